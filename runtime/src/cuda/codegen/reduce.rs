//! Reductions and what is built on them: sum and mean over axes, `sum_to`,
//! `broadcast_to`, the softmax family with its gradients, the two losses with theirs,
//! and layer normalisation.
//!
//! A reduction runs one block per output element (or per softmax lane, per row): the
//! block's threads stride over the reduced elements and meet in a block reduction of
//! fixed shape, so a result has the same bits every run (no atomics). The index maps
//! of the kept and the reduced axes are baked in.

use super::index::{broadcast_map, reduction_maps};
use super::{flit, want_f32, want_float, want_i32, Elem, KArg, KernelSet, NodeCx, BLOCK, INDEX};
use distc_ir::shape::broadcasts_to;
use distc_ir::TensorType;

/// Threads per block for reducing `len` elements: a multiple of 32, at most 256.
fn block_for(len: usize) -> u32 {
    (len.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// A grid of `n` blocks.
fn grid(n: usize) -> Result<[u32; 3], String> {
    match u32::try_from(n) {
        Ok(g) if g < (1 << 31) => Ok([g, 1, 1]),
        _ => Err(format!("{n} blocks are more than a grid holds")),
    }
}

/// `y[o] = sum (or mean) of x over the reduced map`, one block per output element.
fn reduce_kernel(
    cx: &mut NodeCx<'_>,
    x: &TensorType,
    axes: &[usize],
    mean: bool,
    outputs: usize,
) -> Result<(), String> {
    let ex = want_float(x, "input 0")?;
    let ey: Elem = want_float(cx.tout(0)?, "the output")?;
    let (kept, red) = reduction_maps(x.dims(), axes);
    if kept.len() != outputs {
        return Err(format!(
            "reducing {x} over {axes:?} gives {} elements, the output has {outputs}",
            kept.len()
        ));
    }
    let count = red.len();
    let fin = if mean {
        format!("acc / {}", flit(count as f64))
    } else {
        "acc".into()
    };
    let text = format!(
        "// {what} of {x} over axes {axes:?}\nextern \"C\" __global__ void KNAME(const {}* x, {}* y) {{\n    __shared__ float sh[32];\n    u64 o = blockIdx.x;\n    {}\n    float acc = 0.0f;\n    for (u64 r = threadIdx.x; r < {count}ull; r += blockDim.x) {{\n        {}\n        acc += {};\n    }}\n    acc = block_sum(acc, sh);\n    if (threadIdx.x == 0) {}\n}}\n",
        ex.c(),
        ey.c(),
        kept.emit("base", "o"),
        red.emit("off", "r"),
        ex.load("x[base + off]"),
        ey.store("y", "o", &fin),
        what = if mean { "mean" } else { "sum" },
    );
    let name = cx.kernel(if mean { "mean" } else { "sum" }, text);
    if outputs > 0 {
        cx.launch(
            &name,
            grid(outputs)?,
            block_for(count),
            vec![KArg::Input(0), KArg::Output(0)],
        );
    }
    Ok(())
}

/// Sum or mean over `axes` (sorted, distinct): kept size-1 axes do not move data.
pub(crate) fn sum_axes(cx: &mut NodeCx<'_>, axes: &[usize], mean: bool) -> Result<(), String> {
    let x = cx.tin(0)?.clone();
    if axes.windows(2).any(|w| w[0] >= w[1]) || axes.iter().any(|&a| a >= x.dims().len()) {
        return Err(format!(
            "axes {axes:?} are not sorted, distinct axes of {x}"
        ));
    }
    let outputs = cx.tout(0)?.shape.numel();
    reduce_kernel(cx, &x, axes, mean, outputs)
}

/// Sums `x` down to the output's shape over its broadcast axes.
pub(crate) fn sum_to(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (x, y) = (cx.tin(0)?.clone(), cx.tout(0)?.clone());
    if !broadcasts_to(y.dims(), x.dims()) {
        return Err(format!("{x} cannot be summed down to {y}"));
    }
    let lead = x.dims().len() - y.dims().len();
    let axes: Vec<usize> = (0..x.dims().len())
        .filter(|&i| i < lead || (y.dims()[i - lead] == 1 && x.dims()[i] != 1))
        .collect();
    reduce_kernel(cx, &x, &axes, false, y.shape.numel())
}

/// Broadcasts `x` to the output's shape: one thread per output element.
pub(crate) fn broadcast_to(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (x, y) = (cx.tin(0)?.clone(), cx.tout(0)?.clone());
    let (ex, ey) = (want_float(&x, "input 0")?, want_float(&y, "the output")?);
    let map = broadcast_map(x.dims(), y.dims())
        .ok_or_else(|| format!("{x} does not broadcast to {y}"))?;
    let n = y.shape.numel();
    let copy = if ex == ey {
        "y[i] = x[o];".to_string()
    } else {
        ey.store("y", "i", &ex.load("x[o]"))
    };
    let text = format!(
        "// broadcast {x} to {y}\nextern \"C\" __global__ void KNAME(const {}* x, {}* y, u64 n) {{\n{INDEX}    {}\n    {copy}\n}}\n",
        ex.c(),
        ey.c(),
        map.emit("o", "i")
    );
    let name = cx.kernel("broadcast", text);
    cx.launch_1d(
        &name,
        n,
        vec![KArg::Input(0), KArg::Output(0), KArg::U64(n as u64)],
    )
}

/// `(outer, axis length, inner)` of a softmax along `axis` of `x`.
fn lanes(x: &TensorType, axis: usize) -> Result<(usize, usize, usize), String> {
    let d = x.dims();
    if axis >= d.len() {
        return Err(format!("axis {axis} is out of range for {x}"));
    }
    Ok((
        d[..axis].iter().product(),
        d[axis],
        d[axis + 1..].iter().product(),
    ))
}

/// The C that opens a lane kernel: `base` is the lane's first element, elements are
/// `INNER` apart.
fn lane_open(len: usize, inner: usize) -> String {
    format!(
        "    __shared__ float sh[32];\n    u64 lane = blockIdx.x;\n    u64 base = (lane / {inner}ull) * {len}ull * {inner}ull + lane % {inner}ull;\n"
    )
}

/// Softmax (or log-softmax) along `axis`, one block per lane, the lane's maximum
/// subtracted first.
pub(crate) fn softmax(cx: &mut NodeCx<'_>, axis: usize, log: bool) -> Result<(), String> {
    let x = cx.tin(0)?.clone();
    want_f32(&x, "input 0")?;
    let (outer, len, inner) = lanes(&x, axis)?;
    let write = if log {
        "y[base + j * INNERull] = x[base + j * INNERull] - m - logf(s);"
    } else {
        "y[base + j * INNERull] = expf(x[base + j * INNERull] - m) * inv;"
    }
    .replace("INNER", &inner.to_string());
    let text = format!(
        "// {op} of {x} along axis {axis}\nextern \"C\" __global__ void KNAME(const float* x, float* y) {{\n{open}    float m = -__int_as_float(0x7f800000);\n    for (u64 j = threadIdx.x; j < {len}ull; j += blockDim.x) m = fmaxf(m, x[base + j * {inner}ull]);\n    m = block_max(m, sh);\n    float s = 0.0f;\n    for (u64 j = threadIdx.x; j < {len}ull; j += blockDim.x) s += expf(x[base + j * {inner}ull] - m);\n    s = block_sum(s, sh);\n    float inv = 1.0f / s;\n    for (u64 j = threadIdx.x; j < {len}ull; j += blockDim.x) {write}\n}}\n",
        op = if log { "log_softmax" } else { "softmax" },
        open = lane_open(len, inner),
    );
    let name = cx.kernel(if log { "log_softmax" } else { "softmax" }, text);
    if outer * inner > 0 && len > 0 {
        cx.launch(
            &name,
            grid(outer * inner)?,
            block_for(len),
            vec![KArg::Input(0), KArg::Output(0)],
        );
    }
    Ok(())
}

/// Softmax gradient `y * (dy - sum(dy * y))`, or log-softmax gradient
/// `dy - exp(y) * sum(dy)`, along `axis`, one block per lane.
pub(crate) fn softmax_grad(cx: &mut NodeCx<'_>, axis: usize, log: bool) -> Result<(), String> {
    let (dy, y) = (cx.tin(0)?.clone(), cx.tin(1)?.clone());
    want_f32(&dy, "dy")?;
    if dy != y {
        return Err(format!("dy {dy} and y {y} differ"));
    }
    let (outer, len, inner) = lanes(&y, axis)?;
    let at = format!("base + j * {inner}ull");
    let (sum, write) = if log {
        (
            format!("d[{at}]"),
            format!("dx[{at}] = d[{at}] - expf(y[{at}]) * s;"),
        )
    } else {
        (
            format!("d[{at}] * y[{at}]"),
            format!("dx[{at}] = y[{at}] * (d[{at}] - s);"),
        )
    };
    let text = format!(
        "// {op}_grad of {y} along axis {axis}\nextern \"C\" __global__ void KNAME(const float* d, const float* y, float* dx) {{\n{open}    float s = 0.0f;\n    for (u64 j = threadIdx.x; j < {len}ull; j += blockDim.x) s += {sum};\n    s = block_sum(s, sh);\n    for (u64 j = threadIdx.x; j < {len}ull; j += blockDim.x) {write}\n}}\n",
        op = if log { "log_softmax" } else { "softmax" },
        open = lane_open(len, inner),
    );
    let name = cx.kernel(
        if log {
            "log_softmax_grad"
        } else {
            "softmax_grad"
        },
        text,
    );
    if outer * inner > 0 && len > 0 {
        cx.launch(
            &name,
            grid(outer * inner)?,
            block_for(len),
            vec![KArg::Input(0), KArg::Input(1), KArg::Output(0)],
        );
    }
    Ok(())
}

/// Checks `[B, K]` logits against `i32[B]` labels; returns `(B, K)`.
fn sce_shapes(logits: &TensorType, labels: &TensorType) -> Result<(usize, usize), String> {
    want_f32(logits, "the logits")?;
    want_i32(labels, "the labels")?;
    match (logits.dims(), labels.dims()) {
        ([b, k], [l]) if b == l => Ok((*b, *k)),
        _ => Err(format!(
            "logits must be [B, K] and labels i32[B], got {logits} and {labels}"
        )),
    }
}

/// Single-block mean of `n` floats into `y[0]` (a fixed-order reduction).
const MEAN1: &str = "extern \"C\" __global__ void KNAME(const float* x, float* y, u64 n) {
    __shared__ float sh[32];
    float acc = 0.0f;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) y[0] = acc / (float)n;
}
";

