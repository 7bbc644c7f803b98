//! The one step loop. Every role that trains runs it: a data-parallel (or model-axis)
//! worker, and a pipeline stage. The loop owns what every role does alike: the steps
//! from the first (after a resumed state's) to the last, the learning rate each update
//! uses, which steps evaluate and which write a checkpoint, the timing of each step,
//! the NaN stop, the trace of steps and memory, and the hand-over of each step's
//! report. What differs is the body of a step ([`StepBody`]), as torchtitan's train
//! step branches on whether pipelining is on: a worker runs its program once per
//! micro-batch (or replays a captured CUDA graph), a stage runs its schedule's
//! instructions (GPipe or 1F1B).

use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::run::hook::Traced;
use crate::run::memory::MemoryByCategory;
use crate::run::options::TrainOptions;
use crate::run::trace::Span;
use distc_ir::NodeId;
use std::collections::HashMap;
use std::time::Instant;

/// The learning-rate schedule's horizon: the plan's steps (the train block's), not
/// `--steps`, so a run resumed to a later step follows the curve of one that never
/// stopped. Updates past it keep the schedule's final factor.
pub(crate) fn lr_horizon(config: &RunConfig) -> u64 {
    config.steps as u64
}

/// Which steps of a run evaluate and which write a checkpoint.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cadence {
    /// The run's last step.
    pub(crate) last: usize,
    /// Whether the run evaluates: every `eval_every` steps (0: never before the last),
    /// and after the last.
    evaluate: bool,
    eval_every: usize,
    /// Every so many steps, and after the last, when the run writes checkpoints.
    checkpoint_every: Option<usize>,
    /// Whether every step's state is kept in memory ([`TrainOptions::snapshot`]).
    snapshot: bool,
    /// Whether the checkpoints are sharded: each worker writes what it holds.
    sharded: bool,
}

/// What a step does besides training, from its [`Cadence`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Due {
    pub(crate) eval: bool,
    pub(crate) checkpoint: bool,
    /// The state goes to the checkpoint's file (or folder) this step.
    pub(crate) file: bool,
    /// It goes there sharded: each worker writes its own part, and nothing is
    /// gathered for the file.
    pub(crate) shard: bool,
    /// The run's last step.
    pub(crate) last: bool,
}

impl Due {
    /// Whether the step's state is gathered whole, for the file.
    pub(crate) fn writes_whole(&self) -> bool {
        self.file && !self.shard
    }
}

/// Whether `step` is one of those every `every` steps of a run ending at `last`, or the
/// last (`every` 0: the last alone).
pub(crate) fn due(step: usize, last: usize, every: usize) -> bool {
    step == last || (every > 0 && step.is_multiple_of(every))
}

impl Cadence {
    /// The run's cadence, from its train block and options.
    pub(crate) fn of(config: &RunConfig, opts: &TrainOptions) -> Cadence {
        Cadence {
            last: opts.last_step(config),
            evaluate: opts.evaluate,
            eval_every: config.eval_every,
            checkpoint_every: opts.checkpoint.as_ref().map(|c| c.every.max(1)),
            snapshot: opts.snapshot.is_some(),
            sharded: opts.checkpoint.as_ref().is_some_and(|c| c.sharded),
        }
    }

    /// Whether the state gathered after `step` goes to the checkpoint file.
    pub(crate) fn writes_file(&self, step: usize) -> bool {
        self.checkpoint_every
            .is_some_and(|every| due(step, self.last, every))
    }

    /// What `step` does besides training.
    pub(crate) fn at(&self, step: usize) -> Due {
        Due {
            eval: self.evaluate && due(step, self.last, self.eval_every),
            checkpoint: self.snapshot || self.writes_file(step),
            file: self.writes_file(step),
            shard: self.sharded && self.writes_file(step),
            last: step == self.last,
        }
    }
}

/// What one step's body ran.
pub(crate) struct Ran<D> {
    /// The mean loss of its micro-batches; `None` on a role that holds no loss (a
    /// pipeline stage before the last).
    pub(crate) loss: Option<f64>,
    /// When the step began, once its batch was at hand.
    pub(crate) start: Instant,
    /// When its update began.
    pub(crate) updating: Instant,
    /// What it held at its peak, by category.
    pub(crate) memory: MemoryByCategory,
    /// The global gradient norm before clipping, where `clip_norm` measured it.
    pub(crate) grad_norm: Option<f64>,
    /// The rest of the body's account, for its report.
    pub(crate) detail: D,
}

/// A step's times, as the loop measured them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timed {
    pub(crate) start: Instant,
    pub(crate) updating: Instant,
    pub(crate) end: Instant,
}

impl Timed {
    pub(crate) fn seconds(&self) -> f64 {
        (self.end - self.start).as_secs_f64()
    }
}

