//! `distc plot`: pictures of training runs drawn from their `--metrics` files.
//!
//! A metrics file holds one JSON object per step, as `distc train/run --metrics FILE`
//! writes it ([`distc_runtime::run::metrics::StepMetrics`]): `step`, `loss`,
//! `samples_per_sec` and `memory` by category; steps that evaluated add `eval_loss`
//! and `eval_accuracy` (classification) or `eval_rmse` (regression). A non-finite
//! number is written as `null` (a run stopped on a NaN loss); such points are left out.
//!
//! The picture is a grid of panels, every run overlaid in its own colour: loss, each
//! evaluation metric that some run has, samples/s, and memory. Memory is one panel
//! per run, its categories stacked: the categories of several runs as lines on one
//! axis would be a tangle of flat, overlapping lines, while stacked areas show at a
//! glance what a worker's memory is made of and how runs differ in total. A panel
//! whose quantity some run has but none has a drawable point says "no data".
//!
//! Text needs a font even in SVG (plotters measures labels to lay out the axes).
//! DejaVu Sans is compiled in (`compiler/assets/`, its licence beside it), so PNG
//! output works on a machine without fonts and the build needs no fontconfig or
//! system headers; the cost is about 0.75 MB of binary.

use distc_runtime::core::output::{check_output, write_file};
use distc_runtime::run::memory::MemoryByCategory;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// DejaVu Sans (Bitstream Vera licence: `compiler/assets/DejaVuSans-LICENSE`).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// The family [`FONT`] is registered under: its own name, which the SVG's
/// `font-family` carries, so a viewer draws the font the labels were measured with.
const FAMILY: &str = "DejaVu Sans";

/// Width of the picture; two panels side by side.
const WIDTH: u32 = 1200;
/// Height of one row of panels.
const ROW_HEIGHT: u32 = 340;

/// Colours of runs, in the order of the files (Tableau 10: distinct for the colour
/// blind and in grey print).
const RUN_COLOURS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Colours of memory categories, in [`MemoryByCategory::named`] order, then any other
/// category a newer runtime writes (by name); the same category has the same colour
/// in every run's panel.
const CATEGORY_COLOURS: [RGBColor; 7] = [
    RGBColor(78, 121, 167),
    RGBColor(242, 142, 43),
    RGBColor(89, 161, 79),
    RGBColor(225, 87, 89),
    RGBColor(176, 122, 161),
    RGBColor(118, 183, 178),
    RGBColor(237, 201, 72),
];

const MIB: f64 = 1024.0 * 1024.0;

/// Width of the memory panels' legend, beside the stack rather than over it.
const MEMORY_LEGEND_WIDTH: u32 = 130;

/// Grid lines: there to read values off, not to be looked at.
const GRID: RGBColor = RGBColor(225, 225, 225);

/// Evaluation metrics, each a panel of its own (their scales differ): key, title.
const EVAL_METRICS: [(&str, &str); 3] = [
    ("eval_loss", "eval loss"),
    ("eval_accuracy", "eval accuracy"),
    ("eval_rmse", "eval RMSE"),
];

/// A loss panel goes to a log axis by itself when its values span more than this
/// many times over ...
const LOG_SPAN: f64 = 1e3;
/// ... or a run's loss rises above this many times its first value: a run diverged,
/// and on a linear axis it would squash every other run flat.
const DIVERGED: f64 = 10.0;

/// What `distc plot` may be asked besides its files.
#[derive(Clone, Debug, Default)]
pub struct PlotOptions {
    /// Legend label of each run, in the order of the files; empty: the file names.
    pub labels: Vec<String>,
    /// The loss panels on a log axis, whatever their values.
    pub log_y: bool,
}

/// What was drawn.
#[derive(Clone, Debug, Default)]
pub struct Plotted {
    /// The panels' titles, in reading order.
    pub panels: Vec<String>,
    /// What the picture alone does not say: a panel put on a log axis by itself, values
    /// a log axis left out.
    pub notes: Vec<String>,
}

/// Why no picture was drawn.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// A metrics file could not be read.
    #[error("{path}: cannot read the metrics file: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a step line of a metrics file.
    #[error("{path}:{line}: {message}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        message: String,
    },
    /// A file has no step at all.
    #[error(
        "{path}: holds no step lines (a metrics file is written by \
         `distc train/run --metrics FILE`, one JSON object per step)"
    )]
    NoSteps {
        /// The file.
        path: PathBuf,
    },
    /// The output's extension names no format we draw.
    #[error("{path}: cannot tell the picture format; give a file name ending in .svg or .png")]
    Format {
        /// The output path.
        path: PathBuf,
    },
    /// `--label` given, but not once per file.
    #[error(
        "{labels} --label given for {files} metrics files: give one per file, in order, or none"
    )]
    Labels {
        /// Labels given.
        labels: usize,
        /// Files given.
        files: usize,
    },
    /// No files given.
    #[error("no metrics files given")]
    NoInputs,
    /// plotters failed (a bug of ours or of plotters, not of the input).
    #[error("cannot draw the picture: {0}")]
    Draw(String),
    /// PNG encoding failed.
    #[error("cannot encode the PNG: {0}")]
    Encode(String),
    /// The output was refused or could not be written.
    #[error(transparent)]
    Output(#[from] distc_runtime::RuntimeError),
}

