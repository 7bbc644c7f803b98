//! The `distc` command line.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use distc::{compile_file, CompileError, CompileOptions, Compiled, Plan};
use distc_passes::placement::{Mechanism, Strategy as StrategyKind, StrategyConfig, SyncMode};
use distc_runtime::distributed::{chrome_trace, train_distributed, DistOptions};
use distc_runtime::metrics::StepMetrics;
use distc_runtime::ps::PsSync;
use distc_runtime::train::{train, TrainOptions};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

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
        /// Where to write the plan.
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
        /// Steps to train before comparing.
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// Largest relative difference allowed (max |a-b| / max |a|, per variable).
        #[arg(long, default_value_t = 1e-4)]
        tolerance: f64,
        /// Data directory (default: $DISTC_DATA).
        #[arg(long, value_name = "DIR")]
        data: Option<PathBuf>,
    },
    /// Benchmark the standard workloads (WORKLOADS.md): each strategy with 1, 2 and 4
    /// workers; 10 warm-up and 50 timed steps, median of 3 runs.
    Bench {
        /// Workloads: sparse_lm, dense_mlp.
        #[arg(long, value_delimiter = ',', default_values_t = ["sparse_lm".to_string(), "dense_mlp".to_string()])]
        workloads: Vec<String>,
        /// Strategies: single, allreduce, allreduce_dense (sparse gradients densified:
        /// all-reduce everything), ps, hybrid, auto.
        #[arg(long, value_delimiter = ',', default_values_t = ["single".to_string(), "allreduce_dense".to_string(), "allreduce".to_string(), "hybrid".to_string(), "ps".to_string()])]
        strategies: Vec<String>,
        /// Worker counts.
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
        workers: Vec<usize>,
        /// Runs per configuration (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Warm-up steps.
        #[arg(long, default_value_t = 10)]
        warmup: usize,
        /// Timed steps.
        #[arg(long, default_value_t = 50)]
        steps: usize,
        /// Write the rows as JSON to FILE.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// Explain a plan: where each variable went, buckets, predicted bytes per step.
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
        /// Stop after this pass: lower, autodiff, simplify, dead_code.
        #[arg(long, value_name = "PASS")]
        after: Option<String>,
        /// Bind the batch dimension B to this instead of the train block's batch.
        #[arg(long)]
        batch: Option<usize>,
    },
    /// Print the graph in Graphviz DOT (pipe into `dot -Tsvg`).
    Dot {
        /// The model (.dsl).
        file: PathBuf,
        /// Stop after this pass (default: after the last).
        #[arg(long, value_name = "PASS")]
        after: Option<String>,
        /// Bind the batch dimension B to this instead of the train block's batch.
        #[arg(long)]
        batch: Option<usize>,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
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

#[derive(Args)]
struct CompileArgs {
    /// Distribution strategy.
    #[arg(long, value_enum, default_value = "single")]
    strategy: Strategy,
    /// Write the IR after every pass into DIR, one numbered file per pass.
    #[arg(long, value_name = "DIR")]
    dump_ir: Option<PathBuf>,
    /// Stop the pipeline after this pass.
    #[arg(long, value_name = "PASS")]
    stop_after: Option<String>,
    /// Skip a pass (repeatable).
    #[arg(long, value_name = "PASS")]
    disable_pass: Vec<String>,
    /// Bind the batch dimension B to this instead of the train block's batch.
    #[arg(long)]
    batch: Option<usize>,
    /// Worker count N (data-parallel replicas).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    workers: u64,
    /// Parameter-server count S.
    #[arg(long, default_value_t = 0)]
    servers: usize,
    /// Parameter-server synchronisation: sync, async or stale:K.
    #[arg(long, default_value = "sync", value_parser = parse_sync)]
    sync: SyncMode,
    /// Bucket size cap for fused all-reduces, MiB.
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
    /// All-reduce sparse gradients as dense tensors instead of all-gathering their rows.
    #[arg(long)]
    sparse_as_dense: bool,
    /// Link bandwidth for the cost model, bytes/s (default: 10 Gbit/s).
    #[arg(long, default_value_t = 1.25e9)]
    bandwidth: f64,
    /// Latency per message for the cost model, seconds.
    #[arg(long, default_value_t = 25e-6)]
    latency: f64,
}

#[derive(Args)]
struct RunArgs {
    /// Override the number of training steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Write per-step metrics as JSON lines to FILE.
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
    /// Data directory (default: $DISTC_DATA).
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Save the trained variables to FILE (safetensors).
    #[arg(long, value_name = "FILE")]
    save: Option<PathBuf>,
    /// No progress bar and no summary.
    #[arg(long, short)]
    quiet: bool,
    /// Write a Chrome trace (open in Perfetto) of a distributed run to FILE: per worker
    /// a track of its steps and IR nodes and a track of its collectives; per server a
    /// track of the pulls, pushes and updates it handled.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Draw every step's batch before the first step, so step times and samples/s
    /// measure training alone (as `distc bench` does).
    #[arg(long)]
    preload: bool,
    /// Print where the step time went (worker 0 of a distributed run): kernel time per
    /// op, the optimizer, communication waits and the executor's own work.
    #[arg(long)]
    profile: bool,
}

fn strategy_config(a: &CompileArgs) -> StrategyConfig {
    StrategyConfig {
        strategy: match a.strategy {
            Strategy::Single => StrategyKind::Single,
            Strategy::Allreduce => StrategyKind::Allreduce,
            Strategy::Ps => StrategyKind::Ps,
            Strategy::Hybrid => StrategyKind::Hybrid,
            Strategy::Auto => StrategyKind::Auto,
        },
        workers: a.workers as usize,
        servers: a.servers,
        sync: a.sync,
        bucket_mb: a.bucket_mb,
        sparse_as_dense: a.sparse_as_dense,
        bandwidth: a.bandwidth,
        latency: a.latency,
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
                eprintln!("{:?}", miette::Report::new(*e));
            } else {
                eprintln!("{}", e.render_plain());
            }
            bail!("could not compile {}", file.display())
        }
        Err(e) => Err(e.into()),
    }
}

