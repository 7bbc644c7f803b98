//! The `distc` command line: the commands and their flags, parsed, and each command
//! handed to the library ([`distc::commands`]), which does its work and printing. What
//! is left here is how the process ends: the error's text and the exit status.

use anyhow::Result;
use clap::{Parser, Subcommand};
use distc::cli::{
    at_least_one, batch_size, non_negative_finite, parse_calibration_flag, parse_device,
    parse_link, profile_steps, timeout_secs, BenchArgs, CompileArgs, Device, ExplainFormat,
    LinkKind, RunArgs, Transport, WeightsArgs,
};
use distc::commands;
use distc::console::err;
use distc::limits::SAMPLE_BYTES;
use distc_runtime::RuntimeError;
use std::path::PathBuf;

/// distc: write a model once for one device; compile, inspect and train it.
#[derive(Parser)]
#[command(name = "distc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
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
        /// finite number of at least 0. Given, it decides alone; by default 1e-4, raised
        /// under 16 bits to the types' own tolerance plus twice the precision's effect
        /// (each variable's allowance is printed).
        #[arg(long, value_parser = non_negative_finite, allow_negative_numbers = true)]
        tolerance: Option<f64>,
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
        /// Both sides start from the weights of this safetensors FILE, by variable name
        /// (as `train --init`); the file and the model must name the same variables.
        #[arg(long, value_name = "FILE")]
        init: Option<PathBuf>,
    },
    /// Benchmark the standard workloads (WORKLOADS.md): each strategy with 1, 2 and 4
    /// workers; 10 warm-up and 50 timed steps, median of 3 runs. With --compile:
    /// compile time of generated deep MLPs of 10k, 30k and 100k nodes instead.
    Bench {
        #[command(flatten)]
        bench: BenchArgs,
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
    /// Train a model as MPI ranks under a supervisor: when a rank is lost (killed, or
    /// crashed), mpirun is started again with one worker fewer, from the last state in
    /// the --state folder (sharded, written every --checkpoint-every steps). Example:
    /// `distc launch --workers 4 --state run.state -- examples/lm.dsl --strategy
    /// allreduce --steps 1000`
    Launch {
        #[command(flatten)]
        launch: distc::cli::LaunchArgs,
        /// `train`'s arguments: the model and its flags.
        #[arg(last = true, required = true, value_name = "TRAIN ARGS")]
        train: Vec<String>,
    },
    /// Evaluate trained weights on the model's held-out data, without training: prints
    /// the metrics and, with --metrics, writes them as one JSON line.
    Eval {
        /// The model (.dsl).
        file: PathBuf,
        #[command(flatten)]
        weights: WeightsArgs,
        /// The data directory (default: DISTC_DATA).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
        /// Samples per evaluation batch (default: the train block's batch).
        #[arg(long, value_parser = batch_size, value_name = "N")]
        batch: Option<usize>,
        /// Evaluate on at most N samples (default: the train block's eval_samples).
        #[arg(long, value_parser = at_least_one, value_name = "N")]
        eval_samples: Option<usize>,
        /// Write the metrics as one JSON line to FILE.
        #[arg(long, value_name = "FILE")]
        metrics: Option<PathBuf>,
        /// Print nothing but errors (as `train -q`); --metrics still writes its line.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Write the model's `prediction` for every sample of a file of inputs, as
    /// safetensors.
    Predict {
        /// The model (.dsl).
        file: PathBuf,
        #[command(flatten)]
        weights: WeightsArgs,
        /// The inputs: a safetensors file holding an array per model input, by name,
        /// the samples along the first axis (an input only the loss reads, a label,
        /// may be left out).
        #[arg(long, value_name = "FILE")]
        input: PathBuf,
        /// Where to write the predictions (the tensor `prediction`, one row a sample).
        #[arg(long, short, value_name = "FILE")]
        output: PathBuf,
        /// Samples per batch (default: the train block's batch).
        #[arg(long, value_parser = batch_size, value_name = "N")]
        batch: Option<usize>,
    },
    /// Print the text IR of a model after a pass (default: after the last).
    Ir {
        /// The model (.dsl).
        file: PathBuf,
        /// Stop after this pass (default: after the last). With the strategy flags
        /// (`--strategy allreduce --workers 2`, `--mesh`, `--zero 1`, ...) the
        /// distributed programs after it: the worker's, then each other one.
        #[arg(long, value_name = "PASS", conflicts_with = "stop_after")]
        after: Option<String>,
        #[command(flatten)]
        compile: CompileArgs,
        /// Data directory, read to measure how many embedding rows a batch touches
        /// (default: $DISTC_DATA).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
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
    /// `distc calibrate`). Every plan: data-parallel (all-reduce, servers, ZeRO), a
    /// mesh with a model axis, and pipeline stages.
    Simulate {
        /// The plan written by `distc compile` (its model is compiled again for the
        /// target's workers, nodes and links).
        plan: PathBuf,
        /// Data-parallel workers to simulate (default: the plan's).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
        workers: Option<u32>,
        /// Parameter servers to simulate (default: the plan's); ps, hybrid and auto.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
        servers: Option<u32>,
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
        /// Steps of the profiling run on one worker (the first ones left out), 1 to 1000.
        #[arg(long, default_value_t = 6, value_parser = profile_steps)]
        profile_steps: usize,
        /// Take op times from worker 0 of this trace instead of profiling one worker:
        /// a trace of the plan (`distc run PLAN --trace FILE`) or of its model on one
        /// device with the plan's batch (`distc train MODEL --batch B --trace FILE`).
        #[arg(long, value_name = "TRACE.json")]
        trace: Option<PathBuf>,
        /// The workers of a node share the cores of a machine like this one (ranks or
        /// threads here): each op is priced slower by how many of them compute at once,
        /// as the layout search prices them. Not with a GPU's trace.
        #[arg(long)]
        shared_cores: bool,
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
        /// Ranks of the in-process ring (2 to 256 threads; default 2). Under
        /// `--transport mpi` the ring is mpirun's ranks.
        #[arg(long, value_parser = clap::value_parser!(u16).range(2..=256))]
        workers: Option<u16>,
        /// Buffer sizes in bytes, each 4 to 1 GiB, 2 or more, each once (default: 4 KiB
        /// to 64 MiB, by 4x: as large as buckets).
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(
            *SAMPLE_BYTES.start() as i64..=*SAMPLE_BYTES.end() as i64))]
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
        /// Draw the loss panels (training and eval loss) on a log y axis; values at or
        /// below 0 are left out, and counted in a note. Without it a loss panel goes to
        /// a log axis by itself when a run diverged: all its values are positive and
        /// the largest is over 1000x the smallest, or a run's loss rose above 10x its
        /// first value.
        #[arg(long)]
        log_y: bool,
    },
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

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its `mi_option_e`, the same in v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps freed memory with the process, as `warm_allocator` does for glibc's malloc:
/// a step frees its buffers at its end and the next one allocates them again. mimalloc
/// returned the freed pages to the OS (a purge), so every step faulted them in again,
/// zeroed (measured: 270 page faults a step of dense_mlp on 4 workers, 5-16% of the
/// run). A purge delay of -1 never purges. `MIMALLOC_PURGE_DELAY` still decides where
/// it is set.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets one of mimalloc's tuning options to a value its header allows
        // (-1: never purge), before any thread but this one exists.
        #[allow(unsafe_code)]
        unsafe {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
    }
}

