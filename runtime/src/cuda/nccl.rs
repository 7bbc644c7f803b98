//! NCCL collectives on the CUDA backend's own buffers, and their bootstrap.
//!
//! # The communicator ([`NcclComm`])
//!
//! One NCCL communicator per worker, on a **stream of its own**. A collective of node
//! `n` is ordered by two events, never by the host: `ready` is recorded on the compute
//! stream when the node is reached (its input is written) and the communication stream
//! waits for it; `done` is recorded on the communication stream after the NCCL call,
//! and the backend makes the compute stream wait for it only where the result is first
//! read. So a bucket's all-reduce runs while the backward pass goes on computing the
//! next buckets, as Horovod and DDP overlap them.
//!
//! Because the collective reads its input after the compute stream has moved on, the
//! backend's memory plan keeps a collective's input alive until its result's last use
//! (see `CudaBackend::prepare`): no later kernel can write over a buffer NCCL is still
//! sending.
//!
//! | plan op | NCCL call |
//! |---|---|
//! | `all_reduce` (sum, mean) | `ncclAllReduce` input → output, `ncclSum` / `ncclAvg` |
//! | `broadcast` | `ncclBroadcast` input → output |
//! | `reduce_scatter` | `ncclReduceScatter` of the input padded with zeros to `chunk × N` (a scratch copy when the input is shorter) |
//! | `all_gather_dense` | `ncclAllGather` of the equal chunks, then the first `prod(shape)` elements copied out when the chunks were padded |
//! | `all_gather` (`IndexedSlices`) | `ncclAllGather` of each rank's whole slices buffer at its static row bound, then one kernel that compacts the gathered rows in rank order (and divides by N for a mean) |
//!
//! NCCL's all-gather wants the same count from every rank, while each worker's sparse
//! gradient has its own number of rows. Exchanging the counts first would make the
//! host wait for the device in the middle of the step. Instead every rank sends its
//! slices buffer at the type's row bound (the plan's static `nnz`), count included,
//! and the compaction kernel reads each part's count on the device: no host round
//! trip, at the price of sending the unused rows of the bound.
//!
//! Bytes are counted as the host communicators count them: the payload a ring would
//! carry per rank (all-reduce `2 (N-1)/N` of the buffer, reduce-scatter `(N-1)/N`,
//! all-gather `N-1` parts, broadcast once per link), padded where NCCL sends padding.
//!
//! # Bootstrap ([`bootstrap`])
//!
//! Over the workers' host communicator (in-process threads, or MPI ranks): every rank
//! reports whether it found the NCCL library and which GPU it runs on; all ranks take
//! the same decision from the same records. Rank 0 then creates the unique id and
//! broadcasts it, and every rank joins the communicator. NCCL refuses two ranks on one
//! GPU, so workers sharing a GPU use the host path.

use super::{drv_err, probe, CudaError, CudaLib, LibDirs};
use crate::comm::{ByteCount, Communicator};
use crate::core::error::{PeerKind, RuntimeError};
use cudarc::driver::{
    result as drv, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nccl::{result as nccl_result, sys as nccl_sys};
use distc_ir::{NodeId, Op, ReduceOp, ValueType};
use std::collections::HashMap;
use std::sync::Arc;

use super::codegen::SlicesLayout;

/// Which communicator a GPU plan's collectives use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Collectives {
    /// NCCL when every worker found the library and has a GPU of its own, else the
    /// host.
    #[default]
    Auto,
    /// NCCL, or an error saying why not.
    Nccl,
    /// The host: values are copied to the host and back around each collective.
    Host,
}

impl std::str::FromStr for Collectives {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Collectives::Auto),
            "nccl" => Ok(Collectives::Nccl),
            "host" => Ok(Collectives::Host),
            _ => Err(format!("`{s}`: expected auto, nccl or host")),
        }
    }
}

/// The kernel that compacts gathered slices buffers into one (see the module doc).
pub const COMPACT_SOURCE: &str = r#"
extern "C" __global__ void distc_nccl_compact_slices(
    const unsigned char* gathered, unsigned long long part_bytes, int nnz, int row,
    unsigned long long part_values, int parts, unsigned long long out_values,
    float scale, unsigned char* out)
{
    int r = blockIdx.y;
    int k = blockIdx.x;
    int before = 0, total = 0;
    for (int q = 0; q < parts; ++q) {
        int c = *(const int*)(gathered + (unsigned long long)q * part_bytes);
        c = c < 0 ? 0 : (c > nnz ? nnz : c);
        if (q < r) before += c;
        total += c;
    }
    if (r == 0 && k == 0 && threadIdx.x == 0) *(int*)out = total;
    const unsigned char* part = gathered + (unsigned long long)r * part_bytes;
    int count = *(const int*)part;
    count = count < 0 ? 0 : (count > nnz ? nnz : count);
    if (k >= count) return;
    int dst = before + k;
    if (threadIdx.x == 0) ((int*)(out + 4))[dst] = ((const int*)(part + 4))[k];
    const float* src = (const float*)(part + part_values) + (unsigned long long)k * row;
    float* o = (float*)(out + out_values) + (unsigned long long)dst * row;
    for (int j = threadIdx.x; j < row; j += blockDim.x) o[j] = src[j] * scale;
}

