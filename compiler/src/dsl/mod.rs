//! The distc DSL: a model written for one device, and how to train it.
//!
//! [`compile_source`] parses a file (the pest grammar in `grammar.pest`), checks it and
//! lowers it to a [`distc_ir::Graph`] and a [`distc_runtime::RunConfig`]. Every mistake
//! is a [`DslError`] pointing into the source; no input makes it panic.
//!
//! # The language
//!
//! ```text
//! # W1: embedding-heavy classifier
//! model sparse_lm {
//!   input ids:   i32[B, 8]
//!   input label: i32[B]
//!
//!   param emb: f32[100000, 128] = uniform(-0.05, 0.05)
//!   param w1:  f32[1024, 512]   = glorot
//!   param b1:  f32[512]         = zeros
//!   param w2:  f32[512, 1000]   = glorot
//!   param b2:  f32[1000]        = zeros
//!
//!   x      = reshape(embedding(emb, ids), [B, 1024])
//!   h      = relu(x @ w1 + b1)
//!   logits = h @ w2 + b2
//!   minimize softmax_cross_entropy(logits, label)
//! }
//!
//! train {
//!   data      = zipf_tokens(vocab = 100000, context = 8, classes = 1000, s = 1.1)
//!   batch     = 256            # per worker
//!   optimizer = sgd(lr = 0.1)
//!   steps     = 200
//!   seed      = 1001
//! }
//! ```
//!
//! ## Lexical structure
//!
//! - Blanks and line breaks separate tokens and are otherwise ignored; statements need
//!   no separator. Comments run from `#` or `//` to the end of the line.
//! - Names: `[A-Za-z_][A-Za-z0-9_]*`. `model`, `train`, `input`, `param`, `minimize`,
//!   `true`, `false` and `B` cannot name values.
//! - Numbers: `12`, `0.5`, `1e-8`, `2.5E+3`; a sign is the unary minus. Where a whole
//!   number is needed (dimensions, axes, steps...) a literal with `.` or an exponent is
//!   refused, and one that does not fit 64 bits is an error.
//!
//! ## Grammar
//!
//! ```text
//! file        = { model | train }                  (exactly one of each, any order)
//! model       = "model" name "{" { statement } "}"
//! statement   = "input" name ":" type
//!             | "param" name ":" type "=" init
//!             | name "=" expr
//!             | "minimize" expr                    (exactly one per model)
//! type        = dtype "[" [ dim { "," dim } [","] ] "]"      dtype: f32 | f64 | i32
//! dim         = number | "B"
//! init        = "zeros" | "ones" | "glorot" | "he"
//!             | "normal" "(" mean "," std ")" | "uniform" "(" lo "," hi ")"
//! train       = "train" "{" { name "=" expr } "}"
//! expr        = product { ("+" | "-") product }    (loosest)
//! product     = matprod { ("*" | "/") matprod }
//! matprod     = unary { "@" unary }                (tightest binary operator)
//! unary       = { "-" } primary
//! primary     = number | name "(" [ arg { "," arg } [","] ] ")" | name
//!             | "[" [ expr { "," expr } [","] ] "]" | "(" expr ")"
//! arg         = [ name "=" ] expr                  (positional arguments first)
//! ```
//!
//! All binary operators are left-associative: `a - b - c` is `(a - b) - c`, and
//! `a + b @ c * d` is `a + ((b @ c) * d)`.
//!
//! ## Meaning
//!
//! - `input x: f32[B, 784]` declares a model input fed by the data source's field of
//!   the same name. Its first dimension must be `B`, the symbolic batch dimension,
//!   bound to the train block's `batch` (or the caller's override); its dtype and its
//!   number of elements per sample (the product of the other dimensions) must match
//!   the field (`DataSpec::fields`).
//! - `param w: f32[784, 10] = glorot` declares a trainable variable; its dimensions are
//!   numbers (at least 1), its dtype a float.
//! - `name = expr` names a value; a name is defined once.
//! - `+ - * /` broadcast as numpy does; `@` is the matrix product of rank-2 tensors. A
//!   number literal next to a tensor is a scalar constant of the tensor's dtype;
//!   numbers with numbers are folded.
//! - Ops, with their keyword arguments and defaults (any argument may also be given by
//!   position, in this order):
//!   `matmul(a, b, transpose_a = false, transpose_b = false)`, `relu(x)`, `sigmoid(x)`,
//!   `tanh(x)`, `exp(x)`, `log(x)`, `neg(x)`, `softmax(x, axis = -1)`,
//!   `log_softmax(x, axis = -1)`, `sum(x, axes = [..], keep_dims = false)` and
//!   `mean(...)` (axes default: all), `reshape(x, [B, 1024])` (dimensions are numbers,
//!   `B`, or one `-1` inferred from the element count), `transpose(x, [1, 0])`
//!   (default: axes reversed), `concat([a, b, ...], axis = 0)` or
//!   `concat(a, b, ..., axis = 0)`, `slice(x, axis, start, end)`,
//!   `embedding(table, ids)`, `softmax_cross_entropy(logits, labels)`,
//!   `mse(prediction, target)`, `dropout(x, rate = 0.5)`,
//!   `layer_norm(x, gamma, beta, eps = 1e-5)`, `conv2d(x, w, stride = 1, padding = 0)`,
//!   `max_pool2d(x, kernel = 2, stride = kernel)`, `rms_norm(x, gamma, eps = 1e-6)`,
//!   `attention(q, k, v, causal = false, scale = 1 / sqrt(D))` (`q [.., Tq, D]`,
//!   `k [.., Tk, D]`, `v [.., Tk, Dv]`, the leading axes batch and heads; causal: query
//!   `i` attends keys `j <= i`),
//!   `batch_norm(x, gamma, beta, momentum = 0.1, eps = 1e-5, sync = true)` (`x [B, C]`
//!   or `[B, C, H, W]`; statistics over every axis but 1; running statistics as the
//!   frozen variables `<gamma>_running_mean` and `<gamma>_running_var`, which
//!   evaluation uses; `sync`: the global batch's statistics under data parallelism).
//!   Negative axes count from the end.
//! - Element-wise functions, whose operands may be tensors (broadcast by numpy rules)
//!   or numbers: `gelu(x, approximate = "none")` (or `"tanh"`), `silu(x)`, `sqrt(x)`,
//!   `rsqrt(x)`, `pow(x, p)`, `less(a, b)`, `less_equal(a, b)`, `greater(a, b)`,
//!   `greater_equal(a, b)`, `equal(a, b)`, `not_equal(a, b)` (1 where true, 0 elsewhere,
//!   no gradient),
//!   `where(cond, a, b)` (`a` where `cond` is not 0; the other side never reaches the
//!   result, so `where(mask, scores, -1e9)` is exact), `maximum(a, b)`, `minimum(a, b)`.
//!   The seed of the n-th `dropout` (from 0, in source order) is `seed * 1000 + n`.
//! - `B` may appear only as the first dimension of an input and in reshape shapes.
//! - `minimize e` makes `e` (a float scalar) the training loss. When `e` is
//!   `softmax_cross_entropy(logits, labels)` or `mse(prediction, target)` (directly
//!   or through a name) the graph also gets outputs `prediction` (the logits or the
//!   prediction) and `target` (the labels or the target) for evaluation.
//!
//! ## The train block
//!
//! | key | value | |
//! | --- | --- | --- |
//! | `data` | `mnist()`, `ptb(context = 8)`, `movielens(test_fraction = 0.1)`, `zipf_tokens(vocab, context, classes, s)`, `gaussian_classes(features, classes)` | required |
//! | `batch` | samples per worker per step, at least 1 | required |
//! | `optimizer` | `sgd(lr, momentum = 0)` or `adam(lr, beta1 = 0.9, beta2 = 0.999, eps = 1e-8)` | required |
//! | `steps` | at least 1 | required |
//! | `seed` | a whole number | default 0 |
//! | `eval_every` | evaluate every this many steps; 0: only at the end | default 0 |
//! | `eval_samples` | evaluate on at most this many samples (at least one batch: `compile` refuses fewer) | default: all |

