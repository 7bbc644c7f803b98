//! `--precision` and `--grad-wire` from the command line (issue 24): `explain`'s
//! precision section, and what is refused by name.

use std::path::PathBuf;

mod common;

use common::{distc, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("precision-cli").join(name)
}

fn arg(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn explain_shows_the_masters_the_16_bit_copies_and_the_wire() {
    let plan = tmp("bf16.plan.json");
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "--precision",
        "fp16",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--grad-wire",
        "bf16",
        "--batch",
        "16",
        "-o",
        arg(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("mixed_precision"), "{}", text(&o));
    assert!(text(&o).contains("grad_wire"), "{}", text(&o));
    let o = distc(&["explain", arg(&plan)]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for want in [
        // dense_mlp: 7.1 MiB of f32 variables, whose 16-bit copies are half that.
        "precision: fp16 (pass mixed_precision; ",
        "variables stay f32 masters (7.11 MiB), cast each step to 16-bit copies (3.55 MiB)",
        "loss scaling: dynamic, from 2^16",
        "gradient wire: bf16",
    ] {
        assert!(t.contains(want), "`{want}` not in:\n{t}");
    }
    // The plan runs from its file, and its metrics carry the loss scale.
    let metrics = tmp("fp16.metrics.jsonl");
    let o = distc(&[
        "run",
        arg(&plan),
        "--steps",
        "2",
        "-q",
        "--metrics",
        arg(&metrics),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let lines = std::fs::read_to_string(&metrics).expect("metrics");
    assert!(lines.contains("\"loss_scale\":65536.0"), "{lines}");
}

#[test]
fn what_a_precision_cannot_do_is_refused_by_name() {
    for (args, want) in [
        (vec!["--precision", "fp64"], "`fp64` is not a precision"),
        (
            vec!["--grad-wire", "bf16"],
            "--grad-wire bf16 sets what gradient all-reduces send; this plan all-reduces no gradient",
        ),
        (
            vec!["--precision", "fp16", "--pipeline", "2"],
            "--precision fp16 (dynamic loss scaling) with --pipeline",
        ),
    ] {
        let never = tmp("never.plan.json");
        let mut a = vec!["compile", "examples/dense_mlp.dsl", "-o", arg(&never)];
        a.extend(args.iter().copied());
        let o = distc(&a);
        assert!(!o.status.success(), "{args:?} compiled");
        assert!(
            text(&o).contains(want),
            "{args:?}: `{want}` not in {}",
            text(&o)
        );
        assert!(!text(&o).contains("panicked"), "{args:?}: {}", text(&o));
        assert!(!never.exists(), "{args:?} wrote a plan");
    }
}

/// Issue 35, item 6: `verify --precision bf16 --tolerance 0` passed, a per-variable
/// allowance deciding that `--tolerance` could not tighten; a bf16 gradient wire got
/// no allowance and failed at 3.5e-3 against 1e-4. Each variable's line now says what
/// allows it, an explicit `--tolerance` decides alone, and the wire gets its stated
/// allowance.
#[test]
fn verify_prints_each_allowance_and_an_explicit_tolerance_decides() {
    let base = [
        "verify",
        "examples/dense_mlp.dsl",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--batch",
        "16",
        "--steps",
        "2",
    ];
    let run = |extra: &[&str]| distc(&[&base[..], extra].concat());
    let o = run(&["--precision", "bf16"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("(16-bit floor) + 2 x"), "{}", text(&o));
    let o = run(&["--precision", "bf16", "--tolerance", "0"]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "--tolerance 0 passed: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("allowed 0.0e0 (--tolerance)"),
        "{}",
        text(&o)
    );
    assert!(
        text(&o).contains("beyond the tolerance 0.0e0"),
        "{}",
        text(&o)
    );
    let o = run(&["--grad-wire", "bf16"]);
    assert!(
        o.status.success(),
        "a bf16 wire within its allowance: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("allowed 1.0e-2 (16-bit floor)"),
        "{}",
        text(&o)
    );
    let o = run(&["--grad-wire", "bf16", "--tolerance", "1e-6"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}
