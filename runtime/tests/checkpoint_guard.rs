//! Regression tests of issue 20 (what 1,000 damaged checkpoints found): a flipped bit
//! is caught by the tensor's checksum, a stored NaN is refused by name, and what is
//! not a regular file (a FIFO) is refused at once instead of hanging.

use distc_runtime::core::checkpoint::{load, save};
use distc_runtime::Tensor;
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;
use std::path::PathBuf;

fn dir(label: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("distc-guard-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn tensor(values: Vec<f32>) -> Tensor {
    let n = values.len();
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[n]), values).expect("shape"))
}

#[test]
fn a_flipped_bit_is_caught_by_the_tensors_checksum() {
    let d = dir("bit");
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
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_stored_nan_is_refused_naming_the_tensor() {
    let d = dir("nan");
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
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_fifo_is_refused_at_once() {
    let d = dir("fifo");
    let fifo = d.join("state.safetensors");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        println!("skipping: mkfifo is not available");
        return;
    }
    // No writer ever comes: opening the FIFO to read it would block for ever.
    let err = load(&fifo).expect_err("a FIFO is refused").to_string();
    assert!(err.contains("not a regular file"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}
