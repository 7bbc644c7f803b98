//! The sources whose files a user names in the train block, each path relative to the
//! data directory or absolute:
//!
//! * `tokens`: a flat stream of little-endian u16 or u32 token ids with no header (the
//!   nanoGPT and llm.c `.bin` layout), read where it is used: a batch reads only its windows,
//!   and a resumed run starts at its position without reading what came before.
//!   Training sample `i` is the window at token `i` (`tokens`) and the window one token
//!   later (`targets`); evaluation takes the held-out stream's windows in order,
//!   `context` apart.
//! * `tensors`: named arrays whose first axis is the sample axis, from a `.safetensors`
//!   file, a `.npz` archive or a folder of `.npy` files. Each model input reads the
//!   array of its name, converted to the input's type (integers to i32 only when every
//!   value fits).
//! * `csv`: a table with a header row; each model input reads the column of its name,
//!   one value per sample.
//!
//! What a file lacks or holds wrongly is an error naming the file (and, for CSV, the
//! line and column), raised when the source is opened, before step 1.

use super::{Column, Loaded, Table};
use crate::core::config::FieldSpec;
use crate::core::error::{Result, RuntimeError};
use distc_ir::DType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn data_err(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Data {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// `path` as the train block wrote it, under the data directory unless absolute.
pub(crate) fn resolve(dir: Option<&Path>, path: &str) -> Result<PathBuf> {
    let p = Path::new(path);
    let p = if p.is_absolute() {
        p.to_path_buf()
    } else {
        match dir {
            Some(d) => d.join(p),
            None => {
                return Err(RuntimeError::Config(format!(
                    "the data file \"{path}\" is relative to the data directory: give it \
                     with --data or set DISTC_DATA (or write an absolute path)"
                )))
            }
        }
    };
    file_or_folder(&p)?;
    Ok(p)
}

/// Refuses a data path that is there but neither a file nor a folder: reading a FIFO
/// waits forever for a writer, and a device (`/dev/zero`) never ends.
fn file_or_folder(path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() && !m.is_dir() => Err(data_err(
            path,
            "not a regular file (a device, a pipe or a socket): give a data file",
        )),
        _ => Ok(()),
    }
}

/// A token file, `width` bytes a token, read where a batch's windows lie.
///
/// Read, not memory-mapped: a mapped file that another process truncates kills the
/// reader with SIGBUS at its next window (no message, no final state), while a read
/// past the end is an error this run can name and stop on.
#[derive(Debug)]
pub(crate) struct TokenStream {
    file: std::fs::File,
    path: PathBuf,
    width: usize,
    len: usize,
    /// Ids lie in `0..bound`, as read when the file was opened.
    bound: usize,
}

/// Tokens read at a time when the whole file is scanned for its largest id.
const SCAN_TOKENS: usize = 1 << 20;

impl TokenStream {
    fn open(path: &Path, width: usize) -> Result<TokenStream> {
        let io = |source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(data_err(path, "is not a regular file"));
        }
        if meta.len() % width as u64 != 0 {
            return Err(data_err(
                path,
                format!(
                    "{} bytes is not a whole number of {}-byte tokens: is `dtype` right?",
                    meta.len(),
                    width
                ),
            ));
        }
        if meta.len() == 0 {
            return Err(data_err(path, "is empty"));
        }
        let len = usize::try_from(meta.len() / width as u64)
            .map_err(|_| data_err(path, "holds more tokens than this machine can index"))?;
        let mut stream = TokenStream {
            file,
            path: path.to_path_buf(),
            width,
            len,
            bound: usize::MAX,
        };
        stream.bound = stream.scan_bound()?;
        Ok(stream)
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Tokens `[start, start + n)` appended to `out` as read, unchecked.
    fn read(&self, out: &mut Vec<i32>, start: usize, n: usize) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let mut bytes = vec![0u8; n * self.width];
        self.file
            .read_exact_at(&mut bytes, (start * self.width) as u64)
            .map_err(|e| {
                data_err(
                    &self.path,
                    format!(
                        "cannot read tokens {start}..{} ({e}); it held {} tokens when the \
                         run opened it: was it truncated or replaced while training?",
                        start + n,
                        self.len
                    ),
                )
            })?;
        match self.width {
            2 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| i32::from(u16::from_le_bytes([b[0], b[1]]))),
            ),
            _ => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i32),
            ),
        }
        Ok(())
    }

    /// Tokens `[start, start + n)` appended to `out` as i32 ids, each within the ids
    /// the file held when it was opened.
    pub(crate) fn extend(&self, out: &mut Vec<i32>, start: usize, n: usize) -> Result<()> {
        let first = out.len();
        self.read(out, start, n)?;
        // The ids were checked against the model when the file was opened; a file
        // rewritten since then must not index past a table.
        match out[first..]
            .iter()
            .position(|&t| t < 0 || t as usize >= self.bound)
        {
            None => Ok(()),
            Some(k) => Err(data_err(
                &self.path,
                format!(
                    "token {} is now {}, beyond the ids 0..{} it held when the run opened \
                     it: was it rewritten while training?",
                    start + k,
                    out[first + k] as u32,
                    self.bound
                ),
            )),
        }
    }

    /// The largest id plus one, after checking every id fits an i32.
    fn scan_bound(&self) -> Result<usize> {
        let mut max = 0u32;
        let mut chunk = Vec::with_capacity(SCAN_TOKENS);
        for start in (0..self.len).step_by(SCAN_TOKENS) {
            chunk.clear();
            self.read(&mut chunk, start, SCAN_TOKENS.min(self.len - start))?;
            // Read as i32, an id beyond i32 is negative.
            if let Some(&t) = chunk.iter().find(|&&t| t < 0) {
                return Err(data_err(
                    &self.path,
                    format!("holds the id {}, beyond i32: is `dtype` right?", t as u32),
                ));
            }
            max = max.max(chunk.iter().copied().max().unwrap_or(0) as u32);
        }
        Ok(max as usize + 1)
    }

    fn bound(&self) -> usize {
        self.bound
    }
}

