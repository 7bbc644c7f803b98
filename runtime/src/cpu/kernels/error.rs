//! What a CPU kernel refuses, as [`CpuKernelError`]: the facts of each refusal (the
//! shapes, the dtype, the axis, the index), spelled as the kernels have always
//! spelled them, so a message reads the same whether it is matched as a variant or as
//! text.
//!
//! The executor sees a kernel's failure as [`KernelError::Invalid`], by the `From`
//! impl here: the core sits below the CPU layer and names no CPU type (see the crate
//! doc's layer table), and what it adds is the node, not the kernel's facts, so the
//! message is what crosses.

use super::shape_str;
use crate::core::backend::KernelError;
use distc_ir::{DType, TensorType};
use ndarray::ShapeError;
use thiserror::Error;

/// Why a CPU kernel did not run: inputs it cannot work on (a pass bug or a
/// hand-edited plan). The executor adds the node.
#[derive(Debug, Error)]
pub enum CpuKernelError {
    /// The op takes another number of inputs.
    #[error("takes {want} inputs, got {got}")]
    Arity {
        /// The inputs the op takes.
        want: usize,
        /// The inputs it was given.
        got: usize,
    },
    /// An op of any arity was given none.
    #[error("takes at least one input, got none")]
    NoInputs,
    /// An input is `IndexedSlices` where the kernel reads a dense tensor.
    #[error("input {input} is {found}, a dense tensor is needed")]
    NotDense {
        /// The input's position.
        input: usize,
        /// Its type, as the IR spells it.
        found: String,
    },
    /// An input is a dense tensor where the kernel reads `IndexedSlices`.
    #[error("input {input} is {found}, IndexedSlices are needed")]
    NotSlices {
        /// The input's position.
        input: usize,
        /// Its type, as the IR spells it.
        found: String,
    },
    /// A dense input's element type is not the one the kernel computes in.
    #[error("input {input} is {found}, {want} is needed")]
    DType {
        /// The input's position.
        input: usize,
        /// Its type, as the IR spells it.
        found: String,
        /// The element type the kernel computes in.
        want: DType,
    },
    /// The values of a slices input are not of the element type the kernel computes in.
    #[error("input {input} is {found}, {want} values are needed")]
    ValuesDType {
        /// The input's position.
        input: usize,
        /// Its type, as the IR spells it.
        found: String,
        /// The element type the kernel computes in.
        want: DType,
    },
    /// A float kernel was given integers.
    #[error("needs float tensors, got {0}")]
    NotFloat(DType),
    /// A 16-bit input reached a kernel without being widened to f32 first.
    #[error("{0} reached a kernel uncast")]
    Uncast(DType),
    /// A `cast` the tensor cannot make.
    #[error("cannot cast {from} to {to}")]
    Cast {
        /// The tensor's type.
        from: TensorType,
        /// The element type asked for.
        to: DType,
    },
    /// Two shapes that do not agree as `check` needs them to.
    #[error("{}", .check.message(.left, .right))]
    Shapes {
        /// The rule they break.
        check: ShapeCheck,
        /// The first shape the rule names.
        left: Vec<usize>,
        /// The second.
        right: Vec<usize>,
    },
    /// One shape the kernel cannot work on.
    #[error("{}", .need.message(.shape))]
    Shape {
        /// What the kernel needs of it.
        need: ShapeNeed,
        /// The shape.
        shape: Vec<usize>,
    },
    /// The three inputs of an attention do not fit together.
    #[error(
        "q {}, k {} and v {} do not make an attention ([.., Tq, D], [.., Tk, D], [.., Tk, Dv])",
        shape_str(.q),
        shape_str(.k),
        shape_str(.v)
    )]
    Attention {
        /// The queries' shape.
        q: Vec<usize>,
        /// The keys'.
        k: Vec<usize>,
        /// The values'.
        v: Vec<usize>,
    },
    /// A lookup's result gradient is not the ids' shape followed by a table row's.
    #[error(
        "dy is {}, expected {} for ids {} into {table}",
        shape_str(.dy),
        shape_str(.want),
        shape_str(.ids)
    )]
    LookupGrad {
        /// The gradient's shape.
        dy: Vec<usize>,
        /// The shape the lookup gives.
        want: Vec<usize>,
        /// The ids' shape.
        ids: Vec<usize>,
        /// The table.
        table: TensorType,
    },
    /// An axis the input does not have.
    #[error("axis {axis} is out of range for {}", shape_str(.shape))]
    Axis {
        /// The axis.
        axis: usize,
        /// The input's shape.
        shape: Vec<usize>,
    },
    /// A slice range that is empty or past the end of its axis (or an axis the input
    /// does not have).
    #[error(
        "range {start}..{end} is empty or outside axis {axis} of {}",
        shape_str(.shape)
    )]
    Range {
        /// The axis sliced.
        axis: usize,
        /// The first index kept.
        start: usize,
        /// One past the last.
        end: usize,
        /// The input's shape.
        shape: Vec<usize>,
    },
    /// An id, label or row index outside what it indexes.
    #[error("{}", .of.message(*.index, *.position))]
    Index {
        /// The index.
        index: i32,
        /// Its position among the ids (the sample, for a label).
        position: usize,
        /// What it indexes.
        of: IndexOf,
    },
    /// An array the kernel reads as a flat slice is not one (a kernel bug: arrays in
    /// standard layout are).
    #[error("{0} is not contiguous")]
    NotContiguous(&'static str),
    /// ndarray refused a shape the kernel built, named by what it was for.
    #[error("{what} {}: {error}", shape_str(.shape))]
    Layout {
        /// What the array was for (`reshape to`, `slices values`).
        what: &'static str,
        /// The shape asked for.
        shape: Vec<usize>,
        /// ndarray's reason.
        error: ShapeError,
    },
    /// ndarray refused a shape the kernel built.
    #[error(transparent)]
    Ndarray(#[from] ShapeError),
    /// Anything else the kernel refuses (an attribute out of range, an expression or
    /// a geometry that does not fit, an op that is not a kernel's).
    #[error("{0}")]
    Invalid(String),
}

impl CpuKernelError {
    /// What a kernel says when ndarray refuses the array of `shape` it built for
    /// `what`: for `map_err`.
    pub fn layout<'a>(
        what: &'static str,
        shape: &'a [usize],
    ) -> impl FnOnce(ShapeError) -> Self + 'a {
        move |error| CpuKernelError::Layout {
            what,
            shape: shape.to_vec(),
            error,
        }
    }
}

