//! The workers' [`Communicator`] over MPI (feature `mpi`), and what the MPI launcher
//! (`crate::run::mpi`) shares with it: a thread-safe communicator handle, the polling
//! back-off and the message tags.
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
//! which ranks arrived at that op and which did not, and abort the job. Sends are
//! non-blocking too ([`Outgoing`]): a blocking `MPI_Send` of a large message waits, with
//! no deadline and a core spinning, until the receiver takes it, which a stalled rank
//! never does.

use super::{chunk_range, ByteCount, Communicator};
use crate::core::error::RuntimeError;
use crate::core::roles::Roles;
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::request::{scope, Request, Scope, StaticScope};
use mpi::topology::SimpleCommunicator;
use mpi::traits::Communicator as _;
use mpi::traits::*;
use mpi::Tag;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub(crate) const TAG_REQUEST: Tag = 101;
pub(crate) const TAG_REPLY: Tag = 102;
pub(crate) const TAG_REPORT: Tag = 103;
pub(crate) const TAG_SPANS: Tag = 104;
pub(crate) const TAG_STATUS: Tag = 105;
pub(crate) const TAG_P2P: Tag = 106;

/// A communicator shared by threads.
pub(crate) struct Comm(pub(crate) SimpleCommunicator);

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
pub(crate) struct Backoff(pub(crate) u32);

impl Backoff {
    pub(crate) fn wait(&mut self) {
        self.0 += 1;
        if self.0 < 50 {
            std::thread::yield_now();
        } else {
            let us = (10u64 << ((self.0 - 50) / 20).min(5)).min(200);
            std::thread::sleep(Duration::from_micros(us));
        }
    }
}

/// How often the suspension clock ticks, and the gap between ticks that counts as this
/// process having been suspended.
const TICK: Duration = Duration::from_millis(100);
const SUSPENSION: Duration = Duration::from_secs(1);

/// The suspension clock: time this process spent suspended (gaps in the ticker's
/// ticks) and when the ticker last ticked.
struct Clock {
    suspended: Duration,
    last_tick: Instant,
}

static CLOCK: OnceLock<Mutex<Clock>> = OnceLock::new();

fn clock() -> std::sync::MutexGuard<'static, Clock> {
    let c = CLOCK.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("suspension-clock".into())
            .spawn(|| loop {
                std::thread::sleep(TICK);
                let mut c = clock();
                let now = Instant::now();
                let gap = now.saturating_duration_since(c.last_tick);
                if gap > SUSPENSION {
                    c.suspended += gap - TICK;
                }
                c.last_tick = now;
            });
        Mutex::new(Clock {
            suspended: Duration::ZERO,
            last_tick: Instant::now(),
        })
    });
    c.lock().unwrap_or_else(|p| p.into_inner())
}

/// Time this process has spent suspended (`SIGSTOP`, or starved of the CPU for more
/// than a second) since it first asked. A stalled rank that is continued (`mpirun`
/// sends `SIGCONT` before it kills one) must not blame the ranks it waited on for its
/// own lost time: every deadline on a peer leaves this time out.
pub(crate) fn suspended() -> Duration {
    let c = clock();
    // A gap the ticker has not seen yet (it may wake after the thread asking).
    let gap = c.last_tick.elapsed();
    let unseen = if gap > SUSPENSION {
        gap - TICK
    } else {
        Duration::ZERO
    };
    c.suspended + unseen
}

/// A moment to measure a wait on a peer from: [`Since::waited`] leaves out the time
/// this process was suspended meanwhile.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Since {
    at: Instant,
    suspended: Duration,
}

impl Since {
    pub(crate) fn now() -> Since {
        Since {
            suspended: suspended(),
            at: Instant::now(),
        }
    }

    /// Time since then that this process was running.
    pub(crate) fn waited(&self) -> Duration {
        let lost = suspended().saturating_sub(self.suspended);
        self.at.elapsed().saturating_sub(lost)
    }
}

/// A point-to-point send that owns its buffer, started non-blocking (`MPI_Isend`, or
/// `MPI_Issend` when the sender must learn that the receiver took it) and polled with
/// [`Outgoing::done`], so a sender can give up on a receiver that stopped answering.
/// Dropped while still active, the request is freed and the buffer leaked (MPI may still
/// read it): that happens only on the way to aborting the job.
pub(crate) struct Outgoing {
    req: Option<Request<'static, [u8], StaticScope>>,
    buf: Vec<u8>,
    /// The destination rank in the communicator it was sent on.
    pub(crate) to: usize,
    /// When it was started.
    pub(crate) since: Since,
}

