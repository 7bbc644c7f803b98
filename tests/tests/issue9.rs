//! Regressions of issue 9, Part A, at the library level: each test shows a defect the
//! issue names, on models that are not examples (tests/models/issue9_*.dsl).

use distc::verify::{verify, VerifyError, VerifyOptions};
use distc::{compile_file, CompileOptions, Plan};
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::run::train::{train, TrainOptions};
use distc_tests::{example, EXAMPLES};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name)
}

fn strategy(strategy: Strategy, workers: usize, servers: usize) -> StrategyConfig {
    StrategyConfig {
        strategy,
        workers,
        servers,
        ..Default::default()
    }
}

fn verify_opts(s: StrategyConfig, steps: usize) -> VerifyOptions {
    VerifyOptions {
        compile: CompileOptions {
            strategy: s,
            ..Default::default()
        },
        steps,
        tolerance: 1e-4,
        timeout: Duration::from_secs(60),
        device: None,
        init: None,
    }
}

fn assert_verifies(file: &Path, s: StrategyConfig, steps: usize) {
    let what = format!("{} {:?} x{}", file.display(), s.strategy, s.workers);
    let r = verify(file, &verify_opts(s, steps)).unwrap_or_else(|e| panic!("{what}: {e}"));
    let w = r.worst().expect("variables").clone();
    assert!(
        r.passed(),
        "{what}: `{}` differs by {:.2e}",
        w.name,
        w.relative
    );
}

/// A.2: N workers of batch b drop what one device of batch N*b drops.
#[test]
fn dropout_masks_follow_the_global_batch() {
    let file = model("issue9_dropout.dsl");
    for workers in [2, 3] {
        assert_verifies(&file, strategy(Strategy::Allreduce, workers, 0), 5);
    }
    assert_verifies(&file, strategy(Strategy::Ps, 2, 1), 3);
    // The mask is marked per sample in the IR (the batch is its first axis).
    let c = compile_file(&file, &CompileOptions::default()).expect("compiles");
    let ir = distc_ir::print(&c.programs.worker);
    assert!(ir.contains("per_sample=true"), "{ir}");
}

/// A.3: a sparse gradient's momentum and Adam state change only on the rows the
/// global batch touched, whatever carries the gradient.
#[test]
fn sparse_updates_stay_lazy_under_every_strategy() {
    for file in ["issue9_sparse_momentum.dsl", "issue9_sparse_adam.dsl"] {
        let file = model(file);
        assert_verifies(&file, strategy(Strategy::Allreduce, 2, 0), 4);
        let dense = StrategyConfig {
            sparse_as_dense: true,
            ..strategy(Strategy::Allreduce, 2, 0)
        };
        assert_verifies(&file, dense, 4);
        assert_verifies(&file, strategy(Strategy::Ps, 2, 2), 4);
        assert_verifies(&file, strategy(Strategy::Hybrid, 2, 1), 4);
        // With a fast link the cost model all-reduces the table densified.
        let auto = StrategyConfig {
            bandwidth: 1e15,
            ..strategy(Strategy::Auto, 2, 1)
        };
        let c = compile_file(
            &file,
            &CompileOptions {
                strategy: auto.clone(),
                ..Default::default()
            },
        )
        .expect("compiles");
        let ir = distc_ir::print(&c.programs.worker);
        assert!(ir.contains("sparsify"), "auto did not densify: {ir}");
        assert_verifies(&file, auto, 4);
    }
}

/// A.4: ids or labels beyond what the model indexes failed on a worker mid-run; since
/// issue 20 `compile` refuses them before anything runs, naming the field and the op.
#[test]
fn ids_beyond_the_table_are_refused_at_compile_time() {
    for (file, field) in [
        ("issue9_bad_ids.dsl", "`ids` values up to"),
        ("issue9_bad_labels.dsl", "`label` values up to"),
    ] {
        let e = compile_file(&model(file), &CompileOptions::default())
            .expect_err("refused")
            .to_string();
        assert!(e.contains(field), "{file}: {e}");
    }
}

/// A.5: an error on a worker ends the run, sync or stale, and the cause is what the
/// caller sees; a non-finite loss stops every run at its step.
#[test]
fn a_workers_error_ends_the_run_with_its_cause() {
    let cases = [("issue9_diverges.dsl", "the loss became")];
    for (file, cause) in cases {
        for (s, servers, sync) in [
            (Strategy::Single, 0, distc_passes::placement::SyncMode::Sync),
            (
                Strategy::Allreduce,
                0,
                distc_passes::placement::SyncMode::Sync,
            ),
            (Strategy::Ps, 2, distc_passes::placement::SyncMode::Sync),
            (Strategy::Ps, 2, distc_passes::placement::SyncMode::Stale(1)),
            (Strategy::Hybrid, 1, distc_passes::placement::SyncMode::Sync),
        ] {
            let workers = if s == Strategy::Single { 1 } else { 2 };
            let cfg = StrategyConfig {
                sync,
                ..strategy(s, workers, servers)
            };
            let c = compile_file(
                &model(file),
                &CompileOptions {
                    strategy: cfg,
                    ..Default::default()
                },
            )
            .expect("compiles");
            let programs = c.programs(workers);
            let opts = TrainOptions {
                sync: match sync {
                    distc_passes::placement::SyncMode::Sync => distc_runtime::ps::PsSync::Sync,
                    distc_passes::placement::SyncMode::Async => distc_runtime::ps::PsSync::Async,
                    distc_passes::placement::SyncMode::Stale(k) => {
                        distc_runtime::ps::PsSync::Stale(k)
                    }
                },
                timeout: Duration::from_secs(30),
                ..Default::default()
            };
            let start = Instant::now();
            let e = train(programs, &c.config, &opts, &mut |_| Ok(()))
                .expect_err("the run fails")
                .to_string();
            let what = format!("{file} {s:?} {sync}");
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "{what}: took {:?}",
                start.elapsed()
            );
            assert!(e.contains(cause), "{what}: {e}");
            assert!(
                e.contains("worker "),
                "{what}: the error names no worker: {e}"
            );
            assert!(
                !e.contains("hung up"),
                "{what}: a consequence, not the cause: {e}"
            );
        }
    }
}

