//! Ranks as MPI processes (feature `mpi`): [`run`] runs one rank of a plan under
//! `mpirun` with the same worker loop and the same [`Coordinator`] as the in-process
//! launcher, plus the parameter-server links over MPI.
//!
//! Ranks and roles follow [`crate::core::roles`]: `mpirun -np N+S`, ranks `0..N` are
//! workers, `N..N+S` servers. Start-up: every rank gathers every rank's plan hash and
//! world size and stops, naming the rank, when one differs from rank 0's.
//!
//! A rank's error is printed by that rank, which then aborts the job (MPI has no other
//! way to stop ranks blocked in a collective); a killed rank makes `mpirun` stop the
//! others. The communicator and its timeouts are [`crate::comm::mpi`]'s.

use crate::comm::mpi::{Backoff, Comm, MpiComm, TAG_REPLY, TAG_REPORT, TAG_REQUEST, TAG_SPANS};
use crate::comm::Communicator;
use crate::core::backend::Backend;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::roles::{Role, Roles};
use crate::ps::transport::{ServerLink, WorkerLink};
use crate::ps::{self, PsClient, PsConfig, Server};
use crate::run::launch::{rank_path, MpiRun};
use crate::run::metrics::StepMetrics;
use crate::run::trace::Span;
use crate::run::train::{
    open_data, pulled_types, server_shards, Coordinator, Programs, TrainOptions, TrainReport,
};
use crate::run::worker::{run_worker_on, ErrorSlot, StepReport, WorkerSetup};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Communicator as _;
use mpi::traits::*;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// A worker's link to the servers (ranks `N..N+S`).
struct MpiWorkerLink {
    comm: Arc<Comm>,
    workers: usize,
}

