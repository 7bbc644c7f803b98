//! One kernel suite for both backends: every op that is not a source, a sink or
//! communication runs on the CPU backend ([`Cpu`]) and on the CUDA backend
//! ([`CudaBackend`]) from the same seeded random inputs, and every result must agree.
//!
//! Each case is a small graph of one op under test (after the ops that make its
//! inputs where it needs IndexedSlices: `embedding_grad` or `sparsify`), an `output`
//! sink on each of its results (the sink densifies IndexedSlices on the host) and
//! seeded random inputs: ids and labels in range, positive inputs where `log` or a
//! denominator needs them. The tolerance, per element, with `cpu` the CPU's value:
//!
//! ```text
//! |gpu - cpu| <= 1e-4 * max(1, |cpu|)     f32 outputs
//! |gpu - cpu| <= 2^-7 * max(1, |cpu|)     bf16 outputs (one unit in the last place)
//! |gpu - cpu| <= 2^-10 * max(1, |cpu|)    f16 outputs (one unit in the last place)
//!  gpu == cpu                             integer outputs
//! ```
//!
//! The 16-bit group (`half`) casts f32 inputs to bf16 or f16 as the precision pass
//! does, then runs the op under test on the 16-bit values: `cast` both ways, `matmul`
//! (a GemmEx on the device) and ops the device runs on widened f32 copies. Both
//! backends compute in f32 and round once, so only a sum taken in another order may
//! round to the neighbouring 16-bit value.
//!
//! The optimizer updates are compared the same way: two steps of SGD, SGD with
//! momentum, Adam, AdamW, LARS and LAMB on a dense gradient and on a sparse
//! (IndexedSlices, repeated rows) one, the CPU's `Backend::update` against the CUDA
//! backend's.
//!
//! Every case is `build graph + inputs` -> `run on the CPU` (with checks of its own:
//! result types as the graph says, finite values, and per op what is known, e.g. the
//! dropout mask of the gradient is the forward's) -> `if let Some(gpu) = gpu(..)`
//! `{ run on CUDA; compare }`. Without a GPU or the CUDA libraries, `gpu` prints
//! `skipping: <case>: <reason>` and the case passes after its CPU part; an error that
//! is not about a missing GPU or library (the backend refusing a graph, NVRTC failing)
//! fails the case.
//!
//! What `CudaBackend::new` does before it needs a GPU also runs here for every case:
//! the device plan is generated, and where NVRTC is found (`DISTC_CUDA_LIB_DIR`, or
//! `.nvrtc/` from `scripts/install-nvrtc.sh`) its source and the optimizer kernels
//! compile to an sm_90 CUBIN (`every_case_generates_cuda_that_compiles`).
//!
//! [`covering_group`] is a `match` over every [`Op`] variant with no wildcard arm: a
//! new op does not compile until it names the group of cases that runs it (or why it
//! has none), and `coverage_table_matches_the_cases` checks that every op in every
//! case is in the table and every group really runs the ops the table gives it.
//!
//! `accumulate` runs a micro-batch run, then the last, with other feeds: on the CPU it
//! must give the mean of the two gradients, and CUDA must match the CPU.

use distc_ir::{
    BinaryFn, DType, FusedExpr, FusedStep, Graph, NodeId, Op, Shape, TensorType, UnaryFn, ValueId,
    ValueType,
};
use distc_runtime::core::backend::Backend;
use distc_runtime::core::exec::Executor;
use distc_runtime::core::schedule::Mode;
use distc_runtime::cpu::Cpu;
use distc_runtime::cuda::codegen::{generate, optimizer_kernels, sparse_bound};
use distc_runtime::cuda::{nvrtc, CudaBackend, CudaError, CudaOptions};
use distc_runtime::{OptimizerSpec, Tensor};
use ndarray::{ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use std::collections::{BTreeSet, HashMap};

/// Relative tolerance of a CUDA kernel against the CPU's, with an absolute floor of
/// the same size for values below 1 (see the module doc).
const TOL: f64 = 1e-4;

// ---------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------

/// One run of a case's graph.
struct Run {
    mode: Mode,
    step: u64,
    /// Feeds of this run (`None`: the case's).
    feeds: Option<HashMap<String, Tensor>>,
}

/// A graph, its inputs and how to run it.
struct Case {
    name: String,
    group: &'static str,
    g: Graph,
    feeds: HashMap<String, Tensor>,
    runs: Vec<Run>,
    rank: usize,
    /// The worker's rank on a mesh's model axis (its part of a split value).
    model_rank: usize,
    rng: Pcg64,
    outputs: usize,
    /// CUDA must give the CPU's bits, not just values within the tolerance (sums
    /// whose order is specified).
    exact: bool,
}

fn f32t(dims: &[usize]) -> TensorType {
    TensorType::new(DType::F32, dims.to_vec())
}

fn tensor(dims: &[usize], v: Vec<f32>) -> Tensor {
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(dims), v).expect("shape"))
}

fn ids_tensor(dims: &[usize], v: Vec<i32>) -> Tensor {
    Tensor::I32(ArrayD::from_shape_vec(IxDyn(dims), v).expect("shape"))
}

/// A seed from a case name (FNV-1a), so each case draws its own inputs.
fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

impl Case {
    fn new(group: &'static str, name: impl Into<String>) -> Case {
        let name = name.into();
        Case {
            g: Graph::new(name.replace(|c: char| !c.is_ascii_alphanumeric(), "_")),
            rng: Pcg64::seed_from_u64(seed_of(&name)),
            name,
            group,
            feeds: HashMap::new(),
            runs: vec![Run {
                mode: Mode::Train,
                step: 1,
                feeds: None,
            }],
            rank: 0,
            model_rank: 0,
            outputs: 0,
            exact: false,
        }
    }

    fn random(&mut self, dims: &[usize], lo: f32, hi: f32) -> Tensor {
        let n = dims.iter().product();
        let v = (0..n).map(|_| self.rng.random_range(lo..hi)).collect();
        tensor(dims, v)
    }

    /// A fed input holding `t`.
    fn feed(&mut self, t: Tensor) -> ValueId {
        let name = format!("in{}", self.feeds.len());
        let ty = t.tensor_type();
        self.feeds.insert(name.clone(), t);
        self.g
            .add(Op::Input { name, ty }, vec![])
            .expect("input")
            .into()
    }

    /// An f32 input uniform in `[lo, hi)`.
    fn input(&mut self, dims: &[usize], lo: f32, hi: f32) -> ValueId {
        let t = self.random(dims, lo, hi);
        self.feed(t)
    }

    /// An f32 input uniform in `[-1, 1)`.
    fn x(&mut self, dims: &[usize]) -> ValueId {
        self.input(dims, -1.0, 1.0)
    }

    /// An i32 input of ids uniform in `0..n`.
    fn ids(&mut self, dims: &[usize], n: usize) -> ValueId {
        let k = dims.iter().product();
        let v = (0..k).map(|_| self.rng.random_range(0..n as i32)).collect();
        self.feed(ids_tensor(dims, v))
    }

    fn node(&mut self, op: Op, inputs: Vec<ValueId>) -> NodeId {
        let what = format!("{}: {op}", self.name);
        self.g
            .add(op, inputs)
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    }

    fn op(&mut self, op: Op, inputs: Vec<ValueId>) -> ValueId {
        self.node(op, inputs).into()
    }

    /// An `output` sink on `v`.
    fn output(&mut self, v: ValueId) {
        let name = format!(
            "{}:{}#{}",
            self.outputs,
            self.g.op(v.node).mnemonic(),
            v.port
        );
        self.outputs += 1;
        self.g.add(Op::Output { name }, vec![v]).expect("output");
    }

    /// The op under test: added, with an `output` on each of its results.
    fn test(&mut self, op: Op, inputs: Vec<ValueId>) -> Vec<ValueId> {
        let id = self.node(op, inputs);
        let ports = self.g.node(id).outputs.len();
        let outs: Vec<ValueId> = (0..ports).map(|p| id.out(p as u16)).collect();
        for &v in &outs {
            self.output(v);
        }
        outs
    }
}

// ---------------------------------------------------------------------------------
// The coverage table
// ---------------------------------------------------------------------------------

