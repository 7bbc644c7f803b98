//! Parameter servers: threads that own row-range shards of variables, apply the
//! optimizer to them, and serve workers' pulls and pushes over in-process channels.
//!
//! * [`start`] launches one thread per server; each shard starts as rows
//!   `start..end` of [`init_param`] of the whole variable, so a partitioned variable
//!   starts exactly as the one-device variable would.
//! * Workers talk to the servers through a [`PsClient`] (one per worker rank).
//!   Dense pulls/pushes are split by row ranges; sparse pulls send each server only
//!   the distinct ids in its range (8 bytes per id on the wire) and get each distinct
//!   row once; sparse pushes sum a worker's duplicate rows (in order of appearance),
//!   rebase each row to its shard and send it to the server holding it (8 bytes per
//!   id plus the row's values). Every push reaches every shard of the variable (an
//!   empty one where no row falls in the shard) so servers can count who pushed.
//! * Each shard has its own [`Optimizer`], so Adam's step count `t` advances once per
//!   applied step of that shard, as the single-device optimizer's does once per step.
//!
//! Synchronisation ([`PsSync`]), with workers numbering steps 1, 2, 3, ... and a
//! worker's pull for step `t` issued before its pushes of step `t`:
//!
//! * `Sync`: a shard collects step `t`'s pushes from all workers, combines them in
//!   rank order (dense: summed; sparse: concatenated, the optimizer sums duplicate
//!   rows) and applies them once with scale `1/workers`; a pull for step `t` waits
//!   until step `t-1` has been applied.
//! * `Async`: each push is applied on arrival with scale `1/workers` (and counts as a
//!   step for Adam's bias correction); pulls never wait.
//! * `Stale(K)`: applied on arrival like `Async`; a pull for step `t` waits until every
//!   worker has pushed its step `t-K-1` gradient of that variable (SSP: nobody reads
//!   more than `K` steps ahead of the slowest worker's applied updates).
//!
//! A server handles one message at a time, so a pull never sees a half-applied
//! update. A server that fails (a bad push, an optimizer error) records the error,
//! answers every later request with it, and each client's next call returns it.

mod server;

use crate::config::OptimizerSpec;
use crate::error::{Result, RuntimeError};
use crate::init::init_param;
use crate::value::{Slices, Tensor, Value};
use distc_ir::{DType, Init, TensorType};
use ndarray::{ArrayD, Axis, IxDyn, Slice};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// When servers apply pushes and when pulls may proceed (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PsSync {
    /// A step's pushes from all workers are combined, then applied once.
    Sync,
    /// Applied on arrival; pulls never wait.
    Async,
    /// Applied on arrival; no worker reads more than K steps ahead of the slowest.
    Stale(u32),
}

/// One shard: rows `start..end` of variable `var` (whose full type is `full`).
#[derive(Clone, Debug)]
pub struct ShardSpec {
    /// The variable.
    pub var: String,
    /// The whole variable's type (f32).
    pub full: TensorType,
    /// How the whole variable is initialised.
    pub init: Init,
    /// First row (0 for a scalar).
    pub start: usize,
    /// One past the last row (1 for a scalar).
    pub end: usize,
}

/// How the servers run.
#[derive(Clone, Debug)]
pub struct PsConfig {
    /// Number of workers (ranks `0..workers`).
    pub workers: usize,
    /// Synchronisation mode.
    pub sync: PsSync,
    /// The optimizer the servers apply.
    pub optimizer: OptimizerSpec,
    /// Run seed for [`init_param`].
    pub seed: u64,
}

/// A server's answer to a pull: the request's tag and the rows, or an error.
pub(crate) type Reply = Sender<(usize, std::result::Result<Tensor, String>)>;

