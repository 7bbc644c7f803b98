//! The compile driver. From DSL source to compiled programs: lower, then the
//! strategy's passes over the program set, with every program's IR written after each
//! step when asked (`--dump-ir`), `--stop-after` and `--disable-pass`. From compiled
//! programs to a plan ([`Plan::new`]), and from a plan back to its programs compiled
//! for other workers ([`retarget`]: `distc simulate`, `run --elastic`).

use crate::dsl::{compile_source, DslError};
use crate::plan::{PassSummary, Plan, PLAN_FORMAT, PLAN_VERSION};
use distc_ir::Graph;
use distc_ir::{Op, TensorType};
use distc_passes::placement::{DistPlan, Link, Strategy, StrategyConfig};
use distc_passes::{
    known_pass_names, passes_for, run_pipeline, PassCx, PassRecord, PipelineError, ProgramRole,
    ProgramSet, Verify,
};
use distc_runtime::run::data::{data_dir, DataSource};
use distc_runtime::RunConfig;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// How to compile.
#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// Write the IR after each pass into this directory, numbered in pipeline order:
    /// the worker program as `NN-pass.ir`, and each other program that exists then
    /// beside it (`NN-pass.server0.ir`, `NN-pass.init.ir`, `NN-pass.final.ir`).
    pub dump_ir: Option<PathBuf>,
    /// Stop after this pass (`lower` stops before any pass).
    pub stop_after: Option<String>,
    /// Passes to skip.
    pub disabled: Vec<String>,
    /// Overrides the train block's per-worker batch.
    pub batch: Option<usize>,
    /// The strategy and its flags.
    pub strategy: StrategyConfig,
    /// Data directory for the sparsity measurement (else `DISTC_DATA`).
    pub data_dir: Option<PathBuf>,
    /// When the passes' output is verified: after each (a user's compile), or once at
    /// the end (a search's candidates; a failure is then compiled again to name its
    /// pass).
    pub verify: Verify,
    /// Compile a float64 copy of the model (`--dtype f64`): every f32 input, variable
    /// and constant promoted to f64 right after lowering, the data sources' f32 values
    /// widened as they are read. What `verify` measures the f32 rounding floor against.
    pub promote_f64: bool,
    /// The train block's settings overridden from the command line (`--set
    /// KEY=VALUE`, in order; see [`crate::dsl::overrides`]).
    pub overrides: Vec<String>,
}

/// A compiled model.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The programs: the worker program, and the server, init and final programs the
    /// distributed passes made.
    pub programs: ProgramSet,
    /// The run configuration from the train block.
    pub config: RunConfig,
    /// What each pass did.
    pub records: Vec<PassRecord>,
    /// Node count right after lowering.
    pub lowered_nodes: usize,
    /// The distribution decision (strategies other than `single`).
    pub dist: Option<DistPlan>,
    /// What the sparsity measurement did, for the user.
    pub measurement: Option<String>,
    /// Where the model breaks what data parallelism assumes (a sum over the batch, a
    /// batch statistic), for `distc verify` to name.
    pub assumptions: Vec<String>,
    /// Why the plan cannot be trained, when a flag cut the pipeline short (a plan
    /// without gradients or without its communication is for reading, not running).
    pub not_runnable: Option<String>,
    /// The stages the model's `pipeline_stage` markers give its variables, when it has
    /// markers and is pipelined (`--pipeline`); one device ignores the markers.
    pub stage_marks: Option<std::collections::BTreeMap<String, usize>>,
    /// The variables split over the model axis as the model's `shard` marks and
    /// `--shard` say (none: the Megatron rule chose).
    pub shards: std::collections::BTreeMap<String, usize>,
    /// The model's forward and backward FLOPs per sample: the cost model's count of the
    /// one-device graph right after autodiff over its batch (none when autodiff did not
    /// run).
    pub flops_per_sample: Option<f64>,
    /// The tokens a sample predicts, for a model with a per-position loss (a language
    /// model's window).
    pub tokens_per_sample: Option<usize>,
    /// The `--set` overrides the train block was compiled with.
    pub overrides: Vec<String>,
}

