//! The CPU kernels and the executor on small graphs, checked against hand-computed
//! numbers or against direct-loop references written here. Each test builds a graph
//! with `Graph::add` (so the IR's shape rules agree with the kernels' results: the
//! executor rejects a result whose type differs from the IR's) and runs it through
//! `Executor`, the path training takes.
#![allow(clippy::unwrap_used)]

use distc_ir::{DType, Graph, NodeId, Op, Shape, TensorType, ValueId};
use distc_runtime::core::exec::{Executor, StepOutputs};
use distc_runtime::core::schedule::Mode;
use distc_runtime::cpu::kernels::{eval_op, KernelCtx};
use distc_runtime::{Tensor, Value};
use ndarray::{ArrayD, IxDyn};
use std::collections::HashMap;

// ---- helpers ----

fn f32t(dims: &[usize], data: &[f32]) -> Tensor {
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(dims), data.to_vec()).unwrap())
}

fn f64t(dims: &[usize], data: &[f64]) -> Tensor {
    Tensor::F64(ArrayD::from_shape_vec(IxDyn(dims), data.to_vec()).unwrap())
}

fn i32t(dims: &[usize], data: &[i32]) -> Tensor {
    Tensor::I32(ArrayD::from_shape_vec(IxDyn(dims), data.to_vec()).unwrap())
}

/// Deterministic pseudo-random numbers in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A graph under construction with its feeds.
struct G {
    g: Graph,
    feeds: HashMap<String, Tensor>,
    params: HashMap<String, Tensor>,
}

impl G {
    fn new() -> G {
        G {
            g: Graph::new("test"),
            feeds: HashMap::new(),
            params: HashMap::new(),
        }
    }
    /// An input fed with `t`.
    fn input(&mut self, name: &str, t: Tensor) -> ValueId {
        let ty = t.tensor_type();
        self.feeds.insert(name.into(), t);
        self.g
            .add(
                Op::Input {
                    name: name.into(),
                    ty,
                },
                vec![],
            )
            .unwrap()
            .into()
    }
    /// A parameter holding `t`.
    fn param(&mut self, name: &str, t: Tensor) -> ValueId {
        let ty = t.tensor_type();
        self.params.insert(name.into(), t);
        self.g
            .add(
                Op::Param {
                    name: name.into(),
                    ty,
                    init: distc_ir::Init::Zeros,
                    frozen: false,
                },
                vec![],
            )
            .unwrap()
            .into()
    }
    fn op(&mut self, op: Op, inputs: &[ValueId]) -> ValueId {
        self.g.add(op, inputs.to_vec()).unwrap().into()
    }
    fn node(&mut self, op: Op, inputs: &[ValueId]) -> NodeId {
        self.g.add(op, inputs.to_vec()).unwrap()
    }
    fn output(&mut self, name: &str, v: ValueId) {
        self.g
            .add(Op::Output { name: name.into() }, vec![v])
            .unwrap();
    }
    fn run(&self, mode: Mode) -> StepOutputs {
        self.try_run(mode).unwrap()
    }
    fn try_run(&self, mode: Mode) -> Result<StepOutputs, distc_runtime::RuntimeError> {
        let mut ex = Executor::new(&self.g)?;
        ex.run(&self.feeds, &self.params, mode, 1)
    }
}

/// The output `name`: its shape and its elements as f64.
fn out(o: &StepOutputs, name: &str) -> (Vec<usize>, Vec<f64>) {
    let t = &o.outputs.iter().find(|(n, _)| n == name).unwrap().1;
    (t.shape().to_vec(), t.to_f64_vec())
}

fn assert_close(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ: {got:?} vs {want:?}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "element {i}: got {a}, want {b}\n got {got:?}\nwant {want:?}"
        );
    }
}

/// Runs `op` on single inputs fed as `x0, x1, ..` and returns its output.
fn run_op(op: Op, inputs: Vec<Tensor>) -> (Vec<usize>, Vec<f64>) {
    let mut g = G::new();
    let ids: Vec<ValueId> = inputs
        .into_iter()
        .enumerate()
        .map(|(i, t)| g.input(&format!("x{i}"), t))
        .collect();
    let y = g.op(op, &ids);
    g.output("y", y);
    out(&g.run(Mode::Train), "y")
}

/// Row-major `[m,n] = a[m,k] @ b[k,n]`.
fn matmul_ref(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for l in 0..k {
                c[i * n + j] += a[i * k + l] as f64 * b[l * n + j] as f64;
            }
        }
    }
    c
}

fn transpose_data(a: &[f32], r: usize, c: usize) -> Vec<f32> {
    let mut t = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            t[j * r + i] = a[i * c + j];
        }
    }
    t
}

// ---- dense forward ops ----

#[test]
fn matmul_plain_hand_computed() {
    let a = f32t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let b = f32t(&[3, 2], &[7., 8., 9., 10., 11., 12.]);
    let (s, v) = run_op(
        Op::MatMul {
            transpose_a: false,
            transpose_b: false,
        },
        vec![a, b],
    );
    assert_eq!(s, [2, 2]);
    assert_close(&v, &[58., 64., 139., 154.], 1e-6);
}

#[test]
fn matmul_every_transpose_combination() {
    let (m, k, n) = (5, 7, 3);
    let a = noise(m * k, 1);
    let b = noise(k * n, 2);
    let want = matmul_ref(&a, &b, m, k, n);
    for ta in [false, true] {
        for tb in [false, true] {
            let at = if ta {
                f32t(&[k, m], &transpose_data(&a, m, k))
            } else {
                f32t(&[m, k], &a)
            };
            let bt = if tb {
                f32t(&[n, k], &transpose_data(&b, k, n))
            } else {
                f32t(&[k, n], &b)
            };
            let (s, v) = run_op(
                Op::MatMul {
                    transpose_a: ta,
                    transpose_b: tb,
                },
                vec![at, bt],
            );
            assert_eq!(s, [m, n], "ta={ta} tb={tb}");
            assert_close(&v, &want, 1e-5);
        }
    }
}

#[test]
fn broadcasting_add_sub_mul_div() {
    let a = f32t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let b = f32t(&[3], &[10., 20., 30.]);
    let (s, v) = run_op(Op::Add, vec![a.clone(), b.clone()]);
    assert_eq!(s, [2, 3]);
    assert_close(&v, &[11., 22., 33., 14., 25., 36.], 0.0);
    // The broadcast operand on the left.
    let (_, v) = run_op(Op::Sub, vec![b.clone(), a.clone()]);
    assert_close(&v, &[9., 18., 27., 6., 15., 24.], 0.0);
    let (_, v) = run_op(Op::Div, vec![a.clone(), b]);
    assert_close(&v, &[0.1, 0.1, 0.1, 0.4, 0.25, 0.2], 1e-6);
    // Both operands grow: [2,1] * [1,3] -> [2,3].
    let c = f32t(&[2, 1], &[1., 2.]);
    let d = f32t(&[1, 3], &[3., 4., 5.]);
    let (s, v) = run_op(Op::Mul, vec![c, d]);
    assert_eq!(s, [2, 3]);
    assert_close(&v, &[3., 4., 5., 6., 8., 10.], 0.0);
}

