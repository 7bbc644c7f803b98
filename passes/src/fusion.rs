//! Gradient fusion: packs the dense gradients that are all-reduced into buckets, in
//! the order the backward pass produces them, each bucket up to `bucket_mb` (the
//! first up to `first_bucket_mb`, so communication starts early), and all-reduces each
//! bucket once: `pack`, `all_reduce`, `unpack`. A bucket of one gradient keeps its
//! plain `all_reduce`. ZeRO's collectives are bucketed the same way: reduce-scatters
//! as `pack_chunks`, one `reduce_scatter`, `unpack` (each worker's part of the bucket
//! is its chunk of every gradient), and gathers of parameter shards, in the order the
//! step first reads them and never across the forward/backward boundary, as `pack`,
//! one `all_gather_dense`, `unpack_chunks`, each gather bucket at most the first
//! bucket's cap. Requires the distribute pass; records the
//! gradient buckets in [`crate::PassCx::dist`]. Before/after:
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
use std::collections::HashMap;

/// The fusion pass.
pub struct Fusion;

/// Groups `items` (with their bytes) in order into buckets of at most `cap` bytes,
/// the first of at most `first_cap` (an item larger than its cap is a bucket alone).
fn group<T>(items: Vec<(T, usize)>, first_cap: usize, cap: usize) -> Vec<Vec<(T, usize)>> {
    let mut buckets: Vec<Vec<(T, usize)>> = Vec::new();
    let mut size = 0;
    for item in items {
        let current_cap = if buckets.len() == 1 { first_cap } else { cap };
        match buckets.last_mut() {
            Some(b) if size + item.1 <= current_cap => {
                size += item.1;
                b.push(item);
            }
            _ => {
                size = item.1;
                buckets.push(vec![item]);
            }
        }
    }
    buckets
}

/// The variable whose gradient sink `id` feeds, directly or through the `take_chunk`
/// of ZeRO stage 1 (a ZeRO shard `w.zero` is named `w`).
fn sink_of(g: &Graph, id: NodeId) -> Option<String> {
    match g.user_nodes(id).as_slice() {
        [u] => match g.op(*u) {
            Op::ParamGrad { param } => Some(
                param
                    .strip_suffix(distc_ir::ZERO_SHARD_SUFFIX)
                    .unwrap_or(param)
                    .to_string(),
            ),
            Op::TakeChunk { .. } => sink_of(g, *u),
            _ => None,
        },
        _ => None,
    }
}

/// Buckets ZeRO's reduce-scatters (stage 2 and 3) like the all-reduces: one
/// `pack_chunks`, one `reduce_scatter`, one `unpack` of this worker's chunks.
fn bucket_reduce_scatters(
    g: &mut Graph,
    pos: &HashMap<NodeId, usize>,
    caps: (usize, usize),
    first_id: usize,
) -> Result<(Vec<Bucket>, usize), PassError> {
    let mut scatters: Vec<((NodeId, String, usize), usize)> = g
        .node_ids()
        .into_iter()
        .filter_map(|id| match g.op(id) {
            Op::ReduceScatter { workers, .. } => {
                let name = sink_of(g, id)?;
                let bytes = g.tensor_type(id.into()).bytes() * workers;
                Some(((id, name, *workers), bytes))
            }
            _ => None,
        })
        .collect();
    scatters.sort_by_key(|((id, _, _), _)| pos.get(&g.node(*id).inputs[0].node).copied());
    let mut records = Vec::new();
    let mut fused = 0;
    for b in group(scatters, caps.0, caps.1) {
        records.push(Bucket {
            id: first_id + records.len(),
            vars: b.iter().map(|((_, n, _), _)| n.clone()).collect(),
            bytes: b.iter().map(|(_, s)| s).sum(),
        });
        if b.len() < 2 {
            continue;
        }
        fused += b.len();
        let workers = b[0].0 .2;
        let grads: Vec<_> = b
            .iter()
            .map(|((id, _, _), _)| g.node(*id).inputs[0])
            .collect();
        let chunks: Vec<Shape> = b
            .iter()
            .map(|((id, _, _), _)| g.tensor_type((*id).into()).shape.clone())
            .collect();
        let pack = g.add(Op::PackChunks { workers }, grads)?;
        let scatter = g.add(
            Op::ReduceScatter {
                workers,
                reduce: ReduceOp::Mean,
            },
            vec![pack.into()],
        )?;
        let unpack = g.add(Op::Unpack { shapes: chunks }, vec![scatter.into()])?;
        for (k, ((id, _, _), _)) in b.iter().enumerate() {
            g.replace_all_uses((*id).into(), unpack.out(k as u16));
            g.remove(*id);
        }
    }
    Ok((records, fused))
}

