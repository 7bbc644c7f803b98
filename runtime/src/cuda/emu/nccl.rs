//! Emulated NCCL (issue 21): the workers of one process, each with an emulated
//! device, join a communicator by the id rank 0 made ([`unique_id`]); each collective
//! is an exchange among them, computed on every rank from every rank's input as NCCL
//! defines it, so the multi-rank NCCL paths of the backend run where one GPU (or
//! none) is all there is.
//!
//! As on a GPU, a collective runs on the communicator's own stream: it waits for the
//! compute stream's `ready` event before reading its input and records `done` after
//! writing its output. The emulated device checks that ordering: a kernel on the
//! compute stream reading the result before the backend made it wait for `done` is a
//! race, named. The bytes counted are the real communicator's
//! ([`crate::cuda::nccl::collective_bytes`]).

use super::device::{EmuDevice, Event, Stream};
use super::driver::{Recorded, Shared};
use crate::comm::ByteCount;
use crate::cuda::codegen::SlicesLayout;
use crate::cuda::nccl::{check_workers, collective_bytes};
use crate::cuda::{driver::DeviceComm, CudaError};
use distc_ir::{NodeId, Op, ReduceOp, ValueType};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// How long a rank waits for the others to reach a collective before it says so.
const WAIT: Duration = Duration::from_secs(120);

/// The ranks of one communicator meeting at each collective, and their
/// point-to-point messages.
struct Group {
    size: usize,
    state: Mutex<Round>,
    turn: Condvar,
    mail: Mutex<HashMap<(usize, usize), Channel>>,
    posted: Condvar,
    /// The communicators split from this one, in the order its ranks split it.
    children: Mutex<Vec<Arc<Group>>>,
}

/// The messages from one rank to another not yet received, and how many were sent and
/// taken: a send returns once its message is taken (NCCL's rendezvous).
#[derive(Default)]
struct Channel {
    queue: std::collections::VecDeque<Vec<u8>>,
    sent: u64,
    taken: u64,
}

#[derive(Default)]
struct Round {
    deposits: Vec<Option<Vec<u8>>>,
    arrived: usize,
    results: Option<Arc<Vec<Vec<u8>>>>,
    taken: usize,
}

impl Group {
    fn new(size: usize) -> Group {
        Group {
            size,
            state: Mutex::new(Round::default()),
            turn: Condvar::new(),
            mail: Mutex::new(HashMap::new()),
            posted: Condvar::new(),
            children: Mutex::new(Vec::new()),
        }
    }

    /// The `k`-th communicator split from this one: every rank's `k`-th split joins
    /// the same (as `ncclCommSplit` of one colour).
    fn child(&self, k: usize) -> Result<Arc<Group>, CudaError> {
        let mut children = self
            .children
            .lock()
            .map_err(|_| CudaError::Invalid("communicator split poisoned".into()))?;
        while children.len() <= k {
            children.push(Arc::new(Group::new(self.size)));
        }
        Ok(children[k].clone())
    }

    /// Every rank's bytes, once every rank has given its own.
    fn exchange(
        &self,
        rank: usize,
        bytes: Vec<u8>,
        what: &str,
    ) -> Result<Arc<Vec<Vec<u8>>>, CudaError> {
        let timeout = |m: String| CudaError::Nccl {
            call: "emulated collective",
            code: m,
        };
        let mut st = self
            .state
            .lock()
            .map_err(|_| timeout("a rank panicked".into()))?;
        // The previous round's results are still being taken.
        while st.results.is_some() {
            let (g, t) = self
                .turn
                .wait_timeout(st, WAIT)
                .map_err(|_| timeout("a rank panicked".into()))?;
            st = g;
            if t.timed_out() {
                return Err(timeout(format!(
                    "rank {rank} waited {WAIT:?} to start {what}"
                )));
            }
        }
        if st.deposits.len() != self.size {
            st.deposits = vec![None; self.size];
        }
        st.deposits[rank] = Some(bytes);
        st.arrived += 1;
        if st.arrived == self.size {
            let all = st
                .deposits
                .iter_mut()
                .map(|d| d.take().unwrap_or_default())
                .collect();
            st.results = Some(Arc::new(all));
            st.arrived = 0;
            self.turn.notify_all();
        }
        while st.results.is_none() {
            let (g, t) = self
                .turn
                .wait_timeout(st, WAIT)
                .map_err(|_| timeout("a rank panicked".into()))?;
            st = g;
            if t.timed_out() && st.results.is_none() {
                return Err(timeout(format!(
                    "rank {rank} waited {WAIT:?} for the other ranks to reach {what}"
                )));
            }
        }
        let out = st.results.clone().expect("present");
        st.taken += 1;
        if st.taken == self.size {
            st.taken = 0;
            st.results = None;
            self.turn.notify_all();
        }
        Ok(out)
    }
}

