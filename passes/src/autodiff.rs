//! Reverse-mode automatic differentiation as a graph rewrite.
//!
//! Requires one `loss` sink on a scalar and no gradient nodes yet. Adds, for every
//! variable the loss depends on, the nodes computing d loss / d variable and a
//! `param_grad` sink marking it. The gradient of an embedding lookup is an
//! `indexed_slices` value (rows of the batch), never a dense scatter; contributions of a
//! variable read twice are summed (`add` for dense, `concat_slices` for slices, a dense
//! sum when both kinds meet). Variables the loss does not reach get no sink and are
//! listed in the stats note. Before/after (abridged):
//! ```text
//! %2 = embedding %0, %1 : f32[4,8]           %2 = embedding %0, %1 : f32[4,8]
//! %3 = mean{axes=[0,1]} %2 : f32[]      =>   ...
//! loss %3                                     %6 = embedding_grad{table=f32[100,8]} %5, %1
//!                                                    : indexed_slices(f32[100,8], nnz=4)
//!                                             param_grad{param="emb"} %6
//! ```

use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{DType, Graph, NodeId, Op, Shape, TensorType, ValueId, ValueType};
use std::collections::{HashMap, HashSet};

/// The autodiff pass.
pub struct Autodiff;

impl Pass for Autodiff {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let nodes_before = g.node_count();
        let loss = g
            .loss()
            .ok_or_else(|| PassError::Precondition("autodiff needs a `loss` sink".into()))?;
        if !g.param_grads().is_empty() {
            return Err(PassError::Precondition(
                "the graph already has gradients".into(),
            ));
        }
        let order = g.topo_order();
        let active = active_nodes(g, &order, loss.node);
        let mut grads: HashMap<ValueId, Vec<ValueId>> = HashMap::new();
        let loss_ty = g.tensor_type(loss).clone();
        // fp16 scales the loss (so small gradients do not flush to zero): the backward
        // pass starts from the scale the runtime feeds, and the runtime unscales.
        let seed = if cx.strategy.precision == crate::placement::Precision::Fp16 {
            g.add(
                Op::Input {
                    name: distc_ir::LOSS_SCALE.to_string(),
                    ty: loss_ty,
                },
                vec![],
            )?
        } else {
            g.add(
                Op::Constant {
                    value: 1.0,
                    ty: loss_ty,
                },
                vec![],
            )?
        };
        grads.insert(loss, vec![seed.into()]);
        let mut param_grads = Vec::new();
        for &id in order.iter().rev() {
            if !active.contains(&id) {
                continue;
            }
            let node = g.node(id).clone();
            let mut dys = Vec::with_capacity(node.outputs.len());
            let mut any = false;
            for port in 0..node.outputs.len() as u16 {
                let v = id.out(port);
                let dy = match grads.remove(&v) {
                    Some(parts) => Some(sum_grads(g, parts)?),
                    None => None,
                };
                any |= dy.is_some();
                dys.push(dy);
            }
            if !any {
                continue;
            }
            if let Op::Param { name, .. } = &node.op {
                if let Some(dy) = dys[0] {
                    param_grads.push((name.clone(), dy));
                }
                continue;
            }
            let needs: Vec<bool> = node
                .inputs
                .iter()
                .map(|v| active.contains(&v.node) && g.value_type(*v).dense_type().dtype.is_float())
                .collect();
            let contributions = vjp(g, id, &dys, &needs)?;
            for (slot, c) in contributions.into_iter().enumerate() {
                if let (Some(c), true) = (c, needs[slot]) {
                    grads.entry(node.inputs[slot]).or_default().push(c);
                }
            }
        }
        let reached: HashSet<&str> = param_grads.iter().map(|(n, _)| n.as_str()).collect();
        let frozen = g.frozen_params();
        let unreached: Vec<String> = g
            .params()
            .iter()
            .filter(|(_, n, _)| !reached.contains(n) && !frozen.contains(*n))
            .map(|(_, n, _)| n.to_string())
            .collect();
        let n_grads = param_grads.len();
        let mut sparse = 0;
        for (name, dy) in param_grads {
            sparse += usize::from(g.value_type(dy).is_sparse());
            g.add(Op::ParamGrad { param: name }, vec![dy])?;
        }
        g.remove_dead();
        let mut stats = PassStats::default()
            .count("added", g.node_count().saturating_sub(nodes_before))
            .count("gradients", n_grads)
            .count("sparse", sparse)
            .count("unreached", unreached.len())
            .count("frozen", frozen.len());
        if !unreached.is_empty() {
            stats.note = Some(format!("no gradient reaches {}", unreached.join(", ")));
        }
        Ok(stats)
    }
}

