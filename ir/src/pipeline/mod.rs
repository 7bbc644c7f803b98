//! A pipelined program: one forward and one backward graph per stage, and the static
//! schedule every stage runs them in. The compiler's pipeline pass makes it; the
//! runtime runs it as written.

pub mod schedule;

use crate::Graph;
use schedule::{ScheduleError, ScheduleKind, Step};

/// The two programs of one pipeline stage. Both run once per micro-batch: `forward`
/// when the schedule says `forward m`, `backward` when it says `backward m`.
///
/// Values crossing stages are `send`/`recv` ops naming the other stage; what a
/// stage's backward reads of its own forward (the stash) is a `send` to its own stage
/// in `forward` and a `recv` from it in `backward`. Each phase's sends to one stage
/// travel as one message, in the schedule's order.
#[derive(Clone, Debug, PartialEq)]
pub struct StageGraphs {
    /// The forward pass of one micro-batch on this stage.
    pub forward: Graph,
    /// Its backward pass, ending in the accumulated gradients of the stage's variables.
    pub backward: Graph,
}

/// Every stage's programs, and how their micro-batches are ordered.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineProgram {
    /// Stage 0 first.
    pub stages: Vec<StageGraphs>,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// The order of forwards and backwards.
    pub schedule: ScheduleKind,
}

impl PipelineProgram {
    /// Each stage's communication program (see [`schedule::program`]).
    pub fn programs(&self) -> Result<Vec<Vec<Step>>, ScheduleError> {
        schedule::programs(self.schedule, self.stages.len(), self.micro_batches)
    }
}
