//! Optimizer updates on the device, the rules of `crate::cpu::optim` (read there for the
//! semantics): SGD, SGD with momentum and Adam, each fused into one pass over a dense
//! variable, and for an `IndexedSlices` gradient the CPU's two rules: by default the
//! rows summed (in order of appearance) into a dense gradient in scratch, then the
//! dense update (every row's slots move, as `torch.optim`'s); plain SGD, and
//! momentum and Adam under `lazy`, a row-wise form that touches only the rows it
//! holds (repeated rows summed first, then the update of each touched row), whose
//! scratch is one i32 per table row (the first-occurrence table) and one per
//! gradient row.
//!
//! LARS and LAMB scale each variable's step by a trust ratio of two norms over the
//! whole variable ([`trust_dense`]): a pass for the norms (one block, f64 sums in a
//! fixed tree, so the same bits every run), then the update, which reads them from
//! scratch; LAMB first moves its moments, as the CPU does. A row-sparse gradient is
//! applied as the dense gradient it stands for (the CPU's rule: the trust ratio is
//! over the whole variable, and the momentum moves every row), summed into scratch.
//!
//! Adam's bias correction reads the step from device memory ([`KArg::Step`], the
//! 0-based index of the step being run, so `t = step + 1`) and computes
//! `1 - beta^t` in double precision, as the CPU does before rounding to f32. Beside
//! the step lies the update's [`Rate`]: the learning rate and AdamW's `1 - lr * wd`,
//! as f32, which the backend writes before each update (and replay), so a schedule
//! moves them without new kernels or a new capture. After the rate lies the skip flag
//! ([`SKIP_STEP`]): an fp16 step captured into a CUDA graph unscales its gradients on
//! the device, and an overflow there skips the update there, with no host round trip.

use super::sparse::{unique_launches, UniqueSink};
use super::{flit, row_len, CodegenError, KArg, KernelSet, Launch, NodeCx, NodeLaunch, INDEX};
use crate::core::config::OptimizerSpec;
use distc_ir::{DType, Graph, NodeId, Op, TensorType, ValueType};
use std::collections::HashMap;

/// C that ends an update kernel's thread when the step is skipped: the flag after the
/// rate (`step[2]`), which fp16's unscaling raises on the device when a gradient
/// overflowed in a captured step (the backend keeps it zero otherwise). Uniform over
/// the grid, so a block's barriers are passed by all its threads or none.
pub(crate) const SKIP_STEP: &str = "if (((const unsigned int*)(step + 2))[0] != 0u) return;";

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

/// The rule with its constants as C literals; the learning rate is read from device
/// memory (see [`Rate`]). Pointwise rules update each element from its own gradient;
/// trust-ratio rules need the whole variable's norms first.
enum Rule {
    Sgd,
    Momentum {
        mu: String,
    },
    Adam(Adam),
    Lars {
        mu: String,
        /// The weight decay as a C float (the update) and a C double (the ratio).
        wd: String,
        wdd: String,
        eta: String,
    },
    Lamb {
        adam: Adam,
        wd: String,
    },
}

struct Adam {
    b1: String,
    b2: String,
    c1: String,
    c2: String,
    eps: String,
    /// The decays as C double literals, for the bias correction.
    b1d: String,
    b2d: String,
    /// Whether the variable takes AdamW's decay, `w *= 1 - lr * wd`.
    decays: bool,
}

/// The learning rate an update reads from device memory, 8 bytes after the optimizer's
/// step (the two f32s this writes), and AdamW's decay factor: as the CPU computes them,
/// in f64 then rounded.
#[derive(Clone, Debug, PartialEq)]
pub struct Rate {
    lr: f64,
    wd: f64,
    schedule: Option<(crate::core::config::LrSchedule, u64)>,
}