/// Picture formats, chosen by the output's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
}

impl Format {
    /// How lines reach this format's backend.
    fn strokes(self) -> Strokes {
        match self {
            Format::Svg => Strokes::Polyline,
            Format::Png => Strokes::Segments,
        }
    }

    fn of(path: &Path) -> Result<Format, PlotError> {
        let ext = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match ext.as_deref() {
            Some("svg") => Ok(Format::Svg),
            Some("png") => Ok(Format::Png),
            _ => Err(PlotError::Format {
                path: path.to_path_buf(),
            }),
        }
    }
}

/// How a line series is handed to the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strokes {
    /// One polyline per series: an SVG viewer strokes it itself.
    Polyline,
    /// One 2-pixel segment at a time, kept a pixel inside the plotting area. plotters'
    /// bitmap backend turns a wide polyline into one polygon: every sharp turn of a
    /// noisy series spikes its outline (out of the panel, unclipped), and where the
    /// outline crosses itself the even-odd fill leaves holes (a line of speckles).
    Segments,
}

/// `(step, value)` points of one quantity of one run.
type Points = Vec<(f64, f64)>;

/// One metrics file, as series over steps.
#[derive(Debug, Default)]
struct Run {
    label: String,
    loss: Points,
    samples_per_sec: Points,
    /// By key of [`EVAL_METRICS`]; absent when the run never reported it.
    eval: BTreeMap<&'static str, Points>,
    /// By category, in drawing order; bytes. Every category has a point at every step
    /// that reported memory (0 where a line lacked it), so they stack point by point.
    memory: Vec<(String, Points)>,
    /// A pipelined run: its lines' memory is replica 0's stages summed, not one
    /// worker's.
    pipelined: bool,
}

/// A number under `key`: `None` when absent or `null` (non-finite when written).
fn number(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("`{key}` is {v}, not a number")),
    }
}

