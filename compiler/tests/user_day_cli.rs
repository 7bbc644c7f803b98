//! A user's day (issue 66): log lines off a terminal, tokens/s for language models,
//! sizes with units, the device in the summary, and `eval -q`.

use std::path::{Path, PathBuf};

mod common;

use common::{distc, metrics_lines, s, text};

/// A classifier on synthetic data: no files, one label a sample.
fn classifier(dir: &Path) -> PathBuf {
    let m = dir.join("mlp.dsl");
    std::fs::write(
        &m,
        "model mlp {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
         param w: f32[8, 3] = glorot\n  \
         minimize softmax_cross_entropy(x @ w, label)\n}\n\
         train {\n  data = gaussian_classes(features = 8, classes = 3)\n  batch = 4\n  \
         optimizer = sgd(lr = 0.1)\n  steps = 25\n  seed = 1\n}\n",
    )
    .expect("model");
    m
}

/// A next-token model of windows of 4 tokens, over a token file it writes.
fn token_model(dir: &Path) -> PathBuf {
    std::fs::write(dir.join("train.bin"), common::token_bytes(4000)).expect("tokens");
    let m = dir.join("lm.dsl");
    std::fs::write(
        &m,
        "model lm {\n  input tokens: i32[B, 4]\n  input targets: i32[B, 4]\n  \
         param emb: f32[50, 8] = uniform(-0.05, 0.05)\n  param w: f32[8, 50] = glorot\n  \
         x = reshape(embedding(emb, tokens), [-1, 8])\n  \
         minimize softmax_cross_entropy(x @ w, reshape(targets, [-1]))\n}\n\
         train {\n  data = tokens(path = \"train.bin\", dtype = \"u16\", context = 4)\n  \
         batch = 8\n  optimizer = sgd(lr = 0.1)\n  steps = 3\n  seed = 1\n}\n",
    )
    .expect("model");
    m
}

fn log_steps(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_string())
        .collect()
}

