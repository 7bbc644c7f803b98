//! A pipelined plan's stages as threads of this process, one per stage, each running
//! its forward and backward programs in the order its schedule says.
//!
//! Every step, stage s draws the step's M micro-batches (each stage reads the feeds
//! its programs need: stage 0 the features, the loss's stage the labels), then walks
//! its communication program ([`distc_ir::pipeline::schedule::program`]): a `recv`
//! waits for one message from a neighbour, a computation runs the forward or backward
//! program of one micro-batch, a `send` ships what that computation sent to the
//! neighbour. What a forward sends to its own stage is the stash: kept per micro-batch
//! until that micro-batch's backward. The backward programs accumulate the gradients
//! (`accumulate{micro=M}`): the last micro-batch's backward hands the mean over the
//! step to the optimizer, as gradient accumulation does on one device.
//!
//! Messages go through the communicator among the stages (its `send`/`recv`, bounded
//! by `--timeout`, counted in the metrics' bytes). Stage s of this launcher is rank s.
//!
//! On a GPU whose stages send their messages device to device, a stage's step has no
//! host round trip: after the warm-up steps it is captured into one CUDA graph (the
//! backward's backend begins the capture of the stream both programs run on, the
//! forward's joins it and keeps each micro-batch's loss in a device slot) and replayed
//! from then on ([`StageGraph`]).
//!
//! On a mesh with a model axis of T (tensor parallelism), each stage is T workers, one
//! per model rank: each runs the stage's sharded programs on its part of the split
//! variables, joined to the other model ranks of its stage by a model-axis
//! communicator, and to the same model rank of the neighbouring stages by the
//! pipeline's. Worker w is model rank w % T of stage (w / T) % P of replica w / (T P).

use crate::comm::{AxisComms, ByteCount, Communicator, Links};
use crate::core::axis::Axis;
use crate::core::backend::Site;
use crate::core::backend::{backend_error, upload_micro_batches, Backend};
use crate::core::checkpoint::{StateIndex, TrainingState};
use crate::core::config::RunConfig;
use crate::core::error::{PeerKind, Result, RuntimeError};
use crate::core::exec::{Executor, Message};
use crate::core::schedule::Mode;
use crate::core::shards::{Layout, Manifest};
use crate::core::value::{Tensor, Value};
use crate::ps::wire::{decode_values, encode_values};
use crate::run::checkpoint::{commit_state, start_shard};
use crate::run::data::DataSource;
use crate::run::data::{open_data, open_source};
use crate::run::eval::{settle, Evaluated, Evaluator};
use crate::run::hook::HostHook;
use crate::run::memory::MemoryByCategory;
use crate::run::mesh::Mesh;
use crate::run::metrics::{EvalMetrics, StageAccount, StepReport};
use crate::run::options::{CheckpointEvery, TrainOptions};
use crate::run::programs::Programs;
use crate::run::state::{
    carried_slots, first_step, initial_values, model_part, role_state, RoleState,
};
use crate::run::steps::{run_steps, Cadence, Due, Ran, StepBody, StepTrace, Timed};
use crate::run::trace::Span;
use crate::run::trainer::{
    assign_running, capture_failed, clip_gradients, host_params, onto_device, squared_norm,
    Capture, OnDevice, Rehearsal,
};
use crate::run::worker::WorkerOutcome;
use distc_ir::pipeline::schedule::{Action, Carried, Step};
use distc_ir::pipeline::{PipelineProgram, TiedVariable};
use distc_ir::TensorType;
use distc_ir::{Graph, Op};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// The variables a stage's programs read.
fn stage_variables(graphs: [&Graph; 2]) -> Vec<String> {
    let mut names: Vec<String> = graphs
        .iter()
        .flat_map(|g| g.params().into_iter().map(|(_, n, _)| n.to_string()))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The messages between a stage and its neighbours, by (neighbour, what it carries):
/// each value's tag and type, sorted by tag, the order a message sent device to device
/// holds them in.
#[derive(Default)]
struct Messages {
    /// What it receives.
    inbound: HashMap<(usize, Carried), Vec<(String, TensorType)>>,
    /// What the neighbour receives from it.
    outbound: HashMap<(usize, Carried), Vec<(String, TensorType)>>,
}

impl Messages {
    /// Stage `s`'s, from the receiving programs of `stages`.
    fn of(stages: &[distc_ir::pipeline::StageGraphs], s: usize) -> Messages {
        let received = |graph: &Graph, from: usize| {
            let mut got: Vec<(String, TensorType)> = graph
                .node_ids()
                .into_iter()
                .filter_map(|id| match graph.op(id) {
                    Op::Recv { stage, tag, ty } if *stage == from => {
                        Some((tag.clone(), ty.clone()))
                    }
                    _ => None,
                })
                .collect();
            got.sort_by(|a, b| a.0.cmp(&b.0));
            got
        };
        let mut m = Messages::default();
        if s > 0 {
            let key = (s - 1, Carried::Activation);
            m.inbound.insert(key, received(&stages[s].forward, s - 1));
            let key = (s - 1, Carried::Gradient);
            m.outbound.insert(key, received(&stages[s - 1].backward, s));
        }
        if s + 1 < stages.len() {
            let key = (s + 1, Carried::Gradient);
            m.inbound.insert(key, received(&stages[s].backward, s + 1));
            let key = (s + 1, Carried::Activation);
            m.outbound.insert(key, received(&stages[s + 1].forward, s));
        }
        m
    }
}

/// What every stage of a pipelined run shares, on threads or MPI ranks alike: the
/// programs, each stage's schedule, the data's shapes and the variables' initial values
/// (a resumed state's where the run resumes one). Worker w is model rank w % T of stage
/// (w / T) % P of replica w / (T P) (T = 1 without a model axis).
pub(crate) struct PipelineRun<'a> {
    /// The graph the stages were cut from: the one-device graph, sharded on a mesh with
    /// a model axis.
    whole: &'a Graph,
    program: &'a PipelineProgram,
    /// The plan's programs, as every role's data opener reads them.
    programs: Programs<'a>,
    /// The plan's mesh: copies of the pipeline (replicas, each a slice of the global
    /// batch), its stages, and the workers of each stage on the model axis.
    pub(crate) mesh: Mesh,
    /// Cuts each model rank's part of the split variables from the whole ones.
    shard: Option<&'a Graph>,
    /// The whole values the init program cuts a model rank's parts from (a resumed
    /// state's where there is one).
    whole_values: Option<HashMap<String, Tensor>>,
    /// Each split variable's part, whole name and dimension: `(w.tp, w, dim)`.
    split: Vec<(String, String, usize)>,
    steps_of: Vec<Vec<Step>>,
    tied: Vec<TiedVariable>,
    initial: HashMap<String, Tensor>,
    /// The variables no stage reads, whole, and their optimizer state: on one device
    /// no gradient reaches them and they never change, so the run carries them as
    /// they are into its checkpoints and its trained variables.
    carried: HashMap<String, Tensor>,
    carried_slots: HashMap<String, Tensor>,
    /// How a sharded state records the split variables (from the final program).
    layout: Layout,
    /// Steps of the run.
    pub(crate) steps: usize,
    /// The first step it runs: 1, or the one after a resumed state's.
    pub(crate) first: usize,
    /// Which steps evaluate and which write a checkpoint.
    cadence: Cadence,
    resume: Option<Arc<TrainingState>>,
    checkpoint: Option<CheckpointEvery>,
    /// The one-device step's samples: the data position a checkpoint records.
    samples_per_step: usize,
    /// The model's FLOPs per sample, for the metrics.
    pub(crate) flops_per_sample: Option<f64>,
    pub(crate) tokens_per_sample: Option<usize>,
    model: String,
    optimizer: String,
}

