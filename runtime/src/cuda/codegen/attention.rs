//! Scaled dot-product attention, fused: no `Tq x Tk` score matrix is ever stored. The
//! forward kernel runs one thread per query row with an online softmax (running max
//! and sum, the output rescaled only when the max grows: the flash-attention
//! recurrence); the gradient recomputes the scores, one thread per query row for `dq`
//! (a first pass over the keys gives the row's log-sum-exp and `rowsum(dy * y)`, kept
//! in scratch, with the same recurrence; a second, `dq`), then one
//! thread per key row for `dk` and `dv`, summing over the queries in order: no atomics,
//! the same bits every run.
//!
//! A block holds [`ROWS`] rows of one slice (a batch and head). The rows every thread
//! reads (the keys and values a query row walks; the queries, output gradients and
//! statistics a key row walks) come through shared memory a tile at a time, loaded by
//! the whole block in coalesced reads, and are read there by every thread at once (a
//! broadcast). A thread's own rows and accumulators live in registers: the head sizes
//! are constants of the generated code, so the loops over them unroll. A causal block
//! stops at its last row's last key (or starts at its first key's first query).
//! (Thread-private rows read and written in global memory once per key made a GPT-2
//! 124M step's attention most of its time.) Tensor cores are the next step.

use super::{flit, want_f32, KArg, NodeCx};
use distc_ir::shape::attention_shape;

/// Rows (threads) per block.
const ROWS: usize = 64;
/// Floats of shared memory a kernel's tiles may take (32 KiB: within the 48 KiB a
/// kernel gets without opting in, with room for two blocks an SM).
const TILE_FLOATS: usize = 8192;

