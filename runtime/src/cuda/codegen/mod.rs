//! CUDA code generation: a compiled worker graph becomes one CUDA C translation unit
//! (compiled once per plan by NVRTC to an sm_90 CUBIN) and, per node, a list of
//! launches that the CUDA executor replays without knowing any op.
//!
//! # What the executor sees
//!
//! [`generate`] gives a [`DevicePlan`]: the source and, for every node in topological
//! order, a [`NodeLaunch`]. Each [`Launch`] is plain data: a kernel by name with its
//! grid, block and arguments ([`KArg`]), a cuBLAS product ([`Gemm`]), a memset, an
//! alias (reshape: the output *is* the input's buffer) or [`Launch::Host`] (feeds,
//! parameters, sinks and communication, which the executor does itself). Pointers are
//! named by role ([`KArg::Input`], [`KArg::Output`], [`KArg::Scratch`]), never by
//! address, so one plan serves every step and a captured CUDA graph replays it.
//! Everything that changes between steps lives in device memory: the step counter
//! ([`KArg::Step`]) and the row count of every `IndexedSlices` value, so nothing
//! syncs to the host inside a step.
//!
//! Shapes are static, so index maps (broadcasting, transposes, reductions) are baked
//! into the kernels as constants; kernels whose work is only an element count (the
//! pointwise maps, copies) take the count as an argument, so one body serves every
//! shape. Kernels are deduplicated by identical text: the source holds each body once.
//!
//! # Buffers
//!
//! A dense value is a row-major array of its dtype (`float` for f32, `int` for i32,
//! `bf16` and `f16` for the 16-bit types, see `codegen/half.rs`);
//! [`value_bytes`] gives its size. An `IndexedSlices { dense: [R, ..], nnz }` value is
//! one buffer ([`SlicesLayout`]):
//!
//! ```text
//! offset 0                 i32 count        rows held now (0 ..= nnz), written on the device
//! offset 4                 i32 indices[nnz] row ids; only the first `count` are meaningful
//! offset align16(4+4*nnz)  f32 values[nnz, row]   row k belongs to indices[k]
//! ```
//!
//! Kernels read `count` from device memory and ignore rows past it. Row ids outside
//! `0..R` are skipped by every kernel that scatters or looks rows up (the CPU backend
//! reports them as errors; a GPU kernel has no one to report to mid-step).
//!
//! # Arguments
//!
//! A kernel's arguments are passed in order, each as its C type: pointers (`Input`,
//! `Output`, `Scratch`, `Step`, `Param`, `Grad`, `Slot`) as device addresses,
//! `I32`/`U32`/`Rank`/`ModelRank`/`Training` as 32-bit integers, `F32` as `float`, `U64` as a
//! 64-bit integer.
//!
//! # Matrix products
//!
//! cuBLAS is column-major; distc's tensors are row-major. A row-major `[r, c]` array
//! read column-major is its transpose `[c, r]` with leading dimension `c`. So the
//! row-major product `C[M,N] = op(X)[M,K] @ op(Y)[K,N]` is issued as the column-major
//! product `Cᵀ[N,M] = op(Y)ᵀ @ op(X)ᵀ`: cuBLAS's `A` is our `Y` and its `B` our `X`,
//! `m = N`, `n = M`, `k = K`, `transa` says whether `Y` is used transposed, `transb`
//! whether `X` is, each leading dimension is the *stored* row-major array's column
//! count, and `ldc = N`. [`Gemm`] holds the parameters in cuBLAS's own terms, ready
//! for `cublasSgemmStridedBatched`; [`Gemm::row_major`] builds one from the row-major
//! description and covers the four transpose cases of `matmul`.

mod attention;
mod elementwise;
mod half;
mod index;
mod layout;
mod model;
mod nn;
mod optim;
mod reduce;
pub(crate) use reduce::SQUARE_BLOCKS;
mod sparse;

pub use index::{broadcast_map, StridedMap};
/// The gradient-scaling kernels alone, for a plan without fp16 whose gradients are
/// clipped: the translation unit and the dense and slices kernels' names.
pub(crate) fn unscale_unit() -> (String, String, String) {
    let mut ks = KernelSet::default();
    let (dense, slices) = half::unscale_kernels(&mut ks);
    (ks.source(), dense, slices)
}

/// The gradient-norm kernel (`reduce::square_partials`) as its own compilation unit,
/// for plans that clip by norm: (source, kernel name).
pub(crate) fn square_partials_unit() -> (String, String) {
    let mut ks = KernelSet::default();
    let name = reduce::square_partials(&mut ks);
    (ks.source(), name)
}

pub use optim::{optimizer_kernels, sparse_bound, weight_copies, OptimizerPlan, Rate, VarUpdate};

use distc_ir::{DType, Graph, NodeId, Op, TensorType, ValueType};
use std::collections::HashMap;
use thiserror::Error;

/// Threads per block of the element-wise kernels.
pub const BLOCK: u32 = 256;

/// The thread's element index and the bounds check every 1-D kernel over `n`
/// elements opens with.
pub(crate) const INDEX: &str =
    "    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n";

