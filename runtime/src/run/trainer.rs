//! What every role's training builds alike, whatever its step's body: the optimizer
//! (with its learning-rate schedule and a resumed state's slots), the state machine
//! of capturing a step into a CUDA graph, a rehearsed failure, fp16's loss scaler,
//! the variables read back to the host, and the slot a run's first error is kept in. A worker and a pipeline stage differ in their
//! `forward_backward` (micro-batches, or a schedule's instructions); these do not.

use crate::core::axis::Axis;
use crate::core::backend::{backend_error, upload_all, Backend, KernelError};
use crate::core::checkpoint::LOSS_SCALE_KEY;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::Executor;
use crate::core::roles::Role;
use crate::core::value::Tensor;
use crate::run::hook::HostHook;
use crate::run::options::TrainOptions;
use crate::run::snapshot::{rehearsed_loss, StateSlot};
use crate::run::state::RoleState;
use distc_ir::{MODEL_SHARD_SUFFIX, ZERO_SHARD_SUFFIX};
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Eager steps before a training step is captured into a CUDA graph: they load
/// modules, pick cuBLAS algorithms and settle every lazy setup first.
pub(crate) const WARMUP: usize = 2;

/// A role's variables on its device, and their optimizer.
pub(crate) struct OnDevice<B: Backend> {
    pub(crate) params: HashMap<String, B::Tensor>,
    pub(crate) optimizer: B::Optimizer,
}

/// A role's start on its device: its variables copied in, and the optimizer of them
/// (the train block's, following its learning-rate schedule, with a resumed state's
/// slots where the run resumes one).
pub(crate) fn onto_device<B: Backend>(
    backend: &mut B,
    config: &RunConfig,
    start: RoleState,
) -> Result<OnDevice<B>> {
    let params = upload_all(backend, start.params)?;
    let optimizer = make_optimizer(backend, config, &params, start.slots.as_ref())?;
    Ok(OnDevice { params, optimizer })
}

