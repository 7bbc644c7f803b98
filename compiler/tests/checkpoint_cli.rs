//! `--checkpoint`, `--checkpoint-every` and `--resume` at the command line: a run
//! resumed from its state file ends with the uninterrupted run's weights; files that
//! are not training states and runs with nothing left to do are refused by name.

use distc_runtime::core::checkpoint;
use std::path::PathBuf;

mod common;

use common::{distc, refused, s, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("checkpoint-cli").join(name)
}

const MODEL: &str = "tests/models/issue9_sparse_adam.dsl";

#[test]
fn train_resume_and_refusals() {
    let (whole, state, resumed) = (tmp("whole.st"), tmp("state.st"), tmp("resumed.st"));
    let o = distc(&["train", MODEL, "--steps", "5", "-q", "--save", s(&whole)]);
    assert!(o.status.success(), "{}", text(&o));
    // Written at steps 2 and 4 and at the end (3): the file holds the last, step 3.
    let o = distc(&[
        "train",
        MODEL,
        "--steps",
        "3",
        "-q",
        "--checkpoint-every",
        "2",
        "--checkpoint",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        checkpoint::load_state(&state).expect("a state").index.step,
        3
    );
    // Resumed to the end: the weights of the uninterrupted run, bit for bit.
    let o = distc(&[
        "train",
        MODEL,
        "--steps",
        "5",
        "-q",
        "--resume",
        s(&state),
        "--save",
        s(&resumed),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (a, _) = checkpoint::load(&whole).expect("weights");
    let (b, _) = checkpoint::load(&resumed).expect("weights");
    assert_eq!(a, b, "the resumed run ended elsewhere");

    for (args, want) in [
        (vec!["--checkpoint-every", "2"], "--checkpoint <FILE>"),
        (
            vec!["--checkpoint-every", "0", "--checkpoint", "x.st"],
            "0 is not allowed",
        ),
        (vec!["--resume", s(&whole)], "cannot be resumed"),
        (
            vec!["--resume", s(&state), "--steps", "3"],
            "--steps above 3",
        ),
        (vec!["--resume", "no-such-state.st"], "no-such-state.st"),
    ] {
        let mut all = vec!["train", MODEL, "-q"];
        all.extend(args.iter().copied());
        refused(&all, want);
    }
}

/// Issue 20: an Adam state resumed into a momentum-SGD model lost its state without a
/// word, and a state of another model was taken for this one where the shapes
/// matched; both are refused naming both sides. A data position past any stream
/// (`samples = 1e19`) hung resume in a linear fast-forward; it is refused at once, and
/// far positions are reached in O(1).
#[test]
fn a_state_of_another_optimizer_model_or_position_is_refused() {
    let state = tmp("adam.st");
    let o = distc(&[
        "train",
        MODEL,
        "--steps",
        "2",
        "-q",
        "--checkpoint",
        s(&state),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let src = std::fs::read_to_string(common::root().join(MODEL)).expect("model");
    let momentum = tmp("momentum.dsl");
    std::fs::write(
        &momentum,
        src.replace("adam(lr = 0.01)", "sgd(lr = 0.01, momentum = 0.9)"),
    )
    .expect("write");
    refused(
        &[
            "train",
            s(&momentum),
            "-q",
            "--steps",
            "4",
            "--resume",
            s(&state),
        ],
        "this plan trains with momentum (state momentum)",
    );
    let renamed = tmp("renamed.dsl");
    std::fs::write(&renamed, src.replace("model sparse_adam", "model other")).expect("write");
    refused(
        &[
            "train",
            s(&renamed),
            "-q",
            "--steps",
            "4",
            "--resume",
            s(&state),
        ],
        "the training state is of model `sparse_adam`, this plan trains `other`",
    );
    // The index rewritten to a position of 1e19 samples (checksums are per tensor:
    // the index is metadata, so the file stays loadable).
    let (tensors, mut meta) = checkpoint::load(&state).expect("state");
    let key = checkpoint::INDEX_KEY.to_string();
    let mut index: serde_json::Value = serde_json::from_str(&meta[&key]).expect("index");
    index["samples"] = serde_json::json!(10_000_000_000_000_000_000u64);
    meta.insert(key, index.to_string());
    let far = tmp("far.st");
    let named: Vec<(String, &distc_runtime::Tensor)> =
        tensors.iter().map(|(k, v)| (k.clone(), v)).collect();
    checkpoint::save(&far, &named, meta).expect("save");
    let started = std::time::Instant::now();
    refused(
        &["train", MODEL, "-q", "--steps", "4", "--resume", s(&far)],
        "beyond any stream",
    );
    assert!(
        started.elapsed().as_secs() < 60,
        "resume took {:?}",
        started.elapsed()
    );
}

/// Issue 20: Ctrl-C ended a run at once, saying nothing. Now the run stops after its
/// step with status 130, keeps every metrics line, and says which training state is on
/// disk; that state loads and is of the step it names.
#[test]
fn ctrl_c_stops_after_the_step_and_says_what_is_on_disk() {
    let (state, metrics) = (tmp("sigint.st"), tmp("sigint.jsonl"));
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_distc"))
        .args(["train", MODEL, "--steps", "100000000", "-q"])
        .args(["--checkpoint", s(&state), "--checkpoint-every", "7"])
        .args(["--metrics", s(&metrics)])
        .current_dir(common::root())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !state.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let sent = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let o = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(130), "{err}");
    let step: usize = err
        .split("interrupted (Ctrl-C) after step ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in: {err}"));
    assert!(err.contains("no final checkpoint was written"), "{err}");
    let saved = checkpoint::load_state(&state).expect("the state loads");
    let at = saved.index.step as usize;
    // Workers run ahead of the metrics the coordinator has reported: the state may be
    // of a later step than the last line, and the message reads it back.
    assert!(
        at.is_multiple_of(7) && at > 0,
        "state of step {at}, stopped at {step}"
    );
    assert!(err.contains(&format!("of step {at}")), "{err}");
    let lines = std::fs::read_to_string(&metrics)
        .expect("metrics")
        .lines()
        .count();
    assert_eq!(lines, step, "metrics lines lost");
}