/// Sizes of the attention of node inputs `q, k, v` at `first..first + 3`.
struct Sizes {
    rows: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

impl Sizes {
    /// Slices (batch times heads).
    fn slices(&self) -> usize {
        self.rows / self.tq.max(1)
    }
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

/// Rows of a tile whose rows hold `width` floats each.
fn tile_rows(width: usize) -> usize {
    (TILE_FLOATS / width.max(1)).clamp(1, ROWS)
}

/// The grid of a kernel over `per_slice` rows of each of `slices` slices, [`ROWS`] a
/// block, blocks never straddling two slices.
fn grid(slices: usize, per_slice: usize) -> Result<[u32; 3], String> {
    let blocks = slices * per_slice.div_ceil(ROWS);
    let blocks = u32::try_from(blocks)
        .map_err(|_| format!("{blocks} blocks of attention rows are more than a grid holds"))?;
    Ok([blocks, 1, 1])
}

/// The C lines that place a thread: its slice `s`, its row `t` of the slice's `len`
/// rows, `row` (whether it has one: the block's last may be short), the block's first
/// row `first` and one past its last `end`.
fn place(len: usize) -> String {
    let nb = len.div_ceil(ROWS).max(1);
    format!(
        "    u64 s = blockIdx.x / {nb}ull, first = (blockIdx.x % {nb}ull) * {ROWS}ull;\n    u64 t = first + threadIdx.x;\n    bool row = t < {len}ull;\n    u64 end = first + {ROWS}ull < {len}ull ? first + {ROWS}ull : {len}ull;\n"
    )
}

/// C lines declaring register array `name` of `len` floats, copied from `src` when the
/// thread has a row, else zeros.
fn load_row(name: &str, len: usize, src: &str) -> String {
    format!(
        "    float {name}[{len}];\n    const float* {name}_src = {src};\n#pragma unroll\n    for (int e = 0; e < {len}; ++e) {name}[e] = row ? {name}_src[e] : 0.0f;\n"
    )
}

/// C lines declaring register array `name` of `len` zeros.
fn zeros(name: &str, len: usize) -> String {
    format!("    float {name}[{len}];\n#pragma unroll\n    for (int e = 0; e < {len}; ++e) {name}[e] = 0.0f;\n")
}

/// C lines filling shared array `dst` with `count` rows of `width` floats, contiguous
/// at `src`, the block's threads striding through it (coalesced).
fn fill_tile(dst: &str, src: &str, count: &str, width: usize) -> String {
    format!(
        "        for (u64 x = threadIdx.x; x < {count} * {width}ull; x += {ROWS}ull) {dst}[x] = {src}[x];\n"
    )
}

/// The C statement setting `out` to `sum_e a[e] * b[e]`.
fn dot(out: &str, a: &str, b: &str, len: usize) -> String {
    format!(
        "float {out} = 0.0f;\n#pragma unroll\n            for (int e = 0; e < {len}; ++e) {out} += {a}[e] * {b}[e];"
    )
}

/// The C expression of how many keys query row `t` attends (keys `0..` that many).
fn live(n: &Sizes, causal: bool) -> String {
    if causal {
        format!("(t + 1ull < {tk}ull ? t + 1ull : {tk}ull)", tk = n.tk)
    } else {
        format!("{}ull", n.tk)
    }
}

/// The C loop over the key tiles of a query block: `body` runs per tile with `j0`
/// (its first key), `nt` (its keys) and `jn` (those this thread's row attends) set,
/// after `fill` filled the shared tiles.
fn key_tiles(n: &Sizes, causal: bool, tile: usize, fill: &str, body: &str) -> String {
    let block_keys = if causal {
        format!("(end < {tk}ull ? end : {tk}ull)", tk = n.tk)
    } else {
        format!("{}ull", n.tk)
    };
    format!(
        "    for (u64 j0 = 0; j0 < {block_keys}; j0 += {tile}ull) {{\n        u64 nt = {block_keys} - j0 < {tile}ull ? {block_keys} - j0 : {tile}ull;\n        __syncthreads();\n{fill}        __syncthreads();\n        u64 jn = row && lv > j0 ? (lv - j0 < nt ? lv - j0 : nt) : 0;\n        for (u64 jj = 0; jj < jn; ++jj) {{\n{body}        }}\n    }}\n"
    )
}

/// `attention(q, k, v) -> y`.
pub(crate) fn attention(cx: &mut NodeCx<'_>, causal: bool, scale: f64) -> Result<(), String> {
    let n = sizes(cx, 0)?;
    let (d, dv, tk) = (n.d, n.dv, n.tk);
    let tile = tile_rows(d + dv);
    let fill = fill_tile("ks", &format!("(k + (s * {tk}ull + j0) * {d}ull)"), "nt", d)
        + &fill_tile(
            "vs",
            &format!("(v + (s * {tk}ull + j0) * {dv}ull)"),
            "nt",
            dv,
        );
    let body = format!(
        "            const float* kj = ks + jj * {d}ull;\n            const float* vj = vs + jj * {dv}ull;\n            {score}\n            sc *= {sc};\n            if (sc > m) {{\n                float corr = expf(m - sc);\n                l *= corr;\n#pragma unroll\n                for (int e = 0; e < {dv}; ++e) acc[e] *= corr;\n                m = sc;\n            }}\n            float p = expf(sc - m);\n            l += p;\n#pragma unroll\n            for (int e = 0; e < {dv}; ++e) acc[e] += p * vj[e];\n",
        score = dot("sc", "qr", "kj", d),
        sc = flit(scale),
    );
    let text = format!(
        "// attention, {rows} query rows of {tq}, {tk} keys, D {d}, Dv {dv}, causal {causal}, tiles of {tile} keys\nextern \"C\" __global__ void KNAME(const float* q, const float* k, const float* v, float* y) {{\n    __shared__ float ks[{ksz}];\n    __shared__ float vs[{vsz}];\n{place}    u64 i = s * {tq}ull + t;\n    u64 lv = {live};\n{qr}{acc}    float m = -3.0e38f, l = 0.0f;\n{tiles}    if (!row) return;\n    float inv = l > 0.0f ? 1.0f / l : 0.0f;\n    float* out = y + i * {dv}ull;\n#pragma unroll\n    for (int e = 0; e < {dv}; ++e) out[e] = acc[e] * inv;\n}}\n",
        rows = n.rows,
        tq = n.tq,
        ksz = tile * d.max(1),
        vsz = tile * dv.max(1),
        place = place(n.tq),
        live = live(&n, causal),
        qr = load_row("qr", d, &format!("q + i * {d}ull")),
        acc = zeros("acc", dv),
        tiles = key_tiles(&n, causal, tile, &fill, &body),
    );
    if n.rows == 0 {
        return Ok(());
    }
    let name = cx.kernel("attention", text);
    cx.launch(
        &name,
        grid(n.slices(), n.tq)?,
        ROWS as u32,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Input(2),
            KArg::Output(0),
        ],
    );
    Ok(())
}

/// `(dy, q, k, v) -> (dq, dk, dv)`.
pub(crate) fn attention_grad(cx: &mut NodeCx<'_>, causal: bool, scale: f64) -> Result<(), String> {
    let n = sizes(cx, 1)?;
    let (d, dv, tk, tq) = (n.d, n.dv, n.tk, n.tq);
    let sc = flit(scale);
    // Per query row: the log-sum-exp, delta = rowsum(dy * y) = sum_j p_j (dy . v_j),
    // then dq = scale * sum_j p_j (dy . v_j - delta) k_j.
    let tile = tile_rows(d + dv);
    let fill_k = fill_tile("ks", &format!("(k + (s * {tk}ull + j0) * {d}ull)"), "nt", d);
    let fill_kv = fill_k.clone()
        + &fill_tile(
            "vs",
            &format!("(v + (s * {tk}ull + j0) * {dv}ull)"),
            "nt",
            dv,
        );
    let score = dot("sc", "qr", "kj", d);
    let dp = dot("dp", "dyr", "vj", dv);
    // One pass gives both statistics: the running max, the softmax's running sum and
    // the running sum of its terms times `dy . v_j`, both rescaled as the max grows.
    let stats_body = format!(
        "            const float* kj = ks + jj * {d}ull;\n            const float* vj = vs + jj * {dv}ull;\n            {score}\n            sc *= {sc};\n            {dp}\n            if (sc > m) {{\n                float corr = expf(m - sc);\n                l *= corr;\n                dsum *= corr;\n                m = sc;\n            }}\n            float p = expf(sc - m);\n            l += p;\n            dsum += p * dp;\n"
    );
    let dq_body = format!(
        "            const float* kj = ks + jj * {d}ull;\n            const float* vj = vs + jj * {dv}ull;\n            {score}\n            sc *= {sc};\n            {dp}\n            float ds = expf(sc - lse) * (dp - delta) * {sc};\n#pragma unroll\n            for (int e = 0; e < {d}; ++e) acc[e] += ds * kj[e];\n"
    );
    let rows_text = format!(
        "// attention_grad: dq and each query row's statistics, tiles of {tile} keys\nextern \"C\" __global__ void KNAME(const float* dy, const float* q, const float* k, const float* v, float* dq, float* stats) {{\n    __shared__ float ks[{ksz}];\n    __shared__ float vs[{vsz}];\n{place}    u64 i = s * {tq}ull + t;\n    u64 lv = {live};\n{qr}{dyr}    float m = -3.0e38f, l = 0.0f, dsum = 0.0f;\n{stats_tiles}    float lse = m + logf(l);\n    float delta = l > 0.0f ? dsum / l : 0.0f;\n{acc}{dq_tiles}    if (!row) return;\n    float* out = dq + i * {d}ull;\n#pragma unroll\n    for (int e = 0; e < {d}; ++e) out[e] = acc[e];\n    stats[2 * i] = lse;\n    stats[2 * i + 1] = delta;\n}}\n",
        ksz = tile * d.max(1),
        vsz = tile * dv.max(1),
        place = place(tq),
        live = live(&n, causal),
        qr = load_row("qr", d, &format!("q + i * {d}ull")),
        dyr = load_row("dyr", dv, &format!("dy + i * {dv}ull")),
        acc = zeros("acc", d),
        stats_tiles = key_tiles(&n, causal, tile, &fill_kv, &stats_body),
        dq_tiles = key_tiles(&n, causal, tile, &fill_kv, &dq_body),
    );
    // Per key row j of slice s: the queries that attend it, in order, a tile of
    // queries (their rows, output gradients and statistics) at a time. A causal block
    // starts at its first key: no earlier query attends any of its keys.
    let qtile = tile_rows(d + dv + 2);
    let first_query = if causal { "first" } else { "0ull" };
    let attends = if causal { "t0 + tt >= j" } else { "true" };
    let keys_text = format!(
        "// attention_grad: dk and dv, one thread per key row, tiles of {qtile} queries\nextern \"C\" __global__ void KNAME(const float* dy, const float* q, const float* k, const float* v, const float* stats, float* dk, float* dvo) {{\n    __shared__ float qs[{qsz}];\n    __shared__ float dys[{dysz}];\n    __shared__ float sts[{stsz}];\n{place}    u64 j = t;\n    u64 i = s * {tk}ull + j;\n{kr}{vr}{dka}{dva}    for (u64 t0 = {first_query}; t0 < {tq}ull; t0 += {qtile}ull) {{\n        u64 nt = {tq}ull - t0 < {qtile}ull ? {tq}ull - t0 : {qtile}ull;\n        __syncthreads();\n{fill}        __syncthreads();\n        if (!row) continue;\n        for (u64 tt = 0; tt < nt; ++tt) {{\n            if (!({attends})) continue;\n            const float* qt = qs + tt * {d}ull;\n            const float* dyt = dys + tt * {dv}ull;\n            float sc = 0.0f, dp = 0.0f;\n#pragma unroll\n            for (int e = 0; e < {d}; ++e) sc += qt[e] * kr[e];\n            sc *= {sc};\n            float p = expf(sc - sts[2 * tt]);\n#pragma unroll\n            for (int e = 0; e < {dv}; ++e) {{\n                dva[e] += p * dyt[e];\n                dp += dyt[e] * vr[e];\n            }}\n            float ds = p * (dp - sts[2 * tt + 1]) * {sc};\n#pragma unroll\n            for (int e = 0; e < {d}; ++e) dka[e] += ds * qt[e];\n        }}\n    }}\n    if (!row) return;\n#pragma unroll\n    for (int e = 0; e < {d}; ++e) dk[i * {d}ull + e] = dka[e];\n#pragma unroll\n    for (int e = 0; e < {dv}; ++e) dvo[i * {dv}ull + e] = dva[e];\n}}\n",
        qsz = qtile * d.max(1),
        dysz = qtile * dv.max(1),
        stsz = qtile * 2,
        place = place(tk),
        kr = load_row("kr", d, &format!("k + i * {d}ull")),
        vr = load_row("vr", dv, &format!("v + i * {dv}ull")),
        dka = zeros("dka", d),
        dva = zeros("dva", dv),
        fill = fill_tile("qs", &format!("(q + (s * {tq}ull + t0) * {d}ull)"), "nt", d)
            + &fill_tile("dys", &format!("(dy + (s * {tq}ull + t0) * {dv}ull)"), "nt", dv)
            + &fill_tile("sts", &format!("(stats + (s * {tq}ull + t0) * 2ull)"), "nt", 2),
    );
    if n.rows == 0 {
        return Ok(());
    }
    let rows_k = cx.kernel("attention_grad_rows", rows_text);
    let keys_k = cx.kernel("attention_grad_keys", keys_text);
    let stats = cx.scratch(8 * n.rows);
    cx.launch(
        &rows_k,
        grid(n.slices(), tq)?,
        ROWS as u32,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Input(2),
            KArg::Input(3),
            KArg::Output(0),
            stats.clone(),
        ],
    );
    if tk > 0 {
        cx.launch(
            &keys_k,
            grid(n.slices(), tk)?,
            ROWS as u32,
            vec![
                KArg::Input(0),
                KArg::Input(1),
                KArg::Input(2),
                KArg::Input(3),
                stats,
                KArg::Output(1),
                KArg::Output(2),
            ],
        );
    }
    Ok(())
}