/// Reads one metrics file into a run labelled `label`.
fn read_run(path: &Path, label: String) -> Result<Run, PlotError> {
    let text = distc_runtime::core::output::read_regular_text(
        path,
        distc_runtime::core::output::TEXT_INPUT_LIMIT,
    )
    .map_err(|source| PlotError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let known: Vec<&str> = MemoryByCategory::default()
        .named()
        .iter()
        .map(|(n, _)| *n)
        .collect();
    let mut run = Run {
        label,
        ..Run::default()
    };
    // Steps that reported memory, and each category's bytes at those steps.
    let mut memory_steps: Vec<f64> = Vec::new();
    let mut memory: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut steps = 0usize;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let malformed = |message: String| PlotError::Malformed {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let value: Value =
            serde_json::from_str(line).map_err(|e| malformed(format!("not a JSON line: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| malformed("not a JSON object".into()))?;
        let step = obj
            .get("step")
            .and_then(Value::as_u64)
            .ok_or_else(|| malformed("no `step` (a whole number): not a step line".into()))?
            as f64;
        if !obj.contains_key("loss") {
            return Err(malformed("no `loss`: not a step line".into()));
        }
        let loss = number(obj, "loss").map_err(malformed)?;
        let samples = number(obj, "samples_per_sec").map_err(malformed)?;
        run.loss.extend(loss.map(|v| (step, v)));
        run.samples_per_sec.extend(samples.map(|v| (step, v)));
        for (key, _) in EVAL_METRICS {
            if obj.contains_key(key) {
                let points = run.eval.entry(key).or_default();
                points.extend(number(obj, key).map_err(malformed)?.map(|v| (step, v)));
            }
        }
        run.pipelined |= obj.get("pipeline").is_some_and(|p| !p.is_null());
        match obj.get("memory") {
            None | Some(Value::Null) => {}
            Some(Value::Object(m)) => {
                let row = memory_steps.len();
                memory_steps.push(step);
                for category in m.keys() {
                    let bytes =
                        number(m, category).map_err(|e| malformed(format!("in `memory`: {e}")))?;
                    let values = memory
                        .entry(category.clone())
                        .or_insert_with(|| vec![0.0; row]);
                    values.push(bytes.unwrap_or(0.0));
                }
                for values in memory.values_mut() {
                    values.resize(row + 1, 0.0);
                }
            }
            Some(v) => {
                return Err(malformed(format!(
                    "`memory` is {v}, not an object of bytes by category"
                )))
            }
        }
        steps += 1;
    }
    if steps == 0 {
        return Err(PlotError::NoSteps {
            path: path.to_path_buf(),
        });
    }
    // The runtime's order (params at the bottom of the stack), then the rest by name.
    let points =
        |values: Vec<f64>| -> Points { memory_steps.iter().copied().zip(values).collect() };
    for name in &known {
        if let Some(values) = memory.remove(*name) {
            run.memory.push((name.to_string(), points(values)));
        }
    }
    run.memory.extend(
        memory
            .into_iter()
            .map(|(name, values)| (name, points(values))),
    );
    Ok(run)
}

/// Legend labels: the given ones, or each file's name; the path as written where two
/// files share a name (`a/metrics.jsonl`, `b/metrics.jsonl`).
fn labels(inputs: &[PathBuf], given: &[String]) -> Result<Vec<String>, PlotError> {
    if !given.is_empty() {
        if given.len() != inputs.len() {
            return Err(PlotError::Labels {
                labels: given.len(),
                files: inputs.len(),
            });
        }
        return Ok(given.to_vec());
    }
    let names: Vec<String> = inputs
        .iter()
        .map(|p| {
            p.file_name().map_or_else(
                || p.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            )
        })
        .collect();
    Ok(names
        .iter()
        .zip(inputs)
        .map(|(n, p)| {
            if names.iter().filter(|m| *m == n).count() > 1 {
                p.display().to_string()
            } else {
                n.clone()
            }
        })
        .collect())
}

/// One panel of the grid.
enum Panel<'a> {
    /// One line per run.
    Lines {
        title: String,
        y_label: &'static str,
        /// `(run index, label, points)`.
        series: Vec<(usize, &'a str, &'a Points)>,
        /// Dots on the points: evaluations are few and far apart.
        markers: bool,
        /// A log y axis (loss panels only).
        log_y: bool,
    },
    /// One run's memory, categories stacked (bytes, drawn in MiB).
    Memory {
        run: usize,
        label: &'a str,
        /// The run is pipelined: its memory is its stages' summed.
        stages: bool,
        categories: &'a [(String, Points)],
        /// The colour of each category: one colour per category name over all runs.
        colours: Vec<RGBColor>,
        /// Top of the axis in MiB, shared by every run's memory panel so that their
        /// heights compare.
        top_mib: f64,
    },
}

impl Panel<'_> {
    fn title(&self) -> String {
        match self {
            Panel::Lines { title, .. } => title.clone(),
            Panel::Memory {
                label,
                stages: true,
                ..
            } => format!("memory of replica 0's stages, summed: {label}"),
            Panel::Memory { label, .. } => format!("memory of worker 0: {label}"),
        }
    }
}

/// The finite values of a panel's series.
fn values<'a>(series: &'a [(usize, &str, &Points)]) -> impl Iterator<Item = f64> + 'a {
    series
        .iter()
        .flat_map(|s| s.2.iter().map(|p| p.1))
        .filter(|v| v.is_finite())
}

/// Why a loss panel goes to a log axis without `--log-y`: its values span more than
/// [`LOG_SPAN`] times over, or a run's loss rose above [`DIVERGED`] times its first
/// value. `None`: it stays linear, as it does whenever a value is 0 or below (a log
/// axis would leave it out).
fn diverged(series: &[(usize, &str, &Points)]) -> Option<String> {
    if values(series).any(|v| v <= 0.0) {
        return None;
    }
    let (lo, hi) = values(series).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if hi > LOG_SPAN * lo {
        return Some(format!(
            "its values span {} to {}, more than {LOG_SPAN}x",
            short(lo),
            short(hi)
        ));
    }
    series.iter().find_map(|&(_, label, points)| {
        let mut finite = points.iter().map(|p| p.1).filter(|v| v.is_finite());
        let first = finite.next()?;
        let top = finite.fold(first, f64::max);
        (top > DIVERGED * first).then(|| {
            format!(
                "{label} rose from {} to {}, above {DIVERGED}x its first value",
                short(first),
                short(top)
            )
        })
    })
}

/// A number for a note: three significant digits.
fn short(v: f64) -> String {
    let a = v.abs();
    if (1e-3..1e5).contains(&a) {
        let decimals = (2 - a.log10().floor() as i32).clamp(0, 5) as usize;
        format!("{v:.decimals$}")
    } else {
        format!("{v:.2e}")
    }
}