/// Which group of cases runs an op, or why none does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cover {
    /// The group (one `#[test]` below) whose cases run it.
    Group(&'static str),
    /// Not a kernel of a one-device plain graph: a source, a sink or communication.
    NotAKernel(&'static str),
}

/// Every op variant and what covers it. No wildcard arm: a new op does not compile
/// until it is listed here.
fn covering_group(op: &Op) -> Cover {
    use Cover::{Group, NotAKernel};
    const SOURCE: &str = "a source: the executor hands the backend's tensor over";
    const SINK: &str = "a sink: the executor reads its input";
    const COMM: &str = "communication: the executor moves the value through the host";
    match op {
        Op::Input { .. } | Op::Param { .. } => NotAKernel(SOURCE),
        // A source too, but the backend fills it (`Backend::filled`): compared.
        Op::Constant { .. } => Group("constant"),
        Op::Pull { .. } | Op::Shard { .. } => NotAKernel(SOURCE),
        Op::Loss
        | Op::ParamGrad { .. }
        | Op::Output { .. }
        | Op::Assign { .. }
        | Op::Serve { .. } => NotAKernel(SINK),
        // One device's identity, and a copy of the side the mode reads.
        Op::ReplicaReduce { .. } | Op::TrainOrEval => Group("layout"),
        Op::AllReduce { .. }
        | Op::AllGather { .. }
        | Op::Broadcast { .. }
        | Op::ReduceScatter { .. }
        | Op::AllGatherDense { .. }
        | Op::SparsePull { .. }
        | Op::Push { .. }
        | Op::SparsePush { .. }
        | Op::Send { .. }
        | Op::Recv { .. } => NotAKernel(COMM),
        Op::ModelAllReduce { .. } | Op::ModelGather { .. } | Op::ModelReduceScatter { .. } => {
            NotAKernel(COMM)
        }
        Op::ModelEnter { .. }
        | Op::ModelSplit { .. }
        | Op::ModelEmbedding { .. }
        | Op::ModelEmbeddingGrad { .. } => Group("model"),
        Op::Cast { .. } => Group("half"),
        Op::MatMul { .. } => Group("matmul"),
        Op::Add | Op::Sub | Op::Mul | Op::Div => Group("elementwise"),
        Op::Neg | Op::Relu | Op::Sigmoid | Op::Tanh | Op::Exp | Op::Log => Group("elementwise"),
        Op::ReluGrad | Op::SigmoidGrad | Op::TanhGrad => Group("elementwise"),
        Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::SoftmaxGrad { .. }
        | Op::LogSoftmaxGrad { .. } => Group("softmax"),
        Op::Sum { .. } | Op::Mean { .. } | Op::SumTo { .. } | Op::BroadcastTo { .. } => {
            Group("reductions")
        }
        Op::Reshape { .. } | Op::Transpose { .. } | Op::Concat { .. } | Op::Slice { .. } => {
            Group("layout")
        }
        Op::SoftmaxCrossEntropy | Op::SoftmaxCrossEntropyGrad | Op::Mse | Op::MseGrad => {
            Group("losses")
        }
        Op::LayerNorm { .. } | Op::LayerNormGrad { .. } => Group("layer_norm"),
        Op::Attention { .. } | Op::AttentionGrad { .. } => Group("attention"),
        Op::Dropout { .. } | Op::DropoutGrad { .. } => Group("dropout"),
        Op::Conv2d { .. }
        | Op::Conv2dGradInput { .. }
        | Op::Conv2dGradFilter { .. }
        | Op::MaxPool2d { .. }
        | Op::MaxPool2dGrad { .. } => Group("conv_pool"),
        Op::Embedding
        | Op::EmbeddingGrad { .. }
        | Op::ConcatSlices
        | Op::Densify
        | Op::RowMask
        | Op::Sparsify
        | Op::UniqueRows => Group("sparse"),
        Op::Pack
        | Op::Unpack { .. }
        | Op::PackChunks { .. }
        | Op::UnpackChunks { .. }
        | Op::TakeChunk { .. } => Group("packing"),
        Op::Fused { .. } => Group("fused"),
        Op::Accumulate { .. } => Group("accumulate"),
    }
}

/// The step of [`fused_expr`] that applies each unary function (no wildcard: a new
/// function does not compile until the fused case uses it).
fn unary_step(f: UnaryFn) -> usize {
    match f {
        UnaryFn::Neg => 15,
        UnaryFn::Relu => 5,
        UnaryFn::Sigmoid => 6,
        UnaryFn::Tanh => 7,
        UnaryFn::Exp => 10,
        UnaryFn::Log => 9,
        UnaryFn::Step => 12,
        UnaryFn::Sqrt => 18,
        UnaryFn::Rsqrt => 19,
        UnaryFn::Gelu => 20,
        UnaryFn::GeluTanh => 21,
        UnaryFn::Silu => 22,
        UnaryFn::GeluDerivative => 23,
        UnaryFn::GeluTanhDerivative => 24,
        UnaryFn::SiluDerivative => 25,
    }
}

/// The step of [`fused_expr`] that applies each binary function.
fn binary_step(f: BinaryFn) -> usize {
    match f {
        BinaryFn::Add => 4,
        BinaryFn::Sub => 13,
        BinaryFn::Mul => 8,
        BinaryFn::Div => 11,
        BinaryFn::Pow => 26,
        BinaryFn::Less => 27,
        BinaryFn::LessEqual => 28,
        BinaryFn::Greater => 29,
        BinaryFn::GreaterEqual => 30,
        BinaryFn::Equal => 31,
        BinaryFn::NotEqual => 32,
        BinaryFn::Keep => 33,
    }
}

/// What builds a group's cases.
type CaseBuilder = fn() -> Vec<Case>;

/// The groups, each with its cases.
const GROUPS: &[(&str, CaseBuilder)] = &[
    ("constant", constant_cases),
    ("elementwise", elementwise_cases),
    ("matmul", matmul_cases),
    ("softmax", softmax_cases),
    ("reductions", reduction_cases),
    ("layout", layout_cases),
    ("losses", loss_cases),
    ("layer_norm", layer_norm_cases),
    ("attention", attention_cases),
    ("dropout", dropout_cases),
    ("conv_pool", conv_pool_cases),
    ("sparse", sparse_cases),
    ("packing", packing_cases),
    ("fused", fused_cases),
    ("accumulate", accumulate_cases),
    ("half", half_cases),
    ("model", model_cases),
];

fn cases_of(group: &str) -> Vec<Case> {
    let (_, build) = GROUPS
        .iter()
        .find(|(g, _)| *g == group)
        .unwrap_or_else(|| panic!("no group `{group}`"));
    build()
}

// ---------------------------------------------------------------------------------
// Running and comparing
// ---------------------------------------------------------------------------------

/// Outputs by name, per run.
type Results = Vec<HashMap<String, Tensor>>;

fn upload<B: Backend>(b: &mut B, m: &HashMap<String, Tensor>) -> HashMap<String, B::Tensor> {
    m.iter()
        .map(|(k, t)| {
            let d = b
                .upload(k, t.clone())
                .unwrap_or_else(|e| panic!("upload `{k}` to {}: {e}", b.name()));
            (k.clone(), d)
        })
        .collect()
}

/// Runs every run of `case` on `backend`: its outputs, as host tensors.
fn execute<B: Backend>(case: &Case, backend: B) -> Results {
    let on = backend.name();
    let mut ex = Executor::with_backend(&case.g, backend)
        .unwrap_or_else(|e| panic!("{} on {on}: {e}", case.name));
    ex.set_rank(case.rank);
    ex.set_model_rank(case.model_rank);
    let params = HashMap::new();
    let mut out = Vec::new();
    for run in &case.runs {
        let feeds = upload(ex.backend(), run.feeds.as_ref().unwrap_or(&case.feeds));
        let o = ex
            .run(&feeds, &params, run.mode, run.step)
            .unwrap_or_else(|e| {
                panic!(
                    "{} on {on} ({:?}, step {}): {e}",
                    case.name, run.mode, run.step
                )
            });
        out.push(o.outputs.into_iter().collect());
    }
    out
}

/// The CUDA backend for `g`, or `None` (printing why) where there is no GPU or no
/// CUDA library. Any other error fails the case.
fn gpu(case: &str, g: &Graph) -> Option<CudaBackend> {
    let opts = CudaOptions {
        tf32: false,
        graphs: false,
        ..Default::default()
    };
    match CudaBackend::new(0, g, opts) {
        Ok(b) => Some(b),
        Err(
            e @ (CudaError::MissingLibrary { .. }
            | CudaError::LoadFailed { .. }
            | CudaError::NoDevice(_)),
        ) => {
            println!("skipping: {case}: {e}");
            None
        }
        Err(e) => panic!("{case}: the CUDA backend refused the graph: {e}"),
    }
}

/// `gpu` against `cpu` within the module's tolerance (integers exactly).
fn assert_close(what: &str, gpu: &Tensor, cpu: &Tensor) {
    assert_eq!(gpu.dtype(), cpu.dtype(), "{what}: dtypes differ");
    assert_eq!(gpu.shape(), cpu.shape(), "{what}: shapes differ");
    if let (Tensor::I32(g), Tensor::I32(c)) = (gpu, cpu) {
        assert_eq!(g, c, "{what}: integer results differ");
        return;
    }
    let tol = match cpu.dtype() {
        DType::BF16 => 2f64.powi(-7),
        DType::F16 => 2f64.powi(-10),
        _ => TOL,
    };
    let (g, c) = (gpu.to_f64_vec(), cpu.to_f64_vec());
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}[{i}]: {a} on CUDA, {b} on the CPU (tolerance {tol} * max(1, |cpu|))"
        );
    }
}

fn assert_same_bits(what: &str, gpu: &Tensor, cpu: &Tensor) {
    assert_eq!(gpu.shape(), cpu.shape(), "{what}: shapes differ");
    let (g, c) = (gpu.to_f64_vec(), cpu.to_f64_vec());
    if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != c[i].to_bits()) {
        panic!(
            "{what}[{i}]: {} on CUDA, {} on the CPU (the same bits expected)",
            g[i], c[i]
        );
    }
}

