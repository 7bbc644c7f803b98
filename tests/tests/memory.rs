//! Memory as a result (issue 12): what `distc explain` predicts per worker and per
//! category is what the runtime measures, within 10%, on every example and strategy.

use distc::{compile_file, CompileOptions};
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::run::data::data_dir;
use distc_runtime::run::memory::{self, MemoryByCategory};
use distc_runtime::run::train::{train, TrainOptions};
use distc_tests::{example, EXAMPLES};
use std::collections::HashMap;

#[test]
fn predicted_memory_is_measured_memory() {
    for name in EXAMPLES {
        for (strategy, workers, servers) in [
            (Strategy::Single, 1, 0),
            (Strategy::Allreduce, 2, 0),
            (Strategy::Hybrid, 2, 1),
            (Strategy::Ps, 2, 2),
        ] {
            let opts = CompileOptions {
                batch: Some(16),
                strategy: StrategyConfig {
                    strategy,
                    workers,
                    servers,
                    ..Default::default()
                },
                ..Default::default()
            };
            let c = compile_file(&example(name), &opts).expect("compiles");
            if c.config.data.needs_files() && data_dir(None).is_none() {
                println!("skipping {name}: DISTC_DATA not set");
                break;
            }
            let programs = c.programs(workers);
            let touched: HashMap<String, f64> = c
                .dist
                .iter()
                .flat_map(|d| &d.vars)
                .map(|v| (v.name.clone(), v.rows_touched))
                .collect();
            let rows = memory::expected_rows(&c.programs.worker, &touched);
            let predicted = memory::estimate(&programs, &c.config, 3, false, &rows)
                .expect("estimate")
                .worker;
            let run = TrainOptions {
                steps: Some(3),
                global_data: strategy != Strategy::Single,
                ..Default::default()
            };
            let mut measured = MemoryByCategory::default();
            train(programs, &c.config, &run, &mut |m| {
                measured = m.memory;
                Ok(())
            })
            .expect("trains");
            let what = format!("{name} {strategy:?}");
            println!("{what}: predicted {predicted:?}, measured {measured:?}");
            for ((cat, p), (_, m)) in predicted.named().iter().zip(measured.named()) {
                let (p, m) = (*p as f64, m as f64);
                assert!(
                    (p - m).abs() <= 0.1 * p.max(m) + 1024.0,
                    "{what}: {cat} predicted {p} B, measured {m} B"
                );
            }
        }
    }
}
