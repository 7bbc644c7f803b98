//! A worker's handle on the parameter servers: splits pulls and pushes by shard,
//! sends them over its [`WorkerLink`] and gathers the replies by tag.
//!
//! A wait for an answer lasts the timeout, plus a grace in which a server that waits on
//! another worker itself says which (it fails the request at the same timeout, counted
//! from the request's arrival): only a server that says nothing is blamed. Time this
//! process spent suspended (a `SIGSTOP`, a starved machine) does not count against the
//! servers.

use super::server::slice_rows;
use super::transport::WorkerLink;
use super::wire::{Reply, Request};
use super::{concat_rows, ShardList};
use crate::core::error::{PeerKind, Result, RuntimeError};
use crate::core::value::HostElem;
use crate::core::value::{Slices, Tensor, Value};
use distc_ir::DType;
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A worker's handle on the servers. After any error it fails every later call with
/// that error (a failed server stays failed).
pub struct PsClient {
    rank: usize,
    workers: usize,
    servers: usize,
    link: Option<Box<dyn WorkerLink>>,
    timeout: Duration,
    next_tag: u64,
    failed: Option<RuntimeError>,
    sent: u64,
    received: u64,
}

/// A variable's shards `(server, start, end)` sorted by rows and checked to cover
/// `0..rows` contiguously; returns them and `rows`.
fn layout(
    op: &str,
    var: &str,
    shards: &[(usize, usize, usize)],
    servers: usize,
) -> Result<(ShardList, usize)> {
    let mut sh = shards.to_vec();
    sh.sort_by_key(|s| s.1);
    if sh.is_empty() {
        return Err(RuntimeError::plan(format!(
            "{op} of `{var}`: no shards given"
        )));
    }
    let mut at = 0;
    for &(s, a, b) in &sh {
        if s >= servers {
            return Err(RuntimeError::plan(format!(
                "{op} of `{var}`: server {s} does not exist ({servers} servers)"
            )));
        }
        if a != at || b <= a {
            return Err(RuntimeError::plan(format!(
                "{op} of `{var}`: shards {shards:?} do not cover its rows contiguously"
            )));
        }
        at = b;
    }
    Ok((sh, at))
}

/// The index in `sh` (sorted, contiguous from 0) of the shard holding row `id`.
fn shard_of(sh: &[(usize, usize, usize)], id: usize) -> usize {
    sh.partition_point(|&(_, a, _)| a <= id).saturating_sub(1)
}

/// How much longer than the timeout a worker waits for a server's own explanation of a
/// late answer.
fn grace(timeout: Duration) -> Duration {
    timeout.min(Duration::from_secs(2))
}

/// A wait on the link that returned this much later than asked was a suspended process,
/// not a silent server.
const SUSPENDED: Duration = Duration::from_secs(1);

/// Waits on `link` for at most `wait`; pushes `deadline` back by any time the process
/// spent suspended meanwhile.
fn recv_until(link: &mut dyn WorkerLink, deadline: &mut Instant) -> Result<Option<Vec<u8>>> {
    let asked = deadline.saturating_duration_since(Instant::now());
    let t = Instant::now();
    let got = link.recv(asked)?;
    let late = t.elapsed().saturating_sub(asked);
    if late > SUSPENDED {
        *deadline += late;
    }
    Ok(got)
}

/// The gradient's dtype against the servers' masters, f32 (or f64 for a float64
/// copy): the model's precision.
fn served_float(op: &str, var: &str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::F64 => Ok(()),
        d => Err(RuntimeError::plan(format!(
            "{op} of `{var}`: a {d} gradient (the servers hold f32 or f64)"
        ))),
    }
}

/// Why the servers' answers to a sparse pull do not hold its rows.
enum Unpulled {
    /// No answer held any rows.
    None,
    /// Answer `k` held too few rows.
    Short(usize),
    Shape(String),
}