#[test]
fn broadcasting_in_place_paths_give_the_same_numbers() {
    // Owned operands (results of earlier kernels) take the in-place paths.
    let mut g = G::new();
    let x = g.input("x", f32t(&[2, 3], &[1., -2., 3., -4., 5., -6.]));
    let b = g.input("b", f32t(&[3], &[1., 2., 3.]));
    let r = g.op(Op::Relu, &[x]); // owned [2,3]
    let nb = g.op(Op::Neg, &[b]); // owned [3]
    let s1 = g.op(Op::Sub, &[r, nb]); // r owned and full: in place into r
    let nb2 = g.op(Op::Neg, &[b]);
    let x2 = g.op(Op::Neg, &[x]); // owned [2,3]
    let s2 = g.op(Op::Sub, &[nb2, x2]); // right operand owned and full
    g.output("s1", s1);
    g.output("s2", s2);
    let o = g.run(Mode::Train);
    assert_close(&out(&o, "s1").1, &[2., 2., 6., 1., 7., 3.], 0.0);
    assert_close(&out(&o, "s2").1, &[0., -4., 0., -5., 3., -9.], 0.0);
}

/// `a - b` by numpy broadcasting, element by element: the reference.
fn sub_ref(a: &[f32], ad: &[usize], b: &[f32], bd: &[usize]) -> (Vec<usize>, Vec<f64>) {
    let n = ad.len().max(bd.len());
    let pad = |d: &[usize]| -> Vec<usize> {
        let mut v = vec![1; n - d.len()];
        v.extend_from_slice(d);
        v
    };
    let (ap, bp) = (pad(ad), pad(bd));
    let od: Vec<usize> = ap.iter().zip(&bp).map(|(&x, &y)| x.max(y)).collect();
    let total: usize = od.iter().product();
    let flat = |idx: &[usize], d: &[usize]| {
        idx.iter()
            .zip(d)
            .fold(0, |acc, (&i, &n)| acc * n + if n == 1 { 0 } else { i })
    };
    let mut out = Vec::with_capacity(total);
    for k in 0..total {
        let mut idx = vec![0; n];
        let mut r = k;
        for i in (0..n).rev() {
            idx[i] = r % od[i];
            r /= od[i];
        }
        out.push(a[flat(&idx, &ap)] as f64 - b[flat(&idx, &bp)] as f64);
    }
    (od, out)
}

#[test]
fn broadcasting_matches_a_reference_on_many_shapes() {
    let cases: [(&[usize], &[usize]); 9] = [
        (&[2, 3, 4], &[4]),
        (&[2, 3, 4], &[3, 1]),
        (&[2, 3, 4], &[2, 1, 4]),
        (&[2, 1, 4], &[3, 1]),
        (&[1, 3, 1], &[2, 1, 5]),
        (&[4], &[]),
        (&[], &[2, 2]),
        (&[2, 3, 1, 2], &[1, 3, 2, 1]),
        (&[3, 1, 2, 1], &[3, 4, 1, 5]),
    ];
    for (ad, bd) in cases {
        for (xd, yd) in [(ad, bd), (bd, ad)] {
            let x = noise(xd.iter().product(), 8);
            let y = noise(yd.iter().product(), 9);
            let (want_s, want) = sub_ref(&x, xd, &y, yd);
            // Borrowed operands (feeds), then owned ones (results of `neg`).
            let (s, v) = run_op(Op::Sub, vec![f32t(xd, &x), f32t(yd, &y)]);
            assert_eq!(s, want_s, "{xd:?} - {yd:?}");
            assert_close(&v, &want, 1e-6);
            let mut g = G::new();
            let xi = g.input("x", f32t(xd, &x));
            let yi = g.input("y", f32t(yd, &y));
            let nx = g.op(Op::Neg, &[xi]);
            let ny = g.op(Op::Neg, &[yi]);
            let d = g.op(Op::Sub, &[ny, nx]); // -y - -x = x - y
            g.output("d", d);
            let (s, v) = out(&g.run(Mode::Train), "d");
            assert_eq!(s, want_s, "owned {xd:?} - {yd:?}");
            assert_close(&v, &want, 1e-6);
        }
    }
}

#[test]
fn values_read_twice_are_not_overwritten() {
    let mut g = G::new();
    let x = g.input("x", f32t(&[4], &[-1., 0., 1., 2.]));
    let h = g.op(Op::Relu, &[x]);
    let a = g.op(Op::Neg, &[h]); // not h's last use: must not overwrite h
    let b = g.op(Op::Exp, &[h]);
    let c = g.op(Op::Add, &[b, b]); // one value in both slots
    g.output("a", a);
    g.output("c", c);
    g.output("h", h);
    let o = g.run(Mode::Train);
    assert_close(&out(&o, "a").1, &[0., 0., -1., -2.], 0.0);
    let e = |v: f64| 2.0 * v.exp();
    assert_close(&out(&o, "c").1, &[e(0.), e(0.), e(1.), e(2.)], 1e-6);
    assert_close(&out(&o, "h").1, &[0., 0., 1., 2.], 0.0);
}

#[test]
fn unary_ops() {
    let x = f32t(&[4], &[-2., -0.5, 0.5, 2.]);
    let xs = [-2f64, -0.5, 0.5, 2.];
    type Case = (Op, fn(f64) -> f64);
    let cases: Vec<Case> = vec![
        (Op::Neg, |v| -v),
        (Op::Relu, |v| v.max(0.0)),
        (Op::Sigmoid, |v| 1.0 / (1.0 + (-v).exp())),
        (Op::Tanh, f64::tanh),
        (Op::Exp, f64::exp),
    ];
    for (op, f) in cases {
        let (_, v) = run_op(op.clone(), vec![x.clone()]);
        let want: Vec<f64> = xs.iter().map(|&v| f(v)).collect();
        assert_close(&v, &want, 1e-6);
    }
    let (_, v) = run_op(Op::Log, vec![f32t(&[2], &[1., std::f32::consts::E])]);
    assert_close(&v, &[0., 1.], 1e-6);
}

#[test]
fn softmax_rows_sum_to_one_and_are_stable() {
    let x = f32t(&[2, 3], &[1., 2., 3., 1000., 1000., 1000.]);
    let (s, v) = run_op(Op::Softmax { axis: 1 }, vec![x.clone()]);
    assert_eq!(s, [2, 3]);
    let z = 1f64.exp() + 2f64.exp() + 3f64.exp();
    assert_close(
        &v,
        &[
            1f64.exp() / z,
            2f64.exp() / z,
            3f64.exp() / z,
            1. / 3.,
            1. / 3.,
            1. / 3.,
        ],
        1e-6,
    );
    for row in v.chunks(3) {
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6);
    }
    let (_, l) = run_op(Op::LogSoftmax { axis: 1 }, vec![x]);
    let want: Vec<f64> = v.iter().map(|p| p.ln()).collect();
    assert_close(&l, &want, 1e-5);
    // Along axis 0.
    let (_, v) = run_op(
        Op::Softmax { axis: 0 },
        vec![f32t(&[2, 2], &[0., 1., 0., 1.])],
    );
    assert_close(&v, &[0.5, 0.5, 0.5, 0.5], 1e-6);
}

#[test]
fn sum_and_mean_over_axes() {
    let x = f32t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let sum = |axes: Vec<usize>, keep_dims| Op::Sum { axes, keep_dims };
    let (s, v) = run_op(sum(vec![0], false), vec![x.clone()]);
    assert_eq!(s, [3]);
    assert_close(&v, &[5., 7., 9.], 0.0);
    let (s, v) = run_op(sum(vec![1], true), vec![x.clone()]);
    assert_eq!(s, [2, 1]);
    assert_close(&v, &[6., 15.], 0.0);
    let (s, v) = run_op(sum(vec![0, 1], false), vec![x.clone()]);
    assert_eq!(s, Vec::<usize>::new());
    assert_close(&v, &[21.], 0.0);
    let (s, v) = run_op(
        Op::Mean {
            axes: vec![0, 1],
            keep_dims: true,
        },
        vec![x.clone()],
    );
    assert_eq!(s, [1, 1]);
    assert_close(&v, &[3.5], 1e-7);
    let (_, v) = run_op(
        Op::Mean {
            axes: vec![1],
            keep_dims: false,
        },
        vec![x],
    );
    assert_close(&v, &[2., 5.], 1e-7);
}

