//! Activation checkpointing (`--remat layers|MIB`): drops chosen forward activations
//! after the forward pass and recomputes them in the backward pass, trading compute
//! for activation memory. Gradients are unchanged: a recomputation is a copy of the
//! forward node, reading the same kept values (dropout masks are a function of seed,
//! step and element, so a recomputed dropout drops the same elements).
//!
//! The backward pass's reads of a dropped activation go to a copy of its forward
//! subgraph that starts at kept values: checkpoints, sources (inputs, parameters,
//! constants) and nodes never recomputed (embedding lookups, whose copies would be a
//! second pull under the parameter-server strategies). Each copy is emitted just
//! before its first backward reader, and the graph is rebuilt in that order so the
//! executor, which runs nodes lowest id first, frees the originals at the end of the
//! forward pass and holds a copy only while its layer's backward pass runs. Runs after
//! `simplify` (which would merge the copies back into the originals) and `accumulate`;
//! a no-op without `--remat`. Before/after, checkpointing the layer input `%3`:
//! ```text
//! %4 = matmul %3, %w                  %4 = matmul %3, %w
//! %5 = add %4, %b                     %5 = add %4, %b
//! %6 = relu %5                        %6 = relu %5
//! ...                          =>     ...
//! %20 = relu_grad %19, %5             %20 = matmul %3, %w      (recomputed)
//!                                     %21 = add %20, %b        (recomputed)
//!                                     %22 = relu_grad %19, %21
//! ```

use crate::placement::RematPolicy;
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{Graph, NodeId, Op};
use std::collections::{HashMap, HashSet};

/// The activation checkpointing rewrite.
pub struct Remat;

const MIB: f64 = 1024.0 * 1024.0;

impl Pass for Remat {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let policy = cx.strategy.remat;
        if policy == RematPolicy::Off {
            return Ok(PassStats::default());
        }
        let Some(loss) = g.loss() else {
            return Err(PassError::Precondition(
                "--remat needs a training graph (no loss found)".into(),
            ));
        };
        let order = g.topo_order();
        let roles = Roles::of(g, loss.node);
        let boundaries = roles.layer_boundaries(g, &order);
        let plain = peak_activation_bytes(g, &order);
        let (plan, rewritten, peak) = match policy {
            RematPolicy::Off => unreachable!("returned above"),
            RematPolicy::Layers => {
                let (out, copies) =
                    rewrite(g, &order, &roles, &boundaries.iter().copied().collect());
                let peak = peak_activation_bytes(&out, &out.topo_order());
                ("layers".to_string(), Some((out, copies)), peak)
            }
            RematPolicy::Budget(mib) => {
                let budget = (mib * MIB) as usize;
                if plain <= budget {
                    ("none needed".to_string(), None, plain)
                } else {
                    let mut chosen = None;
                    let mut smallest = (usize::MAX, String::new());
                    for (name, kept) in budget_candidates(&boundaries) {
                        let (out, copies) = rewrite(g, &order, &roles, &kept);
                        let peak = peak_activation_bytes(&out, &out.topo_order());
                        if peak <= budget {
                            chosen = Some((name, Some((out, copies)), peak));
                            break;
                        }
                        if peak < smallest.0 {
                            smallest = (peak, name);
                        }
                    }
                    chosen.ok_or_else(|| {
                        PassError::Precondition(format!(
                            "--remat {mib}: no checkpoint choice brings the predicted peak of \
                             activations ({:.2} MiB without checkpointing) down to {mib} MiB; \
                             the smallest is {:.2} MiB ({}); give a budget of at least that",
                            plain as f64 / MIB,
                            // Rounded up: the budget printed must itself be met.
                            (smallest.0 as f64 / MIB * 100.0).ceil() / 100.0,
                            smallest.1
                        ))
                    })?
                }
            }
        };
        let mut stats = PassStats::default().count("layer_boundaries", boundaries.len());
        if let Some((out, copies)) = rewritten {
            *g = out;
            stats = stats.count("recomputed", copies);
        }
        stats.note = Some(format!(
            "checkpoints: {plan}; predicted peak of activations {:.2} -> {:.2} MiB",
            plain as f64 / MIB,
            peak as f64 / MIB
        ));
        Ok(stats)
    }
}

/// Forward and backward nodes of a training graph.
struct Roles {
    /// The loss and everything it depends on.
    forward: HashSet<NodeId>,
    /// Nodes outside the forward pass that lead to a `param_grad`.
    backward: HashSet<NodeId>,
}

impl Roles {
    fn of(g: &Graph, loss: NodeId) -> Roles {
        let forward = ancestors(g, [loss], |_| true);
        let sinks = g
            .node_ids()
            .into_iter()
            .filter(|&id| matches!(g.op(id), Op::ParamGrad { .. }));
        let backward = ancestors(g, sinks, |id| !forward.contains(&id));
        Roles { forward, backward }
    }

