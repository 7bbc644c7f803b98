//! Communication among ranks: collectives (all-reduce, all-gather, reduce-scatter,
//! broadcast, barrier) and point-to-point messages, behind one [`Communicator`] trait.
//!
//! The design names three implementations (in-process threads, MPI, NCCL); this module
//! holds the trait and the in-process one ([`in_process`]). Collectives use ring
//! algorithms: every rank sends only to `rank + 1` and receives only from `rank - 1`
//! (mod `size`), so each link carries the same load and the bytes a rank sends do not
//! grow with the number of ranks (all-reduce: `2 (N-1)/N` times the buffer).
//!
//! Every communicator counts the payload bytes it sends and receives as a network
//! would carry them (4 per `f32`, 8 per `f64`, the length of a byte buffer; message
//! headers are not counted), so the metrics can report communication volume per step
//! by differencing [`Communicator::bytes`].
//!
//! Failures are errors, never panics or silent hangs: a peer whose thread died (its
//! communicator dropped) makes the next operation that talks to it fail with
//! [`RuntimeError::Peer`] naming both ranks and the operation. After such an error a
//! communicator closes its own channels, so the failure spreads along the ring to every
//! rank instead of leaving some of them waiting.

pub mod calibrate;
pub mod collective;
mod inprocess;
#[cfg(feature = "mpi")]
pub mod mpi;

pub use inprocess::{in_process, InProcessComm};

use crate::core::axis::Axis;
use crate::core::error::{PeerKind, RuntimeError};
use zerocopy::IntoBytes;

pub use crate::core::value::ByteCount;

/// Collective and point-to-point communication among `size()` ranks. One object per
/// rank, owned by that rank's thread (`Send`, not `Sync`).
///
/// Collectives must be called by every rank, in the same order, with compatible
/// arguments (SPMD). On error the contents of in/out buffers are unspecified.
pub trait Communicator: Send {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// In-place all-reduce of `f32` (sum, or mean = sum / size, divided once after the
    /// sum). Ring algorithm: reduce-scatter then all-gather over `size` chunks, each rank
    /// sending to rank+1 and receiving from rank-1, so each rank sends `2 (N-1)/N` times
    /// the buffer's bytes. Every rank ends with bit-identical results (each chunk is
    /// summed on one rank, then copied). Different lengths across ranks are an error on
    /// every rank. With size 1 it does nothing and counts nothing.
    fn all_reduce(&mut self, buf: &mut [f32], mean: bool) -> Result<(), RuntimeError>;
    /// [`Communicator::all_reduce`] for `f64` buffers (same ring).
    fn all_reduce_f64(&mut self, buf: &mut [f64], mean: bool) -> Result<(), RuntimeError>;
    /// Every rank contributes a byte buffer of any length (lengths may differ per rank);
    /// every rank gets all buffers in rank order. Ring all-gather: `N-1` steps, each
    /// forwarding the block received in the previous step, so a rank sends every block
    /// but its successor's.
    fn all_gather(&mut self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, RuntimeError>;
    /// Ring reduce-scatter of `f32`: returns this rank's reduced chunk (chunk `rank` of
    /// `size` nearly equal chunks, the first `len % size` one element longer; see
    /// [`chunk_range`]). Each rank sends `(N-1)/N` times the buffer's bytes.
    fn reduce_scatter(&mut self, buf: &[f32], mean: bool) -> Result<Vec<f32>, RuntimeError>;
    /// Root's bytes to everyone, passed along the ring from `root` (each rank sends the
    /// buffer at most once). `buf` is overwritten on non-roots; its length must equal the
    /// root's, else that rank returns an error (the others still complete).
    fn broadcast(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), RuntimeError>;
    /// Returns once every rank has entered the barrier (a ring pass of empty messages).
    fn barrier(&mut self) -> Result<(), RuntimeError>;
    /// Sends `data` to rank `to` without waiting for it to be received.
    fn send(&mut self, to: usize, data: Vec<u8>) -> Result<(), RuntimeError>;
    /// Waits for the next message from rank `from`.
    fn recv(&mut self, from: usize) -> Result<Vec<u8>, RuntimeError>;
    /// Cumulative bytes of payload sent and received by this rank (all operations).
    fn bytes(&self) -> ByteCount;
    /// Names what the next operations are for (`all_reduce %25 at step 12`), so a
    /// failure or a timeout can say which op of the program it hit.
    fn set_label(&mut self, _label: &str) {}
}

/// The host communicators a backend is made with, to bootstrap its own over them: the
/// worker's link on the data axis (a pipeline stage's to its replicas), on the model
/// axis where the mesh has one, and among a pipeline's stages (rank = stage).
pub struct Links<'c> {
    by_axis: [Option<&'c mut dyn Communicator>; 3],
}

impl<'c> Links<'c> {
    /// No link: a backend alone on its device.
    pub fn none() -> Links<'c> {
        Links {
            by_axis: [None, None, None],
        }
    }

