//! A pipelined plan's stages as MPI ranks: `mpirun -np P*R` for P stages and R
//! replicas, rank w is stage w % P of replica w / P, as the threads of
//! [`crate::run::pipeline`] are.
//!
//! The world is split twice: by replica (a stage's rank there is its stage), over which
//! activations go forward and their gradients back; and by stage (a replica's rank there
//! is its replica), over which a stage's gradients are averaged among its replicas. Each
//! rank runs the stage loop the threads run. Rank 0 runs its stage on a thread and joins
//! every rank's step reports into the metrics lines; after the last step, replica 0's
//! stages send it their variables, and, when tracing, every rank its spans.
//!
//! Every wait is bounded by `--timeout`: a neighbour that does not send or receive is
//! named by the waiting rank (the label says which stage, step, micro-batch and message),
//! a report or variables rank 0 does not take, by their sender.

use super::reports::{drain_on_rank0, ToRank0};
use super::{gather_spans, local_line, rank_metrics, send_spans};
use crate::comm::mpi::{Backoff, Comm, Outgoing, Since, TAG_PARAMS};
use crate::comm::Links;
use crate::core::backend::Backend;
use crate::core::backend::Site;
use crate::core::config::RunConfig;
use crate::core::error::{PeerKind, Result, RuntimeError};
use crate::core::value::Tensor;
use crate::run::coordinator::{combine, reporter, Coordinator, StageReports};
use crate::run::eval::Evaluated;
use crate::run::mesh::{Coord, Mesh};
use crate::run::metrics::StepMetrics;
use crate::run::metrics::StepReport;
use crate::run::metrics::TrainReport;
use crate::run::options::{MpiRun, TrainOptions};
use crate::run::pipeline::{decode_params, encode_params, Handed, PipelineRun};
use crate::run::programs::Programs;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::collections::HashMap;
use std::io::Write;
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// Runs this rank's stage of a pipelined plan; rank 0 returns the run's report.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_stage_rank<B: Backend>(
    programs: Programs<'_>,
    mesh: Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
    world: &SimpleCommunicator,
    rank: usize,
    ctl: &Arc<Comm>,
    t0: Instant,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: &(dyn Fn(Site<'_>, Links<'_>) -> Result<B> + Sync),
) -> Result<Option<TrainReport>> {
    let stages = mesh.pipe;
    let run = PipelineRun::new(&programs, mesh, config, opts)?;
    let (replica, _, m) = run.coordinates(rank);
    // The world split by each axis the mesh links: the pipe axis links one model
    // rank's stages of a replica, the data axis the replicas of one stage's model rank,
    // the model axis one stage's model ranks of a replica.
    let comms = super::link_axes(&mesh, rank, world, ctl, opts.timeout)?;
    let data = run.sources(config, opts, rank)?;
    let mut me = run.stage(rank, comms, data, opts, t0)?;
    let name = mesh.name(rank);
    let last_step = run.steps;
    let micro_batch = config.batch;
    let mut local = rank_metrics(mpi_run, rank)?;
    // This rank's own line: its stage's step (a micro-batch's samples per step's second).
    let mut write_local = move |rep: &StepReport| -> Result<()> {
        let Some(w) = local.as_mut() else {
            return Ok(());
        };
        let step = rep.step;
        let line = local_line(&combine(step, std::slice::from_ref(rep)), micro_batch);
        let text = serde_json::to_string(&line)
            .map_err(|e| RuntimeError::internal("the metrics", e.to_string()))?;
        writeln!(w, "{text}").map_err(|source| RuntimeError::Io {
            path: "metrics".into(),
            source,
        })?;
        if step == last_step {
            let _ = w.flush();
        }
        Ok(())
    };
    if rank != 0 {
        let mut to_rank0 = ToRank0::new(rank, &mesh, last_step, opts.timeout);
        let outcome = me.run_on(make, config, &mut |mut rep| {
            write_local(&rep)?;
            // An evaluation's or a checkpoint's variables go first, then a checkpoint's
            // optimizer state: rank 0 takes them in that order when the step is complete.
            let ahead = [rep.params.take(), rep.slots.take()]
                .into_iter()
                .flatten()
                .map(|carried| (TAG_PARAMS, encode_params(carried)))
                .collect();
            to_rank0.send(ctl, rep.step, ahead, &rep)
        })?;
        if replica == 0 && m == 0 {
            let mut out =
                Outgoing::start(&ctl.0, 0, TAG_PARAMS, encode_params(outcome.params), true);
            if !out.wait_for(opts.timeout) {
                return Err(RuntimeError::Peer {
                    rank,
                    peer: 0,
                    op: "trained variables".into(),
                    kind: PeerKind::TimedOut,
                    message: format!(
                        "rank 0 did not take the trained variables of {name} within {:.0} s \
                         (--timeout)",
                        opts.timeout.as_secs_f64()
                    ),
                });
            }
        }
        return send_spans(ctl, rank, outcome.spans, opts, mpi_run);
    }
    // Rank 0: its stage on a thread, the coordinator here.
    let workers = run.workers();
    let mut coordinator = Coordinator::of_pipeline(&run, on_step);
    let mut evaluator = run.evaluator(config, opts, make)?;
    run.clear_later_states()?;
    // At an evaluation or a checkpoint, replica 0's other stages send their variables,
    // and at a checkpoint their optimizer state after them.
    let mut take_state = |step: usize, mut handed: Handed| -> Result<Evaluated> {
        let due = run.due_at(step);
        if due.eval || due.writes_whole() {
            for from in 1..stages {
                handed
                    .params
                    .extend(receive_params(ctl, &run, from, opts, step)?);
                if due.writes_whole() {
                    handed
                        .slots
                        .extend(receive_params(ctl, &run, from, opts, step)?);
                }
            }
        }
        run.take_state(step, handed, &mut evaluator)
    };
    let stage = |tx: mpsc::Sender<StepReport>| {
        let mut to_coordinator = reporter(tx);
        me.run_on(make, config, &mut |rep| {
            write_local(&rep)?;
            to_coordinator(rep)
        })
    };
    let mut reports = StageReports::default();
    let outcome = drain_on_rank0(
        "stage-0-replica-0",
        &run.mesh,
        ctl,
        (run.steps_to_run(), run.first - 1),
        opts.timeout,
        stage,
        &mut |rep| reports.add(rep, workers, &mut coordinator, &mut take_state),
    )?;
    let mut params = outcome.params;
    // Replica 0's other stages' trained variables.
    for from in 1..stages {
        params.extend(receive_params(ctl, &run, from, opts, run.steps)?);
    }
    let mut spans = outcome.spans;
    gather_spans(ctl, workers, opts, mpi_run, "stage 0", &mut spans)?;
    Ok(Some(coordinator.finish(
        run.with_carried(params),
        None,
        spans,
    )))
}

