//! The expression a `fused` node computes: a chain of element-wise ops collapsed into
//! one node by the kernel-fusion pass, so a backend runs it as one loop (on the CPU)
//! or one generated kernel (on a GPU) instead of one pass over memory per op.
//!
//! The expression is a list of steps in SSA order; the last step is the result. Step
//! `Input(k)` reads the node's input `k`, broadcast by numpy rules to the node's output
//! shape (a bias `[N]` against `[B, N]`), so each element of the result depends only on
//! the same element (or its broadcast source) of each input.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// A one-argument element-wise function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryFn {
    /// `-x`.
    Neg,
    /// `max(x, 0)`.
    Relu,
    /// `1 / (1 + exp(-x))`.
    Sigmoid,
    /// `tanh(x)`.
    Tanh,
    /// `exp(x)`.
    Exp,
    /// `ln(x)`.
    Log,
    /// `1` where `x > 0`, else `0` (the derivative of relu).
    Step,
    /// `sqrt(x)`.
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// `x * Φ(x)`, `Φ` the standard normal CDF (`torch.nn.functional.gelu`).
    Gelu,
    /// GELU's tanh approximation, `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`
    /// (`gelu(approximate="tanh")`, GPT-2's).
    GeluTanh,
    /// `x * sigmoid(x)`.
    Silu,
    /// The derivative of `gelu` at `x` (its gradient rule reads it).
    GeluDerivative,
    /// The derivative of `gelu_tanh` at `x`.
    GeluTanhDerivative,
    /// The derivative of `silu` at `x`.
    SiluDerivative,
}

/// A two-argument element-wise function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryFn {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b`.
    Div,
    /// `a` to the power `b`.
    Pow,
    /// `1` where `a < b`, else `0`.
    Less,
    /// `1` where `a <= b`, else `0`.
    LessEqual,
    /// `1` where `a > b`, else `0`.
    Greater,
    /// `1` where `a >= b`, else `0`.
    GreaterEqual,
    /// `1` where `a == b`, else `0`.
    Equal,
    /// `1` where `a != b`, else `0`.
    NotEqual,
    /// `b` where `a != 0`, else exactly `0` (even where `b` is infinite or NaN): the
    /// half of `where(c, x, y) = keep(c, x) + keep(c == 0, y)` that masks, so a `-inf`
    /// on the side not chosen never reaches the sum.
    Keep,
}

/// One step of a [`FusedExpr`]; operands are indices of earlier steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FusedStep {
    /// The node's input `k`, broadcast to the output shape.
    Input(usize),
    /// A constant.
    Const(f64),
    /// `f(steps[a])`.
    Unary(UnaryFn, usize),
    /// `f(steps[a], steps[b])`.
    Binary(BinaryFn, usize, usize),
}

/// An element-wise expression over a fused node's inputs; the last step is the result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FusedExpr {
    /// The steps, each reading only earlier ones.
    pub steps: Vec<FusedStep>,
}

impl UnaryFn {
    /// The name in the IR's text form.
    pub fn name(self) -> &'static str {
        match self {
            UnaryFn::Neg => "neg",
            UnaryFn::Relu => "relu",
            UnaryFn::Sigmoid => "sigmoid",
            UnaryFn::Tanh => "tanh",
            UnaryFn::Exp => "exp",
            UnaryFn::Log => "log",
            UnaryFn::Step => "step",
            UnaryFn::Sqrt => "sqrt",
            UnaryFn::Rsqrt => "rsqrt",
            UnaryFn::Gelu => "gelu",
            UnaryFn::GeluTanh => "gelu_tanh",
            UnaryFn::Silu => "silu",
            UnaryFn::GeluDerivative => "gelu_derivative",
            UnaryFn::GeluTanhDerivative => "gelu_tanh_derivative",
            UnaryFn::SiluDerivative => "silu_derivative",
        }
    }
}

impl BinaryFn {
    /// The name in the IR's text form.
    pub fn name(self) -> &'static str {
        match self {
            BinaryFn::Add => "add",
            BinaryFn::Sub => "sub",
            BinaryFn::Mul => "mul",
            BinaryFn::Div => "div",
            BinaryFn::Pow => "pow",
            BinaryFn::Less => "less",
            BinaryFn::LessEqual => "less_equal",
            BinaryFn::Greater => "greater",
            BinaryFn::GreaterEqual => "greater_equal",
            BinaryFn::Equal => "equal",
            BinaryFn::NotEqual => "not_equal",
            BinaryFn::Keep => "keep",
        }
    }
}

