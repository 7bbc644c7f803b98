//! Gradient accumulation (issue 12): K micro-batches of b per step train what one
//! device trains with N*K*b, communicate once per step and hold one micro-batch's
//! activations.

use distc::verify::{verify, VerifyOptions};
use distc::{compile_file, CompileOptions};
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::run::data::data_dir;
use distc_runtime::run::metrics::StepMetrics;
use distc_runtime::run::train::{train, TrainOptions};
use distc_tests::{example, EXAMPLES};
use std::time::Duration;

fn strategy(
    strategy: Strategy,
    workers: usize,
    servers: usize,
    accumulate: usize,
) -> StrategyConfig {
    StrategyConfig {
        strategy,
        workers,
        servers,
        accumulate,
        ..Default::default()
    }
}

#[test]
fn accumulation_trains_what_one_device_trains() {
    for name in EXAMPLES {
        let file = example(name);
        let probe = compile_file(&file, &CompileOptions::default()).expect("compiles");
        if probe.config.data.needs_files() && data_dir(None).is_none() {
            println!("skipping {name}: DISTC_DATA not set");
            continue;
        }
        for (s, servers) in [(Strategy::Allreduce, 0), (Strategy::Hybrid, 1)] {
            let opts = VerifyOptions {
                compile: CompileOptions {
                    batch: Some(4),
                    strategy: strategy(s, 2, servers, 3),
                    ..Default::default()
                },
                steps: 3,
                // lm.dsl trains with Adam, whose division by sqrt(v) amplifies the f32
                // rounding of summing 6 micro-batch means in another order (9.7e-5).
                tolerance: 2e-4,
                timeout: Duration::from_secs(60),
                device: None,
                init: None,
            };
            let r = verify(&file, &opts).unwrap_or_else(|e| panic!("{name} {s:?}: {e}"));
            let w = r.worst().expect("variables").clone();
            println!(
                "{name} {s:?} accumulate 3: largest relative error {:.2e}",
                w.relative
            );
            assert!(
                r.passed(),
                "{name} {s:?}: `{}` differs by {:.2e}",
                w.name,
                w.relative
            );
        }
    }
}

fn lines(batch: usize, accumulate: usize) -> Vec<StepMetrics> {
    let opts = CompileOptions {
        batch: Some(batch),
        strategy: strategy(Strategy::Allreduce, 2, 0, accumulate),
        ..Default::default()
    };
    let c = compile_file(&example("dense_mlp.dsl"), &opts).expect("compiles");
    let programs = c.programs(2);
    let mut out = Vec::new();
    let run = TrainOptions {
        steps: Some(3),
        global_data: true,
        ..Default::default()
    };
    train(programs, &c.config, &run, &mut |m| {
        out.push(m.clone());
        Ok(())
    })
    .expect("trains");
    out
}

#[test]
fn one_round_of_communication_and_one_micro_batch_of_activations() {
    let plain = lines(16, 1);
    let accumulated = lines(16, 4);
    let large = lines(64, 1);
    // Step 2 (step 1 also carries the initial broadcast).
    assert_eq!(accumulated[1].bytes_moved, plain[1].bytes_moved);
    // One micro-batch's activations (plus the accumulated means, a few KiB here).
    let (a, p) = (
        accumulated[1].memory.activations as f64,
        plain[1].memory.activations as f64,
    );
    assert!((a - p).abs() <= 0.01 * p, "{a} vs {p}");
    // Four times the batch in one go holds more (the weight gradients do not grow).
    assert!(large[1].memory.activations > accumulated[1].memory.activations);
    assert!(accumulated.iter().all(|m| m.loss.is_finite()));
}
