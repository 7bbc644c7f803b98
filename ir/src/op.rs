//! The closed set of operations. Every concern (shape rule, gradient rule, kernel,
//! cost, text spelling) is one exhaustive `match` over [`Op`] in its own module, so a
//! new op does not compile until each of them handles it.

use crate::fused::FusedExpr;
use crate::types::{DType, Shape, TensorType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// How a parameter is initialised.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Normal distribution.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Uniform distribution on `[lo, hi)`.
    Uniform {
        /// Lower bound.
        lo: f64,
        /// Upper bound.
        hi: f64,
    },
    /// Glorot (Xavier) uniform: `U(-sqrt(6/(fan_in+fan_out)), +)`.
    Glorot,
    /// He normal: `N(0, sqrt(2/fan_in))`.
    He,
}

impl fmt::Display for Init {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Init::Zeros => f.write_str("zeros"),
            Init::Ones => f.write_str("ones"),
            Init::Normal { mean, std } => write!(f, "normal({mean:?}, {std:?})"),
            Init::Uniform { lo, hi } => write!(f, "uniform({lo:?}, {hi:?})"),
            Init::Glorot => f.write_str("glorot"),
            Init::He => f.write_str("he"),
        }
    }
}

/// What a collective reduces with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Mean over ranks.
    Mean,
}

