//! The `fused` kernel against the unfused kernels it replaces: every expression is
//! also evaluated step by step with the ops of the IR (`add`, `relu`, ...), on inputs
//! that broadcast in every way numpy allows, across block boundaries, in f32 and f64,
//! with borrowed inputs and with an owned input whose buffer the result takes.
#![allow(clippy::unwrap_used)]

use distc_ir::{BinaryFn, DType, FusedExpr, FusedStep, Op, UnaryFn};
use distc_runtime::cpu::kernels::{eval, eval_op, Arg, KernelCtx};
use distc_runtime::{Tensor, Value};
use ndarray::{ArrayD, IxDyn};

const CTX: KernelCtx = KernelCtx {
    step: 0,
    training: true,
    rank: 0,
    model_rank: 0,
};

/// Deterministic values in [-2, 2), none exactly 0.
fn noise(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0 + 1e-3
        })
        .collect()
}

fn tensor(dtype: DType, dims: &[usize], data: Vec<f64>) -> Tensor {
    match dtype {
        DType::F64 => Tensor::F64(ArrayD::from_shape_vec(IxDyn(dims), data).unwrap()),
        _ => Tensor::F32(
            ArrayD::from_shape_vec(IxDyn(dims), data.iter().map(|&x| x as f32).collect()).unwrap(),
        ),
    }
}

fn one(v: Vec<Value>) -> Value {
    v.into_iter().next().unwrap()
}

/// `expr` evaluated one step at a time with the unfused kernels.
fn unfused(expr: &FusedExpr, inputs: &[Value], dtype: DType) -> Value {
    let mut vals: Vec<Value> = Vec::new();
    for s in &expr.steps {
        let v = match *s {
            FusedStep::Input(k) => inputs[k].clone(),
            FusedStep::Const(c) => Value::Tensor(tensor(dtype, &[], vec![c])),
            FusedStep::Unary(UnaryFn::Step, a) => {
                // step(x) is relu_grad(1, x), with the ones of x's shape.
                let Value::Tensor(x) = &vals[a] else { panic!() };
                let n = x.shape().iter().product();
                let ones = Value::Tensor(tensor(dtype, x.shape(), vec![1.0; n]));
                one(eval_op(&Op::ReluGrad, &[&ones, &vals[a]], &CTX).unwrap())
            }
            FusedStep::Unary(f, a) => {
                let op = match f {
                    UnaryFn::Neg => Op::Neg,
                    UnaryFn::Relu => Op::Relu,
                    UnaryFn::Sigmoid => Op::Sigmoid,
                    UnaryFn::Tanh => Op::Tanh,
                    UnaryFn::Exp => Op::Exp,
                    UnaryFn::Log => Op::Log,
                    UnaryFn::Step => unreachable!("above"),
                    // No op of their own: the f64 reference, element by element.
                    other => {
                        let Value::Tensor(x) = &vals[a] else { panic!() };
                        let data = x.to_f64_vec().into_iter().map(|v| other.eval(v)).collect();
                        vals.push(Value::Tensor(tensor(dtype, x.shape(), data)));
                        continue;
                    }
                };
                one(eval_op(&op, &[&vals[a]], &CTX).unwrap())
            }
            FusedStep::Binary(f, a, b) => {
                let op = match f {
                    BinaryFn::Add => Op::Add,
                    BinaryFn::Sub => Op::Sub,
                    BinaryFn::Mul => Op::Mul,
                    BinaryFn::Div => Op::Div,
                    // No op of their own: a one-step fused node (its simplest loop).
                    other => Op::Fused {
                        expr: format!("{}(in0, in1)", other.name()).parse().unwrap(),
                    },
                };
                one(eval_op(&op, &[&vals[a], &vals[b]], &CTX).unwrap())
            }
        };
        vals.push(v);
    }
    vals.pop().unwrap()
}

fn elements(v: &Value) -> (Vec<usize>, Vec<f64>) {
    let Value::Tensor(t) = v else { panic!("dense") };
    (t.shape().to_vec(), t.to_f64_vec())
}

