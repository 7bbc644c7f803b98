//! Gradient fusion: packs the dense gradients that are all-reduced into buckets, in
//! the order the backward pass produces them, each bucket up to `bucket_mb` (the
//! first up to `first_bucket_mb`, so communication starts early), and all-reduces each
//! bucket once: `pack`, `all_reduce`, `unpack`. A bucket of one gradient keeps its
//! plain `all_reduce`. Requires the distribute pass; records the buckets in
//! [`crate::PassCx::dist`]. Before/after:
//! ```text
//! %7 = all_reduce{reduce="mean"} %5            %7 = pack %5, %6 : f32[1024512]
//! %8 = all_reduce{reduce="mean"} %6      =>    %8 = all_reduce{reduce="mean"} %7
//! param_grad{param="b2"} %7                    %9 = unpack{shape=[512], shape=[1024,512]} %8
//! param_grad{param="w2"} %8                    param_grad{param="b2"} %9
//!                                              param_grad{param="w2"} %9#1
//! ```

use crate::placement::Bucket;
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{Graph, NodeId, Op, ReduceOp, Shape};

/// The fusion pass.
pub struct Fusion;

impl Pass for Fusion {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let order = g.topo_order();
        let pos: std::collections::HashMap<NodeId, usize> =
            order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        // Dense all-reduces that feed one gradient sink, in gradient production order.
        let mut reduces: Vec<(NodeId, String, usize)> = order
            .iter()
            .filter(|&&id| matches!(g.op(id), Op::AllReduce { .. }))
            .filter_map(|&id| {
                let users = g.user_nodes(id);
                let name = match users.as_slice() {
                    [u] => match g.op(*u) {
                        Op::ParamGrad { param } => param.clone(),
                        _ => return None,
                    },
                    _ => return None,
                };
                Some((id, name, g.tensor_type(id.into()).bytes()))
            })
            .collect();
        reduces.sort_by_key(|(id, _, _)| pos[&g.node(*id).inputs[0].node]);
        let mib = |x: f64| (x * 1024.0 * 1024.0) as usize;
        let mut buckets: Vec<Vec<(NodeId, String, usize)>> = Vec::new();
        let mut size = 0;
        let (first_cap, cap) = (mib(cx.strategy.first_bucket_mb), mib(cx.strategy.bucket_mb));
        for r in reduces {
            let current_cap = if buckets.len() == 1 { first_cap } else { cap };
            match buckets.last_mut() {
                Some(b) if size + r.2 <= current_cap => {
                    size += r.2;
                    b.push(r);
                }
                _ => {
                    size = r.2;
                    buckets.push(vec![r]);
                }
            }
        }
        let dist = cx.dist.as_mut();
        let mut records = Vec::new();
        let mut fused = 0;
        for (i, b) in buckets.iter().enumerate() {
            records.push(Bucket {
                id: i,
                vars: b.iter().map(|(_, n, _)| n.clone()).collect(),
                bytes: b.iter().map(|(_, _, s)| s).sum(),
            });
            if b.len() < 2 {
                continue;
            }
            fused += b.len();
            let grads: Vec<_> = b.iter().map(|(id, _, _)| g.node(*id).inputs[0]).collect();
            let shapes: Vec<Shape> = grads
                .iter()
                .map(|v| g.tensor_type(*v).shape.clone())
                .collect();
            let pack = g.add(Op::Pack, grads)?;
            let reduce = g.add(
                Op::AllReduce {
                    reduce: ReduceOp::Mean,
                },
                vec![pack.into()],
            )?;
            let unpack = g.add(Op::Unpack { shapes }, vec![reduce.into()])?;
            for (k, (id, _, _)) in b.iter().enumerate() {
                g.replace_all_uses((*id).into(), unpack.out(k as u16));
                g.remove(*id);
            }
        }
        if let Some(d) = dist {
            // Each name to its first variable, as a search from the start finds it.
            let mut var_of: std::collections::HashMap<&str, usize> = Default::default();
            for (i, v) in d.vars.iter().enumerate() {
                var_of.entry(v.name.as_str()).or_insert(i);
            }
            let mut bucket_of = Vec::new();
            for r in &records {
                for name in &r.vars {
                    if let Some(&i) = var_of.get(name.as_str()) {
                        bucket_of.push((i, r.id));
                    }
                }
            }
            for (i, b) in bucket_of {
                d.vars[i].bucket = Some(b);
            }
            d.buckets = records.clone();
        }
        Ok(PassStats::default()
            .count("buckets", records.len())
            .count("fused", fused))
    }
}
