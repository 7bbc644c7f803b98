//! The run configuration: what a plan asks the runtime to do. Written by the DSL's
//! `train` block, carried in the plan, read here. The plan is the only contract
//! between compiler and runtime, so this type lives on the runtime's side.

use serde::{Deserialize, Serialize};

/// Where training data comes from. Each source provides named fields; a model's
/// `input`s are bound to them by name (see [`DataSpec::fields`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataSpec {
    /// MNIST from `<data>/mnist`: `image` f32 (784 values per sample, scaled to [0,1],
    /// any input shape with 784 elements per sample, e.g. `[B,784]` or `[B,1,28,28]`),
    /// `label` i32[B]. Evaluation: the 10k test set.
    Mnist,
    /// Penn Treebank from `<data>/ptb`: `context` i32[B, context] (word ids),
    /// `next` i32[B] (the following word). Evaluation: the valid split.
    Ptb {
        /// Words of context.
        context: usize,
    },
    /// MovieLens 100K from `<data>/ml-100k/u.data`: `user` i32[B], `item` i32[B]
    /// (ids minus one), `rating` f32[B] (1..5). Evaluation: a seeded held-out fraction.
    Movielens {
        /// Fraction of ratings held out for evaluation.
        test_fraction: f64,
    },
    /// Synthetic W1 (WORKLOADS.md): `ids` i32[B, context] Zipf(s) over `0..vocab`,
    /// `label` i32[B] = last id mod `classes`.
    ZipfTokens {
        /// Vocabulary size.
        vocab: usize,
        /// Ids per sample.
        context: usize,
        /// Number of classes.
        classes: usize,
        /// Zipf exponent.
        s: f64,
    },
    /// Synthetic W2 (WORKLOADS.md): `x` f32[B, features] standard normal, `label`
    /// i32[B] uniform in `0..classes`.
    GaussianClasses {
        /// Features per sample.
        features: usize,
        /// Number of classes.
        classes: usize,
    },
    /// A flat binary stream of token ids, little-endian u16 or u32 with no header (the
    /// nanoGPT and llm.c `.bin` layout): `tokens` i32[B, context] is a window of the
    /// stream and `targets` i32[B, context] the window one token later. Sample `i` is
    /// the window starting at token `i`; training draws every start once an epoch in a
    /// seeded permutation. Evaluation: `eval_path`'s windows in order, `context`
    /// apart.
    Tokens {
        /// The training stream, relative to the data directory or absolute.
        path: String,
        /// The held-out stream, if any.
        eval_path: Option<String>,
        /// Bytes per token: 2 (`"u16"`) or 4 (`"u32"`).
        width: usize,
        /// Tokens per sample.
        context: usize,
    },
    /// Named arrays whose first axis is the sample axis, from a `.safetensors` file, a
    /// `.npz` archive or a folder of `.npy` files (one per name): each model input
    /// reads the array of its name. `fields` are the model's inputs (name, dtype,
    /// values per sample), set by the compiler and checked against the file.
    Tensors {
        /// The training arrays, relative to the data directory or absolute.
        path: String,
        /// The held-out arrays, if any.
        eval_path: Option<String>,
        /// What the model reads.
        fields: Vec<FieldSpec>,
        /// Train on the samples in file order, epoch after epoch (no shuffle): to
        /// replay exactly the batches another system trained on.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        in_order: bool,
    },
    /// A CSV file with a header row: each model input reads the column of its name,
    /// one value per sample (f32 inputs read numbers, i32 inputs whole numbers).
    Csv {
        /// The training rows, relative to the data directory or absolute.
        path: String,
        /// The held-out rows, if any.
        eval_path: Option<String>,
        /// What the model reads (the compiler sets them from the model's inputs).
        fields: Vec<FieldSpec>,
    },
}

/// A field a model reads from a file source whose fields the file names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldSpec {
    /// The array or column name, and the model input's.
    pub name: String,
    /// The model input's element type.
    pub dtype: distc_ir::DType,
    /// Values per sample.
    pub per_sample: usize,
}

