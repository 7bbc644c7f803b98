//! Runs a distributed plan in one process: N workers and S parameter servers as
//! threads, the embedded default and the reference for the MPI and NCCL transports.
//!
//! Every worker runs the same SPMD program with its rank. Its collectives go to a
//! communication thread of its own (which owns the worker's [`Communicator`]), so a
//! bucket's all-reduce runs while the backward pass goes on; the executor waits for it
//! only where the result is read. Parameter-server ops go through the worker's
//! [`PsClient`]. Each worker reports its step to the coordinator (the caller's thread),
//! which joins the reports into one line of metrics: loss (mean over workers), global
//! samples per second, and the bytes each worker moved.

use crate::comm::{in_process, ByteCount, Communicator};
use crate::config::RunConfig;
use crate::data::{data_dir, DataSource};
use crate::error::{Result, RuntimeError};
use crate::exec::{CommHook, Executor, Mode, Pending};
use crate::metrics::{Profile, StepMetrics};
use crate::optim::Optimizer;
use crate::ps::{PsClient, PsCluster, PsConfig, PsSync, ShardSpec};
use crate::train::{init_params, input_types};
use crate::value::{Slices, Tensor, Value};
use distc_ir::{Graph, NodeId, Op, ReduceOp};
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How to run a distributed plan.
#[derive(Clone, Debug)]
pub struct DistOptions {
    /// Worker count.
    pub workers: usize,
    /// Server synchronisation.
    pub sync: PsSync,
    /// Steps (else the plan's).
    pub steps: Option<usize>,
    /// Data directory (else `DISTC_DATA`).
    pub data_dir: Option<std::path::PathBuf>,
    /// Synthetic sources slice one global stream (as one device with batch N*b would
    /// see it) instead of seeding worker r with seed + r. For `distc verify`.
    pub global_data: bool,
    /// Record spans for a Chrome trace.
    pub trace: bool,
    /// Draw every step's batches before the first step (see [`DataSource::preload`]).
    pub preload: bool,
    /// Profile worker 0: time every kernel, its optimizer and its waits (see [`Profile`]).
    pub profile: bool,
}

/// One span of a trace: who, what, when (microseconds since the run started).
///
/// Tracks: `worker R` (a `step N` span holding one span per IR node run, and
/// `wait %N` where the worker blocked on a collective's result), `worker R comm` (the
/// collectives its communication thread ran, with the bytes each sent), `server S`
/// (each pull and push the server handled and each update it applied).
#[derive(Clone, Debug)]
pub struct Span {
    /// "worker 0", "worker 0 comm", "server 1".
    pub track: String,
    /// Op or collective name.
    pub name: String,
    /// IR node (`%12`), when the span is a node.
    pub node: Option<String>,
    /// Training step.
    pub step: u64,
    /// Bytes sent, for a collective.
    pub bytes: Option<u64>,
    /// Start, microseconds.
    pub start_us: f64,
    /// Duration, microseconds.
    pub dur_us: f64,
}

/// What a distributed run produced.
#[derive(Debug)]
pub struct DistReport {
    /// Steps run.
    pub steps: usize,
    /// Mean loss over workers of the first and last step.
    pub first_loss: f64,
    /// Mean loss over workers of the last step.
    pub final_loss: f64,
    /// Global samples per second over all steps.
    pub samples_per_sec: f64,
    /// Wall time of the steps.
    pub train_time: Duration,
    /// Every variable after training: replicated ones from worker 0, server-held ones
    /// reassembled from their shards.
    pub params: HashMap<String, Tensor>,
    /// Trace spans, when asked for.
    pub spans: Vec<Span>,
    /// Where worker 0's step time went, when asked for.
    pub profile: Option<Profile>,
}

/// Shards of every server program: `shard` sources, by server.
pub fn server_shards(
    servers: &[Graph],
    full: &HashMap<String, distc_ir::TensorType>,
) -> Result<Vec<Vec<ShardSpec>>> {
    servers
        .iter()
        .map(|g| {
            g.topo_order()
                .into_iter()
                .filter_map(|id| match g.op(id) {
                    Op::Shard {
                        var,
                        start,
                        end,
                        init,
                        ..
                    } => Some((var.clone(), *start, *end, init.clone())),
                    _ => None,
                })
                .map(|(var, start, end, init)| {
                    let full = full.get(&var).cloned().ok_or_else(|| {
                        RuntimeError::Config(format!(
                            "server program holds `{var}`, which no worker reads"
                        ))
                    })?;
                    Ok(ShardSpec {
                        var,
                        full,
                        init,
                        start,
                        end,
                    })
                })
                .collect()
        })
        .collect()
}

