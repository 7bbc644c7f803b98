//! Frozen variables (issue 36, item 5): `param w: ... frozen` is held as it starts (its
//! initializer or `--init`'s value) in every layout: no gradient, no optimizer state,
//! no communication, and `explain` says so.

use distc_runtime::core::checkpoint;
use std::collections::HashMap;
use std::path::Path;

mod common;

use common::{distc, max_difference, s, text};

const MODEL: &str = "model fr {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
    param emb: f32[8, 16] = glorot frozen\n  param w: f32[16, 4] = glorot\n  \
    param b: f32[4] = zeros\n  h = tanh(x @ emb)\n  pipeline_stage\n  \
    frozen = h @ w\n  minimize softmax_cross_entropy(frozen + b, label)\n}\n\
    train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 8\n  \
    optimizer = adam(lr = 0.05)\n  steps = 6\n  seed = 3\n}\n";

fn weights(path: &Path) -> HashMap<String, Vec<f64>> {
    checkpoint::load(path)
        .expect("loads")
        .0
        .into_iter()
        .map(|(k, v)| (k, v.to_f64_vec()))
        .collect()
}

#[test]
fn a_frozen_variable_keeps_its_value_in_every_layout_and_costs_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("fr.dsl");
    std::fs::write(&m, MODEL).expect("writes");
    let (start, trained) = (
        dir.path().join("start.safetensors"),
        dir.path().join("trained.safetensors"),
    );
    let o = distc(&["train", s(&m), "-q", "--steps", "1", "--save", s(&start)]);
    assert!(o.status.success(), "{}", text(&o));
    let first = weights(&start);
    for (what, flags) in [
        ("one device", vec![]),
        (
            "allreduce",
            vec!["--strategy", "allreduce", "--workers", "2"],
        ),
        (
            "hybrid",
            vec!["--strategy", "hybrid", "--workers", "2", "--servers", "1"],
        ),
        (
            "ps",
            vec!["--strategy", "ps", "--workers", "2", "--servers", "1"],
        ),
        (
            "zero 3",
            vec!["--strategy", "allreduce", "--workers", "2", "--zero", "3"],
        ),
        ("pipeline", vec!["--pipeline", "2", "--micro-batches", "2"]),
    ] {
        let mut args = vec!["train", s(&m), "-q", "--save", s(&trained)];
        args.extend(flags.iter().copied());
        let o = distc(&args);
        assert!(o.status.success(), "{what}: {}", text(&o));
        let after = weights(&trained);
        assert_eq!(
            after["emb"], first["emb"],
            "{what}: the frozen variable moved"
        );
        assert_ne!(
            after["w"], first["w"],
            "{what}: the trained variable did not move"
        );
        if !flags.is_empty() {
            let mut v = vec!["verify", s(&m)];
            v.extend(flags.iter().copied());
            let o = distc(&v);
            assert!(o.status.success(), "{what}: {}", text(&o));
        }
    }
    // No traffic: the predicted bytes are the trained variables' alone, and explain
    // names it.
    let plan = dir.path().join("p.plan.json");
    let o = distc(&[
        "compile",
        s(&m),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&["explain", s(&plan)]);
    let t = text(&o);
    assert!(
        t.contains("frozen (held as they start") && t.contains(": emb"),
        "{t}"
    );
    assert!(!t.contains("no gradient reaches"), "{t}");
    let o = distc(&["explain", s(&plan), "--format", "json"]);
    let j: serde_json::Value =
        serde_json::from_str(&String::from_utf8_lossy(&o.stdout)).expect("json");
    assert_eq!(j["frozen"], serde_json::json!(["emb"]));
    let trained_bytes = (16 * 4 + 4) * 4;
    assert_eq!(
        j["predicted_bytes_per_step_per_worker"]
            .as_f64()
            .expect("bytes"),
        f64::from(trained_bytes)
    );
}

#[test]
fn a_frozen_variable_has_no_optimizer_state_resumes_and_takes_init_weights() {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("fr.dsl");
    std::fs::write(&m, MODEL).expect("writes");
    let state = dir.path().join("state.safetensors");
    let (whole, resumed) = (
        dir.path().join("whole.safetensors"),
        dir.path().join("resumed.safetensors"),
    );
    let o = distc(&["train", s(&m), "-q", "--save", s(&whole)]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&[
        "train",
        s(&m),
        "-q",
        "--steps",
        "3",
        "--checkpoint",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let st = checkpoint::load_state(&state).expect("a state");
    assert!(
        st.optimizer.contains_key("w/m"),
        "{:?}",
        st.index.optimizer_state
    );
    assert!(
        !st.optimizer.keys().any(|k| k.starts_with("emb/")),
        "{:?}",
        st.index.optimizer_state
    );
    let o = distc(&[
        "train",
        s(&m),
        "-q",
        "--resume",
        s(&state),
        "--save",
        s(&resumed),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(max_difference(&whole, &resumed), 0.0);
    // Pretrained weights for the frozen variable, through --init: kept as given.
    let mut w: HashMap<String, distc_runtime::Tensor> = checkpoint::load(&whole).expect("loads").0;
    let emb = w["emb"].as_f32().expect("f32").mapv(|x| x * 2.0 + 1.0);
    w.insert("emb".into(), distc_runtime::Tensor::F32(emb));
    let mut named: Vec<(String, &distc_runtime::Tensor)> =
        w.iter().map(|(k, v)| (k.clone(), v)).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let init = dir.path().join("init.safetensors");
    checkpoint::save(&init, &named, HashMap::new()).expect("saves");
    let out = dir.path().join("out.safetensors");
    let o = distc(&["train", s(&m), "-q", "--init", s(&init), "--save", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(weights(&out)["emb"], weights(&init)["emb"]);
}
