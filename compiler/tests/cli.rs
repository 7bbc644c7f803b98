//! The `distc` binary: commands, files, exit codes and the plan format.

use std::path::{Path, PathBuf};

mod common;

use common::{distc, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("cli").join(name)
}

/// The rows of a `--metrics` JSON-lines file.
fn metrics_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

#[test]
fn compile_dump_and_run_a_plan() {
    let plan = tmp("dense.plan.json");
    let dump = tmp("ir");
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "--batch",
        "16",
        "-o",
        plan.to_str().expect("utf8"),
        "--dump-ir",
        dump.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let mut files: Vec<String> = std::fs::read_dir(&dump)
        .expect("dump")
        .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "00-lower.ir",
            "01-autodiff.ir",
            "02-simplify.ir",
            "03-dead_code.ir",
            "04-accumulate.ir",
            "05-remat.ir",
            "06-kernel_fusion.ir",
            "plan.cu"
        ]
    );
    // 5 steps of the plan, with `more` flags: the metrics lines.
    let run = |name: &str, more: &[&str]| {
        let metrics = tmp(name);
        let mut args = vec!["run", plan.to_str().expect("utf8"), "--steps", "5"];
        args.extend(more);
        args.extend(["--metrics", metrics.to_str().expect("utf8")]);
        let o = distc(&args);
        assert!(o.status.success(), "{}", text(&o));
        metrics_lines(&metrics)
    };
    let lines = run("m.jsonl", &[]);
    assert_eq!(lines.len(), 5);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i + 1);
        assert!(
            l["loss"].as_f64().is_some() && l["samples_per_sec"].as_f64().is_some(),
            "{l}"
        );
    }
    assert!(
        lines[4]["eval_loss"].as_f64().is_some() && lines[4]["eval_accuracy"].as_f64().is_some(),
        "{}",
        lines[4]
    );
    // `--no-eval`: the same steps, no evaluation.
    let without = run("m-no-eval.jsonl", &["--no-eval"]);
    assert_eq!(without.len(), 5);
    for (a, b) in lines.iter().zip(&without) {
        assert_eq!(a["loss"], b["loss"], "{a}\n{b}");
        assert!(
            b.as_object()
                .expect("object")
                .keys()
                .all(|k| !k.starts_with("eval")),
            "{b}"
        );
    }
}

