//! What the command-line tests share: the built `distc` run from the repository root,
//! its output as one text, and a temporary folder per test binary (never a path
//! outside it).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root (examples/ and tests/models/ are relative to it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `distc ARGS` in the repository root and waits for it.
pub fn distc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_distc"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("runs")
}

/// Standard output then standard error.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `$TMPDIR/distc-LABEL-PID`, created.
pub fn temp_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("distc-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    dir
}

/// Runs `distc ARGS` and checks it fails with exit status 1 or 2 (clap's usage
/// errors), printing `want`, never a panic.
pub fn refused(args: &[&str], want: &str) {
    let o = distc(args);
    assert!(
        matches!(o.status.code(), Some(1 | 2)),
        "{args:?} was not refused: {}",
        text(&o)
    );
    assert!(
        text(&o).contains(want),
        "{args:?}: expected {want:?} in {}",
        text(&o)
    );
    assert!(!text(&o).contains("panicked"), "{args:?}: {}", text(&o));
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf8")
}
