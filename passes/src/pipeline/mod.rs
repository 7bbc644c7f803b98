//! Pipeline parallelism (`--pipeline P`): the one-device graph cut into P stages, and
//! the static schedules that run their micro-batches.

pub mod schedule;
pub mod stages;
