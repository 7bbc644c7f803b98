//! The heavy kernels: matmul, layer normalisation, 2-D convolution and max pooling,
//! with their gradients.
//!
//! Matrix products go through ndarray's `dot` / `general_mat_mul` (matrixmultiply:
//! near peak on this CPU, threaded via `MATMUL_NUM_THREADS`), with transposes as
//! stride-swapped views, never copies. A convolution is im2col followed by one matrix
//! product per image, written straight into the output; its input gradient is the
//! transposed product followed by col2im, its filter gradient accumulates
//! `dy_n @ cols_nᵀ` over the batch.

use super::{cow, standard, val, view, Arg, CpuKernelError, Elem, ShapeCheck, ShapeNeed};
use crate::core::geom::ConvGeom as Geom;
use crate::core::value::Value;
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, Array3, ArrayD, ArrayView2, ArrayView3, ArrayViewD, CowArray, Ix2, IxDyn};

/// `a @ b` as numpy's matmul, either side transposed (as a view): rank-2 operands are
/// one product; higher ranks one product per element of the broadcast batch, each
/// written into its block of the output.
pub(super) fn matmul<A: Elem>(
    a: &Arg<'_>,
    b: &Arg<'_>,
    ta: bool,
    tb: bool,
) -> Result<Value, CpuKernelError> {
    let (a, b) = (view::<A>(a, 0)?, view::<A>(b, 1)?);
    let (ra, rb) = (a.ndim(), b.ndim());
    if ra < 2 || rb < 2 {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::MatmulRank,
            left: a.shape().to_vec(),
            right: b.shape().to_vec(),
        });
    }
    let inner = |x: &ArrayViewD<'_, A>, t: bool| {
        let d = x.shape();
        let (r, c) = (d[d.len() - 2], d[d.len() - 1]);
        if t {
            (c, r)
        } else {
            (r, c)
        }
    };
    let ((m, k), (k2, n)) = (inner(&a, ta), inner(&b, tb));
    if k != k2 {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::MatmulInner { ta, tb, k, k2 },
            left: a.shape().to_vec(),
            right: b.shape().to_vec(),
        });
    }
    let (ba, bb) = (&a.shape()[..ra - 2], &b.shape()[..rb - 2]);
    let batch =
        distc_ir::shape::broadcast_shapes(ba, bb).ok_or_else(|| CpuKernelError::Shapes {
            check: ShapeCheck::MatmulBatch,
            left: a.shape().to_vec(),
            right: b.shape().to_vec(),
        })?;
    fn matrix<A>(x: ArrayViewD<'_, A>, t: bool) -> Result<ArrayView2<'_, A>, CpuKernelError> {
        let x = x.into_dimensionality::<Ix2>()?;
        Ok(if t { x.reversed_axes() } else { x })
    }
    if batch.is_empty() {
        let (a2, b2) = (matrix(a.view(), ta)?, matrix(b.view(), tb)?);
        return Ok(val(a2.dot(&b2).into_dyn()));
    }
    let mut dims = batch.clone();
    dims.extend([m, n]);
    let mut out = ArrayD::<A>::zeros(IxDyn(&dims));
    let count: usize = batch.iter().product();
    // Operand `x`'s matrix for batch element `i`: its own index, broadcast dims at 0.
    fn pick<'v, A>(
        x: &'v ArrayViewD<'v, A>,
        batch: &[usize],
        own: &[usize],
        i: usize,
    ) -> ArrayViewD<'v, A> {
        let mut rest = i;
        let mut idx = vec![0usize; batch.len()];
        for d in (0..batch.len()).rev() {
            idx[d] = rest % batch[d];
            rest /= batch[d];
        }
        let skip = batch.len() - own.len();
        let mut v = x.view();
        for (d, &size) in own.iter().enumerate() {
            let at = if size == 1 { 0 } else { idx[skip + d] };
            v = v.index_axis_move(ndarray::Axis(0), at);
        }
        v
    }
    {
        let mut blocks = out.view_mut().into_shape_with_order((count, m, n))?;
        for i in 0..count {
            let a2 = matrix(pick(&a, &batch, ba, i), ta)?;
            let b2 = matrix(pick(&b, &batch, bb, i), tb)?;
            let mut c = blocks.index_axis_mut(ndarray::Axis(0), i);
            general_mat_mul(A::one(), &a2, &b2, A::zero(), &mut c);
        }
    }
    Ok(val(out))
}

