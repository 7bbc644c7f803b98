//! Per-step and evaluation metrics, as written to the JSON-lines metrics file.
//!
//! The keys are a contract (README): every step line has `step`, `loss` and
//! `samples_per_sec`; evaluation lines add `eval_loss` and `eval_accuracy`
//! (classification) or `eval_rmse` (regression).

use serde::Serialize;

/// One training step.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// 1-based step number.
    pub step: usize,
    /// Mean loss over the step's global batch.
    pub loss: f64,
    /// Global samples per second over this step.
    pub samples_per_sec: f64,
    /// Seconds worker 0 spent computing (forward, backward, update), waits excluded.
    pub compute_sec: f64,
    /// Seconds this worker spent waiting for communication (collectives and servers).
    pub comm_wait_sec: f64,
    /// Bytes this worker sent (0 on one device).
    pub bytes_sent: u64,
    /// Bytes this worker received (0 on one device).
    pub bytes_received: u64,
    /// Bytes each worker sent this step, by rank (distributed runs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bytes_sent_per_worker: Vec<u64>,
    /// Bytes each worker received this step, by rank (distributed runs).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub bytes_received_per_worker: Vec<u64>,
    /// Evaluation at this step, when one ran.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalMetrics>,
}

/// One evaluation over the held-out data.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct EvalMetrics {
    /// Mean loss.
    pub eval_loss: f64,
    /// Fraction of arg-max predictions equal to the label (classification).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_accuracy: Option<f64>,
    /// Root mean squared error (regression).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_rmse: Option<f64>,
    /// Samples evaluated.
    pub eval_samples: usize,
}
