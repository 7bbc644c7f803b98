//! Plans run as MPI processes (`--features mpi`, OpenMPI from scripts/install-mpi.sh):
//! the same weights as in-process, verify under mpirun, start-up checks, the first
//! error, a killed rank and a stalled one. Each test starts `mpirun` with the distc
//! binary; ranks share this machine's cores (`--oversubscribe`).
#![cfg(feature = "mpi")]

use distc_runtime::core::checkpoint;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::{distc, max_difference, root, s, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("mpi").join(name)
}

const MPIRUN: [&str; 2] = ["--allow-run-as-root", "--oversubscribe"];

fn mpirun_cmd(np: usize, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.args(MPIRUN)
        .args(["-np", &np.to_string()])
        .arg(env!("CARGO_BIN_EXE_distc"))
        .args(args)
        .current_dir(root())
        .env("MATMUL_NUM_THREADS", "1");
    c
}

fn mpirun(np: usize, args: &[&str]) -> Output {
    mpirun_cmd(np, args)
        .output()
        .expect("mpirun runs (install OpenMPI: scripts/install-mpi.sh)")
}

fn compile(model: &str, strategy: &str, workers: usize, servers: usize, name: &str) -> PathBuf {
    compile_with(model, strategy, workers, servers, name, &[])
}

/// [`compile`] with more options (`--sync async`).
fn compile_with(
    model: &str,
    strategy: &str,
    workers: usize,
    servers: usize,
    name: &str,
    extra: &[&str],
) -> PathBuf {
    let plan = tmp(name);
    let w = workers.to_string();
    let sv = servers.to_string();
    let mut args = vec![
        "compile",
        model,
        "--strategy",
        strategy,
        "--workers",
        &w,
        "--servers",
        &sv,
        "--batch",
        "16",
        "-o",
        s(&plan),
    ];
    args.extend_from_slice(extra);
    let o = distc(&args);
    assert!(o.status.success(), "{}", text(&o));
    plan
}

/// Largest relative difference over every variable of two checkpoints.
#[test]
fn mpi_ranks_train_the_weights_threads_train() {
    let _one = common::one_job_at_a_time();
    for (model, strategy, workers, servers) in [
        ("examples/dense_mlp.dsl", "allreduce", 2, 0),
        ("examples/dense_mlp.dsl", "allreduce", 3, 0),
        ("examples/sparse_lm.dsl", "allreduce", 4, 0),
        ("examples/sparse_lm.dsl", "ps", 2, 1),
        ("examples/dense_mlp.dsl", "ps", 3, 2),
        ("examples/sparse_lm.dsl", "hybrid", 2, 2),
        ("examples/sparse_lm.dsl", "hybrid", 3, 1),
    ] {
        let what = format!("{model} {strategy} {workers}w {servers}s");
        let plan = compile(model, strategy, workers, servers, "same.plan.json");
        let (one, many) = (tmp("threads.safetensors"), tmp("mpi.safetensors"));
        let o = distc(&["run", s(&plan), "--steps", "4", "-q", "--save", s(&one)]);
        assert!(o.status.success(), "{what}: {}", text(&o));
        let m = tmp("m.jsonl");
        let o = mpirun(
            workers + servers,
            &[
                "run",
                s(&plan),
                "--steps",
                "4",
                "-q",
                "--save",
                s(&many),
                "--transport",
                "mpi",
                "--metrics",
                s(&m),
            ],
        );
        assert!(o.status.success(), "{what}: {}", text(&o));
        let d = max_difference(&one, &many);
        println!("{what}: largest relative difference MPI vs threads {d:.2e}");
        // Two ranks sum in one order on both transports; more ranks sum in MPI's order.
        let tolerance = if workers == 2 || strategy == "ps" {
            0.0
        } else {
            1e-5
        };
        assert!(d <= tolerance, "{what}: MPI and threads differ by {d:.2e}");
        // Rank 0's global lines and every worker's own.
        let global = std::fs::read_to_string(&m).expect("global metrics");
        assert_eq!(global.lines().count(), 4, "{what}");
        for r in 0..workers {
            let own = tmp(&format!("m.rank{r}.jsonl"));
            assert_eq!(
                std::fs::read_to_string(&own)
                    .expect("rank metrics")
                    .lines()
                    .count(),
                4,
                "{what}"
            );
        }
    }
}

#[test]
fn traces_of_every_rank_merge_into_one() {
    let _one = common::one_job_at_a_time();
    let plan = compile("examples/sparse_lm.dsl", "hybrid", 2, 1, "trace.plan.json");
    let t = tmp("t.json");
    let o = mpirun(
        3,
        &[
            "run",
            s(&plan),
            "--steps",
            "2",
            "-q",
            "--transport",
            "mpi",
            "--trace",
            s(&t),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let merged: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&t).expect("merged trace")).expect("json");
    let tracks: Vec<String> = merged["traceEvents"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["ph"] == "M")
        .filter_map(|e| e["args"]["name"].as_str().map(String::from))
        .collect();
    for want in ["worker 0", "worker 1", "worker 0 comm", "server 0"] {
        assert!(tracks.iter().any(|t| t == want), "{want} not in {tracks:?}");
    }
    for r in 0..3 {
        assert!(
            tmp(&format!("t.rank{r}.json")).exists(),
            "no trace of rank {r}"
        );
    }
}

