//! Evaluation of a model's variables on the held-out data: the one function every
//! role (a worker, a pipeline's evaluator) runs.

use crate::comm::in_process;
use crate::core::backend::{upload_all, Backend};
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::{CommHook, Executor};
use crate::core::schedule::Mode;
use crate::core::value::Tensor;
use crate::run::data::DataSource;
use crate::run::hook::HostHook;
use crate::run::metrics::EvalMetrics;
use crate::run::state::model_part;
use distc_ir::Graph;
use std::collections::HashMap;

/// An evaluation's outcome as a step reports it: its figures, or why the evaluation
/// after the last step failed.
pub(crate) type Evaluated = (Option<EvalMetrics>, Option<String>);

/// An evaluation's result at a step: a failure after the last step is kept, not
/// raised, so that the run writes its trained weights (`--save`, the last checkpoint)
/// before it fails naming it (issue 60, item 4); any other failure stops the run.
pub(crate) fn settle(result: Result<EvalMetrics>, last: bool) -> Result<Evaluated> {
    match result {
        Ok(e) => Ok((Some(e), None)),
        Err(e) if last => Ok((None, Some(e.to_string()))),
        Err(e) => Err(e),
    }
}

/// Refuses, before step 1, held-out data of less than one batch: the evaluation after
/// the last step would find none, once the run is over.
pub(crate) fn check_held_out(data: &DataSource, config: &RunConfig) -> Result<()> {
    if data.eval_samples(config.eval_samples) == 0 {
        return Err(no_held_out(config));
    }
    Ok(())
}

fn no_held_out(config: &RunConfig) -> RuntimeError {
    RuntimeError::Config(format!(
        "no evaluation data: the held-out set of data source `{}` is smaller than one batch \
         ({} samples); give a larger one, or run with --no-eval",
        config.data.name(),
        config.batch
    ))
}

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
        return Err(no_held_out(config));
    }
    let (mut loss, mut n, mut correct, mut sq, mut classified, mut regressed) =
        (0.0, 0usize, 0usize, 0.0, false, false);
    // Predictions scored: a sample may hold several (a token model predicts each
    // position of its window).
    let (mut labels_seen, mut values_seen) = (0usize, 0usize);
    let top_k = config.metrics.iter().find_map(|m| match m {
        crate::core::config::Metric::TopK { k } => Some(*k),
        _ => None,
    });
    let mut in_top_k = 0usize;
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
                        if let (Some(k), Some(&at)) =
                            (top_k, usize::try_from(l).ok().and_then(|l| row.get(l)))
                        {
                            // Ties count for the label: fewer than k logits above it.
                            in_top_k += usize::from(row.iter().filter(|&&v| v > at).count() < k);
                        }
                    }
                    labels_seen += labels.len();
                }
                (p, t) if p.shape() == t.shape() => {
                    regressed = true;
                    values_seen += t.len();
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
    use crate::core::config::Metric;
    let eval_loss = loss / n as f64;
    // Declared metrics decide what is reported; none declared: accuracy or RMSE.
    let wants = |m: Metric| config.metrics.is_empty() || config.metrics.contains(&m);
    Ok(EvalMetrics {
        eval_loss,
        eval_accuracy: (classified && wants(Metric::Accuracy))
            .then(|| correct as f64 / labels_seen.max(1) as f64),
        eval_rmse: (regressed && wants(Metric::Rmse))
            .then(|| (sq / values_seen.max(1) as f64).sqrt()),
        eval_top_k_accuracy: top_k
            .filter(|_| classified)
            .map(|_| in_top_k as f64 / labels_seen.max(1) as f64),
        eval_top_k: top_k.filter(|_| classified),
        eval_perplexity: (classified && config.metrics.contains(&Metric::Perplexity))
            .then(|| eval_loss.exp()),
        eval_samples: n,
        eval_device: Some(exec.backend().name()),
        eval_sec: start.elapsed().as_secs_f64(),
    })
}

/// Evaluation alone (`distc eval`): `params` (whole variables) of the one-device
/// `graph` on the held-out data of `config`, read from `dir`, at most `max_samples`.
pub fn evaluate_weights(
    graph: &distc_ir::Graph,
    config: &RunConfig,
    params: &HashMap<String, Tensor>,
    dir: Option<&std::path::Path>,
) -> Result<EvalMetrics> {
    if !config.data.has_held_out() {
        return Err(RuntimeError::Config(format!(
            "data source `{}` has no held-out set: give it an `eval_path`",
            config.data.name()
        )));
    }
    let data = DataSource::open(
        &config.data,
        dir,
        &crate::run::programs::input_types(graph),
        config.batch,
        config.seed,
        0,
        1,
    )?;
    let mut exec = Executor::new(graph)?;
    let params = upload_all(exec.backend(), params.clone())?;
    evaluate(&mut exec, &params, &data, config, 0, None)
}

