//! Graph transformations of distc: each pass is a function from graph to graph in its
//! own file, run by the [`manager`] with the verifier after every step.
#![deny(missing_docs)]

pub mod accumulate;
pub mod autodiff;
pub mod cost;
pub mod dead_code;
pub mod distribute;
pub mod fused_rules;
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
    /// When the pass manager verifies the programs.
    pub verify: Verify,
}

/// When [`run_pipeline`] verifies the programs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Verify {
    /// After every pass, keeping the set from before it: a failure names its pass and
    /// hands back the last good set. What a user's compile does.
    #[default]
    EveryPass,
    /// Once, after the last pass, keeping no copies: for a search that compiles many
    /// plans of one model. A failure is not pinned on a pass (`last_good` is the set
    /// as it was left); compile again with [`Verify::EveryPass`] to name it.
    AtEnd,
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

// The pipelines are plain data: one list per kind of pipeline, every pass it can run
// in order, each with the option it waits for. `passes_for` keeps the passes whose
// option holds; `known_pass_names` reads the same lists, so the two cannot drift.

/// What a pass in a pipeline's list waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    /// Every compile runs it.
    Always,
    /// A model axis (`--model` above 1): the forward program is sharded first.
    ModelAxis,
    /// Compute below fp32 (`--precision`): on the forward program, before autodiff.
    Precision,
    /// Gradients sent below fp32 (`--grad-wire`): on the buckets fusion made.
    GradWire,
    /// Several ranks per node (`--ranks-per-node`): on the buckets, as the wire left them.
    RanksPerNode,
}

impl When {
    fn holds(self, cfg: &placement::StrategyConfig) -> bool {
        match self {
            When::Always => true,
            When::ModelAxis => cfg.model > 1,
            When::Precision => cfg.precision != placement::Precision::Fp32,
            When::GradWire => cfg.grad_wire != placement::Precision::Fp32,
            When::RanksPerNode => cfg.ranks_per_node > 1,
        }
    }
}

/// A pipeline's list: each pass with what it waits for.
type PassList = Vec<(When, Box<dyn Pass>)>;

fn always(p: impl Pass + 'static) -> (When, Box<dyn Pass>) {
    (When::Always, Box::new(p))
}

fn when(w: When, p: impl Pass + 'static) -> (When, Box<dyn Pass>) {
    (w, Box::new(p))
}

/// The passes every list starts with, on the one-device program: sharding on a model
/// axis, 16-bit arithmetic, differentiation and its clean-up, accumulation, remat.
fn with_device_passes(then: PassList) -> PassList {
    let mut passes = vec![
        when(When::ModelAxis, tensor_parallel::TensorParallel),
        when(When::Precision, mixed_precision::MixedPrecision),
        always(autodiff::Autodiff),
        always(simplify::Simplify::default()),
        always(dead_code::DeadCode),
        always(accumulate::Accumulate),
        always(remat::Remat),
    ];
    passes.extend(then);
    passes
}

/// One device (`--strategy single`): differentiation and the rewrites of one device's
/// program.
fn single_pipeline() -> PassList {
    with_device_passes(vec![always(kernel_fusion::KernelFusion)])
}

/// Every other strategy: the device passes, then analysis, placement, the rewrite,
/// gradient fusion, kernel fusion (after every pass that makes element-wise ops) and
/// scheduling.
fn distributed_pipeline() -> PassList {
    with_device_passes(vec![
        always(sparsity::SparsityAnalysis),
        always(place::Place),
        always(distribute::Distribute),
        always(zero::Zero),
        always(fusion::Fusion),
        when(When::GradWire, grad_wire::GradWire),
        when(When::RanksPerNode, hierarchy::Hierarchy),
        always(kernel_fusion::KernelFusion),
        always(schedule::Schedule),
    ])
}

/// Pipeline stages (`--pipeline` above 1, whatever the strategy): the stages are cut
/// from the one-device program (sharded first, with a model axis: each stage is then T
/// workers wide); the split averages each stage's gradients over the replicas itself.
fn split_pipeline() -> PassList {
    with_device_passes(vec![
        always(kernel_fusion::KernelFusion),
        always(pipeline::split::PipelineSplit),
    ])
}

/// The passes a compile with `cfg` runs, in order: its kind of pipeline's list, less
/// the passes whose option is off.
pub fn passes_for(cfg: &placement::StrategyConfig) -> Vec<Box<dyn Pass>> {
    let list = if cfg.pipeline > 1 {
        split_pipeline()
    } else if cfg.strategy == placement::Strategy::Single {
        single_pipeline()
    } else {
        distributed_pipeline()
    };
    list.into_iter()
        .filter(|(w, _)| w.holds(cfg))
        .map(|(_, p)| p)
        .collect()
}

/// Every pass name the pipelines know, for `--after`, `--stop-after` and
/// `--disable-pass`: `lower` (the DSL front end), then the lists' passes, each where
/// it first appears.
pub fn known_pass_names() -> Vec<String> {
    let mut names = vec!["lower".to_string()];
    for (_, p) in [distributed_pipeline(), single_pipeline(), split_pipeline()]
        .into_iter()
        .flatten()
    {
        let name = p.name();
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}
