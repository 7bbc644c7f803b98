//! Batch normalisation (issue 37): `batch_norm` with running statistics. Synchronised
//! statistics make data-parallel workers (with ZeRO, and with parameter servers) train
//! what one device trains, running statistics included; per-worker statistics
//! (`sync = false`) do not, and compile with the warning that says so. Evaluation reads
//! the running statistics, not the batch's. The layouts that do not keep running
//! statistics yet are refused by name.

use distc::dsl::compile_source;
use distc::verify::{verify, VerifyOptions, VerifyReport};
use distc::CompileOptions;
use distc_ir::Op;
use distc_passes::placement::{Strategy, StrategyConfig};
use std::time::Duration;

/// Both ranks of batch_norm: [B, C] after a linear layer, [B, C, H, W] after a
/// convolution of the features seen as 4 channels of 2x2.
fn model(sync: bool) -> String {
    format!(
        "model bn {{
  input x: f32[B, 16]
  input label: i32[B]
  param k: f32[6, 4, 2, 2] = he
  param g1: f32[6] = ones
  param b1: f32[6] = zeros
  param w: f32[54, 8] = glorot
  param g2: f32[8] = ones
  param b2: f32[8] = zeros
  param v: f32[8, 3] = glorot
  param c: f32[3] = zeros
  h = relu(batch_norm(conv2d(reshape(x, [B, 4, 2, 2]), k, padding = 1), g1, b1, sync = {sync}))
  z = relu(batch_norm(reshape(h, [B, 54]) @ w, g2, b2, momentum = 0.2, sync = {sync}))
  minimize softmax_cross_entropy(z @ v + c, label)
}}
train {{
  data = gaussian_classes(features = 16, classes = 3)
  batch = 8
  optimizer = sgd(lr = 0.1, momentum = 0.9)
  steps = 4
  seed = 3
}}
"
    )
}

fn options(strategy: StrategyConfig) -> VerifyOptions {
    VerifyOptions {
        compile: CompileOptions {
            strategy,
            ..Default::default()
        },
        steps: 4,
        tolerance: 1e-4,
        timeout: Duration::from_secs(120),
        device: None,
        init: None,
    }
}

fn verify_text(text: &str, strategy: StrategyConfig) -> VerifyReport {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bn.dsl");
    std::fs::write(&path, text).expect("writes the model");
    verify(&path, &options(strategy)).expect("verify runs")
}

fn workers(n: usize) -> StrategyConfig {
    StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: n,
        ..Default::default()
    }
}

#[test]
fn synchronised_statistics_train_what_one_device_trains_running_statistics_included() {
    let layouts = [
        ("allreduce x2", workers(2)),
        ("allreduce x4", workers(4)),
        (
            "zero 3",
            StrategyConfig {
                zero: 3,
                ..workers(2)
            },
        ),
        (
            "parameter servers",
            StrategyConfig {
                strategy: Strategy::Ps,
                servers: 1,
                ..workers(2)
            },
        ),
    ];
    for (what, s) in layouts {
        trains_what_one_device_trains(what, &verify_text(&model(true), s));
    }
}

/// Asserts `r` compared every running statistic with one device's and passed.
fn trains_what_one_device_trains(what: &str, r: &VerifyReport) {
    let names: Vec<&str> = r.vars.iter().map(|v| v.name.as_str()).collect();
    for running in [
        "g1_running_mean",
        "g1_running_var",
        "g2_running_mean",
        "g2_running_var",
    ] {
        assert!(
            names.contains(&running),
            "{what}: {running} not compared: {names:?}"
        );
    }
    let w = r.worst().expect("variables");
    assert!(
        r.passed(),
        "{what}: `{}` differs by {:.2e}",
        w.name,
        w.relative
    );
}

