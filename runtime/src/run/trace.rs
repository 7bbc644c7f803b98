//! Trace spans and their Chrome trace (Perfetto) form.
//!
//! Tracks: `worker R` (a `step N` span per step holding `forward`, `backward` and
//! `update`, one span per IR node run, and `wait %N` where the worker blocked on a
//! collective's result), `worker R comm` (the collectives its communication thread
//! ran, with the bytes each sent), `server S` (each pull and push the server handled
//! and each update it applied). Times are microseconds since the run's start (under
//! MPI, since the start-up barrier every rank leaves together), so the spans of every
//! rank merge into one file.

use serde::{Deserialize, Serialize};

/// One span of a trace: who, what, when.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Span {
    /// "worker 0", "worker 0 comm", "server 1".
    pub track: String,
    /// Op or collective name.
    pub name: String,
    /// IR node (`%12`), when the span is a node.
    pub node: Option<String>,
    /// Training step.
    pub step: u64,
    /// Bytes sent, for a collective.
    pub bytes: Option<u64>,
    /// Start, microseconds.
    pub start_us: f64,
    /// Duration, microseconds.
    pub dur_us: f64,
    /// Values of a counter track at `start_us` (memory by category, bytes); such a span
    /// is drawn as counters, not as a slice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub counters: Vec<(String, u64)>,
}

/// The spans as a Chrome trace (JSON; loads in Perfetto and chrome://tracing).
pub fn chrome_trace(spans: &[Span]) -> serde_json::Value {
    let mut tracks: Vec<&str> = spans.iter().map(|s| s.track.as_str()).collect();
    tracks.sort();
    tracks.dedup();
    let tid = |t: &str| tracks.iter().position(|x| *x == t).unwrap_or(0);
    let mut events: Vec<serde_json::Value> = tracks
        .iter()
        .enumerate()
        .map(|(i, t)| serde_json::json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": t}}))
        .collect();
    events.extend(spans.iter().map(|s| {
        if s.counters.is_empty() {
            serde_json::json!({
                "ph": "X", "pid": 1, "tid": tid(&s.track), "name": s.name,
                "ts": s.start_us, "dur": s.dur_us,
                "args": {"node": s.node, "step": s.step, "bytes": s.bytes},
            })
        } else {
            let args: serde_json::Map<String, serde_json::Value> = s
                .counters
                .iter()
                .map(|(k, v)| (k.clone(), (*v).into()))
                .collect();
            serde_json::json!({
                "ph": "C", "pid": 1, "tid": tid(&s.track), "name": s.name,
                "ts": s.start_us, "args": args,
            })
        }
    }));
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
