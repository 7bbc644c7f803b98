//! Training a plan and checking a strategy: `distc run` (a saved plan), `distc train`
//! (a model compiled and run at once) and `distc verify` (N workers against one
//! device). Every run goes through the runtime's one launch entry
//! ([`distc_runtime::run::launch::launch`]); this module turns the flags into its
//! options and reports what the run did: metrics file, progress bar, `--save`, trace,
//! summary, profile, and what a Ctrl-C left on disk.

use crate::cli::{check_strategy_flags, compile_opts, CompileArgs, Device, RunArgs, Transport};
use crate::commands::compile_or_report;
use crate::console::{err, out};
use crate::verify::VerifyOptions;
use crate::Plan;
use anyhow::{bail, Context, Result};
use distc_passes::placement::{Precision, StrategyConfig, SyncMode};
use distc_passes::program_set::ProgramSet;
use distc_runtime::core::output::{check_outputs, write_file};
use distc_runtime::cuda::nccl::Collectives;
use distc_runtime::ps::PsSync;
use distc_runtime::run::launch::{
    launch, DeviceChoice, GpuOptions, Launch, MpiRun, TransportChoice,
};
use distc_runtime::run::metrics::StepMetrics;
use distc_runtime::run::trace::chrome_trace;
use distc_runtime::run::train::{CheckpointEvery, Programs, TrainOptions, TrainReport};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// `distc run`: trains the plan at `plan` as `args` say.
pub fn run(plan: &Path, args: &RunArgs) -> Result<()> {
    let (p, programs) = Plan::load(plan)?;
    let r = Runnable::new(&p, &programs)?;
    run_plan(&r, args, &[plan])
}

/// `distc train`: compiles `file` as `compile` says and trains it as `args` say.
pub fn train(file: &Path, compile: &CompileArgs, args: &RunArgs) -> Result<()> {
    check_strategy_flags(compile)?;
    let mut compile = compile.clone();
    // A GPU runs each fused group as one generated kernel.
    compile.fuse |= matches!(args.device, Device::Cuda(_));
    let (c, plan) = crate::commands::compile_plan(file, &compile, args.data.as_deref())?;
    let r = Runnable::new(&plan, &c.programs)?;
    run_plan(&r, args, &[file])
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
        crate::driver::check_settings(&plan.config)?;
        Ok(Runnable { plan, programs })
    }

    fn programs(&self) -> Programs<'_> {
        crate::driver::program_view(self.programs, self.plan.settings.workers)
    }
}

fn train_options(plan: &Plan, args: &RunArgs) -> Result<TrainOptions> {
    // Issue 60, item 9: accepted and ignored, it promised a bound on nothing.
    let s = &plan.settings;
    let one_rank = s.workers <= 1 && s.pipeline <= 1 && s.model <= 1 && s.servers == 0;
    if args.timeout.is_some() && one_rank {
        bail!(
            "--timeout bounds collectives and server requests; this plan runs one worker \
             and no servers, so it has none (compile it with --workers N for a distributed \
             run)"
        );
    }
    let resume = match &args.resume {
        Some(path) => Some(std::sync::Arc::new(
            distc_runtime::core::checkpoint::load_state(path)?,
        )),
        None => None,
    };
    let checkpoint = args.checkpoint.as_ref().map(|path| {
        let saved_by = format!(
            "{} with {} workers{}{}",
            plan.strategy.name(),
            plan.settings.workers,
            match plan.settings.zero {
                0 => String::new(),
                z => format!(", ZeRO {z}"),
            },
            pipeline_words(&plan.settings)
        );
        let every = CheckpointEvery::new(
            path.clone(),
            args.checkpoint_every.unwrap_or(usize::MAX),
            saved_by,
        );
        if args.sharded {
            every.sharded()
        } else {
            every
        }
    });
    Ok(TrainOptions {
        steps: args.steps,
        data_dir: args.data.clone(),
        // Synchronous plans read one global stream sliced by rank and micro-batch, so
        // the workers and micro-batches of a step together see the batch one device of
        // batch N*M*b would, sample for sample, however the step is cut (WORKLOADS.md's
        // seed + rank streams, which `distc bench` keeps, have the same distribution);
        // asynchronous ones give each worker its own stream.
        global_data: plan.settings.sync == SyncMode::Sync,
        preload: args.preload,
        profile: args.profile,
        trace: args.trace.is_some(),
        evaluate: !args.no_eval,
        sync: ps_sync(plan.settings.sync),
        timeout: Duration::from_secs_f64(args.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS)),
        checkpoint,
        resume,
        flops_per_sample: plan.flops_per_sample,
        tokens_per_sample: plan.tokens_per_sample,
        snapshot: None,
        fail: args.fail_worker,
    })
}

