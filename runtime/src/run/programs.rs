//! What a run is, below every role and transport: the plan's programs, the run's
//! options, what training produced, and what every role derives from the programs
//! alone (initial values, input shapes, server shards, a worker's data).

use crate::core::checkpoint::TrainingState;
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::init::init_param;
use crate::core::value::Tensor;
use crate::ps::{self, PsSync, ShardSpec};
use crate::run::data::{check_model, data_dir, DataSource};
use crate::run::mesh::Mesh;
use crate::run::metrics::{EvalMetrics, Profile};
use crate::run::trace::Span;
use distc_ir::pipeline::PipelineProgram;
use distc_ir::{Graph, Op, TensorType};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use crate::comm::Links;
pub use crate::core::backend::Site;
pub use crate::run::snapshot::StateSlot;

/// The programs of a plan: the SPMD worker program (the one-device graph for one
/// device), the workers' init program and one program per parameter server.
#[derive(Clone, Copy, Debug)]
pub struct Programs<'g> {
    /// The worker program.
    pub worker: &'g Graph,
    /// Broadcasts replicated variables from rank 0, if any.
    pub init: Option<&'g Graph>,
    /// One per parameter server.
    pub servers: &'g [Graph],
    /// Gathers whole variables from the workers' shards after the last step (ZeRO).
    pub finalize: Option<&'g Graph>,
    /// Workers N.
    pub workers: usize,
    /// The stages' programs and schedule of a pipelined plan (`--pipeline`); `worker`
    /// is then the one-device graph they were cut from.
    pub pipeline: Option<&'g PipelineProgram>,
}

impl<'g> Programs<'g> {
    /// One device: the graph alone.
    pub fn single(graph: &'g Graph) -> Programs<'g> {
        Programs {
            worker: graph,
            init: None,
            servers: &[],
            finalize: None,
            workers: 1,
            pipeline: None,
        }
    }

    /// Micro-batches per step: a pipeline's, or the worker program's accumulation.
    pub fn micro_batches(&self) -> usize {
        match self.pipeline {
            Some(p) => p.micro_batches,
            None => micro_batches(self.worker),
        }
    }
}

/// Options of a run that are not part of the plan.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// Overrides the plan's step count.
    pub steps: Option<usize>,
    /// Data directory (else `DISTC_DATA`).
    pub data_dir: Option<PathBuf>,
    /// Synthetic sources slice one global stream (see `DataSource::open_global`), so
    /// N workers of batch b see what one device of batch N*b sees. Synchronous plans
    /// and verification use it; asynchronous ones seed worker r with seed + r.
    pub global_data: bool,
    /// Draw every step's batch before the first step (see [`DataSource::preload`]).
    pub preload: bool,
    /// Time every kernel, the optimizer and the waits of worker 0 (see [`Profile`]).
    pub profile: bool,
    /// Record spans for a Chrome trace.
    pub trace: bool,
    /// Evaluate on the held-out data after the last step (and every `eval_every`
    /// steps); off, a run needs no evaluation data (`distc verify` compares weights).
    pub evaluate: bool,
    /// Parameter-server synchronisation.
    pub sync: PsSync,
    /// Bound on any wait for a collective or a server's answer.
    pub timeout: Duration,
    /// Write the training state every so many steps (worker 0 writes it).
    pub checkpoint: Option<CheckpointEvery>,
    /// Continue from this state: its variables, optimizer state, step and data
    /// position replace the initial ones.
    pub resume: Option<Arc<TrainingState>>,
    /// The model's forward and backward FLOPs per sample, as the compiler counted
    /// them, for the metrics' model FLOPs and utilisation (`None`: not reported).
    pub flops_per_sample: Option<f64>,
    /// Each worker keeps what it holds after every step in memory, each copy replacing
    /// the last: an elastic run restarts from the survivors' copies when a worker is
    /// lost.
    pub snapshot: Option<StateSlot>,
    /// A failure to rehearse: a worker lost at the start of a step.
    pub fail: Option<InjectedFailure>,
}

/// Worker `worker` is lost at the start of step `step` (`--fail-worker W:K`): its
/// thread ends with [`crate::RuntimeError::WorkerLost`], as a crashed worker would.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InjectedFailure {
    /// The worker (its rank).
    pub worker: usize,
    /// The step it is lost at.
    pub step: usize,
}

/// Where and how often a run writes its [`TrainingState`].
#[derive(Clone, Debug)]
pub struct CheckpointEvery {
    /// The file (rewritten atomically each time), or with `sharded` the folder.
    pub path: PathBuf,
    /// Every this many steps (at least 1).
    pub every: usize,
    /// What trains, for the index: strategy, workers, ZeRO stage.
    pub saved_by: String,
    /// Each worker writes its own shard into the folder `path`
    /// ([`crate::core::shards`]), instead of worker 0 writing the whole state.
    pub sharded: bool,
    /// Writes the states while training goes on.
    writer: crate::core::checkpoint::StateWriter,
    /// Sharded: each worker's writer (the threads of this process), and the step of
    /// the state written but not yet committed (worker 0's).
    shards: Arc<std::sync::Mutex<ShardWrites>>,
}

