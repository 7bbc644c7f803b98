//! The command line's arguments, shared by several commands: the compile and run flags,
//! the value parsers that check each flag's value before a command starts, and their
//! translation into the library's options. The binary's `Cli` lists the commands; the
//! flags live here so that `commands` takes them without a copy.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use distc_passes::pipeline::schedule::ScheduleKind;
use distc_passes::placement::{
    Precision, RematPolicy, Strategy as StrategyKind, StrategyConfig, SyncMode, MAX_MICRO_BATCHES,
    MAX_RANKS,
};
use distc_runtime::core::config::MAX_BATCH;
use std::path::{Path, PathBuf};

use crate::limits::{MAX_TIMEOUT_SECS, MIN_BANDWIDTH};
use crate::CompileOptions;

// The `--strategy` values (the passes' `Strategy` without clap's derive).
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Strategy {
    /// One device: no communication.
    Single,
    /// Replicated variables; dense gradients all-reduced, sparse ones all-gathered.
    Allreduce,
    /// Every variable on parameter servers (large ones row-partitioned).
    Ps,
    /// Sparse variables on parameter servers, dense ones all-reduced.
    Hybrid,
    /// Per variable, by the cost model.
    Auto,
}

// `--format` of `explain` and `simulate`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ExplainFormat {
    /// A table for people.
    Table,
    /// JSON for programs.
    Json,
}

/// How the ranks of a distributed plan run.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Transport {
    /// Every rank a thread of this process (the default).
    Inprocess,
    /// Every rank a process started by `mpirun` (build with `--features mpi`).
    Mpi,
}

/// `sync`, `async` or `stale:K`.
pub fn parse_sync(s: &str) -> Result<SyncMode, String> {
    match s {
        "sync" => Ok(SyncMode::Sync),
        "async" => Ok(SyncMode::Async),
        _ => match s.strip_prefix("stale:").map(str::parse::<u32>) {
            Some(Ok(k)) => Ok(SyncMode::Stale(k)),
            _ => Err(format!("`{s}` is not sync, async or stale:K")),
        },
    }
}

/// `off`, `layers` or a budget above 0 ([`parse_mib`]'s sizes).
pub fn parse_remat(s: &str) -> Result<RematPolicy, String> {
    match s {
        "off" => Ok(RematPolicy::Off),
        "layers" => Ok(RematPolicy::Layers),
        _ if size_in_mib(s).is_none() => Err(format!(
            "`{s}` is not `off`, `layers` or a budget (`512`, in MiB, or with a unit: \
             `512MiB`, `2GiB`, `1.5GB`)"
        )),
        _ => parse_mib(s).map(RematPolicy::Budget),
    }
}

/// A size above 0, in MiB: a bare number is MiB; with a unit, binary (`KiB`, `MiB`,
/// `GiB`, `TiB`) or decimal (`KB`, `MB`, `GB`, `TB`), a space between or not, as
/// people write them.
pub fn parse_mib(s: &str) -> Result<f64, String> {
    match size_in_mib(s) {
        Some(mib) if mib.is_finite() && mib > 0.0 && mib <= 1e12 => Ok(mib),
        Some(mib) if mib > 1e12 => Err(format!(
            "`{s}` is more than any machine holds: give at most 1e12 MiB (an exbibyte)"
        )),
        Some(_) => Err(format!("`{s}` is not a size above 0")),
        None => Err(format!(
            "`{s}` is not a size: give MiB (`160`) or a unit (`160MiB`, `2GiB`, `1.5GB`, \
             `512KiB`)"
        )),
    }
}

/// `s` in MiB: a bare number, or a size with a unit (the `parse-size` crate's rules,
/// `KB` decimal and `KiB` binary).
fn size_in_mib(s: &str) -> Option<f64> {
    if let Ok(mib) = s.trim().parse::<f64>() {
        return Some(mib);
    }
    // A bare number of bytes is not a size here: a bare number is MiB.
    if !s.trim_end().ends_with(|c: char| c.is_ascii_alphabetic()) {
        return None;
    }
    parse_size::parse_size(s.trim())
        .ok()
        .map(|bytes| bytes as f64 / (1u64 << 20) as f64)
}

/// Whether `a` asks for the layout search: `--strategy auto` over several workers with
/// no parameter servers and no axis fixed (`--mesh`, `--pipeline`).
pub fn searches_layout(a: &CompileArgs) -> bool {
    a.strategy == Strategy::Auto
        && a.servers == 0
        && a.workers > 1
        && a.mesh.is_none()
        && a.pipeline == 1
}

/// A whole number in `lo..=hi`, named in the error.
pub fn whole_in(s: &str, lo: usize, hi: usize) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        Ok(n) => Err(format!("{n} is out of range: give {lo} to {hi}")),
        Err(_) => Err(format!("`{s}` is not a whole number from {lo} to {hi}")),
    }
}

/// Workers or servers of a plan: at least 1, at most [`MAX_RANKS`].
pub fn rank_count(s: &str) -> Result<usize, String> {
    whole_in(s, 1, MAX_RANKS)
}

/// Parameter servers: 0 (none, or as the strategy decides) to [`MAX_RANKS`].
pub fn server_count(s: &str) -> Result<usize, String> {
    whole_in(s, 0, MAX_RANKS)
}

/// Nodes of a generated benchmark graph: 1 to 10 million.
pub fn graph_nodes(s: &str) -> Result<usize, String> {
    whole_in(s, 1, 10_000_000)
}

/// The most steps `simulate --profile-steps` runs: a profile settles in a few steps,
/// and 1000 of ResNet-50 on a CPU already take an hour.
pub const MAX_PROFILE_STEPS: usize = 1000;

/// Steps of `simulate`'s profiling run: 1 to [`MAX_PROFILE_STEPS`].
pub fn profile_steps(s: &str) -> Result<usize, String> {
    whole_in(s, 1, MAX_PROFILE_STEPS)
}

/// A batch: 1 to [`MAX_BATCH`] samples.
pub fn batch_size(s: &str) -> Result<usize, String> {
    whole_in(s, 1, MAX_BATCH)
}

