//! The `train` block to a [`RunConfig`]: data source, batch, optimizer, learning-rate
//! schedule, steps, seed and evaluation settings, each checked and located.

use super::args::{self, bind, describe, Sig};
use super::ast::{Arg, Expr, ExprKind, Ident, Span, TrainBlock};
use super::error::{did_you_mean, line_of, Diag};
use distc_runtime::{DataSpec, Decay, LinearScaling, LrSchedule, OptimizerSpec, RunConfig};

type R<T> = Result<T, Diag>;

/// The keys of the train block: `(key, required)`.
pub(super) const KEYS: &[(&str, bool)] = &[
    ("data", true),
    ("batch", true),
    ("optimizer", true),
    ("steps", true),
    ("seed", false),
    ("eval_every", false),
    ("eval_samples", false),
    ("lr_schedule", false),
    ("lr_scaling", false),
    ("metrics", false),
    ("clip_norm", false),
    ("no_decay", false),
    ("decay_min_rank", false),
];

const METRICS: &[Sig] = &[
    Sig {
        name: "accuracy",
        params: &[],
        usage: "accuracy",
    },
    Sig {
        name: "top_k",
        params: &[("k", true)],
        usage: "top_k(5)",
    },
    Sig {
        name: "perplexity",
        params: &[],
        usage: "perplexity",
    },
    Sig {
        name: "rmse",
        params: &[],
        usage: "rmse",
    },
];

const SOURCES: &[Sig] = &[
    Sig {
        name: "mnist",
        params: &[],
        usage: "mnist()",
    },
    Sig {
        name: "ptb",
        params: &[("context", false)],
        usage: "ptb(context = 8)",
    },
    Sig {
        name: "movielens",
        params: &[("test_fraction", false)],
        usage: "movielens(test_fraction = 0.1)",
    },
    Sig {
        name: "zipf_tokens",
        params: &[
            ("vocab", true),
            ("context", true),
            ("classes", true),
            ("s", true),
        ],
        usage: "zipf_tokens(vocab, context, classes, s)",
    },
    Sig {
        name: "gaussian_classes",
        params: &[("features", true), ("classes", true)],
        usage: "gaussian_classes(features, classes)",
    },
    Sig {
        name: "tokens",
        params: &[
            ("path", true),
            ("context", true),
            ("eval_path", false),
            ("dtype", false),
        ],
        usage: "tokens(path = \"train.bin\", context, eval_path = \"val.bin\", dtype = \"u16\")",
    },
    Sig {
        name: "tensors",
        params: &[("path", true), ("eval_path", false), ("shuffle", false)],
        usage: "tensors(path = \"train.safetensors\", eval_path = \"test.safetensors\", shuffle = true)",
    },
    Sig {
        name: "csv",
        params: &[("path", true), ("eval_path", false)],
        usage: "csv(path = \"train.csv\", eval_path = \"test.csv\")",
    },
];

const OPTIMIZERS: &[Sig] = &[
    Sig {
        name: "sgd",
        params: &[("lr", true), ("momentum", false), ("lazy", false)],
        usage: "sgd(lr, momentum = 0, lazy = false)",
    },
    Sig {
        name: "adam",
        params: &[
            ("lr", true),
            ("beta1", false),
            ("beta2", false),
            ("eps", false),
            ("lazy", false),
        ],
        usage: "adam(lr, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, lazy = false)",
    },
    Sig {
        name: "adamw",
        params: &[
            ("lr", true),
            ("beta1", false),
            ("beta2", false),
            ("eps", false),
            ("weight_decay", false),
            ("lazy", false),
        ],
        usage:
            "adamw(lr, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01, lazy = false)",
    },
    Sig {
        name: "lars",
        params: &[
            ("lr", true),
            ("momentum", false),
            ("weight_decay", false),
            ("trust", false),
        ],
        usage: "lars(lr, momentum = 0.9, weight_decay = 0, trust = 0.001)",
    },
    Sig {
        name: "lamb",
        params: &[
            ("lr", true),
            ("beta1", false),
            ("beta2", false),
            ("eps", false),
            ("weight_decay", false),
        ],
        usage: "lamb(lr, beta1 = 0.9, beta2 = 0.999, eps = 1e-6, weight_decay = 0)",
    },
];

