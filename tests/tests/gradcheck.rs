//! Every differentiable op's gradient, as built by the autodiff pass and computed by
//! the CPU kernels, against central finite differences. Graphs run in f64 so the
//! check is tight: a relative error of 1e-6 means the gradient is right, not roughly
//! right.

use distc_ir::{DType, Graph, Op, Shape, TensorType, ValueId};
use distc_passes::{autodiff::Autodiff, Pass, PassCx};
use distc_runtime::core::exec::Executor;
use distc_runtime::core::schedule::Mode;
use distc_runtime::{Tensor, Value};
use ndarray::{ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use std::collections::HashMap;

const EPS: f64 = 1e-6;
const TOL: f64 = 1e-6;

struct Builder {
    g: Graph,
    params: HashMap<String, Tensor>,
    feeds: HashMap<String, Tensor>,
    rng: Pcg64,
}

fn f64t(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F64, dims.to_vec())
}

impl Builder {
    fn new(name: &str) -> Builder {
        Builder {
            g: Graph::new(name),
            params: HashMap::new(),
            feeds: HashMap::new(),
            rng: Pcg64::seed_from_u64(42),
        }
    }
    fn random(&mut self, dims: &[usize], lo: f64, hi: f64) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.rng.random_range(lo..hi)).collect();
        Tensor::F64(ArrayD::from_shape_vec(IxDyn(dims), v).expect("shape"))
    }
    /// A variable with values uniform in `[lo, hi)`.
    fn param(&mut self, name: &str, dims: &[usize], lo: f64, hi: f64) -> ValueId {
        let t = self.random(dims, lo, hi);
        self.params.insert(name.into(), t);
        let op = Op::Param {
            name: name.into(),
            ty: f64t(dims),
            init: distc_ir::Init::Zeros,
            frozen: false,
        };
        self.g.add(op, vec![]).expect("param").into()
    }
    fn ids(&mut self, name: &str, values: &[i32], dims: &[usize]) -> ValueId {
        let t = Tensor::I32(ArrayD::from_shape_vec(IxDyn(dims), values.to_vec()).expect("shape"));
        self.feeds.insert(name.into(), t);
        let op = Op::Input {
            name: name.into(),
            ty: TensorType::new(DType::I32, dims.to_vec()),
        };
        self.g.add(op, vec![]).expect("input").into()
    }
    fn op(&mut self, op: Op, inputs: Vec<ValueId>) -> ValueId {
        self.g.add(op, inputs).expect("op fits").into()
    }
}

fn loss_of(
    exec: &mut Executor<distc_runtime::cpu::Cpu>,
    b: &Builder,
    params: &HashMap<String, Tensor>,
) -> f64 {
    let out = exec.run(&b.feeds, params, Mode::Train, 1).expect("runs");
    out.loss.expect("loss")
}

fn dense(v: &Value) -> Vec<f64> {
    match v {
        Value::Tensor(t) => t.to_f64_vec(),
        Value::Slices(s) => {
            let row: usize = s.dense_shape[1..].iter().product();
            let mut out = vec![0.0; s.dense_shape.iter().product()];
            let vals = s.values.to_f64_vec();
            for (i, &r) in s.indices.iter().enumerate() {
                for j in 0..row {
                    out[r as usize * row + j] += vals[i * row + j];
                }
            }
            out
        }
    }
}

/// Adds a loss reducing `y` with random weights, differentiates, and compares every
/// variable's gradient with central differences. Returns the sparse gradient names.
fn check(b: Builder, y: ValueId) -> Vec<String> {
    check_with(b, y, EPS, TOL)
}