/// Mean softmax cross-entropy: per row `logsumexp - x[label]` into scratch (one block
/// per row), then their mean (one block). A label outside `0..K` gives NaN, which the
/// training loop's NaN stop reports (the CPU backend refuses it by name).
pub(crate) fn sce(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (b, k) = sce_shapes(&cx.tin(0)?.clone(), &cx.tin(1)?.clone())?;
    let text = format!(
        "// per-row softmax cross-entropy of [{b}, {k}] logits\nextern \"C\" __global__ void KNAME(const float* x, const int* labels, float* loss) {{\n    __shared__ float sh[32];\n    const float* row = x + (u64)blockIdx.x * {k}ull;\n    float m = -__int_as_float(0x7f800000);\n    for (u64 j = threadIdx.x; j < {k}ull; j += blockDim.x) m = fmaxf(m, row[j]);\n    m = block_max(m, sh);\n    float s = 0.0f;\n    for (u64 j = threadIdx.x; j < {k}ull; j += blockDim.x) s += expf(row[j] - m);\n    s = block_sum(s, sh);\n    if (threadIdx.x == 0) {{\n        int l = labels[blockIdx.x];\n        loss[blockIdx.x] = (l >= 0 && l < {k}) ? m + logf(s) - row[l] : __int_as_float(0x7fc00000);\n    }}\n}}\n"
    );
    let rows = cx.kernel("sce_rows", text);
    let mean = cx.kernel("mean1", MEAN1.to_string());
    let scratch = cx.scratch(4 * b);
    if b > 0 && k > 0 {
        cx.launch(
            &rows,
            grid(b)?,
            block_for(k),
            vec![KArg::Input(0), KArg::Input(1), scratch.clone()],
        );
    }
    cx.launch(
        &mean,
        [1, 1, 1],
        block_for(b),
        vec![scratch, KArg::Output(0), KArg::U64(b as u64)],
    );
    Ok(())
}

