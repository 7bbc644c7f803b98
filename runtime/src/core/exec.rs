//! The graph executor: runs one graph on a backend, step after step.
//!
//! [`Executor::with_backend`] compiles the graph once into a [`Schedule`] (order,
//! slots, and the plans with each input's last use). At run time a value at its last
//! use is handed to the kernel *owned*, so pointwise and most backward kernels
//! overwrite it instead of allocating, and it is freed as soon as nothing reads it:
//! peak memory is the live set, not the graph.
//!
//! Feeds, parameters and constants are only ever borrowed (the embedding table alone
//! is 51 MB); kernels see them as borrowed arguments and never copy them wholesale.
//! Feeds are checked against the graph's input types, and every kernel result is
//! checked against the type the IR gave it, so a kernel bug or a bad feed is an error
//! naming the node or the input, never a panic or a silently wrong shape.

use crate::core::backend::{
    backend_error, Backend, BackendArg, Device, KernelCtx, KernelError, Started, ValueRef,
};
use crate::core::error::{Result, RuntimeError};
use crate::core::schedule::{
    is_comm_buffer, type_bytes, MemoryUse, Mode, Node, Schedule, Tally, Use,
};
use crate::core::value::{Tensor, Value};
use distc_ir::{Graph, NodeId, Op, TensorType, ValueType, LOSS_SCALE};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A value one pipeline stage hands another (or its own backward, the stash): on the
/// host (decoded from the stages' communicator), or already on the receiving device
/// (sent device to device, or kept there by the stage itself).
pub enum Message<V> {
    /// A host value, copied into the `recv`'s planned buffer.
    Host(Value),
    /// A device value, read where it lies.
    Device(V),
}

/// A collective started on a communication thread: its value, when it is needed.
pub trait Pending: Send {
    /// Blocks until the collective is done.
    fn wait(self: Box<Self>) -> Result<Value>;
}

