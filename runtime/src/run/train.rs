//! One training loop for every role and transport, and its in-process launcher.
//!
//! [`crate::run::worker::run_worker`] is the loop: data, timing, metrics, evaluation,
//! NaN stop, profile and trace are written once, for one device (one worker, no
//! servers) as for N workers and S servers. [`train`] runs a plan's ranks as threads
//! of this process (the embedded default; see [`crate::core::roles`] for the mapping):
//! servers over in-process links, workers over an in-process communicator, and the
//! caller's thread joins the workers' step reports into one metrics line per step
//! ([`Coordinator`]), which also assembles the run's [`TrainReport`]. The MPI launcher
//! (`crate::run::mpi`) runs the same loop and the same coordinator, one rank per
//! process. One device is the one-worker case, on the CPU or a GPU alike.

use crate::comm::{in_process, Communicator};
use crate::core::backend::{upload_all, Backend};
use crate::core::checkpoint::TrainingState;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::{CommHook, Executor, Mode};
use crate::core::init::init_param;
use crate::core::roles::Role;
use crate::core::value::Tensor;
use crate::cpu::Cpu;
use crate::ps::{self, PsConfig, PsSync, ShardSpec};
use crate::run::data::{check_model, data_dir, DataSource};
use crate::run::mesh::{Axis, Mesh};
use crate::run::metrics::{EvalMetrics, Profile, StepMetrics};
use crate::run::trace::Span;
use crate::run::worker::{run_worker_on, ErrorSlot, StepReport, WorkerOutcome, WorkerSetup};
use distc_ir::pipeline::PipelineProgram;
use distc_ir::{Graph, Op, TensorType};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The programs of a plan: the SPMD worker program (the one-device graph for one
/// device), the workers' init program and one program per parameter server.
#[derive(Clone, Copy, Debug)]
pub struct Programs<'g> {
    /// The worker program.
    pub worker: &'g Graph,
    /// Broadcasts replicated variables from rank 0, if any.
    pub init: Option<&'g Graph>,
    /// One per parameter server.
    pub servers: &'g [Graph],
    /// Gathers whole variables from the workers' shards after the last step (ZeRO).
    pub finalize: Option<&'g Graph>,
    /// Workers N.
    pub workers: usize,
    /// The stages' programs and schedule of a pipelined plan (`--pipeline`); `worker`
    /// is then the one-device graph they were cut from.
    pub pipeline: Option<&'g PipelineProgram>,
}

impl<'g> Programs<'g> {
    /// One device: the graph alone.
    pub fn single(graph: &'g Graph) -> Programs<'g> {
        Programs {
            worker: graph,
            init: None,
            servers: &[],
            finalize: None,
            workers: 1,
            pipeline: None,
        }
    }

    /// Micro-batches per step: a pipeline's, or the worker program's accumulation.
    pub fn micro_batches(&self) -> usize {
        match self.pipeline {
            Some(p) => p.micro_batches,
            None => micro_batches(self.worker),
        }
    }
}

/// Options of a run that are not part of the plan.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Overrides the plan's step count.
    pub steps: Option<usize>,
    /// Data directory (else `DISTC_DATA`).
    pub data_dir: Option<PathBuf>,
    /// Synthetic sources slice one global stream (see `DataSource::open_global`), so
    /// N workers of batch b see what one device of batch N*b sees. Synchronous plans
    /// and verification use it; asynchronous ones seed worker r with seed + r.
    pub global_data: bool,
    /// Draw every step's batch before the first step (see [`DataSource::preload`]).
    pub preload: bool,
    /// Time every kernel, the optimizer and the waits of worker 0 (see [`Profile`]).
    pub profile: bool,
    /// Record spans for a Chrome trace.
    pub trace: bool,
    /// Evaluate on the held-out data after the last step (and every `eval_every`
    /// steps); off, a run needs no evaluation data (`distc verify` compares weights).
    pub evaluate: bool,
    /// Parameter-server synchronisation.
    pub sync: PsSync,
    /// Bound on any wait for a collective or a server's answer.
    pub timeout: Duration,
    /// Write the training state every so many steps (worker 0 writes it).
    pub checkpoint: Option<CheckpointEvery>,
    /// Continue from this state: its variables, optimizer state, step and data
    /// position replace the initial ones.
    pub resume: Option<Arc<TrainingState>>,
}