/// `tokens(path, eval_path, dtype, context)`.
pub(crate) fn tokens(
    dir: Option<&Path>,
    path: &str,
    eval_path: Option<&str>,
    width: usize,
    context: usize,
) -> Result<Loaded> {
    let open = |p: &str| -> Result<(PathBuf, Arc<TokenStream>)> {
        let path = resolve(dir, p)?;
        let s = TokenStream::open(&path, width)?;
        if s.len() <= context {
            return Err(data_err(
                &path,
                format!(
                    "holds {} tokens: a sample needs context + 1 = {}",
                    s.len(),
                    context + 1
                ),
            ));
        }
        Ok((path, Arc::new(s)))
    };
    let (_, train) = open(path)?;
    let mut bound = train.bound();
    let windows = |stream: &Arc<TokenStream>, stride: usize| {
        [0, 1].map(|offset| Column::Tokens {
            stream: stream.clone(),
            stride,
            offset,
            width: context,
        })
    };
    let eval = match eval_path {
        Some(p) => {
            let (_, stream) = open(p)?;
            bound = bound.max(stream.bound());
            Table {
                len: (stream.len() - 1) / context,
                cols: windows(&stream, context).to_vec(),
            }
        }
        None => Table {
            len: 0,
            cols: windows(&train, context).to_vec(),
        },
    };
    Ok(Loaded {
        train: Table {
            len: train.len() - context,
            cols: windows(&train, 1).to_vec(),
        },
        eval,
        id_bounds: [("tokens", bound), ("targets", bound)]
            .map(|(f, b)| (f.to_string(), b))
            .into(),
    })
}

/// One array as read from a file: its shape and its values.
enum Array {
    F64(Vec<f64>),
    I64(Vec<i64>),
}

