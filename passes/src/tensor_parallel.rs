//! Tensor parallelism (`--mesh model=T`): variables split along one dimension over the
//! T workers of the model axis, and every value's sharding propagated through the
//! one-device forward graph, before autodiff.
//!
//! A value is whole on every model-axis worker, split along one dimension (each worker
//! holds an equal part, in rank order), or partial (each holds a term of a sum). Each op
//! keeps its inputs' sharding where its arithmetic allows it (a matmul of a whole value
//! by a column-split weight is column-split; of a column-split value by a row-split
//! weight, partial; element-wise ops, softmax off the split axis, sums and layer norm
//! off it); elsewhere its inputs are made whole first: a `model_gather` of a split
//! value, a `model_all_reduce` of a partial one. A whole operand meeting a split one in
//! an element-wise op is cut with `model_split` (local), and a whole value entering a
//! column-split matmul goes through `model_enter`, so that its gradient, partial on each
//! worker, is summed. Autodiff then differentiates the rewritten graph with the
//! collectives' own rules (all-reduce and enter swap; gather and split swap): every
//! worker computes the loss whole, so a whole value's gradient is whole on each.
//!
//! Which variables split: those named in the model (`shard(DIM)` after a `param`) or
//! by `--shard VAR=DIM`; with none named, the Megatron rule: a matmul whose weight's
//! result reaches a second matmul's left operand through element-wise ops only splits
//! its weight by columns and the second's by rows (one all-reduce forward and one
//! backward per pair). A split variable `w` becomes `w.tp` of its local shape; the init
//! program cuts each worker's part from the one-device value and the final program
//! gathers it back, so a run starts and ends with the one-device variables.

use crate::{PassCx, PassError, PassStats};
use distc_ir::{Graph, NodeId, Op, Shape, TensorType, ValueId};
use std::collections::{BTreeMap, HashMap};

pub use distc_ir::MODEL_SHARD_SUFFIX;

/// The local part's name of variable `var`.
pub fn shard_name(var: &str) -> String {
    format!("{var}{MODEL_SHARD_SUFFIX}")
}

/// Where a value lives on the model axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Every worker holds it all.
    Whole,
    /// Each worker holds its equal part along this dimension.
    Split(usize),
    /// Each worker holds a term; the value is their sum.
    Partial,
}

impl std::fmt::Display for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Sharding::Whole => f.write_str("whole"),
            Sharding::Split(d) => write!(f, "split({d})"),
            Sharding::Partial => f.write_str("partial"),
        }
    }
}

/// The variables the Megatron rule splits over `parts` workers, `var -> dim`: per pair
/// of matmuls joined by element-wise ops, the first weight by columns (1) and the
/// second by rows (0), where those split evenly.
pub fn megatron_pairs(g: &Graph, parts: usize) -> BTreeMap<String, usize> {
    let param_of = |v: ValueId, dim: usize| match g.op(v.node) {
        Op::Param { name, ty, .. }
            if ty.shape.rank() == 2 && ty.dims()[dim].is_multiple_of(parts) =>
        {
            Some(name.clone())
        }
        // Only a variable splits: no other op is a weight.
        _ => None,
    };
    let plain = |id: NodeId| {
        matches!(
            g.op(id),
            Op::MatMul {
                transpose_a: false,
                transpose_b: false
            }
        )
    };
    let mut out = BTreeMap::new();
    for id in g.topo_order() {
        if !plain(id) {
            continue;
        }
        let Some(first) = param_of(g.node(id).inputs[1], 1) else {
            continue;
        };
        if out.contains_key(&first) {
            continue;
        }
        // Follow the result through element-wise ops with one user each.
        let mut v: ValueId = id.into();
        let second = loop {
            let users = g.users(v);
            let [(user, slot)] = users.as_slice() else {
                break None;
            };
            match g.op(*user) {
                Op::MatMul { .. } if plain(*user) && *slot == 0 => {
                    break param_of(g.node(*user).inputs[1], 0);
                }
                // Element-wise ops, and the reshapes, transposes and attention of a
                // multi-head block: q, k and v each reach the output projection.
                Op::Add
                | Op::Sub
                | Op::Mul
                | Op::Relu
                | Op::Tanh
                | Op::Sigmoid
                | Op::Neg
                | Op::Exp
                | Op::Fused { .. }
                | Op::Reshape { .. }
                | Op::Transpose { .. }
                | Op::Attention { .. } => v = (*user).into(),
                // The walk follows no other op, a matmul not reading the value as its
                // plain left operand included: no pair through it.
                Op::Input { .. }
                | Op::Param { .. }
                | Op::Constant { .. }
                | Op::MatMul { .. }
                | Op::Div
                | Op::Log
                | Op::Softmax { .. }
                | Op::LogSoftmax { .. }
                | Op::Sum { .. }
                | Op::Mean { .. }
                | Op::Cast { .. }
                | Op::Concat { .. }
                | Op::Slice { .. }
                | Op::Embedding
                | Op::SoftmaxCrossEntropy
                | Op::Mse
                | Op::Dropout { .. }
                | Op::LayerNorm { .. }
                | Op::Conv2d { .. }
                | Op::MaxPool2d { .. }
                | Op::ReplicaReduce { .. }
                | Op::TrainOrEval
                | Op::SumTo { .. }
                | Op::BroadcastTo { .. }
                | Op::ReluGrad
                | Op::SigmoidGrad
                | Op::TanhGrad
                | Op::SoftmaxGrad { .. }
                | Op::LogSoftmaxGrad { .. }
                | Op::SoftmaxCrossEntropyGrad
                | Op::MseGrad
                | Op::EmbeddingGrad { .. }
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
                | Op::ModelEnter { .. }
                | Op::ModelAllReduce { .. }
                | Op::ModelGather { .. }
                | Op::ModelSplit { .. }
                | Op::ModelReduceScatter { .. }
                | Op::ModelEmbedding { .. }
                | Op::ModelEmbeddingGrad { .. }
                | Op::Accumulate { .. }
                | Op::UniqueRows
                | Op::Pack
                | Op::Unpack { .. }
                | Op::PackChunks { .. }
                | Op::UnpackChunks { .. }
                | Op::Pull { .. }
                | Op::SparsePull { .. }
                | Op::Push { .. }
                | Op::SparsePush { .. }
                | Op::Shard { .. }
                | Op::Serve { .. }
                | Op::Send { .. }
                | Op::Recv { .. }
                | Op::Loss
                | Op::ParamGrad { .. }
                | Op::Output { .. }
                | Op::Assign { .. } => break None,
            }
        };
        // A second weight already split by rows takes more first weights: attention's
        // q, k and v projections all feed its output projection.
        if let Some(second) = second.filter(|s| *s != first && out.get(s).is_none_or(|d| *d == 0)) {
            out.insert(first, 1);
            out.insert(second, 0);
            // The column-parallel layer's bias splits with its columns, as Megatron's:
            // added whole, it would be cut each step and its gradient gathered.
            if let Some(bias) = column_bias(g, id, parts) {
                out.entry(bias).or_insert(0);
            }
        }
    }
    out
}

