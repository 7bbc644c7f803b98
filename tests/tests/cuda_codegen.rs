//! Generated CUDA (issue 10, items 2, 3 and 6): every example's worker program, under
//! several strategies, becomes a device plan whose whole source NVRTC compiles to an
//! sm_90 CUBIN; the source of each example is snapshotted; every launch is checked
//! against the node it belongs to (argument roles exist, grids cover the elements,
//! products have the op's shapes); and the cuBLAS mapping of every matmul transpose
//! case is evaluated in Rust against the row-major product.
//!
//! NVRTC is looked for in `DISTC_CUDA_LIB_DIR`'s folders, then in the project-local
//! `.nvrtc/nvidia/cu13/lib` that `scripts/install-nvrtc.sh` fills. Where it is missing
//! the compile test skips with a printed reason, except in CI (`CI` set), where it
//! fails. Nothing here needs a GPU.

use distc::{compile_file, CompileOptions, Compiled};
use distc_ir::{Graph, Op, ValueType};
use distc_passes::placement::{Precision, Strategy, StrategyConfig};
use distc_runtime::cuda::codegen::{
    generate, value_bytes, DevicePlan, Gemm, KArg, Launch, NodeLaunch, OptimizerPlan, BLOCK,
};
use distc_runtime::cuda::emu::blas::{sgemm_strided_batched, SgemmCall};
use distc_runtime::cuda::nvrtc;
use distc_runtime::OptimizerSpec;
use distc_tests::{example, nvrtc_or_skip, EXAMPLES};

/// The strategies each example is generated under: `(label, strategy, workers,
/// servers, kernel fusion)`.
const STRATEGIES: [(&str, Strategy, usize, usize, bool); 6] = [
    ("single", Strategy::Single, 1, 0, false),
    ("allreduce", Strategy::Allreduce, 2, 0, false),
    ("hybrid", Strategy::Hybrid, 2, 1, false),
    ("ps", Strategy::Ps, 2, 1, false),
    ("single-fuse", Strategy::Single, 1, 0, true),
    ("hybrid-fuse", Strategy::Hybrid, 2, 1, true),
];

fn compile(name: &str, strategy: Strategy, workers: usize, servers: usize, fuse: bool) -> Compiled {
    let opts = CompileOptions {
        strategy: StrategyConfig {
            strategy,
            workers,
            servers,
            fuse,
            ..Default::default()
        },
        ..Default::default()
    };
    compile_file(&example(name), &opts).unwrap_or_else(|e| panic!("{name} {strategy:?}: {e}"))
}

/// The optimizer's kernels for every variable the program has a gradient of.
fn optimizer_plan(c: &Compiled) -> OptimizerPlan {
    distc_tests::optimizer_plan(
        &c.programs.worker,
        (&c.config.optimizer, c.config.lazy_updates),
    )
}

/// Checks a CUBIN is a CUDA ELF image holding `names`.
fn check_cubin(cubin: &[u8], names: &[&str], what: &str) {
    assert_eq!(&cubin[..4], b"\x7fELF", "{what}: not an ELF image");
    assert_eq!(
        u16::from_le_bytes([cubin[18], cubin[19]]),
        190,
        "{what}: not a CUDA ELF"
    );
    for n in names {
        assert!(
            cubin.windows(n.len()).any(|w| w == n.as_bytes()),
            "{what}: no symbol {n}"
        );
    }
}

