//! Scaled dot-product attention and its gradient, one `(batch, head)` slice at a time:
//! the scores `q kᵀ * scale` of a slice (masked above the diagonal when causal), a
//! softmax per query row, the weighted values. The gradient recomputes the scores
//! rather than reading stored ones, as a fused GPU kernel does, so the forward pass
//! keeps nothing `Tq x Tk` alive.

use super::{val, view, Arg, CpuKernelError, Elem, ShapeCheck};
use crate::core::value::Value;
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayD, ArrayView2, Axis, CowArray, Ix2, IxDyn};

/// The sizes of an attention: slices, query length, key length, feature sizes.
struct Dims {
    slices: usize,
    tq: usize,
    tk: usize,
    d: usize,
    dv: usize,
}

fn dims(q: &[usize], k: &[usize], v: &[usize]) -> Result<Dims, CpuKernelError> {
    let r = q.len();
    let ok = r >= 2
        && k.len() == r
        && v.len() == r
        && q[..r - 2] == k[..r - 2]
        && q[..r - 2] == v[..r - 2]
        && q[r - 1] == k[r - 1]
        && k[r - 2] == v[r - 2];
    if !ok {
        return Err(CpuKernelError::Attention {
            q: q.to_vec(),
            k: k.to_vec(),
            v: v.to_vec(),
        });
    }
    Ok(Dims {
        slices: q[..r - 2].iter().product(),
        tq: q[r - 2],
        tk: k[r - 2],
        d: q[r - 1],
        dv: v[r - 1],
    })
}

/// Slice `i` of `x` (standard layout) seen as `[slices, rows, cols]`.
fn slice<'a, A>(
    x: &'a CowArray<'_, A, IxDyn>,
    n: &Dims,
    rows: usize,
    i: usize,
) -> ArrayView2<'a, A> {
    let cols = x.len() / (n.slices * rows).max(1);
    let whole = x
        .view()
        .into_shape_with_order((n.slices, rows, cols))
        .expect("standard layout checked by the caller");
    whole
        .index_axis_move(Axis(0), i)
        .into_dimensionality::<Ix2>()
        .expect("rank 2")
}

/// The softmax weights of one slice: `softmax(q kᵀ * scale)`, masked entries exactly 0.
fn weights<A: Elem>(
    q: ArrayView2<'_, A>,
    k: ArrayView2<'_, A>,
    causal: bool,
    scale: A,
) -> Array2<A> {
    let (tq, tk) = (q.nrows(), k.nrows());
    let mut p = Array2::<A>::zeros((tq, tk));
    general_mat_mul(scale, &q, &k.t(), A::zero(), &mut p);
    for (i, mut row) in p.axis_iter_mut(Axis(0)).enumerate() {
        let live = if causal { (i + 1).min(tk) } else { tk };
        let row = row.as_slice_mut().expect("a fresh array is contiguous");
        let max = row[..live]
            .iter()
            .copied()
            .fold(A::neg_infinity(), |m, v| if v > m { v } else { m });
        let mut sum = A::zero();
        for v in &mut row[..live] {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in &mut row[..live] {
            *v /= sum;
        }
        for v in &mut row[live..] {
            *v = A::zero();
        }
    }
    p
}

/// Inputs in standard layout (reshaping needs contiguous memory): borrowed where they
/// are, copied where not.
fn standard_views<'a, A: Elem>(
    args: &[&'a Arg<'_>],
) -> Result<Vec<CowArray<'a, A, IxDyn>>, CpuKernelError> {
    args.iter()
        .enumerate()
        .map(|(i, a)| {
            let v = view::<A>(a, i)?;
            Ok(if v.is_standard_layout() {
                CowArray::from(v)
            } else {
                CowArray::from(v.as_standard_layout().into_owned())
            })
        })
        .collect()
}

