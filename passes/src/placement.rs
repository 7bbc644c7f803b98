//! What the distribution passes decide, as data: per variable its kind (dense or
//! sparse), measured density, mechanism, shards, bucket and predicted bytes. The
//! analysis and placement passes fill it in; the rewrite passes read it; the plan
//! stores it; `distc explain` prints it.

use serde::{Deserialize, Serialize};

/// The distribution strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// One device, no communication.
    Single,
    /// Every variable replicated; gradients all-reduced (sparse ones all-gathered).
    Allreduce,
    /// Every variable on parameter servers.
    Ps,
    /// Sparse variables on parameter servers, dense ones all-reduced.
    Hybrid,
    /// Chosen per variable by the cost model.
    Auto,
}

impl Strategy {
    /// The strategy's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::Allreduce => "allreduce",
            Strategy::Ps => "ps",
            Strategy::Hybrid => "hybrid",
            Strategy::Auto => "auto",
        }
    }
}

/// How parameter servers apply pushes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "staleness")]
pub enum SyncMode {
    /// A step's gradients from all workers are aggregated, then applied once.
    Sync,
    /// Applied on arrival.
    Async,
    /// Async, but no worker runs more than K steps ahead of the slowest.
    Stale(u32),
}

impl std::fmt::Display for SyncMode {
    /// As the user types it: `sync`, `async`, `stale:2`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SyncMode::Sync => f.write_str("sync"),
            SyncMode::Async => f.write_str("async"),
            SyncMode::Stale(k) => write!(f, "stale:{k}"),
        }
    }
}

/// The `--strategy` flags and the cost model's constants.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StrategyConfig {
    /// The strategy.
    pub strategy: Strategy,
    /// Worker count N.
    pub workers: usize,
    /// Parameter-server count S (0 when no variable is on a server).
    pub servers: usize,
    /// Server synchronisation.
    pub sync: SyncMode,
    /// Bucket size cap in MiB for fused all-reduces.
    pub bucket_mb: f64,
    /// Cap of the first bucket in MiB, small so communication starts early.
    pub first_bucket_mb: f64,
    /// All-reduce sparse gradients densified instead of all-gathering their slices.
    pub sparse_as_dense: bool,
    /// Variables of at least this many bytes are row-partitioned across servers.
    pub partition_bytes: usize,
    /// Link bandwidth, bytes per second (the cost model's 1/beta).
    pub bandwidth: f64,
    /// Latency per message, seconds (the cost model's alpha).
    pub latency: f64,
    /// ZeRO stage of the all-reduced dense variables: 0 (none), 1 (optimizer state
    /// sharded), 2 (and gradients), 3 (and parameters).
    #[serde(default)]
    pub zero: u8,
    /// Micro-batches per step (gradient accumulation); 1 for none.
    #[serde(default = "one")]
    pub accumulate: usize,
    /// Activation checkpointing: which forward activations the backward pass
    /// recomputes instead of keeping.
    #[serde(default)]
    pub remat: RematPolicy,
    /// Kernel fusion: collapse chains of element-wise ops into `fused` nodes.
    #[serde(default)]
    pub fuse: bool,
    /// Pipeline stages P (1: no pipeline).
    #[serde(default = "one")]
    pub pipeline: usize,
    /// Micro-batches per step of a pipeline.
    #[serde(default = "one")]
    pub micro_batches: usize,
    /// The pipeline's order of forwards and backwards.
    #[serde(default)]
    pub schedule: distc_ir::pipeline::schedule::ScheduleKind,
    /// The stage of each variable as the model's `pipeline_stage` markers say (the
    /// stage of the statement first using it); none: stages balanced by cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_marks: Option<std::collections::BTreeMap<String, usize>>,
    /// Workers T of the model axis (tensor parallelism; 1: none). Worker w is model
    /// rank w % T of data rank w / T.
    #[serde(default = "one")]
    pub model: usize,
    /// Variables split over the model axis, `var -> dim` (the model's `shard` marks
    /// and `--shard`); none: the Megatron rule picks them.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub shard: std::collections::BTreeMap<String, usize>,
    /// The forward and backward arithmetic's precision (`--precision`): variables
    /// stay f32 master copies whatever it is.
    #[serde(default)]
    pub precision: Precision,
    /// What dense gradient all-reduces send (`--grad-wire`): f32, or 16-bit values
    /// (each worker's divided by N first, sums accumulated in f32).
    #[serde(default)]
    pub grad_wire: Precision,
    /// Workers per node L (`--ranks-per-node`; 0: every worker on one node). Worker w
    /// is on node w / L; `bandwidth` and `latency` are then the link between nodes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ranks_per_node: usize,
    /// The link between two workers of one node (`--link intra=BW,LAT`).
    #[serde(default = "Link::default_intra")]
    pub intra_link: Link,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

