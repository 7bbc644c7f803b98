//! The `distc` command line.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use distc::console::{err, out};
use distc::verify::{verify, VerifyOptions};
use distc::{compile_file, CompileError, CompileOptions, Compiled, Plan};
use distc_passes::pipeline::schedule::ScheduleKind;
use distc_passes::placement::{
    Mechanism, Precision, RematPolicy, Strategy as StrategyKind, StrategyConfig, SyncMode,
    MAX_MICRO_BATCHES, MAX_RANKS,
};
use distc_passes::program_set::ProgramSet;
use distc_runtime::core::config::MAX_BATCH;
use distc_runtime::core::output::{check_outputs, write_file};
use distc_runtime::cuda::nccl::Collectives;
use distc_runtime::ps::PsSync;
use distc_runtime::run::launch::{
    launch, DeviceChoice, GpuOptions, Launch, MpiRun, TransportChoice,
};
use distc_runtime::run::memory;
use distc_runtime::run::metrics::StepMetrics;
use distc_runtime::run::trace::chrome_trace;
use distc_runtime::run::train::{CheckpointEvery, Programs, TrainOptions, TrainReport};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// distc: write a model once for one device; compile, inspect and train it.
#[derive(Parser)]
#[command(name = "distc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile a DSL model into a plan (JSON).
    Compile {
        /// The model (.dsl).
        file: PathBuf,
        #[command(flatten)]
        compile: CompileArgs,
        /// Where to write the plan (not the model's own file, not a device).
        #[arg(short, long, value_name = "PLAN.json")]
        output: PathBuf,
        /// Data directory, read to measure how many embedding rows a batch touches
        /// (default: $DISTC_DATA).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
    },
    /// Check a strategy against one device: N workers of batch b vs one device of
    /// batch N*b, same data and seed; every variable compared after K steps.
    Verify {
        /// The model (.dsl).
        file: PathBuf,
        #[command(flatten)]
        compile: CompileArgs,
        /// Steps to train before comparing (at least 1).
        #[arg(long, default_value_t = 3, value_parser = at_least_one)]
        steps: usize,
        /// Largest relative difference allowed (max |a-b| / max |a|, per variable), a
        /// finite number of at least 0.
        #[arg(long, default_value_t = 1e-4, value_parser = non_negative_finite, allow_negative_numbers = true)]
        tolerance: f64,
        /// Data directory (default: $DISTC_DATA).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
        /// Seconds any collective or server request may take before the run stops
        /// with an error naming it.
        #[arg(long, default_value_t = 300.0, value_parser = timeout_secs, allow_negative_numbers = true, value_name = "SECONDS")]
        timeout: f64,
        /// How the distributed run's ranks run: `inprocess` (threads) or `mpi` (this
        /// process is one rank of `mpirun -np N+S distc verify ... --transport mpi`;
        /// rank 0 then trains the one device and compares).
        #[arg(long, value_enum, default_value = "inprocess")]
        transport: Transport,
        /// Run both sides' workers on a GPU: `cuda` or `cuda:N` (the workers of the
        /// distributed run share it, exchanging through the host); default `cpu`.
        #[arg(long, default_value = "cpu", value_parser = parse_device, value_name = "DEVICE")]
        device: Device,
    },
    /// Benchmark the standard workloads (WORKLOADS.md): each strategy with 1, 2 and 4
    /// workers; 10 warm-up and 50 timed steps, median of 3 runs. With --compile:
    /// compile time of generated deep MLPs of 10k, 30k and 100k nodes instead.
    Bench {
        /// Workloads: sparse_lm, dense_mlp.
        #[arg(long, value_delimiter = ',', default_values_t = ["sparse_lm".to_string(), "dense_mlp".to_string()])]
        workloads: Vec<String>,
        /// Strategies: single, allreduce, allreduce_dense (sparse gradients densified:
        /// all-reduce everything), ps, hybrid, auto; with --compile also
        /// allreduce_zero3 (ZeRO stage 3 and --accumulate 2). Default:
        /// single,allreduce_dense,allreduce,hybrid,ps; with --compile:
        /// single,allreduce,hybrid,allreduce_zero3.
        #[arg(long, value_delimiter = ',')]
        strategies: Option<Vec<String>>,
        /// Measure compile time instead of training: deep MLPs generated in memory
        /// with about --nodes nodes after autodiff, compiled (all passes, verifier and
        /// plan included) with each strategy and the largest --workers; prints nodes,
        /// times and the slowest passes.
        #[arg(long)]
        compile: bool,
        /// Graph sizes of --compile, nodes after autodiff (each at least 1).
        #[arg(long, value_delimiter = ',', default_values_t = [10_000usize, 30_000, 100_000], value_parser = graph_nodes)]
        nodes: Vec<usize>,
        /// Worker counts (each at least 1).
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4], value_parser = rank_count)]
        workers: Vec<usize>,
        /// Runs per configuration (at least 1; the median is reported; default 3). With
        /// --compile: compiles per configuration, the fastest reported (default 1).
        #[arg(long, value_parser = at_least_one)]
        runs: Option<usize>,
        /// Parameter servers of ps, hybrid and auto plans (default: as many as workers).
        #[arg(long, value_parser = rank_count)]
        servers: Option<usize>,
        /// Warm-up steps.
        #[arg(long, default_value_t = 10)]
        warmup: usize,
        /// Timed steps (at least 1).
        #[arg(long, default_value_t = 50, value_parser = at_least_one)]
        steps: usize,
        /// How workers run: `inprocess` (threads of one process) or `mpi` (each
        /// configuration an `mpirun` job, one process per rank).
        #[arg(long, value_enum, default_value = "inprocess")]
        transport: Transport,
        /// Write the rows as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
        /// Where the runs' kernels run: cpu, or cuda / cuda:N (one-device plans:
        /// `--strategies single --workers 1`; plans are compiled with --fuse).
        #[arg(long, default_value = "cpu", value_parser = parse_device, value_name = "DEVICE")]
        device: Device,
        /// With --device cuda: no CUDA graph replay (see `distc run --no-cuda-graph`).
        #[arg(long)]
        no_cuda_graph: bool,
    },
    /// Explain a plan: where each variable went, buckets, predicted bytes per step and
    /// the memory a run needs.
    Explain {
        /// The plan written by `distc compile`.
        plan: PathBuf,
        /// Output format.
        #[arg(long, value_enum, default_value = "table")]
        format: ExplainFormat,
    },
    /// Run a compiled plan.
    Run {
        /// The plan written by `distc compile`.
        plan: PathBuf,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Compile a DSL model and run it (takes the flags of both).
    Train {
        /// The model (.dsl).
        file: PathBuf,
        #[command(flatten)]
        compile: CompileArgs,
        #[command(flatten)]
        run: RunArgs,
    },
    /// Print the text IR of a model after a pass (default: after the last).
    Ir {
        /// The model (.dsl).
        file: PathBuf,
        /// Stop after this pass: lower, autodiff, simplify, dead_code (with --mesh,
        /// tensor_parallel: every value's sharding beside it).
        #[arg(long, value_name = "PASS")]
        after: Option<String>,
        /// Bind the batch dimension B to this instead of the train block's batch.
        #[arg(long, value_parser = batch_size)]
        batch: Option<usize>,
        /// The program of one worker of this mesh, `data=D,model=T[,pipe=P]`.
        #[arg(long, value_parser = parse_mesh, value_name = "data=D,model=T")]
        mesh: Option<Mesh>,
        /// Split variable VAR along dimension DIM over the mesh's model axis (repeatable).
        #[arg(long, value_parser = parse_shard, value_name = "VAR=DIM", requires = "mesh")]
        shard: Vec<(String, usize)>,
        /// The arithmetic's precision (`--after mixed_precision` shows the casts).
        #[arg(long, default_value = "fp32", value_name = "fp32|bf16|fp16")]
        precision: Precision,
    },
    /// Print the graph in Graphviz DOT (pipe into `dot -Tsvg`).
    Dot {
        /// The model (.dsl).
        file: PathBuf,
        /// Stop after this pass (default: after the last).
        #[arg(long, value_name = "PASS")]
        after: Option<String>,
        /// Bind the batch dimension B to this instead of the train block's batch.
        #[arg(long, value_parser = batch_size)]
        batch: Option<usize>,
    },
    /// Predict a plan's step on more workers than this machine has: step time, each
    /// collective's time, how much of it the backward pass hides, scaling efficiency
    /// and memory per worker, from the plan's own schedule, a profile of one worker on
    /// this machine and an alpha-beta model of the links (`--link`, or measured by
    /// `distc calibrate`). Data-parallel plans (all-reduce, servers, ZeRO).
    Simulate {
        /// The plan written by `distc compile` (its model is compiled again for the
        /// target's workers, nodes and links).
        plan: PathBuf,
        /// Data-parallel workers to simulate (default: the plan's).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
        workers: Option<u32>,
        /// Workers per node: nodes of L consecutive workers, each bucket all-reduced as
        /// one ring or hierarchically, whichever the cost model predicts faster.
        #[arg(long, value_name = "L", value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
        ranks_per_node: Option<u32>,
        /// A link, `intra=BW,LAT` or `inter=BW,LAT` (bytes/s, seconds). Repeatable.
        #[arg(long, value_name = "KIND=BW,LAT", value_parser = parse_link)]
        link: Vec<(LinkKind, distc_passes::placement::Link)>,
        /// A link as `distc calibrate` measured it, `intra=FILE` or `inter=FILE`.
        #[arg(long, value_name = "KIND=FILE", value_parser = parse_calibration_flag)]
        calibration: Vec<(LinkKind, PathBuf)>,
        /// Steps of the profiling run on one worker (the first ones left out).
        #[arg(long, default_value_t = 6, value_parser = at_least_one)]
        profile_steps: usize,
        /// Take op times from worker 0 of this trace instead of profiling one worker:
        /// a trace of the plan (`distc run PLAN --trace FILE`) or of its model on one
        /// device with the plan's batch (`distc train MODEL --batch B --trace FILE`).
        #[arg(long, value_name = "TRACE.json")]
        trace: Option<PathBuf>,
        /// Data directory (default: $DISTC_DATA).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
        /// Output format.
        #[arg(long, value_enum, default_value = "table")]
        format: ExplainFormat,
    },
    /// Measure the link the collectives run on: all-reduces of growing buffers over N
    /// ranks (threads, or the ranks of `mpirun -np N distc calibrate --transport mpi`),
    /// and the alpha-beta fit of them that `distc simulate --calibration` reads.
    Calibrate {
        /// `inprocess` (threads) or `mpi` (each rank of mpirun one rank of the ring).
        #[arg(long, value_enum, default_value = "inprocess")]
        transport: Transport,
        /// Ranks of the in-process ring (2 to 256 threads).
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(2..=256))]
        workers: u16,
        /// Buffer sizes in bytes, each 4 to 1 GiB (default: 4 KiB to 64 MiB, by 4x: as
        /// large as buckets).
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(4..=1 << 30))]
        sizes: Vec<u32>,
        /// Timed all-reduces per size, 1 to 1000 (the median is kept).
        #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u16).range(1..=1000))]
        reps: u16,
        /// Seconds a collective may take before the run stops with an error naming it.
        #[arg(long, default_value_t = 300.0, value_parser = timeout_secs, allow_negative_numbers = true, value_name = "SECONDS")]
        timeout: f64,
        /// Where to write the calibration (JSON).
        #[arg(short, long, value_name = "CALIBRATION.json")]
        output: Option<PathBuf>,
    },
    /// Draw metrics files (`train`/`run --metrics`) as one picture: loss, evaluation
    /// metrics, samples/s and memory by category over steps, the runs overlaid.
    Plot {
        /// Metrics files (JSON lines), one run each.
        #[arg(required = true, value_name = "METRICS.jsonl")]
        files: Vec<PathBuf>,
        /// Where to write the picture; the format follows the extension: .svg or .png.
        #[arg(short, long, value_name = "FILE.svg|FILE.png")]
        output: PathBuf,
        /// Legend label of a run (repeat once per file, in order; default: file names).
        #[arg(long = "label", value_name = "TEXT")]
        labels: Vec<String>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum Strategy {
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

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ExplainFormat {
    /// A table for people.
    Table,
    /// JSON for programs.
    Json,
}

/// How the ranks of a distributed plan run.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum Transport {
    /// Every rank a thread of this process (the default).
    Inprocess,
    /// Every rank a process started by `mpirun` (build with `--features mpi`).
    Mpi,
}

fn parse_sync(s: &str) -> Result<SyncMode, String> {
    match s {
        "sync" => Ok(SyncMode::Sync),
        "async" => Ok(SyncMode::Async),
        _ => match s.strip_prefix("stale:").map(str::parse::<u32>) {
            Some(Ok(k)) => Ok(SyncMode::Stale(k)),
            _ => Err(format!("`{s}` is not sync, async or stale:K")),
        },
    }
}

fn parse_remat(s: &str) -> Result<RematPolicy, String> {
    match s {
        "off" => Ok(RematPolicy::Off),
        "layers" => Ok(RematPolicy::Layers),
        _ => match s.parse::<f64>() {
            Ok(mib) if mib.is_finite() && mib > 0.0 => Ok(RematPolicy::Budget(mib)),
            Ok(_) => Err(format!("`{s}` is not a budget above 0 MiB")),
            Err(_) => Err(format!("`{s}` is not `off`, `layers` or a budget in MiB")),
        },
    }
}

/// A count flag: a whole number of at least 1.
/// A scratch folder removed when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A whole number in `lo..=hi`, named in the error.
fn whole_in(s: &str, lo: usize, hi: usize) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        Ok(n) => Err(format!("{n} is out of range: give {lo} to {hi}")),
        Err(_) => Err(format!("`{s}` is not a whole number from {lo} to {hi}")),
    }
}

