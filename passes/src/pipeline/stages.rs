//! Cutting a trained one-device graph (after autodiff) into P contiguous pipeline
//! stages: an analysis over `&Graph`, which the pipeline rewrite turns into one
//! program per stage.
//!
//! **Forward nodes** are the ancestors of the `loss` and `output` sinks (and those
//! sinks). Their kernels, in the graph's topological order, are cut into P non-empty
//! contiguous runs: any prefix of a topological order is closed under inputs, so every
//! forward value flows to its own stage or a later one. Each kernel weighs its share
//! of the flops ([`crate::cost::node_flops`]: its own and those of the backward kernels
//! that go with it) plus its share of the memory
//! (its results, and the variables it is the first to read); the cut minimises the
//! heaviest stage (a bisection on the bound, packed greedily, so it is optimal for
//! that bound to within the bisection's precision).
//!
//! With `pipeline_stage` markers in the model, the cut is the user's instead: each
//! variable is on the stage of the statement that first uses it, and each forward
//! kernel on the latest stage of its variables and inputs ([`partition_with`]).
//!
//! **Backward nodes** (every other kernel) go where their forward op went, which the
//! graph does not record, so it is recovered from what they read: the latest stage of
//! the variables (`dx = dy @ w^T` needs `w`) and forward values (`relu_grad` reads its
//! pre-activation) they read, but never a stage before one of their readers', since a
//! gradient can only travel to an earlier stage (its backward runs later). A node that
//! reads neither goes with its latest reader, a `param_grad` sink being on its
//! variable's stage. Reverse topological order settles readers first.
//!
//! **Sources** are not placed: a variable is held by every stage whose kernels read
//! it. One held by several stages (a tied embedding) is updated on the first
//! ([`StagePlan::tied`]): the gradient contributions of the others travel back to it
//! like any gradient and are summed there as on one device, and the updated value goes
//! to the other holders after each step. A backward kernel reading a tied variable
//! goes to the first of its stages that its readers allow. Inputs and constants are
//! fed or built where read.
//!
//! **Crossings** are the values a stage reads from another: forward values going
//! to a later stage travel after that micro-batch's forward; every value going to an
//! earlier stage (activation gradients, and a forward value an earlier stage's
//! backward reads) travels after the producing stage's backward of it.

use crate::cost::node_flops;
use distc_ir::{Graph, NodeId, Op, ValueId};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use thiserror::Error;

/// Bisection steps for the heaviest-stage bound: relative precision 2^-60.
const BISECTION_STEPS: usize = 60;

/// Why a graph cannot be cut.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum StageError {
    /// Zero stages asked for.
    #[error("--pipeline needs at least 1 stage")]
    NoStages,
    /// Fewer forward kernels than stages.
    #[error("the model has {kernels} forward kernels, too few to cut into {stages} stages")]
    TooFewKernels {
        /// Forward kernels in the graph.
        kernels: usize,
        /// Stages asked for.
        stages: usize,
    },
    /// The model's markers make another number of stages than asked for.
    #[error(
        "the model's pipeline_stage markers make {marked} stages, --pipeline asks for \
         {stages}: give --pipeline {marked}, or move the markers"
    )]
    Marked {
        /// Stages the markers make.
        marked: usize,
        /// Stages asked for.
        stages: usize,
    },
    /// A marked stage got no kernel: its variables are all read by kernels that also
    /// read a later stage's values.
    #[error(
        "marked stage {stage} computes nothing of its own: its variables ({variables}) are \
         read only by operations on later stages; move its pipeline_stage marker"
    )]
    EmptyMarkedStage {
        /// The empty stage.
        stage: usize,
        /// Its variables.
        variables: String,
    },
    /// No `loss` sink: nothing says what is forward.
    #[error("the graph has no loss: pipeline stages cut a trained graph")]
    NoLoss,
}