/// Micro-batches of gradient accumulation: 1 to [`MAX_MICRO_BATCHES`].
pub fn micro_batches(s: &str) -> Result<usize, String> {
    whole_in(s, 1, MAX_MICRO_BATCHES)
}

/// `gpipe` or `1f1b`.
pub fn parse_schedule(s: &str) -> Result<ScheduleKind, String> {
    s.parse()
        .map_err(|e: distc_passes::pipeline::schedule::ScheduleError| e.to_string())
}

/// A device mesh: workers along the data, model and pipeline axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// Data-parallel replicas.
    pub data: usize,
    /// Workers a variable is split over.
    pub model: usize,
    /// Pipeline stages.
    pub pipe: usize,
}

/// `data=D,model=T[,pipe=P]`, each at least 1.
pub fn parse_mesh(s: &str) -> Result<Mesh, String> {
    let mut m = Mesh {
        data: 1,
        model: 1,
        pipe: 1,
    };
    let mut seen = std::collections::BTreeSet::new();
    for part in s.split(',') {
        let (axis, n) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not AXIS=N (axes: data, model, pipe)"))?;
        let n = at_least_one(n.trim())?;
        if n > 1 << 20 {
            return Err(format!("{axis}={n}: at most 2^20 workers on an axis"));
        }
        let axis = axis.trim();
        if !seen.insert(axis.to_string()) {
            return Err(format!("the {axis} axis is given twice"));
        }
        match axis {
            "data" => m.data = n,
            "model" => m.model = n,
            "pipe" => m.pipe = n,
            other => return Err(format!("`{other}` is not an axis: data, model or pipe")),
        }
    }
    if m.data * m.model * m.pipe > 1 << 20 {
        return Err("more than 2^20 workers in all".into());
    }
    Ok(m)
}

/// `VAR=DIM`.
pub fn parse_shard(s: &str) -> Result<(String, usize), String> {
    let (var, dim) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not VAR=DIM (the variable and the dimension split)"))?;
    let dim = dim
        .trim()
        .parse::<usize>()
        .map_err(|_| format!("`{dim}` is not a dimension (0, 1, ...)"))?;
    Ok((var.trim().to_string(), dim))
}

/// A count flag: a whole number of at least 1.
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("0 is not allowed: give at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// A number that is neither infinite nor NaN.
pub fn finite(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        Ok(x) => Err(format!("`{x}` is not a finite number")),
        Err(_) => Err(format!("`{s}` is not a number")),
    }
}

/// A quantity that must be above 0 (a bandwidth, a size, a time).
pub fn positive_finite(s: &str) -> Result<f64, String> {
    match finite(s)? {
        x if x > 0.0 => Ok(x),
        x => Err(format!("{x} is not above 0")),
    }
}

/// A link's bandwidth for the cost model, bytes/s: from
/// [`MIN_BANDWIDTH`] (1 B/s) to 1 PB/s (beyond either,
/// the predicted times are not numbers a plan can be made of).
pub fn link_bandwidth(s: &str) -> Result<f64, String> {
    match positive_finite(s)? {
        x if (MIN_BANDWIDTH..=1e15).contains(&x) => Ok(x),
        x => Err(format!(
            "{x:?} B/s is not a link's bandwidth (1 to 1e15 B/s)"
        )),
    }
}

/// A link's latency per message for the cost model, seconds: from 0 to 10 s.
pub fn link_latency(s: &str) -> Result<f64, String> {
    match non_negative_finite(s)? {
        x if x <= 10.0 => Ok(x),
        x => Err(format!("{x:?} s is not a link's latency (0 to 10 s)")),
    }
}

/// A timeout in seconds: above 0 and at most [`MAX_TIMEOUT_SECS`].
pub fn timeout_secs(s: &str) -> Result<f64, String> {
    match positive_finite(s)? {
        x if x <= MAX_TIMEOUT_SECS => Ok(x),
        x => Err(format!(
            "{x} s is more than a year ({MAX_TIMEOUT_SECS} s), the longest timeout"
        )),
    }
}

/// A quantity that may be 0 but not negative (a latency, a tolerance).
pub fn non_negative_finite(s: &str) -> Result<f64, String> {
    match finite(s)? {
        x if x >= 0.0 => Ok(x),
        x => Err(format!("{x} is negative")),
    }
}