impl Rate {
    /// The rate of `spec` (constant until [`Rate::follow`]).
    pub fn of(spec: &OptimizerSpec) -> Rate {
        let wd = match *spec {
            OptimizerSpec::Adam { weight_decay, .. } => weight_decay,
            _ => 0.0,
        };
        Rate {
            lr: spec.lr(),
            wd,
            schedule: None,
        }
    }

    /// Follows `schedule` over a run of `total` updates.
    pub fn follow(&mut self, schedule: &crate::core::config::LrSchedule, total: u64) {
        self.schedule = (!schedule.is_constant()).then(|| (schedule.clone(), total));
    }

    /// The learning rate of the update after `done` updates.
    pub fn lr(&self, done: u64) -> f64 {
        match &self.schedule {
            Some((s, total)) => self.lr * s.factor(done, *total),
            None => self.lr,
        }
    }

    /// The 8 bytes the kernels read: the learning rate and `1 - lr * wd`, as f32.
    pub fn bytes(&self, done: u64) -> [u8; 8] {
        let lr = self.lr(done);
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&(lr as f32).to_ne_bytes());
        b[4..].copy_from_slice(&((1.0 - lr * self.wd) as f32).to_ne_bytes());
        b
    }
}

/// The rule's kernel text, or why the GPU has none; `decays`: the variable takes the
/// weight decay (it is not exempt).
fn rule(spec: &OptimizerSpec, decays: bool) -> Result<Rule, String> {
    let adam = |beta1: f64, beta2: f64, eps: f64, decays: bool| Adam {
        decays,
        b1: flit(beta1),
        b2: flit(beta2),
        // 1-b in f64, then f32, as the CPU does (f32(0.999) is off by 5e-8).
        c1: flit(1.0 - beta1),
        c2: flit(1.0 - beta2),
        eps: flit(eps),
        b1d: format!("{beta1:?}"),
        b2d: format!("{beta2:?}"),
    };
    // An exempt variable's LARS and LAMB take no decay (the CPU's `without_decay`).
    let wd_of = |wd: f64| if decays { wd } else { 0.0 };
    Ok(match *spec {
        OptimizerSpec::Lars {
            momentum,
            weight_decay,
            trust,
            ..
        } => Rule::Lars {
            mu: flit(momentum),
            wd: flit(wd_of(weight_decay)),
            wdd: format!("{:?}", wd_of(weight_decay)),
            eta: format!("{trust:?}"),
        },
        OptimizerSpec::Lamb {
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } => Rule::Lamb {
            adam: adam(beta1, beta2, eps, false),
            wd: flit(wd_of(weight_decay)),
        },
        OptimizerSpec::Sgd { momentum: 0.0, .. } => Rule::Sgd,
        OptimizerSpec::Sgd { momentum, .. } => Rule::Momentum { mu: flit(momentum) },
        OptimizerSpec::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } => Rule::Adam(adam(beta1, beta2, eps, decays && weight_decay > 0.0)),
    })
}