/// Workers or servers of a plan: at least 1, at most [`MAX_RANKS`].
fn rank_count(s: &str) -> Result<usize, String> {
    whole_in(s, 1, MAX_RANKS)
}

/// Parameter servers: 0 (none, or as the strategy decides) to [`MAX_RANKS`].
fn server_count(s: &str) -> Result<usize, String> {
    whole_in(s, 0, MAX_RANKS)
}

/// Nodes of a generated benchmark graph: 1 to 10 million.
fn graph_nodes(s: &str) -> Result<usize, String> {
    whole_in(s, 1, 10_000_000)
}

/// A batch: 1 to [`MAX_BATCH`] samples.
fn batch_size(s: &str) -> Result<usize, String> {
    whole_in(s, 1, MAX_BATCH)
}

/// Micro-batches of gradient accumulation: 1 to [`MAX_MICRO_BATCHES`].
fn micro_batches(s: &str) -> Result<usize, String> {
    whole_in(s, 1, MAX_MICRO_BATCHES)
}

/// `, pipeline of 4 stages x 8 micro-batches (1f1b)` for a pipelined plan, `, mesh
/// data=2 x model=2 x pipe=2, 4 micro-batches (1f1b)` for a mesh with a model axis,
/// else nothing.
fn pipeline_words(s: &StrategyConfig) -> String {
    if s.model > 1 {
        let mut w = format!(", mesh data={} x model={}", s.data_workers(), s.model);
        if s.pipeline > 1 {
            w += &format!(
                " x pipe={}, {} micro-batches ({})",
                s.pipeline, s.micro_batches, s.schedule
            );
        }
        w
    } else if s.pipeline > 1 {
        format!(
            ", pipeline of {} stages x {} micro-batches ({})",
            s.pipeline, s.micro_batches, s.schedule
        )
    } else {
        String::new()
    }
}

fn parse_schedule(s: &str) -> Result<ScheduleKind, String> {
    s.parse()
        .map_err(|e: distc_passes::pipeline::schedule::ScheduleError| e.to_string())
}

/// A device mesh: workers along the data, model and pipeline axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mesh {
    data: usize,
    model: usize,
    pipe: usize,
}