/// What a run of either kind produced, for the summary and `--save`.
struct RunSummary {
    steps: usize,
    first_loss: f64,
    final_loss: f64,
    train_time: f64,
    samples_per_sec: f64,
    eval: Option<distc_runtime::metrics::EvalMetrics>,
    params: std::collections::HashMap<String, distc_runtime::Tensor>,
    profile: Option<distc_runtime::metrics::Profile>,
}

fn ps_sync(s: SyncMode) -> PsSync {
    match s {
        SyncMode::Sync => PsSync::Sync,
        SyncMode::Async => PsSync::Async,
        SyncMode::Stale(k) => PsSync::Stale(k),
    }
}

/// Trains a plan: one device, or its workers and servers as threads of this process.
fn train_plan(
    plan: &Plan,
    graph: &distc_ir::Graph,
    args: &RunArgs,
    global_data: bool,
    on_step: &mut dyn FnMut(&StepMetrics) -> distc_runtime::Result<()>,
) -> Result<RunSummary> {
    if plan.strategy == "single" {
        if let Some(path) = &args.trace {
            bail!(
                "--trace {}: traces are of distributed runs (workers, collectives, servers); \
                 for where one device's step time goes use --profile",
                path.display()
            );
        }
        let opts = TrainOptions {
            steps: args.steps,
            data_dir: args.data.clone(),
            global_data,
            preload: args.preload,
            profile: args.profile,
        };
        let r = train(graph, &plan.config, &opts, on_step)?;
        return Ok(RunSummary {
            steps: r.steps,
            first_loss: r.first_loss,
            final_loss: r.final_loss,
            train_time: r.train_time.as_secs_f64(),
            samples_per_sec: r.samples_per_sec,
            eval: r.eval,
            params: r.params,
            profile: r.profile,
        });
    }
    let parse =
        |text: &String| distc_ir::parse(text).map_err(|e| anyhow::anyhow!("plan program: {e}"));
    let init = plan.init.as_ref().map(parse).transpose()?;
    let servers = plan.servers.iter().map(parse).collect::<Result<Vec<_>>>()?;
    let opts = DistOptions {
        workers: plan.settings.workers,
        sync: ps_sync(plan.settings.sync),
        steps: args.steps,
        data_dir: args.data.clone(),
        global_data,
        trace: args.trace.is_some(),
        preload: args.preload,
        profile: args.profile,
    };
    let r = train_distributed(graph, init.as_ref(), &servers, &plan.config, &opts, on_step)?;
    if let Some(path) = &args.trace {
        let text = serde_json::to_string(&chrome_trace(&r.spans))?;
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(RunSummary {
        steps: r.steps,
        first_loss: r.first_loss,
        final_loss: r.final_loss,
        train_time: r.train_time.as_secs_f64(),
        samples_per_sec: r.samples_per_sec,
        eval: None,
        params: r.params,
        profile: r.profile,
    })
}

fn run_plan(plan: &Plan, graph: &distc_ir::Graph, args: &RunArgs) -> Result<RunSummary> {
    let steps = args.steps.unwrap_or(plan.config.steps);
    let mut metrics = match &args.metrics {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => None,
    };
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
    let mut on_step = |m: &StepMetrics| -> distc_runtime::Result<()> {
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
        Ok(())
    };
    // Synchronous plans read one global stream sliced by rank, so the workers together
    // see the batches one device of batch N*b would (WORKLOADS.md's seed + rank streams
    // have the same distribution); asynchronous ones give each worker its own stream.
    let global = plan.strategy != "single" && plan.settings.sync == SyncMode::Sync;
    let report = train_plan(plan, graph, args, global, &mut on_step)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(mut w) = metrics {
        w.flush().context("cannot write the metrics file")?;
    }
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
        distc_runtime::checkpoint::save(path, &named, meta)?;
    }
    if !args.quiet {
        let mut line = format!(
            "{} ({}, {} workers): {} steps in {:.1} s, loss {:.4} -> {:.4}, {:.0} samples/s",
            plan.model,
            plan.strategy,
            plan.settings.workers,
            report.steps,
            report.train_time,
            report.first_loss,
            report.final_loss,
            report.samples_per_sec
        );
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
        println!("{line}");
    }
    if let Some(p) = &report.profile {
        print!("{}", p.render());
    }
    Ok(report)
}

