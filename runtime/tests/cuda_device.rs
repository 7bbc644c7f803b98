//! The CUDA backend: with no GPU (or a missing library) `CudaBackend::new` returns an
//! error naming what is missing, never a panic; where a GPU exists, small graphs run
//! on it and on the CPU backend from the same random inputs and agree within 1e-4
//! relative. Without a GPU the GPU tests print why they skip and pass.

use distc_ir::{DType, Graph, Op, Shape, TensorType, ValueId};
use distc_runtime::core::backend::{Device, Transfer};
use distc_runtime::core::exec::Executor;
use distc_runtime::core::schedule::Mode;
use distc_runtime::cuda::{CudaBackend, CudaError, CudaLib, CudaOptions};
use distc_runtime::Tensor;
use ndarray::{ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Relative tolerance of a kernel against the CPU's (fp32, different summation orders).
const RTOL: f64 = 1e-4;

fn f32_type(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, Shape(dims.to_vec()))
}

fn random(dims: &[usize], rng: &mut rand_pcg::Pcg64) -> Tensor {
    let n = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(dims), v).expect("shape"))
}

/// A forward graph touching matmuls (all four transpose cases), pointwise maps, a
/// softmax and a reshape (an alias), with every intermediate an output.
fn forward_graph() -> (Graph, HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let mut rng = rand_pcg::Pcg64::seed_from_u64(7);
    let mut g = Graph::new("cuda_backend_forward");
    let mut feeds = HashMap::new();
    let mut params = HashMap::new();
    let mut input = |g: &mut Graph,
                     name: &str,
                     dims: &[usize],
                     feeds: &mut HashMap<String, Tensor>|
     -> ValueId {
        feeds.insert(name.to_string(), random(dims, &mut rng));
        g.add(
            Op::Input {
                name: name.into(),
                ty: f32_type(dims),
            },
            vec![],
        )
        .expect("input")
        .into()
    };
    let x = input(&mut g, "x", &[8, 16], &mut feeds);
    let xt = input(&mut g, "xt", &[16, 8], &mut feeds);
    let w = input(&mut g, "w_in", &[16, 32], &mut feeds);
    let wt = input(&mut g, "wt_in", &[32, 16], &mut feeds);
    let p: ValueId = g
        .add(
            Op::Param {
                name: "p".into(),
                ty: f32_type(&[8, 32]),
                init: distc_ir::Init::Zeros,
                frozen: false,
            },
            vec![],
        )
        .expect("param")
        .into();
    params.insert("p".to_string(), random(&[8, 32], &mut rng));
    let op = |g: &mut Graph, o: Op, ins: &[ValueId]| -> ValueId {
        g.add(o, ins.to_vec()).expect("op").into()
    };
    let mm = |a, b| Op::MatMul {
        transpose_a: a,
        transpose_b: b,
    };
    let y00 = op(&mut g, mm(false, false), &[x, w]);
    let y10 = op(&mut g, mm(true, false), &[xt, w]);
    let y01 = op(&mut g, mm(false, true), &[x, wt]);
    let y11 = op(&mut g, mm(true, true), &[xt, wt]);
    let s = op(&mut g, Op::Add, &[y00, p]);
    let r = op(&mut g, Op::Relu, &[s]);
    let t = op(&mut g, Op::Tanh, &[y10]);
    let sg = op(&mut g, Op::Sigmoid, &[y01]);
    let m = op(&mut g, Op::Mul, &[t, sg]);
    let sm = op(&mut g, Op::Softmax { axis: 1 }, &[y11]);
    let rs = op(
        &mut g,
        Op::Reshape {
            shape: Shape(vec![16, 16]),
        },
        &[sm],
    );
    for (name, v) in [
        ("y00", y00),
        ("y10", y10),
        ("y01", y01),
        ("y11", y11),
        ("relu", r),
        ("mul", m),
        ("softmax", sm),
        ("reshaped", rs),
    ] {
        g.add(Op::Output { name: name.into() }, vec![v])
            .expect("output");
    }
    (g, feeds, params)
}

