//! Shape rules: the result types of an op from its input types. One `match` over [`Op`].

use crate::op::Op;
use crate::types::{DType, Shape, TensorType, ValueType};
use thiserror::Error;

/// An op applied to inputs of types it does not accept.
#[derive(Clone, Debug, PartialEq, Error)]
#[error("{op}: {message}")]
pub struct ShapeError {
    /// The op's mnemonic.
    pub op: &'static str,
    /// What is wrong, naming the shapes involved.
    pub message: String,
}

/// Numpy broadcasting of two shapes, or `None` when they do not broadcast.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// The result of attending `q [.., Tq, D]` over `k [.., Tk, D]`, `v [.., Tk, Dv]`:
/// `[.., Tq, Dv]`.
pub fn attention_shape(
    q: &TensorType,
    k: &TensorType,
    v: &TensorType,
) -> Result<TensorType, String> {
    if !q.dtype.is_float() || k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(format!(
            "q, k and v must be of one float type, got {q}, {k} and {v}"
        ));
    }
    let r = q.shape.rank();
    if r < 2 || k.shape.rank() != r || v.shape.rank() != r {
        return Err(format!(
            "q, k and v must be of one rank, 2 or more ([batch.., T, D]), got {q}, {k} and {v}"
        ));
    }
    let (qd, kd, vd) = (q.dims(), k.dims(), v.dims());
    if qd[..r - 2] != kd[..r - 2] || qd[..r - 2] != vd[..r - 2] {
        return Err(format!(
            "the leading (batch, head) dimensions of q, k and v differ: {q}, {k} and {v}"
        ));
    }
    if qd[r - 1] != kd[r - 1] {
        return Err(format!(
            "q and k must have one feature size (last dimension), got {q} and {k}"
        ));
    }
    if kd[r - 2] != vd[r - 2] {
        return Err(format!("k and v must have one length (T), got {k} and {v}"));
    }
    let mut dims = qd.to_vec();
    dims[r - 1] = vd[r - 1];
    Ok(TensorType::new(q.dtype, dims))
}

/// Whether `from` broadcasts to exactly `to`.
pub fn broadcasts_to(from: &[usize], to: &[usize]) -> bool {
    broadcast_shapes(from, to).as_deref() == Some(to)
}