/// `distc verify`: one device with batch N*b against the strategy with N workers of
/// batch b, same data and seed; every variable compared after K steps.
fn verify_cmd(
    file: &Path,
    compile: &CompileArgs,
    steps: usize,
    tolerance: f64,
    data: Option<&Path>,
) -> Result<()> {
    let dist_opts = compile_opts(compile, data);
    if !matches!(dist_opts.strategy.sync, SyncMode::Sync) {
        bail!("verify compares synchronous strategies with one device; --sync {:?} is not synchronous", dist_opts.strategy.sync);
    }
    let dist = compile_or_report(file, &dist_opts)?;
    let n = dist_opts.strategy.workers;
    let single_opts = CompileOptions {
        batch: Some(dist.config.batch * n),
        ..Default::default()
    };
    let single = compile_or_report(file, &single_opts)?;
    let args = RunArgs {
        steps: Some(steps),
        metrics: None,
        data: data.map(Path::to_path_buf),
        save: None,
        quiet: true,
        trace: None,
        preload: false,
        profile: false,
    };
    let source = file.display().to_string();
    let one = train_plan(
        &Plan::new(&single, &source, &single_opts.strategy),
        &single.graph,
        &args,
        true,
        &mut |_| Ok(()),
    )?;
    let many = train_plan(
        &Plan::new(&dist, &source, &dist_opts.strategy),
        &dist.graph,
        &args,
        true,
        &mut |_| Ok(()),
    )?;
    let mut worst: Option<(String, f64)> = None;
    let mut names: Vec<&String> = one.params.keys().collect();
    names.sort();
    for name in names {
        let a = one.params[name].to_f64_vec();
        let b = many
            .params
            .get(name)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "the {} run has no variable `{name}`",
                    dist_opts.strategy.strategy.name()
                )
            })?
            .to_f64_vec();
        let scale = a.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-12);
        let err = a
            .iter()
            .zip(&b)
            .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
            / scale;
        println!(
            "  {name:<10} max |one device - {}| / max |w| = {err:.2e}",
            dist_opts.strategy.strategy.name()
        );
        if worst.as_ref().is_none_or(|(_, w)| err > *w) {
            worst = Some((name.clone(), err));
        }
    }
    let (name, err) = worst.ok_or_else(|| anyhow::anyhow!("the model has no variables"))?;
    println!(
        "verify {}: {} with {n} workers vs one device with batch {}, {steps} steps: largest relative error {err:.2e} (`{name}`), tolerance {tolerance:.0e}",
        file.display(),
        dist_opts.strategy.strategy.name(),
        dist.config.batch * n
    );
    if err > tolerance {
        bail!("`{name}` differs by {err:.2e} (relative), beyond the tolerance {tolerance:.0e}");
    }
    Ok(())
}

