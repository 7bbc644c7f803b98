//! `distc compile --strategy auto --workers N` without servers (issue 39, item 2): the
//! layout search over data x model x pipe meshes, micro-batches, ZeRO and remat, each
//! candidate priced by the simulator from a profile of the model here, and the
//! fastest that fits the memory budget compiled.
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
  param w3: f32[512, 16] = glorot
  minimize softmax_cross_entropy(relu(relu(x @ w1 + b1) @ w2) @ w3, label)
}
train {
  data = gaussian_classes(features = 128, classes = 16)
  batch = 16
  optimizer = adam(lr = 0.01)
  steps = 4
  seed = 3
}
";

fn model(label: &str) -> (PathBuf, PathBuf) {
    let dir = temp_dir("planner").join(label);
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("wide.dsl");
    std::fs::write(&model, MODEL).unwrap();
    (dir, model)
}

/// Compiles `model` with the search, `extra` flags added: the plan's path and the
/// explanation as JSON.
fn search(dir: &Path, model: &Path, name: &str, extra: &[&str]) -> (PathBuf, serde_json::Value) {
    let plan = dir.join(name);
    let mut args = vec![
        "compile",
        s(model),
        "--strategy",
        "auto",
        "--workers",
        "4",
        "-o",
        s(&plan),
    ];
    args.extend_from_slice(extra);
    let o = distc(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("auto: 4 workers, 64 samples a step: chose"),
        "{}",
        text(&o)
    );
    let o = distc(&["explain", s(&plan), "--format", "json"]);
    assert!(o.status.success(), "{}", text(&o));
    (plan, serde_json::from_slice(&o.stdout).unwrap())
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
    let (dir, model) = model("pick");
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
    refused(
        &[
            "compile",
            s(&model),
            "--strategy",
            "auto",
            "--workers",
            "4",
            "--memory-per-worker",
            "0.01",
            "-o",
            s(&dir.join("none.json")),
        ],
        "the smallest needs",
    );
    // The budget belongs to the search.
    refused(
        &[
            "compile",
            s(&model),
            "--strategy",
            "allreduce",
            "--workers",
            "4",
            "--memory-per-worker",
            "64",
            "-o",
            s(&dir.join("ar.json")),
        ],
        "--memory-per-worker is the layout search's budget",
    );
}