/// The pulled rows in the order of `ids`, `pos[id]` being (answer, row in it): each
/// answer holds each of its distinct rows once.
fn in_id_order<T: HostElem>(
    parts: &[Option<Tensor>],
    ids: &[i32],
    pos: &HashMap<i32, (usize, usize)>,
) -> std::result::Result<Tensor, Unpulled> {
    let arrays: Vec<Option<&ArrayD<T>>> = parts
        .iter()
        .map(|p| p.as_ref().and_then(T::array))
        .collect();
    let first = arrays.iter().flatten().next().ok_or(Unpulled::None)?;
    let rest: Vec<usize> = first.shape()[1..].to_vec();
    let row: usize = rest.iter().product();
    let mut data: Vec<T> = Vec::with_capacity(ids.len() * row);
    for id in ids {
        let (k, p) = pos[id];
        let src = arrays[k]
            .and_then(|a| a.as_slice())
            .and_then(|s| s.get(p * row..(p + 1) * row))
            .ok_or(Unpulled::Short(k))?;
        data.extend_from_slice(src);
    }
    let mut shape = vec![ids.len()];
    shape.extend_from_slice(&rest);
    ArrayD::from_shape_vec(IxDyn(&shape), data)
        .map(T::tensor)
        .map_err(|e| Unpulled::Shape(e.to_string()))
}

/// A worker's row-sparse gradient as one message per shard: duplicate rows summed in
/// order of appearance, each row's index rebased to its shard.
fn split_by_shard<T: HostElem>(
    var: &str,
    vals: &ArrayD<T>,
    indices: &[i32],
    sh: &ShardList,
    rows: usize,
) -> Result<Vec<(Vec<i32>, Tensor)>> {
    let rest = &vals.shape()[1..];
    let row: usize = rest.iter().product();
    let vals = vals.as_standard_layout();
    let vs = vals.as_slice().ok_or_else(|| {
        RuntimeError::internal(
            "parameter servers",
            format!("sparse_push of `{var}`: non-contiguous values"),
        )
    })?;
    let mut pos: HashMap<i32, (usize, usize)> = HashMap::with_capacity(indices.len());
    let mut idx: Vec<Vec<i32>> = vec![Vec::new(); sh.len()];
    let mut data: Vec<Vec<T>> = vec![Vec::new(); sh.len()];
    for (r, &id) in indices.iter().enumerate() {
        let src = &vs[r * row..(r + 1) * row];
        if let Some(&(k, p)) = pos.get(&id) {
            for (d, s) in data[k][p * row..(p + 1) * row].iter_mut().zip(src) {
                *d += *s;
            }
            continue;
        }
        // The ids come from the data.
        if id < 0 || id as usize >= rows {
            return Err(RuntimeError::plan(format!(
                "sparse_push of `{var}`: id {id} is not in 0..{rows}"
            )));
        }
        let k = shard_of(sh, id as usize);
        pos.insert(id, (k, idx[k].len()));
        idx[k].push((id as usize - sh[k].1) as i32);
        data[k].extend_from_slice(src);
    }
    idx.into_iter()
        .zip(data)
        .map(|(indices, data)| {
            let mut shape = vec![indices.len()];
            shape.extend_from_slice(rest);
            // `indices.len()` rows of `row` values each, gathered above.
            let values = ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(|e| {
                RuntimeError::internal("parameter servers", format!("sparse_push of `{var}`: {e}"))
            })?;
            Ok((indices, T::tensor(values)))
        })
        .collect()
}

impl PsClient {
    /// The client of worker `rank` of `workers`, over `link` to `servers` servers;
    /// every wait for an answer is bounded by `timeout`.
    pub fn new(
        rank: usize,
        workers: usize,
        servers: usize,
        link: Box<dyn WorkerLink>,
        timeout: Duration,
    ) -> PsClient {
        PsClient {
            rank,
            workers,
            servers,
            link: Some(link),
            timeout,
            next_tag: 0,
            failed: None,
            sent: 0,
            received: 0,
        }
    }