/// The message set between clients and servers.
pub(crate) enum Msg {
    /// Rows of the shard `(var, start..end)`: all of them (`ids: None`) or the given
    /// shard-local rows, as of `step`.
    Pull {
        var: String,
        start: usize,
        end: usize,
        ids: Option<Vec<usize>>,
        step: u64,
        tag: usize,
        reply: Reply,
    },
    /// A gradient of the shard `(var, start..end)` from worker `rank` for `step`
    /// (dense of the shard's shape, or slices with shard-local indices).
    Push {
        var: String,
        start: usize,
        end: usize,
        rank: usize,
        step: u64,
        grad: Value,
    },
    /// Apply what is pending, answer waiting pulls with an error, and stop.
    Shutdown,
}

/// State shared by the cluster, its servers and the clients.
pub(crate) struct Shared {
    /// Per server: the error it failed with.
    pub(crate) errors: Vec<Mutex<Option<String>>>,
    /// Per server: nanoseconds spent handling messages.
    pub(crate) busy: Vec<AtomicU64>,
    /// Servers record a span per message handled (for traces) while this is set.
    pub(crate) tracing: AtomicBool,
    /// The spans servers recorded, appended when each server stops.
    pub(crate) spans: Mutex<Vec<ServerSpan>>,
}

/// What a server did, when: one message handled (`pull emb`, `push emb`) or one
/// update applied (`apply emb`).
#[derive(Clone, Debug)]
pub struct ServerSpan {
    /// Server id.
    pub server: usize,
    /// What it did and to which variable.
    pub name: String,
    /// The step of the message.
    pub step: u64,
    /// The worker that sent it (none for an apply).
    pub rank: Option<usize>,
    /// When it started and ended.
    pub start: Instant,
    pub end: Instant,
}