/// [`check`] with another finite-difference step and tolerance (for values that pass
/// through a narrower type).
fn check_with(mut b: Builder, y: ValueId, eps: f64, tol: f64) -> Vec<String> {
    let yt = b.g.tensor_type(y).clone();
    let loss = if yt.shape.rank() == 0 {
        y
    } else {
        let w = b.random(yt.dims(), -1.0, 1.0);
        b.feeds.insert("loss_weights".into(), w);
        let r = b.op(
            Op::Input {
                name: "loss_weights".into(),
                ty: yt.clone(),
            },
            vec![],
        );
        let p = b.op(Op::Mul, vec![y, r]);
        let axes = (0..yt.shape.rank()).collect();
        b.op(
            Op::Sum {
                axes,
                keep_dims: false,
            },
            vec![p],
        )
    };
    b.g.add(Op::Loss, vec![loss]).expect("loss");
    let mut g = b.g.clone();
    Autodiff
        .run(&mut g, &mut PassCx::default())
        .expect("autodiff");
    distc_ir::verify(&g).expect("differentiated graph verifies");
    let mut exec = Executor::new(&g).expect("executor");
    let out = exec.run(&b.feeds, &b.params, Mode::Train, 1).expect("runs");
    let mut sparse = Vec::new();
    let mut fwd = Executor::new(&b.g).expect("executor");
    for (name, grad) in &out.grads {
        if matches!(grad, Value::Slices(_)) {
            sparse.push(name.clone());
        }
        let analytic = dense(grad);
        let base = b.params[name].clone();
        let n = base.len();
        assert_eq!(
            analytic.len(),
            n,
            "{}: gradient of {name} has the wrong size",
            b.g.name
        );
        let step = (n / 24).max(1);
        for i in (0..n).step_by(step) {
            let mut at = |delta: f64| {
                let mut params = b.params.clone();
                if let Some(Tensor::F64(a)) = params.get_mut(name) {
                    if let Some(x) = a.iter_mut().nth(i) {
                        *x += delta;
                    }
                }
                loss_of(&mut fwd, &b, &params)
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
            let err = (analytic[i] - numeric).abs() / numeric.abs().max(1.0);
            assert!(
                err < tol,
                "{}: d loss / d {name}[{i}]: autodiff {} vs finite differences {numeric} (error {err:.2e})",
                b.g.name,
                analytic[i]
            );
        }
    }
    assert!(!out.grads.is_empty(), "{}: no gradients", b.g.name);
    sparse
}

fn unary(name: &str, op: Op, lo: f64, hi: f64) {
    let mut b = Builder::new(name);
    let x = b.param("x", &[3, 4], lo, hi);
    let y = b.op(op, vec![x]);
    check(b, y);
}

fn binary(name: &str, op: Op, a: &[usize], bd: &[usize], lo: f64, hi: f64) {
    let mut b = Builder::new(name);
    let x = b.param("a", a, lo, hi);
    let z = b.param("b", bd, lo, hi);
    let y = b.op(op, vec![x, z]);
    check(b, y);
}

#[test]
fn matmul_all_transposes() {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let a: &[usize] = if ta { &[4, 3] } else { &[3, 4] };
        let bd: &[usize] = if tb { &[5, 4] } else { &[4, 5] };
        binary(
            &format!("matmul_{ta}_{tb}"),
            Op::MatMul {
                transpose_a: ta,
                transpose_b: tb,
            },
            a,
            bd,
            -1.0,
            1.0,
        );
    }
}

/// numpy's matmul: batches, broadcast batches (summed back out of the gradient) and
/// every transpose.
#[test]
fn batched_matmul() {
    let t = |d: &[usize], tr: bool| {
        let mut d = d.to_vec();
        let n = d.len();
        if tr {
            d.swap(n - 2, n - 1);
        }
        d
    };
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        for (a, bd) in [
            (&[2, 3, 4][..], &[2, 4, 5][..]),
            (&[2, 3, 4], &[4, 5]),
            (&[3, 4], &[2, 4, 5]),
            (&[2, 1, 3, 4], &[3, 4, 5]),
        ] {
            binary(
                &format!("matmul_{a:?}_{bd:?}_{ta}_{tb}"),
                Op::MatMul {
                    transpose_a: ta,
                    transpose_b: tb,
                },
                &t(a, ta),
                &t(bd, tb),
                -1.0,
                1.0,
            );
        }
    }
}