impl DataSpec {
    /// The source's name in the DSL.
    pub fn name(&self) -> &'static str {
        match self {
            DataSpec::Mnist => "mnist",
            DataSpec::Ptb { .. } => "ptb",
            DataSpec::Movielens { .. } => "movielens",
            DataSpec::ZipfTokens { .. } => "zipf_tokens",
            DataSpec::GaussianClasses { .. } => "gaussian_classes",
            DataSpec::Tokens { .. } => "tokens",
            DataSpec::Tensors { .. } => "tensors",
            DataSpec::Csv { .. } => "csv",
        }
    }

    /// Whether training samples come in file order instead of shuffled per epoch.
    pub fn in_order(&self) -> bool {
        matches!(self, DataSpec::Tensors { in_order: true, .. })
    }

    /// The fields one sample provides: name, dtype, and elements per sample.
    pub fn fields(&self) -> Vec<(&str, distc_ir::DType, usize)> {
        use distc_ir::DType::{F32, I32};
        match self {
            DataSpec::Mnist => vec![("image", F32, 784), ("label", I32, 1)],
            DataSpec::Ptb { context } => vec![("context", I32, *context), ("next", I32, 1)],
            DataSpec::Movielens { .. } => {
                vec![("user", I32, 1), ("item", I32, 1), ("rating", F32, 1)]
            }
            DataSpec::ZipfTokens { context, .. } => vec![("ids", I32, *context), ("label", I32, 1)],
            DataSpec::GaussianClasses { features, .. } => {
                vec![("x", F32, *features), ("label", I32, 1)]
            }
            DataSpec::Tokens { context, .. } => {
                vec![("tokens", I32, *context), ("targets", I32, *context)]
            }
            DataSpec::Tensors { fields, .. } | DataSpec::Csv { fields, .. } => fields
                .iter()
                .map(|f| (f.name.as_str(), f.dtype, f.per_sample))
                .collect(),
        }
    }

    /// Whether the file names the fields, and each model input declares one
    /// ([`DataSpec::with_fields`]).
    pub fn fields_from_model(&self) -> bool {
        matches!(self, DataSpec::Tensors { .. } | DataSpec::Csv { .. })
    }

    /// The source reading `fields` (for [`DataSpec::fields_from_model`] sources; the
    /// others are returned as they are).
    pub fn with_fields(mut self, declared: Vec<FieldSpec>) -> DataSpec {
        if let DataSpec::Tensors { fields, .. } | DataSpec::Csv { fields, .. } = &mut self {
            *fields = declared;
        }
        self
    }

    /// Whether the source has a held-out set to evaluate on (a file source a user
    /// names has one only with its `eval_path`).
    pub fn has_held_out(&self) -> bool {
        match self {
            DataSpec::Tokens { eval_path, .. }
            | DataSpec::Tensors { eval_path, .. }
            | DataSpec::Csv { eval_path, .. } => eval_path.is_some(),
            _ => true,
        }
    }

    /// Whether the source reads files from the data directory.
    pub fn needs_files(&self) -> bool {
        !matches!(
            self,
            DataSpec::ZipfTokens { .. } | DataSpec::GaussianClasses { .. }
        )
    }
}

/// The optimizer and its hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum OptimizerSpec {
    /// `v = momentum * v + g; w -= lr * v` (plain SGD when momentum is 0).
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum (0 for none).
        momentum: f64,
    },
    /// Adam with bias correction; with `weight_decay > 0`, AdamW (the decay decoupled
    /// from the gradient, as `torch.optim.AdamW`).
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
        /// Decoupled weight decay (0: Adam).
        #[serde(default, skip_serializing_if = "is_zero")]
        weight_decay: f64,
    },
    /// LARS (You et al. 2017), layer-wise trust ratio with momentum, per variable:
    /// `d = g + wd w; trust = eta |w| / (|g| + wd |w|)` (1 when a norm is 0);
    /// `v = momentum v + lr trust d; w -= v`.
    Lars {
        /// Learning rate (the global one the trust ratio scales).
        lr: f64,
        /// Momentum.
        momentum: f64,
        /// Weight decay.
        weight_decay: f64,
        /// The trust coefficient `eta`.
        trust: f64,
    },
    /// LAMB (You et al. 2019): Adam's bias-corrected moments, then per variable
    /// `r = m^ / (sqrt(v^) + eps) + wd w; w -= lr (|w| / |r|) r` (ratio 1 when a norm
    /// is 0).
    Lamb {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
        /// Weight decay.
        weight_decay: f64,
    },
}

