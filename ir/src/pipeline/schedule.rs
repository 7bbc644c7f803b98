//! Static pipeline schedules and a compile-time deadlock check.
//!
//! A model cut into P stages runs each training step as M micro-batches. Stage s runs
//! `forward m` (activations of m in from stage s-1, out to stage s+1) and `backward m`
//! (the activation gradient of m in from stage s+1, out to stage s-1) for every m, then
//! the optimizer step (not modelled here). Two orders are offered:
//!
//! - `gpipe`: all M forwards, then all M backwards; every stage holds M micro-batches
//!   of activations at its peak.
//! - `1f1b` (PipeDream-flush, as in DeepSpeed and `torch.distributed.pipelining`):
//!   stage s runs min(P-s-1, M) warm-up forwards, then alternates one forward and one
//!   backward, then drains the remaining backwards; stage s holds at most min(P-s, M).
//!
//! 1F1B for P = 3, M = 4, forward 1 and backward 2 time units, as [`simulate`] times
//! it (`.` is idle; both schedules idle (P-1)/(M+P-1) of the time):
//! ```text
//! time     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17
//! stage 0  F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3
//! stage 1  .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .
//! stage 2  .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  .
//! ```
//!
//! [`program`] spells each stage's schedule as the sends, receives and computations it
//! performs, and [`check`] proves a set of such programs cannot deadlock. It assumes the
//! worst transport, rendezvous: a send completes only together with the matching
//! receive, nothing is buffered. Buffering only lets a sender run ahead, so any program
//! set that completes on rendezvous completes on every buffered transport too (NCCL
//! send/recv does not promise a buffer, so the compiler may not count on one).

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;
use thiserror::Error;

/// Which static order of forwards and backwards each stage runs.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum ScheduleKind {
    /// All forwards, then all backwards.
    #[serde(rename = "gpipe")]
    GPipe,
    /// Warm-up forwards, then one forward and one backward in turn, then a flush.
    #[default]
    #[serde(rename = "1f1b")]
    OneFOneB,
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
        })
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            _ => Err(ScheduleError::UnknownKind(s.to_string())),
        }
    }
}

/// One computation of a stage, on the micro-batch it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The forward pass of this micro-batch.
    Forward(usize),
    /// The backward pass of this micro-batch.
    Backward(usize),
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Forward(m) => write!(f, "forward m{m}"),
            Action::Backward(m) => write!(f, "backward m{m}"),
        }
    }
}

/// What a message between two stages carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Carried {
    /// A forward output, sent to the next stage.
    Activation,
    /// The gradient of a stage's input, sent to the previous stage.
    Gradient,
}

impl fmt::Display for Carried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Carried::Activation => "activation",
            Carried::Gradient => "gradient",
        })
    }
}

/// One step of a stage's communication program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Blocks until stage `from` sends `what` of micro-batch `micro`.
    Recv {
        /// The sending stage.
        from: usize,
        /// What arrives.
        what: Carried,
        /// Of which micro-batch.
        micro: usize,
    },
    /// Runs a computation.
    Compute(Action),
    /// Blocks until stage `to` receives `what` of micro-batch `micro`.
    Send {
        /// The receiving stage.
        to: usize,
        /// What leaves.
        what: Carried,
        /// Of which micro-batch.
        micro: usize,
    },
}

impl Step {
    /// The stage a send or receive talks to; `None` for a computation.
    pub fn peer(&self) -> Option<usize> {
        match *self {
            Step::Recv { from, .. } => Some(from),
            Step::Send { to, .. } => Some(to),
            Step::Compute(_) => None,
        }
    }

    /// What a send or receive moves, of which micro-batch; `None` for a computation.
    fn message(&self) -> Option<(Carried, usize)> {
        match *self {
            Step::Recv { what, micro, .. } | Step::Send { what, micro, .. } => Some((what, micro)),
            Step::Compute(_) => None,
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Recv { from, what, micro } => write!(f, "recv {what} m{micro} <- stage {from}"),
            Step::Compute(a) => write!(f, "{a}"),
            Step::Send { to, what, micro } => write!(f, "send {what} m{micro} -> stage {to}"),
        }
    }
}

