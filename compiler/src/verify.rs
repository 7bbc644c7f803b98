//! `distc verify`: a synchronous strategy with N workers of batch b must compute what
//! one device computes with batch N*b on the same data and seed. Both are trained for
//! K steps; every variable is compared by its largest difference relative to its
//! largest magnitude. The CLI and the tests call [`verify`]; [`compare`] is the
//! comparison alone.

use crate::driver::{compile_file, CompileError, CompileOptions, Compiled};
use distc_passes::placement::{Precision, RematPolicy, Strategy, StrategyConfig, SyncMode};
#[cfg(feature = "mpi")]
use distc_runtime::run::launch::MpiRun;
use distc_runtime::run::launch::{launch, DeviceChoice, GpuOptions, Launch, TransportChoice};
use distc_runtime::run::train::TrainOptions;
use distc_runtime::{RuntimeError, Tensor};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use thiserror::Error;

/// How to verify.
#[derive(Clone, Debug)]
pub struct VerifyOptions {
    /// The distributed compilation (strategy, workers, servers, flags).
    pub compile: CompileOptions,
    /// Steps to train before comparing (at least 1).
    pub steps: usize,
    /// Largest relative difference allowed.
    pub tolerance: f64,
    /// Bound on any wait for a collective or a server.
    pub timeout: Duration,
    /// Run both sides' workers on this GPU (CUDA backend, collectives through the
    /// host); `None`: the CPU.
    pub device: Option<usize>,
    /// The weights both sides start from (`--init`), by variable name; `None`: the
    /// model's initializers.
    pub init: Option<std::sync::Arc<HashMap<String, Tensor>>>,
}

/// One variable's comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct VarError {
    /// The variable.
    pub name: String,
    /// `max |one - dist| / max |one|`.
    pub relative: f64,
    /// Under 16-bit precision, the same measure between one device in that precision
    /// and one device in f32: the precision's own effect on this variable.
    pub precision_effect: Option<f64>,
    /// In f32, both runs against one device in float64: the verdict's yardstick.
    pub rounding: Option<Rounding>,
    /// The least the tolerance is taken to be for the plan's 16-bit parts: the
    /// arithmetic type's own relative tolerance (torch.testing's: 1.6e-2 for bf16,
    /// 1e-3 for f16) and the gradient wire's (1e-2 for bf16, 2e-3 for f16); 0 in f32.
    pub half_rtol: f64,
}

/// How far an f32 layout and one device in f32 are from one device in float64, the
/// same weights, data and steps (issue 67, item 6): f32's rounding, measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rounding {
    /// `max |one device f64 - layout| / max |one device f64|`.
    pub layout: f64,
    /// `max |one device f64 - one device f32| / max |one device f64|`: the floor, what
    /// f32 itself changes on one device.
    pub floor: f64,
    /// The floor is at least [`NOISE_FLOOR`]: one device's f32 value is mostly its own
    /// rounding, so f32 cannot say whether the layout trains this variable right (a
    /// key bias before a softmax: its gradient is zero but for rounding, which Adam
    /// turns into whole steps).
    pub noise: bool,
}

/// A layout in f32 is right when it is no farther from float64 than one device in f32
/// is, up to this factor: two f32 runs that round differently each stray from the
/// float64 one by about the floor, and a layout's sums in other orders add their own.
pub const FLOOR_FACTOR: f64 = 4.0;

/// The least the floor is taken to be, relative: a few f32 units in the last place
/// (2^-24 each) of a variable's largest element, so that a variable one device's f32
/// happens to get exactly right still allows a layout its own last-place rounding.
pub const FLOOR_MIN: f64 = 16.0 / 16_777_216.0;

/// A floor this large (half the variable's largest magnitude) makes a variable's f32
/// value noise: see [`Rounding::noise`].
pub const NOISE_FLOOR: f64 = 0.5;

