//! Mixed precision (`--precision bf16|fp16`): the forward program's arithmetic in 16
//! bits where it is safe and fast, in f32 where it is not, as TensorFlow's
//! auto_mixed_precision rewrites a graph. Runs before autodiff, which differentiates
//! the casts it inserts (a cast's gradient is cast back), so the backward pass runs in
//! the same precisions and every gradient reaches the optimizer in f32.
//!
//! Every op is in one of the lists of [`class`]: `Half` ops (matrix products and
//! convolutions) read their float inputs in 16 bits; `Full` ops (the losses,
//! softmax and log-softmax, exp and log, layer norm's statistics, reductions to a
//! scalar, model-axis collectives, the sinks) read them in f32; `Follow` ops
//! (element-wise ops, layout, pooling, dropout) run in 16 bits when one of their float
//! inputs is 16-bit, so the chains between two `Half` ops stay 16-bit, and in f32
//! otherwise. A lookup reads its f32 table and casts the rows it found (the table's
//! sparse gradient stays f32). Variables stay f32: they are the master copies, cast
//! where a 16-bit op reads them. A value is cast to a type once, however many ops read
//! it in that type, and never to the type it has. Before/after, bf16:
//! ```text
//! %2 = matmul %0, %1 : f32[64,10]     =>   %2 = cast{to="bf16"} %0 : bf16[64,784]
//! %4 = add %2, %3 : f32[64,10]             %3 = cast{to="bf16"} %1 : bf16[784,10]
//! %5 = softmax_cross_entropy %4, %l        %4 = matmul %2, %3 : bf16[64,10]
//!                                          %6 = add %4, %5 : bf16[64,10]   (%5: b cast)
//!                                          %7 = cast{to="f32"} %6 : f32[64,10]
//!                                          %8 = softmax_cross_entropy %7, %l : f32[]
//! ```

use crate::placement::Precision;
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{DType, Graph, Op, ValueId, ValueType};
use std::collections::HashMap;

/// Where an op computes under mixed precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// In 16 bits: its float inputs are cast down.
    Half,
    /// In f32: its float inputs are cast up.
    Full,
    /// As its inputs: 16 bits if one float input is, and the others are cast down.
    Follow,
    /// Reads its inputs as they are; its float result is cast down (a lookup).
    HalfResult,
}

