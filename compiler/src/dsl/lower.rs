//! The model block to a [`Graph`]: names resolved, op calls bound and checked, every
//! node added through [`Graph::add`] so that its shape rule runs, and shape errors
//! turned into diagnostics at the call or operator that caused them.

use super::args::{self, bind, describe, Sig};
use super::ast::{Arg, BinOp, Dim, Expr, ExprKind, Ident, InitExpr, Model, Span, Stmt, TypeExpr};
use super::error::{backticked, close_names, did_you_mean, line_of, Diag};
use distc_ir::{DType, Graph, GraphError, Init, Op, Shape, TensorType, ValueId};
use distc_runtime::DataSpec;
use std::collections::HashMap;

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

/// The ops callable in a model, with their parameters. `concat` is variadic and bound
/// by hand; it is listed for names and usage.
const OPS: &[Sig] = &[
    Sig {
        name: "matmul",
        params: &[
            ("a", true),
            ("b", true),
            ("transpose_a", false),
            ("transpose_b", false),
        ],
        usage: "matmul(a, b, transpose_a = false, transpose_b = false)",
    },
    Sig {
        name: "relu",
        params: &[("x", true)],
        usage: "relu(x)",
    },
    Sig {
        name: "sigmoid",
        params: &[("x", true)],
        usage: "sigmoid(x)",
    },
    Sig {
        name: "tanh",
        params: &[("x", true)],
        usage: "tanh(x)",
    },
    Sig {
        name: "exp",
        params: &[("x", true)],
        usage: "exp(x)",
    },
    Sig {
        name: "log",
        params: &[("x", true)],
        usage: "log(x)",
    },
    Sig {
        name: "neg",
        params: &[("x", true)],
        usage: "neg(x)",
    },
    Sig {
        name: "softmax",
        params: &[("x", true), ("axis", false)],
        usage: "softmax(x, axis = -1)",
    },
    Sig {
        name: "log_softmax",
        params: &[("x", true), ("axis", false)],
        usage: "log_softmax(x, axis = -1)",
    },
    Sig {
        name: "sum",
        params: &[("x", true), ("axes", false), ("keep_dims", false)],
        usage: "sum(x, axes = [..], keep_dims = false)  (axes default: all)",
    },
    Sig {
        name: "mean",
        params: &[("x", true), ("axes", false), ("keep_dims", false)],
        usage: "mean(x, axes = [..], keep_dims = false)  (axes default: all)",
    },
    Sig {
        name: "reshape",
        params: &[("x", true), ("shape", true)],
        usage: "reshape(x, [B, 1024])  (one dimension may be -1)",
    },
    Sig {
        name: "transpose",
        params: &[("x", true), ("perm", false)],
        usage: "transpose(x, [1, 0])  (default: axes reversed)",
    },
    Sig {
        name: "concat",
        params: &[("axis", false)],
        usage: "concat([a, b, ...], axis = 0) or concat(a, b, ..., axis = 0)",
    },
    Sig {
        name: "slice",
        params: &[("x", true), ("axis", true), ("start", true), ("end", true)],
        usage: "slice(x, axis = 1, start = 0, end = 10)",
    },
    Sig {
        name: "embedding",
        params: &[("table", true), ("ids", true)],
        usage: "embedding(table, ids)",
    },
    Sig {
        name: "softmax_cross_entropy",
        params: &[("logits", true), ("labels", true)],
        usage: "softmax_cross_entropy(logits, labels)",
    },
    Sig {
        name: "mse",
        params: &[("prediction", true), ("target", true)],
        usage: "mse(prediction, target)",
    },
    Sig {
        name: "dropout",
        params: &[("x", true), ("rate", false)],
        usage: "dropout(x, rate = 0.5)",
    },
    Sig {
        name: "layer_norm",
        params: &[("x", true), ("gamma", true), ("beta", true), ("eps", false)],
        usage: "layer_norm(x, gamma, beta, eps = 1e-5)",
    },
    Sig {
        name: "conv2d",
        params: &[
            ("x", true),
            ("w", true),
            ("stride", false),
            ("padding", false),
        ],
        usage: "conv2d(x, w, stride = 1, padding = 0)",
    },
    Sig {
        name: "max_pool2d",
        params: &[("x", true), ("kernel", false), ("stride", false)],
        usage: "max_pool2d(x, kernel = 2, stride = kernel)",
    },
];

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
    };
    let mut minimized: Option<Span> = None;
    for stmt in &model.stmts {
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
            Stmt::Param { name, ty, init, .. } => {
                cx.define_check(name)?;
                let t = cx.param_type(ty)?;
                let init = lower_init(init)?;
                let v = cx.add(
                    Op::Param {
                        name: name.name.clone(),
                        ty: t,
                        init,
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
        }
    }
    if minimized.is_none() {
        return Err(Diag::new(
            model.header,
            format!("model `{}` has no `minimize` statement", model.name.name),
            "nothing to train",
        )
        .help("end the model with the objective, e.g. `minimize softmax_cross_entropy(logits, label)`"));
    }
    Ok(Lowered { graph: cx.graph })
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
        DType::from_name(&ty.dtype.name).ok_or_else(|| {
            Diag::new(
                ty.dtype.span,
                format!("unknown element type `{}`", ty.dtype.name),
                "not a type",
            )
            .help("the element types are f32, f64 and i32")
        })
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
            Ok(id) => Ok(id.out(0)),
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
        .help("i32 tensors (ids, labels) can only go to embedding, softmax_cross_entropy, reshape, transpose, concat and slice"))
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
            let label = format!("{} @ {}", self.ty(x), self.ty(y));
            let mm = Op::MatMul {
                transpose_a: false,
                transpose_b: false,
            };
            return self.add(mm, vec![x, y], op_span, &label).map(Val::Tensor);
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
        let Some(sig) = OPS.iter().find(|s| s.name == name.name) else {
            return Err(self.unknown_op(name));
        };
        if sig.name == "concat" {
            return self.concat(args, span).map(Val::Tensor);
        }
        let slots = bind(sig, "op", span, args)?;
        let arg = |i: usize| slots.get(i).copied().flatten().map(|a| &a.value);
        let op_name = sig.name;
        // Tensor operands first, in order, so errors come in reading order.
        let mut tensors = Vec::new();
        for (i, (p, required)) in sig.params.iter().enumerate() {
            let tensor_param = *required
                && !matches!(
                    (op_name, *p),
                    ("reshape", "shape") | ("slice", "axis" | "start" | "end")
                );
            if tensor_param {
                if let Some(e) = arg(i) {
                    let v = self.tensor(e, &format!("argument `{p}` of `{op_name}`"))?;
                    tensors.push((v, e));
                }
            }
        }
        let t = |i: usize| tensors[i].0;
        let te = |i: usize| tensors[i].1;
        // Dtype checks: ids and labels are i32, everything else that computes is float.
        match op_name {
            "embedding" => {
                self.need_float(t(0), te(0), op_name)?;
                self.need_i32(t(1), te(1), op_name, "ids")?;
            }
            "softmax_cross_entropy" => {
                self.need_float(t(0), te(0), op_name)?;
                self.need_i32(t(1), te(1), op_name, "labels")?;
            }
            "reshape" | "transpose" | "slice" => {}
            _ => {
                for (v, e) in &tensors {
                    self.need_float(*v, e, op_name)?;
                }
            }
        }
        let x_ty = self.ty(t(0));
        let rank = x_ty.shape.rank();
        let op = match op_name {
            "matmul" => Op::MatMul {
                transpose_a: opt_bool(arg(2), "`transpose_a`", false)?,
                transpose_b: opt_bool(arg(3), "`transpose_b`", false)?,
            },
            "relu" => Op::Relu,
            "sigmoid" => Op::Sigmoid,
            "tanh" => Op::Tanh,
            "exp" => Op::Exp,
            "log" => Op::Log,
            "neg" => Op::Neg,
            "softmax" | "log_softmax" => {
                let axis = axis_arg(arg(1), -1, &x_ty, span, op_name)?;
                if op_name == "softmax" {
                    Op::Softmax { axis }
                } else {
                    Op::LogSoftmax { axis }
                }
            }
            "sum" | "mean" => {
                let axes = match arg(1) {
                    None => (0..rank).collect(),
                    Some(e) => {
                        let mut axes = Vec::new();
                        for (a, at) in args::int_list(e, "`axes`")? {
                            let ax = normalize_axis(a, &x_ty, at, op_name)?;
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
                let keep_dims = opt_bool(arg(2), "`keep_dims`", false)?;
                if op_name == "sum" {
                    Op::Sum { axes, keep_dims }
                } else {
                    Op::Mean { axes, keep_dims }
                }
            }
            "reshape" => {
                let e = arg(1).ok_or_else(|| Diag::new(span, "reshape needs a shape", ""))?;
                Op::Reshape {
                    shape: self.reshape_target(e, &x_ty)?,
                }
            }
            "transpose" => {
                let perm = match arg(1) {
                    None => (0..rank).rev().collect(),
                    Some(e) => {
                        let mut perm = Vec::new();
                        for (a, at) in args::int_list(e, "`perm`")? {
                            perm.push(normalize_axis(a, &x_ty, at, op_name)?);
                        }
                        perm
                    }
                };
                Op::Transpose { perm }
            }
            "slice" => {
                let (Some(ae), Some(se), Some(ee)) = (arg(1), arg(2), arg(3)) else {
                    return Err(Diag::new(span, "slice needs axis, start and end", ""));
                };
                let axis = normalize_axis(args::int(ae, "`axis`")?, &x_ty, ae.span, op_name)?;
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
                Op::Slice { axis, start, end }
            }
            "embedding" => Op::Embedding,
            "softmax_cross_entropy" => Op::SoftmaxCrossEntropy,
            "mse" => Op::Mse,
            "dropout" => {
                let rate = match arg(1) {
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
                let seed = self.seed.wrapping_mul(1000).wrapping_add(self.dropouts);
                self.dropouts += 1;
                Op::Dropout {
                    rate,
                    seed,
                    per_sample: false,
                }
            }
            "layer_norm" => {
                let eps = match arg(3) {
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
                Op::LayerNorm { eps }
            }
            "conv2d" => {
                let stride = opt_usize(arg(2), "`stride`", 1, 1)?;
                let padding = opt_usize(arg(3), "`padding`", 0, 0)?;
                if padding > MAX_PADDING {
                    let at = arg(3).map_or(span, |e| e.span);
                    return Err(Diag::new(
                        at,
                        format!("padding {padding} is too large"),
                        "too large",
                    ));
                }
                Op::Conv2d { stride, padding }
            }
            "max_pool2d" => {
                let kernel = opt_usize(arg(1), "`kernel`", 2, 1)?;
                let stride = opt_usize(arg(2), "`stride`", kernel, 1)?;
                Op::MaxPool2d { kernel, stride }
            }
            _ => return Err(self.unknown_op(name)),
        };
        let types: Vec<String> = tensors
            .iter()
            .map(|(v, _)| self.ty(*v).to_string())
            .collect();
        let label = format!("{op_name} of {}", types.join(", "));
        let inputs: Vec<ValueId> = tensors.iter().map(|(v, _)| *v).collect();
        let out = self.add(op, inputs.clone(), span, &label)?;
        if matches!(op_name, "softmax_cross_entropy" | "mse") {
            self.loss_parts.insert(out, (inputs[0], inputs[1]));
        }
        Ok(Val::Tensor(out))
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

    /// `concat([a, b], axis = 1)` or `concat(a, b, axis = 1)`.
    fn concat(&mut self, call_args: &[Arg], span: Span) -> R<ValueId> {
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
            .help("usage: concat([a, b, ...], axis = 0) or concat(a, b, ..., axis = 0)"));
        }
        let mut inputs = Vec::new();
        for (i, e) in operands.iter().enumerate() {
            let v = self.tensor(e, &format!("input {} of `concat`", i + 1))?;
            inputs.push(v);
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
                    format!("this tensor has more than {MAX_ELEMENTS} elements"),
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