    /// A client every call of which fails (a rank with no link).
    pub(crate) fn invalid(rank: usize, workers: usize, servers: usize) -> PsClient {
        PsClient {
            rank,
            workers,
            servers,
            link: None,
            timeout: super::DEFAULT_TIMEOUT,
            next_tag: 0,
            failed: None,
            sent: 0,
            received: 0,
        }
    }

    /// This client's worker rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Fails if this client's rank is invalid or an earlier call failed.
    fn check(&self) -> Result<()> {
        // The launcher hands out one client per worker rank.
        if self.rank >= self.workers || self.link.is_none() {
            return Err(RuntimeError::internal(
                "parameter servers",
                format!(
                    "parameter-server client of rank {} (there are {} workers, one client each)",
                    self.rank, self.workers
                ),
            ));
        }
        match &self.failed {
            Some(e) => Err(e.duplicate()),
            None => Ok(()),
        }
    }

    /// Server `server`'s rank (servers follow the workers).
    fn server_rank(&self, server: usize) -> usize {
        self.workers + server
    }

    /// Server `server` failed (an error of its own, or another worker's it answers
    /// with): a consequence here, as a peer's hang-up is.
    fn server_failed(&self, server: usize, op: &str, message: String) -> RuntimeError {
        RuntimeError::Peer {
            rank: self.rank,
            peer: self.server_rank(server),
            op: op.to_string(),
            kind: PeerKind::HungUp,
            message,
        }
    }

