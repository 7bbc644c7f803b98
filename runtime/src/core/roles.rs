//! Which process (or thread) does what: the mapping from rank to role.
//!
//! A plan with N workers and S parameter servers runs as `N + S` ranks:
//!
//! | ranks | role |
//! | --- | --- |
//! | `0 .. N-1` | worker `r` (rank `r`); rank 0 also writes the global metrics line |
//! | `N .. N+S-1` | parameter server `s` (rank `N + s`) |
//!
//! Workers form their own communicator for collectives (all-reduce, all-gather,
//! broadcast), so a collective never waits for a server; servers are addressed by
//! their index `s` through the parameter-server transport. One device is the
//! `N = 1, S = 0` case. The in-process runtime runs every rank as a thread; under MPI
//! each rank is a process and `mpirun -np N+S` starts them.

/// What one rank does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Worker `r` of `0..N`.
    Worker(usize),
    /// Parameter server `s` of `0..S`.
    Server(usize),
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Role::Worker(r) => write!(f, "worker {r}"),
            Role::Server(s) => write!(f, "server {s}"),
        }
    }
}

/// The rank-to-role mapping of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Roles {
    /// Workers N.
    pub workers: usize,
    /// Parameter servers S.
    pub servers: usize,
}

impl Roles {
    /// Ranks in all: `N + S`.
    pub fn world(&self) -> usize {
        self.workers + self.servers
    }

    /// The role of `rank`, or `None` past the last rank.
    pub fn role(&self, rank: usize) -> Option<Role> {
        if rank < self.workers {
            Some(Role::Worker(rank))
        } else if rank < self.world() {
            Some(Role::Server(rank - self.workers))
        } else {
            None
        }
    }

    /// The rank of `role`.
    pub fn rank(&self, role: Role) -> usize {
        match role {
            Role::Worker(r) => r,
            Role::Server(s) => self.workers + s,
        }
    }
}