/// A field's column from `values` (`n` samples), converted to the field's type and
/// checked as it is opened: no NaN or infinity among floats (they would train
/// silently into NaN weights, and the run would blame the learning rate), no negative
/// ids or labels (their bound is checked against the model once every file is read).
fn column(path: &Path, f: &FieldSpec, n: usize, values: Array) -> Result<Column> {
    let per = f.per_sample;
    let sample = |k: usize| k / per.max(1);
    match &values {
        Array::F64(v) => {
            // Every float column is held in f32: beyond its range is an infinity.
            if let Some(k) = v
                .iter()
                .position(|x| !x.is_finite() || x.abs() > f32::MAX as f64)
            {
                return Err(data_err(
                    path,
                    format!(
                        "`{}` holds {} at sample {}: the model trains on finite {} values",
                        f.name,
                        v[k],
                        sample(k),
                        f.dtype
                    ),
                ));
            }
        }
        Array::I64(v) if f.dtype == DType::I32 => {
            if let Some(k) = v.iter().position(|x| *x < 0) {
                return Err(data_err(
                    path,
                    format!(
                        "`{}` holds {} at sample {}: ids and class labels are 0 or more",
                        f.name,
                        v[k],
                        sample(k)
                    ),
                ));
            }
        }
        Array::I64(_) => {}
    }
    match (f.dtype, values) {
        (DType::F32 | DType::F64, Array::F64(v)) => Ok(Column::F32 {
            data: Arc::new(v.into_iter().map(|x| x as f32).collect()),
            per,
        }),
        (DType::F32 | DType::F64, Array::I64(v)) => Ok(Column::F32 {
            data: Arc::new(v.into_iter().map(|x| x as f32).collect()),
            per,
        }),
        (DType::I32, Array::I64(v)) => {
            let mut out = Vec::with_capacity(n * per);
            for (k, x) in v.into_iter().enumerate() {
                out.push(i32::try_from(x).map_err(|_| {
                    data_err(
                        path,
                        format!(
                            "`{}` holds {x} at sample {}, beyond the i32 the model reads",
                            f.name,
                            k / per.max(1)
                        ),
                    )
                })?);
            }
            Ok(Column::I32 {
                data: Arc::new(out),
                per,
            })
        }
        (DType::I32, Array::F64(_)) => Err(data_err(
            path,
            format!(
                "`{}` holds floating-point values, but the model reads it as i32 ids: \
                 store integers, or declare the input f32",
                f.name
            ),
        )),
        (d, _) => Err(data_err(
            path,
            format!(
                "`{}`: the model reads it as {d}, which no data file provides",
                f.name
            ),
        )),
    }
}

/// Checks an array's shape against a field and the other fields' sample count.
fn check_shape(path: &Path, f: &FieldSpec, shape: &[usize], n: &mut Option<usize>) -> Result<()> {
    let Some((&samples, rest)) = shape.split_first() else {
        return Err(data_err(
            path,
            format!(
                "`{}` is a scalar: its first axis must be the samples",
                f.name
            ),
        ));
    };
    let per: usize = rest.iter().product();
    if per != f.per_sample {
        return Err(data_err(
            path,
            format!(
                "`{}` has shape {shape:?}: {per} value(s) per sample, but the model's input \
                 reads {}",
                f.name, f.per_sample
            ),
        ));
    }
    match *n {
        Some(m) if m != samples => Err(data_err(
            path,
            format!(
                "`{}` has {samples} samples, but the fields before it have {m}",
                f.name
            ),
        )),
        _ => {
            *n = Some(samples);
            Ok(())
        }
    }
}

/// `tensors(path, eval_path)`: the training and held-out tables.
pub(crate) fn tensors(
    dir: Option<&Path>,
    path: &str,
    eval_path: Option<&str>,
    fields: &[FieldSpec],
) -> Result<Loaded> {
    let train = tensor_table(&resolve(dir, path)?, fields)?;
    let eval = match eval_path {
        Some(p) => tensor_table(&resolve(dir, p)?, fields)?,
        None => empty_like(&train),
    };
    Ok(with_bounds(train, eval, fields))
}

