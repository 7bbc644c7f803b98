//! The `distc` command line.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use distc::plan::PassSummary;
use distc::{compile_file, CompileError, CompileOptions, Compiled, Plan};
use distc_runtime::metrics::StepMetrics;
use distc_runtime::train::{train, TrainOptions, TrainReport};
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
}

fn compile_opts(a: &CompileArgs) -> CompileOptions {
    CompileOptions {
        dump_ir: a.dump_ir.clone(),
        stop_after: a.stop_after.clone(),
        disabled: a.disable_pass.clone(),
        batch: a.batch,
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

fn summaries(c: &Compiled) -> Vec<PassSummary> {
    c.records
        .iter()
        .map(|r| PassSummary {
            name: r.name.clone(),
            stats: r.stats.to_string(),
            nodes: r.nodes,
        })
        .collect()
}

fn strategy_name(s: Strategy) -> &'static str {
    match s {
        Strategy::Single => "single",
    }
}

fn run_plan(plan: &Plan, graph: &distc_ir::Graph, args: &RunArgs) -> Result<TrainReport> {
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
    let opts = TrainOptions {
        steps: args.steps,
        data_dir: args.data.clone(),
    };
    let mut on_step = |m: &StepMetrics| -> distc_runtime::Result<()> {
        if let Some(w) = metrics.as_mut() {
            let line = serde_json::to_string(m).map_err(|e| distc_runtime::RuntimeError::Config(e.to_string()))?;
            writeln!(w, "{line}").map_err(|source| distc_runtime::RuntimeError::Io {
                path: args.metrics.clone().unwrap_or_default(),
                source,
            })?;
        }
        if let Some(b) = &bar {
            b.set_position(m.step as u64);
            b.set_message(format!("loss {:.4}  {:.0} samples/s", m.loss, m.samples_per_sec));
        }
        Ok(())
    };
    let report = train(graph, &plan.config, &opts, &mut on_step)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(mut w) = metrics {
        w.flush().context("cannot write the metrics file")?;
    }
    if let Some(path) = &args.save {
        let mut named: Vec<(String, &distc_runtime::Tensor)> = report.params.iter().map(|(k, v)| (k.clone(), v)).collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let meta = [("model".to_string(), plan.model.clone()), ("steps".to_string(), report.steps.to_string())]
            .into_iter()
            .collect();
        distc_runtime::checkpoint::save(path, &named, meta)?;
    }
    if !args.quiet {
        let mut line = format!(
            "{}: {} steps in {:.1} s, loss {:.4} -> {:.4}, {:.0} samples/s",
            plan.model,
            report.steps,
            report.train_time.as_secs_f64(),
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
    Ok(report)
}

fn main() {
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
        } => {
            let c = compile_or_report(&file, &compile_opts(&compile))?;
            let plan = Plan::new(&c.graph, c.config.clone(), &file.display().to_string(), strategy_name(compile.strategy), summaries(&c));
            plan.save(&output)?;
            for r in &c.records {
                eprintln!("  {:<10} {:>5} -> {:>5} nodes  {}", r.name, r.nodes.0, r.nodes.1, r.stats);
            }
            eprintln!("wrote {} ({} nodes)", output.display(), c.graph.node_count());
        }
        Command::Run { plan, run } => {
            let (p, graph) = Plan::load(&plan)?;
            run_plan(&p, &graph, &run)?;
        }
        Command::Train { file, compile, run } => {
            let c = compile_or_report(&file, &compile_opts(&compile))?;
            let plan = Plan::new(&c.graph, c.config.clone(), &file.display().to_string(), strategy_name(compile.strategy), summaries(&c));
            run_plan(&plan, &c.graph, &run)?;
        }
        Command::Ir { file, after, batch } => {
            let c = compile_or_report(&file, &CompileOptions { stop_after: after, batch, ..Default::default() })?;
            print!("{}", distc_ir::print(&c.graph));
        }
        Command::Dot { file, after, batch } => {
            let c = compile_or_report(&file, &CompileOptions { stop_after: after, batch, ..Default::default() })?;
            print!("{}", distc_ir::dot::to_dot(&c.graph));
        }
    }
    Ok(())
}