/// `attention(q, k, v)`.
pub(super) fn attention<A: Elem>(
    q: &Arg<'_>,
    k: &Arg<'_>,
    v: &Arg<'_>,
    causal: bool,
    scale: f64,
) -> Result<Value, CpuKernelError> {
    let views = standard_views::<A>(&[q, k, v])?;
    let (q, k, v) = (&views[0], &views[1], &views[2]);
    let n = dims(q.shape(), k.shape(), v.shape())?;
    let mut out_dims = q.shape().to_vec();
    let r = out_dims.len();
    out_dims[r - 1] = n.dv;
    let mut out = ArrayD::<A>::zeros(IxDyn(&out_dims));
    {
        let mut blocks = out
            .view_mut()
            .into_shape_with_order((n.slices, n.tq, n.dv))?;
        for i in 0..n.slices {
            let p = weights(
                slice(q, &n, n.tq, i),
                slice(k, &n, n.tk, i),
                causal,
                A::c(scale),
            );
            let mut o = blocks.index_axis_mut(Axis(0), i);
            general_mat_mul(A::one(), &p, &slice(v, &n, n.tk, i), A::zero(), &mut o);
        }
    }
    Ok(val(out))
}

/// `(dy, q, k, v) -> (dq, dk, dv)`.
pub(super) fn attention_grad<A: Elem>(
    dy: &Arg<'_>,
    q: &Arg<'_>,
    k: &Arg<'_>,
    v: &Arg<'_>,
    causal: bool,
    scale: f64,
) -> Result<Vec<Value>, CpuKernelError> {
    let views = standard_views::<A>(&[dy, q, k, v])?;
    let (dy, q, k, v) = (&views[0], &views[1], &views[2], &views[3]);
    let n = dims(q.shape(), k.shape(), v.shape())?;
    let r = q.shape().len();
    let mut want = q.shape().to_vec();
    want[r - 1] = n.dv;
    if dy.shape() != want.as_slice() {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::Gradient("attention"),
            left: dy.shape().to_vec(),
            right: want,
        });
    }
    let scale = A::c(scale);
    let mut dq = ArrayD::<A>::zeros(IxDyn(q.shape()));
    let mut dk = ArrayD::<A>::zeros(IxDyn(k.shape()));
    let mut dv = ArrayD::<A>::zeros(IxDyn(v.shape()));
    {
        let mut dqb = dq.view_mut().into_shape_with_order((n.slices, n.tq, n.d))?;
        let mut dkb = dk.view_mut().into_shape_with_order((n.slices, n.tk, n.d))?;
        let mut dvb = dv
            .view_mut()
            .into_shape_with_order((n.slices, n.tk, n.dv))?;
        for i in 0..n.slices {
            let (qi, ki, vi) = (
                slice(q, &n, n.tq, i),
                slice(k, &n, n.tk, i),
                slice(v, &n, n.tk, i),
            );
            let dyi = slice(dy, &n, n.tq, i);
            let p = weights(qi, ki, causal, scale);
            // dv = pᵀ dy; dp = dy vᵀ; ds = p (dp - rowsum(p dp)); dq = ds k s; dk = dsᵀ q s.
            general_mat_mul(
                A::one(),
                &p.t(),
                &dyi,
                A::zero(),
                &mut dvb.index_axis_mut(Axis(0), i),
            );
            let mut ds = Array2::<A>::zeros((n.tq, n.tk));
            general_mat_mul(A::one(), &dyi, &vi.t(), A::zero(), &mut ds);
            for (mut dsr, pr) in ds.axis_iter_mut(Axis(0)).zip(p.axis_iter(Axis(0))) {
                let dot = dsr
                    .iter()
                    .zip(pr.iter())
                    .fold(A::zero(), |s, (&a, &b)| s + a * b);
                for (d, &pv) in dsr.iter_mut().zip(pr.iter()) {
                    *d = pv * (*d - dot);
                }
            }
            general_mat_mul(
                scale,
                &ds,
                &ki,
                A::zero(),
                &mut dqb.index_axis_mut(Axis(0), i),
            );
            general_mat_mul(
                scale,
                &ds.t(),
                &qi,
                A::zero(),
                &mut dkb.index_axis_mut(Axis(0), i),
            );
        }
    }
    Ok(vec![val(dq), val(dk), val(dv)])
}
