//! The distc runtime: executes compiled plans.
//!
//! Kernels (CPU), the graph executor, optimizers, data loaders, training loop,
//! metrics and checkpoints. Depends on `distc-ir` only: the plan is the contract.

pub mod arena;
pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod cuda;
pub mod data;
pub mod device;
pub mod error;
pub mod exec;
pub mod init;
pub mod kernels;
pub mod memory;
pub mod metrics;
pub mod optim;
pub mod output;
pub mod ps;
pub mod roles;
pub mod trace;
pub mod train;
pub mod value;
pub mod worker;

pub use config::{DataSpec, OptimizerSpec, RunConfig};
pub use error::{Result, RuntimeError};
pub use value::{Slices, Tensor, Value};
