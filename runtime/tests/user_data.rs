//! Data a user brings (issue 36, item 1): a token stream (`tokens`), named arrays
//! (`tensors`: safetensors, a folder of .npy, .npz) and a CSV table (`csv`). For each:
//! its fields, N workers of batch b drawing one worker's batch N*b (N = 2 and 3), a
//! resumed position continuing the stream, and malformed files named with their path.

use distc_ir::{DType, TensorType};
use distc_runtime::run::data::{Batch, DataSource};
use distc_runtime::{DataSpec, FieldSpec, RuntimeError};
use npyz::WriterBuilder;
use std::collections::HashMap;
use std::path::Path;

fn shapes(fields: &[(&str, DType, &[usize])]) -> HashMap<String, TensorType> {
    fields
        .iter()
        .map(|(n, d, dims)| (n.to_string(), TensorType::new(*d, dims.to_vec())))
        .collect()
}

fn open(
    spec: &DataSpec,
    dir: &Path,
    shapes: &HashMap<String, TensorType>,
    batch: usize,
    rank: usize,
    workers: usize,
) -> distc_runtime::Result<DataSource> {
    DataSource::open(spec, Some(dir), shapes, batch, 7, rank, workers)
}

/// The fields of `shapes` with the batch dimension set to `b`.
fn at_batch(shapes: &HashMap<String, TensorType>, b: usize) -> HashMap<String, TensorType> {
    shapes
        .iter()
        .map(|(n, t)| {
            let mut dims = t.dims().to_vec();
            dims[0] = b;
            (n.clone(), TensorType::new(t.dtype, dims))
        })
        .collect()
}

/// N workers of batch b draw, step by step, what one worker of batch N*b draws; a
/// source skipped to step k's position draws step k's batch.
fn check_sharding_and_resume(spec: &DataSpec, dir: &Path, shapes: &HashMap<String, TensorType>) {
    let b = 4;
    for workers in [2, 3] {
        let mut one = open(spec, dir, &at_batch(shapes, workers * b), workers * b, 0, 1)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut many: Vec<DataSource> = (0..workers)
            .map(|r| open(spec, dir, &at_batch(shapes, b), b, r, workers).expect("opens"))
            .collect();
        let mut wholes: Vec<Batch> = Vec::new();
        for step in 0..5 {
            let whole = one.next_batch().expect("batch");
            let parts: Vec<Batch> = many
                .iter_mut()
                .map(|d| d.next_batch().expect("batch"))
                .collect();
            for (name, t) in &whole {
                let joined: Vec<f64> = parts.iter().flat_map(|p| p[name].to_f64_vec()).collect();
                assert_eq!(
                    t.to_f64_vec(),
                    joined,
                    "{workers} workers: `{name}`, step {step}"
                );
            }
            wholes.push(whole);
        }
        let mut resumed =
            open(spec, dir, &at_batch(shapes, workers * b), workers * b, 0, 1).expect("opens");
        resumed
            .skip_samples(3 * (workers * b) as u64)
            .expect("skips");
        let next = resumed.next_batch().expect("batch");
        for (name, t) in &wholes[3] {
            assert_eq!(t.to_f64_vec(), next[name].to_f64_vec(), "resumed `{name}`");
        }
    }
}

fn message(r: distc_runtime::Result<DataSource>) -> String {
    match r {
        Ok(_) => panic!("opened a malformed source"),
        Err(
            e @ (RuntimeError::Data { .. } | RuntimeError::Io { .. } | RuntimeError::Config(_)),
        ) => e.to_string(),
        Err(e) => panic!("unexpected error kind: {e}"),
    }
}

fn write_tokens(path: &Path, ids: &[u32], width: usize) {
    let bytes: Vec<u8> = match width {
        2 => ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect(),
        _ => ids.iter().flat_map(|&i| i.to_le_bytes()).collect(),
    };
    std::fs::write(path, bytes).expect("writes tokens");
}

fn token_spec(path: &str, eval: Option<&str>, width: usize, context: usize) -> DataSpec {
    DataSpec::Tokens {
        path: path.into(),
        eval_path: eval.map(Into::into),
        width,
        context,
    }
}