    /// Whether a copy of forward node `id` can stand in for it: a pure computation
    /// that reads something (sources are kept, they cost nothing to keep).
    fn recomputable(&self, g: &Graph, id: NodeId) -> bool {
        let op = g.op(id);
        self.forward.contains(&id)
            && !g.node(id).inputs.is_empty()
            && !op.is_source()
            && !op.is_sink()
            && !op.is_communication()
            && !matches!(op, Op::Embedding | Op::Accumulate { .. })
    }

    /// The activations entering a layer: the non-parameter input of each forward
    /// `matmul` and `conv2d`, in forward order.
    fn layer_boundaries(&self, g: &Graph, order: &[NodeId]) -> Vec<NodeId> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for &id in order {
            if !self.forward.contains(&id)
                || !matches!(g.op(id), Op::MatMul { .. } | Op::Conv2d { .. })
            {
                continue;
            }
            for v in &g.node(id).inputs {
                if self.recomputable(g, v.node) && seen.insert(v.node) {
                    out.push(v.node);
                }
            }
        }
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        out.sort_by_key(|n| pos[n]);
        out
    }
}

/// `from` and every node they depend on, through nodes `follow` admits.
fn ancestors(
    g: &Graph,
    from: impl IntoIterator<Item = NodeId>,
    follow: impl Fn(NodeId) -> bool,
) -> HashSet<NodeId> {
    let mut seen = HashSet::new();
    let mut stack: Vec<NodeId> = from.into_iter().filter(|&id| follow(id)).collect();
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        for v in &g.node(id).inputs {
            if follow(v.node) && !seen.contains(&v.node) {
                stack.push(v.node);
            }
        }
    }
    seen
}

/// The checkpoint sets a budget tries, fewest recomputations first: every layer
/// boundary kept, then every 2nd, 4th, ..., then none.
fn budget_candidates(boundaries: &[NodeId]) -> Vec<(String, HashSet<NodeId>)> {
    let mut out = vec![(
        "every layer boundary".to_string(),
        boundaries.iter().copied().collect(),
    )];
    let mut every = 2;
    while every < boundaries.len() {
        let kept = boundaries.iter().copied().step_by(every).collect();
        out.push((format!("every {every}th layer boundary"), kept));
        every *= 2;
    }
    if !boundaries.is_empty() {
        out.push((
            "no checkpoint: everything recomputed from the inputs".to_string(),
            HashSet::new(),
        ));
    }
    out
}

/// `g` rebuilt in `order`, with every backward read of a recomputable forward node
/// outside `kept` redirected to a copy emitted just before its first backward reader.
/// Returns the graph and the number of copies.
fn rewrite(g: &Graph, order: &[NodeId], roles: &Roles, kept: &HashSet<NodeId>) -> (Graph, usize) {
    let keep = also_kept(g, order, roles, kept);
    let dropped =
        |id: NodeId| roles.recomputable(g, id) && !kept.contains(&id) && !keep.contains(&id);
    let mut out = Graph::new(g.name.clone());
    let mut new_id: HashMap<NodeId, NodeId> = HashMap::with_capacity(order.len());
    let mut copy: HashMap<NodeId, NodeId> = HashMap::new();
    for &id in order {
        let node = g.node(id);
        let backward = roles.backward.contains(&id);
        if backward {
            for v in &node.inputs {
                if dropped(v.node) {
                    emit_copies(g, v.node, &dropped, &new_id, &mut copy, &mut out);
                }
            }
        }
        let inputs = node
            .inputs
            .iter()
            .map(|v| {
                let src = if backward && dropped(v.node) {
                    copy[&v.node]
                } else {
                    new_id[&v.node]
                };
                src.out(v.port)
            })
            .collect();
        let nid = out.add_typed(node.op.clone(), inputs, node.outputs.clone());
        new_id.insert(id, nid);
    }
    let copies = copy.len();
    (out, copies)
}

/// Forward nodes that dropping would not free, kept beside the checkpoints: those
/// read outside the forward and backward passes (an `output` holds them to the end of
/// the step anyway), and the segment after the last checkpoint (the loss head, whose
/// backward pass starts as soon as the forward pass ends).
fn also_kept(
    g: &Graph,
    order: &[NodeId],
    roles: &Roles,
    kept: &HashSet<NodeId>,
) -> HashSet<NodeId> {
    let mut out: HashSet<NodeId> = roles
        .forward
        .iter()
        .copied()
        .filter(|&id| {
            g.user_nodes(id)
                .iter()
                .any(|u| !roles.forward.contains(u) && !roles.backward.contains(u))
        })
        .collect();
    if let Some(&last) = order.iter().rev().find(|id| kept.contains(id)) {
        let mut stack = vec![last];
        while let Some(id) = stack.pop() {
            for u in g.user_nodes(id) {
                if roles.forward.contains(&u) && out.insert(u) {
                    stack.push(u);
                }
            }
        }
    }
    out
}

