//! Trace spans and their Chrome trace (Perfetto) form.
//!
//! Tracks: `worker R` (a `step N` span per step holding `forward`, `backward` and
//! `update`, one span per IR node run, and `wait %N` where the worker blocked on a
//! collective's result), `worker R comm` (the collectives its communication thread
//! ran, with the bytes each sent), `server S` (each pull and push the server handled
//! and each update it applied). Times are microseconds since the run's start (under
//! MPI, since the start-up barrier every rank leaves together), so the spans of every
//! rank merge into one file.

use distc_ir::{Graph, NodeId};
use serde::{Deserialize, Serialize};

/// The longest span a trace may hold, in microseconds (about 11.6 days). No span of a
/// run lasts longer, and below it sums of spans stay far from overflowing; a longer
/// one (or a negative, infinite or NaN one) is a damaged file.
pub const MAX_SPAN_US: f64 = 1e12;

/// A node's input and output types as the text IR spells them,
/// `f32[16,128], f32[128,512] -> f32[16,512]`: what a trace records of each node span
/// so that a reader can tell whose program it is.
pub fn node_types(g: &Graph, id: NodeId) -> String {
    let n = g.node(id);
    let list = |types: Vec<String>| types.join(", ");
    format!(
        "{} -> {}",
        list(
            n.inputs
                .iter()
                .map(|v| g.value_type(*v).to_string())
                .collect()
        ),
        list(n.outputs.iter().map(ToString::to_string).collect())
    )
}

/// One span of a trace: who, what, when.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Span {
    /// "worker 0", "worker 0 comm", "server 1".
    pub track: String,
    /// Op or collective name.
    pub name: String,
    /// IR node (`%12`), when the span is a node.
    pub node: Option<String>,
    /// The node's input and output types ([`node_types`]), when the span is a node's:
    /// node ids and op names repeat between models, so these are what tell a trace of
    /// this program from a trace of another (`distc simulate --trace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub types: Option<String>,
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
    /// An op timed on the device between two events on its stream: the kernels' time.
    /// Otherwise the host's clock timed it (on a GPU: the launches).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub on_device: bool,
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
                "args": {"node": s.node, "types": s.types, "step": s.step, "bytes": s.bytes,
                         "clock": if s.on_device { "device" } else { "host" }},
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
/// `distc simulate --trace` reads back. Counter events are left out. A slice whose
/// start or duration is not a number, or whose duration is negative or longer than
/// [`MAX_SPAN_US`], is refused, naming the event: the times are what a reader sums.
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
    let mut spans = Vec::new();
    for (i, e) in events.iter().enumerate() {
        if phase(e).as_deref() != Some("X") {
            continue;
        }
        let name: String = e.get("name").and_then(|n| n.as_str()).unwrap_or("").into();
        let node: Option<String> = e
            .pointer("/args/node")
            .and_then(|n| n.as_str())
            .map(Into::into);
        let step = e
            .pointer("/args/step")
            .and_then(|s| s.as_u64())
            .unwrap_or(0);
        // `traceEvents[7]` (`matmul` of %3, step 2): ..., the event as a reader finds it.
        let at = || {
            let of = node
                .as_ref()
                .map(|n| format!(" of {n}"))
                .unwrap_or_default();
            format!("traceEvents[{i}] (`{name}`{of}, step {step})")
        };
        let time = |field: &str| -> Result<f64, String> {
            match e.get(field) {
                None => Ok(0.0),
                Some(x) => match x.as_f64() {
                    Some(t) if t.is_finite() => Ok(t),
                    _ => Err(format!("{}: `{field}` {x} is not a number", at())),
                },
            }
        };
        let start_us = time("ts")?;
        let dur_us = time("dur")?;
        if !(0.0..=MAX_SPAN_US).contains(&dur_us) {
            return Err(format!(
                "{}: `dur` {dur_us:?} is not a duration: give 0 to {MAX_SPAN_US:e} microseconds",
                at()
            ));
        }
        spans.push(Span {
            track: e
                .get("tid")
                .and_then(|t| t.as_u64())
                .and_then(|t| tracks.get(&t))
                .cloned()
                .unwrap_or_default(),
            types: e
                .pointer("/args/types")
                .and_then(|n| n.as_str())
                .map(Into::into),
            name,
            node,
            step,
            bytes: e.pointer("/args/bytes").and_then(|b| b.as_u64()),
            start_us,
            dur_us,
            counters: Vec::new(),
            on_device: e.pointer("/args/clock").and_then(|c| c.as_str()) == Some("device"),
        });
    }
    Ok(spans)
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
            types: node.map(|_| "f32[2,3], f32[3,4] -> f32[2,4]".into()),
            step: 3,
            bytes,
            start_us: 12.5,
            dur_us: 4.25,
            counters: Vec::new(),
            on_device: false,
        };
        let slices = vec![
            Span {
                on_device: true,
                ..span("worker 0", "matmul", Some("%7"), None)
            },
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
                s.types.clone(),
                s.bytes,
                s.step,
                s.on_device,
            )
        };
        assert_eq!(
            back.iter().map(key).collect::<Vec<_>>(),
            slices.iter().map(key).collect::<Vec<_>>()
        );
        assert!(back.iter().all(|s| s.start_us == 12.5 && s.dur_us == 4.25));
        assert!(spans_of_chrome_trace("{}").is_err());
    }

    #[test]
    fn a_slice_whose_duration_is_negative_huge_or_not_a_number_is_refused_by_its_event() {
        let event = |dur: &str| {
            format!(
                r#"{{"traceEvents": [{{"ph": "X", "tid": 0, "name": "matmul", "ts": 1,
                   "dur": {dur}, "args": {{"node": "%7", "step": 2}}}}]}}"#
            )
        };
        assert!(spans_of_chrome_trace(&event("0")).is_ok());
        for (dur, want) in [
            ("-5", "`dur` -5.0 is not a duration"),
            ("1e308", "`dur` 1e308 is not a duration"),
            ("\"5\"", "`dur` \"5\" is not a number"),
        ] {
            let e = spans_of_chrome_trace(&event(dur)).expect_err(dur);
            assert!(e.contains(want), "{e}");
            assert!(e.contains("traceEvents[0] (`matmul` of %7, step 2)"), "{e}");
        }
    }
}