// The flags of `compile`, `train` and `verify`.
#[derive(Args, Clone)]
pub struct CompileArgs {
    /// Distribution strategy.
    #[arg(long, value_enum, default_value = "single")]
    pub strategy: Strategy,
    /// Write the IR after every pass into DIR, one numbered file per pass and program:
    /// the worker program as NN-PASS.ir, and from distribute on each other program
    /// beside it (NN-PASS.server0.ir ..., NN-PASS.init.ir, NN-PASS.final.ir).
    #[arg(long, value_name = "DIR")]
    pub dump_ir: Option<PathBuf>,
    /// Stop the pipeline after this pass (the plan is then for reading: `run` refuses it).
    #[arg(long, value_name = "PASS")]
    pub stop_after: Option<String>,
    /// Skip a pass (repeatable; skipping autodiff, sparsity_analysis, place or
    /// distribute makes a plan `run` refuses).
    #[arg(long, value_name = "PASS")]
    pub disable_pass: Vec<String>,
    /// Bind the batch dimension B to this instead of the train block's batch.
    #[arg(long, value_parser = batch_size)]
    pub batch: Option<usize>,
    /// Worker count N (data-parallel replicas; more than 1 needs a distributed strategy).
    #[arg(long, default_value_t = 1, value_parser = rank_count)]
    pub workers: usize,
    /// Parameter-server count S (ps, hybrid and auto).
    #[arg(long, default_value_t = 0, value_parser = server_count)]
    pub servers: usize,
    /// Parameter-server synchronisation: sync, async or stale:K (ps, hybrid, auto).
    #[arg(long, default_value = "sync", value_parser = parse_sync)]
    pub sync: SyncMode,
    /// Bucket size cap for fused all-reduces, in MiB, or with a unit (`25MiB`, `1GB`).
    #[arg(long, default_value_t = 25.0, value_parser = parse_mib, allow_negative_numbers = true, value_name = "SIZE")]
    pub bucket_mb: f64,
    /// All-reduce sparse gradients as dense tensors instead of all-gathering their
    /// rows (allreduce and auto); the update stays the one-device update of the rows
    /// the global batch touched.
    #[arg(long)]
    pub sparse_as_dense: bool,
    /// Link bandwidth for the cost model, bytes/s (above 0; default: 10 Gbit/s).
    #[arg(long, default_value_t = 1.25e9, value_parser = link_bandwidth, allow_negative_numbers = true)]
    pub bandwidth: f64,
    /// ZeRO stage of the all-reduced dense variables (allreduce, hybrid, auto): 1
    /// shards the optimizer state over the workers, 2 also the gradients
    /// (reduce-scatter), 3 also the parameters (gathered before each use).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    pub zero: Option<u8>,
    /// Gradient accumulation: K micro-batches of the plan's batch per step, one update
    /// and one round of communication per step (the same update as one device with
    /// batch N*K*b; the activations of one micro-batch).
    #[arg(long, default_value_t = 1, value_parser = micro_batches, value_name = "K")]
    pub accumulate: usize,
    /// Activation checkpointing: `layers` keeps only the activations entering each
    /// layer (matmul, conv2d) and recomputes the rest in the backward pass; a number
    /// is a budget (MiB, or `512MiB`, `2GiB`) for the peak of activations, met with the
    /// fewest recomputations; `off` (the default) keeps every activation.
    #[arg(long, default_value = "off", value_parser = parse_remat, value_name = "layers|SIZE")]
    pub remat: RematPolicy,
    /// With `--strategy auto` and no servers, the layout search's memory budget: the
    /// bytes a worker may hold, in MiB or with a unit (`160MiB`, `2GiB`, `1.5GB`); the
    /// layouts estimated over it are rejected.
    #[arg(long, value_parser = parse_mib, value_name = "SIZE")]
    pub memory_per_worker: Option<f64>,
    /// With the layout search, the precisions it chooses among (`fp32,bf16`), each
    /// profiled on this machine; without it the search keeps --precision.
    #[arg(long, value_delimiter = ',', value_name = "fp32|bf16|fp16,...")]
    pub search_precision: Vec<Precision>,
    /// With the layout search, the op times of a trace of the model on one device
    /// (`distc train MODEL --trace FILE`; on a GPU each op's kernels are timed on the
    /// device) instead of a profile on this machine: the search then prices that device.
    #[arg(long, value_name = "TRACE")]
    pub op_times: Option<PathBuf>,
    /// With the layout search, steps of its profiling run on one worker, the first left
    /// out (default 3), 1 to 1000: more steady the op times on a noisy machine, at
    /// their cost in search time.
    #[arg(long, value_name = "STEPS", value_parser = profile_steps)]
    pub profile_steps: Option<usize>,
    /// With the layout search, a link measured by `distc calibrate` (`intra=FILE` or
    /// `inter=FILE`), as `distc simulate --calibration` reads it: its fitted line, and
    /// its measured sizes. A --link of the same kind replaces it. Repeatable.
    #[arg(long, value_name = "KIND=FILE", value_parser = parse_calibration_flag)]
    pub calibration: Vec<(LinkKind, PathBuf)>,
    /// Kernel fusion: collapse each chain of element-wise ops (a layer's bias add and
    /// activation, the activation gradients) into one `fused` node, which the runtime
    /// runs in one pass over memory; the values computed are the same.
    #[arg(long)]
    pub fuse: bool,
    /// Pipeline parallelism: cut the model into P stages (balanced by the cost model's
    /// FLOPs and memory, or where the model's `pipeline_stage` lines say), each with its
    /// forward and backward program, run as P workers passing activations and their
    /// gradients (`distc explain` shows the cut).
    #[arg(long, default_value_t = 1, value_parser = at_least_one, value_name = "P")]
    pub pipeline: usize,
    /// Micro-batches per step of a pipeline (--pipeline), each of the plan's batch:
    /// one update per step, the same as one device with batch M*b.
    #[arg(long, default_value_t = 1, value_parser = micro_batches, value_name = "M")]
    pub micro_batches: usize,
    /// The pipeline's order of forwards and backwards: `1f1b` (one forward, one
    /// backward; at most P micro-batches' activations alive per stage) or `gpipe` (all
    /// forwards, then all backwards).
    /// Default `1f1b`.
    #[arg(long, value_parser = parse_schedule, value_name = "gpipe|1f1b")]
    pub schedule: Option<ScheduleKind>,
    /// The arithmetic's precision: `fp32`, or `bf16`/`fp16` where the mixed_precision
    /// pass's lists allow it (matmuls, convolutions, lookups and the element-wise chains
    /// between them in 16 bits; losses, softmax, exp, log, layer norm, attention and
    /// reductions to a scalar in f32). Variables stay f32 master copies; gradients reach the optimizer
    /// in f32. fp16 scales the loss dynamically.
    #[arg(long, default_value = "fp32", value_name = "fp32|bf16|fp16")]
    pub precision: Precision,
    /// The model's floating-point type: `f32` (as written), or `f64`, a float64 copy
    /// (every f32 input, variable and constant promoted; data widened as read) in any
    /// layout on the CPU: `distc verify --dtype f64` compares a layout without f32's
    /// rounding.
    #[arg(long, default_value = "f32", value_parser = parse_model_dtype, value_name = "f32|f64")]
    pub dtype: ModelDType,
    /// Override a train block setting, `KEY=VALUE` (repeatable, applied in order): a
    /// setting (`seed=2`, `optimizer=adamw(lr = 3e-4)`) or an argument of one
    /// (`optimizer.lr=3e-4`, `data.vocab=5000`, `lr_schedule.warmup=100`), written as the
    /// block would write it; recorded in the plan and shown by `explain`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// What dense gradient all-reduces send: `fp32`, or `bf16`/`fp16` (half the bytes;
    /// each worker's gradient divided by N before the sum, sums accumulated in f32 at
    /// each receiver, the optimizer still given f32).
    #[arg(long, default_value = "fp32", value_name = "fp32|bf16|fp16")]
    pub grad_wire: Precision,
    /// A device mesh, `data=D,model=T[,pipe=P]` (instead of --workers and --pipeline):
    /// D x T x P workers, worker w at model rank w % T of stage (w / T) % P of data rank
    /// w / (T P). The model axis splits variables over T workers (tensor parallelism;
    /// the Megatron rule picks the pairs of matmuls unless --shard names them), the pipe
    /// axis cuts the model into P stages each T workers wide (with --micro-batches), the
    /// data axis all-reduces gradients among the D copies (--zero shards them there).
    #[arg(long, value_parser = parse_mesh, value_name = "data=D,model=T", conflicts_with_all = ["workers", "pipeline"])]
    pub mesh: Option<Mesh>,
    /// Split variable VAR along dimension DIM over the mesh's model axis (repeatable).
    #[arg(long, value_parser = parse_shard, value_name = "VAR=DIM", requires = "mesh")]
    pub shard: Vec<(String, usize)>,
    /// Latency per message for the cost model, seconds (0 or more).
    #[arg(long, default_value_t = 25e-6, value_parser = link_latency, allow_negative_numbers = true)]
    pub latency: f64,
    /// Workers per node: worker w is on node w / L, and each dense all-reduce runs as
    /// one ring or as a hierarchical all-reduce (within nodes, then across them),
    /// whichever the cost model predicts faster from the two links (see --link).
    #[arg(long, value_name = "L", value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub ranks_per_node: Option<u32>,
    /// A link of the cost model, `intra=BW,LAT` (between workers of one node; default
    /// 100e9 B/s, 5e-6 s) or `inter=BW,LAT` (between nodes: the same as --bandwidth and
    /// --latency), in bytes/s and seconds. Repeatable.
    #[arg(long, value_name = "KIND=BW,LAT", value_parser = parse_link)]
    pub link: Vec<(LinkKind, distc_passes::placement::Link)>,
}