// SAFETY: the request is an MPI handle, used under MPI_THREAD_MULTIPLE by one thread at
// a time (whoever owns the `Outgoing`); the buffer is plain bytes.
#[allow(unsafe_code)]
unsafe impl Send for Outgoing {}

impl Outgoing {
    /// Starts sending `buf` to rank `to` of `comm` with `tag`; `synchronous`: completes
    /// only once the receiver has matched it (`MPI_Issend`).
    pub(crate) fn start(
        comm: &SimpleCommunicator,
        to: usize,
        tag: Tag,
        buf: Vec<u8>,
        synchronous: bool,
    ) -> Outgoing {
        // SAFETY: the slice is `buf`'s heap allocation, which this `Outgoing` owns and
        // neither changes nor frees while the request is active: `done` drops the
        // request only once MPI has completed it, and `Drop` leaks the buffer of a request
        // still active. Moving the `Outgoing` moves the `Vec`, not its allocation.
        #[allow(unsafe_code)]
        let data: &'static [u8] = unsafe { std::slice::from_raw_parts(buf.as_ptr(), buf.len()) };
        let p = comm.process_at_rank(to as i32);
        let req = if synchronous {
            p.immediate_synchronous_send_with_tag(StaticScope, data, tag)
        } else {
            p.immediate_send_with_tag(StaticScope, data, tag)
        };
        Outgoing {
            req: Some(req),
            buf,
            to,
            since: Since::now(),
        }
    }

    /// Whether the send has completed (the buffer is MPI's no more).
    pub(crate) fn done(&mut self) -> bool {
        match self.req.take() {
            None => true,
            Some(r) => match r.test() {
                Ok(_) => true,
                Err(r) => {
                    self.req = Some(r);
                    false
                }
            },
        }
    }

