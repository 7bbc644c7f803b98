//! What a run will hold in memory, estimated from the plan before anything is
//! allocated, so a plan too large for the machine is refused with the figures instead
//! of aborting the process halfway through an allocation.
//!
//! Per worker: its variables (the replicated ones), the optimizer's slots for them
//! (momentum: one copy; Adam: two), the peak of values live at once while a step runs
//! (from the schedule's last uses, as the executor frees them), a batch of data (every
//! batch when preloading) and, on worker 0, the evaluation set. Per server: its shards
//! and their slots. In one process (threads), everything adds up, plus the
//! communicator's channel matrix.

use crate::config::{OptimizerSpec, RunConfig};
use crate::train::{input_types, Programs};
use distc_ir::{Graph, Op, ValueType};
use std::collections::HashMap;

/// Bytes a run needs, by category, per process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryEstimate {
    /// Variables held by one worker (replicated ones).
    pub worker_params: u128,
    /// Optimizer slots of those.
    pub worker_optimizer: u128,
    /// Peak of the values one step holds at once.
    pub activations: u128,
    /// Data one worker holds: its batch, or every batch when preloading.
    pub data: u128,
    /// The held-out set worker 0 evaluates on.
    pub eval: u128,
    /// Variables and slots held by all servers together.
    pub servers: u128,
    /// Workers.
    pub workers: u128,
    /// Bookkeeping of running every rank as a thread (channels between ranks).
    pub in_process_overhead: u128,
}

impl MemoryEstimate {
    /// One worker process.
    pub fn per_worker(&self) -> u128 {
        self.worker_params + self.worker_optimizer + self.activations + self.data
    }

    /// Every rank as threads of one process.
    pub fn in_process_total(&self) -> u128 {
        self.per_worker()
            .saturating_mul(self.workers)
            .saturating_add(self.eval)
            .saturating_add(self.servers)
            .saturating_add(self.in_process_overhead)
    }

    /// One line for people: the total and its parts.
    pub fn describe(&self) -> String {
        format!(
            "{} in one process: per worker {} (variables {}, optimizer state {}, peak \
             activations {}, data {}) x {} workers, evaluation set {}, servers {}",
            gib(self.in_process_total()),
            gib(self.per_worker()),
            gib(self.worker_params),
            gib(self.worker_optimizer),
            gib(self.activations),
            gib(self.data),
            self.workers,
            gib(self.eval),
            gib(self.servers),
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

fn value_bytes(t: &ValueType) -> u128 {
    match t {
        ValueType::Tensor(t) => t.bytes() as u128,
        // Row ids (4 bytes each) and the rows.
        ValueType::IndexedSlices { dense, nnz } => {
            let rows = dense.dims().first().copied().unwrap_or(1).max(1) as u128;
            let row = dense.bytes() as u128 / rows;
            (*nnz as u128).saturating_mul(row + 4)
        }
    }
}

/// Optimizer slots per variable.
fn slots(spec: &OptimizerSpec) -> u128 {
    match spec {
        OptimizerSpec::Sgd { momentum, .. } if *momentum == 0.0 => 0,
        OptimizerSpec::Sgd { .. } => 1,
        OptimizerSpec::Adam { .. } => 2,
    }
}

/// The peak bytes of computed values live at once when `g` runs in topological order
/// and each value is freed after its last use (variables, feeds and constants are
/// counted elsewhere or are small).
pub fn peak_activations(g: &Graph) -> u128 {
    let order = g.topo_order();
    let pos: HashMap<_, _> = order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut last_use: HashMap<distc_ir::ValueId, usize> = HashMap::new();
    for (i, &id) in order.iter().enumerate() {
        for &v in &g.node(id).inputs {
            last_use.insert(v, i);
        }
    }
    let mut frees: Vec<u128> = vec![0; order.len() + 1];
    let (mut live, mut peak) = (0u128, 0u128);
    for (i, &id) in order.iter().enumerate() {
        let n = g.node(id);
        let borrowed = matches!(
            n.op,
            Op::Param { .. } | Op::Input { .. } | Op::Constant { .. }
        );
        for (port, ty) in n.outputs.iter().enumerate() {
            if borrowed {
                continue;
            }
            let bytes = value_bytes(ty);
            live = live.saturating_add(bytes);
            let freed_at = last_use
                .get(&id.out(port as u16))
                .copied()
                .unwrap_or(i)
                .max(pos[&id]);
            frees[freed_at] = frees[freed_at].saturating_add(bytes);
        }
        peak = peak.max(live);
        live = live.saturating_sub(frees[i]);
    }
    peak
}

/// The estimate for `programs` trained as `config` says for `steps` steps.
pub fn estimate(
    programs: &Programs<'_>,
    config: &RunConfig,
    steps: usize,
    preload: bool,
) -> MemoryEstimate {
    let params: u128 = programs
        .worker
        .params()
        .iter()
        .map(|(_, _, t)| t.bytes() as u128)
        .sum();
    let slots = slots(&config.optimizer);
    let inputs = input_types(programs.worker);
    let batch_bytes: u128 = inputs.values().map(|t| t.bytes() as u128).sum();
    let per_sample = batch_bytes / config.batch.max(1) as u128;
    let batches = if preload { steps.max(1) as u128 } else { 1 };
    // Synthetic sources generate ten batches by default; file sources hold theirs.
    let eval_samples = config
        .eval_samples
        .map_or(10 * config.batch as u128, |n| n as u128);
    let server_bytes: u128 = programs
        .servers
        .iter()
        .flat_map(|g| g.node_ids().into_iter().map(move |id| (g, id)))
        .filter_map(|(g, id)| match g.op(id) {
            Op::Shard { ty, .. } => Some(ty.bytes() as u128),
            _ => None,
        })
        .sum();
    let workers = programs.workers as u128;
    MemoryEstimate {
        worker_params: params,
        worker_optimizer: params.saturating_mul(slots),
        activations: peak_activations(programs.worker),
        data: batch_bytes.saturating_mul(batches),
        eval: per_sample.saturating_mul(eval_samples),
        servers: server_bytes.saturating_mul(1 + slots),
        workers,
        in_process_overhead: workers.saturating_mul(workers).saturating_mul(128),
    }
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
