//! The programs a compile produces, as one value the pipeline transforms: the worker
//! program (one SPMD program for every rank), a program per parameter server, and the
//! workers' init and final programs.
//!
//! Before the distribute pass the set is the worker program alone; distribute adds the
//! servers and the init program, zero changes the init program and adds the final one.
//! The pass manager verifies every program of the set after every pass, and
//! `--dump-ir` writes every program that exists, so none travels unseen.
//! (`distc_runtime::run::train::Programs` is the runtime's borrowed view of the same four.)

use distc_ir::pipeline::PipelineProgram;
use distc_ir::{verify, Graph, ValueId, VerifyError};
use std::collections::HashMap;
use std::fmt;
use thiserror::Error;

/// The worker, server, init and final programs of one compile.
#[derive(Clone, Debug, PartialEq)]
pub struct ProgramSet {
    /// The worker program: one program for every rank.
    pub worker: Graph,
    /// One program per parameter server (none before distribute, or without servers).
    pub servers: Vec<Graph>,
    /// The workers' init program (broadcasts of replicated variables, ZeRO chunks).
    pub init: Option<Graph>,
    /// The workers' final program (whole variables gathered from ZeRO shards).
    pub finalize: Option<Graph>,
    /// The stages' programs and schedule (`--pipeline`; the worker program is then the
    /// whole one-device graph they were cut from).
    pub pipeline: Option<PipelineProgram>,
    /// What the last pass said of the worker program's values (the tensor-parallel
    /// pass: each one's sharding), printed beside them in IR dumps. Cleared before every
    /// pass: a note never outlives the graph it describes.
    pub worker_notes: HashMap<ValueId, String>,
}

/// Which program of a [`ProgramSet`]: how messages name it and how dump files end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProgramRole {
    /// The worker program.
    Worker,
    /// The program of parameter server `s`.
    Server(usize),
    /// The workers' init program.
    Init,
    /// The workers' final program.
    Final,
    /// A pipeline stage's forward (`backward: false`) or backward program.
    Stage {
        /// The stage.
        stage: usize,
        /// Whether the backward program.
        backward: bool,
    },
}

impl ProgramRole {
    /// What a dump file of this program adds before `.ir`: nothing for the worker
    /// program (`07-distribute.ir`), else `.server0`, `.init`, `.final`, the suffix the
    /// program's graph name also carries.
    pub fn file_suffix(self) -> String {
        match self {
            ProgramRole::Worker => String::new(),
            ProgramRole::Server(s) => format!(".server{s}"),
            ProgramRole::Init => ".init".into(),
            ProgramRole::Final => ".final".into(),
            ProgramRole::Stage { stage, backward } => {
                format!(
                    ".stage{stage}.{}",
                    if backward { "backward" } else { "forward" }
                )
            }
        }
    }
}

impl fmt::Display for ProgramRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProgramRole::Worker => f.write_str("worker"),
            ProgramRole::Server(s) => write!(f, "server {s}"),
            ProgramRole::Init => f.write_str("init"),
            ProgramRole::Final => f.write_str("final"),
            ProgramRole::Stage { stage, backward } => write!(
                f,
                "stage {stage} {}",
                if *backward { "backward" } else { "forward" }
            ),
        }
    }
}

/// The programs of a set that do not verify, each with all its errors.
#[derive(Clone, Debug, PartialEq, Error)]
#[error("{}", self.lines().join("\n"))]
pub struct ProgramSetError {
    /// Per failing program, its verifier errors (node ids as in that program's dump).
    pub failures: Vec<(ProgramRole, VerifyError)>,
}

impl ProgramSetError {
    /// One line per error, each naming its program: `server 1 program: %3 (...): ...`.
    fn lines(&self) -> Vec<String> {
        self.failures
            .iter()
            .flat_map(|(role, e)| {
                e.errors
                    .iter()
                    .map(move |line| format!("{role} program: {line}"))
            })
            .collect()
    }

    /// The failing programs, in set order.
    pub fn programs(&self) -> Vec<ProgramRole> {
        self.failures.iter().map(|(r, _)| *r).collect()
    }
}

