//! Evaluation of a model's variables on the held-out data: the one function every
//! role (a worker, a pipeline's evaluator) runs.

use crate::core::backend::{upload_all, Backend};
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::{CommHook, Executor};
use crate::core::schedule::Mode;
use crate::core::value::Tensor;
use crate::run::data::DataSource;
use crate::run::metrics::EvalMetrics;
use std::collections::HashMap;

/// Evaluates `params` on the held-out data of `config`; a worker program's pulls go
/// through `comm` (as of `step`).
pub fn evaluate<'h, B: Backend>(
    exec: &mut Executor<B>,
    params: &HashMap<String, B::Tensor>,
    data: &DataSource,
    config: &RunConfig,
    step: u64,
    mut comm: Option<&mut (dyn CommHook + 'h)>,
) -> Result<EvalMetrics> {
    let start = std::time::Instant::now();
    let batches = data.eval_batches(config.eval_samples)?;
    if batches.is_empty() {
        return Err(RuntimeError::Config(
            "no evaluation data: the held-out set is smaller than one batch".into(),
        ));
    }
    let (mut loss, mut n, mut correct, mut sq, mut classified, mut regressed) =
        (0.0, 0usize, 0usize, 0.0, false, false);
    for batch in batches {
        let b = batch.values().next().map_or(0, |t| t.shape()[0]);
        let feeds = upload_all(exec.backend(), batch)?;
        let out = exec.run_with(&feeds, params, Mode::Eval, step, comm.as_deref_mut())?;
        loss += out.loss.unwrap_or(f64::NAN) * b as f64;
        n += b;
        let find = |name: &str| out.outputs.iter().find(|(k, _)| k == name).map(|(_, t)| t);
        if let (Some(pred), Some(target)) = (find("prediction"), find("target")) {
            match (pred, target) {
                (p, Tensor::I32(labels)) if p.shape().len() == 2 => {
                    classified = true;
                    let k = p.shape()[1];
                    let p = p.to_f64_vec();
                    for (i, &l) in labels.iter().enumerate() {
                        let row = &p[i * k..(i + 1) * k];
                        let arg =
                            row.iter()
                                .enumerate()
                                .fold(0, |best, (j, &v)| if v > row[best] { j } else { best });
                        correct += usize::from(arg as i32 == l);
                    }
                }
                (p, t) if p.shape() == t.shape() => {
                    regressed = true;
                    sq += p
                        .to_f64_vec()
                        .iter()
                        .zip(t.to_f64_vec())
                        .map(|(a, b)| (a - b) * (a - b))
                        .sum::<f64>();
                }
                _ => {}
            }
        }
    }
    Ok(EvalMetrics {
        eval_loss: loss / n as f64,
        eval_accuracy: classified.then(|| correct as f64 / n as f64),
        eval_rmse: regressed.then(|| (sq / n as f64).sqrt()),
        eval_samples: n,
        eval_sec: start.elapsed().as_secs_f64(),
    })
}