/// Nodes on a path from a variable to the loss: only these need gradients.
fn active_nodes(g: &Graph, order: &[NodeId], loss: NodeId) -> HashSet<NodeId> {
    let mut from_params: HashSet<NodeId> = HashSet::new();
    for &id in order {
        let n = g.node(id);
        // A frozen variable is not trained: no gradient flows to it.
        if matches!(n.op, Op::Param { frozen: false, .. })
            || n.inputs.iter().any(|v| from_params.contains(&v.node))
        {
            from_params.insert(id);
        }
    }
    let mut to_loss: HashSet<NodeId> = HashSet::new();
    let mut stack = vec![loss];
    while let Some(id) = stack.pop() {
        if to_loss.insert(id) {
            stack.extend(g.node(id).inputs.iter().map(|v| v.node));
        }
    }
    from_params.intersection(&to_loss).copied().collect()
}

/// Sums gradient contributions to one value.
fn sum_grads(g: &mut Graph, parts: Vec<ValueId>) -> Result<ValueId, PassError> {
    if parts.len() == 1 {
        return Ok(parts[0]);
    }
    let (sparse, dense): (Vec<ValueId>, Vec<ValueId>) = parts
        .into_iter()
        .partition(|v| g.value_type(*v).is_sparse());
    if dense.is_empty() {
        return Ok(g.add(Op::ConcatSlices, sparse)?.into());
    }
    let mut acc = dense[0];
    for &d in &dense[1..] {
        acc = g.add(Op::Add, vec![acc, d])?.into();
    }
    if !sparse.is_empty() {
        // A variable also read densely gets a dense gradient.
        let joined: ValueId = if sparse.len() == 1 {
            sparse[0]
        } else {
            g.add(Op::ConcatSlices, sparse)?.into()
        };
        let dense_part = g.add(Op::Densify, vec![joined])?;
        acc = g.add(Op::Add, vec![acc, dense_part.into()])?.into();
    }
    Ok(acc)
}

fn dims(g: &Graph, v: ValueId) -> Vec<usize> {
    g.tensor_type(v).dims().to_vec()
}

/// `dy` summed down to the shape of `like` (identity when the shapes agree).
fn sum_to(g: &mut Graph, dy: ValueId, like: ValueId) -> Result<ValueId, PassError> {
    let target = dims(g, like);
    if dims(g, dy) == target {
        return Ok(dy);
    }
    Ok(g.add(
        Op::SumTo {
            shape: Shape(target),
        },
        vec![dy],
    )?
    .into())
}

fn scalar(g: &mut Graph, value: f64, dtype: DType) -> Result<ValueId, PassError> {
    Ok(g.add(
        Op::Constant {
            value,
            ty: TensorType::new(dtype, Shape::scalar()),
        },
        vec![],
    )?
    .into())
}

fn bin(g: &mut Graph, op: Op, a: ValueId, b: ValueId) -> Result<ValueId, PassError> {
    Ok(g.add(op, vec![a, b])?.into())
}

fn un(g: &mut Graph, op: Op, a: ValueId) -> Result<ValueId, PassError> {
    Ok(g.add(op, vec![a])?.into())
}