/// Where and how often a run writes its [`TrainingState`].
#[derive(Clone, Debug)]
pub struct CheckpointEvery {
    /// The file (rewritten atomically each time).
    pub path: PathBuf,
    /// Every this many steps (at least 1).
    pub every: usize,
    /// What trains, for the index: strategy, workers, ZeRO stage.
    pub saved_by: String,
}

impl Default for TrainOptions {
    fn default() -> TrainOptions {
        TrainOptions {
            steps: None,
            data_dir: None,
            global_data: false,
            preload: false,
            profile: false,
            trace: false,
            evaluate: true,
            sync: PsSync::Sync,
            timeout: ps::DEFAULT_TIMEOUT,
            checkpoint: None,
            resume: None,
        }
    }
}

/// What training produced.
#[derive(Debug)]
pub struct TrainReport {
    /// Steps run.
    pub steps: usize,
    /// Loss of the first step (mean over workers).
    pub first_loss: f64,
    /// Loss of the last step (mean over workers).
    pub final_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalMetrics>,
    /// Wall time of the training steps (the slowest worker's, summed; evaluation and
    /// data loading excluded).
    pub train_time: Duration,
    /// Global samples per second over all steps.
    pub samples_per_sec: f64,
    /// Every variable after training: replicated ones from worker 0, server-held ones
    /// reassembled from their shards.
    pub params: HashMap<String, Tensor>,
    /// Where worker 0's step time went, when asked for.
    pub profile: Option<Profile>,
    /// Trace spans, when asked for.
    pub spans: Vec<Span>,
    /// The mean measured bubble of a pipelined run's steps.
    pub pipeline_bubble: Option<f64>,
}

/// Initial values of every variable of `graph`, from the seed.
pub fn init_params(graph: &Graph, seed: u64) -> HashMap<String, Tensor> {
    graph
        .topo_order()
        .into_iter()
        .filter_map(|id| match graph.op(id) {
            Op::Param { name, ty, init } => Some((name.clone(), init_param(name, ty, init, seed))),
            _ => None,
        })
        .collect()
}

/// The model inputs of `graph` by name, for the data source to shape its fields.
pub fn input_types(graph: &Graph) -> HashMap<String, TensorType> {
    graph
        .inputs()
        .into_iter()
        .map(|(_, n, t)| (n.to_string(), t.clone()))
        .collect()
}

/// Evaluates `params` on the held-out data of `config`; a worker program's pulls go
/// through `comm` (as of `step`).
pub fn evaluate<'h, B: Backend>(
    exec: &mut Executor<B>,
    params: &HashMap<String, B::Tensor>,
    data: &DataSource,
    config: &RunConfig,
    step: u64,
    mut comm: Option<&mut (dyn CommHook + 'h)>,
) -> Result<EvalMetrics> {
    let batches = data.eval_batches(config.eval_samples)?;
    if batches.is_empty() {
        return Err(RuntimeError::Config(
            "no evaluation data: the held-out set is smaller than one batch".into(),
        ));
    }
    let (mut loss, mut n, mut correct, mut sq, mut classified, mut regressed) =
        (0.0, 0usize, 0usize, 0.0, false, false);
    for batch in batches {
        let b = batch.values().next().map_or(0, |t| t.shape()[0]);
        let feeds = upload_all(exec.backend(), batch)?;
        let out = exec.run_with(&feeds, params, Mode::Eval, step, comm.as_deref_mut())?;
        loss += out.loss.unwrap_or(f64::NAN) * b as f64;
        n += b;
        let find = |name: &str| out.outputs.iter().find(|(k, _)| k == name).map(|(_, t)| t);
        if let (Some(pred), Some(target)) = (find("prediction"), find("target")) {
            match (pred, target) {
                (p, Tensor::I32(labels)) if p.shape().len() == 2 => {
                    classified = true;
                    let k = p.shape()[1];
                    let p = p.to_f64_vec();
                    for (i, &l) in labels.iter().enumerate() {
                        let row = &p[i * k..(i + 1) * k];
                        let arg =
                            row.iter()
                                .enumerate()
                                .fold(0, |best, (j, &v)| if v > row[best] { j } else { best });
                        correct += usize::from(arg as i32 == l);
                    }
                }
                (p, t) if p.shape() == t.shape() => {
                    regressed = true;
                    sq += p
                        .to_f64_vec()
                        .iter()
                        .zip(t.to_f64_vec())
                        .map(|(a, b)| (a - b) * (a - b))
                        .sum::<f64>();
                }
                _ => {}
            }
        }
    }
    Ok(EvalMetrics {
        eval_loss: loss / n as f64,
        eval_accuracy: classified.then(|| correct as f64 / n as f64),
        eval_rmse: regressed.then(|| (sq / n as f64).sqrt()),
        eval_samples: n,
    })
}