/// `--dtype`: the model's floating-point type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelDType {
    /// As the model is written.
    F32,
    /// A float64 copy.
    F64,
}

fn parse_model_dtype(s: &str) -> Result<ModelDType, String> {
    match s {
        "f32" => Ok(ModelDType::F32),
        "f64" => Ok(ModelDType::F64),
        _ => Err(format!(
            "`{s}` is not a model type: f32 (as written) or f64 (a float64 copy)"
        )),
    }
}

/// Which link `--link` sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// Between workers of one node.
    Intra,
    /// Between nodes.
    Inter,
}

/// `intra=FILE` or `inter=FILE`.
pub fn parse_calibration_flag(s: &str) -> Result<(LinkKind, PathBuf), String> {
    match s.split_once('=') {
        Some(("intra", f)) => Ok((LinkKind::Intra, PathBuf::from(f))),
        Some(("inter", f)) => Ok((LinkKind::Inter, PathBuf::from(f))),
        _ => Err(format!("`{s}`: write intra=FILE or inter=FILE")),
    }
}

/// `intra=BW,LAT` or `inter=BW,LAT`.
pub fn parse_link(s: &str) -> Result<(LinkKind, distc_passes::placement::Link), String> {
    let (kind, rest) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: write intra=BW,LAT or inter=BW,LAT"))?;
    let kind = match kind {
        "intra" => LinkKind::Intra,
        "inter" => LinkKind::Inter,
        other => return Err(format!("`{other}` is not a link: intra or inter")),
    };
    let (bw, lat) = rest
        .split_once(',')
        .ok_or_else(|| format!("`{rest}`: write a bandwidth and a latency, BW,LAT"))?;
    Ok((
        kind,
        distc_passes::placement::Link {
            bandwidth: link_bandwidth(bw.trim())?,
            latency: link_latency(lat.trim())?,
        },
    ))
}

/// Where `eval` and `predict` take the weights from. [`WeightsArgs::weights`] turns
/// them into the command's `Weights`; it is defined beside them, in
/// [`crate::commands::eval`].
#[derive(Args, Clone)]
pub struct WeightsArgs {
    /// The weights: a safetensors file by variable name (`--save`, PyTorch's
    /// `safetensors.torch.save_file`).
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// With --init: variables the file lacks keep their initializer.
    #[arg(long, requires = "init")]
    pub init_partial: bool,
    /// The weights of a training state (`--checkpoint`).
    #[arg(long, value_name = "FILE")]
    pub resume: Option<PathBuf>,
}

