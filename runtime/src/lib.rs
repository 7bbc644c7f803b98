//! The distc runtime: executes compiled plans. Depends on `distc-ir` only: the plan is
//! the contract with the compiler.
//!
//! # Layers
//!
//! The runtime is in layers that depend one way (a test, `tests/layers.rs`, reads every
//! file's imports and fails on an import against the arrows):
//!
//! ```text
//!           run      programs, roles, data, checkpoints on disk, memory accounting,
//!         /  |  \    the one worker loop, thread and MPI launchers, the launch entry
//!       ps   |  cuda   parameter servers | the CUDA backend (codegen, cuBLAS, NCCL)
//!       | \  |  / |
//!      cpu  comm  |    the CPU backend | the Communicator trait and its transports
//!         \  |   /
//!           core     values, config, errors, schedule, executor, backend families
//! ```
//!
//! | layer | owns | may import |
//! | --- | --- | --- |
//! | [`core`] | values, config, errors, the schedule and executor, the backend traits | — |
//! | [`cpu`] | the CPU backend: kernels, optimizers, allocator tuning | core |
//! | [`comm`] | the `Communicator` trait, in-process and MPI transports | core |
//! | [`cuda`] | the CUDA backend: libraries, NVRTC codegen, cuBLAS, memory plan, graphs, NCCL | core, comm |
//! | [`ps`] | parameter servers: state machine, wire format, client | core, cpu |
//! | [`run`] | everything that makes a training run out of the above | all |

pub mod comm;
pub mod core;
pub mod cpu;
pub mod cuda;
pub mod ps;
pub mod run;

pub use crate::core::config::{
    DataSpec, Decay, FieldSpec, LinearScaling, LrSchedule, Metric, OptimizerSpec, RunConfig,
};
pub use crate::core::error::{Result, RuntimeError};
pub use crate::core::value::{Slices, Tensor, Value};
