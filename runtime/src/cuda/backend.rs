//! [`CudaBackend`]: the executor's [`Backend`] on one NVIDIA GPU, through cudarc.
//!
//! # What it does once
//!
//! [`CudaBackend::new`] probes the driver, cuBLAS and NVRTC (cudarc panics on a
//! missing library, so nothing calls into one before [`super::probe`] found it),
//! checks the GPU exists, creates the context and **one** stream, turns cudarc's
//! per-buffer event tracking off (everything is ordered on that one stream), generates
//! the plan's CUDA code ([`codegen::generate`]), compiles it with NVRTC to a CUBIN for
//! the device's own `sm_XY` and resolves every kernel once.
//!
//! [`Kernels::prepare`] makes the static memory plan: every value the training plan
//! computes and every node's scratch buffers get a fixed offset in one arena
//! ([`crate::core::arena::plan`]), allocated once. A [`Launch::Alias`] output (a reshape) is
//! its input's buffer: the chain shares the first buffer, which lives until the last
//! use of any member. Gradients live to the end of the plan, since the optimizer reads
//! them after the run. So a step allocates nothing, and a step can be captured into a
//! CUDA graph and replayed.
//!
//! # Values and tensors
//!
//! A computed value ([`DeviceValue`]) is a device address and its IR type: its bytes
//! belong to the arena (or to a persistent tensor, see below), not to the handle.
//! Values are immutable on this backend: every kernel writes only its own outputs and
//! scratch, never its inputs, so [`Kernels::copy_value`] and [`Kernels::copy_tensor`]
//! return a handle to the same bytes instead of copying (the executor only copies a
//! value a sink takes while a later node still reads it; the copy is read, never
//! written). An `IndexedSlices` value is the layout of [`codegen::SlicesLayout`], its
//! row count on the device; its handle carries the type's bound (the executor accepts
//! `nnz <=` the bound).
//!
//! The one exception is gradient accumulation: an `accumulate` node's output has its
//! own buffer outside the arena, cleared on a step's first micro-batch, and each
//! micro-batch adds its gradient (divided by the micro-batch count) into it
//! ([`Kernels::accumulate`]). Nothing reads it before the step's last micro-batch.
//!
//! A persistent tensor ([`DeviceTensor`]) is a variable, a feed or a constant, whose
//! memory the backend keeps: one buffer per `(name, bytes)` given to
//! [`Transfer::upload`], reused by every later upload of that name and size (so a
//! captured graph, which holds addresses, sees each step's batch), with a pinned host
//! staging buffer; constants from [`Kernels::filled`].
//!
//! # The step counters
//!
//! Two `u64`s in device memory: the step the node kernels see ([`KArg::Step`] of a
//! node, what the CPU's `KernelCtx::step` holds: set by [`Kernels::set_step`], or
//! by [`Kernels::eval`] when a run's step differs outside a capture) and the
//! optimizer's completed steps ([`KArg::Step`] of an update: Adam's `t - 1`, counted
//! by the backend). Both are written from pinned memory by one async copy, so a
//! replayed graph reads the current ones.
//!
//! # Graphs
//!
//! With [`CudaOptions::graphs`], [`Capture::begin_capture`] starts a stream capture;
//! the executor's run and the update are recorded (not run), the loss read becomes a
//! copy into a pinned slot ([`Transfer::read_scalar`] returns `None`,
//! [`Transfer::pending_scalar`] has it after each replay). Nothing may allocate,
//! upload or synchronize while capturing: those paths return an error instead.
//! [`Transfer::to_host`] (an `output` sink of the training plan) gives zeros of the
//! value's type while capturing: the captured step's outputs are not used.
//! A sibling on the same stream ([`Kernels::beside`], a pipeline stage's forward)
//! joins a capture the other begins ([`Capture::join_capture`]): its launches and
//! collectives become part of that graph, and each scalar it reads (a micro-batch's
//! loss) is copied into a device slot of its own, read back after each replay
//! ([`Capture::replayed_scalars`]). Stage messages (NCCL send and receive) are
//! captured in the schedule's order.
//!
//! # Not supported (clear errors)
//!
//! f64 graphs (gradient checks run on the CPU), CUDA graphs of a step whose
//! collectives run on the host or of a data-parallel step of several micro-batches
//! (the worker loop runs those eagerly). A step whose collectives all run on
//! NCCL is captured with them: the NCCL calls and their events become graph nodes,
//! and each replay adds the bytes the recorded collectives move.
//!
//! # Communication
//!
//! In a distributed plan's worker, [`Transfer::from_host`] writes a pulled or
//! host-reduced value into its node's planned buffer. With an NCCL communicator
//! ([`CudaBackend::attach_nccl`], [`super::nccl`]) the plan's collectives run on
//! device buffers on a second stream: [`DeviceCollectives::start_collective`] issues them after
//! an event on the compute stream, and every reader of a result (a kernel, a copy to
//! the host, the update) first makes the compute stream wait for the collective's
//! `done` event.

use super::codegen::SQUARE_BLOCKS;
use super::codegen::{
    self, CParam, DevicePlan, KArg, Launch, NodeLaunch, OptimizerPlan, VarUpdate,
};
use super::driver::{
    Access, ArgVal, CudarcDriver, DeviceComm, Driver, HostBuf, KernelHandle, KernelLaunch, Region,
};
use super::emu::blas::SgemmCall;
use super::nccl::NcclComm;
use super::{probe, CudaError, CudaLib, LibDirs};
use crate::comm::ByteCount;
use crate::core::arena::{self, Block};
use crate::core::axis::Axis;
use crate::core::backend::{
    BackendArg, Capture, Device, DeviceCollectives, KernelCtx, KernelError, Kernels,
    OptimizerState, OverflowBounds, Started, Transfer, ValueRef,
};
use crate::core::checkpoint::STEP_KEY;
use crate::core::config::{LrSchedule, OptimizerSpec};
use crate::core::peak::{datasheet_peak, DevicePeak, Products};
use crate::core::schedule::{Mode, Schedule};
use crate::core::value::{Slices, Tensor, Value};
use distc_ir::{DType, Graph, NodeId, Op, TensorType, ValueType};
use ndarray::{ArrayD, IxDyn};
use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Alignment of every buffer in the arena (cudaMalloc's own alignment).
const ALIGN: usize = 256;

/// The step counters' bytes in device memory: the nodes' step (u64), the optimizer's
/// (u64), the learning rate of its next update with AdamW's decay factor
/// (`codegen::Rate`, two f32), the skip flag the update kernels read
/// (`codegen::SKIP_STEP`, a u32 an overflowed fp16 step raises on the device) and
/// fp16's unscaling factor (f32), which the unscaling kernels read.
const STEPS_BYTES: usize = 32;
/// Where the skip flag and the unscaling factor lie in the counters.
const SKIP_AT: u64 = 24;
/// The node an all-reduce of the skip flag is issued as: no node of a plan.
const SKIP_FLAG_NODE: NodeId = NodeId(u32::MAX - 1);
const FACTOR_AT: u64 = 28;
/// The environment variable that runs the CUDA backend on the GPU emulator
/// ([`super::emu`]) instead of a GPU: `1` (anything but empty or `0`).
pub const EMULATOR_ENV: &str = "DISTC_CUDA_EMULATOR";

/// How the CUDA backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// cuBLAS products with TF32 tensor cores (faster, about 1e-3 relative error);
    /// off: plain fp32, as the CPU and PyTorch's default.
    pub tf32: bool,
    /// Capture a training step into a CUDA graph and replay it.
    pub graphs: bool,
    /// Run on the GPU emulator ([`super::emu::EmuDriver`]): the same kernels, copies,
    /// products and graphs, executed and checked on the CPU. Default: whether
    /// [`EMULATOR_ENV`] is set.
    pub emulator: bool,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            tf32: false,
            graphs: true,
            emulator: emulator_requested(),
        }
    }
}

/// Whether [`EMULATOR_ENV`] asks for the emulator.
pub fn emulator_requested() -> bool {
    std::env::var_os(EMULATOR_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// A computed value on the device: its address and IR type (bytes owned elsewhere).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceValue {
    /// The device address (`CUdeviceptr`).
    pub ptr: u64,
    /// The IR type (slices at their bound).
    pub ty: ValueType,
}

/// A persistent tensor on the device (variable, feed, constant): its memory is the
/// backend's.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceTensor {
    /// The device address (`CUdeviceptr`).
    pub ptr: u64,
    /// The IR type.
    pub ty: TensorType,
}

/// The optimizer state on the device: slots (zeroed once), one scratch buffer and the
/// compiled update kernels.
pub struct CudaOptimizer {
    funcs: HashMap<String, Kernel>,
    /// The learning rate and schedule, and the updates done (the backend's count).
    rate: codegen::Rate,
    done: Arc<AtomicU64>,
    vars: HashMap<String, VarState>,
    scratch_base: u64,
    slot_bytes: u64,
    slot_names: &'static [&'static str],
}

impl std::fmt::Debug for CudaOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaOptimizer")
            .field("vars", &self.vars.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish_non_exhaustive()
    }
}

struct VarState {
    /// The variable's type, which each of its slots has.
    ty: TensorType,
    update: VarUpdate,
    slot_ptrs: Vec<u64>,
    scratch_offsets: Vec<usize>,
}

/// fp16's unscaling on the device: the kernels (dense and slices gradients) and a
/// device `i32` they set on an infinity or a NaN.
struct Unscale {
    dense: String,
    slices: String,
    flag: u64,
}

/// A trained variable's 16-bit copy, which the forward pass reads in place of its cast.
/// The update writes it beside the variable, so a step casts nothing; the cast runs only
/// when the copy is not of the variable's current bytes (the first step, and after the
/// variable was written by an upload or an assign).
struct WeightCopy {
    ptr: u64,
    /// The variable's buffer the copy holds the cast of, when it is current.
    of: Option<u64>,
}

/// The gradient-norm kernel and its buffer of per-block partial sums (f64), made on a
/// clipped plan's first step.
struct GradNorm {
    kernel: String,
    partials: u64,
    /// Partials the buffer holds.
    capacity: usize,
}

/// One persistent named buffer and its pinned staging copy.
struct Named {
    ptr: u64,
    staging: HostBuf,
}

/// A feed of a batch held on the device ([`Transfer::hold_batch`]).
#[derive(Debug)]
struct HeldFeed {
    name: String,
    ptr: u64,
    ty: TensorType,
}

/// What the backend adds to the driver's [`ArgVal`].
trait ArgCheck: Sized {
    fn fits(self, p: CParam) -> bool;
    fn scalar(k: &KArg, ctx: &KernelCtx) -> Option<Result<Self, KernelError>>;
}

/// The context of a launch outside a node's kernels (optimizer updates, accumulation):
/// they take no rank and always train.
const OUTSIDE_NODES: KernelCtx = KernelCtx {
    step: 0,
    training: true,
    rank: 0,
    model_rank: 0,
};

impl ArgCheck for ArgVal {
    /// Whether this value is what a C parameter of class `p` takes (8 bytes for a
    /// pointer or a 64-bit integer; 4 bytes of the right kind otherwise).
    fn fits(self, p: CParam) -> bool {
        matches!(
            (self, p),
            (ArgVal::U64(_), CParam::Ptr | CParam::B64)
                | (ArgVal::I32(_), CParam::I32)
                | (ArgVal::U32(_), CParam::U32)
                | (ArgVal::F32(_), CParam::F32)
        )
    }

    /// A by-value argument (not a buffer) in its C type; `None` for a buffer.
    fn scalar(k: &KArg, ctx: &KernelCtx) -> Option<Result<ArgVal, KernelError>> {
        let rank = |r: usize| match u32::try_from(r) {
            Ok(r) => Ok(ArgVal::U32(r)),
            Err(_) => Err(invalid(format!("rank {r} exceeds u32"))),
        };
        Some(Ok(match k {
            KArg::Rank => return Some(rank(ctx.rank)),
            KArg::ModelRank => return Some(rank(ctx.model_rank)),
            KArg::Training => ArgVal::U32(u32::from(ctx.training)),
            KArg::I32(v) => ArgVal::I32(*v),
            KArg::U32(v) => ArgVal::U32(*v),
            KArg::F32(v) => ArgVal::F32(*v),
            KArg::U64(v) => ArgVal::U64(*v),
            KArg::Input(_)
            | KArg::Output(_)
            | KArg::Scratch(_)
            | KArg::Step
            | KArg::Param
            | KArg::Grad
            | KArg::Slot(_)
            | KArg::WeightCopy => return None,
        }))
    }
}

/// A loaded kernel and its C parameters' classes (checked at every launch).
struct Kernel {
    handle: KernelHandle,
    params: Vec<CParam>,
}

