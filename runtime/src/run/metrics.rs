//! Per-step and evaluation metrics, as written to the JSON-lines metrics file.
//!
//! The keys are a contract (README): every step line has `step`, `loss` and
//! `samples_per_sec`; evaluation lines add `eval_loss` and `eval_accuracy`
//! (classification) or `eval_rmse` (regression).

use crate::core::value::Tensor;
use crate::run::memory::MemoryByCategory;
use crate::run::trace::Span;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One training step.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StepMetrics {
    /// 1-based step number.
    pub step: usize,
    /// Mean loss over the step's global batch.
    pub loss: f64,
    /// Global samples per second over this step.
    pub samples_per_sec: f64,
    /// Global tokens per second over this step, for a model whose loss is per position
    /// (a language model): samples per second times the positions a sample predicts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_sec: Option<f64>,
    /// The model's FLOPs per second over this step: its forward and backward FLOPs per
    /// sample (the cost model's count of the one-device program: no recompute, no
    /// optimizer) times the samples per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model_flops_per_sec: Option<f64>,
    /// Model FLOPs utilisation: `model_flops_per_sec` over the summed peak of the
    /// distinct devices the step ran on (a GPU's datasheet figure for the plan's
    /// products, the CPU's measured matrix-product rate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// Seconds worker 0 spent computing (forward, backward, update), waits excluded.
    pub compute_sec: f64,
    /// Seconds this worker spent waiting for communication (collectives and servers).
    pub comm_wait_sec: f64,
    /// Bytes this worker sent (0 on one device).
    pub bytes_sent: u64,
    /// Bytes this worker received (0 on one device).
    pub bytes_received: u64,
    /// Bytes as WORKLOADS.md and the plan's prediction count them: collective bytes
    /// sent, plus parameter-server bytes pushed and pulled (0 on one device).
    pub bytes_moved: u64,
    /// Bytes each worker sent this step, by rank (distributed runs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bytes_sent_per_worker: Vec<u64>,
    /// Bytes each worker received this step, by rank (distributed runs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bytes_received_per_worker: Vec<u64>,
    /// Evaluation at this step, when one ran.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalMetrics>,
    /// Why the evaluation after the last step failed (the run then fails, after
    /// writing its weights).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_error: Option<String>,
    /// What worker 0 held in this step, by category (bytes): `params`, `gradients`,
    /// `optimizer`, `activations` (peak), `comm_buffers` (peak).
    pub memory: crate::run::memory::MemoryByCategory,
    /// GPU memory distc's allocations hold on worker 0 after the step, bytes (GPU
    /// runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<u64>,
    /// The most GPU memory held at once so far, bytes (GPU runs only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory_peak: Option<u64>,
    /// Per stage of a pipelined run (replica 0's stages), and its measured bubble.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineStep>,
    /// fp16's loss scale after the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// The global gradient norm before clipping (`torch.nn.utils.clip_grad_norm_`'s
    /// return value), where the train block sets `clip_norm`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f64>,
    /// Steps skipped so far because their gradients overflowed (fp16).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<usize>,
    /// The learning rate worker 0's update used this step (warm-up, decay and the
    /// linear scaling rule applied).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Whether worker 0's step was a replay of its captured CUDA graph (GPU runs, after
    /// the warm-up steps, where the step has no host round trip).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cuda_graph: bool,
    /// On the first step after an elastic restart: what was lost and what it cost.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub restart: Option<Restart>,
}

/// An elastic run's restart after a lost worker (`--elastic`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Restart {
    /// The step the worker was lost at.
    pub lost_at_step: usize,
    /// The step the run resumed from (the last state kept; 0: the start).
    pub resumed_from_step: usize,
    /// The error that lost it.
    pub cause: String,
    /// Workers before the restart.
    pub workers_before: usize,
    /// Workers after it.
    pub workers_after: usize,
    /// Shards read from disk for what only the lost worker held (its ZeRO chunks); 0:
    /// the survivors' memory held the whole state.
    #[serde(default)]
    pub shards_read: usize,
    /// Seconds from the loss to the restarted run's first step (the plan compiled
    /// again, the workers started, the state moved in).
    pub recovery_sec: f64,
    /// Seconds of training the loss undid: from the state it resumed from to the
    /// loss.
    pub lost_sec: f64,
}

