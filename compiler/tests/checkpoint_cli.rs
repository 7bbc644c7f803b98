//! `--checkpoint`, `--checkpoint-every` and `--resume` at the command line: a run
//! resumed from its state file ends with the uninterrupted run's weights; files that
//! are not training states and runs with nothing left to do are refused by name.

use distc_runtime::core::checkpoint;
use std::path::PathBuf;

mod common;

use common::{distc, refused, s, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("checkpoint-cli").join(name)
}

const MODEL: &str = "tests/models/issue9_sparse_adam.dsl";

#[test]
fn train_resume_and_refusals() {
    let (whole, state, resumed) = (tmp("whole.st"), tmp("state.st"), tmp("resumed.st"));
    let o = distc(&["train", MODEL, "--steps", "5", "-q", "--save", s(&whole)]);
    assert!(o.status.success(), "{}", text(&o));
    // Written at steps 2 and 4 and at the end (3): the file holds the last, step 3.
    let o = distc(&[
        "train",
        MODEL,
        "--steps",
        "3",
        "-q",
        "--checkpoint-every",
        "2",
        "--checkpoint",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        checkpoint::load_state(&state).expect("a state").index.step,
        3
    );
    // Resumed to the end: the weights of the uninterrupted run, bit for bit.
    let o = distc(&[
        "train",
        MODEL,
        "--steps",
        "5",
        "--resume",
        s(&state),
        "--save",
        s(&resumed),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // Issue 36, item 7.4: one worker in the singular, and the resumption said.
    let summary = String::from_utf8_lossy(&o.stdout);
    assert!(
        summary.contains("(single, 1 worker) on CPU (")
            && summary.contains(" threads): 2 steps resumed from step 3 in"),
        "{summary}"
    );
    let (a, _) = checkpoint::load(&whole).expect("weights");
    let (b, _) = checkpoint::load(&resumed).expect("weights");
    assert_eq!(a, b, "the resumed run ended elsewhere");

    for (args, want) in [
        (vec!["--checkpoint-every", "2"], "--checkpoint <FILE>"),
        (
            vec!["--checkpoint-every", "0", "--checkpoint", "x.st"],
            "0 is not allowed",
        ),
        (vec!["--resume", s(&whole)], "cannot be resumed"),
        (
            vec!["--resume", s(&state), "--steps", "3"],
            "--steps above 3",
        ),
        (vec!["--resume", "no-such-state.st"], "no-such-state.st"),
    ] {
        let mut all = vec!["train", MODEL, "-q"];
        all.extend(args.iter().copied());
        refused(&all, want);
    }
}

/// Issue 60, item 2: a variable the loss never reaches gets no optimizer state (no
/// gradient ever reaches Adam for it), and the state a run wrote without it resumes, on
/// one device and on 2 workers, to the uninterrupted run's weights bit for bit. It
/// used to be refused as "damaged": the run was lost.
#[test]
fn a_state_with_a_variable_the_loss_never_reaches_resumes_under_adam() {
    let dir = common::temp_dir("checkpoint-unreached");
    let model = dir.join("unreached.dsl");
    std::fs::write(
        &model,
        "model unreached {
  input x: f32[B, 8]
  input label: i32[B]
  param w: f32[8, 3] = glorot
  param b: f32[3] = zeros
  param unused: f32[4] = glorot
  minimize softmax_cross_entropy(x @ w + b, label)
}
train {
  data = gaussian_classes(features = 8, classes = 3)
  batch = 8
  optimizer = adam(lr = 0.01)
  steps = 3
  seed = 1
}
",
    )
    .expect("writes the model");
    let plan = dir.join("unreached.plan.json");
    let o = distc(&[
        "compile",
        s(&model),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    for (what, run) in [
        ("one device", vec!["train", s(&model)]),
        ("2 workers", vec!["run", s(&plan)]),
    ] {
        let (state, resumed, whole) = (
            dir.join(format!("{what}.state.st")),
            dir.join(format!("{what}.resumed.st")),
            dir.join(format!("{what}.whole.st")),
        );
        let go = |extra: &[&str]| {
            let mut args = run.clone();
            args.push("-q");
            args.extend(extra);
            let o = distc(&args);
            assert!(o.status.success(), "{what} {extra:?}: {}", text(&o));
        };
        go(&["--checkpoint", s(&state)]);
        let written = checkpoint::load_state(&state).expect("a state");
        assert!(
            !written.optimizer.keys().any(|k| k.starts_with("unused/")),
            "{what}: {:?}",
            written.optimizer.keys().collect::<Vec<_>>()
        );
        go(&["--steps", "5", "--resume", s(&state), "--save", s(&resumed)]);
        go(&["--steps", "5", "--save", s(&whole)]);
        let (a, _) = checkpoint::load(&whole).expect("weights");
        let (b, _) = checkpoint::load(&resumed).expect("weights");
        assert_eq!(a, b, "{what}: the resumed run ended elsewhere");
    }
}

/// Issue 36, item 7.6: the schedule's horizon is the plan's `steps`, not `--steps`: a
/// run stopped at 100 and resumed to 200 follows the curve of the run of 200 (it used
/// to decay to the floor at 100 and jump back up at 101). Past the horizon the rate
/// stays at the schedule's final factor.
#[test]
fn a_resumed_run_follows_the_plans_learning_rate_schedule() {
    let model = tmp("cosine.dsl");
    let text_of = std::fs::read_to_string(common::root().join(MODEL)).expect("model");
    let text_of = text_of.replace(
        "steps     = 4",
        "steps     = 200\n  lr_schedule = cosine(warmup = 50, final = 0.1)",
    );
    std::fs::write(&model, text_of).expect("write");
    let (whole, state, resumed, metrics) = (
        tmp("cos-whole.st"),
        tmp("cos-state.st"),
        tmp("cos-resumed.st"),
        tmp("cos-long.jsonl"),
    );
    let train = |args: &[&str]| {
        let o = distc(&[&["train", s(&model), "-q"][..], args].concat());
        assert!(o.status.success(), "{}", text(&o));
    };
    train(&["--steps", "200", "--save", s(&whole)]);
    train(&["--steps", "100", "--checkpoint", s(&state)]);
    train(&[
        "--steps",
        "200",
        "--resume",
        s(&state),
        "--save",
        s(&resumed),
    ]);
    let (a, _) = checkpoint::load(&whole).expect("weights");
    let (b, _) = checkpoint::load(&resumed).expect("weights");
    assert_eq!(a, b, "the resumed run followed another schedule");
    // Beyond the plan's 200 steps: the final factor, 0.1 of adam's 0.01.
    train(&["--steps", "210", "--metrics", s(&metrics)]);
    let lrs: Vec<f64> = std::fs::read_to_string(&metrics)
        .expect("metrics")
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).expect("json")["lr"]
                .as_f64()
                .expect("lr")
        })
        .collect();
    assert_eq!(lrs.len(), 210);
    assert!(
        lrs[200..].iter().all(|&lr| (lr - 1e-3).abs() < 1e-12),
        "{:?}",
        &lrs[190..]
    );
    assert!(lrs[100] > 1e-3 + 1e-6, "{}", lrs[100]);
}

/// Issue 20: an Adam state resumed into a momentum-SGD model lost its state without a
/// word, and a state of another model was taken for this one where the shapes
/// matched; both are refused naming both sides. A data position past any stream
/// (`samples = 1e19`) hung resume in a linear fast-forward; it is refused at once, and
/// far positions are reached in O(1).
#[test]
fn a_state_of_another_optimizer_model_or_position_is_refused() {
    let state = tmp("adam.st");
    let o = distc(&[
        "train",
        MODEL,
        "--steps",
        "2",
        "-q",
        "--checkpoint",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let src = std::fs::read_to_string(common::root().join(MODEL)).expect("model");
    let momentum = tmp("momentum.dsl");
    std::fs::write(
        &momentum,
        src.replace("adam(lr = 0.01)", "sgd(lr = 0.01, momentum = 0.9)"),
    )
    .expect("write");
    refused(
        &[
            "train",
            s(&momentum),
            "-q",
            "--steps",
            "4",
            "--resume",
            s(&state),
        ],
        "this plan trains with momentum (state momentum)",
    );
    let renamed = tmp("renamed.dsl");
    std::fs::write(&renamed, src.replace("model sparse_adam", "model other")).expect("write");
    refused(
        &[
            "train",
            s(&renamed),
            "-q",
            "--steps",
            "4",
            "--resume",
            s(&state),
        ],
        "the training state is of model `sparse_adam`, this plan trains `other`",
    );
    // The index rewritten to a position of 1e19 samples (checksums are per tensor:
    // the index is metadata, so the file stays loadable).
    let (tensors, mut meta) = checkpoint::load(&state).expect("state");
    let key = checkpoint::INDEX_KEY.to_string();
    let mut index: serde_json::Value = serde_json::from_str(&meta[&key]).expect("index");
    index["samples"] = serde_json::json!(10_000_000_000_000_000_000u64);
    meta.insert(key, index.to_string());
    let far = tmp("far.st");
    let named: Vec<(String, &distc_runtime::Tensor)> =
        tensors.iter().map(|(k, v)| (k.clone(), v)).collect();
    checkpoint::save(&far, &named, meta).expect("save");
    let started = std::time::Instant::now();
    refused(
        &["train", MODEL, "-q", "--steps", "4", "--resume", s(&far)],
        "beyond any stream",
    );
    assert!(
        started.elapsed().as_secs() < 60,
        "resume took {:?}",
        started.elapsed()
    );
}

/// Issue 35, item 5: LARS keeps momentum-SGD's slot and LAMB Adam's, so a state of
/// one resumed into the other with exit 0; a state with one variable's slot removed
/// loaded, that slot restarting at 0; an index at step 2^64-1 wrapped. Each is refused.
#[test]
fn a_state_is_checked_for_its_optimizer_every_slot_and_its_step() {
    let src = std::fs::read_to_string(common::root().join(MODEL)).expect("model");
    let with = |name: &str, optimizer: &str| {
        let path = tmp(name);
        std::fs::write(&path, src.replace("adam(lr = 0.01)", optimizer)).expect("write");
        path
    };
    let state_of = |model: &PathBuf, name: &str| {
        let state = tmp(name);
        let o = distc(&[
            "train",
            s(model),
            "--steps",
            "2",
            "-q",
            "--checkpoint",
            s(&state),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        state
    };
    let momentum = with("momentum.dsl", "sgd(lr = 0.01, momentum = 0.9)");
    let lars = with("lars.dsl", "lars(lr = 0.01, momentum = 0.9)");
    let adam = with("adam.dsl", "adam(lr = 0.01)");
    let lamb = with("lamb.dsl", "lamb(lr = 0.01)");
    for (from, into, want) in [
        (
            &momentum,
            &lars,
            "saved by optimizer momentum (state momentum); this plan trains with lars",
        ),
        (
            &lars,
            &momentum,
            "saved by optimizer lars (state momentum); this plan trains with momentum",
        ),
        (
            &adam,
            &lamb,
            "saved by optimizer adam (state m, v); this plan trains with lamb",
        ),
    ] {
        let state = state_of(from, "kind.st");
        refused(
            &[
                "train",
                s(into),
                "-q",
                "--steps",
                "4",
                "--resume",
                s(&state),
            ],
            want,
        );
    }
    // The same optimizer resumes (the check refuses the kind, not the run).
    let state = state_of(&adam, "adam.st");
    let o = distc(&[
        "train",
        s(&adam),
        "-q",
        "--steps",
        "4",
        "--resume",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));

    // Rewritten files: one slot removed (the index lists what the file holds, so it
    // still loads), a slot of another shape, the step at 2^64-1.
    type Edit = fn(&mut checkpoint::TrainingState);
    let cases: [(&str, Edit, &str); 4] = [
        (
            "no-slot.st",
            |st| {
                st.optimizer.remove("w/m").expect("w/m");
            },
            "has `w` without its optimizer state `w/m`",
        ),
        (
            "reshaped.st",
            |st| {
                let b = st.optimizer["b/v"].clone();
                st.optimizer.insert("w/v".into(), b);
            },
            "`w/v` is f32[6], its variable `w` f32[32,6]",
        ),
        (
            "stray.st",
            |st| {
                let b = st.optimizer["b/v"].clone();
                st.optimizer.insert("gone/v".into(), b);
            },
            "optimizer state `gone/v` of no variable it holds",
        ),
        (
            "far-step.st",
            |st| st.index.step = u64::MAX,
            "beyond any run",
        ),
    ];
    for (name, edit, want) in cases {
        let mut st = checkpoint::load_state(&state).expect("state");
        edit(&mut st);
        let st = checkpoint::TrainingState::new(st.index.clone(), st.params, st.optimizer);
        let path = tmp(name);
        checkpoint::save_state(&path, &st).expect("save");
        refused(
            &[
                "train",
                s(&adam),
                "-q",
                "--steps",
                "4",
                "--resume",
                s(&path),
            ],
            want,
        );
    }
}

/// Issue 20: Ctrl-C ended a run at once, saying nothing. Now the run stops after its
/// step with status 130, keeps every metrics line, and says which training state is on
/// disk; that state loads and is of the step it names.
#[test]
fn ctrl_c_stops_after_the_step_and_says_what_is_on_disk() {
    let (state, metrics) = (tmp("sigint.st"), tmp("sigint.jsonl"));
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_distc"))
        .args(["train", MODEL, "--steps", "100000000", "-q"])
        .args(["--checkpoint", s(&state), "--checkpoint-every", "7"])
        .args(["--metrics", s(&metrics)])
        .current_dir(common::root())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !state.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let sent = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let o = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(130), "{err}");
    let step: usize = err
        .split("interrupted (Ctrl-C) after step ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in: {err}"));
    assert!(err.contains("no final checkpoint was written"), "{err}");
    let saved = checkpoint::load_state(&state).expect("the state loads");
    let at = saved.index.step as usize;
    // Workers run ahead of the metrics the coordinator has reported: the state may be
    // of a later step than the last line, and the message reads it back.
    assert!(
        at.is_multiple_of(7) && at > 0,
        "state of step {at}, stopped at {step}"
    );
    assert!(err.contains(&format!("of step {at}")), "{err}");
    if at > step {
        assert!(
            err.contains(&format!("the metrics end at step {step}")),
            "{err}"
        );
    }
    let lines = std::fs::read_to_string(&metrics)
        .expect("metrics")
        .lines()
        .count();
    assert_eq!(lines, step, "metrics lines lost");
}

/// `--elastic` (issue 40, item 1): a worker lost at step K (`--fail-worker W:K`)
/// costs the run one replica, not the job. The run goes on from the state of step K-1
/// the survivors kept in memory (reading no file), with the plan compiled for the
/// workers left, and ends with the weights of a run that trained K-1 steps with N
/// workers, wrote its state, and was resumed from it with one replica fewer: bit for
/// bit. Under all-reduce, parameter servers (kept) and a model axis (a replica of T
/// workers lost). Under ZeRO 3 the lost worker's chunks are nowhere else: the run goes
/// back to the last sharded state written (step 2), the survivors' pieces from their
/// memory and the lost worker's one shard from disk; with none written yet (ZeRO 1, a
/// state every 10 steps), back to the start.
#[test]
fn an_elastic_run_loses_a_worker_and_trains_what_a_resumed_smaller_run_trains() {
    let dense = "examples/dense_mlp.dsl";
    let (shards, unwritten) = (tmp("zero3-shards"), tmp("zero1-shards"));
    // label, model, layout, the layout left, the failure, the step resumed from, the
    // shards read, the elastic run's own flags
    for (label, model, layout, after, fail, from, read, own) in [
        (
            "allreduce",
            dense,
            &["--strategy", "allreduce", "--workers", "3"][..],
            "2",
            "1:4",
            3,
            0,
            &[][..],
        ),
        (
            "zero3",
            dense,
            &["--strategy", "allreduce", "--zero", "3", "--workers", "3"][..],
            "2",
            "2:4",
            2,
            1,
            &[
                "--checkpoint",
                s(&shards),
                "--sharded",
                "--checkpoint-every",
                "2",
            ][..],
        ),
        (
            "hybrid",
            MODEL,
            &["--strategy", "hybrid", "--servers", "1", "--workers", "3"][..],
            "2",
            "0:3",
            2,
            0,
            &[][..],
        ),
        (
            "mesh",
            dense,
            &["--mesh", "data=2,model=2"][..],
            "data=1,model=2",
            "3:3",
            2,
            0,
            &[][..],
        ),
        // Stages two model ranks wide: worker 5 (stage 0 of replica 1, model rank 1)
        // costs its replica's four workers.
        (
            "pipe-mesh",
            dense,
            &["--mesh", "data=2,model=2,pipe=2", "--micro-batches", "2"][..],
            "data=1,model=2,pipe=2",
            "5:4",
            3,
            0,
            &[][..],
        ),
        // No sharded state written yet: back to the start.
        (
            "zero1-start",
            dense,
            &["--strategy", "allreduce", "--zero", "1", "--workers", "3"][..],
            "2",
            "1:3",
            0,
            0,
            &[
                "--checkpoint",
                s(&unwritten),
                "--sharded",
                "--checkpoint-every",
                "10",
            ][..],
        ),
    ] {
        let steps = "5";
        let k: usize = fail
            .split(':')
            .nth(1)
            .and_then(|k| k.parse().ok())
            .expect("W:K");
        let (elastic, metrics) = (
            tmp(&format!("{label}-elastic.st")),
            tmp(&format!("{label}-m.jsonl")),
        );
        let run = |extra: &[&str]| {
            let mut args = vec!["train", model, "--batch", "16", "-q"];
            args.extend_from_slice(extra);
            let o = distc(&args);
            assert!(o.status.success(), "{label} {extra:?}: {}", text(&o));
        };
        let mut args = layout.to_vec();
        args.extend_from_slice(&[
            "--steps",
            steps,
            "--elastic",
            "--fail-worker",
            fail,
            "--save",
            s(&elastic),
            "--metrics",
            s(&metrics),
        ]);
        args.extend_from_slice(own);
        run(&args);
        // The reference: the steps resumed from with N workers, resumed with the
        // layout left.
        let (state, resumed) = (
            tmp(&format!("{label}-state.st")),
            tmp(&format!("{label}-resumed.st")),
        );
        let before = from.to_string();
        if from > 0 {
            let mut args = layout.to_vec();
            args.extend_from_slice(&["--steps", &before, "--checkpoint", s(&state)]);
            run(&args);
        }
        let smaller: Vec<&str> = layout
            .iter()
            .map(|a| match *a == "3" || a.starts_with("data=") {
                true => after,
                false => a,
            })
            .collect();
        let mut args = smaller.clone();
        args.extend_from_slice(&["--steps", steps, "--save", s(&resumed)]);
        if from > 0 {
            args.extend_from_slice(&["--resume", s(&state)]);
        }
        run(&args);
        assert_eq!(
            common::max_difference(&elastic, &resumed),
            0.0,
            "{label}: the elastic run's weights are not the resumed run's"
        );
        // Every step has its line; the one after the loss says what happened.
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
            .expect("metrics")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        let steps: Vec<u64> = lines.iter().filter_map(|l| l["step"].as_u64()).collect();
        let expected: Vec<u64> = (1..k as u64).chain(from + 1..=5).collect();
        assert_eq!(steps, expected, "{label}");
        let restarts: Vec<&serde_json::Value> =
            lines.iter().filter(|l| !l["restart"].is_null()).collect();
        assert_eq!(restarts.len(), 1, "{label}: {lines:?}");
        let r = &restarts[0]["restart"];
        assert_eq!(restarts[0]["step"].as_u64(), Some(from + 1), "{label}");
        assert_eq!(r["lost_at_step"].as_u64(), Some(k as u64), "{label}");
        assert_eq!(r["resumed_from_step"].as_u64(), Some(from), "{label}");
        assert_eq!(r["shards_read"].as_u64(), Some(read), "{label}: {r}");
        let workers = |l: &str| {
            l.split(',')
                .map(|p| {
                    p.rsplit('=')
                        .next()
                        .and_then(|n| n.parse::<u64>().ok())
                        .unwrap_or(1)
                })
                .product::<u64>()
        };
        let (n, m) = match layout[1].starts_with("data=") {
            true => (workers(layout[1]), workers(after)),
            false => (3, 2),
        };
        assert_eq!(r["workers_before"].as_u64(), Some(n), "{label}");
        assert_eq!(r["workers_after"].as_u64(), Some(m), "{label}");
        let worker = fail.split(':').next().expect("W");
        let cause = r["cause"].as_str().unwrap_or("");
        assert!(
            cause.contains(&format!("worker {worker}")) || label.contains("mesh"),
            "{label}: {cause}"
        );
        assert!(
            r["recovery_sec"].as_f64().is_some_and(|s| s >= 0.0),
            "{label}: {r}"
        );
        println!("{label}: recovery {} s", r["recovery_sec"]);
    }
}

#[test]
fn a_lost_worker_without_elastic_stops_the_run_and_elastic_refuses_what_it_cannot_do() {
    // Two workers, worker 1 lost at step 2 of 3, with the flags `extra`.
    let lose_one = |extra: &[&str]| {
        let mut args = vec![
            "train",
            MODEL,
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--steps",
            "3",
            "--fail-worker",
            "1:2",
        ];
        args.extend_from_slice(extra);
        distc(&args)
    };
    // Without --elastic the loss stops the run, naming the worker and the step.
    let o = lose_one(&["-q"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("worker 1: lost at step 2"), "{t}");
    // With --elastic the summary names the workers the run ended on.
    let o = lose_one(&["--elastic"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("2 steps on 1 worker (--elastic: 1 restart) from step 1"),
        "{t}"
    );
    // Fewer workers than --min-workers: stops with the loss and says why.
    let o = lose_one(&["-q", "--elastic", "--min-workers", "2"]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("lost at step 2") && t.contains("--min-workers 2"),
        "{t}"
    );
    refused(
        &["train", MODEL, "--steps", "2", "--elastic"],
        "one replica",
    );
    // ZeRO's chunks of a lost worker are on no other worker: only on disk.
    refused(
        &[
            "train",
            MODEL,
            "--strategy",
            "allreduce",
            "--zero",
            "1",
            "--workers",
            "2",
            "--elastic",
        ],
        "--checkpoint DIR --sharded",
    );
    refused(
        &[
            "train",
            MODEL,
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--elastic",
            "--transport",
            "mpi",
        ],
        "distc launch",
    );
    refused(
        &[
            "train",
            MODEL,
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--fail-worker",
            "2:1",
        ],
        "workers 0 to 1",
    );
    // Issue 60, item 9: a rehearsal after the last step, and a floor above the workers
    // the run starts with, used to be accepted and do nothing.
    refused(
        &[
            "train",
            MODEL,
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--steps",
            "3",
            "--fail-worker",
            "1:4",
        ],
        "--fail-worker 1:4: the run ends at step 3",
    );
    let o = lose_one(&["-q", "--elastic", "--min-workers", "3"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("--min-workers 3: the plan has 2 workers"),
        "{}",
        text(&o)
    );
}

/// Issue 40, item 2: with `--sharded` every worker writes its own shard (nothing is
/// gathered), and the state put together from the shards is the one-file state of the
/// same run, bit for bit; it resumes under another layout as the file does. A state
/// with a shard missing is refused, naming the shard.
#[test]
fn a_sharded_state_is_the_whole_state_and_resumes_into_another_layout() {
    // Adam: slots split as their variables are.
    let dense = "tests/models/adam_mlp.dsl";
    let tied = common::tied_model(&tmp("tied.dsl"), "adam(lr = 0.01)");
    // A shard a worker; with stages, a shard a worker of replica 0.
    for (label, model, layout, shards) in [
        (
            "mesh-zero3",
            dense,
            &["--mesh", "data=2,model=2", "--zero", "3"][..],
            4,
        ),
        (
            "hybrid",
            MODEL,
            &["--strategy", "hybrid", "--servers", "1", "--workers", "2"][..],
            2,
        ),
        (
            "pipe-mesh",
            dense,
            &["--mesh", "data=2,model=2,pipe=2", "--micro-batches", "2"][..],
            4,
        ),
        // The tied variable `e` is held by the first and the last stage.
        (
            "pipe-tied",
            s(&tied),
            &["--pipeline", "3", "--micro-batches", "2"][..],
            3,
        ),
    ] {
        let (whole, dir) = (tmp(&format!("{label}.st")), tmp(&format!("{label}-shards")));
        for (out, sharded) in [(&whole, false), (&dir, true)] {
            let mut args = vec![
                "train",
                model,
                "--steps",
                "4",
                "-q",
                "--checkpoint-every",
                "3",
            ];
            args.extend(layout);
            args.extend(["--checkpoint", s(out)]);
            if sharded {
                args.push("--sharded");
            }
            let o = distc(&args);
            assert!(o.status.success(), "{label}: {}", text(&o));
        }
        // The state of step 3 was committed, then step 4's replaced it.
        let latest = std::fs::read_to_string(dir.join("latest")).expect("latest");
        assert_eq!(latest.trim(), "step-000000004", "{label}");
        let folders: Vec<String> = std::fs::read_dir(&dir)
            .expect("the folder")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        assert_eq!(folders, ["step-000000004"], "{label}");
        let step = dir.join("step-000000004");
        assert!(!step.join(format!("rank-{shards}.safetensors")).exists());
        let shard_bytes: Vec<u64> = (0..shards)
            .map(|r| {
                std::fs::metadata(step.join(format!("rank-{r}.safetensors")))
                    .expect("a shard a worker")
                    .len()
            })
            .collect();
        let a = checkpoint::load_state(&whole).expect("the whole state");
        let b = checkpoint::load_state(&dir).expect("the sharded state");
        assert_eq!(a.index.step, 4);
        assert_eq!(a.index, b.index, "{label}");
        assert_eq!(a.params, b.params, "{label}");
        assert_eq!(a.optimizer, b.optimizer, "{label}");
        // ZeRO's four workers each hold about a quarter, two stages of two model ranks
        // less than half each: no worker wrote the whole model.
        let parts = match label {
            "mesh-zero3" => 3,
            "pipe-mesh" => 2,
            _ => 0,
        };
        if parts > 0 {
            let file = std::fs::metadata(&whole).expect("the file").len();
            let most = *shard_bytes.iter().max().expect("shards");
            assert!(
                most * parts < file,
                "{label}: shards {shard_bytes:?}, whole {file}"
            );
        }
        // Resumed under another layout, the sharded state trains what the file trains.
        let mut ends = Vec::new();
        for from in [&whole, &dir] {
            let end = tmp(&format!("{label}-end-{}.st", ends.len()));
            let o = distc(&[
                "train",
                model,
                "--steps",
                "6",
                "-q",
                "--strategy",
                "allreduce",
                "--workers",
                "2",
                "--resume",
                s(from),
                "--save",
                s(&end),
            ]);
            assert!(o.status.success(), "{label}: {}", text(&o));
            ends.push(end);
        }
        assert_eq!(common::max_difference(&ends[0], &ends[1]), 0.0, "{label}");
    }
    // A shard missing: the state is refused, naming it.
    let dir = tmp("mesh-zero3-shards");
    std::fs::remove_file(dir.join("step-000000004/rank-2.safetensors")).expect("removed");
    refused(
        &["train", dense, "-q", "--steps", "6", "--resume", s(&dir)],
        "rank-2.safetensors",
    );
}

/// Issue 60, item 6: a sharded state took a shard of another run of the same model (at
/// the same step, on the same mesh) and a manifest edited to other sample counts, and
/// resumed from them. Each shard now names its run, as the manifest does, and the
/// manifest carries its own digest. Workers and a pipeline's stages write them alike.
#[test]
fn a_sharded_state_refuses_another_runs_shard_and_an_edited_manifest() {
    let dense = "tests/models/adam_mlp.dsl";
    for (label, layout) in [
        (
            "workers",
            &["--strategy", "allreduce", "--workers", "2"][..],
        ),
        ("stages", &["--pipeline", "2", "--micro-batches", "2"][..]),
    ] {
        let (a, b) = (
            tmp(&format!("{label}-run-a")),
            tmp(&format!("{label}-run-b")),
        );
        // Run b starts where run a ended: both write a state of step 2, of one model
        // on one mesh, holding other values.
        let weights = tmp(&format!("{label}-a.st"));
        let runs: [(&PathBuf, &[&str]); 2] = [
            (&a, &["--save", s(&weights)]),
            (&b, &["--init", s(&weights)]),
        ];
        for (dir, own) in runs {
            let _ = std::fs::remove_dir_all(dir);
            let mut args = vec!["train", dense, "--steps", "2", "-q"];
            args.extend_from_slice(layout);
            args.extend_from_slice(own);
            args.extend_from_slice(&["--checkpoint", s(dir), "--sharded"]);
            let o = distc(&args);
            assert!(o.status.success(), "{label}: {}", text(&o));
        }
        let resume = |dir: &PathBuf| {
            let mut args = vec!["train", dense, "--steps", "3", "-q", "--resume", s(dir)];
            args.extend_from_slice(layout);
            distc(&args)
        };
        let o = resume(&a);
        assert!(o.status.success(), "{label}: {}", text(&o));
        let step = |dir: &PathBuf| dir.join("step-000000002");
        let shard = "rank-1.safetensors";
        std::fs::copy(step(&b).join(shard), step(&a).join(shard)).expect("copies");
        let o = resume(&a);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{label}: {t}");
        assert!(
            t.contains(shard) && t.contains("is a shard of another run"),
            "{label}: {t}"
        );
        let manifest = step(&b).join("manifest.json");
        let text_of = std::fs::read_to_string(&manifest).expect("manifest");
        let samples = serde_json::from_str::<serde_json::Value>(&text_of).expect("json")["index"]
            ["samples"]
            .as_u64()
            .expect("samples");
        let edited = text_of.replacen(
            &format!("\"samples\": {samples}"),
            &format!("\"samples\": {}", samples + 1),
            1,
        );
        assert_ne!(edited, text_of, "{label}: the edit took");
        std::fs::write(&manifest, edited).expect("edits");
        let o = resume(&b);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{label}: {t}");
        assert!(
            t.contains("manifest.json") && t.contains("the manifest was edited or is damaged"),
            "{label}: {t}"
        );
    }
}

/// Issue 60, item 11 (found by the `sharded_states` fuzz target): a manifest whose
/// numbers multiply past 64 bits (the mesh's cells, a ZeRO chunk's shape), rewritten
/// with its digest as distc writes it, panicked on the overflow (exit 101). Each is
/// now a refusal naming the manifest.
#[test]
fn a_resealed_manifest_whose_sizes_overflow_is_refused_not_a_panic() {
    use distc_runtime::core::shards::{step_dir, Gather, Manifest};
    let dense = "tests/models/adam_mlp.dsl";
    let dir = tmp("overflow-shards");
    let _ = std::fs::remove_dir_all(&dir);
    let layout = ["--mesh", "data=2,model=2", "--zero", "3"];
    let mut args = vec!["train", dense, "--steps", "2", "-q"];
    args.extend(layout);
    args.extend(["--checkpoint", s(&dir), "--sharded"]);
    let o = distc(&args);
    assert!(o.status.success(), "{}", text(&o));
    let path = step_dir(&dir, 2).join("manifest.json");
    let written = std::fs::read_to_string(&path).expect("the manifest");
    type Edit = fn(&mut Manifest) -> bool;
    let edits: [(&str, Edit); 2] = [
        ("the mesh's cells", |m| {
            m.data = usize::MAX;
            true
        }),
        ("a chunk's shape", |m| {
            let chunks = m.tensors.values_mut().flat_map(|t| t.gathers.iter_mut());
            for g in chunks {
                if let Gather::Chunks { shape, .. } = g {
                    *shape = vec![usize::MAX, 3];
                    return true;
                }
            }
            false
        }),
    ];
    for (what, edit) in edits {
        let mut m: Manifest = serde_json::from_str(&written).expect("reads");
        assert!(edit(&mut m), "{what}: no tensor to edit");
        m.digest = None;
        m.write(&dir).expect("rewritten with its digest");
        let mut args = vec!["train", dense, "--steps", "3", "-q", "--resume", s(&dir)];
        args.extend(layout);
        let o = distc(&args);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{what}: {t}");
        assert!(!t.contains("panicked"), "{what}: {t}");
    }
}

/// Issue 60, item 11 (found by the `sharded_states` fuzz target): a manifest with its
/// digest taken out (or its digest and its run's name) skipped the digest check as a
/// state of distc before issue 60 does, so an edit behind it resumed. And a step count
/// of another shape than one number resumed with no count on the CPU (Adam's bias
/// correction started again). Each is now refused, naming what.
#[test]
fn a_manifest_stripped_of_its_digest_and_a_malformed_step_count_are_refused() {
    use distc_runtime::core::shards::step_dir;
    let dense = "tests/models/adam_mlp.dsl";
    let layout = ["--strategy", "allreduce", "--workers", "2"];
    let train = |extra: &[&str]| {
        let mut args = vec!["train", dense, "-q"];
        args.extend(layout);
        args.extend(extra);
        distc(&args)
    };
    let dir = tmp("stripped-shards");
    let _ = std::fs::remove_dir_all(&dir);
    let o = train(&["--steps", "2", "--checkpoint", s(&dir), "--sharded"]);
    assert!(o.status.success(), "{}", text(&o));
    let path = step_dir(&dir, 2).join("manifest.json");
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("manifest")).expect("json");
    for (stripped, says) in [
        (&["digest"][..], "names its run and carries no digest"),
        (&["digest", "run"][..], "the state's manifest names none"),
    ] {
        let mut m = written.clone();
        for key in stripped {
            m.as_object_mut().expect("an object").remove(*key);
        }
        m["index"]["samples"] = serde_json::json!(7);
        std::fs::write(&path, m.to_string()).expect("edits");
        let o = train(&["--steps", "3", "--resume", s(&dir)]);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{stripped:?}: {t}");
        assert!(t.contains(says), "{stripped:?}: {t}");
    }
    // A whole state whose step count is two numbers, or one number of shape [1].
    let file = tmp("step-count.st");
    let o = train(&["--steps", "2", "--checkpoint", s(&file)]);
    assert!(o.status.success(), "{}", text(&o));
    let state = checkpoint::load_state(&file).expect("the state");
    for shape in [vec![2], vec![1]] {
        let mut edited = checkpoint::TrainingState {
            index: state.index.clone(),
            params: state.params.clone(),
            optimizer: state.optimizer.clone(),
        };
        let n: usize = shape.iter().product();
        let ty = distc_ir::TensorType::new(distc_ir::DType::F64, shape.clone());
        edited
            .optimizer
            .insert("optimizer/step".into(), distc_runtime::Tensor::zeros(&ty));
        let bad = tmp(&format!("step-count-{n}.st"));
        checkpoint::save_state(&bad, &edited).expect("written");
        let o = train(&["--steps", "3", "--resume", s(&bad)]);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{shape:?}: {t}");
        assert!(t.contains("not one step count"), "{shape:?}: {t}");
    }
}

/// Issue 59: workers and stages clear a sharded folder by one rule. Before a run
/// starts, worker 0 removes what an earlier run left in the folders of the steps this
/// run writes, and no others: a later state of another run stays (stages used to
/// remove every folder from their first step on).
#[test]
fn a_sharded_run_clears_the_steps_it_writes_and_keeps_another_runs_later_state() {
    let dense = "tests/models/adam_mlp.dsl";
    for (label, layout) in [
        (
            "workers",
            &["--strategy", "allreduce", "--workers", "2"][..],
        ),
        ("stages", &["--pipeline", "2", "--micro-batches", "2"][..]),
    ] {
        let dir = tmp(&format!("{label}-cleared"));
        let _ = std::fs::remove_dir_all(&dir);
        let run = |steps: &str| {
            let mut args = vec!["train", dense, "--steps", steps, "-q"];
            args.extend_from_slice(layout);
            args.extend_from_slice(&["--checkpoint", s(&dir), "--sharded"]);
            args.extend_from_slice(&["--checkpoint-every", "2"]);
            distc(&args)
        };
        let o = run("4");
        assert!(o.status.success(), "{label}: {}", text(&o));
        let step = |k: u32| dir.join(format!("step-{k:09}"));
        assert!(
            step(4).join("manifest.json").exists(),
            "{label}: step 4 written"
        );
        // What an earlier run left half written in a folder this run writes.
        std::fs::create_dir_all(step(2)).expect("a folder");
        let stale = step(2).join("rank-9.safetensors");
        std::fs::write(&stale, b"half a shard").expect("a stale shard");
        let o = run("2");
        assert!(o.status.success(), "{label}: {}", text(&o));
        assert!(
            !stale.exists(),
            "{label}: the stale shard of step 2 was removed"
        );
        assert!(
            step(2).join("manifest.json").exists(),
            "{label}: step 2 written"
        );
        assert!(
            step(4).join("manifest.json").exists(),
            "{label}: the other run's state of step 4 stays"
        );
    }
}
