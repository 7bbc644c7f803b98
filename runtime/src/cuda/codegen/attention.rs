//! Scaled dot-product attention, fused: no `Tq x Tk` score matrix is ever stored. The
//! forward kernel runs one thread per query row with an online softmax (running max
//! and sum, the output rescaled only when the max grows: the flash-attention
//! recurrence); the gradient recomputes the scores, one thread per query row for `dq`
//! (which also keeps each row's log-sum-exp and `rowsum(dy * y)` in scratch), then one
//! thread per key row for `dk` and `dv`, summing over the queries in order: no atomics,
//! the same bits every run.
//!
//! A thread's own rows (its query or key, its accumulators) live in registers: the head
//! sizes are constants of the generated code, so the loops over them unroll. The rows
//! every thread of a warp reads at once (key `j` in the forward, query `t` in the key
//! kernel) are one address for the whole warp, a broadcast: the key kernel starts each
//! warp's loop at the warp's first key, so its lanes walk the queries in step, masked
//! below their own key. (Keeping thread-private rows in global memory, read and
//! written once per key, made a GPT-2 124M step's attention most of its time.)
//! Tiling over shared memory and tensor cores is the next step (GPU issue).

use super::{flit, want_f32, KArg, NodeCx, INDEX};
use distc_ir::shape::attention_shape;

/// Sizes of the attention of node inputs `q, k, v` at `first..first + 3`.
struct Sizes {
    rows: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

fn sizes(cx: &NodeCx<'_>, first: usize) -> Result<Sizes, String> {
    let (q, k, v) = (
        cx.tin(first)?.clone(),
        cx.tin(first + 1)?.clone(),
        cx.tin(first + 2)?.clone(),
    );
    for (t, what) in [(&q, "q"), (&k, "k"), (&v, "v")] {
        want_f32(t, what)?;
    }
    attention_shape(&q, &k, &v)?;
    let r = q.shape.rank();
    Ok(Sizes {
        rows: q.shape.numel() / q.dims()[r - 1].max(1),
        tq: q.dims()[r - 2],
        tk: k.dims()[r - 2],
        d: q.dims()[r - 1],
        dv: v.dims()[r - 1],
    })
}

/// The C lines that set `s` (slice), `t` (query position) and `live` (keys attended)
/// for query row `i`.
fn row_prologue(n: &Sizes, causal: bool) -> String {
    let live = if causal {
        format!("(t + 1ull < {tk}ull ? t + 1ull : {tk}ull)", tk = n.tk)
    } else {
        format!("{}ull", n.tk)
    };
    format!(
        "    u64 s = i / {tq}ull, t = i % {tq}ull;\n    u64 live = {live};\n",
        tq = n.tq.max(1)
    )
}

/// C lines copying `len` floats from `src` (an expression of a row's start) into a new
/// register array `name`.
fn load_row(name: &str, len: usize, src: &str) -> String {
    format!(
        "    float {name}[{len}];\n    const float* {name}_src = {src};\n#pragma unroll\n    for (int e = 0; e < {len}; ++e) {name}[e] = {name}_src[e];\n"
    )
}

/// C lines declaring register array `name` of `len` zeros.
fn zeros(name: &str, len: usize) -> String {
    format!("    float {name}[{len}];\n#pragma unroll\n    for (int e = 0; e < {len}; ++e) {name}[e] = 0.0f;\n")
}

/// The C expression of `sum_e a[e] * b[e]` as a statement setting `out`, `a` a register
/// array, `b` a pointer.
fn dot(out: &str, a: &str, b: &str, len: usize) -> String {
    format!(
        "float {out} = 0.0f;\n#pragma unroll\n        for (int e = 0; e < {len}; ++e) {out} += {a}[e] * {b}[e];"
    )
}

/// `attention(q, k, v) -> y`.
pub(crate) fn attention(cx: &mut NodeCx<'_>, causal: bool, scale: f64) -> Result<(), String> {
    let n = sizes(cx, 0)?;
    let (d, dv, tk) = (n.d, n.dv, n.tk);
    let text = format!(
        "// attention, {rows} query rows of {tq}, {tk} keys, D {d}, Dv {dv}, causal {causal}\nextern \"C\" __global__ void KNAME(const float* q, const float* k, const float* v, float* y, u64 n) {{\n{INDEX}{pro}{qr}{acc}    const float* kb = k + s * {tk}ull * {d}ull;\n    const float* vb = v + s * {tk}ull * {dv}ull;\n    float m = -3.0e38f, l = 0.0f;\n    for (u64 j = 0; j < live; ++j) {{\n        const float* kj = kb + j * {d}ull;\n        const float* vj = vb + j * {dv}ull;\n        {score}\n        sc *= {sc};\n        if (sc > m) {{\n            float corr = expf(m - sc);\n            l *= corr;\n#pragma unroll\n            for (int e = 0; e < {dv}; ++e) acc[e] *= corr;\n            m = sc;\n        }}\n        float p = expf(sc - m);\n        l += p;\n#pragma unroll\n        for (int e = 0; e < {dv}; ++e) acc[e] += p * vj[e];\n    }}\n    float inv = l > 0.0f ? 1.0f / l : 0.0f;\n    float* out = y + i * {dv}ull;\n#pragma unroll\n    for (int e = 0; e < {dv}; ++e) out[e] = acc[e] * inv;\n}}\n",
        rows = n.rows,
        tq = n.tq,
        pro = row_prologue(&n, causal),
        qr = load_row("qr", d, &format!("q + i * {d}ull")),
        acc = zeros("acc", dv),
        score = dot("sc", "qr", "kj", d),
        sc = flit(scale),
    );
    let name = cx.kernel("attention", text);
    cx.launch_1d(
        &name,
        n.rows,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Input(2),
            KArg::Output(0),
            KArg::U64(n.rows as u64),
        ],
    )
}