    /// Polls until the send completes or it has waited `timeout`; whether it completed.
    pub(crate) fn wait_for(&mut self, timeout: Duration) -> bool {
        let mut backoff = Backoff(0);
        loop {
            if self.done() {
                return true;
            }
            if self.since.waited() >= timeout {
                return false;
            }
            backoff.wait();
        }
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        if self.done() {
            return;
        }
        if let Some(r) = self.req.take() {
            // SAFETY: the request is active and dropped here; MPI_Request_free lets the
            // send go on without a handle, so its buffer must outlive it: leaked.
            #[allow(unsafe_code)]
            unsafe {
                let (mut raw, _, _) = r.into_raw();
                mpi::ffi::MPI_Request_free(&mut raw);
            }
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

/// Which ranks a timed-out wait names as missing: the workers (a collective among
/// them) or every rank of the job.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Among {
    Workers,
    World,
}

/// What one rank is doing when a collective times out, as sent to the others.
fn status_line(rank: usize, label: &str) -> String {
    format!("{rank}\t{label}")
}

/// Polls `req` until it completes, backing off; once it has waited `timeout` (time
/// this rank spent suspended not counted), `abort` ends the job.
pub(crate) fn complete_or<'a, D: ?Sized, S: Scope<'a>>(
    mut req: Request<'a, D, S>,
    timeout: Duration,
    abort: impl FnOnce() -> std::convert::Infallible,
) {
    let since = Since::now();
    let mut backoff = Backoff(0);
    loop {
        match req.test() {
            Ok(_) => return,
            Err(r) => req = r,
        }
        if since.waited() >= timeout {
            // Uninhabited: `abort` never returns.
            abort();
        }
        backoff.wait();
    }
}

/// Reports a timed-out collective on every rank that can still speak, then aborts
/// the job. `label` names the op, IR node and step.
fn timed_out(ctl: &Comm, roles: Roles, rank: usize, label: &str, timeout: Duration) -> ! {
    report_and_abort(&ctl.0, roles, rank, label, timeout, Among::Workers)
}

/// How long a rank that timed out collects the others' status before it reports.
const GRACE: Duration = Duration::from_secs(2);

/// [`timed_out`] on any communicator spanning the world (ranks are world ranks), naming
/// as missing the ranks of `among` that did not report being at `label`.
pub(crate) fn report_and_abort(
    world: &SimpleCommunicator,
    roles: Roles,
    rank: usize,
    label: &str,
    timeout: Duration,
    among: Among,
) -> ! {
    let mine = status_line(rank, label);
    // Never blocking: a stalled rank never takes its copy.
    let _sent: Vec<Outgoing> = (0..world.size() as usize)
        .filter(|&other| other != rank)
        .map(|other| Outgoing::start(world, other, TAG_STATUS, mine.clone().into_bytes(), false))
        .collect();
    // Ranks stuck in the same collective time out at about the same moment.
    let grace = Instant::now() + GRACE;
    let mut arrived = vec![rank];
    let mut elsewhere = Vec::new();
    // Every rank that answered at all: one that did not is stopped or stuck outside
    // any bounded wait, the likely cause, so it is named apart.
    let mut heard = vec![rank];
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
            heard.push(r);
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
    let (everyone, who) = match among {
        Among::Workers => (roles.workers, "workers"),
        Among::World => (roles.world(), "ranks"),
    };
    let missing: Vec<usize> = (0..everyone).filter(|r| !arrived.contains(r)).collect();
    let role = roles.role(rank).map_or("?".into(), |r| r.to_string());
    let mut m = format!(
        "error: rank {rank} ({role}): {label} did not complete within {:.0} s (--timeout); \
         ranks that arrived: {arrived:?}; {who} that did not: {missing:?}",
        timeout.as_secs_f64()
    );
    if !elsewhere.is_empty() {
        m += &format!(" ({})", elsewhere.join("; "));
    }
    let silent: Vec<usize> = (0..everyone).filter(|r| !heard.contains(r)).collect();
    if !silent.is_empty() {
        m += &format!(
            "; {who} that sent no status within {} s (stopped, or busy outside any \
             wait): {silent:?}",
            GRACE.as_secs()
        );
    }
    eprintln!("{m}");
    // A peer that did not arrive: the job may run again without it (`distc launch`).
    world.abort(crate::core::error::WORKER_LOST_EXIT)
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
    /// World rank `world_rank`'s communicator over `comm` (the workers' split of the
    /// world, or a pipeline's split by stage or replica: its rank there is its own);
    /// `ctl` carries the status messages of a timed-out collective.
    pub(crate) fn new(
        comm: Comm,
        ctl: Arc<Comm>,
        roles: Roles,
        world_rank: usize,
        timeout: Duration,
    ) -> MpiComm {
        let (rank, size) = (comm.0.rank() as usize, comm.0.size() as usize);
        MpiComm {
            comm,
            ctl,
            roles,
            world_rank,
            rank,
            size,
            timeout,
            bytes: ByteCount::default(),
            label: "the start".into(),
        }
    }
}

impl MpiComm {
    /// Reports this rank's stalled wait and aborts the job.
    fn timed_out(&self) -> ! {
        timed_out(
            &self.ctl,
            self.roles,
            self.world_rank,
            &self.label,
            self.timeout,
        )
    }

    /// Polls `req` until it completes; past the deadline, reports and aborts.
    fn finish<'a, D: ?Sized, S: Scope<'a>>(&self, req: Request<'a, D, S>) {
        // An MPI collective cannot be cancelled: the job stops here.
        complete_or(req, self.timeout, || self.timed_out())
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
            return Err(RuntimeError::Plan(format!(
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
        // The root is an op's attribute in the plan.
        if root >= n {
            return Err(RuntimeError::Plan(format!(
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
            return Err(RuntimeError::Plan(format!(
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
            return Err(RuntimeError::Plan(format!(
                "send to rank {to} of {}",
                self.size
            )));
        }
        let n = data.len() as u64;
        // Bounded like a collective: a peer that never receives stops the job here.
        let mut out = Outgoing::start(&self.comm.0, to, TAG_P2P, data, false);
        if !out.wait_for(self.timeout) {
            self.timed_out();
        }
        self.bytes.sent += n;
        Ok(())
    }
    fn recv(&mut self, from: usize) -> std::result::Result<Vec<u8>, RuntimeError> {
        if from >= self.size {
            return Err(RuntimeError::Plan(format!(
                "recv from rank {from} of {}",
                self.size
            )));
        }
        let since = Since::now();
        let mut backoff = Backoff(0);
        loop {
            let p = self.comm.0.process_at_rank(from as i32);
            if let Some((msg, st)) = p.immediate_matched_probe_with_tag(TAG_P2P) {
                let (data, _) = (msg, st).matched_receive_vec::<u8>();
                self.bytes.received += data.len() as u64;
                return Ok(data);
            }
            if since.waited() >= self.timeout {
                self.timed_out();
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
