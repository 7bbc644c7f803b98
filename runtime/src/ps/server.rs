//! One parameter server: a thread that owns shards, applies pushes with one
//! [`Optimizer`] per shard, and answers pulls when the sync mode allows.

use super::{Msg, PsConfig, PsSync, Reply, ServerSpan, ShardValues, Shared};
use crate::optim::Optimizer;
use crate::value::{Slices, Tensor, Value};
use ndarray::{ArrayD, Axis, IxDyn};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

/// Rows `start..end` of variable `var` with its optimizer and sync state.
pub(crate) struct Shard {
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

impl Shard {
    pub(crate) fn new(
        var: String,
        start: usize,
        end: usize,
        value: Tensor,
        cfg: &PsConfig,
    ) -> Shard {
        Shard {
            var,
            start,
            end,
            value,
            // A server is one thread, as a server process would be one core's worth;
            // its updates stay on it rather than taking the workers' cores via rayon.
            opt: {
                let mut o = Optimizer::new(&cfg.optimizer);
                o.set_parallel(false);
                o
            },
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
    fn rows(&self, ids: Option<&[usize]>) -> Result<Tensor, String> {
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
                    i + self.start,
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
    fn apply(&mut self, grad: &Value, workers: usize) -> Result<(), String> {
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
fn combine(pushes: Vec<Vec<Value>>) -> Result<Value, String> {
    let all: Vec<Value> = pushes.into_iter().flatten().collect();
    let mut it = all.into_iter();
    let Some(first) = it.next() else {
        return Err("no pushes".into());
    };
    match first {
        Value::Tensor(Tensor::F32(mut acc)) => {
            for v in it {
                match v {
                    Value::Tensor(Tensor::F32(g)) if g.shape() == acc.shape() => acc += &g,
                    _ => {
                        return Err(
                            "the workers' gradients of one step differ in kind or shape".into()
                        )
                    }
                }
            }
            Ok(Value::Tensor(Tensor::F32(acc)))
        }
        Value::Slices(s0) => {
            let mut ss = vec![s0];
            for v in it {
                match v {
                    Value::Slices(s) if s.dense_shape == ss[0].dense_shape => ss.push(s),
                    _ => {
                        return Err(
                            "the workers' gradients of one step differ in kind or shape".into()
                        )
                    }
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

/// `Sync`: applies every step of `shard` whose pushes have all arrived, in order,
/// noting each in `applied`.
fn apply_complete_steps(
    shard: &mut Shard,
    workers: usize,
    applied: &mut Vec<(u64, Option<usize>, Instant, Instant)>,
) -> Result<(), String> {
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

/// A pull waiting for its step.
struct Waiting {
    key: (String, usize),
    ids: Option<Vec<usize>>,
    step: u64,
    tag: usize,
    reply: Reply,
}

/// A server thread's state.
pub(crate) struct Server {
    id: usize,
    sync: PsSync,
    workers: usize,
    shards: HashMap<(String, usize), Shard>,
    waiting: Vec<Waiting>,
    failed: Option<String>,
    shared: Arc<Shared>,
    /// Spans recorded while tracing, handed to `shared` at the end.
    spans: Vec<ServerSpan>,
}

impl Server {
    pub(crate) fn new(
        id: usize,
        sync: PsSync,
        workers: usize,
        shards: Vec<Shard>,
        shared: Arc<Shared>,
    ) -> Server {
        Server {
            id,
            sync,
            workers,
            shards: shards
                .into_iter()
                .map(|s| ((s.var.clone(), s.start), s))
                .collect(),
            waiting: Vec::new(),
            failed: None,
            shared,
            spans: Vec::new(),
        }
    }

    /// Serves messages until `Shutdown` (or until every sender is gone); returns the
    /// shards' values.
    pub(crate) fn run(mut self, rx: Receiver<Msg>) -> ShardValues {
        while let Ok(msg) = rx.recv() {
            let t0 = Instant::now();
            // Named before `handle` consumes the message; only while tracing, as a
            // server handles thousands of messages a second.
            let what = match &msg {
                _ if !self.tracing() => None,
                Msg::Pull { var, step, ids, .. } => Some((
                    format!("pull {var}{}", if ids.is_some() { " rows" } else { "" }),
                    *step,
                    None,
                )),
                Msg::Push {
                    var, step, rank, ..
                } => Some((format!("push {var}"), *step, Some(*rank))),
                Msg::Shutdown => None,
            };
            let stop = self.handle(msg);
            let end = Instant::now();
            self.shared.busy[self.id].fetch_add((end - t0).as_nanos() as u64, Ordering::Relaxed);
            if let Some((name, step, rank)) = what {
                self.record(name, step, rank, t0, end);
            }
            if stop {
                break;
            }
        }
        self.finish()
    }

    fn handle(&mut self, msg: Msg) -> bool {
        match msg {
            Msg::Shutdown => return true,
            Msg::Pull {
                var,
                start,
                end,
                ids,
                step,
                tag,
                reply,
            } => self.pull(var, start, end, ids, step, tag, reply),
            Msg::Push {
                var,
                start,
                end,
                rank,
                step,
                grad,
            } => {
                if self.failed.is_none() {
                    if let Err(e) = self.push(&var, start, end, rank, step, grad) {
                        self.fail(&var, start, end, &e);
                    }
                    self.wake();
                }
            }
        }
        false
    }

    fn tracing(&self) -> bool {
        self.shared.tracing.load(Ordering::Relaxed)
    }

    fn record(
        &mut self,
        name: String,
        step: u64,
        rank: Option<usize>,
        start: Instant,
        end: Instant,
    ) {
        if self.tracing() {
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
    fn find(&self, var: &str, start: usize, end: usize) -> Result<&Shard, String> {
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
        var: String,
        start: usize,
        end: usize,
        ids: Option<Vec<usize>>,
        step: u64,
        tag: usize,
        reply: Reply,
    ) {
        if let Some(e) = &self.failed {
            let _ = reply.send((tag, Err(e.clone())));
            return;
        }
        let shard = match self.find(&var, start, end) {
            Ok(s) => s,
            Err(e) => {
                let _ = reply.send((tag, Err(e)));
                return;
            }
        };
        if shard.ready(self.sync, step) {
            let r = shard
                .rows(ids.as_deref())
                .map_err(|e| format!("{}: {e}", self.name(&var, start, end)));
            let _ = reply.send((tag, r));
        } else {
            self.waiting.push(Waiting {
                key: (var, start),
                ids,
                step,
                tag,
                reply,
            });
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
    ) -> Result<(), String> {
        self.find(var, start, end)?;
        let (sync, workers) = (self.sync, self.workers);
        let Some(shard) = self.shards.get_mut(&(var.to_string(), start)) else {
            return Err("no such shard on this server".into());
        };
        if rank >= workers {
            return Err(format!(
                "push from worker {rank} (there are {workers} workers)"
            ));
        }
        shard.last[rank] = shard.last[rank].max(step);
        // Steps applied by this push, with when: recorded once `shard` is released.
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

    /// Records a failure (the first one sticks) and answers every waiting pull with it.
    fn fail(&mut self, var: &str, start: usize, end: usize, e: &str) {
        let m = format!("{}: {e}", self.name(var, start, end));
        let mut slot = self.shared.errors[self.id]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if slot.is_none() {
            *slot = Some(m.clone());
        }
        drop(slot);
        if self.failed.is_none() {
            self.failed = Some(m);
        }
    }

    /// Answers the waiting pulls that may proceed now (all of them, with the error,
    /// if the server has failed).
    fn wake(&mut self) {
        let waiting = std::mem::take(&mut self.waiting);
        for w in waiting {
            if let Some(e) = &self.failed {
                let _ = w.reply.send((w.tag, Err(e.clone())));
                continue;
            }
            let Some(shard) = self.shards.get(&w.key) else {
                continue;
            };
            if shard.ready(self.sync, w.step) {
                let r = shard
                    .rows(w.ids.as_deref())
                    .map_err(|e| format!("{}: {e}", self.name(&w.key.0, shard.start, shard.end)));
                let _ = w.reply.send((w.tag, r));
            } else {
                self.waiting.push(w);
            }
        }
    }

    /// At shutdown: incomplete `Sync` steps are an error; waiting pulls are answered
    /// with an error; returns the shards' values.
    fn finish(mut self) -> ShardValues {
        let mut incomplete = Vec::new();
        for s in self.shards.values() {
            for (step, p) in &s.pending {
                let k = p.iter().filter(|w| !w.is_empty()).count();
                incomplete.push((
                    s.var.clone(),
                    s.start,
                    s.end,
                    format!(
                        "step {step} was pushed by {k} of {} workers and not applied",
                        self.workers
                    ),
                ));
            }
        }
        incomplete.sort();
        if let Some((var, start, end, e)) = incomplete.first() {
            self.fail(var, *start, *end, e);
        }
        for w in std::mem::take(&mut self.waiting) {
            let e = self
                .failed
                .clone()
                .unwrap_or_else(|| format!("parameter server {}: shut down", self.id));
            let _ = w.reply.send((w.tag, Err(e)));
        }
        let spans = std::mem::take(&mut self.spans);
        self.shared
            .spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(spans);
        self.shards
            .into_values()
            .map(|s| (s.var, s.start, s.value))
            .collect()
    }
}
