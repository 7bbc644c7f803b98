//! The text IR round-trips (print then parse gives an equal graph), on generated
//! graphs covering every op family; the parser and the verifier locate their errors.

use distc_ir::{
    parse, print, verify, BinaryFn, DType, FusedExpr, FusedStep, Graph, Init, Op, Shape,
    TensorType, UnaryFn, ValueId,
};
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;

fn roundtrip(g: &Graph) {
    let text = print(g);
    let back = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    verify(&back).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(&back, g, "graph differs after parse:\n{text}");
    assert_eq!(print(&back), text);
}

/// A random expression over `inputs` inputs, in canonical form (steps a graph cannot
/// reach are dropped, so some read fewer inputs and the shape rule refuses them).
fn random_expr(rng: &mut Pcg64, inputs: usize) -> FusedExpr {
    let mut steps: Vec<FusedStep> = (0..inputs).map(FusedStep::Input).collect();
    steps.push(FusedStep::Const(
        [1.0, -0.5, 1e-8, 3.25][rng.random_range(0..4)],
    ));
    for _ in 0..rng.random_range(1..8) {
        let n = steps.len();
        let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
        steps.push(if rng.random() {
            FusedStep::Unary(UnaryFn::ALL[rng.random_range(0..UnaryFn::ALL.len())], a)
        } else {
            FusedStep::Binary(
                BinaryFn::ALL[rng.random_range(0..BinaryFn::ALL.len())],
                a,
                b,
            )
        });
    }
    FusedExpr { steps }.canonical()
}

/// A random graph: sources, then a chain of ops chosen among those whose shape rule
/// accepts the operands at hand.
fn random_graph(seed: u64) -> Graph {
    let mut rng = Pcg64::seed_from_u64(seed);
    let mut g = Graph::new(format!("random{seed}"));
    let mut vals: Vec<ValueId> = Vec::new();
    let dims = [2usize, 3, 4];
    for i in 0..4 {
        let shape: Vec<usize> = (0..rng.random_range(1..=3))
            .map(|_| dims[rng.random_range(0..3)])
            .collect();
        let op = match i % 3 {
            0 => Op::Param {
                name: format!("p{i}"),
                ty: TensorType::f32(shape),
                init: [
                    Init::Glorot,
                    Init::Uniform { lo: -0.1, hi: 0.1 },
                    Init::Normal {
                        mean: 0.0,
                        std: 1e-3,
                    },
                ][i % 3]
                    .clone(),
                // Some frozen, so the text format's flag round-trips.
                frozen: i % 4 == 0,
            },
            1 => Op::Input {
                name: format!("x{i}"),
                ty: TensorType::f32(shape),
            },
            _ => Op::Constant {
                value: 0.1 * i as f64,
                ty: TensorType::f32(shape),
            },
        };
        vals.push(g.add(op, vec![]).expect("source").into());
    }
    let ids = g
        .add(
            Op::Input {
                name: "ids".into(),
                ty: TensorType::new(DType::I32, vec![2, 3]),
            },
            vec![],
        )
        .expect("ids");
    let table = g
        .add(
            Op::Param {
                name: "table".into(),
                ty: TensorType::f32(vec![10, 4]),
                init: Init::Zeros,
                frozen: false,
            },
            vec![],
        )
        .expect("table");
    let e = g
        .add(Op::Embedding, vec![table.into(), ids.into()])
        .expect("embedding");
    vals.push(e.into());
    let mut tries = 0;
    while g.node_count() < 30 && tries < 2000 {
        tries += 1;
        let a = vals[rng.random_range(0..vals.len())];
        let b = vals[rng.random_range(0..vals.len())];
        let ta = g.tensor_type(a).clone();
        let rank = ta.shape.rank();
        let op = match rng.random_range(0..15) {
            0 => Op::Add,
            1 => Op::Mul,
            2 => Op::MatMul {
                transpose_a: rng.random(),
                transpose_b: rng.random(),
            },
            3 => Op::Relu,
            4 => Op::Tanh,
            5 => Op::Softmax {
                axis: rng.random_range(0..rank.max(1)),
            },
            6 => Op::Sum {
                axes: vec![0],
                keep_dims: rng.random(),
            },
            7 => Op::Reshape {
                shape: Shape(vec![ta.shape.numel()]),
            },
            8 => Op::Transpose {
                perm: (0..rank).rev().collect(),
            },
            9 => Op::Concat { axis: 0 },
            10 => Op::Slice {
                axis: 0,
                start: 0,
                end: 1,
            },
            11 => Op::Dropout {
                rate: 0.25,
                seed: 7,
                per_sample: true,
            },
            12 => Op::LayerNorm { eps: 1e-5 },
            13 => Op::Fused {
                expr: random_expr(&mut rng, 2),
            },
            _ => Op::Sub,
        };
        let inputs = match op.arity() {
            Some(1) => vec![a],
            Some(2) => vec![a, b],
            Some(3) => {
                let last = *ta.dims().last().unwrap_or(&1);
                let gm = g
                    .add(
                        Op::Param {
                            name: format!("gamma{}", g.node_count()),
                            ty: TensorType::f32(vec![last]),
                            init: Init::Ones,
                            frozen: false,
                        },
                        vec![],
                    )
                    .expect("gamma");
                vec![a, gm.into(), gm.into()]
            }
            _ => vec![a, b],
        };
        if let Ok(id) = g.add(op, inputs) {
            vals.push(id.into());
        }
    }
    let last = *vals.last().expect("values");
    g.add(Op::Output { name: "y".into() }, vec![last])
        .expect("output");
    g
}