/// A step located in a program set: `stage 1 step 4 `recv gradient m0 <- stage 2``.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpAt {
    /// The stage whose program holds the step.
    pub stage: usize,
    /// The step's index in that program.
    pub step: usize,
    /// The step itself.
    pub op: Step,
}

impl fmt::Display for OpAt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stage {} step {} `{}`", self.stage, self.step, self.op)
    }
}

/// A stage stuck on a send or receive when no stage can move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocked {
    /// The blocked step.
    pub at: OpAt,
    /// The stage it waits for.
    pub peer: usize,
    /// Where that stage is stuck, or `None` when it has finished its program.
    pub peer_at: Option<OpAt>,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} waits for stage {}, which ", self.at, self.peer)?;
        match &self.peer_at {
            Some(p) => write!(f, "is at step {} `{}`", p.step, p.op),
            None => f.write_str("has finished"),
        }
    }
}

/// Why no stage can move: every blocked stage, and a cycle of stages waiting on each
/// other if there is one (the rest wait on a stage of the cycle or on a finished one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deadlock {
    /// Each unfinished stage's blocked step, by stage.
    pub blocked: Vec<Blocked>,
    /// Stages that wait on each other in a ring, first stage lowest; empty if none.
    pub cycle: Vec<usize>,
}

impl fmt::Display for Deadlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("deadlock on a rendezvous transport")?;
        match self.cycle.as_slice() {
            [] => f.write_str(" (stages wait on finished stages)")?,
            [a, b] => write!(f, ": stages {a} and {b} wait on each other")?,
            ring => {
                let names: Vec<String> = ring.iter().map(|s| s.to_string()).collect();
                write!(
                    f,
                    ": stages {} wait on each other in a ring",
                    names.join(" -> ")
                )?;
            }
        }
        for b in &self.blocked {
            write!(f, "\n  {b}")?;
        }
        Ok(())
    }
}

/// Why a schedule cannot be built, or why a program set does not check.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ScheduleError {
    /// A schedule name that is none of the spellings.
    #[error("unknown pipeline schedule `{0}` (valid: gpipe, 1f1b)")]
    UnknownKind(String),
    /// A pipeline of zero stages.
    #[error("a pipeline needs at least one stage")]
    NoStages,
    /// A step of zero micro-batches.
    #[error("a pipeline step needs at least one micro-batch")]
    NoMicroBatches,
    /// A stage index past the last stage.
    #[error("stage {stage} does not exist in a pipeline of {stages} stages")]
    NoSuchStage {
        /// The index asked for.
        stage: usize,
        /// How many stages there are.
        stages: usize,
    },
    /// A send or receive naming a stage that does not exist.
    #[error("{at}: there is no stage {peer} in a pipeline of {stages} stages")]
    PeerOutOfRange {
        /// The offending step.
        at: OpAt,
        /// The peer it names.
        peer: usize,
        /// How many stages there are.
        stages: usize,
    },
    /// A send or receive naming its own stage (it would wait for itself forever).
    #[error("{at}: a stage cannot send to or receive from itself")]
    SelfPeer {
        /// The offending step.
        at: OpAt,
    },
    /// A computation out of order within its stage.
    #[error("{at}: {why}")]
    Order {
        /// The offending step.
        at: OpAt,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A send meets a receive from it that expects another message.
    #[error("{send} meets {recv}, which expects another message")]
    Mismatch {
        /// The send.
        send: OpAt,
        /// The receive at the head of the receiving stage.
        recv: OpAt,
    },
    /// No stage can move and some have not finished.
    #[error("{0}")]
    Deadlock(Deadlock),
    /// A cost table of the wrong length, or with a negative or non-finite entry.
    #[error("{which} cost table {problem} (pipeline of {stages} stages)")]
    BadCosts {
        /// `forward` or `backward`.
        which: &'static str,
        /// What is wrong.
        problem: String,
        /// How many stages there are.
        stages: usize,
    },
    /// The simulation ran past its round limit (a bug in the checker: every round
    /// completes at least one step).
    #[error("simulation did not finish within {0} rounds")]
    RoundLimit(usize),
}

