//! Where a plan's kernels run. The [`Executor`](crate::core::exec::Executor) computes what
//! is independent of any device once (the [`Schedule`](crate::core::schedule::Schedule): order,
//! slots, last uses) and its run loop is generic over a [`Backend`], which owns the
//! buffers: the CPU backend ([`Cpu`]) holds host ndarrays, a GPU backend device
//! memory.
//!
//! A backend also owns the variables and the optimizer state between steps (its
//! [`Backend::Tensor`] values and [`Backend::Optimizer`]), so a device step copies only
//! the batch in ([`Backend::upload`]) and the loss out. A backend with its own
//! communicator (the CUDA backend with NCCL) runs collectives on its buffers
//! ([`Backend::start_collective`]); otherwise, and for pushes and pulls, the executor
//! moves a value to the host before a collective or a push and back after a pull
//! ([`Backend::to_host`], [`Backend::from_host`]); on the CPU backend both are moves,
//! not copies.

use crate::core::config::{LrSchedule, OptimizerSpec};
use crate::core::error::RuntimeError;
use crate::core::schedule::Schedule;
use crate::core::value::{ByteCount, Tensor, Value};
use distc_ir::{DType, NodeId, Op, TensorType, ValueType};
use std::borrow::Cow;
use std::collections::HashMap;
use thiserror::Error;

/// The largest magnitude a gradient may hold, by name, as it reaches the update and
/// before it is unscaled: at or beyond it the step overflowed (fp16: one device's
/// 16-bit gradient of the whole batch would not fit, though this worker's part did).
/// A gradient not named need only be finite.
pub type OverflowBounds = HashMap<String, f64>;

/// Why a kernel failed: inputs it cannot work on (a pass bug or a hand-edited plan),
/// or the device (a driver call, a kernel NVRTC refused).
#[derive(Debug, Error)]
pub enum KernelError {
    /// The kernel rejected its inputs.
    #[error("{0}")]
    Invalid(String),
    /// The device failed (its own error, boxed: the core knows no device's types).
    #[error(transparent)]
    Device(Box<dyn std::error::Error + Send + Sync>),
}

impl From<String> for KernelError {
    fn from(m: String) -> KernelError {
        KernelError::Invalid(m)
    }
}

/// One input of a kernel on backend `B`: owned (its buffer may be reused), borrowed
/// from a slot, or a borrowed variable, feed or constant.
pub enum BackendArg<'a, V, T> {
    /// A value nothing reads after this kernel.
    Owned(V),
    /// A value read again later.
    Borrowed(&'a V),
    /// A variable, feed or constant.
    BorrowedTensor(&'a T),
}

/// A value a sink reads, by reference.
pub enum ValueRef<'s, V, T> {
    /// A computed value.
    Value(&'s V),
    /// A variable, feed or constant.
    Tensor(&'s T),
}

/// What a kernel may know about the step it runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelCtx {
    /// The training step (dropout masks depend on it).
    pub step: u64,
    /// Training (dropout active) or evaluation (dropout is the identity).
    pub training: bool,
    /// This worker's rank and the number of workers: a per-sample dropout mask indexes
    /// an element by its position in the global batch, rank `r`'s rows after those of
    /// ranks `0..r` (equal batches per worker).
    pub rank: usize,
    /// This worker's rank on the model axis of a mesh (tensor parallelism's shards).
    pub model_rank: usize,
}

/// The buffers of a device: what every family is over.
pub trait Device {
    /// A computed value in an executor slot: a tensor or `IndexedSlices`.
    type Value: Send;
    /// A dense tensor the backend holds across steps: variables, feeds, constants.
    type Tensor;

    /// The backend's name, for messages (`cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// The device in words, for a run's summary: the CPU with its vector width and
    /// threads, the GPU's name, or the emulator.
    fn describe(&self) -> String {
        self.name()
    }
    /// The IR type of a value (slices at their actual row count).
    fn value_type(v: &Self::Value) -> ValueType;
    /// Bytes a value holds, as the memory accounting counts them.
    fn value_bytes(v: &Self::Value) -> u64;
    /// The IR type of a tensor.
    fn tensor_type(t: &Self::Tensor) -> TensorType;
}

/// What a backend is made for: a worker of the mesh and the program it will run on
/// that backend (the worker program, or a pipeline stage's forward or backward). A
/// device backend compiles its kernels for `program`.
#[derive(Clone, Copy, Debug)]
pub struct Site<'g> {
    /// The worker (its rank in the plan's mesh).
    pub worker: usize,
    /// The program the backend runs.
    pub program: &'g distc_ir::Graph,
    /// The program that will run beside it on the same device (a pipeline stage's
    /// forward, beside its backward: [`Kernels::beside`]), whose
    /// collectives the backend's communicators must serve too.
    pub beside: Option<&'g distc_ir::Graph>,
}