/// The CUDA backend: one GPU, one stream, a static arena (see the module doc).
pub struct CudaBackend {
    // Dropped first: the NCCL communicator before the driver whose device it uses
    // (fields drop in declaration order); the driver owns every buffer.
    /// Its NCCL communicators by axis ([`Axis::index`]), where the mesh has the axis
    /// and NCCL runs it: the data axis's collectives, the model axis's all-reduces and
    /// its gathers and reduce-scatters of contiguous parts, and a pipeline stage's
    /// messages among the stages (rank = stage, point-to-point on the compute stream).
    nccl: [Option<Box<dyn DeviceComm>>; 3],
    /// Results of NCCL collectives not yet waited for on the compute stream: the
    /// bytes `[start, end)` and the node.
    in_flight: Vec<(u64, u64, NodeId)>,
    funcs: HashMap<String, Kernel>,
    /// fp16's unscaling kernels and their overflow flag, when the graph scales its loss.
    unscale: Option<Unscale>,
    grad_norm: Option<GradNorm>,
    has_arena: bool,
    named: HashMap<(String, usize), Named>,
    /// Buffers of received and kept stage messages, by name and bytes (no staging:
    /// their bytes never cross the host).
    messages: HashMap<(String, usize), u64>,
    /// The step counters' pinned copy (two u64) and the loss's (one f32).
    steps_host: HostBuf,
    /// Pinned slots a replayed step's loss is copied into, used in turn, so that
    /// the next step can be replayed before this one's loss is read.
    loss_slots: [HostBuf; LOSS_SLOTS],
    /// Whether the device checks accesses: launches then carry their regions.
    checked: bool,

    ordinal: usize,
    device_name: String,
    arch: String,
    opts: CudaOptions,
    graph: Graph,
    plan: HashMap<NodeId, NodeLaunch>,
    arena_base: u64,
    out_offsets: HashMap<(NodeId, usize), usize>,
    scratch_offsets: HashMap<(NodeId, usize), usize>,
    /// The buffer of each `accumulate` node's output: outside the arena, since it
    /// holds the running sum across a step's micro-batches while the arena's other
    /// values are recomputed.
    accumulators: HashMap<NodeId, u64>,
    /// The casts whose output is a trained variable's 16-bit copy
    /// (`codegen::weight_copies`): by node, the variable and the copy's type.
    copy_nodes: HashMap<NodeId, (String, DType)>,
    /// Each such copy's buffer, outside the arena (it lives across steps), by variable.
    copies: HashMap<String, WeightCopy>,
    steps_ptr: u64,
    /// Where a captured step copies its losses (one a micro-batch) the moment each is
    /// computed: outside the arena, so the step's later kernels cannot reuse them
    /// before the copy out after the replay. First the skip flag of a step that
    /// unscales on the device, then the losses (4 bytes each).
    loss_ptr: u64,
    /// The step node kernels should see, and the optimizer's completed steps.
    kernel_step: u64,
    opt_steps: Arc<AtomicU64>,
    /// The optimizer's learning rate (and schedule), written beside its step.
    rate: Option<codegen::Rate>,
    /// fp16's unscaling factor, written beside the counters.
    unscale_factor: f32,
    /// What the device's counters hold (after the copies issued): the steps, the
    /// rate and the factor (the skip flag is written zero with them).
    dev_steps: Option<(u64, u64, [u8; 8], u32)>,
    /// How many f32 slots the loss area (`loss_ptr`) and its pinned copies hold.
    loss_capacity: usize,
    /// The most scalars the capture being recorded may read, and how many it read.
    capture_scalars: (usize, usize),
    /// Recording into a sibling's capture ([`Capture::join_capture`]), its scalars
    /// kept in the loss area as a capture of its own keeps them.
    joined: bool,
    /// Replays issued and not yet accounted for, oldest first.
    pending: VecDeque<PendingReplay>,
    /// Preloaded batches in device memory, by id.
    held: Vec<Vec<HeldFeed>>,
    replays: usize,
    capturing: bool,
    capture_update: bool,
    /// Whether the captured step unscaled its gradients on the device
    /// ([`Kernels::unscale_on_device`]): a replay's update then counts once its flag
    /// is read, if the step was not skipped.
    capture_scaled: bool,
    /// The losses each replay of the graph computes.
    graph_losses: usize,
    graph_update: bool,
    graph_scaled: bool,
    /// Whether the last replay read had finite gradients (a scaled graph's).
    last_finite: Option<bool>,
    /// NCCL bytes when the capture began, and the bytes one replay of the graph
    /// moves (counted when the collectives were recorded, not run).
    capture_bytes_at: ByteCount,
    graph_bytes: ByteCount,
    /// Bytes the recorded-not-run collectives counted (subtracted), and the bytes of
    /// every replay (added), so the metrics count what ran.
    bytes_not_run: ByteCount,
    bytes_replayed: ByteCount,
    allocated: u64,
    peak: u64,

    dev: Box<dyn Driver>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.name())
            .field("arch", &self.arch)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

/// Replayed steps that may be in flight at once: the one being read and the next.
const LOSS_SLOTS: usize = 2;
/// The bytes of a loss area holding one loss: the skip flag, then the loss.
const LOSS_AREA_AT: usize = 8;

/// A replay issued, not yet read.
#[derive(Debug)]
struct PendingReplay {
    /// Its pinned slot, when the graph computes a loss or unscales on the device: the
    /// skip flag (u32), then each loss (f32).
    slot: Option<usize>,
    losses: usize,
    /// Whether its update counts only if its flag says the step was not skipped.
    scaled: bool,
}

/// Native-endian f32s, as f64.
fn f32s(bytes: &[u8]) -> impl Iterator<Item = f64> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f64::from(f32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
}

fn invalid(m: impl Into<String>) -> KernelError {
    KernelError::Invalid(m.into())
}

/// Whether a type holds an f64 anywhere.
fn is_f64(t: &ValueType) -> bool {
    t.dense_type().dtype == DType::F64
}

/// A host tensor's bytes, row-major.
fn host_bytes(t: &Tensor) -> Result<Vec<u8>, KernelError> {
    let mut out = Vec::with_capacity(t.bytes());
    match t {
        Tensor::F32(a) => a
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_ne_bytes())),
        Tensor::I32(a) => a
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_ne_bytes())),
        Tensor::BF16(a) => a
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_ne_bytes())),
        Tensor::F16(a) => a
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_ne_bytes())),
        Tensor::F64(_) => return Err(no_f64()),
    }
    Ok(out)
}

/// Writes a host tensor's bytes, row-major, into `out` (exactly its size).
fn write_host_bytes(t: &Tensor, out: &mut [u8]) -> Result<(), KernelError> {
    if out.len() != t.bytes() {
        return Err(invalid(format!(
            "a {}-byte buffer for a {}-byte tensor",
            out.len(),
            t.bytes()
        )));
    }
    match t {
        Tensor::F32(a) => out
            .chunks_exact_mut(4)
            .zip(a.iter())
            .for_each(|(o, x)| o.copy_from_slice(&x.to_ne_bytes())),
        Tensor::I32(a) => out
            .chunks_exact_mut(4)
            .zip(a.iter())
            .for_each(|(o, x)| o.copy_from_slice(&x.to_ne_bytes())),
        Tensor::BF16(a) => out
            .chunks_exact_mut(2)
            .zip(a.iter())
            .for_each(|(o, x)| o.copy_from_slice(&x.to_bits().to_ne_bytes())),
        Tensor::F16(a) => out
            .chunks_exact_mut(2)
            .zip(a.iter())
            .for_each(|(o, x)| o.copy_from_slice(&x.to_bits().to_ne_bytes())),
        Tensor::F64(_) => return Err(no_f64()),
    }
    Ok(())
}

fn no_f64() -> KernelError {
    invalid("an f64 tensor cannot go to the GPU: the CUDA backend holds f32, bf16, f16 and i32")
}

/// Zeros of type `ty` (slices: no rows), what [`Transfer::to_host`] gives while a
/// capture records (nothing has run yet).
fn placeholder(ty: &ValueType) -> Value {
    match ty {
        ValueType::Tensor(t) => Value::Tensor(Tensor::filled(t, 0.0)),
        ValueType::IndexedSlices { dense, .. } => {
            let mut shape = vec![0];
            shape.extend_from_slice(dense.dims().get(1..).unwrap_or(&[]));
            Value::Slices(Slices {
                indices: Vec::new(),
                values: Tensor::F32(ArrayD::zeros(IxDyn(&shape))),
                dense_shape: dense.dims().to_vec(),
            })
        }
    }
}

/// The bytes of a value of type `ty` a kernel reading it may touch, and how: a slices
/// value's rows past its count were never written, so only the count must be.
fn read_extent(ty: &ValueType) -> (usize, Access) {
    let access = if codegen::SlicesLayout::of(ty).is_some() {
        Access::ReadCounted
    } else {
        Access::Read
    };
    (codegen::value_bytes(ty), access)
}

/// Every kernel name a list of launches uses.
fn kernel_names<'a>(launches: impl Iterator<Item = &'a Launch>, out: &mut Vec<String>) {
    for l in launches {
        if let Launch::Kernel { name, .. } = l {
            if !out.contains(name) {
                out.push(name.clone());
            }
        }
    }
}

impl CudaBackend {
    /// The backend for graph `graph` on GPU `ordinal` (see the module doc). Errors,
    /// never panics, when a library or the GPU is missing: the error names it and how
    /// to point distc at it (`DISTC_CUDA_LIB_DIR`, `LD_LIBRARY_PATH`).
    pub fn new(ordinal: usize, graph: &Graph, opts: CudaOptions) -> Result<CudaBackend, CudaError> {
        // What this backend cannot run is refused first: it needs no GPU to say so.
        Self::check_graph(graph)?;
        let dev: Box<dyn Driver> = if opts.emulator {
            Box::new(super::emu::EmuDriver::new(ordinal)?)
        } else {
            let dirs = LibDirs::from_env();
            probe(CudaLib::Driver, &dirs)?;
            probe(CudaLib::Cublas, &dirs)?;
            probe(CudaLib::Nvrtc, &dirs)?;
            let n = super::require_gpu(&dirs)?;
            if ordinal >= n {
                return Err(CudaError::NoDevice(format!(
                    "GPU {ordinal} was asked for; the CUDA driver sees {n} (0..{n})"
                )));
            }
            Box::new(CudarcDriver::new(ordinal, opts.tf32)?)
        };
        Self::with_driver(dev, ordinal, graph, opts)
    }

    /// The backend for `graph` on the device `dev` drives (see [`super::driver`]).
    pub(crate) fn with_driver(
        mut dev: Box<dyn Driver>,
        ordinal: usize,
        graph: &Graph,
        opts: CudaOptions,
    ) -> Result<CudaBackend, CudaError> {
        let DevicePlan {
            source,
            nodes,
            unscale,
        } = codegen::generate(graph)?;
        let mut names = Vec::new();
        for (_, nl) in &nodes {
            kernel_names(nl.launches.iter().chain(&nl.step_start), &mut names);
        }
        if let Some((dense, slices)) = &unscale {
            names.extend([dense.clone(), slices.clone()]);
        }
        let funcs = load_functions(dev.as_mut(), &source, &format!("{}.cu", graph.name), &names)?;
        let steps_ptr = dev.alloc(STEPS_BYTES, true)?;
        let loss_ptr = dev.alloc(LOSS_AREA_AT, true)?;
        let unscale = match unscale {
            Some((dense, slices)) => Some(Unscale {
                dense,
                slices,
                flag: dev.alloc(4, true)?,
            }),
            None => None,
        };
        // Each variable's 16-bit copy lives across steps: a buffer of its own.
        let copy_nodes = codegen::weight_copies(graph);
        let mut copies = HashMap::new();
        let mut copy_bytes = 0;
        for (id, (var, _)) in &copy_nodes {
            let ty = graph.node(*id).outputs.first().cloned();
            let bytes = ty.map_or(0, |t| codegen::value_bytes(&t)).max(4);
            let ptr = dev.alloc(bytes, false)?;
            copy_bytes += bytes;
            copies.insert(var.clone(), WeightCopy { ptr, of: None });
        }
        let steps_host = dev.host_buffer(STEPS_BYTES)?;
        let loss_slots = [
            dev.host_buffer(LOSS_AREA_AT)?,
            dev.host_buffer(LOSS_AREA_AT)?,
        ];
        dev.synchronize()?;
        let allocated = (super::driver::CUBLAS_WORKSPACE + 2 * ALIGN + copy_bytes) as u64;
        Ok(CudaBackend {
            nccl: [None, None, None],
            in_flight: Vec::new(),
            funcs,
            unscale,
            grad_norm: None,
            has_arena: false,
            named: HashMap::new(),
            messages: HashMap::new(),
            steps_host,
            loss_slots,
            checked: dev.checks_accesses(),
            ordinal,
            device_name: dev.device_name().to_string(),
            arch: dev.arch().to_string(),
            opts,
            graph: graph.clone(),
            plan: nodes.into_iter().collect(),
            arena_base: 0,
            out_offsets: HashMap::new(),
            scratch_offsets: HashMap::new(),
            accumulators: HashMap::new(),
            copy_nodes,
            copies,
            steps_ptr,
            loss_ptr,
            kernel_step: 0,
            opt_steps: Arc::new(AtomicU64::new(0)),
            rate: None,
            unscale_factor: 1.0,
            // Allocated zeroed.
            dev_steps: Some((0, 0, [0; 8], 0)),
            loss_capacity: 1,
            capture_scalars: (0, 0),
            joined: false,
            pending: VecDeque::new(),
            held: Vec::new(),
            replays: 0,
            capturing: false,
            capture_update: false,
            capture_scaled: false,
            graph_losses: 0,
            graph_update: false,
            graph_scaled: false,
            last_finite: None,
            capture_bytes_at: ByteCount::default(),
            graph_bytes: ByteCount::default(),
            bytes_not_run: ByteCount::default(),
            bytes_replayed: ByteCount::default(),
            allocated,
            peak: allocated,
            dev,
        })
    }

