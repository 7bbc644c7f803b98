//! The attributes of each op as printed in the text IR, and the way back.
//! `attrs_of` and `op_from_parts` are inverse: the round-trip tests hold them to it.

use crate::op::{Init, Op, ReduceOp};
use crate::types::{DType, Shape, TensorType, ValueType};
use std::fmt;

/// One attribute value in the text IR.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    /// An integer.
    Int(i64),
    /// A float, printed so that it parses back bit-exact.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A quoted string.
    Str(String),
    /// A list of integers: axes, shapes.
    List(Vec<i64>),
    /// An initialiser.
    Init(Init),
    /// A tensor type.
    Type(TensorType),
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::Int(i) => write!(f, "{i}"),
            AttrValue::Float(x) => write!(f, "{x:?}"),
            AttrValue::Bool(b) => write!(f, "{b}"),
            AttrValue::Str(s) => write!(f, "{s:?}"),
            AttrValue::List(l) => {
                f.write_str("[")?;
                for (i, x) in l.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("]")
            }
            AttrValue::Init(init) => write!(f, "{init}"),
            AttrValue::Type(t) => write!(f, "{t}"),
        }
    }
}

fn list(v: &[usize]) -> AttrValue {
    AttrValue::List(v.iter().map(|&x| x as i64).collect())
}