/// `dloss * (softmax(logits) - onehot(labels)) / B`, one block per row; `dloss` is
/// read from device memory.
pub(crate) fn sce_grad(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let d = cx.tin(0)?.clone();
    want_f32(&d, "dloss")?;
    if d.shape.numel() != 1 {
        return Err(format!("dloss must be a scalar, got {d}"));
    }
    let (b, k) = sce_shapes(&cx.tin(1)?.clone(), &cx.tin(2)?.clone())?;
    let text = format!(
        "// softmax cross-entropy gradient of [{b}, {k}] logits\nextern \"C\" __global__ void KNAME(const float* dloss, const float* x, const int* labels, float* dx) {{\n    __shared__ float sh[32];\n    const float* row = x + (u64)blockIdx.x * {k}ull;\n    float* out = dx + (u64)blockIdx.x * {k}ull;\n    float m = -__int_as_float(0x7f800000);\n    for (u64 j = threadIdx.x; j < {k}ull; j += blockDim.x) m = fmaxf(m, row[j]);\n    m = block_max(m, sh);\n    float s = 0.0f;\n    for (u64 j = threadIdx.x; j < {k}ull; j += blockDim.x) s += expf(row[j] - m);\n    s = block_sum(s, sh);\n    float scale = dloss[0] / {bf};\n    float f = scale / s;\n    int l = labels[blockIdx.x];\n    for (u64 j = threadIdx.x; j < {k}ull; j += blockDim.x) {{\n        float v = expf(row[j] - m) * f;\n        out[j] = (long long)j == l ? v - scale : v;\n    }}\n}}\n",
        bf = flit(b as f64),
    );
    let name = cx.kernel("sce_grad", text);
    if b > 0 && k > 0 {
        cx.launch(
            &name,
            grid(b)?,
            block_for(k),
            vec![
                KArg::Input(0),
                KArg::Input(1),
                KArg::Input(2),
                KArg::Output(0),
            ],
        );
    }
    Ok(())
}

