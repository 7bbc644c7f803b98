//! Parameter servers: processes or threads that own row-range shards of variables, apply the
//! optimizer to them, and serve workers' pulls and pushes over a transport.
//!
//! * [`start`] launches one thread per server; each shard starts as rows
//!   `start..end` of [`crate::core::init::init_param`] of the whole variable, so a partitioned variable
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

mod client;
mod server;
pub mod transport;
pub mod wire;

pub use client::PsClient;
pub use server::{serve, Server, ServerOutcome};

use crate::core::config::OptimizerSpec;
use crate::core::error::{Result, RuntimeError};
use crate::core::value::HostElem;
use crate::core::value::Tensor;
use distc_ir::{DType, Init, TensorType};
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use transport::{in_process_links, InProcessWorkerLink};
use wire::Request;

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

impl std::fmt::Display for PsSync {
    /// As the user types it: `sync`, `async`, `stale:2`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PsSync::Sync => f.write_str("sync"),
            PsSync::Async => f.write_str("async"),
            PsSync::Stale(k) => write!(f, "stale:{k}"),
        }
    }
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
    /// Its learning-rate schedule, over a run of `total_steps` updates.
    pub lr_schedule: crate::core::config::LrSchedule,
    /// The run's steps (the schedule's length).
    pub total_steps: u64,
    /// Variables the weight decay skips.
    pub no_decay: Vec<String>,
    /// Row-sparse gradients update only their rows (`RunConfig::lazy_updates`).
    pub lazy_updates: bool,
    /// Run seed for [`crate::core::init::init_param`].
    pub seed: u64,
    /// A resumed run's state: shards start from its rows and optimizer slots, at its
    /// step, instead of the initialisers.
    pub resume: Option<std::sync::Arc<crate::core::checkpoint::TrainingState>>,
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
    /// When it started.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}

/// A variable's shards as a client names them: `(server, start, end)`.
type ShardList = Vec<(usize, usize, usize)>;

/// Per variable, while checking specs: its type, init and row ranges.
type VarShards = HashMap<String, (TensorType, Init, Vec<(usize, usize)>)>;

/// Rows of a variable of dimensions `dims` (a scalar is one row).
fn rows_of(dims: &[usize]) -> usize {
    dims.first().copied().unwrap_or(1)
}

/// Concatenates shards along rows (a single part is returned as is).
fn concat_rows(var: &str, mut parts: Vec<Tensor>) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    let parts: Vec<&Tensor> = parts.iter().collect();
    Tensor::concat(&parts, 0).map_err(|e| {
        RuntimeError::plan(format!("variable `{var}`: shards do not fit together: {e}"))
    })
}

/// Rows `ids` of `w` (shard-local; each below `end - start`), in their order.
pub(crate) fn gather_rows<T: HostElem>(
    w: &ArrayD<T>,
    ids: &[usize],
    start: usize,
    end: usize,
) -> std::result::Result<Tensor, String> {
    let shape = w.shape();
    if shape.is_empty() {
        return Err("sparse pull of a scalar".into());
    }
    let row: usize = shape[1..].iter().product();
    let ws = w.as_slice().ok_or("non-contiguous shard")?;
    let mut data = Vec::with_capacity(ids.len() * row);
    for &i in ids {
        if i >= end - start {
            return Err(format!(
                "id {} is not in {start}..{end}",
                i.saturating_add(start)
            ));
        }
        data.extend_from_slice(&ws[i * row..(i + 1) * row]);
    }
    let mut out = vec![ids.len()];
    out.extend_from_slice(&shape[1..]);
    ArrayD::from_shape_vec(IxDyn(&out), data)
        .map(T::tensor)
        .map_err(|e| e.to_string())
}