/// What every CPU result must satisfy: the graph's type, finite values.
fn check_cpu(case: &Case, results: &Results) {
    let want: HashMap<String, ValueType> = case
        .g
        .outputs()
        .into_iter()
        .map(|(n, v)| (n, case.g.value_type(v).clone()))
        .collect();
    for (run, outs) in case.runs.iter().zip(results) {
        if run.mode == Mode::Micro {
            continue;
        }
        assert_eq!(
            outs.len(),
            want.len(),
            "{}: {} outputs, the graph has {}",
            case.name,
            outs.len(),
            want.len()
        );
        for (name, t) in outs {
            let ty = want[name].dense_type();
            assert_eq!(
                t.shape(),
                ty.dims(),
                "{}: `{name}` has the wrong shape",
                case.name
            );
            assert_eq!(
                t.dtype(),
                ty.dtype,
                "{}: `{name}` has the wrong dtype",
                case.name
            );
            assert!(
                t.to_f64_vec().iter().all(|x| x.is_finite()),
                "{}: `{name}` is not finite on the CPU",
                case.name
            );
        }
    }
}

/// Runs a case on the CPU, checks it, then compares with CUDA where there is a GPU.
/// Returns the CPU's results for the case's own checks.
fn check(case: &Case) -> Results {
    let want = execute(case, Cpu);
    check_cpu(case, &want);
    if let Some(gpu) = gpu(&case.name, &case.g) {
        let got = execute(case, gpu);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.len(),
                w.len(),
                "{}: run {r}: output counts differ",
                case.name
            );
            for (name, c) in w {
                let d = g
                    .get(name)
                    .unwrap_or_else(|| panic!("{}: run {r}: no `{name}` on CUDA", case.name));
                let what = format!("{}: run {r}: `{name}`", case.name);
                if case.exact {
                    assert_same_bits(&what, d, c);
                } else {
                    assert_close(&what, d, c);
                }
            }
        }
    }
    want
}

/// Runs every case of a group.
fn run_group(group: &str) {
    let cases = cases_of(group);
    assert!(!cases.is_empty(), "group `{group}` has no cases");
    for case in &cases {
        check(case);
    }
}

/// The output of run `run` whose name starts with `k:` (the `k`-th sink).
fn nth(results: &Results, run: usize, k: usize) -> &Tensor {
    let prefix = format!("{k}:");
    results[run]
        .iter()
        .find(|(n, _)| n.starts_with(&prefix))
        .map(|(_, t)| t)
        .unwrap_or_else(|| panic!("no output {k}"))
}

// ---------------------------------------------------------------------------------
// The groups
// ---------------------------------------------------------------------------------

fn constant_cases() -> Vec<Case> {
    let mut c = Case::new("constant", "constant");
    let k = c.op(
        Op::Constant {
            value: 0.75,
            ty: f32t(&[3, 4]),
        },
        vec![],
    );
    c.output(k);
    let x = c.x(&[3, 4]);
    c.test(Op::Add, vec![x, k]);
    vec![c]
}

#[test]
fn constant() {
    run_group("constant");
}

fn elementwise_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    // Binary ops, same shapes and every kind of broadcast (rank 0, trailing, both
    // sides, a missing leading axis).
    let shapes: &[(&[usize], &[usize])] = &[
        (&[3, 4], &[3, 4]),
        (&[3, 4], &[4]),
        (&[3, 1], &[1, 4]),
        (&[], &[3, 4]),
        (&[2, 3, 4], &[3, 1]),
    ];
    for (name, op) in [
        ("add", Op::Add),
        ("sub", Op::Sub),
        ("mul", Op::Mul),
        ("div", Op::Div),
    ] {
        for (a, b) in shapes {
            let mut c = Case::new("elementwise", format!("{name} {a:?} {b:?}"));
            let x = c.x(a);
            // Denominators away from zero.
            let y = if name == "div" {
                c.input(b, 0.5, 1.5)
            } else {
                c.x(b)
            };
            c.test(op.clone(), vec![x, y]);
            cases.push(c);
        }
    }
    for (name, op, lo, hi) in [
        ("neg", Op::Neg, -1.0, 1.0),
        ("relu", Op::Relu, -1.0, 1.0),
        ("sigmoid", Op::Sigmoid, -3.0, 3.0),
        ("tanh", Op::Tanh, -3.0, 3.0),
        ("exp", Op::Exp, -2.0, 2.0),
        ("log", Op::Log, 0.1, 3.0),
    ] {
        let mut c = Case::new("elementwise", name);
        let x = c.input(&[5, 7], lo, hi);
        c.test(op, vec![x]);
        cases.push(c);
    }
    // Gradients: (dy, x) for relu, (dy, y) with y in the forward's range otherwise.
    for (name, op, lo, hi) in [
        ("relu_grad", Op::ReluGrad, -1.0, 1.0),
        ("sigmoid_grad", Op::SigmoidGrad, 0.0, 1.0),
        ("tanh_grad", Op::TanhGrad, -1.0, 1.0),
    ] {
        let mut c = Case::new("elementwise", name);
        let dy = c.x(&[5, 7]);
        let y = c.input(&[5, 7], lo, hi);
        c.test(op, vec![dy, y]);
        cases.push(c);
    }
    cases
}

#[test]
fn elementwise() {
    run_group("elementwise");
}

fn matmul_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (m, k, n) in [(5, 7, 3), (17, 33, 9)] {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let mut c = Case::new("matmul", format!("matmul {m}x{k}x{n} ta={ta} tb={tb}"));
            let a = c.x(&if ta { [k, m] } else { [m, k] });
            let b = c.x(&if tb { [n, k] } else { [k, n] });
            c.test(
                Op::MatMul {
                    transpose_a: ta,
                    transpose_b: tb,
                },
                vec![a, b],
            );
            cases.push(c);
        }
    }
    // Batched: one strided product, each side a full batch or one matrix for all.
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        for (ba, bb) in [(&[2, 3][..], &[2, 3][..]), (&[2, 3], &[]), (&[], &[4])] {
            let (m, k, n) = (5, 7, 3);
            let dims = |batch: &[usize], r: usize, c: usize, t: bool| {
                let mut d = batch.to_vec();
                d.extend(if t { [c, r] } else { [r, c] });
                d
            };
            let mut c = Case::new(
                "matmul",
                format!("batched matmul {ba:?} {bb:?} ta={ta} tb={tb}"),
            );
            let a = c.x(&dims(ba, m, k, ta));
            let b = c.x(&dims(bb, k, n, tb));
            c.test(
                Op::MatMul {
                    transpose_a: ta,
                    transpose_b: tb,
                },
                vec![a, b],
            );
            cases.push(c);
        }
    }
    cases
}

#[test]
fn matmul() {
    run_group("matmul");
}

fn half_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for to in [DType::BF16, DType::F16] {
        let cast = Op::Cast { to };
        let mut c = Case::new("half", format!("cast f32 to {to} and back"));
        let x = c.input(&[37, 5], -300.0, 300.0);
        let h = c.test(cast.clone(), vec![x]);
        c.test(Op::Cast { to: DType::F32 }, vec![h[0]]);
        cases.push(c);
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let (m, k, n) = (17, 33, 9);
            let mut c = Case::new("half", format!("matmul {to} {m}x{k}x{n} ta={ta} tb={tb}"));
            let a = c.x(&if ta { [k, m] } else { [m, k] });
            let b = c.x(&if tb { [n, k] } else { [k, n] });
            let a = c.op(cast.clone(), vec![a]);
            let b = c.op(cast.clone(), vec![b]);
            c.test(
                Op::MatMul {
                    transpose_a: ta,
                    transpose_b: tb,
                },
                vec![a, b],
            );
            cases.push(c);
        }
        // Ops the device runs on widened copies: broadcasting, a reduction, a layout
        // change, an alias and a convolution (whose f32 GEMMs read the widened input).
        let mut c = Case::new("half", format!("add relu sum transpose reshape {to}"));
        let x = c.x(&[6, 8]);
        let b = c.x(&[8]);
        let (x, b) = (c.op(cast.clone(), vec![x]), c.op(cast.clone(), vec![b]));
        let y = c.test(Op::Add, vec![x, b]);
        let r = c.test(Op::Relu, vec![y[0]]);
        c.test(
            Op::Sum {
                axes: vec![0],
                keep_dims: false,
            },
            vec![r[0]],
        );
        c.test(Op::Transpose { perm: vec![1, 0] }, vec![r[0]]);
        c.test(
            Op::Reshape {
                shape: Shape(vec![4, 12]),
            },
            vec![r[0]],
        );
        cases.push(c);
        // Ops with kernels of their own for 16-bit operands (widened as read, narrowed
        // as written): every activation and its gradient, broadcasting binaries, a
        // fused chain, sum_to, mean and broadcast_to.
        let mut c = Case::new("half", format!("element-wise and reductions in {to}"));
        let x = c.input(&[5, 7], -2.0, 2.0);
        let d = c.x(&[5, 7]);
        let b = c.input(&[7], 0.5, 2.0);
        let (x, d, b) = (
            c.op(cast.clone(), vec![x]),
            c.op(cast.clone(), vec![d]),
            c.op(cast.clone(), vec![b]),
        );
        for op in [Op::Neg, Op::Relu, Op::Sigmoid, Op::Tanh, Op::Exp] {
            let y = c.test(op.clone(), vec![x]);
            let grad = match op {
                Op::Relu => Some(Op::ReluGrad),
                Op::Sigmoid => Some(Op::SigmoidGrad),
                Op::Tanh => Some(Op::TanhGrad),
                _ => None,
            };
            if let Some(g) = grad {
                c.test(g, vec![d, y[0]]);
            }
        }
        for op in [Op::Add, Op::Sub, Op::Mul, Op::Div] {
            c.test(op, vec![x, b]);
        }
        c.test(Op::Mul, vec![x, d]);
        let e = c.test(Op::Exp, vec![b]);
        c.test(Op::Log, vec![e[0]]);
        c.test(Op::Fused { expr: fused_expr() }, vec![x, b, b]);
        c.test(
            Op::SumTo {
                shape: Shape(vec![7]),
            },
            vec![d],
        );
        c.test(
            Op::Mean {
                axes: vec![1],
                keep_dims: true,
            },
            vec![d],
        );
        c.test(
            Op::BroadcastTo {
                shape: Shape(vec![5, 7]),
            },
            vec![b],
        );
        cases.push(c);
        let mut c = Case::new("half", format!("conv2d {to}"));
        let x = c.x(&[2, 3, 6, 6]);
        let w = c.x(&[4, 3, 3, 3]);
        let (x, w) = (c.op(cast.clone(), vec![x]), c.op(cast.clone(), vec![w]));
        c.test(
            Op::Conv2d {
                stride: 1,
                padding: 1,
            },
            vec![x, w],
        );
        cases.push(c);
    }
    cases
}