/// Joins the workers' step reports into one metrics line per step: loss (mean over
/// workers), global samples per second (over the slowest worker's step time), worker
/// 0's times and bytes, every worker's bytes, and worker 0's evaluation.
pub struct Coordinator<'a> {
    workers: usize,
    batch: usize,
    /// Whether lines carry per-worker byte lists (plans that communicate).
    per_worker: bool,
    pending: HashMap<usize, Vec<StepReport>>,
    on_step: &'a mut dyn FnMut(&StepMetrics) -> Result<()>,
    /// Steps completed.
    pub steps: usize,
    /// Mean loss of the first step.
    pub first_loss: f64,
    /// Mean loss of the last step.
    pub final_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalMetrics>,
    /// Sum over steps of the slowest worker's step time.
    pub train_time: Duration,
    /// Sum and count of the pipelined steps' measured bubbles.
    bubbles: (f64, usize),
    /// Workers of a model axis, who train on the same samples (1: none).
    pub model_axis: usize,
}

impl<'a> Coordinator<'a> {
    /// A coordinator of `workers` workers of `batch` samples each.
    pub fn new(
        workers: usize,
        batch: usize,
        per_worker: bool,
        on_step: &'a mut dyn FnMut(&StepMetrics) -> Result<()>,
    ) -> Coordinator<'a> {
        Coordinator {
            workers,
            batch,
            per_worker,
            pending: HashMap::new(),
            on_step,
            steps: 0,
            first_loss: f64::NAN,
            final_loss: f64::NAN,
            eval: None,
            train_time: Duration::ZERO,
            bubbles: (0.0, 0),
            model_axis: 1,
        }
    }

    /// Takes one worker's report; writes the step's line once every worker's is in.
    pub fn add(&mut self, r: StepReport) -> Result<()> {
        let step = r.step;
        let reports = self.pending.entry(step).or_default();
        reports.push(r);
        if reports.len() < self.workers {
            return Ok(());
        }
        let mut reports = self.pending.remove(&step).unwrap_or_default();
        reports.sort_by_key(|r| r.rank);
        let n = self.workers as f64;
        let loss = reports.iter().map(|r| r.loss).sum::<f64>() / n;
        let slowest = reports.iter().map(|r| r.step_sec).fold(0.0, f64::max);
        // The first step this run ran (a resumed run starts after the state's step).
        if self.steps == 0 {
            self.first_loss = loss;
        }
        self.final_loss = loss;
        self.steps += 1;
        self.train_time += Duration::from_secs_f64(slowest);
        let r0 = &reports[0];
        if let Some(p) = &r0.pipeline {
            self.bubbles.0 += p.bubble;
            self.bubbles.1 += 1;
        }
        if r0.eval.is_some() {
            self.eval.clone_from(&r0.eval);
        }
        let list = |f: fn(&StepReport) -> u64| {
            if self.per_worker {
                reports.iter().map(f).collect()
            } else {
                Vec::new()
            }
        };
        (self.on_step)(&StepMetrics {
            step,
            loss,
            samples_per_sec: (self.workers / self.model_axis.max(1) * self.batch) as f64
                / slowest.max(1e-9),
            compute_sec: (r0.step_sec - r0.comm_wait_sec).max(0.0),
            comm_wait_sec: r0.comm_wait_sec,
            bytes_sent_per_worker: list(|r| r.bytes_sent),
            bytes_received_per_worker: list(|r| r.bytes_received),
            bytes_sent: r0.bytes_sent,
            bytes_received: r0.bytes_received,
            bytes_moved: r0.bytes_moved,
            eval: r0.eval.clone(),
            memory: r0.memory,
            gpu_memory: r0.device_memory.map(|m| m.0),
            gpu_memory_peak: r0.device_memory.map(|m| m.1),
            pipeline: r0.pipeline.clone(),
            loss_scale: r0.loss_scale.map(|s| s.0),
            skipped_steps: r0.loss_scale.map(|s| s.1),
            lr: r0.lr,
        })
    }
}