    /// The data axis's link alone.
    pub fn data(data: &'c mut dyn Communicator) -> Links<'c> {
        Links::none().with(Axis::Data, data)
    }

    /// These links and `comm` on `axis`.
    pub fn with(mut self, axis: Axis, comm: &'c mut dyn Communicator) -> Links<'c> {
        self.by_axis[axis.index()] = Some(comm);
        self
    }

    /// The link on `axis`, taken out.
    pub fn take(&mut self, axis: Axis) -> Option<&'c mut dyn Communicator> {
        self.by_axis[axis.index()].take()
    }
}

/// A role's communicators, keyed by the mesh's axes (torchtitan's `world_mesh["dp"]`):
/// a worker's on the data axis and, with one, the model axis; a stage's on the pipe
/// axis, among its replicas and among its model ranks. A new axis is an entry here,
/// not a field of every role and backend.
#[derive(Default)]
pub struct AxisComms {
    by_axis: [Option<Box<dyn Communicator>>; 3],
}

impl AxisComms {
    /// `comm` on `axis`, replacing any there.
    pub fn insert(&mut self, axis: Axis, comm: Box<dyn Communicator>) {
        self.by_axis[axis.index()] = Some(comm);
    }

    /// The communicator on `axis`, taken out.
    pub fn take(&mut self, axis: Axis) -> Option<Box<dyn Communicator>> {
        self.by_axis[axis.index()].take()
    }

    /// The communicator on `axis`, taken out, where the role cannot run without it.
    pub fn require(
        &mut self,
        axis: Axis,
        role: &str,
    ) -> Result<Box<dyn Communicator>, RuntimeError> {
        self.take(axis).ok_or_else(|| {
            RuntimeError::internal(role, format!("no communicator on the {} axis", axis.name()))
        })
    }

    /// Links to every communicator it holds, for a device's bootstrap.
    pub fn links(&mut self) -> Links<'_> {
        let [a, b, c] = &mut self.by_axis;
        Links {
            by_axis: [a, b, c].map(|c| c.as_mut().map(|c| &mut **c as &mut dyn Communicator)),
        }
    }
}

/// A 16-bit wire's element: `x` rounded to `wire` (bf16 or f16), as little-endian bytes.
fn encode_half(xs: &[f32], wire: distc_ir::DType) -> Vec<u8> {
    match wire {
        distc_ir::DType::F16 => xs
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        _ => xs
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// The values of an [`encode_half`] message.
fn decode_half(bytes: &[u8], wire: distc_ir::DType) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|c| match wire {
            distc_ir::DType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
            _ => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        })
        .collect()
}

/// Sends `out` to its rank and receives from `from`: odd ranks receive first, so a
/// ring whose sends wait for their receiver (MPI's) cannot have every rank sending.
fn exchange(
    comm: &mut dyn Communicator,
    (to, out): (usize, Vec<u8>),
    from: usize,
) -> Result<Vec<u8>, RuntimeError> {
    if comm.rank() % 2 == 1 {
        let got = comm.recv(from)?;
        comm.send(to, out)?;
        Ok(got)
    } else {
        comm.send(to, out)?;
        comm.recv(from)
    }
}

