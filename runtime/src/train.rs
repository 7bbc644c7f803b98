//! The single-device training loop: initialise, then for each step feed a batch, run
//! the forward and backward graph, apply the optimizer; evaluate on held-out data.
//! The caller sees every step as an event (metrics file, progress bar).

use crate::config::RunConfig;
use crate::data::{data_dir, DataSource};
use crate::error::{Result, RuntimeError};
use crate::exec::{Executor, Mode};
use crate::init::init_param;
use crate::metrics::{EvalMetrics, Profile, StepMetrics};
use crate::optim::Optimizer;
use crate::value::Tensor;
use distc_ir::{Graph, Op, TensorType};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Options of a run that are not part of the plan.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// Overrides the plan's step count.
    pub steps: Option<usize>,
    /// Data directory (else `DISTC_DATA`).
    pub data_dir: Option<PathBuf>,
    /// Synthetic sources slice one global stream (see `DataSource::open_global`), so
    /// this run sees what N workers of batch b/N would see together. For verification.
    pub global_data: bool,
    /// Draw every step's batch before the first step (see [`DataSource::preload`]).
    pub preload: bool,
    /// Time every kernel and the optimizer (see [`Profile`]).
    pub profile: bool,
}

/// What training produced.
#[derive(Debug)]
pub struct TrainReport {
    /// Steps run.
    pub steps: usize,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Mean loss of the first step.
    pub first_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalMetrics>,
    /// Wall time of the training steps (evaluation excluded).
    pub train_time: Duration,
    /// Samples per second over all steps.
    pub samples_per_sec: f64,
    /// The trained variables.
    pub params: HashMap<String, Tensor>,
    /// Where the step time went, when asked for.
    pub profile: Option<Profile>,
}

/// Initial values of every variable of `graph`, from the seed.
pub fn init_params(graph: &Graph, seed: u64) -> HashMap<String, Tensor> {
    graph
        .topo_order()
        .into_iter()
        .filter_map(|id| match graph.op(id) {
            Op::Param { name, ty, init } => Some((name.clone(), init_param(name, ty, init, seed))),
            _ => None,
        })
        .collect()
}

/// The model inputs of `graph` by name, for the data source to shape its fields.
pub fn input_types(graph: &Graph) -> HashMap<String, TensorType> {
    graph
        .inputs()
        .into_iter()
        .map(|(_, n, t)| (n.to_string(), t.clone()))
        .collect()
}

/// Evaluates `params` on the held-out data of `config`.
pub fn evaluate(
    exec: &mut Executor,
    params: &HashMap<String, Tensor>,
    data: &DataSource,
    config: &RunConfig,
    step: u64,
) -> Result<EvalMetrics> {
    let batches = data.eval_batches(config.eval_samples)?;
    if batches.is_empty() {
        return Err(RuntimeError::Config(
            "no evaluation data: the held-out set is smaller than one batch".into(),
        ));
    }
    let (mut loss, mut n, mut correct, mut sq, mut classified, mut regressed) =
        (0.0, 0usize, 0usize, 0.0, false, false);
    for batch in &batches {
        let out = exec.run(batch, params, Mode::Eval, step)?;
        let b = batch.values().next().map_or(0, |t| t.shape()[0]);
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
    })
}

/// Trains `graph` (a differentiated single-device graph) as `config` says. `on_step`
/// sees each step's metrics as it happens; returning an error from it stops training.
pub fn train(
    graph: &Graph,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<TrainReport> {
    let steps = opts.steps.unwrap_or(config.steps);
    let dir = data_dir(opts.data_dir.as_deref());
    let open = if opts.global_data {
        DataSource::open_global
    } else {
        DataSource::open
    };
    let mut data = open(
        &config.data,
        dir.as_deref(),
        &input_types(graph),
        config.batch,
        config.seed,
        0,
        1,
    )?;
    if opts.preload {
        data.preload(steps)?;
    }
    let mut exec = Executor::new(graph)?;
    exec.set_profiling(opts.profile);
    let mut optimizer_time = Duration::ZERO;
    let mut params = init_params(graph, config.seed);
    let mut optimizer = Optimizer::new(&config.optimizer);
    let mut train_time = Duration::ZERO;
    let (mut first_loss, mut final_loss, mut last_eval) = (f64::NAN, f64::NAN, None);
    for step in 1..=steps {
        let batch = data.next_batch()?;
        let start = Instant::now();
        let out = exec.run(&batch, &params, Mode::Train, step as u64)?;
        let updating = Instant::now();
        optimizer.step(&mut params, &out.grads)?;
        optimizer_time += updating.elapsed();
        let elapsed = start.elapsed();
        train_time += elapsed;
        let loss = out.loss.unwrap_or(f64::NAN);
        if !loss.is_finite() {
            return Err(RuntimeError::Config(format!(
                "the loss became {loss} at step {step}: lower the learning rate"
            )));
        }
        if step == 1 {
            first_loss = loss;
        }
        final_loss = loss;
        let eval_now = step == steps || (config.eval_every > 0 && step % config.eval_every == 0);
        let eval = if eval_now {
            // Evaluation is not training: keep its kernels out of the profile.
            exec.set_profiling(false);
            let e = evaluate(&mut exec, &params, &data, config, step as u64)?;
            exec.set_profiling(opts.profile);
            last_eval = Some(e.clone());
            Some(e)
        } else {
            None
        };
        on_step(&StepMetrics {
            step,
            loss,
            samples_per_sec: config.batch as f64 / elapsed.as_secs_f64().max(1e-9),
            compute_sec: elapsed.as_secs_f64(),
            comm_wait_sec: 0.0,
            bytes_sent_per_worker: vec![],
            bytes_received_per_worker: vec![],
            bytes_sent: 0,
            bytes_received: 0,
            bytes_moved: 0,
            eval,
        })?;
    }
    Ok(TrainReport {
        steps,
        final_loss,
        first_loss,
        eval: last_eval,
        train_time,
        samples_per_sec: (steps * config.batch) as f64 / train_time.as_secs_f64().max(1e-9),
        params,
        profile: opts.profile.then(|| Profile {
            steps,
            step_time: train_time,
            ops: exec.profile(),
            optimizer: optimizer_time,
            comm_wait: Duration::ZERO,
        }),
    })
}