impl Rule {
    fn slot_names(&self) -> &'static [&'static str] {
        match self {
            Rule::Sgd => &[],
            Rule::Momentum { .. } | Rule::Lars { .. } => &["momentum"],
            Rule::Adam(_) | Rule::Lamb { .. } => &["m", "v"],
        }
    }

    /// C run by every thread before its elements: the skip of an overflowed fp16 step
    /// ([`SKIP_STEP`]), the rate, and Adam's bias corrections.
    fn prologue(&self) -> String {
        let rate = format!("{SKIP_STEP} const float lr_ = ((const float*)(step + 1))[0]; const float keep_ = ((const float*)(step + 1))[1];");
        match self {
            Rule::Adam(a) | Rule::Lamb { adam: a, .. } => format!(
                "{rate} double t_ = (double)(*step + 1ull); float bc1 = (float)(1.0 - pow({}, t_)); float bc2 = (float)(1.0 - pow({}, t_));",
                a.b1d, a.b2d
            ),
            _ => rate,
        }
    }

    /// C updating element `at` of the variable (and its slots) with the scaled
    /// gradient `g` (a float expression evaluated once). A trust-ratio rule's step is
    /// `st_`, its learning rate times the trust ratio ([`trust_dense`]), and LAMB's
    /// moments were moved by an earlier pass.
    fn update(&self, at: &str, g: &str) -> String {
        match self {
            Rule::Lars { mu, wd, .. } => format!(
                "float v = {mu} * s0[{at}] + st_ * ({g} * sc + {wd} * w[{at}]); s0[{at}] = v; w[{at}] = w[{at}] - v;"
            ),
            Rule::Lamb { .. } => format!("w[{at}] = w[{at}] - st_ * {};", self.lamb_ratio(at)),
            Rule::Sgd => format!("w[{at}] = w[{at}] - lr_ * ({g} * sc);"),
            Rule::Momentum { mu } => format!(
                "float v = {mu} * s0[{at}] + {g} * sc; s0[{at}] = v; w[{at}] = w[{at}] - lr_ * v;"
            ),
            Rule::Adam(a) => format!(
                "float gs = {g} * sc; float m = {b1} * s0[{at}] + {c1} * gs; float v = {b2} * s1[{at}] + {c2} * gs * gs; s0[{at}] = m; s1[{at}] = v; {decay}w[{at}] = w[{at}] - lr_ * (m / bc1) / (sqrtf(v / bc2) + {eps});",
                decay = if a.decays {
                    format!("w[{at}] = w[{at}] * keep_; ")
                } else {
                    String::new()
                },
                b1 = a.b1,
                b2 = a.b2,
                c1 = a.c1,
                c2 = a.c2,
                eps = a.eps,
            ),
        }
    }

    /// LAMB's update direction at `at`, in f32 as the CPU computes it: the
    /// bias-corrected Adam ratio plus the decay.
    fn lamb_ratio(&self, at: &str) -> String {
        match self {
            Rule::Lamb { adam, wd } => format!(
                "((s0[{at}] / bc1) / (sqrtf(s1[{at}] / bc2) + {eps}) + {wd} * w[{at}])",
                eps = adam.eps
            ),
            _ => "0.0f".into(),
        }
    }

    /// Kernel parameters after the variable: the slots and, for Adam, the step.
    fn params(&self) -> &'static str {
        match self {
            Rule::Sgd => ", const u64* step",
            Rule::Momentum { .. } | Rule::Lars { .. } => ", float* s0, const u64* step",
            Rule::Adam(_) | Rule::Lamb { .. } => ", float* s0, float* s1, const u64* step",
        }
    }

    fn args(&self) -> Vec<KArg> {
        match self {
            Rule::Sgd => vec![KArg::Step],
            Rule::Momentum { .. } | Rule::Lars { .. } => vec![KArg::Slot(0), KArg::Step],
            Rule::Adam(_) | Rule::Lamb { .. } => {
                vec![KArg::Slot(0), KArg::Slot(1), KArg::Step]
            }
        }
    }

    fn base(&self, sparse: bool) -> &'static str {
        match (self, sparse) {
            (Rule::Sgd, false) => "sgd",
            (Rule::Momentum { .. }, false) => "momentum",
            (Rule::Adam(_), false) => "adam",
            (Rule::Sgd, true) => "sparse_sgd",
            (Rule::Momentum { .. }, true) => "sparse_momentum",
            (Rule::Adam(_), true) => "sparse_adam",
            (Rule::Lars { .. }, _) => "lars",
            (Rule::Lamb { .. }, _) => "lamb",
        }
    }

    /// Whether the rule scales its step by a trust ratio over the whole variable.
    fn trusts(&self) -> bool {
        matches!(self, Rule::Lars { .. } | Rule::Lamb { .. })
    }

    /// C computing `trust_` from the two norms' square sums `norms[0..2]` (the
    /// variable's, and the gradient's or LAMB's direction's), as the CPU does in f64.
    fn trust(&self, scale: f64) -> String {
        match self {
            Rule::Lars { wdd, eta, .. } => format!(
                "double wn_ = sqrt(norms[0]), gn_ = {scale:?} * sqrt(norms[1]); double trust_ = (wn_ > 0.0 && gn_ > 0.0) ? {eta} * wn_ / (gn_ + {wdd} * wn_) : 1.0;"
            ),
            _ => "double wn_ = sqrt(norms[0]), rn_ = sqrt(norms[1]); double trust_ = (wn_ > 0.0 && rn_ > 0.0) ? wn_ / rn_ : 1.0;".into(),
        }
    }
}