#[test]
fn verify_runs_under_mpirun() {
    let _one = common::one_job_at_a_time();
    let o = mpirun(
        3,
        &[
            "verify",
            "examples/sparse_lm.dsl",
            "--strategy",
            "hybrid",
            "--workers",
            "2",
            "--servers",
            "1",
            "--batch",
            "16",
            "--transport",
            "mpi",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("worst relative error"), "{}", text(&o));
    // Issue 67, item 3: under --init both sides start from the file's weights (the
    // ranks started from the seed's, and the verify failed on a correct layout).
    let model = root().join("examples/dense_mlp.dsl");
    let c = distc::compile_file(&model, &distc::CompileOptions::default()).expect("compiles");
    let halved: Vec<(String, distc_runtime::Tensor)> =
        distc_runtime::run::state::whole_variables(&c.programs(1), c.config.seed)
            .expect("variables")
            .into_iter()
            .map(|(name, t)| {
                let ty = t.tensor_type();
                let mut out = distc_runtime::Tensor::zeros(&ty);
                if let distc_runtime::Tensor::F32(a) = &mut out {
                    for (o, v) in a.iter_mut().zip(t.to_f64_vec()) {
                        *o = (v * 0.5 + 0.01) as f32;
                    }
                }
                (name, out)
            })
            .collect();
    let init = tmp("halved.safetensors");
    let named: Vec<(String, &distc_runtime::Tensor)> =
        halved.iter().map(|(k, t)| (k.clone(), t)).collect();
    checkpoint::save(&init, &named, Default::default()).expect("writes the weights");
    let o = mpirun(
        2,
        &[
            "verify",
            "examples/dense_mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--batch",
            "16",
            "--steps",
            "2",
            "--init",
            s(&init),
            "--transport",
            "mpi",
        ],
    );
    assert!(o.status.success(), "--init under mpirun: {}", text(&o));
}

#[test]
fn ranks_check_they_run_one_plan_of_the_right_size() {
    let _one = common::one_job_at_a_time();
    let a = compile("examples/dense_mlp.dsl", "allreduce", 2, 0, "a.plan.json");
    let b = compile("examples/sparse_lm.dsl", "allreduce", 2, 0, "b.plan.json");
    // Two plans in one job: mpirun's MPMD form gives rank 1 the other one.
    let o = Command::new("mpirun")
        .args(MPIRUN)
        .args([
            "-np",
            "1",
            env!("CARGO_BIN_EXE_distc"),
            "run",
            s(&a),
            "--transport",
            "mpi",
            ":",
        ])
        .args([
            "-np",
            "1",
            env!("CARGO_BIN_EXE_distc"),
            "run",
            s(&b),
            "--transport",
            "mpi",
        ])
        .current_dir(root())
        .output()
        .expect("mpirun");
    assert!(!o.status.success());
    assert!(
        text(&o).contains("rank 1 runs another plan"),
        "{}",
        text(&o)
    );
    // The wrong number of ranks.
    let o = mpirun(3, &["run", s(&a), "--transport", "mpi"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("the job has 3 ranks, the plan needs 2"),
        "{}",
        text(&o)
    );
    // Outside mpirun: the line to use.
    let o = distc(&["run", s(&a), "--transport", "mpi"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("mpirun -np 2 "), "{}", text(&o));
}

// Ids beyond the table (issue 9's first case here) are refused at compile time since
// issue 20; a loss that overflows is an error of the workers at run time.
#[test]
fn one_ranks_error_reaches_the_user_and_ends_the_job() {
    let _one = common::one_job_at_a_time();
    for (strategy, servers) in [("ps", 1), ("allreduce", 0)] {
        let plan = compile(
            "tests/models/issue9_diverges.dsl",
            strategy,
            2,
            servers,
            "bad.plan.json",
        );
        let start = Instant::now();
        let o = mpirun(
            2 + servers,
            &["run", s(&plan), "--transport", "mpi", "--timeout", "20"],
        );
        assert!(!o.status.success(), "{}", text(&o));
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:?}",
            start.elapsed()
        );
        let t = text(&o);
        assert!(
            t.contains("error: rank ") && t.contains("the loss became"),
            "{t}"
        );
    }
}

/// The ranks of a running job: `(world rank, pid)` of mpirun's children.
fn ranks_of(mpirun: &Child) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let ppid: u32 = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if ppid != mpirun.id() {
            continue;
        }
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let rank = env
            .split(|&b| b == 0)
            .filter_map(|kv| std::str::from_utf8(kv).ok())
            .find_map(|kv| kv.strip_prefix("OMPI_COMM_WORLD_RANK="))
            .and_then(|r| r.parse().ok());
        if let Some(r) = rank {
            out.push((r, pid));
        }
    }
    out
}

/// Starts a long 3-worker run and waits until rank 1 exists and training is under way.
fn long_run(timeout: &str) -> (Child, u32) {
    let plan = compile(
        "examples/dense_mlp.dsl",
        "allreduce",
        3,
        0,
        "long.plan.json",
    );
    long_run_of(&plan, 3, timeout, 1)
}

