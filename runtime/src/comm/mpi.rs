//! Ranks as MPI processes (feature `mpi`): the [`Communicator`] among workers, the
//! parameter-server links, and [`run`], which runs one rank of a plan under `mpirun`
//! with the same training loop as the in-process runtime.
//!
//! Ranks and roles follow [`crate::roles`]: `mpirun -np N+S`, ranks `0..N` are
//! workers, `N..N+S` servers. Start-up: every rank gathers every rank's plan hash and
//! world size and stops, naming the rank, when one differs from rank 0's.
//!
//! Thread level: `MPI_THREAD_MULTIPLE`. A worker's collectives run on its
//! communication thread (so bucket all-reduces overlap the backward pass) while the
//! worker thread talks to the servers, and rank 0's coordinator thread receives the
//! other workers' step reports: three threads make MPI calls at once. Each uses its own
//! communicator (the workers' split for collectives, duplicates of the world for
//! server traffic and for control messages), so the order of operations on each
//! communicator is the same on every rank.
//!
//! Collectives are MPI's own (`MPI_Iallreduce`, `MPI_Iallgatherv`,
//! `MPI_Ireduce_scatter_block`, `MPI_Ibcast`), started non-blocking and polled with a
//! deadline (`--timeout`): blocking MPI calls cannot time out, and OpenMPI's blocking
//! calls spin a core, which the compute threads need. Bytes are counted as the ring
//! algorithms of the in-process communicator count them, so metrics and the cost
//! model's prediction compare across transports.
//!
//! Never a hang: a collective that does not complete in time makes the rank send its
//! status (op, IR node, step) to every rank, collect the others' for a moment, print
//! which ranks arrived at that op and which did not, and abort the job. A rank's error
//! is printed by that rank, which then aborts the job (MPI has no other way to stop
//! ranks blocked in a collective); a killed rank makes `mpirun` stop the others.

