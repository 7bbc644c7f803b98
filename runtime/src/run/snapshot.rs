//! The training state an elastic run keeps in its workers' memory (`--elastic`).
//!
//! After every step each worker keeps a host copy of what it holds: its ZeRO chunks,
//! its model-axis parts, the variables it holds whole, their optimizer slots. Nothing
//! is gathered, so keeping costs no communication; worker 0 adds the servers' rows
//! (the servers outlive a lost worker). A worker that writes a sharded state
//! (`--checkpoint DIR --sharded`) also keeps the copy it wrote.
//!
//! A lost worker's memory goes with it ([`StateSlot::lose`]). The state to restart
//! from is put together from the survivors' copies where they hold every piece (no
//! file is read: the usual case, since a data-parallel replica holds what every other
//! replica holds), and otherwise from the newest state of which the survivors kept
//! their copies and a sharded state on disk holds what only the lost worker held
//! (its ZeRO chunks): the survivors' pieces from memory, the lost worker's shard from
//! the file ([`StateSlot::restore`]).

use crate::core::checkpoint::{StateIndex, TrainingState};
use crate::core::error::{Result, RuntimeError};
use crate::core::shards::{self, Cells, Layout, Manifest};
use crate::core::value::Tensor;
use crate::run::mesh::Coord;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What the workers of an elastic run keep in memory, shared by the run and whoever
/// restarts it (see [`crate::run::options::TrainOptions::snapshot`]).
#[derive(Clone, Debug, Default)]
pub struct StateSlot {
    kept: Arc<Mutex<Kept>>,
    /// Signalled at each copy kept.
    changed: Arc<Condvar>,
    /// What trains, for the state's index.
    pub saved_by: String,
}

#[derive(Debug, Default)]
struct Kept {
    /// How the run's variables are split, for putting them together again.
    layout: Layout,
    /// By rank.
    workers: HashMap<usize, Held>,
    /// The servers' variables and slots, whole, by step.
    servers: BTreeMap<u64, Arc<HashMap<String, Tensor>>>,
    /// Workers lost: what they kept is gone.
    lost: BTreeSet<usize>,
}

/// One worker's copies.
#[derive(Debug)]
struct Held {
    /// Its place on the mesh: its replica, stage and model rank.
    place: Coord,
    /// After the last step it ran.
    latest: Option<Copy>,
    /// Of the last state it wrote to a sharded state on disk.
    written: Option<Copy>,
}

/// A worker's tensors after one step.
#[derive(Clone, Debug)]
pub struct Copy {
    /// The step's index (step, data position).
    pub index: StateIndex,
    /// What the worker holds, by the name it holds it under.
    pub tensors: Arc<HashMap<String, Tensor>>,
}

/// A state put together for a restart, and where its pieces came from.
#[derive(Debug)]
pub struct Restored {
    /// The whole state.
    pub state: Arc<TrainingState>,
    /// The shards read from disk: none when the survivors held every piece.
    pub files_read: Vec<PathBuf>,
}

