//! `--pipeline` from the command line: the stage programs in `--dump-ir`, `explain`'s
//! per-stage table, a plan file that carries its stages, the metrics and trace of a
//! pipelined run, a stalled peer named within `--timeout`, and flags refused by name.

use std::path::{Path, PathBuf};

mod common;

use common::{distc, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("pipeline-cli").join(name)
}

/// Six tanh layers on synthetic data: no data files needed.
fn model() -> PathBuf {
    let mut s = String::from("model deep6 {\n  input x: f32[B, 32]\n  input label: i32[B]\n");
    for k in 0..6 {
        s += &format!("  param w{k}: f32[32, 32] = glorot\n  param b{k}: f32[32] = zeros\n");
    }
    s += "  param wo: f32[32, 10] = glorot\n  h0 = x\n";
    for k in 0..6 {
        s += &format!("  h{} = tanh(h{k} @ w{k} + b{k})\n", k + 1);
    }
    s += "  minimize softmax_cross_entropy(h6 @ wo, label)\n}\n";
    s += "train {\n  data = gaussian_classes(features = 32, classes = 10)\n  batch = 8\n  \
          optimizer = sgd(lr = 0.1)\n  steps = 3\n  seed = 3\n  eval_samples = 64\n}\n";
    let path = tmp("deep6.dsl");
    std::fs::write(&path, s).expect("model");
    path
}

