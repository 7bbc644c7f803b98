//! The kernel of a `fused` node: an element-wise expression over broadcast inputs.
//!
//! The unfused chain reads and writes a whole tensor per op; this reads each input
//! once and writes the result once, whatever the number of steps. How:
//! - The result is walked in *runs*: spans of the innermost axes along which every
//!   input is either contiguous or one repeated element (a bias `[N]` against `[B, N]`
//!   gives runs of one row, where the bias is a plain slice). A run is cut into
//!   chunks of at most [`BLOCK`] elements, so intermediates stay in the L1 cache. When
//!   runs would be short (odd broadcasts), the whole result is one run and the inputs
//!   that do not fit are gathered per chunk instead.
//! - Each step is one tight loop over a chunk (slice against slice, or against a
//!   repeated scalar), which vectorises like the unfused kernels. A step that reads a
//!   single-use unary step, or feeds a unary step, runs as one loop with both functions
//!   (`relu(add(x, b))`, `mul(dy, step(x))`), so the common bias-activation and
//!   activation-gradient pairs touch memory as often as one unfused op. The last step
//!   writes straight into the result, which is an owned input's buffer when one has
//!   the result's shape.
//! - Steps whose operands are all scalars (constants, one-element inputs) are folded
//!   once per call.
//!
//! The per-element formulas are the unfused kernels' own (`sigmoid` uses the same
//! `fast_exp`), so a fused graph computes what the unfused one does.

use super::{cow, val, Arg, CpuKernelError, Elem, ShapeCheck};
use crate::core::value::Value;
use distc_ir::fused::{GELU_TANH_C, GELU_TANH_K};
use distc_ir::shape::broadcast_shapes;
use distc_ir::{BinaryFn, FusedExpr, FusedStep, UnaryFn};
use ndarray::{ArrayD, CowArray, IxDyn};

/// Elements per chunk: a few chunks of f64 fit in L1 with room for the inputs' lines.
const BLOCK: usize = 1024;

/// Runs shorter than this are not worth a loop each: the kernel gathers instead.
const MIN_RUN: usize = 64;

/// How an input is read within a run.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Contiguous along the run: a sub-slice.
    Contiguous,
    /// One element repeated along the run.
    Repeated,
    /// Gathered element by element (only when the whole result is one run).
    Gathered,
    /// The input whose buffer became the result's.
    Out,
}

struct Input<'a, A> {
    data: &'a [A],
    mode: Mode,
    /// Stride of each output axis outside the run (0 where the input repeats).
    outer: Vec<usize>,
    /// For gathered inputs: merged `(size, stride)` axes, innermost first.
    axes: Vec<(usize, usize)>,
}

/// Where a step's value lives.
#[derive(Clone, Copy)]
enum Place<A> {
    /// Known for the whole call.
    Scalar(A),
    /// Input `k`, read per chunk.
    Input(usize),
    /// A scratch buffer.
    Slot(usize),
    /// Folded into the step that reads it.
    Absorbed,
}

/// One loop of the plan. Operands are steps; a composed instruction applies two
/// functions in one loop.
#[derive(Clone, Copy)]
enum Instr {
    Unary(UnaryFn, usize),
    Binary(BinaryFn, usize, usize),
    /// `g(f(a, b))`: an activation after a bias add.
    BinaryThen(BinaryFn, UnaryFn, usize, usize),
    /// `f(a, g(b))`: `dy * step(x)`.
    BinaryOfUnary(BinaryFn, UnaryFn, usize, usize),
}

/// An operand within one chunk.
#[derive(Clone, Copy)]
enum Src<'a, A> {
    Slice(&'a [A]),
    Scalar(A),
    /// The destination itself (the reused input, read where the result is written).
    Dst,
}