// The flags of `run` and `train`.
#[derive(Args, Clone)]
pub struct RunArgs {
    /// Override the number of training steps (at least 1). A learning-rate schedule
    /// keeps the train block's length (a run stopped early or resumed later follows the
    /// same curve); `--set steps=N` changes both.
    #[arg(long, value_parser = at_least_one)]
    pub steps: Option<usize>,
    /// Write per-step metrics as JSON lines to FILE (under MPI, each rank also writes
    /// its own lines to FILE with `.rankR` before the extension).
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
    /// Data directory (default: $DISTC_DATA).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Save the trained variables to FILE (safetensors).
    #[arg(long, value_name = "FILE")]
    pub save: Option<PathBuf>,
    /// Write the training state (variables, optimizer state, step, data position) to
    /// FILE at the end, and every K steps with --checkpoint-every: one safetensors
    /// file with a JSON index in its metadata, rewritten atomically.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Write the --checkpoint file every K steps (at least 1).
    #[arg(long, value_parser = at_least_one, value_name = "K", requires = "checkpoint")]
    pub checkpoint_every: Option<usize>,
    /// With --checkpoint DIR: every worker writes its own shard of the state (its ZeRO
    /// chunks, its model-axis parts) into the folder DIR, in parallel and while
    /// training goes on; nothing is gathered. DIR/latest names the last complete state
    /// (DIR/step-K/: a manifest.json and rank-R.safetensors a worker), which
    /// --resume DIR loads into any layout.
    #[arg(long, requires = "checkpoint")]
    pub sharded: bool,
    /// Continue a run from a --checkpoint file: its variables, optimizer state and data
    /// position, from the step after its own up to --steps (or the plan's steps). The
    /// plan may use another strategy, worker count or ZeRO stage than the run that
    /// wrote it.
    #[arg(long, value_name = "FILE")]
    pub resume: Option<PathBuf>,
    /// Start from the weights in a safetensors FILE (written by `--save`, by PyTorch's
    /// `safetensors.torch.save_file`, or anything else): each variable takes the
    /// tensor of its name, shapes checked, at step 0 with fresh optimizer state. The
    /// file and the model must name the same variables, unless --init-partial.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// With --init: a variable the file lacks keeps the model's initializer, and a
    /// tensor no variable is named is ignored (both are listed).
    #[arg(long, requires = "init")]
    pub init_partial: bool,
    /// Write TensorBoard event files into DIR: every number of each step's metrics line
    /// as a scalar (loss, lr, throughput, MFU, memory, each worker's bytes, each
    /// stage's account), under the line's names (`tensorboard --logdir DIR`).
    #[arg(long, value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
    /// No progress bar, no log lines and no summary.
    #[arg(long, short)]
    pub quiet: bool,
    /// A log line on standard error every N steps and at the last: step, loss, learning
    /// rate, throughput, MFU, memory, elapsed time and ETA. Off a terminal (a pipe,
    /// `nohup`, a batch job) every 10 steps unless given; on a terminal only when
    /// given, beside the progress bar; 0: none.
    #[arg(long, value_name = "N")]
    pub log_every: Option<usize>,
    /// Write a Chrome trace (open in Perfetto) to FILE: per worker a track of its steps
    /// and IR nodes and a track of its collectives; per server a track of the pulls,
    /// pushes and updates it handled.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Draw every step's batch before the first step, so step times and samples/s
    /// measure training alone (as `distc bench` does); on a GPU the batches are then
    /// held in device memory.
    #[arg(long)]
    pub preload: bool,
    /// Leave out the evaluations on the held-out data (the one after the last step, and
    /// the train block's `eval_every`): for runs that time the steps; `distc eval`
    /// evaluates saved weights later.
    #[arg(long)]
    pub no_eval: bool,
    /// Print where the step time went (worker 0 of a distributed run): kernel time per
    /// op, the optimizer, communication waits and the executor's own work.
    #[arg(long)]
    pub profile: bool,
    /// Seconds any collective or server request may take before the run stops with an
    /// error naming the op and the ranks that did not arrive (default 300; a plan of
    /// one worker and no servers has none, and refuses it).
    #[arg(long, value_parser = timeout_secs, allow_negative_numbers = true, value_name = "SECONDS")]
    pub timeout: Option<f64>,
    /// How the ranks run: `inprocess` (threads of this process) or `mpi` (this process
    /// is one rank of an `mpirun` job; see the README for the rank-to-role mapping: a
    /// pipeline's rank w is stage w % P of replica w / P).
    #[arg(long, value_enum, default_value = "inprocess")]
    pub transport: Transport,
    /// Where the kernels run: `cpu`, or `cuda` / `cuda:N` (GPU N, default 0). A
    /// distributed plan's workers run on that GPU (or on --gpus); servers stay on the
    /// CPU. The CUDA libraries are loaded at run time: point distc at them with
    /// DISTC_CUDA_LIB_DIR (or LD_LIBRARY_PATH).
    #[arg(long, default_value = "cpu", value_parser = parse_device, value_name = "DEVICE")]
    pub device: Device,
    /// With --device cuda: the GPU of each worker, worker i on the i-th of the list
    /// (`0,1,2,3`; more workers than GPUs wrap around). Under --transport mpi, worker
    /// rank i takes the i-th. Default: every worker on --device's GPU.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub gpus: Option<Vec<usize>>,
    /// With --device cuda: how the workers' collectives run. `nccl`: NCCL on device
    /// buffers, on a stream of their own (needs libnccl.so and one GPU per worker);
    /// `host`: through host memory and the in-process or MPI communicator (workers
    /// may share a GPU); `auto`: nccl when every worker has its own GPU and found the
    /// library, else host.
    #[arg(long, default_value = "auto", value_name = "auto|nccl|host")]
    pub collectives: distc_runtime::cuda::nccl::Collectives,
    /// On a GPU: run every step eagerly instead of replaying the step captured into a
    /// CUDA graph after warm-up (for comparison).
    #[arg(long)]
    pub no_cuda_graph: bool,
    /// On a GPU: let cuBLAS use TF32 tensor cores for matrix products (faster, about
    /// 10 mantissa bits); by default they compute in full fp32.
    #[arg(long)]
    pub tf32: bool,
    /// Carry on when a worker is lost (it fails, or is lost to an injected failure):
    /// the plan is compiled again for the workers left (the data axis shrinks by one
    /// replica, servers are kept) and training resumes from the state of the last
    /// step, kept in memory every step (no file is read). In-process runs of
    /// data-parallel plans (all-reduce, ZeRO, servers, a model axis).
    #[arg(long)]
    pub elastic: bool,
    /// With --elastic: restart at most K times (at least 1).
    #[arg(long, value_parser = at_least_one, default_value_t = 3, requires = "elastic", value_name = "K")]
    pub max_restarts: usize,
    /// With --elastic: stop instead of restarting with fewer than M workers.
    #[arg(long, value_parser = at_least_one, default_value_t = 1, requires = "elastic", value_name = "M")]
    pub min_workers: usize,
    /// Rehearse a failure: worker W is lost at the start of step K (`W:K`), as if its
    /// process crashed. With --elastic the run carries on without it; without, the
    /// run stops with the error naming the worker.
    #[arg(long, value_parser = parse_failure, value_name = "W:K")]
    pub fail_worker: Option<distc_runtime::run::options::InjectedFailure>,
}

