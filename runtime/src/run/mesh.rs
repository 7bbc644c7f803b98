//! The mesh: how a plan's worker ranks are arranged, made once from the plan and asked
//! by every launcher, loop and message (torchtitan's `ParallelDims`). No other code
//! reads the axis sizes from the programs.
//!
//! A plan's workers form a `data x pipe x model` grid, plus `S` parameter servers:
//!
//! | axis | size | what its members share |
//! | --- | --- | --- |
//! | `data` | D replicas | the same stage and model rank; they average gradients |
//! | `pipe` | P stages | the same replica and model rank; activations pass between them |
//! | `model` | T model ranks | the same replica and stage; they split layers' variables |
//!
//! Worker `w` sits at
//!
//! ```text
//! replica = w / (T P)      stage = (w / T) % P      model rank = w % T
//! w = (replica P + stage) T + model rank
//! ```
//!
//! so a stage's model ranks are neighbours, and a data-parallel plan (P = T = 1) has
//! worker `w` as replica `w`. Servers follow the workers: rank `D P T + s` is server
//! `s` (see [`crate::core::roles`]). Each axis splits the workers into groups: a
//! worker's group on an axis and its rank inside it ([`Mesh::group`]) are what both
//! transports use to link the axis, threads by one in-process communicator per group,
//! MPI by splitting the world with the group as colour and the rank as key.

use crate::core::error::{Result, RuntimeError};
use crate::core::roles::{Role, Roles};
use crate::run::programs::Programs;
use distc_ir::{Graph, Op};

pub use crate::core::axis::Axis;

/// A worker's place on the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coord {
    /// Its replica: its rank on the data axis.
    pub replica: usize,
    /// Its pipeline stage (0 without a pipeline).
    pub stage: usize,
    /// Its rank on the model axis (0 without one).
    pub model: usize,
}

/// The arrangement of a plan's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    /// Replicas D.
    pub data: usize,
    /// Pipeline stages P of a pipelined plan; `None` without a pipeline. A one-stage
    /// pipeline (`Some(1)`) still runs the stage loop.
    pub stages: Option<usize>,
    /// Model ranks T (1 without tensor parallelism).
    pub model: usize,
    /// Parameter servers S.
    pub servers: usize,
}

impl Mesh {
    /// The mesh of a plan's programs. Its workers must fill whole replicas: N workers of
    /// a pipeline of P stages T wide run N / (P T) replicas (one when N < P T).
    pub fn of(programs: &Programs<'_>) -> Result<Mesh> {
        let model = model_parts(programs.worker);
        let stages = programs.pipeline.map(|p| p.stages.len().max(1));
        let pipe = stages.unwrap_or(1);
        let servers = programs.servers.len();
        let n = programs.workers;
        if n == 0 {
            return Err(RuntimeError::plan("it has no workers"));
        }
        let data = match programs.pipeline {
            // A pipeline's workers count every model rank of every stage; fewer than
            // one pipeline's worth runs one replica.
            Some(_) => {
                if n > 1 && !n.is_multiple_of(pipe) {
                    return Err(RuntimeError::Config(format!(
                        "{n} workers cannot run replicas of {pipe} pipeline stages: give a \
                         multiple of {pipe}"
                    )));
                }
                let replicas = pipe * (n / pipe).max(1) / (pipe * model);
                if replicas == 0 {
                    return Err(RuntimeError::Config(format!(
                        "{n} workers cannot run one replica of {pipe} pipeline stages {model} \
                         model ranks wide"
                    )));
                }
                replicas
            }
            None => {
                if !n.is_multiple_of(model) {
                    return Err(RuntimeError::Config(format!(
                        "{n} workers cannot fill a model axis of {model}: give a multiple of \
                         {model}"
                    )));
                }
                n / model
            }
        };
        Ok(Mesh {
            data,
            stages,
            model,
            servers,
        })
    }

    /// The pipe axis's size: the stages, 1 without a pipeline.
    pub fn pipe(&self) -> usize {
        self.stages.unwrap_or(1)
    }

    /// Whether the plan is pipelined: its ranks run the stage loop.
    pub fn pipelined(&self) -> bool {
        self.stages.is_some()
    }

    /// Worker ranks: `D P T`.
    pub fn workers(&self) -> usize {
        self.data * self.pipe() * self.model
    }

    /// The rank-to-role mapping: workers, then servers.
    pub fn roles(&self) -> Roles {
        Roles {
            workers: self.workers(),
            servers: self.servers,
        }
    }

    /// Whether only the data axis is wider than one (no pipeline, no model axis).
    pub fn data_parallel_only(&self) -> bool {
        !self.pipelined() && self.model == 1
    }

