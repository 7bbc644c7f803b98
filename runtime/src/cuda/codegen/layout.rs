//! Layout kernels: reshape (an alias, nothing runs), transpose, concat, slice, and the
//! local halves of communication (pack, unpack, the ZeRO chunkings).
//!
//! Everything but transpose is one strided block copy, [`COPY2D`]: `rows` runs of
//! `cols` 32-bit words, the destination and source each with their own row pitch and
//! start. Copies move 32-bit words, so ids (i32) and floats share the kernels.

use super::index::transpose_map;
use super::{want_f32, KArg, Launch, NodeCx, INDEX};
use distc_ir::TensorType;

/// `dst[doff + r*dld + c] = src[soff + r*sld + c]` for `r < rows`, `c < cols`.
const COPY2D: &str = "extern \"C\" __global__ void KNAME(u32* dst, const u32* src, u64 rows, u64 cols, u64 dld, u64 doff, u64 sld, u64 soff) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    u64 r = i / cols, c = i - r * cols;
    dst[doff + r * dld + c] = src[soff + r * sld + c];
}
";

/// One strided block copy (see [`COPY2D`]); nothing for an empty block.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy2d(
    cx: &mut NodeCx<'_>,
    dst: KArg,
    src: KArg,
    rows: usize,
    cols: usize,
    (dld, doff): (usize, usize),
    (sld, soff): (usize, usize),
) -> Result<(), String> {
    let name = cx.kernel("copy2d", COPY2D.to_string());
    let u = |v: usize| KArg::U64(v as u64);
    cx.launch_1d(
        &name,
        rows * cols,
        vec![dst, src, u(rows), u(cols), u(dld), u(doff), u(sld), u(soff)],
    )
}

/// Same elements, new shape: the output is the input's buffer.
pub(crate) fn reshape(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (x, y) = (cx.tin(0)?, cx.tout(0)?);
    if x.bytes() != y.bytes() || x.dtype != y.dtype {
        return Err(format!("cannot reshape {x} to {y}"));
    }
    cx.out.launches.push(Launch::Alias { input: 0 });
    Ok(())
}

/// The input, copied to the output's own buffer.
pub(crate) fn copy(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let (x, y) = (cx.tin(0)?.clone(), cx.tout(0)?.clone());
    if x != y {
        return Err(format!("cannot copy {x} to {y}"));
    }
    let n = x.shape.numel();
    copy2d(cx, KArg::Output(0), KArg::Input(0), 1, n, (n, 0), (n, 0))
}

/// Output axis `i` is input axis `perm[i]`: one thread per output element, the input
/// offset from the baked permuted strides.
pub(crate) fn transpose(cx: &mut NodeCx<'_>, perm: &[usize]) -> Result<(), String> {
    let x = cx.tin(0)?.clone();
    let mut seen = vec![false; x.dims().len()];
    for &p in perm {
        if p >= seen.len() || std::mem::replace(&mut seen[p], true) {
            return Err(format!("{perm:?} is not a permutation of the axes of {x}"));
        }
    }
    if perm.len() != seen.len() {
        return Err(format!("{perm:?} does not fit {x}"));
    }
    let n = x.shape.numel();
    let map = transpose_map(x.dims(), perm);
    if map.is_identity() {
        return copy2d(cx, KArg::Output(0), KArg::Input(0), 1, n, (n, 0), (n, 0));
    }
    let text = format!(
        "// transpose {x} by {perm:?}\nextern \"C\" __global__ void KNAME(const u32* x, u32* y, u64 n) {{\n{INDEX}    {}\n    y[i] = x[o];\n}}\n",
        map.emit("o", "i")
    );
    let name = cx.kernel("transpose", text);
    cx.launch_1d(
        &name,
        n,
        vec![KArg::Input(0), KArg::Output(0), KArg::U64(n as u64)],
    )
}

/// `(outer, axis size, inner)` of `dims` around `axis`.
fn around(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    )
}

/// Joins the inputs along `axis`: one block copy per input into its part of each
/// output row.
pub(crate) fn concat(cx: &mut NodeCx<'_>, axis: usize) -> Result<(), String> {
    let y = cx.tout(0)?.clone();
    if axis >= y.dims().len() {
        return Err(format!("axis {axis} is out of range for {y}"));
    }
    let (outer, total, inner) = around(y.dims(), axis);
    let mut at = 0;
    for i in 0..cx.ins.len() {
        let x = cx.tin(i)?.clone();
        if x.dims().len() != y.dims().len() || x.dtype != y.dtype {
            return Err(format!("input {i} {x} does not fit the output {y}"));
        }
        let len = x.dims()[axis];
        copy2d(
            cx,
            KArg::Output(0),
            KArg::Input(i),
            outer,
            len * inner,
            (total * inner, at * inner),
            (len * inner, 0),
        )?;
        at += len;
    }
    if at != total {
        return Err(format!(
            "the inputs give {at} along axis {axis}, the output {y} has {total}"
        ));
    }
    Ok(())
}

/// `x[start..end]` along `axis`: one block copy.
pub(crate) fn slice(
    cx: &mut NodeCx<'_>,
    axis: usize,
    start: usize,
    end: usize,
) -> Result<(), String> {
    let x = cx.tin(0)?.clone();
    if axis >= x.dims().len() || start >= end || end > x.dims()[axis] {
        return Err(format!(
            "range {start}..{end} is empty or outside axis {axis} of {x}"
        ));
    }
    let (outer, len, inner) = around(x.dims(), axis);
    let cols = (end - start) * inner;
    copy2d(
        cx,
        KArg::Output(0),
        KArg::Input(0),
        outer,
        cols,
        (cols, 0),
        (len * inner, start * inner),
    )
}

