//! Graph transformations of distc: each pass is a function from graph to graph in its
//! own file, run by the [`manager`] with the verifier after every step.
#![deny(missing_docs)]

pub mod accumulate;
pub mod autodiff;
pub mod cost;
pub mod dead_code;
pub mod distribute;
pub mod fusion;
pub mod grad_wire;
pub mod hierarchy;
pub mod kernel_fusion;
pub mod manager;
pub mod mixed_precision;
pub mod pipeline;
pub mod place;
pub mod placement;
pub mod precision;
pub mod program_set;
pub mod remat;
pub mod schedule;
pub mod simplify;
pub mod sparsity;
pub mod tensor_parallel;
pub mod zero;

use distc_ir::Graph;
use thiserror::Error;

pub use manager::{run_pipeline, PassRecord, PipelineError};
pub use program_set::{ProgramRole, ProgramSet, ProgramSetError};

/// Options the passes read and the analyses they share.
#[derive(Clone, Debug, Default)]
pub struct PassCx {
    /// Names of passes to skip (`--disable-pass`).
    pub disabled: Vec<String>,
    /// The strategy flags.
    pub strategy: placement::StrategyConfig,
    /// Per id input: mean distinct ids per worker batch, and over how many batches,
    /// measured by the compiler on the configured data source.
    pub measured_ids: std::collections::HashMap<String, (f64, usize)>,
    /// The distribution decision, filled by the analysis and placement passes.
    pub dist: Option<placement::DistPlan>,
}

/// Plain counters a pass reports, plus an optional note for the user.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassStats {
    /// `(what, how many)`, in the order the pass reports them.
    pub counters: Vec<(&'static str, usize)>,
    /// Anything else worth telling (e.g. a stop reason).
    pub note: Option<String>,
}

impl PassStats {
    /// Sets the note.
    pub fn with_note(mut self, note: impl Into<String>) -> PassStats {
        self.note = Some(note.into());
        self
    }
    /// Adds a counter.
    pub fn count(mut self, what: &'static str, n: usize) -> PassStats {
        self.counters.push((what, n));
        self
    }
    /// The value of a counter, 0 if absent.
    pub fn get(&self, what: &str) -> usize {
        self.counters
            .iter()
            .find(|(k, _)| *k == what)
            .map_or(0, |(_, v)| *v)
    }
}

impl std::fmt::Display for PassStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .counters
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        f.write_str(&parts.join(" "))?;
        if let Some(n) = &self.note {
            write!(f, " ({n})")?;
        }
        Ok(())
    }
}

/// Why a pass could not transform a graph.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum PassError {
    /// The graph lacks something the pass requires.
    #[error("{0}")]
    Precondition(String),
    /// An edit produced an ill-typed node (a bug in the pass).
    #[error(transparent)]
    Graph(#[from] distc_ir::GraphError),
}

/// A graph-to-graph transformation. Its name comes from its type (`DeadCode` is
/// `dead_code`), so flags, dump files and messages cannot drift apart.
///
/// The pipeline transforms a [`ProgramSet`] through [`Pass::run_programs`], which by
/// default rewrites the worker program alone with [`Pass::run`]: most passes implement
/// `run` and nothing else. A pass that makes or changes the server, init or final
/// programs (distribute, zero) overrides `run_programs`.
pub trait Pass {
    /// Rewrites the worker program `g` in place.
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError>;

    /// Rewrites the program set in place: by default its worker program, with `run`.
    fn run_programs(&self, p: &mut ProgramSet, cx: &mut PassCx) -> Result<PassStats, PassError> {
        self.run(&mut p.worker, cx)
    }

    /// The pass's name: its type name in snake case.
    fn name(&self) -> String {
        snake_case(
            std::any::type_name::<Self>()
                .rsplit("::")
                .next()
                .unwrap_or("pass"),
        )
    }
}

/// What `run` answers in a pass that rewrites the program set as a whole: it cannot
/// run on the worker program alone without losing the programs it makes.
pub fn needs_program_set(pass: &str) -> PassError {
    PassError::Precondition(format!(
        "{pass} rewrites the program set (worker, servers, init, final), not one graph: \
         run it with `run_programs`"
    ))
}

