//! The expressions of the DSL's element-wise functions (`gelu`, `pow`, `where`, the
//! comparisons, ...), over their operands in parameter order (`in0` the first). Each
//! lowers to one `fused` node, whose gradient, CPU loop, GPU kernel and fusion with its
//! neighbours are the fused node's: a new function needs only its expression here and
//! its scalar definition in `distc_ir::fused`.

use super::error::Diag;
use distc_ir::{BinaryFn, FusedExpr, FusedStep, UnaryFn};

type R<T> = Result<T, Diag>;

/// `f(in0)`.
pub(super) fn unary(f: UnaryFn) -> R<FusedExpr> {
    Ok(FusedExpr {
        steps: vec![FusedStep::Input(0), FusedStep::Unary(f, 0)],
    })
}

/// `f(in0, in1)`.
pub(super) fn binary(f: BinaryFn) -> R<FusedExpr> {
    Ok(FusedExpr {
        steps: vec![
            FusedStep::Input(0),
            FusedStep::Input(1),
            FusedStep::Binary(f, 0, 1),
        ],
    })
}

/// `where(cond, a, b)`: `a` where `cond` is not zero, else `b`; the side not chosen
/// never reaches the result (a `-inf` mask stays `-inf`, never NaN), and gets no
/// gradient there.
pub(super) fn select() -> R<FusedExpr> {
    use FusedStep::{Binary as B, Const, Input};
    Ok(FusedExpr {
        steps: vec![
            Input(0),
            Input(1),
            B(BinaryFn::Keep, 0, 1),
            Const(0.0),
            B(BinaryFn::Equal, 0, 3),
            Input(2),
            B(BinaryFn::Keep, 4, 5),
            B(BinaryFn::Add, 2, 6),
        ],
    })
}

/// `maximum(a, b)` (or `minimum`), as `where(a >= b, a, b)`: on a tie the gradient
/// goes to `a`.
pub(super) fn maximum(max: bool) -> R<FusedExpr> {
    use FusedStep::{Binary as B, Input};
    let (take_a, take_b) = if max {
        (BinaryFn::GreaterEqual, BinaryFn::Less)
    } else {
        (BinaryFn::LessEqual, BinaryFn::Greater)
    };
    Ok(FusedExpr {
        steps: vec![
            Input(0),
            Input(1),
            B(take_a, 0, 1),
            B(BinaryFn::Keep, 2, 0),
            B(take_b, 0, 1),
            B(BinaryFn::Keep, 4, 1),
            B(BinaryFn::Add, 3, 5),
        ],
    })
}

/// An operand's place in the expression: a tensor input (renumbered) or a number.
pub(super) enum Operand {
    Tensor(usize),
    Number(f64),
}

/// `expr` with each `Input(k)` replaced by operand `k`'s place, in canonical form.
pub(super) fn substitute(expr: &FusedExpr, operands: &[Operand]) -> FusedExpr {
    let steps = expr
        .steps
        .iter()
        .map(|s| match *s {
            FusedStep::Input(k) => match operands.get(k) {
                Some(Operand::Tensor(j)) => FusedStep::Input(*j),
                Some(Operand::Number(v)) => FusedStep::Const(*v),
                None => FusedStep::Input(k),
            },
            ref other => other.clone(),
        })
        .collect();
    FusedExpr { steps }.canonical()
}
