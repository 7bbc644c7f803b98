//! The model block to a [`Graph`]: names resolved, op calls bound and checked, every
//! node added through [`Graph::add`] so that its shape rule runs, and shape errors
//! turned into diagnostics at the call or operator that caused them.

use super::args::{self, bind, describe, Sig, Signature};
use super::ast::{Arg, BinOp, Dim, Expr, ExprKind, Ident, InitExpr, Model, Span, Stmt, TypeExpr};
use super::error::{backticked, close_names, did_you_mean, line_of, Diag};
use super::pointwise;
use distc_ir::{
    BinaryFn, DType, FusedExpr, Graph, GraphError, Init, Op, ReduceOp, Shape, TensorType, UnaryFn,
    ValueId,
};
use distc_runtime::DataSpec;
use std::collections::{BTreeMap, HashMap};

type R<T> = Result<T, Diag>;

/// The batch dimension's name.
const BATCH: &str = "B";
/// Words that cannot name a value.
const KEYWORDS: &[&str] = &[
    "model", "train", "input", "param", "minimize", "true", "false",
];
/// The most elements one tensor may have (4 TiB of f32): keeps every size computation
/// far from overflow.
const MAX_ELEMENTS: usize = 1 << 40;
/// The largest convolution padding accepted.
const MAX_PADDING: usize = 1 << 20;

/// What a parameter of a model op takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Takes {
    /// A float tensor.
    Float,
    /// An i32 tensor of indices (messages call them by the parameter's name: `ids`,
    /// `labels`).
    Indices,
    /// A tensor of any dtype (the layout ops).
    AnyTensor,
    /// A literal: a number, a boolean or a list.
    Literal,
    /// A float tensor or a number (the operands of element-wise functions).
    Operand,
}

impl Takes {
    fn is_tensor(self) -> bool {
        !matches!(self, Takes::Literal | Takes::Operand)
    }
}

/// A parameter of a model op.
#[derive(Clone, Copy, Debug)]
struct Param {
    name: &'static str,
    /// It must be written (else it has a default).
    required: bool,
    takes: Takes,
}

/// A required float tensor.
const fn float(name: &'static str) -> Param {
    Param {
        name,
        required: true,
        takes: Takes::Float,
    }
}

/// A required i32 tensor of indices.
const fn indices(name: &'static str) -> Param {
    Param {
        name,
        required: true,
        takes: Takes::Indices,
    }
}

/// A required tensor of any dtype.
const fn any_tensor(name: &'static str) -> Param {
    Param {
        name,
        required: true,
        takes: Takes::AnyTensor,
    }
}

/// A required literal.
const fn literal(name: &'static str) -> Param {
    Param {
        name,
        required: true,
        takes: Takes::Literal,
    }
}

/// A float tensor or a number.
const fn operand(name: &'static str) -> Param {
    Param {
        name,
        required: true,
        takes: Takes::Operand,
    }
}

/// A literal with a default.
const fn optional(name: &'static str) -> Param {
    Param {
        name,
        required: false,
        takes: Takes::Literal,
    }
}

/// How a call of a model op becomes IR.
#[derive(Clone, Copy)]
enum Lowering {
    /// The IR op of a bound call. Before it runs, the tensor operands are lowered in
    /// parameter order, then checked against what their parameters take.
    Op(fn(&mut Lowerer<'_>, &Call<'_>) -> R<Op>),
    /// Variadic: binds and lowers the written arguments itself; every operand takes
    /// `operands` (concat).
    Variadic {
        operands: Takes,
        lower: fn(&mut Lowerer<'_>, &DslOp, Takes, &[Arg], Span) -> R<ValueId>,
    },
    /// An element-wise function: one `fused` node over the tensor operands. The
    /// function gets the bound call and returns the expression over the `Operand`
    /// parameters in order (`in0` the first); a number written for one becomes a
    /// constant of the expression. Its gradient, kernels and fusion are the fused
    /// node's.
    Elementwise(fn(&Call<'_>) -> R<FusedExpr>),
}

/// An op a model can call, defined in this one entry: its DSL name and parameters bind
/// a call and name it in errors (`bind`, unknown ops, "is an op, not a value"); what
/// each parameter takes decides which operands are lowered as tensors and their dtype
/// checks (and the list of ops i32 tensors may go to); `lower` makes the IR op; `loss`
/// gives `minimize` the prediction and target outputs.
struct DslOp {
    name: &'static str,
    /// In positional order.
    params: &'static [Param],
    /// The usage line shown in help.
    usage: &'static str,
    /// The result is a loss of its two tensor operands, `(prediction, target)`.
    loss: bool,
    lower: Lowering,
}

impl Signature for DslOp {
    fn name(&self) -> &'static str {
        self.name
    }
    fn params(&self) -> Vec<(&'static str, bool)> {
        self.params.iter().map(|p| (p.name, p.required)).collect()
    }
    fn usage(&self) -> &'static str {
        self.usage
    }
}

/// A bound call of a model op, for its [`Lowering::Op`].
struct Call<'e> {
    /// The op's DSL name.
    name: &'static str,
    /// The whole call.
    span: Span,
    /// The written argument of each parameter.
    slots: Vec<Option<&'e Arg>>,
    /// The type of the first tensor operand.
    x: TensorType,
}

impl<'e> Call<'e> {
    /// The written argument of parameter `i`.
    fn arg(&self, i: usize) -> Option<&'e Expr> {
        self.slots.get(i).copied().flatten().map(|a| &a.value)
    }
}

