//! `distc explain`: what a plan does, for people (a table, then the pipeline, mesh,
//! precision, nodes and learning-rate sections that apply) or for programs (JSON).
//! Rendering lives here rather than in the binary so tests reach it without a
//! process.

use crate::driver::program_view;
use crate::plan::Plan;
use anyhow::Result;
use distc_passes::placement::{Mechanism, Precision, StrategyConfig};
use distc_passes::program_set::ProgramSet;
use distc_runtime::run::memory;
use distc_runtime::run::train::Programs;

/// The explanation of `plan` (its programs as `Plan::load` returned them) as text.
pub fn text(plan: &Plan, programs: &ProgramSet) -> Result<String> {
    let programs = program_view(programs, plan.settings.workers);
    let mem = plan_memory(plan, &programs)?;
    Ok(format!(
        "{}{}{}{}{}{}{}{}",
        plan.search.as_ref().map_or(String::new(), |s| s.render(10)),
        explain_table(plan, &mem, &memory_frozen(&programs)),
        explain_pipeline(plan, programs.worker, programs.pipeline)?,
        explain_mesh(plan, programs.worker),
        explain_precision(plan, programs.worker),
        explain_nodes(&plan.settings, programs.worker),
        explain_lr(&plan.config),
        explain_sparse_updates(&plan.config, &programs)
    ))
}

/// The explanation of `plan` as JSON: the table's content, for programs.
pub fn json(plan: &Plan, programs: &ProgramSet) -> Result<serde_json::Value> {
    let programs = program_view(programs, plan.settings.workers);
    let mem = plan_memory(plan, &programs)?;
    Ok(explain_json(plan, &mem, &memory_frozen(&programs)))
}

/// The memory estimate of a plan's own steps: sparse gradients at the rows the compiler
/// measured a batch to touch.
fn plan_memory(plan: &Plan, programs: &Programs<'_>) -> Result<memory::MemoryEstimate> {
    let touched = crate::verify::rows_touched(plan.dist.as_ref());
    let rows = memory::expected_rows(programs.worker, &touched);
    Ok(memory::estimate(
        programs,
        &plan.config,
        plan.config.steps,
        false,
        &rows,
    )?)
}

/// The plan's frozen variables (`frozen` in the DSL).
fn memory_frozen(programs: &Programs<'_>) -> std::collections::BTreeSet<String> {
    distc_runtime::run::programs::frozen_variables(programs)
}