impl<'g> Site<'g> {
    /// The worker program `program` of worker `worker`, alone on its device.
    pub fn of(worker: usize, program: &'g distc_ir::Graph) -> Site<'g> {
        Site {
            worker,
            program,
            beside: None,
        }
    }

    /// Its program, and the one beside it.
    pub fn programs(&self) -> impl Iterator<Item = &'g distc_ir::Graph> {
        std::iter::once(self.program).chain(self.beside)
    }
}

/// Running the ops of a plan.
pub trait Kernels: Device {
    /// A backend for another program of the same worker, on this one's device: each
    /// one's variables and feeds are the other's to read (a pipeline stage's forward
    /// beside its backward). `None`: this backend has no such sharing, and the caller
    /// makes a second backend its own way (on the CPU, tensors are shared anyway).
    fn beside(&mut self, _program: &distc_ir::Graph) -> Result<Option<Self>, KernelError>
    where
        Self: Sized,
    {
        Ok(None)
    }

    /// Called once with the schedule the executor will run, before any kernel: a
    /// device backend plans its memory and compiles its kernels here.
    fn prepare(&mut self, _schedule: &Schedule) -> Result<(), KernelError> {
        Ok(())
    }

    /// Runs the kernel of `op` (node `node`) on `args`: one value per output port.
    fn eval(
        &mut self,
        node: NodeId,
        op: &Op,
        args: Vec<BackendArg<'_, Self::Value, Self::Tensor>>,
        ctx: &KernelCtx,
    ) -> Result<Vec<Self::Value>, KernelError>;

    /// A tensor of type `ty` with every element `value` (a `constant` node).
    fn filled(&mut self, ty: &TensorType, value: f64) -> Result<Self::Tensor, KernelError>;
    /// A computed value holding a copy of a tensor.
    fn copy_tensor(&mut self, t: &Self::Tensor) -> Result<Self::Value, KernelError>;
    /// A copy of a computed value.
    fn copy_value(&mut self, v: &Self::Value) -> Result<Self::Value, KernelError>;
    /// One micro-batch's `value` into the running sum of the `accumulate` node `node`
    /// (over `micro` micro-batches); `sum` is what this step's earlier micro-batches
    /// gave, `None` on its first. Slices: rows concatenated, in micro-batch order.
    fn accumulate(
        &mut self,
        node: NodeId,
        sum: Option<Self::Value>,
        value: Self::Value,
        micro: usize,
    ) -> Result<Self::Value, KernelError>;
    /// The step's gradient from the running sum after its last micro-batch: the mean.
    fn accumulated(
        &mut self,
        node: NodeId,
        sum: Self::Value,
        micro: usize,
    ) -> Result<Self::Value, KernelError>;
    /// Sets the step the next kernels see (dropout masks, Adam's bias correction). A
    /// device backend keeps it in device memory, so a replayed graph reads the new one.
    fn set_step(&mut self, _step: u64) -> Result<(), KernelError> {
        Ok(())
    }
}

