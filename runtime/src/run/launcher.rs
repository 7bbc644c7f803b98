//! The one launcher (Horovod's controller): what a plan's worker ranks run is decided
//! once, here ([`Training`]: workers running the SPMD program, or a pipeline's
//! stages), and a [`Transport`] (threads of this process, or MPI ranks) runs this
//! process's share of them. A transport spawns the roles, links each axis of the mesh,
//! carries the step reports to rank 0's coordinator and gathers the spans there; the
//! data, the coordinator, the roles and the run's report are made here, once for both.

use crate::comm::{AxisComms, Links};
use crate::core::backend::{Backend, Site};
use crate::core::config::RunConfig;
use crate::core::error::Result;
use crate::core::roles::Role;
use crate::ps::{self, PsClient, PsConfig, ShardSpec};
use crate::run::coordinator::{combine, metrics_line, Coordinator, StageReports};
use crate::run::data::{open_data, DataSource};
use crate::run::mesh::Mesh;
use crate::run::metrics::{StepMetrics, StepReport, TrainReport};
use crate::run::options::TrainOptions;
use crate::run::pipeline::{PipelineRun, Stage};
use crate::run::programs::{micro_batches, pulled_types, server_shards, Programs};
use crate::run::trace::Span;
use crate::run::trainer::ErrorSlot;
use crate::run::worker::{run_worker_on, WorkerOutcome, WorkerSetup};
use distc_ir::TensorType;
use std::collections::HashMap;
use std::time::Instant;

/// What a plan's worker ranks run, decided once from its mesh.
pub(crate) enum Training<'a> {
    /// Workers running the SPMD worker program (data parallel, ZeRO, a model axis,
    /// parameter servers).
    Workers {
        programs: Programs<'a>,
        mesh: Mesh,
        /// Each server's shards of the variables it holds (none without servers).
        server_shards: Vec<Vec<ShardSpec>>,
        /// The whole type of each variable the servers hold, to assemble their shards.
        server_types: HashMap<String, TensorType>,
    },
    /// A pipeline's stages, each walking its schedule.
    Stages(Box<PipelineRun<'a>>),
}

/// One worker's role, made and ready to run on its own thread.
pub(crate) enum Trainee<'t> {
    Worker(Box<WorkerSetup<'t>>),
    Stage(Box<Stage<'t>>),
}

/// A role a transport runs: its worker rank and thread name, and the role itself.
pub(crate) struct LocalRole<'t> {
    pub(crate) worker: usize,
    pub(crate) name: String,
    pub(crate) trainee: Trainee<'t>,
}

/// Where a role's step reports go.
pub(crate) type Report<'r> = &'r mut dyn FnMut(StepReport) -> Result<()>;

/// What makes each role's backend on its thread: `make(site, links)`.
pub(crate) type Make<'m, B> = &'m (dyn Fn(Site<'_>, Links<'_>) -> Result<B> + Sync);

/// What differs between running a plan's ranks as threads of this process and as MPI
/// ranks; the one launcher ([`run_ranks`]) does the rest.
pub(crate) trait Transport {
    /// The worker ranks this process runs, in order: every one, or its own.
    fn local(&self, mesh: &Mesh) -> Vec<usize>;
    /// Each local worker's communicators, one per axis the mesh links
    /// ([`Mesh::axes`]), in the order of [`Transport::local`].
    fn link(&mut self, mesh: &Mesh, opts: &TrainOptions) -> Result<Vec<AxisComms>>;
    /// Worker `w`'s client of the parameter servers, when the plan has any.
    fn servers(&mut self, w: usize) -> Option<PsClient>;
    /// Runs the local roles to their end, each on a thread, `run(worker, role, report)`
    /// running one. Where `coordinator` is given (the process of worker 0), every worker's
    /// reports reach it, the other processes' too. Returns the local roles' outcomes
    /// in order, or the run's error.
    fn run<'t>(
        &mut self,
        roles: Vec<LocalRole<'t>>,
        training: &Training<'_>,
        run: &(dyn Fn(usize, Trainee<'t>, Report<'_>) -> Result<WorkerOutcome> + Sync),
        coordinator: Option<&mut dyn FnMut(StepReport) -> Result<()>>,
        errors: &ErrorSlot,
    ) -> Result<Vec<WorkerOutcome>>;
    /// The run's spans, with the servers' (their times from `t0`), at the process of
    /// worker 0 (`Some`); the other processes send theirs there and get `None`.
    fn gather(
        &mut self,
        spans: Vec<Span>,
        training: &Training<'_>,
        t0: Instant,
    ) -> Result<Option<Vec<Span>>>;
}