/// The panels the runs call for, in reading order; a loss panel put on a log axis, or
/// values one leaves out, noted in `notes`.
fn panels<'a>(runs: &'a [Run], log_y: bool, notes: &mut Vec<String>) -> Vec<Panel<'a>> {
    let mut lines =
        |title: &str, y_label, markers, loss: bool, get: &dyn Fn(&Run) -> Option<&Points>| {
            let series: Vec<(usize, &str, &Points)> = runs
                .iter()
                .enumerate()
                .filter_map(|(i, r)| get(r).map(|p| (i, r.label.as_str(), p)))
                .collect();
            let log_y = loss
                && (log_y
                    || diverged(&series).is_some_and(|why| {
                        notes.push(format!(
                            "{title}: on a log axis, as {why} (--log-y asks for it always)"
                        ));
                        true
                    }));
            let left_out = values(&series).filter(|v| *v <= 0.0).count();
            if log_y && left_out > 0 {
                notes.push(format!(
                    "{title}: {left_out} values at or below 0 left out of the log axis"
                ));
            }
            Panel::Lines {
                title: title.to_string(),
                y_label,
                series,
                markers,
                log_y,
            }
        };
    let mut panels = vec![lines("training loss", "loss", false, true, &|r| {
        Some(&r.loss)
    })];
    for (key, title) in EVAL_METRICS {
        if runs.iter().any(|r| r.eval.contains_key(key)) {
            let loss = key == "eval_loss";
            panels.push(lines(title, "", true, loss, &|r| r.eval.get(key)));
        }
    }
    panels.push(lines("throughput", "samples/s", false, false, &|r| {
        Some(&r.samples_per_sec)
    }));
    if runs.iter().any(|r| !r.memory.is_empty()) {
        let known = MemoryByCategory::default().named().map(|(name, _)| name);
        let others: BTreeSet<&str> = runs
            .iter()
            .flat_map(|r| &r.memory)
            .map(|(name, _)| name.as_str())
            .filter(|name| !known.contains(name))
            .collect();
        let colour = |name: &str| {
            let index = known
                .iter()
                .position(|k| *k == name)
                .or_else(|| {
                    others
                        .iter()
                        .position(|o| *o == name)
                        .map(|i| known.len() + i)
                })
                .unwrap_or(0);
            CATEGORY_COLOURS[index % CATEGORY_COLOURS.len()]
        };
        let top_mib = runs
            .iter()
            .flat_map(|r| {
                let steps = r.memory.first().map_or(0, |(_, p)| p.len());
                (0..steps).map(|i| {
                    r.memory
                        .iter()
                        .map(|(_, p)| p.get(i).map_or(0.0, |q| q.1))
                        .sum::<f64>()
                })
            })
            .fold(0.0, f64::max)
            / MIB;
        for (i, r) in runs.iter().enumerate() {
            panels.push(Panel::Memory {
                run: i,
                label: &r.label,
                stages: r.pipelined,
                categories: &r.memory,
                colours: r.memory.iter().map(|(name, _)| colour(name)).collect(),
                top_mib,
            });
        }
    }
    panels
}

/// Draws `inputs` (metrics files, one run each) into `output` (`.svg` or `.png`).
pub fn plot(
    inputs: &[PathBuf],
    output: &Path,
    options: &PlotOptions,
) -> Result<Plotted, PlotError> {
    if inputs.is_empty() {
        return Err(PlotError::NoInputs);
    }
    let format = Format::of(output)?;
    let input_refs: Vec<&Path> = inputs.iter().map(PathBuf::as_path).collect();
    check_output(output, &input_refs)?;
    let runs = labels(inputs, &options.labels)?
        .into_iter()
        .zip(inputs)
        .map(|(label, path)| read_run(path, label))
        .collect::<Result<Vec<_>, _>>()?;
    let mut notes = Vec::new();
    let panels = panels(&runs, options.log_y, &mut notes);
    register_font(FAMILY, FontStyle::Normal, FONT)
        .map_err(|_| PlotError::Draw("the bundled font is not a font".into()))?;
    let rows = panels.len().div_ceil(2) as u32;
    let size = (WIDTH, ROW_HEIGHT * rows);
    let bytes = match format {
        Format::Svg => {
            let mut svg = String::new();
            draw(
                SVGBackend::with_string(&mut svg, size).into_drawing_area(),
                &panels,
                format.strokes(),
            )?;
            svg.into_bytes()
        }
        Format::Png => {
            let mut rgb = vec![0u8; size.0 as usize * size.1 as usize * 3];
            draw(
                BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area(),
                &panels,
                format.strokes(),
            )?;
            encode_png(&rgb, size)?
        }
    };
    write_file(output, &bytes)?;
    Ok(Plotted {
        panels: panels.iter().map(Panel::title).collect(),
        notes,
    })
}

fn encode_png(rgb: &[u8], (width, height): (u32, u32)) -> Result<Vec<u8>, PlotError> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let encode = |e: png::EncodingError| PlotError::Encode(e.to_string());
    let mut writer = encoder.write_header().map_err(encode)?;
    writer.write_image_data(rgb).map_err(encode)?;
    writer.finish().map_err(encode)?;
    Ok(out)
}

