//! The programs a compile produces, as one value the pipeline transforms: the worker
//! program (one SPMD program for every rank), a program per parameter server, and the
//! workers' init and final programs.
//!
//! Before the distribute pass the set is the worker program alone; distribute adds the
//! servers and the init program, zero changes the init program and adds the final one.
//! The pass manager verifies every program of the set after every pass, and
//! `--dump-ir` writes every program that exists, so none travels unseen.
//! (`distc_runtime::run::train::Programs` is the runtime's borrowed view of the same four.)

use distc_ir::{verify, Graph, VerifyError};
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
    }

    /// The program of `role`, if the set has it.
    pub fn get(&self, role: ProgramRole) -> Option<&Graph> {
        match role {
            ProgramRole::Worker => Some(&self.worker),
            ProgramRole::Server(s) => self.servers.get(s),
            ProgramRole::Init => self.init.as_ref(),
            ProgramRole::Final => self.finalize.as_ref(),
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