#[test]
fn half() {
    run_group("half");
}

fn softmax_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (dims, axis) in [
        (&[4usize, 6][..], 0usize),
        (&[4, 6][..], 1),
        (&[2, 3, 5][..], 1),
        (&[2, 3, 5][..], 2),
    ] {
        for log in [false, true] {
            let name = if log { "log_softmax" } else { "softmax" };
            let mut c = Case::new("softmax", format!("{name} {dims:?} axis {axis}"));
            let x = c.input(dims, -3.0, 3.0);
            let op = if log {
                Op::LogSoftmax { axis }
            } else {
                Op::Softmax { axis }
            };
            c.test(op, vec![x]);
            cases.push(c);

            // The gradient, at y = the forward's result (computed in the graph).
            let mut c = Case::new("softmax", format!("{name}_grad {dims:?} axis {axis}"));
            let x = c.input(dims, -3.0, 3.0);
            let dy = c.x(dims);
            let (fwd, grad) = if log {
                (Op::LogSoftmax { axis }, Op::LogSoftmaxGrad { axis })
            } else {
                (Op::Softmax { axis }, Op::SoftmaxGrad { axis })
            };
            let y = c.op(fwd, vec![x]);
            c.test(grad, vec![dy, y]);
            cases.push(c);
        }
    }
    cases
}

#[test]
fn softmax() {
    run_group("softmax");
}

fn reduction_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for axes in [
        vec![0],
        vec![1],
        vec![2],
        vec![0, 2],
        vec![1, 2],
        vec![0, 1, 2],
    ] {
        for keep_dims in [false, true] {
            for mean in [false, true] {
                let name = if mean { "mean" } else { "sum" };
                let mut c = Case::new(
                    "reductions",
                    format!("{name} axes {axes:?} keep {keep_dims}"),
                );
                let x = c.x(&[3, 4, 5]);
                let axes = axes.clone();
                let op = if mean {
                    Op::Mean { axes, keep_dims }
                } else {
                    Op::Sum { axes, keep_dims }
                };
                c.test(op, vec![x]);
                cases.push(c);
            }
        }
    }
    let pairs: &[(&[usize], &[usize])] = &[
        (&[3, 4], &[4]),
        (&[3, 4], &[3, 1]),
        (&[3, 4], &[]),
        (&[2, 3, 4], &[1, 3, 1]),
        (&[2, 3, 4], &[4]),
    ];
    for (big, small) in pairs {
        let mut c = Case::new("reductions", format!("sum_to {big:?} -> {small:?}"));
        let x = c.x(big);
        c.test(
            Op::SumTo {
                shape: Shape(small.to_vec()),
            },
            vec![x],
        );
        cases.push(c);
        let mut c = Case::new("reductions", format!("broadcast_to {small:?} -> {big:?}"));
        let x = c.x(small);
        c.test(
            Op::BroadcastTo {
                shape: Shape(big.to_vec()),
            },
            vec![x],
        );
        cases.push(c);
    }
    cases
}

#[test]
fn reductions() {
    run_group("reductions");
}

fn layout_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for to in [vec![12, 5], vec![60], vec![5, 2, 6]] {
        let mut c = Case::new("layout", format!("reshape [3, 4, 5] -> {to:?}"));
        let x = c.x(&[3, 4, 5]);
        c.test(Op::Reshape { shape: Shape(to) }, vec![x]);
        cases.push(c);
    }
    // A reshape (an alias on the GPU) read by a kernel, beside its own output.
    let mut c = Case::new("layout", "reshape then neg");
    let x = c.x(&[3, 4]);
    let r = c.test(
        Op::Reshape {
            shape: Shape(vec![2, 6]),
        },
        vec![x],
    );
    let n = c.op(Op::Neg, vec![r[0]]);
    c.output(n);
    cases.push(c);
    for (dims, perm) in [
        (&[3usize, 4][..], vec![1, 0]),
        (&[2, 3, 4][..], vec![2, 0, 1]),
        (&[2, 3, 4][..], vec![1, 0, 2]),
        (&[2, 3, 4][..], vec![0, 2, 1]),
        (&[2, 3, 4, 5][..], vec![3, 1, 0, 2]),
    ] {
        let mut c = Case::new("layout", format!("transpose {dims:?} {perm:?}"));
        let x = c.x(dims);
        c.test(Op::Transpose { perm }, vec![x]);
        cases.push(c);
    }
    for axis in 0..3 {
        let mut c = Case::new("layout", format!("concat axis {axis}"));
        let mut ins = Vec::new();
        for k in 1..=3 {
            let mut d = vec![2, 3, 4];
            d[axis] = k;
            ins.push(c.x(&d));
        }
        c.test(Op::Concat { axis }, ins);
        cases.push(c);
    }
    let mut c = Case::new("layout", "concat one input");
    let x = c.x(&[2, 3]);
    c.test(Op::Concat { axis: 1 }, vec![x]);
    cases.push(c);
    // Batch norm's statistics on one device: the mean over replicas (an alias), then
    // the training side of train_or_eval (a copy).
    let mut c = Case::new("layout", "replica_reduce then train_or_eval");
    let (x, running) = (c.x(&[1, 4, 1, 1]), c.x(&[1, 4, 1, 1]));
    let m = c.test(
        Op::ReplicaReduce {
            reduce: distc_ir::ReduceOp::Mean,
        },
        vec![x],
    );
    c.test(Op::TrainOrEval, vec![m[0], running]);
    cases.push(c);
    for (axis, start, end) in [(0, 1, 3), (1, 0, 2), (2, 3, 5), (2, 0, 5)] {
        let mut c = Case::new("layout", format!("slice axis {axis} {start}..{end}"));
        let x = c.x(&[3, 4, 5]);
        c.test(Op::Slice { axis, start, end }, vec![x]);
        cases.push(c);
    }
    cases
}

#[test]
fn layout() {
    run_group("layout");
}

/// The local halves of tensor parallelism, as model rank `m` of the axis: its part of
/// a split value (along the first, a middle and the last dimension), the
/// vocabulary-parallel lookup of a table part and its gradient's compaction (ids in
/// the part's range, repeated, and outside it on both sides).
fn model_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (dims, dim, parts, m) in [
        (&[4usize, 6][..], 1, 3, 2),
        (&[4, 6][..], 0, 2, 1),
        (&[2, 6, 3][..], 1, 2, 1),
    ] {
        let mut c = Case::new(
            "model",
            format!("model_split {dims:?} dim {dim} of {parts}, rank {m}"),
        );
        c.model_rank = m;
        let x = c.x(dims);
        c.test(Op::ModelSplit { dim, parts }, vec![x]);
        cases.push(c);
    }
    let mut c = Case::new("model", "model_enter [3, 5]");
    let x = c.x(&[3, 5]);
    c.test(Op::ModelEnter { parts: 2 }, vec![x]);
    cases.push(c);
    // A table of 10 rows in 2 parts of 5: rank 1 holds rows 5..10.
    let ids = vec![7, 2, 5, 9, 7, 0, 4, 5];
    for m in [0, 1] {
        let mut c = Case::new("model", format!("model_embedding part {m} of 2"));
        c.model_rank = m;
        let t = c.x(&[5, 3]);
        let i = c.feed(ids_tensor(&[2, 4], ids.clone()));
        c.test(Op::ModelEmbedding { parts: 2 }, vec![t, i]);
        cases.push(c);
        let mut c = Case::new("model", format!("model_embedding_grad part {m} of 2"));
        c.model_rank = m;
        let dy = c.x(&[8, 3]);
        let i = c.feed(ids_tensor(&[8], ids.clone()));
        c.test(
            Op::ModelEmbeddingGrad {
                table: f32t(&[5, 3]),
                parts: 2,
            },
            vec![dy, i],
        );
        cases.push(c);
    }
    cases
}