/// Checks every server's shards (`shards[s]` = what server `s` owns): one type per
/// variable, f32, covering its rows exactly once. Returns every variable's full type.
pub fn check_shards(shards: &[Vec<ShardSpec>]) -> Result<HashMap<String, TensorType>> {
    let mut vars: VarShards = HashMap::new();
    for (s, list) in shards.iter().enumerate() {
        for sp in list {
            let at = || {
                format!(
                    "parameter server {s}: variable `{}` rows {}..{}",
                    sp.var, sp.start, sp.end
                )
            };
            // The servers' programs against one another.
            let err = |m: String| RuntimeError::plan(format!("{}: {m}", at()));
            // The model's precision against what servers hold: a setting.
            let unserved = |m: String| RuntimeError::Config(format!("{}: {m}", at()));
            match sp.full.dtype {
                DType::F32 | DType::F64 => {}
                DType::I32 => return Err(unserved("i32 variables are not served".into())),
                d @ (DType::BF16 | DType::F16) => {
                    return Err(unserved(format!(
                        "{d} variables are not served (masters are f32)"
                    )))
                }
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
                let (lo, hi, what) = if a > at {
                    (at, a, "on no server")
                } else {
                    (a, at, "on two shards")
                };
                return Err(RuntimeError::plan(format!(
                    "parameter servers: variable `{var}`: rows {lo}..{hi} are {what}"
                )));
            }
            at = b;
        }
        let rows = rows_of(full.dims());
        if at != rows {
            return Err(RuntimeError::plan(format!(
                "parameter servers: variable `{var}`: rows {at}..{rows} are on no server"
            )));
        }
    }
    Ok(vars.into_iter().map(|(k, v)| (k, v.0)).collect())
}

