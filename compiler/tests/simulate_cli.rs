//! `distc calibrate` and `distc simulate` from the command line (issue 25, item 3):
//! what they write, that a plan simulated on many workers in nodes picks the
//! all-reduce the links favour, where op times come from, and the refusals.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

mod common;

use common::{distc, refused, s, temp_dir, text};

const MODEL: &str = "model wide {
  input x: f32[B, 128]
  input label: i32[B]
  param w1: f32[128, 512] = glorot
  param b1: f32[512] = zeros
  param w2: f32[512, 512] = glorot
  param w3: f32[512, 10] = glorot
  minimize softmax_cross_entropy(relu(relu(x @ w1 + b1) @ w2) @ w3, label)
}
train {
  data = gaussian_classes(features = 128, classes = 10)
  batch = 16
  optimizer = sgd(lr = 0.1)
  steps = 6
  seed = 3
}
";

fn setup(label: &str) -> (PathBuf, PathBuf) {
    let dir = temp_dir("simulate").join(label);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("wide.dsl");
    std::fs::write(&model, MODEL).unwrap();
    let plan = dir.join("plan.json");
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
    (dir, plan)
}

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", text(o));
    serde_json::from_slice(&o.stdout).expect("JSON on stdout")
}

fn calibration(dir: &Path) -> PathBuf {
    let cal = dir.join("cal.json");
    let o = distc(&[
        "calibrate",
        "--workers",
        "3",
        "--sizes",
        "4096,65536,1048576",
        "--reps",
        "3",
        "-o",
        s(&cal),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("link: bandwidth"), "{}", text(&o));
    cal
}

#[test]
fn calibrate_writes_the_samples_and_the_link_fitted_to_them() {
    let dir = temp_dir("simulate").join("calibrate");
    std::fs::create_dir_all(&dir).unwrap();
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(calibration(&dir)).unwrap()).unwrap();
    assert_eq!(c["ranks"], 3);
    assert_eq!(c["transport"], "inprocess");
    let bytes: Vec<u64> = c["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(bytes, vec![4096, 65536, 1048576]);
    assert!(c["link"]["bandwidth"].as_f64().unwrap() > 0.0);
    assert!(c["link"]["latency"].as_f64().unwrap() >= 0.0);
    refused(&["calibrate", "--workers", "1"], "1 is not in 2..=256");
    refused(&["calibrate", "--sizes", "0"], "0 is not in 4..=1073741824");
}

#[test]
fn a_slow_link_between_nodes_makes_every_bucket_hierarchical_at_scale() {
    let (dir, plan) = setup("nodes");
    let cal = calibration(&dir);
    let inter = format!("inter={}", s(&cal));
    let sim = |extra: &[&str]| {
        let mut args = vec![
            "simulate",
            s(&plan),
            "--profile-steps",
            "3",
            "--format",
            "json",
        ];
        args.extend_from_slice(extra);
        json(&distc(&args))
    };
    let hier = sim(&[
        "--workers",
        "64",
        "--ranks-per-node",
        "8",
        "--calibration",
        &inter,
        "--link",
        "intra=1e12,1e-7",
    ]);
    assert_eq!(
        (hier["workers"].as_u64(), hier["ranks_per_node"].as_u64()),
        (Some(64), Some(8))
    );
    let reduces: Vec<&serde_json::Value> = hier["comms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["op"] == "all_reduce")
        .collect();
    assert!(!reduces.is_empty(), "{hier}");
    for c in &reduces {
        // A link within the node thousands of times faster: the hierarchy wins, and the
        // plan (compiled again for 64 workers) runs it.
        assert_eq!(c["how"], "hierarchical", "{c}");
        assert!(
            c["hierarchical_seconds"].as_f64() < c["flat_seconds"].as_f64(),
            "{c}"
        );
    }
    let step = hier["step"].as_f64().unwrap();
    let parts = hier["compute"].as_f64().unwrap() + hier["exposed_comm"].as_f64().unwrap();
    assert!((step - parts).abs() <= 1e-9 * step, "{hier}");
    let eff = hier["scaling_efficiency"].as_f64().unwrap();
    assert!(eff > 0.0 && eff <= 1.0 + 1e-9, "{hier}");
    assert!(hier["memory_per_worker"].as_u64().unwrap() > 4 * (128 * 512 + 512 * 512));
    // The same plan at its own 2 workers, and as a table for people.
    let own = sim(&["--calibration", &inter]);
    assert_eq!(own["workers"], 2);
    let o = distc(&[
        "simulate",
        s(&plan),
        "--profile-steps",
        "3",
        "--workers",
        "16",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    for want in [
        "on 16 workers",
        "scaling efficiency",
        "all_reduce",
        "memory per worker",
    ] {
        assert!(text(&o).contains(want), "{want}: {}", text(&o));
    }
}

#[test]
fn op_times_come_from_a_trace_of_the_plan_or_of_the_model_on_one_device() {
    let (dir, plan) = setup("trace");
    let model = dir.join("wide.dsl");
    for (what, args) in [
        ("plan", vec!["run", s(&plan), "--steps", "5", "-q"]),
        ("single", vec!["train", s(&model), "--steps", "5", "-q"]),
    ] {
        let trace = dir.join(format!("{what}.trace.json"));
        let mut args = args.clone();
        args.extend(["--trace", s(&trace)]);
        let o = distc(&args);
        assert!(o.status.success(), "{}", text(&o));
        let sim = json(&distc(&[
            "simulate",
            s(&plan),
            "--workers",
            "8",
            "--trace",
            s(&trace),
            "--format",
            "json",
        ]));
        let (measured, _, copies) = (
            sim["op_times"][0].as_u64().unwrap(),
            sim["op_times"][1].as_u64().unwrap(),
            sim["op_times"][2].as_u64().unwrap(),
        );
        assert!(measured > 5, "{what}: {sim}");
        if what == "plan" {
            // The plan's own run timed its packing too.
            assert_eq!(copies, 0, "{sim}");
        }
    }
    // A trace of another model is refused.
    let other = dir.join("other.trace.json");
    let o = distc(&[
        "train",
        "examples/dense_mlp.dsl",
        "--steps",
        "2",
        "-q",
        "--trace",
        s(&other),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    refused(
        &["simulate", s(&plan), "--trace", s(&other)],
        "a trace of neither this plan nor its model",
    );
}

#[test]
fn simulate_refuses_what_it_cannot_simulate_and_says_why() {
    let (dir, plan) = setup("refusals");
    refused(
        &[
            "simulate",
            s(&plan),
            "--workers",
            "12",
            "--ranks-per-node",
            "8",
        ],
        "cannot fill nodes of 8",
    );
    refused(
        &[
            "simulate",
            s(&plan),
            "--calibration",
            "inter=/nonexistent/cal.json",
        ],
        "/nonexistent/cal.json",
    );
    refused(
        &["simulate", s(&plan), "--calibration", "across=x"],
        "intra=FILE or inter=FILE",
    );
    // One device cannot be simulated on many workers.
    let single = dir.join("single.json");
    let o = distc(&[
        "compile",
        s(&dir.join("wide.dsl")),
        "--strategy",
        "single",
        "-o",
        s(&single),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    refused(
        &["simulate", s(&single), "--workers", "4"],
        "compile it with a distributed strategy",
    );
    // The model changed since the plan was compiled: the simulation would be of another.
    std::fs::write(
        dir.join("wide.dsl"),
        MODEL.replace("x @ w1 + b1", "x @ w1 - b1"),
    )
    .unwrap();
    refused(
        &["simulate", s(&plan), "--workers", "4"],
        "no longer compiles to this plan",
    );
    // The model's file is gone: the message names it.
    std::fs::remove_file(dir.join("wide.dsl")).unwrap();
    refused(&["simulate", s(&plan), "--workers", "4"], "wide.dsl");
}
