//! Embedding lookups and row-sparse `IndexedSlices`.
//!
//! The gradient of a lookup stays sparse: `embedding_grad` returns the ids and the
//! rows of `dy` as they are (repeated ids kept, no scatter into a table-sized
//! buffer), so a 100k-row table costs only the rows a batch touched. Only `densify`
//! builds a dense tensor, adding repeated rows up.

use super::{
    cow, shape_str, standard, val, view, Arg, CpuKernelError, Elem, IndexOf, ShapeCheck, ShapeNeed,
};
use crate::core::value::{Slices, Value};
use distc_ir::TensorType;
use ndarray::{ArrayD, ArrayViewD, IxDyn};

/// Elements per row of a tensor of shape `dims` (the product of `dims[1..]`).
fn row_len(dims: &[usize]) -> usize {
    dims.iter().skip(1).product()
}

/// Checks that every id addresses one of `rows` rows.
fn check_ids(ids: &ArrayViewD<'_, i32>, rows: usize) -> Result<(), CpuKernelError> {
    match ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id < 0 || id as usize >= rows)
    {
        Some((k, &id)) => Err(CpuKernelError::Index {
            index: id,
            position: k,
            of: IndexOf::TableRows(rows),
        }),
        None => Ok(()),
    }
}

/// `(table [V, ..], ids) -> [ids.., table.dims[1..]]`: one row copy per id.
pub(super) fn embedding<A: Elem>(table: &Arg<'_>, ids: &Arg<'_>) -> Result<Value, CpuKernelError> {
    let rows = view::<A>(table, 0)?.shape().first().copied().unwrap_or(0);
    check_ids(&view::<i32>(ids, 1)?, rows)?;
    lookup::<A>(table, ids, "embedding output", |id| Some(id as usize))
}

/// The rows `row_of(id)` names of `table` (rank 2 or more), one per id, in the ids'
/// shape; zeros where it names none. `output` names the result in a message
/// (`embedding output`).
fn lookup<A: Elem>(
    table: &Arg<'_>,
    ids: &Arg<'_>,
    output: &'static str,
    row_of: impl Fn(i32) -> Option<usize>,
) -> Result<Value, CpuKernelError> {
    let table = view::<A>(table, 0)?;
    let ids = view::<i32>(ids, 1)?;
    if table.ndim() < 2 {
        return Err(CpuKernelError::Shape {
            need: ShapeNeed::TableRank,
            shape: table.shape().to_vec(),
        });
    }
    let rows = table.shape()[0];
    let row = row_len(table.shape());
    let table = table.as_standard_layout();
    let data = table
        .as_slice()
        .ok_or(CpuKernelError::NotContiguous("the table"))?;
    let mut out = vec![A::zero(); ids.len() * row];
    for (k, &id) in ids.iter().enumerate() {
        if let Some(r) = row_of(id).filter(|r| *r < rows) {
            out[k * row..(k + 1) * row].copy_from_slice(&data[r * row..(r + 1) * row]);
        }
    }
    let mut dims = ids.shape().to_vec();
    dims.extend_from_slice(&table.shape()[1..]);
    ArrayD::from_shape_vec(IxDyn(&dims), out)
        .map(val)
        .map_err(CpuKernelError::layout(output, &dims))
}

/// That `dy` (of type `A`) is a lookup's result gradient for ids of shape `ids` into
/// `table`: the ids' shape followed by a row's.
fn check_lookup_grad<A: Elem>(
    dy: &[usize],
    ids: &[usize],
    table: &TensorType,
) -> Result<(), CpuKernelError> {
    if table.dtype != A::DTYPE || table.dims().len() < 2 {
        return Err(CpuKernelError::Invalid(format!(
            "cannot take the gradient of a lookup into {table} from {}",
            A::DTYPE
        )));
    }
    let mut want = ids.to_vec();
    want.extend_from_slice(&table.dims()[1..]);
    if dy != want.as_slice() {
        return Err(CpuKernelError::LookupGrad {
            dy: dy.to_vec(),
            want,
            ids: ids.to_vec(),
            table: table.clone(),
        });
    }
    Ok(())
}

/// `(dy, ids) -> IndexedSlices`: indices are the ids flattened, values are `dy`
/// reshaped to `[nnz, table.dims[1..]]` (no copy when `dy` is owned).
pub(super) fn embedding_grad<A: Elem>(
    dy: Arg<'_>,
    ids: &Arg<'_>,
    table: &TensorType,
) -> Result<Value, CpuKernelError> {
    let ids = view::<i32>(ids, 1)?;
    let dy = cow::<A>(dy, 0)?;
    check_lookup_grad::<A>(dy.shape(), ids.shape(), table)?;
    check_ids(&ids, table.dims()[0])?;
    let indices: Vec<i32> = ids.iter().copied().collect();
    let mut vdims = vec![indices.len()];
    vdims.extend_from_slice(&table.dims()[1..]);
    let values = standard(dy)
        .into_shape_with_order(IxDyn(&vdims))
        .map_err(CpuKernelError::layout("slices values", &vdims))?;
    Ok(Value::Slices(Slices {
        indices,
        values: A::wrap(values),
        dense_shape: table.dims().to_vec(),
    }))
}

