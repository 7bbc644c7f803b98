//! SLURM, run for real (issue 40, item 3): a cluster of this machine, started and
//! stopped by the test (`scripts/slurm-local.sh`: Debian's slurmctld and slurmd), runs
//! the README's SLURM lines: ranks of distc started by `srun --mpi=pmix` (PMIx), and an
//! `sbatch` job whose script starts them with OpenMPI's own launcher inside the
//! allocation. Both train what threads train, bit for bit. Needs the `mpi` feature and
//! SLURM (`scripts/install-slurm.sh`); without SLURM the test says so and passes,
//! unless `CI` is set.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::{distc, max_difference, root, s, text};

fn tmp(name: &str) -> PathBuf {
    common::temp_dir("slurm").join(name)
}

/// A cluster of this machine, stopped when dropped.
struct Cluster {
    dir: PathBuf,
}

impl Cluster {
    /// Starts one under `dir`, or `None` (said why) where SLURM is not installed.
    fn start(dir: &Path) -> Option<Cluster> {
        if Command::new("slurmctld").arg("-V").output().is_err() {
            assert!(
                std::env::var_os("CI").is_none(),
                "SLURM is not installed (scripts/install-slurm.sh), and CI is set"
            );
            println!("skipping: SLURM is not installed (scripts/install-slurm.sh)");
            return None;
        }
        // A port of this process's own: two test runs at once do not meet.
        let port = 20000 + (std::process::id() % 5000) * 2;
        let o = Command::new("bash")
            .arg(root().join("scripts/slurm-local.sh"))
            .args(["start", s(dir), &port.to_string()])
            .output()
            .expect("bash runs");
        assert!(
            o.status.success(),
            "the cluster did not start: {}",
            text(&o)
        );
        Some(Cluster {
            dir: dir.to_path_buf(),
        })
    }

    /// A SLURM client command against this cluster, in the repository's root.
    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", self.dir.join("slurm.conf"))
            .env("MATMUL_NUM_THREADS", "1")
            .current_dir(root());
        c
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(root().join("scripts/slurm-local.sh"))
            .args(["stop", s(&self.dir)])
            .output();
    }
}

fn ok(o: &Output, what: &str) {
    assert!(o.status.success(), "{what}: {}", text(o));
}

#[test]
fn srun_and_sbatch_jobs_of_distc_train_what_threads_train() {
    let _one = common::one_job_at_a_time();
    let Some(cluster) = Cluster::start(&tmp("cluster")) else {
        return;
    };
    let distc_bin = env!("CARGO_BIN_EXE_distc");
    // The README's plan: 2 workers and 2 parameter servers, 4 ranks.
    let plan = tmp("lm.plan.json");
    let o = distc(&[
        "compile",
        "examples/sparse_lm.dsl",
        "--strategy",
        "hybrid",
        "--workers",
        "2",
        "--servers",
        "2",
        "--batch",
        "16",
        "-o",
        s(&plan),
    ]);
    ok(&o, "compile");
    let threads = tmp("threads.st");
    let o = distc(&["run", s(&plan), "--steps", "3", "-q", "--save", s(&threads)]);
    ok(&o, "threads");

    // srun -n 4 --mpi=pmix distc run lm.plan.json --transport mpi
    let by_srun = tmp("srun.st");
    let o = cluster
        .command("srun")
        .args(["-n", "4", "--mpi=pmix", distc_bin, "run", s(&plan)])
        .args([
            "--transport",
            "mpi",
            "--steps",
            "3",
            "-q",
            "--save",
            s(&by_srun),
        ])
        .output()
        .expect("srun runs");
    ok(&o, "srun");
    assert_eq!(max_difference(&threads, &by_srun), 0.0, "srun");

    // sbatch -n 4 job.sh, the script starting the ranks with mpirun inside the
    // allocation (OpenMPI reads the allocation from SLURM's environment).
    let by_sbatch = tmp("sbatch.st");
    let script = tmp("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nmpirun --allow-run-as-root {distc_bin} run {} --transport mpi \
             --steps 3 -q --save {}\n",
            s(&plan),
            s(&by_sbatch)
        ),
    )
    .expect("the job script");
    let log = tmp("job.out");
    let o = cluster
        .command("sbatch")
        .args(["--wait", "-n", "4", "-o", s(&log), s(&script)])
        .output()
        .expect("sbatch runs");
    let job_log = std::fs::read_to_string(&log).unwrap_or_default();
    ok(&o, &format!("sbatch (job output: {job_log})"));
    assert_eq!(
        max_difference(&threads, &by_sbatch),
        0.0,
        "sbatch: {job_log}"
    );

    // distc launch inside an allocation, without a hostfile: its hosts (what it probes
    // after a lost rank) are the allocation's nodes.
    let (launched, state) = (tmp("launch.st"), tmp("launch.state"));
    let script = tmp("launch.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n{distc_bin} launch --workers 2 --state {} --checkpoint-every 1 \
             --mpirun-arg=--allow-run-as-root -- examples/dense_mlp.dsl --strategy \
             allreduce --batch 16 -q --steps 3 --save {}\n",
            s(&state),
            s(&launched)
        ),
    )
    .expect("the job script");
    let log = tmp("launch.out");
    let o = cluster
        .command("sbatch")
        .args(["--wait", "-n", "2", "-o", s(&log), s(&script)])
        .output()
        .expect("sbatch runs");
    let job_log = std::fs::read_to_string(&log).unwrap_or_default();
    ok(
        &o,
        &format!("sbatch of distc launch (job output: {job_log})"),
    );
    assert!(
        job_log.contains("the hosts of the SLURM allocation: local slots=2"),
        "{job_log}"
    );
    let by_threads = tmp("launch-threads.st");
    let o = distc(&[
        "train",
        "examples/dense_mlp.dsl",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--batch",
        "16",
        "-q",
        "--steps",
        "3",
        "--save",
        s(&by_threads),
    ]);
    ok(&o, "threads");
    assert_eq!(max_difference(&by_threads, &launched), 0.0, "{job_log}");

    // A job of the wrong size is refused by every rank, naming the size the plan needs.
    let o = cluster
        .command("srun")
        .args(["-n", "3", "--mpi=pmix", distc_bin, "run", s(&plan)])
        .args(["--transport", "mpi", "--steps", "1", "-q"])
        .output()
        .expect("srun runs");
    assert!(!o.status.success(), "a 3-rank job of a 4-rank plan ran");
    assert!(
        text(&o).contains("the job has 3 ranks, the plan needs 4")
            && text(&o).contains("srun -n 4 --mpi=pmix"),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
}