/// One argument of a kernel launch, named by role (see the module doc for C types).
#[derive(Clone, Debug, PartialEq)]
pub enum KArg {
    /// The buffer of the node's input `i` (a device pointer).
    Input(usize),
    /// The buffer of the node's output `j`.
    Output(usize),
    /// The node's scratch buffer `k`, of `NodeLaunch::scratch_bytes[k]` bytes; its
    /// contents are undefined when the node starts.
    Scratch(usize),
    /// A pointer to a device `u64` holding the 0-based index of the step being run
    /// (what the CPU backend's `KernelCtx::step` holds): a captured graph replays with
    /// the right step. Dropout masks read it; Adam's bias correction uses `t = step + 1`.
    Step,
    /// This worker's rank, as a 32-bit unsigned integer.
    Rank,
    /// This worker's rank on the mesh's model axis (0 without one), as a 32-bit
    /// unsigned integer: which part of a split variable it holds.
    ModelRank,
    /// 1 in a training run, 0 in an evaluation run (dropout is the identity there),
    /// as a 32-bit unsigned integer.
    Training,
    /// A 32-bit signed integer.
    I32(i32),
    /// A 32-bit unsigned integer.
    U32(u32),
    /// A 32-bit float.
    F32(f32),
    /// A 64-bit unsigned integer.
    U64(u64),
    /// Optimizer launches: the variable's buffer.
    Param,
    /// Optimizer launches: the variable's gradient (dense, or `IndexedSlices`).
    Grad,
    /// Optimizer launches: the variable's slot `i` (momentum; Adam's `m`, `v`), a buffer
    /// of the variable's shape that the executor zeroes once, before the first step.
    Slot(usize),
    /// Optimizer launches: the variable's 16-bit copy, which the forward pass reads
    /// instead of casting the variable (see `optim::weight_copies`).
    WeightCopy,
}

/// A cuBLAS product, in cuBLAS's column-major terms (see the module doc):
/// `C = alpha * op(A) @ op(B) + beta * C` for each of `batch` matrices, matrix `i` of
/// each operand starting `i * stride_*` elements after its first. `A`, `B` and `C` are
/// all of type `dtype`: f32 is `cublasSgemmStridedBatched`; bf16 and f16 are
/// `cublasGemmStridedBatchedEx` accumulating in f32 on the tensor cores.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemm {
    /// The element type of `A`, `B` and `C`.
    pub dtype: DType,
    /// `op(A) = Aᵀ`.
    pub transa: bool,
    /// `op(B) = Bᵀ`.
    pub transb: bool,
    /// Rows of `op(A)` and of `C`.
    pub m: u32,
    /// Columns of `op(B)` and of `C`.
    pub n: u32,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: u32,
    /// Leading dimension of `A`.
    pub lda: u32,
    /// Leading dimension of `B`.
    pub ldb: u32,
    /// Leading dimension of `C`.
    pub ldc: u32,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of `C`'s old contents (0: `C` is only written).
    pub beta: f32,
    /// Matrices in the batch (1 for a plain product).
    pub batch: u32,
    /// Elements between consecutive `A` matrices (0: one `A` for all).
    pub stride_a: u64,
    /// Elements between consecutive `B` matrices.
    pub stride_b: u64,
    /// Elements between consecutive `C` matrices.
    pub stride_c: u64,
    /// cuBLAS's `A` buffer.
    pub a: KArg,
    /// cuBLAS's `B` buffer.
    pub b: KArg,
    /// cuBLAS's `C` buffer.
    pub c: KArg,
}

impl Gemm {
    /// The cuBLAS call computing the row-major `y[M,N] = op(x) @ op(w)` (`x` stored
    /// `[M,K]`, or `[K,M]` when `tx`; `w` stored `[K,N]`, or `[N,K]` when `tw`) for
    /// `batch` products with the given row-major strides (elements).
    #[allow(clippy::too_many_arguments)]
    pub fn row_major(
        (x, tx): (KArg, bool),
        (w, tw): (KArg, bool),
        y: KArg,
        (m, n, k): (usize, usize, usize),
        batch: usize,
        (stride_x, stride_w, stride_y): (usize, usize, usize),
    ) -> Result<Gemm, String> {
        let u = |v: usize, what: &str| {
            u32::try_from(v).map_err(|_| format!("{what} {v} does not fit cuBLAS's 32-bit sizes"))
        };
        // Stored row-major column counts are the column-major leading dimensions.
        let ldx = if tx { m } else { k };
        let ldw = if tw { k } else { n };
        Ok(Gemm {
            dtype: DType::F32,
            transa: tw,
            transb: tx,
            m: u(n, "columns")?,
            n: u(m, "rows")?,
            k: u(k, "inner size")?,
            lda: u(ldw.max(1), "leading dimension")?,
            ldb: u(ldx.max(1), "leading dimension")?,
            ldc: u(n.max(1), "leading dimension")?,
            alpha: 1.0,
            beta: 0.0,
            batch: u(batch, "batch")?,
            stride_a: stride_w as u64,
            stride_b: stride_x as u64,
            stride_c: stride_y as u64,
            a: w,
            b: x,
            c: y,
        })
    }
}

/// One thing the executor does for a node.
#[derive(Clone, Debug, PartialEq)]
pub enum Launch {
    /// A kernel of [`DevicePlan::source`].
    Kernel {
        /// Its `extern "C"` name.
        name: String,
        /// Blocks.
        grid: [u32; 3],
        /// Threads per block.
        block: [u32; 3],
        /// Dynamic shared memory.
        shared_bytes: u32,
        /// Arguments, in order.
        args: Vec<KArg>,
    },
    /// A cuBLAS product.
    Gemm(Gemm),
    /// Sets the first `bytes` bytes of a buffer to zero.
    Memset {
        /// The buffer.
        buf: KArg,
        /// Bytes from its start.
        bytes: u64,
    },
    /// The node's output 0 is its input `input`'s buffer (a reshape): nothing runs.
    Alias {
        /// The input.
        input: usize,
    },
    /// The executor does the node itself: feeds (`input`), variables (`param`), sinks
    /// (`loss`, `param_grad`, `output`) and communication (collectives, pulls, pushes).
    Host,
}