/// The attributes of an op, in printing order. Types of sources are not attributes:
/// they are the node's result type.
pub fn attrs_of(op: &Op) -> Vec<(&'static str, AttrValue)> {
    use AttrValue as A;
    match op {
        Op::Input { name, .. } => vec![("name", A::Str(name.clone()))],
        Op::Param {
            name, init, frozen, ..
        } => {
            let mut v = vec![
                ("name", A::Str(name.clone())),
                ("init", A::Init(init.clone())),
            ];
            if *frozen {
                v.push(("frozen", A::Bool(true)));
            }
            v
        }
        Op::Constant { value, .. } => vec![("value", A::Float(*value))],
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            let mut v = Vec::new();
            if *transpose_a {
                v.push(("transpose_a", A::Bool(true)));
            }
            if *transpose_b {
                v.push(("transpose_b", A::Bool(true)));
            }
            v
        }
        Op::Add
        | Op::Sub
        | Op::Mul
        | Op::Div
        | Op::Neg
        | Op::TrainOrEval
        | Op::Relu
        | Op::Sigmoid
        | Op::Tanh
        | Op::Exp
        | Op::Log
        | Op::Embedding
        | Op::SoftmaxCrossEntropy
        | Op::Mse
        | Op::ReluGrad
        | Op::SigmoidGrad
        | Op::TanhGrad
        | Op::SoftmaxCrossEntropyGrad
        | Op::MseGrad
        | Op::ConcatSlices
        | Op::Densify
        | Op::RowMask
        | Op::Sparsify
        | Op::Loss => vec![],
        Op::Softmax { axis }
        | Op::LogSoftmax { axis }
        | Op::Concat { axis }
        | Op::SoftmaxGrad { axis }
        | Op::LogSoftmaxGrad { axis } => vec![("axis", A::Int(*axis as i64))],
        Op::Sum { axes, keep_dims } | Op::Mean { axes, keep_dims } => {
            let mut v = vec![("axes", list(axes))];
            if *keep_dims {
                v.push(("keep_dims", A::Bool(true)));
            }
            v
        }
        Op::Cast { to } => vec![("to", A::Str(to.name().to_string()))],
        Op::Reshape { shape } | Op::SumTo { shape } | Op::BroadcastTo { shape } => {
            vec![("shape", list(shape.dims()))]
        }
        Op::Transpose { perm } => vec![("perm", list(perm))],
        // A string, so the text grammar needs no expression syntax of its own.
        Op::Fused { expr } => vec![("expr", A::Str(expr.to_string()))],
        Op::Slice { axis, start, end } => vec![
            ("axis", A::Int(*axis as i64)),
            ("start", A::Int(*start as i64)),
            ("end", A::Int(*end as i64)),
        ],
        Op::Dropout {
            rate,
            seed,
            per_sample,
        }
        | Op::DropoutGrad {
            rate,
            seed,
            per_sample,
        } => vec![
            ("rate", A::Float(*rate)),
            ("seed", A::Int(*seed as i64)),
            ("per_sample", A::Bool(*per_sample)),
        ],
        Op::LayerNorm { eps } | Op::LayerNormGrad { eps } => vec![("eps", A::Float(*eps))],
        Op::Attention { causal, scale } | Op::AttentionGrad { causal, scale } => {
            vec![("causal", A::Bool(*causal)), ("scale", A::Float(*scale))]
        }
        Op::Conv2d { stride, padding } => vec![
            ("stride", A::Int(*stride as i64)),
            ("padding", A::Int(*padding as i64)),
        ],
        Op::MaxPool2d { kernel, stride } | Op::MaxPool2dGrad { kernel, stride } => vec![
            ("kernel", A::Int(*kernel as i64)),
            ("stride", A::Int(*stride as i64)),
        ],
        Op::EmbeddingGrad { table } => vec![("table", A::Type(table.clone()))],
        Op::ModelEmbedding { parts } => vec![("parts", A::Int(*parts as i64))],
        Op::ModelEmbeddingGrad { table, parts } => vec![
            ("table", A::Type(table.clone())),
            ("parts", A::Int(*parts as i64)),
        ],
        Op::Conv2dGradInput {
            stride,
            padding,
            input,
        } => vec![
            ("stride", A::Int(*stride as i64)),
            ("padding", A::Int(*padding as i64)),
            ("input", list(input.dims())),
        ],
        Op::Conv2dGradFilter {
            stride,
            padding,
            filter,
        } => vec![
            ("stride", A::Int(*stride as i64)),
            ("padding", A::Int(*padding as i64)),
            ("filter", list(filter.dims())),
        ],
        Op::ReplicaReduce { reduce } => vec![("reduce", A::Str(reduce_name(*reduce).into()))],
        Op::AllReduce {
            reduce,
            ranks_per_node,
        } => {
            let mut v = vec![("reduce", A::Str(reduce_name(*reduce).into()))];
            if *ranks_per_node > 0 {
                v.push(("ranks_per_node", A::Int(*ranks_per_node as i64)));
            }
            v
        }
        Op::AllGather { workers, reduce } => vec![
            ("workers", A::Int(*workers as i64)),
            ("reduce", A::Str(reduce_name(*reduce).into())),
        ],
        Op::Broadcast { root } => vec![("root", A::Int(*root as i64))],
        Op::ReduceScatter { workers, reduce } => vec![
            ("workers", A::Int(*workers as i64)),
            ("reduce", A::Str(reduce_name(*reduce).into())),
        ],
        Op::AllGatherDense { workers, shape } => vec![
            ("workers", A::Int(*workers as i64)),
            ("shape", list(shape.dims())),
        ],
        Op::TakeChunk { workers } => vec![("workers", A::Int(*workers as i64))],
        Op::ModelEnter { parts } | Op::ModelAllReduce { parts } => {
            vec![("parts", A::Int(*parts as i64))]
        }
        Op::ModelGather { dim, parts }
        | Op::ModelSplit { dim, parts }
        | Op::ModelReduceScatter { dim, parts } => vec![
            ("dim", A::Int(*dim as i64)),
            ("parts", A::Int(*parts as i64)),
        ],
        Op::Accumulate { micro } => vec![("micro", A::Int(*micro as i64))],
        Op::UniqueRows | Op::Pack => vec![],
        Op::Unpack { shapes } => shapes.iter().map(|s| ("shape", list(s.dims()))).collect(),
        Op::PackChunks { workers } => vec![("workers", A::Int(*workers as i64))],
        Op::UnpackChunks { workers, shapes } => {
            std::iter::once(("workers", A::Int(*workers as i64)))
                .chain(shapes.iter().map(|s| ("shape", list(s.dims()))))
                .collect()
        }
        Op::Pull { var, shards, .. }
        | Op::SparsePull { var, shards, .. }
        | Op::Push { var, shards }
        | Op::SparsePush { var, shards } => {
            let mut v = vec![("var", A::Str(var.clone()))];
            if let Op::SparsePull { table, .. } = op {
                v.push(("table", A::Type(table.clone())));
            }
            v.push(("shards", shard_list(shards)));
            v
        }
        Op::Shard {
            var,
            start,
            end,
            init,
            ..
        } => vec![
            ("var", A::Str(var.clone())),
            ("start", A::Int(*start as i64)),
            ("end", A::Int(*end as i64)),
            ("init", A::Init(init.clone())),
        ],
        Op::Serve { var } => vec![("var", A::Str(var.clone()))],
        Op::Send { stage, tag } | Op::Recv { stage, tag, .. } => vec![
            ("stage", A::Int(*stage as i64)),
            ("tag", A::Str(tag.clone())),
        ],
        Op::ParamGrad { param } => vec![("param", A::Str(param.clone()))],
        Op::Output { name } => vec![("name", A::Str(name.clone()))],
        Op::Assign { param } => vec![("param", A::Str(param.clone()))],
    }
}