impl StateSlot {
    /// An empty slot; `saved_by` goes into each state's index.
    pub fn new(saved_by: String) -> StateSlot {
        StateSlot {
            kept: Arc::default(),
            changed: Arc::default(),
            saved_by,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A run of the layout `layout` (read from its plan's final program) starts: what
    /// the last run's workers kept is forgotten (the restart took what it needed).
    pub fn begin(&self, layout: Layout) {
        *self.lock() = Kept {
            layout,
            ..Kept::default()
        };
    }

    /// Worker `rank`, at `place` on the mesh, ran a step: `copy` replaces its last;
    /// `written`: the same tensors went to a sharded state on disk.
    pub(crate) fn keep(&self, rank: usize, place: Coord, copy: Copy, written: bool) {
        let mut kept = self.lock();
        let held = kept.workers.entry(rank).or_insert(Held {
            place,
            latest: None,
            written: None,
        });
        if written {
            held.written = Some(copy.clone());
        }
        held.latest = Some(copy);
        kept.prune_servers();
        self.changed.notify_all();
    }

    /// Waits, at most `timeout`, until workers `0..workers` have each kept a copy of
    /// `step` or later. A rehearsed loss waits for it, so its restart point does not
    /// depend on how far the others got (a real loss may come earlier, and the run
    /// then goes back one step further).
    pub(crate) fn wait_kept(&self, step: u64, workers: usize, timeout: Duration) {
        let until = Instant::now() + timeout;
        let mut kept = self.lock();
        loop {
            let done = (0..workers).all(|r| {
                kept.workers
                    .get(&r)
                    .and_then(|h| h.latest.as_ref())
                    .is_some_and(|c| c.index.step >= step)
            });
            let left = until.saturating_duration_since(Instant::now());
            if done || left.is_zero() {
                return;
            }
            kept = self
                .changed
                .wait_timeout(kept, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The servers' variables and slots after `step` (worker 0 asks them).
    pub(crate) fn keep_servers(&self, step: u64, tensors: HashMap<String, Tensor>) {
        let mut kept = self.lock();
        kept.servers.insert(step, Arc::new(tensors));
        kept.prune_servers();
    }

    /// Worker `rank` is lost, and what it kept with it.
    pub(crate) fn lose(&self, rank: usize) {
        let mut kept = self.lock();
        kept.lost.insert(rank);
        if let Some(held) = kept.workers.get_mut(&rank) {
            held.latest = None;
            held.written = None;
        }
    }

    /// The newest state the survivors can put together, with the shards of the
    /// sharded states under `disk` (the run's `--checkpoint DIR --sharded`) for
    /// what only a lost worker held; `None` when no worker kept anything yet.
    pub fn restore(&self, disk: Option<&Path>) -> Result<Option<Restored>> {
        let kept = self.lock();
        let steps: BTreeSet<u64> = kept.steps().collect();
        let mut why = Vec::new();
        for &step in steps.iter().rev() {
            match kept.put_together(step, disk) {
                Ok(r) => return Ok(Some(r)),
                Err(e) => why.push(format!("step {step}: {e}")),
            }
        }
        if why.is_empty() {
            return Ok(None);
        }
        let lost: Vec<String> = kept.lost.iter().map(|r| format!("worker {r}")).collect();
        Err(RuntimeError::state(format!(
            "--elastic: no state to restart from: the memory of {} is lost, and what the \
             others kept does not make a whole state ({})",
            if lost.is_empty() {
                "no worker".to_string()
            } else {
                lost.join(", ")
            },
            why.join("; ")
        )))
    }
}

/// Worker `rank`'s rehearsed loss at `step` (`--fail-worker`), its run's first step
/// being `first`: what it kept in `slot` goes with it, as with a crashed process, once
/// the run's other workers (`0..workers`) kept the step before, so the rehearsal's
/// restart point is known. The error its thread ends with.
pub(crate) fn rehearsed_loss(
    slot: Option<&StateSlot>,
    (rank, workers): (usize, usize),
    (step, first): (usize, usize),
    timeout: Duration,
) -> RuntimeError {
    if let Some(slot) = slot {
        if step > first {
            slot.wait_kept(step as u64 - 1, workers, timeout);
        }
        slot.lose(rank);
    }
    RuntimeError::WorkerLost {
        step,
        cause: "an injected failure (--fail-worker)".into(),
    }
}

impl Held {
    /// Its copies: the last step's, the last written.
    fn copies(&self) -> impl Iterator<Item = &Copy> {
        [&self.latest, &self.written].into_iter().flatten()
    }
}

impl Kept {
    /// The steps of every copy the workers hold.
    fn steps(&self) -> impl Iterator<Item = u64> + '_ {
        self.workers
            .values()
            .flat_map(Held::copies)
            .map(|c| c.index.step)
    }

    /// Server states older than every worker's oldest copy are of no use.
    fn prune_servers(&mut self) {
        let oldest = self.steps().min();
        if let Some(oldest) = oldest {
            self.servers = self.servers.split_off(&oldest);
        }
    }

    /// The state of `step` from the copies of that step, then from the shards on
    /// disk of the workers whose copy is missing.
    fn put_together(
        &self,
        step: u64,
        disk: Option<&Path>,
    ) -> std::result::Result<Restored, String> {
        let mut ranks: Vec<(&usize, &Held)> = self.workers.iter().collect();
        ranks.sort_by_key(|(r, _)| **r);
        let copies: Vec<(usize, Coord, &Copy)> = ranks
            .iter()
            .filter_map(|(r, h)| {
                h.copies()
                    .find(|c| c.index.step == step)
                    .map(|c| (**r, h.place, c))
            })
            .collect();
        let servers = match self.servers.get(&step) {
            Some(s) => Some(s.clone()),
            None if self.servers.is_empty() => None,
            None => return Err("the servers' state of that step is not kept".into()),
        };
        let index = &copies.first().ok_or("no copy of that step")?.2.index;
        let data = ranks
            .iter()
            .map(|(_, h)| h.place.replica + 1)
            .max()
            .unwrap_or(1);
        let model = ranks
            .iter()
            .map(|(_, h)| h.place.model + 1)
            .max()
            .unwrap_or(1);
        let mesh = (ranks.len(), data, model);
        let mut cells: Cells<'_> = HashMap::new();
        let mut from_disk: Vec<((usize, usize), HashMap<String, Tensor>)> = Vec::new();
        let mut files_read = Vec::new();
        let whole = |cells: &Cells<'_>| {
            let mut keys: Vec<String> = cells.values().flat_map(|c| c.keys().cloned()).collect();
            keys.sort();
            keys.dedup();
            let manifest = Manifest::of(index, &self.layout, &keys, mesh);
            shards::assemble_state(&manifest, cells)
        };
        // Workers of one place hold the same values: any one's copy serves. A
        // pipeline's stages at one data and model rank hold disjoint variables: their
        // copies are merged into one cell.
        let mut by_cell: BTreeMap<(usize, usize), BTreeMap<usize, &Copy>> = BTreeMap::new();
        for (_, at, c) in &copies {
            by_cell
                .entry((at.replica, at.model))
                .or_default()
                .entry(at.stage)
                .or_insert(c);
        }
        let merged: HashMap<(usize, usize), HashMap<String, Tensor>> = by_cell
            .iter()
            .filter(|(_, stages)| stages.len() > 1)
            .map(|(cell, stages)| {
                let mut all = HashMap::new();
                for c in stages.values() {
                    for (k, t) in c.tensors.iter() {
                        all.entry(k.clone()).or_insert_with(|| t.clone());
                    }
                }
                (*cell, all)
            })
            .collect();
        for (cell, stages) in &by_cell {
            match (merged.get(cell), stages.values().next()) {
                (Some(all), _) => cells.insert(*cell, all),
                (None, Some(c)) => cells.insert(*cell, &*c.tensors),
                (None, None) => None,
            };
        }
        let state = match whole(&cells) {
            Ok(s) => s,
            Err(in_memory) => {
                let Some(dir) = disk else {
                    return Err(in_memory);
                };
                let folder = shards::step_dir(dir, step);
                for (&rank, held) in &ranks {
                    if copies.iter().any(|(r, _, _)| *r == rank) {
                        continue;
                    }
                    let shard = shards::read_shard(&folder, (step, None), rank, ranks.len())
                        .map_err(|e| format!("{in_memory}, and on disk: {e}"))?;
                    if shard.0 != (held.place.replica, held.place.model) {
                        return Err(format!(
                            "{}: worker {rank}'s shard is at {:?} on the mesh, the worker \
                             was at {:?}",
                            folder.display(),
                            shard.0,
                            held.place
                        ));
                    }
                    from_disk.push(shard);
                    files_read.push(folder.join(shards::shard_file(rank)));
                }
                for (place, tensors) in &from_disk {
                    cells.entry(*place).or_insert(tensors);
                }
                whole(&cells)?
            }
        };
        let TrainingState {
            index,
            mut params,
            mut optimizer,
        } = state;
        // The servers' variables replace the copies the workers pulled.
        for (k, t) in servers.iter().flat_map(|s| s.iter()) {
            if k.contains('/') {
                optimizer.insert(k.clone(), t.clone());
            } else {
                params.insert(k.clone(), t.clone());
            }
        }
        Ok(Restored {
            state: Arc::new(TrainingState::new(index, params, optimizer)),
            files_read,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(step: u64) -> StateIndex {
        StateIndex {
            format: String::new(),
            model: "m".into(),
            step,
            samples: step * 8,
            saved_by: "test".into(),
            optimizer: "sgd".into(),
            variables: Vec::new(),
            optimizer_state: Vec::new(),
        }
    }

    fn replica(r: usize) -> Coord {
        Coord {
            replica: r,
            stage: 0,
            model: 0,
        }
    }

    fn t(v: &[f32]) -> Tensor {
        Tensor::F32(ndarray::Array1::from(v.to_vec()).into_dyn())
    }

    fn copy(step: u64, tensors: &[(&str, &[f32])]) -> Copy {
        Copy {
            index: index(step),
            tensors: Arc::new(tensors.iter().map(|(k, v)| (k.to_string(), t(v))).collect()),
        }
    }

    /// ZeRO over two workers: `w` (4 elements) is two chunks of 2.
    fn zero_layout() -> Layout {
        let g = distc_ir::parse(
            "graph t.final {\n  %0 = param{name=\"w.zero\", init=zeros} : f32[2]\n  \
             %1 = all_gather_dense{workers=2, shape=[4]} %0 : f32[4]\n  \
             output{name=\"w\"} %1\n}\n",
        )
        .expect("final program");
        Layout::of(Some(&g)).expect("layout")
    }

    #[test]
    fn a_replicated_state_comes_back_from_the_survivors_memory_alone() {
        let slot = StateSlot::new("test".into());
        slot.begin(Layout::default());
        for (rank, step) in [(0, 2), (1, 3), (2, 3), (0, 3)] {
            let v = step as f32;
            slot.keep(
                rank,
                replica(rank),
                copy(step, &[("b", &[v, v]), ("b/m", &[v])]),
                false,
            );
        }
        slot.lose(1);
        let r = slot.restore(None).expect("restore").expect("a state");
        assert!(r.files_read.is_empty());
        assert_eq!(r.state.index.step, 3);
        assert_eq!(r.state.index.samples, 24);
        assert_eq!(r.state.params["b"], t(&[3.0, 3.0]));
        assert_eq!(r.state.optimizer["b/m"], t(&[3.0]));
        // Nothing kept: nothing to restart from, and no error.
        let empty = StateSlot::new("test".into());
        assert!(empty.restore(None).expect("restore").is_none());
    }

    #[test]
    fn a_lost_workers_chunks_come_from_the_last_sharded_state_on_disk() {
        let dir = tempfile::tempdir().expect("temp dir");
        let slot = StateSlot::new("test".into());
        slot.begin(zero_layout());
        // Step 2 written to disk, step 3 kept in memory only.
        for rank in 0..2 {
            let c = rank as f32 * 10.0;
            let two = copy(2, &[("w.zero", &[c, c + 1.0])]);
            shards::write_shard(dir.path(), (2, "run"), (rank, rank, 0), &two.tensors)
                .expect("shard");
            slot.keep(rank, replica(rank), two, true);
            slot.keep(
                rank,
                replica(rank),
                copy(3, &[("w.zero", &[c + 5.0, c + 6.0])]),
                false,
            );
        }
        slot.lose(1);
        // Memory alone does not hold worker 1's chunk of any step.
        let e = slot.restore(None).expect_err("no chunk").to_string();
        assert!(e.contains("worker 1") && e.contains("`w.zero`"), "{e}");
        let r = slot
            .restore(Some(dir.path()))
            .expect("restore")
            .expect("a state");
        assert_eq!(r.state.index.step, 2);
        assert_eq!(r.state.params["w"], t(&[0.0, 1.0, 10.0, 11.0]));
        assert_eq!(
            r.files_read,
            [shards::step_dir(dir.path(), 2).join(shards::shard_file(1))]
        );
        // A shard of another step in its place is refused, not loaded.
        let folder = shards::step_dir(dir.path(), 2);
        std::fs::remove_dir_all(&folder).expect("remove");
        shards::write_shard(dir.path(), (3, "run"), (1, 1, 0), &copy(3, &[]).tensors)
            .expect("shard");
        std::fs::create_dir_all(&folder).expect("folder");
        std::fs::rename(
            shards::step_dir(dir.path(), 3).join(shards::shard_file(1)),
            folder.join(shards::shard_file(1)),
        )
        .expect("move");
        let e = slot
            .restore(Some(dir.path()))
            .expect_err("wrong step")
            .to_string();
        assert!(e.contains("worker 1's shard of step 3"), "{e}");
    }

    #[test]
    fn servers_state_of_the_step_replaces_the_workers_pulled_copies() {
        let slot = StateSlot::new("test".into());
        slot.begin(Layout::default());
        slot.keep_servers(1, [("emb".to_string(), t(&[1.0]))].into());
        slot.keep_servers(
            2,
            [
                ("emb".to_string(), t(&[2.0])),
                ("emb/m".to_string(), t(&[7.0])),
            ]
            .into(),
        );
        for rank in 0..2 {
            slot.keep(
                rank,
                replica(rank),
                copy(2, &[("emb", &[0.0]), ("b", &[4.0])]),
                false,
            );
        }
        slot.lose(0);
        let r = slot.restore(None).expect("restore").expect("a state");
        assert_eq!(r.state.params["emb"], t(&[2.0]));
        assert_eq!(r.state.optimizer["emb/m"], t(&[7.0]));
        assert_eq!(r.state.params["b"], t(&[4.0]));
        // Step 1's servers' state went once every worker kept step 2.
        assert_eq!(slot.lock().servers.keys().copied().collect::<Vec<_>>(), [2]);
    }
}