fn main() {
    // Before anything allocates (data is loaded before the first executor exists) and
    // before any thread starts, so every block follows the same malloc settings.
    distc_runtime::exec::warm_allocator();
    let cli = Cli::parse();
    if let Err(e) = real_main(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
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
            let start = std::time::Instant::now();
            let c = compile_or_report(&file, &compile_opts(&compile, data.as_deref()))?;
            let plan = Plan::new(&c, &file.display().to_string(), &strategy_config(&compile));
            plan.save(&output)?;
            for r in &c.records {
                eprintln!(
                    "  {:<18} {:>5} -> {:>5} nodes  {}",
                    r.name, r.nodes.0, r.nodes.1, r.stats
                );
            }
            if let Some(m) = &c.measurement {
                eprintln!("  sparsity {m}");
            }
            eprintln!(
                "wrote {} ({} nodes, {} server programs) in {:.2} s",
                output.display(),
                c.graph.node_count(),
                c.server_programs.len(),
                start.elapsed().as_secs_f64()
            );
        }
        Command::Verify {
            file,
            compile,
            steps,
            tolerance,
            data,
        } => verify_cmd(&file, &compile, steps, tolerance, data.as_deref())?,
        Command::Bench {
            workloads,
            strategies,
            workers,
            runs,
            warmup,
            steps,
            json,
        } => {
            let dir = std::env::temp_dir().join(format!("distc-bench-{}", std::process::id()));
            let settings = distc::bench::BenchSettings {
                workloads,
                strategies,
                workers,
                runs,
                warmup,
                steps,
                dir,
            };
            let rows = distc::bench::run(&settings)?;
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
                    .with_context(|| format!("cannot write {}", path.display()))?;
            }
        }
        Command::Explain { plan, format } => {
            let (p, _) = Plan::load(&plan)?;
            match format {
                ExplainFormat::Json => {
                    println!("{}", serde_json::to_string_pretty(&explain_json(&p))?)
                }
                ExplainFormat::Table => print!("{}", explain_table(&p)),
            }
        }
        Command::Run { plan, run } => {
            let (p, graph) = Plan::load(&plan)?;
            run_plan(&p, &graph, &run)?;
        }
        Command::Train { file, compile, run } => {
            let c = compile_or_report(&file, &compile_opts(&compile, run.data.as_deref()))?;
            let plan = Plan::new(&c, &file.display().to_string(), &strategy_config(&compile));
            run_plan(&plan, &c.graph, &run)?;
        }
        Command::Ir { file, after, batch } => {
            print!(
                "{}",
                distc_ir::print(&compile_until(&file, after, batch)?.graph)
            );
        }
        Command::Dot { file, after, batch } => {
            print!(
                "{}",
                distc_ir::dot::to_dot(&compile_until(&file, after, batch)?.graph)
            );
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

/// The explain table: one row per variable, then totals.
fn explain_table(p: &Plan) -> String {
    use std::fmt::Write as _;
    let mut s = format!(
        "plan {} ({}): strategy {}, {} workers, {} servers, batch {} per worker\n",
        p.model, p.source, p.strategy, p.settings.workers, p.settings.servers, p.config.batch
    );
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
            v.runner_up
                .map_or("-".into(), |(m, b)| format!("{} {}", m.name(), mib(b))),
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
fn explain_json(p: &Plan) -> serde_json::Value {
    let vars: Vec<serde_json::Value> = p
        .dist
        .iter()
        .flat_map(|d| &d.vars)
        .map(|v| {
            serde_json::json!({
                "name": v.name,
                "shape": v.shape,
                "bytes": v.bytes,
                "kind": v.kind,
                "density": v.density,
                "rows_touched": v.rows_touched,
                "rows_source": v.rows_source,
                "placement": v.placement,
                "shards": v.shards,
                "bucket": v.bucket,
                "predicted_bytes_per_step": v.predicted_bytes_per_step,
                "runner_up": v.runner_up.map(|(m, b)| serde_json::json!({"placement": m, "predicted_bytes_per_step": b})),
                "reason": v.reason,
            })
        })
        .collect();
    serde_json::json!({
        "model": p.model,
        "strategy": p.strategy,
        "workers": p.settings.workers,
        "servers": p.settings.servers,
        "batch_per_worker": p.config.batch,
        "variables": vars,
        "buckets": p.dist.as_ref().map(|d| d.buckets.clone()).unwrap_or_default(),
        "unreached": p.dist.as_ref().map(|d| d.unreached.clone()).unwrap_or_default(),
        "predicted_bytes_per_step_per_worker": p.dist.as_ref().map_or(0.0, |d| d.predicted_bytes_per_step_per_worker()),
    })
}