/// Trains a plan as the flags say and reports: metrics file, progress bar, `--save`,
/// trace, summary and profile. `inputs` are the files the command read (never
/// overwritten).
fn run_plan(r: &Runnable<'_>, args: &RunArgs, inputs: &[&Path]) -> Result<()> {
    let plan = r.plan;
    // A sharded state is a folder: its `latest` file stands for it.
    let sharded_at = args
        .checkpoint
        .as_ref()
        .filter(|_| args.sharded)
        .map(|dir| dir.join(distc_runtime::core::shards::LATEST));
    let checkpoint = if args.sharded {
        &sharded_at
    } else {
        &args.checkpoint
    };
    let outputs: Vec<&Path> = [&args.metrics, &args.save, &args.trace, checkpoint]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
        .collect();
    let given: Vec<&Path> = inputs
        .iter()
        .copied()
        .chain(
            [&args.init, &args.resume]
                .into_iter()
                .flatten()
                .map(PathBuf::as_path),
        )
        .collect();
    let read =
        distc_runtime::run::data::files_read(&given, &plan.config.data, args.data.as_deref());
    let read: Vec<&Path> = read.iter().map(PathBuf::as_path).collect();
    check_outputs(&outputs, &read)?;
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
    if args.elastic && args.transport == Transport::Mpi {
        bail!(
            "--elastic runs in-process (threads): under MPI a lost rank ends the mpirun job \
             with the survivors' memory; run the job under `distc launch --workers N \
             --state DIR -- MODEL ...`, which starts it again from its sharded state"
        );
    }
    if args.gpus.as_ref().is_some_and(Vec::is_empty) {
        bail!("--gpus: give at least one GPU number (0,1,...)");
    }
    // The memory estimate is checked by `launch`, before anything is allocated.
    let steps = args.steps.unwrap_or(plan.config.steps);
    let sched = &plan.config.lr_schedule;
    let scheduled = sched.warmup > 0 || sched.decay != distc_runtime::Decay::Constant;
    if !args.quiet && scheduled && steps != plan.config.steps {
        crate::console::err(&format!(
            "note: --steps {steps}: the learning-rate schedule keeps the train block's {} \
             steps (warm-up {}), so this run {} it; `--set steps={steps}` fits the schedule \
             to {steps} steps\n",
            plan.config.steps,
            sched.warmup,
            if steps < plan.config.steps {
                "stops early in"
            } else {
                "goes on past the end of"
            },
        ));
    }
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
    let reported = Arc::new(AtomicUsize::new(0));
    let interrupt = match args.transport {
        Transport::Inprocess => Some(interrupt_flag()),
        Transport::Mpi => {
            let (args, reported) = (args.clone(), reported.clone());
            // Rank 0 writes the states: it says which one it wrote last without reading
            // it back (mpirun's SIGKILL follows its SIGTERM within a second or so).
            stop_at_once_on_interrupt(move || {
                world_rank_is_0().then(|| {
                    let written = distc_runtime::core::checkpoint::last_state_written();
                    let state = args.checkpoint.clone().map(|path| {
                        let step = written.filter(|(p, _)| *p == path).map(|(_, s)| s);
                        (path, step)
                    });
                    note_on_disk(args.save.as_deref(), reported.load(Ordering::SeqCst), state)
                })
            });
            None
        }
    };
    // An elastic run's restarts, for its summary.
    let mut restarts: Vec<distc_runtime::run::metrics::Restart> = Vec::new();
    let log_every = match (args.quiet, args.log_every) {
        (true, _) => 0,
        (false, Some(n)) => n,
        (false, None) if bar.is_some() => 0,
        (false, None) => DEFAULT_LOG_EVERY,
    };
    let mut log = StepLog::new(steps);
    // Created at the first line, as the metrics file is.
    let mut events: Option<crate::tensorboard::EventWriter> = None;
    let mut on_step = |m: &StepMetrics| -> distc_runtime::Result<()> {
        if let (None, Some(dir)) = (&events, &args.tensorboard) {
            let w = crate::tensorboard::EventWriter::create(dir)
                .map_err(|(path, source)| distc_runtime::RuntimeError::Io { path, source })?;
            events = Some(w);
        }
        if let Some(w) = events.as_mut() {
            let line = serde_json::to_value(m)
                .map_err(|e| distc_runtime::RuntimeError::internal("the metrics", e.to_string()))?;
            w.step(m.step, &line)
                .map_err(|source| distc_runtime::RuntimeError::Io {
                    path: w.path().to_path_buf(),
                    source,
                })?;
        }
        reported.store(m.step, Ordering::SeqCst);
        if let Some(line) = log.line(m, log_every) {
            match &bar {
                Some(b) => b.println(line),
                None => crate::console::err(&format!("{line}\n")),
            }
        }
        restarts.extend(m.restart.clone());
        if let (None, Some(p)) = (&metrics, &args.metrics) {
            let f = std::fs::File::create(p).map_err(|source| distc_runtime::RuntimeError::Io {
                path: p.clone(),
                source,
            })?;
            metrics = Some(std::io::BufWriter::new(f));
        }
        if let Some(w) = metrics.as_mut() {
            let line = serde_json::to_string(m)
                .map_err(|e| distc_runtime::RuntimeError::internal("the metrics", e.to_string()))?;
            // A line per step reaches the disk at once: `tail -f` follows the run, and a
            // rank stopped by mpirun (which cannot flush) leaves every step it reported.
            writeln!(w, "{line}")
                .and_then(|()| w.flush())
                .map_err(|source| distc_runtime::RuntimeError::Io {
                    path: args.metrics.clone().unwrap_or_default(),
                    source,
                })?;
        }
        if let Some(b) = &bar {
            b.set_position(m.step as u64);
            b.set_message(format!(
                "loss {:.4}  {}",
                m.loss,
                throughput_words(m.samples_per_sec, m.tokens_per_sec, None)
            ));
        }
        if interrupt.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) {
            return Err(distc_runtime::RuntimeError::Interrupted(INTERRUPTED.into()));
        }
        Ok(())
    };
    let mut opts = train_options(plan, args)?;
    // A run started from --init weights is at step 0: not a resumed run.
    let resumed = opts.resume.as_ref().map(|s| s.index.step);
    if let Some(path) = &args.init {
        opts.resume = Some(initial_weights(plan, &r.programs(), path, args)?);
    }
    let run = Launch {
        programs: r.programs(),
        config: &plan.config,
        opts,
        device: device_choice(args.device, args),
        transport: match args.transport {
            Transport::Inprocess => TransportChoice::InProcess,
            Transport::Mpi => TransportChoice::Mpi(mpi_run_options(plan, args)),
        },
        rows_touched: crate::verify::rows_touched(plan.dist.as_ref()),
    };
    let result = if args.elastic {
        super::elastic::launch_elastic(plan, run, args, &mut on_step)
    } else {
        launch(&run, &mut on_step).map_err(anyhow::Error::from)
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Some(mut w) = metrics {
        w.flush().context("cannot write the metrics file")?;
    }
    if interrupt.is_some_and(|f| f.load(Ordering::SeqCst)) && result.is_err() {
        return Err(distc_runtime::RuntimeError::Interrupted(interrupted_note(
            args,
            reported.load(Ordering::SeqCst),
        ))
        .into());
    }
    match result? {
        Some(report) => finish_run(plan, args, &report, resumed, &restarts),
        // Another rank than 0 of an MPI job: rank 0 reports.
        None => Ok(()),
    }
}