extern "C" __global__ void distc_nccl_interleave_parts(
    const float* in, unsigned long long outer, unsigned long long row, int parts,
    int to_parts, float* out)
{
    unsigned long long o = blockIdx.x;
    int p = blockIdx.y;
    unsigned long long by_part = ((unsigned long long)p * outer + o) * row;
    unsigned long long in_place = (o * parts + p) * row;
    const float* src = in + (to_parts ? in_place : by_part);
    float* dst = out + (to_parts ? by_part : in_place);
    for (unsigned long long j = threadIdx.x; j < row; j += blockDim.x) dst[j] = src[j];
}
"#;

/// The compaction kernel's name in [`COMPACT_SOURCE`].
pub const COMPACT_KERNEL: &str = "distc_nccl_compact_slices";

/// The kernel that moves a model-axis collective's parts between their places in the
/// whole, `[outer, parts, row]`, and rank after rank, `[parts, outer, row]`, where
/// they are not contiguous in the whole (a split dimension after the first): after a
/// gather (NCCL's all-gather leaves them rank after rank), and before a reduce-scatter
/// (`to_parts`: NCCL's reduce-scatter gives rank r the r-th run). In
/// [`COMPACT_SOURCE`]'s module.
pub const INTERLEAVE_KERNEL: &str = "distc_nccl_interleave_parts";

fn nccl_err(call: &'static str) -> impl Fn(nccl_result::NcclError) -> CudaError {
    // NcclError's Debug text is only "NcclError": the code is its field.
    move |e| CudaError::Nccl {
        call,
        code: format!("{:?}", e.0),
    }
}

/// A new NCCL unique id (rank 0's part of the bootstrap). The library is probed first,
/// so a missing one is an error naming it, never a panic.
pub fn unique_id(dirs: &LibDirs) -> Result<[u8; 128], CudaError> {
    probe(CudaLib::Nccl, dirs)?;
    let id = nccl_result::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
    let mut out = [0u8; 128];
    for (o, c) in out.iter_mut().zip(id.internal.iter()) {
        *o = *c as u8;
    }
    Ok(out)
}

/// One rank's line in the bootstrap: whether it found NCCL, and its GPU.
fn record(found: bool, gpu: &str) -> Vec<u8> {
    format!("{}\t{gpu}", u8::from(found)).into_bytes()
}

/// Whether the workers use NCCL, from every rank's record (the same answer on every
/// rank). `Err` when `mode` is [`Collectives::Nccl`] and NCCL cannot run: the message
/// names the ranks and why.
pub fn decide(mode: Collectives, records: &[Vec<u8>]) -> Result<bool, String> {
    if mode == Collectives::Host {
        return Ok(false);
    }
    let parsed: Vec<(bool, String)> = records
        .iter()
        .map(|r| {
            let text = String::from_utf8_lossy(r);
            let (found, gpu) = text.split_once('\t').unwrap_or(("0", ""));
            (found == "1", gpu.to_string())
        })
        .collect();
    let missing: Vec<String> = parsed
        .iter()
        .enumerate()
        .filter(|(_, (found, _))| !found)
        .map(|(r, _)| r.to_string())
        .collect();
    let mut shared = Vec::new();
    for (r, (_, gpu)) in parsed.iter().enumerate() {
        if let Some(first) = parsed[..r].iter().position(|(_, g)| g == gpu) {
            shared.push(format!("ranks {first} and {r} on GPU {gpu}"));
        }
    }
    match mode {
        Collectives::Nccl if !missing.is_empty() => Err(format!(
            "--collectives nccl: the NCCL library is missing on rank(s) {}",
            missing.join(", ")
        )),
        Collectives::Nccl if !shared.is_empty() => Err(format!(
            "--collectives nccl: NCCL runs one rank per GPU and refuses two ranks of one \
             communicator on the same GPU ({}); give each worker its own GPU (--gpus \
             0,1,...) or use --collectives host, which shares a GPU through the host",
            shared.join("; ")
        )),
        _ => Ok(missing.is_empty() && shared.is_empty()),
    }
}

