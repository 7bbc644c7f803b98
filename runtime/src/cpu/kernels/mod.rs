//! CPU kernels: what each op of the IR computes, as one exhaustive `match` over
//! [`Op`] in [`eval`]. A new op does not compile until it has a kernel here.
//!
//! Why it is shaped this way:
//! - Every float kernel is written once, generic over [`Elem`] (f32 and f64), and the
//!   dtype is dispatched once per call: training runs in f32, gradient checks run
//!   whole graphs in f64 through the same code.
//! - Inputs arrive as [`Arg`]s, owned or borrowed. The executor hands over ownership
//!   of a value at its last use, so elementwise kernels, dropout, the softmax family
//!   and most backward kernels overwrite their input instead of allocating, and
//!   reshape of an owned tensor is free. Borrowed inputs (parameters, feeds, values
//!   still needed later) are never modified.
//! - Kernels check what they rely on (ranks, shapes, dtypes, ids in range) and return
//!   a [`CpuKernelError`] instead of panicking: a hand-edited plan or a pass bug must
//!   not bring the process down. The executor adds the node to its message.
//! - Every dense result is in standard (row-major) layout, so later kernels can work
//!   on flat slices.
//!
//! Families live in submodules: `elementwise` (pointwise maths and dropout), `fused`
//! (element-wise expressions the kernel-fusion pass collapsed into one node), `reduce`
//! (sums, broadcasting, softmax and losses), `layout` (reshape, transpose, concat,
//! slice), `sparse` (embedding and `IndexedSlices`), `nn` (matmul, layer norm,
//! convolution, pooling).

mod attention;
mod comm;
mod elementwise;
mod error;
mod fused;
mod layout;
mod nn;

mod reduce;
mod sparse;

use crate::core::value::{Slices, Tensor, Value};
use distc_ir::{DType, Op};
use ndarray::{ArrayD, ArrayViewD, CowArray, IxDyn, LinalgScalar, ScalarOperand};
use num_traits::{Float, One, Zero};
use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

pub use crate::core::backend::KernelCtx;
pub use error::{CpuKernelError, IndexOf, ShapeCheck, ShapeNeed};

/// One input of a kernel: owned (the kernel may reuse its buffer) or borrowed.
#[derive(Debug)]
pub enum Arg<'a> {
    /// A value nothing reads after this kernel: its buffer may be overwritten.
    Owned(Value),
    /// A value read again later, or owned by someone else.
    Borrowed(&'a Value),
    /// A borrowed dense tensor (parameters, feeds, constants).
    BorrowedTensor(&'a Tensor),
}

impl Arg<'_> {
    /// The value, taken when owned, else copied.
    fn into_value(self) -> Value {
        match self {
            Arg::Owned(v) => v,
            Arg::Borrowed(v) => v.clone(),
            Arg::BorrowedTensor(t) => Value::Tensor(t.clone()),
        }
    }

    /// Whether the kernel may take this input's buffer.
    pub fn is_owned(&self) -> bool {
        matches!(self, Arg::Owned(_))
    }

    fn tensor(&self) -> Option<&Tensor> {
        match self {
            Arg::Owned(Value::Tensor(t)) | Arg::Borrowed(Value::Tensor(t)) => Some(t),
            Arg::BorrowedTensor(t) => Some(t),
            Arg::Owned(Value::Slices(_)) | Arg::Borrowed(Value::Slices(_)) => None,
        }
    }

    fn slices(&self) -> Option<&Slices> {
        match self {
            Arg::Owned(Value::Slices(s)) | Arg::Borrowed(Value::Slices(s)) => Some(s),
            _ => None,
        }
    }

    /// The element type (of the values, for slices).
    fn dtype(&self) -> DType {
        match (self.tensor(), self.slices()) {
            (Some(t), _) => t.dtype(),
            (None, Some(s)) => s.values.dtype(),
            (None, None) => DType::F32,
        }
    }

    /// The IR spelling of this input's type, for messages.
    fn describe(&self) -> String {
        match (self.tensor(), self.slices()) {
            (Some(t), _) => t.tensor_type().to_string(),
            (None, Some(s)) => Value::Slices(s.clone()).value_type().to_string(),
            (None, None) => "nothing".into(),
        }
    }
}

