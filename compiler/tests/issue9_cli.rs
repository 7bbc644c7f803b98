//! Regressions of issue 9, Part A, at the command line: numeric flags, output files,
//! closed pipes, sizes that would not fit, and flags that would mean nothing. Never a
//! path under /dev: special files are made in a temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;

use common::{distc, refused, s, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("issue9-cli").join(name)
}

#[test]
fn non_finite_and_non_positive_numbers_are_refused() {
    let plan = tmp("n.plan.json");
    for (flag, value) in [
        ("--bandwidth", "nan"),
        ("--bandwidth", "inf"),
        ("--bandwidth", "0"),
        ("--latency", "-1"),
        ("--latency", "NaN"),
        ("--bucket-mb", "0"),
        ("--bucket-mb", "inf"),
    ] {
        refused(
            &[
                "compile",
                "examples/dense_mlp.dsl",
                "--strategy",
                "allreduce",
                "--workers",
                "2",
                flag,
                value,
                "-o",
                s(&plan),
            ],
            flag,
        );
    }
    refused(
        &[
            "verify",
            "examples/dense_mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--tolerance",
            "nan",
        ],
        "--tolerance",
    );
    refused(
        &["train", "examples/dense_mlp.dsl", "--timeout", "0"],
        "--timeout",
    );
}

#[test]
fn count_flags_have_lower_bounds() {
    refused(&["bench", "--runs", "0"], "--runs");
    refused(&["bench", "--steps", "0"], "--steps");
    refused(&["bench", "--workers", "1,0"], "--workers");
    refused(
        &["train", "examples/dense_mlp.dsl", "--steps", "0"],
        "--steps",
    );
    refused(
        &["train", "examples/dense_mlp.dsl", "--batch", "0"],
        "--batch",
    );
    refused(
        &[
            "verify",
            "examples/dense_mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--steps",
            "0",
        ],
        "--steps",
    );
}

#[test]
fn flags_that_would_mean_nothing_are_refused() {
    let plan = tmp("m.plan.json");
    let o = s(&plan);
    refused(
        &[
            "compile",
            "examples/dense_mlp.dsl",
            "--workers",
            "3",
            "-o",
            o,
        ],
        "--workers 3",
    );
    refused(
        &[
            "compile",
            "examples/dense_mlp.dsl",
            "--servers",
            "2",
            "-o",
            o,
        ],
        "--servers 2",
    );
    refused(
        &[
            "compile",
            "examples/dense_mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--sync",
            "async",
            "-o",
            o,
        ],
        "--sync async",
    );
    refused(
        &[
            "compile",
            "examples/dense_mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--servers",
            "2",
            "-o",
            o,
        ],
        "--servers 2",
    );
    refused(
        &[
            "compile",
            "examples/sparse_lm.dsl",
            "--strategy",
            "hybrid",
            "--workers",
            "2",
            "--servers",
            "1",
            "--sparse-as-dense",
            "-o",
            o,
        ],
        "--sparse-as-dense",
    );
    refused(
        &[
            "verify",
            "examples/dense_mlp.dsl",
            "--strategy",
            "ps",
            "--workers",
            "2",
            "--servers",
            "1",
            "--sync",
            "stale:2",
        ],
        "--sync stale:2",
    );
    // A plan cut short compiles (for reading) but does not run.
    for cut in [
        ["--stop-after", "autodiff"],
        ["--disable-pass", "distribute"],
    ] {
        let mut args = vec![
            "compile",
            "examples/dense_mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "-o",
            o,
        ];
        args.extend(cut);
        let c = distc(&args);
        assert!(c.status.success(), "{}", text(&c));
        refused(&["run", o, "--steps", "1"], cut[0]);
    }
}

