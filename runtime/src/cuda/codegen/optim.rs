//! Optimizer updates on the device, the rules of `crate::cpu::optim` (read there for the
//! semantics): SGD, SGD with momentum and Adam, each fused into one pass over a dense
//! variable, and a row-wise form for an `IndexedSlices` gradient that touches only
//! the rows it holds (repeated rows summed first, in order of appearance, then the
//! lazy update of each touched row, as the CPU's sparse apply does). A sparse update
//! never builds a dense gradient: its scratch is one i32 per table row (the first-
//! occurrence table) and one per gradient row.
//!
//! Adam's bias correction reads the step from device memory ([`KArg::Step`], the
//! 0-based index of the step being run, so `t = step + 1`) and computes
//! `1 - beta^t` in double precision, as the CPU does before rounding to f32.

use super::sparse::{unique_launches, UniqueSink};
use super::{flit, row_len, CodegenError, KArg, KernelSet, Launch, NodeCx, NodeLaunch, INDEX};
use crate::core::config::OptimizerSpec;
use distc_ir::{DType, TensorType, ValueType};

/// The update of one variable.
#[derive(Clone, Debug, PartialEq)]
pub struct VarUpdate {
    /// The variable.
    pub name: String,
    /// Launches with [`KArg::Param`], [`KArg::Grad`], [`KArg::Slot`], [`KArg::Step`] and
    /// [`KArg::Scratch`] arguments, in stream order.
    pub launches: Vec<Launch>,
    /// Bytes of each scratch buffer.
    pub scratch_bytes: Vec<usize>,
}

/// The optimizer's code for a set of variables.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerPlan {
    /// One CUDA C translation unit (the same prelude as a [`super::DevicePlan`]'s).
    pub source: String,
    /// Slots per variable, each of the variable's shape and dtype, zeroed before the
    /// first step: none for SGD, `["momentum"]` with momentum, `["m", "v"]` for Adam
    /// (the names `crate::cpu::optim::Optimizer::slot_names` gives, so checkpoints agree).
    pub slot_names: &'static [&'static str],
    /// One update per variable, in the order given.
    pub vars: Vec<VarUpdate>,
}

/// The rule with its constants as C literals.
enum Rule {
    Sgd { lr: String },
    Momentum { lr: String, mu: String },
    Adam(Adam),
}

struct Adam {
    lr: String,
    b1: String,
    b2: String,
    c1: String,
    c2: String,
    eps: String,
    /// The decays as C double literals, for the bias correction.
    b1d: String,
    b2d: String,
    /// AdamW's `1 - lr * wd`, where the variable decays.
    keep: Option<String>,
}

/// The rule's kernel text, or why the GPU has none; `decays`: the variable takes the
/// weight decay (it is not exempt).
fn rule(spec: &OptimizerSpec, decays: bool) -> Result<Rule, String> {
    Ok(match *spec {
        OptimizerSpec::Lars { .. } | OptimizerSpec::Lamb { .. } => {
            return Err(format!(
                "{} (a layer-wise trust ratio) runs on the CPU backend for now",
                spec.name()
            ))
        }
        OptimizerSpec::Sgd { lr, momentum: 0.0 } => Rule::Sgd { lr: flit(lr) },
        OptimizerSpec::Sgd { lr, momentum } => Rule::Momentum {
            lr: flit(lr),
            mu: flit(momentum),
        },
        OptimizerSpec::Adam {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } => Rule::Adam(Adam {
            // The learning rate is constant on the GPU (it refuses schedules).
            keep: (decays && weight_decay > 0.0).then(|| flit(1.0 - lr * weight_decay)),
            lr: flit(lr),
            b1: flit(beta1),
            b2: flit(beta2),
            // 1-b in f64, then f32, as the CPU does (f32(0.999) is off by 5e-8).
            c1: flit(1.0 - beta1),
            c2: flit(1.0 - beta2),
            eps: flit(eps),
            b1d: format!("{beta1:?}"),
            b2d: format!("{beta2:?}"),
        }),
    })
}

