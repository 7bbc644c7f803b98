//! Weights in (issue 36, item 2): `--init FILE.safetensors` starts a run from a file's
//! weights, by name, with shapes checked and unmatched names listed. A file holding
//! the model's own initial values trains bitwise what a run without it trains, in
//! every layout (one device, parameter servers, ZeRO 3, a pipeline), with Adam's
//! fresh state; a file written by PyTorch loads when PyTorch is installed
//! (scripts/install-pytorch.sh), and one written here otherwise.

use distc_runtime::core::checkpoint;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

mod common;

use common::{distc, max_difference, root, s, text};

const MODEL: &str = "model small {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
    param w1: f32[8, 16] = glorot\n  param b1: f32[16] = zeros\n  \
    param w2: f32[16, 4] = glorot\n  param b2: f32[4] = zeros\n  \
    h = tanh(x @ w1 + b1)\n  pipeline_stage\n  \
    minimize softmax_cross_entropy(h @ w2 + b2, label)\n}\n\
    train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 8\n  \
    optimizer = adam(lr = 0.01)\n  steps = 4\n  seed = 9\n}\n";

fn setup() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let m = dir.path().join("small.dsl");
    std::fs::write(&m, MODEL).expect("writes");
    (dir, m)
}

/// The model's own initial values (as a run without --init starts from), by name.
fn initial_values(m: &Path) -> HashMap<String, distc_runtime::Tensor> {
    let c = distc::compile_file(m, &distc::CompileOptions::default()).expect("compiles");
    distc_runtime::run::state::whole_variables(&c.programs(1), c.config.seed)
        .expect("variables")
        .into_iter()
        .collect()
}

fn save(path: &Path, values: &HashMap<String, distc_runtime::Tensor>) {
    let mut named: Vec<(String, &distc_runtime::Tensor)> =
        values.iter().map(|(k, v)| (k.clone(), v)).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    checkpoint::save(path, &named, HashMap::new()).expect("saves");
}

