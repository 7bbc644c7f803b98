//! `distc verify` judged against f32's rounding floor (issue 67, item 6): an f32 layout
//! passes when it is no farther from one device in float64 than one device in f32 is;
//! a variable whose f32 value is only rounding (a key bias before a softmax) is named
//! and never the verdict; each step's gradient norm is compared too, so a uniform
//! scale of the gradient that AdamW and clipping hide from the weights still fails;
//! and `--dtype f64` runs every data-parallel, ZeRO, model-axis and pipeline layout.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::{distc, root, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("verify-floor").join(name)
}

/// Attention with a key bias (GPT-2's and BERT's `c_attn` has one): every query's
/// scores move together with it, so the softmax cancels its gradient, which is zero
/// but for rounding. AdamW, clipping at 1.
fn key_bias_model(path: &Path) -> PathBuf {
    let src = "model kb {
  input x: f32[B, 32]
  input label: i32[B]
  param wq: f32[8, 8] = glorot
  param wk: f32[8, 8] = glorot
  param bk: f32[8] = zeros
  param wv: f32[8, 8] = glorot
  param w1: f32[32, 32] = glorot
  param w2: f32[32, 4] = glorot
  h = reshape(x, [B, 4, 8])
  q = reshape(h @ wq, [B, 1, 4, 8])
  k = reshape(h @ wk + bk, [B, 1, 4, 8])
  v = reshape(h @ wv, [B, 1, 4, 8])
  y = reshape(attention(q, k, v), [B, 32])
  minimize softmax_cross_entropy(tanh(y @ w1) @ w2, label)
}
train {
  data = gaussian_classes(features = 32, classes = 4)
  batch = 8
  optimizer = adamw(lr = 0.01, weight_decay = 0.1)
  clip_norm = 1.0
  steps = 3
  seed = 1
}
";
    std::fs::write(path, src).expect("writes the model");
    path.to_path_buf()
}

fn verify(model: &Path, args: &[&str], planted: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_distc"));
    cmd.arg("verify")
        .arg(model)
        .args(args)
        .current_dir(root())
        .env_remove("DISTC_PLANTED_BUG");
    if let Some(bug) = planted {
        cmd.env("DISTC_PLANTED_BUG", bug);
    }
    cmd.output().expect("runs")
}