/// The bootstrap over the workers' host communicator (see the module doc): `Some(id)`
/// when the workers use NCCL. `gpu` names this rank's GPU (its UUID). Every rank calls
/// it, in the same order as every other collective.
pub fn bootstrap(
    comm: &mut dyn Communicator,
    mode: Collectives,
    gpu: &str,
    dirs: &LibDirs,
) -> Result<Option<[u8; 128]>, RuntimeError> {
    if mode == Collectives::Host {
        return Ok(None);
    }
    let rank = comm.rank();
    let found = probe(CudaLib::Nccl, dirs);
    let records = comm.all_gather(record(found.is_ok(), gpu))?;
    match decide(mode, &records) {
        Ok(true) => {}
        Ok(false) => return Ok(None),
        // This rank's own missing library says best where to look.
        Err(m) => {
            return Err(match found {
                Err(e) => RuntimeError::Backend(Box::new(e)),
                Ok(_) => RuntimeError::Config(m),
            })
        }
    }
    // A flag byte before the id: rank 0 failing to create one still broadcasts, so
    // the other ranks stop with an error instead of waiting.
    let mut buf = vec![0u8; 129];
    let mut own = None;
    if rank == 0 {
        match unique_id(dirs) {
            Ok(id) => {
                buf[0] = 1;
                buf[1..].copy_from_slice(&id);
            }
            Err(e) => own = Some(e),
        }
    }
    comm.broadcast(&mut buf, 0)?;
    if let Some(e) = own {
        return Err(RuntimeError::Backend(Box::new(e)));
    }
    // Rank 0's own error is the cause; this rank's is its consequence.
    if buf[0] != 1 {
        return Err(RuntimeError::Peer {
            rank,
            peer: 0,
            op: "broadcast".into(),
            kind: PeerKind::HungUp,
            message: "rank 0 could not create the NCCL unique id (its error says why)".into(),
        });
    }
    let mut id = [0u8; 128];
    id.copy_from_slice(&buf[1..]);
    Ok(Some(id))
}

/// An NCCL communicator handle; destroyed (after its work is done) on drop.
struct RawComm(nccl_sys::ncclComm_t);

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: the handle came from ncclCommInitRank and is destroyed once, here;
        // the backend synchronizes both streams before dropping the communicator.
        #[allow(unsafe_code)]
        unsafe {
            let _ = nccl_result::comm_destroy(self.0);
        }
    }
}

/// A collective's events: its input is ready (compute stream), its result is written
/// (communication stream).
struct Events {
    ready: CudaEvent,
    done: CudaEvent,
}

/// [`COMPACT_SOURCE`]'s kernels, loaded once a communicator (a split shares them).
#[derive(Clone)]
struct Kernels {
    compact: CudaFunction,
    interleave: CudaFunction,
    _module: Arc<CudaModule>,
}