/// The variables stage `stage` of replica 0 (its model rank 0) sends after `step`,
/// waiting at most the timeout.
fn receive_params(
    ctl: &Comm,
    run: &PipelineRun<'_>,
    stage: usize,
    opts: &TrainOptions,
    step: usize,
) -> Result<HashMap<String, Tensor>> {
    let from = run.mesh.worker(Coord {
        replica: 0,
        stage,
        model: 0,
    });
    let since = Since::now();
    let mut backoff = Backoff(0);
    let bytes = loop {
        let p = ctl.0.process_at_rank(from as i32);
        if let Some((msg, st)) = p.immediate_matched_probe_with_tag(TAG_PARAMS) {
            break (msg, st).matched_receive_vec::<u8>().0;
        }
        if since.waited() >= opts.timeout {
            return Err(RuntimeError::Peer {
                rank: 0,
                peer: from,
                op: "variables".into(),
                kind: PeerKind::TimedOut,
                message: format!(
                    "rank {from} ({}) did not send its variables of step {step} within {:.0} s \
                     (--timeout)",
                    run.mesh.name(from),
                    opts.timeout.as_secs_f64()
                ),
            });
        }
        backoff.wait();
    };
    decode_params(&bytes).map_err(|e| RuntimeError::Peer {
        rank: 0,
        peer: from,
        op: "variables".into(),
        kind: PeerKind::Malformed,
        message: format!("rank {from}'s variables: {e}"),
    })
}