/// The ops callable in a model: one entry each, everything about the op in it. Adding
/// an op is adding its entry here (and its usage to the DSL reference in `dsl/mod.rs`;
/// the tests below check both, and that every entry lowers).
const OPS: &[DslOp] = &[
    DslOp {
        name: "matmul",
        params: &[
            float("a"),
            float("b"),
            optional("transpose_a"),
            optional("transpose_b"),
        ],
        usage: "matmul(a, b, transpose_a = false, transpose_b = false)",
        loss: false,
        lower: Lowering::Variadic {
            operands: Takes::Float,
            lower: |cx, def, _, args, span| {
                let slots = bind(def, "op", span, args)?;
                let (Some(a), Some(b)) = (slots[0], slots[1]) else {
                    return Err(Diag::new(span, "matmul needs a and b", "")
                        .help(format!("usage: {}", def.usage)));
                };
                let x = cx.tensor(&a.value, "argument `a` of `matmul`")?;
                cx.need_float(x, &a.value, def.name)?;
                let y = cx.tensor(&b.value, "argument `b` of `matmul`")?;
                cx.need_float(y, &b.value, def.name)?;
                let ta = opt_bool(slots[2].map(|a| &a.value), "`transpose_a`", false)?;
                let tb = opt_bool(slots[3].map(|a| &a.value), "`transpose_b`", false)?;
                cx.matmul(x, y, (ta, tb), span)
            },
        },
    },
    DslOp {
        name: "relu",
        params: &[float("x")],
        usage: "relu(x)",
        loss: false,
        lower: Lowering::Op(|_, _| Ok(Op::Relu)),
    },
    DslOp {
        name: "sigmoid",
        params: &[float("x")],
        usage: "sigmoid(x)",
        loss: false,
        lower: Lowering::Op(|_, _| Ok(Op::Sigmoid)),
    },
    DslOp {
        name: "tanh",
        params: &[float("x")],
        usage: "tanh(x)",
        loss: false,
        lower: Lowering::Op(|_, _| Ok(Op::Tanh)),
    },
    DslOp {
        name: "exp",
        params: &[float("x")],
        usage: "exp(x)",
        loss: false,
        lower: Lowering::Op(|_, _| Ok(Op::Exp)),
    },
    DslOp {
        name: "log",
        params: &[float("x")],
        usage: "log(x)",
        loss: false,
        lower: Lowering::Op(|_, _| Ok(Op::Log)),
    },
    DslOp {
        name: "neg",
        params: &[float("x")],
        usage: "neg(x)",
        loss: false,
        lower: Lowering::Op(|_, _| Ok(Op::Neg)),
    },
    DslOp {
        name: "gelu",
        params: &[operand("x"), optional("approximate")],
        usage: "gelu(x, approximate = \"none\")",
        loss: false,
        lower: Lowering::Elementwise(|c| {
            let f = match c.arg(1) {
                None => UnaryFn::Gelu,
                Some(e) => match args::string(e, "`approximate`")?.as_str() {
                    "none" => UnaryFn::Gelu,
                    "tanh" => UnaryFn::GeluTanh,
                    other => {
                        return Err(Diag::new(
                            e.span,
                            format!("`approximate` is \"none\" or \"tanh\", found \"{other}\""),
                            "unknown approximation",
                        ))
                    }
                },
            };
            pointwise::unary(f)
        }),
    },
    DslOp {
        name: "silu",
        params: &[operand("x")],
        usage: "silu(x)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::unary(UnaryFn::Silu)),
    },
    DslOp {
        name: "sqrt",
        params: &[operand("x")],
        usage: "sqrt(x)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::unary(UnaryFn::Sqrt)),
    },
    DslOp {
        name: "rsqrt",
        params: &[operand("x")],
        usage: "rsqrt(x)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::unary(UnaryFn::Rsqrt)),
    },
    DslOp {
        name: "pow",
        params: &[operand("x"), operand("p")],
        usage: "pow(x, p)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::binary(BinaryFn::Pow)),
    },
    DslOp {
        name: "less",
        params: &[operand("a"), operand("b")],
        usage: "less(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::binary(BinaryFn::Less)),
    },
    DslOp {
        name: "less_equal",
        params: &[operand("a"), operand("b")],
        usage: "less_equal(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::binary(BinaryFn::LessEqual)),
    },
    DslOp {
        name: "greater",
        params: &[operand("a"), operand("b")],
        usage: "greater(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::binary(BinaryFn::Greater)),
    },
    DslOp {
        name: "greater_equal",
        params: &[operand("a"), operand("b")],
        usage: "greater_equal(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::binary(BinaryFn::GreaterEqual)),
    },
    DslOp {
        name: "equal",
        params: &[operand("a"), operand("b")],
        usage: "equal(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::binary(BinaryFn::Equal)),
    },
    DslOp {
        name: "not_equal",
        params: &[operand("a"), operand("b")],
        usage: "not_equal(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::binary(BinaryFn::NotEqual)),
    },
    DslOp {
        name: "where",
        params: &[operand("cond"), operand("a"), operand("b")],
        usage: "where(cond, a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::select()),
    },
    DslOp {
        name: "maximum",
        params: &[operand("a"), operand("b")],
        usage: "maximum(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::maximum(true)),
    },
    DslOp {
        name: "minimum",
        params: &[operand("a"), operand("b")],
        usage: "minimum(a, b)",
        loss: false,
        lower: Lowering::Elementwise(|_| pointwise::maximum(false)),
    },
    DslOp {
        name: "rms_norm",
        params: &[float("x"), float("gamma"), optional("eps")],
        usage: "rms_norm(x, gamma, eps = 1e-6)",
        loss: false,
        lower: Lowering::Variadic {
            operands: Takes::Float,
            lower: |cx, def, _, args, span| cx.rms_norm(def, args, span),
        },
    },
    DslOp {
        name: "batch_norm",
        params: &[
            float("x"),
            float("gamma"),
            float("beta"),
            optional("momentum"),
            optional("eps"),
            optional("sync"),
        ],
        usage: "batch_norm(x, gamma, beta, momentum = 0.1, eps = 1e-5, sync = true)",
        loss: false,
        lower: Lowering::Variadic {
            operands: Takes::Float,
            lower: |cx, def, _, args, span| cx.batch_norm(def, args, span),
        },
    },
    DslOp {
        name: "softmax",
        params: &[float("x"), optional("axis")],
        usage: "softmax(x, axis = -1)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let axis = axis_arg(c.arg(1), -1, &c.x, c.span, c.name)?;
            Ok(Op::Softmax { axis })
        }),
    },
    DslOp {
        name: "log_softmax",
        params: &[float("x"), optional("axis")],
        usage: "log_softmax(x, axis = -1)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let axis = axis_arg(c.arg(1), -1, &c.x, c.span, c.name)?;
            Ok(Op::LogSoftmax { axis })
        }),
    },
    DslOp {
        name: "sum",
        params: &[float("x"), optional("axes"), optional("keep_dims")],
        usage: "sum(x, axes = [..], keep_dims = false)  (axes default: all)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let (axes, keep_dims) = reduction(c)?;
            Ok(Op::Sum { axes, keep_dims })
        }),
    },
    DslOp {
        name: "mean",
        params: &[float("x"), optional("axes"), optional("keep_dims")],
        usage: "mean(x, axes = [..], keep_dims = false)  (axes default: all)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let (axes, keep_dims) = reduction(c)?;
            Ok(Op::Mean { axes, keep_dims })
        }),
    },
    DslOp {
        name: "reshape",
        params: &[any_tensor("x"), literal("shape")],
        usage: "reshape(x, [B, 1024])  (one dimension may be -1)",
        loss: false,
        lower: Lowering::Op(|cx, c| {
            let e = c
                .arg(1)
                .ok_or_else(|| Diag::new(c.span, "reshape needs a shape", ""))?;
            Ok(Op::Reshape {
                shape: cx.reshape_target(e, &c.x)?,
            })
        }),
    },
    DslOp {
        name: "transpose",
        params: &[any_tensor("x"), optional("perm")],
        usage: "transpose(x, [1, 0])  (default: axes reversed)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let perm = match c.arg(1) {
                None => (0..c.x.shape.rank()).rev().collect(),
                Some(e) => {
                    let mut perm = Vec::new();
                    for (a, at) in args::int_list(e, "`perm`")? {
                        perm.push(normalize_axis(a, &c.x, at, c.name)?);
                    }
                    perm
                }
            };
            Ok(Op::Transpose { perm })
        }),
    },
    DslOp {
        name: "concat",
        params: &[optional("axis")],
        usage: "concat([a, b, ...], axis = 0) or concat(a, b, ..., axis = 0)",
        loss: false,
        lower: Lowering::Variadic {
            operands: Takes::AnyTensor,
            lower: |cx, def, takes, args, span| cx.concat(def, takes, args, span),
        },
    },
    DslOp {
        name: "slice",
        params: &[
            any_tensor("x"),
            literal("axis"),
            literal("start"),
            literal("end"),
        ],
        usage: "slice(x, axis = 1, start = 0, end = 10)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let (Some(ae), Some(se), Some(ee)) = (c.arg(1), c.arg(2), c.arg(3)) else {
                return Err(Diag::new(c.span, "slice needs axis, start and end", ""));
            };
            let x_ty = &c.x;
            let axis = normalize_axis(args::int(ae, "`axis`")?, x_ty, ae.span, c.name)?;
            let start = args::usize_(se, "`start`", 0)?;
            let end = args::usize_(ee, "`end`", 1)?;
            let len = x_ty.dims()[axis];
            if start >= end || end > len {
                return Err(Diag::new(
                    se.span.to(ee.span),
                    format!(
                        "slice {start}..{end} is empty or outside axis {axis} of {x_ty} (length {len})"
                    ),
                    format!("expected 0 <= start < end <= {len}"),
                ));
            }
            Ok(Op::Slice { axis, start, end })
        }),
    },
    DslOp {
        name: "embedding",
        params: &[float("table"), indices("ids")],
        usage: "embedding(table, ids)",
        loss: false,
        lower: Lowering::Op(|_, _| Ok(Op::Embedding)),
    },
    DslOp {
        name: "softmax_cross_entropy",
        params: &[float("logits"), indices("labels")],
        usage: "softmax_cross_entropy(logits, labels)",
        loss: true,
        lower: Lowering::Variadic {
            operands: Takes::Float,
            lower: |cx, def, _, args, span| cx.cross_entropy(def, args, span),
        },
    },
    DslOp {
        name: "mse",
        params: &[float("prediction"), float("target")],
        usage: "mse(prediction, target)",
        loss: true,
        lower: Lowering::Op(|_, _| Ok(Op::Mse)),
    },
    DslOp {
        name: "dropout",
        params: &[float("x"), optional("rate")],
        usage: "dropout(x, rate = 0.5)",
        loss: false,
        lower: Lowering::Op(|cx, c| {
            let rate = match c.arg(1) {
                None => 0.5,
                Some(e) => {
                    let r = args::float(e, "the dropout `rate`")?;
                    if !(0.0..1.0).contains(&r) {
                        return Err(Diag::new(
                            e.span,
                            format!("the dropout rate must be in [0, 1), found {r}"),
                            "out of range",
                        ));
                    }
                    r
                }
            };
            // Within i64: the text IR's integers are signed (a seed of 2^53 made a
            // plan its own loader refused). Seeds below 2^53 are unchanged by the mask.
            let seed = cx.seed.wrapping_mul(1000).wrapping_add(cx.dropouts) & (i64::MAX as u64);
            cx.dropouts += 1;
            Ok(Op::Dropout {
                rate,
                seed,
                per_sample: false,
            })
        }),
    },
    DslOp {
        name: "layer_norm",
        params: &[float("x"), float("gamma"), float("beta"), optional("eps")],
        usage: "layer_norm(x, gamma, beta, eps = 1e-5)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let eps = match c.arg(3) {
                None => 1e-5,
                Some(e) => {
                    let v = args::float(e, "`eps`")?;
                    if v <= 0.0 {
                        return Err(Diag::new(
                            e.span,
                            format!("`eps` must be positive, found {v}"),
                            "must be > 0",
                        ));
                    }
                    v
                }
            };
            Ok(Op::LayerNorm { eps })
        }),
    },
    DslOp {
        name: "attention",
        params: &[
            float("q"),
            float("k"),
            float("v"),
            optional("causal"),
            optional("scale"),
        ],
        usage: "attention(q, k, v, causal = false, scale = 1 / sqrt(D))",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let causal = opt_bool(c.arg(3), "`causal`", false)?;
            let d = c.x.dims().last().copied().unwrap_or(1).max(1);
            let scale = match c.arg(4) {
                None => 1.0 / (d as f64).sqrt(),
                Some(e) => {
                    let v = args::float(e, "`scale`")?;
                    if !v.is_finite() || v <= 0.0 {
                        return Err(Diag::new(
                            e.span,
                            format!("`scale` must be a positive number, found {v}"),
                            "must be > 0",
                        ));
                    }
                    v
                }
            };
            Ok(Op::Attention { causal, scale })
        }),
    },
    DslOp {
        name: "conv2d",
        params: &[
            float("x"),
            float("w"),
            optional("stride"),
            optional("padding"),
        ],
        usage: "conv2d(x, w, stride = 1, padding = 0)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let stride = opt_usize(c.arg(2), "`stride`", 1, 1)?;
            let padding = opt_usize(c.arg(3), "`padding`", 0, 0)?;
            if padding > MAX_PADDING {
                let at = c.arg(3).map_or(c.span, |e| e.span);
                return Err(Diag::new(
                    at,
                    format!("padding {padding} is too large"),
                    "too large",
                ));
            }
            Ok(Op::Conv2d { stride, padding })
        }),
    },
    DslOp {
        name: "max_pool2d",
        params: &[float("x"), optional("kernel"), optional("stride")],
        usage: "max_pool2d(x, kernel = 2, stride = kernel)",
        loss: false,
        lower: Lowering::Op(|_, c| {
            let kernel = opt_usize(c.arg(1), "`kernel`", 2, 1)?;
            let stride = opt_usize(c.arg(2), "`stride`", kernel, 1)?;
            Ok(Op::MaxPool2d { kernel, stride })
        }),
    },
];