const SCHEDULES: &[Sig] = &[
    Sig {
        name: "constant",
        params: &[("warmup", false)],
        usage: "constant(warmup = 0)",
    },
    Sig {
        name: "step",
        params: &[("every", true), ("gamma", false), ("warmup", false)],
        usage: "step(every, gamma = 0.1, warmup = 0)",
    },
    Sig {
        name: "cosine",
        params: &[("warmup", false), ("final", false)],
        usage: "cosine(warmup = 0, final = 0)",
    },
    Sig {
        name: "poly",
        params: &[("power", false), ("warmup", false), ("final", false)],
        usage: "poly(power = 1, warmup = 0, final = 0)",
    },
];

const SCALINGS: &[Sig] = &[
    Sig {
        name: "none",
        params: &[],
        usage: "none()",
    },
    Sig {
        name: "linear",
        params: &[],
        usage: "linear()",
    },
];

/// The lowered train block, with where its settings are written.
pub(crate) struct Train {
    pub config: RunConfig,
    /// The `batch = ...` value.
    pub batch_span: Span,
    /// The `metrics = [...]` value, if set.
    pub metrics_span: Option<Span>,
    /// The variables `no_decay = [...]` names, each where it is written (checked
    /// against the model's variables once it is lowered).
    pub no_decay: Vec<(String, Span)>,
    /// `decay_min_rank = r`: variables of lower rank skip the weight decay.
    pub decay_min_rank: Option<(usize, Span)>,
}