/// Evaluates `expr` over `args`; the result has the broadcast shape of the inputs. An
/// owned input of that shape and type lends its buffer to the result.
pub(super) fn fused<A: Elem>(
    expr: &FusedExpr,
    args: Vec<Arg<'_>>,
) -> Result<Value, CpuKernelError> {
    expr.check(args.len()).map_err(CpuKernelError::Invalid)?;
    let mut arrays: Vec<CowArray<'_, A, IxDyn>> = args
        .into_iter()
        .enumerate()
        .map(|(i, a)| cow::<A>(a, i))
        .collect::<Result<_, _>>()?;
    let mut shape: Vec<usize> = Vec::new();
    for (i, a) in arrays.iter().enumerate() {
        shape = broadcast_shapes(&shape, a.shape()).ok_or_else(|| CpuKernelError::Shapes {
            check: ShapeCheck::FusedBroadcast(i),
            left: a.shape().to_vec(),
            right: shape.clone(),
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
            let empty = CowArray::from(ArrayD::zeros(IxDyn(&[0])));
            match std::mem::replace(&mut arrays[k], empty)
                .into_owned()
                .into_raw_vec_and_offset()
            {
                (v, Some(0) | None) if v.len() == n => v,
                // A buffer that holds more than the array (a sliced owner) is copied.
                (v, off) => {
                    let start = off.unwrap_or(0);
                    v.get(start..start + n)
                        .ok_or_else(|| {
                            CpuKernelError::Invalid(
                                "an owned input's buffer is shorter than its shape".into(),
                            )
                        })?
                        .to_vec()
                }
            }
        }
        None => vec![A::zero(); n],
    };
    if n > 0 {
        let inputs = layout(&arrays, &shape, reuse)?;
        let run = inputs.run;
        let plan = Plan::new(expr, &inputs.inputs);
        Exec {
            expr,
            plan: &plan,
            inputs: &inputs.inputs,
            slots: (0..plan.slots).map(|_| vec![A::zero(); BLOCK]).collect(),
            offsets: vec![0; inputs.inputs.len()],
        }
        .all(&mut out, &shape, run);
    }
    ArrayD::from_shape_vec(IxDyn(&shape), out)
        .map(val)
        .map_err(|error| CpuKernelError::Layout {
            what: "result of shape",
            shape,
            error,
        })
}

struct Layout<'a, A> {
    inputs: Vec<Input<'a, A>>,
    /// Elements per run.
    run: usize,
}

/// Chooses the run length and how each input is read.
fn layout<'a, A: Elem>(
    arrays: &'a [CowArray<'_, A, IxDyn>],
    shape: &[usize],
    reuse: Option<usize>,
) -> Result<Layout<'a, A>, CpuKernelError> {
    let rank = shape.len();
    let n: usize = shape.iter().product();
    // Per input, per output axis: its stride (0 where it repeats).
    let strides: Vec<Vec<usize>> = arrays
        .iter()
        .enumerate()
        .map(|(k, a)| {
            // The reused input's array is already the result's buffer: it has the
            // result's shape.
            let src = if Some(k) == reuse { shape } else { a.shape() };
            let lead = rank.saturating_sub(src.len());
            let mut st = vec![0; rank];
            let mut s = 1;
            for i in (0..rank).rev() {
                let d = if i >= lead { src[i - lead] } else { 1 };
                st[i] = if d == 1 { 0 } else { s };
                s *= d;
            }
            st
        })
        .collect();
    // The innermost axes along which every input keeps one mode.
    let mut inner = 0;
    let mut run = 1;
    let mut modes: Vec<Option<Mode>> = vec![None; arrays.len()];
    for axis in (0..rank).rev() {
        if shape[axis] == 1 {
            inner += 1;
            continue;
        }
        let mut ok = true;
        let mut next = modes.clone();
        for (k, st) in strides.iter().enumerate() {
            let m = if st[axis] == 0 {
                Mode::Repeated
            } else if st[axis] == run {
                Mode::Contiguous
            } else {
                ok = false;
                break;
            };
            if next[k].is_some_and(|old| old != m) {
                ok = false;
                break;
            }
            next[k] = Some(m);
        }
        if !ok {
            break;
        }
        modes = next;
        inner += 1;
        run *= shape[axis];
    }
    let one_run = run < MIN_RUN && run < n;
    let run = if one_run { n } else { run };
    let outer_axes = rank - inner;
    let inputs = arrays
        .iter()
        .enumerate()
        .map(|(k, a)| {
            let data = a
                .as_slice()
                .ok_or(CpuKernelError::NotContiguous("a standard-layout array"))?;
            let mode = if Some(k) == reuse {
                Mode::Out
            } else if data.len() == 1 {
                Mode::Repeated
            } else if one_run {
                if data.len() == n {
                    Mode::Contiguous
                } else {
                    Mode::Gathered
                }
            } else {
                modes[k].unwrap_or(Mode::Repeated)
            };
            let axes = if mode == Mode::Gathered {
                gather_axes(shape, a.shape())
            } else {
                Vec::new()
            };
            Ok(Input {
                data,
                mode,
                outer: if one_run {
                    Vec::new()
                } else {
                    strides[k][..outer_axes].to_vec()
                },
                axes,
            })
        })
        .collect::<Result<_, CpuKernelError>>()?;
    Ok(Layout { inputs, run })
}