impl<'a> PipelineRun<'a> {
    /// The pipelined plan's stages on `mesh` (its replicas, T workers wide on a model
    /// axis); refuses what a pipelined run cannot do.
    pub(crate) fn new(
        programs: &Programs<'a>,
        mesh: Mesh,
        config: &RunConfig,
        opts: &TrainOptions,
    ) -> Result<PipelineRun<'a>> {
        let (whole, init, finalize) = (programs.worker, programs.init, programs.finalize);
        let Some(program) = programs.pipeline else {
            return Err(RuntimeError::plan("it has no pipeline"));
        };
        if mesh.data == 0 || mesh.stages != Some(program.stages.len().max(1)) {
            return Err(RuntimeError::plan(format!(
                "a pipeline of {} stages cannot run on {}",
                program.stages.len(),
                mesh.describe()
            )));
        }
        let replicas = mesh.data;
        // How the final program gathers the model axis's parts: the split variables,
        // and how a sharded state records them.
        let layout = Layout::of(finalize).map_err(RuntimeError::Plan)?;
        let split = layout.model_parts();
        // The one-device values the init program cuts each model rank's parts from: a
        // resumed state's where there is one.
        let whole_values = init
            .map(|init| initial_values(init, config.seed, opts.resume.as_deref()))
            .transpose()?;
        let steps_of = program
            .programs()
            .map_err(|e| RuntimeError::plan(format!("its pipeline's schedule: {e}")))?;
        let steps = opts.last_step(config);
        let resume = opts.resume.as_deref();
        // The state is whole, whatever wrote it: checked against the whole model.
        let initial = initial_values(whole, config.seed, resume)?;
        // Read by a stage, split over the model axis, or read by the model itself (a
        // stage that should read it and does not is the plan's error, not a variable
        // to carry).
        let read: HashSet<String> = program
            .stages
            .iter()
            .flat_map(|g| stage_variables([&g.forward, &g.backward]))
            .chain(split.iter().map(|(_, whole, _)| whole.clone()))
            .chain(
                whole
                    .params()
                    .into_iter()
                    .filter(|(id, _, _)| !whole.user_nodes(*id).is_empty())
                    .map(|(_, n, _)| n.to_string()),
            )
            .collect();
        let carried: HashMap<String, Tensor> = initial
            .iter()
            .filter(|(n, _)| !read.contains(*n))
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let carried_slots = carried_slots(&carried, config, resume)?;
        Ok(PipelineRun {
            whole,
            program,
            programs: *programs,
            mesh,
            shard: init,
            whole_values,
            split,
            steps_of,
            tied: program.tied(),
            initial,
            carried,
            carried_slots,
            layout,
            steps,
            first: first_step(resume, steps)?,
            cadence: Cadence::of(config, opts),
            resume: opts.resume.clone(),
            checkpoint: opts.checkpoint.clone(),
            samples_per_step: config.batch * program.micro_batches * replicas,
            flops_per_sample: opts.flops_per_sample,
            tokens_per_sample: opts.tokens_per_sample,
            model: whole.name.clone(),
            optimizer: format!("{:?}", config.optimizer),
        })
    }

    /// Samples of one step, over every replica: what a metrics line's throughput
    /// counts.
    pub(crate) fn samples_per_step(&self) -> usize {
        self.samples_per_step
    }

    /// Whether stage `s` updates variable `name`: a tied variable's holders leave it
    /// (and its optimizer state) to its owner.
    fn updates(&self, s: usize, name: &str) -> bool {
        !self.tied.iter().any(|t| t.name == name && t.owner != s)
    }

    /// Steps this run runs.
    pub(crate) fn steps_to_run(&self) -> usize {
        self.steps + 1 - self.first
    }

    /// Writes the whole training state after `step` (a checkpoint's, not sharded):
    /// `params` and `slots`, every stage's gathered into worker 0, with the carried
    /// ones. Worker 0 calls it.
    fn write_whole(
        &self,
        step: usize,
        params: &HashMap<String, Tensor>,
        mut slots: HashMap<String, Tensor>,
        last: bool,
    ) -> Result<()> {
        let Some(c) = &self.checkpoint else {
            return Ok(());
        };
        let lacking = self.lacking(|n| params.contains_key(n));
        if !lacking.is_empty() {
            return Err(RuntimeError::internal(
                "the stages' gather",
                format!(
                    "the training state of step {step} lacks {lacking:?}: a stage did not \
                     send its variables"
                ),
            ));
        }
        slots.extend(self.carried_slots.clone());
        let index = self.index(step, c.saved_by.clone());
        let state = TrainingState::new(index, params.clone(), slots);
        c.write(Arc::new(state), last)
    }

    /// The index of the state after `step`, saved by `saved_by`.
    fn index(&self, step: usize, saved_by: String) -> StateIndex {
        let samples = (step * self.samples_per_step) as u64;
        StateIndex::at(
            &self.model,
            step as u64,
            samples,
            saved_by,
            self.optimizer.clone(),
        )
    }

    /// The whole model's variables that `has` says a state lacks (a split variable's
    /// part stands for the whole variable).
    fn lacking(&self, has: impl Fn(&str) -> bool) -> Vec<String> {
        let mut lacking: Vec<String> = self
            .initial
            .keys()
            .map(|n| {
                self.split
                    .iter()
                    .find(|(part, _, _)| part == n)
                    .map_or(n.as_str(), |(_, w, _)| w.as_str())
            })
            .filter(|n| !has(n))
            .map(str::to_string)
            .collect();
        lacking.sort();
        lacking
    }

    /// A sharded state's step, once replica 0's stages have started writing their
    /// shards (`keys`, what they hold, gathered into worker 0, which calls this): the
    /// state before it is committed (every stage's write of it is done, since a stage
    /// starts its next write only then), this one's manifest is written, and after the
    /// run's last step it is committed too (its shards were written before the stages
    /// sent their names). Replica 0's workers write one shard each, on the data axis's
    /// rank 0 and their own model rank.
    fn commit_shards(&self, step: usize, mut keys: Vec<String>) -> Result<()> {
        let Some(c) = &self.checkpoint else {
            return Ok(());
        };
        let index = &self.index(step, c.saved_by.clone());
        keys.sort();
        keys.dedup();
        let shards = self.mesh.pipe() * self.mesh.model;
        let manifest = Manifest::of(index, &self.layout, &keys, (shards, 1, self.mesh.model))
            .of_run(&c.run_id());
        let lacking = self.lacking(|n| manifest.index.variables.iter().any(|v| v == n));
        if !lacking.is_empty() {
            return Err(RuntimeError::internal(
                "the sharded checkpoint",
                format!(
                    "the sharded state of step {} lacks {lacking:?}: no stage wrote them",
                    index.step
                ),
            ));
        }
        commit_state(c, manifest, index.step as usize == self.cadence.last)
    }

    /// The stages' variables and those no stage reads: the whole model's.
    fn with_carried(&self, mut params: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
        params.extend(self.carried.clone());
        params
    }

    /// Worker `w`'s place: `(replica, stage, model rank)`.
    pub(crate) fn coordinates(&self, w: usize) -> (usize, usize, usize) {
        let c = self.mesh.coord(w);
        (c.replica, c.stage, c.model)
    }

    /// Worker `w`'s data: one source per micro-batch, opened as every role's is.
    pub(crate) fn sources(
        &self,
        config: &RunConfig,
        opts: &TrainOptions,
        w: usize,
    ) -> Result<Vec<DataSource>> {
        open_data(&self.programs, &self.mesh, config, opts, w)
    }

    /// Worker `w`'s stage, its communicators by axis: the pipe axis's links it to the
    /// other stages of its replica (rank = stage), the data axis's to its stage in the
    /// other replicas (rank = replica), the model axis's (where the mesh has one) to
    /// the other model ranks of its stage (rank = model rank).
    pub(crate) fn stage(
        &self,
        w: usize,
        mut comms: AxisComms,
        data: Vec<DataSource>,
        (config, opts): (&RunConfig, &TrainOptions),
        t0: Instant,
    ) -> Result<Stage<'_>> {
        let comm = comms.require(Axis::Pipe, "a pipeline stage")?;
        let replica_comm = comms.require(Axis::Data, "a pipeline stage")?;
        let model_comm = comms.take(Axis::Model);
        let (r, s, m) = self.coordinates(w);
        let graphs = &self.program.stages[s];
        let held: HashSet<String> = stage_variables([&graphs.forward, &graphs.backward])
            .into_iter()
            .collect();
        let uncut = held
            .iter()
            .filter_map(|n| Some((n.clone(), self.initial.get(n)?.clone())))
            .collect();
        // The init program's cuts are local (no collective): a stage cuts its own part.
        let mut start = role_state(
            uncut,
            self.shard.zip(self.whole_values.as_ref()),
            self.resume.as_deref(),
            (1, 0),
            |name| held.contains(name),
            |init, whole| Ok(model_part(init, m, whole)?.into_iter().collect()),
        )?;
        let updated = |name: &str| self.updates(s, name);
        if let Some(slots) = start.slots.as_mut() {
            slots.retain(|k, _| k.rsplit_once('/').is_none_or(|(var, _)| updated(var)));
        }
        let split = self
            .split
            .iter()
            .filter(|(part, _, _)| start.params.contains_key(part))
            .cloned()
            .collect();
        Ok(Stage {
            run: self,
            held_out: self.held_out(config, opts, w)?,
            name: self.mesh.name(w),
            worker: w,
            start,
            stage: s,
            replica: r,
            model_rank: m,
            split,
            snapshot: opts.snapshot.clone().map(|slot| (slot, opts.saved_by())),
            rehearsal: Rehearsal::of(opts, w, self.mesh.workers()),
            // A stage records its own spans: its hook traces nothing.
            hook: HostHook::new(Some(replica_comm), model_comm, None, false),
            steps: &self.steps_of[s],
            forward: &graphs.forward,
            backward: &graphs.backward,
            messages: Messages::of(&self.program.stages, s),
            micro: self.program.micro_batches,
            comm,
            data,
            trace: opts.trace,
            t0,
        })
    }

    /// Worker 0's held-out data, when the run evaluates (its own source: the stages'
    /// sources are theirs); `None` at every other worker.
    fn held_out(
        &self,
        config: &RunConfig,
        opts: &TrainOptions,
        w: usize,
    ) -> Result<Option<DataSource>> {
        if w != 0 || !opts.evaluate {
            return Ok(None);
        }
        let data = open_source(self.whole, config, opts, 0, 1)?;
        crate::run::eval::check_held_out(&data, config)?;
        Ok(Some(data))
    }

    /// What evaluates the one-device graph on the stages' variables, gathered into
    /// worker 0: on `backend`, one worker 0 makes beside its stage's (its device).
    fn evaluator<B: Backend>(
        &self,
        data: DataSource,
        config: &RunConfig,
        backend: B,
    ) -> Result<Evaluator<'a, B>> {
        Ok(Evaluator {
            exec: Executor::with_backend(self.whole, backend)?,
            whole: self.whole,
            shard: self.shard,
            model_axis: self.mesh.model,
            data,
            config: config.clone(),
        })
    }
}