/// A pipelined step, measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct PipelineStep {
    /// 1 - (time the stages computed) / (stages x the slowest stage's step time): the
    /// share of stage time spent waiting. `None` for a step a stage replayed from a
    /// CUDA graph: its waits inside the graph are not told apart from its compute.
    #[serde(default)]
    pub bubble: Option<f64>,
    /// Stage 0 first.
    pub stages: Vec<StageStep>,
}

/// One role's account of one step: a worker's, a pipeline stage's (with its
/// [`StageAccount`]), or a step's stages joined into one (with its `pipeline`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepReport {
    /// The worker.
    pub rank: usize,
    /// The device it computed on, in words ([`crate::core::backend::Device::describe`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub device: String,
    /// 1-based step.
    pub step: usize,
    /// The loss of its batch.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Seconds of the step (forward, backward, update, waits; data excluded).
    pub step_sec: f64,
    /// Seconds of it spent waiting for collectives and servers.
    pub comm_wait_sec: f64,
    /// Bytes sent (collectives, pushes, pulled ids).
    pub bytes_sent: u64,
    /// Bytes received (collectives, pulled values).
    pub bytes_received: u64,
    /// Collective bytes sent plus server bytes pushed and pulled.
    pub bytes_moved: u64,
    /// The evaluation run after this step, if one ran (worker 0).
    pub eval: Option<EvalMetrics>,
    /// Why the evaluation after the last step failed: kept, not raised, so that the
    /// trained weights are written first ([`crate::run::eval::settle`]).
    #[serde(default)]
    pub eval_failed: Option<String>,
    /// What the worker held, by category (peaks of this step).
    pub memory: MemoryByCategory,
    /// Device memory in use after the step and its peak so far, bytes (GPU workers).
    pub device_memory: Option<(u64, u64)>,
    /// Per stage, of a pipelined run.
    #[serde(default)]
    pub pipeline: Option<PipelineStep>,
    /// fp16's loss scale after the step, and the steps skipped so far for overflow.
    #[serde(default)]
    pub loss_scale: Option<(f64, usize)>,
    /// The global gradient norm before clipping (with `clip_norm`).
    #[serde(default)]
    pub grad_norm: Option<f64>,
    /// The learning rate of this step's update.
    #[serde(default)]
    pub lr: Option<f64>,
    /// Whether the step was a replay of the worker's captured CUDA graph.
    #[serde(default)]
    pub cuda_graph: bool,
    /// The devices the report's work ran on and their peaks (one for a worker, one per
    /// stage for a pipeline's replica), where the backends know them.
    #[serde(default)]
    pub peaks: Vec<crate::core::peak::DevicePeak>,
    /// A pipeline stage's own account, in the report it sends.
    #[serde(default)]
    pub stage: Option<StageAccount>,
}

/// A loss read back: JSON has no NaN (serde_json writes one as `null`), and a stage
/// without the loss reports NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// What a pipeline stage's report says of the stage beside a worker's account.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StageAccount {
    /// Its place on the mesh.
    pub stage: usize,
    pub replica: usize,
    /// Its rank on the model axis (0 without one).
    pub model_rank: usize,
    /// Seconds its forwards and backwards ran.
    pub busy_sec: f64,
    /// Whether its forward program holds the loss (the report's loss is its mean over
    /// the step's micro-batches; the other stages' is NaN).
    pub holds_loss: bool,
    /// Whether its messages to other stages went device to device.
    pub messages_on_device: bool,
    /// Its programs' collectives that run through the host.
    pub host_collectives: usize,
}