/// The axes and `keep_dims` of `sum` and `mean` (axes default: all, sorted, each once).
fn reduction(c: &Call<'_>) -> R<(Vec<usize>, bool)> {
    let axes = match c.arg(1) {
        None => (0..c.x.shape.rank()).collect(),
        Some(e) => {
            let mut axes = Vec::new();
            for (a, at) in args::int_list(e, "`axes`")? {
                let ax = normalize_axis(a, &c.x, at, c.name)?;
                if axes.contains(&ax) {
                    return Err(Diag::new(
                        at,
                        format!("axis {ax} appears twice in `axes`"),
                        "repeated axis",
                    ));
                }
                axes.push(ax);
            }
            axes.sort_unstable();
            axes
        }
    };
    let keep_dims = opt_bool(c.arg(2), "`keep_dims`", false)?;
    Ok((axes, keep_dims))
}

/// Where i32 tensors may go, derived from the table: the ops that take indices, then
/// those that take tensors of any dtype.
fn i32_help() -> String {
    let takes = |want: fn(Takes) -> bool| {
        OPS.iter().filter(move |op| {
            op.params.iter().any(|p| want(p.takes))
                || matches!(op.lower, Lowering::Variadic { operands, .. } if want(operands))
        })
    };
    let mut roles: Vec<&str> = Vec::new();
    for p in OPS.iter().flat_map(|op| op.params) {
        if p.takes == Takes::Indices && !roles.contains(&p.name) {
            roles.push(p.name);
        }
    }
    let ops: Vec<&str> = takes(|t| t == Takes::Indices)
        .chain(takes(|t| t == Takes::AnyTensor))
        .map(|op| op.name)
        .collect();
    let list = match ops.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => ops.join(""),
    };
    format!("i32 tensors ({}) can only go to {list}", roles.join(", "))
}

const INITS: &[Sig] = &[
    Sig {
        name: "zeros",
        params: &[],
        usage: "zeros",
    },
    Sig {
        name: "ones",
        params: &[],
        usage: "ones",
    },
    Sig {
        name: "normal",
        params: &[("mean", true), ("std", true)],
        usage: "normal(mean, std)",
    },
    Sig {
        name: "uniform",
        params: &[("lo", true), ("hi", true)],
        usage: "uniform(lo, hi)",
    },
    Sig {
        name: "glorot",
        params: &[],
        usage: "glorot",
    },
    Sig {
        name: "he",
        params: &[],
        usage: "he",
    },
];

/// The names of the ops a model can call.
pub(crate) fn op_names() -> impl Iterator<Item = &'static str> {
    OPS.iter().map(|s| s.name)
}

/// A value during lowering: a tensor in the graph or a number not yet given a type.
#[derive(Clone, Copy, Debug)]
enum Val {
    Tensor(ValueId),
    Number(f64),
}

/// What a name is bound to, and where it was defined.
struct Binding {
    val: Val,
    span: Span,
    what: &'static str,
}

/// What the lowering of a model produces.
pub(crate) struct Lowered {
    pub graph: Graph,
    /// With `pipeline_stage` markers: each variable's stage, the stage of the
    /// statement first using it.
    pub stage_marks: Option<BTreeMap<String, usize>>,
    /// The variables marked `shard(DIM)`: split along DIM over a model axis.
    pub shards: BTreeMap<String, usize>,
}

struct Lowerer<'a> {
    graph: Graph,
    scope: HashMap<String, Binding>,
    /// Names in definition order (for suggestions that are deterministic).
    order: Vec<String>,
    batch: usize,
    seed: u64,
    data: &'a DataSpec,
    src: &'a str,
    dropouts: u64,
    /// The operands of each loss op's result: `(prediction, target)`.
    loss_parts: HashMap<ValueId, (ValueId, ValueId)>,
    /// A batch flattened for a product, once per value: q, k and v projections of one
    /// input read one reshape (which the tensor-parallel pass then enters once).
    flattened: HashMap<ValueId, ValueId>,
}

/// Lowers a model with `B` bound to `batch`; inputs are checked against `data`.
pub(crate) fn lower_model(
    model: &Model,
    batch: usize,
    seed: u64,
    data: &DataSpec,
    src: &str,
) -> R<Lowered> {
    let mut cx = Lowerer {
        graph: Graph::new(model.name.name.clone()),
        scope: HashMap::new(),
        order: Vec::new(),
        batch,
        seed,
        data,
        src,
        dropouts: 0,
        loss_parts: HashMap::new(),
        flattened: HashMap::new(),
    };
    let mut minimized: Option<Span> = None;
    // The markers so far, and per statement other than a marker: the node count after
    // it and the markers before it (see `stage_of_variables`).
    let mut marks: Vec<Span> = Vec::new();
    let mut ends: Vec<StatementEnd> = Vec::new();
    let mut shards: BTreeMap<String, usize> = BTreeMap::new();
    for stmt in &model.stmts {
        if let Stmt::StageMark { span } = stmt {
            marks.push(*span);
            continue;
        }
        match stmt {
            Stmt::Input { name, ty, .. } => {
                cx.define_check(name)?;
                let t = cx.input_type(name, ty)?;
                let v = cx.add(
                    Op::Input {
                        name: name.name.clone(),
                        ty: t,
                    },
                    vec![],
                    name.span,
                    "",
                )?;
                cx.define(name, Val::Tensor(v), "an input");
            }
            Stmt::Param {
                name,
                ty,
                init,
                shard,
                frozen,
                ..
            } => {
                cx.define_check(name)?;
                let t = cx.param_type(ty)?;
                if let Some((dim, span)) = *shard {
                    let rank = t.shape.rank();
                    if dim >= rank {
                        return Err(Diag::new(
                            span,
                            format!(
                                "`{}` ({t}) has {rank} dimension{}; shard({dim}) names dimension {dim}",
                                name.name,
                                if rank == 1 { "" } else { "s" }
                            ),
                            "no such dimension",
                        )
                        .help(format!("dimensions count from 0: shard(0) .. shard({})", rank.saturating_sub(1))));
                    }
                    shards.insert(name.name.clone(), dim);
                }
                let init = lower_init(init)?;
                let v = cx.add(
                    Op::Param {
                        name: name.name.clone(),
                        ty: t,
                        init,
                        frozen: *frozen,
                    },
                    vec![],
                    name.span,
                    "",
                )?;
                cx.define(name, Val::Tensor(v), "a param");
            }
            Stmt::Let { name, value } => {
                cx.define_check(name)?;
                let v = cx.expr(value)?;
                cx.define(name, v, "a value");
            }
            Stmt::Minimize { expr, span } => {
                if let Some(first) = minimized {
                    return Err(Diag::new(
                        *span,
                        "a model has one `minimize`, this is the second",
                        "second objective",
                    )
                    .help(format!(
                        "the first is on line {}; to train on several terms, minimize their sum: `minimize a + b`",
                        line_of(cx.src, first.start)
                    )));
                }
                cx.minimize(expr)?;
                minimized = Some(*span);
            }
            Stmt::StageMark { .. } => {}
        }
        ends.push(StatementEnd {
            nodes: cx.graph.node_count(),
            marks: marks.len(),
        });
    }
    if minimized.is_none() {
        return Err(Diag::new(
            model.header,
            format!("model `{}` has no `minimize` statement", model.name.name),
            "nothing to train",
        )
        .help("end the model with the objective, e.g. `minimize softmax_cross_entropy(logits, label)`"));
    }
    let stage_marks = if marks.is_empty() {
        None
    } else {
        let stage_of = stage_of_variables(&cx.graph, &ends);
        // Every stage starts with a variable of its own: the markers cut between
        // layers, not inside one.
        for stage in 0..=marks.len() {
            if stage_of.values().any(|&s| s == stage) {
                continue;
            }
            return Err(if stage == 0 {
                Diag::new(
                    marks[0],
                    "no variable is used before the first `pipeline_stage`",
                    "stage 0 would hold nothing",
                )
                .help("put the marker after the statements of the first layers")
            } else {
                Diag::new(
                    marks[stage - 1],
                    format!("the stage this marker starts (stage {stage}) uses no variable first"),
                    "an empty stage",
                )
                .help("a stage starts with the first statement using a variable not used before; move the marker before such a statement, or drop it")
            });
        }
        Some(stage_of)
    };
    Ok(Lowered {
        graph: cx.graph,
        stage_marks,
        shards,
    })
}

/// Where a statement other than a `pipeline_stage` marker ended: the graph's node count
/// after it, and the markers before it (its stage).
#[derive(Clone, Copy)]
struct StatementEnd {
    nodes: usize,
    marks: usize,
}

/// Each variable's stage: the stage of the statement that added its first user. Lowering
/// only adds nodes, so node ids count up in statement order and the statement that
/// added node `n` is the first whose end count exceeds `n`. Found once at the end: asking
/// after every statement which variables had gained a user rescanned the whole graph
/// per statement, quadratic (issue 35 item 13).
fn stage_of_variables(graph: &Graph, ends: &[StatementEnd]) -> BTreeMap<String, usize> {
    graph
        .params()
        .into_iter()
        .filter_map(|(id, name, _)| {
            // `user_nodes` is in id order: the first is the earliest user.
            let first = graph.user_nodes(id).first()?.0 as usize;
            let stmt = ends.partition_point(|end| end.nodes <= first);
            // Every node is added by a statement, so `stmt` is one of them.
            Some((name.to_string(), ends[stmt].marks))
        })
        .collect()
}