impl Rule {
    fn slot_names(&self) -> &'static [&'static str] {
        match self {
            Rule::Sgd { .. } => &[],
            Rule::Momentum { .. } => &["momentum"],
            Rule::Adam(_) => &["m", "v"],
        }
    }

    /// C run by every thread before its elements: the bias corrections.
    fn prologue(&self) -> String {
        match self {
            Rule::Adam(a) => format!(
                "double t_ = (double)(*step + 1ull); float bc1 = (float)(1.0 - pow({}, t_)); float bc2 = (float)(1.0 - pow({}, t_));",
                a.b1d, a.b2d
            ),
            _ => String::new(),
        }
    }

    /// C updating element `at` of the variable (and its slots) with the scaled
    /// gradient `g` (a float expression evaluated once).
    fn update(&self, at: &str, g: &str) -> String {
        match self {
            Rule::Sgd { lr } => format!("w[{at}] = w[{at}] - {lr} * ({g} * sc);"),
            Rule::Momentum { lr, mu } => format!(
                "float v = {mu} * s0[{at}] + {g} * sc; s0[{at}] = v; w[{at}] = w[{at}] - {lr} * v;"
            ),
            Rule::Adam(a) => format!(
                "float gs = {g} * sc; float m = {b1} * s0[{at}] + {c1} * gs; float v = {b2} * s1[{at}] + {c2} * gs * gs; s0[{at}] = m; s1[{at}] = v; {decay}w[{at}] = w[{at}] - {lr} * (m / bc1) / (sqrtf(v / bc2) + {eps});",
                decay = a
                    .keep
                    .as_ref()
                    .map_or(String::new(), |k| format!("w[{at}] = w[{at}] * {k}; ")),
                b1 = a.b1,
                b2 = a.b2,
                c1 = a.c1,
                c2 = a.c2,
                lr = a.lr,
                eps = a.eps,
            ),
        }
    }

    /// Kernel parameters after the variable: the slots and, for Adam, the step.
    fn params(&self) -> &'static str {
        match self {
            Rule::Sgd { .. } => "",
            Rule::Momentum { .. } => ", float* s0",
            Rule::Adam(_) => ", float* s0, float* s1, const u64* step",
        }
    }

    fn args(&self) -> Vec<KArg> {
        match self {
            Rule::Sgd { .. } => vec![],
            Rule::Momentum { .. } => vec![KArg::Slot(0)],
            Rule::Adam(_) => vec![KArg::Slot(0), KArg::Slot(1), KArg::Step],
        }
    }

    fn base(&self, sparse: bool) -> &'static str {
        match (self, sparse) {
            (Rule::Sgd { .. }, false) => "sgd",
            (Rule::Momentum { .. }, false) => "momentum",
            (Rule::Adam(_), false) => "adam",
            (Rule::Sgd { .. }, true) => "sparse_sgd",
            (Rule::Momentum { .. }, true) => "sparse_momentum",
            (Rule::Adam(_), true) => "sparse_adam",
        }
    }
}