/// What the executor does for one node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeLaunch {
    /// The launches, in stream order.
    pub launches: Vec<Launch>,
    /// Bytes of each scratch buffer ([`KArg::Scratch`]), live only while the node runs.
    pub scratch_bytes: Vec<usize>,
    /// Launches run once per step, before the node's first run in that step. Only an
    /// `accumulate` node has them: its output buffer lives across the micro-batches
    /// of a step (each run adds into it), and these clear it.
    pub step_start: Vec<Launch>,
}

/// The generated code of one worker program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DevicePlan {
    /// One CUDA C translation unit: the helpers, then each kernel once.
    pub source: String,
    /// Every node, in topological order, with its launches.
    pub nodes: Vec<(NodeId, NodeLaunch)>,
    /// fp16's unscaling kernels `(dense, slices)`, when the graph scales its loss.
    pub unscale: Option<(String, String)>,
}

/// Why a graph has no device plan.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CodegenError {
    /// The op (or this use of it) has no CUDA kernel.
    #[error("{node} ({op}): no CUDA kernel: {reason}")]
    Unsupported {
        /// The node.
        node: NodeId,
        /// The op's mnemonic.
        op: &'static str,
        /// What is missing.
        reason: String,
    },
    /// The node's types do not fit its op (a pass bug or a hand-edited plan).
    #[error("{node} ({op}): {reason}")]
    Invalid {
        /// The node.
        node: NodeId,
        /// The op's mnemonic.
        op: &'static str,
        /// What does not fit.
        reason: String,
    },
    /// An optimizer update that has no kernel (e.g. an f64 variable).
    #[error("optimizer update of `{var}`: {reason}")]
    Optimizer {
        /// The variable.
        var: String,
        /// What is missing.
        reason: String,
    },
}

/// Where the parts of an `IndexedSlices` buffer lie (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlicesLayout {
    /// Most rows held.
    pub nnz: usize,
    /// Elements per row.
    pub row: usize,
    /// Byte offset of the i32 indices (the count is at 0).
    pub indices_offset: usize,
    /// Byte offset of the f32 values (16-byte aligned).
    pub values_offset: usize,
    /// Bytes of the whole buffer.
    pub bytes: usize,
}

impl SlicesLayout {
    /// The layout of slices of at most `nnz` rows of `row` elements.
    pub fn new(nnz: usize, row: usize) -> SlicesLayout {
        let values_offset = (4 + 4 * nnz).div_ceil(16) * 16;
        SlicesLayout {
            nnz,
            row,
            indices_offset: 4,
            values_offset,
            bytes: values_offset + 4 * nnz * row,
        }
    }

    /// The layout of a value of type `ty`, if it is `IndexedSlices`.
    pub fn of(ty: &ValueType) -> Option<SlicesLayout> {
        match ty {
            ValueType::IndexedSlices { dense, nnz } => {
                Some(SlicesLayout::new(*nnz, row_len(dense)))
            }
            ValueType::Tensor(_) => None,
        }
    }
}

/// Bytes of the device buffer of a value of type `ty`.
pub fn value_bytes(ty: &ValueType) -> usize {
    match SlicesLayout::of(ty) {
        Some(l) => l.bytes,
        None => ty.dense_type().bytes(),
    }
}

/// Elements per row (`dims[1..]`'s product) of a table type.
fn row_len(t: &TensorType) -> usize {
    t.dims().iter().skip(1).product()
}

/// The CUDA C every kernel may use: integer types, the `IndexedSlices` accessors, the
/// dropout hash and deterministic block reductions (fixed tree order, so a reduction
/// gives the same bits every run).
const PRELUDE: &str = r#"// Generated by distc (runtime/src/cuda/codegen). One translation unit per plan.
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// 16-bit storage (--precision bf16|fp16): a bf16 holds the bits of __nv_bfloat16, an
// f16 those of __half. NVRTC's built-in headers include neither cuda_bf16.h nor
// cuda_fp16.h, so the kernels carry their own 2-byte types and convert with the
// hardware's round-to-nearest-even cvt (sm_80 and later). A kernel widens what it
// loads to f32, computes in f32 and narrows what it stores, as GemmEx accumulates.
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ void narrow(float* p, float v) { *p = v; }
#ifdef DISTC_EMULATED
__device__ __forceinline__ float widen(bf16 x) { return distc_emu::bf16_to_f32(x.bits); }
__device__ __forceinline__ void narrow(bf16* p, float v) { p->bits = distc_emu::f32_to_bf16(v); }
__device__ __forceinline__ float widen(f16 x) { return distc_emu::f16_to_f32(x.bits); }
__device__ __forceinline__ void narrow(f16* p, float v) { p->bits = distc_emu::f32_to_f16(v); }
#else
__device__ __forceinline__ float widen(bf16 x) { return __uint_as_float(((unsigned)x.bits) << 16); }
__device__ __forceinline__ void narrow(bf16* p, float v) {
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
    p->bits = b;
}
__device__ __forceinline__ float widen(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ void narrow(f16* p, float v) {
    unsigned short b;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(v));
    p->bits = b;
}
#endif

