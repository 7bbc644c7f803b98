//! Regression tests of issue 20 (what hostile command lines found): numeric flags are
//! range-checked by the parser, a closed output pipe never panics, and an error's
//! cause is printed once.

use std::process::{Command, Stdio};

mod common;

use common::{distc, refused, root, s, temp_dir, text};

/// sparse_lm compiled with a batch of 8 into `dir`.
fn small_plan(dir: &std::path::Path) -> std::path::PathBuf {
    let plan = dir.join("lm.plan.json");
    let o = distc(&[
        "compile",
        "examples/sparse_lm.dsl",
        "--batch",
        "8",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    plan
}

/// `--timeout 1e30` (and 2^64, 2^63-1) overflowed a duration and panicked after the
/// plan loaded; now the parser refuses it, exit 2, naming the limit.
#[test]
fn a_timeout_beyond_a_year_is_refused_by_the_parser() {
    let dir = temp_dir("issue20-timeout");
    let plan = small_plan(&dir);
    for t in ["1e30", "18446744073709551616", "9223372036854775807"] {
        refused(
            &["run", s(&plan), "--steps", "1", "--timeout", t],
            "the longest timeout",
        );
        let o = distc(&["run", s(&plan), "--steps", "1", "--timeout", t]);
        assert_eq!(o.status.code(), Some(2), "--timeout {t}: {}", text(&o));
    }
    refused(
        &[
            "verify",
            "examples/sparse_lm.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--timeout",
            "1e30",
        ],
        "the longest timeout",
    );
    // Two workers: a plan of one worker has no collective to bound, and refuses the
    // flag (issue 60, item 9).
    refused(
        &["run", s(&plan), "--steps", "1", "--timeout", "5"],
        "this plan runs one worker and no servers",
    );
    let two = dir.join("lm2.plan.json");
    let o = distc(&[
        "compile",
        "examples/sparse_lm.dsl",
        "--batch",
        "8",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "-o",
        s(&two),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = distc(&[
        "run",
        s(&two),
        "--steps",
        "1",
        "--timeout",
        "31536000",
        "-q",
    ]);
    assert!(o.status.success(), "a year is allowed: {}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `compile ... 2>&1 | head -c 10` and `bench ... | head` panicked on the broken pipe:
/// everything the CLI prints goes through `distc::console` now, so a closed output
/// never panics (exit status 101).
#[test]
fn a_closed_output_pipe_never_panics() {
    let dir = temp_dir("issue20-pipe");
    let plan = dir.join("cnn.plan.json");
    for args in [
        &["compile", "examples/cnn.dsl", "-o", s(&plan)][..],
        &[
            "bench",
            "--compile",
            "--nodes",
            "200",
            "--strategies",
            "single",
            "--workers",
            "1",
        ][..],
        &["ir", "examples/lm.dsl", "--after", "autodiff"][..],
    ] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_distc"))
            .args(args)
            .current_dir(root())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starts");
        // Both ends closed before distc writes anything.
        drop(child.stdout.take());
        drop(child.stderr.take());
        let status = child.wait().expect("ends");
        assert_ne!(status.code(), Some(101), "{args:?} panicked: {status:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// "Is a directory (os error 21): Is a directory (os error 21)": a cause the message
/// already states is not printed again (and a directory is now refused as an input by
/// name before it is read).
#[test]
fn an_error_states_its_cause_once() {
    let dir = temp_dir("issue20-cause");
    let o = distc(&["run", s(&dir)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr).trim().to_string();
    let parts: Vec<&str> = err.split(": ").collect();
    for (i, p) in parts.iter().enumerate() {
        assert!(!parts[..i].contains(p), "`{p}` is said twice: {err}");
    }
    assert!(err.contains(s(&dir)), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--save` or `--checkpoint` where nothing can be written failed only after training:
/// now before step 1, naming the path. (A file stands where the folder would be: the
/// folder cannot be made, as a missing or read-only one cannot.)
#[test]
fn an_output_that_cannot_be_written_fails_before_training() {
    let dir = temp_dir("issue20-outputs");
    let plan = small_plan(&dir);
    let blocker = dir.join("blocker");
    std::fs::write(&blocker, b"a file, not a folder").expect("writes");
    for flag in ["--save", "--checkpoint"] {
        let target = blocker.join("sub").join("out.safetensors");
        let metrics = dir.join(format!("m{flag}.jsonl"));
        let o = distc(&[
            "run",
            s(&plan),
            "--steps",
            "100000",
            "--metrics",
            s(&metrics),
            flag,
            s(&target),
        ]);
        assert_eq!(o.status.code(), Some(1), "{flag}: {}", text(&o));
        assert!(text(&o).contains(s(&target)), "{flag}: {}", text(&o));
        assert!(!metrics.exists(), "{flag}: a step ran before the refusal");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `eval_samples` smaller than the batch trained every step and then failed "no
/// evaluation data", writing neither `--save` nor `--checkpoint`: now `compile` and
/// `train` refuse it before step 1, and `verify` (which compares weights) needs no
/// evaluation data at all.
#[test]
fn eval_samples_below_a_batch_is_refused_before_training() {
    let dir = temp_dir("issue20-eval");
    let src = std::fs::read_to_string(root().join("examples/sparse_lm.dsl")).expect("reads");
    let model = dir.join("small_eval.dsl");
    let batch = src
        .lines()
        .find_map(|l| {
            let l = l.trim();
            l.strip_prefix("batch")
                .and_then(|r| r.trim().strip_prefix('='))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse::<usize>().ok())
        })
        .expect("the example sets a batch");
    let patched: String = src
        .lines()
        .filter(|l| !l.trim_start().starts_with("eval_samples"))
        .map(|l| {
            if l.trim_start().starts_with("batch") {
                format!("  eval_samples = {}\n{l}\n", batch - 1)
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(&model, patched).expect("writes");
    let plan = dir.join("p.plan.json");
    refused(
        &["compile", s(&model), "-o", s(&plan)],
        "smaller than one batch",
    );
    assert!(!plan.exists());
    let metrics = dir.join("m.jsonl");
    refused(
        &["train", s(&model), "--steps", "2", "--metrics", s(&metrics)],
        "smaller than one batch",
    );
    assert!(!metrics.exists(), "a step ran before the refusal");
    let o = distc(&[
        "verify",
        s(&model),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "1",
    ]);
    assert!(
        o.status.success(),
        "verify needs no evaluation: {}",
        text(&o)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A failing pass wrote `distc-before-PASS.ir` into the current folder (later the
/// system's temporary folder) unasked; now it writes only into `--dump-ir`'s folder
/// and otherwise says how to get it.
#[test]
fn a_failing_pass_writes_nothing_unasked() {
    let dir = temp_dir("issue20-dump");
    let (cwd, tmp, dump) = (dir.join("cwd"), dir.join("tmp"), dir.join("dump"));
    for d in [&cwd, &tmp] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    let model = root().join("examples/mlp.dsl");
    let compile = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_distc"))
            .args(["compile", s(&model), "--strategy", "ps", "--workers", "2"])
            .args(["-o", s(&cwd.join("plan.json"))])
            .args(extra)
            .current_dir(&cwd)
            .env("TMPDIR", &tmp)
            .output()
            .expect("runs")
    };
    let o = compile(&[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("give --dump-ir DIR"), "{}", text(&o));
    for d in [&cwd, &tmp] {
        let left: Vec<_> = std::fs::read_dir(d).expect("ls").flatten().collect();
        assert!(left.is_empty(), "{} holds {left:?}", d.display());
    }
    let o = compile(&["--dump-ir", s(&dump)]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(dump.join("before-place.ir").is_file(), "{}", text(&o));
}

/// `--workers`, `--servers` and `--nodes` of 2^32 or 2^63-1 aborted or panicked in
/// the compiler; the parser now bounds them (exit 2), naming the range.
#[test]
fn rank_and_graph_counts_are_bounded_by_the_parser() {
    for big in ["4294967296", "9223372036854775807"] {
        refused(
            &[
                "compile",
                "examples/mlp.dsl",
                "-o",
                "x.json",
                "--servers",
                big,
            ],
            "out of range",
        );
        refused(
            &[
                "compile",
                "examples/mlp.dsl",
                "-o",
                "x.json",
                "--workers",
                big,
            ],
            "out of range",
        );
        refused(&["bench", "--compile", "--nodes", big], "out of range");
    }
    refused(
        &[
            "compile",
            "examples/mlp.dsl",
            "-o",
            "x.json",
            "--batch",
            "99999999999",
        ],
        "out of range",
    );
}

/// `verify --batch 300000000` aborted allocating 9.6 GB: verify skipped the memory
/// estimate `run` applies. The estimate now guards every run at the one launch entry,
/// so verify refuses it naming the figures.
#[test]
fn verify_applies_the_memory_estimate() {
    let o = distc(&[
        "verify",
        "examples/dense_mlp.dsl",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--batch",
        "300000000",
        "--steps",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("this run needs about"), "{}", text(&o));
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
}
