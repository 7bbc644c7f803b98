//! Runtime errors. Each names what it is about: the node, the file, the variable.

use std::path::PathBuf;
use thiserror::Error;

/// What can go wrong while running a plan.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// A kernel rejected its inputs (a bug in a pass, or a hand-edited plan).
    #[error("{node} ({op}): {message}")]
    Kernel {
        /// The node, as `%N`.
        node: String,
        /// The op's mnemonic.
        op: &'static str,
        /// What went wrong.
        message: String,
    },
    /// The device failed while running a node (a driver call, a kernel launch).
    #[error("{node} ({op}) on the device: {source}")]
    Device {
        /// The node, as `%N`.
        node: String,
        /// The op's mnemonic.
        op: &'static str,
        /// The device's own error (a driver call, a kernel compiler), boxed: the core
        /// knows no device's error type.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The device failed outside a node: creating the optimizer, an update, a copy, a
    /// CUDA graph's replay.
    #[error("{device}: {what}: {message}")]
    DeviceCall {
        /// The backend's name (`cpu`, `cuda:0`).
        device: String,
        /// What it was doing.
        what: String,
        /// Its own error's text.
        message: String,
    },
    /// A device could not be set up (a missing library, no GPU, a kernel that does not
    /// compile): the device's own error, boxed.
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
    /// The graph reads an input the feed does not provide.
    #[error("no value fed for input `{0}`")]
    MissingInput(String),
    /// The graph reads a variable the store does not hold.
    #[error("no value for variable `{0}`")]
    MissingParam(String),
    /// A data file is missing or malformed.
    #[error("{path}: {message}")]
    Data {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The configuration does not fit the model.
    #[error("{0}")]
    Config(String),
    /// The loss became NaN or infinite: training stops at that step.
    #[error("the loss became {loss} at step {step}: lower the learning rate")]
    Diverged {
        /// The step whose loss it was.
        step: usize,
        /// The loss.
        loss: f64,
    },
    /// A worker was lost at a step: it failed as a crashed process would (an injected
    /// failure rehearses it). An elastic run carries on without it.
    #[error("lost at step {step}: {cause}")]
    WorkerLost {
        /// The step it was lost at.
        step: usize,
        /// Why.
        cause: String,
    },
    /// The user stopped the run (Ctrl-C): the text says what was kept.
    #[error("{0}")]
    Interrupted(String),
    /// Another rank hung up, sent what the protocol does not allow, or did not answer
    /// within the timeout.
    #[error("rank {rank}: {message}")]
    Peer {
        /// This rank, on the communicator that saw it.
        rank: usize,
        /// The rank that failed or did not answer.
        peer: usize,
        /// The operation that waited on it (`all_reduce`, `recv`, ...).
        op: String,
        /// What happened.
        message: String,
    },
    /// A rank's error, named by its place in the run (`worker 3`, `stage 1 of replica
    /// 0`, `server 0`): the error keeps its kind, so the exit code follows the cause.
    #[error("{who}: {source}")]
    Rank {
        /// The rank's name on the mesh.
        who: String,
        /// Its error.
        source: Box<RuntimeError>,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

impl RuntimeError {
    /// `self` as the error of the rank named `who`, unless it names one already.
    pub fn of_rank(self, who: impl Into<String>) -> RuntimeError {
        match self {
            e @ RuntimeError::Rank { .. } => e,
            e => RuntimeError::Rank {
                who: who.into(),
                source: Box::new(e),
            },
        }
    }

    /// The error under any rank naming: what decides what the caller does.
    pub fn cause(&self) -> &RuntimeError {
        match self {
            RuntimeError::Rank { source, .. } => source.cause(),
            e => e,
        }
    }

    /// Whether this is a peer hanging up: what a rank sees when another failed and
    /// closed its links, so never the cause where another rank has an error of its own.
    pub fn is_hang_up(&self) -> bool {
        matches!(self.cause(), RuntimeError::Peer { message, .. } if message.contains("hung up"))
    }

    /// The process's exit status for this error: 130 for an interrupt (128 + SIGINT, as
    /// shells report a job stopped by Ctrl-C), [`WORKER_LOST_EXIT`] for a lost worker or
    /// peer, 1 for every other failure.
    pub fn exit_code(&self) -> i32 {
        match self.cause() {
            RuntimeError::Interrupted(_) => 130,
            RuntimeError::WorkerLost { .. } | RuntimeError::Peer { .. } => WORKER_LOST_EXIT,
            _ => 1,
        }
    }
}

/// The status a process exits with when it stopped because a worker or a peer was
/// lost (EX_TEMPFAIL: started again without it, the run may succeed): what `distc
/// launch` restarts on.
pub const WORKER_LOST_EXIT: i32 = 75;

/// Shorthand for runtime results.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
