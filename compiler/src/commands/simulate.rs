//! `distc simulate` and `distc calibrate` as commands: the flags turned into a target
//! and a link model, the profile taken (from a trace, or from a profiling run here),
//! and the prediction or the fit printed. The model itself is [`crate::simulate`].

use crate::cli::{ExplainFormat, LinkKind, Transport};
use crate::console::{err, out};
use crate::driver::{retarget, Target};
use crate::Plan;
use anyhow::{bail, Context, Result};
use distc_runtime::core::output::write_file;
use distc_runtime::run::memory;
use std::path::{Path, PathBuf};
#[cfg(feature = "mpi")]
use std::time::Duration;

/// `distc simulate`: the plan at `plan_path` predicted on `workers` workers (default:
/// the plan's) of `ranks_per_node` per node, over the links given or calibrated.
#[allow(clippy::too_many_arguments)]
pub fn simulate(
    plan_path: &Path,
    workers: Option<usize>,
    servers: Option<usize>,
    ranks_per_node: Option<usize>,
    links: &[(LinkKind, distc_passes::placement::Link)],
    calibrations: &[(LinkKind, PathBuf)],
    profile_steps: usize,
    (trace, shared_cores): (Option<&Path>, bool),
    data: Option<&Path>,
    format: ExplainFormat,
) -> Result<()> {
    use crate::simulate as sim;
    let (p, programs) = Plan::load(plan_path)?;
    p.check_runnable().map_err(anyhow::Error::msg)?;
    let mut target = Target {
        workers,
        ranks_per_node,
        servers,
        inter: None,
        intra: None,
        data_dir: data.map(Path::to_path_buf),
    };
    let given = given_links(links, calibrations)?;
    target.intra = given.intra;
    target.inter = given.inter;
    let (compiled, settings) = retarget(&p, &target).map_err(anyhow::Error::msg)?;
    let single = sim::single_program(&p, data).map_err(anyhow::Error::msg)?;
    let copy_bandwidth = given
        .copy_bandwidth
        .unwrap_or_else(distc_runtime::comm::calibrate::copy_bandwidth);
    let profile = match trace {
        Some(path) => {
            let spans = sim::read_trace(path).map_err(anyhow::Error::msg)?;
            // A trace of this plan, or of its model on one device (`distc train MODEL
            // --trace`): the one whose ops, with their types, the spans name.
            let traced = match sim::check_spans_of(&programs.worker, &spans) {
                Ok(()) => &programs.worker,
                Err(plan) => match sim::check_spans_of(&single.programs.worker, &spans) {
                    Ok(()) => &single.programs.worker,
                    Err(one) => bail!(
                        "{}: a trace of neither this plan nor its model on one device \
                         (with the plan's batch): against the plan, {plan}; against the \
                         model on one device, {one}",
                        path.display()
                    ),
                },
            };
            if shared_cores && spans.iter().any(|s| s.on_device) {
                bail!(
                    "{}: --shared-cores prices workers sharing a CPU's cores, and this \
                     trace timed its ops on a GPU, a device a worker",
                    path.display()
                );
            }
            sim::profile_of_trace(traced, &spans, path, copy_bandwidth)
                .map_err(anyhow::Error::msg)?
        }
        None => sim::profile_here(&single, profile_steps, data, copy_bandwidth)
            .map_err(anyhow::Error::msg)?,
    };
    let profile = if shared_cores {
        profile.on_shared_cores(sim::Cores::here())
    } else {
        profile
    };
    let touched = crate::verify::rows_touched(compiled.dist.as_ref());
    let rows = memory::expected_rows(&compiled.programs.worker, &touched);
    let mem = memory::estimate(
        &compiled.programs(settings.workers),
        &compiled.config,
        1,
        false,
        &rows,
    )?;
    let links = sim::Links::new(
        settings.intra_link,
        distc_passes::placement::Link {
            bandwidth: settings.bandwidth,
            latency: settings.latency,
        },
    )
    .with_measured(&given.measured);
    let s = match &compiled.programs.pipeline {
        Some(pp) => sim::simulate_pipeline(
            pp,
            &single.programs.worker,
            &settings,
            links,
            &profile,
            mem.per_worker(),
        )
        .map_err(anyhow::Error::msg)?,
        None => sim::simulate(
            &compiled.programs.worker,
            &single.programs.worker,
            &settings,
            links,
            &profile,
            &rows,
            mem.per_worker(),
        ),
    };
    match format {
        ExplainFormat::Json => out(&format!("{}\n", serde_json::to_string_pretty(&s)?)),
        ExplainFormat::Table => out(&s.render(&p, &profile)),
    }
    let largest = s.comms.iter().map(|c| c.bytes).fold(0.0, f64::max);
    if given.calibrated_bytes > 0 && largest > given.calibrated_bytes as f64 {
        err(&format!(
            "note: a collective of {largest:.0} bytes is beyond the calibration's largest \
             buffer ({} bytes): its time is extrapolated (calibrate with \
             --sizes up to it)\n",
            given.calibrated_bytes
        ));
    }
    Ok(())
}