#[test]
fn sum_to_and_broadcast_to() {
    let x = f32t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let (s, v) = run_op(
        Op::SumTo {
            shape: Shape(vec![3]),
        },
        vec![x.clone()],
    );
    assert_eq!(s, [3]);
    assert_close(&v, &[5., 7., 9.], 0.0);
    let (s, v) = run_op(
        Op::SumTo {
            shape: Shape(vec![2, 1]),
        },
        vec![x.clone()],
    );
    assert_eq!(s, [2, 1]);
    assert_close(&v, &[6., 15.], 0.0);
    let (s, v) = run_op(
        Op::SumTo {
            shape: Shape(vec![1, 1]),
        },
        vec![x.clone()],
    );
    assert_eq!(s, [1, 1]);
    assert_close(&v, &[21.], 0.0);
    let (s, v) = run_op(
        Op::SumTo {
            shape: Shape(vec![]),
        },
        vec![x],
    );
    assert_eq!(s, Vec::<usize>::new());
    assert_close(&v, &[21.], 0.0);
    let (s, v) = run_op(
        Op::BroadcastTo {
            shape: Shape(vec![2, 3]),
        },
        vec![f32t(&[2, 1], &[1., 2.])],
    );
    assert_eq!(s, [2, 3]);
    assert_close(&v, &[1., 1., 1., 2., 2., 2.], 0.0);
}

#[test]
fn reshape_transpose_concat_slice() {
    let x = f32t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let (s, v) = run_op(
        Op::Reshape {
            shape: Shape(vec![3, 2]),
        },
        vec![x.clone()],
    );
    assert_eq!(s, [3, 2]);
    assert_close(&v, &[1., 2., 3., 4., 5., 6.], 0.0);
    let (s, v) = run_op(Op::Transpose { perm: vec![1, 0] }, vec![x.clone()]);
    assert_eq!(s, [3, 2]);
    assert_close(&v, &[1., 4., 2., 5., 3., 6.], 0.0);
    // A transposed result reshaped: reshape reads row-major order of the transpose.
    let mut g = G::new();
    let xi = g.input("x", x.clone());
    let t = g.op(Op::Transpose { perm: vec![1, 0] }, &[xi]);
    let r = g.op(
        Op::Reshape {
            shape: Shape(vec![6]),
        },
        &[t],
    );
    g.output("r", r);
    assert_close(
        &out(&g.run(Mode::Train), "r").1,
        &[1., 4., 2., 5., 3., 6.],
        0.0,
    );
    // Rank 3 permutation.
    let y = f32t(&[2, 2, 2], &[0., 1., 2., 3., 4., 5., 6., 7.]);
    let (s, v) = run_op(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        vec![y],
    );
    assert_eq!(s, [2, 2, 2]);
    assert_close(&v, &[0., 2., 4., 6., 1., 3., 5., 7.], 0.0);
    // Concat along each axis.
    let z = f32t(&[2, 1], &[7., 8.]);
    let (s, v) = run_op(Op::Concat { axis: 1 }, vec![x.clone(), z]);
    assert_eq!(s, [2, 4]);
    assert_close(&v, &[1., 2., 3., 7., 4., 5., 6., 8.], 0.0);
    let w = f32t(&[1, 3], &[9., 9., 9.]);
    let (s, v) = run_op(Op::Concat { axis: 0 }, vec![w.clone(), x.clone(), w]);
    assert_eq!(s, [4, 3]);
    assert_close(&v, &[9., 9., 9., 1., 2., 3., 4., 5., 6., 9., 9., 9.], 0.0);
    // Slice.
    let (s, v) = run_op(
        Op::Slice {
            axis: 1,
            start: 1,
            end: 3,
        },
        vec![x.clone()],
    );
    assert_eq!(s, [2, 2]);
    assert_close(&v, &[2., 3., 5., 6.], 0.0);
    let (s, v) = run_op(
        Op::Slice {
            axis: 0,
            start: 1,
            end: 2,
        },
        vec![x],
    );
    assert_eq!(s, [1, 3]);
    assert_close(&v, &[4., 5., 6.], 0.0);
    // Layout ops work on ids too.
    let ids = i32t(&[2, 3], &[1, 2, 3, 4, 5, 6]);
    let (s, v) = run_op(
        Op::Slice {
            axis: 1,
            start: 2,
            end: 3,
        },
        vec![ids],
    );
    assert_eq!(s, [2, 1]);
    assert_close(&v, &[3., 6.], 0.0);
}

// ---- losses ----

#[test]
fn softmax_cross_entropy_known_case_and_gradient() {
    let mut g = G::new();
    let logits = g.input("logits", f32t(&[2, 3], &[1., 2., 3., 1., 1., 1.]));
    let labels = g.input("labels", i32t(&[2], &[2, 0]));
    let loss = g.op(Op::SoftmaxCrossEntropy, &[logits, labels]);
    g.node(Op::Loss, &[loss]);
    let one = g.op(
        Op::Constant {
            value: 1.0,
            ty: TensorType::f32(vec![]),
        },
        &[],
    );
    let d = g.op(Op::SoftmaxCrossEntropyGrad, &[one, logits, labels]);
    g.output("d", d);
    let o = g.run(Mode::Train);
    let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
    let want = ((lse - 3.0) + 3f64.ln()) / 2.0;
    assert!(
        (o.loss.unwrap() - want).abs() < 1e-6,
        "{:?} vs {want}",
        o.loss
    );
    let p: Vec<f64> = [1f64, 2., 3.].iter().map(|v| (v - lse).exp()).collect();
    let third = 1.0 / 3.0;
    assert_close(
        &out(&o, "d").1,
        &[
            p[0] / 2.,
            p[1] / 2.,
            (p[2] - 1.) / 2.,
            (third - 1.) / 2.,
            third / 2.,
            third / 2.,
        ],
        1e-6,
    );
}

#[test]
fn softmax_cross_entropy_rejects_labels_out_of_range() {
    let mut g = G::new();
    let logits = g.input("logits", f32t(&[2, 3], &[1., 2., 3., 1., 1., 1.]));
    let labels = g.input("labels", i32t(&[2], &[2, 3]));
    let loss = g.op(Op::SoftmaxCrossEntropy, &[logits, labels]);
    g.node(Op::Loss, &[loss]);
    let e = g.try_run(Mode::Train).unwrap_err().to_string();
    assert!(
        e.contains("softmax_cross_entropy") && e.contains("label 3"),
        "{e}"
    );
}

#[test]
fn mse_and_its_gradient() {
    let mut g = G::new();
    let p = g.input("p", f32t(&[2, 2], &[1., 2., 3., 4.]));
    let t = g.input("t", f32t(&[2, 2], &[1., 0., 3., 2.]));
    let l = g.op(Op::Mse, &[p, t]);
    g.node(Op::Loss, &[l]);
    let two = g.op(
        Op::Constant {
            value: 2.0,
            ty: TensorType::f32(vec![]),
        },
        &[],
    );
    let d = g.op(Op::MseGrad, &[two, p, t]);
    g.output("d", d);
    let o = g.run(Mode::Train);
    assert!((o.loss.unwrap() - 2.0).abs() < 1e-6);
    assert_close(&out(&o, "d").1, &[0., 2., 0., 2.], 1e-6);
}

