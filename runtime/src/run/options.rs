//! A run's options that are not part of the plan: steps, data, checkpoints, the
//! state to resume, an elastic run's copies, a failure to rehearse, and what every
//! MPI rank is told.

use crate::core::checkpoint::TrainingState;
use crate::core::config::RunConfig;
use crate::core::error::Result;
use crate::ps::{self, PsSync};
use crate::run::snapshot::StateSlot;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

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
    /// The tokens a sample predicts (a language model's window), for the metrics'
    /// tokens per second (`None`: not a token model).
    pub tokens_per_sample: Option<usize>,
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
    /// What names this run in a sharded state's manifest and shards: drawn once per
    /// process, and an MPI job's ranks take rank 0's at start-up.
    run: Arc<std::sync::atomic::AtomicU64>,
}

/// A number no other run draws: the standard library's randomly keyed hasher over
/// this process and the time.
fn random_run() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new()
        .hash_one((std::process::id(), std::time::SystemTime::now()))
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
            run: Arc::new(random_run().into()),
        }
    }

    /// This run's name in a sharded state.
    pub(crate) fn run_id(&self) -> String {
        format!("{:016x}", self.run_number())
    }

    /// See [`CheckpointEvery::run_id`].
    pub(crate) fn run_number(&self) -> u64 {
        self.run.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Takes `run` as this run's name (an MPI job's rank 0's).
    pub(crate) fn agree_run(&self, run: u64) {
        self.run.store(run, std::sync::atomic::Ordering::SeqCst);
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
    /// The run's last step: `--steps`, else the train block's.
    pub(crate) fn last_step(&self, config: &RunConfig) -> usize {
        self.steps.unwrap_or(config.steps)
    }

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
            tokens_per_sample: None,
            snapshot: None,
            fail: None,
        }
    }
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
