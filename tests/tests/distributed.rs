//! Distributed plans run as threads: every synchronous strategy computes what one
//! device with the global batch computes, the bytes each worker moves match the plan's
//! prediction, and asynchronous parameter servers still train.

use distc::verify::{verify, VerifyOptions};
use distc::{compile_file, CompileOptions, Compiled};
use distc_passes::placement::{Strategy, StrategyConfig, SyncMode};
use distc_runtime::ps::PsSync;
use distc_runtime::run::data::data_dir;
use distc_runtime::run::train::{train, TrainOptions, TrainReport};
use distc_tests::example;
use std::time::Duration;

fn compile(
    name: &str,
    batch: usize,
    strategy: Strategy,
    workers: usize,
    servers: usize,
) -> Compiled {
    compile_sync(name, batch, strategy, workers, servers, SyncMode::Sync)
}

fn compile_sync(
    name: &str,
    batch: usize,
    strategy: Strategy,
    workers: usize,
    servers: usize,
    sync: SyncMode,
) -> Compiled {
    let strategy = StrategyConfig {
        strategy,
        workers,
        servers,
        sync,
        ..Default::default()
    };
    compile_file(
        &example(name),
        &CompileOptions {
            batch: Some(batch),
            strategy,
            ..Default::default()
        },
    )
    .expect("compiles")
}

fn run(
    c: &Compiled,
    workers: usize,
    sync: PsSync,
    steps: usize,
    global_data: bool,
) -> (TrainReport, Vec<distc_runtime::run::metrics::StepMetrics>) {
    let opts = TrainOptions {
        sync,
        steps: Some(steps),
        global_data,
        ..Default::default()
    };
    let programs = c.programs(workers);
    let mut lines = Vec::new();
    let r = train(programs, &c.config, &opts, &mut |m| {
        lines.push(m.clone());
        Ok(())
    })
    .expect("trains");
    (r, lines)
}

/// N workers of batch b against one device of batch N*b, every variable, through the
/// library's `verify` (what `distc verify` runs).
fn matches_one_device(name: &str, strategy: Strategy, servers: usize) {
    let (n, b, steps) = (2, 8, 3);
    if compile(name, b, Strategy::Single, 1, 0)
        .config
        .data
        .needs_files()
        && data_dir(None).is_none()
    {
        println!("skipping {name}: DISTC_DATA not set");
        return;
    }
    let opts = VerifyOptions {
        compile: CompileOptions {
            batch: Some(b),
            strategy: StrategyConfig {
                strategy,
                workers: n,
                servers,
                ..Default::default()
            },
            ..Default::default()
        },
        steps,
        tolerance: 1e-4,
        timeout: Duration::from_secs(120),
        device: None,
        init: None,
    };
    let report = verify(&example(name), &opts).expect("verifies");
    let worst = report.worst().expect("variables");
    assert!(
        report.passed(),
        "{name} {strategy:?}: `{}` differs by {:.2e}",
        worst.name,
        worst.relative
    );
}

#[test]
fn synchronous_strategies_match_one_device() {
    for name in [
        "sparse_lm.dsl",
        "dense_mlp.dsl",
        "mlp.dsl",
        "recsys.dsl",
        "lm.dsl",
        "cnn.dsl",
    ] {
        matches_one_device(name, Strategy::Allreduce, 0);
        matches_one_device(name, Strategy::Hybrid, 2);
        matches_one_device(name, Strategy::Ps, 2);
    }
}

#[test]
fn measured_bytes_match_the_prediction() {
    for (strategy, servers) in [
        (Strategy::Allreduce, 0),
        (Strategy::Hybrid, 2),
        (Strategy::Ps, 2),
    ] {
        let c = compile("sparse_lm.dsl", 64, strategy, 2, servers);
        let predicted = c
            .dist
            .as_ref()
            .expect("placement")
            .predicted_bytes_per_step_per_worker();
        let (_, lines) = run(&c, 2, PsSync::Sync, 8, false);
        // Step 1 also carries the initial broadcast.
        let timed = &lines[1..];
        let measured: f64 =
            timed.iter().map(|m| m.bytes_moved as f64).sum::<f64>() / timed.len() as f64;
        let err = (measured - predicted).abs() / predicted;
        assert!(
            err < 0.05,
            "{strategy:?}: measured {measured:.0} B/step, predicted {predicted:.0} ({err:.3})"
        );
    }
}

#[test]
fn async_and_stale_servers_train() {
    // The runtime's server mode beside the compiler's (the plan is compiled for it).
    let modes = [
        (PsSync::Async, SyncMode::Async),
        (PsSync::Stale(2), SyncMode::Stale(2)),
    ];
    for (sync, mode) in modes {
        let c = compile_sync("sparse_lm.dsl", 32, Strategy::Ps, 2, 2, mode);
        let (_, lines) = run(&c, 2, sync, 25, false);
        let (first, last) = loss_ends(&lines);
        assert!(last < first, "{sync:?}: loss {first} -> {last}");
    }
    if data_dir(None).is_none() {
        println!("skipping lm.dsl: DISTC_DATA not set");
        return;
    }
    for (sync, mode) in modes {
        let c = compile_sync("lm.dsl", 32, Strategy::Hybrid, 2, 2, mode);
        let (_, lines) = run(&c, 2, sync, 40, false);
        let (first, last) = loss_ends(&lines);
        // Uniform guessing over the 10k-word vocabulary is ln(10000) = 9.2.
        println!("lm {sync:?}: mean loss of the first and last 5 steps {first:.3} -> {last:.3}");
        assert!(last < first - 0.5, "lm {sync:?}: loss {first} -> {last}");
    }
}

/// Mean loss of the first and of the last five steps: one step's loss on one small
/// batch is too noisy to compare.
fn loss_ends(lines: &[distc_runtime::run::metrics::StepMetrics]) -> (f64, f64) {
    let k = 5.min(lines.len());
    let mean = |s: &[distc_runtime::run::metrics::StepMetrics]| {
        s.iter().map(|m| m.loss).sum::<f64>() / s.len() as f64
    };
    (mean(&lines[..k]), mean(&lines[lines.len() - k..]))
}