/// Starts a long run of `plan` on `np` ranks and waits until rank `rank` exists and
/// training is under way; returns mpirun and that rank's pid.
// The caller waits for the child it gets back.
#[allow(clippy::zombie_processes)]
fn long_run_of(plan: &Path, np: usize, timeout: &str, rank: usize) -> (Child, u32) {
    let m = tmp("long.jsonl");
    let _ = std::fs::remove_file(tmp("long.rank0.jsonl"));
    let mut child = mpirun_cmd(
        np,
        &[
            "run",
            s(plan),
            "--steps",
            "100000",
            "-q",
            "--transport",
            "mpi",
            "--timeout",
            timeout,
            "--metrics",
            s(&m),
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("mpirun");
    let start = Instant::now();
    loop {
        let steps =
            std::fs::read_to_string(tmp("long.rank0.jsonl")).map_or(0, |t| t.lines().count());
        let ranks = ranks_of(&child);
        if steps >= 3 {
            if let Some(&(_, pid)) = ranks.iter().find(|(r, _)| *r == rank) {
                return (child, pid);
            }
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let o = child.wait_with_output().expect("waits");
            panic!("the run did not start: {}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_killed_rank_stops_every_rank_naming_it() {
    let _one = common::one_job_at_a_time();
    let (child, pid) = long_run("30");
    let killed = Instant::now();
    Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill");
    let o = child.wait_with_output().expect("waits");
    let took = killed.elapsed();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        took < Duration::from_secs(30),
        "the job took {took:?} to stop"
    );
    assert!(text(&o).contains("rank 1"), "{}", text(&o));
}

#[test]
fn a_stalled_rank_makes_the_others_report_who_did_not_arrive() {
    let _one = common::one_job_at_a_time();
    let (child, pid) = long_run("3");
    Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("stop");
    let (o, _) = wait_at_most(child, Some(pid), Duration::from_secs(40), "allreduce");
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("did not complete within 3 s"), "{t}");
    assert!(t.contains("all_reduce %"), "{t}");
    // Every rank that reports names rank 1 among those that did not arrive. (With three
    // ranks MPI may complete a collective on one rank before another, so a rank can
    // also report a peer that went one collective ahead.)
    let reports: Vec<&str> = t
        .lines()
        .filter(|l| l.contains("did not complete within"))
        .collect();
    assert!(!reports.is_empty(), "{t}");
    for r in reports {
        let missing = r
            .split("workers that did not: [")
            .nth(1)
            .and_then(|rest| rest.split(']').next())
            .unwrap_or("");
        assert!(
            missing.split(", ").any(|m| m == "1"),
            "rank 1 not named in: {r}"
        );
    }
}

#[test]
fn a_training_state_written_under_mpirun_resumes_bitwise() {
    let _one = common::one_job_at_a_time();
    let plan = compile("examples/sparse_lm.dsl", "hybrid", 2, 1, "state.plan.json");
    let whole = tmp("state-whole.safetensors");
    let o = distc(&["run", s(&plan), "--steps", "4", "-q", "--save", s(&whole)]);
    assert!(o.status.success(), "{}", text(&o));
    // Steps 1-2 under mpirun (rank 0 writes the servers' rows and slots), steps 3-4
    // resumed under mpirun and in-process.
    let state = tmp("state-2.safetensors");
    let mpi = |extra: &[&str]| {
        let mut args = vec!["run", s(&plan), "-q", "--transport", "mpi"];
        args.extend_from_slice(extra);
        let o = mpirun(3, &args);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
    };
    mpi(&[
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--checkpoint",
        s(&state),
    ]);
    let (resumed_mpi, resumed_threads) = (
        tmp("state-mpi.safetensors"),
        tmp("state-threads.safetensors"),
    );
    mpi(&[
        "--steps",
        "4",
        "--resume",
        s(&state),
        "--save",
        s(&resumed_mpi),
    ]);
    let o = distc(&[
        "run",
        s(&plan),
        "--steps",
        "4",
        "-q",
        "--resume",
        s(&state),
        "--save",
        s(&resumed_threads),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(max_difference(&whole, &resumed_mpi), 0.0);
    assert_eq!(max_difference(&whole, &resumed_threads), 0.0);
}

/// GPU workers under MPI where there is no GPU (or no NCCL): every rank stops with
/// the message naming what is missing, exit non-zero, no hang and no panic.
#[test]
fn gpu_workers_under_mpirun_without_a_gpu_or_nccl_say_what_is_missing() {
    let _one = common::one_job_at_a_time();
    let have_gpu =
        distc_runtime::cuda::require_gpu(&distc_runtime::cuda::LibDirs::from_env()).is_ok();
    if have_gpu {
        println!("skipping: this machine has a GPU");
        return;
    }
    let have_nccl = distc_runtime::cuda::probe(
        distc_runtime::cuda::CudaLib::Nccl,
        &distc_runtime::cuda::LibDirs::from_env(),
    )
    .is_ok();
    let plan = compile("examples/sparse_lm.dsl", "hybrid", 2, 1, "gpu.plan.json");
    for (collectives, want) in [
        ("auto", "libcuda.so.1"),
        (
            "nccl",
            if have_nccl {
                "libcuda.so.1"
            } else {
                "libnccl.so"
            },
        ),
    ] {
        let start = Instant::now();
        let o = mpirun(
            3,
            &[
                "run",
                s(&plan),
                "--transport",
                "mpi",
                "--device",
                "cuda",
                "--collectives",
                collectives,
                "--steps",
                "2",
                "--timeout",
                "20",
            ],
        );
        assert!(!o.status.success(), "{}", text(&o));
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{:?}",
            start.elapsed()
        );
        let t = text(&o);
        assert!(t.contains(want), "{collectives}: {t}");
        assert!(!t.contains("panicked"), "{t}");
    }
}

/// Issue 20: ranks started with different `--steps` timed out at the last step of the
/// shorter one; the start-up check now compares every setting that must agree and
/// names the one that differs.
#[test]
fn ranks_started_with_other_settings_are_refused_at_start_up() {
    let _one = common::one_job_at_a_time();
    let a = compile(
        "examples/dense_mlp.dsl",
        "allreduce",
        2,
        0,
        "steps.plan.json",
    );
    let rank = |steps: &str| {
        [
            "-np",
            "1",
            env!("CARGO_BIN_EXE_distc"),
            "run",
            s(&a),
            "--transport",
            "mpi",
            "--timeout",
            "20",
            "--steps",
        ]
        .iter()
        .map(|x| x.to_string())
        .chain([steps.to_string()])
        .collect::<Vec<_>>()
    };
    let start = std::time::Instant::now();
    let o = Command::new("mpirun")
        .args(MPIRUN)
        .args(rank("3"))
        .arg(":")
        .args(rank("5"))
        .current_dir(root())
        .env("MATMUL_NUM_THREADS", "1")
        .output()
        .expect("mpirun");
    assert!(!o.status.success());
    assert!(
        text(&o).contains("rank 1 runs with other settings: --steps=5 (rank 0: --steps=3)"),
        "{}",
        text(&o)
    );
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "refused only after {:?}",
        start.elapsed()
    );
}

/// Waits for `child` at most `limit`; a job still running then is killed (mpirun, and
/// `stopped`, a rank it may leave behind) and the test fails: a hang must not block CI.
fn wait_at_most(
    child: Child,
    stopped: Option<u32>,
    limit: Duration,
    what: &str,
) -> (Output, Duration) {
    let start = Instant::now();
    let mpirun = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let got = rx.recv_timeout(limit);
    let took = start.elapsed();
    let kill = |pid: u32| {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    };
    // The stopped rank may outlive the job; it must not outlive the test.
    if let Some(pid) = stopped {
        kill(pid);
    }
    match got {
        Ok(o) => (o.expect("waits"), took),
        Err(_) => {
            kill(mpirun);
            let o = rx
                .recv_timeout(Duration::from_secs(30))
                .map(|o| o.map(|o| text(&o)).unwrap_or_default())
                .unwrap_or_default();
            panic!("{what}: the job hung: still running {took:?} after the stop\n{o}");
        }
    }
}

/// Issue 20: `kill -STOP` of worker rank 0 under parameter servers hung most runs
/// (servers and workers blocked in MPI sends to it, nothing waiting with a deadline
/// under async servers) or blamed a server ("parameter server(s) [0] did not answer").
/// In every sync mode, ps and hybrid, the job now ends within the timeout and a few
/// seconds, naming worker rank 0 and blaming no server.
#[test]
fn a_stalled_worker_under_parameter_servers_is_named_in_every_sync_mode() {
    let _one = common::one_job_at_a_time();
    for (model, strategy, sync) in [
        ("examples/dense_mlp.dsl", "ps", "sync"),
        ("examples/dense_mlp.dsl", "ps", "async"),
        ("examples/sparse_lm.dsl", "ps", "stale:2"),
        ("examples/sparse_lm.dsl", "hybrid", "stale:2"),
    ] {
        let what = format!("{strategy} --sync {sync}");
        let plan = compile_with(model, strategy, 2, 1, "stall.plan.json", &["--sync", sync]);
        let (child, pid) = long_run_of(&plan, 3, "5", 0);
        Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("stop");
        let (o, took) = wait_at_most(child, Some(pid), Duration::from_secs(40), &what);
        let t = text(&o);
        println!("{what}: the job ended {took:?} after worker rank 0 stopped");
        assert!(!o.status.success(), "{what}: {t}");
        assert!(took < Duration::from_secs(30), "{what}: took {took:?}: {t}");
        let errors: Vec<&str> = t.lines().filter(|l| l.starts_with("error: ")).collect();
        assert!(!errors.is_empty(), "{what}: no error printed: {t}");
        // A server or worker names it; a timed-out collective lists it as missing.
        assert!(
            errors
                .iter()
                .any(|l| l.contains("worker rank 0 did not")
                    || l.contains("workers that did not: [0]")),
            "{what}: worker rank 0 is not named: {t}"
        );
        for l in &errors {
            assert!(
                !l.contains("did not answer") && !l.contains("parameter server(s)"),
                "{what}: a server is blamed: {l}\n{t}"
            );
        }
    }
}

/// Issue 20: under async parameter servers nothing waits on a stalled worker other
/// than rank 0, which gathers the step reports: rank 0 names it once it has been silent
/// for the timeout while worker 0 went on.
#[test]
fn a_stalled_worker_under_async_servers_is_named_by_rank_0() {
    let _one = common::one_job_at_a_time();
    let plan = compile_with(
        "examples/dense_mlp.dsl",
        "ps",
        2,
        1,
        "stall1.plan.json",
        &["--sync", "async"],
    );
    let (child, pid) = long_run_of(&plan, 3, "5", 1);
    Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("stop");
    let (o, took) = wait_at_most(child, Some(pid), Duration::from_secs(40), "async, rank 1");
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(took < Duration::from_secs(30), "took {took:?}: {t}");
    assert!(
        t.lines()
            .any(|l| l.starts_with("error: ") && l.contains("worker rank 1")),
        "{t}"
    );
    assert!(!t.contains("did not answer"), "{t}");
}

/// Issue 22: a pipelined plan's stages as MPI ranks (rank w is stage w % P of replica
/// w / P) train the weights its stage threads train, bitwise: activations and gradients
/// cross ranks as the bytes they cross threads, and two replicas sum in one order on
/// both transports. Every rank writes its stage's lines, every stage of every replica
/// is a track of the merged trace, and a job of the wrong size names the mapping.
#[test]
fn pipeline_stages_as_ranks_train_what_stage_threads_train() {
    let _one = common::one_job_at_a_time();
    for (workers, pipeline, micro, schedule) in
        [(1, 2, 4, "1f1b"), (1, 3, 3, "gpipe"), (4, 2, 2, "1f1b")]
    {
        let what = format!("dense_mlp {workers} workers, {pipeline} stages x {micro} ({schedule})");
        let (p, m) = (pipeline.to_string(), micro.to_string());
        // One replica is the single-device program cut; more are data-parallel.
        let strategy = if workers > 1 { "allreduce" } else { "single" };
        let plan = compile_with(
            "examples/dense_mlp.dsl",
            strategy,
            workers,
            0,
            "pipeline.plan.json",
            &[
                "--pipeline",
                &p,
                "--micro-batches",
                &m,
                "--schedule",
                schedule,
            ],
        );
        let (one, many) = (tmp("stages.safetensors"), tmp("ranks.safetensors"));
        let o = distc(&["run", s(&plan), "--steps", "3", "-q", "--save", s(&one)]);
        assert!(o.status.success(), "{what}: {}", text(&o));
        let (metrics, trace) = (tmp("pm.jsonl"), tmp("pt.json"));
        let ranks = pipeline * workers.div_ceil(pipeline);
        let o = mpirun(
            ranks,
            &[
                "run",
                s(&plan),
                "--steps",
                "3",
                "-q",
                "--save",
                s(&many),
                "--transport",
                "mpi",
                "--metrics",
                s(&metrics),
                "--trace",
                s(&trace),
            ],
        );
        assert!(o.status.success(), "{what}: {}", text(&o));
        let d = max_difference(&one, &many);
        assert!(d == 0.0, "{what}: MPI ranks and threads differ by {d:.2e}");
        let lines = std::fs::read_to_string(&metrics).expect("global metrics");
        assert_eq!(lines.lines().count(), 3, "{what}");
        let first: serde_json::Value =
            serde_json::from_str(lines.lines().next().unwrap_or("")).expect("a metrics line");
        let stages = first["pipeline"]["stages"].as_array().map_or(0, Vec::len);
        assert_eq!(stages, pipeline, "{what}: {first}");
        for r in 0..ranks {
            let own =
                std::fs::read_to_string(tmp(&format!("pm.rank{r}.jsonl"))).expect("rank metrics");
            assert_eq!(own.lines().count(), 3, "{what}: rank {r}");
        }
        let merged: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).expect("merged trace"))
                .expect("json");
        let tracks: Vec<String> = merged["traceEvents"]
            .as_array()
            .expect("events")
            .iter()
            .filter(|e| e["ph"] == "M")
            .filter_map(|e| e["args"]["name"].as_str().map(String::from))
            .collect();
        let last = if ranks > pipeline {
            format!("stage {} of replica 1", pipeline - 1)
        } else {
            format!("stage {}", pipeline - 1)
        };
        assert!(tracks.contains(&last), "{what}: {last} not in {tracks:?}");
    }
    // A variable tied across stages 0 and 2: stage 0 sends its update to rank 2.
    let model = common::tied_model(&tmp("tied.dsl"), "sgd(lr = 0.1)");
    let plan = compile_with(
        s(&model),
        "single",
        1,
        0,
        "tied.plan.json",
        &["--pipeline", "3", "--micro-batches", "2"],
    );
    let (one, many) = (tmp("tied.safetensors"), tmp("tied.mpi.safetensors"));
    let (m1, mm) = (tmp("tied.jsonl"), tmp("tied.mpi.jsonl"));
    let o = distc(&[
        "run",
        s(&plan),
        "--steps",
        "3",
        "-q",
        "--save",
        s(&one),
        "--metrics",
        s(&m1),
    ]);
    assert!(o.status.success(), "tied: {}", text(&o));
    let o = mpirun(
        3,
        &[
            "run",
            s(&plan),
            "--steps",
            "3",
            "-q",
            "--save",
            s(&many),
            "--transport",
            "mpi",
            "--metrics",
            s(&mm),
        ],
    );
    assert!(o.status.success(), "tied: {}", text(&o));
    let d = max_difference(&one, &many);
    assert!(d == 0.0, "tied: MPI ranks and threads differ by {d:.2e}");
    // Evaluated after steps 2 and 3 on both transports, from the same variables.
    let evals = |p: &Path| -> Vec<(u64, f64)> {
        std::fs::read_to_string(p)
            .expect("metrics")
            .lines()
            .filter_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                Some((v["step"].as_u64()?, v["eval_loss"].as_f64()?))
            })
            .collect()
    };
    let (threads, ranks) = (evals(&m1), evals(&mm));
    assert_eq!(threads.iter().map(|e| e.0).collect::<Vec<_>>(), [2, 3]);
    assert_eq!(threads, ranks);
    let plan = compile_with(
        "examples/dense_mlp.dsl",
        "allreduce",
        4,
        0,
        "pipeline.plan.json",
        &["--pipeline", "2", "--micro-batches", "2"],
    );
    let o = mpirun(
        3,
        &["run", s(&plan), "--steps", "1", "-q", "--transport", "mpi"],
    );
    assert!(!o.status.success());
    assert!(
        text(&o)
            .contains("2 replicas x 2 pipeline stages: worker w is stage w % 2 of replica w / 2"),
        "{}",
        text(&o)
    );
}

