//! Memory as a result: what a run will hold, by category, predicted from the plan
//! before anything is allocated, and what it held, measured while it runs.
//!
//! Categories, per worker: its **parameters** (the replicated variables it holds;
//! server-held ones it pulls count as activations), the **gradients** a step hands to
//! the optimizer, the **optimizer state** (momentum: one slot per variable; Adam: two;
//! plain SGD: none), the **peak activations** (every value the step computes, freed at
//! its last use as the schedule says) and the **communication buffers** (packed buckets
//! and collective results). Per server: its shards and their optimizer state. Data (a
//! batch, every batch when preloading, the evaluation set on worker 0) is counted for
//! the refusal check below.
//!
//! The prediction runs the executor's own [`Schedule`] over the IR's types by the rule
//! the executor measures with ([`MemoryUse`]); row-sparse values whose row count the
//! type only bounds (after `unique_rows`, `all_gather`) are counted at the rows the
//! compiler measured a batch to touch, when the caller knows them. A plan that would not
//! fit in the machine's available memory is refused with the figures ([`check`]).

use crate::core::config::{OptimizerSpec, RunConfig};
use crate::core::schedule::{MemoryUse, Mode, Schedule};
use crate::run::programs::{input_types, Programs};
use distc_ir::pipeline::schedule::{Action, Carried, Step};
use distc_ir::pipeline::PipelineProgram;
use distc_ir::{Graph, NodeId, Op};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Bytes by category for one worker or one server.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryByCategory {
    /// Variables held.
    pub params: u64,
    /// Gradients handed to the optimizer in a step.
    pub gradients: u64,
    /// Optimizer slots.
    pub optimizer: u64,
    /// Peak of computed values.
    pub activations: u64,
    /// Peak of bucket buffers.
    pub comm_buffers: u64,
}

impl MemoryByCategory {
    /// The sum of the categories.
    pub fn total(&self) -> u64 {
        self.params + self.gradients + self.optimizer + self.activations + self.comm_buffers
    }

    /// `(name, bytes)` of each category, in a fixed order.
    pub fn named(&self) -> [(&'static str, u64); 5] {
        [
            ("params", self.params),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("comm_buffers", self.comm_buffers),
        ]
    }
}

/// Bytes a run needs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryEstimate {
    /// One worker (they all run the same program); of a pipeline, its largest stage.
    pub worker: MemoryByCategory,
    /// Each stage of a pipelined plan, stage 0 first (each of its replicas and model
    /// ranks holds as much); empty for other plans.
    pub stages: Vec<MemoryByCategory>,
    /// Each server.
    pub servers: Vec<MemoryByCategory>,
    /// Data one worker holds: its batch, or every batch when preloading.
    pub data: u128,
    /// The held-out set worker 0 evaluates on.
    pub eval: u128,
    /// Workers.
    pub workers: u128,
    /// Bookkeeping of running every rank as a thread (channels between ranks).
    pub in_process_overhead: u128,
}

impl MemoryEstimate {
    /// One worker process.
    pub fn per_worker(&self) -> u128 {
        u128::from(self.worker.total()) + self.data
    }

    /// Every server together.
    pub fn all_servers(&self) -> u128 {
        self.servers.iter().map(|s| u128::from(s.total())).sum()
    }

    /// Every rank as threads of one process.
    pub fn in_process_total(&self) -> u128 {
        let ranks = if self.stages.is_empty() {
            self.per_worker().saturating_mul(self.workers)
        } else {
            // Each stage is held by as many ranks as there are replicas and model ranks.
            let per_stage = (self.workers / self.stages.len() as u128).max(1);
            self.stages
                .iter()
                .map(|st| (u128::from(st.total()) + self.data).saturating_mul(per_stage))
                .fold(0u128, u128::saturating_add)
        };
        ranks
            .saturating_add(self.eval)
            .saturating_add(self.all_servers())
            .saturating_add(self.in_process_overhead)
    }

