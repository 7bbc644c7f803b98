//! `distc launch`: a `train` job as MPI ranks under a supervisor that starts the job
//! again, one replica smaller, when a rank is lost (issue 40).
//!
//! Under MPI a lost rank ends the whole job (mpirun kills the others), so the
//! survivors' memory is gone with it: the supervisor keeps the state on disk instead.
//! Each attempt is `mpirun -np W+S distc train ARGS --workers W --transport mpi
//! --checkpoint DIR --sharded --checkpoint-every K`, resuming from `DIR` where it holds
//! a state. When mpirun ends with a rank lost (a rank killed by a signal, or a rank
//! that stopped on a lost peer: exit status 75), the supervisor starts the next attempt
//! with one replica fewer (the data axis shrinks, servers are kept), from the last
//! complete state in `DIR`, at most `--max-restarts` times and never below
//! `--min-workers`. Any other failure is the job's own and ends the launch. With
//! `--model-axis T` and `--pipeline P` a replica is T workers on a model axis on each
//! of P stages: each attempt runs `--mesh data=W/(T P),model=T,pipe=P` instead of
//! `--workers W` (replica 0's stage ranks write the shards).
//!
//! A job that lost workers grows again (`--max-workers`): once the hostfile lists slots
//! for more workers (a host added back, or a new one) and a state of the running job is
//! on disk, the supervisor stops the job (SIGTERM to mpirun) and starts it with the
//! workers there is room for, from that state.
//!
//! Every attempt's metrics lines reach `--metrics FILE` as they come; the first line
//! after a restart carries a `restart` object, as under `--elastic`.
//!
//! The supervisor owns its jobs (issue 60, item 3). mpirun runs in a process group of
//! its own, so a terminal's Ctrl-C reaches the supervisor alone; Ctrl-C or SIGTERM to
//! the supervisor stops the job (SIGTERM to mpirun) and ends the launch with exit 130,
//! saying what is on disk. Every local process of a job carries its job's mark in its
//! environment (`DISTC_LAUNCH_JOB`): once mpirun has ended, however it ended (killed
//! itself, say), those still running are stopped, and waited for, before anything
//! else starts on the state folder. A rank ended by SIGTERM that the supervisor did
//! not send is a lost rank, as one ended by SIGKILL is. The ranks learn why they are
//! stopped from the file `DISTC_LAUNCH_STOP` names: the supervisor writes it before
//! it stops a job, so a rank stopped by mpirun for a lost peer does not say it was
//! interrupted.

use super::restart::{Loss, Restarts};
use crate::cli::LaunchArgs;
use crate::console::err;
use anyhow::{bail, Context, Result};
use distc_runtime::core::error::WORKER_LOST_EXIT;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `train` flags the supervisor sets itself on every attempt.
const OWNED: [&str; 11] = [
    "--workers",
    "--servers",
    "--transport",
    "--checkpoint",
    "--checkpoint-every",
    "--sharded",
    "--resume",
    "--metrics",
    "--elastic",
    "--mesh",
    "--pipeline",
];

/// Whether mpirun's `status` says a rank was lost: a rank killed by a signal a crash
/// or `kill -9` sends (mpirun exits with 128 + the signal), or a rank that stopped on
/// a lost peer.
fn lost_a_rank(status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    match status.code() {
        Some(WORKER_LOST_EXIT) => true,
        // SIGABRT, SIGBUS, SIGKILL, SIGSEGV.
        Some(c) if c > 128 => matches!(c - 128, 6 | 7 | 9 | 11),
        Some(_) => false,
        None => status.signal().is_some_and(|s| matches!(s, 6 | 7 | 9 | 11)),
    }
}

/// The step of the newest complete state in `dir`, if any (committed or not: a job
/// that lost a rank may have finished writing a state it had no time to commit).
fn state_step(dir: &Path) -> Option<usize> {
    distc_runtime::core::shards::newest_complete(dir).map(|(step, _)| step as usize)
}