impl<'a> Training<'a> {
    /// The one place a launcher asks whether the plan is a pipeline.
    pub(crate) fn new(
        programs: &Programs<'a>,
        mesh: Mesh,
        config: &RunConfig,
        opts: &TrainOptions,
    ) -> Result<Training<'a>> {
        if mesh.pipelined() {
            return Ok(Training::Stages(Box::new(PipelineRun::new(
                programs, mesh, config, opts,
            )?)));
        }
        let shards = server_shards(programs.servers, &pulled_types(programs.worker))?;
        Ok(Training::Workers {
            programs: *programs,
            mesh,
            server_types: ps::check_shards(&shards)?,
            server_shards: shards,
        })
    }

    /// Each server's shards, for a transport that runs the servers itself.
    pub(crate) fn server_shards(&self) -> &[Vec<ShardSpec>] {
        match self {
            Training::Workers { server_shards, .. } => server_shards,
            Training::Stages(_) => &[],
        }
    }

    pub(crate) fn mesh(&self) -> &Mesh {
        match self {
            Training::Workers { mesh, .. } => mesh,
            Training::Stages(run) => &run.mesh,
        }
    }

    /// The reports each worker sends, and the step before its first: a resumed state's.
    pub(crate) fn reported(&self, config: &RunConfig, opts: &TrainOptions) -> (usize, usize) {
        let done = opts.resume.as_ref().map_or(0, |s| s.index.step as usize);
        (opts.last_step(config).saturating_sub(done), done)
    }

    /// Worker `w`'s data: one source per micro-batch, opened as every role's is.
    fn sources(
        &self,
        config: &RunConfig,
        opts: &TrainOptions,
        w: usize,
    ) -> Result<Vec<DataSource>> {
        match self {
            Training::Workers { programs, mesh, .. } => open_data(programs, mesh, config, opts, w),
            Training::Stages(run) => run.sources(config, opts, w),
        }
    }

    /// The coordinator of the run's metrics lines: one per step, from every worker's
    /// reports (a pipeline's stages' joined into one first, see [`Training::joined`]).
    fn coordinator<'c>(
        &self,
        config: &RunConfig,
        opts: &TrainOptions,
        on_step: &'c mut dyn FnMut(&StepMetrics) -> Result<()>,
    ) -> Coordinator<'c> {
        match self {
            Training::Workers { programs, mesh, .. } => {
                let n = mesh.workers();
                let batch = config.batch * micro_batches(programs.worker);
                let mut c = Coordinator::new(n, batch, n > 1 || mesh.servers > 0, on_step);
                c.model_axis = mesh.model;
                c.flops_per_sample = opts.flops_per_sample;
                c.tokens_per_sample = opts.tokens_per_sample;
                c
            }
            Training::Stages(run) => Coordinator::of_pipeline(run, on_step),
        }
    }

    /// What the coordinator takes a report through: a worker's as it is; a stage's
    /// joined with the step's other stages' into one.
    fn joined<'c, 'o>(
        &self,
        coordinator: &'c mut Coordinator<'o>,
    ) -> impl FnMut(StepReport) -> Result<()> + use<'c, 'o> {
        let mut stages = matches!(self, Training::Stages(_)).then(StageReports::default);
        let workers = self.mesh().workers();
        move |r| match stages.as_mut() {
            Some(s) => s.add(r, workers, coordinator),
            None => coordinator.add(r),
        }
    }

    /// A worker's own metrics line from its own report (MPI's per-rank file): a stage's
    /// counts one micro-batch's samples.
    pub(crate) fn local_line(&self, config: &RunConfig, r: &StepReport) -> StepMetrics {
        let joined;
        let own = match self {
            Training::Workers { .. } => r,
            Training::Stages(_) => {
                joined = combine(r.step, std::slice::from_ref(r));
                &joined
            }
        };
        metrics_line(std::slice::from_ref(own), config.batch, false, (None, None))
    }

    /// What worker 0's own trace tracks are named from.
    pub(crate) fn own_tracks(&self) -> &'static str {
        match self {
            Training::Workers { .. } => "worker 0",
            Training::Stages(_) => "stage 0",
        }
    }

    /// Worker `w`'s role, its communicators `comms` and its data `data`.
    #[allow(clippy::too_many_arguments)]
    fn trainee<'t>(
        &'t self,
        w: usize,
        comms: AxisComms,
        data: Vec<DataSource>,
        ps: Option<PsClient>,
        (config, opts): (&'t RunConfig, &'t TrainOptions),
        t0: Instant,
        errors: &ErrorSlot,
    ) -> Result<LocalRole<'t>> {
        let mesh = *self.mesh();
        let c = mesh.coord(w);
        let (name, trainee) = match self {
            Training::Workers { programs, .. } => (
                format!("worker-{w}"),
                Trainee::Worker(Box::new(WorkerSetup {
                    programs: *programs,
                    config,
                    opts,
                    rank: w,
                    mesh,
                    comms,
                    ps,
                    data,
                    t0,
                    errors: errors.clone(),
                })),
            ),
            Training::Stages(run) => (
                format!("stage-{}-replica-{}-model-{}", c.stage, c.replica, c.model),
                Trainee::Stage(Box::new(run.stage(w, comms, data, (config, opts), t0)?)),
            ),
        };
        Ok(LocalRole {
            worker: w,
            name,
            trainee,
        })
    }

    /// The run's report from worker 0's outcome: its variables, and the servers'.
    fn finish(
        &self,
        coordinator: Coordinator<'_>,
        w0: WorkerOutcome,
        spans: Vec<Span>,
    ) -> Result<TrainReport> {
        let mut params = w0.params;
        if let Training::Workers { server_types, .. } = self {
            params.extend(ps::assemble(w0.server_shards, server_types)?);
        }
        Ok(coordinator.finish(params, w0.profile, spans))
    }
}

