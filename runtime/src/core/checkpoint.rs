//! Checkpoints: named tensors (variables, optimizer slots) and string metadata in one
//! safetensors file (f32, f64, i32; little-endian, as the format specifies).
//!
//! [`save`] writes a temporary file next to the target, syncs it, then renames it over
//! the target, so a crash never leaves a half-written checkpoint under the real name.
//! Every error names the file.

use crate::core::error::{Result, RuntimeError};
use crate::core::value::Tensor;
use ndarray::{ArrayD, IxDyn};
use safetensors::tensor::{Dtype, SafeTensors, View};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The name under which an optimizer state reports its step count (completed steps,
/// an f64 scalar), on every backend.
pub const STEP_KEY: &str = "optimizer/step";

/// The step count `t` holds under [`STEP_KEY`]: one whole number, 0 or more, as a
/// scalar, which is how every optimizer writes it. Anything else (a count of another
/// shape, a fraction, a negative number) is what a damaged or edited state holds: the
/// error says what it is.
pub fn step_count(t: &Tensor) -> std::result::Result<u64, String> {
    match t.scalar_f64().filter(|_| t.shape().is_empty()) {
        Some(s) if s >= 0.0 && s.fract() == 0.0 => Ok(s as u64),
        Some(s) => Err(format!("`{STEP_KEY}` is {s}, not a step count")),
        None => Err(format!(
            "`{STEP_KEY}` is {}, not a step count",
            t.tensor_type()
        )),
    }
}

/// The name under which an fp16 run's loss scaler is kept: `[scale, finite steps since
/// it last changed, steps skipped]` as f64s, so a resumed run scales and skips as the
/// uninterrupted one does.
pub const LOSS_SCALE_KEY: &str = "optimizer/loss_scale";

/// A tensor as a safetensors view (bytes produced on demand, little-endian).
struct TensorView<'a>(&'a Tensor);

impl View for TensorView<'_> {
    fn dtype(&self) -> Dtype {
        match self.0 {
            Tensor::F32(_) => Dtype::F32,
            Tensor::F64(_) => Dtype::F64,
            Tensor::I32(_) => Dtype::I32,
            Tensor::BF16(_) => Dtype::BF16,
            Tensor::F16(_) => Dtype::F16,
        }
    }
    fn shape(&self) -> &[usize] {
        self.0.shape()
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let bytes: Vec<u8> = match self.0 {
            Tensor::F32(a) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::F64(a) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::I32(a) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::BF16(a) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Tensor::F16(a) => a.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        self.0.bytes()
    }
}