/// `W:K`: worker W lost at step K (K at least 1).
fn parse_failure(s: &str) -> Result<distc_runtime::run::options::InjectedFailure, String> {
    let (w, k) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: give the worker and the step as W:K (`1:4`)"))?;
    let worker = w
        .trim()
        .parse()
        .map_err(|_| format!("`{w}`: the worker must be a rank (0, 1, ...)"))?;
    let step: usize = k
        .trim()
        .parse()
        .map_err(|_| format!("`{k}`: the step must be a whole number"))?;
    if step == 0 {
        return Err("the step must be at least 1".into());
    }
    Ok(distc_runtime::run::options::InjectedFailure { worker, step })
}

// The flags of `bench`.
#[derive(Args, Clone)]
pub struct BenchArgs {
    /// Workloads: sparse_lm, dense_mlp.
    #[arg(long, value_delimiter = ',', default_values_t = ["sparse_lm".to_string(), "dense_mlp".to_string()])]
    pub workloads: Vec<String>,
    /// Strategies: single, allreduce, allreduce_dense (sparse gradients densified:
    /// all-reduce everything), ps, hybrid, auto; with --compile also
    /// allreduce_zero3 (ZeRO stage 3 and --accumulate 2) and search (the layout
    /// search of `compile --strategy auto --workers N`, timed whole). Default:
    /// single,allreduce_dense,allreduce,hybrid,ps; with --compile:
    /// single,allreduce,hybrid,allreduce_zero3.
    #[arg(long, value_delimiter = ',')]
    pub strategies: Option<Vec<String>>,
    /// Measure compile time instead of training: deep MLPs generated in memory
    /// with about --nodes nodes after autodiff, compiled (all passes, verifier and
    /// plan included) with each strategy and the largest --workers; prints nodes,
    /// times and the slowest passes.
    #[arg(long)]
    pub compile: bool,
    /// Graph sizes of --compile, nodes after autodiff (each at least 1).
    #[arg(long, value_delimiter = ',', default_values_t = [10_000usize, 30_000, 100_000], value_parser = graph_nodes)]
    pub nodes: Vec<usize>,
    /// Worker counts (each at least 1).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4], value_parser = rank_count)]
    pub workers: Vec<usize>,
    /// Runs per configuration (at least 1; the median is reported; default 3). With
    /// --compile: compiles per configuration, the fastest reported (default 1).
    #[arg(long, value_parser = at_least_one)]
    pub runs: Option<usize>,
    /// Parameter servers of ps, hybrid and auto plans (default: as many as workers).
    #[arg(long, value_parser = rank_count)]
    pub servers: Option<usize>,
    /// Warm-up steps.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Timed steps (at least 1).
    #[arg(long, default_value_t = 50, value_parser = at_least_one)]
    pub steps: usize,
    /// How workers run: `inprocess` (threads of one process) or `mpi` (each
    /// configuration an `mpirun` job, one process per rank).
    #[arg(long, value_enum, default_value = "inprocess")]
    pub transport: Transport,
    /// Write the rows as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Where the runs' kernels run: cpu, or cuda / cuda:N (one-device plans:
    /// `--strategies single --workers 1`; plans are compiled with --fuse).
    #[arg(long, default_value = "cpu", value_parser = parse_device, value_name = "DEVICE")]
    pub device: Device,
    /// With --device cuda: no CUDA graph replay (see `distc run --no-cuda-graph`).
    #[arg(long)]
    pub no_cuda_graph: bool,
}

/// Where a run's kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// GPU N.
    Cuda(usize),
}

/// `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => Err(format!("`{s}`: give cpu, cuda or cuda:N (N a GPU number)")),
        },
    }
}

/// The passes' strategy of a `--strategy` value.
pub fn strategy_kind(s: Strategy) -> StrategyKind {
    match s {
        Strategy::Single => StrategyKind::Single,
        Strategy::Allreduce => StrategyKind::Allreduce,
        Strategy::Ps => StrategyKind::Ps,
        Strategy::Hybrid => StrategyKind::Hybrid,
        Strategy::Auto => StrategyKind::Auto,
    }
}

/// One rule of [`check_strategy_flags`]: a flag given where the plan it describes
/// would not use it.
struct Ignored {
    /// The flag was given.
    given: bool,
    /// The plan would use it.
    used: bool,
    /// What the user reads: the flag, and why it would do nothing here.
    why: String,
}