#[derive(Debug, Default)]
struct ShardWrites {
    writers: HashMap<usize, crate::core::checkpoint::StateWriter>,
    pending: Option<u64>,
}

impl CheckpointEvery {
    /// States written to `path` every `every` steps and after the last, their index
    /// saying `saved_by`.
    pub fn new(path: PathBuf, every: usize, saved_by: String) -> CheckpointEvery {
        CheckpointEvery {
            path,
            every,
            saved_by,
            sharded: false,
            writer: Default::default(),
            shards: Default::default(),
        }
    }

    /// The same, each worker writing its own shard into the folder `path`.
    pub fn sharded(self) -> CheckpointEvery {
        CheckpointEvery {
            sharded: true,
            ..self
        }
    }

    /// Writes `state` while training goes on (the previous write done first); the
    /// run's last state (`last`) is on disk when this returns.
    pub(crate) fn write(&self, state: Arc<TrainingState>, last: bool) -> Result<()> {
        self.writer.write(self.path.clone(), state, last)
    }

    /// Worker `rank`'s writer of its shards.
    pub(crate) fn shard_writer(&self, rank: usize) -> crate::core::checkpoint::StateWriter {
        let mut s = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        s.writers.entry(rank).or_default().clone()
    }

    /// Marks the state of `step` written by every worker once they all say so: the
    /// one before it, if any, is committed first (`None`: commits the pending one).
    pub(crate) fn commit_pending(&self, then: Option<u64>) -> Result<()> {
        let mut s = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(step) = s.pending.take() {
            crate::core::shards::commit(&self.path, step)?;
        }
        s.pending = then;
        Ok(())
    }

    /// Forgets the state written but not committed, after a run that stopped short
    /// (an elastic restart): a lost worker may not have written its shard.
    pub fn abandon_pending(&self) {
        let mut s = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        for w in s.writers.values() {
            let _ = w.wait();
        }
        s.writers.clear();
        s.pending = None;
    }

    /// Waits for the state being written, if any: once a step's metrics line is out,
    /// its state (where the step wrote one) is on disk when this returns.
    pub fn written(&self) -> Result<()> {
        let writers: Vec<_> = {
            let s = self.shards.lock().unwrap_or_else(|p| p.into_inner());
            s.writers.values().cloned().collect()
        };
        for w in writers {
            w.wait()?;
        }
        self.writer.wait()
    }
}

impl TrainOptions {
    /// What a training state's index says wrote it: the checkpoint's words, or the
    /// elastic run's.
    pub(crate) fn saved_by(&self) -> String {
        match (&self.checkpoint, &self.snapshot) {
            (Some(c), _) => c.saved_by.clone(),
            (None, Some(s)) => s.saved_by.clone(),
            (None, None) => String::new(),
        }
    }
}

impl Default for TrainOptions {
    fn default() -> TrainOptions {
        TrainOptions {
            steps: None,
            data_dir: None,
            global_data: false,
            preload: false,
            profile: false,
            trace: false,
            evaluate: true,
            sync: PsSync::Sync,
            timeout: ps::DEFAULT_TIMEOUT,
            checkpoint: None,
            resume: None,
            flops_per_sample: None,
            snapshot: None,
            fail: None,
        }
    }
}

/// What training produced.
#[derive(Debug)]
pub struct TrainReport {
    /// Steps run.
    pub steps: usize,
    /// Loss of the first step (mean over workers).
    pub first_loss: f64,
    /// Loss of the last step (mean over workers).
    pub final_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalMetrics>,
    /// Wall time of the training steps (the slowest worker's, summed; evaluation and
    /// data loading excluded).
    pub train_time: Duration,
    /// Global samples per second over all steps.
    pub samples_per_sec: f64,
    /// Every variable after training: replicated ones from worker 0, server-held ones
    /// reassembled from their shards.
    pub params: HashMap<String, Tensor>,
    /// Where worker 0's step time went, when asked for.
    pub profile: Option<Profile>,
    /// Trace spans, when asked for.
    pub spans: Vec<Span>,
    /// The mean measured bubble of a pipelined run's steps.
    pub pipeline_bubble: Option<f64>,
    /// The model's FLOPs per second over all steps, where the plan counted them.
    pub model_flops_per_sec: Option<f64>,
    /// Model FLOPs utilisation over all steps, the devices' summed peak it is against
    /// (FLOP/s) and where that figure comes from.
    pub mfu: Option<(f64, f64, String)>,
}