/// `data=D,model=T[,pipe=P]`, each at least 1.
fn parse_mesh(s: &str) -> Result<Mesh, String> {
    let mut m = Mesh {
        data: 1,
        model: 1,
        pipe: 1,
    };
    for part in s.split(',') {
        let (axis, n) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not AXIS=N (axes: data, model, pipe)"))?;
        let n = at_least_one(n.trim())?;
        if n > 1 << 20 {
            return Err(format!("{axis}={n}: at most 2^20 workers on an axis"));
        }
        match axis.trim() {
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
fn parse_shard(s: &str) -> Result<(String, usize), String> {
    let (var, dim) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}` is not VAR=DIM (the variable and the dimension split)"))?;
    let dim = dim
        .trim()
        .parse::<usize>()
        .map_err(|_| format!("`{dim}` is not a dimension (0, 1, ...)"))?;
    Ok((var.trim().to_string(), dim))
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("0 is not allowed: give at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

fn finite(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() => Ok(x),
        Ok(x) => Err(format!("`{x}` is not a finite number")),
        Err(_) => Err(format!("`{s}` is not a number")),
    }
}

/// A quantity that must be above 0 (a bandwidth, a size, a time).
fn positive_finite(s: &str) -> Result<f64, String> {
    match finite(s)? {
        x if x > 0.0 => Ok(x),
        x => Err(format!("{x} is not above 0")),
    }
}

/// The longest `--timeout`: a year. Above about 1.8e19 s a duration overflows; no wait
/// needs more than this.
const MAX_TIMEOUT_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// A timeout in seconds: above 0 and at most [`MAX_TIMEOUT_SECS`].
fn timeout_secs(s: &str) -> Result<f64, String> {
    match positive_finite(s)? {
        x if x <= MAX_TIMEOUT_SECS => Ok(x),
        x => Err(format!(
            "{x} s is more than a year ({MAX_TIMEOUT_SECS} s), the longest timeout"
        )),
    }
}

/// A quantity that may be 0 but not negative (a latency, a tolerance).
fn non_negative_finite(s: &str) -> Result<f64, String> {
    match finite(s)? {
        x if x >= 0.0 => Ok(x),
        x => Err(format!("{x} is negative")),
    }
}

#[derive(Args, Clone)]
struct CompileArgs {
    /// Distribution strategy.
    #[arg(long, value_enum, default_value = "single")]
    strategy: Strategy,
    /// Write the IR after every pass into DIR, one numbered file per pass and program:
    /// the worker program as NN-PASS.ir, and from distribute on each other program
    /// beside it (NN-PASS.server0.ir ..., NN-PASS.init.ir, NN-PASS.final.ir).
    #[arg(long, value_name = "DIR")]
    dump_ir: Option<PathBuf>,
    /// Stop the pipeline after this pass (the plan is then for reading: `run` refuses it).
    #[arg(long, value_name = "PASS")]
    stop_after: Option<String>,
    /// Skip a pass (repeatable; skipping autodiff, sparsity_analysis, place or
    /// distribute makes a plan `run` refuses).
    #[arg(long, value_name = "PASS")]
    disable_pass: Vec<String>,
    /// Bind the batch dimension B to this instead of the train block's batch.
    #[arg(long, value_parser = batch_size)]
    batch: Option<usize>,
    /// Worker count N (data-parallel replicas; more than 1 needs a distributed strategy).
    #[arg(long, default_value_t = 1, value_parser = rank_count)]
    workers: usize,
    /// Parameter-server count S (ps, hybrid and auto).
    #[arg(long, default_value_t = 0, value_parser = server_count)]
    servers: usize,
    /// Parameter-server synchronisation: sync, async or stale:K (ps, hybrid, auto).
    #[arg(long, default_value = "sync", value_parser = parse_sync)]
    sync: SyncMode,
    /// Bucket size cap for fused all-reduces, MiB (above 0).
    #[arg(long, default_value_t = 25.0, value_parser = positive_finite, allow_negative_numbers = true)]
    bucket_mb: f64,
    /// All-reduce sparse gradients as dense tensors instead of all-gathering their
    /// rows (allreduce and auto); the update stays the one-device update of the rows
    /// the global batch touched.
    #[arg(long)]
    sparse_as_dense: bool,
    /// Link bandwidth for the cost model, bytes/s (above 0; default: 10 Gbit/s).
    #[arg(long, default_value_t = 1.25e9, value_parser = positive_finite, allow_negative_numbers = true)]
    bandwidth: f64,
    /// ZeRO stage of the all-reduced dense variables (allreduce, hybrid, auto): 1
    /// shards the optimizer state over the workers, 2 also the gradients
    /// (reduce-scatter), 3 also the parameters (gathered before each use).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=3))]
    zero: Option<u8>,
    /// Gradient accumulation: K micro-batches of the plan's batch per step, one update
    /// and one round of communication per step (the same update as one device with
    /// batch N*K*b; the activations of one micro-batch).
    #[arg(long, default_value_t = 1, value_parser = micro_batches, value_name = "K")]
    accumulate: usize,
    /// Activation checkpointing: `layers` keeps only the activations entering each
    /// layer (matmul, conv2d) and recomputes the rest in the backward pass; a number
    /// is a budget in MiB for the peak of activations, met with the fewest
    /// recomputations; `off` (the default) keeps every activation.
    #[arg(long, default_value = "off", value_parser = parse_remat, value_name = "layers|MIB")]
    remat: RematPolicy,
    /// Kernel fusion: collapse each chain of element-wise ops (a layer's bias add and
    /// activation, the activation gradients) into one `fused` node, which the runtime
    /// runs in one pass over memory; the values computed are the same.
    #[arg(long)]
    fuse: bool,
    /// Pipeline parallelism: cut the model into P stages (balanced by the cost model's
    /// FLOPs and memory, or where the model's `pipeline_stage` lines say), each with its
    /// forward and backward program, run as P workers passing activations and their
    /// gradients (`distc explain` shows the cut).
    #[arg(long, default_value_t = 1, value_parser = at_least_one, value_name = "P")]
    pipeline: usize,
    /// Micro-batches per step of a pipeline (--pipeline), each of the plan's batch:
    /// one update per step, the same as one device with batch M*b.
    #[arg(long, default_value_t = 1, value_parser = micro_batches, value_name = "M")]
    micro_batches: usize,
    /// The pipeline's order of forwards and backwards: `1f1b` (one forward, one
    /// backward; at most P micro-batches' activations alive per stage) or `gpipe` (all
    /// forwards, then all backwards).
    #[arg(long, default_value = "1f1b", value_parser = parse_schedule, value_name = "gpipe|1f1b")]
    schedule: ScheduleKind,
    /// The arithmetic's precision: `fp32`, or `bf16`/`fp16` where the mixed_precision
    /// pass's lists allow it (matmuls, convolutions, lookups and the element-wise chains
    /// between them in 16 bits; losses, softmax, exp, log, layer norm and reductions to
    /// a scalar in f32). Variables stay f32 master copies; gradients reach the optimizer
    /// in f32. fp16 scales the loss dynamically.
    #[arg(long, default_value = "fp32", value_name = "fp32|bf16|fp16")]
    precision: Precision,
    /// What dense gradient all-reduces send: `fp32`, or `bf16`/`fp16` (half the bytes;
    /// each worker's gradient divided by N before the sum, sums accumulated in f32 at
    /// each receiver, the optimizer still given f32).
    #[arg(long, default_value = "fp32", value_name = "fp32|bf16|fp16")]
    grad_wire: Precision,
    /// A device mesh, `data=D,model=T[,pipe=P]` (instead of --workers and --pipeline):
    /// D x T x P workers, worker w at model rank w % T of stage (w / T) % P of data rank
    /// w / (T P). The model axis splits variables over T workers (tensor parallelism;
    /// the Megatron rule picks the pairs of matmuls unless --shard names them), the pipe
    /// axis cuts the model into P stages each T workers wide (with --micro-batches), the
    /// data axis all-reduces gradients among the D copies (--zero shards them there).
    #[arg(long, value_parser = parse_mesh, value_name = "data=D,model=T", conflicts_with_all = ["workers", "pipeline"])]
    mesh: Option<Mesh>,
    /// Split variable VAR along dimension DIM over the mesh's model axis (repeatable).
    #[arg(long, value_parser = parse_shard, value_name = "VAR=DIM", requires = "mesh")]
    shard: Vec<(String, usize)>,
    /// Latency per message for the cost model, seconds (0 or more).
    #[arg(long, default_value_t = 25e-6, value_parser = non_negative_finite, allow_negative_numbers = true)]
    latency: f64,
    /// Workers per node: worker w is on node w / L, and each dense all-reduce runs as
    /// one ring or as a hierarchical all-reduce (within nodes, then across them),
    /// whichever the cost model predicts faster from the two links (see --link).
    #[arg(long, value_name = "L", value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    ranks_per_node: Option<u32>,
    /// A link of the cost model, `intra=BW,LAT` (between workers of one node; default
    /// 100e9 B/s, 5e-6 s) or `inter=BW,LAT` (between nodes: the same as --bandwidth and
    /// --latency), in bytes/s and seconds. Repeatable.
    #[arg(long, value_name = "KIND=BW,LAT", value_parser = parse_link)]
    link: Vec<(LinkKind, distc_passes::placement::Link)>,
}

/// Which link `--link` sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkKind {
    Intra,
    Inter,
}

/// `intra=FILE` or `inter=FILE`.
fn parse_calibration_flag(s: &str) -> Result<(LinkKind, PathBuf), String> {
    match s.split_once('=') {
        Some(("intra", f)) => Ok((LinkKind::Intra, PathBuf::from(f))),
        Some(("inter", f)) => Ok((LinkKind::Inter, PathBuf::from(f))),
        _ => Err(format!("`{s}`: write intra=FILE or inter=FILE")),
    }
}

#[allow(clippy::too_many_arguments)]
fn simulate_cmd(
    plan_path: &Path,
    workers: Option<usize>,
    ranks_per_node: Option<usize>,
    links: &[(LinkKind, distc_passes::placement::Link)],
    calibrations: &[(LinkKind, PathBuf)],
    profile_steps: usize,
    trace: Option<&Path>,
    data: Option<&Path>,
    format: ExplainFormat,
) -> Result<()> {
    use distc::simulate::{self as sim, Calibration};
    let (p, programs) = Plan::load(plan_path)?;
    p.check_runnable().map_err(anyhow::Error::msg)?;
    let mut target = sim::Target {
        workers,
        ranks_per_node,
        inter: None,
        intra: None,
        data_dir: data.map(Path::to_path_buf),
    };
    let mut copy_bandwidth = None;
    let mut calibrated_bytes = 0usize;
    let mut measured = Vec::new();
    let links_given: Vec<LinkKind> = links.iter().map(|l| l.0).collect();
    let read = |path: &Path| {
        distc_runtime::core::output::read_regular_text(
            path,
            distc_runtime::core::output::TEXT_INPUT_LIMIT,
        )
        .with_context(|| format!("{}", path.display()))
    };
    for (kind, path) in calibrations {
        let text = read(path)?;
        let c: Calibration = serde_json::from_str(&text).with_context(|| {
            format!("{}: not a calibration from distc calibrate", path.display())
        })?;
        copy_bandwidth = Some(c.copy_bandwidth);
        measured.push((*kind, c.ring_steps()));
        calibrated_bytes =
            calibrated_bytes.max(c.samples.iter().map(|s| s.bytes).max().unwrap_or(0));
        match kind {
            LinkKind::Intra => target.intra = Some(c.link),
            LinkKind::Inter => target.inter = Some(c.link),
        }
    }
    for (kind, l) in links {
        match kind {
            LinkKind::Intra => target.intra = Some(*l),
            LinkKind::Inter => target.inter = Some(*l),
        }
    }
    let (compiled, settings) = sim::retarget(&p, &target).map_err(anyhow::Error::msg)?;
    let single = sim::single_program(&p, data).map_err(anyhow::Error::msg)?;
    let copy_bandwidth =
        copy_bandwidth.unwrap_or_else(distc_runtime::comm::calibrate::copy_bandwidth);
    let profile = match trace {
        Some(path) => {
            let text = read(path)?;
            let spans = distc_runtime::run::trace::spans_of_chrome_trace(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let first = spans.iter().map(|s| s.step).min().unwrap_or(0);
            let last = spans.iter().map(|s| s.step).max().unwrap_or(0);
            let skip = if last - first >= 3 { 2 } else { 0 };
            // A trace of this plan, or of its model on one device (`distc train MODEL
            // --trace`): the one whose ops the spans name.
            let traced = [&programs.worker, &single.programs.worker]
                .into_iter()
                .find(|g| sim::spans_match(g, &spans))
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}: a trace of neither this plan nor its model on one device \
                         (with the plan's batch)",
                        path.display()
                    )
                })?;
            sim::ComputeProfile::from_spans(
                traced,
                &spans,
                first + skip,
                copy_bandwidth,
                format!("worker 0 of the run traced in {}", path.display()),
            )
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => sim::profile_here(&single, profile_steps, data, copy_bandwidth)
            .map_err(anyhow::Error::msg)?,
    };
    let touched = distc::verify::rows_touched(compiled.dist.as_ref());
    let rows = memory::expected_rows(&compiled.programs.worker, &touched);
    let mem = memory::estimate(
        &compiled.programs(settings.workers),
        &compiled.config,
        1,
        false,
        &rows,
    )?;
    let mut links = sim::Links::new(
        settings.intra_link,
        distc_passes::placement::Link {
            bandwidth: settings.bandwidth,
            latency: settings.latency,
        },
    );
    // A link given by --link is a line; one calibrated keeps its measured sizes.
    for (kind, steps) in measured {
        let given = links_given.contains(&kind);
        match kind {
            LinkKind::Intra if !given => links.intra_measured = steps,
            LinkKind::Inter if !given => links.inter_measured = steps,
            _ => {}
        }
    }
    let s = sim::simulate(
        &compiled.programs.worker,
        &single.programs.worker,
        &settings,
        links,
        &profile,
        &rows,
        mem.per_worker(),
    );
    match format {
        ExplainFormat::Json => out(&format!("{}\n", serde_json::to_string_pretty(&s)?)),
        ExplainFormat::Table => out(&s.render(&p, &profile)),
    }
    let largest = s.comms.iter().map(|c| c.bytes).fold(0.0, f64::max);
    if calibrated_bytes > 0 && largest > calibrated_bytes as f64 {
        err(&format!(
            "note: a collective of {largest:.0} bytes is beyond the calibration's largest \
             buffer ({calibrated_bytes} bytes): its time is extrapolated (calibrate with \
             --sizes up to it)\n"
        ));
    }
    Ok(())
}

