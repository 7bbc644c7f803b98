//! Pointwise kernels: unary maths, broadcasting binary maths, the activation
//! gradients, and dropout. Each writes into an owned input when it can (the input
//! has the result's shape and nothing reads it later), so a chain of pointwise ops
//! runs in one buffer.

use super::{cow, shape_str, standard, val, Arg, CpuKernelError, Elem, KernelCtx, ShapeCheck};
use crate::core::value::Value;
use distc_ir::shape::broadcast_shapes;
use ndarray::IxDyn;

/// `f` applied to every element; in place when `x` is owned.
pub(super) fn unary<A: Elem>(x: Arg<'_>, f: impl Fn(A) -> A) -> Result<Value, CpuKernelError> {
    let x = cow::<A>(x, 0)?;
    if x.is_view() {
        Ok(val(x.mapv(f)))
    } else {
        let mut o = x.into_owned();
        o.mapv_inplace(f);
        Ok(val(o))
    }
}

/// `f(a, b)` with numpy broadcasting. The result is written into an owned operand that
/// already has the result's shape, else into a copy of one that has it (else into `a`
/// broadcast out), and the other operand is streamed over it (see [`zip_broadcast`]).
pub(super) fn binary<A: Elem>(
    a: Arg<'_>,
    b: Arg<'_>,
    f: impl Fn(A, A) -> A,
) -> Result<Value, CpuKernelError> {
    let (a, b) = (cow::<A>(a, 0)?, cow::<A>(b, 1)?);
    let shape = broadcast_shapes(a.shape(), b.shape()).ok_or_else(|| CpuKernelError::Shapes {
        check: ShapeCheck::Broadcast,
        left: a.shape().to_vec(),
        right: b.shape().to_vec(),
    })?;
    let a_full = a.shape() == shape.as_slice();
    let b_full = b.shape() == shape.as_slice();
    let into_b = b_full && (b.is_owned() || !a_full) && !(a_full && a.is_owned());
    let (mut dst, src) = if into_b {
        (standard(b), a)
    } else if a_full {
        (standard(a), b)
    } else {
        // Both operands grow (e.g. [n,1] + [1,m]): `a` broadcast out.
        let full = a
            .broadcast(IxDyn(&shape))
            .ok_or_else(|| {
                CpuKernelError::Invalid(format!("cannot broadcast to {}", shape_str(&shape)))
            })?
            .as_standard_layout()
            .into_owned();
        (full, b)
    };
    let src_std = src.as_standard_layout();
    let s = src_std.as_slice().ok_or(CONTIGUOUS)?;
    let d = dst.as_slice_mut().ok_or(CONTIGUOUS)?;
    if into_b {
        zip_broadcast(&shape, d, s, src.shape(), |y, x| *y = f(x, *y));
    } else {
        zip_broadcast(&shape, d, s, src.shape(), |x, y| *x = f(*x, y));
    }
    Ok(val(dst))
}

const CONTIGUOUS: CpuKernelError = CpuKernelError::NotContiguous("a standard-layout array");