impl UnaryFn {
    /// Every unary function, for parsing and tests.
    pub const ALL: [UnaryFn; 15] = [
        UnaryFn::Neg,
        UnaryFn::Relu,
        UnaryFn::Sigmoid,
        UnaryFn::Tanh,
        UnaryFn::Exp,
        UnaryFn::Log,
        UnaryFn::Step,
        UnaryFn::Sqrt,
        UnaryFn::Rsqrt,
        UnaryFn::Gelu,
        UnaryFn::GeluTanh,
        UnaryFn::Silu,
        UnaryFn::GeluDerivative,
        UnaryFn::GeluTanhDerivative,
        UnaryFn::SiluDerivative,
    ];

    /// The value at `x`, in f64: the reference the kernels (f32 loops, generated GPU
    /// code) are tested against.
    pub fn eval(self, x: f64) -> f64 {
        let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
        match self {
            UnaryFn::Neg => -x,
            UnaryFn::Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            UnaryFn::Sigmoid => sigmoid(x),
            UnaryFn::Tanh => x.tanh(),
            UnaryFn::Exp => x.exp(),
            UnaryFn::Log => x.ln(),
            UnaryFn::Step => f64::from(u8::from(x > 0.0)),
            UnaryFn::Sqrt => x.sqrt(),
            UnaryFn::Rsqrt => 1.0 / x.sqrt(),
            UnaryFn::Gelu => x * normal_cdf(x),
            UnaryFn::GeluTanh => 0.5 * x * (1.0 + gelu_tanh_inner(x).tanh()),
            UnaryFn::Silu => x * sigmoid(x),
            UnaryFn::GeluDerivative => normal_cdf(x) + x * normal_pdf(x),
            UnaryFn::GeluTanhDerivative => {
                let t = gelu_tanh_inner(x).tanh();
                let du = GELU_TANH_C * (1.0 + 3.0 * GELU_TANH_K * x * x);
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
            }
            UnaryFn::SiluDerivative => {
                let s = sigmoid(x);
                s * (1.0 + x * (1.0 - s))
            }
        }
    }
}

/// `√(2/π)`, GELU's tanh approximation's scale.
pub const GELU_TANH_C: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of GELU's tanh approximation.
pub const GELU_TANH_K: f64 = 0.044_715;

fn gelu_tanh_inner(x: f64) -> f64 {
    GELU_TANH_C * (x + GELU_TANH_K * x * x * x)
}

/// `Φ(x)`, the standard normal CDF.
fn normal_cdf(x: f64) -> f64 {
    0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
}

/// `φ(x)`, the standard normal density.
fn normal_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

impl BinaryFn {
    /// Every binary function, for parsing and tests.
    pub const ALL: [BinaryFn; 12] = [
        BinaryFn::Add,
        BinaryFn::Sub,
        BinaryFn::Mul,
        BinaryFn::Div,
        BinaryFn::Pow,
        BinaryFn::Less,
        BinaryFn::LessEqual,
        BinaryFn::Greater,
        BinaryFn::GreaterEqual,
        BinaryFn::Equal,
        BinaryFn::NotEqual,
        BinaryFn::Keep,
    ];

    /// The value at `(a, b)`, in f64 (see [`UnaryFn::eval`]).
    pub fn eval(self, a: f64, b: f64) -> f64 {
        let truth = |t: bool| f64::from(u8::from(t));
        match self {
            BinaryFn::Add => a + b,
            BinaryFn::Sub => a - b,
            BinaryFn::Mul => a * b,
            BinaryFn::Div => a / b,
            BinaryFn::Pow => a.powf(b),
            BinaryFn::Less => truth(a < b),
            BinaryFn::LessEqual => truth(a <= b),
            BinaryFn::Greater => truth(a > b),
            BinaryFn::GreaterEqual => truth(a >= b),
            BinaryFn::Equal => truth(a == b),
            BinaryFn::NotEqual => truth(a != b),
            BinaryFn::Keep => {
                if a != 0.0 {
                    b
                } else {
                    0.0
                }
            }
        }
    }

