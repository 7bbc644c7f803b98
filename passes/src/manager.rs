//! Runs a list of passes with the verifier after each, reporting what each did.
//!
//! The caller sees the graph after every pass (for `--dump-ir`) and, when a pass fails
//! or leaves an invalid graph, gets the last good graph back to write out.

use crate::{Pass, PassCx, PassStats};
use distc_ir::{verify, Graph};
use std::time::{Duration, Instant};
use thiserror::Error;

/// What one pass did.
#[derive(Clone, Debug)]
pub struct PassRecord {
    /// The pass's name.
    pub name: String,
    /// Its counters.
    pub stats: PassStats,
    /// Wall time of the pass itself.
    pub time: Duration,
    /// Wall time of the verifier after it.
    pub verify: Duration,
    /// Nodes before and after.
    pub nodes: (usize, usize),
}

/// One line for the user: name, nodes before and after, wall time of the pass and of
/// the verifier after it in milliseconds, counters.
impl std::fmt::Display for PassRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<18} {:>6} -> {:>6} nodes {:>8.1} ms (verify {:>6.1} ms)  {}",
            self.name,
            self.nodes.0,
            self.nodes.1,
            self.time.as_secs_f64() * 1e3,
            self.verify.as_secs_f64() * 1e3,
            self.stats
        )
    }
}

/// A pass failed or broke an invariant; `last_good` is the graph before it.
#[derive(Debug, Error)]
#[error("after pass {pass}: {message}")]
pub struct PipelineError {
    /// The failing pass.
    pub pass: String,
    /// What went wrong (all verifier errors, one per line).
    pub message: String,
    /// The graph before the failing pass.
    pub last_good: Box<Graph>,
}

/// Runs `passes` in order on `g`, verifying after each. `after` sees the graph after
/// each pass that ran; `stop_after` ends the pipeline after the named pass.
pub fn run_pipeline(
    g: &mut Graph,
    passes: &[Box<dyn Pass>],
    cx: &mut PassCx,
    stop_after: Option<&str>,
    mut after: impl FnMut(&str, &Graph),
) -> Result<Vec<PassRecord>, PipelineError> {
    let mut records = Vec::new();
    for pass in passes {
        let name = pass.name();
        if cx.disabled.contains(&name) {
            continue;
        }
        // Kept for the error only: one copy per pass, linear in the graph.
        let before = g.clone();
        let start = Instant::now();
        let nodes_before = g.node_count();
        let stats = match pass.run(g, cx) {
            Ok(stats) => stats,
            Err(e) => {
                return Err(PipelineError {
                    pass: name,
                    message: e.to_string(),
                    last_good: Box::new(before),
                })
            }
        };
        let time = start.elapsed();
        let checked = Instant::now();
        let verified = verify(g);
        let verify_time = checked.elapsed();
        if let Err(e) = verified {
            return Err(PipelineError {
                pass: name,
                message: e.to_string(),
                last_good: Box::new(before),
            });
        }
        after(&name, g);
        records.push(PassRecord {
            name: name.clone(),
            stats,
            time,
            verify: verify_time,
            nodes: (nodes_before, g.node_count()),
        });
        if stop_after == Some(name.as_str()) {
            break;
        }
    }
    Ok(records)
}
