//! How a run says why it stopped: Ctrl-C's words, and, under `distc launch`, what the
//! supervisor and its ranks tell each other through the environment (the job's mark,
//! and the file saying why the supervisor stopped the job). Below both `run` and
//! `launch`, which each read it.

/// How the error of a run stopped by Ctrl-C begins (the binary exits with 130 on it).
pub const INTERRUPTED: &str = "interrupted (Ctrl-C)";

/// The environment variable that marks a job's processes.
pub const JOB_MARK: &str = "DISTC_LAUNCH_JOB";
/// The environment variable that names the file saying why the supervisor stopped the
/// job (absent while it has not).
pub const STOP_FILE: &str = "DISTC_LAUNCH_STOP";

/// Why this run is stopping, in its first words: Ctrl-C, or under `distc launch` what
/// the supervisor wrote before it stopped the job. A rank of a supervised job that
/// finds no such word was stopped by mpirun, which SIGTERMs every rank once one is
/// lost: the ranks cannot tell that SIGTERM from a Ctrl-C's, the supervisor can.
pub(crate) fn stop_cause() -> String {
    stop_cause_in(std::env::var_os(STOP_FILE))
}

/// [`stop_cause`], `stop_file` being what the supervisor's variable says.
fn stop_cause_in(stop_file: Option<std::ffi::OsString>) -> String {
    match stop_file {
        None => INTERRUPTED.to_string(),
        Some(file) => match std::fs::read_to_string(&file) {
            Ok(why) if !why.trim().is_empty() => why.trim().to_string(),
            _ => "stopped by mpirun, as every rank is once one is lost or mpirun is \
                  stopped (distc launch decides what follows)"
                .to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 60, item 9: a rank of a `distc launch` job stopped by mpirun (another
    /// rank was lost) said "interrupted (Ctrl-C)". It says what the supervisor wrote
    /// when the supervisor stopped the job, and that mpirun stopped it otherwise.
    #[test]
    fn a_supervised_rank_says_who_stopped_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("stop");
        assert_eq!(stop_cause_in(None), INTERRUPTED);
        let lost = stop_cause_in(Some(file.clone().into_os_string()));
        assert!(
            lost.starts_with("stopped by mpirun") && !lost.contains("Ctrl-C"),
            "{lost}"
        );
        std::fs::write(&file, "stopped by distc launch: interrupted\n").expect("writes");
        assert_eq!(
            stop_cause_in(Some(file.into_os_string())),
            "stopped by distc launch: interrupted"
        );
    }
}