fn mib(b: f64) -> String {
    if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

fn placement_text(v: &distc_passes::placement::VarPlacement) -> String {
    match v.placement {
        Mechanism::Ps => {
            let shards: Vec<String> = v
                .shards
                .iter()
                .map(|s| format!("s{}[{}:{}]", s.server, s.start, s.end))
                .collect();
            format!("ps {}", shards.join(" "))
        }
        m => m.name().to_string(),
    }
}

/// `--ranks-per-node`: the nodes and links, and for each dense all-reduce the cost
/// model's choice, both predicted times and the bytes a worker sends over each link.
fn explain_nodes(s: &StrategyConfig, worker: &distc_ir::Graph) -> String {
    use distc_ir::{DType, Op, ValueType};
    use distc_passes::hierarchy::{flat_fraction, hierarchical_fractions};
    use std::fmt::Write as _;
    let local = s.ranks_per_node;
    if local == 0 {
        return String::new();
    }
    let n = s.data_workers();
    let link = |bw: f64, lat: f64| format!("{:.3e} B/s, {:.1} us", bw, lat * 1e6);
    let mut out = format!(
        "nodes: {} of {local} workers each (--ranks-per-node); links: within a node {}, \
         between nodes {}\n",
        n.div_ceil(local),
        link(s.intra_link.bandwidth, s.intra_link.latency),
        link(s.bandwidth, s.latency)
    );
    for id in worker.topo_order() {
        let Op::AllReduce { ranks_per_node, .. } = *worker.op(id) else {
            continue;
        };
        let bytes = match worker.value_type(worker.node(id).inputs[0]) {
            ValueType::Tensor(t) if t.dtype == DType::F32 => t.bytes() as f64,
            _ => continue,
        };
        let (flat, hier) = distc_passes::placement::all_reduce_seconds(bytes, n, local, s);
        let sends = if ranks_per_node > 1 {
            let (within, across) = hierarchical_fractions(n, local);
            format!(
                "each worker sends {} within its node and {} across nodes",
                mib(within * bytes),
                mib(across * bytes)
            )
        } else if n > local {
            format!(
                "the ring's {} node-edge workers each send {} across nodes, the others as \
                 much within their node",
                n / local,
                mib(flat_fraction(n) * bytes)
            )
        } else {
            format!(
                "each worker sends {} within its node",
                mib(flat_fraction(n) * bytes)
            )
        };
        let _ =
            writeln!(
            out,
            "  all-reduce {id} ({}): {}; predicted {:.3} ms flat, {:.3} ms hierarchical; {sends}",
            mib(bytes),
            if ranks_per_node > 1 { "hierarchical" } else { "flat" },
            flat * 1e3,
            hier * 1e3
        );
    }
    out
}

/// How the optimizer applies row-sparse gradients (an embedding's), when it keeps
/// slots that make the two rules differ: every row (`torch.optim`'s), or the touched
/// rows only under `lazy = true` (TensorFlow's LazyAdam). Nothing for plain SGD, whose
/// two rules are the same update, or without a sparse gradient.
fn explain_sparse_updates(config: &distc_runtime::RunConfig, programs: &Programs<'_>) -> String {
    // Only where `lazy` changes the update (momentum and Adam).
    let spec = &config.optimizer;
    let differ = spec.moves_untouched_rows(false) != spec.moves_untouched_rows(true);
    // The workers' updates, and the rows pushed to parameter servers.
    let g = programs.worker;
    let pushed = g.node_ids().into_iter().filter_map(|id| match g.op(id) {
        distc_ir::Op::SparsePush { var, .. } => Some(var.clone()),
        _ => None,
    });
    let mut sparse: Vec<String> = g
        .param_grads()
        .into_iter()
        .filter(|(_, grad)| g.value_type(*grad).is_sparse())
        .map(|(param, _)| param)
        .chain(pushed)
        .collect();
    sparse.sort_unstable();
    sparse.dedup();
    if !differ || sparse.is_empty() {
        return String::new();
    }
    let rule = if config.lazy_updates {
        "lazy (`lazy = true`, as TensorFlow's LazyAdam): only the rows a step's batch \
         touches move, and the other rows' optimizer slots neither decay nor move them"
    } else {
        "every row, as torch.optim updates an nn.Embedding's gradient: the slots of rows \
         the batch did not touch decay and move them (`lazy = true` in the optimizer \
         keeps the update to the touched rows)"
    };
    format!("row-sparse gradients ({}): {rule}\n", sparse.join(", "))
}

/// The learning rate: the linear scaling rule's arithmetic and the schedule, with the
/// rate at a few updates of the run (nothing for a constant rate as written).
fn explain_lr(config: &distc_runtime::RunConfig) -> String {
    use distc_runtime::Decay;
    use std::fmt::Write as _;
    let mut s = String::new();
    let lr = config.optimizer.lr();
    if let Some(l) = &config.lr_scaling {
        let _ = writeln!(
            s,
            "learning rate: {lr} = {} x {} / {} (linear scaling rule: a step's {} samples \
             over the train block's batch of {})",
            l.base_lr, l.global_batch, l.batch, l.global_batch, l.batch
        );
    }
    let sched = &config.lr_schedule;
    if !sched.is_constant() {
        let decay = match sched.decay {
            Decay::Constant => "then constant".to_string(),
            Decay::Step { every, gamma } => format!("then x {gamma} every {every} updates"),
            Decay::Cosine { final_factor } => format!("then cosine to {final_factor} x"),
            Decay::Poly {
                power,
                final_factor,
            } => format!("then polynomial (power {power}) to {final_factor} x"),
        };
        let total = config.steps as u64;
        let at: Vec<String> = [0, sched.warmup as u64, total / 2, total.saturating_sub(1)]
            .into_iter()
            .filter(|&t| t < total)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|t| format!("update {}: {:.4e}", t + 1, lr * sched.factor(t, total)))
            .collect();
        let _ = writeln!(
            s,
            "learning-rate schedule: linear warm-up over {} updates, {decay} over {} steps ({})",
            sched.warmup,
            total,
            at.join(", ")
        );
    }
    s
}

