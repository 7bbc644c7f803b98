//! The distc runtime: executes compiled plans.
//!
//! Kernels (CPU), the graph executor, optimizers, data loaders, training loop,
//! metrics and checkpoints. Depends on `distc-ir` only: the plan is the contract.

pub mod config;
pub mod value;

pub use config::{DataSpec, OptimizerSpec, RunConfig};
pub use value::{Slices, Tensor, Value};