impl Rounding {
    /// What the layout may be from float64: [`FLOOR_FACTOR`] times the floor (at least
    /// [`FLOOR_MIN`]).
    pub fn allowed(&self) -> f64 {
        FLOOR_FACTOR * self.floor.max(FLOOR_MIN)
    }
}

impl VarError {
    /// The most `relative` may be by default: the tolerance (at least the 16-bit
    /// types' own), plus twice the precision's own effect under 16 bits (two runs
    /// rounding differently each stray from the f32 one by about that much).
    pub fn allowed(&self, tolerance: f64) -> f64 {
        tolerance.max(self.half_rtol) + 2.0 * self.precision_effect.unwrap_or(0.0)
    }

    /// Whether the default verdict passes this variable: in f32 against float64, within
    /// [`Rounding::allowed`] (or the tolerance itself, one device matched outright), a
    /// noise variable never failing; else within [`VarError::allowed`].
    pub fn passes(&self, tolerance: f64) -> bool {
        match self.rounding {
            Some(r) => r.noise || r.layout <= r.allowed() || self.relative <= FLOOR_MIN,
            None => self.relative <= self.allowed(tolerance),
        }
    }

    /// How far beyond its default allowance this variable is (at most 1 passes); a
    /// noise variable's is 0.
    pub fn share(&self, tolerance: f64) -> f64 {
        let ratio = |x: f64, allowed: f64| match () {
            _ if x.is_nan() => f64::INFINITY,
            _ if allowed > 0.0 => x / allowed,
            _ if x > 0.0 => f64::INFINITY,
            _ => 0.0,
        };
        match self.rounding {
            Some(r) if r.noise => 0.0,
            Some(r) if self.passes(tolerance) => ratio(r.layout, r.allowed()).min(1.0),
            Some(r) => ratio(r.layout, r.allowed()),
            None => ratio(self.relative, self.allowed(tolerance)),
        }
    }

    /// What decides [`VarError::allowed`], in words: `tolerance`, the 16-bit floor,
    /// or either plus the precision's effect.
    pub fn allowance(&self, tolerance: f64) -> String {
        if let Some(r) = self.rounding {
            return format!(
                "{:.2e} = {FLOOR_FACTOR} x {:.2e} (one device's f32 rounding)",
                r.allowed(),
                r.floor.max(FLOOR_MIN)
            );
        }
        let floor = if self.half_rtol > tolerance {
            format!("{:.1e} (16-bit floor)", self.half_rtol)
        } else {
            format!("{tolerance:.1e} (tolerance)")
        };
        match self.precision_effect {
            Some(e) => format!(
                "{:.2e} = {floor} + 2 x {e:.2e} (precision effect)",
                self.allowed(tolerance)
            ),
            None => floor,
        }
    }
}

/// The relative tolerance of a 16-bit gradient wire against one device: what the
/// README states for a bf16 and an fp16 wire (half the bits of each summand's
/// mantissa, rounded once per worker and hop).
pub fn wire_rtol(wire: Precision) -> f64 {
    match wire {
        Precision::Fp32 => 0.0,
        Precision::Bf16 => 1e-2,
        Precision::Fp16 => 2e-3,
    }
}

/// What verification found.
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// The strategy checked.
    pub strategy: Strategy,
    /// Workers N.
    pub workers: usize,
    /// The one-device batch N*b.
    pub global_batch: usize,
    /// The micro-batches the one device splits it into (`--accumulate`): a pipeline's,
    /// where the model computes statistics over the batch axis (each micro-batch's own
    /// in the pipeline); under fp16 every part the layout splits a step into (its
    /// workers' batches and micro-batches); else 1.
    pub micro_batches: usize,
    /// Why the one device splits its batch, for people (empty when it does not).
    pub split_reason: &'static str,
    /// Steps trained.
    pub steps: usize,
    /// Every variable, by name.
    pub vars: Vec<VarError>,
    /// The tolerance.
    pub tolerance: f64,
    /// Where the model breaks what data parallelism assumes, if it does.
    pub assumptions: Vec<String>,
}