/// The shards of the newest complete state in `dir`: what a restart reads (a new
/// `mpirun` job's ranks hold nothing).
fn state_shards(dir: &Path) -> usize {
    distc_runtime::core::shards::newest_complete(dir).map_or(0, |(_, folder)| {
        std::fs::read_dir(folder).map_or(0, |entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("rank-"))
                .count()
        })
    })
}

use super::stop::{JOB_MARK, STOP_FILE};

/// This machine's processes that carry `mark` as their job's mark, but this one.
fn marked(mark: &str) -> Vec<u32> {
    let want = format!("{JOB_MARK}={mark}");
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|&pid| pid != me && distc_runtime::core::output::process_alive(pid))
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|kv| kv == want.as_bytes()))
        })
        .collect()
}

/// Stops what is left of the job marked `mark` once its mpirun has ended: SIGTERM, then
/// SIGKILL to what still runs after `grace`; returns how many were left, and fails if
/// any outlives SIGKILL (nothing may start on the state folder beside them).
fn end_leftovers(mark: &str, grace: Duration) -> Result<usize> {
    let left = marked(mark);
    if left.is_empty() {
        return Ok(0);
    }
    let signal = |sig: &str, pids: &[u32]| {
        let mut kill = Command::new("kill");
        kill.arg(sig).args(pids.iter().map(u32::to_string));
        let _ = kill.stderr(Stdio::null()).status();
    };
    let gone_within = |within: Duration| {
        let start = Instant::now();
        while start.elapsed() < within {
            if marked(mark).is_empty() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        marked(mark).is_empty()
    };
    signal("-TERM", &left);
    if !gone_within(grace) {
        signal("-KILL", &marked(mark));
        if !gone_within(Duration::from_secs(10)) {
            bail!(
                "processes {:?} of the ended job still run after SIGKILL: not starting \
                 another job on the state folder beside them",
                marked(mark)
            );
        }
    }
    Ok(left.len())
}

/// Set by Ctrl-C or SIGTERM to the supervisor.
fn stop_flag() -> Arc<std::sync::atomic::AtomicBool> {
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = flag.clone();
    if let Err(e) = ctrlc::set_handler(move || {
        seen.store(true, std::sync::atomic::Ordering::SeqCst);
    }) {
        err(&format!(
            "warning: Ctrl-C will not stop the job cleanly: {e}\n"
        ));
    }
    flag
}

/// Runs `train` as the flags say, restarting on a lost rank.
pub fn launch(args: &LaunchArgs, train: &[String]) -> Result<()> {
    for a in train {
        if let Some(flag) = OWNED
            .iter()
            .find(|f| a == *f || a.starts_with(&format!("{f}=")))
        {
            bail!(
                "distc launch sets {flag} itself: give the workers, servers, model axis, \
                 pipeline stages, state folder (--state), checkpoint interval and metrics \
                 file to launch, before `--`"
            );
        }
    }
    let replica = args.replica();
    let of = format!(
        "--model-axis {} x --pipeline {}",
        args.model_axis, args.pipeline
    );
    for (flag, n) in [
        ("--workers", Some(args.workers)),
        ("--max-workers", args.max_workers),
    ] {
        if let Some(n) = n.filter(|n| n % replica != 0) {
            bail!("{flag} {n} is not a multiple of {of}: each replica has {replica} workers");
        }
    }
    if replica > 1 && args.servers > 0 {
        bail!(
            "--servers with {of}: a mesh with a model axis or pipeline stages has no \
             parameter servers"
        );
    }
    if args.workers < args.min_workers {
        bail!(
            "--workers {} is below --min-workers {}",
            args.workers,
            args.min_workers
        );
    }
    if let Some(most) = args.max_workers.filter(|&m| m < args.workers) {
        bail!("--max-workers {most} is below --workers {}", args.workers);
    }
    let exe = std::env::current_exe().context("finding the distc binary")?;
    let scratch = tempfile::tempdir().context("a folder for the attempts' metrics")?;
    if let Some(m) = &args.metrics {
        distc_runtime::core::output::check_output(m, &[])?;
        std::fs::File::create(m).with_context(|| format!("{}", m.display()))?;
    }
    let hostfile = match &args.hostfile {
        Some(h) => Some(h.clone()),
        None => slurm_hostfile(scratch.path())?,
    };
    let mut hosts = hostfile.map(|path| Hosts {
        path,
        dead: Vec::new(),
        live: scratch.path().join("hosts"),
    });
    let mut workers = args.workers;
    // Restarts after a lost rank (bounded by --max-restarts), and attempts in all.
    let mut restarts = Restarts::new(args.max_restarts, args.min_workers, replica);
    let mut attempt = 0;
    let stop = stop_flag();
    let stop_file = scratch.path().join("stop");
    loop {
        let resume = distc_runtime::core::shards::newest_complete(&args.state);
        attempt += 1;
        let _ = std::fs::remove_file(&stop_file);
        let mark = format!("{}-{attempt}", std::process::id());
        let metrics = scratch.path().join(format!("attempt-{attempt}.jsonl"));
        let mut cmd = Command::new(&args.mpirun);
        cmd.args(&args.mpirun_args);
        if let Some(h) = &hosts {
            cmd.arg("--hostfile").arg(h.write_live()?);
        }
        cmd.args(["-np", &(workers + args.servers).to_string()])
            .arg(&exe)
            .arg("train")
            .args(train);
        if replica > 1 {
            let mesh = format!(
                "data={},model={},pipe={}",
                workers / replica,
                args.model_axis,
                args.pipeline
            );
            cmd.args(["--mesh", &mesh]);
        } else {
            cmd.args(["--workers", &workers.to_string()])
                .args(["--servers", &args.servers.to_string()]);
        }
        cmd.args(["--transport", "mpi", "--sharded"])
            .arg("--checkpoint")
            .arg(&args.state)
            .args(["--checkpoint-every", &args.checkpoint_every.to_string()])
            .arg("--metrics")
            .arg(&metrics)
            .env(JOB_MARK, &mark)
            .env(STOP_FILE, &stop_file)
            .stderr(Stdio::piped());
        // Its own process group: a terminal's Ctrl-C reaches the supervisor, which
        // stops the job itself.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        if let Some((_, folder)) = &resume {
            cmd.arg("--resume").arg(folder);
        }
        restarts.attempt();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} (is OpenMPI installed?)", args.mpirun))?;
        // mpirun's own words on a lost rank, and the ranks' errors, for the restart's
        // cause; everything is passed on to this process's stderr.
        let said = Arc::new(Mutex::new(Vec::<String>::new()));
        let forward = child.stderr.take().map(|e| {
            let said = said.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(e).lines().map_while(|l| l.ok()) {
                    err(&format!("{line}\n"));
                    let l = line.trim();
                    if l.starts_with("error:") || l.contains("exited on signal") {
                        said.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(l.to_string());
                    }
                }
            })
        });
        let mut lines = MetricsTail::new(metrics);
        let on_disk_at_start = state_step(&args.state);
        // Workers the job grows to, once the hostfile has room for them and a state
        // of this attempt is on disk to start them from.
        let mut grow_to = None;
        // Why the supervisor stopped the job itself, once it has.
        let mut stopped: Option<&str> = None;
        let term = |child: &std::process::Child, why: &str| {
            let _ = std::fs::write(&stop_file, why);
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        };
        let status = loop {
            lines.pass_on(args.metrics.as_deref(), &mut restarts)?;
            if let Some(s) = child.try_wait()? {
                break s;
            }
            if stopped.is_none() && stop.load(std::sync::atomic::Ordering::SeqCst) {
                stopped = Some("interrupted");
                term(
                    &child,
                    "stopped by distc launch: interrupted (Ctrl-C or SIGTERM)",
                );
            }
            // The hostfile first (one small file; nothing without --max-workers), the
            // state's shard headers only once it has room.
            let room = grow_to
                .is_none()
                .then(|| room_for(args, hosts.as_ref(), workers))
                .flatten();
            if let Some(room) = room {
                if state_step(&args.state) > on_disk_at_start {
                    grow_to = Some(room);
                    stopped = Some("grow");
                    // mpirun passes SIGTERM on; each rank stops at once, and the state
                    // just committed is where the larger job starts.
                    term(
                        &child,
                        &format!("stopped by distc launch to start it on {room} workers"),
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let seen = Instant::now();
        // Nothing starts on the state folder while a process of this job runs.
        let left = end_leftovers(&mark, Duration::from_secs(5))?;
        if left > 0 {
            err(&format!(
                "distc launch: {left} process(es) of the job still ran after mpirun \
                 ended ({status}): stopped\n"
            ));
        }
        if let Some(f) = forward {
            let _ = f.join();
        }
        lines.pass_on(args.metrics.as_deref(), &mut restarts)?;
        if status.success() {
            return Ok(());
        }
        if stopped == Some("interrupted") {
            let state = match state_step(&args.state) {
                Some(step) => format!(
                    "the last complete state is of step {step} in {} (run the same \
                     launch again to resume from it)",
                    args.state.display()
                ),
                None => format!("{} holds no complete state", args.state.display()),
            };
            return Err(distc_runtime::RuntimeError::Interrupted(format!(
                "{} after step {}: the job was stopped; {state}",
                super::stop::INTERRUPTED,
                lines.last_step.unwrap_or(0)
            ))
            .into());
        }
        if let Some(room) = grow_to {
            let resumed_from = state_step(&args.state).unwrap_or(0);
            let slots = hosts.as_ref().map_or(0, Hosts::slots);
            err(&format!(
                "distc launch: the hostfile lists {slots} slots; restarting from step \
                 {resumed_from} with {room} workers (was {workers})\n"
            ));
            let joined = Loss {
                lost_at_step: lines.last_step.unwrap_or(resumed_from) + 1,
                resumed_from_step: resumed_from,
                cause: format!("workers joined: the hostfile lists {slots} slots"),
                workers_before: workers,
                workers_after: room,
                shards_read: state_shards(&args.state),
            };
            restarts.regroup(joined, seen);
            workers = room;
            continue;
        }
        // A rank ended by a SIGTERM the supervisor did not send (a scheduler's, or a
        // user's `kill`) is lost as one SIGKILL ended.
        let termed = said
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|l| l.contains("exited on signal 15"));
        if !lost_a_rank(status) && !termed {
            bail!("the job failed (mpirun: {status}), not on a lost rank: not restarted");
        }
        // mpirun's line naming the rank lost, else the ranks' errors (the survivors',
        // stopped by mpirun, say they were interrupted: not the cause).
        let cause = {
            let said = said.lock().unwrap_or_else(|p| p.into_inner());
            let signalled: Vec<&String> = said
                .iter()
                .filter(|l| l.contains("exited on signal"))
                .collect();
            match (signalled.is_empty(), said.is_empty()) {
                (false, _) => signalled
                    .iter()
                    .map(|l| l.as_str())
                    .collect::<Vec<_>>()
                    .join("; "),
                (true, false) => said.join("; "),
                (true, true) => format!("mpirun: {status}"),
            }
        };
        // A host that no longer answers is left out of the next attempts (its ranks
        // with it); a rank killed on a host that answers costs that rank alone.
        let mut after = workers - replica;
        if let Some(h) = hosts.as_mut() {
            let gone = h.probe(args);
            if !gone.is_empty() {
                err(&format!(
                    "distc launch: host(s) {} did not answer within {} s: left out\n",
                    gone.join(", "),
                    args.probe_timeout
                ));
            }
            after = after.min(h.slots().saturating_sub(args.servers));
            after -= after % replica;
        }
        if let Some(why) = restarts.refusal(after) {
            bail!("a rank was lost ({cause}); {why}");
        }
        let resumed_from = state_step(&args.state).unwrap_or(0);
        let lost_at = lines
            .last_step
            .map_or(resumed_from, |s| s.max(resumed_from))
            + 1;
        err(&format!(
            "distc launch: a rank was lost at step {lost_at} ({cause}); restarting from \
             step {resumed_from} with {after} workers (was {workers})\n"
        ));
        let loss = Loss {
            lost_at_step: lost_at,
            resumed_from_step: resumed_from,
            cause,
            workers_before: workers,
            workers_after: after,
            shards_read: state_shards(&args.state),
        };
        restarts.restart(loss, seen);
        workers = after;
    }
}

/// Inside a SLURM allocation without `--hostfile`: the allocation's nodes as a
/// hostfile written under `dir` (`scontrol show hostnames $SLURM_JOB_NODELIST`, each
/// node's slots from `SLURM_TASKS_PER_NODE`), so that a node lost is probed and left
/// out as a hostfile's host is. `None` outside an allocation.
fn slurm_hostfile(dir: &Path) -> Result<Option<PathBuf>> {
    let Ok(nodelist) = std::env::var("SLURM_JOB_NODELIST") else {
        return Ok(None);
    };
    let per_node = std::env::var("SLURM_TASKS_PER_NODE").unwrap_or_default();
    let o = Command::new("scontrol")
        .args(["show", "hostnames", &nodelist])
        .output()
        .context("running scontrol show hostnames (SLURM_JOB_NODELIST is set)")?;
    if !o.status.success() {
        bail!(
            "scontrol show hostnames {nodelist}: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    let nodes: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let slots = tasks_per_node(&per_node)
        .map_err(|m| anyhow::anyhow!("SLURM_TASKS_PER_NODE `{per_node}`: {m}"))?;
    if slots.len() != nodes.len() {
        bail!(
            "SLURM_JOB_NODELIST `{nodelist}` names {} nodes, SLURM_TASKS_PER_NODE \
             `{per_node}` gives slots for {}",
            nodes.len(),
            slots.len()
        );
    }
    let text: String = nodes
        .iter()
        .zip(&slots)
        .map(|(n, k)| format!("{n} slots={k}\n"))
        .collect();
    err(&format!(
        "distc launch: the hosts of the SLURM allocation: {}\n",
        text.trim().replace('\n', ", ")
    ));
    let path = dir.join("slurm-hosts");
    std::fs::write(&path, text).with_context(|| format!("{}", path.display()))?;
    Ok(Some(path))
}

/// Slots per node from SLURM's `SLURM_TASKS_PER_NODE` (`2(x3),1`: three nodes of 2,
/// then one of 1).
fn tasks_per_node(text: &str) -> std::result::Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in text.split(',').map(str::trim) {
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => (n, rest.strip_suffix(')').ok_or("an unclosed `(x`")?),
            None => (part, "1"),
        };
        let n: usize = n
            .parse()
            .map_err(|_| format!("`{part}` is not N or N(xK)"))?;
        let times: usize = times
            .parse()
            .map_err(|_| format!("`{part}` is not N or N(xK)"))?;
        out.extend(std::iter::repeat_n(n, times));
    }
    Ok(out)
}

/// Slots a hostfile's text lists: `HOST slots=N` a line (a host alone: one slot; `#`
/// comments).
fn slots_of(text: &str) -> usize {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("slots="))
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(1)
        })
        .sum()
}