    /// One line for people: the total and its parts.
    pub fn describe(&self) -> String {
        let w = &self.worker;
        let (who, ranks) = if self.stages.is_empty() {
            (
                "per worker".to_string(),
                format!("x {} workers", self.workers),
            )
        } else {
            (
                format!("the largest of {} stages", self.stages.len()),
                format!(
                    "(stages: {}) x {} ranks each",
                    self.stages
                        .iter()
                        .map(|st| gib(u128::from(st.total()) + self.data))
                        .collect::<Vec<_>>()
                        .join(", "),
                    (self.workers / self.stages.len() as u128).max(1)
                ),
            )
        };
        format!(
            "{} in one process: {who} {} (variables {}, gradients {}, optimizer state \
             {}, peak activations {}, buckets {}, data {}) {ranks}, evaluation set {}, \
             servers {}",
            gib(self.in_process_total()),
            gib(self.per_worker()),
            gib(w.params.into()),
            gib(w.gradients.into()),
            gib(w.optimizer.into()),
            gib(w.activations.into()),
            gib(w.comm_buffers.into()),
            gib(self.data),
            gib(self.eval),
            gib(self.all_servers()),
        )
    }
}

/// Bytes as GiB (or MiB when small), for messages.
pub fn gib(b: u128) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    }
}

/// Optimizer slots per variable.
pub fn slots(spec: &OptimizerSpec) -> u64 {
    crate::cpu::optim::Optimizer::new(spec).slot_names().len() as u64
}

/// The variable a row-sparse gradient node belongs to: following its single users to
/// the `param_grad` or `sparse_push` that names it.
fn var_of(g: &Graph, mut id: NodeId) -> Option<String> {
    for _ in 0..16 {
        match g.op(id) {
            Op::ParamGrad { param } => return Some(param.clone()),
            Op::SparsePush { var, .. } => return Some(var.clone()),
            _ => {}
        }
        let users = g.user_nodes(id);
        id = *users.first()?;
    }
    None
}

/// The rows each `unique_rows` and `all_gather` of `g` is expected to produce, from
/// the distinct rows a worker's batch touches per variable (`rows_touched`), for
/// [`Schedule::predicted_memory_with`].
pub fn expected_rows(g: &Graph, rows_touched: &HashMap<String, f64>) -> HashMap<NodeId, usize> {
    let mut out = HashMap::new();
    for id in g.node_ids() {
        let per_worker = |id| var_of(g, id).and_then(|v| rows_touched.get(&v).copied());
        match g.op(id) {
            Op::UniqueRows => {
                if let Some(r) = per_worker(id) {
                    out.insert(id, r.ceil() as usize);
                }
            }
            Op::AllGather { workers, .. } => {
                if let Some(r) = per_worker(id) {
                    out.insert(id, (r * *workers as f64).ceil() as usize);
                }
            }
            _ => {}
        }
    }
    out
}

