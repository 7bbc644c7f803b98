//! 16-bit values on the device (`--precision bf16|fp16`).
//!
//! A bf16 or f16 value is stored in 16 bits (`bf16` / `f16` in the prelude, the bits of
//! `__nv_bfloat16` / `__half`). Ops meet them in four ways:
//!
//! - `cast` has its own kernels, one per pair of types, rounding to nearest even.
//! - `matmul` with 16-bit operands is one cuBLAS GemmEx: 16-bit `A`, `B` and `C`, f32
//!   accumulation (`CUBLAS_COMPUTE_32F`), on the tensor cores (see [`super::nn`]).
//! - Element-wise maths (fused chains included), the activation gradients, sums,
//!   means, `sum_to` and `broadcast_to` have kernels per operand type: each element
//!   is widened to f32 as it is read and narrowed as it is written (the prelude's
//!   `widen` and `narrow`), so they cost one launch and 16-bit traffic. These are the
//!   ops between a 16-bit matmul and the next, where most of a 16-bit step's
//!   launches are.
//! - Every other op with a 16-bit operand runs its f32 kernels on f32 copies: each
//!   16-bit input is widened into a scratch buffer first and each 16-bit output
//!   narrowed from one after. This is what the CPU backend does inside its kernels,
//!   done here around them, so one lowering per op serves every precision. Host work
//!   (feeds, sinks, collectives) and aliases (reshape) take the 16-bit buffer as it is.

use super::{blocks_for, node_kernels, KArg, KernelSet, Launch, NodeCx, NodeError, BLOCK, INDEX};
use distc_ir::{DType, Op, TensorType, ValueType};

/// The C type a kernel stores `d` in, for the float types the device holds.
pub(crate) fn c_type(d: DType) -> Option<&'static str> {
    match d {
        DType::F32 => Some("float"),
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        DType::F64 | DType::I32 => None,
    }
}

fn is_half(t: &ValueType) -> bool {
    t.dense_type().dtype.is_half()
}

/// One node's launches, whatever the precision of its values.
pub(super) fn lower(op: &Op, cx: &mut NodeCx<'_>) -> Result<(), NodeError> {
    if !cx.ins.iter().chain(&cx.outs).any(is_half) {
        return node_kernels(op, cx);
    }
    if let Some(t) = cx
        .ins
        .iter()
        .chain(&cx.outs)
        .find(|t| matches!(t, ValueType::IndexedSlices { .. }) && is_half(t))
    {
        return Err(NodeError::Unsupported(format!(
            "{t}: sparse rows stay f32 on the GPU (the precision pass casts looked-up rows \
             after the lookup)"
        )));
    }
    match op {
        Op::Cast { .. } => node_kernels(op, cx),
        Op::MatMul { .. } if same_dtype(cx) => node_kernels(op, cx),
        // Element-wise maths and plain reductions read and write 16 bits themselves
        // (widen, compute in f32, narrow): no copies, one launch.
        op if op.is_elementwise_math()
            || matches!(op, Op::Sum { .. } | Op::Mean { .. } | Op::SumTo { .. }) =>
        {
            node_kernels(op, cx)
        }
        _ => widened(op, cx),
    }
}

/// Whether every input and output has one dtype (a GemmEx reads and writes one type).
fn same_dtype(cx: &NodeCx<'_>) -> bool {
    let mut all = cx.ins.iter().chain(&cx.outs).map(|t| t.dense_type().dtype);
    let first = all.next();
    all.all(|d| Some(d) == first)
}

/// `y = cast(x)`: one thread per element, rounding to nearest even.
pub(crate) fn cast(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (x, y) = (cx.tin(0)?.clone(), cx.tout(0)?.clone());
    if x.dims() != y.dims() {
        return Err(format!("casts {x} to {y}: the shapes differ"));
    }
    let launch = cast_launch(cx, x.dtype, y.dtype, KArg::Input(0), KArg::Output(0), &x)?;
    cx.out.launches.extend(launch);
    Ok(())
}

/// The launch converting the `ty`-shaped buffer `src` of type `from` into `dst` of type
/// `to` (none for an empty tensor).
fn cast_launch(
    cx: &mut NodeCx<'_>,
    from: DType,
    to: DType,
    src: KArg,
    dst: KArg,
    ty: &TensorType,
) -> Result<Option<Launch>, String> {
    let (Some(s), Some(d)) = (c_type(from), c_type(to)) else {
        return Err(format!(
            "no GPU cast from {} to {}: the device holds f32, bf16 and f16",
            from.name(),
            to.name()
        ));
    };
    let n = ty.dims().iter().product::<usize>();
    if n == 0 {
        return Ok(None);
    }
    let name = cx.kernel(
        &format!("cast_{}_{}", from.name(), to.name()),
        format!(
            "extern \"C\" __global__ void KNAME(const {s}* __restrict__ x, {d}* __restrict__ y, \
             u64 n) {{\n{INDEX}    narrow(y + i, widen(x[i]));\n}}\n"
        ),
    );
    Ok(Some(Launch::Kernel {
        name,
        grid: [blocks_for(n)?, 1, 1],
        block: [BLOCK, 1, 1],
        shared_bytes: 0,
        args: vec![src, dst, KArg::U64(n as u64)],
    }))
}