#[test]
fn model() {
    run_group("model");
}

fn loss_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let (b, k) = (6, 5);
    let mut c = Case::new("losses", "softmax_cross_entropy");
    let logits = c.input(&[b, k], -3.0, 3.0);
    let labels = c.ids(&[b], k);
    c.test(Op::SoftmaxCrossEntropy, vec![logits, labels]);
    cases.push(c);
    let mut c = Case::new("losses", "softmax_cross_entropy_grad");
    let dloss = c.input(&[], 0.5, 2.0);
    let logits = c.input(&[b, k], -3.0, 3.0);
    let labels = c.ids(&[b], k);
    c.test(Op::SoftmaxCrossEntropyGrad, vec![dloss, logits, labels]);
    cases.push(c);
    for dims in [&[7usize][..], &[3, 4][..], &[2, 3, 4][..]] {
        let mut c = Case::new("losses", format!("mse {dims:?}"));
        let p = c.x(dims);
        let t = c.x(dims);
        c.test(Op::Mse, vec![p, t]);
        cases.push(c);
        let mut c = Case::new("losses", format!("mse_grad {dims:?}"));
        let dloss = c.input(&[], 0.5, 2.0);
        let p = c.x(dims);
        let t = c.x(dims);
        c.test(Op::MseGrad, vec![dloss, p, t]);
        cases.push(c);
    }
    cases
}

#[test]
fn losses() {
    run_group("losses");
}

fn layer_norm_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    // [3, 50, 5]: 150 rows, so the column sums of the gradient add three chunks.
    for dims in [&[4usize, 6][..], &[2, 3, 8][..], &[3, 50, 5][..]] {
        let last = dims[dims.len() - 1];
        let mut c = Case::new("layer_norm", format!("layer_norm {dims:?}"));
        let x = c.input(dims, -2.0, 2.0);
        let gamma = c.input(&[last], 0.5, 1.5);
        let beta = c.x(&[last]);
        c.test(Op::LayerNorm { eps: 1e-5 }, vec![x, gamma, beta]);
        cases.push(c);
        let mut c = Case::new("layer_norm", format!("layer_norm_grad {dims:?}"));
        let dy = c.x(dims);
        let x = c.input(dims, -2.0, 2.0);
        let gamma = c.input(&[last], 0.5, 1.5);
        let outs = c.test(Op::LayerNormGrad { eps: 1e-5 }, vec![dy, x, gamma]);
        assert_eq!(outs.len(), 3, "layer_norm_grad has three results");
        cases.push(c);
    }
    cases
}

#[test]
fn layer_norm() {
    run_group("layer_norm");
}

fn dropout_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for per_sample in [false, true] {
        for rank in [0, 1] {
            let mut c = Case::new(
                "dropout",
                format!("dropout per_sample={per_sample} rank {rank}"),
            );
            c.rank = rank;
            let (rate, seed) = (0.3, 11);
            let x = c.x(&[4, 6]);
            // Output 0: the forward; output 1: the gradient of `x` as dy, which must
            // drop and scale exactly as the forward does.
            c.test(
                Op::Dropout {
                    rate,
                    seed,
                    per_sample,
                },
                vec![x],
            );
            c.test(
                Op::DropoutGrad {
                    rate,
                    seed,
                    per_sample,
                },
                vec![x],
            );
            // Training at two steps (the mask follows the step), then evaluation
            // (the identity).
            c.runs = [(Mode::Train, 3), (Mode::Train, 4), (Mode::Eval, 3)]
                .into_iter()
                .map(|(mode, step)| Run {
                    mode,
                    step,
                    feeds: None,
                })
                .collect();
            cases.push(c);
        }
    }
    cases
}

#[test]
fn dropout() {
    for case in dropout_cases() {
        let r = check(&case);
        let x = &case.feeds["in0"];
        let scale = 1.0 / 0.7;
        for run in 0..2 {
            let (y, dx) = (nth(&r, run, 0), nth(&r, run, 1));
            assert_eq!(
                y, dx,
                "{}: the gradient's mask is not the forward's",
                case.name
            );
            let dropped = y.to_f64_vec().iter().filter(|v| **v == 0.0).count();
            assert!(
                dropped > 0 && dropped < y.len(),
                "{}: step {}: {dropped} of {} dropped",
                case.name,
                case.runs[run].step,
                y.len()
            );
            for (a, b) in y.to_f64_vec().iter().zip(x.to_f64_vec()) {
                assert!(
                    *a == 0.0 || (a - b * scale).abs() < 1e-6,
                    "{}: {a} from {b}",
                    case.name
                );
            }
        }
        assert_ne!(
            nth(&r, 0, 0),
            nth(&r, 1, 0),
            "{}: the mask ignores the step",
            case.name
        );
        assert_eq!(
            nth(&r, 2, 0),
            x,
            "{}: dropout in evaluation is not the identity",
            case.name
        );
    }
}

fn conv_out(h: usize, k: usize, stride: usize, padding: usize) -> usize {
    (h + 2 * padding - k) / stride + 1
}

fn conv_pool_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let convs: &[([usize; 4], [usize; 4], usize, usize)] = &[
        ([2, 3, 6, 6], [4, 3, 3, 3], 1, 0),
        ([2, 3, 6, 6], [4, 3, 3, 3], 1, 1),
        ([2, 3, 6, 6], [4, 3, 3, 3], 2, 1),
        ([1, 2, 5, 7], [3, 2, 2, 3], 1, 0),
        ([1, 2, 7, 5], [2, 2, 3, 1], 2, 2),
    ];
    for &(xd, wd, stride, padding) in convs {
        let tag = format!("x {xd:?} w {wd:?} s{stride} p{padding}");
        let yd = [
            xd[0],
            wd[0],
            conv_out(xd[2], wd[2], stride, padding),
            conv_out(xd[3], wd[3], stride, padding),
        ];
        let mut c = Case::new("conv_pool", format!("conv2d {tag}"));
        let x = c.x(&xd);
        let w = c.x(&wd);
        c.test(Op::Conv2d { stride, padding }, vec![x, w]);
        cases.push(c);
        let mut c = Case::new("conv_pool", format!("conv2d_grad_input {tag}"));
        let dy = c.x(&yd);
        let w = c.x(&wd);
        c.test(
            Op::Conv2dGradInput {
                stride,
                padding,
                input: Shape(xd.to_vec()),
            },
            vec![dy, w],
        );
        cases.push(c);
        let mut c = Case::new("conv_pool", format!("conv2d_grad_filter {tag}"));
        let dy = c.x(&yd);
        let x = c.x(&xd);
        c.test(
            Op::Conv2dGradFilter {
                stride,
                padding,
                filter: Shape(wd.to_vec()),
            },
            vec![dy, x],
        );
        cases.push(c);
    }
    for (xd, kernel, stride) in [
        ([2, 2, 6, 6], 2, 2),
        ([2, 2, 6, 6], 3, 1),
        ([1, 3, 7, 5], 3, 2),
    ] {
        let tag = format!("x {xd:?} k{kernel} s{stride}");
        let mut c = Case::new("conv_pool", format!("max_pool2d {tag}"));
        let x = c.x(&xd);
        c.test(Op::MaxPool2d { kernel, stride }, vec![x]);
        cases.push(c);
        let yd = [
            xd[0],
            xd[1],
            (xd[2] - kernel) / stride + 1,
            (xd[3] - kernel) / stride + 1,
        ];
        let mut c = Case::new("conv_pool", format!("max_pool2d_grad {tag}"));
        let dy = c.x(&yd);
        let x = c.x(&xd);
        c.test(Op::MaxPool2dGrad { kernel, stride }, vec![dy, x]);
        cases.push(c);
    }
    cases
}

#[test]
fn conv_pool() {
    run_group("conv_pool");
}

/// `embedding_grad` of random `dy` at `ids` (repeated ids, untouched rows) into a
/// `[rows, width]` table: IndexedSlices for the sparse ops to work on.
fn slices(c: &mut Case, ids: &[i32], rows: usize, width: usize) -> ValueId {
    let n = ids.len();
    let idv = c.feed(ids_tensor(&[n], ids.to_vec()));
    let dy = c.x(&[n, width]);
    c.op(
        Op::EmbeddingGrad {
            table: f32t(&[rows, width]),
        },
        vec![dy, idv],
    )
}