/// How the learning rate moves over a run (the train block's `lr_schedule`): a linear
/// warm-up over the first `warmup` updates, then a decay over the rest of the run.
/// Update `t` (0-based, counted by the optimizer, so a resumed run goes on where it
/// stopped) uses `lr * factor(t, total)`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Updates of linear warm-up: update `t < warmup` uses `(t + 1) / warmup` of the
    /// learning rate (Goyal et al.'s gradual warm-up).
    pub warmup: usize,
    /// What follows the warm-up.
    pub decay: Decay,
}

/// The learning rate's decay after the warm-up, over `p = (t - warmup) / (total -
/// warmup)` of the rest of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Decay {
    /// The learning rate as written.
    #[default]
    Constant,
    /// Multiplied by `gamma` every `every` updates (PyTorch's StepLR).
    Step {
        /// Updates between two drops.
        every: usize,
        /// Each drop's factor, in (0, 1].
        gamma: f64,
    },
    /// Half a cosine from 1 down to `final_factor` (PyTorch's CosineAnnealingLR).
    Cosine {
        /// The factor at the end of the run, in [0, 1].
        final_factor: f64,
    },
    /// `final + (1 - final) * (1 - p)^power` (polynomial decay; power 1 is linear).
    Poly {
        /// The exponent, positive.
        power: f64,
        /// The factor at the end of the run, in [0, 1].
        final_factor: f64,
    },
}

impl LrSchedule {
    /// Whether every update uses the learning rate as written.
    pub fn is_constant(&self) -> bool {
        self.warmup == 0 && self.decay == Decay::Constant
    }

    /// The learning rate's factor at update `t` (0-based) of a run of `total` updates.
    pub fn factor(&self, t: u64, total: u64) -> f64 {
        let warmup = self.warmup as u64;
        if t < warmup {
            return (t + 1) as f64 / warmup as f64;
        }
        let after = t - warmup;
        let p = (after as f64 / total.saturating_sub(warmup).max(1) as f64).min(1.0);
        match self.decay {
            Decay::Constant => 1.0,
            Decay::Step { every, gamma } => {
                gamma.powi(i32::try_from(after / every.max(1) as u64).unwrap_or(i32::MAX))
            }
            Decay::Cosine { final_factor: f } => {
                f + (1.0 - f) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
            Decay::Poly {
                power,
                final_factor: f,
            } => f + (1.0 - f) * (1.0 - p).powf(power),
        }
    }

    /// The ranges of the settings (a plan is checked whoever wrote it).
    pub fn check(&self) -> Result<(), String> {
        let unit = |what: &str, x: f64| {
            if (0.0..=1.0).contains(&x) {
                Ok(())
            } else {
                Err(format!("lr_schedule: {what} must be in [0, 1], found {x}"))
            }
        };
        match self.decay {
            Decay::Constant => Ok(()),
            Decay::Step { every, gamma } => {
                if every == 0 {
                    return Err("lr_schedule: `every` must be at least 1".into());
                }
                if !(gamma > 0.0 && gamma <= 1.0) {
                    return Err(format!(
                        "lr_schedule: `gamma` must be in (0, 1], found {gamma}"
                    ));
                }
                Ok(())
            }
            Decay::Cosine { final_factor } => unit("`final`", final_factor),
            Decay::Poly {
                power,
                final_factor,
            } => {
                if !(power > 0.0 && power.is_finite()) {
                    return Err(format!(
                        "lr_schedule: `power` must be positive, found {power}"
                    ));
                }
                unit("`final`", final_factor)
            }
        }
    }
}

/// The linear scaling rule (the train block's `lr_scaling = linear()`, Goyal et al.):
/// the learning rate written for the train block's batch, multiplied by the global
/// batch of a step over that batch. `compile` applies it once it knows the strategy;
/// the plan's optimizer holds the scaled rate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinearScaling {
    /// The train block's batch, which `lr` was written for.
    pub batch: usize,
    /// The samples of one step: per-worker batch x data-parallel workers x
    /// micro-batches.
    pub global_batch: usize,
    /// The learning rate as written.
    pub base_lr: f64,
}