/// Checks `gamma` (and `beta`) against the last axis of `x`; returns it.
fn ln_dim(x: &[usize], params: &[&[usize]]) -> Result<usize, CpuKernelError> {
    let d = *x.last().ok_or_else(|| CpuKernelError::Shape {
        need: ShapeNeed::Rank(1),
        shape: x.to_vec(),
    })?;
    for p in params {
        if *p != [d] {
            return Err(CpuKernelError::Shapes {
                check: ShapeCheck::LayerNormParams(d),
                left: x.to_vec(),
                right: p.to_vec(),
            });
        }
    }
    Ok(d)
}

/// Mean and `1/sqrt(var + eps)` of one row (biased variance).
fn row_stats<A: Elem>(row: &[A], eps: A) -> (A, A) {
    let n = A::c(row.len() as f64);
    let mean = row.iter().copied().sum::<A>() / n;
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<A>() / n;
    (mean, A::one() / (var + eps).sqrt())
}

/// `(x - mean) / sqrt(var + eps) * gamma + beta` over the last axis.
pub(super) fn layer_norm<A: Elem>(
    x: Arg<'_>,
    gamma: &Arg<'_>,
    beta: &Arg<'_>,
    eps: f64,
) -> Result<Value, CpuKernelError> {
    let x = cow::<A>(x, 0)?;
    let (g, b) = (view::<A>(gamma, 1)?, view::<A>(beta, 2)?);
    let d = ln_dim(x.shape(), &[g.shape(), b.shape()])?;
    let mut o = standard(x);
    if d == 0 {
        return Ok(val(o));
    }
    let (g, b) = (
        g.iter().copied().collect::<Vec<A>>(),
        b.iter().copied().collect::<Vec<A>>(),
    );
    let eps = A::c(eps);
    let data = o.as_slice_mut().ok_or(CONTIGUOUS)?;
    for row in data.chunks_exact_mut(d) {
        let (mean, inv) = row_stats(row, eps);
        for ((v, &g), &b) in row.iter_mut().zip(&g).zip(&b) {
            *v = (*v - mean) * inv * g + b;
        }
    }
    Ok(val(o))
}

/// `(dy, x, gamma) -> (dx, dgamma, dbeta)`; `dx` is written into `dy` when owned.
pub(super) fn layer_norm_grad<A: Elem>(
    dy: Arg<'_>,
    x: &Arg<'_>,
    gamma: &Arg<'_>,
    eps: f64,
) -> Result<Vec<Value>, CpuKernelError> {
    let dy = cow::<A>(dy, 0)?;
    let (x, g) = (view::<A>(x, 1)?, view::<A>(gamma, 2)?);
    if dy.shape() != x.shape() {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::SameNamed("dy", "x"),
            left: dy.shape().to_vec(),
            right: x.shape().to_vec(),
        });
    }
    let d = ln_dim(x.shape(), &[g.shape()])?;
    let mut dx = standard(dy);
    let mut dgamma = vec![A::zero(); d];
    let mut dbeta = vec![A::zero(); d];
    if d > 0 {
        let g = g.iter().copied().collect::<Vec<A>>();
        let x = x.as_standard_layout();
        let xs = x.as_slice().ok_or(CONTIGUOUS)?;
        let dxs = dx.as_slice_mut().ok_or(CONTIGUOUS)?;
        let (eps, n) = (A::c(eps), A::c(d as f64));
        for (drow, xrow) in dxs.chunks_exact_mut(d).zip(xs.chunks_exact(d)) {
            let (mean, inv) = row_stats(xrow, eps);
            // dxhat = dy * gamma; dx = inv/d * (d*dxhat - sum(dxhat) - xhat*sum(dxhat*xhat)).
            let (mut s1, mut s2) = (A::zero(), A::zero());
            for j in 0..d {
                let xhat = (xrow[j] - mean) * inv;
                let dxhat = drow[j] * g[j];
                s1 += dxhat;
                s2 += dxhat * xhat;
                dgamma[j] += drow[j] * xhat;
                dbeta[j] += drow[j];
            }
            let f = inv / n;
            for j in 0..d {
                let xhat = (xrow[j] - mean) * inv;
                drow[j] = f * (n * drow[j] * g[j] - s1 - xhat * s2);
            }
        }
    }
    let vec1 = |v: Vec<A>| ArrayD::from_shape_vec(IxDyn(&[d]), v);
    Ok(vec![val(dx), val(vec1(dgamma)?), val(vec1(dbeta)?)])
}