impl Group {
    /// Hands `bytes` from `from` to `to`, returning once `to` has taken them.
    fn post(&self, from: usize, to: usize, bytes: Vec<u8>) -> Result<(), CudaError> {
        let err = |m: String| CudaError::Nccl {
            call: "emulated ncclSend",
            code: m,
        };
        let mut mail = self
            .mail
            .lock()
            .map_err(|_| err("a rank panicked".into()))?;
        let ch = mail.entry((from, to)).or_default();
        ch.queue.push_back(bytes);
        ch.sent += 1;
        let mine = ch.sent;
        self.posted.notify_all();
        loop {
            if mail.get(&(from, to)).is_some_and(|c| c.taken >= mine) {
                return Ok(());
            }
            let (m, t) = self
                .posted
                .wait_timeout(mail, WAIT)
                .map_err(|_| err("a rank panicked".into()))?;
            mail = m;
            if t.timed_out() && mail.get(&(from, to)).is_none_or(|c| c.taken < mine) {
                return Err(err(format!(
                    "rank {from} waited {WAIT:?} for rank {to} to receive its message"
                )));
            }
        }
    }

    /// The next message from `from` to `to`, once it is sent.
    fn take(&self, from: usize, to: usize) -> Result<Vec<u8>, CudaError> {
        let err = |m: String| CudaError::Nccl {
            call: "emulated ncclRecv",
            code: m,
        };
        let mut mail = self
            .mail
            .lock()
            .map_err(|_| err("a rank panicked".into()))?;
        loop {
            if let Some(ch) = mail.get_mut(&(from, to)) {
                if let Some(bytes) = ch.queue.pop_front() {
                    ch.taken += 1;
                    self.posted.notify_all();
                    return Ok(bytes);
                }
            }
            let (m, t) = self
                .posted
                .wait_timeout(mail, WAIT)
                .map_err(|_| err("a rank panicked".into()))?;
            mail = m;
            let waiting = mail.get(&(from, to)).is_none_or(|c| c.queue.is_empty());
            if t.timed_out() && waiting {
                return Err(err(format!(
                    "rank {to} waited {WAIT:?} for a message from rank {from}"
                )));
            }
        }
    }
}

/// The communicators of this process, by id.
fn groups() -> &'static Mutex<HashMap<[u8; 128], Arc<Group>>> {
    static G: OnceLock<Mutex<HashMap<[u8; 128], Arc<Group>>>> = OnceLock::new();
    G.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A fresh communicator id (rank 0's part of the bootstrap): unique in the process.
pub fn unique_id() -> [u8; 128] {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    let mut id = [0u8; 128];
    id[..8].copy_from_slice(&N.fetch_add(1, Ordering::Relaxed).to_ne_bytes());
    id[8..12].copy_from_slice(&std::process::id().to_ne_bytes());
    id
}

/// One rank's side of a communicator: its stream, events and the group.
pub struct CommCore {
    rank: usize,
    size: usize,
    compute: Stream,
    stream: Stream,
    events: HashMap<NodeId, (Event, Event)>,
    group: Arc<Group>,
    bytes: ByteCount,
    /// How many communicators this rank has split from this one.
    splits: usize,
}

/// The rank's communicator, as the backend holds it.
pub struct EmuComm {
    core: Rc<RefCell<CommCore>>,
    shared: Rc<RefCell<Shared>>,
}

/// 16-bit values (`wire`: bf16 or f16, native byte order) widened to f32.
fn halves(b: &[u8], wire: distc_ir::DType) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| {
            let bits = u16::from_ne_bytes([c[0], c[1]]);
            match wire {
                distc_ir::DType::F16 => half::f16::from_bits(bits).to_f32(),
                _ => half::bf16::from_bits(bits).to_f32(),
            }
        })
        .collect()
}