/// An op as the text IR spells it: the mnemonic, then its attributes in braces
/// (`param{name="w", init=glorot}`). Lives beside [`attrs_of`] so that `op` needs
/// nothing from this module.
impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.mnemonic())?;
        let attrs = attrs_of(self);
        if !attrs.is_empty() {
            f.write_str("{")?;
            for (i, (k, v)) in attrs.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{k}={v}")?;
            }
            f.write_str("}")?;
        }
        Ok(())
    }
}

fn reduce_name(r: ReduceOp) -> &'static str {
    match r {
        ReduceOp::Sum => "sum",
        ReduceOp::Mean => "mean",
    }
}

/// Shards as a flat list `[server, start, end, server, start, end, ...]`.
fn shard_list(shards: &[(usize, usize, usize)]) -> AttrValue {
    AttrValue::List(
        shards
            .iter()
            .flat_map(|&(s, a, b)| [s as i64, a as i64, b as i64])
            .collect(),
    )
}

/// Reads attributes by name, reporting missing, mistyped and unknown ones.
struct Attrs<'a> {
    op: &'a str,
    items: Vec<(String, AttrValue)>,
}

impl<'a> Attrs<'a> {
    fn take(&mut self, key: &str) -> Option<AttrValue> {
        let i = self.items.iter().position(|(k, _)| k == key)?;
        Some(self.items.remove(i).1)
    }
    fn missing(&self, key: &str) -> String {
        format!("{}: missing attribute `{key}`", self.op)
    }
    fn mistyped(&self, key: &str, want: &str, got: &AttrValue) -> String {
        format!(
            "{}: attribute `{key}` must be {want}, found `{got}`",
            self.op
        )
    }
    fn int(&mut self, key: &str) -> Result<usize, String> {
        match self.take(key) {
            Some(AttrValue::Int(i)) if i >= 0 => Ok(i as usize),
            Some(v) => Err(self.mistyped(key, "a non-negative integer", &v)),
            None => Err(self.missing(key)),
        }
    }
    /// A `workers` attribute: 1 to [`crate::MAX_WORKERS`] (a damaged plan's huge count
    /// would overflow every chunk size computed from it).
    fn workers(&mut self) -> Result<usize, String> {
        let w = self.int("workers")?;
        if w == 0 || w > crate::MAX_WORKERS {
            return Err(format!(
                "{}: `workers` must be 1 to {}, found {w}",
                self.op,
                crate::MAX_WORKERS
            ));
        }
        Ok(w)
    }
    fn float(&mut self, key: &str) -> Result<f64, String> {
        match self.take(key) {
            Some(AttrValue::Float(x)) => Ok(x),
            Some(AttrValue::Int(i)) => Ok(i as f64),
            Some(v) => Err(self.mistyped(key, "a number", &v)),
            None => Err(self.missing(key)),
        }
    }
    fn flag(&mut self, key: &str) -> Result<bool, String> {
        match self.take(key) {
            Some(AttrValue::Bool(b)) => Ok(b),
            Some(v) => Err(self.mistyped(key, "true or false", &v)),
            None => Ok(false),
        }
    }
    fn string(&mut self, key: &str) -> Result<String, String> {
        match self.take(key) {
            Some(AttrValue::Str(s)) => Ok(s),
            Some(v) => Err(self.mistyped(key, "a string", &v)),
            None => Err(self.missing(key)),
        }
    }
    fn list(&mut self, key: &str) -> Result<Vec<usize>, String> {
        match self.take(key) {
            Some(AttrValue::List(l)) if l.iter().all(|&x| x >= 0) => {
                Ok(l.into_iter().map(|x| x as usize).collect())
            }
            Some(v) => Err(self.mistyped(key, "a list of non-negative integers", &v)),
            None => Err(self.missing(key)),
        }
    }
    fn reduce(&mut self, key: &str) -> Result<ReduceOp, String> {
        match self.take(key) {
            Some(AttrValue::Str(s)) if s == "sum" => Ok(ReduceOp::Sum),
            Some(AttrValue::Str(s)) if s == "mean" => Ok(ReduceOp::Mean),
            Some(v) => Err(self.mistyped(key, "\"sum\" or \"mean\"", &v)),
            None => Err(self.missing(key)),
        }
    }
    fn shards(&mut self, key: &str) -> Result<Vec<(usize, usize, usize)>, String> {
        let flat = self.list(key)?;
        if flat.len() % 3 != 0 {
            return Err(format!(
                "{}: `{key}` must hold (server, start, end) triples",
                self.op
            ));
        }
        Ok(flat.chunks(3).map(|c| (c[0], c[1], c[2])).collect())
    }
    fn shapes(&mut self, key: &str) -> Result<Vec<Shape>, String> {
        let mut out = Vec::new();
        while self.items.iter().any(|(k, _)| k == key) {
            out.push(self.shape(key)?);
        }
        Ok(out)
    }
    /// A shape attribute, refused when it holds more than `MAX_ELEMENTS` elements.
    fn shape(&mut self, key: &str) -> Result<Shape, String> {
        let dims = self.list(key)?;
        Shape::check_size(&dims).map_err(|e| format!("{}: `{key}`: {e}", self.op))?;
        Ok(Shape(dims))
    }
    fn init(&mut self, key: &str) -> Result<Init, String> {
        match self.take(key) {
            Some(AttrValue::Init(i)) => Ok(i),
            Some(v) => Err(self.mistyped(key, "an initialiser", &v)),
            None => Err(self.missing(key)),
        }
    }
    fn ty(&mut self, key: &str) -> Result<TensorType, String> {
        match self.take(key) {
            Some(AttrValue::Type(t)) => Ok(t),
            Some(v) => Err(self.mistyped(key, "a tensor type", &v)),
            None => Err(self.missing(key)),
        }
    }
    fn done(self, op: Op) -> Result<Op, String> {
        match self.items.first() {
            Some((k, _)) => Err(format!("{}: unknown attribute `{k}`", self.op)),
            None => Ok(op),
        }
    }
}

