//! `distc eval` and `distc predict`: a model's trained weights (`--init`, `--resume`)
//! on its held-out data, or on a file of inputs, without training.

use crate::cli::WeightsArgs;
use crate::console::{err, out};
use crate::{CompileOptions, Compiled};
use anyhow::{bail, Context, Result};
use distc_runtime::core::checkpoint;
use distc_runtime::Tensor;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where the weights come from, as the flags say.
pub struct Weights<'a> {
    /// `--init FILE`: weights by name.
    pub init: Option<&'a Path>,
    /// `--init-partial`.
    pub partial: bool,
    /// `--resume FILE`: a training state's variables.
    pub resume: Option<&'a Path>,
}

// Here, not in `cli`, so the flags name no command: `commands` imports `cli`, not the
// other way round.
impl WeightsArgs {
    /// The flags as [`Weights`].
    pub fn weights(&self) -> Weights<'_> {
        Weights {
            init: self.init.as_deref(),
            partial: self.init_partial,
            resume: self.resume.as_deref(),
        }
    }
}

impl Weights<'_> {
    /// What a command that evaluates these weights of `file` reads: the model and
    /// the weights' file, which its outputs may not replace.
    fn read<'p>(&'p self, file: &'p Path) -> Vec<&'p Path> {
        std::iter::once(file)
            .chain(self.init)
            .chain(self.resume)
            .collect()
    }
}

/// The one-device program of `file`, with its batch overridden by `batch`.
fn one_device(file: &Path, batch: Option<usize>, data: Option<&Path>) -> Result<Compiled> {
    let opts = CompileOptions {
        batch,
        data_dir: data.map(Path::to_path_buf),
        ..Default::default()
    };
    crate::commands::compile_or_report(file, &opts)
}

/// The whole variables the run evaluates with, checked against the model.
fn params(c: &Compiled, w: &Weights<'_>) -> Result<HashMap<String, Tensor>> {
    let ((weights, foreign), partial, what) = match (w.init, w.resume) {
        (Some(p), None) => (
            checkpoint::load_weights(p)?,
            w.partial,
            format!("--init {}", p.display()),
        ),
        (None, Some(p)) => (
            (checkpoint::load_state(p)?.params, Vec::new()),
            false,
            format!("--resume {}", p.display()),
        ),
        _ => bail!("give the weights to evaluate: --init FILE.safetensors or --resume STATE"),
    };
    let (state, report) = distc_runtime::run::state::state_from_weights(
        &c.programs(1),
        &c.config,
        (&weights, &foreign),
        partial,
    )
    .with_context(|| what.clone())?;
    if partial && !report.missing.is_empty() {
        err(&format!(
            "{what}: keeping their initializer: {}\n",
            report.missing.join(", ")
        ));
    }
    Ok(state.params)
}

/// `distc eval`: the metrics of the weights on the held-out data, printed and, with
/// `metrics`, written as one JSON line.
pub fn eval(
    file: &Path,
    weights: &Weights<'_>,
    data: Option<&Path>,
    batch: Option<usize>,
    eval_samples: Option<usize>,
    metrics: Option<&PathBuf>,
    quiet: bool,
) -> Result<()> {
    let mut c = one_device(file, batch, data)?;
    if let Some(m) = metrics {
        // The held-out data is read too.
        let read = distc_runtime::run::data::files_read(&weights.read(file), &c.config.data, data);
        let read: Vec<&Path> = read.iter().map(PathBuf::as_path).collect();
        distc_runtime::core::output::check_output(m, &read)?;
    }
    if eval_samples.is_some() {
        c.config.eval_samples = eval_samples;
    }
    c.config.check_evaluation().map_err(anyhow::Error::msg)?;
    let params = params(&c, weights)?;
    let dir = distc_runtime::run::data::data_dir(data);
    let m = distc_runtime::run::eval::evaluate_weights(
        &c.programs.worker,
        &c.config,
        &params,
        dir.as_deref(),
    )?;
    if !quiet {
        out(&format!("{}: {}\n", c.programs.worker.name, m.describe()));
    }
    if let Some(path) = metrics {
        let json = serde_json::to_string(&m)?;
        distc_runtime::core::output::write_file(path, format!("{json}\n").as_bytes())?;
    }
    // Issue 60, item 7: a loss that is not finite is a failure (it exited 0).
    if !m.eval_loss.is_finite() {
        bail!(
            "eval_loss {}: these weights do not compute a finite loss on the held-out data \
             (weights that diverged, or a running variance below 0)",
            m.eval_loss
        );
    }
    Ok(())
}

/// `distc predict`: the model's `prediction` for every sample of `input` (a
/// safetensors file of the model's inputs by name), written to `output` as the tensor
/// `prediction`.
pub fn predict(
    file: &Path,
    weights: &Weights<'_>,
    input: &Path,
    output: &Path,
    batch: Option<usize>,
) -> Result<()> {
    let mut read = weights.read(file);
    read.push(input);
    distc_runtime::core::output::check_output(output, &read)?;
    // Read as the `tensors` source reads training data (issue 60, item 8: the U8
    // images scripts/mnist-safetensors.py writes were refused), for each model input.
    let own = one_device(file, None, None)?;
    let fields: Vec<distc_runtime::FieldSpec> =
        distc_runtime::run::programs::input_types(&own.programs.worker)
            .into_iter()
            .map(|(name, ty)| distc_runtime::FieldSpec {
                name,
                dtype: ty.dtype,
                per_sample: ty.dims()[1..].iter().product(),
            })
            .collect();
    let inputs = distc_runtime::run::data::read_model_inputs(input, &fields)?;
    // A batch above the samples would only be padding (issue 60, item 8: `--batch
    // 4294967296` on 16 samples allocated 137 GB).
    let samples = inputs
        .values()
        .filter_map(|t| t.shape().first().copied())
        .max()
        .unwrap_or(0);
    // The model's own batch, compiled above, unless --batch asks for another.
    let c = match batch.map(|b| b.min(samples.max(1))) {
        Some(b) if b != own.config.batch => one_device(file, Some(b), None)?,
        _ => own,
    };
    let params = params(&c, weights)?;
    let pred = distc_runtime::run::eval::predict(
        &c.programs.worker,
        &params,
        (input, &inputs),
        c.config.batch,
    )?;
    let samples = pred.shape().first().copied().unwrap_or(0);
    checkpoint::save(output, &[("prediction".to_string(), &pred)], HashMap::new())?;
    err(&format!(
        "wrote {}: `prediction` {:?} for {samples} samples\n",
        output.display(),
        pred.shape()
    ));
    Ok(())
}
