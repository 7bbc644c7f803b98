//! Placement: chooses each variable's mechanism (all-reduce, all-gather, parameter
//! server) by the strategy's rule or, for `auto`, by the cost model, and lays out the
//! server shards: variables of at least `partition_bytes` are row-partitioned over
//! every server; smaller ones go whole to the least-loaded server, largest first.
//! Requires the sparsity analysis; writes [`crate::PassCx::dist`]; the graph is
//! unchanged (the `distribute` pass rewrites it).

use crate::cost::{cost, VarCost};
use crate::placement::{Kind, Mechanism, RunnerUp, Shard, Strategy, VarPlacement};
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::Graph;

/// The placement pass.
pub struct Place;

fn var_cost(v: &VarPlacement) -> VarCost {
    let rows = v.shape.first().copied().unwrap_or(1).max(1);
    VarCost {
        bytes: v.bytes as f64,
        row_bytes: v.bytes as f64 / rows as f64,
        rows_touched: v.rows_touched,
        sparse: v.kind == Kind::Sparse,
    }
}

impl Pass for Place {
    fn run(&self, _g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let cfg = cx.strategy.clone();
        let mut plan = cx.dist.take().ok_or_else(|| {
            PassError::Precondition("placement needs the sparsity analysis".into())
        })?;
        let needs_servers = matches!(cfg.strategy, Strategy::Ps | Strategy::Hybrid);
        if needs_servers && cfg.servers == 0 {
            return Err(PassError::Precondition(format!(
                "strategy {} needs at least one parameter server (--servers)",
                cfg.strategy.name()
            )));
        }
        for v in &mut plan.vars {
            let c = var_cost(v);
            let mut candidates = vec![Mechanism::Allreduce];
            if v.kind == Kind::Sparse {
                candidates.push(Mechanism::Allgather);
            }
            if cfg.servers > 0 {
                candidates.push(Mechanism::Ps);
            }
            let chosen = match (cfg.strategy, v.kind) {
                (Strategy::Single, _) => Mechanism::Local,
                (Strategy::Allreduce, Kind::Sparse) if !cfg.sparse_as_dense => Mechanism::Allgather,
                (Strategy::Allreduce, _) => Mechanism::Allreduce,
                (Strategy::Ps, _) | (Strategy::Hybrid, Kind::Sparse) => Mechanism::Ps,
                (Strategy::Hybrid, Kind::Dense) => Mechanism::Allreduce,
                (Strategy::Auto, _) => *candidates
                    .iter()
                    .min_by(|a, b| cost(**a, c, &cfg).time.total_cmp(&cost(**b, c, &cfg).time))
                    .unwrap_or(&Mechanism::Allreduce),
            };
            let chosen_cost = cost(chosen, c, &cfg);
            let runner = candidates
                .iter()
                .filter(|m| **m != chosen)
                .min_by(|a, b| cost(**a, c, &cfg).time.total_cmp(&cost(**b, c, &cfg).time));
            v.placement = chosen;
            v.predicted_bytes_per_step = chosen_cost.bytes;
            v.runner_up = runner.map(|m| RunnerUp {
                placement: *m,
                predicted_bytes_per_step: cost(*m, c, &cfg).bytes,
            });
            let ms = |m: Mechanism| format!("{} {:.3} ms", m.name(), cost(m, c, &cfg).time * 1e3);
            v.reason = match (cfg.strategy, runner) {
                (Strategy::Single, _) => "one device".into(),
                (Strategy::Auto, Some(r)) => format!("{} < {}", ms(chosen), ms(*r)),
                (Strategy::Auto, None) => ms(chosen),
                (s, _) => {
                    let how = match chosen {
                        Mechanism::Local => "where no gradient travels",
                        Mechanism::Allreduce => "in an all-reduce of the gradient",
                        Mechanism::Allgather => "in an all-gather of the gradient's rows",
                        Mechanism::Ps => "on the parameter servers",
                    };
                    format!(
                        "strategy {} places {} variables {how}",
                        s.name(),
                        format!("{:?}", v.kind).to_lowercase()
                    )
                }
            };
        }
        // Shards: partitioned variables first, then whole ones largest first onto the
        // least-loaded server.
        let mut load = vec![0usize; cfg.servers];
        let mut order: Vec<usize> = (0..plan.vars.len())
            .filter(|&i| plan.vars[i].placement == Mechanism::Ps)
            .collect();
        order.sort_by_key(|&i| std::cmp::Reverse(plan.vars[i].bytes));
        let mut partitioned = 0;
        for &i in &order {
            let v = &mut plan.vars[i];
            let rows = v.shape.first().copied().unwrap_or(1).max(1);
            let row_bytes = v.bytes / rows;
            if v.bytes >= cfg.partition_bytes && cfg.servers > 1 && rows >= cfg.servers {
                partitioned += 1;
                for (s, load) in load.iter_mut().enumerate() {
                    let (start, end) = (rows * s / cfg.servers, rows * (s + 1) / cfg.servers);
                    *load += (end - start) * row_bytes;
                    v.shards.push(Shard {
                        server: s,
                        start,
                        end,
                        bytes: (end - start) * row_bytes,
                    });
                }
            }
        }
        for &i in &order {
            let v = &mut plan.vars[i];
            if v.shards.is_empty() {
                let s = (0..cfg.servers).min_by_key(|&s| load[s]).unwrap_or(0);
                load[s] += v.bytes;
                let rows = v.shape.first().copied().unwrap_or(1);
                v.shards.push(Shard {
                    server: s,
                    start: 0,
                    end: rows,
                    bytes: v.bytes,
                });
            }
        }
        let count = |m: Mechanism| plan.vars.iter().filter(|v| v.placement == m).count();
        let stats = PassStats::default()
            .count("allreduce", count(Mechanism::Allreduce))
            .count("allgather", count(Mechanism::Allgather))
            .count("ps", count(Mechanism::Ps))
            .count("partitioned", partitioned);
        cx.dist = Some(plan);
        Ok(stats)
    }
}