// The CPU kernels' own walks over the geometry.
impl Geom {
    /// The input coordinate read by output coordinate `o` at kernel offset `k`, if it
    /// is inside the image (not padding).
    fn src(&self, o: usize, k: usize, size: usize) -> Option<usize> {
        (o * self.stride + k)
            .checked_sub(self.pad)
            .filter(|&i| i < size)
    }

    /// Visits the runs of the column matrix that read the image rather than padding:
    /// `f(col, src, n)` stands for `cols[col + t] <-> x[src + t * stride]`, `t < n`.
    /// Column row `(c*kh + i)*kw + j`, column `oy*ow + ox`.
    fn for_each_run(&self, mut f: impl FnMut(usize, usize, usize)) {
        let (p, s) = (self.p(), self.stride);
        for c in 0..self.c {
            for i in 0..self.kh {
                for j in 0..self.kw {
                    let row = ((c * self.kh + i) * self.kw + j) * p;
                    // Output columns whose input column `ox*s + j - pad` is inside 0..w.
                    let lo = self.pad.saturating_sub(j).div_ceil(s);
                    let Some(last) = (self.w + self.pad).checked_sub(j + 1) else {
                        continue;
                    };
                    let hi = (last / s + 1).min(self.ow);
                    if lo >= hi {
                        continue;
                    }
                    let x0 = lo * s + j - self.pad;
                    for oy in 0..self.oh {
                        if let Some(y) = self.src(oy, i, self.h) {
                            f(
                                row + oy * self.ow + lo,
                                (c * self.h + y) * self.w + x0,
                                hi - lo,
                            );
                        }
                    }
                }
            }
        }
    }

    /// Fills `cols [k, p]` from one image `x [c, h, w]` (padding reads as zero).
    fn im2col<A: Elem>(&self, x: &[A], cols: &mut [A]) {
        cols.fill(A::zero());
        let s = self.stride;
        self.for_each_run(|col, src, n| {
            let dst = &mut cols[col..col + n];
            if s == 1 {
                dst.copy_from_slice(&x[src..src + n]);
            } else {
                for (t, d) in dst.iter_mut().enumerate() {
                    *d = x[src + t * s];
                }
            }
        });
    }

    /// Adds `cols [k, p]` back into one image gradient `dx [c, h, w]`.
    fn col2im<A: Elem>(&self, cols: &[A], dx: &mut [A]) {
        let s = self.stride;
        self.for_each_run(|col, src, n| {
            let from = &cols[col..col + n];
            if s == 1 {
                for (d, &v) in dx[src..src + n].iter_mut().zip(from) {
                    *d += v;
                }
            } else {
                for (t, &v) in from.iter().enumerate() {
                    dx[src + t * s] += v;
                }
            }
        });
    }

    /// Checks `dy` against the output shape.
    fn check_dy(&self, dy: &[usize]) -> Result<(), CpuKernelError> {
        if dy != self.out_dims() {
            return Err(CpuKernelError::Shapes {
                check: ShapeCheck::Gradient("convolution"),
                left: dy.to_vec(),
                right: self.out_dims().to_vec(),
            });
        }
        Ok(())
    }
}

const CONTIGUOUS: CpuKernelError = CpuKernelError::NotContiguous("a standard-layout array");

/// `x [N,C,H,W] (*) w [O,C,KH,KW] -> [N,O,OH,OW]`: im2col, then `w [O,K] @ cols [K,P]`
/// per image into the output.
pub(super) fn conv2d<A: Elem>(
    x: &Arg<'_>,
    w: &Arg<'_>,
    stride: usize,
    padding: usize,
) -> Result<Value, CpuKernelError> {
    let (x, w) = (view::<A>(x, 0)?, view::<A>(w, 1)?);
    let g = Geom::new(x.shape(), w.shape(), stride, padding).map_err(CpuKernelError::Invalid)?;
    let x = x.as_standard_layout();
    let xs = x.as_slice().ok_or(CONTIGUOUS)?;
    let w = w.as_standard_layout();
    let w2 = w.view().into_shape_with_order((g.o, g.k()))?;
    let mut out = Array3::<A>::zeros((g.n, g.o, g.p()));
    let mut cols = Array2::<A>::zeros((g.k(), g.p()));
    for (i, mut out_i) in out.outer_iter_mut().enumerate() {
        g.im2col(
            &xs[i * g.chw()..][..g.chw()],
            cols.as_slice_mut().ok_or(CONTIGUOUS)?,
        );
        general_mat_mul(A::one(), &w2, &cols, A::zero(), &mut out_i);
    }
    Ok(val(out.into_shape_with_order(IxDyn(&g.out_dims()))?))
}

