//! ZeRO: shards the model state of every all-reduced dense variable over the workers
//! (`--zero 1|2|3` on `allreduce`, and on the dense part of `hybrid` and `auto`).
//!
//! A variable `w` of `n` elements becomes the variable `w.zero`, this worker's chunk of
//! `c = ceil(n / N)` elements (flattened, the last chunk zero-padded), which the
//! optimizer updates (its state is 1/N of `w`'s):
//!
//! * stage 1 shards the optimizer state: the gradient is all-reduced as before, each
//!   worker keeps its chunk (`take_chunk`) for its update, and the whole `w` is
//!   all-gathered from the updated chunks (`all_gather_dense`) where the step reads it;
//! * stage 2 also shards the gradient: `reduce_scatter` replaces the all-reduce, so
//!   only the chunk is reduced;
//! * stage 3 also shards the parameters' lifetime: the forward reads and the backward
//!   reads each get their own `all_gather_dense`, scheduled just before the first read,
//!   so the whole `w` is freed after its last forward use and gathered again for the
//!   backward pass.
//!
//! The init program makes each worker's chunk from the one-device initial value
//! (`take_chunk` instead of a broadcast); a final program gathers the whole variables
//! (for `--save` and `distc verify`). Requires the distribute pass; runs before fusion,
//! which buckets the all-reduces, reduce-scatters and gathers this pass makes. Before/after (stage 2, abridged):
//! ```text
//! %1 = param{name="w1", ...}                 %1 = param{name="w1.zero", ty=f32[401408]}
//! %4 = matmul %0, %1                   =>    %2 = all_gather_dense{workers=2, shape=[784,1024]} %1
//! %9 = all_reduce{reduce="mean"} %8          %4 = matmul %0, %2
//! param_grad{param="w1"} %9                  %9 = reduce_scatter{workers=2, reduce="mean"} %8
//!                                            param_grad{param="w1.zero"} %9
//! ```

use crate::placement::{Kind, Mechanism};
use crate::{needs_program_set, Pass, PassCx, PassError, PassStats, ProgramSet};
use distc_ir::{Graph, NodeId, Op, ReduceOp, Shape, TensorType};
use std::collections::{HashMap, HashSet};

/// The ZeRO rewrite.
pub struct Zero;

/// The name of the shard variable of `var`.
pub fn shard_name(var: &str) -> String {
    format!("{var}{}", distc_ir::ZERO_SHARD_SUFFIX)
}

/// Nodes the loss and the outputs depend on: the forward pass.
pub(crate) fn forward_nodes(g: &Graph) -> HashSet<NodeId> {
    let mut stack: Vec<NodeId> = g
        .node_ids()
        .into_iter()
        .filter(|&id| matches!(g.op(id), Op::Loss | Op::Output { .. }))
        .collect();
    let mut seen = HashSet::new();
    while let Some(id) = stack.pop() {
        if seen.insert(id) {
            stack.extend(g.node(id).inputs.iter().map(|v| v.node));
        }
    }
    seen
}

/// The nodes of one kind by name (a variable, a gradient sink, an output), first in
/// node order, kept up to date as the rewrite adds and removes them: one look-up per
/// variable instead of a search of the whole graph.
struct ByName {
    name_of: fn(&Op) -> Option<&String>,
    ids: HashMap<String, NodeId>,
}

impl ByName {
    fn new(g: &Graph, name_of: fn(&Op) -> Option<&String>) -> ByName {
        let mut ids = HashMap::new();
        for id in g.node_ids() {
            if let Some(n) = name_of(g.op(id)) {
                ids.entry(n.clone()).or_insert(id);
            }
        }
        ByName { name_of, ids }
    }

    /// The node named `name`, if it is still there (its id not reused by another).
    fn get(&self, g: &Graph, name: &str) -> Option<NodeId> {
        let id = *self.ids.get(name)?;
        let node = g.get(id)?;
        ((self.name_of)(&node.op).map(String::as_str) == Some(name)).then_some(id)
    }