fn lower_init(init: &InitExpr) -> R<Init> {
    let Some(sig) = INITS.iter().find(|s| s.name == init.name.name) else {
        let names: Vec<&str> = INITS.iter().map(|s| s.name).collect();
        let help = match did_you_mean(&init.name.name, names.iter().copied()) {
            Some(s) => s,
            None => {
                "the initialisers are: zeros, ones, normal(mean, std), uniform(lo, hi), glorot, he"
                    .into()
            }
        };
        return Err(Diag::new(
            init.name.span,
            format!("unknown initialiser `{}`", init.name.name),
            "not an initialiser",
        )
        .help(help));
    };
    let no_args: Vec<Arg> = Vec::new();
    let written = init.args.as_ref().unwrap_or(&no_args);
    let slots = bind(sig, "initialiser", init.span, written)?;
    let num = |i: usize, what: &str| -> R<f64> {
        match slots[i] {
            Some(a) => args::float(&a.value, what),
            None => Ok(0.0),
        }
    };
    Ok(match sig.name {
        "zeros" => Init::Zeros,
        "ones" => Init::Ones,
        "glorot" => Init::Glorot,
        "he" => Init::He,
        "normal" => {
            let (mean, std) = (num(0, "`mean`")?, num(1, "`std`")?);
            if std < 0.0 {
                let at = slots[1].map_or(init.span, |a| a.value.span);
                return Err(Diag::new(
                    at,
                    format!("the standard deviation must not be negative, found {std}"),
                    "negative",
                ));
            }
            Init::Normal { mean, std }
        }
        _ => {
            let (lo, hi) = (num(0, "`lo`")?, num(1, "`hi`")?);
            if lo > hi {
                return Err(Diag::new(
                    init.span,
                    format!("`uniform({lo}, {hi})` has its bounds in the wrong order"),
                    "lo > hi",
                )
                .help(format!("write `uniform({hi}, {lo})`")));
            }
            Init::Uniform { lo, hi }
        }
    })
}