/// One stage's step.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct StageStep {
    /// Seconds its forwards and backwards ran.
    pub busy_sec: f64,
    /// Seconds of its step (update included).
    pub step_sec: f64,
    /// Peak bytes of computed values, the stash of micro-batches in flight included.
    pub activations: u64,
    /// Bytes the stage's worker holds: its variables, gradients, optimizer state, peak
    /// activations and buffers (what `memory` sums over the stages).
    #[serde(default)]
    pub held: u64,
    /// Bytes it sent to other stages and replicas.
    pub bytes_sent: u64,
    /// Bytes it received.
    pub bytes_received: u64,
    /// Whether its messages to other stages went device to device (NCCL's send and
    /// receive), not through the host.
    #[serde(default)]
    pub messages_on_device: bool,
    /// How many of its programs' collectives (a model axis's, a replica's) run through
    /// the host, not on the device's own communicator (NCCL): all of them on the CPU.
    #[serde(default)]
    pub host_collectives: usize,
    /// Whether its step was a replay of its captured CUDA graph (a stage with a host
    /// round trip, such as a tied variable's exchange, steps eagerly beside stages
    /// that replay).
    #[serde(default)]
    pub cuda_graph: bool,
}

/// One evaluation over the held-out data.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct EvalMetrics {
    /// Mean loss.
    pub eval_loss: f64,
    /// Fraction of arg-max predictions equal to the label (classification).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Root mean squared error (regression).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_rmse: Option<f64>,
    /// The fraction of labels among the `eval_top_k` largest logits (`top_k(k)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_top_k_accuracy: Option<f64>,
    /// The `k` of `eval_top_k_accuracy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_top_k: Option<usize>,
    /// `exp(eval_loss)` of a cross-entropy model (`perplexity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_perplexity: Option<f64>,
    /// Samples evaluated.
    pub eval_samples: usize,
    /// The device the model was evaluated on (`cpu`, `cuda:0`): a worker's own, a
    /// pipeline's worker 0's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_device: Option<String>,
    /// Seconds of the evaluation, the other workers' wait for it included; no
    /// step's time includes them.
    #[serde(default)]
    pub eval_sec: f64,
}

impl EvalMetrics {
    /// One line for people: `eval_loss 0.1234, eval_accuracy 0.9700 (10000 samples)`.
    pub fn describe(&self) -> String {
        let mut line = format!("eval_loss {:.4}", self.eval_loss);
        if let Some(a) = self.eval_accuracy {
            line += &format!(", eval_accuracy {a:.4}");
        }
        if let (Some(a), Some(k)) = (self.eval_top_k_accuracy, self.eval_top_k) {
            line += &format!(", eval_top{k}_accuracy {a:.4}");
        }
        if let Some(p) = self.eval_perplexity {
            line += &format!(", eval_perplexity {p:.2}");
        }
        if let Some(r) = self.eval_rmse {
            line += &format!(", eval_rmse {r:.4}");
        }
        format!("{line} ({} samples)", self.eval_samples)
    }
}

/// Where one worker's step time went, summed over the profiled steps.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// Steps profiled.
    pub steps: usize,
    /// The run's first steps, left out of the profile (one-time setup).
    pub warmup: usize,
    /// Wall time of those steps (forward, backward, update, waits).
    pub step_time: Duration,
    /// Kernel time by op mnemonic: `(op, total, calls)`, most expensive first.
    pub ops: Vec<(&'static str, Duration, u64)>,
    /// Time in the optimizer's updates of the worker's own variables.
    pub optimizer: Duration,
    /// Time blocked on collectives and parameter servers.
    pub comm_wait: Duration,
}