fn make_optimizer<B: Backend>(
    backend: &mut B,
    config: &RunConfig,
    params: &HashMap<String, B::Tensor>,
    slots: Option<&HashMap<String, Tensor>>,
) -> Result<B::Optimizer> {
    let device = backend.name();
    let fail = |what: &'static str| |e| backend_error(&device, what, e);
    let mut optimizer = backend
        .optimizer(
            &config.optimizer,
            &config.no_decay,
            config.lazy_updates,
            params,
        )
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

/// fp16's dynamic loss scaling, as PyTorch's GradScaler: the backward pass starts
/// from `scale` (2^16 at first); a step whose gradients overflowed is skipped and halves
/// it, and 2000 finite steps in a row double it.
#[derive(Debug)]
pub(crate) struct LossScaler {
    pub(crate) scale: f64,
    /// Finite steps since the scale last changed.
    good: usize,
    /// Steps skipped so far.
    pub(crate) skipped: usize,
}

/// Finite steps in a row after which the loss scale doubles.
pub const LOSS_SCALE_GROWTH_INTERVAL: usize = 2000;
/// The first loss scale.
pub const INITIAL_LOSS_SCALE: f64 = 65536.0;

impl Default for LossScaler {
    fn default() -> LossScaler {
        LossScaler {
            scale: INITIAL_LOSS_SCALE,
            good: 0,
            skipped: 0,
        }
    }
}

impl LossScaler {
    /// Its state as a training state keeps it ([`LOSS_SCALE_KEY`]).
    pub(crate) fn to_tensor(&self) -> Tensor {
        let v = vec![self.scale, self.good as f64, self.skipped as f64];
        Tensor::F64(
            ArrayD::from_shape_vec(IxDyn(&[3]), v).unwrap_or_else(|_| ArrayD::zeros(IxDyn(&[3]))),
        )
    }

    /// The scaler a training state kept, checked: a positive finite scale, whole
    /// counts.
    pub(crate) fn from_tensor(t: &Tensor) -> Result<LossScaler> {
        let bad = || {
            RuntimeError::state(format!(
                "the training state's `{LOSS_SCALE_KEY}` is not [scale, finite steps, skipped \
                 steps]: the file is damaged or was edited"
            ))
        };
        let Tensor::F64(a) = t else { return Err(bad()) };
        let v: Vec<f64> = a.iter().copied().collect();
        let count = |x: f64| (x >= 0.0 && x.fract() == 0.0 && x < 9e15).then_some(x as usize);
        match v.as_slice() {
            [scale, good, skipped] if scale.is_finite() && *scale > 0.0 => Ok(LossScaler {
                scale: *scale,
                good: count(*good)
                    .filter(|g| *g < LOSS_SCALE_GROWTH_INTERVAL)
                    .ok_or_else(bad)?,
                skipped: count(*skipped).ok_or_else(bad)?,
            }),
            _ => Err(bad()),
        }
    }

    /// The scale after a step whose gradients were (`finite`) or were not all finite.
    pub(crate) fn after(&mut self, finite: bool) {
        if finite {
            self.good += 1;
            if self.good == LOSS_SCALE_GROWTH_INTERVAL {
                self.scale *= 2.0;
                self.good = 0;
            }
        } else {
            self.scale /= 2.0;
            self.good = 0;
            self.skipped += 1;
        }
    }
}

fn hung_up(e: &RuntimeError) -> bool {
    e.peer_kind() == Some(crate::core::error::PeerKind::HungUp)
}

/// The first error of a run, with the role that hit it. Shared by every rank of a
/// process; later errors (consequences: a peer hung up, a server aborted) are dropped.
#[derive(Clone, Default)]
pub struct ErrorSlot(Arc<Mutex<Option<(Role, RuntimeError)>>>);

impl ErrorSlot {
    /// Records `e` of `role` unless an error is already recorded, or replaces a peer's
    /// hang-up recorded before it: a rank that fails closes its links as it fails, so
    /// a peer can see it hang up and record that before the rank records its cause.
    pub fn record(&self, role: Role, e: RuntimeError) {
        let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let replace = match &*slot {
            None => true,
            Some((_, first)) => hung_up(first) && !hung_up(&e),
        };
        if replace {
            *slot = Some((role, e));
        }
    }

    /// The first error, once.
    pub fn take(&self) -> Option<(Role, RuntimeError)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Clips a step's gradients to `max` as torch.nn.utils.clip_grad_norm_ does: scaled
/// by max / (norm + 1e-6) where that is below 1. `norm` is their global norm, from the
/// names and squares of the role's own gradients (summed over the axes that split them).
/// Returns that norm, for the step's report.
pub(crate) fn clip_gradients<B: Backend>(
    backend: &mut B,
    grads: &mut [(String, B::Value)],
    max: f64,
    norm: impl FnOnce(&[&str], &[f64]) -> Result<f64>,
) -> Result<f64> {
    let device = backend.name();
    let squares = backend
        .grad_squares(grads)
        .map_err(|e| backend_error(&device, "measuring the gradient's norm", e))?;
    let names: Vec<&str> = grads.iter().map(|(n, _)| n.as_str()).collect();
    let norm = norm(&names, &squares)?;
    let factor = max / (norm + 1e-6);
    if factor < 1.0 {
        backend
            .unscale(grads, factor, &Default::default())
            .map_err(|e| backend_error(&device, "clipping the gradients", e))?;
    }
    Ok(norm)
}

/// The square of the whole gradient's norm from this rank's parts (`names` and their
/// square sums), summed over the data and model axes (a pipeline stage then sums it
/// over its stages): a whole variable's square sum counted once over the model axis, a
/// model-axis part's as it is, a ZeRO chunk's summed over the replicas (which
/// otherwise hold the same averaged gradients). Data parallelism alone needs no
/// communication: every rank holds the whole averaged gradient. `label(axis)` names a
/// sum over an axis for its errors.
pub(crate) fn squared_norm(
    hook: &mut HostHook,
    names: &[&str],
    squares: &[f64],
    label: &dyn Fn(&str) -> String,
) -> Result<f64> {
    let split = |n: &str| {
        n.strip_suffix(ZERO_SHARD_SUFFIX)
            .unwrap_or(n)
            .ends_with(MODEL_SHARD_SUFFIX)
    };
    let chunked = |n: &str| n.ends_with(ZERO_SHARD_SUFFIX);
    if !names.iter().any(|n| chunked(n) || split(n)) {
        return Ok(squares.iter().sum());
    }
    let parts = hook.model_parts() as f64;
    let (mut whole, mut chunks) = (0.0, 0.0);
    for (n, s) in names.iter().zip(squares) {
        let v = if split(n) { *s } else { s / parts };
        if chunked(n) {
            chunks += v;
        } else {
            whole += v;
        }
    }
    if names.iter().any(|n| chunked(n)) {
        chunks = hook.sum_f64(Axis::Data, vec![chunks], label("the replicas"))?[0];
    }
    Ok(hook.sum_f64(Axis::Model, vec![whole + chunks], label("the model axis"))?[0])
}

/// Sets an executor's ranks from the worker's mesh ranks: its data rank (dropout's
/// rows, ZeRO's chunk; micro-batch `m` of `k` a step) and its model rank (tensor
/// parallelism's shard).
pub(crate) fn set_ranks<B: Backend>(
    exec: &mut Executor<B>,
    (data_rank, model_rank): (usize, usize),
    micro: Option<(usize, usize)>,
) {
    exec.set_rank(micro.map_or(data_rank, |(k, m)| data_rank * k + m));
    exec.set_model_rank(model_rank);
}

#[cfg(test)]
mod loss_scale_tests {
    use super::{LossScaler, INITIAL_LOSS_SCALE, LOSS_SCALE_GROWTH_INTERVAL};
    use crate::core::value::Tensor;
    use ndarray::{ArrayD, IxDyn};

    #[test]
    fn a_kept_scaler_comes_back_as_it_was_and_a_damaged_one_is_refused() {
        let mut s = LossScaler::default();
        s.after(false);
        s.after(true);
        let back = LossScaler::from_tensor(&s.to_tensor()).expect("kept");
        assert_eq!((back.scale, back.good, back.skipped), (s.scale, 1, 1));
        let of =
            |v: Vec<f64>| Tensor::F64(ArrayD::from_shape_vec(IxDyn(&[v.len()]), v).expect("shape"));
        for bad in [
            of(vec![0.0, 0.0, 0.0]),
            of(vec![f64::INFINITY, 0.0, 0.0]),
            of(vec![1024.0, 0.5, 0.0]),
            of(vec![1024.0, LOSS_SCALE_GROWTH_INTERVAL as f64, 0.0]),
            of(vec![1024.0, 0.0, -1.0]),
            of(vec![1024.0, 0.0]),
        ] {
            assert!(LossScaler::from_tensor(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_overflow_halves_the_scale_and_2000_finite_steps_double_it() {
        let mut s = LossScaler::default();
        assert_eq!(s.scale, INITIAL_LOSS_SCALE);
        s.after(false);
        assert_eq!((s.scale, s.skipped), (INITIAL_LOSS_SCALE / 2.0, 1));
        for _ in 0..LOSS_SCALE_GROWTH_INTERVAL - 1 {
            s.after(true);
        }
        assert_eq!(s.scale, INITIAL_LOSS_SCALE / 2.0);
        // An overflow restarts the count.
        s.after(false);
        for _ in 0..LOSS_SCALE_GROWTH_INTERVAL - 1 {
            s.after(true);
        }
        assert_eq!(s.scale, INITIAL_LOSS_SCALE / 4.0);
        s.after(true);
        assert_eq!((s.scale, s.skipped), (INITIAL_LOSS_SCALE / 2.0, 2));
    }
}

#[cfg(test)]
mod error_slot_tests {
    use super::ErrorSlot;
    use crate::core::error::{PeerKind, RuntimeError};
    use crate::core::roles::Role;

    /// Regression (CI, pipeline_cli `a_stage_that_does_not_answer_in_time_is_named`):
    /// stage 0 recorded stage 1's hang-up before stage 1 recorded its timeout, and the
    /// run reported the hang-up.
    #[test]
    fn a_hang_up_recorded_first_gives_way_to_its_cause() {
        let peer = |kind: PeerKind, message: &str| RuntimeError::Peer {
            rank: 0,
            peer: 1,
            op: "recv".into(),
            kind,
            message: message.into(),
        };
        let timeout = || peer(PeerKind::TimedOut, "no message from rank 0 within 1µs");
        let hang_up = || peer(PeerKind::HungUp, "peer rank 1 hung up during recv");
        for (first, second) in [(hang_up(), timeout()), (timeout(), hang_up())] {
            let slot = ErrorSlot::default();
            slot.record(Role::Worker(0), first);
            slot.record(Role::Worker(1), second);
            let (_, e) = slot.take().expect("an error");
            assert_eq!(e.peer_kind(), Some(PeerKind::TimedOut), "{e}");
        }
        // Two causes: the first stays.
        let slot = ErrorSlot::default();
        slot.record(Role::Worker(0), RuntimeError::plan("first"));
        slot.record(Role::Worker(1), RuntimeError::plan("second"));
        assert_eq!(
            slot.take().expect("an error").1.to_string(),
            "the plan: first"
        );
    }
}