    /// Worker `w`'s place.
    pub fn coord(&self, w: usize) -> Coord {
        let (t, p) = (self.model, self.pipe());
        Coord {
            replica: w / (t * p),
            stage: (w / t) % p,
            model: w % t,
        }
    }

    /// The worker at `c`.
    pub fn worker(&self, c: Coord) -> usize {
        (c.replica * self.pipe() + c.stage) * self.model + c.model
    }

    /// The axes a role of this mesh is linked on, in the order every rank links them:
    /// the data axis always (one replica's is a group of one), the pipe axis in a
    /// pipelined plan, the model axis where it is wider than one.
    pub fn axes(&self) -> Vec<Axis> {
        Axis::ALL
            .into_iter()
            .filter(|a| match a {
                Axis::Data => true,
                Axis::Pipe => self.pipelined(),
                Axis::Model => self.model > 1,
            })
            .collect()
    }

    /// The size of `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Data => self.data,
            Axis::Pipe => self.pipe(),
            Axis::Model => self.model,
        }
    }

    /// Groups `axis` splits the workers into: the product of the other two axes.
    pub fn groups(&self, axis: Axis) -> usize {
        self.workers() / self.size(axis)
    }

    /// Worker `w`'s group on `axis` (`0..groups(axis)`) and its rank inside it
    /// (`0..size(axis)`): the colour and key of an MPI split, the index of an
    /// in-process communicator and of its end.
    pub fn group(&self, axis: Axis, w: usize) -> (usize, usize) {
        let c = self.coord(w);
        let (t, p) = (self.model, self.pipe());
        match axis {
            Axis::Data => (c.stage * t + c.model, c.replica),
            Axis::Pipe => (c.replica * t + c.model, c.stage),
            Axis::Model => (c.replica * p + c.stage, c.model),
        }
    }

    /// Worker `w` by the axes the plan has: `worker 3`, `stage 2 of replica 1`,
    /// `model rank 1 of replica 0`, `stage 1 of replica 0, model rank 1`.
    pub fn name(&self, w: usize) -> String {
        let c = self.coord(w);
        let mut text = if self.pipelined() {
            if self.data > 1 {
                format!("stage {} of replica {}", c.stage, c.replica)
            } else {
                format!("stage {}", c.stage)
            }
        } else if self.model > 1 {
            format!("replica {}", c.replica)
        } else {
            return format!("worker {w}");
        };
        if self.model > 1 {
            text.push_str(&format!(", model rank {}", c.model));
        }
        text
    }

    /// What rank `rank` is, in words: a worker by its place, or a server.
    pub fn rank_name(&self, rank: usize) -> String {
        match self.roles().role(rank) {
            Some(Role::Worker(w)) => self.name(w),
            Some(Role::Server(s)) => format!("server {s}"),
            None => format!("rank {rank} (past the last of {})", self.roles().world()),
        }
    }

    /// The mapping, in words, for messages about a job's ranks:
    /// `2 replicas x 2 pipeline stages x 2 model ranks: worker w is model rank w % 2 of
    /// stage (w / 2) % 2 of replica w / 4`.
    pub fn describe(&self) -> String {
        let (d, p, t) = (self.data, self.pipe(), self.model);
        let plural = |n: usize, one: &str| {
            if n == 1 {
                format!("1 {one}")
            } else {
                format!("{n} {one}s")
            }
        };
        let mut axes = vec![plural(d, "replica")];
        if self.pipelined() {
            axes.push(plural(p, "pipeline stage"));
        }
        if t > 1 {
            axes.push(plural(t, "model rank"));
        }
        let mut places = Vec::new();
        if t > 1 {
            places.push(format!("model rank w % {t}"));
        }
        if self.pipelined() {
            places.push(match t {
                1 => format!("stage w % {p}"),
                _ => format!("stage (w / {t}) % {p}"),
            });
        }
        let tp = t * p;
        places.push(match tp {
            1 => "replica w".to_string(),
            _ => format!("replica w / {tp}"),
        });
        let servers = match self.servers {
            0 => String::new(),
            s => format!(
                "; ranks {}.. are the {}",
                self.workers(),
                plural(s, "server")
            ),
        };
        format!(
            "{}: worker w is {}{servers}",
            axes.join(" x "),
            places.join(" of ")
        )
    }
}

