//! The plan: the versioned JSON contract between compiler and runtime. It holds the
//! graph as text IR (what `--dump-ir` shows is what runs), the run configuration, what
//! each pass did, and a content hash so a damaged or edited plan is refused.
//!
//! The format names no other module of the compiler: the layout search's record is
//! here ([`Search`]), and [`Plan::new`], which makes a plan of a compile, is the
//! driver's ([`crate::driver`]).

mod search;

pub use search::{Candidate, Search, Verdict};

use distc_ir::pipeline::{PipelineProgram, StageGraphs};
use distc_ir::Graph;
use distc_passes::placement::{DistPlan, Strategy, StrategyConfig};
use distc_passes::program_set::ProgramSet;
use distc_runtime::RunConfig;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The `format` field of every plan.
pub const PLAN_FORMAT: &str = "distc-plan";
/// The plan version this distc writes and reads.
pub const PLAN_VERSION: u32 = 2;

/// One pass as recorded in the plan.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PassSummary {
    /// Pass name.
    pub name: String,
    /// Its counters, as text.
    pub stats: String,
    /// Nodes before and after.
    pub nodes: (usize, usize),
}

/// A compiled, runnable plan.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    /// Always [`PLAN_FORMAT`].
    pub format: String,
    /// Always [`PLAN_VERSION`] when written by this distc.
    pub version: u32,
    /// The model's name.
    pub model: String,
    /// The DSL file it came from.
    pub source: String,
    /// The strategy (`single` for one device).
    pub strategy: Strategy,
    /// How to run it.
    pub config: RunConfig,
    /// What the passes did.
    pub passes: Vec<PassSummary>,
    /// The strategy's settings (workers, servers, sync, buckets, cost constants).
    pub settings: StrategyConfig,
    /// Placement table, buckets and predicted traffic (distributed strategies).
    pub dist: Option<DistPlan>,
    /// The graph in text IR: the one-device program, or the SPMD worker program.
    pub graph: String,
    /// The workers' init program in text IR (broadcast from rank 0), if any.
    pub init: Option<String>,
    /// One program per parameter server, in text IR.
    pub servers: Vec<String>,
    /// The workers' final program in text IR (whole variables from ZeRO shards).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalize: Option<String>,
    /// Each pipeline stage's forward and backward program in text IR (`--pipeline`;
    /// micro-batches and schedule are in the settings).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<(String, String)>,
    /// Why the plan cannot be trained (a flag cut the pipeline short), if so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_runnable: Option<String>,
    /// The model's forward and backward FLOPs per sample, for model FLOPs utilisation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flops_per_sample: Option<f64>,
    /// The tokens a sample predicts (a language model's window), for tokens/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_sample: Option<usize>,
    /// The train block's settings overridden on the command line (`--set KEY=VALUE`),
    /// in order: the plan's config holds their values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<String>,
    /// The layout search that chose this plan (`--strategy auto` without servers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub search: Option<Search>,
    /// SHA-256 of the content above, hex.
    pub hash: String,
}

/// A plan that cannot be used.
#[derive(Debug, Error)]
pub enum PlanError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The target may not be written.
    #[error("{message}")]
    Refused {
        /// Why.
        message: String,
    },
    /// Not a plan, or damaged.
    #[error("{path}: not a valid distc plan: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