fn validate(stages: usize, micro: usize, stage: usize) -> Result<(), ScheduleError> {
    if stages == 0 {
        return Err(ScheduleError::NoStages);
    }
    if micro == 0 {
        return Err(ScheduleError::NoMicroBatches);
    }
    if stage >= stages {
        return Err(ScheduleError::NoSuchStage { stage, stages });
    }
    Ok(())
}

/// The computations of `stage` in a pipeline of `stages` stages and `micro`
/// micro-batches, in the order the schedule `kind` runs them.
pub fn actions(
    kind: ScheduleKind,
    stages: usize,
    micro: usize,
    stage: usize,
) -> Result<Vec<Action>, ScheduleError> {
    validate(stages, micro, stage)?;
    let mut out = Vec::with_capacity(2 * micro);
    match kind {
        // Backwards run in forward order (m = 0 first), as in 1F1B, not in reverse as
        // in torchgpipe: both schedules then pass gradients between two stages in the
        // same order, and the oldest activations are the first freed.
        ScheduleKind::GPipe => {
            out.extend((0..micro).map(Action::Forward));
            out.extend((0..micro).map(Action::Backward));
        }
        ScheduleKind::OneFOneB => {
            // Stage s can start backward 0 only after the P-s-1 stages above it have
            // each run forward 0; the warm-up fills that wait with forwards.
            let warmup = (stages - stage - 1).min(micro);
            out.extend((0..warmup).map(Action::Forward));
            for i in 0..micro - warmup {
                out.push(Action::Forward(warmup + i));
                out.push(Action::Backward(i));
            }
            out.extend((micro - warmup..micro).map(Action::Backward));
        }
    }
    Ok(out)
}

/// The communication program of `stage`: each computation of [`actions`] with the
/// receive of its input before it and the send of its output after it.
pub fn program(
    kind: ScheduleKind,
    stages: usize,
    micro: usize,
    stage: usize,
) -> Result<Vec<Step>, ScheduleError> {
    let last = stages.saturating_sub(1);
    let mut steps = Vec::new();
    for action in actions(kind, stages, micro, stage)? {
        match action {
            Action::Forward(m) => {
                if stage > 0 {
                    steps.push(recv(stage - 1, Carried::Activation, m));
                }
                steps.push(Step::Compute(action));
                if stage < last {
                    steps.push(send(stage + 1, Carried::Activation, m));
                }
            }
            Action::Backward(m) => {
                if stage < last {
                    steps.push(recv(stage + 1, Carried::Gradient, m));
                }
                steps.push(Step::Compute(action));
                if stage > 0 {
                    steps.push(send(stage - 1, Carried::Gradient, m));
                }
            }
        }
    }
    // In 1F1B's steady state stage s, after forward m, sends activation m up and then
    // waits for a gradient from above; stage s+1, after a backward, sends that gradient
    // down and then waits for activation m. On rendezvous both block in their send: a
    // deadlock. Every neighbour exchange therefore moves the activation first, so the
    // upper stage receives its next activation before sending the gradient (the order
    // Megatron's paired `send_backward_recv_forward` takes). Communication costs
    // nothing in the model, so the swap costs no time either.
    let mut i = 0;
    while i + 1 < steps.len() {
        if gradient_before_activation(steps[i], steps[i + 1]) {
            steps.swap(i, i + 1);
            i += 1;
        }
        i += 1;
    }
    Ok(steps)
}

fn gradient_before_activation(first: Step, then: Step) -> bool {
    matches!(
        (first, then),
        (Step::Send { to, what: Carried::Gradient, .. }, Step::Recv { from, what: Carried::Activation, .. })
            if to == from
    )
}

