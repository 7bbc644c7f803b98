//! The plan's programs, and what every role derives from them alone: initial values
//! from the seed, input shapes, server shards, the micro-batches of a step, the
//! frozen variables. Nothing of the run layer: every other module may read these.

use crate::core::error::{Result, RuntimeError};
use crate::core::init::init_param;
use crate::core::value::Tensor;
use crate::ps::ShardSpec;
use distc_ir::pipeline::PipelineProgram;
use distc_ir::{Graph, Op, TensorType};
use std::collections::HashMap;

/// The programs of a plan: the SPMD worker program (the one-device graph for one
/// device), the workers' init program and one program per parameter server.
#[derive(Clone, Copy, Debug)]
pub struct Programs<'g> {
    /// The worker program.
    pub worker: &'g Graph,
    /// Broadcasts replicated variables from rank 0, if any.
    pub init: Option<&'g Graph>,
    /// One per parameter server.
    pub servers: &'g [Graph],
    /// Gathers whole variables from the workers' shards after the last step (ZeRO).
    pub finalize: Option<&'g Graph>,
    /// Workers N.
    pub workers: usize,
    /// The stages' programs and schedule of a pipelined plan (`--pipeline`); `worker`
    /// is then the one-device graph they were cut from.
    pub pipeline: Option<&'g PipelineProgram>,
}

impl<'g> Programs<'g> {
    /// One device: the graph alone.
    pub fn single(graph: &'g Graph) -> Programs<'g> {
        Programs {
            worker: graph,
            init: None,
            servers: &[],
            finalize: None,
            workers: 1,
            pipeline: None,
        }
    }

    /// Micro-batches per step: a pipeline's, or the worker program's accumulation.
    pub fn micro_batches(&self) -> usize {
        match self.pipeline {
            Some(p) => p.micro_batches,
            None => micro_batches(self.worker),
        }
    }
}

/// Initial values of every variable of `graph`, from the seed.
pub fn init_params(graph: &Graph, seed: u64) -> HashMap<String, Tensor> {
    graph
        .topo_order()
        .into_iter()
        .filter_map(|id| match graph.op(id) {
            Op::Param { name, ty, init, .. } => {
                Some((name.clone(), init_param(name, ty, init, seed)))
            }
            _ => None,
        })
        .collect()
}

/// The model inputs of `graph` by name, for the data source to shape its fields.
pub fn input_types(graph: &Graph) -> HashMap<String, TensorType> {
    graph
        .inputs()
        .into_iter()
        .map(|(_, n, t)| (n.to_string(), t.clone()))
        .collect()
}

/// Shards of every server program: `shard` sources, by server.
pub fn server_shards(
    servers: &[Graph],
    full: &HashMap<String, TensorType>,
) -> Result<Vec<Vec<ShardSpec>>> {
    servers
        .iter()
        .map(|g| {
            g.topo_order()
                .into_iter()
                .filter_map(|id| match g.op(id) {
                    Op::Shard {
                        var,
                        start,
                        end,
                        init,
                        ..
                    } => Some((var.clone(), *start, *end, init.clone())),
                    _ => None,
                })
                .map(|(var, start, end, init)| {
                    let full = full.get(&var).cloned().ok_or_else(|| {
                        RuntimeError::plan(format!(
                            "server program holds `{var}`, which no worker reads"
                        ))
                    })?;
                    Ok(ShardSpec {
                        var,
                        full,
                        init,
                        start,
                        end,
                    })
                })
                .collect()
        })
        .collect()
}

/// The full type of every server-held variable, from the worker program's pulls.
pub fn pulled_types(worker: &Graph) -> HashMap<String, TensorType> {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::Pull { var, ty, .. } => Some((var.clone(), ty.clone())),
            Op::SparsePull { var, table, .. } => Some((var.clone(), table.clone())),
            _ => None,
        })
        .collect()
}

/// Micro-batches per step of a worker program (gradient accumulation; 1 without).
pub fn micro_batches(worker: &Graph) -> usize {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::Accumulate { micro } => Some(*micro),
            _ => None,
        })
        .max()
        .unwrap_or(1)
}

/// The variables a plan trains, by their whole names (a ZeRO chunk or a model-axis
/// part stands for its variable): those whose gradient a program hands to the
/// optimizer (`param_grad`) or pushes to the servers. The optimizer keeps state for
/// these alone, so a training state must hold every slot of each of them and of no
/// other (a variable the loss never reaches has none, frozen or not).
pub fn trained_variables(programs: &Programs<'_>) -> std::collections::BTreeSet<String> {
    let whole = |n: &str| distc_ir::whole_variable(n).to_string();
    let stages = programs
        .pipeline
        .into_iter()
        .flat_map(|p| p.stages.iter().flat_map(|s| [&s.forward, &s.backward]));
    let mut out = std::collections::BTreeSet::new();
    for g in std::iter::once(programs.worker)
        .chain(programs.servers)
        .chain(stages)
    {
        for id in g.node_ids() {
            match g.op(id) {
                Op::ParamGrad { param: var }
                | Op::Push { var, .. }
                | Op::SparsePush { var, .. } => {
                    out.insert(whole(var));
                }
                _ => {}
            }
        }
    }
    out
}

/// fp16's bound on each gradient computed in 16 bits (issue 67, item 5): one device's
/// gradient of the whole batch overflows fp16 at 65520 (half an ulp above its largest
/// finite 65504), and a worker's, averaged over the `share` parts of a step (workers
/// times micro-batches, each scaled by 1/share), is that gradient over `share`: a part
/// that fits while the whole does not is an overflow of the step, skipped where one
/// device skips it. A variable's gradient is 16-bit where the variable reaches an fp16
/// cast through ops that only move it (of one operand, as a ZeRO gather or a reshape,
/// or packing several into one buffer): its gradient comes back through that cast.
/// By gradient name (`w`, `w.zero`, `w.tp`).
pub fn fp16_overflow_bounds(graph: &Graph, share: usize) -> crate::core::backend::OverflowBounds {
    let mut half = std::collections::BTreeSet::new();
    for id in graph.node_ids() {
        if !matches!(graph.op(id), Op::Cast { to } if *to == distc_ir::DType::F16) {
            continue;
        }
        let mut up = vec![graph.node(id).inputs[0]];
        while let Some(v) = up.pop() {
            let node = graph.node(v.node);
            match &node.op {
                Op::Param { name, .. } => {
                    half.insert(distc_ir::whole_variable(name));
                }
                Op::Pack => up.extend(&node.inputs),
                _ if node.inputs.len() == 1 => up.push(node.inputs[0]),
                _ => {}
            }
        }
    }
    let bound = 65520.0 / share.max(1) as f64;
    graph
        .param_grads()
        .into_iter()
        .filter(|(param, _)| half.contains(distc_ir::whole_variable(param)))
        .map(|(param, _)| (param, bound))
        .collect()
}

/// The variables a plan holds without training them (`frozen` in the DSL): no
/// gradient, no optimizer state.
pub fn frozen_variables(programs: &Programs<'_>) -> std::collections::BTreeSet<String> {
    let mut out = programs.worker.frozen_params();
    for g in programs.init.into_iter().chain(programs.servers) {
        out.extend(g.frozen_params());
    }
    if let Some(p) = programs.pipeline {
        for st in &p.stages {
            out.extend(st.forward.frozen_params());
            out.extend(st.backward.frozen_params());
        }
    }
    out
}