impl VerifyReport {
    /// What `v` may differ by: an explicit `--tolerance` decides alone; by default each
    /// variable's own [`VarError::allowed`].
    pub fn allowed_for(&self, v: &VarError, explicit: Option<f64>) -> f64 {
        explicit.unwrap_or_else(|| v.allowed(self.tolerance))
    }

    /// The variable that decides the verdict: the largest error relative to its own
    /// allowance (allowances differ per variable under 16 bits, so the largest
    /// error alone may pass while a smaller one fails).
    pub fn worst_within(&self, explicit: Option<f64>) -> Option<&VarError> {
        let share = |v: &VarError| match explicit {
            Some(allowed) if allowed > 0.0 => v.relative / allowed,
            Some(_) if v.relative > 0.0 => f64::INFINITY,
            Some(_) => 0.0,
            None => v.share(self.tolerance),
        };
        self.vars.iter().max_by(|a, b| {
            share(a)
                .total_cmp(&share(b))
                .then(a.relative.total_cmp(&b.relative))
        })
    }

    /// [`VerifyReport::worst_within`] each variable's default allowance.
    pub fn worst(&self) -> Option<&VarError> {
        self.worst_within(None)
    }

    /// Whether every variable is within the tolerance (and, under 16 bits, within its
    /// precision's own effect, twice).
    pub fn passed(&self) -> bool {
        !self.vars.is_empty() && self.vars.iter().all(|v| v.passes(self.tolerance))
    }

    /// Whether every variable is within `tolerance` itself, whatever the precision:
    /// what an explicit `--tolerance` asks.
    pub fn passed_within(&self, tolerance: f64) -> bool {
        !self.vars.is_empty() && self.vars.iter().all(|v| v.relative <= tolerance)
    }
}

/// Why verification could not run.
#[derive(Debug, Error)]
pub enum VerifyError {
    /// The flags do not describe something verification can check.
    #[error("{0}")]
    Refused(String),
    /// The model did not compile.
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// A run failed.
    #[error(transparent)]
    Run(#[from] RuntimeError),
    /// The two runs do not hold the same variables.
    #[error("{0}")]
    Mismatch(String),
}

/// `max |a - b| / max |a|` of every variable of `one`, against `dist`.
pub fn compare(
    one: &HashMap<String, Tensor>,
    dist: &HashMap<String, Tensor>,
) -> Result<Vec<VarError>, String> {
    let mut names: Vec<&String> = one.keys().collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let a = one[name].to_f64_vec();
            let b = dist
                .get(name)
                .ok_or_else(|| format!("the distributed run has no variable `{name}`"))?
                .to_f64_vec();
            if a.len() != b.len() {
                return Err(format!(
                    "variable `{name}` has {} elements on one device and {} distributed",
                    a.len(),
                    b.len()
                ));
            }
            let scale = a.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-12);
            let diff = a
                .iter()
                .zip(&b)
                .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
            // NaN anywhere is a failure, never a pass.
            let relative = if diff.is_nan() {
                f64::INFINITY
            } else {
                diff / scale
            };
            Ok(VarError {
                name: name.clone(),
                relative,
                precision_effect: None,
                rounding: None,
                half_rtol: 0.0,
            })
        })
        .collect()
}

/// Both sides' workers on the CPU, or on one GPU: workers sharing it exchange through
/// the host; one worker alone (or workers on GPUs of their own) use NCCL where found.
/// Every step eager: verify compares computations, not replays.
fn device_choice(opts: &VerifyOptions) -> DeviceChoice {
    match opts.device {
        None => DeviceChoice::Cpu,
        Some(ordinal) => DeviceChoice::Cuda(GpuOptions {
            ordinal,
            graphs: false,
            ..GpuOptions::default()
        }),
    }
}

