//! Where a run's variables and optimizer state start: the seed's initial values, a
//! resumed state's (checked against the model), or weights from a file (`--init`).
//! Every role starts here, so every layout starts from the same values.

use crate::core::backend::{backend_error, OptimizerState};
use crate::core::checkpoint::{TrainingState, STEP_KEY};
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::core::exec::Executor;
use crate::core::init::init_param;
use crate::core::schedule::Mode;
use crate::core::value::Tensor;
use crate::run::programs::{init_params, pulled_types, server_shards, trained_variables, Programs};
use distc_ir::{TensorType, ZERO_SHARD_SUFFIX};
use std::collections::HashMap;

/// What `--init` found, for people: the variables set from the file, and the names
/// on either side without a match.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct InitReport {
    /// Variables the file set.
    pub set: Vec<String>,
    /// Variables of the model the file lacks (they keep the model's initializer).
    pub missing: Vec<String>,
    /// Tensors of the file no variable of the model is named.
    pub unused: Vec<String>,
}

/// Every variable of a plan, whole, with its initial value from the seed: the worker
/// program's own (not a ZeRO chunk, nor a model-axis part whose whole value the init
/// program cuts), the init program's (the whole values it cuts into shards and
/// model-axis parts), and the servers' (whole types from the workers' pulls). Sorted
/// by name.
pub fn whole_variables(programs: &Programs<'_>, seed: u64) -> Result<Vec<(String, Tensor)>> {
    let mut out: HashMap<String, Tensor> = HashMap::new();
    for g in std::iter::once(programs.worker).chain(programs.init) {
        for (name, t) in init_params(g, seed) {
            if !name.ends_with(distc_ir::ZERO_SHARD_SUFFIX) {
                out.insert(name, t);
            }
        }
    }
    // Issue 67, item 2: a part `w.tp` is not a variable of the model; `w` is (`--init`
    // named the parts as missing from the file).
    let parts: Vec<String> = out
        .keys()
        .filter(|n| {
            n.strip_suffix(distc_ir::MODEL_SHARD_SUFFIX)
                .is_some_and(|w| out.contains_key(w))
        })
        .cloned()
        .collect();
    for part in parts {
        out.remove(&part);
    }
    for shards in server_shards(programs.servers, &pulled_types(programs.worker))? {
        for sp in shards {
            out.entry(sp.var.clone())
                .or_insert_with(|| init_param(&sp.var, &sp.full, &sp.init, seed));
        }
    }
    let mut v: Vec<(String, Tensor)> = out.into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(v)
}