fn send(to: usize, what: Carried, micro: usize) -> Step {
    Step::Send { to, what, micro }
}

fn recv(from: usize, what: Carried, micro: usize) -> Step {
    Step::Recv { from, what, micro }
}

/// The programs of all stages of a schedule, stage 0 first.
pub fn programs(
    kind: ScheduleKind,
    stages: usize,
    micro: usize,
) -> Result<Vec<Vec<Step>>, ScheduleError> {
    validate(stages, micro, 0)?;
    (0..stages)
        .map(|s| program(kind, stages, micro, s))
        .collect()
}

/// The bubble fraction of GPipe and 1F1B when every stage's forward costs the same
/// and every stage's backward costs the same: (P-1)/(M+P-1). Without a stage or a
/// micro-batch there is no pipeline and no bubble: 0.
pub fn predicted_bubble(stages: usize, micro: usize) -> f64 {
    if stages == 0 || micro == 0 {
        return 0.0;
    }
    (stages - 1) as f64 / (micro + stages - 1) as f64
}

/// What a successful check measured, with communication taking no time.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// Per stage, the time spent computing.
    pub busy: Vec<f64>,
    /// When the last stage finishes.
    pub makespan: f64,
    /// 1 - total busy time / (stages * makespan): the share of stage time spent idle.
    pub bubble: f64,
    /// Per stage, the most micro-batches whose activations were alive at once
    /// (forwards done minus backwards done).
    pub peak_alive: Vec<usize>,
    /// Per stage, each computation with its start time, in program order.
    pub timeline: Vec<Vec<(f64, Action)>>,
}

/// [`simulate`] with every forward costing 1 and every backward 2 (a backward computes
/// two products, for the input and the weight gradients, per forward product).
pub fn check(programs: &[Vec<Step>]) -> Result<Simulation, ScheduleError> {
    let n = programs.len();
    simulate(programs, &vec![1.0; n], &vec![2.0; n])
}

/// Runs the programs, one per stage, on a rendezvous transport: proves they cannot
/// deadlock and measures them, a forward on stage s costing `forward_cost[s]` and a
/// backward `backward_cost[s]`. The programs may be any, not only generated ones.
pub fn simulate(
    programs: &[Vec<Step>],
    forward_cost: &[f64],
    backward_cost: &[f64],
) -> Result<Simulation, ScheduleError> {
    simulate_with_transfers(programs, forward_cost, backward_cost, &|_, _| 0.0)
}

