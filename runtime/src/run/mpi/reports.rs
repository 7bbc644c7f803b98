//! The MPI transport's report path, for every kind of plan: a worker rank's reports
//! to rank 0 ([`ToRank0`]), and rank 0's drain ([`drain_on_rank0`]), which runs its
//! own role on a thread and hands every report, its own and the other ranks', to the
//! coordinator, watching the others with the one stall policy ([`StallInspector`]).

use super::{fail, Sends};
use crate::comm::mpi::{Backoff, Comm, Outgoing, Since, TAG_REPORT};
use crate::core::error::{PeerKind, Result, RuntimeError};
use crate::core::roles::Role;
use crate::run::mesh::Mesh;
use crate::run::metrics::StepReport;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::Duration;

/// The one stall policy of rank 0's coordinator, for every kind of plan: a worker that
/// sends no step report for longer than the timeout while another reports (or after
/// rank 0's own role has ended) has stopped. Each rank also bounds its own waits on its
/// peers; this catches a rank that went silent without any peer noticing (as under
/// asynchronous servers, or a stage whose neighbours are blocked on it).
struct StallInspector {
    /// Per worker: reports taken, when the last came, its step.
    heard: Vec<(usize, Since, usize)>,
    /// Reports each worker sends in all.
    expected: usize,
    timeout: Duration,
}

impl StallInspector {
    fn new(workers: usize, expected: usize, first_step: usize, timeout: Duration) -> Self {
        StallInspector {
            heard: vec![(0, Since::now(), first_step); workers],
            expected,
            timeout,
        }
    }

    /// Worker `w` reported `step`.
    fn heard(&mut self, w: usize, step: usize) {
        if let Some(h) = self.heard.get_mut(w) {
            *h = (h.0 + 1, Since::now(), step);
        }
    }

    /// The stalled worker other than rank 0's own, if one is, with the step it last
    /// reported, as an error naming it on the mesh. `own_done`: rank 0's own role has
    /// ended, so every other report is overdue from now on.
    fn stalled(&self, mesh: &Mesh, own_done: bool) -> Option<RuntimeError> {
        // How long ago the newest report came (now, once rank 0's own role has ended).
        let newest = if own_done {
            Duration::ZERO
        } else {
            self.heard
                .iter()
                .map(|h| h.1.waited())
                .min()
                .unwrap_or_default()
        };
        let w = (1..self.heard.len()).find(|&w| {
            let (taken, since, _) = &self.heard[w];
            *taken < self.expected && since.waited().saturating_sub(newest) > self.timeout
        })?;
        Some(RuntimeError::Peer {
            rank: 0,
            peer: w,
            op: "step report".into(),
            kind: PeerKind::TimedOut,
            message: format!(
                "worker rank {w} ({}) sent no step report after step {} for {:.0} s \
                 (--timeout) while {}: it stopped answering",
                mesh.name(w),
                self.heard[w].2,
                self.timeout.as_secs_f64(),
                if own_done {
                    "rank 0's own role had finished"
                } else {
                    "other workers went on"
                }
            ),
        })
    }
}

/// A worker rank's reports to rank 0, sent synchronous and in order: one rank 0 has not
/// taken within the timeout means rank 0 stopped (nothing else tells a rank that runs
/// on alone, as under asynchronous servers).
pub(super) struct ToRank0 {
    sends: Sends,
    /// The steps of the reports still pending, oldest first.
    steps: VecDeque<usize>,
    /// The run's last step: its report is awaited before the rank goes on.
    last_step: usize,
    rank: usize,
    /// This rank's name on the mesh.
    name: String,
}

impl ToRank0 {
    pub(super) fn new(rank: usize, mesh: &Mesh, last_step: usize, timeout: Duration) -> ToRank0 {
        ToRank0 {
            sends: Sends::new(timeout),
            steps: VecDeque::new(),
            last_step,
            rank,
            name: mesh.name(rank),
        }
    }