/// Moving values between the host and the device.
pub trait Transfer: Device {
    /// Moves host tensor `name` to the backend (a feed of the batch, an initial
    /// variable); a device backend copies each name into the same buffer every step.
    fn upload(&mut self, name: &str, t: Tensor) -> Result<Self::Tensor, KernelError>;
    /// Copies a tensor back to the host.
    fn download(&mut self, t: &Self::Tensor) -> Result<Tensor, KernelError>;
    /// Moves a computed value to the host (before a collective or a push).
    fn to_host(&mut self, v: Self::Value) -> Result<Value, KernelError>;
    /// Moves a host value to the backend (after a collective or a pull).
    // Named as the pair of `to_host`; it takes `self` because the backend owns the
    // memory the value moves into.
    #[allow(clippy::wrong_self_convention)]
    /// `at` is the node output the value becomes (a device backend writes it into
    /// that output's planned buffer, so a step allocates nothing).
    fn from_host(
        &mut self,
        at: Option<(NodeId, usize)>,
        v: Value,
    ) -> Result<Self::Value, KernelError>;
    /// A sink's input as a host tensor (ids for a sparse pull), borrowed where it
    /// already is one.
    fn host_tensor<'s>(
        &mut self,
        v: ValueRef<'s, Self::Value, Self::Tensor>,
    ) -> Result<Cow<'s, Tensor>, KernelError>;
    /// The scalar a `loss` sink reads. `None` when the value is not on the host yet (a
    /// device step being captured into a graph): [`Transfer::pending_scalar`] has it
    /// once the step is done.
    fn read_scalar(
        &mut self,
        v: ValueRef<'_, Self::Value, Self::Tensor>,
    ) -> Result<Option<f64>, KernelError> {
        Ok(self.host_tensor(v)?.scalar_f64())
    }
    /// The scalar [`Transfer::read_scalar`] deferred: the loss of the oldest replay
    /// not read yet ([`Capture::replay`]), waiting for that replay alone.
    fn pending_scalar(&mut self) -> Result<Option<f64>, KernelError> {
        Ok(None)
    }
    /// Keeps a preloaded batch in the backend's own memory for [`Transfer::feed_held`]:
    /// its id, or `None` where holding gains nothing (the CPU's tensors are host
    /// memory already).
    fn hold_batch(
        &mut self,
        _batch: &HashMap<String, Tensor>,
    ) -> Result<Option<usize>, KernelError> {
        Ok(None)
    }
    /// The feeds of held batch `id`, copied into the buffers [`Transfer::upload`]
    /// fills (so a captured graph reads them), without crossing from the host.
    fn feed_held(&mut self, id: usize) -> Result<HashMap<String, Self::Tensor>, KernelError> {
        Err(KernelError::Invalid(format!(
            "this backend holds no batches (batch {id} asked for)"
        )))
    }
    /// Moves a tensor the backend holds to the host (a copy on a device; a move on
    /// the CPU).
    fn move_to_host(&mut self, t: Self::Tensor) -> Result<Tensor, KernelError> {
        self.download(&t)
    }
    /// Waits until everything issued has finished (for timing a step); a no-op on a
    /// backend that runs synchronously.
    fn synchronize(&mut self) -> Result<(), KernelError> {
        Ok(())
    }
    /// Whether the device runs what is issued after the host has moved on, so that a
    /// host clock times launches, not kernels: a trace then times each op between
    /// two [`Transfer::mark`]s on the device (a GPU's events on its stream).
    fn runs_asynchronously(&self) -> bool {
        false
    }
    /// Records a time mark on the device, after the work issued so far.
    fn mark(&mut self) -> Result<(), KernelError> {
        Ok(())
    }
    /// Waits for the device, and gives the seconds from the first mark recorded since
    /// the last call to each mark, in order; then forgets them.
    fn mark_times(&mut self) -> Result<Vec<f64>, KernelError> {
        Ok(Vec::new())
    }
    /// Bytes of device memory in use and at its peak, where the backend has its own
    /// memory (`None` on the host).
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
    /// The device this backend computes on and its peak rate for `products` (model
    /// FLOPs utilisation is measured against it); `None` where it is not known.
    fn peak_flops(&self, _products: DType) -> Option<crate::core::peak::DevicePeak> {
        None
    }
}

/// The optimizer state the backend holds beside the variables, and the update.
pub trait OptimizerState: Device {
    /// The optimizer state of the variables the backend holds.
    type Optimizer;