/// The training state a run starts from when its initial weights come from a file
/// (`--init`): step 0, the data at its start, each variable of the plan (whole, as
/// [`whole_variables`] finds them) from `weights` by name and shape, fresh optimizer
/// state (zero slots, which is what every optimizer starts from). A variable the file
/// lacks is an error unless `partial`, when it keeps its initializer; a tensor of the
/// file that no variable is named is an error unless `partial`. Every layout starts
/// from such a state as it resumes one, so the same weights reach every worker,
/// stage, shard and server. `foreign` names the file's tensors of a dtype no variable
/// has ([`crate::core::checkpoint::load_weights`]): unused tensors like any other, and an
/// error where a variable is named by one.
pub fn state_from_weights(
    programs: &Programs<'_>,
    config: &RunConfig,
    (weights, foreign): (&HashMap<String, Tensor>, &[(String, String)]),
    partial: bool,
) -> Result<(TrainingState, InitReport)> {
    use crate::core::checkpoint::{StateIndex, STEP_KEY};
    let whole = whole_variables(programs, config.seed)?;
    let variables: Vec<(String, TensorType)> = whole
        .iter()
        .map(|(n, t)| (n.clone(), t.tensor_type()))
        .collect();
    let mut params: HashMap<String, Tensor> = whole.into_iter().collect();
    let mut report = InitReport::default();
    for (name, ty) in &variables {
        if let Some((_, dtype)) = foreign.iter().find(|(n, _)| n == name) {
            return Err(RuntimeError::state(format!(
                "`{name}` is {dtype} in the file; the model's `{name}` is {ty}"
            )));
        }
        match weights.get(name) {
            Some(t) if t.shape() == ty.dims() => {
                let t = t.cast(ty.dtype).ok_or_else(|| {
                    RuntimeError::state(format!(
                        "`{name}` is {:?} in the file; the model's `{name}` is {ty}",
                        t.dtype()
                    ))
                })?;
                let values = t.to_f64_vec();
                // A variance below 0 (batch norm's running one, as the DSL names it)
                // evaluates to NaN.
                if name.ends_with("_running_var") {
                    if let Some(v) = values.iter().find(|v| **v < 0.0) {
                        return Err(RuntimeError::state(format!(
                            "`{name}` holds {v}: a running variance is 0 or more"
                        )));
                    }
                }
                // The file's values were finite as stored; an f64 beyond f32's range
                // is not once converted.
                if values.iter().any(|x| !x.is_finite()) {
                    return Err(RuntimeError::state(format!(
                        "`{name}` holds values beyond the range of {} (the model's `{name}` \
                         is {ty}): they would train as infinities",
                        ty.dtype
                    )));
                }
                params.insert(name.clone(), t);
                report.set.push(name.clone());
            }
            Some(t) => {
                return Err(RuntimeError::state(format!(
                    "`{name}` has shape {:?} in the file; the model's `{name}` is {ty}",
                    t.shape()
                )))
            }
            None => report.missing.push(name.clone()),
        }
    }
    report.unused = weights
        .keys()
        .chain(foreign.iter().map(|(n, _)| n))
        .filter(|k| !variables.iter().any(|(n, _)| n == *k))
        .cloned()
        .collect();
    report.unused.sort();
    // Issue 67, item 2: a file of which --init-partial takes nothing trained from
    // scratch with exit 0.
    if report.set.is_empty() {
        return Err(RuntimeError::state(format!(
            "none of the file's {} tensor(s) is a variable of the model ({} of them: {}): \
             is it this model's weights?",
            report.unused.len(),
            variables.len(),
            variables
                .iter()
                .map(|(n, _)| n.as_str())
                .take(8)
                .collect::<Vec<_>>()
                .join(", ")
                + if variables.len() > 8 { ", ..." } else { "" }
        )));
    }
    let all_named = report.missing.is_empty() && report.unused.is_empty();
    if !partial && !all_named {
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".into()
            } else {
                v.join(", ")
            }
        };
        return Err(RuntimeError::state(format!(
            "the file and the model do not name the same variables: the model's {} \
             are not in the file, and the file's {} are not the model's (--init-partial \
             keeps the model's initializer for the first and ignores the second)",
            list(&report.missing),
            list(&report.unused)
        )));
    }
    let slots = crate::cpu::optim::Optimizer::new(&config.optimizer).slot_names();
    // What a run's optimizer would hold: the trained variables' slots.
    let trained = trained_variables(programs);
    let mut optimizer: HashMap<String, Tensor> = HashMap::new();
    for (name, ty) in variables.iter().filter(|(n, _)| trained.contains(n)) {
        for slot in slots {
            optimizer.insert(format!("{name}/{slot}"), Tensor::zeros(ty));
        }
    }
    optimizer.insert(
        STEP_KEY.to_string(),
        Tensor::F64(ndarray::arr0(0.0).into_dyn()),
    );
    let index = StateIndex {
        format: "distc-training-state".into(),
        model: programs.worker.name.clone(),
        step: 0,
        samples: 0,
        saved_by: "--init".into(),
        optimizer: format!("{:?}", config.optimizer),
        variables: variables.iter().map(|(n, _)| n.clone()).collect(),
        optimizer_state: {
            let mut k: Vec<String> = optimizer.keys().cloned().collect();
            k.sort();
            k
        },
    };
    Ok((
        TrainingState {
            index,
            params,
            optimizer,
        },
        report,
    ))
}

/// The first step a run of `steps` steps runs: the one after the resumed state's.
pub(crate) fn first_step(resume: Option<&TrainingState>, steps: usize) -> Result<usize> {
    let first = resume.map_or(1, |s| s.index.step as usize + 1);
    if first > steps {
        return Err(RuntimeError::Config(format!(
            "the training state is at step {}, and this run ends at step {steps}: give \
             --steps above {}",
            first - 1,
            first - 1
        )));
    }
    Ok(first)
}