/// Every mnemonic the text IR knows, for error messages.
pub const MNEMONICS: &[&str] = &[
    "input",
    "param",
    "constant",
    "matmul",
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "relu",
    "sigmoid",
    "tanh",
    "exp",
    "log",
    "softmax",
    "log_softmax",
    "sum",
    "mean",
    "reshape",
    "cast",
    "transpose",
    "concat",
    "slice",
    "embedding",
    "softmax_cross_entropy",
    "mse",
    "dropout",
    "layer_norm",
    "conv2d",
    "max_pool2d",
    "fused",
    "replica_reduce",
    "train_or_eval",
    "sum_to",
    "broadcast_to",
    "relu_grad",
    "sigmoid_grad",
    "tanh_grad",
    "softmax_grad",
    "log_softmax_grad",
    "softmax_cross_entropy_grad",
    "mse_grad",
    "embedding_grad",
    "dropout_grad",
    "layer_norm_grad",
    "conv2d_grad_input",
    "conv2d_grad_filter",
    "max_pool2d_grad",
    "concat_slices",
    "densify",
    "all_reduce",
    "all_gather",
    "broadcast",
    "model_enter",
    "model_all_reduce",
    "model_gather",
    "model_split",
    "model_embedding",
    "model_embedding_grad",
    "unique_rows",
    "pack",
    "unpack",
    "pull",
    "sparse_pull",
    "push",
    "sparse_push",
    "shard",
    "serve",
    "loss",
    "param_grad",
    "output",
    "assign",
    "accumulate",
    "all_gather_dense",
    "attention",
    "attention_grad",
    "model_reduce_scatter",
    "pack_chunks",
    "recv",
    "reduce_scatter",
    "row_mask",
    "send",
    "sparsify",
    "take_chunk",
    "unpack_chunks",
];

