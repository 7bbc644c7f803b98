//! The host's collectives: one IR collective op run on a [`Communicator`], for every
//! role alike (a worker's communication thread, a pipeline stage's replicas and model
//! ranks, the init and final programs). What a device communicator (NCCL) runs on its
//! own buffers is the backend's.

use super::{
    all_reduce_wire, from_wire, from_wire_parts, hierarchical_all_reduce, reduce_scatter_wire,
    wire_bytes, Communicator,
};
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::Pending;
use crate::core::value::{Slices, Tensor, Value};
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
    let n = comm.size();
    let Value::Tensor(Tensor::F32(mut a)) = value else {
        return Err(RuntimeError::plan(format!(
            "{op} of a value that is not f32"
        )));
    };
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
            comm.all_reduce(buf, false)?;
            Ok(Value::Tensor(Tensor::F32(a)))
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
            if shape[0] % n != 0 {
                return Err(RuntimeError::plan(format!(
                    "{op} of a value whose dimension {dim} ({}) does not split into {n}",
                    shape[0]
                )));
            }
            let flat: Vec<f32> = moved.iter().copied().collect();
            let mine = comm.reduce_scatter(&flat, false)?;
            shape[0] /= n;
            let part = ArrayD::from_shape_vec(IxDyn(&shape), mine).map_err(shape_err)?;
            let mut back = vec![0; rank];
            for (k, p) in perm.iter().enumerate() {
                back[*p] = k;
            }
            let part = part
                .permuted_axes(IxDyn(&back))
                .as_standard_layout()
                .into_owned();
            Ok(Value::Tensor(Tensor::F32(part)))
        }
        Op::ModelGather { dim, .. } => {
            a = a.as_standard_layout().into_owned();
            let shape = a.shape().to_vec();
            let mine = wire_bytes(a.as_slice().unwrap_or_default());
            let parts = comm
                .all_gather(mine)?
                .into_iter()
                .map(|p| {
                    ArrayD::from_shape_vec(IxDyn(&shape), from_wire::<f32>(&p)).map_err(shape_err)
                })
                .collect::<Result<Vec<_>>>()?;
            let views: Vec<_> = parts.iter().map(|p| p.view()).collect();
            let whole = ndarray::concatenate(ndarray::Axis(*dim), &views).map_err(shape_err)?;
            Ok(Value::Tensor(Tensor::F32(whole)))
        }
        _ => Err(RuntimeError::plan(format!(
            "{op} is not a model-axis collective"
        ))),
    }
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
            let mean = *reduce == ReduceOp::Mean;
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
        (Op::ReduceScatter { workers, reduce }, Value::Tensor(Tensor::F32(a))) => {
            if *workers != n {
                return Err(RuntimeError::plan(format!(
                    "reduce_scatter for {workers} workers on a communicator of {n}"
                )));
            }
            let mut flat = flat_vec(a);
            let c = flat.len().div_ceil(n);
            flat.resize(c * n, 0.0);
            let mine = comm.reduce_scatter(&flat, *reduce == ReduceOp::Mean)?;
            Ok(Value::Tensor(Tensor::F32(
                ArrayD::from_shape_vec(IxDyn(&[c]), mine).map_err(shape_err)?,
            )))
        }
        (Op::AllGatherDense { workers, shape }, Value::Tensor(Tensor::F32(a))) => {
            if *workers != n {
                return Err(RuntimeError::plan(format!(
                    "all_gather_dense for {workers} workers on a communicator of {n}"
                )));
            }
            let a = a.as_standard_layout();
            let mine = wire_bytes(a.as_slice().unwrap_or_default());
            let total: usize = shape.dims().iter().product();
            let mut whole = from_wire_parts::<f32, _>(&comm.all_gather(mine)?);
            whole.truncate(total);
            Ok(Value::Tensor(Tensor::F32(
                ArrayD::from_shape_vec(IxDyn(shape.dims()), whole).map_err(shape_err)?,
            )))
        }
        (Op::AllGather { reduce, .. }, Value::Slices(s)) => {
            let Tensor::F32(values) = &s.values else {
                return Err(RuntimeError::plan("all_gather of non-f32 slices"));
            };
            let row: usize = s.dense_shape[1..].iter().product();
            // On the wire: an 8-byte row id and the row's values, per row.
            let mut mine = Vec::with_capacity(s.indices.len() * (8 + 4 * row));
            let flat = values.as_standard_layout();
            let flat = flat.as_slice().ok_or_else(|| {
                RuntimeError::internal("all_gather", "slices values are not contiguous")
            })?;
            for (k, &id) in s.indices.iter().enumerate() {
                mine.extend_from_slice(&i64::from(id).to_le_bytes());
                mine.extend_from_slice(flat[k * row..(k + 1) * row].as_bytes());
            }
            let parts = comm.all_gather(mine)?;
            let scale = if *reduce == ReduceOp::Mean {
                1.0 / n as f32
            } else {
                1.0
            };
            let (mut indices, mut vals) = (Vec::new(), Vec::new());
            for p in parts {
                for rec in p.chunks_exact(8 + 4 * row) {
                    let mut id = [0u8; 8];
                    id.copy_from_slice(&rec[..8]);
                    indices.push(i64::from_le_bytes(id) as i32);
                    vals.extend(
                        rec[8..]
                            .chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * scale),
                    );
                }
            }
            let mut dims = vec![indices.len()];
            dims.extend_from_slice(&s.dense_shape[1..]);
            let values = ArrayD::from_shape_vec(IxDyn(&dims), vals).map_err(shape_err)?;
            Ok(Value::Slices(Slices {
                indices,
                values: Tensor::F32(values),
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