/// A link of the cost model: `bytes / bandwidth + messages * latency`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bytes per second (1/beta).
    pub bandwidth: f64,
    /// Seconds per message (alpha).
    pub latency: f64,
}

impl Link {
    /// Within a node: NVLink-class, 100 GB/s and 5 us a message, unless `--link intra`
    /// says otherwise.
    pub fn default_intra() -> Link {
        Link {
            bandwidth: 100e9,
            latency: 5e-6,
        }
    }
}

/// Predicted seconds of one all-reduce of `bytes` over `n` workers in nodes of `local`:
/// `(flat ring, hierarchical)`. A flat ring's 2(N-1) steps each move `bytes/N` and wait
/// on the slowest link, between nodes; the hierarchical all-reduce's 2(L-1) steps move
/// `bytes/L` within the node and its 2(M-1) steps `bytes/(L M)` between the M nodes.
pub fn all_reduce_seconds(bytes: f64, n: usize, local: usize, cfg: &StrategyConfig) -> (f64, f64) {
    let inter = Link {
        bandwidth: cfg.bandwidth,
        latency: cfg.latency,
    };
    let intra = cfg.intra_link;
    all_reduce_seconds_by(bytes, n, local, |across, chunk| {
        let link = if across { inter } else { intra };
        link.latency + chunk / link.bandwidth
    })
}

/// [`all_reduce_seconds`] with each ring step priced by `message(across, bytes)`: one
/// message of `bytes` between nodes (`across`) or within one. The hierarchy pass
/// prices a message on the two links' lines; `distc simulate` on a calibration's
/// measured sizes.
pub fn all_reduce_seconds_by(
    bytes: f64,
    n: usize,
    local: usize,
    message: impl Fn(bool, f64) -> f64,
) -> (f64, f64) {
    let ring = |m: usize, chunk: f64, across: bool| 2.0 * (m as f64 - 1.0) * message(across, chunk);
    let n = n.max(1);
    let local = local.clamp(1, n);
    let nodes = n / local;
    let flat = ring(n, bytes / n as f64, nodes > 1);
    let hier = ring(local, bytes / local as f64, false) + ring(nodes, bytes / n as f64, true);
    (flat, hier)
}

/// `--precision`: f32 throughout, or 16-bit arithmetic where the mixed-precision
/// pass's lists allow it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 everywhere.
    #[default]
    Fp32,
    /// bfloat16 (f32's range): no loss scaling needed.
    Bf16,
    /// IEEE half, with dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// `fp32`, `bf16` or `fp16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" => Ok(Precision::Fp16),
            _ => Err(format!("`{s}` is not a precision: fp32, bf16 or fp16")),
        }
    }
}

/// Which activations the remat pass drops after the forward pass and recomputes in
/// the backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "policy", content = "mib")]
pub enum RematPolicy {
    /// Keep every activation the backward pass reads.
    #[default]
    Off,
    /// Keep only the activations entering a layer (the non-parameter input of a
    /// `matmul` or `conv2d`) and recompute the rest of each layer from them, as
    /// checkpointing each layer in PyTorch does.
    Layers,
    /// The fewest recomputations whose predicted peak of activations is at most this
    /// many MiB: no checkpointing, then every layer boundary kept, then every 2nd,
    /// 4th, ... boundary, then none (everything recomputed from the inputs).
    Budget(f64),
}

impl std::fmt::Display for RematPolicy {
    /// As the user types it: `off`, `layers`, `64` (MiB).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RematPolicy::Off => f.write_str("off"),
            RematPolicy::Layers => f.write_str("layers"),
            RematPolicy::Budget(mib) => write!(f, "{mib}"),
        }
    }
}

fn one() -> usize {
    1
}

