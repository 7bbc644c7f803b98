//! Training as a library: [`train`] and [`train_with`] run a plan's ranks as threads
//! of this process ([`crate::run::threads`], the in-process transport), and this module
//! re-exports what a caller names with them.

use crate::core::backend::Backend;
use crate::core::config::RunConfig;
use crate::core::error::Result;
use crate::cpu::Cpu;
use crate::run::mesh::Mesh;
use crate::run::metrics::StepMetrics;
use crate::run::threads::train_on;

// What a caller of the thread launcher names, where it has always found it.
pub use crate::comm::Links;
pub use crate::core::backend::Site;
pub use crate::run::data::open_data;
pub use crate::run::eval::evaluate;
pub use crate::run::metrics::TrainReport;
pub use crate::run::options::{CheckpointEvery, TrainOptions};
pub use crate::run::programs::{
    init_params, input_types, micro_batches, pulled_types, server_shards, Programs,
};

/// Trains a plan with its N workers and S servers as threads of this process (one
/// device: one worker). `on_step` sees each step's metrics line as it is complete;
/// returning an error from it stops training.
pub fn train(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<TrainReport> {
    train_with(programs, config, opts, on_step, |_, _| Ok(Cpu))
}

/// [`train`], each worker's kernels on the backend `make(site, comm)` creates on that
/// worker's thread (several workers may share one device). `comm` is the workers'
/// in-process communicators, for a device communicator's bootstrap; collectives go
/// through the host unless the backend runs them itself
/// ([`Backend::start_collective`](crate::core::backend::Backend::start_collective)).
pub fn train_with<B: Backend>(
    programs: Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: impl Fn(Site<'_>, Links<'_>) -> Result<B> + Sync,
) -> Result<TrainReport> {
    train_on(programs, Mesh::of(&programs)?, config, opts, on_step, make)
}