/// Builds the backend, or says why a GPU test skips (`None`).
fn gpu_or_skip(test: &str, g: &Graph) -> Option<CudaBackend> {
    match CudaBackend::new(0, g, CudaOptions::default()) {
        Ok(b) => Some(b),
        Err(e) => {
            eprintln!("SKIP {test}: {e}");
            None
        }
    }
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, rtol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let scale = w.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-6);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= rtol * b.abs().max(scale),
            "{what}[{i}]: {a} on the GPU, {b} on the CPU"
        );
    }
}

#[test]
fn new_without_a_gpu_is_an_error_naming_what_is_missing() {
    let (g, _, _) = forward_graph();
    match CudaBackend::new(0, &g, CudaOptions::default()) {
        Ok(b) => {
            eprintln!("a GPU is here: {}", b.name());
        }
        Err(e) => {
            let text = e.to_string();
            eprintln!("{text}");
            match &e {
                CudaError::MissingLibrary { lib, .. } => {
                    assert!(
                        matches!(lib, CudaLib::Driver | CudaLib::Cublas | CudaLib::Nvrtc),
                        "{e:?}"
                    );
                    assert!(
                        text.contains("DISTC_CUDA_LIB_DIR") && text.contains(lib.file_name()),
                        "{text}"
                    );
                }
                CudaError::NoDevice(_) => assert!(text.contains("no usable CUDA GPU"), "{text}"),
                other => panic!("unexpected error with no GPU: {other:?}"),
            }
        }
    }
    // A GPU that does not exist is an error too, never a panic.
    if let Err(e) = CudaBackend::new(1 << 20, &g, CudaOptions::default()) {
        eprintln!("ordinal 2^20: {e}");
    } else {
        panic!("GPU 2^20 exists?");
    }
}

#[test]
fn f64_graphs_are_refused_before_any_gpu_work() {
    let mut g = Graph::new("f64");
    let x: ValueId = g
        .add(
            Op::Input {
                name: "x".into(),
                ty: TensorType::new(DType::F64, Shape(vec![2, 2])),
            },
            vec![],
        )
        .expect("input")
        .into();
    let r: ValueId = g.add(Op::Relu, vec![x]).expect("relu").into();
    g.add(Op::Output { name: "r".into() }, vec![r])
        .expect("output");
    let e = CudaBackend::new(0, &g, CudaOptions::default()).expect_err("f64 is refused");
    let text = e.to_string();
    assert!(text.contains("f64") && text.contains("CPU"), "{text}");
}

#[test]
fn forward_kernels_match_the_cpu() {
    let (g, feeds, params) = forward_graph();
    let Some(gpu) = gpu_or_skip("forward_kernels_match_the_cpu", &g) else {
        return;
    };
    let mut cpu = Executor::new(&g).expect("cpu executor");
    let want = cpu.run(&feeds, &params, Mode::Train, 1).expect("cpu run");
    let mut ex = Executor::with_backend(&g, gpu).expect("cuda executor");
    let up = |ex: &mut Executor<CudaBackend>, m: &HashMap<String, Tensor>| {
        m.iter()
            .map(|(k, t)| {
                (
                    k.clone(),
                    ex.backend().upload(k, t.clone()).expect("upload"),
                )
            })
            .collect::<HashMap<_, _>>()
    };
    let dfeeds = up(&mut ex, &feeds);
    let dparams = up(&mut ex, &params);
    // Twice: the second run reuses every buffer of the first.
    for round in 0..2 {
        let got = ex.run(&dfeeds, &dparams, Mode::Train, 1).expect("cuda run");
        assert_eq!(got.outputs.len(), want.outputs.len());
        for ((name, a), (wname, b)) in got.outputs.iter().zip(&want.outputs) {
            assert_eq!(name, wname);
            assert_close(&format!("round {round}: {name}"), a, b, RTOL);
        }
    }
}
