//! The one launch entry: the CLI (and `verify`) hand a loaded plan's programs and the
//! run's options to [`launch`], which decides the device, the transport and the roles.
//!
//! | device | transport | what runs |
//! | --- | --- | --- |
//! | CPU | in-process | every rank a thread of this process ([`crate::run::train::train`]) |
//! | CPU | MPI | this process is one rank of an `mpirun` job (`crate::run::mpi`) |
//! | GPU | in-process | every worker a thread with a CUDA backend of its own |
//! | GPU | MPI | this process is one rank; its worker has a CUDA backend |
//!
//! Whatever the row, a worker runs the one worker loop ([`crate::run::worker`]); on a
//! GPU the loop captures a step into a CUDA graph where the backend can
//! ([`crate::core::backend::Capture`]). Parameter servers always run on the CPU.

use crate::comm::Links;
use crate::core::backend::Site;
use crate::core::checkpoint::{TrainingState, LOSS_SCALE_KEY, STEP_KEY};
use crate::core::config::RunConfig;
use crate::core::error::{Result, RuntimeError};
use crate::cuda::nccl::Collectives;
use crate::cuda::{CudaBackend, CudaLib, CudaOptions, LibDirs};
use crate::run::mesh::Mesh;
use crate::run::metrics::StepMetrics;
use crate::run::metrics::TrainReport;
use crate::run::options::TrainOptions;
use crate::run::programs::Programs;
use crate::run::threads::train_on;
use std::collections::HashMap;

// What the CLI names beside `launch`, where it has always found it.
pub use crate::run::metrics::rank_path;
pub use crate::run::options::MpiRun;

/// Where a run's workers compute.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU backend.
    #[default]
    Cpu,
    /// CUDA GPUs.
    Cuda(GpuOptions),
}

/// How a GPU run uses its GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuOptions {
    /// The GPU of every worker when `gpus` is not given.
    pub ordinal: usize,
    /// Worker `r` on the `r`-th of these (wrapping).
    pub gpus: Option<Vec<usize>>,
    /// cuBLAS with TF32 tensor cores.
    pub tf32: bool,
    /// Capture a step into a CUDA graph and replay it where the step allows.
    pub graphs: bool,
    /// Which communicator the collectives use.
    pub collectives: Collectives,
}

impl Default for GpuOptions {
    fn default() -> GpuOptions {
        GpuOptions {
            ordinal: 0,
            gpus: None,
            tf32: false,
            graphs: true,
            collectives: Collectives::Auto,
        }
    }
}

impl GpuOptions {
    /// The GPU of worker `rank`.
    pub fn gpu_of(&self, rank: usize) -> usize {
        match &self.gpus {
            Some(g) if !g.is_empty() => g[rank % g.len()],
            _ => self.ordinal,
        }
    }
}

/// How a run's ranks are connected.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// Threads of this process.
    #[default]
    InProcess,
    /// This process is one rank of an `mpirun` job.
    Mpi(MpiRun),
}

/// Everything a run needs: the plan's programs and settings, and where it runs.
#[derive(Clone, Debug)]
pub struct Launch<'a> {
    /// The plan's programs.
    pub programs: Programs<'a>,
    /// The plan's settings.
    pub config: &'a RunConfig,
    /// The run's options.
    pub opts: TrainOptions,
    /// Where the workers compute.
    pub device: DeviceChoice,
    /// How the ranks are connected.
    pub transport: TransportChoice,
    /// Rows a batch touches of each sparse variable, as the compiler measured them
    /// (for the memory estimate; empty: the bounds the types give).
    pub rows_touched: HashMap<String, f64>,
}

/// Trains as `run` says. `on_step` sees each step's metrics line. Returns the run's
/// report; under MPI, ranks other than 0 return `None` (rank 0 reports).
pub fn launch(
    run: &Launch<'_>,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<Option<TrainReport>> {
    let Launch {
        programs,
        config,
        opts,
        device,
        transport,
        rows_touched: _,
    } = run;
    check_run(run)?;
    // A file source without `eval_path` has nothing held out to evaluate on.
    let opts = &TrainOptions {
        evaluate: opts.evaluate && config.data.has_held_out(),
        ..opts.clone()
    };
    let result = launch_checked(programs, config, opts, device, transport, on_step);
    // A failed run's last state may still be being written: it is on disk (or its
    // write failed) before the caller says which state the run left.
    let written = opts.checkpoint.as_ref().map_or(Ok(()), |c| c.written());
    let report = result?;
    written?;
    Ok(report)
}