mod args;
mod ast;
pub mod batch;
mod error;
mod lower;
pub mod overrides;
mod parser;
mod pointwise;
mod train;

pub use error::DslError;

use ast::Span;
use error::Diag;

/// A lowered program: the one-device graph and how to train it.
#[derive(Clone, Debug)]
pub struct Program {
    /// The model as a graph; `B` is bound to [`Program::batch_symbol_value`].
    pub graph: distc_ir::Graph,
    /// The train block.
    pub config: distc_runtime::RunConfig,
    /// The value `B` was bound to: the override if given, else the train block's batch.
    pub batch_symbol_value: usize,
    /// Where the model breaks what data parallelism assumes (see [`batch::assumptions`]).
    pub assumptions: Vec<String>,
    /// With `pipeline_stage` markers: each variable's pipeline stage (the stage of the
    /// statement first using it).
    pub stage_marks: Option<std::collections::BTreeMap<String, usize>>,
    /// The variables marked `shard(DIM)`.
    pub shards: std::collections::BTreeMap<String, usize>,
}

/// Parses and lowers a DSL file. `file_name` is shown in diagnostics.
/// `batch_override`: if Some, binds B to that instead of the train block's `batch`.
/// (`config.batch` stays the train block's value.)
pub fn compile_source(
    file_name: &str,
    src: &str,
    batch_override: Option<usize>,
) -> Result<Program, DslError> {
    compile(src, batch_override).map_err(|d| DslError::new(file_name, src, d))
}