impl From<CpuKernelError> for KernelError {
    /// The message, for the executor to place at its node.
    fn from(e: CpuKernelError) -> KernelError {
        KernelError::Invalid(e.to_string())
    }
}

/// How two shapes must agree (see [`CpuKernelError::Shapes`]); each rule's message
/// names `left` first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShapeCheck {
    /// Two operands broadcast together.
    Broadcast,
    /// Input `i` of a fused node (`left`) broadcasts with the shape of the inputs before
    /// it (`right`).
    FusedBroadcast(usize),
    /// `left` broadcasts to `right`.
    BroadcastTo,
    /// `left` sums down to `right` over broadcast axes.
    SumTo,
    /// Equal shapes.
    Same,
    /// Equal shapes, the inputs named (`dy` and `y`).
    SameNamed(&'static str, &'static str),
    /// A prediction and its target have one shape.
    Target,
    /// `dy` (`left`) has the shape the forward op (named) gives (`right`).
    Gradient(&'static str),
    /// Concatenated inputs agree outside the axis joined.
    OutsideAxis(usize),
    /// Matmul operands have rank 2 or more.
    MatmulRank,
    /// Matmul operands' inner dimensions (`k` of the left, `k2` of the right, each
    /// side transposed or not) are equal.
    MatmulInner {
        /// The left operand is transposed.
        ta: bool,
        /// The right operand is transposed.
        tb: bool,
        /// The left operand's inner dimension.
        k: usize,
        /// The right operand's.
        k2: usize,
    },
    /// Matmul operands' batch dimensions broadcast together.
    MatmulBatch,
    /// Layer norm's `gamma` and `beta` (`right`) are `[d]` for `x` (`left`).
    LayerNormParams(usize),
    /// Labels (`right`) are `i32[b]` for `[b, classes]` logits (`left`).
    Labels(usize),
    /// A row mask (`left`) has one element per row of the tensor (`right`).
    Mask,
    /// Slices joined (input `i`, `left`) stand for one dense shape (input 0's, `right`).
    DenseShape(usize),
    /// A reshape keeps the element count.
    Reshape,
}