    /// Whether the result is a 0/1 truth value, with no gradient to either operand.
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryFn::Less
                | BinaryFn::LessEqual
                | BinaryFn::Greater
                | BinaryFn::GreaterEqual
                | BinaryFn::Equal
                | BinaryFn::NotEqual
        )
    }
}

impl FusedStep {
    /// The earlier steps this one reads.
    pub fn operands(&self) -> Vec<usize> {
        match *self {
            FusedStep::Input(_) | FusedStep::Const(_) => vec![],
            FusedStep::Unary(_, a) => vec![a],
            FusedStep::Binary(_, a, b) => vec![a, b],
        }
    }

    /// Whether the step is a leaf (an input or a constant), printed inline wherever read.
    pub fn is_leaf(&self) -> bool {
        matches!(self, FusedStep::Input(_) | FusedStep::Const(_))
    }
}

impl FusedExpr {
    /// Checks that the expression is well formed for a node with `inputs` inputs: at
    /// least one step, operands naming earlier steps, inputs in range, every input read.
    pub fn check(&self, inputs: usize) -> Result<(), String> {
        if self.steps.is_empty() {
            return Err("the expression has no steps".into());
        }
        let mut read = vec![false; inputs];
        for (i, s) in self.steps.iter().enumerate() {
            if let FusedStep::Input(k) = *s {
                match read.get_mut(k) {
                    Some(r) => *r = true,
                    None => {
                        return Err(format!(
                            "step {i} reads input {k}, but the node has {inputs} inputs"
                        ))
                    }
                }
            }
            if let Some(a) = s.operands().into_iter().find(|&a| a >= i) {
                return Err(format!("step {i} reads step {a}, which is not before it"));
            }
        }
        if let Some(k) = read.iter().position(|r| !r) {
            return Err(format!("input {k} is never read by the expression"));
        }
        Ok(())
    }

    /// How many times each step is read by later steps that the result depends on
    /// (steps it does not depend on count 0 and are not printed).
    fn use_counts(&self) -> Vec<usize> {
        let n = self.steps.len();
        let mut live = vec![false; n];
        if let Some(l) = live.last_mut() {
            *l = true;
        }
        let mut uses = vec![0; n];
        for i in (0..n).rev() {
            if !live[i] {
                continue;
            }
            for a in self.steps[i].operands() {
                if let Some(u) = uses.get_mut(a) {
                    *u += 1;
                    live[a] = true;
                }
            }
        }
        uses
    }

    /// The steps the text form names with a binding (`t0 = ...;`): the non-leaf steps
    /// the result reads more than once. Everything else prints inline, as a tree.
    fn bound(&self) -> Vec<usize> {
        self.use_counts()
            .iter()
            .enumerate()
            .filter(|&(i, &u)| u > 1 && !self.steps[i].is_leaf())
            .map(|(i, _)| i)
            .collect()
    }

    /// The expression with its steps in the order the text form lists them: each
    /// binding's tree (post-order, left operand first), then the result's, with equal
    /// leaves shared. `parse(print(e))` is `e.canonical()`, and the kernel-fusion pass
    /// only makes canonical expressions, so its graphs round-trip through text exactly.
    /// The structure (which step reads which) is kept: nothing but leaves is merged, and
    /// steps the result does not depend on are dropped.
    pub fn canonical(&self) -> FusedExpr {
        let mut b = Builder::default();
        let mut done: Vec<Option<usize>> = vec![None; self.steps.len()];
        let bound = self.bound();
        let root = self.steps.len().saturating_sub(1);
        for &i in bound.iter().chain(std::iter::once(&root)) {
            if i < self.steps.len() {
                self.emit(i, &bound, &mut done, &mut b);
            }
        }
        FusedExpr { steps: b.steps }
    }

