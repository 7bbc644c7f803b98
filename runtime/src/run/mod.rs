//! The run layer: what makes a training run out of the layers below. Its modules
//! are in sub-layers that depend one way (`runtime/tests/layers.rs` holds them to it):
//!
//! | sub-layer | modules | owns |
//! | --- | --- | --- |
//! | base | [`mesh`], [`programs`], [`options`], `hook`, [`state`], [`snapshot`], [`data`], [`eval`], [`memory`], [`metrics`], [`trace`], `steps` | the mesh (the one place a rank becomes a coordinate and a name), the plan's programs, the run's options, the communication hook every role's executors use (its axes and the servers), where the variables start (and a model rank's part of them), the state an elastic run keeps in memory, data sources and every role's data opener, evaluation (a pipeline's whole model too), memory accounting, what a run reports (one step report for every role), the one step loop |
//! | roles | `trainer`, `checkpoint`, [`worker`], [`pipeline`] | what every role builds alike (the optimizer, the CUDA-graph capture state, a rehearsed failure, the loss scaler, the gradient's norm, the run's first error), how a role's training state is written (a worker's whole or sharded, every role's shard), and the body of a step for each kind of rank: a worker's program per micro-batch (a CUDA graph's capture and replay is a mode of it), a pipeline stage's schedule |
//! | coordinator | [`coordinator`] | the one place a step report becomes a metrics line, and a run's report |
//! | launcher | `launcher` | the one launcher: the roles the mesh gives, the data, the coordinator, the run's report, over a transport |
//! | transport | `threads` (in-process), `mpi` (feature `mpi`, one rank per process) | spawning the roles, linking each axis, joining, the first error |
//! | launch | [`launch`], [`train`] | the one entry the CLI calls (the checks, the mesh, the device, the transport), and training as a library (threads) |

pub(crate) mod checkpoint;
pub mod coordinator;
pub mod data;
pub mod eval;
pub(crate) mod hook;
pub mod launch;
pub(crate) mod launcher;
pub mod memory;
pub mod mesh;
pub mod metrics;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod options;
pub mod pipeline;
pub mod programs;
pub mod snapshot;
pub mod state;
pub(crate) mod steps;
pub(crate) mod threads;
pub mod trace;
pub mod train;
pub(crate) mod trainer;
pub mod worker;