/// One stage of one replica: a thread, or an MPI rank.
pub(crate) struct Stage<'a> {
    /// The run it is a stage of: worker 0 writes its whole states and commits its
    /// sharded ones.
    run: &'a PipelineRun<'a>,
    /// Worker 0's held-out data, when the run evaluates: worker 0 evaluates the
    /// whole model on its own device.
    held_out: Option<DataSource>,
    /// Its worker's name on the mesh, for messages and trace tracks.
    name: String,
    /// Its worker (rank in the mesh), for the backends it makes.
    worker: usize,
    stage: usize,
    /// Its variables at the start, and a resumed state's optimizer state of those it
    /// updates.
    start: RoleState,
    replica: usize,
    /// Its rank on the model axis (0 without one).
    model_rank: usize,
    /// The split variables it holds a part of: `(w.tp, w, dim)`.
    split: Vec<(String, String, usize)>,
    /// An elastic run's slot for the copy it keeps after every step, and who saves it.
    snapshot: Option<(crate::run::snapshot::StateSlot, String)>,
    /// The failure it rehearses, if any (`--fail-worker`).
    rehearsal: Rehearsal,
    hook: HostHook,
    steps: &'a [Step],
    forward: &'a Graph,
    backward: &'a Graph,
    /// What it receives from each neighbour, and what each neighbour expects from it.
    messages: Messages,
    micro: usize,
    comm: Box<dyn Communicator>,
    data: Vec<DataSource>,
    trace: bool,
    t0: Instant,
}

impl Stage<'_> {
    /// The norm of the whole gradient: each stage's square sums of the variables it
    /// updates (a tied variable's at its owner only; a ZeRO chunk summed over the
    /// replicas, which otherwise hold the same averaged gradients; a model-axis part
    /// summed over the model ranks, a whole variable counted once), then summed over
    /// the stages of the replica.
    fn global_norm(&mut self, names: &[&str], squares: &[f64], step: usize) -> Result<f64> {
        let stage = self.stage;
        let label = |over: &str| format!("stage {stage}, step {step}: clip_norm's sum over {over}");
        let mut own = [squared_norm(&mut self.hook, names, squares, &label)?];
        self.comm.set_label(&label("the stages"));
        self.comm.all_reduce_f64(&mut own, false)?;
        Ok(own[0].max(0.0).sqrt())
    }

    /// Brings every tied variable's copies up to date after the update: its owner sends
    /// the updated value to each holder ([`PipelineProgram::tied`] says in which order).
    fn exchange_tied<B: Backend>(
        &mut self,
        step: usize,
        backend: &mut B,
        params: &mut HashMap<String, B::Tensor>,
    ) -> Result<()> {
        let s = self.stage;
        let device = backend.name();
        let run = self.run;
        for t in &run.tied {
            if t.owner == s {
                let held = params.get(&t.name).ok_or_else(|| {
                    RuntimeError::plan(format!("stage {s} does not hold `{}`", t.name))
                })?;
                let value = backend
                    .download(held)
                    .map_err(|e| backend_error(&device, "reading a tied variable", e))?;
                let msg = encode_params(HashMap::from([(t.name.clone(), value)]));
                for &h in &t.holders {
                    self.comm.set_label(&format!(
                        "stage {s}, step {step}: the send of the updated `{}` to stage {h}",
                        t.name
                    ));
                    self.comm.send(h, msg.clone())?;
                }
            } else if t.holders.contains(&s) {
                let from = t.owner;
                self.comm.set_label(&format!(
                    "stage {s}, step {step}: the receive of the updated `{}` from stage {from}",
                    t.name
                ));
                let bytes = self.comm.recv(from).map_err(|e| {
                    e.context(format_args!(
                        "step {step}: waiting for the updated `{}` from stage {from}",
                        t.name
                    ))
                })?;
                let values = decode_params(&bytes).map_err(|e| {
                    malformed(
                        s,
                        from,
                        format!("the updated `{}` from stage {from}: {e}", t.name),
                    )
                })?;
                for (name, x) in values {
                    if name != t.name {
                        return Err(RuntimeError::plan(format!(
                            "stage {from} sent `{name}` for the updated `{}`",
                            t.name
                        )));
                    }
                    let x = backend
                        .upload(&name, x)
                        .map_err(|e| backend_error(&device, "writing a tied variable", e))?;
                    params.insert(name, x);
                }
            }
        }
        Ok(())
    }
}