#[test]
fn output_files_never_replace_what_is_not_a_plain_output() {
    // A pipe where the plan should go stays a pipe.
    let fifo = tmp("fifo");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    refused(
        &["compile", "examples/dense_mlp.dsl", "-o", s(&fifo)],
        "not a regular file",
    );
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata(&fifo)
        .expect("still there")
        .file_type()
        .is_fifo());
    // A directory is refused for --save and -o alike.
    let dir = tmp("a-dir");
    std::fs::create_dir_all(&dir).expect("dir");
    refused(
        &[
            "train",
            "examples/dense_mlp.dsl",
            "--steps",
            "1",
            "--save",
            s(&dir),
        ],
        "directory",
    );
    // The model's own source is never overwritten.
    let model = tmp("model.dsl");
    let src = std::fs::read_to_string("../examples/dense_mlp.dsl")
        .or_else(|_| {
            std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/dense_mlp.dsl"),
            )
        })
        .expect("example");
    std::fs::write(&model, &src).expect("write");
    refused(&["compile", s(&model), "-o", s(&model)], "input");
    refused(
        &["train", s(&model), "--steps", "1", "--save", s(&model)],
        "input",
    );
    assert_eq!(std::fs::read_to_string(&model).expect("read"), src);
    // Two outputs on one file.
    let m = tmp("same.out");
    refused(
        &[
            "train",
            "examples/dense_mlp.dsl",
            "--steps",
            "1",
            "--metrics",
            s(&m),
            "--save",
            s(&m),
        ],
        "another output",
    );
    // A temporary file left by a killed save (its process is gone) is cleaned up.
    let save = tmp("w.safetensors");
    let stale = tmp(".w.safetensors.distc-tmp-4194999");
    std::fs::write(&stale, b"half a file").expect("write");
    let o = distc(&[
        "train",
        "examples/dense_mlp.dsl",
        "--steps",
        "1",
        "--batch",
        "4",
        "-q",
        "--save",
        s(&save),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        save.exists() && !stale.exists(),
        "stale temporary file left behind"
    );
}

#[test]
fn a_closed_pipe_ends_quietly() {
    let plan = tmp("p.plan.json");
    let c = distc(&[
        "compile",
        "examples/sparse_lm.dsl",
        "--strategy",
        "hybrid",
        "--workers",
        "2",
        "--servers",
        "1",
        "-o",
        s(&plan),
    ]);
    assert!(c.status.success(), "{}", text(&c));
    for args in [
        vec!["explain", s(&plan)],
        vec!["ir", "examples/cnn.dsl"],
        vec!["dot", "examples/cnn.dsl"],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_distc"))
            .args(&args)
            .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join(".."))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("runs");
        // The reader goes away before anything is written.
        drop(child.stdout.take());
        let o = child.wait_with_output().expect("waits");
        assert!(o.status.success(), "{args:?}: {}", text(&o));
        assert!(!text(&o).contains("panicked"), "{args:?}: {}", text(&o));
    }
}

#[test]
fn sizes_that_cannot_fit_are_refused_with_the_estimate() {
    let model = |name: &str, body: &str| {
        let p = tmp(name);
        std::fs::write(&p, body).expect("write");
        p
    };
    let big_batch = model(
        "big_batch.dsl",
        "model m { input x: f32[B, 784] input label: i32[B] param w: f32[784, 10] = glorot \
         minimize softmax_cross_entropy(x @ w, label) }\n\
         train { data = gaussian_classes(features = 784, classes = 10) batch = 1000000000 \
         optimizer = sgd(lr = 0.1) steps = 1 }",
    );
    let big_param = model(
        "big_param.dsl",
        "model m { input ids: i32[B, 2] input label: i32[B] param e: f32[2147483647, 32] = zeros \
         param w: f32[64, 5] = glorot \
         minimize softmax_cross_entropy(reshape(embedding(e, ids), [B, 64]) @ w, label) }\n\
         train { data = zipf_tokens(vocab = 1000, context = 2, classes = 5, s = 1.1) batch = 4 \
         optimizer = sgd(lr = 0.1) steps = 1 }",
    );
    let big_eval = model(
        "big_eval.dsl",
        "model m { input x: f32[B, 784] input label: i32[B] param w: f32[784, 10] = glorot \
         minimize softmax_cross_entropy(x @ w, label) }\n\
         train { data = gaussian_classes(features = 784, classes = 10) batch = 4 \
         optimizer = sgd(lr = 0.1) steps = 1 eval_samples = 2147483647 }",
    );
    for f in [&big_batch, &big_param, &big_eval] {
        refused(&["train", s(f)], "needs about");
    }
    refused(
        &[
            "train",
            s(&big_batch),
            "--strategy",
            "allreduce",
            "--workers",
            "2",
        ],
        "needs about",
    );
    refused(
        &[
            "train",
            "examples/dense_mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "100000",
        ],
        "needs about",
    );
    refused(
        &[
            "train",
            "examples/dense_mlp.dsl",
            "--preload",
            "--steps",
            "100000000",
        ],
        "needs about",
    );
    // explain prints the estimate.
    let plan = tmp("e.plan.json");
    let c = distc(&["compile", "examples/dense_mlp.dsl", "-o", s(&plan)]);
    assert!(c.status.success(), "{}", text(&c));
    let e = distc(&["explain", s(&plan)]);
    assert!(text(&e).contains("memory (estimate"), "{}", text(&e));
}