    /// The optimizer `spec` describes, for the variables `params`; the weight decay
    /// skips the variables `no_decay`; with `lazy`, a row-sparse gradient updates only
    /// its rows (`crate::cpu::optim`'s module doc).
    fn optimizer(
        &mut self,
        spec: &OptimizerSpec,
        no_decay: &[String],
        lazy: bool,
        params: &HashMap<String, Self::Tensor>,
    ) -> Result<Self::Optimizer, KernelError>;
    /// Applies one step's gradients to the variables.
    fn update(
        &mut self,
        opt: &mut Self::Optimizer,
        params: &mut HashMap<String, Self::Tensor>,
        grads: Vec<(String, Self::Value)>,
    ) -> Result<(), KernelError>;
    /// Writes each value over the variable it names, a frozen one no optimizer updates
    /// (batch norm's running statistics, from the step's `assign` sinks).
    fn assign(
        &mut self,
        params: &mut HashMap<String, Self::Tensor>,
        assigned: Vec<(String, Self::Value)>,
    ) -> Result<(), KernelError>;
    /// Makes the optimizer follow a learning-rate schedule over a run of `total`
    /// updates (from the update count it holds, so a resumed run goes on where it
    /// stopped). A constant schedule needs nothing.
    fn follow_schedule(
        &mut self,
        _opt: &mut Self::Optimizer,
        schedule: &LrSchedule,
        _total: u64,
    ) -> Result<(), KernelError> {
        if schedule.is_constant() {
            return Ok(());
        }
        Err(KernelError::Invalid(format!(
            "{} cannot follow a learning-rate schedule yet: train with an lr_schedule on \
             the CPU",
            self.name()
        )))
    }
    /// Multiplies every gradient by `factor` (the inverse of fp16's loss scale) and
    /// says whether every one was finite and, before scaling, below its bound in
    /// `bounds` (an overflowed step is skipped).
    fn unscale(
        &mut self,
        _grads: &mut [(String, Self::Value)],
        _factor: f64,
        _bounds: &OverflowBounds,
    ) -> Result<bool, KernelError> {
        Err(KernelError::Invalid(format!(
            "{} cannot scale the loss yet: train --precision fp16 on the CPU",
            self.name()
        )))
    }
    /// The sum of the squares of each gradient's elements (of the dense gradient a
    /// row-sparse one stands for), in f64: the parts of a gradient-norm clip.
    fn grad_squares(&mut self, _grads: &[(String, Self::Value)]) -> Result<Vec<f64>, KernelError> {
        Err(KernelError::Invalid(format!(
            "{} cannot clip gradients yet: train with `clip_norm` on the CPU",
            self.name()
        )))
    }
    /// Bytes of optimizer state.
    fn optimizer_bytes(opt: &Self::Optimizer) -> u64;
    /// The learning rate the next update uses (after warm-up, decay and scaling), where
    /// the backend's optimizer keeps it; `ahead` updates were issued already and are
    /// not that one (a CUDA graph's replay issued behind the previous step's).
    fn learning_rate(_opt: &Self::Optimizer, _ahead: u64) -> Option<f64> {
        None
    }
    /// Whether the optimizer may spread one update over threads (the CPU's, when
    /// cores are left over); a no-op elsewhere.
    fn parallel_updates(_opt: &mut Self::Optimizer, _on: bool) {}
    /// The optimizer state on the host, for a training state on disk: `VAR/SLOT`
    /// tensors and the step count (`VAR/SLOT` names, the CPU optimizer's).
    fn optimizer_state(
        &mut self,
        _opt: &Self::Optimizer,
    ) -> Result<Vec<(String, Tensor)>, KernelError> {
        Err(KernelError::Invalid(format!(
            "{} cannot write its optimizer state yet: train on the CPU to write a training state",
            self.name()
        )))
    }
    /// Loads a resumed optimizer state (names as [`OptimizerState::optimizer_state`]
    /// gives).
    fn load_optimizer_state(
        &mut self,
        _opt: &mut Self::Optimizer,
        _state: &HashMap<String, Tensor>,
    ) -> Result<(), KernelError> {
        Err(KernelError::Invalid(format!(
            "{} cannot resume an optimizer state yet: resume on the CPU",
            self.name()
        )))
    }
    /// The names of each variable's optimizer slots (`momentum`; Adam's `m`, `v`).
    fn optimizer_slots(opt: &Self::Optimizer) -> &'static [&'static str];
}

