//! One parameter server: owns shards, applies pushes with one [`Optimizer`] per
//! shard, answers pulls when the sync mode allows. [`Server::handle`] takes one
//! request and returns the replies it releases, addressed by worker rank; it knows
//! nothing of how messages travel. [`serve`] runs it over a [`ServerLink`].

use super::transport::ServerLink;
use super::wire::{Reply, Request};
use super::{PsConfig, PsSync, ServerSpan, ShardSpec};
use crate::core::checkpoint::TrainingState;
use crate::core::error::{Result, RuntimeError};
use crate::core::init::{init_param, init_rows};
use crate::core::value::{Slices, Tensor, Value};
use crate::cpu::optim::{Optimizer, STEP_KEY};
use ndarray::{ArrayD, Axis, IxDyn, Slice};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// Rows `start..end` of variable `var` with its optimizer and sync state.
struct Shard {
    var: String,
    start: usize,
    end: usize,
    value: Tensor,
    opt: Optimizer,
    /// Steps applied (`Sync`: the variable is at version `applied`).
    applied: u64,
    /// Per worker: the latest step it pushed.
    last: Vec<u64>,
    /// `Sync`: pushes of steps not yet applied, per step, per worker.
    pending: BTreeMap<u64, Vec<Vec<Value>>>,
}