impl LinearScaling {
    /// The factor the learning rate is multiplied by.
    pub fn factor(&self) -> f64 {
        self.global_batch as f64 / self.batch as f64
    }
}

/// How to run training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// The data source.
    pub data: DataSpec,
    /// Samples per worker per step.
    pub batch: usize,
    /// The optimizer.
    pub optimizer: OptimizerSpec,
    /// The learning rate's warm-up and decay (constant when the train block sets none).
    #[serde(default, skip_serializing_if = "LrSchedule::is_constant")]
    pub lr_schedule: LrSchedule,
    /// The linear scaling rule, when the train block asks for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_scaling: Option<LinearScaling>,
    /// Training steps.
    pub steps: usize,
    /// Seed of initialisation, data order and dropout.
    pub seed: u64,
    /// Evaluate every this many steps (and after the last); 0 evaluates only at the end.
    pub eval_every: usize,
    /// Evaluate on at most this many held-out samples (None: all).
    pub eval_samples: Option<usize>,
    /// What an evaluation reports besides the loss (the train block's `metrics`);
    /// empty: accuracy for a classifier, RMSE for a regression.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub metrics: Vec<Metric>,
    /// Variables the optimizer's weight decay skips (one-device names, sorted): the
    /// train block's `no_decay` list and those below its `decay_min_rank`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_decay: Vec<String>,
    /// A row-sparse gradient (an embedding's) of momentum or Adam updates only the
    /// rows it holds, as TensorFlow's LazyAdam (the optimizer's `lazy = true`); by
    /// default every row, as `torch.optim` updates a dense embedding gradient.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lazy_updates: bool,
    /// Clip the gradient to this global norm before each update (the norm over every
    /// variable's whole gradient, as `torch.nn.utils.clip_grad_norm_`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_norm: Option<f64>,
}

/// A metric an evaluation reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Metric {
    /// The fraction of arg-max predictions equal to the label.
    Accuracy,
    /// The fraction of labels among the `k` largest logits.
    TopK {
        /// How many of the largest logits count.
        k: usize,
    },
    /// `exp` of the mean cross-entropy per prediction: for token models.
    Perplexity,
    /// Root mean squared error of a regression.
    Rmse,
}

impl Metric {
    /// As the train block writes it.
    pub fn name(&self) -> String {
        match self {
            Metric::Accuracy => "accuracy".into(),
            Metric::TopK { k } => format!("top_k({k})"),
            Metric::Perplexity => "perplexity".into(),
            Metric::Rmse => "rmse".into(),
        }
    }

    /// Whether it scores a classifier (a cross-entropy loss), not a regression.
    pub fn classifies(&self) -> bool {
        !matches!(self, Metric::Rmse)
    }
}

/// The largest id an `i32` id field can hold, plus one: a vocabulary or class count
/// beyond it cannot be represented in the id tensors.
pub const MAX_IDS: usize = 1 << 31;

/// Refuses a value outside a range, naming the field: `what` must be `rule`, found `x`.
fn out_of_range(what: &str, rule: &str, x: impl std::fmt::Display) -> String {
    format!("{what} must be {rule}, found {x}")
}

fn count_in(what: &str, x: usize, max: usize) -> Result<(), String> {
    if x == 0 || x > max {
        return Err(out_of_range(what, &format!("in 1..={max}"), x));
    }
    Ok(())
}