/// Mixed precision and a 16-bit gradient wire: what runs in 16 bits, the f32 master
/// variables beside their 16-bit copies, the 16-bit and f32 values a step makes, and
/// the loss scaling. Empty for an f32 plan.
fn explain_precision(p: &Plan, worker: &distc_ir::Graph) -> String {
    use distc_ir::{DType, Op};
    use std::fmt::Write as _;
    let (precision, wire) = (p.settings.precision, p.settings.grad_wire);
    let mut s = String::new();
    if precision != Precision::Fp32 {
        let (mut masters, mut copies, mut half, mut full, mut casts) = (0usize, 0, 0, 0, 0);
        for id in worker.node_ids() {
            let node = worker.node(id);
            let bytes: usize = node.outputs.iter().map(|t| t.dense_type().bytes()).sum();
            match &node.op {
                Op::Param { ty, .. } => masters += ty.bytes(),
                Op::Cast { to } if to.is_half() => {
                    casts += 1;
                    if matches!(worker.op(node.inputs[0].node), Op::Param { .. }) {
                        copies += bytes;
                    } else {
                        half += bytes;
                    }
                }
                op if op.is_source() || op.is_sink() => {}
                _ => {
                    let halfs = node.outputs.iter().any(|t| t.dense_type().dtype.is_half());
                    if halfs {
                        half += bytes;
                    } else if node
                        .outputs
                        .iter()
                        .any(|t| t.dense_type().dtype == DType::F32)
                    {
                        full += bytes;
                    }
                }
            }
        }
        let _ = writeln!(
            s,
            "precision: {precision} (pass mixed_precision; {casts} casts down): variables \
             stay f32 masters ({}), cast each step to 16-bit copies ({}); values a step \
             makes: {} in 16 bits, {} in f32; gradients reach the optimizer in f32",
            mib(masters as f64),
            mib(copies as f64),
            mib(half as f64),
            mib(full as f64)
        );
        if precision == Precision::Fp16 {
            let _ = writeln!(
                s,
                "loss scaling: dynamic, from 2^16: a step whose gradients overflow is \
                 skipped on every worker and halves it; 2000 finite steps double it"
            );
        }
    }
    if wire != Precision::Fp32 {
        let _ = writeln!(
            s,
            "gradient wire: {wire}: each dense all-reduce sends 16-bit values (each \
             worker's divided by N first, sums accumulated in f32), half the bytes of f32"
        );
    }
    s
}