/// The NCCL communicator of one CUDA backend (see the module doc).
pub struct NcclComm {
    // Dropped first: the communicator, then what it used.
    raw: RawComm,
    scratch: HashMap<NodeId, CudaSlice<u8>>,
    events: HashMap<NodeId, Events>,
    kernels: Kernels,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    rank: usize,
    size: usize,
    bytes: ByteCount,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// Joins the communicator of `size` ranks named by `id` as `rank`, on a new stream
    /// of `ctx`; `arch` is the device's (`sm_90`), for the compaction kernel. Blocks
    /// until every rank has joined (NCCL's `ncclCommInitRank`).
    pub fn new(
        ctx: &Arc<CudaContext>,
        arch: &str,
        rank: usize,
        size: usize,
        id: [u8; 128],
    ) -> Result<NcclComm, CudaError> {
        probe(CudaLib::Nccl, &LibDirs::from_env())?;
        // NCCL uses the calling thread's current device.
        ctx.bind_to_thread().map_err(drv_err("cuCtxSetCurrent"))?;
        let stream = ctx.new_stream().map_err(drv_err("cuStreamCreate"))?;
        let cubin = super::nvrtc::compile_cubin(COMPACT_SOURCE, "nccl_compact.cu", arch)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(drv_err("cuModuleLoadData"))?;
        let load = |name| {
            module
                .load_function(name)
                .map_err(drv_err("cuModuleGetFunction"))
        };
        let kernels = Kernels {
            compact: load(COMPACT_KERNEL)?,
            interleave: load(INTERLEAVE_KERNEL)?,
            _module: module.clone(),
        };
        let mut internal = [0 as std::ffi::c_char; 128];
        for (i, b) in internal.iter_mut().zip(id) {
            *i = b as std::ffi::c_char;
        }
        let n = i32::try_from(size).map_err(|_| CudaError::Invalid("too many ranks".into()))?;
        let r = i32::try_from(rank).map_err(|_| CudaError::Invalid("rank too large".into()))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by ncclCommInitRank before it is read (on success
        // only); the id is the one rank 0 created, as NCCL requires.
        #[allow(unsafe_code)]
        let raw = unsafe {
            nccl_result::comm_init_rank(
                comm.as_mut_ptr(),
                n,
                nccl_sys::ncclUniqueId { internal },
                r,
            )
            .map_err(nccl_err("ncclCommInitRank"))?;
            RawComm(comm.assume_init())
        };
        Ok(NcclComm::joined(raw, stream, kernels, ctx, rank, size))
    }

    /// A communicator just joined (`raw`), with nothing issued yet.
    fn joined(
        raw: RawComm,
        stream: Arc<CudaStream>,
        kernels: Kernels,
        ctx: &Arc<CudaContext>,
        rank: usize,
        size: usize,
    ) -> NcclComm {
        NcclComm {
            raw,
            scratch: HashMap::new(),
            events: HashMap::new(),
            kernels,
            stream,
            ctx: ctx.clone(),
            rank,
            size,
            bytes: ByteCount::default(),
        }
    }

    /// A second communicator of the same ranks, on a stream of its own (NCCL's
    /// `ncclCommSplit`, one colour, the same order): for a second program of this
    /// rank's worker (a pipeline stage's forward beside its backward), whose
    /// collectives keep their own events and scratch. Every rank must split, in the
    /// same order: it is a collective of this communicator.
    pub fn split(&self) -> Result<NcclComm, CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(drv_err("cuCtxSetCurrent"))?;
        let stream = self.ctx.new_stream().map_err(drv_err("cuStreamCreate"))?;
        let key =
            i32::try_from(self.rank).map_err(|_| CudaError::Invalid("rank too large".into()))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `self.raw` is a live communicator; `comm` is written by
        // ncclCommSplit before it is read (on success only); a null config asks for
        // the parent's.
        #[allow(unsafe_code)]
        let raw = unsafe {
            // cudarc's safe wrapper is configured out for CUDA 13; the symbol is there.
            nccl_sys::ncclCommSplit(self.raw.0, 0, key, comm.as_mut_ptr(), std::ptr::null_mut())
                .result()
                .map_err(nccl_err("ncclCommSplit"))?;
            RawComm(comm.assume_init())
        };
        let kernels = self.kernels.clone();
        Ok(NcclComm::joined(
            raw, stream, kernels, &self.ctx, self.rank, self.size,
        ))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes sent and received so far (see the module doc).
    pub fn bytes(&self) -> ByteCount {
        self.bytes
    }

    /// Whether NCCL runs `op` on an input of type `input` (f32 only).
    pub fn supports(op: &Op, input: &ValueType) -> bool {
        use distc_ir::DType;
        let dtype = input.dense_type().dtype;
        // The model axis: its sums, gathers and reduce-scatters (of equal parts). Parts
        // that are not contiguous in the whole are laid into place after a gather and
        // rank after rank before a reduce-scatter ([`NcclComm::interleaved`]).
        if op.is_model_collective() {
            let ValueType::Tensor(t) = input else {
                return false;
            };
            return dtype == DType::F32
                && match op {
                    Op::ModelAllReduce { .. } | Op::ModelGather { .. } => true,
                    Op::ModelReduceScatter { dim, parts } => {
                        *parts > 0 && t.dims().get(*dim).is_some_and(|d| d % parts == 0)
                    }
                    _ => false,
                };
        }
        // A 16-bit gradient wire's sums: NCCL reduces bf16 and fp16 itself.
        let wired = matches!(
            (op, input),
            (
                Op::AllReduce { .. } | Op::ReduceScatter { .. },
                ValueType::Tensor(_)
            )
        ) && matches!(dtype, DType::BF16 | DType::F16);
        wired
            || dtype == DType::F32
                && matches!(
                    (op, input),
                    (
                        Op::AllReduce { .. }
                            | Op::Broadcast { .. }
                            | Op::ReduceScatter { .. }
                            | Op::AllGatherDense { .. },
                        ValueType::Tensor(_),
                    ) | (Op::AllGather { .. }, ValueType::IndexedSlices { .. })
                )
    }

    /// For a model-axis gather or reduce-scatter whose parts are not contiguous in the
    /// whole (a dimension above 1 before the split one), `(outer, row)`: the whole is
    /// `[outer, parts, row]` where NCCL's all-gather leaves, and its reduce-scatter
    /// takes, `[parts, outer, row]` (`row`: a part's elements from the split dimension
    /// on). `None` for every other collective.
    pub(crate) fn interleaved(op: &Op, in_ty: &ValueType) -> Option<(usize, usize)> {
        let ValueType::Tensor(t) = in_ty else {
            return None;
        };
        let dims = t.dims();
        // The input is a part of a gather, the whole of a reduce-scatter.
        let (dim, parts) = match *op {
            Op::ModelGather { dim, .. } => (dim, 1),
            Op::ModelReduceScatter { dim, parts } => (dim, parts.max(1)),
            _ => return None,
        };
        let outer: usize = dims.iter().take(dim).product();
        let row = dims.iter().skip(dim).product::<usize>() / parts;
        (outer > 1).then_some((outer, row))
    }

    /// The data-axis collective NCCL runs for `op` (output type `out_ty`): itself, or
    /// for a model-axis collective of contiguous parts the equivalent one (a sum's
    /// all-reduce, an all-gather, a reduce-scatter of equal chunks).
    pub(crate) fn equivalent(op: &Op, out_ty: &ValueType) -> Op {
        match *op {
            Op::ModelAllReduce { .. } => Op::AllReduce {
                reduce: ReduceOp::Sum,
                ranks_per_node: 0,
            },
            Op::ModelGather { parts, .. } => Op::AllGatherDense {
                workers: parts,
                shape: out_ty.dense_type().shape.clone(),
            },
            Op::ModelReduceScatter { parts, .. } => Op::ReduceScatter {
                workers: parts,
                reduce: ReduceOp::Sum,
            },
            ref other => other.clone(),
        }
    }

    /// Waits, on `compute`, for node `node`'s collective to be done.
    pub fn order_after(&self, node: NodeId, compute: &CudaStream) -> Result<(), CudaError> {
        if let Some(ev) = self.events.get(&node) {
            compute
                .wait(&ev.done)
                .map_err(drv_err("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    /// A scratch buffer of `bytes` for node `node`, made on first use.
    fn scratch(&mut self, node: NodeId, bytes: usize) -> Result<u64, CudaError> {
        if !self.scratch.contains_key(&node) {
            // SAFETY: uninitialised; every use writes it (a copy, a memset or NCCL)
            // before reading it, on this stream.
            #[allow(unsafe_code)]
            let buf = unsafe { self.stream.alloc::<u8>(bytes.max(256)) }
                .map_err(drv_err("cuMemAllocAsync"))?;
            self.scratch.insert(node, buf);
        }
        let buf = &self.scratch[&node];
        let (p, _guard) = buf.device_ptr(&self.stream);
        Ok(p)
    }

    /// Copies `from` to `to` on the communicator's stream, the parts (each `outer` runs
    /// of `row`) from rank after rank into their places in the whole, or with
    /// `to_parts` back ([`NcclComm::interleaved`]).
    fn interleave(
        &self,
        node: NodeId,
        (from, to): (u64, u64),
        (outer, row): (usize, usize),
        to_parts: bool,
    ) -> Result<(), CudaError> {
        let parts = i32::try_from(self.size).map_err(|_| CudaError::Invalid("ranks".into()))?;
        let grid_x = u32::try_from(outer)
            .map_err(|_| CudaError::Invalid(format!("{node}: {outer} rows to interleave")))?;
        let cfg = LaunchConfig {
            grid_dim: (grid_x, self.size as u32, 1),
            block_dim: (row.clamp(1, 256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (outer, row) = (outer as u64, row as u64);
        let to_parts = i32::from(to_parts);
        let mut b = self.stream.launch_builder(&self.kernels.interleave);
        b.arg(&from)
            .arg(&outer)
            .arg(&row)
            .arg(&parts)
            .arg(&to_parts)
            .arg(&to);
        // SAFETY: the arguments are INTERLEAVE_KERNEL's parameters in order (pointers and
        // 64-bit sizes as u64, two ints); `from` and `to` each hold `outer parts row`
        // f32, and what wrote `from` (the gather, or the compute stream before the
        // collective's `ready` event) is ordered before, on this stream.
        #[allow(unsafe_code)]
        unsafe { b.launch(cfg) }.map_err(|e| CudaError::Driver {
            call: "cuLaunchKernel",
            code: format!("{:?} (kernel {INTERLEAVE_KERNEL}, {node})", e.0),
        })?;
        Ok(())
    }

    /// Sends (`send`) or receives the buffers `parts` (address, bytes) to or from rank
    /// `peer`, as one NCCL group on `stream` (the compute stream: a stage's messages
    /// are ordered with its kernels, with no event between them). Rendezvous: the
    /// stream goes on once the peer's matching group has run.
    pub fn point_to_point(
        &mut self,
        peer: usize,
        parts: &[(u64, usize)],
        send: bool,
        stream: &CudaStream,
    ) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(drv_err("cuCtxSetCurrent"))?;
        let to = i32::try_from(peer).map_err(|_| CudaError::Invalid("peer rank".into()))?;
        let s = stream.cu_stream() as nccl_sys::cudaStream_t;
        let bytes: usize = parts.iter().map(|p| p.1).sum();
        nccl_result::group_start().map_err(nccl_err("ncclGroupStart"))?;
        for &(ptr, len) in parts.iter().filter(|p| p.1 > 0) {
            // SAFETY: `ptr` is a live device buffer of `len` bytes on this
            // communicator's device; the peer posts the matching call with the same
            // count (both sides derive the message from the plan's types).
            #[allow(unsafe_code)]
            let r = unsafe {
                if send {
                    nccl_result::send(
                        ptr as *const _,
                        len,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        to,
                        self.raw.0,
                        s,
                    )
                } else {
                    nccl_result::recv(
                        ptr as *mut _,
                        len,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        to,
                        self.raw.0,
                        s,
                    )
                }
            };
            if let Err(e) = r {
                // Close the group before reporting, so the communicator stays usable.
                let _ = nccl_result::group_end();
                return Err(nccl_err(if send { "ncclSend" } else { "ncclRecv" })(e));
            }
        }
        nccl_result::group_end().map_err(nccl_err("ncclGroupEnd"))?;
        if send {
            self.count(bytes as u64, 0);
        } else {
            self.count(0, bytes as u64);
        }
        Ok(())
    }

    fn count(&mut self, sent: u64, received: u64) {
        self.bytes.sent += sent;
        self.bytes.received += received;
    }

    /// Issues node `node`'s collective `op` of the value at `input` (type `in_ty`)
    /// into `output` (type `out_ty`), after the work issued on `compute` so far. The
    /// caller orders readers of `output` with [`NcclComm::order_after`].
    #[allow(clippy::too_many_arguments)]
    pub fn issue(
        &mut self,
        node: NodeId,
        op: &Op,
        compute: &CudaStream,
        input: u64,
        in_ty: &ValueType,
        output: u64,
        out_ty: &ValueType,
    ) -> Result<(), CudaError> {
        let interleave = Self::interleaved(op, in_ty);
        let op = &Self::equivalent(op, out_ty);
        self.ctx
            .bind_to_thread()
            .map_err(drv_err("cuCtxSetCurrent"))?;
        if !self.events.contains_key(&node) {
            let ready = self.ctx.new_event(None).map_err(drv_err("cuEventCreate"))?;
            let done = self.ctx.new_event(None).map_err(drv_err("cuEventCreate"))?;
            self.events.insert(node, Events { ready, done });
        }
        {
            let ev = &self.events[&node];
            ev.ready.record(compute).map_err(drv_err("cuEventRecord"))?;
            self.stream
                .wait(&ev.ready)
                .map_err(drv_err("cuStreamWaitEvent"))?;
        }
        let n = self.size;
        let stream = self.stream.cu_stream();
        let nccl_stream = stream as nccl_sys::cudaStream_t;
        let comm = self.raw.0;
        let red = |r: &ReduceOp| match r {
            ReduceOp::Mean => nccl_sys::ncclRedOp_t::ncclAvg,
            ReduceOp::Sum => nccl_sys::ncclRedOp_t::ncclSum,
        };
        let f32t = nccl_sys::ncclDataType_t::ncclFloat32;
        // The element type of a reduction: f32, or a 16-bit wire's.
        let (wire, esize) = match in_ty.dense_type().dtype {
            distc_ir::DType::BF16 => (nccl_sys::ncclDataType_t::ncclBfloat16, 2),
            distc_ir::DType::F16 => (nccl_sys::ncclDataType_t::ncclFloat16, 2),
            _ => (f32t, 4),
        };
        let elems = |t: &ValueType| t.dense_type().dims().iter().product::<usize>();
        match (op, in_ty) {
            (Op::AllReduce { reduce, .. }, ValueType::Tensor(_)) => {
                let len = elems(in_ty);
                // SAFETY: `input` and `output` are live device buffers of `len` elements
                // of `wire` (the plan's types); the stream belongs to the communicator's
                // device.
                #[allow(unsafe_code)]
                unsafe {
                    nccl_result::all_reduce(
                        input as *const _,
                        output as *mut _,
                        len,
                        wire,
                        red(reduce),
                        comm,
                        nccl_stream,
                    )
                }
                .map_err(nccl_err("ncclAllReduce"))?;
            }
            (Op::Broadcast { root }, ValueType::Tensor(_)) => {
                let len = elems(in_ty);
                let root_i = i32::try_from(*root).map_err(|_| CudaError::Invalid("root".into()))?;
                // SAFETY: as for all-reduce; NCCL reads `input` on the root only.
                #[allow(unsafe_code)]
                unsafe {
                    nccl_result::broadcast(
                        input as *const _,
                        output as *mut _,
                        len,
                        f32t,
                        root_i,
                        comm,
                        nccl_stream,
                    )
                }
                .map_err(nccl_err("ncclBroadcast"))?;
            }
            (Op::ReduceScatter { workers, reduce }, ValueType::Tensor(_)) => {
                check_workers(op, *workers, n)?;
                let len = elems(in_ty);
                let chunk = len.div_ceil(n);
                let send = if let Some((outer, row)) = interleave {
                    // A model-axis part that is not contiguous in the whole: the parts
                    // laid rank after rank first.
                    let s = self.scratch(node, esize * len)?;
                    self.interleave(node, (input, s), (outer, row), true)?;
                    s
                } else if chunk * n == len {
                    input
                } else {
                    let s = self.scratch(node, esize * chunk * n)?;
                    // SAFETY: `s` holds `esize chunk n` bytes, `input` `esize len`; both
                    // copies are on this stream, before the NCCL call that reads `s`.
                    #[allow(unsafe_code)]
                    unsafe {
                        drv::memset_d8_async(s, 0, esize * chunk * n, stream)
                            .map_err(drv_err("cuMemsetD8Async"))?;
                        drv::memcpy_dtod_async(s, input, esize * len, stream)
                            .map_err(drv_err("cuMemcpyDtoDAsync"))?;
                    }
                    s
                };
                // SAFETY: `send` holds `chunk n` elements of `wire`, `output` `chunk`
                // (the op's type).
                #[allow(unsafe_code)]
                unsafe {
                    nccl_result::reduce_scatter(
                        send as *const _,
                        output as *mut _,
                        chunk,
                        wire,
                        red(reduce),
                        comm,
                        nccl_stream,
                    )
                }
                .map_err(nccl_err("ncclReduceScatter"))?;
            }
            (Op::AllGatherDense { workers, .. }, ValueType::Tensor(_)) => {
                check_workers(op, *workers, n)?;
                let chunk = elems(in_ty);
                let total = elems(out_ty);
                let recv = if chunk * n == total && interleave.is_none() {
                    output
                } else {
                    self.scratch(node, 4 * chunk * n)?
                };
                // SAFETY: `input` holds `chunk` f32, `recv` `chunk n`.
                #[allow(unsafe_code)]
                unsafe {
                    nccl_result::all_gather(
                        input as *const _,
                        recv as *mut _,
                        chunk,
                        f32t,
                        comm,
                        nccl_stream,
                    )
                }
                .map_err(nccl_err("ncclAllGather"))?;
                if let Some((outer, row)) = interleave {
                    self.interleave(node, (recv, output), (outer, row), false)?;
                } else if recv != output && total > 0 {
                    // SAFETY: `output` holds `total <= chunk n` f32; after the gather on
                    // this stream.
                    #[allow(unsafe_code)]
                    unsafe { drv::memcpy_dtod_async(output, recv, 4 * total, stream) }
                        .map_err(drv_err("cuMemcpyDtoDAsync"))?;
                }
            }
            (Op::AllGather { reduce, .. }, ValueType::IndexedSlices { .. }) => {
                let (Some(part), Some(whole)) = (SlicesLayout::of(in_ty), SlicesLayout::of(out_ty))
                else {
                    return Err(CudaError::Invalid("all_gather of non-slices".into()));
                };
                let recv = self.scratch(node, part.bytes * n)?;
                // SAFETY: `input` is a slices buffer of `part.bytes` bytes; `recv` holds
                // `n` of them.
                #[allow(unsafe_code)]
                unsafe {
                    nccl_result::all_gather(
                        input as *const _,
                        recv as *mut _,
                        part.bytes,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        comm,
                        nccl_stream,
                    )
                }
                .map_err(nccl_err("ncclAllGather"))?;
                let scale = if *reduce == ReduceOp::Mean {
                    1.0 / n as f32
                } else {
                    1.0
                };
                let nnz = i32::try_from(part.nnz).map_err(|_| CudaError::Invalid("nnz".into()))?;
                let row = i32::try_from(part.row).map_err(|_| CudaError::Invalid("row".into()))?;
                let parts = i32::try_from(n).map_err(|_| CudaError::Invalid("ranks".into()))?;
                let (part_bytes, part_values, out_values) = (
                    part.bytes as u64,
                    part.values_offset as u64,
                    whole.values_offset as u64,
                );
                let cfg = LaunchConfig {
                    grid_dim: (part.nnz.max(1) as u32, n as u32, 1),
                    block_dim: (part.row.clamp(1, 256) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.stream.launch_builder(&self.kernels.compact);
                b.arg(&recv)
                    .arg(&part_bytes)
                    .arg(&nnz)
                    .arg(&row)
                    .arg(&part_values)
                    .arg(&parts)
                    .arg(&out_values)
                    .arg(&scale)
                    .arg(&output);
                // SAFETY: the arguments are COMPACT_SOURCE's parameters in order and C
                // types (pointers and 64-bit sizes as u64, ints, a float); `recv` holds
                // `n` parts of `part.bytes`, `output` a slices buffer of the output
                // type, whose bound is `n nnz` rows.
                #[allow(unsafe_code)]
                unsafe { b.launch(cfg) }.map_err(|e| CudaError::Driver {
                    call: "cuLaunchKernel",
                    code: format!("{:?} (kernel {COMPACT_KERNEL}, {node})", e.0),
                })?;
            }
            (op, t) => {
                return Err(CudaError::Invalid(format!(
                    "{node}: NCCL has no {} of {t}",
                    op.mnemonic()
                )))
            }
        }
        let b = collective_bytes(op, in_ty, n, self.rank);
        self.count(b.sent, b.received);
        self.events[&node]
            .done
            .record(&self.stream)
            .map_err(drv_err("cuEventRecord"))?;
        Ok(())
    }
}

/// The bytes rank `rank` of `n` sends and receives in the collective `op` of a value
/// of type `in_ty`, as NCCL's ring moves them (and as the host path
/// counts them): what every communicator, real or emulated, reports.
pub(crate) fn collective_bytes(op: &Op, in_ty: &ValueType, n: usize, rank: usize) -> ByteCount {
    let elems = |t: &ValueType| t.dense_type().dims().iter().product::<usize>();
    let others = n.saturating_sub(1) as u64;
    let both = |b: u64| ByteCount {
        sent: b,
        received: b,
    };
    // A 16-bit wire's reductions move 2-byte elements.
    let esize = in_ty.dense_type().dtype.size() as u64;
    let wide = |b: ByteCount| ByteCount {
        sent: b.sent / 4 * esize,
        received: b.received / 4 * esize,
    };
    match (op, in_ty) {
        (Op::AllReduce { .. }, _) => wide(ring_all_reduce_bytes(elems(in_ty), n, rank)),
        (Op::Broadcast { root }, _) if n > 1 => {
            let b = 4 * elems(in_ty) as u64;
            ByteCount {
                sent: if (rank + 1) % n != *root { b } else { 0 },
                received: if rank != *root { b } else { 0 },
            }
        }
        (Op::ReduceScatter { .. }, _) => {
            both(esize * others * elems(in_ty).div_ceil(n.max(1)) as u64)
        }
        (Op::AllGatherDense { .. }, _) => both(4 * others * elems(in_ty) as u64),
        (Op::AllGather { .. }, ValueType::IndexedSlices { .. }) => {
            both(others * SlicesLayout::of(in_ty).map_or(0, |l| l.bytes) as u64)
        }
        _ => ByteCount::default(),
    }
}

pub(crate) fn check_workers(op: &Op, workers: usize, n: usize) -> Result<(), CudaError> {
    if workers == n {
        Ok(())
    } else {
        Err(CudaError::Invalid(format!(
            "{} for {workers} workers on an NCCL communicator of {n}",
            op.mnemonic()
        )))
    }
}

/// Bytes rank `rank` sends and receives in a ring all-reduce of `len` f32 over `n`
/// ranks, as the host ring moves them: the reduce-scatter sends every chunk but the
/// rank's own and receives every chunk but its predecessor's; the all-gather sends
/// every chunk but its successor's and receives every chunk but its own.
pub fn ring_all_reduce_bytes(len: usize, n: usize, rank: usize) -> ByteCount {
    if n <= 1 {
        return ByteCount::default();
    }
    let c = |i: usize| crate::comm::chunk_range(len, n, i % n).len();
    let (own, next, prev) = (c(rank), c(rank + 1), c(rank + n - 1));
    ByteCount {
        sent: 4 * (2 * len - own - next) as u64,
        received: 4 * (2 * len - prev - own) as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(found: bool, gpu: &str) -> Vec<u8> {
        record(found, gpu)
    }

    /// A 16-bit wire's reductions run on NCCL, in its element type and bytes; what
    /// NCCL cannot reduce in 16 bits (a broadcast of variables) stays f32-only.
    #[test]
    fn sixteen_bit_reductions_run_on_nccl_in_their_own_bytes() {
        use distc_ir::{DType, TensorType};
        let t = |d| ValueType::Tensor(TensorType::new(d, vec![10]));
        let mean = ReduceOp::Mean;
        let all_reduce = Op::AllReduce {
            reduce: mean,
            ranks_per_node: 0,
        };
        let scatter = Op::ReduceScatter {
            workers: 2,
            reduce: mean,
        };
        for d in [DType::F32, DType::BF16, DType::F16] {
            assert!(NcclComm::supports(&all_reduce, &t(d)), "{d}");
            assert!(NcclComm::supports(&scatter, &t(d)), "{d}");
        }
        assert!(!NcclComm::supports(
            &Op::Broadcast { root: 0 },
            &t(DType::BF16)
        ));
        let f32_bytes = collective_bytes(&all_reduce, &t(DType::F32), 2, 0);
        let bf16_bytes = collective_bytes(&all_reduce, &t(DType::BF16), 2, 0);
        assert_eq!(bf16_bytes.sent * 2, f32_bytes.sent);
        assert_eq!(collective_bytes(&scatter, &t(DType::F16), 2, 1).sent, 2 * 5);
    }

    #[test]
    fn nccl_needs_the_library_on_every_rank_and_a_gpu_per_rank() {
        let distinct = [rec(true, "GPU-a"), rec(true, "GPU-b")];
        assert_eq!(decide(Collectives::Auto, &distinct), Ok(true));
        assert_eq!(decide(Collectives::Nccl, &distinct), Ok(true));
        assert_eq!(decide(Collectives::Host, &distinct), Ok(false));

        let shared = [rec(true, "GPU-a"), rec(true, "GPU-a")];
        assert_eq!(decide(Collectives::Auto, &shared), Ok(false));
        let e = decide(Collectives::Nccl, &shared).expect_err("shared GPU");
        assert!(e.contains("ranks 0 and 1 on GPU GPU-a"), "{e}");

        let missing = [rec(true, "GPU-a"), rec(false, "GPU-b")];
        assert_eq!(decide(Collectives::Auto, &missing), Ok(false));
        let e = decide(Collectives::Nccl, &missing).expect_err("missing library");
        assert!(e.contains("missing on rank(s) 1"), "{e}");
        // One rank alone has its GPU to itself.
        assert_eq!(decide(Collectives::Auto, &[rec(true, "GPU-a")]), Ok(true));
    }

    #[test]
    fn ring_bytes_are_what_the_in_process_ring_counts() {
        for n in 1..=4 {
            for len in [1usize, 7, 10, 64] {
                let comms = crate::comm::in_process(n);
                let counted: Vec<(usize, ByteCount)> = std::thread::scope(|s| {
                    let hs: Vec<_> = comms
                        .into_iter()
                        .map(|mut c| {
                            s.spawn(move || {
                                let mut buf = vec![1.0f32; len];
                                c.all_reduce(&mut buf, false).expect("all-reduce");
                                (c.rank(), c.bytes())
                            })
                        })
                        .collect();
                    hs.into_iter()
                        .map(|h| h.join().expect("no panic"))
                        .collect()
                });
                for (rank, b) in counted {
                    assert_eq!(
                        b,
                        ring_all_reduce_bytes(len, n, rank),
                        "n {n} len {len} rank {rank}"
                    );
                }
            }
        }
    }
}
