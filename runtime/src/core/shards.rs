//! Sharded training states (`--checkpoint DIR --sharded`): every worker writes the
//! tensors it holds (its ZeRO chunks, its model-axis parts, and the whole variables
//! no other worker holds first), in parallel and while training goes on; worker 0
//! adds a manifest. A state loads whole ([`load_sharded`]), so any layout resumes it
//! as it resumes a one-file state.
//!
//! On disk:
//! ```text
//! DIR/latest                        step-000000040 (the last complete state)
//! DIR/step-000000040/manifest.json  the index, the workers, each tensor's gathers
//! DIR/step-000000040/rank-0.safetensors ... rank-(N-1).safetensors
//! ```
//! A state is complete once every worker has written its shard; only then does
//! `latest` name it ([`commit`]), and the states before it are removed. A shard
//! carries its step and worker in its metadata and a checksum per tensor, so a mix of
//! steps, a missing shard or a damaged one is refused, never loaded.
//!
//! How a stored tensor becomes the whole one is read from the plan's final program,
//! which gathers exactly these tensors: a chain of `all_gather_dense` (ZeRO's chunks
//! over the data axis) and `model_gather` (the parts of the model axis) from a
//! variable to an output ([`Layout::of`]).

use crate::core::checkpoint::{self, StateIndex, TrainingState, STEP_KEY};
use crate::core::error::{Result, RuntimeError};
use crate::core::value::Tensor;
use distc_ir::{Graph, Op};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The manifest's file name in a state's folder.
pub const MANIFEST: &str = "manifest.json";
/// The file naming the last complete state's folder.
pub const LATEST: &str = "latest";
const FORMAT: &str = "distc-sharded-state";
/// The metadata key of a shard's [`ShardIdentity`].
const SHARD_KEY: &str = "distc_shard";

/// One step of the final program from a stored tensor to the whole one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Gather {
    /// ZeRO's chunks over the data axis: the flat chunks of `parts` workers joined,
    /// the padding cut, the result of `shape`.
    Chunks { parts: usize, shape: Vec<usize> },
    /// The model axis's parts: `parts` tensors joined along `dim`.
    Parts { dim: usize, parts: usize },
}