impl Profile {
    /// A table: per op, milliseconds per step, share of the step, calls per step; then
    /// the optimizer, communication waits and what is left (the executor's own work:
    /// scheduling, freeing, feeding).
    pub fn render(&self) -> String {
        let steps = self.steps.max(1) as f64;
        let total = self.step_time.as_secs_f64().max(1e-12);
        let w = self
            .ops
            .iter()
            .map(|o| o.0.len())
            .max()
            .unwrap_or(0)
            .max(12);
        let mut out = if self.warmup > 0 {
            format!(
                "profile of {} steps (the first {} left out: one-time setup)\n",
                self.steps, self.warmup
            )
        } else {
            format!("profile of {} steps\n", self.steps)
        };
        out += &format!(
            "{:<w$} {:>10} {:>7} {:>10}\n",
            "op", "ms/step", "share", "calls/step"
        );
        let mut line = |name: &str, d: Duration, calls: Option<u64>| {
            out += &format!(
                "{:<w$} {:>10.3} {:>6.1}% {:>10}\n",
                name,
                d.as_secs_f64() * 1e3 / steps,
                100.0 * d.as_secs_f64() / total,
                calls.map_or(String::new(), |c| format!("{:.0}", c as f64 / steps)),
            );
        };
        let mut accounted = Duration::ZERO;
        for (op, d, calls) in &self.ops {
            line(op, *d, Some(*calls));
            accounted += *d;
        }
        line("(optimizer)", self.optimizer, None);
        line("(comm wait)", self.comm_wait, None);
        accounted += self.optimizer + self.comm_wait;
        line("(executor)", self.step_time.saturating_sub(accounted), None);
        line("step", self.step_time, None);
        out
    }
}

/// `path` with `.rankR` before its extension: `m.jsonl` -> `m.rank1.jsonl`.
pub fn rank_path(path: &Path, rank: usize) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// What training produced.
#[derive(Debug)]
pub struct TrainReport {
    /// Steps run.
    pub steps: usize,
    /// Loss of the first step (mean over workers).
    pub first_loss: f64,
    /// Loss of the last step (mean over workers).
    pub final_loss: f64,
    /// The last evaluation.
    pub eval: Option<EvalMetrics>,
    /// Why the evaluation after the last step failed, when it did.
    pub eval_failed: Option<String>,
    /// Wall time of the training steps (the slowest worker's, summed; evaluation and
    /// data loading excluded).
    pub train_time: Duration,
    /// Global samples per second over all steps.
    pub samples_per_sec: f64,
    /// Global tokens per second over all steps (token models).
    pub tokens_per_sec: Option<f64>,
    /// The device worker 0 computed on, in words (empty: no step ran).
    pub device: String,
    /// Every variable after training: replicated ones from worker 0, server-held ones
    /// reassembled from their shards.
    pub params: HashMap<String, Tensor>,
    /// Where worker 0's step time went, when asked for.
    pub profile: Option<Profile>,
    /// Trace spans, when asked for.
    pub spans: Vec<Span>,
    /// The mean measured bubble of a pipelined run's steps.
    pub pipeline_bubble: Option<f64>,
    /// The model's FLOPs per second over all steps, where the plan counted them.
    pub model_flops_per_sec: Option<f64>,
    /// Model FLOPs utilisation over all steps, the devices' summed peak it is against
    /// (FLOP/s) and where that figure comes from.
    pub mfu: Option<(f64, f64, String)>,
}

#[cfg(test)]
mod tests {
    use super::{StageAccount, StepReport};

    #[test]
    fn a_stage_report_without_the_loss_crosses_json_as_nan_with_its_account() {
        let sent = StepReport {
            rank: 3,
            step: 7,
            loss: f64::NAN,
            stage: Some(StageAccount {
                stage: 1,
                replica: 1,
                busy_sec: 0.25,
                ..StageAccount::default()
            }),
            eval_failed: Some("the held-out file went".into()),
            ..StepReport::default()
        };
        let text = serde_json::to_string(&sent).expect("a report serialises");
        let got: StepReport = serde_json::from_str(&text).expect("a report reads back");
        assert!(got.loss.is_nan(), "{text}");
        let account = got.stage.expect("the stage's account came back");
        assert_eq!(
            (got.rank, got.step, account.stage, account.replica),
            (3, 7, 1, 1)
        );
        assert!(!account.holds_loss);
        assert_eq!(got.eval_failed.as_deref(), Some("the held-out file went"));
        let with_loss = StepReport {
            loss: 2.5,
            ..StepReport::default()
        };
        let back: StepReport =
            serde_json::from_str(&serde_json::to_string(&with_loss).expect("serialises"))
                .expect("reads back");
        assert_eq!(back.loss, 2.5);
    }
}