fn content_hash(p: &Plan) -> String {
    let mut h = Sha256::new();
    let config = serde_json::to_string(&p.config).unwrap_or_default();
    let settings = serde_json::to_string(&p.settings).unwrap_or_default();
    let dist = serde_json::to_string(&p.dist).unwrap_or_default();
    let init = p.init.clone().unwrap_or_default();
    let servers = p.servers.join("\n");
    let not_runnable = p.not_runnable.clone().unwrap_or_default();
    let finalize = p.finalize.clone().unwrap_or_default();
    for part in [
        p.model.as_str(),
        p.strategy.name(),
        config.as_str(),
        settings.as_str(),
        dist.as_str(),
        p.graph.as_str(),
        init.as_str(),
        servers.as_str(),
        not_runnable.as_str(),
        finalize.as_str(),
    ] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    for (forward, backward) in &p.stages {
        for part in [forward, backward] {
            h.update(part.as_bytes());
            h.update([0u8]);
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

impl Plan {
    /// Writes the plan (to a temporary file renamed into place), refusing a target
    /// that is not a regular file or is one of `inputs` (the model's source).
    pub fn save(&self, path: &Path, inputs: &[&Path]) -> Result<(), PlanError> {
        let refused = |e: distc_runtime::RuntimeError| PlanError::Refused {
            message: e.to_string(),
        };
        distc_runtime::core::output::check_output(path, inputs).map_err(refused)?;
        let text = serde_json::to_string_pretty(self).map_err(|e| PlanError::Invalid {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        distc_runtime::core::output::write_file(path, text.as_bytes()).map_err(refused)
    }

    /// Fails, saying why, if the plan cannot be trained.
    pub fn check_runnable(&self) -> Result<(), String> {
        match &self.not_runnable {
            Some(why) => Err(format!(
                "this plan cannot be trained: {why}; compile it again without that flag"
            )),
            None => Ok(()),
        }
    }

    /// Fields that contradict each other or name nothing distc knows.
    fn check_fields(&self) -> Result<(), String> {
        let s = &self.settings;
        if self.strategy != s.strategy {
            return Err(format!(
                "field `strategy`: `{}` differs from the settings' `{}`",
                self.strategy.name(),
                s.strategy.name()
            ));
        }
        if s.workers == 0 {
            return Err("field `settings.workers`: 0; a plan has at least one worker".into());
        }
        // `single` is one device, or one data replica split over a model axis (and a
        // mesh's pipeline stages).
        let replica = [
            s.model.max(1),
            s.model.max(1).saturating_mul(s.pipeline.max(1)),
        ];
        if self.strategy == Strategy::Single && (!replica.contains(&s.workers) || s.servers != 0) {
            return Err(format!(
                "fields `settings.workers`/`settings.servers`: {} workers and {} servers for \
                 the one-device strategy `single` (with a model axis of {})",
                s.workers,
                s.servers,
                s.model.max(1)
            ));
        }
        if self.servers.len() > s.servers {
            return Err(format!(
                "field `servers`: {} server programs for `settings.servers` = {}",
                self.servers.len(),
                s.servers
            ));
        }
        Ok(())
    }

    /// Reads a plan and its programs, parsed and verified once, refusing other formats,
    /// other versions, damaged content and programs that do not verify.
    pub fn load(path: &Path) -> Result<(Plan, ProgramSet), PlanError> {
        let text = distc_runtime::core::output::read_regular_text(
            path,
            distc_runtime::core::output::TEXT_INPUT_LIMIT,
        )
        .map_err(|source| PlanError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |message: String| PlanError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| invalid(format!("not JSON ({e})")))?;
        match value.get("format").and_then(|f| f.as_str()) {
            Some(PLAN_FORMAT) => {}
            _ => return Err(invalid(format!("no \"format\": \"{PLAN_FORMAT}\" field"))),
        }
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(PLAN_VERSION) => {}
            Some(v) => {
                return Err(invalid(format!(
                    "plan format version {v}; this distc reads version {PLAN_VERSION}: recompile the model"
                )))
            }
            None => return Err(invalid("no version field".into())),
        }
        let plan: Plan = serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
        if content_hash(&plan) != plan.hash {
            return Err(invalid("its content does not match its hash: the file is damaged or was edited; recompile it".into()));
        }
        // The settings first, range-checked: the fields' checks and what is built from
        // the programs are sized by them (a schedule of `micro_batches` steps).
        plan.settings.check().map_err(|e| {
            invalid(format!(
                "settings: {e} (the plan is intact but not sound: recompile it)"
            ))
        })?;
        plan.check_fields().map_err(&invalid)?;
        let parse = |what: &str, text: &str| -> Result<Graph, PlanError> {
            let g = distc_ir::parse(text).map_err(|e| invalid(format!("{what}: {e}")))?;
            distc_ir::verify(&g).map_err(|e| invalid(format!("{what} does not verify:\n{e}")))?;
            Ok(g)
        };
        let mut programs = ProgramSet::new(parse("graph", &plan.graph)?);
        programs.init = plan
            .init
            .as_deref()
            .map(|t| parse("init program", t))
            .transpose()?;
        programs.servers = plan
            .servers
            .iter()
            .enumerate()
            .map(|(i, t)| parse(&format!("server program {i}"), t))
            .collect::<Result<_, _>>()?;
        programs.finalize = plan
            .finalize
            .as_deref()
            .map(|t| parse("final program", t))
            .transpose()?;
        if !plan.stages.is_empty() {
            let stages = plan
                .stages
                .iter()
                .enumerate()
                .map(|(i, (f, b))| {
                    Ok(StageGraphs {
                        forward: parse(&format!("stage {i} forward program"), f)?,
                        backward: parse(&format!("stage {i} backward program"), b)?,
                    })
                })
                .collect::<Result<Vec<_>, PlanError>>()?;
            if stages.len() != plan.settings.pipeline {
                return Err(invalid(format!(
                    "it holds {} stage programs for --pipeline {}",
                    stages.len(),
                    plan.settings.pipeline
                )));
            }
            let program = PipelineProgram {
                stages,
                micro_batches: plan.settings.micro_batches,
                schedule: plan.settings.schedule,
            };
            let steps = program.programs().map_err(|e| invalid(e.to_string()))?;
            distc_ir::pipeline::schedule::check(&steps)
                .map_err(|e| invalid(format!("its pipeline schedule: {e}")))?;
            programs.pipeline = Some(program);
        } else if plan.settings.pipeline > 1 && plan.not_runnable.is_none() {
            return Err(invalid(format!(
                "--pipeline {} without stage programs",
                plan.settings.pipeline
            )));
        }
        let unsound = |e: String| {
            invalid(format!(
                "{e} (the plan is intact but not sound: recompile it)"
            ))
        };
        plan.config
            .check()
            .map_err(|e| unsound(format!("config: {e}")))?;
        // A plan cut short (`--stop-after`, a disabled pass) holds programs half-way
        // through the pipeline: readable, and refused by `run` for what it is.
        if plan.not_runnable.is_none() {
            programs
                .check_consistency(&plan.settings, plan.dist.as_ref())
                .map_err(unsound)?;
            distc_runtime::run::data::check_model(
                &programs.worker,
                &plan.config.data,
                plan.config.batch,
                &plan.config.data.id_bounds(),
            )
            .map_err(|e| unsound(e.to_string()))?;
        }
        Ok((plan, programs))
    }

    /// Recomputes the hash after an edit of the fields above (for tools and tests
    /// that make plans by hand; [`Plan::load`] still checks what the plan says).
    pub fn seal(&mut self) {
        self.hash = content_hash(self);
    }
}