/// Refuses flags that the plan would accept and then ignore, one table for every flag:
/// each rule says when a flag was given, when the plan uses it, and what to say.
pub fn check_strategy_flags(a: &CompileArgs) -> Result<()> {
    let stages = a.mesh.map_or(a.pipeline, |m| m.pipe);
    let model = a.mesh.map_or(1, |m| m.model);
    let replicas = a.mesh.map_or(a.workers, |m| m.data);
    let name = strategy_kind(a.strategy).name();
    let single = a.strategy == Strategy::Single && a.mesh.is_none_or(|m| m.data == 1);
    // Dense gradients are all-reduced among replicas: what the wire and the node
    // grouping act on. A pipeline's replicas all-reduce in the stage loop, which has no
    // 16-bit wire nor hierarchy yet.
    let all_reduces = !single && a.strategy != Strategy::Ps && replicas > 1;
    if a.op_times.is_some() && a.profile_steps.is_some() {
        bail!("--profile-steps sets a profile here; --op-times takes the op times from a trace");
    }
    if a.op_times.is_some() && a.search_precision.len() > 1 {
        bail!(
            "--op-times is a trace at one precision: give --search-precision one precision, \
             or none (the trace's, as --precision)"
        );
    }
    // The layout search's own flags: what each does, and where one plan takes it instead.
    let search_only = [
        (
            !a.search_precision.is_empty(),
            "--search-precision lists the precisions the layout search chooses among",
            None,
        ),
        (
            a.op_times.is_some(),
            "--op-times prices the layout search's candidates",
            Some("`distc simulate --trace` prices one plan"),
        ),
        (
            a.profile_steps.is_some(),
            "--profile-steps sets the layout search's profile",
            Some("`distc simulate --profile-steps` profiles for one plan"),
        ),
        (
            !a.calibration.is_empty(),
            "--calibration prices the layout search's candidates",
            Some("`distc simulate --calibration` prices one plan"),
        ),
        (
            a.memory_per_worker.is_some(),
            "--memory-per-worker is the layout search's budget",
            None,
        ),
    ];
    let searching = searches_layout(a);
    let search_rules = search_only
        .into_iter()
        .map(|(given, what, instead)| Ignored {
            given,
            used: searching,
            why: format!(
                "{what}: give it with --strategy auto, --workers N and no servers, mesh or \
             pipeline{}",
                instead.map_or(String::new(), |i| format!(" ({i})"))
            ),
        });
    let rules = [
        Ignored {
            given: a.micro_batches > 1,
            used: stages > 1,
            why: format!(
                "--micro-batches {} splits a pipeline's step; without --pipeline use \
                 --accumulate {} for the same update",
                a.micro_batches, a.micro_batches
            ),
        },
        Ignored {
            given: a.schedule.is_some(),
            used: stages > 1,
            why: format!(
                "--schedule {} orders a pipeline's micro-batches; give --pipeline P (or \
                 --mesh ...,pipe=P) with it",
                a.schedule.unwrap_or_default()
            ),
        },
        Ignored {
            given: a.workers > 1 && a.mesh.is_none(),
            used: a.strategy != Strategy::Single,
            why: format!(
                "--workers {} needs a distributed strategy (--strategy allreduce, ps, hybrid \
                 or auto); --strategy single is one device",
                a.workers
            ),
        },
        Ignored {
            given: a.servers > 0,
            used: matches!(a.strategy, Strategy::Ps | Strategy::Hybrid | Strategy::Auto),
            why: format!(
                "--servers {}: --strategy {name} places nothing on parameter servers; use \
                 --strategy hybrid or ps to use them",
                a.servers
            ),
        },
        Ignored {
            given: a.sync != SyncMode::Sync,
            used: !matches!(a.strategy, Strategy::Single | Strategy::Allreduce),
            why: format!(
                "--sync {} sets how parameter servers apply pushes; --strategy {name} has none \
                 (all-reduce is synchronous)",
                a.sync
            ),
        },
        Ignored {
            given: a.zero.is_some(),
            used: !single && a.strategy != Strategy::Ps,
            why: format!(
                "--zero {} shards all-reduced variables over the workers; --strategy {name} \
                 all-reduces none (use allreduce, hybrid or auto)",
                a.zero.unwrap_or(0)
            ),
        },
        Ignored {
            given: a.sparse_as_dense,
            used: matches!(a.strategy, Strategy::Allreduce | Strategy::Auto),
            why: format!(
                "--sparse-as-dense changes how sparse gradients are all-reduced; under \
                 --strategy {name} none are (use allreduce or auto)"
            ),
        },
        Ignored {
            given: !a.shard.is_empty(),
            used: model > 1,
            why: format!(
                "--shard {}={} splits a variable over the model axis; this mesh has none \
                 (give --mesh ...,model=T with T above 1)",
                a.shard.first().map_or("", |s| s.0.as_str()),
                a.shard.first().map_or(0, |s| s.1)
            ),
        },
        Ignored {
            given: a.grad_wire != Precision::Fp32,
            used: all_reduces && stages == 1,
            why: format!(
                "--grad-wire {} sets what gradient all-reduces send; {} (use more than one \
                 worker under allreduce, hybrid or auto, without a pipeline)",
                a.grad_wire,
                if stages > 1 {
                    "a pipeline's replicas send theirs in f32"
                } else {
                    "this plan all-reduces no gradient"
                }
            ),
        },
        Ignored {
            given: a.ranks_per_node.is_some(),
            used: all_reduces && stages == 1,
            why: format!(
                "--ranks-per-node {} groups workers into nodes for hierarchical all-reduces; \
                 {} (use more than one worker under allreduce, hybrid or auto, without a \
                 pipeline)",
                a.ranks_per_node.unwrap_or(0),
                if stages > 1 {
                    "a pipeline's replicas all-reduce flat"
                } else {
                    "this plan all-reduces no gradient"
                }
            ),
        },
        Ignored {
            given: !a.link.is_empty(),
            used: a.ranks_per_node.is_some(),
            why: "--link sets the links within and between nodes; give --ranks-per-node L \
                  to group the workers into nodes (--bandwidth and --latency set the one \
                  link otherwise)"
                .to_string(),
        },
    ];
    match search_rules.chain(rules).find(|r| r.given && !r.used) {
        Some(r) => bail!("{}", r.why),
        None => Ok(()),
    }
}

/// `base` on mesh `m`, splitting `shard` over its model axis.
pub fn mesh_strategy(m: Mesh, shard: &[(String, usize)], base: StrategyConfig) -> StrategyConfig {
    // A data axis all-reduces: `single` is one data replica.
    let strategy = match base.strategy {
        StrategyKind::Single if m.data > 1 => StrategyKind::Allreduce,
        s => s,
    };
    StrategyConfig {
        strategy,
        // One replica of a pipeline under `single` counts as one worker, as with
        // --pipeline P: its stages are the pipeline's.
        workers: if strategy == StrategyKind::Single && m.model == 1 {
            1
        } else {
            m.data * m.model * m.pipe
        },
        model: m.model,
        pipeline: m.pipe,
        shard: shard.iter().cloned().collect(),
        ..base
    }
}

/// The strategy the compile flags describe.
pub fn strategy_config(a: &CompileArgs) -> StrategyConfig {
    if let Some(m) = a.mesh {
        return mesh_strategy(
            m,
            &a.shard,
            strategy_config(&CompileArgs {
                mesh: None,
                ..a.clone()
            }),
        );
    }
    let link = |kind: LinkKind| a.link.iter().rev().find(|l| l.0 == kind).map(|l| l.1);
    let inter = link(LinkKind::Inter);
    StrategyConfig {
        strategy: strategy_kind(a.strategy),
        workers: a.workers,
        servers: a.servers,
        sync: a.sync,
        bucket_mb: a.bucket_mb,
        sparse_as_dense: a.sparse_as_dense,
        bandwidth: inter.map_or(a.bandwidth, |l| l.bandwidth),
        latency: inter.map_or(a.latency, |l| l.latency),
        ranks_per_node: a.ranks_per_node.map_or(0, |l| l as usize),
        intra_link: link(LinkKind::Intra)
            .unwrap_or_else(distc_passes::placement::Link::default_intra),
        zero: a.zero.unwrap_or(0),
        accumulate: a.accumulate,
        remat: a.remat,
        fuse: a.fuse,
        pipeline: a.pipeline,
        micro_batches: a.micro_batches,
        schedule: a.schedule.unwrap_or_default(),
        precision: a.precision,
        grad_wire: a.grad_wire,
        ..StrategyConfig::default()
    }
}