/// Initial values of every variable of `graph`, from the seed.
pub fn init_params(graph: &Graph, seed: u64) -> HashMap<String, Tensor> {
    graph
        .topo_order()
        .into_iter()
        .filter_map(|id| match graph.op(id) {
            Op::Param { name, ty, init, .. } => {
                Some((name.clone(), init_param(name, ty, init, seed)))
            }
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

/// Shards of every server program: `shard` sources, by server.
pub fn server_shards(
    servers: &[Graph],
    full: &HashMap<String, TensorType>,
) -> Result<Vec<Vec<ShardSpec>>> {
    servers
        .iter()
        .map(|g| {
            g.topo_order()
                .into_iter()
                .filter_map(|id| match g.op(id) {
                    Op::Shard {
                        var,
                        start,
                        end,
                        init,
                        ..
                    } => Some((var.clone(), *start, *end, init.clone())),
                    _ => None,
                })
                .map(|(var, start, end, init)| {
                    let full = full.get(&var).cloned().ok_or_else(|| {
                        RuntimeError::Config(format!(
                            "server program holds `{var}`, which no worker reads"
                        ))
                    })?;
                    Ok(ShardSpec {
                        var,
                        full,
                        init,
                        start,
                        end,
                    })
                })
                .collect()
        })
        .collect()
}

/// The full type of every server-held variable, from the worker program's pulls.
pub fn pulled_types(worker: &Graph) -> HashMap<String, TensorType> {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::Pull { var, ty, .. } => Some((var.clone(), ty.clone())),
            Op::SparsePull { var, table, .. } => Some((var.clone(), table.clone())),
            _ => None,
        })
        .collect()
}

/// Micro-batches per step of a worker program (gradient accumulation; 1 without).
pub fn micro_batches(worker: &Graph) -> usize {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::Accumulate { micro } => Some(*micro),
            _ => None,
        })
        .max()
        .unwrap_or(1)
}

/// Opens worker `rank`'s data (its shard of the plan's source), preloaded if asked:
/// one source per micro-batch, micro-batch `m` of worker `r` being part `r*K + m` of
/// the `N*K` parts of the global batch.
pub fn open_data(
    programs: &Programs<'_>,
    mesh: &Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    rank: usize,
) -> Result<Vec<DataSource>> {
    let dir = data_dir(opts.data_dir.as_deref());
    let open = if opts.global_data {
        DataSource::open_global
    } else {
        DataSource::open
    };
    let k = programs.micro_batches();
    // A model axis's workers read the same batch: the data is split over replicas.
    let (rank, workers) = (mesh.coord(rank).replica, mesh.data);
    (0..k)
        .map(|m| {
            let mut source = open(
                &config.data,
                dir.as_deref(),
                &input_types(programs.worker),
                config.batch,
                config.seed,
                rank * k + m,
                workers * k,
            )?;
            if m == 0 && config.data.needs_files() {
                // File sources know their id ranges (a vocabulary) only once read;
                // synthetic sources' were checked with the settings at launch.
                let info = source.info();
                let bounds: Vec<(&str, usize)> = info
                    .id_bounds
                    .iter()
                    .map(|(f, b)| (f.as_str(), *b))
                    .collect();
                check_model(programs.worker, &config.data, config.batch, &bounds)?;
            }
            let mut steps = opts.steps.unwrap_or(config.steps);
            if let Some(state) = &opts.resume {
                source.skip_samples(state.index.samples)?;
                steps = steps.saturating_sub(state.index.step as usize);
            }
            if opts.preload {
                source.preload(steps)?;
            }
            Ok(source)
        })
        .collect()
}

/// What every rank of an MPI run is told beyond the programs and options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MpiRun {
    /// The plan's hash, compared across ranks at start-up.
    pub plan_hash: String,
    /// Parameter servers S.
    pub servers: usize,
    /// The global metrics file (rank 0); every worker also writes its own lines to this
    /// path with `.rankR` before the extension.
    pub metrics: Option<PathBuf>,
    /// Where each rank writes its own spans (`.rankR` inserted), when tracing.
    pub trace: Option<PathBuf>,
    /// The command to suggest when started outside `mpirun` (the `-np` is added).
    pub command: String,
}

/// The variables a plan holds without training them (`frozen` in the DSL): no
/// gradient, no optimizer state.
pub fn frozen_variables(programs: &Programs<'_>) -> std::collections::BTreeSet<String> {
    let mut out = programs.worker.frozen_params();
    for g in programs.init.into_iter().chain(programs.servers) {
        out.extend(g.frozen_params());
    }
    if let Some(p) = programs.pipeline {
        for st in &p.stages {
            out.extend(st.forward.frozen_params());
            out.extend(st.backward.frozen_params());
        }
    }
    out
}