/// Fused against unfused, borrowed and with each full-shape input owned in turn.
fn check(text: &str, shapes: &[&[usize]]) {
    let expr: FusedExpr = text.parse().unwrap();
    let op = Op::Fused { expr: expr.clone() };
    for dtype in [DType::F32, DType::F64] {
        let inputs: Vec<Value> = shapes
            .iter()
            .enumerate()
            .map(|(i, dims)| {
                let n = dims.iter().product();
                Value::Tensor(tensor(dtype, dims, noise(n, i as u64 + 1)))
            })
            .collect();
        let want = elements(&unfused(&expr, &inputs, dtype));
        let refs: Vec<&Value> = inputs.iter().collect();
        let got = elements(&one(eval_op(&op, &refs, &CTX).unwrap()));
        assert_eq!(got.0, want.0, "{text}: shape");
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-13 };
        let close = |got: &[f64], what: &str| {
            for (i, (a, b)) in got.iter().zip(&want.1).enumerate() {
                assert!(
                    (a - b).abs() <= tol * (1.0 + b.abs()),
                    "{text} {dtype} {what}: element {i} is {a}, unfused {b}"
                );
            }
        };
        close(&got.1, "borrowed");
        for (k, dims) in shapes.iter().enumerate() {
            if *dims != want.0.as_slice() {
                continue;
            }
            let args: Vec<Arg<'_>> = inputs
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    if i == k {
                        Arg::Owned(v.clone())
                    } else {
                        Arg::Borrowed(v)
                    }
                })
                .collect();
            let got = elements(&one(eval(&op, args, &CTX).unwrap()));
            close(&got.1, &format!("input {k} owned"));
        }
    }
}

#[test]
fn the_expression_functions() {
    for f in [
        "gelu",
        "gelu_tanh",
        "silu",
        "gelu_derivative",
        "gelu_tanh_derivative",
        "silu_derivative",
    ] {
        check(&format!("mul({f}(add(in0, in1)), in0)"), &[&[3, 70], &[70]]);
    }
    check(
        "add(sqrt(mul(in0, in0)), rsqrt(add(mul(in1, in1), 1.0)))",
        &[&[3, 70], &[3, 1]],
    );
    check(
        "t0 = greater(in0, in1); add(keep(t0, pow(mul(in0, in0), 0.5)), keep(equal(t0, 0.0), in1))",
        &[&[5, 70], &[70]],
    );
    check(
        "add(add(less(in0, in1), less_equal(in0, 0.5)), add(greater_equal(in1, in0), not_equal(in0, in1)))",
        &[&[4, 33], &[4, 1]],
    );
}

#[test]
fn bias_add_and_activation() {
    check("relu(add(in0, in1))", &[&[5, 7], &[7]]);
    // Over several blocks, with a tail.
    check("relu(add(in0, in1))", &[&[3, 1000], &[1000]]);
}

#[test]
fn activation_gradients() {
    check("mul(in0, step(in1))", &[&[4, 300], &[4, 300]]);
    check("mul(mul(in0, in1), sub(1.0, in1))", &[&[2, 600], &[2, 600]]);
    check("mul(in0, sub(1.0, mul(in1, in1)))", &[&[1200], &[1200]]);
}

#[test]
fn every_function_and_shared_steps() {
    check(
        "t0 = sigmoid(add(in0, in1)); div(mul(t0, in2), sub(exp(neg(t0)), log(add(tanh(in2), 2.0))))",
        &[&[3, 1], &[700], &[3, 700]],
    );
}

#[test]
fn broadcasting_in_every_direction() {
    // No input has the result's shape: [4,1,3] and [1,5,1] both grow.
    check("add(in0, in1)", &[&[4, 1, 3], &[1, 5, 1]]);
    // A scalar input, a column, a row, and a leading axis of 1.
    check(
        "sub(mul(in0, 2.0), add(in1, mul(in2, in3)))",
        &[&[], &[6, 1], &[1, 400], &[1, 6, 400]],
    );
    // A middle axis broadcast, over block boundaries.
    check("mul(in0, in1)", &[&[3, 1, 500], &[3, 7, 500]]);
    // A column repeated along rows of more than one block.
    check("relu(sub(in0, in1))", &[&[3, 1500], &[3, 1]]);
    // Short rows: gathered over the whole result.
    check("mul(in0, step(in1))", &[&[40, 3], &[40, 1]]);
}

