//! Sparsity analysis: classifies every variable as dense or sparse from the types of
//! its gradient, and records its bytes and the rows a worker's step touches.
//!
//! A variable is sparse when its gradient is `indexed_slices`, i.e. when every
//! contribution is a lookup's slices (autodiff densifies a gradient that mixes in a
//! dense read). Rows touched come from the data: the compiler samples batches of the
//! configured source and hands the mean distinct ids per batch of each id input to
//! the pass ([`crate::PassCx::measured_ids`]); without a measurement the pass uses the
//! bound (the number of lookups) and says so. Reads the graph; writes
//! [`crate::PassCx::dist`]. The graph is unchanged.

use crate::placement::{DistPlan, Kind, Mechanism, VarPlacement};
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{Graph, Op, ValueId};

/// The sparsity analysis.
pub struct SparsityAnalysis;

impl Pass for SparsityAnalysis {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        // The first gradient of each variable, as a search from the start finds it.
        let mut grads: std::collections::HashMap<String, ValueId> = Default::default();
        for (name, v) in g.param_grads() {
            grads.entry(name).or_insert(v);
        }
        let mut plan = DistPlan::default();
        let (mut sparse, mut measured) = (0, 0);
        for (id, name, ty) in g.params() {
            let rows = ty.dims().first().copied().unwrap_or(1).max(1);
            let Some(grad) = grads.get(name) else {
                plan.unreached.push(name.to_string());
                continue;
            };
            let kind = if g.value_type(*grad).is_sparse() {
                Kind::Sparse
            } else {
                Kind::Dense
            };
            let (rows_touched, rows_source) = match kind {
                Kind::Dense => (rows as f64, "dense".to_string()),
                Kind::Sparse => {
                    let mut total = 0.0;
                    let mut sources = Vec::new();
                    for (user, slot) in g.users(id.into()) {
                        if slot != 0 || !matches!(g.op(user), Op::Embedding) {
                            continue;
                        }
                        let ids = g.node(user).inputs[1];
                        let lookups = g.tensor_type(ids).shape.numel() as f64;
                        match g.op(ids.node) {
                            Op::Input { name: input, .. }
                                if cx.measured_ids.contains_key(input) =>
                            {
                                let (mean, batches) = cx.measured_ids[input];
                                total += mean.min(lookups);
                                sources.push(format!("measured: `{input}` over {batches} batches"));
                            }
                            _ => {
                                total += lookups;
                                sources.push("bound: lookups per step, not measured".to_string());
                            }
                        }
                    }
                    if sources.iter().all(|s| s.starts_with("measured")) {
                        measured += 1;
                    }
                    (total.min(rows as f64), sources.join("; "))
                }
            };
            sparse += usize::from(kind == Kind::Sparse);
            plan.vars.push(VarPlacement {
                name: name.to_string(),
                shape: ty.dims().to_vec(),
                bytes: ty.bytes(),
                kind,
                rows_touched,
                density: rows_touched / rows as f64,
                rows_source,
                placement: Mechanism::Local,
                shards: vec![],
                bucket: None,
                predicted_bytes_per_step: 0.0,
                gather_bytes_per_step: 0.0,
                runner_up: None,
                reason: String::new(),
            });
        }
        let stats = PassStats::default()
            .count("variables", plan.vars.len())
            .count("sparse", sparse)
            .count("measured", measured)
            .count("unreached", plan.unreached.len());
        cx.dist = Some(plan);
        Ok(stats)
    }
}