/// What `--init` found, for people: the variables set from the file, and the names
/// on either side without a match.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InitReport {
    /// Variables the file set.
    pub set: Vec<String>,
    /// Variables of the model the file lacks (they keep the model's initializer).
    pub missing: Vec<String>,
    /// Tensors of the file no variable of the model is named.
    pub unused: Vec<String>,
}

/// Every variable of a plan, whole, with its initial value from the seed: the worker
/// program's own (not a ZeRO chunk), the init program's (the whole values it cuts into
/// shards and model-axis parts), and the servers' (whole types from the workers'
/// pulls). Sorted by name.
pub fn whole_variables(programs: &Programs<'_>, seed: u64) -> Result<Vec<(String, Tensor)>> {
    let mut out: HashMap<String, Tensor> = HashMap::new();
    for g in std::iter::once(programs.worker).chain(programs.init) {
        for (name, t) in init_params(g, seed) {
            if !name.ends_with(distc_ir::ZERO_SHARD_SUFFIX) {
                out.insert(name, t);
            }
        }
    }
    for shards in server_shards(programs.servers, &pulled_types(programs.worker))? {
        for sp in shards {
            out.entry(sp.var.clone())
                .or_insert_with(|| init_param(&sp.var, &sp.full, &sp.init, seed));
        }
    }
    let mut v: Vec<(String, Tensor)> = out.into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

/// The training state a run starts from when its initial weights come from a file
/// (`--init`): step 0, the data at its start, each variable of the plan (whole, as
/// [`whole_variables`] finds them) from `weights` by name and shape, fresh optimizer
/// state (zero slots, which is what every optimizer starts from). A variable the file
/// lacks is an error unless `partial`, when it keeps its initializer; a tensor of the
/// file that no variable is named is an error unless `partial`. Every layout starts
/// from such a state as it resumes one, so the same weights reach every worker,
/// stage, shard and server.
pub fn state_from_weights(
    programs: &Programs<'_>,
    config: &RunConfig,
    weights: &HashMap<String, Tensor>,
    partial: bool,
) -> Result<(TrainingState, InitReport)> {
    use crate::core::checkpoint::{StateIndex, STEP_KEY};
    let whole = whole_variables(programs, config.seed)?;
    let variables: Vec<(String, TensorType)> = whole
        .iter()
        .map(|(n, t)| (n.clone(), t.tensor_type()))
        .collect();
    let mut params: HashMap<String, Tensor> = whole.into_iter().collect();
    let mut report = InitReport::default();
    for (name, ty) in &variables {
        match weights.get(name) {
            Some(t) if t.shape() == ty.dims() => {
                let t = t.cast(ty.dtype).ok_or_else(|| {
                    RuntimeError::Config(format!(
                        "`{name}` is {:?} in the file; the model's `{name}` is {ty}",
                        t.dtype()
                    ))
                })?;
                params.insert(name.clone(), t);
                report.set.push(name.clone());
            }
            Some(t) => {
                return Err(RuntimeError::Config(format!(
                    "`{name}` has shape {:?} in the file; the model's `{name}` is {ty}",
                    t.shape()
                )))
            }
            None => report.missing.push(name.clone()),
        }
    }
    report.unused = weights
        .keys()
        .filter(|k| !variables.iter().any(|(n, _)| n == *k))
        .cloned()
        .collect();
    report.unused.sort();
    let all_named = report.missing.is_empty() && report.unused.is_empty();
    if !partial && !all_named {
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".into()
            } else {
                v.join(", ")
            }
        };
        return Err(RuntimeError::Config(format!(
            "the file and the model do not name the same variables: the model's {} \
             are not in the file, and the file's {} are not the model's (--init-partial \
             keeps the model's initializer for the first and ignores the second)",
            list(&report.missing),
            list(&report.unused)
        )));
    }
    let slots = crate::cpu::optim::Optimizer::new(&config.optimizer).slot_names();
    let frozen = frozen_variables(programs);
    let mut optimizer: HashMap<String, Tensor> = HashMap::new();
    for (name, ty) in variables.iter().filter(|(n, _)| !frozen.contains(n)) {
        for slot in slots {
            optimizer.insert(format!("{name}/{slot}"), Tensor::zeros(ty));
        }
    }
    optimizer.insert(
        STEP_KEY.to_string(),
        Tensor::F64(ndarray::arr0(0.0).into_dyn()),
    );
    let index = StateIndex {
        format: "distc-training-state".into(),
        model: programs.worker.name.clone(),
        step: 0,
        samples: 0,
        saved_by: "--init".into(),
        optimizer: format!("{:?}", config.optimizer),
        variables: variables.iter().map(|(n, _)| n.clone()).collect(),
        optimizer_state: {
            let mut k: Vec<String> = optimizer.keys().cloned().collect();
            k.sort();
            k
        },
    };
    Ok((
        TrainingState {
            index,
            params,
            optimizer,
        },
        report,
    ))
}