/// The initial variables of `graph`: the resumed state's where it has them (checked
/// against the model's types), else the seeded initialisers'. A ZeRO chunk (`w.zero`)
/// is not in a state: the init program makes it from the whole `w`.
pub(crate) fn initial_values(
    graph: &distc_ir::Graph,
    seed: u64,
    resume: Option<&TrainingState>,
) -> Result<HashMap<String, Tensor>> {
    let mut params = init_params(graph, seed);
    let Some(state) = resume else {
        return Ok(params);
    };
    for (_, name, ty) in graph.params() {
        match state.params.get(name) {
            Some(t) if t.shape() == ty.dims() && t.dtype() == ty.dtype => {
                params.insert(name.to_string(), t.clone());
            }
            Some(t) => {
                return Err(RuntimeError::state(format!(
                    "the training state's `{name}` is {:?}{:?}; the model's is {ty}",
                    t.dtype(),
                    t.shape()
                )))
            }
            // Made by the init program from the whole variable.
            None if name.ends_with(ZERO_SHARD_SUFFIX)
                || name.ends_with(distc_ir::MODEL_SHARD_SUFFIX) => {}
            None => {
                return Err(RuntimeError::state(format!(
                    "the training state has no variable `{name}` (it holds {})",
                    state.index.variables.join(", ")
                )))
            }
        }
    }
    Ok(params)
}

/// The optimizer state this worker holds of a resumed state: the slots of its
/// variables, a ZeRO chunk's slots cut from the whole ones as `take_chunk` cuts.
pub(crate) fn resumed_slots(
    state: &TrainingState,
    params: &HashMap<String, Tensor>,
    workers: usize,
    rank: usize,
) -> HashMap<String, Tensor> {
    let mut out = HashMap::new();
    for (key, t) in &state.optimizer {
        let Some((var, slot)) = key.rsplit_once('/').filter(|_| key != STEP_KEY) else {
            out.insert(key.clone(), t.clone());
            continue;
        };
        if params.contains_key(var) {
            out.insert(key.clone(), t.clone());
        } else {
            let chunk = format!("{var}{ZERO_SHARD_SUFFIX}");
            if params.contains_key(&chunk) {
                out.insert(format!("{chunk}/{slot}"), t.chunk(workers, rank));
            }
        }
    }
    out
}