/// Checks and lowers the train block.
pub(crate) fn lower_train(block: &TrainBlock, src: &str) -> R<Train> {
    let mut values: Vec<Option<&Expr>> = vec![None; KEYS.len()];
    for entry in &block.entries {
        let key = &entry.key;
        let Some(i) = KEYS.iter().position(|(k, _)| *k == key.name) else {
            return Err(unknown_key(key));
        };
        if let Some(first) = values[i] {
            return Err(Diag::new(
                key.span,
                format!("`{}` is set twice in the train block", key.name),
                "set again here",
            )
            .help(format!(
                "`{}` is first set on line {}; remove one of them",
                key.name,
                line_of(src, first.span.start)
            )));
        }
        values[i] = Some(&entry.value);
    }
    for (i, (k, required)) in KEYS.iter().enumerate() {
        if *required && values[i].is_none() {
            return Err(Diag::new(
                block.keyword,
                format!("the train block does not set `{k}`"),
                format!("`{k}` is missing"),
            )
            .help(format!("add `{k} = {}`", example(k))));
        }
    }
    let get = |k: &str| {
        KEYS.iter()
            .position(|(key, _)| *key == k)
            .and_then(|i| values[i])
    };
    let (Some(data), Some(batch), Some(optimizer), Some(steps)) =
        (get("data"), get("batch"), get("optimizer"), get("steps"))
    else {
        return Err(Diag::new(
            block.keyword,
            "the train block is incomplete",
            "",
        ));
    };
    let (optimizer, lazy_updates) = lower_optimizer(optimizer)?;
    let config = RunConfig {
        data: lower_data(data)?,
        batch: args::usize_(batch, "`batch`", 1)?,
        optimizer,
        lazy_updates,
        steps: args::usize_(steps, "`steps`", 1)?,
        seed: match get("seed") {
            Some(e) => args::uint(e, "`seed`", 0)?,
            None => 0,
        },
        eval_every: match get("eval_every") {
            Some(e) => args::usize_(e, "`eval_every`", 0)?,
            None => 0,
        },
        eval_samples: match get("eval_samples") {
            Some(e) => Some(args::usize_(e, "`eval_samples`", 1)?),
            None => None,
        },
        lr_schedule: match get("lr_schedule") {
            Some(e) => lower_schedule(e)?,
            None => LrSchedule::default(),
        },
        lr_scaling: None,
        metrics: match get("metrics") {
            Some(e) => lower_metrics(e)?,
            None => Vec::new(),
        },
        no_decay: Vec::new(),
        clip_norm: match get("clip_norm") {
            Some(e) => {
                let c = args::float(e, "`clip_norm`")?;
                if !c.is_finite() || c <= 0.0 {
                    return Err(Diag::new(
                        e.span,
                        format!("`clip_norm` must be a positive number, found {c}"),
                        "must be > 0",
                    ));
                }
                Some(c)
            }
            None => None,
        },
    };
    let no_decay = match get("no_decay") {
        None => Vec::new(),
        Some(e) => {
            let ExprKind::List(items) = &e.kind else {
                return Err(Diag::new(
                    e.span,
                    format!("`no_decay` is a list of variables, found {}", describe(e)),
                    "not a list",
                )
                .help("e.g. `no_decay = [b1, ln_gain]`"));
            };
            let mut names = Vec::new();
            for item in items {
                let ExprKind::Name(n) = &item.kind else {
                    return Err(Diag::new(
                        item.span,
                        format!(
                            "`no_decay` lists variables by name, found {}",
                            describe(item)
                        ),
                        "not a name",
                    ));
                };
                names.push((n.clone(), item.span));
            }
            names
        }
    };
    let decay_min_rank = match get("decay_min_rank") {
        None => None,
        Some(e) => Some((args::usize_(e, "`decay_min_rank`", 0)?, e.span)),
    };
    if (!no_decay.is_empty() || decay_min_rank.is_some()) && config.optimizer.weight_decay() == 0.0
    {
        let span = get("no_decay")
            .or(get("decay_min_rank"))
            .map_or(block.keyword, |e| e.span);
        return Err(Diag::new(
            span,
            format!(
                "`{}` has no weight decay to exempt variables from",
                config.optimizer.name()
            ),
            "nothing to exempt from",
        )
        .help("set the optimizer's `weight_decay`, e.g. `adamw(lr = 3e-4, weight_decay = 0.1)`"));
    }
    let mut config = config;
    if let Some(e) = get("lr_scaling") {
        let (name, args) = call_parts(e, "a learning-rate scaling", "lr_scaling = linear()")?;
        let sig = find(
            SCALINGS,
            name,
            "learning-rate scaling",
            "a learning-rate scaling",
        )?;
        bind(sig, "learning-rate scaling", e.span, args)?;
        // Until compile knows the strategy, the global batch is the train block's.
        config.lr_scaling = (sig.name == "linear").then(|| LinearScaling {
            batch: config.batch,
            global_batch: config.batch,
            base_lr: config.optimizer.lr(),
        });
    }
    Ok(Train {
        config,
        batch_span: batch.span,
        metrics_span: get("metrics").map(|e| e.span),
        no_decay,
        decay_min_rank,
    })
}

/// `metrics = [accuracy, top_k(5), perplexity, rmse]`: each at most once.
fn lower_metrics(e: &Expr) -> R<Vec<distc_runtime::Metric>> {
    use distc_runtime::Metric;
    let ExprKind::List(items) = &e.kind else {
        return Err(Diag::new(
            e.span,
            format!("`metrics` is a list, found {}", describe(e)),
            "expected `[...]`",
        )
        .help("e.g. `metrics = [accuracy, top_k(5)]`"));
    };
    let mut out: Vec<Metric> = Vec::new();
    for item in items {
        let (name, args) = match &item.kind {
            ExprKind::Name(n) => (
                Ident {
                    name: n.clone(),
                    span: item.span,
                },
                &[][..],
            ),
            ExprKind::Call { name, args } => (name.clone(), args.as_slice()),
            _ => {
                return Err(Diag::new(
                    item.span,
                    format!("expected a metric, found {}", describe(item)),
                    "not a metric",
                ))
            }
        };
        let sig = find(METRICS, &name, "metric", "a metric")?;
        let slots = bind(sig, "metric", item.span, args)?;
        let metric = match sig.name {
            "accuracy" => Metric::Accuracy,
            "top_k" => Metric::TopK {
                k: match slots[0] {
                    Some(a) => args::usize_(&a.value, "`k`", 1)?,
                    None => 1,
                },
            },
            "perplexity" => Metric::Perplexity,
            _ => Metric::Rmse,
        };
        let same_kind = |m: &Metric| std::mem::discriminant(m) == std::mem::discriminant(&metric);
        if out.iter().any(same_kind) {
            return Err(Diag::new(
                item.span,
                format!("`{}` is listed twice", sig.name),
                "again",
            ));
        }
        out.push(metric);
    }
    Ok(out)
}