/// The tables, with each integer field's bound (its largest value plus one, over both
/// tables), which the model's lookups and classes are checked against before step 1.
fn with_bounds(train: Table, eval: Table, fields: &[FieldSpec]) -> Loaded {
    let mut id_bounds = HashMap::new();
    for (k, f) in fields.iter().enumerate() {
        for t in [&train, &eval] {
            if let Some(Column::I32 { data, .. }) = t.cols.get(k) {
                if let Some(&top) = data.iter().max() {
                    let b = id_bounds.entry(f.name.clone()).or_insert(0usize);
                    *b = (*b).max(top as usize + 1);
                }
            }
        }
    }
    Loaded {
        train,
        eval,
        id_bounds,
    }
}

fn empty_like(t: &Table) -> Table {
    Table {
        len: 0,
        cols: t.cols.clone(),
    }
}

fn tensor_table(path: &Path, fields: &[FieldSpec]) -> Result<Table> {
    let name = path.to_string_lossy();
    let arrays: Vec<(Vec<usize>, Array)> = if path.is_dir() {
        fields
            .iter()
            .map(|f| npy(&path.join(format!("{}.npy", f.name)), f))
            .collect::<Result<_>>()?
    } else if name.ends_with(".safetensors") {
        safetensors_arrays(path, fields)?
    } else if name.ends_with(".npz") {
        let mut archive = npyz::npz::NpzArchive::open(path).map_err(|source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut out = Vec::with_capacity(fields.len());
        for f in fields {
            // Read whole and checked before npyz parses it (see `check_npy_shape`).
            let entry = format!("{}.npy", f.name);
            let zip = archive.zip_archive();
            if !zip.file_names().any(|n| n == entry) {
                return Err(missing(path, f));
            }
            let cannot = |e: &dyn std::fmt::Display| {
                data_err(path, format!("cannot read `{}`: {e}", f.name))
            };
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(
                &mut zip.by_name(&entry).map_err(|e| cannot(&e))?,
                &mut bytes,
            )
            .map_err(|e| cannot(&e))?;
            check_npy_shape(path, f, &bytes)?;
            let file = npyz::NpyFile::new(&bytes[..]).map_err(|e| cannot(&e))?;
            out.push(npy_values(path, f, file)?);
        }
        out
    } else if !path.exists() {
        return Err(data_err(path, "not found"));
    } else {
        return Err(data_err(
            path,
            "is not a .safetensors file, a .npz archive or a folder of .npy files",
        ));
    };
    let mut n = None;
    let mut cols = Vec::with_capacity(fields.len());
    for (f, (shape, values)) in fields.iter().zip(arrays) {
        check_shape(path, f, &shape, &mut n)?;
        cols.push(column(path, f, shape[0], values)?);
    }
    Ok(Table {
        len: n.unwrap_or(0),
        cols,
    })
}

fn missing(path: &Path, f: &FieldSpec) -> RuntimeError {
    data_err(
        path,
        format!(
            "has no array `{}`, which the model's input of that name reads",
            f.name
        ),
    )
}

fn npy(path: &Path, f: &FieldSpec) -> Result<(Vec<usize>, Array)> {
    file_or_folder(path)?;
    let file = std::fs::File::open(path).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut head = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(&file, NPY_HEAD), &mut head).map_err(
        |source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        },
    )?;
    check_npy_shape(path, f, &head)?;
    let file = std::fs::File::open(path).map_err(|source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let npy = npyz::NpyFile::new(std::io::BufReader::new(file))
        .map_err(|e| data_err(path, format!("not a .npy file: {e}")))?;
    npy_values(path, f, npy)
}

/// The most of a `.npy` file its header can take: the magic, the version, a 4-byte
/// length and the header itself, which numpy keeps far below 64 KiB.
const NPY_HEAD: u64 = 12 + (1 << 16);