fn calibrate_cmd(
    transport: Transport,
    workers: usize,
    sizes: Vec<usize>,
    reps: usize,
    timeout: f64,
    output: Option<&Path>,
) -> Result<()> {
    use distc::simulate::Calibration;
    if let Some(path) = output {
        distc_runtime::core::output::check_output(path, &[])?;
    }
    let sizes = if sizes.is_empty() {
        (0..8).map(|k| 4096usize << (2 * k)).collect()
    } else {
        sizes
    };
    let (samples, ranks, hosts) = match transport {
        Transport::Inprocess => {
            let largest = sizes.iter().copied().max().unwrap_or(0) as u128;
            // Each thread holds one buffer of the size it times.
            let need = largest * workers as u128;
            if let Some(have) = memory::available().filter(|have| need > *have) {
                bail!(
                    "{} ranks of {} each need {}; the machine has {} available: give smaller \
                     --sizes or fewer --workers",
                    workers,
                    memory::gib(largest),
                    memory::gib(need),
                    memory::gib(have)
                );
            }
            let s = distc_runtime::comm::calibrate::sweep_in_process(workers, &sizes, reps)?;
            (Some(s), workers, 1)
        }
        Transport::Mpi => calibrate_mpi(&sizes, reps, timeout)?,
    };
    let Some(samples) = samples else {
        return Ok(());
    };
    let c = Calibration::fit(
        match transport {
            Transport::Inprocess => "inprocess",
            Transport::Mpi => "mpi",
        },
        ranks,
        hosts,
        samples,
        distc_runtime::comm::calibrate::copy_bandwidth(),
    )
    .map_err(anyhow::Error::msg)?;
    out(&c.render());
    if let Some(path) = output {
        write_file(path, serde_json::to_string_pretty(&c)?.as_bytes())?;
        err(&format!("wrote {}\n", path.display()));
    }
    Ok(())
}

type CalibrationSamples = (
    Option<Vec<distc_runtime::comm::calibrate::Sample>>,
    usize,
    usize,
);

#[cfg(feature = "mpi")]
fn calibrate_mpi(sizes: &[usize], reps: usize, timeout: f64) -> Result<CalibrationSamples> {
    let got = distc_runtime::run::mpi::calibrate(sizes, reps, Duration::from_secs_f64(timeout))?;
    Ok(match got {
        Some((samples, hosts)) => {
            let ranks = hosts.len();
            let mut distinct = hosts;
            distinct.sort();
            distinct.dedup();
            (Some(samples), ranks, distinct.len())
        }
        None => (None, 0, 0),
    })
}

#[cfg(not(feature = "mpi"))]
fn calibrate_mpi(_: &[usize], _: usize, _: f64) -> Result<CalibrationSamples> {
    bail!("this distc was built without MPI: build it with `--features mpi`")
}

/// `intra=BW,LAT` or `inter=BW,LAT`.
fn parse_link(s: &str) -> Result<(LinkKind, distc_passes::placement::Link), String> {
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
            bandwidth: positive_finite(bw.trim())?,
            latency: non_negative_finite(lat.trim())?,
        },
    ))
}

#[derive(Args, Clone)]
struct RunArgs {
    /// Override the number of training steps (at least 1).
    #[arg(long, value_parser = at_least_one)]
    steps: Option<usize>,
    /// Write per-step metrics as JSON lines to FILE (under MPI, each rank also writes
    /// its own lines to FILE with `.rankR` before the extension).
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
    /// Data directory (default: $DISTC_DATA).
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Save the trained variables to FILE (safetensors).
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// Write the training state (variables, optimizer state, step, data position) to
    /// FILE at the end, and every K steps with --checkpoint-every: one safetensors
    /// file with a JSON index in its metadata, rewritten atomically.
    #[arg(long, value_name = "FILE")]
    checkpoint: Option<PathBuf>,
    /// Write the --checkpoint file every K steps (at least 1).
    #[arg(long, value_parser = at_least_one, value_name = "K", requires = "checkpoint")]
    checkpoint_every: Option<usize>,
    /// Continue a run from a --checkpoint file: its variables, optimizer state and data
    /// position, from the step after its own up to --steps (or the plan's steps). The
    /// plan may use another strategy, worker count or ZeRO stage than the run that
    /// wrote it.
    #[arg(long, value_name = "FILE")]
    resume: Option<PathBuf>,
    /// No progress bar and no summary.
    #[arg(long, short)]
    quiet: bool,
    /// Write a Chrome trace (open in Perfetto) to FILE: per worker a track of its steps
    /// and IR nodes and a track of its collectives; per server a track of the pulls,
    /// pushes and updates it handled.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Draw every step's batch before the first step, so step times and samples/s
    /// measure training alone (as `distc bench` does); on a GPU the batches are then
    /// held in device memory.
    #[arg(long)]
    preload: bool,
    /// Print where the step time went (worker 0 of a distributed run): kernel time per
    /// op, the optimizer, communication waits and the executor's own work.
    #[arg(long)]
    profile: bool,
    /// Seconds any collective or server request may take before the run stops with an
    /// error naming the op and the ranks that did not arrive.
    #[arg(long, default_value_t = 300.0, value_parser = timeout_secs, allow_negative_numbers = true, value_name = "SECONDS")]
    timeout: f64,
    /// How the ranks run: `inprocess` (threads of this process) or `mpi` (this process
    /// is one rank of an `mpirun` job; see the README for the rank-to-role mapping: a
    /// pipeline's rank w is stage w % P of replica w / P).
    #[arg(long, value_enum, default_value = "inprocess")]
    transport: Transport,
    /// Where the kernels run: `cpu`, or `cuda` / `cuda:N` (GPU N, default 0). A
    /// distributed plan's workers run on that GPU (or on --gpus); servers stay on the
    /// CPU. The CUDA libraries are loaded at run time: point distc at them with
    /// DISTC_CUDA_LIB_DIR (or LD_LIBRARY_PATH).
    #[arg(long, default_value = "cpu", value_parser = parse_device, value_name = "DEVICE")]
    device: Device,
    /// With --device cuda: the GPU of each worker, worker i on the i-th of the list
    /// (`0,1,2,3`; more workers than GPUs wrap around). Under --transport mpi, worker
    /// rank i takes the i-th. Default: every worker on --device's GPU.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    gpus: Option<Vec<usize>>,
    /// With --device cuda: how the workers' collectives run. `nccl`: NCCL on device
    /// buffers, on a stream of their own (needs libnccl.so and one GPU per worker);
    /// `host`: through host memory and the in-process or MPI communicator (workers
    /// may share a GPU); `auto`: nccl when every worker has its own GPU and found the
    /// library, else host.
    #[arg(long, default_value = "auto", value_name = "auto|nccl|host")]
    collectives: distc_runtime::cuda::nccl::Collectives,
    /// On a GPU: run every step eagerly instead of replaying the step captured into a
    /// CUDA graph after warm-up (for comparison).
    #[arg(long)]
    no_cuda_graph: bool,
    /// On a GPU: let cuBLAS use TF32 tensor cores for matrix products (faster, about
    /// 10 mantissa bits); by default they compute in full fp32.
    #[arg(long)]
    tf32: bool,
}

/// Where a run's kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Device {
    Cpu,
    Cuda(usize),
}

fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Ok(Device::Cuda(n)),
            _ => Err(format!("`{s}`: give cpu, cuda or cuda:N (N a GPU number)")),
        },
    }
}

fn strategy_kind(s: Strategy) -> StrategyKind {
    match s {
        Strategy::Single => StrategyKind::Single,
        Strategy::Allreduce => StrategyKind::Allreduce,
        Strategy::Ps => StrategyKind::Ps,
        Strategy::Hybrid => StrategyKind::Hybrid,
        Strategy::Auto => StrategyKind::Auto,
    }
}

/// Refuses flags that the strategy would accept and then ignore.
fn check_strategy_flags(a: &CompileArgs) -> Result<()> {
    let stages = a.mesh.map_or(a.pipeline, |m| m.pipe);
    if a.micro_batches > 1 && stages == 1 {
        bail!(
            "--micro-batches {} splits a pipeline's step; without --pipeline use \
             --accumulate {} for the same update",
            a.micro_batches,
            a.micro_batches
        );
    }
    let name = strategy_kind(a.strategy).name();
    match a.strategy {
        Strategy::Single if a.mesh.is_some() => {}
        Strategy::Single => {
            if a.workers > 1 {
                bail!(
                    "--workers {} needs a distributed strategy (--strategy allreduce, ps, hybrid \
                     or auto); --strategy single is one device",
                    a.workers
                );
            }
            if a.servers > 0 {
                bail!("--servers {} needs --strategy ps, hybrid or auto; --strategy single has no servers", a.servers);
            }
        }
        Strategy::Allreduce => {
            if a.servers > 0 {
                bail!(
                    "--servers {}: --strategy allreduce places nothing on parameter servers; \
                     use --strategy hybrid or ps to use them",
                    a.servers
                );
            }
        }
        Strategy::Ps | Strategy::Hybrid | Strategy::Auto => {}
    }
    if a.sync != SyncMode::Sync && matches!(a.strategy, Strategy::Single | Strategy::Allreduce) {
        bail!(
            "--sync {} sets how parameter servers apply pushes; --strategy {name} has none \
             (all-reduce is synchronous)",
            a.sync
        );
    }
    if let (Some(z), Strategy::Single | Strategy::Ps) = (a.zero, a.strategy) {
        bail!(
            "--zero {z} shards all-reduced variables over the workers; --strategy {name} \
             all-reduces none (use allreduce, hybrid or auto)"
        );
    }
    if a.sparse_as_dense
        && matches!(
            a.strategy,
            Strategy::Single | Strategy::Ps | Strategy::Hybrid
        )
    {
        bail!(
            "--sparse-as-dense changes how sparse gradients are all-reduced; under --strategy \
             {name} none are (use allreduce or auto)"
        );
    }
    Ok(())
}

/// `base` on mesh `m`, splitting `shard` over its model axis.
fn mesh_strategy(m: Mesh, shard: &[(String, usize)], base: StrategyConfig) -> StrategyConfig {
    // A data axis all-reduces: `single` is one data replica.
    let strategy = match base.strategy {
        StrategyKind::Single if m.data > 1 => StrategyKind::Allreduce,
        s => s,
    };
    StrategyConfig {
        strategy,
        workers: m.data * m.model * m.pipe,
        model: m.model,
        pipeline: m.pipe,
        shard: shard.iter().cloned().collect(),
        ..base
    }
}

fn strategy_config(a: &CompileArgs) -> StrategyConfig {
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
        schedule: a.schedule,
        precision: a.precision,
        grad_wire: a.grad_wire,
        ..StrategyConfig::default()
    }
}

fn compile_opts(a: &CompileArgs, data: Option<&Path>) -> CompileOptions {
    CompileOptions {
        dump_ir: a.dump_ir.clone(),
        stop_after: a.stop_after.clone(),
        disabled: a.disable_pass.clone(),
        batch: a.batch,
        strategy: strategy_config(a),
        data_dir: data.map(Path::to_path_buf),
    }
}