/// Element types a tensor can hold; layout kernels work on all of them.
pub trait Scalar: Copy + Zero + PartialEq + Debug + Send + Sync + 'static {
    /// The IR dtype.
    const DTYPE: DType;
    /// The array, if `t` holds this type.
    fn of(t: &Tensor) -> Option<&ArrayD<Self>>;
    /// The array, moved out, if `t` holds this type.
    fn take(t: Tensor) -> Result<ArrayD<Self>, Tensor>;
    /// Wraps an array into a tensor.
    fn wrap(a: ArrayD<Self>) -> Tensor;
}

/// Float element types: every float kernel is generic over this.
pub trait Elem:
    Scalar + Float + LinalgScalar + ScalarOperand + AddAssign + SubAssign + MulAssign + DivAssign + Sum
{
    /// Converts an attribute (rates, eps, counts) to this type.
    fn c(x: f64) -> Self;
    /// `exp`, fast where that is safe: a branch-free polynomial for f32 (so loops over
    /// slices vectorise), the exact `exp` for f64 (gradient checks).
    fn fast_exp(self) -> Self;
    /// The error function (GELU's normal CDF).
    fn erf(self) -> Self;
}

macro_rules! scalar_impl {
    ($t:ty, $variant:ident) => {
        impl Scalar for $t {
            const DTYPE: DType = DType::$variant;
            fn of(t: &Tensor) -> Option<&ArrayD<Self>> {
                match t {
                    Tensor::$variant(a) => Some(a),
                    _ => None,
                }
            }
            fn take(t: Tensor) -> Result<ArrayD<Self>, Tensor> {
                match t {
                    Tensor::$variant(a) => Ok(a),
                    other => Err(other),
                }
            }
            fn wrap(a: ArrayD<Self>) -> Tensor {
                Tensor::$variant(a)
            }
        }
    };
}
scalar_impl!(f32, F32);
scalar_impl!(f64, F64);
scalar_impl!(i32, I32);

impl Elem for f32 {
    fn c(x: f64) -> f32 {
        x as f32
    }
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        expf(self)
    }
    fn erf(self) -> f32 {
        libm::erff(self)
    }
}
impl Elem for f64 {
    fn c(x: f64) -> f64 {
        x
    }
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
    fn erf(self) -> f64 {
        libm::erf(self)
    }
}

/// `exp` on f32 with Cephes' `expf` polynomial (relative error below 1e-7), written
/// without branches or float-to-int casts so that loops over slices vectorise; libm's
/// `expf` does not, and the softmax family spends most of its time in `exp`. Below
/// -87.33 (where the exact result is subnormal) it gives 0; above 88.72, infinity;
/// NaN stays NaN.
#[inline(always)]
fn expf(x0: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let x = x0.clamp(-87.33, 88.37);
    let z = x * std::f32::consts::LOG2_E + MAGIC;
    let n = z - MAGIC;
    // x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two for an exact product.
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n, built from n's bits.
    let two_n = f32::from_bits(z.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23);
    let e = if x0 < -87.33 { 0.0 } else { y * two_n };
    if x0 > 88.72 {
        f32::INFINITY
    } else {
        e
    }
}

/// Runs `$body` with `$A` bound to the float type of `$dt`.
macro_rules! float {
    ($dt:expr, $A:ident => $body:expr) => {
        match $dt {
            DType::F32 => {
                type $A = f32;
                $body
            }
            DType::F64 => {
                type $A = f64;
                $body
            }
            DType::I32 => Err(CpuKernelError::NotFloat(DType::I32)),
            // `eval` runs 16-bit inputs as f32 before any kernel sees them.
            DType::BF16 | DType::F16 => Err(CpuKernelError::Uncast($dt)),
        }
    };
}

/// Runs `$body` with `$T` bound to the element type of `$dt` (any dtype).
macro_rules! any {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::BF16 | DType::F16 => Err(CpuKernelError::Uncast($dt)),
        }
    };
}

/// A 16-bit float input as f32 (other inputs as they are).
fn widen(a: Arg<'_>) -> Result<Value, CpuKernelError> {
    let wide = |t: Tensor| match t.dtype() {
        d if d.is_half() => t
            .cast(DType::F32)
            .ok_or_else(|| CpuKernelError::Invalid(format!("cannot widen {d}"))),
        _ => Ok(t),
    };
    let v = match a {
        Arg::Owned(v) => v,
        Arg::Borrowed(v) => v.clone(),
        Arg::BorrowedTensor(t) => Value::Tensor(t.clone()),
    };
    Ok(match v {
        Value::Tensor(t) => Value::Tensor(wide(t)?),
        Value::Slices(s) => Value::Slices(Slices {
            values: wide(s.values)?,
            ..s
        }),
    })
}