/// Buckets ZeRO's gathers of parameter shards in the order the step first reads
/// them: one `pack` of this worker's shards, one `all_gather_dense`, one
/// `unpack_chunks` into the whole variables.
fn bucket_gathers(
    g: &mut Graph,
    pos: &HashMap<NodeId, usize>,
    caps: (usize, usize),
) -> Result<(usize, usize), PassError> {
    let mut gathers: Vec<((NodeId, usize, Shape), usize)> = g
        .node_ids()
        .into_iter()
        .filter_map(|id| match g.op(id) {
            Op::AllGatherDense { workers, shape }
                if matches!(g.op(g.node(id).inputs[0].node), Op::Param { .. }) =>
            {
                let bytes = g.tensor_type(g.node(id).inputs[0]).bytes() * workers;
                Some(((id, *workers, shape.clone()), bytes))
            }
            _ => None,
        })
        .collect();
    let first_read = |g: &Graph, id: NodeId| {
        g.user_nodes(id)
            .iter()
            .filter_map(|u| pos.get(u))
            .min()
            .copied()
    };
    gathers.sort_by_cached_key(|((id, _, _), _)| first_read(g, *id));
    // A bucket never spans the forward and the backward pass: stage 3 gathers a
    // variable again for the backward pass so that it is not held in between.
    let forward = crate::zero::forward_nodes(g);
    let (fwd, bwd): (Vec<_>, Vec<_>) = gathers
        .into_iter()
        .partition(|((id, _, _), _)| g.user_nodes(*id).iter().all(|u| forward.contains(u)));
    let grouped = group(fwd, caps.0, caps.1)
        .into_iter()
        .chain(group(bwd, caps.0, caps.1));
    let (mut buckets, mut fused) = (0, 0);
    for b in grouped {
        buckets += 1;
        if b.len() < 2 {
            continue;
        }
        fused += b.len();
        let workers = b[0].0 .1;
        let shards: Vec<_> = b
            .iter()
            .map(|((id, _, _), _)| g.node(*id).inputs[0])
            .collect();
        let shapes: Vec<Shape> = b.iter().map(|((_, _, s), _)| s.clone()).collect();
        let packed: usize = shards.iter().map(|v| g.tensor_type(*v).shape.numel()).sum();
        let pack = g.add(Op::Pack, shards)?;
        let gather = g.add(
            Op::AllGatherDense {
                workers,
                shape: Shape(vec![packed * workers]),
            },
            vec![pack.into()],
        )?;
        let unpack = g.add(Op::UnpackChunks { workers, shapes }, vec![gather.into()])?;
        for (k, ((id, _, _), _)) in b.iter().enumerate() {
            g.replace_all_uses((*id).into(), unpack.out(k as u16));
            g.remove(*id);
        }
    }
    Ok((buckets, fused))
}

impl Pass for Fusion {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let order = g.topo_order();
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        // Dense all-reduces that feed one gradient sink, in gradient production order.
        let mut reduces: Vec<((NodeId, String), usize)> = order
            .iter()
            .filter(|&&id| matches!(g.op(id), Op::AllReduce { .. }))
            .filter_map(|&id| Some(((id, sink_of(g, id)?), g.tensor_type(id.into()).bytes())))
            .collect();
        reduces.sort_by_key(|((id, _), _)| pos[&g.node(*id).inputs[0].node]);
        let mib = |x: f64| (x * 1024.0 * 1024.0) as usize;
        let caps = (mib(cx.strategy.first_bucket_mb), mib(cx.strategy.bucket_mb));
        let buckets: Vec<Vec<(NodeId, String, usize)>> = group(reduces, caps.0, caps.1)
            .into_iter()
            .map(|b| b.into_iter().map(|((id, n), s)| (id, n, s)).collect())
            .collect();
        let dist = cx.dist.as_mut();
        let mut records = Vec::new();
        let mut fused = 0;
        for (i, b) in buckets.iter().enumerate() {
            records.push(Bucket {
                id: i,
                vars: b.iter().map(|(_, n, _)| n.clone()).collect(),
                bytes: b.iter().map(|(_, _, s)| s).sum(),
            });
            // One worker's all-reduces copy in place: a bucket's pack and unpack would
            // be all of their cost.
            if b.len() < 2 || cx.strategy.data_workers() == 1 {
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
                    ranks_per_node: 0,
                },
                vec![pack.into()],
            )?;
            let unpack = g.add(Op::Unpack { shapes }, vec![reduce.into()])?;
            for (k, (id, _, _)) in b.iter().enumerate() {
                g.replace_all_uses((*id).into(), unpack.out(k as u16));
                g.remove(*id);
            }
        }
        let (scattered, scatters_fused) = bucket_reduce_scatters(g, &pos, caps, records.len())?;
        records.extend(scattered);
        // Gathered parameters are whole variables alive until their last reader: buckets of
        // at most the first bucket's cap fuse the small variables without holding many
        // large ones at once (DeepSpeed's stage-3 prefetch bucket plays the same part).
        let (gather_buckets, gathers_fused) = bucket_gathers(g, &pos, (caps.0, caps.0))?;
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
            .count("fused", fused + scatters_fused)
            .count("gather_buckets", gather_buckets)
            .count("gathers_fused", gathers_fused))
    }
}
