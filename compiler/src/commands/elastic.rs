//! `--elastic`: a run that carries on when a worker is lost.
//!
//! After every step each worker keeps a copy of what it holds in memory (its ZeRO
//! chunks, model-axis parts, whole variables and their slots; worker 0 adds the
//! servers' rows), replacing the last; nothing is gathered, written or read
//! ([`StateSlot`]). When a worker is lost (its thread fails, or `--fail-worker`
//! rehearses that), its memory goes with it and the others stop at the error; the plan
//! is compiled again from its model for one replica fewer (the data axis shrinks; a
//! replica of P pipeline stages on a model axis of T loses its P x T workers; servers
//! are kept), and training resumes from the newest state the survivors can put together:
//! from their memory alone where they hold every piece, else with what only the lost
//! worker held (its ZeRO chunks) read from the last sharded state on disk. Its
//! variables, optimizer state, step and data position are resharded for the new layout
//! as `--resume` reshards a state file. The first step line after the restart carries
//! a `restart` object (the step lost, the step resumed from, the cause, workers before
//! and after, the shards read, seconds of recovery and of training undone).
//!
//! The restarted run trains what a run resumed from that state with the smaller plan
//! trains, bit for bit (`compiler/tests/checkpoint_cli.rs`).

use super::restart::{Loss, Restarts};
use crate::cli::RunArgs;
use crate::console::err;
use crate::driver::{retarget, Target};
use crate::Plan;
use anyhow::{bail, Result};
use distc_runtime::core::shards::Layout;
use distc_runtime::run::launch::{launch, Launch};
use distc_runtime::run::metrics::StepMetrics;
use distc_runtime::run::snapshot::StateSlot;
use distc_runtime::run::train::TrainReport;
use distc_runtime::RuntimeError;
use std::time::Instant;

/// The step `e` lost a worker at, where it says.
fn lost_at(e: &RuntimeError) -> Option<usize> {
    match e.cause() {
        RuntimeError::WorkerLost { step, .. } => Some(*step),
        _ => None,
    }
}

/// Trains `first` (the plan `plan`'s run, as the flags made it), restarting with one
/// replica fewer each time a worker is lost, at most `--max-restarts` times and never
/// below `--min-workers`.
pub(super) fn launch_elastic(
    plan: &Plan,
    first: Launch<'_>,
    args: &RunArgs,
    on_step: &mut dyn FnMut(&StepMetrics) -> distc_runtime::Result<()>,
) -> Result<Option<TrainReport>> {
    let settings = &plan.settings;
    if settings.data_workers() < 2 {
        bail!(
            "--elastic: the plan has one replica; compile it with --workers N (N >= 2 \
             replicas) for a run that can lose one"
        );
    }
    // Issue 60, item 9: a floor the run starts below could never have been meant.
    if args.min_workers > settings.workers {
        bail!(
            "--elastic --min-workers {}: the plan has {} workers, so the run would stop at \
             its first loss before losing any; give at most {}",
            args.min_workers,
            settings.workers,
            settings.workers
        );
    }
    let sharded_dir = first
        .opts
        .checkpoint
        .as_ref()
        .filter(|c| c.sharded)
        .map(|c| c.path.clone());
    let layout = |programs: &distc_runtime::run::train::Programs<'_>| {
        Layout::of(programs.finalize).map_err(|m| anyhow::anyhow!("--elastic: {m}"))
    };
    if let (Some(var), None) = (layout(&first.programs)?.split_over_data(), &sharded_dir) {
        bail!(
            "--elastic: under ZeRO each worker holds a chunk of `{var}` no other worker \
             holds, so a lost worker's chunks can only come back from disk: add \
             --checkpoint DIR --sharded (with --checkpoint-every K; the run goes back to \
             the last state written)"
        );
    }
    let slot = StateSlot::new(format!(
        "{} with {} workers (elastic)",
        plan.strategy.name(),
        settings.workers
    ));
    // A replica: a model axis's T workers on each of P pipeline stages.
    let replica = settings.model.max(1) * settings.pipeline.max(1);
    let (config, device, transport) = (first.config, first.device.clone(), first.transport.clone());
    let mut opts = first.opts.clone();
    opts.snapshot = Some(slot.clone());
    let mut workers = settings.workers;
    let mut restarts = Restarts::new(args.max_restarts, args.min_workers, replica);
    // Each attempt's own plan once one was compiled again (the first runs the given).
    let mut recompiled: Option<crate::Compiled> = None;
    loop {
        let (programs, rows_touched) = match &recompiled {
            Some(c) => (
                crate::driver::program_view(&c.programs, workers),
                crate::verify::rows_touched(c.dist.as_ref()),
            ),
            None => (first.programs, first.rows_touched.clone()),
        };
        slot.begin(layout(&programs)?);
        let run = Launch {
            programs,
            config,
            opts: opts.clone(),
            device: device.clone(),
            transport: transport.clone(),
            rows_touched,
        };
        restarts.attempt();
        let mut report_line = |m: &StepMetrics| {
            let mut m = m.clone();
            if let Some(restart) = restarts.line(m.step, m.compute_sec + m.comm_wait_sec) {
                m.restart = Some(restart);
            }
            on_step(&m)
        };
        let result = launch(&run, &mut report_line);
        let e = match result {
            Ok(report) => return Ok(report),
            Err(e) if RuntimeError::lost_a_rank(&e) => e,
            Err(e) => return Err(e.into()),
        };
        let seen = Instant::now();
        let after = workers.saturating_sub(replica);
        if let Some(why) = restarts.refusal(after) {
            bail!("{e}\n--elastic: {why}");
        }
        if let Some(c) = &opts.checkpoint {
            // The lost worker's shard of the last state is read below, once written.
            c.abandon_pending();
        }
        // No state kept to put together (under ZeRO before the first sharded state is
        // written): the attempt starts again from where it started.
        let restored = slot.restore(sharded_dir.as_deref()).unwrap_or_else(|m| {
            if !args.quiet {
                err(&format!("{m}; going back to where the run started\n"));
            }
            None
        });
        let shards_read = restored.as_ref().map_or(0, |r| r.files_read.len());
        let state = restored.map(|r| r.state).or_else(|| opts.resume.clone());
        let resumed_from = state.as_ref().map_or(0, |s| s.index.step as usize);
        let loss = Loss {
            lost_at_step: lost_at(&e).unwrap_or(resumed_from + 1),
            resumed_from_step: resumed_from,
            cause: e.to_string(),
            workers_before: workers,
            workers_after: after,
            shards_read,
        };
        if !args.quiet {
            err(&format!(
                "{e}\n--elastic: restarting from step {resumed_from} with {after} workers \
                 (was {workers})\n"
            ));
        }
        let target = Target {
            workers: Some(after),
            ranks_per_node: None,
            servers: None,
            inter: None,
            intra: None,
            data_dir: args.data.clone(),
        };
        let (compiled, _) = retarget(plan, &target)
            .map_err(|m| anyhow::anyhow!("{e}\n--elastic: compiling for {after} workers: {m}"))?;
        recompiled = Some(compiled);
        workers = after;
        opts.resume = state;
        // The rehearsed failure happened: the restarted run keeps its workers.
        opts.fail = None;
        restarts.restart(loss, seen);
    }
}