/// [`launch`] once its options are checked.
fn launch_checked(
    programs: &Programs<'_>,
    config: &RunConfig,
    opts: &TrainOptions,
    device: &DeviceChoice,
    transport: &TransportChoice,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
) -> Result<Option<TrainReport>> {
    // The one mesh of the run, whatever carries its ranks.
    let mesh = Mesh::of(programs)?;
    match (device, transport) {
        (DeviceChoice::Cpu, TransportChoice::InProcess) => {
            train_on(*programs, mesh, config, opts, on_step, |_, _| {
                Ok(crate::cpu::Cpu)
            })
            .map(Some)
        }
        (DeviceChoice::Cpu, TransportChoice::Mpi(m)) => {
            mpi_ranks(*programs, mesh, config, opts, m, on_step, &|_, _| {
                Ok(crate::cpu::Cpu)
            })
        }
        (DeviceChoice::Cuda(gpu), transport) => {
            require_gpu(gpu)?;
            let cuda = CudaOptions {
                tf32: gpu.tf32,
                graphs: gpu.graphs,
                ..CudaOptions::default()
            };
            // Emulated NCCL ranks are threads of one process: MPI ranks go through the
            // host (`auto`), or are refused by name (`nccl`).
            let mut collectives = gpu.collectives;
            if cuda.emulator && matches!(transport, TransportChoice::Mpi(_)) {
                match collectives {
                    Collectives::Nccl => {
                        return Err(RuntimeError::Config(
                            "--collectives nccl: the GPU emulator's NCCL ranks are threads of \
                             one process, not MPI ranks; use --collectives host (or auto)"
                                .into(),
                        ))
                    }
                    _ => collectives = Collectives::Host,
                }
            }
            let make = |site: Site<'_>, links: Links<'_>| -> Result<CudaBackend> {
                let gpu_of = gpu.gpu_of(site.worker);
                crate::cuda::worker_backend(site, cuda, gpu_of, collectives, links)
            };
            match transport {
                TransportChoice::InProcess => {
                    train_on(*programs, mesh, config, opts, on_step, make).map(Some)
                }
                TransportChoice::Mpi(m) => {
                    mpi_ranks(*programs, mesh, config, opts, m, on_step, &make)
                }
            }
        }
    }
}

