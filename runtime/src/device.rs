//! Training one worker on one device through a [`Backend`].
//!
//! The variables are initialised on the host once, uploaded, and from then on live in
//! the backend's store with the optimizer state: a step uploads its batch, runs the
//! graph, applies the update on the backend and reads back only the loss. The final
//! variables come back to the host once, at the end, to be saved.
//!
//! This is the loop `distc train --device cuda` runs; on the [`Cpu`](crate::backend::Cpu)
//! backend it computes exactly what the in-process trainer computes for one worker
//! (a test holds it to that, bit for bit), which is how the loop itself is checked
//! where no GPU is.

use crate::backend::{all_to_host, backend_error, upload_all, Backend};
use crate::config::RunConfig;
use crate::data::DataSource;
use crate::error::{Result, RuntimeError};
use crate::exec::{Executor, Mode};
use crate::memory::MemoryByCategory;
use crate::metrics::{EvalMetrics, Profile, StepMetrics};
use crate::train::{
    evaluate, init_params, open_data, Coordinator, Programs, TrainOptions, TrainReport,
};
use crate::worker::StepReport;
use distc_ir::Graph;
use std::collections::HashMap;
use std::time::Instant;

/// Trains the one-device plan `graph` on `backend`; `on_step` sees each step's
/// metrics line.
pub fn train_on<B: Backend>(
    backend: B,
    graph: &Graph,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<TrainReport> {
    let device = backend.name();
    if let Some(op) = graph
        .node_ids()
        .into_iter()
        .map(|id| graph.op(id))
        .find(|op| op.is_communication())
    {
        return Err(RuntimeError::Config(format!(
            "this plan communicates (`{}`): on {device} distc runs one-device plans \
             (`--strategy single`); distributed plans run on the CPU",
            op.mnemonic()
        )));
    }
    if opts.checkpoint.is_some() || opts.resume.is_some() {
        return Err(RuntimeError::Config(format!(
            "--checkpoint and --resume are not supported on {device} yet: the optimizer \
             state lives on the device; train on the CPU to write or resume a training state"
        )));
    }
    let programs = Programs::single(graph);
    let mut data = open_data(&programs, config, opts, 0)?;
    let k = data.len();
    let steps = opts.steps.unwrap_or(config.steps);
    let mut exec = Executor::with_backend(graph, backend)?;
    let host = init_params(graph, config.seed);
    let mut params = upload_all(exec.backend(), host)?;
    let mut optimizer = exec
        .backend()
        .optimizer(&config.optimizer, &params)
        .map_err(|e| backend_error(&device, "creating the optimizer", e))?;
    let param_bytes: u64 = params
        .values()
        .map(|t| B::tensor_type(t).bytes() as u64)
        .sum();
    let mut coordinator = Coordinator::new(1, config.batch * k, false, on_step);
    // CUDA graphs: after WARMUP uncaptured steps (which also settle every lazy setup,
    // cuBLAS's included), one step and its update are captured, then that graph is
    // replayed for that step and every later one. Only with one batch per step; a
    // backend without graphs (the CPU's) says so and every step runs uncaptured.
    // Profiling times each node's kernels (the executor waits for them), which a
    // replayed graph cannot: a profiled run runs every step uncaptured.
    let mut graph_state = if k == 1 && !opts.profile {
        GraphState::Untried
    } else {
        GraphState::Off
    };
    let mut captured_memory = None;
    exec.set_profiling(opts.profile);
    // Training runs read back no `output` sink (the prediction and target are for
    // evaluation): on a device that would be a copy and a wait every step.
    exec.set_train_outputs(false);
    let mut profile = Profile {
        steps,
        ..Profile::default()
    };
    // While a replayed step runs on the device, the next step's batch is drawn and
    // staged (uploads are ordered after the replay on the device's stream, so the
    // buffers the graph reads are overwritten only once it is done).
    let mut prefetched: Option<HashMap<String, B::Tensor>> = None;
    for step in 1..=steps {
        let eval_now = step == steps || (config.eval_every > 0 && step % config.eval_every == 0);
        let (uploaded, start) = match prefetched.take() {
            Some(feeds) => (vec![feeds], Instant::now()),
            None => {
                let batches = data
                    .iter_mut()
                    .map(DataSource::next_batch)
                    .collect::<Result<Vec<_>>>()?;
                let start = Instant::now();
                let uploaded = batches
                    .into_iter()
                    .map(|b| upload_all(exec.backend(), b))
                    .collect::<Result<Vec<_>>>()?;
                (uploaded, start)
            }
        };
        let mut loss = 0.0;
        let mut last = None;
        let mut replayed = false;
        for (m, feeds) in uploaded.into_iter().enumerate() {
            exec.set_rank(m);
            let mode = if m + 1 < k { Mode::Micro } else { Mode::Train };
            exec.backend()
                .set_step(step as u64)
                .map_err(|e| backend_error(&device, "setting the step", e))?;
            if graph_state == GraphState::Untried && step > WARMUP {
                let backend = exec.backend();
                let on = backend
                    .begin_capture()
                    .map_err(|e| backend_error(&device, "starting a CUDA graph capture", e))?;
                if on {
                    let captured =
                        capture_step(&mut exec, &feeds, &mut params, &mut optimizer, step as u64);
                    let ended = exec.backend().end_capture();
                    let hint = "; run with --no-cuda-graph to train without a graph";
                    let used = captured.map_err(|e| {
                        RuntimeError::Config(format!(
                            "{device}: step {step} could not be captured into a CUDA graph: {e}{hint}"
                        ))
                    })?;
                    ended.map_err(|e| {
                        let e = backend_error(&device, "ending the CUDA graph capture", e);
                        RuntimeError::Config(format!("{e}{hint}"))
                    })?;
                    captured_memory = Some(used);
                    graph_state = GraphState::Replaying;
                } else {
                    graph_state = GraphState::Off;
                }
            }
            if graph_state == GraphState::Replaying {
                exec.backend()
                    .replay()
                    .map_err(|e| backend_error(&device, "replaying the step's CUDA graph", e))?;
                // Not before an evaluation: its batches would land in the same buffers.
                if k == 1 && step < steps && !eval_now {
                    let next = data[0].next_batch()?;
                    prefetched = Some(upload_all(exec.backend(), next)?);
                }
                let backend = exec.backend();
                backend
                    .synchronize()
                    .map_err(|e| backend_error(&device, "finishing the step", e))?;
                loss += backend
                    .pending_scalar()
                    .map_err(|e| backend_error(&device, "reading the loss", e))?
                    .unwrap_or(f64::NAN);
                replayed = true;
                continue;
            }
            let out = exec.run(&feeds, &params, mode, step as u64)?;
            loss += out.loss.unwrap_or(f64::NAN);
            last = Some(out);
        }
        let loss = loss / k as f64;
        let optimizer_bytes = B::optimizer_bytes(&optimizer);
        let used = if replayed {
            captured_memory.unwrap_or_default()
        } else {
            let Some(out) = last else {
                return Err(RuntimeError::Config("no data source".into()));
            };
            let used = exec.measured_memory();
            let backend = exec.backend();
            let updating = Instant::now();
            backend
                .update(&mut optimizer, &mut params, out.grads)
                .map_err(|e| backend_error(&device, "applying the update", e))?;
            backend
                .synchronize()
                .map_err(|e| backend_error(&device, "finishing the step", e))?;
            profile.optimizer += updating.elapsed();
            used
        };
        let elapsed = start.elapsed();
        profile.step_time += elapsed;
        if !loss.is_finite() {
            return Err(RuntimeError::Config(format!(
                "the loss became {loss} at step {step}: lower the learning rate"
            )));
        }
        let eval: Option<EvalMetrics> = if eval_now {
            exec.set_profiling(false);
            let e = evaluate(&mut exec, &params, &data[0], config, step as u64 + 1, None)?;
            exec.set_profiling(opts.profile);
            Some(e)
        } else {
            None
        };
        coordinator.add(StepReport {
            rank: 0,
            step,
            loss,
            step_sec: elapsed.as_secs_f64(),
            comm_wait_sec: 0.0,
            bytes_sent: 0,
            bytes_received: 0,
            bytes_moved: 0,
            eval,
            memory: MemoryByCategory {
                params: param_bytes,
                gradients: used.gradients,
                optimizer: optimizer_bytes,
                activations: used.activations,
                comm_buffers: used.comm_buffers,
            },
            device_memory: exec.backend().device_memory(),
        })?;
    }
    let host = all_to_host(exec.backend(), params)?;
    let c = coordinator;
    Ok(TrainReport {
        steps: c.steps,
        first_loss: c.first_loss,
        final_loss: c.final_loss,
        eval: c.eval,
        train_time: c.train_time,
        samples_per_sec: (c.steps * k * config.batch) as f64 / c.train_time.as_secs_f64().max(1e-9),
        params: host,
        profile: opts.profile.then(|| Profile {
            ops: exec.profile(),
            ..profile
        }),
        spans: Vec::new(),
    })
}

/// Uncaptured steps before a training step is captured into a CUDA graph.
const WARMUP: usize = 2;

/// Where the loop is with CUDA graphs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GraphState {
    /// Not tried yet (waiting for the warmup steps).
    Untried,
    /// The backend has no graphs, or a step has several batches: never captured.
    Off,
    /// A step is captured: it is replayed from now on.
    Replaying,
}

/// Records one training step and its update while the backend captures; nothing
/// runs. Returns the memory the run would hold (for the metrics of replayed steps).
fn capture_step<B: Backend>(
    exec: &mut Executor<B>,
    feeds: &HashMap<String, B::Tensor>,
    params: &mut HashMap<String, B::Tensor>,
    optimizer: &mut B::Optimizer,
    step: u64,
) -> Result<crate::exec::MemoryUse> {
    let device = exec.backend().name();
    let out = exec.run(feeds, params, Mode::Train, step)?;
    let used = exec.measured_memory();
    exec.backend()
        .update(optimizer, params, out.grads)
        .map_err(|e| backend_error(&device, "applying the update", e))?;
    Ok(used)
}