impl Stage<'_> {
    /// The optimizer state of the variables this stage updates: a tied variable's
    /// holders leave its slots to its owner, whose are the ones its updates used.
    fn updated_slots<B: Backend>(
        &self,
        backend: &mut B,
        optimizer: &B::Optimizer,
    ) -> Result<HashMap<String, Tensor>> {
        let s = self.stage;
        let device = backend.name();
        let mut slots: HashMap<String, Tensor> = backend
            .optimizer_state(optimizer)
            .map_err(|e| backend_error(&device, "reading the optimizer state", e))?
            .into_iter()
            .collect();
        slots.retain(|k, _| {
            k.rsplit_once('/')
                .is_none_or(|(var, _)| self.run.updates(s, var))
        });
        Ok(slots)
    }
}

impl Stage<'_> {
    /// Its optimizer slots, whole: on a model axis each slot of a split variable's part
    /// (`w.tp/m`) gathered from the stage's model ranks along the part's dimension, as
    /// `w/m` (a collective: every model rank calls it at the same step).
    fn whole_slots(
        &mut self,
        mut slots: HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut keys: Vec<String> = slots.keys().cloned().collect();
        keys.sort();
        for key in keys {
            let Some((var, slot)) = key.rsplit_once('/') else {
                continue;
            };
            let Some((_, name, dim)) = self.split.iter().find(|(part, _, _)| part == var) else {
                continue;
            };
            let (name, dim) = (name.clone(), *dim);
            let Some(t) = slots.remove(&key) else {
                continue;
            };
            let w = self.hook.gather_model(t, dim, &format!("{name}/{slot}"))?;
            slots.insert(format!("{name}/{slot}"), w);
        }
        Ok(slots)
    }

    /// Its variables, whole: on a model axis, each split variable's parts gathered from
    /// the stage's model ranks (a collective: every model rank calls it at the same step).
    fn whole_params<B: Backend>(
        &mut self,
        backend: &mut B,
        params: &HashMap<String, B::Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut out = host_params(backend, params)?;
        for (part, name, dim) in &self.split {
            if let Some(t) = out.remove(part) {
                let w = self.hook.gather_model(t, *dim, name)?;
                out.insert(name.clone(), w);
            }
        }
        Ok(out)
    }
}

impl Stage<'_> {
    /// `mine` gathered over the pipe axis into stage 0, as a stage's parts are gathered
    /// over the model axis into its model rank 0: each other stage sends its own
    /// (`what`, for the messages of step `step`), stage 0 gets every stage's in stage
    /// order (its own first). Called by every stage of one model rank of replica 0.
    fn gather_over_stages(
        &mut self,
        step: usize,
        what: &str,
        mine: Vec<u8>,
    ) -> Result<Option<Vec<Vec<u8>>>> {
        let s = self.stage;
        if s != 0 {
            let label = format!("stage {s}, step {step}: the send of its {what} to stage 0");
            self.comm.set_label(&label);
            self.comm.send(0, mine)?;
            return Ok(None);
        }
        let mut all = vec![mine];
        for from in 1..self.run.mesh.pipe() {
            let label = format!("stage 0, step {step}: the receive of stage {from}'s {what}");
            self.comm.set_label(&label);
            all.push(self.comm.recv(from)?);
        }
        Ok(Some(all))
    }

    /// Replica 0's whole variables and optimizer state (`held`: this stage's, a slot
    /// named `VAR/SLOT`) in worker 0, with the carried ones: `(variables, slots)` there,
    /// `None` elsewhere. Called by every model rank 0 of replica 0 after `step`.
    fn gather_stages(
        &mut self,
        step: usize,
        held: HashMap<String, Tensor>,
    ) -> Result<Option<[HashMap<String, Tensor>; 2]>> {
        let Some(all) = self.gather_over_stages(step, "variables", encode_params(held))? else {
            return Ok(None);
        };
        let mut whole = HashMap::new();
        for (from, bytes) in all.iter().enumerate() {
            whole.extend(decode_params(bytes).map_err(|e| {
                malformed(
                    0,
                    from,
                    format!("stage {from}'s variables of step {step}: {e}"),
                )
            })?);
        }
        let (slots, params) = whole.into_iter().partition(|(k, _)| k.contains('/'));
        Ok(Some([self.run.with_carried(params), slots]))
    }

    /// The names replica 0's workers wrote into their shards of the state of `step`
    /// (`keys`, this worker's), gathered into worker 0 (over the model axis, then the
    /// pipe axis), which commits the state before it and writes this one's manifest.
    /// Called by every worker of replica 0 after the same step.
    fn gather_shard_keys(&mut self, step: usize, keys: Vec<String>) -> Result<()> {
        let what = "shard names";
        let decode = |me: usize, lanes: Vec<Vec<u8>>, over: &str| -> Result<Vec<String>> {
            let mut all = Vec::new();
            for (from, bytes) in lanes.iter().enumerate() {
                all.extend(serde_json::from_slice::<Vec<String>>(bytes).map_err(|e| {
                    malformed(
                        me,
                        from,
                        format!("{over} {from}'s {what} of step {step}: {e}"),
                    )
                })?);
            }
            Ok(all)
        };
        let encode = |keys: &[String]| serde_json::to_vec(keys).unwrap_or_default();
        let label = format!("step {step}: the {what} of the stage's model ranks");
        let lanes = self.hook.gather_model_bytes(encode(&keys), &label)?;
        let lane = decode(self.model_rank, lanes, "model rank")?;
        if self.model_rank != 0 {
            return Ok(());
        }
        match self.gather_over_stages(step, what, encode(&lane))? {
            Some(stages) => self.run.commit_shards(step, decode(0, stages, "stage")?),
            None => Ok(()),
        }
    }
}

