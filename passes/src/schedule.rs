//! Scheduling: orders the program so that each collective (and the packing and row
//! merging that feed it) runs as soon as its inputs exist, i.e. right after the last
//! gradient it needs, while the rest of the backward pass goes on. The order is the
//! graph's own: nodes are renumbered so that the text IR, and the executor that follows
//! it, list them in schedule order. Requires the fusion pass; changes no value.
//! Before/after:
//! ```text
//! %7 = matmul %5, %2        (grad of w1)       %7 = matmul %5, %2
//! %8 = matmul %5, %1        (grad of h)  =>    %8 = all_reduce{reduce="mean"} %7
//! %9 = all_reduce %7                           %9 = matmul %5, %1
//! ```

use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{Graph, NodeId, Op};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// The scheduling pass.
pub struct Schedule;

/// Runs as early as possible: communication and what prepares it. (`unpack` is not:
/// it waits for the collective, so it runs as late as the order allows.)
fn eager(op: &Op) -> bool {
    op.is_communication() || matches!(op, Op::Pack | Op::PackChunks { .. } | Op::UniqueRows)
}

impl Pass for Schedule {
    fn run(&self, g: &mut Graph, _cx: &mut PassCx) -> Result<PassStats, PassError> {
        let before = g.topo_order();
        let mut indegree: HashMap<NodeId, usize> = before
            .iter()
            .map(|&id| (id, g.node(id).inputs.len()))
            .collect();
        // (priority, id): eager nodes first, then the lowest id, as the printer would.
        let mut ready: BinaryHeap<Reverse<(u8, NodeId)>> = BinaryHeap::new();
        let prio = |g: &Graph, id: NodeId| u8::from(!eager(g.op(id)));
        for &id in &before {
            if indegree[&id] == 0 {
                ready.push(Reverse((prio(g, id), id)));
            }
        }
        let mut order = Vec::with_capacity(before.len());
        while let Some(Reverse((_, id))) = ready.pop() {
            order.push(id);
            for user in g.user_nodes(id) {
                let uses = g.node(user).inputs.iter().filter(|v| v.node == id).count();
                if let Some(d) = indegree.get_mut(&user) {
                    *d -= uses;
                    if *d == 0 {
                        ready.push(Reverse((prio(g, user), user)));
                    }
                }
            }
        }
        // A gathered parameter (ZeRO) is gathered just before its first reader, so it is
        // alive only as long as that reader's pass needs it.
        let order = gathers_before_readers(g, order);
        let moved = order.iter().zip(&before).filter(|(a, b)| a != b).count();
        let mut out = Graph::new(g.name.clone());
        let mut map: HashMap<NodeId, NodeId> = HashMap::new();
        for id in order {
            let node = g.node(id);
            let inputs = node
                .inputs
                .iter()
                .map(|v| map[&v.node].out(v.port))
                .collect();
            map.insert(
                id,
                out.add_typed(node.op.clone(), inputs, node.outputs.clone()),
            );
        }
        *g = out;
        Ok(PassStats::default().count("moved", moved))
    }
}

/// Moves each `all_gather_dense` just before its first reader (to the end when it has
/// none); gathers before the same reader keep their order. When a gather reads
/// another (ZeRO never makes one), moves them one at a time, each a search of the
/// whole order, as the definition says.
fn gathers_before_readers(g: &Graph, mut order: Vec<NodeId>) -> Vec<NodeId> {
    let is_gather = |id: NodeId| matches!(g.op(id), Op::AllGatherDense { .. });
    let gathers: Vec<NodeId> = order.iter().copied().filter(|&id| is_gather(id)).collect();
    if gathers.is_empty() {
        return order;
    }
    if gathers
        .iter()
        .any(|&gid| g.node(gid).inputs.iter().any(|v| is_gather(v.node)))
    {
        for gid in gathers {
            order.retain(|&id| id != gid);
            let users = g.user_nodes(gid);
            let at = order
                .iter()
                .position(|id| users.contains(id))
                .unwrap_or(order.len());
            order.insert(at, gid);
        }
        return order;
    }
    // No gather reads a gather, so the others keep their order and each gather's
    // place depends only on them: one pass.
    let rest: Vec<NodeId> = order.into_iter().filter(|&id| !is_gather(id)).collect();
    let pos: HashMap<NodeId, usize> = rest.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let mut before: Vec<Vec<NodeId>> = vec![Vec::new(); rest.len()];
    let mut tail = Vec::new();
    for gid in gathers {
        let first = g
            .user_nodes(gid)
            .iter()
            .filter_map(|u| pos.get(u).copied())
            .min();
        match first {
            Some(i) => before[i].push(gid),
            None => tail.push(gid),
        }
    }
    let mut out = Vec::with_capacity(rest.len() + tail.len());
    for (id, gs) in rest.into_iter().zip(before) {
        out.extend(gs);
        out.push(id);
    }
    out.extend(tail);
    out
}
