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
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Shorthand for runtime results.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