// IndexedSlices buffer: i32 count, i32 indices[nnz], then f32 rows at a 16-byte boundary.
__device__ __forceinline__ int* sl_count(void* b) { return (int*)b; }
__device__ __forceinline__ int* sl_idx(void* b) { return (int*)b + 1; }
__device__ __forceinline__ float* sl_val(void* b, u64 nnz) {
    return (float*)((char*)b + ((4ull + 4ull * nnz + 15ull) & ~15ull));
}

// splitmix64's finaliser: a bijective 64-bit mix, the dropout hash.
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Block-wide sum and maximum (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `sh` is 32 floats of shared memory.
__device__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < (blockDim.x >> 5) ? sh[threadIdx.x] : 0.0f;
    if (threadIdx.x < 32) v = warp_sum(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}
__device__ float block_max(float v, float* sh) {
    v = warp_max(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < (blockDim.x >> 5) ? sh[threadIdx.x] : -__int_as_float(0x7f800000);
    if (threadIdx.x < 32) v = warp_max(v);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}
// Block-wide exclusive scan of 0/1 flags over blockDim.x threads (a multiple of 32):
// returns this thread's prefix; *total gets the block's sum. `sh` is 33 ints.
__device__ int block_scan(int flag, int* sh, int* total) {
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    unsigned ballot = __ballot_sync(0xffffffffu, flag);
    int before = __popc(ballot & ((1u << lane) - 1u));
    __syncthreads();
    if (lane == 0) sh[w] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (unsigned i = 0; i < (blockDim.x >> 5); ++i) { int c = sh[i]; sh[i] = acc; acc += c; }
        sh[32] = acc;
    }
    __syncthreads();
    *total = sh[32];
    return sh[w] + before;
}
// The same for any non-negative ints: a butterfly within each warp (at each level a
// lane in the upper half adds the lower half's sum), then the warps' sums.
__device__ int block_sum_scan(int v, int* sh, int* total) {
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int incl = v, group = v;
    for (int o = 1; o < 32; o <<= 1) {
        int other = __shfl_xor_sync(0xffffffffu, group, o);
        if (lane & o) incl += other;
        group += other;
    }
    __syncthreads();
    if (lane == 31) sh[w] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (unsigned i = 0; i < (blockDim.x >> 5); ++i) { int c = sh[i]; sh[i] = acc; acc += c; }
        sh[32] = acc;
    }
    __syncthreads();
    *total = sh[32];
    return sh[w] + incl - v;
}
"#;

/// The deduplicated kernels of one translation unit.
#[derive(Debug, Default)]
pub(crate) struct KernelSet {
    /// Kernel text (with `KNAME` for its name) -> name.
    by_text: HashMap<String, String>,
    /// How many kernels use each base name.
    per_base: HashMap<String, usize>,
    /// `(name, text)` in order of first use.
    order: Vec<(String, String)>,
}

impl KernelSet {
    /// The name of the kernel with this text (`KNAME` standing for its name), added
    /// under a name built from `base` if new.
    pub(crate) fn add(&mut self, base: &str, text: String) -> String {
        if let Some(name) = self.by_text.get(&text) {
            return name.clone();
        }
        let n = self.per_base.entry(base.to_string()).or_insert(0);
        // The `k_` prefix keeps kernels clear of CUDA's own C names (`tanh`, `exp`).
        let name = if *n == 0 {
            format!("k_{base}")
        } else {
            format!("k_{base}_{n}")
        };
        *n += 1;
        self.by_text.insert(text.clone(), name.clone());
        self.order.push((name.clone(), text));
        name
    }

    /// The translation unit: the prelude, then each kernel once.
    pub(crate) fn source(&self) -> String {
        let mut s = String::from(PRELUDE);
        for (name, text) in &self.order {
            s.push('\n');
            s.push_str(&text.replace("KNAME", name));
        }
        s
    }
}

/// Blocks of `BLOCK` threads covering `n` elements.
pub(crate) fn blocks_for(n: usize) -> Result<u32, String> {
    u32::try_from(n.div_ceil(BLOCK as usize))
        .map_err(|_| format!("{n} elements need more blocks than a grid holds"))
}

/// What one node's code generation builds.
pub(crate) struct NodeCx<'a> {
    pub(crate) ks: &'a mut KernelSet,
    pub(crate) ins: Vec<ValueType>,
    pub(crate) outs: Vec<ValueType>,
    pub(crate) out: NodeLaunch,
}