/// A kernel's f32 result rounded back to the 16-bit type `to`.
fn narrow(v: Value, to: DType) -> Result<Value, CpuKernelError> {
    let round = |t: Tensor| match t.dtype() {
        DType::F32 => t
            .cast(to)
            .ok_or_else(|| CpuKernelError::Invalid(format!("cannot round to {to}"))),
        _ => Ok(t),
    };
    Ok(match v {
        Value::Tensor(t) => Value::Tensor(round(t)?),
        Value::Slices(s) => Value::Slices(Slices {
            values: round(s.values)?,
            ..s
        }),
    })
}

/// Evaluates `op` on borrowed inputs. Sources and sinks are the executor's business
/// and give an error here.
pub fn eval_op(op: &Op, inputs: &[&Value], ctx: &KernelCtx) -> Result<Vec<Value>, CpuKernelError> {
    eval(op, inputs.iter().map(|v| Arg::Borrowed(v)).collect(), ctx)
}

/// Evaluates `op` on inputs that may be owned: an owned input's buffer may be reused
/// for the result. Returns one value per output port of the op.
pub fn eval(op: &Op, args: Vec<Arg<'_>>, ctx: &KernelCtx) -> Result<Vec<Value>, CpuKernelError> {
    // `train_or_eval` is handed only the input its mode reads (see the schedule).
    let arity = match op {
        Op::TrainOrEval => Some(1),
        op => op.arity(),
    };
    match arity {
        Some(n) if args.len() != n => {
            return Err(CpuKernelError::Arity {
                want: n,
                got: args.len(),
            })
        }
        None if args.is_empty() => return Err(CpuKernelError::NoInputs),
        _ => {}
    }
    let dt = args.first().map_or(DType::F32, Arg::dtype);
    if let Op::Cast { to } = op {
        let [x] = split(args)?;
        let t = x
            .tensor()
            .ok_or_else(|| CpuKernelError::Invalid("casts a dense tensor".into()))?;
        let cast = t.cast(*to).ok_or_else(|| CpuKernelError::Cast {
            from: t.tensor_type(),
            to: *to,
        })?;
        return Ok(vec![Value::Tensor(cast)]);
    }
    // 16-bit floats are stored in 16 bits and computed in f32: every kernel runs on the
    // inputs widened, and its float results are rounded back to the inputs' type.
    if let Some(half) = args.iter().map(Arg::dtype).find(|d| d.is_half()) {
        let wide = args
            .into_iter()
            .map(|a| widen(a).map(Arg::Owned))
            .collect::<Result<Vec<_>, CpuKernelError>>()?;
        return eval(op, wide, ctx)?
            .into_iter()
            .map(|v| narrow(v, half))
            .collect();
    }
    let out: Value = match op {
        Op::Cast { .. } => unreachable!("cast is evaluated above"),
        Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } => {
            return Err(CpuKernelError::Invalid(
                "a source: the executor provides its value, not a kernel".into(),
            ))
        }
        Op::Loss | Op::ParamGrad { .. } | Op::Output { .. } | Op::Assign { .. } => {
            return Err(CpuKernelError::Invalid(
                "a sink: the executor reads its input, not a kernel".into(),
            ))
        }
        Op::Accumulate { .. } => {
            return Err(CpuKernelError::Invalid(
                "accumulation keeps state across runs: the executor runs it".into(),
            ))
        }
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::Broadcast { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGatherDense { .. }
        | Op::ModelAllReduce { .. }
        | Op::ModelGather { .. }
        | Op::ModelReduceScatter { .. }
        | Op::Pull { .. }
        | Op::SparsePull { .. }
        | Op::Push { .. }
        | Op::SparsePush { .. }
        | Op::Shard { .. }
        | Op::Serve { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => {
            return Err(CpuKernelError::Invalid(
                "moves data between workers or servers: it runs on a communicator, which \
                 this executor does not have"
                    .into(),
            ))
        }
        Op::Pack => float!(dt, A => comm::pack::<A>(&args))?,
        Op::PackChunks { workers } => float!(dt, A => comm::pack_chunks::<A>(&args, *workers))?,
        Op::UnpackChunks { workers, shapes } => {
            let [x] = split(args)?;
            return float!(dt, A => comm::unpack_chunks::<A>(&x, *workers, shapes));
        }
        Op::Unpack { shapes } => {
            let [x] = split(args)?;
            return float!(dt, A => comm::unpack::<A>(&x, shapes));
        }
        Op::UniqueRows => {
            let [s] = split(args)?;
            float!(dt, A => comm::unique_rows::<A>(&s))?
        }
        Op::ModelEnter { .. } => {
            let [x] = split(args)?;
            match x {
                Arg::Owned(v) => v,
                Arg::Borrowed(v) => v.clone(),
                Arg::BorrowedTensor(t) => Value::Tensor(t.clone()),
            }
        }
        Op::ModelSplit { dim, parts } => {
            let [x] = split(args)?;
            let len = x
                .tensor()
                .and_then(|t| t.shape().get(*dim).copied())
                .unwrap_or(0)
                / parts;
            let start = ctx.model_rank * len;
            any!(dt, T => layout::slice::<T>(&x, *dim, start, start + len))?
        }
        Op::TakeChunk { workers } => {
            let [x] = split(args)?;
            float!(dt, A => comm::take_chunk::<A>(&x, *workers, ctx.rank))?
        }
        Op::Fused { expr } => float!(dt, A => fused::fused::<A>(expr, args))?,
        Op::AttentionGrad { causal, scale } => {
            let [dy, q, k, v] = split(args)?;
            return float!(dt, A => attention::attention_grad::<A>(&dy, &q, &k, &v, *causal, *scale));
        }
        Op::LayerNormGrad { eps } => {
            let [dy, x, gamma] = split(args)?;
            return float!(dt, A => nn::layer_norm_grad::<A>(dy, &x, &gamma, *eps));
        }

        // ---- dense forward ops ----
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            let [a, b] = split(args)?;
            float!(dt, A => nn::matmul::<A>(&a, &b, *transpose_a, *transpose_b))?
        }
        Op::Add => {
            let [a, b] = split(args)?;
            float!(dt, A => elementwise::binary::<A>(a, b, |x, y| x + y))?
        }
        Op::Sub => {
            let [a, b] = split(args)?;
            float!(dt, A => elementwise::binary::<A>(a, b, |x, y| x - y))?
        }
        Op::Mul => {
            let [a, b] = split(args)?;
            float!(dt, A => elementwise::binary::<A>(a, b, |x, y| x * y))?
        }
        Op::Div => {
            let [a, b] = split(args)?;
            float!(dt, A => elementwise::binary::<A>(a, b, |x, y| x / y))?
        }
        Op::Neg => {
            let [x] = split(args)?;
            float!(dt, A => elementwise::unary::<A>(x, |v: A| -v))?
        }
        Op::Relu => {
            let [x] = split(args)?;
            float!(dt, A => elementwise::unary::<A>(x, |v: A| if v > A::zero() { v } else { A::zero() }))?
        }
        Op::Sigmoid => {
            let [x] = split(args)?;
            float!(dt, A => elementwise::unary::<A>(x, |v: A| A::one() / (A::one() + (-v).fast_exp())))?
        }
        Op::Tanh => {
            let [x] = split(args)?;
            float!(dt, A => elementwise::unary::<A>(x, |v: A| v.tanh()))?
        }
        Op::Exp => {
            let [x] = split(args)?;
            float!(dt, A => elementwise::unary::<A>(x, |v: A| v.exp()))?
        }
        Op::Log => {
            let [x] = split(args)?;
            float!(dt, A => elementwise::unary::<A>(x, |v: A| v.ln()))?
        }
        Op::Softmax { axis } => {
            let [x] = split(args)?;
            float!(dt, A => reduce::softmax::<A>(x, *axis, false))?
        }
        Op::LogSoftmax { axis } => {
            let [x] = split(args)?;
            float!(dt, A => reduce::softmax::<A>(x, *axis, true))?
        }
        Op::Sum { axes, keep_dims } => {
            let [x] = split(args)?;
            float!(dt, A => reduce::sum::<A>(x, axes, *keep_dims, false))?
        }
        Op::Mean { axes, keep_dims } => {
            let [x] = split(args)?;
            float!(dt, A => reduce::sum::<A>(x, axes, *keep_dims, true))?
        }
        // One device is all the replicas; the schedule hands `train_or_eval` only the
        // input its mode reads.
        Op::ReplicaReduce { .. } | Op::TrainOrEval => {
            let [x] = split(args)?;
            x.into_value()
        }
        Op::Reshape { shape } => {
            let [x] = split(args)?;
            any!(dt, T => layout::reshape::<T>(x, shape.dims()))?
        }
        Op::Transpose { perm } => {
            let [x] = split(args)?;
            any!(dt, T => layout::transpose::<T>(x, perm))?
        }
        Op::Concat { axis } => any!(dt, T => layout::concat::<T>(&args, *axis))?,
        Op::Slice { axis, start, end } => {
            let [x] = split(args)?;
            any!(dt, T => layout::slice::<T>(&x, *axis, *start, *end))?
        }
        Op::Embedding => {
            let [table, ids] = split(args)?;
            float!(dt, A => sparse::embedding::<A>(&table, &ids))?
        }
        Op::SoftmaxCrossEntropy => {
            let [logits, labels] = split(args)?;
            float!(dt, A => reduce::softmax_cross_entropy::<A>(&logits, &labels))?
        }
        Op::Mse => {
            let [p, t] = split(args)?;
            float!(dt, A => reduce::mse::<A>(&p, &t))?
        }
        Op::Dropout {
            rate,
            seed,
            per_sample,
        } => {
            let [x] = split(args)?;
            float!(dt, A => elementwise::dropout::<A>(x, *rate, *seed, *per_sample, ctx))?
        }
        Op::Attention { causal, scale } => {
            let [q, k, v] = split(args)?;
            float!(dt, A => attention::attention::<A>(&q, &k, &v, *causal, *scale))?
        }
        Op::LayerNorm { eps } => {
            let [x, gamma, beta] = split(args)?;
            float!(dt, A => nn::layer_norm::<A>(x, &gamma, &beta, *eps))?
        }
        Op::Conv2d { stride, padding } => {
            let [x, w] = split(args)?;
            float!(dt, A => nn::conv2d::<A>(&x, &w, *stride, *padding))?
        }
        Op::MaxPool2d { kernel, stride } => {
            let [x] = split(args)?;
            float!(dt, A => nn::max_pool2d::<A>(&x, *kernel, *stride))?
        }

        // ---- backward ops ----
        Op::SumTo { shape } => {
            let [x] = split(args)?;
            float!(dt, A => reduce::sum_to::<A>(x, shape.dims()))?
        }
        Op::BroadcastTo { shape } => {
            let [x] = split(args)?;
            float!(dt, A => reduce::broadcast_to::<A>(x, shape.dims()))?
        }
        Op::ReluGrad => {
            let [dy, x] = split(args)?;
            float!(dt, A => elementwise::binary_same::<A>(dy, x, |d, x| if x > A::zero() { d } else { A::zero() }))?
        }
        Op::SigmoidGrad => {
            let [dy, y] = split(args)?;
            float!(dt, A => elementwise::binary_same::<A>(dy, y, |d, y| d * y * (A::one() - y)))?
        }
        Op::TanhGrad => {
            let [dy, y] = split(args)?;
            float!(dt, A => elementwise::binary_same::<A>(dy, y, |d, y| d * (A::one() - y * y)))?
        }
        Op::SoftmaxGrad { axis } => {
            let [dy, y] = split(args)?;
            float!(dt, A => reduce::softmax_grad::<A>(dy, &y, *axis, false))?
        }
        Op::LogSoftmaxGrad { axis } => {
            let [dy, y] = split(args)?;
            float!(dt, A => reduce::softmax_grad::<A>(dy, &y, *axis, true))?
        }
        Op::SoftmaxCrossEntropyGrad => {
            let [dloss, logits, labels] = split(args)?;
            float!(dt, A => reduce::softmax_cross_entropy_grad::<A>(&dloss, logits, &labels))?
        }
        Op::MseGrad => {
            let [dloss, p, t] = split(args)?;
            float!(dt, A => reduce::mse_grad::<A>(&dloss, p, t))?
        }
        Op::EmbeddingGrad { table } => {
            let [dy, ids] = split(args)?;
            float!(dt, A => sparse::embedding_grad::<A>(dy, &ids, table))?
        }
        Op::ModelEmbedding { .. } => {
            let [table, ids] = split(args)?;
            float!(dt, A => sparse::model_embedding::<A>(&table, &ids, ctx.model_rank))?
        }
        Op::ModelEmbeddingGrad { table, .. } => {
            let [dy, ids] = split(args)?;
            float!(dt, A => sparse::model_embedding_grad::<A>(dy, &ids, table, ctx.model_rank))?
        }
        Op::DropoutGrad {
            rate,
            seed,
            per_sample,
        } => {
            let [dy] = split(args)?;
            float!(dt, A => elementwise::dropout::<A>(dy, *rate, *seed, *per_sample, ctx))?
        }
        Op::Conv2dGradInput {
            stride,
            padding,
            input,
        } => {
            let [dy, w] = split(args)?;
            float!(dt, A => nn::conv2d_grad_input::<A>(&dy, &w, *stride, *padding, input.dims()))?
        }
        Op::Conv2dGradFilter {
            stride,
            padding,
            filter,
        } => {
            let [dy, x] = split(args)?;
            float!(dt, A => nn::conv2d_grad_filter::<A>(&dy, &x, *stride, *padding, filter.dims()))?
        }
        Op::MaxPool2dGrad { kernel, stride } => {
            let [dy, x] = split(args)?;
            float!(dt, A => nn::max_pool2d_grad::<A>(&dy, &x, *kernel, *stride))?
        }
        Op::ConcatSlices => float!(dt, A => sparse::concat_slices::<A>(args))?,
        Op::Densify => {
            let [s] = split(args)?;
            float!(dt, A => sparse::densify::<A>(&s))?
        }
        Op::RowMask => {
            let [s] = split(args)?;
            float!(dt, A => sparse::row_mask::<A>(&s))?
        }
        Op::Sparsify => {
            let [x, mask] = split(args)?;
            float!(dt, A => sparse::sparsify::<A>(&x, &mask))?
        }
    };
    Ok(vec![out])
}

