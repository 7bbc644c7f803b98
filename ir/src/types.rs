//! Static tensor types: a dtype and a shape, and the row-sparse `IndexedSlices` type.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// 32-bit float, the training dtype.
    F32,
    /// 64-bit float, used by gradient checks to make finite differences meaningful.
    F64,
    /// 32-bit signed integer: ids and labels.
    I32,
    /// bfloat16: f32's exponent range, 8 bits of mantissa (mixed precision).
    BF16,
    /// IEEE half precision: 5 exponent bits, 11 of mantissa (mixed precision, with
    /// loss scaling).
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 => 8,
        }
    }
    /// Whether values of this type carry gradients.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }
    /// Whether a 16-bit float (computed in f32 inside a kernel, stored in 16 bits).
    pub fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }
    /// The spelling in the text IR and the DSL.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
    /// Parses `f32`, `f64`, `i32`, `bf16` or `f16`.
    pub fn from_name(s: &str) -> Option<DType> {
        match s {
            "f32" => Some(DType::F32),
            "f64" => Some(DType::F64),
            "i32" => Some(DType::I32),
            "bf16" => Some(DType::BF16),
            "f16" => Some(DType::F16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A static shape; the batch dimension is bound to a number at compile time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape(pub Vec<usize>);

/// The most elements one tensor of the IR may hold (2^48, 1 PiB of f32): far beyond any
/// model, and far enough from `usize::MAX` that byte counts and sums of them never
/// overflow.
pub const MAX_ELEMENTS: usize = 1 << 48;

impl Shape {
    /// Refuses a shape of more than [`MAX_ELEMENTS`] elements (a damaged or hostile
    /// text IR would otherwise overflow every size computed from it).
    pub fn check_size(dims: &[usize]) -> Result<(), String> {
        let mut n: usize = 1;
        for &d in dims {
            n = match n.checked_mul(d) {
                Some(n) if n <= MAX_ELEMENTS => n,
                _ => return Err(format!("the shape {dims:?} has more than 2^48 elements")),
            };
        }
        Ok(())
    }

    /// The shape of a scalar.
    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Shape {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Shape {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// A dense tensor type.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
}

impl TensorType {
    /// A tensor type from a dtype and dimensions.
    pub fn new(dtype: DType, dims: impl Into<Shape>) -> TensorType {
        TensorType {
            dtype,
            shape: dims.into(),
        }
    }
    /// An f32 tensor type.
    pub fn f32(dims: impl Into<Shape>) -> TensorType {
        TensorType::new(DType::F32, dims)
    }
    /// An i32 tensor type.
    pub fn i32(dims: impl Into<Shape>) -> TensorType {
        TensorType::new(DType::I32, dims)
    }
    /// Bytes of one tensor of this type.
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size()
    }
    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.shape.0
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

/// The type of one value (one output port of a node).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ValueType {
    /// A dense tensor.
    Tensor(TensorType),
    /// A row-sparse tensor: row indices (i32) and values of shape `[rows, dense.dims[1..]]`
    /// standing for a dense tensor of type `dense` that is zero outside those rows.
    /// Indices may repeat; repeated rows add up. `nnz` is the most rows a value of this
    /// type carries: exact for a lookup's gradient, a bound after `unique_rows` or an
    /// all-gather of such rows.
    IndexedSlices {
        /// The dense tensor this stands for.
        dense: TensorType,
        /// Most rows carried (with repeats).
        nnz: usize,
    },
}

impl ValueType {
    /// The dense tensor type, if this is a dense tensor.
    pub fn tensor(&self) -> Option<&TensorType> {
        match self {
            ValueType::Tensor(t) => Some(t),
            ValueType::IndexedSlices { .. } => None,
        }
    }
    /// The dense type this value stands for (itself for a tensor).
    pub fn dense_type(&self) -> &TensorType {
        match self {
            ValueType::Tensor(t) => t,
            ValueType::IndexedSlices { dense, .. } => dense,
        }
    }
    /// Whether this is an `IndexedSlices` value.
    pub fn is_sparse(&self) -> bool {
        matches!(self, ValueType::IndexedSlices { .. })
    }
    /// Bytes this value occupies (indices and values for slices).
    pub fn bytes(&self) -> usize {
        match self {
            ValueType::Tensor(t) => t.bytes(),
            ValueType::IndexedSlices { dense, nnz } => {
                let row: usize = dense.dims().iter().skip(1).product();
                nnz * 4 + nnz * row * dense.dtype.size()
            }
        }
    }
}

impl From<TensorType> for ValueType {
    fn from(t: TensorType) -> ValueType {
        ValueType::Tensor(t)
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueType::Tensor(t) => write!(f, "{t}"),
            ValueType::IndexedSlices { dense, nnz } => {
                write!(f, "indexed_slices({dense}, nnz={nnz})")
            }
        }
    }
}
