//! The coordinator: joins the roles' step reports into one metrics line per step and,
//! at the end, the run's [`TrainReport`], for threads and MPI ranks alike. A metrics
//! line is made in one place, [`metrics_line`], from one report (a rank's own line) or
//! from every worker's (the run's line).

use crate::core::error::{Result, RuntimeError};
use crate::core::peak::total_peak;
use crate::core::value::Tensor;
use crate::run::memory::MemoryByCategory;
use crate::run::metrics::TrainReport;
use crate::run::metrics::{EvalMetrics, Profile, StepMetrics};
use crate::run::metrics::{PipelineStep, StageAccount, StageStep, StepReport};
use crate::run::pipeline::PipelineRun;
use crate::run::trace::Span;
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Duration;

/// The metrics line of one step from its reports, sorted by rank: the mean loss, the
/// throughput of `samples` over the slowest report's time, report 0's times, bytes,
/// memory and evaluation, and, when `per_worker`, every report's bytes. With the
/// model's FLOPs per sample, the model's FLOPs per second, and their share of the
/// peak of the distinct devices the reports ran on; with the tokens a sample predicts
/// (a language model), the tokens per second.
pub fn metrics_line(
    reports: &[StepReport],
    samples: usize,
    per_worker: bool,
    (flops_per_sample, tokens_per_sample): (Option<f64>, Option<usize>),
) -> StepMetrics {
    let n = reports.len().max(1) as f64;
    let loss = reports.iter().map(|r| r.loss).sum::<f64>() / n;
    let slowest = reports.iter().map(|r| r.step_sec).fold(0.0, f64::max);
    let list = |f: fn(&StepReport) -> u64| {
        if per_worker {
            reports.iter().map(f).collect()
        } else {
            Vec::new()
        }
    };
    let Some(r0) = reports.first() else {
        return StepMetrics::default();
    };
    let samples_per_sec = samples as f64 / slowest.max(1e-9);
    let model_flops_per_sec = flops_per_sample.map(|f| f * samples_per_sec);
    let peak = total_peak(reports.iter().flat_map(|r| &r.peaks));
    StepMetrics {
        step: r0.step,
        loss,
        samples_per_sec,
        tokens_per_sec: tokens_per_sample.map(|t| t as f64 * samples_per_sec),
        model_flops_per_sec,
        mfu: model_flops_per_sec.zip(peak).map(|(f, (p, _))| f / p),
        compute_sec: (r0.step_sec - r0.comm_wait_sec).max(0.0),
        comm_wait_sec: r0.comm_wait_sec,
        bytes_sent_per_worker: list(|r| r.bytes_sent),
        bytes_received_per_worker: list(|r| r.bytes_received),
        bytes_sent: r0.bytes_sent,
        bytes_received: r0.bytes_received,
        bytes_moved: r0.bytes_moved,
        eval: r0.eval.clone(),
        eval_error: reports.iter().find_map(|r| r.eval_failed.clone()),
        memory: r0.memory,
        gpu_memory: r0.device_memory.map(|m| m.0),
        gpu_memory_peak: r0.device_memory.map(|m| m.1),
        pipeline: r0.pipeline.clone(),
        loss_scale: r0.loss_scale.map(|s| s.0),
        skipped_steps: r0.loss_scale.map(|s| s.1),
        grad_norm: r0.grad_norm,
        lr: r0.lr,
        cuda_graph: r0.cuda_graph,
        restart: None,
    }
}

/// Joins the workers' step reports into one metrics line per step: loss (mean over
/// workers), global samples per second (over the slowest worker's step time), worker
/// 0's times and bytes, every worker's bytes, and worker 0's evaluation.
pub struct Coordinator<'a> {
    workers: usize,
    batch: usize,
    /// Whether lines carry per-worker byte lists (plans that communicate).
    per_worker: bool,
    pending: HashMap<usize, Vec<StepReport>>,
    on_step: &'a mut dyn FnMut(&StepMetrics) -> Result<()>,
    /// Steps completed.
    pub steps: usize,
    /// Mean loss of the first step.
    pub first_loss: f64,
    /// Mean loss of the last step.
    pub final_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalMetrics>,
    /// Why the evaluation after the last step failed, when it did.
    pub eval_failed: Option<String>,
    /// Sum over steps of the slowest worker's step time.
    pub train_time: Duration,
    /// Sum and count of the pipelined steps' measured bubbles.
    bubbles: (f64, usize),
    /// Workers of a model axis, who train on the same samples (1: none).
    pub model_axis: usize,
    /// The model's FLOPs per sample (forward and backward), where the plan says.
    pub flops_per_sample: Option<f64>,
    /// The tokens a sample predicts, for a token model's tokens per second.
    pub tokens_per_sample: Option<usize>,
    /// The device worker 0 computed on, in words.
    device: String,
    /// The summed peak of the devices of the last step and where it comes from.
    peak: Option<(f64, String)>,
}