/// f32 values rounded to `wire`, in native byte order.
fn half_bytes(v: &[f32], wire: distc_ir::DType) -> Vec<u8> {
    v.iter()
        .flat_map(|x| match wire {
            distc_ir::DType::F16 => half::f16::from_f32(*x).to_bits().to_ne_bytes(),
            _ => half::bf16::from_f32(*x).to_bits().to_ne_bytes(),
        })
        .collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

impl EmuComm {
    /// Joins communicator `id` as `rank` of `size`, on stream `stream` of the device.
    pub(super) fn join(
        shared: Rc<RefCell<Shared>>,
        compute: Stream,
        stream: Stream,
        rank: usize,
        size: usize,
        id: [u8; 128],
    ) -> Result<EmuComm, CudaError> {
        if rank >= size {
            return Err(CudaError::Invalid(format!("rank {rank} of {size}")));
        }
        let group = {
            let mut g = groups()
                .lock()
                .map_err(|_| CudaError::Invalid("communicator registry poisoned".into()))?;
            g.entry(id)
                .or_insert_with(|| Arc::new(Group::new(size)))
                .clone()
        };
        if group.size != size {
            return Err(CudaError::Invalid(format!(
                "a communicator of {} ranks joined as one of {size}",
                group.size
            )));
        }
        Ok(EmuComm {
            core: Rc::new(RefCell::new(CommCore {
                rank,
                size,
                compute,
                stream,
                events: HashMap::new(),
                group,
                bytes: ByteCount::default(),
                splits: 0,
            })),
            shared,
        })
    }
}

impl CommCore {
    /// Reads this rank's part on the communicator's stream: a dense value whole, a
    /// slices value as its count and that many rows.
    fn read_input(
        &self,
        dev: &mut EmuDevice,
        at: u64,
        ty: &ValueType,
    ) -> Result<Vec<u8>, CudaError> {
        let mut read = |addr: u64, len: usize| -> Result<Vec<u8>, CudaError> {
            let mut b = vec![0u8; len];
            if len > 0 {
                let (p, off) = dev.locate(addr, len, "a collective's input")?;
                dev.copy_dtoh(self.stream, p, off, &mut b)?;
            }
            Ok(b)
        };
        match SlicesLayout::of(ty) {
            None => read(at, crate::cuda::codegen::value_bytes(ty)),
            Some(l) => {
                let head = read(at, 4)?;
                let count = i32::from_ne_bytes([head[0], head[1], head[2], head[3]]);
                let rows = usize::try_from(count).unwrap_or(0).min(l.nnz);
                let mut out = head;
                out.extend(read(at + l.indices_offset as u64, 4 * rows)?);
                out.extend(read(at + l.values_offset as u64, 4 * rows * l.row)?);
                Ok(out)
            }
        }
    }

    /// Runs node `node`'s collective: the exchange, then this rank's output written
    /// on the communicator's stream, then `done` recorded.
    pub(super) fn run(
        &mut self,
        dev: &mut EmuDevice,
        node: NodeId,
        op: &Op,
        (input, in_ty): (u64, &ValueType),
        (output, out_ty): (u64, &ValueType),
    ) -> Result<(), CudaError> {
        let interleave = crate::cuda::nccl::NcclComm::interleaved(op, in_ty);
        let op = &crate::cuda::nccl::NcclComm::equivalent(op, out_ty);
        let (ready, done) = self.events[&node];
        dev.wait_event(self.stream, ready)?;
        let mine = self.read_input(dev, input, in_ty)?;
        let what = format!("{node} ({})", op.mnemonic());
        let all = self.group.exchange(self.rank, mine, &what)?;
        let (n, rank) = (self.size, self.rank);
        let elems = |t: &ValueType| t.dense_type().dims().iter().product::<usize>();
        let reduce = |parts: Vec<Vec<f32>>, r: &ReduceOp| -> Vec<f32> {
            let mut acc = vec![0f32; parts.first().map_or(0, Vec::len)];
            for p in &parts {
                for (a, x) in acc.iter_mut().zip(p) {
                    *a += x;
                }
            }
            if *r == ReduceOp::Mean {
                acc.iter_mut().for_each(|a| *a /= n as f32);
            }
            acc
        };
        // A 16-bit gradient wire: each contribution widened, a mean's divided by N first
        // (NCCL's average of floats), summed in f32 in rank order, rounded once.
        let wire = in_ty.dense_type().dtype;
        let half_sum = |parts: &[Vec<u8>], r: &ReduceOp, pad: usize| -> Vec<u8> {
            let scale = if *r == ReduceOp::Mean {
                1.0 / n as f32
            } else {
                1.0
            };
            let mut acc: Vec<f32> = Vec::new();
            for p in parts {
                let mut v = halves(p, wire);
                v.resize(pad.max(v.len()), 0.0);
                acc.resize(v.len(), 0.0);
                for (a, x) in acc.iter_mut().zip(v) {
                    *a += x * scale;
                }
            }
            half_bytes(&acc, wire)
        };
        // What this rank's output gets: (offset, bytes) pieces.
        let writes: Vec<(usize, Vec<u8>)> = match (op, in_ty) {
            (Op::AllReduce { reduce: r, .. }, ValueType::Tensor(_)) if wire.is_half() => {
                vec![(0, half_sum(&all, r, 0))]
            }
            (Op::ReduceScatter { workers, reduce: r }, ValueType::Tensor(_)) if wire.is_half() => {
                check_workers(op, *workers, n)?;
                let chunk = elems(in_ty).div_ceil(n);
                let sum = half_sum(&all, r, chunk * n);
                vec![(0, sum[2 * rank * chunk..2 * (rank + 1) * chunk].to_vec())]
            }
            (Op::AllReduce { reduce: r, .. }, ValueType::Tensor(_)) => {
                vec![(
                    0,
                    bytes_of(&reduce(all.iter().map(|p| f32s(p)).collect(), r)),
                )]
            }
            (Op::Broadcast { root }, ValueType::Tensor(_)) => {
                let src = all.get(*root).ok_or_else(|| {
                    CudaError::Invalid(format!("{what}: root {root} of {n} ranks"))
                })?;
                vec![(0, src.clone())]
            }
            (Op::ReduceScatter { workers, reduce: r }, ValueType::Tensor(_)) => {
                check_workers(op, *workers, n)?;
                let len = elems(in_ty);
                let chunk = len.div_ceil(n);
                let parts = all
                    .iter()
                    .map(|p| {
                        let mut v = f32s(p);
                        // Parts not contiguous in the whole, laid rank after rank first.
                        if let Some((outer, row)) = interleave {
                            v = permute_parts(&v, (outer, row), n, true);
                        }
                        v.resize(chunk * n, 0.0);
                        v[rank * chunk..(rank + 1) * chunk].to_vec()
                    })
                    .collect();
                vec![(0, bytes_of(&reduce(parts, r)))]
            }
            (Op::AllGatherDense { workers, .. }, ValueType::Tensor(_)) => {
                check_workers(op, *workers, n)?;
                let total = elems(out_ty);
                let mut v: Vec<f32> = all.iter().flat_map(|p| f32s(p)).collect();
                v.resize(total, 0.0);
                // Parts not contiguous in the whole, laid into place.
                if let Some((outer, row)) = interleave {
                    v = permute_parts(&v, (outer, row), n, false);
                }
                vec![(0, bytes_of(&v))]
            }
            (Op::AllGather { reduce: r, .. }, ValueType::IndexedSlices { .. }) => {
                let (Some(part), Some(whole)) = (SlicesLayout::of(in_ty), SlicesLayout::of(out_ty))
                else {
                    return Err(CudaError::Invalid(format!(
                        "{what}: all_gather of non-slices"
                    )));
                };
                let scale = if *r == ReduceOp::Mean {
                    1.0 / n as f32
                } else {
                    1.0
                };
                let mut out = vec![0u8; whole.bytes];
                let mut total = 0usize;
                for p in all.iter() {
                    let rows = (p.len() - 4) / (4 + 4 * part.row);
                    let (ids, vals) = p[4..].split_at(4 * rows);
                    let at = whole.indices_offset + 4 * total;
                    out[at..at + ids.len()].copy_from_slice(ids);
                    let scaled: Vec<f32> = f32s(vals).iter().map(|x| x * scale).collect();
                    let at = whole.values_offset + 4 * total * part.row;
                    out[at..at + 4 * scaled.len()].copy_from_slice(&bytes_of(&scaled));
                    total += rows;
                }
                out[..4].copy_from_slice(&(total as i32).to_ne_bytes());
                // Only what was gathered: the rows past the count stay unwritten.
                let used = whole.values_offset + 4 * total * part.row;
                vec![
                    (0, out[..4 + 4 * total].to_vec()),
                    (whole.values_offset, out[whole.values_offset..used].to_vec()),
                ]
            }
            (op, t) => {
                return Err(CudaError::Invalid(format!(
                    "{node}: NCCL has no {} of {t}",
                    op.mnemonic()
                )))
            }
        };
        for (at, bytes) in &writes {
            self.write(dev, output, bytes, *at)?;
        }
        let b = collective_bytes(op, in_ty, n, rank);
        self.bytes.sent += b.sent;
        self.bytes.received += b.received;
        dev.record_event(self.stream, done)?;
        Ok(())
    }

    fn write(
        &self,
        dev: &mut EmuDevice,
        output: u64,
        bytes: &[u8],
        at: usize,
    ) -> Result<(), CudaError> {
        if bytes.is_empty() {
            return Ok(());
        }
        let (p, off) = dev.locate(output + at as u64, bytes.len(), "a collective's output")?;
        dev.copy_htod(self.stream, p, off, bytes)?;
        Ok(())
    }
}

impl DeviceComm for EmuComm {
    fn issue(
        &mut self,
        node: NodeId,
        op: &Op,
        input: u64,
        in_ty: &ValueType,
        output: u64,
        out_ty: &ValueType,
    ) -> Result<(), CudaError> {
        let mut shared = self.shared.borrow_mut();
        let mut core = self.core.borrow_mut();
        let (ready, _) = *core
            .events
            .entry(node)
            .or_insert_with(|| (shared.dev.event(), shared.dev.event()));
        let compute = core.compute;
        if let Some(c) = &mut shared.capture {
            c.push(Recorded::Record(compute, ready));
            c.push(Recorded::Collective {
                comm: self.core.clone(),
                node,
                op: op.clone(),
                input,
                in_ty: in_ty.clone(),
                output,
                out_ty: out_ty.clone(),
            });
            return Ok(());
        }
        shared.dev.record_event(compute, ready)?;
        core.run(&mut shared.dev, node, op, (input, in_ty), (output, out_ty))
    }

    fn order_after(&mut self, node: NodeId) -> Result<(), CudaError> {
        let core = self.core.borrow();
        let Some(&(_, done)) = core.events.get(&node) else {
            return Ok(());
        };
        let mut shared = self.shared.borrow_mut();
        if let Some(c) = &mut shared.capture {
            c.push(Recorded::Wait(core.compute, done));
            return Ok(());
        }
        Ok(shared.dev.wait_event(core.compute, done)?)
    }

    fn bytes(&self) -> ByteCount {
        self.core.borrow().bytes
    }

    fn send(&mut self, peer: usize, parts: &[(u64, usize)]) -> Result<(), CudaError> {
        self.point_to_point(peer, parts, true)
    }

    fn recv(&mut self, peer: usize, parts: &[(u64, usize)]) -> Result<(), CudaError> {
        self.point_to_point(peer, parts, false)
    }

    fn split(&mut self) -> Result<Box<dyn DeviceComm>, CudaError> {
        let mut core = self.core.borrow_mut();
        let group = core.group.child(core.splits)?;
        core.splits += 1;
        let stream = self.shared.borrow_mut().dev.stream();
        Ok(Box::new(EmuComm {
            core: Rc::new(RefCell::new(CommCore {
                rank: core.rank,
                size: core.size,
                compute: core.compute,
                stream,
                events: HashMap::new(),
                group,
                bytes: ByteCount::default(),
                splits: 0,
            })),
            shared: self.shared.clone(),
        }))
    }
}

impl EmuComm {
    /// A send (`send`) or receive of `parts` with rank `peer`: run now, or recorded
    /// into the capture and run at each replay, in the captured order.
    fn point_to_point(
        &mut self,
        peer: usize,
        parts: &[(u64, usize)],
        send: bool,
    ) -> Result<(), CudaError> {
        let mut shared = self.shared.borrow_mut();
        self.core.borrow().check_point_to_point(peer)?;
        if let Some(c) = &mut shared.capture {
            c.push(Recorded::Message {
                comm: self.core.clone(),
                peer,
                parts: parts.to_vec(),
                send,
            });
            return Ok(());
        }
        self.core
            .borrow_mut()
            .message(&mut shared.dev, peer, parts, send)
    }
}

impl CommCore {
    /// Runs a send (`send`) to rank `peer` of `parts`, or a receive into them. The
    /// host thread is the stream here: it blocks as the stream would.
    pub(super) fn message(
        &mut self,
        dev: &mut EmuDevice,
        peer: usize,
        parts: &[(u64, usize)],
        send: bool,
    ) -> Result<(), CudaError> {
        if send {
            let mut message = Vec::new();
            for &(at, len) in parts.iter().filter(|p| p.1 > 0) {
                let (p, off) = dev.locate(at, len, "a message sent")?;
                let mut b = vec![0u8; len];
                dev.copy_dtoh(self.compute, p, off, &mut b)?;
                message.extend(b);
            }
            let bytes = message.len() as u64;
            self.group.post(self.rank, peer, message)?;
            self.bytes.sent += bytes;
            return Ok(());
        }
        let message = self.group.take(peer, self.rank)?;
        let want: usize = parts.iter().map(|p| p.1).sum();
        if message.len() != want {
            return Err(CudaError::Invalid(format!(
                "rank {} received {} bytes from rank {peer}, its buffers hold {want}",
                self.rank,
                message.len()
            )));
        }
        let mut at_byte = 0;
        for &(at, len) in parts.iter().filter(|p| p.1 > 0) {
            let (p, off) = dev.locate(at, len, "a message received")?;
            dev.copy_htod(self.compute, p, off, &message[at_byte..at_byte + len])?;
            at_byte += len;
        }
        self.bytes.received += want as u64;
        Ok(())
    }

    /// Refuses a point-to-point call to itself or to a rank the communicator lacks.
    fn check_point_to_point(&self, peer: usize) -> Result<(), CudaError> {
        if peer >= self.size || peer == self.rank {
            return Err(CudaError::Invalid(format!(
                "rank {} of {} cannot send to or receive from rank {peer}",
                self.rank, self.size
            )));
        }
        Ok(())
    }
}

/// What the interleaving kernel ([`crate::cuda::nccl::INTERLEAVE_KERNEL`]) computes:
/// `v` from `[parts, outer, row]` (rank after rank) to `[outer, parts, row]` (the
/// whole), or with `to_parts` back.
fn permute_parts(
    v: &[f32],
    (outer, row): (usize, usize),
    parts: usize,
    to_parts: bool,
) -> Vec<f32> {
    let by_part = |p: usize, o: usize| (p * outer + o) * row;
    let in_place = |p: usize, o: usize| (o * parts + p) * row;
    let order: Vec<usize> = if to_parts {
        (0..parts)
            .flat_map(|p| (0..outer).map(move |o| in_place(p, o)))
            .collect()
    } else {
        (0..outer)
            .flat_map(|o| (0..parts).map(move |p| by_part(p, o)))
            .collect()
    };
    order
        .into_iter()
        .flat_map(|at| v[at..at + row].iter().copied())
        .collect()
}