/// Compiles, printing DSL errors as diagnostics.
fn compile_or_report(file: &Path, opts: &CompileOptions) -> Result<Compiled> {
    match compile_file(file, opts) {
        Ok(c) => Ok(c),
        Err(CompileError::Dsl(e)) => {
            if std::io::stderr().is_terminal() {
                err(&format!("{:?}\n", miette::Report::new(*e)));
            } else {
                err(&format!("{}\n", e.render_plain()));
            }
            bail!("could not compile {}", file.display())
        }
        Err(e) => Err(e.into()),
    }
}

fn ps_sync(s: SyncMode) -> PsSync {
    match s {
        SyncMode::Sync => PsSync::Sync,
        SyncMode::Async => PsSync::Async,
        SyncMode::Stale(k) => PsSync::Stale(k),
    }
}

/// Everything a run needs from a plan, however it was obtained: loaded (its programs
/// parsed and verified by `Plan::load`) or just compiled (the compiler's own graphs).
struct Runnable<'a> {
    plan: &'a Plan,
    programs: &'a ProgramSet,
}

impl<'a> Runnable<'a> {
    fn new(plan: &'a Plan, programs: &'a ProgramSet) -> Result<Runnable<'a>> {
        plan.check_runnable().map_err(anyhow::Error::msg)?;
        distc::pipeline::check_settings(&plan.config)?;
        Ok(Runnable { plan, programs })
    }

    fn programs(&self) -> Programs<'_> {
        program_view(self.programs, self.plan.settings.workers)
    }
}

/// The runtime's view of a plan's programs.
fn program_view(p: &ProgramSet, workers: usize) -> Programs<'_> {
    Programs {
        worker: &p.worker,
        init: p.init.as_ref(),
        servers: &p.servers,
        finalize: p.finalize.as_ref(),
        workers,
        pipeline: p.pipeline.as_ref(),
    }
}

/// The memory estimate of a plan: sparse gradients at the rows the compiler measured a
/// batch to touch.
fn plan_memory(
    plan: &Plan,
    programs: &Programs<'_>,
    steps: usize,
    preload: bool,
) -> Result<memory::MemoryEstimate> {
    let touched = distc::verify::rows_touched(plan.dist.as_ref());
    let rows = memory::expected_rows(programs.worker, &touched);
    Ok(memory::estimate(
        programs,
        &plan.config,
        steps,
        preload,
        &rows,
    )?)
}

fn train_options(plan: &Plan, args: &RunArgs) -> Result<TrainOptions> {
    let resume = match &args.resume {
        Some(path) => Some(std::sync::Arc::new(
            distc_runtime::core::checkpoint::load_state(path)?,
        )),
        None => None,
    };
    let checkpoint = args.checkpoint.as_ref().map(|path| CheckpointEvery {
        path: path.clone(),
        every: args.checkpoint_every.unwrap_or(usize::MAX),
        saved_by: format!(
            "{} with {} workers{}{}",
            plan.strategy.name(),
            plan.settings.workers,
            match plan.settings.zero {
                0 => String::new(),
                z => format!(", ZeRO {z}"),
            },
            pipeline_words(&plan.settings)
        ),
    });
    Ok(TrainOptions {
        steps: args.steps,
        data_dir: args.data.clone(),
        // Synchronous plans read one global stream sliced by rank, so the workers
        // together see the batches one device of batch N*b would (WORKLOADS.md's
        // seed + rank streams have the same distribution); asynchronous ones give each
        // worker its own stream.
        global_data: plan.strategy != StrategyKind::Single && plan.settings.sync == SyncMode::Sync,
        preload: args.preload,
        profile: args.profile,
        trace: args.trace.is_some(),
        evaluate: true,
        sync: ps_sync(plan.settings.sync),
        timeout: Duration::from_secs_f64(args.timeout),
        checkpoint,
        resume,
    })
}

/// Trains a plan as the flags say and reports: metrics file, progress bar, `--save`,
/// trace, summary and profile. `inputs` are the files the command read (never
/// overwritten).
fn run_plan(r: &Runnable<'_>, args: &RunArgs, inputs: &[&Path]) -> Result<()> {
    let plan = r.plan;
    let outputs: Vec<&Path> = [&args.metrics, &args.save, &args.trace, &args.checkpoint]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
        .collect();
    check_outputs(&outputs, inputs)?;
    if args.device == Device::Cpu
        && (args.no_cuda_graph
            || args.tf32
            || args.gpus.is_some()
            || args.collectives != Collectives::Auto)
    {
        bail!(
            "--no-cuda-graph, --tf32, --gpus and --collectives are GPU settings: give \
             --device cuda with them"
        );
    }
    if args.gpus.as_ref().is_some_and(Vec::is_empty) {
        bail!("--gpus: give at least one GPU number (0,1,...)");
    }
    // The memory estimate is checked by `launch`, before anything is allocated.
    let steps = args.steps.unwrap_or(plan.config.steps);
    // Created at the first line: under MPI only rank 0 writes the global lines.
    let mut metrics: Option<std::io::BufWriter<std::fs::File>> = None;
    let bar = if !args.quiet && std::io::stderr().is_terminal() {
        let b = ProgressBar::new(steps as u64);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed} < {eta}]")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        Some(b)
    } else {
        None
    };
    // Ctrl-C stops at the end of the running step (the metrics so far are kept) and
    // says which training state is on disk; a second one stops at once.
    let interrupt = (args.transport == Transport::Inprocess).then(interrupt_flag);
    let mut last_step = 0;
    let mut on_step = |m: &StepMetrics| -> distc_runtime::Result<()> {
        last_step = m.step;
        if let (None, Some(p)) = (&metrics, &args.metrics) {
            let f = std::fs::File::create(p).map_err(|source| distc_runtime::RuntimeError::Io {
                path: p.clone(),
                source,
            })?;
            metrics = Some(std::io::BufWriter::new(f));
        }
        if let Some(w) = metrics.as_mut() {
            let line = serde_json::to_string(m)
                .map_err(|e| distc_runtime::RuntimeError::Config(e.to_string()))?;
            writeln!(w, "{line}").map_err(|source| distc_runtime::RuntimeError::Io {
                path: args.metrics.clone().unwrap_or_default(),
                source,
            })?;
        }
        if let Some(b) = &bar {
            b.set_position(m.step as u64);
            b.set_message(format!(
                "loss {:.4}  {:.0} samples/s",
                m.loss, m.samples_per_sec
            ));
        }
        if interrupt.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) {
            return Err(distc_runtime::RuntimeError::Config(INTERRUPTED.into()));
        }
        Ok(())
    };
    let run = Launch {
        programs: r.programs(),
        config: &plan.config,
        opts: train_options(plan, args)?,
        device: device_choice(args.device, args),
        transport: match args.transport {
            Transport::Inprocess => TransportChoice::InProcess,
            Transport::Mpi => TransportChoice::Mpi(mpi_run_options(plan, args)),
        },
        rows_touched: distc::verify::rows_touched(plan.dist.as_ref()),
    };
    let result = launch(&run, &mut on_step).map_err(anyhow::Error::from);
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(mut w) = metrics {
        w.flush().context("cannot write the metrics file")?;
    }
    if interrupt.is_some_and(|f| f.load(Ordering::SeqCst)) && result.is_err() {
        bail!("{}", interrupted_note(args, last_step));
    }
    match result? {
        Some(report) => finish_run(plan, args, &report),
        // Another rank than 0 of an MPI job: rank 0 reports.
        None => Ok(()),
    }
}

const INTERRUPTED: &str = "interrupted (Ctrl-C)";

/// Set by the first Ctrl-C; a second one exits at once. Installed once per process.
fn interrupt_flag() -> Arc<AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let seen = flag.clone();
        let installed = ctrlc::set_handler(move || {
            if seen.swap(true, Ordering::SeqCst) {
                err("\ninterrupted again: stopping now, writing nothing more\n");
                std::process::exit(130);
            }
            err("\ninterrupted: stopping after this step (Ctrl-C again stops at once)\n");
        });
        if let Err(e) = installed {
            err(&format!("warning: Ctrl-C will stop at once: {e}\n"));
        }
        flag
    })
    .clone()
}

/// What a run stopped by Ctrl-C leaves: the metrics so far, and the training state of
/// the last checkpoint step, if any. No final state is written: workers stop where
/// each is, and a state must be one step of all of them.
fn interrupted_note(args: &RunArgs, step: usize) -> String {
    // Read back, not computed: workers may have finished (and saved) a step beyond
    // the last one reported.
    let state = match &args.checkpoint {
        Some(path) => match distc_runtime::core::checkpoint::load_state(path) {
            Ok(st) => format!(
                "the last training state written is of step {} in {} (resume with --resume)",
                st.index.step,
                path.display()
            ),
            Err(_) => format!("{} holds no training state", path.display()),
        },
        None => "no training state was written (--checkpoint FILE \
                 --checkpoint-every K keeps one)"
            .into(),
    };
    let saved = match &args.save {
        Some(p) => format!("; --save {} was not written", p.display()),
        None => String::new(),
    };
    format!("{INTERRUPTED} after step {step}: no final checkpoint was written; {state}{saved}")
}

/// Where a run's workers compute, from --device and the GPU flags.
fn device_choice(device: Device, args: &RunArgs) -> DeviceChoice {
    match device {
        Device::Cpu => DeviceChoice::Cpu,
        Device::Cuda(ordinal) => DeviceChoice::Cuda(GpuOptions {
            ordinal,
            gpus: args.gpus.clone(),
            tf32: args.tf32,
            graphs: !args.no_cuda_graph,
            collectives: args.collectives,
        }),
    }
}