/// Rows `start..end` of `t` (the whole tensor for a scalar).
pub(crate) fn slice_rows(t: &Tensor, start: usize, end: usize) -> Tensor {
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

/// Shard `sp` of a resumed state: its rows of the variable and of each slot.
fn resumed_shard(sp: &ShardSpec, state: &TrainingState, cfg: &PsConfig) -> Result<Shard> {
    let whole = state.params.get(&sp.var).ok_or_else(|| {
        RuntimeError::Config(format!(
            "the training state has no variable `{}` (it holds {})",
            sp.var,
            state.index.variables.join(", ")
        ))
    })?;
    if whole.shape() != sp.full.dims() || whole.dtype() != sp.full.dtype {
        return Err(RuntimeError::Config(format!(
            "the training state's `{}` is {}; the model's is {}",
            sp.var,
            whole.tensor_type(),
            sp.full
        )));
    }
    let mut shard = Shard::new(
        sp.var.clone(),
        sp.start,
        sp.end,
        slice_rows(whole, sp.start, sp.end),
        cfg,
    );
    let prefix = format!("{}/", sp.var);
    let slots: HashMap<String, Tensor> = state
        .optimizer
        .iter()
        .filter(|(k, _)| k.starts_with(&prefix) || k.as_str() == STEP_KEY)
        .map(|(k, t)| {
            (
                k.clone(),
                if k == STEP_KEY {
                    t.clone()
                } else {
                    slice_rows(t, sp.start, sp.end)
                },
            )
        })
        .collect();
    shard.opt.load_state(&slots)?;
    shard.applied = state.index.step;
    Ok(shard)
}

impl Shard {
    fn new(var: String, start: usize, end: usize, value: Tensor, cfg: &PsConfig) -> Shard {
        // A server is one thread, as a server process would be one core's worth; its
        // updates stay on it rather than taking the workers' cores via rayon.
        let mut opt = Optimizer::new(&cfg.optimizer);
        opt.set_parallel(false);
        Shard {
            var,
            start,
            end,
            value,
            opt,
            applied: 0,
            last: vec![0; cfg.workers],
            pending: BTreeMap::new(),
        }
    }

    /// Whether a pull for `step` may be answered now.
    fn ready(&self, sync: PsSync, step: u64) -> bool {
        match sync {
            PsSync::Sync => self.applied + 1 >= step,
            PsSync::Async => true,
            PsSync::Stale(k) => {
                let slowest = self.last.iter().copied().min().unwrap_or(0);
                slowest + u64::from(k) + 1 >= step
            }
        }
    }

    /// The shard's rows (all, or the shard-local `ids`).
    fn rows(&self, ids: Option<&[usize]>) -> std::result::Result<Tensor, String> {
        let Some(ids) = ids else {
            return Ok(self.value.clone());
        };
        let Tensor::F32(w) = &self.value else {
            return Err("the shard is not f32".into());
        };
        let n = self.end - self.start;
        let shape = w.shape();
        if shape.is_empty() {
            return Err("sparse pull of a scalar".into());
        }
        let row: usize = shape[1..].iter().product();
        let ws = w.as_slice().ok_or("non-contiguous shard")?;
        let mut data = Vec::with_capacity(ids.len() * row);
        for &i in ids {
            if i >= n {
                return Err(format!(
                    "id {} is not in {}..{}",
                    i.saturating_add(self.start),
                    self.start,
                    self.end
                ));
            }
            data.extend_from_slice(&ws[i * row..(i + 1) * row]);
        }
        let mut out = vec![ids.len()];
        out.extend_from_slice(&shape[1..]);
        ArrayD::from_shape_vec(IxDyn(&out), data)
            .map(Tensor::F32)
            .map_err(|e| e.to_string())
    }

    /// Applies one (combined) gradient with scale `1/workers` and ends the step.
    fn apply(&mut self, grad: &Value, workers: usize) -> std::result::Result<(), String> {
        let empty = matches!(grad, Value::Slices(s) if s.indices.is_empty());
        if !empty {
            self.opt
                .apply(&self.var, &mut self.value, grad, 1.0 / workers as f64)
                .map_err(|e| e.to_string())?;
        }
        self.opt.end_step();
        self.applied += 1;
        Ok(())
    }
}

/// Combines one step's pushes (in rank order): dense ones summed, sparse ones
/// concatenated.
fn combine(pushes: Vec<Vec<Value>>) -> std::result::Result<Value, String> {
    let all: Vec<Value> = pushes.into_iter().flatten().collect();
    let mut it = all.into_iter();
    let Some(first) = it.next() else {
        return Err("no pushes".into());
    };
    let differ = || "the workers' gradients of one step differ in kind or shape".to_string();
    match first {
        Value::Tensor(Tensor::F32(mut acc)) => {
            for v in it {
                match v {
                    Value::Tensor(Tensor::F32(g)) if g.shape() == acc.shape() => acc += &g,
                    _ => return Err(differ()),
                }
            }
            Ok(Value::Tensor(Tensor::F32(acc)))
        }
        Value::Slices(s0) => {
            let mut ss = vec![s0];
            for v in it {
                match v {
                    Value::Slices(s) if s.dense_shape == ss[0].dense_shape => ss.push(s),
                    _ => return Err(differ()),
                }
            }
            if ss.len() == 1 {
                return Ok(Value::Slices(ss.remove(0)));
            }
            let mut indices = Vec::new();
            let mut views = Vec::new();
            for s in &ss {
                indices.extend_from_slice(&s.indices);
                views.push(
                    s.values
                        .as_f32()
                        .ok_or("an f64 or i32 sparse gradient")?
                        .view(),
                );
            }
            let values = ndarray::concatenate(Axis(0), &views).map_err(|e| e.to_string())?;
            Ok(Value::Slices(Slices {
                indices,
                values: Tensor::F32(values),
                dense_shape: ss[0].dense_shape.clone(),
            }))
        }
        Value::Tensor(t) => Err(format!("a {} gradient (the servers hold f32)", t.dtype())),
    }
}

/// A pull waiting for its step.
struct Waiting {
    from: usize,
    key: (String, usize),
    ids: Option<Vec<usize>>,
    step: u64,
    tag: u64,
}

/// One parameter server's state.
pub struct Server {
    id: usize,
    sync: PsSync,
    workers: usize,
    shards: HashMap<(String, usize), Shard>,
    waiting: Vec<Waiting>,
    failed: Option<String>,
    /// Per worker: it has sent `Shutdown` or `Abort`.
    finished: Vec<bool>,
    /// Workers that asked for the shards at shutdown, with their tags.
    collectors: Vec<(usize, u64)>,
    /// Snapshots asked for `(worker, tag, step)`, answered once the step is applied.
    snapshots: Vec<(usize, u64, u64)>,
    /// Record a span per message (for traces).
    tracing: bool,
    spans: Vec<ServerSpan>,
    busy: Duration,
}

/// What a server hands back when it stops.
#[derive(Debug)]
pub struct ServerOutcome {
    /// `(var, start, rows)` per shard.
    pub shards: Vec<(String, usize, Tensor)>,
    /// The error it failed with, if it did.
    pub error: Option<String>,
    /// Spans recorded while tracing.
    pub spans: Vec<ServerSpan>,
    /// Time spent handling messages.
    pub busy: Duration,
}

impl Server {
    /// Server `id` holding `shards`, each initialised as rows `start..end` of the whole
    /// variable's initial value (so a partitioned variable starts as one device's).
    /// A resumed run's shards are rows `start..end` of the state's variables and of
    /// their optimizer slots, at the state's step.
    pub fn new(id: usize, shards: &[ShardSpec], cfg: &PsConfig) -> Result<Server> {
        let mut owned = HashMap::new();
        for sp in shards {
            let mut shard = match &cfg.resume {
                None => {
                    let value = if sp.full.dims().is_empty() {
                        init_param(&sp.var, &sp.full, &sp.init, cfg.seed)
                    } else {
                        init_rows(&sp.var, &sp.full, &sp.init, cfg.seed, sp.start, sp.end)
                    };
                    Shard::new(sp.var.clone(), sp.start, sp.end, value, cfg)
                }
                Some(state) => resumed_shard(sp, state, cfg)?,
            };
            shard.last = vec![shard.applied; cfg.workers];
            owned.insert((sp.var.clone(), sp.start), shard);
        }
        Ok(Server {
            id,
            sync: cfg.sync,
            workers: cfg.workers,
            shards: owned,
            waiting: Vec::new(),
            failed: None,
            finished: vec![false; cfg.workers],
            collectors: Vec::new(),
            snapshots: Vec::new(),
            tracing: false,
            spans: Vec::new(),
            busy: Duration::ZERO,
        })
    }

    /// Records a span per message handled and per update applied from now on.
    pub fn set_tracing(&mut self, on: bool) {
        self.tracing = on;
    }

    /// Whether every worker has finished (the server has nothing more to do).
    pub fn done(&self) -> bool {
        self.finished.iter().all(|&f| f)
    }

    /// Handles one request from worker `from`; returns the replies it releases.
    pub fn handle(&mut self, from: usize, req: Request) -> Vec<(usize, Reply)> {
        let t0 = Instant::now();
        let what = match &req {
            _ if !self.tracing => None,
            Request::Pull { var, step, ids, .. } => Some((
                format!("pull {var}{}", if ids.is_some() { " rows" } else { "" }),
                *step,
                None,
            )),
            Request::Push { var, step, .. } => Some((format!("push {var}"), *step, Some(from))),
            Request::Shutdown { .. } | Request::Abort { .. } | Request::Snapshot { .. } => None,
        };
        let mut out = Vec::new();
        if from >= self.workers {
            self.fail(format!(
                "a message from worker {from} (there are {} workers)",
                self.workers
            ));
        } else {
            match req {
                Request::Pull {
                    tag,
                    var,
                    start,
                    end,
                    ids,
                    step,
                } => self.pull(from, tag, var, start, end, ids, step, &mut out),
                Request::Push {
                    var,
                    start,
                    end,
                    step,
                    grad,
                } => {
                    if self.failed.is_none() {
                        if let Err(e) = self.push(&var, start, end, from, step, grad) {
                            let m = format!("{}: {e}", self.name(&var, start, end));
                            self.fail(m);
                        }
                    }
                }
                Request::Shutdown { tag, collect } => {
                    self.finished[from] = true;
                    if collect {
                        self.collectors.push((from, tag));
                    }
                }
                Request::Abort { reason } => {
                    self.finished[from] = true;
                    self.fail(format!("worker {from} failed: {reason}"));
                }
                Request::Snapshot { tag, step } => self.snapshots.push((from, tag, step)),
            }
        }
        self.wake(&mut out);
        if self.done() {
            self.finish(&mut out);
        }
        let end = Instant::now();
        self.busy += end - t0;
        if let Some((name, step, rank)) = what {
            self.record(name, step, rank, t0, end);
        }
        out
    }

    fn record(
        &mut self,
        name: String,
        step: u64,
        rank: Option<usize>,
        start: Instant,
        end: Instant,
    ) {
        if self.tracing {
            self.spans.push(ServerSpan {
                server: self.id,
                name,
                step,
                rank,
                start,
                end,
            });
        }
    }

    fn name(&self, var: &str, start: usize, end: usize) -> String {
        format!(
            "parameter server {}: variable `{var}` rows {start}..{end}",
            self.id
        )
    }

    /// The shard `(var, start..end)`, or why not.
    fn find(&self, var: &str, start: usize, end: usize) -> std::result::Result<&Shard, String> {
        match self.shards.get(&(var.to_string(), start)) {
            Some(s) if s.end == end => Ok(s),
            _ => Err(format!(
                "{}: no such shard on this server",
                self.name(var, start, end)
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn pull(
        &mut self,
        from: usize,
        tag: u64,
        var: String,
        start: usize,
        end: usize,
        ids: Option<Vec<usize>>,
        step: u64,
        out: &mut Vec<(usize, Reply)>,
    ) {
        if let Some(e) = &self.failed {
            out.push((
                from,
                Reply::Failed {
                    tag,
                    error: e.clone(),
                },
            ));
            return;
        }
        match self.find(&var, start, end) {
            Err(e) => out.push((
                from,
                Reply::Rows {
                    tag,
                    result: Err(e),
                },
            )),
            Ok(_) => self.waiting.push(Waiting {
                from,
                key: (var, start),
                ids,
                step,
                tag,
            }),
        }
    }

    fn push(
        &mut self,
        var: &str,
        start: usize,
        end: usize,
        rank: usize,
        step: u64,
        grad: Value,
    ) -> std::result::Result<(), String> {
        self.find(var, start, end)?;
        let (sync, workers) = (self.sync, self.workers);
        let Some(shard) = self.shards.get_mut(&(var.to_string(), start)) else {
            return Err("no such shard on this server".into());
        };
        shard.last[rank] = shard.last[rank].max(step);
        let mut applied = Vec::new();
        let r = match sync {
            PsSync::Async | PsSync::Stale(_) => {
                let t0 = Instant::now();
                let r = shard.apply(&grad, workers);
                applied.push((step, Some(rank), t0, Instant::now()));
                r
            }
            PsSync::Sync => {
                if step <= shard.applied {
                    return Err(format!(
                        "push of step {step} from worker {rank} arrived after step {} was applied",
                        shard.applied
                    ));
                }
                shard
                    .pending
                    .entry(step)
                    .or_insert_with(|| vec![Vec::new(); workers])[rank]
                    .push(grad);
                apply_complete_steps(shard, workers, &mut applied)
            }
        };
        for (step, rank, t0, t1) in applied {
            self.record(format!("apply {var}"), step, rank, t0, t1);
        }
        r
    }

    /// Records a failure (the first one sticks).
    fn fail(&mut self, m: String) {
        if self.failed.is_none() {
            self.failed = Some(m);
        }
    }

    /// Answers the waiting pulls that may proceed now (all of them, with the error,
    /// if the server has failed).
    fn wake(&mut self, out: &mut Vec<(usize, Reply)>) {
        for (from, tag, step) in std::mem::take(&mut self.snapshots) {
            // Once every shard could answer a pull of the next step.
            if self.failed.is_some() || self.shards.values().all(|s| s.ready(self.sync, step + 1)) {
                let result = match &self.failed {
                    Some(e) => Err(e.clone()),
                    None => Ok(self.state()),
                };
                out.push((from, Reply::Shards { tag, result }));
            } else {
                self.snapshots.push((from, tag, step));
            }
        }
        let waiting = std::mem::take(&mut self.waiting);
        for w in waiting {
            if let Some(e) = &self.failed {
                out.push((
                    w.from,
                    Reply::Failed {
                        tag: w.tag,
                        error: e.clone(),
                    },
                ));
                continue;
            }
            let Some(shard) = self.shards.get(&w.key) else {
                continue;
            };
            if shard.ready(self.sync, w.step) {
                let result = shard
                    .rows(w.ids.as_deref())
                    .map_err(|e| format!("{}: {e}", self.name(&w.key.0, shard.start, shard.end)));
                out.push((w.from, Reply::Rows { tag: w.tag, result }));
            } else {
                self.waiting.push(w);
            }
        }
    }

    /// Once every worker has finished: incomplete `Sync` steps are an error, waiting
    /// pulls are answered with an error, collectors get the shards.
    fn finish(&mut self, out: &mut Vec<(usize, Reply)>) {
        let mut incomplete = Vec::new();
        for s in self.shards.values() {
            for (step, p) in &s.pending {
                let k = p.iter().filter(|w| !w.is_empty()).count();
                incomplete.push(format!(
                    "{}: step {step} was pushed by {k} of {} workers and not applied",
                    self.name(&s.var, s.start, s.end),
                    self.workers
                ));
            }
        }
        incomplete.sort();
        if let Some(e) = incomplete.into_iter().next() {
            self.fail(e);
        }
        for w in std::mem::take(&mut self.waiting) {
            let e = self
                .failed
                .clone()
                .unwrap_or_else(|| format!("parameter server {}: shut down", self.id));
            out.push((
                w.from,
                Reply::Failed {
                    tag: w.tag,
                    error: e,
                },
            ));
        }
        for (to, tag) in std::mem::take(&mut self.collectors) {
            let result = match &self.failed {
                Some(e) => Err(e.clone()),
                None => Ok(self.values()),
            };
            out.push((to, Reply::Shards { tag, result }));
        }
    }

    /// Every shard's current rows, sorted by variable and first row.
    fn values(&self) -> Vec<(String, usize, Tensor)> {
        let mut v: Vec<_> = self
            .shards
            .values()
            .map(|s| (s.var.clone(), s.start, s.value.clone()))
            .collect();
        v.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        v
    }

    /// Every shard's rows and its optimizer slots (`VAR/SLOT`), sorted.
    fn state(&self) -> Vec<(String, usize, Tensor)> {
        let mut v = self.values();
        for s in self.shards.values() {
            for (key, t) in s.opt.state() {
                if key != STEP_KEY {
                    let slot = key.rsplit_once('/').map_or(key.as_str(), |(_, slot)| slot);
                    v.push((format!("{}/{slot}", s.var), s.start, t.clone()));
                }
            }
        }
        v.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        v
    }

    /// Stops: the shards, the error, the spans.
    pub fn into_outcome(self) -> ServerOutcome {
        let shards = self.values();
        ServerOutcome {
            shards,
            error: self.failed,
            spans: self.spans,
            busy: self.busy,
        }
    }
}

/// `Sync`: applies every step of `shard` whose pushes have all arrived, in order.
fn apply_complete_steps(
    shard: &mut Shard,
    workers: usize,
    applied: &mut Vec<(u64, Option<usize>, Instant, Instant)>,
) -> std::result::Result<(), String> {
    loop {
        let next = shard.applied + 1;
        let complete = shard
            .pending
            .get(&next)
            .is_some_and(|p| p.iter().all(|w| !w.is_empty()));
        if !complete {
            return Ok(());
        }
        let Some(pushes) = shard.pending.remove(&next) else {
            return Ok(());
        };
        let t0 = Instant::now();
        let g = combine(pushes).map_err(|e| format!("step {next}: {e}"))?;
        shard
            .apply(&g, workers)
            .map_err(|e| format!("step {next}: {e}"))?;
        applied.push((next, None, t0, Instant::now()));
    }
}

/// Serves requests arriving on `link` until every worker has finished (or no worker
/// can send any more); returns the server's shards, error and spans.
pub fn serve(mut server: Server, link: &mut dyn ServerLink) -> Result<ServerOutcome> {
    while !server.done() {
        let (from, bytes) = match link.recv() {
            Ok(m) => m,
            // Every worker is gone without finishing: nothing can reach this server.
            Err(_) => break,
        };
        let replies = match Request::decode(&bytes) {
            Ok(req) => server.handle(from, req),
            Err(e) => {
                return Err(RuntimeError::Config(format!(
                    "parameter server {}: a malformed message from worker {from}: {e}",
                    server.id
                )))
            }
        };
        for (to, reply) in replies {
            link.send(to, reply.encode())?;
        }
    }
    Ok(server.into_outcome())
}