impl Gather {
    fn axis(&self) -> Axis {
        match self {
            Gather::Chunks { .. } => Axis::Data,
            Gather::Parts { .. } => Axis::Model,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Axis {
    Data,
    Model,
}

/// A stored tensor: the whole tensor's name, and the gathers that make it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    /// The name a worker's shard stores it under (`w1.tp.zero`, `w1.tp.zero/m`).
    pub stored: String,
    /// The final program's gathers, in order.
    pub gathers: Vec<Gather>,
}

/// How each variable a worker holds is split: its stored name to the whole
/// variable's name and the gathers between them. A variable it does not list is
/// whole on every worker that holds it.
#[derive(Clone, Debug, Default)]
pub struct Layout(HashMap<String, (String, Vec<Gather>)>);

impl Layout {
    /// The layout of a plan whose final program is `finalize` (none: nothing is
    /// split). An op in the final program other than the two gathers is refused:
    /// the state could not be put together again.
    pub fn of(finalize: Option<&Graph>) -> std::result::Result<Layout, String> {
        let mut out = HashMap::new();
        let Some(g) = finalize else {
            return Ok(Layout(out));
        };
        for (whole, value) in g.outputs() {
            let mut gathers = Vec::new();
            let mut id = value.node;
            let stored = loop {
                let node = g.node(id);
                match g.op(id) {
                    Op::Param { name, .. } => break name.clone(),
                    Op::AllGatherDense { workers, shape } => gathers.push(Gather::Chunks {
                        parts: *workers,
                        shape: shape.0.clone(),
                    }),
                    Op::ModelGather { dim, parts } => gathers.push(Gather::Parts {
                        dim: *dim,
                        parts: *parts,
                    }),
                    other => {
                        return Err(format!(
                            "the plan's final program makes `{whole}` with `{}`, which a \
                             sharded state cannot record (it records gathers of ZeRO \
                             chunks and model-axis parts)",
                            other.mnemonic()
                        ))
                    }
                }
                id = node.inputs[0].node;
            };
            gathers.reverse();
            out.insert(stored, (whole, gathers));
        }
        Ok(Layout(out))
    }

    /// The whole name and the gathers of the stored tensor `key` (a variable, or an
    /// optimizer slot `VAR/SLOT` split as its variable is).
    fn whole(&self, key: &str) -> (String, Vec<Gather>) {
        if let Some((whole, g)) = self.0.get(key) {
            return (whole.clone(), g.clone());
        }
        if let Some((var, slot)) = key.rsplit_once('/').filter(|_| key != STEP_KEY) {
            if let Some((whole, g)) = self.0.get(var) {
                return (format!("{whole}/{slot}"), g.clone());
            }
        }
        (key.to_string(), Vec::new())
    }

    /// Whether the worker at `(data, model)` writes `key`: one worker of each group
    /// that holds the same values, the first along every axis the tensor is not
    /// split on.
    pub fn writes(&self, key: &str, (data, model): (usize, usize)) -> bool {
        let (_, gathers) = self.whole(key);
        let split = |axis| gathers.iter().any(|g| g.axis() == axis);
        (data == 0 || split(Axis::Data)) && (model == 0 || split(Axis::Model))
    }

    /// The variables split over the model axis alone, each gathered by one
    /// `model_gather`: `(part, whole, dim)`, sorted by part.
    pub fn model_parts(&self) -> Vec<(String, String, usize)> {
        let mut out: Vec<(String, String, usize)> = self
            .0
            .iter()
            .filter_map(|(part, (whole, gathers))| match gathers.as_slice() {
                [Gather::Parts { dim, .. }] => Some((part.clone(), whole.clone(), *dim)),
                _ => None,
            })
            .collect();
        out.sort();
        out
    }

    /// A variable split over the data axis (ZeRO's chunks), if any: then each worker
    /// holds values no other worker of its model rank holds.
    pub fn split_over_data(&self) -> Option<&str> {
        let mut split: Vec<&str> = self
            .0
            .values()
            .filter(|(_, g)| g.iter().any(|g| g.axis() == Axis::Data))
            .map(|(whole, _)| whole.as_str())
            .collect();
        split.sort();
        split.first().copied()
    }
}

/// What a shard says of itself, in its metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct ShardIdentity {
    step: u64,
    rank: usize,
    data: usize,
    model: usize,
    /// The run that wrote it ([`Manifest::run`]); absent in shards of distc before
    /// issue 60.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    run: Option<String>,
}

/// A sharded state's manifest: the index of the whole state, the workers that wrote
/// it, and how each whole tensor is put together.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Always `distc-sharded-state`.
    pub format: String,
    /// The whole state's index (its variables and optimizer state by whole name).
    pub index: StateIndex,
    /// Workers, one shard each: `rank-R.safetensors`.
    pub workers: usize,
    /// The data axis's and the model axis's sizes.
    pub data: usize,
    /// See `data`.
    pub model: usize,
    /// Each whole tensor's stored name and gathers.
    pub tensors: BTreeMap<String, Stored>,
    /// The run that wrote the state, which each of its shards names too: a shard of
    /// another run of the same model, at the same step, is refused (issue 60, item 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<String>,
    /// CRC-32 of the manifest's own JSON (compact, without this field), so that an
    /// edited manifest (other sample counts, another mesh) is refused as damaged, as a
    /// tensor whose bytes do not match its CRC is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

/// A state's folder under `dir`.
pub fn step_dir(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("step-{step:09}"))
}

/// Worker `rank`'s shard's file name in a state's folder.
pub fn shard_file(rank: usize) -> String {
    format!("rank-{rank}.safetensors")
}

