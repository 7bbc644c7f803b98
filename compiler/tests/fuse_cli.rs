//! `--fuse` on the command line: the kernel_fusion pass reports what it fused (or that
//! it is off), its dump holds `fused` nodes, the plan trains, and `distc verify --fuse`
//! compares a fused plan with the plain one device.

mod common;

use common::{distc, text};

#[test]
fn fuse_compiles_dumps_and_verifies() {
    let dir = common::temp_dir("fuse-cli");
    let plan = dir.join("fused.plan.json");
    let dump = dir.join("ir");
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "--batch",
        "16",
        "--fuse",
        "-o",
        plan.to_str().expect("utf8"),
        "--dump-ir",
        dump.to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let line = text(&o)
        .lines()
        .find(|l| l.trim_start().starts_with("kernel_fusion"))
        .expect("a kernel_fusion line")
        .to_string();
    assert!(line.contains("groups=2"), "{line}");
    let ir = std::fs::read_to_string(dump.join("06-kernel_fusion.ir")).expect("dump");
    assert!(ir.contains(r#"fused{expr="relu(add(in0, in1))"}"#), "{ir}");
    let o = distc(&["run", plan.to_str().expect("utf8"), "--steps", "2"]);
    assert!(o.status.success(), "{}", text(&o));

    // Off by default: listed, and says so.
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "-o",
        dir.join("plain.plan.json").to_str().expect("utf8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("off (--fuse not given)"), "{}", text(&o));

    // One device fused against one device plain.
    let o = distc(&[
        "verify",
        "examples/dense_mlp.dsl",
        "--fuse",
        "--batch",
        "8",
        "--steps",
        "2",
    ]);
    assert!(o.status.success(), "{}", text(&o));

    let o = distc(&["compile", "--help"]);
    assert!(text(&o).contains("--fuse"), "{}", text(&o));
}
