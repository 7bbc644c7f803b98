//! The distc intermediate representation.
//!
//! A [`Graph`] of [`Op`]s over static [`TensorType`]s, with a row-sparse
//! `IndexedSlices` value type for the gradients of embedding lookups. Every graph
//! prints to text ([`print()`]) and parses back ([`parse()`]) to an equal graph;
//! the [`verify()`] function checks the invariants after each pass.
#![deny(missing_docs)]

pub mod attrs;
pub mod dot;
pub mod fused;
mod fused_grad;
pub mod graph;
pub mod op;
pub mod parse;
pub mod pipeline;
pub mod print;
pub mod shape;
pub mod types;
pub mod verify;

pub use graph::{Graph, GraphError, Node, NodeId, ValueId, LOSS_SCALE};

/// The suffix of the variable holding a worker's ZeRO shard of variable `w` (`w.zero`):
/// the zero pass names shards so, and the runtime finds them so when it writes or
/// resumes a training state.
pub const ZERO_SHARD_SUFFIX: &str = ".zero";
/// How a tensor-parallel variable's local part is named: `w` is held as `w.tp`.
pub const MODEL_SHARD_SUFFIX: &str = ".tp";

/// The one-device variable a worker's variable holds (part of): `w` for `w`, its
/// ZeRO chunk `w.zero`, its model-axis part `w.tp` and a chunk of that, `w.tp.zero`.
pub fn whole_variable(name: &str) -> &str {
    let name = name.strip_suffix(ZERO_SHARD_SUFFIX).unwrap_or(name);
    name.strip_suffix(MODEL_SHARD_SUFFIX).unwrap_or(name)
}
/// The most workers a collective of the IR may name (the compiler's limit on
/// `--workers`).
pub const MAX_WORKERS: usize = 1 << 20;
pub use fused::{BinaryFn, FusedExpr, FusedStep, UnaryFn};
pub use fused_grad::InputGradient;
pub use op::{Init, Op, ReduceOp};
pub use parse::{parse, ParseError};
pub use print::print;
pub use shape::{infer, ShapeError};
pub use types::{DType, Shape, TensorType, ValueType, MAX_ELEMENTS};
pub use verify::{verify, VerifyError};