/// A resumed state's optimizer slots of the variables the init program cuts (into
/// model-axis parts, and ZeRO chunks of them), cut exactly as the variables are: the
/// program run once per slot by `cut`, on that slot's whole values in place of the
/// variables' (zeros where the state has none), each part's slot kept where the state
/// has its whole variable's. By the slot's key (`w1.tp/m`). Every rank of an axis runs
/// it in the same order: `cut`'s collectives (broadcasts) are collectives.
fn cut_slots(
    init: &distc_ir::Graph,
    state: &TrainingState,
    mut cut: impl FnMut(&HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>>,
) -> Result<HashMap<String, Tensor>> {
    let mut slots: Vec<&str> = state
        .optimizer
        .keys()
        .filter_map(|k| k.rsplit_once('/').map(|(_, slot)| slot))
        .collect();
    slots.sort_unstable();
    slots.dedup();
    let mut out = HashMap::new();
    for slot in slots {
        let whole: HashMap<String, Tensor> = init
            .params()
            .into_iter()
            .map(|(_, name, ty)| {
                let t = state.optimizer.get(&format!("{name}/{slot}")).cloned();
                (name.to_string(), t.unwrap_or_else(|| Tensor::zeros(ty)))
            })
            .collect();
        for (name, t) in cut(&whole)? {
            // A part, or a ZeRO chunk of a part.
            let part = name.strip_suffix(ZERO_SHARD_SUFFIX).unwrap_or(&name);
            let base = part.strip_suffix(distc_ir::MODEL_SHARD_SUFFIX);
            if base.is_some_and(|b| state.optimizer.contains_key(&format!("{b}/{slot}"))) {
                out.insert(format!("{name}/{slot}"), t);
            }
        }
    }
    Ok(out)
}

/// The optimizer state of the variables no stage reads: a resumed state's, or what a
/// fresh optimizer gives them (their step count left to the stages).
pub(crate) fn carried_slots(
    carried: &HashMap<String, Tensor>,
    config: &RunConfig,
    resume: Option<&TrainingState>,
) -> Result<HashMap<String, Tensor>> {
    if carried.is_empty() {
        return Ok(HashMap::new());
    }
    let slots: Vec<(String, Tensor)> = match resume {
        Some(state) => resumed_slots(state, carried, 1, 0).into_iter().collect(),
        None => {
            let mut cpu = crate::cpu::Cpu;
            let optimizer = cpu
                .optimizer(
                    &config.optimizer,
                    &config.no_decay,
                    config.lazy_updates,
                    carried,
                )
                .map_err(|e| backend_error("cpu", "creating the optimizer", e))?;
            cpu.optimizer_state(&optimizer)
                .map_err(|e| backend_error("cpu", "reading the optimizer state", e))?
        }
    };
    Ok(slots
        .into_iter()
        .filter(|(key, _)| {
            key.rsplit_once('/')
                .is_some_and(|(var, _)| carried.contains_key(var))
        })
        .collect())
}

/// What a role starts from: its variables, and on a resumed run its optimizer state.
#[derive(Default)]
pub(crate) struct RoleState {
    pub(crate) params: HashMap<String, Tensor>,
    pub(crate) slots: Option<HashMap<String, Tensor>>,
}

/// The one way a role (a worker, or a pipeline's stage) gets its variables and resumed
/// optimizer state. `params` are its uncut initial values ([`initial_values`]); where
/// the plan has an init program, `cut` runs it on `whole` (its whole inputs, the seed's
/// or a resumed state's) and its outputs (model-axis parts, ZeRO chunks) replace them.
/// The role keeps the variables `holds` names. A resumed state's slots are cut as the
/// variables are: ZeRO chunks by `zero` (workers, rank), model-axis parts by `cut`, run
/// once per slot (so every rank of an axis runs `cut` equally often, in one order: its
/// collectives stay collectives).
pub(crate) fn role_state(
    mut params: HashMap<String, Tensor>,
    init: Option<(&distc_ir::Graph, &HashMap<String, Tensor>)>,
    resume: Option<&TrainingState>,
    zero: (usize, usize),
    holds: impl Fn(&str) -> bool,
    mut cut: impl FnMut(&distc_ir::Graph, &HashMap<String, Tensor>) -> Result<Vec<(String, Tensor)>>,
) -> Result<RoleState> {
    if let Some((init, whole)) = init {
        params.extend(cut(init, whole)?);
    }
    params.retain(|name, _| holds(name));
    let Some(state) = resume else {
        return Ok(RoleState {
            params,
            slots: None,
        });
    };
    let mut slots = resumed_slots(state, &params, zero.0, zero.1);
    if let Some((init, _)) = init.filter(|(init, _)| cuts_model_parts(init)) {
        slots.extend(
            cut_slots(init, state, |whole| cut(init, whole))?
                .into_iter()
                .filter(|(key, _)| {
                    key.rsplit_once('/')
                        .is_some_and(|(var, _)| params.contains_key(var))
                }),
        );
    }
    Ok(RoleState {
        params,
        slots: Some(slots),
    })
}

/// Whether `init` makes model-axis parts (`w.tp`, or a ZeRO chunk of one).
fn cuts_model_parts(init: &distc_ir::Graph) -> bool {
    init.outputs().iter().any(|(name, _)| {
        name.strip_suffix(ZERO_SHARD_SUFFIX)
            .unwrap_or(name)
            .ends_with(distc_ir::MODEL_SHARD_SUFFIX)
    })
}

/// Model rank `m`'s part of the split variables: the init program's outputs, run on the
/// whole variables (its cuts are local: no collective).
pub(crate) fn model_part(
    init: &distc_ir::Graph,
    m: usize,
    whole: &HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let mut exec = Executor::new(init)?;
    exec.set_model_rank(m);
    let out = exec.run_with(&HashMap::new(), whole, Mode::Train, 0, None)?;
    Ok(out.outputs.into_iter().collect())
}
