//! The axes of a run's mesh, named below every layer that links or keys by them: the
//! transports link one communicator per axis, a role holds its communicators keyed by
//! axis ([`crate::comm::AxisComms`]), a device backend its device communicators. A new
//! axis is a variant here and an entry wherever an axis is matched.

/// An axis of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Axis {
    /// Replicas of the model (data parallelism).
    Data,
    /// Pipeline stages.
    Pipe,
    /// Model ranks (tensor parallelism).
    Model,
}

impl Axis {
    /// Every axis, in the order every rank links them.
    pub const ALL: [Axis; 3] = [Axis::Data, Axis::Pipe, Axis::Model];

    /// Its place in [`Axis::ALL`]: the index of per-axis arrays.
    pub fn index(self) -> usize {
        match self {
            Axis::Data => 0,
            Axis::Pipe => 1,
            Axis::Model => 2,
        }
    }

    /// The axis a collective op runs over: the model axis's ops (`model_*`), else the
    /// data axis (a pipeline's messages are not collectives).
    pub fn of_collective(op: &distc_ir::Op) -> Axis {
        if op.is_model_collective() {
            Axis::Model
        } else {
            Axis::Data
        }
    }

    /// Its name in messages: `data`, `pipe`, `model`.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Data => "data",
            Axis::Pipe => "pipe",
            Axis::Model => "model",
        }
    }
}
