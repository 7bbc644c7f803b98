//! In-process communicator: ranks are threads of one process, connected by one
//! `std::sync::mpsc` channel per ordered pair of ranks.
//!
//! This is real message passing, not a shared sum behind a lock: each collective runs
//! the same ring schedule a networked implementation would, so the byte counts, the
//! order of floating-point additions and the failure behaviour match. Messages carry
//! typed vectors (`Vec<f32>`, `Vec<f64>`, `Vec<u8>`) to avoid serialising, but bytes are
//! counted as a network would carry them. Each message also carries a small header (the
//! operation, and the smallest and largest buffer length seen so far along the ring)
//! that lets ranks detect mismatched calls; headers are not counted, as framing would
//! not be on a real network either.

use super::{chunk_range, ByteCount, Communicator};
use crate::core::error::{PeerKind, RuntimeError};
use std::fmt;
use std::ops::{Add, Div};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

/// Which operation a message belongs to; a receiver checks it against its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
    Send,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::Send => "send/recv",
        })
    }
}

/// A message's data, typed so no serialisation is needed in-process.
enum Payload {
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bytes(Vec<u8>),
}

impl Payload {
    /// The bytes this payload would occupy on a network.
    fn wire_bytes(&self) -> u64 {
        let n = match self {
            Payload::F32(v) => v.len() * 4,
            Payload::F64(v) => v.len() * 8,
            Payload::Bytes(v) => v.len(),
        };
        n as u64
    }
}

/// One message: header (not counted) and payload (counted).
struct Msg {
    op: Op,
    /// Smallest and largest buffer length the sender has seen along the ring (reductions).
    lens: (u64, u64),
    payload: Payload,
}

/// Element types the ring reductions work on.
trait Elem: Copy + Add<Output = Self> + Div<Output = Self> {
    fn wrap(v: Vec<Self>) -> Payload;
    fn unwrap(p: Payload) -> Option<Vec<Self>>;
    fn from_count(n: usize) -> Self;
}

impl Elem for f32 {
    fn wrap(v: Vec<Self>) -> Payload {
        Payload::F32(v)
    }
    fn unwrap(p: Payload) -> Option<Vec<Self>> {
        match p {
            Payload::F32(v) => Some(v),
            _ => None,
        }
    }
    fn from_count(n: usize) -> Self {
        n as f32
    }
}

impl Elem for f64 {
    fn wrap(v: Vec<Self>) -> Payload {
        Payload::F64(v)
    }
    fn unwrap(p: Payload) -> Option<Vec<Self>> {
        match p {
            Payload::F64(v) => Some(v),
            _ => None,
        }
    }
    fn from_count(n: usize) -> Self {
        n as f64
    }
}

/// `n` connected in-process communicators, one per rank, in rank order; move each into
/// its rank's thread. `n == 0` gives none.
pub fn in_process(n: usize) -> Vec<InProcessComm> {
    // senders[from][to] and receivers[to][from] are the two ends of one channel.
    let mut senders: Vec<Vec<Sender<Msg>>> = (0..n).map(|_| Vec::with_capacity(n)).collect();
    let mut receivers: Vec<Vec<Receiver<Msg>>> = (0..n).map(|_| Vec::with_capacity(n)).collect();
    for from_senders in senders.iter_mut() {
        for to_receivers in receivers.iter_mut() {
            let (s, r) = channel();
            from_senders.push(s);
            to_receivers.push(r);
        }
    }
    senders
        .into_iter()
        .zip(receivers)
        .enumerate()
        .map(|(rank, (to, from))| InProcessComm {
            rank,
            size: n,
            to,
            from,
            timeout: None,
            bytes: ByteCount::default(),
            closed: None,
        })
        .collect()
}