/// Refuses a `.npy` header whose shape holds more values than 64 bits count, before
/// npyz parses it: npyz multiplies the dimensions unchecked (a panic in a build with
/// overflow checks, a wrapped count without). Anything else wrong with the header is
/// npyz's to name.
fn check_npy_shape(path: &Path, f: &FieldSpec, head: &[u8]) -> Result<()> {
    let text = match head.get(6) {
        Some(1) => head.get(10..),
        Some(_) => head.get(12..),
        None => None,
    }
    .map(String::from_utf8_lossy)
    .unwrap_or_default();
    let Some(at) = text.find("'shape'").or_else(|| text.find("\"shape\"")) else {
        return Ok(());
    };
    let rest = &text[at..];
    let (Some(open), Some(close)) = (rest.find('('), rest.find(')')) else {
        return Ok(());
    };
    if close < open {
        return Ok(());
    }
    let mut count = 1u64;
    for dim in rest[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        // numpy writes decimal dimensions (Python 2's with an `L`).
        let Ok(d) = dim.trim_end_matches('L').parse::<u64>() else {
            return Err(data_err(
                path,
                format!(
                    "`{}`'s shape {} is not whole numbers as numpy writes them",
                    f.name,
                    &rest[open..=close]
                ),
            ));
        };
        count = count.checked_mul(d).ok_or_else(|| {
            data_err(
                path,
                format!(
                    "`{}`'s shape {} holds more values than a file can",
                    f.name,
                    &rest[open..=close]
                ),
            )
        })?;
    }
    Ok(())
}

fn npy_values<R: std::io::Read>(
    path: &Path,
    f: &FieldSpec,
    npy: npyz::NpyFile<R>,
) -> Result<(Vec<usize>, Array)> {
    use npyz::TypeChar;
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let npyz::DType::Plain(ty) = npy.dtype() else {
        return Err(data_err(
            path,
            format!("`{}` is a structured array; store plain numbers", f.name),
        ));
    };
    let bad = |e: std::io::Error| data_err(path, format!("`{}`: {e}", f.name));
    // `np.save` of a transposed array writes it column-major (`fortran_order`).
    let fortran = npy.order() == npyz::Order::Fortran;
    let values = match (ty.type_char(), ty.size_field()) {
        (TypeChar::Float, 4) => Array::F64(
            npy.into_vec::<f32>()
                .map_err(bad)?
                .into_iter()
                .map(f64::from)
                .collect(),
        ),
        (TypeChar::Float, 8) => Array::F64(npy.into_vec::<f64>().map_err(bad)?),
        (TypeChar::Int, 1) => Array::I64(widen(npy.into_vec::<i8>().map_err(bad)?)),
        (TypeChar::Int, 2) => Array::I64(widen(npy.into_vec::<i16>().map_err(bad)?)),
        (TypeChar::Int, 4) => Array::I64(widen(npy.into_vec::<i32>().map_err(bad)?)),
        (TypeChar::Int, 8) => Array::I64(npy.into_vec::<i64>().map_err(bad)?),
        (TypeChar::Uint, 1) => Array::I64(widen(npy.into_vec::<u8>().map_err(bad)?)),
        (TypeChar::Uint, 2) => Array::I64(widen(npy.into_vec::<u16>().map_err(bad)?)),
        (TypeChar::Uint, 4) => Array::I64(widen(npy.into_vec::<u32>().map_err(bad)?)),
        (TypeChar::Bool, 1) => Array::I64(
            npy.into_vec::<bool>()
                .map_err(bad)?
                .into_iter()
                .map(i64::from)
                .collect(),
        ),
        _ => {
            return Err(data_err(
                path,
                format!(
                    "`{}` holds {ty}, which distc does not read (floats, integers up to \
                     64 bits, booleans)",
                    f.name
                ),
            ))
        }
    };
    let values = match values {
        _ if !fortran => values,
        Array::F64(v) => Array::F64(row_major(v, &shape).map_err(|e| bad_shape(path, f, e))?),
        Array::I64(v) => Array::I64(row_major(v, &shape).map_err(|e| bad_shape(path, f, e))?),
    };
    Ok((shape, values))
}