/// This rank's error for a chunk from `prev` that does not fit its slot during `op`:
/// what a peer sent is not what the ring allows.
fn malformed(rank: usize, prev: usize, op: &str, message: String) -> RuntimeError {
    RuntimeError::Peer {
        rank,
        peer: prev,
        op: op.into(),
        kind: PeerKind::Malformed,
        message,
    }
}

/// All-reduce of `buf` with 16-bit values on the wire (`wire`: bf16 or f16): the ring of
/// [`Communicator::all_reduce`] over the communicator's `send`/`recv`, each chunk sent
/// rounded to 16 bits and what arrives added in f32. With `mean` every rank divides its
/// contribution by N before the sum (an f16 sum of N gradients may overflow where
/// their mean does not). Each rank rounds its own reduced chunk as it sends it, so every
/// rank ends with the same values. Sends `2 (N-1)/N` times half the f32 bytes.
pub fn all_reduce_wire(
    comm: &mut dyn Communicator,
    buf: &mut [f32],
    mean: bool,
    wire: distc_ir::DType,
) -> Result<(), RuntimeError> {
    let (n, r, len) = (comm.size(), comm.rank(), buf.len());
    reduce_scatter_ring_wire(comm, buf, mean, wire)?;
    if n <= 1 {
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for s in 0..n - 1 {
        let send_c = (r + n - s) % n;
        let recv_c = (r + 2 * n - s - 1) % n;
        let out = encode_half(&buf[chunk_range(len, n, send_c)], wire);
        let theirs = decode_half(&exchange(comm, (next, out), prev)?, wire);
        let range = chunk_range(len, n, recv_c);
        if theirs.len() != range.len() {
            return Err(malformed(
                r,
                prev,
                "all_reduce",
                format!("rank {prev} sent a malformed reduced chunk during a 16-bit all-reduce"),
            ));
        }
        buf[range].copy_from_slice(&theirs);
    }
    Ok(())
}

/// Reduce-scatter with 16-bit values on the wire: this rank's chunk ([`chunk_range`]
/// `r` of N) of the sum (with `mean`, each contribution divided by N first), rounded
/// to `wire` as every rank would have it; the ring's first half of
/// [`all_reduce_wire`]. Sends `(N-1)/N` times half the f32 bytes.
pub fn reduce_scatter_wire(
    comm: &mut dyn Communicator,
    buf: &mut [f32],
    mean: bool,
    wire: distc_ir::DType,
) -> Result<Vec<f32>, RuntimeError> {
    reduce_scatter_ring_wire(comm, buf, mean, wire)?;
    let (n, r) = (comm.size(), comm.rank());
    Ok(buf[chunk_range(buf.len(), n, r)].to_vec())
}

/// The ring reduce-scatter in place: afterwards chunk `r` of `buf` holds the sum,
/// rounded to `wire` (the other chunks hold partial sums).
fn reduce_scatter_ring_wire(
    comm: &mut dyn Communicator,
    buf: &mut [f32],
    mean: bool,
    wire: distc_ir::DType,
) -> Result<(), RuntimeError> {
    let (n, r, len) = (comm.size(), comm.rank(), buf.len());
    if mean && n > 1 {
        let d = n as f32;
        buf.iter_mut().for_each(|x| *x /= d);
    }
    if n <= 1 {
        let rounded = decode_half(&encode_half(buf, wire), wire);
        buf.copy_from_slice(&rounded);
        return Ok(());
    }
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Reduce-scatter: at step s rank r sends chunk r-s-1 and adds chunk r-s-2.
    for s in 0..n - 1 {
        let send_c = (r + 2 * n - s - 1) % n;
        let recv_c = (r + 2 * n - s - 2) % n;
        let out = encode_half(&buf[chunk_range(len, n, send_c)], wire);
        let theirs = decode_half(&exchange(comm, (next, out), prev)?, wire);
        let range = chunk_range(len, n, recv_c);
        if theirs.len() != range.len() {
            return Err(malformed(
                r,
                prev,
                "reduce_scatter",
                format!("rank {prev} sent a malformed chunk during a 16-bit reduce-scatter"),
            ));
        }
        for (a, b) in buf[range].iter_mut().zip(theirs) {
            *a += b;
        }
    }
    // This rank's reduced chunk as everyone will have it.
    let own = chunk_range(len, n, r);
    let rounded = decode_half(&encode_half(&buf[own.clone()], wire), wire);
    buf[own].copy_from_slice(&rounded);
    Ok(())
}

/// The element range of chunk `i` when `len` elements are split into `n` nearly equal
/// chunks, the first `len % n` one element longer. Collectives that scatter use it.
pub fn chunk_range(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / n;
    let rem = len % n;
    let start = i * base + i.min(rem);
    let size = base + usize::from(i < rem);
    start..start + size
}

/// Payload bytes one rank sent over each kind of link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkBytes {
    /// To ranks on its own node.
    pub intra_node: u64,
    /// To ranks on other nodes.
    pub inter_node: u64,
}