impl<'a> Coordinator<'a> {
    /// A coordinator of `workers` workers of `batch` samples each.
    pub fn new(
        workers: usize,
        batch: usize,
        per_worker: bool,
        on_step: &'a mut dyn FnMut(&StepMetrics) -> Result<()>,
    ) -> Coordinator<'a> {
        Coordinator {
            workers,
            batch,
            per_worker,
            pending: HashMap::new(),
            on_step,
            steps: 0,
            first_loss: f64::NAN,
            final_loss: f64::NAN,
            eval: None,
            eval_failed: None,
            train_time: Duration::ZERO,
            bubbles: (0.0, 0),
            model_axis: 1,
            flops_per_sample: None,
            tokens_per_sample: None,
            device: String::new(),
            peak: None,
        }
    }

    /// Takes one worker's report; writes the step's line once every worker's is in.
    pub fn add(&mut self, r: StepReport) -> Result<()> {
        let step = r.step;
        let reports = self.pending.entry(step).or_default();
        reports.push(r);
        if reports.len() < self.workers {
            return Ok(());
        }
        let mut reports = self.pending.remove(&step).unwrap_or_default();
        reports.sort_by_key(|r| r.rank);
        if let Some(r) = reports.first().filter(|_| self.device.is_empty()) {
            self.device.clone_from(&r.device);
        }
        let samples = self.workers / self.model_axis.max(1) * self.batch;
        let per_sample = (self.flops_per_sample, self.tokens_per_sample);
        let line = metrics_line(&reports, samples, self.per_worker, per_sample);
        if let Some(p) = total_peak(reports.iter().flat_map(|r| &r.peaks)) {
            self.peak = Some(p);
        }
        // The first step this run ran (a resumed run starts after the state's step).
        if self.steps == 0 {
            self.first_loss = line.loss;
        }
        self.final_loss = line.loss;
        self.steps += 1;
        let slowest = reports.iter().map(|r| r.step_sec).fold(0.0, f64::max);
        self.train_time += Duration::from_secs_f64(slowest);
        if let Some(bubble) = line.pipeline.as_ref().and_then(|p| p.bubble) {
            self.bubbles.0 += bubble;
            self.bubbles.1 += 1;
        }
        if line.eval.is_some() {
            self.eval.clone_from(&line.eval);
        }
        if line.eval_error.is_some() {
            self.eval_failed.clone_from(&line.eval_error);
        }
        (self.on_step)(&line)
    }
}

impl Coordinator<'_> {
    /// The run's report once every step is in: the losses, evaluation and time the
    /// coordinator saw, the variables, worker 0's profile and every role's spans. The
    /// one place a [`TrainReport`] is made, for threads and MPI ranks alike.
    pub fn finish(
        self,
        params: HashMap<String, Tensor>,
        profile: Option<Profile>,
        spans: Vec<Span>,
    ) -> TrainReport {
        let samples = (self.steps * self.workers / self.model_axis.max(1) * self.batch) as f64;
        let seconds = self.train_time.as_secs_f64().max(1e-9);
        let model_flops_per_sec = self.flops_per_sample.map(|f| f * samples / seconds);
        TrainReport {
            model_flops_per_sec,
            mfu: model_flops_per_sec
                .zip(self.peak)
                .map(|(f, (p, source))| (f / p, p, source)),
            steps: self.steps,
            first_loss: self.first_loss,
            final_loss: self.final_loss,
            eval: self.eval,
            eval_failed: self.eval_failed,
            train_time: self.train_time,
            samples_per_sec: samples / seconds,
            device: self.device,
            tokens_per_sec: self.tokens_per_sample.map(|t| t as f64 * samples / seconds),
            params,
            profile,
            spans,
            pipeline_bubble: (self.bubbles.1 > 0).then(|| self.bubbles.0 / self.bubbles.1 as f64),
        }
    }
}

impl<'a> Coordinator<'a> {
    /// The coordinator of a pipelined run's metrics lines: one per step, from every
    /// stage's reports joined by [`StageReports`].
    pub(crate) fn of_pipeline(
        run: &PipelineRun<'_>,
        on_step: &'a mut dyn FnMut(&StepMetrics) -> Result<()>,
    ) -> Coordinator<'a> {
        let mut c = Coordinator::new(1, run.samples_per_step(), false, on_step);
        c.flops_per_sample = run.flops_per_sample;
        c.tokens_per_sample = run.tokens_per_sample;
        c
    }
}

/// Steps' reports from every stage, joined into one line per step once all are in.
#[derive(Default)]
pub(crate) struct StageReports {
    pending: HashMap<usize, Vec<StepReport>>,
}

