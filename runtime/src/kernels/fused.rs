//! The kernel of a `fused` node: an element-wise expression over broadcast inputs,
//! evaluated in blocks of [`BLOCK`] elements so every intermediate stays in the L1
//! cache. The unfused chain reads and writes a whole tensor per op; this reads each
//! input once and writes the result once, whatever the number of steps.
//!
//! Each step runs as one tight loop over a block (a slice against a slice or against
//! a repeated scalar), which vectorises like the unfused kernels do. Steps whose
//! operands are all scalars (constants, one-element inputs) are folded once per call.
//! The per-element formulas are the unfused kernels' own (`sigmoid` uses the same
//! `fast_exp`), so a fused graph computes what the unfused one does.

use super::{cow, shape_str, val, Arg, Elem};
use crate::value::Value;
use distc_ir::shape::broadcast_shapes;
use distc_ir::{BinaryFn, FusedExpr, FusedStep, UnaryFn};
use ndarray::{ArrayD, CowArray, IxDyn};

/// Elements per block: a few blocks of f64 fit in L1 with room for the inputs' lines.
const BLOCK: usize = 1024;

/// How an input is read, per block.
enum Source<'a, A> {
    /// As many elements as the result, in its order: a sub-slice per block.
    Full(&'a [A]),
    /// One element, repeated.
    Splat(A),
    /// Broadcast along some axes: gathered per block. `axes` are `(size, stride)`,
    /// innermost first, size-1 axes dropped, contiguous neighbours merged.
    Gather(&'a [A], Vec<(usize, usize)>),
    /// The input whose buffer became the result's: a sub-slice of the result, read
    /// before the block is overwritten.
    Out,
}

/// Where a step's value lives during a block.
#[derive(Clone, Copy)]
enum Place<A> {
    /// A value known for the whole call.
    Scalar(A),
    /// Input `k`, read in place.
    Input(usize),
    /// The reused input, read from the result buffer.
    Out,
    /// A scratch buffer.
    Slot(usize),
}

/// A step's operand in one block.
#[derive(Clone, Copy)]
enum View<'a, A> {
    Slice(&'a [A]),
    Scalar(A),
}

/// Evaluates `expr` over `args`; the result has the broadcast shape of the inputs. An
/// owned input of that shape and type lends its buffer to the result.
pub(super) fn fused<A: Elem>(expr: &FusedExpr, args: Vec<Arg<'_>>) -> Result<Value, String> {
    expr.check(args.len())?;
    let mut arrays: Vec<CowArray<'_, A, IxDyn>> = args
        .into_iter()
        .enumerate()
        .map(|(i, a)| cow::<A>(a, i))
        .collect::<Result<_, _>>()?;
    let mut shape: Vec<usize> = Vec::new();
    for (i, a) in arrays.iter().enumerate() {
        shape = broadcast_shapes(&shape, a.shape()).ok_or_else(|| {
            format!(
                "input {i} ({}) does not broadcast with {}",
                shape_str(a.shape()),
                shape_str(&shape)
            )
        })?;
    }
    let n: usize = shape.iter().product();
    // Every input must be readable as a row-major slice.
    for a in arrays.iter_mut() {
        if !a.is_standard_layout() {
            *a = CowArray::from(a.as_standard_layout().into_owned());
        }
    }
    let reuse = arrays
        .iter()
        .position(|a| a.is_owned() && a.shape() == shape.as_slice());
    let mut out: Vec<A> = match reuse {
        Some(k) => {
            let taken = std::mem::replace(&mut arrays[k], CowArray::from(ArrayD::zeros(IxDyn(&[0]))));
            match taken.into_owned().into_raw_vec_and_offset() {
                (v, Some(0) | None) if v.len() == n => v,
                // A buffer that holds more than the array (a sliced owner) is copied.
                (v, off) => {
                    let start = off.unwrap_or(0);
                    v.get(start..start + n)
                        .ok_or("an owned input's buffer is shorter than its shape")?
                        .to_vec()
                }
            }
        }
        None => Vec::with_capacity(n),
    };
    let sources: Vec<Source<'_, A>> = arrays
        .iter()
        .enumerate()
        .map(|(k, a)| {
            if Some(k) == reuse {
                return Ok(Source::Out);
            }
            let data = a.as_slice().ok_or("a standard-layout array is not contiguous")?;
            Ok(match data.len() {
                len if len == n => Source::Full(data),
                1 => Source::Splat(data[0]),
                _ => Source::Gather(data, broadcast_axes(&shape, a.shape())),
            })
        })
        .collect::<Result<_, String>>()?;
    let plan = Plan::new(expr, &sources);
    let mut slots: Vec<Vec<A>> = (0..plan.slots).map(|_| vec![A::zero(); BLOCK]).collect();
    let root = plan.places.len() - 1;
    let mut lo = 0;
    while lo < n {
        let hi = (lo + BLOCK).min(n);
        let len = hi - lo;
        for (i, step) in expr.steps.iter().enumerate() {
            let Place::Slot(s) = plan.places[i] else {
                continue;
            };
            let mut dst = std::mem::take(&mut slots[s]);
            let d = &mut dst[..len];
            let view = |p: Place<A>| -> View<'_, A> {
                match p {
                    Place::Scalar(v) => View::Scalar(v),
                    Place::Input(k) => match &sources[k] {
                        Source::Full(x) => View::Slice(&x[lo..hi]),
                        Source::Splat(v) => View::Scalar(*v),
                        // Gathered inputs and the result buffer have slots or `Out`.
                        Source::Gather(..) | Source::Out => View::Scalar(A::zero()),
                    },
                    Place::Out => View::Slice(&out[lo..hi]),
                    Place::Slot(s) => View::Slice(&slots[s][..len]),
                }
            };
            match *step {
                FusedStep::Input(k) => {
                    if let Source::Gather(data, axes) = &sources[k] {
                        gather(data, axes, lo, d);
                    }
                }
                FusedStep::Const(_) => {}
                FusedStep::Unary(f, a) => unary(f, view(plan.places[a]), d),
                FusedStep::Binary(f, a, b) => {
                    binary(f, view(plan.places[a]), view(plan.places[b]), d)
                }
            }
            slots[s] = dst;
        }
        // The result: from its slot, or (an expression that is one leaf) its source.
        let result: View<'_, A> = match plan.places[root] {
            Place::Scalar(v) => View::Scalar(v),
            Place::Slot(s) => View::Slice(&slots[s][..len]),
            Place::Input(k) => match &sources[k] {
                Source::Full(x) => View::Slice(&x[lo..hi]),
                Source::Splat(v) => View::Scalar(*v),
                Source::Gather(..) | Source::Out => View::Scalar(A::zero()),
            },
            Place::Out => View::Scalar(A::zero()),
        };
        if reuse.is_some() {
            // `Out` as the result means the expression is the reused input itself.
            if !matches!(plan.places[root], Place::Out) {
                match result {
                    View::Slice(r) => out[lo..hi].copy_from_slice(r),
                    View::Scalar(v) => out[lo..hi].fill(v),
                }
            }
        } else {
            match result {
                View::Slice(r) => out.extend_from_slice(r),
                View::Scalar(v) => out.resize(hi, v),
            }
        }
        lo = hi;
    }
    ArrayD::from_shape_vec(IxDyn(&shape), out)
        .map(val)
        .map_err(|e| format!("result of shape {}: {e}", shape_str(&shape)))
}