    /// Sends step `step`'s report.
    pub(super) fn send(&mut self, ctl: &Comm, step: usize, report: &StepReport) -> Result<()> {
        let bytes = serde_json::to_vec(report)
            .map_err(|e| RuntimeError::internal("the step report", e.to_string()))?;
        self.sends
            .pending
            .push_back(Outgoing::start(&ctl.0, 0, TAG_REPORT, bytes, true));
        self.steps.push_back(step);
        let late = if step == self.last_step {
            self.sends.flush().is_some()
        } else {
            self.sends.late().is_some()
        };
        // Sends complete in order: the steps of those still pending are the last.
        while self.steps.len() > self.sends.pending.len() {
            self.steps.pop_front();
        }
        if late {
            return Err(RuntimeError::Peer {
                rank: self.rank,
                peer: 0,
                op: "step report".into(),
                kind: PeerKind::TimedOut,
                message: format!(
                    "worker rank 0 did not take the report of step {} of {} within {:.0} s \
                     (--timeout): rank 0 stopped answering",
                    self.steps.front().copied().unwrap_or(step),
                    self.name,
                    self.sends.timeout.as_secs_f64()
                ),
            });
        }
        Ok(())
    }
}

/// Rank 0: its own role (`role`, named `name`) on a thread, the coordinator (`sink`)
/// here, until it has taken `steps` reports from each of the mesh's workers (the
/// steps after `done`, a resumed state's). Its own role's reports come over the
/// channel `role` is given; the others' as MPI messages. The coordinator's errors and a
/// stall stop the job at once: returning would wait for the own role, which may be
/// waiting on the rank at fault. The own role's error ends the drain with that error.
pub(super) fn drain_on_rank0<O: Send>(
    name: &str,
    mesh: &Mesh,
    ctl: &Comm,
    (steps, done): (usize, usize),
    timeout: Duration,
    role: impl FnOnce(mpsc::Sender<StepReport>) -> Result<O> + Send,
    sink: &mut dyn FnMut(StepReport) -> Result<()>,
) -> Result<O> {
    let workers = mesh.workers();
    let stop = |e: RuntimeError| -> ! {
        let code = e.exit_code();
        fail(
            &SimpleCommunicator::world(),
            0,
            Some(Role::Worker(0)),
            &e,
            code,
        )
    };
    let (tx, rx) = mpsc::channel::<StepReport>();
    let panicked = || RuntimeError::internal(name, format!("{name} panicked"));
    std::thread::scope(|scope| -> Result<O> {
        let handle = std::thread::Builder::new()
            .name(name.to_string())
            .spawn_scoped(scope, move || role(tx))
            .map_err(|e| RuntimeError::no_thread(name, e))?;
        let mut handle = Some(handle);
        let mut outcome = None;
        let mut stalls = StallInspector::new(workers, steps, done, timeout);
        let (mut received, expected) = (0, steps * workers);
        let mut backoff = Backoff(0);
        while received < expected {
            let mut got: Vec<StepReport> = rx.try_iter().collect();
            if let Some((msg, st)) = ctl
                .0
                .any_process()
                .immediate_matched_probe_with_tag(TAG_REPORT)
            {
                let (bytes, st) = (msg, st).matched_receive_vec::<u8>();
                match serde_json::from_slice::<StepReport>(&bytes) {
                    Ok(rep) => got.push(rep),
                    Err(e) => stop(RuntimeError::Peer {
                        rank: 0,
                        peer: st.source_rank() as usize,
                        op: "step report".into(),
                        kind: PeerKind::Malformed,
                        message: format!("a malformed step report: {e}"),
                    }),
                }
            }
            // The own role may end first (its reports are all in the channel): an
            // error ends the drain now; otherwise the other ranks' reports are awaited.
            if let Some(h) = handle.take_if(|h| h.is_finished()) {
                outcome = Some(h.join().map_err(|_| panicked())??);
            }
            if got.is_empty() {
                if let Some(e) = stalls.stalled(mesh, outcome.is_some()) {
                    stop(e);
                }
                backoff.wait();
                continue;
            }
            backoff = Backoff(0);
            for rep in got {
                stalls.heard(rep.rank, rep.step);
                received += 1;
                if let Err(e) = sink(rep) {
                    stop(e);
                }
            }
        }
        match (outcome, handle) {
            (Some(o), _) => Ok(o),
            (None, Some(h)) => h.join().map_err(|_| panicked())?,
            // The handle is taken only with its outcome.
            (None, None) => Err(RuntimeError::internal(name, format!("{name} vanished"))),
        }
    })
}