/// The passes a plan needs to be trained: without them it has no gradients, or its
/// workers do not communicate, or its pipeline stages have no programs.
const REQUIRED_PASSES: [&str; 5] = [
    "autodiff",
    "sparsity_analysis",
    "place",
    "distribute",
    "pipeline_split",
];

/// Why the options make a plan that cannot be trained, if they do.
fn not_runnable(opts: &CompileOptions) -> Option<String> {
    let passes: Vec<String> = passes_for(&opts.strategy)
        .iter()
        .map(|p| p.name())
        .collect();
    if let Some(stop) = &opts.stop_after {
        if passes.last() != Some(stop) {
            return Some(format!(
                "it was compiled with --stop-after {stop}, so the passes after it did not run"
            ));
        }
    }
    opts.disabled
        .iter()
        .find(|d| REQUIRED_PASSES.contains(&d.as_str()) && passes.contains(d))
        .map(|d| format!("it was compiled with --disable-pass {d}, a pass training needs"))
}

impl Compiled {
    /// Its programs, borrowed for a run with `workers` workers.
    pub fn programs(&self, workers: usize) -> distc_runtime::run::train::Programs<'_> {
        program_view(&self.programs, workers)
    }
}

/// The runtime's view of a plan's programs, for a run with `workers` workers.
pub fn program_view(p: &ProgramSet, workers: usize) -> distc_runtime::run::train::Programs<'_> {
    distc_runtime::run::train::Programs {
        worker: &p.worker,
        init: p.init.as_ref(),
        servers: &p.servers,
        finalize: p.finalize.as_ref(),
        workers,
        pipeline: p.pipeline.as_ref(),
    }
}

/// Why compilation failed.
#[derive(Debug, Error)]
pub enum CompileError {
    /// The source file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The DSL is wrong.
    #[error("{0}")]
    Dsl(Box<DslError>),
    /// A pass failed; with `--dump-ir`, the last good IR of every program was written
    /// to `last_good` (the worker program first).
    #[error("{error}\n{}", last_good_note(.last_good))]
    Pipeline {
        /// The failure.
        error: PipelineError,
        /// Where the last good IR was written, one file per program.
        last_good: Vec<PathBuf>,
    },
    /// The train block's settings cannot work with the model as compiled.
    #[error("{0}")]
    Settings(String),
    /// A flag names a pass that does not exist.
    #[error("unknown pass `{name}`; the passes are: {}", .known.join(", "))]
    UnknownPass {
        /// The name given.
        name: String,
        /// The valid names.
        known: Vec<String>,
    },
    /// Writing a dump failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

fn last_good_note(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "give --dump-ir DIR to keep the IR before that pass".into();
    }
    let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    format!("the IR before that pass is in {}", names.join(", "))
}

/// Writes every program of `p` into `dir` as `{stem}.ir`, `{stem}.server0.ir`,
/// `{stem}.init.ir`, `{stem}.final.ir`: the files `--dump-ir` and a failing pass write.
fn write_programs(dir: &Path, stem: &str, p: &ProgramSet) -> Result<Vec<PathBuf>, CompileError> {
    p.iter()
        .map(|(role, g)| {
            let path = dir.join(format!("{stem}{}.ir", role.file_suffix()));
            let text = match role {
                ProgramRole::Worker => distc_ir::print::print_with_notes(g, &p.worker_notes),
                _ => distc_ir::print(g),
            };
            write(&path, &text)?;
            Ok(path)
        })
        .collect()
}

