//! `distc plot`: metrics files in, pictures out; and the errors a user meets.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

mod common;

use common::{distc, s, text};

fn tmp(test: &str) -> PathBuf {
    common::temp_dir(&format!("plot-{test}"))
}

/// A step line as `distc train --metrics` writes it, evaluation every 4 steps.
fn step_line(step: usize, loss: f64, samples: f64, activations: u64) -> String {
    let eval = if [4, 8, 12].contains(&step) {
        format!(
            r#","eval_loss":{},"eval_accuracy":{},"eval_samples":1000"#,
            loss * 0.9,
            0.5 + step as f64 / 40.0
        )
    } else {
        String::new()
    };
    format!(
        r#"{{"step":{step},"loss":{loss},"samples_per_sec":{samples},"compute_sec":0.01,"comm_wait_sec":0.0,"bytes_sent":0,"bytes_received":0,"bytes_moved":0{eval},"memory":{{"params":2097152,"gradients":2097152,"optimizer":4194304,"activations":{activations},"comm_buffers":0}}}}"#
    )
}

/// Two runs of 12 steps: `one.jsonl` and `two.jsonl`.
fn two_runs(dir: &Path) -> (PathBuf, PathBuf) {
    let write = |name: &str, scale: f64| {
        let path = dir.join(name);
        let lines: Vec<String> = (1..=12)
            .map(|i| step_line(i, scale * 2.3 / i as f64, 1000.0 * scale, 3 << 20))
            .collect();
        std::fs::write(&path, lines.join("\n") + "\n").expect("write");
        path
    };
    (write("one.jsonl", 1.0), write("two.jsonl", 1.5))
}