impl Shared {
    fn first_error(&self) -> Option<String> {
        self.errors
            .iter()
            .find_map(|e| e.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

/// What a server thread hands back at shutdown: `(var, start, rows)` per shard.
type ShardValues = Vec<(String, usize, Tensor)>;

/// The servers' spans, readable after [`PsCluster::shutdown`].
pub struct ServerTrace(Arc<Shared>);

impl ServerTrace {
    /// Every span recorded, by server then time.
    pub fn spans(&self) -> Vec<ServerSpan> {
        let mut v = self
            .0
            .spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        v.sort_by_key(|s| (s.server, s.start));
        v
    }
}

/// A variable's shards as a client names them: `(server, start, end)`.
type ShardList = Vec<(usize, usize, usize)>;

/// Per variable, while checking specs: its type, init and row ranges.
type VarShards = HashMap<String, (TensorType, Init, Vec<(usize, usize)>)>;

/// Running parameter servers.
pub struct PsCluster {
    senders: Vec<Sender<Msg>>,
    handles: Vec<JoinHandle<ShardValues>>,
    shared: Arc<Shared>,
    workers: usize,
    /// Every variable's full type.
    vars: HashMap<String, TensorType>,
}

/// Rows of a variable of dimensions `dims` (a scalar is one row).
fn rows_of(dims: &[usize]) -> usize {
    dims.first().copied().unwrap_or(1)
}

fn cfg_err(m: String) -> RuntimeError {
    RuntimeError::Config(m)
}

/// Rows `start..end` of `t` (the whole tensor for a scalar).
fn slice_rows(t: &Tensor, start: usize, end: usize) -> Tensor {
    if t.shape().is_empty() {
        return t.clone();
    }
    let sl = Slice::from(start..end);
    match t {
        Tensor::F32(a) => Tensor::F32(a.slice_axis(Axis(0), sl).as_standard_layout().into_owned()),
        Tensor::F64(a) => Tensor::F64(a.slice_axis(Axis(0), sl).as_standard_layout().into_owned()),
        Tensor::I32(a) => Tensor::I32(a.slice_axis(Axis(0), sl).as_standard_layout().into_owned()),
    }
}

/// Concatenates f32 parts along rows (a single part is returned as is).
fn concat_rows(var: &str, mut parts: Vec<Tensor>) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    let views: Vec<_> = parts
        .iter()
        .map(|p| match p {
            Tensor::F32(a) => Ok(a.view()),
            _ => Err(cfg_err(format!("variable `{var}`: a shard is not f32"))),
        })
        .collect::<Result<_>>()?;
    ndarray::concatenate(Axis(0), &views)
        .map(Tensor::F32)
        .map_err(|e| cfg_err(format!("variable `{var}`: shards do not fit together: {e}")))
}

/// Starts one thread per server (`shards[s]` = the shards server `s` owns).
pub fn start(shards: Vec<Vec<ShardSpec>>, cfg: PsConfig) -> Result<PsCluster> {
    if cfg.workers == 0 {
        return Err(cfg_err("parameter servers: no workers".into()));
    }
    // Check every variable's shards: one type, f32, covering its rows exactly once.
    let mut vars: VarShards = HashMap::new();
    for (s, list) in shards.iter().enumerate() {
        for sp in list {
            let err = |m: String| {
                cfg_err(format!(
                    "parameter server {s}: variable `{}` rows {}..{}: {m}",
                    sp.var, sp.start, sp.end
                ))
            };
            match sp.full.dtype {
                DType::F32 => {}
                DType::F64 => return Err(err("f64 variables are not served".into())),
                DType::I32 => return Err(err("i32 variables are not served".into())),
            }
            let rows = rows_of(sp.full.dims());
            if sp.start >= sp.end || sp.end > rows {
                return Err(err(format!("not a row range of 0..{rows}")));
            }
            let e = vars
                .entry(sp.var.clone())
                .or_insert_with(|| (sp.full.clone(), sp.init.clone(), Vec::new()));
            if e.0 != sp.full || e.1 != sp.init {
                return Err(err("its type or init differs from another shard's".into()));
            }
            e.2.push((sp.start, sp.end));
        }
    }
    for (var, (full, _, ranges)) in vars.iter_mut() {
        ranges.sort_unstable();
        let mut at = 0;
        for &(a, b) in ranges.iter() {
            if a != at {
                return Err(cfg_err(format!(
                    "parameter servers: variable `{var}`: rows {} are {}",
                    if a > at {
                        format!("{at}..{a}")
                    } else {
                        format!("{a}..{at}")
                    },
                    if a > at {
                        "on no server"
                    } else {
                        "on two shards"
                    }
                )));
            }
            at = b;
        }
        let rows = rows_of(full.dims());
        if at != rows {
            return Err(cfg_err(format!(
                "parameter servers: variable `{var}`: rows {at}..{rows} are on no server"
            )));
        }
    }
    // Initial values: each variable once, then sliced into its shards.
    let mut inits: HashMap<String, Tensor> = HashMap::new();
    for (var, (full, init, _)) in &vars {
        inits.insert(var.clone(), init_param(var, full, init, cfg.seed));
    }
    let shared = Arc::new(Shared {
        errors: shards.iter().map(|_| Mutex::new(None)).collect(),
        busy: shards.iter().map(|_| AtomicU64::new(0)).collect(),
        tracing: AtomicBool::new(false),
        spans: Mutex::new(Vec::new()),
    });
    let mut senders = Vec::new();
    let mut handles = Vec::new();
    for (id, list) in shards.into_iter().enumerate() {
        let mut owned = Vec::new();
        for sp in list {
            let value = slice_rows(&inits[&sp.var], sp.start, sp.end);
            owned.push(server::Shard::new(sp.var, sp.start, sp.end, value, &cfg));
        }
        let (tx, rx): (Sender<Msg>, Receiver<Msg>) = mpsc::channel();
        let srv = server::Server::new(id, cfg.sync, cfg.workers, owned, shared.clone());
        let h = std::thread::Builder::new()
            .name(format!("ps-{id}"))
            .spawn(move || srv.run(rx))
            .map_err(|e| cfg_err(format!("parameter server {id}: cannot start: {e}")))?;
        senders.push(tx);
        handles.push(h);
    }
    Ok(PsCluster {
        senders,
        handles,
        shared,
        workers: cfg.workers,
        vars: vars.into_iter().map(|(k, v)| (k, v.0)).collect(),
    })
}

impl PsCluster {
    /// A client for worker `rank` (call once per worker, move it into the worker's
    /// thread). A rank out of `0..workers` makes every call of the client fail.
    pub fn client(&self, rank: usize) -> PsClient {
        PsClient {
            rank,
            workers: self.workers,
            senders: self.senders.clone(),
            shared: self.shared.clone(),
            sent: 0,
            received: 0,
        }
    }

    /// Number of servers.
    pub fn servers(&self) -> usize {
        self.senders.len()
    }

    /// Stops the servers and returns every variable reassembled from its shards
    /// (full tensors by name), after all pushes sent before this call are applied.
    /// Fails with the first server error, or if a `Sync` step was pushed by only
    /// some of the workers.
    pub fn shutdown(mut self) -> Result<HashMap<String, Tensor>> {
        for tx in &self.senders {
            let _ = tx.send(Msg::Shutdown);
        }
        let handles = std::mem::take(&mut self.handles);
        let mut parts: HashMap<String, Vec<(usize, Tensor)>> = HashMap::new();
        for (id, h) in handles.into_iter().enumerate() {
            let vals = h
                .join()
                .map_err(|_| cfg_err(format!("parameter server {id} panicked")))?;
            for (var, start, t) in vals {
                parts.entry(var).or_default().push((start, t));
            }
        }
        if let Some(e) = self.shared.first_error() {
            return Err(cfg_err(e));
        }
        let mut out = HashMap::new();
        for (var, mut ps) in parts {
            ps.sort_by_key(|p| p.0);
            let t = concat_rows(&var, ps.into_iter().map(|p| p.1).collect())?;
            if let Some(ty) = self.vars.get(&var) {
                if t.shape() != ty.dims() {
                    return Err(cfg_err(format!(
                        "variable `{var}`: reassembled shape {:?}, expected {:?}",
                        t.shape(),
                        ty.dims()
                    )));
                }
            }
            out.insert(var, t);
        }
        Ok(out)
    }

    /// Makes the servers record a [`ServerSpan`] per message from now on; the spans
    /// come back from [`ServerTrace::spans`] once the cluster has shut down.
    pub fn trace(&self) -> ServerTrace {
        self.shared.tracing.store(true, Ordering::Relaxed);
        ServerTrace(self.shared.clone())
    }

    /// Server-side time spent applying updates and serving, per server.
    pub fn server_busy(&self) -> Vec<Duration> {
        self.shared
            .busy
            .iter()
            .map(|b| Duration::from_nanos(b.load(Ordering::Relaxed)))
            .collect()
    }
}

impl Drop for PsCluster {
    fn drop(&mut self) {
        if self.handles.is_empty() {
            return;
        }
        for tx in &self.senders {
            let _ = tx.send(Msg::Shutdown);
        }
        for h in std::mem::take(&mut self.handles) {
            let _ = h.join();
        }
    }
}

/// A worker's handle on the servers.
pub struct PsClient {
    rank: usize,
    workers: usize,
    senders: Vec<Sender<Msg>>,
    shared: Arc<Shared>,
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
        return Err(cfg_err(format!("{op} of `{var}`: no shards given")));
    }
    let mut at = 0;
    for &(s, a, b) in &sh {
        if s >= servers {
            return Err(cfg_err(format!(
                "{op} of `{var}`: server {s} does not exist ({servers} servers)"
            )));
        }
        if a != at || b <= a {
            return Err(cfg_err(format!(
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

fn f32_of<'a>(op: &str, var: &str, t: &'a Tensor) -> Result<&'a ArrayD<f32>> {
    t.as_f32().ok_or_else(|| {
        cfg_err(format!(
            "{op} of `{var}`: a {} gradient (the servers hold f32)",
            t.dtype()
        ))
    })
}

impl PsClient {
    /// This client's worker rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Fails if this client's rank is invalid or a server has failed.
    fn check(&self) -> Result<()> {
        if self.rank >= self.workers {
            return Err(cfg_err(format!(
                "parameter-server client of rank {} (there are {} workers)",
                self.rank, self.workers
            )));
        }
        match self.shared.first_error() {
            Some(e) => Err(cfg_err(e)),
            None => Ok(()),
        }
    }

    fn send(&self, server: usize, var: &str, msg: Msg) -> Result<()> {
        self.senders[server].send(msg).map_err(|_| {
            cfg_err(format!(
                "parameter server {server} (variable `{var}`) has stopped"
            ))
        })
    }

    /// Waits for `n` replies on `rx`; returns them by tag.
    fn collect(
        &self,
        var: &str,
        rx: &Receiver<(usize, std::result::Result<Tensor, String>)>,
        slots: usize,
        n: usize,
    ) -> Result<Vec<Option<Tensor>>> {
        let mut parts: Vec<Option<Tensor>> = vec![None; slots];
        for _ in 0..n {
            let (tag, r) = rx.recv().map_err(|_| {
                cfg_err(format!(
                    "pull of `{var}`: a parameter server stopped without answering"
                ))
            })?;
            let t = r.map_err(cfg_err)?;
            if let Some(p) = parts.get_mut(tag) {
                *p = Some(t);
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
        let (sh, _) = layout("pull", var, shards, self.senders.len())?;
        let (tx, rx) = mpsc::channel();
        for (tag, &(s, a, b)) in sh.iter().enumerate() {
            let msg = Msg::Pull {
                var: var.to_string(),
                start: a,
                end: b,
                ids: None,
                step,
                tag,
                reply: tx.clone(),
            };
            self.send(s, var, msg)?;
        }
        drop(tx);
        let parts = self.collect(var, &rx, sh.len(), sh.len())?;
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
        let (sh, rows) = layout("sparse_pull", var, shards, self.senders.len())?;
        // Distinct ids, each placed at (shard, position in that shard's request).
        let mut pos: HashMap<i32, (usize, usize)> = HashMap::with_capacity(ids.len());
        let mut local: Vec<Vec<usize>> = vec![Vec::new(); sh.len()];
        for &id in ids {
            if pos.contains_key(&id) {
                continue;
            }
            if id < 0 || id as usize >= rows {
                return Err(cfg_err(format!(
                    "sparse_pull of `{var}`: id {id} is not in 0..{rows}"
                )));
            }
            let k = shard_of(&sh, id as usize);
            pos.insert(id, (k, local[k].len()));
            local[k].push(id as usize - sh[k].1);
        }
        let distinct = pos.len();
        let (tx, rx) = mpsc::channel();
        let mut asked = 0;
        for (k, l) in local.iter_mut().enumerate() {
            // With no ids at all, ask the first shard for none (to learn the row shape).
            if l.is_empty() && !(distinct == 0 && k == 0) {
                continue;
            }
            let (s, a, b) = sh[k];
            let msg = Msg::Pull {
                var: var.to_string(),
                start: a,
                end: b,
                ids: Some(std::mem::take(l)),
                step,
                tag: k,
                reply: tx.clone(),
            };
            self.send(s, var, msg)?;
            asked += 1;
        }
        drop(tx);
        let parts = self.collect(var, &rx, sh.len(), asked)?;
        let arrays: Vec<Option<&ArrayD<f32>>> = parts
            .iter()
            .map(|p| p.as_ref().and_then(|t| t.as_f32()))
            .collect();
        let Some(first) = arrays.iter().flatten().next() else {
            return Err(cfg_err(format!(
                "sparse_pull of `{var}`: no rows came back"
            )));
        };
        let rest: Vec<usize> = first.shape()[1..].to_vec();
        let row: usize = rest.iter().product();
        let mut data: Vec<f32> = Vec::with_capacity(ids.len() * row);
        for id in ids {
            let (k, p) = pos[id];
            let src = arrays[k]
                .and_then(|a| a.as_slice())
                .and_then(|s| s.get(p * row..(p + 1) * row))
                .ok_or_else(|| {
                    cfg_err(format!(
                        "sparse_pull of `{var}`: server {} returned too few rows",
                        sh[k].0
                    ))
                })?;
            data.extend_from_slice(src);
        }
        let mut shape = vec![ids.len()];
        shape.extend_from_slice(&rest);
        let out = ArrayD::from_shape_vec(IxDyn(&shape), data)
            .map_err(|e| cfg_err(format!("sparse_pull of `{var}`: {e}")))?;
        self.sent += 8 * distinct as u64;
        self.received += (4 * row * distinct) as u64;
        Ok(Tensor::F32(out))
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
        let (sh, rows) = layout("push", var, shards, self.senders.len())?;
        f32_of("push", var, grad)?;
        if grad.shape().is_empty() && sh.len() != 1 {
            return Err(cfg_err(format!(
                "push of `{var}`: a scalar gradient for several shards"
            )));
        }
        if !grad.shape().is_empty() && grad.shape()[0] != rows {
            return Err(cfg_err(format!(
                "push of `{var}`: gradient of shape {:?} for a variable of {rows} rows",
                grad.shape()
            )));
        }
        for &(s, a, b) in &sh {
            let part = slice_rows(grad, a, b);
            self.sent += part.bytes() as u64;
            let msg = Msg::Push {
                var: var.to_string(),
                start: a,
                end: b,
                rank: self.rank,
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
        let (sh, rows) = layout("sparse_push", var, shards, self.senders.len())?;
        let vals = f32_of("sparse_push", var, &grad.values)?;
        let ds = &grad.dense_shape;
        if ds.is_empty() || ds[0] != rows {
            return Err(cfg_err(format!(
                "sparse_push of `{var}`: dense shape {ds:?} for a variable of {rows} rows"
            )));
        }
        let rest = &ds[1..];
        let row: usize = rest.iter().product();
        let n = grad.indices.len();
        if vals.shape().first() != Some(&n) || vals.shape()[1..] != *rest {
            return Err(cfg_err(format!(
                "sparse_push of `{var}`: values {:?} do not hold {n} rows of {rest:?}",
                vals.shape()
            )));
        }
        let vals = vals.as_standard_layout();
        let vs = vals
            .as_slice()
            .ok_or_else(|| cfg_err(format!("sparse_push of `{var}`: non-contiguous values")))?;
        let mut pos: HashMap<i32, (usize, usize)> = HashMap::with_capacity(n);
        let mut idx: Vec<Vec<i32>> = vec![Vec::new(); sh.len()];
        let mut data: Vec<Vec<f32>> = vec![Vec::new(); sh.len()];
        for (r, &id) in grad.indices.iter().enumerate() {
            let src = &vs[r * row..(r + 1) * row];
            if let Some(&(k, p)) = pos.get(&id) {
                for (d, s) in data[k][p * row..(p + 1) * row].iter_mut().zip(src) {
                    *d += s;
                }
                continue;
            }
            if id < 0 || id as usize >= rows {
                return Err(cfg_err(format!(
                    "sparse_push of `{var}`: id {id} is not in 0..{rows}"
                )));
            }
            let k = shard_of(&sh, id as usize);
            pos.insert(id, (k, idx[k].len()));
            idx[k].push((id as usize - sh[k].1) as i32);
            data[k].extend_from_slice(src);
        }
        for (k, &(s, a, b)) in sh.iter().enumerate() {
            let indices = std::mem::take(&mut idx[k]);
            let mut shape = vec![indices.len()];
            shape.extend_from_slice(rest);
            let values = ArrayD::from_shape_vec(IxDyn(&shape), std::mem::take(&mut data[k]))
                .map_err(|e| cfg_err(format!("sparse_push of `{var}`: {e}")))?;
            self.sent += (indices.len() * (8 + 4 * row)) as u64;
            let mut dense_shape = vec![b - a];
            dense_shape.extend_from_slice(rest);
            let msg = Msg::Push {
                var: var.to_string(),
                start: a,
                end: b,
                rank: self.rank,
                step,
                grad: Value::Slices(Slices {
                    indices,
                    values: Tensor::F32(values),
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
}