#[test]
fn a_key_bias_is_named_noise_and_never_the_verdict() {
    let model = key_bias_model(&tmp("kb.dsl"));
    let o = verify(
        &model,
        &["--strategy", "allreduce", "--workers", "2", "--steps", "5"],
        None,
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    let bk = t
        .lines()
        .find(|l| l.trim_start().starts_with("bk "))
        .expect("a line for bk");
    assert!(bk.contains("noise"), "{t}");
    assert!(
        t.contains("only rounding noise in f32, not judged: bk"),
        "{t}"
    );
    // Every other variable is judged: none is called noise.
    let noise = t.lines().filter(|l| l.contains("; noise:")).count();
    assert_eq!(noise, 1, "{t}");
    // The bias's f32 value is mostly rounding: one device's own f32 run is farther from
    // float64 than half the bias's size, which a plain tolerance calls a failure.
    let o = verify(
        &model,
        &[
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--steps",
            "5",
            "--tolerance",
            "1e-4",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("`bk` differs by"), "{}", text(&o));
}

#[test]
fn verify_fails_on_each_planted_bug_and_passes_without_it() {
    let model = key_bias_model(&tmp("planted.dsl"));
    // Each bug with the layout it lives in; the first two scale the whole gradient,
    // which AdamW with clipping hides from the weights: the gradient norm shows them.
    let cases: [(&str, &[&str], &str); 3] = [
        (
            "allreduce-mean",
            &["--strategy", "allreduce", "--workers", "2"],
            "`(grad norm)`",
        ),
        (
            "micro-batch-scale",
            &[
                "--strategy",
                "allreduce",
                "--workers",
                "2",
                "--accumulate",
                "2",
            ],
            "`(grad norm)`",
        ),
        (
            "zero-slot",
            &["--strategy", "allreduce", "--workers", "2", "--zero", "1"],
            "from one device in float64",
        ),
    ];
    for (bug, layout, names) in cases {
        let o = verify(&model, layout, None);
        assert_eq!(o.status.code(), Some(0), "{bug}, not planted: {}", text(&o));
        let o = verify(&model, layout, Some(bug));
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{bug}: {t}");
        assert!(t.contains("more than f32's rounding"), "{bug}: {t}");
        assert!(t.contains(names), "{bug}: {t}");
        assert!(t.contains("this run has a bug planted"), "{bug}: {t}");
    }
}

#[test]
fn a_float64_copy_runs_every_layout_on_the_cpu() {
    // Without the key bias: in float64 too its gradient is rounding (about 1e-17),
    // which Adam makes steps of; it has no finer reference to be judged against.
    let model = key_bias_model(&tmp("f64-kb.dsl"));
    let src = std::fs::read_to_string(&model)
        .expect("model")
        .replace("  param bk: f32[8] = zeros\n", "")
        .replace(" + bk", "");
    let model = tmp("f64.dsl");
    std::fs::write(&model, src).expect("writes");
    for layout in [
        &["--strategy", "allreduce", "--workers", "3"][..],
        &["--strategy", "allreduce", "--workers", "2", "--zero", "3"],
        &[
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--zero",
            "2",
            "--accumulate",
            "2",
        ],
        &["--mesh", "data=2,model=2"],
        &["--pipeline", "2", "--micro-batches", "2"],
    ] {
        let mut args = layout.to_vec();
        args.extend(["--dtype", "f64", "--tolerance", "1e-10"]);
        let o = verify(&model, &args, None);
        assert_eq!(o.status.code(), Some(0), "{layout:?}: {}", text(&o));
    }
    // Parameter servers hold float64 shards too: dense pulls and pushes of every
    // variable, and an embedding's sparse pulls and pushes, its rows split over two
    // servers, under Adam, which moves the rows no batch touched (servers update their
    // rows themselves, so no clipping there).
    let served = tmp("f64-ps.dsl");
    let src = std::fs::read_to_string(&model)
        .expect("model")
        .replace("  clip_norm = 1.0\n", "");
    std::fs::write(&served, src).expect("writes");
    let embedding = tmp("f64-emb.dsl");
    std::fs::write(
        &embedding,
        "model sp {
  input ids: i32[B, 4]
  input label: i32[B]
  param emb: f32[131072, 16] = uniform(-0.05, 0.05)
  param w1: f32[64, 32] = glorot
  param w2: f32[32, 10] = glorot
  x = reshape(embedding(emb, ids), [B, 64])
  minimize softmax_cross_entropy(tanh(x @ w1) @ w2, label)
}
train {
  data = zipf_tokens(vocab = 131072, context = 4, classes = 10, s = 1.1)
  batch = 8
  optimizer = adam(lr = 0.01)
  steps = 3
  seed = 1
}
",
    )
    .expect("writes");
    for (model, layout) in [
        (&served, &["--strategy", "ps", "--servers", "1"][..]),
        (&embedding, &["--strategy", "ps", "--servers", "2"]),
        (&embedding, &["--strategy", "hybrid", "--servers", "1"]),
    ] {
        let mut args = layout.to_vec();
        args.extend(["--workers", "2", "--dtype", "f64", "--tolerance", "1e-10"]);
        let o = verify(model, &args, None);
        assert_eq!(o.status.code(), Some(0), "{layout:?}: {}", text(&o));
        assert!(
            text(&o).contains("emb") == (model == &embedding),
            "{}",
            text(&o)
        );
    }
    // The table's rows are split over the two servers (16 MiB in float64).
    let plan = tmp("f64-emb.json");
    let o = distc(&[
        "compile",
        embedding.to_str().expect("utf-8"),
        "--strategy",
        "ps",
        "--servers",
        "2",
        "--workers",
        "2",
        "--dtype",
        "f64",
        "-o",
        plan.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&["explain", plan.to_str().expect("utf-8")]);
    assert!(
        text(&o).contains("ps s0[0:65536] s1[65536:131072]"),
        "{}",
        text(&o)
    );
}

#[test]
fn the_gradient_norm_is_logged_where_clip_norm_measures_it() {
    let model = key_bias_model(&tmp("norm.dsl"));
    let read = |path: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .expect("metrics")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect()
    };
    let (one, two) = (tmp("one.jsonl"), tmp("two.jsonl"));
    let o = distc(&[
        "train",
        model.to_str().expect("utf-8"),
        "--batch",
        "16",
        "--metrics",
        one.to_str().expect("utf-8"),
        "-q",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&[
        "train",
        model.to_str().expect("utf-8"),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--zero",
        "2",
        "--metrics",
        two.to_str().expect("utf-8"),
        "-q",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (one, two) = (read(&one), read(&two));
    assert_eq!(one.len(), 3);
    for (a, b) in one.iter().zip(&two) {
        let (a, b) = (
            a["grad_norm"].as_f64().expect("grad_norm"),
            b["grad_norm"].as_f64().expect("grad_norm"),
        );
        assert!(a > 0.0 && (a - b).abs() <= 1e-5 * a, "{a} against {b}");
    }
    // Without clip_norm nothing measures it, and nothing is written.
    let plain = tmp("plain.dsl");
    let src = std::fs::read_to_string(&model)
        .expect("model")
        .replace("  clip_norm = 1.0\n", "");
    std::fs::write(&plain, src).expect("writes");
    let m = tmp("plain.jsonl");
    let o = distc(&[
        "train",
        plain.to_str().expect("utf-8"),
        "--metrics",
        m.to_str().expect("utf-8"),
        "-q",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(read(&m).iter().all(|r| r.get("grad_norm").is_none()));
}