#[test]
fn svg_of_two_runs_holds_every_panel_and_both_labels() {
    let dir = tmp("svg");
    let (one, two) = two_runs(&dir);
    let out = dir.join("runs.svg");
    let o = distc(&["plot", s(&one), s(&two), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert!(
        svg.starts_with("<svg") || svg.starts_with("<?xml"),
        "{}",
        &svg[..100.min(svg.len())]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    for needle in [
        "one.jsonl",
        "two.jsonl",
        "training loss",
        "eval loss",
        "eval accuracy",
        "throughput",
        "activations",
        "optimizer",
    ] {
        assert!(svg.contains(needle), "no `{needle}` in the SVG");
    }
    // No regression metric in the files, so no panel for it; comm_buffers is zero
    // throughout, so the legend leaves it out.
    assert!(!svg.contains("eval RMSE"));
    assert!(!svg.contains("comm_buffers"));
    // Lines were drawn: one polyline per run in each of the four line panels.
    assert!(svg.matches("<polyline").count() >= 8, "too few lines drawn");
}

#[test]
fn labels_replace_file_names() {
    let dir = tmp("labels");
    let (one, two) = two_runs(&dir);
    let out = dir.join("runs.svg");
    let o = distc(&[
        "plot",
        s(&one),
        s(&two),
        "-o",
        s(&out),
        "--label",
        "baseline",
        "--label",
        "allreduce x2",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert!(svg.contains("baseline") && svg.contains("allreduce x2"));
    assert!(!svg.contains("one.jsonl"));

    let o = distc(&[
        "plot",
        s(&one),
        s(&two),
        "-o",
        s(&out),
        "--label",
        "only one",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("1 --label given for 2 metrics files"),
        "{}",
        text(&o)
    );
}

#[test]
fn png_has_the_signature_and_real_content() {
    let dir = tmp("png");
    let (one, two) = two_runs(&dir);
    let out = dir.join("runs.png");
    let o = distc(&["plot", s(&one), s(&two), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    let png = std::fs::read(&out).expect("png written");
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    // A blank 1200x1020 picture compresses to a few KB; lines, text and areas do not.
    assert!(png.len() > 20_000, "only {} bytes", png.len());
    // IHDR: width and height, big-endian, right after the signature and chunk header.
    let width = u32::from_be_bytes(png[16..20].try_into().expect("4 bytes"));
    let height = u32::from_be_bytes(png[20..24].try_into().expect("4 bytes"));
    assert_eq!(width, 1200);
    // Six panels (loss, eval loss, eval accuracy, throughput, two memories): 3 rows.
    assert_eq!(height, 3 * 340);
}

#[test]
fn a_run_without_evaluation_or_memory_gets_only_its_panels() {
    let dir = tmp("plain");
    let path = dir.join("plain.jsonl");
    std::fs::write(
        &path,
        "{\"step\":1,\"loss\":1.0,\"samples_per_sec\":10.0}\n\n{\"step\":2,\"loss\":null,\"samples_per_sec\":12.0}\n",
    )
    .expect("write");
    let out = dir.join("plain.svg");
    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("(training loss, throughput)"),
        "{}",
        text(&o)
    );
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert!(!svg.contains("eval") && !svg.contains("memory"));
}

#[test]
fn missing_file_is_named() {
    let dir = tmp("missing");
    let out = dir.join("x.svg");
    let missing = dir.join("nope.jsonl");
    let o = distc(&["plot", s(&missing), "-o", s(&out)]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains(s(&missing)) && t.contains("cannot read"), "{t}");
    assert!(!out.exists());
}

#[test]
fn bad_line_is_located_by_file_and_line() {
    let dir = tmp("bad");
    let path = dir.join("bad.jsonl");
    let lines = [
        step_line(1, 2.0, 10.0, 1),
        step_line(2, 1.5, 10.0, 1),
        "{\"step\":3,\"loss\":".into(),
    ];
    std::fs::write(&path, lines.join("\n")).expect("write");
    let out = dir.join("x.png");
    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains(&format!("{}:3:", path.display())), "{t}");
    assert!(t.contains("not a JSON line"), "{t}");

    std::fs::write(&path, "{\"loss\":1.0}\n").expect("write");
    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(text(&o).contains(":1: no `step`"), "{}", text(&o));

    std::fs::write(&path, "{\"step\":1,\"loss\":\"high\"}\n").expect("write");
    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(
        text(&o).contains("`loss` is \"high\", not a number"),
        "{}",
        text(&o)
    );
    assert!(!out.exists());
}

#[test]
fn empty_file_has_no_step_lines() {
    let dir = tmp("empty");
    let path = dir.join("empty.jsonl");
    std::fs::write(&path, "\n").expect("write");
    let o = distc(&["plot", s(&path), "-o", s(&dir.join("x.svg"))]);
    assert!(!o.status.success());
    assert!(text(&o).contains("holds no step lines"), "{}", text(&o));
}

#[test]
fn unknown_extension_and_bad_targets_are_refused() {
    let dir = tmp("targets");
    let (one, _) = two_runs(&dir);
    let o = distc(&["plot", s(&one), "-o", s(&dir.join("x.jpg"))]);
    assert!(!o.status.success());
    assert!(text(&o).contains("ending in .svg or .png"), "{}", text(&o));
    assert!(!dir.join("x.jpg").exists());

    // A directory named like a picture is not overwritten.
    let folder = dir.join("folder.svg");
    std::fs::create_dir_all(&folder).expect("mkdir");
    let o = distc(&["plot", s(&one), "-o", s(&folder)]);
    assert!(!o.status.success());
    assert!(text(&o).contains("a directory"), "{}", text(&o));
    assert!(folder.is_dir());

    // No files at all: clap's own message.
    let o = distc(&["plot", "-o", s(&dir.join("x.svg"))]);
    assert!(!o.status.success());
}

#[test]
fn an_input_is_never_the_output() {
    let dir = tmp("input");
    let (one, _) = two_runs(&dir);
    // A metrics file that happens to be named like a picture.
    let named_svg = dir.join("metrics.svg");
    std::fs::copy(&one, &named_svg).expect("copy");
    let before = std::fs::read(&named_svg).expect("read");
    let o = distc(&["plot", s(&named_svg), "-o", s(&named_svg)]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("refusing to overwrite an input"),
        "{}",
        text(&o)
    );
    assert_eq!(std::fs::read(&named_svg).expect("read"), before);
}

#[test]
fn a_quantity_without_a_drawable_point_says_no_data() {
    let dir = tmp("nodata");
    let path = dir.join("nan.jsonl");
    // A run stopped on a NaN loss writes `null` for it.
    std::fs::write(
        &path,
        "{\"step\":1,\"loss\":null,\"samples_per_sec\":10.0}\n{\"step\":2,\"loss\":null,\"samples_per_sec\":11.0}\n",
    )
    .expect("write");
    let out = dir.join("nan.svg");
    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert_eq!(
        svg.matches("no data").count(),
        1,
        "only the loss panel is empty"
    );
    assert!(svg.contains("training loss") && svg.contains("throughput"));
}

/// Issue 20: a loss of ±1e308 or samples/s of f64::MAX made the axis span infinite and
/// `distc plot` spun at 100% CPU; axes now stop at ±1e300 and leave non-finite values
/// out. The plot must finish (the test kills it after 60 s) and write the picture.
#[test]
fn extreme_and_non_finite_values_plot_and_end() {
    let dir = tmp("extreme");
    let metrics = dir.join("extreme.jsonl");
    let lines: Vec<String> = [
        (1, 1e308, 1000.0),
        (2, -1e308, f64::MAX),
        (3, 2.0, 1e-300),
        (4, 1.5, 900.0),
    ]
    .iter()
    .map(|&(step, loss, samples)| step_line(step, loss, samples, 3 << 20))
    .collect();
    std::fs::write(&metrics, lines.join("\n") + "\n").expect("write");
    let out = dir.join("extreme.png");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_distc"))
        .args(["plot", s(&metrics), "-o", s(&out)])
        .current_dir(common::root())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starts");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("waits") {
            break st;
        }
        if start.elapsed() > std::time::Duration::from_secs(60) {
            let _ = child.kill();
            panic!("distc plot did not end within 60 s on extreme values");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(out.exists(), "no picture written");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 35, item 12: a pipelined run's memory is its stages' summed, and its title
/// says so (it read "memory of worker 0"); evaluation points on two steps get one
/// tick per step (they read "30 30 30 31 31").
#[test]
fn a_pipelined_runs_memory_says_it_sums_the_stages_and_few_steps_get_whole_ticks() {
    let dir = tmp("stages");
    let path = dir.join("piped.jsonl");
    let lines: Vec<String> = (30..=31)
        .map(|step| {
            let line = step_line(step, 1.0, 100.0, 1 << 20);
            let eval = r#","eval_loss":0.9,"eval_accuracy":0.5"#;
            let pipeline = r#","pipeline":{"bubble":0.2,"stages":[]}}"#;
            format!("{}{eval}{pipeline}", &line[..line.len() - 1])
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").expect("write");
    let out = dir.join("piped.svg");
    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert!(
        svg.contains("memory of replica 0&apos;s stages, summed")
            || svg.contains("memory of replica 0's stages, summed"),
        "title"
    );
    assert!(!svg.contains("memory of worker 0"));
    // Every step tick is a whole step, each printed once per panel's axis.
    let ticks: Vec<&str> = svg
        .split('>')
        .filter_map(|t| t.split('<').next())
        .map(str::trim)
        .filter(|t| *t == "30" || *t == "31" || *t == "30.5")
        .collect();
    let thirty = ticks.iter().filter(|t| **t == "30").count();
    let thirty_one = ticks.iter().filter(|t| **t == "31").count();
    assert!(thirty > 0 && thirty == thirty_one, "ticks: {ticks:?}");
}

/// A picture read back from a PNG, RGB.
struct Picture {
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

/// A rectangle of pixels, `x0..x1` by `y0..y1`.
#[derive(Clone, Copy, Debug)]
struct Rect {
    x0: usize,
    y0: usize,
    x1: usize,
    y1: usize,
}

impl Rect {
    fn contains(&self, x: usize, y: usize) -> bool {
        (self.x0..self.x1).contains(&x) && (self.y0..self.y1).contains(&y)
    }
}

impl Picture {
    fn read(path: &Path) -> Picture {
        let file = std::io::BufReader::new(std::fs::File::open(path).expect("png written"));
        let mut reader = png::Decoder::new(file).read_info().expect("a PNG");
        let mut rgb = vec![0; reader.output_buffer_size().expect("a size")];
        let info = reader.next_frame(&mut rgb).expect("a frame");
        assert_eq!(info.color_type, png::ColorType::Rgb);
        rgb.truncate(info.buffer_size());
        Picture {
            width: info.width as usize,
            height: info.height as usize,
            rgb,
        }
    }

    fn at(&self, x: usize, y: usize) -> [u8; 3] {
        let i = (y * self.width + x) * 3;
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }

    /// The first run's blue (31, 119, 180), whole or blended with white at a line's
    /// edge; grey and black (text, grid, axes) are not.
    fn ink(&self, x: usize, y: usize) -> bool {
        let [r, _, b] = self.at(x, y);
        i32::from(b) - i32::from(r) > 40
    }

    /// The longest straight run of black pixels in `cell`: `(start, end, at)` along
    /// columns (`vertical`) or rows.
    fn longest_black(&self, cell: Rect, vertical: bool) -> (usize, usize, usize) {
        let (outer, inner) = if vertical {
            (cell.x0..cell.x1, cell.y0..cell.y1)
        } else {
            (cell.y0..cell.y1, cell.x0..cell.x1)
        };
        let mut best = (0, 0, 0);
        for a in outer {
            let mut start = None;
            for b in inner.clone().chain([usize::MAX]) {
                let (x, y) = if vertical { (a, b) } else { (b, a) };
                let black = b != usize::MAX && self.at(x, y) == [0, 0, 0];
                match (black, start) {
                    (true, None) => start = Some(b),
                    (false, Some(s)) => {
                        if b - s > best.1 - best.0 {
                            best = (s, b, a);
                        }
                        start = None;
                    }
                    _ => {}
                }
            }
        }
        best
    }

    /// The plotting rectangle of the chart in `cell`: right of its y axis (the longest
    /// black column) and above its x axis (the longest black row).
    fn plotting_rect(&self, cell: Rect) -> Rect {
        let (top, _, y_axis) = self.longest_black(cell, true);
        let (_, right, x_axis) = self.longest_black(cell, false);
        Rect {
            x0: y_axis + 1,
            y0: top,
            x1: right,
            y1: x_axis,
        }
    }

    /// The 8-connected pieces of ink in `rect`, largest first, each as the columns it
    /// reaches.
    fn ink_pieces(&self, rect: Rect) -> Vec<BTreeSet<usize>> {
        let mut seen = vec![false; self.width * self.height];
        let mut pieces = Vec::new();
        for y in rect.y0..rect.y1 {
            for x in rect.x0..rect.x1 {
                if seen[y * self.width + x] || !self.ink(x, y) {
                    continue;
                }
                let mut columns = BTreeSet::new();
                let mut stack = vec![(x, y)];
                seen[y * self.width + x] = true;
                while let Some((px, py)) = stack.pop() {
                    columns.insert(px);
                    for (nx, ny) in [
                        (px.wrapping_sub(1), py.wrapping_sub(1)),
                        (px, py.wrapping_sub(1)),
                        (px + 1, py.wrapping_sub(1)),
                        (px.wrapping_sub(1), py),
                        (px + 1, py),
                        (px.wrapping_sub(1), py + 1),
                        (px, py + 1),
                        (px + 1, py + 1),
                    ] {
                        if rect.contains(nx, ny) && !seen[ny * self.width + nx] && self.ink(nx, ny)
                        {
                            seen[ny * self.width + nx] = true;
                            stack.push((nx, ny));
                        }
                    }
                }
                pieces.push(columns);
            }
        }
        pieces.sort_by_key(|p| std::cmp::Reverse(p.len()));
        pieces
    }
}

/// Issue 36, item 6: a PNG of 3,000 steps drew its lines as speckles, and throughput's
/// zigzag sent spikes out of its panel; plotters turned each whole 2-pixel line into
/// one polygon, spiked at every sharp turn and left blank where it crossed itself.
#[test]
fn png_lines_of_a_long_run_are_connected_and_stay_in_their_panels() {
    let dir = tmp("long");
    let path = dir.join("long.jsonl");
    let lines: Vec<String> = (1..=3000)
        .map(|step| {
            // Noise step to step, as a real run has: every segment turns sharply.
            let sign = if step % 2 == 0 { 1.0 } else { -1.0 };
            let noise = sign * ((step * 7919) % 13) as f64 / 13.0;
            let loss = 2.3 * (-(step as f64) / 800.0).exp() + 0.2 + 0.05 * noise;
            step_line(step + 100, loss, 1000.0 + 300.0 * noise, 3 << 20)
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").expect("write");
    let out = dir.join("long.png");
    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    let picture = Picture::read(&out);
    // Loss and throughput side by side, the memory panel below the loss.
    assert_eq!((picture.width, picture.height), (1200, 2 * 340));
    let cell = |column: usize, row: usize| Rect {
        x0: 600 * column,
        y0: 340 * row,
        x1: 600 * (column + 1),
        y1: 340 * (row + 1),
    };
    let memory = cell(0, 1);
    // The two panels are laid out alike; the loss's axes are the ones a spike of the
    // throughput cannot hide.
    let loss = picture.plotting_rect(cell(0, 0));
    let rects = [
        loss,
        Rect {
            x0: loss.x0 + 600,
            x1: loss.x1 + 600,
            ..loss
        },
    ];
    for (name, rect) in ["loss", "throughput"].iter().zip(rects) {
        assert!(
            rect.x1 > rect.x0 + 400 && rect.y1 > rect.y0 + 200,
            "{name}: plotting area {rect:?}"
        );
        let pieces = picture.ink_pieces(rect);
        // The line runs the whole axis (steps 101 to 3100) as one piece; the only other
        // piece is the legend's sample of it.
        let line = pieces.first().cloned().unwrap_or_default();
        let (first, last) = (line.first().copied(), line.last().copied());
        assert!(
            first.is_some_and(|x| x <= rect.x0 + 2) && last.is_some_and(|x| x + 3 >= rect.x1),
            "{name}: the line's largest piece runs from column {first:?} to {last:?} in {rect:?}"
        );
        assert!(
            pieces.len() <= 2,
            "{name}: the line is broken into {} pieces",
            pieces.len()
        );
    }
    let mut outside = Vec::new();
    for y in 0..picture.height {
        for x in 0..picture.width {
            // The memory panel's title is in the run's colour.
            let allowed = memory.contains(x, y) || rects.iter().any(|r| r.contains(x, y));
            if !allowed && picture.ink(x, y) {
                outside.push((x, y));
            }
        }
    }
    assert!(
        outside.is_empty(),
        "{} pixels of the run's colour outside the plotting areas, first {:?}",
        outside.len(),
        &outside[..outside.len().min(10)]
    );
}

/// Issue 36, item 6: the SVG named a generic `sans-serif`, so a viewer drew its own
/// font, not the one plotters measured the labels with; it names the bundled family.
#[test]
fn svg_names_the_bundled_font() {
    let dir = tmp("font");
    let (one, _) = two_runs(&dir);
    let out = dir.join("font.svg");
    let o = distc(&["plot", s(&one), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    let families: BTreeSet<&str> = svg
        .split("font-family=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .collect();
    assert_eq!(families, BTreeSet::from(["DejaVu Sans"]));
}

/// Writes `losses` as a run's metrics, one step each, throughput a steady 5000/s (its
/// ticks, 4500 to 5500, never read like a loss's).
fn losses_run(path: &Path, losses: &[f64]) {
    let lines: Vec<String> = losses
        .iter()
        .enumerate()
        .map(|(i, loss)| {
            format!(
                r#"{{"step":{},"loss":{loss},"samples_per_sec":5000.0}}"#,
                i + 1
            )
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").expect("write");
}

/// The text of every `<text>` element of an SVG.
fn svg_texts(svg: &str) -> Vec<&str> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| t.split('>').nth(1))
        .filter_map(|t| t.split('<').next())
        .map(str::trim)
        .collect()
}

/// Issue 36, item 6: `--log-y` draws the loss on a log axis; a loss of 0 or below has
/// no place on it and is left out, and the user is told how many.
#[test]
fn log_y_puts_the_loss_on_a_log_axis_and_leaves_out_what_is_not_positive() {
    let dir = tmp("log-y");
    let path = dir.join("loss.jsonl");
    // 10 down to 0.015: under 1000x and never rising, so linear unless asked.
    let mut losses: Vec<f64> = (0..40).map(|i| 10.0 * 0.85f64.powi(i)).collect();
    losses.extend([0.0, -1.0]);
    losses_run(&path, &losses);
    let out = dir.join("loss.svg");

    let o = distc(&["plot", s(&path), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert!(!svg_texts(&svg).contains(&"0.1"), "linear by default");
    assert!(!text(&o).contains("log axis"), "{}", text(&o));

    let o = distc(&["plot", s(&path), "-o", s(&out), "--log-y"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("training loss: 2 values at or below 0 left out of the log axis"),
        "{}",
        text(&o)
    );
    let svg = std::fs::read_to_string(&out).expect("svg written");
    let texts = svg_texts(&svg);
    for tick in ["0.1", "1", "10"] {
        assert!(texts.contains(&tick), "no tick {tick}: {texts:?}");
    }
    assert!(texts.contains(&"loss (log scale)"), "{texts:?}");

    // The bitmap backend too, and a loss with no positive value at all.
    let o = distc(&["plot", s(&path), "-o", s(&dir.join("loss.png")), "--log-y"]);
    assert!(o.status.success(), "{}", text(&o));
    losses_run(&path, &[0.0, -2.0, -3.0]);
    let o = distc(&["plot", s(&path), "-o", s(&out), "--log-y"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("3 values at or below 0"), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert_eq!(svg.matches("no data").count(), 1);
}

/// Issue 36, item 6: a run that diverges squashes every other run's loss flat against
/// the bottom of a linear axis; its loss panel goes to a log axis by itself, and says
/// why. A run that merely converges stays linear.
#[test]
fn a_diverging_run_puts_the_loss_on_a_log_axis_by_itself() {
    let dir = tmp("diverge");
    let steady = dir.join("steady.jsonl");
    let blown = dir.join("blown.jsonl");
    losses_run(
        &steady,
        &(1..=40).map(|i| 2.3 / f64::from(i)).collect::<Vec<_>>(),
    );
    losses_run(
        &blown,
        &(0..40).map(|i| 2.3 * 1.5f64.powi(i)).collect::<Vec<_>>(),
    );
    let out = dir.join("runs.svg");

    let o = distc(&["plot", s(&steady), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("log axis"), "{}", text(&o));
    let svg = std::fs::read_to_string(&out).expect("svg written");
    assert!(!svg_texts(&svg).contains(&"loss (log scale)"));

    let o = distc(&["plot", s(&steady), s(&blown), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("training loss: on a log axis"),
        "{}",
        text(&o)
    );
    let svg = std::fs::read_to_string(&out).expect("svg written");
    let texts = svg_texts(&svg);
    for tick in ["0.1", "1", "1000", "10k", "1M"] {
        assert!(texts.contains(&tick), "no tick {tick}: {texts:?}");
    }

    // Rising tenfold is divergence too, though the values span far less than 1000x.
    losses_run(
        &blown,
        &(0..40).map(|i| 2.0 + f64::from(i)).collect::<Vec<_>>(),
    );
    let o = distc(&["plot", s(&blown), "-o", s(&out)]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("training loss: on a log axis"),
        "{}",
        text(&o)
    );
}