impl Coordinator<'_> {
    /// The run's report once every step is in: the losses, evaluation and time the
    /// coordinator saw, the variables, worker 0's profile and every role's spans. The
    /// one place a [`TrainReport`] is made, for threads and MPI ranks alike.
    pub fn finish(
        self,
        params: HashMap<String, Tensor>,
        profile: Option<Profile>,
        spans: Vec<Span>,
    ) -> TrainReport {
        TrainReport {
            steps: self.steps,
            first_loss: self.first_loss,
            final_loss: self.final_loss,
            eval: self.eval,
            train_time: self.train_time,
            samples_per_sec: (self.steps * self.workers / self.model_axis.max(1) * self.batch)
                as f64
                / self.train_time.as_secs_f64().max(1e-9),
            params,
            profile,
            spans,
            pipeline_bubble: (self.bubbles.1 > 0).then(|| self.bubbles.0 / self.bubbles.1 as f64),
        }
    }
}

/// One in-process communicator per group of `axis`, each end in its slot until a
/// worker takes it ([`take_link`]).
pub(crate) fn axis_links(
    mesh: &Mesh,
    axis: Axis,
    linked: &dyn Fn(usize) -> Vec<Option<Box<dyn Communicator>>>,
) -> Vec<Vec<Option<Box<dyn Communicator>>>> {
    (0..mesh.groups(axis))
        .map(|_| linked(mesh.size(axis)))
        .collect()
}

/// Worker `w`'s end of its group's communicator on `axis`.
pub(crate) fn take_link(
    links: &mut [Vec<Option<Box<dyn Communicator>>>],
    mesh: &Mesh,
    axis: Axis,
    w: usize,
) -> Option<Box<dyn Communicator>> {
    let (group, rank) = mesh.group(axis, w);
    links.get_mut(group)?.get_mut(rank)?.take()
}

/// Shards of every server program: `shard` sources, by server.
pub fn server_shards(
    servers: &[Graph],
    full: &HashMap<String, TensorType>,
) -> Result<Vec<Vec<ShardSpec>>> {
    servers
        .iter()
        .map(|g| {
            g.topo_order()
                .into_iter()
                .filter_map(|id| match g.op(id) {
                    Op::Shard {
                        var,
                        start,
                        end,
                        init,
                        ..
                    } => Some((var.clone(), *start, *end, init.clone())),
                    _ => None,
                })
                .map(|(var, start, end, init)| {
                    let full = full.get(&var).cloned().ok_or_else(|| {
                        RuntimeError::Config(format!(
                            "server program holds `{var}`, which no worker reads"
                        ))
                    })?;
                    Ok(ShardSpec {
                        var,
                        full,
                        init,
                        start,
                        end,
                    })
                })
                .collect()
        })
        .collect()
}

/// The full type of every server-held variable, from the worker program's pulls.
pub fn pulled_types(worker: &Graph) -> HashMap<String, TensorType> {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::Pull { var, ty, .. } => Some((var.clone(), ty.clone())),
            Op::SparsePull { var, table, .. } => Some((var.clone(), table.clone())),
            _ => None,
        })
        .collect()
}

/// Micro-batches per step of a worker program (gradient accumulation; 1 without).
pub fn micro_batches(worker: &Graph) -> usize {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::Accumulate { micro } => Some(*micro),
            _ => None,
        })
        .max()
        .unwrap_or(1)
}