/// Where each step lives, the loops to run, and how many scratch buffers they need.
struct Plan<A> {
    places: Vec<Place<A>>,
    /// `(step, instruction)`, in step order; the last computes the result.
    instrs: Vec<(usize, Instr)>,
    slots: usize,
}

impl<A: Elem> Plan<A> {
    fn new(expr: &FusedExpr, inputs: &[Input<'_, A>]) -> Plan<A> {
        let steps = &expr.steps;
        let last = steps.len() - 1;
        let mut uses = vec![0usize; steps.len()];
        for s in steps {
            for a in s.operands() {
                uses[a] += 1;
            }
        }
        // Fold scalars; everything else is computed per chunk.
        let mut places: Vec<Place<A>> = Vec::with_capacity(steps.len());
        for s in steps {
            let p = match *s {
                FusedStep::Input(k) => match inputs[k].mode {
                    Mode::Repeated if inputs[k].data.len() == 1 => Place::Scalar(inputs[k].data[0]),
                    _ => Place::Input(k),
                },
                FusedStep::Const(c) => Place::Scalar(A::c(c)),
                FusedStep::Unary(f, a) => match places[a] {
                    Place::Scalar(x) => Place::Scalar(unary_fn(f)(x)),
                    _ => Place::Slot(usize::MAX),
                },
                FusedStep::Binary(f, a, b) => match (places[a], places[b]) {
                    (Place::Scalar(x), Place::Scalar(y)) => Place::Scalar(binary_fn(f)(x, y)),
                    _ => Place::Slot(usize::MAX),
                },
            };
            places.push(p);
        }
        // Compose pairs: a single-use step computed per chunk folds into its reader.
        let computed = |places: &[Place<A>], i: usize| matches!(places[i], Place::Slot(_));
        let mut instrs: Vec<(usize, Instr)> = Vec::new();
        let mut composes = vec![false; steps.len()];
        for (i, s) in steps.iter().enumerate() {
            if !computed(&places, i) {
                continue;
            }
            let instr = match *s {
                FusedStep::Unary(g, a)
                    if composable_after(g)
                        && uses[a] == 1
                        && computed(&places, a)
                        && !composes[a]
                        && matches!(steps[a], FusedStep::Binary(..)) =>
                {
                    let FusedStep::Binary(f, x, y) = steps[a] else {
                        continue;
                    };
                    places[a] = Place::Absorbed;
                    composes[i] = true;
                    Instr::BinaryThen(f, g, x, y)
                }
                FusedStep::Unary(f, a) => Instr::Unary(f, a),
                FusedStep::Binary(f, x, b) => match steps[b] {
                    FusedStep::Unary(g, y)
                        if composable_inside(g)
                            && uses[b] == 1
                            && computed(&places, b)
                            && !composes[b] =>
                    {
                        places[b] = Place::Absorbed;
                        composes[i] = true;
                        Instr::BinaryOfUnary(f, g, x, y)
                    }
                    _ => Instr::Binary(f, x, b),
                },
                FusedStep::Input(_) | FusedStep::Const(_) => continue,
            };
            instrs.push((i, instr));
        }
        // A step absorbed after it was listed (its reader came later) is dropped.
        instrs.retain(|&(i, _)| !matches!(places[i], Place::Absorbed));
        // Scratch buffers: one per computed step and per gathered input, reused once
        // no later loop reads it. A loop never writes a buffer it reads.
        let mut last_read = vec![0usize; steps.len()];
        for &(i, ins) in &instrs {
            for a in instr_operands(ins) {
                last_read[a] = i;
            }
        }
        let mut free: Vec<usize> = Vec::new();
        let mut slots = 0;
        let mut alloc = |free: &mut Vec<usize>| {
            free.pop().unwrap_or_else(|| {
                slots += 1;
                slots - 1
            })
        };
        for (i, s) in steps.iter().enumerate() {
            if let FusedStep::Input(k) = *s {
                if inputs[k].mode == Mode::Gathered {
                    places[i] = Place::Slot(alloc(&mut free));
                }
            }
        }
        for &(i, ins) in &instrs {
            if i != last {
                places[i] = Place::Slot(alloc(&mut free));
            }
            for a in instr_operands(ins) {
                if last_read[a] == i {
                    if let Place::Slot(x) = places[a] {
                        if !free.contains(&x) {
                            free.push(x);
                        }
                    }
                }
            }
        }
        Plan {
            places,
            instrs,
            slots,
        }
    }
}

/// Unary functions worth a composed loop after a binary step: the activations.
fn composable_after(g: UnaryFn) -> bool {
    matches!(g, UnaryFn::Relu | UnaryFn::Sigmoid | UnaryFn::Tanh)
}

/// Unary functions worth a composed loop as a binary step's second operand.
fn composable_inside(g: UnaryFn) -> bool {
    matches!(g, UnaryFn::Step)
}

fn instr_operands(i: Instr) -> Vec<usize> {
    match i {
        Instr::Unary(_, a) => vec![a],
        Instr::Binary(_, a, b)
        | Instr::BinaryThen(_, _, a, b)
        | Instr::BinaryOfUnary(_, _, a, b) => {
            vec![a, b]
        }
    }
}

struct Exec<'p, 'a, A> {
    expr: &'p FusedExpr,
    plan: &'p Plan<A>,
    inputs: &'p [Input<'a, A>],
    slots: Vec<Vec<A>>,
    /// Each input's offset at the start of the current run.
    offsets: Vec<usize>,
}