/// A.5: distributed runs evaluate, and write the same eval lines as one device.
#[test]
fn distributed_runs_evaluate() {
    let file = example("dense_mlp.dsl");
    for (s, workers, servers) in [
        (Strategy::Single, 1, 0),
        (Strategy::Allreduce, 2, 0),
        (Strategy::Ps, 2, 1),
    ] {
        let c = compile_file(
            &file,
            &CompileOptions {
                batch: Some(16),
                strategy: strategy(s, workers, servers),
                ..Default::default()
            },
        )
        .expect("compiles");
        let mut config = c.config.clone();
        config.eval_every = 2;
        config.eval_samples = Some(64);
        let programs = c.programs(workers);
        let opts = TrainOptions {
            steps: Some(4),
            global_data: s != Strategy::Single,
            ..Default::default()
        };
        let mut evals = Vec::new();
        let r = train(programs, &config, &opts, &mut |m| {
            if let Some(e) = &m.eval {
                evals.push((m.step, e.eval_samples, e.eval_accuracy.is_some()));
            }
            Ok(())
        })
        .expect("trains");
        assert_eq!(evals, [(2, 64, true), (4, 64, true)], "{s:?}");
        assert!(r.eval.is_some(), "{s:?}");
    }
}

/// A.10: verify fails on a model that breaks what data parallelism assumes, and says
/// which assumption.
#[test]
fn verify_names_the_assumption_a_model_breaks() {
    for (file, said) in [
        ("issue9_sum_loss.dsl", "sums over the batch axis"),
        (
            "issue9_batch_statistic.dsl",
            "statistic over the batch axis",
        ),
    ] {
        let r = verify(
            &model(file),
            &verify_opts(strategy(Strategy::Allreduce, 2, 0), 3),
        )
        .expect("runs");
        assert!(!r.passed(), "{file}: verify passed");
        assert!(
            r.assumptions.iter().any(|a| a.contains(said)),
            "{file}: {:?}",
            r.assumptions
        );
    }
    // A model that keeps the assumptions has none listed.
    let c =
        compile_file(&model("issue9_dropout.dsl"), &CompileOptions::default()).expect("compiles");
    assert!(c.assumptions.is_empty(), "{:?}", c.assumptions);
}

/// A.9: verify refuses to compare nothing.
#[test]
fn verify_refuses_what_it_cannot_compare() {
    let file = model("issue9_dropout.dsl");
    let mut o = verify_opts(strategy(Strategy::Allreduce, 2, 0), 0);
    assert!(matches!(verify(&file, &o), Err(VerifyError::Refused(_))));
    o.steps = 1;
    o.tolerance = f64::NAN;
    assert!(matches!(verify(&file, &o), Err(VerifyError::Refused(_))));
    let single = verify_opts(strategy(Strategy::Single, 1, 0), 1);
    assert!(matches!(
        verify(&file, &single),
        Err(VerifyError::Refused(_))
    ));
}

/// A.1: every plan compile writes is one run accepts, for every example, strategy
/// and worker count (floats needing 17 digits included: measured densities, 512/3).
#[test]
fn every_compiled_plan_loads() {
    let have_data = distc_runtime::run::data::data_dir(None).is_some();
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path();
    for name in EXAMPLES {
        let file = example(name);
        for (s, servers) in [
            (Strategy::Allreduce, 0),
            (Strategy::Ps, 2),
            (Strategy::Hybrid, 2),
            (Strategy::Auto, 2),
        ] {
            for workers in [2, 3, 5] {
                let opts = CompileOptions {
                    strategy: strategy(s, workers, servers),
                    ..Default::default()
                };
                let c = match compile_file(&file, &opts) {
                    Ok(c) => c,
                    Err(e) if !have_data => {
                        println!("skipping {name}: {e}");
                        continue;
                    }
                    Err(e) => panic!("{name} {s:?} x{workers}: {e}"),
                };
                let plan = Plan::new(&c, &file.display().to_string(), &opts.strategy);
                let path = dir.join(format!("{name}-{s:?}-{workers}.plan.json"));
                plan.save(&path, &[&file]).expect("saves");
                let (loaded, _) =
                    Plan::load(&path).unwrap_or_else(|e| panic!("{name} {s:?} x{workers}: {e}"));
                assert_eq!(loaded, plan);
            }
        }
    }
    // An lr that needs every digit and a subnormal one survive too.
    let c = compile_file(&example("dense_mlp.dsl"), &CompileOptions::default()).expect("compiles");
    for lr in [512.0 / 3.0, 1e-45, 0.1 + 0.2] {
        let mut c = c.clone();
        c.config.optimizer = distc_runtime::OptimizerSpec::Sgd { lr, momentum: 0.0 };
        let plan = Plan::new(&c, "x.dsl", &StrategyConfig::default());
        let path = dir.join("lr.plan.json");
        plan.save(&path, &[]).expect("saves");
        Plan::load(&path).unwrap_or_else(|e| panic!("lr {lr:e}: {e}"));
    }
}