/// The body of a step: what one kind of role runs between two reports.
pub(crate) trait StepBody {
    /// The rest of a step's account, from [`StepBody::run_step`] to
    /// [`StepBody::account`].
    type Detail;
    /// What a step hands to the coordinator.
    type Report;
    /// The learning rate of the next update, read before it moves on.
    fn learning_rate(&self) -> f64;
    /// Runs step `step`: its forwards, backwards, communication and update.
    fn run_step(&mut self, step: usize, due: Due) -> Result<Ran<Self::Detail>>;
    /// After a step whose loss is finite: its evaluation and checkpoint where `due`
    /// says, and its report.
    fn account(
        &mut self,
        step: usize,
        due: Due,
        ran: Ran<Self::Detail>,
        timed: Timed,
        lr: f64,
    ) -> Result<Self::Report>;
}

/// What the loop records while tracing: each step's times, and memory after each.
#[derive(Debug, Default)]
pub(crate) struct StepTrace {
    pub(crate) steps: Vec<(u64, Timed)>,
    pub(crate) memory: Vec<(u64, Instant, MemoryByCategory)>,
}

impl StepTrace {
    /// Its spans: a `step N` span per step on `track`, and the memory counters on
    /// `track memory`.
    pub(crate) fn spans(&self, track: &str, t0: Instant) -> Vec<Span> {
        let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
        let steps = self.steps.iter().map(|(step, t)| Span {
            track: track.to_string(),
            name: format!("step {step}"),
            node: None,
            types: None,
            step: *step,
            bytes: None,
            start_us: us(t.start),
            dur_us: us(t.end) - us(t.start),
            counters: Vec::new(),
            on_device: false,
        });
        let memory = self.memory.iter().map(|(step, at, m)| Span {
            track: format!("{track} memory"),
            name: "memory".into(),
            node: None,
            types: None,
            step: *step,
            bytes: None,
            start_us: us(*at),
            dur_us: 0.0,
            counters: m.named().iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            on_device: false,
        });
        steps.chain(memory).collect()
    }
}

/// Runs steps `first..=cadence.last` of `body`, handing each step's report to
/// `report`; `trace` (while tracing) records them. A loss that is not finite stops
/// the run at that step, on every role alike.
pub(crate) fn run_steps<Body: StepBody>(
    body: &mut Body,
    first: usize,
    cadence: Cadence,
    trace: Option<&mut StepTrace>,
    report: &mut dyn FnMut(Body::Report) -> Result<()>,
) -> Result<()> {
    let mut trace = trace;
    for step in first..=cadence.last {
        let lr = body.learning_rate();
        let due = cadence.at(step);
        let ran = body.run_step(step, due)?;
        let timed = Timed {
            start: ran.start,
            updating: ran.updating,
            end: Instant::now(),
        };
        if let Some(t) = trace.as_deref_mut() {
            t.steps.push((step as u64, timed));
            t.memory.push((step as u64, timed.end, ran.memory));
        }
        if let Some(loss) = ran.loss.filter(|l| !l.is_finite()) {
            return Err(RuntimeError::Diverged { step, loss });
        }
        report(body.account(step, due, ran, timed, lr)?)?;
    }
    Ok(())
}