/// How a worker program's communication ops reach the other workers and the servers.
/// Collectives are started and awaited only where their result is first read, so they
/// overlap whatever the program computes in between.
pub trait CommHook {
    /// Starts `all_reduce`, `all_gather` or `broadcast` on `v`.
    fn start_collective(
        &mut self,
        node: NodeId,
        op: &Op,
        v: Value,
        step: u64,
    ) -> Result<Box<dyn Pending>>;
    /// A dense variable's current value from its servers.
    fn pull(&mut self, var: &str, shards: &[(usize, usize, usize)], step: u64) -> Result<Tensor>;
    /// The rows `ids` names of a server-held table.
    fn sparse_pull(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        ids: &Tensor,
        step: u64,
    ) -> Result<Tensor>;
    /// Pushes a gradient (dense or slices) of `var` to its servers.
    fn push(
        &mut self,
        var: &str,
        shards: &[(usize, usize, usize)],
        grad: Value,
        step: u64,
    ) -> Result<()>;
    /// Called with each node as it runs, for traces: `(node, op, start, end)`.
    fn span(&mut self, _node: NodeId, _op: &'static str, _start: Instant, _end: Instant) {}
}

/// What one run produced; gradients stay on the backend (`V`: its value type).
#[derive(Debug)]
pub struct StepOutputs<V = Value> {
    /// The value marked by the `loss` sink, if the graph has one.
    pub loss: Option<f64>,
    /// One gradient per `param_grad` sink, in graph order (empty in evaluation).
    pub grads: Vec<(String, V)>,
    /// One tensor per `output` sink, in graph order (slices are densified).
    pub outputs: Vec<(String, Tensor)>,
    /// One value per `send` sink, in graph order: `(stage, tag, value)`.
    pub sent: Vec<(usize, String, V)>,
    /// One value per `assign` sink, in graph order (empty in evaluation): the new
    /// value of a frozen variable, written over it with the step's update.
    pub assigned: Vec<(String, V)>,
}

/// A slot's content during a run.
enum Slot<'a, B: Backend> {
    Empty,
    Owned(B::Value),
    Borrowed(&'a B::Tensor),
    /// A collective under way; waited for when first read.
    Pending(Box<dyn Pending>, NodeId),
}

/// Runs one graph on a [`Backend`] (the CPU's by default); compiled once, run once
/// per step.
pub struct Executor<B: Backend> {
    backend: B,
    schedule: Schedule,
    /// The filled tensor of each `constant` node, by node position.
    constants: Vec<Option<B::Tensor>>,
    profiling: bool,
    profile: HashMap<&'static str, (Duration, u64)>,
    /// Ops timed on the device, where the backend runs asynchronously and a trace asks.
    device_clock: Option<DeviceClock>,
    /// The worker's rank, for per-sample dropout masks (see [`KernelCtx::rank`]).
    rank: usize,
    /// The worker's rank on a mesh's model axis (see [`KernelCtx::model_rank`]).
    model_rank: usize,
    /// What the last run held at its peak.
    measured: MemoryUse,
    /// Gradient sums of the micro-batches of the current step, by node position.
    accumulated: HashMap<usize, B::Value>,
    /// Whether training runs read their `output` sinks.
    train_outputs: bool,
    /// The loss scale a backward pass starts from (fp16), fed as input `loss_scale`.
    loss_scale: Option<B::Tensor>,
}

impl<B: Backend> std::fmt::Debug for Executor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.backend.name())
            .field("schedule", &self.schedule)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Executor<B> {
    /// Compiles `graph` for `backend`: its [`Schedule`] and constants.
    pub fn with_backend(graph: &Graph, mut backend: B) -> Result<Executor<B>> {
        let schedule = Schedule::new(graph)?;
        backend.prepare(&schedule).map_err(|e| match e {
            KernelError::Device(e) => RuntimeError::Backend(e),
            // A graph the device cannot lay out: a pass's bug or a hand-edited plan.
            KernelError::Invalid(m) => RuntimeError::Plan(m),
        })?;
        let constants = schedule
            .nodes
            .iter()
            .map(|n| match &n.op {
                Op::Constant { value, ty } => backend
                    .filled(ty, *value)
                    .map(Some)
                    .map_err(|e| device_err(n, e)),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Executor {
            backend,
            schedule,
            constants,
            profiling: false,
            profile: HashMap::new(),
            device_clock: None,
            rank: 0,
            model_rank: 0,
            measured: MemoryUse::default(),
            accumulated: HashMap::new(),
            train_outputs: true,
            loss_scale: None,
        })
    }

    /// Whether the backend can capture a training step of this schedule into a graph.
    pub fn can_capture(&self) -> bool {
        self.backend.can_capture(&self.schedule)
    }

    /// The backend the kernels run on.
    pub fn backend(&mut self) -> &mut B {
        &mut self.backend
    }

    /// How many of its program's collectives run through the host (the worker's
    /// communicator) rather than on the backend's own.
    pub fn host_collectives(&self) -> usize {
        self.schedule
            .order()
            .filter(|(id, op)| op.is_collective() && !self.backend.runs_collective(*id))
            .count()
    }

    /// Runs one step. `feeds` are the model inputs by name and `params` the variables
    /// by name; both are borrowed, never copied.
    pub fn run(
        &mut self,
        feeds: &HashMap<String, B::Tensor>,
        params: &HashMap<String, B::Tensor>,
        mode: Mode,
        step: u64,
    ) -> Result<StepOutputs<B::Value>> {
        self.run_with(feeds, params, mode, step, None)
    }

    /// Runs one step of a worker program, its communication ops going through `comm`
    /// (without one they are an error).
    pub fn run_with<'h>(
        &mut self,
        feeds: &HashMap<String, B::Tensor>,
        params: &HashMap<String, B::Tensor>,
        mode: Mode,
        step: u64,
        comm: Option<&mut (dyn CommHook + 'h)>,
    ) -> Result<StepOutputs<B::Value>> {
        self.run_stage(feeds, params, &mut HashMap::new(), mode, step, comm)
    }

    /// [`Executor::run_with`] for a pipeline stage's program: each `recv` takes the
    /// value of its tag out of `received` (a host value a device backend copies into
    /// its `recv`'s planned buffer, so a step allocates nothing; a device value as it
    /// is), and each `send`'s value is handed back in [`StepOutputs::sent`].
    pub fn run_stage<'h>(
        &mut self,
        feeds: &HashMap<String, B::Tensor>,
        params: &HashMap<String, B::Tensor>,
        received: &mut HashMap<String, Message<B::Value>>,
        mode: Mode,
        step: u64,
        mut comm: Option<&mut (dyn CommHook + 'h)>,
    ) -> Result<StepOutputs<B::Value>> {
        let Executor {
            backend,
            schedule:
                Schedule {
                    nodes,
                    slots: n_slots,
                    train,
                    eval,
                    micro,
                },
            constants,
            profiling,
            profile,
            device_clock,
            rank,
            model_rank,
            measured,
            accumulated,
            train_outputs,
            loss_scale,
        } = self;
        let mut tally = Tally::default();
        // Bytes and category of the value in each slot, for freeing.
        let mut held: Vec<(bool, u64)> = vec![(false, 0); *n_slots];
        let plan = match mode {
            Mode::Train => &*train,
            Mode::Eval => &*eval,
            Mode::Micro => &*micro,
        };
        let ctx = KernelCtx {
            step,
            training: mode != Mode::Eval,
            rank: *rank,
            model_rank: *model_rank,
        };
        let mut slots: Vec<Slot<'_, B>> = (0..*n_slots).map(|_| Slot::Empty).collect();
        let mut out = StepOutputs {
            loss: None,
            grads: Vec::new(),
            outputs: Vec::new(),
            sent: Vec::new(),
            assigned: Vec::new(),
        };
        for st in plan {
            let node = &nodes[st.node];
            let kernel_err = |message: String| RuntimeError::Kernel {
                node: node.id.to_string(),
                op: node.op.mnemonic(),
                message,
            };
            let backend_err = |e: KernelError| device_err(node, e);
            for u in &st.uses {
                if matches!(slots[u.slot], Slot::Pending(..)) {
                    if let Slot::Pending(p, from) =
                        std::mem::replace(&mut slots[u.slot], Slot::Empty)
                    {
                        let v = backend
                            .from_host(Some((from, 0)), p.wait()?)
                            .map_err(backend_err)?;
                        slots[u.slot] = Slot::Owned(v);
                    }
                }
            }
            match &node.op {
                Op::Recv { stage, tag, ty } => {
                    let v = received.remove(tag).ok_or_else(|| {
                        kernel_err(format!(
                            "stage {stage} sent nothing named `{tag}` for this micro-batch"
                        ))
                    })?;
                    let got = match &v {
                        Message::Host(v) => v.value_type(),
                        Message::Device(v) => B::value_type(v),
                    };
                    if !fits(&got, &ValueType::Tensor(ty.clone())) {
                        return Err(kernel_err(format!(
                            "stage {stage} sent `{tag}` as {got}, the graph says {ty}"
                        )));
                    }
                    if let (Some(&(slot, _)), Some(true)) = (node.outputs.first(), st.keep.first())
                    {
                        let v = match v {
                            Message::Host(v) => backend
                                .from_host(Some((node.id, 0)), v)
                                .map_err(backend_err)?,
                            Message::Device(v) => v,
                        };
                        let bytes = B::value_bytes(&v);
                        held[slot] = (false, bytes);
                        tally.add(false, bytes);
                        slots[slot] = Slot::Owned(v);
                    }
                    continue;
                }
                Op::Send { stage, tag } => {
                    let u = st
                        .uses
                        .first()
                        .ok_or_else(|| kernel_err("a send needs one input".into()))?;
                    let v = take(backend, &mut slots, u).map_err(backend_err)?;
                    tally.free_released(&mut held, &st.uses);
                    out.sent.push((*stage, tag.clone(), v));
                    continue;
                }
                _ => {}
            }
            let started = Instant::now();
            let no_comm = || {
                kernel_err("moves data between workers or servers: run the plan with `distc run`, which connects them".into())
            };
            let communicated = match (&node.op, comm.as_deref_mut()) {
                (Op::Pull { var, shards, .. }, Some(c)) => {
                    let t = c.pull(var, shards, step)?;
                    Some(Slot::Owned(
                        backend
                            .from_host(Some((node.id, 0)), Value::Tensor(t))
                            .map_err(backend_err)?,
                    ))
                }
                (Op::SparsePull { var, shards, .. }, Some(c)) => {
                    let ids = read(
                        &slots,
                        st.uses.first().ok_or_else(|| kernel_err("no ids".into()))?,
                    )
                    .map_err(kernel_err)?;
                    let ids = backend.host_tensor(ids).map_err(backend_err)?;
                    let rows = c.sparse_pull(var, shards, &ids, step)?;
                    drop(ids);
                    release(&mut slots, &st.uses);
                    Some(Slot::Owned(
                        backend
                            .from_host(Some((node.id, 0)), Value::Tensor(rows))
                            .map_err(backend_err)?,
                    ))
                }
                (Op::Push { var, shards } | Op::SparsePush { var, shards }, Some(c)) => {
                    let v = take(
                        backend,
                        &mut slots,
                        st.uses
                            .first()
                            .ok_or_else(|| kernel_err("no gradient".into()))?,
                    )
                    .map_err(backend_err)?;
                    c.push(var, shards, backend.to_host(v).map_err(backend_err)?, step)?;
                    Some(Slot::Empty)
                }
                (
                    op @ (Op::AllReduce { .. }
                    | Op::AllGather { .. }
                    | Op::Broadcast { .. }
                    | Op::ReduceScatter { .. }
                    | Op::AllGatherDense { .. }
                    | Op::ModelAllReduce { .. }
                    | Op::ModelGather { .. }
                    | Op::ModelReduceScatter { .. }),
                    Some(c),
                ) => {
                    let v = take(
                        backend,
                        &mut slots,
                        st.uses
                            .first()
                            .ok_or_else(|| kernel_err("no input".into()))?,
                    )
                    .map_err(backend_err)?;
                    match backend
                        .start_collective(node.id, op, v)
                        .map_err(backend_err)?
                    {
                        Started::Device(v) => Some(Slot::Owned(v)),
                        Started::Host(v) => {
                            let v = backend.to_host(v).map_err(backend_err)?;
                            Some(Slot::Pending(
                                c.start_collective(node.id, op, v, step)?,
                                node.id,
                            ))
                        }
                    }
                }
                (
                    Op::Pull { .. }
                    | Op::SparsePull { .. }
                    | Op::Push { .. }
                    | Op::SparsePush { .. },
                    None,
                ) => return Err(no_comm()),
                (
                    Op::AllReduce { .. }
                    | Op::AllGather { .. }
                    | Op::Broadcast { .. }
                    | Op::ReduceScatter { .. }
                    | Op::AllGatherDense { .. }
                    | Op::ModelAllReduce { .. }
                    | Op::ModelGather { .. }
                    | Op::ModelReduceScatter { .. },
                    None,
                ) => return Err(no_comm()),
                _ => None,
            };
            if let Some(slot) = communicated {
                if let (Some(&(out, ref ty)), Some(true)) = (node.outputs.first(), st.keep.first())
                {
                    let bytes = match &slot {
                        Slot::Owned(v) => B::value_bytes(v),
                        _ => type_bytes(ty),
                    };
                    let comm = is_comm_buffer(&node.op);
                    held[out] = (comm, bytes);
                    tally.add(comm, bytes);
                    slots[out] = slot;
                }
                tally.free_released(&mut held, &st.uses);
                if let Some(c) = comm.as_deref_mut() {
                    c.span(node.id, node.op.mnemonic(), started, Instant::now());
                }
                continue;
            }
            let source = match &node.op {
                Op::Input { name, ty } => {
                    let t = feeds
                        .get(name)
                        .or_else(|| loss_scale.as_ref().filter(|_| name == LOSS_SCALE))
                        .ok_or_else(|| RuntimeError::MissingInput(name.clone()))?;
                    check_type::<B>(t, ty, || format!("input `{name}`: fed"))?;
                    Some(t)
                }
                Op::Param { name, ty, .. } => {
                    let t = params
                        .get(name)
                        .ok_or_else(|| RuntimeError::MissingParam(name.clone()))?;
                    check_type::<B>(t, ty, || format!("variable `{name}`: holds"))?;
                    Some(t)
                }
                Op::Constant { .. } => Some(
                    constants[st.node]
                        .as_ref()
                        .ok_or_else(|| kernel_err("constant not built".into()))?,
                ),
                _ => None,
            };
            if let Some(t) = source {
                if let (Some(&(slot, _)), Some(true)) = (node.outputs.first(), st.keep.first()) {
                    slots[slot] = Slot::Borrowed(t);
                }
                continue;
            }
            let first = || {
                st.uses
                    .first()
                    .ok_or_else(|| kernel_err("a sink needs one input, it has none".into()))
            };
            match &node.op {
                Op::Loss => {
                    let v = read(&slots, first()?).map_err(kernel_err)?;
                    out.loss = backend.read_scalar(v).map_err(backend_err)?;
                    release(&mut slots, &st.uses);
                    tally.free_released(&mut held, &st.uses);
                }
                Op::Accumulate { micro } => {
                    let v = take(backend, &mut slots, first()?).map_err(backend_err)?;
                    tally.free_released(&mut held, &st.uses);
                    let sum = backend
                        .accumulate(node.id, accumulated.remove(&st.node), v, *micro)
                        .map_err(backend_err)?;
                    if mode == Mode::Micro {
                        accumulated.insert(st.node, sum);
                    } else if let (Some(&(slot, _)), Some(true)) =
                        (node.outputs.first(), st.keep.first())
                    {
                        let mean = backend
                            .accumulated(node.id, sum, *micro)
                            .map_err(backend_err)?;
                        let bytes = B::value_bytes(&mean);
                        held[slot] = (false, bytes);
                        tally.add(false, bytes);
                        slots[slot] = Slot::Owned(mean);
                    }
                }
                Op::ParamGrad { param } => {
                    let v = take(backend, &mut slots, first()?).map_err(backend_err)?;
                    tally.gradients += B::value_bytes(&v);
                    tally.free_released(&mut held, &st.uses);
                    out.grads.push((param.clone(), v));
                }
                Op::Assign { param } => {
                    let v = take(backend, &mut slots, first()?).map_err(backend_err)?;
                    tally.free_released(&mut held, &st.uses);
                    out.assigned.push((param.clone(), v));
                }
                Op::Output { .. } if mode != Mode::Eval && !*train_outputs => {
                    release(&mut slots, &st.uses);
                    tally.free_released(&mut held, &st.uses);
                }
                Op::Output { name } => {
                    tally.free_released(&mut held, &st.uses);
                    let v = take(backend, &mut slots, first()?).map_err(backend_err)?;
                    let v = match backend.to_host(v).map_err(backend_err)? {
                        Value::Tensor(t) => t,
                        Value::Slices(s) => s.to_dense().map_err(kernel_err)?,
                    };
                    out.outputs.push((name.clone(), v));
                }
                op => {
                    let args = args(&mut slots, &st.uses).map_err(kernel_err)?;
                    let start = profiling.then(Instant::now);
                    let clock = device_clock.as_mut().filter(|c| c.origin.is_some());
                    if clock.is_some() {
                        backend.mark().map_err(backend_err)?;
                    }
                    let results = backend.eval(node.id, op, args, &ctx).map_err(backend_err)?;
                    if let Some(c) = clock {
                        backend.mark().map_err(backend_err)?;
                        c.timed.push(node.id);
                    }
                    if let Some(start) = start {
                        // A device backend only queued the kernels: wait for them, so
                        // the time is the kernels' (a no-op on the CPU).
                        backend.synchronize().map_err(backend_err)?;
                        let e = profile.entry(op.mnemonic()).or_default();
                        e.0 += start.elapsed();
                        e.1 += 1;
                    }
                    release(&mut slots, &st.uses);
                    if let Some(c) = comm.as_deref_mut() {
                        c.span(node.id, op.mnemonic(), started, Instant::now());
                    }
                    if results.len() != node.outputs.len() {
                        return Err(kernel_err(format!(
                            "the kernel gave {} results for {} outputs",
                            results.len(),
                            node.outputs.len()
                        )));
                    }
                    let comm_buffer = is_comm_buffer(op);
                    for ((v, (slot, ty)), &keep) in
                        results.into_iter().zip(&node.outputs).zip(&st.keep)
                    {
                        let got = B::value_type(&v);
                        if !fits(&got, ty) {
                            return Err(kernel_err(format!(
                                "the kernel gave {got}, the graph says {ty}"
                            )));
                        }
                        if keep {
                            let bytes = B::value_bytes(&v);
                            held[*slot] = (comm_buffer, bytes);
                            tally.add(comm_buffer, bytes);
                            slots[*slot] = Slot::Owned(v);
                        }
                    }
                    tally.free_released(&mut held, &st.uses);
                }
            }
        }
        *measured = tally.result();
        Ok(out)
    }

    /// What the last run held at its peak (see [`MemoryUse`]).
    pub fn measured_memory(&self) -> MemoryUse {
        self.measured
    }

    /// The schedule it runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Sets the worker's rank among equal-batch workers (0 by default), which places
    /// its samples in the global batch for per-sample dropout masks.
    pub fn set_rank(&mut self, rank: usize) {
        self.rank = rank;
    }

    /// Sets the loss scale the backward pass starts from (input `loss_scale`, fp16).
    pub fn set_loss_scale(&mut self, scale: f64) -> Result<()> {
        let t = Tensor::F32(ndarray::ArrayD::from_elem(
            ndarray::IxDyn(&[]),
            scale as f32,
        ));
        let name = self.backend.name();
        let t = self
            .backend
            .upload(LOSS_SCALE, t)
            .map_err(|e| backend_error(&name, "uploading the loss scale", e))?;
        self.loss_scale = Some(t);
        Ok(())
    }

    /// Sets the worker's rank on the model axis of a mesh: which shard a
    /// `model_split` takes.
    pub fn set_model_rank(&mut self, rank: usize) {
        self.model_rank = rank;
    }

    /// Whether a training run reads its `output` sinks (on by default; evaluation
    /// always does). Off, a training step returns no outputs and a device backend
    /// copies nothing back for them.
    pub fn set_train_outputs(&mut self, on: bool) {
        self.train_outputs = on;
    }

    /// Turns per-op timing on or off (off by default; it costs two clock reads a node).
    pub fn set_profiling(&mut self, on: bool) {
        self.profiling = on;
    }

    /// Times each op of a step on the device, where the backend runs asynchronously
    /// (see [`Executor::begin_device_step`]); returns whether it will.
    pub fn set_device_clock(&mut self, on: bool) -> bool {
        let on = on && self.backend.runs_asynchronously();
        self.device_clock = on.then(DeviceClock::default);
        on
    }

    /// Whether each op of a step is timed on the device.
    pub fn device_clock(&self) -> bool {
        self.device_clock.is_some()
    }

    /// Starts a step timed on the device: waits for the device to be idle and marks
    /// it, so that the mark's time is the host's now. A no-op without the clock.
    pub fn begin_device_step(&mut self) -> Result<()> {
        let Some(clock) = self.device_clock.as_mut() else {
            return Ok(());
        };
        let name = self.backend.name();
        let err = |e| backend_error(&name, "timing the step on the device", e);
        self.backend.synchronize().map_err(err)?;
        self.backend.mark().map_err(err)?;
        clock.origin = Some(Instant::now());
        clock.timed.clear();
        Ok(())
    }

    /// The ops run since [`Executor::begin_device_step`], as the device ran them:
    /// `(node, start, end)` in the host's clock, in the order they ran. Waits for the
    /// device. `None` without the clock or a step begun.
    pub fn device_spans(&mut self) -> Result<Option<Vec<(NodeId, Instant, Instant)>>> {
        let Some(clock) = self.device_clock.as_mut() else {
            return Ok(None);
        };
        let Some(origin) = clock.origin.take() else {
            return Ok(None);
        };
        let name = self.backend.name();
        let times = self
            .backend
            .mark_times()
            .map_err(|e| backend_error(&name, "reading the device's time marks", e))?;
        // The step's first mark, then a pair a timed op.
        if times.len() != 1 + 2 * clock.timed.len() {
            return Err(RuntimeError::Internal {
                at: format!("{name}'s step timing"),
                message: format!(
                    "{} time marks for {} timed ops",
                    times.len(),
                    clock.timed.len()
                ),
            });
        }
        let at = |s: f64| origin + Duration::from_secs_f64(s.max(0.0));
        Ok(Some(
            clock
                .timed
                .drain(..)
                .zip(times[1..].chunks(2))
                .map(|(node, t)| (node, at(t[0]), at(t[1])))
                .collect(),
        ))
    }

    /// Accumulated kernel time per op mnemonic since the last reset: `(op, total time,
    /// calls)`, the most expensive first. Empty unless profiling is on.
    pub fn profile(&self) -> Vec<(&'static str, Duration, u64)> {
        let mut v: Vec<_> = self
            .profile
            .iter()
            .map(|(k, (d, n))| (*k, *d, *n))
            .collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v
    }

    /// Clears the accumulated profile.
    pub fn reset_profile(&mut self) {
        self.profile.clear();
    }
}

/// A step's ops as the device ran them: the first mark's host time, then a pair of
/// marks an op.
#[derive(Default)]
struct DeviceClock {
    origin: Option<Instant>,
    timed: Vec<NodeId>,
}

/// A backend's error at `node`: an invalid input is a kernel error, a device failure
/// keeps its cause.
fn device_err(node: &Node, e: KernelError) -> RuntimeError {
    match e {
        KernelError::Invalid(message) => RuntimeError::Kernel {
            node: node.id.to_string(),
            op: node.op.mnemonic(),
            message,
        },
        KernelError::Device(source) => RuntimeError::Device {
            node: node.id.to_string(),
            op: node.op.mnemonic(),
            source,
        },
    }
}

/// Errors unless `t` has type `ty`; `what` starts the message (`input `x`: fed`).
fn check_type<B: Backend>(t: &B::Tensor, ty: &TensorType, what: impl Fn() -> String) -> Result<()> {
    let got = B::tensor_type(t);
    if got.dtype == ty.dtype && got.dims() == ty.dims() {
        return Ok(());
    }
    // Data sources and states are checked against the model when opened: what reaches
    // here disagrees with the plan's own types.
    Err(RuntimeError::plan(format!(
        "{} {got}, the graph needs {ty}",
        what()
    )))
}

/// The inputs of one kernel on backend `B`.
type KernelArgs<'s, B> = Vec<BackendArg<'s, <B as Device>::Value, <B as Device>::Tensor>>;

/// The kernel arguments: values at their last use are moved out of their slots,
/// the others borrowed.
fn args<'s, 'a: 's, B: Backend>(
    slots: &'s mut [Slot<'a, B>],
    uses: &[Use],
) -> std::result::Result<KernelArgs<'s, B>, String> {
    let mut owned: Vec<Option<B::Value>> = Vec::with_capacity(uses.len());
    for u in uses {
        owned.push(match (u.take, &slots[u.slot]) {
            (true, Slot::Owned(_)) => match std::mem::replace(&mut slots[u.slot], Slot::Empty) {
                Slot::Owned(v) => Some(v),
                _ => None,
            },
            _ => None,
        });
    }
    let slots: &'s [Slot<'a, B>] = slots;
    uses.iter()
        .zip(owned)
        .map(|(u, o)| match (o, &slots[u.slot]) {
            (Some(v), _) => Ok(BackendArg::Owned(v)),
            (None, Slot::Owned(v)) => Ok(BackendArg::Borrowed(v)),
            (None, Slot::Borrowed(t)) => Ok(BackendArg::BorrowedTensor(*t)),
            (None, Slot::Empty | Slot::Pending(..)) => {
                Err(format!("input slot {} is empty (executor bug)", u.slot))
            }
        })
        .collect()
}