fn data_err(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Data {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl Manifest {
    /// Writes it into its state's folder under `dir`, with its digest.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let path = step_dir(dir, self.index.step).join(MANIFEST);
        let encode =
            |e: serde_json::Error| data_err(&path, format!("cannot encode the manifest: {e}"));
        let digest = self.own_digest().map_err(encode)?;
        let text = serde_json::to_string_pretty(&Manifest {
            digest: Some(digest),
            ..self.clone()
        })
        .map_err(encode)?;
        crate::core::output::write_file(&path, text.as_bytes())
    }

    /// The same manifest, of the run `run`.
    pub fn of_run(self, run: &str) -> Manifest {
        Manifest {
            run: Some(run.to_string()),
            ..self
        }
    }

    /// CRC-32 of its JSON without the digest, as hex.
    fn own_digest(&self) -> serde_json::Result<String> {
        let bare = serde_json::to_vec(&Manifest {
            digest: None,
            ..self.clone()
        })?;
        Ok(format!("{:08x}", crc32fast::hash(&bare)))
    }

    /// The manifest of the state at `index.step` whose stored tensors are `keys` (each
    /// named once, whichever workers hold it), on `workers` workers of a data axis of
    /// `data` and a model axis of `model`.
    pub fn of(
        index: &StateIndex,
        layout: &Layout,
        keys: &[String],
        (workers, data, model): (usize, usize, usize),
    ) -> Manifest {
        let mut tensors = BTreeMap::new();
        let (mut variables, mut optimizer_state) = (Vec::new(), Vec::new());
        for key in keys {
            let (whole, gathers) = layout.whole(key);
            if whole.contains('/') {
                optimizer_state.push(whole.clone());
            } else {
                variables.push(whole.clone());
            }
            tensors.insert(
                whole,
                Stored {
                    stored: key.clone(),
                    gathers,
                },
            );
        }
        variables.sort();
        optimizer_state.sort();
        Manifest {
            format: FORMAT.to_string(),
            index: StateIndex {
                variables,
                optimizer_state,
                format: "distc-training-state".into(),
                ..index.clone()
            },
            workers,
            data,
            model,
            tensors,
            run: None,
            digest: None,
        }
    }
}

/// Worker `rank`'s shard of the state at `step`: the tensors it writes.
pub fn write_shard(
    dir: &Path,
    (step, run): (u64, &str),
    (rank, data, model): (usize, usize, usize),
    tensors: &HashMap<String, Tensor>,
) -> Result<()> {
    let path = step_dir(dir, step).join(shard_file(rank));
    let mut named: Vec<(String, &Tensor)> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let identity = ShardIdentity {
        step,
        rank,
        data,
        model,
        run: Some(run.to_string()),
    };
    let meta = serde_json::to_string(&identity)
        .map_err(|e| data_err(&path, format!("cannot encode the shard's identity: {e}")))?;
    checkpoint::save(&path, &named, [(SHARD_KEY.to_string(), meta)].into())
}

/// Makes the state at `step` the one `dir` holds: `latest` names it, and the
/// folders of earlier states are removed (a later one may be being written). Call
/// once every shard is written.
pub fn commit(dir: &Path, step: u64) -> Result<()> {
    let name = format!("step-{step:09}");
    crate::core::output::write_file(&dir.join(LATEST), format!("{name}\n").as_bytes())?;
    let entries = std::fs::read_dir(dir).map_err(|source| RuntimeError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let earlier = n
            .strip_prefix("step-")
            .and_then(|k| k.parse::<u64>().ok())
            .is_some_and(|k| k < step);
        if earlier && is_state_dir(&e.path()) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
    checkpoint::note_written(dir, step);
    Ok(())
}

/// Whether `folder` is a state's folder as distc writes them: named `step-NNNNNNNNN`,
/// holding nothing but shards, a manifest and their temporary files. Only such a
/// folder is ever removed: a user's own folder of that name, or one a user put a file
/// in, is left alone (issue 60, item 9).
fn is_state_dir(folder: &Path) -> bool {
    let name = folder.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let numbered = name
        .strip_prefix("step-")
        .is_some_and(|k| k.len() == 9 && k.bytes().all(|b| b.is_ascii_digit()));
    let Ok(entries) = std::fs::read_dir(folder) else {
        return false;
    };
    numbered
        && entries.flatten().all(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let shard = n
                .strip_prefix("rank-")
                .and_then(|r| r.strip_suffix(".safetensors"))
                .is_some_and(|r| r.parse::<usize>().is_ok());
            let ours = n == MANIFEST || shard || n.contains(".distc-tmp-");
            ours && e.file_type().is_ok_and(|t| t.is_file())
        })
}

/// Makes way for a state's folder that a run is about to write: one an earlier run
/// left ([`is_state_dir`]) is removed; anything else of that name is refused, never
/// removed or written into.
pub fn clear_state_dir(folder: &Path) -> Result<()> {
    if std::fs::symlink_metadata(folder).is_err() {
        return Ok(());
    }
    if !is_state_dir(folder) {
        return Err(data_err(
            folder,
            "holds what distc did not write (a state's folder holds only rank-N.safetensors \
             and manifest.json): refusing to remove it or to write a state into it; move \
             it, or give --checkpoint another folder",
        ));
    }
    std::fs::remove_dir_all(folder).map_err(|source| RuntimeError::Io {
        path: folder.to_path_buf(),
        source,
    })
}

/// Removes the folders under `dir` of the states of the steps `which` names.
pub fn clear_steps(dir: &Path, which: impl Fn(u64) -> bool) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let named = name
            .strip_prefix("step-")
            .and_then(|k| k.parse::<u64>().ok())
            .is_some_and(&which);
        if named {
            clear_state_dir(&e.path())?;
        }
    }
    Ok(())
}