/// The bias added to matmul `id`'s result (through reshapes): a rank-1 variable as
/// long as the result's last dimension, split evenly.
fn column_bias(g: &Graph, id: NodeId, parts: usize) -> Option<String> {
    let cols = *g.tensor_type(id.into()).dims().last()?;
    let mut v: ValueId = id.into();
    loop {
        let users = g.users(v);
        let [(user, slot)] = users.as_slice() else {
            return None;
        };
        match g.op(*user) {
            Op::Reshape { shape } if shape.dims().last() == Some(&cols) => v = (*user).into(),
            Op::Add => {
                let other = g.node(*user).inputs[1 - *slot];
                return match g.op(other.node) {
                    Op::Param { name, ty, .. }
                        if ty.dims() == [cols] && cols.is_multiple_of(parts) =>
                    {
                        Some(name.clone())
                    }
                    // Only a variable splits: no other op is a bias.
                    _ => None,
                };
            }
            // A bias is looked for through reshapes keeping the columns only: through
            // any other op it is not the layer's, and stays whole.
            Op::Input { .. }
            | Op::Param { .. }
            | Op::Constant { .. }
            | Op::MatMul { .. }
            | Op::Sub
            | Op::Mul
            | Op::Div
            | Op::Neg
            | Op::Relu
            | Op::Sigmoid
            | Op::Tanh
            | Op::Exp
            | Op::Log
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::Sum { .. }
            | Op::Mean { .. }
            | Op::Cast { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Embedding
            | Op::SoftmaxCrossEntropy
            | Op::Mse
            | Op::Dropout { .. }
            | Op::LayerNorm { .. }
            | Op::Attention { .. }
            | Op::Conv2d { .. }
            | Op::MaxPool2d { .. }
            | Op::Fused { .. }
            | Op::ReplicaReduce { .. }
            | Op::TrainOrEval
            | Op::SumTo { .. }
            | Op::BroadcastTo { .. }
            | Op::ReluGrad
            | Op::SigmoidGrad
            | Op::TanhGrad
            | Op::SoftmaxGrad { .. }
            | Op::LogSoftmaxGrad { .. }
            | Op::SoftmaxCrossEntropyGrad
            | Op::MseGrad
            | Op::EmbeddingGrad { .. }
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
            | Op::ModelEnter { .. }
            | Op::ModelAllReduce { .. }
            | Op::ModelGather { .. }
            | Op::ModelSplit { .. }
            | Op::ModelReduceScatter { .. }
            | Op::ModelEmbedding { .. }
            | Op::ModelEmbeddingGrad { .. }
            | Op::Accumulate { .. }
            | Op::UniqueRows
            | Op::Pack
            | Op::Unpack { .. }
            | Op::PackChunks { .. }
            | Op::UnpackChunks { .. }
            | Op::Pull { .. }
            | Op::SparsePull { .. }
            | Op::Push { .. }
            | Op::SparsePush { .. }
            | Op::Shard { .. }
            | Op::Serve { .. }
            | Op::Send { .. }
            | Op::Recv { .. }
            | Op::Loss
            | Op::ParamGrad { .. }
            | Op::Output { .. }
            | Op::Assign { .. } => return None,
        }
    }
}

/// What the rewrite made beside the worker program.
#[derive(Debug, Default)]
pub struct Rewritten {
    /// Cuts each worker's part from the one-device variables.
    pub init: Graph,
    /// Gathers the whole variables back.
    pub finalize: Graph,
    /// Every value's sharding in the rewritten program.
    pub sharding: HashMap<ValueId, Sharding>,
    /// Collectives inserted: `(op mnemonic, count)`.
    pub inserted: BTreeMap<&'static str, usize>,
}

/// Rewrites the forward program `g` for `parts` workers on the model axis, splitting
/// `split` (`var -> dim`).
pub fn rewrite(
    g: &Graph,
    parts: usize,
    split: &BTreeMap<String, usize>,
) -> Result<(Graph, Rewritten), PassError> {
    let mut r = Rewriter {
        old: g,
        new: Graph::new(g.name.clone()),
        parts,
        map: HashMap::new(),
        entered: HashMap::new(),
        cuts: HashMap::new(),
        out: Rewritten {
            init: Graph::new(g.name.clone()),
            finalize: Graph::new(g.name.clone()),
            ..Rewritten::default()
        },
    };
    let params = g.params();
    let names: std::collections::HashSet<&str> = params.iter().map(|(_, n, _)| *n).collect();
    for var in split.keys() {
        if !names.contains(var.as_str()) {
            let known: Vec<&str> = params.iter().map(|(_, n, _)| *n).collect();
            return Err(PassError::Precondition(format!(
                "`{var}` is sharded, and the model has no variable of that name (it has {})",
                known.join(", ")
            )));
        }
    }
    for id in g.topo_order() {
        r.node(id, split)?;
    }
    let Rewriter { new, mut out, .. } = r;
    out.init.remove_dead();
    Ok((new, out))
}

struct Rewriter<'a> {
    old: &'a Graph,
    new: Graph,
    parts: usize,
    /// Old value -> (new value, its sharding).
    map: HashMap<ValueId, (ValueId, Sharding)>,
    out: Rewritten,
    /// Values already entered or cut (a value read by several split computations,
    /// as a block's input by q, k and v, enters once: one all-reduce of its gradient).
    entered: HashMap<ValueId, ValueId>,
    cuts: HashMap<(ValueId, usize), ValueId>,
}