/// [`simulate`] with messages that take time: a message from stage `from` to stage
/// `to` takes `transfer(from, to)` seconds, during which both stages wait (a
/// rendezvous: the sender is done when the receiver has it).
pub fn simulate_with_transfers(
    programs: &[Vec<Step>],
    forward_cost: &[f64],
    backward_cost: &[f64],
    transfer: &dyn Fn(usize, usize) -> f64,
) -> Result<Simulation, ScheduleError> {
    let stages = programs.len();
    check_costs("forward", forward_cost, stages)?;
    check_costs("backward", backward_cost, stages)?;
    for (stage, prog) in programs.iter().enumerate() {
        check_static(stage, prog, stages)?;
    }
    let at = |stage: usize, pc: &[usize]| {
        programs[stage].get(pc[stage]).map(|&op| OpAt {
            stage,
            step: pc[stage],
            op,
        })
    };
    let mut pc = vec![0usize; stages];
    let mut clock = vec![0.0f64; stages];
    let mut busy = vec![0.0f64; stages];
    let mut alive = vec![0usize; stages];
    let mut peak_alive = vec![0usize; stages];
    let mut timeline = vec![Vec::new(); stages];
    // Every round but the last completes at least one step, so this bound is never hit.
    let limit = programs.iter().map(Vec::len).sum::<usize>() + 1;
    for _ in 0..limit {
        let mut moved = false;
        for s in 0..stages {
            // A stage runs until it blocks; a matched pair completes when either side
            // is visited, at the later of the two clocks.
            while let Some(head) = at(s, &pc) {
                let (send_at, recv_at) = match head.op {
                    Step::Compute(a) => {
                        let cost = match a {
                            Action::Forward(_) => forward_cost[s],
                            Action::Backward(_) => backward_cost[s],
                        };
                        timeline[s].push((clock[s], a));
                        clock[s] += cost;
                        busy[s] += cost;
                        match a {
                            Action::Forward(_) => alive[s] += 1,
                            // check_static saw this micro-batch's forward earlier.
                            Action::Backward(_) => alive[s] = alive[s].saturating_sub(1),
                        }
                        peak_alive[s] = peak_alive[s].max(alive[s]);
                        pc[s] += 1;
                        moved = true;
                        continue;
                    }
                    Step::Send { to, .. } => match at(to, &pc) {
                        Some(r) => (head, r),
                        None => break,
                    },
                    Step::Recv { from, .. } => match at(from, &pc) {
                        Some(r) => (r, head),
                        None => break,
                    },
                };
                let paired = matches!(send_at.op, Step::Send { to, .. } if to == recv_at.stage)
                    && matches!(recv_at.op, Step::Recv { from, .. } if from == send_at.stage);
                if !paired {
                    break;
                }
                if send_at.op.message() != recv_at.op.message() {
                    return Err(ScheduleError::Mismatch {
                        send: send_at,
                        recv: recv_at,
                    });
                }
                let t = clock[send_at.stage].max(clock[recv_at.stage])
                    + transfer(send_at.stage, recv_at.stage);
                clock[send_at.stage] = t;
                clock[recv_at.stage] = t;
                pc[send_at.stage] += 1;
                pc[recv_at.stage] += 1;
                moved = true;
            }
        }
        if (0..stages).all(|s| pc[s] == programs[s].len()) {
            let makespan = clock.iter().copied().fold(0.0, f64::max);
            let total: f64 = busy.iter().sum();
            let bubble = if makespan > 0.0 {
                1.0 - total / (stages as f64 * makespan)
            } else {
                0.0
            };
            return Ok(Simulation {
                busy,
                makespan,
                bubble,
                peak_alive,
                timeline,
            });
        }
        if !moved {
            return Err(ScheduleError::Deadlock(deadlock(programs, &pc)));
        }
    }
    Err(ScheduleError::RoundLimit(limit))
}

fn check_costs(which: &'static str, costs: &[f64], stages: usize) -> Result<(), ScheduleError> {
    let problem = if costs.len() != stages {
        format!("has {} entries", costs.len())
    } else if let Some((s, c)) = costs
        .iter()
        .enumerate()
        .find(|(_, c)| !(c.is_finite() && **c >= 0.0))
    {
        format!("gives stage {s} the cost {c}")
    } else {
        return Ok(());
    };
    Err(ScheduleError::BadCosts {
        which,
        problem,
        stages,
    })
}

/// What one program gets wrong on its own, whatever the others do: a peer out of
/// range or itself, a backward before its forward, a computation repeated.
fn check_static(stage: usize, prog: &[Step], stages: usize) -> Result<(), ScheduleError> {
    let mut forwarded = HashSet::new();
    let mut backwarded = HashSet::new();
    for (step, &op) in prog.iter().enumerate() {
        let at = OpAt { stage, step, op };
        let order_error = |why| Err(ScheduleError::Order { at, why });
        match op {
            Step::Send { to: peer, .. } | Step::Recv { from: peer, .. } => {
                if peer >= stages {
                    return Err(ScheduleError::PeerOutOfRange { at, peer, stages });
                }
                if peer == stage {
                    return Err(ScheduleError::SelfPeer { at });
                }
            }
            Step::Compute(Action::Forward(m)) => {
                if !forwarded.insert(m) {
                    return order_error("this micro-batch was already forwarded");
                }
            }
            Step::Compute(Action::Backward(m)) => {
                if !forwarded.contains(&m) {
                    return order_error("backward before the micro-batch's forward");
                }
                if !backwarded.insert(m) {
                    return order_error("this micro-batch was already backwarded");
                }
            }
        }
    }
    Ok(())
}