fn data_err(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Data {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `params` (names must be distinct) and `metadata` to `path` atomically
/// (temporary file, then rename). Creates the parent directory if needed.
pub fn save(
    path: &Path,
    params: &[(String, &Tensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let mut seen = HashSet::new();
    for (name, _) in params {
        if !seen.insert(name.as_str()) {
            return Err(data_err(path, format!("tensor `{name}` is listed twice")));
        }
    }
    // Serialised in memory and written through distc's own temporary name: safetensors'
    // `serialize_to_file` keeps a temporary file of its own, which a process killed
    // midway leaves behind under a name no later write cleans up.
    let views = params.iter().map(|(n, t)| (n.as_str(), TensorView(t)));
    let mut metadata = metadata;
    let sums: Vec<String> = params
        .iter()
        .map(|(n, t)| format!("{n}={:08x}", crc32fast::hash(&TensorView(t).data())))
        .collect();
    metadata.insert(CHECKSUM_KEY.to_string(), sums.join("\n"));
    let meta = Some(metadata);
    let bytes = safetensors::serialize(views, meta)
        .map_err(|e| data_err(path, format!("cannot serialise the tensors: {e}")))?;
    crate::core::output::write_atomic(path, |f| std::io::Write::write_all(f, &bytes))
}

/// Reads a checkpoint written by [`save`] (or any safetensors file of f32, f64 and
/// i32 tensors): the tensors by name and the metadata.
pub fn load(path: &Path) -> Result<(HashMap<String, Tensor>, HashMap<String, String>)> {
    load_with(path, None)
}

/// A weights file for `--init` (PyTorch's `state_dict` saved as safetensors): its
/// tensors by name, and the names and dtypes of those of a dtype no variable has (an
/// I64 `num_batches_tracked`, a U8 mask), left out rather than refused, so that
/// `--init-partial` can ignore them as it ignores any tensor the model does not name.
pub type WeightsFile = (HashMap<String, Tensor>, Vec<(String, String)>);

/// Reads a weights file for `--init`; see [`WeightsFile`].
pub fn load_weights(path: &Path) -> Result<WeightsFile> {
    let mut foreign = Vec::new();
    let (tensors, _) = load_with(path, Some(&mut foreign))?;
    foreign.sort();
    Ok((tensors, foreign))
}

/// [`load`], leaving tensors of other dtypes out into `foreign` where it is given.
fn load_with(
    path: &Path,
    mut foreign: Option<&mut Vec<(String, String)>>,
) -> Result<(HashMap<String, Tensor>, HashMap<String, String>)> {
    let bytes = crate::core::output::read_regular(path, u64::MAX).map_err(io_err(path))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| data_err(path, format!("not a safetensors checkpoint: {e}")))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| data_err(path, format!("not a safetensors checkpoint: {e}")))?;
    let mut metadata = meta.metadata().clone().unwrap_or_default();
    // Files distc wrote carry a CRC-32 per tensor; other safetensors files load as they
    // are. The checksums are the file's own: the caller gets its metadata without them.
    let sums: HashMap<String, String> = metadata
        .remove(CHECKSUM_KEY)
        .map(|text| {
            text.lines()
                .filter_map(|l| l.rsplit_once('='))
                .map(|(n, c)| (n.to_string(), c.to_string()))
                .collect()
        })
        .unwrap_or_default();
    let mut tensors = HashMap::new();
    for (name, view) in st.iter() {
        let shape = IxDyn(view.shape());
        let data = view.data();
        if let Some(want) = sums.get(name) {
            let got = format!("{:08x}", crc32fast::hash(data));
            if got != *want {
                return Err(data_err(
                    path,
                    format!(
                        "tensor `{name}` does not match its checksum (CRC-32 {got}, stored \
                         {want}): the file is damaged"
                    ),
                ));
            }
        }
        let bad = |e: ndarray::ShapeError| data_err(path, format!("tensor `{name}`: {e}"));
        let t = match view.dtype() {
            Dtype::F32 => Tensor::F32(
                ArrayD::from_shape_vec(
                    shape,
                    data.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            Dtype::F64 => Tensor::F64(
                ArrayD::from_shape_vec(
                    shape,
                    data.chunks_exact(8)
                        .map(|c| {
                            f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])
                        })
                        .collect(),
                )
                .map_err(bad)?,
            ),
            Dtype::I32 => Tensor::I32(
                ArrayD::from_shape_vec(
                    shape,
                    data.chunks_exact(4)
                        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            Dtype::BF16 => Tensor::BF16(
                ArrayD::from_shape_vec(
                    shape,
                    data.chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            Dtype::F16 => Tensor::F16(
                ArrayD::from_shape_vec(
                    shape,
                    data.chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                        .collect(),
                )
                .map_err(bad)?,
            ),
            other => {
                if let Some(f) = foreign.as_deref_mut() {
                    f.push((name.to_string(), other.to_string()));
                    continue;
                }
                return Err(data_err(
                    path,
                    format!(
                        "tensor `{name}` is {other}; checkpoints hold f32, f64, i32, bf16 and f16"
                    ),
                ));
            }
        };
        // A NaN or an infinity would spread through training and be saved again.
        if t.to_f64_vec().iter().any(|x| !x.is_finite()) {
            return Err(data_err(
                path,
                format!("tensor `{name}` holds NaN or infinite values; refusing to load it"),
            ));
        }
        tensors.insert(name.to_string(), t);
    }
    Ok((tensors, metadata))
}

/// The metadata key of the per-tensor checksums (`name=crc32hex`, one per line).
pub const CHECKSUM_KEY: &str = "distc_crc32";

/// The metadata key of a training state's JSON index.
pub const INDEX_KEY: &str = "distc_index";

/// What a training-state file holds, stored as JSON in its safetensors metadata under
/// [`INDEX_KEY`], so any safetensors reader sees the step and where each tensor is.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StateIndex {
    /// Always `distc-training-state`.
    pub format: String,
    /// The model's name.
    pub model: String,
    /// Steps completed.
    pub step: u64,
    /// Training samples consumed, over all workers: where the data stream resumes.
    pub samples: u64,
    /// What wrote it, for people: strategy, workers, ZeRO stage.
    pub saved_by: String,
    /// The optimizer, for people (its state is the tensors named `VAR/SLOT` and
    /// [`STEP_KEY`]).
    pub optimizer: String,
    /// The variables, whole, stored under their own names.
    pub variables: Vec<String>,
    /// The optimizer's tensors, whole.
    pub optimizer_state: Vec<String>,
}

const STATE_FORMAT: &str = "distc-training-state";

/// The furthest step a state may record: beyond it, the step count would overflow
/// the arithmetic of the steps after it, so such an index is damage.
pub const MAX_STEP: u64 = 1 << 62;

impl StateIndex {
    /// The index of a state of `model` after `step`, its data at `samples`, saved by
    /// `saved_by` with the optimizer `optimizer` describes; its lists of what it holds
    /// are filled in as it is written.
    pub fn at(model: &str, step: u64, samples: u64, saved_by: String, optimizer: String) -> Self {
        StateIndex {
            format: String::new(),
            model: model.to_string(),
            step,
            samples,
            saved_by,
            optimizer,
            variables: Vec::new(),
            optimizer_state: Vec::new(),
        }
    }

    /// The kind of optimizer that wrote the state, as the DSL names it (`sgd`,
    /// `momentum`, `adam`, `lars`, `lamb`), read from its description (`Sgd { lr: 0.1,
    /// momentum: 0.9 }`); `None` when the description names none.
    pub fn optimizer_kind(&self) -> Option<&'static str> {
        let d = self.optimizer.trim();
        let word: String = d.chars().take_while(|c| c.is_alphanumeric()).collect();
        let field = |name: &str| {
            d.split(&format!("{name}:"))
                .nth(1)
                .and_then(|rest| {
                    rest.split([',', '}'])
                        .next()
                        .and_then(|v| v.trim().parse::<f64>().ok())
                })
                .unwrap_or(0.0)
        };
        match word.to_ascii_lowercase().as_str() {
            "sgd" => Some(if field("momentum") == 0.0 {
                "sgd"
            } else {
                "momentum"
            }),
            "momentum" => Some("momentum"),
            // AdamW is Adam with a decay (OptimizerSpec::name's spelling).
            "adam" if field("weight_decay") > 0.0 => Some("adamw"),
            "adam" => Some("adam"),
            "adamw" => Some("adamw"),
            "lars" => Some("lars"),
            "lamb" => Some("lamb"),
            _ => None,
        }
    }
}

/// A run's state at the end of a step, whole whatever the layout that trained it (a
/// variable on servers or in ZeRO chunks is stored as one tensor), so a run under
/// another strategy, worker count or ZeRO stage can resume it.
#[derive(Clone, Debug)]
pub struct TrainingState {
    /// The index (step, data position, names).
    pub index: StateIndex,
    /// Variables by name.
    pub params: HashMap<String, Tensor>,
    /// Optimizer state as [`crate::cpu::optim::Optimizer::state`] names it.
    pub optimizer: HashMap<String, Tensor>,
}

/// Writes `state` to `path` atomically (see [`save`]).
pub fn save_state(path: &Path, state: &TrainingState) -> Result<()> {
    let mut named: Vec<(String, &Tensor)> = state
        .params
        .iter()
        .chain(&state.optimizer)
        .map(|(k, v)| (k.clone(), v))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let index = serde_json::to_string(&state.index)
        .map_err(|e| data_err(path, format!("cannot encode the index: {e}")))?;
    save(
        path,
        &named,
        [(INDEX_KEY.to_string(), index)].into_iter().collect(),
    )?;
    note_written(path, state.index.step);
    Ok(())
}

/// Records that the state of `step` is whole on disk at `path`.
pub(crate) fn note_written(path: &Path, step: u64) {
    *last_written() = Some((path.to_path_buf(), step));
}

/// Writes training states on a thread of its own, one at a time: training goes on
/// while a state is written, and the next write first waits for the one in flight
/// (so at most one state is in memory for writing). A write's error is returned by
/// the next call. Dropping the last handle waits for the write in flight, so a state
/// whose write began is never cut off by the run's end.
#[derive(Clone, Default)]
pub struct StateWriter(Arc<InFlight>);

#[derive(Default)]
struct InFlight(Mutex<Option<std::thread::JoinHandle<Result<()>>>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(h) = self.0.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for StateWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateWriter")
    }
}

impl StateWriter {
    /// Starts writing `state` to `path` once the write in flight is done; with
    /// `wait`, returns when this one is done too.
    pub fn write(&self, path: PathBuf, state: Arc<TrainingState>, wait: bool) -> Result<()> {
        self.start(move || save_state(&path, &state), wait)
    }

    /// Starts the write `job` once the write in flight is done; with `wait`, returns
    /// when this one is done too.
    pub fn start(
        &self,
        job: impl FnOnce() -> Result<()> + Send + 'static,
        wait: bool,
    ) -> Result<()> {
        // Held while joining: whoever else waits, waits for the join to finish.
        let mut in_flight = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        joined(in_flight.take())?;
        let handle = std::thread::Builder::new()
            .name("state-writer".into())
            .spawn(job)
            .map_err(|e| RuntimeError::no_thread("the state writer", e))?;
        *in_flight = Some(handle);
        drop(in_flight);
        if wait {
            self.wait()?;
        }
        Ok(())
    }

    /// Waits for the write in flight, if any, and returns its result.
    pub fn wait(&self) -> Result<()> {
        let mut in_flight = self.0 .0.lock().unwrap_or_else(|p| p.into_inner());
        joined(in_flight.take())
    }
}

/// The result of the write `h`, once it is done.
fn joined(h: Option<std::thread::JoinHandle<Result<()>>>) -> Result<()> {
    match h {
        Some(h) => h.join().unwrap_or_else(|_| {
            Err(RuntimeError::Internal {
                at: "the state writer".into(),
                message: "the state writer panicked".into(),
            })
        }),
        None => Ok(()),
    }
}

fn last_written() -> std::sync::MutexGuard<'static, Option<(std::path::PathBuf, u64)>> {
    static LAST: std::sync::Mutex<Option<(std::path::PathBuf, u64)>> = std::sync::Mutex::new(None);
    LAST.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The file and step of the last training state this process wrote, if any: what a
/// process about to exit on a signal says is on disk, without reading it back.
pub fn last_state_written() -> Option<(std::path::PathBuf, u64)> {
    last_written().clone()
}

/// Reads a training state written by [`save_state`], or a sharded one (a folder, see
/// [`crate::core::shards`]); a plain weights file (`--save`) or a tensor the index
/// does not list is refused with the reason.
pub fn load_state(path: &Path) -> Result<TrainingState> {
    if path.is_dir() {
        return crate::core::shards::load_sharded(path);
    }
    let (mut tensors, meta) = load(path)?;
    let Some(text) = meta.get(INDEX_KEY) else {
        return Err(data_err(
            path,
            "has no training-state index: it is not a file written by --checkpoint-every \
             (a --save file holds the weights alone and cannot be resumed)",
        ));
    };
    let index: StateIndex = serde_json::from_str(text)
        .map_err(|e| data_err(path, format!("its index is not valid: {e}")))?;
    if index.format != STATE_FORMAT {
        return Err(data_err(
            path,
            format!("format `{}` is not {STATE_FORMAT}", index.format),
        ));
    }
    if index.step > MAX_STEP {
        return Err(data_err(
            path,
            format!(
                "its index is at step {}, beyond any run (at most 2^62): the state is damaged",
                index.step
            ),
        ));
    }
    let mut take = |names: &[String]| -> Result<HashMap<String, Tensor>> {
        names
            .iter()
            .map(|n| {
                tensors.remove(n).map(|t| (n.clone(), t)).ok_or_else(|| {
                    data_err(path, format!("the index lists `{n}`, the file lacks it"))
                })
            })
            .collect()
    };
    let params = take(&index.variables)?;
    let optimizer = take(&index.optimizer_state)?;
    Ok(TrainingState {
        index,
        params,
        optimizer,
    })
}

impl TrainingState {
    /// A state from whole variables and optimizer state.
    pub fn new(
        index: StateIndex,
        params: HashMap<String, Tensor>,
        optimizer: HashMap<String, Tensor>,
    ) -> TrainingState {
        let mut index = index;
        index.format = STATE_FORMAT.to_string();
        index.variables = sorted_keys(&params);
        index.optimizer_state = sorted_keys(&optimizer);
        TrainingState {
            index,
            params,
            optimizer,
        }
    }
}

fn sorted_keys(m: &HashMap<String, Tensor>) -> Vec<String> {
    let mut v: Vec<String> = m.keys().cloned().collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> Arc<TrainingState> {
        let index = StateIndex {
            format: String::new(),
            model: "m".into(),
            step,
            samples: 4 * step,
            saved_by: "test".into(),
            optimizer: "Sgd { lr: 0.1 }".into(),
            variables: Vec::new(),
            optimizer_state: Vec::new(),
        };
        let w = Tensor::F32(ArrayD::from_elem(IxDyn(&[3]), step as f32));
        let params = [("w".to_string(), w)].into_iter().collect();
        Arc::new(TrainingState::new(index, params, HashMap::new()))
    }

    #[test]
    fn states_are_written_in_turn_and_a_failed_write_is_reported_by_the_next_call() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("s.st");
        let w = StateWriter::default();
        for step in 1..=5 {
            w.write(path.clone(), state(step), false).expect("started");
        }
        w.wait().expect("written");
        assert_eq!(load_state(&path).expect("a state").index.step, 5);
        // Under a file, not a folder: the write fails on its own thread, and the next
        // call returns its error (the state it was given is not written).
        let bad = path.join("s.st");
        w.write(bad, state(6), false).expect("started");
        let e = w
            .write(path.clone(), state(7), true)
            .expect_err("the failed write");
        assert!(e.to_string().contains("s.st/s.st"), "{e}");
        assert_eq!(load_state(&path).expect("a state").index.step, 5);
        // The last handle dropped waits for the write in flight.
        w.write(path.clone(), state(8), false).expect("started");
        drop(w);
        assert_eq!(load_state(&path).expect("a state").index.step, 8);
    }
}