#[test]
fn elementwise_binary_with_broadcasting() {
    for (name, op) in [("add", Op::Add), ("sub", Op::Sub), ("mul", Op::Mul)] {
        binary(name, op.clone(), &[3, 4], &[3, 4], -1.0, 1.0);
        binary(
            &format!("{name}_broadcast"),
            op.clone(),
            &[3, 4],
            &[4],
            -1.0,
            1.0,
        );
        binary(
            &format!("{name}_broadcast_both"),
            op,
            &[3, 1],
            &[1, 4],
            -1.0,
            1.0,
        );
    }
    binary("div", Op::Div, &[3, 4], &[3, 4], 0.5, 1.5);
    binary("div_broadcast", Op::Div, &[3, 4], &[3, 1], 0.5, 1.5);
}

#[test]
fn elementwise_unary() {
    unary("neg", Op::Neg, -1.0, 1.0);
    unary("relu", Op::Relu, -1.0, 1.0);
    unary("sigmoid", Op::Sigmoid, -2.0, 2.0);
    unary("tanh", Op::Tanh, -2.0, 2.0);
    unary("exp", Op::Exp, -1.0, 1.0);
    unary("log", Op::Log, 0.5, 2.0);
}

/// The element-wise functions written as expressions (`gelu`, `pow`, `where`, ...):
/// autodiff's expression gradient, run by the fused CPU loop, with broadcasting.
#[test]
fn elementwise_expressions() {
    let fused = |text: &str| Op::Fused {
        expr: text.parse().expect("expression parses"),
    };
    for (f, lo, hi) in [
        ("gelu", -2.0, 2.0),
        ("gelu_tanh", -2.0, 2.0),
        ("silu", -2.0, 2.0),
        ("sqrt", 0.5, 2.0),
        ("rsqrt", 0.5, 2.0),
    ] {
        unary(f, fused(&format!("{f}(in0)")), lo, hi);
    }
    unary("pow_3", fused("pow(in0, 3.0)"), -1.5, 1.5);
    unary("pow_half", fused("pow(in0, 0.5)"), 0.5, 2.0);
    binary("pow_both", fused("pow(in0, in1)"), &[3, 4], &[4], 0.5, 2.0);
    // where(a > b, a * a, b): the mask broadcast from a row.
    binary(
        "where",
        fused("t0 = greater(in0, in1); add(keep(t0, mul(in0, in0)), keep(equal(t0, 0.0), in1))"),
        &[3, 4],
        &[4],
        -1.0,
        1.0,
    );
    binary(
        "maximum",
        fused("add(keep(greater_equal(in0, in1), in0), keep(less(in0, in1), in1))"),
        &[3, 4],
        &[3, 1],
        -1.0,
        1.0,
    );
}

#[test]
fn softmax_and_log_softmax() {
    for axis in [0, 1] {
        unary(&format!("softmax_{axis}"), Op::Softmax { axis }, -2.0, 2.0);
        unary(
            &format!("log_softmax_{axis}"),
            Op::LogSoftmax { axis },
            -2.0,
            2.0,
        );
    }
}

#[test]
fn reductions() {
    for keep_dims in [false, true] {
        for axes in [vec![0], vec![1], vec![0, 1]] {
            unary(
                "sum",
                Op::Sum {
                    axes: axes.clone(),
                    keep_dims,
                },
                -1.0,
                1.0,
            );
            unary("mean", Op::Mean { axes, keep_dims }, -1.0, 1.0);
        }
    }
}