/// The libraries and the GPU a GPU run needs, probed before anything starts: NCCL
/// first where `--collectives nccl` asks for it, so a missing library is named first.
/// What would fail at the first step or later, refused before anything is allocated,
/// whoever made the plan: the settings' ranges, the model against its data source, a
/// resumed state against the model and optimizer, and the memory the run will hold.
fn check_run(run: &Launch<'_>) -> Result<()> {
    let (programs, config, opts) = (&run.programs, run.config, &run.opts);
    config.check().map_err(RuntimeError::Config)?;
    if opts.evaluate {
        config.check_evaluation().map_err(RuntimeError::Config)?;
    }
    if let Some(f) = opts.fail {
        let steps = opts.last_step(config);
        let why = if f.worker >= programs.workers {
            Some(format!(
                "the plan has workers 0 to {}",
                programs.workers - 1
            ))
        } else if f.step > steps {
            // Issue 60, item 9: a rehearsal that never happens rehearses nothing.
            Some(format!(
                "the run ends at step {steps}, so nothing would fail"
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(RuntimeError::Config(format!(
                "--fail-worker {}:{}: {why}",
                f.worker, f.step
            )));
        }
    }
    crate::run::data::check_model(
        programs.worker,
        &config.data,
        config.batch,
        &config.data.id_bounds(),
    )?;
    if let Some(state) = opts.resume.as_deref() {
        check_resume(state, programs, config)?;
    }
    let steps = opts.last_step(config);
    let rows = crate::run::memory::expected_rows(programs.worker, &run.rows_touched);
    let est = crate::run::memory::estimate(programs, config, steps, opts.preload, &rows)?;
    match run.transport {
        TransportChoice::InProcess => {
            crate::run::memory::check(est.in_process_total(), &est.describe())
        }
        TransportChoice::Mpi(_) => {
            let need = est.per_worker() + est.eval;
            crate::run::memory::check(
                need,
                &format!("{} per worker process", crate::run::memory::gib(need)),
            )
        }
    }
    .map_err(RuntimeError::Config)
}

/// Refuses a training state written for another model or by another optimizer (its
/// optimizer state would be dropped, or missing, without a word), or one whose
/// variables, optimizer state or step count are not of the model's types.
pub fn check_resume(
    state: &TrainingState,
    programs: &Programs<'_>,
    config: &RunConfig,
) -> Result<()> {
    let model = &programs.worker.name;
    if &state.index.model != model {
        return Err(RuntimeError::state(format!(
            "the training state is of model `{}`, this plan trains `{model}`",
            state.index.model
        )));
    }
    for (name, init) in crate::run::state::whole_variables(programs, config.seed)? {
        match state.params.get(&name) {
            Some(t) if t.tensor_type() != init.tensor_type() => {
                return Err(RuntimeError::state(format!(
                    "the training state's `{name}` is {}; the model's is {}",
                    t.tensor_type(),
                    init.tensor_type()
                )))
            }
            _ => {}
        }
    }
    // Refused here, before anything starts, as the optimizers refuse it.
    if let Some(t) = state.optimizer.get(STEP_KEY) {
        if crate::core::checkpoint::step_count(t).is_err() {
            return Err(RuntimeError::state(format!(
                "the training state's `{STEP_KEY}` is {}, not one step count: the file is \
                 damaged or was edited",
                t.tensor_type()
            )));
        }
    }
    let wanted = crate::cpu::optim::Optimizer::new(&config.optimizer).slot_names();
    let mut held: Vec<&str> = state
        .optimizer
        .keys()
        .filter(|k| k.as_str() != STEP_KEY && k.as_str() != LOSS_SCALE_KEY)
        .filter_map(|k| k.rsplit_once('/').map(|(_, slot)| slot))
        .collect();
    held.sort_unstable();
    held.dedup();
    let mut want: Vec<&str> = wanted.to_vec();
    want.sort_unstable();
    // LARS and momentum-SGD keep the same slot, as do LAMB and Adam: the slots alone
    // do not tell the optimizer.
    let kind = state.index.optimizer_kind();
    if held != want || kind != Some(config.optimizer.name()) {
        let slots = |s: &[&str]| match s {
            [] => "no state".to_string(),
            s => format!("state {}", s.join(", ")),
        };
        return Err(RuntimeError::state(format!(
            "the training state was saved by optimizer {} ({}); this plan trains with {} \
             ({}): resume with the optimizer that wrote it, or start afresh",
            kind.unwrap_or(&state.index.optimizer),
            slots(&held),
            config.optimizer.name(),
            slots(&want),
        )));
    }
    // Every trained variable has every slot, of its own type: a slot missing would
    // restart at zero without a word. A variable no gradient reaches (frozen, or one the
    // loss never reads) has none: the optimizer never made them.
    let trained = crate::run::programs::trained_variables(programs);
    for (var, t) in state.params.iter().filter(|(v, _)| trained.contains(*v)) {
        for slot in wanted {
            let key = format!("{var}/{slot}");
            match state.optimizer.get(&key) {
                None => {
                    return Err(RuntimeError::state(format!(
                        "the training state has `{var}` without its optimizer state \
                         `{key}`: the file is damaged or was edited"
                    )))
                }
                Some(s) if s.tensor_type() != t.tensor_type() => {
                    return Err(RuntimeError::state(format!(
                        "the training state's `{key}` is {}, its variable `{var}` {}: the \
                         file is damaged or was edited",
                        s.tensor_type(),
                        t.tensor_type()
                    )))
                }
                Some(_) => {}
            }
        }
    }
    if let Some(stray) = state.optimizer.keys().find(|k| {
        k.as_str() != STEP_KEY
            && k.as_str() != LOSS_SCALE_KEY
            && k.rsplit_once('/')
                .is_none_or(|(var, _)| !state.params.contains_key(var))
    }) {
        return Err(RuntimeError::state(format!(
            "the training state holds optimizer state `{stray}` of no variable it holds: \
             the file is damaged or was edited"
        )));
    }
    Ok(())
}

fn require_gpu(gpu: &GpuOptions) -> Result<()> {
    // The emulator needs no library and no GPU (and cannot run NCCL yet: it says so);
    // it is one device.
    let count = if crate::cuda::backend::emulator_requested() {
        1
    } else {
        let dirs = LibDirs::from_env();
        if gpu.collectives == Collectives::Nccl {
            crate::cuda::probe(CudaLib::Nccl, &dirs)?;
        }
        crate::cuda::require_gpu(&dirs)?;
        crate::cuda::device_count(&dirs)?
    };
    let named = match &gpu.gpus {
        Some(list) => list.iter().map(|g| ("--gpus", *g)).collect(),
        None => vec![("--device cuda", gpu.ordinal)],
    };
    if let Some((flag, g)) = named.into_iter().find(|(_, g)| *g >= count) {
        return Err(RuntimeError::Config(format!(
            "{flag}: GPU {g} does not exist; this machine has {count} (0 to {}){}",
            count.saturating_sub(1),
            if crate::cuda::backend::emulator_requested() {
                " under the emulator, which is one GPU"
            } else {
                ""
            }
        )));
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn mpi_ranks<B: crate::core::backend::Backend>(
    programs: Programs<'_>,
    mesh: Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    m: &MpiRun,
    on_step: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    make: &(dyn Fn(Site<'_>, Links<'_>) -> Result<B> + Sync),
) -> Result<Option<TrainReport>> {
    // The plan's servers as the plan's settings count them: every one is a rank.
    let mesh = Mesh {
        servers: m.servers,
        ..mesh
    };
    crate::run::mpi::run_with(programs, mesh, config, opts, m, on_step, make)
}

#[cfg(not(feature = "mpi"))]
fn mpi_ranks<B: crate::core::backend::Backend>(
    _: Programs<'_>,
    _: Mesh,
    _: &RunConfig,
    _: &TrainOptions,
    _: &MpiRun,
    _: &mut dyn FnMut(&StepMetrics) -> Result<()>,
    _: &(dyn Fn(Site<'_>, Links<'_>) -> Result<B> + Sync),
) -> Result<Option<TrainReport>> {
    Err(RuntimeError::Config(NO_MPI.into()))
}

/// What a build without the `mpi` feature says when asked for MPI.
pub const NO_MPI: &str = "--transport mpi: this distc was built without MPI; install OpenMPI \
     (scripts/install-mpi.sh) and build with `cargo build --release --features mpi`";