impl NodeCx<'_> {
    /// Adds a kernel (deduplicated) and returns its name.
    pub(crate) fn kernel(&mut self, base: &str, text: String) -> String {
        self.ks.add(base, text)
    }

    /// A launch of `name` over `n` elements, one thread each, `BLOCK` per block. No
    /// launch at all for `n == 0` (a grid of 0 blocks is an error in CUDA).
    pub(crate) fn launch_1d(
        &mut self,
        name: &str,
        n: usize,
        args: Vec<KArg>,
    ) -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        self.launch(name, [blocks_for(n)?, 1, 1], BLOCK, args);
        Ok(())
    }

    /// A launch with an explicit grid and a 1-D block.
    pub(crate) fn launch(&mut self, name: &str, grid: [u32; 3], block: u32, args: Vec<KArg>) {
        self.out.launches.push(Launch::Kernel {
            name: name.to_string(),
            grid,
            block: [block, 1, 1],
            shared_bytes: 0,
            args,
        });
    }

    /// A new scratch buffer of `bytes` bytes.
    pub(crate) fn scratch(&mut self, bytes: usize) -> KArg {
        self.out.scratch_bytes.push(bytes.max(4));
        KArg::Scratch(self.out.scratch_bytes.len() - 1)
    }

    /// Dense input `i`'s type.
    pub(crate) fn tin(&self, i: usize) -> Result<&TensorType, String> {
        match self.ins.get(i) {
            Some(ValueType::Tensor(t)) => Ok(t),
            Some(t) => Err(format!("input {i} is {t}, a dense tensor is needed")),
            None => Err(format!("has no input {i}")),
        }
    }

    /// Dense output `j`'s type.
    pub(crate) fn tout(&self, j: usize) -> Result<&TensorType, String> {
        match self.outs.get(j) {
            Some(ValueType::Tensor(t)) => Ok(t),
            Some(t) => Err(format!("output {j} is {t}, a dense tensor is needed")),
            None => Err(format!("has no output {j}")),
        }
    }

    /// Input `i` as slices: `(dense type, nnz)`.
    pub(crate) fn sin(&self, i: usize) -> Result<(&TensorType, usize), String> {
        match self.ins.get(i) {
            Some(ValueType::IndexedSlices { dense, nnz }) => Ok((dense, *nnz)),
            Some(t) => Err(format!("input {i} is {t}, IndexedSlices are needed")),
            None => Err(format!("has no input {i}")),
        }
    }

    /// Output `j` as slices: `(dense type, nnz)`.
    pub(crate) fn sout(&self, j: usize) -> Result<(&TensorType, usize), String> {
        match self.outs.get(j) {
            Some(ValueType::IndexedSlices { dense, nnz }) => Ok((dense, *nnz)),
            Some(t) => Err(format!("output {j} is {t}, IndexedSlices are needed")),
            None => Err(format!("has no output {j}")),
        }
    }
}

/// The C type of a float operand a kernel reads and writes in its own storage (f32,
/// or bf16 and f16 through the prelude's `widen` and `narrow`, computing in f32).
pub(crate) fn want_float(t: &TensorType, what: &str) -> Result<Elem, String> {
    match t.dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(Elem(t.dtype)),
        DType::F64 | DType::I32 => Err(format!(
            "{what} is {t}; the GPU runs f32, bf16 and f16 (and i32 ids)"
        )),
    }
}

/// How a kernel stores a float operand: f32 as `float`, 16-bit types in 16 bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Elem(DType);

impl Elem {
    pub(crate) fn c(self) -> &'static str {
        half::c_type(self.0).unwrap_or("float")
    }

    /// The f32 value of `e` (an element of this type).
    pub(crate) fn load(self, e: &str) -> String {
        if self.0 == DType::F32 {
            e.to_string()
        } else {
            format!("widen({e})")
        }
    }

    /// The statement storing the f32 value `v` at `ptr[at]`.
    pub(crate) fn store(self, ptr: &str, at: &str, v: &str) -> String {
        if self.0 == DType::F32 {
            format!("{ptr}[{at}] = {v};")
        } else {
            format!("narrow({ptr} + {at}, {v});")
        }
    }
}

/// Checks a dense type is f32 (the device trains in f32).
pub(crate) fn want_f32(t: &TensorType, what: &str) -> Result<(), String> {
    if t.dtype == DType::F32 {
        Ok(())
    } else {
        Err(format!("{what} is {t}; the GPU runs f32 (and i32 ids)"))
    }
}

/// Checks a dense type is i32.
pub(crate) fn want_i32(t: &TensorType, what: &str) -> Result<(), String> {
    if t.dtype == DType::I32 {
        Ok(())
    } else {
        Err(format!("{what} is {t}, i32 ids are needed"))
    }
}

/// A float literal CUDA C reads back as the same f32 (`1.5f`, `1e-05f`).
pub(crate) fn flit(x: f64) -> String {
    let v = x as f32;
    if v.is_nan() {
        "__int_as_float(0x7fc00000)".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "__int_as_float(0x7f800000)".into()
        } else {
            "__int_as_float(0xff800000)".into()
        }
    } else {
        // Rust's shortest round-trip spelling, made a C float literal.
        let s = format!("{v:?}");
        format!("{s}f")
    }
}

/// The device plan of a worker program: the CUDA source and each node's launches.
pub fn generate(graph: &Graph) -> Result<DevicePlan, CodegenError> {
    let mut ks = KernelSet::default();
    let mut nodes = Vec::new();
    for id in graph.topo_order() {
        let node = graph.node(id);
        let ins: Vec<ValueType> = node
            .inputs
            .iter()
            .map(|&v| {
                graph
                    .try_value_type(v)
                    .cloned()
                    .ok_or_else(|| CodegenError::Invalid {
                        node: id,
                        op: node.op.mnemonic(),
                        reason: format!("input {v} does not exist"),
                    })
            })
            .collect::<Result<_, _>>()?;
        let mut cx = NodeCx {
            ks: &mut ks,
            ins,
            outs: node.outputs.clone(),
            out: NodeLaunch::default(),
        };
        half::lower(&node.op, &mut cx).map_err(|e| e.at(id, &node.op))?;
        nodes.push((id, cx.out));
    }
    let unscale = graph.scales_loss().then(|| half::unscale_kernels(&mut ks));
    let source = ks.source();
    // Every launch against its kernel's C parameters: a mismatch is a codegen bug that
    // would hand the GPU garbage, so it is caught here, where no GPU is needed.
    let sigs = kernel_signatures(&source).map_err(|reason| CodegenError::Invalid {
        node: nodes.first().map_or_else(|| NodeId(0), |n| n.0),
        op: "kernel source",
        reason,
    })?;
    for (id, nl) in &nodes {
        check_launches(&sigs, nl.launches.iter().chain(&nl.step_start)).map_err(|reason| {
            CodegenError::Invalid {
                node: *id,
                op: graph.node(*id).op.mnemonic(),
                reason,
            }
        })?;
    }
    Ok(DevicePlan {
        source,
        nodes,
        unscale,
    })
}

