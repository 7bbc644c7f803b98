//! The in-process transport: a plan's ranks as threads of this process.
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

use crate::comm::{in_process, AxisComms, Communicator};
use crate::core::backend::Backend;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::roles::Role;
use crate::cpu::Cpu;
use crate::ps::{self, PsConfig};
use crate::run::coordinator::{reporter, Coordinator, StageReports};
use crate::run::mesh::{Axis, Coord, Mesh};
use crate::run::metrics::StepMetrics;
use crate::run::pipeline::PipelineRun;
use crate::run::trace::Span;
use crate::run::trainer::ErrorSlot;
use crate::run::worker::{run_worker_on, WorkerSetup};
use std::sync::mpsc;
use std::time::Instant;

// What a caller of the thread launcher names, where it has always found it.
pub use crate::comm::Links;
pub use crate::core::backend::Site;
pub use crate::run::data::open_data;
pub use crate::run::eval::evaluate;
pub use crate::run::metrics::TrainReport;
pub use crate::run::options::{CheckpointEvery, TrainOptions};
pub use crate::run::programs::{
    init_params, input_types, micro_batches, pulled_types, server_shards, Programs,
};

/// One in-process communicator per group of `axis`, its waits bounded by the run's
/// timeout, each end in its slot until a worker takes it ([`take_link`]).
pub(crate) fn axis_links(
    mesh: &Mesh,
    axis: Axis,
    opts: &TrainOptions,
) -> Vec<Vec<Option<Box<dyn Communicator>>>> {
    (0..mesh.groups(axis))
        .map(|_| {
            in_process(mesh.size(axis))
                .into_iter()
                .map(|mut c| {
                    c.set_timeout(Some(opts.timeout));
                    Some(Box::new(c) as Box<dyn Communicator>)
                })
                .collect()
        })
        .collect()
}

/// Every worker's communicators, by axis: for each axis the mesh links
/// ([`Mesh::axes`]), one in-process communicator per group, worker `w` holding its
/// group's end.
pub(crate) fn link_axes(mesh: &Mesh, opts: &TrainOptions) -> Vec<AxisComms> {
    let mut comms: Vec<AxisComms> = (0..mesh.workers()).map(|_| AxisComms::default()).collect();
    for axis in mesh.axes() {
        let mut links = axis_links(mesh, axis, opts);
        for (w, c) in comms.iter_mut().enumerate() {
            if let Some(link) = take_link(&mut links, mesh, axis, w) {
                c.insert(axis, link);
            }
        }
    }
    comms
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

/// The error a run ends with: the first one recorded (the cause), named by role.
fn first_error(errors: &ErrorSlot, mesh: &Mesh, fallback: RuntimeError) -> RuntimeError {
    match errors.take() {
        Some((Role::Worker(r), e)) => e.of_rank(mesh.name(r)),
        Some((Role::Server(s), e)) => e.of_rank(format!("server {s}")),
        None => fallback,
    }
}

/// The thread transport's one runner: each role on a thread of its own, named, and
/// its reports drained into `sink` on the caller's thread (the coordinator) until
/// every role is done. An error from `sink` ends the drain, so the roles see their
/// reports refused and stop. Returns each role's result in order (a panic or a thread
/// that did not start among them) and `sink`'s error.
pub(crate) fn run_roles<R, O, F>(
    roles: Vec<(String, F)>,
    sink: &mut dyn FnMut(R) -> Result<()>,
) -> (Vec<Result<O>>, Option<RuntimeError>)
where
    R: Send,
    O: Send,
    F: FnOnce(mpsc::Sender<R>) -> Result<O> + Send,
{
    let (tx, rx) = mpsc::channel::<R>();
    let mut sink_error = None;
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = roles
            .into_iter()
            .map(|(name, role)| {
                let tx = tx.clone();
                let h = std::thread::Builder::new()
                    .name(name.clone())
                    .spawn_scoped(scope, move || role(tx));
                (name, h)
            })
            .collect();
        drop(tx);
        for r in rx.iter() {
            if let Err(e) = sink(r) {
                sink_error = Some(e);
                break;
            }
        }
        drop(rx);
        handles
            .into_iter()
            .map(|(name, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::internal(
                        "the launcher",
                        format!("{name} panicked"),
                    ))
                }),
                Err(e) => Err(RuntimeError::no_thread(name, e)),
            })
            .collect()
    });
    (results, sink_error)
}

/// Every role's outcome, or the run's error: the coordinator's if it stopped the run,
/// else the first error recorded (the cause; roles record theirs as they fail, before
/// their peers see them hang up), worker w being the w-th role.
fn settle<O>(
    results: Vec<Result<O>>,
    coordinator_error: Option<RuntimeError>,
    errors: &ErrorSlot,
    mesh: &Mesh,
) -> Result<Vec<O>> {
    if let Some(e) = coordinator_error {
        return Err(e);
    }
    let mut outcomes = Vec::with_capacity(results.len());
    let mut failed = false;
    for (w, r) in results.into_iter().enumerate() {
        match r {
            Ok(o) => outcomes.push(o),
            Err(e) => {
                errors.record(Role::Worker(w), e);
                failed = true;
            }
        }
    }
    if failed {
        return Err(first_error(
            errors,
            mesh,
            RuntimeError::internal("the launcher", "a worker failed"),
        ));
    }
    Ok(outcomes)
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
    train_with(programs, config, opts, on_step, |_, _| Ok(Cpu))
}