impl WorkerLink for MpiWorkerLink {
    fn send(&mut self, server: usize, msg: Vec<u8>) -> Result<()> {
        i32::try_from(msg.len()).map_err(|_| {
            RuntimeError::Config(format!(
                "a message of {} bytes to server {server}: more than MPI counts",
                msg.len()
            ))
        })?;
        self.comm
            .0
            .process_at_rank((self.workers + server) as i32)
            .send_with_tag(&msg[..], TAG_REQUEST);
        Ok(())
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff(0);
        loop {
            if let Some((msg, st)) = self
                .comm
                .0
                .any_process()
                .immediate_matched_probe_with_tag(TAG_REPLY)
            {
                return Ok(Some((msg, st).matched_receive_vec::<u8>().0));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            backoff.wait();
        }
    }
}

/// A server's link to the workers (ranks `0..N`).
struct MpiServerLink {
    comm: Arc<Comm>,
    workers: usize,
}

impl ServerLink for MpiServerLink {
    fn recv(&mut self) -> Result<(usize, Vec<u8>)> {
        let mut backoff = Backoff(0);
        loop {
            if let Some((msg, st)) = self
                .comm
                .0
                .any_process()
                .immediate_matched_probe_with_tag(TAG_REQUEST)
            {
                let (data, st) = (msg, st).matched_receive_vec::<u8>();
                let from = st.source_rank() as usize;
                if from >= self.workers {
                    return Err(RuntimeError::Config(format!(
                        "a request from rank {from}, which is no worker"
                    )));
                }
                return Ok((from, data));
            }
            backoff.wait();
        }
    }
    fn send(&mut self, worker: usize, msg: Vec<u8>) -> Result<()> {
        i32::try_from(msg.len()).map_err(|_| {
            RuntimeError::Config(format!(
                "a reply of {} bytes: more than MPI counts",
                msg.len()
            ))
        })?;
        self.comm
            .0
            .process_at_rank(worker as i32)
            .send_with_tag(&msg[..], TAG_REPLY);
        Ok(())
    }
}

/// Bytes of a rank's start-up record: plan hash, world size and settings.
const RECORD: usize = 1024;

/// The run settings every rank must share, as `name=value` words: steps, the
/// synchronisation, how data is read, evaluation, tracing (every rank sends spans),
/// checkpoints (a collective on ZeRO workers) and the resumed step.
fn agreed_settings(config: &RunConfig, opts: &TrainOptions) -> Vec<String> {
    vec![
        format!("--steps={}", opts.steps.unwrap_or(config.steps)),
        format!("sync={}", opts.sync),
        format!("global_data={}", opts.global_data),
        format!("evaluate={}", opts.evaluate),
        format!("--trace={}", opts.trace),
        format!(
            "--checkpoint-every={}",
            opts.checkpoint
                .as_ref()
                .map_or("none".to_string(), |c| c.every.to_string())
        ),
        format!(
            "--resume-step={}",
            opts.resume.as_ref().map_or(0, |s| s.index.step)
        ),
    ]
}

/// Dies loudly: prints the rank's error and stops every rank of the job.
fn fail(
    world: &SimpleCommunicator,
    rank: usize,
    role: Option<Role>,
    e: &dyn std::fmt::Display,
) -> ! {
    let role = role.map_or("?".to_string(), |r| r.to_string());
    let text = e.to_string();
    let text = text.strip_prefix(&format!("{role}: ")).unwrap_or(&text);
    eprintln!("error: rank {rank} ({role}): {text}");
    world.abort(1)
}

/// Runs this process's rank of the plan under `mpirun`: a worker or a server as the
/// rank-to-role mapping says, each worker rank's kernels on the backend
/// `make(rank, comm)` creates (`comm`: the workers' MPI communicator, for a device
/// communicator's bootstrap); servers stay on the CPU. Rank 0 returns the run's report
/// (metrics lines go to `on_step` there); the other ranks return `None`. An error on
/// any rank stops the job.
pub fn run_with<B: Backend>(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: &(dyn Fn(usize, &mut dyn Communicator) -> Result<B> + Sync),
) -> Result<Option<TrainReport>> {
    let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .ok_or_else(|| {
            RuntimeError::Config("MPI was already initialised in this process".into())
        })?;
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let roles = Roles {
        workers: programs.workers,
        servers: mpi_run.servers,
    };
    // Start-up checks, decided from data every rank has, so every rank decides alike:
    // the plan, the job's size, and every run setting that must agree across ranks (a
    // rank with other --steps would leave the others waiting at its last step).
    let record = format!(
        "{}\t{}\t{}",
        mpi_run.plan_hash,
        roles.world(),
        agreed_settings(config, opts).join(" ")
    );
    let mut mine = [0u8; RECORD];
    let n = record.len().min(mine.len());
    mine[..n].copy_from_slice(&record.as_bytes()[..n]);
    let mut all = vec![0u8; RECORD * size];
    world.all_gather_into(&mine[..], &mut all[..]);
    let text = |r: usize| {
        String::from_utf8_lossy(&all[r * RECORD..(r + 1) * RECORD])
            .trim_end_matches('\0')
            .to_string()
    };
    let fields = |r: usize| -> Vec<String> { text(r).split('\t').map(str::to_string).collect() };
    let differ: Vec<String> = (1..size)
        .filter(|&r| text(r) != text(0))
        .map(|r| {
            let (f, f0) = (fields(r), fields(0));
            let field = |v: &[String], i: usize| v.get(i).cloned().unwrap_or_default();
            let (h, h0) = (field(&f, 0), field(&f0, 0));
            if h != h0 {
                format!(
                    "rank {r} runs another plan (hash {}… vs rank 0's {}…)",
                    &h[..h.len().min(12)],
                    &h0[..h0.len().min(12)]
                )
            } else if field(&f, 1) != field(&f0, 1) {
                format!(
                    "rank {r}'s plan needs {} ranks, rank 0's {}",
                    field(&f, 1),
                    field(&f0, 1)
                )
            } else {
                let (mine, theirs) = (field(&f, 2), field(&f0, 2));
                let odd: Vec<String> = mine
                    .split(' ')
                    .zip(theirs.split(' '))
                    .filter(|(a, b)| a != b)
                    .map(|(a, b)| format!("{a} (rank 0: {b})"))
                    .collect();
                format!("rank {r} runs with other settings: {}", odd.join(", "))
            }
        })
        .collect();
    if !differ.is_empty() {
        return Err(RuntimeError::Config(format!(
            "rank {rank}: the ranks do not run the same plan alike: {}",
            differ.join("; ")
        )));
    }
    if size != roles.world() {
        let line = format!("mpirun -np {} {}", roles.world(), mpi_run.command);
        return Err(RuntimeError::Config(if size == 1 {
            format!(
                "--transport mpi: this plan has {} workers and {} servers, so it runs as {} \
                 processes; start it with\n  {line}\n(as root add --allow-run-as-root; with \
                 more ranks than cores, --oversubscribe)",
                roles.workers,
                roles.servers,
                roles.world()
            )
        } else {
            format!(
                "rank {rank}: the job has {size} ranks, the plan needs {} ({} workers, {} \
                 servers); start it with\n  {line}",
                roles.world(),
                roles.workers,
                roles.servers
            )
        }));
    }
    if threading < mpi::Threading::Multiple {
        return Err(RuntimeError::Config(format!(
            "this MPI gives thread level {threading:?}; distc needs MPI_THREAD_MULTIPLE"
        )));
    }
    // From here on, a rank that fails stops the job: the others may be waiting for it.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        SimpleCommunicator::world().abort(101);
    }));
    let role = roles.role(rank);
    let color = if rank < roles.workers {
        Color::with_value(0)
    } else {
        Color::undefined()
    };
    let workers_comm = world.split_by_color(color);
    let ps_comm = Arc::new(Comm(world.duplicate()));
    let ctl = Arc::new(Comm(world.duplicate()));
    world.barrier();
    let t0 = Instant::now();
    let result = match role {
        Some(Role::Server(s)) => run_server(programs, config, opts, roles, s, &ps_comm, t0)
            .map(|spans| send_spans(&ctl, rank, spans, opts, mpi_run)),
        Some(Role::Worker(r)) => {
            let comm = match workers_comm {
                Some(c) => Comm(c),
                None => fail(&world, rank, role, &"not in the workers' communicator"),
            };
            run_worker_rank(
                programs, config, opts, mpi_run, roles, r, comm, &ps_comm, &ctl, t0, on_step, make,
            )
        }
        None => Err(RuntimeError::Config(format!("rank {rank} has no role"))),
    };
    match result {
        Ok(report) => {
            // Communicators are freed before MPI_Finalize (dropping the universe).
            drop(ps_comm);
            drop(ctl);
            drop(world);
            drop(universe);
            Ok(report)
        }
        Err(e) => fail(&world, rank, role, &e),
    }
}