/// Checks prediction and target have one f32 type; returns the element count.
fn mse_shapes(p: &TensorType, t: &TensorType) -> Result<usize, String> {
    want_f32(p, "the prediction")?;
    if p != t {
        return Err(format!("prediction {p} and target {t} differ"));
    }
    Ok(p.shape.numel())
}

/// `mean((p - t)^2)` in one block.
pub(crate) fn mse(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let n = mse_shapes(&cx.tin(0)?.clone(), &cx.tin(1)?.clone())?;
    let text =
        "extern \"C\" __global__ void KNAME(const float* p, const float* t, float* y, u64 n) {
    __shared__ float sh[32];
    float acc = 0.0f;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) { float d = p[i] - t[i]; acc += d * d; }
    acc = block_sum(acc, sh);
    if (threadIdx.x == 0) y[0] = acc / (float)n;
}
"
        .to_string();
    let name = cx.kernel("mse", text);
    cx.launch(
        &name,
        [1, 1, 1],
        block_for(n),
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Output(0),
            KArg::U64(n as u64),
        ],
    );
    Ok(())
}

/// `dloss * 2 (p - t) / n`, `dloss` read from device memory.
pub(crate) fn mse_grad(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let d = cx.tin(0)?.clone();
    want_f32(&d, "dloss")?;
    if d.shape.numel() != 1 {
        return Err(format!("dloss must be a scalar, got {d}"));
    }
    let n = mse_shapes(&cx.tin(1)?.clone(), &cx.tin(2)?.clone())?;
    let text = format!(
        "extern \"C\" __global__ void KNAME(const float* dloss, const float* p, const float* t, float* y, u64 n) {{\n{INDEX}    float c = dloss[0] * 2.0f / (float)n;\n    y[i] = (p[i] - t[i]) * c;\n}}\n"
    );
    let name = cx.kernel("mse_grad", text);
    cx.launch_1d(
        &name,
        n,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Input(2),
            KArg::Output(0),
            KArg::U64(n as u64),
        ],
    )
}