/// Threads of the one block that sums a variable's norms.
const NORM_BLOCK: u32 = 1024;

/// The 16-bit copy of a variable that its update writes beside it
/// ([`KArg::WeightCopy`]), when the forward pass casts the variable: the forward then
/// reads the copy instead of casting every step (the casts were the most frequent
/// launches of a 16-bit step). Written as the cast writes it, so the same bits.
#[derive(Clone, Copy)]
struct WeightCopy(Option<DType>);

impl WeightCopy {
    /// The kernel parameter, after the rule's.
    fn param(self) -> Result<String, String> {
        let Some(d) = self.0 else {
            return Ok(String::new());
        };
        let c = super::half::c_type(d)
            .filter(|_| matches!(d, DType::BF16 | DType::F16))
            .ok_or_else(|| format!("a weight copy in {} (bf16 or f16 only)", d.name()))?;
        Ok(format!(", {c}* __restrict__ wc"))
    }

    /// C writing the copy of updated element `at`.
    fn write(self, at: &str) -> String {
        match self.0 {
            Some(_) => format!(" narrow(wc + {at}, w[{at}]);"),
            None => String::new(),
        }
    }

    fn args(self, args: &mut Vec<KArg>) {
        if self.0.is_some() {
            args.push(KArg::WeightCopy);
        }
    }
}

/// A trust-ratio update of a dense gradient `grad` (the variable's own, or scratch a
/// sparse gradient was summed into): LAMB's moments, then one block sums the squares
/// of the variable and of the gradient (LARS) or of LAMB's direction into two f64s of
/// scratch (a fixed tree: the same bits every run), then each element's update reads
/// them and scales its step by the trust ratio.
fn trust_dense(
    cx: &mut NodeCx<'_>,
    rule: &Rule,
    ty: &TensorType,
    scale: f64,
    grad: KArg,
    copy: WeightCopy,
) -> Result<(), String> {
    let n = ty.shape.numel();
    let u = |v: usize| KArg::U64(v as u64);
    let params = rule.params();
    if let Rule::Lamb { adam, .. } = rule {
        let text = format!(
            "extern \"C\" __global__ void KNAME(const float* g, u64 n, float sc{params}) {{\n{INDEX}    {SKIP_STEP} float gs = g[i] * sc; s0[i] = {b1} * s0[i] + {c1} * gs; s1[i] = {b2} * s1[i] + {c2} * gs * gs;\n}}\n",
            b1 = adam.b1,
            b2 = adam.b2,
            c1 = adam.c1,
            c2 = adam.c2,
        );
        let name = cx.kernel("lamb_moments", text);
        let mut args = vec![grad.clone(), u(n), KArg::F32(scale as f32)];
        args.extend(rule.args());
        cx.launch_1d(&name, n, args)?;
    }
    let second = match rule {
        Rule::Lamb { .. } => rule.lamb_ratio("i"),
        _ => "g[i]".into(),
    };
    let norms = format!(
        "extern \"C\" __global__ void KNAME(const float* w, const float* g, u64 n, double* norms{params}) {{
    {pro}
    __shared__ double sh[2 * {NORM_BLOCK}];
    double a = 0.0, b = 0.0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) {{
        double x = (double)w[i], y = (double)({second});
        a += x * x;
        b += y * y;
    }}
    sh[threadIdx.x] = a;
    sh[{NORM_BLOCK} + threadIdx.x] = b;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {{
        if (threadIdx.x < s) {{
            sh[threadIdx.x] += sh[threadIdx.x + s];
            sh[{NORM_BLOCK} + threadIdx.x] += sh[{NORM_BLOCK} + threadIdx.x + s];
        }}
        __syncthreads();
    }}
    if (threadIdx.x == 0) {{ norms[0] = sh[0]; norms[1] = sh[{NORM_BLOCK}]; }}
}}
",
        pro = rule.prologue(),
    );
    let norms = cx.kernel(&format!("{}_norms", rule.base(false)), norms);
    let sums = cx.scratch(16);
    let mut args = vec![KArg::Param, grad.clone(), u(n), sums.clone()];
    args.extend(rule.args());
    cx.launch(&norms, [1, 1, 1], NORM_BLOCK, args);
    let text = format!(
        "extern \"C\" __global__ void KNAME(float* w, const float* g, u64 n, float sc{params}, const double* norms{cp}) {{\n{INDEX}    {pro}\n    {trust}\n    const float st_ = (float)((double)lr_ * trust_);\n    {upd}{cw}\n}}\n",
        pro = rule.prologue(),
        trust = rule.trust(scale),
        upd = rule.update("i", "g[i]"),
        cp = copy.param()?,
        cw = copy.write("i"),
    );
    let name = cx.kernel(rule.base(false), text);
    let mut args = vec![KArg::Param, grad, u(n), KArg::F32(scale as f32)];
    args.extend(rule.args());
    args.push(sums);
    copy.args(&mut args);
    cx.launch_1d(&name, n, args)
}