/// Issue 22: a pipelined run's training state written under mpirun (every stage rank
/// of replica 0 sends rank 0 its variables and Adam slots; the tied variable's from its
/// owner) resumes bitwise under mpirun and under threads.
#[test]
fn a_pipelined_training_state_written_under_mpirun_resumes_bitwise() {
    let _one = common::one_job_at_a_time();
    let model = common::tied_model(&tmp("tied-adam.dsl"), "adam(lr = 0.01)");
    let plan = compile_with(
        s(&model),
        "allreduce",
        6,
        0,
        "tied-state.plan.json",
        &["--pipeline", "3", "--micro-batches", "2"],
    );
    let whole = tmp("piped-whole.safetensors");
    let o = distc(&["run", s(&plan), "--steps", "4", "-q", "--save", s(&whole)]);
    assert!(o.status.success(), "{}", text(&o));
    let state = tmp("piped-state.safetensors");
    let mpi = |extra: &[&str]| {
        let mut args = vec!["run", s(&plan), "-q", "--transport", "mpi"];
        args.extend_from_slice(extra);
        let o = mpirun(6, &args);
        assert!(o.status.success(), "{extra:?}: {}", text(&o));
    };
    mpi(&[
        "--steps",
        "2",
        "--checkpoint-every",
        "1",
        "--checkpoint",
        s(&state),
    ]);
    let written = checkpoint::load_state(&state).expect("the state loads");
    assert_eq!(written.index.step, 2);
    assert!(
        written.index.saved_by.contains("pipeline of 3 stages"),
        "{:?}",
        written.index
    );
    assert!(written.optimizer.contains_key("e/v"), "{:?}", written.index);
    let (resumed_mpi, resumed_threads) = (
        tmp("piped-mpi.safetensors"),
        tmp("piped-threads.safetensors"),
    );
    mpi(&[
        "--steps",
        "4",
        "--resume",
        s(&state),
        "--save",
        s(&resumed_mpi),
    ]);
    let o = distc(&[
        "run",
        s(&plan),
        "--steps",
        "4",
        "-q",
        "--resume",
        s(&state),
        "--save",
        s(&resumed_threads),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(max_difference(&whole, &resumed_mpi), 0.0);
    assert_eq!(max_difference(&whole, &resumed_threads), 0.0);
}

/// Issue 23: a mesh's workers as MPI ranks (worker r is model rank r % T of data rank
/// r / T; the workers' communicator split by each) train what threads train: two
/// ranks on an axis sum in one order on both transports.
#[test]
fn a_mesh_with_a_model_axis_under_mpirun_trains_what_threads_train() {
    let _one = common::one_job_at_a_time();
    for (mesh, np, extra) in [
        ("data=1,model=2", 2, &[][..]),
        ("data=2,model=2", 4, &[]),
        // ZeRO along the data axis: chunks of each model rank's parts.
        (
            "data=2,model=2",
            4,
            &["--strategy", "allreduce", "--zero", "3"],
        ),
        // Stages two workers wide: a model-axis communicator per stage of a replica.
        ("data=1,model=2,pipe=2", 4, &["--micro-batches", "2"]),
        ("data=2,model=2,pipe=2", 8, &["--micro-batches", "2"]),
    ] {
        let plan = tmp("mesh.plan.json");
        let mut args = vec![
            "compile",
            "examples/dense_mlp.dsl",
            "--mesh",
            mesh,
            "--batch",
            "16",
            "-o",
            s(&plan),
        ];
        args.extend(extra);
        let o = distc(&args);
        assert!(o.status.success(), "{mesh}: {}", text(&o));
        let (one, many) = (tmp("mesh-threads.safetensors"), tmp("mesh-mpi.safetensors"));
        // Issue 40: each rank process writes its own shard of the state, as each
        // thread does (with stages, each of replica 0's).
        let (dir_one, dir_many) = (tmp("mesh-threads-state"), tmp("mesh-mpi-state"));
        for dir in [&dir_one, &dir_many] {
            let _ = std::fs::remove_dir_all(dir);
        }
        let sharded = |dir| vec!["--checkpoint", s(dir), "--sharded"];
        let mut args = vec!["run", s(&plan), "--steps", "3", "-q"];
        args.extend(sharded(&dir_one));
        let o = distc(&[&args[..], &["--save", s(&one)]].concat());
        assert!(o.status.success(), "{mesh}: {}", text(&o));
        let mut args = vec!["run", s(&plan), "--steps", "3", "-q", "--transport", "mpi"];
        args.extend(sharded(&dir_many));
        let o = mpirun(np, &[&args[..], &["--save", s(&many)]].concat());
        assert!(o.status.success(), "{mesh}: {}", text(&o));
        let d = max_difference(&one, &many);
        assert!(d == 0.0, "{mesh}: MPI ranks and threads differ by {d:.2e}");
        let a = checkpoint::load_state(&dir_one).expect("the threads' shards");
        let b = checkpoint::load_state(&dir_many).expect("the ranks' shards");
        assert_eq!(a.params, b.params, "{mesh}");
        assert_eq!(a.optimizer, b.optimizer, "{mesh}");
        assert_eq!(b.index.step, 3, "{mesh}");
    }
    let o = mpirun(
        2,
        &[
            "verify",
            "examples/dense_mlp.dsl",
            "--mesh",
            "data=1,model=2",
            "--batch",
            "16",
            "--steps",
            "2",
            "--tolerance",
            "1e-5",
            "--transport",
            "mpi",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("worst relative error"), "{}", text(&o));
    let o = mpirun(
        4,
        &[
            "verify",
            "examples/dense_mlp.dsl",
            "--mesh",
            "data=1,model=2,pipe=2",
            "--micro-batches",
            "2",
            "--batch",
            "16",
            "--steps",
            "2",
            "--tolerance",
            "1e-5",
            "--transport",
            "mpi",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("mesh data=1 x model=2 x pipe=2, 2 micro-batches"),
        "{}",
        text(&o)
    );
}

/// Issue 22: `verify --pipeline` under mpirun, with a replica per pair of ranks.
#[test]
fn verify_of_a_pipeline_runs_under_mpirun() {
    let _one = common::one_job_at_a_time();
    for (np, strategy, workers, schedule) in
        [(2, "single", "1", "gpipe"), (4, "allreduce", "4", "1f1b")]
    {
        let o = mpirun(
            np,
            &[
                "verify",
                "examples/dense_mlp.dsl",
                "--strategy",
                strategy,
                "--workers",
                workers,
                "--pipeline",
                "2",
                "--micro-batches",
                "3",
                "--schedule",
                schedule,
                "--batch",
                "8",
                "--steps",
                "2",
                "--transport",
                "mpi",
            ],
        );
        assert!(o.status.success(), "{}", text(&o));
        assert!(text(&o).contains("worst relative error"), "{}", text(&o));
    }
}

/// Issue 22: a stage rank that stops answering is named by its neighbour within the
/// timeout: which stage waited, at which step, for what, from or to which stage.
#[test]
fn a_stalled_stage_rank_is_named_by_its_neighbour() {
    let _one = common::one_job_at_a_time();
    let plan = compile_with(
        "examples/dense_mlp.dsl",
        "single",
        1,
        0,
        "stall.plan.json",
        &["--pipeline", "2", "--micro-batches", "2"],
    );
    let (child, pid) = long_run_of(&plan, 2, "3", 1);
    Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("stop");
    let (o, _) = wait_at_most(child, Some(pid), Duration::from_secs(40), "pipeline");
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("did not complete within 3 s"), "{t}");
    assert!(
        t.contains("stage 0, step") && (t.contains("from stage 1") || t.contains("to stage 1")),
        "{t}"
    );
}

/// Issue 35, item 9: on a mesh, a stalled rank's peers wait in model-axis and data-axis
/// collectives; each report names the op it waited in (not "the start"), and the rank
/// that sent no status at all, the stopped one, is named apart.
#[test]
fn a_stalled_rank_of_a_mesh_is_named_and_every_wait_says_its_op() {
    let _one = common::one_job_at_a_time();
    let plan = tmp("stall-mesh.plan.json");
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "--mesh",
        "data=2,model=2",
        "--batch",
        "16",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (child, pid) = long_run_of(&plan, 4, "3", 3);
    Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .expect("stop");
    let (o, _) = wait_at_most(child, Some(pid), Duration::from_secs(40), "mesh");
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    let reports: Vec<&str> = t
        .lines()
        .filter(|l| l.contains("did not complete within"))
        .collect();
    assert!(!reports.is_empty(), "{t}");
    for r in &reports {
        assert!(!r.contains("the start did not complete"), "{r}");
        assert!(r.contains(" at step "), "no op named: {r}");
    }
    let silent = |r: &str| -> Vec<String> {
        r.split("(stopped, or busy outside any wait): [")
            .nth(1)
            .and_then(|rest| rest.split(']').next())
            .map(|l| l.split(", ").map(String::from).collect())
            .unwrap_or_default()
    };
    assert!(
        reports.iter().any(|r| silent(r).contains(&"3".to_string())),
        "rank 3 is not named apart: {t}"
    );
}

/// Issue 24: a 16-bit gradient wire over MPI ranks (a ring of the communicator's own
/// sends and receives) trains bitwise what threads train, with half the f32 wire's bytes.
#[test]
fn a_bf16_gradient_wire_under_mpirun_trains_what_threads_train() {
    let _one = common::one_job_at_a_time();
    for np in [2usize, 3] {
        let mut bytes = Vec::new();
        for wire in ["fp32", "bf16"] {
            let plan = compile_with(
                "examples/dense_mlp.dsl",
                "allreduce",
                np,
                0,
                "wire.plan.json",
                &["--grad-wire", wire],
            );
            let (one, many) = (tmp("wire-threads.safetensors"), tmp("wire-mpi.safetensors"));
            let metrics = tmp("wire.metrics.jsonl");
            let o = distc(&["run", s(&plan), "--steps", "3", "-q", "--save", s(&one)]);
            assert!(o.status.success(), "{wire} {np}: {}", text(&o));
            let o = mpirun(
                np,
                &[
                    "run",
                    s(&plan),
                    "--steps",
                    "3",
                    "-q",
                    "--save",
                    s(&many),
                    "--metrics",
                    s(&metrics),
                    "--transport",
                    "mpi",
                ],
            );
            assert!(o.status.success(), "{wire} {np}: {}", text(&o));
            // The 16-bit ring is the same code on both; MPI's own f32 all-reduce may sum
            // three ranks in another order than the threads' ring.
            let d = max_difference(&one, &many);
            let bound = if wire == "bf16" { 0.0 } else { 1e-5 };
            assert!(
                d <= bound,
                "{wire} {np}: MPI ranks and threads differ by {d:.2e}"
            );
            let lines = std::fs::read_to_string(&metrics).expect("metrics");
            let last: serde_json::Value =
                serde_json::from_str(lines.lines().last().expect("a line")).expect("json");
            bytes.push(last["bytes_sent"].as_u64().expect("bytes_sent"));
        }
        assert_eq!(bytes[1] * 2, bytes[0], "{np} ranks: {bytes:?}");
    }
}

/// Issue 25: hierarchical all-reduces (`--ranks-per-node`) over MPI ranks, a ring within
/// each node and one across the nodes over the communicator's own sends and receives,
/// train bitwise what threads train, and each rank sends what a flat ring sends in all
/// (the hierarchy moves bytes between links, it does not save any).
#[test]
fn hierarchical_all_reduces_under_mpirun_train_what_threads_train() {
    let _one = common::one_job_at_a_time();
    for (np, local) in [(4usize, "2"), (6, "3")] {
        let plan = compile_with(
            "examples/dense_mlp.dsl",
            "allreduce",
            np,
            0,
            "nodes.plan.json",
            &["--ranks-per-node", local],
        );
        let (one, many) = (
            tmp("nodes-threads.safetensors"),
            tmp("nodes-mpi.safetensors"),
        );
        let metrics = tmp("nodes.metrics.jsonl");
        let o = distc(&["run", s(&plan), "--steps", "3", "-q", "--save", s(&one)]);
        assert!(o.status.success(), "{np}: {}", text(&o));
        let o = mpirun(
            np,
            &[
                "run",
                s(&plan),
                "--steps",
                "3",
                "-q",
                "--save",
                s(&many),
                "--metrics",
                s(&metrics),
                "--transport",
                "mpi",
            ],
        );
        assert!(o.status.success(), "{np}: {}", text(&o));
        let d = max_difference(&one, &many);
        assert!(
            d == 0.0,
            "{np} ranks in nodes of {local}: differ by {d:.2e}"
        );
        let explained = text(&distc(&["explain", s(&plan)]));
        assert!(explained.contains("hierarchical; predicted"), "{explained}");
    }
}

/// `distc calibrate` under mpirun (issue 25, item 3): the ranks of the job are the
/// ring, rank 0 writes the fit, and the link it fitted reproduces what it timed
/// closely enough for `distc simulate` to read it.
#[test]
fn calibrate_under_mpirun_times_the_ranks_ring() {
    let _one = common::one_job_at_a_time();
    let cal = tmp("calibration.json");
    let o = mpirun(
        3,
        &[
            "calibrate",
            "--transport",
            "mpi",
            "--sizes",
            "4096,262144,1048576",
            "--reps",
            "3",
            "-o",
            s(&cal),
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    // Only rank 0 prints the table.
    assert_eq!(
        text(&o).matches("link: bandwidth").count(),
        1,
        "{}",
        text(&o)
    );
    let c: distc::simulate::Calibration =
        serde_json::from_str(&std::fs::read_to_string(&cal).expect("the calibration"))
            .expect("its JSON");
    assert_eq!(
        (c.transport.as_str(), c.ranks, c.hosts),
        ("mpi", 3, 1),
        "{c:?}"
    );
    assert_eq!(c.samples.len(), 3);
    assert!(c.link.bandwidth > 0.0 && c.link.latency >= 0.0, "{c:?}");
    let plan = compile(
        "examples/dense_mlp.dsl",
        "allreduce",
        3,
        0,
        "calibrated.json",
    );
    let o = distc(&[
        "simulate",
        s(&plan),
        "--calibration",
        &format!("inter={}", s(&cal)),
        "--profile-steps",
        "3",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("on 3 workers"), "{}", text(&o));
}

/// A job of the wrong size for a mesh names the whole mapping, the model axis included
/// (issue 35, item 9: it gave a pipeline's mapping without it); the mapping is the
/// mesh's own (`run::mesh::Mesh::describe`), as every launcher uses it.
#[test]
fn a_wrong_sized_job_of_a_mesh_names_every_axis_of_the_mapping() {
    let _one = common::one_job_at_a_time();
    let plan = tmp("mesh3-size.plan.json");
    let o = distc(&[
        "compile",
        "examples/dense_mlp.dsl",
        "--mesh",
        "data=1,model=2,pipe=2",
        "--micro-batches",
        "2",
        "--batch",
        "16",
        "-o",
        s(&plan),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = mpirun(
        3,
        &["run", s(&plan), "--steps", "1", "-q", "--transport", "mpi"],
    );
    assert!(!o.status.success());
    assert!(
        text(&o).contains(
            "1 replica x 2 pipeline stages x 2 model ranks: worker w is model rank w % 2 of \
             stage (w / 2) % 2 of replica w / 4"
        ),
        "{}",
        text(&o)
    );
}

/// Issue 35, item 10: Ctrl-C to mpirun (which sends every rank SIGTERM, then SIGKILL
/// about a second later) stops a pipelined job with rank 0's word on what is on disk, and no rank leaves the temporary file of a checkpoint it was writing (a large
/// variable no op reads makes each step mostly that write).
#[test]
fn ctrl_c_to_mpirun_stops_a_pipelined_job_saying_what_is_on_disk() {
    let _one = common::one_job_at_a_time();
    let model = tmp("interrupted.dsl");
    let src = std::fs::read_to_string(common::tied_model(
        &tmp("interrupted-tied.dsl"),
        "sgd(lr = 0.1)",
    ))
    .expect("reads the model")
    .replace(
        "param e: f32[16, 16] = glorot\n",
        "param e: f32[16, 16] = glorot\n  param unread: f32[1024, 2048] = zeros\n",
    );
    std::fs::write(&model, src).expect("writes the model");
    let plan = compile_with(
        s(&model),
        "allreduce",
        2,
        0,
        "interrupted.plan.json",
        &["--pipeline", "2", "--micro-batches", "2"],
    );
    let dir = common::temp_dir("mpi-interrupted");
    let state = dir.join("interrupted.state.safetensors");
    let metrics = dir.join("interrupted.jsonl");
    let mut child = mpirun_cmd(
        2,
        &[
            "run",
            s(&plan),
            "--steps",
            "1000000",
            "-q",
            "--transport",
            "mpi",
            "--checkpoint",
            s(&state),
            "--checkpoint-every",
            "1",
            "--metrics",
            s(&metrics),
        ],
    )
    // What is asserted is what a rank's handler does once it runs; on a loaded 2-core
    // machine it may not be scheduled within OpenMPI's default second before SIGKILL.
    .env("OMPI_MCA_odls_base_sigkill_timeout", "5")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("mpirun");
    let start = Instant::now();
    while checkpoint::load_state(&state).map_or(0, |st| st.index.step) < 3 {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let o = child.wait_with_output().expect("waits");
            panic!("the run did not start: {}", text(&o));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill");
    let (o, _) = wait_at_most(child, None, Duration::from_secs(30), "interrupted");
    let t = text(&o);
    // The ranks exit with 130; mpirun (OpenMPI 4.1.4) exits with 1 after a Ctrl-C to
    // itself whatever they return.
    assert!(!o.status.success(), "{t}");
    // OpenMPI tearing a job down may drop what its ranks wrote last (CI saw mpirun
    // print nothing at all once); what it forwards must be the note.
    assert!(
        t.trim().is_empty()
            || (t.contains("interrupted (Ctrl-C) after step")
                && t.contains("last training state written")),
        "{t}"
    );
    // Every reported step is on disk, however the ranks ended.
    let lines = std::fs::read_to_string(&metrics).expect("the metrics file");
    assert!(lines.ends_with('\n'), "a torn metrics line: {lines:?}");
    let steps: Vec<u64> = lines
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a metrics line");
            v["step"].as_u64().expect("its step")
        })
        .collect();
    assert!(steps.len() >= 3, "{lines}");
    assert!(steps.windows(2).all(|w| w[1] == w[0] + 1), "{steps:?}");
    let left: Vec<String> = std::fs::read_dir(&dir)
        .expect("reads the folder")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("distc-tmp"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}\n{t}");
    let written = checkpoint::load_state(&state).expect("the last state is whole");
    assert!(written.index.step >= 3, "{:?}", written.index);
}

/// The pid of rank `rank` of a job whose command line names `marker`, if it runs.
fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(marker) {
            continue;
        }
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let is_rank = env
            .split(|&b| b == 0)
            .filter_map(|kv| std::str::from_utf8(kv).ok())
            .any(|kv| kv == format!("OMPI_COMM_WORLD_RANK={rank}"));
        if is_rank {
            return Some(pid);
        }
    }
    None
}

/// Issue 40, items 1 and 4: `kill -9` of one rank of a `distc launch` job. mpirun ends
/// the job; the supervisor starts it again with one worker fewer from the last
/// sharded state on disk (ZeRO 3: the chunks are cut anew for 2 workers). Then the
/// hostfile lists a third slot again, and the job grows back to 3 workers
/// (`--max-workers`) from the next state written. The run completes all its steps,
/// and its weights equal, bit for bit, those of jobs run by hand from state to state:
/// 3 ranks to the first restart's state, 2 from it to the second's, 3 from there.
#[test]
fn a_rank_killed_under_distc_launch_costs_one_replica_and_a_slot_added_brings_it_back() {
    let _one = common::one_job_at_a_time();
    let state = tmp("launch.state");
    let _ = std::fs::remove_dir_all(&state);
    let (metrics, saved, hosts) = (tmp("launch.jsonl"), tmp("launch.st"), tmp("hosts"));
    std::fs::write(&hosts, "localhost slots=2\n").expect("the hostfile");
    let steps = 24;
    let steps_s = steps.to_string();
    let model = [
        "examples/dense_mlp.dsl",
        "--strategy",
        "allreduce",
        "--zero",
        "3",
        "--batch",
        "16",
        "-q",
    ];
    let child = launch_job(
        &[
            &["--workers", "3", "--max-workers", "3", "--state", s(&state)][..],
            &["--metrics", s(&metrics), "--hostfile", s(&hosts)],
        ]
        .concat(),
        &[&model[..], &["--steps", &steps_s, "--save", s(&saved)]].concat(),
    );
    let start = Instant::now();
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        while !done() {
            assert!(
                start.elapsed() < Duration::from_secs(90),
                "waited for {what}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // Once the state of step 3 is complete, rank 1 is killed.
    let latest = state.join("latest");
    wait_for("the state of step 3", &|| {
        std::fs::read_to_string(&latest)
            .ok()
            .and_then(|t| t.trim().strip_prefix("step-")?.parse::<u64>().ok())
            .is_some_and(|k| k >= 3)
    });
    let pid = rank_pid(s(&state), 1).expect("rank 1 runs");
    Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill");
    // Once the job runs on 2 workers, a third slot comes back.
    let restarts = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&metrics)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|l| l.get("restart").cloned())
            .collect()
    };
    wait_for("the restart on 2 workers", &|| !restarts().is_empty());
    std::fs::write(&hosts, "localhost slots=3\n").expect("the hostfile");
    let (o, _) = wait_at_most(child, None, Duration::from_secs(120), "launch");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("a rank was lost") && t.contains("with 2 workers (was 3)"),
        "{t}"
    );
    let lines = common::metrics_lines(&metrics);
    assert_eq!(lines.last().expect("lines")["step"], steps, "{t}");
    let r = restarts();
    assert_eq!(r.len(), 2, "{t}");
    let workers =
        |r: &serde_json::Value| (r["workers_before"].as_u64(), r["workers_after"].as_u64());
    assert_eq!(workers(&r[0]), (Some(3), Some(2)), "{t}");
    assert_eq!(workers(&r[1]), (Some(2), Some(3)), "{t}");
    let step_of = |r: &serde_json::Value| r["resumed_from_step"].as_u64().expect("a step") as usize;
    let (lost, grown) = (step_of(&r[0]), step_of(&r[1]));
    assert!(lost >= 3 && grown > lost, "{r:?}");
    assert!(
        r[0]["cause"]
            .as_str()
            .is_some_and(|c| c.contains("rank 1") && c.contains("signal 9")),
        "{r:?}"
    );
    assert!(
        r[1]["cause"]
            .as_str()
            .is_some_and(|c| c.contains("3 slots")),
        "{r:?}"
    );
    println!(
        "launch: rank 1 killed, resumed from step {lost} on 2 workers (recovery {:.2} s); \
         grown back to 3 from step {grown} (recovery {:.2} s)",
        r[0]["recovery_sec"].as_f64().unwrap_or(f64::NAN),
        r[1]["recovery_sec"].as_f64().unwrap_or(f64::NAN),
    );
    // The same arithmetic by hand, from state to state.
    let reference = tmp("launch-ref.state");
    let _ = std::fs::remove_dir_all(&reference);
    let ref_saved = tmp("launch-ref.st");
    let (lost_s, grown_s) = (lost.to_string(), grown.to_string());
    common::run_legs(
        &model,
        &[
            (3, &["--workers", "3"], &lost_s, false),
            (2, &["--workers", "2"], &grown_s, true),
            (3, &["--workers", "3"], &steps_s, true),
        ],
        (&reference, &ref_saved),
        &mpirun,
    );
    assert_eq!(max_difference(&saved, &ref_saved), 0.0);
}

/// `distc launch LAUNCH -- TRAIN` on this machine's slots, its state written every
/// step, its output piped.
fn launch_job(launch: &[&str], train: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_distc"))
        .arg("launch")
        .args(launch)
        .args(["--checkpoint-every", "1"])
        .args([
            "--mpirun-arg=--allow-run-as-root",
            "--mpirun-arg=--oversubscribe",
            "--",
        ])
        .args(train)
        .current_dir(root())
        .env("MATMUL_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("distc launch starts")
}

/// `distc launch --model-axis 2`, and `--pipeline 2` (issue 40): a replica is the 2
/// workers of a model axis, or of two stages, so rank 3 killed costs its replica. The
/// job goes on as `data=1` from the last state on disk, reading every shard of it (a
/// pipeline's: replica 0's stages wrote them), and completes its steps; its weights
/// equal, bit for bit, those of jobs run by hand: `data=2` to that state, `data=1`
/// from it.
#[test]
fn a_rank_killed_under_distc_launch_on_a_model_axis_or_stages_costs_its_replica() {
    let _one = common::one_job_at_a_time();
    for (label, axis, before, after, shards) in [
        (
            "tp",
            &["--model-axis", "2"][..],
            "data=2,model=2",
            "data=1,model=2",
            4,
        ),
        (
            "pipe",
            &["--pipeline", "2"][..],
            "data=2,pipe=2",
            "data=1,pipe=2",
            2,
        ),
    ] {
        let state = tmp(&format!("launch-{label}.state"));
        let _ = std::fs::remove_dir_all(&state);
        let (metrics, saved) = (
            tmp(&format!("launch-{label}.jsonl")),
            tmp(&format!("launch-{label}.st")),
        );
        let steps = "16";
        let mut model = vec!["examples/dense_mlp.dsl", "--batch", "16", "-q"];
        if label == "pipe" {
            model.extend(["--micro-batches", "2"]);
        }
        let child = launch_job(
            &[
                &["--workers", "4"][..],
                axis,
                &["--state", s(&state), "--metrics", s(&metrics)],
            ]
            .concat(),
            &[&model[..], &["--steps", steps, "--save", s(&saved)]].concat(),
        );
        let start = Instant::now();
        let latest = state.join("latest");
        while std::fs::read_to_string(&latest)
            .ok()
            .and_then(|t| t.trim().strip_prefix("step-")?.parse::<u64>().ok())
            .is_none_or(|k| k < 2)
        {
            assert!(
                start.elapsed() < Duration::from_secs(90),
                "{label}: waited for the state of step 2"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let pid = rank_pid(s(&state), 3).expect("rank 3 runs");
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .expect("kill");
        let (o, _) = wait_at_most(child, None, Duration::from_secs(120), "launch");
        let t = text(&o);
        assert!(o.status.success(), "{label}: {t}");
        assert!(t.contains("with 2 workers (was 4)"), "{label}: {t}");
        let lines = common::metrics_lines(&metrics);
        assert_eq!(lines.last().expect("lines")["step"], 16, "{label}: {t}");
        let r: Vec<&serde_json::Value> = lines
            .iter()
            .filter_map(|l| l.get("restart").filter(|r| !r.is_null()))
            .collect();
        assert_eq!(r.len(), 1, "{label}: {t}");
        assert_eq!(r[0]["workers_before"], 4, "{label}: {t}");
        assert_eq!(r[0]["workers_after"], 2, "{label}: {t}");
        assert_eq!(r[0]["shards_read"], shards, "{label}: {t}");
        let lost = r[0]["resumed_from_step"].as_u64().expect("a step");
        assert!(lost >= 2, "{label}: {r:?}");
        let reference = tmp(&format!("launch-{label}-ref.state"));
        let _ = std::fs::remove_dir_all(&reference);
        let ref_saved = tmp(&format!("launch-{label}-ref.st"));
        let lost = lost.to_string();
        common::run_legs(
            &model,
            &[
                (4, &["--mesh", before], &lost, false),
                (2, &["--mesh", after], steps, true),
            ],
            (&reference, &ref_saved),
            &mpirun,
        );
        assert_eq!(max_difference(&saved, &ref_saved), 0.0, "{label}");
    }
}

/// The processes whose parent is `parent`, by name.
fn children_named(parent: u32, name: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let Some((head, rest)) = stat.rsplit_once(')') else {
                return false;
            };
            let comm = head.split_once('(').map_or("", |(_, c)| c);
            let ppid = rest
                .split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u32>().ok());
            comm == name && ppid == Some(parent)
        })
        .collect()
}

/// Issue 60, item 3: `kill -9` of mpirun under `distc launch` left its ranks training
/// unsupervised while the supervisor started a second job on the same state folder,
/// and the second job failed on the race (4 of 4 runs). The supervisor now stops the
/// ranks left, and waits for them, before it restarts; the launch completes its steps.
/// Then Ctrl-C to the supervisor (SIGINT, as a terminal sends it): the job stops, no
/// rank is left, and the launch exits with 130 saying what is on disk.
#[test]
fn the_launch_supervisor_owns_its_jobs_ranks() {
    let _one = common::one_job_at_a_time();
    let model = [
        "examples/dense_mlp.dsl",
        "--strategy",
        "allreduce",
        "--batch",
        "16",
        "-q",
    ];
    for ctrl_c in [false, true] {
        let state = tmp(&format!("owned-{ctrl_c}.state"));
        let _ = std::fs::remove_dir_all(&state);
        let metrics = tmp(&format!("owned-{ctrl_c}.jsonl"));
        let steps = if ctrl_c { "100000" } else { "16" };
        let child = launch_job(
            &[
                "--workers",
                "2",
                "--state",
                s(&state),
                "--metrics",
                s(&metrics),
            ],
            &[&model[..], &["--steps", steps]].concat(),
        );
        let start = Instant::now();
        let latest = state.join("latest");
        let written = || {
            std::fs::read_to_string(&latest)
                .ok()
                .and_then(|t| t.trim().strip_prefix("step-")?.parse::<u64>().ok())
        };
        while written().is_none_or(|k| k < 3) {
            assert!(
                start.elapsed() < Duration::from_secs(90),
                "no state of step 3"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (signal, target) = if ctrl_c {
            ("-INT", child.id())
        } else {
            let mpirun = children_named(child.id(), "mpirun");
            assert_eq!(mpirun.len(), 1, "{mpirun:?}");
            ("-KILL", mpirun[0])
        };
        let ranks_before = [0, 1].map(|r| rank_pid(s(&state), r));
        Command::new("kill")
            .args([signal, &target.to_string()])
            .status()
            .expect("kill");
        let (o, _) = wait_at_most(child, None, Duration::from_secs(120), "launch");
        let t = text(&o);
        println!("{signal} to {target}:\n{t}");
        // No rank of any of its jobs outlives the launch.
        for pid in ranks_before.into_iter().flatten() {
            assert!(
                !distc_runtime::core::output::process_alive(pid),
                "rank pid {pid} still runs: {t}"
            );
        }
        if ctrl_c {
            assert_eq!(o.status.code(), Some(130), "{t}");
            assert!(
                t.contains("interrupted (Ctrl-C) after step")
                    && t.contains("the last complete state is of step"),
                "{t}"
            );
        } else {
            assert!(o.status.success(), "{t}");
            assert!(t.contains("a rank was lost"), "{t}");
            let lines = common::metrics_lines(&metrics);
            assert_eq!(lines.last().expect("lines")["step"], 16, "{t}");
        }
    }
}
