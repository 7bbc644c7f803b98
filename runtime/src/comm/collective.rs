//! The host's collectives: one IR collective op run on a [`Communicator`], for every
//! role alike (a worker's communication thread, a pipeline stage's replicas and model
//! ranks, the init and final programs). What a device communicator (NCCL) runs on its
//! own buffers is the backend's.

use super::{
    all_reduce_wire, chunk_range, from_wire, from_wire_parts, hierarchical_all_reduce,
    reduce_scatter_wire, wire_bytes, Communicator,
};
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::Pending;
use crate::core::value::{HostElem, Slices, Tensor, Value};
use distc_ir::{DType, NodeId, Op, ReduceOp};
use ndarray::{ArrayD, IxDyn};
use zerocopy::IntoBytes;

fn shape_err(e: ndarray::ShapeError) -> RuntimeError {
    RuntimeError::plan(e.to_string())
}

/// A collective already done.
pub struct Done(pub(crate) Value);

impl Pending for Done {
    fn wait(self: Box<Self>) -> Result<Value> {
        Ok(self.0)
    }
}

/// What a communicator names when one of its operations fails or times out: the op,
/// its IR node and the step (`all_reduce %25 at step 12`), on every axis alike.
pub fn op_label(op: &Op, node: NodeId, step: u64) -> String {
    if node == NodeId(u32::MAX) {
        return format!("the {} of step {step}'s overflow check", op.mnemonic());
    }
    format!("{} {node} at step {step}", op.mnemonic())
}

/// An element type the host collectives carry: f32, the training type, and f64, a
/// float64 copy of a model (`--dtype f64`) in any layout.
pub trait HostFloat:
    HostElem + zerocopy::FromBytes + zerocopy::IntoBytes + zerocopy::Immutable
{
    /// `1 / n`.
    fn reciprocal(n: usize) -> Self;
    /// [`Communicator::all_reduce`] in this type.
    fn all_reduce(comm: &mut dyn Communicator, buf: &mut [Self], mean: bool) -> Result<()>;
    /// [`Communicator::reduce_scatter`] in this type.
    fn reduce_scatter(comm: &mut dyn Communicator, buf: &[Self], mean: bool) -> Result<Vec<Self>>;
}

impl HostFloat for f32 {
    fn reciprocal(n: usize) -> f32 {
        1.0 / n as f32
    }
    fn all_reduce(comm: &mut dyn Communicator, buf: &mut [f32], mean: bool) -> Result<()> {
        comm.all_reduce(buf, mean)
    }
    fn reduce_scatter(comm: &mut dyn Communicator, buf: &[f32], mean: bool) -> Result<Vec<f32>> {
        comm.reduce_scatter(buf, mean)
    }
}

impl HostFloat for f64 {
    fn reciprocal(n: usize) -> f64 {
        1.0 / n as f64
    }
    fn all_reduce(comm: &mut dyn Communicator, buf: &mut [f64], mean: bool) -> Result<()> {
        comm.all_reduce_f64(buf, mean)
    }
    /// A whole all-reduce, this rank's chunk kept: float64 copies check layouts, they
    /// are not the path to be fast on.
    fn reduce_scatter(comm: &mut dyn Communicator, buf: &[f64], mean: bool) -> Result<Vec<f64>> {
        let mut all = buf.to_vec();
        comm.all_reduce_f64(&mut all, mean)?;
        Ok(all[chunk_range(all.len(), comm.size(), comm.rank())].to_vec())
    }
}

/// Runs one collective over the model axis: a sum, the sum's shard of this rank, or the
/// shards concatenated along their split dimension in rank order. `label` names it
/// ([`op_label`]) for a failure or a timeout.
pub fn model_collective(
    comm: &mut dyn Communicator,
    op: &Op,
    value: Value,
    label: &str,
) -> Result<Value> {
    comm.set_label(label);
    match value {
        Value::Tensor(Tensor::F32(a)) => Ok(Value::Tensor(Tensor::F32(model_collective_of(
            comm, op, a,
        )?))),
        Value::Tensor(Tensor::F64(a)) => Ok(Value::Tensor(Tensor::F64(model_collective_of(
            comm, op, a,
        )?))),
        _ => Err(RuntimeError::plan(format!(
            "{op} of a value that is neither f32 nor f64"
        ))),
    }
}