/// Empties the slots whose last use this was.
fn release<B: Backend>(slots: &mut [Slot<'_, B>], uses: &[Use]) {
    for u in uses {
        if u.release {
            slots[u.slot] = Slot::Empty;
        }
    }
}

/// The value of a sink's input, by reference.
fn read<'s, B: Backend>(
    slots: &'s [Slot<'_, B>],
    u: &Use,
) -> std::result::Result<ValueRef<'s, B::Value, B::Tensor>, String> {
    match &slots[u.slot] {
        Slot::Owned(v) => Ok(ValueRef::Value(v)),
        Slot::Borrowed(t) => Ok(ValueRef::Tensor(*t)),
        Slot::Empty | Slot::Pending(..) => {
            Err(format!("input slot {} is empty (executor bug)", u.slot))
        }
    }
}

/// The value of a sink's input, owned: moved at its last use, copied otherwise.
fn take<B: Backend>(
    backend: &mut B,
    slots: &mut [Slot<'_, B>],
    u: &Use,
) -> std::result::Result<B::Value, KernelError> {
    let empty = || KernelError::Invalid(format!("input slot {} is empty (executor bug)", u.slot));
    let v = if u.take {
        match std::mem::replace(&mut slots[u.slot], Slot::Empty) {
            Slot::Owned(v) => v,
            Slot::Borrowed(t) => backend.copy_tensor(t)?,
            Slot::Empty | Slot::Pending(..) => return Err(empty()),
        }
    } else {
        match &slots[u.slot] {
            Slot::Owned(v) => backend.copy_value(v)?,
            Slot::Borrowed(t) => backend.copy_tensor(t)?,
            Slot::Empty | Slot::Pending(..) => return Err(empty()),
        }
    };
    release(slots, std::slice::from_ref(u));
    Ok(v)
}

/// Whether a kernel's result fits the type the IR gives it: equal, except that
/// `IndexedSlices` may carry fewer rows than the type's bound (after `unique_rows`).
fn fits(got: &ValueType, ty: &ValueType) -> bool {
    match (got, ty) {
        (
            ValueType::IndexedSlices { dense: a, nnz: n },
            ValueType::IndexedSlices {
                dense: b,
                nnz: bound,
            },
        ) => a == b && n <= bound,
        _ => got == ty,
    }
}