impl Rewriter<'_> {
    fn add(&mut self, op: Op, inputs: Vec<ValueId>, s: Sharding) -> Result<ValueId, PassError> {
        if op.is_model_collective() || matches!(op, Op::ModelEnter { .. } | Op::ModelSplit { .. }) {
            *self.out.inserted.entry(op.mnemonic()).or_default() += 1;
        }
        let v: ValueId = self.new.add(op, inputs)?.into();
        self.out.sharding.insert(v, s);
        Ok(v)
    }

    fn rank(&self, v: ValueId) -> usize {
        self.new.tensor_type(v).shape.rank()
    }

    /// Every input whole on every worker (an op that reads them so).
    fn all_whole(&mut self, ins: &[(ValueId, Sharding)]) -> Result<Vec<ValueId>, PassError> {
        ins.iter().map(|v| self.whole(*v)).collect()
    }

    /// `v` whole on every worker.
    fn whole(&mut self, (v, s): (ValueId, Sharding)) -> Result<ValueId, PassError> {
        let parts = self.parts;
        match s {
            Sharding::Whole => Ok(v),
            Sharding::Split(dim) => {
                self.add(Op::ModelGather { dim, parts }, vec![v], Sharding::Whole)
            }
            Sharding::Partial => self.add(Op::ModelAllReduce { parts }, vec![v], Sharding::Whole),
        }
    }

    /// Whole `v` entering a split computation (Megatron's `f`): its gradient, partial
    /// on each worker, is summed over them.
    fn enter(&mut self, v: ValueId) -> Result<ValueId, PassError> {
        if let Some(&e) = self.entered.get(&v) {
            return Ok(e);
        }
        let parts = self.parts;
        let e = self.add(Op::ModelEnter { parts }, vec![v], Sharding::Whole)?;
        self.entered.insert(v, e);
        Ok(e)
    }

    /// This worker's part along `dim` of whole `v` (local).
    fn cut(&mut self, v: ValueId, dim: usize) -> Result<ValueId, PassError> {
        let parts = self.parts;
        let size = self.new.tensor_type(v).dims()[dim];
        if !size.is_multiple_of(parts) {
            return Err(PassError::Precondition(format!(
                "{} does not split into {parts} equal parts along dimension {dim} (size {size})",
                self.new.tensor_type(v)
            )));
        }
        if let Some(&c) = self.cuts.get(&(v, dim)) {
            return Ok(c);
        }
        let c = self.add(Op::ModelSplit { dim, parts }, vec![v], Sharding::Split(dim))?;
        self.cuts.insert((v, dim), c);
        Ok(c)
    }

    fn node(&mut self, id: NodeId, split: &BTreeMap<String, usize>) -> Result<(), PassError> {
        let node = self.old.node(id).clone();
        let ins: Vec<(ValueId, Sharding)> = node.inputs.iter().map(|v| self.map[v]).collect();
        let parts = self.parts;
        let (op, inputs, s) = match &node.op {
            Op::Param { name, ty, init, .. } if split.contains_key(name) => {
                let dim = split[name];
                let local = self.local_type(name, ty, dim)?;
                let v = self.add(
                    Op::Param {
                        name: shard_name(name),
                        ty: local.clone(),
                        init: init.clone(),
                        frozen: false,
                    },
                    vec![],
                    Sharding::Split(dim),
                )?;
                self.map.insert(id.into(), (v, Sharding::Split(dim)));
                self.init_and_final(name, ty, &local, init, dim)?;
                return Ok(());
            }
            // A source reads nothing, and one not split is whole on every worker.
            Op::Input { .. }
            | Op::Param { .. }
            | Op::Constant { .. }
            | Op::Pull { .. }
            | Op::Shard { .. }
            | Op::Recv { .. } => (node.op.clone(), vec![], Sharding::Whole),
            Op::MatMul {
                transpose_a: false,
                transpose_b: false,
            } if self.old.tensor_type(node.inputs[0]).shape.rank() == 2
                && self.old.tensor_type(node.inputs[1]).shape.rank() == 2 =>
            {
                // A weight split by columns (its outputs), or both operands along the
                // contracted dimension.
                self.contraction(&node.op, &ins, (1, 1), (1, 0))?
            }
            // Output channels split as matmul's columns, input channels as its rows.
            Op::Conv2d { .. } => self.contraction(&node.op, &ins, (0, 1), (1, 1))?,
            // Pooling is per sample and channel.
            Op::MaxPool2d { .. } => match ins[0].1 {
                Sharding::Split(d) if d < 2 => {
                    (node.op.clone(), vec![ins[0].0], Sharding::Split(d))
                }
                _ => (node.op.clone(), vec![self.whole(ins[0])?], Sharding::Whole),
            },
            Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Fused { .. } => {
                self.elementwise(&node.op, &ins)?
            }
            // Heads (any leading axis) split alike in q, k and v attend apart.
            Op::Attention { .. } => {
                let r = self.rank(ins[0].0);
                match (ins[0].1, ins[1].1, ins[2].1) {
                    (Sharding::Split(a), Sharding::Split(b), Sharding::Split(c))
                        if a == b && b == c && a + 2 < r =>
                    {
                        (
                            node.op.clone(),
                            vec![ins[0].0, ins[1].0, ins[2].0],
                            Sharding::Split(a),
                        )
                    }
                    _ => {
                        let all = self.all_whole(&ins)?;
                        (node.op.clone(), all, Sharding::Whole)
                    }
                }
            }
            // Same elements: a sum stays a sum, and a split survives where its parts are
            // still equal blocks of one output dimension.
            Op::Reshape { shape } => match ins[0].1 {
                Sharding::Partial => (node.op.clone(), vec![ins[0].0], Sharding::Partial),
                Sharding::Split(d) => {
                    let whole = self.old.tensor_type(node.inputs[0]).dims().to_vec();
                    match reshaped_split(&whole, d, shape.dims(), parts) {
                        Some(k) => {
                            let mut local = shape.dims().to_vec();
                            local[k] /= parts;
                            (
                                Op::Reshape {
                                    shape: Shape(local),
                                },
                                vec![ins[0].0],
                                Sharding::Split(k),
                            )
                        }
                        None => (node.op.clone(), vec![self.whole(ins[0])?], Sharding::Whole),
                    }
                }
                Sharding::Whole => (node.op.clone(), vec![ins[0].0], Sharding::Whole),
            },
            Op::Transpose { perm } => match ins[0].1 {
                Sharding::Split(d) => {
                    let k = perm.iter().position(|p| *p == d).unwrap_or(d);
                    (node.op.clone(), vec![ins[0].0], Sharding::Split(k))
                }
                s => (node.op.clone(), vec![ins[0].0], s),
            },
            Op::Neg => (node.op.clone(), vec![ins[0].0], ins[0].1),
            Op::Relu | Op::Sigmoid | Op::Tanh | Op::Exp | Op::Log => match ins[0].1 {
                Sharding::Partial => (node.op.clone(), vec![self.whole(ins[0])?], Sharding::Whole),
                s => (node.op.clone(), vec![ins[0].0], s),
            },
            Op::Softmax { axis } | Op::LogSoftmax { axis } => match ins[0].1 {
                Sharding::Split(d) if d != *axis => {
                    (node.op.clone(), vec![ins[0].0], Sharding::Split(d))
                }
                _ => (node.op.clone(), vec![self.whole(ins[0])?], Sharding::Whole),
            },
            Op::Sum { axes, keep_dims } | Op::Mean { axes, keep_dims } => {
                let is_sum = matches!(node.op, Op::Sum { .. });
                match ins[0].1 {
                    Sharding::Partial => (node.op.clone(), vec![ins[0].0], Sharding::Partial),
                    Sharding::Split(d) if axes.contains(&d) && is_sum => {
                        (node.op.clone(), vec![ins[0].0], Sharding::Partial)
                    }
                    Sharding::Split(d) if !axes.contains(&d) => {
                        let d = if *keep_dims {
                            d
                        } else {
                            d - axes.iter().filter(|a| **a < d).count()
                        };
                        (node.op.clone(), vec![ins[0].0], Sharding::Split(d))
                    }
                    _ => (node.op.clone(), vec![self.whole(ins[0])?], Sharding::Whole),
                }
            }
            Op::LayerNorm { .. } => {
                let last = self.rank(ins[0].0).saturating_sub(1);
                match ins[0].1 {
                    // gamma and beta's gradients sum over the split rows: they enter.
                    Sharding::Split(d) if d != last => {
                        let (gamma, beta) = (self.whole(ins[1])?, self.whole(ins[2])?);
                        let (gamma, beta) = (self.enter(gamma)?, self.enter(beta)?);
                        (
                            node.op.clone(),
                            vec![ins[0].0, gamma, beta],
                            Sharding::Split(d),
                        )
                    }
                    _ => {
                        let all = self.all_whole(&ins)?;
                        (node.op.clone(), all, Sharding::Whole)
                    }
                }
            }
            // A table split by rows (vocabulary-parallel): each worker looks up the ids
            // in its rows, zeros for the others; the sum over the workers is the lookup.
            Op::Embedding if ins[0].1 == Sharding::Split(0) => {
                let ids = self.whole(ins[1])?;
                (
                    Op::ModelEmbedding { parts },
                    vec![ins[0].0, ids],
                    Sharding::Partial,
                )
            }
            // A table split by columns looks up each worker's columns of every row.
            Op::Embedding if ins[0].1 == Sharding::Split(1) => {
                let ids = self.whole(ins[1])?;
                let d = self.old.tensor_type(node.inputs[1]).shape.rank();
                (node.op.clone(), vec![ins[0].0, ids], Sharding::Split(d))
            }
            // Everything else, sinks included, reads whole values: a matmul of other
            // ranks or transposed, and a lookup in a table not split by rows or columns.
            Op::MatMul { .. }
            | Op::Cast { .. }
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Embedding
            | Op::SoftmaxCrossEntropy
            | Op::Mse
            | Op::Dropout { .. }
            | Op::ReplicaReduce { .. }
            | Op::TrainOrEval
            | Op::SumTo { .. }
            | Op::BroadcastTo { .. }
            | Op::ReluGrad
            | Op::SigmoidGrad
            | Op::TanhGrad
            | Op::SoftmaxGrad { .. }
            | Op::LogSoftmaxGrad { .. }
            | Op::SoftmaxCrossEntropyGrad
            | Op::MseGrad
            | Op::EmbeddingGrad { .. }
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
            | Op::ModelEnter { .. }
            | Op::ModelAllReduce { .. }
            | Op::ModelGather { .. }
            | Op::ModelSplit { .. }
            | Op::ModelReduceScatter { .. }
            | Op::ModelEmbedding { .. }
            | Op::ModelEmbeddingGrad { .. }
            | Op::Accumulate { .. }
            | Op::UniqueRows
            | Op::Pack
            | Op::Unpack { .. }
            | Op::PackChunks { .. }
            | Op::UnpackChunks { .. }
            | Op::SparsePull { .. }
            | Op::Push { .. }
            | Op::SparsePush { .. }
            | Op::Serve { .. }
            | Op::Send { .. }
            | Op::Loss
            | Op::ParamGrad { .. }
            | Op::Output { .. }
            | Op::Assign { .. } => {
                let all = self.all_whole(&ins)?;
                (node.op.clone(), all, Sharding::Whole)
            }
        };
        let new_id = self.new.add(op, inputs)?;
        for port in 0..node.outputs.len() {
            let v = new_id.out(port as u16);
            // Extra ports (none among the ops that keep a sharding) are whole.
            let s = if port == 0 { s } else { Sharding::Whole };
            self.out.sharding.insert(v, s);
            self.map.insert(id.out(port as u16), (v, s));
        }
        Ok(())
    }

    /// `op(x, w)`, contracting x's dimension `x_in` with w's `w_in`: `w` split along
    /// `w_out` (its output features) makes the result split along `result`, `x`
    /// entering whole (Megatron's column-parallel layer); both split along the
    /// contracted dimensions make partial sums (row-parallel), a whole `x` being cut to
    /// match; `x` split by samples (dimension 0) and `w` whole keep the samples split.
    fn contraction(
        &mut self,
        op: &Op,
        ins: &[(ValueId, Sharding)],
        (w_out, result): (usize, usize),
        (x_in, w_in): (usize, usize),
    ) -> Result<(Op, Vec<ValueId>, Sharding), PassError> {
        let mut operand = |v: (ValueId, Sharding)| match v.1 {
            Sharding::Partial => self.whole(v).map(|w| (w, Sharding::Whole)),
            _ => Ok(v),
        };
        let (x, w) = (operand(ins[0])?, operand(ins[1])?);
        use Sharding::{Split, Whole};
        Ok(match (x.1, w.1) {
            (Whole, Whole) => (op.clone(), vec![x.0, w.0], Whole),
            (Whole, Split(d)) if d == w_out => {
                let e = self.enter(x.0)?;
                (op.clone(), vec![e, w.0], Split(result))
            }
            (Split(a), Split(b)) if a == x_in && b == w_in => {
                (op.clone(), vec![x.0, w.0], Sharding::Partial)
            }
            (Whole, Split(b)) if b == w_in => {
                let c = self.cut(x.0, x_in)?;
                (op.clone(), vec![c, w.0], Sharding::Partial)
            }
            // x split along the contracted dimension: the whole weight is cut to match
            // (its gradient, split, is gathered back) and the sums are partial.
            (Split(a), Whole) if a == x_in => {
                let c = self.cut(w.0, w_in)?;
                (op.clone(), vec![x.0, c], Sharding::Partial)
            }
            // The weight's gradient sums over the split samples: it enters.
            (Split(0), Whole) => {
                let e = self.enter(w.0)?;
                (op.clone(), vec![x.0, e], Split(0))
            }
            _ => {
                let (a, b) = (self.whole(x)?, self.whole(w)?);
                (op.clone(), vec![a, b], Whole)
            }
        })
    }

    /// An element-wise op with broadcasting: partial terms stay partial where the op is
    /// linear in them; split operands agreeing on the result's dimension stay split, with
    /// the whole operands cut to match.
    fn elementwise(
        &mut self,
        op: &Op,
        ins: &[(ValueId, Sharding)],
    ) -> Result<(Op, Vec<ValueId>, Sharding), PassError> {
        let partial: Vec<bool> = ins.iter().map(|v| v.1 == Sharding::Partial).collect();
        // Only a sum of partial terms stays partial: a partial times a whole value
        // would give the whole value a partial gradient.
        let linear = matches!(op, Op::Add | Op::Sub) && partial.iter().all(|p| *p);
        if partial.iter().any(|p| *p) {
            if linear {
                return Ok((
                    op.clone(),
                    ins.iter().map(|v| v.0).collect(),
                    Sharding::Partial,
                ));
            }
            // Beside a split operand, a partial one is reduce-scattered to match it (half
            // an all-reduce's bytes); elsewhere it is summed whole.
            let out_rank = ins.iter().map(|v| self.rank(v.0)).max().unwrap_or(0);
            let split = ins.iter().find_map(|v| match v.1 {
                Sharding::Split(d) => Some(d + out_rank - self.rank(v.0)),
                _ => None,
            });
            let mut summed = Vec::new();
            for v in ins {
                if v.1 != Sharding::Partial {
                    summed.push(*v);
                    continue;
                }
                let dims = self.new.tensor_type(v.0).dims().to_vec();
                let k = split
                    .and_then(|d| d.checked_sub(out_rank - dims.len()))
                    .filter(|k| dims[*k] > 1 && dims[*k].is_multiple_of(self.parts));
                summed.push(match k {
                    Some(k) => {
                        let parts = self.parts;
                        let s = Sharding::Split(k);
                        (
                            self.add(Op::ModelReduceScatter { dim: k, parts }, vec![v.0], s)?,
                            s,
                        )
                    }
                    None => (self.whole(*v)?, Sharding::Whole),
                });
            }
            return self.elementwise(op, &summed);
        }
        let out_rank = ins.iter().map(|v| self.rank(v.0)).max().unwrap_or(0);
        let dims: Vec<Option<usize>> = ins
            .iter()
            .map(|v| match v.1 {
                Sharding::Split(d) => Some(d + out_rank - self.rank(v.0)),
                _ => None,
            })
            .collect();
        let split: Vec<usize> = dims.iter().flatten().copied().collect();
        let Some(&d) = split.first() else {
            return Ok((
                op.clone(),
                ins.iter().map(|v| v.0).collect(),
                Sharding::Whole,
            ));
        };
        if split.iter().any(|x| *x != d) {
            let all = self.all_whole(ins)?;
            return Ok((op.clone(), all, Sharding::Whole));
        }
        let mut inputs = Vec::new();
        for v in ins {
            if v.1 != Sharding::Whole {
                inputs.push(v.0);
                continue;
            }
            // The whole operand's dimension under the result's split one, if it has one
            // of more than one element: cut to match. Else it broadcasts along the split
            // dimension, so each worker's gradient for it sums over its part alone: it
            // enters the split computation, and its gradient is summed over the workers.
            let offset = out_rank - self.rank(v.0);
            let cut = d
                .checked_sub(offset)
                .filter(|k| self.new.tensor_type(v.0).dims()[*k] > 1);
            inputs.push(match cut {
                Some(k) => self.cut(v.0, k)?,
                None => self.enter(v.0)?,
            });
        }
        Ok((op.clone(), inputs, Sharding::Split(d)))
    }

    fn local_type(&self, name: &str, ty: &TensorType, dim: usize) -> Result<TensorType, PassError> {
        let parts = self.parts;
        let dims = ty.dims();
        if dim >= dims.len() {
            return Err(PassError::Precondition(format!(
                "`{name}` ({ty}) is sharded along dimension {dim}, and it has {}",
                dims.len()
            )));
        }
        if !dims[dim].is_multiple_of(parts) {
            return Err(PassError::Precondition(format!(
                "`{name}` ({ty}) does not split into {parts} equal parts along dimension \
                 {dim} (size {}): give a model axis dividing it",
                dims[dim]
            )));
        }
        let mut local = dims.to_vec();
        local[dim] /= parts;
        Ok(TensorType::new(ty.dtype, Shape(local)))
    }

    /// The init program's cut of `name` and the final program's gather of it.
    fn init_and_final(
        &mut self,
        name: &str,
        ty: &TensorType,
        local: &TensorType,
        init: &distc_ir::Init,
        dim: usize,
    ) -> Result<(), PassError> {
        let parts = self.parts;
        let i = &mut self.out.init;
        let whole = i.add(
            Op::Param {
                name: name.to_string(),
                ty: ty.clone(),
                init: init.clone(),
                frozen: false,
            },
            vec![],
        )?;
        let mine = i.add(Op::ModelSplit { dim, parts }, vec![whole.into()])?;
        i.add(
            Op::Output {
                name: shard_name(name),
            },
            vec![mine.into()],
        )?;
        let f = &mut self.out.finalize;
        let part = f.add(
            Op::Param {
                name: shard_name(name),
                ty: local.clone(),
                init: init.clone(),
                frozen: false,
            },
            vec![],
        )?;
        let back = f.add(Op::ModelGather { dim, parts }, vec![part.into()])?;
        f.add(
            Op::Output {
                name: name.to_string(),
            },
            vec![back.into()],
        )?;
        Ok(())
    }
}