/// The inputs as an array of `N` (the arity was checked by [`eval`]).
fn split<const N: usize>(args: Vec<Arg<'_>>) -> Result<[Arg<'_>; N], CpuKernelError> {
    let got = args.len();
    args.try_into()
        .map_err(|_| CpuKernelError::Arity { want: N, got })
}

/// The tensor of input `i`, or an error if it is `IndexedSlices`.
fn tensor<'b>(arg: &'b Arg<'_>, i: usize) -> Result<&'b Tensor, CpuKernelError> {
    arg.tensor().ok_or_else(|| CpuKernelError::NotDense {
        input: i,
        found: arg.describe(),
    })
}

/// Input `i` is not of the element type `want`.
fn dtype_error(arg: &Arg<'_>, i: usize, want: DType) -> CpuKernelError {
    CpuKernelError::DType {
        input: i,
        found: arg.describe(),
        want,
    }
}

/// A view of input `i` as an array of `T`.
fn view<'b, T: Scalar>(arg: &'b Arg<'_>, i: usize) -> Result<ArrayViewD<'b, T>, CpuKernelError> {
    T::of(tensor(arg, i)?)
        .map(|a| a.view())
        .ok_or_else(|| dtype_error(arg, i, T::DTYPE))
}

/// Input `i` as an array of `T`, owned when the argument is.
fn cow<T: Scalar>(arg: Arg<'_>, i: usize) -> Result<CowArray<'_, T, IxDyn>, CpuKernelError> {
    match arg {
        Arg::Owned(Value::Tensor(t)) => T::take(t)
            .map(CowArray::from)
            .map_err(|t| dtype_error(&Arg::BorrowedTensor(&t), i, T::DTYPE)),
        Arg::Borrowed(Value::Tensor(t)) | Arg::BorrowedTensor(t) => T::of(t)
            .map(|a| CowArray::from(a.view()))
            .ok_or_else(|| dtype_error(&Arg::BorrowedTensor(t), i, T::DTYPE)),
        Arg::Owned(Value::Slices(_)) | Arg::Borrowed(Value::Slices(_)) => {
            Err(CpuKernelError::NotDense {
                input: i,
                found: arg.describe(),
            })
        }
    }
}

/// An owned array in standard layout: moves an owned standard array, copies otherwise.
fn standard<T: Scalar>(a: CowArray<'_, T, IxDyn>) -> ArrayD<T> {
    if a.is_standard_layout() {
        a.into_owned()
    } else {
        a.as_standard_layout().into_owned()
    }
}

/// Wraps an array as a dense value.
fn val<T: Scalar>(a: ArrayD<T>) -> Value {
    Value::Tensor(T::wrap(a))
}

/// Spells a shape as the IR does, for messages.
fn shape_str(dims: &[usize]) -> String {
    distc_ir::Shape(dims.to_vec()).to_string()
}