/// Which way a crossing value travels, and so with which message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Direction {
    /// To a later stage, after the producer's forward of the micro-batch.
    Forward,
    /// To an earlier stage, after the producer's backward of the micro-batch.
    Backward,
}

/// One value a stage reads from another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Crossing {
    /// The value.
    pub value: ValueId,
    /// The producing stage.
    pub from: usize,
    /// The reading stage.
    pub to: usize,
    /// Its bytes per micro-batch (slices at their row bound).
    pub bytes: usize,
    /// Which message carries it.
    pub direction: Direction,
}

/// What one stage holds and does, per micro-batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StageStats {
    /// Variables it holds, in graph order.
    pub variables: Vec<String>,
    /// Bytes of those variables.
    pub param_bytes: usize,
    /// Forward and backward flops of one micro-batch.
    pub forward_flops: f64,
    /// Backward flops of one micro-batch.
    pub backward_flops: f64,
    /// Bytes of the forward values a micro-batch's backward reads on this stage
    /// (computed here or received): what stays alive from a micro-batch's forward to
    /// its backward, per micro-batch in flight.
    pub stashed_bytes: usize,
    /// Bytes this stage sends per micro-batch (both directions).
    pub sent_bytes: usize,
    /// Bytes it receives per micro-batch.
    pub received_bytes: usize,
}

/// The cut: where every kernel runs, and what crosses.
#[derive(Clone, Debug, PartialEq)]
pub struct StagePlan {
    /// Number of stages.
    pub stages: usize,
    /// The stage of every kernel and sink (sources are held where read: [`Self::readers`]).
    pub stage_of: HashMap<NodeId, usize>,
    /// Every node that is forward (an ancestor of the loss or an output, or one).
    pub forward: HashSet<NodeId>,
    /// The stages reading each source (variable, input, constant), ascending.
    pub readers: HashMap<NodeId, Vec<usize>>,
    /// Values read on another stage than their producer's, in graph order.
    pub crossings: Vec<Crossing>,
    /// Per stage.
    pub stats: Vec<StageStats>,
    /// Variables held by more than one stage, with those stages: their gradients are
    /// summed across them.
    pub tied: Vec<(String, Vec<usize>)>,
}

/// Cuts `g` into `stages` stages balanced by the cost model (see the module doc).
pub fn partition(g: &Graph, stages: usize) -> Result<StagePlan, StageError> {
    partition_with(g, stages, None)
}