/// The output dimension a reshape of `from`, split into `parts` along `dim`, stays split
/// along: the one after the same leading elements whose size `parts` divides (each
/// worker's contiguous block of the flattened trailing dimensions is then an equal block
/// of it). None where the parts would interleave.
fn reshaped_split(from: &[usize], dim: usize, to: &[usize], parts: usize) -> Option<usize> {
    let lead: usize = from[..dim].iter().product();
    let mut prefix = 1;
    for (k, &n) in to.iter().enumerate() {
        if prefix == lead && n > 1 && n.is_multiple_of(parts) {
            return Some(k);
        }
        prefix *= n;
        if prefix > lead {
            return None;
        }
    }
    None
}

/// The pass: runs on the one-device forward program when the mesh has a model axis.
pub struct TensorParallel;

impl crate::Pass for TensorParallel {
    fn run(&self, _g: &mut Graph, _cx: &mut PassCx) -> Result<PassStats, PassError> {
        Err(crate::needs_program_set("tensor_parallel"))
    }

    fn run_programs(
        &self,
        p: &mut crate::ProgramSet,
        cx: &mut PassCx,
    ) -> Result<PassStats, PassError> {
        let parts = cx.strategy.model;
        if parts <= 1 {
            return Ok(PassStats::default().with_note("no model axis"));
        }
        let split = if cx.strategy.shard.is_empty() {
            megatron_pairs(&p.worker, parts)
        } else {
            cx.strategy.shard.clone()
        };
        if split.is_empty() {
            return Err(PassError::Precondition(format!(
                "nothing to split over a model axis of {parts}: the Megatron rule found no \
                 pair of matmuls whose weights split into {parts} equal parts; name the \
                 variables with shard(DIM) in the model or --shard VAR=DIM"
            )));
        }
        let (g, r) = rewrite(&p.worker, parts, &split)?;
        // What was split, for the plan's settings and `explain`.
        cx.strategy.shard = split.clone();
        p.worker = g;
        // The dump after this pass shows every value's sharding.
        p.worker_notes = r
            .sharding
            .iter()
            .map(|(v, s)| (*v, s.to_string()))
            .collect();
        p.init = (r.init.node_count() > 0).then_some(r.init);
        p.finalize = (r.finalize.node_count() > 0).then_some(r.finalize);
        let mut stats = PassStats::default().count("sharded", split.len());
        for (op, n) in &r.inserted {
            stats = stats.count(op, *n);
        }
        let list: Vec<String> = split.iter().map(|(v, d)| format!("{v}:{d}")).collect();
        Ok(stats.with_note(format!("split over {parts}: {}", list.join(" "))))
    }
}