/// What every rank of an MPI run is told about the plan and the command.
fn mpi_run_options(plan: &Plan, args: &RunArgs) -> MpiRun {
    MpiRun {
        plan_hash: plan.hash.clone(),
        servers: plan.settings.servers,
        metrics: args.metrics.clone(),
        trace: args.trace.clone(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
    }
}

/// What every run does once trained: save, trace, summary, profile.
fn finish_run(plan: &Plan, args: &RunArgs, report: &TrainReport) -> Result<()> {
    if let Some(path) = &args.save {
        let mut named: Vec<(String, &distc_runtime::Tensor)> =
            report.params.iter().map(|(k, v)| (k.clone(), v)).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let meta = [
            ("model".to_string(), plan.model.clone()),
            ("steps".to_string(), report.steps.to_string()),
        ]
        .into_iter()
        .collect();
        distc_runtime::core::checkpoint::save(path, &named, meta)?;
    }
    if let Some(path) = &args.trace {
        let text = serde_json::to_string(&chrome_trace(&report.spans))?;
        write_file(path, text.as_bytes())?;
    }
    if !args.quiet {
        let mut line = format!(
            "{} ({}, {} workers{}): {} steps in {:.1} s, loss {:.4} -> {:.4}, {:.0} samples/s",
            plan.model,
            plan.strategy.name(),
            plan.settings.workers,
            pipeline_words(&plan.settings),
            report.steps,
            report.train_time.as_secs_f64(),
            report.first_loss,
            report.final_loss,
            report.samples_per_sec
        );
        if let Some(b) = report.pipeline_bubble {
            line += &format!(", pipeline bubble {:.1}% measured", 100.0 * b);
        }
        if let Some(e) = &report.eval {
            line += &format!("; eval_loss {:.4}", e.eval_loss);
            if let Some(a) = e.eval_accuracy {
                line += &format!(", eval_accuracy {:.4}", a);
            }
            if let Some(r) = e.eval_rmse {
                line += &format!(", eval_rmse {:.4}", r);
            }
            line += &format!(" ({} samples)", e.eval_samples);
        }
        out(&format!("{line}\n"));
    }
    if let Some(p) = &report.profile {
        out(&p.render());
    }
    Ok(())
}

#[cfg(feature = "mpi")]
use distc::verify::verify_mpi;

#[cfg(not(feature = "mpi"))]
fn verify_mpi(
    _: &Path,
    _: &VerifyOptions,
) -> Result<Option<distc::verify::VerifyReport>, distc::verify::VerifyError> {
    Err(distc::verify::VerifyError::Refused(
        distc_runtime::run::launch::NO_MPI.into(),
    ))
}

/// `distc verify`: the library's check, printed.
#[allow(clippy::too_many_arguments)]
fn verify_cmd(
    file: &Path,
    compile: &CompileArgs,
    steps: usize,
    tolerance: f64,
    data: Option<&Path>,
    timeout: f64,
    transport: Transport,
    device: Device,
) -> Result<()> {
    check_strategy_flags(compile)?;
    let device = match (device, transport) {
        (Device::Cpu, _) => None,
        (Device::Cuda(n), Transport::Inprocess) => Some(n),
        (Device::Cuda(_), Transport::Mpi) => bail!(
            "--device cuda verifies with worker threads on one GPU; --transport mpi runs on the CPU"
        ),
    };
    let opts = VerifyOptions {
        compile: compile_opts(compile, data),
        steps,
        tolerance,
        timeout: Duration::from_secs_f64(timeout),
        device,
    };
    let result = match transport {
        Transport::Inprocess => verify(file, &opts).map(Some),
        Transport::Mpi => verify_mpi(file, &opts),
    };
    let report = match result {
        Err(distc::verify::VerifyError::Compile(e)) => {
            // DSL errors print as diagnostics.
            compile_or_report(file, &opts.compile)?;
            return Err(e.into());
        }
        // Another rank than 0 of an MPI job: rank 0 reports.
        Ok(None) => return Ok(()),
        Ok(Some(r)) => r,
        Err(e) => return Err(e.into()),
    };
    let name = match opts.compile.strategy.zero {
        0 => report.strategy.name().to_string(),
        z => format!("{} (ZeRO {z})", report.strategy.name()),
    } + &pipeline_words(&opts.compile.strategy);
    let precision = opts.compile.strategy.precision;
    let name = if precision == Precision::Fp32 {
        name
    } else {
        format!("{name}, {precision}")
    };
    let name = match opts.compile.strategy.grad_wire {
        Precision::Fp32 => name,
        wire => format!("{name}, {wire} wire"),
    };
    let mut text = String::new();
    for v in &report.vars {
        text += &format!(
            "  {:<10} max |one device - {name}| / max |w| = {:.2e}",
            v.name, v.relative
        );
        if let Some(e) = v.precision_effect {
            text += &format!(
                " (one device {precision} vs f32: {e:.2e}; allowed {:.2e})",
                v.allowed(tolerance)
            );
        }
        text.push('\n');
    }
    let worst = report
        .worst()
        .ok_or_else(|| anyhow::anyhow!("the model has no variables"))?;
    text += &format!(
        "verify {}: {name} with {} workers vs one device with batch {}, {steps} steps: largest relative error {:.2e} (`{}`), tolerance {tolerance:.0e}\n",
        file.display(),
        report.workers,
        report.global_batch,
        worst.relative,
        worst.name
    );
    out(&text);
    if !report.passed() {
        let failing = report
            .vars
            .iter()
            .find(|v| v.relative > v.allowed(tolerance))
            .unwrap_or(worst);
        let mut why = match failing.precision_effect {
            None => format!(
                "`{}` differs by {:.2e} (relative), beyond the tolerance {tolerance:.0e}",
                failing.name, failing.relative
            ),
            Some(e) => format!(
                "`{}` differs by {:.2e} (relative), beyond the tolerance ({:.1e}, at least \
                 {precision}'s own) plus twice what {precision} itself changes on one device \
                 ({e:.2e})",
                failing.name,
                failing.relative,
                tolerance.max(failing.half_rtol)
            ),
        };
        if !report.assumptions.is_empty() {
            why += "\ndata parallelism assumes the loss is a mean over the batch and that \
                    nothing is computed across samples; this model does not:";
            for a in &report.assumptions {
                why += &format!("\n  - {a}");
            }
        }
        bail!("{why}");
    }
    Ok(())
}

/// An error and its causes, joined by `: `, each cause left out when the text before
/// it already says it (an error whose message includes its source's, as `path: OS
/// error` does, would otherwise print the OS error twice).
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

fn main() {
    // Before anything allocates (data is loaded before the first executor exists) and
    // before any thread starts, so every block follows the same malloc settings.
    distc_runtime::cpu::warm_allocator();
    let cli = Cli::parse();
    if let Err(e) = real_main(cli) {
        let text = error_chain(&e);
        err(&format!("error: {text}\n"));
        // 128 + SIGINT, as shells report a job stopped by Ctrl-C.
        std::process::exit(if text.starts_with(INTERRUPTED) {
            130
        } else {
            1
        });
    }
}

fn real_main(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Compile {
            file,
            compile,
            output,
            data,
        } => {
            check_strategy_flags(&compile)?;
            distc_runtime::core::output::check_output(&output, &[&file])?;
            let start = std::time::Instant::now();
            let c = compile_or_report(&file, &compile_opts(&compile, data.as_deref()))?;
            distc::pipeline::check_settings(&c.config)?;
            let plan = Plan::new(&c, &file.display().to_string(), &strategy_config(&compile));
            plan.save(&output, &[&file])?;
            for r in &c.records {
                err(&format!("  {r}\n"));
            }
            if let Some(m) = &c.measurement {
                err(&format!("  sparsity {m}\n"));
            }
            if let Some(why) = &c.not_runnable {
                err(&format!(
                    "  note: `distc run` will refuse this plan: {why}\n"
                ));
            }
            err(&format!(
                "wrote {} ({} nodes, {} server programs) in {:.2} s\n",
                output.display(),
                c.programs.worker.node_count(),
                c.programs.servers.len(),
                start.elapsed().as_secs_f64()
            ));
        }
        Command::Verify {
            file,
            compile,
            steps,
            tolerance,
            data,
            timeout,
            transport,
            device,
        } => verify_cmd(
            &file,
            &compile,
            steps,
            tolerance,
            data.as_deref(),
            timeout,
            transport,
            device,
        )?,
        Command::Bench {
            workloads,
            strategies,
            compile,
            nodes,
            workers,
            runs,
            servers,
            warmup,
            steps,
            transport,
            json,
            device,
            no_cuda_graph,
        } => {
            if let Some(path) = &json {
                distc_runtime::core::output::check_output(path, &[])?;
            }
            let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
            if compile {
                let settings = distc::bench::CompileBenchSettings {
                    nodes,
                    strategies: strategies.unwrap_or_else(|| {
                        names(&["single", "allreduce", "hybrid", "allreduce_zero3"])
                    }),
                    workers: workers.iter().copied().max().unwrap_or(2),
                    servers,
                    runs: runs.unwrap_or(1),
                };
                let rows = distc::bench::run_compile(&settings)?;
                if let Some(path) = json {
                    write_file(&path, serde_json::to_string_pretty(&rows)?.as_bytes())?;
                }
                return Ok(());
            }
            let strategies = strategies.unwrap_or_else(|| {
                names(&["single", "allreduce_dense", "allreduce", "hybrid", "ps"])
            });
            let runs = runs.unwrap_or(3);
            let dir = std::env::temp_dir().join(format!("distc-bench-{}", std::process::id()));
            let settings = distc::bench::BenchSettings {
                workloads,
                strategies,
                workers,
                runs,
                servers,
                warmup,
                steps,
                mpi: transport == Transport::Mpi,
                dir,
                device: match device {
                    Device::Cpu => None,
                    Device::Cuda(n) => Some(format!("cuda:{n}")),
                },
                no_cuda_graph,
            };
            // The scratch plans and metrics go with the run, however it ends.
            let _scratch = RemoveOnDrop(settings.dir.clone());
            let rows = distc::bench::run(&settings)?;
            if let Some(path) = json {
                write_file(&path, serde_json::to_string_pretty(&rows)?.as_bytes())?;
            }
        }
        Command::Explain { plan, format } => {
            let (p, programs) = Plan::load(&plan)?;
            let programs = program_view(&programs, p.settings.workers);
            let mem = plan_memory(&p, &programs, p.config.steps, false)?;
            match format {
                ExplainFormat::Json => out(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&explain_json(&p, &mem))?
                )),
                ExplainFormat::Table => out(&format!(
                    "{}{}{}{}{}{}",
                    explain_table(&p, &mem),
                    explain_pipeline(&p, programs.worker, programs.pipeline)?,
                    explain_mesh(&p, programs.worker),
                    explain_precision(&p, programs.worker),
                    explain_nodes(&p.settings, programs.worker),
                    explain_lr(&p.config)
                )),
            }
        }
        Command::Simulate {
            plan,
            workers,
            ranks_per_node,
            link,
            calibration,
            profile_steps,
            trace,
            data,
            format,
        } => simulate_cmd(
            &plan,
            workers.map(|n| n as usize),
            ranks_per_node.map(|n| n as usize),
            &link,
            &calibration,
            profile_steps,
            trace.as_deref(),
            data.as_deref(),
            format,
        )?,
        Command::Calibrate {
            transport,
            workers,
            sizes,
            reps,
            timeout,
            output,
        } => calibrate_cmd(
            transport,
            workers.into(),
            sizes.into_iter().map(|b| b as usize).collect(),
            reps.into(),
            timeout,
            output.as_deref(),
        )?,
        Command::Run { plan, run } => {
            let (p, programs) = Plan::load(&plan)?;
            let r = Runnable::new(&p, &programs)?;
            run_plan(&r, &run, &[&plan])?;
        }
        Command::Train {
            file,
            mut compile,
            run,
        } => {
            check_strategy_flags(&compile)?;
            // A GPU runs each fused group as one generated kernel.
            compile.fuse |= matches!(run.device, Device::Cuda(_));
            let c = compile_or_report(&file, &compile_opts(&compile, run.data.as_deref()))?;
            distc::pipeline::check_settings(&c.config)?;
            let plan = Plan::new(&c, &file.display().to_string(), &strategy_config(&compile));
            let r = Runnable::new(&plan, &c.programs)?;
            run_plan(&r, &run, &[&file])?;
        }
        Command::Ir {
            file,
            after,
            batch,
            mesh,
            shard,
            precision,
        } => {
            let base = StrategyConfig {
                precision,
                ..StrategyConfig::default()
            };
            let strategy = match mesh {
                Some(m) => mesh_strategy(m, &shard, base),
                None => base,
            };
            let c = compile_or_report(
                &file,
                &CompileOptions {
                    stop_after: after,
                    batch,
                    strategy,
                    ..Default::default()
                },
            )?;
            out(&distc_ir::print::print_with_notes(
                &c.programs.worker,
                &c.programs.worker_notes,
            ));
        }
        Command::Dot { file, after, batch } => {
            out(&distc_ir::dot::to_dot(
                &compile_until(&file, after, batch)?.programs.worker,
            ));
        }
        Command::Plot {
            files,
            output,
            labels,
        } => {
            let panels = distc::plot::plot(&files, &output, &distc::plot::PlotOptions { labels })?;
            err(&format!(
                "wrote {} ({})\n",
                output.display(),
                panels.join(", ")
            ));
        }
    }
    Ok(())
}