#[test]
fn layout_ops() {
    unary(
        "reshape",
        Op::Reshape {
            shape: Shape(vec![2, 6]),
        },
        -1.0,
        1.0,
    );
    unary("transpose", Op::Transpose { perm: vec![1, 0] }, -1.0, 1.0);
    unary(
        "slice_middle",
        Op::Slice {
            axis: 1,
            start: 1,
            end: 3,
        },
        -1.0,
        1.0,
    );
    unary(
        "slice_start",
        Op::Slice {
            axis: 0,
            start: 0,
            end: 2,
        },
        -1.0,
        1.0,
    );
    let mut b = Builder::new("transpose3");
    let x = b.param("x", &[2, 3, 4], -1.0, 1.0);
    let y = b.op(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        vec![x],
    );
    check(b, y);
    let mut b = Builder::new("concat");
    let x = b.param("x", &[3, 2], -1.0, 1.0);
    let z = b.param("z", &[3, 4], -1.0, 1.0);
    let y = b.op(Op::Concat { axis: 1 }, vec![x, z, x]);
    check(b, y);
}

#[test]
fn embedding_gradient_is_sparse_and_right() {
    let mut b = Builder::new("embedding");
    let table = b.param("emb", &[7, 3], -1.0, 1.0);
    let ids = b.ids("ids", &[1, 4, 4, 0, 6, 1], &[2, 3]);
    let y = b.op(Op::Embedding, vec![table, ids]);
    let sparse = check(b, y);
    assert_eq!(sparse, vec!["emb".to_string()]);
}

#[test]
fn losses() {
    let mut b = Builder::new("softmax_cross_entropy");
    let logits = b.param("logits", &[4, 5], -2.0, 2.0);
    let labels = b.ids("labels", &[0, 4, 2, 2], &[4]);
    let y = b.op(Op::SoftmaxCrossEntropy, vec![logits, labels]);
    check(b, y);
    binary("mse", Op::Mse, &[3, 4], &[3, 4], -1.0, 1.0);
}

#[test]
fn dropout() {
    unary(
        "dropout",
        Op::Dropout {
            rate: 0.3,
            seed: 5,
            per_sample: false,
        },
        -1.0,
        1.0,
    );
}

/// Attention, plain and causal, with more keys than queries and a value size of its
/// own: all three inputs' gradients from the one `attention_grad` op.
#[test]
fn attention() {
    for causal in [false, true] {
        for (tq, tk) in [(4, 4), (3, 5)] {
            let mut b = Builder::new(&format!("attention_causal_{causal}_{tq}x{tk}"));
            let q = b.param("q", &[2, 2, tq, 3], -1.0, 1.0);
            let k = b.param("k", &[2, 2, tk, 3], -1.0, 1.0);
            let v = b.param("v", &[2, 2, tk, 5], -1.0, 1.0);
            let y = b.op(Op::Attention { causal, scale: 0.7 }, vec![q, k, v]);
            check(b, y);
        }
    }
}

#[test]
fn layer_norm() {
    let mut b = Builder::new("layer_norm");
    let x = b.param("x", &[3, 5], -2.0, 2.0);
    let gamma = b.param("gamma", &[5], 0.5, 1.5);
    let beta = b.param("beta", &[5], -1.0, 1.0);
    let y = b.op(Op::LayerNorm { eps: 1e-5 }, vec![x, gamma, beta]);
    check(b, y);
}

#[test]
fn conv2d_and_max_pool() {
    for (stride, padding) in [(1, 0), (1, 1), (2, 1)] {
        let mut b = Builder::new(&format!("conv2d_s{stride}_p{padding}"));
        let x = b.param("x", &[2, 3, 5, 5], -1.0, 1.0);
        let w = b.param("w", &[4, 3, 3, 3], -1.0, 1.0);
        let y = b.op(Op::Conv2d { stride, padding }, vec![x, w]);
        check(b, y);
    }
    for (kernel, stride) in [(2, 2), (3, 1)] {
        let mut b = Builder::new(&format!("max_pool2d_k{kernel}_s{stride}"));
        let x = b.param("x", &[2, 2, 6, 6], -1.0, 1.0);
        let y = b.op(Op::MaxPool2d { kernel, stride }, vec![x]);
        check(b, y);
    }
}

