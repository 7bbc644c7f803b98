//! The gradient of an element-wise expression, itself element-wise: reverse mode over
//! the expression's steps, done symbolically, so that an op written as a `fused` node
//! (`gelu`, `pow`, `where`, ...) differentiates into `fused` nodes the same kernels run
//! and the kernel-fusion pass merges with their neighbours.

use crate::fused::{BinaryFn, Builder, FusedExpr, FusedStep, UnaryFn};

/// The gradient of one input of a fused node: `expr` over `inputs`, where `None` is the
/// incoming gradient `dy` and `Some(k)` the node's input `k`. Evaluated at the node's
/// result shape; the caller sums it down to the input's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct InputGradient {
    /// `dy * d(result)/d(input)`, element by element.
    pub expr: FusedExpr,
    /// What each of its inputs reads.
    pub inputs: Vec<Option<usize>>,
}

impl FusedExpr {
    /// For each of the node's `n` inputs, the expression of its gradient, or `None`
    /// where none flows (the input is read only by comparisons, `step` or `keep`'s
    /// condition). Fails on the derivative functions themselves: gradients of gradients
    /// are not supported.
    pub fn input_gradients(&self, n: usize) -> Result<Vec<Option<InputGradient>>, String> {
        let steps = &self.steps;
        let Some(root) = steps.len().checked_sub(1) else {
            return Err("the expression has no steps".into());
        };
        // Builder input 0 is dy; input k + 1 is the node's input k.
        let mut b = Builder::default();
        let mut fwd = Vec::with_capacity(steps.len());
        for s in steps {
            let j = match *s {
                FusedStep::Input(k) => b.input(k + 1),
                FusedStep::Const(c) => b.constant(c),
                FusedStep::Unary(f, a) => b.push(FusedStep::Unary(f, fwd[a])),
                FusedStep::Binary(f, x, y) => b.push(FusedStep::Binary(f, fwd[x], fwd[y])),
            };
            fwd.push(j);
        }
        let mut adj: Vec<Option<usize>> = vec![None; steps.len()];
        adj[root] = Some(b.input(0));
        let mut grads: Vec<Option<usize>> = vec![None; n];
        for i in (0..steps.len()).rev() {
            let Some(g) = adj[i] else { continue };
            match steps[i] {
                FusedStep::Input(k) => {
                    let slot = grads
                        .get_mut(k)
                        .ok_or_else(|| format!("step {i} reads input {k} of {n}"))?;
                    accumulate(&mut b, slot, g);
                }
                FusedStep::Const(_) => {}
                FusedStep::Unary(f, a) => {
                    if let Some(d) = unary_adjoint(&mut b, f, fwd[a], fwd[i], g)? {
                        accumulate(&mut b, &mut adj[a], d);
                    }
                }
                FusedStep::Binary(f, x, y) => {
                    let (dx, dy) = binary_adjoint(&mut b, f, fwd[x], fwd[y], fwd[i], g);
                    if let Some(d) = dx {
                        accumulate(&mut b, &mut adj[x], d);
                    }
                    if let Some(d) = dy {
                        accumulate(&mut b, &mut adj[y], d);
                    }
                }
            }
        }
        Ok(grads
            .into_iter()
            .map(|r| r.map(|r| compact(&b.steps[..=r])))
            .collect())
    }
}

/// `slot += d`.
fn accumulate(b: &mut Builder, slot: &mut Option<usize>, d: usize) {
    *slot = Some(match *slot {
        None => d,
        Some(s) => b.push(FusedStep::Binary(BinaryFn::Add, s, d)),
    });
}