    /// Refuses what the backend cannot run, before any GPU work.
    fn check_graph(graph: &Graph) -> Result<(), CudaError> {
        for id in graph.node_ids() {
            let node = graph.node(id);
            if let Some(t) = node.outputs.iter().find(|t| is_f64(t)) {
                return Err(CudaError::Invalid(format!(
                    "{id} ({}): {t}: the CUDA backend runs f32 (and i32 ids); f64 graphs \
                     (gradient checks) run on the CPU",
                    node.op.mnemonic()
                )));
            }
        }
        Ok(())
    }

    /// The architecture the kernels were compiled for (`sm_90`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The GPU's UUID (`GPU-xxxxxxxx-...`), which names it across processes (NCCL's
    /// bootstrap compares them: one rank per GPU).
    pub fn gpu_uuid(&self) -> Result<String, CudaError> {
        let b = self.dev.uuid()?;
        let hex = |r: std::ops::Range<usize>| -> String {
            b[r].iter().map(|x| format!("{x:02x}")).collect()
        };
        Ok(format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        ))
    }

    /// Joins the NCCL communicator on `axis` rank 0's `id` names, as `rank` of `size`:
    /// from then on the plan's collectives over that axis run on device buffers
    /// ([`super::nccl`]), and on the pipe axis its messages go device to device
    /// ([`DeviceCollectives::send_message`]). Before [`Kernels::prepare`], whose memory
    /// plan keeps their inputs alive while they run.
    pub fn attach_nccl(
        &mut self,
        axis: Axis,
        rank: usize,
        size: usize,
        id: [u8; 128],
    ) -> Result<(), CudaError> {
        self.nccl[axis.index()] = Some(self.join_nccl(rank, size, id)?);
        Ok(())
    }

    /// The device buffer of `bytes` for the message `name` (allocated on first use).
    fn message_buffer(&mut self, name: &str, bytes: usize) -> Result<u64, KernelError> {
        let key = (name.to_string(), bytes);
        if let Some(&ptr) = self.messages.get(&key) {
            return Ok(ptr);
        }
        self.no_capture(&format!("allocating a buffer for `{name}`"))?;
        let ptr = self.dev.alloc(bytes, false)?;
        self.track(bytes);
        self.messages.insert(key, ptr);
        Ok(ptr)
    }

    /// Joins the NCCL communicator `id` names, before the memory plan (which keeps a
    /// collective's input alive while NCCL reads it) is made.
    fn join_nccl(
        &mut self,
        rank: usize,
        size: usize,
        id: [u8; 128],
    ) -> Result<Box<dyn DeviceComm>, CudaError> {
        if self.has_arena {
            return Err(CudaError::Invalid(
                "NCCL must be attached before the memory plan is made".into(),
            ));
        }
        self.dev.communicator(rank, size, id)
    }

    /// Whether an NCCL communicator is attached on `axis`.
    pub fn has_nccl(&self, axis: Axis) -> bool {
        self.nccl[axis.index()].is_some()
    }

    /// Whether an NCCL communicator runs node `id`'s op.
    fn nccl_runs(&self, id: NodeId) -> bool {
        let Some(node) = self.graph.get(id) else {
            return false;
        };
        self.has_nccl(Axis::of_collective(&node.op))
            && input_key(&self.graph, id, 0)
                .and_then(|(n, p)| self.graph.get(n).and_then(|m| m.outputs.get(p)))
                .is_some_and(|t| NcclComm::supports(&node.op, t))
    }

    /// The communicator that runs node `id`'s collective (see [`Self::nccl_runs`]).
    fn comm_of(&mut self, id: NodeId) -> Option<&mut Box<dyn DeviceComm>> {
        let axis = Axis::of_collective(&self.graph.get(id)?.op);
        self.nccl[axis.index()].as_mut()
    }

    /// Bytes its communicators have moved.
    fn nccl_bytes(&self) -> ByteCount {
        self.nccl
            .iter()
            .flatten()
            .map(|c| c.bytes())
            .fold(ByteCount::default(), |a, b| a + b)
    }

    /// Makes the compute stream wait for the collectives whose results hold any of
    /// `ptrs` (no host wait).
    fn await_collectives(&mut self, ptrs: &[u64]) -> Result<(), CudaError> {
        let mut k = 0;
        while k < self.in_flight.len() {
            let (start, end, node) = self.in_flight[k];
            if ptrs.iter().any(|&p| p >= start && p < end) {
                if let Some(comm) = self.comm_of(node) {
                    comm.order_after(node)?;
                }
                self.in_flight.swap_remove(k);
            } else {
                k += 1;
            }
        }
        Ok(())
    }

    /// Makes the compute stream wait for every collective in flight.
    fn await_all_collectives(&mut self) -> Result<(), CudaError> {
        for (_, _, node) in std::mem::take(&mut self.in_flight) {
            if let Some(comm) = self.comm_of(node) {
                comm.order_after(node)?;
            }
        }
        Ok(())
    }

    fn bind(&self) -> Result<(), CudaError> {
        self.dev.bind()
    }

    /// Room in the loss area (and its pinned copies) for a capture reading `scalars`
    /// losses, made before the capture begins; the capture has read none yet.
    fn reserve_losses(&mut self, scalars: usize) -> Result<(), CudaError> {
        if scalars > self.loss_capacity {
            // Replays not read yet hold the old pinned slots: none, since a backend
            // captures once, before its first replay.
            let bytes = 4 + 4 * scalars;
            self.loss_ptr = self.dev.alloc(bytes, true)?;
            self.track(bytes);
            self.loss_slots = [self.dev.host_buffer(bytes)?, self.dev.host_buffer(bytes)?];
            self.loss_capacity = scalars;
        }
        self.capture_scalars = (scalars, 0);
        Ok(())
    }

    /// The bytes the collectives recorded since the capture began counted (they did
    /// not run): what each replay moves.
    fn count_recorded_bytes(&mut self) {
        self.graph_bytes = self.nccl_bytes() - self.capture_bytes_at;
        self.bytes_not_run.sent += self.graph_bytes.sent;
        self.bytes_not_run.received += self.graph_bytes.received;
    }

    /// One replay's bytes, counted once its step is read.
    fn count_replayed_bytes(&mut self) {
        self.bytes_replayed.sent += self.graph_bytes.sent;
        self.bytes_replayed.received += self.graph_bytes.received;
    }

    fn track(&mut self, bytes: usize) {
        self.allocated += bytes.max(ALIGN) as u64;
        self.peak = self.peak.max(self.allocated);
    }

    fn no_capture(&self, what: &str) -> Result<(), KernelError> {
        if self.capturing {
            Err(invalid(format!(
                "{what} while a CUDA graph is being captured: upload before capturing, \
                 read results after replaying"
            )))
        } else {
            Ok(())
        }
    }

    /// Multiplies every gradient by the factor in the counters (`FACTOR_AT`) and raises
    /// `flag` (cleared first) if one was not finite: the kernels of [`Unscale`].
    fn scale_gradients(
        &mut self,
        grads: &mut [(String, DeviceValue)],
        flag: u64,
        bounds: &OverflowBounds,
    ) -> Result<(), KernelError> {
        let Some(u) = &self.unscale else {
            return Err(invalid("no gradient-scaling kernels"));
        };
        let (dense, slices) = (u.dense.clone(), u.slices.clone());
        self.await_all_collectives()?;
        self.dev.memset_zero(flag, 4)?;
        let bufs = [
            (flag, 4, Access::ReadWrite),
            (self.steps_ptr + FACTOR_AT, 4, Access::Read),
        ];
        for (name, g) in grads.iter() {
            // Infinity where there is no bound: only an infinity or a NaN is then bad.
            let bound = KArg::F32(bounds.get(name).map_or(f32::INFINITY, |&b| b as f32));
            let (kernel, n, args, access) = match codegen::SlicesLayout::of(&g.ty) {
                None => {
                    let n = g.ty.dense_type().dims().iter().product::<usize>();
                    let args = vec![
                        KArg::Grad,
                        KArg::Scratch(1),
                        KArg::U64(n as u64),
                        KArg::Scratch(0),
                        bound,
                    ];
                    (dense.clone(), n, args, Access::ReadWrite)
                }
                Some(l) => {
                    let (nnz, row) = (KArg::U64(l.nnz as u64), KArg::U64(l.row as u64));
                    let args = vec![
                        KArg::Grad,
                        nnz,
                        row,
                        KArg::Scratch(1),
                        KArg::Scratch(0),
                        bound,
                    ];
                    (
                        slices.clone(),
                        l.nnz * l.row,
                        args,
                        Access::ReadWriteCounted,
                    )
                }
            };
            if n == 0 {
                continue;
            }
            let launch = Launch::Kernel {
                name: kernel,
                grid: [codegen::blocks_for(n).map_err(invalid)?, 1, 1],
                block: [codegen::BLOCK, 1, 1],
                shared_bytes: 0,
                args,
            };
            issue_over_gradient(
                self.dev.as_mut(),
                &self.funcs,
                launch,
                (g.ptr, codegen::value_bytes(&g.ty), access),
                &bufs,
                &|| format!("unscaling the gradient of `{name}`"),
            )?;
        }
        Ok(())
    }

    /// The 16-bit copy each variable with one has, for the update kernels.
    fn copy_types(&self) -> HashMap<String, DType> {
        self.copy_nodes.values().cloned().collect()
    }

    /// The optimizer's completed updates.
    fn opt_done(&self) -> u64 {
        self.opt_steps.load(Ordering::Relaxed)
    }

    /// Copies the step counters, the optimizer's rate for its next update and the
    /// unscaling factor to the device if they changed (outside a capture), and clears
    /// the skip flag.
    fn write_steps(&mut self) -> Result<(), CudaError> {
        let rate = self
            .rate
            .as_ref()
            .map_or([0u8; 8], |r| r.bytes(self.opt_done()));
        let factor = self.unscale_factor.to_bits();
        let want = (self.kernel_step, self.opt_done(), rate, factor);
        if self.dev_steps == Some(want) {
            return Ok(());
        }
        // The previous copy out of the pinned buffer is done before it is refilled.
        let host = self.dev.host_bytes(self.steps_host)?;
        host[..8].copy_from_slice(&want.0.to_ne_bytes());
        host[8..16].copy_from_slice(&want.1.to_ne_bytes());
        host[16..24].copy_from_slice(&rate);
        host[SKIP_AT as usize..FACTOR_AT as usize].copy_from_slice(&0u32.to_ne_bytes());
        host[FACTOR_AT as usize..STEPS_BYTES].copy_from_slice(&factor.to_ne_bytes());
        self.dev
            .upload(self.steps_host, self.steps_ptr, STEPS_BYTES)?;
        self.dev_steps = Some(want);
        Ok(())
    }

    /// A persistent buffer for `(name, bytes)`, created on first use.
    fn named_buffer(&mut self, name: &str, bytes: usize) -> Result<&mut Named, KernelError> {
        let key = (name.to_string(), bytes);
        if !self.named.contains_key(&key) {
            self.no_capture(&format!("allocating a buffer for `{name}`"))?;
            let ptr = self.dev.alloc(bytes, false)?;
            let staging = self.dev.host_buffer(bytes.max(1))?;
            self.track(bytes);
            self.named.insert(key.clone(), Named { ptr, staging });
        }
        let named = self
            .named
            .get_mut(&key)
            .ok_or_else(|| invalid("named buffer vanished"))?;
        // Its bytes are about to change: a copy of them is no longer current.
        for c in self.copies.values_mut() {
            if c.of == Some(named.ptr) {
                c.of = None;
            }
        }
        Ok(named)
    }

    /// A fresh device buffer holding `bytes` (kept until the backend is dropped).
    fn owned_copy(&mut self, bytes: &[u8]) -> Result<u64, KernelError> {
        self.no_capture("allocating a buffer")?;
        let ptr = self.dev.alloc(bytes.len(), false)?;
        self.dev.htod(ptr, bytes)?;
        self.dev.synchronize()?;
        self.track(bytes.len());
        Ok(ptr)
    }

    /// Reads a dense tensor of type `ty` at `ptr` back to the host.
    fn read_dense(&mut self, ptr: u64, ty: &TensorType) -> Result<Tensor, KernelError> {
        self.no_capture("reading a tensor back")?;
        self.bind()?;
        let dim = IxDyn(ty.dims());
        let n = ty.dims().iter().product::<usize>();
        let mut bytes = vec![0u8; ty.dtype.size() * n];
        if ty.dtype == DType::F64 {
            return Err(invalid("the CUDA backend holds no f64 tensors"));
        }
        self.dev.read(ptr, &mut bytes)?;
        let words = bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
        let halves = bytes
            .chunks_exact(2)
            .map(|c| u16::from_ne_bytes([c[0], c[1]]));
        let bad = |e: ndarray::ShapeError| invalid(e.to_string());
        Ok(match ty.dtype {
            DType::BF16 => Tensor::BF16(
                ArrayD::from_shape_vec(dim, halves.map(half::bf16::from_bits).collect())
                    .map_err(bad)?,
            ),
            DType::F16 => Tensor::F16(
                ArrayD::from_shape_vec(dim, halves.map(half::f16::from_bits).collect())
                    .map_err(bad)?,
            ),
            DType::I32 => Tensor::I32(
                ArrayD::from_shape_vec(dim, words.map(i32::from_ne_bytes).collect())
                    .map_err(bad)?,
            ),
            _ => Tensor::F32(
                ArrayD::from_shape_vec(dim, words.map(f32::from_ne_bytes).collect())
                    .map_err(bad)?,
            ),
        })
    }

    /// Reads a value (dense or slices) back to the host.
    fn read_value(&mut self, v: &DeviceValue) -> Result<Value, KernelError> {
        let Some(layout) = codegen::SlicesLayout::of(&v.ty) else {
            return Ok(Value::Tensor(self.read_dense(v.ptr, v.ty.dense_type())?));
        };
        self.no_capture("reading slices back")?;
        let dense = v.ty.dense_type();
        let mut count = [0u8; 4];
        self.dev.read(v.ptr, &mut count)?;
        let rows = usize::try_from(i32::from_ne_bytes(count))
            .unwrap_or(0)
            .min(layout.nnz);
        let mut indices = vec![0u8; 4 * rows];
        let mut values = vec![0u8; 4 * rows * layout.row];
        self.dev
            .read(v.ptr + layout.indices_offset as u64, &mut indices)?;
        self.dev
            .read(v.ptr + layout.values_offset as u64, &mut values)?;
        let word = |c: &[u8]| [c[0], c[1], c[2], c[3]];
        let mut shape = vec![rows];
        shape.extend_from_slice(dense.dims().get(1..).unwrap_or(&[]));
        Ok(Value::Slices(Slices {
            indices: indices
                .chunks_exact(4)
                .map(|c| i32::from_ne_bytes(word(c)))
                .collect(),
            values: Tensor::F32(
                ArrayD::from_shape_vec(
                    IxDyn(&shape),
                    values
                        .chunks_exact(4)
                        .map(|c| f32::from_ne_bytes(word(c)))
                        .collect(),
                )
                .map_err(|e| invalid(e.to_string()))?,
            ),
            dense_shape: dense.dims().to_vec(),
        }))
    }
}