/// Bytes one worker sends over the model axis when node `id` of `g` runs, as the ring
/// collectives count them: a `model_all_reduce` of `b` bytes sends `2 (T-1)/T b`
/// (reduce-scatter, then all-gather, of `b/T` chunks), a `model_gather` of a `b`-byte
/// part sends `(T-1) b`; every other op, nothing.
pub fn sent_bytes(g: &Graph, id: NodeId) -> f64 {
    let node = g.node(id);
    let input = || {
        node.inputs
            .first()
            .map_or(0.0, |v| g.tensor_type(*v).bytes() as f64)
    };
    match &node.op {
        Op::ModelAllReduce { parts } => {
            let t = *parts as f64;
            2.0 * (t - 1.0) / t * input()
        }
        Op::ModelGather { parts, .. } => (*parts as f64 - 1.0) * input(),
        Op::ModelReduceScatter { parts, .. } => {
            let t = *parts as f64;
            (t - 1.0) / t * input()
        }
        // Nothing over the model axis: `model_enter` and `model_split` are local (their
        // gradients are the collectives above), and the data axis is costed apart.
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::MatMul { .. }
        | Op::Add
        | Op::Sub
        | Op::Mul
        | Op::Div
        | Op::Neg
        | Op::Relu
        | Op::Sigmoid
        | Op::Tanh
        | Op::Exp
        | Op::Log
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::Sum { .. }
        | Op::Mean { .. }
        | Op::Cast { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Embedding
        | Op::SoftmaxCrossEntropy
        | Op::Mse
        | Op::Dropout { .. }
        | Op::LayerNorm { .. }
        | Op::Attention { .. }
        | Op::Conv2d { .. }
        | Op::MaxPool2d { .. }
        | Op::Fused { .. }
        | Op::ReplicaReduce { .. }
        | Op::TrainOrEval
        | Op::SumTo { .. }
        | Op::BroadcastTo { .. }
        | Op::ReluGrad
        | Op::SigmoidGrad
        | Op::TanhGrad
        | Op::SoftmaxGrad { .. }
        | Op::LogSoftmaxGrad { .. }
        | Op::SoftmaxCrossEntropyGrad
        | Op::MseGrad
        | Op::EmbeddingGrad { .. }
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
        | Op::ModelEnter { .. }
        | Op::ModelSplit { .. }
        | Op::ModelEmbedding { .. }
        | Op::ModelEmbeddingGrad { .. }
        | Op::Accumulate { .. }
        | Op::UniqueRows
        | Op::Pack
        | Op::Unpack { .. }
        | Op::PackChunks { .. }
        | Op::UnpackChunks { .. }
        | Op::Pull { .. }
        | Op::SparsePull { .. }
        | Op::Push { .. }
        | Op::SparsePush { .. }
        | Op::Shard { .. }
        | Op::Serve { .. }
        | Op::Send { .. }
        | Op::Recv { .. }
        | Op::Loss
        | Op::ParamGrad { .. }
        | Op::Output { .. }
        | Op::Assign { .. } => 0.0,
    }
}

/// Bytes one worker sends over the model axis per step of program `g`.
pub fn predicted_bytes_per_step(g: &Graph) -> f64 {
    g.node_ids().into_iter().map(|id| sent_bytes(g, id)).sum()
}

#[cfg(test)]
mod tests {
    use super::reshaped_split;

    #[test]
    fn a_reshape_keeps_a_split_where_the_parts_stay_blocks() {
        // Channels split, flattened with the pixels after them: blocks of the row.
        assert_eq!(reshaped_split(&[4, 16, 7, 7], 1, &[4, 784], 2), Some(1));
        // A split dimension cut in two: the outer one carries it.
        assert_eq!(reshaped_split(&[4, 16], 1, &[4, 4, 4], 2), Some(1));
        assert_eq!(reshaped_split(&[4, 16], 1, &[4, 4, 4], 8), None);
        // Features split, flattened after the positions before them: interleaved.
        assert_eq!(reshaped_split(&[4, 8, 32], 2, &[4, 256], 2), None);
        // Size-1 dimensions before the split one are passed over.
        assert_eq!(reshaped_split(&[1, 16], 1, &[1, 1, 16], 4), Some(2));
    }
}