/// The estimate for `programs` trained as `config` says for `steps` steps; `rows` as
/// [`expected_rows`] gives them (empty: slices at their type's bound).
pub fn estimate(
    programs: &Programs<'_>,
    config: &RunConfig,
    steps: usize,
    preload: bool,
    rows: &HashMap<NodeId, usize>,
) -> crate::Result<MemoryEstimate> {
    let params: u64 = programs
        .worker
        .params()
        .iter()
        .map(|(_, _, t)| t.bytes() as u64)
        .sum();
    let slots = slots(&config.optimizer);
    // A frozen variable keeps no optimizer state.
    let frozen = crate::run::programs::frozen_variables(programs);
    let trained: u64 = programs
        .worker
        .params()
        .iter()
        .filter(|(_, n, _)| !frozen.contains(*n))
        .map(|(_, _, t)| t.bytes() as u64)
        .sum();
    let step: MemoryUse = Schedule::new(programs.worker)?.predicted_memory_with(Mode::Train, rows);
    let inputs = input_types(programs.worker);
    let batch_bytes: u128 = inputs.values().map(|t| t.bytes() as u128).sum();
    let per_sample = batch_bytes / config.batch.max(1) as u128;
    let batches = if preload { steps.max(1) as u128 } else { 1 };
    // Synthetic sources generate ten batches by default; file sources hold theirs.
    let eval_samples = config
        .eval_samples
        .map_or(10 * config.batch as u128, |n| n as u128);
    let servers = programs
        .servers
        .iter()
        .map(|g| {
            let held: u64 = g
                .node_ids()
                .into_iter()
                .filter_map(|id| match g.op(id) {
                    Op::Shard { ty, .. } => Some(ty.bytes() as u64),
                    _ => None,
                })
                .sum();
            MemoryByCategory {
                params: held,
                optimizer: held.saturating_mul(slots),
                ..MemoryByCategory::default()
            }
        })
        .collect();
    let workers = programs.workers as u128;
    let stages: Vec<MemoryByCategory> = match programs.pipeline {
        Some(p) => pipeline_stages(p, &config.optimizer)?
            .into_iter()
            .map(|st| st.memory)
            .collect(),
        None => Vec::new(),
    };
    let worker = stages
        .iter()
        .copied()
        .max_by_key(MemoryByCategory::total)
        .unwrap_or(MemoryByCategory {
            params,
            gradients: step.gradients,
            optimizer: trained.saturating_mul(slots),
            activations: step.activations,
            comm_buffers: step.comm_buffers,
        });
    Ok(MemoryEstimate {
        worker,
        stages,
        servers,
        data: batch_bytes
            .saturating_mul(batches)
            .saturating_add(config.data.table_bytes()),
        eval: per_sample.saturating_mul(eval_samples),
        workers,
        in_process_overhead: workers.saturating_mul(workers).saturating_mul(128),
    })
}

/// Memory this machine can give: `MemAvailable` from `/proc/meminfo`, if readable.
pub fn available() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses a run whose estimate `need` (bytes) exceeds what the machine has available,
/// naming both; `what` says what the estimate covers.
pub fn check(need: u128, what: &str) -> Result<(), String> {
    match available() {
        Some(have) if need > have => Err(format!(
            "this run needs about {what}; the machine has {} available: lower the batch, \
             the evaluation set, the workers or the model",
            gib(have)
        )),
        _ => Ok(()),
    }
}

/// One pipeline stage's step, predicted from its own programs by the rule its run
/// measures with: what it holds, its peak activations with the stash and the messages
/// of the micro-batches in flight, and the bytes it exchanges with other stages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageEstimate {
    /// Its memory by category; `activations` is the peak beside the held messages.
    pub memory: MemoryByCategory,
    /// Bytes its forward keeps for its own backward, per micro-batch.
    pub stash_per_micro: u64,
    /// The most micro-batches whose forward ran and whose backward did not.
    pub in_flight: usize,
    /// Bytes of stash and received messages held at that peak's largest.
    pub held_peak: u64,
    /// Bytes of values it sends to other stages per step (tied variables' updates
    /// included), message framing left out.
    pub sent: u64,
    /// Bytes it receives per step.
    pub received: u64,
}

