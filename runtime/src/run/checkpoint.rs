//! How a role's training state is written: by a worker, whole (gathered through the
//! final program, worker 0 writing) or as its own shard. Every role's shard is started
//! on its writer thread alike ([`start_shard`]), and worker 0 commits a sharded state
//! by one rule ([`commit_state`]), a pipeline's as the workers'.

use crate::core::backend::{backend_error, Backend};
use crate::core::checkpoint::{StateIndex, TrainingState, LOSS_SCALE_KEY};
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::Executor;
use crate::core::schedule::Mode;
use crate::core::shards::{Layout, Manifest};
use crate::core::value::Tensor;
use crate::run::hook::HostHook;
use crate::run::mesh::Mesh;
use crate::run::options::{CheckpointEvery, TrainOptions};
use crate::run::programs::Programs;
use crate::run::steps::Due;
use crate::run::trainer::{host_params, set_ranks, LossScaler};
use std::collections::HashMap;
use std::sync::Arc;

/// Starts writing the shard of worker `w` (at `(data, model)` on its mesh) of the
/// state of `step` on the worker's writer thread, once its previous shard is written
/// (with `last`, before it returns): of `tensors`, those the layout has that worker
/// write and `keep` keeps. Returns the names the shard holds, sorted.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_shard(
    c: &CheckpointEvery,
    layout: &Layout,
    (w, data, model): (usize, usize, usize),
    step: u64,
    mut tensors: HashMap<String, Tensor>,
    keep: impl Fn(&str) -> bool,
    last: bool,
) -> Result<Vec<String>> {
    tensors.retain(|k, _| layout.writes(k, (data, model)) && keep(k));
    let mut keys: Vec<String> = tensors.keys().cloned().collect();
    keys.sort();
    let (dir, run) = (c.path.clone(), c.run_id());
    c.shard_writer(w).start(
        move || crate::core::shards::write_shard(&dir, (step, &run), (w, data, model), &tensors),
        last,
    )?;
    Ok(keys)
}

/// Worker 0's part of a sharded state's step, once every worker has started writing
/// its shard of it: so each has written its shard of the state before (a writer
/// starts a write only once its last is done) and, after the run's last step
/// (`last`), of this one (written before the worker went on). The state before is
/// committed, this one's manifest written, and after the last step this one committed.
pub(crate) fn commit_state(c: &CheckpointEvery, manifest: Manifest, last: bool) -> Result<()> {
    c.commit_pending(Some(manifest.index.step))?;
    manifest.write(&c.path)?;
    if last {
        c.commit_pending(None)?;
    }
    Ok(())
}

/// Before any role of a sharded run starts: the folders of the states this run will
/// write that an earlier run left are removed, so a step's folder never mixes two
/// runs' shards; the states of other steps stay. The process of worker 0 calls it,
/// before the others start (under MPI, before the start-up barrier).
pub(crate) fn clear_steps_to_write(config: &RunConfig, opts: &TrainOptions) -> Result<()> {
    let Some(c) = opts.checkpoint.as_ref().filter(|c| c.sharded) else {
        return Ok(());
    };
    let cadence = crate::run::steps::Cadence::of(config, opts);
    let first = crate::run::state::first_step(opts.resume.as_deref(), cadence.last)? as u64;
    let writes = |k: u64| k >= first && k as usize <= cadence.last && cadence.at(k as usize).shard;
    crate::core::shards::clear_steps(&c.path, writes)
}

/// Whether `g` reads variable `name`.
fn reads_param(g: &distc_ir::Graph, name: &str) -> bool {
    g.params().iter().any(|(_, n, _)| *n == name)
}