/// Recording a training step (its kernels and its update) into a graph and replaying
/// it. The worker loop captures a step after its warm-up steps when
/// [`Capture::can_capture`] says the step has no host round trip, then replays it.
pub trait Capture: Device {
    /// Whether a training step of `schedule` can be captured: the backend records
    /// graphs, and every collective the step makes runs on the device
    /// ([`DeviceCollectives`]); the worker loop also checks that the step neither
    /// pulls nor pushes. Default: no graphs.
    fn can_capture(&self, _schedule: &Schedule) -> bool {
        false
    }
    /// Starts recording everything issued (a step and its update) into a graph instead
    /// of running it, a step that reads at most `scalars` scalars (its micro-batches'
    /// losses: [`Transfer::pending_scalar`] gives their sum after each replay).
    /// `false`: this backend has no graphs, nothing changed.
    fn begin_capture(&mut self, _scalars: usize) -> Result<bool, KernelError> {
        Ok(false)
    }
    /// Ends the recording [`Capture::begin_capture`] started; the graph is kept.
    fn end_capture(&mut self) -> Result<(), KernelError> {
        Ok(())
    }
    /// Records into the capture a sibling on the same stream begins next
    /// ([`Kernels::beside`]): this backend's launches and collectives become part of
    /// that graph, and each scalar it reads ([`Transfer::read_scalar`], a pipeline
    /// stage's micro-batch losses, at most `scalars`) is kept on the device for
    /// [`Capture::replayed_scalars`]. `false`: no graphs, nothing changed.
    fn join_capture(&mut self, _scalars: usize) -> Result<bool, KernelError> {
        Ok(false)
    }
    /// Stops recording into the sibling's capture, before the sibling ends it.
    fn leave_capture(&mut self) -> Result<(), KernelError> {
        Ok(())
    }
    /// The scalars read while this backend was joined to a capture, as the last
    /// replay of that graph computed them (waits for it).
    fn replayed_scalars(&mut self) -> Result<Vec<f64>, KernelError> {
        Err(KernelError::Invalid(
            "this backend records no graphs".into(),
        ))
    }
    /// Issues the recorded graph once (after the batch was uploaded and the step set).
    /// Two replays may be in flight: the next step's is issued before this one's loss
    /// is read ([`Transfer::pending_scalar`], once per replay, in order).
    fn replay(&mut self) -> Result<(), KernelError> {
        Err(KernelError::Invalid(
            "this backend records no graphs".into(),
        ))
    }
    /// fp16 in a captured step: multiplies every gradient by the factor of the last
    /// [`Capture::set_unscale_factor`] (read at each replay) and, where one is not
    /// finite, makes the update that follows skip the step, all on the device. With
    /// `over_workers`, a worker whose gradients are parts (ZeRO chunks, model-axis
    /// parts) skips where any worker overflowed: the flags are summed over the
    /// workers of each axis the backend communicates on, on the device. Whether a
    /// replay skipped comes with its loss: [`Capture::replayed_finite`].
    fn unscale_on_device(
        &mut self,
        _grads: &mut [(String, Self::Value)],
        _over_workers: bool,
        _bounds: &OverflowBounds,
    ) -> Result<(), KernelError> {
        Err(KernelError::Invalid(
            "this backend records no graphs".into(),
        ))
    }
    /// The factor (the inverse of the loss scale) the next replays unscale by.
    fn set_unscale_factor(&mut self, _factor: f64) -> Result<(), KernelError> {
        Err(KernelError::Invalid(
            "this backend records no graphs".into(),
        ))
    }
    /// Whether the replay whose loss [`Transfer::pending_scalar`] last returned had
    /// finite gradients (and so made its update), for a step captured with
    /// [`Capture::unscale_on_device`]; `None` for other steps.
    fn replayed_finite(&mut self) -> Option<bool> {
        None
    }
}

