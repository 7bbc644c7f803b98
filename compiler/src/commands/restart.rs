//! The one restart policy of `--elastic` (a run that goes on in this process) and
//! `distc launch` (an MPI job started again): at most `--max-restarts` restarts after a
//! lost worker, never below `--min-workers` nor below one replica, and the `restart`
//! object the first step line after a restart carries, with its seconds of recovery
//! (from the loss to that line's step's start) and of training undone (from the line of
//! the step resumed from to the loss).

use distc_runtime::run::metrics::Restart;
use std::time::Instant;

/// What a caller knows of a loss: where it was, what it resumes from, who is left.
pub(super) struct Loss {
    pub(super) lost_at_step: usize,
    pub(super) resumed_from_step: usize,
    pub(super) cause: String,
    pub(super) workers_before: usize,
    pub(super) workers_after: usize,
    pub(super) shards_read: usize,
}

/// The restarts of one run, and the lines of its current attempt.
pub(super) struct Restarts {
    max: usize,
    min_workers: usize,
    /// The workers of one replica: what one loss costs.
    replica: usize,
    done: usize,
    /// The restart the next step line reports, and when the loss was seen.
    pending: Option<(Restart, Instant)>,
    /// When the current attempt started, and when each of its step lines came.
    started: Instant,
    arrived: Vec<(usize, Instant)>,
}

impl Restarts {
    pub(super) fn new(max: usize, min_workers: usize, replica: usize) -> Restarts {
        Restarts {
            max,
            min_workers,
            replica: replica.max(1),
            done: 0,
            pending: None,
            started: Instant::now(),
            arrived: Vec::new(),
        }
    }

    /// An attempt starts: what a later loss undoes is counted from its lines.
    pub(super) fn attempt(&mut self) {
        self.started = Instant::now();
        self.arrived.clear();
    }

    /// Step `step`'s line came (`own_sec`: the step's own time, which is training, not
    /// recovery). The first line after a restart carries it.
    pub(super) fn line(&mut self, step: usize, own_sec: f64) -> Option<Restart> {
        self.arrived.push((step, Instant::now()));
        let (mut restart, seen) = self.pending.take()?;
        restart.recovery_sec = (seen.elapsed().as_secs_f64() - own_sec).max(0.0);
        Some(restart)
    }

    /// Whether a loss that leaves `after` workers may restart; why not, when not.
    pub(super) fn refusal(&self, after: usize) -> Option<String> {
        if self.done >= self.max {
            return Some(format!(
                "stopped after {} restarts (--max-restarts)",
                self.done
            ));
        }
        if after < self.min_workers.max(self.replica) {
            return Some(format!(
                "{after} workers would be left, fewer than --min-workers {}",
                self.min_workers
            ));
        }
        None
    }

    /// Restarts after `loss`, seen at `seen`: the next attempt's first line reports it.
    pub(super) fn restart(&mut self, loss: Loss, seen: Instant) {
        let since = self
            .arrived
            .iter()
            .find(|(s, _)| *s == loss.resumed_from_step)
            .map_or(self.started, |(_, at)| *at);
        self.pending = Some((
            restart_of(loss, seen.saturating_duration_since(since)),
            seen,
        ));
        self.done += 1;
    }

    /// Starts again for a reason that loses nothing (workers joined): reported as a
    /// restart, not counted against `--max-restarts`, no training undone.
    pub(super) fn regroup(&mut self, loss: Loss, seen: Instant) {
        self.pending = Some((restart_of(loss, std::time::Duration::ZERO), seen));
    }
}

fn restart_of(loss: Loss, lost: std::time::Duration) -> Restart {
    Restart {
        lost_at_step: loss.lost_at_step,
        resumed_from_step: loss.resumed_from_step,
        cause: loss.cause,
        workers_before: loss.workers_before,
        workers_after: loss.workers_after,
        shards_read: loss.shards_read,
        recovery_sec: 0.0,
        lost_sec: lost.as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loss(resumed_from_step: usize, after: usize) -> Loss {
        Loss {
            lost_at_step: resumed_from_step + 1,
            resumed_from_step,
            cause: "worker 1 lost".into(),
            workers_before: after + 2,
            workers_after: after,
            shards_read: 0,
        }
    }

    #[test]
    fn restarts_stop_at_the_limit_and_the_floor_and_the_next_line_reports_one() {
        let mut r = Restarts::new(1, 2, 2);
        assert_eq!(r.refusal(2), None);
        // Below --min-workers, and below one replica whatever --min-workers says.
        assert!(r.refusal(1).is_some_and(|m| m.contains("--min-workers 2")));
        assert!(Restarts::new(1, 0, 2).refusal(0).is_some());
        r.attempt();
        assert!(r.line(1, 0.0).is_none());
        r.restart(loss(1, 2), Instant::now());
        assert!(r.refusal(2).is_some_and(|m| m.contains("after 1 restarts")));
        r.attempt();
        let first = r.line(2, 0.0).expect("the first line after a restart");
        assert_eq!((first.resumed_from_step, first.workers_after), (1, 2));
        assert!(first.recovery_sec >= 0.0 && first.lost_sec >= 0.0);
        assert!(r.line(3, 0.0).is_none());
    }

    #[test]
    fn training_undone_counts_from_the_line_of_the_step_resumed_from() {
        let mut r = Restarts::new(3, 1, 1);
        r.attempt();
        r.line(1, 0.0);
        std::thread::sleep(std::time::Duration::from_millis(30));
        r.line(2, 0.0);
        r.restart(loss(1, 1), Instant::now());
        r.attempt();
        let lost = r.line(2, 0.0).map(|x| x.lost_sec).unwrap_or_default();
        assert!(
            lost >= 0.03,
            "undone since step 1's line, not step 2's: {lost}"
        );
        r.regroup(loss(2, 1), Instant::now());
        assert_eq!(r.line(3, 0.0).map(|x| x.lost_sec), Some(0.0));
        assert_eq!(r.refusal(1), None, "joining workers counts no restart");
    }
}