impl Trainee<'_> {
    /// Runs the role to its end, each step's report to `report`, its kernels on the
    /// backends `make` creates. A failure is recorded in `errors` before its peers see
    /// it hang up.
    pub(crate) fn run<B: Backend>(
        self,
        worker: usize,
        make: Make<'_, B>,
        config: &RunConfig,
        report: Report<'_>,
        errors: &ErrorSlot,
    ) -> Result<WorkerOutcome> {
        match self {
            Trainee::Worker(setup) => {
                let site = Site::of(worker, setup.programs.worker);
                run_worker_on(*setup, report, |links| make(site, links))
            }
            Trainee::Stage(mut stage) => {
                let result = stage.run_on(make, config, report);
                // The cause first: its neighbours fail next, seeing it hang up once the
                // stage (its communicators) is dropped, after this.
                result.map_err(|e| {
                    let copy = e.duplicate();
                    errors.record(Role::Worker(worker), e);
                    copy
                })
            }
        }
    }
}

/// The parameter servers' settings, for threads and MPI ranks alike.
pub(crate) fn server_config(config: &RunConfig, opts: &TrainOptions, workers: usize) -> PsConfig {
    PsConfig {
        workers,
        sync: opts.sync,
        optimizer: config.optimizer.clone(),
        lr_schedule: config.lr_schedule.clone(),
        total_steps: crate::run::steps::lr_horizon(config),
        no_decay: config.no_decay.clone(),
        lazy_updates: config.lazy_updates,
        seed: config.seed,
        resume: opts.resume.clone(),
    }
}

/// The servers' spans as trace spans, their times from `t0`.
pub(crate) fn server_spans(spans: Vec<ps::ServerSpan>, t0: Instant) -> Vec<Span> {
    let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
    spans
        .into_iter()
        .map(|s| Span {
            track: format!("server {}", s.server),
            name: match s.rank {
                Some(r) => format!("{} (worker {r})", s.name),
                None => s.name,
            },
            node: None,
            types: None,
            step: s.step,
            bytes: None,
            start_us: us(s.start),
            dur_us: us(s.end) - us(s.start),
            counters: Vec::new(),
            on_device: false,
        })
        .collect()
}

/// The one launcher: this process's share of the plan's worker ranks, run by
/// `transport`. The process of worker 0 returns the run's report; the others `None`.
pub(crate) fn run_ranks<B: Backend>(
    training: &Training<'_>,
    transport: &mut dyn Transport,
    (config, opts): (&RunConfig, &TrainOptions),
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: Make<'_, B>,
) -> Result<Option<TrainReport>> {
    let mesh = *training.mesh();
    let local = transport.local(&mesh);
    // Data first, so a missing file fails before any role starts.
    let sources = local
        .iter()
        .map(|&w| training.sources(config, opts, w))
        .collect::<Result<Vec<_>>>()?;
    let comms = transport.link(&mesh, opts)?;
    let errors = ErrorSlot::default();
    let t0 = Instant::now();
    let coordinates = local.first() == Some(&0);
    let mut coordinator = coordinates.then(|| training.coordinator(config, opts, on_step));
    let mut roles = Vec::with_capacity(local.len());
    for ((&w, data), comms) in local.iter().zip(sources).zip(comms) {
        let ps = transport.servers(w);
        roles.push(training.trainee(w, comms, data, ps, (config, opts), t0, &errors)?);
    }
    let run = |w: usize, trainee: Trainee<'_>, report: Report<'_>| {
        trainee.run(w, make, config, report, &errors)
    };
    let mut joined = coordinator.as_mut().map(|c| training.joined(c));
    let sink = joined
        .as_mut()
        .map(|j| j as &mut dyn FnMut(StepReport) -> Result<()>);
    let mut outcomes = transport.run(roles, training, &run, sink, &errors)?;
    drop(joined);
    let spans = outcomes
        .iter_mut()
        .flat_map(|o| std::mem::take(&mut o.spans))
        .collect();
    let Some(spans) = transport.gather(spans, training, t0)? else {
        return Ok(None);
    };
    let Some(coordinator) = coordinator else {
        return Ok(None);
    };
    training
        .finish(coordinator, outcomes.swap_remove(0), spans)
        .map(Some)
}