impl Lowerer<'_> {
    // ------------------------------------------------------------ names

    /// Refuses a name that is reserved or already defined.
    fn define_check(&self, name: &Ident) -> R<()> {
        if name.name == BATCH {
            return Err(Diag::new(
                name.span,
                "`B` is the batch dimension and cannot name a value",
                "reserved name",
            ));
        }
        if KEYWORDS.contains(&name.name.as_str()) {
            return Err(Diag::new(
                name.span,
                format!("`{}` is a keyword and cannot name a value", name.name),
                "reserved name",
            ));
        }
        if let Some(b) = self.scope.get(&name.name) {
            return Err(Diag::new(
                name.span,
                format!("`{}` is defined twice", name.name),
                "redefined here",
            )
            .help(format!(
                "`{}` is already {} on line {}; each name is defined once",
                name.name,
                b.what,
                line_of(self.src, b.span.start)
            )));
        }
        Ok(())
    }

    fn define(&mut self, name: &Ident, val: Val, what: &'static str) {
        self.order.push(name.name.clone());
        self.scope.insert(
            name.name.clone(),
            Binding {
                val,
                span: name.span,
                what,
            },
        );
    }

    fn lookup(&self, name: &str, at: Span) -> R<Val> {
        if let Some(b) = self.scope.get(name) {
            return Ok(b.val);
        }
        if name == BATCH {
            return Err(b_misuse(at));
        }
        if OPS.iter().any(|s| s.name == name) {
            return Err(Diag::new(
                at,
                format!("`{name}` is an op, not a value"),
                "missing arguments",
            )
            .help(format!("call it: `{name}(...)`")));
        }
        let help = did_you_mean(name, self.order.iter().map(String::as_str));
        Err(
            Diag::new(at, format!("unknown name `{name}`"), "not defined").maybe_help(
                help.or_else(|| {
                    (!self.order.is_empty()).then(|| {
                        let names: Vec<&str> = self.order.iter().map(String::as_str).collect();
                        format!("the names defined so far are {}", backticked(&names, "and"))
                    })
                }),
            ),
        )
    }

    // ------------------------------------------------------------ types

    fn dtype(&self, ty: &TypeExpr) -> R<DType> {
        // A model is written in f32: 16-bit arithmetic is a compile flag, and its
        // variables stay f32 masters.
        match DType::from_name(&ty.dtype.name) {
            Some(d) if !d.is_half() => Ok(d),
            Some(d) => Err(Diag::new(
                ty.dtype.span,
                format!("`{d}` is not an element type of a model"),
                "not a model type",
            )
            .help(
                "write the model in f32 and compile with --precision bf16 or fp16: 16-bit \
                 arithmetic where it is safe, f32 master variables",
            )),
            None => Err(Diag::new(
                ty.dtype.span,
                format!("unknown element type `{}`", ty.dtype.name),
                "not a type",
            )
            .help("the element types are f32, f64 and i32")),
        }
    }

    fn number_dim(&self, text: &str, at: Span) -> R<usize> {
        let e = Expr {
            kind: ExprKind::Number(text.to_string()),
            span: at,
        };
        args::usize_(&e, "a dimension", 1)
    }

    /// `[B, d1, ...]` of an input: `B` first and only there.
    fn input_type(&self, name: &Ident, ty: &TypeExpr) -> R<TensorType> {
        let dtype = self.dtype(ty)?;
        let mut dims = Vec::with_capacity(ty.dims.len());
        for (i, d) in ty.dims.iter().enumerate() {
            match d {
                Dim::Name(n) if n.name == BATCH && i == 0 => dims.push(self.batch),
                Dim::Name(n) if n.name == BATCH => return Err(b_misuse(n.span)),
                Dim::Name(n) => return Err(bad_dim_name(n)),
                Dim::Number(text, at) => dims.push(self.number_dim(text, *at)?),
            }
        }
        if !matches!(ty.dims.first(), Some(Dim::Name(n)) if n.name == BATCH) {
            let at = match ty.dims.first() {
                Some(Dim::Number(_, s)) => *s,
                _ => ty.span,
            };
            return Err(Diag::new(
                at,
                format!(
                    "the first dimension of input `{}` must be the batch `B`",
                    name.name
                ),
                "expected `B`",
            )
            .help(format!(
                "inputs hold one batch: write `{}[B, ...]`",
                ty.dtype.name
            )));
        }
        let t = TensorType::new(dtype, dims);
        check_size(&t, ty.span)?;
        self.check_field(name, &t, ty)?;
        Ok(t)
    }

    /// The type of a param: numbers only.
    fn param_type(&self, ty: &TypeExpr) -> R<TensorType> {
        let dtype = self.dtype(ty)?;
        let mut dims = Vec::with_capacity(ty.dims.len());
        for d in &ty.dims {
            match d {
                Dim::Name(n) if n.name == BATCH => {
                    return Err(Diag::new(
                        n.span,
                        "a param cannot depend on the batch size `B`",
                        "batch dimension in a param",
                    )
                    .help("params have fixed shapes; `B` is only for inputs and reshape"))
                }
                Dim::Name(n) => return Err(bad_dim_name(n)),
                Dim::Number(text, at) => dims.push(self.number_dim(text, *at)?),
            }
        }
        if !dtype.is_float() {
            return Err(Diag::new(
                ty.dtype.span,
                format!("a param must have a float type, found `{}`", ty.dtype.name),
                "not trainable",
            )
            .help("params are trained by gradients: use f32"));
        }
        let t = TensorType::new(dtype, dims);
        check_size(&t, ty.span)?;
        Ok(t)
    }

    /// The input must be a field of the data source, of the same dtype and size.
    fn check_field(&self, name: &Ident, t: &TensorType, ty: &TypeExpr) -> R<()> {
        // Checked against the file when the source opens, before step 1.
        if self.data.fields_from_model() {
            return Ok(());
        }
        let fields = self.data.fields();
        let source = format!("{}()", self.data.name());
        let per_sample: usize = t.dims()[1..].iter().product();
        let Some((_, dtype, n)) = fields.iter().find(|(f, _, _)| *f == name.name) else {
            let list: Vec<String> = fields
                .iter()
                .map(|(f, d, n)| format!("{f} ({d}, {n} per sample)"))
                .collect();
            let names: Vec<&str> = fields.iter().map(|(f, _, _)| *f).collect();
            return Err(Diag::new(
                name.span,
                format!(
                    "input `{}` is not provided by {source}; it provides: {}",
                    name.name,
                    list.join(", ")
                ),
                format!("not a field of {source}"),
            )
            .maybe_help(
                did_you_mean(&name.name, names.iter().copied()).or_else(|| {
                    Some("an input is bound to the data field of the same name".into())
                }),
            ));
        };
        if *dtype != t.dtype {
            return Err(Diag::new(
                ty.dtype.span,
                format!(
                    "input `{}` is declared {}, but {source} provides `{}` as {dtype}",
                    name.name, t.dtype, name.name
                ),
                format!("expected {dtype}"),
            ));
        }
        if per_sample != *n {
            return Err(Diag::new(
                ty.span,
                format!(
                    "input `{}` has {per_sample} element{} per sample, but {source} provides {n}",
                    name.name,
                    if per_sample == 1 { "" } else { "s" }
                ),
                format!("{} per sample", per_sample),
            )
            .help(format!(
                "the dimensions after `B` must multiply to {n}, e.g. `{}[B{}]`",
                dtype,
                if *n == 1 {
                    String::new()
                } else {
                    format!(", {n}")
                }
            )));
        }
        Ok(())
    }

    // ------------------------------------------------------------ graph

    fn add(&mut self, op: Op, inputs: Vec<ValueId>, at: Span, label: &str) -> R<ValueId> {
        match self.graph.add(op, inputs) {
            Ok(id) => {
                // A result past the limit fails here, where it is written, not when a
                // plan holding it is loaded.
                let v = id.out(0);
                let ty = self.graph.try_value_type(v).map(|t| t.dense_type().clone());
                if let Some(t) = ty {
                    check_size(&t, at)?;
                }
                Ok(v)
            }
            Err(GraphError::Shape(e)) => Err(Diag::new(
                at,
                format!("shape mismatch in {}: {}", e.op, e.message),
                label,
            )),
            Err(e) => Err(Diag::new(at, format!("internal error: {e}"), label)),
        }
    }

    fn ty(&self, v: ValueId) -> TensorType {
        self.graph.tensor_type(v).clone()
    }

    /// Lowers `e` to a tensor; a bare number is refused.
    fn tensor(&mut self, e: &Expr, role: &str) -> R<ValueId> {
        match self.expr(e)? {
            Val::Tensor(v) => Ok(v),
            Val::Number(_) => Err(Diag::new(
                e.span,
                format!("{role} must be a tensor, found {}", describe(e)),
                "expected a tensor",
            )),
        }
    }

    fn need_float(&self, v: ValueId, e: &Expr, op: &str) -> R<()> {
        let t = self.ty(v);
        if t.dtype.is_float() {
            return Ok(());
        }
        Err(Diag::new(
            e.span,
            format!("`{op}` needs a float tensor, found {t}"),
            format!("this is {t}"),
        )
        .help(i32_help()))
    }

    fn need_i32(&self, v: ValueId, e: &Expr, op: &str, role: &str) -> R<()> {
        let t = self.ty(v);
        if t.dtype == DType::I32 {
            return Ok(());
        }
        Err(Diag::new(
            e.span,
            format!("the {role} of `{op}` must be i32, found {t}"),
            format!("this is {t}"),
        )
        .help(format!(
            "{role} are integer indices: declare the input as i32"
        )))
    }

    // ------------------------------------------------------------ expressions

    fn expr(&mut self, e: &Expr) -> R<Val> {
        match &e.kind {
            ExprKind::Number(text) => match text.parse::<f64>() {
                Ok(v) if v.is_finite() => Ok(Val::Number(v)),
                _ => Err(Diag::new(
                    e.span,
                    format!("the number `{text}` is too large"),
                    "too large",
                )),
            },
            ExprKind::Name(n) => self.lookup(n, e.span),
            ExprKind::Str(_) => Err(Diag::new(
                e.span,
                "a string is not a value of the model",
                "not a tensor or a number",
            )
            .help("strings name data files, in the train block's `data = ...`")),
            ExprKind::Neg(x) => match self.expr(x)? {
                Val::Number(v) => Ok(Val::Number(-v)),
                Val::Tensor(v) => {
                    self.need_float(v, x, "-")?;
                    let label = format!("-{}", self.ty(v));
                    self.add(Op::Neg, vec![v], e.span, &label).map(Val::Tensor)
                }
            },
            ExprKind::Binary {
                op,
                op_span,
                lhs,
                rhs,
            } => self.binary(*op, *op_span, lhs, rhs),
            ExprKind::Call { name, args } => self.call(name, args, e.span),
            ExprKind::List(_) => Err(
                Diag::new(e.span, "a list is not a value", "unexpected list")
                    .help("lists are only arguments: shapes, axes and concat's inputs"),
            ),
        }
    }

    fn binary(&mut self, op: BinOp, op_span: Span, lhs: &Expr, rhs: &Expr) -> R<Val> {
        let (a, b) = (self.expr(lhs)?, self.expr(rhs)?);
        let sym = op.symbol();
        if op == BinOp::MatMul {
            let (Val::Tensor(x), Val::Tensor(y)) = (a, b) else {
                let bad = if matches!(a, Val::Number(_)) {
                    lhs
                } else {
                    rhs
                };
                return Err(Diag::new(
                    bad.span,
                    format!("`@` needs two tensors, found {}", describe(bad)),
                    "not a tensor",
                ));
            };
            self.need_float(x, lhs, "@")?;
            self.need_float(y, rhs, "@")?;
            return self.matmul(x, y, (false, false), op_span).map(Val::Tensor);
        }
        let (x, y) = match (a, b) {
            (Val::Number(x), Val::Number(y)) => {
                let v = match op {
                    BinOp::Add => x + y,
                    BinOp::Sub => x - y,
                    BinOp::Mul => x * y,
                    _ => x / y,
                };
                if !v.is_finite() {
                    return Err(Diag::new(
                        lhs.span.to(rhs.span),
                        format!("`{x} {sym} {y}` is not a finite number"),
                        "not finite",
                    ));
                }
                return Ok(Val::Number(v));
            }
            (Val::Tensor(x), Val::Tensor(y)) => {
                self.need_float(x, lhs, sym)?;
                self.need_float(y, rhs, sym)?;
                (x, y)
            }
            (Val::Tensor(x), Val::Number(n)) => {
                self.need_float(x, lhs, sym)?;
                let c = self.constant(n, x, rhs.span)?;
                (x, c)
            }
            (Val::Number(n), Val::Tensor(y)) => {
                self.need_float(y, rhs, sym)?;
                let c = self.constant(n, y, lhs.span)?;
                (c, y)
            }
        };
        let ir = match op {
            BinOp::Add => Op::Add,
            BinOp::Sub => Op::Sub,
            BinOp::Mul => Op::Mul,
            _ => Op::Div,
        };
        let label = format!("{} {sym} {}", self.ty(x), self.ty(y));
        self.add(ir, vec![x, y], op_span, &label).map(Val::Tensor)
    }

    /// A scalar constant of the dtype of `like`.
    fn constant(&mut self, value: f64, like: ValueId, at: Span) -> R<ValueId> {
        let dtype = self.ty(like).dtype;
        let op = Op::Constant {
            value,
            ty: TensorType::new(dtype, Shape::scalar()),
        };
        self.add(op, vec![], at, "")
    }

    fn call(&mut self, name: &Ident, args: &[Arg], span: Span) -> R<Val> {
        let Some(def) = OPS.iter().find(|d| d.name == name.name) else {
            return Err(self.unknown_op(name));
        };
        let lower = match def.lower {
            Lowering::Op(lower) => lower,
            Lowering::Variadic { operands, lower } => {
                return lower(self, def, operands, args, span).map(Val::Tensor)
            }
            Lowering::Elementwise(build) => {
                return self.elementwise(def, build, args, span).map(Val::Tensor)
            }
        };
        let slots = bind(def, "op", span, args)?;
        let op_name = def.name;
        // Tensor operands first, in order, so errors come in reading order.
        let mut tensors = Vec::new();
        for (p, slot) in def.params.iter().zip(&slots) {
            if let (true, Some(a)) = (p.takes.is_tensor(), slot) {
                let v = self.tensor(&a.value, &format!("argument `{}` of `{op_name}`", p.name))?;
                tensors.push((v, &a.value, p));
            }
        }
        // Dtype checks: what each parameter takes.
        for (v, e, p) in &tensors {
            self.check_dtype(*v, e, op_name, p.takes, p.name)?;
        }
        let Some(&(first, _, _)) = tensors.first() else {
            return Err(Diag::new(
                span,
                format!("internal error: op `{op_name}` has no tensor operand"),
                "",
            ));
        };
        let call = Call {
            name: op_name,
            span,
            slots,
            x: self.ty(first),
        };
        let op = lower(self, &call)?;
        let types: Vec<String> = tensors
            .iter()
            .map(|(v, _, _)| self.ty(*v).to_string())
            .collect();
        let label = format!("{op_name} of {}", types.join(", "));
        let inputs: Vec<ValueId> = tensors.iter().map(|(v, _, _)| *v).collect();
        let out = self.add(op, inputs.clone(), span, &label)?;
        if def.loss {
            self.loss_parts.insert(out, (inputs[0], inputs[1]));
        }
        Ok(Val::Tensor(out))
    }

    /// Checks operand `v` (written `e`) of `op` against what its parameter takes.
    fn check_dtype(&self, v: ValueId, e: &Expr, op: &str, takes: Takes, param: &str) -> R<()> {
        match takes {
            Takes::Float => self.need_float(v, e, op),
            Takes::Indices => self.need_i32(v, e, op, param),
            Takes::AnyTensor | Takes::Literal | Takes::Operand => Ok(()),
        }
    }

    fn unknown_op(&self, name: &Ident) -> Diag {
        let mut help = match close_names(&name.name, op_names(), 3).as_slice() {
            [] => None,
            [one] => Some(format!("did you mean `{one}`?")),
            many => Some(format!("did you mean one of {}?", backticked(many, "or"))),
        };
        if help.is_none() {
            if self.scope.contains_key(&name.name) {
                help = Some(format!("`{}` is a value, not an op", name.name));
            } else {
                let all: Vec<&str> = op_names().collect();
                help = Some(format!("the ops are: {}", all.join(", ")));
            }
        }
        Diag::new(
            name.span,
            format!("unknown op `{}`", name.name),
            "not an op",
        )
        .maybe_help(help)
    }

    /// `x @ y` as numpy's matmul. A batch times one matrix (`[B, T, C] @ [C, N]`) is
    /// one product of `[B*T, C]` (reshapes around a rank-2 matmul, which the
    /// tensor-parallel rule splits as any other); batches that broadcast each other
    /// both ways are broadcast to the result's batch first, so a GPU runs one strided
    /// product.
    fn matmul(&mut self, x: ValueId, y: ValueId, (ta, tb): (bool, bool), at: Span) -> R<ValueId> {
        let (xt, yt) = (self.ty(x), self.ty(y));
        let label = format!("{xt} @ {yt}");
        let mm = Op::MatMul {
            transpose_a: ta,
            transpose_b: tb,
        };
        let (xd, yd) = (xt.dims().to_vec(), yt.dims().to_vec());
        if xd.len() < 2 || yd.len() < 2 {
            return Err(Diag::new(
                at,
                format!(
                    "shape mismatch in matmul: needs operands of rank 2 or more, got {xt} and {yt}"
                ),
                label,
            ));
        }
        if xd.len() > 2 && yd.len() == 2 && !ta {
            let k = xd[xd.len() - 1];
            let rows: usize = xd[..xd.len() - 1].iter().product();
            let flat = match self.flattened.get(&x) {
                Some(&f) => f,
                None => {
                    let f = self.add(
                        Op::Reshape {
                            shape: Shape(vec![rows, k]),
                        },
                        vec![x],
                        at,
                        &label,
                    )?;
                    self.flattened.insert(x, f);
                    f
                }
            };
            let p = self.add(mm, vec![flat, y], at, &label)?;
            let n = self.ty(p).dims()[1];
            let mut dims = xd[..xd.len() - 1].to_vec();
            dims.push(n);
            return self.add(Op::Reshape { shape: Shape(dims) }, vec![p], at, &label);
        }
        let (bx, by) = (&xd[..xd.len() - 2], &yd[..yd.len() - 2]);
        let Some(batch) = distc_ir::shape::broadcast_shapes(bx, by) else {
            return Err(Diag::new(
                at,
                format!(
                    "shape mismatch in matmul: the batch dimensions {bx:?} of {xt} and {by:?} of {yt} do not broadcast"
                ),
                label,
            ));
        };
        let count: usize = batch.iter().product();
        let widen = |cx: &mut Self, v: ValueId, own: &[usize], dims: &[usize]| -> R<ValueId> {
            let own_count: usize = own.iter().product();
            if own_count == 1 || own_count == count {
                return Ok(v);
            }
            let mut to = batch.clone();
            to.extend_from_slice(&dims[dims.len() - 2..]);
            cx.add(Op::BroadcastTo { shape: Shape(to) }, vec![v], at, &label)
        };
        let x = widen(self, x, bx, &xd)?;
        let y = widen(self, y, by, &yd)?;
        self.add(mm, vec![x, y], at, &label)
    }

    /// `softmax_cross_entropy(logits [.., K], labels [..])`: the mean over every
    /// position (a language model's per-token loss, as `F.cross_entropy` of the
    /// flattened logits); logits of rank 3 or more are flattened to `[N, K]` and the
    /// labels to `[N]`, which evaluation then reads as prediction and target.
    fn cross_entropy(&mut self, def: &DslOp, args: &[Arg], span: Span) -> R<ValueId> {
        let slots = bind(def, "op", span, args)?;
        let (Some(la), Some(ya)) = (slots[0], slots[1]) else {
            return Err(
                Diag::new(span, "softmax_cross_entropy needs logits and labels", "")
                    .help(format!("usage: {}", def.usage)),
            );
        };
        let mut logits = self.tensor(&la.value, "argument `logits` of `softmax_cross_entropy`")?;
        self.need_float(logits, &la.value, def.name)?;
        let mut labels = self.tensor(&ya.value, "argument `labels` of `softmax_cross_entropy`")?;
        self.need_i32(labels, &ya.value, def.name, "labels")?;
        let (lt, yt) = (self.ty(logits), self.ty(labels));
        let label = format!("softmax_cross_entropy of {lt}, {yt}");
        if lt.shape.rank() > 2 {
            let ld = lt.dims();
            let (rows, k) = (&ld[..ld.len() - 1], ld[ld.len() - 1]);
            if yt.dims() != rows {
                return Err(Diag::new(
                    span,
                    format!(
                        "shape mismatch in softmax_cross_entropy: labels {yt} must have the logits' \
                         leading dimensions {rows:?} (logits {lt})"
                    ),
                    label,
                ));
            }
            let n: usize = rows.iter().product();
            logits = self.add(
                Op::Reshape {
                    shape: Shape(vec![n, k]),
                },
                vec![logits],
                span,
                &label,
            )?;
            labels = self.add(
                Op::Reshape {
                    shape: Shape(vec![n]),
                },
                vec![labels],
                span,
                &label,
            )?;
        }
        let out = self.add(Op::SoftmaxCrossEntropy, vec![logits, labels], span, &label)?;
        self.loss_parts.insert(out, (logits, labels));
        Ok(out)
    }

    /// An element-wise function: each `Operand` parameter lowered (a tensor becomes an
    /// input of the fused node, a number a constant of its expression), then one
    /// `fused` node.
    fn elementwise(
        &mut self,
        def: &DslOp,
        build: fn(&Call<'_>) -> R<FusedExpr>,
        args: &[Arg],
        span: Span,
    ) -> R<ValueId> {
        let slots = bind(def, "op", span, args)?;
        let mut operands = Vec::new();
        let mut inputs: Vec<ValueId> = Vec::new();
        for (p, slot) in def.params.iter().zip(&slots) {
            let (Takes::Operand, Some(a)) = (p.takes, slot) else {
                continue;
            };
            match self.expr(&a.value)? {
                Val::Tensor(v) => {
                    self.need_float(v, &a.value, def.name)?;
                    operands.push(pointwise::Operand::Tensor(inputs.len()));
                    inputs.push(v);
                }
                Val::Number(n) => operands.push(pointwise::Operand::Number(n)),
            }
        }
        let Some(&first) = inputs.first() else {
            return Err(Diag::new(
                span,
                format!(
                    "`{}` needs at least one tensor operand, found only numbers",
                    def.name
                ),
                "no tensor",
            )
            .help(format!("usage: {}", def.usage)));
        };
        let call = Call {
            name: def.name,
            span,
            slots,
            x: self.ty(first),
        };
        let expr = pointwise::substitute(&build(&call)?, &operands);
        let types: Vec<String> = inputs.iter().map(|v| self.ty(*v).to_string()).collect();
        let label = format!("{} of {}", def.name, types.join(", "));
        self.add(Op::Fused { expr }, inputs, span, &label)
    }

    /// `rms_norm(x, gamma, eps)`: `x * rsqrt(mean(x * x, last axis) + eps) * gamma`, as
    /// `torch.nn.RMSNorm`; three nodes the gradient, fusion and mixed precision treat
    /// as they treat any.
    fn rms_norm(&mut self, def: &DslOp, args: &[Arg], span: Span) -> R<ValueId> {
        let slots = bind(def, "op", span, args)?;
        let (Some(xa), Some(ga)) = (slots[0], slots[1]) else {
            return Err(Diag::new(span, "rms_norm needs x and gamma", "")
                .help(format!("usage: {}", def.usage)));
        };
        let x = self.tensor(&xa.value, "argument `x` of `rms_norm`")?;
        self.need_float(x, &xa.value, def.name)?;
        let gamma = self.tensor(&ga.value, "argument `gamma` of `rms_norm`")?;
        self.need_float(gamma, &ga.value, def.name)?;
        let eps = match slots[2] {
            None => 1e-6,
            Some(a) => {
                let v = args::float(&a.value, "`eps`")?;
                if v <= 0.0 {
                    return Err(Diag::new(
                        a.value.span,
                        format!("`eps` must be positive, found {v}"),
                        "must be > 0",
                    ));
                }
                v
            }
        };
        let (xt, gt) = (self.ty(x), self.ty(gamma));
        let label = format!("rms_norm of {xt}, {gt}");
        let Some(&d) = xt.dims().last() else {
            return Err(Diag::new(
                xa.value.span,
                format!("rms_norm needs rank 1 or more, got {xt}"),
                "a scalar",
            ));
        };
        if gt.dims() != [d] {
            return Err(Diag::new(
                ga.value.span,
                format!("shape mismatch in rms_norm: gamma must be [{d}] for {xt}, got {gt}"),
                label,
            ));
        }
        let parse = |t: &str| t.parse::<FusedExpr>().map_err(|e| Diag::new(span, e, ""));
        let square = parse("mul(in0, in0)")?;
        let sq = self.add(Op::Fused { expr: square }, vec![x], span, &label)?;
        let last = xt.shape.rank() - 1;
        let ms = self.add(
            Op::Mean {
                axes: vec![last],
                keep_dims: true,
            },
            vec![sq],
            span,
            &label,
        )?;
        let scale = parse(&format!("rsqrt(add(in0, {eps:?}))"))?;
        let r = self.add(Op::Fused { expr: scale }, vec![ms], span, &label)?;
        let apply = parse("mul(mul(in0, in1), in2)")?;
        self.add(Op::Fused { expr: apply }, vec![x, r, gamma], span, &label)
    }

    /// `batch_norm(x, gamma, beta, momentum, eps, sync)` over every axis of `x` but 1
    /// (channels), as PyTorch's BatchNorm1d/2d: a training step normalises with the
    /// batch's mean and biased variance and moves the running statistics (frozen
    /// variables `<gamma>_running_mean`, `<gamma>_running_var`, the variance unbiased)
    /// by `momentum` towards them; evaluation normalises with the running ones. With
    /// `sync`, the statistics are the global batch's under data parallelism (the
    /// moments averaged over replicas, as SyncBatchNorm), so workers train as one
    /// device.
    fn batch_norm(&mut self, def: &DslOp, args: &[Arg], span: Span) -> R<ValueId> {
        let slots = bind(def, "op", span, args)?;
        let (Some(xa), Some(ga), Some(ba)) = (slots[0], slots[1], slots[2]) else {
            return Err(Diag::new(span, "batch_norm needs x, gamma and beta", "")
                .help(format!("usage: {}", def.usage)));
        };
        let x = self.tensor(&xa.value, "argument `x` of `batch_norm`")?;
        self.need_float(x, &xa.value, def.name)?;
        let gamma = self.tensor(&ga.value, "argument `gamma` of `batch_norm`")?;
        self.need_float(gamma, &ga.value, def.name)?;
        let beta = self.tensor(&ba.value, "argument `beta` of `batch_norm`")?;
        self.need_float(beta, &ba.value, def.name)?;
        let in_unit = |i: usize, what: &str, default: f64, open_zero: bool| -> R<f64> {
            let Some(a) = slots[i] else {
                return Ok(default);
            };
            let v = args::float(&a.value, what)?;
            let ok = if open_zero {
                v > 0.0 && v.is_finite()
            } else {
                (0.0..=1.0).contains(&v)
            };
            if !ok {
                let want = if open_zero { "> 0" } else { "in [0, 1]" };
                return Err(Diag::new(
                    a.value.span,
                    format!("{what} must be {want}, found {v}"),
                    format!("must be {want}"),
                ));
            }
            Ok(v)
        };
        let momentum = in_unit(3, "`momentum`", 0.1, false)?;
        let eps = in_unit(4, "`eps`", 1e-5, true)?;
        let sync = opt_bool(slots[5].map(|a| &a.value), "`sync`", true)?;
        let (xt, gt, bt) = (self.ty(x), self.ty(gamma), self.ty(beta));
        let label = format!("batch_norm of {xt}, {gt}, {bt}");
        let dims = xt.dims().to_vec();
        if dims.len() != 2 && dims.len() != 4 {
            return Err(Diag::new(
                xa.value.span,
                format!("batch_norm normalises [B, C] or [B, C, H, W] (NCHW), got {xt}"),
                label,
            ));
        }
        let c = dims[1];
        for (t, a, what) in [(&gt, ga, "gamma"), (&bt, ba, "beta")] {
            if t.dims() != [c] {
                return Err(Diag::new(
                    a.value.span,
                    format!("shape mismatch in batch_norm: {what} must be [{c}] for {xt}, got {t}"),
                    label.clone(),
                ));
            }
        }
        // The running statistics are named after gamma, the variable the layer owns.
        let owner = match self.graph.op(gamma.node) {
            Op::Param { name, .. } => name.clone(),
            _ => {
                return Err(Diag::new(
                    ga.value.span,
                    "batch_norm's gamma must be a variable: its running statistics are \
                     named after it",
                    "not a `param`",
                ))
            }
        };
        let channels = TensorType::new(xt.dtype, Shape(vec![c]));
        let mut running = Vec::new();
        for (suffix, init) in [("running_mean", Init::Zeros), ("running_var", Init::Ones)] {
            let name = format!("{owner}_{suffix}");
            if self.graph.params().iter().any(|(_, n, _)| *n == name) {
                return Err(Diag::new(
                    ga.value.span,
                    format!("`{name}` is taken: a second batch_norm with gamma `{owner}`?"),
                    "names the running statistics",
                )
                .help("each batch_norm needs its own gamma"));
            }
            let op = Op::Param {
                name,
                ty: channels.clone(),
                init,
                frozen: true,
            };
            running.push(self.add(op, vec![], span, "")?);
        }
        let axes: Vec<usize> = (0..dims.len()).filter(|&a| a != 1).collect();
        let stat_shape = Shape(
            (0..dims.len())
                .map(|a| if a == 1 { c } else { 1 })
                .collect(),
        );
        let count: usize = axes.iter().map(|&a| dims[a]).product();
        let parse = |t: &str| t.parse::<FusedExpr>().map_err(|e| Diag::new(span, e, ""));
        let mean_op = Op::Mean {
            axes: axes.clone(),
            keep_dims: true,
        };
        let replicas = |cx: &mut Self, v: ValueId, reduce: ReduceOp| -> R<ValueId> {
            if sync {
                cx.add(Op::ReplicaReduce { reduce }, vec![v], span, &label)
            } else {
                Ok(v)
            }
        };
        let m = self.add(mean_op.clone(), vec![x], span, &label)?;
        let batch_mean = replicas(self, m, ReduceOp::Mean)?;
        let sq = parse("mul(sub(in0, in1), sub(in0, in1))")?;
        let sq = self.add(Op::Fused { expr: sq }, vec![x, batch_mean], span, &label)?;
        let v = self.add(mean_op, vec![sq], span, &label)?;
        let batch_var = replicas(self, v, ReduceOp::Mean)?;
        let as_stat = Op::Reshape {
            shape: stat_shape.clone(),
        };
        let as_channels = Op::Reshape {
            shape: Shape(vec![c]),
        };
        let pick = |cx: &mut Self, batch: ValueId, run: ValueId| -> R<ValueId> {
            let run = cx.add(as_stat.clone(), vec![run], span, &label)?;
            cx.add(Op::TrainOrEval, vec![batch, run], span, &label)
        };
        let mean = pick(self, batch_mean, running[0])?;
        let var = pick(self, batch_var, running[1])?;
        let (g, b) = if dims.len() == 4 {
            let per_channel = Op::Reshape {
                shape: Shape(vec![c, 1, 1]),
            };
            (
                self.add(per_channel.clone(), vec![gamma], span, &label)?,
                self.add(per_channel, vec![beta], span, &label)?,
            )
        } else {
            (gamma, beta)
        };
        let apply = parse(&format!(
            "add(mul(mul(sub(in0, in1), rsqrt(add(in2, {eps:?}))), in3), in4)"
        ))?;
        let y = self.add(
            Op::Fused { expr: apply },
            vec![x, mean, var, g, b],
            span,
            &label,
        )?;
        // The running statistics move towards the step's (the variance unbiased by the
        // count over the global batch: the workers' counts summed).
        let n = self.add(
            Op::Constant {
                value: count as f64,
                ty: TensorType::new(xt.dtype, Shape::scalar()),
            },
            vec![],
            span,
            "",
        )?;
        let n = replicas(self, n, ReduceOp::Sum)?;
        let keep = 1.0 - momentum;
        let mean_c = self.add(as_channels.clone(), vec![batch_mean], span, &label)?;
        let new_mean = parse(&format!("add(mul(in0, {keep:?}), mul(in1, {momentum:?}))"))?;
        let new_mean = self.add(
            Op::Fused { expr: new_mean },
            vec![running[0], mean_c],
            span,
            &label,
        )?;
        let var_c = self.add(as_channels, vec![batch_var], span, &label)?;
        let new_var = parse(&format!(
            "add(mul(in0, {keep:?}), mul(mul(in1, div(in2, sub(in2, 1.0))), {momentum:?}))"
        ))?;
        let new_var = self.add(
            Op::Fused { expr: new_var },
            vec![running[1], var_c, n],
            span,
            &label,
        )?;
        for (v, (suffix, _)) in [new_mean, new_var]
            .into_iter()
            .zip([("running_mean", ()), ("running_var", ())])
        {
            let param = format!("{owner}_{suffix}");
            self.add(Op::Assign { param }, vec![v], span, "")?;
        }
        Ok(y)
    }

    /// `concat([a, b], axis = 1)` or `concat(a, b, axis = 1)`: every operand takes
    /// `operands`.
    fn concat(
        &mut self,
        def: &DslOp,
        operands_take: Takes,
        call_args: &[Arg],
        span: Span,
    ) -> R<ValueId> {
        let mut operands: Vec<&Expr> = Vec::new();
        let mut axis_expr = None;
        for a in call_args {
            match &a.name {
                Some(k) if k.name == "axis" => {
                    if axis_expr.is_some() {
                        return Err(Diag::new(
                            k.span,
                            "argument `axis` of `concat` is given twice",
                            "given again here",
                        ));
                    }
                    axis_expr = Some(&a.value);
                }
                Some(k) => {
                    let help = did_you_mean(&k.name, ["axis"])
                        .unwrap_or_else(|| "its only keyword argument is `axis`".into());
                    return Err(Diag::new(
                        k.span,
                        format!("op `concat` has no argument `{}`", k.name),
                        "unknown argument",
                    )
                    .help(help));
                }
                None => match &a.value.kind {
                    ExprKind::List(items)
                        if call_args.iter().filter(|a| a.name.is_none()).count() == 1 =>
                    {
                        operands.extend(items.iter());
                    }
                    _ => operands.push(&a.value),
                },
            }
        }
        if operands.is_empty() {
            return Err(Diag::new(
                span,
                "`concat` needs at least one tensor",
                "nothing to join",
            )
            .help(format!("usage: {}", def.usage)));
        }
        let mut inputs = Vec::new();
        for (i, e) in operands.iter().enumerate() {
            let v = self.tensor(e, &format!("input {} of `concat`", i + 1))?;
            inputs.push(v);
        }
        for (v, e) in inputs.iter().zip(&operands) {
            self.check_dtype(*v, e, def.name, operands_take, "inputs")?;
        }
        let first = self.ty(inputs[0]);
        let axis = axis_arg(axis_expr, 0, &first, span, "concat")?;
        let types: Vec<String> = inputs.iter().map(|v| self.ty(*v).to_string()).collect();
        let label = format!("concat of {} on axis {axis}", types.join(", "));
        self.add(Op::Concat { axis }, inputs, span, &label)
    }

    /// The target shape of a reshape: numbers, `B`, and at most one `-1`.
    fn reshape_target(&self, e: &Expr, x: &TensorType) -> R<Shape> {
        let ExprKind::List(items) = &e.kind else {
            return Err(Diag::new(
                e.span,
                format!(
                    "the shape of `reshape` must be a list such as `[B, 1024]`, found {}",
                    describe(e)
                ),
                "expected a shape",
            ));
        };
        let mut dims: Vec<Option<usize>> = Vec::new();
        let mut infer_at: Option<Span> = None;
        for item in items {
            match &item.kind {
                ExprKind::Name(n) if n == BATCH => dims.push(Some(self.batch)),
                ExprKind::Name(n) => {
                    return Err(Diag::new(
                        item.span,
                        format!("`{n}` cannot be a dimension"),
                        "expected a number or `B`",
                    )
                    .help("shape dimensions are numbers, `B` (the batch) or one `-1` (inferred)"))
                }
                _ => {
                    let v = args::int(item, "a dimension")?;
                    if v == -1 {
                        if infer_at.is_some() {
                            return Err(Diag::new(
                                item.span,
                                "only one dimension of a shape can be -1",
                                "second -1",
                            ));
                        }
                        infer_at = Some(item.span);
                        dims.push(None);
                    } else if v < 1 {
                        return Err(Diag::new(
                            item.span,
                            format!(
                                "a dimension must be at least 1 (or -1 to infer it), found {v}"
                            ),
                            "invalid dimension",
                        ));
                    } else {
                        dims.push(Some(usize::try_from(v).map_err(|_| {
                            Diag::new(item.span, "dimension too large", "too large")
                        })?));
                    }
                }
            }
        }
        let mut known: usize = 1;
        for d in dims.iter().flatten() {
            known = match known.checked_mul(*d) {
                Some(k) if k <= MAX_ELEMENTS => k,
                _ => {
                    return Err(Diag::new(
                        e.span,
                        "this shape has too many elements",
                        "too large",
                    ));
                }
            };
        }
        let total = x.shape.numel();
        let out: Vec<usize> = match infer_at {
            None => dims.into_iter().flatten().collect(),
            Some(at) => {
                if (total / known) * known != total {
                    return Err(Diag::new(
                        at,
                        format!(
                            "cannot infer the -1 in reshape: {x} has {total} elements, which is not a multiple of {known}"
                        ),
                        "cannot be inferred",
                    ));
                }
                dims.into_iter()
                    .map(|d| d.unwrap_or(total / known))
                    .collect()
            }
        };
        Ok(Shape(out))
    }

    // ------------------------------------------------------------ the objective

    fn minimize(&mut self, e: &Expr) -> R<()> {
        let v = self.tensor(e, "the objective")?;
        let t = self.ty(v);
        if !t.dtype.is_float() || t.shape.rank() != 0 {
            return Err(Diag::new(
                e.span,
                format!("the objective must be a float scalar, found {t}"),
                format!("this is {t}"),
            )
            .help("reduce it to one number, e.g. `mean(...)`, `softmax_cross_entropy(...)` or `mse(...)`"));
        }
        self.add(Op::Loss, vec![v], e.span, "")?;
        if let Some(&(prediction, target)) = self.loss_parts.get(&v) {
            self.add(
                Op::Output {
                    name: "prediction".into(),
                },
                vec![prediction],
                e.span,
                "",
            )?;
            self.add(
                Op::Output {
                    name: "target".into(),
                },
                vec![target],
                e.span,
                "",
            )?;
        }
        Ok(())
    }
}