// ---- embedding and slices ----

fn table() -> Tensor {
    f32t(&[4, 2], &[0., 1., 10., 11., 20., 21., 30., 31.])
}

#[test]
fn embedding_gathers_rows() {
    let (s, v) = run_op(Op::Embedding, vec![table(), i32t(&[2, 2], &[1, 3, 1, 0])]);
    assert_eq!(s, [2, 2, 2]);
    assert_close(&v, &[10., 11., 30., 31., 10., 11., 0., 1.], 0.0);
}

#[test]
fn embedding_rejects_ids_out_of_range() {
    let mut g = G::new();
    let t = g.param("emb", table());
    let ids = g.input("ids", i32t(&[3], &[0, 4, 1]));
    let e = g.op(Op::Embedding, &[t, ids]);
    g.output("e", e);
    let err = g.try_run(Mode::Train).unwrap_err().to_string();
    assert!(err.contains("id 4") && err.contains("4 rows"), "{err}");
    assert!(err.contains("(embedding)"), "{err}");
}

#[test]
fn embedding_grad_is_slices_with_repeats_kept() {
    let mut g = G::new();
    let ids = g.input("ids", i32t(&[2, 2], &[1, 3, 1, 0]));
    let dy = g.input("dy", f32t(&[2, 2, 2], &[1., 2., 3., 4., 5., 6., 7., 8.]));
    let grad = g.op(
        Op::EmbeddingGrad {
            table: TensorType::f32(vec![4, 2]),
        },
        &[dy, ids],
    );
    g.node(
        Op::ParamGrad {
            param: "emb".into(),
        },
        &[grad],
    );
    let dense = g.op(Op::Densify, &[grad]);
    g.output("dense", dense);
    let o = g.run(Mode::Train);
    assert_eq!(o.grads.len(), 1);
    let Value::Slices(s) = &o.grads[0].1 else {
        panic!("not slices: {:?}", o.grads[0].1)
    };
    assert_eq!(o.grads[0].0, "emb");
    assert_eq!(s.indices, [1, 3, 1, 0]);
    assert_eq!(s.dense_shape, [4, 2]);
    assert_eq!(s.values.shape(), [4, 2]);
    assert_close(
        &s.values.to_f64_vec(),
        &[1., 2., 3., 4., 5., 6., 7., 8.],
        0.0,
    );
    // Densify adds the repeated row 1 up.
    let (shape, v) = out(&o, "dense");
    assert_eq!(shape, [4, 2]);
    assert_close(&v, &[7., 8., 1. + 5., 2. + 6., 0., 0., 3., 4.], 0.0);
}

#[test]
fn concat_slices_joins_indices_and_values() {
    let mut g = G::new();
    let ty = TensorType::f32(vec![4, 2]);
    let ids1 = g.input("a", i32t(&[1], &[2]));
    let ids2 = g.input("b", i32t(&[2], &[2, 0]));
    let dy1 = g.input("da", f32t(&[1, 2], &[1., 1.]));
    let dy2 = g.input("db", f32t(&[2, 2], &[2., 3., 4., 5.]));
    let s1 = g.op(Op::EmbeddingGrad { table: ty.clone() }, &[dy1, ids1]);
    let s2 = g.op(Op::EmbeddingGrad { table: ty }, &[dy2, ids2]);
    let j = g.op(Op::ConcatSlices, &[s1, s2]);
    g.node(
        Op::ParamGrad {
            param: "emb".into(),
        },
        &[j],
    );
    let d = g.op(Op::Densify, &[j]);
    g.output("d", d);
    let o = g.run(Mode::Train);
    let Value::Slices(s) = &o.grads[0].1 else {
        panic!("not slices")
    };
    assert_eq!(s.indices, [2, 2, 0]);
    assert_close(&s.values.to_f64_vec(), &[1., 1., 2., 3., 4., 5.], 0.0);
    assert_close(&out(&o, "d").1, &[4., 5., 0., 0., 3., 4., 0., 0.], 0.0);
}

// ---- convolution and pooling ----

/// Direct-loop convolution, NCHW, zero padding.
fn conv_ref(
    x: &[f32],
    xd: [usize; 4],
    w: &[f32],
    wd: [usize; 4],
    s: usize,
    p: usize,
) -> (Vec<usize>, Vec<f64>) {
    let [n, c, h, wi] = xd;
    let [o, _, kh, kw] = wd;
    let oh = (h + 2 * p - kh) / s + 1;
    let ow = (wi + 2 * p - kw) / s + 1;
    let mut y = vec![0.0; n * o * oh * ow];
    for b in 0..n {
        for f in 0..o {
            for i in 0..oh {
                for j in 0..ow {
                    let mut acc = 0.0f64;
                    for ch in 0..c {
                        for u in 0..kh {
                            for v in 0..kw {
                                let (yy, xx) = (
                                    (i * s + u) as isize - p as isize,
                                    (j * s + v) as isize - p as isize,
                                );
                                if yy < 0 || xx < 0 || yy >= h as isize || xx >= wi as isize {
                                    continue;
                                }
                                let xv = x[((b * c + ch) * h + yy as usize) * wi + xx as usize];
                                let wv = w[((f * c + ch) * kh + u) * kw + v];
                                acc += xv as f64 * wv as f64;
                            }
                        }
                    }
                    y[((b * o + f) * oh + i) * ow + j] = acc;
                }
            }
        }
    }
    (vec![n, o, oh, ow], y)
}

#[test]
fn conv2d_matches_direct_loops() {
    for (xd, wd, s, p) in [
        ([2, 3, 5, 6], [4, 3, 3, 3], 1, 0),
        ([2, 3, 5, 6], [4, 3, 3, 3], 2, 1),
        ([1, 2, 7, 7], [3, 2, 2, 3], 3, 2),
        ([3, 1, 4, 4], [2, 1, 1, 1], 1, 0),
    ] {
        let x = noise(xd.iter().product(), 3);
        let w = noise(wd.iter().product(), 4);
        let (want_s, want) = conv_ref(&x, xd, &w, wd, s, p);
        let (got_s, got) = run_op(
            Op::Conv2d {
                stride: s,
                padding: p,
            },
            vec![f32t(&xd, &x), f32t(&wd, &w)],
        );
        assert_eq!(got_s, want_s, "x {xd:?} w {wd:?} stride {s} pad {p}");
        assert_close(&got, &want, 1e-5);
    }
}

#[test]
fn conv2d_gradients_are_adjoint_to_the_convolution() {
    // For a linear map y = conv(x, w): <y, dy> = <x, grad_input(dy, w)> = <w, grad_filter(dy, x)>.
    let (xd, wd, s, p) = ([2usize, 3, 6, 5], [4usize, 3, 3, 2], 2, 1);
    let x = noise(xd.iter().product(), 5);
    let w = noise(wd.iter().product(), 6);
    let (yd, y) = conv_ref(&x, xd, &w, wd, s, p);
    let dy = noise(yd.iter().product(), 7);
    let mut g = G::new();
    let xi = g.input("x", f32t(&xd, &x));
    let wi = g.input("w", f32t(&wd, &w));
    let dyi = g.input("dy", f32t(&yd, &dy));
    let dx = g.op(
        Op::Conv2dGradInput {
            stride: s,
            padding: p,
            input: Shape(xd.to_vec()),
        },
        &[dyi, wi],
    );
    let dw = g.op(
        Op::Conv2dGradFilter {
            stride: s,
            padding: p,
            filter: Shape(wd.to_vec()),
        },
        &[dyi, xi],
    );
    g.output("dx", dx);
    g.output("dw", dw);
    let o = g.run(Mode::Train);
    let dot = |a: &[f64], b: &[f32]| a.iter().zip(b).map(|(a, &b)| a * b as f64).sum::<f64>();
    let ydy = dot(&y, &dy);
    let (dxs, dxv) = out(&o, "dx");
    let (dws, dwv) = out(&o, "dw");
    assert_eq!(dxs, xd);
    assert_eq!(dws, wd);
    assert!(
        (dot(&dxv, &x) - ydy).abs() < 1e-4,
        "{} vs {ydy}",
        dot(&dxv, &x)
    );
    assert!(
        (dot(&dwv, &w) - ydy).abs() < 1e-4,
        "{} vs {ydy}",
        dot(&dwv, &w)
    );
}