fn snake_case(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The passes every pipeline starts with: differentiation and the rewrites of one
/// device's program.
fn device_passes() -> Vec<Box<dyn Pass>> {
    vec![
        Box::new(autodiff::Autodiff),
        Box::new(simplify::Simplify::default()),
        Box::new(dead_code::DeadCode),
        Box::new(accumulate::Accumulate),
        Box::new(remat::Remat),
    ]
}

/// The passes of the single-device training pipeline, in order.
pub fn single_pipeline() -> Vec<Box<dyn Pass>> {
    let mut passes = device_passes();
    passes.push(Box::new(kernel_fusion::KernelFusion));
    passes
}

/// The passes of a distributed training pipeline (every strategy but `single`): the
/// device passes, then analysis, placement, the rewrite, gradient fusion, kernel fusion
/// (after every pass that makes element-wise ops) and scheduling.
pub fn distributed_pipeline() -> Vec<Box<dyn Pass>> {
    let mut passes = device_passes();
    passes.push(Box::new(sparsity::SparsityAnalysis));
    passes.push(Box::new(place::Place));
    passes.push(Box::new(distribute::Distribute));
    passes.push(Box::new(zero::Zero));
    passes.push(Box::new(fusion::Fusion));
    passes.push(Box::new(kernel_fusion::KernelFusion));
    passes.push(Box::new(schedule::Schedule));
    passes
}

/// The pipeline of a strategy.
pub fn pipeline(strategy: placement::Strategy) -> Vec<Box<dyn Pass>> {
    match strategy {
        placement::Strategy::Single => single_pipeline(),
        _ => distributed_pipeline(),
    }
}

/// The passes a compile with `cfg` runs: the strategy's, or with `--pipeline` the
/// one-device passes and the pipeline rewrite.
pub fn passes_for(cfg: &placement::StrategyConfig) -> Vec<Box<dyn Pass>> {
    let mut passes = strategy_passes(cfg);
    if cfg.precision != placement::Precision::Fp32 {
        // On the forward program (sharded first, with a model axis), before autodiff.
        let at = passes
            .iter()
            .position(|p| p.name() == autodiff::Autodiff.name())
            .unwrap_or(0);
        passes.insert(at, Box::new(mixed_precision::MixedPrecision));
    }
    if cfg.grad_wire != placement::Precision::Fp32 {
        // On the buckets gradient fusion made.
        if let Some(at) = passes
            .iter()
            .position(|p| p.name() == fusion::Fusion.name())
        {
            passes.insert(at + 1, Box::new(grad_wire::GradWire));
        }
    }
    if cfg.ranks_per_node > 1 {
        // On the buckets, as the wire left them.
        if let Some(at) = passes
            .iter()
            .rposition(|p| [fusion::Fusion.name(), grad_wire::GradWire.name()].contains(&p.name()))
        {
            passes.insert(at + 1, Box::new(hierarchy::Hierarchy));
        }
    }
    passes
}

fn strategy_passes(cfg: &placement::StrategyConfig) -> Vec<Box<dyn Pass>> {
    if cfg.model > 1 {
        // The shardings are propagated through the forward program, and autodiff
        // differentiates the collectives they need.
        let mut passes = if cfg.pipeline > 1 {
            // Stages cut from the sharded program: each is T workers wide.
            let mut passes = single_pipeline();
            passes.push(Box::new(pipeline::split::PipelineSplit));
            passes
        } else {
            pipeline(cfg.strategy)
        };
        passes.insert(0, Box::new(tensor_parallel::TensorParallel));
        return passes;
    }
    if cfg.pipeline > 1 {
        // The stages are cut from the one-device program; the split averages each
        // stage's gradients over the pipeline's replicas itself.
        let mut passes = single_pipeline();
        passes.push(Box::new(pipeline::split::PipelineSplit));
        return passes;
    }
    pipeline(cfg.strategy)
}

/// Every pass name the pipelines know, for `--after`, `--stop-after` and `--disable-pass`.
pub fn known_pass_names() -> Vec<String> {
    let mut names: Vec<String> = distributed_pipeline().iter().map(|p| p.name()).collect();
    names.insert(0, "lower".to_string());
    names.push(pipeline::split::PipelineSplit.name());
    names.insert(1, tensor_parallel::TensorParallel.name());
    names.insert(2, mixed_precision::MixedPrecision.name());
    let fusion = names.iter().position(|n| *n == fusion::Fusion.name());
    names.insert(
        fusion.map_or(names.len(), |f| f + 1),
        grad_wire::GradWire.name(),
    );
    names.insert(
        fusion.map_or(names.len(), |f| f + 2),
        hierarchy::Hierarchy.name(),
    );
    names
}