impl Stage<'_> {
    /// An elastic run's copy of what it holds after `step` (`held`: its variables, the
    /// optimizer state of those it updates, and the carried ones), replacing its last;
    /// `held` is called only where the run keeps copies.
    fn keep(&self, held: impl FnOnce() -> HashMap<String, Tensor>, step: usize) {
        let Some((slot, saved_by)) = &self.snapshot else {
            return;
        };
        let copy = crate::run::snapshot::Copy {
            index: self.run.index(step, saved_by.clone()),
            tensors: Arc::new(held()),
        };
        slot.keep(self.worker, self.run.mesh.coord(self.worker), copy, false);
    }

    /// Writes this stage's shard of the state of `step` on its writer thread, once its
    /// previous shard is written (with `last`, before it returns): what it holds
    /// (`tensors`: its variables, their optimizer state, the carried ones) as it holds
    /// them (a part of a split variable as the part), each tensor by one worker alone
    /// (a tied variable by its owner, an unsplit one by model rank 0). Returns the
    /// names the shard holds.
    fn write_shard(
        &self,
        tensors: HashMap<String, Tensor>,
        step: usize,
        last: bool,
    ) -> Result<Vec<String>> {
        let Some(c) = (self.run.checkpoint.as_ref()).filter(|c| c.sharded && self.replica == 0)
        else {
            return Err(RuntimeError::internal(
                "checkpoint",
                format!(
                    "{} writes no shard: it is not in replica 0 of a sharded run",
                    self.name
                ),
            ));
        };
        let (s, m) = (self.stage, self.model_rank);
        // A tied variable is written by its owner alone.
        let owned = |k: &str| self.run.updates(s, k);
        let place = (self.worker, 0, m);
        start_shard(
            c,
            &self.run.layout,
            place,
            step as u64,
            tensors,
            owned,
            last,
        )
    }
}

/// Variables as one message (a tied variable's update, or a stage's variables).
pub(crate) fn encode_params(params: HashMap<String, Tensor>) -> Vec<u8> {
    let values: Vec<(String, Value)> = params
        .into_iter()
        .map(|(n, t)| (n, Value::Tensor(t)))
        .collect();
    encode_values(&values)
}

/// The variables of an [`encode_params`] message.
pub(crate) fn decode_params(bytes: &[u8]) -> std::result::Result<HashMap<String, Tensor>, String> {
    decode_values(bytes)?
        .into_iter()
        .map(|(n, v)| match v {
            Value::Tensor(t) => Ok((n, t)),
            v => Err(format!("`{n}` is {}, not a variable", v.value_type())),
        })
        .collect()
}

/// Bytes of the values held for micro-batches in flight.
fn held_bytes<B: Backend>(maps: &[HashMap<String, Message<B::Value>>]) -> u64 {
    maps.iter()
        .flat_map(|m| m.values())
        .map(|v| match v {
            Message::Host(v) => v.value_type().bytes() as u64,
            Message::Device(v) => B::value_bytes(v),
        })
        .sum()
}

/// The values of a message waiting to be sent, by tag.
type Outgoing<B> = Vec<(String, Message<<B as crate::core::backend::Device>::Value>)>;

/// A message's buffer name on the receiving device: one per value and micro-batch
/// (`from` the sending stage; a stash is its stage's own).
fn message_name(from: usize, tag: &str, micro: usize) -> String {
    format!("stage{from}:{tag}/micro{micro}")
}

impl<'a> Stage<'a> {
    /// Bytes the stage has moved: its messages, its collectives through the host, and
    /// its backends' collectives (NCCL's).
    fn bytes<B: Backend>(&mut self, fwd: &mut Executor<B>, bwd: &mut Executor<B>) -> ByteCount {
        self.comm.bytes()
            + self.hook.bytes()
            + fwd.backend().collective_bytes()
            + bwd.backend().collective_bytes()
    }

    /// Runs its steps in the one step loop with its schedule as the body, its kernels
    /// on the backends `make` creates (one for the forward program, one for the
    /// backward program and the update; they share the variables), handing each step's
    /// account to `report`. `make` gets the stage's communicator among its replicas
    /// (the pipeline's where it has none), for a device communicator's bootstrap.
    /// Messages between stages and the variables a stage hands over go through the
    /// host.
    pub(crate) fn run_on<B: Backend>(
        &mut self,
        make: &dyn Fn(Site<'_>, Links<'_>) -> Result<B>,
        config: &RunConfig,
        report: &mut dyn FnMut(StepReport) -> Result<()>,
    ) -> Result<WorkerOutcome> {
        let (forward, backward) = (self.forward, self.backward);
        let mut made = |program, beside| {
            let site = Site {
                worker: self.worker,
                program,
                beside,
            };
            make(site, self.hook.links().with(Axis::Pipe, &mut *self.comm))
        };
        // The forward runs beside the backward, on its device: the variables and the
        // batch are uploaded once, for both.
        let mut backward_backend = made(backward, Some(forward))?;
        let forward_backend = match backward_backend
            .beside(forward)
            .map_err(|e| backend_error(&backward_backend.name(), "adding the forward program", e))?
        {
            Some(b) => b,
            None => made(forward, None)?,
        };
        // Worker 0 evaluates the whole model on a backend of its own device.
        let evaluator = match self.held_out.take() {
            Some(data) => {
                let whole = self.run.whole;
                let backend = make(Site::of(self.worker, whole), Links::none())?;
                Some(self.run.evaluator(data, config, backend)?)
            }
            None => None,
        };
        self.hook.start(&self.name)?;
        let mut fwd = Executor::with_backend(self.forward, forward_backend)?;
        fwd.set_train_outputs(false);
        fwd.set_model_rank(self.model_rank);
        let mut bwd = Executor::with_backend(self.backward, backward_backend)?;
        bwd.set_model_rank(self.model_rank);
        let device = bwd.backend().name();
        let OnDevice { params, optimizer } =
            onto_device(bwd.backend(), config, std::mem::take(&mut self.start))?;
        let has_loss = self
            .forward
            .node_ids()
            .iter()
            .any(|id| matches!(self.forward.op(*id), Op::Loss));
        let last_bytes = self.bytes(&mut fwd, &mut bwd);
        let (first, cadence, t0) = (self.run.first, self.run.cadence, self.t0);
        let run = self.run;
        let work = run.samples_per_step * run.steps_to_run();
        let peak = if crate::core::peak::worth_measuring(run.flops_per_sample, work) {
            bwd.backend()
                .peak_flops(crate::core::peak::products_dtype(self.forward))
        } else {
            None
        };
        // CUDA graphs where the step has no host round trip: messages device to
        // device, every collective on NCCL, no clipping (a global norm over the
        // stages), no tied variable to exchange, no loss scale to move, and no
        // device clock (profiling times each node).
        let s = self.stage;
        let capturable = bwd.backend().sends_messages()
            && config.clip_norm.is_none()
            && !self
                .run
                .tied
                .iter()
                .any(|t| t.owner == s || t.holders.contains(&s))
            && !forward.scales_loss()
            && !backward.scales_loss()
            && !fwd.device_clock()
            && !bwd.device_clock()
            && fwd.can_capture()
            && bwd.can_capture();
        let graph = Capture::starting(capturable);
        let mut trace = StepTrace::default();
        let mut body = ScheduleStep {
            graph,
            peak,
            stage: &mut *self,
            fwd,
            bwd,
            params,
            optimizer,
            config,
            has_loss,
            device: device.clone(),
            spans: Vec::new(),
            last_bytes,
            evaluator,
            last_gathered: None,
        };
        let traced = body.stage.trace.then_some(&mut trace);
        run_steps(&mut body, first, cadence, traced, report)?;
        let ScheduleStep {
            mut bwd,
            params,
            mut spans,
            last_gathered,
            ..
        } = body;
        if self.trace {
            spans.extend(trace.spans(&self.name, t0));
        }
        // The trained variables, whole, into worker 0 (replicas hold the same): those
        // the last step gathered, else gathered now.
        let mut trained = HashMap::new();
        if let Some(gathered) = last_gathered {
            trained = gathered;
        } else if self.replica == 0 {
            let whole = self.whole_params(bwd.backend(), &params)?;
            if self.model_rank == 0 {
                if let Some([params, _]) = self.gather_stages(self.run.steps, whole)? {
                    trained = params;
                }
            }
        }
        // Worker 0 holds the whole model's variables, gathered over the pipe axis;
        // every other stage holds none.
        Ok(WorkerOutcome {
            params: trained,
            spans,
            ..WorkerOutcome::default()
        })
    }
}