/// Steps between two log lines off a terminal, as torchtitan's `log_freq`.
const DEFAULT_LOG_EVERY: usize = 10;

/// The log lines of a run (`--log-every`): what a line needs that one step's metrics
/// do not hold, the time since the run's first step and how many it has seen.
struct StepLog {
    steps: usize,
    started: Option<(std::time::Instant, usize)>,
}

impl StepLog {
    fn new(steps: usize) -> StepLog {
        StepLog {
            steps,
            started: None,
        }
    }

    /// The line of step `m`, when it is one of every `every`th or the last.
    fn line(&mut self, m: &StepMetrics, every: usize) -> Option<String> {
        // Timed from the end of the first step this run saw (a resumed run starts late).
        let (since, first) = *self
            .started
            .get_or_insert_with(|| (std::time::Instant::now(), m.step));
        if every == 0 || (!m.step.is_multiple_of(every) && m.step != self.steps) {
            return None;
        }
        let elapsed = since.elapsed().as_secs_f64();
        let done = m.step.saturating_sub(first);
        let mut line = format!(
            "step {:>w$}/{}  loss {:.4}",
            m.step,
            self.steps,
            m.loss,
            w = self.steps.to_string().len()
        );
        if let Some(lr) = m.lr {
            line += &format!("  lr {lr:.3e}");
        }
        line += &format!(
            "  {}",
            throughput_words(m.samples_per_sec, m.tokens_per_sec, None)
        );
        if let Some(mfu) = m.mfu {
            line += &format!("  MFU {:.1}%", 100.0 * mfu);
        }
        let held = m.gpu_memory_peak.unwrap_or_else(|| m.memory.total());
        line += &format!("  memory {:.1} MiB", held as f64 / (1u64 << 20) as f64);
        let left = self.steps.saturating_sub(m.step);
        line += &format!("  elapsed {}", duration_words(elapsed));
        if left > 0 && done > 0 {
            line += &format!(
                "  ETA {}",
                duration_words(elapsed / done as f64 * left as f64)
            );
        }
        Some(line)
    }
}

