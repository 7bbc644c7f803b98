//! A pipelined plan's stages as MPI ranks: `mpirun -np P*R` for P stages and R
//! replicas, rank w is stage w % P of replica w / P, as the threads of
//! [`crate::run::pipeline`] are.
//!
//! The world is split twice: by replica (a stage's rank there is its stage), over which
//! activations go forward and their gradients back; and by stage (a replica's rank there
//! is its replica), over which a stage's gradients are averaged among its replicas. Each
//! rank runs the stage loop the threads run. Rank 0 runs its stage on a thread and joins
//! every rank's step reports into the metrics lines; after the last step, when tracing,
//! every rank sends it its spans. Rank 0 is worker 0: its stage gathers the whole
//! model's variables over the pipe axis, writes the whole states and evaluates, as the
//! threads' worker 0 does.
//!
//! Every wait is bounded by `--timeout`: a neighbour that does not send or receive is
//! named by the waiting rank (the label says which stage, step, micro-batch and message),
//! a report rank 0 does not take, by its sender.

use super::reports::{drain_on_rank0, ToRank0};
use super::{gather_spans, local_line, rank_metrics, send_spans};
use crate::comm::mpi::Comm;
use crate::comm::Links;
use crate::core::backend::Backend;
use crate::core::backend::Site;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::run::coordinator::{combine, reporter, Coordinator, StageReports};
use crate::run::mesh::Mesh;
use crate::run::metrics::StepMetrics;
use crate::run::metrics::StepReport;
use crate::run::metrics::TrainReport;
use crate::run::options::{MpiRun, TrainOptions};
use crate::run::pipeline::PipelineRun;
use crate::run::programs::Programs;
use mpi::topology::SimpleCommunicator;
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
    let run = PipelineRun::new(&programs, mesh, config, opts)?;
    // The world split by each axis the mesh links: the pipe axis links one model
    // rank's stages of a replica, the data axis the replicas of one stage's model rank,
    // the model axis one stage's model ranks of a replica.
    let comms = super::link_axes(&mesh, rank, world, ctl, opts.timeout)?;
    let data = run.sources(config, opts, rank)?;
    let mut me = run.stage(rank, comms, data, (config, opts), t0)?;
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
        let outcome = me.run_on(make, config, &mut |rep| {
            write_local(&rep)?;
            to_rank0.send(ctl, rep.step, &rep)
        })?;
        return send_spans(ctl, rank, outcome.spans, opts, mpi_run);
    }
    // Rank 0: its stage on a thread, the coordinator here.
    let workers = run.workers();
    let mut coordinator = Coordinator::of_pipeline(&run, on_step);
    run.clear_later_states()?;
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
        &mut |rep| reports.add(rep, workers, &mut coordinator),
    )?;
    let mut spans = outcome.spans;
    gather_spans(ctl, workers, opts, mpi_run, "stage 0", &mut spans)?;
    Ok(Some(coordinator.finish(outcome.params, None, spans)))
}