use super::{chunk_range, ByteCount, Communicator};
use crate::backend::{Backend, Cpu};
use crate::config::RunConfig;
use crate::error::{Result, RuntimeError};
use crate::metrics::StepMetrics;
use crate::ps::transport::{ServerLink, WorkerLink};
use crate::ps::{self, PsClient, PsConfig, Server};
use crate::roles::{Role, Roles};
use crate::trace::Span;
use crate::train::{
    open_data, pulled_types, server_shards, Coordinator, Programs, TrainOptions, TrainReport,
};
use crate::worker::{run_worker_on, ErrorSlot, StepReport, WorkerSetup};
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::request::{scope, Request, Scope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::Communicator as _;
use mpi::traits::*;
use mpi::Tag;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

const TAG_REQUEST: Tag = 101;
const TAG_REPLY: Tag = 102;
const TAG_REPORT: Tag = 103;
const TAG_SPANS: Tag = 104;
const TAG_STATUS: Tag = 105;
const TAG_P2P: Tag = 106;

/// A communicator shared by threads.
struct Comm(SimpleCommunicator);

// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (checked in `run`), under which
// MPI calls on one communicator from several threads are allowed; `MPI_Comm` is a
// handle (a pointer in OpenMPI) that MPI itself synchronises. Each communicator is used
// for one purpose by one thread at a time (see the module doc), so no two threads
// interleave a collective on the same one.
#[allow(unsafe_code)]
unsafe impl Send for Comm {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Comm {}

/// Waits between polls: spins briefly (most collectives finish within microseconds of
/// the last rank arriving), then sleeps up to 200 µs, so a waiting rank leaves the cores
/// to computing threads.
struct Backoff(u32);

impl Backoff {
    fn wait(&mut self) {
        self.0 += 1;
        if self.0 < 50 {
            std::thread::yield_now();
        } else {
            let us = (10u64 << ((self.0 - 50) / 20).min(5)).min(200);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

/// What one rank is doing when a collective times out, as sent to the others.
fn status_line(rank: usize, label: &str) -> String {
    format!("{rank}\t{label}")
}

/// Reports a timed-out collective on every rank that can still speak, then aborts
/// the job. `label` names the op, IR node and step.
fn timed_out(ctl: &Comm, roles: Roles, rank: usize, label: &str, timeout: Duration) -> ! {
    let world = &ctl.0;
    let mine = status_line(rank, label);
    for other in 0..world.size() as usize {
        if other != rank {
            world
                .process_at_rank(other as i32)
                .send_with_tag(mine.as_bytes(), TAG_STATUS);
        }
    }
    // Ranks stuck in the same collective time out at about the same moment.
    let grace = Instant::now() + Duration::from_secs(2);
    let mut arrived = vec![rank];
    let mut elsewhere = Vec::new();
    let mut backoff = Backoff(0);
    while Instant::now() < grace {
        if let Some((msg, st)) = world
            .any_process()
            .immediate_matched_probe_with_tag(TAG_STATUS)
        {
            let (bytes, _) = (msg, st).matched_receive_vec::<u8>();
            let text = String::from_utf8_lossy(&bytes).into_owned();
            let mut parts = text.splitn(2, '\t');
            let r: usize = parts
                .next()
                .and_then(|r| r.parse().ok())
                .unwrap_or(usize::MAX);
            let theirs = parts.next().unwrap_or("");
            if theirs == label {
                arrived.push(r);
            } else {
                elsewhere.push(format!("rank {r} is in {theirs}"));
            }
        } else {
            backoff.wait();
        }
    }
    arrived.sort_unstable();
    let missing: Vec<usize> = (0..roles.workers)
        .filter(|r| !arrived.contains(r))
        .collect();
    let role = roles.role(rank).map_or("?".into(), |r| r.to_string());
    let mut m = format!(
        "error: rank {rank} ({role}): {label} did not complete within {:.0} s (--timeout); \
         ranks that arrived: {arrived:?}; workers that did not: {missing:?}",
        timeout.as_secs_f64()
    );
    if !elsewhere.is_empty() {
        m += &format!(" ({})", elsewhere.join("; "));
    }
    eprintln!("{m}");
    world.abort(3)
}

/// The communicator among the workers over MPI.
pub struct MpiComm {
    comm: Comm,
    ctl: Arc<Comm>,
    roles: Roles,
    world_rank: usize,
    rank: usize,
    size: usize,
    timeout: Duration,
    bytes: ByteCount,
    label: String,
}

impl MpiComm {
    /// Polls `req` until it completes; past the deadline, reports and aborts.
    fn finish<'a, D: ?Sized, S: Scope<'a>>(&self, mut req: Request<'a, D, S>) {
        let deadline = Instant::now() + self.timeout;
        let mut backoff = Backoff(0);
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            if Instant::now() >= deadline {
                // An MPI collective cannot be cancelled: the job stops here.
                timed_out(
                    &self.ctl,
                    self.roles,
                    self.world_rank,
                    &self.label,
                    self.timeout,
                );
            }
            backoff.wait();
        }
    }

    /// Bytes of a ring all-reduce of `len` elements of `size` bytes (as the in-process
    /// ring counts them: every chunk but one, twice).
    fn count_all_reduce(&mut self, len: usize, size: usize) {
        let (n, r) = (self.size, self.rank);
        let chunk = |c: usize| chunk_range(len, n, c % n).len();
        let sent = (len - chunk(r)) + (len - chunk(r + 1));
        let received = (len - chunk(r + n - 1)) + (len - chunk(r));
        self.bytes.sent += (sent * size) as u64;
        self.bytes.received += (received * size) as u64;
    }

    fn all_reduce_any<T: Equivalence + Copy + std::ops::Div<Output = T>>(
        &mut self,
        buf: &mut [T],
        mean: bool,
        count: T,
    ) -> std::result::Result<(), RuntimeError> {
        if self.size <= 1 {
            return Ok(());
        }
        self.check_len(buf.len() as u64, "all_reduce")?;
        let send = buf.to_vec();
        scope(|sc| {
            let req = self.comm.0.immediate_all_reduce_into(
                sc,
                &send[..],
                &mut buf[..],
                SystemOperation::sum(),
            );
            self.finish(req);
        });
        if mean {
            for x in buf.iter_mut() {
                *x = *x / count;
            }
        }
        self.count_all_reduce(buf.len(), std::mem::size_of::<T>());
        Ok(())
    }

    /// Every rank must pass the same length; a mismatch is an error on every rank.
    fn check_len(&mut self, len: u64, op: &str) -> std::result::Result<(), RuntimeError> {
        let mut all = vec![0u64; self.size];
        scope(|sc| {
            let req = self
                .comm
                .0
                .immediate_all_gather_into(sc, &len, &mut all[..]);
            self.finish(req);
        });
        if all.iter().any(|&l| l != len) {
            return Err(RuntimeError::Config(format!(
                "rank {}: {op}: buffer lengths differ across workers: {all:?}",
                self.rank
            )));
        }
        Ok(())
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce(&mut self, buf: &mut [f32], mean: bool) -> std::result::Result<(), RuntimeError> {
        let n = self.size as f32;
        self.all_reduce_any(buf, mean, n)
    }
    fn all_reduce_f64(
        &mut self,
        buf: &mut [f64],
        mean: bool,
    ) -> std::result::Result<(), RuntimeError> {
        let n = self.size as f64;
        self.all_reduce_any(buf, mean, n)
    }
    fn all_gather(&mut self, mine: Vec<u8>) -> std::result::Result<Vec<Vec<u8>>, RuntimeError> {
        let n = self.size;
        if n <= 1 {
            return Ok(vec![mine]);
        }
        let len = i32::try_from(mine.len()).map_err(|_| {
            RuntimeError::Config(format!(
                "all_gather of {} bytes: more than MPI counts",
                mine.len()
            ))
        })?;
        let mut counts = vec![0i32; n];
        scope(|sc| {
            let req = self
                .comm
                .0
                .immediate_all_gather_into(sc, &len, &mut counts[..]);
            self.finish(req);
        });
        let mut displs = Vec::with_capacity(n);
        let mut total: i64 = 0;
        for &c in &counts {
            displs.push(
                i32::try_from(total).map_err(|_| {
                    RuntimeError::Config("all_gather: more than 2 GiB in all".into())
                })?,
            );
            total += i64::from(c);
        }
        let mut all = vec![0u8; total as usize];
        {
            let mut part = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            scope(|sc| {
                let req = self
                    .comm
                    .0
                    .immediate_all_gather_varcount_into(sc, &mine[..], &mut part);
                self.finish(req);
            });
        }
        let total = total as usize;
        let next = counts[(self.rank + 1) % n] as usize;
        self.bytes.sent += (total - next) as u64;
        self.bytes.received += (total - mine.len()) as u64;
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| all[d as usize..(d + c) as usize].to_vec())
            .collect())
    }
    fn reduce_scatter(
        &mut self,
        buf: &[f32],
        mean: bool,
    ) -> std::result::Result<Vec<f32>, RuntimeError> {
        let (n, r, len) = (self.size, self.rank, buf.len());
        if n <= 1 {
            return Ok(buf.to_vec());
        }
        self.check_len(len as u64, "reduce_scatter")?;
        // MPI's block reduce-scatter wants equal blocks: chunk i of `chunk_range` goes
        // to block i, padded to the longest chunk.
        let block = chunk_range(len, n, 0).len();
        let mut send = vec![0f32; block * n];
        for i in 0..n {
            let c = chunk_range(len, n, i);
            send[i * block..i * block + c.len()].copy_from_slice(&buf[c]);
        }
        let mut recv = vec![0f32; block];
        scope(|sc| {
            let req = self.comm.0.immediate_reduce_scatter_block_into(
                sc,
                &send[..],
                &mut recv[..],
                SystemOperation::sum(),
            );
            self.finish(req);
        });
        recv.truncate(chunk_range(len, n, r).len());
        if mean {
            recv.iter_mut().for_each(|x| *x /= n as f32);
        }
        self.bytes.sent += ((len - chunk_range(len, n, r).len()) * 4) as u64;
        self.bytes.received += ((len - chunk_range(len, n, (r + n - 1) % n).len()) * 4) as u64;
        Ok(recv)
    }
    fn broadcast(
        &mut self,
        buf: &mut Vec<u8>,
        root: usize,
    ) -> std::result::Result<(), RuntimeError> {
        let n = self.size;
        if n <= 1 {
            return Ok(());
        }
        if root >= n {
            return Err(RuntimeError::Config(format!(
                "broadcast from rank {root} of {n}"
            )));
        }
        let mut len = buf.len() as u64;
        scope(|sc| {
            let req = self
                .comm
                .0
                .process_at_rank(root as i32)
                .immediate_broadcast_into(sc, &mut len);
            self.finish(req);
        });
        let mine = buf.len() as u64;
        let mut data = if self.rank == root {
            std::mem::take(buf)
        } else {
            vec![0u8; len as usize]
        };
        scope(|sc| {
            let req = self
                .comm
                .0
                .process_at_rank(root as i32)
                .immediate_broadcast_into(sc, &mut data[..]);
            self.finish(req);
        });
        if (self.rank + 1) % n != root {
            self.bytes.sent += len;
        }
        if self.rank != root {
            self.bytes.received += len;
        }
        let ok = mine == len;
        *buf = data;
        if !ok {
            return Err(RuntimeError::Config(format!(
                "rank {}: broadcast of {len} bytes from rank {root} into a buffer of {mine}",
                self.rank
            )));
        }
        Ok(())
    }
    fn barrier(&mut self) -> std::result::Result<(), RuntimeError> {
        let req = self.comm.0.immediate_barrier();
        self.finish(req);
        Ok(())
    }
    fn send(&mut self, to: usize, data: Vec<u8>) -> std::result::Result<(), RuntimeError> {
        if to >= self.size {
            return Err(RuntimeError::Config(format!(
                "send to rank {to} of {}",
                self.size
            )));
        }
        self.comm
            .0
            .process_at_rank(to as i32)
            .send_with_tag(&data[..], TAG_P2P);
        self.bytes.sent += data.len() as u64;
        Ok(())
    }
    fn recv(&mut self, from: usize) -> std::result::Result<Vec<u8>, RuntimeError> {
        if from >= self.size {
            return Err(RuntimeError::Config(format!(
                "recv from rank {from} of {}",
                self.size
            )));
        }
        let deadline = Instant::now() + self.timeout;
        let mut backoff = Backoff(0);
        loop {
            let p = self.comm.0.process_at_rank(from as i32);
            if let Some((msg, st)) = p.immediate_matched_probe_with_tag(TAG_P2P) {
                let (data, _) = (msg, st).matched_receive_vec::<u8>();
                self.bytes.received += data.len() as u64;
                return Ok(data);
            }
            if Instant::now() >= deadline {
                timed_out(
                    &self.ctl,
                    self.roles,
                    self.world_rank,
                    &self.label,
                    self.timeout,
                );
            }
            backoff.wait();
        }
    }
    fn bytes(&self) -> ByteCount {
        self.bytes
    }
    fn set_label(&mut self, label: &str) {
        label.clone_into(&mut self.label);
    }
}

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

/// What the launcher needs beyond the programs and options.
#[derive(Clone, Debug, Default)]
pub struct MpiRun {
    /// The plan's hash, compared across ranks at start-up.
    pub plan_hash: String,
    /// Parameter servers S.
    pub servers: usize,
    /// The global metrics file (rank 0); every worker also writes its own lines to this
    /// path with `.rankR` before the extension.
    pub metrics: Option<PathBuf>,
    /// Where each rank writes its own spans (`.rankR` inserted), when tracing.
    pub trace: Option<PathBuf>,
    /// The command to suggest when started outside `mpirun` (the `-np` is added).
    pub command: String,
}

/// `path` with `.rankR` before its extension: `m.jsonl` -> `m.rank1.jsonl`.
pub fn rank_path(path: &std::path::Path, rank: usize) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
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
/// rank-to-role mapping says. Rank 0 returns the run's report (metrics lines go to
/// `on_step` there); the other ranks return `None`. An error on any rank stops the job.
pub fn run(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    mpi_run: &MpiRun,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<Option<TrainReport>> {
    run_with(programs, config, opts, mpi_run, on_step, &|_, _| Ok(Cpu))
}

/// [`run`], each worker rank's kernels on the backend `make(rank, comm)` creates
/// (`comm`: the workers' MPI communicator, for a device communicator's bootstrap);
/// servers stay on the CPU.
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
    // Start-up checks, decided from data every rank has, so every rank decides alike.
    let record = format!("{}\t{}", mpi_run.plan_hash, roles.world());
    let mut mine = [0u8; 96];
    let n = record.len().min(mine.len());
    mine[..n].copy_from_slice(&record.as_bytes()[..n]);
    let mut all = vec![0u8; 96 * size];
    world.all_gather_into(&mine[..], &mut all[..]);
    let text = |r: usize| {
        String::from_utf8_lossy(&all[r * 96..(r + 1) * 96])
            .trim_end_matches('\0')
            .to_string()
    };
    let differ: Vec<String> = (1..size)
        .filter(|&r| text(r) != text(0))
        .map(|r| {
            let (h, w) = text(r)
                .split_once('\t')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .unwrap_or_default();
            let (h0, w0) = text(0)
                .split_once('\t')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .unwrap_or_default();
            if h != h0 {
                format!(
                    "rank {r} runs another plan (hash {}… vs rank 0's {}…)",
                    &h[..h.len().min(12)],
                    &h0[..h0.len().min(12)]
                )
            } else {
                format!("rank {r}'s plan needs {w} ranks, rank 0's {w0}")
            }
        })
        .collect();
    if !differ.is_empty() {
        return Err(RuntimeError::Config(format!(
            "rank {rank}: the ranks do not run the same plan: {}",
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
            let trace = crate::trace::chrome_trace(&spans).to_string();
            let _ = crate::output::write_file(&rank_path(path, rank), trace.as_bytes());
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
    let size = comm.0.size() as usize;
    let mpi_comm = MpiComm {
        comm,
        ctl: ctl.clone(),
        roles,
        world_rank: r,
        rank: r,
        size,
        timeout: opts.timeout,
        bytes: ByteCount::default(),
        label: "the start".into(),
    };
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
    let k = crate::train::micro_batches(programs.worker);
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
                let trace = crate::trace::chrome_trace(&own).to_string();
                crate::output::write_file(&rank_path(path, 0), trace.as_bytes())?;
            }
        }
        let types = ps::check_shards(&server_shards(
            programs.servers,
            &pulled_types(programs.worker),
        )?)?;
        let mut params = outcome.params;
        params.extend(ps::assemble(outcome.server_shards, &types)?);
        let c = coordinator;
        Ok(Some(TrainReport {
            steps: c.steps,
            first_loss: c.first_loss,
            final_loss: c.final_loss,
            eval: c.eval,
            train_time: c.train_time,
            samples_per_sec: (c.steps * roles.workers * k * config.batch) as f64
                / c.train_time.as_secs_f64().max(1e-9),
            params,
            profile: outcome.profile,
            spans,
        }))
    })
}