#[test]
fn a_token_stream_gives_windows_and_their_next_tokens() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ids: Vec<u32> = (0..500u32).map(|i| (i * 7919) % 1000).collect();
    for width in [2, 4] {
        write_tokens(&dir.path().join("train.bin"), &ids, width);
        write_tokens(&dir.path().join("val.bin"), &ids[..101], width);
        let spec = token_spec("train.bin", Some("val.bin"), width, 8);
        let sh = shapes(&[
            ("tokens", DType::I32, &[4, 8]),
            ("targets", DType::I32, &[4, 8]),
        ]);
        let mut src = open(&spec, dir.path(), &sh, 4, 0, 1).expect("opens");
        let info = src.info();
        assert_eq!(info.train_samples, Some(500 - 8));
        assert_eq!(info.eval_samples, Some(100 / 8));
        assert_eq!(
            info.id_bounds["tokens"],
            *ids.iter().max().expect("ids") as usize + 1
        );
        let batch = src.next_batch().expect("batch");
        let (tok, tgt) = (batch["tokens"].to_f64_vec(), batch["targets"].to_f64_vec());
        for s in 0..4 {
            let start = ids
                .windows(8)
                .position(|w| {
                    w.iter()
                        .zip(&tok[s * 8..])
                        .all(|(a, b)| f64::from(*a) == *b)
                })
                .expect("a window of the stream");
            let want: Vec<f64> = ids[start + 1..start + 9]
                .iter()
                .map(|&i| f64::from(i))
                .collect();
            assert_eq!(
                tgt[s * 8..(s + 1) * 8],
                want[..],
                "targets are the next tokens"
            );
        }
        // Evaluation: the held-out stream's windows in order, `context` apart.
        let eval = src.eval_batches(None).expect("eval");
        assert_eq!(eval.len(), 3);
        let first: Vec<f64> = ids[..8].iter().map(|&i| f64::from(i)).collect();
        assert_eq!(eval[0]["tokens"].to_f64_vec()[..8], first[..]);
        let second: Vec<f64> = ids[8..16].iter().map(|&i| f64::from(i)).collect();
        assert_eq!(eval[0]["tokens"].to_f64_vec()[8..16], second[..]);
        check_sharding_and_resume(&spec, dir.path(), &sh);
    }
}

#[test]
fn a_malformed_token_file_is_named_before_step_1() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sh = shapes(&[
        ("tokens", DType::I32, &[2, 4]),
        ("targets", DType::I32, &[2, 4]),
    ]);
    let missing = message(open(
        &token_spec("none.bin", None, 2, 4),
        dir.path(),
        &sh,
        2,
        0,
        1,
    ));
    assert!(missing.contains("none.bin"), "{missing}");
    std::fs::write(dir.path().join("odd.bin"), [1u8, 0, 2]).expect("writes");
    let odd = message(open(
        &token_spec("odd.bin", None, 2, 4),
        dir.path(),
        &sh,
        2,
        0,
        1,
    ));
    assert!(
        odd.contains("odd.bin") && odd.contains("2-byte tokens"),
        "{odd}"
    );
    write_tokens(&dir.path().join("short.bin"), &[1, 2, 3], 2);
    let short = message(open(
        &token_spec("short.bin", None, 2, 4),
        dir.path(),
        &sh,
        2,
        0,
        1,
    ));
    assert!(
        short.contains("short.bin") && short.contains("holds 3 tokens"),
        "{short}"
    );
    write_tokens(&dir.path().join("wide.bin"), &[1, 2, 3, 4, 5, u32::MAX], 4);
    let wide = message(open(
        &token_spec("wide.bin", None, 4, 4),
        dir.path(),
        &sh,
        2,
        0,
        1,
    ));
    assert!(
        wide.contains("wide.bin") && wide.contains("beyond i32"),
        "{wide}"
    );
    // A relative path needs the data directory; an absolute one does not.
    let abs = dir.path().join("abs.bin");
    write_tokens(&abs, &(0..20).collect::<Vec<_>>(), 2);
    let spec = token_spec(abs.to_str().expect("utf8"), None, 2, 4);
    DataSource::open(&spec, None, &sh, 2, 7, 0, 1).expect("an absolute path opens without --data");
}

