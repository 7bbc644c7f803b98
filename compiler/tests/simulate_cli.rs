//! `distc calibrate`, `distc simulate` and the layout search (`--strategy auto`) from
//! the command line (issue 25, item 3; issue 39, items 1 and 2):
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

/// Issue 36, item 7.3: a plan's one server simulated at 64 workers carries every
/// worker's pulls and pushes: the table says the servers bound the step, and
/// `--servers N` simulates another count, which shares that load.
#[test]
fn simulate_names_servers_as_the_bottleneck_and_takes_a_server_count() {
    let dir = temp_dir("simulate").join("servers");
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("wide.dsl");
    std::fs::write(&model, MODEL).unwrap();
    let plan = dir.join("ps.json");
    let o = distc(&[
        "compile",
        s(&model),
        "--strategy",
        "ps",
        "--workers",
        "2",
        "--servers",
        "1",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // A slow link, so the servers' share dwarfs any CPU's compute.
    let sim = |servers: &str| {
        let mut args = vec![
            "simulate",
            s(&plan),
            "--profile-steps",
            "2",
            "--workers",
            "64",
            "--link",
            "inter=1e7,1e-4",
        ];
        if !servers.is_empty() {
            args.extend(["--servers", servers]);
        }
        let o = distc(&args);
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    let one = sim("");
    assert!(one.contains("on 64 workers and 1 server"), "{one}");
    assert!(
        one.contains("note: the 1 parameter server(s) are the bottleneck")
            && one.contains("--servers N"),
        "{one}"
    );
    let many = sim("64");
    assert!(many.contains("on 64 workers and 64 servers"), "{many}");
    assert!(!many.contains("bottleneck"), "{many}");
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
        let simulate = |more: &[&str]| {
            let mut args = vec!["simulate", s(&plan), "--workers", "8", "--trace", s(&trace)];
            args.extend(["--format", "json"]);
            args.extend(more);
            json(&distc(&args))
        };
        let sim = simulate(&[]);
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
        // The same op times, the 8 workers sharing this machine's cores: slower on
        // any machine (8 large updates at once on one pool of the cores, if nothing
        // else waits).
        let shared = simulate(&["--shared-cores"]);
        let compute = |v: &serde_json::Value| v["compute"].as_f64().unwrap();
        assert!(
            compute(&shared) > compute(&sim),
            "{what}: {} against {}",
            compute(&shared),
            compute(&sim)
        );
        if what == "single" {
            // A GPU's trace: each worker has a device of its own.
            edit_first_op_span(&trace, |op| op["args"]["clock"] = "device".into());
            refused(
                &["simulate", s(&plan), "--trace", s(&trace), "--shared-cores"],
                // Whole: the message once had a run of spaces in its middle.
                "cores, and this trace timed its ops on a GPU, a device a worker",
            );
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
    // Issue 60, item 9: servers for a plan that has no use for them priced nothing.
    refused(
        &["simulate", s(&plan), "--servers", "4"],
        "--servers 4: the plan is `allreduce`",
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

/// A calibration as `distc calibrate` writes one (3 ranks on one host), for tests to
/// damage one field of.
fn calibration_json() -> serde_json::Value {
    serde_json::json!({
        "transport": "inprocess",
        "ranks": 3,
        "hosts": 1,
        "samples": [
            {"bytes": 4096, "seconds": 2e-5},
            {"bytes": 65536, "seconds": 6e-5},
            {"bytes": 1048576, "seconds": 6e-4}
        ],
        "link": {"bandwidth": 2e9, "latency": 5e-6},
        "predicted": [2e-5, 6e-5, 6e-4],
        "copy_bandwidth": 1e10
    })
}

#[test]
fn a_calibration_out_of_range_is_refused_naming_its_file_field_and_value() {
    let (dir, plan) = setup("bad-calibration");
    let cal = dir.join("cal.json");
    let simulate = |c: &serde_json::Value| {
        std::fs::write(&cal, c.to_string()).unwrap();
        let inter = format!("inter={}", s(&cal));
        distc(&[
            "simulate",
            s(&plan),
            "--profile-steps",
            "2",
            "--calibration",
            &inter,
        ])
    };
    // The file as calibrate writes it is read.
    let o = simulate(&calibration_json());
    assert!(o.status.success(), "{}", text(&o));
    for (pointer, value, want) in [
        // "communication -5.5 ms"
        (
            "/samples/1/seconds",
            serde_json::json!(-5.5e-3),
            "`samples[1].seconds` -0.0055",
        ),
        // "step inf ms, NaN% overlap"
        (
            "/samples/0/seconds",
            serde_json::json!(1e308),
            "`samples[0].seconds` 1e308",
        ),
        (
            "/samples/2/seconds",
            serde_json::json!(0.0),
            "`samples[2].seconds` 0.0",
        ),
        // A 127 s step: two times for one size.
        (
            "/samples/2/bytes",
            serde_json::json!(65536),
            "65536 bytes is given more than once",
        ),
        (
            "/samples/0/bytes",
            serde_json::json!(0),
            "`samples[0].bytes` 0",
        ),
        (
            "/ranks",
            serde_json::json!(u64::MAX),
            "`ranks` 18446744073709551615",
        ),
        ("/ranks", serde_json::json!(1), "`ranks` 1"),
        ("/hosts", serde_json::json!(0), "`hosts` 0"),
        ("/hosts", serde_json::json!(4), "`hosts` 4"),
        (
            "/copy_bandwidth",
            serde_json::json!(0.0),
            "`copy_bandwidth` 0.0",
        ),
        (
            "/copy_bandwidth",
            serde_json::json!(-1.0),
            "`copy_bandwidth` -1.0",
        ),
        (
            "/link/bandwidth",
            serde_json::json!(-2e9),
            "`link.bandwidth` -2000000000.0",
        ),
        (
            "/link/latency",
            serde_json::json!(-1e-6),
            "`link.latency` -1e-6",
        ),
        (
            "/predicted/0",
            serde_json::json!(-1.0),
            "`predicted[0]` -1.0",
        ),
        (
            "/transport",
            serde_json::json!("tcp"),
            "`transport` \"tcp\"",
        ),
    ] {
        let mut c = calibration_json();
        *c.pointer_mut(pointer).unwrap() = value;
        let o = simulate(&c);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{pointer}: {t}");
        assert!(
            t.contains(want) && t.contains(s(&cal)),
            "{pointer}: {want:?} in {t}"
        );
        assert!(!t.contains("panicked"), "{t}");
    }
    // One size: any line goes through it.
    let mut c = calibration_json();
    c["samples"].as_array_mut().unwrap().truncate(1);
    c["predicted"].as_array_mut().unwrap().truncate(1);
    let o = simulate(&c);
    assert!(
        text(&o).contains("`samples`: 1 buffer size; a fit needs 2 or more"),
        "{}",
        text(&o)
    );
}

#[test]
fn calibrate_refuses_sizes_it_cannot_fit_before_timing_them() {
    refused(
        &["calibrate", "--sizes", "4,4,4"],
        "--sizes 4,4,4: 4 bytes is given more than once",
    );
    // Whole f32s: 5 bytes is timed as 4.
    refused(
        &["calibrate", "--sizes", "4,5"],
        "--sizes 4,5: 4 bytes is given more than once",
    );
    refused(
        &["calibrate", "--sizes", "4096"],
        "--sizes 4096: 1 buffer size; a fit needs 2 or more",
    );
}

#[test]
fn simulate_refuses_counts_and_bandwidths_out_of_range() {
    let (_, plan) = setup("flag-ranges");
    refused(
        &[
            "simulate",
            s(&plan),
            "--profile-steps",
            "18446744073709551615",
        ],
        "18446744073709551615 is out of range: give 1 to 1000",
    );
    refused(
        &["simulate", s(&plan), "--profile-steps", "1001"],
        "1001 is out of range: give 1 to 1000",
    );
    // Finite and above 0, yet a bucket over it takes forever.
    refused(
        &["simulate", s(&plan), "--link", "inter=5e-324,0"],
        "5e-324 B/s is not a link's bandwidth",
    );
    refused(
        &["simulate", s(&plan), "--link", "intra=-1,0"],
        "-1 is not above 0",
    );
}

/// The trace file at `path` with `edit` applied to its first op span of worker 0.
fn edit_first_op_span(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let events = t["traceEvents"].as_array_mut().unwrap();
    let worker0 = events
        .iter()
        .find(|e| e["ph"] == "M" && e["args"]["name"] == "worker 0")
        .unwrap()["tid"]
        .clone();
    let op = events
        .iter_mut()
        .find(|e| e["ph"] == "X" && e["tid"] == worker0 && e["name"] == "matmul")
        .unwrap();
    edit(op);
    std::fs::write(path, t.to_string()).unwrap();
}

#[test]
fn a_trace_with_negative_times_or_of_another_model_with_the_same_ops_is_refused() {
    let (dir, plan) = setup("bad-trace");
    let model = dir.join("wide.dsl");
    let trace = dir.join("own.trace.json");
    let o = distc(&[
        "train",
        s(&model),
        "--steps",
        "3",
        "-q",
        "--trace",
        s(&trace),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let simulate = |t: &Path| distc(&["simulate", s(&plan), "--workers", "4", "--trace", s(t)]);
    assert!(simulate(&trace).status.success());
    // "scaling efficiency -109.9%"
    edit_first_op_span(&trace, |e| e["dur"] = serde_json::json!(-5000.0));
    refused(
        &["simulate", s(&plan), "--trace", s(&trace)],
        "`dur` -5000.0 is not a duration",
    );
    let o = simulate(&trace);
    assert!(text(&o).contains(s(&trace)) && text(&o).contains("(`matmul` of %"));
    edit_first_op_span(&trace, |e| e["dur"] = serde_json::json!(1e308));
    refused(
        &["simulate", s(&plan), "--trace", s(&trace)],
        "`dur` 1e308 is not a duration",
    );
    // The same model, narrower: every node has the id and the op of the plan's, but
    // not its types.
    let narrow = dir.join("narrow.dsl");
    std::fs::write(&narrow, MODEL.replace("128", "64")).unwrap();
    let other = dir.join("narrow.trace.json");
    let o = distc(&[
        "train",
        s(&narrow),
        "--steps",
        "3",
        "-q",
        "--trace",
        s(&other),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = simulate(&other);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(
        t.contains(s(&other)) && t.contains("a trace of neither this plan nor its model"),
        "{t}"
    );
    // The op named, with both shapes.
    assert!(
        t.contains("(`matmul`) is f32[16,64], f32[64,512] -> f32[16,512], the program's")
            && t.contains("f32[16,128], f32[128,512] -> f32[16,512]"),
        "{t}"
    );
    assert!(!t.contains("panicked"), "{t}");
}

/// Issue 35, item 11: `calibrate --timeout` did nothing in-process (1e-9 s timed as
/// usual) and `--workers` did nothing under MPI. The in-process ring waits at most the
/// timeout, naming the wait; `--workers` with `--transport mpi` is refused.
#[test]
fn calibrate_flags_act_or_are_refused() {
    let o = distc(&["calibrate", "--timeout", "1e-9", "--sizes", "4096,65536"]);
    // A peer that did not answer within the timeout: status 75 (EX_TEMPFAIL), what
    // `distc launch` restarts on.
    assert_eq!(o.status.code(), Some(75), "{}", text(&o));
    // Whichever rank timed out first (a race), its wait is named, not a peer's hang-up.
    let t = text(&o);
    assert!(
        t.contains("rank 0: no message from rank 1")
            || t.contains("rank 1: no message from rank 0"),
        "{t}"
    );
    let o = distc(&["calibrate", "--transport", "mpi", "--workers", "4"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        text(&o).contains("--workers 4 sizes the in-process ring"),
        "{}",
        text(&o)
    );
}

/// Issue 39, item 1: `simulate` covers a model axis and pipeline stages. A mesh of 2
/// data x 2 model: the model axis's sums are rings over its 2 workers, on the link
/// within a node when a node holds the model group, between nodes when not. A
/// pipeline of 2 stages x 4 micro-batches: the schedule run with its messages on the
/// link, each stage's replica all-reduces after its last backward, the step the last
/// stage to end, and its bubble at least the ideal (P-1)/(M+P-1).
#[test]
fn simulate_prices_the_model_axis_and_pipeline_stages() {
    let (dir, _) = setup("mesh");
    let model = dir.join("wide.dsl");
    let compile = |name: &str, mesh: &str, extra: &[&str]| {
        let plan = dir.join(name);
        let mut args = vec![
            "compile",
            s(&model),
            "--strategy",
            "allreduce",
            "--mesh",
            mesh,
            "-o",
            s(&plan),
        ];
        args.extend_from_slice(extra);
        let o = distc(&args);
        assert!(o.status.success(), "{}", text(&o));
        plan
    };
    let sim = |plan: &Path, extra: &[&str]| {
        let mut args = vec![
            "simulate",
            s(plan),
            "--profile-steps",
            "2",
            "--format",
            "json",
            "--link",
            "intra=1e12,1e-7",
            "--link",
            "inter=1e8,1e-4",
        ];
        args.extend_from_slice(extra);
        json(&distc(&args))
    };
    let mesh = compile("mesh.json", "data=2,model=2", &[]);
    let model_seconds = |j: &serde_json::Value| -> f64 {
        let ops: Vec<&serde_json::Value> = j["comms"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["how"] == "model ring")
            .collect();
        assert!(!ops.is_empty(), "no model-axis collective: {j}");
        ops.iter().map(|c| c["seconds"].as_f64().unwrap()).sum()
    };
    let inside = sim(&mesh, &["--ranks-per-node", "2"]);
    let across = sim(&mesh, &["--ranks-per-node", "1"]);
    assert!(
        model_seconds(&inside) * 10.0 < model_seconds(&across),
        "within a node {} s, across {} s",
        model_seconds(&inside),
        model_seconds(&across)
    );
    for j in [&inside, &across] {
        let eff = j["scaling_efficiency"].as_f64().unwrap();
        assert!(eff > 0.0 && eff <= 1.0 + 1e-9, "{j}");
    }

    let piped = compile(
        "pipe.json",
        "data=2,model=1,pipe=2",
        &["--micro-batches", "4"],
    );
    let j = sim(&piped, &[]);
    let p = &j["pipeline"];
    assert_eq!(
        (p["stages"].as_u64(), p["micro_batches"].as_u64()),
        (Some(2), Some(4)),
        "{j}"
    );
    let ideal = p["ideal_bubble"].as_f64().unwrap();
    assert!((ideal - 1.0 / 5.0).abs() < 1e-12, "{j}");
    assert!(p["bubble"].as_f64().unwrap() >= ideal - 1e-9, "{j}");
    let ends: Vec<f64> = p["stage_end"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_f64().unwrap())
        .collect();
    let step = j["step"].as_f64().unwrap();
    assert_eq!(ends.iter().copied().fold(0.0, f64::max), step, "{j}");
    // Messages between nodes cost more than within one.
    let msg = |j: &serde_json::Value| j["pipeline"]["activation_message"][0].as_f64().unwrap();
    let near = sim(&piped, &["--ranks-per-node", "4"]);
    assert!(msg(&near) < msg(&j), "{near} {j}");
    // Each stage's gradients are all-reduced among its 2 replicas after its backwards.
    for stage in ["s0/", "s1/"] {
        assert!(
            j["comms"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["op"] == "all_reduce" && c["node"].as_str().unwrap().starts_with(stage)),
            "{stage}: {j}"
        );
    }
    // And as a table.
    let o = distc(&["simulate", s(&piped), "--profile-steps", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("pipeline: 2 stages x 4 micro-batches"),
        "{}",
        text(&o)
    );
}

// ---------------------------------------------------------------------------------
// The layout search: `distc compile --strategy auto --workers N` without servers
// (issue 39, item 2), each candidate priced by the simulator from a profile of the
// model here, the fastest that fits the memory budget compiled.
// ---------------------------------------------------------------------------------

/// Compiles `model` with the search, `flags` added (the workers among them): the
/// plan's path, the explanation as JSON, and what the compile printed.
fn searched(
    dir: &Path,
    model: &Path,
    name: &str,
    flags: &[&str],
) -> (PathBuf, serde_json::Value, String) {
    let plan = dir.join(name);
    let mut args = vec!["compile", s(model), "--strategy", "auto", "-o", s(&plan)];
    args.extend_from_slice(flags);
    let o = distc(&args);
    assert!(o.status.success(), "{}", text(&o));
    let said = text(&o);
    let o = distc(&["explain", s(&plan), "--format", "json"]);
    assert!(o.status.success(), "{}", text(&o));
    (plan, serde_json::from_slice(&o.stdout).unwrap(), said)
}

/// [`searched`] on 4 workers, `extra` flags added: the plan's path and the
/// explanation as JSON.
fn search(dir: &Path, model: &Path, name: &str, extra: &[&str]) -> (PathBuf, serde_json::Value) {
    let mut flags = vec!["--workers", "4"];
    flags.extend_from_slice(extra);
    let (plan, j, said) = searched(dir, model, name, &flags);
    assert!(
        said.contains("auto: 4 workers, 64 samples a step: chose"),
        "{said}"
    );
    (plan, j)
}

/// `compile MODEL --strategy auto --workers 4 FLAGS`: refused with `message`.
fn refused_search(dir: &Path, model: &Path, flags: &[&str], message: &str) {
    let out = dir.join("refused.json");
    let mut args = vec!["compile", s(model), "--strategy", "auto", "--workers", "4"];
    args.extend_from_slice(flags);
    args.extend(["-o", s(&out)]);
    refused(&args, message);
}

/// `compile MODEL --strategy allreduce --workers 4 FLAGS`: refused with `message`, the
/// flags being the layout search's alone.
fn refused_without_the_search(dir: &Path, model: &Path, flags: &[&str], message: &str) {
    let out = dir.join("ar.json");
    let mut args = vec![
        "compile",
        s(model),
        "--strategy",
        "allreduce",
        "--workers",
        "4",
    ];
    args.extend_from_slice(flags);
    args.extend(["-o", s(&out)]);
    refused(&args, message);
}

/// A trace of `model` trained 5 steps on one device, at `trace`.
fn traced(model: &Path, trace: &Path) {
    let o = distc(&["train", s(model), "--steps", "5", "-q", "--trace", s(trace)]);
    assert!(o.status.success(), "{}", text(&o));
}

fn priced(c: &serde_json::Value) -> Option<(f64, u64)> {
    let p = c["verdict"].get("priced")?;
    Some((
        p["samples_per_sec"].as_f64().unwrap(),
        p["memory_per_worker"].as_u64().unwrap(),
    ))
}

#[test]
fn the_search_picks_the_fastest_layout_that_fits_and_the_plan_trains() {
    let (dir, _) = setup("search");
    let model = dir.join("wide.dsl");
    let (plan, j) = search(&dir, &model, "auto.json", &[]);
    let found = &j["search"];
    let cands = found["candidates"].as_array().unwrap();
    // Every mesh of 4 is tried: 1x1x4 ... 4x1x1.
    for (d, t, p) in [
        (4, 1, 1),
        (2, 2, 1),
        (1, 4, 1),
        (2, 1, 2),
        (1, 2, 2),
        (1, 1, 4),
    ] {
        assert!(
            cands.iter().any(
                |c| (c["data"].as_u64(), c["model"].as_u64(), c["pipe"].as_u64())
                    == (Some(d), Some(t), Some(p))
            ),
            "no candidate {d}x{t}x{p}"
        );
    }
    // Each priced one trains the same 64 samples a step.
    for c in cands.iter().filter(|c| priced(c).is_some()) {
        let samples = c["data"].as_u64().unwrap()
            * c["micro_batches"].as_u64().unwrap()
            * c["batch"].as_u64().unwrap();
        assert_eq!(samples, 64, "{c}");
    }
    let chosen = &cands[found["chosen"].as_u64().unwrap() as usize];
    let (best, best_memory) = priced(chosen).expect("the pick is priced");
    assert!(cands
        .iter()
        .filter_map(priced)
        .all(|(rate, _)| rate <= best));
    // The plan is the pick's.
    let plan_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let settings = &plan_json["settings"];
    assert_eq!(settings["model"], chosen["model"], "{settings}");
    assert_eq!(settings["pipeline"], chosen["pipe"], "{settings}");
    assert_eq!(settings["zero"], chosen["zero"], "{settings}");
    assert_eq!(plan_json["config"]["batch"], chosen["batch"]);
    let o = distc(&["run", s(&plan), "--steps", "2", "-q"]);
    assert!(o.status.success(), "{}", text(&o));
    // `explain` shows the search for people too, and `train` searches as `compile` does.
    let o = distc(&["explain", s(&plan)]);
    assert!(text(&o).contains("auto: 4 workers"), "{}", text(&o));
    let o = distc(&[
        "train",
        s(&model),
        "--strategy",
        "auto",
        "--workers",
        "4",
        "--steps",
        "1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("auto: 4 workers"), "{}", text(&o));
    // `verify` checks the layout the search picks against one device, not the
    // per-variable `auto` of servers and all-reduce.
    let verify_auto = ["verify", s(&model), "--strategy", "auto", "--workers", "4"];
    let o = distc(&[&verify_auto[..], &["--steps", "1"]].concat());
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("auto: 4 workers") && t.contains("chose data="),
        "{t}"
    );
    assert!(
        t.contains("vs one device") && !t.contains("auto with"),
        "{t}"
    );
    refused(
        &[&verify_auto[..], &["--transport", "mpi"]].concat(),
        "then verify those flags under mpirun",
    );

    // A budget below the pick's memory rejects it, and what is chosen fits.
    let budget = (best_memory as f64 - 1.0) / 1048576.0;
    let (_, j) = search(
        &dir,
        &model,
        "tight.json",
        &["--memory-per-worker", &format!("{budget}")],
    );
    let cands = j["search"]["candidates"].as_array().unwrap();
    let chosen = &cands[j["search"]["chosen"].as_u64().unwrap() as usize];
    let (_, memory) = priced(chosen).expect("the pick is priced");
    assert!((memory as f64) <= budget * 1048576.0, "{chosen}");
    assert!(
        cands.iter().any(|c| c["verdict"].get("memory").is_some()),
        "nothing was rejected for memory"
    );

    // No layout fits: the smallest need is named.
    refused_search(
        &dir,
        &model,
        &["--memory-per-worker", "0.01"],
        "the smallest needs",
    );
    // The budget belongs to the search.
    refused_without_the_search(
        &dir,
        &model,
        &["--memory-per-worker", "64"],
        "--memory-per-worker is the layout search's budget",
    );
}

/// `--op-times TRACE` (issue 39, item 1): the search prices every candidate from the
/// op times of a trace of the model on one device (a GPU's, whose ops are timed on the
/// device), not from a profile here, and says so. Products made 50 times slower in the
/// trace slow every candidate's prediction. A trace of another model, and the flag
/// without the search, are refused.
#[test]
fn the_search_takes_its_op_times_from_a_trace_of_the_model() {
    let (dir, _) = setup("op-times");
    let model = dir.join("wide.dsl");
    let trace = dir.join("one.trace.json");
    traced(&model, &trace);
    let rates = |name: &str| {
        let (_, j) = search(&dir, &model, name, &["--op-times", s(&trace)]);
        let source = j["search"]["profile"].as_str().unwrap_or("").to_string();
        assert!(
            source.contains(s(&trace)) && source.contains("each op timed by the host"),
            "{source}"
        );
        j["search"]["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| priced(c).map(|p| p.0))
            .collect::<Vec<_>>()
    };
    let fast = rates("traced.json");
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    for e in t["traceEvents"].as_array_mut().unwrap() {
        if e["ph"] == "X" && e["name"] == "matmul" {
            e["dur"] = serde_json::json!(e["dur"].as_f64().unwrap() * 50.0);
        }
    }
    std::fs::write(&trace, t.to_string()).unwrap();
    let slow = rates("slow.json");
    assert_eq!(fast.len(), slow.len());
    assert!(fast.iter().flatten().count() > 1);
    for (f, s) in fast.iter().zip(&slow) {
        if let (Some(f), Some(s)) = (f, s) {
            assert!(
                s < f,
                "{s} samples/s from the slowed trace, {f} from the trace"
            );
        }
    }
    let narrow = dir.join("narrow.dsl");
    std::fs::write(&narrow, MODEL.replace("128", "64")).unwrap();
    let other = dir.join("narrow.trace.json");
    traced(&narrow, &other);
    let auto = ["compile", s(&model), "--strategy", "auto", "--workers", "4"];
    refused(
        &[
            &auto[..],
            &["--op-times", s(&other), "-o", s(&dir.join("x.json"))],
        ]
        .concat(),
        "not a trace of the model on one device",
    );
    refused_without_the_search(
        &dir,
        &model,
        &["--op-times", s(&trace)],
        "--op-times prices the layout search's candidates",
    );
}

/// `--profile-steps N` with the search (issue 39, item 3): the search profiles N steps
/// here, the first left out, where by default it profiles 3 (and says how many). A
/// steadier profile is what `bench/planner.sh` asks for on a noisy machine. With
/// `--op-times` (no profile is run), and without the search, it is refused.
#[test]
fn the_search_profiles_as_many_steps_as_asked() {
    let (dir, _) = setup("profile-steps");
    let model = dir.join("wide.dsl");
    for (flags, says) in [
        (&[][..], "(3 steps"),
        (&["--profile-steps", "5"][..], "(5 steps"),
    ] {
        let (_, j) = search(&dir, &model, "steps.json", flags);
        let source = j["search"]["profile"].as_str().unwrap_or("");
        assert!(source.contains(says), "{flags:?}: {source}");
    }
    refused_search(
        &dir,
        &model,
        &[
            "--profile-steps",
            "5",
            "--op-times",
            s(&dir.join("any.trace.json")),
        ],
        "--op-times takes the op times from a trace",
    );
    refused_without_the_search(
        &dir,
        &model,
        &["--profile-steps", "5"],
        "--profile-steps sets the layout search's profile",
    );
}

/// `--calibration inter=FILE` with the search (issue 39, item 1): the candidates are
/// priced on the calibrated link as `distc simulate --calibration` prices a plan, so
/// with the op times of one trace the pick's predicted step is the one `simulate`
/// predicts for that layout's plan (data=4, whose batch is the traced one's: `simulate`
/// takes a trace at the plan's batch). The flag without the search is refused.
#[test]
fn the_search_prices_a_calibrated_link_as_simulate_does() {
    let (dir, _) = setup("search-calibrated");
    let model = dir.join("wide.dsl");
    let trace = dir.join("one.trace.json");
    traced(&model, &trace);
    let cal = dir.join("cal.json");
    let o = distc(&[
        "calibrate",
        "--workers",
        "2",
        "--sizes",
        "4096,65536,1048576",
        "--reps",
        "2",
        "-o",
        s(&cal),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let calibration = format!("inter={}", s(&cal));
    let (_, j) = search(
        &dir,
        &model,
        "calibrated.json",
        &["--op-times", s(&trace), "--calibration", &calibration],
    );
    let data4 = j["search"]["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["data"] == 4 && c["zero"] == 0 && c["remat"] == false)
        .expect("the data=4 layout")
        .clone();
    let predicted = data4["verdict"]["priced"]["step"].as_f64().unwrap();
    let plan = dir.join("data4.json");
    let o = distc(&[
        "compile",
        s(&model),
        "--strategy",
        "allreduce",
        "--workers",
        "4",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&[
        "simulate",
        s(&plan),
        "--trace",
        s(&trace),
        "--calibration",
        &calibration,
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let simulated: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let step = simulated["step"].as_f64().unwrap();
    assert!(
        (step - predicted).abs() <= 1e-9 * step,
        "the search predicted {predicted} s for {data4}, simulate {step} s"
    );
    // In nodes (and with a ZeRO stage given): the one-device profile has neither, and
    // a mesh is priced on the nodes, compiled without them (the runtime groups no
    // mesh by node), so its plan runs. Both were refused before.
    let (plan, j) = search(
        &dir,
        &model,
        "nodes.json",
        &[
            "--op-times",
            s(&trace),
            "--ranks-per-node",
            "2",
            "--zero",
            "1",
        ],
    );
    let cands = j["search"]["candidates"].as_array().unwrap();
    assert!(
        cands
            .iter()
            .any(|c| c["model"] == 2 && c["verdict"].get("priced").is_some()),
        "no mesh priced in nodes: {cands:?}"
    );
    let o = distc(&["run", s(&plan), "--steps", "1", "-q"]);
    assert!(o.status.success(), "{}", text(&o));
    refused_without_the_search(
        &dir,
        &model,
        &["--calibration", &calibration],
        "--calibration prices the layout search's candidates",
    );
}

/// `--search-precision fp32,bf16` (issue 39, item 2): the search prices every layout
/// in each precision, from a profile of each on this machine. Under a budget that
/// only layouts with 16-bit activations fit (a large batch: activations outweigh the
/// variables), the pick is a bf16 layout, the fastest of those that fit, and its plan
/// trains in bf16. Without the flag the precision is the user's, and the flag without
/// the search is refused.
#[test]
fn the_search_chooses_the_precision_among_those_listed() {
    let (dir, _) = setup("precision");
    let model = dir.join("wide.dsl");
    let search = |name: &str, extra: &[&str]| {
        let mut flags = vec!["--workers", "2", "--batch", "4096"];
        flags.extend_from_slice(extra);
        let (plan, j, _) = searched(&dir, &model, name, &flags);
        (plan, j)
    };
    let (_, j) = search("both.json", &["--search-precision", "fp32,bf16"]);
    let cands = j["search"]["candidates"]
        .as_array()
        .expect("candidates")
        .clone();
    let layout = |c: &serde_json::Value| {
        format!(
            "{} {} {} {} {} {}",
            c["data"], c["model"], c["pipe"], c["micro_batches"], c["zero"], c["remat"]
        )
    };
    // Every layout in both precisions.
    let of = |p: &str| -> Vec<String> {
        let mut v: Vec<String> = cands
            .iter()
            .filter(|c| c["precision"] == p)
            .map(layout)
            .collect();
        v.sort();
        v
    };
    assert!(!of("fp32").is_empty());
    assert_eq!(of("fp32"), of("bf16"));
    let profile = j["search"]["profile"].as_str().unwrap_or("");
    assert!(
        profile.contains("fp32:") && profile.contains("bf16:"),
        "{profile}"
    );
    // The least memory each precision needs; a budget of bf16's least, which no fp32
    // layout fits.
    let least = |p: &str| {
        cands
            .iter()
            .filter(|c| c["precision"] == p)
            .filter_map(priced)
            .map(|(_, mem)| mem)
            .min()
            .expect("a priced layout")
    };
    let (fp32, bf16) = (least("fp32"), least("bf16"));
    assert!(bf16 < fp32, "bf16 needs {bf16} B at least, fp32 {fp32} B");
    let mib = format!("{}", (bf16 as f64 + 0.5) / 1048576.0);
    let (plan, j) = search(
        "tight.json",
        &[
            "--search-precision",
            "fp32,bf16",
            "--memory-per-worker",
            &mib,
        ],
    );
    let cands = j["search"]["candidates"].as_array().expect("candidates");
    let chosen = &cands[j["search"]["chosen"].as_u64().expect("chosen") as usize];
    assert_eq!(chosen["precision"], "bf16", "{chosen}");
    let (best, _) = priced(chosen).expect("the pick is priced");
    assert!(cands
        .iter()
        .filter_map(priced)
        .all(|(rate, _)| rate <= best));
    assert!(cands
        .iter()
        .filter(|c| c["precision"] == "fp32")
        .all(|c| priced(c).is_none()));
    let plan_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).expect("plan")).expect("json");
    assert_eq!(plan_json["settings"]["precision"], "bf16");
    let o = distc(&["run", s(&plan), "--steps", "2", "-q"]);
    assert!(o.status.success(), "{}", text(&o));
    // Without the flag, the user's precision only.
    let (_, j) = search("user.json", &["--precision", "bf16"]);
    let cands = j["search"]["candidates"].as_array().expect("candidates");
    assert!(cands.iter().all(|c| c["precision"] == "bf16"));
    refused(
        &[
            "compile",
            s(&model),
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--search-precision",
            "bf16",
            "-o",
            s(&dir.join("refused.json")),
        ],
        "--search-precision lists the precisions",
    );
}