/// The most workers, or servers, a plan may name.
pub const MAX_RANKS: usize = distc_ir::MAX_WORKERS;

/// The most micro-batches a step may accumulate.
pub const MAX_MICRO_BATCHES: usize = 1 << 16;

impl StrategyConfig {
    /// Every setting's range, and the settings that contradict the strategy: what the
    /// command line refuses by flag, refused here by field for a plan whoever wrote it.
    pub fn check(&self) -> Result<(), String> {
        let name = self.strategy.name();
        let field = |f: &str, rule: &str, x: &dyn std::fmt::Display| {
            Err(format!("`{f}` must be {rule}, found {x}"))
        };
        if !(1..=MAX_RANKS).contains(&self.workers) {
            return field("workers", &format!("in 1..={MAX_RANKS}"), &self.workers);
        }
        if self.ranks_per_node > 0 {
            if self.model > 1 || self.pipeline > 1 {
                return Err(
                    "--ranks-per-node with a model axis or a pipeline is not supported yet".into(),
                );
            }
            if !self.workers.is_multiple_of(self.ranks_per_node) {
                return Err(format!(
                    "{} workers cannot fill nodes of {}: give a multiple of \
                     --ranks-per-node",
                    self.workers, self.ranks_per_node
                ));
            }
        }
        // A byte a second is the slowest link (below it a bucket's time is infinite).
        for (what, l) in [("intra", self.intra_link)] {
            if !(l.bandwidth >= 1.0 && l.bandwidth.is_finite() && l.latency >= 0.0) {
                return Err(format!(
                    "the {what}-node link must have a bandwidth of at least 1 B/s and a latency of \
                     0 or more, found {} B/s and {} s",
                    l.bandwidth, l.latency
                ));
            }
        }
        if self.servers > MAX_RANKS {
            return field("servers", &format!("at most {MAX_RANKS}"), &self.servers);
        }
        if !(1..=MAX_MICRO_BATCHES).contains(&self.accumulate) {
            return field(
                "accumulate",
                &format!("in 1..={MAX_MICRO_BATCHES}"),
                &self.accumulate,
            );
        }
        if self.zero > 3 {
            return field("zero", "0, 1, 2 or 3", &self.zero);
        }

        if !(1..=MAX_RANKS).contains(&self.pipeline) {
            return field("pipeline", &format!("in 1..={MAX_RANKS}"), &self.pipeline);
        }
        if !(1..=MAX_MICRO_BATCHES).contains(&self.micro_batches) {
            return field(
                "micro_batches",
                &format!("in 1..={MAX_MICRO_BATCHES}"),
                &self.micro_batches,
            );
        }
        // Settings that contradict each other: each would train something else than
        // they describe, or ignore one of them (a plan file may say anything).
        let contradictions = [
            (
                self.pipeline > 1 && self.accumulate > 1,
                format!(
                    "--accumulate {} with --pipeline: a pipeline's micro-batches are \
                     --micro-batches",
                    self.accumulate
                ),
            ),
            (
                self.pipeline == 1 && self.micro_batches > 1,
                format!(
                    "--micro-batches {} without --pipeline: use --accumulate for the same \
                     update",
                    self.micro_batches
                ),
            ),
            (
                self.zero > 0 && (self.pipeline > 1 || self.model > 1) && self.data_workers() <= 1,
                format!(
                    "--zero {} on a mesh of one data replica: ZeRO shards over the data axis",
                    self.zero
                ),
            ),
            (
                self.zero > 0 && self.pipeline > 1,
                format!(
                    "--zero {} with --pipeline is not supported yet: each stage holds its \
                     own variables whole",
                    self.zero
                ),
            ),
        ];
        if let Some((_, what)) = contradictions.into_iter().find(|c| c.0) {
            return Err(what);
        }
        for (f, x) in [
            ("bucket_mb", self.bucket_mb),
            ("first_bucket_mb", self.first_bucket_mb),
            ("latency", self.latency),
        ] {
            if !(x.is_finite() && x >= 0.0) {
                return field(f, "a finite number of at least 0", &x);
            }
        }
        if !(self.bandwidth.is_finite() && self.bandwidth >= 1.0) {
            return field(
                "bandwidth",
                "a finite number of at least 1 (B/s)",
                &self.bandwidth,
            );
        }
        if self.partition_bytes == 0 {
            return field("partition_bytes", "positive", &self.partition_bytes);
        }
        if let RematPolicy::Budget(mib) = self.remat {
            if !(mib.is_finite() && mib > 0.0) {
                return field("remat", "a positive finite budget in MiB", &mib);
            }
        }
        if self.grad_wire != Precision::Fp32
            && matches!(self.strategy, Strategy::Single | Strategy::Ps)
        {
            return Err(format!(
                "--grad-wire {} sets what gradient all-reduces send; `{}` all-reduces none \
                 (use allreduce, hybrid or auto)",
                self.grad_wire,
                self.strategy.name()
            ));
        }
        if self.precision == Precision::Fp16 {
            // The loss scale is applied where the worker updates its variables.
            let refused = [
                (
                    self.servers > 0,
                    "parameter servers (they apply the updates)",
                ),
                (
                    self.pipeline > 1,
                    "--pipeline (each stage updates its own variables)",
                ),
            ];
            if let Some((_, what)) = refused.iter().find(|r| r.0) {
                return Err(format!(
                    "--precision fp16 (dynamic loss scaling) with {what} is not supported yet: \
                     use bf16, which needs no scaling"
                ));
            }
        }
        if self.model == 0 || self.model > MAX_RANKS {
            return field("model", &format!("in 1..={MAX_RANKS}"), &self.model);
        }
        if self.model > 1 {
            if !self.workers.is_multiple_of(self.model) {
                return Err(format!(
                    "{} workers cannot form a mesh with a model axis of {}: give a multiple",
                    self.workers, self.model
                ));
            }
            let refused = [
                (self.servers > 0, "parameter servers"),
                (self.accumulate > 1, "--accumulate"),
            ];
            if let Some((_, what)) = refused.iter().find(|r| r.0) {
                return Err(format!(
                    "{what} with a model axis (tensor parallelism) is not supported yet"
                ));
            }
            let replica = self.model * self.pipeline.max(1);
            if !self.workers.is_multiple_of(replica) {
                return Err(format!(
                    "{} workers cannot form a mesh of model={} x pipe={}: give a multiple \
                     of {replica}",
                    self.workers,
                    self.model,
                    self.pipeline.max(1)
                ));
            }
            if self.zero > 0 && self.data_workers() <= 1 {
                return Err(format!(
                    "ZeRO {} shards over the data axis, and this mesh has one data replica",
                    self.zero
                ));
            }
            if self.strategy == Strategy::Single && self.workers != replica {
                return Err(format!(
                    "{} workers under `single` with a model axis of {}: one data replica \
                     is {replica} workers",
                    self.workers, self.model
                ));
            }
            return match self.strategy {
                Strategy::Single | Strategy::Allreduce => Ok(()),
                s => Err(format!(
                    "`{}` with a model axis (tensor parallelism) is not supported yet: use \
                     `single` or `allreduce`",
                    s.name()
                )),
            };
        }
        match self.strategy {
            Strategy::Single if self.workers != 1 || self.servers != 0 => Err(format!(
                "{} workers and {} servers under `single`, one device: it has 1 and 0",
                self.workers, self.servers
            )),
            Strategy::Single | Strategy::Allreduce if self.sync != SyncMode::Sync => Err(format!(
                "sync `{}` under `{name}`: all-reduce is synchronous; only servers apply \
                 pushes asynchronously",
                self.sync
            )),
            Strategy::Single | Strategy::Ps if self.zero != 0 => Err(format!(
                "ZeRO {} under `{name}`, which all-reduces nothing to shard",
                self.zero
            )),
            _ => Ok(()),
        }
    }
}