/// The compiler's options from the compile flags, reading data from `data`.
pub fn compile_opts(a: &CompileArgs, data: Option<&Path>) -> CompileOptions {
    CompileOptions {
        dump_ir: a.dump_ir.clone(),
        stop_after: a.stop_after.clone(),
        disabled: a.disable_pass.clone(),
        batch: a.batch,
        strategy: strategy_config(a),
        data_dir: data.map(Path::to_path_buf),
        // A user's compile names the pass that broke a program.
        verify: distc_passes::Verify::EveryPass,
        promote_f64: a.dtype == ModelDType::F64,
        overrides: a.set.clone(),
    }
}

/// `distc launch`'s own flags (the `train` flags follow `--`).
#[derive(clap::Args, Clone, Debug)]
pub struct LaunchArgs {
    /// Workers of the first job; each restart has one replica fewer.
    #[arg(long, value_parser = at_least_one, value_name = "N")]
    pub workers: usize,
    /// Workers of one replica on a model axis (tensor parallelism): each job runs
    /// `--mesh data=N/T,model=T`, and a lost rank costs its replica of T workers.
    #[arg(long, value_parser = at_least_one, default_value_t = 1, value_name = "T")]
    pub model_axis: usize,
    /// Pipeline stages of one replica: each job runs `--mesh data=N/(T P),model=T,
    /// pipe=P`, and a lost rank costs its replica of T x P workers (the micro-batches
    /// and schedule are `train` flags, after `--`).
    #[arg(long, value_parser = at_least_one, default_value_t = 1, value_name = "P")]
    pub pipeline: usize,
    /// Parameter servers, kept on a restart.
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub servers: usize,
    /// The folder of the training state, sharded (one shard a worker): written every
    /// --checkpoint-every steps and after the last, and resumed from after a lost rank
    /// (and at the start, where it holds one).
    #[arg(long, value_name = "DIR")]
    pub state: PathBuf,
    /// Write the state every K steps: a lost rank undoes the steps since.
    #[arg(long, value_parser = at_least_one, default_value_t = 10, value_name = "K")]
    pub checkpoint_every: usize,
    /// Restart at most K times.
    #[arg(long, default_value_t = 3, value_name = "K")]
    pub max_restarts: usize,
    /// Stop instead of restarting with fewer than M workers.
    #[arg(long, value_parser = at_least_one, default_value_t = 1, value_name = "M")]
    pub min_workers: usize,
    /// The hosts, for mpirun (`node1 slots=2` a line). Read again while the job runs:
    /// with --max-workers, slots added let the job grow. Without it, inside a SLURM
    /// allocation: the allocation's nodes and tasks per node.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Let the job grow back, up to N workers, when the hostfile lists slots for more
    /// (admitted at the next state written: the job is started again from it).
    #[arg(long, value_parser = at_least_one, requires = "hostfile", value_name = "N")]
    pub max_workers: Option<usize>,
    /// After a lost rank, each host of the hostfile must run a one-rank job within
    /// this many seconds, or it is left out of the next attempts.
    #[arg(long, default_value_t = 10.0, value_parser = timeout_secs, value_name = "SECONDS")]
    pub probe_timeout: f64,
    /// The MPI launcher.
    #[arg(long, default_value = "mpirun", value_name = "PROGRAM")]
    pub mpirun: String,
    /// An option for the launcher (repeatable): `--mpirun-arg=--oversubscribe`.
    #[arg(long = "mpirun-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub mpirun_args: Vec<String>,
    /// Every attempt's metrics lines, in one file (JSON lines, as `train --metrics`);
    /// the first line after a restart carries a `restart` object.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<PathBuf>,
}

impl LaunchArgs {
    /// Workers of one replica: a model axis's on each pipeline stage.
    pub fn replica(&self) -> usize {
        self.model_axis * self.pipeline
    }
}

#[cfg(test)]
mod size_tests {
    use super::parse_mib;

    /// Issue 60, item 9: `--memory-per-worker 1e30` was refused as "not above 0".
    #[test]
    fn a_size_beyond_any_machine_is_refused_as_that() {
        assert!(parse_mib("1e30")
            .expect_err("refused")
            .contains("more than any machine holds"));
        for bad in ["0", "-3", "nan", "0MiB"] {
            assert!(parse_mib(bad).expect_err(bad).contains("above 0"), "{bad}");
        }
        assert_eq!(parse_mib("64"), Ok(64.0));
    }

    /// Issue 66, item 5: `--memory-per-worker 160MiB` was "not a size in MiB".
    #[test]
    fn sizes_take_the_units_people_write() {
        for (given, mib) in [
            ("160MiB", 160.0),
            ("160 MiB", 160.0),
            ("160mib", 160.0),
            ("2GiB", 2048.0),
            ("512KiB", 0.5),
            ("1TiB", 1048576.0),
            ("1.5GB", 1.5e9 / 1048576.0),
            ("100MB", 1e8 / 1048576.0),
            ("64", 64.0),
        ] {
            assert_eq!(parse_mib(given), Ok(mib), "{given}");
        }
        for bad in ["lots", "160 MiBs", "MiB", "1.2.3GB"] {
            let e = parse_mib(bad).expect_err(bad);
            assert!(
                e.contains("is not a size") && e.contains("2GiB"),
                "{bad}: {e}"
            );
        }
        assert!(super::parse_remat("2GiB").is_ok());
        assert!(super::parse_remat("some").is_err());
    }
}