/// [`exchange`] within a ring of ranks: position `pos` in the ring decides who receives
/// first (odd positions), so a ring of ranks of one parity cannot have every rank
/// sending.
fn exchange_at(
    comm: &mut dyn Communicator,
    pos: usize,
    (to, out): (usize, Vec<u8>),
    from: usize,
) -> Result<Vec<u8>, RuntimeError> {
    if pos % 2 == 1 {
        let got = comm.recv(from)?;
        comm.send(to, out)?;
        Ok(got)
    } else {
        comm.send(to, out)?;
        comm.recv(from)
    }
}

// The wire is little-endian, as every machine we run on is: a tensor's memory is its
// bytes on the wire.
const _: () = assert!(cfg!(target_endian = "little"));

/// The wire bytes of `xs` (little-endian), in one copy.
pub fn wire_bytes<T: zerocopy::IntoBytes + zerocopy::Immutable>(xs: &[T]) -> Vec<u8> {
    xs.as_bytes().to_vec()
}

/// The values of wire bytes `bytes` (little-endian; any alignment), in one copy; a
/// trailing part of a value is left out.
pub fn from_wire<T: zerocopy::FromBytes + zerocopy::IntoBytes + Clone>(bytes: &[u8]) -> Vec<T> {
    from_wire_parts(&[bytes])
}

/// The values of the wire bytes `parts` laid end to end (as [`from_wire`]), each part
/// copied once into the one vector.
pub fn from_wire_parts<T, P>(parts: &[P]) -> Vec<T>
where
    T: zerocopy::FromBytes + zerocopy::IntoBytes + Clone,
    P: AsRef<[u8]>,
{
    let size = std::mem::size_of::<T>().max(1);
    let total: usize = parts.iter().map(|p| p.as_ref().len()).sum();
    let n = total / size;
    let mut out = vec![T::new_zeroed(); n];
    let bytes = out.as_mut_bytes();
    let mut at = 0;
    for part in parts {
        let part = part.as_ref();
        let take = part.len().min(bytes.len() - at);
        bytes[at..at + take].copy_from_slice(&part[..take]);
        at += take;
    }
    out
}

/// A ring reduce-scatter over `ring` (ranks in ring order; this rank is `ring[pos]`):
/// afterwards chunk `pos` of `ring.len()` ([`chunk_range`]) of `buf` holds the ring's
/// sum. Returns the bytes sent.
fn ring_reduce_scatter(
    comm: &mut dyn Communicator,
    ring: &[usize],
    pos: usize,
    buf: &mut [f32],
) -> Result<u64, RuntimeError> {
    let (m, len) = (ring.len(), buf.len());
    let (next, prev) = (ring[(pos + 1) % m], ring[(pos + m - 1) % m]);
    let mut sent = 0;
    for s in 0..m.saturating_sub(1) {
        let send_c = (pos + 2 * m - s - 1) % m;
        let recv_c = (pos + 2 * m - s - 2) % m;
        let out = wire_bytes(&buf[chunk_range(len, m, send_c)]);
        sent += out.len() as u64;
        let theirs = from_wire::<f32>(&exchange_at(comm, pos, (next, out), prev)?);
        let range = chunk_range(len, m, recv_c);
        if theirs.len() != range.len() {
            return Err(malformed(
                comm.rank(),
                prev,
                "all_reduce",
                format!("rank {prev} sent a malformed chunk during a hierarchical all-reduce"),
            ));
        }
        for (a, b) in buf[range].iter_mut().zip(theirs) {
            *a += b;
        }
    }
    Ok(sent)
}