/// `g(&mut dst[i], src[j(i)])` over a row-major `dst` of shape `shape`, where `src`
/// (row-major, shape `src_shape`) broadcasts to `shape`.
///
/// Axes are first merged where `src` is contiguous across them (or broadcast across
/// both), which leaves one to three axes in practice; the innermost then runs as a
/// plain slice zip (or a slice against one repeated scalar), which vectorises, where
/// ndarray's `Zip` over `IxDyn` with a broadcast operand steps an index per element.
fn zip_broadcast<A: Copy>(
    shape: &[usize],
    dst: &mut [A],
    src: &[A],
    src_shape: &[usize],
    g: impl Fn(&mut A, A),
) {
    if dst.is_empty() {
        return;
    }
    // Source stride of each output axis (0 where it broadcasts), innermost first,
    // size-1 axes dropped, mergeable neighbours merged: (size, stride).
    let lead = shape.len() - src_shape.len();
    let mut axes: Vec<(usize, usize)> = Vec::with_capacity(shape.len());
    let mut stride = 1;
    for i in (0..shape.len()).rev() {
        let sd = if i >= lead { src_shape[i - lead] } else { 1 };
        let st = if sd == 1 { 0 } else { stride };
        stride *= sd;
        if shape[i] == 1 {
            continue;
        }
        match axes.last_mut() {
            Some((n, s)) if st == *s * *n => *n *= shape[i],
            _ => axes.push((shape[i], st)),
        }
    }
    // The innermost group's source stride is 0 (broadcast) or 1: output axes after it
    // have size 1, so the source's do too.
    let (n0, s0) = axes.first().copied().unwrap_or((1, 1));
    let outer = &axes[axes.len().min(1)..];
    let mut idx = vec![0usize; outer.len()];
    let mut off = 0usize;
    for chunk in dst.chunks_exact_mut(n0) {
        if s0 == 0 {
            let v = src[off];
            chunk.iter_mut().for_each(|d| g(d, v));
        } else {
            for (d, &v) in chunk.iter_mut().zip(&src[off..off + n0]) {
                g(d, v);
            }
        }
        // Odometer over the outer axes.
        for (k, &(n, s)) in outer.iter().enumerate() {
            idx[k] += 1;
            off += s;
            if idx[k] < n {
                break;
            }
            idx[k] = 0;
            off -= n * s;
        }
    }
}

/// `f(a, b)` on two tensors of one shape (the activation gradients).
pub(super) fn binary_same<A: Elem>(
    a: Arg<'_>,
    b: Arg<'_>,
    f: impl Fn(A, A) -> A,
) -> Result<Value, CpuKernelError> {
    let (sa, sb) = (super::tensor(&a, 0)?.shape(), super::tensor(&b, 1)?.shape());
    if sa != sb {
        return Err(CpuKernelError::Shapes {
            check: ShapeCheck::Same,
            left: sa.to_vec(),
            right: sb.to_vec(),
        });
    }
    binary(a, b, f)
}

/// Inverted dropout, also its gradient: the mask depends only on `(seed, ctx.step,
/// element index)`, so the backward op drops exactly the forward op's elements. With
/// `per_sample` (axis 0 is the batch) the index is the element's position in the global
/// batch: worker `r` of equal batches starts at `r * len`, so a sample's mask does not
/// depend on how the global batch is split. The identity outside training.
pub(super) fn dropout<A: Elem>(
    x: Arg<'_>,
    rate: f64,
    seed: u64,
    per_sample: bool,
    ctx: &KernelCtx,
) -> Result<Value, CpuKernelError> {
    if !(0.0..1.0).contains(&rate) {
        return Err(CpuKernelError::Invalid(format!(
            "rate {rate} is not in [0, 1)"
        )));
    }
    let x = cow::<A>(x, 0)?;
    if !ctx.training || rate == 0.0 {
        return Ok(val(x.into_owned()));
    }
    let mask = DropoutMask::new(rate, seed, ctx.step);
    let scale = A::c(1.0 / (1.0 - rate));
    let mut o = x.into_owned();
    let offset = if per_sample {
        (ctx.rank * o.len()) as u64
    } else {
        0
    };
    // Logical (row-major) order, whatever the memory layout: the index is the flat
    // row-major index in both the forward and the backward op.
    for (i, v) in o.iter_mut().enumerate() {
        *v = if mask.keep(offset + i as u64) {
            *v * scale
        } else {
            A::zero()
        };
    }
    Ok(val(o))
}

/// The dropout mask of one op at one step.
struct DropoutMask {
    base: u64,
    threshold: u64,
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finaliser: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl DropoutMask {
    fn new(rate: f64, seed: u64, step: u64) -> DropoutMask {
        let base = mix(mix(seed.wrapping_add(GOLDEN)) ^ step.wrapping_mul(GOLDEN).wrapping_add(1));
        // `rate * 2^64`, saturating: an element is dropped when its hash is below it.
        let threshold = (rate * 18_446_744_073_709_551_616.0) as u64;
        DropoutMask { base, threshold }
    }

    /// Whether element `i` is kept: element `i` of the splitmix64 stream seeded with
    /// `base`, compared with the threshold.
    fn keep(&self, i: u64) -> bool {
        mix(self
            .base
            .wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
            >= self.threshold
    }
}