impl DataSpec {
    /// Every field's range: counts positive, id counts representable as `i32` ids,
    /// fractions and exponents where they mean something. The DSL checks the same
    /// ranges with spans; a plan's values are checked here whoever wrote them.
    pub fn check(&self) -> Result<(), String> {
        let name = self.name();
        let field = |f: &str| format!("data source `{name}`: `{f}`");
        match *self {
            DataSpec::Mnist => Ok(()),
            DataSpec::Ptb { context } => count_in(&field("context"), context, 1 << 20),
            DataSpec::Movielens { test_fraction } => {
                if !(test_fraction > 0.0 && test_fraction < 1.0) {
                    return Err(out_of_range(
                        &field("test_fraction"),
                        "in (0, 1)",
                        test_fraction,
                    ));
                }
                Ok(())
            }
            DataSpec::ZipfTokens {
                vocab,
                context,
                classes,
                s,
            } => {
                count_in(&field("vocab"), vocab, MAX_IDS - 1)?;
                count_in(&field("context"), context, 1 << 20)?;
                count_in(&field("classes"), classes, MAX_IDS - 1)?;
                if !(s.is_finite() && s > 0.0) {
                    return Err(out_of_range(&field("s"), "a positive finite number", s));
                }
                Ok(())
            }
            DataSpec::GaussianClasses { features, classes } => {
                count_in(&field("features"), features, 1 << 24)?;
                count_in(&field("classes"), classes, MAX_IDS - 1)
            }
            DataSpec::Tokens { width, context, .. } => {
                if width != 2 && width != 4 {
                    return Err(format!(
                        "data source `{name}`: a token is 2 (u16) or 4 (u32) bytes, not {width}"
                    ));
                }
                count_in(&field("context"), context, 1 << 20)
            }
            DataSpec::Tensors { ref fields, .. } | DataSpec::Csv { ref fields, .. } => {
                for (k, f) in fields.iter().enumerate() {
                    count_in(&field(&f.name), f.per_sample, 1 << 30)?;
                    if fields[..k].iter().any(|g| g.name == f.name) {
                        return Err(format!("data source `{name}`: `{}` is read twice", f.name));
                    }
                }
                Ok(())
            }
        }
    }

    /// The exclusive bound of each id field that the source's settings alone fix
    /// (file sources whose vocabulary the files decide report theirs when opened).
    pub fn id_bounds(&self) -> Vec<(&'static str, usize)> {
        match *self {
            DataSpec::Mnist => vec![("label", 10)],
            DataSpec::ZipfTokens { vocab, classes, .. } => {
                vec![("ids", vocab), ("label", classes)]
            }
            DataSpec::GaussianClasses { classes, .. } => vec![("label", classes)],
            _ => Vec::new(),
        }
    }

    /// Bytes the source holds besides its batches: the Zipf sampler's table.
    pub fn table_bytes(&self) -> u128 {
        match *self {
            DataSpec::ZipfTokens { vocab, .. } => 8 * vocab as u128,
            _ => 0,
        }
    }
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl OptimizerSpec {
    /// Whether a row-sparse gradient moves the rows it does not hold (their slots
    /// decay, as in the dense update of the scattered rows): momentum and Adam unless
    /// `lazy` (TensorFlow's LazyAdam), LARS and LAMB always (their trust ratio is over
    /// the whole variable), plain SGD never (the two rules are one update).
    pub fn moves_untouched_rows(&self, lazy: bool) -> bool {
        match *self {
            OptimizerSpec::Sgd { momentum, .. } => momentum > 0.0 && !lazy,
            OptimizerSpec::Adam { .. } => !lazy,
            OptimizerSpec::Lars { .. } | OptimizerSpec::Lamb { .. } => true,
        }
    }

    /// The decoupled or L2 weight decay, 0 for none.
    pub fn weight_decay(&self) -> f64 {
        match *self {
            OptimizerSpec::Sgd { .. } => 0.0,
            OptimizerSpec::Adam { weight_decay, .. }
            | OptimizerSpec::Lars { weight_decay, .. }
            | OptimizerSpec::Lamb { weight_decay, .. } => weight_decay,
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match *self {
            OptimizerSpec::Sgd { lr, .. }
            | OptimizerSpec::Adam { lr, .. }
            | OptimizerSpec::Lars { lr, .. }
            | OptimizerSpec::Lamb { lr, .. } => lr,
        }
    }

    /// The same optimizer with learning rate `lr`.
    pub fn with_lr(&self, lr: f64) -> OptimizerSpec {
        let mut o = self.clone();
        match &mut o {
            OptimizerSpec::Sgd { lr: l, .. }
            | OptimizerSpec::Adam { lr: l, .. }
            | OptimizerSpec::Lars { lr: l, .. }
            | OptimizerSpec::Lamb { lr: l, .. } => *l = lr,
        }
        o
    }

    /// Every hyper-parameter's range (the DSL's ranges).
    pub fn check(&self) -> Result<(), String> {
        let positive = |what: &str, x: f64| {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(out_of_range(what, "a positive finite number", x))
            }
        };
        let decay = |what: &str, x: f64| {
            if (0.0..1.0).contains(&x) {
                Ok(())
            } else {
                Err(out_of_range(what, "in [0, 1)", x))
            }
        };
        match *self {
            OptimizerSpec::Sgd { lr, momentum } => {
                positive("sgd: the learning rate `lr`", lr)?;
                decay("sgd: `momentum`", momentum)
            }
            OptimizerSpec::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let name = self.name();
                positive(&format!("{name}: the learning rate `lr`"), lr)?;
                decay(&format!("{name}: `beta1`"), beta1)?;
                decay(&format!("{name}: `beta2`"), beta2)?;
                decay(&format!("{name}: `weight_decay`"), weight_decay)?;
                positive(&format!("{name}: `eps`"), eps)
            }
            OptimizerSpec::Lars {
                lr,
                momentum,
                weight_decay,
                trust,
            } => {
                positive("lars: the learning rate `lr`", lr)?;
                decay("lars: `momentum`", momentum)?;
                decay("lars: `weight_decay`", weight_decay)?;
                positive("lars: `trust`", trust)
            }
            OptimizerSpec::Lamb {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                positive("lamb: the learning rate `lr`", lr)?;
                decay("lamb: `beta1`", beta1)?;
                decay("lamb: `beta2`", beta2)?;
                decay("lamb: `weight_decay`", weight_decay)?;
                positive("lamb: `eps`", eps)
            }
        }
    }

