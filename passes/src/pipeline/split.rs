//! The pipeline rewrite (`--pipeline P`): the trained one-device graph becomes two
//! programs per stage, the forward and the backward of one micro-batch, joined by
//! `send`/`recv` ops, plus the static schedule every stage runs them in.
//!
//! Every kernel goes to the stage [`partition`] gave it, into the forward program if it
//! is forward (an ancestor of the loss or an output), else into the backward one.
//! Sources are copied into each program that reads them. A value read where it is not
//! computed travels:
//!
//! - forward, from stage t to a later stage s: after t's forward of the micro-batch,
//!   through every stage between (each relays it), into s's forward;
//! - backward, from stage t to an earlier stage s: after t's backward, relayed the same
//!   way down, into s's backward; a forward value an earlier stage's backward reads
//!   goes this way too, stashed on t until t's backward;
//! - from a stage's forward to its own backward: a `send` to its own stage, the stash
//!   the runtime keeps per micro-batch in flight.
//!
//! Neighbours alone talk, so each schedule step is one message per direction, which
//! [`schedule::check`] proves free of deadlock. Each `param_grad` reads an
//! `accumulate{micro=M}` of its gradient: the step's update is the mean over the M
//! micro-batches, the one-device gradient of the whole batch. Before/after, a matmul
//! cut from its loss (stage 0 | stage 1):
//! ```text
//! %2 = matmul %0, %1        forward 0:  %2 = matmul %0, %1; send{stage=1, tag="%2"} %2
//! %3 = loss_fn %2      =>                send{stage=0, tag="%0"} %0
//!                           forward 1:  %0 = recv{stage=0, tag="%2"}; ...
//! ```
//! The one-device graph stays the worker program, for reading and for `explain`.

use crate::fusion::Fusion;
use crate::pipeline::schedule::{self, ScheduleKind};
use crate::pipeline::stages::{partition_with, StagePlan};
use crate::placement::{Strategy, StrategyConfig};
use crate::schedule::Schedule;
use crate::{needs_program_set, Pass, PassCx, PassError, PassStats, ProgramSet};
use distc_ir::pipeline::{PipelineProgram, StageGraphs};
use distc_ir::{Graph, NodeId, Op, ReduceOp, ValueId};
use std::collections::{HashMap, HashSet};

/// Which program of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Phase {
    Forward,
    Backward,
}

/// A program being built: stage and phase.
type At = (usize, Phase);

struct Builder<'g> {
    g: &'g Graph,
    plan: &'g StagePlan,
    forward: Vec<Graph>,
    backward: Vec<Graph>,
    /// The value standing for an original value in a program.
    map: HashMap<(At, ValueId), ValueId>,
    /// Sends already made: (program, receiving stage, value).
    sent: HashSet<(At, usize, ValueId)>,
}