/// `op`'s f32 launches, run between widening its 16-bit inputs and narrowing its 16-bit
/// outputs, each through a scratch buffer of its own.
fn widened(op: &Op, cx: &mut NodeCx<'_>) -> Result<(), NodeError> {
    let wide = |t: &ValueType| match t {
        ValueType::Tensor(d) if d.dtype.is_half() => {
            ValueType::Tensor(TensorType::new(DType::F32, d.dims().to_vec()))
        }
        other => other.clone(),
    };
    let mut inner = NodeCx {
        ks: &mut *cx.ks,
        ins: cx.ins.iter().map(wide).collect(),
        outs: cx.outs.iter().map(wide).collect(),
        out: Default::default(),
    };
    node_kernels(op, &mut inner)?;
    let inner = inner.out;
    if inner
        .launches
        .iter()
        .any(|l| matches!(l, Launch::Host | Launch::Alias { .. }))
    {
        return node_kernels(op, cx);
    }
    if !inner.step_start.is_empty() {
        return Err(NodeError::Unsupported(format!(
            "{}: a value kept across micro-batches stays f32 on the GPU",
            op.mnemonic()
        )));
    }
    let mut scratch = inner.scratch_bytes;
    let mut before = Vec::new();
    let mut after = Vec::new();
    let mut inputs = vec![None; cx.ins.len()];
    let mut outputs = vec![None; cx.outs.len()];
    for (i, t) in cx.ins.clone().iter().enumerate() {
        if let ValueType::Tensor(d) = t {
            if d.dtype.is_half() {
                let k = scratch.len();
                scratch.push(4 * d.dims().iter().product::<usize>());
                inputs[i] = Some(k);
                before.extend(cast_launch(
                    cx,
                    d.dtype,
                    DType::F32,
                    KArg::Input(i),
                    KArg::Scratch(k),
                    d,
                )?);
            }
        }
    }
    for (j, t) in cx.outs.clone().iter().enumerate() {
        if let ValueType::Tensor(d) = t {
            if d.dtype.is_half() {
                let k = scratch.len();
                scratch.push(4 * d.dims().iter().product::<usize>());
                outputs[j] = Some(k);
                after.extend(cast_launch(
                    cx,
                    DType::F32,
                    d.dtype,
                    KArg::Scratch(k),
                    KArg::Output(j),
                    d,
                )?);
            }
        }
    }
    let remap = |a: &KArg| match a {
        KArg::Input(i) => inputs[*i].map_or(KArg::Input(*i), KArg::Scratch),
        KArg::Output(j) => outputs[*j].map_or(KArg::Output(*j), KArg::Scratch),
        other => other.clone(),
    };
    let body = inner.launches.into_iter().map(|l| match l {
        Launch::Kernel {
            name,
            grid,
            block,
            shared_bytes,
            args,
        } => Launch::Kernel {
            name,
            grid,
            block,
            shared_bytes,
            args: args.iter().map(remap).collect(),
        },
        Launch::Gemm(mut g) => {
            g.a = remap(&g.a);
            g.b = remap(&g.b);
            g.c = remap(&g.c);
            Launch::Gemm(g)
        }
        Launch::Memset { buf, bytes } => Launch::Memset {
            buf: remap(&buf),
            bytes,
        },
        other => other,
    });
    let launches: Vec<Launch> = before.into_iter().chain(body).chain(after).collect();
    cx.out.launches.extend(launches);
    cx.out.scratch_bytes = scratch;
    Ok(())
}

/// fp16's loss scaling on the device: the kernels that multiply a gradient by the
/// inverse scale in place and raise `*bad` (to 1.0f, so that NCCL can sum the flags of
/// several workers) on an infinity or a NaN, or on a value at or beyond `bound` before
/// scaling (`OverflowBounds`: infinity for none), `(dense, slices)`. The factor is read
/// from device memory, so a captured step follows the scale each replay is given. A
/// dense gradient is `(float* g, const float* factor, u64 n, float* bad, float bound)`;
/// slices are `(void* b, u64 nnz, u64 row, const float* factor, float* bad, float
/// bound)` and touch only the rows held.
pub(crate) fn unscale_kernels(ks: &mut KernelSet) -> (String, String) {
    let dense = ks.add(
        "unscale",
        format!(
            "extern \"C\" __global__ void KNAME(float* __restrict__ g, const float* __restrict__ \
             factor, u64 n, float* __restrict__ bad, float bound) {{\n{INDEX}    float v = g[i] * *factor;\n    \
             if (!(fabsf(g[i]) < bound) || !isfinite(v)) *bad = 1.0f;\n    g[i] = v;\n}}\n"
        ),
    );
    let slices = ks.add(
        "unscale_slices",
        "extern \"C\" __global__ void KNAME(void* b, u64 nnz, u64 row, const float* \
         __restrict__ factor, float* __restrict__ bad, float bound) {\n    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    \
         u64 rows = (u64)*sl_count(b);\n    if (rows > nnz) rows = nnz;\n    if (i >= rows * row) \
         return;\n    float* v = sl_val(b, nnz);\n    float x = v[i] * *factor;\n    if \
         (!(fabsf(v[i]) < bound) || !isfinite(x)) *bad = 1.0f;\n    v[i] = x;\n}\n"
            .to_string(),
    );
    (dense, slices)
}