fn fields(f: &[(&str, DType, usize)]) -> Vec<FieldSpec> {
    f.iter()
        .map(|&(name, dtype, per_sample)| FieldSpec {
            name: name.into(),
            dtype,
            per_sample,
        })
        .collect()
}

fn tensors_spec(path: &str, eval: Option<&str>, f: Vec<FieldSpec>) -> DataSpec {
    DataSpec::Tensors {
        path: path.into(),
        eval_path: eval.map(Into::into),
        fields: f,
        in_order: false,
    }
}

fn write_safetensors(path: &Path, n: usize, shift: f32) {
    let x: Vec<u8> = (0..n * 3)
        .flat_map(|i| (i as f32 * 0.5 + shift).to_le_bytes())
        .collect();
    let y: Vec<u8> = (0..n as i64).flat_map(|i| (i % 5).to_le_bytes()).collect();
    let views = [
        (
            "x",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n, 3], &x),
        ),
        (
            "y",
            safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![n], &y),
        ),
    ];
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = views
        .into_iter()
        .map(|(k, v)| (k, v.expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("writes safetensors");
}

fn write_npy_folder(dir: &Path, n: usize, shift: f32) {
    std::fs::create_dir_all(dir).expect("folder");
    let x: Vec<f32> = (0..n * 3).map(|i| i as f32 * 0.5 + shift).collect();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&[n as u64, 3])
        .writer(std::io::BufWriter::new(
            std::fs::File::create(dir.join("x.npy")).expect("file"),
        ))
        .begin_nd()
        .expect("npy");
    w.extend(x).expect("writes");
    w.finish().expect("finishes");
    let y: Vec<i64> = (0..n as i64).map(|i| i % 5).collect();
    npyz::to_file_1d(dir.join("y.npy"), y).expect("writes y");
}

#[test]
fn named_arrays_from_safetensors_and_npy_are_fields() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_safetensors(&dir.path().join("train.safetensors"), 60, 0.0);
    write_safetensors(&dir.path().join("test.safetensors"), 20, 100.0);
    write_npy_folder(&dir.path().join("train-npy"), 60, 0.0);
    let f = fields(&[("x", DType::F32, 3), ("y", DType::I32, 1)]);
    let sh = shapes(&[("x", DType::F32, &[4, 3]), ("y", DType::I32, &[4])]);
    for (path, eval) in [
        ("train.safetensors", Some("test.safetensors")),
        ("train-npy", None),
    ] {
        let spec = tensors_spec(path, eval, f.clone());
        let src = open(&spec, dir.path(), &sh, 4, 0, 1).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(src.info().train_samples, Some(60), "{path}");
        let first = src.train_slice(2, 1).expect("slice");
        assert_eq!(
            first["x"].to_f64_vec(),
            vec![3.0, 3.5, 4.0],
            "{path}: row 2 of x"
        );
        assert_eq!(
            first["y"].to_f64_vec(),
            vec![2.0],
            "{path}: y is read as i32"
        );
        if eval.is_some() {
            let e = src.eval_batches(None).expect("eval");
            assert_eq!(e.len(), 5);
            assert_eq!(e[0]["x"].to_f64_vec()[0], 100.0);
        }
        check_sharding_and_resume(&spec, dir.path(), &sh);
    }
}

/// Issue 60, item 5: `np.save` of a transposed array writes it column-major
/// (`fortran_order: True`); its rows are read as the rows it holds, not its bytes in
/// file order (which scrambled the features silently).
#[test]
fn a_column_major_npy_array_is_read_by_its_rows() {
    let dir = tempfile::tempdir().expect("temp dir");
    let n = 60;
    write_npy_folder(&dir.path().join("c"), n, 0.0);
    let fortran = dir.path().join("f");
    write_npy_folder(&fortran, n, 0.0);
    // x[i][j] = (3 i + j) / 2, written column by column.
    let column_major: Vec<f32> = (0..3)
        .flat_map(|j| (0..n).map(move |i| (3 * i + j) as f32 * 0.5))
        .collect();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .order(npyz::Order::Fortran)
        .shape(&[n as u64, 3])
        .writer(std::io::BufWriter::new(
            std::fs::File::create(fortran.join("x.npy")).expect("file"),
        ))
        .begin_nd()
        .expect("npy");
    w.extend(column_major).expect("writes");
    w.finish().expect("finishes");
    let f = fields(&[("x", DType::F32, 3), ("y", DType::I32, 1)]);
    let sh = shapes(&[("x", DType::F32, &[4, 3]), ("y", DType::I32, &[4])]);
    let rows = |folder: &str| {
        let src = open(
            &tensors_spec(folder, None, f.clone()),
            dir.path(),
            &sh,
            4,
            0,
            1,
        )
        .unwrap_or_else(|e| panic!("{folder}: {e}"));
        src.train_slice(0, n).expect("slice")["x"].to_f64_vec()
    };
    let c = rows("c");
    assert_eq!(&c[6..9], &[3.0, 3.5, 4.0]);
    assert_eq!(rows("f"), c, "the column-major file's rows");
}