/// The newest complete state under `dir` and its folder: committed or not (a run that
/// stopped before committing its last state may have finished writing it). Complete:
/// a manifest, and a shard of that step from each of its workers. (A step's folder
/// never mixes two runs' shards: the run that writes it removes it first.) Checksums
/// are checked when it is loaded.
pub fn newest_complete(dir: &Path) -> Option<(u64, PathBuf)> {
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step = name.strip_prefix("step-")?.parse::<u64>().ok()?;
            Some((step, e.path()))
        })
        .collect();
    steps.sort_by_key(|s| std::cmp::Reverse(s.0));
    steps
        .into_iter()
        .find(|(step, folder)| complete(folder, *step))
}

/// Whether `folder` holds a manifest of `step` and every worker's shard of it.
fn complete(folder: &Path, step: u64) -> bool {
    let Ok(text) = std::fs::read_to_string(folder.join(MANIFEST)) else {
        return false;
    };
    let Ok(manifest) = serde_json::from_str::<Manifest>(&text) else {
        return false;
    };
    manifest.index.step == step
        && (0..manifest.workers).all(|rank| {
            shard_identity(&folder.join(shard_file(rank)))
                .is_some_and(|id| id.step == step && id.rank == rank)
        })
}

/// A shard's identity, read from its header alone.
fn shard_identity(path: &Path) -> Option<ShardIdentity> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let n = u64::from_le_bytes(len);
    if n > 1 << 26 {
        return None;
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&header).ok()?;
    let id = header.get("__metadata__")?.get(SHARD_KEY)?.as_str()?;
    serde_json::from_str(id).ok()
}

/// The folder of the state `path` names: the one `latest` names, or `path` itself
/// where it holds a manifest.
fn state_dir(path: &Path) -> Result<PathBuf> {
    let latest = path.join(LATEST);
    if latest.is_file() {
        let text = crate::core::output::read_regular_text(&latest, 4096).map_err(|source| {
            RuntimeError::Io {
                path: latest.clone(),
                source,
            }
        })?;
        let name = text.trim();
        if name.is_empty() || name.contains(['/', '\\']) || name == ".." {
            return Err(data_err(
                &latest,
                format!("names `{name}`, not a state's folder"),
            ));
        }
        return Ok(path.join(name));
    }
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    Err(data_err(
        path,
        format!(
            "is a folder with neither `{LATEST}` nor `{MANIFEST}`: not a sharded training \
             state, or one whose first state was never completed"
        ),
    ))
}