/// Emits into `out` a copy of `root` and of every dropped node it reads that has no
/// copy yet, inputs first (iteratively: a chain can be as long as the forward pass).
fn emit_copies(
    g: &Graph,
    root: NodeId,
    dropped: &impl Fn(NodeId) -> bool,
    new_id: &HashMap<NodeId, NodeId>,
    copy: &mut HashMap<NodeId, NodeId>,
    out: &mut Graph,
) {
    let mut stack = vec![(root, false)];
    while let Some((id, inputs_done)) = stack.pop() {
        if copy.contains_key(&id) {
            continue;
        }
        let node = g.node(id);
        if !inputs_done {
            stack.push((id, true));
            for v in &node.inputs {
                if dropped(v.node) && !copy.contains_key(&v.node) {
                    stack.push((v.node, false));
                }
            }
            continue;
        }
        let inputs = node
            .inputs
            .iter()
            .map(|v| {
                let src = if dropped(v.node) {
                    copy[&v.node]
                } else {
                    new_id[&v.node]
                };
                src.out(v.port)
            })
            .collect();
        copy.insert(
            id,
            out.add_typed(node.op.clone(), inputs, node.outputs.clone()),
        );
    }
}

/// The most bytes of computed values alive at once when `g` runs in `order`, each
/// value freed after its last reader (sources excluded: they are parameters, feeds
/// and constants, not activations).
pub fn peak_activation_bytes(g: &Graph, order: &[NodeId]) -> usize {
    peak_bytes_of(g, order, |op| !op.is_source())
}

/// [`peak_activation_bytes`] as a run's metrics count activations: the accumulated
/// gradients (`accumulate` results, which a run holds as gradients) left out too.
pub fn peak_activation_bytes_without_gradients(g: &Graph, order: &[NodeId]) -> usize {
    peak_bytes_of(g, order, |op| {
        !op.is_source() && !matches!(op, distc_ir::Op::Accumulate { .. })
    })
}

/// The most bytes alive at once of the values of nodes `counted` says, each freed
/// after its last reader.
fn peak_bytes_of(g: &Graph, order: &[NodeId], counted: impl Fn(&distc_ir::Op) -> bool) -> usize {
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut last_use: HashMap<NodeId, usize> = HashMap::new();
    for (i, &id) in order.iter().enumerate() {
        for v in &g.node(id).inputs {
            let e = last_use.entry(v.node).or_insert(i);
            *e = (*e).max(i);
        }
    }
    let mut frees: Vec<usize> = vec![0; order.len()];
    let (mut live, mut peak) = (0usize, 0usize);
    for (i, &id) in order.iter().enumerate() {
        let node = g.node(id);
        if counted(&node.op) {
            let bytes: usize = node.outputs.iter().map(|t| t.bytes()).sum();
            live += bytes;
            peak = peak.max(live);
            // A value nobody reads is dropped at once.
            let at = last_use.get(&id).copied().unwrap_or(pos[&id]);
            frees[at] += bytes;
        }
        live -= frees[i];
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::StrategyConfig;
    use distc_ir::parse;

    #[test]
    fn budget_candidates_go_from_every_boundary_to_none() {
        let ids: Vec<NodeId> = (0..8).map(NodeId).collect();
        let c = budget_candidates(&ids);
        let sizes: Vec<usize> = c.iter().map(|(_, k)| k.len()).collect();
        assert_eq!(sizes, vec![8, 4, 2, 0]);
    }

    #[test]
    fn peak_frees_values_after_their_last_reader() {
        let g = parse(
            "graph t {\n  %0 = input{name=\"x\"} : f32[256]\n  %1 = relu %0 : f32[256]\n  %2 = relu %1 : f32[256]\n  %3 = relu %2 : f32[256]\n  %4 = sum_to{shape=[]} %3 : f32[]\n  loss %4\n}\n",
        )
        .expect("the test graph parses");
        // At most two of the 1 KiB values at once: each is freed after its one reader.
        assert_eq!(peak_activation_bytes(&g, &g.topo_order()), 2048);
    }

    #[test]
    fn off_leaves_the_graph_alone_and_no_loss_is_an_error() {
        let g = parse("graph t {\n  %0 = input{name=\"x\"} : f32[4]\n  %1 = relu %0 : f32[4]\n  output{name=\"y\"} %1\n}\n")
            .expect("the test graph parses");
        let mut cx = PassCx::default();
        let mut h = g.clone();
        assert!(Remat.run(&mut h, &mut cx).is_ok());
        assert!(h == g);
        cx.strategy = StrategyConfig {
            remat: RematPolicy::Layers,
            ..StrategyConfig::default()
        };
        assert!(Remat.run(&mut h, &mut cx).is_err());
    }
}