/// A failure inside one node's generation, placed by [`generate`].
pub(crate) enum NodeError {
    /// No kernel for this.
    Unsupported(String),
    /// The node's types do not fit.
    Invalid(String),
}

impl From<String> for NodeError {
    fn from(s: String) -> NodeError {
        NodeError::Invalid(s)
    }
}

impl NodeError {
    fn at(self, node: NodeId, op: &Op) -> CodegenError {
        let op = op.mnemonic();
        match self {
            NodeError::Unsupported(reason) => CodegenError::Unsupported { node, op, reason },
            NodeError::Invalid(reason) => CodegenError::Invalid { node, op, reason },
        }
    }
}

/// The kernels of one op: one exhaustive `match`, so a new op does not compile until
/// it has a CUDA lowering or is named as host work.
pub(crate) fn node_kernels(op: &Op, cx: &mut NodeCx<'_>) -> Result<(), NodeError> {
    use elementwise as ew;
    // Gradient checks run whole graphs in f64 on the CPU; the device has no f64
    // kernels, and says so before any op looks at its types.
    if let Some(t) = cx
        .ins
        .iter()
        .chain(&cx.outs)
        .find(|t| t.dense_type().dtype == DType::F64)
    {
        return Err(NodeError::Unsupported(format!(
            "{t}: the GPU backend runs f32 (and i32 ids), not f64"
        )));
    }
    match op {
        // Identity forward; its gradient is the model-axis sum.
        Op::ModelEnter { .. } => Ok(layout::reshape(cx)?),
        Op::ModelSplit { dim, parts } => Ok(model::split(cx, *dim, *parts)?),
        Op::ModelEmbedding { .. } => Ok(model::embedding(cx)?),
        Op::ModelEmbeddingGrad { .. } => Ok(model::embedding_grad(cx)?),
        Op::Cast { .. } => Ok(half::cast(cx)?),
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Loss
        | Op::ParamGrad { .. }
        | Op::Output { .. }
        | Op::Assign { .. }
        | Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::Broadcast { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGatherDense { .. }
        | Op::ModelAllReduce { .. }
        | Op::ModelGather { .. }
        | Op::ModelReduceScatter { .. }
        | Op::Pull { .. }
        | Op::SparsePull { .. }
        | Op::Push { .. }
        | Op::SparsePush { .. }
        | Op::Shard { .. }
        | Op::Serve { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => {
            cx.out.launches.push(Launch::Host);
            Ok(())
        }
        Op::Constant { value, ty } => Ok(ew::constant(cx, *value, ty)?),
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => Ok(nn::matmul(cx, *transpose_a, *transpose_b)?),
        Op::Add => Ok(ew::binary(cx, ew::Bin::Add)?),
        Op::Sub => Ok(ew::binary(cx, ew::Bin::Sub)?),
        Op::Mul => Ok(ew::binary(cx, ew::Bin::Mul)?),
        Op::Div => Ok(ew::binary(cx, ew::Bin::Div)?),
        Op::Neg => Ok(ew::unary(cx, ew::Un::Neg)?),
        Op::Relu => Ok(ew::unary(cx, ew::Un::Relu)?),
        Op::Sigmoid => Ok(ew::unary(cx, ew::Un::Sigmoid)?),
        Op::Tanh => Ok(ew::unary(cx, ew::Un::Tanh)?),
        Op::Exp => Ok(ew::unary(cx, ew::Un::Exp)?),
        Op::Log => Ok(ew::unary(cx, ew::Un::Log)?),
        Op::ReluGrad => Ok(ew::grad(cx, ew::Grad::Relu)?),
        Op::SigmoidGrad => Ok(ew::grad(cx, ew::Grad::Sigmoid)?),
        Op::TanhGrad => Ok(ew::grad(cx, ew::Grad::Tanh)?),
        Op::Dropout {
            rate,
            seed,
            per_sample,
        }
        | Op::DropoutGrad {
            rate,
            seed,
            per_sample,
        } => Ok(ew::dropout(cx, *rate, *seed, *per_sample)?),
        Op::Softmax { axis } => Ok(reduce::softmax(cx, *axis, false)?),
        Op::LogSoftmax { axis } => Ok(reduce::softmax(cx, *axis, true)?),
        Op::SoftmaxGrad { axis } => Ok(reduce::softmax_grad(cx, *axis, false)?),
        Op::LogSoftmaxGrad { axis } => Ok(reduce::softmax_grad(cx, *axis, true)?),
        Op::Sum { axes, .. } => Ok(reduce::sum_axes(cx, axes, false)?),
        Op::Mean { axes, .. } => Ok(reduce::sum_axes(cx, axes, true)?),
        Op::SumTo { .. } => Ok(reduce::sum_to(cx)?),
        Op::BroadcastTo { .. } => Ok(reduce::broadcast_to(cx)?),
        Op::SoftmaxCrossEntropy => Ok(reduce::sce(cx)?),
        Op::SoftmaxCrossEntropyGrad => Ok(reduce::sce_grad(cx)?),
        Op::Mse => Ok(reduce::mse(cx)?),
        Op::MseGrad => Ok(reduce::mse_grad(cx)?),
        Op::LayerNorm { eps } => Ok(reduce::layer_norm(cx, *eps)?),
        Op::Attention { causal, scale } => Ok(attention::attention(cx, *causal, *scale)?),
        Op::AttentionGrad { causal, scale } => Ok(attention::attention_grad(cx, *causal, *scale)?),
        Op::LayerNormGrad { eps } => Ok(reduce::layer_norm_grad(cx, *eps)?),
        Op::Reshape { .. } => Ok(layout::reshape(cx)?),
        // One device is all the replicas (several are an all-reduce by then).
        Op::ReplicaReduce { .. } => Ok(layout::reshape(cx)?),
        // A copy of the one input the mode reads (the schedule passes no other).
        Op::TrainOrEval => Ok(layout::copy(cx)?),
        Op::Transpose { perm } => Ok(layout::transpose(cx, perm)?),
        Op::Concat { axis } => Ok(layout::concat(cx, *axis)?),
        Op::Slice { axis, start, end } => Ok(layout::slice(cx, *axis, *start, *end)?),
        Op::Pack => Ok(layout::pack(cx)?),
        Op::Unpack { .. } => Ok(layout::unpack(cx)?),
        Op::PackChunks { workers } => Ok(layout::pack_chunks(cx, *workers)?),
        Op::UnpackChunks { workers, .. } => Ok(layout::unpack_chunks(cx, *workers)?),
        Op::TakeChunk { workers } => Ok(layout::take_chunk(cx, *workers)?),
        Op::Conv2d { stride, padding } => Ok(nn::conv2d(cx, *stride, *padding)?),
        Op::Conv2dGradInput {
            stride, padding, ..
        } => Ok(nn::conv2d_grad_input(cx, *stride, *padding)?),
        Op::Conv2dGradFilter {
            stride, padding, ..
        } => Ok(nn::conv2d_grad_filter(cx, *stride, *padding)?),
        Op::MaxPool2d { kernel, stride } => Ok(nn::max_pool2d(cx, *kernel, *stride)?),
        Op::MaxPool2dGrad { kernel, stride } => Ok(nn::max_pool2d_grad(cx, *kernel, *stride)?),
        Op::Embedding => Ok(sparse::embedding(cx)?),
        Op::EmbeddingGrad { .. } => Ok(sparse::embedding_grad(cx)?),
        Op::ConcatSlices => Ok(sparse::concat_slices(cx)?),
        Op::Densify => Ok(sparse::densify(cx)?),
        Op::RowMask => Ok(sparse::row_mask(cx)?),
        Op::Sparsify => Ok(sparse::sparsify(cx)?),
        Op::UniqueRows => Ok(sparse::unique_rows(cx)?),
        Op::Accumulate { micro } => Ok(sparse::accumulate(cx, *micro)?),
        Op::Fused { expr } => Ok(ew::fused(cx, expr)?),
    }
}

pub use elementwise::fused_kernel;

/// The C class of a kernel parameter, as far as its launch argument is concerned:
/// what the executor must push, and how many bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CParam {
    /// Any pointer: a 64-bit device address.
    Ptr,
    /// `u64`, `i64` (`unsigned long long`, `long long`).
    B64,
    /// `int`.
    I32,
    /// `u32` (`unsigned`, `unsigned int`).
    U32,
    /// `float`.
    F32,
}

impl CParam {
    /// The class of one C parameter declaration (`const float* x`, `u64 n`).
    fn of(decl: &str) -> Result<CParam, String> {
        let decl = decl.trim();
        if decl.contains('*') {
            return Ok(CParam::Ptr);
        }
        let words: Vec<&str> = decl
            .split_whitespace()
            .filter(|w| *w != "const" && *w != "__restrict__")
            .collect();
        // The last word is the parameter's name.
        let ty = match words.split_last() {
            Some((_, ty)) if !ty.is_empty() => ty.join(" "),
            _ => return Err(format!("cannot read the parameter `{decl}`")),
        };
        Ok(match ty.as_str() {
            "u64" | "i64" | "unsigned long long" | "long long" | "size_t" => CParam::B64,
            "int" | "signed" | "signed int" => CParam::I32,
            "u32" | "unsigned" | "unsigned int" => CParam::U32,
            "float" => CParam::F32,
            other => {
                return Err(format!(
                    "parameter `{decl}`: no launch argument passes a `{other}`"
                ))
            }
        })
    }

    /// The class a launch argument is passed as (see the module doc).
    pub fn of_arg(k: &KArg) -> CParam {
        match k {
            KArg::Input(_)
            | KArg::Output(_)
            | KArg::Scratch(_)
            | KArg::Step
            | KArg::Param
            | KArg::Grad
            | KArg::Slot(_)
            | KArg::WeightCopy => CParam::Ptr,
            KArg::Rank | KArg::ModelRank | KArg::Training | KArg::U32(_) => CParam::U32,
            KArg::I32(_) => CParam::I32,
            KArg::F32(_) => CParam::F32,
            KArg::U64(_) => CParam::B64,
        }
    }
}

/// Every `extern "C"` kernel of a translation unit with its parameters' classes.
pub fn kernel_signatures(source: &str) -> Result<HashMap<String, Vec<CParam>>, String> {
    const OPEN: &str = "extern \"C\" __global__ void ";
    let mut out = HashMap::new();
    let mut rest = source;
    while let Some(at) = rest.find(OPEN) {
        rest = &rest[at + OPEN.len()..];
        let open = rest
            .find('(')
            .ok_or_else(|| "a kernel without a parameter list".to_string())?;
        let name = rest[..open].trim().to_string();
        let close = rest[open..]
            .find(')')
            .ok_or_else(|| format!("kernel `{name}`: unclosed parameter list"))?;
        let list = &rest[open + 1..open + close];
        let params = if list.trim().is_empty() || list.trim() == "void" {
            Vec::new()
        } else {
            list.split(',')
                .map(CParam::of)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("kernel `{name}`: {e}"))?
        };
        if out.insert(name.clone(), params).is_some() {
            return Err(format!("kernel `{name}` is defined twice"));
        }
        rest = &rest[open + close..];
    }
    Ok(out)
}