#[test]
fn generated_graphs_round_trip() {
    for seed in 0..200 {
        let g = random_graph(seed);
        verify(&g).expect("generated graphs verify");
        roundtrip(&g);
    }
}

#[test]
fn multi_output_and_sparse_values_round_trip() {
    let text = r#"graph t {
  %0 = input{name="ids"} : i32[4]
  %1 = param{name="emb", init=uniform(-0.05, 0.05)} : f32[100,8]
  %2 = embedding %1, %0 : f32[4,8]
  %3 = param{name="g", init=ones} : f32[8]
  %4 = layer_norm{eps=1e-5} %2, %3, %3 : f32[4,8]
  %5 = layer_norm_grad{eps=1e-5} %4, %2, %3 : (f32[4,8], f32[8], f32[8])
  %6 = embedding_grad{table=f32[100,8]} %5, %0 : indexed_slices(f32[100,8], nnz=4)
  %7 = concat_slices %6, %6 : indexed_slices(f32[100,8], nnz=8)
  param_grad{param="emb"} %7
  param_grad{param="g"} %5#1
}
"#;
    let g = parse(text).expect("parses");
    verify(&g).expect("verifies");
    assert_eq!(print(&g), text);
    roundtrip(&g);
}

#[test]
fn parse_errors_are_located() {
    let cases = [
        (
            "graph g {\n  %0 = frobnicate : f32[2]\n}\n",
            "2:8",
            "unknown op `frobnicate`",
        ),
        (
            "graph g {\n  %0 = relu %3 : f32[2]\n}\n",
            "2:13",
            "%3 is used before it is defined",
        ),
        (
            "graph g {\n  %0 = input{name=\"x\"} : f32[2]\n  %0 = relu %0 : f32[2]\n}\n",
            "3:3",
            "defined twice",
        ),
        (
            "graph g {\n  %0 = param{name=\"w\"} : f32[2]\n}\n",
            "2:8",
            "missing attribute `init`",
        ),
        (
            "graph g {\n  %0 = input{name=\"x\"} : f32[2\n}\n",
            "2:29",
            "a shape like [2,3]",
        ),
        ("graph g {\n  loss\n", "3:1", ""),
    ];
    for (text, loc, msg) in cases {
        let e = parse(text).expect_err(text);
        assert_eq!(format!("{}:{}", e.line, e.col), loc, "{e} for\n{text}");
        assert!(e.message.contains(msg), "{e} lacks {msg:?}");
    }
}

#[test]
fn verifier_collects_every_error() {
    let text = r#"graph bad {
  %0 = input{name="x"} : f32[4,3]
  %1 = param{name="w", init=glorot} : f32[5,2]
  %2 = matmul %0, %1 : f32[4,2]
  %3 = relu %0 : f32[4,4]
  param_grad{param="nope"} %3
}
"#;
    let g = parse(text).expect("parses");
    let e = verify(&g).expect_err("invalid");
    assert_eq!(e.errors.len(), 3, "{e}");
    assert!(
        e.errors[0].contains("matmul: inner dimensions differ"),
        "{e}"
    );
    assert!(e.errors[0].starts_with("%2 (%2 = matmul %0, %1"), "{e}");
    assert!(
        e.errors[1].contains("result types should be f32[4,3]"),
        "{e}"
    );
    assert!(
        e.errors[2].contains("`nope`, which is not a variable"),
        "{e}"
    );
}

#[test]
fn fused_nodes_round_trip() {
    let text = r#"graph f {
  %0 = input{name="x"} : f32[4,8]
  %1 = param{name="b", init=zeros} : f32[8]
  %2 = fused{expr="relu(add(in0, in1))"} %0, %1 : f32[4,8]
  %3 = fused{expr="t0 = mul(in0, 1e-8); t1 = sigmoid(t0); add(mul(t1, sub(-0.5, t1)), exp(t0))"} %2 : f32[4,8]
  %4 = fused{expr="mul(mul(in0, in1), sub(1.0, in1))"} %3, %2 : f32[4,8]
  output{name="y"} %4
}
"#;
    let g = parse(text).unwrap_or_else(|e| panic!("{e}"));
    verify(&g).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(print(&g), text);
    roundtrip(&g);
    let id = g.node_ids()[3];
    let Op::Fused { expr } = g.op(id) else {
        panic!("{}", g.op(id))
    };
    // t0 and t1 are each one step, read twice.
    assert_eq!(expr.steps.len(), 9, "{expr:?}");
}

