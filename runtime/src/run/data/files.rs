//! The file-backed sources: MNIST (IDX, gzip), Penn Treebank (text) and MovieLens
//! 100K (`u.data`), decoded into in-memory tables and cached process-wide.
//!
//! * MNIST: `mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`; magic numbers,
//!   counts, 28x28 and file sizes are checked. Pixels are kept as bytes and scaled to
//!   `[0,1]` f32 when a batch is gathered. Train: the 60k set; eval: t10k.
//! * PTB: each line is split on whitespace and `<eos>` appended; the lines are
//!   concatenated into one id stream. The vocabulary comes from `ptb.train.txt` and is
//!   **sorted by frequency** (descending count, ties by the word's bytes), so id 0 is
//!   the most frequent word; it has 10000 entries. A sample is a sliding window:
//!   `context = ids[i..i+C]`, `next = ids[i+C]`, for every `i` (windows cross sentence
//!   boundaries). Train: the train split; eval: the valid split (an out-of-vocabulary
//!   word there maps to `<unk>`).
//! * MovieLens: `ml-100k/u.data`, `user \t item \t rating \t timestamp`; ids minus one,
//!   rating as f32. The held-out split is a permutation seeded with the fixed
//!   [`MOVIELENS_SPLIT_SEED`] (not the run seed, so that runs with different seeds are
//!   evaluated on the same ratings): its first `round(test_fraction * n)` ratings are
//!   held out. Both splits keep the file order.

use super::{mix, Column, Loaded, Table};
use crate::core::config::DataSpec;
use crate::core::error::{Result, RuntimeError};
use flate2::read::GzDecoder;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_pcg::Pcg64;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// Seed of MovieLens' train/held-out split.
pub const MOVIELENS_SPLIT_SEED: u64 = 0x6d6c_3130_306b;

/// A file as the cache knows it: its path, device, inode, length and modification
/// time (seconds, nanoseconds).
type Fingerprint = (PathBuf, u64, u64, u64, i64, i64);

type Cache = Mutex<HashMap<(String, PathBuf, Vec<Fingerprint>), Arc<Loaded>>>;

/// What `spec` reads under `dir`, each file as it is now: a file changed, replaced or
/// added since it was decoded is decoded again, not served from the cache.
fn fingerprints(spec: &DataSpec, dir: Option<&Path>) -> Vec<Fingerprint> {
    use std::os::unix::fs::MetadataExt;
    let mut out: Vec<Fingerprint> = super::data_files(spec, dir)
        .into_iter()
        .map(|p| {
            let m = std::fs::metadata(&p).ok();
            let f = |g: fn(&std::fs::Metadata) -> u64| m.as_ref().map_or(0, g);
            let t = |g: fn(&std::fs::Metadata) -> i64| m.as_ref().map_or(0, g);
            (
                p,
                f(|m| m.dev()),
                f(|m| m.ino()),
                f(|m| m.len()),
                t(|m| m.mtime()),
                t(|m| m.mtime_nsec()),
            )
        })
        .collect();
    out.sort();
    out
}

/// Loads (or finds in the process-wide cache) the data of a file source.
pub(crate) fn load(spec: &DataSpec, dir: Option<&Path>) -> Result<Arc<Loaded>> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let builtin = matches!(
        spec,
        DataSpec::Mnist | DataSpec::Ptb { .. } | DataSpec::Movielens { .. }
    );
    match dir {
        None if builtin => {
            return Err(RuntimeError::Config(format!(
                "data source `{}` reads files: give the data directory with --data or set \
                 DISTC_DATA",
                spec.name()
            )))
        }
        Some(d) if !d.is_dir() => {
            return Err(data_err(
                d,
                "the data directory does not exist (set --data or DISTC_DATA)",
            ))
        }
        _ => {}
    }
    let key = (
        format!("{spec:?}"),
        dir.map(Path::to_path_buf).unwrap_or_default(),
        fingerprints(spec, dir),
    );
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    // Loading under the lock: concurrent openers of one source decode it once.
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = map.get(&key) {
        return Ok(l.clone());
    }
    let under = |sub: &str| dir.map(|d| d.join(sub)).unwrap_or_default();
    let loaded = Arc::new(match spec {
        DataSpec::Mnist => mnist(&under("mnist"))?,
        DataSpec::Ptb { context } => ptb(&under("ptb"), *context)?,
        DataSpec::Movielens { test_fraction } => movielens(&under("ml-100k"), *test_fraction)?,
        DataSpec::Tokens {
            path,
            eval_path,
            width,
            context,
        } => super::user_files::tokens(dir, path, eval_path.as_deref(), *width, *context)?,
        DataSpec::Tensors {
            path,
            eval_path,
            fields,
            ..
        } => super::user_files::tensors(dir, path, eval_path.as_deref(), fields)?,
        DataSpec::Csv {
            path,
            eval_path,
            fields,
        } => super::user_files::csv(dir, path, eval_path.as_deref(), fields)?,
        // Only a source that `needs_files` is loaded.
        _ => {
            return Err(RuntimeError::Internal {
                at: "data loading".into(),
                message: format!("data source `{}` reads no files", spec.name()),
            })
        }
    });
    // The same source's files as they were: never served again.
    map.retain(|k, _| (&k.0, &k.1) != (&key.0, &key.1));
    map.insert(key, loaded.clone());
    Ok(loaded)
}