/// Rows and row length of a layer norm over the last axis of `x`, with `params` each
/// `[D]`.
fn ln_shapes(x: &TensorType, params: &[&TensorType]) -> Result<(usize, usize), String> {
    want_f32(x, "x")?;
    let d = *x
        .dims()
        .last()
        .ok_or_else(|| format!("needs rank 1 or more, got {x}"))?;
    for p in params {
        if p.dims() != [d] {
            return Err(format!("gamma and beta must be [{d}] for {x}, got {p}"));
        }
    }
    Ok((x.shape.numel() / d.max(1), d))
}

/// The C computing a row's `mean` and `inv = 1/sqrt(var + eps)` (biased variance, two
/// passes, as the CPU does), `row` pointing at the row.
fn row_stats(d: usize, eps: f64) -> String {
    format!(
        "    float mean = 0.0f;\n    for (u64 j = threadIdx.x; j < {d}ull; j += blockDim.x) mean += row[j];\n    mean = block_sum(mean, sh) / {df};\n    float var = 0.0f;\n    for (u64 j = threadIdx.x; j < {d}ull; j += blockDim.x) {{ float c = row[j] - mean; var += c * c; }}\n    var = block_sum(var, sh) / {df};\n    float inv = 1.0f / sqrtf(var + {eps});\n",
        df = flit(d as f64),
        eps = flit(eps),
    )
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last axis, one block per row.
pub(crate) fn layer_norm(cx: &mut NodeCx<'_>, eps: f64) -> Result<(), String> {
    let (x, g, b) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tin(2)?.clone());
    let (rows, d) = ln_shapes(&x, &[&g, &b])?;
    let text = format!(
        "// layer_norm of {x}\nextern \"C\" __global__ void KNAME(const float* x, const float* gamma, const float* beta, float* y) {{\n    __shared__ float sh[32];\n    const float* row = x + (u64)blockIdx.x * {d}ull;\n    float* out = y + (u64)blockIdx.x * {d}ull;\n{}    for (u64 j = threadIdx.x; j < {d}ull; j += blockDim.x) out[j] = (row[j] - mean) * inv * gamma[j] + beta[j];\n}}\n",
        row_stats(d, eps)
    );
    let name = cx.kernel("layer_norm", text);
    if rows > 0 && d > 0 {
        cx.launch(
            &name,
            grid(rows)?,
            block_for(d),
            vec![
                KArg::Input(0),
                KArg::Input(1),
                KArg::Input(2),
                KArg::Output(0),
            ],
        );
    }
    Ok(())
}

/// Rows a thread of layer norm's column sums adds before the sums of the chunks are
/// added: a [8192, 768] gradient's columns, one thread each over every row, left most
/// of the GPU idle for a millisecond (GPT-2 124M).
const LN_CHUNK: usize = 64;