/// A stage's step: its schedule's instructions (GPipe or 1F1B), then the update and
/// the tied variables' exchange.
struct ScheduleStep<'s, 'a, B: Backend> {
    stage: &'s mut Stage<'a>,
    fwd: Executor<B>,
    bwd: Executor<B>,
    params: HashMap<String, B::Tensor>,
    optimizer: B::Optimizer,
    config: &'s RunConfig,
    /// Whether its forward program holds the loss (the last stage's does).
    has_loss: bool,
    /// The backend's name, for its errors.
    device: String,
    /// Its device's peak, for model FLOPs utilisation.
    peak: Option<crate::core::peak::DevicePeak>,
    /// A span per computation, while tracing.
    spans: Vec<Span>,
    last_bytes: ByteCount,
    graph: StageGraph,
    /// Worker 0's evaluator of the whole model, when the run evaluates.
    evaluator: Option<Evaluator<'a, B>>,
    /// Where the run's last step gathered the whole model (to evaluate it or write
    /// it), at every stage of replica 0: the variables at worker 0, none elsewhere.
    /// They are the trained ones: no update comes after.
    last_gathered: Option<HashMap<String, Tensor>>,
}

/// Whether a stage's steps are a CUDA graph's replays: a stage's whole step (every
/// micro-batch's forward and backward in its schedule's order, its messages device to
/// device, and the update) is one graph; what it holds, measured while it was
/// recorded.
type StageGraph = Capture<MemoryByCategory>;

/// What a stage's step hands from its body to its report.
struct ScheduleRan {
    /// Seconds its forwards and backwards ran.
    busy: f64,
    /// Seconds it waited for its neighbours.
    waited: f64,
}

impl<B: Backend> StepBody for ScheduleStep<'_, '_, B> {
    type Detail = ScheduleRan;
    type Report = StepReport;

    fn learning_rate(&self) -> f64 {
        B::learning_rate(&self.optimizer, 0).unwrap_or_else(|| self.config.optimizer.lr())
    }

    fn run_step(&mut self, step: usize, _: Due) -> Result<Ran<ScheduleRan>> {
        let me = &mut *self.stage;
        me.rehearsal.at(step, me.run.first)?;
        // Each micro-batch in buffers of its own (the same every step, which a
        // replayed graph reads): all of a step's are live at once.
        let batches = me
            .data
            .iter_mut()
            .map(DataSource::next_batch)
            .collect::<Result<Vec<_>>>()?;
        let feeds = upload_micro_batches(self.fwd.backend(), batches, me.micro)?;
        let start = Instant::now();
        if let Some(memory) = self.graph.replayed() {
            return self.replay(step, start, memory);
        }
        let capturing =
            self.graph.captures_at(step, self.stage.run.first) && self.begin_capture(step)?;
        let ran = self.schedule(step, &feeds, start);
        if !capturing {
            return ran;
        }
        let memory = self.end_capture(step, ran)?;
        self.graph = Capture::Replaying(memory);
        self.replay(step, start, memory)
    }

    fn account(
        &mut self,
        step: usize,
        due: Due,
        ran: Ran<ScheduleRan>,
        timed: Timed,
        lr: f64,
    ) -> Result<StepReport> {
        let bytes = self.stage.bytes(&mut self.fwd, &mut self.bwd);
        let me = &mut *self.stage;
        let writes = due.shard && me.replica == 0;
        let shard = if writes || me.snapshot.is_some() {
            let mut held = host_params(self.bwd.backend(), &self.params)?;
            held.extend(me.updated_slots(self.bwd.backend(), &self.optimizer)?);
            // Stage 0's model rank 0 holds the variables no stage reads, and their
            // optimizer state, in its shard and its kept copy.
            if me.stage == 0 && me.model_rank == 0 {
                let run = me.run;
                held.extend(
                    run.carried
                        .iter()
                        .chain(&run.carried_slots)
                        .map(|(k, t)| (k.clone(), t.clone())),
                );
            }
            if writes {
                me.keep(|| held.clone(), step);
                Some(me.write_shard(held, step, due.last)?)
            } else {
                me.keep(|| held, step);
                None
            }
        } else {
            None
        };
        if let Some(keys) = shard {
            me.gather_shard_keys(step, keys)?;
        }
        let eval_start = Instant::now();
        let (eval, eval_failed) = self.gather_whole(step, due)?;
        let me = &mut *self.stage;
        // The other stages wait for worker 0's evaluation here, not in the next step,
        // where it would count as that step's time.
        let eval = if due.eval {
            me.comm
                .set_label(&format!("step {step}: the wait for the evaluation"));
            me.comm.barrier()?;
            me.hook.barrier_all(step as u64)?;
            me.hook.take_waited();
            eval.map(|e| EvalMetrics {
                eval_sec: eval_start.elapsed().as_secs_f64(),
                ..e
            })
        } else {
            eval
        };
        let report = StepReport {
            rank: me.worker,
            step,
            device: self.bwd.backend().describe(),
            loss: ran.loss.unwrap_or(f64::NAN),
            grad_norm: ran.grad_norm,
            step_sec: timed.seconds(),
            comm_wait_sec: ran.detail.waited,
            bytes_sent: bytes.sent - self.last_bytes.sent,
            bytes_received: bytes.received - self.last_bytes.received,
            bytes_moved: bytes.sent - self.last_bytes.sent,
            memory: ran.memory,
            lr: Some(lr),
            cuda_graph: self.graph.replaying(),
            peaks: self.peak.iter().cloned().collect(),
            stage: Some(StageAccount {
                stage: me.stage,
                replica: me.replica,
                model_rank: me.model_rank,
                busy_sec: ran.detail.busy,
                holds_loss: self.has_loss,
                messages_on_device: self.bwd.backend().sends_messages(),
                host_collectives: self.fwd.host_collectives() + self.bwd.host_collectives(),
            }),
            eval,
            eval_failed,
            ..StepReport::default()
        };
        // What the step's state and evaluation moved is not the step's traffic.
        self.last_bytes = if due.eval || due.file {
            self.stage.bytes(&mut self.fwd, &mut self.bwd)
        } else {
            bytes
        };
        Ok(report)
    }
}