impl ProgramSet {
    /// A set of the worker program alone (what lowering makes).
    pub fn new(worker: Graph) -> ProgramSet {
        ProgramSet {
            worker,
            servers: Vec::new(),
            init: None,
            finalize: None,
            pipeline: None,
            worker_notes: HashMap::new(),
        }
    }

    /// Every program that exists, with its role: the worker, the servers in order, the
    /// init program, the final program.
    pub fn iter(&self) -> impl Iterator<Item = (ProgramRole, &Graph)> {
        std::iter::once((ProgramRole::Worker, &self.worker))
            .chain(
                self.servers
                    .iter()
                    .enumerate()
                    .map(|(s, g)| (ProgramRole::Server(s), g)),
            )
            .chain(self.init.iter().map(|g| (ProgramRole::Init, g)))
            .chain(self.finalize.iter().map(|g| (ProgramRole::Final, g)))
            .chain(self.pipeline.iter().flat_map(|p| {
                p.stages.iter().enumerate().flat_map(|(stage, s)| {
                    [
                        (
                            ProgramRole::Stage {
                                stage,
                                backward: false,
                            },
                            &s.forward,
                        ),
                        (
                            ProgramRole::Stage {
                                stage,
                                backward: true,
                            },
                            &s.backward,
                        ),
                    ]
                })
            }))
    }

    /// The program of `role`, if the set has it.
    pub fn get(&self, role: ProgramRole) -> Option<&Graph> {
        match role {
            ProgramRole::Worker => Some(&self.worker),
            ProgramRole::Server(s) => self.servers.get(s),
            ProgramRole::Init => self.init.as_ref(),
            ProgramRole::Final => self.finalize.as_ref(),
            ProgramRole::Stage { stage, backward } => {
                let s = self.pipeline.as_ref()?.stages.get(stage)?;
                Some(if backward { &s.backward } else { &s.forward })
            }
        }
    }

    /// Verifies every program, collecting the errors of all that fail.
    pub fn verify(&self) -> Result<(), ProgramSetError> {
        let failures: Vec<(ProgramRole, VerifyError)> = self
            .iter()
            .filter_map(|(role, g)| verify(g).err().map(|e| (role, e)))
            .collect();
        if failures.is_empty() {
            Ok(())
        } else {
            Err(ProgramSetError { failures })
        }
    }
}

/// One shard of a server-held variable as the programs name it: (var, server, start
/// row, end row).
type ShardRef = (String, usize, usize, usize);