/// Cuts `g` into `stages` stages: where the model's `pipeline_stage` markers say when
/// `marks` is given (each variable's stage: the stage of the statement first using
/// it), else balanced by the cost model. A marked cut puts each forward kernel on the
/// latest stage of the variables it reads and of its inputs.
pub fn partition_with(
    g: &Graph,
    stages: usize,
    marks: Option<&BTreeMap<String, usize>>,
) -> Result<StagePlan, StageError> {
    if stages == 0 {
        return Err(StageError::NoStages);
    }
    if g.loss().is_none() {
        return Err(StageError::NoLoss);
    }
    let order = g.topo_order();
    let forward = forward_nodes(g, &order);
    let kernels: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|id| forward.contains(id) && !g.op(*id).is_source() && !g.op(*id).is_sink())
        .collect();
    if kernels.len() < stages {
        return Err(StageError::TooFewKernels {
            kernels: kernels.len(),
            stages,
        });
    }
    let cut = match marks {
        Some(marks) => marked_cut(g, &kernels, marks, stages)?,
        None => cut(&kernel_weights(g, &order, &forward, &kernels), stages),
    };
    let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
    for (k, id) in kernels.iter().enumerate() {
        stage_of.insert(*id, cut[k]);
    }
    // Forward sinks where their input is.
    for id in &order {
        if forward.contains(id) && g.op(*id).is_sink() {
            let s = producer_stage(g, &stage_of, *id).unwrap_or(stages - 1);
            stage_of.insert(*id, s);
        }
    }
    // The stages reading each variable forward, ascending: its update runs on the
    // first; a tied one is read on several.
    let mut var_readers: HashMap<String, Vec<usize>> = HashMap::new();
    for (id, name, _) in g.params() {
        let read: BTreeSet<usize> = g
            .user_nodes(id)
            .iter()
            .filter(|u| forward.contains(u))
            .filter_map(|u| stage_of.get(u).copied())
            .collect();
        var_readers.insert(name.to_string(), read.into_iter().collect());
    }
    // Backward: where its forward op is, as far as what it reads shows it (a variable's
    // stage, a forward value's stage), and never before a reader (gradients only flow
    // to earlier stages, whose backward runs later).
    for id in order.iter().rev() {
        let op = g.op(*id);
        if forward.contains(id) || op.is_source() {
            continue;
        }
        let s = match op {
            Op::ParamGrad { param } => var_readers.get(param).and_then(|r| r.first().copied()),
            _ => {
                let readers = g
                    .user_nodes(*id)
                    .iter()
                    .filter_map(|u| stage_of.get(u).copied())
                    .max();
                let hint = g
                    .node(*id)
                    .inputs
                    .iter()
                    .filter_map(|v| match g.op(v.node) {
                        // Of a tied variable's stages, the first its readers allow: the
                        // backward of the use there (`dx = dy @ w^T` of the later use
                        // has its readers on that stage or the one before).
                        Op::Param { name, .. } => var_readers.get(name).and_then(|held| {
                            let floor = readers.unwrap_or(0);
                            held.iter()
                                .copied()
                                .find(|&s| s >= floor)
                                .or(held.last().copied())
                        }),
                        _ if forward.contains(&v.node) => stage_of.get(&v.node).copied(),
                        _ => None,
                    })
                    .max();
                hint.max(readers)
            }
        };
        stage_of.insert(*id, s.unwrap_or(stages - 1));
    }
    let mut readers: HashMap<NodeId, Vec<usize>> = HashMap::new();
    for id in &order {
        if !g.op(*id).is_source() {
            continue;
        }
        let set: BTreeSet<usize> = g
            .user_nodes(*id)
            .iter()
            .filter_map(|u| stage_of.get(u).copied())
            .collect();
        readers.insert(*id, set.into_iter().collect());
    }
    let crossings = crossings(g, &order, &stage_of, &forward);
    let mut stats = vec![StageStats::default(); stages];
    let mut tied = Vec::new();
    for (id, name, ty) in g.params() {
        let held = readers.get(&id).cloned().unwrap_or_default();
        for &s in &held {
            stats[s].variables.push(name.to_string());
            stats[s].param_bytes += ty.bytes();
        }
        if held.len() > 1 {
            tied.push((name.to_string(), held));
        }
    }
    for id in &order {
        let Some(&s) = stage_of.get(id) else {
            continue;
        };
        let f = node_flops(g, *id);
        if forward.contains(id) {
            stats[s].forward_flops += f;
        } else {
            stats[s].backward_flops += f;
        }
    }
    // Stashed: forward values (computed or received) that a backward kernel of the
    // stage reads.
    let mut stashed: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); stages];
    for id in &order {
        if forward.contains(id) || g.op(*id).is_source() {
            continue;
        }
        let Some(&s) = stage_of.get(id) else {
            continue;
        };
        for v in &g.node(*id).inputs {
            if forward.contains(&v.node) && !g.op(v.node).is_source() {
                stashed[s].insert(*v);
            }
        }
    }
    for (s, vals) in stashed.iter().enumerate() {
        stats[s].stashed_bytes = vals.iter().map(|v| g.value_type(*v).bytes()).sum();
    }
    for c in &crossings {
        stats[c.from].sent_bytes += c.bytes;
        stats[c.to].received_bytes += c.bytes;
    }
    Ok(StagePlan {
        stages,
        stage_of,
        forward,
        readers,
        crossings,
        stats,
        tied,
    })
}

