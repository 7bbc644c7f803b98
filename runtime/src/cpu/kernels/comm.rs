//! The local halves of communication: packing gradients into one buffer for a fused
//! collective, unpacking the result, and summing repeated rows of slices so each row
//! travels once. The collectives and the parameter-server ops themselves run on a
//! communicator, not here.

use super::sparse::slices;
use super::{dtype_error, tensor, Arg, CpuKernelError, Elem};
use crate::core::value::{Slices, Value};
use distc_ir::Shape;
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;

/// Concatenates the inputs' elements, in order, into one flat tensor.
pub(super) fn pack<A: Elem>(args: &[Arg<'_>]) -> Result<Value, CpuKernelError> {
    let arrays = args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let t = tensor(a, i)?;
            A::of(t).ok_or_else(|| dtype_error(a, i, A::DTYPE))
        })
        .collect::<Result<Vec<_>, CpuKernelError>>()?;
    // A bucket is megabytes: one allocation, and a memcpy per contiguous input.
    let n = arrays.iter().map(|a| a.len()).sum();
    let mut out: Vec<A> = Vec::with_capacity(n);
    for arr in arrays {
        match arr.as_slice() {
            Some(flat) => out.extend_from_slice(flat),
            None => out.extend(arr.iter().copied()),
        }
    }
    Ok(Value::Tensor(A::wrap(ArrayD::from_shape_vec(
        IxDyn(&[n]),
        out,
    )?)))
}

/// The buffer of a bucketed reduce-scatter: for each worker in turn, its chunk of
/// every input (flattened, `ceil(n / workers)` elements, zero-padded).
pub(super) fn pack_chunks<A: Elem>(
    args: &[Arg<'_>],
    workers: usize,
) -> Result<Value, CpuKernelError> {
    if workers == 0 {
        return Err(CpuKernelError::Invalid("no workers".into()));
    }
    let flats = args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let t = tensor(a, i)?;
            let arr = A::of(t).ok_or_else(|| dtype_error(a, i, A::DTYPE))?;
            Ok(arr.as_standard_layout())
        })
        .collect::<Result<Vec<_>, CpuKernelError>>()?;
    let flats: Vec<&[A]> = flats
        .iter()
        .map(|f| f.as_slice().unwrap_or_default())
        .collect();
    let chunks: Vec<usize> = flats.iter().map(|f| f.len().div_ceil(workers)).collect();
    let total: usize = chunks.iter().sum::<usize>() * workers;
    let mut out: Vec<A> = Vec::with_capacity(total);
    for r in 0..workers {
        for (flat, &c) in flats.iter().zip(&chunks) {
            let (start, end) = ((r * c).min(flat.len()), ((r + 1) * c).min(flat.len()));
            out.extend_from_slice(&flat[start..end]);
            out.extend(std::iter::repeat_n(A::zero(), c - (end - start)));
        }
    }
    Ok(Value::Tensor(A::wrap(ArrayD::from_shape_vec(
        IxDyn(&[total]),
        out,
    )?)))
}

/// The values whole again from all workers' packed chunks (see [`pack_chunks`]; here
/// each worker's part holds its chunk of every value, parts in rank order).
pub(super) fn unpack_chunks<A: Elem>(
    arg: &Arg<'_>,
    workers: usize,
    shapes: &[Shape],
) -> Result<Vec<Value>, CpuKernelError> {
    let t = tensor(arg, 0)?;
    let arr = A::of(t).ok_or_else(|| dtype_error(arg, 0, A::DTYPE))?;
    let flat = arr.as_standard_layout();
    let flat = flat
        .as_slice()
        .ok_or(CpuKernelError::NotContiguous("packed buffer"))?;
    let chunks: Vec<usize> = shapes
        .iter()
        .map(|s| s.numel().div_ceil(workers.max(1)))
        .collect();
    let part: usize = chunks.iter().sum();
    if workers == 0 || flat.len() != part * workers {
        return Err(CpuKernelError::Invalid(format!(
            "{} elements are not {workers} workers' chunks of {part}",
            flat.len()
        )));
    }
    let mut offset = 0;
    shapes
        .iter()
        .zip(&chunks)
        .map(|(s, &c)| {
            let n = s.numel();
            let mut whole: Vec<A> = Vec::with_capacity(c * workers);
            for r in 0..workers {
                let at = r * part + offset;
                whole.extend_from_slice(&flat[at..at + c]);
            }
            whole.truncate(n);
            offset += c;
            ArrayD::from_shape_vec(IxDyn(s.dims()), whole)
                .map(|a| Value::Tensor(A::wrap(a)))
                .map_err(CpuKernelError::layout("unpack_chunks to", s.dims()))
        })
        .collect()
}

