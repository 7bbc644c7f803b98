//! Pipeline parallelism (`--pipeline P`): the one-device graph cut into P stages, and
//! the static schedules that run their micro-batches.

pub use distc_ir::pipeline::schedule;
pub mod split;
pub mod stages;
