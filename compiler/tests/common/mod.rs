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

/// `target/tmp/distc-LABEL-PID` (cargo's scratch folder for integration tests, not
/// the system's /tmp), created; the folders of earlier runs of this label whose
/// process is gone are removed first, so runs do not pile up.
pub fn temp_dir(label: &str) -> PathBuf {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let prefix = format!("distc-{label}-");
    for e in std::fs::read_dir(base).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix(&prefix)
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|p| p != std::process::id() && !alive(p)) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    let dir = base.join(format!("{prefix}{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    dir
}

fn alive(pid: u32) -> bool {
    distc_runtime::core::output::process_alive(pid)
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

/// Held for the whole of a test that starts several processes which wait on each other
/// with timeouts (MPI jobs, network-namespace hosts): such tests run one at a time even
/// inside `cargo test --workspace`, as with `--test-threads 1`, so two jobs never share
/// this machine's cores and stall each other past their timeouts.
pub fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static JOBS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that failed while holding it leaves nothing to repair.
    JOBS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `max |a - b| / max |a|` over the variables of two weight files (`--save`), the
/// largest: 0 when they are equal bit for bit.
pub fn max_difference(a: &Path, b: &Path) -> f64 {
    use distc_runtime::core::checkpoint;
    let (a, _) = checkpoint::load(a).expect("weights");
    let (b, _) = checkpoint::load(b).expect("weights");
    assert_eq!(a.len(), b.len(), "the files hold other variables");
    let mut worst: f64 = 0.0;
    for (name, x) in &a {
        let (x, y) = (x.to_f64_vec(), b[name].to_f64_vec());
        let scale = x.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
        let d = x
            .iter()
            .zip(&y)
            .fold(0.0f64, |m, (p, q)| m.max((p - q).abs()));
        worst = worst.max(d / scale);
    }
    worst
}

/// `train MODEL... LAYOUT... --transport mpi --steps TO`, writing its sharded state
/// to `state` (resuming from it with `resume`) and its weights to `save`: one leg of a
/// `distc launch` run repeated by hand from state to state.
pub fn leg<'a>(
    model: &[&'a str],
    layout: &[&'a str],
    to: &'a str,
    (state, save): (&'a Path, &'a Path),
    resume: bool,
) -> Vec<&'a str> {
    let mut args = vec!["train"];
    args.extend(model);
    args.extend(layout);
    args.extend(["--transport", "mpi", "--steps", to]);
    args.extend(["--checkpoint", s(state), "--sharded", "--save", s(save)]);
    if resume {
        args.extend(["--resume", s(state)]);
    }
    args
}

/// Jobs run by hand from state to state, as `distc launch` ran them: each leg
/// `(ranks, layout, to, resume)` is [`leg`] run by `run` on that many ranks; a leg that
/// fails fails the test.
pub fn run_legs(
    model: &[&str],
    legs: &[(usize, &[&str], &str, bool)],
    (state, save): (&Path, &Path),
    run: &dyn Fn(usize, &[&str]) -> Output,
) {
    for &(np, layout, to, resume) in legs {
        let args = leg(model, layout, to, (state, save), resume);
        let o = run(np, &args);
        assert!(
            o.status.success(),
            "{np} ranks, {layout:?}, to step {to}: {}",
            text(&o)
        );
    }
}

/// A metrics file's lines (`--metrics`), each parsed.
pub fn metrics_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("the metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a metrics line"))
        .collect()
}

/// Writes to `path` a model whose first layer's weight `e` is also its output layer
/// (tied), with 4 tanh layers between, on synthetic data, trained by `optimizer` and
/// evaluated every 2 steps; returns `path`.
pub fn tied_model(path: &Path, optimizer: &str) -> PathBuf {
    let mut src = "model tied {\n  input x: f32[B, 16]\n  input label: i32[B]\n  \
                   param e: f32[16, 16] = glorot\n"
        .to_string();
    for k in 0..4 {
        src += &format!("  param w{k}: f32[16, 16] = glorot\n");
    }
    src += "  h0 = tanh(x @ e)\n";
    for k in 0..4 {
        src += &format!("  h{} = tanh(h{k} @ w{k})\n", k + 1);
    }
    src += &format!(
        "  minimize softmax_cross_entropy(h4 @ e, label)\n}}\ntrain {{\n  \
         data = gaussian_classes(features = 16, classes = 16)\n  batch = 8\n  \
         optimizer = {optimizer}\n  steps = 3\n  seed = 1\n  eval_every = 2\n}}\n"
    );
    std::fs::write(path, src).expect("writes the model");
    path.to_path_buf()
}

/// `n` u16 token ids below 50, as a token file's bytes.
pub fn token_bytes(n: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (((i * 7 + i / 13) % 50) as u16).to_le_bytes())
        .collect()
}