fn kernel_names(launches: &[Launch]) -> Vec<&str> {
    launches
        .iter()
        .filter_map(|l| match l {
            Launch::Kernel { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect()
}

#[test]
fn every_example_compiles_to_cubin_under_every_strategy() {
    if !nvrtc_or_skip("every_example_compiles_to_cubin_under_every_strategy") {
        return;
    }
    for name in EXAMPLES {
        for (label, s, workers, servers, fuse) in STRATEGIES {
            let c = compile(name, s, workers, servers, fuse);
            let plan =
                generate(&c.programs.worker).unwrap_or_else(|e| panic!("{name} {label}: {e}"));
            let what = format!("{name} {label}");
            let cubin = nvrtc::compile_cubin(&plan.source, &format!("{name}.{label}.cu"), "sm_90")
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let names: Vec<&str> = plan
                .nodes
                .iter()
                .flat_map(|(_, n)| kernel_names(&n.launches))
                .collect();
            check_cubin(&cubin, &names, &what);
            let opt = optimizer_plan(&c);
            let cubin =
                nvrtc::compile_cubin(&opt.source, &format!("{name}.{label}.optim.cu"), "sm_90")
                    .unwrap_or_else(|e| panic!("{what} optimizer: {e}"));
            let names: Vec<&str> = opt
                .vars
                .iter()
                .flat_map(|v| kernel_names(&v.launches))
                .collect();
            check_cubin(&cubin, &names, &format!("{what} optimizer"));
            eprintln!(
                "{what}: {} nodes, {} kernels, {} bytes of CUDA C, CUBIN {} bytes",
                plan.nodes.len(),
                plan.source.matches("__global__").count(),
                plan.source.len(),
                cubin.len()
            );
        }
    }
}

#[test]
fn generated_source_of_each_example() {
    for name in EXAMPLES {
        let c = compile(name, Strategy::Single, 1, 0, false);
        let plan = generate(&c.programs.worker).unwrap_or_else(|e| panic!("{name}: {e}"));
        let stem = name.trim_end_matches(".dsl");
        insta::assert_snapshot!(format!("cuda_{stem}"), plan.source);
    }
}

/// The type of a node's input or output buffer a launch argument names.
fn arg_type<'g>(g: &'g Graph, node: distc_ir::NodeId, arg: &KArg) -> Option<&'g ValueType> {
    let n = g.node(node);
    match arg {
        KArg::Input(i) => n.inputs.get(*i).map(|&v| g.value_type(v)),
        KArg::Output(j) => n.outputs.get(*j),
        _ => None,
    }
}

/// Every argument names something the node (or its launch list) has.
fn check_args(g: &Graph, id: distc_ir::NodeId, nl: &NodeLaunch, args: &[&KArg], what: &str) {
    let n = g.node(id);
    for a in args {
        match a {
            KArg::Input(i) => assert!(
                *i < n.inputs.len(),
                "{what}: input {i} of {}",
                n.inputs.len()
            ),
            KArg::Output(j) => {
                assert!(
                    *j < n.outputs.len(),
                    "{what}: output {j} of {}",
                    n.outputs.len()
                )
            }
            KArg::Scratch(k) => assert!(
                *k < nl.scratch_bytes.len(),
                "{what}: scratch {k} of {}",
                nl.scratch_bytes.len()
            ),
            KArg::Param | KArg::Grad | KArg::Slot(_) | KArg::WeightCopy => {
                panic!("{what}: an optimizer argument in a graph launch")
            }
            _ => {}
        }
    }
}

/// The element count a 1-D kernel over a node's output must cover, for the ops whose
/// kernels take one thread per output element: the element-wise maths (as the IR
/// defines it, [`Op::is_elementwise_math`]) and a few more.
fn covered_by_output(op: &Op) -> bool {
    op.is_elementwise_math()
        || matches!(
            op,
            Op::MseGrad
                | Op::Dropout { .. }
                | Op::DropoutGrad { .. }
                | Op::Transpose { .. }
                | Op::Embedding
                | Op::MaxPool2d { .. }
        )
}

/// The emulator's cuBLAS (column-major, as cuBLAS defines it) on plain slices.
fn sgemm(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) {
    sgemm_strided_batched(&SgemmCall::of(g), a, b, c).expect("a valid cuBLAS call");
}

#[test]
fn gemm_mapping_computes_every_row_major_transpose_case() {
    let (m, n, k) = (3, 5, 4);
    for (tx, tw) in [(false, false), (true, false), (false, true), (true, true)] {
        // Row-major x: [m,k] (or [k,m] stored when tx); w: [k,n] (or [n,k] when tw).
        let x: Vec<f32> = (0..m * k).map(|v| v as f32 * 0.5 - 2.0).collect();
        let w: Vec<f32> = (0..k * n).map(|v| (v as f32 * 0.25).sin()).collect();
        let xe = |i: usize, p: usize| if tx { x[p * m + i] } else { x[i * k + p] };
        let we = |p: usize, j: usize| if tw { w[j * k + p] } else { w[p * n + j] };
        let g = Gemm::row_major(
            (KArg::Input(0), tx),
            (KArg::Input(1), tw),
            KArg::Output(0),
            (m, n, k),
            1,
            (0, 0, 0),
        )
        .expect("fits");
        assert_eq!(g.a, KArg::Input(1), "cuBLAS's A is the right-hand operand");
        let mut y = vec![f32::NAN; m * n];
        y.iter_mut().for_each(|v| *v = 0.0);
        sgemm(&g, &w, &x, &mut y);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|p| xe(i, p) * we(p, j)).sum();
                assert!(
                    (y[i * n + j] - want).abs() < 1e-4,
                    "tx {tx} tw {tw} at [{i},{j}]: {} vs {want}",
                    y[i * n + j]
                );
            }
        }
    }
}