impl StageReports {
    /// Takes one stage's report; hands the coordinator the step's line when it is the
    /// step's last (of `workers`).
    pub(crate) fn add(
        &mut self,
        r: StepReport,
        workers: usize,
        coordinator: &mut Coordinator<'_>,
    ) -> Result<()> {
        let step = r.step;
        let reports = self.pending.entry(step).or_default();
        reports.push(r);
        if reports.len() < workers {
            return Ok(());
        }
        let reports = self.pending.remove(&step).unwrap_or_default();
        coordinator.add(combine(step, &reports))
    }
}

/// Worker `worker`'s end of the channel to the coordinator, on threads and on MPI's
/// rank 0 alike: once the coordinator takes no more reports (the caller stopped the
/// run, or another role failed), the role's next report fails and the role stops. The
/// coordinator hung up: the error is a consequence, and gives way to the cause.
pub(crate) fn reporter<R: Send>(
    tx: mpsc::Sender<R>,
    worker: usize,
) -> impl FnMut(R) -> Result<()> + Send {
    move |r| {
        tx.send(r).map_err(|_| RuntimeError::Peer {
            rank: worker,
            peer: 0,
            op: "step report".into(),
            kind: crate::core::error::PeerKind::HungUp,
            message: "the coordinator took no more step reports: the run was stopped".into(),
        })
    }
}

/// One metrics line of a step from every stage's report: the loss stages' mean loss, the
/// slowest stage's time, bytes and memory summed over the stages, and worker 0's
/// evaluation.
pub(crate) fn combine(step: usize, reports: &[StepReport]) -> StepReport {
    let account = |r: &StepReport| r.stage.clone().unwrap_or_default();
    // One replica's stages (the first present: a rank's own line has its replica alone).
    let shown = reports
        .iter()
        .map(|r| account(r).replica)
        .min()
        .unwrap_or(0);
    let lane = reports
        .iter()
        .map(account)
        .filter(|a| a.replica == shown)
        .map(|a| a.model_rank)
        .min()
        .unwrap_or(0);
    let mut first: Vec<(StageAccount, &StepReport)> = reports
        .iter()
        .map(|r| (account(r), r))
        .filter(|(a, _)| a.replica == shown && a.model_rank == lane)
        .collect();
    first.sort_by_key(|(a, _)| a.stage);
    let stages: Vec<StageStep> = first
        .iter()
        .map(|(a, r)| StageStep {
            busy_sec: a.busy_sec,
            step_sec: r.step_sec,
            activations: r.memory.activations,
            held: r.memory.total(),
            bytes_sent: r.bytes_sent,
            bytes_received: r.bytes_received,
            messages_on_device: a.messages_on_device,
            host_collectives: a.host_collectives,
            cuda_graph: r.cuda_graph,
        })
        .collect();
    let longest = stages.iter().map(|s| s.step_sec).fold(0.0, f64::max);
    let busy: f64 = stages.iter().map(|s| s.busy_sec).sum();
    // A replayed stage's busy time is its whole replay, waits included: no bubble.
    let bubble = if stages.iter().any(|s| s.cuda_graph) {
        None
    } else if longest > 0.0 {
        Some((1.0 - busy / (stages.len() as f64 * longest)).max(0.0))
    } else {
        Some(0.0)
    };
    let losses: Vec<f64> = reports
        .iter()
        .filter(|r| account(r).holds_loss)
        .map(|r| r.loss)
        .collect();
    let loss = if losses.is_empty() {
        f64::NAN
    } else {
        losses.iter().sum::<f64>() / losses.len() as f64
    };
    let slowest = reports
        .iter()
        .max_by(|a, b| a.step_sec.total_cmp(&b.step_sec));
    let sum = |f: fn(&StepReport) -> u64| reports.iter().map(f).sum::<u64>();
    let memory = MemoryByCategory {
        params: sum(|r| r.memory.params),
        gradients: sum(|r| r.memory.gradients),
        optimizer: sum(|r| r.memory.optimizer),
        activations: sum(|r| r.memory.activations),
        comm_buffers: sum(|r| r.memory.comm_buffers),
    };
    StepReport {
        rank: 0,
        step,
        device: first
            .first()
            .map(|(_, r)| r.device.clone())
            .unwrap_or_default(),
        loss,
        step_sec: slowest.map_or(0.0, |r| r.step_sec),
        comm_wait_sec: slowest.map_or(0.0, |r| r.comm_wait_sec),
        bytes_sent: sum(|r| r.bytes_sent),
        bytes_received: sum(|r| r.bytes_received),
        bytes_moved: sum(|r| r.bytes_sent),
        memory,
        pipeline: Some(PipelineStep { bubble, stages }),
        cuda_graph: !reports.is_empty() && reports.iter().all(|r| r.cuda_graph),
        lr: first.first().and_then(|(_, r)| r.lr),
        grad_norm: first.first().and_then(|(_, r)| r.grad_norm),
        peaks: reports.iter().flat_map(|r| r.peaks.clone()).collect(),
        eval: reports.iter().find_map(|r| r.eval.clone()),
        eval_failed: reports.iter().find_map(|r| r.eval_failed.clone()),
        ..StepReport::default()
    }
}
