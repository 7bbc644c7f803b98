//! The training loop of one worker: the same code for one device (one worker, no
//! servers), for worker threads of one process and for MPI processes.
//!
//! A worker runs the SPMD worker program with its rank. Its collectives go to a
//! communication thread of its own (which owns the worker's [`Communicator`]), so a
//! bucket's all-reduce runs while the backward pass goes on; the executor waits for it
//! only where the result is read. Parameter-server ops go through the worker's
//! [`PsClient`], whatever transport it runs over. After each step the worker checks
//! its loss (NaN or infinite stops the run, naming the step and the worker), worker 0
//! evaluates when the plan says so, and the step's [`StepReport`] goes to whoever
//! joins the reports into metrics lines.
//!
//! A worker that fails records its error in the run's [`ErrorSlot`] first, then tells
//! the servers ([`PsClient::abort`]) and drops its communicator: waiting servers and
//! peers fail in turn, and the first error recorded, the cause, is what the user sees.

use crate::comm::collective::op_label;
use crate::comm::{AxisComms, ByteCount, Links};
use crate::core::axis::Axis;
use crate::core::backend::{all_to_host, backend_error, upload_all, upload_micro_batches, Backend};
use crate::core::checkpoint::LOSS_SCALE_KEY;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::{CommHook, Executor};
use crate::core::roles::Role;
use crate::core::schedule::{MemoryUse, Mode};
use crate::core::value::{Tensor, Value};
use crate::ps::{PsClient, PsSync};
use crate::run::checkpoint::save_training_state;
use crate::run::data::DataSource;
use crate::run::eval::{evaluate, settle};
use crate::run::hook::HostHook;
use crate::run::memory::MemoryByCategory;
use crate::run::mesh::Mesh;
use crate::run::metrics::{EvalMetrics, Profile, StepReport};
use crate::run::options::TrainOptions;
use crate::run::programs::Programs;
use crate::run::state::{first_step, initial_values, role_state};
use crate::run::steps::{run_steps, worker_spans, Cadence, Due, Ran, StepBody, StepTrace, Timed};
use crate::run::trace::Span;
use crate::run::trainer::{
    assign_running, capture_failed, clip_gradients, onto_device, set_ranks, squared_norm, Capture,
    ErrorSlot, LossScaler, OnDevice, Rehearsal, WARMUP,
};
use distc_ir::{NodeId, Op, ReduceOp, ZERO_SHARD_SUFFIX};
use ndarray::{ArrayD, IxDyn};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// Everything a worker needs: its rank, its data, its links to the others.
pub struct WorkerSetup<'a> {
    /// The plan's programs.
    pub programs: Programs<'a>,
    /// The run configuration.
    pub config: &'a RunConfig,
    /// The run options.
    pub opts: &'a TrainOptions,
    /// This worker's rank in `0..mesh.workers()`.
    pub rank: usize,
    /// The plan's mesh: this worker's place, and who shares its samples.
    pub mesh: Mesh,
    /// Its communicators, by axis: the data axis's (its replicas), and the model
    /// axis's where the mesh has one.
    pub comms: AxisComms,
    /// The parameter servers, when the plan has any.
    pub ps: Option<PsClient>,
    /// This worker's data, opened: one source per micro-batch of a step.
    pub data: Vec<DataSource>,
    /// When the run started (trace times are relative to it).
    pub t0: Instant,
    /// Where a failure is recorded before anything else happens.
    pub errors: ErrorSlot,
}

/// What a worker hands back when it ends.
#[derive(Debug, Default)]
pub struct WorkerOutcome {
    /// Its variables (the replicated ones; server-held ones are in `server_shards`).
    pub params: HashMap<String, Tensor>,
    /// The servers' shards `(var, start, rows)`, collected by worker 0 at shutdown.
    pub server_shards: Vec<(String, usize, Tensor)>,
    /// Its trace spans, when tracing.
    pub spans: Vec<Span>,
    /// Where its step time went, when profiling (worker 0).
    pub profile: Option<Profile>,
}

