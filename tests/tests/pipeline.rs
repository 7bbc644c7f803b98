//! Pipeline parallelism (issue 22): a pipelined run equals one device with the same
//! global batch, under both schedules, on the deep example and on models written
//! here; it equals gradient accumulation bitwise; what is not supported is refused.

use distc::verify::{compare, verify, VerifyOptions};
use distc::{compile, CompileOptions, Compiled};
use distc_passes::pipeline::schedule::ScheduleKind;
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::core::checkpoint::{load_state, TrainingState};
use distc_runtime::run::data::data_dir;
use distc_runtime::run::train::{train, CheckpointEvery, TrainOptions};
use distc_runtime::Tensor;
use distc_tests::example;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn pipelined(stages: usize, micro: usize, schedule: ScheduleKind) -> StrategyConfig {
    StrategyConfig {
        pipeline: stages,
        micro_batches: micro,
        schedule,
        ..Default::default()
    }
}

fn verify_opts(strategy: StrategyConfig, batch: Option<usize>) -> VerifyOptions {
    VerifyOptions {
        compile: CompileOptions {
            strategy,
            batch,
            ..Default::default()
        },
        steps: 3,
        tolerance: 1e-5,
        timeout: Duration::from_secs(60),
        device: None,
        init: None,
    }
}

/// A deep tanh MLP on synthetic data, its layers `width` wide, with a skip connection
/// from the first hidden layer to the last (a value that crosses several stages).
fn deep_with_skip(layers: usize, width: usize) -> String {
    let mut s = "model deep {\n  input x: f32[B, 32]\n  input label: i32[B]\n".to_string();
    s += &format!("  param wi: f32[32, {width}] = glorot\n");
    for k in 0..layers {
        s += &format!(
            "  param w{k}: f32[{width}, {width}] = glorot\n  param b{k}: f32[{width}] = zeros\n"
        );
    }
    s += &format!("  param wo: f32[{width}, 10] = glorot\n");
    s += "  h0 = tanh(x @ wi)\n";
    for k in 0..layers {
        s += &format!("  h{} = tanh(h{k} @ w{k} + b{k})\n", k + 1);
    }
    s += &format!(
        "  minimize softmax_cross_entropy((h{layers} + h0) @ wo, label)\n}}\n\
         train {{\n  data = gaussian_classes(features = 32, classes = 10)\n  batch = 16\n  \
         optimizer = sgd(lr = 0.2)\n  steps = 3\n  seed = 11\n}}\n"
    );
    s
}

fn write_model(name: &str, src: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(name);
    std::fs::write(&path, src).expect("write model");
    (dir, path)
}

fn assert_passes(what: &str, r: &distc::verify::VerifyReport) {
    let w = r.worst().expect("variables");
    assert!(
        r.passed(),
        "{what}: `{}` differs by {:.2e} (tolerance {:.0e})",
        w.name,
        w.relative,
        r.tolerance
    );
}

#[test]
fn deep_example_matches_one_device_for_both_schedules() {
    if data_dir(None).is_none() {
        println!("skipping: DISTC_DATA not set (deep_mlp trains on MNIST)");
        return;
    }
    for (stages, micro) in [(2, 4), (4, 4), (4, 8)] {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let r = verify(
                &example("deep_mlp.dsl"),
                &verify_opts(pipelined(stages, micro, schedule), Some(16)),
            )
            .unwrap_or_else(|e| panic!("P={stages} M={micro} {schedule}: {e}"));
            assert_passes(&format!("deep_mlp P={stages} M={micro} {schedule}"), &r);
            assert_eq!(r.global_batch, 16 * micro);
        }
    }
}

#[test]
fn a_skip_connection_across_stages_matches_one_device() {
    let (_dir, path) = write_model("skip.dsl", &deep_with_skip(6, 24));
    for stages in [2, 3, 5] {
        for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            let r = verify(&path, &verify_opts(pipelined(stages, 3, schedule), None))
                .unwrap_or_else(|e| panic!("P={stages} {schedule}: {e}"));
            assert_passes(&format!("skip P={stages} {schedule}"), &r);
        }
    }
}