/// Checks each launch of a plan against its node; returns how many were checked.
fn check_plan(g: &Graph, plan: &DevicePlan, what: &str) -> usize {
    let mut checked = 0;
    for (id, nl) in &plan.nodes {
        let node = g.node(*id);
        let what = format!("{what} {id} ({})", node.op);
        assert!(
            nl.scratch_bytes.iter().all(|&b| b > 0),
            "{what}: an empty scratch"
        );
        for l in nl.launches.iter().chain(&nl.step_start) {
            checked += 1;
            match l {
                Launch::Kernel {
                    name,
                    grid,
                    block,
                    args,
                    ..
                } => {
                    assert!(
                        plan.source.contains(&format!("void {name}(")),
                        "{what}: kernel {name} is not in the source"
                    );
                    assert!(grid.iter().all(|&d| d >= 1), "{what}: grid {grid:?}");
                    assert!(
                        block[0] % 32 == 0 && block[0] <= 1024 && block[1] == 1 && block[2] == 1,
                        "{what}: block {block:?}"
                    );
                    check_args(g, *id, nl, &args.iter().collect::<Vec<_>>(), &what);
                    if matches!(node.op, Op::Fused { .. }) {
                        assert!(name.starts_with("k_fused"), "{what}: runs {name}");
                    }
                    // A 16-bit operand's widening cast covers that operand instead.
                    if covered_by_output(&node.op) && !name.starts_with("k_cast_") {
                        let n = node.outputs[0].dense_type().shape.numel() as u64;
                        assert!(
                            args.contains(&KArg::U64(n)),
                            "{what}: no element count {n} in {args:?}"
                        );
                        let threads = grid[0] as u64 * block[0] as u64;
                        assert!(threads >= n, "{what}: {threads} threads for {n} elements");
                        assert_eq!(*block, [BLOCK, 1, 1], "{what}");
                    }
                }
                Launch::Gemm(gm) => {
                    check_args(g, *id, nl, &[&gm.a, &gm.b, &gm.c], &what);
                    // Every operand's last matrix ends inside its buffer.
                    for (arg, rows, cols, ld, stride, trans) in [
                        (&gm.a, gm.m, gm.k, gm.lda, gm.stride_a, gm.transa),
                        (&gm.b, gm.k, gm.n, gm.ldb, gm.stride_b, gm.transb),
                        (&gm.c, gm.m, gm.n, gm.ldc, gm.stride_c, false),
                    ] {
                        let (r, c) = if trans { (cols, rows) } else { (rows, cols) };
                        assert!(ld >= r.max(1), "{what}: leading dimension {ld} < {r}");
                        let last =
                            (gm.batch as u64 - 1) * stride + (c as u64 - 1) * ld as u64 + r as u64;
                        let bytes = match arg {
                            KArg::Scratch(k) => nl.scratch_bytes[*k] as u64,
                            other => value_bytes(arg_type(g, *id, other).expect("a buffer")) as u64,
                        };
                        let size = gm.dtype.size() as u64;
                        assert!(
                            size * last <= bytes,
                            "{what}: gemm reads {} bytes of {bytes}",
                            size * last
                        );
                    }
                    if let Op::MatMul {
                        transpose_a,
                        transpose_b,
                    } = &node.op
                    {
                        let a = g.tensor_type(node.inputs[0]).dims().to_vec();
                        let b = g.tensor_type(node.inputs[1]).dims().to_vec();
                        let (m, k) = if *transpose_a {
                            (a[1], a[0])
                        } else {
                            (a[0], a[1])
                        };
                        let n = if *transpose_b { b[0] } else { b[1] };
                        assert_eq!(
                            (gm.m as usize, gm.n as usize, gm.k as usize, gm.batch),
                            (n, m, k, 1),
                            "{what}"
                        );
                        assert_eq!(
                            (gm.transa, gm.transb),
                            (*transpose_b, *transpose_a),
                            "{what}"
                        );
                        assert_eq!(
                            (&gm.a, &gm.b, &gm.c),
                            (&KArg::Input(1), &KArg::Input(0), &KArg::Output(0)),
                            "{what}"
                        );
                    }
                }
                Launch::Memset { buf, bytes } => {
                    check_args(g, *id, nl, &[buf], &what);
                    let have = match buf {
                        KArg::Scratch(k) => nl.scratch_bytes[*k] as u64,
                        other => value_bytes(arg_type(g, *id, other).expect("a buffer")) as u64,
                    };
                    assert!(*bytes <= have, "{what}: memset {bytes} of {have} bytes");
                }
                Launch::Alias { input } => {
                    assert!(matches!(node.op, Op::Reshape { .. }), "{what}");
                    assert_eq!(
                        value_bytes(g.value_type(node.inputs[*input])),
                        value_bytes(&node.outputs[0]),
                        "{what}"
                    );
                }
                Launch::Host => assert!(
                    node.op.is_communication()
                        || node.op.is_sink()
                        || matches!(
                            node.op,
                            Op::Input { .. } | Op::Param { .. } | Op::Shard { .. }
                        ),
                    "{what}: host work for a computing op"
                ),
            }
        }
    }
    checked
}

