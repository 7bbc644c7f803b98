//! What every role's training builds alike, whatever its step's body: the optimizer
//! (with its learning-rate schedule and a resumed state's slots), the state machine
//! of capturing a step into a CUDA graph, a rehearsed failure, and the variables
//! read back to the host. A worker and a pipeline stage differ in their
//! `forward_backward` (micro-batches, or a schedule's instructions); these do not.

use crate::core::backend::{backend_error, Backend, KernelError};
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::value::Tensor;
use crate::run::options::TrainOptions;
use crate::run::snapshot::{rehearsed_loss, StateSlot};
use std::collections::HashMap;
use std::time::Duration;

/// Eager steps before a training step is captured into a CUDA graph: they load
/// modules, pick cuBLAS algorithms and settle every lazy setup first.
pub(crate) const WARMUP: usize = 2;

/// The optimizer of `params` on `backend`: the train block's, following its
/// learning-rate schedule, with a resumed state's slots (`slots`) where the run
/// resumes one.
pub(crate) fn make_optimizer<B: Backend>(
    backend: &mut B,
    config: &RunConfig,
    params: &HashMap<String, B::Tensor>,
    slots: Option<&HashMap<String, Tensor>>,
) -> Result<B::Optimizer> {
    let device = backend.name();
    let fail = |what: &'static str| |e| backend_error(&device, what, e);
    let mut optimizer = backend
        .optimizer(&config.optimizer, &config.no_decay, params)
        .map_err(fail("creating the optimizer"))?;
    backend
        .follow_schedule(
            &mut optimizer,
            &config.lr_schedule,
            crate::run::steps::lr_horizon(config),
        )
        .map_err(fail("setting the learning-rate schedule"))?;
    if let Some(slots) = slots {
        backend
            .load_optimizer_state(&mut optimizer, slots)
            .map_err(fail("loading the optimizer state"))?;
    }
    Ok(optimizer)
}

/// Where a role's steps are with CUDA graphs: the same for a worker's step of K
/// micro-batches and a stage's step of its schedule. `M` is what the captured step
/// holds (measured while it was recorded), for the metrics of its replays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Capture<M> {
    /// Not tried yet (waiting for the warm-up steps).
    Untried,
    /// Every step runs eagerly: a backend records no graphs, or the step has a host
    /// round trip.
    Off,
    /// A step is captured: it is replayed from now on.
    Replaying(M),
}

impl<M: Copy> Capture<M> {
    /// Where a role starts: untried where its step could be a graph, else off.
    pub(crate) fn starting(capturable: bool) -> Capture<M> {
        if capturable {
            Capture::Untried
        } else {
            Capture::Off
        }
    }

    /// Whether step `step` of a run whose first step is `first` is captured now.
    pub(crate) fn captures_at(&self, step: usize, first: usize) -> bool {
        matches!(self, Capture::Untried) && step >= first + WARMUP
    }

    /// Whether step `step` runs as a graph: captured now, or replayed.
    pub(crate) fn graphed_at(&self, step: usize, first: usize) -> bool {
        self.captures_at(step, first) || self.replayed().is_some()
    }

    /// What the captured step holds, while its graph is replayed.
    pub(crate) fn replayed(&self) -> Option<M> {
        match self {
            Capture::Replaying(m) => Some(*m),
            Capture::Untried | Capture::Off => None,
        }
    }

    /// Whether the role's steps are replays now (for the metrics).
    pub(crate) fn replaying(&self) -> bool {
        self.replayed().is_some()
    }
}

/// What a capture that failed says: the device, the step, its own error, and how to
/// train without a graph.
pub(crate) fn capture_failed(
    device: &str,
    what: String,
    e: impl std::fmt::Display,
) -> RuntimeError {
    RuntimeError::DeviceCall {
        device: device.to_string(),
        what,
        message: format!("{e}; run with --no-cuda-graph to train without a graph"),
    }
}

/// A failure a run rehearses (`--fail-worker W:K`): worker W is lost at the start of
/// step K, as a crashed process would be, after the survivors kept their copies of
/// the step before (an elastic run's).
#[derive(Clone, Debug)]
pub(crate) struct Rehearsal {
    /// The step this role is lost at, if it is the one lost.
    lost_at: Option<usize>,
    /// Where an elastic run keeps its copies.
    slot: Option<StateSlot>,
    /// This role's worker, the run's workers, and how long the loss waits for their
    /// copies.
    worker: usize,
    workers: usize,
    timeout: Duration,
}

impl Rehearsal {
    /// What `opts` rehearses for worker `worker` of `workers`.
    pub(crate) fn of(opts: &TrainOptions, worker: usize, workers: usize) -> Rehearsal {
        Rehearsal {
            lost_at: opts.fail.filter(|f| f.worker == worker).map(|f| f.step),
            slot: opts.snapshot.clone(),
            worker,
            workers,
            timeout: opts.timeout,
        }
    }

    /// The loss, where this role is lost at `step` (of a run whose first step is
    /// `first`).
    pub(crate) fn at(&self, step: usize, first: usize) -> Result<()> {
        if self.lost_at != Some(step) {
            return Ok(());
        }
        Err(rehearsed_loss(
            self.slot.as_ref(),
            (self.worker, self.workers),
            (step, first),
            self.timeout,
        ))
    }
}

/// The variables on the host, as the backend holds them (a copy: training goes on).
pub(crate) fn host_params<B: Backend>(
    backend: &mut B,
    params: &HashMap<String, B::Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let device = backend.name();
    let mut out = HashMap::with_capacity(params.len());
    for (name, t) in params {
        let host = backend.download(t).map_err(|e: KernelError| {
            backend_error(&device, &format!("reading `{name}` back"), e)
        })?;
        out.insert(name.clone(), host);
    }
    Ok(out)
}

/// Writes the running statistics a run of a micro-batch moved (its `assign` sinks:
/// the run's `assigned`) over their variables at once, for a worker's micro-batch and a
/// stage's program alike: the next micro-batch moves them further, as PyTorch's move
/// on every forward, and they move even in a step whose update is skipped (as with
/// PyTorch's gradient scaler).
pub(crate) fn assign_running<B: Backend>(
    backend: &mut B,
    params: &mut HashMap<String, B::Tensor>,
    assigned: Vec<(String, B::Value)>,
) -> Result<()> {
    if assigned.is_empty() {
        return Ok(());
    }
    let device = backend.name();
    backend
        .assign(params, assigned)
        .map_err(|e| backend_error(&device, "writing the running statistics", e))
}