/// `(dy, x, gamma) -> (dx, dgamma, dbeta)`: one block per row computes `dx` and keeps
/// the row's mean and `inv` in scratch; then one thread per column and chunk of
/// [`LN_CHUNK`] rows sums that chunk's `dgamma` and `dbeta` terms in order, and one
/// thread per column adds the chunks in order (no atomics, the same bits every run).
pub(crate) fn layer_norm_grad(cx: &mut NodeCx<'_>, eps: f64) -> Result<(), String> {
    let (dy, x, g) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tin(2)?.clone());
    if dy != x {
        return Err(format!("dy {dy} and x {x} differ"));
    }
    let (rows, d) = ln_shapes(&x, &[&g])?;
    let text = format!(
        "// layer_norm_grad of {x}: dx and each row's statistics\nextern \"C\" __global__ void KNAME(const float* dy, const float* x, const float* gamma, float* dx, float* stats) {{\n    __shared__ float sh[32];\n    const float* row = x + (u64)blockIdx.x * {d}ull;\n    const float* drow = dy + (u64)blockIdx.x * {d}ull;\n    float* out = dx + (u64)blockIdx.x * {d}ull;\n{}    float s1 = 0.0f, s2 = 0.0f;\n    for (u64 j = threadIdx.x; j < {d}ull; j += blockDim.x) {{\n        float dxhat = drow[j] * gamma[j];\n        s1 += dxhat;\n        s2 += dxhat * (row[j] - mean) * inv;\n    }}\n    s1 = block_sum(s1, sh);\n    s2 = block_sum(s2, sh);\n    float f = inv / {df};\n    for (u64 j = threadIdx.x; j < {d}ull; j += blockDim.x) {{\n        float xhat = (row[j] - mean) * inv;\n        out[j] = f * ({df} * drow[j] * gamma[j] - s1 - xhat * s2);\n    }}\n    if (threadIdx.x == 0) {{ stats[2 * blockIdx.x] = mean; stats[2 * blockIdx.x + 1] = inv; }}\n}}\n",
        row_stats(d, eps),
        df = flit(d as f64),
    );
    let rows_k = cx.kernel("layer_norm_grad_rows", text);
    let chunks = rows.div_ceil(LN_CHUNK).max(1);
    let chunk_text = format!(
        "// layer_norm_grad of {x}: dgamma and dbeta terms of a chunk of {LN_CHUNK} rows, one thread per column and chunk\nextern \"C\" __global__ void KNAME(const float* dy, const float* x, const float* stats, float* part) {{\n    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= {cells}ull) return;\n    u64 c = i / {d}ull, j = i % {d}ull;\n    u64 r1 = (c + 1ull) * {LN_CHUNK}ull < {rows}ull ? (c + 1ull) * {LN_CHUNK}ull : {rows}ull;\n    float g = 0.0f, b = 0.0f;\n    for (u64 r = c * {LN_CHUNK}ull; r < r1; ++r) {{\n        float v = dy[r * {d}ull + j];\n        g += v * (x[r * {d}ull + j] - stats[2 * r]) * stats[2 * r + 1];\n        b += v;\n    }}\n    part[i] = g;\n    part[{cells}ull + i] = b;\n}}\n",
        cells = chunks * d,
    );
    let cols_text = format!(
        "// layer_norm_grad of {x}: dgamma and dbeta, the chunks added in order, one thread per column\nextern \"C\" __global__ void KNAME(const float* part, float* dgamma, float* dbeta) {{\n    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (j >= {d}ull) return;\n    float g = 0.0f, b = 0.0f;\n    for (u64 c = 0; c < {chunks}ull; ++c) {{\n        g += part[c * {d}ull + j];\n        b += part[{cells}ull + c * {d}ull + j];\n    }}\n    dgamma[j] = g;\n    dbeta[j] = b;\n}}\n",
        cells = chunks * d,
    );
    let chunk_k = cx.kernel("layer_norm_grad_chunks", chunk_text);
    let cols_k = cx.kernel("layer_norm_grad_cols", cols_text);
    let stats = cx.scratch(8 * rows);
    if rows > 0 && d > 0 {
        cx.launch(
            &rows_k,
            grid(rows)?,
            block_for(d),
            vec![
                KArg::Input(0),
                KArg::Input(1),
                KArg::Input(2),
                KArg::Output(0),
                stats.clone(),
            ],
        );
    }
    let part = cx.scratch(8 * chunks * d);
    cx.launch_1d(
        &chunk_k,
        chunks * d,
        vec![KArg::Input(0), KArg::Input(1), stats, part.clone()],
    )?;
    cx.launch_1d(&cols_k, d, vec![part, KArg::Output(1), KArg::Output(2)])
}

/// Most blocks one gradient's sum of squares is cut into: enough to fill a GPU, few
/// enough that their partial sums are a small read.
pub(crate) const SQUARE_BLOCKS: usize = 1024;

/// `g[n] (f32) -> partial[gridDim.x] (f64)`: each block's sum of the squares of its
/// grid-stride share of `g`, in f64 (as the CPU sums a gradient's squares), reduced in
/// a fixed tree: the same bits every run. The host adds the partials in order.
pub(crate) fn square_partials(ks: &mut KernelSet) -> String {
    ks.add(
        "square_partials",
        format!(
            "// the f64 sum of squares of each block's grid-stride share of g\nextern \"C\" __global__ void KNAME(const float* __restrict__ g, u64 n, double* __restrict__ partial) {{\n    __shared__ double sh[{block}];\n    double acc = 0.0;\n    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {{\n        double x = (double)g[i];\n        acc += x * x;\n    }}\n    sh[threadIdx.x] = acc;\n    __syncthreads();\n    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {{\n        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];\n        __syncthreads();\n    }}\n    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];\n}}\n",
            block = BLOCK
        ),
    )
}
