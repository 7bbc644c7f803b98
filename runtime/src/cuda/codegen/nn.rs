//! The heavy ops: matmul (a cuBLAS product), 2-D convolution and its two gradients
//! (im2col / col2im kernels around batched cuBLAS products) and max pooling with its
//! gradient.
//!
//! A convolution `x [N,C,H,W] (*) w [O,C,KH,KW]` is, per image, `w [O,K] @ cols [K,P]`
//! with `K = C*KH*KW` and `P = OH*OW`. Column row `(c*KH + i)*KW + j`, column
//! `oy*OW + ox` reads `x[c, oy*S + i - pad, ox*S + j - pad]` (zero in the padding), as
//! the CPU backend lays it out. col2im and the pooling gradient gather (one thread per
//! input element, summing what reaches it in a fixed order) rather than scatter with
//! atomics, so results have the same bits every run.

use super::index::transpose_map;
use super::{half, want_f32, Gemm, KArg, Launch, NodeCx, INDEX};
use crate::core::geom::ConvGeom as Geom;
use distc_ir::TensorType;

/// `a @ b` on rank-2 tensors, either side transposed: one cuBLAS product (see
/// [`Gemm::row_major`] for the mapping) in the operands' own type (f32, or bf16/f16
/// with f32 accumulation), or a memset when the inner size is 0.
pub(crate) fn matmul(cx: &mut NodeCx<'_>, ta: bool, tb: bool) -> Result<(), String> {
    let (a, b, y) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tout(0)?.clone());
    let dtype = a.dtype;
    if half::c_type(dtype).is_none() || b.dtype != dtype || y.dtype != dtype {
        return Err(format!(
            "{a} @ {b} -> {y}: a GPU product reads and writes one of f32, bf16 or f16"
        ));
    }
    let (ad, bd) = (a.dims(), b.dims());
    let (ra, rb) = (ad.len(), bd.len());
    if ra < 2 || rb < 2 {
        return Err(format!("needs operands of rank 2 or more, got {a} and {b}"));
    }
    let (a0, a1, b0, b1) = (ad[ra - 2], ad[ra - 1], bd[rb - 2], bd[rb - 1]);
    let (m, k) = if ta { (a1, a0) } else { (a0, a1) };
    let (k2, n) = if tb { (b1, b0) } else { (b0, b1) };
    let yd = y.dims();
    let batch = &yd[..yd.len().saturating_sub(2)];
    let count: usize = batch.iter().product();
    if k != k2 || yd.len() < 2 || yd[yd.len() - 2..] != [m, n] {
        return Err(format!(
            "{a}{} @ {b}{} does not give {y}",
            if ta { "ᵀ" } else { "" },
            if tb { "ᵀ" } else { "" }
        ));
    }
    // One strided-batched product: each operand's batch is the result's (stride: one
    // matrix) or a single matrix for all (stride 0). Mixed broadcasts are not strided.
    let stride = |own: &[usize], size: usize, x: &TensorType| -> Result<usize, String> {
        let own_count: usize = own.iter().product();
        if own_count == 1 {
            Ok(0)
        } else if own_count == count
            && own.len() <= batch.len()
            && own == &batch[batch.len() - own.len()..]
        {
            Ok(size)
        } else {
            Err(format!(
                "{a} @ {b}: the batch of {x} is neither the result's nor one matrix; a GPU \
                 product needs one or the other (broadcast_to the result's batch first)"
            ))
        }
    };
    let strides = (
        stride(&ad[..ra - 2], a0 * a1, &a)?,
        stride(&bd[..rb - 2], b0 * b1, &b)?,
        m * n,
    );
    if m == 0 || n == 0 || count == 0 {
        return Ok(());
    }
    if k == 0 {
        cx.out.launches.push(Launch::Memset {
            buf: KArg::Output(0),
            bytes: (dtype.size() * m * n * count) as u64,
        });
        return Ok(());
    }
    let mut g = Gemm::row_major(
        (KArg::Input(0), ta),
        (KArg::Input(1), tb),
        KArg::Output(0),
        (m, n, k),
        count,
        strides,
    )?;
    g.dtype = dtype;
    cx.out.launches.push(Launch::Gemm(g));
    Ok(())
}

/// Conv kernels' text, from the geometry the CPU backend's kernels use.
impl Geom {
    /// The constants every conv kernel uses, as C `#define`-free literals in a comment
    /// line and a tuple for `format!`.
    fn describe(&self) -> String {
        format!(
            "x [{},{},{},{}], w [{},{},{},{}], stride {}, padding {}",
            self.n, self.c, self.h, self.w, self.o, self.c, self.kh, self.kw, self.stride, self.pad
        )
    }
}