/// The update kernels of `spec` for each `(name, type, sparse gradient)` variable;
/// every gradient is first multiplied by `grad_scale` (as `Optimizer::apply`'s
/// `scale`). A sparse variable's gradient is an `IndexedSlices` buffer of at most
/// `nnz` rows (its type's bound; the launch reads the true count on the device).
pub fn optimizer_kernels(
    spec: &OptimizerSpec,
    no_decay: &[String],
    params: &[(String, TensorType, Option<usize>)],
    grad_scale: f64,
) -> Result<OptimizerPlan, CodegenError> {
    let rule_of = |decays: bool| {
        rule(spec, decays).map_err(|reason| CodegenError::Optimizer {
            var: params.first().map_or_else(String::new, |p| p.0.clone()),
            reason,
        })
    };
    let (rule, exempt_rule) = (rule_of(true)?, rule_of(false)?);
    // A variable's exemption holds for its tensor-parallel part and ZeRO chunk too.
    let exempt = |name: &str| {
        let mut base = name;
        for suffix in [distc_ir::ZERO_SHARD_SUFFIX, distc_ir::MODEL_SHARD_SUFFIX] {
            base = base.strip_suffix(suffix).unwrap_or(base);
        }
        no_decay.iter().any(|n| n == base)
    };
    let mut ks = KernelSet::default();
    let mut vars = Vec::with_capacity(params.len());
    for (name, ty, bound) in params {
        let err = |reason: String| CodegenError::Optimizer {
            var: name.clone(),
            reason,
        };
        if ty.dtype != DType::F32 {
            return Err(err(format!("the variable is {ty}; the GPU runs f32")));
        }
        let mut cx = NodeCx {
            ks: &mut ks,
            ins: Vec::new(),
            outs: Vec::new(),
            out: NodeLaunch::default(),
        };
        let rule = if exempt(name) { &exempt_rule } else { &rule };
        match bound {
            None => dense(&mut cx, rule, ty, grad_scale).map_err(err)?,
            Some(nnz) => sparse(&mut cx, rule, ty, *nnz, grad_scale).map_err(err)?,
        }
        vars.push(VarUpdate {
            name: name.clone(),
            launches: cx.out.launches,
            scratch_bytes: cx.out.scratch_bytes,
        });
    }
    let source = ks.source();
    let sigs = super::kernel_signatures(&source).map_err(|reason| CodegenError::Optimizer {
        var: "(all)".into(),
        reason,
    })?;
    for v in &vars {
        super::check_launches(&sigs, &v.launches).map_err(|reason| CodegenError::Optimizer {
            var: v.name.clone(),
            reason,
        })?;
    }
    Ok(OptimizerPlan {
        source,
        slot_names: rule.slot_names(),
        vars,
    })
}

/// One pass over the variable: each thread updates one element and its slots.
fn dense(cx: &mut NodeCx<'_>, rule: &Rule, ty: &TensorType, scale: f64) -> Result<(), String> {
    let n = ty.shape.numel();
    let text = format!(
        "extern \"C\" __global__ void KNAME(float* w, const float* g, u64 n, float sc{params}) {{\n{INDEX}    {pro}\n    {upd}\n}}\n",
        params = rule.params(),
        pro = rule.prologue(),
        upd = rule.update("i", "g[i]"),
    );
    let name = cx.kernel(rule.base(false), text);
    let mut args = vec![
        KArg::Param,
        KArg::Grad,
        KArg::U64(n as u64),
        KArg::F32(scale as f32),
    ];
    args.extend(rule.args());
    cx.launch_1d(&name, n, args)
}

/// The row-wise update: the repeated-row machinery of `sparse`, its last step
/// updating each touched row of the variable (and its slots) with the row's summed
/// gradient.
fn sparse(
    cx: &mut NodeCx<'_>,
    rule: &Rule,
    ty: &TensorType,
    nnz: usize,
    scale: f64,
) -> Result<(), String> {
    let Some(&rows) = ty.dims().first() else {
        return Err(format!(
            "a row-sparse gradient needs a table, the variable is {ty}"
        ));
    };
    let row = row_len(ty);
    let mut args = vec![KArg::Param, KArg::F32(scale as f32)];
    args.extend(rule.args());
    let sink = UniqueSink {
        base: rule.base(true),
        params: format!(", float* w, float sc{}", rule.params()),
        per_row: String::new(),
        per_col: format!(
            "{} u64 at = (u64)id * {row}ull + c; {}",
            rule.prologue(),
            rule.update("at", "g")
        ),
        args,
    };
    unique_launches(cx, KArg::Grad, (rows, row, nnz), None, sink)
}

/// The gradient's nnz bound if `ty` is `IndexedSlices`, for [`optimizer_kernels`]'s
/// variable list.
pub fn sparse_bound(ty: &ValueType) -> Option<usize> {
    match ty {
        ValueType::IndexedSlices { nnz, .. } => Some(*nnz),
        ValueType::Tensor(_) => None,
    }
}
