//! Data loaders: real-data sources (MNIST, PTB, MovieLens; need `DISTC_DATA`, else
//! they print `skipping: DISTC_DATA not set`), the synthetic WORKLOADS.md sources, the
//! sharding rule (N workers of batch b == one worker of batch N*b), and errors.

use distc_ir::TensorType;
use distc_runtime::run::data::{data_dir, zipf_cdf, Batch, DataSource};
use distc_runtime::{DataSpec, RuntimeError, Tensor};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

fn real_data() -> Option<PathBuf> {
    let dir = std::env::var_os("DISTC_DATA").filter(|v| !v.is_empty());
    if dir.is_none() {
        println!("skipping: DISTC_DATA not set");
    }
    dir.map(PathBuf::from)
}

fn shapes(fields: &[(&str, TensorType)]) -> HashMap<String, TensorType> {
    fields
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect()
}

fn i32s(b: &Batch, f: &str) -> Vec<i32> {
    b[f].as_i32().expect("i32 field").iter().copied().collect()
}

fn zipf() -> DataSpec {
    DataSpec::ZipfTokens {
        vocab: 100_000,
        context: 8,
        classes: 1000,
        s: 1.1,
    }
}

fn gauss() -> DataSpec {
    DataSpec::GaussianClasses {
        features: 784,
        classes: 10,
    }
}

/// Worker batches of `workers` workers with batch `b`, concatenated per step, compared
/// with one worker of batch `workers * b`, for `steps` steps.
fn check_sharding(
    open: &dyn Fn(usize, usize, usize) -> DataSource,
    workers: usize,
    b: usize,
    steps: usize,
) {
    let mut one = open(workers * b, 0, 1);
    let mut many: Vec<DataSource> = (0..workers).map(|r| open(b, r, workers)).collect();
    for step in 0..steps {
        let whole = one.next_batch().expect("batch");
        let parts: Vec<Batch> = many
            .iter_mut()
            .map(|d| d.next_batch().expect("batch"))
            .collect();
        for (name, t) in &whole {
            let joined: Vec<f64> = parts.iter().flat_map(|p| p[name].to_f64_vec()).collect();
            assert_eq!(t.to_f64_vec(), joined, "field {name}, step {step}");
            assert_eq!(parts[0][name].shape()[0], b);
        }
    }
}

