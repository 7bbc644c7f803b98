//! Rewrites the one-device training graph into the SPMD worker program the placement
//! chose, plus a program per parameter server and a worker init program.
//!
//! Per variable: `allreduce` puts `all_reduce{reduce="mean"}` between the gradient and
//! its `param_grad` (a sparse gradient is densified first); `allgather` puts
//! `unique_rows` then `all_gather`; `ps` replaces the `param` by a `pull` (dense) or
//! each lookup by a `sparse_pull` of only the batch's rows (sparse) and the
//! `param_grad` by a `push` or, after `unique_rows`, a `sparse_push`. Each server
//! program holds `shard` sources and `serve` sinks; the init program broadcasts every
//! replicated variable from rank 0. Requires the placement; the worker program is one
//! program for every rank, never N copies. Before/after (hybrid, abridged):
//! ```text
//! %1 = param{name="emb", ...}                  %2 = sparse_pull{var="emb", ...} %0
//! %2 = embedding %1, %0                  =>    ...
//! param_grad{param="emb"} %9                   %10 = unique_rows %9
//!                                              sparse_push{var="emb", ...} %10
//! param_grad{param="w1"} %7                    %8 = all_reduce{reduce="mean"} %7
//!                                              param_grad{param="w1"} %8
//! ```

use crate::placement::{Mechanism, VarPlacement};
use crate::{needs_program_set, Pass, PassCx, PassError, PassStats, ProgramSet};
use distc_ir::{Graph, NodeId, Op, ReduceOp, TensorType};
use std::collections::HashMap;

/// The distribution rewrite.
pub struct Distribute;

fn shards(v: &VarPlacement) -> Vec<(usize, usize, usize)> {
    v.shards
        .iter()
        .map(|s| (s.server, s.start, s.end))
        .collect()
}

/// Every variable's node and gradient sink, by name: looked up once, not once per
/// variable (the rewrite of one variable leaves the others' nodes where they are).
struct Index {
    params: HashMap<String, NodeId>,
    sinks: HashMap<String, NodeId>,
}

impl Index {
    fn new(g: &Graph) -> Index {
        let (mut params, mut sinks) = (HashMap::new(), HashMap::new());
        // The first in node order wins, as a search from the start would find it.
        for id in g.node_ids() {
            match g.op(id) {
                Op::Param { name, .. } => {
                    params.entry(name.clone()).or_insert(id);
                }
                Op::ParamGrad { param } => {
                    sinks.entry(param.clone()).or_insert(id);
                }
                _ => {}
            }
        }
        Index { params, sinks }
    }

    fn sink_of(&self, g: &Graph, name: &str) -> Option<NodeId> {
        let id = *self.sinks.get(name)?;
        match &g.get(id)?.op {
            Op::ParamGrad { param } if param == name => Some(id),
            _ => None,
        }
    }

    fn param_of(&self, g: &Graph, name: &str) -> Option<(NodeId, TensorType, distc_ir::Init)> {
        let id = *self.params.get(name)?;
        match &g.get(id)?.op {
            Op::Param {
                name: n,
                ty,
                init,
                frozen: false,
            } if n == name => Some((id, ty.clone(), init.clone())),
            _ => None,
        }
    }
}

impl Pass for Distribute {
    fn run(&self, _: &mut Graph, _: &mut PassCx) -> Result<PassStats, PassError> {
        Err(needs_program_set(&self.name()))
    }