#[test]
fn max_pool2d_and_its_gradient_agree_on_ties() {
    // One 4x4 plane, window 2, stride 2; the top-left window is all ties.
    let x = f32t(
        &[1, 1, 4, 4],
        &[
            5., 5., 1., 2., 5., 5., 3., 0., 0., 1., 9., 9., 2., 0., 9., 8.,
        ],
    );
    let (s, v) = run_op(
        Op::MaxPool2d {
            kernel: 2,
            stride: 2,
        },
        vec![x.clone()],
    );
    assert_eq!(s, [1, 1, 2, 2]);
    assert_close(&v, &[5., 3., 2., 9.], 0.0);
    let (s, d) = run_op(
        Op::MaxPool2dGrad {
            kernel: 2,
            stride: 2,
        },
        vec![f32t(&[1, 1, 2, 2], &[1., 2., 3., 4.]), x],
    );
    assert_eq!(s, [1, 1, 4, 4]);
    // Ties go to the first maximum in row-major window order.
    assert_close(
        &d,
        &[
            1., 0., 0., 0., 0., 0., 2., 0., 0., 0., 4., 0., 3., 0., 0., 0.,
        ],
        0.0,
    );
    // Overlapping windows (stride 1) add up at a shared maximum.
    let x = f32t(&[1, 1, 1, 3], &[0., 9., 0.]);
    let (_, d) = run_op(
        Op::MaxPool2dGrad {
            kernel: 1,
            stride: 1,
        },
        vec![f32t(&[1, 1, 1, 3], &[1., 1., 1.]), x.clone()],
    );
    assert_close(&d, &[1., 1., 1.], 0.0);
}

// ---- layer norm ----

#[test]
fn layer_norm_known_values_and_gradient_sums() {
    let x = f32t(&[2, 3], &[1., 2., 3., 2., 4., 9.]);
    let gamma = f32t(&[3], &[1., 2., 0.5]);
    let beta = f32t(&[3], &[0., 1., -1.]);
    let eps = 1e-5;
    let (s, v) = run_op(Op::LayerNorm { eps }, vec![x, gamma, beta]);
    assert_eq!(s, [2, 3]);
    let norm = |r: [f64; 3]| {
        let m = r.iter().sum::<f64>() / 3.;
        let var = r.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / 3.;
        r.map(|v| (v - m) / (var + eps).sqrt())
    };
    let (a, b) = (norm([1., 2., 3.]), norm([2., 4., 9.]));
    let g = [1., 2., 0.5];
    let bt = [0., 1., -1.];
    let want: Vec<f64> = a
        .iter()
        .chain(&b)
        .enumerate()
        .map(|(i, v)| v * g[i % 3] + bt[i % 3])
        .collect();
    assert_close(&v, &want, 1e-5);

    // Gradient: dbeta = sum(dy), dgamma = sum(dy * xhat); dx sums to 0 per row.
    let mut gr = G::new();
    let dy = gr.input("dy", f32t(&[2, 3], &[1., -1., 2., 0.5, 0.5, 3.]));
    let xi = gr.input("x", f32t(&[2, 3], &[1., 2., 3., 2., 4., 9.]));
    let gi = gr.input("g", f32t(&[3], &[1., 2., 0.5]));
    let n = gr.node(Op::LayerNormGrad { eps }, &[dy, xi, gi]);
    gr.output("dx", n.out(0));
    gr.output("dgamma", n.out(1));
    gr.output("dbeta", n.out(2));
    let o = gr.run(Mode::Train);
    assert_close(&out(&o, "dbeta").1, &[1.5, -0.5, 5.], 1e-6);
    let dyv = [1., -1., 2., 0.5, 0.5, 3.];
    let xhat: Vec<f64> = a.iter().chain(&b).copied().collect();
    let dg: Vec<f64> = (0..3)
        .map(|j| dyv[j] * xhat[j] + dyv[3 + j] * xhat[3 + j])
        .collect();
    assert_close(&out(&o, "dgamma").1, &dg, 1e-5);
    let dx = out(&o, "dx").1;
    for row in dx.chunks(3) {
        assert!(row.iter().sum::<f64>().abs() < 1e-4, "{row:?}");
    }
}

// ---- dropout ----

#[test]
fn dropout_masks_agree_keep_rate_and_eval_is_identity() {
    let n = 200_000;
    let rate = 0.3;
    let mut g = G::new();
    let x = g.input("x", f32t(&[n], &vec![1.0; n]));
    let y = g.op(
        Op::Dropout {
            rate,
            seed: 7,
            per_sample: false,
        },
        &[x],
    );
    let dy = g.op(
        Op::DropoutGrad {
            rate,
            seed: 7,
            per_sample: false,
        },
        &[x],
    );
    let other = g.op(
        Op::Dropout {
            rate,
            seed: 8,
            per_sample: false,
        },
        &[x],
    );
    g.output("y", y);
    g.output("dy", dy);
    g.output("other", other);
    let o = g.run(Mode::Train);
    let (_, yv) = out(&o, "y");
    let (_, dv) = out(&o, "dy");
    let scale = 1.0 / (1.0 - rate);
    let kept = yv.iter().filter(|&&v| v != 0.0).count();
    assert!(yv.iter().all(|&v| v == 0.0 || (v - scale).abs() < 1e-6));
    let frac = kept as f64 / n as f64;
    assert!((frac - (1.0 - rate)).abs() < 0.005, "kept {frac}");
    assert_eq!(yv, dv, "forward and backward masks differ");
    assert_ne!(yv, out(&o, "other").1, "the seed does not change the mask");

    // Another step: another mask.
    let mut ex = Executor::new(&g.g).unwrap();
    let o2 = ex.run(&g.feeds, &g.params, Mode::Train, 2).unwrap();
    assert_ne!(yv, out(&o2, "y").1, "the step does not change the mask");

    // Evaluation: identity (both ops).
    let o = g.run(Mode::Eval);
    assert!(out(&o, "y").1.iter().all(|&v| v == 1.0));
    assert!(out(&o, "dy").1.iter().all(|&v| v == 1.0));
}

// ---- f64 ----

#[test]
fn float64_graphs_run_in_f64() {
    let mut g = G::new();
    let a = g.input("a", f64t(&[2, 2], &[1., 2., 3., 4.]));
    let b = g.input("b", f64t(&[2], &[0.5, -0.5]));
    let m = g.op(
        Op::MatMul {
            transpose_a: true,
            transpose_b: false,
        },
        &[a, a],
    );
    let s = g.op(Op::Add, &[m, b]);
    let p = g.op(Op::Softmax { axis: 1 }, &[s]);
    g.output("p", p);
    let o = g.run(Mode::Train);
    let t = &o.outputs[0].1;
    assert_eq!(t.dtype(), DType::F64);
    // aᵀa = [[10, 14], [14, 20]]; + b = [[10.5, 13.5], [14.5, 19.5]].
    let sm = |u: f64, v: f64| [1.0 / (1.0 + (v - u).exp()), 1.0 / (1.0 + (u - v).exp())];
    let want: Vec<f64> = sm(10.5, 13.5).into_iter().chain(sm(14.5, 19.5)).collect();
    assert_close(&t.to_f64_vec(), &want, 1e-12);
}