/// Whether every worker's gradients were finite: a flag summed over the data axis and
/// the model axis.
fn all_finite(hook: &mut HostHook, finite: bool, step: usize) -> Result<bool> {
    let flag = || {
        Value::Tensor(Tensor::F32(ArrayD::from_elem(
            IxDyn(&[1]),
            if finite { 0.0 } else { 1.0 },
        )))
    };
    let sum = Op::AllReduce {
        reduce: ReduceOp::Sum,
        ranks_per_node: 0,
    };
    let over_data = hook
        .start_collective(NodeId(u32::MAX), &sum, flag(), step as u64)?
        .wait()?;
    let mut bad = over_data
        .tensor()
        .and_then(Tensor::scalar_f64)
        .unwrap_or(1.0);
    if hook.has_model_axis() {
        let op = Op::ModelAllReduce {
            parts: hook.model_parts(),
        };
        let label = op_label(&op, NodeId(u32::MAX), step as u64);
        let over_model = hook.over_model(&op, flag(), &label)?;
        bad += over_model
            .tensor()
            .and_then(Tensor::scalar_f64)
            .unwrap_or(1.0);
    }
    Ok(bad == 0.0)
}

/// Worker `rank`'s place on the plan's mesh: `(data rank, model rank)`.
fn mesh_ranks(mesh: &Mesh, rank: usize) -> (usize, usize) {
    let c = mesh.coord(rank);
    (c.replica, c.model)
}

/// The state a worker's steps share: the executor on the worker's backend, which
/// holds the variables and the optimizer state.
struct Loop<B: Backend> {
    exec: Executor<B>,
    params: HashMap<String, B::Tensor>,
    optimizer: B::Optimizer,
    profile: Profile,
    /// Its hook's bytes at the last reading.
    last: ByteCount,
    ps_last: (u64, u64),
    /// The backend's own communicator's bytes at the last reading.
    device_last: ByteCount,
}