#[test]
fn sparse_embedding_model_matches_one_device() {
    // sparse_lm: an embedding's row-sparse gradient stays on its stage.
    let r = verify(
        &example("sparse_lm.dsl"),
        &verify_opts(pipelined(2, 2, ScheduleKind::OneFOneB), Some(32)),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_passes("sparse_lm P=2", &r);
}

#[test]
fn replicas_of_a_pipeline_match_one_device() {
    // N workers = N/P replicas of P stages: each stage's gradients averaged over its
    // replicas (bucketed all-reduces; the embedding's rows all-gathered).
    let (_dir, path) = write_model("skip.dsl", &deep_with_skip(4, 16));
    for (workers, stages) in [(4, 2), (6, 3)] {
        let s = StrategyConfig {
            strategy: Strategy::Allreduce,
            workers,
            ..pipelined(stages, 2, ScheduleKind::OneFOneB)
        };
        let r = verify(&path, &verify_opts(s, None))
            .unwrap_or_else(|e| panic!("N={workers} P={stages}: {e}"));
        assert_passes(&format!("skip N={workers} P={stages}"), &r);
        assert_eq!(r.global_batch, 16 * 2 * workers / stages);
    }
    let s = StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 4,
        ..pipelined(2, 2, ScheduleKind::GPipe)
    };
    let r = verify(&example("sparse_lm.dsl"), &verify_opts(s, Some(16)))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_passes("sparse_lm N=4 P=2", &r);
}

fn trained(c: &Compiled) -> HashMap<String, Tensor> {
    let opts = TrainOptions {
        steps: Some(3),
        global_data: true,
        evaluate: false,
        ..TrainOptions::default()
    };
    train(c.programs(1), &c.config, &opts, &mut |_| Ok(()))
        .unwrap_or_else(|e| panic!("{e}"))
        .params
}