#[test]
fn mixed_dtypes_are_an_error_not_a_panic() {
    let op = Op::Add;
    let a = Value::Tensor(f32t(&[2], &[1., 2.]));
    let b = Value::Tensor(f64t(&[2], &[1., 2.]));
    let ctx = KernelCtx {
        step: 0,
        training: true,
        rank: 0,
        model_rank: 0,
    };
    let e = eval_op(&op, &[&a, &b], &ctx).unwrap_err().to_string();
    assert!(e.contains("f64") && e.contains("f32"), "{e}");
    // Shapes that do not broadcast.
    let c = Value::Tensor(f32t(&[3], &[1., 2., 3.]));
    assert!(eval_op(&op, &[&a, &c], &ctx).is_err());
    // Sources are the executor's.
    let src = Op::Constant {
        value: 1.0,
        ty: TensorType::f32(vec![1]),
    };
    assert!(eval_op(&src, &[], &ctx).is_err());
}

// ---- executor ----

#[test]
fn a_feed_of_the_wrong_shape_names_both_shapes() {
    let mut g = G::new();
    let x = g.input("x", f32t(&[2, 3], &[0.; 6]));
    let r = g.op(Op::Relu, &[x]);
    g.output("r", r);
    let mut ex = Executor::new(&g.g).unwrap();
    let mut feeds = HashMap::new();
    feeds.insert("x".to_string(), f32t(&[3, 2], &[0.; 6]));
    let e = ex
        .run(&feeds, &g.params, Mode::Train, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("input `x`") && e.contains("f32[3,2]") && e.contains("f32[2,3]"),
        "{e}"
    );
    feeds.insert("x".to_string(), i32t(&[2, 3], &[0; 6]));
    let e = ex
        .run(&feeds, &g.params, Mode::Train, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("i32[2,3]") && e.contains("f32[2,3]"), "{e}");
    let e = ex
        .run(&HashMap::new(), &g.params, Mode::Train, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`x`"), "{e}");
}

#[test]
fn eval_runs_only_what_loss_and_outputs_need() {
    // A tiny model: loss = mse(x @ w, t); the gradient of w needs `extra`, which
    // evaluation does not feed.
    let mut g = G::new();
    let x = g.input("x", f32t(&[1, 2], &[1., 2.]));
    let t = g.input("t", f32t(&[1, 1], &[0.]));
    let w = g.param("w", f32t(&[2, 1], &[0.5, 0.25]));
    let y = g.op(
        Op::MatMul {
            transpose_a: false,
            transpose_b: false,
        },
        &[x, w],
    );
    let l = g.op(Op::Mse, &[y, t]);
    g.node(Op::Loss, &[l]);
    g.output("prediction", y);
    let extra = g.input("extra", f32t(&[2, 1], &[1., 1.]));
    let gw = g.op(Op::Mul, &[w, extra]);
    g.node(Op::ParamGrad { param: "w".into() }, &[gw]);
    let o = g.run(Mode::Train);
    assert!((o.loss.unwrap() - 1.0).abs() < 1e-6);
    assert_eq!(o.grads.len(), 1);
    let mut ex = Executor::new(&g.g).unwrap();
    let mut feeds = g.feeds.clone();
    feeds.remove("extra");
    let o = ex.run(&feeds, &g.params, Mode::Eval, 1).unwrap();
    assert!((o.loss.unwrap() - 1.0).abs() < 1e-6);
    assert!(o.grads.is_empty());
    assert_close(&out(&o, "prediction").1, &[1.0], 1e-6);
    let e = ex
        .run(&feeds, &g.params, Mode::Train, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("extra"), "{e}");
    // A wrongly shaped variable is named too.
    let mut params = g.params.clone();
    params.insert("w".into(), f32t(&[1, 2], &[0., 0.]));
    let e = ex
        .run(&g.feeds, &params, Mode::Train, 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`w`") && e.contains("f32[1,2]") && e.contains("f32[2,1]"),
        "{e}"
    );
}

#[test]
fn kernel_errors_name_the_node() {
    let mut g = G::new();
    let x = g.input("x", f32t(&[2], &[1., 2.]));
    let ids = g.input("ids", i32t(&[1], &[5]));
    let t = g.input("t", f32t(&[3, 2], &[0.; 6]));
    let e = g.node(Op::Embedding, &[t, ids]);
    g.output("e", e.into());
    g.output("x", x);
    let err = g.try_run(Mode::Train).unwrap_err().to_string();
    assert!(err.starts_with(&format!("{e} (embedding)")), "{err}");
}

#[test]
fn profiling_counts_kernels() {
    let mut g = G::new();
    let x = g.input("x", f32t(&[2], &[1., 2.]));
    let a = g.op(Op::Neg, &[x]);
    let b = g.op(Op::Neg, &[a]);
    g.output("b", b);
    let mut ex = Executor::new(&g.g).unwrap();
    ex.set_profiling(true);
    ex.run(&g.feeds, &g.params, Mode::Train, 1).unwrap();
    let p = ex.profile();
    assert_eq!(p.len(), 1);
    assert_eq!((p[0].0, p[0].2), ("neg", 2));
}

// ---- throughput (run by hand: `cargo test --release -p distc-runtime --test kernels -- --ignored --nocapture`) ----

/// A hand-differentiated W1 (sparse-lm) or W2 (dense-mlp) training graph, as autodiff
/// writes it, fed with random data: prints samples/s and the per-op profile.
fn bench(name: &str, g: &G, batch: usize) {
    // Minor page faults of this process so far (Linux), to see allocator churn.
    let faults = || -> u64 {
        std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                let rest = s.rsplit(')').next()?.to_string();
                rest.split_whitespace().nth(7)?.parse().ok()
            })
            .unwrap_or(0)
    };
    let mut ex = Executor::new(&g.g).unwrap();
    for step in 0..3 {
        ex.run(&g.feeds, &g.params, Mode::Train, step).unwrap();
    }
    ex.set_profiling(true);
    let steps = 20;
    let (start, f0) = (std::time::Instant::now(), faults());
    for step in 0..steps {
        ex.run(&g.feeds, &g.params, Mode::Train, step).unwrap();
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{name}: {:.1} ms/step, {:.0} samples/s, {} page faults/step",
        secs * 1e3 / steps as f64,
        (steps as usize * batch) as f64 / secs,
        (faults() - f0) / steps
    );
    for (op, d, n) in ex.profile() {
        println!(
            "  {op:<28} {:>8.2} ms/step  ({} calls)",
            d.as_secs_f64() * 1e3 / steps as f64,
            n
        );
    }
}

/// A matmul node.
fn mm(g: &mut G, a: ValueId, b: ValueId, ta: bool, tb: bool) -> ValueId {
    g.op(
        Op::MatMul {
            transpose_a: ta,
            transpose_b: tb,
        },
        &[a, b],
    )
}

fn param_noise(g: &mut G, name: &str, dims: &[usize], scale: f32) -> ValueId {
    let n = dims.iter().product();
    let v: Vec<f32> = noise(n, name.len() as u64)
        .iter()
        .map(|x| x * scale)
        .collect();
    g.param(name, f32t(dims, &v))
}