    /// Records a node just added under `name`, unless one by that name is still there.
    fn added(&mut self, g: &Graph, name: &str, id: NodeId) {
        if self.get(g, name).is_none_or(|old| old > id) {
            self.ids.insert(name.to_string(), id);
        }
    }
}

fn param_name(op: &Op) -> Option<&String> {
    match op {
        Op::Param { name, .. } => Some(name),
        _ => None,
    }
}

fn sink_name(op: &Op) -> Option<&String> {
    match op {
        Op::ParamGrad { param } => Some(param),
        _ => None,
    }
}

fn output_name(op: &Op) -> Option<&String> {
    match op {
        Op::Output { name } => Some(name),
        _ => None,
    }
}

impl Pass for Zero {
    fn run(&self, _: &mut Graph, _: &mut PassCx) -> Result<PassStats, PassError> {
        Err(needs_program_set(&self.name()))
    }

    fn run_programs(&self, p: &mut ProgramSet, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let g = &mut p.worker;
        let stage = cx.strategy.zero;
        let stats = PassStats::default().count("stage", stage.into());
        if stage == 0 {
            return Ok(stats.count("sharded", 0));
        }
        if stage > 3 {
            return Err(PassError::Precondition(format!(
                "ZeRO stage {stage}: the stages are 1, 2 and 3"
            )));
        }
        let n = cx.strategy.data_workers();
        let mut plan = cx
            .dist
            .clone()
            .ok_or_else(|| PassError::Precondition("zero needs the placement".into()))?;
        let forward = forward_nodes(g);
        let mut init = p
            .init
            .take()
            .unwrap_or_else(|| Graph::new(format!("{}.init", g.name)));
        // A final program already there (a model axis's gathers) reads what this one
        // gathers from the chunks.
        let mut fin = p
            .finalize
            .take()
            .unwrap_or_else(|| Graph::new(format!("{}.final", g.name)));
        let fin_params = ByName::new(&fin, param_name);
        let (mut sharded, mut gathers) = (0, 0);
        let (mut params, mut sinks) = (ByName::new(g, param_name), ByName::new(g, sink_name));
        let (mut init_params, mut init_outputs) = (
            ByName::new(&init, param_name),
            ByName::new(&init, output_name),
        );
        for v in plan.vars.iter_mut() {
            if v.placement != Mechanism::Allreduce || v.kind != Kind::Dense {
                continue;
            }
            let name = v.name.clone();
            let shard = shard_name(&name);
            let Some(param) = params.get(g, &name) else {
                continue;
            };
            let (ty, init_spec) = match g.op(param) {
                Op::Param { ty, init, .. } => (ty.clone(), init.clone()),
                _ => continue,
            };
            let Some(sink) = sinks.get(g, &name) else {
                continue;
            };
            let numel: usize = ty.dims().iter().product();
            let c = numel.div_ceil(n);
            let shard_ty = TensorType::new(ty.dtype, Shape(vec![c]));
            let gather_op = Op::AllGatherDense {
                workers: n,
                shape: ty.shape.clone(),
            };
            // Reads of the whole variable: gathered from the shards.
            let p = g.add(
                Op::Param {
                    name: shard.clone(),
                    ty: shard_ty.clone(),
                    init: init_spec.clone(),
                    frozen: false,
                },
                vec![],
            )?;
            params.added(g, &shard, p);
            let users = g.users(param.into());
            let mut made = 0usize;
            if stage == 3 {
                let (fwd, bwd): (Vec<_>, Vec<_>) =
                    users.into_iter().partition(|(u, _)| forward.contains(u));
                for group in [fwd, bwd] {
                    if group.is_empty() {
                        continue;
                    }
                    let gathered = g.add(gather_op.clone(), vec![p.into()])?;
                    made += 1;
                    for (u, slot) in group {
                        g.set_input(u, slot, gathered.into());
                    }
                }
            } else {
                let gathered = g.add(gather_op.clone(), vec![p.into()])?;
                made += 1;
                g.replace_all_uses(param.into(), gathered.into());
            }
            gathers += made;
            g.remove(param);
            // The gradient: this worker's chunk of the mean over workers.
            let grad = g.node(sink).inputs[0];
            let chunk = match g.op(grad.node) {
                Op::AllReduce { .. } if stage == 1 => {
                    g.add(Op::TakeChunk { workers: n }, vec![grad])?
                }
                Op::AllReduce { .. } => {
                    let local = g.node(grad.node).inputs[0];
                    let rs = Op::ReduceScatter {
                        workers: n,
                        reduce: ReduceOp::Mean,
                    };
                    g.add(rs, vec![local])?
                }
                op => {
                    return Err(PassError::Precondition(format!(
                        "`{name}`'s gradient comes from {}, not an all_reduce",
                        op.mnemonic()
                    )))
                }
            };
            g.remove(sink);
            let s = g.add(
                Op::ParamGrad {
                    param: shard.clone(),
                },
                vec![chunk.into()],
            )?;
            sinks.added(g, &shard, s);
            // Init: each worker's chunk of the one-device value, instead of a broadcast;
            // of what the init program makes of it otherwise (a model axis's part).
            let mut made_by_init = None;
            if let Some(out) = init_outputs.get(&init, &name) {
                let v = init.node(out).inputs[0];
                if !matches!(init.op(v.node), Op::Broadcast { .. }) {
                    made_by_init = Some(v);
                }
                init.remove(out);
            }
            let full = match (made_by_init, init_params.get(&init, &name)) {
                (Some(v), _) => v,
                (None, Some(full)) => full.into(),
                (None, None) => {
                    let full = init.add(
                        Op::Param {
                            name: name.clone(),
                            ty: ty.clone(),
                            init: init_spec.clone(),
                            frozen: false,
                        },
                        vec![],
                    )?;
                    init_params.added(&init, &name, full);
                    full.into()
                }
            };
            let mine = init.add(Op::TakeChunk { workers: n }, vec![full])?;
            let out = init.add(
                Op::Output {
                    name: shard.clone(),
                },
                vec![mine.into()],
            )?;
            init_outputs.added(&init, &shard, out);
            // Final: the whole variable again.
            let sp = fin.add(
                Op::Param {
                    name: shard.clone(),
                    ty: shard_ty,
                    init: init_spec,
                    frozen: false,
                },
                vec![],
            )?;
            let whole = fin.add(gather_op, vec![sp.into()])?;
            match fin_params.get(&fin, &name) {
                Some(read) => {
                    fin.replace_all_uses(read.into(), whole.into());
                    fin.remove(read);
                }
                None => {
                    fin.add(Op::Output { name: name.clone() }, vec![whole.into()])?;
                }
            }
            // Bytes a worker sends per step, counted as the ring counts them.
            let (nf, b) = (n as f64, (c * n * ty.dtype.size()) as f64);
            let per_chunk = b / nf;
            let gather = (nf - 1.0) * per_chunk;
            let reduce = if stage == 1 {
                2.0 * (nf - 1.0) / nf * (numel * ty.dtype.size()) as f64
            } else {
                (nf - 1.0) * per_chunk
            };
            v.predicted_bytes_per_step = reduce + made as f64 * gather;
            v.gather_bytes_per_step = made as f64 * gather;
            sharded += 1;
        }
        // The all-reduces reduce-scatter replaced.
        g.remove_dead();
        init.remove_dead();
        cx.dist = Some(plan);
        p.init = (init.node_count() > 0).then_some(init);
        p.finalize = (fin.node_count() > 0).then_some(fin);
        Ok(stats.count("sharded", sharded).count("gathers", gathers))
    }
}