#[test]
fn variable_used_twice_sums_its_gradients() {
    // Dense twice.
    let mut b = Builder::new("shared_dense");
    let w = b.param("w", &[4, 4], -1.0, 1.0);
    let h = b.op(
        Op::MatMul {
            transpose_a: false,
            transpose_b: false,
        },
        vec![w, w],
    );
    let y = b.op(Op::Tanh, vec![h]);
    check(b, y);
    // Two lookups: the gradient stays sparse (concatenated slices).
    let mut b = Builder::new("shared_sparse");
    let t = b.param("emb", &[6, 2], -1.0, 1.0);
    let i1 = b.ids("i1", &[1, 2, 2], &[3]);
    let i2 = b.ids("i2", &[2, 5, 0], &[3]);
    let e1 = b.op(Op::Embedding, vec![t, i1]);
    let e2 = b.op(Op::Embedding, vec![t, i2]);
    let y = b.op(Op::Mul, vec![e1, e2]);
    assert_eq!(check(b, y), vec!["emb".to_string()]);
    // A lookup and a dense read: the gradient is dense.
    let mut b = Builder::new("shared_mixed");
    let t = b.param("emb", &[3, 2], -1.0, 1.0);
    let i = b.ids("i", &[0, 2, 2], &[3]);
    let e = b.op(Op::Embedding, vec![t, i]);
    let y = b.op(Op::Add, vec![e, t]);
    assert!(check(b, y).is_empty());
}

#[test]
fn cast_passes_the_gradient_back_in_the_inputs_type() {
    // Through f32 and back, with tanh computed in f32: a step of 1e-3 keeps the
    // truncation error near 1e-7 and f32's rounding near 1e-4.
    let mut b = Builder::new("cast_f32");
    let x = b.param("x", &[3, 4], -1.0, 1.0);
    let narrow = b.op(Op::Cast { to: DType::F32 }, vec![x]);
    let t = b.op(Op::Tanh, vec![narrow]);
    let y = b.op(Op::Cast { to: DType::F64 }, vec![t]);
    check_with(b, y, 1e-3, 1e-3);
    // Through 16 bits, linearly: the rounding (2^-8 of a value near 1 for bf16, 2^-11
    // for f16) is a small part of a step of 0.5.
    for (name, half, tol) in [
        ("cast_bf16", DType::BF16, 1e-2),
        ("cast_f16", DType::F16, 2e-3),
    ] {
        let mut b = Builder::new(name);
        let x = b.param("x", &[3, 4], -1.0, 1.0);
        let narrow = b.op(Op::Cast { to: half }, vec![x]);
        let y = b.op(Op::Cast { to: DType::F64 }, vec![narrow]);
        check_with(b, y, 0.5, tol);
    }
}

#[test]
fn replica_reduce_and_train_or_eval() {
    // On one device the reductions over replicas are the identity, and training reads
    // train_or_eval's first input: batch norm's statistics flow through both.
    for reduce in [distc_ir::ReduceOp::Mean, distc_ir::ReduceOp::Sum] {
        let mut b = Builder::new(&format!("replica_reduce_{reduce:?}"));
        let x = b.param("x", &[3, 4], -1.0, 1.0);
        let running = b.param("running", &[1, 4], -1.0, 1.0);
        let m = b.op(
            Op::Mean {
                axes: vec![0],
                keep_dims: true,
            },
            vec![x],
        );
        let m = b.op(Op::ReplicaReduce { reduce }, vec![m]);
        let m = b.op(Op::TrainOrEval, vec![m, running]);
        let y = b.op(Op::Sub, vec![x, m]);
        let y = b.op(Op::Mul, vec![y, y]);
        check(b, y);
    }
}