/// The workers a job of `workers` grows to: more where the hostfile now lists slots
/// for them (beside the servers), up to `--max-workers`.
fn room_for(args: &LaunchArgs, hosts: Option<&Hosts>, workers: usize) -> Option<usize> {
    let most = args.max_workers?;
    let room = hosts?.slots().saturating_sub(args.servers).min(most);
    let room = room - room % args.replica();
    (room > workers).then_some(room)
}

/// The hostfile's hosts, less those found unreachable (left out for the rest of the
/// launch; a host that joins later is a line of another name).
struct Hosts {
    /// The user's hostfile, read again at every look.
    path: PathBuf,
    /// Hosts that did not answer a probe.
    dead: Vec<String>,
    /// Where the hostfile of the live hosts is written for mpirun.
    live: PathBuf,
}

impl Hosts {
    /// The live hosts and their lines.
    fn lines(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(&self.path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let host = l.split('#').next()?.split_whitespace().next()?.to_string();
                (!self.dead.contains(&host)).then(|| (host, l.to_string()))
            })
            .collect()
    }

    /// The live hosts' hostfile text.
    fn text(&self) -> String {
        self.lines().into_iter().map(|(_, l)| l + "\n").collect()
    }

    /// Slots of the live hosts.
    fn slots(&self) -> usize {
        slots_of(&self.text())
    }

    /// Writes the live hosts' hostfile; returns its path.
    fn write_live(&self) -> Result<PathBuf> {
        std::fs::write(&self.live, self.text())
            .with_context(|| format!("{}", self.live.display()))?;
        Ok(self.live.clone())
    }

    /// Runs a one-rank job on every live host at once; those that do not finish it
    /// within `--probe-timeout` seconds are dead from now on. Returns them.
    fn probe(&mut self, args: &LaunchArgs) -> Vec<String> {
        let probes: Vec<(String, Option<std::process::Child>)> = self
            .lines()
            .into_iter()
            .map(|(host, _)| {
                let child = Command::new(&args.mpirun)
                    .args(&args.mpirun_args)
                    .args(["--host", &host, "-np", "1", "true"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .ok();
                (host, child)
            })
            .collect();
        let until = Instant::now() + Duration::from_secs_f64(args.probe_timeout);
        let mut gone = Vec::new();
        for (host, child) in probes {
            let answered = child.is_some_and(|mut c| loop {
                match c.try_wait() {
                    Ok(Some(status)) => break status.success(),
                    Ok(None) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    _ => {
                        let _ = c.kill();
                        let _ = c.wait();
                        break false;
                    }
                }
            });
            if !answered {
                gone.push(host);
            }
        }
        self.dead.extend(gone.iter().cloned());
        gone
    }
}

/// The lines an attempt's rank 0 has written so far, passed on once each.
struct MetricsTail {
    path: PathBuf,
    /// Bytes of complete lines already passed on.
    read: usize,
    /// The last step passed on.
    last_step: Option<usize>,
}

impl MetricsTail {
    fn new(path: PathBuf) -> MetricsTail {
        MetricsTail {
            path,
            read: 0,
            last_step: None,
        }
    }

    /// Appends the new complete lines to `out`, each taken by `restarts`: the first
    /// after a restart carries it.
    fn pass_on(&mut self, out: Option<&Path>, restarts: &mut Restarts) -> Result<()> {
        let Ok(bytes) = std::fs::read(&self.path) else {
            return Ok(());
        };
        let Some(end) = bytes.iter().rposition(|&b| b == b'\n').map(|e| e + 1) else {
            return Ok(());
        };
        if end <= self.read {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&bytes[self.read..end]).into_owned();
        self.read = end;
        let mut new = String::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let mut v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}: a metrics line", self.path.display()))?;
            let step = v["step"].as_u64().unwrap_or(0) as usize;
            self.last_step = Some(step);
            let own = v["compute_sec"].as_f64().unwrap_or(0.0)
                + v["comm_wait_sec"].as_f64().unwrap_or(0.0);
            if let Some(restart) = restarts.line(step, own) {
                v["restart"] = serde_json::to_value(&restart)?;
            }
            new.push_str(&serde_json::to_string(&v)?);
            new.push('\n');
        }
        if let Some(out) = out {
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(out)
                .with_context(|| format!("{}", out.display()))?;
            f.write_all(new.as_bytes())
                .with_context(|| format!("{}", out.display()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_tasks_per_node_give_each_nodes_slots() {
        assert_eq!(tasks_per_node("2(x3),1"), Ok(vec![2, 2, 2, 1]));
        assert_eq!(tasks_per_node("4"), Ok(vec![4]));
        assert!(tasks_per_node("2(x3").is_err());
        assert!(tasks_per_node("two").is_err());
        assert_eq!(slots_of("a slots=2\nb\n# c slots=9\n"), 3);
    }
}