impl ShapeCheck {
    /// The message for `left` and `right` breaking this rule.
    fn message(self, left: &[usize], right: &[usize]) -> String {
        let (l, r) = (shape_str(left), shape_str(right));
        match self {
            ShapeCheck::Broadcast => format!("shapes {l} and {r} do not broadcast"),
            ShapeCheck::FusedBroadcast(i) => format!("input {i} ({l}) does not broadcast with {r}"),
            ShapeCheck::BroadcastTo => format!("{l} does not broadcast to {r}"),
            ShapeCheck::SumTo => format!("{l} cannot be summed down to {r}"),
            ShapeCheck::Same => format!("shapes differ: {l} and {r}"),
            ShapeCheck::SameNamed(a, b) => format!("shapes differ: {a} {l} and {b} {r}"),
            ShapeCheck::Target => format!("prediction {l} and target {r} differ in shape"),
            ShapeCheck::Gradient(op) => format!("dy is {l}, the {op} gives {r}"),
            ShapeCheck::OutsideAxis(axis) => format!("{l} and {r} differ outside axis {axis}"),
            ShapeCheck::MatmulRank => {
                format!("needs operands of rank 2 or more, got {l} and {r}")
            }
            ShapeCheck::MatmulInner { ta, tb, k, k2 } => format!(
                "inner dimensions differ: {l}{} @ {r}{} ({k} vs {k2})",
                if ta { "ᵀ" } else { "" },
                if tb { "ᵀ" } else { "" },
            ),
            ShapeCheck::MatmulBatch => format!("batch dimensions of {l} @ {r} do not broadcast"),
            ShapeCheck::LayerNormParams(d) => {
                format!("gamma and beta must be [{d}] for {l}, got {r}")
            }
            ShapeCheck::Labels(b) => format!("labels must be i32[{b}] for logits {l}, got {r}"),
            ShapeCheck::Mask => format!("the mask {l} must have one element per row of {r}"),
            ShapeCheck::DenseShape(i) => format!("input {i} stands for {l}, input 0 for {r}"),
            ShapeCheck::Reshape => format!(
                "cannot reshape {l} ({} elements) to {r} ({} elements)",
                left.iter().product::<usize>(),
                right.iter().product::<usize>()
            ),
        }
    }
}

/// What a kernel needs of one shape (see [`CpuKernelError::Shape`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeNeed {
    /// At least this rank.
    Rank(usize),
    /// An embedding table of rank 2 or more.
    TableRank,
    /// Logits `[batch, classes]`.
    Logits,
    /// An image batch `[N,C,H,W]`.
    Image,
    /// Room for a pooling window.
    Window {
        /// The window's side.
        kernel: usize,
        /// Its stride.
        stride: usize,
    },
    /// Input `i` is a scalar.
    Scalar(usize),
    /// A permutation of the axes (each once, each in range).
    Permutation(Vec<usize>),
    /// A permutation as long as the rank.
    PermutationLength(Vec<usize>),
}

impl ShapeNeed {
    /// The message for `shape` not being what this asks.
    fn message(&self, shape: &[usize]) -> String {
        let s = shape_str(shape);
        match self {
            ShapeNeed::Rank(r) => format!("needs rank {r} or more, got {s}"),
            ShapeNeed::TableRank => format!("the table must have rank 2 or more, got {s}"),
            ShapeNeed::Logits => format!("logits must be [batch, classes], got {s}"),
            ShapeNeed::Image => format!("needs x [N,C,H,W], got {s}"),
            ShapeNeed::Window { kernel, stride } => {
                format!("window {kernel} stride {stride} does not fit {s}")
            }
            ShapeNeed::Scalar(i) => format!("input {i} must be a scalar, got {s}"),
            ShapeNeed::Permutation(perm) => {
                format!("{perm:?} is not a permutation of the axes of {s}")
            }
            ShapeNeed::PermutationLength(perm) => {
                format!("permutation {perm:?} does not fit {s}")
            }
        }
    }
}

/// What an index indexes (see [`CpuKernelError::Index`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexOf {
    /// An embedding table's rows (an id).
    TableRows(usize),
    /// The classes of a cross-entropy (a label; the position is its sample).
    Classes(usize),
    /// The rows of the dense tensor `IndexedSlices` stand for (its dense shape).
    Rows(Vec<usize>),
    /// Nothing negative (an id of a split table).
    NonNegative,
}

