//! Each `distc` command's work, given its parsed flags: what it compiles, runs or
//! reads, and what it prints. The binary only parses the command line and calls one
//! of these; the flags themselves are in [`crate::cli`].
//!
//! `run` owns training a plan (`run`, `train`) and checking a strategy (`verify`);
//! `simulate` owns predicting a plan on other machines (`simulate`, `calibrate`). The
//! small commands are here.

mod elastic;
pub mod eval;
pub mod launch;
mod restart;
pub mod run;
pub mod simulate;
pub mod stop;

use crate::cli::{
    check_strategy_flags, compile_opts, strategy_config, BenchArgs, CompileArgs, Device,
    ExplainFormat, Transport,
};
use crate::console::{err, out};
use crate::{compile_file, CompileError, CompileOptions, Compiled, Plan};
use anyhow::{bail, Result};
use distc_runtime::core::output::write_file;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// Under data parallelism, a statistic over the batch axis (a hand-written batch
/// norm's mean and variance) is each worker's own, and under a pipeline each
/// micro-batch's: said at compile time, not left for `verify` to find.
fn warn_per_worker_statistics(c: &Compiled, opts: &CompileOptions) {
    let s = &opts.strategy;
    if c.assumptions.is_empty() {
        return;
    }
    if s.pipeline > 1 {
        let replicas = s.workers / (s.pipeline * s.model.max(1)).max(1);
        if replicas <= 1 && s.micro_batches <= 1 {
            return;
        }
        let same = if replicas <= 1 {
            " (one device with the same micro-batches, --accumulate, trains the same: what \
             `verify` compares it with)"
        } else {
            ""
        };
        err(&format!(
            "warning: the pipeline's {replicas} replica(s), each step in {} micro-batches, \
             compute on each micro-batch what one device computes on the global batch, so \
             this model trains differently{same}:\n",
            s.micro_batches
        ));
    } else {
        let replicas = s.workers / s.model.max(1);
        if replicas <= 1 {
            return;
        }
        err(&format!(
            "warning: {replicas} data-parallel replicas each compute on their own batch what \
             one device computes on the global batch, so this model trains differently:\n"
        ));
    }
    for a in &c.assumptions {
        err(&format!("  - {a}\n"));
    }
}

/// `distc compile`: the plan of `file` written to `output`, what each pass did on
/// standard error.
pub fn compile(
    file: &Path,
    compile: &CompileArgs,
    output: &Path,
    data: Option<&Path>,
) -> Result<()> {
    check_strategy_flags(compile)?;
    distc_runtime::core::output::check_output(output, &[file])?;
    let start = std::time::Instant::now();
    let (c, plan) = compile_plan(file, compile, data)?;
    plan.save(output, &[file])?;
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
    Ok(())
}

/// `file` compiled as `compile` says, and its plan: with the layout search's pick (the
/// search printed and kept in the plan) when the flags ask for it
/// ([`crate::cli::searches_layout`]).
pub fn compile_plan(
    file: &Path,
    compile: &CompileArgs,
    data: Option<&Path>,
) -> Result<(Compiled, Plan)> {
    let source = file.display().to_string();
    if !crate::cli::searches_layout(compile) {
        let c = compile_or_report(file, &compile_opts(compile, data))?;
        crate::driver::check_settings(&c.config)?;
        let plan = Plan::new(&c, &source, &strategy_config(compile));
        return Ok((c, plan));
    }
    let (c, settings, search) = search_layout(file, compile, data)?;
    crate::driver::check_settings(&c.config)?;
    let mut plan = Plan::new(&c, &source, &settings);
    plan.search = Some(search);
    plan.seal();
    Ok((c, plan))
}

/// The layout search `compile` asks for: its pick compiled, the pick's settings, and
/// the search (printed).
pub fn search_layout(
    file: &Path,
    compile: &CompileArgs,
    data: Option<&Path>,
) -> Result<(
    Compiled,
    distc_passes::placement::StrategyConfig,
    crate::plan::Search,
)> {
    let budget = compile
        .memory_per_worker
        .map(|mib| (mib * 1048576.0) as u128);
    // A calibrated link prices the candidates as `simulate` prices a plan: its line
    // in the settings (the passes' choices), its measured sizes in the simulation.
    let given = simulate::given_links(&compile.link, &compile.calibration)?;
    let mut opts = compile_opts(compile, data);
    if let Some(l) = given.intra {
        opts.strategy.intra_link = l;
    }
    if let Some(l) = given.inter {
        (opts.strategy.bandwidth, opts.strategy.latency) = (l.bandwidth, l.latency);
    }
    let mut pricing = crate::planner::Pricing {
        measured: given.measured,
        copy_bandwidth: given.copy_bandwidth,
        ..crate::planner::Pricing::here()
    };
    if let Some(steps) = compile.profile_steps {
        pricing.op_times = crate::planner::OpTimes::Here { steps };
    }
    if let Some(path) = &compile.op_times {
        pricing.op_times = crate::planner::OpTimes::Trace(path);
    }
    let (c, settings, search) = crate::planner::search(
        file,
        &opts,
        compile.workers,
        compile.zero,
        budget,
        &pricing,
        &compile.search_precision,
    )
    .map_err(anyhow::Error::msg)?;
    err(&search.render(10));
    Ok((c, settings, search))
}

