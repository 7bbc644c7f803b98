//! Model state on disk (issue 12.6): a run that writes its training state and a run
//! that resumes it end with bitwise the weights of one uninterrupted run, and a state
//! resumes under another strategy, worker count or ZeRO stage.

use distc::verify::compare;
use distc::{compile_file, CompileOptions};
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::core::checkpoint::{load_state, TrainingState};
use distc_runtime::run::train::{train, CheckpointEvery, TrainOptions, TrainReport};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn model(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// A folder of the test's own, removed when it ends.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("distc-checkpoint-{name}-"))
        .tempdir()
        .expect("temp dir")
}

fn layout(strategy: Strategy, workers: usize, servers: usize, zero: u8) -> StrategyConfig {
    StrategyConfig {
        strategy,
        workers,
        servers,
        zero,
        ..Default::default()
    }
}

/// Trains `file` under `s` to `steps`, writing the state to `save` at the end and
/// resuming `resume` when given.
fn run(
    file: &Path,
    s: StrategyConfig,
    steps: usize,
    save: Option<&Path>,
    resume: Option<TrainingState>,
) -> TrainReport {
    let workers = s.workers;
    let distributed = s.strategy != Strategy::Single;
    let c = compile_file(
        file,
        &CompileOptions {
            strategy: s,
            ..Default::default()
        },
    )
    .expect("compiles");
    let opts = TrainOptions {
        steps: Some(steps),
        global_data: distributed,
        checkpoint: save.map(|p| CheckpointEvery::new(p.to_path_buf(), usize::MAX, "test".into())),
        resume: resume.map(Arc::new),
        ..Default::default()
    };
    train(c.programs(workers), &c.config, &opts, &mut |_| Ok(())).expect("trains")
}

#[test]
fn resuming_gives_bitwise_the_uninterrupted_weights() {
    let tmp = temp_dir("bitwise");
    let dir = tmp.path();
    // Adam over a sparse embedding (lazy rows, bias correction) and plain SGD.
    for (name, file) in [
        ("sparse_adam", model("tests/models/issue9_sparse_adam.dsl")),
        ("dense_mlp", model("examples/dense_mlp.dsl")),
    ] {
        for s in [
            layout(Strategy::Single, 1, 0, 0),
            layout(Strategy::Allreduce, 2, 0, 0),
            layout(Strategy::Hybrid, 2, 1, 0),
            layout(Strategy::Ps, 2, 2, 0),
            layout(Strategy::Allreduce, 2, 0, 1),
            layout(Strategy::Allreduce, 3, 0, 3),
        ] {
            let what = format!("{name} {:?} zero {}", s.strategy, s.zero);
            let whole = run(&file, s.clone(), 6, None, None);
            let state_file = dir.join(format!("{name}-{:?}-{}.safetensors", s.strategy, s.zero));
            run(&file, s.clone(), 3, Some(&state_file), None);
            let state = load_state(&state_file).expect("the state loads");
            assert_eq!(state.index.step, 3, "{what}");
            assert!(
                !state.optimizer.is_empty(),
                "{what}: no optimizer step count"
            );
            let resumed = run(&file, s, 6, None, Some(state));
            for (var, w) in &whole.params {
                assert!(
                    resumed.params.get(var) == Some(w),
                    "{what}: `{var}` differs"
                );
            }
        }
    }
}

#[test]
fn a_state_resumes_under_another_layout() {
    let tmp = temp_dir("layouts");
    let dir = tmp.path();
    let file = model("tests/models/issue9_sparse_adam.dsl");
    // Saved from hybrid with 4 workers (the embedding's rows and Adam slots on two
    // servers) and from ZeRO 3 with 4 workers (every dense variable in chunks).
    for saved_by in [
        layout(Strategy::Hybrid, 4, 2, 0),
        layout(Strategy::Allreduce, 4, 0, 3),
    ] {
        let state_file = dir.join(format!(
            "{:?}-{}.safetensors",
            saved_by.strategy, saved_by.zero
        ));
        run(&file, saved_by.clone(), 3, Some(&state_file), None);
        let state = load_state(&state_file).expect("the state loads");
        resume_under_layouts_of_two(&file, &state);
    }
}