/// The model's `prediction` output for every sample of `inputs` (whole arrays whose
/// first axis is the sample axis, by input name), in batches of `batch`: the
/// predictions of all samples, concatenated. An input the file lacks is fed zeros
/// when `prediction` does not depend on it (a label only the loss reads); otherwise
/// it is an error naming it and the file `inputs` came from (`input`).
pub fn predict(
    graph: &distc_ir::Graph,
    params: &HashMap<String, Tensor>,
    (input, inputs): (&std::path::Path, &HashMap<String, Tensor>),
    batch: usize,
) -> Result<Tensor> {
    use distc_ir::Op;
    let Some(output) = graph
        .node_ids()
        .into_iter()
        .find(|&id| matches!(graph.op(id), Op::Output { name } if name == "prediction"))
    else {
        return Err(RuntimeError::plan(format!(
            "model `{}` has no `prediction` output (a loss names its prediction)",
            graph.name
        )));
    };
    let bad = |message: String| RuntimeError::Data {
        path: input.to_path_buf(),
        message,
    };
    let needed = ancestors(graph, output);
    let types = crate::run::programs::input_types(graph);
    let mut samples = None;
    for (name, t) in inputs {
        if let Some(ty) = types.get(name) {
            let per: usize = ty.dims()[1..].iter().product();
            let n = t.shape().first().copied().unwrap_or(0);
            if t.len() != n * per {
                return Err(bad(format!(
                    "`{name}` has shape {:?}: the model's input is {ty}, {per} value(s) per \
                     sample",
                    t.shape()
                )));
            }
            match samples {
                Some(m) if m != n => {
                    return Err(bad(format!(
                        "`{name}` has {n} samples, the other inputs {m}"
                    )))
                }
                _ => samples = Some(n),
            }
        }
    }
    let n = samples.ok_or_else(|| {
        bad(format!(
            "the file holds none of the model's inputs ({})",
            types.keys().cloned().collect::<Vec<_>>().join(", ")
        ))
    })?;
    for (id, name, _) in graph.inputs() {
        if !inputs.contains_key(name) && needed.contains(&id) {
            return Err(bad(format!(
                "the file has no `{name}`, which the model's prediction reads"
            )));
        }
    }
    let mut exec = Executor::new(graph)?;
    let params = upload_all(exec.backend(), params.clone())?;
    // Each input's values once, not once per batch.
    let flat: HashMap<&str, Vec<f64>> = inputs
        .iter()
        .filter(|(name, _)| types.contains_key(name.as_str()))
        .map(|(name, t)| (name.as_str(), t.to_f64_vec()))
        .collect();
    let (mut values, mut row_shape): (Vec<f64>, Vec<usize>) = (Vec::new(), Vec::new());
    let mut start = 0;
    while start < n {
        // The graph's batch is fixed: a last, partial batch is padded, its padding cut.
        let b = batch.min(n - start);
        let mut feeds = HashMap::new();
        for (name, ty) in &types {
            let per: usize = ty.dims()[1..].iter().product();
            let rows = match flat.get(name.as_str()) {
                Some(all) => padded_rows(all, start * per, b * per, ty),
                None => Tensor::zeros(ty),
            };
            feeds.insert(name.clone(), rows);
        }
        let feeds = upload_all(exec.backend(), feeds)?;
        let out = exec.run_with(&feeds, &params, Mode::Eval, 0, None)?;
        let pred = out
            .outputs
            .into_iter()
            .find(|(k, _)| k == "prediction")
            .map(|(_, t)| t)
            // Evaluation runs every `output`, and the graph has this one.
            .ok_or_else(|| RuntimeError::internal("predict", "the run made no `prediction`"))?;
        // Issue 67, item 1: a loss flattens per-position logits [B, T, V] to
        // [B·T, V]; a sample is its T rows, written in the model's own shape.
        row_shape = sample_shape(graph, output, batch, pred.shape())?;
        let per: usize = row_shape.iter().product();
        values.extend_from_slice(&pred.to_f64_vec()[..b * per]);
        start += b;
    }
    let mut shape = vec![n];
    shape.extend(row_shape);
    ndarray::ArrayD::from_shape_vec(
        ndarray::IxDyn(&shape),
        values.into_iter().map(|v| v as f32).collect(),
    )
    .map(Tensor::F32)
    // `n` samples of one row shape, laid out here.
    .map_err(|e| RuntimeError::internal("predict", format!("the predictions: {e}")))
}

