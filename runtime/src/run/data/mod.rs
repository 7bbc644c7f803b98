//! Data loaders: the sources a plan's `train` block names (see [`DataSpec`]), turned
//! into batches of named tensors for the executor.
//!
//! Two families:
//!
//! * **File sources** (MNIST, Penn Treebank, MovieLens 100K) read the data directory
//!   (`--data` or `DISTC_DATA`; the data is never copied into the repository). The
//!   decoded data is cached process-wide, keyed by source, directory and each file's
//!   identity, length and time, so opening the same source again (tests, evaluation,
//!   several workers in one process) is cheap, and a file changed since is read again.
//! * **Synthetic sources** (`zipf_tokens` = WORKLOADS.md W1, `gaussian_classes` = W2)
//!   generate every batch from a seeded `Pcg64`.
//!
//! # Sharding and the global stream
//!
//! Worker `rank` of `workers`, each with `batch` samples per step, `G = workers*batch`:
//!
//! * File sources: epoch `e`'s order is a permutation of the training samples seeded
//!   from `(seed, e)` only (never the rank), and the epochs are concatenated into one
//!   endless stream. Step `t` is the global slice `[t*G, (t+1)*G)` of that stream and
//!   worker `rank` takes its sub-slice `[rank*batch, (rank+1)*batch)`. Hence one worker
//!   with batch `N*b` sees at step `t` exactly the concatenation, in rank order, of
//!   what `N` workers with batch `b` see at step `t`. Batches may straddle epochs.
//! * Synthetic sources, [`DataSource::open`]: as WORKLOADS.md specifies, worker `r`
//!   draws from its own generator seeded with `seed + r`, batch after batch. This is
//!   *not* the same data as one worker with batch `N*b` (that one would use `seed`
//!   alone); it is what the benchmark defines, and what other systems are measured on.
//! * Synthetic sources, [`DataSource::open_global`]: the generator is seeded with
//!   `seed` on every worker, each step generates the whole global batch of `G` samples
//!   and worker `rank` keeps rows `[rank*batch, (rank+1)*batch)`: the same slicing rule
//!   as file sources, for verifying a distributed run against a single-device one.
//!   (It generates `workers` times more than it keeps; it is for verification.)
//!   For file sources `open_global` is the same as `open`.
//!
//! # Evaluation data
//!
//! [`DataSource::eval_batches`] returns the held-out set in its fixed order (no
//! shuffling, no sharding: every worker sees the same set), cut into batches of
//! `batch`; **the last partial batch is dropped**. MNIST: the 10k test set; PTB: the
//! windows of the valid split; MovieLens: the held-out ratings; synthetic: a fixed
//! set generated in one chunk from `seed ^ 0x5eed_e7a1` (rank-independent) with
//! `max_samples` samples (default `10 * batch`), rounded down to whole batches.
//!
//! # Fields and shapes
//!
//! `shapes` maps each model input to its type (batch dimension first). A batch holds
//! exactly those fields, each sample reshaped to `dims[1..]` (which must hold the
//! field's elements per sample; the batch dimension itself is taken from `batch`).
//! An f32 field may be requested as f64 (gradient checks). If `shapes` is empty, a
//! batch holds every field of the source with its default shape (`[B]` for one value
//! per sample, `[B, n]` otherwise).

mod files;
mod open;
mod synthetic;
mod user_files;

pub use files::MOVIELENS_SPLIT_SEED;
pub use open::open_data;
pub(crate) use open::open_source;
pub use synthetic::zipf_cdf;
pub use user_files::read_model_inputs;

use crate::core::config::DataSpec;
use crate::core::error::{Result, RuntimeError};
use crate::core::value::Tensor;
use distc_ir::{DType, TensorType};
use ndarray::{ArrayD, IxDyn};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_pcg::Pcg64;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One batch: field name -> tensor, shaped `[batch, per-sample dims given by shapes]`.
pub type Batch = HashMap<String, Tensor>;

/// The salt of the synthetic evaluation set's seed (`seed ^ EVAL_SEED_SALT`).
pub const EVAL_SEED_SALT: u64 = 0x5eed_e7a1;

/// Resolves the data directory: `explicit` if given, else the environment variable
/// `DISTC_DATA` (when set and non-empty), else `None`.
pub fn data_dir(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    match std::env::var_os("DISTC_DATA") {
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => None,
    }
}