/// `dy` as `[N, O, P]`.
fn dy3<'b, A: Elem>(
    dy: &'b CowArray<'_, A, IxDyn>,
    g: &Geom,
) -> Result<ArrayView3<'b, A>, CpuKernelError> {
    Ok(dy.view().into_shape_with_order((g.n, g.o, g.p()))?)
}

/// `(dy, w) -> dx`: `cols = wᵀ [K,O] @ dy_n [O,P]`, then col2im, per image.
pub(super) fn conv2d_grad_input<A: Elem>(
    dy: &Arg<'_>,
    w: &Arg<'_>,
    stride: usize,
    padding: usize,
    input: &[usize],
) -> Result<Value, CpuKernelError> {
    let (dy, w) = (view::<A>(dy, 0)?, view::<A>(w, 1)?);
    let g = Geom::new(input, w.shape(), stride, padding).map_err(CpuKernelError::Invalid)?;
    g.check_dy(dy.shape())?;
    let dy = dy.as_standard_layout();
    let dy = dy3(&dy, &g)?;
    let w = w.as_standard_layout();
    let w2: ArrayView2<'_, A> = w.view().into_shape_with_order((g.o, g.k()))?;
    let mut dx = ArrayD::<A>::zeros(IxDyn(input));
    let dxs = dx.as_slice_mut().ok_or(CONTIGUOUS)?;
    let mut cols = Array2::<A>::zeros((g.k(), g.p()));
    for (i, dy_i) in dy.outer_iter().enumerate() {
        general_mat_mul(A::one(), &w2.t(), &dy_i, A::zero(), &mut cols);
        g.col2im(
            cols.as_slice().ok_or(CONTIGUOUS)?,
            &mut dxs[i * g.chw()..][..g.chw()],
        );
    }
    Ok(val(dx))
}

/// `(dy, x) -> dw`: the sum over images of `dy_n [O,P] @ cols_nᵀ [P,K]`.
pub(super) fn conv2d_grad_filter<A: Elem>(
    dy: &Arg<'_>,
    x: &Arg<'_>,
    stride: usize,
    padding: usize,
    filter: &[usize],
) -> Result<Value, CpuKernelError> {
    let (dy, x) = (view::<A>(dy, 0)?, view::<A>(x, 1)?);
    let g = Geom::new(x.shape(), filter, stride, padding).map_err(CpuKernelError::Invalid)?;
    g.check_dy(dy.shape())?;
    let dy = dy.as_standard_layout();
    let dy = dy3(&dy, &g)?;
    let x = x.as_standard_layout();
    let xs = x.as_slice().ok_or(CONTIGUOUS)?;
    let mut dw = Array2::<A>::zeros((g.o, g.k()));
    let mut cols = Array2::<A>::zeros((g.k(), g.p()));
    for (i, dy_i) in dy.outer_iter().enumerate() {
        g.im2col(
            &xs[i * g.chw()..][..g.chw()],
            cols.as_slice_mut().ok_or(CONTIGUOUS)?,
        );
        general_mat_mul(A::one(), &dy_i, &cols.t(), A::one(), &mut dw);
    }
    Ok(val(dw.into_shape_with_order(IxDyn(filter))?))
}

/// The geometry of a pool: `(planes, h, w, oh, ow)`.
fn pool_geom(x: &[usize], kernel: usize, stride: usize) -> Result<[usize; 5], CpuKernelError> {
    if x.len() != 4 {
        return Err(CpuKernelError::Shape {
            need: ShapeNeed::Image,
            shape: x.to_vec(),
        });
    }
    if kernel == 0 || stride == 0 || kernel > x[2] || kernel > x[3] {
        return Err(CpuKernelError::Shape {
            need: ShapeNeed::Window { kernel, stride },
            shape: x.to_vec(),
        });
    }
    Ok([
        x[0] * x[1],
        x[2],
        x[3],
        (x[2] - kernel) / stride + 1,
        (x[3] - kernel) / stride + 1,
    ])
}