/// A ring all-gather over `ring`: chunk `i` of `buf` comes from `ring[i]`, which holds
/// it. Returns the bytes sent.
fn ring_all_gather(
    comm: &mut dyn Communicator,
    ring: &[usize],
    pos: usize,
    buf: &mut [f32],
) -> Result<u64, RuntimeError> {
    let (m, len) = (ring.len(), buf.len());
    let (next, prev) = (ring[(pos + 1) % m], ring[(pos + m - 1) % m]);
    let mut sent = 0;
    for s in 0..m.saturating_sub(1) {
        let send_c = (pos + m - s) % m;
        let recv_c = (pos + 2 * m - s - 1) % m;
        let out = wire_bytes(&buf[chunk_range(len, m, send_c)]);
        sent += out.len() as u64;
        let theirs = from_wire::<f32>(&exchange_at(comm, pos, (next, out), prev)?);
        let range = chunk_range(len, m, recv_c);
        if theirs.len() != range.len() {
            return Err(malformed(
                comm.rank(),
                prev,
                "all_reduce",
                format!("rank {prev} sent a malformed chunk during a hierarchical all-reduce"),
            ));
        }
        buf[range].copy_from_slice(&theirs);
    }
    Ok(sent)
}

/// Horovod's hierarchical all-reduce over nodes of `local` consecutive ranks: a ring
/// reduce-scatter within each node leaves local rank `l` with slice `l` of the node's
/// sum; the ranks holding slice `l` on every node all-reduce it in a ring across the
/// nodes; a ring all-gather within each node hands every slice to every rank. Each rank
/// sends `2 (L-1)/L` of the buffer within its node and `2 (M-1)/M` of its slice
/// (`1/L` of the buffer) across nodes, against a flat ring's `2 (N-1)/N` of the buffer,
/// whose every step waits on the slowest link. Every rank ends with the same values
/// (each slice is summed by one rank's ring and then copied). With `mean` the sum is
/// divided by N at the end, as the flat ring does.
pub fn hierarchical_all_reduce(
    comm: &mut dyn Communicator,
    buf: &mut [f32],
    mean: bool,
    local: usize,
) -> Result<LinkBytes, RuntimeError> {
    let (n, r) = (comm.size(), comm.rank());
    if local < 2 || !n.is_multiple_of(local) {
        return Err(RuntimeError::Config(format!(
            "a hierarchical all-reduce over nodes of {local} ranks needs a multiple of \
             {local} ranks (at least 2 per node), not {n}"
        )));
    }
    let (nodes, node, l) = (n / local, r / local, r % local);
    let within: Vec<usize> = (0..local).map(|i| node * local + i).collect();
    let across: Vec<usize> = (0..nodes).map(|k| k * local + l).collect();
    let mut bytes = LinkBytes {
        intra_node: ring_reduce_scatter(comm, &within, l, buf)?,
        ..Default::default()
    };
    let slice = chunk_range(buf.len(), local, l);
    if nodes > 1 {
        bytes.inter_node += ring_reduce_scatter(comm, &across, node, &mut buf[slice.clone()])?;
        bytes.inter_node += ring_all_gather(comm, &across, node, &mut buf[slice])?;
    }
    bytes.intra_node += ring_all_gather(comm, &within, l, buf)?;
    if mean {
        let d = n as f32;
        buf.iter_mut().for_each(|x| *x /= d);
    }
    Ok(bytes)
}

