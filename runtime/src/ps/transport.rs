//! How parameter-server messages travel: a worker's [`WorkerLink`] to every server and
//! a server's [`ServerLink`] to every worker. Links move encoded messages (see
//! [`super::wire`]); they know ranks, not variables or steps, so [`super::Server`] and
//! [`super::PsClient`] run unchanged over any of them. Two implementations: in-process
//! channels ([`in_process_links`]) and MPI point-to-point (`comm::mpi`, feature `mpi`).

use crate::core::error::{PeerKind, Result, RuntimeError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

/// A worker's end: requests to servers by index, replies addressed to this worker.
pub trait WorkerLink: Send {
    /// Sends an encoded request to server `server` without waiting for it. A link that
    /// delivers later fails a later call once a server has not taken a message in time.
    fn send(&mut self, server: usize, msg: Vec<u8>) -> Result<()>;
    /// The next reply to this worker, waiting at most `timeout`; `None` on timeout.
    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>>;
    /// Waits until every request sent has been delivered; fails, naming the server,
    /// when one is not taken in time.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
}

/// What a server's [`ServerLink::recv`] got.
#[derive(Debug)]
pub enum Incoming {
    /// A request and the worker rank that sent it.
    Request(usize, Vec<u8>),
    /// Nothing within the time asked for.
    Idle,
    /// No worker can send any more.
    Closed,
}

/// A server's end: requests from any worker, replies to a worker by rank.
pub trait ServerLink: Send {
    /// The next request, waiting at most `timeout` (with `None`, until one comes or no
    /// worker can send any more). An error is the link's own: a worker that did not take
    /// a reply in time, a message from a rank that is no worker.
    fn recv(&mut self, timeout: Option<Duration>) -> Result<Incoming>;
    /// Sends an encoded reply to worker `worker` without waiting for it.
    fn send(&mut self, worker: usize, msg: Vec<u8>) -> Result<()>;
    /// How long this process has been suspended in all (time a server's waits on
    /// workers leave out); zero where the link cannot tell.
    fn suspended(&self) -> Duration {
        Duration::ZERO
    }
    /// The bound on the server's waits on workers, where the link carries one (the
    /// run's `--timeout`, which may be set after the server started).
    fn timeout(&self) -> Option<Duration> {
        None
    }
    /// Waits until every reply sent has been delivered; fails, naming the worker, when
    /// one is not taken in time.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
}

/// An in-process worker link.
pub struct InProcessWorkerLink {
    rank: usize,
    to_servers: Vec<Sender<(usize, Vec<u8>)>>,
    replies: Receiver<Vec<u8>>,
}

/// An in-process server link.
pub struct InProcessServerLink {
    requests: Receiver<(usize, Vec<u8>)>,
    to_workers: Vec<Sender<Vec<u8>>>,
    /// The servers' timeout in nanoseconds (0: none), shared with whoever sets it.
    pub(crate) timeout_ns: Arc<AtomicU64>,
}

/// Links between `workers` workers and `servers` servers of one process, by rank and
/// server index. A server's `recv` fails once every worker link is dropped.
pub fn in_process_links(
    workers: usize,
    servers: usize,
) -> (Vec<InProcessWorkerLink>, Vec<InProcessServerLink>) {
    let (req_tx, req_rx): (Vec<_>, Vec<_>) = (0..servers).map(|_| channel()).unzip();
    let (rep_tx, rep_rx): (Vec<_>, Vec<_>) = (0..workers).map(|_| channel()).unzip();
    let worker_links = rep_rx
        .into_iter()
        .enumerate()
        .map(|(rank, replies)| InProcessWorkerLink {
            rank,
            to_servers: req_tx.clone(),
            replies,
        })
        .collect();
    let server_links = req_rx
        .into_iter()
        .map(|requests| InProcessServerLink {
            requests,
            to_workers: rep_tx.clone(),
            timeout_ns: Arc::new(AtomicU64::new(0)),
        })
        .collect();
    (worker_links, server_links)
}

impl InProcessWorkerLink {
    /// Sends as if from worker `rank` (for a cluster that stops servers on behalf of
    /// clients it handed out).
    pub(crate) fn send_as(&self, rank: usize, server: usize, msg: Vec<u8>) -> Result<()> {
        // Clients check a shard's server against the cluster's, which made these links.
        self.to_servers
            .get(server)
            .ok_or_else(|| {
                RuntimeError::internal(
                    "parameter-server links",
                    format!("parameter server {server} does not exist"),
                )
            })?
            .send((rank, msg))
            .map_err(|_| RuntimeError::Peer {
                rank,
                // In-process servers have no rank: the server's index.
                peer: server,
                op: "parameter-server request".into(),
                kind: PeerKind::HungUp,
                message: format!("parameter server {server} has stopped"),
            })
    }
}

impl WorkerLink for InProcessWorkerLink {
    fn send(&mut self, server: usize, msg: Vec<u8>) -> Result<()> {
        self.send_as(self.rank, server, msg)
    }
    fn recv(&mut self, timeout: Duration) -> Result<Option<Vec<u8>>> {
        match self.replies.recv_timeout(timeout) {
            Ok(m) => Ok(Some(m)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(RuntimeError::Peer {
                rank: self.rank,
                // Every one of them: the first.
                peer: 0,
                op: "parameter-server reply".into(),
                kind: PeerKind::HungUp,
                message: "every parameter server has stopped".into(),
            }),
        }
    }
}

impl ServerLink for InProcessServerLink {
    fn recv(&mut self, timeout: Option<Duration>) -> Result<Incoming> {
        let got = match timeout {
            None => self
                .requests
                .recv()
                .map_err(|_| RecvTimeoutError::Disconnected),
            Some(t) => self.requests.recv_timeout(t),
        };
        Ok(match got {
            Ok((from, msg)) => Incoming::Request(from, msg),
            Err(RecvTimeoutError::Timeout) => Incoming::Idle,
            Err(RecvTimeoutError::Disconnected) => Incoming::Closed,
        })
    }
    fn timeout(&self) -> Option<Duration> {
        match self.timeout_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }
    fn send(&mut self, worker: usize, msg: Vec<u8>) -> Result<()> {
        // A worker that has gone no longer waits for the reply: dropping it is right.
        if let Some(tx) = self.to_workers.get(worker) {
            let _ = tx.send(msg);
        }
        Ok(())
    }
}
