//! Data a user brings, from the command line (issue 36, item 1): Penn Treebank as a
//! token file made by scripts/ptb-tokens.py trains examples/ptb_tokens.dsl and reads
//! the built-in `ptb()` stream; a safetensors and a CSV dataset train, and verify
//! against one device under 3 workers; a malformed file stops the run before step 1,
//! named.

use distc_ir::{DType, TensorType};
use distc_runtime::run::data::DataSource;
use distc_runtime::DataSpec;
use std::collections::HashMap;
use std::path::Path;

mod common;

use common::{distc, root, s, text};

/// A separable 3-class problem: class k's points sit around (2k, -2k, k, 0).
fn points(n: usize, seed: usize) -> (Vec<f32>, Vec<i64>) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for i in 0..n {
        let k = (i * 7 + seed) % 3;
        let jitter = |j: usize| (((i * 31 + j * 17 + seed) % 11) as f32 - 5.0) * 0.05;
        x.extend(
            [2.0 * k as f32, -2.0 * k as f32, k as f32, 0.0]
                .iter()
                .enumerate()
                .map(|(j, v)| v + jitter(j)),
        );
        y.push(k as i64);
    }
    (x, y)
}

fn write_safetensors(path: &Path, n: usize, seed: usize) {
    let (x, y) = points(n, seed);
    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let yb: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        (
            "features",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, 4], &xb)
                .expect("view"),
        ),
        (
            "label",
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![n], &yb)
                .expect("view"),
        ),
    ];
    safetensors::serialize_to_file(views, None, path).expect("writes");
}

fn model(data: &str) -> String {
    format!(
        "model points {{\n  input features: f32[B, 4]\n  input label: i32[B]\n  \
         param w: f32[4, 3] = glorot\n  param b: f32[3] = zeros\n  \
         minimize softmax_cross_entropy(features @ w + b, label)\n}}\n\
         train {{\n  data = {data}\n  batch = 12\n  optimizer = sgd(lr = 0.3)\n  \
         steps = 60\n  seed = 2\n  eval_samples = 120\n}}\n"
    )
}

/// A temporary data folder with `train.safetensors` and `test.safetensors` of
/// `train` and `test` samples, and `points.dsl` reading them: the folder and the model.
fn points_with_held_out(train: usize, test: usize) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    write_safetensors(&dir.path().join("train.safetensors"), train, 0);
    write_safetensors(&dir.path().join("test.safetensors"), test, 1);
    let m = dir.path().join("points.dsl");
    std::fs::write(
        &m,
        model(r#"tensors(path = "train.safetensors", eval_path = "test.safetensors")"#),
    )
    .expect("writes");
    (dir, m)
}