fn sparse_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (table, ids) in [
        (&[10usize, 4][..], &[2usize, 3][..]),
        (&[6, 2, 3][..], &[4][..]),
    ] {
        let mut c = Case::new("sparse", format!("embedding {table:?} ids {ids:?}"));
        let t = c.x(table);
        let i = c.ids(ids, table[0]);
        c.test(Op::Embedding, vec![t, i]);
        cases.push(c);
        let mut c = Case::new("sparse", format!("embedding_grad {table:?} ids {ids:?}"));
        let mut dyd = ids.to_vec();
        dyd.extend_from_slice(&table[1..]);
        let dy = c.x(&dyd);
        let i = c.ids(ids, table[0]);
        c.test(Op::EmbeddingGrad { table: f32t(table) }, vec![dy, i]);
        cases.push(c);
    }
    // Repeated rows (3 and 7 twice, 0 three times), untouched rows 1, 2, 4, 5, 6, 8, 9.
    let ids = [3, 7, 0, 3, 0, 7, 0];
    let mut c = Case::new("sparse", "unique_rows");
    let s = slices(&mut c, &ids, 10, 4);
    c.output(s);
    c.test(Op::UniqueRows, vec![s]);
    cases.push(c);
    // A hot row (id 5 at every third of 330 positions: 110 = 3 rounds of 32 loads
    // ahead, one of 8, and 6 one at a time), among rows seen once or a few times.
    let hot: Vec<i32> = (0..330)
        .map(|k| if k % 3 == 0 { 5 } else { k * 7 % 40 })
        .collect();
    // Summed in order of appearance, as on the CPU: the same bits.
    for width in [4, 40] {
        let mut c = Case::new("sparse", format!("unique_rows, a hot row, width {width}"));
        c.exact = true;
        let s = slices(&mut c, &hot, 40, width);
        c.test(Op::UniqueRows, vec![s]);
        c.test(Op::Densify, vec![s]);
        cases.push(c);
    }
    // A row seen more often than one block sorts in shared memory (4096 times; here
    // about 4180): summed by scanning the batch instead, in the same order.
    let hottest: Vec<i32> = (0..4600)
        .map(|k| if k % 11 == 3 { k % 7 } else { 2 })
        .collect();
    let mut c = Case::new("sparse", "unique_rows, a row seen over 4096 times");
    c.exact = true;
    let s = slices(&mut c, &hottest, 8, 3);
    c.test(Op::UniqueRows, vec![s]);
    cases.push(c);
    let mut c = Case::new("sparse", "densify");
    let s = slices(&mut c, &ids, 10, 4);
    c.test(Op::Densify, vec![s]);
    cases.push(c);
    let mut c = Case::new("sparse", "row_mask");
    let s = slices(&mut c, &ids, 10, 4);
    c.test(Op::RowMask, vec![s]);
    cases.push(c);
    for k in 1..=3 {
        let mut c = Case::new("sparse", format!("concat_slices of {k}"));
        let parts = [&[1, 4, 4][..], &[9, 1][..], &[0, 4, 8, 8][..]];
        let ins = (0..k).map(|j| slices(&mut c, parts[j], 10, 3)).collect();
        c.test(Op::ConcatSlices, ins);
        cases.push(c);
    }
    // Sparsify with zeros, negatives and positives in the mask; then what it feeds.
    let mut c = Case::new("sparse", "sparsify");
    let dense = c.x(&[6, 3]);
    let mask = c.feed(tensor(&[6], vec![1.0, 0.0, 2.0, 0.0, 0.0, -1.0]));
    let s = c.test(Op::Sparsify, vec![dense, mask]);
    c.test(Op::RowMask, vec![s[0]]);
    c.test(Op::UniqueRows, vec![s[0]]);
    cases.push(c);
    let mut c = Case::new("sparse", "sparsify all zero");
    let dense = c.x(&[4, 2]);
    let mask = c.feed(tensor(&[4], vec![0.0; 4]));
    c.test(Op::Sparsify, vec![dense, mask]);
    cases.push(c);
    cases
}

#[test]
fn sparse() {
    for case in sparse_cases() {
        let r = check(&case);
        // Whatever the row order, unique_rows stands for the same dense tensor.
        if case.name == "unique_rows" {
            assert_close(
                "unique_rows vs its input (CPU)",
                nth(&r, 0, 1),
                nth(&r, 0, 0),
            );
        }
        if case.name == "row_mask" {
            let want: Vec<f64> = (0..10)
                .map(|i| if [0, 3, 7].contains(&i) { 1.0 } else { 0.0 })
                .collect();
            assert_eq!(nth(&r, 0, 0).to_f64_vec(), want, "row_mask on the CPU");
        }
        if case.name == "sparsify" {
            let d = case.feeds["in0"].to_f64_vec();
            let got = nth(&r, 0, 0).to_f64_vec();
            for (i, (a, b)) in got.iter().zip(&d).enumerate() {
                let kept = [0, 2, 5].contains(&(i / 3));
                assert_eq!(*a, if kept { *b } else { 0.0 }, "sparsify[{i}] on the CPU");
            }
        }
    }
}

fn packing_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let shapes = [vec![2, 3], vec![5], vec![2, 2]];
    let mut c = Case::new("packing", "pack");
    let ins = shapes.iter().map(|s| c.x(s)).collect();
    c.test(Op::Pack, ins);
    cases.push(c);
    let mut c = Case::new("packing", "unpack");
    let total = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let x = c.x(&[total]);
    c.test(
        Op::Unpack {
            shapes: shapes.iter().cloned().map(Shape).collect(),
        },
        vec![x],
    );
    cases.push(c);
    for workers in [1, 3, 4] {
        let mut c = Case::new("packing", format!("pack_chunks {workers}"));
        let ins = shapes.iter().map(|s| c.x(s)).collect();
        c.test(Op::PackChunks { workers }, ins);
        cases.push(c);
        let mut c = Case::new("packing", format!("unpack_chunks {workers}"));
        let chunks: usize = shapes
            .iter()
            .map(|s| s.iter().product::<usize>().div_ceil(workers))
            .sum();
        let x = c.x(&[chunks * workers]);
        c.test(
            Op::UnpackChunks {
                workers,
                shapes: shapes.iter().cloned().map(Shape).collect(),
            },
            vec![x],
        );
        cases.push(c);
        // The round trip gives the values back.
        let mut c = Case::new(
            "packing",
            format!("pack_chunks then unpack_chunks {workers}"),
        );
        let ins: Vec<ValueId> = shapes.iter().map(|s| c.x(s)).collect();
        let p = c.test(Op::PackChunks { workers }, ins.clone());
        c.test(
            Op::UnpackChunks {
                workers,
                shapes: shapes.iter().cloned().map(Shape).collect(),
            },
            p,
        );
        cases.push(c);
    }
    // The last rank's chunk is padded (10 elements, chunks of 4 for 3 workers).
    for (workers, rank) in [(3, 0), (3, 1), (3, 2), (1, 0)] {
        let mut c = Case::new("packing", format!("take_chunk {workers} rank {rank}"));
        c.rank = rank;
        let x = c.x(&[2, 5]);
        c.test(Op::TakeChunk { workers }, vec![x]);
        cases.push(c);
    }
    cases
}

#[test]
fn packing() {
    for case in packing_cases() {
        let r = check(&case);
        if case.name.starts_with("pack_chunks then") {
            for k in 0..3 {
                assert_eq!(
                    nth(&r, 0, k + 1),
                    &case.feeds[&format!("in{k}")],
                    "{}: value {k} does not come back",
                    case.name
                );
            }
        }
    }
}

/// Inputs: `x [4, 5]`, `b [5]` and `p [4, 1]` (positive), the last two broadcast.
/// Every unary and binary function is used, and every step feeds the result.
fn fused_expr() -> FusedExpr {
    use BinaryFn as B;
    use FusedStep::{Binary, Const, Input, Unary};
    use UnaryFn as U;
    FusedExpr {
        steps: vec![
            Input(0),                        // 0: x
            Input(1),                        // 1: b
            Input(2),                        // 2: p > 0
            Const(0.5),                      // 3
            Binary(B::Add, 0, 1),            // 4: x + b
            Unary(U::Relu, 4),               // 5
            Unary(U::Sigmoid, 0),            // 6
            Unary(U::Tanh, 1),               // 7
            Binary(B::Mul, 6, 7),            // 8
            Unary(U::Log, 2),                // 9
            Unary(U::Exp, 8),                // 10
            Binary(B::Div, 10, 2),           // 11
            Unary(U::Step, 4),               // 12
            Binary(B::Sub, 5, 11),           // 13
            Binary(B::Mul, 12, 3),           // 14
            Unary(U::Neg, 9),                // 15
            Binary(B::Add, 13, 14),          // 16
            Binary(B::Add, 16, 15),          // 17
            Unary(U::Sqrt, 2),               // 18
            Unary(U::Rsqrt, 2),              // 19
            Unary(U::Gelu, 0),               // 20
            Unary(U::GeluTanh, 1),           // 21
            Unary(U::Silu, 4),               // 22
            Unary(U::GeluDerivative, 0),     // 23
            Unary(U::GeluTanhDerivative, 1), // 24
            Unary(U::SiluDerivative, 4),     // 25
            Binary(B::Pow, 2, 3),            // 26: p^0.5
            Binary(B::Less, 0, 1),           // 27
            Binary(B::LessEqual, 0, 3),      // 28
            Binary(B::Greater, 1, 3),        // 29
            Binary(B::GreaterEqual, 0, 1),   // 30
            Binary(B::Equal, 27, 30),        // 31
            Binary(B::NotEqual, 27, 29),     // 32
            Binary(B::Keep, 28, 20),         // 33
            // 34..: the sum of 17..=33, so every step reaches the result.
            Binary(B::Add, 17, 18),
            Binary(B::Add, 34, 19),
            Binary(B::Add, 35, 20),
            Binary(B::Add, 36, 21),
            Binary(B::Add, 37, 22),
            Binary(B::Add, 38, 23),
            Binary(B::Add, 39, 24),
            Binary(B::Add, 40, 25),
            Binary(B::Add, 41, 26),
            Binary(B::Add, 42, 27),
            Binary(B::Add, 43, 28),
            Binary(B::Add, 44, 29),
            Binary(B::Add, 45, 30),
            Binary(B::Add, 46, 31),
            Binary(B::Add, 47, 32),
            Binary(B::Add, 48, 33),
        ],
    }
}

