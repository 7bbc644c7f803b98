//! The distc compiler: the DSL, the pass pipeline, plans and the CLI's commands.

pub mod bench;
pub mod cli;
pub mod commands;
pub mod console;
pub mod driver;
pub mod dsl;
pub mod explain;
pub mod limits;
pub mod plan;
pub mod planner;
pub mod plot;
pub mod simulate;
pub mod tensorboard;
pub mod verify;

pub use driver::{compile, compile_file, CompileError, CompileOptions, Compiled};
pub use plan::{Plan, PlanError};