/// `B` where a value or a plain dimension is expected.
fn b_misuse(at: Span) -> Diag {
    Diag::new(
        at,
        "`B` (the batch size) can only be the first dimension of an input or a dimension in reshape",
        "batch dimension used here",
    )
    .help("e.g. `input x: f32[B, 784]` or `reshape(h, [B, 1024])`")
}

fn bad_dim_name(n: &Ident) -> Diag {
    Diag::new(
        n.span,
        format!("`{}` cannot be a dimension", n.name),
        "expected a number or `B`",
    )
    .help("dimensions are numbers; `B` (the batch) is the first dimension of inputs")
}

/// Refuses types with more than [`MAX_ELEMENTS`] elements.
fn check_size(t: &TensorType, at: Span) -> R<()> {
    let mut n: usize = 1;
    for &d in t.dims() {
        n = match n.checked_mul(d) {
            Some(n) if n <= MAX_ELEMENTS => n,
            _ => {
                return Err(Diag::new(
                    at,
                    format!("this tensor ({t}) has more than 2^40 elements"),
                    "too large",
                ))
            }
        };
    }
    Ok(())
}

fn opt_bool(e: Option<&Expr>, what: &str, default: bool) -> R<bool> {
    e.map_or(Ok(default), |e| args::boolean(e, what))
}