/// How a launch's argument resolves: its value, and for a pointer the bytes it may
/// touch and how (asked only of a driver that checks accesses).
struct Args<'a> {
    value: &'a dyn Fn(&KArg) -> Result<ArgVal, KernelError>,
    extent: &'a dyn Fn(&KArg) -> Option<(usize, Access)>,
    what: &'a dyn Fn() -> String,
}

/// Issues one kernel `launch` over a gradient: its `KArg::Grad` is the gradient at
/// `grad` (its bytes and access), its `KArg::Scratch(i)` the buffer `scratch[i]`, and
/// its other arguments values. What unscaling and the gradient's norm launch alike.
fn issue_over_gradient(
    dev: &mut dyn Driver,
    funcs: &HashMap<String, Kernel>,
    launch: Launch,
    grad: (u64, usize, Access),
    scratch: &[(u64, usize, Access)],
    what: &dyn Fn() -> String,
) -> Result<(), KernelError> {
    let value = |k: &KArg| -> Result<ArgVal, KernelError> {
        match k {
            KArg::Grad => Ok(ArgVal::U64(grad.0)),
            KArg::Scratch(i) => scratch
                .get(*i)
                .map(|b| ArgVal::U64(b.0))
                .ok_or_else(|| invalid(format!("{}: no scratch {i}", what()))),
            _ => ArgVal::scalar(k, &OUTSIDE_NODES)
                .unwrap_or_else(|| Err(invalid(format!("{}: {k:?} is not a value", what())))),
        }
    };
    let extent = |k: &KArg| match k {
        KArg::Grad => Some((grad.1, grad.2)),
        KArg::Scratch(i) => scratch.get(*i).map(|b| (b.1, b.2)),
        _ => None,
    };
    let args = Args {
        value: &value,
        extent: &extent,
        what,
    };
    issue(dev, std::slice::from_ref(&launch), funcs, &args)
}