fn arg(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn metrics_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

#[test]
fn compile_explain_and_run_a_pipelined_plan() {
    let m = model();
    let (plan, dump) = (tmp("p.json"), tmp("ir"));
    let o = distc(&[
        "compile",
        arg(&m),
        "--pipeline",
        "3",
        "--micro-batches",
        "4",
        "--schedule",
        "gpipe",
        "--dump-ir",
        arg(&dump),
        "-o",
        arg(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("pipeline_split"), "{}", text(&o));
    let files: Vec<String> = std::fs::read_dir(&dump)
        .expect("dump")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    for s in 0..3 {
        for phase in ["forward", "backward"] {
            let want = format!("pipeline_split.stage{s}.{phase}.ir");
            assert!(
                files.iter().any(|f| f.ends_with(&want)),
                "{want} in {files:?}"
            );
        }
    }

    let o = distc(&["explain", arg(&plan)]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("pipeline: 3 stages x 4 micro-batches of 8 (gpipe)"),
        "{out}"
    );
    assert!(out.contains("(P-1)/(M+P-1) = 33.3%"), "{out}");
    let rows = out
        .lines()
        .filter(|l| l.starts_with(['0', '1', '2']))
        .count();
    assert_eq!(rows, 3, "{out}");

    let (metrics, trace) = (tmp("m.jsonl"), tmp("t.json"));
    let o = distc(&[
        "run",
        arg(&plan),
        "--metrics",
        arg(&metrics),
        "--trace",
        arg(&trace),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // Issue 36, item 7.4: the summary names the pipeline, not `single`.
    let summary = String::from_utf8_lossy(&o.stdout);
    assert!(
        summary.contains("(pipeline of 3 stages x 4 micro-batches (gpipe), 3 workers) on CPU (")
            && summary.contains(" threads): 3 steps"),
        "{summary}"
    );
    let lines = metrics_lines(&metrics);
    assert_eq!(lines.len(), 3);
    for l in &lines {
        let stages = l["pipeline"]["stages"].as_array().expect("stages");
        assert_eq!(stages.len(), 3, "{l}");
        // An activation of 8 x 32 f32 per micro-batch at least, each way.
        assert!(
            stages[0]["bytes_sent"].as_u64().unwrap_or(0) >= 4 * 8 * 32 * 4,
            "{l}"
        );
        assert!(
            stages[1]["bytes_received"].as_u64().unwrap_or(0) >= 2 * 4 * 8 * 32 * 4,
            "{l}"
        );
        let bubble = l["pipeline"]["bubble"].as_f64().unwrap_or(-1.0);
        assert!((0.0..1.0).contains(&bubble), "{l}");
    }
    let t = std::fs::read_to_string(&trace).expect("trace");
    for s in 0..3 {
        assert!(t.contains(&format!("\"stage {s}\"")), "track of stage {s}");
    }
    assert!(t.contains("backward m3"), "a span per computation");

    // A stage program edited in the file: the hash refuses it.
    let text_plan = std::fs::read_to_string(&plan).expect("plan");
    let edited = text_plan.replacen("tanh", "relu", 1);
    assert_ne!(edited, text_plan);
    let bad = tmp("edited.json");
    std::fs::write(&bad, edited).expect("write");
    let o = distc(&["run", arg(&bad), "-q"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("hash"), "{}", text(&o));
}

#[test]
fn a_stage_that_does_not_answer_in_time_is_named() {
    // A timeout shorter than any stage's forward: some stage gives up waiting for its
    // neighbour and says which, and what it waited for.
    let m = model();
    let o = distc(&[
        "train",
        arg(&m),
        "--pipeline",
        "3",
        "--micro-batches",
        "2",
        "--timeout",
        "0.000001",
        "-q",
    ]);
    let out = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("stage "), "{out}");
    assert!(out.contains("micro-batch"), "{out}");
    assert!(out.contains("from stage"), "{out}");
}

#[test]
fn pipeline_flags_are_checked() {
    let m = model();
    let o = distc(&["train", arg(&m), "--micro-batches", "2"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--accumulate 2"), "{}", text(&o));
    let o = distc(&["train", arg(&m), "--pipeline", "2", "--schedule", "zigzag"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("valid: gpipe, 1f1b"), "{}", text(&o));
    let o = distc(&["train", arg(&m), "--pipeline", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// Issue 59: a pipeline's stages open their data as workers do, so a token file with
/// ids past the embedding's rows is refused before step 1 under both, with the same
/// words (the stages' opener used to skip the check and train on out-of-range rows).
#[test]
fn a_token_file_past_the_vocabulary_is_refused_by_a_pipeline_as_by_workers() {
    let dir = tmp("vocab");
    std::fs::create_dir_all(&dir).expect("dir");
    // u16 ids 0..=49: a vocabulary of 50 for a table of 40 rows.
    let ids: Vec<u8> = (0..400u16).flat_map(|i| (i % 50).to_le_bytes()).collect();
    std::fs::write(dir.join("train.bin"), ids).expect("tokens");
    let model = "model narrow {\n  input tokens: i32[B, 4]\n  input targets: i32[B, 4]\n  \
                 param emb: f32[40, 8] = uniform(-0.05, 0.05)\n  \
                 param w1: f32[8, 8] = glorot\n  param w2: f32[8, 50] = glorot\n  \
                 x = reshape(embedding(emb, tokens), [-1, 8])\n  h = tanh(x @ w1)\n  \
                 minimize softmax_cross_entropy(h @ w2, reshape(targets, [-1]))\n}\n\
                 train {\n  data = tokens(path = \"train.bin\", dtype = \"u16\", context = 4)\n  \
                 batch = 4\n  optimizer = sgd(lr = 0.1)\n  steps = 2\n  seed = 1\n}\n";
    let m = dir.join("narrow.dsl");
    std::fs::write(&m, model).expect("model");
    // (The lookup split by rows over a model axis is checked against its whole table:
    // its parts hold 20 rows each.)
    let layouts: [&[&str]; 3] = [
        &["--strategy", "allreduce", "--workers", "2"],
        &["--pipeline", "2", "--micro-batches", "2"],
        &["--mesh", "model=2", "--shard", "emb=0"],
    ];
    for layout in layouts {
        let mut args = vec!["train", arg(&m), "--data", arg(&dir), "--no-eval", "-q"];
        args.extend_from_slice(layout);
        let o = distc(&args);
        let out = text(&o);
        assert_eq!(o.status.code(), Some(1), "{layout:?}: {out}");
        assert!(
            out.contains("gives `tokens` values up to 49") && out.contains("40 rows"),
            "{layout:?}: {out}"
        );
    }
}
