//! Which axes of each value are the batch, and what that tells about data parallelism.
//!
//! The lowering binds `B` to a number, so the graph's types no longer say which
//! dimensions came from it. The model is lowered a second time with `B + 1`: an axis
//! whose length changes is a batch axis (it is, by definition, the axes that depend on
//! `B`). The two lowerings run the same code on the same source, so their nodes
//! correspond one to one.
//!
//! Two uses:
//! * dropout whose input has the batch as axis 0 is marked `per_sample`, so its mask
//!   follows a sample's position in the global batch (N workers of batch b drop what
//!   one device of batch N*b drops);
//! * [`assumptions`] lists the places where a model breaks what data parallelism
//!   assumes (the loss is a mean over the batch; batch statistics are per worker), for
//!   `distc verify` to name when a strategy does not match one device.

use distc_ir::{Graph, NodeId, Op, ValueId};
use std::collections::HashMap;

/// Per node, per output: the batch axes.
pub type BatchAxes = HashMap<NodeId, Vec<Vec<usize>>>;

/// The batch axes of `g` (lowered with `B = b`) from `g1` (the same model lowered with
/// `B = b + 1`); `None` if the two graphs do not correspond node for node.
pub fn batch_axes(g: &Graph, g1: &Graph) -> Option<BatchAxes> {
    let (ids, ids1) = (g.node_ids(), g1.node_ids());
    if ids != ids1 {
        return None;
    }
    let mut out = HashMap::with_capacity(ids.len());
    for id in ids {
        let (n, n1) = (g.node(id), g1.node(id));
        if n.op.mnemonic() != n1.op.mnemonic() || n.outputs.len() != n1.outputs.len() {
            return None;
        }
        let axes = n
            .outputs
            .iter()
            .zip(&n1.outputs)
            .map(|(a, b)| {
                let (a, b) = (a.dense_type().dims(), b.dense_type().dims());
                if a.len() != b.len() {
                    return Vec::new();
                }
                (0..a.len()).filter(|&i| a[i] != b[i]).collect()
            })
            .collect();
        out.insert(id, axes);
    }
    Some(out)
}

/// The batch axes of value `v`.
fn axes_of(axes: &BatchAxes, v: ValueId) -> &[usize] {
    axes.get(&v.node)
        .and_then(|o| o.get(v.port as usize))
        .map_or(&[], Vec::as_slice)
}

/// Marks every dropout whose input has the batch as axis 0 `per_sample`.
pub fn mark_per_sample_dropout(g: &mut Graph, axes: &BatchAxes) {
    for id in g.node_ids() {
        let Op::Dropout { rate, seed, .. } = *g.op(id) else {
            continue;
        };
        let input = g.node(id).inputs[0];
        if axes_of(axes, input).first() == Some(&0) {
            let op = Op::Dropout {
                rate,
                seed,
                per_sample: true,
            };
            // Same input and output types: the replacement cannot fail.
            let _ = g.replace_op(id, op);
        }
    }
}

/// The axes an op reduces or normalises over, of its first input.
fn reduced_axes(op: &Op, rank: usize) -> Vec<usize> {
    match op {
        Op::Sum { axes, .. } | Op::Mean { axes, .. } => axes.clone(),
        Op::Softmax { axis } | Op::LogSoftmax { axis } => vec![*axis],
        Op::LayerNorm { .. } => rank.checked_sub(1).into_iter().collect(),
        _ => Vec::new(),
    }
}

/// Whether `id`'s output, or any value computed from it, still has a batch axis (the
/// reduced value flows back into per-sample computations).
fn feeds_per_sample(g: &Graph, axes: &BatchAxes, id: NodeId) -> bool {
    let per_sample = |n: NodeId| {
        axes.get(&n)
            .is_some_and(|o| o.iter().any(|a| !a.is_empty()))
    };
    if per_sample(id) {
        return true;
    }
    let mut stack = vec![id];
    let mut seen = std::collections::HashSet::new();
    while let Some(n) = stack.pop() {
        if !seen.insert(n) {
            continue;
        }
        for user in g.user_nodes(n) {
            if per_sample(user) {
                return true;
            }
            stack.push(user);
        }
    }
    false
}

/// What this model does that data parallelism assumes it does not: each finding names
/// the node and the assumption. Empty for a model whose loss is a mean over the batch
/// and that computes nothing across samples.
pub fn assumptions(g: &Graph, axes: &BatchAxes) -> Vec<String> {
    let mut found = Vec::new();
    for id in g.topo_order() {
        let n = g.node(id);
        let Some(&input) = n.inputs.first() else {
            continue;
        };
        let in_axes = axes_of(axes, input);
        let rank = g.value_type(input).dense_type().dims().len();
        let over_batch = reduced_axes(&n.op, rank)
            .iter()
            .any(|a| in_axes.contains(a));
        // A statistic averaged over the replicas (`batch_norm(.., sync = true)`) is the
        // global batch's, as on one device.
        let users = g.user_nodes(id);
        let synchronised = !users.is_empty()
            && users
                .iter()
                .all(|&u| matches!(g.op(u), Op::ReplicaReduce { .. }));
        if !over_batch || synchronised {
            continue;
        }
        let op = n.op.mnemonic();
        if feeds_per_sample(g, axes, id) {
            found.push(format!(
                "{id} ({op}) computes a statistic over the batch axis that feeds back into \
                 per-sample values: under data parallelism each worker computes it on its \
                 own batch of b samples, one device on all N*b"
            ));
        } else if matches!(n.op, Op::Sum { .. }) {
            found.push(format!(
                "{id} (sum) sums over the batch axis on the way to the loss: data \
                 parallelism averages the workers' gradients, which matches one device \
                 only when the loss is a mean over the batch (use `mean`)"
            ));
        }
    }
    found
}