/// Splits a flat tensor into tensors of `shapes`.
pub(super) fn unpack<A: Elem>(
    arg: &Arg<'_>,
    shapes: &[Shape],
) -> Result<Vec<Value>, CpuKernelError> {
    let t = tensor(arg, 0)?;
    let arr = A::of(t).ok_or_else(|| dtype_error(arg, 0, A::DTYPE))?;
    let flat = arr.as_standard_layout();
    let flat = flat
        .as_slice()
        .ok_or(CpuKernelError::NotContiguous("packed buffer"))?;
    let total: usize = shapes.iter().map(|s| s.numel()).sum();
    if flat.len() != total {
        return Err(CpuKernelError::Invalid(format!(
            "{} elements cannot be unpacked into {total}",
            flat.len()
        )));
    }
    let mut at = 0;
    shapes
        .iter()
        .map(|s| {
            let n = s.numel();
            let part = flat[at..at + n].to_vec();
            at += n;
            ArrayD::from_shape_vec(IxDyn(s.dims()), part)
                .map(|a| Value::Tensor(A::wrap(a)))
                .map_err(CpuKernelError::layout("unpack to", s.dims()))
        })
        .collect()
}

/// Slices with each row index once, its values summed; rows in first-seen order.
pub(super) fn unique_rows<A: Elem>(arg: &Arg<'_>) -> Result<Value, CpuKernelError> {
    let (s, values) = slices::<A>(arg, 0)?;
    let row: usize = s.dense_shape[1..].iter().product();
    let values = values.as_standard_layout();
    let src = values
        .as_slice()
        .ok_or(CpuKernelError::NotContiguous("slices values"))?;
    let mut slot: HashMap<i32, usize> = HashMap::with_capacity(s.indices.len());
    let mut indices = Vec::new();
    let mut out: Vec<A> = Vec::new();
    for (k, &id) in s.indices.iter().enumerate() {
        let j = *slot.entry(id).or_insert_with(|| {
            indices.push(id);
            out.extend(std::iter::repeat_n(A::zero(), row));
            indices.len() - 1
        });
        for (d, &v) in out[j * row..][..row].iter_mut().zip(&src[k * row..][..row]) {
            *d += v;
        }
    }
    let mut dims = vec![indices.len()];
    dims.extend_from_slice(&s.dense_shape[1..]);
    Ok(Value::Slices(Slices {
        indices,
        values: A::wrap(ArrayD::from_shape_vec(IxDyn(&dims), out)?),
        dense_shape: s.dense_shape.clone(),
    }))
}

/// This worker's chunk of `x` (flattened, zero-padded to `workers * c` elements with
/// `c = ceil(n / workers)`): elements `rank * c .. (rank + 1) * c`.
pub(super) fn take_chunk<A: Elem>(
    x: &Arg<'_>,
    workers: usize,
    rank: usize,
) -> Result<Value, CpuKernelError> {
    let t = tensor(x, 0)?;
    let a = A::of(t).ok_or_else(|| dtype_error(x, 0, A::DTYPE))?;
    if workers == 0 || rank >= workers {
        return Err(CpuKernelError::Invalid(format!(
            "chunk {rank} of {workers}"
        )));
    }
    let n = a.len();
    let c = n.div_ceil(workers);
    let mut out = vec![A::zero(); c];
    let (start, end) = ((rank * c).min(n), ((rank + 1) * c).min(n));
    for (o, v) in out.iter_mut().zip(a.iter().skip(start).take(end - start)) {
        *o = *v;
    }
    Ok(Value::Tensor(A::wrap(ArrayD::from_shape_vec(
        IxDyn(&[c]),
        out,
    )?)))
}
