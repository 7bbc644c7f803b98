//! The record of a layout search (`--strategy auto` without servers) that a plan
//! keeps: every candidate the planner tried, its verdict, and the pick. The planner
//! ([`crate::planner`]) makes it; the plan holds it and `explain` shows it, so it lives
//! with the plan format, which depends on no planner code.

use distc_passes::placement::{Precision, RematPolicy, Strategy, StrategyConfig};
use distc_runtime::run::memory;
use serde::{Deserialize, Serialize};

/// One layout the search tried.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Data replicas D, model axis T, pipeline stages P.
    pub data: usize,
    pub model: usize,
    pub pipe: usize,
    /// Micro-batches a step (1 without a pipeline).
    pub micro_batches: usize,
    /// Samples a micro-batch (the plan's batch).
    pub batch: usize,
    pub zero: u8,
    pub remat: bool,
    /// The arithmetic's precision.
    #[serde(default)]
    pub precision: Precision,
    /// Predicted seconds a step, samples per second, and bytes per worker; or why the
    /// candidate was rejected.
    pub verdict: Verdict,
}

/// What the search made of a candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Priced {
        step: f64,
        samples_per_sec: f64,
        memory_per_worker: u128,
    },
    /// Over the memory budget: what it needs.
    Memory { memory_per_worker: u128 },
    /// Refused by the compiler or the simulator, or not a whole batch.
    Refused { reason: String },
}

impl Candidate {
    /// `data=D,model=T,pipe=P` with its micro-batches, ZeRO and remat.
    pub fn label(&self) -> String {
        let mut s = format!("data={},model={},pipe={}", self.data, self.model, self.pipe);
        if self.pipe > 1 {
            s += &format!(" micro={}", self.micro_batches);
        }
        if self.zero > 0 {
            s += &format!(" zero={}", self.zero);
        }
        if self.remat {
            s += " remat=layers";
        }
        if self.precision != Precision::Fp32 {
            s += &format!(" {}", self.precision);
        }
        s
    }

    /// The settings that compile it, from the user's.
    pub fn settings(&self, base: &StrategyConfig) -> StrategyConfig {
        StrategyConfig {
            strategy: if self.data > 1 {
                Strategy::Allreduce
            } else {
                Strategy::Single
            },
            // One replica of a pipeline counts as one worker, as `--mesh` counts it.
            workers: if self.data == 1 && self.model == 1 {
                1
            } else {
                self.data * self.model * self.pipe
            },
            model: self.model,
            pipeline: self.pipe,
            micro_batches: self.micro_batches,
            zero: self.zero,
            precision: self.precision,
            remat: if self.remat {
                RematPolicy::Layers
            } else {
                base.remat
            },
            ..base.clone()
        }
    }
}

/// What the search found: every candidate, the pick, and what it cost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Search {
    pub workers: usize,
    /// The global batch every candidate trains a step.
    pub global_batch: usize,
    pub memory_budget: Option<u128>,
    pub candidates: Vec<Candidate>,
    /// Index of the pick in `candidates`.
    pub chosen: usize,
    /// Where the op times came from.
    pub profile: String,
    /// Seconds the search took, profiling included.
    pub seconds: f64,
}

/// Reasons alike but for their numbers as one: the words where they differ joined by
/// `|` in the order they came (`--zero 1|3 with --pipeline ...`).
fn merged_words(reasons: &[&str]) -> String {
    let split: Vec<Vec<&str>> = reasons.iter().map(|r| r.split(' ').collect()).collect();
    let n = split[0].len();
    if split.iter().any(|w| w.len() != n) {
        return reasons[0].to_string();
    }
    (0..n)
        .map(|i| {
            let mut seen: Vec<&str> = Vec::new();
            for w in &split {
                if !seen.contains(&w[i]) {
                    seen.push(w[i]);
                }
            }
            seen.join("|")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl Search {
    /// The pick, the priced candidates fastest first (at most `top`), and the rejected
    /// ones counted by reason.
    pub fn render(&self, top: usize) -> String {
        let ms = |s: f64| s * 1e3;
        let chosen = &self.candidates[self.chosen];
        let mut out = format!(
            "auto: {} workers, {} samples a step: chose {} ({} candidates, {:.2} s; op times: \
             {})\n",
            self.workers,
            self.global_batch,
            chosen.label(),
            self.candidates.len(),
            self.seconds,
            self.profile
        );
        let mut priced: Vec<(usize, f64, f64, u128)> = self
            .candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c.verdict {
                Verdict::Priced {
                    step,
                    samples_per_sec,
                    memory_per_worker,
                } => Some((i, step, samples_per_sec, memory_per_worker)),
                _ => None,
            })
            .collect();
        priced.sort_by(|a, b| b.2.total_cmp(&a.2));
        out += &format!(
            "  {:<40} {:>6} {:>12} {:>14} {:>12}\n",
            "layout", "batch", "step ms", "samples/s", "memory"
        );
        for (i, step, rate, mem) in priced.iter().take(top) {
            let c = &self.candidates[*i];
            out += &format!(
                "{} {:<40} {:>6} {:>12.3} {:>14.0} {:>12}\n",
                if *i == self.chosen { "*" } else { " " },
                c.label(),
                c.batch,
                ms(*step),
                rate,
                memory::gib(*mem)
            );
        }
        let over: Vec<&Candidate> = self
            .candidates
            .iter()
            .filter(|c| matches!(c.verdict, Verdict::Memory { .. }))
            .collect();
        if !over.is_empty() {
            out += &format!(
                "  rejected for memory (budget {}): {}\n",
                memory::gib(self.memory_budget.unwrap_or(0)),
                over.iter()
                    .map(|c| match c.verdict {
                        Verdict::Memory { memory_per_worker } => {
                            format!("{} ({})", c.label(), memory::gib(memory_per_worker))
                        }
                        _ => String::new(),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        // One line a kind of reason (reasons that differ only in their numbers), in the
        // order the kinds first came.
        let kind = |r: &str| -> String {
            r.chars()
                .map(|c| if c.is_ascii_digit() { '#' } else { c })
                .collect()
        };
        let mut refused: Vec<(String, Vec<&str>, Vec<String>)> = Vec::new();
        for c in &self.candidates {
            if let Verdict::Refused { reason } = &c.verdict {
                let first = reason.lines().next().unwrap_or("");
                let k = kind(first);
                match refused.iter_mut().find(|(r, _, _)| *r == k) {
                    Some((_, reasons, labels)) => {
                        reasons.push(first);
                        labels.push(c.label());
                    }
                    None => refused.push((k, vec![first], vec![c.label()])),
                }
            }
        }
        for (_, reasons, labels) in refused {
            let reason = merged_words(&reasons);
            out += &match labels.as_slice() {
                [one] => format!("  rejected {one}: {reason}\n"),
                [first, rest @ ..] => format!(
                    "  rejected {} layouts ({first} and {} more): {reason}\n",
                    labels.len(),
                    rest.len()
                ),
                [] => String::new(),
            };
        }
        out
    }
}
