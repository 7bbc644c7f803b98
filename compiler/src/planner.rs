//! `--strategy auto` without parameter servers: the search over the layouts of N
//! workers. Every data x model x pipe mesh of N, the pipeline's micro-batches, the
//! ZeRO stage and activation recomputation are enumerated; each candidate is compiled
//! (the compiler's refusals reject it, by their message), its memory per worker
//! estimated as `explain` estimates it (over the budget: rejected), and its step
//! priced by [`crate::simulate`] from one profile of the model on this machine. The
//! fastest that fits is the plan.
//!
//! Every candidate trains the same global batch a step, the one N data-parallel
//! workers of the model's batch b train (N b samples): a replica of T x P workers
//! takes N b / D samples a step, in M micro-batches of N b / (D M) under a pipeline.
//! A candidate whose micro-batch would not be a whole number of samples is rejected.
//! The precision is the user's: the search changes the arithmetic only among the
//! precisions the user lists (`--search-precision fp32,bf16`), each profiled here.

use crate::driver::compiled_settings;
use crate::plan::{Candidate, Search, Verdict};
use crate::simulate::{self as sim, ComputeProfile, Links};
use distc_passes::placement::{Link, Precision, Strategy, StrategyConfig};
use distc_passes::Verify;
use distc_runtime::run::memory;
use std::path::Path;

/// The largest model axis and pipeline the search tries.
const MAX_AXIS: usize = 8;

/// Where the search takes its op times from.
#[derive(Clone, Copy, Debug)]
pub enum OpTimes<'a> {
    /// A profiling run of the model on one worker of this machine, of `steps` steps.
    Here { steps: usize },
    /// A trace of the model on one device (`distc train MODEL --trace FILE`), such as
    /// a GPU's, whose ops are timed on the device: the search then prices that device.
    Trace(&'a std::path::Path),
}

/// How the search prices a candidate beyond the user's settings: where its op times
/// come from, and the ring steps of calibrated links (`--calibration`).
#[derive(Clone, Debug)]
pub struct Pricing<'a> {
    pub op_times: OpTimes<'a>,
    pub measured: sim::MeasuredSteps,
    /// A calibration's copy bandwidth (bytes/s), else one measured here.
    pub copy_bandwidth: Option<f64>,
}

impl Pricing<'_> {
    /// The search's default: op times from a profile here, links as given.
    pub fn here() -> Pricing<'static> {
        Pricing {
            op_times: OpTimes::Here {
                steps: PROFILE_STEPS,
            },
            measured: Default::default(),
            copy_bandwidth: None,
        }
    }
}

/// Steps of the search's profiling run (the first left out).
const PROFILE_STEPS: usize = 3;