/// Regression (issue 37, found by bench/pytorch/parity.py): a run under AdamW refused
/// its own `--init` ("saved by optimizer adam ... trains with adamw") and the training
/// state it checkpointed: the state's optimizer kind did not know AdamW.
#[test]
fn adamw_runs_start_from_init_and_resume_their_own_state() {
    let (dir, _) = setup();
    let m = dir.path().join("small_adamw.dsl");
    std::fs::write(
        &m,
        MODEL.replace("adam(lr = 0.01)", "adamw(lr = 0.01, weight_decay = 0.1)"),
    )
    .expect("writes");
    let init = dir.path().join("init.safetensors");
    save(&init, &initial_values(&m));
    let (a, b, state) = (
        dir.path().join("a.safetensors"),
        dir.path().join("b.safetensors"),
        dir.path().join("state.ckpt"),
    );
    let o = distc(&["train", s(&m), "-q", "--save", s(&a)]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&["train", s(&m), "-q", "--init", s(&init), "--save", s(&b)]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(max_difference(&a, &b), 0.0);
    let o = distc(&[
        "train",
        s(&m),
        "-q",
        "--steps",
        "2",
        "--checkpoint",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&["train", s(&m), "-q", "--resume", s(&state), "--save", s(&b)]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(max_difference(&a, &b), 0.0, "2 steps, then 2 resumed");
}

#[test]
fn the_models_own_initial_values_train_bitwise_in_every_layout() {
    let (dir, m) = setup();
    let init = dir.path().join("init.safetensors");
    save(&init, &initial_values(&m));
    for (what, flags) in [
        ("one device", vec![]),
        (
            "hybrid",
            vec!["--strategy", "hybrid", "--workers", "2", "--servers", "1"],
        ),
        (
            "zero 3",
            vec!["--strategy", "allreduce", "--workers", "2", "--zero", "3"],
        ),
        ("pipeline", vec!["--pipeline", "2", "--micro-batches", "2"]),
    ] {
        let plan = dir.path().join("p.plan.json");
        let mut args = vec!["compile", s(&m), "-o", s(&plan)];
        args.extend(flags.iter().copied());
        let o = distc(&args);
        assert!(o.status.success(), "{what}: {}", text(&o));
        let (a, b) = (
            dir.path().join("a.safetensors"),
            dir.path().join("b.safetensors"),
        );
        let o = distc(&["run", s(&plan), "-q", "--save", s(&a)]);
        assert!(o.status.success(), "{what}: {}", text(&o));
        let o = distc(&["run", s(&plan), "--init", s(&init), "--save", s(&b)]);
        assert!(o.status.success(), "{what}: {}", text(&o));
        assert!(
            text(&o).contains("4 of 4 variables set"),
            "{what}: {}",
            text(&o)
        );
        assert_eq!(max_difference(&a, &b), 0.0, "{what}");
    }
}

#[test]
fn the_files_weights_are_the_ones_trained_and_mismatches_are_named() {
    let (dir, m) = setup();
    let metrics = dir.path().join("m.jsonl");
    let first_loss = |args: &[&str]| -> f64 {
        let mut a = vec![
            "train",
            s(&m),
            "-q",
            "--steps",
            "1",
            "--metrics",
            s(&metrics),
        ];
        a.extend_from_slice(args);
        let o = distc(&a);
        assert!(o.status.success(), "{}", text(&o));
        let line = std::fs::read_to_string(&metrics).expect("metrics");
        let v: serde_json::Value =
            serde_json::from_str(line.lines().next().expect("a line")).expect("json");
        v["loss"].as_f64().expect("loss")
    };
    // All-zero weights make every logit 0: the first loss is ln 4 exactly, which the
    // model's own initial weights are not.
    let zeros: HashMap<String, distc_runtime::Tensor> = initial_values(&m)
        .into_iter()
        .map(|(k, v)| (k, distc_runtime::Tensor::zeros(&v.tensor_type())))
        .collect();
    let zero_file = dir.path().join("zeros.safetensors");
    save(&zero_file, &zeros);
    let ln4 = 4f64.ln();
    assert!((first_loss(&[]) - ln4).abs() > 1e-3);
    let from_zeros = first_loss(&["--init", s(&zero_file)]);
    assert!(
        (from_zeros - ln4).abs() < 1e-6,
        "from zero weights: {from_zeros}"
    );

    // A shape that differs names the variable and both shapes.
    let mut values = initial_values(&m);
    values.insert(
        "w2".into(),
        distc_runtime::Tensor::zeros(&distc_ir::TensorType::new(
            distc_ir::DType::F32,
            vec![16, 5],
        )),
    );
    let bad = dir.path().join("bad.safetensors");
    save(&bad, &values);
    let o = distc(&["train", s(&m), "--init", s(&bad)]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("`w2` has shape [16, 5]") && text(&o).contains("f32[16,4]"),
        "{}",
        text(&o)
    );

    // Names on either side without a match: an error, listed; --init-partial runs.
    let mut values = initial_values(&m);
    values.remove("b2");
    values.insert("head.weight".into(), values["w2"].clone());
    let partial = dir.path().join("partial.safetensors");
    save(&partial, &values);
    let o = distc(&["train", s(&m), "--init", s(&partial)]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("b2") && text(&o).contains("head.weight"),
        "{}",
        text(&o)
    );
    let o = distc(&[
        "train",
        s(&m),
        "--init",
        s(&partial),
        "--init-partial",
        "--steps",
        "2",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("keeping their initializer: b2")
            && text(&o).contains("not in the model: head.weight"),
        "{}",
        text(&o)
    );
    let o = distc(&[
        "train",
        s(&m),
        "--init",
        s(&dir.path().join("none.safetensors")),
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("none.safetensors"), "{}", text(&o));
}

/// Issue 67, item 2: `--init` reaches a model axis's parts, as `--resume` does. The
/// internal part names (`w1.tp`) were asked of the file; `--init-partial` then left
/// the split layers at their initializer; ZeRO with a model axis failed on a slot's
/// size. Every layout trains from the file what one device trains from it, whether
/// the file names every variable or (`--init-partial`) all but one; a file of which
/// `--init-partial` would take nothing is an error.
#[test]
fn init_reaches_a_model_axis_and_a_file_of_no_variable_is_refused() {
    let (dir, m) = setup();
    // Weights of the file's own, not the model's initial values: a layer left at its
    // initializer shows.
    let values: HashMap<String, distc_runtime::Tensor> = initial_values(&m)
        .into_iter()
        .map(|(k, v)| {
            let ty = v.tensor_type();
            let shifted: Vec<f32> = v
                .to_f64_vec()
                .iter()
                .enumerate()
                .map(|(i, x)| (x + 0.05 * ((i % 7) as f64 - 3.0)) as f32)
                .collect();
            let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(ty.dims()), shifted)
                .expect("a shape");
            (k, distc_runtime::Tensor::F32(a))
        })
        .collect();
    let full = dir.path().join("full.safetensors");
    save(&full, &values);
    let mut partial_values = values.clone();
    partial_values.remove("b2");
    let partial = dir.path().join("partial.safetensors");
    save(&partial, &partial_values);
    let trained = |flags: &[&str], file: &Path, out: &Path| {
        let mut args = vec![
            "train",
            s(&m),
            "--steps",
            "2",
            "--init",
            s(file),
            "--save",
            s(out),
        ];
        if file == partial.as_path() {
            args.push("--init-partial");
        }
        args.extend_from_slice(flags);
        let o = distc(&args);
        assert!(o.status.success(), "{flags:?}: {}", text(&o));
        text(&o)
    };
    for file in [&full, &partial] {
        // One device with the layout's global batch.
        for (flags, batch) in [
            (&["--mesh", "data=1,model=2"][..], "8"),
            (&["--mesh", "data=2,model=2", "--zero", "1"][..], "16"),
        ] {
            let one = dir.path().join("one.safetensors");
            trained(&["--batch", batch], file, &one);
            let got = dir.path().join("mesh.safetensors");
            let said = trained(flags, file, &got);
            assert!(!said.contains(".tp"), "{flags:?}: part names: {said}");
            let d = max_difference(&one, &got);
            assert!(
                d < 1e-5,
                "{flags:?} from {}: {d} from one device",
                file.display()
            );
        }
    }
    // Nothing of the file is a variable of the model.
    let mut other = HashMap::new();
    other.insert("head.weight".to_string(), values["w2"].clone());
    let none = dir.path().join("other.safetensors");
    save(&none, &other);
    let o = distc(&["train", s(&m), "--init", s(&none), "--init-partial"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("none of the file's 1 tensor(s) is a variable of the model")
            && text(&o).contains("other.safetensors"),
        "{}",
        text(&o)
    );
}

/// Issue 60, item 7: an f64 `1e300` is finite in the file but not as the model's f32,
/// and is refused by name; a PyTorch state's I64 `num_batches_tracked` (a dtype no
/// variable has) is one more unused tensor: refused without `--init-partial`, ignored
/// with it, and named where a variable of the model has its name.
#[test]
fn values_beyond_f32_and_tensors_of_other_dtypes_are_told_apart() {
    let (dir, m) = setup();
    type Named = Vec<(String, Vec<u8>, Vec<usize>, safetensors::Dtype)>;
    let write = |path: &Path, named: &Named| {
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = named
            .iter()
            .map(|(n, b, shape, d)| {
                (
                    n.as_str(),
                    safetensors::tensor::TensorView::new(*d, shape.clone(), b).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).expect("writes");
    };
    // One step from the weights at `path`, with --init-partial where `partial`.
    let train = |path: &Path, partial: bool| {
        let mut args = vec!["train", s(&m), "--init", s(path), "--steps", "1"];
        if partial {
            args.push("--init-partial");
        }
        distc(&args)
    };
    // The model's own values, in f32.
    let mut named: Named = initial_values(&m)
        .iter()
        .map(|(k, t)| {
            let bytes = t
                .to_f64_vec()
                .iter()
                .flat_map(|v| (*v as f32).to_le_bytes())
                .collect();
            (
                k.clone(),
                bytes,
                t.shape().to_vec(),
                safetensors::Dtype::F32,
            )
        })
        .collect();
    let mut huge = named.clone();
    for (_, b, shape, d) in huge.iter_mut().filter(|(n, ..)| n == "b1") {
        let mut v = vec![0.0f64; shape.iter().product()];
        v[3] = 1e300;
        *b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        *d = safetensors::Dtype::F64;
    }
    let path = dir.path().join("huge.safetensors");
    write(&path, &huge);
    let o = train(&path, false);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("`b1` holds values beyond the range of f32"),
        "{}",
        text(&o)
    );
    named.push((
        "bn.num_batches_tracked".into(),
        7i64.to_le_bytes().to_vec(),
        vec![],
        safetensors::Dtype::I64,
    ));
    let torch = dir.path().join("torch.safetensors");
    write(&torch, &named);
    let o = train(&torch, false);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("bn.num_batches_tracked"), "{}", text(&o));
    let o = train(&torch, true);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("not in the model: bn.num_batches_tracked"),
        "{}",
        text(&o)
    );
    // A variable's own name on an I64 tensor: named, with both types.
    let last = named.len() - 1;
    named[last].0 = "b2".into();
    named.retain(|(n, _, _, d)| n != "b2" || *d == safetensors::Dtype::I64);
    write(&torch, &named);
    let o = train(&torch, true);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("`b2` is I64 in the file") && text(&o).contains("f32[4]"),
        "{}",
        text(&o)
    );
}

/// PyTorch's tensors, written with `safetensors.torch.save_file` (or, without that
/// package, in the safetensors layout by hand from the tensors' bytes), load by name.
#[test]
fn weights_written_by_pytorch_load() {
    let python = root().join(".venv-bench/bin/python");
    let has_torch = python.exists()
        && std::process::Command::new(&python)
            .args(["-c", "import torch"])
            .status()
            .is_ok_and(|s| s.success());
    if !has_torch {
        println!("skipping the PyTorch writer: PyTorch is not installed (scripts/install-pytorch.sh); the Rust writer's files are tested above");
        return;
    }
    let (dir, m) = setup();
    let out = dir.path().join("torch.safetensors");
    let script = r#"
import json, struct, sys, torch
torch.manual_seed(0)
t = {"w1": torch.randn(8, 16), "b1": torch.zeros(16), "w2": torch.randn(16, 4), "b2": torch.zeros(4)}
try:
    from safetensors.torch import save_file
    save_file(t, sys.argv[1])
except ImportError:
    header, blobs, at = {}, [], 0
    for k, v in t.items():
        b = v.contiguous().numpy().tobytes()
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b); at += len(b)
    h = json.dumps(header).encode(); h += b" " * (-len(h) % 8)
    open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
print(float(t["w1"][0, 0]))
"#;
    let o = std::process::Command::new(&python)
        .args(["-c", script, s(&out)])
        .output()
        .expect("python runs");
    assert!(o.status.success(), "{}", text(&o));
    let w10: f32 = String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .expect("a number");
    let (weights, _) = checkpoint::load(&out).expect("loads");
    assert_eq!(weights["w1"].to_f64_vec()[0] as f32, w10);
    let o = distc(&["train", s(&m), "--init", s(&out), "--steps", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("4 of 4 variables set"), "{}", text(&o));
}

#[test]
fn verify_starts_both_sides_from_the_file() {
    let (dir, m) = setup();
    // Weights far from the model's own: both sides must start from them to agree.
    let scaled: HashMap<String, distc_runtime::Tensor> = initial_values(&m)
        .into_iter()
        .map(|(k, v)| {
            let t = distc_runtime::Tensor::F32(v.as_f32().expect("f32").mapv(|x| 3.0 * x + 0.25));
            (k, t)
        })
        .collect();
    let w = dir.path().join("w.safetensors");
    let verify = || {
        distc(&[
            "verify",
            s(&m),
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--init",
            s(&w),
        ])
    };
    save(&w, &scaled);
    let o = verify();
    assert!(o.status.success(), "{}", text(&o));
    let mut partial = scaled.clone();
    partial.remove("b1");
    save(&w, &partial);
    let o = verify();
    assert!(!o.status.success());
    assert!(text(&o).contains("b1"), "{}", text(&o));
}