/// The vector-Jacobian product of node `id`: given the gradients of its outputs, the
/// gradient contribution to each input (None where none flows). One arm per op.
fn vjp(
    g: &mut Graph,
    id: NodeId,
    dys: &[Option<ValueId>],
    needs: &[bool],
) -> Result<Vec<Option<ValueId>>, PassError> {
    let node = g.node(id).clone();
    let x = &node.inputs;
    let y: ValueId = id.into();
    let no_grad = |what: &str| {
        Err(PassError::Precondition(format!(
            "{id} ({what}): has no gradient rule (higher-order gradients are not supported)"
        )))
    };
    // Multi-output ops read their port gradients themselves; every other op has one.
    let dy = match dys.first().copied().flatten() {
        Some(d) => d,
        None => return Ok(vec![None; x.len()]),
    };
    let dtype = g.value_type(dy).dense_type().dtype;
    Ok(match &node.op {
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Pull { .. }
        | Op::Shard { .. } => {
            vec![]
        }
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            let (a, b) = (x[0], x[1]);
            let mm = |ta, tb| Op::MatMul {
                transpose_a: ta,
                transpose_b: tb,
            };
            let (da, db) = match (transpose_a, transpose_b) {
                (false, false) => ((mm(false, true), dy, b), (mm(true, false), a, dy)),
                (false, true) => ((mm(false, false), dy, b), (mm(true, false), dy, a)),
                (true, false) => ((mm(false, true), b, dy), (mm(false, false), a, dy)),
                (true, true) => ((mm(true, true), b, dy), (mm(true, true), dy, a)),
            };
            // A batch dimension an operand broadcast is summed back out of its gradient.
            let da = if needs[0] {
                let d = bin(g, da.0, da.1, da.2)?;
                Some(sum_to(g, d, a)?)
            } else {
                None
            };
            let db = if needs[1] {
                let d = bin(g, db.0, db.1, db.2)?;
                Some(sum_to(g, d, b)?)
            } else {
                None
            };
            vec![da, db]
        }
        Op::Add => vec![Some(sum_to(g, dy, x[0])?), Some(sum_to(g, dy, x[1])?)],
        Op::Sub => {
            let da = sum_to(g, dy, x[0])?;
            let neg = un(g, Op::Neg, dy)?;
            vec![Some(da), Some(sum_to(g, neg, x[1])?)]
        }
        Op::Mul => {
            let da = if needs[0] {
                let p = bin(g, Op::Mul, dy, x[1])?;
                Some(sum_to(g, p, x[0])?)
            } else {
                None
            };
            let db = if needs[1] {
                let p = bin(g, Op::Mul, dy, x[0])?;
                Some(sum_to(g, p, x[1])?)
            } else {
                None
            };
            vec![da, db]
        }
        Op::Div => {
            let da = if needs[0] {
                let q = bin(g, Op::Div, dy, x[1])?;
                Some(sum_to(g, q, x[0])?)
            } else {
                None
            };
            let db = if needs[1] {
                // d(a/b)/db = -(a/b)/b = -y/b
                let p = bin(g, Op::Mul, dy, y)?;
                let q = bin(g, Op::Div, p, x[1])?;
                let n = un(g, Op::Neg, q)?;
                Some(sum_to(g, n, x[1])?)
            } else {
                None
            };
            vec![da, db]
        }
        Op::Neg => vec![Some(un(g, Op::Neg, dy)?)],
        // Each replica's value is the sum (mean) of all of theirs, so each gets the sum
        // (mean) of their gradients: the map is its own adjoint.
        op @ Op::ReplicaReduce { .. } => vec![Some(un(g, op.clone(), dy)?)],
        // Training reads the first input; the second is evaluation's.
        Op::TrainOrEval => vec![Some(dy), None],
        // Every model-axis worker computes the loss whole, so a replicated value's
        // gradient is the same on each: what enters split computations gets its
        // gradient summed over them, and a sum hands the gradient back unchanged;
        // gathering and splitting swap.
        Op::ModelEnter { parts } => vec![Some(un(g, Op::ModelAllReduce { parts: *parts }, dy)?)],
        Op::ModelAllReduce { parts } => vec![Some(un(g, Op::ModelEnter { parts: *parts }, dy)?)],
        Op::ModelGather { dim, parts } => vec![Some(un(
            g,
            Op::ModelSplit {
                dim: *dim,
                parts: *parts,
            },
            dy,
        )?)],
        Op::ModelSplit { dim, parts } | Op::ModelReduceScatter { dim, parts } => vec![Some(un(
            g,
            Op::ModelGather {
                dim: *dim,
                parts: *parts,
            },
            dy,
        )?)],
        Op::Relu => vec![Some(bin(g, Op::ReluGrad, dy, x[0])?)],
        Op::Sigmoid => vec![Some(bin(g, Op::SigmoidGrad, dy, y)?)],
        Op::Tanh => vec![Some(bin(g, Op::TanhGrad, dy, y)?)],
        Op::Exp => vec![Some(bin(g, Op::Mul, dy, y)?)],
        Op::Log => vec![Some(bin(g, Op::Div, dy, x[0])?)],
        Op::Softmax { axis } => vec![Some(bin(g, Op::SoftmaxGrad { axis: *axis }, dy, y)?)],
        Op::LogSoftmax { axis } => {
            vec![Some(bin(g, Op::LogSoftmaxGrad { axis: *axis }, dy, y)?)]
        }
        Op::Sum { axes, keep_dims } | Op::Mean { axes, keep_dims } => {
            let xd = dims(g, x[0]);
            let mut d = dy;
            if !keep_dims {
                let kept: Vec<usize> = xd
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| if axes.contains(&i) { 1 } else { n })
                    .collect();
                d = un(g, Op::Reshape { shape: Shape(kept) }, d)?;
            }
            if matches!(node.op, Op::Mean { .. }) {
                let count: usize = axes.iter().map(|&a| xd[a]).product();
                let c = scalar(g, 1.0 / count as f64, dtype)?;
                d = bin(g, Op::Mul, d, c)?;
            }
            vec![Some(un(g, Op::BroadcastTo { shape: Shape(xd) }, d)?)]
        }
        Op::Reshape { .. } => {
            let shape = Shape(dims(g, x[0]));
            vec![Some(un(g, Op::Reshape { shape }, dy)?)]
        }
        // The gradient in the input's type: a 16-bit use of an f32 master variable
        // hands the optimizer an f32 gradient.
        Op::Cast { .. } => {
            let to = g.tensor_type(x[0]).dtype;
            vec![Some(un(g, Op::Cast { to }, dy)?)]
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(un(g, Op::Transpose { perm: inv }, dy)?)]
        }
        Op::Concat { axis } => {
            let mut start = 0;
            let mut out = Vec::with_capacity(x.len());
            for (slot, v) in x.iter().enumerate() {
                let len = dims(g, *v)[*axis];
                out.push(if needs[slot] {
                    Some(un(
                        g,
                        Op::Slice {
                            axis: *axis,
                            start,
                            end: start + len,
                        },
                        dy,
                    )?)
                } else {
                    None
                });
                start += len;
            }
            out
        }
        Op::Slice { axis, start, end } => {
            // Pad the gradient back with zeros on both sides of the kept range.
            let xd = dims(g, x[0]);
            let mut parts = Vec::new();
            let zeros = |g: &mut Graph, n: usize| -> Result<ValueId, PassError> {
                let mut d = xd.clone();
                d[*axis] = n;
                Ok(g.add(
                    Op::Constant {
                        value: 0.0,
                        ty: TensorType::new(dtype, d),
                    },
                    vec![],
                )?
                .into())
            };
            if *start > 0 {
                parts.push(zeros(g, *start)?);
            }
            parts.push(dy);
            if *end < xd[*axis] {
                parts.push(zeros(g, xd[*axis] - end)?);
            }
            let dx = if parts.len() == 1 {
                dy
            } else {
                g.add(Op::Concat { axis: *axis }, parts)?.into()
            };
            vec![Some(dx)]
        }
        Op::Embedding => {
            let table = g.tensor_type(x[0]).clone();
            vec![Some(bin(g, Op::EmbeddingGrad { table }, dy, x[1])?), None]
        }
        Op::ModelEmbedding { parts } => {
            let table = g.tensor_type(x[0]).clone();
            let op = Op::ModelEmbeddingGrad {
                table,
                parts: *parts,
            };
            vec![Some(bin(g, op, dy, x[1])?), None]
        }
        Op::SoftmaxCrossEntropy => {
            let d = g.add(Op::SoftmaxCrossEntropyGrad, vec![dy, x[0], x[1]])?;
            vec![Some(d.into()), None]
        }
        Op::Mse => {
            let dp: ValueId = g.add(Op::MseGrad, vec![dy, x[0], x[1]])?.into();
            let dt = if needs[1] {
                Some(un(g, Op::Neg, dp)?)
            } else {
                None
            };
            vec![Some(dp), dt]
        }
        Op::Dropout {
            rate,
            seed,
            per_sample,
        } => vec![Some(un(
            g,
            Op::DropoutGrad {
                rate: *rate,
                seed: *seed,
                per_sample: *per_sample,
            },
            dy,
        )?)],
        Op::Attention { causal, scale } => {
            let op = Op::AttentionGrad {
                causal: *causal,
                scale: *scale,
            };
            let n = g.add(op, vec![dy, x[0], x[1], x[2]])?;
            vec![Some(n.out(0)), Some(n.out(1)), Some(n.out(2))]
        }
        Op::LayerNorm { eps } => {
            let n = g.add(Op::LayerNormGrad { eps: *eps }, vec![dy, x[0], x[1]])?;
            vec![Some(n.out(0)), Some(n.out(1)), Some(n.out(2))]
        }
        Op::Conv2d { stride, padding } => {
            let dx = if needs[0] {
                let input = Shape(dims(g, x[0]));
                let op = Op::Conv2dGradInput {
                    stride: *stride,
                    padding: *padding,
                    input,
                };
                Some(bin(g, op, dy, x[1])?)
            } else {
                None
            };
            let filter = Shape(dims(g, x[1]));
            let op = Op::Conv2dGradFilter {
                stride: *stride,
                padding: *padding,
                filter,
            };
            let dw = if needs[1] {
                Some(bin(g, op, dy, x[0])?)
            } else {
                None
            };
            vec![dx, dw]
        }
        Op::MaxPool2d { kernel, stride } => vec![Some(bin(
            g,
            Op::MaxPool2dGrad {
                kernel: *kernel,
                stride: *stride,
            },
            dy,
            x[0],
        )?)],
        Op::Fused { expr } => {
            // Element-wise ops written as expressions (gelu, pow, where, ...) and
            // fused nodes alike: each input's gradient is an expression too.
            let grads = expr
                .input_gradients(x.len())
                .map_err(|e| PassError::Precondition(format!("{id} ({}): {e}", node.op)))?;
            let mut out = Vec::with_capacity(x.len());
            for (k, grad) in grads.into_iter().enumerate() {
                let Some(grad) = grad.filter(|_| needs[k]) else {
                    out.push(None);
                    continue;
                };
                let inputs: Vec<ValueId> =
                    grad.inputs.iter().map(|i| i.map_or(dy, |j| x[j])).collect();
                let d = match grad.expr.steps.as_slice() {
                    [distc_ir::FusedStep::Input(j)] => inputs[*j],
                    _ => g.add(Op::Fused { expr: grad.expr }, inputs)?.into(),
                };
                out.push(Some(sum_to(g, d, x[k])?));
            }
            out
        }
        Op::SumTo { .. }
        | Op::BroadcastTo { .. }
        | Op::ReluGrad
        | Op::SigmoidGrad
        | Op::TanhGrad
        | Op::SoftmaxGrad { .. }
        | Op::LogSoftmaxGrad { .. }
        | Op::SoftmaxCrossEntropyGrad
        | Op::MseGrad
        | Op::EmbeddingGrad { .. }
        | Op::ModelEmbeddingGrad { .. }
        | Op::DropoutGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::AttentionGrad { .. }
        | Op::Conv2dGradInput { .. }
        | Op::Conv2dGradFilter { .. }
        | Op::MaxPool2dGrad { .. }
        | Op::ConcatSlices
        | Op::Densify
        | Op::RowMask
        | Op::Sparsify
        | Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::Broadcast { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGatherDense { .. }
        | Op::TakeChunk { .. }
        | Op::Accumulate { .. }
        | Op::UniqueRows
        | Op::Pack
        | Op::Unpack { .. }
        | Op::PackChunks { .. }
        | Op::UnpackChunks { .. }
        | Op::SparsePull { .. } => return no_grad(node.op.mnemonic()),
        Op::Loss
        | Op::ParamGrad { .. }
        | Op::Output { .. }
        | Op::Assign { .. }
        | Op::Push { .. }
        | Op::SparsePush { .. }
        | Op::Serve { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => vec![],
    })
}

/// Whether a value type carries a gradient.
pub fn differentiable(t: &ValueType) -> bool {
    t.dense_type().dtype.is_float()
}