fn grad(g: &mut G, name: &str, v: ValueId) {
    g.node(Op::ParamGrad { param: name.into() }, &[v]);
}

#[test]
#[ignore]
fn throughput_w1_sparse_lm() {
    let (b, v, e, c, hdim, k) = (256, 100_000, 128, 8, 512, 1000);
    let mut g = G::new();
    let idv: Vec<i32> = noise(b * c, 11)
        .iter()
        .map(|x| ((x + 1.0) * 0.5 * (v - 1) as f32) as i32)
        .collect();
    let ids = g.input("ids", i32t(&[b, c], &idv));
    let lv: Vec<i32> = idv.chunks(c).map(|r| r[c - 1] % k as i32).collect();
    let label = g.input("label", i32t(&[b], &lv));
    let emb = param_noise(&mut g, "emb", &[v, e], 0.05);
    let w1 = param_noise(&mut g, "w1", &[c * e, hdim], 0.06);
    let b1 = param_noise(&mut g, "b1", &[hdim], 0.0);
    let w2 = param_noise(&mut g, "w2", &[hdim, k], 0.06);
    let b2 = param_noise(&mut g, "b2", &[k], 0.0);
    let looked = g.op(Op::Embedding, &[emb, ids]);
    let x = g.op(
        Op::Reshape {
            shape: Shape(vec![b, c * e]),
        },
        &[looked],
    );
    let m1 = mm(&mut g, x, w1, false, false);
    let a1 = g.op(Op::Add, &[m1, b1]);
    let h = g.op(Op::Relu, &[a1]);
    let m2 = mm(&mut g, h, w2, false, false);
    let logits = g.op(Op::Add, &[m2, b2]);
    let loss = g.op(Op::SoftmaxCrossEntropy, &[logits, label]);
    g.node(Op::Loss, &[loss]);
    let one = g.op(
        Op::Constant {
            value: 1.0,
            ty: TensorType::f32(vec![]),
        },
        &[],
    );
    let dl = g.op(Op::SoftmaxCrossEntropyGrad, &[one, logits, label]);
    let db2 = g.op(
        Op::SumTo {
            shape: Shape(vec![k]),
        },
        &[dl],
    );
    let dw2 = mm(&mut g, h, dl, true, false);
    let dh = mm(&mut g, dl, w2, false, true);
    let da1 = g.op(Op::ReluGrad, &[dh, a1]);
    let db1 = g.op(
        Op::SumTo {
            shape: Shape(vec![hdim]),
        },
        &[da1],
    );
    let dw1 = mm(&mut g, x, da1, true, false);
    let dx = mm(&mut g, da1, w1, false, true);
    let de = g.op(
        Op::Reshape {
            shape: Shape(vec![b, c, e]),
        },
        &[dx],
    );
    let demb = g.op(
        Op::EmbeddingGrad {
            table: TensorType::f32(vec![v, e]),
        },
        &[de, ids],
    );
    for (n, d) in [
        ("emb", demb),
        ("w1", dw1),
        ("b1", db1),
        ("w2", dw2),
        ("b2", db2),
    ] {
        grad(&mut g, n, d);
    }
    bench("W1 sparse-lm", &g, b);
}

#[test]
#[ignore]
fn throughput_w2_dense_mlp() {
    let (b, d, hdim, k) = (128, 784, 1024, 10);
    let mut g = G::new();
    let x = g.input("x", f32t(&[b, d], &noise(b * d, 21)));
    let lv: Vec<i32> = (0..b as i32).map(|i| i % k as i32).collect();
    let label = g.input("label", i32t(&[b], &lv));
    let w1 = param_noise(&mut g, "w1", &[d, hdim], 0.05);
    let b1 = param_noise(&mut g, "b1", &[hdim], 0.0);
    let w2 = param_noise(&mut g, "w2", &[hdim, hdim], 0.05);
    let b2 = param_noise(&mut g, "b2", &[hdim], 0.0);
    let w3 = param_noise(&mut g, "w3", &[hdim, k], 0.05);
    let b3 = param_noise(&mut g, "b3", &[k], 0.0);
    let m1 = mm(&mut g, x, w1, false, false);
    let a1 = g.op(Op::Add, &[m1, b1]);
    let h1 = g.op(Op::Relu, &[a1]);
    let m2 = mm(&mut g, h1, w2, false, false);
    let a2 = g.op(Op::Add, &[m2, b2]);
    let h2 = g.op(Op::Relu, &[a2]);
    let m3 = mm(&mut g, h2, w3, false, false);
    let logits = g.op(Op::Add, &[m3, b3]);
    let loss = g.op(Op::SoftmaxCrossEntropy, &[logits, label]);
    g.node(Op::Loss, &[loss]);
    let one = g.op(
        Op::Constant {
            value: 1.0,
            ty: TensorType::f32(vec![]),
        },
        &[],
    );
    let dl = g.op(Op::SoftmaxCrossEntropyGrad, &[one, logits, label]);
    let db3 = g.op(
        Op::SumTo {
            shape: Shape(vec![k]),
        },
        &[dl],
    );
    let dw3 = mm(&mut g, h2, dl, true, false);
    let dh2 = mm(&mut g, dl, w3, false, true);
    let da2 = g.op(Op::ReluGrad, &[dh2, a2]);
    let db2 = g.op(
        Op::SumTo {
            shape: Shape(vec![hdim]),
        },
        &[da2],
    );
    let dw2 = mm(&mut g, h1, da2, true, false);
    let dh1 = mm(&mut g, da2, w2, false, true);
    let da1 = g.op(Op::ReluGrad, &[dh1, a1]);
    let db1 = g.op(
        Op::SumTo {
            shape: Shape(vec![hdim]),
        },
        &[da1],
    );
    let dw1 = mm(&mut g, x, da1, true, false);
    for (n, v) in [
        ("w1", dw1),
        ("b1", db1),
        ("w2", dw2),
        ("b2", db2),
        ("w3", dw3),
        ("b3", db3),
    ] {
        grad(&mut g, n, v);
    }
    bench("W2 dense-mlp", &g, b);
}