/// Writes the training state after `step`, as `due` says (to the file, sharded or
/// whole; the run's last step). Whole: worker 0 writes its replicated
/// variables and slots, the servers' rows and slots, and the ZeRO chunks and
/// model-axis parts, which every worker gathers with it through the final program (a
/// collective, so every worker calls this at the same steps). Sharded: every worker
/// writes what it holds, and nothing is gathered. Elastic: every worker keeps a copy
/// of what it holds in memory (`opts.snapshot`), and nothing is gathered either.
#[allow(clippy::too_many_arguments)]
pub(crate) fn save_training_state<B: Backend>(
    opts: &TrainOptions,
    due: Due,
    (exec, optimizer, params): (&mut Executor<B>, &B::Optimizer, &HashMap<String, B::Tensor>),
    programs: &Programs<'_>,
    config: &RunConfig,
    (rank, ranks, step): (usize, (usize, usize), usize),
    mesh: &Mesh,
    scaler: Option<&LossScaler>,
    hook: &mut HostHook,
) -> Result<()> {
    let device = exec.backend().name();
    let mut slots: HashMap<String, Tensor> = exec
        .backend()
        .optimizer_state(optimizer)
        .map_err(|e| backend_error(&device, "writing the training state", e))?
        .into_iter()
        .collect();
    let mut host = host_params(exec.backend(), params)?;
    // What no worker holds, which worker 0 asks for: the servers' variables and
    // slots, whole.
    let mut servers: HashMap<String, Tensor> = HashMap::new();
    if rank == 0 {
        if let Some(ps) = hook.ps.as_mut() {
            let parts = ps.snapshot(step as u64)?;
            servers =
                crate::ps::assemble(parts, &crate::run::programs::pulled_types(programs.worker))?;
        }
    }
    let scale = scaler.map(|s| (LOSS_SCALE_KEY.to_string(), s.to_tensor()));
    let k = crate::run::programs::micro_batches(programs.worker);
    let saved_by = opts.saved_by();
    // The data is split over the replicas: a model axis's workers read one batch.
    let samples = (step * config.batch * mesh.data * k) as u64;
    let described = format!("{:?}", config.optimizer);
    let index = StateIndex::at(
        &programs.worker.name,
        step as u64,
        samples,
        saved_by,
        described,
    );
    let sharded = opts.checkpoint.as_ref().filter(|_| due.shard);
    let whole = due.writes_whole();
    if sharded.is_some() || opts.snapshot.is_some() {
        // What this worker holds: moved where nothing needs it after.
        let mut mine: HashMap<String, Tensor> = if whole {
            host.iter()
                .chain(&slots)
                .map(|(k, t)| (k.clone(), t.clone()))
                .collect()
        } else {
            std::mem::take(&mut host)
                .into_iter()
                .chain(std::mem::take(&mut slots))
                .collect()
        };
        if let Some(slot) = &opts.snapshot {
            if rank == 0 && hook.ps.is_some() {
                let kept = if sharded.is_some() || whole {
                    servers.clone()
                } else {
                    std::mem::take(&mut servers)
                };
                slot.keep_servers(step as u64, kept);
            }
            let mut copy = if sharded.is_some() {
                mine.clone()
            } else {
                std::mem::take(&mut mine)
            };
            // Each worker's own scaler: it moves with every worker's steps alike.
            copy.extend(scale.clone());
            let copy = crate::run::snapshot::Copy {
                index: index.clone(),
                tensors: Arc::new(copy),
            };
            let place = crate::run::mesh::Coord {
                replica: ranks.0,
                stage: 0,
                model: ranks.1,
            };
            slot.keep(rank, place, copy, sharded.is_some());
        }
        if let Some(c) = sharded {
            // A server's variable replaces the copy the worker pulled.
            mine.extend(std::mem::take(&mut servers));
            if rank == 0 {
                mine.extend(scale.clone());
            }
            write_shard(
                c,
                programs,
                mesh,
                &index,
                mine,
                (rank, ranks),
                due.last,
                hook,
            )?;
        }
    }
    if !whole {
        return Ok(());
    }
    let mut params: HashMap<String, Tensor> = HashMap::new();
    if let Some(fin) = programs.finalize {
        let mut exec = Executor::new(fin)?;
        set_ranks(&mut exec, ranks, None);
        let out = exec.run_with(
            &HashMap::new(),
            &host,
            Mode::Train,
            step as u64,
            Some(&mut *hook),
        )?;
        params.extend(out.outputs);
        // The slots of the chunks, gathered by the same program, one slot at a time.
        for slot in B::optimizer_slots(optimizer) {
            let chunks: HashMap<String, Tensor> = fin
                .params()
                .into_iter()
                .map(|(_, name, ty)| {
                    let key = format!("{name}/{slot}");
                    let t = slots.remove(&key).unwrap_or_else(|| Tensor::zeros(ty));
                    (name.to_string(), t)
                })
                .collect();
            let out = exec.run_with(
                &HashMap::new(),
                &chunks,
                Mode::Train,
                step as u64,
                Some(&mut *hook),
            )?;
            for (var, t) in out.outputs {
                slots.insert(format!("{var}/{slot}"), t);
            }
        }
    }
    if rank != 0 {
        return Ok(());
    }
    // The final program's outputs stand for the chunks and parts it read.
    params.extend(
        host.into_iter()
            .filter(|(k, _)| programs.finalize.is_none_or(|f| !reads_param(f, k))),
    );
    for (k, t) in servers.into_iter().chain(scale) {
        if k.contains('/') {
            slots.insert(k, t);
        } else {
            params.insert(k, t);
        }
    }
    let state = Arc::new(TrainingState::new(index, params, slots));
    if let Some(c) = &opts.checkpoint {
        c.write(state, due.last)?;
    }
    Ok(())
}

/// Writes this worker's shard of the state `index` (of `tensors`, what it holds,
/// worker 0's with what no worker holds): the shard while training goes on, worker
/// 0's manifest beside it. A state is committed once every worker has written its
/// shard: the one before is committed here, after every worker's writer finished it;
/// the last one (`last`) before this returns.
#[allow(clippy::too_many_arguments)]
fn write_shard(
    c: &crate::run::options::CheckpointEvery,
    programs: &Programs<'_>,
    mesh: &Mesh,
    index: &StateIndex,
    tensors: HashMap<String, Tensor>,
    (rank, (data, model)): (usize, (usize, usize)),
    last: bool,
    hook: &mut HostHook,
) -> Result<()> {
    let layout = Layout::of(programs.finalize).map_err(RuntimeError::Plan)?;
    // Worker 0 holds every name the state has; the others hold parts of the same.
    let mut keys: Vec<String> = tensors.keys().cloned().collect();
    keys.sort();
    let step = index.step;
    start_shard(
        c,
        &layout,
        (rank, data, model),
        step,
        tensors,
        |_| true,
        last,
    )?;
    hook.barrier_all(step)?;
    if rank == 0 {
        let workers = (programs.workers, mesh.data, mesh.model);
        let manifest = Manifest::of(index, &layout, &keys, workers).of_run(&c.run_id());
        commit_state(c, manifest, last)?;
    }
    Ok(())
}