/// plotters' errors carry the backend's error type; ours is a message.
fn drawing<E: std::fmt::Display>(e: E) -> PlotError {
    PlotError::Draw(e.to_string())
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    panels: &[Panel],
    strokes: Strokes,
) -> Result<(), PlotError> {
    root.fill(&WHITE).map_err(drawing)?;
    let rows = panels.len().div_ceil(2);
    let areas = root.split_evenly((rows, 2));
    for (panel, area) in panels.iter().zip(&areas) {
        match panel {
            Panel::Lines {
                title,
                y_label,
                series,
                markers,
                log_y,
            } => draw_lines(area, title, y_label, series, *markers, *log_y, strokes)?,
            Panel::Memory {
                run,
                categories,
                colours,
                top_mib,
                ..
            } => draw_memory(area, &panel.title(), *run, categories, colours, *top_mib)?,
        }
    }
    root.present().map_err(drawing)
}

/// The largest magnitude an axis spans: beyond it the axis's span, its padding or its
/// ticks overflow to infinity, and drawing such an axis never ends.
const AXIS_LIMIT: f64 = 1e300;

/// A range around the finite `values` with a little room, never empty and never
/// beyond [`AXIS_LIMIT`] (a loss of 1e308 is drawn at the edge); `None` when no value
/// is finite.
fn range(values: impl Iterator<Item = f64>, from_zero: bool) -> Option<std::ops::Range<f64>> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .map(|v| v.clamp(-AXIS_LIMIT, AXIS_LIMIT))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    let lo = if from_zero { lo.min(0.0) } else { lo };
    let pad = if hi > lo {
        (hi - lo) * 0.05
    } else {
        (hi.abs() * 0.1).max(1e-9)
    };
    Some(
        (if from_zero && lo >= 0.0 {
            0.0
        } else {
            lo - pad
        })..hi + pad,
    )
}

/// The smallest value a log axis reaches down to (a loss of 5e-324 is drawn at it).
const LOG_FLOOR: f64 = 1e-300;

/// The most decades a log axis spans.
const LOG_DECADES: f64 = 24.0;

/// A log axis's range around the positive finite `values`, a twentieth of its decades
/// to spare at each end (half a decade around a single value), within [`LOG_FLOOR`]
/// and [`AXIS_LIMIT`], and out to the powers of ten around it where it holds none
/// (plotters' log ticks start at a power of ten: 2 to 8 would get no tick at all);
/// `None` when no value is positive.
fn log_range(values: impl Iterator<Item = f64>) -> Option<std::ops::Range<f64>> {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(|v| v.clamp(LOG_FLOOR, AXIS_LIMIT).log10())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    let pad = if hi > lo { (hi - lo) * 0.05 } else { 0.5 };
    let (least, most) = (LOG_FLOOR.log10(), AXIS_LIMIT.log10());
    let (mut lo, mut hi) = ((lo - pad).max(least), (hi + pad).min(most));
    // plotters lays out every decade's ticks: hundreds of decades (1e-320 beside 3e38
    // in a damaged file) took minutes. Below the top's LOG_DECADES the axis stops.
    lo = lo.max(hi - LOG_DECADES);
    if lo.ceil() > hi {
        (lo, hi) = (lo.floor(), hi.ceil());
    }
    Some(10f64.powf(lo)..10f64.powf(hi))
}

fn steps_range<'a>(points: impl Iterator<Item = &'a Points>) -> Option<std::ops::Range<f64>> {
    let (lo, hi) = points
        .flatten()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
            (lo.min(p.0), hi.max(p.0))
        });
    if !lo.is_finite() {
        return None;
    }
    // One step still gets a visible axis.
    Some(lo..hi.max(lo + 1.0))
}

/// How many step ticks an axis of `steps` gets: about ten, and never more than the
/// whole steps it spans (fractional ticks would print as repeated whole numbers).
fn step_labels(steps: &std::ops::Range<f64>) -> usize {
    ((steps.end - steps.start).floor() as usize + 1).clamp(2, 10)
}

/// Steps are whole numbers: 1200, not 1200.00.
fn step_tick(v: f64) -> String {
    if v.abs() >= 1e5 {
        tick(v, v)
    } else {
        format!("{v:.0}")
    }
}

/// Axis ticks short enough for the margin (12345 -> "12.3k") and with as many
/// decimals as the axis's `span` needs to tell ticks apart (0.82, 0.84; 2, 4).
fn tick(v: f64, span: f64) -> String {
    let a = v.abs();
    if a >= 1e9 {
        format!("{v:.1e}")
    } else if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else {
        // About ten ticks: their spacing is a tenth of the span.
        let decimals = (-(span / 10.0).log10().floor()).clamp(0.0, 6.0) as usize;
        format!("{v:.decimals$}")
    }
}