fn write(path: &Path, text: &str) -> Result<(), CompileError> {
    std::fs::write(path, text).map_err(|source| CompileError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Refuses train-block settings that would fail only at the end of a training run,
/// so `compile` and `train` fail before step 1 instead. (`verify` trains without
/// evaluating, so it does not ask.)
pub fn check_settings(config: &RunConfig) -> Result<(), CompileError> {
    config.check().map_err(CompileError::Settings)?;
    config.check_evaluation().map_err(CompileError::Settings)
}

/// Compiles DSL `src` (read from `file_name`).
pub fn compile(
    file_name: &str,
    src: &str,
    opts: &CompileOptions,
) -> Result<Compiled, CompileError> {
    let known = known_pass_names();
    for name in opts.stop_after.iter().chain(&opts.disabled) {
        if !known.contains(name) {
            return Err(CompileError::UnknownPass {
                name: name.clone(),
                known,
            });
        }
    }
    opts.strategy.check().map_err(CompileError::Settings)?;
    let overridden;
    let src = if opts.overrides.is_empty() {
        src
    } else {
        overridden =
            crate::dsl::overrides::apply(src, &opts.overrides).map_err(CompileError::Settings)?;
        overridden.as_str()
    };
    let program =
        compile_source(file_name, src, opts.batch).map_err(|e| CompileError::Dsl(Box::new(e)))?;
    let assumptions = program.assumptions;
    let mut program_graph = program.graph;
    if opts.promote_f64 {
        use distc_passes::Pass;
        distc_passes::precision::PromoteF64
            .run(&mut program_graph, &mut PassCx::default())
            .map_err(|e| CompileError::Settings(format!("--dtype f64: {e}")))?;
    }
    let stage_marks = program.stage_marks.filter(|_| opts.strategy.pipeline > 1);
    // The model's `shard(DIM)` marks, with `--shard` taking precedence; one device
    // ignores them.
    let mut shards = if opts.strategy.model > 1 {
        program.shards
    } else {
        Default::default()
    };
    shards.extend(opts.strategy.shard.clone());
    check_batch_statistics(&opts.strategy, &program_graph)?;
    check_server_count(&opts.strategy, &program_graph)?;
    let mut programs = ProgramSet::new(program_graph);
    let mut config = program.config;
    // The data loader must produce the batch the graph was bound to.
    config.batch = program.batch_symbol_value;
    // The linear scaling rule, now that a step's global batch is known.
    if let Some(s) = &mut config.lr_scaling {
        s.global_batch = config.batch * opts.strategy.batches_per_step();
        config.optimizer = config.optimizer.with_lr(s.base_lr * s.factor());
    }
    // What `run` would refuse, refused now: the settings' ranges, and the model's
    // inputs and the ids it indexes with against the data source.
    config.check().map_err(CompileError::Settings)?;
    distc_runtime::run::data::check_model(
        &programs.worker,
        &config.data,
        config.batch,
        &config.data.id_bounds(),
    )
    .map_err(|e| CompileError::Settings(e.to_string()))?;
    let lowered_nodes = programs.worker.node_count();
    if let Some(dir) = &opts.dump_ir {
        std::fs::create_dir_all(dir).map_err(|source| CompileError::Write {
            path: dir.clone(),
            source,
        })?;
        write_programs(dir, "00-lower", &programs)?;
    }
    if opts.stop_after.as_deref() == Some("lower") {
        return Ok(Compiled {
            programs,
            config: config.clone(),
            records: vec![],
            lowered_nodes,
            dist: None,
            measurement: None,
            assumptions,
            not_runnable: not_runnable(opts),
            stage_marks,
            shards,
            flops_per_sample: None,
            tokens_per_sample: None,
            overrides: opts.overrides.clone(),
        });
    }
    let passes = passes_for(&opts.strategy);
    let (measured_ids, measurement) = if opts.strategy.strategy == Strategy::Single {
        (HashMap::new(), None)
    } else {
        let (m, note) = measure_ids(&programs.worker, &config, opts.data_dir.as_deref());
        (m, Some(note))
    };
    let mut cx = PassCx {
        disabled: opts.disabled.clone(),
        strategy: StrategyConfig {
            stage_marks: stage_marks.clone(),
            shard: shards.clone(),
            ..opts.strategy.clone()
        },
        measured_ids,
        verify: opts.verify,
        ..Default::default()
    };
    let mut index = 0;
    let mut dump_err = None;
    let mut flops_per_sample = None;
    let mut tokens_per_sample = None;
    let result = run_pipeline(
        &mut programs,
        &passes,
        &mut cx,
        opts.stop_after.as_deref(),
        |name, p| {
            index += 1;
            if name == "autodiff" {
                flops_per_sample =
                    Some(distc_passes::cost::graph_flops(&p.worker) / config.batch.max(1) as f64);
                tokens_per_sample = distc_passes::cost::tokens_per_sample(&p.worker, config.batch);
            }
            if let Some(dir) = &opts.dump_ir {
                if let Err(e) = write_programs(dir, &format!("{index:02}-{name}"), p) {
                    dump_err.get_or_insert(e);
                }
            }
        },
    );
    if let Some(e) = dump_err {
        return Err(e);
    }
    match result {
        Ok(records) => {
            if not_runnable(opts).is_none() {
                // The plan's loader checks the same: a compile never writes a plan
                // `run` would refuse. (A plan cut short, or with a pass training
                // needs disabled, is for reading, and refused by `run` as such.)
                programs
                    .check_consistency(&opts.strategy, cx.dist.as_ref())
                    .map_err(|e| CompileError::Settings(format!("internal error: {e}")))?;
                check_layer_wise(&config, &opts.strategy, &programs)?;
                check_clip_norm(&config, &programs)?;
            }
            if let (Some(dir), None) = (&opts.dump_ir, &opts.stop_after) {
                write(&dir.join(CUDA_DUMP), &cuda_source(&programs.worker))?;
            }
            Ok(Compiled {
                programs,
                config: config.clone(),
                records,
                lowered_nodes,
                dist: cx.dist,
                measurement,
                assumptions,
                not_runnable: not_runnable(opts),
                stage_marks,
                // As the tensor_parallel pass chose them (the Megatron rule's, unless
                // the model or --shard named them).
                shards: cx.strategy.shard.clone(),
                flops_per_sample,
                tokens_per_sample,
                overrides: opts.overrides.clone(),
            })
        }
        // A program that did not verify at the end (or a failure whose last good IR
        // is asked for), pinned on its pass as a user's compile reports it. A pass's
        // own refusal already names it.
        Err(e)
            if opts.verify == Verify::AtEnd
                && (!e.programs.is_empty() || opts.dump_ir.is_some()) =>
        {
            compile(
                file_name,
                src,
                &CompileOptions {
                    verify: Verify::EveryPass,
                    ..opts.clone()
                },
            )
        }
        Err(error) => {
            // Written only where the user asked for IR: nothing appears unasked.
            let last_good = match &opts.dump_ir {
                Some(dir) => {
                    write_programs(dir, &format!("before-{}", error.pass), &error.last_good)?
                }
                None => Vec::new(),
            };
            Err(CompileError::Pipeline { error, last_good })
        }
    }
}

/// The file `--dump-ir` writes the final worker program's generated CUDA into.
pub const CUDA_DUMP: &str = "plan.cu";

/// The CUDA C the GPU backend generates for `worker`, or, where it cannot, a comment
/// saying why (a dump is for reading: the reason is what the reader needs).
fn cuda_source(worker: &Graph) -> String {
    match distc_runtime::cuda::codegen::generate(worker) {
        Ok(plan) => plan.source,
        Err(e) => format!("// no CUDA plan for this program: {e}\n"),
    }
}

/// Compiles the DSL file at `path`.
pub fn compile_file(path: &Path, opts: &CompileOptions) -> Result<Compiled, CompileError> {
    let src = distc_runtime::core::output::read_regular_text(
        path,
        distc_runtime::core::output::TEXT_INPUT_LIMIT,
    )
    .map_err(|source| CompileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    compile(&path.display().to_string(), &src, opts)
}

// The plan format names no compiler module; making a plan of a compile is the driver's.
impl Plan {
    /// A plan for a compiled model.
    pub fn new(c: &Compiled, source: &str, settings: &StrategyConfig) -> Plan {
        let passes = c
            .records
            .iter()
            .map(|r| PassSummary {
                name: r.name.clone(),
                stats: r.stats.to_string(),
                nodes: r.nodes,
            })
            .collect();
        let mut p = Plan {
            format: PLAN_FORMAT.into(),
            version: PLAN_VERSION,
            model: c.programs.worker.name.clone(),
            source: source.into(),
            strategy: settings.strategy,
            config: c.config.clone(),
            passes,
            settings: StrategyConfig {
                stage_marks: c.stage_marks.clone(),
                shard: c.shards.clone(),
                ..settings.clone()
            },
            dist: c.dist.clone(),
            graph: distc_ir::print(&c.programs.worker),
            init: c.programs.init.as_ref().map(distc_ir::print),
            servers: c.programs.servers.iter().map(distc_ir::print).collect(),
            not_runnable: c.not_runnable.clone(),
            flops_per_sample: c.flops_per_sample,
            tokens_per_sample: c.tokens_per_sample,
            overrides: c.overrides.clone(),
            finalize: c.programs.finalize.as_ref().map(distc_ir::print),
            stages: c
                .programs
                .pipeline
                .iter()
                .flat_map(|p| &p.stages)
                .map(|s| (distc_ir::print(&s.forward), distc_ir::print(&s.backward)))
                .collect(),
            search: None,
            hash: String::new(),
        };
        p.seal();
        p
    }
}

/// What [`retarget`] compiles a plan for beyond the plan: the machine `distc simulate`
/// is asked about, or the workers an elastic run has left.
#[derive(Clone, Debug)]
pub struct Target {
    /// Workers (data-parallel) to simulate; none: the plan's.
    pub workers: Option<usize>,
    /// Workers per node; none: the plan's.
    pub ranks_per_node: Option<usize>,
    /// Parameter servers; none: the plan's.
    pub servers: Option<usize>,
    /// Link between nodes; none: the plan's (`--bandwidth`, `--latency`).
    pub inter: Option<Link>,
    /// Link within a node; none: the plan's.
    pub intra: Option<Link>,
    /// Data directory for the profiling run and the sparsity measurement.
    pub data_dir: Option<PathBuf>,
}

/// The plan's programs as they would be compiled for `target`: the plan's own when
/// nothing changes, else its model compiled again from `plan.source` with the plan's
/// settings but the target's workers, nodes and links (the hierarchy pass then decides
/// flat or hierarchical per bucket for those). The model must still compile to the
/// plan at the plan's own settings, or the simulation would be of another model.
pub fn retarget(plan: &Plan, target: &Target) -> Result<(Compiled, StrategyConfig), String> {
    let s = &plan.settings;
    let mut settings = s.clone();
    if let Some(n) = target.workers {
        settings.workers = n;
    }
    if let Some(l) = target.ranks_per_node {
        settings.ranks_per_node = l;
    }
    if let Some(n) = target.servers {
        // Issue 60, item 9: an all-reduce plan simulated with servers priced none.
        if n > 0 && matches!(s.strategy, Strategy::Single | Strategy::Allreduce) {
            return Err(format!(
                "--servers {n}: the plan is `{}`, whose workers hold every variable and use \
                 no parameter server; compile it with --strategy ps or hybrid to simulate \
                 servers",
                s.strategy.name()
            ));
        }
        settings.servers = n;
    }
    if let Some(l) = target.inter {
        settings.bandwidth = l.bandwidth;
        settings.latency = l.latency;
    }
    if let Some(l) = target.intra {
        settings.intra_link = l;
    }
    if settings.strategy == Strategy::Single && settings.data_workers() > 1 {
        return Err(format!(
            "the plan is `single`, one device: compile it with a distributed strategy to \
             simulate {} workers",
            settings.workers
        ));
    }
    let compiled_with = compiled_settings(&settings);
    compiled_with
        .check()
        .map_err(|e| format!("the simulated settings: {e}"))?;
    let compile = |strategy: &StrategyConfig| {
        let opts = CompileOptions {
            batch: Some(plan.config.batch),
            strategy: strategy.clone(),
            data_dir: target.data_dir.clone(),
            overrides: plan.overrides.clone(),
            ..Default::default()
        };
        compile_file(Path::new(&plan.source), &opts)
            .map_err(|e| format!("compiling {} again: {e}", plan.source))
    };
    let own = compile(s)?;
    if distc_ir::print(&own.programs.worker) != plan.graph {
        return Err(format!(
            "{} no longer compiles to this plan (the model changed, or the plan was \
             compiled with other flags): compile the plan again",
            plan.source
        ));
    }
    if compiled_with == *s {
        return Ok((own, settings));
    }
    Ok((compile(&compiled_with)?, settings))
}

/// The settings a plan of `settings` is compiled with. A mesh's nodes are the
/// simulation's alone (which links its axes cross): the runtime groups no mesh by
/// node yet, so its plan is compiled without them.
pub fn compiled_settings(settings: &StrategyConfig) -> StrategyConfig {
    let mut compiled_with = settings.clone();
    if settings.model > 1 || settings.pipeline > 1 {
        compiled_with.ranks_per_node = 0;
    }
    compiled_with
}

/// LARS and LAMB scale each variable's update by the norms of the whole variable and
/// its whole gradient: every worker must hold both whole (a lookup's rows are applied as
/// the dense gradient they stand for).
fn check_layer_wise(
    config: &RunConfig,
    s: &StrategyConfig,
    programs: &ProgramSet,
) -> Result<(), CompileError> {
    if !config.optimizer.is_layer_wise() {
        return Ok(());
    }
    let name = config.optimizer.name();
    let split = if s.zero > 0 {
        Some("--zero shards each variable's optimizer state over the workers")
    } else if s.model > 1 {
        Some("a model axis splits variables over workers")
    } else if !programs.servers.is_empty() {
        Some("parameter servers hold rows of the variables")
    } else {
        None
    };
    if let Some(why) = split {
        return Err(CompileError::Settings(format!(
            "{name}'s trust ratio needs each variable whole on one worker, and {why}: use \
             --strategy single or allreduce, without --zero or a model axis"
        )));
    }
    Ok(())
}

/// `clip_norm` scales the gradient by the norm of the whole gradient, which the workers
/// assemble from their parts; a server's rows and a pipeline stage's variables are not
/// in reach of that sum yet.
fn check_clip_norm(config: &RunConfig, programs: &ProgramSet) -> Result<(), CompileError> {
    if config.clip_norm.is_none() {
        return Ok(());
    }
    // A variable a server updates: its gradient is pushed (servers with nothing
    // placed on them change nothing).
    let w = &programs.worker;
    let pushed = w
        .node_ids()
        .into_iter()
        .any(|id| matches!(w.op(id), Op::Push { .. } | Op::SparsePush { .. }));
    if pushed {
        return Err(CompileError::Settings(
            "`clip_norm` needs the norm of the whole gradient before any update, and \
             parameter servers apply the update to their rows, out of the workers' reach: \
             use --strategy single or allreduce (with --zero, a model axis or pipeline stages \
             if wanted), or remove `clip_norm`"
                .into(),
        ));
    }
    Ok(())
}

/// Refuses more parameter servers than the model has rows to give them (issue 60, item
/// 9: `--servers 1048576` on a 3-variable model wrote a million server programs, and
/// `run` would start a million threads): each server holds rows of some variable.
fn check_server_count(s: &StrategyConfig, g: &Graph) -> Result<(), CompileError> {
    if s.servers == 0 {
        return Ok(());
    }
    let rows: usize = g
        .params()
        .iter()
        .map(|(_, _, ty)| ty.dims().first().copied().unwrap_or(1))
        .sum();
    if s.servers > rows {
        return Err(CompileError::Settings(format!(
            "--servers {}: the model's variables have {rows} rows in all, and a server holds \
             whole rows: give at most {rows} servers",
            s.servers
        )));
    }
    Ok(())
}

/// Batch norm's batch statistics (`replica_reduce`) and running ones (`assign`) are kept
/// as one device keeps them by data-parallel workers; the layouts that would keep them
/// otherwise are refused by name.
fn check_batch_statistics(s: &StrategyConfig, g: &Graph) -> Result<(), CompileError> {
    let (mut synced, mut running) = (false, None);
    for id in g.node_ids() {
        match g.op(id) {
            Op::ReplicaReduce { .. } => synced = true,
            Op::Assign { param } => running = running.or(Some(param.clone())),
            _ => {}
        }
    }
    let Some(var) = running.or_else(|| synced.then(|| "a synchronised statistic".into())) else {
        return Ok(());
    };
    let refuse = |why: &str| {
        Err(CompileError::Settings(format!(
            "batch_norm (`{var}`): {why}; train it with data parallelism (--strategy \
             allreduce, --zero 1-3), or normalise with layer_norm or rms_norm"
        )))
    };
    if s.model > 1 {
        return refuse("a mesh with a model axis does not keep running statistics yet");
    }
    let micro = if s.pipeline > 1 {
        s.micro_batches
    } else {
        s.accumulate
    };
    if synced && micro > 1 {
        let flag = if s.pipeline > 1 {
            "pipeline stages"
        } else {
            "--accumulate"
        };
        return Err(CompileError::Settings(format!(
            "batch_norm (`{var}`): with {flag} each micro-batch has its own batch \
             statistics, which differ from the step's batch that one device normalises \
             with: write batch_norm(..., sync = false) for per-micro-batch statistics (one \
             device with the same micro-batches then trains the same), or train it with \
             data parallelism (--strategy allreduce, --zero 1-3)"
        )));
    }
    Ok(())
}

/// Batches sampled to measure how many distinct ids a worker's batch holds.
pub const SAMPLED_BATCHES: usize = 8;

/// The largest batch of inputs, in bytes, the measurement draws.
const MEASURE_LIMIT: usize = 256 << 20;

/// Mean distinct ids per worker batch of every i32 input that feeds a lookup, measured
/// on the configured data source (worker 0's stream). Without the data, no measurement,
/// and the note says why.
fn measure_ids(
    graph: &Graph,
    config: &RunConfig,
    dir: Option<&Path>,
) -> (HashMap<String, (f64, usize)>, String) {
    let mut fields: Vec<String> = Vec::new();
    for id in graph.node_ids() {
        if let Op::Embedding = graph.op(id) {
            let ids = graph.node(id).inputs[1];
            if let Op::Input { name, .. } = graph.op(ids.node) {
                if !fields.contains(name) {
                    fields.push(name.clone());
                }
            }
        }
    }
    if fields.is_empty() {
        return (HashMap::new(), "no lookups: nothing to measure".into());
    }
    let dir = data_dir(dir);
    if config.data.needs_files() && dir.is_none() {
        return (
            HashMap::new(),
            "not measured: no data directory (--data or DISTC_DATA); rows touched are bounds"
                .into(),
        );
    }
    let shapes: HashMap<String, TensorType> = graph
        .inputs()
        .into_iter()
        .map(|(_, n, t)| (n.to_string(), t.clone()))
        .collect();
    // Drawing the sample batches must not take more memory than a step would have.
    let batch_bytes: usize = shapes.values().map(TensorType::bytes).sum();
    if batch_bytes > MEASURE_LIMIT {
        return (
            HashMap::new(),
            format!(
                "not measured: a batch holds {} MiB of inputs, more than the {} MiB the \
                 measurement draws at once; rows touched are bounds",
                batch_bytes >> 20,
                MEASURE_LIMIT >> 20
            ),
        );
    }
    let mut source = match DataSource::open(
        &config.data,
        dir.as_deref(),
        &shapes,
        config.batch,
        config.seed,
        0,
        1,
    ) {
        Ok(s) => s,
        Err(e) => return (HashMap::new(), format!("not measured: {e}")),
    };
    let mut out = HashMap::new();
    let mut notes = Vec::new();
    for f in fields {
        match source.mean_distinct_ids(&f, SAMPLED_BATCHES) {
            Ok(mean) => {
                notes.push(format!(
                    "`{f}`: {mean:.1} distinct ids per batch of {}",
                    config.batch
                ));
                out.insert(f, (mean, SAMPLED_BATCHES));
            }
            Err(e) => notes.push(format!("`{f}` not measured: {e}")),
        }
    }
    (
        out,
        format!(
            "measured over {SAMPLED_BATCHES} batches: {}",
            notes.join(", ")
        ),
    )
}