/// Describes a stuck state: each unfinished stage is at a send or receive (a compute
/// always moves), waiting for the peer it names.
fn deadlock(programs: &[Vec<Step>], pc: &[usize]) -> Deadlock {
    let head = |s: usize| {
        programs[s].get(pc[s]).map(|&op| OpAt {
            stage: s,
            step: pc[s],
            op,
        })
    };
    let peer_of = |s: usize| head(s).and_then(|a| a.op.peer());
    let blocked: Vec<Blocked> = (0..programs.len())
        .filter_map(|s| {
            let at = head(s)?;
            let peer = peer_of(s)?;
            Some(Blocked {
                at,
                peer,
                peer_at: head(peer),
            })
        })
        .collect();
    // Each blocked stage waits on one peer, so following waits from any stage ends at
    // a finished stage or enters a ring; the first start found on a ring is its
    // lowest stage.
    let mut cycle = Vec::new();
    for start in 0..programs.len() {
        let mut path = vec![start];
        let mut cur = start;
        for _ in 0..programs.len() {
            match peer_of(cur) {
                Some(next) if next == start => {
                    cycle = path;
                    break;
                }
                Some(next) if !path.contains(&next) => {
                    path.push(next);
                    cur = next;
                }
                _ => break,
            }
        }
        if !cycle.is_empty() {
            break;
        }
    }
    Deadlock { blocked, cycle }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two stages, one micro-batch, forwards of 1 and backwards of 2: 6 time units
    /// with free messages; a message of 1 each way holds both stages for it, 8.
    #[test]
    fn messages_that_take_time_hold_both_stages() {
        let programs = programs(ScheduleKind::OneFOneB, 2, 1).expect("programs");
        let free = simulate(&programs, &[1.0, 1.0], &[2.0, 2.0]).expect("runs");
        assert_eq!(free.makespan, 6.0);
        let slow = simulate_with_transfers(&programs, &[1.0, 1.0], &[2.0, 2.0], &|_, _| 1.0)
            .expect("runs");
        assert_eq!(slow.makespan, 8.0);
        // Stage 1's forward starts once the activations arrived; stage 0's backward
        // once the gradients did.
        assert_eq!(slow.timeline[1][0].0, 2.0);
        assert_eq!(slow.timeline[0][1].0, 6.0);
    }

    /// (P, M) with M < P, M == P, M > P, and a single stage.
    const SHAPES: [(usize, usize); 9] = [
        (1, 1),
        (1, 4),
        (2, 1),
        (2, 2),
        (3, 4),
        (4, 2),
        (4, 4),
        (4, 8),
        (5, 16),
    ];
    const KINDS: [ScheduleKind; 2] = [ScheduleKind::GPipe, ScheduleKind::OneFOneB];

    type R = Result<(), ScheduleError>;
    const ACT: Carried = Carried::Activation;

    /// The timeline of a [`check`] (forward 1, backward 2) as rows of one cell per
    /// time unit.
    fn picture(sim: &Simulation) -> Vec<String> {
        let width = sim.makespan.round() as usize;
        sim.timeline
            .iter()
            .enumerate()
            .map(|(s, row)| {
                let mut cells = vec![".".to_string(); width];
                for &(t, a) in row {
                    let (name, len) = match a {
                        Action::Forward(m) => (format!("F{m}"), 1),
                        Action::Backward(m) => (format!("B{m}"), 2),
                    };
                    let t = t.round() as usize;
                    for c in cells.iter_mut().skip(t).take(len) {
                        c.clone_from(&name);
                    }
                }
                let cells: Vec<String> = cells.iter().map(|c| format!("{c:<2}")).collect();
                format!("stage {s}  {}", cells.join(" "))
                    .trim_end()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn kind_spellings_round_trip() {
        for kind in KINDS {
            assert_eq!(kind.to_string().parse::<ScheduleKind>(), Ok(kind));
        }
        let err = "1F1B".parse::<ScheduleKind>().map_err(|e| e.to_string());
        assert_eq!(
            err,
            Err("unknown pipeline schedule `1F1B` (valid: gpipe, 1f1b)".into())
        );
    }

    #[test]
    fn degenerate_shapes_are_errors() {
        let k = ScheduleKind::OneFOneB;
        assert_eq!(actions(k, 0, 4, 0), Err(ScheduleError::NoStages));
        assert_eq!(actions(k, 2, 0, 0), Err(ScheduleError::NoMicroBatches));
        assert_eq!(
            program(k, 2, 4, 2),
            Err(ScheduleError::NoSuchStage {
                stage: 2,
                stages: 2
            })
        );
        assert_eq!(programs(k, 0, 4), Err(ScheduleError::NoStages));
    }

    #[test]
    fn every_micro_batch_once_forward_before_backward() -> R {
        for kind in KINDS {
            for (p, m) in SHAPES {
                for s in 0..p {
                    let acts = actions(kind, p, m, s)?;
                    assert_eq!(acts.len(), 2 * m, "{kind} P={p} M={m} stage {s}");
                    for mb in 0..m {
                        let f = acts.iter().position(|&a| a == Action::Forward(mb));
                        let b = acts.iter().position(|&a| a == Action::Backward(mb));
                        assert!(
                            matches!((f, b), (Some(f), Some(b)) if f < b),
                            "{kind} {s} m{mb}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    #[test]
    fn one_f_one_b_matches_the_header_picture() -> R {
        let sim = check(&programs(ScheduleKind::OneFOneB, 3, 4)?)?;
        let header: Vec<String> = include_str!("schedule.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! stage "))
            .map(|l| format!("stage {l}"))
            .collect();
        assert_eq!(picture(&sim), header);
        Ok(())
    }

    #[test]
    fn generated_schedules_pass_with_bounded_memory_and_predicted_bubble() -> R {
        for kind in KINDS {
            for (p, m) in SHAPES {
                let progs = programs(kind, p, m)?;
                for (f, b) in [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)] {
                    let sim = simulate(&progs, &vec![f; p], &vec![b; p])?;
                    let want = predicted_bubble(p, m);
                    assert!(
                        (sim.bubble - want).abs() < 1e-9,
                        "{kind} P={p} M={m}: {sim:?}"
                    );
                    assert!((sim.makespan - (m + p - 1) as f64 * (f + b)).abs() < 1e-9);
                }
                let sim = check(&progs)?;
                for s in 0..p {
                    let peak = sim.peak_alive[s];
                    match kind {
                        ScheduleKind::GPipe => assert_eq!(peak, m),
                        // The bound min(P - s, M) is reached: the warm-up plus one.
                        ScheduleKind::OneFOneB => assert_eq!(peak, (p - s).min(m)),
                    }
                    assert_eq!(sim.timeline[s].len(), 2 * m);
                }
            }
        }
        Ok(())
    }

    #[test]
    fn predicted_bubble_values() {
        assert_eq!(predicted_bubble(1, 8), 0.0);
        assert_eq!(predicted_bubble(4, 4), 3.0 / 7.0);
        assert_eq!(predicted_bubble(0, 4), 0.0);
    }

    #[test]
    fn mutual_sends_are_a_deadlock_naming_both_ops() {
        let progs = vec![
            vec![Step::Compute(Action::Forward(1)), send(1, ACT, 1)],
            vec![send(0, Carried::Gradient, 0)],
        ];
        let err = check(&progs).map_err(|e| e.to_string());
        let want = "deadlock on a rendezvous transport: stages 0 and 1 wait on each other\n  \
            stage 0 step 1 `send activation m1 -> stage 1` waits for stage 1, which is at \
            step 0 `send gradient m0 -> stage 0`\n  \
            stage 1 step 0 `send gradient m0 -> stage 0` waits for stage 0, which is at \
            step 1 `send activation m1 -> stage 1`";
        assert_eq!(err, Err(want.to_string()));
    }

    #[test]
    fn a_ring_and_a_finished_peer_are_named() {
        let ring = vec![
            vec![recv(2, ACT, 0)],
            vec![recv(0, ACT, 0)],
            vec![recv(1, ACT, 0)],
        ];
        assert!(matches!(check(&ring), Err(ScheduleError::Deadlock(d)) if d.cycle == [0, 2, 1]));
        let orphan = vec![vec![], vec![recv(0, ACT, 0)]];
        let err = check(&orphan).map_err(|e| e.to_string());
        assert!(
            matches!(&err, Err(e) if e.contains("waits for stage 0, which has finished")),
            "{err:?}"
        );
    }

    #[test]
    fn receiving_micro_batches_out_of_order_names_the_pair() {
        let progs = vec![
            vec![send(1, ACT, 0), send(1, ACT, 1)],
            vec![recv(0, ACT, 1), recv(0, ACT, 0)],
        ];
        let err = check(&progs).map_err(|e| e.to_string());
        let want = "stage 0 step 0 `send activation m0 -> stage 1` meets stage 1 step 0 \
            `recv activation m1 <- stage 0`, which expects another message";
        assert_eq!(err, Err(want.to_string()));
    }

    #[test]
    fn bad_peers_and_orders_are_refused() {
        let far = vec![vec![send(5, ACT, 0)], vec![]];
        assert!(matches!(
            check(&far),
            Err(ScheduleError::PeerOutOfRange {
                peer: 5,
                stages: 2,
                ..
            })
        ));
        let own = vec![vec![], vec![recv(1, ACT, 0)]];
        assert!(matches!(check(&own), Err(ScheduleError::SelfPeer { at }) if at.stage == 1));
        let early = vec![vec![Step::Compute(Action::Backward(0))]];
        assert!(matches!(check(&early), Err(ScheduleError::Order { .. })));
        let costs = simulate(&[vec![]], &[1.0], &[f64::NAN]);
        assert!(matches!(
            costs,
            Err(ScheduleError::BadCosts {
                which: "backward",
                ..
            })
        ));
        let short = simulate(&[vec![], vec![]], &[1.0], &[1.0, 1.0]);
        assert!(matches!(
            short,
            Err(ScheduleError::BadCosts {
                which: "forward",
                ..
            })
        ));
    }

    #[test]
    fn undoing_the_activation_first_exchange_deadlocks() -> R {
        // The plain "receive, compute, send" order of 1F1B, with the upper stage's
        // gradient send put back before its next activation receive.
        let mut progs = programs(ScheduleKind::OneFOneB, 2, 2)?;
        let i = progs[1]
            .iter()
            .position(|s| matches!(s, Step::Recv { micro: 1, .. }));
        assert!(matches!(i, Some(i) if matches!(progs[1][i + 1], Step::Send { .. })));
        if let Some(i) = i {
            progs[1].swap(i, i + 1);
        }
        let err = check(&progs).map_err(|e| e.to_string());
        let want = "stage 0 step 3 `send activation m1 -> stage 1` waits for stage 1, which \
            is at step 3 `send gradient m0 -> stage 0`";
        assert!(matches!(&err, Err(e) if e.contains(want)), "{err:?}");
        Ok(())
    }

    #[test]
    fn swapping_two_receives_of_a_generated_program_is_a_mismatch() -> R {
        let mut progs = programs(ScheduleKind::GPipe, 3, 3)?;
        // Stage 1 is `recv a m0, forward m0, send a m0, recv a m1, ...`.
        progs[1].swap(0, 3);
        let err = check(&progs);
        assert!(matches!(err, Err(ScheduleError::Mismatch { send, recv })
            if send.stage == 0 && recv.stage == 1 && recv.step == 0));
        Ok(())
    }
}