/// The full type of every server-held variable, from the worker program's pulls.
pub fn pulled_types(worker: &Graph) -> HashMap<String, distc_ir::TensorType> {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::Pull { var, ty, .. } => Some((var.clone(), ty.clone())),
            Op::SparsePull { var, table, .. } => Some((var.clone(), table.clone())),
            _ => None,
        })
        .collect()
}

/// A collective handed to the communication thread.
struct Request {
    node: NodeId,
    op: Op,
    value: Value,
    step: u64,
    reply: mpsc::Sender<Result<Value>>,
}

struct Waiting(mpsc::Receiver<Result<Value>>);

impl Pending for Waiting {
    fn wait(self: Box<Self>) -> Result<Value> {
        self.0
            .recv()
            .map_err(|_| RuntimeError::Config("the communication thread stopped".into()))?
    }
}

/// Runs one collective on a communicator.
fn collective(comm: &mut dyn Communicator, op: &Op, value: Value) -> Result<Value> {
    let n = comm.size();
    match (op, value) {
        (Op::AllReduce { reduce }, Value::Tensor(Tensor::F32(mut a))) => {
            let buf = a.as_slice_mut().ok_or_else(|| {
                RuntimeError::Config("all_reduce of a non-contiguous tensor".into())
            })?;
            comm.all_reduce(buf, *reduce == ReduceOp::Mean)?;
            Ok(Value::Tensor(Tensor::F32(a)))
        }
        (Op::AllReduce { reduce }, Value::Tensor(Tensor::F64(mut a))) => {
            let buf = a.as_slice_mut().ok_or_else(|| {
                RuntimeError::Config("all_reduce of a non-contiguous tensor".into())
            })?;
            comm.all_reduce_f64(buf, *reduce == ReduceOp::Mean)?;
            Ok(Value::Tensor(Tensor::F64(a)))
        }
        (Op::Broadcast { root }, Value::Tensor(Tensor::F32(a))) => {
            let shape = a.shape().to_vec();
            let mut bytes: Vec<u8> = a.iter().flat_map(|x| x.to_le_bytes()).collect();
            comm.broadcast(&mut bytes, *root)?;
            let v: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Ok(Value::Tensor(Tensor::F32(
                ArrayD::from_shape_vec(IxDyn(&shape), v)
                    .map_err(|e| RuntimeError::Config(e.to_string()))?,
            )))
        }
        (Op::AllGather { reduce, .. }, Value::Slices(s)) => {
            let Tensor::F32(values) = &s.values else {
                return Err(RuntimeError::Config("all_gather of non-f32 slices".into()));
            };
            let row: usize = s.dense_shape[1..].iter().product();
            // On the wire: an 8-byte row id and the row's values, per row.
            let mut mine = Vec::with_capacity(s.indices.len() * (8 + 4 * row));
            let flat = values.as_standard_layout();
            let flat = flat
                .as_slice()
                .ok_or_else(|| RuntimeError::Config("slices values are not contiguous".into()))?;
            for (k, &id) in s.indices.iter().enumerate() {
                mine.extend_from_slice(&i64::from(id).to_le_bytes());
                for x in &flat[k * row..(k + 1) * row] {
                    mine.extend_from_slice(&x.to_le_bytes());
                }
            }
            let parts = comm.all_gather(mine)?;
            let scale = if *reduce == ReduceOp::Mean {
                1.0 / n as f32
            } else {
                1.0
            };
            let (mut indices, mut vals) = (Vec::new(), Vec::new());
            for p in parts {
                for rec in p.chunks_exact(8 + 4 * row) {
                    let mut id = [0u8; 8];
                    id.copy_from_slice(&rec[..8]);
                    indices.push(i64::from_le_bytes(id) as i32);
                    vals.extend(
                        rec[8..]
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * scale),
                    );
                }
            }
            let mut dims = vec![indices.len()];
            dims.extend_from_slice(&s.dense_shape[1..]);
            let values = ArrayD::from_shape_vec(IxDyn(&dims), vals)
                .map_err(|e| RuntimeError::Config(e.to_string()))?;
            Ok(Value::Slices(Slices {
                indices,
                values: Tensor::F32(values),
                dense_shape: s.dense_shape,
            }))
        }
        (op, v) => Err(RuntimeError::Config(format!(
            "{} of {} is not supported",
            op.mnemonic(),
            v.value_type()
        ))),
    }
}

