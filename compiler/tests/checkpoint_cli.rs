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