/// The adjoint of `x` through `y = f(x)`, given `y`'s adjoint `g`.
fn unary_adjoint(
    b: &mut Builder,
    f: UnaryFn,
    x: usize,
    y: usize,
    g: usize,
) -> Result<Option<usize>, String> {
    use FusedStep::{Binary as B, Unary as U};
    let (mul, sub, div) = (BinaryFn::Mul, BinaryFn::Sub, BinaryFn::Div);
    Ok(Some(match f {
        UnaryFn::Neg => b.push(U(UnaryFn::Neg, g)),
        UnaryFn::Relu => {
            let s = b.push(U(UnaryFn::Step, x));
            b.push(B(mul, g, s))
        }
        UnaryFn::Sigmoid => {
            // As `sigmoid_grad` computes it: (g * y) * (1 - y).
            let gy = b.push(B(mul, g, y));
            let one = b.constant(1.0);
            let rest = b.push(B(sub, one, y));
            b.push(B(mul, gy, rest))
        }
        UnaryFn::Tanh => {
            let yy = b.push(B(mul, y, y));
            let one = b.constant(1.0);
            let rest = b.push(B(sub, one, yy));
            b.push(B(mul, g, rest))
        }
        UnaryFn::Exp => b.push(B(mul, g, y)),
        UnaryFn::Log => b.push(B(div, g, x)),
        UnaryFn::Step => return Ok(None),
        UnaryFn::Sqrt => {
            let half = b.constant(0.5);
            let gh = b.push(B(mul, g, half));
            b.push(B(div, gh, y))
        }
        UnaryFn::Rsqrt => {
            // d x^(-1/2) = -1/2 x^(-3/2) = -1/2 y^3.
            let c = b.constant(-0.5);
            let gc = b.push(B(mul, g, c));
            let yy = b.push(B(mul, y, y));
            let yyy = b.push(B(mul, yy, y));
            b.push(B(mul, gc, yyy))
        }
        UnaryFn::Gelu | UnaryFn::GeluTanh | UnaryFn::Silu => {
            let derivative = match f {
                UnaryFn::Gelu => UnaryFn::GeluDerivative,
                UnaryFn::GeluTanh => UnaryFn::GeluTanhDerivative,
                _ => UnaryFn::SiluDerivative,
            };
            let d = b.push(U(derivative, x));
            b.push(B(mul, g, d))
        }
        UnaryFn::GeluDerivative | UnaryFn::GeluTanhDerivative | UnaryFn::SiluDerivative => {
            return Err(format!(
                "`{}` has no gradient rule (higher-order gradients are not supported)",
                f.name()
            ))
        }
    }))
}

/// The adjoints of `(a, b)` through `y = f(a, b)`, given `y`'s adjoint `g`.
fn binary_adjoint(
    b: &mut Builder,
    f: BinaryFn,
    x: usize,
    z: usize,
    y: usize,
    g: usize,
) -> (Option<usize>, Option<usize>) {
    use FusedStep::{Binary as B, Unary as U};
    let (mul, sub, div) = (BinaryFn::Mul, BinaryFn::Sub, BinaryFn::Div);
    match f {
        BinaryFn::Add => (Some(g), Some(g)),
        BinaryFn::Sub => (Some(g), Some(b.push(U(UnaryFn::Neg, g)))),
        BinaryFn::Mul => (Some(b.push(B(mul, g, z))), Some(b.push(B(mul, g, x)))),
        BinaryFn::Div => {
            // d(a/b)/db = -(a/b)/b.
            let da = b.push(B(div, g, z));
            let gy = b.push(B(mul, g, y));
            let q = b.push(B(div, gy, z));
            (Some(da), Some(b.push(U(UnaryFn::Neg, q))))
        }
        BinaryFn::Pow => {
            // d a^p/da = p a^(p-1); d a^p/dp = a^p ln a (dropped unread when p is a
            // constant: nothing reads a constant's adjoint).
            let one = b.constant(1.0);
            let pm1 = b.push(B(sub, z, one));
            let apm1 = b.push(B(BinaryFn::Pow, x, pm1));
            let papm1 = b.push(B(mul, z, apm1));
            let da = b.push(B(mul, g, papm1));
            let ln = b.push(U(UnaryFn::Log, x));
            let yln = b.push(B(mul, y, ln));
            let dp = b.push(B(mul, g, yln));
            (Some(da), Some(dp))
        }
        BinaryFn::Keep => (None, Some(b.push(B(BinaryFn::Keep, x, g)))),
        BinaryFn::Less
        | BinaryFn::LessEqual
        | BinaryFn::Greater
        | BinaryFn::GreaterEqual
        | BinaryFn::Equal
        | BinaryFn::NotEqual => (None, None),
    }
}