fn bad_shape(path: &Path, f: &FieldSpec, e: ndarray::ShapeError) -> RuntimeError {
    data_err(
        path,
        format!("`{}`: its values do not fill its shape: {e}", f.name),
    )
}

/// The values of a column-major array of `shape` in row-major order, as every other
/// source holds them.
fn row_major<T: Copy>(v: Vec<T>, shape: &[usize]) -> Result<Vec<T>, ndarray::ShapeError> {
    use ndarray::ShapeBuilder;
    let a = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape).f(), v)?;
    Ok(a.iter().copied().collect())
}

fn widen<T: Into<i64>>(v: Vec<T>) -> Vec<i64> {
    v.into_iter().map(Into::into).collect()
}

/// `read` of the safetensors file at `path`, opened as every data source opens one.
fn with_safetensors<T>(
    path: &Path,
    read: impl FnOnce(&safetensors::SafeTensors<'_>) -> Result<T>,
) -> Result<T> {
    let bytes =
        crate::core::output::read_regular(path, u64::MAX).map_err(|source| RuntimeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| data_err(path, format!("not a safetensors file: {e}")))?;
    read(&st)
}

fn safetensors_arrays(path: &Path, fields: &[FieldSpec]) -> Result<Vec<(Vec<usize>, Array)>> {
    with_safetensors(path, |st| {
        fields
            .iter()
            .map(|f| {
                let view = st.tensor(&f.name).map_err(|_| missing(path, f))?;
                Ok((view.shape().to_vec(), decode(path, f, &view)?))
            })
            .collect()
    })
}

/// The model inputs `fields` a safetensors file holds (`distc predict --input`), read
/// as the `tensors` source reads them (any integer or float dtype, converted and
/// checked as training data is), each `[samples, values per sample]`; a field the file
/// lacks is left out.
pub fn read_model_inputs(
    path: &Path,
    fields: &[FieldSpec],
) -> Result<HashMap<String, crate::core::value::Tensor>> {
    use crate::core::value::Tensor;
    with_safetensors(path, |st| {
        let mut out = HashMap::new();
        for f in fields {
            let Ok(view) = st.tensor(&f.name) else {
                continue;
            };
            let shape = view.shape().to_vec();
            check_shape(path, f, &shape, &mut None)?;
            let n = shape[0];
            let dims = ndarray::IxDyn(&[n, f.per_sample]);
            let shaped = |e: ndarray::ShapeError| data_err(path, format!("`{}`: {e}", f.name));
            let t = match column(path, f, n, decode(path, f, &view)?)? {
                Column::F32 { data, .. } => Tensor::F32(
                    ndarray::ArrayD::from_shape_vec(dims, Arc::unwrap_or_clone(data))
                        .map_err(shaped)?,
                ),
                Column::I32 { data, .. } => Tensor::I32(
                    ndarray::ArrayD::from_shape_vec(dims, Arc::unwrap_or_clone(data))
                        .map_err(shaped)?,
                ),
                _ => {
                    return Err(data_err(
                        path,
                        format!("`{}`: not an array distc reads as a model input", f.name),
                    ))
                }
            };
            out.insert(f.name.clone(), t);
        }
        Ok(out)
    })
}

/// A safetensors array's values, for field `f`.
fn decode(path: &Path, f: &FieldSpec, view: &safetensors::tensor::TensorView<'_>) -> Result<Array> {
    use safetensors::Dtype;
    let data = view.data();
    macro_rules! le {
        ($t:ty, $n:expr) => {
            data.chunks_exact($n)
                .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or([0; $n])))
        };
    }
    Ok(match view.dtype() {
        Dtype::F32 => Array::F64(le!(f32, 4).map(f64::from).collect()),
        Dtype::F64 => Array::F64(le!(f64, 8).collect()),
        Dtype::F16 => Array::F64(le!(half::f16, 2).map(f64::from).collect()),
        Dtype::BF16 => Array::F64(le!(half::bf16, 2).map(f64::from).collect()),
        Dtype::I8 => Array::I64(le!(i8, 1).map(i64::from).collect()),
        Dtype::I16 => Array::I64(le!(i16, 2).map(i64::from).collect()),
        Dtype::I32 => Array::I64(le!(i32, 4).map(i64::from).collect()),
        Dtype::I64 => Array::I64(le!(i64, 8).collect()),
        Dtype::U8 => Array::I64(le!(u8, 1).map(i64::from).collect()),
        Dtype::U16 => Array::I64(le!(u16, 2).map(i64::from).collect()),
        Dtype::U32 => Array::I64(le!(u32, 4).map(i64::from).collect()),
        Dtype::BOOL => Array::I64(data.iter().map(|&b| i64::from(b != 0)).collect()),
        other => {
            return Err(data_err(
                path,
                format!("`{}` holds {other:?}, which distc does not read", f.name),
            ))
        }
    })
}