/// Checks every kernel launch against its kernel's C parameter list: the kernel
/// exists, the argument count is the parameter count, and each argument is passed
/// as its parameter's C type (a pointer as a 64-bit address, 32-bit integers of the
/// right signedness, floats, 64-bit integers). A mismatch would be garbage on the GPU.
pub fn check_launches<'a>(
    sigs: &HashMap<String, Vec<CParam>>,
    launches: impl IntoIterator<Item = &'a Launch>,
) -> Result<(), String> {
    for l in launches {
        let Launch::Kernel { name, args, .. } = l else {
            continue;
        };
        let params = sigs
            .get(name)
            .ok_or_else(|| format!("kernel `{name}` is launched but not in the source"))?;
        if params.len() != args.len() {
            return Err(format!(
                "kernel `{name}` takes {} parameters, its launch passes {} ({args:?})",
                params.len(),
                args.len()
            ));
        }
        for (i, (p, a)) in params.iter().zip(args).enumerate() {
            if CParam::of_arg(a) != *p {
                return Err(format!(
                    "kernel `{name}`: parameter {i} is {p:?}, its launch passes {a:?}"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::config::OptimizerSpec;

    #[test]
    fn signatures_classify_every_c_parameter() {
        let src = "// a comment (with parens)\nextern \"C\" __global__ void k_a(const float* x, float* y, u64 n, const u64* step, u32 rank, unsigned int t, int c, float s, long long q) {\n}\nextern \"C\" __global__ void k_b() {}\n";
        let sigs = kernel_signatures(src).expect("parses");
        use CParam::*;
        assert_eq!(
            sigs["k_a"],
            vec![Ptr, Ptr, B64, Ptr, U32, U32, I32, F32, B64]
        );
        assert_eq!(sigs["k_b"], Vec::<CParam>::new());
        assert!(kernel_signatures("extern \"C\" __global__ void k(double d) {}").is_err());
        assert!(kernel_signatures(
            "extern \"C\" __global__ void k(int a) {}\nextern \"C\" __global__ void k(int a) {}"
        )
        .is_err());
    }

    #[test]
    fn launches_are_checked_against_their_kernel() {
        let sigs = kernel_signatures(
            "extern \"C\" __global__ void k(const float* x, float* y, u64 n, u32 r, float s) {}",
        )
        .expect("parses");
        let launch = |args: Vec<KArg>| Launch::Kernel {
            name: "k".into(),
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
            args,
        };
        let good = launch(vec![
            KArg::Input(0),
            KArg::Output(0),
            KArg::U64(3),
            KArg::Rank,
            KArg::F32(1.0),
        ]);
        check_launches(&sigs, [&good]).expect("fits");
        // A 32-bit count where the kernel reads a u64: garbage in the high word.
        let narrow = launch(vec![
            KArg::Input(0),
            KArg::Output(0),
            KArg::U32(3),
            KArg::Rank,
            KArg::F32(1.0),
        ]);
        assert!(check_launches(&sigs, [&narrow]).is_err());
        let short = launch(vec![KArg::Input(0), KArg::Output(0), KArg::U64(3)]);
        assert!(check_launches(&sigs, [&short]).is_err());
        let float_as_int = launch(vec![
            KArg::Input(0),
            KArg::Output(0),
            KArg::U64(3),
            KArg::Rank,
            KArg::I32(1),
        ]);
        assert!(check_launches(&sigs, [&float_as_int]).is_err());
        let missing = Launch::Kernel {
            name: "nope".into(),
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
            args: vec![],
        };
        assert!(check_launches(&sigs, [&missing]).is_err());
    }

    #[test]
    fn every_optimizer_update_fits_its_kernels() {
        let specs = [
            OptimizerSpec::Sgd {
                lr: 0.1,
                momentum: 0.0,
            },
            OptimizerSpec::Sgd {
                lr: 0.1,
                momentum: 0.9,
            },
            OptimizerSpec::Adam {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        ];
        let vars = vec![
            ("b".to_string(), TensorType::f32(vec![7]), None),
            ("emb".to_string(), TensorType::f32(vec![50, 300]), Some(64)),
            ("w".to_string(), TensorType::f32(vec![4, 3]), None),
        ];
        for spec in &specs {
            let plan = optimizer_kernels(spec, &[], false, &vars, &HashMap::new(), 0.5)
                .expect("an optimizer plan");
            let sigs = kernel_signatures(&plan.source).expect("parses");
            for v in &plan.vars {
                assert!(
                    !v.launches.is_empty(),
                    "{spec:?}: `{}` has no launch",
                    v.name
                );
                check_launches(&sigs, &v.launches).expect("fits");
                // The slot and step arguments the backend resolves exist for this rule.
                for l in &v.launches {
                    if let Launch::Kernel { args, .. } = l {
                        for a in args {
                            if let KArg::Slot(i) = a {
                                assert!(*i < plan.slot_names.len(), "{spec:?}: slot {i}");
                            }
                        }
                    }
                }
            }
        }
    }
}