#[test]
fn fused_text_is_canonical() {
    let mut rng = Pcg64::seed_from_u64(10);
    for _ in 0..500 {
        let raw = {
            let mut steps: Vec<FusedStep> = vec![FusedStep::Input(1), FusedStep::Input(0)];
            for _ in 0..rng.random_range(1..10) {
                let n = steps.len();
                let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
                steps.push(match rng.random_range(0..3) {
                    0 => FusedStep::Unary(UnaryFn::ALL[rng.random_range(0..7)], a),
                    1 => FusedStep::Const(rng.random_range(-2.0..2.0)),
                    _ => FusedStep::Binary(BinaryFn::ALL[rng.random_range(0..4)], a, b),
                });
            }
            FusedExpr { steps }
        };
        let canonical = raw.canonical();
        assert_eq!(canonical.canonical(), canonical, "{raw:?}");
        let back: FusedExpr = raw
            .to_string()
            .parse()
            .unwrap_or_else(|e| panic!("{e}: {raw}"));
        assert_eq!(back, canonical, "{raw}");
        assert_eq!(back.to_string(), raw.to_string());
    }
}

#[test]
fn fused_errors_name_the_problem() {
    let node = |expr: &str, ins: &str| {
        format!(
            "graph f {{\n  %0 = input{{name=\"x\"}} : f32[4]\n  %1 = input{{name=\"z\"}} : f64[4]\n  %2 = fused{{expr=\"{expr}\"}} {ins} : f32[4]\n  output{{name=\"y\"}} %2\n}}\n"
        )
    };
    let parse_err = |expr: &str| parse(&node(expr, "%0")).expect_err("refused").to_string();
    let e = parse_err("cube(in0)");
    assert!(
        e.contains("unknown function `cube`") && e.contains("sigmoid"),
        "{e}"
    );
    let e = parse_err("add(in0)");
    assert!(e.contains("expected `,`"), "{e}");
    let e = parse_err("relu(t3)");
    assert!(e.contains("`t3`"), "{e}");
    let e = parse_err("relu(in0) extra");
    assert!(e.contains("unexpected text"), "{e}");
    let e = parse_err("add(in0, 1.2.3)");
    assert!(e.contains("not a number"), "{e}");
    // Well-formed text the shape rule refuses: an input out of range, an input never
    // read, dtypes that differ.
    let verify_err = |expr: &str, ins: &str| {
        let g = parse(&node(expr, ins)).unwrap_or_else(|e| panic!("{e}"));
        verify(&g).expect_err("refused").to_string()
    };
    let e = verify_err("add(in0, in1)", "%0");
    assert!(e.contains("reads input 1") && e.contains("fused"), "{e}");
    let e = verify_err("relu(in0)", "%0, %0");
    assert!(e.contains("input 1 is never read"), "{e}");
    let e = verify_err("add(in0, in1)", "%0, %1");
    assert!(e.contains("dtypes differ"), "{e}");
}

/// Issue 20 (found by the plan fuzzer): a dimension of 2^63-1 in a plan's text IR
/// overflowed the element count in shape inference and panicked; types, row-sparse
/// types and shape attributes beyond 2^48 elements are refused by the parser, naming
/// the line.
#[test]
fn sizes_beyond_the_element_limit_are_refused_when_parsed() {
    for text in [
        "graph g {\n  %0 = input{name=\"x\"} : f32[9223372036854775807, 128]\n}\n",
        "graph g {\n  %0 = input{name=\"x\"} : f32[4, 4]\n  %1 = reshape{shape=[4294967296, 4294967296]} %0 : f32[16]\n}\n",
        "graph g {\n  %0 = input{name=\"x\"} : indexed_slices(f32[4, 65536], nnz=9223372036854775807)\n}\n",
    ] {
        let e = distc_ir::parse(text).expect_err("refused").to_string();
        assert!(e.contains("more than 2^48 elements"), "{e}");
    }
}

/// Issue 20 (found by the plan fuzzer): `workers=2^63-1` on `pack_chunks` /
/// `unpack_chunks` overflowed the chunk count in shape inference; a `workers`
/// attribute is 1 to 2^20, refused by the parser otherwise.
#[test]
fn worker_counts_beyond_the_limit_are_refused_when_parsed() {
    let text = "graph g {\n  %0 = param{name=\"w\", init=zeros} : f32[12]\n  %1 = unpack_chunks{workers=9223372036854775807, shape=[4], shape=[4], shape=[4]} %0 : (f32[4], f32[4], f32[4])\n}\n";
    let e = distc_ir::parse(text).expect_err("refused").to_string();
    assert!(e.contains("`workers` must be 1 to 1048576"), "{e}");
}