/// [`train`], each worker's kernels on the backend `make(site, comm)` creates on that
/// worker's thread (several workers may share one device). `comm` is the workers'
/// in-process communicator, for a device communicator's bootstrap; collectives go
/// through the host unless the backend runs them itself
/// ([`Backend::start_collective`](crate::core::backend::Backend::start_collective)).
pub fn train_with<B: Backend>(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: impl Fn(Site<'_>, Links<'_>) -> Result<B> + Sync,
) -> Result<TrainReport> {
    let mesh = Mesh::of(&programs)?;
    if mesh.pipelined {
        return train_pipeline_with(&programs, mesh, config, opts, on_step, make);
    }
    let make = &make;
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
            total_steps: crate::run::steps::lr_horizon(config),
            no_decay: config.no_decay.clone(),
            seed: config.seed,
            resume: opts.resume.clone(),
        };
        let mut c = ps::start_traced(shards, cfg, opts.trace)?;
        c.set_timeout(opts.timeout);
        Some(c)
    };
    // The data axis links the replicas of one model rank, the model axis the model
    // ranks of one replica.
    let comms = link_axes(&mesh, opts);
    let errors = ErrorSlot::default();
    let t0 = Instant::now();
    let k = micro_batches(programs.worker);
    let mut coordinator =
        Coordinator::new(n, config.batch * k, n > 1 || cluster.is_some(), on_step);
    coordinator.model_axis = mesh.model;
    coordinator.flops_per_sample = opts.flops_per_sample;
    let roles = comms
        .into_iter()
        .zip(sources)
        .enumerate()
        .map(|(rank, (comms, data))| {
            let ps = cluster.as_mut().map(|c| c.client(rank));
            let errors = errors.clone();
            let role = move |tx| {
                let setup = WorkerSetup {
                    programs,
                    config,
                    opts,
                    rank,
                    mesh,
                    comms,
                    ps,
                    data,
                    report: Box::new(reporter(tx)),
                    t0,
                    errors,
                };
                let site = Site::of(rank, programs.worker);
                run_worker_on(setup, |links| make(site, links))
            };
            (format!("worker-{rank}"), role)
        })
        .collect();
    let (results, coordinator_error) = run_roles(roles, &mut |r| coordinator.add(r));
    let servers_outcome = cluster.as_mut().map(|c| c.stop());
    let mut outcomes = settle(results, coordinator_error, &errors, &mesh)?;
    let servers = match servers_outcome.transpose() {
        Ok(s) => s,
        Err(e) => return Err(first_error(&errors, &mesh, e)),
    };
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
            types: None,
            step: s.step,
            bytes: None,
            start_us: us(s.start),
            dur_us: us(s.end) - us(s.start),
            counters: Vec::new(),
            on_device: false,
        }));
    }
    Ok(coordinator.finish(params, w0.profile, spans))
}

/// Trains a pipelined plan, its stages as threads: `whole` is the one-device graph the
/// stages were cut from (for the data's shapes and the variables' initial values).
pub fn train_pipeline(
    programs: &Programs<'_>,
    mesh: Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<TrainReport> {
    train_pipeline_with(programs, mesh, config, opts, on_step, |_, _| Ok(Cpu))
}

/// [`train_pipeline`], each stage's kernels on the backends `make(site, comm)`
/// creates on that stage's thread (see [`crate::run::pipeline::Stage::run_on`]).
pub fn train_pipeline_with<B: Backend>(
    programs: &Programs<'_>,
    mesh: Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: impl Fn(Site<'_>, Links<'_>) -> Result<B> + Sync,
) -> Result<TrainReport> {
    let make = &make;
    let run = PipelineRun::new(programs, mesh, config, opts)?;
    let workers = run.workers();
    let sources = (0..workers)
        .map(|w| run.sources(config, opts, w))
        .collect::<Result<Vec<_>>>()?;
    // Its stages talk over the pipe axis, its replicas average gradients over the data
    // axis, a stage's model ranks run their collectives over the model axis.
    let comms = link_axes(&mesh, opts);
    let errors = ErrorSlot::default();
    let t0 = Instant::now();
    let mut coordinator = Coordinator::of_pipeline(&run, on_step);
    run.clear_later_states()?;
    let mut roles = Vec::with_capacity(workers);
    for (w, (data, comms)) in sources.into_iter().zip(comms).enumerate() {
        let Coord {
            replica: r,
            stage: s,
            model: m,
        } = mesh.coord(w);
        let mut stage = run.stage(w, comms, data, (config, opts), t0)?;
        let errors = &errors;
        let role = move |tx| {
            let result = stage.run_on(make, config, &mut reporter(tx));
            // The cause first: its neighbours fail next, seeing it hang up once the
            // stage (its communicators) is dropped, after this.
            result.map_err(|e| {
                let copy = e.duplicate();
                errors.record(Role::Worker(w), e);
                copy
            })
        };
        roles.push((format!("stage-{s}-replica-{r}-model-{m}"), role));
    }
    let mut reports = StageReports::default();
    let (results, coordinator_error) =
        run_roles(roles, &mut |r| reports.add(r, workers, &mut coordinator));
    let mut outcomes = settle(results, coordinator_error, &errors, &mesh)?;
    let spans = outcomes
        .iter_mut()
        .flat_map(|o| std::mem::take(&mut o.spans))
        .collect();
    // Worker 0 holds the whole model's trained variables, gathered from its stages.
    let params = outcomes.swap_remove(0).params;
    // The last step's line carries the final evaluation, and so does the report.
    Ok(coordinator.finish(params, None, spans))
}