impl ProgramSet {
    /// Checks that the programs agree with each other, with the strategy's settings
    /// and with the placement table: every shard a worker pulls or pushes is held by the
    /// server it names with those rows, and every shard a server holds is used; a
    /// server program only holds and serves shards; a variable the table places on
    /// servers is pulled, one it replicates is a worker variable; ZeRO chunks come with
    /// the final program that makes the whole variables again. The verifier checks
    /// each program alone; a plan someone edited (and re-hashed) can still break these.
    pub fn check_consistency(
        &self,
        settings: &crate::placement::StrategyConfig,
        dist: Option<&crate::placement::DistPlan>,
    ) -> Result<(), String> {
        use crate::placement::Mechanism;
        use distc_ir::{Graph, Op, ZERO_SHARD_SUFFIX};
        use std::collections::{BTreeSet, HashSet};
        if self.servers.len() != settings.servers && !self.servers.is_empty() {
            return Err(format!(
                "{} server programs for `settings.servers` = {}",
                self.servers.len(),
                settings.servers
            ));
        }
        // What the worker reads from servers, and what the servers hold.
        let mut used: BTreeSet<ShardRef> = BTreeSet::new();
        let mut pulled: HashSet<&str> = HashSet::new();
        for id in self.worker.node_ids() {
            match self.worker.op(id) {
                Op::Pull { var, shards, .. }
                | Op::SparsePull { var, shards, .. }
                | Op::Push { var, shards }
                | Op::SparsePush { var, shards } => {
                    pulled.insert(var);
                    for &(s, a, b) in shards {
                        used.insert((var.clone(), s, a, b));
                    }
                }
                op @ (Op::Shard { .. } | Op::Serve { .. }) => {
                    return Err(format!(
                        "the worker program holds `{}`, a server's op",
                        op.mnemonic()
                    ))
                }
                _ => {}
            }
        }
        let mut held: BTreeSet<ShardRef> = BTreeSet::new();
        for (i, g) in self.servers.iter().enumerate() {
            for id in g.node_ids() {
                match g.op(id) {
                    Op::Shard {
                        var, start, end, ..
                    } => {
                        held.insert((var.clone(), i, *start, *end));
                    }
                    Op::Serve { .. } => {}
                    op => {
                        return Err(format!(
                            "server program {i} holds `{}`; a server program only holds \
                             and serves shards",
                            op.mnemonic()
                        ))
                    }
                }
            }
        }
        if let Some((var, s, a, b)) = used.difference(&held).next() {
            return Err(format!(
                "the worker program reads rows {a}..{b} of `{var}` from server {s}, which \
                 does not hold them"
            ));
        }
        if let Some((var, s, a, b)) = held.difference(&used).next() {
            return Err(format!(
                "server {s} holds rows {a}..{b} of `{var}`, which no worker reads"
            ));
        }
        // ZeRO chunks and the final program.
        let chunks: Vec<String> = self
            .worker
            .params()
            .into_iter()
            .filter_map(|(_, n, _)| n.strip_suffix(ZERO_SHARD_SUFFIX))
            // A chunk of a model-axis part: the final program makes the whole variable.
            .map(|n| {
                n.strip_suffix(crate::tensor_parallel::MODEL_SHARD_SUFFIX)
                    .unwrap_or(n)
                    .to_string()
            })
            .collect();
        // Tensor parallelism's parts are gathered by the same final program.
        let parts: Vec<String> = self
            .worker
            .params()
            .into_iter()
            .filter_map(|(_, n, _)| {
                n.strip_suffix(crate::tensor_parallel::MODEL_SHARD_SUFFIX)
                    .map(str::to_string)
            })
            .collect();
        if !parts.is_empty() && settings.model <= 1 {
            return Err(format!(
                "the worker program holds a model-axis part (`{}{}`) but `settings.model` is 1",
                parts[0],
                crate::tensor_parallel::MODEL_SHARD_SUFFIX
            ));
        }
        let chunks: Vec<String> = chunks.into_iter().chain(parts).collect();
        if !chunks.is_empty() && settings.zero == 0 && settings.model <= 1 {
            return Err(format!(
                "the worker program holds ZeRO chunks (`{}{ZERO_SHARD_SUFFIX}`) but \
                 `settings.zero` is 0",
                chunks[0]
            ));
        }
        match &self.finalize {
            None if !chunks.is_empty() => {
                return Err(format!(
                    "the worker program holds ZeRO chunks (`{}{ZERO_SHARD_SUFFIX}`) but the \
                     plan has no final program to make the whole variables from them",
                    chunks[0]
                ))
            }
            Some(_) if chunks.is_empty() => {
                return Err("a final program, but no ZeRO chunks for it to gather".into())
            }
            Some(fin) => {
                let made: HashSet<String> =
                    fin.outputs().into_iter().map(|(name, _)| name).collect();
                if let Some(v) = chunks.iter().find(|v| !made.contains(*v)) {
                    return Err(format!(
                        "the final program does not make `{v}` from its ZeRO chunk"
                    ));
                }
            }
            None => {}
        }
        // Parts and chunks of variables are made by the init program from the one-device
        // values: without it each worker would initialise its part on its own, another
        // model.
        if let Some(v) = chunks.first() {
            let made: HashSet<String> = self
                .init
                .iter()
                .flat_map(|g| g.outputs().into_iter().map(|(name, _)| name))
                .collect();
            let read: Vec<String> = self
                .worker
                .params()
                .into_iter()
                .map(|(_, n, _)| n.to_string())
                .filter(|n| {
                    n.ends_with(ZERO_SHARD_SUFFIX)
                        || n.ends_with(crate::tensor_parallel::MODEL_SHARD_SUFFIX)
                })
                .collect();
            if let Some(part) = read.iter().find(|n| !made.contains(*n)) {
                return Err(match &self.init {
                    None => format!(
                        "the worker program holds parts of variables (`{part}`, of `{v}`) \
                         and the plan has no init program to cut them from the model's \
                         values"
                    ),
                    Some(_) => format!("the init program does not make `{part}`"),
                });
            }
        }
        // The whole variable's rank: the init program reads it whole (a ZeRO chunk of
        // a part is flat), else the worker holds it or its part. Found once for every
        // name (a search per sharded variable is quadratic).
        let mut ranks: HashMap<&str, usize> = HashMap::new();
        if !settings.shard.is_empty() {
            for (_, n, t) in self
                .init
                .iter()
                .flat_map(|g| g.params())
                .chain(self.worker.params())
            {
                let whole = n
                    .strip_suffix(crate::tensor_parallel::MODEL_SHARD_SUFFIX)
                    .unwrap_or(n);
                ranks.entry(whole).or_insert(t.shape.rank());
                ranks.entry(n).or_insert(t.shape.rank());
            }
        }
        for (var, dim) in &settings.shard {
            let rank = ranks.get(var.as_str()).copied();
            match rank {
                Some(r) if *dim < r => {}
                Some(r) => {
                    return Err(format!(
                        "`settings.shard` splits `{var}` along dimension {dim}; it has {r}"
                    ))
                }
                None => {
                    return Err(format!(
                        "`settings.shard` names `{var}`, which the worker program does not hold"
                    ))
                }
            }
        }
        // An all-reduce grouped into nodes needs the nodes the settings give.
        for id in self.worker.node_ids() {
            if let Op::AllReduce { ranks_per_node, .. } = self.worker.op(id) {
                if *ranks_per_node > 0 && *ranks_per_node != settings.ranks_per_node {
                    return Err(format!(
                        "the worker program's all_reduce {id} runs over nodes of \
                         {ranks_per_node} workers, and `settings.ranks_per_node` is {}",
                        settings.ranks_per_node
                    ));
                }
            }
        }
        // The stages read the variables the model reads: one variable read in place of
        // another would train both wrong.
        if let Some(p) = &self.pipeline {
            let read_by = |g: &Graph| -> BTreeSet<String> {
                g.params()
                    .into_iter()
                    .filter(|(id, _, _)| !g.user_nodes(*id).is_empty())
                    .map(|(_, n, _)| n.to_string())
                    .collect()
            };
            let whole = read_by(&self.worker);
            let stages: BTreeSet<String> = p
                .stages
                .iter()
                .flat_map(|s| read_by(&s.forward).into_iter().chain(read_by(&s.backward)))
                .collect();
            if let Some(v) = whole.difference(&stages).next() {
                return Err(format!("the model reads `{v}`, and no pipeline stage does"));
            }
            if let Some(v) = stages.difference(&whole).next() {
                return Err(format!(
                    "a pipeline stage reads `{v}`, which the model does not"
                ));
            }
        }
        // The placement table against the programs.
        let Some(dist) = dist else { return Ok(()) };
        let params: HashSet<String> = self
            .worker
            .params()
            .into_iter()
            .map(|(_, n, _)| n.strip_suffix(ZERO_SHARD_SUFFIX).unwrap_or(n).to_string())
            .collect();
        for v in &dist.vars {
            let on_servers = v.placement == Mechanism::Ps;
            if on_servers && !pulled.contains(v.name.as_str()) {
                return Err(format!(
                    "the placement table puts `{}` on servers; the worker program does not \
                     pull it",
                    v.name
                ));
            }
            if !on_servers && !params.contains(&v.name) {
                return Err(format!(
                    "the placement table replicates `{}` ({}); the worker program has no \
                     such variable",
                    v.name,
                    v.placement.name()
                ));
            }
            let table: BTreeSet<ShardRef> = v
                .shards
                .iter()
                .map(|s| (v.name.clone(), s.server, s.start, s.end))
                .collect();
            let programs: BTreeSet<ShardRef> =
                held.iter().filter(|s| s.0 == v.name).cloned().collect();
            if table != programs {
                return Err(format!(
                    "the placement table's shards of `{}` differ from those the server \
                     programs hold",
                    v.name
                ));
            }
        }
        let listed: HashSet<&str> = dist
            .vars
            .iter()
            .map(|v| v.name.as_str())
            .chain(dist.unreached.iter().map(String::as_str))
            .collect();
        if let Some(v) = params
            .iter()
            .map(String::as_str)
            .chain(pulled.iter().copied())
            .find(|v| !listed.contains(v))
        {
            return Err(format!("`{v}` is not in the placement table"));
        }
        Ok(())
    }
}
