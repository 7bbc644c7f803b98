//! Runtime values: dense tensors (ndarray) and row-sparse `IndexedSlices`.

use distc_ir::{DType, Shape, TensorType, ValueType};
use ndarray::{ArrayD, IxDyn};
use serde::{Deserialize, Serialize};

/// `$body` on the array of a tensor `$t` of any dtype, as a tensor of that dtype.
macro_rules! each_dtype {
    ($t:expr, $a:ident => $body:expr) => {
        match $t {
            $crate::core::value::Tensor::F32($a) => $crate::core::value::Tensor::F32($body),
            $crate::core::value::Tensor::F64($a) => $crate::core::value::Tensor::F64($body),
            $crate::core::value::Tensor::I32($a) => $crate::core::value::Tensor::I32($body),
            $crate::core::value::Tensor::BF16($a) => $crate::core::value::Tensor::BF16($body),
            $crate::core::value::Tensor::F16($a) => $crate::core::value::Tensor::F16($body),
        }
    };
}
pub(crate) use each_dtype;

/// A dense tensor of one of the IR's dtypes.
#[derive(Clone, Debug, PartialEq)]
pub enum Tensor {
    /// f32 elements.
    F32(ArrayD<f32>),
    /// f64 elements (gradient checks).
    F64(ArrayD<f64>),
    /// i32 elements (ids, labels).
    I32(ArrayD<i32>),
    /// bfloat16 elements (mixed precision; kernels compute in f32).
    BF16(ArrayD<half::bf16>),
    /// IEEE half elements (mixed precision; kernels compute in f32).
    F16(ArrayD<half::f16>),
}

impl Tensor {
    /// A one-dimensional f64 tensor of `values`.
    pub fn vector_f64(values: Vec<f64>) -> Tensor {
        Tensor::F64(ndarray::Array1::from_vec(values).into_dyn())
    }