/// The search for `file` on `workers` workers from the user's settings `base` (their
/// links, nodes, fixed ZeRO stage if `zero` is given), within `memory_budget` bytes
/// a worker if given, in each of `precisions` (none: the user's): the pick's settings
/// and the search.
pub fn search(
    file: &Path,
    opts: &crate::CompileOptions,
    workers: usize,
    zero: Option<u8>,
    memory_budget: Option<u128>,
    pricing: &Pricing<'_>,
    precisions: &[Precision],
) -> Result<(crate::Compiled, StrategyConfig, Search), String> {
    let start = std::time::Instant::now();
    let base = &opts.strategy;
    let compile = |settings: &StrategyConfig, batch: usize| {
        crate::compile_file(
            file,
            &crate::CompileOptions {
                batch: Some(batch),
                strategy: settings.clone(),
                dump_ir: None,
                // Dozens of plans of one model: each verified once, not after each pass.
                verify: Verify::AtEnd,
                ..opts.clone()
            },
        )
    };
    let mut precisions = precisions.to_vec();
    if precisions.is_empty() {
        precisions.push(base.precision);
    }
    precisions.dedup();
    // Each precision's one-device program and its profile here: the op times the
    // candidates of that precision are priced with.
    let mut profiled = Vec::new();
    for &precision in &precisions {
        let single = crate::compile_file(
            file,
            &crate::CompileOptions {
                // One device: no nodes, no ZeRO (the layouts' settings, not its).
                strategy: StrategyConfig {
                    strategy: Strategy::Single,
                    workers: 1,
                    precision,
                    ranks_per_node: 0,
                    zero: 0,
                    ..base.clone()
                },
                dump_ir: None,
                verify: Verify::AtEnd,
                ..opts.clone()
            },
        )
        .map_err(|e| format!("{precision}: {e}"))?;
        let copies = pricing
            .copy_bandwidth
            .unwrap_or_else(distc_runtime::comm::calibrate::copy_bandwidth);
        let profile = match pricing.op_times {
            OpTimes::Here { steps } => {
                // The layouts' workers run on machines like this one: sharing a node's
                // cores, they are priced slower than the one profiled alone.
                sim::profile_here(&single, steps, opts.data_dir.as_deref(), copies)?
                    .on_shared_cores(sim::Cores::here())
            }
            OpTimes::Trace(path) => {
                let spans = sim::read_trace(path)?;
                let g = &single.programs.worker;
                sim::check_spans_of(g, &spans).map_err(|e| {
                    format!(
                        "{}: not a trace of the model on one device at {precision} \
                         (`distc train MODEL --trace FILE`, with the model's batch): {e}",
                        path.display()
                    )
                })?;
                sim::profile_of_trace(g, &spans, path, copies)?
            }
        };
        profiled.push((precision, single, profile));
    }
    // The model's batch b.
    let b = profiled[0].1.config.batch;
    let global = workers * b;
    // Every candidate, and those to price: (position, settings, profile).
    let mut candidates = Vec::new();
    let mut to_price: Vec<(usize, StrategyConfig, usize)> = Vec::new();
    for (k, (precision, _, _)) in profiled.iter().enumerate() {
        for &(data, model, pipe, micro_batches, z, remat) in &layouts(workers, zero) {
            let mut c = Candidate {
                data,
                model,
                pipe,
                micro_batches,
                batch: 0,
                zero: z,
                remat,
                precision: *precision,
                verdict: Verdict::Refused {
                    reason: String::new(),
                },
            };
            let per_step = global / data;
            if !global.is_multiple_of(data) || !per_step.is_multiple_of(micro_batches) {
                c.verdict = Verdict::Refused {
                    reason: format!(
                        "{global} samples a step do not split into {data} replicas \
                         x {micro_batches} micro-batches"
                    ),
                };
            } else {
                c.batch = per_step / micro_batches;
                to_price.push((candidates.len(), c.settings(base), k));
            }
            candidates.push(c);
        }
    }
    // Priced on every core: each compile is independent. Each thread keeps the fastest
    // plan it priced that fits (the plans of a large model do not all fit in memory).
    let priced = price_all(&to_price, memory_budget, |settings, i| {
        let (_, single, profile) = &profiled[to_price[i].2];
        price(
            settings,
            candidates[to_price[i].0].batch,
            &compile,
            (single, profile),
            &pricing.measured,
        )
    });
    let mut best: Option<(usize, f64, crate::Compiled, StrategyConfig)> = None;
    for (i, result, plan) in priced {
        let (index, settings, _) = &to_price[i];
        let c = &mut candidates[*index];
        c.verdict = match result {
            Err(reason) => Verdict::Refused { reason },
            Ok((mem, _)) if memory_budget.is_some_and(|m| mem > m) => Verdict::Memory {
                memory_per_worker: mem,
            },
            Ok((mem, step)) => {
                let rate = global as f64 / step.max(1e-12);
                // The first of equals, as the candidates are listed.
                let better = best
                    .as_ref()
                    .is_none_or(|b| rate > b.1 || (rate == b.1 && *index < b.0));
                if let (true, Some(compiled)) = (better, plan) {
                    best = Some((*index, rate, compiled, compiled_settings(settings)));
                }
                Verdict::Priced {
                    step,
                    samples_per_sec: rate,
                    memory_per_worker: mem,
                }
            }
        };
    }
    let Some((chosen, _, compiled, settings)) = best else {
        let least = candidates
            .iter()
            .filter_map(|c| match c.verdict {
                Verdict::Memory { memory_per_worker } => Some(memory_per_worker),
                _ => None,
            })
            .min();
        return Err(match least {
            Some(m) => format!(
                "no layout of {workers} workers fits in {} a worker: the smallest needs {} \
                 (give --memory-per-worker at least that, or more workers)",
                memory::gib(memory_budget.unwrap_or(0)),
                memory::gib(m)
            ),
            None => format!(
                "no layout of {workers} workers compiles: {}",
                candidates
                    .first()
                    .map(|c| match &c.verdict {
                        Verdict::Refused { reason } => reason.clone(),
                        _ => String::new(),
                    })
                    .unwrap_or_default()
            ),
        });
    };
    let search = Search {
        workers,
        global_batch: global,
        memory_budget,
        candidates,
        chosen,
        profile: profiled
            .iter()
            .map(|(p, _, profile)| match profiled.len() {
                1 => profile.source.clone(),
                _ => format!("{p}: {}", profile.source),
            })
            .collect::<Vec<_>>()
            .join("; "),
        seconds: start.elapsed().as_secs_f64(),
    };
    Ok((compiled, settings, search))
}