    /// The optimizer's name in the DSL (and in a checkpoint's index).
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerSpec::Sgd { momentum, .. } if *momentum == 0.0 => "sgd",
            OptimizerSpec::Sgd { .. } => "momentum",
            OptimizerSpec::Adam { weight_decay, .. } if *weight_decay > 0.0 => "adamw",
            OptimizerSpec::Adam { .. } => "adam",
            OptimizerSpec::Lars { .. } => "lars",
            OptimizerSpec::Lamb { .. } => "lamb",
        }
    }

    /// Whether the update of a variable needs the whole variable and its whole
    /// gradient (a layer-wise trust ratio): LARS and LAMB.
    pub fn is_layer_wise(&self) -> bool {
        matches!(
            self,
            OptimizerSpec::Lars { .. } | OptimizerSpec::Lamb { .. }
        )
    }
}

/// The most samples one worker's batch may hold.
pub const MAX_BATCH: usize = 1 << 32;

impl RunConfig {
    /// Every setting's range: the data source's, the optimizer's and the batch's. A
    /// plan is checked here whoever wrote it: its hash proves it is what was written,
    /// not that it is sound.
    pub fn check(&self) -> Result<(), String> {
        self.data.check()?;
        self.optimizer.check()?;
        self.lr_schedule.check()?;
        if let Some(s) = &self.lr_scaling {
            let lr = s.base_lr * s.factor();
            if s.batch == 0 || s.global_batch == 0 || (self.optimizer.lr() - lr).abs() > 1e-9 * lr {
                return Err(format!(
                    "lr_scaling: the learning rate {} is not {} x {} / {}",
                    self.optimizer.lr(),
                    s.base_lr,
                    s.global_batch,
                    s.batch
                ));
            }
        }
        count_in("`batch`", self.batch, MAX_BATCH)
    }

    /// Refuses an evaluation that would find no data after the last step (a run that
    /// evaluates; `verify` does not).
    pub fn check_evaluation(&self) -> Result<(), String> {
        match self.eval_samples {
            Some(e) if e < self.batch => Err(format!(
                "eval_samples = {e} is smaller than one batch ({}): the evaluation after \
                 the last step would have no data; give eval_samples of at least {} or \
                 leave it out",
                self.batch, self.batch
            )),
            _ => Ok(()),
        }
    }
}