/// Every file a command reads, which none of its outputs may replace (issue 60,
/// item 1: `--save train.safetensors` replaced the training set): the files it was
/// given (`given`: the model or plan, the weights or state it starts from) and those
/// `spec` reads from the data directory (`data`, or `DISTC_DATA`; a folder's files
/// one by one). Data paths that do not exist are left out: nothing there to lose.
pub fn files_read(given: &[&Path], spec: &DataSpec, data: Option<&Path>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = given.iter().map(|p| p.to_path_buf()).collect();
    out.extend(data_files(spec, data_dir(data).as_deref()));
    out
}

/// The files `spec` reads from the data directory `dir`.
fn data_files(spec: &DataSpec, dir: Option<&Path>) -> Vec<PathBuf> {
    let at = |p: &str| {
        let p = Path::new(p);
        if p.is_absolute() {
            Some(p.to_path_buf())
        } else {
            dir.map(|d| d.join(p))
        }
    };
    let named: Vec<Option<PathBuf>> = match spec {
        DataSpec::Mnist => vec![dir.map(|d| d.join("mnist"))],
        DataSpec::Ptb { .. } => vec![dir.map(|d| d.join("ptb"))],
        DataSpec::Movielens { .. } => vec![dir.map(|d| d.join("ml-100k"))],
        DataSpec::Tokens {
            path, eval_path, ..
        }
        | DataSpec::Tensors {
            path, eval_path, ..
        }
        | DataSpec::Csv {
            path, eval_path, ..
        } => std::iter::once(path)
            .chain(eval_path)
            .map(|p| at(p))
            .collect(),
        DataSpec::ZipfTokens { .. } | DataSpec::GaussianClasses { .. } => Vec::new(),
    };
    let mut out = Vec::new();
    for p in named.into_iter().flatten() {
        match std::fs::read_dir(&p) {
            Ok(entries) => out.extend(entries.flatten().map(|e| e.path())),
            Err(_) if p.exists() => out.push(p),
            Err(_) => {}
        }
    }
    out
}

/// Sizes of a source, for reports and for the compiler's checks.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceInfo {
    /// Training samples (file sources; `None` for endless synthetic sources).
    pub train_samples: Option<usize>,
    /// Held-out samples available (file sources; `None` for synthetic sources, whose
    /// evaluation set is generated to the requested size).
    pub eval_samples: Option<usize>,
    /// For each id-typed field: ids lie in `0..bound` (PTB: the vocabulary size;
    /// MovieLens: `max id + 1` of users and items; labels: the number of classes).
    pub id_bounds: HashMap<String, usize>,
}

/// Column data for `n` samples of one field, `per` values per sample, row-major.
#[derive(Clone, Debug)]
pub(crate) enum ColData {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl ColData {
    /// Rows `[start, start+len)` of a column with `per` values per row.
    fn rows(&self, per: usize, start: usize, len: usize) -> ColData {
        let r = start * per..(start + len) * per;
        match self {
            ColData::F32(v) => ColData::F32(v[r].to_vec()),
            ColData::I32(v) => ColData::I32(v[r].to_vec()),
        }
    }
}

/// One column of an in-memory table of samples.
#[derive(Clone, Debug)]
pub(crate) enum Column {
    /// Bytes, `per` per sample, scaled by 1/255 to f32 (MNIST pixels).
    U8Scaled { data: Arc<Vec<u8>>, per: usize },
    /// f32 values, `per` per sample.
    F32 { data: Arc<Vec<f32>>, per: usize },
    /// i32 values, `per` per sample.
    I32 { data: Arc<Vec<i32>>, per: usize },
    /// Sliding windows over a token stream: sample `i` is
    /// `stream[i+offset .. i+offset+width]`.
    Window {
        stream: Arc<Vec<i32>>,
        offset: usize,
        width: usize,
    },
    /// Windows of a token file read where they lie: sample `i` is its tokens
    /// `[i*stride + offset, i*stride + offset + width)`.
    Tokens {
        stream: Arc<user_files::TokenStream>,
        stride: usize,
        offset: usize,
        width: usize,
    },
}

impl Column {
    /// The samples `idx`, in that order.
    fn gather(&self, idx: &[usize]) -> Result<ColData> {
        Ok(match self {
            Column::U8Scaled { data, per } => {
                let mut out = Vec::with_capacity(idx.len() * per);
                for &i in idx {
                    out.extend(
                        data[i * per..(i + 1) * per]
                            .iter()
                            .map(|&b| b as f32 / 255.0),
                    );
                }
                ColData::F32(out)
            }
            Column::F32 { data, per } => {
                let mut out = Vec::with_capacity(idx.len() * per);
                for &i in idx {
                    out.extend_from_slice(&data[i * per..(i + 1) * per]);
                }
                ColData::F32(out)
            }
            Column::I32 { data, per } => {
                let mut out = Vec::with_capacity(idx.len() * per);
                for &i in idx {
                    out.extend_from_slice(&data[i * per..(i + 1) * per]);
                }
                ColData::I32(out)
            }
            Column::Window {
                stream,
                offset,
                width,
            } => {
                let mut out = Vec::with_capacity(idx.len() * width);
                for &i in idx {
                    out.extend_from_slice(&stream[i + offset..i + offset + width]);
                }
                ColData::I32(out)
            }
            Column::Tokens {
                stream,
                stride,
                offset,
                width,
            } => {
                let mut out = Vec::with_capacity(idx.len() * width);
                for &i in idx {
                    stream.extend(&mut out, i * stride + offset, *width)?;
                }
                ColData::I32(out)
            }
        })
    }
}

/// An in-memory set of samples: one column per field, in [`DataSpec::fields`] order.
#[derive(Clone, Debug)]
pub(crate) struct Table {
    pub(crate) len: usize,
    pub(crate) cols: Vec<Column>,
}

/// A file source's decoded data.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub(crate) train: Table,
    pub(crate) eval: Table,
    pub(crate) id_bounds: HashMap<String, usize>,
}