/// Where im2col writes the columns: per image `[N][K][P]` (the forward product and
/// the input gradient), or all images side by side `[K][N*P]` (the filter gradient's
/// one product over the whole batch).
#[derive(Clone, Copy, PartialEq)]
enum Cols {
    PerImage,
    Batch,
}

/// im2col: one thread per column element (padding reads as zero).
fn im2col(cx: &mut NodeCx<'_>, g: &Geom, layout: Cols, x: KArg, cols: KArg) -> Result<(), String> {
    let (k, p, n) = (g.k(), g.p(), g.n);
    let split = match layout {
        Cols::PerImage => format!(
            "u64 b = i / {kp}ull, k = (i / {p}ull) % {k}ull, p = i % {p}ull;",
            kp = k * p
        ),
        Cols::Batch => format!(
            "u64 k = i / {np}ull, b = (i / {p}ull) % {n}ull, p = i % {p}ull;",
            np = n * p
        ),
    };
    let text = format!(
        "// im2col{which} of {desc}\nextern \"C\" __global__ void KNAME(const float* x, float* cols, u64 n) {{\n{INDEX}    {split}\n    u64 c = k / {khw}ull, ki = (k / {kw}ull) % {kh}ull, kj = k % {kw}ull;\n    long long y = (long long)((p / {ow}ull) * {s}ull + ki) - {pad}ll;\n    long long xx = (long long)((p % {ow}ull) * {s}ull + kj) - {pad}ll;\n    cols[i] = (y >= 0 && y < {h}ll && xx >= 0 && xx < {w}ll) ? x[((b * {c}ull + c) * {h}ull + (u64)y) * {w}ull + (u64)xx] : 0.0f;\n}}\n",
        which = if layout == Cols::Batch { " (batch-wide columns)" } else { "" },
        desc = g.describe(),
        khw = g.kh * g.kw,
        kw = g.kw,
        kh = g.kh,
        ow = g.ow,
        s = g.stride,
        pad = g.pad,
        h = g.h,
        w = g.w,
        c = g.c,
    );
    let name = cx.kernel("im2col", text);
    let total = n * k * p;
    cx.launch_1d(&name, total, vec![x, cols, KArg::U64(total as u64)])
}

/// `x [N,C,H,W] (*) w [O,C,KH,KW] -> [N,O,OH,OW]`: im2col into scratch, then one
/// batched product `out[b] [O,P] = w [O,K] @ cols[b] [K,P]`.
pub(crate) fn conv2d(cx: &mut NodeCx<'_>, stride: usize, padding: usize) -> Result<(), String> {
    let (x, w, y) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tout(0)?.clone());
    want_f32(&x, "x")?;
    want_f32(&w, "w")?;
    let g = Geom::new(x.dims(), w.dims(), stride, padding)?;
    check_out(&y, &g.out_dims(), "the output")?;
    if g.n * g.o * g.p() == 0 {
        return Ok(());
    }
    let cols = cx.scratch(4 * g.n * g.k() * g.p());
    im2col(cx, &g, Cols::PerImage, KArg::Input(0), cols.clone())?;
    let gemm = Gemm::row_major(
        (KArg::Input(1), false),
        (cols, false),
        KArg::Output(0),
        (g.o, g.p(), g.k()),
        g.n,
        (0, g.k() * g.p(), g.o * g.p()),
    )?;
    cx.out.launches.push(Launch::Gemm(gemm));
    Ok(())
}

fn check_out(t: &TensorType, want: &[usize], what: &str) -> Result<(), String> {
    want_f32(t, what)?;
    if t.dims() != want {
        return Err(format!("{what} is {t}, the convolution gives {want:?}"));
    }
    Ok(())
}