/// Issue 59: pipeline stages keep running statistics. Each micro-batch normalises with
/// its own statistics (`sync = false`), so two stages of one replica train what one
/// device trains on the same micro-batches (`--accumulate`), running statistics
/// included, moved after every micro-batch in order (with 4 micro-batches, 1F1B runs
/// forwards ahead of backwards).
#[test]
fn pipeline_stages_train_what_one_device_trains_on_the_same_micro_batches() {
    for (what, micro) in [("2 stages x 2 micro-batches", 2), ("2 stages x 4", 4)] {
        let r = verify_text(
            &model(false),
            StrategyConfig {
                pipeline: 2,
                micro_batches: micro,
                ..workers(2)
            },
        );
        assert_eq!(r.micro_batches, micro, "{what}");
        trains_what_one_device_trains(what, &r);
    }
}

#[test]
fn per_worker_statistics_differ_from_one_device_and_are_warned_of() {
    let r = verify_text(&model(false), workers(2));
    assert!(!r.passed(), "per-worker statistics matched one device");
    assert!(
        !r.assumptions.is_empty(),
        "no warning of statistics over the batch axis"
    );
    // Synchronised statistics are the global batch's: nothing to warn of.
    let synced = compile_source("bn.dsl", &model(true), None).expect("compiles");
    assert!(synced.assumptions.is_empty(), "{:?}", synced.assumptions);
}

#[test]
fn the_graph_moves_running_statistics_in_training_and_reads_them_in_evaluation() {
    let p = compile_source("bn.dsl", &model(true), None).expect("compiles");
    let g = &p.graph;
    let assigned: Vec<String> = g
        .node_ids()
        .into_iter()
        .filter_map(|id| match g.op(id) {
            Op::Assign { param } => Some(param.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        assigned,
        [
            "g1_running_mean",
            "g1_running_var",
            "g2_running_mean",
            "g2_running_var"
        ]
    );
    let frozen = g.frozen_params();
    for name in &assigned {
        assert!(frozen.contains(name), "{name} is trained");
    }
    let picks = g
        .node_ids()
        .into_iter()
        .filter(|&id| matches!(g.op(id), Op::TrainOrEval))
        .count();
    assert_eq!(picks, 4, "a mean and a variance per layer");
}

#[test]
fn layouts_that_do_not_keep_running_statistics_are_refused_by_name() {
    let refused = |s: StrategyConfig| -> String {
        let opts = CompileOptions {
            strategy: s,
            ..Default::default()
        };
        match distc::compile("bn.dsl", &model(true), &opts) {
            Ok(_) => panic!("compiled"),
            Err(e) => e.to_string(),
        }
    };
    let e = refused(StrategyConfig {
        pipeline: 2,
        micro_batches: 2,
        ..workers(2)
    });
    assert!(
        e.contains("batch_norm") && e.contains("pipeline stages"),
        "{e}"
    );
    let e = refused(StrategyConfig {
        model: 2,
        ..workers(2)
    });
    assert!(e.contains("batch_norm") && e.contains("model axis"), "{e}");
    let e = refused(StrategyConfig {
        accumulate: 2,
        ..workers(2)
    });
    assert!(e.contains("batch_norm") && e.contains("micro-batch"), "{e}");
}

/// On the GPU (or its emulator, as CI runs it), workers sharing the device match one
/// device, running statistics included: the values of `assign` sinks are copied over
/// their variables after the run, so their buffers live to its end (a GPU run of
/// examples/resnet.dsl found them overwritten by later kernels).
#[test]
fn on_the_gpu_running_statistics_match_one_device() {
    if !distc_tests::gpu_or_skip("running statistics on the GPU") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bn.dsl");
    std::fs::write(&path, model(true)).expect("writes the model");
    let opts = VerifyOptions {
        device: Some(0),
        ..options(workers(2))
    };
    trains_what_one_device_trains("2 workers", &verify(&path, &opts).expect("verify runs"));
    // Two stages on the device, each micro-batch with its own statistics (issue 59):
    // their steps are captured and replayed, the running statistics' copies with them.
    std::fs::write(&path, model(false)).expect("writes the model");
    let opts = VerifyOptions {
        device: Some(0),
        ..options(StrategyConfig {
            pipeline: 2,
            micro_batches: 2,
            ..workers(2)
        })
    };
    trains_what_one_device_trains("pipeline", &verify(&path, &opts).expect("verify runs"));
}