#[test]
fn a_pipeline_is_bitwise_gradient_accumulation() {
    // The same micro-batches, the same kernels, the same accumulation order: the stages
    // and their messages change where values are computed, not what.
    let src = deep_with_skip(4, 16);
    for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let piped = compile(
            "skip.dsl",
            &src,
            &CompileOptions {
                strategy: pipelined(3, 4, schedule),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let accumulated = compile(
            "skip.dsl",
            &src,
            &CompileOptions {
                strategy: StrategyConfig {
                    accumulate: 4,
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let errors =
            compare(&trained(&accumulated), &trained(&piped)).unwrap_or_else(|e| panic!("{e}"));
        for e in errors {
            assert_eq!(
                e.relative, 0.0,
                "{schedule}: `{}` differs by {:.2e}",
                e.name, e.relative
            );
        }
    }
}

fn refusal(strategy: StrategyConfig, src: &str) -> String {
    match compile(
        "m.dsl",
        src,
        &CompileOptions {
            strategy,
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("compiled"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_combinations_are_refused_by_name() {
    let src = deep_with_skip(2, 8);
    let uneven = StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 3,
        ..pipelined(2, 2, ScheduleKind::OneFOneB)
    };
    let e = refusal(uneven, &src);
    assert!(
        e.contains("--workers 3 is not a multiple of --pipeline 2"),
        "{e}"
    );
    let servers = StrategyConfig {
        strategy: Strategy::Ps,
        workers: 2,
        servers: 1,
        ..pipelined(2, 2, ScheduleKind::OneFOneB)
    };
    let e = refusal(servers, &src);
    assert!(e.contains("--strategy ps"), "{e}");
    let zero = StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 4,
        zero: 1,
        ..pipelined(2, 2, ScheduleKind::OneFOneB)
    };
    let e = refusal(zero, &src);
    assert!(e.contains("--zero 1 with --pipeline"), "{e}");
    let accumulate = StrategyConfig {
        accumulate: 2,
        ..pipelined(2, 2, ScheduleKind::OneFOneB)
    };
    let e = refusal(accumulate, &src);
    assert!(e.contains("--accumulate 2 with --pipeline"), "{e}");
    let e = refusal(pipelined(500, 2, ScheduleKind::GPipe), &src);
    assert!(e.contains("too few to cut into 500 stages"), "{e}");
}

#[test]
fn a_variable_tied_across_stages_is_updated_once_and_matches_one_device() {
    // The stage of its first use updates `e` with every stage's gradient contribution
    // (sent back to it like any gradient), then sends the updated value to the others.
    let src = distc_tests::tied(4);
    for (stages, schedule) in [
        (2, ScheduleKind::OneFOneB),
        (3, ScheduleKind::GPipe),
        (4, ScheduleKind::OneFOneB),
    ] {
        let c = compile(
            "tied.dsl",
            &src,
            &CompileOptions {
                strategy: pipelined(stages, 2, schedule),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("P={stages}: {e}"));
        let program = c.programs.pipeline.as_ref().expect("a pipeline");
        let ties = program.tied();
        assert_eq!(ties.len(), 1, "P={stages}: {ties:?}");
        assert_eq!(
            (
                ties[0].name.as_str(),
                ties[0].owner,
                ties[0].holders.clone()
            ),
            ("e", 0, vec![stages - 1]),
            "P={stages}"
        );
        let accumulated = compile(
            "tied.dsl",
            &src,
            &CompileOptions {
                strategy: StrategyConfig {
                    accumulate: 2,
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let errors =
            compare(&trained(&accumulated), &trained(&c)).unwrap_or_else(|e| panic!("{e}"));
        for e in errors {
            assert_eq!(
                e.relative, 0.0,
                "P={stages} {schedule}: `{}` differs by {:.2e}",
                e.name, e.relative
            );
        }
        let (_dir, path) = write_model("tied.dsl", &src);
        let r = verify(&path, &verify_opts(pipelined(stages, 2, schedule), None))
            .unwrap_or_else(|e| panic!("P={stages}: {e}"));
        assert_passes(&format!("tied P={stages} {schedule}"), &r);
    }
    // Two replicas: each owner averages over its replicas, then updates its holders.
    let (_dir, path) = write_model("tied.dsl", &src);
    let s = StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 4,
        ..pipelined(2, 2, ScheduleKind::OneFOneB)
    };
    let r = verify(&path, &verify_opts(s, None)).unwrap_or_else(|e| panic!("{e}"));
    assert_passes("tied N=4 P=2", &r);
}

#[test]
fn every_stage_program_round_trips_and_the_cut_is_what_explain_counts() {
    let c = compile(
        "skip.dsl",
        &deep_with_skip(6, 24),
        &CompileOptions {
            strategy: pipelined(3, 2, ScheduleKind::OneFOneB),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let p = c.programs.pipeline.as_ref().expect("a pipeline");
    assert_eq!(p.stages.len(), 3);
    for (s, st) in p.stages.iter().enumerate() {
        for g in [&st.forward, &st.backward] {
            let text = distc_ir::print(g);
            let back = distc_ir::parse(&text).unwrap_or_else(|e| panic!("stage {s}: {e}"));
            assert_eq!(&back, g, "stage {s} does not round-trip");
        }
    }
    // The skip value h0 leaves stage 0 once and is relayed by stage 1 to stage 2.
    let sends = |g: &distc_ir::Graph, to: usize| {
        g.node_ids()
            .into_iter()
            .filter(|id| matches!(g.op(*id), distc_ir::Op::Send { stage, .. } if *stage == to))
            .count()
    };
    assert!(
        sends(&p.stages[0].forward, 1) >= 2,
        "h0 and the layer output"
    );
    assert!(
        sends(&p.stages[1].forward, 2) >= 2,
        "h0 relayed, and the layer output"
    );
    // Every variable lives on exactly one stage.
    let mut held: Vec<String> = p
        .stages
        .iter()
        .flat_map(|st| {
            let mut v: Vec<String> = st
                .forward
                .params()
                .into_iter()
                .chain(st.backward.params())
                .map(|(_, n, _)| n.to_string())
                .collect();
            v.sort();
            v.dedup();
            v
        })
        .collect();
    held.sort();
    let mut all: Vec<String> = c
        .programs
        .worker
        .params()
        .into_iter()
        .map(|(_, n, _)| n.to_string())
        .collect();
    all.sort();
    assert_eq!(held, all);
}

#[test]
fn split_snapshot_of_a_three_layer_model_in_two_stages() {
    let src = "model small {\n  input x: f32[B, 4]\n  input label: i32[B]\n  \
        param w1: f32[4, 4] = glorot\n  param w2: f32[4, 4] = glorot\n  \
        param w3: f32[4, 3] = glorot\n  h1 = tanh(x @ w1)\n  h2 = tanh(h1 @ w2)\n  \
        minimize softmax_cross_entropy(h2 @ w3, label)\n}\n\
        train {\n  data = gaussian_classes(features = 4, classes = 3)\n  batch = 2\n  \
        optimizer = sgd(lr = 0.1)\n  steps = 1\n  seed = 1\n}\n";
    let c = compile(
        "small.dsl",
        src,
        &CompileOptions {
            strategy: pipelined(2, 2, ScheduleKind::OneFOneB),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let p = c.programs.pipeline.as_ref().expect("a pipeline");
    let text: String = p
        .stages
        .iter()
        .flat_map(|st| [distc_ir::print(&st.forward), distc_ir::print(&st.backward)])
        .collect::<Vec<_>>()
        .join("\n");
    insta::assert_snapshot!("pipeline_split_small_p2_m2", text);
}

/// `deep_with_skip` with a `pipeline_stage` marker before each layer in `before`.
fn marked(layers: usize, width: usize, before: &[usize]) -> String {
    let src = deep_with_skip(layers, width);
    let mut out = String::new();
    for line in src.lines() {
        let starts = before
            .iter()
            .any(|k| line.trim_start().starts_with(&format!("h{} = ", k + 1)));
        if starts {
            out += "  pipeline_stage\n";
        }
        out += line;
        out += "\n";
    }
    out
}

#[test]
fn pipeline_stage_markers_place_the_layers_and_match_one_device() {
    // Markers before layers 1 and 4 of six: stage 0 holds wi, w0 and b0; stage 1 the
    // layers 1 to 3; stage 2 the rest. The cost model would cut elsewhere.
    let src = marked(6, 24, &[1, 4]);
    let (_dir, path) = write_model("marked.dsl", &src);
    for schedule in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let c = compile(
            "marked.dsl",
            &src,
            &CompileOptions {
                strategy: pipelined(3, 2, schedule),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = c.programs.pipeline.as_ref().expect("a pipeline");
        let held = |s: usize| -> Vec<String> {
            let mut v: Vec<String> = p.stages[s]
                .forward
                .params()
                .into_iter()
                .map(|(_, n, _)| n.to_string())
                .collect();
            v.sort();
            v
        };
        assert_eq!(held(0), ["b0", "w0", "wi"], "{schedule}");
        assert_eq!(held(1), ["b1", "b2", "b3", "w1", "w2", "w3"], "{schedule}");
        assert_eq!(held(2), ["b4", "b5", "w4", "w5", "wo"], "{schedule}");
        let r = verify(&path, &verify_opts(pipelined(3, 2, schedule), None))
            .unwrap_or_else(|e| panic!("{schedule}: {e}"));
        assert_passes(&format!("marked {schedule}"), &r);
    }
    // One device ignores the markers; another stage count is refused by name.
    compile("marked.dsl", &src, &CompileOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let e = refusal(pipelined(2, 2, ScheduleKind::OneFOneB), &src);
    assert!(
        e.contains("markers make 3 stages, --pipeline asks for 2"),
        "{e}"
    );
}

#[test]
fn a_pipelined_run_evaluates_every_eval_every_steps_as_accumulation_does() {
    // Every 2 steps of 5 and after the last, the coordinator evaluates the whole model on replica 0's
    // variables: the same variables, bit for bit, as one device accumulating the same
    // micro-batches, so the same evaluation.
    let src = deep_with_skip(4, 16).replace("  seed = 11\n", "  seed = 11\n  eval_every = 2\n");
    let evals = |strategy: StrategyConfig| {
        let c = compile(
            "skip.dsl",
            &src,
            &CompileOptions {
                strategy,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let opts = TrainOptions {
            steps: Some(5),
            global_data: true,
            ..TrainOptions::default()
        };
        let mut lines = Vec::new();
        let report = train(c.programs(1), &c.config, &opts, &mut |m| {
            lines.push((m.step, m.eval.as_ref().map(|e| e.eval_loss)));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        (lines, report.eval.map(|e| e.eval_loss))
    };
    let piped = evals(pipelined(3, 4, ScheduleKind::OneFOneB));
    let accumulated = evals(StrategyConfig {
        accumulate: 4,
        ..Default::default()
    });
    let at: Vec<usize> = piped
        .0
        .iter()
        .filter(|l| l.1.is_some())
        .map(|l| l.0)
        .collect();
    assert_eq!(at, [2, 4, 5], "{:?}", piped.0);
    assert_eq!(piped, accumulated);
}

/// Trains `c` on `workers` workers to step `steps`, writing the training state to `save`
/// every `every` steps and after the last, resuming `resume` when given; the states of
/// each step that wrote one, beside the trained variables. A state is written while
/// training goes on, and workers run ahead of the metrics lines, so the file may hold
/// a later step's state by the time a line comes: a step's state before the last is
/// read from a run stopped at that step (the same updates: the schedule's horizon is
/// the plan's steps, whatever the run's).
fn run_with_state(
    c: &Compiled,
    workers: usize,
    steps: usize,
    save: Option<(&Path, usize)>,
    resume: Option<&TrainingState>,
) -> (HashMap<String, Tensor>, Vec<TrainingState>) {
    let run = |to: usize| {
        let opts = TrainOptions {
            steps: Some(to),
            global_data: true,
            evaluate: false,
            checkpoint: save.map(|(path, every)| {
                CheckpointEvery::new(path.to_path_buf(), every, "test".into())
            }),
            resume: resume.map(|s| Arc::new(s.clone())),
            ..TrainOptions::default()
        };
        let report = train(c.programs(workers), &c.config, &opts, &mut |_| Ok(()))
            .unwrap_or_else(|e| panic!("{e}"));
        let state = save.map(|(path, _)| load_state(path).unwrap_or_else(|e| panic!("{e}")));
        (report.params, state)
    };
    let first = resume.map_or(1, |s| s.index.step as usize + 1);
    let mut states: Vec<TrainingState> = match save {
        Some((_, every)) => (first..steps)
            .filter(|k| k % every == 0)
            .filter_map(|k| run(k).1)
            .collect(),
        None => Vec::new(),
    };
    let (params, last) = run(steps);
    states.extend(last);
    (params, states)
}

fn assert_bitwise(what: &str, want: &HashMap<String, Tensor>, got: &HashMap<String, Tensor>) {
    assert_eq!(
        want.keys().collect::<std::collections::BTreeSet<_>>(),
        got.keys().collect(),
        "{what}"
    );
    for (name, w) in want {
        assert!(got.get(name) == Some(w), "{what}: `{name}` differs");
    }
}

#[test]
fn a_pipelined_run_resumes_bitwise_and_its_state_resumes_under_accumulation() {
    // Adam (two slots and a step count) on a model with a variable tied across stages:
    // the state holds the tied variable's slots from its owner, whose updates used them.
    let src =
        distc_tests::tied(4).replace("optimizer = sgd(lr = 0.1)", "optimizer = adam(lr = 0.01)");
    let with = |strategy: StrategyConfig| {
        compile(
            "tied.dsl",
            &src,
            &CompileOptions {
                strategy,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let piped = with(pipelined(3, 2, ScheduleKind::OneFOneB));
    let accumulated = with(StrategyConfig {
        accumulate: 2,
        ..Default::default()
    });
    let tmp = tempfile::tempdir().expect("temp dir");
    let (whole, _) = run_with_state(&piped, 1, 6, None, None);
    // The cross-layout checks below rest on this: the same updates, bit for bit.
    assert_bitwise(
        "accumulation, uninterrupted",
        &whole,
        &run_with_state(&accumulated, 1, 6, None, None).0,
    );

    // Written every 2 steps and after the last: steps 2 and 3.
    let piped_file = tmp.path().join("piped.safetensors");
    let (_, states) = run_with_state(&piped, 1, 3, Some((&piped_file, 2)), None);
    let steps: Vec<u64> = states.iter().map(|s| s.index.step).collect();
    assert_eq!(steps, [2, 3]);
    let acc_file = tmp.path().join("accumulated.safetensors");
    let (_, acc_states) = run_with_state(&accumulated, 1, 3, Some((&acc_file, 2)), None);
    for (p, a) in states.iter().zip(&acc_states) {
        let step = p.index.step;
        assert_bitwise(&format!("variables at step {step}"), &a.params, &p.params);
        assert_bitwise(
            &format!("optimizer state at step {step}"),
            &a.optimizer,
            &p.optimizer,
        );
        assert_eq!(p.index.samples, a.index.samples, "step {step}");
        assert!(p.optimizer.contains_key("e/m") && p.optimizer.contains_key("e/v"));
    }

    for (what, c, state) in [
        ("the pipeline from its step 2", &piped, &states[0]),
        ("the pipeline from its step 3", &piped, &states[1]),
        (
            "accumulation from the pipeline's step 3",
            &accumulated,
            &states[1],
        ),
        (
            "the pipeline from accumulation's step 2",
            &piped,
            &acc_states[0],
        ),
    ] {
        let (resumed, _) = run_with_state(c, 1, 6, None, Some(state));
        assert_bitwise(what, &whole, &resumed);
    }

    // Replicas (N = 4, P = 2): replica 0's stages write the state; every replica's data
    // resumes at its own micro-batches.
    let replicated = with(StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 4,
        ..pipelined(2, 2, ScheduleKind::GPipe)
    });
    let (whole, _) = run_with_state(&replicated, 4, 5, None, None);
    let file = tmp.path().join("replicated.safetensors");
    let (_, states) = run_with_state(&replicated, 4, 2, Some((&file, 2)), None);
    let (resumed, _) = run_with_state(&replicated, 4, 5, None, Some(&states[0]));
    assert_bitwise("N=4 P=2 from step 2", &whole, &resumed);
}

#[test]
fn a_variable_no_op_reads_is_carried_whole_into_checkpoints_and_the_trained_model() {
    // Issue 35, item 1: no stage holds `unused`; it used to fail the run at its end
    // ("a stage did not hand its variables over"), losing the checkpoint and the
    // trained variables. On one device it never changes, and so it must here.
    let src = deep_with_skip(3, 8)
        .replace(
            "  param wo:",
            "  param unused: f32[4, 3] = glorot\n  param wo:",
        )
        .replace("optimizer = sgd(lr = 0.2)", "optimizer = adam(lr = 0.01)");
    let with = |strategy: StrategyConfig| {
        compile(
            "unused.dsl",
            &src,
            &CompileOptions {
                strategy,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let accumulated = with(StrategyConfig {
        accumulate: 2,
        ..Default::default()
    });
    let tmp = tempfile::tempdir().expect("temp dir");
    let acc_file = tmp.path().join("accumulated.safetensors");
    let (acc_params, acc_states) = run_with_state(&accumulated, 1, 3, Some((&acc_file, 2)), None);
    assert!(acc_params.contains_key("unused"));
    for (what, workers, strategy) in [
        ("one pipeline", 1, pipelined(2, 2, ScheduleKind::GPipe)),
        (
            "two replicas",
            2,
            StrategyConfig {
                strategy: Strategy::Allreduce,
                workers: 2,
                ..pipelined(2, 1, ScheduleKind::OneFOneB)
            },
        ),
    ] {
        let piped = with(strategy);
        let file = tmp.path().join(format!("{workers}.safetensors"));
        let (params, states) = run_with_state(&piped, workers, 3, Some((&file, 2)), None);
        assert_eq!(states.len(), 2, "{what}: a state at steps 2 and 3");
        assert!(
            params.get("unused") == acc_params.get("unused"),
            "{what}: `unused` is carried as it is"
        );
        if workers == 1 {
            assert_bitwise(what, &acc_params, &params);
            for (p, a) in states.iter().zip(&acc_states) {
                assert_bitwise(&format!("{what}: variables"), &a.params, &p.params);
                assert_bitwise(
                    &format!("{what}: optimizer state"),
                    &a.optimizer,
                    &p.optimizer,
                );
            }
        }
        // Its state resumes on one device, `unused`'s slots among the others.
        let (resumed, _) = run_with_state(&accumulated, 1, 3, None, Some(&states[0]));
        if workers == 1 {
            assert_bitwise(
                &format!("{what}, resumed by accumulation"),
                &acc_params,
                &resumed,
            );
        }
        let (again, _) = run_with_state(&piped, workers, 3, None, Some(&states[0]));
        assert_bitwise(&format!("{what}, resumed"), &params, &again);
    }
}

/// A sparse model whose last stage does little beside the loss (markers place it; a
/// stage must begin with a variable), and whose embedding's output is read on the
/// first stage and again on the second.
fn loss_only_last_stage() -> String {
    "model relay {\n  input ids: i32[B, 4]\n  input label: i32[B]\n  \
     param emb: f32[64, 16] = uniform(-0.1, 0.1)\n  param w0: f32[64, 64] = glorot\n  \
     param wo: f32[64, 64] = glorot\n  param shift: f32[64] = zeros\n  \
     x = reshape(embedding(emb, ids), [B, 64])\n  h0 = tanh(x @ w0)\n  pipeline_stage\n  \
     z = tanh(h0 @ wo) @ wo + x\n  pipeline_stage\n  \
     minimize softmax_cross_entropy(z + shift, label)\n}\n\
     train {\n  data = zipf_tokens(vocab = 64, context = 4, classes = 64, s = 1.1)\n  \
     batch = 32\n  optimizer = sgd(lr = 0.1)\n  steps = 3\n  seed = 3\n}\n"
        .to_string()
}

#[test]
fn what_explain_predicts_per_stage_is_what_each_stage_measures() {
    // Issue 35, item 4: the stage table counted the cut, not the stage programs, so a
    // value relayed through a middle stage and the messages a stage holds before it
    // reads them were missing (a last stage computing only the loss: 4 B predicted).
    for (what, src, stages, micro, schedule) in [
        (
            "skip relayed",
            deep_with_skip(6, 24),
            3,
            4,
            ScheduleKind::GPipe,
        ),
        (
            "skip relayed 1f1b",
            deep_with_skip(6, 24),
            3,
            4,
            ScheduleKind::OneFOneB,
        ),
        ("tied", distc_tests::tied(4), 3, 2, ScheduleKind::GPipe),
        (
            "loss-only stage",
            loss_only_last_stage(),
            3,
            2,
            ScheduleKind::GPipe,
        ),
    ] {
        let c = compile(
            "m.dsl",
            &src,
            &CompileOptions {
                strategy: pipelined(stages, micro, schedule),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let program = c.programs.pipeline.as_ref().expect("a pipeline");
        let predicted = distc_runtime::run::memory::pipeline_stages(program, &c.config.optimizer)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        // The estimate the run is refused by counts each stage as it is measured.
        let estimate = distc_runtime::run::memory::estimate(
            &c.programs(stages),
            &c.config,
            2,
            false,
            &HashMap::new(),
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(
            estimate.stages,
            predicted.iter().map(|p| p.memory).collect::<Vec<_>>(),
            "{what}"
        );
        let opts = TrainOptions {
            steps: Some(2),
            global_data: true,
            evaluate: false,
            ..TrainOptions::default()
        };
        let mut measured = Vec::new();
        train(c.programs(stages), &c.config, &opts, &mut |m| {
            if let Some(p) = &m.pipeline {
                measured = p.stages.clone();
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(measured.len(), stages, "{what}");
        // Messages carry their names and shapes beside the values.
        let near = |p: u64, m: u64| (p as f64 - m as f64).abs() <= 0.1 * p.max(m) as f64 + 1024.0;
        for (k, (p, m)) in predicted.iter().zip(&measured).enumerate() {
            println!("{what} stage {k}: predicted {p:?}, measured {m:?}");
            assert!(
                near(p.memory.activations, m.activations),
                "{what}: stage {k}'s activations predicted {} B, measured {} B",
                p.memory.activations,
                m.activations
            );
            assert!(
                near(p.sent, m.bytes_sent) && near(p.received, m.bytes_received),
                "{what}: stage {k} predicted to send {} B and receive {} B, measured {} B and {} B",
                p.sent,
                p.received,
                m.bytes_sent,
                m.bytes_received
            );
        }
    }
}