/// One rank's end of an in-process group (see [`in_process`]).
///
/// After a communication failure (a peer hung up, a timeout, ranks calling different
/// operations) it closes all its channels, so peers waiting on it fail too rather than
/// wait forever, and every later call returns an error. A length mismatch in a
/// reduction is detected consistently by every rank and does not close it.
pub struct InProcessComm {
    rank: usize,
    size: usize,
    /// Sending ends, indexed by destination rank (empty once closed).
    to: Vec<Sender<Msg>>,
    /// Receiving ends, indexed by source rank (empty once closed).
    from: Vec<Receiver<Msg>>,
    timeout: Option<Duration>,
    bytes: ByteCount,
    /// Why the communicator was closed, once it is.
    closed: Option<String>,
}

impl fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("bytes", &self.bytes)
            .field("closed", &self.closed)
            .finish()
    }
}

impl InProcessComm {
    /// Bounds every wait for a message (`None`, the default, waits until the message
    /// arrives or its sender hangs up). A timeout fails the operation and closes the
    /// communicator; set it well above the slowest rank's compute time between
    /// collectives.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Ranks whose calls disagree run programs that disagree.
    fn err(&self, message: impl fmt::Display) -> RuntimeError {
        RuntimeError::Plan(format!("rank {}: {message}", self.rank))
    }

    /// Closes every channel (peers waiting on this rank see it hang up) and returns
    /// the error that caused it: what peer rank `peer` did (or did not do) during `op`.
    fn peer_failed(
        &mut self,
        peer: usize,
        op: Op,
        kind: PeerKind,
        message: String,
    ) -> RuntimeError {
        self.to.clear();
        self.from.clear();
        self.closed = Some(message.clone());
        RuntimeError::Peer {
            rank: self.rank,
            peer,
            op: op.to_string(),
            kind,
            message,
        }
    }

    fn check_open(&self, op: Op) -> Result<(), RuntimeError> {
        match &self.closed {
            // A consequence, as a hang-up is: the cause is the earlier error.
            Some(why) => Err(RuntimeError::Peer {
                rank: self.rank,
                peer: self.rank,
                op: op.to_string(),
                kind: PeerKind::HungUp,
                message: format!("{op} on a communicator closed after an earlier error ({why})"),
            }),
            None => Ok(()),
        }
    }

    fn check_rank(&self, peer: usize, what: &str, op: Op) -> Result<(), RuntimeError> {
        if peer < self.size {
            Ok(())
        } else {
            // A broadcast's root is the plan's.
            Err(self.err(format_args!(
                "{op}: {what} rank {peer} out of range (size {})",
                self.size
            )))
        }
    }

    fn send_msg(
        &mut self,
        to: usize,
        op: Op,
        lens: (u64, u64),
        payload: Payload,
    ) -> Result<(), RuntimeError> {
        let n = payload.wire_bytes();
        let sent = match self.to.get(to) {
            Some(s) => s.send(Msg { op, lens, payload }).is_ok(),
            None => false,
        };
        if !sent {
            return Err(self.peer_failed(
                to,
                op,
                PeerKind::HungUp,
                format!("peer rank {to} hung up during {op}"),
            ));
        }
        self.bytes.sent += n;
        Ok(())
    }