/// Opens worker `rank`'s data (its shard of the plan's source), preloaded if asked:
/// one source per micro-batch, micro-batch `m` of worker `r` being part `r*K + m` of
/// the `N*K` parts of the global batch.
pub fn open_data(
    programs: &Programs<'_>,
    mesh: &Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    rank: usize,
) -> Result<Vec<DataSource>> {
    let dir = data_dir(opts.data_dir.as_deref());
    let open = if opts.global_data {
        DataSource::open_global
    } else {
        DataSource::open
    };
    let k = programs.micro_batches();
    // A model axis's workers read the same batch: the data is split over replicas.
    let (rank, workers) = (mesh.coord(rank).replica, mesh.data);
    (0..k)
        .map(|m| {
            let mut source = open(
                &config.data,
                dir.as_deref(),
                &input_types(programs.worker),
                config.batch,
                config.seed,
                rank * k + m,
                workers * k,
            )?;
            if m == 0 && config.data.needs_files() {
                // File sources know their id ranges (a vocabulary) only once read;
                // synthetic sources' were checked with the settings at launch.
                let info = source.info();
                let bounds: Vec<(&str, usize)> = info
                    .id_bounds
                    .iter()
                    .map(|(f, b)| (f.as_str(), *b))
                    .collect();
                check_model(programs.worker, &config.data, config.batch, &bounds)?;
            }
            let mut steps = opts.steps.unwrap_or(config.steps);
            if let Some(state) = &opts.resume {
                source.skip_samples(state.index.samples)?;
                steps = steps.saturating_sub(state.index.step as usize);
            }
            if opts.preload {
                source.preload(steps)?;
            }
            Ok(source)
        })
        .collect()
}

/// The error a run ends with: the first one recorded (the cause), named by role.
fn first_error(errors: &ErrorSlot, mesh: &Mesh, fallback: RuntimeError) -> RuntimeError {
    match errors.take() {
        Some((Role::Worker(r), e)) => e.of_rank(mesh.name(r)),
        Some((Role::Server(s), e)) => e.of_rank(format!("server {s}")),
        None => fallback,
    }
}