fn run_server(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    roles: Roles,
    s: usize,
    ps_comm: &Arc<Comm>,
    t0: Instant,
) -> Result<Vec<Span>> {
    let shards = server_shards(programs.servers, &pulled_types(programs.worker))?;
    ps::check_shards(&shards)?;
    let mine = shards.get(s).cloned().unwrap_or_default();
    let cfg = PsConfig {
        workers: roles.workers,
        sync: opts.sync,
        optimizer: config.optimizer.clone(),
        seed: config.seed,
        resume: opts.resume.clone(),
    };
    let mut server = Server::new(s, &mine, &cfg)?;
    server.set_tracing(opts.trace);
    let mut link = MpiServerLink {
        comm: ps_comm.clone(),
        workers: roles.workers,
    };
    let outcome = ps::serve(server, &mut link)?;
    // The server's failure reached the workers as replies; they report it.
    let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
    Ok(outcome
        .spans
        .into_iter()
        .map(|sp| Span {
            track: format!("server {}", sp.server),
            name: match sp.rank {
                Some(r) => format!("{} (worker {r})", sp.name),
                None => sp.name,
            },
            node: None,
            step: sp.step,
            bytes: None,
            start_us: us(sp.start),
            dur_us: us(sp.end) - us(sp.start),
            counters: Vec::new(),
        })
        .collect())
}