/// The shape of one sample's prediction: the model's own, before a loss flattened its
/// leading axes. `shape` is the `prediction` output's, for a batch of `batch`. The
/// value the output reads is followed up through reshapes to the first whose leading
/// axis is the batch; without one, the rows are split evenly among the samples.
fn sample_shape(
    graph: &distc_ir::Graph,
    output: distc_ir::NodeId,
    batch: usize,
    shape: &[usize],
) -> Result<Vec<usize>> {
    let total: usize = shape.iter().product();
    let mut v = graph.node(output).inputs[0];
    loop {
        let dims = graph.tensor_type(v).dims().to_vec();
        if dims.first() == Some(&batch) && dims.iter().product::<usize>() == total {
            return Ok(dims[1..].to_vec());
        }
        match graph.op(v.node) {
            distc_ir::Op::Reshape { .. } => v = graph.node(v.node).inputs[0],
            _ => break,
        }
    }
    match shape.first() {
        Some(&rows) if batch > 0 && rows % batch == 0 => {
            let mut per = vec![rows / batch];
            per.extend_from_slice(&shape[1..]);
            Ok(per)
        }
        _ => Err(RuntimeError::internal(
            "predict",
            format!("a prediction of shape {shape:?} for a batch of {batch}"),
        )),
    }
}

/// The nodes `id` is computed from, itself included.
fn ancestors(
    g: &distc_ir::Graph,
    id: distc_ir::NodeId,
) -> std::collections::HashSet<distc_ir::NodeId> {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![id];
    while let Some(n) = stack.pop() {
        if seen.insert(n) {
            stack.extend(g.node(n).inputs.iter().map(|v| v.node));
        }
    }
    seen
}

/// `len` values of `all` from `from` (row-major), zero-padded to a whole batch of `ty`.
fn padded_rows(all: &[f64], from: usize, len: usize, ty: &distc_ir::TensorType) -> Tensor {
    let mut v = all[from..from + len].to_vec();
    v.resize(ty.shape.numel(), 0.0);
    let dims = ndarray::IxDyn(ty.dims());
    match ty.dtype {
        distc_ir::DType::I32 => Tensor::I32(
            ndarray::ArrayD::from_shape_vec(dims, v.into_iter().map(|x| x as i32).collect())
                .unwrap_or_else(|_| ndarray::ArrayD::zeros(ndarray::IxDyn(ty.dims()))),
        ),
        distc_ir::DType::F64 => Tensor::F64(
            ndarray::ArrayD::from_shape_vec(dims, v)
                .unwrap_or_else(|_| ndarray::ArrayD::zeros(ndarray::IxDyn(ty.dims()))),
        ),
        _ => Tensor::F32(
            ndarray::ArrayD::from_shape_vec(dims, v.into_iter().map(|x| x as f32).collect())
                .unwrap_or_else(|_| ndarray::ArrayD::zeros(ndarray::IxDyn(ty.dims()))),
        ),
    }
}

/// Evaluates the whole model on the held-out data: the one-device graph on the stages'
/// kind of device, or on a model axis of T the sharded graph as T workers (threads of
/// the host) on the variables' parts.
pub(crate) struct Evaluator<'a, B: Backend> {
    pub(crate) exec: Executor<B>,
    pub(crate) whole: &'a Graph,
    pub(crate) shard: Option<&'a Graph>,
    pub(crate) model_axis: usize,
    pub(crate) data: DataSource,
    pub(crate) config: RunConfig,
}

impl<B: Backend> Evaluator<'_, B> {
    /// The evaluation of `params` (whole) as of `step`.
    pub(crate) fn evaluate(
        &mut self,
        params: &HashMap<String, Tensor>,
        step: u64,
    ) -> Result<EvalMetrics> {
        let t = self.model_axis;
        let Some(shard) = self.shard.filter(|_| t > 1) else {
            let on_device = upload_all(self.exec.backend(), params.clone())?;
            return evaluate(
                &mut self.exec,
                &on_device,
                &self.data,
                &self.config,
                step,
                None,
            );
        };
        // Each model rank's variables: the replicated ones and its parts of the split.
        let mut mine = Vec::with_capacity(t);
        for m in 0..t {
            let mut p = params.clone();
            p.extend(model_part(shard, m, params)?);
            mine.push(p);
        }
        let (whole, data, config) = (self.whole, &self.data, &self.config);
        let mut results = Vec::new();
        std::thread::scope(|scope| {
            let handles: Vec<_> = in_process(t)
                .into_iter()
                .zip(&mine)
                .enumerate()
                .map(|(m, (comm, p))| {
                    scope.spawn(move || -> Result<EvalMetrics> {
                        let mut exec = Executor::new(whole)?;
                        exec.set_model_rank(m);
                        let mut hook = HostHook::new(None, Some(Box::new(comm)), None, false);
                        evaluate(&mut exec, p, data, config, step, Some(&mut hook))
                    })
                })
                .collect();
            for h in handles {
                results.push(h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::internal(
                        "evaluation",
                        "an evaluation thread panicked",
                    ))
                }));
            }
        });
        // Every model rank computes the same metrics: rank 0's.
        let results = results.into_iter().collect::<Result<Vec<_>>>()?;
        results
            .into_iter()
            .next()
            .ok_or_else(|| RuntimeError::internal("evaluation", "no model rank evaluated"))
    }
}
