//! The communication cost model: bytes a worker moves per step for each mechanism,
//! and the time those bytes take (`bytes / bandwidth + messages * latency`).
//!
//! Bytes follow `../shared/WORKLOADS.md`: a ring all-reduce counts the bytes a worker
//! sends, `2(N-1)/N * bytes`; parameter-server traffic counts what a worker pushes
//! plus what it pulls; a row on the wire carries an 8-byte index. Time is what
//! chooses in `auto`: it takes the busiest link, so a server's fan-in (N workers
//! pushing to S servers) counts against the parameter server, and a fused all-reduce's
//! latency is shared by the gradients in its bucket.
//!
//! Beside it, [`elementwise_cost`]: the flops and memory traffic of an element-wise
//! kernel, which the kernel-fusion pass reports before and after it fuses.

use crate::placement::{Mechanism, StrategyConfig};
use distc_ir::{Graph, NodeId, Op, ValueType};

/// Bytes of a row index on the wire.
pub const INDEX_BYTES: f64 = 8.0;

/// Inputs of the model for one variable.
#[derive(Clone, Copy, Debug)]
pub struct VarCost {
    /// Bytes of the variable.
    pub bytes: f64,
    /// Bytes of one row.
    pub row_bytes: f64,
    /// Distinct rows a worker touches per step (sparse variables).
    pub rows_touched: f64,
    /// Whether the gradient is sparse.
    pub sparse: bool,
}

/// Predicted cost of one mechanism for one variable.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// Bytes per step per worker, as explain reports them.
    pub bytes: f64,
    /// Seconds per step on the busiest link.
    pub time: f64,
}

/// The cost of moving `v`'s gradient (and, for `Ps`, its values) with `m`.
pub fn cost(m: Mechanism, v: VarCost, cfg: &StrategyConfig) -> Cost {
    let n = cfg.data_workers() as f64;
    let s = cfg.servers.max(1) as f64;
    let (alpha, beta) = (cfg.latency, 1.0 / cfg.bandwidth);
    let row_wire = v.row_bytes + INDEX_BYTES;
    match m {
        Mechanism::Local => Cost {
            bytes: 0.0,
            time: 0.0,
        },
        Mechanism::Allreduce => {
            if n <= 1.0 {
                return Cost {
                    bytes: 0.0,
                    time: 0.0,
                };
            }
            // A sparse gradient travels densified, with a mask of the rows it touches
            // (one f32 per row) so the update stays lazy.
            let payload = if v.sparse && v.row_bytes > 0.0 {
                v.bytes + v.bytes / v.row_bytes * 4.0
            } else {
                v.bytes
            };
            let bytes = 2.0 * (n - 1.0) / n * payload;
            // Fusion packs small gradients into one bucket, whose 2(N-1) messages they
            // share: each is charged its share of the bucket's latency.
            let bucket = cfg.bucket_mb * 1024.0 * 1024.0;
            let share = if bucket > 0.0 {
                (v.bytes / bucket).min(1.0)
            } else {
                1.0
            };
            // A ring link carries as much in as out.
            Cost {
                bytes,
                time: 2.0 * bytes * beta + 2.0 * (n - 1.0) * alpha * share,
            }
        }
        Mechanism::Allgather => {
            if n <= 1.0 {
                return Cost {
                    bytes: 0.0,
                    time: 0.0,
                };
            }
            let mine = v.rows_touched * row_wire;
            let bytes = (n - 1.0) * mine;
            Cost {
                bytes,
                time: 2.0 * bytes * beta + (n - 1.0) * alpha,
            }
        }
        Mechanism::Ps => {
            let (worker, server_fan_in, messages) = if v.sparse {
                let w = 2.0 * v.rows_touched * row_wire;
                (w, n * w / s, 2.0 * s)
            } else {
                let w = 2.0 * v.bytes;
                // A whole dense variable sits on one server, which serves every worker.
                (w, n * w, 2.0)
            };
            Cost {
                bytes: worker,
                time: worker.max(server_fan_in) * beta + messages * alpha,
            }
        }
    }
}

/// The work and memory traffic of one node's kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ComputeCost {
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written in memory: every input once, the result once.
    pub bytes: f64,
}

