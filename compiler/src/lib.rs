//! The distc compiler: the DSL, the pass pipeline, plans and the CLI's commands.

pub mod dsl;