fn main() {
    // Before anything allocates (data is loaded before the first executor exists) and
    // before any thread starts, so every block follows the same malloc settings.
    keep_freed_memory();
    distc_runtime::cpu::warm_allocator();
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli.command) {
        err(&format!("error: {}\n", error_chain(&e)));
        std::process::exit(exit_code(&e));
    }
}

/// The status distc exits with after `e`, chosen by the runtime error's kind where
/// there is one ([`RuntimeError::exit_code`]: 130 for a run stopped by Ctrl-C), else 1.
fn exit_code(e: &anyhow::Error) -> i32 {
    e.chain()
        .find_map(|cause| cause.downcast_ref::<RuntimeError>())
        .map_or(1, RuntimeError::exit_code)
}

fn dispatch(command: Command) -> Result<()> {
    match command {
        Command::Compile {
            file,
            compile,
            output,
            data,
        } => commands::compile(&file, &compile, &output, data.as_deref()),
        Command::Verify {
            file,
            compile,
            steps,
            tolerance,
            data,
            timeout,
            transport,
            device,
            init,
        } => commands::run::verify(
            &file,
            &compile,
            steps,
            tolerance,
            data.as_deref(),
            timeout,
            transport,
            device,
            init.as_deref(),
        ),
        Command::Bench { bench } => commands::bench(&bench),
        Command::Explain { plan, format } => commands::explain(&plan, format),
        Command::Simulate {
            plan,
            workers,
            servers,
            ranks_per_node,
            link,
            calibration,
            profile_steps,
            trace,
            shared_cores,
            data,
            format,
        } => commands::simulate::simulate(
            &plan,
            workers.map(|n| n as usize),
            servers.map(|n| n as usize),
            ranks_per_node.map(|n| n as usize),
            &link,
            &calibration,
            profile_steps,
            (trace.as_deref(), shared_cores),
            data.as_deref(),
            format,
        ),
        Command::Calibrate {
            transport,
            workers,
            sizes,
            reps,
            timeout,
            output,
        } => commands::simulate::calibrate(
            transport,
            workers,
            sizes.into_iter().map(|b| b as usize).collect(),
            reps.into(),
            timeout,
            output.as_deref(),
        ),
        Command::Run { plan, run } => commands::run::run(&plan, &run),
        Command::Train { file, compile, run } => commands::run::train(&file, &compile, &run),
        Command::Launch { launch, train } => distc::commands::launch::launch(&launch, &train),
        Command::Ir {
            file,
            after,
            compile,
            data,
        } => commands::ir(&file, after, &compile, data.as_deref()),
        Command::Dot { file, after, batch } => commands::dot(&file, after, batch),
        Command::Eval {
            file,
            weights,
            data,
            batch,
            eval_samples,
            metrics,
            quiet,
        } => commands::eval::eval(
            &file,
            &weights.weights(),
            data.as_deref(),
            batch,
            eval_samples,
            metrics.as_ref(),
            quiet,
        ),
        Command::Predict {
            file,
            weights,
            input,
            output,
            batch,
        } => commands::eval::predict(&file, &weights.weights(), &input, &output, batch),
        Command::Plot {
            files,
            output,
            labels,
            log_y,
        } => commands::plot(&files, &output, &distc::plot::PlotOptions { labels, log_y }),
    }
}
