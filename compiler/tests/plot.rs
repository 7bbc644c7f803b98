//! `distc plot`: metrics files in, pictures out; and the errors a user meets.

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