impl Builder<'_> {
    fn graph(&mut self, at: At) -> &mut Graph {
        match at.1 {
            Phase::Forward => &mut self.forward[at.0],
            Phase::Backward => &mut self.backward[at.0],
        }
    }

    fn home(&self, id: NodeId) -> Result<At, PassError> {
        let s = self.plan.stage_of.get(&id).copied().ok_or_else(|| {
            PassError::Precondition(format!("{id} ({}) has no stage", self.g.op(id)))
        })?;
        let phase = if self.plan.forward.contains(&id) {
            Phase::Forward
        } else {
            Phase::Backward
        };
        Ok((s, phase))
    }

    fn refuse(&self, v: ValueId, from: At, to: At, why: &str) -> PassError {
        PassError::Precondition(format!(
            "{v} ({}) computed in stage {}'s {} is read in stage {}'s {}: {why}",
            self.g.op(v.node).mnemonic(),
            from.0,
            phase_name(from.1),
            to.0,
            phase_name(to.1),
        ))
    }

    /// The value standing for `v` in program `at`, bringing it there if needed.
    fn value_in(&mut self, at: At, v: ValueId) -> Result<ValueId, PassError> {
        if let Some(&x) = self.map.get(&(at, v)) {
            return Ok(x);
        }
        let op = self.g.op(v.node);
        if op.is_source() {
            let id = self.graph(at).add(op.clone(), vec![])?;
            self.map.insert((at, v), id.into());
            return Ok(id.into());
        }
        let home = self.home(v.node)?;
        let (s, phase) = at;
        let (t, home_phase) = home;
        let from = match (phase, home_phase) {
            (_, _) if home == at => {
                return Err(PassError::Precondition(format!(
                    "{v} is read in stage {s} before it is computed there (a bug in the rewrite)"
                )))
            }
            (Phase::Forward, Phase::Backward) => {
                return Err(self.refuse(v, home, at, "a forward op reads a gradient"))
            }
            (Phase::Forward, Phase::Forward) if t > s => {
                return Err(self.refuse(
                    v,
                    home,
                    at,
                    "stages must read forward values of earlier stages only",
                ))
            }
            (Phase::Forward, Phase::Forward) => (s - 1, Phase::Forward),
            (Phase::Backward, _) if t > s => (s + 1, Phase::Backward),
            (Phase::Backward, Phase::Backward) => {
                return Err(self.refuse(
                    v,
                    home,
                    at,
                    "a gradient cannot travel to a later stage, whose backward runs first",
                ))
            }
            (Phase::Backward, Phase::Forward) => (s, Phase::Forward),
        };
        let w = self.value_in(from, v)?;
        let tag = v.to_string();
        if self.sent.insert((from, s, v)) {
            self.graph(from)
                .add(
                    Op::Send {
                        stage: s,
                        tag: tag.clone(),
                    },
                    vec![w],
                )
                .map_err(|e| {
                    PassError::Precondition(format!(
                        "{v} cannot cross from stage {} to stage {s}: {e}",
                        from.0
                    ))
                })?;
        }
        let ty = self.g.tensor_type(v).clone();
        let r = self.graph(at).add(
            Op::Recv {
                stage: from.0,
                tag,
                ty,
            },
            vec![],
        )?;
        self.map.insert((at, v), r.into());
        Ok(r.into())
    }
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "forward",
        Phase::Backward => "backward",
    }
}

/// The forward and backward program of every stage of `g` cut as `plan` says, each
/// gradient accumulated over `micro` micro-batches.
pub fn split(g: &Graph, plan: &StagePlan, micro: usize) -> Result<Vec<StageGraphs>, PassError> {
    let p = plan.stages;
    let named = |s: usize, what: &str| Graph::new(format!("{}.stage{s}.{what}", g.name));
    let mut b = Builder {
        g,
        plan,
        forward: (0..p).map(|s| named(s, "forward")).collect(),
        backward: (0..p).map(|s| named(s, "backward")).collect(),
        map: HashMap::new(),
        sent: HashSet::new(),
    };
    // Each variable's node by name, found once (a search per gradient is quadratic).
    let vars: HashMap<&str, NodeId> = g
        .params()
        .into_iter()
        .map(|(id, name, _)| (name, id))
        .collect();
    for id in g.topo_order() {
        let op = g.op(id);
        if op.is_source() {
            continue;
        }
        let at = b.home(id)?;
        let mut inputs = g
            .node(id)
            .inputs
            .iter()
            .map(|v| b.value_in(at, *v))
            .collect::<Result<Vec<_>, _>>()?;
        if let Op::ParamGrad { param } = op {
            // The variable itself, which its gradient's program need not read.
            if let Some(&var) = vars.get(param.as_str()) {
                b.value_in(at, var.into())?;
            }
        }
        if matches!(op, Op::ParamGrad { .. }) && micro > 1 {
            let acc = b.graph(at).add(Op::Accumulate { micro }, inputs)?;
            inputs = vec![acc.into()];
        }
        let new = b.graph(at).add(op.clone(), inputs)?;
        for port in 0..g.node(id).outputs.len() {
            let port = port as u16;
            b.map.insert((at, id.out(port)), new.out(port));
        }
    }
    Ok(b.forward
        .into_iter()
        .zip(b.backward)
        .map(|(forward, backward)| StageGraphs { forward, backward })
        .collect())
}

fn count_sends(g: &Graph) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|id| matches!(g.op(*id), Op::Send { .. }))
        .count()
}

/// Replicas of the pipeline: `--workers N` over `--pipeline P` stages (allreduce only),
/// each stage T workers wide on a mesh's model axis.
fn replicas(cfg: &StrategyConfig) -> Result<usize, PassError> {
    let stages = cfg.pipeline.max(1);
    let lanes = cfg.workers / cfg.model.max(1);
    match cfg.strategy {
        Strategy::Single if lanes <= 1 || lanes == stages => Ok(1),
        Strategy::Allreduce if lanes.is_multiple_of(stages) && lanes >= stages => {
            Ok(lanes / stages)
        }
        Strategy::Allreduce => Err(PassError::Precondition(format!(
            "--workers {} is not a multiple of --pipeline {stages}: N workers run N/P \
             replicas of the P stages",
            cfg.workers
        ))),
        s => Err(PassError::Precondition(format!(
            "--pipeline with --strategy {} and {} workers is not supported: replicas of a \
             pipeline average their gradients with --strategy allreduce",
            s.name(),
            cfg.workers
        ))),
    }
}