/// The maximum and its index in `plane` (width `w`) of every window of output row
/// `oy`. Each window is scanned in row-major order keeping the first maximum, so the
/// forward and the backward op agree on ties. The loops run over a whole output row
/// per window offset, with selects rather than branches: pooled activations are
/// noise to a branch predictor.
fn pool_row<A: Elem>(
    plane: &[A],
    w: usize,
    oy: usize,
    kernel: usize,
    stride: usize,
    top: &mut [A],
    arg: &mut [usize],
) {
    let base = oy * stride * w;
    for (ox, (t, a)) in top.iter_mut().zip(arg.iter_mut()).enumerate() {
        *a = base + ox * stride;
        *t = plane[*a];
    }
    for dy in 0..kernel {
        let row = base + dy * w;
        for dx in 0..kernel {
            if dy == 0 && dx == 0 {
                continue;
            }
            let start = row + dx;
            let src = plane[start..].iter().step_by(stride);
            for (ox, ((t, a), &v)) in top.iter_mut().zip(arg.iter_mut()).zip(src).enumerate() {
                let take = v > *t;
                *t = std::hint::select_unpredictable(take, v, *t);
                *a = std::hint::select_unpredictable(take, start + ox * stride, *a);
            }
        }
    }
}

/// The maximum of every window of output row `oy` (the value [`pool_row`] finds).
fn pool_row_max<A: Elem>(
    plane: &[A],
    w: usize,
    oy: usize,
    kernel: usize,
    stride: usize,
    top: &mut [A],
) {
    let base = oy * stride * w;
    for (ox, t) in top.iter_mut().enumerate() {
        *t = plane[base + ox * stride];
    }
    for dy in 0..kernel {
        let row = base + dy * w;
        for dx in 0..kernel {
            if dy == 0 && dx == 0 {
                continue;
            }
            let src = plane[row + dx..].iter().step_by(stride);
            for (t, &v) in top.iter_mut().zip(src) {
                *t = if v > *t { v } else { *t };
            }
        }
    }
}

/// 2-D max pooling, NCHW, no padding.
pub(super) fn max_pool2d<A: Elem>(
    x: &Arg<'_>,
    kernel: usize,
    stride: usize,
) -> Result<Value, CpuKernelError> {
    let x = view::<A>(x, 0)?;
    let [planes, h, w, oh, ow] = pool_geom(x.shape(), kernel, stride)?;
    let x = x.as_standard_layout();
    let xs = x.as_slice().ok_or(CONTIGUOUS)?;
    let mut out = vec![A::zero(); planes * oh * ow];
    for (plane, o) in xs.chunks_exact(h * w).zip(out.chunks_exact_mut(oh * ow)) {
        for (oy, top) in o.chunks_exact_mut(ow).enumerate() {
            pool_row_max(plane, w, oy, kernel, stride, top);
        }
    }
    let s = x.shape();
    Ok(val(ArrayD::from_shape_vec(
        IxDyn(&[s[0], s[1], oh, ow]),
        out,
    )?))
}

/// `(dy, x) -> dx`: each `dy` element goes to its window's arg-max (added up where
/// windows overlap).
pub(super) fn max_pool2d_grad<A: Elem>(
    dy: &Arg<'_>,
    x: &Arg<'_>,
    kernel: usize,
    stride: usize,
) -> Result<Value, CpuKernelError> {
    let (dy, x) = (view::<A>(dy, 0)?, view::<A>(x, 1)?);
    let [_, h, w, oh, ow] = pool_geom(x.shape(), kernel, stride)?;
    let s = x.shape();
    let want = [s[0], s[1], oh, ow];
    if dy.shape() != want {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::Gradient("pool"),
            left: dy.shape().to_vec(),
            right: want.to_vec(),
        });
    }
    let (x, dy) = (x.as_standard_layout(), dy.as_standard_layout());
    let (xs, dys) = (
        x.as_slice().ok_or(CONTIGUOUS)?,
        dy.as_slice().ok_or(CONTIGUOUS)?,
    );
    let mut dx = ArrayD::<A>::zeros(IxDyn(x.shape()));
    let dxs = dx.as_slice_mut().ok_or(CONTIGUOUS)?;
    let (mut top, mut arg) = (vec![A::zero(); ow], vec![0; ow]);
    for ((plane, dplane), dyp) in xs
        .chunks_exact(h * w)
        .zip(dxs.chunks_exact_mut(h * w))
        .zip(dys.chunks_exact(oh * ow))
    {
        for (oy, dyrow) in dyp.chunks_exact(ow).enumerate() {
            pool_row(plane, w, oy, kernel, stride, &mut top, &mut arg);
            for (&i, &g) in arg.iter().zip(dyrow) {
                dplane[i] += g;
            }
        }
    }
    Ok(val(dx))
}