/// The update kernels of `spec` for each `(name, type, sparse gradient)` variable
/// (`lazy`: a sparse gradient of momentum or Adam updates only its rows); every
/// gradient is first multiplied by `grad_scale` (as `Optimizer::apply`'s
/// `scale`). A sparse variable's gradient is an `IndexedSlices` buffer of at most
/// `nnz` rows (its type's bound; the launch reads the true count on the device). A
/// variable named in `copies` also gets its 16-bit copy written ([`KArg::WeightCopy`],
/// see [`weight_copies`]).
pub fn optimizer_kernels(
    spec: &OptimizerSpec,
    no_decay: &[String],
    lazy: bool,
    params: &[(String, TensorType, Option<usize>)],
    copies: &HashMap<String, DType>,
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
    let exempt = |name: &str| no_decay.iter().any(|n| n == distc_ir::whole_variable(name));
    let as_dense = spec.moves_untouched_rows(lazy);
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
        let copy = WeightCopy(copies.get(name).copied());
        match bound {
            None => dense(&mut cx, rule, ty, KArg::Grad, grad_scale, copy).map_err(err)?,
            Some(nnz) => {
                sparse(&mut cx, (rule, as_dense), ty, *nnz, grad_scale, copy).map_err(err)?
            }
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
fn dense(
    cx: &mut NodeCx<'_>,
    rule: &Rule,
    ty: &TensorType,
    grad: KArg,
    scale: f64,
    copy: WeightCopy,
) -> Result<(), String> {
    if rule.trusts() {
        return trust_dense(cx, rule, ty, scale, grad, copy);
    }
    let n = ty.shape.numel();
    let text = format!(
        "extern \"C\" __global__ void KNAME(float* w, const float* g, u64 n, float sc{params}{cp}) {{\n{INDEX}    {pro}\n    {upd}{cw}\n}}\n",
        params = rule.params(),
        pro = rule.prologue(),
        upd = rule.update("i", "g[i]"),
        cp = copy.param()?,
        cw = copy.write("i"),
    );
    let name = cx.kernel(rule.base(false), text);
    let mut args = vec![
        KArg::Param,
        grad,
        KArg::U64(n as u64),
        KArg::F32(scale as f32),
    ];
    args.extend(rule.args());
    copy.args(&mut args);
    cx.launch_1d(&name, n, args)
}

/// The update of a row-sparse gradient: with `as_dense`
/// (`OptimizerSpec::moves_untouched_rows`), the rows summed into a dense gradient and
/// the dense update; else (plain SGD; momentum and Adam under `lazy`) the row-wise
/// update: the repeated-row machinery of `sparse`, its last step updating each
/// touched row of the variable (and its slots) with the row's summed gradient.
fn sparse(
    cx: &mut NodeCx<'_>,
    (rule, as_dense): (&Rule, bool),
    ty: &TensorType,
    nnz: usize,
    scale: f64,
    copy: WeightCopy,
) -> Result<(), String> {
    let Some(&rows) = ty.dims().first() else {
        return Err(format!(
            "a row-sparse gradient needs a table, the variable is {ty}"
        ));
    };
    let row = row_len(ty);
    if as_dense {
        // The rows summed into a dense gradient in scratch, zeros elsewhere.
        let dense = cx.scratch(ty.bytes());
        cx.out.launches.push(Launch::Memset {
            buf: dense.clone(),
            bytes: ty.bytes() as u64,
        });
        let sink = UniqueSink {
            base: "densify",
            params: ", float* y".into(),
            per_row: String::new(),
            per_col: format!("y[(u64)id * {row}ull + c] = g;"),
            args: vec![dense.clone()],
        };
        unique_launches(cx, KArg::Grad, (rows, row, nnz), None, sink)?;
        return self::dense(cx, rule, ty, dense, scale, copy);
    }
    let mut args = vec![KArg::Param, KArg::F32(scale as f32)];
    args.extend(rule.args());
    copy.args(&mut args);
    let sink = UniqueSink {
        base: rule.base(true),
        params: format!(", float* w, float sc{}{}", rule.params(), copy.param()?),
        per_row: String::new(),
        per_col: format!(
            "{} u64 at = (u64)id * {row}ull + c; {}{}",
            rule.prologue(),
            rule.update("at", "g"),
            copy.write("at")
        ),
        args,
    };
    unique_launches(cx, KArg::Grad, (rows, row, nnz), None, sink)
}

/// The casts of `graph` whose output can be a variable's 16-bit copy that the update
/// keeps ([`KArg::WeightCopy`]): a `cast` to bf16 or f16 straight from a trained
/// variable's `param` node, the only such cast of that variable. By node: the
/// variable and the copy's type.
pub fn weight_copies(graph: &Graph) -> HashMap<NodeId, (String, DType)> {
    let trained: Vec<&str> = graph
        .node_ids()
        .into_iter()
        .filter_map(|id| match graph.op(id) {
            Op::ParamGrad { param } => Some(param.as_str()),
            _ => None,
        })
        .collect();
    let mut by_var: HashMap<String, Vec<(NodeId, DType)>> = HashMap::new();
    for id in graph.node_ids() {
        let Op::Cast { to } = graph.op(id) else {
            continue;
        };
        if !matches!(to, DType::BF16 | DType::F16) {
            continue;
        }
        let Some(src) = graph.node(id).inputs.first() else {
            continue;
        };
        if let Op::Param { name, .. } = graph.op(src.node) {
            if trained.contains(&name.as_str()) {
                by_var.entry(name.clone()).or_default().push((id, *to));
            }
        }
    }
    by_var
        .into_iter()
        .filter_map(|(var, casts)| match casts.as_slice() {
            [(id, to)] => Some((*id, (var, *to))),
            _ => None,
        })
        .collect()
}

/// The gradient's nnz bound if `ty` is `IndexedSlices`, for [`optimizer_kernels`]'s
/// variable list.
pub fn sparse_bound(ty: &ValueType) -> Option<usize> {
    match ty {
        ValueType::IndexedSlices { nnz, .. } => Some(*nnz),
        ValueType::Tensor(_) => None,
    }
}
