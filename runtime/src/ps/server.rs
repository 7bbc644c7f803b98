//! One parameter server: owns shards, applies pushes with one [`Optimizer`] per
//! shard, answers pulls when the sync mode allows. [`Server::handle`] takes one
//! request and returns the replies it releases, addressed by worker rank; it knows
//! nothing of how messages travel. [`serve`] runs it over a [`ServerLink`].
//!
//! With a timeout ([`Server::set_timeout`], `--timeout` under MPI), nothing waits on a
//! worker for longer: a pull, a training-state snapshot or a shutdown that has waited
//! that long fails the server with an error naming the workers it waits for (those that
//! did not push the step it needs, or did not finish), which every waiting worker gets
//! as its answer. The worker that stalled is named, not the server.

use super::transport::{Incoming, ServerLink};
use super::wire::{Reply, Request};
use super::{gather_rows, PsConfig, PsSync, ServerSpan, ShardSpec};
use crate::core::checkpoint::TrainingState;
use crate::core::error::{PeerKind, Result, RuntimeError};
use crate::core::init::{init_param, init_rows};
use crate::core::value::HostElem;
use crate::core::value::{each_dtype, Slices, Tensor, Value};
use crate::cpu::optim::{Optimizer, STEP_KEY};
use ndarray::{ArrayD, Axis, Slice};
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
    each_dtype!(t, a => a.slice_axis(Axis(0), sl).as_standard_layout().into_owned())
}