fn model_collective_of<T: HostFloat>(
    comm: &mut dyn Communicator,
    op: &Op,
    mut a: ArrayD<T>,
) -> Result<ArrayD<T>> {
    let n = comm.size();
    match op {
        Op::ModelAllReduce { parts }
        | Op::ModelGather { parts, .. }
        | Op::ModelReduceScatter { parts, .. }
            if *parts != n =>
        {
            Err(RuntimeError::plan(format!(
                "{op} for {parts} workers on a model axis of {n}"
            )))
        }
        Op::ModelAllReduce { .. } => {
            let mut a = a.as_standard_layout().into_owned();
            let buf = a.as_slice_mut().ok_or_else(|| {
                RuntimeError::internal(
                    "model_all_reduce",
                    "model_all_reduce of a non-contiguous tensor",
                )
            })?;
            T::all_reduce(comm, buf, false)?;
            Ok(a)
        }
        Op::ModelReduceScatter { dim, .. } => {
            // With `dim` leading, each rank's shard is one contiguous chunk of the sum.
            let rank = a.ndim();
            let mut perm: Vec<usize> = vec![*dim];
            perm.extend((0..rank).filter(|k| k != dim));
            let moved = a
                .permuted_axes(IxDyn(&perm))
                .as_standard_layout()
                .into_owned();
            let mut shape = moved.shape().to_vec();
            if !shape[0].is_multiple_of(n) {
                return Err(RuntimeError::plan(format!(
                    "{op} of a value whose dimension {dim} ({}) does not split into {n}",
                    shape[0]
                )));
            }
            let flat: Vec<T> = moved.iter().copied().collect();
            let mine = T::reduce_scatter(comm, &flat, false)?;
            shape[0] /= n;
            let part = ArrayD::from_shape_vec(IxDyn(&shape), mine).map_err(shape_err)?;
            let mut back = vec![0; rank];
            for (k, p) in perm.iter().enumerate() {
                back[*p] = k;
            }
            Ok(part
                .permuted_axes(IxDyn(&back))
                .as_standard_layout()
                .into_owned())
        }
        Op::ModelGather { dim, .. } => {
            a = a.as_standard_layout().into_owned();
            let shape = a.shape().to_vec();
            let mine = wire_bytes(a.as_slice().unwrap_or_default());
            let parts = comm
                .all_gather(mine)?
                .into_iter()
                .map(|p| {
                    ArrayD::from_shape_vec(IxDyn(&shape), from_wire::<T>(&p)).map_err(shape_err)
                })
                .collect::<Result<Vec<_>>>()?;
            let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
            ndarray::concatenate(ndarray::Axis(*dim), &views).map_err(shape_err)
        }
        _ => Err(RuntimeError::plan(format!(
            "{op} is not a model-axis collective"
        ))),
    }
}

/// ZeRO's reduce-scatter of `a` in its own type: this rank's chunk of the flat sum (or
/// mean), the chunks padded to equal parts.
fn reduce_scatter_of<T: HostFloat>(
    comm: &mut dyn Communicator,
    a: ArrayD<T>,
    workers: usize,
    mean: bool,
) -> Result<Tensor> {
    let n = comm.size();
    if workers != n {
        return Err(RuntimeError::plan(format!(
            "reduce_scatter for {workers} workers on a communicator of {n}"
        )));
    }
    let mut flat = flat_vec(a);
    let c = flat.len().div_ceil(n);
    flat.resize(c * n, T::default());
    let mine = T::reduce_scatter(comm, &flat, mean)?;
    Ok(T::tensor(
        ArrayD::from_shape_vec(IxDyn(&[c]), mine).map_err(shape_err)?,
    ))
}

/// ZeRO's all-gather of this rank's chunk `a` into the whole of `shape`.
fn all_gather_dense_of<T: HostFloat>(
    comm: &mut dyn Communicator,
    a: ArrayD<T>,
    workers: usize,
    shape: &distc_ir::Shape,
) -> Result<Tensor> {
    let n = comm.size();
    if workers != n {
        return Err(RuntimeError::plan(format!(
            "all_gather_dense for {workers} workers on a communicator of {n}"
        )));
    }
    let a = a.as_standard_layout();
    let mine = wire_bytes(a.as_slice().unwrap_or_default());
    let total: usize = shape.dims().iter().product();
    let mut whole = from_wire_parts::<T, _>(&comm.all_gather(mine)?);
    whole.truncate(total);
    Ok(T::tensor(
        ArrayD::from_shape_vec(IxDyn(shape.dims()), whole).map_err(shape_err)?,
    ))
}

