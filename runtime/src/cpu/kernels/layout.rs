//! Layout kernels: reshape, transpose, concat and slice, for every dtype (ids are
//! reshaped and sliced too). An owned standard-layout input is reshaped without a
//! copy; everything else is copied once into a standard-layout result.

use super::{cow, standard, val, view, Arg, CpuKernelError, Scalar, ShapeCheck, ShapeNeed};
use crate::core::value::Value;
use ndarray::{ArrayD, Axis, CowArray, IxDyn, Slice};

/// Same elements in row-major order, new shape.
pub(super) fn reshape<T: Scalar>(x: Arg<'_>, shape: &[usize]) -> Result<Value, CpuKernelError> {
    let x = cow::<T>(x, 0)?;
    let n: usize = shape.iter().product();
    if n != x.len() {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::Reshape,
            left: x.shape().to_vec(),
            right: shape.to_vec(),
        });
    }
    standard(x)
        .into_shape_with_order(IxDyn(shape))
        .map(val)
        .map_err(CpuKernelError::layout("reshape to", shape))
}

/// Output axis `i` is input axis `perm[i]`.
pub(super) fn transpose<T: Scalar>(x: Arg<'_>, perm: &[usize]) -> Result<Value, CpuKernelError> {
    let x = cow::<T>(x, 0)?;
    let mut seen = vec![false; x.ndim()];
    for &p in perm {
        if p >= seen.len() || seen[p] {
            return Err(CpuKernelError::Shape {
                need: ShapeNeed::Permutation(perm.to_vec()),
                shape: x.shape().to_vec(),
            });
        }
        seen[p] = true;
    }
    if perm.len() != x.ndim() {
        return Err(CpuKernelError::Shape {
            need: ShapeNeed::PermutationLength(perm.to_vec()),
            shape: x.shape().to_vec(),
        });
    }
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        return Ok(val(standard(x)));
    }
    let out = x
        .view()
        .permuted_axes(IxDyn(perm))
        .as_standard_layout()
        .into_owned();
    Ok(val(out))
}

/// Joins the inputs along `axis`.
pub(super) fn concat<T: Scalar>(args: &[Arg<'_>], axis: usize) -> Result<Value, CpuKernelError> {
    let views = args
        .iter()
        .enumerate()
        .map(|(i, a)| view::<T>(a, i))
        .collect::<Result<Vec<_>, _>>()?;
    let first = views.first().ok_or(CpuKernelError::NoInputs)?;
    if axis >= first.ndim() {
        return Err(CpuKernelError::Axis {
            axis,
            shape: first.shape().to_vec(),
        });
    }
    let mut dims = first.shape().to_vec();
    dims[axis] = 0;
    for v in &views {
        let fits = v.ndim() == dims.len()
            && v.shape()
                .iter()
                .zip(first.shape())
                .enumerate()
                .all(|(i, (x, y))| i == axis || x == y);
        if !fits {
            return Err(CpuKernelError::Shapes {
                check: ShapeCheck::OutsideAxis(axis),
                left: v.shape().to_vec(),
                right: first.shape().to_vec(),
            });
        }
        dims[axis] += v.shape()[axis];
    }
    let mut out = ArrayD::<T>::zeros(IxDyn(&dims));
    let mut at = 0;
    for v in &views {
        let n = v.shape()[axis];
        out.slice_axis_mut(Axis(axis), Slice::from(at..at + n))
            .assign(v);
        at += n;
    }
    Ok(val(out))
}

/// `x[start..end]` along `axis`.
pub(super) fn slice<T: Scalar>(
    x: &Arg<'_>,
    axis: usize,
    start: usize,
    end: usize,
) -> Result<Value, CpuKernelError> {
    let x = view::<T>(x, 0)?;
    if axis >= x.ndim() || start >= end || end > x.shape()[axis] {
        return Err(CpuKernelError::Range {
            axis,
            start,
            end,
            shape: x.shape().to_vec(),
        });
    }
    let s = x.slice_axis(Axis(axis), Slice::from(start..end));
    Ok(val(standard(CowArray::from(s))))
}
