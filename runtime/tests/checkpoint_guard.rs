//! Regression tests of issue 20 (what 1,000 damaged checkpoints found): a flipped bit
//! is caught by the tensor's checksum, a stored NaN is refused by name, and what is
//! not a regular file (a FIFO) is refused at once instead of hanging; a temporary
//! file of a killed writer is removed by the next write even while the writer is a
//! zombie.

use distc_runtime::core::checkpoint::{load, save};
use distc_runtime::Tensor;
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;

/// A temporary folder, removed when the test ends.
fn dir(label: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("distc-guard-{label}-"))
        .tempdir()
        .expect("temp dir")
}

fn tensor(values: Vec<f32>) -> Tensor {
    let n = values.len();
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[n]), values).expect("shape"))
}

#[test]
fn a_flipped_bit_is_caught_by_the_tensors_checksum() {
    let tmp = dir("bit");
    let d = tmp.path();
    let path = d.join("w.safetensors");
    let w = tensor((0..64).map(|i| i as f32 * 0.25).collect());
    save(&path, &[("w".to_string(), &w)], HashMap::new()).expect("saves");
    let (back, _) = load(&path).expect("an intact file loads");
    assert_eq!(back["w"], w);
    let mut bytes = std::fs::read(&path).expect("reads");
    // The data follows the header: the last byte is the last element's.
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&path, &bytes).expect("writes");
    let err = load(&path)
        .expect_err("a damaged tensor is refused")
        .to_string();
    assert!(err.contains("`w`") && err.contains("checksum"), "{err}");
}

#[test]
fn a_stored_nan_is_refused_naming_the_tensor() {
    let tmp = dir("nan");
    let d = tmp.path();
    let path = d.join("w.safetensors");
    let ok = tensor(vec![1.0, 2.0]);
    let bad = tensor(vec![1.0, f32::NAN, 3.0]);
    save(
        &path,
        &[("ok".to_string(), &ok), ("emb".to_string(), &bad)],
        HashMap::new(),
    )
    .expect("saves");
    let err = load(&path).expect_err("NaN is refused").to_string();
    assert!(err.contains("`emb`") && err.contains("NaN"), "{err}");
}

#[test]
fn a_fifo_is_refused_at_once() {
    let tmp = dir("fifo");
    let d = tmp.path();
    let fifo = d.join("state.safetensors");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        println!("skipping: mkfifo is not available");
        return;
    }
    // No writer ever comes: opening the FIFO to read it would block for ever.
    let err = load(&fifo).expect_err("a FIFO is refused").to_string();
    assert!(err.contains("not a regular file"), "{err}");
}

#[test]
fn a_zombie_writers_temporary_file_is_removed_and_a_live_ones_kept() {
    use distc_runtime::core::output::{process_alive, write_file};
    let tmp = dir("zombie");
    let d = tmp.path();
    // A child that exits and is not waited for stays a zombie: /proc still lists it.
    let mut dead = std::process::Command::new("true").spawn().expect("spawn");
    let mut live = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while process_alive(dead.id()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(std::path::Path::new(&format!("/proc/{}", dead.id())).exists());
    assert!(!process_alive(dead.id()), "a zombie counted as alive");
    assert!(process_alive(live.id()));
    let stale = d.join(format!(".model.safetensors.distc-tmp-{}", dead.id()));
    let busy = d.join(format!(".model.safetensors.distc-tmp-{}", live.id()));
    std::fs::write(&stale, b"half a file").expect("stale");
    std::fs::write(&busy, b"being written").expect("busy");
    write_file(&d.join("model.safetensors"), b"whole").expect("write");
    assert!(!stale.exists(), "the zombie's temporary file was kept");
    assert!(busy.exists(), "a live writer's temporary file was removed");
    live.kill().expect("kill");
    let _ = live.wait();
    let _ = dead.wait();
}