#[test]
#[ignore]
fn throughput_cnn() {
    // examples/cnn.dsl: two conv + relu + max-pool blocks and a dense layer, batch 64.
    let b = 64;
    let mut g = G::new();
    let image = g.input("image", f32t(&[b, 1, 28, 28], &noise(b * 784, 31)));
    let lv: Vec<i32> = (0..b as i32).map(|i| i % 10).collect();
    let label = g.input("label", i32t(&[b], &lv));
    let k1 = param_noise(&mut g, "k1", &[8, 1, 3, 3], 0.5);
    let c1 = param_noise(&mut g, "c1", &[8, 1, 1], 0.0);
    let k2 = param_noise(&mut g, "k2", &[16, 8, 3, 3], 0.2);
    let c2 = param_noise(&mut g, "c2", &[16, 1, 1], 0.0);
    let w = param_noise(&mut g, "w", &[784, 10], 0.05);
    let bias = param_noise(&mut g, "b", &[10], 0.0);
    let conv = Op::Conv2d {
        stride: 1,
        padding: 1,
    };
    let pool = Op::MaxPool2d {
        kernel: 2,
        stride: 2,
    };
    let y1 = g.op(conv.clone(), &[image, k1]);
    let z1 = g.op(Op::Add, &[y1, c1]);
    let r1 = g.op(Op::Relu, &[z1]);
    let a1 = g.op(pool.clone(), &[r1]);
    let y2 = g.op(conv, &[a1, k2]);
    let z2 = g.op(Op::Add, &[y2, c2]);
    let r2 = g.op(Op::Relu, &[z2]);
    let a2 = g.op(pool, &[r2]);
    let flat = g.op(
        Op::Reshape {
            shape: Shape(vec![b, 784]),
        },
        &[a2],
    );
    let m = mm(&mut g, flat, w, false, false);
    let logits = g.op(Op::Add, &[m, bias]);
    let loss = g.op(Op::SoftmaxCrossEntropy, &[logits, label]);
    g.node(Op::Loss, &[loss]);
    let one = g.op(
        Op::Constant {
            value: 1.0,
            ty: TensorType::f32(vec![]),
        },
        &[],
    );
    let dl = g.op(Op::SoftmaxCrossEntropyGrad, &[one, logits, label]);
    let db = g.op(
        Op::SumTo {
            shape: Shape(vec![10]),
        },
        &[dl],
    );
    let dw = mm(&mut g, flat, dl, true, false);
    let dflat = mm(&mut g, dl, w, false, true);
    let da2 = g.op(
        Op::Reshape {
            shape: Shape(vec![b, 16, 7, 7]),
        },
        &[dflat],
    );
    let pool_grad = Op::MaxPool2dGrad {
        kernel: 2,
        stride: 2,
    };
    let dr2 = g.op(pool_grad.clone(), &[da2, r2]);
    let dz2 = g.op(Op::ReluGrad, &[dr2, z2]);
    let dc2 = g.op(
        Op::SumTo {
            shape: Shape(vec![16, 1, 1]),
        },
        &[dz2],
    );
    let dk2 = g.op(
        Op::Conv2dGradFilter {
            stride: 1,
            padding: 1,
            filter: Shape(vec![16, 8, 3, 3]),
        },
        &[dz2, a1],
    );
    let da1 = g.op(
        Op::Conv2dGradInput {
            stride: 1,
            padding: 1,
            input: Shape(vec![b, 8, 14, 14]),
        },
        &[dz2, k2],
    );
    let dr1 = g.op(pool_grad, &[da1, r1]);
    let dz1 = g.op(Op::ReluGrad, &[dr1, z1]);
    let dc1 = g.op(
        Op::SumTo {
            shape: Shape(vec![8, 1, 1]),
        },
        &[dz1],
    );
    let dk1 = g.op(
        Op::Conv2dGradFilter {
            stride: 1,
            padding: 1,
            filter: Shape(vec![8, 1, 3, 3]),
        },
        &[dz1, image],
    );
    for (n, v) in [
        ("k1", dk1),
        ("c1", dc1),
        ("k2", dk2),
        ("c2", dc2),
        ("w", dw),
        ("b", db),
    ] {
        grad(&mut g, n, v);
    }
    bench("CNN (examples/cnn.dsl)", &g, b);
}

/// `pack_chunks` + a reduce-scatter's cut + `unpack` give each worker its
/// `take_chunk` of every value; `pack` of every worker's chunks in rank order +
/// `unpack_chunks` gives the values whole again (ZeRO's bucketed collectives).
#[test]
fn chunked_buckets_cut_and_join_as_take_chunk_does() {
    let workers = 3;
    let a = Value::Tensor(f32t(&[5], &noise(5, 1)));
    let b = Value::Tensor(f32t(&[2, 4], &noise(8, 2)));
    let ctx = |rank| KernelCtx {
        step: 0,
        training: true,
        rank,
        model_rank: 0,
    };
    let packed = eval_op(&Op::PackChunks { workers }, &[&a, &b], &ctx(0)).unwrap();
    let Some(Value::Tensor(Tensor::F32(flat))) = packed.first() else {
        panic!("pack_chunks made {packed:?}")
    };
    // ceil(5/3) + ceil(8/3) = 2 + 3 elements per worker.
    assert_eq!(flat.len(), 3 * 5);
    let flat: Vec<f32> = flat.iter().copied().collect();
    let mut mine = Vec::new();
    for r in 0..workers {
        let part = Value::Tensor(f32t(&[5], &flat[r * 5..(r + 1) * 5]));
        let chunks = eval_op(
            &Op::Unpack {
                shapes: vec![Shape(vec![2]), Shape(vec![3])],
            },
            &[&part],
            &ctx(r),
        )
        .unwrap();
        for (chunk, whole) in chunks.iter().zip([&a, &b]) {
            let want = eval_op(&Op::TakeChunk { workers }, &[whole], &ctx(r)).unwrap();
            assert_eq!(chunk, &want[0], "worker {r}");
        }
        mine.push(
            eval_op(&Op::Pack, &[&chunks[0], &chunks[1]], &ctx(r))
                .unwrap()
                .remove(0),
        );
    }
    let gathered: Vec<f32> = mine
        .iter()
        .flat_map(|v| {
            v.tensor()
                .and_then(Tensor::as_f32)
                .unwrap()
                .iter()
                .copied()
                .collect::<Vec<_>>()
        })
        .collect();
    let whole = eval_op(
        &Op::UnpackChunks {
            workers,
            shapes: vec![Shape(vec![5]), Shape(vec![2, 4])],
        },
        &[&Value::Tensor(f32t(&[15], &gathered))],
        &ctx(0),
    )
    .unwrap();
    assert_eq!(whole, vec![a, b]);
    // A buffer of the wrong length is refused, not read past.
    let short = Value::Tensor(f32t(&[14], &gathered[..14]));
    let op = Op::UnpackChunks {
        workers,
        shapes: vec![Shape(vec![5]), Shape(vec![2, 4])],
    };
    assert!(eval_op(&op, &[&short], &ctx(0)).is_err());
}

/// Issue 67, item 8: attention against a loop written here, not the kernel's own mask
/// (which its forward and its gradient share, so a gradient check agrees with itself).
/// Causal is PyTorch's `is_causal`: query `i` attends keys `j <= i`, so row 0 is exactly
/// `v[0]`; with more keys than queries the mask still starts at key 0.
#[test]
fn attention_matches_a_naive_loop_causal_and_with_more_keys_than_queries() {
    let (d, dv, scale) = (3, 2, 0.6);
    for (tq, tk, causal) in [(4, 4, true), (4, 4, false), (3, 5, true), (3, 5, false)] {
        let (q, k, v) = (noise(tq * d, 11), noise(tk * d, 12), noise(tk * dv, 13));
        let op = Op::Attention { causal, scale };
        let inputs = vec![
            f32t(&[1, 1, tq, d], &q),
            f32t(&[1, 1, tk, d], &k),
            f32t(&[1, 1, tk, dv], &v),
        ];
        let (shape, got) = run_op(op, inputs);
        assert_eq!(shape, [1, 1, tq, dv]);
        let mut want = Vec::new();
        for i in 0..tq {
            let keys: Vec<usize> = (0..tk).filter(|&j| !causal || j <= i).collect();
            let scores: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    scale
                        * (0..d)
                            .map(|c| f64::from(q[i * d + c] * k[j * d + c]))
                            .sum::<f64>()
                })
                .collect();
            let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
            let total: f64 = e.iter().sum();
            for c in 0..dv {
                let o: f64 = keys
                    .iter()
                    .zip(&e)
                    .map(|(&j, w)| w / total * f64::from(v[j * dv + c]))
                    .sum();
                want.push(o);
            }
        }
        assert_close(&got, &want, 1e-5);
        if causal {
            let v0: Vec<f64> = v[..dv].iter().map(|&x| f64::from(x)).collect();
            assert_eq!(got[..dv], v0[..], "causal row 0 attends key 0 alone");
        }
    }
}
