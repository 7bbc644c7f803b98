//! A pipelined program: one forward and one backward graph per stage, and the static
//! schedule every stage runs them in. The compiler's pipeline pass makes it; the
//! runtime runs it as written.

pub mod schedule;

use crate::{Graph, Op};
use schedule::{ScheduleError, ScheduleKind, Step};
use std::collections::BTreeMap;

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

/// A variable several stages read (a tied embedding): `owner` updates it (its programs
/// hold its `param_grad`, the sum of every stage's contribution); after each step it
/// sends the updated value to each of `holders`, which read it only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiedVariable {
    /// The variable.
    pub name: String,
    /// The stage that updates it.
    pub owner: usize,
    /// The other stages reading it, ascending.
    pub holders: Vec<usize>,
}

impl PipelineProgram {
    /// Each stage's communication program (see [`schedule::program`]).
    pub fn programs(&self) -> Result<Vec<Vec<Step>>, ScheduleError> {
        schedule::programs(self.schedule, self.stages.len(), self.micro_batches)
    }

    /// The variables read on more than one stage, by name, read off the programs: the
    /// stage with its `param_grad` owns it. Every stage walks this list in order after
    /// its update, the owner sending, the holders receiving: each message's two stages
    /// reach it in the same global order, so the exchange cannot deadlock.
    pub fn tied(&self) -> Vec<TiedVariable> {
        let mut read: BTreeMap<String, (Option<usize>, Vec<usize>)> = BTreeMap::new();
        for (s, st) in self.stages.iter().enumerate() {
            for g in [&st.forward, &st.backward] {
                for id in g.node_ids() {
                    match g.op(id) {
                        Op::Param { name, .. } => {
                            let e = read.entry(name.clone()).or_default();
                            if !e.1.contains(&s) {
                                e.1.push(s);
                            }
                        }
                        Op::ParamGrad { param } => {
                            read.entry(param.clone()).or_default().0 = Some(s);
                        }
                        _ => {}
                    }
                }
            }
        }
        read.into_iter()
            .filter_map(|(name, (owner, mut stages))| {
                let owner = owner?;
                stages.retain(|&s| s != owner);
                stages.sort_unstable();
                (!stages.is_empty()).then_some(TiedVariable {
                    name,
                    owner,
                    holders: stages,
                })
            })
            .collect()
    }
}