/// The links `--calibration KIND=FILE` and `--link KIND=BW,LAT` give, as `simulate`
/// and the layout search read them.
#[derive(Debug, Default)]
pub struct GivenLinks {
    /// Each kind's line: from `--link`, else from its calibration's fit.
    pub intra: Option<distc_passes::placement::Link>,
    pub inter: Option<distc_passes::placement::Link>,
    /// A calibrated kind's measured ring steps, unless `--link` gave that kind.
    pub measured: crate::simulate::MeasuredSteps,
    /// A calibration's copy bandwidth (the last one read).
    pub copy_bandwidth: Option<f64>,
    /// The largest buffer a calibration timed (0 without one).
    pub calibrated_bytes: usize,
}

/// Reads the calibrations (each checked as `calibrate` could have written it, by
/// field and file) and sets the links given over them: a `--link` is a line, a
/// calibrated link keeps its measured sizes.
pub fn given_links(
    links: &[(LinkKind, distc_passes::placement::Link)],
    calibrations: &[(LinkKind, PathBuf)],
) -> Result<GivenLinks> {
    let mut given = GivenLinks::default();
    let line_given = |kind: LinkKind| links.iter().any(|l| l.0 == kind);
    for (kind, path) in calibrations {
        let text = distc_runtime::core::output::read_regular_text(
            path,
            distc_runtime::core::output::TEXT_INPUT_LIMIT,
        )
        .with_context(|| format!("{}", path.display()))?;
        let c = crate::simulate::Calibration::from_json(&text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        given.copy_bandwidth = Some(c.copy_bandwidth);
        given.calibrated_bytes = given
            .calibrated_bytes
            .max(c.samples.iter().map(|s| s.bytes).max().unwrap_or(0));
        let (steps, messages) = if line_given(*kind) {
            (Vec::new(), Vec::new())
        } else {
            (c.ring_steps(), c.message_times())
        };
        let m = &mut given.measured;
        match kind {
            LinkKind::Intra => {
                (given.intra, m.intra, m.intra_messages) = (Some(c.link), steps, messages)
            }
            LinkKind::Inter => {
                (given.inter, m.inter, m.inter_messages) = (Some(c.link), steps, messages)
            }
        }
    }
    for (kind, l) in links {
        match kind {
            LinkKind::Intra => given.intra = Some(*l),
            LinkKind::Inter => given.inter = Some(*l),
        }
    }
    Ok(given)
}

/// `distc calibrate`: all-reduces of `sizes` bytes (default: 4 KiB to 64 MiB) timed
/// over the transport's ranks, the alpha-beta fit printed and written to `output`.
pub fn calibrate(
    transport: Transport,
    workers: Option<u16>,
    sizes: Vec<usize>,
    reps: usize,
    timeout: f64,
    output: Option<&Path>,
) -> Result<()> {
    use crate::simulate::Calibration;
    if let Some(path) = output {
        distc_runtime::core::output::check_output(path, &[])?;
    }
    let sizes = if sizes.is_empty() {
        (0..8).map(|k| 4096usize << (2 * k)).collect()
    } else {
        sizes
    };
    // Before the sweep: the sizes as it times them, in whole f32s (`--sizes 4,5` is one
    // size twice).
    let timed: Vec<usize> = sizes.iter().map(|b| (b / 4).max(1) * 4).collect();
    crate::simulate::check_sizes(
        &format!(
            "--sizes {}",
            sizes
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        ),
        &timed,
    )
    .map_err(anyhow::Error::msg)?;
    // The in-process ring's size is --workers; under MPI it is mpirun's -np.
    let workers = match (transport, workers) {
        (Transport::Mpi, Some(n)) => bail!(
            "--workers {n} sizes the in-process ring; under --transport mpi the ring is \
             mpirun's ranks (-np)"
        ),
        (_, n) => usize::from(n.unwrap_or(2)),
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
            let s = distc_runtime::comm::calibrate::sweep_in_process(
                workers,
                &sizes,
                reps,
                std::time::Duration::from_secs_f64(timeout),
            )?;
            (Some(s), workers, 1)
        }
        Transport::Mpi => calibrate_mpi(&sizes, reps, timeout)?,
    };
    let Some(sweep) = samples else {
        return Ok(());
    };
    let mut c = Calibration::fit(
        match transport {
            Transport::Inprocess => "inprocess",
            Transport::Mpi => "mpi",
        },
        ranks,
        hosts,
        sweep.all_reduce,
        distc_runtime::comm::calibrate::copy_bandwidth(),
    )
    .map_err(anyhow::Error::msg)?;
    c.messages = sweep.messages;
    c.check().map_err(anyhow::Error::msg)?;
    out(&c.render());
    if let Some(path) = output {
        write_file(path, serde_json::to_string_pretty(&c)?.as_bytes())?;
        err(&format!("wrote {}\n", path.display()));
    }
    Ok(())
}

type CalibrationSamples = (Option<distc_runtime::comm::calibrate::Sweep>, usize, usize);

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