/// The rows of every rank's slices `values` (each row an 8-byte id and its values on
/// the wire), in rank order, scaled by `scale`.
fn all_gather_rows_of<T: HostFloat>(
    comm: &mut dyn Communicator,
    indices: &[i32],
    values: &ArrayD<T>,
    dense_shape: &[usize],
    scale: T,
) -> Result<(Vec<i32>, Tensor)> {
    let row: usize = dense_shape[1..].iter().product();
    let width = std::mem::size_of::<T>();
    let mut mine = Vec::with_capacity(indices.len() * (8 + width * row));
    let flat = values.as_standard_layout();
    let flat = flat
        .as_slice()
        .ok_or_else(|| RuntimeError::internal("all_gather", "slices values are not contiguous"))?;
    for (k, &id) in indices.iter().enumerate() {
        mine.extend_from_slice(&i64::from(id).to_le_bytes());
        mine.extend_from_slice(flat[k * row..(k + 1) * row].as_bytes());
    }
    let parts = comm.all_gather(mine)?;
    let (mut ids, mut vals) = (Vec::new(), Vec::new());
    for p in parts {
        for rec in p.chunks_exact(8 + width * row) {
            let mut id = [0u8; 8];
            id.copy_from_slice(&rec[..8]);
            ids.push(i64::from_le_bytes(id) as i32);
            vals.extend(from_wire::<T>(&rec[8..]).into_iter().map(|x| x * scale));
        }
    }
    let mut dims = vec![ids.len()];
    dims.extend_from_slice(&dense_shape[1..]);
    let values = ArrayD::from_shape_vec(IxDyn(&dims), vals).map_err(shape_err)?;
    Ok((ids, T::tensor(values)))
}

/// `a` as rank `root` holds it, on every rank: its elements broadcast as their wire
/// bytes.
fn broadcast_array<T>(comm: &mut dyn Communicator, a: &ArrayD<T>, root: usize) -> Result<ArrayD<T>>
where
    T: Clone + zerocopy::FromBytes + zerocopy::IntoBytes + zerocopy::Immutable,
{
    let a = a.as_standard_layout();
    let mut bytes = wire_bytes(a.as_slice().unwrap_or_default());
    comm.broadcast(&mut bytes, root)?;
    ArrayD::from_shape_vec(IxDyn(a.shape()), from_wire::<T>(&bytes)).map_err(shape_err)
}

