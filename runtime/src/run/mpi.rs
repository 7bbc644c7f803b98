//! Ranks as MPI processes (feature `mpi`): [`run_with`] runs one rank of a plan under
//! `mpirun`. A worker rank (a worker or a pipeline's stage) runs the one launcher
//! ([`crate::run::launcher::run_ranks`]) over this transport ([`MpiRanks`]), as the
//! threads run it over theirs; a server rank serves its shards over MPI.
//!
//! Ranks and roles follow [`crate::core::roles`]: `mpirun -np N+S`, ranks `0..N` are
//! workers, `N..N+S` servers. Start-up: every rank gathers every rank's plan hash and
//! world size and stops, naming the rank, when one differs from rank 0's.
//!
//! A rank's error is printed by that rank, which then aborts the job (MPI has no other
//! way to stop ranks blocked in a collective); a killed rank makes `mpirun` stop the
//! others. The communicator and its timeouts are [`crate::comm::mpi`]'s.
//!
//! Every wait on another rank is bounded by `--timeout` and names the rank it waited
//! for: the start-up check and the barriers at the start and the end, requests to
//! servers and their replies (sent non-blocking: a server never waits on one worker
//! while others wait on it), step reports (sent synchronous, so a worker learns that
//! rank 0 stopped taking them), rank 0's wait for the other workers' reports (a worker
//! silent for longer than the timeout while another reported is named) and the trace
//! spans.

mod reports;