fn data_err(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Data {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn check_dir(dir: &Path, what: &str) -> Result<()> {
    if dir.is_dir() {
        Ok(())
    } else {
        Err(data_err(
            dir,
            format!("directory not found (expected {what} here)"),
        ))
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    crate::core::output::read_regular(path, u64::MAX).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn read_gz(path: &Path) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    GzDecoder::new(std::io::BufReader::new(file))
        .read_to_end(&mut out)
        .map_err(|e| data_err(path, format!("cannot gunzip: {e}")))?;
    Ok(out)
}

fn be_u32(b: &[u8], at: usize) -> usize {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

/// Reads an IDX image file: (count, pixels).
fn idx_images(path: &Path) -> Result<(usize, Vec<u8>)> {
    let mut b = read_gz(path)?;
    if b.len() < 16 {
        return Err(data_err(
            path,
            format!("{} bytes: too short for an IDX image header", b.len()),
        ));
    }
    let magic = be_u32(&b, 0);
    if magic != 2051 {
        return Err(data_err(
            path,
            format!("magic number {magic:#010x}, expected 0x00000803 (IDX images)"),
        ));
    }
    let (n, rows, cols) = (be_u32(&b, 4), be_u32(&b, 8), be_u32(&b, 12));
    if (rows, cols) != (28, 28) {
        return Err(data_err(
            path,
            format!("images are {rows}x{cols}, expected 28x28"),
        ));
    }
    if b.len() != 16 + n * 784 {
        return Err(data_err(
            path,
            format!(
                "{} bytes after gunzip, expected {} for {n} images",
                b.len(),
                16 + n * 784
            ),
        ));
    }
    b.drain(..16);
    Ok((n, b))
}

/// Reads an IDX label file.
fn idx_labels(path: &Path) -> Result<Vec<i32>> {
    let b = read_gz(path)?;
    if b.len() < 8 {
        return Err(data_err(
            path,
            format!("{} bytes: too short for an IDX label header", b.len()),
        ));
    }
    let magic = be_u32(&b, 0);
    if magic != 2049 {
        return Err(data_err(
            path,
            format!("magic number {magic:#010x}, expected 0x00000801 (IDX labels)"),
        ));
    }
    let n = be_u32(&b, 4);
    if b.len() != 8 + n {
        return Err(data_err(
            path,
            format!(
                "{} bytes after gunzip, expected {} for {n} labels",
                b.len(),
                8 + n
            ),
        ));
    }
    if let Some(p) = b[8..].iter().position(|&l| l > 9) {
        return Err(data_err(
            path,
            format!("label {} of sample {p} is not a digit", b[8 + p]),
        ));
    }
    Ok(b[8..].iter().map(|&l| l as i32).collect())
}

fn mnist_split(dir: &Path, prefix: &str) -> Result<Table> {
    let ipath = dir.join(format!("{prefix}-images-idx3-ubyte.gz"));
    let lpath = dir.join(format!("{prefix}-labels-idx1-ubyte.gz"));
    let (n, pixels) = idx_images(&ipath)?;
    let labels = idx_labels(&lpath)?;
    if labels.len() != n {
        return Err(data_err(
            &lpath,
            format!(
                "{} labels, but {} holds {n} images",
                labels.len(),
                ipath.display()
            ),
        ));
    }
    Ok(Table {
        len: n,
        cols: vec![
            Column::U8Scaled {
                data: Arc::new(pixels),
                per: 784,
            },
            Column::I32 {
                data: Arc::new(labels),
                per: 1,
            },
        ],
    })
}

fn mnist(dir: &Path) -> Result<Loaded> {
    check_dir(dir, "the MNIST IDX .gz files")?;
    Ok(Loaded {
        train: mnist_split(dir, "train")?,
        eval: mnist_split(dir, "t10k")?,
        id_bounds: HashMap::from([("label".to_string(), 10)]),
    })
}

/// The text of a PTB file.
fn ptb_words(path: &Path) -> Result<String> {
    String::from_utf8(read_file(path)?).map_err(|e| data_err(path, format!("not UTF-8: {e}")))
}

/// The words of PTB text, `<eos>` after each line.
fn ptb_tokens(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .flat_map(|l| l.split_whitespace().chain(std::iter::once("<eos>")))
}

fn ptb_windows(stream: Vec<i32>, context: usize) -> Table {
    let len = stream.len().saturating_sub(context);
    let stream = Arc::new(stream);
    Table {
        len,
        cols: vec![
            Column::Window {
                stream: stream.clone(),
                offset: 0,
                width: context,
            },
            Column::Window {
                stream,
                offset: context,
                width: 1,
            },
        ],
    }
}

fn ptb(dir: &Path, context: usize) -> Result<Loaded> {
    check_dir(dir, "ptb.train.txt and ptb.valid.txt")?;
    if context == 0 {
        return Err(RuntimeError::Config(
            "data source `ptb`: context must be positive".into(),
        ));
    }
    let tpath = dir.join("ptb.train.txt");
    let vpath = dir.join("ptb.valid.txt");
    let train_text = ptb_words(&tpath)?;
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for w in ptb_tokens(&train_text) {
        *counts.entry(w).or_insert(0) += 1;
    }
    let mut vocab: Vec<(&str, usize)> = counts.into_iter().collect();
    vocab.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let ids: HashMap<&str, i32> = vocab
        .iter()
        .enumerate()
        .map(|(i, (w, _))| (*w, i as i32))
        .collect();
    let train: Vec<i32> = ptb_tokens(&train_text).map(|w| ids[w]).collect();
    let valid_text = ptb_words(&vpath)?;
    let unk = ids.get("<unk>").copied();
    let mut valid = Vec::new();
    for w in ptb_tokens(&valid_text) {
        match ids.get(w).copied().or(unk) {
            Some(i) => valid.push(i),
            None => {
                return Err(data_err(
                    &vpath,
                    format!("word `{w}` is not in the training vocabulary, which has no <unk>"),
                ))
            }
        }
    }
    if train.len() <= context {
        return Err(data_err(
            &tpath,
            format!("{} words: too few for context {context}", train.len()),
        ));
    }
    let v = vocab.len();
    Ok(Loaded {
        train: ptb_windows(train, context),
        eval: ptb_windows(valid, context),
        id_bounds: HashMap::from([("context".to_string(), v), ("next".to_string(), v)]),
    })
}

fn movielens(dir: &Path, test_fraction: f64) -> Result<Loaded> {
    check_dir(dir, "u.data")?;
    if !(0.0..1.0).contains(&test_fraction) {
        return Err(RuntimeError::Config(format!(
            "data source `movielens`: test_fraction {test_fraction} is not in [0, 1)"
        )));
    }
    let path = dir.join("u.data");
    let text = String::from_utf8(read_file(&path)?)
        .map_err(|e| data_err(&path, format!("not UTF-8: {e}")))?;
    let (mut users, mut items, mut ratings) = (Vec::new(), Vec::new(), Vec::new());
    for (ln, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split('\t').collect();
        let parse = |s: &str| s.trim().parse::<i64>().ok();
        let (Some(u), Some(i), Some(r)) = (
            f.first().and_then(|s| parse(s)),
            f.get(1).and_then(|s| parse(s)),
            f.get(2).and_then(|s| parse(s)),
        ) else {
            return Err(data_err(
                &path,
                format!(
                    "line {}: expected `user\\titem\\trating\\ttimestamp`",
                    ln + 1
                ),
            ));
        };
        if f.len() != 4 || u < 1 || i < 1 || u > i32::MAX as i64 || i > i32::MAX as i64 {
            return Err(data_err(
                &path,
                format!("line {}: malformed rating `{line}`", ln + 1),
            ));
        }
        users.push((u - 1) as i32);
        items.push((i - 1) as i32);
        ratings.push(r as f32);
    }
    let n = users.len();
    if n == 0 {
        return Err(data_err(&path, "no ratings"));
    }
    let mut perm: Vec<usize> = (0..n).collect();
    perm.shuffle(&mut Pcg64::seed_from_u64(mix(
        MOVIELENS_SPLIT_SEED,
        n as u64,
    )));
    let n_test = (test_fraction * n as f64).round() as usize;
    let mut held = vec![false; n];
    for &k in &perm[..n_test] {
        held[k] = true;
    }
    let split = |keep: bool| {
        let idx: Vec<usize> = (0..n).filter(|&k| held[k] == keep).collect();
        Table {
            len: idx.len(),
            cols: vec![
                Column::I32 {
                    data: Arc::new(idx.iter().map(|&k| users[k]).collect()),
                    per: 1,
                },
                Column::I32 {
                    data: Arc::new(idx.iter().map(|&k| items[k]).collect()),
                    per: 1,
                },
                Column::F32 {
                    data: Arc::new(idx.iter().map(|&k| ratings[k]).collect()),
                    per: 1,
                },
            ],
        }
    };
    let bound = |v: &[i32]| v.iter().copied().max().map_or(0, |m| m as usize + 1);
    Ok(Loaded {
        train: split(false),
        eval: split(true),
        id_bounds: HashMap::from([
            ("user".to_string(), bound(&users)),
            ("item".to_string(), bound(&items)),
        ]),
    })
}