fn attention_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for causal in [false, true] {
        // Short slices, a slice of one whole block of rows (64), part of one, and
        // slices of several blocks and tiles (the kernels walk keys and queries 64 at
        // a time, a causal block stopping at its last row or starting at its first).
        for (tq, tk) in [(5, 5), (3, 7), (64, 64), (40, 40), (70, 130), (130, 70)] {
            let mut c = Case::new(
                "attention",
                format!("attention causal={causal} {tq}x{tk} and its gradient"),
            );
            let q = c.x(&[2, 3, tq, 4]);
            let k = c.x(&[2, 3, tk, 4]);
            let v = c.x(&[2, 3, tk, 6]);
            let y = c.test(Op::Attention { causal, scale: 0.5 }, vec![q, k, v]);
            let dy = c.x(&[2, 3, tq, 6]);
            let _ = y;
            c.test(Op::AttentionGrad { causal, scale: 0.5 }, vec![dy, q, k, v]);
            cases.push(c);
        }
    }
    cases
}

#[test]
fn attention() {
    run_group("attention");
}

fn fused_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut c = Case::new("fused", "fused every function, broadcast inputs");
    let x = c.x(&[4, 5]);
    let b = c.x(&[5]);
    let p = c.input(&[4, 1], 0.5, 2.0);
    c.test(Op::Fused { expr: fused_expr() }, vec![x, b, p]);
    cases.push(c);
    // The broadcast input first, so the result's shape is not the first input's.
    let mut c = Case::new("fused", "fused broadcast first");
    let b = c.x(&[1, 5]);
    let x = c.x(&[3, 1]);
    let expr = FusedExpr {
        steps: vec![
            FusedStep::Input(0),
            FusedStep::Input(1),
            FusedStep::Binary(BinaryFn::Mul, 0, 1),
            FusedStep::Unary(UnaryFn::Tanh, 2),
        ],
    };
    c.test(Op::Fused { expr }, vec![b, x]);
    cases.push(c);
    cases
}

#[test]
fn fused() {
    let expr = fused_expr();
    for f in UnaryFn::ALL {
        assert!(
            matches!(expr.steps[unary_step(f)], FusedStep::Unary(g, _) if g == f),
            "step {} is not {}",
            unary_step(f),
            f.name()
        );
    }
    for f in BinaryFn::ALL {
        assert!(
            matches!(expr.steps[binary_step(f)], FusedStep::Binary(g, _, _) if g == f),
            "step {} is not {}",
            binary_step(f),
            f.name()
        );
    }
    assert_eq!(
        expr.canonical().steps.len(),
        expr.steps.len(),
        "a step is dead"
    );
    run_group("fused");
}

/// A micro-batch run with other feeds, then the last run with the case's: the graph
/// is the gradient (dense `a * b`, or sparse `embedding_grad`), under `accumulate`
/// when `accumulate`, else alone (the reference).
fn accumulate_case(sparse: bool, accumulate: bool) -> Case {
    let mut c = Case::new("accumulate", format!("accumulate sparse={sparse}"));
    let g = if sparse {
        slices(&mut c, &[1, 4, 4, 0], 6, 3)
    } else {
        let a = c.x(&[3, 4]);
        let b = c.x(&[3, 4]);
        c.op(Op::Mul, vec![a, b])
    };
    if accumulate {
        c.test(Op::Accumulate { micro: 2 }, vec![g]);
    } else {
        c.output(g);
    }
    let mut first = c.feeds.clone();
    let mut names: Vec<String> = first.keys().cloned().collect();
    names.sort();
    for k in names {
        if let Some(t) = first.get_mut(&k) {
            if t.dtype() == DType::F32 {
                *t = c.random(t.shape(), -1.0, 1.0);
            }
        }
    }
    c.runs = vec![
        Run {
            mode: if accumulate { Mode::Micro } else { Mode::Train },
            step: 1,
            feeds: Some(first),
        },
        Run {
            mode: Mode::Train,
            step: 1,
            feeds: None,
        },
    ];
    c
}

fn accumulate_cases() -> Vec<Case> {
    vec![accumulate_case(false, true), accumulate_case(true, true)]
}

#[test]
fn accumulate() {
    for (case, sparse) in accumulate_cases().into_iter().zip([false, true]) {
        // On the CPU: the mean of the two micro-batches' gradients; then the GPU
        // against the CPU.
        let r = check(&case);
        let got = nth(&r, 1, 0).to_f64_vec();
        let reference = accumulate_case(sparse, false);
        let each = execute(&reference, Cpu);
        let (g1, g2) = (nth(&each, 0, 0).to_f64_vec(), nth(&each, 1, 0).to_f64_vec());
        assert_eq!(got.len(), g1.len(), "{}", case.name);
        for (i, a) in got.iter().enumerate() {
            let b = (g1[i] + g2[i]) / 2.0;
            assert!(
                (a - b).abs() <= 1e-6,
                "{}[{i}]: {a}, the mean is {b}",
                case.name
            );
        }
    }
}

// ---------------------------------------------------------------------------------
// The coverage table against the cases
// ---------------------------------------------------------------------------------

#[test]
fn coverage_table_matches_the_cases() {
    let mut groups_seen = BTreeSet::new();
    for (group, build) in GROUPS {
        let cases = build();
        assert!(!cases.is_empty(), "group `{group}` has no cases");
        for case in &cases {
            assert_eq!(
                case.group, *group,
                "{}: built by the wrong group",
                case.name
            );
            distc_ir::verify(&case.g).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let mut tests_its_group = false;
            for id in case.g.node_ids() {
                let op = case.g.op(id);
                match covering_group(op) {
                    Cover::Group(g) => {
                        assert!(
                            GROUPS.iter().any(|(n, _)| *n == g),
                            "{op}: the table names group `{g}`, which does not exist"
                        );
                        tests_its_group |= g == *group;
                        groups_seen.insert(g);
                    }
                    Cover::NotAKernel(why) => assert!(
                        op.is_source() || op.is_sink() || op.is_communication(),
                        "{op}: the table says `{why}`, but it is a kernel"
                    ),
                }
                // Every kernel op is in some group; nothing here communicates.
                assert!(!op.is_communication(), "{}: {op} communicates", case.name);
            }
            assert!(
                tests_its_group,
                "{}: runs no op the table gives to group `{group}`",
                case.name
            );
        }
    }
    let all: BTreeSet<&str> = GROUPS.iter().map(|(n, _)| *n).collect();
    assert_eq!(groups_seen, all, "a group runs none of its ops");
}

// ---------------------------------------------------------------------------------
// The generated CUDA, without a GPU
// ---------------------------------------------------------------------------------