use crate::comm::mpi::{
    complete_or, report_and_abort, suspended, Among, Backoff, Comm, MpiComm, Outgoing, Since,
    TAG_REPLY, TAG_REQUEST, TAG_SPANS,
};
use crate::comm::AxisComms;
use crate::comm::Communicator;
use crate::comm::Links;
use crate::core::backend::Backend;
use crate::core::backend::Site;
use crate::core::config::RunConfig;
use crate::core::error::{PeerKind, Result, RuntimeError};
use crate::core::roles::{Role, Roles};
use crate::ps::transport::{Incoming, ServerLink, WorkerLink};
use crate::ps::{self, PsClient, Server};
use crate::run::checkpoint::clear_steps_to_write;
use crate::run::coordinator::reporter;
use crate::run::launcher::{
    run_ranks, server_config, server_spans, LocalRole, Report, Trainee, Training, Transport,
};
use crate::run::mesh::Mesh;
use crate::run::metrics::rank_path;
use crate::run::metrics::StepMetrics;
use crate::run::metrics::StepReport;
use crate::run::metrics::TrainReport;
use crate::run::options::{MpiRun, TrainOptions};
use crate::run::programs::{pulled_types, server_shards, Programs};
use crate::run::trace::Span;
use crate::run::trainer::ErrorSlot;
use crate::run::worker::WorkerOutcome;
use mpi::request::{scope, Request, Scope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Communicator as _;
use mpi::traits::*;
use reports::{drain_on_rank0, ToRank0};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Sends not yet taken by their receivers, oldest first; an error naming the receiver
/// once the oldest has waited `timeout`.
struct Sends {
    pending: VecDeque<Outgoing>,
    timeout: Duration,
}

impl Sends {
    fn new(timeout: Duration) -> Sends {
        Sends {
            pending: VecDeque::new(),
            timeout,
        }
    }

    /// Forgets the sends that completed; the receiver of the oldest one still waiting,
    /// if it has waited the timeout.
    fn late(&mut self) -> Option<usize> {
        self.pending.retain_mut(|o| !o.done());
        let t = self.timeout;
        self.pending
            .iter()
            .find(|o| o.since.waited() >= t)
            .map(|o| o.to)
    }

    /// Waits until every send completes; the receiver of the first that does not within
    /// the timeout.
    fn flush(&mut self) -> Option<usize> {
        let mut backoff = Backoff(0);
        while !self.pending.is_empty() {
            if let Some(to) = self.late() {
                return Some(to);
            }
            backoff.wait();
        }
        None
    }
}

/// A worker's link to the servers (ranks `N..N+S`). Requests go out non-blocking; one a
/// server has not taken within the timeout fails the next call.
struct MpiWorkerLink {
    comm: Arc<Comm>,
    /// This worker's rank.
    rank: usize,
    workers: usize,
    sends: Sends,
}

impl MpiWorkerLink {
    fn check(&mut self) -> Result<()> {
        let workers = self.workers;
        match self.sends.late() {
            Some(o) => Err(server_late(self.rank, o, workers, self.sends.timeout)),
            None => Ok(()),
        }
    }
}

/// Server rank `to` did not take a request of worker rank `rank`.
fn server_late(rank: usize, to: usize, workers: usize, timeout: Duration) -> RuntimeError {
    RuntimeError::Peer {
        rank,
        peer: to,
        op: "parameter-server request".into(),
        kind: PeerKind::TimedOut,
        message: format!(
            "parameter server {} (rank {to}) did not take a request within {:.0} s (--timeout)",
            to.saturating_sub(workers),
            timeout.as_secs_f64()
        ),
    }
}

impl WorkerLink for MpiWorkerLink {
    fn send(&mut self, server: usize, msg: Vec<u8>) -> Result<()> {
        i32::try_from(msg.len()).map_err(|_| {
            RuntimeError::Config(format!(
                "a message of {} bytes to server {server}: more than MPI counts",
                msg.len()
            ))
        })?;
        self.check()?;
        self.sends.pending.push_back(Outgoing::start(
            &self.comm.0,
            self.workers + server,
            TAG_REQUEST,
            msg,
            false,
        ));
        Ok(())
    }
    fn flush(&mut self) -> Result<()> {
        let workers = self.workers;
        match self.sends.flush() {
            Some(o) => Err(server_late(self.rank, o, workers, self.sends.timeout)),
            None => Ok(()),
        }
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let since = Since::now();
        let mut backoff = Backoff(0);
        loop {
            self.check()?;
            if let Some((msg, st)) = self
                .comm
                .0
                .any_process()
                .immediate_matched_probe_with_tag(TAG_REPLY)
            {
                return Ok(Some((msg, st).matched_receive_vec::<u8>().0));
            }
            if since.waited() >= timeout {
                return Ok(None);
            }
            backoff.wait();
        }
    }
}

/// A server's link to the workers (ranks `0..N`). Replies go out non-blocking, so a
/// worker that stopped taking them holds up no other; one not taken within the timeout
/// fails the server, naming that worker.
struct MpiServerLink {
    comm: Arc<Comm>,
    workers: usize,
    server: usize,
    sends: Sends,
}

impl MpiServerLink {
    fn check(&mut self) -> Result<()> {
        let (server, rank) = (self.server, self.workers + self.server);
        match self.sends.late() {
            Some(o) => Err(worker_late(o, server, rank, self.sends.timeout)),
            None => Ok(()),
        }
    }
}

/// Worker rank `to` did not take a server's reply.
fn worker_late(to: usize, server: usize, rank: usize, timeout: Duration) -> RuntimeError {
    RuntimeError::Peer {
        rank,
        peer: to,
        op: "parameter-server reply".into(),
        kind: PeerKind::TimedOut,
        message: format!(
            "worker rank {to} did not take a reply of parameter server {server} (rank {rank}) \
             within {:.0} s (--timeout)",
            timeout.as_secs_f64()
        ),
    }
}

impl ServerLink for MpiServerLink {
    fn recv(&mut self, timeout: Option<Duration>) -> Result<Incoming> {
        let since = Since::now();
        let mut backoff = Backoff(0);
        loop {
            self.check()?;
            if let Some((msg, st)) = self
                .comm
                .0
                .any_process()
                .immediate_matched_probe_with_tag(TAG_REQUEST)
            {
                let (data, st) = (msg, st).matched_receive_vec::<u8>();
                let from = st.source_rank() as usize;
                if from >= self.workers {
                    return Err(RuntimeError::Peer {
                        rank: self.workers + self.server,
                        peer: from,
                        op: "parameter-server request".into(),
                        kind: PeerKind::Malformed,
                        message: format!("a request from rank {from}, which is no worker"),
                    });
                }
                return Ok(Incoming::Request(from, data));
            }
            if timeout.is_some_and(|t| since.waited() >= t) {
                return Ok(Incoming::Idle);
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
        self.sends
            .pending
            .push_back(Outgoing::start(&self.comm.0, worker, TAG_REPLY, msg, false));
        self.check()
    }
    fn suspended(&self) -> Duration {
        suspended()
    }
    fn timeout(&self) -> Option<Duration> {
        Some(self.sends.timeout)
    }
    fn flush(&mut self) -> Result<()> {
        let (server, rank) = (self.server, self.workers + self.server);
        match self.sends.flush() {
            Some(o) => Err(worker_late(o, server, rank, self.sends.timeout)),
            None => Ok(()),
        }
    }
}

/// Polls `req` until it completes; past `timeout`, reports which ranks of `among` did
/// not reach `label` and aborts the job.
fn complete_or_abort<'a, D: ?Sized, S: Scope<'a>>(
    req: Request<'a, D, S>,
    comm: &SimpleCommunicator,
    roles: Roles,
    rank: usize,
    label: &str,
    timeout: Duration,
    among: Among,
) {
    complete_or(req, timeout, || {
        report_and_abort(comm, roles, rank, label, timeout, among)
    })
}

/// Bytes of a rank's start-up record: plan hash, world size and settings.
const RECORD: usize = 1024;
/// Bytes of a rank's host name (MPI's processor name), sent after its record.
const HOST: usize = 256;
/// Bytes of a rank's run number (its sharded states' name), sent after its host: every
/// rank takes rank 0's.
const RUN: usize = 8;

/// The run settings every rank must share, as `name=value` words: steps, the
/// synchronisation, how data is read, evaluation, tracing (every rank sends spans),
/// checkpoints (a collective on ZeRO workers) and the resumed step.
fn agreed_settings(config: &RunConfig, opts: &TrainOptions) -> Vec<String> {
    vec![
        format!("--steps={}", opts.last_step(config)),
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

/// The workers' hosts (`hosts[w]`, from the start-up exchange) against the plan's
/// nodes ([`crate::comm::check_nodes`]): a plan whose hierarchical all-reduces group
/// workers other than their hosts do is refused on every rank alike; rank 0 prints the
/// notes. Data-parallel plans only (a pipeline's or a model axis's ranks are not
/// grouped).
fn check_worker_hosts(
    programs: Programs<'_>,
    mesh: &Mesh,
    hosts: &[String],
    rank: usize,
) -> Result<()> {
    use distc_ir::Op;
    let g = programs.worker;
    if !mesh.data_parallel_only() {
        return Ok(());
    }
    let local = g
        .node_ids()
        .into_iter()
        .filter_map(|id| match g.op(id) {
            Op::AllReduce { ranks_per_node, .. } => Some(*ranks_per_node),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    match crate::comm::check_nodes(hosts, local) {
        Ok(Some(note)) if rank == 0 => eprintln!("note: {note}"),
        Ok(_) => {}
        // The plan's ranks per node against the job's hosts.
        Err(e) => return Err(RuntimeError::Config(e)),
    }
    Ok(())
}

/// Dies loudly: prints the rank's error and stops every rank of the job, with the
/// error's exit status (mpirun exits with it: `distc launch` restarts on a lost peer's).
fn fail(
    world: &SimpleCommunicator,
    rank: usize,
    role: Option<Role>,
    e: &dyn std::fmt::Display,
    code: i32,
) -> ! {
    let role = role.map_or("?".to_string(), |r| r.to_string());
    let text = e.to_string();
    let text = text.strip_prefix(&format!("{role}: ")).unwrap_or(&text);
    eprintln!("error: rank {rank} ({role}): {text}");
    world.abort(code)
}

/// Runs this process's rank of the plan on `mesh` (the launch's) under `mpirun`: a
/// worker or a server as the rank-to-role mapping says, each worker rank's kernels on
/// the backend `make(site, comm)` creates (`comm`: the workers' MPI communicator, for
/// a device communicator's bootstrap); servers stay on the CPU. Rank 0 returns the run's report
/// (metrics lines go to `on_step` there); the other ranks return `None`. An error on
/// any rank stops the job.
pub fn run_with<B: Backend>(
    programs: Programs<'_>,
    mesh: Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: &(dyn Fn(Site<'_>, Links<'_>) -> Result<B> + Sync),
) -> Result<Option<TrainReport>> {
    let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
        .ok_or_else(|| {
            RuntimeError::internal("MPI", "MPI was already initialised in this process")
        })?;
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    let roles = mesh.roles();
    // Start-up checks, decided from data every rank has, so every rank decides alike:
    // the plan, the job's size, and every run setting that must agree across ranks (a
    // rank with other --steps would leave the others waiting at its last step).
    let record = format!(
        "{}\t{}\t{}",
        mpi_run.plan_hash,
        roles.world(),
        agreed_settings(config, opts).join(" ")
    );
    // The host name travels with the record, for the nodes' check below; only the
    // record must agree.
    let host = mpi::environment::processor_name().unwrap_or_default();
    let mut mine = [0u8; RECORD + HOST + RUN];
    for (field, text) in [(0..RECORD, &record), (RECORD..RECORD + HOST, &host)] {
        let n = text.len().min(field.len());
        mine[field.start..field.start + n].copy_from_slice(&text.as_bytes()[..n]);
    }
    if let Some(c) = &opts.checkpoint {
        mine[RECORD + HOST..].copy_from_slice(&c.run_number().to_le_bytes());
    }
    let mut all = vec![0u8; (RECORD + HOST + RUN) * size];
    scope(|sc| {
        let req = world.immediate_all_gather_into(sc, &mine[..], &mut all[..]);
        complete_or_abort(
            req,
            &world,
            roles,
            rank,
            "the start-up check",
            opts.timeout,
            Among::World,
        );
    });
    let slot = |r: usize, at: std::ops::Range<usize>| {
        let base = r * (RECORD + HOST + RUN);
        String::from_utf8_lossy(&all[base + at.start..base + at.end])
            .trim_end_matches('\0')
            .to_string()
    };
    let text = |r: usize| slot(r, 0..RECORD);
    if let Some(c) = &opts.checkpoint {
        let mut run = [0u8; RUN];
        run.copy_from_slice(&all[RECORD + HOST..RECORD + HOST + RUN]);
        c.agree_run(u64::from_le_bytes(run));
    }
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
        // Ranks that would run programs that disagree.
        return Err(RuntimeError::Plan(format!(
            "rank {rank}: the ranks do not run the same plan alike: {}",
            differ.join("; ")
        )));
    }
    // What the job's ranks are: `3 workers and 1 servers`, or the mesh's mapping.
    let layout = |and: &str| {
        if mesh.data_parallel_only() {
            format!("{} workers{and} {} servers", roles.workers, roles.servers)
        } else {
            mesh.describe()
        }
    };
    if size != roles.world() {
        // Ranks srun started (a SLURM job step, no mpirun daemon behind them) are
        // started again by srun; ranks of mpirun's, inside an allocation or not, by
        // mpirun.
        let by_srun = std::env::var_os("SLURM_STEP_ID").is_some()
            && std::env::var_os("OMPI_MCA_orte_hnp_uri").is_none();
        let line = if by_srun {
            format!("srun -n {} --mpi=pmix {}", roles.world(), mpi_run.command)
        } else {
            format!("mpirun -np {} {}", roles.world(), mpi_run.command)
        };
        return Err(RuntimeError::Config(if size == 1 {
            format!(
                "--transport mpi: this plan has {}, so it runs as {} processes; start it \
                 with\n  {line}\n(as root add --allow-run-as-root; with more ranks than \
                 cores, --oversubscribe)",
                layout(" and"),
                roles.world()
            )
        } else {
            format!(
                "rank {rank}: the job has {size} ranks, the plan needs {} ({}); start it \
                 with\n  {line}",
                roles.world(),
                layout(",")
            )
        }));
    }
    if threading < mpi::Threading::Multiple {
        return Err(RuntimeError::Config(format!(
            "this MPI gives thread level {threading:?}; distc needs MPI_THREAD_MULTIPLE"
        )));
    }
    let hosts: Vec<String> = (0..roles.workers)
        .map(|r| slot(r, RECORD..RECORD + HOST))
        .collect();
    check_worker_hosts(programs, &mesh, &hosts, rank)?;
    // From here on, a rank that fails stops the job: the others may be waiting for it.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        SimpleCommunicator::world().abort(101);
    }));
    let role = roles.role(rank);
    if rank == 0 {
        // Before any rank can write a shard.
        if let Err(e) = clear_steps_to_write(config, opts) {
            fail(&world, rank, role, &e, e.exit_code());
        }
    }
    let color = if rank < roles.workers {
        Color::with_value(0)
    } else {
        Color::undefined()
    };
    let workers_comm = world.split_by_color(color);
    let ps_comm = Arc::new(Comm(world.duplicate()));
    let ctl = Arc::new(Comm(world.duplicate()));
    complete_or_abort(
        ctl.0.immediate_barrier(),
        &ctl.0,
        roles,
        rank,
        "the start of the run",
        opts.timeout,
        Among::World,
    );
    let t0 = Instant::now();
    let result = match role {
        Some(Role::Server(s)) => run_server(programs, config, opts, roles, s, &ps_comm, t0)
            .and_then(|spans| send_spans(&ctl, rank, spans, opts, mpi_run))
            .map(|()| None),
        Some(Role::Worker(_)) => {
            let parent = match workers_comm {
                Some(c) => Comm(c),
                None => fail(&world, rank, role, &"not in the workers' communicator", 1),
            };
            let mut ranks = MpiRanks {
                rank,
                parent,
                ps_comm: ps_comm.clone(),
                ctl: ctl.clone(),
                mpi_run,
                config,
                opts,
            };
            Training::new(&programs, mesh, config, opts).and_then(|training| {
                run_ranks(&training, &mut ranks, (config, opts), on_step, make)
            })
        }
        // The job's size is the plan's: every rank has one.
        None => Err(RuntimeError::internal(
            format!("rank {rank}"),
            "the rank has no role",
        )),
    };
    match result {
        Ok(report) => {
            // MPI_Finalize waits for every rank with no deadline: a bounded barrier first.
            complete_or_abort(
                ctl.0.immediate_barrier(),
                &ctl.0,
                roles,
                rank,
                "the end of the run",
                opts.timeout,
                Among::World,
            );
            // Communicators are freed before MPI_Finalize (dropping the universe).
            drop(ps_comm);
            drop(ctl);
            drop(world);
            drop(universe);
            Ok(report)
        }
        Err(e) => {
            let code = e.exit_code();
            fail(&world, rank, role, &e, code)
        }
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
    let cfg = server_config(config, opts, roles.workers);
    let mut server = Server::new(s, &mine, &cfg)?;
    server.set_tracing(opts.trace);
    server.set_timeout(opts.timeout);
    let mut link = MpiServerLink {
        comm: ps_comm.clone(),
        workers: roles.workers,
        server: s,
        sends: Sends::new(opts.timeout),
    };
    let outcome = ps::serve(server, &mut link)?;
    // The server's failure reached the workers as replies; they report it.
    Ok(server_spans(outcome.spans, t0))
}

/// A rank other than 0 sends its spans to rank 0 and writes its own trace file.
fn send_spans(
    ctl: &Comm,
    rank: usize,
    spans: Vec<Span>,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
) -> Result<()> {
    if opts.trace {
        let text = serde_json::to_vec(&spans).unwrap_or_default();
        if let Some(path) = &mpi_run.trace {
            let trace = crate::run::trace::chrome_trace(&spans).to_string();
            let _ = crate::core::output::write_file(&rank_path(path, rank), trace.as_bytes());
        }
        let mut out = Outgoing::start(&ctl.0, 0, TAG_SPANS, text, false);
        if !out.wait_for(opts.timeout) {
            return Err(RuntimeError::Peer {
                rank,
                peer: 0,
                op: "trace spans".into(),
                kind: PeerKind::TimedOut,
                message: format!(
                    "worker rank 0 did not take this rank's trace spans within {:.0} s \
                     (--timeout)",
                    opts.timeout.as_secs_f64()
                ),
            });
        }
    }
    Ok(())
}

/// Rank 0 takes every other rank's trace spans into `spans` (when tracing), and writes
/// its own (the tracks named from `own`) to its rank's trace file.
fn gather_spans(
    ctl: &Comm,
    ranks: usize,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
    own: &str,
    spans: &mut Vec<Span>,
) -> Result<()> {
    if !opts.trace {
        return Ok(());
    }
    let mut left: Vec<usize> = (1..ranks).collect();
    let since = Since::now();
    let mut backoff = Backoff(0);
    while !left.is_empty() {
        let Some((msg, st)) = ctl
            .0
            .any_process()
            .immediate_matched_probe_with_tag(TAG_SPANS)
        else {
            if since.waited() >= opts.timeout {
                return Err(RuntimeError::Peer {
                    rank: 0,
                    peer: left[0],
                    op: "trace spans".into(),
                    kind: PeerKind::TimedOut,
                    message: format!(
                        "rank(s) {left:?} did not send their trace spans within {:.0} s \
                         (--timeout)",
                        opts.timeout.as_secs_f64()
                    ),
                });
            }
            backoff.wait();
            continue;
        };
        let (bytes, st) = (msg, st).matched_receive_vec::<u8>();
        let from = st.source_rank() as usize;
        left.retain(|&r| r != from);
        let theirs: Vec<Span> = serde_json::from_slice(&bytes).map_err(|e| RuntimeError::Peer {
            rank: 0,
            peer: from,
            op: "trace spans".into(),
            kind: PeerKind::Malformed,
            message: format!("malformed spans: {e}"),
        })?;
        spans.extend(theirs);
    }
    if let Some(path) = &mpi_run.trace {
        let mine: Vec<Span> = spans
            .iter()
            .filter(|s| s.track.starts_with(own))
            .cloned()
            .collect();
        let trace = crate::run::trace::chrome_trace(&mine).to_string();
        crate::core::output::write_file(&rank_path(path, 0), trace.as_bytes())?;
    }
    Ok(())
}

/// The file of rank `rank`'s own metrics lines (`--metrics` with `.rankR`), if asked.
fn rank_metrics(
    mpi_run: &MpiRun,
    rank: usize,
) -> Result<Option<std::io::BufWriter<std::fs::File>>> {
    let Some(p) = &mpi_run.metrics else {
        return Ok(None);
    };
    let path = rank_path(p, rank);
    let file = std::fs::File::create(&path).map_err(|source| RuntimeError::Io { path, source })?;
    Ok(Some(std::io::BufWriter::new(file)))
}

/// Rank `rank`'s communicators, by axis: `parent` (the workers', or the world of a
/// pipeline's ranks) split by its group on each axis the mesh links. Every rank of
/// `parent` calls it, and splits in the same order ([`Mesh::axes`]).
fn link_axes(
    mesh: &Mesh,
    rank: usize,
    parent: &SimpleCommunicator,
    ctl: &Arc<Comm>,
    timeout: Duration,
) -> Result<AxisComms> {
    let mut comms = AxisComms::default();
    for axis in mesh.axes() {
        let (group, key) = mesh.group(axis, rank);
        // Every rank splits with a color of its own group: it is in each.
        let Some(linked) =
            parent.split_by_color_with_key(Color::with_value(group as i32), key as i32)
        else {
            return Err(RuntimeError::internal(
                format!("rank {rank}"),
                format!("not in its {} axis's communicator", axis.name()),
            ));
        };
        let linked = MpiComm::new(Comm(linked), ctl.clone(), mesh.roles(), rank, timeout);
        comms.insert(axis, Box::new(linked));
    }
    Ok(comms)
}

/// The MPI transport: this process is one worker rank of the job.
struct MpiRanks<'r> {
    rank: usize,
    /// The workers' communicator, which each axis splits.
    parent: Comm,
    ps_comm: Arc<Comm>,
    ctl: Arc<Comm>,
    mpi_run: &'r MpiRun,
    config: &'r RunConfig,
    opts: &'r TrainOptions,
}

impl Transport for MpiRanks<'_> {
    fn local(&self, _: &Mesh) -> Vec<usize> {
        vec![self.rank]
    }

    fn link(&mut self, mesh: &Mesh, opts: &TrainOptions) -> Result<Vec<AxisComms>> {
        let comms = link_axes(mesh, self.rank, &self.parent.0, &self.ctl, opts.timeout)?;
        Ok(vec![comms])
    }

    fn servers(&mut self, w: usize) -> Option<PsClient> {
        let roles = Roles {
            workers: self.parent.0.size() as usize,
            servers: self.mpi_run.servers,
        };
        (roles.servers > 0).then(|| {
            let link = MpiWorkerLink {
                comm: self.ps_comm.clone(),
                rank: w,
                workers: roles.workers,
                sends: Sends::new(self.opts.timeout),
            };
            PsClient::new(
                w,
                roles.workers,
                roles.servers,
                Box::new(link),
                self.opts.timeout,
            )
        })
    }

    fn run<'t>(
        &mut self,
        roles: Vec<LocalRole<'t>>,
        training: &Training<'_>,
        run: &(dyn Fn(usize, Trainee<'t>, Report<'_>) -> Result<WorkerOutcome> + Sync),
        coordinator: Option<&mut dyn FnMut(StepReport) -> Result<()>>,
        _: &ErrorSlot,
    ) -> Result<Vec<WorkerOutcome>> {
        use std::io::Write;
        let Some(LocalRole {
            worker,
            name,
            trainee,
        }) = roles.into_iter().next()
        else {
            return Err(RuntimeError::internal(
                format!("rank {}", self.rank),
                "the rank has no role to run",
            ));
        };
        let (config, opts) = (self.config, self.opts);
        let mesh = training.mesh();
        let last_step = opts.last_step(config);
        // This rank's own metrics lines, when asked (`--metrics` with `.rankR`).
        let mut local = rank_metrics(self.mpi_run, worker)?;
        let mut write_local = move |rep: &StepReport| -> Result<()> {
            let Some(w) = local.as_mut() else {
                return Ok(());
            };
            let line = serde_json::to_string(&training.local_line(config, rep))
                .map_err(|e| RuntimeError::internal("the metrics", e.to_string()))?;
            writeln!(w, "{line}").map_err(|source| RuntimeError::Io {
                path: PathBuf::from("metrics"),
                source,
            })?;
            if rep.step == last_step {
                let _ = w.flush();
            }
            Ok(())
        };
        let ctl = &self.ctl;
        let outcome = match coordinator {
            None => {
                let mut to_rank0 = ToRank0::new(worker, mesh, last_step, opts.timeout);
                run(worker, trainee, &mut |rep| {
                    write_local(&rep)?;
                    to_rank0.send(ctl, rep.step, &rep)
                })?
            }
            // Rank 0: its role on a thread, the coordinator here.
            Some(sink) => {
                let role = |tx: mpsc::Sender<StepReport>| {
                    let mut to_coordinator = reporter(tx, worker);
                    run(worker, trainee, &mut |rep| {
                        write_local(&rep)?;
                        to_coordinator(rep)
                    })
                };
                let reported = training.reported(config, opts);
                drain_on_rank0(&name, mesh, ctl, reported, opts.timeout, role, sink)?
            }
        };
        Ok(vec![outcome])
    }

    fn gather(
        &mut self,
        mut spans: Vec<Span>,
        training: &Training<'_>,
        _: Instant,
    ) -> Result<Option<Vec<Span>>> {
        let (ctl, opts, mpi_run) = (&self.ctl, self.opts, self.mpi_run);
        if self.rank != 0 {
            send_spans(ctl, self.rank, spans, opts, mpi_run)?;
            return Ok(None);
        }
        let world = training.mesh().roles().world();
        gather_spans(ctl, world, opts, mpi_run, training.own_tracks(), &mut spans)?;
        Ok(Some(spans))
    }
}

/// `distc calibrate` under `mpirun`: [`crate::comm::calibrate::sweep`] over every rank
/// of the job, each a worker. Rank 0 returns the samples and every rank's host name
/// (so the caller knows whether the ring crossed machines); the others return `None`.
pub fn calibrate(
    sizes: &[usize],
    reps: usize,
    timeout: Duration,
) -> Result<Option<(crate::comm::calibrate::Sweep, Vec<String>)>> {
    let (universe, _) =
        mpi::initialize_with_threading(mpi::Threading::Multiple).ok_or_else(|| {
            RuntimeError::internal("MPI", "MPI was already initialised in this process")
        })?;
    let world = universe.world();
    let size = world.size() as usize;
    let rank = world.rank() as usize;
    let roles = Roles {
        workers: size,
        servers: 0,
    };
    let ctl = Arc::new(Comm(world.duplicate()));
    let mut comm = MpiComm::new(Comm(world.duplicate()), ctl, roles, rank, timeout);
    let host = mpi::environment::processor_name().unwrap_or_default();
    let hosts = comm
        .all_gather(host.into_bytes())?
        .into_iter()
        .map(|h| String::from_utf8_lossy(&h).into_owned())
        .collect();
    let samples = crate::comm::calibrate::sweep(&mut comm, sizes, reps)?;
    comm.barrier()?;
    drop(comm);
    Ok((rank == 0).then_some((samples, hosts)))
}