impl<A: Elem> Exec<'_, '_, A> {
    /// Every run, every chunk.
    fn all(&mut self, out: &mut [A], shape: &[usize], run: usize) {
        let n = out.len();
        let outer_shape = &shape[..self.inputs.first().map_or(0, |i| i.outer.len())];
        let mut idx = vec![0usize; outer_shape.len()];
        let mut start = 0;
        while start < n {
            for (k, inp) in self.inputs.iter().enumerate() {
                self.offsets[k] = idx.iter().zip(&inp.outer).map(|(i, s)| i * s).sum();
            }
            let mut lo = 0;
            while lo < run {
                let len = BLOCK.min(run - lo);
                self.chunk(out, start, lo, len);
                lo += len;
            }
            start += run;
            for k in (0..idx.len()).rev() {
                idx[k] += 1;
                if idx[k] < outer_shape[k] {
                    break;
                }
                idx[k] = 0;
            }
        }
    }

    /// Elements `start + lo .. start + lo + len` of the result (`lo` within the run).
    fn chunk(&mut self, out: &mut [A], start: usize, lo: usize, len: usize) {
        let at = start + lo;
        let steps = &self.expr.steps;
        for (i, s) in steps.iter().enumerate() {
            if let (&FusedStep::Input(k), Place::Slot(slot)) = (s, self.plan.places[i]) {
                let inp = &self.inputs[k];
                gather(inp.data, &inp.axes, at, &mut self.slots[slot][..len]);
            }
        }
        let last = steps.len() - 1;
        for &(i, ins) in &self.plan.instrs {
            if i == last {
                break;
            }
            let Place::Slot(s) = self.plan.places[i] else {
                continue;
            };
            let mut dst = std::mem::take(&mut self.slots[s]);
            {
                let src = |a: usize| self.src(a, out, at, lo, len);
                run_instr(ins, &src, &mut dst[..len]);
            }
            self.slots[s] = dst;
        }
        // The result, written in place.
        let d = &mut out[at..at + len];
        match self.plan.instrs.last() {
            Some(&(i, ins)) if i == last => {
                let src = |a: usize| self.src_root(a, lo, len);
                run_instr(ins, &src, d);
            }
            // The result is a leaf or a folded scalar.
            _ => match self.src_root(last, lo, len) {
                Src::Slice(x) => d.copy_from_slice(x),
                Src::Scalar(v) => d.fill(v),
                Src::Dst => {}
            },
        }
    }