/// Collectives on the device's own buffers, by the backend's own communicator.
pub trait DeviceCollectives: Device {
    /// Starts collective `op` (node `node`) on `v` with the backend's own communicator
    /// (NCCL on device buffers), when it has one for this op: the result is a value the
    /// backend orders its readers after, so the executor neither waits nor copies.
    /// [`Started::Host`] hands `v` back for the host path (the worker's communicator).
    fn start_collective(
        &mut self,
        _node: NodeId,
        _op: &Op,
        v: Self::Value,
    ) -> Result<Started<Self::Value>, KernelError> {
        Ok(Started::Host(v))
    }
    /// Whether [`DeviceCollectives::start_collective`] runs node `node`'s collective on
    /// the backend's own communicator (else it goes through the host).
    fn runs_collective(&self, _node: NodeId) -> bool {
        false
    }
    /// Payload bytes the backend's own communicator has sent and received, counted as
    /// the host communicators count them (cumulative).
    fn collective_bytes(&self) -> ByteCount {
        ByteCount::default()
    }
    /// Whether a pipeline stage's messages go device to device, on the backend's own
    /// communicator among the stages ([`DeviceCollectives::send_message`]); else the
    /// stage sends them through the host.
    fn sends_messages(&self) -> bool {
        false
    }
    /// Sends `values`, in this order, to stage `to` (one message), after the work
    /// issued so far: the values may be overwritten once the call returns.
    fn send_message(&mut self, to: usize, _values: &[&Self::Value]) -> Result<(), KernelError> {
        Err(KernelError::Invalid(format!(
            "this backend sends no messages to stage {to} itself"
        )))
    }
    /// Receives one message from stage `from`: values of the types `into` gives, in
    /// that order, each into the buffer named beside its type. A buffer is reused by
    /// the next message received under its name, so a name is per micro-batch.
    fn recv_message(
        &mut self,
        from: usize,
        _into: &[(String, TensorType)],
    ) -> Result<Vec<Self::Value>, KernelError> {
        Err(KernelError::Invalid(format!(
            "this backend receives no messages from stage {from} itself"
        )))
    }
    /// `v`, kept beyond the run that computed it under the buffer name `name` (a
    /// stage's stash, read by a later run): the value itself where the backend owns
    /// its values, a copy where the next run reuses their memory.
    fn keep(&mut self, _name: &str, v: Self::Value) -> Result<Self::Value, KernelError> {
        Ok(v)
    }
}

/// A device that runs a plan: every family. Implemented for whatever has them all.
pub trait Backend: Kernels + Transfer + OptimizerState + Capture + DeviceCollectives {}

impl<T: Kernels + Transfer + OptimizerState + Capture + DeviceCollectives> Backend for T {}

/// What [`Backend::start_collective`] did with a value.
pub enum Started<V> {
    /// Issued on the backend's communicator: the collective's result.
    Device(V),
    /// Not the backend's to run: the value, for the host communicator.
    Host(V),
}

/// A backend's error outside a node, naming the backend and what it was doing.
pub(crate) fn backend_error(device: &str, what: &str, e: KernelError) -> RuntimeError {
    RuntimeError::DeviceCall {
        device: device.to_string(),
        what: what.to_string(),
        message: e.to_string(),
    }
}

/// Uploads every tensor of `host` to `backend` (on the CPU: moved, not copied).
pub(crate) fn upload_all<B: Backend>(
    backend: &mut B,
    host: HashMap<String, Tensor>,
) -> Result<HashMap<String, B::Tensor>, RuntimeError> {
    upload_all_as(backend, host, |name| name.to_string())
}

/// [`upload_all`], each tensor held under the device name `as_named(name)` (a device
/// backend keeps one buffer per name), returned under its own.
pub(crate) fn upload_all_as<B: Backend>(
    backend: &mut B,
    host: HashMap<String, Tensor>,
    as_named: impl Fn(&str) -> String,
) -> Result<HashMap<String, B::Tensor>, RuntimeError> {
    let device = backend.name();
    host.into_iter()
        .map(|(name, t)| {
            let t = backend
                .upload(&as_named(&name), t)
                .map_err(|e| backend_error(&device, &format!("copying `{name}` in"), e))?;
            Ok((name, t))
        })
        .collect()
}

/// Uploads micro-batch m of `batches`, of K a step, into its own buffers (`x/micro1`
/// for feed `x` of the second), so a captured step reads each from where the next
/// steps put theirs; one micro-batch a step keeps the feeds' names.
pub(crate) fn upload_micro_batches<B: Backend>(
    backend: &mut B,
    batches: Vec<HashMap<String, Tensor>>,
    k: usize,
) -> Result<Vec<HashMap<String, B::Tensor>>, RuntimeError> {
    batches
        .into_iter()
        .enumerate()
        .map(|(m, b)| {
            if k == 1 {
                upload_all(backend, b)
            } else {
                upload_all_as(backend, b, |n| format!("{n}/micro{m}"))
            }
        })
        .collect()
}

/// Moves every tensor of `held` to the host (on the CPU: moved, not copied).
pub(crate) fn all_to_host<B: Backend>(
    backend: &mut B,
    held: HashMap<String, B::Tensor>,
) -> Result<HashMap<String, Tensor>, RuntimeError> {
    let device = backend.name();
    held.into_iter()
        .map(|(name, t)| {
            let t = backend
                .move_to_host(t)
                .map_err(|e| backend_error(&device, &format!("reading `{name}` back"), e))?;
            Ok((name, t))
        })
        .collect()
}