/// The lists: which ops run in 16 bits, which in f32, which follow their inputs.
pub fn class(op: &Op, result_rank: Option<usize>) -> Class {
    match op {
        Op::MatMul { .. } | Op::Conv2d { .. } => Class::Half,
        Op::Embedding | Op::ModelEmbedding { .. } => Class::HalfResult,
        Op::SoftmaxCrossEntropy
        | Op::Mse
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::Exp
        | Op::Log
        | Op::LayerNorm { .. }
        | Op::Attention { .. }
        | Op::ModelEnter { .. }
        | Op::ModelAllReduce { .. }
        | Op::ModelGather { .. }
        | Op::ModelSplit { .. }
        | Op::ModelReduceScatter { .. }
        | Op::Loss
        | Op::Output { .. }
        | Op::ParamGrad { .. }
        // Batch statistics and the running ones they update stay f32.
        | Op::ReplicaReduce { .. }
        | Op::TrainOrEval
        | Op::Assign { .. } => Class::Full,
        // A sum or mean to a scalar (a loss, a metric) adds many terms: f32.
        Op::Sum { .. } | Op::Mean { .. } if result_rank == Some(0) => Class::Full,
        // The chains between two `Half` ops stay 16-bit through element-wise ops, layout,
        // pooling, dropout and the other sums.
        Op::Add
        | Op::Sub
        | Op::Mul
        | Op::Div
        | Op::Neg
        | Op::Relu
        | Op::Sigmoid
        | Op::Tanh
        | Op::Sum { .. }
        | Op::Mean { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Dropout { .. }
        | Op::MaxPool2d { .. }
        | Op::Fused { .. }
        | Op::SumTo { .. }
        | Op::BroadcastTo { .. } => Class::Follow,
        // `rewrite` passes over sources and casts: variables stay f32 master copies.
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant { .. }
        | Op::Cast { .. }
        | Op::Pull { .. }
        | Op::Shard { .. }
        | Op::Recv { .. } => Class::Follow,
        // Made by the passes after this one (autodiff, sparsity, distribution,
        // accumulation): they run in the precision of what they are given.
        Op::ReluGrad
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
        | Op::Send { .. } => Class::Follow,
    }
}

/// The 16-bit type of a precision (none for fp32).
pub fn half_type(p: Precision) -> Option<DType> {
    match p {
        Precision::Fp32 => None,
        Precision::Bf16 => Some(DType::BF16),
        Precision::Fp16 => Some(DType::F16),
    }
}

/// Rewrites forward program `g` for 16-bit type `half`; returns the casts inserted.
pub fn rewrite(g: &mut Graph, half: DType) -> Result<usize, PassError> {
    let mut casts: HashMap<(ValueId, DType), ValueId> = HashMap::new();
    let mut inserted = 0;
    let float_of = |g: &Graph, v: ValueId| match g.value_type(v) {
        ValueType::Tensor(t) if t.dtype.is_float() => Some(t.dtype),
        _ => None,
    };
    for id in g.topo_order() {
        let node = g.node(id).clone();
        if node.op.is_source() || matches!(node.op, Op::Cast { .. }) {
            continue;
        }
        let rank = node.outputs.first().and_then(|t| match t {
            ValueType::Tensor(t) => Some(t.shape.rank()),
            ValueType::IndexedSlices { .. } => None,
        });
        let class = class(&node.op, rank);
        let any_half = node
            .inputs
            .iter()
            .any(|v| float_of(g, *v).is_some_and(DType::is_half));
        let want = match class {
            Class::Half => Some(half),
            Class::Full => Some(DType::F32),
            Class::Follow if any_half => Some(half),
            Class::Follow => Some(DType::F32),
            Class::HalfResult => None,
        };
        if let Some(want) = want {
            for (slot, v) in node.inputs.iter().enumerate() {
                match float_of(g, *v) {
                    Some(d) if d != want && d != DType::F64 => {
                        let c = cast(g, &mut casts, &mut inserted, *v, want)?;
                        g.set_input(id, slot, c);
                    }
                    _ => {}
                }
            }
        }
        // The result's type follows the inputs it now reads.
        g.replace_op(id, node.op.clone())?;
        if class == Class::HalfResult && float_of(g, id.into()) == Some(DType::F32) {
            let users = g.users(id.into());
            let c = cast(g, &mut casts, &mut inserted, id.into(), half)?;
            for (u, slot) in users {
                g.set_input(u, slot, c);
            }
        }
    }
    Ok(inserted)
}

/// `v` as type `to`: one cast per value and type.
fn cast(
    g: &mut Graph,
    casts: &mut HashMap<(ValueId, DType), ValueId>,
    inserted: &mut usize,
    v: ValueId,
    to: DType,
) -> Result<ValueId, PassError> {
    if let Some(c) = casts.get(&(v, to)) {
        return Ok(*c);
    }
    let c: ValueId = g.add(Op::Cast { to }, vec![v])?.into();
    *inserted += 1;
    casts.insert((v, to), c);
    Ok(c)
}

/// The pass: runs on the forward program when `--precision` is bf16 or fp16.
pub struct MixedPrecision;

impl Pass for MixedPrecision {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let Some(half) = half_type(cx.strategy.precision) else {
            return Ok(PassStats::default().with_note("fp32"));
        };
        let casts = rewrite(g, half)?;
        let halves = g
            .node_ids()
            .into_iter()
            .filter(|id| {
                g.node(*id)
                    .outputs
                    .iter()
                    .any(|t| t.dense_type().dtype == half)
            })
            .count();
        Ok(PassStats::default()
            .count("casts", casts)
            .count("half_ops", halves)
            .with_note(format!("{half} with f32 master variables")))
    }
}