impl StrategyConfig {
    /// Workers on the data axis: the copies among which gradients are averaged (all of
    /// them without a model axis or pipeline stages).
    pub fn data_workers(&self) -> usize {
        (self.workers / (self.model.max(1) * self.pipeline.max(1))).max(1)
    }

    /// Batches of the per-worker size in one step's update: one per data-parallel
    /// worker, times the micro-batches of accumulation or of a pipeline.
    pub fn batches_per_step(&self) -> usize {
        let micro = self.accumulate.max(1)
            * if self.pipeline > 1 {
                self.micro_batches.max(1)
            } else {
                1
            };
        self.data_workers() * micro
    }
}

impl Default for StrategyConfig {
    fn default() -> StrategyConfig {
        StrategyConfig {
            strategy: Strategy::Single,
            workers: 1,
            servers: 0,
            sync: SyncMode::Sync,
            bucket_mb: 25.0,
            first_bucket_mb: 1.0,
            sparse_as_dense: false,
            partition_bytes: 8 << 20,
            bandwidth: 1.25e9,
            latency: 25e-6,
            ranks_per_node: 0,
            intra_link: Link::default_intra(),
            zero: 0,
            accumulate: 1,
            remat: RematPolicy::Off,
            fuse: false,
            pipeline: 1,
            micro_batches: 1,
            schedule: Default::default(),
            stage_marks: None,
            model: 1,
            precision: Precision::Fp32,
            grad_wire: Precision::Fp32,
            shard: Default::default(),
        }
    }
}