/// Reads the sharded state `path` names (its folder, or one state's folder), whole:
/// every shard is checked against the manifest (its step, its worker, its
/// checksums) before anything is put together.
pub fn load_sharded(path: &Path) -> Result<TrainingState> {
    let dir = state_dir(path)?;
    let mpath = dir.join(MANIFEST);
    let text = crate::core::output::read_regular_text(&mpath, 1 << 28).map_err(|source| {
        RuntimeError::Io {
            path: mpath.clone(),
            source,
        }
    })?;
    let manifest: Manifest = serde_json::from_str(&text)
        .map_err(|e| data_err(&mpath, format!("not a sharded state's manifest: {e}")))?;
    if manifest.format != FORMAT {
        return Err(data_err(
            &mpath,
            format!("format `{}` is not {FORMAT}", manifest.format),
        ));
    }
    // The run's name and the digest came in together: a manifest naming its run
    // without a digest had it taken out.
    if manifest.run.is_some() && manifest.digest.is_none() {
        return Err(data_err(
            &mpath,
            "names its run and carries no digest: the manifest was edited or is damaged",
        ));
    }
    if let Some(stored) = &manifest.digest {
        let own = manifest
            .own_digest()
            .map_err(|e| data_err(&mpath, format!("cannot encode the manifest: {e}")))?;
        if own != *stored {
            return Err(data_err(
                &mpath,
                format!(
                    "does not match its digest (CRC-32 {own}, stored {stored}): the \
                     manifest was edited or is damaged"
                ),
            ));
        }
    }
    if manifest.workers == 0
        || manifest.data == 0
        || manifest.model == 0
        || manifest
            .data
            .checked_mul(manifest.model)
            .is_none_or(|cells| cells > manifest.workers)
    {
        return Err(data_err(
            &mpath,
            format!(
                "{} workers on a data axis of {} and a model axis of {}: the manifest is \
                 damaged",
                manifest.workers, manifest.data, manifest.model
            ),
        ));
    }
    let step = manifest.index.step;
    // Every shard, by its place on the mesh.
    let mut shards: HashMap<(usize, usize), HashMap<String, Tensor>> = HashMap::new();
    for rank in 0..manifest.workers {
        let ((data, model), tensors) = read_shard(
            &dir,
            (step, Some(manifest.run.as_deref())),
            rank,
            manifest.workers,
        )?;
        if data >= manifest.data || model >= manifest.model {
            return Err(data_err(
                &dir.join(shard_file(rank)),
                format!(
                    "is at data rank {data} and model rank {model}, outside the manifest's \
                     mesh"
                ),
            ));
        }
        shards.entry((data, model)).or_default().extend(tensors);
    }
    let cells: Cells<'_> = shards.iter().map(|(k, v)| (*k, v)).collect();
    assemble_state(&manifest, &cells).map_err(|m| data_err(&dir, m))
}

/// Worker `rank`'s shard in the state folder `folder` of `step` (of `workers`
/// shards), checked: its place on the mesh, its tensors, and the run that wrote it
/// where `run` says which it must be: `Some(Some(r))` the state's run `r`,
/// `Some(None)` none (a state of distc before issue 60, whose shards name none), `None`
/// any (a process's own shards, written moments before).
pub fn read_shard(
    folder: &Path,
    (step, run): (u64, Option<Option<&str>>),
    rank: usize,
    workers: usize,
) -> Result<((usize, usize), HashMap<String, Tensor>)> {
    let spath = folder.join(shard_file(rank));
    if !spath.is_file() {
        return Err(data_err(
            &spath,
            format!(
                "is missing: the state of step {step} has {workers} shards, and is \
                 incomplete without this one"
            ),
        ));
    }
    let (tensors, meta) = checkpoint::load(&spath)?;
    let identity: ShardIdentity = meta
        .get(SHARD_KEY)
        .and_then(|m| serde_json::from_str(m).ok())
        .ok_or_else(|| data_err(&spath, "is not a shard of a sharded state"))?;
    if identity.step != step || identity.rank != rank {
        return Err(data_err(
            &spath,
            format!(
                "is worker {}'s shard of step {}; the manifest wants worker {rank}'s of \
                 step {step}: the state is incomplete",
                identity.rank, identity.step
            ),
        ));
    }
    match (run, identity.run.as_deref()) {
        (Some(Some(want)), got) if got != Some(want) => {
            return Err(data_err(
                &spath,
                format!(
                    "is a shard of another run ({}) than the state's ({want}): a folder \
                     never mixes two runs' shards, so the state is incomplete",
                    got.unwrap_or("no run named")
                ),
            ))
        }
        (Some(None), Some(got)) => {
            return Err(data_err(
                &spath,
                format!(
                    "names the run that wrote it ({got}), and the state's manifest names \
                     none: the manifest was edited or is damaged"
                ),
            ))
        }
        _ => {}
    }
    Ok(((identity.data, identity.model), tensors))
}