/// Input `i` as slices with values of type `A`.
pub(super) fn slices<'b, A: Elem>(
    arg: &'b Arg<'_>,
    i: usize,
) -> Result<(&'b Slices, ArrayViewD<'b, A>), CpuKernelError> {
    let s = arg.slices().ok_or_else(|| CpuKernelError::NotSlices {
        input: i,
        found: arg.describe(),
    })?;
    let values = A::of(&s.values).ok_or_else(|| CpuKernelError::ValuesDType {
        input: i,
        found: arg.describe(),
        want: A::DTYPE,
    })?;
    let mut want = vec![s.indices.len()];
    want.extend(s.dense_shape.iter().skip(1));
    if s.dense_shape.is_empty() || values.shape() != want.as_slice() {
        return Err(CpuKernelError::Invalid(format!(
            "input {i}: {} indices with values {} do not fit dense shape {}",
            s.indices.len(),
            shape_str(values.shape()),
            shape_str(&s.dense_shape)
        )));
    }
    Ok((s, values.view()))
}

/// Joins slices over one dense tensor: indices and values concatenated.
pub(super) fn concat_slices<A: Elem>(args: Vec<Arg<'_>>) -> Result<Value, CpuKernelError> {
    let parts = args
        .iter()
        .enumerate()
        .map(|(i, a)| slices::<A>(a, i))
        .collect::<Result<Vec<_>, _>>()?;
    let dense_shape = parts
        .first()
        .ok_or(CpuKernelError::NoInputs)?
        .0
        .dense_shape
        .clone();
    let nnz: usize = parts.iter().map(|(s, _)| s.indices.len()).sum();
    let row = row_len(&dense_shape);
    let mut indices = Vec::with_capacity(nnz);
    let mut values = Vec::with_capacity(nnz * row);
    for (i, (s, v)) in parts.iter().enumerate() {
        if s.dense_shape != dense_shape {
            return Err(CpuKernelError::Shapes {
                check: ShapeCheck::DenseShape(i),
                left: s.dense_shape.clone(),
                right: dense_shape,
            });
        }
        indices.extend_from_slice(&s.indices);
        let v = v.as_standard_layout();
        values.extend_from_slice(
            v.as_slice()
                .ok_or(CpuKernelError::NotContiguous("slices values"))?,
        );
    }
    let mut vdims = vec![nnz];
    vdims.extend_from_slice(&dense_shape[1..]);
    let values = ArrayD::from_shape_vec(IxDyn(&vdims), values)
        .map_err(CpuKernelError::layout("slices values", &vdims))?;
    Ok(Value::Slices(Slices {
        indices,
        values: A::wrap(values),
        dense_shape,
    }))
}

/// The dense tensor the slices stand for: zeros with each value row added to its row.
pub(super) fn densify<A: Elem>(s: &Arg<'_>) -> Result<Value, CpuKernelError> {
    let (s, values) = slices::<A>(s, 0)?;
    let rows = s.dense_shape[0];
    let row = row_len(&s.dense_shape);
    let mut out = ArrayD::<A>::zeros(IxDyn(&s.dense_shape));
    let dst = out
        .as_slice_mut()
        .ok_or(CpuKernelError::NotContiguous("a new array"))?;
    // A large table's zeros come from calloc as untouched pages. Left so, whoever reads
    // the gradient next (an all-reduce) maps the shared zero page and its first write
    // then pays a copy-on-write fault and a TLB shootdown per page: measured at 80% of
    // a 2-worker step. Writing the zeros here faults each page in once, cheaply.
    // (`black_box` keeps the compiler from dropping the store as redundant.)
    std::hint::black_box(&mut *dst).fill(A::zero());
    let values = values.as_standard_layout();
    let src = values
        .as_slice()
        .ok_or(CpuKernelError::NotContiguous("slices values"))?;
    for (k, &id) in s.indices.iter().enumerate() {
        if id < 0 || id as usize >= rows {
            return Err(CpuKernelError::Index {
                index: id,
                position: k,
                of: IndexOf::Rows(s.dense_shape.clone()),
            });
        }
        let d = &mut dst[id as usize * row..][..row];
        for (d, &v) in d.iter_mut().zip(&src[k * row..][..row]) {
            *d += v;
        }
    }
    Ok(val(out))
}