impl std::ops::Add for ComputeCost {
    type Output = ComputeCost;
    fn add(self, o: ComputeCost) -> ComputeCost {
        ComputeCost {
            flops: self.flops + o.flops,
            bytes: self.bytes + o.bytes,
        }
    }
}

/// The cost of an element-wise node: the ops the kernel-fusion pass groups, and
/// `fused` itself. Flops are the ops per element (a gradient op counts its formula's;
/// a fused node, its non-leaf steps) times the result's elements; bytes are the dense
/// inputs read once and the result written once, which is what fusion saves on: a
/// chain of k ops moves about k results through memory, its fused node one. `None`
/// for every other op.
pub fn elementwise_cost(g: &Graph, id: NodeId) -> Option<ComputeCost> {
    let node = g.node(id);
    let per_element = match &node.op {
        Op::Add | Op::Sub | Op::Mul | Op::Div | Op::Neg | Op::Relu | Op::Exp | Op::Log => 1,
        // Exp, add, divide; a tanh is costed alike.
        Op::Sigmoid | Op::Tanh => 3,
        Op::BroadcastTo { .. } => 0,
        // dy * step(x); dy * y * (1 - y); dy * (1 - y * y).
        Op::ReluGrad => 2,
        Op::SigmoidGrad | Op::TanhGrad => 3,
        Op::Fused { expr } => expr.steps.iter().filter(|s| !s.is_leaf()).count(),
        // Kernel fusion leaves these out of its groups (a constant it absorbs becomes a
        // literal of the fused expression; a cast stays a kernel of its own).
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::MatMul { .. }
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
        | Op::ReplicaReduce { .. }
        | Op::TrainOrEval
        | Op::SumTo { .. }
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
    };
    let out = match node.outputs.as_slice() {
        [ValueType::Tensor(t)] => t,
        _ => return None,
    };
    let elements = out.shape.dims().iter().product::<usize>() as f64;
    let mut bytes = out.bytes() as f64;
    for v in &node.inputs {
        bytes += g.value_type(*v).dense_type().bytes() as f64;
    }
    Some(ComputeCost {
        flops: per_element as f64 * elements,
        bytes,
    })
}

/// Floating-point operations of every node of `g` ([`node_flops`]): of the graph
/// right after autodiff, the model's forward and backward FLOPs for its batch, what
/// model FLOPs utilisation counts (no recompute, no optimizer, no communication).
pub fn graph_flops(g: &Graph) -> f64 {
    g.node_ids().into_iter().map(|id| node_flops(g, id)).sum()
}

/// The tokens one sample predicts, for a model whose loss is per position: the
/// positions of a cross-entropy's integer targets, followed up through reshapes to a
/// model input of `[batch, positions...]` (a language model's window of T). None for
/// a model with one label a sample.
pub fn tokens_per_sample(g: &Graph, batch: usize) -> Option<usize> {
    g.node_ids().into_iter().find_map(|id| {
        if g.op(id) != &Op::SoftmaxCrossEntropy {
            return None;
        }
        let mut v = *g.node(id).inputs.get(1)?;
        loop {
            match g.op(v.node) {
                Op::Input { ty, .. } => {
                    let dims = ty.dims();
                    return (dims.len() >= 2 && dims[0] == batch)
                        .then(|| dims[1..].iter().product());
                }
                Op::Reshape { .. } => v = *g.node(v.node).inputs.first()?,
                _ => return None,
            }
        }
    })
}