/// `(dy, w) -> dx`: `cols[b] = wᵀ [K,O] @ dy[b] [O,P]` (one batched product), then
/// col2im gathering, for each input element, the column entries that read it.
pub(crate) fn conv2d_grad_input(
    cx: &mut NodeCx<'_>,
    stride: usize,
    padding: usize,
) -> Result<(), String> {
    let (dy, w, dx) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tout(0)?.clone());
    want_f32(&w, "w")?;
    let g = Geom::new(dx.dims(), w.dims(), stride, padding)?;
    check_out(&dy, &g.out_dims(), "dy")?;
    let n_in = dx.shape.numel();
    if n_in == 0 {
        return Ok(());
    }
    if g.o * g.p() == 0 {
        cx.out.launches.push(Launch::Memset {
            buf: KArg::Output(0),
            bytes: (4 * n_in) as u64,
        });
        return Ok(());
    }
    let cols = cx.scratch(4 * g.n * g.k() * g.p());
    let gemm = Gemm::row_major(
        (KArg::Input(1), true),
        (KArg::Input(0), false),
        cols.clone(),
        (g.k(), g.p(), g.o),
        g.n,
        (0, g.o * g.p(), g.k() * g.p()),
    )?;
    cx.out.launches.push(Launch::Gemm(gemm));
    let text = format!(
        "// col2im of {desc}: one thread per input element\nextern \"C\" __global__ void KNAME(const float* cols, float* dx, u64 n) {{\n{INDEX}    u64 xx = i % {w}ull, y = (i / {w}ull) % {h}ull, c = (i / {hw}ull) % {c}ull, b = i / {chw}ull;\n    const float* base = cols + b * {kp}ull;\n    float acc = 0.0f;\n    for (u64 ki = 0; ki < {kh}ull; ++ki) {{\n        long long ty = (long long)(y + {pad}ull) - (long long)ki;\n        if (ty < 0 || ty % {s} != 0 || ty / {s} >= {oh}) continue;\n        for (u64 kj = 0; kj < {kw}ull; ++kj) {{\n            long long tx = (long long)(xx + {pad}ull) - (long long)kj;\n            if (tx < 0 || tx % {s} != 0 || tx / {s} >= {ow}) continue;\n            acc += base[((c * {kh}ull + ki) * {kw}ull + kj) * {p}ull + (u64)(ty / {s}) * {ow}ull + (u64)(tx / {s})];\n        }}\n    }}\n    dx[i] = acc;\n}}\n",
        desc = g.describe(),
        w = g.w,
        h = g.h,
        hw = g.h * g.w,
        c = g.c,
        chw = g.c * g.h * g.w,
        kp = g.k() * g.p(),
        kh = g.kh,
        kw = g.kw,
        pad = g.pad,
        s = g.stride,
        oh = g.oh,
        ow = g.ow,
        p = g.p(),
    );
    let name = cx.kernel("col2im", text);
    cx.launch_1d(
        &name,
        n_in,
        vec![cols, KArg::Output(0), KArg::U64(n_in as u64)],
    )
}

/// `(dy, x) -> dw`: batch-wide columns `[K, N*P]`, `dy` transposed to `[O, N*P]`, then
/// one product `dw [O,K] = dyᵀ' @ colsᵀ` summing over every image and position.
pub(crate) fn conv2d_grad_filter(
    cx: &mut NodeCx<'_>,
    stride: usize,
    padding: usize,
) -> Result<(), String> {
    let (dy, x, dw) = (cx.tin(0)?.clone(), cx.tin(1)?.clone(), cx.tout(0)?.clone());
    want_f32(&x, "x")?;
    let g = Geom::new(x.dims(), dw.dims(), stride, padding)?;
    check_out(&dy, &g.out_dims(), "dy")?;
    let n_w = dw.shape.numel();
    if n_w == 0 {
        return Ok(());
    }
    let np = g.n * g.p();
    if np == 0 {
        cx.out.launches.push(Launch::Memset {
            buf: KArg::Output(0),
            bytes: (4 * n_w) as u64,
        });
        return Ok(());
    }
    let cols = cx.scratch(4 * g.k() * np);
    let dyt = cx.scratch(4 * g.o * np);
    im2col(cx, &g, Cols::Batch, KArg::Input(1), cols.clone())?;
    let map = transpose_map(&[g.n, g.o, g.p()], &[1, 0, 2]);
    let text = format!(
        "// transpose [{n},{o},{p}] to [{o},{n},{p}]\nextern \"C\" __global__ void KNAME(const u32* x, u32* y, u64 n) {{\n{INDEX}    {}\n    y[i] = x[o];\n}}\n",
        map.emit("o", "i"),
        n = g.n,
        o = g.o,
        p = g.p(),
    );
    let name = cx.kernel("transpose", text);
    let total = g.o * np;
    cx.launch_1d(
        &name,
        total,
        vec![KArg::Input(0), dyt.clone(), KArg::U64(total as u64)],
    )?;
    let gemm = Gemm::row_major(
        (dyt, false),
        (cols, true),
        KArg::Output(0),
        (g.o, g.k(), np),
        1,
        (0, 0, 0),
    )?;
    cx.out.launches.push(Launch::Gemm(gemm));
    Ok(())
}