/// Every example in bf16 and in fp16 (single, and all-reduce with a 16-bit wire):
/// the device plan's launches fit their nodes, a product in 16 bits is one GemmEx of
/// its operands' type, the loss-scaling kernels are there exactly for fp16, and NVRTC
/// compiles the whole source to an sm_90 CUBIN.
#[test]
fn every_example_in_16_bits_generates_and_compiles() {
    let nvrtc = nvrtc_or_skip("every_example_in_16_bits_generates_and_compiles");
    for name in EXAMPLES {
        for (label, precision) in [("bf16", Precision::Bf16), ("fp16", Precision::Fp16)] {
            for (strategy, workers) in [(Strategy::Single, 1), (Strategy::Allreduce, 2)] {
                let opts = CompileOptions {
                    strategy: StrategyConfig {
                        strategy,
                        workers,
                        precision,
                        grad_wire: if workers > 1 {
                            precision
                        } else {
                            Precision::Fp32
                        },
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let what = format!("{name} {label} {strategy:?}");
                let c =
                    compile_file(&example(name), &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
                let g = &c.programs.worker;
                let plan = generate(g).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(check_plan(g, &plan, &what) > 0, "{what}: no launches");
                let gemms_16: usize = plan
                    .nodes
                    .iter()
                    .flat_map(|(_, n)| &n.launches)
                    .filter(|l| matches!(l, Launch::Gemm(gm) if gm.dtype.is_half()))
                    .count();
                let matmuls_16 = g
                    .node_ids()
                    .into_iter()
                    .filter(|&id| {
                        matches!(g.op(id), Op::MatMul { .. })
                            && g.node(id).outputs[0].dense_type().dtype.is_half()
                    })
                    .count();
                assert_eq!(gemms_16, matmuls_16, "{what}: one GemmEx per 16-bit matmul");
                assert_eq!(
                    plan.unscale.is_some(),
                    precision == Precision::Fp16,
                    "{what}: loss-scaling kernels"
                );
                if nvrtc {
                    let cubin =
                        nvrtc::compile_cubin(&plan.source, &format!("{name}.{label}.cu"), "sm_90")
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let mut names: Vec<&str> = plan
                        .nodes
                        .iter()
                        .flat_map(|(_, n)| kernel_names(&n.launches))
                        .collect();
                    if let Some((dense, slices)) = &plan.unscale {
                        names.extend([dense.as_str(), slices.as_str()]);
                    }
                    check_cubin(&cubin, &names, &what);
                }
            }
        }
    }
}

#[test]
fn every_launch_fits_its_node() {
    for name in EXAMPLES {
        for (label, s, workers, servers, fuse) in STRATEGIES {
            let c = compile(name, s, workers, servers, fuse);
            let g = &c.programs.worker;
            let plan = generate(g).unwrap_or_else(|e| panic!("{name} {label}: {e}"));
            assert_eq!(plan.nodes.len(), g.node_count(), "{name} {label}");
            let n = check_plan(g, &plan, &format!("{name} {label}"));
            assert!(n > 0, "{name} {label}: no launches");
            let opt = optimizer_plan(&c);
            for v in &opt.vars {
                for l in &v.launches {
                    if let Launch::Kernel { args, .. } = l {
                        for a in args {
                            if let KArg::Scratch(k) = a {
                                assert!(*k < v.scratch_bytes.len(), "{name} {label} {}", v.name);
                            }
                            if let KArg::Slot(i) = a {
                                assert!(*i < opt.slot_names.len(), "{name} {label} {}", v.name);
                            }
                            assert!(
                                !matches!(a, KArg::Input(_) | KArg::Output(_)),
                                "{name} {label} {}: a graph argument in an update",
                                v.name
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn sparse_updates_touch_a_dense_gradient_only_for_every_rows_rule() {
    let c = compile("sparse_lm.dsl", Strategy::Single, 1, 0, false);
    for spec in [
        OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.0,
        },
        OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.9,
        },
        OptimizerSpec::Adam {
            lr: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    ] {
        let stateful = !matches!(spec, OptimizerSpec::Sgd { momentum: 0.0, .. });
        for lazy in [false, true] {
            let mut c = c.clone();
            c.config.optimizer = spec.clone();
            c.config.lazy_updates = lazy;
            let opt = optimizer_plan(&c);
            let emb = opt.vars.iter().find(|v| v.name == "emb").expect("emb");
            let scratch: usize = emb.scratch_bytes.iter().sum();
            let zeroed = emb
                .launches
                .iter()
                .any(|l| matches!(l, Launch::Memset { .. }));
            if stateful && !lazy {
                // torch.optim's rule: the rows summed into a dense gradient, zeros
                // elsewhere, then the dense update of every row (issue 67, item 4).
                assert!(
                    scratch >= 100_000 * 128 * 4 && zeroed,
                    "{spec:?}: {scratch} bytes of scratch"
                );
            } else {
                // One i32 per table row and per gradient row, never a float per table
                // element.
                assert!(
                    scratch < 100_000 * 128 * 4 / 16 && !zeroed,
                    "{spec:?} (lazy {lazy}): {scratch} bytes of scratch"
                );
            }
            let dense = opt.vars.iter().find(|v| v.name == "w1").expect("w1");
            assert_eq!(dense.launches.len(), 1, "{spec:?}: one fused pass");
        }
    }
}

/// A graph holding every device op the examples do not reach (the softmax family on
/// inner and outer axes, layer norm, dropout, slices joined, summed, masked and
/// sparsified, accumulation, the ZeRO chunkings, strided convolution and pooling).
fn every_op_graph() -> Graph {
    use distc_ir::{Shape, TensorType};
    let mut g = Graph::new("every_op");
    let f = |d: &[usize]| TensorType::f32(d.to_vec());
    let add = |g: &mut Graph, op: Op, ins: Vec<distc_ir::ValueId>| {
        let what = op.to_string();
        g.add(op, ins).unwrap_or_else(|e| panic!("{what}: {e}"))
    };
    let input = |g: &mut Graph, name: &str, ty: TensorType| {
        g.add(
            Op::Input {
                name: name.into(),
                ty,
            },
            vec![],
        )
        .expect("input")
    };
    let x = input(&mut g, "x", f(&[4, 6, 5]));
    let ids = input(&mut g, "ids", TensorType::i32(vec![4, 3]));
    let table = input(&mut g, "table", f(&[50, 8]));
    let gamma = input(&mut g, "gamma", f(&[5]));
    let img = input(&mut g, "img", f(&[2, 3, 9, 9]));
    let k = input(&mut g, "k", f(&[4, 3, 3, 3]));
    let one = add(
        &mut g,
        Op::Constant {
            value: 1.0,
            ty: f(&[]),
        },
        vec![],
    );
    let mut sinks = Vec::new();
    for op in [
        Op::Softmax { axis: 1 },
        Op::LogSoftmax { axis: 2 },
        Op::Exp,
        Op::Sigmoid,
        Op::Neg,
        Op::Dropout {
            rate: 0.25,
            seed: 9,
            per_sample: true,
        },
        Op::DropoutGrad {
            rate: 0.5,
            seed: 2,
            per_sample: false,
        },
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        Op::Slice {
            axis: 1,
            start: 2,
            end: 5,
        },
        Op::Sum {
            axes: vec![0, 2],
            keep_dims: true,
        },
        Op::Mean {
            axes: vec![1],
            keep_dims: false,
        },
        Op::TakeChunk { workers: 3 },
        Op::SumTo {
            shape: Shape(vec![6, 1]),
        },
    ] {
        sinks.push(add(&mut g, op, vec![x.into()]));
    }
    let sm = add(&mut g, Op::Softmax { axis: 0 }, vec![x.into()]);
    sinks.push(add(
        &mut g,
        Op::SoftmaxGrad { axis: 0 },
        vec![x.into(), sm.into()],
    ));
    sinks.push(add(
        &mut g,
        Op::LogSoftmaxGrad { axis: 2 },
        vec![x.into(), sm.into()],
    ));
    sinks.push(add(&mut g, Op::Div, vec![x.into(), gamma.into()]));
    sinks.push(add(&mut g, Op::Sub, vec![gamma.into(), x.into()]));
    sinks.push(add(&mut g, Op::Mse, vec![x.into(), sm.into()]));
    sinks.push(add(
        &mut g,
        Op::MseGrad,
        vec![one.into(), x.into(), sm.into()],
    ));
    let beta = add(&mut g, Op::Exp, vec![gamma.into()]);
    sinks.push(add(
        &mut g,
        Op::LayerNorm { eps: 1e-5 },
        vec![x.into(), gamma.into(), beta.into()],
    ));
    let lng = add(
        &mut g,
        Op::LayerNormGrad { eps: 1e-5 },
        vec![x.into(), sm.into(), gamma.into()],
    );
    sinks.extend([lng.out(0), lng.out(1), lng.out(2)].map(|v| v.node));
    sinks.push(add(
        &mut g,
        Op::Concat { axis: 1 },
        vec![x.into(), sm.into()],
    ));
    sinks.push(add(
        &mut g,
        Op::BroadcastTo {
            shape: Shape(vec![3, 4, 6, 5]),
        },
        vec![x.into()],
    ));
    let packed = add(
        &mut g,
        Op::PackChunks { workers: 2 },
        vec![x.into(), gamma.into()],
    );
    sinks.push(add(
        &mut g,
        Op::UnpackChunks {
            workers: 2,
            shapes: vec![Shape(vec![4, 6, 5]), Shape(vec![5])],
        },
        vec![packed.into()],
    ));
    let flat = add(&mut g, Op::Pack, vec![x.into(), gamma.into()]);
    sinks.push(add(
        &mut g,
        Op::Unpack {
            shapes: vec![Shape(vec![120]), Shape(vec![5])],
        },
        vec![flat.into()],
    ));
    sinks.push(add(&mut g, Op::Accumulate { micro: 4 }, vec![x.into()]));
    // Slices.
    let rows = add(&mut g, Op::Embedding, vec![table.into(), ids.into()]);
    let s1 = add(
        &mut g,
        Op::EmbeddingGrad { table: f(&[50, 8]) },
        vec![rows.into(), ids.into()],
    );
    let s2 = add(&mut g, Op::ConcatSlices, vec![s1.into(), s1.into()]);
    sinks.push(add(&mut g, Op::UniqueRows, vec![s2.into()]));
    sinks.push(add(&mut g, Op::Densify, vec![s2.into()]));
    sinks.push(add(&mut g, Op::Accumulate { micro: 2 }, vec![s2.into()]));
    let mask = add(&mut g, Op::RowMask, vec![s2.into()]);
    sinks.push(add(&mut g, Op::Sparsify, vec![table.into(), mask.into()]));
    // Strided convolution and overlapping pooling.
    let conv = add(
        &mut g,
        Op::Conv2d {
            stride: 2,
            padding: 0,
        },
        vec![img.into(), k.into()],
    );
    sinks.push(add(
        &mut g,
        Op::Conv2dGradInput {
            stride: 2,
            padding: 0,
            input: Shape(vec![2, 3, 9, 9]),
        },
        vec![conv.into(), k.into()],
    ));
    sinks.push(add(
        &mut g,
        Op::Conv2dGradFilter {
            stride: 2,
            padding: 0,
            filter: Shape(vec![4, 3, 3, 3]),
        },
        vec![conv.into(), img.into()],
    ));
    let pool = add(
        &mut g,
        Op::MaxPool2d {
            kernel: 3,
            stride: 2,
        },
        vec![img.into()],
    );
    sinks.push(add(
        &mut g,
        Op::MaxPool2dGrad {
            kernel: 3,
            stride: 2,
        },
        vec![pool.into(), img.into()],
    ));
    for (i, s) in sinks.into_iter().enumerate() {
        add(
            &mut g,
            Op::Output {
                name: format!("o{i}"),
            },
            vec![s.into()],
        );
    }
    g
}

#[test]
fn ops_beyond_the_examples_generate_consistent_launches_and_compile() {
    let g = every_op_graph();
    let plan = generate(&g).unwrap_or_else(|e| panic!("{e}"));
    let n = check_plan(&g, &plan, "every_op");
    assert!(n > 40, "{n} launches");
    let acc = plan
        .nodes
        .iter()
        .filter(|(id, _)| matches!(g.op(*id), Op::Accumulate { .. }))
        .count();
    assert_eq!(acc, 2);
    assert!(plan
        .nodes
        .iter()
        .filter(|(id, _)| matches!(g.op(*id), Op::Accumulate { .. }))
        .all(|(_, nl)| !nl.step_start.is_empty()));
    if !nvrtc_or_skip("ops_beyond_the_examples_generate_consistent_launches_and_compile") {
        return;
    }
    let cubin = nvrtc::compile_cubin(&plan.source, "every_op.cu", "sm_90")
        .unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<&str> = plan
        .nodes
        .iter()
        .flat_map(|(_, nl)| kernel_names(&nl.launches))
        .collect();
    check_cubin(&cubin, &names, "every_op");
}

#[test]
fn f64_graphs_are_refused_by_name() {
    let mut g = Graph::new("f64");
    let x = g
        .add(
            Op::Input {
                name: "x".into(),
                ty: distc_ir::TensorType::new(distc_ir::DType::F64, vec![3]),
            },
            vec![],
        )
        .expect("input");
    g.add(Op::Relu, vec![x.into()]).expect("relu");
    // The first node holding an f64 value is named: here the feed itself.
    match generate(&g) {
        Err(distc_runtime::cuda::codegen::CodegenError::Unsupported { node, op, reason }) => {
            assert_eq!((node, op), (x, "input"));
            assert!(reason.contains("f64"), "{reason}");
        }
        other => panic!("expected an unsupported-op error, got {other:?}"),
    }
}

/// The emulator's cuBLAS refuses what cuBLAS refuses and names a product that would
/// reach past a buffer: the row-major call issued as if cuBLAS were row-major (the
/// classic swap) is caught, on a non-square product where the swap matters.
#[test]
fn the_emulated_gemm_catches_a_row_major_swap() {
    let (m, n, k) = (3, 5, 4);
    let g = Gemm::row_major(
        (KArg::Input(0), false),
        (KArg::Input(1), false),
        KArg::Output(0),
        (m, n, k),
        1,
        (0, 0, 0),
    )
    .expect("fits");
    let (x, w) = (vec![1.0f32; m * k], vec![1.0f32; k * n]);
    let mut y = vec![0.0f32; m * n];
    let right = SgemmCall::of(&g);
    sgemm_strided_batched(&right, &w, &x, &mut y).expect("the mapped call fits");
    // Operands in row-major order, dimensions unswapped: cuBLAS's A is then x.
    let swapped = SgemmCall {
        m,
        n,
        k,
        lda: k,
        ldb: n,
        ldc: n,
        ..right
    };
    let e = sgemm_strided_batched(&swapped, &x, &w, &mut y).expect_err("caught");
    assert!(e.contains("lda") || e.contains("reaches element"), "{e}");
    let bad_ld = SgemmCall { ldc: 1, ..right };
    let e = sgemm_strided_batched(&bad_ld, &w, &x, &mut y).expect_err("refused");
    assert!(e.contains("CUBLAS_STATUS_INVALID_VALUE"), "{e}");
}