/// A worker's trace spans from what it recorded of its program `g`.
pub(crate) fn worker_spans(
    g: &distc_ir::Graph,
    rank: usize,
    t0: Instant,
    step_spans: &[(u64, Timed)],
    traced: Traced,
) -> Vec<Span> {
    let Traced {
        nodes: node_spans,
        waits: wait_spans,
        comms: comm_spans,
    } = traced;
    let us = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e6;
    let track = format!("worker {rank}");
    let span = |track: &str, name: String, node: Option<NodeId>, step, s, e| Span {
        track: track.to_string(),
        name,
        node: node.map(|n: NodeId| n.to_string()),
        types: node.map(|n| crate::run::trace::node_types(g, n)),
        step,
        bytes: None,
        start_us: us(s),
        dur_us: us(e) - us(s),
        counters: Vec::new(),
        on_device: false,
    };
    let mut spans: Vec<Span> = Vec::new();
    // Op groups: forward until the loss's gradient (autodiff's first `_grad` op),
    // backward until the executor returns, then the update.
    let mut backward_from: HashMap<u64, Instant> = HashMap::new();
    for s in &node_spans {
        if s.op.ends_with("_grad") {
            backward_from.entry(s.step).or_insert(s.start);
        }
    }
    // Each step's own span is the loop's ([`StepTrace::spans`]).
    for &(
        step,
        Timed {
            start: s,
            updating,
            end: e,
        },
    ) in step_spans
    {
        let b = backward_from.get(&step).copied().unwrap_or(s);
        spans.push(span(&track, "forward".into(), None, step, s, b));
        spans.push(span(&track, "backward".into(), None, step, b, updating));
        spans.push(span(&track, "update".into(), None, step, updating, e));
    }
    spans.extend(node_spans.iter().map(|n| {
        // The worker only hands a collective to its comm thread.
        let name = match n.op {
            "all_reduce" | "all_gather" | "broadcast" => format!("issue {}", n.op),
            op => op.to_string(),
        };
        Span {
            on_device: n.on_device,
            ..span(&track, name, Some(n.node), n.step, n.start, n.end)
        }
    }));
    spans.extend(
        wait_spans.iter().map(|&(node, step, s, e)| {
            span(&track, format!("wait {node}"), Some(node), step, s, e)
        }),
    );
    let comm_track = format!("worker {rank} comm");
    spans.extend(comm_spans.into_iter().map(|c| Span {
        bytes: Some(c.bytes),
        ..span(
            &comm_track,
            format!("{} {}", c.op, c.node),
            Some(c.node),
            c.step,
            c.start,
            c.end,
        )
    }));
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cadence(last: usize, evaluate: bool, eval_every: usize, ckpt: Option<usize>) -> Cadence {
        Cadence {
            last,
            evaluate,
            eval_every,
            checkpoint_every: ckpt,
            snapshot: false,
            sharded: false,
        }
    }

    #[test]
    fn the_last_step_evaluates_and_checkpoints_and_so_does_every_nth() {
        let c = cadence(10, true, 4, Some(3));
        let evals: Vec<usize> = (1..=10).filter(|&s| c.at(s).eval).collect();
        let ckpts: Vec<usize> = (1..=10).filter(|&s| c.at(s).checkpoint).collect();
        assert_eq!(evals, [4, 8, 10]);
        assert_eq!(ckpts, [3, 6, 9, 10]);
        assert!(c.at(10).last && !c.at(9).last);
        let quiet = cadence(10, false, 4, None);
        assert!((1..=10).all(|s| !quiet.at(s).eval && !quiet.at(s).checkpoint));
        assert!(!cadence(5, true, 0, None).at(4).eval);
        assert!(cadence(5, true, 0, None).at(5).eval);
        // An elastic run keeps every step's state; the file is written as before.
        let kept = Cadence {
            snapshot: true,
            ..cadence(10, false, 0, Some(3))
        };
        assert!((1..=10).all(|s| kept.at(s).checkpoint));
        let written: Vec<usize> = (1..=10).filter(|&s| kept.writes_file(s)).collect();
        assert_eq!(written, [3, 6, 9, 10]);
        let whole: Vec<usize> = (1..=10).filter(|&s| kept.at(s).writes_whole()).collect();
        assert_eq!(whole, written);
        // Sharded, the steps that write the file gather nothing for it.
        let sharded = Cadence {
            sharded: true,
            ..kept
        };
        assert!((1..=10).all(|s| !sharded.at(s).writes_whole()));
        let shards: Vec<usize> = (1..=10).filter(|&s| sharded.at(s).shard).collect();
        assert_eq!(shards, written);
    }

    struct Counting {
        losses: Vec<f64>,
        accounted: Vec<usize>,
    }

    impl StepBody for Counting {
        type Detail = ();
        type Report = (usize, f64);
        fn learning_rate(&self) -> f64 {
            0.1 * self.accounted.len() as f64
        }
        fn run_step(&mut self, step: usize, _: Due) -> Result<Ran<()>> {
            let now = Instant::now();
            Ok(Ran {
                loss: self.losses.get(step - 1).copied(),
                start: now,
                updating: now,
                memory: MemoryByCategory::default(),
                grad_norm: None,
                detail: (),
            })
        }
        fn account(
            &mut self,
            step: usize,
            _: Due,
            _: Ran<()>,
            _: Timed,
            lr: f64,
        ) -> Result<(usize, f64)> {
            self.accounted.push(step);
            Ok((step, lr))
        }
    }

    #[test]
    fn a_loss_that_is_not_finite_stops_the_loop_before_its_step_is_reported() {
        let mut body = Counting {
            losses: vec![1.0, 0.5, f64::NAN, 0.2],
            accounted: Vec::new(),
        };
        let mut reports = Vec::new();
        let mut trace = StepTrace::default();
        let e = run_steps(
            &mut body,
            1,
            cadence(4, false, 0, None),
            Some(&mut trace),
            &mut |r| {
                reports.push(r);
                Ok(())
            },
        )
        .expect_err("a NaN loss stops the run");
        assert!(matches!(e, RuntimeError::Diverged { step: 3, .. }), "{e:?}");
        assert_eq!(reports.iter().map(|r| r.0).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(trace.steps.len(), 3, "the failing step is in the trace");
        // A stage without the loss never stops on it; a resumed run starts later.
        let mut body = Counting {
            losses: Vec::new(),
            accounted: Vec::new(),
        };
        let mut seen = Vec::new();
        run_steps(&mut body, 3, cadence(5, false, 0, None), None, &mut |r| {
            seen.push(r.0);
            Ok(())
        })
        .expect("no loss, no stop");
        assert_eq!(seen, [3, 4, 5]);
    }
}