fn example(key: &str) -> &'static str {
    match key {
        "data" => "mnist()",
        "batch" => "64",
        "optimizer" => "sgd(lr = 0.1)",
        "steps" => "1000",
        _ => "...",
    }
}

fn unknown_key(key: &Ident) -> Diag {
    let names: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
    let list = names.join(", ");
    let help = match did_you_mean(&key.name, names.iter().copied()) {
        Some(s) => format!("{s} the settings are: {list}"),
        None => format!("the settings are: {list}"),
    };
    Diag::new(
        key.span,
        format!("unknown train setting `{}`", key.name),
        "unknown setting",
    )
    .help(help)
}

/// `name(args)` or a bare `name`, as written for a data source or an optimizer.
fn call_parts<'a>(e: &'a Expr, what: &str, example: &str) -> R<(&'a Ident, &'a [Arg])> {
    match &e.kind {
        ExprKind::Call { name, args } => Ok((name, args.as_slice())),
        ExprKind::Name(_) => Err(Diag::new(
            e.span,
            format!("{what} is written as a call"),
            "add parentheses",
        )
        .help(format!("e.g. `{example}`"))),
        _ => Err(Diag::new(
            e.span,
            format!("expected {what}, found {}", describe(e)),
            format!("expected {what}"),
        )
        .help(format!("e.g. `{example}`"))),
    }
}

fn find<'s>(table: &'s [Sig], name: &Ident, what: &str, a_what: &str) -> R<&'s Sig> {
    if let Some(sig) = table.iter().find(|s| s.name == name.name) {
        return Ok(sig);
    }
    let usages: Vec<&str> = table.iter().map(|s| s.usage).collect();
    let list = usages.join(", ");
    let help = match did_you_mean(&name.name, table.iter().map(|s| s.name)) {
        Some(s) => format!("{s} the {what}s are: {list}"),
        None => format!("the {what}s are: {list}"),
    };
    Err(Diag::new(
        name.span,
        format!("unknown {what} `{}`", name.name),
        format!("not {a_what}"),
    )
    .help(help))
}