/// What a batch holds of one field.
#[derive(Clone, Debug)]
struct OutField {
    name: String,
    /// Index into the source's fields / table columns.
    col: usize,
    /// Requested dtype.
    dtype: DType,
    /// Per-sample dims (without the batch dim).
    dims: Vec<usize>,
}

/// The endless, epoch-concatenated shuffled order of a file source's training set.
#[derive(Clone, Debug)]
struct Shuffled {
    n: usize,
    seed: u64,
    /// File order, every epoch (the source's `shuffle = false`).
    in_order: bool,
    /// The next step.
    step: u64,
    /// Stream position of step 0 (samples a resumed run skipped).
    base: u64,
    /// The most recently used epoch permutations.
    perms: Vec<(u64, Arc<Vec<u32>>)>,
}

impl Shuffled {
    fn perm(&mut self, epoch: u64) -> Arc<Vec<u32>> {
        if let Some((_, p)) = self.perms.iter().find(|(e, _)| *e == epoch) {
            return p.clone();
        }
        let mut v: Vec<u32> = (0..self.n as u32).collect();
        if !self.in_order {
            let mut rng = Pcg64::seed_from_u64(mix(mix(self.seed, 0x5417_f1e5), epoch));
            v.shuffle(&mut rng);
        }
        let p = Arc::new(v);
        self.perms.push((epoch, p.clone()));
        if self.perms.len() > 2 {
            self.perms.remove(0);
        }
        p
    }

    /// The training-set indices at stream positions `[start, start+len)`.
    fn indices(&mut self, start: u64, len: usize) -> Vec<usize> {
        let n = self.n as u64;
        let mut out = Vec::with_capacity(len);
        let mut pos = start;
        let end = start + len as u64;
        while pos < end {
            let epoch = pos / n;
            let perm = self.perm(epoch);
            let upto = end.min((epoch + 1) * n);
            out.extend(
                perm[(pos - epoch * n) as usize..(upto - epoch * n) as usize]
                    .iter()
                    .map(|&i| i as usize),
            );
            pos = upto;
        }
        out
    }
}

/// Where the next training batch comes from.
#[derive(Clone, Debug)]
enum Cursor {
    Files(Shuffled),
    Synthetic(Pcg64),
}

#[derive(Debug)]
enum Backing {
    Files(Arc<Loaded>),
    Synthetic(synthetic::Generator),
}

/// A data source opened for one worker: endless shuffled training batches and the
/// held-out evaluation set.
#[derive(Debug)]
pub struct DataSource {
    spec: DataSpec,
    batch: usize,
    rank: usize,
    workers: usize,
    seed: u64,
    global_stream: bool,
    fields: Vec<OutField>,
    backing: Backing,
    cursor: Cursor,
    /// Batches drawn ahead by [`DataSource::preload`], served first.
    preloaded: std::collections::VecDeque<Batch>,
}

impl DataSource {
    /// Opens `spec` for worker `rank` of `workers`, `batch` samples per step.
    ///
    /// `dir`: the data directory (file sources only; `None` is an error naming
    /// `DISTC_DATA` and `--data`). `shapes`: the model input type of each field it
    /// needs (batch dim first); each sample is reshaped to it. `seed`: shuffling or
    /// generation seed. Synthetic sources use `seed + rank` per worker, as WORKLOADS.md
    /// says (see the module doc; [`DataSource::open_global`] slices one global stream
    /// instead).
    pub fn open(
        spec: &DataSpec,
        dir: Option<&Path>,
        shapes: &HashMap<String, TensorType>,
        batch: usize,
        seed: u64,
        rank: usize,
        workers: usize,
    ) -> Result<DataSource> {
        Self::open_impl(spec, dir, shapes, batch, seed, rank, workers, false)
    }