/// Floating-point operations of one node's kernel, from its types: what the pipeline
/// pass balances stages by. A product counts a multiply and an add per term (`2mnk`);
/// an element-wise op its formula's ops per result element (as [`elementwise_cost`]);
/// a reduction or a normalisation a few per input element; moving data (layout,
/// lookups, communication, sources and sinks) none. Estimates for balancing, not a
/// timing model: a kernel's speed depends on more than its flops.
pub fn node_flops(g: &Graph, id: NodeId) -> f64 {
    let node = g.node(id);
    let numel = |t: &ValueType| t.dense_type().shape.dims().iter().product::<usize>() as f64;
    let input = |i: usize| node.inputs.get(i).map_or(0.0, |v| numel(g.value_type(*v)));
    let input_dims = |i: usize| {
        node.inputs
            .get(i)
            .map(|v| g.value_type(*v).dense_type().shape.dims().to_vec())
            .unwrap_or_default()
    };
    let out = node.outputs.first().map_or(0.0, numel);
    match &node.op {
        Op::Add
        | Op::Sub
        | Op::Mul
        | Op::Div
        | Op::Neg
        | Op::Relu
        | Op::Sigmoid
        | Op::Tanh
        | Op::Exp
        | Op::Log
        | Op::Fused { .. }
        | Op::BroadcastTo { .. }
        | Op::Cast { .. }
        | Op::ReluGrad
        | Op::SigmoidGrad
        | Op::TanhGrad => elementwise_cost(g, id).map_or(0.0, |c| c.flops),
        Op::MatMul {
            transpose_a,
            transpose_b: _,
        } => {
            // The inner dimension from `a`: its last axis, or the one before when
            // transposed; every output element sums that many products.
            let a = input_dims(0);
            let k = match (a.len(), transpose_a) {
                (0, _) => 1,
                (1, _) => a[0],
                (n, false) => a[n - 1],
                (n, true) => a[n - 2],
            };
            2.0 * out * k as f64
        }
        Op::Conv2d { .. } => {
            // Each output element: C * KH * KW multiply-adds (the filter's [O,C,KH,KW]).
            let w = input_dims(1);
            let per: usize = w.iter().skip(1).product();
            2.0 * out * per as f64
        }
        Op::Conv2dGradInput { .. } => {
            // As many products as the forward convolution: dy's elements times C*KH*KW.
            let w = input_dims(1);
            let per: usize = w.iter().skip(1).product();
            2.0 * input(0) * per as f64
        }
        Op::Conv2dGradFilter { filter, .. } => {
            let per: usize = filter.dims().iter().skip(1).product();
            2.0 * input(0) * per as f64
        }
        Op::MaxPool2d { kernel, .. } => out * (kernel * kernel) as f64,
        Op::MaxPool2dGrad { kernel, .. } => input(0) * (kernel * kernel) as f64,
        // Max, subtract, exponentiate, sum, divide (and a log).
        Op::Softmax { .. } | Op::LogSoftmax { .. } => 5.0 * input(0),
        Op::SoftmaxGrad { .. } | Op::LogSoftmaxGrad { .. } => 4.0 * input(0),
        Op::SoftmaxCrossEntropy | Op::SoftmaxCrossEntropyGrad => 6.0 * input(0),
        Op::Mse | Op::MseGrad => 3.0 * input(0),
        Op::Attention { causal, .. } | Op::AttentionGrad { causal, .. } => {
            // Two products of Tq x Tk x D (scores, then values), half of them masked
            // when causal; the gradient recomputes the scores and makes four more.
            let forward = matches!(node.op, Op::Attention { .. });
            let (q, kv) = if forward {
                (input_dims(0), input_dims(1))
            } else {
                (input_dims(1), input_dims(2))
            };
            let r = q.len();
            let tk = kv.get(r.wrapping_sub(2)).copied().unwrap_or(1) as f64;
            let products = if forward { 2.0 } else { 5.0 };
            let masked = if *causal { 0.5 } else { 1.0 };
            let qn: f64 = q.iter().map(|&d| d as f64).product();
            2.0 * products * qn * tk * masked
        }
        // Mean, variance, normalise, scale and shift.
        Op::LayerNorm { .. } => 8.0 * input(0),
        Op::LayerNormGrad { .. } => 12.0 * input(1),
        Op::Dropout { .. } | Op::DropoutGrad { .. } => 2.0 * out,
        Op::Sum { .. } | Op::Mean { .. } | Op::SumTo { .. } => input(0),
        Op::EmbeddingGrad { .. } | Op::ModelEmbeddingGrad { .. } | Op::Densify | Op::UniqueRows => {
            out
        }
        Op::Accumulate { .. } => 2.0 * out,
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Embedding
        | Op::ModelEmbedding { .. }
        | Op::ConcatSlices
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
        | Op::Assign { .. }
        | Op::ReplicaReduce { .. }
        | Op::TrainOrEval => 0.0,
    }
}