/// The expression whose result is the last of `steps`, with only the inputs it reads,
/// renumbered in order (builder input 0 is `dy`, input `k + 1` the node's input `k`).
fn compact(steps: &[FusedStep]) -> InputGradient {
    let whole = FusedExpr {
        steps: steps.to_vec(),
    }
    .canonical();
    let mut read: Vec<usize> = whole
        .steps
        .iter()
        .filter_map(|s| match *s {
            FusedStep::Input(j) => Some(j),
            _ => None,
        })
        .collect();
    read.sort_unstable();
    read.dedup();
    let steps = whole
        .steps
        .iter()
        .map(|s| match *s {
            FusedStep::Input(j) => FusedStep::Input(read.iter().position(|&r| r == j).unwrap_or(0)),
            ref other => other.clone(),
        })
        .collect();
    InputGradient {
        expr: FusedExpr { steps }.canonical(),
        inputs: read.iter().map(|&j| j.checked_sub(1)).collect(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Evaluates an expression at scalar inputs.
    fn eval(e: &FusedExpr, inputs: &[f64]) -> f64 {
        let mut v: Vec<f64> = Vec::new();
        for s in &e.steps {
            v.push(match *s {
                FusedStep::Input(k) => inputs[k],
                FusedStep::Const(c) => c,
                FusedStep::Unary(f, a) => f.eval(v[a]),
                FusedStep::Binary(f, a, b) => f.eval(v[a], v[b]),
            });
        }
        *v.last().unwrap()
    }

    /// Every function's gradient expression against central differences of `eval`.
    #[test]
    fn gradients_match_finite_differences() {
        let cases = [
            "gelu(in0)",
            "gelu_tanh(in0)",
            "silu(in0)",
            "sqrt(in0)",
            "rsqrt(in0)",
            "pow(in0, 3.0)",
            "pow(in0, in1)",
            "mul(tanh(in0), sigmoid(in1))",
            "div(exp(in0), log(in1))",
            "add(keep(greater(in0, in1), in0), keep(equal(greater(in0, in1), 0.0), mul(in1, in1)))",
            "sub(neg(in0), relu(in1))",
            "t0 = add(in0, in1); mul(t0, t0)",
        ];
        let at = [[0.7, 1.3], [1.9, 0.4], [0.35, 2.2]];
        for text in cases {
            let e: FusedExpr = text.parse().unwrap();
            let grads = e.input_gradients(2).unwrap();
            for x in at {
                for (k, gk) in grads.iter().enumerate() {
                    let h = 1e-6;
                    let (mut lo, mut hi) = (x, x);
                    lo[k] -= h;
                    hi[k] += h;
                    let numeric = (eval(&e, &hi) - eval(&e, &lo)) / (2.0 * h);
                    let dy = 1.7;
                    let analytic = match gk {
                        None => 0.0,
                        Some(g) => {
                            g.expr.check(g.inputs.len()).unwrap();
                            let ins: Vec<f64> =
                                g.inputs.iter().map(|i| i.map_or(dy, |j| x[j])).collect();
                            eval(&g.expr, &ins) / dy
                        }
                    };
                    assert!(
                        (numeric - analytic).abs() <= 1e-5 * (1.0 + numeric.abs()),
                        "{text} d/din{k} at {x:?}: numeric {numeric}, analytic {analytic}"
                    );
                }
            }
        }
    }

    #[test]
    fn comparisons_have_no_gradient_and_derivatives_refuse() {
        let e: FusedExpr = "less(in0, in1)".parse().unwrap();
        assert_eq!(e.input_gradients(2).unwrap(), vec![None, None]);
        let e: FusedExpr = "gelu_derivative(in0)".parse().unwrap();
        assert!(e.input_gradients(1).unwrap_err().contains("higher-order"));
    }

    #[test]
    fn keep_masks_infinities_exactly() {
        let e: FusedExpr = "add(keep(in0, in1), keep(equal(in0, 0.0), in2))"
            .parse()
            .unwrap();
        assert_eq!(eval(&e, &[1.0, 2.0, f64::NEG_INFINITY]), 2.0);
        assert_eq!(eval(&e, &[0.0, f64::NAN, -3.0]), -3.0);
    }
}