fn lower_data(e: &Expr) -> R<DataSpec> {
    let (name, args) = call_parts(e, "a data source", "data = mnist()")?;
    let sig = find(SOURCES, name, "data source", "a data source")?;
    let slots = bind(sig, "data source", e.span, args)?;
    let val = |i: usize| slots[i].map(|a| &a.value);
    let count = |i: usize, what: &str| -> R<usize> {
        match val(i) {
            Some(v) => args::usize_(v, what, 1),
            None => Ok(0),
        }
    };
    Ok(match sig.name {
        "mnist" => DataSpec::Mnist,
        "ptb" => DataSpec::Ptb {
            context: match val(0) {
                Some(v) => args::usize_(v, "`context`", 1)?,
                None => 8,
            },
        },
        "movielens" => DataSpec::Movielens {
            test_fraction: match val(0) {
                Some(v) => {
                    let f = args::float(v, "`test_fraction`")?;
                    if !(f > 0.0 && f < 1.0) {
                        return Err(Diag::new(
                            v.span,
                            format!("`test_fraction` must be between 0 and 1, found {f}"),
                            "out of range",
                        ));
                    }
                    f
                }
                None => 0.1,
            },
        },
        "zipf_tokens" => {
            let s_expr = val(3).ok_or_else(|| Diag::new(e.span, "missing `s`", ""))?;
            let s = args::float(s_expr, "`s`")?;
            if s <= 0.0 {
                return Err(Diag::new(
                    s_expr.span,
                    format!("the Zipf exponent `s` must be positive, found {s}"),
                    "must be > 0",
                ));
            }
            DataSpec::ZipfTokens {
                vocab: count(0, "`vocab`")?,
                context: count(1, "`context`")?,
                classes: count(2, "`classes`")?,
                s,
            }
        }
        "gaussian_classes" => DataSpec::GaussianClasses {
            features: count(0, "`features`")?,
            classes: count(1, "`classes`")?,
        },
        "tokens" => {
            let width = match val(3) {
                None => 2,
                Some(v) => match args::string(v, "`dtype`")?.as_str() {
                    "u16" => 2,
                    "u32" => 4,
                    other => {
                        return Err(Diag::new(
                            v.span,
                            format!("a token file holds \"u16\" or \"u32\" ids, not \"{other}\""),
                            "unknown token type",
                        ))
                    }
                },
            };
            DataSpec::Tokens {
                path: path(val(0), e.span)?,
                eval_path: val(2).map(|v| args::string(v, "`eval_path`")).transpose()?,
                width,
                context: count(1, "`context`")?,
            }
        }
        "tensors" => DataSpec::Tensors {
            path: path(val(0), e.span)?,
            eval_path: val(1).map(|v| args::string(v, "`eval_path`")).transpose()?,
            fields: Vec::new(),
            in_order: !val(2)
                .map(|v| args::boolean(v, "`shuffle`"))
                .transpose()?
                .unwrap_or(true),
        },
        _ => DataSpec::Csv {
            path: path(val(0), e.span)?,
            eval_path: val(1).map(|v| args::string(v, "`eval_path`")).transpose()?,
            fields: Vec::new(),
        },
    })
}

/// A file source's required `path`.
fn path(v: Option<&Expr>, call: Span) -> R<String> {
    let v = v.ok_or_else(|| Diag::new(call, "missing `path`", "the data file"))?;
    args::string(v, "`path`")
}

/// A hyper-parameter in `lo..hi` (`lo` excluded when `open_lo`, `hi` always excluded).
fn hyper(v: Option<&Expr>, what: &str, default: f64, open_lo: bool, lo: f64, hi: f64) -> R<f64> {
    let Some(v) = v else { return Ok(default) };
    let x = args::float(v, what)?;
    let ok = (if open_lo { x > lo } else { x >= lo }) && x < hi;
    if !ok {
        let range = match (open_lo, hi.is_finite()) {
            (true, false) => "positive".to_string(),
            (true, true) => format!("in ({lo}, {hi})"),
            (false, _) => format!("in [{lo}, {hi})"),
        };
        return Err(Diag::new(
            v.span,
            format!("{what} must be {range}, found {x}"),
            "out of range",
        ));
    }
    Ok(x)
}

/// A factor in `[0, 1]`, or `(0, 1]` when `open_lo`.
fn fraction(v: Option<&Expr>, what: &str, default: f64, open_lo: bool) -> R<f64> {
    let Some(v) = v else { return Ok(default) };
    let x = args::float(v, what)?;
    if (open_lo && x <= 0.0) || !(0.0..=1.0).contains(&x) {
        let range = if open_lo { "(0, 1]" } else { "[0, 1]" };
        return Err(Diag::new(
            v.span,
            format!("{what} must be in {range}, found {x}"),
            "out of range",
        ));
    }
    Ok(x)
}