/// Builds an op from its mnemonic, attributes and (for sources) its result type.
pub fn op_from_parts(
    mnemonic: &str,
    items: Vec<(String, AttrValue)>,
    results: &[ValueType],
) -> Result<Op, String> {
    let mut a = Attrs {
        op: mnemonic,
        items,
    };
    let source_ty = || -> Result<TensorType, String> {
        match results {
            [ValueType::Tensor(t)] => Ok(t.clone()),
            _ => Err(format!("{mnemonic}: needs one dense result type")),
        }
    };
    let op = match mnemonic {
        "input" => Op::Input {
            name: a.string("name")?,
            ty: source_ty()?,
        },
        "param" => Op::Param {
            name: a.string("name")?,
            init: a.init("init")?,
            ty: source_ty()?,
            frozen: a.flag("frozen")?,
        },
        "constant" => Op::Constant {
            value: a.float("value")?,
            ty: source_ty()?,
        },
        "matmul" => Op::MatMul {
            transpose_a: a.flag("transpose_a")?,
            transpose_b: a.flag("transpose_b")?,
        },
        "add" => Op::Add,
        "sub" => Op::Sub,
        "mul" => Op::Mul,
        "div" => Op::Div,
        "neg" => Op::Neg,
        "relu" => Op::Relu,
        "sigmoid" => Op::Sigmoid,
        "tanh" => Op::Tanh,
        "exp" => Op::Exp,
        "log" => Op::Log,
        "softmax" => Op::Softmax {
            axis: a.int("axis")?,
        },
        "log_softmax" => Op::LogSoftmax {
            axis: a.int("axis")?,
        },
        "sum" => Op::Sum {
            axes: a.list("axes")?,
            keep_dims: a.flag("keep_dims")?,
        },
        "mean" => Op::Mean {
            axes: a.list("axes")?,
            keep_dims: a.flag("keep_dims")?,
        },
        "reshape" => Op::Reshape {
            shape: a.shape("shape")?,
        },
        "cast" => {
            let name = a.string("to")?;
            match DType::from_name(&name) {
                Some(to) if to.is_float() => Op::Cast { to },
                _ => {
                    return Err(format!(
                        "cast: `to` is \"{name}\"; a float type is needed (f32, f64, bf16, f16)"
                    ))
                }
            }
        }
        "transpose" => Op::Transpose {
            perm: a.list("perm")?,
        },
        "concat" => Op::Concat {
            axis: a.int("axis")?,
        },
        "slice" => Op::Slice {
            axis: a.int("axis")?,
            start: a.int("start")?,
            end: a.int("end")?,
        },
        "embedding" => Op::Embedding,
        "softmax_cross_entropy" => Op::SoftmaxCrossEntropy,
        "mse" => Op::Mse,
        "dropout" => Op::Dropout {
            rate: a.float("rate")?,
            seed: a.int("seed")? as u64,
            per_sample: a.flag("per_sample")?,
        },
        "layer_norm" => Op::LayerNorm {
            eps: a.float("eps")?,
        },
        "attention" => Op::Attention {
            causal: a.flag("causal")?,
            scale: a.float("scale")?,
        },
        "attention_grad" => Op::AttentionGrad {
            causal: a.flag("causal")?,
            scale: a.float("scale")?,
        },
        "conv2d" => Op::Conv2d {
            stride: a.int("stride")?,
            padding: a.int("padding")?,
        },
        "max_pool2d" => Op::MaxPool2d {
            kernel: a.int("kernel")?,
            stride: a.int("stride")?,
        },
        "fused" => Op::Fused {
            expr: a
                .string("expr")?
                .parse()
                .map_err(|e| format!("fused: {e}"))?,
        },
        "sum_to" => Op::SumTo {
            shape: a.shape("shape")?,
        },
        "broadcast_to" => Op::BroadcastTo {
            shape: a.shape("shape")?,
        },
        "relu_grad" => Op::ReluGrad,
        "sigmoid_grad" => Op::SigmoidGrad,
        "tanh_grad" => Op::TanhGrad,
        "softmax_grad" => Op::SoftmaxGrad {
            axis: a.int("axis")?,
        },
        "log_softmax_grad" => Op::LogSoftmaxGrad {
            axis: a.int("axis")?,
        },
        "softmax_cross_entropy_grad" => Op::SoftmaxCrossEntropyGrad,
        "mse_grad" => Op::MseGrad,
        "embedding_grad" => Op::EmbeddingGrad {
            table: a.ty("table")?,
        },
        "model_embedding" => Op::ModelEmbedding {
            parts: a.int("parts")?,
        },
        "model_embedding_grad" => Op::ModelEmbeddingGrad {
            table: a.ty("table")?,
            parts: a.int("parts")?,
        },
        "dropout_grad" => Op::DropoutGrad {
            rate: a.float("rate")?,
            seed: a.int("seed")? as u64,
            per_sample: a.flag("per_sample")?,
        },
        "layer_norm_grad" => Op::LayerNormGrad {
            eps: a.float("eps")?,
        },
        "conv2d_grad_input" => Op::Conv2dGradInput {
            stride: a.int("stride")?,
            padding: a.int("padding")?,
            input: Shape(a.list("input")?),
        },
        "conv2d_grad_filter" => Op::Conv2dGradFilter {
            stride: a.int("stride")?,
            padding: a.int("padding")?,
            filter: Shape(a.list("filter")?),
        },
        "max_pool2d_grad" => Op::MaxPool2dGrad {
            kernel: a.int("kernel")?,
            stride: a.int("stride")?,
        },
        "concat_slices" => Op::ConcatSlices,
        "densify" => Op::Densify,
        "row_mask" => Op::RowMask,
        "sparsify" => Op::Sparsify,
        "all_reduce" => Op::AllReduce {
            reduce: a.reduce("reduce")?,
            ranks_per_node: match a.take("ranks_per_node") {
                None => 0,
                Some(AttrValue::Int(l)) if (2..=crate::MAX_WORKERS as i64).contains(&l) => {
                    l as usize
                }
                Some(v) => {
                    return Err(a.mistyped("ranks_per_node", "2 or more (absent: flat)", &v))
                }
            },
        },
        "all_gather" => Op::AllGather {
            workers: a.workers()?,
            reduce: a.reduce("reduce")?,
        },
        "reduce_scatter" => Op::ReduceScatter {
            workers: a.workers()?,
            reduce: a.reduce("reduce")?,
        },
        "all_gather_dense" => Op::AllGatherDense {
            workers: a.workers()?,
            shape: a.shape("shape")?,
        },
        "accumulate" => Op::Accumulate {
            micro: a.int("micro")?,
        },
        "take_chunk" => Op::TakeChunk {
            workers: a.workers()?,
        },
        "model_enter" => Op::ModelEnter {
            parts: a.int("parts")?,
        },
        "model_all_reduce" => Op::ModelAllReduce {
            parts: a.int("parts")?,
        },
        "model_gather" => Op::ModelGather {
            dim: a.int("dim")?,
            parts: a.int("parts")?,
        },
        "model_split" => Op::ModelSplit {
            dim: a.int("dim")?,
            parts: a.int("parts")?,
        },
        "model_reduce_scatter" => Op::ModelReduceScatter {
            dim: a.int("dim")?,
            parts: a.int("parts")?,
        },
        "broadcast" => Op::Broadcast {
            root: a.int("root")?,
        },
        "unique_rows" => Op::UniqueRows,
        "pack" => Op::Pack,
        "unpack" => Op::Unpack {
            shapes: a.shapes("shape")?,
        },
        "pack_chunks" => Op::PackChunks {
            workers: a.workers()?,
        },
        "unpack_chunks" => Op::UnpackChunks {
            workers: a.workers()?,
            shapes: a.shapes("shape")?,
        },
        "pull" => Op::Pull {
            var: a.string("var")?,
            shards: a.shards("shards")?,
            ty: source_ty()?,
        },
        "sparse_pull" => Op::SparsePull {
            var: a.string("var")?,
            table: a.ty("table")?,
            shards: a.shards("shards")?,
        },
        "push" => Op::Push {
            var: a.string("var")?,
            shards: a.shards("shards")?,
        },
        "sparse_push" => Op::SparsePush {
            var: a.string("var")?,
            shards: a.shards("shards")?,
        },
        "shard" => Op::Shard {
            var: a.string("var")?,
            start: a.int("start")?,
            end: a.int("end")?,
            init: a.init("init")?,
            ty: source_ty()?,
        },
        "serve" => Op::Serve {
            var: a.string("var")?,
        },
        "send" => Op::Send {
            stage: a.int("stage")?,
            tag: a.string("tag")?,
        },
        "recv" => Op::Recv {
            stage: a.int("stage")?,
            tag: a.string("tag")?,
            ty: source_ty()?,
        },
        "loss" => Op::Loss,
        "param_grad" => Op::ParamGrad {
            param: a.string("param")?,
        },
        "output" => Op::Output {
            name: a.string("name")?,
        },
        "assign" => Op::Assign {
            param: a.string("param")?,
        },
        "replica_reduce" => Op::ReplicaReduce {
            reduce: a.reduce("reduce")?,
        },
        "train_or_eval" => Op::TrainOrEval,
        other => {
            return Err(format!(
                "unknown op `{other}`; known ops: {}",
                MNEMONICS.join(", ")
            ))
        }
    };
    a.done(op)
}

#[cfg(test)]
mod mnemonic_tests {
    /// The unknown-op message lists every op the text IR parses: each `"name" =>` arm
    /// of `op_from_parts` is in [`super::MNEMONICS`] (13 were missing from it), and
    /// nothing else is.
    #[test]
    fn the_unknown_op_message_lists_every_op_the_parser_takes() {
        let src = include_str!("attrs.rs");
        let start = src.find("pub fn op_from_parts").expect("op_from_parts");
        let end = start + src[start..].find("other => {").expect("its fallback arm");
        let mut parsed: Vec<&str> = src[start..end]
            .lines()
            .filter_map(|l| {
                let l = l.trim_start().strip_prefix('"')?;
                let (name, rest) = l.split_once('"')?;
                rest.trim_start().starts_with("=>").then_some(name)
            })
            .collect();
        parsed.sort_unstable();
        let mut listed = super::MNEMONICS.to_vec();
        listed.sort_unstable();
        assert!(parsed.len() > 80, "only {} arms found", parsed.len());
        assert_eq!(parsed, listed);
    }
}