/// The ancestors of the `loss` and `output` sinks, and those sinks.
fn forward_nodes(g: &Graph, order: &[NodeId]) -> HashSet<NodeId> {
    let mut seen: HashSet<NodeId> = HashSet::new();
    let mut stack: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|id| matches!(g.op(*id), Op::Loss | Op::Output { .. }))
        .collect();
    while let Some(id) = stack.pop() {
        if seen.insert(id) {
            stack.extend(g.node(id).inputs.iter().map(|v| v.node));
        }
    }
    seen
}

/// Each forward kernel's share of the flops (its own, and its backward's) plus its
/// share of the memory.
fn kernel_weights(
    g: &Graph,
    order: &[NodeId],
    forward: &HashSet<NodeId>,
    kernels: &[NodeId],
) -> Vec<f64> {
    // Each variable's first forward reader, by node and by name.
    let mut first_reader: HashMap<NodeId, usize> = HashMap::new();
    let mut first_reader_of: HashMap<&str, usize> = HashMap::new();
    for (k, id) in kernels.iter().enumerate() {
        for v in &g.node(*id).inputs {
            if let Op::Param { name, .. } = g.op(v.node) {
                first_reader.entry(v.node).or_insert(k);
                first_reader_of.entry(name.as_str()).or_insert(k);
            }
        }
    }
    let mut flops: Vec<f64> = kernels.iter().map(|id| node_flops(g, *id)).collect();
    // A backward kernel's flops count with the forward kernel it goes with, found as
    // the cut places it (reverse order, readers first): the latest of the forward
    // results and variables it reads and of where its readers went, a `param_grad`
    // going with its variable's first reader. The backward is about twice the forward,
    // but not everywhere (the first layer computes no input gradient): a cut by
    // forward flops alone leaves the stages' steps unequal.
    let index: HashMap<NodeId, usize> =
        kernels.iter().enumerate().map(|(k, id)| (*id, k)).collect();
    let mut with: HashMap<NodeId, usize> = HashMap::new();
    for id in order.iter().rev() {
        let op = g.op(*id);
        if forward.contains(id) || op.is_source() {
            continue;
        }
        let k = if let Op::ParamGrad { param } = op {
            first_reader_of.get(param.as_str()).copied()
        } else {
            let read = g
                .node(*id)
                .inputs
                .iter()
                .filter_map(|v| index.get(&v.node).or_else(|| first_reader.get(&v.node)))
                .copied()
                .max();
            let readers = g
                .user_nodes(*id)
                .iter()
                .filter_map(|u| with.get(u))
                .copied()
                .max();
            read.max(readers)
        };
        if let Some(k) = k {
            with.insert(*id, k);
            if !op.is_sink() {
                flops[k] += node_flops(g, *id);
            }
        }
    }
    let mut memory: Vec<f64> = kernels
        .iter()
        .map(|id| g.node(*id).outputs.iter().map(|t| t.bytes() as f64).sum())
        .collect();
    for (p, k) in &first_reader {
        if let Op::Param { ty, .. } = g.op(*p) {
            memory[*k] += ty.bytes() as f64;
        }
    }
    let (tf, tm) = (flops.iter().sum::<f64>(), memory.iter().sum::<f64>());
    flops
        .iter()
        .zip(&memory)
        .map(|(f, m)| share(*f, tf) + share(*m, tm))
        .collect()
}

fn share(x: f64, total: f64) -> f64 {
    if total > 0.0 {
        x / total
    } else {
        0.0
    }
}