/// One operation of the graph. Inputs are listed in the doc of each variant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // ---- sources ----
    /// A named model input fed by the data source. No inputs.
    Input {
        /// Name of the data field.
        name: String,
        /// Its type (batch dimension bound).
        ty: TensorType,
    },
    /// A trainable variable. No inputs.
    Param {
        /// Name of the variable.
        name: String,
        /// Its type.
        ty: TensorType,
        /// Its initialiser.
        init: Init,
        /// Held as it starts (its initializer or `--init`'s value): no gradient, no
        /// optimizer state, no communication.
        frozen: bool,
    },
    /// A tensor filled with one value. No inputs.
    Constant {
        /// The value of every element.
        value: f64,
        /// The type.
        ty: TensorType,
    },

    // ---- dense forward ops ----
    /// `a @ b` as numpy's matmul: the last two dimensions multiply (either side
    /// optionally transposed), the ones before them are a batch, broadcast.
    MatMul {
        /// Use `a` transposed.
        transpose_a: bool,
        /// Use `b` transposed.
        transpose_b: bool,
    },
    /// `a + b` with numpy broadcasting.
    Add,
    /// `a - b` with numpy broadcasting.
    Sub,
    /// `a * b` with numpy broadcasting.
    Mul,
    /// `a / b` with numpy broadcasting.
    Div,
    /// `-x`.
    Neg,
    /// `max(x, 0)`.
    Relu,
    /// `1 / (1 + exp(-x))`.
    Sigmoid,
    /// `tanh(x)`.
    Tanh,
    /// `exp(x)`.
    Exp,
    /// Natural logarithm.
    Log,
    /// Softmax along `axis`.
    Softmax {
        /// Axis normalised over.
        axis: usize,
    },
    /// Log-softmax along `axis`.
    LogSoftmax {
        /// Axis normalised over.
        axis: usize,
    },
    /// Sum over `axes`.
    Sum {
        /// Axes reduced (sorted, distinct).
        axes: Vec<usize>,
        /// Keep reduced axes with size 1.
        keep_dims: bool,
    },
    /// Mean over `axes`.
    Mean {
        /// Axes reduced (sorted, distinct).
        axes: Vec<usize>,
        /// Keep reduced axes with size 1.
        keep_dims: bool,
    },
    /// The same values in float type `to` (mixed precision: `bf16`/`f16` and `f32`),
    /// rounded to nearest even; its gradient is cast back to the input's type.
    Cast {
        /// The result's float type.
        to: DType,
    },
    /// Same elements, new shape.
    Reshape {
        /// Target shape.
        shape: Shape,
    },
    /// Permutes axes: output axis `i` is input axis `perm[i]`.
    Transpose {
        /// The permutation.
        perm: Vec<usize>,
    },
    /// Concatenates its inputs (one or more) along `axis`.
    Concat {
        /// Axis joined along.
        axis: usize,
    },
    /// `x[start..end]` along `axis`.
    Slice {
        /// Axis sliced.
        axis: usize,
        /// First index kept.
        start: usize,
        /// One past the last index kept.
        end: usize,
    },
    /// Row lookup: `(table [V, ..], ids i32[..]) -> [ids.., table.dims[1..]]`.
    Embedding,
    /// Mean softmax cross-entropy: `(logits [B, K], labels i32[B]) -> scalar`.
    SoftmaxCrossEntropy,
    /// Mean squared error: `(prediction, target)` of one shape `-> scalar`.
    Mse,
    /// Inverted dropout, seeded: keeps an element with probability `1 - rate` and
    /// scales it by `1 / (1 - rate)`; the mask is a function of the seed, the training
    /// step and the element index. Identity in evaluation.
    Dropout {
        /// Probability of dropping an element.
        rate: f64,
        /// Seed of the mask.
        seed: u64,
        /// Axis 0 is the batch: an element's mask index is its position in the global
        /// batch (the worker's rows come after the lower ranks' rows), so N workers of
        /// batch b drop what one device of batch N*b drops.
        per_sample: bool,
    },
    /// Layer normalisation over the last axis: `(x, gamma, beta)`.
    LayerNorm {
        /// Added to the variance.
        eps: f64,
    },
    /// Scaled dot-product attention: `(q [.., Tq, D], k [.., Tk, D], v [.., Tk, Dv]) ->
    /// [.., Tq, Dv]`, `softmax(q kᵀ * scale) v` over the last two axes, the leading
    /// axes (batch, heads) equal in all three. `causal`: query `i` attends keys `j <= i`
    /// only (PyTorch's `is_causal`). One op, and its gradient one op, so a GPU runs a
    /// fused kernel that never stores the `Tq x Tk` scores, and the tensor-parallel
    /// pass splits it by heads.
    Attention {
        /// Mask keys after the query.
        causal: bool,
        /// Multiplies the scores (`1/sqrt(D)` by default in the DSL).
        scale: f64,
    },
    /// 2-D convolution, NCHW: `(x [N,C,H,W], w [O,C,KH,KW]) -> [N,O,OH,OW]`.
    Conv2d {
        /// Stride in both spatial dims.
        stride: usize,
        /// Zero padding on each side in both spatial dims.
        padding: usize,
    },
    /// 2-D max pooling, NCHW.
    MaxPool2d {
        /// Window size in both spatial dims.
        kernel: usize,
        /// Stride in both spatial dims.
        stride: usize,
    },

    /// Element-wise ops collapsed into one node by the kernel-fusion pass: `expr` over
    /// the inputs (one or more float tensors of one dtype), each broadcast by numpy
    /// rules to the result, whose shape is the broadcast of theirs.
    Fused {
        /// What the node computes per element.
        expr: FusedExpr,
    },

    /// The sum or mean of a value over the data-parallel replicas: the identity on one
    /// device; the distribute pass makes it an `all_reduce` among the workers (a sum of
    /// a constant, the constant times the workers). Batch statistics synchronised across
    /// workers (`batch_norm(.., sync = true)`) pass through it, and so do their
    /// gradients: either reduction over replicas is its own adjoint.
    ReplicaReduce {
        /// Sum or mean.
        reduce: ReduceOp,
    },
    /// `(in_training, in_evaluation)`: the first input in a training step, the second
    /// in evaluation; the schedule computes only the one its mode reads (batch norm's
    /// batch statistics against its running ones).
    TrainOrEval,

    // ---- backward ops (introduced by autodiff) ----
    /// Sums `x` down to `shape` over broadcast dimensions (gradient of broadcasting).
    SumTo {
        /// Target shape.
        shape: Shape,
    },
    /// Broadcasts `x` to `shape` (numpy rules).
    BroadcastTo {
        /// Target shape.
        shape: Shape,
    },
    /// `(dy, x) -> dy * (x > 0)`.
    ReluGrad,
    /// `(dy, y) -> dy * y * (1 - y)` with `y = sigmoid(x)`.
    SigmoidGrad,
    /// `(dy, y) -> dy * (1 - y^2)` with `y = tanh(x)`.
    TanhGrad,
    /// `(dy, y) -> y * (dy - sum(dy * y, axis))` with `y = softmax(x)`.
    SoftmaxGrad {
        /// Axis of the softmax.
        axis: usize,
    },
    /// `(dy, y) -> dy - exp(y) * sum(dy, axis)` with `y = log_softmax(x)`.
    LogSoftmaxGrad {
        /// Axis of the log-softmax.
        axis: usize,
    },
    /// `(dloss scalar, logits, labels) -> dloss * (softmax(logits) - onehot(labels)) / B`.
    SoftmaxCrossEntropyGrad,
    /// `(dloss scalar, prediction, target) -> dloss * 2 (prediction - target) / n`.
    MseGrad,
    /// `(dy, ids) -> IndexedSlices` over a table of type `table`: the gradient of a lookup.
    EmbeddingGrad {
        /// Type of the looked-up table.
        table: TensorType,
    },
    /// `dy -> dy * mask / (1 - rate)` with the forward op's mask.
    DropoutGrad {
        /// Probability of dropping an element.
        rate: f64,
        /// Seed of the mask.
        seed: u64,
        /// As the forward op's.
        per_sample: bool,
    },
    /// `(dy, x, gamma) -> (dx, dgamma, dbeta)`: three outputs.
    LayerNormGrad {
        /// Added to the variance.
        eps: f64,
    },
    /// `(dy, q, k, v) -> (dq, dk, dv)` of an attention: three outputs, the scores
    /// recomputed rather than stored.
    AttentionGrad {
        /// As the forward op's.
        causal: bool,
        /// As the forward op's.
        scale: f64,
    },
    /// `(dy, w) -> dx` of a convolution with input shape `input`.
    Conv2dGradInput {
        /// Stride.
        stride: usize,
        /// Padding.
        padding: usize,
        /// Shape of the convolution's input.
        input: Shape,
    },
    /// `(dy, x) -> dw` of a convolution with filter shape `filter`.
    Conv2dGradFilter {
        /// Stride.
        stride: usize,
        /// Padding.
        padding: usize,
        /// Shape of the filter.
        filter: Shape,
    },
    /// `(dy, x) -> dx` of a max pool: `dy` goes to the arg-max of each window.
    MaxPool2dGrad {
        /// Window size.
        kernel: usize,
        /// Stride.
        stride: usize,
    },
    /// Joins two or more `IndexedSlices` over one dense type (indices and values concatenated).
    ConcatSlices,
    /// Turns `IndexedSlices` into the dense tensor it stands for.
    Densify,
    /// `IndexedSlices [R, ..] -> [R]`: 1 at each row the slices touch, 0 elsewhere.
    /// All-reduced beside a densified gradient, it tells which rows the global batch
    /// touched, which the values alone cannot (a touched row's sum may be zero).
    RowMask,
    /// `(dense [R, ..], mask [R]) -> IndexedSlices`: the rows whose mask is not zero,
    /// in row order. Turns an all-reduced densified gradient back into the row-sparse
    /// gradient the optimizer updates lazily, as it does on one device.
    Sparsify,

    // ---- communication (inserted by the strategy passes) ----
    /// Reduces a dense value over all workers; every worker gets the result.
    AllReduce {
        /// Sum or mean.
        reduce: ReduceOp,
        /// 0: one ring over every worker. `L > 1`: hierarchical over nodes of `L`
        /// consecutive workers (Horovod's): a reduce-scatter within each node, an
        /// all-reduce of each slice across the nodes, an all-gather within each node.
        ranks_per_node: usize,
    },
    /// Gathers every worker's `IndexedSlices` (the values scaled by `1/workers` for a
    /// mean); the result carries up to `workers` times the rows.
    AllGather {
        /// Worker count.
        workers: usize,
        /// Sum or mean.
        reduce: ReduceOp,
    },
    /// Sends a dense value from worker `root` to every worker.
    Broadcast {
        /// The sending worker.
        root: usize,
    },
    /// Sums a dense value over all workers and gives each worker its chunk: the
    /// value flattened, padded with zeros to `workers * c` elements (`c` = ceil(n /
    /// workers)), chunk `rank` (`f32[c]`). ZeRO's sharded gradient.
    ReduceScatter {
        /// Worker count.
        workers: usize,
        /// Sum or mean.
        reduce: ReduceOp,
    },
    /// Every worker's `f32[c]` chunk, concatenated in rank order and cut to `shape`
    /// (the inverse of a chunking): ZeRO's gathered parameter.
    AllGatherDense {
        /// Worker count.
        workers: usize,
        /// Shape of the whole value.
        shape: Shape,
    },
    /// This worker's chunk of a dense value, as `reduce_scatter` cuts it (flattened,
    /// zero-padded to `workers * c`, chunk `rank`). Local: no communication.
    TakeChunk {
        /// Worker count.
        workers: usize,
    },
    // ---- tensor parallelism: the model axis of a mesh (`tensor_parallel` pass) ----
    /// Megatron's `f`: the value, unchanged, entering computations split over the
    /// `parts` workers of the model axis; its gradient is summed over them.
    ModelEnter {
        /// Workers of the model axis.
        parts: usize,
    },
    /// Megatron's `g`: the sum over the model axis of every worker's partial value;
    /// its gradient enters the split computations unchanged (`model_enter`).
    ModelAllReduce {
        /// Workers of the model axis.
        parts: usize,
    },
    /// Every model-axis worker's shard, concatenated along `dim` in rank order; its
    /// gradient is this worker's shard of the gradient (`model_split`).
    ModelGather {
        /// The dimension the shards split.
        dim: usize,
        /// Workers of the model axis.
        parts: usize,
    },
    /// This worker's shard along `dim` (equal parts, in rank order) of a value every
    /// model-axis worker holds whole; local. Its gradient is gathered (`model_gather`).
    ModelSplit {
        /// The dimension split.
        dim: usize,
        /// Workers of the model axis.
        parts: usize,
    },
    /// The sum over the model axis of every worker's partial value, each worker keeping
    /// its shard along `dim` (equal parts, in rank order): for a consumer that is itself
    /// split, half the bytes of an all-reduce. Its gradient is gathered
    /// (`model_gather`): reduce-scatter and all-gather swap.
    ModelReduceScatter {
        /// The dimension the result splits.
        dim: usize,
        /// Workers of the model axis.
        parts: usize,
    },
    /// The vocabulary-parallel lookup: `(table part, ids)` where this worker holds rows
    /// `rank * R .. (rank + 1) * R` of the table (`R` the part's rows): the rows of
    /// the ids in that range, zeros for the others; summed over the model axis, the
    /// whole lookup.
    ModelEmbedding {
        /// Workers of the model axis.
        parts: usize,
    },
    /// The gradient of a `model_embedding` into its table part: `IndexedSlices` of the
    /// ids in this worker's range (local row numbers), at most one per id.
    ModelEmbeddingGrad {
        /// Type of the table part.
        table: TensorType,
        /// Workers of the model axis.
        parts: usize,
    },
    /// Gradient accumulation over `micro` micro-batches: the first `micro - 1` runs of
    /// a step add the gradient into a buffer the executor keeps (and nothing after this
    /// op runs); the last outputs the mean of all `micro` (slices: concatenated, values
    /// scaled by `1/micro`).
    Accumulate {
        /// Micro-batches per step.
        micro: usize,
    },
    /// Sums the repeated rows of `IndexedSlices`, so each row travels once.
    UniqueRows,
    /// Packs dense values (one or more, one dtype) into one flat buffer, in order.
    Pack,
    /// Splits a flat buffer into values of the given shapes (one output each).
    Unpack {
        /// Shapes of the outputs.
        shapes: Vec<Shape>,
    },
    /// Packs dense values for one bucketed `reduce_scatter`: each value flattened and
    /// cut as `take_chunk` cuts it (`c = ceil(n / workers)`, zero-padded), the buffer
    /// holding chunk 0 of every value, then chunk 1 of every value, ..., so that worker
    /// r's part of the reduce-scatter is its chunk of each value, in order.
    PackChunks {
        /// Worker count.
        workers: usize,
    },
    /// The inverse for one bucketed `all_gather_dense` of packed chunks: the buffer
    /// holds each worker's chunks of every value in turn; each output is its value
    /// whole again (padding dropped).
    UnpackChunks {
        /// Worker count.
        workers: usize,
        /// Shapes of the outputs.
        shapes: Vec<Shape>,
    },
    /// A worker's copy of variable `var`, pulled from the servers holding `shards`.
    /// No inputs.
    Pull {
        /// The variable.
        var: String,
        /// Its type.
        ty: TensorType,
        /// `(server, start row, end row)` of each shard.
        shards: Vec<(usize, usize, usize)>,
    },
    /// `(ids) -> rows`: the rows of server-held table `var` that `ids` name.
    SparsePull {
        /// The table.
        var: String,
        /// Its type.
        table: TensorType,
        /// `(server, start row, end row)` of each shard.
        shards: Vec<(usize, usize, usize)>,
    },
    /// Pushes a dense gradient of `var` to its servers. A sink.
    Push {
        /// The variable.
        var: String,
        /// `(server, start row, end row)` of each shard.
        shards: Vec<(usize, usize, usize)>,
    },
    /// Pushes the rows of an `IndexedSlices` gradient of `var`, each to the server
    /// holding it. A sink.
    SparsePush {
        /// The variable.
        var: String,
        /// `(server, start row, end row)` of each shard.
        shards: Vec<(usize, usize, usize)>,
    },
    /// On a server: rows `start..end` of variable `var`, initialised as the rows of the
    /// whole variable would be. No inputs.
    Shard {
        /// The variable.
        var: String,
        /// First row.
        start: usize,
        /// One past the last row.
        end: usize,
        /// The variable's initialiser.
        init: Init,
        /// The shard's type.
        ty: TensorType,
    },
    /// On a server: serves pulls of a shard and applies the optimizer to the pushes it
    /// receives. A sink.
    Serve {
        /// The variable.
        var: String,
    },
    /// Sends its input to pipeline stage `stage` as `tag`, once per micro-batch: a
    /// value the pipeline pass's cut makes cross stages. A sink.
    Send {
        /// The receiving stage.
        stage: usize,
        /// What the receiver names it.
        tag: String,
    },
    /// The value pipeline stage `stage` sends as `tag`, of the current micro-batch.
    /// No inputs.
    Recv {
        /// The sending stage.
        stage: usize,
        /// What the sender names it.
        tag: String,
        /// Its type.
        ty: TensorType,
    },

    // ---- sinks ----
    /// Marks the scalar training objective.
    Loss,
    /// Marks the gradient of the variable `param`.
    ParamGrad {
        /// Name of the variable.
        param: String,
    },
    /// A named result read in evaluation (e.g. `prediction`).
    Output {
        /// Name of the result.
        name: String,
    },
    /// The new value of the frozen variable `param`, written over it after each
    /// training step (batch norm's running statistics); not run in evaluation.
    Assign {
        /// Name of the variable.
        param: String,
    },
}