/// The one-device pipeline up to pass `after` (all of it by default), for `ir` and `dot`.
fn compile_until(file: &Path, after: Option<String>, batch: Option<usize>) -> Result<Compiled> {
    let opts = CompileOptions {
        stop_after: after,
        batch,
        ..Default::default()
    };
    compile_or_report(file, &opts)
}

fn mib(b: f64) -> String {
    if b >= 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

fn placement_text(v: &distc_passes::placement::VarPlacement) -> String {
    match v.placement {
        Mechanism::Ps => {
            let shards: Vec<String> = v
                .shards
                .iter()
                .map(|s| format!("s{}[{}:{}]", s.server, s.start, s.end))
                .collect();
            format!("ps {}", shards.join(" "))
        }
        m => m.name().to_string(),
    }
}

/// Mixed precision and a 16-bit gradient wire: what runs in 16 bits, the f32 master
/// variables beside their 16-bit copies, the 16-bit and f32 values a step makes, and
/// the loss scaling. Empty for an f32 plan.
/// `--ranks-per-node`: the nodes and links, and for each dense all-reduce the cost
/// model's choice, both predicted times and the bytes a worker sends over each link.
fn explain_nodes(s: &StrategyConfig, worker: &distc_ir::Graph) -> String {
    use distc_ir::{DType, Op, ValueType};
    use distc_passes::hierarchy::{flat_fraction, hierarchical_fractions};
    use std::fmt::Write as _;
    let local = s.ranks_per_node;
    if local == 0 {
        return String::new();
    }
    let n = s.data_workers();
    let link = |bw: f64, lat: f64| format!("{:.3e} B/s, {:.1} us", bw, lat * 1e6);
    let mut out = format!(
        "nodes: {} of {local} workers each (--ranks-per-node); links: within a node {}, \
         between nodes {}\n",
        n.div_ceil(local),
        link(s.intra_link.bandwidth, s.intra_link.latency),
        link(s.bandwidth, s.latency)
    );
    for id in worker.topo_order() {
        let Op::AllReduce { ranks_per_node, .. } = *worker.op(id) else {
            continue;
        };
        let bytes = match worker.value_type(worker.node(id).inputs[0]) {
            ValueType::Tensor(t) if t.dtype == DType::F32 => t.bytes() as f64,
            _ => continue,
        };
        let (flat, hier) = distc_passes::placement::all_reduce_seconds(bytes, n, local, s);
        let sends = if ranks_per_node > 1 {
            let (within, across) = hierarchical_fractions(n, local);
            format!(
                "each worker sends {} within its node and {} across nodes",
                mib(within * bytes),
                mib(across * bytes)
            )
        } else if n > local {
            format!(
                "the ring's {} node-edge workers each send {} across nodes, the others as \
                 much within their node",
                n / local,
                mib(flat_fraction(n) * bytes)
            )
        } else {
            format!(
                "each worker sends {} within its node",
                mib(flat_fraction(n) * bytes)
            )
        };
        let _ =
            writeln!(
            out,
            "  all-reduce {id} ({}): {}; predicted {:.3} ms flat, {:.3} ms hierarchical; {sends}",
            mib(bytes),
            if ranks_per_node > 1 { "hierarchical" } else { "flat" },
            flat * 1e3,
            hier * 1e3
        );
    }
    out
}

/// The learning rate: the linear scaling rule's arithmetic and the schedule, with the
/// rate at a few updates of the run (nothing for a constant rate as written).
fn explain_lr(config: &distc_runtime::RunConfig) -> String {
    use distc_runtime::Decay;
    use std::fmt::Write as _;
    let mut s = String::new();
    let lr = config.optimizer.lr();
    if let Some(l) = &config.lr_scaling {
        let _ = writeln!(
            s,
            "learning rate: {lr} = {} x {} / {} (linear scaling rule: a step's {} samples \
             over the train block's batch of {})",
            l.base_lr, l.global_batch, l.batch, l.global_batch, l.batch
        );
    }
    let sched = &config.lr_schedule;
    if !sched.is_constant() {
        let decay = match sched.decay {
            Decay::Constant => "then constant".to_string(),
            Decay::Step { every, gamma } => format!("then x {gamma} every {every} updates"),
            Decay::Cosine { final_factor } => format!("then cosine to {final_factor} x"),
            Decay::Poly {
                power,
                final_factor,
            } => format!("then polynomial (power {power}) to {final_factor} x"),
        };
        let total = config.steps as u64;
        let at: Vec<String> = [0, sched.warmup as u64, total / 2, total.saturating_sub(1)]
            .into_iter()
            .filter(|&t| t < total)
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|t| format!("update {}: {:.4e}", t + 1, lr * sched.factor(t, total)))
            .collect();
        let _ = writeln!(
            s,
            "learning-rate schedule: linear warm-up over {} updates, {decay} over {} steps ({})",
            sched.warmup,
            total,
            at.join(", ")
        );
    }
    s
}

fn explain_precision(p: &Plan, worker: &distc_ir::Graph) -> String {
    use distc_ir::{DType, Op};
    use std::fmt::Write as _;
    let (precision, wire) = (p.settings.precision, p.settings.grad_wire);
    let mut s = String::new();
    if precision != Precision::Fp32 {
        let (mut masters, mut copies, mut half, mut full, mut casts) = (0usize, 0, 0, 0, 0);
        for id in worker.node_ids() {
            let node = worker.node(id);
            let bytes: usize = node.outputs.iter().map(|t| t.dense_type().bytes()).sum();
            match &node.op {
                Op::Param { ty, .. } => masters += ty.bytes(),
                Op::Cast { to } if to.is_half() => {
                    casts += 1;
                    if matches!(worker.op(node.inputs[0].node), Op::Param { .. }) {
                        copies += bytes;
                    } else {
                        half += bytes;
                    }
                }
                op if op.is_source() || op.is_sink() => {}
                _ => {
                    let halfs = node.outputs.iter().any(|t| t.dense_type().dtype.is_half());
                    if halfs {
                        half += bytes;
                    } else if node
                        .outputs
                        .iter()
                        .any(|t| t.dense_type().dtype == DType::F32)
                    {
                        full += bytes;
                    }
                }
            }
        }
        let _ = writeln!(
            s,
            "precision: {precision} (pass mixed_precision; {casts} casts down): variables \
             stay f32 masters ({}), cast each step to 16-bit copies ({}); values a step \
             makes: {} in 16 bits, {} in f32; gradients reach the optimizer in f32",
            mib(masters as f64),
            mib(copies as f64),
            mib(half as f64),
            mib(full as f64)
        );
        if precision == Precision::Fp16 {
            let _ = writeln!(
                s,
                "loss scaling: dynamic, from 2^16: a step whose gradients overflow is \
                 skipped on every worker and halves it; 2000 finite steps double it"
            );
        }
    }
    if wire != Precision::Fp32 {
        let _ = writeln!(
            s,
            "gradient wire: {wire}: each dense all-reduce sends 16-bit values (each \
             worker's divided by N first, sums accumulated in f32), half the bytes of f32"
        );
    }
    s
}

/// A mesh with a model axis: how ranks map to coordinates, each split variable, each
/// model-axis collective with the bytes a worker sends for it per step. Empty for
/// other plans.
fn explain_mesh(p: &Plan, worker: &distc_ir::Graph) -> String {
    use distc_passes::tensor_parallel::{self as tp, MODEL_SHARD_SUFFIX};
    use std::fmt::Write as _;
    let t = p.settings.model;
    if t <= 1 {
        return String::new();
    }
    let pipe = p.settings.pipeline.max(1);
    let d = p.settings.data_workers();
    let mut s = if pipe > 1 {
        format!(
            "mesh: data={d} x model={t} x pipe={pipe} ({} workers): worker w is model rank \
             w % {t} of stage (w / {t}) % {pipe} of data rank w / {}; the model axis links the \
             workers of one stage of one replica, the pipeline the stages of one model rank of \
             one replica, the data axis one stage's model rank across replicas\n",
            p.settings.workers,
            t * pipe
        )
    } else {
        format!(
            "mesh: data={d} x model={t} ({} workers): worker w is model rank w % {t} of data \
             rank w / {t}; the data axis links the workers of one model rank, the model axis \
             those of one data rank\n",
            p.settings.workers
        )
    };
    let _ = writeln!(
        s,
        "model axis: variables split (the model's shard marks and --shard, else the \
         Megatron rule's pairs of matmuls)"
    );
    let _ = writeln!(
        s,
        "  {:<10} {:<16} {:>5} {:<16} {:>12}",
        "variable", "whole", "dim", "per worker", "bytes"
    );
    for (_, name, ty) in worker.params() {
        let Some(var) = name.strip_suffix(MODEL_SHARD_SUFFIX) else {
            continue;
        };
        let dim = p.settings.shard.get(var).copied();
        let mut whole = ty.dims().to_vec();
        if let Some(k) = dim {
            whole[k] *= t;
        }
        let dims = |d: &[usize]| {
            format!(
                "[{}]",
                d.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            )
        };
        let _ = writeln!(
            s,
            "  {:<10} {:<16} {:>5} {:<16} {:>12}",
            var,
            dims(&whole),
            dim.map_or("-".into(), |k| k.to_string()),
            dims(ty.dims()),
            mib(ty.bytes() as f64)
        );
    }
    let _ = writeln!(s, "model-axis collectives per step (worker program):");
    let mut total = 0.0;
    for id in worker.topo_order() {
        if !worker.op(id).is_model_collective() {
            continue;
        }
        let bytes = tp::sent_bytes(worker, id);
        total += bytes;
        let ty = worker.tensor_type(worker.node(id).inputs[0]);
        let _ = writeln!(
            s,
            "  {id:<6} {:<36} {:<18} sends {:>12}",
            worker.op(id).to_string(),
            ty.to_string(),
            mib(bytes)
        );
    }
    let _ = writeln!(
        s,
        "predicted model-axis bytes per step per worker: {} ({total:.0} bytes)",
        mib(total)
    );
    s
}