    /// Server `server` answered with what the protocol does not allow.
    fn malformed(&self, server: usize, op: &str, message: String) -> RuntimeError {
        RuntimeError::Peer {
            rank: self.rank,
            peer: self.server_rank(server),
            op: op.to_string(),
            kind: PeerKind::Malformed,
            message,
        }
    }

    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }

    fn link(&mut self) -> Result<&mut Box<dyn WorkerLink>> {
        let rank = self.rank;
        self.link.as_mut().ok_or_else(|| {
            RuntimeError::internal(
                "parameter servers",
                format!("parameter-server client of rank {rank}: no link"),
            )
        })
    }

    fn send(&mut self, server: usize, var: &str, msg: Request) -> Result<()> {
        let r = self.link()?.send(server, msg.encode());
        r.map_err(|e| {
            self.fail(e.context(format_args!("parameter server {server} (variable `{var}`)")))
        })
    }

    /// Remembers the first error, so every later call returns it.
    fn fail(&mut self, e: RuntimeError) -> RuntimeError {
        if self.failed.is_none() {
            self.failed = Some(e.duplicate());
        }
        e
    }

    /// Waits for the replies to the pulls `asked` (`(tag, shard index)`); returns the
    /// rows by shard index. Replies to other tags (of a call that failed earlier) are
    /// dropped. A server error, or no answer within the timeout, fails the call.
    fn collect(
        &mut self,
        op: &str,
        var: &str,
        step: u64,
        sh: &[(usize, usize, usize)],
        asked: &[(u64, usize)],
    ) -> Result<Vec<Option<Tensor>>> {
        let mut parts: Vec<Option<Tensor>> = vec![None; sh.len()];
        let mut left: HashMap<u64, usize> = asked.iter().copied().collect();
        let mut deadline = Instant::now() + self.timeout + grace(self.timeout);
        while !left.is_empty() {
            let got = recv_until(&mut **self.link()?, &mut deadline);
            let bytes = match got {
                Ok(Some(b)) => b,
                Ok(None) => {
                    let mut silent: Vec<usize> = left.values().map(|&k| sh[k].0).collect();
                    silent.sort_unstable();
                    silent.dedup();
                    let e = RuntimeError::Peer {
                        rank: self.rank,
                        peer: self.server_rank(silent[0]),
                        op: op.to_string(),
                        kind: PeerKind::TimedOut,
                        message: format!(
                            "{op} of `{var}` at step {step}: parameter server(s) {silent:?} did \
                             not answer within {:.0} s (--timeout)",
                            self.timeout.as_secs_f64()
                        ),
                    };
                    return Err(self.fail(e));
                }
                Err(e) => return Err(self.fail(e.context(format_args!("{op} of `{var}`")))),
            };
            let reply = match Reply::decode(&bytes) {
                Ok(r) => r,
                Err(e) => {
                    // The reply names no sender: one of the servers still to answer.
                    let server = left.values().map(|&k| sh[k].0).min().unwrap_or(0);
                    let e = self.malformed(
                        server,
                        op,
                        format!("{op} of `{var}`: a malformed reply: {e}"),
                    );
                    return Err(self.fail(e));
                }
            };
            let Some(k) = left.remove(&reply.tag()) else {
                continue;
            };
            let server = sh[k].0;
            match reply {
                Reply::Rows { result: Ok(t), .. } => parts[k] = Some(t),
                // A request the server refused (no such shard, rows it cannot give):
                // this worker's program disagrees with the server's; the server itself
                // carries on.
                Reply::Rows { result: Err(e), .. } => return Err(RuntimeError::Plan(e)),
                Reply::Shards { result: Err(e), .. } => {
                    return Err(self.server_failed(server, op, e))
                }
                Reply::Failed { error, .. } => {
                    let e = self.server_failed(server, op, error);
                    return Err(self.fail(e));
                }
                Reply::Shards { .. } => {
                    let e = self.malformed(
                        server,
                        op,
                        format!("{op} of `{var}`: shards came back instead of rows"),
                    );
                    return Err(self.fail(e));
                }
            }
        }
        Ok(parts)
    }

    /// The whole variable `var` (dense), assembled from its shards
    /// `[(server, start, end)]`, as of `step` (see the module doc).
    pub fn pull(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        step: u64,
    ) -> Result<Tensor> {
        self.check()?;
        let (sh, _) = layout("pull", var, shards, self.servers)?;
        let mut asked = Vec::new();
        for (k, &(s, a, b)) in sh.iter().enumerate() {
            let tag = self.tag();
            let msg = Request::Pull {
                tag,
                var: var.to_string(),
                start: a,
                end: b,
                ids: None,
                step,
            };
            self.send(s, var, msg)?;
            asked.push((tag, k));
        }
        let parts = self.collect("pull", var, step, &sh, &asked)?;
        let parts: Vec<Tensor> = parts.into_iter().flatten().collect();
        let t = concat_rows(var, parts)?;
        self.received += t.bytes() as u64;
        Ok(t)
    }

    /// Rows `ids` (any order, repeats allowed) of table `var`: each server is sent
    /// only the distinct ids in its range (8 bytes each) and returns each distinct
    /// row once. Returns `[ids.len(), row...]` in the order of `ids`.
    pub fn sparse_pull(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        ids: &[i32],
        step: u64,
    ) -> Result<Tensor> {
        self.check()?;
        let (sh, rows) = layout("sparse_pull", var, shards, self.servers)?;
        // Distinct ids, each placed at (shard, position in that shard's request).
        let mut pos: HashMap<i32, (usize, usize)> = HashMap::with_capacity(ids.len());
        let mut local: Vec<Vec<usize>> = vec![Vec::new(); sh.len()];
        for &id in ids {
            if pos.contains_key(&id) {
                continue;
            }
            // The ids come from the data.
            if id < 0 || id as usize >= rows {
                // The data's ids were checked against the table when it was opened.
                return Err(RuntimeError::plan(format!(
                    "sparse_pull of `{var}`: id {id} is not in 0..{rows}"
                )));
            }
            let k = shard_of(&sh, id as usize);
            pos.insert(id, (k, local[k].len()));
            local[k].push(id as usize - sh[k].1);
        }
        let distinct = pos.len();
        let mut asked = Vec::new();
        for (k, l) in local.iter_mut().enumerate() {
            // With no ids at all, ask the first shard for none (to learn the row shape).
            if l.is_empty() && !(distinct == 0 && k == 0) {
                continue;
            }
            let (s, a, b) = sh[k];
            let tag = self.tag();
            let msg = Request::Pull {
                tag,
                var: var.to_string(),
                start: a,
                end: b,
                ids: Some(std::mem::take(l)),
                step,
            };
            self.send(s, var, msg)?;
            asked.push((tag, k));
        }
        let parts = self.collect("sparse_pull", var, step, &sh, &asked)?;
        let dtype = parts.iter().flatten().next().map(Tensor::dtype);
        let pulled = match dtype {
            Some(DType::F64) => in_id_order::<f64>(&parts, ids, &pos),
            _ => in_id_order::<f32>(&parts, ids, &pos),
        };
        let out = pulled.map_err(|e| match e {
            Unpulled::None => {
                let server = asked.first().map_or(0, |&(_, k)| sh[k].0);
                self.malformed(
                    server,
                    "sparse_pull",
                    format!("sparse_pull of `{var}`: no rows came back"),
                )
            }
            Unpulled::Short(k) => self.malformed(
                sh[k].0,
                "sparse_pull",
                format!(
                    "sparse_pull of `{var}`: server {} returned too few rows",
                    sh[k].0
                ),
            ),
            Unpulled::Shape(e) => {
                RuntimeError::internal("parameter servers", format!("sparse_pull of `{var}`: {e}"))
            }
        })?;
        let row_bytes = out.bytes() / ids.len().max(1);
        self.sent += 8 * distinct as u64;
        self.received += (row_bytes * distinct) as u64;
        Ok(out)
    }

    /// Pushes a dense gradient (split by row ranges to the shards' servers).
    pub fn push(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        grad: &Tensor,
        step: u64,
    ) -> Result<()> {
        self.check()?;
        let (sh, rows) = layout("push", var, shards, self.servers)?;
        served_float("push", var, grad)?;
        if grad.shape().is_empty() && sh.len() != 1 {
            return Err(RuntimeError::plan(format!(
                "push of `{var}`: a scalar gradient for several shards"
            )));
        }
        if !grad.shape().is_empty() && grad.shape()[0] != rows {
            return Err(RuntimeError::plan(format!(
                "push of `{var}`: gradient of shape {:?} for a variable of {rows} rows",
                grad.shape()
            )));
        }
        for &(s, a, b) in &sh {
            let part = slice_rows(grad, a, b);
            self.sent += part.bytes() as u64;
            let msg = Request::Push {
                var: var.to_string(),
                start: a,
                end: b,
                step,
                grad: Value::Tensor(part),
            };
            self.send(s, var, msg)?;
        }
        Ok(())
    }

    /// Pushes row-sparse gradients: a worker's duplicate rows are summed (in order of
    /// appearance), each row goes to the server holding it with its index rebased to
    /// the shard (8 bytes per id plus the row's values on the wire). Every shard gets
    /// a message, empty where no row falls in it.
    pub fn sparse_push(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        grad: &Slices,
        step: u64,
    ) -> Result<()> {
        self.check()?;
        let (sh, rows) = layout("sparse_push", var, shards, self.servers)?;
        let vals = &grad.values;
        served_float("sparse_push", var, vals)?;
        let ds = &grad.dense_shape;
        if ds.is_empty() || ds[0] != rows {
            return Err(RuntimeError::plan(format!(
                "sparse_push of `{var}`: dense shape {ds:?} for a variable of {rows} rows"
            )));
        }
        let rest = &ds[1..];
        let n = grad.indices.len();
        if vals.shape().first() != Some(&n) || vals.shape()[1..] != *rest {
            return Err(RuntimeError::plan(format!(
                "sparse_push of `{var}`: values {:?} do not hold {n} rows of {rest:?}",
                vals.shape()
            )));
        }
        let parts = match vals {
            Tensor::F64(v) => split_by_shard(var, v, &grad.indices, &sh, rows)?,
            Tensor::F32(v) => split_by_shard(var, v, &grad.indices, &sh, rows)?,
            t => {
                return Err(RuntimeError::internal(
                    "parameter servers",
                    format!(
                        "sparse_push of `{var}`: {} values passed as served",
                        t.dtype()
                    ),
                ))
            }
        };
        for ((indices, values), &(s, a, b)) in parts.into_iter().zip(&sh) {
            self.sent += (8 * indices.len() + values.bytes()) as u64;
            let mut dense_shape = vec![b - a];
            dense_shape.extend_from_slice(rest);
            let msg = Request::Push {
                var: var.to_string(),
                start: a,
                end: b,
                step,
                grad: Value::Slices(Slices {
                    indices,
                    values,
                    dense_shape,
                }),
            };
            self.send(s, var, msg)?;
        }
        Ok(())
    }

    /// Cumulative payload bytes this worker sent (ids, gradients) and received
    /// (values).
    pub fn bytes(&self) -> (u64, u64) {
        (self.sent, self.received)
    }

    /// Tells every server this worker has finished. With `collect`, waits until every
    /// worker has and returns the servers' shards `(var, start, rows)`.
    pub fn shutdown(&mut self, collect: bool) -> Result<Vec<(String, usize, Tensor)>> {
        self.check()?;
        let mut asked: HashMap<u64, usize> = HashMap::new();
        for s in 0..self.servers {
            let tag = self.tag();
            self.send(s, "", Request::Shutdown { tag, collect })?;
            asked.insert(tag, s);
        }
        if !collect {
            // Every request delivered before this worker ends.
            let r = self.link()?.flush();
            return r.map(|()| Vec::new()).map_err(|e| self.fail(e));
        }
        self.collect_shards(asked, "shutdown")
    }

    /// Every server's shards and optimizer slots once `step` is applied (see
    /// [`Request::Snapshot`]).
    pub fn snapshot(&mut self, step: u64) -> Result<Vec<(String, usize, Tensor)>> {
        self.check()?;
        let mut asked: HashMap<u64, usize> = HashMap::new();
        for s in 0..self.servers {
            let tag = self.tag();
            self.send(s, "", Request::Snapshot { tag, step })?;
            asked.insert(tag, s);
        }
        self.collect_shards(asked, "training state")
    }

    /// Waits for the [`Reply::Shards`] of the requests `asked` (tag -> server).
    fn collect_shards(
        &mut self,
        mut asked: HashMap<u64, usize>,
        what: &str,
    ) -> Result<Vec<(String, usize, Tensor)>> {
        let mut out = Vec::new();
        let mut deadline = Instant::now() + self.timeout + grace(self.timeout);
        while !asked.is_empty() {
            let bytes = match recv_until(&mut **self.link()?, &mut deadline)? {
                Some(b) => b,
                None => {
                    let mut silent: Vec<usize> = asked.values().copied().collect();
                    silent.sort_unstable();
                    return Err(RuntimeError::Peer {
                        rank: self.rank,
                        peer: self.server_rank(silent[0]),
                        op: what.to_string(),
                        kind: PeerKind::TimedOut,
                        message: format!(
                            "{what}: parameter server(s) {silent:?} did not return their \
                             shards within {:.0} s (--timeout)",
                            self.timeout.as_secs_f64()
                        ),
                    });
                }
            };
            let reply = match Reply::decode(&bytes) {
                Ok(r) => r,
                // The reply names no sender: one of the servers still to answer.
                Err(e) => {
                    let server = asked.values().copied().min().unwrap_or(0);
                    return Err(self.malformed(server, what, e));
                }
            };
            match reply {
                Reply::Shards { tag, result } => {
                    if let Some(server) = asked.remove(&tag) {
                        out.extend(result.map_err(|e| self.server_failed(server, what, e))?);
                    }
                }
                Reply::Failed { tag, error } => {
                    if let Some(server) = asked.remove(&tag) {
                        return Err(self.server_failed(server, what, error));
                    }
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// Tells every server this worker failed with `reason`, so servers answer the other
    /// workers' waiting pulls with it instead of waiting for this worker's pushes.
    /// Best effort: a server that has gone is skipped.
    pub fn abort(&mut self, reason: &str) {
        for s in 0..self.servers {
            let msg = Request::Abort {
                reason: reason.to_string(),
            };
            if let Ok(link) = self.link() {
                let _ = link.send(s, msg.encode());
            }
        }
    }
}
