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
        }
    }

    /// The fields one sample provides: name, dtype name, and elements per sample.
    pub fn fields(&self) -> Vec<(&'static str, distc_ir::DType, usize)> {
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
        }
    }

    /// Whether the source reads files from the data directory.
    pub fn needs_files(&self) -> bool {
        matches!(
            self,
            DataSpec::Mnist | DataSpec::Ptb { .. } | DataSpec::Movielens { .. }
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
    /// Adam with bias correction.
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the denominator.
        eps: f64,
    },
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
    /// Training steps.
    pub steps: usize,
    /// Seed of initialisation, data order and dropout.
    pub seed: u64,
    /// Evaluate every this many steps (and after the last); 0 evaluates only at the end.
    pub eval_every: usize,
    /// Evaluate on at most this many held-out samples (None: all).
    pub eval_samples: Option<usize>,
}
