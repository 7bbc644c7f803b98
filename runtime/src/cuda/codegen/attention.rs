//! Scaled dot-product attention, fused: no `Tq x Tk` score matrix is ever stored. The
//! forward kernel runs one thread per query row with an online softmax (running max
//! and sum, the output rescaled as the max grows: the flash-attention recurrence); the
//! gradient recomputes the scores, one thread per query row for `dq` (which also keeps
//! each row's log-sum-exp and `rowsum(dy * y)` in scratch), then one thread per key row
//! for `dk` and `dv`, summing over the queries in order: no atomics, the same bits every
//! run. A thread-per-row kernel is the simple correct one; tiling it over shared memory
//! is the GPU issue's.

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

/// The C expression of the scaled score of query row `i` against key `j` of slice `s`.
fn score(n: &Sizes, scale: f64) -> String {
    format!(
        "float sc = 0.0f;\n        for (u64 e = 0; e < {d}ull; ++e) sc += q[i * {d}ull + e] * k[(s * {tk}ull + j) * {d}ull + e];\n        sc *= {scale};",
        d = n.d,
        tk = n.tk,
        scale = flit(scale)
    )
}

/// `attention(q, k, v) -> y`.
pub(crate) fn attention(cx: &mut NodeCx<'_>, causal: bool, scale: f64) -> Result<(), String> {
    let n = sizes(cx, 0)?;
    let text = format!(
        "// attention, {rows} query rows of {tq}, {tk} keys, D {d}, Dv {dv}, causal {causal}\nextern \"C\" __global__ void KNAME(const float* q, const float* k, const float* v, float* y, u64 n) {{\n{INDEX}{pro}    float* out = y + i * {dv}ull;\n    for (u64 e = 0; e < {dv}ull; ++e) out[e] = 0.0f;\n    float m = -3.0e38f, l = 0.0f;\n    for (u64 j = 0; j < live; ++j) {{\n        {score}\n        float mn = sc > m ? sc : m;\n        float corr = expf(m - mn), p = expf(sc - mn);\n        l = l * corr + p;\n        for (u64 e = 0; e < {dv}ull; ++e) out[e] = out[e] * corr + p * v[(s * {tk}ull + j) * {dv}ull + e];\n        m = mn;\n    }}\n    float inv = l > 0.0f ? 1.0f / l : 0.0f;\n    for (u64 e = 0; e < {dv}ull; ++e) out[e] *= inv;\n}}\n",
        rows = n.rows,
        tq = n.tq,
        tk = n.tk,
        d = n.d,
        dv = n.dv,
        pro = row_prologue(&n, causal),
        score = score(&n, scale),
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
        "// attention_grad: dq and each query row's statistics\nextern \"C\" __global__ void KNAME(const float* dy, const float* q, const float* k, const float* v, float* dq, float* stats, u64 n) {{\n{INDEX}{pro}    float m = -3.0e38f, l = 0.0f;\n    for (u64 j = 0; j < live; ++j) {{\n        {score}\n        float mn = sc > m ? sc : m;\n        l = l * expf(m - mn) + expf(sc - mn);\n        m = mn;\n    }}\n    float lse = m + logf(l);\n    float delta = 0.0f;\n    for (u64 j = 0; j < live; ++j) {{\n        {score}\n        float p = expf(sc - lse), dp = 0.0f;\n        for (u64 e = 0; e < {dv}ull; ++e) dp += dy[i * {dv}ull + e] * v[(s * {tk}ull + j) * {dv}ull + e];\n        delta += p * dp;\n    }}\n    for (u64 e = 0; e < {d}ull; ++e) dq[i * {d}ull + e] = 0.0f;\n    for (u64 j = 0; j < live; ++j) {{\n        {score}\n        float p = expf(sc - lse), dp = 0.0f;\n        for (u64 e = 0; e < {dv}ull; ++e) dp += dy[i * {dv}ull + e] * v[(s * {tk}ull + j) * {dv}ull + e];\n        float ds = p * (dp - delta) * {sc};\n        for (u64 e = 0; e < {d}ull; ++e) dq[i * {d}ull + e] += ds * k[(s * {tk}ull + j) * {d}ull + e];\n    }}\n    stats[2 * i] = lse;\n    stats[2 * i + 1] = delta;\n}}\n",
        pro = row_prologue(&n, causal),
        score = score(&n, scale),
    );
    // Per key row j of slice s: the queries that attend it, in order.
    let first_query = if causal { "j" } else { "0ull" };
    let keys_text = format!(
        "// attention_grad: dk and dv, one thread per key row\nextern \"C\" __global__ void KNAME(const float* dy, const float* q, const float* k, const float* v, const float* stats, float* dk, float* dvo, u64 n) {{\n{INDEX}    u64 s = i / {tkk}ull, j = i % {tkk}ull;\n    for (u64 e = 0; e < {d}ull; ++e) dk[i * {d}ull + e] = 0.0f;\n    for (u64 e = 0; e < {dv}ull; ++e) dvo[i * {dv}ull + e] = 0.0f;\n    for (u64 t = {first_query}; t < {tq}ull; ++t) {{\n        u64 r = s * {tq}ull + t;\n        float sc = 0.0f;\n        for (u64 e = 0; e < {d}ull; ++e) sc += q[r * {d}ull + e] * k[i * {d}ull + e];\n        sc *= {sc};\n        float p = expf(sc - stats[2 * r]), dp = 0.0f;\n        for (u64 e = 0; e < {dv}ull; ++e) {{\n            dvo[i * {dv}ull + e] += p * dy[r * {dv}ull + e];\n            dp += dy[r * {dv}ull + e] * v[i * {dv}ull + e];\n        }}\n        float ds = p * (dp - stats[2 * r + 1]) * {sc};\n        for (u64 e = 0; e < {d}ull; ++e) dk[i * {d}ull + e] += ds * q[r * {d}ull + e];\n    }}\n}}\n",
        tkk = tk.max(1),
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