/// `(dy, q, k, v) -> (dq, dk, dv)`.
pub(crate) fn attention_grad(cx: &mut NodeCx<'_>, causal: bool, scale: f64) -> Result<(), String> {
    let n = sizes(cx, 1)?;
    let (d, dv, tk, tq) = (n.d, n.dv, n.tk, n.tq);
    let sc = flit(scale);
    // Per query row: the log-sum-exp, delta = rowsum(dy * y) = sum_j p_j (dy . v_j),
    // then dq = scale * sum_j p_j (dy . v_j - delta) k_j.
    let rows_text = format!(
        "// attention_grad: dq and each query row's statistics\nextern \"C\" __global__ void KNAME(const float* dy, const float* q, const float* k, const float* v, float* dq, float* stats, u64 n) {{\n{INDEX}{pro}{qr}{dyr}    const float* kb = k + s * {tk}ull * {d}ull;\n    const float* vb = v + s * {tk}ull * {dv}ull;\n    float m = -3.0e38f, l = 0.0f;\n    for (u64 j = 0; j < live; ++j) {{\n        const float* kj = kb + j * {d}ull;\n        {score}\n        sc *= {sc};\n        if (sc > m) {{\n            l *= expf(m - sc);\n            m = sc;\n        }}\n        l += expf(sc - m);\n    }}\n    float lse = m + logf(l);\n    float delta = 0.0f;\n    for (u64 j = 0; j < live; ++j) {{\n        const float* kj = kb + j * {d}ull;\n        const float* vj = vb + j * {dv}ull;\n        {score}\n        sc *= {sc};\n        {dp}\n        delta += expf(sc - lse) * dp;\n    }}\n{acc}    for (u64 j = 0; j < live; ++j) {{\n        const float* kj = kb + j * {d}ull;\n        const float* vj = vb + j * {dv}ull;\n        {score}\n        sc *= {sc};\n        {dp}\n        float ds = expf(sc - lse) * (dp - delta) * {sc};\n#pragma unroll\n        for (int e = 0; e < {d}; ++e) acc[e] += ds * kj[e];\n    }}\n    float* out = dq + i * {d}ull;\n#pragma unroll\n    for (int e = 0; e < {d}; ++e) out[e] = acc[e];\n    stats[2 * i] = lse;\n    stats[2 * i + 1] = delta;\n}}\n",
        pro = row_prologue(&n, causal),
        qr = load_row("qr", d, &format!("q + i * {d}ull")),
        dyr = load_row("dyr", dv, &format!("dy + i * {dv}ull")),
        acc = zeros("acc", d),
        score = dot("sc", "qr", "kj", d),
        dp = dot("dp", "dyr", "vj", dv),
    );
    // Per key row j of slice s: the queries that attend it, in order. A causal loop
    // starts at the warp's first key (lanes hold consecutive keys), so every lane reads
    // the same query row at once; a lane skips the queries before its own key.
    let first_query = if causal {
        "(j >= (u64)(threadIdx.x % 32u) ? j - (u64)(threadIdx.x % 32u) : 0ull)"
    } else {
        "0ull"
    };
    let attends = if causal { "t >= j" } else { "true" };
    let keys_text = format!(
        "// attention_grad: dk and dv, one thread per key row\nextern \"C\" __global__ void KNAME(const float* dy, const float* q, const float* k, const float* v, const float* stats, float* dk, float* dvo, u64 n) {{\n{INDEX}    u64 s = i / {tkk}ull, j = i % {tkk}ull;\n{kr}{vr}{dka}{dva}    for (u64 t = {first_query}; t < {tq}ull; ++t) {{\n        if (!({attends})) continue;\n        u64 r = s * {tq}ull + t;\n        const float* qt = q + r * {d}ull;\n        const float* dyt = dy + r * {dv}ull;\n        float sc = 0.0f, dp = 0.0f;\n#pragma unroll\n        for (int e = 0; e < {d}; ++e) sc += qt[e] * kr[e];\n        sc *= {sc};\n        float p = expf(sc - stats[2 * r]);\n#pragma unroll\n        for (int e = 0; e < {dv}; ++e) {{\n            dva[e] += p * dyt[e];\n            dp += dyt[e] * vr[e];\n        }}\n        float ds = p * (dp - stats[2 * r + 1]) * {sc};\n#pragma unroll\n        for (int e = 0; e < {d}; ++e) dka[e] += ds * qt[e];\n    }}\n#pragma unroll\n    for (int e = 0; e < {d}; ++e) dk[i * {d}ull + e] = dka[e];\n#pragma unroll\n    for (int e = 0; e < {dv}; ++e) dvo[i * {dv}ull + e] = dva[e];\n}}\n",
        tkk = tk.max(1),
        kr = load_row("kr", d, &format!("k + i * {d}ull")),
        vr = load_row("vr", dv, &format!("v + i * {dv}ull")),
        dka = zeros("dka", d),
        dva = zeros("dva", dv),
    );
    let rows_k = cx.kernel("attention_grad_rows", rows_text);
    let keys_k = cx.kernel("attention_grad_keys", keys_text);
    let stats = cx.scratch(8 * n.rows);
    let key_rows = n.rows / tq.max(1) * tk;
    cx.launch_1d(
        &rows_k,
        n.rows,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Input(2),
            KArg::Input(3),
            KArg::Output(0),
            stats.clone(),
            KArg::U64(n.rows as u64),
        ],
    )?;
    cx.launch_1d(
        &keys_k,
        key_rows,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Input(2),
            KArg::Input(3),
            stats,
            KArg::Output(1),
            KArg::Output(2),
            KArg::U64(key_rows as u64),
        ],
    )
}