impl Op {
    /// The op's name in the text IR.
    pub fn mnemonic(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param { .. } => "param",
            Op::Constant { .. } => "constant",
            Op::MatMul { .. } => "matmul",
            Op::Add => "add",
            Op::Sub => "sub",
            Op::Mul => "mul",
            Op::Div => "div",
            Op::Neg => "neg",
            Op::Relu => "relu",
            Op::Sigmoid => "sigmoid",
            Op::Tanh => "tanh",
            Op::Exp => "exp",
            Op::Log => "log",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::Sum { .. } => "sum",
            Op::Mean { .. } => "mean",
            Op::Reshape { .. } => "reshape",
            Op::Cast { .. } => "cast",
            Op::Transpose { .. } => "transpose",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::Embedding => "embedding",
            Op::SoftmaxCrossEntropy => "softmax_cross_entropy",
            Op::Mse => "mse",
            Op::Dropout { .. } => "dropout",
            Op::LayerNorm { .. } => "layer_norm",
            Op::Attention { .. } => "attention",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::Conv2d { .. } => "conv2d",
            Op::MaxPool2d { .. } => "max_pool2d",
            Op::Fused { .. } => "fused",
            Op::SumTo { .. } => "sum_to",
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::ReluGrad => "relu_grad",
            Op::SigmoidGrad => "sigmoid_grad",
            Op::TanhGrad => "tanh_grad",
            Op::SoftmaxGrad { .. } => "softmax_grad",
            Op::LogSoftmaxGrad { .. } => "log_softmax_grad",
            Op::SoftmaxCrossEntropyGrad => "softmax_cross_entropy_grad",
            Op::MseGrad => "mse_grad",
            Op::EmbeddingGrad { .. } => "embedding_grad",
            Op::DropoutGrad { .. } => "dropout_grad",
            Op::LayerNormGrad { .. } => "layer_norm_grad",
            Op::Conv2dGradInput { .. } => "conv2d_grad_input",
            Op::Conv2dGradFilter { .. } => "conv2d_grad_filter",
            Op::MaxPool2dGrad { .. } => "max_pool2d_grad",
            Op::ConcatSlices => "concat_slices",
            Op::Densify => "densify",
            Op::RowMask => "row_mask",
            Op::Sparsify => "sparsify",
            Op::AllReduce { .. } => "all_reduce",
            Op::AllGather { .. } => "all_gather",
            Op::Broadcast { .. } => "broadcast",
            Op::UniqueRows => "unique_rows",
            Op::Accumulate { .. } => "accumulate",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllGatherDense { .. } => "all_gather_dense",
            Op::TakeChunk { .. } => "take_chunk",
            Op::ModelEnter { .. } => "model_enter",
            Op::ModelAllReduce { .. } => "model_all_reduce",
            Op::ModelGather { .. } => "model_gather",
            Op::ModelSplit { .. } => "model_split",
            Op::ModelReduceScatter { .. } => "model_reduce_scatter",
            Op::ModelEmbedding { .. } => "model_embedding",
            Op::ModelEmbeddingGrad { .. } => "model_embedding_grad",
            Op::Pack => "pack",
            Op::Unpack { .. } => "unpack",
            Op::PackChunks { .. } => "pack_chunks",
            Op::UnpackChunks { .. } => "unpack_chunks",
            Op::Pull { .. } => "pull",
            Op::SparsePull { .. } => "sparse_pull",
            Op::Push { .. } => "push",
            Op::SparsePush { .. } => "sparse_push",
            Op::Shard { .. } => "shard",
            Op::Serve { .. } => "serve",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Loss => "loss",
            Op::ParamGrad { .. } => "param_grad",
            Op::Output { .. } => "output",
            Op::Assign { .. } => "assign",
            Op::ReplicaReduce { .. } => "replica_reduce",
            Op::TrainOrEval => "train_or_eval",
        }
    }

    /// Whether the node marks a result and has no outputs of its own.
    pub fn is_sink(&self) -> bool {
        matches!(
            self,
            Op::Loss
                | Op::ParamGrad { .. }
                | Op::Output { .. }
                | Op::Assign { .. }
                | Op::Push { .. }
                | Op::SparsePush { .. }
                | Op::Serve { .. }
                | Op::Send { .. }
        )
    }

    /// Whether the node is a source (no inputs).
    pub fn is_source(&self) -> bool {
        matches!(
            self,
            Op::Input { .. }
                | Op::Param { .. }
                | Op::Constant { .. }
                | Op::Pull { .. }
                | Op::Shard { .. }
                | Op::Recv { .. }
        )
    }

    /// Whether the op is a collective among the workers (every worker runs it): over
    /// the data axis, or over the model axis for the `model_*` ones.
    pub fn is_collective(&self) -> bool {
        matches!(
            self,
            Op::AllReduce { .. }
                | Op::AllGather { .. }
                | Op::Broadcast { .. }
                | Op::ReduceScatter { .. }
                | Op::AllGatherDense { .. }
        ) || self.is_model_collective()
    }

    /// Whether the op is element-wise arithmetic: each output element computed from
    /// the same element of each input (numpy broadcasting), in f32 whatever the
    /// storage. The unary and binary maths, the activation gradients, `broadcast_to`,
    /// and fused chains of them; not `cast`, which changes the type.
    pub fn is_elementwise_math(&self) -> bool {
        matches!(
            self,
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
                | Op::ReluGrad
                | Op::SigmoidGrad
                | Op::TanhGrad
                | Op::BroadcastTo { .. }
                | Op::Fused { .. }
        )
    }

    /// Whether the op is a collective over the model axis of a mesh.
    pub fn is_model_collective(&self) -> bool {
        matches!(
            self,
            Op::ModelAllReduce { .. } | Op::ModelGather { .. } | Op::ModelReduceScatter { .. }
        )
    }

    /// Whether the op moves data between workers or servers.
    pub fn is_communication(&self) -> bool {
        self.is_collective()
            || matches!(
                self,
                Op::Pull { .. }
                    | Op::SparsePull { .. }
                    | Op::Push { .. }
                    | Op::SparsePush { .. }
                    | Op::Send { .. }
                    | Op::Recv { .. }
            )
    }

    /// Number of inputs the op takes, or `None` for variadic ops (at least one).
    pub fn arity(&self) -> Option<usize> {
        match self {
            Op::Input { .. }
            | Op::Param { .. }
            | Op::Constant { .. }
            | Op::Pull { .. }
            | Op::Shard { .. }
            | Op::Recv { .. } => Some(0),
            Op::AllReduce { .. }
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
            | Op::Accumulate { .. }
            | Op::UniqueRows
            | Op::Unpack { .. }
            | Op::UnpackChunks { .. }
            | Op::SparsePull { .. }
            | Op::Push { .. }
            | Op::SparsePush { .. }
            | Op::Serve { .. }
            | Op::Send { .. } => Some(1),
            Op::Neg
            | Op::Relu
            | Op::Sigmoid
            | Op::Tanh
            | Op::Exp
            | Op::Log
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::Sum { .. }
            | Op::Mean { .. }
            | Op::Reshape { .. }
            | Op::Cast { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Dropout { .. }
            | Op::MaxPool2d { .. }
            | Op::SumTo { .. }
            | Op::BroadcastTo { .. }
            | Op::DropoutGrad { .. }
            | Op::Densify
            | Op::RowMask
            | Op::Loss
            | Op::ParamGrad { .. }
            | Op::Output { .. }
            | Op::Assign { .. }
            | Op::ReplicaReduce { .. } => Some(1),
            Op::MatMul { .. }
            | Op::Sparsify
            | Op::Add
            | Op::Sub
            | Op::Mul
            | Op::Div
            | Op::Embedding
            | Op::SoftmaxCrossEntropy
            | Op::Mse
            | Op::Conv2d { .. }
            | Op::ReluGrad
            | Op::SigmoidGrad
            | Op::TanhGrad
            | Op::SoftmaxGrad { .. }
            | Op::LogSoftmaxGrad { .. }
            | Op::EmbeddingGrad { .. }
            | Op::ModelEmbedding { .. }
            | Op::ModelEmbeddingGrad { .. }
            | Op::Conv2dGradInput { .. }
            | Op::Conv2dGradFilter { .. }
            | Op::MaxPool2dGrad { .. }
            | Op::TrainOrEval => Some(2),
            Op::LayerNorm { .. }
            | Op::Attention { .. }
            | Op::SoftmaxCrossEntropyGrad
            | Op::MseGrad
            | Op::LayerNormGrad { .. } => Some(3),
            Op::AttentionGrad { .. } => Some(4),
            Op::Concat { .. }
            | Op::ConcatSlices
            | Op::Pack
            | Op::PackChunks { .. }
            | Op::Fused { .. } => None,
        }
    }
}