/// Prices `jobs` with `price` on every core, in order of index: each job's memory and
/// step (or why it was refused), and the plan of each thread's fastest that fits in
/// `budget` bytes (the caller picks among them; a job whose plan was dropped for a
/// faster one of its thread has `None`).
#[allow(clippy::type_complexity)]
fn price_all<J: Sync>(
    jobs: &[(usize, StrategyConfig, J)],
    budget: Option<u128>,
    price: impl Fn(&StrategyConfig, usize) -> Result<(u128, f64, crate::Compiled), String> + Sync,
) -> Vec<(usize, Result<(u128, f64), String>, Option<crate::Compiled>)> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len())
        .max(1);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut out: Vec<(usize, Result<(u128, f64), String>, Option<crate::Compiled>)> =
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut mine = Vec::new();
                        // This thread's fastest: (step, position in `mine`).
                        let mut fastest: Option<(f64, usize)> = None;
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some((_, settings, _)) = jobs.get(i) else {
                                break;
                            };
                            match price(settings, i) {
                                Err(e) => mine.push((i, Err(e), None)),
                                Ok((mem, step, plan)) => {
                                    let fits = budget.is_none_or(|b| mem <= b);
                                    if fits && fastest.is_none_or(|(f, _)| step < f) {
                                        if let Some((_, at)) = fastest {
                                            let old: &mut (_, _, Option<crate::Compiled>) =
                                                &mut mine[at];
                                            old.2 = None;
                                        }
                                        fastest = Some((step, mine.len()));
                                        mine.push((i, Ok((mem, step)), Some(plan)));
                                    } else {
                                        mine.push((i, Ok((mem, step)), None));
                                    }
                                }
                            }
                        }
                        mine
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        });
    out.sort_by_key(|r| r.0);
    out
}

/// A candidate compiled at micro-batch `batch`: its memory per worker, its predicted
/// step, and the compiled plan.
fn price(
    settings: &StrategyConfig,
    batch: usize,
    compile: &dyn Fn(&StrategyConfig, usize) -> Result<crate::Compiled, crate::CompileError>,
    (single, profile): (&crate::Compiled, &ComputeProfile),
    measured: &sim::MeasuredSteps,
) -> Result<(u128, f64, crate::Compiled), String> {
    // A mesh is priced on the nodes it is simulated on, and compiled without them.
    let compiled_with = compiled_settings(settings);
    compiled_with.check()?;
    let c = compile(&compiled_with, batch).map_err(|e| e.to_string())?;
    let touched = crate::verify::rows_touched(c.dist.as_ref());
    let rows = memory::expected_rows(&c.programs.worker, &touched);
    let mem = memory::estimate(&c.programs(settings.workers), &c.config, 1, false, &rows)
        .map_err(|e| e.to_string())?
        .per_worker();
    let links = Links::new(
        settings.intra_link,
        Link {
            bandwidth: settings.bandwidth,
            latency: settings.latency,
        },
    )
    .with_measured(measured);
    let s = match &c.programs.pipeline {
        Some(pp) => {
            sim::simulate_pipeline(pp, &single.programs.worker, settings, links, profile, mem)?
        }
        None => sim::simulate(
            &c.programs.worker,
            &single.programs.worker,
            settings,
            links,
            profile,
            &rows,
            mem,
        ),
    };
    Ok((mem, s.step, c))
}

/// Every layout of `workers` the search tries: `(data, model, pipe, micro-batches,
/// ZeRO stage, remat)`; the ZeRO stage `zero` alone where given.
fn layouts(workers: usize, zero: Option<u8>) -> Vec<(usize, usize, usize, usize, u8, bool)> {
    let mut out = Vec::new();
    for model in divisors(workers).filter(|&t| t <= MAX_AXIS) {
        for pipe in divisors(workers / model).filter(|&p| p <= MAX_AXIS) {
            let data = workers / (model * pipe);
            let micros: Vec<usize> = if pipe > 1 {
                vec![pipe, 2 * pipe, 4 * pipe]
            } else {
                vec![1]
            };
            let zeros: Vec<u8> = match zero {
                Some(z) => vec![z],
                None if data > 1 => vec![0, 1, 3],
                None => vec![0],
            };
            for &micro in &micros {
                for &z in &zeros {
                    for remat in [false, true] {
                        out.push((data, model, pipe, micro, z, remat));
                    }
                }
            }
        }
    }
    out
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}
