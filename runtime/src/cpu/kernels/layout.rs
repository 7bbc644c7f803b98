//! Layout kernels: reshape, transpose, concat and slice, for every dtype (ids are
//! reshaped and sliced too). An owned standard-layout input is reshaped without a
//! copy; everything else is copied once into a standard-layout result.

use super::{cow, shape_str, standard, val, view, Arg, Scalar};
use crate::core::value::Value;
use ndarray::{ArrayD, Axis, CowArray, IxDyn, Slice};

/// Same elements in row-major order, new shape.
pub(super) fn reshape<T: Scalar>(x: Arg<'_>, shape: &[usize]) -> Result<Value, String> {
    let x = cow::<T>(x, 0)?;
    let n: usize = shape.iter().product();
    if n != x.len() {
        return Err(format!(
            "cannot reshape {} ({} elements) to {} ({n} elements)",
            shape_str(x.shape()),
            x.len(),
            shape_str(shape)
        ));
    }
    standard(x)
        .into_shape_with_order(IxDyn(shape))
        .map(val)
        .map_err(|e| format!("reshape to {}: {e}", shape_str(shape)))
}

/// Output axis `i` is input axis `perm[i]`.
pub(super) fn transpose<T: Scalar>(x: Arg<'_>, perm: &[usize]) -> Result<Value, String> {
    let x = cow::<T>(x, 0)?;
    let mut seen = vec![false; x.ndim()];
    for &p in perm {
        if p >= seen.len() || seen[p] {
            return Err(format!(
                "{perm:?} is not a permutation of the axes of {}",
                shape_str(x.shape())
            ));
        }
        seen[p] = true;
    }
    if perm.len() != x.ndim() {
        return Err(format!(
            "permutation {perm:?} does not fit {}",
            shape_str(x.shape())
        ));
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
pub(super) fn concat<T: Scalar>(args: &[Arg<'_>], axis: usize) -> Result<Value, String> {
    let views = args
        .iter()
        .enumerate()
        .map(|(i, a)| view::<T>(a, i))
        .collect::<Result<Vec<_>, _>>()?;
    let first = views.first().ok_or("takes at least one input, got none")?;
    if axis >= first.ndim() {
        return Err(format!(
            "axis {axis} is out of range for {}",
            shape_str(first.shape())
        ));
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
            return Err(format!(
                "{} and {} differ outside axis {axis}",
                shape_str(v.shape()),
                shape_str(first.shape())
            ));
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
) -> Result<Value, String> {
    let x = view::<T>(x, 0)?;
    if axis >= x.ndim() || start >= end || end > x.shape()[axis] {
        return Err(format!(
            "range {start}..{end} is empty or outside axis {axis} of {}",
            shape_str(x.shape())
        ));
    }
    let s = x.slice_axis(Axis(axis), Slice::from(start..end));
    Ok(val(standard(CowArray::from(s))))
}