/// Reassembles whole variables from `(var, start, rows)` shards, checking each
/// against its full type when known.
pub fn assemble(
    parts: Vec<(String, usize, Tensor)>,
    types: &HashMap<String, TensorType>,
) -> Result<HashMap<String, Tensor>> {
    let mut by_var: HashMap<String, Vec<(usize, Tensor)>> = HashMap::new();
    for (var, start, t) in parts {
        by_var.entry(var).or_default().push((start, t));
    }
    let mut out = HashMap::new();
    for (var, mut ps) in by_var {
        ps.sort_by_key(|p| p.0);
        let t = concat_rows(&var, ps.into_iter().map(|p| p.1).collect())?;
        if let Some(ty) = types.get(&var) {
            if t.shape() != ty.dims() {
                return Err(RuntimeError::plan(format!(
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

/// Parameter servers running as threads of this process, over in-process links.
pub struct PsCluster {
    links: Vec<Option<InProcessWorkerLink>>,
    /// One link kept to stop the servers on behalf of every worker.
    control: InProcessWorkerLink,
    handles: Vec<JoinHandle<Result<ServerOutcome>>>,
    workers: usize,
    timeout: Duration,
    /// The servers' own timeout (nanoseconds, 0: none), read by their links.
    server_timeout: Arc<AtomicU64>,
    vars: HashMap<String, TensorType>,
}

/// The default bound on any wait for a server's answer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Starts one thread per server (`shards[s]` = the shards server `s` owns).
pub fn start(shards: Vec<Vec<ShardSpec>>, cfg: PsConfig) -> Result<PsCluster> {
    start_traced(shards, cfg, false)
}

/// [`start`], with servers recording a [`ServerSpan`] per message when `trace`.
pub fn start_traced(shards: Vec<Vec<ShardSpec>>, cfg: PsConfig, trace: bool) -> Result<PsCluster> {
    if cfg.workers == 0 {
        return Err(RuntimeError::plan("parameter servers without workers"));
    }
    let vars = check_shards(&shards)?;
    // One extra worker link, never handed out, to stop the servers.
    let (mut links, server_links) = in_process_links(cfg.workers + 1, shards.len());
    let control = links
        .pop()
        .ok_or_else(|| RuntimeError::internal("parameter servers", "no control link"))?;
    let mut handles = Vec::new();
    let server_timeout = Arc::new(AtomicU64::new(0));
    for (id, (list, mut link)) in shards.iter().zip(server_links).enumerate() {
        link.timeout_ns = server_timeout.clone();
        let mut server = Server::new(id, list, &cfg)?;
        server.set_tracing(trace);
        let h = std::thread::Builder::new()
            .name(format!("ps-{id}"))
            .spawn(move || serve(server, &mut link))
            // The machine refused a thread.
            .map_err(|e| RuntimeError::no_thread(format!("parameter server {id}"), e))?;
        handles.push(h);
    }
    Ok(PsCluster {
        links: links.into_iter().map(Some).collect(),
        control,
        handles,
        workers: cfg.workers,
        timeout: DEFAULT_TIMEOUT,
        server_timeout,
        vars,
    })
}

/// What stopped servers hand back.
#[derive(Debug, Default)]
pub struct ClusterOutcome {
    /// Every server-held variable, whole.
    pub params: HashMap<String, Tensor>,
    /// Every server's spans, by server then time.
    pub spans: Vec<ServerSpan>,
    /// Time each server spent handling messages.
    pub busy: Vec<Duration>,
}

impl PsCluster {
    /// Bounds every wait of the clients handed out from now on, and every wait of the
    /// servers on a worker (which then name the worker a late pull waits for).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.server_timeout.store(ns, Ordering::Relaxed);
    }

    /// The client of worker `rank` (once per rank; move it into the worker's thread).
    /// A rank out of `0..workers`, or a second client of one rank, fails every call.
    pub fn client(&mut self, rank: usize) -> PsClient {
        let servers = self.handles.len();
        match self.links.get_mut(rank).and_then(Option::take) {
            Some(link) => PsClient::new(rank, self.workers, servers, Box::new(link), self.timeout),
            None => PsClient::invalid(rank, self.workers, servers),
        }
    }

    /// Number of servers.
    pub fn servers(&self) -> usize {
        self.handles.len()
    }

    /// Stops the servers once every pending push is applied (on behalf of workers that
    /// did not shut down themselves) and returns every variable reassembled from its
    /// shards. Fails with the first server error, or if a `Sync` step was pushed by
    /// only some of the workers.
    pub fn shutdown(mut self) -> Result<HashMap<String, Tensor>> {
        Ok(self.stop()?.params)
    }

    /// [`PsCluster::shutdown`], with the servers' spans and busy times.
    pub fn stop(&mut self) -> Result<ClusterOutcome> {
        // Clients not handed out never send their shutdown.
        self.links.clear();
        for rank in 0..self.workers {
            for s in 0..self.handles.len() {
                let msg = Request::Shutdown {
                    tag: 0,
                    collect: false,
                };
                let _ = self.control.send_as(rank, s, msg.encode());
            }
        }
        let mut parts = Vec::new();
        let mut out = ClusterOutcome::default();
        let mut first_error = None;
        for (id, h) in std::mem::take(&mut self.handles).into_iter().enumerate() {
            let o = h.join().map_err(|_| {
                RuntimeError::internal(
                    format!("parameter server {id}"),
                    format!("parameter server {id} panicked"),
                )
            })??;
            if let Some(e) = o.error {
                first_error.get_or_insert(e);
            }
            parts.extend(o.shards);
            out.spans.extend(o.spans);
            out.busy.push(o.busy);
        }
        // A server's own failure (a push that does not fit its shard, a step some
        // workers did not push): a worker's failure, the cause of any other, is the
        // workers' to report.
        if let Some(e) = first_error {
            return Err(RuntimeError::Plan(e));
        }
        out.spans.sort_by_key(|s| (s.server, s.start));
        out.params = assemble(parts, &self.vars)?;
        Ok(out)
    }
}

impl Drop for PsCluster {
    fn drop(&mut self) {
        if !self.handles.is_empty() {
            let _ = self.stop();
        }
    }
}