/// Issue 60, item 5: a FIFO as a data path hung forever (reading it waits for a
/// writer), and `/dev/zero` as a CSV aborted on a 1 GiB allocation: each is refused by
/// its path when opened, for every file source.
#[test]
fn a_pipe_or_a_device_as_a_data_path_is_refused_by_name() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fifo = dir.path().join("fifo.csv");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo");
    let f = fields(&[("x", DType::F32, 1), ("y", DType::I32, 1)]);
    let sh = shapes(&[("x", DType::F32, &[4]), ("y", DType::I32, &[4])]);
    let fifo = fifo.to_string_lossy().into_owned();
    let windows = shapes(&[
        ("tokens", DType::I32, &[4, 4]),
        ("targets", DType::I32, &[4, 4]),
    ]);
    for (spec, sh) in [
        (csv_spec(&fifo, f.clone()), &sh),
        (csv_spec("/dev/zero", f.clone()), &sh),
        (tensors_spec(&fifo, None, f.clone()), &sh),
        (tensors_spec("/dev/zero", None, f.clone()), &sh),
        (token_spec(&fifo, None, 2, 4), &windows),
    ] {
        let m = message(open(&spec, dir.path(), sh, 4, 0, 1));
        assert!(m.contains("not a regular file"), "{spec:?}: {m}");
    }
}

#[test]
fn arrays_that_do_not_fit_the_model_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    write_safetensors(&dir.path().join("t.safetensors"), 10, 0.0);
    let case = |f: Vec<FieldSpec>| {
        let sh: HashMap<String, TensorType> = f
            .iter()
            .map(|f| {
                let dims = if f.per_sample == 1 {
                    vec![2]
                } else {
                    vec![2, f.per_sample]
                };
                (f.name.clone(), TensorType::new(f.dtype, dims))
            })
            .collect();
        message(open(
            &tensors_spec("t.safetensors", None, f),
            dir.path(),
            &sh,
            2,
            0,
            1,
        ))
    };
    let missing = case(fields(&[("x", DType::F32, 3), ("label", DType::I32, 1)]));
    assert!(
        missing.contains("t.safetensors") && missing.contains("no array `label`"),
        "{missing}"
    );
    let shape = case(fields(&[("x", DType::F32, 4), ("y", DType::I32, 1)]));
    assert!(shape.contains("`x` has shape [10, 3]"), "{shape}");
    let float_ids = case(fields(&[("x", DType::I32, 3)]));
    assert!(float_ids.contains("floating-point values"), "{float_ids}");
    std::fs::write(dir.path().join("bad.safetensors"), b"not a header").expect("writes");
    let bad = message(open(
        &tensors_spec("bad.safetensors", None, fields(&[("x", DType::F32, 3)])),
        dir.path(),
        &shapes(&[("x", DType::F32, &[2, 3])]),
        2,
        0,
        1,
    ));
    assert!(
        bad.contains("bad.safetensors") && bad.contains("not a safetensors file"),
        "{bad}"
    );
}

fn csv_spec(path: &str, f: Vec<FieldSpec>) -> DataSpec {
    DataSpec::Csv {
        path: path.into(),
        eval_path: None,
        fields: f,
    }
}