    /// A tensor of type `ty` with every element `value` (a `constant` node).
    pub fn filled(ty: &TensorType, value: f64) -> Tensor {
        let dim = IxDyn(ty.dims());
        match ty.dtype {
            DType::F32 => Tensor::F32(ArrayD::from_elem(dim, value as f32)),
            DType::F64 => Tensor::F64(ArrayD::from_elem(dim, value)),
            DType::I32 => Tensor::I32(ArrayD::from_elem(dim, value as i32)),
            DType::BF16 => Tensor::BF16(ArrayD::from_elem(dim, half::bf16::from_f64(value))),
            DType::F16 => Tensor::F16(ArrayD::from_elem(dim, half::f16::from_f64(value))),
        }
    }
    /// A tensor of zeros of type `t`.
    pub fn zeros(t: &TensorType) -> Tensor {
        let shape = IxDyn(t.dims());
        match t.dtype {
            DType::F32 => Tensor::F32(ArrayD::zeros(shape)),
            DType::F64 => Tensor::F64(ArrayD::zeros(shape)),
            DType::I32 => Tensor::I32(ArrayD::zeros(shape)),
            DType::BF16 => Tensor::BF16(ArrayD::from_elem(shape, half::bf16::ZERO)),
            DType::F16 => Tensor::F16(ArrayD::from_elem(shape, half::f16::ZERO)),
        }
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::F32(_) => DType::F32,
            Tensor::F64(_) => DType::F64,
            Tensor::I32(_) => DType::I32,
            Tensor::BF16(_) => DType::BF16,
            Tensor::F16(_) => DType::F16,
        }
    }
    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        match self {
            Tensor::F32(a) => a.shape(),
            Tensor::F64(a) => a.shape(),
            Tensor::I32(a) => a.shape(),
            Tensor::BF16(a) => a.shape(),
            Tensor::F16(a) => a.shape(),
        }
    }
    /// The IR type of this tensor.
    pub fn tensor_type(&self) -> TensorType {
        TensorType::new(self.dtype(), Shape(self.shape().to_vec()))
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }
    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes of payload.
    pub fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }
    /// Chunk `rank` of `workers` of the flattened tensor, `ceil(len / workers)`
    /// elements, the last zero-padded: what the `take_chunk` op makes.
    pub fn chunk(&self, workers: usize, rank: usize) -> Tensor {
        fn cut<A: Clone + num_traits::Zero>(
            a: &ArrayD<A>,
            workers: usize,
            rank: usize,
        ) -> ArrayD<A> {
            let n = a.len();
            let c = n.div_ceil(workers.max(1));
            let mut out = vec![A::zero(); c];
            let (start, end) = ((rank * c).min(n), ((rank + 1) * c).min(n));
            for (o, v) in out.iter_mut().zip(a.iter().skip(start).take(end - start)) {
                *o = v.clone();
            }
            ArrayD::from_shape_vec(IxDyn(&[c]), out).unwrap_or_else(|_| ArrayD::zeros(IxDyn(&[0])))
        }
        match self {
            Tensor::F32(a) => Tensor::F32(cut(a, workers, rank)),
            Tensor::F64(a) => Tensor::F64(cut(a, workers, rank)),
            Tensor::I32(a) => Tensor::I32(cut(a, workers, rank)),
            Tensor::BF16(a) => Tensor::BF16(cut(a, workers, rank)),
            Tensor::F16(a) => Tensor::F16(cut(a, workers, rank)),
        }
    }
    /// The f32 array, if this is f32.
    pub fn as_f32(&self) -> Option<&ArrayD<f32>> {
        match self {
            Tensor::F32(a) => Some(a),
            _ => None,
        }
    }
    /// The i32 array, if this is i32.
    pub fn as_i32(&self) -> Option<&ArrayD<i32>> {
        match self {
            Tensor::I32(a) => Some(a),
            _ => None,
        }
    }
    /// The f64 array, if this is f64.
    pub fn as_f64(&self) -> Option<&ArrayD<f64>> {
        match self {
            Tensor::F64(a) => Some(a),
            _ => None,
        }
    }
    /// The elements as f64, row-major (any dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            Tensor::F32(a) => a.iter().map(|&x| x as f64).collect(),
            Tensor::F64(a) => a.iter().copied().collect(),
            Tensor::I32(a) => a.iter().map(|&x| x as f64).collect(),
            Tensor::BF16(a) => a.iter().map(|x| x.to_f64()).collect(),
            Tensor::F16(a) => a.iter().map(|x| x.to_f64()).collect(),
        }
    }
    /// The same values as float type `to`, rounded to nearest even (a `cast`); None
    /// for an i32 tensor or target.
    pub fn cast(&self, to: DType) -> Option<Tensor> {
        let f32s: ArrayD<f32> = match self {
            Tensor::F32(a) => a.clone(),
            Tensor::F64(a) if to == DType::F64 => return Some(Tensor::F64(a.clone())),
            Tensor::F64(a) => a.mapv(|x| x as f32),
            Tensor::BF16(a) => a.mapv(half::bf16::to_f32),
            Tensor::F16(a) => a.mapv(half::f16::to_f32),
            Tensor::I32(_) => return None,
        };
        Some(match to {
            DType::F32 => Tensor::F32(f32s),
            DType::F64 => Tensor::F64(f32s.mapv(|x| x as f64)),
            DType::BF16 => Tensor::BF16(f32s.mapv(half::bf16::from_f32)),
            DType::F16 => Tensor::F16(f32s.mapv(half::f16::from_f32)),
            DType::I32 => return None,
        })
    }
    /// The same elements, row-major, in dimensions `shape`.
    pub fn reshaped(&self, shape: &[usize]) -> Result<Tensor, String> {
        let bad = |e: ndarray::ShapeError| format!("{:?} as {shape:?}: {e}", self.shape());
        Ok(each_dtype!(self, a => a
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order(IxDyn(shape))
            .map_err(bad)?))
    }

    /// Tensors of one dtype joined along dimension `dim`.
    pub fn concat(pieces: &[&Tensor], dim: usize) -> Result<Tensor, String> {
        let first = pieces.first().ok_or("no pieces to join")?;
        if dim >= first.shape().len() {
            return Err(format!(
                "joined along dimension {dim} of a piece of {:?}",
                first.shape()
            ));
        }
        macro_rules! join {
            ($v:ident) => {{
                let views = pieces
                    .iter()
                    .map(|p| match p {
                        Tensor::$v(a) => Ok(a.view()),
                        other => Err(format!("pieces of {} and {}", first.dtype(), other.dtype())),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Tensor::$v(
                    ndarray::concatenate(ndarray::Axis(dim), &views)
                        .map_err(|e| format!("pieces that do not join: {e}"))?,
                )
            }};
        }
        Ok(match first {
            Tensor::F32(_) => join!(F32),
            Tensor::F64(_) => join!(F64),
            Tensor::I32(_) => join!(I32),
            Tensor::BF16(_) => join!(BF16),
            Tensor::F16(_) => join!(F16),
        })
    }

    /// A scalar's value as f64 (the first element of any tensor).
    pub fn scalar_f64(&self) -> Option<f64> {
        self.to_f64_vec().first().copied()
    }
}

/// A float element type host tensors hold and host code is generic over: f32, the
/// training type, and f64, a float64 copy of a model (`--dtype f64`).
pub trait HostElem:
    Copy + Default + std::ops::Mul<Output = Self> + std::ops::AddAssign + 'static
{
    /// `a` as a tensor.
    fn tensor(a: ArrayD<Self>) -> Tensor;
    /// The tensor's array, if it holds this type.
    fn array(t: &Tensor) -> Option<&ArrayD<Self>>;
}

impl HostElem for f32 {
    fn tensor(a: ArrayD<f32>) -> Tensor {
        Tensor::F32(a)
    }
    fn array(t: &Tensor) -> Option<&ArrayD<f32>> {
        t.as_f32()
    }
}

impl HostElem for f64 {
    fn tensor(a: ArrayD<f64>) -> Tensor {
        Tensor::F64(a)
    }
    fn array(t: &Tensor) -> Option<&ArrayD<f64>> {
        t.as_f64()
    }
}

/// Row-sparse values: `values[i]` is added to row `indices[i]` of a dense tensor of
/// shape `dense_shape`. Indices may repeat.
#[derive(Clone, Debug, PartialEq)]
pub struct Slices {
    /// Row indices, one per row of `values`.
    pub indices: Vec<i32>,
    /// Values, shape `[indices.len(), dense_shape[1..]]`.
    pub values: Tensor,
    /// Shape of the dense tensor this stands for.
    pub dense_shape: Vec<usize>,
}

impl Slices {
    /// The dense tensor these rows stand for (rows of a repeated index summed), for a
    /// sink that hands a sparse value to the host.
    pub fn to_dense(&self) -> Result<Tensor, String> {
        fn scatter<A: Copy + Default + std::ops::AddAssign>(
            s: &Slices,
            values: &ArrayD<A>,
        ) -> Result<ArrayD<A>, String> {
            let rows = s.dense_shape.first().copied().unwrap_or(0);
            let row: usize = s.dense_shape.iter().skip(1).product();
            let mut out = vec![A::default(); rows * row];
            let values = values.as_standard_layout();
            let src = values
                .as_slice()
                .ok_or("slices values are not contiguous")?;
            for (k, &id) in s.indices.iter().enumerate() {
                if id < 0 || id as usize >= rows {
                    return Err(format!(
                        "index {id} (position {k}) is outside the {rows} rows of {}",
                        Shape(s.dense_shape.clone())
                    ));
                }
                let Some(from) = src.get(k * row..(k + 1) * row) else {
                    return Err(format!("slices hold fewer than {} rows", k + 1));
                };
                for (d, &v) in out[id as usize * row..][..row].iter_mut().zip(from) {
                    *d += v;
                }
            }
            ArrayD::from_shape_vec(IxDyn(&s.dense_shape), out).map_err(|e| e.to_string())
        }
        match &self.values {
            Tensor::F32(v) => Ok(Tensor::F32(scatter(self, v)?)),
            Tensor::F64(v) => Ok(Tensor::F64(scatter(self, v)?)),
            Tensor::I32(_) => Err("slices of i32 values".into()),
            t => Err(format!("slices of {} values", t.dtype())),
        }
    }
}

/// The value of one output port at run time.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A dense tensor.
    Tensor(Tensor),
    /// Row-sparse slices.
    Slices(Slices),
}