fn compile(src: &str, batch_override: Option<usize>) -> Result<Program, Diag> {
    let file = parser::parse(src)?;
    let end = src.trim_end().len();
    let model = match file.models.as_slice() {
        [] => {
            let at = file
                .trains
                .first()
                .map_or(Span::new(end, end), |t| t.keyword);
            return Err(
                Diag::new(at, "the file has no `model` block", "expected a model")
                    .help("declare the model: `model name { ... }` with its inputs, params and a `minimize`"),
            );
        }
        [m] => m,
        [_, second, ..] => {
            return Err(Diag::new(
                second.header,
                "a file holds one model, this is the second",
                "second model",
            ))
        }
    };
    let train = match file.trains.as_slice() {
        [] => return Err(Diag::new(
            model.header,
            format!("model `{}` has no `train` block", model.name.name),
            "no train block for this model",
        )
        .help(
            "add `train { data = mnist()  batch = 64  optimizer = sgd(lr = 0.1)  steps = 1000 }`",
        )),
        [t] => t,
        [_, second, ..] => {
            return Err(Diag::new(
                second.keyword,
                "a file holds one `train` block, this is the second",
                "second train block",
            ))
        }
    };
    let mut t = train::lower_train(train, src)?;
    let batch = match batch_override {
        Some(0) => {
            return Err(Diag::new(
                t.batch_span,
                "the batch override is 0; a batch holds at least 1 sample",
                "overridden by the caller",
            ))
        }
        Some(b) => b,
        None => t.config.batch,
    };
    let lowered = lower::lower_model(model, batch, t.config.seed, &t.config.data, src)?;
    let (mut graph, stage_marks, shards) = (lowered.graph, lowered.stage_marks, lowered.shards);
    // A metric scores what the loss compares: a classifier's or a regression's.
    if let Some(span) = t.metrics_span {
        let has =
            |f: fn(&distc_ir::Op) -> bool| graph.node_ids().into_iter().any(|id| f(graph.op(id)));
        let classifies = has(|op| matches!(op, distc_ir::Op::SoftmaxCrossEntropy));
        let regresses = has(|op| matches!(op, distc_ir::Op::Mse));
        for m in &t.config.metrics {
            let (ok, needs) = if m.classifies() {
                (classifies, "a classifier's (`softmax_cross_entropy`) loss")
            } else {
                (regresses, "a regression's (`mse`) loss")
            };
            if !ok {
                return Err(Diag::new(
                    span,
                    format!(
                        "the metric `{}` scores {needs}, which this model does not minimize",
                        m.name()
                    ),
                    "does not fit the loss",
                ));
            }
        }
    }
    // Weight-decay exemptions, by name and by rank, resolved to the model's variables.
    if !t.no_decay.is_empty() || t.decay_min_rank.is_some() {
        let params = graph.params();
        let mut exempt = std::collections::BTreeSet::new();
        for (name, span) in &t.no_decay {
            if !params.iter().any(|(_, n, _)| *n == name.as_str()) {
                let names: Vec<&str> = params.iter().map(|(_, n, _)| *n).collect();
                return Err(Diag::new(
                    *span,
                    format!("`no_decay` names `{name}`, which is not a variable of the model"),
                    "not a variable",
                )
                .maybe_help(error::did_you_mean(name, names.iter().copied())));
            }
            exempt.insert(name.clone());
        }
        if let Some((rank, _)) = t.decay_min_rank {
            for (_, n, ty) in &params {
                if ty.shape.rank() < rank {
                    exempt.insert(n.to_string());
                }
            }
        }
        t.config.no_decay = exempt.into_iter().collect();
    }
    // A source whose file names the fields reads what the model's inputs declare.
    if t.config.data.fields_from_model() {
        let mut inputs: Vec<_> = distc_runtime::run::programs::input_types(&graph)
            .into_iter()
            .map(|(name, ty)| distc_runtime::FieldSpec {
                name,
                dtype: ty.dtype,
                per_sample: ty.dims()[1..].iter().product(),
            })
            .collect();
        inputs.sort_by(|a, b| a.name.cmp(&b.name));
        t.config.data = t.config.data.clone().with_fields(inputs);
    }
    // The axes that depend on B are those whose length changes with it.
    let mut assumptions = Vec::new();
    let other = batch
        .checked_add(1)
        .and_then(|b1| lower::lower_model(model, b1, t.config.seed, &t.config.data, src).ok());
    if let Some(other) = other {
        if let Some(axes) = batch::batch_axes(&graph, &other.graph) {
            batch::mark_per_sample_dropout(&mut graph, &axes);
            assumptions = batch::assumptions(&graph, &axes);
        }
    }
    Ok(Program {
        graph,
        config: t.config,
        batch_symbol_value: batch,
        assumptions,
        stage_marks,
        shards,
    })
}
