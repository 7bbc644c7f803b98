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

/// The slice spans of a Chrome trace [`chrome_trace`] wrote, each on its track: what
/// `distc simulate --trace` reads back. Counter events are left out.
pub fn spans_of_chrome_trace(text: &str) -> Result<Vec<Span>, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not a trace (JSON): {e}"))?;
    let events = v
        .get("traceEvents")
        .and_then(|e| e.as_array())
        .or_else(|| v.as_array())
        .ok_or("not a Chrome trace: no traceEvents")?;
    let phase = |e: &serde_json::Value| e.get("ph").and_then(|p| p.as_str()).map(str::to_owned);
    let tracks: std::collections::HashMap<u64, String> = events
        .iter()
        .filter(|e| phase(e).as_deref() == Some("M"))
        .filter_map(|e| {
            let tid = e.get("tid")?.as_u64()?;
            Some((tid, e.pointer("/args/name")?.as_str()?.to_string()))
        })
        .collect();
    Ok(events
        .iter()
        .filter(|e| phase(e).as_deref() == Some("X"))
        .map(|e| Span {
            track: e
                .get("tid")
                .and_then(|t| t.as_u64())
                .and_then(|t| tracks.get(&t))
                .cloned()
                .unwrap_or_default(),
            name: e.get("name").and_then(|n| n.as_str()).unwrap_or("").into(),
            node: e
                .pointer("/args/node")
                .and_then(|n| n.as_str())
                .map(Into::into),
            step: e
                .pointer("/args/step")
                .and_then(|s| s.as_u64())
                .unwrap_or(0),
            bytes: e.pointer("/args/bytes").and_then(|b| b.as_u64()),
            start_us: e.get("ts").and_then(|t| t.as_f64()).unwrap_or(0.0),
            dur_us: e.get("dur").and_then(|t| t.as_f64()).unwrap_or(0.0),
            counters: Vec::new(),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chrome_trace_reads_back_as_the_spans_it_was_written_from() {
        let span = |track: &str, name: &str, node: Option<&str>, bytes: Option<u64>| Span {
            track: track.into(),
            name: name.into(),
            node: node.map(Into::into),
            step: 3,
            bytes,
            start_us: 12.5,
            dur_us: 4.25,
            counters: Vec::new(),
        };
        let slices = vec![
            span("worker 0", "matmul", Some("%7"), None),
            span("worker 0 comm", "all_reduce %9", Some("%9"), Some(4096)),
            span("worker 1", "step 3", None, None),
        ];
        let mut all = slices.clone();
        all.push(Span {
            counters: vec![("activations".into(), 64)],
            ..span("worker 0 memory", "memory", None, None)
        });
        let text = chrome_trace(&all).to_string();
        let back = spans_of_chrome_trace(&text).expect("a trace");
        let key = |s: &Span| {
            (
                s.track.clone(),
                s.name.clone(),
                s.node.clone(),
                s.bytes,
                s.step,
            )
        };
        assert_eq!(
            back.iter().map(key).collect::<Vec<_>>(),
            slices.iter().map(key).collect::<Vec<_>>()
        );
        assert!(back.iter().all(|s| s.start_us == 12.5 && s.dur_us == 4.25));
        assert!(spans_of_chrome_trace("{}").is_err());
    }
}
