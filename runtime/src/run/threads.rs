//! The in-process transport: a plan's ranks as threads of this process (the embedded
//! default; see [`crate::core::roles`] for the mapping): servers over in-process
//! links, each axis of the mesh over one in-process communicator per group, and the
//! caller's thread joins the roles' step reports into one metrics line per step
//! ([`crate::run::coordinator::Coordinator`]). What the roles are, and everything
//! around them, is the one launcher's ([`crate::run::launcher`]); MPI ranks
//! (`crate::run::mpi`) are its other transport. One device is the one-worker case, on
//! the CPU or a GPU alike.

use crate::comm::Links;
use crate::comm::{in_process, AxisComms, Communicator};
use crate::core::backend::Backend;
use crate::core::backend::Site;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::roles::Role;
use crate::ps::{self, PsClient, PsCluster};
use crate::run::checkpoint::clear_steps_to_write;
use crate::run::coordinator::reporter;
use crate::run::launcher::{
    run_ranks, server_config, server_spans, LocalRole, Report, Trainee, Training, Transport,
};
use crate::run::mesh::{Axis, Mesh};
use crate::run::metrics::{StepMetrics, StepReport, TrainReport};
use crate::run::options::TrainOptions;
use crate::run::programs::Programs;
use crate::run::trace::Span;
use crate::run::trainer::ErrorSlot;
use crate::run::worker::WorkerOutcome;
use std::sync::mpsc;
use std::time::Instant;

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

/// [`train_with`] on the mesh the launch built.
pub(crate) fn train_on<B: Backend>(
    programs: Programs<'_>,
    mesh: Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: impl Fn(Site<'_>, Links<'_>) -> Result<B> + Sync,
) -> Result<TrainReport> {
    let training = Training::new(&programs, mesh, config, opts)?;
    clear_steps_to_write(config, opts)?;
    let shards = training.server_shards();
    let cluster = if shards.is_empty() {
        None
    } else {
        let cfg = server_config(config, opts, mesh.workers());
        let mut c = ps::start_traced(shards.to_vec(), cfg, opts.trace)?;
        c.set_timeout(opts.timeout);
        Some(c)
    };
    let mut threads = Threads {
        cluster,
        server_spans: Vec::new(),
    };
    run_ranks(&training, &mut threads, (config, opts), on_step, &make)?
        .ok_or_else(|| RuntimeError::internal("the launcher", "the threads ran without worker 0"))
}

/// The thread transport: every worker a thread of this process, the servers too.
struct Threads {
    cluster: Option<PsCluster>,
    /// The servers' spans, once they have stopped.
    server_spans: Vec<ps::ServerSpan>,
}

impl Transport for Threads {
    fn local(&self, mesh: &Mesh) -> Vec<usize> {
        (0..mesh.workers()).collect()
    }

    fn link(&mut self, mesh: &Mesh, opts: &TrainOptions) -> Result<Vec<AxisComms>> {
        Ok(link_axes(mesh, opts))
    }

    fn servers(&mut self, w: usize) -> Option<PsClient> {
        self.cluster.as_mut().map(|c| c.client(w))
    }

    fn run<'t>(
        &mut self,
        roles: Vec<LocalRole<'t>>,
        training: &Training<'_>,
        run: &(dyn Fn(usize, Trainee<'t>, Report<'_>) -> Result<WorkerOutcome> + Sync),
        coordinator: Option<&mut dyn FnMut(StepReport) -> Result<()>>,
        errors: &ErrorSlot,
    ) -> Result<Vec<WorkerOutcome>> {
        let mesh = training.mesh();
        let Some(sink) = coordinator else {
            return Err(RuntimeError::internal(
                "the launcher",
                "the threads have no coordinator",
            ));
        };
        let roles = roles
            .into_iter()
            .map(|role| {
                let LocalRole {
                    worker,
                    name,
                    trainee,
                } = role;
                (name, move |tx| {
                    run(worker, trainee, &mut reporter(tx, worker))
                })
            })
            .collect();
        let (results, coordinator_error) = run_roles(roles, sink);
        let servers = self.cluster.as_mut().map(|c| c.stop());
        let outcomes = settle(results, coordinator_error, errors, mesh)?;
        match servers.transpose() {
            Ok(s) => self.server_spans = s.map(|s| s.spans).unwrap_or_default(),
            Err(e) => return Err(first_error(errors, mesh, e)),
        }
        Ok(outcomes)
    }

    fn gather(
        &mut self,
        mut spans: Vec<Span>,
        _: &Training<'_>,
        t0: Instant,
    ) -> Result<Option<Vec<Span>>> {
        spans.extend(server_spans(std::mem::take(&mut self.server_spans), t0));
        Ok(Some(spans))
    }
}