/// Every stage of `pipeline`, as its run counts it ([`StageEstimate`]): the stage's
/// schedule is walked message by message, holding what arrives until the computation
/// that reads it, as the runtime's stage holds it.
pub fn pipeline_stages(
    pipeline: &PipelineProgram,
    optimizer: &OptimizerSpec,
) -> crate::Result<Vec<StageEstimate>> {
    let programs = pipeline
        .programs()
        .map_err(|e| crate::RuntimeError::Plan(format!("the pipeline's schedule: {e}")))?;
    let tied = pipeline.tied();
    let slots = slots(optimizer);
    let mut out = Vec::with_capacity(pipeline.stages.len());
    for (s, (st, steps)) in pipeline.stages.iter().zip(&programs).enumerate() {
        let fwd = Schedule::new(&st.forward)?;
        let bwd = Schedule::new(&st.backward)?;
        let forward = fwd.predicted_memory(Mode::Train);
        let backward = [Mode::Micro, Mode::Train].map(|m| bwd.predicted_memory(m));
        // Bytes of the messages each phase receives from (or, to itself: the stash) a stage.
        let received = |g: &Graph, from: usize| -> u64 {
            g.node_ids()
                .into_iter()
                .filter_map(|id| match g.op(id) {
                    Op::Recv { stage, ty, .. } if *stage == from => Some(ty.bytes() as u64),
                    _ => None,
                })
                .sum()
        };
        let sent = |g: &Graph, to: &dyn Fn(usize) -> bool| -> u64 {
            g.node_ids()
                .into_iter()
                .filter_map(|id| match g.op(id) {
                    Op::Send { stage, .. } if to(*stage) => {
                        Some(g.value_type(g.node(id).inputs[0]).bytes() as u64)
                    }
                    _ => None,
                })
                .sum()
        };
        let stash = sent(&st.forward, &|to| to == s);
        let micro = pipeline.micro_batches;
        let (mut fwd_in, mut bwd_in) = (vec![0u64; micro], vec![0u64; micro]);
        let (mut peak, mut held_peak, mut alive, mut in_flight, mut backwards) = (0, 0, 0, 0, 0);
        let (mut bytes_in, mut bytes_out) = (0u64, 0u64);
        for step in steps {
            match *step {
                Step::Recv {
                    from,
                    what,
                    micro: m,
                } => {
                    let (into, g) = match what {
                        Carried::Activation => (&mut fwd_in, &st.forward),
                        Carried::Gradient => (&mut bwd_in, &st.backward),
                    };
                    let b = received(g, from);
                    into[m] += b;
                    bytes_in += b;
                }
                Step::Send { to, what, .. } => {
                    let g = match what {
                        Carried::Activation => &st.forward,
                        Carried::Gradient => &st.backward,
                    };
                    bytes_out += sent(g, &|t| t == to);
                }
                Step::Compute(action) => {
                    let run = match action {
                        Action::Forward(m) => {
                            fwd_in[m] = 0;
                            alive += 1;
                            forward.activations
                        }
                        Action::Backward(m) => {
                            bwd_in[m] = 0;
                            alive -= 1;
                            backwards += 1;
                            backward[usize::from(backwards == micro)].activations
                        }
                    };
                    in_flight = in_flight.max(alive);
                    let held: u64 = fwd_in.iter().chain(&bwd_in).sum();
                    if run + held > peak {
                        peak = run + held;
                        held_peak = held;
                    }
                    if let Action::Forward(m) = action {
                        bwd_in[m] += stash;
                    }
                }
            }
        }
        let mut params: Vec<(String, u64)> = [&st.forward, &st.backward]
            .iter()
            .flat_map(|g| g.params())
            .map(|(_, n, t)| (n.to_string(), t.bytes() as u64))
            .collect();
        params.sort();
        params.dedup();
        let var_bytes = |name: &str| params.iter().find(|(n, _)| n == name).map_or(0, |p| p.1);
        // A tied variable's holders keep no optimizer state for it, nor does a frozen
        // variable's stage.
        let frozen = st.forward.frozen_params();
        let updated: u64 = params
            .iter()
            .filter(|(n, _)| !tied.iter().any(|t| &t.name == n && t.owner != s))
            .filter(|(n, _)| !frozen.contains(n))
            .map(|(_, b)| b)
            .sum();
        for t in &tied {
            if t.owner == s {
                bytes_out += var_bytes(&t.name) * t.holders.len() as u64;
            } else if t.holders.contains(&s) {
                bytes_in += var_bytes(&t.name);
            }
        }
        out.push(StageEstimate {
            memory: MemoryByCategory {
                params: params.iter().map(|(_, b)| b).sum(),
                gradients: backward[1].gradients,
                optimizer: updated.saturating_mul(slots),
                activations: peak,
                comm_buffers: forward.comm_buffers.max(backward[1].comm_buffers),
            },
            stash_per_micro: stash,
            in_flight,
            held_peak,
            sent: bytes_out,
            received: bytes_in,
        });
    }
    Ok(out)
}
