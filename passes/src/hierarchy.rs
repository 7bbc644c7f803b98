//! Hierarchical all-reduce (`--ranks-per-node L`): each dense all-reduce is run as one
//! ring over every worker or, where the cost model predicts it faster, as Horovod's
//! hierarchical all-reduce over nodes of L consecutive workers (a reduce-scatter within
//! each node, an all-reduce of each slice across the nodes, an all-gather within each
//! node), from the two links' bandwidths and latencies (`--link intra=BW,LAT`, `--link
//! inter=BW,LAT`; see [`crate::placement::all_reduce_seconds`]). Runs after fusion and
//! the gradient wire, on the buckets; a 16-bit wire's all-reduces stay flat.
//! Before/after, for a bucket the model sends faster hierarchically:
//! ```text
//! %9 = all_reduce{reduce="mean"} %8 : f32[1000]
//!   =>
//! %9 = all_reduce{reduce="mean", ranks_per_node=4} %8 : f32[1000]
//! ```

use crate::placement::all_reduce_seconds;
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{DType, Graph, Op, ValueType};

/// The fraction of a buffer one rank sends in a flat ring all-reduce over `n`.
pub fn flat_fraction(n: usize) -> f64 {
    2.0 * (n as f64 - 1.0) / n as f64
}

/// The fractions of a buffer one rank sends in a hierarchical all-reduce over `n` ranks
/// in nodes of `local`, `(within its node, across nodes)`: `2 (L-1)/L`, and `2 (M-1)/M`
/// of its `1/L` slice across the M nodes. They add up to the flat ring's `2 (N-1)/N`:
/// the hierarchy moves bytes from the slow link to the fast one, it does not save any.
pub fn hierarchical_fractions(n: usize, local: usize) -> (f64, f64) {
    let (l, m) = (local as f64, (n / local) as f64);
    (2.0 * (l - 1.0) / l, 2.0 * (m - 1.0) / (m * l))
}

/// The pass: runs last among the communication passes when `--ranks-per-node` is set.
pub struct Hierarchy;

impl Pass for Hierarchy {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let local = cx.strategy.ranks_per_node;
        let n = cx.strategy.data_workers();
        if local < 2 || n <= local {
            return Ok(PassStats::default().with_note("one node, or one worker a node: flat"));
        }
        let (mut hierarchical, mut flat) = (0, 0);
        for id in g.topo_order() {
            let Op::AllReduce { reduce, .. } = *g.op(id) else {
                continue;
            };
            let bytes = match g.value_type(g.node(id).inputs[0]) {
                ValueType::Tensor(t) if t.dtype == DType::F32 => t.bytes(),
                _ => continue,
            };
            let (flat_s, hier_s) = all_reduce_seconds(bytes as f64, n, local, &cx.strategy);
            if hier_s < flat_s {
                g.replace_op(
                    id,
                    Op::AllReduce {
                        reduce,
                        ranks_per_node: local,
                    },
                )?;
                hierarchical += 1;
            } else {
                flat += 1;
            }
        }
        Ok(PassStats::default()
            .count("hierarchical", hierarchical)
            .count("flat", flat)
            .with_note(format!("{} nodes of {local}", n / local)))
    }
}