/// Workers on the model axis of a worker program: the largest `parts` of its `model_*`
/// ops (1 without tensor parallelism). [`Mesh::of`] is its one caller.
fn model_parts(worker: &Graph) -> usize {
    worker
        .node_ids()
        .into_iter()
        .filter_map(|id| match worker.op(id) {
            Op::ModelEnter { parts }
            | Op::ModelAllReduce { parts }
            | Op::ModelGather { parts, .. }
            | Op::ModelSplit { parts, .. }
            | Op::ModelReduceScatter { parts, .. } => Some(*parts),
            _ => None,
        })
        .max()
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(data: usize, pipe: usize, model: usize) -> Mesh {
        Mesh {
            data,
            stages: (pipe > 1).then_some(pipe),
            model,
            servers: 0,
        }
    }

    #[test]
    fn coordinates_and_ranks_are_inverse() {
        for m in [
            mesh(2, 1, 1),
            mesh(2, 1, 2),
            mesh(2, 3, 1),
            mesh(2, 2, 2),
            mesh(1, 4, 2),
        ] {
            let mut seen = std::collections::HashSet::new();
            for w in 0..m.workers() {
                let c = m.coord(w);
                assert!(c.replica < m.data && c.stage < m.pipe() && c.model < m.model);
                assert_eq!(m.worker(c), w, "{m:?} worker {w}");
                assert!(seen.insert((c.replica, c.stage, c.model)));
            }
        }
    }

    #[test]
    fn a_stage_model_ranks_are_neighbours() {
        let m = mesh(2, 2, 2);
        let c = |w| {
            let c = m.coord(w);
            (c.replica, c.stage, c.model)
        };
        assert_eq!(
            (0..8).map(c).collect::<Vec<_>>(),
            vec![
                (0, 0, 0),
                (0, 0, 1),
                (0, 1, 0),
                (0, 1, 1),
                (1, 0, 0),
                (1, 0, 1),
                (1, 1, 0),
                (1, 1, 1)
            ]
        );
    }

    #[test]
    fn each_axis_groups_the_workers_that_differ_only_along_it() {
        for m in [mesh(2, 1, 2), mesh(3, 2, 1), mesh(2, 2, 2), mesh(1, 3, 2)] {
            for axis in [Axis::Data, Axis::Pipe, Axis::Model] {
                let mut members = vec![Vec::new(); m.groups(axis)];
                for w in 0..m.workers() {
                    let (g, r) = m.group(axis, w);
                    assert!(r < m.size(axis), "{m:?} {axis:?} worker {w}");
                    members[g].push((r, w));
                }
                for group in &members {
                    assert_eq!(group.len(), m.size(axis), "{m:?} {axis:?}");
                    let ranks: Vec<usize> = group.iter().map(|(r, _)| *r).collect();
                    assert_eq!(
                        ranks,
                        (0..m.size(axis)).collect::<Vec<_>>(),
                        "{m:?} {axis:?}"
                    );
                    let first = m.coord(group[0].1);
                    for &(_, w) in group {
                        let c = m.coord(w);
                        let same = match axis {
                            Axis::Data => (c.stage, c.model) == (first.stage, first.model),
                            Axis::Pipe => (c.replica, c.model) == (first.replica, first.model),
                            Axis::Model => (c.replica, c.stage) == (first.replica, first.stage),
                        };
                        assert!(same, "{m:?} {axis:?}: worker {w} in the wrong group");
                    }
                }
            }
        }
    }

    #[test]
    fn names_say_only_the_axes_a_plan_has() {
        assert_eq!(mesh(4, 1, 1).name(3), "worker 3");
        assert_eq!(mesh(1, 3, 1).name(2), "stage 2");
        assert_eq!(mesh(2, 3, 1).name(5), "stage 2 of replica 1");
        assert_eq!(mesh(2, 1, 2).name(3), "replica 1, model rank 1");
        assert_eq!(mesh(2, 2, 2).name(5), "stage 0 of replica 1, model rank 1");
        let mut m = mesh(2, 1, 1);
        m.servers = 2;
        assert_eq!(m.rank_name(3), "server 1");
    }

    #[test]
    fn the_mapping_in_words_names_every_axis() {
        assert_eq!(
            mesh(2, 2, 2).describe(),
            "2 replicas x 2 pipeline stages x 2 model ranks: worker w is model rank w % 2 \
             of stage (w / 2) % 2 of replica w / 4"
        );
        assert_eq!(
            mesh(1, 2, 2).describe(),
            "1 replica x 2 pipeline stages x 2 model ranks: worker w is model rank w % 2 of \
             stage (w / 2) % 2 of replica w / 4"
        );
        assert_eq!(
            mesh(3, 2, 1).describe(),
            "3 replicas x 2 pipeline stages: worker w is stage w % 2 of replica w / 2"
        );
        assert_eq!(
            mesh(4, 1, 1).describe(),
            "4 replicas: worker w is replica w"
        );
    }
}