    fn emit(
        &self,
        i: usize,
        bound: &[usize],
        done: &mut [Option<usize>],
        b: &mut Builder,
    ) -> usize {
        if let Some(j) = done[i] {
            return j;
        }
        let j = match self.steps[i] {
            FusedStep::Input(k) => b.input(k),
            FusedStep::Const(c) => b.constant(c),
            FusedStep::Unary(f, a) => {
                let a = self.emit(a, bound, done, b);
                b.push(FusedStep::Unary(f, a))
            }
            FusedStep::Binary(f, x, y) => {
                let x = self.emit(x, bound, done, b);
                let y = self.emit(y, bound, done, b);
                b.push(FusedStep::Binary(f, x, y))
            }
        };
        // Leaves are shared by value in the builder; only bindings are remembered by
        // position, so a tree read once is emitted where it is read.
        if bound.contains(&i) {
            done[i] = Some(j);
        }
        j
    }

    /// The inputs in the order the expression first reads them.
    pub fn input_order(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for s in &self.steps {
            if let FusedStep::Input(k) = *s {
                if !out.contains(&k) {
                    out.push(k);
                }
            }
        }
        out
    }
}

/// Builds steps, sharing equal leaves (an input read twice is one step).
#[derive(Default)]
pub(crate) struct Builder {
    pub(crate) steps: Vec<FusedStep>,
}

impl Builder {
    pub(crate) fn push(&mut self, s: FusedStep) -> usize {
        self.steps.push(s);
        self.steps.len() - 1
    }
    pub(crate) fn input(&mut self, k: usize) -> usize {
        match self.steps.iter().position(|s| *s == FusedStep::Input(k)) {
            Some(i) => i,
            None => self.push(FusedStep::Input(k)),
        }
    }
    pub(crate) fn constant(&mut self, c: f64) -> usize {
        let found = self.steps.iter().position(|s| match s {
            FusedStep::Const(x) => x.to_bits() == c.to_bits(),
            _ => false,
        });
        match found {
            Some(i) => i,
            None => self.push(FusedStep::Const(c)),
        }
    }
}

/// The text form: `relu(add(in0, in1))`; a non-leaf step read more than once is bound
/// first and named (`t0 = mul(in0, in1); add(t0, relu(t0))`); constants print so that
/// they parse back bit-exact (`1.0`, `-0.5`, `1e-8`).
impl fmt::Display for FusedExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bound = self.bound();
        let names: HashMap<usize, usize> = bound.iter().enumerate().map(|(n, &i)| (i, n)).collect();
        for (n, &i) in bound.iter().enumerate() {
            write!(f, "t{n} = ")?;
            self.write_tree(f, i, &names, false)?;
            f.write_str("; ")?;
        }
        match self.steps.len() {
            0 => Ok(()),
            n => self.write_tree(f, n - 1, &names, true),
        }
    }
}

impl FusedExpr {
    fn write_tree(
        &self,
        f: &mut fmt::Formatter<'_>,
        i: usize,
        names: &HashMap<usize, usize>,
        by_name: bool,
    ) -> fmt::Result {
        if by_name {
            if let Some(n) = names.get(&i) {
                return write!(f, "t{n}");
            }
        }
        match self.steps.get(i) {
            None => write!(f, "?{i}"),
            Some(FusedStep::Input(k)) => write!(f, "in{k}"),
            Some(FusedStep::Const(c)) => write!(f, "{c:?}"),
            Some(FusedStep::Unary(u, a)) => {
                write!(f, "{}(", u.name())?;
                self.write_tree(f, *a, names, true)?;
                f.write_str(")")
            }
            Some(FusedStep::Binary(op, a, b)) => {
                write!(f, "{}(", op.name())?;
                self.write_tree(f, *a, names, true)?;
                f.write_str(", ")?;
                self.write_tree(f, *b, names, true)?;
                f.write_str(")")
            }
        }
    }
}

impl FromStr for FusedExpr {
    type Err = String;