impl IndexOf {
    /// The message for `index` (at `position`) being outside this.
    fn message(&self, index: i32, position: usize) -> String {
        match self {
            IndexOf::TableRows(rows) => {
                format!("id {index} (position {position}) is outside the table's {rows} rows")
            }
            IndexOf::Classes(k) => {
                format!("label {index} (sample {position}) is outside the {k} classes")
            }
            IndexOf::Rows(dense) => format!(
                "index {index} (position {position}) is outside the {} rows of {}",
                dense.first().copied().unwrap_or(0),
                shape_str(dense)
            ),
            IndexOf::NonNegative => format!("id {index} (position {position}) is negative"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each refusal spells what the kernels spelled as strings before they had a type
    /// (tests across the workspace match parts of these messages).
    #[test]
    fn every_refusal_reads_as_it_did() {
        let shapes = |check, left: &[usize], right: &[usize]| CpuKernelError::Shapes {
            check,
            left: left.to_vec(),
            right: right.to_vec(),
        };
        let shape = |need, shape: &[usize]| CpuKernelError::Shape {
            need,
            shape: shape.to_vec(),
        };
        let index = |index, position, of| CpuKernelError::Index {
            index,
            position,
            of,
        };
        let layout_error = ndarray::Array1::<f32>::zeros(3)
            .into_shape_with_order(2)
            .expect_err("3 elements do not make 2");
        let cases: Vec<(CpuKernelError, String)> = vec![
            (
                CpuKernelError::Arity { want: 2, got: 3 },
                "takes 2 inputs, got 3".into(),
            ),
            (
                CpuKernelError::NoInputs,
                "takes at least one input, got none".into(),
            ),
            (
                CpuKernelError::NotDense {
                    input: 1,
                    found: "slices<f32[4,2]; 3 rows>".into(),
                },
                "input 1 is slices<f32[4,2]; 3 rows>, a dense tensor is needed".into(),
            ),
            (
                CpuKernelError::NotSlices {
                    input: 0,
                    found: "f32[4,2]".into(),
                },
                "input 0 is f32[4,2], IndexedSlices are needed".into(),
            ),
            (
                CpuKernelError::DType {
                    input: 1,
                    found: "f64[2]".into(),
                    want: DType::F32,
                },
                "input 1 is f64[2], f32 is needed".into(),
            ),
            (
                CpuKernelError::ValuesDType {
                    input: 0,
                    found: "x".into(),
                    want: DType::F64,
                },
                "input 0 is x, f64 values are needed".into(),
            ),
            (
                CpuKernelError::NotFloat(DType::I32),
                "needs float tensors, got i32".into(),
            ),
            (
                CpuKernelError::Uncast(DType::BF16),
                "bf16 reached a kernel uncast".into(),
            ),
            (
                CpuKernelError::Cast {
                    from: TensorType::f32(vec![2]),
                    to: DType::I32,
                },
                format!("cannot cast {} to i32", TensorType::f32(vec![2])),
            ),
            (
                shapes(ShapeCheck::Broadcast, &[2], &[3]),
                "shapes [2] and [3] do not broadcast".into(),
            ),
            (
                shapes(ShapeCheck::FusedBroadcast(1), &[3], &[2]),
                "input 1 ([3]) does not broadcast with [2]".into(),
            ),
            (
                shapes(ShapeCheck::BroadcastTo, &[2], &[3]),
                "[2] does not broadcast to [3]".into(),
            ),
            (
                shapes(ShapeCheck::SumTo, &[2, 3], &[2]),
                "[2,3] cannot be summed down to [2]".into(),
            ),
            (
                shapes(ShapeCheck::Same, &[2], &[3]),
                "shapes differ: [2] and [3]".into(),
            ),
            (
                shapes(ShapeCheck::SameNamed("dy", "y"), &[2], &[3]),
                "shapes differ: dy [2] and y [3]".into(),
            ),
            (
                shapes(ShapeCheck::Target, &[2], &[3]),
                "prediction [2] and target [3] differ in shape".into(),
            ),
            (
                shapes(ShapeCheck::Gradient("pool"), &[2], &[3]),
                "dy is [2], the pool gives [3]".into(),
            ),
            (
                shapes(ShapeCheck::OutsideAxis(1), &[2, 3], &[4, 3]),
                "[2,3] and [4,3] differ outside axis 1".into(),
            ),
            (
                shapes(ShapeCheck::MatmulRank, &[2], &[2, 3]),
                "needs operands of rank 2 or more, got [2] and [2,3]".into(),
            ),
            (
                shapes(
                    ShapeCheck::MatmulInner {
                        ta: true,
                        tb: false,
                        k: 2,
                        k2: 4,
                    },
                    &[2, 3],
                    &[4, 5],
                ),
                "inner dimensions differ: [2,3]ᵀ @ [4,5] (2 vs 4)".into(),
            ),
            (
                shapes(ShapeCheck::MatmulBatch, &[2, 1, 1], &[3, 1, 1]),
                "batch dimensions of [2,1,1] @ [3,1,1] do not broadcast".into(),
            ),
            (
                shapes(ShapeCheck::LayerNormParams(4), &[2, 4], &[3]),
                "gamma and beta must be [4] for [2,4], got [3]".into(),
            ),
            (
                shapes(ShapeCheck::Labels(2), &[2, 5], &[3]),
                "labels must be i32[2] for logits [2,5], got [3]".into(),
            ),
            (
                shapes(ShapeCheck::Mask, &[3], &[2, 4]),
                "the mask [3] must have one element per row of [2,4]".into(),
            ),
            (
                shapes(ShapeCheck::DenseShape(1), &[5, 2], &[4, 2]),
                "input 1 stands for [5,2], input 0 for [4,2]".into(),
            ),
            (
                shapes(ShapeCheck::Reshape, &[2, 3], &[4]),
                "cannot reshape [2,3] (6 elements) to [4] (4 elements)".into(),
            ),
            (
                shape(ShapeNeed::Rank(1), &[]),
                "needs rank 1 or more, got []".into(),
            ),
            (
                shape(ShapeNeed::TableRank, &[4]),
                "the table must have rank 2 or more, got [4]".into(),
            ),
            (
                shape(ShapeNeed::Logits, &[4]),
                "logits must be [batch, classes], got [4]".into(),
            ),
            (
                shape(ShapeNeed::Image, &[4]),
                "needs x [N,C,H,W], got [4]".into(),
            ),
            (
                shape(
                    ShapeNeed::Window {
                        kernel: 3,
                        stride: 1,
                    },
                    &[1, 1, 2, 2],
                ),
                "window 3 stride 1 does not fit [1,1,2,2]".into(),
            ),
            (
                shape(ShapeNeed::Scalar(0), &[2]),
                "input 0 must be a scalar, got [2]".into(),
            ),
            (
                shape(ShapeNeed::Permutation(vec![0, 0]), &[2, 3]),
                "[0, 0] is not a permutation of the axes of [2,3]".into(),
            ),
            (
                shape(ShapeNeed::PermutationLength(vec![0]), &[2, 3]),
                "permutation [0] does not fit [2,3]".into(),
            ),
            (
                CpuKernelError::Attention {
                    q: vec![2, 3],
                    k: vec![2, 4],
                    v: vec![2, 3],
                },
                "q [2,3], k [2,4] and v [2,3] do not make an attention ([.., Tq, D], \
                 [.., Tk, D], [.., Tk, Dv])"
                    .into(),
            ),
            (
                CpuKernelError::LookupGrad {
                    dy: vec![3],
                    want: vec![3, 2],
                    ids: vec![3],
                    table: TensorType::f32(vec![5, 2]),
                },
                format!(
                    "dy is [3], expected [3,2] for ids [3] into {}",
                    TensorType::f32(vec![5, 2])
                ),
            ),
            (
                CpuKernelError::Axis {
                    axis: 2,
                    shape: vec![2, 3],
                },
                "axis 2 is out of range for [2,3]".into(),
            ),
            (
                CpuKernelError::Range {
                    axis: 0,
                    start: 1,
                    end: 4,
                    shape: vec![3],
                },
                "range 1..4 is empty or outside axis 0 of [3]".into(),
            ),
            (
                index(4, 1, IndexOf::TableRows(4)),
                "id 4 (position 1) is outside the table's 4 rows".into(),
            ),
            (
                index(3, 0, IndexOf::Classes(3)),
                "label 3 (sample 0) is outside the 3 classes".into(),
            ),
            (
                index(-1, 2, IndexOf::Rows(vec![4, 2])),
                "index -1 (position 2) is outside the 4 rows of [4,2]".into(),
            ),
            (
                index(-1, 0, IndexOf::NonNegative),
                "id -1 (position 0) is negative".into(),
            ),
            (
                CpuKernelError::NotContiguous("packed buffer"),
                "packed buffer is not contiguous".into(),
            ),
            (
                CpuKernelError::Layout {
                    what: "reshape to",
                    shape: vec![2],
                    error: layout_error.clone(),
                },
                format!("reshape to [2]: {layout_error}"),
            ),
            (
                CpuKernelError::Ndarray(layout_error.clone()),
                layout_error.to_string(),
            ),
            (
                CpuKernelError::Invalid("no workers".into()),
                "no workers".into(),
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want, "{e:?}");
        }
    }

    #[test]
    fn the_executor_sees_the_message() {
        let e = KernelError::from(CpuKernelError::NoInputs);
        assert!(matches!(&e, KernelError::Invalid(m) if m == "takes at least one input, got none"));
    }
}