/// `42s`, `5m12s`, `3h05m`.
fn duration_words(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// A run's throughput: tokens per second for a model whose loss is per position (a
/// language model), with the samples and their tokens when `per_sample` is given;
/// samples per second otherwise.
pub(crate) fn throughput_words(
    samples_per_sec: f64,
    tokens_per_sec: Option<f64>,
    per_sample: Option<usize>,
) -> String {
    match (tokens_per_sec, per_sample) {
        (Some(t), Some(n)) => {
            format!("{t:.0} tokens/s ({samples_per_sec:.1} samples/s of {n} tokens)")
        }
        (Some(t), None) => format!("{t:.0} tokens/s"),
        (None, _) => format!("{samples_per_sec:.0} samples/s"),
    }
}

/// The state a run starts from with `--init FILE`: the file's weights, by name, as a
/// step-0 training state (every layout starts from it as it resumes one); what was
/// set and what was not is said unless `--quiet`.
fn initial_weights(
    plan: &Plan,
    programs: &Programs<'_>,
    path: &Path,
    args: &RunArgs,
) -> Result<Arc<distc_runtime::core::checkpoint::TrainingState>> {
    let (weights, foreign) = distc_runtime::core::checkpoint::load_weights(path)?;
    let (state, report) = distc_runtime::run::state::state_from_weights(
        programs,
        &plan.config,
        (&weights, &foreign),
        args.init_partial,
    )
    .with_context(|| format!("--init {}", path.display()))?;
    if !args.quiet {
        let mut line = format!(
            "--init {}: {} of {} variables set",
            path.display(),
            report.set.len(),
            report.set.len() + report.missing.len()
        );
        if !report.missing.is_empty() {
            line += &format!("; keeping their initializer: {}", report.missing.join(", "));
        }
        if !report.unused.is_empty() {
            line += &format!("; not in the model: {}", report.unused.join(", "));
        }
        err(&format!("{line}\n"));
    }
    Ok(Arc::new(state))
}

/// `--timeout` when not given: long enough for any collective of a healthy run.
pub const DEFAULT_TIMEOUT_SECS: f64 = 300.0;

use super::stop::stop_cause;
pub use super::stop::INTERRUPTED;

/// Set by the first Ctrl-C; a second one exits at once. Installed once per process.
fn interrupt_flag() -> Arc<AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<AtomicBool>> = std::sync::OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let seen = flag.clone();
        let installed = ctrlc::set_handler(move || {
            if seen.swap(true, Ordering::SeqCst) {
                let stopped = distc_runtime::core::output::stop_writes();
                err("\ninterrupted again: stopping now, writing nothing more\n");
                stopped.exit(130);
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

/// Under MPI, where mpirun turns Ctrl-C into SIGTERM to every rank and SIGKILL seconds
/// later, ranks cannot agree on a step to stop after: each stops at once, removing the
/// temporary file of a write it is in (the file it was to replace stays whole), and
/// rank 0 says what is on disk (`note`). Exits with 130, as in-process.
fn stop_at_once_on_interrupt(note: impl Fn() -> Option<String> + Send + 'static) {
    let installed = ctrlc::set_handler(move || {
        // Training goes on meanwhile, and mpirun may kill the rank at any moment from
        // here: no write may start, or leave its temporary file.
        let stopped = distc_runtime::core::output::stop_writes();
        if let Some(note) = note() {
            err(&format!("\nerror: {note}\n"));
            // mpirun forwards a rank's output only while it reads the rank's pipe; a
            // moment before exiting lets it read the note before the rank is gone.
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        stopped.exit(130);
    });
    if let Err(e) = installed {
        err(&format!("warning: Ctrl-C will stop at once: {e}\n"));
    }
}

/// Whether this process is rank 0 of its MPI job, read from what the launcher sets
/// (before MPI starts: a signal may come at any time); true when none says.
fn world_rank_is_0() -> bool {
    ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .is_none_or(|r| r.trim() == "0")
}

/// What a run stopped by Ctrl-C leaves: the metrics so far, and the training state of
/// the last checkpoint step, if any. No final state is written: workers stop where
/// each is, and a state must be one step of all of them.
fn interrupted_note(args: &RunArgs, step: usize) -> String {
    // Read back, not computed: workers may have finished (and saved) a step beyond
    // the last one reported.
    let state = args.checkpoint.as_ref().map(|path| {
        let step = distc_runtime::core::checkpoint::load_state(path)
            .ok()
            .map(|st| st.index.step);
        (path.clone(), step)
    });
    note_on_disk(args.save.as_deref(), step, state)
}

/// What the run left after the metrics' last step `step`, `state` being the checkpoint
/// file and the step of the state in it (`None`: it holds none), `save` the unwritten
/// `--save`.
fn note_on_disk(save: Option<&Path>, step: usize, state: Option<(PathBuf, Option<u64>)>) -> String {
    let state = match state {
        // Workers run ahead of the coordinator: one may have saved a step whose line
        // the stop kept out of the metrics.
        Some((path, Some(written))) if written > step as u64 => format!(
            "the last training state written is of step {written} in {} (resume with \
             --resume); the metrics end at step {step}: the workers finished step \
             {written} and wrote its state before the stop reached them, and its line was \
             not written",
            path.display()
        ),
        Some((path, Some(written))) => format!(
            "the last training state written is of step {written} in {} (resume with \
             --resume)",
            path.display()
        ),
        Some((path, None)) => format!("{} holds no training state", path.display()),
        None => "no training state was written (--checkpoint FILE \
                 --checkpoint-every K keeps one)"
            .into(),
    };
    let saved = match save {
        Some(p) => format!("; --save {} was not written", p.display()),
        None => String::new(),
    };
    format!(
        "{} after step {step}: no final checkpoint was written; {state}{saved}",
        stop_cause()
    )
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

/// `2 workers`, `1 worker`.
fn workers_word(n: usize) -> String {
    match n {
        1 => "1 worker".into(),
        n => format!("{n} workers"),
    }
}

/// How the summary names a plan's layout: `allreduce, 4 workers`, `pipeline of 2
/// stages x 4 micro-batches (1f1b), 2 workers`, `allreduce, 4 workers, mesh data=2 x
/// model=2`. A pipeline or mesh over `single` is named by its layout alone (it is no
/// one-device run).
pub fn layout_words(plan: &Plan) -> String {
    let s = &plan.settings;
    let words = pipeline_words(s);
    // A pipeline over `single` keeps `workers` at 1; each stage is a worker.
    let workers = workers_word(s.workers.max(s.model.max(1) * s.pipeline.max(1)));
    match plan.strategy {
        distc_passes::placement::Strategy::Single if !words.is_empty() => {
            format!("{}, {workers}", words.trim_start_matches(", "))
        }
        _ => format!("{}, {workers}{words}", plan.strategy.name()),
    }
}

/// `12.3 TFLOP/s`, `840 GFLOP/s`: a rate in the unit that keeps it readable.
fn flops_words(f: f64) -> String {
    match f {
        f if f >= 1e12 => format!("{:.1} TFLOP/s", f / 1e12),
        f if f >= 1e9 => format!("{:.1} GFLOP/s", f / 1e9),
        f => format!("{:.1} MFLOP/s", f / 1e6),
    }
}

/// What every run does once trained: save, trace, summary, profile. `resumed`: the
/// step of the state `--resume` gave.
fn finish_run(
    plan: &Plan,
    args: &RunArgs,
    report: &TrainReport,
    resumed: Option<u64>,
    restarts: &[distc_runtime::run::metrics::Restart],
) -> Result<()> {
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
        // After a restart the report is the last attempt's: its steps, on its workers.
        let resumed = match (restarts.last(), resumed) {
            (Some(r), _) => format!(
                " on {} (--elastic: {} restart{}) from step {}",
                workers_word(r.workers_after),
                restarts.len(),
                if restarts.len() == 1 { "" } else { "s" },
                r.resumed_from_step
            ),
            (None, Some(step)) => format!(" resumed from step {step}"),
            (None, None) => String::new(),
        };
        let on = if report.device.is_empty() {
            String::new()
        } else {
            format!(" on {}", report.device)
        };
        let mut line = format!(
            "{} ({}){on}: {} steps{resumed} in {:.1} s, loss {:.4} -> {:.4}, {}",
            plan.model,
            layout_words(plan),
            report.steps,
            report.train_time.as_secs_f64(),
            report.first_loss,
            report.final_loss,
            throughput_words(
                report.samples_per_sec,
                report.tokens_per_sec,
                plan.tokens_per_sample
            )
        );
        if let Some((mfu, peak, source)) = &report.mfu {
            line += &format!(
                ", {} model ({:.1}% MFU of {} peak: {source})",
                flops_words(report.model_flops_per_sec.unwrap_or(0.0)),
                100.0 * mfu,
                flops_words(*peak)
            );
        } else if let Some(f) = report.model_flops_per_sec {
            line += &format!(", {} model", flops_words(f));
        }
        if let Some(b) = report.pipeline_bubble {
            line += &format!(", pipeline bubble {:.1}% measured", 100.0 * b);
        }
        if let Some(e) = &report.eval {
            line += &format!("; {}", e.describe());
        }
        out(&format!("{line}\n"));
    }
    if let Some(p) = &report.profile {
        out(&p.render());
    }
    // Issue 60, items 4 and 7: said after everything was written, and never with
    // exit 0.
    let kept = args.save.as_ref().map_or(String::new(), |p| {
        format!(" (they were written to {} all the same)", p.display())
    });
    if let Some(why) = &report.eval_failed {
        bail!(
            "the evaluation after the last step failed: {why}; the trained weights are \
             kept{kept}"
        );
    }
    if let Some(e) = report.eval.as_ref().filter(|e| !e.eval_loss.is_finite()) {
        bail!(
            "the evaluation after the last step gave eval_loss {}: the trained weights do \
             not compute a finite loss on the held-out data{kept}",
            e.eval_loss
        );
    }
    Ok(())
}

#[cfg(feature = "mpi")]
use crate::verify::verify_mpi;

#[cfg(not(feature = "mpi"))]
fn verify_mpi(
    _: &Path,
    _: &VerifyOptions,
) -> Result<Option<crate::verify::VerifyReport>, crate::verify::VerifyError> {
    Err(crate::verify::VerifyError::Refused(
        distc_runtime::run::launch::NO_MPI.into(),
    ))
}

/// `distc verify`: the library's check ([`crate::verify`]), printed.
/// `verify`'s tolerance when `--tolerance` is not given.
pub const DEFAULT_TOLERANCE: f64 = 1e-4;

#[allow(clippy::too_many_arguments)]
pub fn verify(
    file: &Path,
    compile: &CompileArgs,
    steps: usize,
    given: Option<f64>,
    data: Option<&Path>,
    timeout: f64,
    transport: Transport,
    device: Device,
    init: Option<&Path>,
) -> Result<()> {
    check_strategy_flags(compile)?;
    let tolerance = given.unwrap_or(DEFAULT_TOLERANCE);
    let init = match init {
        Some(path) => Some(Arc::new(distc_runtime::core::checkpoint::load(path)?.0)),
        None => None,
    };
    let device = match (device, transport) {
        (Device::Cpu, _) => None,
        (Device::Cuda(n), Transport::Inprocess) => Some(n),
        (Device::Cuda(_), Transport::Mpi) => bail!(
            "--device cuda verifies with worker threads on one GPU; --transport mpi runs on the CPU"
        ),
    };
    let mut compiled_with = compile_opts(compile, data);
    if crate::cli::searches_layout(compile) {
        // The layout `compile` and `train` would pick, checked as the user gave it.
        if transport == Transport::Mpi {
            bail!(
                "verify --strategy auto --workers N searches the layout, profiling on this \
                 process: under mpirun each rank would profile its own and could pick \
                 another. Compile the plan (`distc compile FILE --strategy auto --workers \
                 N -o PLAN`; `distc explain PLAN` names the pick's flags), then verify \
                 those flags under mpirun"
            );
        }
        let (_, settings, search) = super::search_layout(file, compile, data)?;
        compiled_with.strategy = settings;
        // The pick's own batch: the search keeps the global batch, not the worker's.
        compiled_with.batch = search.candidates.get(search.chosen).map(|c| c.batch);
    }
    let opts = VerifyOptions {
        compile: compiled_with,
        steps,
        tolerance,
        timeout: Duration::from_secs_f64(timeout),
        device,
        init,
    };
    let result = match transport {
        Transport::Inprocess => crate::verify::verify(file, &opts).map(Some),
        Transport::Mpi => verify_mpi(file, &opts),
    };
    let report = match result {
        Err(crate::verify::VerifyError::Compile(e)) => {
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
    let (text, failure) = verify_verdict(&report, file, &name, precision, given)?;
    out(&text);
    match failure {
        Some(why) => bail!("{why}"),
        None => Ok(()),
    }
}

/// What `distc verify` prints of `report` (one line per variable and the summary) and,
/// if it failed, why. The summary and the failure name the same variable: the one
/// furthest beyond its own allowance ([`VerifyReport::worst_within`]).
pub fn verify_verdict(
    report: &crate::verify::VerifyReport,
    file: &Path,
    name: &str,
    precision: Precision,
    given: Option<f64>,
) -> Result<(String, Option<String>)> {
    let tolerance = report.tolerance;
    let steps = report.steps;
    // An explicit --tolerance decides alone; by default each variable's allowance does.
    let allowed = |v: &crate::verify::VarError| report.allowed_for(v, given);
    let allowance = |v: &crate::verify::VarError| match given {
        Some(t) => format!("{t:.1e} (--tolerance)"),
        None => v.allowance(tolerance),
    };
    let mut text = String::new();
    for v in &report.vars {
        text += &format!(
            "  {:<10} max |one device - {name}| / max |w| = {:.2e}",
            v.name, v.relative
        );
        if let Some(e) = v.precision_effect {
            text += &format!(" (one device {precision} vs f32: {e:.2e})");
        }
        match v.rounding {
            Some(r) if given.is_none() => {
                text += &format!(
                    "; from float64: {name} {:.2e}, one device f32 {:.2e}",
                    r.layout, r.floor
                );
                if r.noise {
                    text += "; noise: one device's f32 value is mostly rounding, not judged\n";
                    continue;
                }
            }
            _ => {}
        }
        text += &format!("; allowed {}\n", allowance(v));
    }
    let worst = report
        .worst_within(given)
        .ok_or_else(|| anyhow::anyhow!("the model has no variables"))?;
    let raised = report
        .vars
        .iter()
        .any(|v| v.half_rtol > 0.0 || v.precision_effect.is_some());
    let against_f64 = given.is_none() && report.vars.iter().any(|v| v.rounding.is_some());
    let decides = match given {
        Some(t) => format!("tolerance {t:.0e}"),
        None if against_f64 => {
            let noise: Vec<&str> = report
                .vars
                .iter()
                .filter(|v| v.rounding.is_some_and(|r| r.noise))
                .map(|v| v.name.as_str())
                .collect();
            let mut d = format!(
                "judged against one device in float64: each variable within {} x one \
                 device f32's own distance from it",
                crate::verify::FLOOR_FACTOR
            );
            if !noise.is_empty() {
                d += &format!(
                    "; {} only rounding noise in f32, not judged: {}",
                    if noise.len() == 1 {
                        "1 variable is"
                    } else {
                        "variables are"
                    },
                    noise.join(", ")
                );
            }
            d
        }
        None if raised => format!("tolerance {tolerance:.0e}, raised per variable as above"),
        None => format!("tolerance {tolerance:.0e}"),
    };
    let one = match report.micro_batches {
        1 => format!("batch {}", report.global_batch),
        m => format!(
            "batch {} in {m} micro-batches (--accumulate {m}: {})",
            report.global_batch, report.split_reason
        ),
    };
    let worst_words = match worst.rounding {
        Some(r) if against_f64 => format!(
            "worst relative error {:.2e} (`{}`, {:.2e} from float64, allowed {})",
            worst.relative,
            worst.name,
            r.layout,
            allowance(worst)
        ),
        _ => format!(
            "worst relative error {:.2e} (`{}`, allowed {})",
            worst.relative,
            worst.name,
            allowance(worst)
        ),
    };
    text += &format!(
        "verify {}: {name} with {} workers vs one device with {one}, {steps} steps: {worst_words}, {decides}\n",
        file.display(),
        report.workers,
    );
    // The worst variable against its allowance decides: the failure names it too.
    let fails = match given {
        Some(t) => worst.relative > t,
        None => !worst.passes(tolerance),
    };
    if fails {
        let failing = worst;
        let mut why = match (failing.rounding, failing.precision_effect) {
            (Some(r), _) if given.is_none() => format!(
                "`{}` is {:.2e} (relative) from one device in float64, beyond {} x the \
                 {:.2e} one device in f32 is from it: more than f32's rounding",
                failing.name,
                r.layout,
                crate::verify::FLOOR_FACTOR,
                r.floor.max(crate::verify::FLOOR_MIN)
            ),
            (_, _)
                if given.is_some()
                    || failing.half_rtol == 0.0 && failing.precision_effect.is_none() =>
            {
                format!(
                    "`{}` differs by {:.2e} (relative), beyond the tolerance {:.1e}",
                    failing.name,
                    failing.relative,
                    allowed(failing)
                )
            }
            (_, None) => format!(
                "`{}` differs by {:.2e} (relative), beyond the allowance {}",
                failing.name,
                failing.relative,
                failing.allowance(tolerance)
            ),
            (_, Some(e)) => format!(
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
        return Ok((text, Some(why)));
    }
    Ok((text, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 36, item 7: a state of a step past the metrics' last line says so.
    #[test]
    fn a_state_past_the_metrics_says_where_the_metrics_end() {
        let state = |step| Some((PathBuf::from("s.st"), Some(step)));
        let ahead = note_on_disk(None, 239, state(240));
        assert!(
            ahead.starts_with("interrupted (Ctrl-C) after step 239:")
                && ahead.contains("state written is of step 240 in s.st")
                && ahead.contains("the metrics end at step 239"),
            "{ahead}"
        );
        let behind = note_on_disk(None, 239, state(238));
        assert!(!behind.contains("the metrics end"), "{behind}");
    }
}