#[test]
fn mnist_loads() {
    let Some(dir) = real_data() else { return };
    let s = shapes(&[
        ("image", TensorType::f32(vec![32, 1, 28, 28])),
        ("label", TensorType::i32(vec![32])),
    ]);
    let mut d = DataSource::open(&DataSpec::Mnist, Some(&dir), &s, 32, 7, 0, 1).expect("open");
    let info = d.info();
    assert_eq!(info.train_samples, Some(60000));
    assert_eq!(info.eval_samples, Some(10000));
    let first = d.train_slice(0, 10).expect("slice");
    assert_eq!(i32s(&first, "label"), vec![5, 0, 4, 1, 9, 2, 1, 3, 1, 4]);
    assert_eq!(first["image"].shape(), &[10, 1, 28, 28]);
    let all = d.train_slice(0, 60000).expect("all");
    let px = all["image"].as_f32().expect("f32");
    assert!(px.iter().all(|&p| (0.0..=1.0).contains(&p)));
    let mean = px.iter().map(|&p| p as f64).sum::<f64>() / px.len() as f64 * 255.0;
    assert!((mean - 33.318).abs() < 0.01, "mean pixel {mean}");
    let mut hist = [0usize; 10];
    for l in i32s(&all, "label") {
        hist[l as usize] += 1;
    }
    assert_eq!(
        hist,
        [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    );
    let b = d.next_batch().expect("batch");
    assert_eq!(b["image"].shape(), &[32, 1, 28, 28]);
    assert_eq!(b["label"].shape(), &[32]);
    // Evaluation: the test set in order, last partial batch dropped.
    let eval = d.eval_batches(None).expect("eval");
    assert_eq!(eval.len(), 10000 / 32);
    assert_eq!(
        i32s(&eval[0], "label")[..10],
        [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    );
    assert_eq!(d.eval_batches(Some(100)).expect("eval").len(), 3);
    // A flat image input and an f64 request work too.
    let flat = shapes(&[("image", TensorType::new(distc_ir::DType::F64, vec![4, 784]))]);
    let mut d2 = DataSource::open(&DataSpec::Mnist, Some(&dir), &flat, 4, 7, 0, 1).expect("open");
    let b = d2.next_batch().expect("batch");
    assert_eq!(b["image"].shape(), &[4, 784]);
    assert!(matches!(b["image"], Tensor::F64(_)));
    assert_eq!(b.len(), 1);
}

#[test]
fn mnist_epochs_reshuffle() {
    let Some(dir) = real_data() else { return };
    let s = shapes(&[("label", TensorType::i32(vec![20000]))]);
    let mut d = DataSource::open(&DataSpec::Mnist, Some(&dir), &s, 20000, 3, 0, 1).expect("open");
    let epoch = |d: &mut DataSource| -> Vec<i32> {
        (0..3)
            .flat_map(|_| i32s(&d.next_batch().expect("batch"), "label"))
            .collect()
    };
    let (e0, e1) = (epoch(&mut d), epoch(&mut d));
    let hist = |v: &[i32]| {
        let mut h = [0usize; 10];
        v.iter().for_each(|&l| h[l as usize] += 1);
        h
    };
    // Each epoch is a permutation of the whole training set, and a different one.
    assert_eq!(hist(&e0), hist(&e1));
    assert_eq!(hist(&e0)[0], 5923);
    assert_ne!(e0, e1);
    // The same seed gives the same order; another seed another.
    let mut again =
        DataSource::open(&DataSpec::Mnist, Some(&dir), &s, 20000, 3, 0, 1).expect("open");
    assert_eq!(epoch(&mut again), e0);
    let mut other =
        DataSource::open(&DataSpec::Mnist, Some(&dir), &s, 20000, 4, 0, 1).expect("open");
    assert_ne!(epoch(&mut other), e0);
}

#[test]
fn mnist_sharding_across_epochs() {
    let Some(dir) = real_data() else { return };
    // 4 workers x 1700 = 6800 per step: step 8 straddles the end of the first epoch.
    let open = |b: usize, r: usize, n: usize| {
        let s = shapes(&[("label", TensorType::i32(vec![b]))]);
        DataSource::open(&DataSpec::Mnist, Some(&dir), &s, b, 11, r, n).expect("open")
    };
    check_sharding(&open, 4, 1700, 10);
}

#[test]
fn ptb_vocab_and_windows() {
    let Some(dir) = real_data() else { return };
    let spec = DataSpec::Ptb { context: 5 };
    let s = shapes(&[
        ("context", TensorType::i32(vec![64, 5])),
        ("next", TensorType::i32(vec![64])),
    ]);
    let mut d = DataSource::open(&spec, Some(&dir), &s, 64, 1, 0, 1).expect("open");
    let info = d.info();
    assert_eq!(info.id_bounds["next"], 10000);
    assert_eq!(info.id_bounds["context"], 10000);
    assert_eq!(info.train_samples, Some(929589 - 5));
    assert_eq!(info.eval_samples, Some(73760 - 5));
    // Windows: sample i+1's context is sample i's shifted by one, then its next word.
    let w = d.train_slice(0, 2).expect("slice");
    let (c, n) = (i32s(&w, "context"), i32s(&w, "next"));
    assert_eq!(c[5..9], c[1..5]);
    assert_eq!(c[9], n[0]);
    let b = d.next_batch().expect("batch");
    assert_eq!(b["context"].shape(), &[64, 5]);
    assert!(i32s(&b, "context").iter().all(|&i| (0..10000).contains(&i)));
    assert_eq!(d.eval_batches(Some(640)).expect("eval").len(), 10);
    let open = |b: usize, r: usize, n: usize| {
        let s = shapes(&[("next", TensorType::i32(vec![b]))]);
        DataSource::open(&spec, Some(&dir), &s, b, 5, r, n).expect("open")
    };
    check_sharding(&open, 3, 100, 4);
}

#[test]
fn movielens_split() {
    let Some(dir) = real_data() else { return };
    let spec = DataSpec::Movielens { test_fraction: 0.1 };
    let d = DataSource::open(&spec, Some(&dir), &HashMap::new(), 100, 1, 0, 1).expect("open");
    let info = d.info();
    assert_eq!(info.train_samples, Some(90000));
    assert_eq!(info.eval_samples, Some(10000));
    assert_eq!(info.id_bounds["user"], 943);
    assert_eq!(info.id_bounds["item"], 1682);
    let eval = d.eval_batches(None).expect("eval");
    assert_eq!(eval.len(), 100);
    let train = d.train_slice(0, 90000).expect("train");
    let ratings = |b: &Batch| b["rating"].to_f64_vec();
    let mut counts = [0usize; 6];
    for r in ratings(&train)
        .into_iter()
        .chain(eval.iter().flat_map(ratings))
    {
        counts[r as usize] += 1;
    }
    assert_eq!(counts[1..], [6110, 11370, 27145, 34174, 21201]);
    // Held-out pairs are not training pairs' duplicates of the same rating line: the
    // split is a partition of the 100000 lines (same counts above); it is also
    // independent of the run seed.
    let d2 = DataSource::open(&spec, Some(&dir), &HashMap::new(), 100, 99, 0, 1).expect("open");
    assert_eq!(
        d2.eval_batches(Some(300)).expect("eval"),
        d.eval_batches(Some(300)).expect("eval")
    );
    let mut d3 = d2;
    let b = d3.next_batch().expect("batch");
    assert_eq!(b["user"].shape(), &[100]);
    assert!(matches!(b["rating"], Tensor::F32(_)));
    let open = |b: usize, r: usize, n: usize| {
        DataSource::open(&spec, Some(&dir), &HashMap::new(), b, 5, r, n).expect("open")
    };
    check_sharding(&open, 2, 500, 3);
}

#[test]
fn zipf_sparsity_matches_workloads() {
    let s = shapes(&[
        ("ids", TensorType::i32(vec![256, 8])),
        ("label", TensorType::i32(vec![256])),
    ]);
    let mut d = DataSource::open(&zipf(), None, &s, 256, 1001, 0, 1).expect("open");
    let m = d.mean_distinct_ids("ids", 100).expect("distinct");
    assert!((m - 862.5).abs() < 0.03 * 862.5, "mean distinct ids {m}");
    // Measuring does not advance the stream.
    let mut fresh = DataSource::open(&zipf(), None, &s, 256, 1001, 0, 1).expect("open");
    let b = d.next_batch().expect("batch");
    assert_eq!(b, fresh.next_batch().expect("batch"));
    // Shapes and labels.
    assert_eq!(b["ids"].shape(), &[256, 8]);
    let ids = i32s(&b, "ids");
    assert!(ids.iter().all(|&i| (0..100_000).contains(&i)));
    let labels = i32s(&b, "label");
    for (row, &l) in ids.chunks(8).zip(&labels) {
        assert_eq!(l, row[7] % 1000);
    }
    // Zipf: id 0 has probability 1/H(100000, 1.1), about 0.135.
    let expected = zipf_cdf(100_000, 1.1)[0];
    assert!((expected - 0.135).abs() < 0.005, "{expected}");
    let p0 = ids.iter().filter(|&&i| i == 0).count() as f64 / ids.len() as f64;
    assert!((p0 - expected).abs() < 0.03, "P(id=0) = {p0}");
    // The union over 2 workers (WORKLOADS.md: 1521 rows on average).
    let mut w1 = DataSource::open(&zipf(), None, &s, 256, 1001, 1, 2).expect("open");
    let mut total = 0;
    for _ in 0..20 {
        let mut u: HashSet<i32> = i32s(&fresh.next_batch().expect("b"), "ids")
            .into_iter()
            .collect();
        u.extend(i32s(&w1.next_batch().expect("b"), "ids"));
        total += u.len();
    }
    let union = total as f64 / 20.0;
    assert!((union - 1521.0).abs() < 0.04 * 1521.0, "union {union}");
}

#[test]
fn synthetic_worker_seeds() {
    // Default (WORKLOADS.md): worker r of N draws from seed + r.
    let s = HashMap::new();
    for spec in [zipf(), gauss()] {
        let mut w2 = DataSource::open(&spec, None, &s, 16, 50, 2, 4).expect("open");
        let mut alone = DataSource::open(&spec, None, &s, 16, 52, 0, 1).expect("open");
        for _ in 0..3 {
            assert_eq!(w2.next_batch().expect("b"), alone.next_batch().expect("b"));
        }
        let mut w0 = DataSource::open(&spec, None, &s, 16, 50, 0, 4).expect("open");
        let mut w1 = DataSource::open(&spec, None, &s, 16, 50, 1, 4).expect("open");
        assert_ne!(w0.next_batch().expect("b"), w1.next_batch().expect("b"));
    }
}

#[test]
fn synthetic_global_stream_sharding() {
    for spec in [zipf(), gauss()] {
        let open = |b: usize, r: usize, n: usize| {
            DataSource::open_global(&spec, None, &HashMap::new(), b, 9, r, n).expect("open")
        };
        check_sharding(&open, 4, 8, 3);
        // One global worker is the plain source of the same seed.
        let mut g = open(32, 0, 1);
        let mut p = DataSource::open(&spec, None, &HashMap::new(), 32, 9, 0, 1).expect("open");
        assert_eq!(g.next_batch().expect("b"), p.next_batch().expect("b"));
    }
}

#[test]
fn gaussian_classes_distribution() {
    let s = shapes(&[
        ("x", TensorType::f32(vec![128, 784])),
        ("label", TensorType::i32(vec![128])),
    ]);
    let mut d = DataSource::open(&gauss(), None, &s, 128, 2001, 0, 1).expect("open");
    let b = d.next_batch().expect("batch");
    assert_eq!(b["x"].shape(), &[128, 784]);
    let x = b["x"].to_f64_vec();
    let mean = x.iter().sum::<f64>() / x.len() as f64;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / x.len() as f64;
    assert!(
        mean.abs() < 0.02 && (var - 1.0).abs() < 0.03,
        "mean {mean} var {var}"
    );
    let labels = i32s(&b, "label");
    assert!(labels.iter().all(|&l| (0..10).contains(&l)));
    assert!(labels.iter().collect::<HashSet<_>>().len() == 10);
    assert_eq!(d.mean_distinct_ids("label", 5).expect("distinct"), 10.0);
    assert!(d.mean_distinct_ids("x", 1).is_err());
}

#[test]
fn synthetic_eval_is_fixed_and_held_out() {
    let s = HashMap::new();
    let mut d = DataSource::open(&zipf(), None, &s, 64, 1001, 1, 2).expect("open");
    let e = d.eval_batches(None).expect("eval");
    assert_eq!(e.len(), 10);
    assert_eq!(d.eval_batches(Some(200)).expect("eval").len(), 3);
    assert!(d.eval_batches(Some(10)).expect("eval").is_empty());
    // Same on every worker, stable across calls and training, unlike training data.
    let d0 = DataSource::open(&zipf(), None, &s, 64, 1001, 0, 2).expect("open");
    assert_eq!(d0.eval_batches(None).expect("eval"), e);
    let train = d.next_batch().expect("batch");
    assert_ne!(train, e[0]);
    assert_eq!(d.eval_batches(None).expect("eval"), e);
}

#[test]
fn errors_name_what_is_wrong() {
    let missing = Path::new("/nonexistent/distc-data-dir");
    let err = DataSource::open(&DataSpec::Mnist, Some(missing), &HashMap::new(), 8, 0, 0, 1)
        .expect_err("missing dir");
    assert!(matches!(err, RuntimeError::Data { .. }));
    assert!(
        err.to_string().contains("/nonexistent/distc-data-dir"),
        "{err}"
    );
    // An existing directory without the dataset names the dataset's directory.
    let tmp = tempfile::tempdir().expect("tmp");
    let empty = tmp.path();
    let err = DataSource::open(
        &DataSpec::Ptb { context: 3 },
        Some(empty),
        &HashMap::new(),
        8,
        0,
        0,
        1,
    )
    .expect_err("no ptb");
    assert!(
        err.to_string()
            .contains(&*empty.join("ptb").to_string_lossy()),
        "{err}"
    );
    std::fs::create_dir_all(empty.join("mnist")).expect("mkdir");
    let err = DataSource::open(&DataSpec::Mnist, Some(empty), &HashMap::new(), 8, 0, 0, 1)
        .expect_err("no files");
    assert!(
        err.to_string().contains("train-images-idx3-ubyte.gz"),
        "{err}"
    );
    // No directory at all names the ways to give one.
    let err =
        DataSource::open(&DataSpec::Mnist, None, &HashMap::new(), 8, 0, 0, 1).expect_err("no dir");
    assert!(err.to_string().contains("DISTC_DATA") && err.to_string().contains("--data"));
    // Inputs that the source does not provide, or of the wrong size or dtype.
    let bad = shapes(&[("pixels", TensorType::f32(vec![8, 784]))]);
    let err = DataSource::open(&gauss(), None, &bad, 8, 0, 0, 1).expect_err("field");
    assert!(err.to_string().contains("pixels"), "{err}");
    let bad = shapes(&[("x", TensorType::f32(vec![8, 700]))]);
    assert!(DataSource::open(&gauss(), None, &bad, 8, 0, 0, 1).is_err());
    let bad = shapes(&[("label", TensorType::f32(vec![8]))]);
    assert!(DataSource::open(&gauss(), None, &bad, 8, 0, 0, 1).is_err());
    assert!(DataSource::open(&gauss(), None, &HashMap::new(), 8, 0, 2, 2).is_err());
    assert!(DataSource::open(&gauss(), None, &HashMap::new(), 0, 0, 0, 1).is_err());
}

#[test]
fn data_dir_resolution() {
    assert_eq!(data_dir(Some(Path::new("/x"))), Some(PathBuf::from("/x")));
}

/// Issue 20: a resumed run skips to its data position in O(1) on synthetic sources
/// (a position of 1e19 samples hung a linear fast-forward): skipping `k` steps'
/// samples gives the batch drawing `k` batches gives, on both streams, for odd
/// feature counts too (the Gaussian source draws normals in pairs); a skip of 2^61
/// steps returns at once, and a position past any stream is refused.
#[test]
fn synthetic_sources_skip_in_constant_time() {
    let odd = DataSpec::GaussianClasses {
        features: 5,
        classes: 3,
    };
    for (spec, fields) in [
        (
            zipf(),
            vec![
                ("ids", TensorType::i32(vec![4, 8])),
                ("label", TensorType::i32(vec![4])),
            ],
        ),
        (
            odd,
            vec![
                ("x", TensorType::f32(vec![4, 5])),
                ("label", TensorType::i32(vec![4])),
            ],
        ),
    ] {
        let s = shapes(&fields);
        for global in [false, true] {
            let open = || {
                let open = if global {
                    DataSource::open_global
                } else {
                    DataSource::open
                };
                open(&spec, None, &s, 4, 7, 1, 3).expect("open")
            };
            let mut walked = open();
            for _ in 0..5 {
                walked.next_batch().expect("batch");
            }
            let mut skipped = open();
            skipped.skip_samples(5 * 4 * 3).expect("skip");
            assert_eq!(
                walked.next_batch().expect("batch"),
                skipped.next_batch().expect("batch"),
                "{} (global stream: {global})",
                spec.name()
            );
            let started = std::time::Instant::now();
            open().skip_samples(1 << 61).expect("a far skip");
            assert!(started.elapsed().as_secs() < 5);
            let err = open()
                .skip_samples(10_000_000_000_000_000_000)
                .expect_err("past any stream");
            assert!(err.to_string().contains("beyond any stream"), "{err}");
        }
    }
}
