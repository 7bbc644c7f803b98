//! Learning-rate schedules from the train block (issue 25, item 2): a distributed plan
//! that follows one (all-reduce, and hybrid, whose parameter servers follow it too)
//! trains what one device trains; a schedule changes what is trained; a schedule out
//! of range is a located error.

use std::path::PathBuf;

mod common;

use common::{distc, root, s, text};

/// `example` with `lr_schedule = SCHEDULE` added after its optimizer line, written
/// to a temporary file.
fn with_schedule(example: &str, schedule: &str) -> PathBuf {
    let src = std::fs::read_to_string(root().join("examples").join(example)).expect("example");
    let at = src.find("  optimizer").expect("an optimizer line");
    let end = at + src[at..].find('\n').expect("a line end") + 1;
    let text = format!("{}  lr_schedule = {schedule}\n{}", &src[..end], &src[end..]);
    let path = common::temp_dir("schedule-cli").join(format!(
        "{}-{}",
        schedule.replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
        example
    ));
    std::fs::write(&path, text).expect("write");
    path
}

#[test]
fn distributed_plans_follow_the_schedule_as_one_device_does() {
    let dense = with_schedule("dense_mlp.dsl", "cosine(warmup = 2, final = 0.1)");
    let o = distc(&[
        "verify",
        s(&dense),
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "4",
        "--batch",
        "16",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let sparse = with_schedule("sparse_lm.dsl", "step(every = 1, gamma = 0.5, warmup = 1)");
    let o = distc(&[
        "verify",
        s(&sparse),
        "--strategy",
        "hybrid",
        "--workers",
        "2",
        "--servers",
        "1",
        "--steps",
        "3",
        "--batch",
        "16",
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

/// The losses of `steps` steps of `file`.
fn losses(file: &str, steps: &str) -> Vec<f64> {
    let m = common::temp_dir("schedule-cli").join(format!(
        "{}.jsonl",
        file.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
    ));
    let o = distc(&[
        "train",
        file,
        "--steps",
        steps,
        "--batch",
        "16",
        "-q",
        "--metrics",
        s(&m),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines = std::fs::read_to_string(&m).expect("metrics");
    lines
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            v["loss"].as_f64().expect("a loss")
        })
        .collect()
}

#[test]
fn a_schedule_changes_what_is_trained() {
    let plain = root().join("examples/dense_mlp.dsl");
    let slow = with_schedule("dense_mlp.dsl", "constant(warmup = 1000)");
    let (a, b) = (losses(s(&plain), "3"), losses(s(&slow), "3"));
    // The first loss is the untrained model's in both; after it, a warm-up of 1000
    // updates has moved the weights 1/1000 as far, so every later loss differs.
    assert_eq!(a[0], b[0], "{a:?} {b:?}");
    assert!(
        a[1..].iter().zip(&b[1..]).all(|(x, y)| x != y),
        "{a:?} {b:?}"
    );
}

#[test]
fn a_schedule_out_of_range_is_a_located_error() {
    let bad = with_schedule("dense_mlp.dsl", "step(every = 10, gamma = 2)");
    let o = distc(&[
        "compile",
        s(&bad),
        "-o",
        s(&common::temp_dir("schedule-cli").join("never.json")),
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("`gamma` must be in (0, 1], found 2"), "{t}");
    assert!(
        t.contains(":23:") && t.contains('^'),
        "no line, column and caret: {t}"
    );
    let bad = with_schedule("dense_mlp.dsl", "cosin(warmup = 10)");
    let o = distc(&[
        "compile",
        s(&bad),
        "-o",
        s(&common::temp_dir("schedule-cli").join("never.json")),
    ]);
    assert!(text(&o).contains("cosine"), "no suggestion: {}", text(&o));
}
