//! `distc bench`: the standard workloads of `../shared/WORKLOADS.md` under each
//! strategy and worker count, measured as that file says: 10 warm-up steps, 50 timed
//! steps, median of 3 runs, the machine's cores split evenly between the workers.
//!
//! Data for the warm-up and timed steps is drawn before the first step (`--preload`).
//! Each run is a child process (`distc run` on a compiled plan) because the matrix
//! product's thread count (`MATMUL_NUM_THREADS`) is read once per process; the child
//! writes per-step metrics, from which the timed steps' throughput and the bytes each
//! worker moved are read.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The two workloads, embedded so the benchmark runs from any directory.
pub const WORKLOADS: [(&str, &str); 2] = [
    ("sparse_lm", include_str!("../../examples/sparse_lm.dsl")),
    ("dense_mlp", include_str!("../../examples/dense_mlp.dsl")),
];

/// What `distc bench --transport mpi` passes to `mpirun`: run as root where the
/// machine's user is root, more ranks than cores, and the environment
/// (`MATMUL_NUM_THREADS`) exported to every rank.
pub const MPIRUN_FLAGS: [&str; 4] = [
    "--allow-run-as-root",
    "--oversubscribe",
    "-x",
    "MATMUL_NUM_THREADS",
];

/// One measured configuration.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    /// Workload name.
    pub workload: String,
    /// Strategy.
    pub strategy: String,
    /// Workers.
    pub workers: usize,
    /// Parameter servers.
    pub servers: usize,
    /// Median over runs of global samples per second over the timed steps.
    pub samples_per_sec: f64,
    /// Every run's samples per second.
    pub runs: Vec<f64>,
    /// Mean bytes sent per step by worker 0 over the timed steps.
    pub bytes_sent_per_step: f64,
    /// Mean bytes received per step by worker 0 over the timed steps.
    pub bytes_received_per_step: f64,
    /// Mean bytes moved per step by worker 0 as the prediction counts them (collective
    /// bytes sent, server bytes pushed and pulled).
    pub bytes_moved_per_step: f64,
    /// The plan's predicted bytes per step per worker.
    pub predicted_bytes_per_step: f64,
    /// Median over runs of the timed steps' mean model FLOPs utilisation, where the
    /// metrics carry it (see the metrics' `mfu`).
    pub mfu: Option<f64>,
}