    /// Step `a`'s value in a chunk, for a loop writing a scratch buffer.
    fn src<'s>(&'s self, a: usize, out: &'s [A], at: usize, lo: usize, len: usize) -> Src<'s, A> {
        match self.plan.places[a] {
            Place::Scalar(v) => Src::Scalar(v),
            Place::Slot(s) => Src::Slice(&self.slots[s][..len]),
            Place::Input(k) => match self.input(k, lo, len) {
                Src::Dst => Src::Slice(&out[at..at + len]),
                s => s,
            },
            // No loop reads an absorbed step: its reader computes it (see `Plan::new`).
            Place::Absorbed => Src::Scalar(A::zero()),
        }
    }

    /// Step `a`'s value in a chunk, for the loop writing the result (the reused input
    /// is the destination itself).
    fn src_root(&self, a: usize, lo: usize, len: usize) -> Src<'_, A> {
        match self.plan.places[a] {
            Place::Scalar(v) => Src::Scalar(v),
            Place::Slot(s) => Src::Slice(&self.slots[s][..len]),
            Place::Input(k) => self.input(k, lo, len),
            // No loop reads an absorbed step: its reader computes it (see `Plan::new`).
            Place::Absorbed => Src::Scalar(A::zero()),
        }
    }

    fn input(&self, k: usize, lo: usize, len: usize) -> Src<'_, A> {
        let inp = &self.inputs[k];
        let off = self.offsets[k];
        match inp.mode {
            Mode::Contiguous => Src::Slice(&inp.data[off + lo..off + lo + len]),
            Mode::Repeated => Src::Scalar(inp.data[off]),
            Mode::Out => Src::Dst,
            // Gathered inputs have slots (see `chunk`).
            Mode::Gathered => Src::Scalar(A::zero()),
        }
    }
}

/// The per-element function, as the unfused kernel computes it.
fn unary_fn<A: Elem>(f: UnaryFn) -> fn(A) -> A {
    match f {
        UnaryFn::Neg => |v: A| -v,
        UnaryFn::Relu => relu,
        UnaryFn::Sigmoid => sigmoid,
        UnaryFn::Tanh => |v: A| v.tanh(),
        UnaryFn::Exp => |v: A| v.exp(),
        UnaryFn::Log => |v: A| v.ln(),
        UnaryFn::Step => step,
        UnaryFn::Sqrt => |v: A| v.sqrt(),
        UnaryFn::Rsqrt => |v: A| A::one() / v.sqrt(),
        UnaryFn::Gelu => gelu,
        UnaryFn::GeluTanh => gelu_tanh,
        UnaryFn::Silu => |v: A| v * sigmoid(v),
        UnaryFn::GeluDerivative => gelu_derivative,
        UnaryFn::GeluTanhDerivative => gelu_tanh_derivative,
        UnaryFn::SiluDerivative => |v: A| {
            let s = sigmoid(v);
            s * (A::one() + v * (A::one() - s))
        },
    }
}

#[inline(always)]
fn normal_cdf<A: Elem>(v: A) -> A {
    A::c(0.5) * (A::one() + (v * A::c(std::f64::consts::FRAC_1_SQRT_2)).erf())
}

#[inline(always)]
fn gelu<A: Elem>(v: A) -> A {
    v * normal_cdf(v)
}

#[inline(always)]
fn gelu_derivative<A: Elem>(v: A) -> A {
    let pdf = (A::c(-0.5) * v * v).exp() * A::c(1.0 / (2.0 * std::f64::consts::PI).sqrt());
    normal_cdf(v) + v * pdf
}