/// `(planes, h, w, oh, ow)` of a pool over `x [N,C,H,W]`.
fn pool_geom(x: &TensorType, kernel: usize, stride: usize) -> Result<[usize; 5], String> {
    want_f32(x, "x")?;
    let &[n, c, h, w] = x.dims() else {
        return Err(format!("needs x [N,C,H,W], got {x}"));
    };
    if kernel == 0 || stride == 0 || kernel > h || kernel > w {
        return Err(format!("window {kernel} stride {stride} does not fit {x}"));
    }
    Ok([
        n * c,
        h,
        w,
        (h - kernel) / stride + 1,
        (w - kernel) / stride + 1,
    ])
}

/// The C scanning window `(oy, ox)` of `plane` in row-major order, keeping the first
/// maximum (`>` only), as the CPU does so forward and backward agree on ties: leaves
/// `best` and its index `arg` (within the plane).
fn window_scan(w: usize, kernel: usize, stride: usize) -> String {
    format!(
        "u64 arg = oy * {s}ull * {w}ull + ox * {s}ull; float best = plane[arg];\n        for (u64 a = 0; a < {k}ull; ++a) for (u64 b = 0; b < {k}ull; ++b) {{\n            u64 at = (oy * {s}ull + a) * {w}ull + ox * {s}ull + b;\n            float v = plane[at];\n            if (v > best) {{ best = v; arg = at; }}\n        }}",
        s = stride,
        k = kernel,
    )
}

/// 2-D max pooling, NCHW, no padding: one thread per output element.
pub(crate) fn max_pool2d(cx: &mut NodeCx<'_>, kernel: usize, stride: usize) -> Result<(), String> {
    let x = cx.tin(0)?.clone();
    let [planes, h, w, oh, ow] = pool_geom(&x, kernel, stride)?;
    let n = planes * oh * ow;
    let text = format!(
        "// max_pool2d of {x}, window {kernel}, stride {stride}\nextern \"C\" __global__ void KNAME(const float* x, float* y, u64 n) {{\n{INDEX}    u64 ox = i % {ow}ull, oy = (i / {ow}ull) % {oh}ull;\n    const float* plane = x + (i / {ohw}ull) * {hw}ull;\n    {{\n        {}\n        y[i] = best;\n    }}\n}}\n",
        window_scan(w, kernel, stride),
        ohw = oh * ow,
        hw = h * w,
    );
    let name = cx.kernel("max_pool2d", text);
    cx.launch_1d(
        &name,
        n,
        vec![KArg::Input(0), KArg::Output(0), KArg::U64(n as u64)],
    )
}

/// `(dy, x) -> dx`: one thread per input element sums `dy` over the windows whose
/// arg-max it is, in window order.
pub(crate) fn max_pool2d_grad(
    cx: &mut NodeCx<'_>,
    kernel: usize,
    stride: usize,
) -> Result<(), String> {
    let (dy, x) = (cx.tin(0)?.clone(), cx.tin(1)?.clone());
    let [planes, h, w, oh, ow] = pool_geom(&x, kernel, stride)?;
    let d = x.dims();
    check_out(&dy, &[d[0], d[1], oh, ow], "dy")?;
    let n = planes * h * w;
    let text = format!(
        "// max_pool2d_grad of {x}, window {kernel}, stride {stride}\nextern \"C\" __global__ void KNAME(const float* dy, const float* x, float* dx, u64 n) {{\n{INDEX}    u64 hw = i % {hw}ull, pl = i / {hw}ull;\n    long long y0 = (long long)(hw / {w}ull), x0 = (long long)(hw % {w}ull);\n    const float* plane = x + pl * {hw}ull;\n    const float* dplane = dy + pl * {ohw}ull;\n    long long oy_lo = y0 >= {k} ? (y0 - {k} + {s}) / {s} : 0, ox_lo = x0 >= {k} ? (x0 - {k} + {s}) / {s} : 0;\n    long long oy_hi = y0 / {s} < {oh} - 1 ? y0 / {s} : {oh} - 1, ox_hi = x0 / {s} < {ow} - 1 ? x0 / {s} : {ow} - 1;\n    float acc = 0.0f;\n    for (long long oyy = oy_lo; oyy <= oy_hi; ++oyy) for (long long oxx = ox_lo; oxx <= ox_hi; ++oxx) {{\n        u64 oy = (u64)oyy, ox = (u64)oxx;\n        {}\n        if (arg == hw) acc += dplane[oy * {ow}ull + ox];\n    }}\n    dx[i] = acc;\n}}\n",
        window_scan(w, kernel, stride),
        hw = h * w,
        ohw = oh * ow,
        k = kernel,
        s = stride,
    );
    let name = cx.kernel("max_pool2d_grad", text);
    cx.launch_1d(
        &name,
        n,
        vec![
            KArg::Input(0),
            KArg::Input(1),
            KArg::Output(0),
            KArg::U64(n as u64),
        ],
    )
}
