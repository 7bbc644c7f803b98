//! Pointwise kernels: unary maths, broadcasting binary maths, the activation
//! gradients, and dropout. Each writes into an owned input when it can (the input
//! has the result's shape and nothing reads it later), so a chain of pointwise ops
//! runs in one buffer.

use super::{cow, shape_str, val, Arg, Elem, KernelCtx};
use crate::value::Value;
use distc_ir::shape::broadcast_shapes;
use ndarray::{IxDyn, Zip};

/// `f` applied to every element; in place when `x` is owned.
pub(super) fn unary<A: Elem>(x: Arg<'_>, f: impl Fn(A) -> A) -> Result<Value, String> {
    let x = cow::<A>(x, 0)?;
    if x.is_view() {
        Ok(val(x.mapv(f)))
    } else {
        let mut o = x.into_owned();
        o.mapv_inplace(f);
        Ok(val(o))
    }
}

/// `f(a, b)` with numpy broadcasting; written into whichever owned input already has
/// the result's shape, else into a new array.
pub(super) fn binary<A: Elem>(
    a: Arg<'_>,
    b: Arg<'_>,
    f: impl Fn(A, A) -> A,
) -> Result<Value, String> {
    let (a, b) = (cow::<A>(a, 0)?, cow::<A>(b, 1)?);
    let shape = broadcast_shapes(a.shape(), b.shape()).ok_or_else(|| {
        format!(
            "shapes {} and {} do not broadcast",
            shape_str(a.shape()),
            shape_str(b.shape())
        )
    })?;
    let a_full = a.shape() == shape.as_slice();
    let b_full = b.shape() == shape.as_slice();
    let out = if a_full && a.is_owned() {
        let mut o = a.into_owned();
        Zip::from(&mut o)
            .and_broadcast(&b)
            .for_each(|x, &y| *x = f(*x, y));
        o
    } else if b_full && b.is_owned() {
        let mut o = b.into_owned();
        Zip::from(&mut o)
            .and_broadcast(&a)
            .for_each(|y, &x| *y = f(x, *y));
        o
    } else if a_full {
        Zip::from(&a)
            .and_broadcast(&b)
            .map_collect(|&x, &y| f(x, y))
    } else if b_full {
        Zip::from(&b)
            .and_broadcast(&a)
            .map_collect(|&y, &x| f(x, y))
    } else {
        // Both operands grow (e.g. [n,1] + [1,m]): broadcast both views.
        let dim = IxDyn(&shape);
        match (a.broadcast(dim.clone()), b.broadcast(dim)) {
            (Some(av), Some(bv)) => Zip::from(&av).and(&bv).map_collect(|&x, &y| f(x, y)),
            _ => return Err(format!("cannot broadcast to {}", shape_str(&shape))),
        }
    };
    Ok(val(out))
}

/// `f(a, b)` on two tensors of one shape (the activation gradients).
pub(super) fn binary_same<A: Elem>(
    a: Arg<'_>,
    b: Arg<'_>,
    f: impl Fn(A, A) -> A,
) -> Result<Value, String> {
    let (sa, sb) = (super::tensor(&a, 0)?.shape(), super::tensor(&b, 1)?.shape());
    if sa != sb {
        return Err(format!(
            "shapes differ: {} and {}",
            shape_str(sa),
            shape_str(sb)
        ));
    }
    binary(a, b, f)
}

/// Inverted dropout, also its gradient: the mask depends only on `(seed, ctx.step,
/// flat element index)`, so the backward op drops exactly the forward op's elements.
/// The identity outside training.
pub(super) fn dropout<A: Elem>(
    x: Arg<'_>,
    rate: f64,
    seed: u64,
    ctx: &KernelCtx,
) -> Result<Value, String> {
    if !(0.0..1.0).contains(&rate) {
        return Err(format!("rate {rate} is not in [0, 1)"));
    }
    let x = cow::<A>(x, 0)?;
    if !ctx.training || rate == 0.0 {
        return Ok(val(x.into_owned()));
    }
    let mask = DropoutMask::new(rate, seed, ctx.step);
    let scale = A::c(1.0 / (1.0 - rate));
    let mut o = x.into_owned();
    // Logical (row-major) order, whatever the memory layout: the index is the flat
    // row-major index in both the forward and the backward op.
    for (i, v) in o.iter_mut().enumerate() {
        *v = if mask.keep(i as u64) {
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