#[test]
fn constants_fold_and_a_leaf_result() {
    check("add(in0, exp(1.0))", &[&[9]]);
    check("mul(in0, in0)", &[&[2, 3]]);
    check("in0", &[&[2, 3]]);
    check("tanh(in0)", &[&[]]);
}

#[test]
fn bad_inputs_are_errors_naming_the_problem() {
    let op = Op::Fused {
        expr: "add(in0, in1)".parse().unwrap(),
    };
    let a = Value::Tensor(tensor(DType::F32, &[2], vec![1.0, 2.0]));
    let b = Value::Tensor(tensor(DType::F64, &[2], vec![1.0, 2.0]));
    let e = eval_op(&op, &[&a, &b], &CTX).unwrap_err().to_string();
    assert!(e.contains("f64") && e.contains("f32"), "{e}");
    let c = Value::Tensor(tensor(DType::F32, &[3], vec![1.0, 2.0, 3.0]));
    let e = eval_op(&op, &[&a, &c], &CTX).unwrap_err().to_string();
    assert!(e.contains("does not broadcast"), "{e}");
    // An expression reading an input the node does not have.
    let op = Op::Fused {
        expr: "add(in0, in2)".parse().unwrap(),
    };
    let e = eval_op(&op, &[&a, &a], &CTX).unwrap_err().to_string();
    assert!(e.contains("input 2"), "{e}");
}

/// Issue 67, item 8: GELU's values and derivatives at fixed points are PyTorch's
/// (`F.gelu(x, approximate=...)` and its autograd, in float64, printed once), for the
/// f64 reference every kernel is tested against and for the CPU kernel in f64 and f32.
/// A wrong constant shared by every implementation (GELU_TANH_C) agreed with itself.
#[test]
fn gelu_values_and_derivatives_are_pytorchs() {
    let x = [-3.0, -1.5, -0.5, 0.0, 0.25, 1.0, 2.5];
    let torch: [(UnaryFn, [f64; 7]); 4] = [
        (
            UnaryFn::Gelu,
            [
                -0.00404969409489031,
                -0.10021080190328704,
                -0.15426876936299344,
                0.0,
                0.14967658142073093,
                0.841344746068543,
                2.4844758366855597,
            ],
        ),
        (
            UnaryFn::GeluDerivative,
            [
                -0.01194564720418392,
                -0.1274691922299796,
                0.13250487534383712,
                0.5,
                0.695373354883636,
                1.0833154705876864,
                1.037611085908145,
            ],
        ),
        (
            UnaryFn::GeluTanh,
            [
                -0.0036373920817729943,
                -0.10042842301976707,
                -0.15428599017485606,
                0.0,
                0.149675350701685,
                0.8411919906082768,
                2.484915733910001,
            ],
        ),
        (
            UnaryFn::GeluTanhDerivative,
            [
                -0.011584166630969648,
                -0.12771079315143308,
                0.13263009646535764,
                0.5,
                0.6953540951510604,
                1.0829640838457826,
                1.037951576212666,
            ],
        ),
    ];
    for (f, want) in torch {
        let op = Op::Fused {
            expr: format!("{}(in0)", f.name()).parse().unwrap(),
        };
        for (&x, &w) in x.iter().zip(&want) {
            let got = f.eval(x);
            assert!(
                (got - w).abs() <= 1e-14,
                "{f:?}({x}): reference {got}, PyTorch {w}"
            );
        }
        for (dtype, tol) in [(DType::F64, 1e-14), (DType::F32, 1e-6)] {
            let input = Value::Tensor(tensor(dtype, &[x.len()], x.to_vec()));
            let got = elements(&one(eval_op(&op, &[&input], &CTX).unwrap())).1;
            for ((&x, &w), g) in x.iter().zip(&want).zip(got) {
                assert!(
                    (g - w).abs() <= tol,
                    "{f:?}({x}) in {dtype}: the CPU kernel gives {g}, PyTorch {w}"
                );
            }
        }
    }
}