/// A rank other than 0 sends its spans to rank 0 and writes its own trace file.
fn send_spans(
    ctl: &Comm,
    rank: usize,
    spans: Vec<Span>,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
) -> Option<TrainReport> {
    if opts.trace {
        let text = serde_json::to_vec(&spans).unwrap_or_default();
        if let Some(path) = &mpi_run.trace {
            let trace = crate::run::trace::chrome_trace(&spans).to_string();
            let _ = crate::core::output::write_file(&rank_path(path, rank), trace.as_bytes());
        }
        ctl.0.process_at_rank(0).send_with_tag(&text[..], TAG_SPANS);
    }
    None
}

/// A worker's local metrics line from its own report.
fn local_line(r: &StepReport, batch: usize) -> StepMetrics {
    StepMetrics {
        step: r.step,
        loss: r.loss,
        samples_per_sec: batch as f64 / r.step_sec.max(1e-9),
        compute_sec: (r.step_sec - r.comm_wait_sec).max(0.0),
        comm_wait_sec: r.comm_wait_sec,
        bytes_sent: r.bytes_sent,
        bytes_received: r.bytes_received,
        bytes_moved: r.bytes_moved,
        bytes_sent_per_worker: vec![],
        bytes_received_per_worker: vec![],
        eval: r.eval.clone(),
        memory: r.memory,
        gpu_memory: r.device_memory.map(|m| m.0),
        gpu_memory_peak: r.device_memory.map(|m| m.1),
    }
}