/// Shard `sp` of a resumed state: its rows of the variable and of each slot.
fn resumed_shard(sp: &ShardSpec, state: &TrainingState, cfg: &PsConfig) -> Result<Shard> {
    let whole = state.params.get(&sp.var).ok_or_else(|| {
        RuntimeError::state(format!(
            "the training state has no variable `{}` (it holds {})",
            sp.var,
            state.index.variables.join(", ")
        ))
    })?;
    if whole.shape() != sp.full.dims() || whole.dtype() != sp.full.dtype {
        return Err(RuntimeError::state(format!(
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
        opt.exempt_from_decay(&cfg.no_decay);
        opt.set_lazy(cfg.lazy_updates);
        opt.follow(&cfg.lr_schedule, cfg.total_steps);
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
        match &self.value {
            Tensor::F32(w) => gather_rows(w, ids, self.start, self.end),
            Tensor::F64(w) => gather_rows(w, ids, self.start, self.end),
            t => Err(format!("the shard is {}", t.dtype())),
        }
    }

    /// Applies one (combined) gradient with scale `1/workers` and ends the step. A
    /// step that touched no row of the shard still moves its rows where the optimizer
    /// moves untouched rows (momentum and Adam, not lazy): a zero gradient, as one
    /// device's scattered gradient is there.
    fn apply(&mut self, grad: &Value, workers: usize) -> std::result::Result<(), String> {
        let empty = matches!(grad, Value::Slices(s) if s.indices.is_empty());
        let zero;
        let grad = match (empty, self.opt.moves_untouched_rows()) {
            (false, _) => Some(grad),
            (true, true) => {
                zero = Value::Tensor(Tensor::zeros(&self.value.tensor_type()));
                Some(&zero)
            }
            (true, false) => None,
        };
        if let Some(grad) = grad {
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
    fn sum<T: HostElem>(
        mut acc: ArrayD<T>,
        rest: impl Iterator<Item = Value>,
        differ: impl Fn() -> String,
    ) -> std::result::Result<Value, String> {
        for v in rest {
            match v.tensor().and_then(T::array) {
                Some(g) if g.shape() == acc.shape() => acc += g,
                _ => return Err(differ()),
            }
        }
        Ok(Value::Tensor(T::tensor(acc)))
    }
    match first {
        Value::Tensor(Tensor::F32(acc)) => sum(acc, it, differ),
        Value::Tensor(Tensor::F64(acc)) => sum(acc, it, differ),
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
            let indices = ss.iter().flat_map(|s| s.indices.iter().copied()).collect();
            let values: Vec<&Tensor> = ss.iter().map(|s| &s.values).collect();
            Ok(Value::Slices(Slices {
                indices,
                values: Tensor::concat(&values, 0)?,
                dense_shape: ss[0].dense_shape.clone(),
            }))
        }
        Value::Tensor(t) => Err(format!(
            "a {} gradient (the servers hold f32 or f64)",
            t.dtype()
        )),
    }
}

/// A pull waiting for its step.
struct Waiting {
    from: usize,
    key: (String, usize),
    ids: Option<Vec<usize>>,
    step: u64,
    tag: u64,
    /// When it arrived.
    since: Instant,
}

/// `worker rank 0`, `worker ranks 0 and 2`, `worker ranks 0, 1 and 2`.
fn worker_ranks(ranks: &[usize]) -> String {
    let r: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match r.as_slice() {
        [one] => format!("worker rank {one}"),
        [init @ .., last] => format!("worker ranks {} and {last}", init.join(", ")),
        [] => "no worker".into(),
    }
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
    /// Workers that asked for the shards at shutdown, with their tags and when.
    collectors: Vec<(usize, u64, Instant)>,
    /// Snapshots asked for `(worker, tag, step, when)`, answered once the step is applied.
    snapshots: Vec<(usize, u64, u64, Instant)>,
    /// How long anything may wait on a worker (none: forever).
    timeout: Option<Duration>,
    /// Per worker: when its last message came.
    heard: Vec<Option<Instant>>,
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
            timeout: None,
            heard: vec![None; cfg.workers],
            tracing: false,
            spans: Vec::new(),
            busy: Duration::ZERO,
        })
    }

    /// Records a span per message handled and per update applied from now on.
    pub fn set_tracing(&mut self, on: bool) {
        self.tracing = on;
    }

    /// Bounds every wait on a worker by `timeout` (see the module doc).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// Moves every wait on a worker `by` later (time this process was suspended, which
    /// is no worker's fault).
    pub fn postpone(&mut self, by: Duration) {
        for w in &mut self.waiting {
            w.since += by;
        }
        for s in &mut self.snapshots {
            s.3 += by;
        }
        for c in &mut self.collectors {
            c.2 += by;
        }
        for h in self.heard.iter_mut().flatten() {
            *h += by;
        }
    }

    /// When the oldest wait on a worker times out (none: nothing waits, or no timeout).
    pub fn next_deadline(&self) -> Option<Instant> {
        let t = self.timeout?;
        if self.failed.is_some() {
            return None;
        }
        let pulls = self.waiting.iter().map(|w| w.since);
        let snaps = self.snapshots.iter().map(|s| s.3);
        let colls = self.collectors.iter().map(|c| c.2);
        pulls.chain(snaps).chain(colls).min().map(|since| since + t)
    }

    /// Fails the server when a wait on a worker has lasted the timeout by `now`, naming
    /// the workers it waits for; returns the replies that answers (every waiting pull,
    /// snapshot and shutdown gets the error).
    pub fn expire(&mut self, now: Instant) -> Vec<(usize, Reply)> {
        let mut out = Vec::new();
        let Some(t) = self.timeout else {
            return out;
        };
        if self.failed.is_some() {
            return out;
        }
        let secs = t.as_secs_f64();
        let mut why = None;
        if let Some(w) = self.waiting.iter().find(|w| now >= w.since + t) {
            if let Some(shard) = self.shards.get(&w.key) {
                let what = format!("pull of `{}` at step {}", shard.var, w.step);
                why = Some(self.blame(shard, w.step, &what, secs, now));
            }
        }
        if why.is_none() {
            if let Some(&(_, _, step, _)) = self.snapshots.iter().find(|s| now >= s.3 + t) {
                let what = format!("training state at step {step}");
                why = self
                    .shards
                    .values()
                    .find(|s| !s.ready(self.sync, step + 1))
                    .map(|s| self.blame(s, step + 1, &what, secs, now))
                    .or_else(|| Some(format!("{what}: not ready within {secs:.0} s (--timeout)")));
            }
        }
        if why.is_none() {
            if let Some(&(by, _, _)) = self.collectors.iter().find(|c| now >= c.2 + t) {
                let left: Vec<usize> = (0..self.workers).filter(|&r| !self.finished[r]).collect();
                why = Some(format!(
                    "the end of the run: {} did not finish within {secs:.0} s (--timeout) of \
                     worker {by}{}",
                    worker_ranks(&left),
                    self.silence(&left, now)
                ));
            }
        }
        let Some(why) = why else {
            return out;
        };
        self.fail(why.clone());
        self.wake(&mut out);
        for (to, tag, _) in std::mem::take(&mut self.collectors) {
            out.push((
                to,
                Reply::Shards {
                    tag,
                    result: Err(why.clone()),
                },
            ));
        }
        out
    }

    /// Why a wait for `shard` to be ready for `step` lasted the timeout: the workers
    /// that did not push the step it needs.
    fn blame(&self, shard: &Shard, step: u64, what: &str, secs: f64, now: Instant) -> String {
        let need = match self.sync {
            PsSync::Sync => shard.applied + 1,
            PsSync::Stale(k) => step.saturating_sub(u64::from(k) + 1),
            PsSync::Async => 0,
        };
        let behind: Vec<usize> = (0..self.workers)
            .filter(|&r| shard.last[r] < need)
            .collect();
        if behind.is_empty() {
            return format!(
                "{what}: parameter server {} could not answer within {secs:.0} s (--timeout)",
                self.id
            );
        }
        format!(
            "{what}: {} did not push step {need} of `{}` within {secs:.0} s (--timeout){}",
            worker_ranks(&behind),
            shard.var,
            self.silence(&behind, now)
        )
    }

    /// `; nothing came from worker rank 0 for 5.2 s`: the longest any of `ranks` has
    /// been silent (empty when they were heard from recently).
    fn silence(&self, ranks: &[usize], now: Instant) -> String {
        let quiet = ranks
            .iter()
            .filter_map(|&r| self.heard[r].map(|h| (r, now.saturating_duration_since(h))))
            .max_by_key(|&(_, d)| d);
        match quiet {
            Some((r, d)) if d >= Duration::from_secs(1) => format!(
                "; parameter server {} heard nothing from worker rank {r} for {:.1} s",
                self.id,
                d.as_secs_f64()
            ),
            _ => String::new(),
        }
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
        if let Some(h) = self.heard.get_mut(from) {
            *h = Some(t0);
        }
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
                        self.collectors.push((from, tag, t0));
                    }
                }
                Request::Abort { reason } => {
                    self.finished[from] = true;
                    self.fail(format!("worker {from} failed: {reason}"));
                }
                Request::Snapshot { tag, step } => self.snapshots.push((from, tag, step, t0)),
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
                since: Instant::now(),
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
        for (from, tag, step, since) in std::mem::take(&mut self.snapshots) {
            // Once every shard could answer a pull of the next step.
            if self.failed.is_some() || self.shards.values().all(|s| s.ready(self.sync, step + 1)) {
                let result = match &self.failed {
                    Some(e) => Err(e.clone()),
                    None => Ok(self.state()),
                };
                out.push((from, Reply::Shards { tag, result }));
            } else {
                self.snapshots.push((from, tag, step, since));
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
        for (to, tag, _) in std::mem::take(&mut self.collectors) {
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
/// can send any more), expiring waits on workers as [`Server::expire`] says; returns the
/// server's shards, error and spans once its replies are delivered. A link error (a
/// worker that did not take a reply in time) is returned.
pub fn serve(mut server: Server, link: &mut dyn ServerLink) -> Result<ServerOutcome> {
    let mut suspended = link.suspended();
    while !server.done() {
        if let Some(t) = link.timeout() {
            server.set_timeout(t);
        }
        let wait = server
            .next_deadline()
            .map(|d| d.saturating_duration_since(Instant::now()));
        let got = link.recv(wait)?;
        let now_suspended = link.suspended();
        if now_suspended > suspended {
            server.postpone(now_suspended - suspended);
            suspended = now_suspended;
        }
        let mut replies = match got {
            Incoming::Request(from, bytes) => match Request::decode(&bytes) {
                Ok(req) => server.handle(from, req),
                Err(e) => {
                    return Err(RuntimeError::Peer {
                        rank: server.workers + server.id,
                        peer: from,
                        op: "parameter-server request".into(),
                        kind: PeerKind::Malformed,
                        message: format!(
                            "parameter server {}: a malformed message from worker {from}: {e}",
                            server.id
                        ),
                    })
                }
            },
            Incoming::Idle => Vec::new(),
            // Every worker is gone without finishing: nothing can reach this server.
            Incoming::Closed => break,
        };
        replies.extend(server.expire(Instant::now()));
        for (to, reply) in replies {
            link.send(to, reply.encode())?;
        }
    }
    link.flush()?;
    Ok(server.into_outcome())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::OptimizerSpec;
    use distc_ir::{Init, TensorType};
    use ndarray::IxDyn;

    fn config(workers: usize, sync: PsSync) -> PsConfig {
        PsConfig {
            workers,
            sync,
            optimizer: OptimizerSpec::Sgd {
                lr: 0.1,
                momentum: 0.0,
            },
            lr_schedule: Default::default(),
            total_steps: 1,
            no_decay: Vec::new(),
            lazy_updates: false,
            seed: 1,
            resume: None,
        }
    }

    fn shard() -> ShardSpec {
        ShardSpec {
            var: "v".into(),
            full: TensorType::f32(vec![4, 2]),
            init: Init::Uniform { lo: -1.0, hi: 1.0 },
            start: 0,
            end: 4,
        }
    }

    fn push(step: u64) -> Request {
        Request::Push {
            var: "v".into(),
            start: 0,
            end: 4,
            step,
            grad: Value::Tensor(Tensor::F32(ArrayD::zeros(IxDyn(&[4, 2])))),
        }
    }

    fn pull(tag: u64, step: u64) -> Request {
        Request::Pull {
            tag,
            var: "v".into(),
            start: 0,
            end: 4,
            ids: None,
            step,
        }
    }

    fn failed(replies: &[(usize, Reply)]) -> Vec<(usize, String)> {
        replies
            .iter()
            .filter_map(|(to, r)| match r {
                Reply::Failed { error, .. } => Some((*to, error.clone())),
                Reply::Shards { result: Err(e), .. } => Some((*to, e.clone())),
                _ => None,
            })
            .collect()
    }

    /// Issue 20: a pull waiting on a worker that stopped pushing fails at the timeout,
    /// naming that worker and the step it did not push (sync and stale); a server with
    /// no timeout waits on.
    #[test]
    fn a_late_pull_names_the_worker_it_waits_for() {
        let t = Duration::from_millis(50);
        for (sync, pushed, asked, missing) in [
            (
                PsSync::Sync,
                1,
                2,
                "worker rank 1 did not push step 1 of `v`",
            ),
            (
                PsSync::Stale(1),
                2,
                3,
                "worker rank 1 did not push step 1 of `v`",
            ),
        ] {
            let mut s = Server::new(0, &[shard()], &config(2, sync)).expect("server");
            s.set_timeout(t);
            for step in 1..=pushed {
                assert!(s.handle(0, push(step)).is_empty());
            }
            assert!(s.handle(0, pull(7, asked)).is_empty(), "{sync}: waits");
            let due = s.next_deadline().expect("a deadline");
            assert!(
                s.expire(due - Duration::from_millis(1)).is_empty(),
                "{sync}"
            );
            let out = failed(&s.expire(due));
            assert_eq!(out.len(), 1, "{sync}: {out:?}");
            assert_eq!(out[0].0, 0);
            assert!(out[0].1.contains(missing), "{sync}: {}", out[0].1);
            assert!(out[0].1.contains("(--timeout)"), "{}", out[0].1);
            // Later requests get the same error; nothing is left to expire.
            assert!(s.next_deadline().is_none());
            let again = failed(&s.handle(1, pull(8, 1)));
            assert_eq!(again[0].1, out[0].1);
        }
        let mut s = Server::new(0, &[shard()], &config(2, PsSync::Sync)).expect("server");
        assert!(s.handle(0, push(1)).is_empty());
        assert!(s.handle(0, pull(7, 2)).is_empty());
        assert!(s.next_deadline().is_none());
        assert!(s
            .expire(Instant::now() + Duration::from_secs(3600))
            .is_empty());
    }

    /// Time the server's process was suspended postpones its deadlines; a shutdown
    /// that waits for another worker names it.
    #[test]
    fn suspension_postpones_and_a_late_shutdown_names_who_did_not_finish() {
        let t = Duration::from_millis(50);
        let mut s = Server::new(0, &[shard()], &config(3, PsSync::Async)).expect("server");
        s.set_timeout(t);
        assert!(s
            .handle(
                1,
                Request::Shutdown {
                    tag: 3,
                    collect: false
                }
            )
            .is_empty());
        assert!(s
            .handle(
                0,
                Request::Shutdown {
                    tag: 4,
                    collect: true
                }
            )
            .is_empty());
        let due = s.next_deadline().expect("a deadline");
        s.postpone(Duration::from_secs(10));
        assert_eq!(s.next_deadline(), Some(due + Duration::from_secs(10)));
        assert!(s.expire(due).is_empty());
        let out = failed(&s.expire(due + Duration::from_secs(10)));
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].0, 0);
        assert!(
            out[0].1.contains("worker rank 2 did not finish"),
            "{}",
            out[0].1
        );
    }

    /// In-process servers take the cluster's timeout: a worker that never pushes is
    /// named in the other worker's error, not the server.
    #[test]
    fn in_process_clients_learn_which_worker_a_pull_waited_for() {
        let mut c =
            super::super::start(vec![vec![shard()]], config(2, PsSync::Sync)).expect("cluster");
        c.set_timeout(Duration::from_millis(200));
        let mut w0 = c.client(0);
        let _w1 = c.client(1);
        let sh = [(0, 0, 4)];
        w0.pull("v", &sh, 1).expect("step 1");
        w0.push("v", &sh, &Tensor::F32(ArrayD::zeros(IxDyn(&[4, 2]))), 1)
            .expect("push");
        let start = Instant::now();
        let e = w0
            .pull("v", &sh, 2)
            .expect_err("worker 1 never pushes")
            .to_string();
        assert!(e.contains("worker rank 1 did not push step 1"), "{e}");
        assert!(!e.contains("did not answer"), "{e}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }
}