/// Puts the mean over the replicas between every accumulated gradient of `g` and its
/// sink: an `all_reduce` of a dense one, `unique_rows` then `all_gather` of rows.
fn average_over_replicas(g: &mut Graph, replicas: usize) -> Result<usize, PassError> {
    let mut n = 0;
    for id in g.node_ids() {
        if !matches!(g.op(id), Op::ParamGrad { .. }) {
            continue;
        }
        let grad = g.node(id).inputs[0];
        let reduced = if g.value_type(grad).is_sparse() {
            let unique = g.add(Op::UniqueRows, vec![grad])?;
            let op = Op::AllGather {
                workers: replicas,
                reduce: ReduceOp::Mean,
            };
            g.add(op, vec![unique.into()])?
        } else {
            g.add(
                Op::AllReduce {
                    reduce: ReduceOp::Mean,
                    ranks_per_node: 0,
                },
                vec![grad],
            )?
        };
        g.set_input(id, 0, reduced.into());
        n += 1;
    }
    Ok(n)
}

/// The pipeline pass: cuts the worker program into `--pipeline` stages and adds their
/// programs and schedule to the set, refusing a schedule that could deadlock.
pub struct PipelineSplit;

impl Pass for PipelineSplit {
    fn run(&self, _g: &mut Graph, _cx: &mut PassCx) -> Result<PassStats, PassError> {
        Err(needs_program_set(&self.name()))
    }

    fn run_programs(&self, p: &mut ProgramSet, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let stages = cx.strategy.pipeline.max(1);
        let micro = cx.strategy.micro_batches.max(1);
        let kind: ScheduleKind = cx.strategy.schedule;
        if stages == 1 {
            return Ok(PassStats::default().count("stages", 1));
        }
        let cfg = cx.strategy.clone();
        let replicas = replicas(&cfg)?;
        if cfg.accumulate > 1 {
            return Err(PassError::Precondition(format!(
                "--accumulate {} with --pipeline: a pipeline's micro-batches accumulate \
                 already; give --micro-batches instead",
                cfg.accumulate
            )));
        }
        let plan = partition_with(&p.worker, stages, cfg.stage_marks.as_ref())
            .map_err(|e| PassError::Precondition(e.to_string()))?;
        let mut graphs = split(&p.worker, &plan, micro)?;
        let mut collectives = 0;
        if replicas > 1 {
            // Each stage's gradients, once accumulated, are averaged over its replicas,
            // bucketed and scheduled as a data-parallel worker program's are.
            let mut stage_cx = PassCx {
                strategy: StrategyConfig {
                    workers: replicas,
                    ..cfg.clone()
                },
                ..PassCx::default()
            };
            for st in &mut graphs {
                collectives += average_over_replicas(&mut st.backward, replicas)?;
                Fusion.run(&mut st.backward, &mut stage_cx)?;
                Schedule.run(&mut st.backward, &mut stage_cx)?;
            }
        }
        let program = PipelineProgram {
            stages: graphs,
            micro_batches: micro,
            schedule: kind,
        };
        let programs = program
            .programs()
            .map_err(|e| PassError::Precondition(e.to_string()))?;
        let sim = schedule::check(&programs).map_err(|e| {
            PassError::Precondition(format!("the {kind} schedule could deadlock: {e}"))
        })?;
        let sends: usize = program
            .stages
            .iter()
            .map(|s| count_sends(&s.forward) + count_sends(&s.backward))
            .sum();
        let (kernels, crossings) = (plan.stage_of.len(), plan.crossings.len());
        p.pipeline = Some(program);
        Ok(PassStats::default()
            .count("stages", stages)
            .count("micro_batches", micro)
            .count("kernels", kernels)
            .count("crossings", crossings)
            .count("sends", sends)
            .count("replicas", replicas)
            .count("collectives", collectives)
            .with_note(format!(
                "{kind}, simulated bubble {:.1}% (predicted {:.1}%)",
                100.0 * sim.bubble,
                100.0 * schedule::predicted_bubble(stages, micro)
            )))
    }
}