/// `IndexedSlices [R, ..] -> [R]`: 1 at every row the slices touch, 0 elsewhere.
pub(super) fn row_mask<A: Elem>(s: &Arg<'_>) -> Result<Value, CpuKernelError> {
    let (s, _) = slices::<A>(s, 0)?;
    let rows = s.dense_shape[0];
    let mut mask = vec![A::zero(); rows];
    for (k, &id) in s.indices.iter().enumerate() {
        let slot = usize::try_from(id)
            .ok()
            .and_then(|i| mask.get_mut(i))
            .ok_or_else(|| CpuKernelError::Index {
                index: id,
                position: k,
                of: IndexOf::Rows(s.dense_shape.clone()),
            })?;
        *slot = A::one();
    }
    Ok(val(ArrayD::from_shape_vec(IxDyn(&[rows]), mask)?))
}

/// `(dense [R, ..], mask [R]) -> IndexedSlices`: the rows whose mask is not zero, in
/// row order.
pub(super) fn sparsify<A: Elem>(x: &Arg<'_>, mask: &Arg<'_>) -> Result<Value, CpuKernelError> {
    let x = view::<A>(x, 0)?;
    let mask = view::<A>(mask, 1)?;
    let rows = x.shape().first().copied().unwrap_or(0);
    if x.ndim() == 0 || mask.shape() != [rows] {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::Mask,
            left: mask.shape().to_vec(),
            right: x.shape().to_vec(),
        });
    }
    let row = row_len(x.shape());
    let x = x.as_standard_layout();
    let data = x
        .as_slice()
        .ok_or(CpuKernelError::NotContiguous("the tensor"))?;
    let mut indices = Vec::new();
    let mut values = Vec::new();
    for (i, m) in mask.iter().enumerate() {
        if *m != A::zero() {
            indices.push(
                i32::try_from(i).map_err(|_| {
                    CpuKernelError::Invalid(format!("row {i} does not fit an i32 id"))
                })?,
            );
            values.extend_from_slice(&data[i * row..(i + 1) * row]);
        }
    }
    let mut vdims = vec![indices.len()];
    vdims.extend_from_slice(&x.shape()[1..]);
    let values = ArrayD::from_shape_vec(IxDyn(&vdims), values)
        .map_err(CpuKernelError::layout("slices values", &vdims))?;
    Ok(Value::Slices(Slices {
        indices,
        values: A::wrap(values),
        dense_shape: x.shape().to_vec(),
    }))
}

/// The vocabulary-parallel lookup: `table` is part `rank` of a table split by rows
/// (rows `rank * R .. (rank + 1) * R` of the whole), so each id in that range gets its
/// row and every other id zeros. Summed over the parts, the whole table's lookup.
pub(super) fn model_embedding<A: Elem>(
    table: &Arg<'_>,
    ids: &Arg<'_>,
    rank: usize,
) -> Result<Value, CpuKernelError> {
    let rows = view::<A>(table, 0)?.shape().first().copied().unwrap_or(0);
    let first = rank * rows;
    if let Some((k, id)) = view::<i32>(ids, 1)?
        .iter()
        .enumerate()
        .find(|(_, id)| **id < 0)
    {
        return Err(CpuKernelError::Index {
            index: *id,
            position: k,
            of: IndexOf::NonNegative,
        });
    }
    lookup::<A>(table, ids, "model_embedding output", |id| {
        (id as usize).checked_sub(first)
    })
}

/// The gradient of [`model_embedding`] into its table part: the ids in this part's
/// range, as local row numbers, with their rows of `dy`; other ids contribute nothing
/// (no row, so a lazily updated optimizer leaves the rows they would name alone).
pub(super) fn model_embedding_grad<A: Elem>(
    dy: Arg<'_>,
    ids: &Arg<'_>,
    table: &TensorType,
    rank: usize,
) -> Result<Value, CpuKernelError> {
    let ids = view::<i32>(ids, 1)?;
    let dy = cow::<A>(dy, 0)?;
    check_lookup_grad::<A>(dy.shape(), ids.shape(), table)?;
    let dims = table.dims();
    let (rows, row) = (dims[0], row_len(dims));
    let first = rank * rows;
    let dy = standard(dy);
    let flat = dy.as_slice().ok_or(CpuKernelError::NotContiguous("dy"))?;
    let (mut indices, mut values) = (Vec::new(), Vec::new());
    for (k, &id) in ids.iter().enumerate() {
        let local = (id.max(0) as usize).wrapping_sub(first);
        if id >= 0 && local < rows {
            indices.push(local as i32);
            values.extend_from_slice(&flat[k * row..(k + 1) * row]);
        }
    }
    let mut vdims = vec![indices.len()];
    vdims.extend_from_slice(&dims[1..]);
    let values = ArrayD::from_shape_vec(IxDyn(&vdims), values)
        .map_err(CpuKernelError::layout("slices values", &vdims))?;
    Ok(Value::Slices(Slices {
        indices,
        values: A::wrap(values),
        dense_shape: dims.to_vec(),
    }))
}