/// Trains a plan with its N workers and S servers as threads of this process (one
/// device: one worker). `on_step` sees each step's metrics line as it is complete;
/// returning an error from it stops training.
pub fn train(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<TrainReport> {
    let mesh = Mesh::of(&programs)?;
    if mesh.pipelined {
        return crate::run::pipeline::train_pipeline(&programs, mesh, config, opts, on_step);
    }
    train_with(programs, config, opts, on_step, |_, _| Ok(Cpu))
}

/// [`train`], each worker's kernels on the backend `make(rank, comm)` creates on that
/// worker's thread (several workers may share one device). `comm` is the workers'
/// in-process communicator, for a device communicator's bootstrap; collectives go
/// through the host unless the backend runs them itself
/// ([`Backend::start_collective`](crate::core::backend::Backend::start_collective)).
pub fn train_with<B: Backend>(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: impl Fn(usize, &mut dyn Communicator) -> Result<B> + Sync,
) -> Result<TrainReport> {
    if programs.pipeline.is_some() {
        return Err(RuntimeError::Config(
            "a pipelined plan runs on the CPU only for now: drop --device cuda".into(),
        ));
    }
    let make = &make;
    let mesh = Mesh::of(&programs)?;
    let n = mesh.workers();
    let shards = server_shards(programs.servers, &pulled_types(programs.worker))?;
    let server_types = ps::check_shards(&shards)?;
    // Data first, so a missing file fails before any thread starts.
    let sources = (0..n)
        .map(|rank| open_data(&programs, &mesh, config, opts, rank))
        .collect::<Result<Vec<_>>>()?;
    let mut cluster = if shards.is_empty() {
        None
    } else {
        let cfg = PsConfig {
            workers: n,
            sync: opts.sync,
            optimizer: config.optimizer.clone(),
            lr_schedule: config.lr_schedule.clone(),
            total_steps: opts.steps.unwrap_or(config.steps) as u64,
            seed: config.seed,
            resume: opts.resume.clone(),
        };
        let mut c = ps::start_traced(shards, cfg, opts.trace)?;
        c.set_timeout(opts.timeout);
        Some(c)
    };
    let linked = |size: usize| -> Vec<Option<Box<dyn Communicator>>> {
        in_process(size)
            .into_iter()
            .map(|mut c| {
                c.set_timeout(Some(opts.timeout));
                Some(Box::new(c) as Box<dyn Communicator>)
            })
            .collect()
    };
    // The data axis links the replicas of one model rank, the model axis the model
    // ranks of one replica: one in-process communicator per group of each axis.
    crate::run::worker::refuse_model_axis_state(mesh.model, opts)?;
    let mut data_links = axis_links(&mesh, Axis::Data, &linked);
    let mut model_links = axis_links(&mesh, Axis::Model, &linked);
    type Links = (Box<dyn Communicator>, Option<Box<dyn Communicator>>);
    let comms: Vec<Links> = (0..n)
        .filter_map(|w| {
            let comm = take_link(&mut data_links, &mesh, Axis::Data, w)?;
            let model = if mesh.model > 1 {
                take_link(&mut model_links, &mesh, Axis::Model, w)
            } else {
                None
            };
            Some((comm, model))
        })
        .collect();
    let errors = ErrorSlot::default();
    let t0 = Instant::now();
    let (report_tx, report_rx) = mpsc::channel::<StepReport>();
    let k = micro_batches(programs.worker);
    let mut coordinator =
        Coordinator::new(n, config.batch * k, n > 1 || cluster.is_some(), on_step);
    coordinator.model_axis = mesh.model;
    let mut outcomes: Vec<Option<WorkerOutcome>> = Vec::new();
    let mut coordinator_error = None;
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (rank, ((comm, model_comm), data)) in comms.into_iter().zip(sources).enumerate() {
            let tx = report_tx.clone();
            let setup = WorkerSetup {
                programs,
                config,
                opts,
                rank,
                mesh,
                comm,
                model_comm,
                ps: cluster.as_mut().map(|c| c.client(rank)),
                data,
                report: Box::new(move |r| {
                    tx.send(r)
                        .map_err(|_| RuntimeError::Config("the run was stopped".into()))
                }),
                t0,
                errors: errors.clone(),
            };
            let h = std::thread::Builder::new()
                .name(format!("worker-{rank}"))
                .spawn_scoped(scope, move || run_worker_on(setup, |c| make(rank, c)));
            handles.push(h);
        }
        drop(report_tx);
        // The coordinator: a metrics line per step once every worker reported it. If
        // the caller stops the run, the workers see their reports refused and stop.
        for r in report_rx.iter() {
            if let Err(e) = coordinator.add(r) {
                coordinator_error = Some(e);
                break;
            }
        }
        drop(report_rx);
        for (rank, h) in handles.into_iter().enumerate() {
            let outcome = match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Config(format!("worker {rank} panicked")))
                }),
                Err(e) => Err(RuntimeError::Config(format!(
                    "worker {rank}: cannot start: {e}"
                ))),
            };
            match outcome {
                Ok(o) => outcomes.push(Some(o)),
                Err(e) => {
                    errors.record(Role::Worker(rank), e);
                    outcomes.push(None);
                }
            }
        }
    });
    let servers_outcome = cluster.as_mut().map(|c| c.stop());
    if let Some(e) = coordinator_error {
        return Err(e);
    }
    if outcomes.iter().any(Option::is_none) {
        return Err(first_error(
            &errors,
            &mesh,
            RuntimeError::Config("a worker failed".into()),
        ));
    }
    let servers = match servers_outcome.transpose() {
        Ok(s) => s,
        Err(e) => return Err(first_error(&errors, &mesh, e)),
    };
    let mut outcomes: Vec<WorkerOutcome> = outcomes.into_iter().flatten().collect();
    let mut spans: Vec<Span> = outcomes
        .iter_mut()
        .flat_map(|o| std::mem::take(&mut o.spans))
        .collect();
    let w0 = outcomes.swap_remove(0);
    let mut params = w0.params;
    params.extend(ps::assemble(w0.server_shards, &server_types)?);
    if let Some(s) = servers {
        let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
        spans.extend(s.spans.into_iter().map(|s| Span {
            track: format!("server {}", s.server),
            name: match s.rank {
                Some(r) => format!("{} (worker {r})", s.name),
                None => s.name,
            },
            node: None,
            step: s.step,
            bytes: None,
            start_us: us(s.start),
            dur_us: us(s.end) - us(s.start),
            counters: Vec::new(),
        }));
    }
    Ok(coordinator.finish(params, w0.profile, spans))
}