fn opt_usize(e: Option<&Expr>, what: &str, default: usize, min: u64) -> R<usize> {
    e.map_or(Ok(default), |e| args::usize_(e, what, min))
}

/// An axis (negative counts from the end) checked against `t`'s rank.
fn normalize_axis(a: i64, t: &TensorType, at: Span, op: &str) -> R<usize> {
    let rank = t.shape.rank() as i64;
    let ax = if a < 0 { rank + a } else { a };
    if ax < 0 || ax >= rank {
        let valid = if rank == 0 {
            format!("{t} is a scalar and has no axes")
        } else {
            format!(
                "the axes of {t} are 0..{} (or -{rank}..-1 from the end)",
                rank - 1
            )
        };
        return Err(Diag::new(
            at,
            format!("axis {a} of `{op}` is out of range for {t}"),
            "out of range",
        )
        .help(valid));
    }
    Ok(ax as usize)
}

/// An optional `axis` argument, `default` (possibly negative) when absent.
fn axis_arg(e: Option<&Expr>, default: i64, t: &TensorType, call: Span, op: &str) -> R<usize> {
    match e {
        Some(e) => normalize_axis(args::int(e, "`axis`")?, t, e.span, op),
        None => normalize_axis(default, t, call, op),
    }
}

#[cfg(test)]
mod tests {
    use super::{i32_help, Lowering, Takes, OPS};
    use crate::dsl::compile_source;
    use std::collections::BTreeMap;