    fn recv_msg(&mut self, from: usize, op: Op) -> Result<Msg, RuntimeError> {
        let got = match (self.from.get(from), self.timeout) {
            (None, _) => Err(RecvTimeoutError::Disconnected),
            (Some(r), Some(t)) => r.recv_timeout(t),
            (Some(r), None) => r.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match got {
            Ok(msg) if msg.op == op => {
                self.bytes.received += msg.payload.wire_bytes();
                Ok(msg)
            }
            Ok(msg) => Err(self.peer_failed(
                from,
                op,
                PeerKind::Malformed,
                format!(
                    "expected a {op} message from rank {from}, got {}: ranks called different \
                     operations",
                    msg.op
                ),
            )),
            Err(RecvTimeoutError::Disconnected) => Err(self.peer_failed(
                from,
                op,
                PeerKind::HungUp,
                format!("peer rank {from} hung up during {op}"),
            )),
            Err(RecvTimeoutError::Timeout) => Err(self.peer_failed(
                from,
                op,
                PeerKind::TimedOut,
                format!(
                    "no message from rank {from} within {:?} during {op}",
                    self.timeout.unwrap_or_default()
                ),
            )),
        }
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn prev(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// Ring reduce-scatter in place: afterwards chunk `rank` of `data` holds the sum over
    /// all ranks (other chunks hold partial sums). At step `s` rank `r` sends chunk
    /// `r-s-1` to `r+1` and adds the chunk `r-s-2` received from `r-1` into its own, so
    /// chunk `c` is summed in ring order starting at rank `c+1` and ending at rank `c`.
    /// Needs `size >= 2`. Every rank runs all `N-1` steps even when lengths differ, and
    /// the length range carried in the headers covers every rank by the end, so all
    /// ranks report a mismatch together and the channels are left drained.
    fn ring_reduce_scatter<T: Elem>(&mut self, data: &mut [T], op: Op) -> Result<(), RuntimeError> {
        let (n, r, len) = (self.size, self.rank, data.len());
        let (next, prev) = (self.next(), self.prev());
        let mut lens = (len as u64, len as u64);
        for s in 0..n - 1 {
            let send_c = (r + 2 * n - s - 1) % n;
            let recv_c = (r + 2 * n - s - 2) % n;
            let chunk = data[chunk_range(len, n, send_c)].to_vec();
            self.send_msg(next, op, lens, T::wrap(chunk))?;
            let msg = self.recv_msg(prev, op)?;
            lens = (lens.0.min(msg.lens.0), lens.1.max(msg.lens.1));
            let Some(theirs) = T::unwrap(msg.payload) else {
                return Err(self.peer_failed(
                    prev,
                    op,
                    PeerKind::Malformed,
                    format!("rank {prev} sent a different element type during {op}"),
                ));
            };
            let range = chunk_range(len, n, recv_c);
            if theirs.len() == range.len() {
                for (a, b) in data[range].iter_mut().zip(theirs) {
                    *a = *a + b;
                }
            }
        }
        if lens.0 != lens.1 {
            return Err(self.err(format_args!(
                "{op}: buffer lengths differ across ranks ({} to {} elements; this rank has {len})",
                lens.0, lens.1
            )));
        }
        Ok(())
    }

    fn all_reduce_ring<T: Elem>(&mut self, buf: &mut [T], mean: bool) -> Result<(), RuntimeError> {
        let op = Op::AllReduce;
        self.check_open(op)?;
        let (n, r, len) = (self.size, self.rank, buf.len());
        if n <= 1 {
            return Ok(());
        }
        self.ring_reduce_scatter(buf, op)?;
        if mean {
            let d = T::from_count(n);
            for x in &mut buf[chunk_range(len, n, r)] {
                *x = *x / d;
            }
        }
        // All-gather the reduced chunks: at step s rank r forwards chunk r-s.
        let (next, prev) = (self.next(), self.prev());
        for s in 0..n - 1 {
            let send_c = (r + n - s) % n;
            let recv_c = (r + 2 * n - s - 1) % n;
            let chunk = buf[chunk_range(len, n, send_c)].to_vec();
            self.send_msg(next, op, (len as u64, len as u64), T::wrap(chunk))?;
            let msg = self.recv_msg(prev, op)?;
            let range = chunk_range(len, n, recv_c);
            match T::unwrap(msg.payload) {
                Some(theirs) if theirs.len() == range.len() => {
                    buf[range].copy_from_slice(&theirs);
                }
                _ => {
                    return Err(self.peer_failed(
                        prev,
                        op,
                        PeerKind::Malformed,
                        format!("rank {prev} sent a malformed chunk during {op}"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Ring all-gather of byte blocks (`size >= 2`): at step s rank r forwards block r-s.
    fn ring_gather(&mut self, mine: Vec<u8>, op: Op) -> Result<Vec<Vec<u8>>, RuntimeError> {
        let (n, r) = (self.size, self.rank);
        let (next, prev) = (self.next(), self.prev());
        let mut blocks = vec![Vec::new(); n];
        blocks[r] = mine;
        for s in 0..n - 1 {
            let send_b = (r + n - s) % n;
            let recv_b = (r + 2 * n - s - 1) % n;
            self.send_msg(next, op, (0, 0), Payload::Bytes(blocks[send_b].clone()))?;
            match self.recv_msg(prev, op)?.payload {
                Payload::Bytes(v) => blocks[recv_b] = v,
                _ => {
                    return Err(self.peer_failed(
                        prev,
                        op,
                        PeerKind::Malformed,
                        format!("rank {prev} sent a non-byte message during {op}"),
                    ))
                }
            }
        }
        Ok(blocks)
    }
}

impl Communicator for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&mut self, buf: &mut [f32], mean: bool) -> Result<(), RuntimeError> {
        self.all_reduce_ring(buf, mean)
    }

    fn all_reduce_f64(&mut self, buf: &mut [f64], mean: bool) -> Result<(), RuntimeError> {
        self.all_reduce_ring(buf, mean)
    }

    fn all_gather(&mut self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>, RuntimeError> {
        self.check_open(Op::AllGather)?;
        if self.size <= 1 {
            return Ok(vec![mine]);
        }
        self.ring_gather(mine, Op::AllGather)
    }

    fn reduce_scatter(&mut self, buf: &[f32], mean: bool) -> Result<Vec<f32>, RuntimeError> {
        let op = Op::ReduceScatter;
        self.check_open(op)?;
        let (n, r) = (self.size, self.rank);
        if n <= 1 {
            return Ok(buf.to_vec());
        }
        let mut data = buf.to_vec();
        self.ring_reduce_scatter(&mut data, op)?;
        let mut mine = data[chunk_range(buf.len(), n, r)].to_vec();
        if mean {
            let d = n as f32;
            for x in &mut mine {
                *x /= d;
            }
        }
        Ok(mine)
    }

    fn broadcast(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), RuntimeError> {
        let op = Op::Broadcast;
        self.check_open(op)?;
        self.check_rank(root, "root", op)?;
        if self.size <= 1 {
            return Ok(());
        }
        let (next, prev) = (self.next(), self.prev());
        let len = buf.len() as u64;
        if self.rank == root {
            return self.send_msg(next, op, (len, len), Payload::Bytes(buf.clone()));
        }
        let msg = self.recv_msg(prev, op)?;
        let Payload::Bytes(data) = msg.payload else {
            return Err(self.peer_failed(
                prev,
                op,
                PeerKind::Malformed,
                format!("rank {prev} sent a non-byte message during {op}"),
            ));
        };
        if next != root {
            self.send_msg(next, op, msg.lens, Payload::Bytes(data.clone()))?;
        }
        if data.len() != buf.len() {
            return Err(self.err(format_args!(
                "{op} from root {root}: root sent {} bytes, this rank's buffer holds {}",
                data.len(),
                buf.len()
            )));
        }
        *buf = data;
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), RuntimeError> {
        self.check_open(Op::Barrier)?;
        if self.size <= 1 {
            return Ok(());
        }
        // After N-1 ring steps each rank has (indirectly) heard from every other rank,
        // so all of them have entered the barrier.
        self.ring_gather(Vec::new(), Op::Barrier).map(|_| ())
    }

    fn send(&mut self, to: usize, data: Vec<u8>) -> Result<(), RuntimeError> {
        let op = Op::Send;
        self.check_open(op)?;
        self.check_rank(to, "destination", op)?;
        self.send_msg(to, op, (0, 0), Payload::Bytes(data))
    }

    fn recv(&mut self, from: usize) -> Result<Vec<u8>, RuntimeError> {
        let op = Op::Send;
        self.check_open(op)?;
        self.check_rank(from, "source", op)?;
        match self.recv_msg(from, op)?.payload {
            Payload::Bytes(v) => Ok(v),
            _ => Err(self.peer_failed(
                from,
                op,
                PeerKind::Malformed,
                format!("rank {from} sent a non-byte message during {op}"),
            )),
        }
    }

    fn bytes(&self) -> ByteCount {
        self.bytes
    }
}