/// A log axis's ticks: 1, 2, ... 9 times a power of ten ("0.02", "3", "10k", "1M"),
/// tiny ones as "1e-5".
fn log_tick(v: f64) -> String {
    let a = v.abs();
    if !(1e-3..1e9).contains(&a) {
        return format!("{v:.0e}");
    }
    let (v, suffix) = if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    // Two significant digits, then what is zero dropped (0.30000000000000004: "0.3").
    let decimals = (1 - v.abs().log10().floor() as i32).max(0) as usize;
    let digits = format!("{v:.decimals$}");
    let digits = if digits.contains('.') {
        digits.trim_end_matches('0').trim_end_matches('.')
    } else {
        &digits
    };
    format!("{digits}{suffix}")
}

/// Where the legend hides the least: away from where the series end, which is where
/// a reader looks (loss ends low, accuracy high).
fn legend_position(
    series: &[(usize, &str, &Points)],
    y: &std::ops::Range<f64>,
    log_y: bool,
) -> SeriesLabelPosition {
    let at = |v: f64| if log_y { v.max(y.start).log10() } else { v };
    let ends: Vec<f64> = series
        .iter()
        .filter_map(|s| s.2.last())
        .map(|p| at(p.1))
        .collect();
    let mean = ends.iter().sum::<f64>() / ends.len().max(1) as f64;
    if mean > at(y.start) + (at(y.end) - at(y.start)) * 2.0 / 3.0 {
        SeriesLabelPosition::LowerRight
    } else {
        SeriesLabelPosition::UpperRight
    }
}

fn no_data<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
) -> Result<(), PlotError> {
    let (w, h) = area.dim_in_pixel();
    area.draw_text(title, &(FAMILY, 20).into_font().color(&BLACK), (10, 10))
        .map_err(drawing)?;
    area.draw_text(
        "no data",
        &(FAMILY, 18).into_font().color(&RGBColor(127, 127, 127)),
        (w as i32 / 2 - 30, h as i32 / 2),
    )
    .map_err(drawing)
}

#[allow(clippy::too_many_arguments)]
fn draw_lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    y_label: &str,
    series: &[(usize, &str, &Points)],
    markers: bool,
    log_y: bool,
    strokes: Strokes,
) -> Result<(), PlotError> {
    let x = steps_range(series.iter().map(|s| s.2));
    let y = if log_y {
        log_range(values(series))
    } else {
        range(values(series), false)
    };
    let (Some(x), Some(y)) = (x, y) else {
        return no_data(area, title);
    };
    let lines = Lines {
        series,
        markers,
        strokes,
        x_labels: step_labels(&x),
        legend: legend_position(series, &y, log_y),
        y: y.clone(),
        log_y,
    };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, (FAMILY, 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60);
    if log_y {
        let chart = builder
            .build_cartesian_2d(x, y.log_scale())
            .map_err(drawing)?;
        let y_label = if y_label.is_empty() {
            "log scale".to_string()
        } else {
            format!("{y_label} (log scale)")
        };
        lines.draw(chart, &y_label, &|v| log_tick(*v))
    } else {
        let span = y.end - y.start;
        let chart = builder.build_cartesian_2d(x, y).map_err(drawing)?;
        lines.draw(chart, y_label, &|v| tick(*v, span))
    }
}

/// A line panel's series and how to draw them, on a linear or a log y axis.
struct Lines<'a> {
    series: &'a [(usize, &'a str, &'a Points)],
    markers: bool,
    strokes: Strokes,
    x_labels: usize,
    legend: SeriesLabelPosition,
    y: std::ops::Range<f64>,
    log_y: bool,
}

impl Lines<'_> {
    fn draw<'c, DB: DrawingBackend + 'c, Y: Ranged<ValueType = f64> + ValueFormatter<f64>>(
        self,
        mut chart: ChartContext<'c, DB, Cartesian2d<RangedCoordf64, Y>>,
        y_label: &str,
        y_tick: &dyn Fn(&f64) -> String,
    ) -> Result<(), PlotError> {
        let (ylo, yhi, log_y) = (self.y.start, self.y.end, self.log_y);
        // What is drawn stays on the axis: a value past it (a loss of 1e308) at its
        // edge, a non-finite one left out (plotters' pixel arithmetic overflows
        // otherwise), and so is one at or below 0 on a log axis.
        let on_axis = move |&(x, v): &(f64, f64)| {
            (v.is_finite() && (!log_y || v > 0.0)).then(|| (x, v.clamp(ylo, yhi)))
        };
        chart
            .configure_mesh()
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .label_style((FAMILY, 12))
            .x_desc("step")
            .x_labels(self.x_labels)
            .y_desc(y_label)
            .x_label_formatter(&|v| step_tick(*v))
            .y_label_formatter(y_tick)
            .draw()
            .map_err(drawing)?;
        for &(run, label, points) in self.series {
            let colour = RUN_COLOURS[run % RUN_COLOURS.len()];
            let line = match self.strokes {
                Strokes::Polyline => points.iter().filter_map(on_axis).collect(),
                Strokes::Segments => {
                    draw_segments(
                        chart.plotting_area(),
                        points.iter().filter_map(on_axis),
                        colour.stroke_width(2),
                    )?;
                    Vec::new()
                }
            };
            // The legend entry comes with a series; for segments it is an empty one.
            chart
                .draw_series(LineSeries::new(line, colour.stroke_width(2)))
                .map_err(drawing)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2))
                });
            if self.markers {
                chart
                    .draw_series(
                        points
                            .iter()
                            .filter_map(on_axis)
                            .map(|p| Circle::new(p, 3, colour.filled())),
                    )
                    .map_err(drawing)?;
            }
        }
        chart
            .configure_series_labels()
            .position(self.legend)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(190, 190, 190))
            .label_font((FAMILY, 14))
            .draw()
            .map_err(drawing)
    }
}