/// Issues `launches` on the driver's compute stream, each argument resolved by `args`.
fn issue(
    dev: &mut dyn Driver,
    launches: &[Launch],
    funcs: &HashMap<String, Kernel>,
    args: &Args<'_>,
) -> Result<(), KernelError> {
    let what = args.what;
    let checked = dev.checks_accesses();
    let ptr = |k: &KArg| match (args.value)(k)? {
        ArgVal::U64(p) => Ok(p),
        other => Err(invalid(format!(
            "{}: {k:?} is {other:?}, not a buffer",
            what()
        ))),
    };
    let bytes = |k: &KArg| {
        if checked {
            (args.extent)(k).map_or(0, |(b, _)| b)
        } else {
            0
        }
    };
    for l in launches {
        match l {
            Launch::Kernel {
                name,
                grid,
                block,
                shared_bytes,
                args: kargs,
            } => {
                let Kernel { handle, params } = funcs
                    .get(name)
                    .ok_or_else(|| invalid(format!("{}: kernel `{name}` not loaded", what())))?;
                let vals = kargs
                    .iter()
                    .map(args.value)
                    .collect::<Result<Vec<_>, _>>()?;
                // Each value in its parameter's C type, or no launch (garbage on the
                // GPU otherwise).
                if vals.len() != params.len() || vals.iter().zip(params).any(|(v, p)| !v.fits(*p)) {
                    return Err(invalid(format!(
                        "{}: kernel `{name}` takes {params:?}, its launch passes {vals:?}",
                        what()
                    )));
                }
                let regions: Vec<Region> = if checked {
                    kargs
                        .iter()
                        .enumerate()
                        .filter_map(|(arg, k)| {
                            (args.extent)(k).map(|(bytes, access)| Region { arg, bytes, access })
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                dev.launch(&KernelLaunch {
                    kernel: *handle,
                    name,
                    grid: *grid,
                    block: *block,
                    shared_bytes: *shared_bytes,
                    args: &vals,
                    regions: &regions,
                    what,
                })?;
            }
            Launch::Gemm(g) => {
                if g.m == 0 || g.n == 0 || g.batch == 0 {
                    continue;
                }
                let gemm = super::driver::Gemm {
                    call: SgemmCall::of(g),
                    a: ptr(&g.a)?,
                    b: ptr(&g.b)?,
                    c: ptr(&g.c)?,
                    bytes: [bytes(&g.a), bytes(&g.b), bytes(&g.c)],
                };
                dev.sgemm(&gemm, what)?;
            }
            Launch::Memset { buf, bytes } => {
                let p = ptr(buf)?;
                let n = usize::try_from(*bytes).map_err(|_| invalid("memset too large"))?;
                dev.memset_zero(p, n)?;
            }
            Launch::Alias { .. } => {}
            Launch::Host => {
                return Err(invalid(format!(
                    "{}: runs on the host; the CUDA backend has no kernel for it",
                    what()
                )))
            }
        }
    }
    Ok(())
}

fn load_functions(
    dev: &mut dyn Driver,
    source: &str,
    file: &str,
    names: &[String],
) -> Result<HashMap<String, Kernel>, CudaError> {
    let sigs = codegen::kernel_signatures(source).map_err(CudaError::Invalid)?;
    let params = names
        .iter()
        .map(|n| {
            sigs.get(n)
                .cloned()
                .ok_or_else(|| CudaError::Invalid(format!("kernel `{n}` is not in the source")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let handles = dev.load_module(source, file, names)?;
    Ok(names
        .iter()
        .cloned()
        .zip(handles.into_iter().zip(params))
        .map(|(n, (handle, params))| (n, Kernel { handle, params }))
        .collect())
}

/// The source value of a node input: `(producer, port)`.
fn input_key(graph: &Graph, node: NodeId, i: usize) -> Option<(NodeId, usize)> {
    graph
        .node(node)
        .inputs
        .get(i)
        .map(|v| (v.node, v.port as usize))
}

impl Device for CudaBackend {
    type Value = DeviceValue;

    type Tensor = DeviceTensor;

    fn name(&self) -> String {
        format!("cuda:{} ({})", self.ordinal, self.device_name)
    }

    fn value_type(v: &DeviceValue) -> ValueType {
        v.ty.clone()
    }

    fn value_bytes(v: &DeviceValue) -> u64 {
        codegen::value_bytes(&v.ty) as u64
    }

    fn tensor_type(t: &DeviceTensor) -> TensorType {
        t.ty.clone()
    }
}

/// Whether `program` has collectives of the model axis (`model`) or of the data axis.
pub(crate) fn has_collectives(program: &Graph, model: bool) -> bool {
    program.node_ids().into_iter().any(|id| {
        let op = program.op(id);
        op.is_collective() && op.is_model_collective() == model
    })
}

impl Kernels for CudaBackend {
    fn beside(&mut self, program: &Graph) -> Result<Option<CudaBackend>, KernelError> {
        Self::check_graph(program)?;
        self.bind()?;
        let dev = self.dev.sibling()?;
        let mut sibling = Self::with_driver(dev, self.ordinal, program, self.opts)?;
        // Its collectives run on communicators split from this one's, axis by axis:
        // every rank of an axis holds the same program, so all of them split alike.
        // (Stage messages are sent by this backend, for both.)
        for axis in [Axis::Data, Axis::Model] {
            let comm = self.nccl[axis.index()].as_mut();
            if let (true, Some(comm)) = (has_collectives(program, axis == Axis::Model), comm) {
                sibling.nccl[axis.index()] = Some(comm.split()?);
            }
        }
        Ok(Some(sibling))
    }

    fn prepare(&mut self, schedule: &Schedule) -> Result<(), KernelError> {
        self.no_capture("planning memory")?;
        self.bind()?;
        let position: HashMap<NodeId, usize> = schedule
            .order()
            .enumerate()
            .map(|(k, (id, _))| (id, k))
            .collect();
        let end = position.len();
        let lifetimes = schedule.lifetimes();
        let accumulating: Vec<NodeId> = schedule
            .order()
            .filter(|(_, op)| matches!(op, Op::Accumulate { .. }))
            .map(|(id, _)| id)
            .collect();
        // Each computed value's buffer: its own (`Some(self)`), an earlier value's (an
        // alias chain's root), or `None` (an alias of a variable, feed or constant).
        let mut root: HashMap<(NodeId, usize), Option<(NodeId, usize)>> = HashMap::new();
        let mut span: HashMap<(NodeId, usize), (usize, usize, usize)> = HashMap::new();
        for lt in &lifetimes {
            let key = (lt.node, lt.port);
            let alias = self.plan.get(&lt.node).and_then(|nl| {
                nl.launches.iter().find_map(|l| match l {
                    Launch::Alias { input } => Some(*input),
                    _ => None,
                })
            });
            let r = match alias {
                Some(input) if lt.port == 0 => {
                    let src = input_key(&self.graph, lt.node, input)
                        .ok_or_else(|| invalid(format!("{}: alias of a missing input", lt.node)))?;
                    root.get(&src).copied().flatten()
                }
                _ => Some(key),
            };
            root.insert(key, r);
            let own_buffer =
                |n: &NodeId| accumulating.contains(n) || self.copy_nodes.contains_key(n);
            if let Some(r) = r.filter(|r| !own_buffer(&r.0)) {
                let e = span
                    .entry(r)
                    .or_insert((codegen::value_bytes(&lt.ty), lt.first, lt.last));
                e.2 = e.2.max(lt.last);
            }
        }
        // Gradients are read by the optimizer after the run, the values of assign
        // sinks copied over their variables then, and what a pipeline stage sends read
        // then to be sent: live to the end.
        for id in self.graph.node_ids() {
            if let Op::ParamGrad { .. } | Op::Assign { .. } | Op::Send { .. } = self.graph.op(id) {
                if let Some(src) = input_key(&self.graph, id, 0) {
                    if let Some(Some(r)) = root.get(&src) {
                        if let Some(e) = span.get_mut(r) {
                            e.2 = end;
                        }
                    }
                }
            }
        }
        // An NCCL collective reads its input on its own stream while the compute
        // stream goes on: the input lives until the result's last use, after which
        // the compute stream has waited for the collective.
        for id in self.graph.node_ids() {
            if !self.nccl_runs(id) {
                continue;
            }
            let (Some(Some(src)), Some(Some(dst))) = (
                input_key(&self.graph, id, 0).and_then(|k| root.get(&k).copied()),
                root.get(&(id, 0)).copied(),
            ) else {
                continue;
            };
            let until = span.get(&dst).map_or(end, |d| d.2);
            if let Some(e) = span.get_mut(&src) {
                e.2 = e.2.max(until);
            }
        }
        let mut keys: Vec<(NodeId, usize)> = span.keys().copied().collect();
        keys.sort();
        let mut blocks: Vec<Block> = keys
            .iter()
            .map(|k| {
                let (bytes, first, last) = span[k];
                Block {
                    bytes: bytes.max(4),
                    first,
                    last,
                }
            })
            .collect();
        let mut scratch_keys = Vec::new();
        let mut plan_ids: Vec<&NodeId> = self.plan.keys().collect();
        plan_ids.sort();
        for id in plan_ids {
            let nl = &self.plan[id];
            let Some(&pos) = position.get(id) else {
                continue;
            };
            for (k, &bytes) in nl.scratch_bytes.iter().enumerate() {
                scratch_keys.push((*id, k));
                blocks.push(Block {
                    bytes: bytes.max(4),
                    first: pos,
                    last: pos,
                });
            }
        }
        let plan = arena::plan(&blocks, ALIGN);
        self.arena_base = self.dev.alloc(plan.size, false)?;
        self.track(plan.size);
        self.has_arena = true;
        self.out_offsets.clear();
        self.scratch_offsets.clear();
        let offset_of: HashMap<(NodeId, usize), usize> = keys
            .iter()
            .copied()
            .zip(plan.offsets.iter().copied())
            .collect();
        for (key, r) in &root {
            if let Some(r) = r {
                if let Some(&off) = offset_of.get(r) {
                    self.out_offsets.insert(*key, off);
                }
            }
        }
        for (key, &off) in scratch_keys.iter().zip(&plan.offsets[keys.len()..]) {
            self.scratch_offsets.insert(*key, off);
        }
        for id in accumulating {
            if self.accumulators.contains_key(&id) {
                continue;
            }
            let ty = self
                .graph
                .node(id)
                .outputs
                .first()
                .cloned()
                .ok_or_else(|| invalid(format!("{id} (accumulate): has no output")))?;
            let bytes = codegen::value_bytes(&ty).max(4);
            let ptr = self.dev.alloc(bytes, false)?;
            self.track(bytes);
            self.accumulators.insert(id, ptr);
        }
        self.dev.synchronize()?;
        Ok(())
    }

    fn eval(
        &mut self,
        node: NodeId,
        op: &Op,
        args: Vec<BackendArg<'_, DeviceValue, DeviceTensor>>,
        ctx: &KernelCtx,
    ) -> Result<Vec<DeviceValue>, KernelError> {
        self.bind()?;
        if !self.capturing && ctx.step != self.kernel_step {
            self.kernel_step = ctx.step;
        }
        if !self.capturing {
            self.write_steps()?;
        }
        let what = || format!("{node} ({})", op.mnemonic());
        let ins: Vec<u64> = args
            .iter()
            .map(|a| match a {
                BackendArg::Owned(v) => v.ptr,
                BackendArg::Borrowed(v) => v.ptr,
                BackendArg::BorrowedTensor(t) => t.ptr,
            })
            .collect();
        // What each input holds, for a driver that checks reads.
        let in_extents: Vec<(usize, Access)> = if self.checked {
            args.iter()
                .map(|a| match a {
                    BackendArg::Owned(v) => read_extent(&v.ty),
                    BackendArg::Borrowed(v) => read_extent(&v.ty),
                    BackendArg::BorrowedTensor(t) => read_extent(&ValueType::Tensor(t.ty.clone())),
                })
                .collect()
        } else {
            Vec::new()
        };
        self.await_collectives(&ins)?;
        let nl = self
            .plan
            .get(&node)
            .ok_or_else(|| invalid(format!("{}: not in the device plan", what())))?;
        let out_types = &self.graph.node(node).outputs;
        let alias = nl.launches.iter().find_map(|l| match l {
            Launch::Alias { input } => Some(*input),
            _ => None,
        });
        // A variable's 16-bit copy: cast only when it is not of the variable's bytes.
        let copy = match self.copy_nodes.get(&node) {
            Some((var, _)) => {
                let c = self
                    .copies
                    .get(var)
                    .ok_or_else(|| invalid(format!("{}: no buffer for `{var}`'s copy", what())))?;
                let src = *ins
                    .first()
                    .ok_or_else(|| invalid(format!("{}: no input", what())))?;
                if c.of == Some(src) {
                    let ty = out_types.first().cloned();
                    let ty = ty.ok_or_else(|| invalid(format!("{}: no output", what())))?;
                    return Ok(vec![DeviceValue { ptr: c.ptr, ty }]);
                }
                Some((var.clone(), c.ptr, src))
            }
            None => None,
        };
        let mut outs = Vec::with_capacity(out_types.len());
        for (j, ty) in out_types.iter().enumerate() {
            let ptr = match (alias, &copy) {
                (Some(i), _) if j == 0 => *ins
                    .get(i)
                    .ok_or_else(|| invalid(format!("{}: alias of missing input {i}", what())))?,
                (_, Some((_, ptr, _))) if j == 0 => *ptr,
                _ => {
                    let off = self.out_offsets.get(&(node, j)).ok_or_else(|| {
                        invalid(format!(
                            "{}: output {j} has no buffer (prepare not run?)",
                            what()
                        ))
                    })?;
                    self.arena_base + *off as u64
                }
            };
            outs.push(DeviceValue {
                ptr,
                ty: ty.clone(),
            });
        }
        let base = self.arena_base;
        let steps = self.steps_ptr;
        if self.checked {
            // A node's outputs and scratch hold nothing until it writes them.
            for (j, o) in outs.iter().enumerate() {
                if alias.is_none() || j > 0 {
                    self.dev.fresh(o.ptr, codegen::value_bytes(&o.ty))?;
                }
            }
            for (s, &bytes) in nl.scratch_bytes.iter().enumerate() {
                if let Some(off) = self.scratch_offsets.get(&(node, s)) {
                    self.dev.fresh(base + *off as u64, bytes)?;
                }
            }
        }
        let arg = |k: &KArg| -> Result<ArgVal, KernelError> {
            Ok(match k {
                KArg::Input(i) => ArgVal::U64(
                    *ins.get(*i)
                        .ok_or_else(|| invalid(format!("{}: no input {i}", what())))?,
                ),
                KArg::Output(j) => ArgVal::U64(
                    outs.get(*j)
                        .ok_or_else(|| invalid(format!("{}: no output {j}", what())))?
                        .ptr,
                ),
                KArg::Scratch(s) => ArgVal::U64(
                    base + *self
                        .scratch_offsets
                        .get(&(node, *s))
                        .ok_or_else(|| invalid(format!("{}: no scratch {s}", what())))?
                        as u64,
                ),
                KArg::Step => ArgVal::U64(steps),
                KArg::Param | KArg::Grad | KArg::Slot(_) | KArg::WeightCopy => {
                    return Err(invalid(format!(
                        "{}: optimizer argument {k:?} in a node",
                        what()
                    )))
                }
                scalar => {
                    return ArgVal::scalar(scalar, ctx).unwrap_or_else(|| {
                        Err(invalid(format!("{}: {scalar:?} is not a value", what())))
                    })
                }
            })
        };
        let extent = |k: &KArg| -> Option<(usize, Access)> {
            match k {
                KArg::Input(i) => in_extents.get(*i).copied(),
                KArg::Output(j) => outs
                    .get(*j)
                    .map(|o| (codegen::value_bytes(&o.ty), Access::Write)),
                KArg::Scratch(s) => nl.scratch_bytes.get(*s).map(|&b| (b, Access::Write)),
                KArg::Step => Some((16, Access::Read)),
                _ => None,
            }
        };
        let args = Args {
            value: &arg,
            extent: &extent,
            what: &what,
        };
        issue(self.dev.as_mut(), &nl.launches, &self.funcs, &args)?;
        if let Some((var, _, src)) = copy {
            if let Some(c) = self.copies.get_mut(&var) {
                c.of = Some(src);
            }
        }
        Ok(outs)
    }

    fn filled(&mut self, ty: &TensorType, value: f64) -> Result<DeviceTensor, KernelError> {
        self.bind()?;
        let bytes = host_bytes(&Tensor::filled(ty, value))?;
        let ptr = self.owned_copy(&bytes)?;
        Ok(DeviceTensor {
            ptr,
            ty: ty.clone(),
        })
    }

    fn copy_tensor(&mut self, t: &DeviceTensor) -> Result<DeviceValue, KernelError> {
        // Values are never written after they are computed (see the module doc), so a
        // copy shares the bytes.
        Ok(DeviceValue {
            ptr: t.ptr,
            ty: ValueType::Tensor(t.ty.clone()),
        })
    }

    fn copy_value(&mut self, v: &DeviceValue) -> Result<DeviceValue, KernelError> {
        Ok(v.clone())
    }

    /// The node's launches add `value / micro` into its accumulator, after the
    /// node's `step_start` launches cleared it on a step's first micro-batch, so the
    /// sum is already the mean.
    fn accumulate(
        &mut self,
        node: NodeId,
        sum: Option<DeviceValue>,
        value: DeviceValue,
        _micro: usize,
    ) -> Result<DeviceValue, KernelError> {
        self.bind()?;
        let what = || format!("{node} (accumulate)");
        let acc = *self
            .accumulators
            .get(&node)
            .ok_or_else(|| invalid(format!("{}: has no accumulator (prepare not run?)", what())))?;
        if sum.as_ref().is_some_and(|s| s.ptr != acc) {
            return Err(invalid(format!(
                "{}: the running sum is not the node's accumulator",
                what()
            )));
        }
        let ty = self
            .graph
            .node(node)
            .outputs
            .first()
            .cloned()
            .ok_or_else(|| invalid(format!("{}: has no output", what())))?;
        self.await_collectives(&[value.ptr])?;
        let nl = self
            .plan
            .get(&node)
            .ok_or_else(|| invalid(format!("{}: not in the device plan", what())))?;
        let arg = |k: &KArg| -> Result<ArgVal, KernelError> {
            match k {
                KArg::Input(0) => Ok(ArgVal::U64(value.ptr)),
                KArg::Output(0) => Ok(ArgVal::U64(acc)),
                // Scalars only: the rank and the training flag are no argument of
                // an accumulation.
                scalar => ArgVal::scalar(scalar, &OUTSIDE_NODES).unwrap_or_else(|| {
                    Err(invalid(format!("{}: {scalar:?} is not a value", what())))
                }),
            }
        };
        let (in_bytes, in_access) = read_extent(&value.ty);
        let out_bytes = codegen::value_bytes(&ty);
        let out_access = match ty {
            ValueType::Tensor(_) => Access::ReadWrite,
            ValueType::IndexedSlices { .. } => Access::Append,
        };
        let extent = |k: &KArg| -> Option<(usize, Access)> {
            match k {
                KArg::Input(0) => Some((in_bytes, in_access)),
                KArg::Output(0) => Some((out_bytes, out_access)),
                _ => None,
            }
        };
        let args = Args {
            value: &arg,
            extent: &extent,
            what: &what,
        };
        if sum.is_none() {
            issue(self.dev.as_mut(), &nl.step_start, &self.funcs, &args)?;
        }
        issue(self.dev.as_mut(), &nl.launches, &self.funcs, &args)?;
        Ok(DeviceValue { ptr: acc, ty })
    }

    fn accumulated(
        &mut self,
        _node: NodeId,
        sum: DeviceValue,
        _micro: usize,
    ) -> Result<DeviceValue, KernelError> {
        Ok(sum)
    }

    fn set_step(&mut self, step: u64) -> Result<(), KernelError> {
        self.no_capture("setting the step")?;
        self.bind()?;
        self.kernel_step = step;
        Ok(self.write_steps()?)
    }
}

impl Transfer for CudaBackend {
    fn upload(&mut self, name: &str, t: Tensor) -> Result<DeviceTensor, KernelError> {
        self.no_capture(&format!("uploading `{name}`"))?;
        self.bind()?;
        let ty = t.tensor_type();
        let len = t.bytes();
        let named = self.named_buffer(name, len)?;
        let (ptr, staging) = (named.ptr, named.staging);
        if len > 0 {
            // The previous copy out of the staging buffer is done before it is refilled.
            // Written straight into it: a batch crosses the host's memory once.
            let host = self.dev.host_bytes(staging)?;
            write_host_bytes(&t, &mut host[..len])?;
            self.dev.upload(staging, ptr, len)?;
        }
        Ok(DeviceTensor { ptr, ty })
    }

    fn download(&mut self, t: &DeviceTensor) -> Result<Tensor, KernelError> {
        self.read_dense(t.ptr, &t.ty)
    }

    fn hold_batch(
        &mut self,
        batch: &HashMap<String, Tensor>,
    ) -> Result<Option<usize>, KernelError> {
        self.no_capture("holding a batch")?;
        self.bind()?;
        let mut feeds = Vec::with_capacity(batch.len());
        for (name, t) in batch {
            let len = t.bytes();
            let mut bytes = vec![0u8; len];
            write_host_bytes(t, &mut bytes)?;
            let ptr = self.dev.alloc(len, false)?;
            self.track(len);
            self.dev.htod(ptr, &bytes)?;
            feeds.push(HeldFeed {
                name: name.clone(),
                ptr,
                ty: t.tensor_type(),
            });
        }
        self.held.push(feeds);
        Ok(Some(self.held.len() - 1))
    }

    fn feed_held(&mut self, id: usize) -> Result<HashMap<String, DeviceTensor>, KernelError> {
        self.no_capture("feeding a held batch")?;
        self.bind()?;
        let feeds: Vec<(String, u64, TensorType)> = self
            .held
            .get(id)
            .ok_or_else(|| invalid(format!("no held batch {id} (of {})", self.held.len())))?
            .iter()
            .map(|f| (f.name.clone(), f.ptr, f.ty.clone()))
            .collect();
        let mut out = HashMap::with_capacity(feeds.len());
        for (name, src, ty) in feeds {
            let len = ty.bytes();
            let dst = self.named_buffer(&name, len)?.ptr;
            self.dev.copy(dst, src, len)?;
            out.insert(name, DeviceTensor { ptr: dst, ty });
        }
        Ok(out)
    }

    fn to_host(&mut self, v: DeviceValue) -> Result<Value, KernelError> {
        if self.capturing {
            // Under a capture nothing has run, so there is nothing to read: the only
            // caller on a one-device plan is an `output` sink (every `minimize` of a
            // loss with a prediction adds `prediction` and `target` sinks, which the
            // training plan runs too), and the captured step's outputs are dropped
            // (replays produce none). Zeros of the value's type keep the run going;
            // refusing would make every such graph uncapturable.
            return Ok(placeholder(&v.ty));
        }
        self.await_collectives(&[v.ptr])?;
        self.read_value(&v)
    }

    fn from_host(
        &mut self,
        at: Option<(NodeId, usize)>,
        v: Value,
    ) -> Result<DeviceValue, KernelError> {
        self.bind()?;
        // The node output's IR type (slices at their row bound, as its planned buffer
        // is sized), else the value's own.
        let ty = at
            .and_then(|(n, p)| self.graph.get(n).and_then(|node| node.outputs.get(p)))
            .cloned()
            .unwrap_or_else(|| v.value_type());
        let bytes = match &v {
            Value::Tensor(t) => host_bytes(t)?,
            Value::Slices(s) => {
                let layout = codegen::SlicesLayout::of(&ty)
                    .ok_or_else(|| invalid("slices without a slices type"))?;
                let vals = host_bytes(&s.values)?;
                if s.indices.len() > layout.nnz || vals.len() != 4 * layout.row * s.indices.len() {
                    return Err(invalid(format!(
                        "slices of {} rows ({} value bytes) do not fit {ty} (at most {} rows of {})",
                        s.indices.len(),
                        vals.len(),
                        layout.nnz,
                        layout.row
                    )));
                }
                let mut b = vec![0u8; layout.bytes];
                let n = i32::try_from(s.indices.len()).map_err(|_| invalid("too many rows"))?;
                b[..4].copy_from_slice(&n.to_ne_bytes());
                for (k, i) in s.indices.iter().enumerate() {
                    let at = layout.indices_offset + 4 * k;
                    b[at..at + 4].copy_from_slice(&i.to_ne_bytes());
                }
                b[layout.values_offset..layout.values_offset + vals.len()].copy_from_slice(&vals);
                b
            }
        };
        // Into the output's planned buffer when it has one: a step allocates nothing.
        if let Some(&off) = at.and_then(|k| self.out_offsets.get(&k)) {
            self.no_capture("copying a value in")?;
            if bytes.len() > codegen::value_bytes(&ty) {
                return Err(invalid(format!(
                    "a {}-byte value does not fit the {}-byte buffer of {ty}",
                    bytes.len(),
                    codegen::value_bytes(&ty)
                )));
            }
            let ptr = self.arena_base + off as u64;
            self.dev.htod(ptr, &bytes)?;
            self.dev.synchronize()?;
            return Ok(DeviceValue { ptr, ty });
        }
        let ptr = self.owned_copy(&bytes)?;
        Ok(DeviceValue { ptr, ty })
    }

    fn host_tensor<'s>(
        &mut self,
        v: ValueRef<'s, DeviceValue, DeviceTensor>,
    ) -> Result<Cow<'s, Tensor>, KernelError> {
        match v {
            ValueRef::Tensor(t) => Ok(Cow::Owned(self.read_dense(t.ptr, &t.ty)?)),
            ValueRef::Value(v) => match &v.ty {
                ValueType::Tensor(t) => {
                    self.await_collectives(&[v.ptr])?;
                    Ok(Cow::Owned(self.read_dense(v.ptr, t)?))
                }
                t => Err(invalid(format!("needs a tensor, got {t}"))),
            },
        }
    }

    fn read_scalar(
        &mut self,
        v: ValueRef<'_, DeviceValue, DeviceTensor>,
    ) -> Result<Option<f64>, KernelError> {
        self.bind()?;
        let (ptr, ty) = match v {
            ValueRef::Tensor(t) => (t.ptr, t.ty.clone()),
            ValueRef::Value(v) => match &v.ty {
                ValueType::Tensor(t) => (v.ptr, t.clone()),
                t => return Err(invalid(format!("the loss must be a scalar, got {t}"))),
            },
        };
        if ty.dtype != DType::F32 || ty.dims().iter().product::<usize>() != 1 {
            return Err(invalid(format!("the loss must be one f32, got {ty}")));
        }
        self.await_collectives(&[ptr])?;
        if self.capturing {
            // Kept aside within the graph (its arena slot is reused later in the step),
            // copied out after each replay into a slot of its own (`pending_scalar`).
            let (most, read) = self.capture_scalars;
            if read == most {
                return Err(invalid(format!(
                    "more than the {most} scalars the capture was begun or joined for \
                     were read"
                )));
            }
            self.dev.copy(self.loss_ptr + 4 + 4 * read as u64, ptr, 4)?;
            self.capture_scalars.1 += 1;
            return Ok(None);
        }
        let mut x = [0u8; 4];
        self.dev.read(ptr, &mut x)?;
        Ok(Some(f64::from(f32::from_ne_bytes(x))))
    }

    fn pending_scalar(&mut self) -> Result<Option<f64>, KernelError> {
        let Some(done) = self.pending.pop_front() else {
            return Ok(None);
        };
        self.no_capture("reading the loss")?;
        self.bind()?;
        // A replay's bytes count once its step is read, so that a step's metrics
        // hold its own collectives when the next step is already issued.
        self.count_replayed_bytes();
        let Some(slot) = done.slot else {
            return Ok(None);
        };
        // Waits for that replay's copy out, not for the replays issued after it.
        let b = self.dev.host_bytes(self.loss_slots[slot])?;
        let skipped = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) != 0;
        // Summed as the eager step sums its micro-batches' losses.
        let loss: f64 = f32s(&b[4..4 + 4 * done.losses]).sum();
        if done.scaled {
            self.last_finite = Some(!skipped);
            if !skipped {
                self.opt_steps.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok((done.losses > 0).then_some(loss))
    }

    fn synchronize(&mut self) -> Result<(), KernelError> {
        self.no_capture("synchronizing")?;
        self.bind()?;
        self.await_all_collectives()?;
        Ok(self.dev.synchronize()?)
    }

    fn runs_asynchronously(&self) -> bool {
        true
    }

    fn mark(&mut self) -> Result<(), KernelError> {
        self.no_capture("recording a time mark")?;
        self.bind()?;
        Ok(self.dev.mark()?)
    }

    fn mark_times(&mut self) -> Result<Vec<f64>, KernelError> {
        self.synchronize()?;
        Ok(self.dev.mark_times()?)
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        Some((self.allocated, self.peak))
    }

    fn peak_flops(&self, products: DType) -> Option<DevicePeak> {
        // The emulator is no GPU of the table: it has no peak to measure against.
        let products = Products::of(products, self.opts.tf32);
        let (flops_per_sec, source) = datasheet_peak(&self.device_name, products)?;
        let uuid = self.dev.uuid().ok()?;
        Some(DevicePeak {
            device: format!(
                "cuda:{}",
                uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ),
            flops_per_sec,
            source,
        })
    }
}

impl OptimizerState for CudaBackend {
    type Optimizer = CudaOptimizer;

    fn optimizer(
        &mut self,
        spec: &OptimizerSpec,
        no_decay: &[String],
        lazy: bool,
        params: &HashMap<String, DeviceTensor>,
    ) -> Result<CudaOptimizer, KernelError> {
        self.no_capture("creating the optimizer")?;

        self.bind()?;
        // Each trained variable's type and, for a sparse gradient, its row bound.
        let mut vars: Vec<(String, TensorType, Option<usize>)> = Vec::new();
        for id in self.graph.node_ids() {
            if let Op::ParamGrad { param } = self.graph.op(id) {
                let t = params.get(param).ok_or_else(|| {
                    invalid(format!(
                        "variable `{param}` has a gradient but was not uploaded"
                    ))
                })?;
                let gty = self
                    .graph
                    .node(id)
                    .inputs
                    .first()
                    .and_then(|v| self.graph.try_value_type(*v))
                    .ok_or_else(|| invalid(format!("{id} (param_grad): no input")))?;
                vars.push((param.clone(), t.ty.clone(), codegen::sparse_bound(gty)));
            }
        }
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars.dedup_by(|a, b| a.0 == b.0);
        let OptimizerPlan {
            source,
            slot_names,
            vars: updates,
        } = codegen::optimizer_kernels(spec, no_decay, lazy, &vars, &self.copy_types(), 1.0)
            .map_err(CudaError::from)?;
        let funcs = if updates.iter().any(|u| !u.launches.is_empty()) {
            let mut names = Vec::new();
            for u in &updates {
                kernel_names(u.launches.iter(), &mut names);
            }
            load_functions(self.dev.as_mut(), &source, "distc_optimizer.cu", &names)?
        } else {
            HashMap::new()
        };
        let mut states = HashMap::new();
        let mut scratch_size = 0usize;
        let mut slot_bytes = 0u64;
        for (u, (name, ty, _)) in updates.into_iter().zip(&vars) {
            let mut slot_ptrs = Vec::new();
            for _ in slot_names.iter() {
                slot_ptrs.push(self.dev.alloc(ty.bytes(), true)?);
                self.track(ty.bytes());
                slot_bytes += ty.bytes() as u64;
            }
            let mut at = 0usize;
            let mut scratch_offsets = Vec::new();
            for &b in &u.scratch_bytes {
                scratch_offsets.push(at);
                at += b.div_ceil(ALIGN) * ALIGN;
            }
            scratch_size = scratch_size.max(at);
            states.insert(
                name.clone(),
                VarState {
                    ty: ty.clone(),
                    update: u,
                    slot_ptrs,
                    scratch_offsets,
                },
            );
        }
        let scratch_base = if scratch_size > 0 {
            self.track(scratch_size);
            self.dev.alloc(scratch_size, false)?
        } else {
            0
        };
        self.dev.synchronize()?;
        let rate = codegen::Rate::of(spec);
        self.rate = Some(rate.clone());
        Ok(CudaOptimizer {
            funcs,
            rate,
            done: self.opt_steps.clone(),
            vars: states,
            scratch_base,
            slot_bytes,
            slot_names,
        })
    }

    /// A device copy into the variable's buffer, so a captured step writes it too.
    fn assign(
        &mut self,
        params: &mut HashMap<String, DeviceTensor>,
        assigned: Vec<(String, DeviceValue)>,
    ) -> Result<(), KernelError> {
        self.bind()?;
        self.await_all_collectives()?;
        for (name, v) in assigned {
            let dst = params
                .get(&name)
                .ok_or_else(|| invalid(format!("assigns `{name}`, which it does not hold")))?;
            if v.ty != ValueType::Tensor(dst.ty.clone()) {
                return Err(invalid(format!(
                    "assigns {} to `{name}`, which is {}",
                    v.ty, dst.ty
                )));
            }
            let bytes = codegen::value_bytes(&v.ty);
            self.dev.copy(dst.ptr, v.ptr, bytes)?;
            if let Some(c) = self.copies.get_mut(&name) {
                c.of = None;
            }
        }
        Ok(())
    }

    fn update(
        &mut self,
        opt: &mut CudaOptimizer,
        params: &mut HashMap<String, DeviceTensor>,
        grads: Vec<(String, DeviceValue)>,
    ) -> Result<(), KernelError> {
        self.bind()?;
        if !self.capturing {
            self.write_steps()?;
        }
        self.await_all_collectives()?;
        let opt_step = self.steps_ptr + 8;
        for (name, g) in &grads {
            let var = opt.vars.get(name).ok_or_else(|| {
                invalid(format!(
                    "`{name}`: a gradient for a variable the optimizer does not update"
                ))
            })?;
            let p = params
                .get(name)
                .ok_or_else(|| invalid(format!("variable `{name}` is not on the device")))?;
            let what = || format!("the update of `{name}`");
            let copy = self.copies.get(name).map(|c| c.ptr);
            let arg = |k: &KArg| -> Result<ArgVal, KernelError> {
                Ok(match k {
                    KArg::Param => ArgVal::U64(p.ptr),
                    KArg::WeightCopy => ArgVal::U64(copy.ok_or_else(|| {
                        invalid(format!("{}: no 16-bit copy (prepare not run?)", what()))
                    })?),
                    KArg::Grad => ArgVal::U64(g.ptr),
                    KArg::Slot(i) => ArgVal::U64(
                        *var.slot_ptrs
                            .get(*i)
                            .ok_or_else(|| invalid(format!("{}: no slot {i}", what())))?,
                    ),
                    KArg::Step => ArgVal::U64(opt_step),
                    KArg::Scratch(s) => ArgVal::U64(
                        opt.scratch_base
                            + *var
                                .scratch_offsets
                                .get(*s)
                                .ok_or_else(|| invalid(format!("{}: no scratch {s}", what())))?
                                as u64,
                    ),
                    KArg::I32(_) | KArg::U32(_) | KArg::F32(_) | KArg::U64(_) => {
                        return ArgVal::scalar(k, &OUTSIDE_NODES).unwrap_or_else(|| {
                            Err(invalid(format!("{}: {k:?} is not a value", what())))
                        })
                    }
                    other => return Err(invalid(format!("{}: node argument {other:?}", what()))),
                })
            };
            let g_extent = read_extent(&g.ty);
            let extent = |k: &KArg| -> Option<(usize, Access)> {
                match k {
                    KArg::Param | KArg::Slot(_) => Some((var.ty.bytes(), Access::ReadWrite)),
                    // Two bytes an element (bf16 or f16).
                    KArg::WeightCopy => Some((2 * var.ty.shape.numel(), Access::Write)),
                    KArg::Grad => Some(g_extent),
                    // The step, the rate (`codegen::Rate`) and the skip flag.
                    KArg::Step => Some(((SKIP_AT + 4 - 8) as usize, Access::Read)),
                    KArg::Scratch(s) => var
                        .update
                        .scratch_bytes
                        .get(*s)
                        .map(|&b| (b, Access::Write)),
                    _ => None,
                }
            };
            let args = Args {
                value: &arg,
                extent: &extent,
                what: &what,
            };
            issue(self.dev.as_mut(), &var.update.launches, &opt.funcs, &args)?;
            let p = p.ptr;
            if let Some(c) = self.copies.get_mut(name) {
                c.of = Some(p);
            }
        }
        if self.capturing {
            // Recorded, not run: the replay counts the step.
            self.capture_update = true;
        } else {
            self.opt_steps.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    // On the device, then one 4-byte read of the overflow flag: the host must know
    // whether to skip the step, as PyTorch's GradScaler reads its found-inf flag.
    fn unscale(
        &mut self,
        grads: &mut [(String, DeviceValue)],
        factor: f64,
        bounds: &OverflowBounds,
    ) -> Result<bool, KernelError> {
        if self.unscale.is_none() {
            // Gradients clipped by a plan without fp16: the same kernels, compiled on
            // first use.
            self.no_capture("compiling the gradient-scaling kernels")?;
            self.bind()?;
            let (source, dense, slices) = codegen::unscale_unit();
            let names = [dense.clone(), slices.clone()];
            let funcs = load_functions(self.dev.as_mut(), &source, "distc_unscale.cu", &names)?;
            self.funcs.extend(funcs);
            let flag = self.dev.alloc(4, true)?;
            self.unscale = Some(Unscale {
                dense,
                slices,
                flag,
            });
        }
        let flag = self.unscale.as_ref().map_or(0, |u| u.flag);
        self.no_capture("unscaling the gradients")?;
        self.bind()?;
        self.unscale_factor = factor as f32;
        self.write_steps()?;
        self.scale_gradients(grads, flag, bounds)?;
        let mut bad = [0u8; 4];
        self.dev.read(flag, &mut bad)?;
        Ok(i32::from_ne_bytes(bad) == 0)
    }

    // The rate lives beside the step in device memory: a schedule moves it there before
    // each update or replay, so captured graphs follow it too.
    fn follow_schedule(
        &mut self,
        opt: &mut CudaOptimizer,
        schedule: &LrSchedule,
        total: u64,
    ) -> Result<(), KernelError> {
        self.no_capture("following a learning-rate schedule")?;
        self.bind()?;
        opt.rate.follow(schedule, total);
        self.rate = Some(opt.rate.clone());
        Ok(self.write_steps()?)
    }

    fn learning_rate(opt: &CudaOptimizer, ahead: u64) -> Option<f64> {
        let done = opt.done.load(Ordering::Relaxed);
        Some(opt.rate.lr(done.saturating_sub(ahead)))
    }

    // Dense gradients on the device: each cut into at most SQUARE_BLOCKS blocks, each
    // block's squares summed in f64 in a fixed order, and the partials of every gradient
    // read back at once and added on the host in order (a clipped step is never
    // captured: the host needs the norm before the update). Slices are read back and
    // summed as the CPU sums them (duplicate rows added first); they are small.
    fn grad_squares(&mut self, grads: &[(String, DeviceValue)]) -> Result<Vec<f64>, KernelError> {
        self.no_capture("measuring the gradient's norm")?;
        self.bind()?;
        self.await_all_collectives()?;
        // Per gradient: its elements, blocks and first partial, when dense f32.
        let mut cuts: Vec<Option<(usize, usize, usize)>> = Vec::with_capacity(grads.len());
        let mut total = 0;
        for (_, g) in grads {
            let dense = g.ty.dense_type();
            let cut = match (&g.ty, dense.dtype) {
                (ValueType::Tensor(_), DType::F32) => {
                    let n: usize = dense.dims().iter().product();
                    let blocks = n.div_ceil(codegen::BLOCK as usize).clamp(1, SQUARE_BLOCKS);
                    total += blocks;
                    Some((n, blocks, total - blocks))
                }
                _ => None,
            };
            cuts.push(cut);
        }
        if total > 0 && self.grad_norm.as_ref().is_none_or(|n| n.capacity < total) {
            let kernel = match self.grad_norm.take() {
                Some(n) => n.kernel,
                None => {
                    let (source, name) = codegen::square_partials_unit();
                    let names = [name.clone()];
                    let funcs =
                        load_functions(self.dev.as_mut(), &source, "distc_grad_norm.cu", &names)?;
                    self.funcs.extend(funcs);
                    name
                }
            };
            let partials = self.dev.alloc(8 * total, false)?;
            self.allocated += (8 * total) as u64;
            self.peak = self.peak.max(self.allocated);
            self.grad_norm = Some(GradNorm {
                kernel,
                partials,
                capacity: total,
            });
        }
        if let Some(norm) = &self.grad_norm {
            for ((name, g), cut) in grads.iter().zip(&cuts) {
                let Some((n, blocks, first)) = *cut else {
                    continue;
                };
                let out = norm.partials + 8 * first as u64;
                let launch = Launch::Kernel {
                    name: norm.kernel.clone(),
                    grid: [blocks as u32, 1, 1],
                    block: [codegen::BLOCK, 1, 1],
                    shared_bytes: 0,
                    args: vec![KArg::Grad, KArg::U64(n as u64), KArg::Scratch(0)],
                };
                issue_over_gradient(
                    self.dev.as_mut(),
                    &self.funcs,
                    launch,
                    (g.ptr, 4 * n, Access::Read),
                    &[(out, 8 * blocks, Access::Write)],
                    &|| format!("the squares of the gradient of `{name}`"),
                )?;
            }
        }
        let mut bytes = vec![0u8; 8 * total];
        if let Some(norm) = &self.grad_norm {
            if total > 0 {
                self.dev.read(norm.partials, &mut bytes)?;
            }
        }
        let partial = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[8 * i..8 * i + 8]);
            f64::from_ne_bytes(w)
        };
        grads
            .iter()
            .zip(&cuts)
            .map(|((_, g), cut)| match *cut {
                Some((_, blocks, first)) => Ok((first..first + blocks).map(partial).sum()),
                None => self.read_value(g)?.square_sum().map_err(invalid),
            })
            .collect()
    }

    fn optimizer_bytes(opt: &CudaOptimizer) -> u64 {
        opt.slot_bytes
    }

    // The state's names and types are the CPU optimizer's (`VAR/SLOT`, and the step
    // count under STEP_KEY), so a training state moves between devices.
    fn optimizer_state(
        &mut self,
        opt: &CudaOptimizer,
    ) -> Result<Vec<(String, Tensor)>, KernelError> {
        self.no_capture("reading the optimizer state")?;
        self.bind()?;
        self.await_all_collectives()?;
        self.dev.synchronize()?;
        let mut names: Vec<&String> = opt.vars.keys().collect();
        names.sort();
        let mut out = Vec::new();
        for name in names {
            let var = &opt.vars[name];
            for (slot, ptr) in opt.slot_names.iter().zip(&var.slot_ptrs) {
                out.push((format!("{name}/{slot}"), self.read_dense(*ptr, &var.ty)?));
            }
        }
        out.push((
            STEP_KEY.to_string(),
            Tensor::F64(ndarray::arr0(self.opt_done() as f64).into_dyn()),
        ));
        Ok(out)
    }

    fn load_optimizer_state(
        &mut self,
        opt: &mut CudaOptimizer,
        state: &HashMap<String, Tensor>,
    ) -> Result<(), KernelError> {
        self.no_capture("loading the optimizer state")?;
        self.bind()?;
        for (name, var) in &opt.vars {
            for (slot, ptr) in opt.slot_names.iter().zip(&var.slot_ptrs) {
                let key = format!("{name}/{slot}");
                let Some(t) = state.get(&key) else {
                    return Err(invalid(format!(
                        "optimizer state: variable `{name}` lacks its slot `{key}`"
                    )));
                };
                if t.tensor_type() != var.ty {
                    return Err(invalid(format!(
                        "optimizer state: `{key}` is {}, the variable is {}",
                        t.tensor_type(),
                        var.ty
                    )));
                }
                self.dev.htod(*ptr, &host_bytes(t)?)?;
            }
        }
        if let Some(t) = state.get(STEP_KEY) {
            let steps = crate::core::checkpoint::step_count(t)
                .map_err(|e| invalid(format!("optimizer state: {e}")))?;
            self.opt_steps.store(steps, Ordering::Relaxed);
            self.write_steps()?;
        }
        self.dev.synchronize()?;
        Ok(())
    }

    fn optimizer_slots(opt: &CudaOptimizer) -> &'static [&'static str] {
        opt.slot_names
    }
}

impl Capture for CudaBackend {
    // A collective on the host is a round trip no graph can hold; NCCL collectives
    // on device buffers are captured with the step.
    fn can_capture(&self, schedule: &Schedule) -> bool {
        self.opts.graphs
            && (!schedule.has_collective(Mode::Train)
                || self
                    .graph
                    .node_ids()
                    .into_iter()
                    .filter(|&id| self.graph.op(id).is_collective())
                    .all(|id| self.nccl_runs(id)))
    }

    fn begin_capture(&mut self, scalars: usize) -> Result<bool, KernelError> {
        if !self.opts.graphs {
            return Ok(false);
        }
        self.no_capture("starting a capture")?;
        self.bind()?;
        self.reserve_losses(scalars)?;
        // Counters on the device are current (the graph reads them at each replay).
        self.write_steps()?;
        self.dev.begin_capture()?;
        self.capturing = true;
        self.capture_update = false;
        self.capture_scaled = false;
        self.capture_bytes_at = self.nccl_bytes();
        Ok(true)
    }

    fn end_capture(&mut self) -> Result<(), KernelError> {
        if !self.capturing {
            return Err(invalid("end_capture without begin_capture"));
        }
        // Every collective's stream joins the captured one before the capture ends.
        self.await_all_collectives()?;
        self.capturing = false;
        self.bind()?;
        if !self.dev.end_capture()? {
            return Err(invalid("the captured CUDA graph is empty"));
        }
        self.graph_losses = self.capture_scalars.1;
        self.graph_update = self.capture_update;
        self.graph_scaled = self.capture_scaled && self.capture_update;
        self.count_recorded_bytes();
        self.pending.clear();
        Ok(())
    }

    fn join_capture(&mut self, scalars: usize) -> Result<bool, KernelError> {
        if !self.opts.graphs {
            return Ok(false);
        }
        self.no_capture("joining a capture")?;
        self.bind()?;
        self.reserve_losses(scalars)?;
        self.write_steps()?;
        self.capturing = true;
        self.joined = true;
        self.capture_bytes_at = self.nccl_bytes();
        Ok(true)
    }

    fn leave_capture(&mut self) -> Result<(), KernelError> {
        if !self.joined {
            return Err(invalid("leave_capture without join_capture"));
        }
        // This backend's collectives join the captured stream before the sibling
        // ends the capture.
        self.await_all_collectives()?;
        self.capturing = false;
        self.joined = false;
        self.graph_losses = self.capture_scalars.1;
        self.count_recorded_bytes();
        Ok(())
    }

    fn replayed_scalars(&mut self) -> Result<Vec<f64>, KernelError> {
        self.no_capture("reading the replayed scalars")?;
        self.bind()?;
        self.count_replayed_bytes();
        let mut b = vec![0u8; 4 * self.graph_losses];
        if !b.is_empty() {
            self.dev.read(self.loss_ptr + 4, &mut b)?;
        }
        Ok(f32s(&b).collect())
    }

    // The factor and the flag are the counters' (written before each replay, read by
    // the update kernels), so neither the scale nor the skip is a host round trip.
    fn unscale_on_device(
        &mut self,
        grads: &mut [(String, DeviceValue)],
        over_workers: bool,
        bounds: &OverflowBounds,
    ) -> Result<(), KernelError> {
        if !self.capturing {
            return Err(invalid(
                "unscaling on the device outside a capture: use unscale, which says whether \
                 the gradients were finite",
            ));
        }
        if self.unscale.is_none() {
            return Err(invalid(
                "the plan scales no loss: it has no gradient-scaling kernels to capture",
            ));
        }
        let flag = self.steps_ptr + SKIP_AT;
        self.scale_gradients(grads, flag, bounds)?;
        if over_workers {
            // Summed in place on each axis's communicator (captured with the step),
            // and waited for before the update reads it.
            let ty = ValueType::Tensor(TensorType::f32(vec![1]));
            let sum = Op::AllReduce {
                reduce: distc_ir::ReduceOp::Sum,
                ranks_per_node: 0,
            };
            for axis in [Axis::Data, Axis::Model] {
                if let Some(comm) = self.nccl[axis.index()].as_mut() {
                    comm.issue(SKIP_FLAG_NODE, &sum, flag, &ty, flag, &ty)?;
                    comm.order_after(SKIP_FLAG_NODE)?;
                }
            }
        }
        // Copied out with the losses after each replay.
        self.dev.copy(self.loss_ptr, flag, 4)?;
        self.capture_scaled = true;
        Ok(())
    }

    fn set_unscale_factor(&mut self, factor: f64) -> Result<(), KernelError> {
        self.no_capture("setting the unscaling factor")?;
        self.bind()?;
        self.unscale_factor = factor as f32;
        Ok(self.write_steps()?)
    }

    fn replayed_finite(&mut self) -> Option<bool> {
        self.last_finite.take()
    }

    fn replay(&mut self) -> Result<(), KernelError> {
        self.no_capture("replaying")?;
        self.bind()?;
        // The graph reads the counters from device memory: make them current.
        self.write_steps()?;
        if self.pending.len() >= LOSS_SLOTS {
            return Err(invalid(format!(
                "{LOSS_SLOTS} replayed steps are not read yet (pending_scalar): a loss slot \
                 would be overwritten"
            )));
        }
        self.dev.replay()?;
        if self.graph_update && !self.graph_scaled {
            self.opt_steps.fetch_add(1, Ordering::Relaxed);
        }
        let losses = self.graph_losses;
        let slot = (losses > 0 || self.graph_scaled).then_some(self.replays % LOSS_SLOTS);
        if let Some(slot) = slot {
            // The skip flag and the losses, side by side (`loss_ptr`).
            self.dev
                .download(self.loss_slots[slot], self.loss_ptr, 4 + 4 * losses)?;
        }
        if self.graph_scaled {
            // The flag may be raised: the next counters' copy clears it.
            self.dev_steps = None;
        }
        self.replays += 1;
        self.pending.push_back(PendingReplay {
            slot,
            losses,
            scaled: self.graph_scaled,
        });
        Ok(())
    }
}

impl DeviceCollectives for CudaBackend {
    fn start_collective(
        &mut self,
        node: NodeId,
        op: &Op,
        v: DeviceValue,
    ) -> Result<Started<DeviceValue>, KernelError> {
        if !self.nccl_runs(node) {
            return Ok(Started::Host(v));
        }
        // Under a capture the NCCL call and its events are recorded into the graph
        // (NCCL 2.9 and later); the communicator's scratch and events exist by then
        // (the warm-up steps made them), so nothing is allocated.
        self.bind()?;
        let out_ty = self
            .graph
            .node(node)
            .outputs
            .first()
            .cloned()
            .ok_or_else(|| invalid(format!("{node}: a collective with no output")))?;
        let off = *self.out_offsets.get(&(node, 0)).ok_or_else(|| {
            invalid(format!(
                "{node}: the collective's output has no buffer (prepare not run?)"
            ))
        })?;
        let out = self.arena_base + off as u64;
        // The input may itself be a collective's result still in flight.
        self.await_collectives(&[v.ptr])?;
        let nccl = self
            .comm_of(node)
            .ok_or_else(|| invalid("no NCCL communicator"))?;
        nccl.issue(node, op, v.ptr, &v.ty, out, &out_ty)?;
        let bytes = codegen::value_bytes(&out_ty) as u64;
        self.in_flight.push((out, out + bytes.max(1), node));
        Ok(Started::Device(DeviceValue {
            ptr: out,
            ty: out_ty,
        }))
    }

    fn runs_collective(&self, node: NodeId) -> bool {
        self.nccl_runs(node)
    }

    fn sends_messages(&self) -> bool {
        self.has_nccl(Axis::Pipe)
    }

    /// Sent on the compute stream, so no event orders it: the values' producers ran
    /// before it, and nothing after it overwrites them before the send has read them.
    fn send_message(&mut self, to: usize, values: &[&DeviceValue]) -> Result<(), KernelError> {
        self.bind()?;
        let ptrs: Vec<u64> = values.iter().map(|v| v.ptr).collect();
        self.await_collectives(&ptrs)?;
        let parts: Vec<(u64, usize)> = values
            .iter()
            .map(|v| (v.ptr, codegen::value_bytes(&v.ty)))
            .collect();
        let comm = self.nccl[Axis::Pipe.index()]
            .as_mut()
            .ok_or_else(|| invalid("no NCCL communicator among the stages"))?;
        Ok(comm.send(to, &parts)?)
    }

    fn recv_message(
        &mut self,
        from: usize,
        into: &[(String, TensorType)],
    ) -> Result<Vec<DeviceValue>, KernelError> {
        self.bind()?;
        let mut values = Vec::with_capacity(into.len());
        let mut parts = Vec::with_capacity(into.len());
        for (name, ty) in into {
            let bytes = ty.bytes();
            let ptr = self.message_buffer(name, bytes)?;
            parts.push((ptr, bytes));
            values.push(DeviceValue {
                ptr,
                ty: ValueType::Tensor(ty.clone()),
            });
        }
        let comm = self.nccl[Axis::Pipe.index()]
            .as_mut()
            .ok_or_else(|| invalid("no NCCL communicator among the stages"))?;
        comm.recv(from, &parts)?;
        Ok(values)
    }

    /// The arena's bytes are the next run's: a stash is copied out, on the stream.
    fn keep(&mut self, name: &str, v: DeviceValue) -> Result<DeviceValue, KernelError> {
        self.bind()?;
        self.await_collectives(&[v.ptr])?;
        let bytes = codegen::value_bytes(&v.ty);
        let ptr = self.message_buffer(name, bytes)?;
        if bytes > 0 {
            self.dev.copy(ptr, v.ptr, bytes)?;
        }
        Ok(DeviceValue { ptr, ty: v.ty })
    }

    fn collective_bytes(&self) -> ByteCount {
        let counted = self.nccl_bytes();
        ByteCount {
            sent: counted.sent - self.bytes_not_run.sent + self.bytes_replayed.sent,
            received: counted.received - self.bytes_not_run.received + self.bytes_replayed.received,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(rank: usize, model_rank: usize) -> KernelCtx {
        KernelCtx {
            rank,
            model_rank,
            ..OUTSIDE_NODES
        }
    }

    /// Every argument role is packed as the C type the codegen gives it: buffers as
    /// 64-bit addresses, scalars as their own 32- or 64-bit values.
    #[test]
    fn every_argument_is_packed_in_its_c_type() {
        let all = [
            KArg::Input(0),
            KArg::Output(1),
            KArg::Scratch(2),
            KArg::Step,
            KArg::Rank,
            KArg::ModelRank,
            KArg::Training,
            KArg::I32(-3),
            KArg::U32(7),
            KArg::F32(0.5),
            KArg::U64(1 << 40),
            KArg::Param,
            KArg::Grad,
            KArg::Slot(1),
        ];
        for k in &all {
            let class = CParam::of_arg(k);
            let v = match ArgVal::scalar(k, &ranks(3, 4)) {
                Some(v) => v.expect("packs"),
                // Buffers: a device address (`CUdeviceptr`, a u64).
                None => ArgVal::U64(0xdead_0000),
            };
            assert!(
                v.fits(class),
                "{k:?} packs as {v:?}, the kernel takes {class:?}"
            );
        }
        assert!(
            matches!(ArgVal::scalar(&KArg::U64(1 << 40), &OUTSIDE_NODES), Some(Ok(ArgVal::U64(x))) if x == 1 << 40)
        );
        assert!(matches!(
            ArgVal::scalar(
                &KArg::Training,
                &KernelCtx {
                    training: false,
                    ..OUTSIDE_NODES
                }
            ),
            Some(Ok(ArgVal::U32(0)))
        ));
        assert!(matches!(
            ArgVal::scalar(&KArg::Rank, &ranks(5, 2)),
            Some(Ok(ArgVal::U32(5)))
        ));
        assert!(matches!(
            ArgVal::scalar(&KArg::ModelRank, &ranks(5, 2)),
            Some(Ok(ArgVal::U32(2)))
        ));
        assert!(matches!(
            ArgVal::scalar(&KArg::Rank, &ranks(usize::MAX, 0)),
            Some(Err(_))
        ));
    }

    #[test]
    fn placeholders_have_the_value_type() {
        let t = TensorType::f32(vec![4, 3]);
        match placeholder(&ValueType::Tensor(t.clone())) {
            Value::Tensor(x) => {
                assert_eq!(x.tensor_type(), t);
                assert!(x.to_f64_vec().iter().all(|v| *v == 0.0));
            }
            other => panic!("{other:?}"),
        }
        let ids = TensorType::i32(vec![5]);
        assert!(
            matches!(placeholder(&ValueType::Tensor(ids.clone())), Value::Tensor(x) if x.tensor_type() == ids)
        );
        let ty = ValueType::IndexedSlices {
            dense: TensorType::f32(vec![10, 3]),
            nnz: 4,
        };
        match placeholder(&ty) {
            Value::Slices(s) => {
                assert!(s.indices.is_empty());
                assert_eq!(s.values.shape(), &[0, 3]);
                assert_eq!(s.dense_shape, vec![10, 3]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_value_of_the_wrong_size_or_kind_does_not_fit() {
        assert!(!ArgVal::U32(1).fits(CParam::B64));
        assert!(!ArgVal::U32(1).fits(CParam::Ptr));
        assert!(!ArgVal::U64(1).fits(CParam::U32));
        assert!(!ArgVal::I32(1).fits(CParam::F32));
        assert!(!ArgVal::F32(1.0).fits(CParam::I32));
        assert!(!ArgVal::I32(1).fits(CParam::U32));
        assert!(ArgVal::U64(1).fits(CParam::Ptr));
        assert!(ArgVal::U64(1).fits(CParam::B64));
    }
}