impl Value {
    /// The sum of squares of a gradient's elements, in f64 (a gradient-norm clip's
    /// part); a row-sparse gradient's repeated rows summed first, so it is the dense
    /// gradient's.
    pub fn square_sum(&self) -> Result<f64, String> {
        let dense = |t: &Tensor| -> Result<Vec<f64>, String> {
            match t {
                Tensor::F32(_) | Tensor::F64(_) => Ok(t.to_f64_vec()),
                t => Err(format!(
                    "a {} gradient: gradients reach the optimizer in f32",
                    t.dtype()
                )),
            }
        };
        match self {
            Value::Tensor(t) => Ok(dense(t)?.iter().map(|x| x * x).sum()),
            Value::Slices(s) => {
                let values = dense(&s.values)?;
                let row = values.len() / s.indices.len().max(1);
                let mut rows: std::collections::BTreeMap<i32, Vec<f64>> = Default::default();
                for (k, &i) in s.indices.iter().enumerate() {
                    let r = rows.entry(i).or_insert_with(|| vec![0.0; row]);
                    for (a, b) in r.iter_mut().zip(&values[k * row..(k + 1) * row]) {
                        *a += b;
                    }
                }
                Ok(rows.values().flatten().map(|x| x * x).sum())
            }
        }
    }

