//! Runtime errors. Each names what it is about: the node, the file, the variable.

use std::fmt;
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
    /// A setting does not fit the model or the machine: the plan's settings, a flag, a
    /// data source's options. The user changes the setting.
    #[error("{0}")]
    Config(String),
    /// A training state (a checkpoint, a resumed or handed-over state, initial weights)
    /// does not fit the model, or is damaged.
    #[error("{}{message}", path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default())]
    State {
        /// The file it came from, where it came from one.
        path: Option<PathBuf>,
        /// What does not fit.
        message: String,
    },
    /// The plan is inconsistent with itself: programs that disagree with each other or
    /// with its settings (a hand-edited plan, or a pass's bug the verifier missed).
    #[error("the plan: {0}")]
    Plan(String),
    /// The runtime broke one of its own invariants: a bug in distc, never a user's
    /// mistake.
    #[error("internal error at {at}: {message} (a bug in distc)")]
    Internal {
        /// Where: the node (`%N`), or the part of the runtime.
        at: String,
        /// What did not hold.
        message: String,
    },
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
        /// What the peer did: what decides whether this error is a cause or another
        /// rank's consequence.
        kind: PeerKind,
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
    /// The operating system refused what the run asked of it (a thread, with the
    /// machine's limit on threads reached).
    #[error("{what}: {source}")]
    Os {
        /// What the run asked for.
        what: String,
        /// The OS error.
        source: std::io::Error,
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
    /// The plan is inconsistent with itself: `message` says how.
    pub fn plan(message: impl Into<String>) -> RuntimeError {
        RuntimeError::Plan(message.into())
    }

    /// A training state from no file (a resumed or handed-over state in memory) that
    /// does not fit: `message` says how.
    pub fn state(message: impl Into<String>) -> RuntimeError {
        RuntimeError::State {
            path: None,
            message: message.into(),
        }
    }

    /// The runtime broke an invariant of its own at `at` (a node, a part of the
    /// runtime).
    pub fn internal(at: impl Into<String>, message: impl Into<String>) -> RuntimeError {
        RuntimeError::Internal {
            at: at.into(),
            message: message.into(),
        }
    }

    /// `self` with `what` (the operation that failed: "step 3: waiting for ...") said
    /// before its message, keeping its variant: a peer's hang-up wrapped in context is
    /// still a hang-up, and exits as one. Errors that stand alone are kept as they are.
    pub fn context(self, what: impl fmt::Display) -> RuntimeError {
        let with = |message: String| format!("{what}: {message}");
        match self {
            RuntimeError::Peer {
                rank,
                peer,
                op,
                kind,
                message,
            } => RuntimeError::Peer {
                rank,
                peer,
                op,
                kind,
                message: with(message),
            },
            RuntimeError::Config(m) => RuntimeError::Config(with(m)),
            RuntimeError::Plan(m) => RuntimeError::Plan(with(m)),
            RuntimeError::State { path, message } => RuntimeError::State {
                path,
                message: with(message),
            },
            RuntimeError::Internal { at, message } => RuntimeError::Internal {
                at,
                message: with(message),
            },
            RuntimeError::Data { path, message } => RuntimeError::Data {
                path,
                message: with(message),
            },
            RuntimeError::Kernel { node, op, message } => RuntimeError::Kernel {
                node,
                op,
                message: with(message),
            },
            RuntimeError::DeviceCall {
                device,
                what: call,
                message,
            } => RuntimeError::DeviceCall {
                device,
                what: with(call),
                message,
            },
            e => e,
        }
    }

    /// The same error again, for a second place that reports it (a rank's error
    /// recorded as the run's cause and returned to its own caller too, a client's
    /// later calls after it failed): every variant kept, so the copy exits, restarts
    /// and yields to a cause as the first does; a device's or the OS's own error is
    /// kept as its text.
    pub fn duplicate(&self) -> RuntimeError {
        use RuntimeError as E;
        let io = |e: &std::io::Error| std::io::Error::new(e.kind(), e.to_string());
        match self {
            E::Kernel { node, op, message } => E::Kernel {
                node: node.clone(),
                op,
                message: message.clone(),
            },
            E::Device { node, op, source } => E::Device {
                node: node.clone(),
                op,
                source: source.to_string().into(),
            },
            E::DeviceCall {
                device,
                what,
                message,
            } => E::DeviceCall {
                device: device.clone(),
                what: what.clone(),
                message: message.clone(),
            },
            E::Backend(e) => E::Backend(e.to_string().into()),
            E::MissingInput(n) => E::MissingInput(n.clone()),
            E::MissingParam(n) => E::MissingParam(n.clone()),
            E::Data { path, message } => E::Data {
                path: path.clone(),
                message: message.clone(),
            },
            E::Config(m) => E::Config(m.clone()),
            E::State { path, message } => E::State {
                path: path.clone(),
                message: message.clone(),
            },
            E::Plan(m) => E::Plan(m.clone()),
            E::Internal { at, message } => E::Internal {
                at: at.clone(),
                message: message.clone(),
            },
            E::Diverged { step, loss } => E::Diverged {
                step: *step,
                loss: *loss,
            },
            E::WorkerLost { step, cause } => E::WorkerLost {
                step: *step,
                cause: cause.clone(),
            },
            E::Interrupted(m) => E::Interrupted(m.clone()),
            E::Peer {
                rank,
                peer,
                op,
                kind,
                message,
            } => E::Peer {
                rank: *rank,
                peer: *peer,
                op: op.clone(),
                kind: *kind,
                message: message.clone(),
            },
            E::Rank { who, source } => E::Rank {
                who: who.clone(),
                source: Box::new(source.duplicate()),
            },
            E::Os { what, source } => E::Os {
                what: what.clone(),
                source: io(source),
            },
            E::Io { path, source } => E::Io {
                path: path.clone(),
                source: io(source),
            },
        }
    }

    /// A thread the run could not start: the OS's refusal.
    pub fn no_thread(what: impl Into<String>, source: std::io::Error) -> RuntimeError {
        RuntimeError::Os {
            what: format!("{}: cannot start", what.into()),
            source,
        }
    }

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

    /// What a peer did, where this error is a peer's: a hang-up is what a rank sees
    /// when another failed and closed its links, so never the cause where another rank
    /// has an error of its own.
    pub fn peer_kind(&self) -> Option<PeerKind> {
        match self.cause() {
            RuntimeError::Peer { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Whether this error lost a rank, as opposed to a mistake that would recur after
    /// a restart (a setting, a damaged state, a plan, a bug, a diverged loss): a
    /// worker's own loss, or a peer that hung up or did not answer. A peer that sent
    /// what the protocol does not allow runs another program: a restart would meet it
    /// again.
    pub fn lost_a_rank(&self) -> bool {
        match self.cause() {
            RuntimeError::WorkerLost { .. } => true,
            RuntimeError::Peer { kind, .. } => *kind != PeerKind::Malformed,
            _ => false,
        }
    }

    /// The process's exit status for this error: 130 for an interrupt (128 + SIGINT, as
    /// shells report a job stopped by Ctrl-C), [`WORKER_LOST_EXIT`] for a lost rank
    /// ([`RuntimeError::lost_a_rank`]), [`INTERNAL_EXIT`] for a bug in distc, 1 for every other failure.
    pub fn exit_code(&self) -> i32 {
        match self.cause() {
            _ if self.lost_a_rank() => WORKER_LOST_EXIT,
            RuntimeError::Interrupted(_) => 130,
            RuntimeError::Internal { .. } => INTERNAL_EXIT,
            _ => 1,
        }
    }
}

/// The status a process exits with when it stopped because a worker or a peer was
/// lost (EX_TEMPFAIL: started again without it, the run may succeed): what `distc
/// launch` restarts on.
pub const WORKER_LOST_EXIT: i32 = 75;

/// The status a process exits with after breaking one of its own invariants
/// (EX_SOFTWARE): a bug to report, not a run to retry or a setting to change.
pub const INTERNAL_EXIT: i32 = 70;

/// What a peer rank did to fail an operation that waited on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerKind {
    /// It closed its links: it failed (or stopped) on its own.
    HungUp,
    /// It did not answer within the timeout.
    TimedOut,
    /// It sent what the protocol does not allow (another op, a wrong size, another
    /// plan).
    Malformed,
}

/// Shorthand for runtime results.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