/// A line through `points` drawn one segment at a time (see [`Strokes::Segments`]).
fn draw_segments<DB: DrawingBackend, CT: CoordTranslate<From = (f64, f64)>>(
    area: &DrawingArea<DB, CT>,
    points: impl Iterator<Item = (f64, f64)>,
    style: ShapeStyle,
) -> Result<(), PlotError> {
    let (x0, y0) = area.get_base_pixel();
    let (w, h) = area.dim_in_pixel();
    // A stroke reaches half its width past its points: keep them that far inside.
    let r = (style.stroke_width / 2) as i32;
    let (right, bottom) = ((w as i32 - 1 - r).max(r), (h as i32 - 1 - r).max(r));
    let mut pixels: Vec<(i32, i32)> = points
        .map(|p| {
            let (x, y) = area.map_coordinate(&p);
            ((x - x0).clamp(r, right), (y - y0).clamp(r, bottom))
        })
        .collect();
    // Many steps share a pixel on a long run; a segment of no length draws nothing.
    pixels.dedup();
    let screen = area.strip_coord_spec();
    for pair in pixels.windows(2) {
        screen
            .draw(&PathElement::new(pair.to_vec(), style))
            .map_err(drawing)?;
    }
    Ok(())
}

/// `colour` a third of the way to white: fills that do not shout over the lines.
fn lighter(RGBColor(r, g, b): RGBColor) -> RGBColor {
    let up = |c: u8| c + (255 - c) / 3;
    RGBColor(up(r), up(g), up(b))
}