fn lower_schedule(e: &Expr) -> R<LrSchedule> {
    let (name, args) = call_parts(
        e,
        "a learning-rate schedule",
        "lr_schedule = cosine(warmup = 100)",
    )?;
    let sig = find(
        SCHEDULES,
        name,
        "learning-rate schedule",
        "a learning-rate schedule",
    )?;
    let slots = bind(sig, "learning-rate schedule", e.span, args)?;
    let arg = |key: &str| {
        sig.params
            .iter()
            .position(|(k, _)| *k == key)
            .and_then(|i| slots[i])
            .map(|a| &a.value)
    };
    let warmup = match arg("warmup") {
        Some(v) => args::usize_(v, "`warmup`", 0)?,
        None => 0,
    };
    let final_factor = fraction(arg("final"), "`final`", 0.0, false)?;
    let decay = match sig.name {
        "constant" => Decay::Constant,
        "step" => Decay::Step {
            every: match arg("every") {
                Some(v) => args::usize_(v, "`every`", 1)?,
                None => 1,
            },
            gamma: fraction(arg("gamma"), "`gamma`", 0.1, true)?,
        },
        "cosine" => Decay::Cosine { final_factor },
        _ => Decay::Poly {
            power: hyper(arg("power"), "`power`", 1.0, true, 0.0, f64::INFINITY)?,
            final_factor,
        },
    };
    Ok(LrSchedule { warmup, decay })
}

/// The optimizer and its `lazy` flag (`RunConfig::lazy_updates`: row-sparse
/// gradients update only their rows, as TensorFlow's LazyAdam; LARS and LAMB, whose
/// trust ratio is over the whole variable, have none).
fn lower_optimizer(e: &Expr) -> R<(OptimizerSpec, bool)> {
    let (name, args) = call_parts(e, "an optimizer", "optimizer = sgd(lr = 0.1)")?;
    let sig = find(OPTIMIZERS, name, "optimizer", "an optimizer")?;
    let slots = bind(sig, "optimizer", e.span, args)?;
    let val = |i: usize| slots[i].map(|a| &a.value);
    let lr = hyper(
        val(0),
        "the learning rate `lr`",
        0.0,
        true,
        0.0,
        f64::INFINITY,
    )?;
    let lazy = |i: usize| match val(i) {
        Some(v) => args::boolean(v, "`lazy`"),
        None => Ok(false),
    };
    Ok(match sig.name {
        "sgd" => (
            OptimizerSpec::Sgd {
                lr,
                momentum: hyper(val(1), "`momentum`", 0.0, false, 0.0, 1.0)?,
            },
            lazy(2)?,
        ),
        "lars" => (
            OptimizerSpec::Lars {
                lr,
                momentum: hyper(val(1), "`momentum`", 0.9, false, 0.0, 1.0)?,
                weight_decay: hyper(val(2), "`weight_decay`", 0.0, false, 0.0, 1.0)?,
                trust: hyper(val(3), "`trust`", 0.001, true, 0.0, f64::INFINITY)?,
            },
            false,
        ),
        "lamb" => (
            OptimizerSpec::Lamb {
                lr,
                beta1: hyper(val(1), "`beta1`", 0.9, false, 0.0, 1.0)?,
                beta2: hyper(val(2), "`beta2`", 0.999, false, 0.0, 1.0)?,
                eps: hyper(val(3), "`eps`", 1e-6, true, 0.0, f64::INFINITY)?,
                weight_decay: hyper(val(4), "`weight_decay`", 0.0, false, 0.0, 1.0)?,
            },
            false,
        ),
        "adamw" => (
            OptimizerSpec::Adam {
                lr,
                beta1: hyper(val(1), "`beta1`", 0.9, false, 0.0, 1.0)?,
                beta2: hyper(val(2), "`beta2`", 0.999, false, 0.0, 1.0)?,
                eps: hyper(val(3), "`eps`", 1e-8, true, 0.0, f64::INFINITY)?,
                weight_decay: hyper(val(4), "`weight_decay`", 0.01, false, 0.0, 1.0)?,
            },
            lazy(5)?,
        ),
        _ => (
            OptimizerSpec::Adam {
                lr,
                beta1: hyper(val(1), "`beta1`", 0.9, false, 0.0, 1.0)?,
                beta2: hyper(val(2), "`beta2`", 0.999, false, 0.0, 1.0)?,
                eps: hyper(val(3), "`eps`", 1e-8, true, 0.0, f64::INFINITY)?,
                weight_decay: 0.0,
            },
            lazy(4)?,
        ),
    })
}