/// `csv(path, eval_path)`: the training and held-out tables.
pub(crate) fn csv(
    dir: Option<&Path>,
    path: &str,
    eval_path: Option<&str>,
    fields: &[FieldSpec],
) -> Result<Loaded> {
    let train = csv_table(&resolve(dir, path)?, fields)?;
    let eval = match eval_path {
        Some(p) => csv_table(&resolve(dir, p)?, fields)?,
        None => empty_like(&train),
    };
    Ok(with_bounds(train, eval, fields))
}

fn csv_table(path: &Path, fields: &[FieldSpec]) -> Result<Table> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .trim(csv::Trim::All)
        .from_path(path)
        .map_err(|e| data_err(path, e.to_string()))?;
    let headers = reader
        .headers()
        .map_err(|e| data_err(path, format!("line 1 (the header): {e}")))?
        .clone();
    let mut at = Vec::with_capacity(fields.len());
    for f in fields {
        if f.per_sample != 1 {
            return Err(data_err(
                path,
                format!(
                    "the model's input `{}` reads {} values per sample; a CSV column gives one",
                    f.name, f.per_sample
                ),
            ));
        }
        let col = headers.iter().position(|h| h == f.name).ok_or_else(|| {
            data_err(
                path,
                format!(
                    "line 1 (the header) has no column `{}`, which the model's input of \
                     that name reads (columns: {})",
                    f.name,
                    headers.iter().collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
        at.push(col);
    }
    let mut floats: Vec<Vec<f64>> = vec![Vec::new(); fields.len()];
    let mut ints: Vec<Vec<i64>> = vec![Vec::new(); fields.len()];
    for record in reader.records() {
        let record = record.map_err(|e| data_err(path, e.to_string()))?;
        let line = record.position().map_or(0, |p| p.line());
        for (k, (f, &col)) in fields.iter().zip(&at).enumerate() {
            let text = record.get(col).unwrap_or("");
            let where_ = || format!("line {line}, column {} (`{}`)", col + 1, f.name);
            if f.dtype == DType::I32 {
                let v: i64 = text.parse().map_err(|_| {
                    data_err(
                        path,
                        format!(
                            "{}: `{text}` is not a whole number (the input is i32)",
                            where_()
                        ),
                    )
                })?;
                ints[k].push(v);
            } else {
                let v: f64 = text.parse().map_err(|_| {
                    data_err(path, format!("{}: `{text}` is not a number", where_()))
                })?;
                floats[k].push(v);
            }
        }
    }
    let mut n = None;
    let mut cols = Vec::with_capacity(fields.len());
    for (k, f) in fields.iter().enumerate() {
        let values = if f.dtype == DType::I32 {
            Array::I64(std::mem::take(&mut ints[k]))
        } else {
            Array::F64(std::mem::take(&mut floats[k]))
        };
        let len = match &values {
            Array::F64(v) => v.len(),
            Array::I64(v) => v.len(),
        };
        check_shape(path, f, &[len], &mut n)?;
        cols.push(column(path, f, len, values)?);
    }
    Ok(Table {
        len: n.unwrap_or(0),
        cols,
    })
}