/// What the workers at each place on the mesh hold, by stored name.
pub type Cells<'a> = HashMap<(usize, usize), &'a HashMap<String, Tensor>>;

/// The whole state `manifest` describes, from what the workers at each place of the
/// mesh hold (`cells`; a tensor not split along an axis is taken from any worker
/// along it that holds it).
pub fn assemble_state(
    manifest: &Manifest,
    cells: &Cells<'_>,
) -> std::result::Result<TrainingState, String> {
    let mut params = HashMap::new();
    let mut optimizer = HashMap::new();
    for (whole, stored) in &manifest.tensors {
        let t = assemble(manifest, cells, whole, stored)?;
        if manifest.index.variables.contains(whole) {
            params.insert(whole.clone(), t);
        } else {
            optimizer.insert(whole.clone(), t);
        }
    }
    for name in manifest
        .index
        .variables
        .iter()
        .chain(&manifest.index.optimizer_state)
    {
        if !manifest.tensors.contains_key(name) {
            return Err(format!(
                "the index lists `{name}`, the manifest does not say where it is"
            ));
        }
    }
    Ok(TrainingState::new(
        manifest.index.clone(),
        params,
        optimizer,
    ))
}

/// The whole tensor `whole` from the shards: the stored pieces gathered in the final
/// program's order, each gather joining the pieces along its axis.
fn assemble(
    manifest: &Manifest,
    cells: &Cells<'_>,
    whole: &str,
    stored: &Stored,
) -> std::result::Result<Tensor, String> {
    let split = |axis| stored.gathers.iter().any(|g| g.axis() == axis);
    let datas = if split(Axis::Data) { manifest.data } else { 1 };
    let models = if split(Axis::Model) {
        manifest.model
    } else {
        1
    };
    let mut pieces: HashMap<(usize, usize), Tensor> = HashMap::new();
    for d in 0..datas {
        for m in 0..models {
            // Along an axis it is not split on, every worker holds the same values:
            // the first that holds it (the one a sharded state's shard has).
            let mut along: Vec<(usize, usize)> = cells
                .keys()
                .copied()
                .filter(|&(cd, cm)| {
                    (cd == d || !split(Axis::Data)) && (cm == m || !split(Axis::Model))
                })
                .collect();
            along.sort();
            let t = along
                .iter()
                .find_map(|c| cells[c].get(&stored.stored))
                .ok_or_else(|| {
                    format!(
                        "no worker at data rank {d} and model rank {m} holds `{}` (a piece of \
                         `{whole}`)",
                        stored.stored
                    )
                })?;
            pieces.insert((d, m), t.clone());
        }
    }
    let (mut datas, mut models) = (datas, models);
    for g in &stored.gathers {
        let mut next = HashMap::new();
        match g {
            Gather::Chunks { parts, shape } => {
                if *parts != datas {
                    return Err(format!(
                        "`{whole}` is gathered from {parts} chunks, the data axis has {datas}"
                    ));
                }
                for m in 0..models {
                    let chunks: Vec<&Tensor> = (0..datas).map(|d| &pieces[&(d, m)]).collect();
                    next.insert((0, m), join_chunks(&chunks, shape, whole)?);
                }
                datas = 1;
            }
            Gather::Parts { dim, parts } => {
                if *parts != models {
                    return Err(format!(
                        "`{whole}` is gathered from {parts} parts, the model axis has {models}"
                    ));
                }
                for d in 0..datas {
                    let ps: Vec<&Tensor> = (0..models).map(|m| &pieces[&(d, m)]).collect();
                    next.insert((d, 0), concat(&ps, *dim, whole)?);
                }
                models = 1;
            }
        }
        pieces = next;
    }
    pieces
        .remove(&(0, 0))
        .ok_or_else(|| format!("`{whole}` has pieces left on more than one worker"))
}