impl<B: Backend> ScheduleStep<'_, '_, B> {
    /// After `step`, what it evaluates or writes whole: replica 0's variables (and at
    /// a checkpoint their optimizer state) gathered over the model axis, then the pipe
    /// axis, into worker 0, which writes the whole state and evaluates the model on
    /// its device. The evaluation at worker 0; none elsewhere.
    fn gather_whole(&mut self, step: usize, due: Due) -> Result<Evaluated> {
        let me = &mut *self.stage;
        if !(due.eval || due.writes_whole()) || me.replica != 0 {
            return Ok((None, None));
        }
        let mut held = me.whole_params(self.bwd.backend(), &self.params)?;
        if due.writes_whole() {
            let slots = me.updated_slots(self.bwd.backend(), &self.optimizer)?;
            held.extend(me.whole_slots(slots)?);
        }
        if due.last {
            self.last_gathered = Some(HashMap::new());
        }
        if me.model_rank != 0 {
            return Ok((None, None));
        }
        let Some([params, slots]) = me.gather_stages(step, held)? else {
            return Ok((None, None));
        };
        if due.writes_whole() {
            me.run.write_whole(step, &params, slots, due.last)?;
        }
        let evaluated = match self.evaluator.as_mut().filter(|_| due.eval) {
            Some(e) => settle(e.evaluate(&params, step as u64), due.last),
            None => Ok((None, None)),
        };
        if due.last {
            self.last_gathered = Some(params);
        }
        evaluated
    }

    /// Sets the step both programs' kernels see, before a capture or a replay.
    fn set_step(&mut self, step: usize) -> Result<()> {
        let device = self.device.as_str();
        for exec in [&mut self.fwd, &mut self.bwd] {
            exec.backend()
                .set_step(step as u64)
                .map_err(|e| backend_error(device, "setting the step", e))?;
        }
        Ok(())
    }

    /// Starts recording step `step` into a CUDA graph: the backward's backend begins
    /// the capture of the stream both programs run on, the forward's joins it
    /// (keeping its micro-batches' losses on the device). `false` where a backend
    /// declines: every step then runs eagerly.
    fn begin_capture(&mut self, step: usize) -> Result<bool> {
        self.set_step(step)?;
        let device = self.device.as_str();
        let fail = |what: &'static str| move |e| backend_error(device, what, e);
        let micro = self.stage.micro;
        let joined = self
            .fwd
            .backend()
            .join_capture(micro)
            .map_err(fail("joining the CUDA graph capture"))?;
        let began = joined
            && self
                .bwd
                .backend()
                .begin_capture(0)
                .map_err(fail("starting a CUDA graph capture"))?;
        if !began {
            if joined {
                self.fwd
                    .backend()
                    .leave_capture()
                    .map_err(fail("leaving the CUDA graph capture"))?;
            }
            self.graph = Capture::Off;
        }
        Ok(began)
    }

    /// Ends the capture of step `step`, whose recording `ran` says how it went: what
    /// the captured step holds, for the metrics of the replays.
    fn end_capture(
        &mut self,
        step: usize,
        ran: Result<Ran<ScheduleRan>>,
    ) -> Result<MemoryByCategory> {
        let device = self.device.clone();
        let left = self.fwd.backend().leave_capture();
        let ended = self.bwd.backend().end_capture();
        let ran = ran.map_err(|e| {
            let what = format!(
                "stage {}'s step {step} could not be captured into a CUDA graph",
                self.stage.stage
            );
            capture_failed(&device, what, e)
        })?;
        for (what, r) in [("leaving", left), ("ending", ended)] {
            r.map_err(|e| capture_failed(&device, format!("{what} the CUDA graph capture"), e))?;
        }
        Ok(ran.memory)
    }

    /// Step `step` as the replay of the captured one, on the micro-batches uploaded
    /// into the captured step's buffers. Its busy time is the replay's; what it waited
    /// for its neighbours within the replay cannot be told apart.
    fn replay(
        &mut self,
        step: usize,
        start: Instant,
        memory: MemoryByCategory,
    ) -> Result<Ran<ScheduleRan>> {
        self.set_step(step)?;
        let device = self.device.as_str();
        let fail = |what: &'static str| move |e| backend_error(device, what, e);
        let bwd = self.bwd.backend();
        bwd.replay()
            .map_err(fail("replaying the stage's CUDA graph"))?;
        bwd.pending_scalar()
            .map_err(fail("accounting for the replay"))?;
        let losses = self
            .fwd
            .backend()
            .replayed_scalars()
            .map_err(fail("reading the micro-batches' losses"))?;
        // A stage without the loss reads nothing back: its step ends when its replay
        // has run, not when it was issued.
        self.bwd
            .backend()
            .synchronize()
            .map_err(fail("finishing the step"))?;
        let busy = start.elapsed().as_secs_f64();
        let micro = self.stage.micro as f64;
        Ok(Ran {
            loss: self.has_loss.then(|| losses.iter().sum::<f64>() / micro),
            start,
            updating: Instant::now(),
            memory,
            grad_norm: None,
            detail: ScheduleRan { busy, waited: 0.0 },
        })
    }

