//! Reductions and what is built on them: sum and mean over axes, `sum_to` and
//! `broadcast_to` (the two halves of broadcasting's gradient), the numerically stable
//! softmax family with its gradients, and the two losses with theirs.
//!
//! Softmax-like kernels work row by row along the normalised axis and overwrite an
//! owned input; the cross-entropy gradient turns the (owned) logits into the gradient
//! in one pass over each row. Rows are reduced with eight accumulators and `exp` is
//! [`Elem::fast_exp`], so the inner loops vectorise: with 1000 classes the loss and
//! its gradient are exp-bound.

use super::{
    cow, standard, tensor, val, view, Arg, CpuKernelError, Elem, IndexOf, ShapeCheck, ShapeNeed,
};
use crate::core::value::Value;
use distc_ir::shape::broadcasts_to;
use ndarray::{ArrayD, ArrayViewD, Axis, CowArray, IxDyn, Zip};

/// Sum (or mean) over `axes`, optionally keeping them with size 1.
pub(super) fn sum<A: Elem>(
    x: Arg<'_>,
    axes: &[usize],
    keep_dims: bool,
    mean: bool,
) -> Result<Value, CpuKernelError> {
    let x = cow::<A>(x, 0)?;
    for w in axes.windows(2) {
        if w[0] >= w[1] {
            return Err(CpuKernelError::Invalid(format!(
                "axes {axes:?} must be sorted and distinct"
            )));
        }
    }
    if let Some(&a) = axes.iter().find(|&&a| a >= x.ndim()) {
        return Err(CpuKernelError::Axis {
            axis: a,
            shape: x.shape().to_vec(),
        });
    }
    let count: usize = axes.iter().map(|&a| x.shape()[a]).product();
    let mut out = reduce_axes(x, axes);
    if mean {
        let n = A::c(count as f64);
        out.mapv_inplace(|v| v / n);
    }
    if keep_dims {
        for &a in axes {
            out.insert_axis_inplace(Axis(a));
        }
    }
    Ok(val(out))
}

/// Sums `x` over `axes` (sorted, in range), dropping them.
fn reduce_axes<A: Elem>(x: CowArray<'_, A, IxDyn>, axes: &[usize]) -> ArrayD<A> {
    if axes.is_empty() {
        return x.into_owned();
    }
    if axes.len() == x.ndim() {
        return ArrayD::from_elem(IxDyn(&[]), x.sum());
    }
    // From the last axis down, so the remaining indices stay valid.
    let mut out: Option<ArrayD<A>> = None;
    for &a in axes.iter().rev() {
        out = Some(match out {
            None => x.sum_axis(Axis(a)),
            Some(o) => o.sum_axis(Axis(a)),
        });
    }
    out.unwrap_or_else(|| x.into_owned())
}

/// Sums `x` over its broadcast dimensions down to `shape`.
pub(super) fn sum_to<A: Elem>(x: Arg<'_>, shape: &[usize]) -> Result<Value, CpuKernelError> {
    let x = cow::<A>(x, 0)?;
    if x.shape() == shape {
        return Ok(val(x.into_owned()));
    }
    if !broadcasts_to(shape, x.shape()) {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::SumTo,
            left: x.shape().to_vec(),
            right: shape.to_vec(),
        });
    }
    let lead = x.ndim() - shape.len();
    let axes: Vec<usize> = (0..x.ndim())
        .filter(|&i| i < lead || (shape[i - lead] == 1 && x.shape()[i] != 1))
        .collect();
    let out = standard(CowArray::from(reduce_axes(x, &axes)));
    out.into_shape_with_order(IxDyn(shape))
        .map(val)
        .map_err(CpuKernelError::layout("sum_to", shape))
}

/// Broadcasts `x` to `shape` (numpy rules).
pub(super) fn broadcast_to<A: Elem>(x: Arg<'_>, shape: &[usize]) -> Result<Value, CpuKernelError> {
    let x = cow::<A>(x, 0)?;
    if x.shape() == shape {
        return Ok(val(x.into_owned()));
    }
    let out = x
        .broadcast(IxDyn(shape))
        .ok_or_else(|| CpuKernelError::Shapes {
            check: ShapeCheck::BroadcastTo,
            left: x.shape().to_vec(),
            right: shape.to_vec(),
        })?
        .as_standard_layout()
        .into_owned();
    Ok(val(out))
}

const CONTIGUOUS: CpuKernelError = CpuKernelError::NotContiguous("a standard-layout array");

fn check_axis(shape: &[usize], axis: usize) -> Result<(), CpuKernelError> {
    if axis >= shape.len() {
        Err(CpuKernelError::Axis {
            axis,
            shape: shape.to_vec(),
        })
    } else {
        Ok(())
    }
}

