//! The run layer: what makes a training run out of the layers below.
//!
//! - [`mesh`]: the plan's ranks arranged as data x pipe x model (plus servers), made
//!   once from the plan; the one place a rank becomes a coordinate and a name.
//! - [`launch`]: the one entry the CLI calls with a loaded plan and its options; it
//!   decides device, transport and roles.
//! - [`train`]: the plan's programs, run options, the [`train::TrainReport`], and the
//!   in-process launcher (ranks as threads) with the coordinator that joins the
//!   workers' step reports into metrics lines.
//! - [`worker`]: the one training loop, for every device, role and transport; a CUDA
//!   graph's capture and replay is a mode of it.
//! - [`mpi`] (feature `mpi`): the MPI launcher, one rank per process, with the same
//!   loop and coordinator.
//! - [`pipeline`]: a pipelined plan's stages as threads, each walking its schedule.
//! - [`data`]: data sources; [`memory`]: memory
//!   accounting; [`metrics`] and [`trace`]: what a run reports.

pub mod data;
pub mod launch;
pub mod memory;
pub mod mesh;
pub mod metrics;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod pipeline;
pub mod trace;
pub mod train;
pub mod worker;