    /// Parses the text form (see the `Display` impl) into the canonical expression.
    fn from_str(s: &str) -> Result<FusedExpr, String> {
        let mut p = ExprParser {
            s: s.as_bytes(),
            pos: 0,
            b: Builder::default(),
            names: HashMap::new(),
        };
        loop {
            p.skip_ws();
            // A binding starts `name =`; anything else is the result.
            let save = p.pos;
            if let Some(name) = p.ident() {
                p.skip_ws();
                if p.peek() == Some(b'=') {
                    p.pos += 1;
                    let v = p.term()?;
                    if p.names.insert(name.clone(), v).is_some() {
                        return Err(p.error(&format!("`{name}` is bound twice")));
                    }
                    p.skip_ws();
                    if p.peek() != Some(b';') {
                        return Err(p.error("expected `;` after a binding"));
                    }
                    p.pos += 1;
                    continue;
                }
            }
            p.pos = save;
            let root = p.term()?;
            p.skip_ws();
            if p.pos != p.s.len() {
                return Err(p.error("unexpected text after the expression"));
            }
            let mut steps = p.b.steps;
            // A result that is an earlier step (a bare name or a leaf) is made the last.
            if root + 1 != steps.len() {
                let s = steps[root].clone();
                steps.push(s);
            }
            return Ok(FusedExpr { steps });
        }
    }
}

struct ExprParser<'a> {
    s: &'a [u8],
    pos: usize,
    b: Builder,
    names: HashMap<String, usize>,
}

impl ExprParser<'_> {
    fn error(&self, what: &str) -> String {
        format!("fused expression, column {}: {what}", self.pos + 1)
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }
    fn skip_ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.pos += 1;
        }
    }
    fn ident(&mut self) -> Option<String> {
        let start = self.pos;
        if !self
            .peek()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == b'_')
        {
            return None;
        }
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_')
        {
            self.pos += 1;
        }
        Some(String::from_utf8_lossy(&self.s[start..self.pos]).into_owned())
    }
    fn expect(&mut self, c: u8) -> Result<(), String> {
        self.skip_ws();
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(&format!("expected `{}`", c as char)))
        }
    }
    fn number(&mut self) -> Result<usize, String> {
        let start = self.pos;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.pos += 1;
        }
        let text = if self.peek().is_some_and(|c| c.is_ascii_alphabetic()) {
            // `inf`, `-inf`, `NaN`.
            self.ident().unwrap_or_default()
        } else {
            while self.peek().is_some_and(|c| {
                c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'+' | b'-')
            }) {
                self.pos += 1;
            }
            String::from_utf8_lossy(&self.s[start + negative as usize..self.pos]).into_owned()
        };
        let x: f64 = text.parse().map_err(|_| {
            self.pos = start;
            self.error(&format!("`{text}` is not a number"))
        })?;
        Ok(self.b.constant(if negative { -x } else { x }))
    }
    fn term(&mut self) -> Result<usize, String> {
        self.skip_ws();
        match self.peek() {
            Some(c) if c.is_ascii_digit() || c == b'-' || c == b'.' => return self.number(),
            None => return Err(self.error("expected an expression")),
            _ => {}
        }
        let start = self.pos;
        let Some(word) = self.ident() else {
            return Err(self.error("expected an expression"));
        };
        if matches!(word.as_str(), "inf" | "NaN") {
            self.pos = start;
            return self.number();
        }
        if let Some(k) = word
            .strip_prefix("in")
            .and_then(|k| k.parse::<usize>().ok())
        {
            return Ok(self.b.input(k));
        }
        self.skip_ws();
        if self.peek() != Some(b'(') {
            return self.names.get(&word).copied().ok_or_else(|| {
                self.pos = start;
                self.error(&format!(
                    "`{word}` is neither an input (`in0`) nor a bound name"
                ))
            });
        }
        self.pos += 1;
        if let Some(f) = UnaryFn::ALL.into_iter().find(|f| f.name() == word) {
            let a = self.term()?;
            self.expect(b')')?;
            return Ok(self.b.push(FusedStep::Unary(f, a)));
        }
        if let Some(f) = BinaryFn::ALL.into_iter().find(|f| f.name() == word) {
            let a = self.term()?;
            self.expect(b',')?;
            let b = self.term()?;
            self.expect(b')')?;
            return Ok(self.b.push(FusedStep::Binary(f, a, b)));
        }
        self.pos = start;
        let known: Vec<&str> = UnaryFn::ALL
            .iter()
            .map(|f| f.name())
            .chain(BinaryFn::ALL.iter().map(|f| f.name()))
            .collect();
        Err(self.error(&format!(
            "unknown function `{word}`; known: {}",
            known.join(", ")
        )))
    }
}