/// How each side of a verify trains `c` on `workers` workers: the same steps, data
/// and (under `--init`) starting weights, whatever the transport (issue 67, item 3:
/// the distributed side under MPI started from the seed's values, not the file's).
fn train_options(
    c: &Compiled,
    opts: &VerifyOptions,
    workers: usize,
) -> Result<TrainOptions, VerifyError> {
    let mut train = TrainOptions {
        steps: Some(opts.steps),
        data_dir: opts.compile.data_dir.clone(),
        global_data: true,
        // Verification compares weights: no evaluation, so no evaluation data needed.
        evaluate: false,
        timeout: opts.timeout,
        ..TrainOptions::default()
    };
    if let Some(weights) = &opts.init {
        let (state, _) = distc_runtime::run::state::state_from_weights(
            &c.programs(workers),
            &c.config,
            (weights, &[]),
            false,
        )
        .map_err(|e| VerifyError::Refused(format!("--init: {e}")))?;
        train.resume = Some(std::sync::Arc::new(state));
    }
    Ok(train)
}

/// One side's run: its variables at the end, and the steps a loss scale skipped.
struct Side {
    params: HashMap<String, Tensor>,
    skipped: usize,
    /// Each step's global gradient norm before clipping, where `clip_norm` measured it.
    grad_norms: Vec<Option<f64>>,
}

impl Side {
    /// The gradient norms of every step as a tensor, when every step measured one.
    fn grad_norm_series(&self) -> Option<Tensor> {
        let norms: Option<Vec<f64>> = self.grad_norms.iter().copied().collect();
        let norms = norms.filter(|n| !n.is_empty())?;
        Some(Tensor::vector_f64(norms))
    }
}

/// The name of the verdict's line for each step's gradient norm: a uniform scale of
/// the gradient (a sum for a mean, a micro-batch scale) that AdamW and clipping hide
/// from the weights shows in it.
pub const GRAD_NORM: &str = "(grad norm)";

/// `sides`' variables and, where every side measured them, their gradient norms as
/// one more entry, [`GRAD_NORM`].
fn with_grad_norms(side: &Side, others: &[&Side]) -> HashMap<String, Tensor> {
    let mut all = side.params.clone();
    let series = std::iter::once(side)
        .chain(others.iter().copied())
        .map(Side::grad_norm_series)
        .collect::<Option<Vec<_>>>();
    if let Some(mine) = series.and_then(|s| s.into_iter().next()) {
        all.insert(GRAD_NORM.to_string(), mine);
    }
    all
}

fn run(c: &Compiled, opts: &VerifyOptions, workers: usize) -> Result<Side, VerifyError> {
    let train = train_options(c, opts, workers)?;
    let run = Launch {
        programs: c.programs(workers),
        config: &c.config,
        opts: train,
        device: device_choice(opts),
        transport: TransportChoice::InProcess,
        rows_touched: rows_touched(c.dist.as_ref()),
    };
    launch_side(&run)?
        .ok_or_else(|| VerifyError::Mismatch("the in-process run gave no report".into()))
}

/// `run` launched: its side, where this process reports one (an MPI rank but 0 does
/// not).
fn launch_side(run: &Launch<'_>) -> Result<Option<Side>, VerifyError> {
    let mut skipped = 0;
    let mut grad_norms = Vec::new();
    let report = launch(run, &mut |m| {
        skipped = m.skipped_steps.unwrap_or(0);
        grad_norms.push(m.grad_norm);
        Ok(())
    })?;
    Ok(report.map(|r| Side {
        params: r.params,
        skipped,
        grad_norms,
    }))
}

/// The rows a batch touches of each sparse variable, as the compiler measured them.
pub fn rows_touched(dist: Option<&distc_passes::placement::DistPlan>) -> HashMap<String, f64> {
    dist.iter()
        .flat_map(|d| &d.vars)
        .map(|v| (v.name.clone(), v.rows_touched))
        .collect()
}

