//! The core: what every device, transport and role shares, and nothing that knows any
//! of them.
//!
//! - [`value`]: host tensors, `IndexedSlices`, byte counts.
//! - [`config`]: a run's settings from the plan (data source, optimizer, batch, steps).
//! - [`error`]: [`error::RuntimeError`]; a device's own errors arrive boxed.
//! - [`schedule`]: the schedule (order, slots, plans with last uses) and the memory
//!   rule that predicts and measures a step's peak ([`schedule::MemoryUse`]).
//! - [`exec`]: the executor that runs a schedule over any [`backend::Backend`].
//! - [`backend`]: the backend families (kernels, transfer, optimizer state, capture,
//!   device collectives).
//! - [`arena`]: the static memory plan a device backend lays its buffers out by.
//! - [`geom`]: convolution geometry, shared by the CPU kernels and CUDA codegen.
//! - [`init`]: seeded variable initialisers.
//! - [`peak`]: devices' peak arithmetic rates, for model FLOPs utilisation.
//! - [`roles`]: the documented mapping from a rank to its role (worker or server).
//! - [`checkpoint`] and [`output`]: the training-state format on disk and atomic writes;
//!   [`shards`]: a state written as one shard a worker.
//!
//! Depends on `distc-ir` only. The CPU backend (`crate::cpu`), the CUDA backend
//! (`crate::cuda`), communication (`crate::comm`), parameter servers (`crate::ps`) and
//! the run layer (`crate::run`) depend on it, never the other way; a test
//! (`runtime/tests/layers.rs`) holds every file to that.

pub mod arena;
pub mod axis;
pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod exec;
pub mod geom;
pub mod init;
pub mod output;
pub mod peak;
pub mod planted;
pub mod roles;
pub mod schedule;
pub mod shards;
pub mod value;