/// The result types of `op` applied to inputs of types `inputs`.
pub fn infer(op: &Op, inputs: &[&ValueType]) -> Result<Vec<ValueType>, ShapeError> {
    let name = op.mnemonic();
    let err = |message: String| ShapeError { op: name, message };
    match op.arity() {
        Some(n) if inputs.len() != n => {
            return Err(err(format!("takes {n} inputs, got {}", inputs.len())))
        }
        None if inputs.is_empty() => return Err(err("takes at least one input".into())),
        _ => {}
    }
    // Only ops that know about IndexedSlices may see them.
    let sparse_ok = matches!(
        op,
        Op::ConcatSlices
            | Op::Densify
            | Op::RowMask
            | Op::ParamGrad { .. }
            | Op::Output { .. }
            | Op::AllGather { .. }
            | Op::Accumulate { .. }
            | Op::UniqueRows
            | Op::SparsePush { .. }
    );
    let mut dense = Vec::with_capacity(inputs.len());
    for (i, t) in inputs.iter().enumerate() {
        match t {
            ValueType::Tensor(t) => dense.push(t),
            ValueType::IndexedSlices { .. } if sparse_ok => {}
            ValueType::IndexedSlices { .. } => {
                return Err(err(format!("input {i} is {t}, a dense tensor is needed")))
            }
        }
    }
    let float = |i: usize| -> Result<&TensorType, ShapeError> {
        let t = dense[i];
        if t.dtype.is_float() {
            Ok(t)
        } else {
            Err(err(format!("input {i} is {t}, a float tensor is needed")))
        }
    };
    let same_float = |a: usize, b: usize| -> Result<(), ShapeError> {
        let (x, y) = (float(a)?, float(b)?);
        if x.dtype != y.dtype {
            return Err(err(format!("dtypes differ: {x} and {y}")));
        }
        Ok(())
    };
    let same_type = |a: usize, b: usize| -> Result<TensorType, ShapeError> {
        same_float(a, b)?;
        if dense[a].shape != dense[b].shape {
            return Err(err(format!("shapes differ: {} and {}", dense[a], dense[b])));
        }
        Ok(dense[a].clone())
    };
    let axis_ok = |t: &TensorType, axis: usize| -> Result<(), ShapeError> {
        if axis >= t.shape.rank() {
            Err(err(format!("axis {axis} is out of range for {t}")))
        } else {
            Ok(())
        }
    };
    let one = |t: TensorType| Ok(vec![ValueType::Tensor(t)]);
    match op {
        Op::Input { ty, .. }
        | Op::Param { ty, .. }
        | Op::Constant { ty, .. }
        | Op::Pull { ty, .. }
        | Op::Shard { ty, .. }
        | Op::Recv { ty, .. } => one(ty.clone()),
        Op::AllReduce { .. } | Op::Broadcast { .. } => one(float(0)?.clone()),
        Op::ModelEnter { parts } | Op::ModelAllReduce { parts } => {
            if *parts == 0 {
                return Err(err("needs at least one worker on the model axis".into()));
            }
            one(float(0)?.clone())
        }
        Op::ModelGather { dim, parts }
        | Op::ModelSplit { dim, parts }
        | Op::ModelReduceScatter { dim, parts } => {
            let t = float(0)?;
            axis_ok(t, *dim)?;
            let mut dims = t.dims().to_vec();
            if *parts == 0 {
                return Err(err("needs at least one worker on the model axis".into()));
            }
            if matches!(op, Op::ModelGather { .. }) {
                dims[*dim] = dims[*dim].checked_mul(*parts).ok_or_else(|| {
                    err(format!("{parts} parts of dimension {dim} of {t} overflow"))
                })?;
            } else if dims[*dim] % parts != 0 {
                return Err(err(format!(
                    "dimension {dim} of {t} does not split into {parts} equal parts"
                )));
            } else {
                dims[*dim] /= parts;
            }
            one(TensorType::new(t.dtype, Shape(dims)))
        }
        Op::ReduceScatter { workers, .. } | Op::TakeChunk { workers } => {
            let t = float(0)?;
            if *workers == 0 {
                return Err(err("needs at least one worker".into()));
            }
            let n: usize = t.dims().iter().product();
            one(TensorType::new(t.dtype, Shape(vec![n.div_ceil(*workers)])))
        }
        Op::AllGatherDense { workers, shape } => {
            let t = float(0)?;
            let n: usize = shape.dims().iter().product();
            if *workers == 0 || t.dims() != [n.div_ceil(*workers)] {
                return Err(err(format!(
                    "{t} is not one of {workers} chunks of {}",
                    TensorType::new(t.dtype, shape.clone())
                )));
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::AllGather { workers, .. } => match inputs[0] {
            ValueType::IndexedSlices { dense, nnz } if *workers >= 1 => {
                let rows: Vec<usize> = std::iter::once(nnz.saturating_mul(*workers))
                    .chain(dense.dims().iter().skip(1).copied())
                    .collect();
                Shape::check_size(&rows).map_err(err)?;
                Ok(vec![ValueType::IndexedSlices {
                    dense: dense.clone(),
                    nnz: nnz * workers,
                }])
            }
            t => Err(err(format!(
                "needs IndexedSlices and at least one worker, got {t}"
            ))),
        },
        Op::Accumulate { micro } => match inputs[0] {
            _ if *micro == 0 => Err(err("needs at least one micro-batch".into())),
            ValueType::IndexedSlices { dense, nnz } => Ok(vec![ValueType::IndexedSlices {
                dense: dense.clone(),
                nnz: nnz * micro,
            }]),
            ValueType::Tensor(t) if t.dtype.is_float() => one(t.clone()),
            t => Err(err(format!("accumulates float gradients, got {t}"))),
        },
        Op::UniqueRows => match inputs[0] {
            ValueType::IndexedSlices { dense, nnz } => Ok(vec![ValueType::IndexedSlices {
                dense: dense.clone(),
                nnz: (*nnz).min(dense.dims().first().copied().unwrap_or(0)),
            }]),
            t => Err(err(format!("input {t} is dense, IndexedSlices are needed"))),
        },
        Op::Pack => {
            let first = float(0)?;
            let mut total = 0;
            for t in &dense {
                if t.dtype != first.dtype {
                    return Err(err(format!("dtypes differ: {first} and {t}")));
                }
                total += t.shape.numel();
            }
            one(TensorType::new(first.dtype, vec![total]))
        }
        Op::PackChunks { workers } => {
            let first = float(0)?;
            if *workers == 0 {
                return Err(err("needs at least one worker".into()));
            }
            let mut chunks = 0;
            for t in &dense {
                if t.dtype != first.dtype {
                    return Err(err(format!("dtypes differ: {first} and {t}")));
                }
                chunks += t.shape.numel().div_ceil(*workers);
            }
            one(TensorType::new(first.dtype, vec![chunks * workers]))
        }
        Op::UnpackChunks { workers, shapes } => {
            let t = float(0)?;
            let chunks: usize = shapes
                .iter()
                .map(|s| s.numel().div_ceil((*workers).max(1)))
                .sum();
            if *workers == 0 || t.dims() != [chunks * workers] {
                return Err(err(format!(
                    "{t} is not {workers} workers' chunks of {} values ({} elements)",
                    shapes.len(),
                    chunks * workers
                )));
            }
            Ok(shapes
                .iter()
                .map(|s| TensorType::new(t.dtype, s.clone()).into())
                .collect())
        }
        Op::Unpack { shapes } => {
            let t = float(0)?;
            let total: usize = shapes.iter().map(|s| s.numel()).sum();
            if t.dims() != [total] {
                return Err(err(format!(
                    "{t} does not hold {total} elements in one axis"
                )));
            }
            Ok(shapes
                .iter()
                .map(|s| TensorType::new(t.dtype, s.clone()).into())
                .collect())
        }
        Op::SparsePull { table, .. } => {
            let ids = dense[0];
            if ids.dtype != DType::I32 {
                return Err(err(format!("ids must be i32, got {ids}")));
            }
            let mut dims = ids.dims().to_vec();
            dims.extend_from_slice(&table.dims()[1..]);
            one(TensorType::new(table.dtype, dims))
        }
        Op::Push { .. } => {
            float(0)?;
            Ok(vec![])
        }
        Op::SparsePush { .. } => match inputs[0] {
            ValueType::IndexedSlices { .. } => Ok(vec![]),
            t => Err(err(format!("input {t} is dense, IndexedSlices are needed"))),
        },
        Op::Serve { .. } => Ok(vec![]),
        // Dense only: slices are refused with the other dense-only ops above.
        Op::Send { .. } => Ok(vec![]),
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            same_float(0, 1)?;
            let (a, b) = (dense[0], dense[1]);
            let (ra, rb) = (a.shape.rank(), b.shape.rank());
            if ra < 2 || rb < 2 {
                return Err(err(format!(
                    "needs operands of rank 2 or more, got {a} and {b}"
                )));
            }
            let (ad, bd) = (a.dims(), b.dims());
            let (m, k1) = if *transpose_a {
                (ad[ra - 1], ad[ra - 2])
            } else {
                (ad[ra - 2], ad[ra - 1])
            };
            let (k2, n) = if *transpose_b {
                (bd[rb - 1], bd[rb - 2])
            } else {
                (bd[rb - 2], bd[rb - 1])
            };
            if k1 != k2 {
                return Err(err(format!(
                    "inner dimensions differ: {a}{} @ {b}{} ({k1} vs {k2})",
                    if *transpose_a { "ᵀ" } else { "" },
                    if *transpose_b { "ᵀ" } else { "" },
                )));
            }
            // numpy's matmul: the dimensions before the last two are a batch, broadcast.
            let Some(mut dims) = broadcast_shapes(&ad[..ra - 2], &bd[..rb - 2]) else {
                return Err(err(format!(
                    "batch dimensions {:?} and {:?} of {a} @ {b} do not broadcast",
                    &ad[..ra - 2],
                    &bd[..rb - 2]
                )));
            };
            dims.extend([m, n]);
            one(TensorType::new(a.dtype, dims))
        }
        Op::Add | Op::Sub | Op::Mul | Op::Div => {
            same_float(0, 1)?;
            let (a, b) = (dense[0], dense[1]);
            match broadcast_shapes(a.dims(), b.dims()) {
                Some(s) => one(TensorType::new(a.dtype, s)),
                None => Err(err(format!("shapes {a} and {b} do not broadcast"))),
            }
        }
        Op::Neg
        | Op::Relu
        | Op::Sigmoid
        | Op::Tanh
        | Op::Exp
        | Op::Log
        | Op::ReplicaReduce { .. } => one(float(0)?.clone()),
        Op::TrainOrEval => {
            let (a, b) = (float(0)?, float(1)?);
            if a != b {
                return Err(err(format!(
                    "its training value is {a}, its evaluation value {b}: they must be one type"
                )));
            }
            one(a.clone())
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            let t = float(0)?;
            axis_ok(t, *axis)?;
            one(t.clone())
        }
        Op::Sum { axes, keep_dims } | Op::Mean { axes, keep_dims } => {
            let t = float(0)?;
            for w in axes.windows(2) {
                if w[0] >= w[1] {
                    return Err(err(format!("axes {axes:?} must be sorted and distinct")));
                }
            }
            for &a in axes {
                axis_ok(t, a)?;
            }
            let mut dims = Vec::new();
            for (i, &d) in t.dims().iter().enumerate() {
                if axes.contains(&i) {
                    if *keep_dims {
                        dims.push(1);
                    }
                } else {
                    dims.push(d);
                }
            }
            one(TensorType::new(t.dtype, dims))
        }
        Op::Cast { to } => {
            let t = float(0)?;
            if !to.is_float() {
                return Err(err(format!("casts to {to}: a float type is needed")));
            }
            one(TensorType::new(*to, t.shape.clone()))
        }
        Op::Reshape { shape } => {
            let t = dense[0];
            if shape.numel() != t.shape.numel() {
                return Err(err(format!(
                    "cannot reshape {t} ({} elements) to {shape} ({} elements)",
                    t.shape.numel(),
                    shape.numel()
                )));
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::Transpose { perm } => {
            let t = dense[0];
            let mut seen = vec![false; t.shape.rank()];
            if perm.len() != t.shape.rank() {
                return Err(err(format!("permutation {perm:?} does not fit {t}")));
            }
            for &p in perm {
                if p >= seen.len() || seen[p] {
                    return Err(err(format!(
                        "{perm:?} is not a permutation of the axes of {t}"
                    )));
                }
                seen[p] = true;
            }
            one(TensorType::new(
                t.dtype,
                perm.iter().map(|&p| t.dims()[p]).collect::<Vec<_>>(),
            ))
        }
        Op::Concat { axis } => {
            let first = dense[0];
            axis_ok(first, *axis)?;
            let mut dims = first.dims().to_vec();
            for t in &dense[1..] {
                let same_other = t.shape.rank() == first.shape.rank()
                    && t.dims()
                        .iter()
                        .zip(first.dims())
                        .enumerate()
                        .all(|(i, (x, y))| i == *axis || x == y);
                if t.dtype != first.dtype || !same_other {
                    return Err(err(format!("{t} and {first} differ outside axis {axis}")));
                }
                dims[*axis] += t.dims()[*axis];
            }
            one(TensorType::new(first.dtype, dims))
        }
        Op::Slice { axis, start, end } => {
            let t = dense[0];
            axis_ok(t, *axis)?;
            if start >= end || *end > t.dims()[*axis] {
                return Err(err(format!(
                    "range {start}..{end} is empty or outside axis {axis} of {t}"
                )));
            }
            let mut dims = t.dims().to_vec();
            dims[*axis] = end - start;
            one(TensorType::new(t.dtype, dims))
        }
        Op::Embedding | Op::ModelEmbedding { .. } => {
            let (table, ids) = (float(0)?, dense[1]);
            if table.shape.rank() < 2 {
                return Err(err(format!(
                    "the table must have rank 2 or more, got {table}"
                )));
            }
            if ids.dtype != DType::I32 {
                return Err(err(format!("ids must be i32, got {ids}")));
            }
            let mut dims = ids.dims().to_vec();
            dims.extend_from_slice(&table.dims()[1..]);
            one(TensorType::new(table.dtype, dims))
        }
        Op::SoftmaxCrossEntropy => {
            let (logits, labels) = (float(0)?, dense[1]);
            check_sce(logits, labels).map_err(err)?;
            one(TensorType::new(logits.dtype, Shape::scalar()))
        }
        Op::Mse => {
            let t = same_type(0, 1)?;
            one(TensorType::new(t.dtype, Shape::scalar()))
        }
        Op::Dropout { rate, .. } | Op::DropoutGrad { rate, .. } => {
            if !(0.0..1.0).contains(rate) {
                return Err(err(format!("rate {rate} is not in [0, 1)")));
            }
            one(float(0)?.clone())
        }
        Op::LayerNorm { .. } => {
            let x = float(0)?;
            same_float(0, 1)?;
            same_float(0, 2)?;
            let last = match x.dims().last() {
                Some(&d) => d,
                None => return Err(err(format!("needs rank 1 or more, got {x}"))),
            };
            for t in [dense[1], dense[2]] {
                if t.dims() != [last] {
                    return Err(err(format!(
                        "gamma and beta must be [{last}] for {x}, got {t}"
                    )));
                }
            }
            one(x.clone())
        }
        Op::Fused { expr } => {
            expr.check(dense.len()).map_err(err)?;
            let mut shape: Vec<usize> = Vec::new();
            for (i, t) in dense.iter().enumerate() {
                same_float(0, i)?;
                shape = broadcast_shapes(&shape, t.dims()).ok_or_else(|| {
                    err(format!(
                        "input {i} ({t}) does not broadcast with {}",
                        Shape(shape.clone())
                    ))
                })?;
            }
            one(TensorType::new(dense[0].dtype, Shape(shape)))
        }
        Op::Conv2d { stride, padding } => {
            same_float(0, 1)?;
            let (x, w) = (dense[0], dense[1]);
            let out = conv_out(x, w, *stride, *padding).map_err(err)?;
            one(TensorType::new(x.dtype, out))
        }
        Op::MaxPool2d { kernel, stride } => {
            let x = float(0)?;
            let out = pool_out(x, *kernel, *stride).map_err(err)?;
            one(TensorType::new(x.dtype, out))
        }
        Op::SumTo { shape } => {
            let t = float(0)?;
            if !broadcasts_to(shape.dims(), t.dims()) {
                return Err(err(format!("{t} cannot be summed down to {shape}")));
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::BroadcastTo { shape } => {
            let t = float(0)?;
            if !broadcasts_to(t.dims(), shape.dims()) {
                return Err(err(format!("{t} does not broadcast to {shape}")));
            }
            one(TensorType::new(t.dtype, shape.clone()))
        }
        Op::ReluGrad | Op::SigmoidGrad | Op::TanhGrad => one(same_type(0, 1)?),
        Op::SoftmaxGrad { axis } | Op::LogSoftmaxGrad { axis } => {
            let t = same_type(0, 1)?;
            axis_ok(&t, *axis)?;
            one(t)
        }
        Op::SoftmaxCrossEntropyGrad => {
            same_float(0, 1)?;
            if dense[0].shape.rank() != 0 {
                return Err(err(format!("dloss must be a scalar, got {}", dense[0])));
            }
            check_sce(dense[1], dense[2]).map_err(err)?;
            one(dense[1].clone())
        }
        Op::MseGrad => {
            same_float(0, 1)?;
            if dense[0].shape.rank() != 0 {
                return Err(err(format!("dloss must be a scalar, got {}", dense[0])));
            }
            one(same_type(1, 2)?)
        }
        Op::EmbeddingGrad { table } | Op::ModelEmbeddingGrad { table, .. } => {
            let (dy, ids) = (float(0)?, dense[1]);
            if ids.dtype != DType::I32 {
                return Err(err(format!("ids must be i32, got {ids}")));
            }
            let mut want = ids.dims().to_vec();
            want.extend_from_slice(&table.dims()[1..]);
            if dy.dims() != want.as_slice() || dy.dtype != table.dtype {
                return Err(err(format!(
                    "dy is {dy}, expected {}{} for ids {ids} into {table}",
                    table.dtype,
                    Shape(want)
                )));
            }
            Ok(vec![ValueType::IndexedSlices {
                dense: table.clone(),
                nnz: ids.shape.numel(),
            }])
        }
        Op::Attention { .. } => {
            let out = attention_shape(dense[0], dense[1], dense[2]).map_err(err)?;
            one(out)
        }
        Op::AttentionGrad { .. } => {
            let out = attention_shape(dense[1], dense[2], dense[3]).map_err(err)?;
            if dense[0] != &out {
                return Err(err(format!(
                    "dy is {}, the attention gives {out}",
                    dense[0]
                )));
            }
            Ok(vec![
                dense[1].clone().into(),
                dense[2].clone().into(),
                dense[3].clone().into(),
            ])
        }
        Op::LayerNormGrad { .. } => {
            let x = same_type(0, 1)?;
            same_float(0, 2)?;
            let last = x.dims().last().copied().unwrap_or(0);
            if dense[2].dims() != [last] {
                return Err(err(format!("gamma must be [{last}], got {}", dense[2])));
            }
            let g = dense[2].clone();
            Ok(vec![x.into(), g.clone().into(), g.into()])
        }
        Op::Conv2dGradInput {
            stride,
            padding,
            input,
        } => {
            same_float(0, 1)?;
            let x = TensorType::new(dense[0].dtype, input.clone());
            let out = conv_out(&x, dense[1], *stride, *padding).map_err(err)?;
            if out != dense[0].dims() {
                return Err(err(format!(
                    "dy is {}, the convolution gives {}",
                    dense[0],
                    Shape(out)
                )));
            }
            one(x)
        }
        Op::Conv2dGradFilter {
            stride,
            padding,
            filter,
        } => {
            same_float(0, 1)?;
            let w = TensorType::new(dense[0].dtype, filter.clone());
            let out = conv_out(dense[1], &w, *stride, *padding).map_err(err)?;
            if out != dense[0].dims() {
                return Err(err(format!(
                    "dy is {}, the convolution gives {}",
                    dense[0],
                    Shape(out)
                )));
            }
            one(w)
        }
        Op::MaxPool2dGrad { kernel, stride } => {
            same_float(0, 1)?;
            let out = pool_out(dense[1], *kernel, *stride).map_err(err)?;
            if out != dense[0].dims() {
                return Err(err(format!(
                    "dy is {}, the pool gives {}",
                    dense[0],
                    Shape(out)
                )));
            }
            one(dense[1].clone())
        }
        Op::ConcatSlices => {
            let mut total = 0;
            let mut dense_ty: Option<&TensorType> = None;
            for t in inputs {
                match t {
                    ValueType::IndexedSlices { dense, nnz } => {
                        if dense_ty.is_some_and(|d| d != dense) {
                            return Err(err(format!("slices over different tensors: {t}")));
                        }
                        dense_ty = Some(dense);
                        total += nnz;
                    }
                    ValueType::Tensor(t) => {
                        return Err(err(format!("input {t} is dense, IndexedSlices are needed")))
                    }
                }
            }
            let dense = dense_ty.cloned().ok_or_else(|| err("no inputs".into()))?;
            Ok(vec![ValueType::IndexedSlices { dense, nnz: total }])
        }
        Op::Densify => match inputs[0] {
            ValueType::IndexedSlices { dense, .. } => one(dense.clone()),
            t => Err(err(format!("input {t} is dense, IndexedSlices are needed"))),
        },
        Op::RowMask => match inputs[0] {
            ValueType::IndexedSlices { dense, .. } if dense.shape.rank() >= 1 => {
                one(TensorType::new(dense.dtype, Shape(vec![dense.dims()[0]])))
            }
            t => Err(err(format!(
                "input {t} is not IndexedSlices over a tensor of rank 1 or more"
            ))),
        },
        Op::Sparsify => {
            let (t, mask) = (float(0)?, float(1)?);
            let rows = t.dims().first().copied();
            if rows.is_none() || mask.dims() != [rows.unwrap_or(0)] || mask.dtype != t.dtype {
                return Err(err(format!(
                    "the mask {mask} must have one element of {}'s dtype per row of {t}",
                    t.dtype
                )));
            }
            Ok(vec![ValueType::IndexedSlices {
                dense: t.clone(),
                nnz: rows.unwrap_or(0),
            }])
        }
        Op::Loss => {
            let t = float(0)?;
            if t.shape.rank() != 0 {
                return Err(err(format!("the loss must be a scalar, got {t}")));
            }
            Ok(vec![])
        }
        Op::ParamGrad { .. } | Op::Output { .. } => Ok(vec![]),
        Op::Assign { .. } => {
            float(0)?;
            Ok(vec![])
        }
    }
}

fn check_sce(logits: &TensorType, labels: &TensorType) -> Result<(), String> {
    if logits.shape.rank() != 2 {
        return Err(format!("logits must be [batch, classes], got {logits}"));
    }
    if labels.dtype != DType::I32 || labels.dims() != [logits.dims()[0]] {
        return Err(format!(
            "labels must be i32[{}] for logits {logits}, got {labels}",
            logits.dims()[0]
        ));
    }
    Ok(())
}

fn conv_out(
    x: &TensorType,
    w: &TensorType,
    stride: usize,
    padding: usize,
) -> Result<Vec<usize>, String> {
    if x.shape.rank() != 4 || w.shape.rank() != 4 {
        return Err(format!(
            "needs x [N,C,H,W] and w [O,C,KH,KW], got {x} and {w}"
        ));
    }
    let (xd, wd) = (x.dims(), w.dims());
    if xd[1] != wd[1] {
        return Err(format!(
            "channels differ: x {x} has {}, w {w} has {}",
            xd[1], wd[1]
        ));
    }
    if stride == 0 {
        return Err("stride must be at least 1".into());
    }
    let padded = |d: usize| {
        padding
            .checked_mul(2)
            .and_then(|p| p.checked_add(d))
            .ok_or_else(|| format!("padding {padding} is too large for {x}"))
    };
    let (h, wi) = (padded(xd[2])?, padded(xd[3])?);
    if wd[2] > h || wd[3] > wi {
        return Err(format!("filter {w} is larger than the padded input {x}"));
    }
    Ok(vec![
        xd[0],
        wd[0],
        (h - wd[2]) / stride + 1,
        (wi - wd[3]) / stride + 1,
    ])
}

fn pool_out(x: &TensorType, kernel: usize, stride: usize) -> Result<Vec<usize>, String> {
    let d = x.dims();
    if d.len() != 4 {
        return Err(format!("needs x [N,C,H,W], got {x}"));
    }
    if kernel == 0 || stride == 0 || kernel > d[2] || kernel > d[3] {
        return Err(format!("window {kernel} stride {stride} does not fit {x}"));
    }
    Ok(vec![
        d[0],
        d[1],
        (d[2] - kernel) / stride + 1,
        (d[3] - kernel) / stride + 1,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the plan fuzzer: a padding near `usize::MAX` overflowed the padded
    /// size instead of being refused.
    #[test]
    fn a_huge_padding_is_refused() {
        let x = ValueType::Tensor(TensorType::f32(vec![1, 1, 4, 4]));
        let w = ValueType::Tensor(TensorType::f32(vec![1, 1, 3, 3]));
        let op = Op::Conv2d {
            stride: 1,
            padding: usize::MAX / 2 + 1,
        };
        let e = infer(&op, &[&x, &w]).expect_err("refused");
        assert!(e.to_string().contains("too large"), "{e}");
        let op = Op::Conv2d {
            stride: 1,
            padding: 1,
        };
        assert!(infer(&op, &[&x, &w]).is_ok());
    }

    /// Found by the plan fuzzer once examples/gpt.dsl joined its corpus: a
    /// `model_gather` of 2^63-1 parts overflowed the gathered dimension.
    #[test]
    fn a_huge_model_gather_is_refused() {
        let x = ValueType::Tensor(TensorType::f32(vec![2, 4]));
        let op = Op::ModelGather {
            dim: 1,
            parts: i64::MAX as usize,
        };
        let e = infer(&op, &[&x]).expect_err("refused");
        assert!(e.to_string().contains("overflow"), "{e}");
        let op = Op::ModelGather { dim: 1, parts: 2 };
        assert!(infer(&op, &[&x]).is_ok());
    }
}