/// Refuses options that compare nothing.
fn check(opts: &VerifyOptions) -> Result<(), VerifyError> {
    let s = &opts.compile.strategy;
    // One device against itself compares something only when a rewrite changed the
    // program: gradient accumulation, recomputation or kernel fusion.
    let rewritten =
        s.accumulate > 1 || s.remat != RematPolicy::Off || s.fuse || s.pipeline > 1 || s.model > 1;
    if s.strategy == Strategy::Single && !rewritten {
        return Err(VerifyError::Refused(
            "verify compares a distributed strategy, --pipeline, --accumulate, --remat or --fuse \
             with one plain device: give --strategy allreduce, ps, hybrid or auto, or one of \
             those flags"
                .into(),
        ));
    }
    if s.sync != SyncMode::Sync {
        return Err(VerifyError::Refused(format!(
            "verify compares synchronous strategies with one device; --sync {} is not synchronous",
            s.sync
        )));
    }
    if opts.steps == 0 {
        return Err(VerifyError::Refused(
            "--steps 0 compares nothing: give at least 1".into(),
        ));
    }
    if !opts.tolerance.is_finite() || opts.tolerance < 0.0 {
        return Err(VerifyError::Refused(format!(
            "--tolerance {} is not a finite number of at least 0",
            opts.tolerance
        )));
    }
    Ok(())
}

/// Trains `file` on one device with batch N*b and with the strategy of
/// `opts.compile` (N workers of batch b, threads of this process), same data and seed,
/// and compares them.
pub fn verify(file: &Path, opts: &VerifyOptions) -> Result<VerifyReport, VerifyError> {
    check(opts)?;
    let dist = compile_file(file, &opts.compile)?;
    let many = run(&dist, opts, opts.compile.strategy.workers)?;
    one_device_against(file, opts, &dist, &many)
}

/// [`verify`] with the distributed run as this process's rank of an `mpirun` job
/// (`mpirun -np N+S distc verify ... --transport mpi`). Rank 0 trains the one device
/// afterwards and returns the report; the other ranks return `None`.
#[cfg(feature = "mpi")]
pub fn verify_mpi(file: &Path, opts: &VerifyOptions) -> Result<Option<VerifyReport>, VerifyError> {
    check(opts)?;
    let dist = compile_file(file, &opts.compile)?;
    let plan = crate::Plan::new(&dist, &file.display().to_string(), &opts.compile.strategy);
    let workers = opts.compile.strategy.workers;
    let run = Launch {
        programs: dist.programs(workers),
        config: &dist.config,
        opts: train_options(&dist, opts, workers)?,
        device: device_choice(opts),
        transport: TransportChoice::Mpi(MpiRun {
            plan_hash: plan.hash,
            servers: opts.compile.strategy.servers,
            metrics: None,
            trace: None,
            command: std::env::args().collect::<Vec<_>>().join(" "),
        }),
        rows_touched: rows_touched(dist.dist.as_ref()),
    };
    match launch_side(&run)? {
        Some(many) => Ok(Some(one_device_against(file, opts, &dist, &many)?)),
        None => Ok(None),
    }
}