    /// The schedule's instructions for step `step`, on `feeds` (one map a micro-batch),
    /// then the update and the tied variables' exchange: run, or recorded while the
    /// backends capture.
    fn schedule(
        &mut self,
        step: usize,
        feeds: &[HashMap<String, B::Tensor>],
        start: Instant,
    ) -> Result<Ran<ScheduleRan>> {
        let me = &mut *self.stage;
        let (fwd, bwd) = (&mut self.fwd, &mut self.bwd);
        let device = self.device.as_str();
        let fail = |what: &'static str| move |e| backend_error(device, what, e);
        let s = me.stage;
        let t0 = me.t0;
        let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
        let mut waited = 0.0;
        let mut busy = 0.0;
        // Per micro-batch: what its forward receives, what its backward receives (the
        // stash and the gradients), what waits to be sent, by stage. Through the host,
        // each run copies what it receives into its own buffers (on the CPU, moved);
        // device to device, received into buffers of their own, one per micro-batch.
        let on_device = bwd.backend().sends_messages();
        let mut fwd_in: Vec<HashMap<String, Message<B::Value>>> =
            (0..me.micro).map(|_| HashMap::new()).collect();
        let mut bwd_in: Vec<HashMap<String, Message<B::Value>>> =
            (0..me.micro).map(|_| HashMap::new()).collect();
        let mut outbox: HashMap<(usize, usize), Outgoing<B>> = HashMap::new();
        let mut loss = 0.0;
        let mut grads = Vec::new();
        let mut backwards = 0;
        let mut peak = MemoryByCategory::default();
        for op in me.steps {
            match *op {
                Step::Recv { from, what, micro } => {
                    let t = Instant::now();
                    // What an MPI rank's report names when the neighbour never comes.
                    let label = format!(
                        "stage {s}, step {step}: the receive of the {what} of micro-batch \
                         {micro} from stage {from}"
                    );
                    let values = if on_device {
                        let layout = me.messages.inbound.get(&(from, what));
                        let into: Vec<(String, TensorType)> = layout
                            .into_iter()
                            .flatten()
                            .map(|(tag, ty)| (message_name(from, tag, micro), ty.clone()))
                            .collect();
                        let got = bwd
                            .backend()
                            .recv_message(from, &into)
                            .map_err(|e| backend_error(device, &label, e))?;
                        layout
                            .into_iter()
                            .flatten()
                            .zip(got)
                            .map(|((tag, _), v)| (tag.clone(), Message::Device(v)))
                            .collect::<Vec<_>>()
                    } else {
                        me.comm.set_label(&label);
                        let bytes = me.comm.recv(from).map_err(|e| {
                            e.context(format_args!(
                                "step {step}: waiting for the {what} of micro-batch {micro} \
                                 from stage {from}"
                            ))
                        })?;
                        decode_values(&bytes)
                            .map_err(|e| {
                                malformed(
                                    s,
                                    from,
                                    format!(
                                        "step {step}: the {what} of micro-batch {micro} from \
                                         stage {from}: {e}"
                                    ),
                                )
                            })?
                            .into_iter()
                            .map(|(tag, v)| (tag, Message::Host(v)))
                            .collect()
                    };
                    waited += t.elapsed().as_secs_f64();
                    let into = match what {
                        Carried::Activation => &mut fwd_in[micro],
                        Carried::Gradient => &mut bwd_in[micro],
                    };
                    into.extend(values);
                }
                Step::Send { to, what, micro } => {
                    let label = format!(
                        "stage {s}, step {step}: the send of the {what} of micro-batch \
                         {micro} to stage {to}"
                    );
                    let mut values = outbox.remove(&(to, micro)).unwrap_or_default();
                    if on_device {
                        values.sort_by(|a, b| a.0.cmp(&b.0));
                        let expected = me.messages.outbound.get(&(to, what));
                        let sent: Vec<(String, TensorType)> = values
                            .iter()
                            .map(|(tag, v)| {
                                let ty = match v {
                                    Message::Device(v) => B::value_type(v),
                                    Message::Host(v) => v.value_type(),
                                };
                                (tag.clone(), ty.dense_type().clone())
                            })
                            .collect();
                        if expected.is_none_or(|e| *e != sent) {
                            return Err(RuntimeError::plan(format!(
                                "{label}: sends {sent:?}, stage {to} receives {expected:?}"
                            )));
                        }
                        let refs: Vec<&B::Value> = values
                            .iter()
                            .map(|(tag, v)| match v {
                                Message::Device(v) => Ok(v),
                                Message::Host(_) => Err(wrong_path(&label, tag, true)),
                            })
                            .collect::<Result<_>>()?;
                        bwd.backend()
                            .send_message(to, &refs)
                            .map_err(|e| backend_error(device, &label, e))?;
                    } else {
                        me.comm.set_label(&label);
                        let host: Vec<(String, Value)> = values
                            .into_iter()
                            .map(|(tag, v)| match v {
                                Message::Host(v) => Ok((tag, v)),
                                Message::Device(_) => Err(wrong_path(&label, &tag, false)),
                            })
                            .collect::<Result<_>>()?;
                        me.comm.send(to, encode_values(&host))?;
                    }
                }
                Step::Compute(action) => {
                    let began = Instant::now();
                    let (m, out, run, forward) = match action {
                        Action::Forward(m) => {
                            fwd.set_rank(me.replica * me.micro + m);
                            let mut received = std::mem::take(&mut fwd_in[m]);
                            let out = fwd.run_stage(
                                &feeds[m],
                                &self.params,
                                &mut received,
                                Mode::Train,
                                step as u64,
                                Some(&mut me.hook),
                            )?;
                            (m, out, fwd.measured_memory(), true)
                        }
                        Action::Backward(m) => {
                            bwd.set_rank(me.replica * me.micro + m);
                            backwards += 1;
                            let mode = if backwards == me.micro {
                                Mode::Train
                            } else {
                                Mode::Micro
                            };
                            let mut received = std::mem::take(&mut bwd_in[m]);
                            let out = bwd.run_stage(
                                &feeds[m],
                                &self.params,
                                &mut received,
                                mode,
                                step as u64,
                                Some(&mut me.hook),
                            )?;
                            (m, out, bwd.measured_memory(), false)
                        }
                    };
                    // The live stash and messages beside this run's own peak.
                    let held = held_bytes::<B>(&fwd_in) + held_bytes::<B>(&bwd_in);
                    peak.activations = peak.activations.max(run.activations + held);
                    peak.gradients = peak.gradients.max(run.gradients);
                    // The replicas' buckets, packed by the last backward.
                    peak.comm_buffers = peak.comm_buffers.max(run.comm_buffers);
                    loss += out.loss.unwrap_or(0.0);
                    for (to, tag, v) in out.sent {
                        let backend = if forward {
                            fwd.backend()
                        } else {
                            bwd.backend()
                        };
                        if to == s {
                            // The stash stays on the device, out of the next run's way.
                            let v = backend
                                .keep(&message_name(s, &tag, m), v)
                                .map_err(fail("keeping the stash"))?;
                            bwd_in[m].insert(tag, Message::Device(v));
                        } else {
                            // Device to device, sent before the next run reuses its
                            // memory (the send follows its computation in the program).
                            let v = if on_device {
                                Message::Device(v)
                            } else {
                                let v = backend.to_host(v).map_err(fail("sending a message"))?;
                                Message::Host(v)
                            };
                            outbox.entry((to, m)).or_default().push((tag, v));
                        }
                    }
                    // In the order this stage runs its micro-batches, as one device's
                    // accumulation moves them.
                    let backend = if forward {
                        fwd.backend()
                    } else {
                        bwd.backend()
                    };
                    assign_running(backend, &mut self.params, out.assigned)?;
                    if !out.grads.is_empty() {
                        grads = out.grads;
                    }
                    busy += began.elapsed().as_secs_f64();
                    if me.trace {
                        self.spans.push(Span {
                            track: me.name.clone(),
                            name: action.to_string(),
                            node: None,
                            types: None,
                            step: step as u64,
                            bytes: None,
                            start_us: us(began),
                            dur_us: began.elapsed().as_secs_f64() * 1e6,
                            counters: Vec::new(),
                            on_device: false,
                        });
                    }
                }
            }
        }
        let updating = Instant::now();
        let mut grads = grads;
        let mut grad_norm = None;
        if let Some(max) = self.config.clip_norm {
            grad_norm = Some(clip_gradients(
                bwd.backend(),
                &mut grads,
                max,
                |names, squares| me.global_norm(names, squares, step),
            )?);
        }
        bwd.backend()
            .update(&mut self.optimizer, &mut self.params, grads)
            .map_err(fail("applying the update"))?;
        let t = Instant::now();
        me.exchange_tied(step, bwd.backend(), &mut self.params)?;
        waited += t.elapsed().as_secs_f64();
        peak.params = self
            .params
            .values()
            .map(|t| B::tensor_type(t).bytes() as u64)
            .sum();
        peak.optimizer = B::optimizer_bytes(&self.optimizer);
        Ok(Ran {
            loss: self.has_loss.then_some(loss / me.micro as f64),
            start,
            updating,
            memory: peak,
            grad_norm,
            detail: ScheduleRan { busy, waited },
        })
    }
}

/// Stage `from` sent stage `me` what it cannot decode.
fn malformed(me: usize, from: usize, message: String) -> RuntimeError {
    RuntimeError::Peer {
        rank: me,
        peer: from,
        op: "recv".into(),
        kind: PeerKind::Malformed,
        message,
    }
}

/// A message value of the other kind than the stage's path (`on_device`: its messages
/// go device to device, and this one is on the host; else the reverse): refused,
/// never dropped.
fn wrong_path(label: &str, tag: &str, on_device: bool) -> RuntimeError {
    let (value, path) = if on_device {
        ("on the host", "device to device")
    } else {
        ("on the device", "through the host")
    };
    RuntimeError::plan(format!(
        "{label}: `{tag}` is a value {value}, and this stage's messages go {path}"
    ))
}
