//! Small end-to-end training runs: DSL in, trained weights and metrics out. Runs are
//! short (debug builds); the full runs are the examples' own configurations.

use distc::{compile_file, CompileOptions};
use distc_runtime::run::data::data_dir;
use distc_runtime::run::train::{train, Programs, TrainOptions, TrainReport};
use distc_tests::example;

fn run(name: &str, batch: Option<usize>, steps: usize) -> Option<TrainReport> {
    let c = compile_file(
        &example(name),
        &CompileOptions {
            batch,
            ..Default::default()
        },
    )
    .expect("compiles");
    if c.config.data.needs_files() && data_dir(None).is_none() {
        println!("skipping {name}: DISTC_DATA not set (point it at the data sets directory)");
        return None;
    }
    let mut lines = 0;
    let report = train(
        Programs::single(&c.programs.worker),
        &c.config,
        &TrainOptions {
            steps: Some(steps),
            ..Default::default()
        },
        &mut |m| {
            lines += 1;
            assert_eq!(m.step, lines);
            assert!(m.loss.is_finite() && m.samples_per_sec > 0.0);
            Ok(())
        },
    )
    .expect("trains");
    assert_eq!(lines, steps);
    Some(report)
}

#[test]
fn dense_mlp_loss_falls() {
    let r = run("dense_mlp.dsl", Some(32), 30).expect("synthetic data needs no files");
    assert!(
        r.final_loss < r.first_loss,
        "{} -> {}",
        r.first_loss,
        r.final_loss
    );
}

#[test]
fn sparse_lm_loss_falls_and_only_touched_rows_move() {
    let c = compile_file(
        &example("sparse_lm.dsl"),
        &CompileOptions {
            batch: Some(32),
            ..Default::default()
        },
    )
    .expect("compiles");
    let init = distc_runtime::run::train::init_params(&c.programs.worker, c.config.seed);
    let r = run("sparse_lm.dsl", Some(32), 20).expect("synthetic data needs no files");
    assert!(
        r.final_loss < r.first_loss,
        "{} -> {}",
        r.first_loss,
        r.final_loss
    );
    // Zipf ids: the tail of the table is almost never looked up, so most rows keep their
    // initial values under sparse SGD.
    let (before, after) = (
        init["emb"].as_f32().expect("f32"),
        r.params["emb"].as_f32().expect("f32"),
    );
    let changed = before
        .outer_iter()
        .zip(after.outer_iter())
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        changed > 0 && changed < 20 * 32 * 8,
        "{changed} rows changed"
    );
}

#[test]
fn mnist_mlp_learns() {
    let Some(r) = run("mlp.dsl", None, 150) else {
        return;
    };
    let acc = r
        .eval
        .expect("evaluated")
        .eval_accuracy
        .expect("classification");
    assert!(acc > 0.85, "accuracy {acc} after 150 steps");
}

#[test]
fn mnist_cnn_learns() {
    let Some(r) = run("cnn.dsl", Some(32), 60) else {
        return;
    };
    assert!(
        r.final_loss < r.first_loss * 0.8,
        "{} -> {}",
        r.first_loss,
        r.final_loss
    );
}

#[test]
fn ptb_lm_loss_falls() {
    let Some(r) = run("lm.dsl", Some(32), 60) else {
        return;
    };
    let ln_v = (10000f64).ln();
    assert!(
        (r.first_loss - ln_v).abs() < 0.5,
        "first loss {} should be near ln(10000)",
        r.first_loss
    );
    assert!(
        r.final_loss < ln_v - 1.0,
        "{} -> {}",
        r.first_loss,
        r.final_loss
    );
}

#[test]
fn movielens_rmse_falls() {
    let c = compile_file(&example("recsys.dsl"), &CompileOptions::default()).expect("compiles");
    if data_dir(None).is_none() {
        println!("skipping recsys: DISTC_DATA not set");
        return;
    }
    let rmse = |steps| {
        train(
            Programs::single(&c.programs.worker),
            &c.config,
            &TrainOptions {
                steps: Some(steps),
                ..Default::default()
            },
            &mut |_| Ok(()),
        )
        .expect("trains")
        .eval
        .expect("evaluated")
        .eval_rmse
        .expect("regression")
    };
    let (early, later) = (rmse(1), rmse(300));
    assert!(later < early && later < 1.1, "rmse {early} -> {later}");
}