#[test]
fn csv_columns_are_fields_and_a_bad_cell_is_named_by_line_and_column() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut text = "id, height ,label,note\n".to_string();
    for i in 0..40 {
        text += &format!("{i},{}.5,{},row {i}\n", 150 + i, i % 3);
    }
    std::fs::write(dir.path().join("t.csv"), &text).expect("writes");
    let f = fields(&[("height", DType::F32, 1), ("label", DType::I32, 1)]);
    let sh = shapes(&[("height", DType::F32, &[4]), ("label", DType::I32, &[4])]);
    let spec = csv_spec("t.csv", f.clone());
    let src = open(&spec, dir.path(), &sh, 4, 0, 1).expect("opens");
    let row = src.train_slice(5, 1).expect("slice");
    assert_eq!(row["height"].to_f64_vec(), vec![155.5]);
    assert_eq!(row["label"].to_f64_vec(), vec![2.0]);
    check_sharding_and_resume(&spec, dir.path(), &sh);

    std::fs::write(dir.path().join("bad.csv"), "height,label\n1.5,0\n2.5,x\n").expect("writes");
    let bad = message(open(
        &csv_spec("bad.csv", f.clone()),
        dir.path(),
        &sh,
        4,
        0,
        1,
    ));
    assert!(
        bad.contains("bad.csv") && bad.contains("line 3, column 2 (`label`)"),
        "{bad}"
    );
    std::fs::write(dir.path().join("frac.csv"), "height,label\n1.5,0.5\n").expect("writes");
    let frac = message(open(
        &csv_spec("frac.csv", f.clone()),
        dir.path(),
        &sh,
        4,
        0,
        1,
    ));
    assert!(frac.contains("not a whole number"), "{frac}");
    let missing = message(open(
        &csv_spec("t.csv", fields(&[("weight", DType::F32, 1)])),
        dir.path(),
        &shapes(&[("weight", DType::F32, &[4])]),
        4,
        0,
        1,
    ));
    assert!(
        missing.contains("no column `weight`") && missing.contains("height"),
        "{missing}"
    );
}

/// Found by the `data_files` fuzz target (issue 60, item 11): a `.npy` header whose
/// shape multiplies past 64 bits panicked inside npyz (it multiplies unchecked), in a
/// `.npy` folder and in an `.npz` archive alike. It is refused, naming the array.
#[test]
fn a_npy_shape_past_64_bits_is_refused_not_a_panic() {
    let dir = tempfile::tempdir().expect("temp dir");
    let folder = dir.path().join("arrays");
    write_npy_folder(&folder, 8, 0.0);
    let mut dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (18446744073709551615, 3), }"
        .to_string();
    while !(10 + dict.len() + 1).is_multiple_of(64) {
        dict.push(' ');
    }
    dict.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((dict.len() as u16).to_le_bytes());
    bytes.extend(dict.into_bytes());
    bytes.extend([0u8; 96]);
    std::fs::write(folder.join("x.npy"), bytes).expect("writes");
    let f = fields(&[("x", DType::F32, 3), ("y", DType::I32, 1)]);
    let sh = shapes(&[("x", DType::F32, &[4, 3]), ("y", DType::I32, &[4])]);
    let e = message(open(
        &tensors_spec("arrays", None, f),
        dir.path(),
        &sh,
        4,
        0,
        1,
    ));
    assert!(
        e.contains("x.npy") && e.contains("more values than a file can"),
        "{e}"
    );
}

/// Found by the `data_files` fuzz target: the process-wide cache of decoded sources
/// was keyed by source and folder only, so a file rewritten after a first open was
/// served as it had been (an elastic restart in one process read stale data). A file
/// changed since is read again.
#[test]
fn a_data_file_rewritten_after_an_open_is_read_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("t.bin");
    let spec = token_spec("t.bin", None, 2, 4);
    let sh = shapes(&[
        ("tokens", DType::I32, &[2, 4]),
        ("targets", DType::I32, &[2, 4]),
    ]);
    let bound = |ids: &[u32]| {
        write_tokens(&path, ids, 2);
        open(&spec, dir.path(), &sh, 2, 0, 1)
            .expect("opens")
            .info()
            .id_bounds["tokens"]
    };
    assert_eq!(bound(&(0..40).map(|i| i % 10).collect::<Vec<_>>()), 10);
    // (Of another length: a rewrite of the same length within the file system's
    // clock tick keeps the file's time, and is not seen.)
    assert_eq!(bound(&(0..48).map(|i| i % 20).collect::<Vec<_>>()), 20);
}