/// Runs worker `setup.rank`'s training to the end, each step's report to `report`, on
/// the backend `make` creates (on
/// the worker's own thread, where a device backend binds its device). `make` gets the
/// workers' communicator before anything else uses it, for a device communicator's
/// bootstrap (NCCL's unique id from rank 0); what it moves is not counted in step 1.
pub fn run_worker_on<B: Backend>(
    setup: WorkerSetup<'_>,
    report: &mut dyn FnMut(StepReport) -> Result<()>,
    make: impl FnOnce(Links<'_>) -> Result<B>,
) -> Result<WorkerOutcome> {
    let WorkerSetup {
        programs,
        config,
        opts,
        rank,
        mesh,
        mut comms,
        ps,
        mut data,
        t0,
        errors,
    } = setup;
    let data_comm = comms.require(Axis::Data, "a worker")?;
    let mut hook = HostHook::new(Some(data_comm), comms.take(Axis::Model), ps, opts.trace);
    let made = make(hook.links());
    hook.start(&format!("worker-{rank}"))?;
    let bytes_start = hook.bytes();
    let mut state = None;
    let mut step_trace = StepTrace::default();
    let mut result = made.and_then(|backend| {
        train_worker(
            backend,
            &programs,
            config,
            opts,
            (rank, &mesh),
            &mut data,
            report,
            &mut hook,
            bytes_start,
            &mut state,
            &mut step_trace,
        )
    });
    // The variables back on the host, then whole from the shards, on every worker
    // (the final program is a collective).
    let mut host_params = HashMap::new();
    if let (Ok(()), Some(st)) = (&result, state.as_mut()) {
        let params = std::mem::take(&mut st.params);
        result = all_to_host(st.exec.backend(), params).map(|p| host_params = p);
    }
    if let (Ok(()), Some(fin)) = (&result, programs.finalize) {
        result = finalize(fin, &mesh, &mut host_params, rank, &mut hook);
    }
    let mut server_shards = Vec::new();
    if result.is_ok() {
        if let Some(ps) = hook.ps.as_mut() {
            match ps.shutdown(rank == 0) {
                Ok(s) => server_shards = s,
                Err(e) => result = Err(e),
            }
        }
    }
    if let Err(e) = result {
        // The cause first, then the consequences: servers answer the other workers'
        // waiting pulls with it, and peers see this worker's communicator close.
        let message = e.to_string();
        let copy = e.duplicate();
        errors.record(Role::Worker(rank), e);
        if let Some(ps) = hook.ps.as_mut() {
            ps.abort(&message);
        }
        drop(hook);
        return Err(copy.of_rank(format!("worker {rank}")));
    }
    let traced = hook.finish();
    let Some(st) = state else {
        return Ok(WorkerOutcome::default());
    };
    let mut spans = Vec::new();
    if opts.trace {
        spans = step_trace.spans(&format!("worker {rank}"), t0);
        spans.extend(worker_spans(
            programs.worker,
            rank,
            t0,
            &step_trace.steps,
            traced,
        ));
    }
    let profile = (opts.profile && rank == 0).then(|| Profile {
        ops: st.exec.profile(),
        ..st.profile
    });
    Ok(WorkerOutcome {
        params: host_params,
        server_shards,
        spans,
        profile,
    })
}

/// Runs the final program (on the host): its outputs (whole variables) replace the
/// shards it reads.
fn finalize(
    fin: &distc_ir::Graph,
    mesh: &Mesh,
    params: &mut HashMap<String, Tensor>,
    rank: usize,
    hook: &mut HostHook,
) -> Result<()> {
    let mut exec = Executor::new(fin)?;
    set_ranks(&mut exec, mesh_ranks(mesh, rank), None);
    let out = exec.run_with(&HashMap::new(), params, Mode::Train, 0, Some(hook))?;
    for (_, name, _) in fin.params() {
        params.remove(name);
    }
    params.extend(out.outputs);
    Ok(())
}

/// Initialises the worker and runs every step in the one step loop with its body;
/// `state` holds what the steps built, for the outcome (also when a step fails).
#[allow(clippy::too_many_arguments)]
fn train_worker<B: Backend>(
    backend: B,
    programs: &Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    (rank, mesh): (usize, &Mesh),
    data: &mut [DataSource],
    report: &mut dyn FnMut(StepReport) -> Result<()>,
    hook: &mut HostHook,
    bytes_start: ByteCount,
    state: &mut Option<Loop<B>>,
    trace: &mut StepTrace,
) -> Result<()> {
    let workers = mesh.workers();
    let steps = opts.last_step(config);
    if opts.evaluate {
        if let Some(d) = data.first() {
            crate::run::eval::check_held_out(d, config)?;
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let resume = opts.resume.as_deref();
    // Found once: the step loop sets them for every micro-batch.
    let ranks = mesh_ranks(mesh, rank);
    // The init program reads the one-device initial values, whole (or the resumed
    // ones) and makes this worker's part of them; it may broadcast, so it runs with
    // the hook.
    let whole = programs
        .init
        .map(|init| initial_values(init, config.seed, resume))
        .transpose()?;
    let mut cutter = programs.init.map(Executor::new).transpose()?;
    if let Some(exec) = cutter.as_mut() {
        set_ranks(exec, ranks, None);
    }
    let start = role_state(
        initial_values(programs.worker, config.seed, resume)?,
        programs.init.zip(whole.as_ref()),
        resume,
        // A ZeRO chunk is one of the data axis's (issue 67, item 2: with a model axis
        // the whole slot of a variable not split was cut over every worker).
        (mesh.data, ranks.0),
        |_| true,
        |_, whole| match cutter.as_mut() {
            Some(exec) => {
                let out =
                    exec.run_with(&HashMap::new(), whole, Mode::Train, 0, Some(&mut *hook))?;
                Ok(out.outputs.into_iter().collect())
            }
            None => Ok(Vec::new()),
        },
    )?;
    let mut exec = Executor::with_backend(programs.worker, backend)?;
    // Training reads back no `output` sink (the prediction and target are for
    // evaluation): on a device that would be a copy and a wait every step.
    exec.set_train_outputs(false);
    set_ranks(&mut exec, ranks, None);
    exec.set_profiling(opts.profile && rank == 0);
    // A trace on a GPU times each op's kernels between events on its stream: the
    // host's clock would time the launches.
    exec.set_device_clock(opts.trace);
    let device = exec.backend().name();
    let OnDevice {
        params,
        mut optimizer,
    } = onto_device(exec.backend(), config, start)?;
    // Workers that fill the cores keep their updates on their own thread.
    B::parallel_updates(&mut optimizer, cores > workers);
    let first = first_step(resume, steps)?;
    let st = state.insert(Loop {
        exec,
        params,
        optimizer,
        profile: Profile {
            steps: steps + 1 - first,
            ..Profile::default()
        },
        last: bytes_start,
        ps_last: (0, 0),
        device_last: ByteCount::default(),
    });
    hook.take_waited();
    let k = data.len();
    // CUDA graphs, a mode of this body: after WARMUP eager steps (which also settle
    // every lazy setup, cuBLAS's included), one step and its update are captured, and
    // that graph is replayed for that step and every later one. Only where the step
    // has no host round trip: no pull or push, every collective on the device, and
    // the backend records graphs (the CPU's does not: every step
    // runs eagerly). A step of K micro-batches is captured whole (each micro-batch
    // in buffers of its own, uploaded before the replay, its loss in a slot of its
    // own). Profiling times each node's kernels (the executor waits for
    // them), which a replayed graph cannot: a profiled run runs eagerly.
    // fp16: the backward pass starts from the loss scale, and an overflowed step is
    // skipped. A captured step unscales on the device and skips its update there; the
    // host reads the flag with the loss and moves the scale before the next replay.
    // Only where every worker sees the same flag without asking the others: each holds
    // whole gradients, averaged over the data axis (an overflow on one worker is then
    // an overflow on all), not a ZeRO chunk or a model-axis part.
    let scaler = match resume.and_then(|r| r.optimizer.get(LOSS_SCALE_KEY)) {
        _ if !programs.worker.scales_loss() => None,
        Some(t) => Some(LossScaler::from_tensor(t)?),
        None => Some(LossScaler::default()),
    };
    let flags_agree = !hook.has_model_axis()
        && programs
            .worker
            .params()
            .iter()
            .all(|(_, name, _)| !name.ends_with(ZERO_SHARD_SUFFIX));
    // Else they are summed on the device over each axis's NCCL communicator, which a
    // captured step has for every axis it has collectives on: the model axis needs
    // one (ZeRO's data axis has its reduce-scatters).
    let flags_on_device = flags_agree
        || !hook.has_model_axis()
        || programs
            .worker
            .node_ids()
            .into_iter()
            .any(|id| programs.worker.op(id).is_model_collective());
    // A captured step replays the update as it was captured: no norm measured, no clip.
    let capturable = (scaler.is_none() || flags_on_device)
        && config.clip_norm.is_none()
        && !opts.profile
        && !st.exec.device_clock()
        && !st.exec.schedule().has_server_ops()
        && st.exec.can_capture();
    let graph = Capture::starting(capturable);
    // Preloaded batches go to the device once where the backend keeps them (a GPU):
    // a step's feeds are then a copy within device memory, not a host-to-device
    // transfer. One batch a step only: micro-batches are fed by the body below.
    let mut held: VecDeque<usize> = VecDeque::new();
    if opts.preload && k == 1 {
        let mut batches = data[0].take_preloaded().into_iter();
        while let Some(b) = batches.next() {
            match st
                .exec
                .backend()
                .hold_batch(&b)
                .map_err(|e| backend_error(&device, "holding the preloaded batches", e))?
            {
                Some(id) => held.push_back(id),
                None => {
                    // Not kept: served from the host as before.
                    data[0].restore_preloaded(std::iter::once(b).chain(batches).collect());
                    break;
                }
            }
        }
    }
    let samples = config.batch * k * (steps + 1).saturating_sub(first);
    let peak = if crate::core::peak::worth_measuring(opts.flops_per_sample, samples) {
        st.exec
            .backend()
            .peak_flops(crate::core::peak::products_dtype(programs.worker))
    } else {
        None
    };
    let cadence = Cadence::of(config, opts);
    let mut body = WorkerStep {
        st,
        peak,
        hook,
        data,
        programs,
        config,
        opts,
        rank,
        ranks,
        mesh: *mesh,
        first,
        last: steps,
        device,
        bounds: match &scaler {
            Some(_) => crate::run::programs::fp16_overflow_bounds(programs.worker, mesh.data * k),
            None => Default::default(),
        },
        scaler,
        flags_agree,
        graph,
        rehearsal: Rehearsal::of(opts, rank, programs.workers),
        prefetched: None,
        issued: false,
        held,
    };
    let trace = opts.trace.then_some(trace);
    run_steps(&mut body, first, cadence, trace, report)
}

/// A worker's step: its program once per micro-batch and the update, or the replay of
/// the step's captured CUDA graph.
struct WorkerStep<'s, 'p, B: Backend> {
    st: &'s mut Loop<B>,
    hook: &'s mut HostHook,
    data: &'s mut [DataSource],
    programs: &'s Programs<'p>,
    config: &'s RunConfig,
    opts: &'s TrainOptions,
    rank: usize,
    /// Its ranks on the mesh's data and model axes, set before each micro-batch.
    ranks: (usize, usize),
    /// The plan's mesh; its data axis's replicas are the workers whose gradients are
    /// averaged.
    mesh: Mesh,
    first: usize,
    /// The run's last step.
    last: usize,
    /// The backend's name, for its errors.
    device: String,
    /// Its device's peak for the plan's products, for model FLOPs utilisation.
    peak: Option<crate::core::peak::DevicePeak>,
    scaler: Option<LossScaler>,
    /// fp16: the bound on each 16-bit gradient past which the whole step overflowed.
    bounds: crate::core::backend::OverflowBounds,
    /// Whether every worker sees the same overflow flag without asking the others.
    flags_agree: bool,
    graph: GraphState,
    /// The failure this worker rehearses, if any (`--fail-worker`).
    rehearsal: Rehearsal,
    /// While a replayed step runs on the device, the next step's batch is drawn and
    /// staged (uploads are ordered after the replay on the device's stream, so the
    /// buffers the graph reads are overwritten only once it is done).
    prefetched: Option<Vec<HashMap<String, B::Tensor>>>,
    /// Whether this step's replay was issued already, behind the previous step's.
    issued: bool,
    /// The preloaded batches the backend holds, in order.
    held: VecDeque<usize>,
}

impl<B: Backend> StepBody for WorkerStep<'_, '_, B> {
    type Detail = ();
    type Report = StepReport;

    fn learning_rate(&self) -> f64 {
        // A backend that does not keep the rate runs no schedule (it refuses one): the
        // rate is the train block's.
        B::learning_rate(&self.st.optimizer, u64::from(self.issued))
            .unwrap_or_else(|| self.config.optimizer.lr())
    }

    fn run_step(&mut self, step: usize, due: Due) -> Result<Ran<()>> {
        let (rank, first, steps) = (self.rank, self.first, self.last);
        self.rehearsal.at(step, first)?;
        let device = self.device.as_str();
        let st = &mut *self.st;
        let hook = &mut *self.hook;
        hook.step = step as u64;
        // The first steps load modules, pick cuBLAS algorithms and fault pages in, once
        // per run: a profile of a run long enough leaves them out.
        if self.opts.profile && step == first + WARMUP && steps + 1 - first >= 4 * WARMUP {
            st.exec.reset_profile();
            st.profile = Profile {
                steps: steps + 1 - step,
                warmup: WARMUP,
                ..Profile::default()
            };
        }
        // The first micro-batch on the device; the others stay on the host until they
        // run. A step captured or replayed reads every micro-batch from buffers of its
        // own, so all of them go to the device before it.
        let k = self.data.len();
        let graphed = self.graph.graphed_at(step, first);
        let (fed, later, start) = match self.prefetched.take() {
            Some(feeds) => (feeds, Vec::new(), Instant::now()),
            None if !self.held.is_empty() => {
                let start = Instant::now();
                let fed = feed_held(st.exec.backend(), &mut self.held, device)?;
                (vec![fed], Vec::new(), start)
            }
            None => {
                let mut batches = self
                    .data
                    .iter_mut()
                    .map(DataSource::next_batch)
                    .collect::<Result<Vec<_>>>()?;
                let start = Instant::now();
                if batches.is_empty() {
                    return Err(RuntimeError::internal(
                        "the worker loop",
                        format!("worker {rank}: no data source"),
                    ));
                }
                let rest = batches.split_off(if graphed { k } else { 1 });
                let fed = upload_micro_batches(st.exec.backend(), batches, k)?;
                (fed, rest, start)
            }
        };
        // fp16: the scale (fed) and its inverse (read by the unscaling kernels) of this
        // step, before its capture or replay; K micro-batches a step on each of N
        // workers, so a share of 1/(N K) (as the eager steps below).
        let share = self.mesh.data * k;
        let scaled = |st: &mut Loop<B>, s: Option<&LossScaler>| -> Result<()> {
            if let Some(s) = s {
                st.exec.set_loss_scale(s.scale / share as f64)?;
                st.exec
                    .backend()
                    .set_unscale_factor(share as f64 / s.scale)
                    .map_err(|e| backend_error(device, "setting the loss scale", e))?;
            }
            Ok(())
        };
        if self.graph.captures_at(step, first) {
            scaled(st, self.scaler.as_ref())?;
            // Some(whether the flags are summed over the workers).
            let unscale = self.scaler.as_ref().map(|_| !self.flags_agree);
            self.graph = capture_step(
                st,
                &fed,
                step,
                self.ranks,
                unscale.map(|o| (o, &self.bounds)),
                &mut *hook,
            )?;
        }
        let mut grad_norm = None;
        let (loss, updating, used) = if let Some(captured) = self.graph.replayed() {
            let replay = |backend: &mut B, step: usize| {
                backend
                    .set_step(step as u64)
                    .map_err(|e| backend_error(device, "setting the step", e))?;
                backend
                    .replay()
                    .map_err(|e| backend_error(device, "replaying the step's CUDA graph", e))
            };
            if !self.issued {
                scaled(st, self.scaler.as_ref())?;
                replay(st.exec.backend(), step)?;
            }
            // The next step's batch is staged and its replay issued before this
            // step's loss is read: the device runs it while the host reports this one
            // (uploads and replays are ordered on the device's stream, so the graph's
            // buffers are overwritten only once this step is done). Not before an
            // evaluation or a checkpoint: they read the same buffers. Not with a loss
            // scale: the next step's scale depends on whether this one overflowed.
            self.issued = !due.last && !due.eval && !due.checkpoint && self.scaler.is_none();
            if self.issued {
                self.prefetched = Some(if self.held.is_empty() {
                    let next = self
                        .data
                        .iter_mut()
                        .map(DataSource::next_batch)
                        .collect::<Result<Vec<_>>>()?;
                    upload_micro_batches(st.exec.backend(), next, k)?
                } else {
                    vec![feed_held(st.exec.backend(), &mut self.held, device)?]
                });
                replay(st.exec.backend(), step + 1)?;
            }
            let loss = st
                .exec
                .backend()
                .pending_scalar()
                .map_err(|e| backend_error(device, "reading the loss", e))?
                .map_or(f64::NAN, |sum| sum / k as f64);
            if let Some(s) = self.scaler.as_mut() {
                let finite = st.exec.backend().replayed_finite().ok_or_else(|| {
                    RuntimeError::internal(
                        "the CUDA graph replay",
                        format!(
                            "{device}: step {step}'s replay did not say whether its gradients \
                         were finite"
                        ),
                    )
                })?;
                s.after(finite);
            }
            (loss, Instant::now(), captured)
        } else {
            // Micro-batches: the last one communicates and hands the gradients over.
            let mut micro_loss = 0.0;
            let mut last = None;
            let sources = fed.len() + later.len();
            let mut later = later.into_iter();
            let mut fed = fed.into_iter();
            // Each of the step's N x K batches starts its backward pass from its share
            // of the scale, so that its 16-bit values are what one device's are for its
            // samples in the global batch (N times larger otherwise: N workers' means
            // over b samples against one mean over N b); the averages over workers and
            // micro-batches then give the global gradient times that share.
            let share = (self.mesh.data * k) as f64;
            if let Some(s) = &self.scaler {
                st.exec.set_loss_scale(s.scale / share)?;
            }
            st.exec.begin_device_step()?;
            for m in 0..k {
                let batch = match fed.next() {
                    Some(b) => b,
                    None => {
                        let b = later.next().ok_or_else(|| {
                            RuntimeError::internal(
                                "the worker loop",
                                format!(
                                "worker {rank}: {k} micro-batches a step, {sources} data sources"
                            ),
                            )
                        })?;
                        upload_all(st.exec.backend(), b)?
                    }
                };
                set_ranks(&mut st.exec, self.ranks, Some((k, m)));
                let mode = if m + 1 < k { Mode::Micro } else { Mode::Train };
                let mut o =
                    st.exec
                        .run_with(&batch, &st.params, mode, step as u64, Some(&mut *hook))?;
                micro_loss += o.loss.unwrap_or(f64::NAN);
                assign_running(
                    st.exec.backend(),
                    &mut st.params,
                    std::mem::take(&mut o.assigned),
                )?;
                last = Some(o);
            }
            let Some(out) = last else {
                return Err(RuntimeError::internal(
                    "the worker loop",
                    format!("worker {rank}: no data source"),
                ));
            };
            let used = st.exec.measured_memory();
            let mut updating = Instant::now();
            let mut grads = out.grads;
            let apply = match self.scaler.as_mut() {
                None => true,
                Some(s) => {
                    let finite = st
                        .exec
                        .backend()
                        .unscale(&mut grads, share / s.scale, &self.bounds)
                        .map_err(|e| backend_error(device, "unscaling the gradients", e))?;
                    // Every worker skips the same steps (a ZeRO chunk or a model-axis
                    // part may overflow on one worker alone).
                    let finite = all_finite(hook, finite, step)?;
                    s.after(finite);
                    finite
                }
            };
            if let (true, Some(max)) = (apply, self.config.clip_norm) {
                let label =
                    |over: &str| format!("worker {rank}, step {step}: clip_norm's sum over {over}");
                grad_norm = Some(clip_gradients(
                    st.exec.backend(),
                    &mut grads,
                    max,
                    |names, squares| {
                        Ok(squared_norm(hook, names, squares, &label)?.max(0.0).sqrt())
                    },
                )?);
            }
            if apply {
                st.exec
                    .backend()
                    .update(&mut st.optimizer, &mut st.params, grads)
                    .map_err(|e| backend_error(device, "applying the update", e))?;
            }
            st.exec
                .backend()
                .synchronize()
                .map_err(|e| backend_error(device, "finishing the step", e))?;
            if let Some(timed) = st.exec.device_spans()? {
                // The update starts on the device when its last op ends.
                if let Some(&(_, _, end)) = timed.last() {
                    updating = end;
                }
                hook.retime(step as u64, timed);
            }
            (micro_loss / k as f64, updating, used)
        };
        let memory = MemoryByCategory {
            params: st
                .params
                .values()
                .map(|t| B::tensor_type(t).bytes() as u64)
                .sum(),
            gradients: used.gradients,
            optimizer: B::optimizer_bytes(&st.optimizer),
            activations: used.activations,
            comm_buffers: used.comm_buffers,
        };
        Ok(Ran {
            loss: Some(loss),
            start,
            updating,
            memory,
            grad_norm,
            detail: (),
        })
    }

    fn account(
        &mut self,
        step: usize,
        due: Due,
        ran: Ran<()>,
        timed: Timed,
        lr: f64,
    ) -> Result<StepReport> {
        let rank = self.rank;
        let st = &mut *self.st;
        let hook = &mut *self.hook;
        st.profile.optimizer += timed.end - timed.updating;
        let waited = hook.take_waited();
        st.profile.step_time += timed.end - timed.start;
        st.profile.comm_wait += waited;
        let (sent, received, moved) = byte_deltas(st, hook);
        // Worker 0 reports the evaluation; when evaluating takes collectives (ZeRO's
        // gathered parameters), every worker takes part.
        let eval_start = Instant::now();
        let eval = if due.eval && (rank == 0 || st.exec.schedule().has_collective(Mode::Eval)) {
            // Evaluation is not training: keep its kernels out of the profile, and its
            // traffic out of the next step's bytes.
            st.exec.set_profiling(false);
            st.exec.begin_device_step()?;
            let e = evaluate(
                &mut st.exec,
                &st.params,
                &self.data[0],
                self.config,
                step as u64 + 1,
                Some(&mut *hook),
            );
            if let Some(timed) = st.exec.device_spans()? {
                hook.retime(step as u64, timed);
            }
            st.exec.set_profiling(self.opts.profile);
            hook.take_waited();
            byte_deltas(st, hook);
            let (e, failed) = settle(e, due.last)?;
            (e.filter(|_| rank == 0), failed)
        } else {
            (None, None)
        };
        let (eval, eval_failed) = eval;
        // The other workers wait for worker 0's evaluation here, not in the next step's
        // first collective, where it would count as that step's time.
        let eval = if due.eval && self.mesh.data > 1 && self.opts.sync == PsSync::Sync {
            hook.barrier(step as u64)?;
            hook.take_waited();
            eval.map(|e| EvalMetrics {
                eval_sec: eval_start.elapsed().as_secs_f64(),
                ..e
            })
        } else {
            eval
        };
        if due.checkpoint && (self.opts.checkpoint.is_some() || self.opts.snapshot.is_some()) {
            let scaler = self.scaler.as_ref();
            save_training_state(
                self.opts,
                due,
                (&mut st.exec, &st.optimizer, &st.params),
                self.programs,
                self.config,
                (rank, self.ranks, step),
                &self.mesh,
                scaler,
                hook,
            )?;
        }
        Ok(StepReport {
            rank,
            step,
            device: st.exec.backend().describe(),
            memory: ran.memory,
            loss: ran.loss.unwrap_or(f64::NAN),
            grad_norm: ran.grad_norm,
            step_sec: timed.seconds(),
            comm_wait_sec: waited.as_secs_f64(),
            bytes_sent: sent,
            bytes_received: received,
            bytes_moved: moved,
            eval,
            eval_failed,
            device_memory: st.exec.backend().device_memory(),
            pipeline: None,
            loss_scale: self.scaler.as_ref().map(|s| (s.scale, s.skipped)),
            lr: Some(lr),
            cuda_graph: self.graph.replaying(),
            peaks: self.peak.iter().cloned().collect(),
            ..StepReport::default()
        })
    }
}

/// The feeds of the next batch the backend holds (`Transfer::hold_batch`).
fn feed_held<B: Backend>(
    backend: &mut B,
    held: &mut VecDeque<usize>,
    device: &str,
) -> Result<HashMap<String, B::Tensor>> {
    let id = held
        .pop_front()
        .ok_or_else(|| RuntimeError::internal("the worker loop", "no held batch is left"))?;
    backend
        .feed_held(id)
        .map_err(|e| backend_error(device, "feeding a held batch", e))
}

/// Where a worker's steps are with CUDA graphs; the captured step's memory use.
type GraphState = Capture<MemoryUse>;

/// Records step `step` and its update while the backend captures (nothing runs; the
/// caller replays the graph for this step too), measuring what the step holds. `Off`
/// where the backend declines. With `unscale` (fp16), the gradients are unscaled and
/// checked on the device against their bounds, and an overflow skips the update there
/// (with `Some((true, _))`, an overflow on any worker: the flags are summed over them).
fn capture_step<B: Backend>(
    st: &mut Loop<B>,
    feeds: &[HashMap<String, B::Tensor>],
    step: usize,
    ranks: (usize, usize),
    unscale: Option<(bool, &crate::core::backend::OverflowBounds)>,
    hook: &mut HostHook,
) -> Result<GraphState> {
    let device = st.exec.backend().name();
    let backend = st.exec.backend();
    backend
        .set_step(step as u64)
        .map_err(|e| backend_error(&device, "setting the step", e))?;
    let k = feeds.len();
    let on = backend
        .begin_capture(k)
        .map_err(|e| backend_error(&device, "starting a CUDA graph capture", e))?;
    if !on {
        return Ok(Capture::Off);
    }
    // Every micro-batch as the eager step runs them: the last communicates and hands
    // the gradients over.
    let micro = |st: &mut Loop<B>, hook: &mut HostHook| {
        let mut last = None;
        for (m, fed) in feeds.iter().enumerate() {
            set_ranks(&mut st.exec, ranks, Some((k, m)));
            let mode = if m + 1 < k { Mode::Micro } else { Mode::Train };
            let mut o = st
                .exec
                .run_with(fed, &st.params, mode, step as u64, Some(&mut *hook))?;
            assign_running(
                st.exec.backend(),
                &mut st.params,
                std::mem::take(&mut o.assigned),
            )?;
            last = Some(o);
        }
        last.ok_or_else(|| {
            RuntimeError::internal(
                "the CUDA graph capture",
                format!("{device}: no data source"),
            )
        })
    };
    let captured = micro(st, hook).and_then(|mut out| {
        let used = st.exec.measured_memory();
        let backend = st.exec.backend();
        if let Some((over_workers, bounds)) = unscale {
            backend
                .unscale_on_device(&mut out.grads, over_workers, bounds)
                .map_err(|e| backend_error(&device, "unscaling the gradients", e))?;
        }
        backend
            .update(&mut st.optimizer, &mut st.params, out.grads)
            .map_err(|e| backend_error(&device, "applying the update", e))
            .map(|()| used)
    });
    let ended = st.exec.backend().end_capture();
    let used = captured.map_err(|e| {
        capture_failed(
            &device,
            format!("step {step} could not be captured into a CUDA graph"),
            e,
        )
    })?;
    ended.map_err(|e| capture_failed(&device, "ending the CUDA graph capture".into(), e))?;
    Ok(Capture::Replaying(used))
}

/// Bytes moved since the last call: `(sent, received, moved)`.
fn byte_deltas<B: Backend>(st: &mut Loop<B>, hook: &mut HostHook) -> (u64, u64, u64) {
    // The model axis's collectives run on this thread, the data axis's on the hook's.
    let now = hook.bytes();
    let ps_now = hook.ps.as_ref().map_or((0, 0), PsClient::bytes);
    let device_now = st.exec.backend().collective_bytes();
    let dd = device_now - st.device_last;
    st.device_last = device_now;
    let d = now - st.last;
    let d = ByteCount {
        sent: d.sent + dd.sent,
        received: d.received + dd.received,
    };
    // To servers: pushes and pulls' ids; from them: pulled values.
    let (to_ps, from_ps) = (ps_now.0 - st.ps_last.0, ps_now.1 - st.ps_last.1);
    st.last = now;
    st.ps_last = ps_now;
    (
        d.sent + to_ps,
        d.received + from_ps,
        d.sent + to_ps + from_ps,
    )
}