/// The bytes one rank sends in a hierarchical all-reduce of `elems` f32 over nodes of
/// `local` ranks out of `n` (rank `rank`): what [`hierarchical_all_reduce`] returns.
pub fn hierarchical_bytes(elems: usize, n: usize, local: usize, rank: usize) -> LinkBytes {
    let (nodes, l) = (n / local.max(1), rank % local.max(1));
    // Each ring phase sends m-1 chunks, in its schedule's order (the reduce-scatter's
    // first chunk is pos-1's, the all-gather's pos's own).
    let chunks = |len: usize, m: usize, pos: usize, scatter: bool| -> u64 {
        (0..m.saturating_sub(1))
            .map(|s| {
                let c = if scatter {
                    (pos + 2 * m - s - 1) % m
                } else {
                    (pos + m - s) % m
                };
                4 * chunk_range(len, m, c).len() as u64
            })
            .sum()
    };
    let slice = chunk_range(elems, local, l).len();
    let intra = chunks(elems, local, l, true) + chunks(elems, local, l, false);
    let inter = if nodes > 1 {
        let node = rank / local;
        chunks(slice, nodes, node, true) + chunks(slice, nodes, node, false)
    } else {
        0
    };
    LinkBytes {
        intra_node: intra,
        inter_node: inter,
    }
}

/// How the workers' hosts (`hosts[w]`, one name per worker rank, from the MPI
/// processor names) meet a plan whose hierarchical all-reduces take nodes of `local`
/// consecutive workers (0: the plan has none).
///
/// `Err` when the workers span several hosts and disagree with the plan: a node of the
/// plan spans hosts, or a host holds workers of several nodes; the message shows where
/// each worker runs and what to do. `Ok` with a note when one host holds every worker
/// (nodes emulated on one machine), or when the plan has no hierarchy but the workers
/// sit on several hosts in equal blocks (what `--ranks-per-node` would describe);
/// else `Ok(None)`.
pub fn check_nodes(hosts: &[String], local: usize) -> Result<Option<String>, String> {
    // Runs of consecutive workers on one host: (host, first, last).
    let mut runs: Vec<(&str, usize, usize)> = Vec::new();
    for (w, h) in hosts.iter().enumerate() {
        match runs.last_mut() {
            Some((last, _, end)) if *last == h.as_str() => *end = w,
            _ => runs.push((h, w, w)),
        }
    }
    let layout = runs
        .iter()
        .map(|(h, a, b)| {
            if a == b {
                format!("worker {a} on {h}")
            } else {
                format!("workers {a}-{b} on {h}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    let distinct = {
        let mut names: Vec<&str> = runs.iter().map(|r| r.0).collect();
        names.sort_unstable();
        names.dedup();
        names.len()
    };
    // Every host one block, all blocks the same size: the `--ranks-per-node` that
    // describes this job.
    let block = runs[..]
        .first()
        .map(|r| r.2 - r.1 + 1)
        .filter(|&k| runs.len() == distinct && runs.iter().all(|r| r.2 - r.1 + 1 == k));
    if local < 2 {
        return Ok(match block {
            Some(k) if k >= 2 && runs.len() >= 2 => Some(format!(
                "the {} workers run on {} hosts, {k} each ({layout}): compiled with \
                 --ranks-per-node {k}, the plan's all-reduces could run hierarchically \
                 where the cost model finds it faster",
                hosts.len(),
                runs.len()
            )),
            _ => None,
        });
    }
    if distinct == 1 {
        // One machine standing in for several nodes (a test, a rehearsal): allowed.
        return Ok(Some(format!(
            "all {} workers run on {}: the plan's nodes of {local} share its links",
            hosts.len(),
            runs[0].0
        )));
    }
    let fits = hosts.iter().enumerate().all(|(w, h)| {
        hosts
            .iter()
            .enumerate()
            .all(|(v, g)| (w / local == v / local) == (h == g))
    });
    if fits {
        return Ok(None);
    }
    let fix = match block {
        Some(k) if k >= 2 => format!("compile with --ranks-per-node {k}"),
        Some(_) => "compile without --ranks-per-node (one worker a host)".to_string(),
        None => format!(
            "start {local} ranks on each host, in rank order (mpirun --map-by \
             ppr:{local}:node), or compile without --ranks-per-node"
        ),
    };
    Err(format!(
        "the plan's hierarchical all-reduces take nodes of {local} consecutive workers \
         (--ranks-per-node {local}), but {layout}: {fix}"
    ))
}