/// Trains one device with the global batch and compares it with `many`.
fn one_device_against(
    file: &Path,
    opts: &VerifyOptions,
    dist: &Compiled,
    many: &Side,
) -> Result<VerifyReport, VerifyError> {
    let s = &opts.compile.strategy;
    // A pipeline's N workers are N/P replicas of its P stages; a mesh's model axis
    // trains T workers on one batch; accumulation and a pipeline add micro-batches.
    let global_batch = dist.config.batch * s.batches_per_step();
    let (micro_batches, split_reason) = if s.precision == Precision::Fp16 {
        // Issue 67, item 7: each part of an fp16 step computes its 16-bit values for
        // its own samples, which round (and, at a kink, branch) otherwise than one
        // batch of them all: the one device splits its batch the same way.
        (
            s.batches_per_step(),
            "fp16: the layout's parts, each with its own 16-bit rounding",
        )
    } else if s.pipeline > 1 && !dist.assumptions.is_empty() {
        // A pipeline's stage normalises each micro-batch with its own statistics
        // (`batch_norm(sync = false)`): the one device runs the same micro-batches.
        (
            s.micro_batches.max(1),
            "the pipeline's, each with its own statistics",
        )
    } else {
        (1, "")
    };
    // One device in the same precision: a bf16 plan is checked against bf16.
    let single_opts = CompileOptions {
        batch: Some(global_batch / micro_batches),
        data_dir: opts.compile.data_dir.clone(),
        strategy: StrategyConfig {
            precision: s.precision,
            accumulate: micro_batches,
            ..StrategyConfig::default()
        },
        promote_f64: opts.compile.promote_f64,
        overrides: opts.compile.overrides.clone(),
        ..Default::default()
    };
    let single = compile_file(file, &single_opts)?;
    let one = run(&single, opts, 1)?;
    // Issue 67, item 5: a verify of fp16 steps all skipped compared the starting
    // weights with themselves, and passed.
    for (who, side) in [("one device", &one), ("the layout", many)] {
        if side.skipped >= opts.steps {
            return Err(VerifyError::Mismatch(format!(
                "{who} skipped all {} steps (the loss scale overflowed in each): both sides \
                 hold their starting weights, so nothing was checked; give more --steps, \
                 or a model whose fp16 gradients fit",
                opts.steps
            )));
        }
    }
    let one_side = one;
    let one = one_side.params.clone();
    let mut vars = compare(&one, &many.params).map_err(VerifyError::Mismatch)?;
    if s.precision != Precision::Fp32 {
        // The yardstick of a 16-bit plan: how far one device in 16 bits strays from
        // one device in f32, variable by variable.
        let f32_opts = CompileOptions {
            strategy: StrategyConfig {
                accumulate: micro_batches,
                ..StrategyConfig::default()
            },
            ..single_opts.clone()
        };
        let full = run(&compile_file(file, &f32_opts)?, opts, 1)?.params;
        let effect = compare(&full, &one).map_err(VerifyError::Mismatch)?;
        let half_rtol = if s.precision == Precision::Bf16 {
            1.6e-2
        } else {
            1e-3
        };
        for (v, e) in vars.iter_mut().zip(effect) {
            v.precision_effect = Some(e.relative);
            v.half_rtol = half_rtol;
        }
    }
    for v in &mut vars {
        v.half_rtol = v.half_rtol.max(wire_rtol(s.grad_wire));
    }
    // A 16-bit wire rounds on purpose: its own allowance judges it.
    if s.precision == Precision::Fp32 && s.grad_wire == Precision::Fp32 && !opts.compile.promote_f64
    {
        // Issue 67, item 6: f32's own rounding, measured on one device against its
        // float64 copy (on the CPU: devices compute in f32), is what the layout may
        // differ by.
        let f64_opts = CompileOptions {
            promote_f64: true,
            ..single_opts.clone()
        };
        let on_cpu = VerifyOptions {
            device: None,
            ..opts.clone()
        };
        let wide = run(&compile_file(file, &f64_opts)?, &on_cpu, 1)?;
        let sides = [&one_side, many];
        let (wide, one, many) = (
            with_grad_norms(&wide, &sides),
            with_grad_norms(&one_side, &[&wide, many]),
            with_grad_norms(many, &[&wide, &one_side]),
        );
        vars = compare(&one, &many).map_err(VerifyError::Mismatch)?;
        let floor = compare(&wide, &one).map_err(VerifyError::Mismatch)?;
        let layout = compare(&wide, &many).map_err(VerifyError::Mismatch)?;
        for ((v, f), l) in vars.iter_mut().zip(floor).zip(layout) {
            v.rounding = Some(Rounding {
                layout: l.relative,
                floor: f.relative,
                noise: f.relative >= NOISE_FLOOR,
            });
        }
    }
    if vars.is_empty() {
        return Err(VerifyError::Mismatch("the model has no variables".into()));
    }
    Ok(VerifyReport {
        strategy: s.strategy,
        workers: s.workers,
        global_batch,
        micro_batches,
        split_reason,
        steps: opts.steps,
        vars,
        tolerance: opts.tolerance,
        assumptions: single.assumptions,
    })
}