/// The inputs' elements, in order, in one flat buffer: one copy per input.
pub(crate) fn pack(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let total = cx.tout(0)?.shape.numel();
    let mut at = 0;
    for i in 0..cx.ins.len() {
        let n = cx.tin(i)?.shape.numel();
        copy2d(cx, KArg::Output(0), KArg::Input(i), 1, n, (n, at), (n, 0))?;
        at += n;
    }
    if at != total {
        return Err(format!("the inputs hold {at} elements, the output {total}"));
    }
    Ok(())
}

/// A flat buffer split into the outputs: one copy per output.
pub(crate) fn unpack(cx: &mut NodeCx<'_>) -> Result<(), String> {
    let total = cx.tin(0)?.shape.numel();
    let mut at = 0;
    for j in 0..cx.outs.len() {
        let n = cx.tout(j)?.shape.numel();
        copy2d(cx, KArg::Output(j), KArg::Input(0), 1, n, (n, 0), (n, at))?;
        at += n;
    }
    if at != total {
        return Err(format!("the outputs hold {at} elements, the input {total}"));
    }
    Ok(())
}

/// Chunk sizes (`ceil(n / workers)`) of each value and their sum (one worker's part).
fn chunks(types: &[TensorType], workers: usize) -> Result<(Vec<usize>, usize), String> {
    if workers == 0 {
        return Err("no workers".into());
    }
    let c: Vec<usize> = types
        .iter()
        .map(|t| t.shape.numel().div_ceil(workers))
        .collect();
    let part = c.iter().sum();
    Ok((c, part))
}

/// This worker's chunk: `y[i] = x[rank*c + i]`, zero past the end.
pub(crate) fn take_chunk(cx: &mut NodeCx<'_>, workers: usize) -> Result<(), String> {
    let x = cx.tin(0)?.clone();
    want_f32(&x, "input 0")?;
    let (c, _) = chunks(std::slice::from_ref(&x), workers)?;
    let (c, n) = (c[0], x.shape.numel());
    let text = "extern \"C\" __global__ void KNAME(const float* x, float* y, u64 c, u64 n, u32 rank) {\n    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= c) return;\n    u64 j = (u64)rank * c + i;\n    y[i] = j < n ? x[j] : 0.0f;\n}\n".to_string();
    let name = cx.kernel("take_chunk", text);
    cx.launch_1d(
        &name,
        c,
        vec![
            KArg::Input(0),
            KArg::Output(0),
            KArg::U64(c as u64),
            KArg::U64(n as u64),
            KArg::Rank,
        ],
    )
}

/// The buffer of a bucketed reduce-scatter: worker `r`'s part holds chunk `r` of
/// every input in turn. One launch per input writes its chunks (and their padding).
pub(crate) fn pack_chunks(cx: &mut NodeCx<'_>, workers: usize) -> Result<(), String> {
    let types: Vec<TensorType> = (0..cx.ins.len())
        .map(|i| cx.tin(i).cloned())
        .collect::<Result<_, _>>()?;
    let (cs, part) = chunks(&types, workers)?;
    let total = cx.tout(0)?.shape.numel();
    if total != part * workers {
        return Err(format!(
            "the output holds {total} elements, {workers} parts of {part} are needed"
        ));
    }
    let text = "extern \"C\" __global__ void KNAME(const float* x, float* y, u64 c, u64 n, u64 part, u64 off, u64 workers) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= workers * c) return;
    u64 r = i / c, t = i - r * c;
    y[r * part + off + t] = i < n ? x[i] : 0.0f;
}
"
    .to_string();
    let name = cx.kernel("pack_chunks", text);
    let mut off = 0;
    for (i, (t, &c)) in types.iter().zip(&cs).enumerate() {
        want_f32(t, &format!("input {i}"))?;
        let u = |v: usize| KArg::U64(v as u64);
        cx.launch_1d(
            &name,
            workers * c,
            vec![
                KArg::Input(i),
                KArg::Output(0),
                u(c),
                u(t.shape.numel()),
                u(part),
                u(off),
                u(workers),
            ],
        )?;
        off += c;
    }
    Ok(())
}

/// The values whole again from every worker's packed chunks: one launch per output.
pub(crate) fn unpack_chunks(cx: &mut NodeCx<'_>, workers: usize) -> Result<(), String> {
    let types: Vec<TensorType> = (0..cx.outs.len())
        .map(|j| cx.tout(j).cloned())
        .collect::<Result<_, _>>()?;
    let (cs, part) = chunks(&types, workers)?;
    let total = cx.tin(0)?.shape.numel();
    if total != part * workers {
        return Err(format!(
            "the input holds {total} elements, {workers} parts of {part} are needed"
        ));
    }
    let text = "extern \"C\" __global__ void KNAME(const float* x, float* y, u64 c, u64 n, u64 part, u64 off) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 r = i / c, t = i - r * c;
    y[i] = x[r * part + off + t];
}
"
    .to_string();
    let name = cx.kernel("unpack_chunks", text);
    let mut off = 0;
    for (j, (t, &c)) in types.iter().zip(&cs).enumerate() {
        want_f32(t, &format!("output {j}"))?;
        let u = |v: usize| KArg::U64(v as u64);
        let n = t.shape.numel();
        cx.launch_1d(
            &name,
            n,
            vec![KArg::Input(0), KArg::Output(j), u(c), u(n), u(part), u(off)],
        )?;
        off += c;
    }
    Ok(())
}