/// Item 1: off a terminal (the test's pipes, as under `nohup` or `sbatch`), a run logs
/// a line every 10 steps and at the last, on standard error, with what torchtitan's
/// logger gives; `--log-every` sets the interval, 0 and `-q` silence it.
#[test]
fn a_run_off_a_terminal_logs_a_line_every_n_steps() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = classifier(dir.path());
    let o = distc(&["train", s(&m), "--no-eval"]);
    assert!(o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(log_steps(&err), ["10/25", "20/25", "25/25"], "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("step 10/25"))
        .expect("step 10");
    for part in [
        "loss ",
        "lr 1.000e-1",
        "samples/s",
        "memory ",
        "MiB",
        "elapsed ",
        "ETA ",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }
    // The last line has no ETA: nothing is left.
    let last = err
        .lines()
        .find(|l| l.starts_with("step 25/25"))
        .expect("last");
    assert!(!last.contains("ETA"), "{last}");
    // The summary stays on standard output, alone.
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains("step 10/25"), "{out}");

    let o = distc(&["train", s(&m), "--no-eval", "--log-every", "12"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(log_steps(&err), ["12/25", "24/25", "25/25"], "{err}");
    for quiet in [
        &["--log-every", "0"][..],
        &["-q"],
        &["-q", "--log-every", "5"],
    ] {
        let mut args = vec!["train", s(&m), "--no-eval"];
        args.extend(quiet);
        let o = distc(&args);
        assert!(o.status.success(), "{}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(log_steps(&err).is_empty(), "{quiet:?}: {err}");
    }
    // A resumed run counts its ETA from its own first step, and logs its own steps.
    let state = dir.path().join("c.st");
    let o = distc(&[
        "train",
        s(&m),
        "--no-eval",
        "-q",
        "--steps",
        "12",
        "--checkpoint",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&[
        "train",
        s(&m),
        "--no-eval",
        "--resume",
        s(&state),
        "--log-every",
        "5",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(log_steps(&err), ["15/25", "20/25", "25/25"], "{err}");
}

/// Item 4: a language model's summary, metrics and log lines give tokens/s (and say
/// so); a classifier's stay in samples/s.
#[test]
fn a_language_model_reports_tokens_per_second() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = token_model(dir.path());
    let metrics = dir.path().join("m.jsonl");
    let o = distc(&[
        "train",
        s(&m),
        "--data",
        s(dir.path()),
        "--no-eval",
        "--log-every",
        "1",
        "--metrics",
        s(&metrics),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("tokens/s (") && out.contains("samples/s of 4 tokens)"),
        "{out}"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.lines()
            .filter(|l| l.starts_with("step "))
            .all(|l| l.contains("tokens/s")),
        "{err}"
    );
    for line in metrics_lines(&metrics) {
        let samples = line["samples_per_sec"].as_f64().expect("samples/s");
        let tokens = line["tokens_per_sec"].as_f64().expect("tokens/s");
        assert!((tokens - 4.0 * samples).abs() <= 1e-9 * tokens, "{line}");
    }
    let m = classifier(dir.path());
    let metrics = dir.path().join("c.jsonl");
    let o = distc(&["train", s(&m), "--no-eval", "--metrics", s(&metrics)]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("samples/s") && !out.contains("tokens/s"),
        "{out}"
    );
    assert!(metrics_lines(&metrics)
        .iter()
        .all(|l| l.get("tokens_per_sec").is_none()));
}

/// Items 5 and 6: sizes take units; the summary names the device; `eval -q` prints
/// nothing but still writes its metrics.
#[test]
fn sizes_take_units_the_summary_names_the_device_and_eval_is_quiet() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = classifier(dir.path());
    let plan = dir.path().join("p.json");
    let o = distc(&[
        "compile",
        s(&m),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--bucket-mb",
        "512KiB",
        "--remat",
        "1GiB",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&["compile", s(&m), "--bucket-mb", "lots", "-o", s(&plan)]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("`lots` is not a size"), "{}", text(&o));

    let weights = dir.path().join("w.st");
    let o = distc(&["train", s(&m), "--no-eval", "--save", s(&weights)]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(") on CPU (") && out.contains(" threads): 25 steps"),
        "{out}"
    );
    let metrics = dir.path().join("e.jsonl");
    let o = distc(&[
        "eval",
        s(&m),
        "--init",
        s(&weights),
        "-q",
        "--metrics",
        s(&metrics),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(o.stdout.is_empty() && o.stderr.is_empty(), "{}", text(&o));
    assert_eq!(metrics_lines(&metrics).len(), 1);
}

/// Item 7: a vocabulary or a class count too small for the data names the variable,
/// not an IR node; the layout search says each kind of refusal once.
#[test]
fn diagnostics_name_the_users_variables_and_refusals_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("narrow.dsl");
    let model = |rows: usize, classes: usize| {
        format!(
            "model sp {{\n  input ids: i32[B, 4]\n  input label: i32[B]\n  \
             param emb: f32[{rows}, 8] = uniform(-0.05, 0.05)\n  \
             param w: f32[32, 10] = glorot\n  param b: f32[10] = zeros\n  \
             x = reshape(embedding(emb, ids), [B, 32])\n  \
             minimize softmax_cross_entropy(x @ w + b, label)\n}}\n\
             train {{\n  data = zipf_tokens(vocab = 1000, context = 4, classes = {classes}, \
             s = 1.1)\n  batch = 8\n  optimizer = sgd(lr = 0.1)\n  steps = 1\n  seed = 1\n}}\n"
        )
    };
    std::fs::write(&m, model(500, 10)).expect("model");
    let o = distc(&["train", s(&m), "--no-eval"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("`ids` values up to 999, but the lookup table `emb` has 500 rows"),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains('%'), "{}", text(&o));
    std::fs::write(&m, model(1000, 20)).expect("model");
    let o = distc(&[
        "train",
        s(&m),
        "--no-eval",
        "--strategy",
        "hybrid",
        "--workers",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("the logits have 10 classes (the last dimension of `w`)"),
        "{}",
        text(&o)
    );

    let deep = dir.path().join("deep.dsl");
    std::fs::write(
        &deep,
        "model deep {\n  input x: f32[B, 16]\n  input label: i32[B]\n  \
         param w1: f32[16, 32] = glorot\n  param w2: f32[32, 32] = glorot\n  \
         param w3: f32[32, 3] = glorot\n  \
         minimize softmax_cross_entropy(relu(relu(x @ w1) @ w2) @ w3, label)\n}\n\
         train {\n  data = gaussian_classes(features = 16, classes = 3)\n  batch = 16\n  \
         optimizer = adam(lr = 0.01)\n  steps = 3\n  seed = 1\n}\n",
    )
    .expect("model");
    let plan = dir.path().join("p.json");
    let o = distc(&[
        "compile",
        s(&deep),
        "--strategy",
        "auto",
        "--workers",
        "4",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let said = text(&o);
    let reasons: Vec<&str> = said
        .lines()
        .filter(|l| l.trim_start().starts_with("rejected "))
        .filter_map(|l| l.split_once("): ").map(|(_, r)| r))
        .collect();
    assert!(!reasons.is_empty(), "{}", text(&o));
    let mut distinct = reasons.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), reasons.len(), "{}", text(&o));
    // ZeRO 1 and ZeRO 3 refused with pipelines are one kind: one line, its numbers merged.
    let zero: Vec<&str> = reasons
        .iter()
        .copied()
        .filter(|r| r.contains("with --pipeline is not supported"))
        .collect();
    assert_eq!(zero.len(), 1, "{}", text(&o));
    assert!(
        zero[0].starts_with("--zero 1|3 with --pipeline"),
        "{}",
        text(&o)
    );
}

/// Item 2: `--set KEY=VALUE` overrides a train block setting or an argument of one, in
/// every compiling command; the plan records it and `explain` shows it; a key that is
/// not a setting is refused naming the settings; `--steps` with a schedule says what it
/// does to the schedule.
#[test]
fn settings_are_overridden_from_the_command_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = classifier(dir.path());
    let metrics = dir.path().join("m.jsonl");
    let o = distc(&[
        "train",
        s(&m),
        "--no-eval",
        "--set",
        "steps=5",
        "--set",
        "optimizer.lr=0.5",
        "--set",
        "lr_schedule=cosine(warmup = 2)",
        "--metrics",
        s(&metrics),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines = metrics_lines(&metrics);
    assert_eq!(lines.len(), 5);
    // Warm-up over 2 updates of the overridden rate: 0.25, then 0.5.
    assert_eq!(lines[0]["lr"].as_f64(), Some(0.25));
    assert_eq!(lines[1]["lr"].as_f64(), Some(0.5));

    let plan = dir.path().join("p.json");
    let o = distc(&[
        "compile",
        s(&m),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--set",
        "seed=7",
        "--set",
        "data.classes=3",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    assert_eq!(
        json["overrides"],
        serde_json::json!(["seed=7", "data.classes=3"])
    );
    let o = distc(&["explain", s(&plan)]);
    assert!(
        text(&o).contains("train block overridden: --set seed=7 --set data.classes=3")
            && text(&o).contains("seed 7"),
        "{}",
        text(&o)
    );
    // Both sides of a verify train the overridden block.
    let o = distc(&[
        "verify",
        s(&m),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--set",
        "batch=3",
    ]);
    assert!(
        o.status.success() && text(&o).contains("vs one device with batch 6"),
        "{}",
        text(&o)
    );

    let o = distc(&["train", s(&m), "--set", "optimiser.lr=1"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("`optimiser` is not a setting of the train block")
            && t.contains("did you mean `optimizer`")
            && t.contains("the settings are: data, batch, optimizer, steps"),
        "{t}"
    );
    // A value out of range is located in the block, as the file's own would be.
    let o = distc(&["train", s(&m), "--set", "optimizer.lr=-1"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("optimizer = sgd(lr = -1)"),
        "{}",
        text(&o)
    );

    let o = distc(&[
        "train",
        s(&m),
        "--no-eval",
        "--steps",
        "3",
        "--set",
        "lr_schedule=cosine(warmup = 2)",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(
            "note: --steps 3: the learning-rate schedule keeps the train block's 25 steps"
        ),
        "{}",
        text(&o)
    );
}

/// Item 3: `--tensorboard DIR` writes one event file whose first event names the
/// format and whose every later event holds the step's metrics line as scalars
/// (TensorBoard's own reader checks the same in CI: bench/pytorch/tensorboard_read.py).
#[test]
fn tensorboard_event_files_hold_every_metrics_number() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = classifier(dir.path());
    let (metrics, logs) = (dir.path().join("m.jsonl"), dir.path().join("tb"));
    let o = distc(&[
        "train",
        s(&m),
        "--no-eval",
        "-q",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "4",
        "--metrics",
        s(&metrics),
        "--tensorboard",
        s(&logs),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let files: Vec<PathBuf> = std::fs::read_dir(&logs)
        .expect("the folder")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().and_then(|n| n.to_str()).expect("name");
    assert!(
        name.starts_with("events.out.tfevents.") && name.ends_with(".distc"),
        "{name}"
    );
    let events = distc::tensorboard::read_events(&std::fs::read(&files[0]).expect("reads"))
        .expect("decodes");
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    let lines = metrics_lines(&metrics);
    assert_eq!(events.len(), 1 + lines.len());
    for (e, line) in events[1..].iter().zip(&lines) {
        assert_eq!(e.step, line["step"].as_i64().expect("step"));
        let values = &e.summary.as_ref().expect("scalars").value;
        let get = |tag: &str| {
            values
                .iter()
                .find(|v| v.tag == tag)
                .and_then(|v| v.simple_value)
                .unwrap_or_else(|| panic!("no {tag}"))
        };
        assert_eq!(get("loss"), line["loss"].as_f64().expect("loss") as f32);
        assert_eq!(get("lr"), line["lr"].as_f64().expect("lr") as f32);
        let sent = line["bytes_sent_per_worker"][1].as_f64().expect("worker 1");
        assert_eq!(get("bytes_sent_per_worker/1"), sent as f32);
        assert_eq!(
            get("memory/params"),
            line["memory"]["params"].as_f64().expect("params") as f32
        );
    }
    // A folder that cannot be made is named.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").expect("file");
    let o = distc(&["train", s(&m), "-q", "--tensorboard", s(&file.join("tb"))]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("a-file/tb"), "{}", text(&o));
}
