//! The expression a `fused` node computes: a chain of element-wise ops collapsed into
//! one node by the kernel-fusion pass, so a backend runs it as one loop (on the CPU)
//! or one generated kernel (on a GPU) instead of one pass over memory per op.
//!
//! The expression is a list of steps in SSA order; the last step is the result. Step
//! `Input(k)` reads the node's input `k`, broadcast by numpy rules to the node's output
//! shape (a bias `[N]` against `[B, N]`), so each element of the result depends only on
//! the same element (or its broadcast source) of each input.

use serde::{Deserialize, Serialize};

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
        }
    }
}