fn draw_memory<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    run: usize,
    categories: &[(String, Points)],
    colours: &[RGBColor],
    top_mib: f64,
) -> Result<(), PlotError> {
    // Categories that are zero throughout (comm_buffers on one device) would only
    // crowd the legend.
    let shown: Vec<(&(String, Points), RGBColor)> = categories
        .iter()
        .zip(colours.iter().copied())
        .filter(|((_, p), _)| p.iter().any(|q| q.1 != 0.0))
        .collect();
    // Stacked: the top of category k at a step is the sum of categories 0..=k (the
    // categories' points are aligned step by step: see `Run::memory`).
    let mut tops: Vec<Points> = Vec::with_capacity(shown.len());
    for ((_, points), _) in &shown {
        let below = tops.last();
        let top: Points = points
            .iter()
            .enumerate()
            .map(|(i, &(step, bytes))| {
                (
                    step,
                    below.and_then(|b| b.get(i)).map_or(0.0, |b| b.1) + bytes / MIB,
                )
            })
            .collect();
        tops.push(top);
    }
    let x = steps_range(tops.iter());
    let y = range(tops.iter().flatten().map(|p| p.1).chain([top_mib]), true);
    let (Some(x), Some(y)) = (x, y) else {
        return no_data(area, title);
    };
    let span = y.end - y.start;
    let x_labels = step_labels(&x);
    let (width, _) = area.dim_in_pixel();
    let (plot_area, legend_area) =
        area.split_horizontally(width.saturating_sub(MEMORY_LEGEND_WIDTH));
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(
            title,
            (FAMILY, 20)
                .into_font()
                .color(&RUN_COLOURS[run % RUN_COLOURS.len()]),
        )
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x, y)
        .map_err(drawing)?;
    chart
        .configure_mesh()
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .label_style((FAMILY, 12))
        .x_desc("step")
        .x_labels(x_labels)
        .y_desc("MiB")
        .x_label_formatter(&|v| step_tick(*v))
        .y_label_formatter(&|v| tick(*v, span))
        .draw()
        .map_err(drawing)?;
    // Top band first, each lower one painted over it, so band k shows category k.
    // Opaque: translucent bands painted over one another would mix their colours.
    for ((_, colour), top) in shown.iter().zip(&tops).rev() {
        chart
            .draw_series(
                AreaSeries::new(top.iter().copied(), 0.0, lighter(*colour).filled())
                    .border_style(*colour),
            )
            .map_err(drawing)?;
    }
    // The legend reads top to bottom as the stack does.
    let font = (FAMILY, 14).into_font().color(&BLACK);
    for (row, ((name, _), colour)) in shown.iter().rev().enumerate() {
        let y = 50 + 22 * row as i32;
        legend_area
            .draw(&Rectangle::new(
                [(4, y - 7), (20, y + 7)],
                lighter(*colour).filled(),
            ))
            .map_err(drawing)?;
        legend_area
            .draw_text(name, &font, (26, y - 8))
            .map_err(drawing)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_from_extension() {
        assert_eq!(Format::of(Path::new("a.SVG")).ok(), Some(Format::Svg));
        assert_eq!(Format::of(Path::new("a/b.png")).ok(), Some(Format::Png));
        assert!(Format::of(Path::new("a.jpg")).is_err());
        assert!(Format::of(Path::new("a")).is_err());
    }

    #[test]
    fn labels_fall_back_to_paths_when_names_clash() {
        let files = [
            PathBuf::from("a/m.jsonl"),
            PathBuf::from("b/m.jsonl"),
            PathBuf::from("c.jsonl"),
        ];
        let got = labels(&files, &[]).ok();
        assert_eq!(
            got,
            Some(vec![
                "a/m.jsonl".to_string(),
                "b/m.jsonl".into(),
                "c.jsonl".into()
            ])
        );
        assert!(matches!(
            labels(&files, &["x".into()]),
            Err(PlotError::Labels {
                labels: 1,
                files: 3
            })
        ));
    }

    #[test]
    fn a_few_steps_get_one_tick_per_whole_step_at_most() {
        // Evaluations on steps 30 and 31 only: ticks 30, 30.1, ... printed as "30 30 30
        // 31 31" before.
        assert_eq!(step_labels(&(30.0..31.0)), 2);
        assert_eq!(step_labels(&(1.0..5.0)), 5);
        assert_eq!(step_labels(&(0.0..1000.0)), 10);
    }

    #[test]
    fn log_ticks_are_short_and_free_of_float_noise() {
        assert_eq!(log_tick(0.1 * 3.0), "0.3");
        assert_eq!(log_tick(0.002), "0.002");
        assert_eq!(log_tick(1.0), "1");
        assert_eq!(log_tick(20.0), "20");
        assert_eq!(log_tick(1000.0), "1000");
        assert_eq!(log_tick(2e4), "20k");
        assert_eq!(log_tick(1e7), "10M");
        assert_eq!(log_tick(1e-5), "1e-5");
    }

    #[test]
    fn a_log_range_holds_a_power_of_ten_and_only_positive_values() {
        let r = log_range([2.0, 8.0, 0.0, -1.0, f64::NAN].into_iter());
        assert_eq!(r, Some(1.0..10.0));
        let r = log_range([0.01, 100.0].into_iter()).expect("a range");
        assert!(r.start < 0.01 && r.start > 0.005 && r.end > 100.0 && r.end < 200.0);
        assert_eq!(log_range([0.0, -2.0].into_iter()), None);
        // The least subnormal and the largest float still make a finite range.
        let r = log_range([5e-324, f64::MAX].into_iter()).expect("a range");
        assert!(r.start > 0.0 && r.end.is_finite());
        // The cli fuzz target's hang: 1e-320 beside 3.4e38 made a 358-decade axis,
        // whose ticks plotters laid out for minutes. The axis keeps the top decades.
        let r = log_range([1e-320, 3.4e38].into_iter()).expect("a range");
        let decades = (r.end / r.start).log10();
        assert!(decades <= LOG_DECADES + 1e-9 && r.end >= 3.4e38, "{r:?}");
    }

    #[test]
    fn a_run_diverged_when_its_loss_spans_1000x_or_rises_10x() {
        let steady: Points = (1..=40).map(|i| (i as f64, 2.3 / i as f64)).collect();
        let blown: Points = (0..40).map(|i| (i as f64, 2.3 * 1.5f64.powi(i))).collect();
        let rising: Points = (0..40).map(|i| (i as f64, 2.0 + i as f64)).collect();
        let mut negative = steady.clone();
        negative.push((41.0, -1.0));
        negative.push((42.0, 1e9));
        assert_eq!(diverged(&[(0, "s", &steady)]), None);
        assert!(diverged(&[(0, "s", &steady), (1, "b", &blown)])
            .is_some_and(|why| why.contains("more than 1000x")));
        assert!(diverged(&[(0, "r", &rising)]).is_some_and(|why| why.contains("r rose")));
        // A value at or below 0 keeps the axis linear: a log one would leave it out.
        assert_eq!(diverged(&[(0, "n", &negative)]), None);
    }

    #[test]
    fn ticks_are_short() {
        assert_eq!(tick(12345.0, 2e4), "12.3k");
        assert_eq!(tick(2.5e6, 3e6), "2.5M");
        assert_eq!(tick(0.84, 0.12), "0.84");
        assert_eq!(tick(4.0, 12.0), "4");
        assert_eq!(tick(0.0, 1.0), "0.0");
    }
}