    /// Like [`DataSource::open`], but synthetic sources follow the file sources'
    /// slicing rule: every worker generates the global batch of `workers * batch`
    /// samples from `seed` and keeps its rows, so one worker with batch `N*b` sees the
    /// concatenation of what `N` workers with batch `b` see. For verification.
    pub fn open_global(
        spec: &DataSpec,
        dir: Option<&Path>,
        shapes: &HashMap<String, TensorType>,
        batch: usize,
        seed: u64,
        rank: usize,
        workers: usize,
    ) -> Result<DataSource> {
        Self::open_impl(spec, dir, shapes, batch, seed, rank, workers, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn open_impl(
        spec: &DataSpec,
        dir: Option<&Path>,
        shapes: &HashMap<String, TensorType>,
        batch: usize,
        seed: u64,
        rank: usize,
        workers: usize,
        global_stream: bool,
    ) -> Result<DataSource> {
        if batch == 0 {
            return Err(setting(spec, "the batch size must be positive"));
        }
        // The launcher's part of the mesh's parts (the compiler's: the one part).
        if workers == 0 || rank >= workers {
            return Err(RuntimeError::internal(
                "the data loader",
                format!(
                    "data source `{}`: worker rank {rank} is not in 0..{workers}",
                    spec.name()
                ),
            ));
        }
        let fields = out_fields(spec, shapes)?;
        let (backing, cursor) = if spec.needs_files() {
            let loaded = files::load(spec, dir)?;
            let n = loaded.train.len;
            if n == 0 {
                return Err(RuntimeError::Data {
                    path: dir.map(Path::to_path_buf).unwrap_or_default(),
                    message: format!("data source `{}` has no training samples", spec.name()),
                });
            }
            let cursor = Cursor::Files(Shuffled {
                n,
                seed,
                in_order: spec.in_order(),
                step: 0,
                base: 0,
                perms: Vec::new(),
            });
            (Backing::Files(loaded), cursor)
        } else {
            let generator = synthetic::Generator::new(spec)?;
            let s = if global_stream {
                seed
            } else {
                seed.wrapping_add(rank as u64)
            };
            (
                Backing::Synthetic(generator),
                Cursor::Synthetic(Pcg64::seed_from_u64(s)),
            )
        };
        Ok(DataSource {
            spec: spec.clone(),
            batch,
            rank,
            workers,
            seed,
            global_stream,
            fields,
            backing,
            cursor,
            preloaded: std::collections::VecDeque::new(),
        })
    }

    /// The source this was opened from.
    pub fn spec(&self) -> &DataSpec {
        &self.spec
    }

    /// Samples per batch (of this worker).
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Whether synthetic data follows the global slicing rule ([`DataSource::open_global`]).
    pub fn global_stream(&self) -> bool {
        self.global_stream
    }

    /// The model `graph` against what this source's files hold ([`check_model`], with
    /// the id bounds read from them): what `distc train` checks before step 1.
    pub fn check_model(&self, graph: &distc_ir::Graph, batch: usize) -> Result<()> {
        let info = self.info();
        let bounds: Vec<(&str, usize)> = info
            .id_bounds
            .iter()
            .map(|(f, b)| (f.as_str(), *b))
            .collect();
        check_model(graph, &self.spec, batch, &bounds)
    }

    /// Sizes of the source.
    pub fn info(&self) -> SourceInfo {
        match &self.backing {
            Backing::Files(l) => SourceInfo {
                train_samples: Some(l.train.len),
                eval_samples: Some(l.eval.len),
                id_bounds: l.id_bounds.clone(),
            },
            Backing::Synthetic(g) => SourceInfo {
                train_samples: None,
                eval_samples: None,
                id_bounds: g.id_bounds(),
            },
        }
    }

    /// The next training batch of this worker (endless; file sources are reshuffled
    /// every epoch).
    pub fn next_batch(&mut self) -> Result<Batch> {
        match self.preloaded.pop_front() {
            Some(b) => Ok(b),
            None => self.draw_batch(),
        }
    }

    /// Draws a training batch from the stream, advancing the cursor.
    fn draw_batch(&mut self) -> Result<Batch> {
        let need: Vec<usize> = self.fields.iter().map(|f| f.col).collect();
        let mut cursor = self.cursor.clone();
        let cols = self.draw(&mut cursor, &need)?;
        self.cursor = cursor;
        self.build(cols, self.batch)
    }

    /// Moves the training stream past `samples` samples drawn over all workers (a
    /// resumed run's data position). File sources continue at exactly that position of
    /// the shuffled stream, whatever the batch and worker count; synthetic sources
    /// draw and drop whole steps of this source's layout (`samples` / global batch),
    /// which is the same stream when the layout is the one that was saved.
    pub fn skip_samples(&mut self, samples: u64) -> Result<()> {
        if samples > MAX_POSITION {
            return Err(RuntimeError::state(format!(
                "the training state's data position, {samples} samples, is beyond any \
                 stream (at most 2^62): the state is damaged"
            )));
        }
        let global = (self.batch * self.workers) as u64;
        let per_draw = if self.global_stream {
            self.batch * self.workers
        } else {
            self.batch
        };
        match (&mut self.cursor, &self.backing) {
            (Cursor::Files(s), _) => s.base += samples,
            // Every draw consumes the same number of generator outputs: skip them at once.
            (Cursor::Synthetic(rng), Backing::Synthetic(g)) => {
                rng.advance(u128::from(samples / global.max(1)) * g.draws(per_draw));
            }
            _ => {}
        }
        Ok(())
    }

    /// Draws the next `steps` training batches now, so that the steps that read them
    /// time training alone (WORKLOADS.md generates benchmark data before timing).
    /// The batches are the ones [`DataSource::next_batch`] would have returned.
    pub fn preload(&mut self, steps: usize) -> Result<()> {
        for _ in 0..steps {
            let b = self.draw_batch()?;
            self.preloaded.push_back(b);
        }
        Ok(())
    }

    /// Hands over the preloaded batches not served yet, in order (a device backend
    /// keeps them in its own memory); [`DataSource::next_batch`] then continues after
    /// them.
    pub fn take_preloaded(&mut self) -> Vec<Batch> {
        self.preloaded.drain(..).collect()
    }

    /// Puts batches [`DataSource::take_preloaded`] took back in front, in order.
    pub fn restore_preloaded(&mut self, batches: Vec<Batch>) {
        for b in batches.into_iter().rev() {
            self.preloaded.push_front(b);
        }
    }

    /// Samples [`DataSource::eval_batches`] gives: whole batches of the held-out data,
    /// at most `max_samples`.
    pub fn eval_samples(&self, max_samples: Option<usize>) -> usize {
        let b = self.batch.max(1);
        let n = match &self.backing {
            Backing::Files(l) => max_samples.map_or(l.eval.len, |m| m.min(l.eval.len)),
            Backing::Synthetic(_) => max_samples.unwrap_or(10 * b),
        };
        n / b * b
    }

    /// The held-out evaluation data in batches of `batch`, at most `max_samples`
    /// samples; the last partial batch is dropped (see the module doc).
    pub fn eval_batches(&self, max_samples: Option<usize>) -> Result<Vec<Batch>> {
        let b = self.batch;
        let n = self.eval_samples(max_samples);
        let mut out = Vec::new();
        match &self.backing {
            Backing::Files(l) => {
                for k in 0..n / b {
                    let idx: Vec<usize> = (k * b..(k + 1) * b).collect();
                    let cols = self.gather(&l.eval, &idx)?;
                    out.push(self.build(cols, b)?);
                }
            }
            Backing::Synthetic(g) => {
                if n == 0 {
                    return Ok(out);
                }
                let mut rng = Pcg64::seed_from_u64(self.seed ^ EVAL_SEED_SALT);
                let all = g.generate(&mut rng, n);
                let pers = g.pers();
                for k in 0..n / b {
                    let cols = self
                        .fields
                        .iter()
                        .map(|f| (f.col, all[f.col].rows(pers[f.col], k * b, b)))
                        .collect();
                    out.push(self.build(cols, b)?);
                }
            }
        }
        Ok(out)
    }

    /// The training samples `[start, start+len)` in file order (unshuffled, unsharded;
    /// file sources only), as a batch of `len` samples. For inspection and tests.
    pub fn train_slice(&self, start: usize, len: usize) -> Result<Batch> {
        match &self.backing {
            Backing::Files(l) => {
                // The caller's (a test's) range.
                if start + len > l.train.len {
                    return Err(RuntimeError::internal(
                        "train_slice",
                        format!(
                            "data source `{}`: samples {start}..{} are past the {} training \
                             samples",
                            self.spec.name(),
                            start + len,
                            l.train.len
                        ),
                    ));
                }
                let idx: Vec<usize> = (start..start + len).collect();
                let cols = self.gather(&l.train, &idx)?;
                self.build(cols, len)
            }
            Backing::Synthetic(_) => Err(RuntimeError::internal(
                "train_slice",
                format!(
                    "data source `{}` is synthetic: it has no stored training samples",
                    self.spec.name()
                ),
            )),
        }
    }

    /// The mean number of distinct ids per batch of the id-typed (i32) `field` over `n`
    /// batches of this worker, sampled from the training stream starting at the
    /// current position **without advancing it** (training data is unchanged by a
    /// measurement). Used by the compiler's sparsity analysis.
    pub fn mean_distinct_ids(&mut self, field: &str, n: usize) -> Result<f64> {
        let fields = self.spec.fields();
        let col = fields
            .iter()
            .position(|(name, _, _)| *name == field)
            .ok_or_else(|| self.unknown_field(field))?;
        if fields[col].1 != DType::I32 {
            return Err(setting(
                &self.spec,
                format_args!("field `{field}` holds {} values, not ids", fields[col].1),
            ));
        }
        // The compiler's fixed sample count.
        if n == 0 {
            return Err(RuntimeError::internal(
                "mean_distinct_ids",
                "the number of batches must be positive",
            ));
        }
        let mut cursor = self.cursor.clone();
        let mut total = 0usize;
        let mut seen = HashSet::new();
        for _ in 0..n {
            let cols = self.draw(&mut cursor, &[col])?;
            seen.clear();
            for (_, c) in cols {
                if let ColData::I32(v) = c {
                    seen.extend(v);
                }
            }
            total += seen.len();
        }
        Ok(total as f64 / n as f64)
    }

    fn unknown_field(&self, field: &str) -> RuntimeError {
        let names: Vec<&str> = self.spec.fields().iter().map(|f| f.0).collect();
        RuntimeError::Config(format!(
            "data source `{}` has no field `{field}` (fields: {})",
            self.spec.name(),
            names.join(", ")
        ))
    }

    /// Gathers columns `cols` of `table` at `idx`.
    fn gather_cols(table: &Table, cols: &[usize], idx: &[usize]) -> Result<Vec<(usize, ColData)>> {
        let mut out: Vec<(usize, ColData)> = Vec::with_capacity(cols.len());
        for &c in cols {
            if let Some((_, d)) = out.iter().find(|(k, _)| *k == c) {
                let d = d.clone();
                out.push((c, d));
            } else {
                out.push((c, table.cols[c].gather(idx)?));
            }
        }
        Ok(out)
    }

    /// Gathers the batch fields of `table` at `idx`.
    fn gather(&self, table: &Table, idx: &[usize]) -> Result<Vec<(usize, ColData)>> {
        let need: Vec<usize> = self.fields.iter().map(|f| f.col).collect();
        Self::gather_cols(table, &need, idx)
    }

    /// Draws this worker's next batch of columns `need` (in that order), advancing
    /// `cursor`.
    fn draw(&self, cursor: &mut Cursor, need: &[usize]) -> Result<Vec<(usize, ColData)>> {
        let (b, g) = (self.batch, self.batch * self.workers);
        match (cursor, &self.backing) {
            (Cursor::Files(s), Backing::Files(l)) => {
                let start = s.base + s.step * g as u64 + (self.rank * b) as u64;
                let idx = s.indices(start, b);
                s.step += 1;
                Self::gather_cols(&l.train, need, &idx)
            }
            (Cursor::Synthetic(rng), Backing::Synthetic(generator)) => {
                // A global stream is the one device's: this worker's rows of the step's
                // batch, the others' skipped.
                let (n_gen, first) = if self.global_stream {
                    (g, self.rank * b)
                } else {
                    (b, 0)
                };
                let all = generator.generate_rows(rng, n_gen, first..first + b);
                Ok(need.iter().map(|&c| (c, all[c].clone())).collect())
            }
            // A source's cursor always matches its backing.
            _ => Ok(Vec::new()),
        }
    }

    /// Turns gathered columns (in `self.fields` order) into a batch of `n` samples.
    fn build(&self, cols: Vec<(usize, ColData)>, n: usize) -> Result<Batch> {
        let mut batch = Batch::with_capacity(self.fields.len());
        for (f, (_, data)) in self.fields.iter().zip(cols) {
            let mut shape = Vec::with_capacity(f.dims.len() + 1);
            shape.push(n);
            shape.extend_from_slice(&f.dims);
            let t = match (data, f.dtype) {
                (ColData::F32(v), DType::F32) => ArrayD::from_shape_vec(IxDyn(&shape), v)
                    .map(Tensor::F32)
                    .map_err(|e| e.to_string()),
                (ColData::F32(v), DType::F64) => {
                    ArrayD::from_shape_vec(IxDyn(&shape), v.into_iter().map(f64::from).collect())
                        .map(Tensor::F64)
                        .map_err(|e| e.to_string())
                }
                (ColData::I32(v), DType::I32) => ArrayD::from_shape_vec(IxDyn(&shape), v)
                    .map(Tensor::I32)
                    .map_err(|e| e.to_string()),
                _ => Err("dtype mismatch".to_string()),
            }
            .map_err(|e| {
                setting(
                    &self.spec,
                    format_args!("field `{}` as {}{:?}: {e}", f.name, f.dtype, shape),
                )
            })?;
            batch.insert(f.name.clone(), t);
        }
        Ok(batch)
    }
}

/// `spec`'s options (or the batch asked of it) do not fit: `message` says how.
pub(crate) fn setting(spec: &DataSpec, message: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Config(format!("data source `{}`: {message}", spec.name()))
}

/// The fields a batch holds, from the model's input types.
fn out_fields(spec: &DataSpec, shapes: &HashMap<String, TensorType>) -> Result<Vec<OutField>> {
    let fields = spec.fields();
    if shapes.is_empty() {
        return Ok(fields
            .iter()
            .enumerate()
            .map(|(col, &(name, dtype, per))| OutField {
                name: name.to_string(),
                col,
                dtype,
                dims: if per == 1 { Vec::new() } else { vec![per] },
            })
            .collect());
    }
    let mut out = Vec::with_capacity(shapes.len());
    let mut names: Vec<&String> = shapes.keys().collect();
    names.sort();
    for name in names {
        let ty = &shapes[name];
        let Some(col) = fields.iter().position(|f| f.0 == name.as_str()) else {
            let all: Vec<&str> = fields.iter().map(|f| f.0).collect();
            return Err(RuntimeError::Config(format!(
                "the model input `{name}` is not a field of data source `{}` (fields: {})",
                spec.name(),
                all.join(", ")
            )));
        };
        let (_, fdtype, per) = fields[col];
        let ok_dtype = ty.dtype == fdtype || (fdtype == DType::F32 && ty.dtype == DType::F64);
        if !ok_dtype {
            return Err(RuntimeError::Config(format!(
                "the model input `{name}` is {ty}, but data source `{}` provides {fdtype} values",
                spec.name()
            )));
        }
        let dims = ty.dims();
        if dims.is_empty() || dims[1..].iter().product::<usize>() != per {
            return Err(RuntimeError::Config(format!(
                "the model input `{name}` is {ty}, but data source `{}` provides {per} \
                 value(s) per sample (the first dimension is the batch)",
                spec.name()
            )));
        }
        out.push(OutField {
            name: name.clone(),
            col,
            dtype: ty.dtype,
            dims: dims[1..].to_vec(),
        });
    }
    Ok(out)
}

/// The furthest data position a resumed run may start at: far beyond any run, and far
/// enough from `u64::MAX` that positions computed from it never overflow.
const MAX_POSITION: u64 = 1 << 62;

/// Mixes two 64-bit values into a seed (splitmix64 finaliser).
pub(crate) fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(0x632b_e59b_d9b4_e019);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Checks a model against its data source before anything runs, so that what would
/// fail at the first step (or, for an id out of range, at some later one) fails now:
/// every model input is a field of the source with its dtype and values per sample
/// (see [`DataSource::open`]), its first dimension is the `batch` the loader will
/// make, and every id field the model indexes with fits what it indexes: a lookup
/// table's rows, a cross-entropy's classes. `bounds` are the id fields' exclusive
/// bounds ([`DataSpec::id_bounds`], or [`SourceInfo::id_bounds`] once files are read).
pub fn check_model(
    graph: &distc_ir::Graph,
    spec: &DataSpec,
    batch: usize,
    bounds: &[(&str, usize)],
) -> Result<()> {
    let shapes = crate::run::programs::input_types(graph);
    out_fields(spec, &shapes)?;
    let mut names: Vec<&String> = shapes.keys().collect();
    names.sort();
    for name in names {
        let ty = &shapes[name];
        if ty.dims().first() != Some(&batch) {
            return Err(RuntimeError::Config(format!(
                "the model input `{name}` is {ty}, but the data loader makes batches of \
                 {batch} samples (the first dimension is the batch)"
            )));
        }
    }
    check_indices(graph, spec, bounds)
}

/// The model input a value is read from, through ops that move ids without changing
/// them.
fn id_origin(g: &distc_ir::Graph, mut v: distc_ir::ValueId) -> Option<&str> {
    use distc_ir::Op;
    loop {
        match g.op(v.node) {
            Op::Input { name, .. } => return Some(name),
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } => {
                v = *g.node(v.node).inputs.first()?;
            }
            _ => return None,
        }
    }
}

/// The variable that gives value `v` its dimension (first or last) of `size`, in the
/// user's words: among `v`'s sources of that size, nearest first, a matrix before a
/// vector (a head before its bias; a lookup table behind a cast), by its whole name.
fn sized_by(g: &distc_ir::Graph, v: distc_ir::ValueId, size: usize, last: bool) -> Option<String> {
    let mut queue = std::collections::VecDeque::from([v.node]);
    let mut seen = std::collections::HashSet::new();
    let mut found: Vec<(usize, &str)> = Vec::new();
    while let Some(n) = queue.pop_front() {
        if !seen.insert(n) {
            continue;
        }
        if let distc_ir::Op::Param { name, ty, .. } = g.op(n) {
            let dims = ty.dims();
            let d = if last { dims.last() } else { dims.first() };
            if d == Some(&size) {
                found.push((dims.len(), name));
            }
            continue;
        }
        queue.extend(g.node(n).inputs.iter().map(|i| i.node));
    }
    found
        .iter()
        .find(|(rank, _)| *rank >= 2)
        .or(found.first())
        .map(|(_, name)| distc_ir::whole_variable(name).to_string())
}

fn check_indices(g: &distc_ir::Graph, spec: &DataSpec, bounds: &[(&str, usize)]) -> Result<()> {
    use distc_ir::Op;
    let bound = |v: distc_ir::ValueId| {
        let field = id_origin(g, v)?;
        bounds
            .iter()
            .find(|(f, _)| *f == field)
            .map(|&(f, b)| (f, b))
    };
    let dims = |v: distc_ir::ValueId| -> Vec<usize> {
        g.try_value_type(v)
            .and_then(|t| t.tensor())
            .map(|t| t.dims().to_vec())
            .unwrap_or_default()
    };
    for id in g.topo_order() {
        let inputs = &g.node(id).inputs;
        // (id operand, how many it may index, what it indexes, the variable that
        // sets that: a table's rows, or the classes of the logits' last axis)
        let (ids, room, what, sized) = match g.op(id) {
            Op::Embedding if inputs.len() == 2 => {
                let rows = dims(inputs[0]).first().copied();
                let table = rows.and_then(|r| sized_by(g, inputs[0], r, false));
                (inputs[1], rows, "rows", table)
            }
            // A part of the table on each of `parts` model ranks: the whole table's rows.
            Op::ModelEmbedding { parts } if inputs.len() == 2 => {
                let rows = dims(inputs[0]).first().copied();
                let table = rows.and_then(|r| sized_by(g, inputs[0], r, false));
                (inputs[1], rows.map(|r| r * parts), "rows", table)
            }
            Op::SparsePull { table, var, .. } if !inputs.is_empty() => (
                inputs[0],
                table.dims().first().copied(),
                "rows",
                Some(distc_ir::whole_variable(var).to_string()),
            ),
            Op::SoftmaxCrossEntropy if inputs.len() == 2 => {
                let classes = dims(inputs[0]).last().copied();
                let head = classes.and_then(|c| sized_by(g, inputs[0], c, true));
                (inputs[1], classes, "classes", head)
            }
            _ => continue,
        };
        let (Some((field, b)), Some(room)) = (bound(ids), room) else {
            continue;
        };
        if b > room {
            let holder = match (sized, what) {
                (Some(var), "rows") => format!("the lookup table `{var}` has {room} rows"),
                (Some(var), _) => {
                    format!("the logits have {room} classes (the last dimension of `{var}`)")
                }
                (None, "rows") => {
                    format!("the lookup table ({}) has {room} rows", g.op(id).mnemonic())
                }
                (None, _) => format!(
                    "the logits of `{}` have {room} classes",
                    g.op(id).mnemonic()
                ),
            };
            return Err(RuntimeError::Config(format!(
                "data source `{}` gives `{field}` values up to {}, but {holder}: make it {b} \
                 wide, or narrow the data source",
                spec.name(),
                b - 1,
            )));
        }
    }
    Ok(())
}