/// Runs one collective on a communicator.
pub fn collective(comm: &mut dyn Communicator, op: &Op, value: Value) -> Result<Value> {
    let n = comm.size();
    match (op, value) {
        // A 16-bit gradient wire (`--grad-wire`).
        (Op::AllReduce { reduce, .. }, Value::Tensor(t)) if t.dtype().is_half() => {
            let wire = t.dtype();
            let wide = t.cast(DType::F32).and_then(|w| w.as_f32().cloned());
            let Some(mut a) = wide.map(|a| a.as_standard_layout().into_owned()) else {
                return Err(RuntimeError::plan(format!("all_reduce of {wire}")));
            };
            let buf = a.as_slice_mut().ok_or_else(|| {
                RuntimeError::internal("all_reduce", "all_reduce of a non-contiguous tensor")
            })?;
            all_reduce_wire(comm, buf, *reduce == ReduceOp::Mean, wire)?;
            let back = Tensor::F32(a)
                .cast(wire)
                .ok_or_else(|| RuntimeError::plan(format!("all_reduce: cannot round to {wire}")))?;
            Ok(Value::Tensor(back))
        }
        (
            Op::AllReduce {
                reduce,
                ranks_per_node,
            },
            Value::Tensor(Tensor::F32(mut a)),
        ) => {
            let buf = a.as_slice_mut().ok_or_else(|| {
                RuntimeError::internal("all_reduce", "all_reduce of a non-contiguous tensor")
            })?;
            let mean =
                *reduce == ReduceOp::Mean && !crate::core::planted::Planted::AllReduceMean.here();
            if *ranks_per_node > 1 {
                hierarchical_all_reduce(comm, buf, mean, *ranks_per_node)?;
            } else {
                comm.all_reduce(buf, mean)?;
            }
            Ok(Value::Tensor(Tensor::F32(a)))
        }
        (Op::AllReduce { reduce, .. }, Value::Tensor(Tensor::F64(mut a))) => {
            let buf = a.as_slice_mut().ok_or_else(|| {
                RuntimeError::internal("all_reduce", "all_reduce of a non-contiguous tensor")
            })?;
            comm.all_reduce_f64(buf, *reduce == ReduceOp::Mean)?;
            Ok(Value::Tensor(Tensor::F64(a)))
        }
        (Op::Broadcast { root }, Value::Tensor(Tensor::F32(a))) => Ok(Value::Tensor(Tensor::F32(
            broadcast_array(comm, &a, *root)?,
        ))),
        // f64 programs (gradient checks, float64 parity runs) start alike on every rank.
        (Op::Broadcast { root }, Value::Tensor(Tensor::F64(a))) => Ok(Value::Tensor(Tensor::F64(
            broadcast_array(comm, &a, *root)?,
        ))),
        // ZeRO's reduce-scatter on a 16-bit wire: its chunks padded to equal parts.
        (Op::ReduceScatter { workers, reduce }, Value::Tensor(t)) if t.dtype().is_half() => {
            if *workers != n {
                return Err(RuntimeError::plan(format!(
                    "reduce_scatter for {workers} workers on a communicator of {n}"
                )));
            }
            let wire = t.dtype();
            let Some(a) = t.cast(DType::F32).and_then(|w| w.as_f32().cloned()) else {
                return Err(RuntimeError::plan(format!("reduce_scatter of {wire}")));
            };
            let mut flat = flat_vec(a);
            let c = flat.len().div_ceil(n);
            flat.resize(c * n, 0.0);
            let mine = reduce_scatter_wire(comm, &mut flat, *reduce == ReduceOp::Mean, wire)?;
            let part = ArrayD::from_shape_vec(IxDyn(&[c]), mine).map_err(shape_err)?;
            let back = Tensor::F32(part).cast(wire).ok_or_else(|| {
                RuntimeError::plan(format!("reduce_scatter: cannot round to {wire}"))
            })?;
            Ok(Value::Tensor(back))
        }
        (Op::ReduceScatter { workers, reduce }, Value::Tensor(t)) => {
            let mean = *reduce == ReduceOp::Mean;
            match t {
                Tensor::F32(a) => Ok(Value::Tensor(reduce_scatter_of(comm, a, *workers, mean)?)),
                Tensor::F64(a) => Ok(Value::Tensor(reduce_scatter_of(comm, a, *workers, mean)?)),
                t => Err(RuntimeError::plan(format!(
                    "reduce_scatter of {}",
                    t.dtype()
                ))),
            }
        }
        (Op::AllGatherDense { workers, shape }, Value::Tensor(t)) => match t {
            Tensor::F32(a) => Ok(Value::Tensor(all_gather_dense_of(
                comm, a, *workers, shape,
            )?)),
            Tensor::F64(a) => Ok(Value::Tensor(all_gather_dense_of(
                comm, a, *workers, shape,
            )?)),
            t => Err(RuntimeError::plan(format!(
                "all_gather_dense of {}",
                t.dtype()
            ))),
        },
        (Op::AllGather { reduce, .. }, Value::Slices(s)) => {
            let mean = *reduce == ReduceOp::Mean;
            let (indices, values) = match &s.values {
                Tensor::F32(v) => {
                    let scale = if mean { f32::reciprocal(n) } else { 1.0 };
                    all_gather_rows_of(comm, &s.indices, v, &s.dense_shape, scale)?
                }
                Tensor::F64(v) => {
                    let scale = if mean { f64::reciprocal(n) } else { 1.0 };
                    all_gather_rows_of(comm, &s.indices, v, &s.dense_shape, scale)?
                }
                t => {
                    return Err(RuntimeError::plan(format!(
                        "all_gather of {} slices",
                        t.dtype()
                    )))
                }
            };
            Ok(Value::Slices(Slices {
                indices,
                values,
                dense_shape: s.dense_shape,
            }))
        }
        (op, v) => Err(RuntimeError::plan(format!(
            "{} of {} is not supported",
            op.mnemonic(),
            v.value_type()
        ))),
    }
}

/// `a`'s elements in order as one vector: its own buffer, without a copy, when it is
/// laid out in order already.
fn flat_vec<T: Clone>(a: ArrayD<T>) -> Vec<T> {
    if !a.is_standard_layout() {
        return a.iter().cloned().collect();
    }
    let n = a.len();
    let (mut v, offset) = a.into_raw_vec_and_offset();
    let offset = offset.unwrap_or(0);
    v.truncate(offset + n);
    v.drain(..offset);
    v
}