/// Where each step lives, and how many scratch buffers a block needs.
struct Plan<A> {
    places: Vec<Place<A>>,
    slots: usize,
}

impl<A: Elem> Plan<A> {
    /// Folds scalar steps, and gives every other computed (or gathered) step a scratch
    /// buffer, reusing the buffers of steps no later step reads.
    fn new(expr: &FusedExpr, sources: &[Source<'_, A>]) -> Plan<A> {
        let steps = &expr.steps;
        let mut last_use: Vec<usize> = (0..steps.len()).collect();
        for (i, s) in steps.iter().enumerate() {
            for a in s.operands() {
                last_use[a] = i;
            }
        }
        if let Some(l) = last_use.last_mut() {
            *l = usize::MAX;
        }
        let mut places: Vec<Place<A>> = Vec::with_capacity(steps.len());
        let mut free: Vec<usize> = Vec::new();
        let mut slots = 0;
        let mut alloc = |free: &mut Vec<usize>| {
            free.pop().unwrap_or_else(|| {
                slots += 1;
                slots - 1
            })
        };
        for (i, s) in steps.iter().enumerate() {
            let place = match *s {
                FusedStep::Input(k) => match &sources[k] {
                    Source::Full(_) => Place::Input(k),
                    Source::Splat(v) => Place::Scalar(*v),
                    Source::Gather(..) => Place::Slot(alloc(&mut free)),
                    Source::Out => Place::Out,
                },
                FusedStep::Const(c) => Place::Scalar(A::c(c)),
                FusedStep::Unary(f, a) => match places[a] {
                    Place::Scalar(x) => Place::Scalar(unary_fn(f)(x)),
                    _ => Place::Slot(alloc(&mut free)),
                },
                FusedStep::Binary(f, a, b) => match (places[a], places[b]) {
                    (Place::Scalar(x), Place::Scalar(y)) => Place::Scalar(binary_fn(f)(x, y)),
                    _ => Place::Slot(alloc(&mut free)),
                },
            };
            places.push(place);
            // Operands freed after the result is placed: a step never writes a buffer
            // it reads.
            for a in s.operands() {
                if last_use[a] == i {
                    if let Place::Slot(x) = places[a] {
                        if !free.contains(&x) {
                            free.push(x);
                        }
                    }
                }
            }
        }
        Plan { places, slots }
    }
}

/// The per-element function, as the unfused kernel computes it.
fn unary_fn<A: Elem>(f: UnaryFn) -> fn(A) -> A {
    match f {
        UnaryFn::Neg => |v: A| -v,
        UnaryFn::Relu => |v: A| if v > A::zero() { v } else { A::zero() },
        UnaryFn::Sigmoid => |v: A| A::one() / (A::one() + (-v).fast_exp()),
        UnaryFn::Tanh => |v: A| v.tanh(),
        UnaryFn::Exp => |v: A| v.exp(),
        UnaryFn::Log => |v: A| v.ln(),
        UnaryFn::Step => |v: A| if v > A::zero() { A::one() } else { A::zero() },
    }
}

fn binary_fn<A: Elem>(f: BinaryFn) -> fn(A, A) -> A {
    match f {
        BinaryFn::Add => |x: A, y: A| x + y,
        BinaryFn::Sub => |x: A, y: A| x - y,
        BinaryFn::Mul => |x: A, y: A| x * y,
        BinaryFn::Div => |x: A, y: A| x / y,
    }
}

/// One unary step over a block. Dispatches once per block to a loop with the function
/// inlined (a `fn` pointer called per element would not vectorise).
fn unary<A: Elem>(f: UnaryFn, x: View<'_, A>, d: &mut [A]) {
    #[inline(always)]
    fn run<A: Elem>(x: View<'_, A>, d: &mut [A], f: impl Fn(A) -> A) {
        match x {
            View::Slice(x) => d.iter_mut().zip(x).for_each(|(d, &v)| *d = f(v)),
            View::Scalar(v) => d.fill(f(v)),
        }
    }
    match f {
        UnaryFn::Neg => run(x, d, |v: A| -v),
        UnaryFn::Relu => run(x, d, |v: A| if v > A::zero() { v } else { A::zero() }),
        UnaryFn::Sigmoid => run(x, d, |v: A| A::one() / (A::one() + (-v).fast_exp())),
        UnaryFn::Tanh => run(x, d, |v: A| v.tanh()),
        UnaryFn::Exp => run(x, d, |v: A| v.exp()),
        UnaryFn::Log => run(x, d, |v: A| v.ln()),
        UnaryFn::Step => run(x, d, |v: A| if v > A::zero() { A::one() } else { A::zero() }),
    }
}

/// One binary step over a block.
fn binary<A: Elem>(f: BinaryFn, x: View<'_, A>, y: View<'_, A>, d: &mut [A]) {
    #[inline(always)]
    fn run<A: Elem>(x: View<'_, A>, y: View<'_, A>, d: &mut [A], f: impl Fn(A, A) -> A) {
        match (x, y) {
            (View::Slice(x), View::Slice(y)) => d
                .iter_mut()
                .zip(x.iter().zip(y))
                .for_each(|(d, (&a, &b))| *d = f(a, b)),
            (View::Slice(x), View::Scalar(b)) => {
                d.iter_mut().zip(x).for_each(|(d, &a)| *d = f(a, b))
            }
            (View::Scalar(a), View::Slice(y)) => {
                d.iter_mut().zip(y).for_each(|(d, &b)| *d = f(a, b))
            }
            (View::Scalar(a), View::Scalar(b)) => d.fill(f(a, b)),
        }
    }
    match f {
        BinaryFn::Add => run(x, y, d, |a, b| a + b),
        BinaryFn::Sub => run(x, y, d, |a, b| a - b),
        BinaryFn::Mul => run(x, y, d, |a, b| a * b),
        BinaryFn::Div => run(x, y, d, |a, b| a / b),
    }
}

/// `(size, stride)` of each axis of `out` as read from a row-major `src` that
/// broadcasts to it: innermost first, stride 0 where `src` repeats, size-1 axes
/// dropped, neighbours merged where `src` is contiguous (or repeats) across them.
fn broadcast_axes(out: &[usize], src: &[usize]) -> Vec<(usize, usize)> {
    let lead = out.len() - src.len().min(out.len());
    let mut axes: Vec<(usize, usize)> = Vec::with_capacity(out.len());
    let mut stride = 1;
    for i in (0..out.len()).rev() {
        let sd = if i >= lead { src[i - lead] } else { 1 };
        let st = if sd == 1 { 0 } else { stride };
        stride *= sd;
        if out[i] == 1 {
            continue;
        }
        match axes.last_mut() {
            Some((n, s)) if st == *s * *n => *n *= out[i],
            _ => axes.push((out[i], st)),
        }
    }
    axes
}

/// Fills `d` with elements `lo..lo + d.len()` (row-major) of `src` broadcast along
/// `axes`: a run of the innermost axis at a time, copied or repeated.
fn gather<A: Copy>(src: &[A], axes: &[(usize, usize)], lo: usize, d: &mut [A]) {
    let Some(&(n0, s0)) = axes.first() else {
        if let Some(&v) = src.first() {
            d.fill(v);
        }
        return;
    };
    // The index along each axis of element `lo`.
    let mut idx: Vec<usize> = Vec::with_capacity(axes.len());
    let mut rest = lo;
    for &(n, _) in axes {
        idx.push(rest % n);
        rest /= n;
    }
    let mut done = 0;
    while done < d.len() {
        let off: usize = idx.iter().zip(axes).map(|(&i, &(_, s))| i * s).sum();
        let run = (n0 - idx[0]).min(d.len() - done);
        let dst = &mut d[done..done + run];
        if s0 == 0 {
            dst.fill(src[off]);
        } else {
            dst.copy_from_slice(&src[off..off + run]);
        }
        done += run;
        idx[0] += run;
        // Odometer over the outer axes.
        for k in 0..axes.len() {
            if idx[k] < axes[k].0 {
                break;
            }
            idx[k] = 0;
            if let Some(next) = idx.get_mut(k + 1) {
                *next += 1;
            }
        }
    }
}