/// `distc bench`: the training benchmark, or with `--compile` the compile-time one.
pub fn bench(a: &BenchArgs) -> Result<()> {
    if let Some(path) = &a.json {
        distc_runtime::core::output::check_output(path, &[])?;
    }
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    if a.compile {
        let settings = crate::bench::CompileBenchSettings {
            nodes: a.nodes.clone(),
            strategies: a
                .strategies
                .clone()
                .unwrap_or_else(|| names(&["single", "allreduce", "hybrid", "allreduce_zero3"])),
            workers: a.workers.iter().copied().max().unwrap_or(2),
            servers: a.servers,
            runs: a.runs.unwrap_or(1),
        };
        let rows = crate::bench::run_compile(&settings)?;
        if let Some(path) = &a.json {
            write_file(path, serde_json::to_string_pretty(&rows)?.as_bytes())?;
        }
        return Ok(());
    }
    let strategies = a
        .strategies
        .clone()
        .unwrap_or_else(|| names(&["single", "allreduce_dense", "allreduce", "hybrid", "ps"]));
    let dir = std::env::temp_dir().join(format!("distc-bench-{}", std::process::id()));
    let settings = crate::bench::BenchSettings {
        workloads: a.workloads.clone(),
        strategies,
        workers: a.workers.clone(),
        runs: a.runs.unwrap_or(3),
        servers: a.servers,
        warmup: a.warmup,
        steps: a.steps,
        mpi: a.transport == Transport::Mpi,
        dir,
        device: match a.device {
            Device::Cpu => None,
            Device::Cuda(n) => Some(format!("cuda:{n}")),
        },
        no_cuda_graph: a.no_cuda_graph,
    };
    // The scratch plans and metrics go with the run, however it ends.
    let _scratch = RemoveOnDrop(settings.dir.clone());
    let rows = crate::bench::run(&settings)?;
    if let Some(path) = &a.json {
        write_file(path, serde_json::to_string_pretty(&rows)?.as_bytes())?;
    }
    Ok(())
}

/// A scratch folder removed when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `distc explain`: the plan at `plan` explained (see [`crate::explain`]).
pub fn explain(plan: &Path, format: ExplainFormat) -> Result<()> {
    let (p, programs) = Plan::load(plan)?;
    match format {
        ExplainFormat::Json => out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&crate::explain::json(&p, &programs)?)?
        )),
        ExplainFormat::Table => out(&crate::explain::text(&p, &programs)?),
    }
    Ok(())
}

/// `distc ir`: the programs after pass `after` (default: the last) of the compilation
/// the flags describe: the worker program, then every other program that exists after
/// that pass (servers, init, final, pipeline stages). A pass the strategy does not run
/// is refused, naming the ones it does.
pub fn ir(
    file: &Path,
    after: Option<String>,
    compile: &CompileArgs,
    data: Option<&Path>,
) -> Result<()> {
    check_strategy_flags(compile)?;
    let mut opts = compile_opts(compile, data);
    opts.stop_after = after.or(opts.stop_after);
    check_stop_runs(&opts)?;
    let c = compile_or_report(file, &opts)?;
    let mut text = String::new();
    for (role, g) in c.programs.iter() {
        if !text.is_empty() {
            text.push('\n');
        }
        text += &match role {
            distc_passes::ProgramRole::Worker => {
                distc_ir::print::print_with_notes(g, &c.programs.worker_notes)
            }
            _ => distc_ir::print(g),
        };
    }
    out(&text);
    Ok(())
}

/// Refuses a `--after` pass that the strategy's pipeline does not run: stopping there
/// never happens, and the program printed would be the last pass's.
fn check_stop_runs(opts: &CompileOptions) -> Result<()> {
    let Some(stop) = &opts.stop_after else {
        return Ok(());
    };
    let passes: Vec<String> = distc_passes::passes_for(&opts.strategy)
        .iter()
        .map(|p| p.name())
        .collect();
    if distc_passes::known_pass_names().contains(stop) && !passes.contains(stop) {
        bail!(
            "pass `{stop}` does not run for this strategy ({}): its passes are {}; give the \
             strategy flags to `distc ir` (e.g. `--strategy allreduce --workers 2`), or see \
             every pass's programs with `distc compile FILE ... --dump-ir DIR`",
            opts.strategy.strategy.name(),
            passes.join(", ")
        );
    }
    Ok(())
}

/// `distc dot`: the one-device program after pass `after`, in Graphviz DOT.
pub fn dot(file: &Path, after: Option<String>, batch: Option<usize>) -> Result<()> {
    let opts = CompileOptions {
        stop_after: after,
        batch,
        ..Default::default()
    };
    check_stop_runs(&opts)?;
    out(&distc_ir::dot::to_dot(
        &compile_or_report(file, &opts)?.programs.worker,
    ));
    Ok(())
}

/// `distc plot`: the metrics files drawn into `output`.
pub fn plot(files: &[PathBuf], output: &Path, options: &crate::plot::PlotOptions) -> Result<()> {
    let plotted = crate::plot::plot(files, output, options)?;
    err(&format!(
        "wrote {} ({})\n",
        output.display(),
        plotted.panels.join(", ")
    ));
    for note in &plotted.notes {
        err(&format!("note: {note}\n"));
    }
    Ok(())
}

/// Compiles, printing DSL errors as diagnostics.
pub fn compile_or_report(file: &Path, opts: &CompileOptions) -> Result<Compiled> {
    match compile_file(file, opts) {
        Ok(c) => {
            warn_per_worker_statistics(&c, opts);
            Ok(c)
        }
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