#[inline(always)]
fn gelu_tanh<A: Elem>(v: A) -> A {
    let inner = A::c(GELU_TANH_C) * (v + A::c(GELU_TANH_K) * v * v * v);
    A::c(0.5) * v * (A::one() + inner.tanh())
}

#[inline(always)]
fn gelu_tanh_derivative<A: Elem>(v: A) -> A {
    let t = (A::c(GELU_TANH_C) * (v + A::c(GELU_TANH_K) * v * v * v)).tanh();
    let du = A::c(GELU_TANH_C) * (A::one() + A::c(3.0 * GELU_TANH_K) * v * v);
    A::c(0.5) * (A::one() + t) + A::c(0.5) * v * (A::one() - t * t) * du
}

fn binary_fn<A: Elem>(f: BinaryFn) -> fn(A, A) -> A {
    match f {
        BinaryFn::Add => |x: A, y: A| x + y,
        BinaryFn::Sub => |x: A, y: A| x - y,
        BinaryFn::Mul => |x: A, y: A| x * y,
        BinaryFn::Div => |x: A, y: A| x / y,
        BinaryFn::Pow => |x: A, y: A| x.powf(y),
        BinaryFn::Less => |x: A, y: A| truth(x < y),
        BinaryFn::LessEqual => |x: A, y: A| truth(x <= y),
        BinaryFn::Greater => |x: A, y: A| truth(x > y),
        BinaryFn::GreaterEqual => |x: A, y: A| truth(x >= y),
        BinaryFn::Equal => |x: A, y: A| truth(x == y),
        BinaryFn::NotEqual => |x: A, y: A| truth(x != y),
        BinaryFn::Keep => |c: A, y: A| if c != A::zero() { y } else { A::zero() },
    }
}

#[inline(always)]
fn truth<A: Elem>(t: bool) -> A {
    if t {
        A::one()
    } else {
        A::zero()
    }
}

#[inline(always)]
fn relu<A: Elem>(v: A) -> A {
    if v > A::zero() {
        v
    } else {
        A::zero()
    }
}

#[inline(always)]
fn sigmoid<A: Elem>(v: A) -> A {
    A::one() / (A::one() + (-v).fast_exp())
}

#[inline(always)]
fn step<A: Elem>(v: A) -> A {
    if v > A::zero() {
        A::one()
    } else {
        A::zero()
    }
}