/// Per pipeline stage: what it holds, its FLOPs, the activations it stashes, the
/// bytes it exchanges, and the bubble its schedule predicts. Empty for other plans.
fn explain_pipeline(
    p: &Plan,
    worker: &distc_ir::Graph,
    program: Option<&distc_ir::pipeline::PipelineProgram>,
) -> Result<String> {
    use distc_ir::pipeline::schedule;
    use std::fmt::Write as _;
    let stages = p.settings.pipeline;
    if stages <= 1 {
        return Ok(String::new());
    }
    let micro = p.settings.micro_batches;
    let kind = p.settings.schedule;
    let plan = distc_passes::pipeline::stages::partition_with(
        worker,
        stages,
        p.settings.stage_marks.as_ref(),
    )?;
    let forward: Vec<f64> = plan.stats.iter().map(|st| st.forward_flops).collect();
    let backward: Vec<f64> = plan.stats.iter().map(|st| st.backward_flops).collect();
    let sim = schedule::simulate(
        &schedule::programs(kind, stages, micro)?,
        &forward,
        &backward,
    )?;
    let mut s = format!(
        "pipeline: {stages} stages x {micro} micro-batches of {} ({kind}); bubble predicted \
         (P-1)/(M+P-1) = {:.1}%, {:.1}% with these stages' FLOPs\n",
        p.config.batch,
        100.0 * schedule::predicted_bubble(stages, micro),
        100.0 * sim.bubble
    );
    let replicas = p.settings.data_workers();
    if replicas > 1 {
        let _ = writeln!(
            s,
            "replicas: {replicas} ({} workers / {stages} stages{}); each stage all-reduces its \
             gradients among its replicas once a step (a ring sends 2(R-1)/R of them: {})",
            p.settings.workers,
            if p.settings.model > 1 {
                format!(" / {} model ranks", p.settings.model)
            } else {
                String::new()
            },
            plan.stats
                .iter()
                .map(
                    |st| mib(st.param_bytes as f64 * 2.0 * (replicas - 1) as f64 / replicas as f64)
                )
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(
        s,
        "{:<6} {:>10} {:>11} {:>11} {:>12} {:>9} {:>12} {:>12} {:>13} {:>13}  variables",
        "stage",
        "params",
        "fwd MFLOP",
        "bwd MFLOP",
        "stash/micro",
        "in flight",
        "peak stash",
        "activations",
        "p2p sent/step",
        "p2p recv/step"
    );
    // A tied variable goes from its first stage to the others once a step.
    let (mut tied_sent, mut tied_received) = (vec![0usize; stages], vec![0usize; stages]);
    let var_bytes: std::collections::HashMap<String, usize> = worker
        .params()
        .into_iter()
        .map(|(_, n, t)| (n.to_string(), t.bytes()))
        .collect();
    for (name, held) in &plan.tied {
        let bytes = var_bytes.get(name).copied().unwrap_or(0);
        if let Some((&owner, rest)) = held.split_first() {
            tied_sent[owner] += bytes * rest.len();
            for &h in rest {
                tied_received[h] += bytes;
            }
        }
    }
    // A stage's activations at their peak: the larger of its forward's and backward's
    // own peak, beside the stash of the micro-batches in flight (what the metrics'
    // per-stage `activations` measure).
    let own_peak = |k: usize| -> usize {
        program.and_then(|pr| pr.stages.get(k)).map_or(0, |st| {
            [&st.forward, &st.backward]
                .iter()
                .map(|g| {
                    distc_passes::remat::peak_activation_bytes_without_gradients(g, &g.topo_order())
                })
                .max()
                .unwrap_or(0)
        })
    };
    for (k, st) in plan.stats.iter().enumerate() {
        let in_flight = sim.peak_alive.get(k).copied().unwrap_or(micro);
        let _ = writeln!(
            s,
            "{:<6} {:>10} {:>11.2} {:>11.2} {:>12} {:>9} {:>12} {:>12} {:>13} {:>13}  {}",
            k,
            mib(st.param_bytes as f64),
            st.forward_flops / 1e6,
            st.backward_flops / 1e6,
            mib(st.stashed_bytes as f64),
            in_flight,
            mib((st.stashed_bytes * in_flight) as f64),
            mib((st.stashed_bytes * in_flight + own_peak(k)) as f64),
            mib((st.sent_bytes * micro + tied_sent[k]) as f64),
            mib((st.received_bytes * micro + tied_received[k]) as f64),
            st.variables.join(" ")
        );
    }
    for (name, held) in &plan.tied {
        if let Some((owner, rest)) = held.split_first() {
            let _ = writeln!(
                s,
                "tied: `{name}` is read on stages {held:?}: stage {owner} sums every stage's \
                 gradient of it and updates it, then sends it to stage(s) {rest:?} after each \
                 step ({} each)",
                mib(var_bytes.get(name).copied().unwrap_or(0) as f64)
            );
        }
    }
    Ok(s)
}

/// The explain table: one row per variable, then totals.
fn explain_table(p: &Plan, mem: &memory::MemoryEstimate) -> String {
    use std::fmt::Write as _;
    let mut s = format!(
        "plan {} ({}): strategy {}, {} workers, {} servers, batch {} per worker\n",
        p.model,
        p.source,
        p.strategy.name(),
        p.settings.workers,
        p.settings.servers,
        p.config.batch
    );
    let _ = writeln!(
        s,
        "memory (estimate, {} steps): {}",
        p.config.steps,
        mem.describe()
    );
    let _ = writeln!(
        s,
        "{:<10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
        "memory", "params", "gradients", "optimizer", "activations", "buckets", "total"
    );
    let row = |name: String, m: &memory::MemoryByCategory| {
        format!(
            "{name:<10} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
            mib(m.params as f64),
            mib(m.gradients as f64),
            mib(m.optimizer as f64),
            mib(m.activations as f64),
            mib(m.comm_buffers as f64),
            mib(m.total() as f64)
        )
    };
    s += &row("worker".into(), &mem.worker);
    for (i, m) in mem.servers.iter().enumerate() {
        s += &row(format!("server {i}"), m);
    }
    let Some(d) = &p.dist else {
        s += "one device: no communication\n";
        return s;
    };
    let _ = writeln!(
        s,
        "{:<8} {:<14} {:>10} {:<6} {:>8} {:<28} {:>6} {:>12}  runner-up",
        "variable", "shape", "bytes", "kind", "density", "placement", "bucket", "bytes/step",
    );
    for v in &d.vars {
        let shape: Vec<String> = v.shape.iter().map(|x| x.to_string()).collect();
        let _ = writeln!(
            s,
            "{:<8} {:<14} {:>10} {:<6} {:>7.2}% {:<28} {:>6} {:>12}  {}",
            v.name,
            format!("[{}]", shape.join(",")),
            mib(v.bytes as f64),
            format!("{:?}", v.kind).to_lowercase(),
            v.density * 100.0,
            placement_text(v),
            v.bucket.map_or("-".into(), |b| b.to_string()),
            mib(v.predicted_bytes_per_step),
            v.runner_up.map_or("-".into(), |r| format!(
                "{} {}",
                r.placement.name(),
                mib(r.predicted_bytes_per_step)
            )),
        );
    }
    for b in &d.buckets {
        let _ = writeln!(
            s,
            "bucket {}: {} ({})",
            b.id,
            b.vars.join(", "),
            mib(b.bytes as f64)
        );
    }
    if !d.unreached.is_empty() {
        let _ = writeln!(
            s,
            "no gradient reaches: {} (no bucket, no traffic)",
            d.unreached.join(", ")
        );
    }
    for v in d
        .vars
        .iter()
        .filter(|v| v.kind == distc_passes::placement::Kind::Sparse)
    {
        let _ = writeln!(
            s,
            "{}: {:.1} rows per step ({}); {}",
            v.name, v.rows_touched, v.rows_source, v.reason
        );
    }
    let total: usize = d.vars.iter().map(|v| v.bytes).sum();
    let _ = writeln!(
        s,
        "total: {} of variables; predicted {} per step per worker ({:.0} bytes)",
        mib(total as f64),
        mib(d.predicted_bytes_per_step_per_worker()),
        d.predicted_bytes_per_step_per_worker()
    );
    s
}

/// The explain JSON (the table's content, for programs).
fn explain_json(p: &Plan, mem: &memory::MemoryEstimate) -> serde_json::Value {
    serde_json::json!({
        "model": p.model,
        "strategy": p.strategy.name(),
        "workers": p.settings.workers,
        "servers": p.settings.servers,
        "batch_per_worker": p.config.batch,
        "variables": p.dist.as_ref().map(|d| d.vars.clone()).unwrap_or_default(),
        "buckets": p.dist.as_ref().map(|d| d.buckets.clone()).unwrap_or_default(),
        "unreached": p.dist.as_ref().map(|d| d.unreached.clone()).unwrap_or_default(),
        "predicted_bytes_per_step_per_worker": p.dist.as_ref().map_or(0.0, |d| d.predicted_bytes_per_step_per_worker()),
        "memory": {
            "worker": mem.worker,
            "servers": mem.servers,
            "data": mem.data as u64,
            "eval": mem.eval as u64,
            "per_worker": mem.per_worker() as u64,
            "in_process_total": mem.in_process_total() as u64,
        },
    })
}