#[test]
fn dump_ir_writes_every_program_per_pass() {
    // Hybrid with ZeRO: two servers and an init program from distribute on, a final
    // program from zero on; the worker program keeps its file names.
    let plan = tmp("hybrid.plan.json");
    let dump = tmp("ir-hybrid");
    let o = distc(&[
        "compile",
        "examples/lm.dsl",
        "--strategy",
        "hybrid",
        "--workers",
        "2",
        "--servers",
        "2",
        "--zero",
        "1",
        "-o",
        plan.to_str().expect("utf8"),
        "--dump-ir",
        dump.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let mut files: Vec<String> = std::fs::read_dir(&dump)
        .expect("dump")
        .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let mut want: Vec<String> = [
        "00-lower",
        "01-autodiff",
        "02-simplify",
        "03-dead_code",
        "04-accumulate",
        "05-remat",
        "06-sparsity_analysis",
        "07-place",
    ]
    .iter()
    .map(|s| format!("{s}.ir"))
    .collect();
    for (i, pass) in [
        (8, "distribute"),
        (9, "zero"),
        (10, "fusion"),
        (11, "kernel_fusion"),
        (12, "schedule"),
    ] {
        let mut programs = vec!["", ".init", ".server0", ".server1"];
        if i >= 9 {
            programs.push(".final");
        }
        want.extend(programs.iter().map(|p| format!("{i:02}-{pass}{p}.ir")));
    }
    want.push("plan.cu".into());
    want.sort();
    assert_eq!(files, want);
    let cuda = std::fs::read_to_string(dump.join("plan.cu")).expect("read plan.cu");
    assert!(cuda.contains("extern \"C\" __global__"), "{cuda}");
    for f in files.iter().filter(|f| f.ends_with(".ir")) {
        let text = std::fs::read_to_string(dump.join(f)).expect("read");
        let g = distc_ir::parse(&text).unwrap_or_else(|e| panic!("{f}: {e}"));
        distc_ir::verify(&g).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert_eq!(distc_ir::print(&g), text, "{f} does not round-trip");
        // The file's suffix is the program's: lm.server1 is in NN-pass.server1.ir.
        let suffix = f.trim_end_matches(".ir").split_once('.').map(|(_, s)| s);
        assert_eq!(
            g.name.split_once('.').map(|(_, s)| s),
            suffix,
            "{f} holds {}",
            g.name
        );
    }
    // The server holding the embedding serves it.
    let servers: String = ["12-schedule.server0.ir", "12-schedule.server1.ir"]
        .iter()
        .map(|f| std::fs::read_to_string(dump.join(f)).expect("read"))
        .collect();
    assert!(servers.contains("serve{var=\"emb\"}"), "{servers}");
}

#[test]
fn plans_of_other_versions_and_damaged_plans_are_refused() {
    let plan = tmp("p.plan.json");
    let o = distc(&[
        "compile",
        "examples/mlp.dsl",
        "-o",
        plan.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let good = std::fs::read_to_string(&plan).expect("plan");
    let cases = [
        (
            good.replace("\"version\": 2", "\"version\": 3"),
            "plan format version 3; this distc reads version 2",
        ),
        (good.replacen("relu", "tanh", 1), "does not match its hash"),
        (good[..good.len() / 2].to_string(), "not JSON"),
        (
            "{\"hello\": 1}".to_string(),
            "no \"format\": \"distc-plan\" field",
        ),
    ];
    for (content, msg) in cases {
        let bad = tmp("bad.plan.json");
        std::fs::write(&bad, content).expect("write");
        let o = distc(&["run", bad.to_str().expect("utf8"), "--steps", "1"]);
        assert!(!o.status.success());
        assert!(text(&o).contains(msg), "expected {msg:?} in {}", text(&o));
        assert!(text(&o).contains("bad.plan.json"), "{}", text(&o));
    }
}

#[test]
fn missing_files_are_named() {
    let o = distc(&["train", "examples/nope.dsl"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("examples/nope.dsl"), "{}", text(&o));
    let o = distc(&["run", "/nonexistent/plan.json"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("/nonexistent/plan.json"), "{}", text(&o));
    let o = distc(&[
        "train",
        "examples/mlp.dsl",
        "--data",
        "/nonexistent/data",
        "--steps",
        "1",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("/nonexistent/data"), "{}", text(&o));
}

#[test]
fn dsl_errors_are_diagnostics_with_a_caret() {
    let bad = tmp("bad.dsl");
    std::fs::write(&bad, "model m {\n  input x: f32[B, 4]\n  param w: f32[5, 2] = glorot\n  minimize mean(x @ w)\n}\ntrain { data = gaussian_classes(features = 4, classes = 2) batch = 2 optimizer = sgd(lr = 0.1) steps = 1 }\n").expect("write");
    let o = distc(&[
        "compile",
        bad.to_str().expect("utf8"),
        "-o",
        tmp("x.json").to_str().expect("utf8"),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let t = text(&o);
    assert!(t.contains("bad.dsl:4:"), "{t}");
    assert!(
        t.contains("matmul") && t.contains("f32[2,4]") && t.contains("f32[5,2]"),
        "{t}"
    );
    assert!(t.contains('^'), "{t}");
}

#[test]
fn unknown_passes_are_listed_with_the_valid_ones() {
    let o = distc(&["ir", "examples/mlp.dsl", "--after", "fusoin"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("unknown pass `fusoin`; the passes are: lower, tensor_parallel, mixed_precision, autodiff, simplify, dead_code, accumulate, remat, sparsity_analysis, place, distribute, zero, fusion, grad_wire, hierarchy, kernel_fusion, schedule, pipeline_split"), "{}", text(&o));
}

#[test]
fn ir_after_autodiff_shows_sparse_gradients_and_dot_renders() {
    let o = distc(&["ir", "examples/lm.dsl", "--after", "autodiff"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("indexed_slices(f32[10000,64], nnz=256)"));
    let o = distc(&["dot", "examples/cnn.dsl"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("digraph \"cnn\""));
}

/// Issue 36, item 7.2: `ir --after distribute` printed the one-device program; with the
/// strategy flags it prints the distributed programs after that pass, and without them
/// it refuses, naming `compile --dump-ir`.
#[test]
fn ir_after_a_distributed_pass_prints_the_distributed_programs() {
    let o = distc(&[
        "ir",
        "examples/sparse_lm.dsl",
        "--after",
        "distribute",
        "--strategy",
        "ps",
        "--workers",
        "2",
        "--servers",
        "1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let ir = String::from_utf8_lossy(&o.stdout);
    assert!(ir.contains(" pull") && ir.contains(" push"), "{ir}");
    assert!(ir.contains(".server0"), "{ir}");
    let o = distc(&["ir", "examples/sparse_lm.dsl", "--after", "distribute"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("pass `distribute` does not run for this strategy (single)")
            && text(&o).contains("--dump-ir"),
        "{}",
        text(&o)
    );
    // `dot` draws the one-device program: the same refusal.
    let o = distc(&["dot", "examples/sparse_lm.dsl", "--after", "fusion"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("pass `fusion` does not run"),
        "{}",
        text(&o)
    );
}

/// Issue 36, item 7.5: the step after an evaluation counted the other workers' wait for
/// worker 0's evaluation (1,800 samples/s instead of 40,000). The evaluation's seconds
/// are its own (`eval_sec`); the next step, a few ms, is far shorter than an evaluation
/// of thousands of batches.
#[test]
fn evaluation_time_is_not_the_next_steps() {
    let dir = common::temp_dir("cli").join("eval-time");
    std::fs::create_dir_all(&dir).expect("dir");
    let model = dir.join("m.dsl");
    std::fs::write(
        &model,
        "model m {
  input x: f32[B, 32]
  input label: i32[B]
  param w1: f32[32, 256] = glorot
  param w2: f32[256, 4] = glorot
  minimize softmax_cross_entropy(relu(x @ w1) @ w2, label)
}
train {
  data = gaussian_classes(features = 32, classes = 4)
  batch = 4
  optimizer = sgd(lr = 0.1)
  steps = 8
  seed = 5
  eval_every = 3
  eval_samples = 40000
}
",
    )
    .expect("model");
    let metrics = dir.join("m.jsonl");
    let o = distc(&[
        "train",
        model.to_str().expect("utf8"),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "-q",
        "--metrics",
        metrics.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines = metrics_lines(&metrics);
    assert_eq!(lines.len(), 8);
    for after in [3, 6] {
        let eval = lines[after - 1]["eval_sec"].as_f64().expect("eval_sec");
        let next = &lines[after];
        assert!(next.get("eval_sec").is_none(), "{next}");
        // Two workers of batch 4 a step.
        let step_sec = 8.0 / next["samples_per_sec"].as_f64().expect("samples/s");
        assert!(
            step_sec < eval,
            "step {} took {step_sec} s, the evaluation before it {eval} s",
            after + 1
        );
    }
}

#[test]
fn a_distributed_run_writes_metrics_per_worker_and_a_trace() {
    let metrics = tmp("hybrid.jsonl");
    let trace = tmp("hybrid.trace.json");
    let o = distc(&[
        "train",
        "examples/sparse_lm.dsl",
        "--strategy",
        "hybrid",
        "--workers",
        "2",
        "--servers",
        "2",
        "--batch",
        "16",
        "--steps",
        "3",
        "--preload",
        "--metrics",
        metrics.to_str().expect("utf8"),
        "--trace",
        trace.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines = metrics_lines(&metrics);
    assert_eq!(lines.len(), 3);
    for l in &lines {
        let sent = l["bytes_sent_per_worker"].as_array().expect("per worker");
        assert_eq!(sent.len(), 2, "{l}");
        assert_eq!(sent[0], l["bytes_sent"], "{l}");
        assert!(sent.iter().all(|b| b.as_u64() > Some(0)), "{l}");
        assert!(l["comm_wait_sec"].as_f64().is_some(), "{l}");
    }
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace")).expect("json");
    let events = t["traceEvents"].as_array().expect("events");
    let track = |tid: &serde_json::Value| {
        events
            .iter()
            .find(|e| e["ph"] == "M" && &e["tid"] == tid)
            .and_then(|e| e["args"]["name"].as_str())
            .unwrap_or("")
            .to_string()
    };
    let spans: Vec<(String, String)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                track(&e["tid"]),
                e["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let has = |tr: &str, prefix: &str| spans.iter().any(|(t, n)| t == tr && n.starts_with(prefix));
    for rank in 0..2 {
        let w = format!("worker {rank}");
        assert!(
            has(&w, "step 3") && has(&w, "matmul") && has(&w, "sparse_pull"),
            "{spans:?}"
        );
        assert!(
            has(&w, "forward") && has(&w, "backward") && has(&w, "update"),
            "{spans:?}"
        );
        assert!(has(&format!("{w} comm"), "all_reduce %"), "{spans:?}");
    }
    for s in 0..2 {
        let s = format!("server {s}");
        assert!(
            has(&s, "pull emb") && has(&s, "push emb") && has(&s, "apply emb"),
            "{spans:?}"
        );
    }
    // A collective span names its node and the bytes it sent.
    let ar = events
        .iter()
        .find(|e| {
            e["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("all_reduce"))
        })
        .expect("an all_reduce");
    assert!(
        ar["args"]["node"]
            .as_str()
            .is_some_and(|n| n.starts_with('%')),
        "{ar}"
    );
    assert!(ar["args"]["bytes"].as_u64().is_some(), "{ar}");
}

#[test]
fn profile_accounts_for_the_step() {
    let o = distc(&[
        "train",
        "examples/dense_mlp.dsl",
        "--batch",
        "16",
        "--steps",
        "3",
        "--profile",
        "--preload",
        "-q",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let share = |name: &str| -> f64 {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no `{name}` line in\n{out}"));
        line.split_whitespace()
            .nth(2)
            .and_then(|s| s.trim_end_matches('%').parse().ok())
            .unwrap_or_else(|| panic!("bad line `{line}`"))
    };
    assert_eq!(share("step"), 100.0);
    assert!(share("matmul") > 0.0, "{out}");
    let total: f64 = out
        .lines()
        .skip(1)
        .filter(|l| !l.starts_with("step"))
        .filter_map(|l| {
            l.split_whitespace()
                .nth(2)?
                .trim_end_matches('%')
                .parse::<f64>()
                .ok()
        })
        .sum();
    assert!((total - 100.0).abs() < 1.0, "shares add to {total}\n{out}");
}

#[test]
fn verify_passes_within_tolerance_and_names_the_worst_variable_beyond() {
    let args = [
        "verify",
        "examples/sparse_lm.dsl",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--batch",
        "8",
        "--steps",
        "2",
    ];
    let o = distc(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("worst relative error"), "{}", text(&o));
    // Summation order differs between one device and a ring, so no run is exact.
    let o = distc(&[&args[..], &["--tolerance", "1e-30"]].concat());
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("beyond the tolerance"), "{}", text(&o));
    let o = distc(&[
        "verify",
        "examples/sparse_lm.dsl",
        "--strategy",
        "ps",
        "--workers",
        "2",
        "--servers",
        "1",
        "--sync",
        "async",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("not synchronous"), "{}", text(&o));
}

/// Issue 36, item 7.1: the summary named the largest error (`beta`, within its raised
/// 16-bit allowance) while the failure named `b2`; both name the variable furthest
/// beyond its own allowance, with that allowance.
#[test]
fn verify_summary_and_failure_name_the_same_variable() {
    use distc::verify::{VarError, VerifyReport};
    let var = |name: &str, relative, half_rtol, precision_effect| VarError {
        name: name.into(),
        relative,
        precision_effect,
        rounding: None,
        half_rtol,
    };
    let report = VerifyReport {
        strategy: distc_passes::placement::Strategy::Allreduce,
        workers: 2,
        global_batch: 16,
        micro_batches: 1,
        split_reason: "",
        steps: 3,
        vars: vec![
            var("beta", 5e-3, 1.6e-2, Some(1e-3)),
            var("b2", 3.77e-3, 0.0, None),
        ],
        tolerance: 1e-3,
        assumptions: vec![],
    };
    assert_eq!(report.worst().map(|v| v.name.as_str()), Some("b2"));
    let (text, failure) = distc::commands::run::verify_verdict(
        &report,
        Path::new("m.dsl"),
        "allreduce",
        distc_passes::placement::Precision::Bf16,
        None,
    )
    .expect("verdict");
    let summary = text.lines().last().expect("summary");
    assert!(
        summary.contains("worst relative error 3.77e-3 (`b2`, allowed 1.0e-3 (tolerance))"),
        "{text}"
    );
    let failure = failure.expect("b2 is beyond its allowance");
    assert!(failure.starts_with("`b2` differs by 3.77e-3"), "{failure}");
    // An explicit --tolerance is every variable's allowance: the largest error decides.
    let (text, failure) = distc::commands::run::verify_verdict(
        &report,
        Path::new("m.dsl"),
        "allreduce",
        distc_passes::placement::Precision::Bf16,
        Some(4e-3),
    )
    .expect("verdict");
    assert!(
        text.contains("(`beta`, allowed 4.0e-3 (--tolerance))"),
        "{text}"
    );
    assert!(failure.expect("beta fails").starts_with("`beta`"));
}

#[test]
fn a_single_device_run_writes_the_same_trace_as_a_worker() {
    // One device is worker 0 of the one training loop: same tracks, same spans.
    let trace = tmp("single.json");
    let o = distc(&[
        "train",
        "examples/dense_mlp.dsl",
        "--steps",
        "2",
        "--trace",
        trace.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).expect("trace")).expect("json");
    let names: Vec<&str> = t["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    for want in ["step 2", "forward", "backward", "update", "matmul"] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    // Memory by category as counter tracks, one sample per step.
    let counters: Vec<&serde_json::Value> = t["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["ph"] == "C" && e["name"] == "memory")
        .collect();
    assert_eq!(counters.len(), 2, "{counters:?}");
    assert!(
        counters[0]["args"]["activations"].as_u64() > Some(0),
        "{counters:?}"
    );
}

/// Issue 35, item 11: flags the plan would accept and then ignore, and values beyond
/// any link, are refused naming the flag (one table of rules in `check_strategy_flags`,
/// and the value parsers); nothing is written.
#[test]
fn flags_a_plan_would_ignore_are_refused_by_name() {
    for (args, want) in [
        (
            vec!["--schedule", "gpipe"],
            "--schedule gpipe orders a pipeline's",
        ),
        (
            vec![
                "--strategy",
                "ps",
                "--workers",
                "2",
                "--servers",
                "1",
                "--ranks-per-node",
                "2",
            ],
            "--ranks-per-node 2 groups workers into nodes",
        ),
        (
            vec![
                "--strategy",
                "allreduce",
                "--workers",
                "4",
                "--pipeline",
                "2",
                "--ranks-per-node",
                "2",
            ],
            "a pipeline's replicas all-reduce flat",
        ),
        (vec!["--link", "intra=1e9,1e-6"], "--link sets the links"),
        (
            vec![
                "--strategy",
                "allreduce",
                "--workers",
                "2",
                "--link",
                "intra=1e9,1e-6",
            ],
            "give --ranks-per-node L",
        ),
        (
            vec!["--mesh", "model=2,model=4"],
            "the model axis is given twice",
        ),
        (
            vec!["--mesh", "data=2", "--shard", "w1=0"],
            "--shard w1=0 splits a variable",
        ),
        (
            vec![
                "--strategy",
                "allreduce",
                "--workers",
                "4",
                "--ranks-per-node",
                "2",
                "--link",
                "intra=1e-300,1e-6",
            ],
            "is not a link's bandwidth",
        ),
        (vec!["--latency", "1e300"], "is not a link's latency"),
        (
            vec![
                "--strategy",
                "allreduce",
                "--workers",
                "4",
                "--pipeline",
                "2",
                "--grad-wire",
                "bf16",
            ],
            "a pipeline's replicas send theirs in f32",
        ),
        // Issue 60, item 9: a million servers for dense_mlp's 4,890 rows wrote a 40 MB
        // plan, then started a million threads.
        (
            vec!["--strategy", "ps", "--workers", "2", "--servers", "1048576"],
            "the model's variables have 4890 rows in all",
        ),
    ] {
        let never = tmp("ignored.plan.json");
        let o = compile_dense(&never, &args);
        assert!(!o.status.success(), "{args:?} compiled");
        assert!(
            text(&o).contains(want),
            "{args:?}: `{want}` not in {}",
            text(&o)
        );
        assert!(!text(&o).contains("panicked"), "{args:?}: {}", text(&o));
        assert!(!never.exists(), "{args:?} wrote a plan");
    }
    // Where they act, the same flags compile: `--mesh pipe=2` is `--pipeline 2` (it was
    // refused as "2 workers under `single`").
    for args in [
        vec!["--mesh", "pipe=2"],
        vec!["--pipeline", "2", "--schedule", "gpipe"],
        vec![
            "--strategy",
            "allreduce",
            "--workers",
            "4",
            "--ranks-per-node",
            "2",
            "--link",
            "intra=1e10,1e-6",
        ],
    ] {
        let o = compile_dense(&tmp("acts.plan.json"), &args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    }
}

/// `distc compile examples/dense_mlp.dsl -o PLAN` with `args`.
fn compile_dense(plan: &Path, args: &[&str]) -> std::process::Output {
    let mut a = vec![
        "compile",
        "examples/dense_mlp.dsl",
        "-o",
        plan.to_str().expect("utf-8"),
    ];
    a.extend(args.iter().copied());
    distc(&a)
}