/// A mesh with a model axis: how ranks map to coordinates, each split variable, each
/// model-axis collective with the bytes a worker sends for it per step. Empty for
/// other plans.
fn explain_mesh(p: &Plan, worker: &distc_ir::Graph) -> String {
    use distc_passes::tensor_parallel::{self as tp, MODEL_SHARD_SUFFIX};
    use std::fmt::Write as _;
    let t = p.settings.model;
    if t <= 1 {
        return String::new();
    }
    let pipe = p.settings.pipeline.max(1);
    let d = p.settings.data_workers();
    let mut s = if pipe > 1 {
        format!(
            "mesh: data={d} x model={t} x pipe={pipe} ({} workers): worker w is model rank \
             w % {t} of stage (w / {t}) % {pipe} of data rank w / {}; the model axis links the \
             workers of one stage of one replica, the pipeline the stages of one model rank of \
             one replica, the data axis one stage's model rank across replicas\n",
            p.settings.workers,
            t * pipe
        )
    } else {
        format!(
            "mesh: data={d} x model={t} ({} workers): worker w is model rank w % {t} of data \
             rank w / {t}; the data axis links the workers of one model rank, the model axis \
             those of one data rank\n",
            p.settings.workers
        )
    };
    let _ = writeln!(
        s,
        "model axis: variables split (the model's shard marks and --shard, else the \
         Megatron rule's pairs of matmuls)"
    );
    let _ = writeln!(
        s,
        "  {:<10} {:<16} {:>5} {:<16} {:>12}",
        "variable", "whole", "dim", "per worker", "bytes"
    );
    for (_, name, ty) in worker.params() {
        let Some(var) = name.strip_suffix(MODEL_SHARD_SUFFIX) else {
            continue;
        };
        let dim = p.settings.shard.get(var).copied();
        let mut whole = ty.dims().to_vec();
        if let Some(k) = dim {
            whole[k] *= t;
        }
        let dims = |d: &[usize]| {
            format!(
                "[{}]",
                d.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        let _ = writeln!(
            s,
            "  {:<10} {:<16} {:>5} {:<16} {:>12}",
            var,
            dims(&whole),
            dim.map_or("-".into(), |k| k.to_string()),
            dims(ty.dims()),
            mib(ty.bytes() as f64)
        );
    }
    let _ = writeln!(s, "model-axis collectives per step (worker program):");
    let mut total = 0.0;
    for id in worker.topo_order() {
        if !worker.op(id).is_model_collective() {
            continue;
        }
        let bytes = tp::sent_bytes(worker, id);
        total += bytes;
        let ty = worker.tensor_type(worker.node(id).inputs[0]);
        let _ = writeln!(
            s,
            "  {id:<6} {:<36} {:<18} sends {:>12}",
            worker.op(id).to_string(),
            ty.to_string(),
            mib(bytes)
        );
    }
    let _ = writeln!(
        s,
        "predicted model-axis bytes per step per worker: {} ({total:.0} bytes)",
        mib(total)
    );
    s
}

/// Per pipeline stage: what it holds, its FLOPs, the activations it stashes, the
/// bytes it exchanges, and the bubble its schedule predicts. Empty for other plans.
fn explain_pipeline(
    p: &Plan,
    worker: &distc_ir::Graph,
    program: Option<&distc_ir::pipeline::PipelineProgram>,
) -> Result<String> {
    use distc_ir::pipeline::schedule;
    use std::fmt::Write as _;
    let stages = p.settings.pipeline;
    if stages <= 1 {
        return Ok(String::new());
    }
    let micro = p.settings.micro_batches;
    let kind = p.settings.schedule;
    let plan = distc_passes::pipeline::stages::partition_with(
        worker,
        stages,
        p.settings.stage_marks.as_ref(),
    )?;
    let forward: Vec<f64> = plan.stats.iter().map(|st| st.forward_flops).collect();
    let backward: Vec<f64> = plan.stats.iter().map(|st| st.backward_flops).collect();
    let sim = schedule::simulate(
        &schedule::programs(kind, stages, micro)?,
        &forward,
        &backward,
    )?;
    let mut s = format!(
        "pipeline: {stages} stages x {micro} micro-batches of {} ({kind}); bubble predicted \
         (P-1)/(M+P-1) = {:.1}%, {:.1}% with these stages' FLOPs\n",
        p.config.batch,
        100.0 * schedule::predicted_bubble(stages, micro),
        100.0 * sim.bubble
    );
    let replicas = p.settings.data_workers();
    if replicas > 1 {
        let _ = writeln!(
            s,
            "replicas: {replicas} ({} workers / {stages} stages{}); each stage all-reduces its \
             gradients among its replicas once a step (a ring sends 2(R-1)/R of them: {})",
            p.settings.workers,
            if p.settings.model > 1 {
                format!(" / {} model ranks", p.settings.model)
            } else {
                String::new()
            },
            plan.stats
                .iter()
                .map(
                    |st| mib(st.param_bytes as f64 * 2.0 * (replicas - 1) as f64 / replicas as f64)
                )
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(
        s,
        "{:<6} {:>10} {:>11} {:>11} {:>12} {:>9} {:>12} {:>12} {:>13} {:>13}  variables",
        "stage",
        "params",
        "fwd MFLOP",
        "bwd MFLOP",
        "stash/micro",
        "in flight",
        "held",
        "activations",
        "p2p sent/step",
        "p2p recv/step"
    );
    let var_bytes: std::collections::HashMap<String, usize> = worker
        .params()
        .into_iter()
        .map(|(_, n, t)| (n.to_string(), t.bytes()))
        .collect();
    // What the runtime measures of each stage, read off the stage programs themselves:
    // values relayed through a middle stage and what a stage receives are counted.
    let predicted = match program {
        Some(pr) => memory::pipeline_stages(pr, &p.config.optimizer)?,
        None => Vec::new(),
    };
    for (k, st) in plan.stats.iter().enumerate() {
        let e = predicted.get(k).cloned().unwrap_or_default();
        let _ = writeln!(
            s,
            "{:<6} {:>10} {:>11.2} {:>11.2} {:>12} {:>9} {:>12} {:>12} {:>13} {:>13}  {}",
            k,
            mib(st.param_bytes as f64),
            st.forward_flops / 1e6,
            st.backward_flops / 1e6,
            mib(e.stash_per_micro as f64),
            e.in_flight,
            mib(e.held_peak as f64),
            mib(e.memory.activations as f64),
            mib(e.sent as f64),
            mib(e.received as f64),
            st.variables.join(" ")
        );
    }
    for (name, held) in &plan.tied {
        if let Some((owner, rest)) = held.split_first() {
            let _ = writeln!(
                s,
                "tied: `{name}` is read on stages {held:?}: stage {owner} sums every stage's \
                 gradient of it and updates it, then sends it to stage(s) {rest:?} after each \
                 step ({} each)",
                mib(var_bytes.get(name).copied().unwrap_or(0) as f64)
            );
        }
    }
    Ok(s)
}

/// The explain table: one row per variable, then totals.
fn explain_table(
    p: &Plan,
    mem: &memory::MemoryEstimate,
    frozen: &std::collections::BTreeSet<String>,
) -> String {
    use std::fmt::Write as _;
    let mut s = format!(
        "plan {} ({}): strategy {}, {} workers, {} servers, batch {} per worker\n",
        p.model,
        p.source,
        p.strategy.name(),
        p.settings.workers,
        p.settings.servers,
        p.config.batch
    );
    if !p.overrides.is_empty() {
        let sets: Vec<String> = p.overrides.iter().map(|o| format!("--set {o}")).collect();
        let _ = writeln!(
            s,
            "train block overridden: {}; the plan trains with optimizer {:?}, batch {}, {} \
             steps, seed {}",
            sets.join(" "),
            p.config.optimizer,
            p.config.batch,
            p.config.steps,
            p.config.seed
        );
    }
    if !frozen.is_empty() {
        let _ = writeln!(
            s,
            "frozen (held as they start: no gradient, no optimizer state, no traffic): {}",
            frozen.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let _ = writeln!(
        s,
        "memory (estimate, {} steps): {}",
        p.config.steps,
        mem.describe()
    );
    let _ = writeln!(
        s,
        "{:<10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "memory", "params", "gradients", "optimizer", "activations", "buckets", "total"
    );
    let row = |name: String, m: &memory::MemoryByCategory| {
        format!(
            "{name:<10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
            mib(m.params as f64),
            mib(m.gradients as f64),
            mib(m.optimizer as f64),
            mib(m.activations as f64),
            mib(m.comm_buffers as f64),
            mib(m.total() as f64)
        )
    };
    s += &row("worker".into(), &mem.worker);
    for (i, m) in mem.servers.iter().enumerate() {
        s += &row(format!("server {i}"), m);
    }
    let Some(d) = &p.dist else {
        s += "one device: no communication\n";
        return s;
    };
    let _ = writeln!(
        s,
        "{:<8} {:<14} {:>10} {:<6} {:>8} {:<28} {:>6} {:>12}  runner-up",
        "variable", "shape", "bytes", "kind", "density", "placement", "bucket", "bytes/step",
    );
    for v in &d.vars {
        let shape: Vec<String> = v.shape.iter().map(|x| x.to_string()).collect();
        let _ = writeln!(
            s,
            "{:<8} {:<14} {:>10} {:<6} {:>7.2}% {:<28} {:>6} {:>12}  {}",
            v.name,
            format!("[{}]", shape.join(",")),
            mib(v.bytes as f64),
            format!("{:?}", v.kind).to_lowercase(),
            v.density * 100.0,
            placement_text(v),
            v.bucket.map_or("-".into(), |b| b.to_string()),
            mib(v.predicted_bytes_per_step),
            v.runner_up.map_or("-".into(), |r| format!(
                "{} {}",
                r.placement.name(),
                mib(r.predicted_bytes_per_step)
            )),
        );
    }
    for b in &d.buckets {
        let _ = writeln!(
            s,
            "bucket {}: {} ({})",
            b.id,
            b.vars.join(", "),
            mib(b.bytes as f64)
        );
    }
    let unreached: Vec<&str> = d
        .unreached
        .iter()
        .filter(|v| !frozen.contains(*v))
        .map(String::as_str)
        .collect();
    if !unreached.is_empty() {
        let _ = writeln!(
            s,
            "no gradient reaches: {} (no bucket, no traffic)",
            unreached.join(", ")
        );
    }
    for v in d
        .vars
        .iter()
        .filter(|v| v.kind == distc_passes::placement::Kind::Sparse)
    {
        let _ = writeln!(
            s,
            "{}: {:.1} rows per step ({}); {}",
            v.name, v.rows_touched, v.rows_source, v.reason
        );
    }
    let total: usize = d.vars.iter().map(|v| v.bytes).sum();
    let _ = writeln!(
        s,
        "total: {} of variables; predicted {} per step per worker ({:.0} bytes)",
        mib(total as f64),
        mib(d.predicted_bytes_per_step_per_worker()),
        d.predicted_bytes_per_step_per_worker()
    );
    s
}

/// The explain JSON (the table's content, for programs).
fn explain_json(
    p: &Plan,
    mem: &memory::MemoryEstimate,
    frozen: &std::collections::BTreeSet<String>,
) -> serde_json::Value {
    serde_json::json!({
        "model": p.model,
        "strategy": p.strategy.name(),
        "workers": p.settings.workers,
        "servers": p.settings.servers,
        "batch_per_worker": p.config.batch,
        "search": p.search,
        "variables": p.dist.as_ref().map(|d| d.vars.clone()).unwrap_or_default(),
        "buckets": p.dist.as_ref().map(|d| d.buckets.clone()).unwrap_or_default(),
        "unreached": p.dist.as_ref().map(|d| d.unreached.clone()).unwrap_or_default(),
        "frozen": frozen,
        "predicted_bytes_per_step_per_worker": p.dist.as_ref().map_or(0.0, |d| d.predicted_bytes_per_step_per_worker()),
        "memory": {
            "worker": mem.worker,
            "servers": mem.servers,
            "data": mem.data as u64,
            "eval": mem.eval as u64,
            "per_worker": mem.per_worker() as u64,
            "in_process_total": mem.in_process_total() as u64,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use distc_passes::placement::Strategy;

    /// An embedding (sparse gradient) beside a dense matmul: hybrid puts one on the
    /// server and all-reduces the other, so both kinds of row show.
    const MODEL: &str = "model m {
  input ids: i32[B, 4]
  input label: i32[B]
  param emb: f32[1000, 8] = uniform(-0.05, 0.05)
  param w: f32[32, 10] = glorot
  minimize softmax_cross_entropy(reshape(embedding(emb, ids), [B, 32]) @ w, label)
}
train {
  data = zipf_tokens(vocab = 1000, context = 4, classes = 10, s = 1.1)
  batch = 16
  optimizer = sgd(lr = 0.1)
  steps = 4
  seed = 1
}";

    fn hybrid_plan() -> (Plan, ProgramSet) {
        let cfg = StrategyConfig {
            strategy: Strategy::Hybrid,
            workers: 2,
            servers: 1,
            ..Default::default()
        };
        let opts = crate::CompileOptions {
            strategy: cfg.clone(),
            ..Default::default()
        };
        let c = crate::compile("m.dsl", MODEL, &opts).expect("compiles");
        (Plan::new(&c, "m.dsl", &cfg), c.programs)
    }

    /// The table's row of variable `name`.
    fn row<'a>(text: &'a str, name: &str) -> &'a str {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for `{name}` in:\n{text}"))
    }

    #[test]
    fn the_table_shows_where_each_variable_went() {
        let (plan, programs) = hybrid_plan();
        let t = text(&plan, &programs).expect("renders");
        assert!(
            t.starts_with(
                "plan m (m.dsl): strategy hybrid, 2 workers, 1 servers, batch 16 per worker\n"
            ),
            "{t}"
        );
        let emb = row(&t, "emb");
        assert!(emb.contains("sparse"), "{emb}");
        assert!(emb.contains("ps s0[0:1000]"), "{emb}");
        let w = row(&t, "w");
        assert!(w.contains("dense"), "{w}");
        assert!(w.contains("allreduce"), "{w}");
        assert!(t.contains("bucket 0: w ("), "{t}");
        // Hybrid with sgd and no mesh: no pipeline, mesh, precision or nodes section.
        assert!(!t.contains("pipeline:") && !t.contains("mesh:"), "{t}");
    }

    #[test]
    fn the_json_holds_the_same_placements() {
        let (plan, programs) = hybrid_plan();
        let j = json(&plan, &programs).expect("renders");
        assert_eq!(j["strategy"], "hybrid");
        assert_eq!(j["workers"], 2);
        assert_eq!(j["batch_per_worker"], 16);
        let vars = j["variables"].as_array().expect("variables");
        let placement = |name: &str| {
            vars.iter()
                .find(|v| v["name"] == name)
                .map(|v| v["placement"].clone())
        };
        assert_eq!(placement("emb"), Some("ps".into()));
        assert_eq!(placement("w"), Some("allreduce".into()));
        assert!(j["memory"]["per_worker"].as_u64().unwrap_or(0) > 0, "{j}");
    }

    #[test]
    fn sizes_read_in_the_largest_unit_that_fits() {
        assert_eq!(mib(512.0), "512 B");
        assert_eq!(mib(1536.0), "1.5 KiB");
        assert_eq!(mib(3.0 * 1024.0 * 1024.0), "3.00 MiB");
    }
}