/// Runs one instruction into `d`. Dispatches once per chunk to a loop with the
/// functions inlined (a function pointer called per element would not vectorise).
fn run_instr<'s, A: Elem>(ins: Instr, src: &impl Fn(usize) -> Src<'s, A>, d: &mut [A]) {
    match ins {
        Instr::Unary(f, a) => {
            let x = src(a);
            match f {
                UnaryFn::Neg => unary_loop(x, d, |v: A| -v),
                UnaryFn::Relu => unary_loop(x, d, relu),
                UnaryFn::Sigmoid => unary_loop(x, d, sigmoid),
                UnaryFn::Tanh => unary_loop(x, d, |v: A| v.tanh()),
                UnaryFn::Exp => unary_loop(x, d, |v: A| v.exp()),
                UnaryFn::Log => unary_loop(x, d, |v: A| v.ln()),
                UnaryFn::Step => unary_loop(x, d, step),
                UnaryFn::Gelu => unary_loop(x, d, gelu),
                UnaryFn::GeluTanh => unary_loop(x, d, gelu_tanh),
                other => unary_loop(x, d, unary_fn::<A>(other)),
            }
        }
        Instr::Binary(f, a, b) => {
            let (x, y) = (src(a), src(b));
            match f {
                BinaryFn::Add => binary_loop(x, y, d, |a, b| a + b),
                BinaryFn::Sub => binary_loop(x, y, d, |a, b| a - b),
                BinaryFn::Mul => binary_loop(x, y, d, |a, b| a * b),
                BinaryFn::Div => binary_loop(x, y, d, |a, b| a / b),
                other => binary_loop(x, y, d, binary_fn::<A>(other)),
            }
        }
        Instr::BinaryThen(f, g, a, b) => {
            let (x, y) = (src(a), src(b));
            macro_rules! then {
                ($g:expr) => {
                    match f {
                        BinaryFn::Add => binary_loop(x, y, d, |a, b| $g(a + b)),
                        BinaryFn::Sub => binary_loop(x, y, d, |a, b| $g(a - b)),
                        BinaryFn::Mul => binary_loop(x, y, d, |a, b| $g(a * b)),
                        BinaryFn::Div => binary_loop(x, y, d, |a, b| $g(a / b)),
                        other => {
                            let f = binary_fn::<A>(other);
                            binary_loop(x, y, d, |a, b| $g(f(a, b)))
                        }
                    }
                };
            }
            match g {
                UnaryFn::Relu => then!(relu),
                UnaryFn::Sigmoid => then!(sigmoid),
                UnaryFn::Tanh => then!(|v: A| v.tanh()),
                // `composable_after` admits only the three above.
                other => {
                    let g = unary_fn::<A>(other);
                    then!(g)
                }
            }
        }
        Instr::BinaryOfUnary(f, g, a, b) => {
            let (x, y) = (src(a), src(b));
            let h = |v: A| match g {
                UnaryFn::Step => step(v),
                other => unary_fn::<A>(other)(v),
            };
            match (f, g) {
                (BinaryFn::Mul, UnaryFn::Step) => binary_loop(x, y, d, |a, b| a * step(b)),
                (BinaryFn::Add, _) => binary_loop(x, y, d, |a, b| a + h(b)),
                (BinaryFn::Sub, _) => binary_loop(x, y, d, |a, b| a - h(b)),
                (BinaryFn::Mul, _) => binary_loop(x, y, d, |a, b| a * h(b)),
                (BinaryFn::Div, _) => binary_loop(x, y, d, |a, b| a / h(b)),
                (other, _) => {
                    let f = binary_fn::<A>(other);
                    binary_loop(x, y, d, |a, b| f(a, h(b)))
                }
            }
        }
    }
}

#[inline(always)]
fn unary_loop<A: Elem>(x: Src<'_, A>, d: &mut [A], f: impl Fn(A) -> A) {
    match x {
        Src::Slice(x) => d.iter_mut().zip(x).for_each(|(d, &v)| *d = f(v)),
        Src::Scalar(v) => d.fill(f(v)),
        Src::Dst => d.iter_mut().for_each(|d| *d = f(*d)),
    }
}

#[inline(always)]
fn binary_loop<A: Elem>(x: Src<'_, A>, y: Src<'_, A>, d: &mut [A], f: impl Fn(A, A) -> A) {
    match (x, y) {
        (Src::Slice(x), Src::Slice(y)) => d
            .iter_mut()
            .zip(x.iter().zip(y))
            .for_each(|(d, (&a, &b))| *d = f(a, b)),
        (Src::Slice(x), Src::Scalar(b)) => d.iter_mut().zip(x).for_each(|(d, &a)| *d = f(a, b)),
        (Src::Scalar(a), Src::Slice(y)) => d.iter_mut().zip(y).for_each(|(d, &b)| *d = f(a, b)),
        (Src::Scalar(a), Src::Scalar(b)) => d.fill(f(a, b)),
        (Src::Dst, Src::Slice(y)) => d.iter_mut().zip(y).for_each(|(d, &b)| *d = f(*d, b)),
        (Src::Slice(x), Src::Dst) => d.iter_mut().zip(x).for_each(|(d, &a)| *d = f(a, *d)),
        (Src::Dst, Src::Scalar(b)) => d.iter_mut().for_each(|d| *d = f(*d, b)),
        (Src::Scalar(a), Src::Dst) => d.iter_mut().for_each(|d| *d = f(a, *d)),
        (Src::Dst, Src::Dst) => d.iter_mut().for_each(|d| *d = f(*d, *d)),
    }
}

/// `(size, stride)` of each axis of `out` as read from a row-major `src` that
/// broadcasts to it: innermost first, stride 0 where `src` repeats, size-1 axes
/// dropped, neighbours merged where `src` is contiguous (or repeats) across them.
fn gather_axes(out: &[usize], src: &[usize]) -> Vec<(usize, usize)> {
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