#[allow(clippy::too_many_arguments)]
fn run_worker_rank<B: Backend>(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
    roles: Roles,
    r: usize,
    comm: Comm,
    ps_comm: &Arc<Comm>,
    ctl: &Arc<Comm>,
    t0: Instant,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: &(dyn Fn(usize, &mut dyn Communicator) -> Result<B> + Sync),
) -> Result<Option<TrainReport>> {
    use std::io::Write;
    let data = open_data(&programs, config, opts, r)?;
    let mpi_comm = MpiComm::new(comm, ctl.clone(), roles, r, opts.timeout);
    let ps = (roles.servers > 0).then(|| {
        PsClient::new(
            r,
            roles.workers,
            roles.servers,
            Box::new(MpiWorkerLink {
                comm: ps_comm.clone(),
                workers: roles.workers,
            }),
            opts.timeout,
        )
    });
    let mut local = match &mpi_run.metrics {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(rank_path(p, r)).map_err(|source| RuntimeError::Io {
                path: rank_path(p, r),
                source,
            })?,
        )),
        None => None,
    };
    let batch = config.batch;
    let (local_tx, local_rx) = mpsc::channel::<StepReport>();
    let ctl_sender = ctl.clone();
    let report = move |rep: StepReport| -> Result<()> {
        if let Some(w) = local.as_mut() {
            let line = serde_json::to_string(&local_line(&rep, batch))
                .map_err(|e| RuntimeError::Config(e.to_string()))?;
            writeln!(w, "{line}").map_err(|source| RuntimeError::Io {
                path: PathBuf::from("metrics"),
                source,
            })?;
            if rep.step == opts.steps.unwrap_or(config.steps) {
                let _ = w.flush();
            }
        }
        if r == 0 {
            local_tx
                .send(rep)
                .map_err(|_| RuntimeError::Config("the coordinator stopped".into()))
        } else {
            let bytes =
                serde_json::to_vec(&rep).map_err(|e| RuntimeError::Config(e.to_string()))?;
            ctl_sender
                .0
                .process_at_rank(0)
                .send_with_tag(&bytes[..], TAG_REPORT);
            Ok(())
        }
    };
    let setup = WorkerSetup {
        programs,
        config,
        opts,
        rank: r,
        comm: Box::new(mpi_comm),
        ps,
        data,
        report: Box::new(report),
        t0,
        errors: ErrorSlot::default(),
    };
    if r != 0 {
        let outcome = run_worker_on(setup, |c| make(r, c))?;
        let _ = send_spans(ctl, r, outcome.spans, opts, mpi_run);
        return Ok(None);
    }
    // Rank 0: the worker on a thread, the coordinator here.
    // A resumed run reports the steps after the state's.
    let done = opts.resume.as_ref().map_or(0, |s| s.index.step as usize);
    let steps = opts.steps.unwrap_or(config.steps).saturating_sub(done);
    let k = crate::run::train::micro_batches(programs.worker);
    let mut coordinator = Coordinator::new(roles.workers, config.batch * k, true, on_step);
    std::thread::scope(|scope| -> Result<Option<TrainReport>> {
        let worker = std::thread::Builder::new()
            .name("worker-0".into())
            .spawn_scoped(scope, move || run_worker_on(setup, |c| make(r, c)))
            .map_err(|e| RuntimeError::Config(format!("worker 0: cannot start: {e}")))?;
        let expected = steps * roles.workers;
        let mut received = 0;
        let mut backoff = Backoff(0);
        let mut worker = Some(worker);
        let mut outcome = None;
        while received < expected {
            let mut got = false;
            while let Ok(rep) = local_rx.try_recv() {
                coordinator.add(rep)?;
                received += 1;
                got = true;
            }
            if let Some((msg, st)) = ctl
                .0
                .any_process()
                .immediate_matched_probe_with_tag(TAG_REPORT)
            {
                let (bytes, _) = (msg, st).matched_receive_vec::<u8>();
                let rep: StepReport = serde_json::from_slice(&bytes)
                    .map_err(|e| RuntimeError::Config(format!("a malformed step report: {e}")))?;
                coordinator.add(rep)?;
                received += 1;
                got = true;
            }
            // Worker 0 may end first (its reports are all in the channel): an error
            // stops the job now; otherwise the other workers' reports are awaited.
            if let Some(w) = worker.take_if(|w| w.is_finished()) {
                outcome = Some(
                    w.join()
                        .map_err(|_| RuntimeError::Config("worker 0 panicked".into()))??,
                );
            }
            if got {
                backoff = Backoff(0);
            } else {
                backoff.wait();
            }
        }
        let outcome = match (outcome, worker) {
            (Some(o), _) => o,
            (None, Some(w)) => w
                .join()
                .map_err(|_| RuntimeError::Config("worker 0 panicked".into()))??,
            (None, None) => return Err(RuntimeError::Config("worker 0 vanished".into())),
        };
        let mut spans = outcome.spans;
        if opts.trace {
            for _ in 1..roles.world() {
                let (bytes, _) = ctl.0.any_process().receive_vec_with_tag::<u8>(TAG_SPANS);
                let theirs: Vec<Span> = serde_json::from_slice(&bytes)
                    .map_err(|e| RuntimeError::Config(format!("malformed spans: {e}")))?;
                spans.extend(theirs);
            }
            if let Some(path) = &mpi_run.trace {
                let own: Vec<Span> = spans
                    .iter()
                    .filter(|s| s.track.starts_with("worker 0"))
                    .cloned()
                    .collect();
                let trace = crate::run::trace::chrome_trace(&own).to_string();
                crate::core::output::write_file(&rank_path(path, 0), trace.as_bytes())?;
            }
        }
        let types = ps::check_shards(&server_shards(
            programs.servers,
            &pulled_types(programs.worker),
        )?)?;
        let mut params = outcome.params;
        params.extend(ps::assemble(outcome.server_shards, &types)?);
        Ok(Some(coordinator.finish(params, outcome.profile, spans)))
    })
}
