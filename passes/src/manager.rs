//! Runs a list of passes over the program set with the verifier after each, reporting
//! what each did.
//!
//! Every program of the set (worker, servers, init, final) is verified after every
//! pass. The caller sees the set after every pass (for `--dump-ir`) and, when a pass
//! fails or leaves an invalid program, gets the last good set back to write out.

use crate::{Pass, PassCx, PassStats, ProgramRole, ProgramSet, Verify};
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
    /// Wall time of the verifier after it (every program).
    pub verify: Duration,
    /// Nodes of the worker program before and after.
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

/// A pass failed or broke an invariant; `last_good` is the program set before it.
#[derive(Debug, Error)]
#[error("after pass {pass}: {message}")]
pub struct PipelineError {
    /// The failing pass.
    pub pass: String,
    /// What went wrong (all verifier errors, one per line, each naming its program).
    pub message: String,
    /// The programs that did not verify (empty when the pass itself failed).
    pub programs: Vec<ProgramRole>,
    /// The program set before the failing pass.
    pub last_good: Box<ProgramSet>,
}

/// Runs `passes` in order on the program set `p`, verifying every program after each
/// (or once at the end: `cx.verify`). `after` sees the set after each pass that ran;
/// `stop_after` ends the pipeline after the named pass.
pub fn run_pipeline(
    p: &mut ProgramSet,
    passes: &[Box<dyn Pass>],
    cx: &mut PassCx,
    stop_after: Option<&str>,
    mut after: impl FnMut(&str, &ProgramSet),
) -> Result<Vec<PassRecord>, PipelineError> {
    let each = cx.verify == Verify::EveryPass;
    let mut records = Vec::new();
    for pass in passes {
        let name = pass.name();
        if cx.disabled.contains(&name) {
            continue;
        }
        // Kept for the error only: one copy per pass, linear in the graph.
        let before = each.then(|| p.clone());
        let start = Instant::now();
        let nodes_before = p.worker.node_count();
        p.worker_notes.clear();
        let stats = pass.run_programs(p, cx).map_err(|e| PipelineError {
            pass: name.clone(),
            message: e.to_string(),
            programs: Vec::new(),
            last_good: Box::new(before.clone().unwrap_or_else(|| p.clone())),
        })?;
        let time = start.elapsed();
        let checked = Instant::now();
        if let Some(before) = before {
            verified(p, &name, move || before)?;
        }
        let verify_time = checked.elapsed();
        after(&name, p);
        records.push(PassRecord {
            name: name.clone(),
            stats,
            time,
            verify: verify_time,
            nodes: (nodes_before, p.worker.node_count()),
        });
        if stop_after == Some(name.as_str()) {
            break;
        }
    }
    if !each {
        let start = Instant::now();
        let last = records
            .last()
            .map_or_else(|| "lower".to_string(), |r| r.name.clone());
        verified(p, &last, || p.clone())?;
        if let Some(r) = records.last_mut() {
            r.verify = start.elapsed();
        }
    }
    Ok(records)
}

/// `p` verified, or the error naming `pass` with `last_good`.
fn verified(
    p: &ProgramSet,
    pass: &str,
    last_good: impl FnOnce() -> ProgramSet,
) -> Result<(), PipelineError> {
    p.verify().map_err(|e| PipelineError {
        pass: pass.to_string(),
        message: e.to_string(),
        programs: e.programs(),
        last_good: Box::new(last_good()),
    })
}