    /// The dense tensor, if this is one.
    pub fn tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            Value::Slices(_) => None,
        }
    }
    /// The IR type of this value.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::Tensor(t) => ValueType::Tensor(t.tensor_type()),
            Value::Slices(s) => ValueType::IndexedSlices {
                dense: TensorType::new(s.values.dtype(), Shape(s.dense_shape.clone())),
                nnz: s.indices.len(),
            },
        }
    }
    /// Bytes of payload (indices included for slices).
    pub fn bytes(&self) -> usize {
        match self {
            Value::Tensor(t) => t.bytes(),
            Value::Slices(s) => s.indices.len() * 4 + s.values.bytes(),
        }
    }
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Value {
        Value::Tensor(t)
    }
}

/// Serialisable description of a tensor for metrics and checkpoints.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// Type.
    pub ty: TensorType,
}

/// `a + b`: dense values summed, slices concatenated (rows may repeat).
pub(crate) fn add_values(a: Value, b: Value) -> std::result::Result<Value, String> {
    match (a, b) {
        (Value::Tensor(Tensor::F32(mut x)), Value::Tensor(Tensor::F32(y)))
            if x.shape() == y.shape() =>
        {
            x += &y;
            Ok(Value::Tensor(Tensor::F32(x)))
        }
        (Value::Tensor(Tensor::F64(mut x)), Value::Tensor(Tensor::F64(y)))
            if x.shape() == y.shape() =>
        {
            x += &y;
            Ok(Value::Tensor(Tensor::F64(x)))
        }
        (Value::Slices(x), Value::Slices(y)) if x.dense_shape == y.dense_shape => {
            let values = match (&x.values, &y.values) {
                (Tensor::F32(a), Tensor::F32(b)) => Tensor::F32(
                    ndarray::concatenate(ndarray::Axis(0), &[a.view(), b.view()])
                        .map_err(|e| e.to_string())?,
                ),
                (Tensor::F64(a), Tensor::F64(b)) => Tensor::F64(
                    ndarray::concatenate(ndarray::Axis(0), &[a.view(), b.view()])
                        .map_err(|e| e.to_string())?,
                ),
                _ => return Err("micro-batch gradients of different dtypes".into()),
            };
            let mut indices = x.indices;
            indices.extend(y.indices);
            Ok(Value::Slices(Slices {
                indices,
                values,
                dense_shape: x.dense_shape,
            }))
        }
        (a, b) => Err(format!(
            "micro-batch gradients differ: {} and {}",
            a.value_type(),
            b.value_type()
        )),
    }
}

/// `v * k` (slices: their values).
pub(crate) fn scale_value(v: Value, k: f64) -> std::result::Result<Value, String> {
    fn scale(t: Tensor, k: f64) -> std::result::Result<Tensor, String> {
        match t {
            Tensor::F32(mut a) => {
                a.mapv_inplace(|x| x * k as f32);
                Ok(Tensor::F32(a))
            }
            Tensor::F64(mut a) => {
                a.mapv_inplace(|x| x * k);
                Ok(Tensor::F64(a))
            }
            Tensor::I32(_) => Err("an i32 gradient".into()),
            t => Err(format!("a {} gradient (scaled in f32)", t.dtype())),
        }
    }
    Ok(match v {
        Value::Tensor(t) => Value::Tensor(scale(t, k)?),
        Value::Slices(mut s) => {
            s.values = scale(s.values, k)?;
            Value::Slices(s)
        }
    })
}

/// Bytes a rank has sent and received, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteCount {
    /// Payload bytes this rank has sent.
    pub sent: u64,
    /// Payload bytes this rank has received.
    pub received: u64,
}

impl std::ops::Add for ByteCount {
    type Output = ByteCount;
    fn add(self, o: ByteCount) -> ByteCount {
        ByteCount {
            sent: self.sent + o.sent,
            received: self.received + o.received,
        }
    }
}

impl std::ops::Sub for ByteCount {
    type Output = ByteCount;
    /// The bytes moved between two readings (`later - earlier`), e.g. for one step.
    fn sub(self, earlier: ByteCount) -> ByteCount {
        ByteCount {
            sent: self.sent.saturating_sub(earlier.sent),
            received: self.received.saturating_sub(earlier.received),
        }
    }
}