/// The stage of each of `weights` (in order): `stages` non-empty contiguous runs
/// whose heaviest is as light as the bisection finds. Needs `weights.len() >= stages`.
fn cut(weights: &[f64], stages: usize) -> Vec<usize> {
    let n = weights.len();
    // Runs greedily packed under `bound`; a run also ends when the kernels left are
    // as many as the stages still empty, so every stage gets one.
    let pack = |bound: f64| -> Option<Vec<usize>> {
        let mut out = Vec::with_capacity(n);
        let (mut stage, mut load) = (0usize, 0.0f64);
        for (k, &w) in weights.iter().enumerate() {
            let started = out.last() == Some(&stage);
            let empty_after = stages - 1 - stage;
            if started && stage + 1 < stages && (load + w > bound || n - k <= empty_after) {
                stage += 1;
                load = 0.0;
            }
            load += w;
            if load > bound {
                return None;
            }
            out.push(stage);
        }
        Some(out)
    };
    let total: f64 = weights.iter().sum();
    let (mut lo, mut hi) = (0.0f64, total.max(f64::MIN_POSITIVE));
    let mut best = pack(hi);
    for _ in 0..BISECTION_STEPS {
        let mid = 0.5 * (lo + hi);
        match pack(mid) {
            Some(p) => {
                best = Some(p);
                hi = mid;
            }
            None => lo = mid,
        }
    }
    // Packing under the total always succeeds when n >= stages (each run takes what
    // the bound allows and leaves one kernel per later stage); the fallback is even
    // runs by count.
    best.unwrap_or_else(|| (0..n).map(|k| k * stages / n).collect())
}

/// The stage of each of `kernels` (in topological order) as the markers say: the
/// latest of its variables' marked stages and its inputs' stages.
fn marked_cut(
    g: &Graph,
    kernels: &[NodeId],
    marks: &BTreeMap<String, usize>,
    stages: usize,
) -> Result<Vec<usize>, StageError> {
    let marked = marks.values().max().map_or(1, |m| m + 1);
    if marked != stages {
        return Err(StageError::Marked { marked, stages });
    }
    let mut at: HashMap<NodeId, usize> = HashMap::new();
    let mut cut = Vec::with_capacity(kernels.len());
    for id in kernels {
        let s = g
            .node(*id)
            .inputs
            .iter()
            .filter_map(|v| match g.op(v.node) {
                Op::Param { name, .. } => marks.get(name).copied(),
                _ => at.get(&v.node).copied(),
            })
            .max()
            .unwrap_or(0);
        at.insert(*id, s);
        cut.push(s);
    }
    if let Some(empty) = (0..stages).find(|s| !cut.contains(s)) {
        let vars: Vec<String> = marks
            .iter()
            .filter(|(_, &s)| s == empty)
            .map(|(n, _)| format!("`{n}`"))
            .collect();
        return Err(StageError::EmptyMarkedStage {
            stage: empty,
            variables: vars.join(", "),
        });
    }
    Ok(cut)
}

/// The stage of the first input's producer that has one.
fn producer_stage(g: &Graph, stage_of: &HashMap<NodeId, usize>, id: NodeId) -> Option<usize> {
    g.node(id)
        .inputs
        .iter()
        .filter_map(|v| stage_of.get(&v.node).copied())
        .max()
}

fn crossings(
    g: &Graph,
    order: &[NodeId],
    stage_of: &HashMap<NodeId, usize>,
    forward: &HashSet<NodeId>,
) -> Vec<Crossing> {
    let mut out: BTreeMap<(ValueId, usize), Crossing> = BTreeMap::new();
    for id in order {
        let Some(&to) = stage_of.get(id) else {
            continue;
        };
        for v in &g.node(*id).inputs {
            let Some(&from) = stage_of.get(&v.node) else {
                continue;
            };
            if from == to {
                continue;
            }
            let direction = if from < to && forward.contains(&v.node) {
                Direction::Forward
            } else {
                Direction::Backward
            };
            out.entry((*v, to)).or_insert(Crossing {
                value: *v,
                from,
                to,
                bytes: g.value_type(*v).bytes(),
                direction,
            });
        }
    }
    out.into_values().collect()
}