    /// A model whose values fit every op: `m` f32[8,8], `v` f32[8], `img` f32[2,3,8,8],
    /// `k` f32[4,3,3,3], `emb` f32[50,8], `ids` i32[B,8], `label` i32[B].
    fn model(call: &str) -> String {
        format!(
            "model t {{
  input ids:   i32[B, 8]
  input label: i32[B]
  param m:   f32[8, 8]       = glorot
  param v:   f32[8]          = zeros
  param img: f32[2, 3, 8, 8] = zeros
  param k:   f32[4, 3, 3, 3] = glorot
  param emb: f32[50, 8]      = glorot
  y = {call}
  minimize mean(m)
}}
train {{
  data      = zipf_tokens(vocab = 50, context = 8, classes = 8, s = 1.1)
  batch     = 8
  optimizer = sgd(lr = 0.1)
  steps     = 1
}}
"
        )
    }

    /// A call of every op, with every parameter written.
    fn examples() -> BTreeMap<&'static str, &'static str> {
        BTreeMap::from([
            (
                "matmul",
                "matmul(m, m, transpose_a = true, transpose_b = false)",
            ),
            ("relu", "relu(m)"),
            ("sigmoid", "sigmoid(m)"),
            ("tanh", "tanh(m)"),
            ("exp", "exp(m)"),
            ("log", "log(m)"),
            ("neg", "neg(m)"),
            ("softmax", "softmax(m, axis = 0)"),
            ("log_softmax", "log_softmax(m, axis = -1)"),
            ("sum", "sum(m, axes = [1], keep_dims = true)"),
            ("mean", "mean(m, axes = [0, 1], keep_dims = false)"),
            ("reshape", "reshape(ids, [B, 2, -1])"),
            ("transpose", "transpose(ids, [1, 0])"),
            ("concat", "concat([m, m], axis = 1)"),
            ("slice", "slice(ids, axis = 1, start = 2, end = 5)"),
            ("embedding", "embedding(emb, ids)"),
            (
                "softmax_cross_entropy",
                "softmax_cross_entropy(sum(embedding(emb, ids), axes = [1]), label)",
            ),
            ("mse", "mse(m, m)"),
            ("dropout", "dropout(m, rate = 0.25)"),
            ("layer_norm", "layer_norm(m, v, v, eps = 1e-3)"),
            ("conv2d", "conv2d(img, k, stride = 1, padding = 1)"),
            ("max_pool2d", "max_pool2d(img, kernel = 2, stride = 2)"),
            ("gelu", "gelu(m, approximate = \"tanh\")"),
            ("silu", "silu(m)"),
            ("sqrt", "sqrt(m)"),
            ("rsqrt", "rsqrt(m)"),
            ("pow", "pow(m, 2)"),
            ("less", "less(m, 0.5)"),
            ("less_equal", "less_equal(m, v)"),
            ("greater", "greater(0, m)"),
            ("greater_equal", "greater_equal(m, m)"),
            ("equal", "equal(m, 1)"),
            ("not_equal", "not_equal(m, 1)"),
            ("where", "where(greater(m, 0), m, -1e9)"),
            ("maximum", "maximum(m, 0)"),
            ("minimum", "minimum(m, v)"),
            ("rms_norm", "rms_norm(m, v, eps = 1e-5)"),
            (
                "batch_norm",
                "batch_norm(m, v, v, momentum = 0.2, eps = 1e-3, sync = false)",
            ),
            (
                "attention",
                "attention(img, img, img, causal = true, scale = 0.5)",
            ),
        ])
    }

    #[test]
    fn every_op_in_the_table_lowers() {
        let names: Vec<&str> = OPS.iter().map(|op| op.name).collect();
        let examples = examples();
        assert_eq!(
            names
                .iter()
                .copied()
                .collect::<std::collections::BTreeSet<_>>(),
            examples.keys().copied().collect(),
            "every op in OPS needs an example here, and only those"
        );
        let base = compile_source("t.dsl", &model("m"), None)
            .unwrap_or_else(|e| panic!("{}", e.render_plain()))
            .graph
            .node_count();
        for (name, call) in examples {
            let p = compile_source("t.dsl", &model(call), None)
                .unwrap_or_else(|e| panic!("{name}: {}", e.render_plain()));
            assert!(
                p.graph.node_count() > base,
                "{name}: `{call}` added no node"
            );
            distc_ir::verify(&p.graph).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn the_table_is_consistent() {
        let mut seen = std::collections::HashSet::new();
        for op in OPS {
            assert!(seen.insert(op.name), "`{}` is in OPS twice", op.name);
            assert!(
                op.usage.starts_with(&format!("{}(", op.name)),
                "usage of `{}`: {}",
                op.name,
                op.usage
            );
            let mut params = std::collections::HashSet::new();
            for p in op.params {
                assert!(
                    params.insert(p.name),
                    "`{}` has `{}` twice",
                    op.name,
                    p.name
                );
                assert!(
                    p.required || p.takes == Takes::Literal,
                    "`{}`: an optional parameter is a literal with a default",
                    op.name
                );
            }
            if let Lowering::Op(_) = op.lower {
                // The lowering reads the first operand's type.
                assert!(
                    op.params
                        .first()
                        .is_some_and(|p| p.required && p.takes.is_tensor()),
                    "`{}`: the first parameter of an op is a tensor",
                    op.name
                );
            }
            if op.loss {
                let tensors = op.params.iter().filter(|p| p.takes.is_tensor()).count();
                assert_eq!(
                    tensors, 2,
                    "`{}`: a loss has a prediction and a target",
                    op.name
                );
            }
        }
    }

    #[test]
    fn the_module_docs_name_every_op() {
        let docs = include_str!("mod.rs");
        for op in OPS {
            assert!(
                docs.contains(&format!("`{}(", op.name)),
                "dsl/mod.rs does not document `{}`",
                op.name
            );
        }
    }

    #[test]
    fn where_i32_tensors_go_is_derived_from_the_table() {
        assert_eq!(
            i32_help(),
            "i32 tensors (ids, labels) can only go to embedding, softmax_cross_entropy, \
             reshape, transpose, concat and slice"
        );
    }
}