    fn run_programs(&self, p: &mut ProgramSet, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let g = &mut p.worker;
        let plan = cx
            .dist
            .clone()
            .ok_or_else(|| PassError::Precondition("distribute needs the placement".into()))?;
        let workers = cx.strategy.data_workers();
        let mut servers: Vec<Graph> = (0..cx.strategy.servers)
            .map(|s| Graph::new(format!("{}.server{s}", g.name)))
            .collect();
        // Tensor parallelism's init program, when there is one, already cuts each
        // worker's part of the split variables from the one-device values: every worker
        // makes the same, so those need no broadcast.
        let mut init = p
            .init
            .take()
            .unwrap_or_else(|| Graph::new(format!("{}.init", g.name)));
        let (mut collectives, mut ps_ops) = (0, 0);
        // Statistics synchronised across workers (and their gradients) are reduced
        // over the workers; one worker is all of them. A count summed is known now.
        if workers > 1 {
            for id in g.node_ids() {
                let Op::ReplicaReduce { reduce } = *g.op(id) else {
                    continue;
                };
                let x = g.node(id).inputs[0];
                if let (ReduceOp::Sum, Op::Constant { value, ty }) = (reduce, g.op(x.node)) {
                    let total = Op::Constant {
                        value: value * workers as f64,
                        ty: ty.clone(),
                    };
                    let c = g.add(total, vec![])?;
                    g.replace_all_uses(id.into(), c.into());
                    g.remove(id);
                    continue;
                }
                let op = Op::AllReduce {
                    reduce,
                    ranks_per_node: 0,
                };
                g.replace_op(id, op)?;
                collectives += 1;
            }
        }
        let index = Index::new(g);
        for v in &plan.vars {
            let missing =
                || PassError::Precondition(format!("variable `{}` has no gradient sink", v.name));
            let (param, ty, init_spec) = index
                .param_of(g, &v.name)
                .ok_or_else(|| PassError::Precondition(format!("no variable `{}`", v.name)))?;
            match v.placement {
                Mechanism::Local => {}
                Mechanism::Allreduce | Mechanism::Allgather => {
                    let sink = index.sink_of(g, &v.name).ok_or_else(missing)?;
                    let mut grad = g.node(sink).inputs[0];
                    let mean = Op::AllReduce {
                        reduce: ReduceOp::Mean,
                        ranks_per_node: 0,
                    };
                    // One worker's rows are the global batch's: no compaction, no
                    // gather (the optimizer sums repeated rows as one device does).
                    let alone = workers == 1 && g.value_type(grad).is_sparse();
                    if alone {
                    } else if v.placement == Mechanism::Allreduce && g.value_type(grad).is_sparse()
                    {
                        // Densified for the all-reduce, then sparse again over the rows
                        // the global batch touched (all-reduced beside it), so the
                        // optimizer updates those rows alone, as on one device.
                        let dense = g.add(Op::Densify, vec![grad])?;
                        let mask = g.add(Op::RowMask, vec![grad])?;
                        let dense = g.add(mean.clone(), vec![dense.into()])?;
                        let mask = g.add(mean, vec![mask.into()])?;
                        grad = g.add(Op::Sparsify, vec![dense.into(), mask.into()])?.into();
                    } else if v.placement == Mechanism::Allreduce {
                        grad = g.add(mean, vec![grad])?.into();
                    } else {
                        let unique = g.add(Op::UniqueRows, vec![grad])?;
                        let op = Op::AllGather {
                            workers,
                            reduce: ReduceOp::Mean,
                        };
                        grad = g.add(op, vec![unique.into()])?.into();
                    }
                    g.set_input(sink, 0, grad);
                    collectives += usize::from(!alone);
                    if v.name.ends_with(crate::tensor_parallel::MODEL_SHARD_SUFFIX) {
                        continue;
                    }
                    let p = init.add(
                        Op::Param {
                            name: v.name.clone(),
                            ty: ty.clone(),
                            init: init_spec,
                            frozen: false,
                        },
                        vec![],
                    )?;
                    let b = init.add(Op::Broadcast { root: 0 }, vec![p.into()])?;
                    init.add(
                        Op::Output {
                            name: v.name.clone(),
                        },
                        vec![b.into()],
                    )?;
                }
                Mechanism::Ps => {
                    let sink = index.sink_of(g, &v.name).ok_or_else(missing)?;
                    let grad = g.node(sink).inputs[0];
                    let sh = shards(v);
                    if g.value_type(grad).is_sparse() {
                        for (user, slot) in g.users(param.into()) {
                            if slot != 0 || !matches!(g.op(user), Op::Embedding) {
                                return Err(PassError::Precondition(format!(
                                    "sparse variable `{}` is read by {} {user}, not only by lookups",
                                    v.name,
                                    g.op(user).mnemonic()
                                )));
                            }
                            let ids = g.node(user).inputs[1];
                            let op = Op::SparsePull {
                                var: v.name.clone(),
                                table: ty.clone(),
                                shards: sh.clone(),
                            };
                            let pulled = g.add(op, vec![ids])?;
                            g.replace_all_uses(user.into(), pulled.into());
                            g.remove(user);
                            ps_ops += 1;
                        }
                        let unique = g.add(Op::UniqueRows, vec![grad])?;
                        g.add(
                            Op::SparsePush {
                                var: v.name.clone(),
                                shards: sh,
                            },
                            vec![unique.into()],
                        )?;
                    } else {
                        let pulled = g.add(
                            Op::Pull {
                                var: v.name.clone(),
                                ty: ty.clone(),
                                shards: sh.clone(),
                            },
                            vec![],
                        )?;
                        g.replace_all_uses(param.into(), pulled.into());
                        g.add(
                            Op::Push {
                                var: v.name.clone(),
                                shards: sh,
                            },
                            vec![grad],
                        )?;
                        ps_ops += 1;
                    }
                    g.remove(sink);
                    g.remove(param);
                    ps_ops += 1;
                    let row_bytes = ty.bytes() / ty.dims().first().copied().unwrap_or(1).max(1);
                    for s in &v.shards {
                        let server = servers.get_mut(s.server).ok_or_else(|| {
                            PassError::Precondition(format!(
                                "shard of `{}` on server {} of {}",
                                v.name, s.server, cx.strategy.servers
                            ))
                        })?;
                        let mut dims = ty.dims().to_vec();
                        if let Some(d) = dims.first_mut() {
                            *d = s.end - s.start;
                        }
                        debug_assert_eq!(s.bytes, (s.end - s.start) * row_bytes);
                        let shard = Op::Shard {
                            var: v.name.clone(),
                            start: s.start,
                            end: s.end,
                            init: init_spec.clone(),
                            ty: TensorType::new(ty.dtype, dims),
                        };
                        let id = server.add(shard, vec![])?;
                        server.add(
                            Op::Serve {
                                var: v.name.clone(),
                            },
                            vec![id.into()],
                        )?;
                    }
                }
            }
        }
        g.remove_dead();
        p.servers = servers;
        p.init = (init.node_count() > 0).then_some(init);
        Ok(PassStats::default()
            .count("collectives", collectives)
            .count("ps_ops", ps_ops)
            .count("servers", cx.strategy.servers))
    }
}