/// Dense or row-sparse gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Every gradient contribution is dense (or some are).
    Dense,
    /// Every gradient contribution is `IndexedSlices`.
    Sparse,
}

/// How a variable's gradient travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mechanism {
    /// No communication (one device, or no gradient reaches it).
    Local,
    /// Ring all-reduce of the (dense) gradient.
    Allreduce,
    /// All-gather of the gradient's slices.
    Allgather,
    /// Pulled from and pushed to parameter servers.
    Ps,
}

impl Mechanism {
    /// The name shown by explain.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Local => "local",
            Mechanism::Allreduce => "allreduce",
            Mechanism::Allgather => "allgather",
            Mechanism::Ps => "ps",
        }
    }
}

/// A row range of a variable held by one server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Shard {
    /// Server index.
    pub server: usize,
    /// First row.
    pub start: usize,
    /// One past the last row.
    pub end: usize,
    /// Bytes of the shard.
    pub bytes: usize,
}

/// What is known of a variable and where it goes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VarPlacement {
    /// Variable name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Bytes of the variable.
    pub bytes: usize,
    /// Dense or sparse gradient.
    pub kind: Kind,
    /// Rows a worker's step touches (all rows for dense variables).
    pub rows_touched: f64,
    /// `rows_touched / rows`.
    pub density: f64,
    /// How `rows_touched` was obtained ("measured over K batches", "bound", "dense").
    pub rows_source: String,
    /// The mechanism chosen.
    pub placement: Mechanism,
    /// Server shards (parameter-server variables only).
    pub shards: Vec<Shard>,
    /// Fusion bucket (dense all-reduced variables only).
    pub bucket: Option<usize>,
    /// Predicted bytes per step per worker under the chosen mechanism.
    pub predicted_bytes_per_step: f64,
    /// Of those, the bytes that carry the variable itself (ZeRO's gathers of its
    /// chunks), not its gradient: a 16-bit gradient wire leaves them in f32.
    #[serde(default)]
    pub gather_bytes_per_step: f64,
    /// The best other mechanism and its predicted bytes per step per worker.
    pub runner_up: Option<RunnerUp>,
    /// Why this mechanism (the cost model's times, or the strategy's rule).
    pub reason: String,
}

/// The mechanism the cost model would have picked next for a variable, and its cost.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunnerUp {
    /// The mechanism.
    pub placement: Mechanism,
    /// Its predicted bytes per step per worker.
    pub predicted_bytes_per_step: f64,
}

/// One fusion bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// Index, in the order the backward pass fills the buckets.
    pub id: usize,
    /// Variables, in gradient production order.
    pub vars: Vec<String>,
    /// Bytes of the packed gradients.
    pub bytes: usize,
}

/// The whole distribution decision.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DistPlan {
    /// Per variable, in graph order.
    pub vars: Vec<VarPlacement>,
    /// Fusion buckets.
    pub buckets: Vec<Bucket>,
    /// Variables no gradient reaches (no bucket slot, no traffic).
    pub unreached: Vec<String>,
}

impl DistPlan {
    /// Sum of the variables' predicted bytes per step per worker.
    pub fn predicted_bytes_per_step_per_worker(&self) -> f64 {
        self.vars.iter().map(|v| v.predicted_bytes_per_step).sum()
    }
    /// The placement of `name`.
    pub fn var(&self, name: &str) -> Option<&VarPlacement> {
        self.vars.iter().find(|v| v.name == name)
    }
}