/// The maximum of a row (eight accumulators, so it vectorises).
fn row_max<A: Elem>(xs: &[A]) -> A {
    let mut acc = [A::neg_infinity(); 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    acc.iter()
        .chain(rest)
        .fold(A::neg_infinity(), |m, &v| m.max(v))
}

/// The sum of a row (eight accumulators, so it vectorises).
fn row_sum<A: Elem>(xs: &[A]) -> A {
    let mut acc = [A::zero(); 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().chain(rest).fold(A::zero(), |s, &v| s + v)
}

/// Writes `exp(src - m)` into `dst`, returns its sum.
fn exp_shifted<A: Elem>(src: &[A], dst: &mut [A], m: A) -> A {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = (v - m).fast_exp();
    }
    row_sum(dst)
}

/// Softmax (or log-softmax) of one contiguous row, in place.
fn softmax_row<A: Elem>(row: &mut [A], log: bool, scratch: &mut [A]) {
    let m = row_max(row);
    if log {
        let lse = m + exp_shifted(row, scratch, m).ln();
        row.iter_mut().for_each(|v| *v -= lse);
    } else {
        for v in row.iter_mut() {
            *v = (*v - m).fast_exp();
        }
        let inv = A::one() / row_sum(row);
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Softmax (or log-softmax) along `axis`, subtracting each lane's maximum first.
pub(super) fn softmax<A: Elem>(
    x: Arg<'_>,
    axis: usize,
    log: bool,
) -> Result<Value, CpuKernelError> {
    let x = cow::<A>(x, 0)?;
    check_axis(x.shape(), axis)?;
    let mut o = standard(x);
    let d = o.shape()[axis];
    if d == 0 {
        return Ok(val(o));
    }
    let mut scratch = vec![A::zero(); d];
    if axis + 1 == o.ndim() {
        // The usual case: rows are contiguous.
        let data = o.as_slice_mut().ok_or(CONTIGUOUS)?;
        for row in data.chunks_exact_mut(d) {
            softmax_row(row, log, &mut scratch);
        }
    } else {
        // Strided lanes: copied into a contiguous row and back.
        let mut row = vec![A::zero(); d];
        Zip::from(o.lanes_mut(Axis(axis))).for_each(|mut lane| {
            row.iter_mut().zip(lane.iter()).for_each(|(r, &v)| *r = v);
            softmax_row(&mut row, log, &mut scratch);
            lane.iter_mut().zip(&row).for_each(|(v, &r)| *v = r);
        });
    }
    Ok(val(o))
}

/// Softmax gradient `y * (dy - sum(dy * y))`, or log-softmax gradient
/// `dy - exp(y) * sum(dy)`, along `axis`; written into `dy` when it is owned.
pub(super) fn softmax_grad<A: Elem>(
    dy: Arg<'_>,
    y: &Arg<'_>,
    axis: usize,
    log: bool,
) -> Result<Value, CpuKernelError> {
    let dy = cow::<A>(dy, 0)?;
    let y = view::<A>(y, 1)?;
    if dy.shape() != y.shape() {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::SameNamed("dy", "y"),
            left: dy.shape().to_vec(),
            right: y.shape().to_vec(),
        });
    }
    check_axis(y.shape(), axis)?;
    let mut o = dy.into_owned();
    Zip::from(o.lanes_mut(Axis(axis)))
        .and(y.lanes(Axis(axis)))
        .for_each(|mut d, yl| {
            if log {
                let s = d.sum();
                Zip::from(&mut d)
                    .and(&yl)
                    .for_each(|d, &y| *d -= y.exp() * s);
            } else {
                let s = Zip::from(&d)
                    .and(&yl)
                    .fold(A::zero(), |acc, &d, &y| acc + d * y);
                Zip::from(&mut d)
                    .and(&yl)
                    .for_each(|d, &y| *d = y * (*d - s));
            }
        });
    Ok(val(o))
}

/// Checks `[B, K]` logits against `i32[B]` labels in `0..K`; returns the labels.
fn sce_inputs<'b, A: Elem>(
    logits: &ArrayViewD<'_, A>,
    labels: &'b Arg<'_>,
    i: usize,
) -> Result<ArrayViewD<'b, i32>, CpuKernelError> {
    if logits.ndim() != 2 {
        return Err(CpuKernelError::Shape {
            need: ShapeNeed::Logits,
            shape: logits.shape().to_vec(),
        });
    }
    let labels = view::<i32>(labels, i)?;
    let (b, k) = (logits.shape()[0], logits.shape()[1]);
    if labels.shape() != [b] {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::Labels(b),
            left: logits.shape().to_vec(),
            right: labels.shape().to_vec(),
        });
    }
    if let Some((i, &l)) = labels
        .iter()
        .enumerate()
        .find(|(_, &l)| l < 0 || l as usize >= k)
    {
        return Err(CpuKernelError::Index {
            index: l,
            position: i,
            of: IndexOf::Classes(k),
        });
    }
    Ok(labels)
}