/// The flat chunks joined, the padding cut, shaped `shape` (what `all_gather_dense`
/// makes of ZeRO's chunks).
fn join_chunks(
    chunks: &[&Tensor],
    shape: &[usize],
    whole: &str,
) -> std::result::Result<Tensor, String> {
    let n = shape
        .iter()
        .try_fold(1usize, |n, d| n.checked_mul(*d))
        .ok_or_else(|| format!("`{whole}`'s shape {shape:?} has more elements than memory"))?;
    let flat: Vec<Tensor> = chunks
        .iter()
        .map(|c| reshape(c, &[c.len()], whole))
        .collect::<std::result::Result<_, _>>()?;
    let refs: Vec<&Tensor> = flat.iter().collect();
    let joined = concat(&refs, 0, whole)?;
    if joined.len() < n {
        return Err(format!(
            "`{whole}`'s chunks hold {} elements, its shape {shape:?} {n}",
            joined.len()
        ));
    }
    reshape(&slice_front(&joined, n), shape, whole)
}

fn slice_front(t: &Tensor, n: usize) -> Tensor {
    crate::core::value::each_dtype!(t, a => a.slice(ndarray::s![..n]).to_owned().into_dyn())
}

fn reshape(t: &Tensor, shape: &[usize], whole: &str) -> std::result::Result<Tensor, String> {
    t.reshaped(shape).map_err(|e| format!("`{whole}`: {e}"))
}

/// The pieces joined along `dim` (all of one dtype).
fn concat(pieces: &[&Tensor], dim: usize, whole: &str) -> std::result::Result<Tensor, String> {
    Tensor::concat(pieces, dim).map_err(|e| format!("`{whole}`: {e}"))
}

#[cfg(test)]
mod folder_tests {
    use super::{clear_steps, step_dir};

    /// Issue 60, item 9: `--sharded` removed a user's own folder named like a state's.
    /// A state's folder an earlier run left is removed before the step is written
    /// again; anything else of that name is refused, and left as it was.
    #[test]
    fn only_a_folder_distc_wrote_is_removed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let ours = step_dir(dir.path(), 5);
        std::fs::create_dir_all(&ours).expect("folder");
        std::fs::write(ours.join("rank-0.safetensors"), b"x").expect("shard");
        std::fs::write(ours.join(".rank-1.safetensors.distc-tmp-9"), b"x").expect("tmp");
        clear_steps(dir.path(), |k| k >= 3).expect("cleared");
        assert!(!ours.exists(), "an earlier run's folder stayed");
        let theirs = step_dir(dir.path(), 7);
        std::fs::create_dir_all(&theirs).expect("folder");
        std::fs::write(theirs.join("notes.txt"), b"mine").expect("a user's file");
        let e = clear_steps(dir.path(), |k| k >= 3).expect_err("refused");
        assert!(e.to_string().contains("did not write"), "{e}");
        assert_eq!(
            std::fs::read(theirs.join("notes.txt")).expect("still there"),
            b"mine"
        );
        // Below the run's first step: not this run's to clear, and left alone.
        clear_steps(dir.path(), |k| k >= 8).expect("nothing at or after step 8");
        assert!(theirs.join("notes.txt").exists());
    }
}