/// What `CudaBackend::new` does before it needs a GPU, for every case: the device
/// plan is generated and,
/// where NVRTC is found, its source compiles to an sm_90 CUBIN; so do the optimizer
/// kernels of `optimizer_updates`.
#[test]
fn every_case_generates_cuda_that_compiles() {
    let nvrtc = distc_tests::nvrtc_or_skip("every_case_generates_cuda_that_compiles");
    let mut graphs: Vec<(String, Graph)> = Vec::new();
    for (_, build) in GROUPS {
        graphs.extend(build().into_iter().map(|c| (c.name, c.g)));
    }
    let (g, _, _) = optimizer_graph();
    graphs.push(("optimizer".into(), g.clone()));
    for (name, g) in &graphs {
        let plan = generate(g).unwrap_or_else(|e| panic!("{name}: no device plan: {e}"));
        if nvrtc {
            nvrtc::compile_cubin(&plan.source, &format!("{}.cu", g.name), "sm_90")
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
    let vars: Vec<(String, TensorType, Option<usize>)> = g
        .param_grads()
        .into_iter()
        .map(|(name, v)| {
            let ty = f32t(if name == "w" { &[4, 3] } else { &[10, 3] });
            (name, ty, sparse_bound(g.value_type(v)))
        })
        .collect();
    assert_eq!(
        vars.iter().filter(|v| v.2.is_some()).count(),
        1,
        "one sparse gradient"
    );
    for (label, spec) in optimizer_specs() {
        let copies = distc_runtime::cuda::codegen::weight_copies(&g)
            .into_values()
            .collect();
        let plan = optimizer_kernels(&spec, &[], false, &vars, &copies, 1.0)
            .unwrap_or_else(|e| panic!("{label}: no optimizer kernels: {e}"));
        if nvrtc && !plan.source.is_empty() {
            nvrtc::compile_cubin(&plan.source, &format!("optimizer_{label}.cu"), "sm_90")
                .unwrap_or_else(|e| panic!("{label}: {e}"));
        }
    }
}

// ---------------------------------------------------------------------------------
// Optimizer updates
// ---------------------------------------------------------------------------------

/// A graph with a dense gradient of `w [4, 3]` (`x^T dy`) and a sparse one of
/// `emb [10, 3]` (`embedding_grad` at ids with repeated rows; rows 7..10 untouched),
/// the initial variables and the feeds of two steps.
fn optimizer_graph() -> (Graph, HashMap<String, Tensor>, Vec<HashMap<String, Tensor>>) {
    let mut c = Case::new("optimizer", "optimizer");
    let mut g = Graph::new("optimizer");
    let param = |g: &mut Graph, name: &str, dims: &[usize]| -> ValueId {
        g.add(
            Op::Param {
                name: name.into(),
                ty: f32t(dims),
                init: distc_ir::Init::Zeros,
                frozen: false,
            },
            vec![],
        )
        .expect("param")
        .into()
    };
    let input = |g: &mut Graph, name: &str, ty: TensorType| -> ValueId {
        g.add(
            Op::Input {
                name: name.into(),
                ty,
            },
            vec![],
        )
        .expect("input")
        .into()
    };
    let w = param(&mut g, "w", &[4, 3]);
    let emb = param(&mut g, "emb", &[10, 3]);
    let x = input(&mut g, "x", f32t(&[5, 4]));
    let dy = input(&mut g, "dy", f32t(&[5, 3]));
    let ids = input(&mut g, "ids", TensorType::new(DType::I32, vec![6]));
    let dye = input(&mut g, "dy_emb", f32t(&[6, 3]));
    let mm = |ta, tb| Op::MatMul {
        transpose_a: ta,
        transpose_b: tb,
    };
    let y: ValueId = g.add(mm(false, false), vec![x, w]).expect("matmul").into();
    let e: ValueId = g
        .add(Op::Embedding, vec![emb, ids])
        .expect("embedding")
        .into();
    g.add(Op::Output { name: "y".into() }, vec![y])
        .expect("output");
    g.add(Op::Output { name: "e".into() }, vec![e])
        .expect("output");
    // The forward's 16-bit reads of the variables: on the GPU, the copies each update
    // writes beside its variable (`codegen::weight_copies`).
    for (v, name, to) in [(w, "w_bf16", DType::BF16), (emb, "emb_f16", DType::F16)] {
        let h: ValueId = g.add(Op::Cast { to }, vec![v]).expect("cast").into();
        g.add(Op::Output { name: name.into() }, vec![h])
            .expect("output");
    }
    let gw: ValueId = g.add(mm(true, false), vec![x, dy]).expect("matmul").into();
    let ge: ValueId = g
        .add(
            Op::EmbeddingGrad {
                table: f32t(&[10, 3]),
            },
            vec![dye, ids],
        )
        .expect("embedding_grad")
        .into();
    g.add(Op::ParamGrad { param: "w".into() }, vec![gw])
        .expect("param_grad");
    g.add(
        Op::ParamGrad {
            param: "emb".into(),
        },
        vec![ge],
    )
    .expect("param_grad");
    let params = HashMap::from([
        ("w".to_string(), c.random(&[4, 3], -1.0, 1.0)),
        ("emb".to_string(), c.random(&[10, 3], -1.0, 1.0)),
    ]);
    let steps = [vec![2, 5, 2, 0, 6, 5], vec![1, 1, 1, 3, 4, 2]]
        .into_iter()
        .map(|ids| {
            HashMap::from([
                ("x".to_string(), c.random(&[5, 4], -1.0, 1.0)),
                ("dy".to_string(), c.random(&[5, 3], -1.0, 1.0)),
                ("ids".to_string(), ids_tensor(&[6], ids)),
                ("dy_emb".to_string(), c.random(&[6, 3], -1.0, 1.0)),
            ])
        })
        .collect();
    (g, params, steps)
}

/// The variables after each step of `spec` on `backend`, as host tensors.
fn train<B: Backend>(
    backend: B,
    g: &Graph,
    (spec, no_decay, lazy): (&OptimizerSpec, &[String], bool),
    params: &HashMap<String, Tensor>,
    steps: &[HashMap<String, Tensor>],
) -> Vec<HashMap<String, Tensor>> {
    let on = backend.name();
    let mut ex = Executor::with_backend(g, backend).unwrap_or_else(|e| panic!("{on}: {e}"));
    let mut vars = upload(ex.backend(), params);
    let mut opt = ex
        .backend()
        .optimizer(spec, no_decay, lazy, &vars)
        .unwrap_or_else(|e| panic!("{on}: {spec:?}: {e}"));
    let mut after: Vec<HashMap<String, Tensor>> = Vec::new();
    for (i, feeds) in steps.iter().enumerate() {
        let feeds = upload(ex.backend(), feeds);
        let out = ex
            .run(&feeds, &vars, Mode::Train, i as u64 + 1)
            .unwrap_or_else(|e| panic!("{on}: step {}: {e}", i + 1));
        assert_eq!(out.grads.len(), 2, "{on}: two gradients");
        // The 16-bit reads are the casts of the variables the step started from, bit
        // for bit (on the GPU, after the first step, what the last update wrote).
        let before = after.last().unwrap_or(params);
        for (var, output, to) in [("w", "w_bf16", DType::BF16), ("emb", "emb_f16", DType::F16)] {
            let got = out
                .outputs
                .iter()
                .find(|(n, _)| n == output)
                .map(|(_, t)| t);
            let want = before[var].cast(to);
            assert!(
                got.is_some() && got == want.as_ref(),
                "{on}: {spec:?}: step {}: `{output}` is not the cast of `{var}`",
                i + 1
            );
        }
        ex.backend()
            .update(&mut opt, &mut vars, out.grads)
            .unwrap_or_else(|e| panic!("{on}: {spec:?}: update {}: {e}", i + 1));
        let b = ex.backend();
        after.push(
            vars.iter()
                .map(|(k, t)| {
                    let h = b
                        .download(t)
                        .unwrap_or_else(|e| panic!("{on}: download `{k}`: {e}"));
                    (k.clone(), h)
                })
                .collect(),
        );
    }
    after
}

/// SGD, SGD with momentum, Adam, AdamW, LARS and LAMB.
fn optimizer_specs() -> [(&'static str, OptimizerSpec); 6] {
    [
        (
            "sgd",
            OptimizerSpec::Sgd {
                lr: 0.1,
                momentum: 0.0,
            },
        ),
        (
            "momentum",
            OptimizerSpec::Sgd {
                lr: 0.1,
                momentum: 0.9,
            },
        ),
        (
            "adam",
            OptimizerSpec::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        ),
        // Decoupled decay on `w`; `emb` exempt (see `optimizer_updates`).
        (
            "adamw",
            OptimizerSpec::Adam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.1,
            },
        ),
        // Trust ratios: every row moves (the momentum, and the decay); LAMB's `emb`
        // is exempt from decay, so its untouched rows stay.
        (
            "lars",
            OptimizerSpec::Lars {
                lr: 0.5,
                momentum: 0.9,
                weight_decay: 0.01,
                trust: 0.02,
            },
        ),
        (
            "lamb",
            OptimizerSpec::Lamb {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
                weight_decay: 0.1,
            },
        ),
    ]
}

#[test]
fn optimizer_updates() {
    let (g, params, steps) = optimizer_graph();
    for (name, spec) in &optimizer_specs() {
        let no_decay = if *name == "adamw" || *name == "lamb" {
            vec!["emb".to_string()]
        } else {
            Vec::new()
        };
        let want = train(Cpu, &g, (spec, &no_decay, false), &params, &steps);
        // On the CPU: every touched value moved; the rows no step touches did not.
        let (w0, e0) = (params["w"].to_f64_vec(), params["emb"].to_f64_vec());
        let last = &want[1];
        assert!(
            last["w"].to_f64_vec().iter().zip(&w0).all(|(a, b)| a != b),
            "{name}: the dense variable did not move everywhere"
        );
        let e = last["emb"].to_f64_vec();
        // LARS applies a sparse gradient as the dense one it stands for, with decay.
        let every_row = *name == "lars";
        for row in 0..10 {
            let moved = (0..3).any(|j| e[row * 3 + j] != e0[row * 3 + j]);
            assert_eq!(
                moved,
                every_row || row < 7,
                "{name}: emb row {row} moved: {moved}"
            );
        }
        // A sparse gradient's two rules (the dense update by default, the touched
        // rows under `lazy`), each against the CPU's.
        for lazy in [false, true] {
            let want = if lazy {
                train(Cpu, &g, (spec, &no_decay, true), &params, &steps)
            } else {
                want.clone()
            };
            if let Some(gpu) = gpu(&format!("optimizer {name}"), &g) {
                let got = train(gpu, &g, (spec, &no_decay, lazy), &params, &steps);
                for (s, (a, b)) in got.iter().zip(&want).enumerate() {
                    for var in ["w", "emb"] {
                        assert_close(
                            &format!("{name} (lazy {lazy}): step {}: `{var}`", s + 1),
                            &a[var],
                            &b[var],
                        );
                    }
                }
            }
        }
    }
}