/// Mean over the batch of `-log_softmax(logits)[label]`.
pub(super) fn softmax_cross_entropy<A: Elem>(
    logits: &Arg<'_>,
    labels: &Arg<'_>,
) -> Result<Value, CpuKernelError> {
    let x = view::<A>(logits, 0)?;
    let labels = sce_inputs(&x, labels, 1)?;
    let (b, k) = (x.shape()[0], x.shape()[1]);
    let mut total = A::zero();
    if k > 0 {
        let x = x.as_standard_layout();
        let data = x.as_slice().ok_or(CONTIGUOUS)?;
        let mut scratch = vec![A::zero(); k];
        for (row, &l) in data.chunks_exact(k).zip(labels.iter()) {
            let m = row_max(row);
            let lse = m + exp_shifted(row, &mut scratch, m).ln();
            total += lse - row[l as usize];
        }
    }
    Ok(val(ArrayD::from_elem(IxDyn(&[]), total / A::c(b as f64))))
}

/// The first element of a scalar input (`dloss`).
fn scalar<A: Elem>(arg: &Arg<'_>, i: usize) -> Result<A, CpuKernelError> {
    let a = view::<A>(arg, i)?;
    if a.len() != 1 {
        return Err(CpuKernelError::Shape {
            need: ShapeNeed::Scalar(i),
            shape: a.shape().to_vec(),
        });
    }
    a.iter()
        .next()
        .copied()
        .ok_or_else(|| CpuKernelError::Invalid(format!("input {i} is empty")))
}

/// `dloss * (softmax(logits) - onehot(labels)) / B`, written into the logits' buffer
/// when they are owned.
pub(super) fn softmax_cross_entropy_grad<A: Elem>(
    dloss: &Arg<'_>,
    logits: Arg<'_>,
    labels: &Arg<'_>,
) -> Result<Value, CpuKernelError> {
    let d = scalar::<A>(dloss, 0)?;
    let x = cow::<A>(logits, 1)?;
    let labels = sce_inputs(&x.view(), labels, 2)?;
    let (b, k) = (x.shape()[0], x.shape()[1]);
    let scale = d / A::c(b as f64);
    let mut o = standard(x);
    if k > 0 {
        let data = o.as_slice_mut().ok_or(CONTIGUOUS)?;
        for (row, &l) in data.chunks_exact_mut(k).zip(labels.iter()) {
            let m = row_max(row);
            for v in row.iter_mut() {
                *v = (*v - m).fast_exp();
            }
            let f = scale / row_sum(row);
            row.iter_mut().for_each(|v| *v *= f);
            row[l as usize] -= scale;
        }
    }
    Ok(val(o))
}

fn same_shape(p: &[usize], t: &[usize]) -> Result<(), CpuKernelError> {
    if p != t {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::Target,
            left: p.to_vec(),
            right: t.to_vec(),
        });
    }
    Ok(())
}

/// `mean((p - t)^2)`.
pub(super) fn mse<A: Elem>(p: &Arg<'_>, t: &Arg<'_>) -> Result<Value, CpuKernelError> {
    let (p, t) = (view::<A>(p, 0)?, view::<A>(t, 1)?);
    same_shape(p.shape(), t.shape())?;
    let s = Zip::from(&p)
        .and(&t)
        .fold(A::zero(), |acc, &a, &b| acc + (a - b) * (a - b));
    Ok(val(ArrayD::from_elem(IxDyn(&[]), s / A::c(p.len() as f64))))
}

/// `dloss * 2 (p - t) / n`, written into an owned `p` or `t`.
pub(super) fn mse_grad<A: Elem>(
    dloss: &Arg<'_>,
    p: Arg<'_>,
    t: Arg<'_>,
) -> Result<Value, CpuKernelError> {
    let d = scalar::<A>(dloss, 0)?;
    same_shape(tensor(&p, 1)?.shape(), tensor(&t, 2)?.shape())?;
    let (p, t) = (cow::<A>(p, 1)?, cow::<A>(t, 2)?);
    let c = d * A::c(2.0) / A::c(p.len() as f64);
    let out = if p.is_owned() {
        let mut o = p.into_owned();
        Zip::from(&mut o)
            .and(&t)
            .for_each(|p, &t| *p = (*p - t) * c);
        o
    } else if t.is_owned() {
        let mut o = t.into_owned();
        Zip::from(&mut o)
            .and(&p)
            .for_each(|t, &p| *t = (p - *t) * c);
        o
    } else {
        Zip::from(&p).and(&t).map_collect(|&p, &t| (p - t) * c)
    };
    Ok(val(out))
}