fn eval_accuracy(out: &str) -> f64 {
    out.split("eval_accuracy ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.trim_end_matches(',').parse().ok())
        .unwrap_or_else(|| panic!("no eval_accuracy in\n{out}"))
}

#[test]
fn a_safetensors_dataset_trains_and_verifies_under_three_workers() {
    let (dir, m) = points_with_held_out(240, 120);
    let o = distc(&["train", s(&m), "--data", s(dir.path())]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(eval_accuracy(&text(&o)) > 0.9, "{}", text(&o));
    let o = distc(&[
        "verify",
        s(&m),
        "--data",
        s(dir.path()),
        "--strategy",
        "allreduce",
        "--workers",
        "3",
        "--steps",
        "4",
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn a_csv_dataset_trains_and_a_bad_cell_stops_the_run_before_step_1() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (x, y) = points(240, 0);
    let mut csv = "label,a,b,c,d\n".to_string();
    for (i, l) in y.iter().enumerate() {
        let r = &x[i * 4..i * 4 + 4];
        csv += &format!("{l},{},{},{},{}\n", r[0], r[1], r[2], r[3]);
    }
    std::fs::write(dir.path().join("train.csv"), &csv).expect("writes");
    let src = "model points {\n  input a: f32[B]\n  input b: f32[B]\n  input label: i32[B]\n  \
               param w: f32[2, 3] = glorot\n  param c: f32[3] = zeros\n  \
               x = concat(reshape(a, [B, 1]), reshape(b, [B, 1]), axis = 1)\n  \
               minimize softmax_cross_entropy(x @ w + c, label)\n}\n\
               train {\n  data = csv(path = \"train.csv\", eval_path = \"train.csv\")\n  \
               batch = 12\n  optimizer = sgd(lr = 0.3)\n  steps = 300\n  seed = 2\n}\n";
    let m = dir.path().join("points.dsl");
    std::fs::write(&m, src).expect("writes");
    let o = distc(&["train", s(&m), "--data", s(dir.path())]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(eval_accuracy(&text(&o)) > 0.9, "{}", text(&o));
    // A bad cell: the run stops before its first step, naming the file, line and column.
    std::fs::write(
        dir.path().join("train.csv"),
        csv.replacen("\n1,", "\n1,oops-", 1),
    )
    .expect("writes");
    let metrics = dir.path().join("m.jsonl");
    let o = distc(&[
        "train",
        s(&m),
        "--data",
        s(dir.path()),
        "--metrics",
        s(&metrics),
    ]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("train.csv") && t.contains("column 2 (`a`)"),
        "{t}"
    );
    assert!(!metrics.exists(), "a step ran: {t}");
}

/// Issue 60, item 5: a CSV or tensors file is checked when opened: a label beyond the
/// logits' classes (in the training or the held-out file), a negative label and a NaN
/// or out-of-range feature stop the run before step 1, naming the file, the field and
/// the value. They used to train silently, or fail later blaming the learning rate.
#[test]
fn labels_beyond_the_classes_negative_labels_and_nan_features_stop_before_step_1() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (x, y) = points(48, 0);
    let mut csv = "label,a,b,c,d\n".to_string();
    for (i, l) in y.iter().enumerate() {
        let r = &x[i * 4..i * 4 + 4];
        csv += &format!("{l},{},{},{},{}\n", r[0], r[1], r[2], r[3]);
    }
    std::fs::write(dir.path().join("good.csv"), &csv).expect("writes");
    let src = |train: &str, eval: &str| {
        format!(
            "model points {{\n  input a: f32[B]\n  input b: f32[B]\n  input label: i32[B]\n  \
             param w: f32[2, 3] = glorot\n  param c: f32[3] = zeros\n  \
             x = concat(reshape(a, [B, 1]), reshape(b, [B, 1]), axis = 1)\n  \
             minimize softmax_cross_entropy(x @ w + c, label)\n}}\n\
             train {{\n  data = csv(path = \"{train}\", eval_path = \"{eval}\")\n  \
             batch = 12\n  optimizer = sgd(lr = 0.3)\n  steps = 3\n  seed = 2\n}}\n"
        )
    };
    let m = dir.path().join("points.dsl");
    let metrics = dir.path().join("m.jsonl");
    let run = |train: &str, eval: &str| {
        std::fs::write(&m, src(train, eval)).expect("writes");
        distc(&[
            "train",
            s(&m),
            "--data",
            s(dir.path()),
            "--metrics",
            s(&metrics),
        ])
    };
    let o = run("good.csv", "good.csv");
    assert!(o.status.success(), "{}", text(&o));
    std::fs::remove_file(&metrics).expect("removes");
    let bad = |name: &str, from: &str, to: &str| {
        std::fs::write(dir.path().join(name), csv.replacen(from, to, 1)).expect("writes");
    };
    // The first line after the header starts with its label: 0, 1 or 2.
    let first = csv.lines().nth(1).expect("a line").to_string();
    let label = first.split(',').next().expect("a label").to_string();
    bad("three.csv", &format!("\n{label},"), "\n3,");
    bad("negative.csv", &format!("\n{label},"), "\n-1,");
    let a = first.split(',').nth(1).expect("a").to_string();
    bad("nan.csv", &format!(",{a},"), ",NaN,");
    bad("huge.csv", &format!(",{a},"), ",1e39,");
    for (train, eval, want) in [
        ("three.csv", "good.csv", "values up to 3"),
        ("good.csv", "three.csv", "values up to 3"),
        ("negative.csv", "good.csv", "holds -1 at sample 0"),
        ("nan.csv", "good.csv", "holds NaN at sample 0"),
        (
            "huge.csv",
            "good.csv",
            "at sample 0: the model trains on finite",
        ),
    ] {
        let o = run(train, eval);
        let t = text(&o);
        assert!(!o.status.success(), "{train}/{eval}: {t}");
        assert!(
            t.contains(want) && t.contains("label") || t.contains(want) && t.contains("`a`"),
            "{train}/{eval}: {t}"
        );
        assert!(!metrics.exists(), "{train}/{eval}: a step ran: {t}");
    }
}

/// Issue 60, item 1: no output of a command replaces what it reads: the training or
/// held-out data (by name, or through a hard or symbolic link), the `--init` weights,
/// and `eval`'s and `predict`'s weights. Each is refused before step 1, and the file
/// is as it was.
#[test]
fn an_output_onto_an_input_is_refused_and_the_input_kept() {
    let (dir, m) = points_with_held_out(48, 24);
    let d = dir.path();
    let w = d.join("w.safetensors");
    let o = distc(&[
        "train",
        s(&m),
        "--data",
        s(d),
        "--steps",
        "2",
        "-q",
        "--save",
        s(&w),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    std::fs::hard_link(d.join("train.safetensors"), d.join("hard.safetensors")).expect("link");
    std::os::unix::fs::symlink(d.join("test.safetensors"), d.join("soft.safetensors"))
        .expect("link");
    let before = |n: &str| std::fs::read(d.join(n)).expect("reads");
    let kept: Vec<(&str, Vec<u8>)> = ["train.safetensors", "test.safetensors", "w.safetensors"]
        .into_iter()
        .map(|n| (n, before(n)))
        .collect();
    let at = |n: &str| d.join(n).to_string_lossy().into_owned();
    let train = |flag: &str, target: &str| {
        vec![
            "train".to_string(),
            s(&m).to_string(),
            "--data".into(),
            s(d).to_string(),
            "--steps".into(),
            "2".into(),
            "-q".into(),
            flag.into(),
            at(target),
        ]
    };
    let mut cases = vec![
        train("--save", "train.safetensors"),
        train("--save", "hard.safetensors"),
        train("--metrics", "test.safetensors"),
        train("--metrics", "soft.safetensors"),
        train("--checkpoint", "train.safetensors"),
        train("--trace", "test.safetensors"),
    ];
    let mut init = train("--save", "w.safetensors");
    init.extend(["--init".into(), at("w.safetensors")]);
    cases.push(init);
    cases.push(
        [
            "eval",
            s(&m),
            "--data",
            s(d),
            "--init",
            &at("w.safetensors"),
            "--metrics",
            &at("w.safetensors"),
        ]
        .map(String::from)
        .to_vec(),
    );
    cases.push(
        [
            "eval",
            s(&m),
            "--data",
            s(d),
            "--init",
            &at("w.safetensors"),
            "--metrics",
            &at("test.safetensors"),
        ]
        .map(String::from)
        .to_vec(),
    );
    cases.push(
        [
            "predict",
            s(&m),
            "--init",
            &at("w.safetensors"),
            "--input",
            &at("test.safetensors"),
            "-o",
            &at("w.safetensors"),
        ]
        .map(String::from)
        .to_vec(),
    );
    for args in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = distc(&args);
        let t = text(&o);
        assert!(!o.status.success(), "{args:?}: {t}");
        assert!(
            t.contains("refusing to overwrite an input"),
            "{args:?}: {t}"
        );
        for (n, bytes) in &kept {
            assert_eq!(&before(n), bytes, "{args:?} changed {n}");
        }
    }
}

#[test]
fn a_missing_data_file_is_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("points.dsl");
    std::fs::write(&m, model(r#"tensors(path = "nowhere.safetensors")"#)).expect("writes");
    let o = distc(&["train", s(&m), "--data", s(dir.path())]);
    assert!(!o.status.success());
    assert!(text(&o).contains("nowhere.safetensors"), "{}", text(&o));
}

/// PTB through the generic source: the script's token file is the built-in `ptb()`
/// stream, and the example trains from it.
#[test]
fn ptb_as_a_token_file_is_the_built_in_stream_and_trains_the_example() {
    let Some(data) = std::env::var_os("DISTC_DATA").filter(|d| !d.is_empty()) else {
        println!("skipping: DISTC_DATA not set");
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let made = std::process::Command::new("python3")
        .arg(root().join("scripts/ptb-tokens.py"))
        .arg(Path::new(&data).join("ptb"))
        .arg(dir.path().join("ptb-tokens"))
        .output()
        .expect("python3 runs");
    assert!(made.status.success(), "{}", text(&made));
    let shapes = |fields: &[(&str, usize)]| -> HashMap<String, TensorType> {
        fields
            .iter()
            .map(|(n, per)| {
                let dims = if *per == 1 { vec![4] } else { vec![4, *per] };
                (n.to_string(), TensorType::new(DType::I32, dims))
            })
            .collect()
    };
    let tokens = DataSource::open(
        &DataSpec::Tokens {
            path: "ptb-tokens/train.bin".into(),
            eval_path: Some("ptb-tokens/valid.bin".into()),
            width: 2,
            context: 16,
        },
        Some(dir.path()),
        &shapes(&[("tokens", 16), ("targets", 16)]),
        4,
        1,
        0,
        1,
    )
    .expect("the token file opens");
    let ptb = DataSource::open(
        &DataSpec::Ptb { context: 16 },
        Some(Path::new(&data)),
        &shapes(&[("context", 16), ("next", 1)]),
        4,
        1,
        0,
        1,
    )
    .expect("ptb opens");
    for start in [0, 1000, 500_000] {
        let (a, b) = (
            tokens.train_slice(start, 1).expect("slice"),
            ptb.train_slice(start, 1).expect("slice"),
        );
        assert_eq!(
            a["tokens"].to_f64_vec(),
            b["context"].to_f64_vec(),
            "window {start}"
        );
        assert_eq!(
            a["targets"].to_f64_vec()[15],
            b["next"].to_f64_vec()[0],
            "next {start}"
        );
    }
    let o = distc(&[
        "train",
        "examples/ptb_tokens.dsl",
        "--data",
        s(dir.path()),
        "--steps",
        "30",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("eval_loss"), "{}", text(&o));
}

/// Issue 60, item 4: a held-out set smaller than one batch is refused before step 1,
/// not found by the evaluation after the last one (which cost the run its `--save`,
/// its final checkpoint and its last metrics line); `--no-eval` trains.
#[test]
fn a_held_out_set_smaller_than_one_batch_is_refused_before_step_1() {
    let (dir, m) = points_with_held_out(48, 5);
    let (metrics, saved) = (dir.path().join("m.jsonl"), dir.path().join("w.st"));
    let args = |extra: &[&str]| {
        let mut a = vec![
            "train",
            s(&m),
            "--data",
            s(dir.path()),
            "--steps",
            "3",
            "--metrics",
            s(&metrics),
            "--save",
            s(&saved),
        ];
        a.extend(extra);
        distc(&a)
    };
    for pipeline in [false, true] {
        let extra: &[&str] = if pipeline {
            &[
                "--pipeline",
                "2",
                "--workers",
                "2",
                "--strategy",
                "allreduce",
            ]
        } else {
            &[]
        };
        let o = args(extra);
        let t = text(&o);
        assert!(!o.status.success(), "{t}");
        assert!(
            t.contains("no evaluation data") && t.contains("smaller than one batch"),
            "{t}"
        );
        assert!(!metrics.exists(), "a step ran: {t}");
    }
    let o = args(&["--no-eval"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(saved.exists(), "{}", text(&o));
}

#[test]
fn a_source_without_eval_path_trains_without_evaluating() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_safetensors(&dir.path().join("train.safetensors"), 48, 0);
    let m = dir.path().join("points.dsl");
    std::fs::write(&m, model(r#"tensors(path = "train.safetensors")"#)).expect("writes");
    let o = distc(&["train", s(&m), "--data", s(dir.path()), "--steps", "5"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("eval_loss"), "{}", text(&o));
}

/// MNIST through the generic source: scripts/mnist-safetensors.py's files train
/// examples/mnist_tensors.dsl.
#[test]
fn mnist_as_safetensors_trains_the_example() {
    let Some(data) = std::env::var_os("DISTC_DATA").filter(|d| !d.is_empty()) else {
        println!("skipping: DISTC_DATA not set");
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let made = std::process::Command::new("python3")
        .arg(root().join("scripts/mnist-safetensors.py"))
        .arg(Path::new(&data).join("mnist"))
        .arg(dir.path().join("mnist-st"))
        .output()
        .expect("python3 runs");
    assert!(made.status.success(), "{}", text(&made));
    let o = distc(&[
        "train",
        "examples/mnist_tensors.dsl",
        "--data",
        s(dir.path()),
        "--steps",
        "150",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(eval_accuracy(&text(&o)) > 0.8, "{}", text(&o));
}

/// `distc train ARGS` started, its output piped; the caller waits for it.
fn spawn_train(args: &[&str]) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_distc"))
        .args(args)
        .current_dir(root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("runs")
}

/// Waits until the metrics file has `n` lines (at most two minutes).
fn wait_for_lines(metrics: &Path, n: usize, what: &str) {
    let start = std::time::Instant::now();
    while std::fs::read_to_string(metrics).map_or(0, |t| t.lines().count()) < n {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(120),
            "{what}: the run did not get going"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Cuts `path` to `len` bytes, as another process truncating it would.
fn truncate(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(len))
        .expect("truncates");
}

/// Issue 60, item 5: a token file truncated by another process while a run reads it
/// stopped the run with SIGBUS (exit 135, no message). The run now stops with an error
/// naming the file, and the last checkpoint it wrote loads.
#[test]
fn a_token_file_truncated_while_training_stops_the_run_naming_it() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = dir.path().join("train.bin");
    std::fs::write(&tokens, common::token_bytes(200_000)).expect("tokens");
    let m = dir.path().join("lm.dsl");
    std::fs::write(
        &m,
        "model lm {\n  input tokens: i32[B, 4]\n  input targets: i32[B, 4]\n  \
         param emb: f32[50, 8] = uniform(-0.05, 0.05)\n  param w: f32[8, 50] = glorot\n  \
         x = reshape(embedding(emb, tokens), [-1, 8])\n  \
         minimize softmax_cross_entropy(x @ w, reshape(targets, [-1]))\n}\n\
         train {\n  data = tokens(path = \"train.bin\", dtype = \"u16\", context = 4)\n  \
         batch = 8\n  optimizer = sgd(lr = 0.1)\n  steps = 100000000\n  seed = 1\n}\n",
    )
    .expect("model");
    let (metrics, state) = (dir.path().join("m.jsonl"), dir.path().join("c.st"));
    let mut child = spawn_train(&[
        "train",
        s(&m),
        "--data",
        s(dir.path()),
        "-q",
        "--no-eval",
        "--metrics",
        s(&metrics),
        "--checkpoint",
        s(&state),
        "--checkpoint-every",
        "2",
    ]);
    wait_for_lines(&metrics, 4, "one device");
    truncate(&tokens, 8);
    let cut = Instant::now();
    while child.try_wait().expect("waits").is_none() {
        if cut.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the run went on 120 s after its token file was truncated");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().expect("waits");
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains(s(&tokens)) && t.contains("truncated or replaced while training"),
        "{t}"
    );
    let st = distc_runtime::core::checkpoint::load_state(&state).expect("the checkpoint loads");
    assert!(st.index.step >= 2, "{:?}", st.index.step);
}

/// Issue 60, item 4: the evaluation after the last step failed and the run threw its
/// training away (no `--save`, no last metrics line). A failure there is now said after
/// the weights are written, by workers and by a pipeline's evaluator alike. What fails
/// here is the held-out token file, truncated while the run trains: nothing before
/// step 1 can know of it.
#[test]
fn a_failed_last_evaluation_keeps_the_trained_weights() {
    use std::process::Command;
    let dir = tempfile::tempdir().expect("temp dir");
    let ids = common::token_bytes;
    let (train, held_out) = (dir.path().join("train.bin"), dir.path().join("valid.bin"));
    std::fs::write(&train, ids(20_000)).expect("tokens");
    let steps = 20_000;
    let m = dir.path().join("lm.dsl");
    std::fs::write(
        &m,
        format!(
            "model lm {{\n  input tokens: i32[B, 4]\n  input targets: i32[B, 4]\n  \
             param emb: f32[50, 8] = uniform(-0.05, 0.05)\n  param w1: f32[8, 8] = glorot\n  \
             param w2: f32[8, 50] = glorot\n  \
             x = reshape(embedding(emb, tokens), [-1, 8])\n  h = tanh(x @ w1)\n  \
             minimize softmax_cross_entropy(h @ w2, reshape(targets, [-1]))\n}}\n\
             train {{\n  data = tokens(path = \"train.bin\", eval_path = \"valid.bin\", \
             dtype = \"u16\", context = 4)\n  batch = 8\n  optimizer = sgd(lr = 0.1)\n  \
             steps = {steps}\n  seed = 1\n}}\n"
        ),
    )
    .expect("model");
    let layouts: [&[&str]; 2] = [&[], &["--pipeline", "2", "--micro-batches", "2"]];
    for layout in layouts {
        std::fs::write(&held_out, ids(4_000)).expect("held-out tokens");
        let (metrics, saved) = (dir.path().join("m.jsonl"), dir.path().join("w.st"));
        let _ = std::fs::remove_file(&saved);
        let _ = std::fs::remove_file(&metrics);
        let mut args = vec!["train", s(&m), "--data", s(dir.path()), "-q"];
        args.extend(["--metrics", s(&metrics), "--save", s(&saved)]);
        args.extend_from_slice(layout);
        let child = spawn_train(&args);
        let lines = || std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count());
        wait_for_lines(&metrics, 1, &format!("{layout:?}"));
        // Held still while the file is cut: a fast machine runs the steps left in
        // about a second.
        let signal = |sig: &str| {
            let pid = child.id().to_string();
            let o = Command::new("kill").args([sig, &pid]).status();
            assert!(o.is_ok_and(|o| o.success()), "kill {sig}");
        };
        signal("-STOP");
        let ran = lines();
        truncate(&held_out, 2);
        signal("-CONT");
        let o = child.wait_with_output().expect("waits");
        let t = text(&o);
        // The file was cut before the last step, or this run could not show anything.
        assert!(ran < steps, "{layout:?}: the run ended before the cut");
        assert_eq!(o.status.code(), Some(1), "{layout:?}: {t}");
        assert!(
            t.contains("the evaluation after the last step failed")
                && t.contains(s(&held_out))
                && t.contains(&format!("written to {}", s(&saved))),
            "{layout:?}: {t}"
        );
        let (weights, _) =
            distc_runtime::core::checkpoint::load(&saved).expect("the weights were saved");
        assert!(weights.contains_key("w2"), "{layout:?}");
        let all = common::metrics_lines(&metrics);
        let last = all.last().expect("a last line");
        assert_eq!(last["step"], steps, "{layout:?}");
        assert!(
            last["eval_error"]
                .as_str()
                .is_some_and(|e| e.contains("truncated")),
            "{layout:?}: {last}"
        );
    }
}