fn resume_under_layouts_of_two(file: &Path, state: &TrainingState) {
    // The same state and global batch under four layouts of two workers: servers take
    // their rows and slots of it, ZeRO workers their chunks.
    let file = file.to_path_buf();
    let reference = run(
        &file,
        layout(Strategy::Allreduce, 2, 0, 0),
        6,
        None,
        Some(state.clone()),
    );
    // The state is used: its step 4 starts from trained weights, not the initial ones.
    let fresh = run(&file, layout(Strategy::Allreduce, 2, 0, 0), 3, None, None);
    assert!(
        (reference.first_loss - fresh.first_loss).abs() > 1e-3,
        "resumed at loss {}, fresh at {}",
        reference.first_loss,
        fresh.first_loss
    );
    for s in [
        layout(Strategy::Hybrid, 2, 1, 0),
        layout(Strategy::Ps, 2, 2, 0),
        layout(Strategy::Allreduce, 2, 0, 2),
        layout(Strategy::Allreduce, 2, 0, 3),
    ] {
        let what = format!("{:?} zero {}", s.strategy, s.zero);
        let r = run(&file, s, 6, None, Some(state.clone()));
        let vars = compare(&reference.params, &r.params).unwrap_or_else(|e| panic!("{what}: {e}"));
        for v in vars {
            assert!(
                v.relative < 1e-5,
                "{what}: `{}` differs by {:.2e}",
                v.name,
                v.relative
            );
        }
        assert!(
            (r.first_loss - reference.first_loss).abs() < 1e-5,
            "{what}: first loss {} vs {}",
            r.first_loss,
            reference.first_loss
        );
    }
}

#[test]
fn a_state_that_does_not_fit_is_refused() {
    let tmp = temp_dir("refused");
    let dir = tmp.path();
    let sparse = model("tests/models/issue9_sparse_adam.dsl");
    let state_file = dir.join("sparse.safetensors");
    run(
        &sparse,
        layout(Strategy::Single, 1, 0, 0),
        2,
        Some(&state_file),
        None,
    );
    let state = load_state(&state_file).expect("the state loads");
    let c = compile_file(&model("examples/dense_mlp.dsl"), &CompileOptions::default())
        .expect("compiles");
    let opts = TrainOptions {
        steps: Some(4),
        resume: Some(Arc::new(state.clone())),
        ..Default::default()
    };
    let err = train(c.programs(1), &c.config, &opts, &mut |_| Ok(()))
        .expect_err("another model's state is refused")
        .to_string();
    assert!(err.contains("has no variable `w1`"), "{err}");
    // A run that would end before the state's step.
    let c = compile_file(&sparse, &CompileOptions::default()).expect("compiles");
    let opts = TrainOptions {
        steps: Some(2),
        resume: Some(Arc::new(state)),
        ..Default::default()
    };
    let err = train(c.programs(1), &c.config, &opts, &mut |_| Ok(()))
        .expect_err("nothing to resume")
        .to_string();
    assert!(
        err.contains("at step 2") && err.contains("--steps above 2"),
        "{err}"
    );
    // A weights file is not a training state.
    let weights = dir.join("weights.safetensors");
    let t = distc_runtime::Tensor::F32(ndarray::ArrayD::zeros(ndarray::IxDyn(&[2])));
    distc_runtime::core::checkpoint::save(&weights, &[("w".into(), &t)], Default::default())
        .expect("saves");
    let err = load_state(&weights).expect_err("refused").to_string();
    assert!(
        err.contains("weights.safetensors") && err.contains("cannot be resumed"),
        "{err}"
    );
}