/// Settings of a benchmark.
pub struct BenchSettings {
    /// Workloads by name.
    pub workloads: Vec<String>,
    /// Strategies by name.
    pub strategies: Vec<String>,
    /// Worker counts.
    pub workers: Vec<usize>,
    /// Runs per configuration (the median is reported).
    pub runs: usize,
    /// Servers of ps, hybrid and auto plans (`None`: one per worker).
    pub servers: Option<usize>,
    /// Warm-up steps.
    pub warmup: usize,
    /// Timed steps.
    pub steps: usize,
    /// Run each configuration as an `mpirun` job (one process per rank) instead of
    /// threads of one process.
    pub mpi: bool,
    /// Scratch directory for plans and metrics.
    pub dir: PathBuf,
    /// `--device` of the runs (`cuda:0`); `None`: the CPU.
    pub device: Option<String>,
    /// With a GPU device: `--no-cuda-graph`.
    pub no_cuda_graph: bool,
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs every configuration, printing a row as each finishes.
pub fn run(s: &BenchSettings) -> Result<Vec<BenchRow>> {
    let exe = std::env::current_exe().context("cannot find the distc executable")?;
    if let Some(d) = &s.device {
        if s.strategies.iter().any(|x| x != "single") || s.workers.iter().any(|&n| n != 1) || s.mpi
        {
            bail!(
                "--device {d} benchmarks one-device plans: give --strategies single \
                 --workers 1 (distributed plans run on the CPU)"
            );
        }
    }
    std::fs::create_dir_all(&s.dir)
        .with_context(|| format!("cannot create {}", s.dir.display()))?;
    let mut rows = Vec::new();
    crate::console::out(&format!(
        "{:<10} {:<16} {:>7} {:>7} {:>10} {:>12} {:>12} {:>12} {:>12} {:>7} {:>6}\n",
        "workload",
        "strategy",
        "workers",
        "servers",
        "samples/s",
        "sent B",
        "received B",
        "moved B",
        "predicted B",
        "error",
        "MFU"
    ));
    for w in &s.workloads {
        let Some((_, src)) = WORKLOADS.iter().find(|(n, _)| n == w) else {
            bail!("unknown workload `{w}`; the workloads are sparse_lm and dense_mlp");
        };
        let dsl = s.dir.join(format!("{w}.dsl"));
        std::fs::write(&dsl, src).with_context(|| format!("cannot write {}", dsl.display()))?;
        for strategy in &s.strategies {
            for &n in &s.workers {
                if strategy == "single" && n != 1 {
                    continue;
                }
                let servers = if matches!(strategy.as_str(), "ps" | "hybrid" | "auto") {
                    s.servers.unwrap_or(n)
                } else {
                    0
                };
                rows.push(one(&exe, s, w, &dsl, strategy, n, servers)?);
                let r = rows.last().expect("pushed");
                let error = if r.predicted_bytes_per_step > 0.0 {
                    format!(
                        "{:+.1}%",
                        100.0 * (r.bytes_moved_per_step / r.predicted_bytes_per_step - 1.0)
                    )
                } else {
                    "-".into()
                };
                let mfu = r.mfu.map_or("-".into(), |m| format!("{:.1}%", 100.0 * m));
                crate::console::out(&format!("{:<10} {:<16} {:>7} {:>7} {:>10.0} {:>12.0} {:>12.0} {:>12.0} {:>12.0} {:>7} {:>6}\n",
                    r.workload,
                    r.strategy,
                    r.workers,
                    r.servers,
                    r.samples_per_sec,
                    r.bytes_sent_per_step,
                    r.bytes_received_per_step,
                    r.bytes_moved_per_step,
                    r.predicted_bytes_per_step,
                    error,
                    mfu
                ));
            }
        }
    }
    Ok(rows)
}

fn one(
    exe: &Path,
    s: &BenchSettings,
    w: &str,
    dsl: &Path,
    strategy: &str,
    n: usize,
    servers: usize,
) -> Result<BenchRow> {
    let plan = s.dir.join(format!("{w}-{strategy}-{n}.plan.json"));
    // `allreduce_dense` is the all-reduce-everything baseline (Horovod's default for
    // embeddings): the allreduce strategy with sparse gradients densified.
    let (kind, extra): (&str, &[&str]) = match strategy {
        "allreduce_dense" => ("allreduce", &["--sparse-as-dense"]),
        other => (other, &[]),
    };
    let status = Command::new(exe)
        .args([
            "compile",
            &dsl.display().to_string(),
            "--strategy",
            kind,
            "--workers",
            &n.to_string(),
            "--servers",
            &servers.to_string(),
            "-o",
            &plan.display().to_string(),
        ])
        .args(extra)
        .args(s.device.as_ref().map(|_| "--fuse"))
        .output()
        .context("cannot start distc compile")?;
    if !status.status.success() {
        bail!(
            "compiling {w} with {strategy}: {}",
            String::from_utf8_lossy(&status.stderr)
        );
    }
    let (loaded, _) = crate::Plan::load(&plan)?;
    let predicted = loaded
        .dist
        .iter()
        .flat_map(|d| &d.vars)
        .map(|v| v.predicted_bytes_per_step)
        // A fold from +0: an empty f64 sum is -0, which prints as "-0".
        .fold(0.0, |a, b| a + b);
    let batch = loaded.config.batch;
    let threads = (cores() / n).max(1);
    let (mut runs, mut sent, mut received, mut moved) = (Vec::new(), 0.0, 0.0, 0.0);
    let mut mfus = Vec::new();
    for run in 0..s.runs {
        let metrics = s.dir.join(format!("{w}-{strategy}-{n}-{run}.jsonl"));
        let run_args = [
            "run".to_string(),
            plan.display().to_string(),
            "-q".into(),
            "--steps".into(),
            (s.warmup + s.steps).to_string(),
            "--metrics".into(),
            metrics.display().to_string(),
            "--preload".into(),
            // The rows time the steps; an evaluation after the last would only add
            // to the benchmark's wall time.
            "--no-eval".into(),
        ];
        let mut run_args = run_args.to_vec();
        if let Some(d) = &s.device {
            run_args.extend(["--device".to_string(), d.clone()]);
            if s.no_cuda_graph {
                run_args.push("--no-cuda-graph".into());
            }
        }
        let mut cmd = if s.mpi {
            // One process per rank: N workers, then the servers (see the README).
            let mut c = Command::new("mpirun");
            c.args(MPIRUN_FLAGS)
                .args(["-np", &(n + servers).to_string()])
                .arg(exe)
                .args(&run_args)
                .args(["--transport", "mpi"]);
            c
        } else {
            let mut c = Command::new(exe);
            c.args(&run_args);
            c
        };
        let out = cmd
            .env("MATMUL_NUM_THREADS", threads.to_string())
            .output()
            .with_context(|| {
                if s.mpi {
                    "cannot start mpirun (install OpenMPI: scripts/install-mpi.sh)"
                } else {
                    "cannot start distc run"
                }
            })?;
        if !out.status.success() {
            bail!(
                "{w} {strategy} x{n}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)?
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        let timed = &lines[s.warmup.min(lines.len())..];
        // Each line's samples_per_sec is N*B over that step's wall time.
        let seconds: f64 = timed
            .iter()
            .filter_map(|l| Some(batch as f64 * n as f64 / l["samples_per_sec"].as_f64()?))
            .sum();
        let samples = (batch * n * timed.len()) as f64;
        runs.push(samples / seconds.max(1e-9));
        let mean = |key: &str| {
            timed.iter().filter_map(|l| l[key].as_f64()).sum::<f64>() / timed.len().max(1) as f64
        };
        if timed.iter().all(|l| l["mfu"].is_f64()) && !timed.is_empty() {
            mfus.push(mean("mfu"));
        }
        (sent, received, moved) = (
            mean("bytes_sent"),
            mean("bytes_received"),
            mean("bytes_moved"),
        );
    }
    Ok(BenchRow {
        workload: w.into(),
        strategy: strategy.into(),
        workers: n,
        servers,
        samples_per_sec: median(runs.clone()),
        runs,
        bytes_sent_per_step: sent,
        bytes_received_per_step: received,
        bytes_moved_per_step: moved,
        predicted_bytes_per_step: predicted,
        mfu: (!mfus.is_empty()).then(|| median(mfus)),
    })
}

/// `distc bench --compile`: compile time against graph size. Deep MLPs (see
/// [`deep_model`]) whose graph after autodiff has about the asked number of nodes are
/// generated in memory and compiled, all passes, under each strategy; a row gives the
/// nodes, the time of lowering, of the passes (with the verifier after each), of the
/// plan (printing, hashing, JSON) and in all, and the slowest passes. Release builds
/// only mean anything.
pub struct CompileBenchSettings {
    /// Target node counts after autodiff.
    pub nodes: Vec<usize>,
    /// Strategies by name: those of [`run`], and `allreduce_zero3` (allreduce with
    /// ZeRO stage 3 and `--accumulate 2`, so every pass rewrites something).
    pub strategies: Vec<String>,
    /// Workers of the distributed strategies.
    pub workers: usize,
    /// Servers of ps, hybrid and auto plans (`None`: one per worker).
    pub servers: Option<usize>,
    /// Compiles per configuration (the fastest is reported).
    pub runs: usize,
}

/// One compiled configuration of `distc bench --compile`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CompileRow {
    /// Strategy.
    pub strategy: String,
    /// MLP layers of the generated model.
    pub layers: usize,
    /// Nodes after lowering.
    pub lowered_nodes: usize,
    /// Nodes after autodiff.
    pub autodiff_nodes: usize,
    /// Nodes of the final worker program.
    pub final_nodes: usize,
    /// Seconds of parsing and lowering (twice, for the batch axes), measured by a
    /// compile that stops after `lower`.
    pub lower_s: f64,
    /// Seconds of the passes, verifier after each included.
    pub passes_s: f64,
    /// Seconds of the rest of compiling: the sparsity measurement, and the pass
    /// manager's copy of the graph before each pass (kept for the error's last good IR).
    pub other_s: f64,
    /// Seconds of making the plan and its JSON text.
    pub plan_s: f64,
    /// Seconds in all (`compile` and the plan; the lowering-only compile not counted).
    pub total_s: f64,
    /// Each pass: (name, seconds of the pass, seconds of its verifier).
    pub pass_s: Vec<(String, f64, f64)>,
    /// `search`: the candidates and the pick (the whole search is `total_s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub search: Option<String>,
}

/// Nodes after autodiff of [`deep_model`] with `layers` layers: 11 per layer (matmul,
/// bias add, relu, their gradients and the two variables with their sinks) and 19
/// for the embedding, head and loss.
pub fn deep_model_nodes(layers: usize) -> usize {
    11 * layers + 19
}

/// A deep MLP in the DSL: an 8-wide embedding of 4 ids, `layers` layers of
/// `relu(h @ w + b)` 8 wide, a 4-class head. Tiny tensors, so its plan compiles at any
/// depth; the embedding gives ps and hybrid a sparse variable.
pub fn deep_model(layers: usize) -> String {
    use std::fmt::Write;
    let mut s = String::from(
        "model deep {\n  input ids: i32[B, 4]\n  input label: i32[B]\n  \
         param emb: f32[1000, 2] = uniform(-0.05, 0.05)\n",
    );
    for i in 0..layers {
        let _ = writeln!(s, "  param w{i}: f32[8, 8] = glorot");
        let _ = writeln!(s, "  param b{i}: f32[8] = zeros");
    }
    s.push_str("  param wo: f32[8, 4] = glorot\n  x = reshape(embedding(emb, ids), [B, 8])\n");
    let mut prev = "x".to_string();
    for i in 0..layers {
        let _ = writeln!(s, "  h{i} = relu({prev} @ w{i} + b{i})");
        prev = format!("h{i}");
    }
    let _ = writeln!(
        s,
        "  logits = {prev} @ wo\n  minimize softmax_cross_entropy(logits, label)\n}}"
    );
    s.push_str(
        "train {\n  data = zipf_tokens(vocab = 1000, context = 4, classes = 4, s = 1.1)\n  \
         batch = 16\n  optimizer = sgd(lr = 0.1)\n  steps = 10\n  seed = 1\n}\n",
    );
    s
}

/// The strategy flags of a benchmark strategy name.
fn compile_config(
    name: &str,
    workers: usize,
    servers: Option<usize>,
) -> Result<distc_passes::placement::StrategyConfig> {
    use distc_passes::placement::{Strategy, StrategyConfig};
    let mut c = StrategyConfig {
        workers,
        ..StrategyConfig::default()
    };
    c.strategy = match name {
        "single" => {
            c.workers = 1;
            Strategy::Single
        }
        "allreduce" => Strategy::Allreduce,
        "allreduce_dense" => {
            c.sparse_as_dense = true;
            Strategy::Allreduce
        }
        "allreduce_zero3" => {
            c.zero = 3;
            c.accumulate = 2;
            Strategy::Allreduce
        }
        "ps" => Strategy::Ps,
        "hybrid" => Strategy::Hybrid,
        "auto" => Strategy::Auto,
        // The layout search over N workers (`compile --strategy auto --workers N`).
        "search" => return Ok(c),
        other => bail!(
            "unknown strategy `{other}`; the strategies are single, allreduce, \
             allreduce_dense, allreduce_zero3, ps, hybrid, auto and search"
        ),
    };
    if matches!(c.strategy, Strategy::Ps | Strategy::Hybrid | Strategy::Auto) {
        c.servers = servers.unwrap_or(workers);
    }
    Ok(c)
}

fn compile_once(src: &str, config: &distc_passes::placement::StrategyConfig) -> Result<CompileRow> {
    let opts = crate::CompileOptions {
        strategy: config.clone(),
        ..Default::default()
    };
    let lower_only = crate::CompileOptions {
        stop_after: Some("lower".into()),
        ..opts.clone()
    };
    let start = std::time::Instant::now();
    std::hint::black_box(crate::compile("deep.dsl", src, &lower_only)?);
    let lower_s = start.elapsed().as_secs_f64();
    let start = std::time::Instant::now();
    let c = crate::compile("deep.dsl", src, &opts)?;
    let compiled = start.elapsed();
    let plan = crate::Plan::new(&c, "deep.dsl", config);
    let json = serde_json::to_string_pretty(&plan)?;
    let total = start.elapsed();
    std::hint::black_box(json);
    let pass_s: Vec<(String, f64, f64)> = c
        .records
        .iter()
        .map(|r| (r.name.clone(), r.time.as_secs_f64(), r.verify.as_secs_f64()))
        .collect();
    let passes_s: f64 = pass_s.iter().map(|(_, p, v)| p + v).sum();
    Ok(CompileRow {
        strategy: String::new(),
        layers: 0,
        lowered_nodes: c.lowered_nodes,
        autodiff_nodes: c.records.first().map_or(0, |r| r.nodes.1),
        final_nodes: c.programs.worker.node_count(),
        lower_s,
        passes_s,
        other_s: (compiled.as_secs_f64() - lower_s - passes_s).max(0.0),
        plan_s: (total - compiled).as_secs_f64(),
        total_s: total.as_secs_f64(),
        pass_s,
        search: None,
    })
}

/// The layout search of `distc compile --strategy auto --workers N` on the model
/// `src` (written to a folder of its own, which the search compiles from), timed
/// whole: profiling, every candidate's compile and price, and the pick's plan.
fn search_once(src: &str, workers: usize) -> Result<CompileRow> {
    let dir = tempfile::tempdir().context("cannot make a temporary folder")?;
    let file = dir.path().join("deep.dsl");
    std::fs::write(&file, src).with_context(|| format!("cannot write {}", file.display()))?;
    let opts = crate::CompileOptions {
        strategy: distc_passes::placement::StrategyConfig {
            strategy: distc_passes::placement::Strategy::Auto,
            workers,
            ..Default::default()
        },
        ..Default::default()
    };
    let pricing = crate::planner::Pricing::here();
    let start = std::time::Instant::now();
    let (c, settings, search) =
        crate::planner::search(&file, &opts, workers, None, None, &pricing, &[])
            .map_err(anyhow::Error::msg)?;
    let plan = crate::Plan::new(&c, "deep.dsl", &settings);
    std::hint::black_box(serde_json::to_string_pretty(&plan)?);
    let total_s = start.elapsed().as_secs_f64();
    let pick = search.candidates.get(search.chosen).map(|c| c.label());
    Ok(CompileRow {
        strategy: String::new(),
        layers: 0,
        lowered_nodes: c.lowered_nodes,
        autodiff_nodes: c
            .records
            .iter()
            .find(|r| r.name == "autodiff")
            .map_or(0, |r| r.nodes.1),
        final_nodes: c.programs.worker.node_count(),
        lower_s: 0.0,
        passes_s: 0.0,
        other_s: 0.0,
        plan_s: 0.0,
        total_s,
        pass_s: Vec::new(),
        search: Some(format!(
            "{} candidates, picked {}",
            search.candidates.len(),
            pick.unwrap_or_default()
        )),
    })
}

/// Runs `distc bench --compile`, printing a row as each configuration finishes.
pub fn run_compile(s: &CompileBenchSettings) -> Result<Vec<CompileRow>> {
    let configs = s
        .strategies
        .iter()
        .map(|n| Ok((n.clone(), compile_config(n, s.workers, s.servers)?)))
        .collect::<Result<Vec<_>>>()?;
    crate::console::out(&format!("{:<16} {:>6} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8}  slowest passes (ms, verifier included)\n",
        "strategy", "layers", "nodes", "lower s", "passes s", "other s", "plan s", "total s"
    ));
    let mut rows = Vec::new();
    for &target in &s.nodes {
        let layers = target.saturating_sub(deep_model_nodes(0)) / 11;
        let src = deep_model(layers.max(1));
        for (name, config) in &configs {
            let mut best: Option<CompileRow> = None;
            for _ in 0..s.runs.max(1) {
                let r = if name == "search" {
                    search_once(&src, config.workers)?
                } else {
                    compile_once(&src, config)?
                };
                if best.as_ref().is_none_or(|b| r.total_s < b.total_s) {
                    best = Some(r);
                }
            }
            let Some(mut r) = best else { continue };
            r.strategy = name.clone();
            r.layers = layers.max(1);
            let mut slow: Vec<&(String, f64, f64)> = r.pass_s.iter().collect();
            slow.sort_by(|a, b| (b.1 + b.2).total_cmp(&(a.1 + a.2)));
            let slowest: Vec<String> = match &r.search {
                Some(pick) => vec![pick.clone()],
                None => slow
                    .iter()
                    .take(3)
                    .map(|(n, p, v)| format!("{n} {:.0}", (p + v) * 1e3))
                    .collect(),
            };
            crate::console::out(&format!(
                "{:<16} {:>6} {:>7} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}  {}\n",
                r.strategy,
                r.layers,
                r.autodiff_nodes,
                r.lower_s,
                r.passes_s,
                r.other_s,
                r.plan_s,
                r.total_s,
                slowest.join(", ")
            ));
            rows.push(r);
        }
    }
    Ok(rows)
}