/// A collective as the communication thread ran it.
struct CommSpan {
    node: NodeId,
    op: &'static str,
    step: u64,
    bytes: u64,
    start: Instant,
    end: Instant,
}

/// The communication thread: runs collectives in program order, timing each.
fn comm_thread(
    mut comm: Box<dyn Communicator>,
    rx: mpsc::Receiver<Request>,
    spans: mpsc::Sender<CommSpan>,
    bytes: mpsc::Sender<ByteCount>,
) {
    for req in rx {
        let before = comm.bytes();
        let start = Instant::now();
        let r = collective(comm.as_mut(), &req.op, req.value);
        let end = Instant::now();
        let after = comm.bytes();
        let _ = spans.send(CommSpan {
            node: req.node,
            op: req.op.mnemonic(),
            step: req.step,
            bytes: after.sent - before.sent,
            start,
            end,
        });
        let _ = bytes.send(after);
        let _ = req.reply.send(r);
    }
}

/// A worker's view of the others and the servers.
struct WorkerHook {
    to_comm: mpsc::Sender<Request>,
    ps: Option<PsClient>,
    trace: bool,
    /// The step running, for spans.
    step: u64,
    spans: Vec<(NodeId, &'static str, u64, Instant, Instant)>,
}

impl CommHook for WorkerHook {
    fn start_collective(
        &mut self,
        node: NodeId,
        op: &Op,
        v: Value,
        step: u64,
    ) -> Result<Box<dyn Pending>> {
        let (reply, rx) = mpsc::channel();
        self.to_comm
            .send(Request {
                node,
                op: op.clone(),
                value: v,
                step,
                reply,
            })
            .map_err(|_| RuntimeError::Config("the communication thread stopped".into()))?;
        Ok(Box::new(TimedWait {
            inner: Waiting(rx),
            node,
            step,
            trace: self.trace,
        }))
    }
    fn pull(&mut self, var: &str, shards: &[(usize, usize, usize)], step: u64) -> Result<Tensor> {
        let start = Instant::now();
        let r = self.ps()?.pull(var, shards, step);
        WAITED.with(|w| w.set(w.get() + start.elapsed()));
        r
    }
    fn sparse_pull(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        ids: &Tensor,
        step: u64,
    ) -> Result<Tensor> {
        let ids_dims = ids.shape().to_vec();
        let ids: Vec<i32> = ids
            .as_i32()
            .ok_or_else(|| {
                RuntimeError::Config(format!("sparse_pull of `{var}`: ids are not i32"))
            })?
            .iter()
            .copied()
            .collect();
        let start = Instant::now();
        let rows = self.ps()?.sparse_pull(var, shards, &ids, step)?;
        WAITED.with(|w| w.set(w.get() + start.elapsed()));
        // The servers answer [ids, row...]; the program wants [ids dims..., row...].
        let Tensor::F32(rows) = rows else {
            return Err(RuntimeError::Config(format!(
                "sparse_pull of `{var}`: not f32"
            )));
        };
        let mut dims = ids_dims;
        dims.extend_from_slice(&rows.shape()[1..]);
        let rows = rows
            .into_shape_with_order(IxDyn(&dims))
            .map_err(|e| RuntimeError::Config(format!("sparse_pull of `{var}`: {e}")))?;
        Ok(Tensor::F32(rows))
    }
    fn push(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        grad: Value,
        step: u64,
    ) -> Result<()> {
        let start = Instant::now();
        let r = match &grad {
            Value::Tensor(t) => self.ps()?.push(var, shards, t, step),
            Value::Slices(s) => self.ps()?.sparse_push(var, shards, s, step),
        };
        WAITED.with(|w| w.set(w.get() + start.elapsed()));
        r
    }
    fn span(&mut self, node: NodeId, op: &'static str, start: Instant, end: Instant) {
        if self.trace {
            self.spans.push((node, op, self.step, start, end));
        }
    }
}

impl WorkerHook {
    fn ps(&mut self) -> Result<&mut PsClient> {
        self.ps.as_mut().ok_or_else(|| {
            RuntimeError::Config(
                "the plan pulls from parameter servers, but none were started".into(),
            )
        })
    }
}

/// Waits for a collective and adds the wait to the worker's communication wait.
struct TimedWait {
    inner: Waiting,
    node: NodeId,
    step: u64,
    trace: bool,
}

impl Pending for TimedWait {
    fn wait(self: Box<Self>) -> Result<Value> {
        let start = Instant::now();
        let r = Box::new(self.inner).wait();
        let end = Instant::now();
        WAITED.with(|w| w.set(w.get() + (end - start)));
        if self.trace {
            WAIT_SPANS.with(|w| w.borrow_mut().push((self.node, self.step, start, end)));
        }
        r
    }
}

thread_local! {
    /// Time this worker thread spent waiting for collectives in the current step.
    static WAITED: std::cell::Cell<Duration> = const { std::cell::Cell::new(Duration::ZERO) };
    /// While tracing: where this worker thread blocked on which collective.
    static WAIT_SPANS: std::cell::RefCell<Vec<(NodeId, u64, Instant, Instant)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// What a worker thread hands back when it ends.
struct WorkerResult {
    params: HashMap<String, Tensor>,
    spans: Vec<Span>,
    profile: Option<Profile>,
}

/// One worker's report of one step.
struct Report {
    rank: usize,
    step: usize,
    loss: f64,
    compute: Duration,
    waited: Duration,
    bytes: (u64, u64),
    /// Collective bytes sent plus server bytes pushed and pulled.
    moved: u64,
}

/// Trains a distributed plan: `worker` is the SPMD worker program, `init` broadcasts the
/// replicated variables from rank 0, `servers` are the server programs. `on_step` sees
/// each step's metrics (joined over workers) as they come.
pub fn train_distributed(
    worker: &Graph,
    init: Option<&Graph>,
    servers: &[Graph],
    config: &RunConfig,
    opts: &DistOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<DistReport> {
    let n = opts.workers.max(1);
    let steps = opts.steps.unwrap_or(config.steps);
    let dir = data_dir(opts.data_dir.as_deref());
    let shards = server_shards(servers, &pulled_types(worker))?;
    let cluster: Option<PsCluster> = if shards.is_empty() {
        None
    } else {
        Some(crate::ps::start(
            shards,
            PsConfig {
                workers: n,
                sync: opts.sync,
                optimizer: config.optimizer.clone(),
                seed: config.seed,
            },
        )?)
    };
    // Data first, so a missing file fails before any thread starts.
    let mut sources = Vec::with_capacity(n);
    for rank in 0..n {
        let open = if opts.global_data {
            DataSource::open_global
        } else {
            DataSource::open
        };
        let mut source = open(
            &config.data,
            dir.as_deref(),
            &input_types(worker),
            config.batch,
            config.seed,
            rank,
            n,
        )?;
        if opts.preload {
            source.preload(steps)?;
        }
        sources.push(source);
    }
    let server_trace = cluster
        .as_ref()
        .filter(|_| opts.trace)
        .map(PsCluster::trace);
    let comms = in_process(n);
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let (report_tx, report_rx) = mpsc::channel::<Result<Report>>();
    let t0 = Instant::now();
    let mut spans = Vec::new();
    let mut params0 = HashMap::new();
    let mut profile0 = None;
    let (mut first_loss, mut final_loss) = (f64::NAN, f64::NAN);
    std::thread::scope(|scope| -> Result<()> {
        let mut handles = Vec::new();
        for ((rank, comm), mut data) in comms.into_iter().enumerate().zip(sources) {
            let report_tx = report_tx.clone();
            let ps = cluster.as_ref().map(|c| c.client(rank));
            let trace = opts.trace;
            handles.push(scope.spawn(move || -> Result<WorkerResult> {
                let (to_comm, comm_rx) = mpsc::channel::<Request>();
                let (span_tx, span_rx) = mpsc::channel();
                let (bytes_tx, bytes_rx) = mpsc::channel();
                let comm_handle = std::thread::spawn(move || {
                    comm_thread(Box::new(comm), comm_rx, span_tx, bytes_tx)
                });
                let mut hook = WorkerHook {
                    to_comm,
                    ps,
                    trace,
                    step: 0,
                    spans: Vec::new(),
                };
                let mut step_spans = Vec::new();
                let mut params = init_params(worker, config.seed);
                if let Some(init) = init {
                    let mut exec = Executor::new(init)?;
                    let out =
                        exec.run_with(&HashMap::new(), &params, Mode::Train, 0, Some(&mut hook))?;
                    for (name, t) in out.outputs {
                        params.insert(name, t);
                    }
                }
                let mut exec = Executor::new(worker)?;
                let profiling = opts.profile && rank == 0;
                exec.set_profiling(profiling);
                let mut profile = Profile::default();
                let mut optimizer = Optimizer::new(&config.optimizer);
                optimizer.set_parallel(cores > n);
                let mut last = ByteCount::default();
                let mut ps_last = (0, 0);
                for step in 1..=steps {
                    let batch = data.next_batch()?;
                    WAITED.with(|w| w.set(Duration::ZERO));
                    hook.step = step as u64;
                    let start = Instant::now();
                    let out =
                        exec.run_with(&batch, &params, Mode::Train, step as u64, Some(&mut hook))?;
                    let updating = Instant::now();
                    optimizer.step(&mut params, &out.grads)?;
                    profile.optimizer += updating.elapsed();
                    let elapsed = start.elapsed();
                    if trace {
                        step_spans.push((step as u64, start, updating, start + elapsed));
                    }
                    let mut now = last;
                    while let Ok(b) = bytes_rx.try_recv() {
                        now = b;
                    }
                    let ps_now = hook.ps.as_ref().map_or((0, 0), PsClient::bytes);
                    let waited = WAITED.with(|w| w.get());
                    profile.step_time += elapsed;
                    profile.comm_wait += waited;
                    let (sent, received) = (now.sent - last.sent, now.received - last.received);
                    // To servers: pushes and pulls' ids; from them: pulled values.
                    let (to_ps, from_ps) = (ps_now.0 - ps_last.0, ps_now.1 - ps_last.1);
                    let report = Report {
                        rank,
                        step,
                        loss: out.loss.unwrap_or(f64::NAN),
                        compute: elapsed.saturating_sub(waited),
                        waited,
                        bytes: (sent + to_ps, received + from_ps),
                        moved: sent + to_ps + from_ps,
                    };
                    last = now;
                    ps_last = ps_now;
                    if report_tx.send(Ok(report)).is_err() {
                        break;
                    }
                }
                drop(hook.to_comm);
                let _ = comm_handle.join();
                let base = t0;
                let us = |t: Instant| t.duration_since(base).as_secs_f64() * 1e6;
                let track = format!("worker {rank}");
                let span = |track: &str, name: String, node: Option<NodeId>, step, s, e| Span {
                    track: track.to_string(),
                    name,
                    node: node.map(|n: NodeId| n.to_string()),
                    step,
                    bytes: None,
                    start_us: us(s),
                    dur_us: us(e) - us(s),
                };
                let mut spans: Vec<Span> = Vec::new();
                if trace {
                    // Op groups: forward until the loss's gradient (autodiff's first `_grad`
                    // op), backward until the executor returns, then the update.
                    let mut backward_from: HashMap<u64, Instant> = HashMap::new();
                    for &(_, op, step, s, _) in &hook.spans {
                        if op.ends_with("_grad") {
                            backward_from.entry(step).or_insert(s);
                        }
                    }
                    for &(step, s, updating, e) in &step_spans {
                        spans.push(span(&track, format!("step {step}"), None, step, s, e));
                        let b = backward_from.get(&step).copied().unwrap_or(s);
                        spans.push(span(&track, "forward".into(), None, step, s, b));
                        spans.push(span(&track, "backward".into(), None, step, b, updating));
                        spans.push(span(&track, "update".into(), None, step, updating, e));
                    }
                    spans.extend(hook.spans.iter().map(|&(node, op, step, s, e)| {
                        // The worker only hands a collective to its comm thread.
                        let name = match op {
                            "all_reduce" | "all_gather" | "broadcast" => format!("issue {op}"),
                            _ => op.to_string(),
                        };
                        span(&track, name, Some(node), step, s, e)
                    }));
                    let waits = WAIT_SPANS.with(|w| std::mem::take(&mut *w.borrow_mut()));
                    spans.extend(waits.into_iter().map(|(node, step, s, e)| {
                        span(&track, format!("wait {node}"), Some(node), step, s, e)
                    }));
                    let comm_track = format!("worker {rank} comm");
                    spans.extend(span_rx.try_iter().map(|c| Span {
                        bytes: Some(c.bytes),
                        ..span(
                            &comm_track,
                            format!("{} {}", c.op, c.node),
                            Some(c.node),
                            c.step,
                            c.start,
                            c.end,
                        )
                    }));
                }
                let profile = profiling.then(|| Profile {
                    steps,
                    ops: exec.profile(),
                    ..profile
                });
                Ok(WorkerResult {
                    params,
                    spans,
                    profile,
                })
            }));
        }
        drop(report_tx);
        // The coordinator: one metrics line per step once every worker reported it.
        let mut pending: HashMap<usize, Vec<Report>> = HashMap::new();
        let mut step_start = Instant::now();
        for r in report_rx.iter() {
            let r = r?;
            let step = r.step;
            let reports = pending.entry(step).or_default();
            reports.push(r);
            if reports.len() < n {
                continue;
            }
            let mut reports = pending.remove(&step).unwrap_or_default();
            reports.sort_by_key(|r| r.rank);
            let elapsed = step_start.elapsed();
            step_start = Instant::now();
            let loss = reports.iter().map(|r| r.loss).sum::<f64>() / n as f64;
            if step == 1 {
                first_loss = loss;
            }
            final_loss = loss;
            let r0 = reports.iter().find(|r| r.rank == 0).unwrap_or(&reports[0]);
            on_step(&StepMetrics {
                step,
                loss,
                samples_per_sec: (n * config.batch) as f64 / elapsed.as_secs_f64().max(1e-9),
                compute_sec: r0.compute.as_secs_f64(),
                comm_wait_sec: r0.waited.as_secs_f64(),
                bytes_sent_per_worker: reports.iter().map(|r| r.bytes.0).collect(),
                bytes_received_per_worker: reports.iter().map(|r| r.bytes.1).collect(),
                bytes_sent: r0.bytes.0,
                bytes_received: r0.bytes.1,
                bytes_moved: r0.moved,
                eval: None,
            })?;
        }
        for (rank, h) in handles.into_iter().enumerate() {
            let w = h
                .join()
                .map_err(|_| RuntimeError::Config(format!("worker {rank} panicked")))??;
            if rank == 0 {
                params0 = w.params;
                profile0 = w.profile;
            }
            spans.extend(w.spans);
        }
        Ok(())
    })?;
    let train_time = t0.elapsed();
    if let Some(c) = cluster {
        params0.extend(c.shutdown()?);
    }
    if let Some(t) = server_trace {
        let us = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e6;
        spans.extend(t.spans().into_iter().map(|s| Span {
            track: format!("server {}", s.server),
            name: match s.rank {
                Some(r) => format!("{} (worker {r})", s.name),
                None => s.name,
            },
            node: None,
            step: s.step,
            bytes: None,
            start_us: us(s.start),
            dur_us: us(s.end) - us(s.start),
        }));
    }
    Ok(DistReport {
        steps,
        first_loss,
        final_loss,
        samples_per_sec: (steps * n * config.batch) as f64 / train_time.as_secs_f64().max(1e-9),
        train_time,
        params: params0,
        spans,
        profile: profile0,
    })
}

/// Writes spans as a Chrome trace (JSON; loads in Perfetto and chrome://tracing).
pub fn chrome_trace(spans: &[Span]) -> serde_json::Value {
    let mut tracks: Vec<&str> = spans.iter().map(|s| s.track.as_str()).collect();
    tracks.sort();
    tracks.dedup();
    let tid = |t: &str| tracks.iter().position(|x| *x == t).unwrap_or(0);
    let mut events: Vec<serde_json::Value> = tracks
        .iter()
        .enumerate()
        .map(|(i, t)| serde_json::json!({"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": t}}))
        .collect();
    events.extend(spans.iter().map(|s| {
        serde_json::json!({
            "ph": "X", "pid": 1, "tid": tid(&s.track), "name": s.name,
            "ts": s.start_us, "dur": s.dur_us,
            "args": {"node": s.node, "step": s.step, "bytes": s.bytes},
        })
    }));
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}
