//! Kernel fusion (issue 10.3): a plan compiled with `--fuse` trains what the unfused
//! plan trains, on one device and under a distributed strategy, for every example; the
//! fused plans round-trip through text.

use distc::verify::compare;
use distc::{compile_file, CompileOptions, Compiled};
use distc_ir::{parse, print, verify as verify_graph, Op};
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::core::value::Tensor;
use distc_runtime::run::data::data_dir;
use distc_runtime::run::train::{train, TrainOptions};
use distc_tests::{example, EXAMPLES};
use std::collections::HashMap;
use std::time::Duration;

const STEPS: usize = 3;

fn options(strategy: Strategy, workers: usize, servers: usize, fuse: bool) -> CompileOptions {
    CompileOptions {
        batch: Some(4),
        strategy: StrategyConfig {
            strategy,
            workers,
            servers,
            fuse,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Per-step losses and the trained variables.
fn run(c: &Compiled, workers: usize) -> (Vec<f64>, HashMap<String, Tensor>) {
    let opts = TrainOptions {
        steps: Some(STEPS),
        global_data: true,
        timeout: Duration::from_secs(60),
        ..TrainOptions::default()
    };
    let mut losses = Vec::new();
    let report = train(c.programs(workers), &c.config, &opts, &mut |m| {
        losses.push(m.loss);
        Ok(())
    })
    .expect("trains");
    (losses, report.params)
}

fn fused_nodes(c: &Compiled) -> usize {
    let g = &c.programs.worker;
    g.node_ids()
        .into_iter()
        .filter(|&id| matches!(g.op(id), Op::Fused { .. }))
        .count()
}

// One test a strategy, so the two train side by side.
#[test]
fn fused_plans_train_what_unfused_plans_train_on_one_device() {
    fused_plans_train_what_unfused_plans_train(Strategy::Single, 1);
}

#[test]
fn fused_plans_train_what_unfused_plans_train_under_allreduce() {
    fused_plans_train_what_unfused_plans_train(Strategy::Allreduce, 2);
}

fn fused_plans_train_what_unfused_plans_train(s: Strategy, workers: usize) {
    for name in EXAMPLES {
        let file = example(name);
        let probe = compile_file(&file, &CompileOptions::default()).expect("compiles");
        if probe.config.data.needs_files() && data_dir(None).is_none() {
            println!("skipping {name}: DISTC_DATA not set");
            continue;
        }
        let plain = compile_file(&file, &options(s, workers, 0, false))
            .unwrap_or_else(|e| panic!("{name} {s:?}: {e}"));
        let fused = compile_file(&file, &options(s, workers, 0, true))
            .unwrap_or_else(|e| panic!("{name} {s:?} --fuse: {e}"));
        assert_eq!(fused_nodes(&plain), 0, "{name}: fused nodes without --fuse");
        assert!(fused_nodes(&fused) > 0, "{name} {s:?}: nothing was fused");
        let (l0, p0) = run(&plain, workers);
        let (l1, p1) = run(&fused, workers);
        assert_eq!(l0.len(), STEPS);
        for (step, (a, b)) in l0.iter().zip(&l1).enumerate() {
            let rel = (a - b).abs() / a.abs().max(1e-12);
            assert!(
                rel <= 1e-5,
                "{name} {s:?} step {}: loss {a} unfused, {b} fused",
                step + 1
            );
        }
        let vars = compare(&p0, &p1).expect("same variables");
        let worst = vars
            .iter()
            .max_by(|a, b| a.relative.total_cmp(&b.relative))
            .expect("variables");
        println!(
            "{name} {s:?}: {} fused nodes, largest relative difference {:.2e} (`{}`)",
            fused_nodes(&fused),
            worst.relative,
            worst.name
        );
        assert!(
            worst.relative <= 1e-5,
            "{name} {s:?}: `{}` differs by {:.2e}",
            worst.name,
            worst.relative
        );
    }
}

#[test]
fn every_fused_example_round_trips() {
    for name in EXAMPLES {
        for (s, workers, servers) in [(Strategy::Single, 1, 0), (Strategy::Hybrid, 2, 1)] {
            let c = compile_file(&example(name), &options(s, workers, servers, true))
                .unwrap_or_else(|e| panic!("{name} {s:?}: {e}"));
            verify_graph(&c.programs.worker).unwrap_or_else(|e| panic!("{name}: {e}"));
            let text = print(&c.programs.worker);
            assert_eq!(
                parse(&text).expect("parses"),
                c.programs.worker,
                "{name} {s:?} does not round-trip"
            );
        }
    }
}
