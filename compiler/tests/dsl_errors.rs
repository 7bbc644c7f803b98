//! The DSL front end: every file in `bad_dsl/` fails with a snapshotted diagnostic;
//! good programs lower to verified graphs; no input makes the front end panic.

use distc::dsl::{compile_source, Program};
use distc_ir::{verify, DType, Graph, Init, Op, ValueId};
use distc_runtime::{DataSpec, OptimizerSpec};

/// A small MLP on synthetic data, valid.
const MLP: &str = "\
# A small MLP on synthetic data.
model mlp {
  input x:     f32[B, 20]
  input label: i32[B]

  param w1: f32[20, 32] = glorot
  param b1: f32[32]     = zeros   // a comment in the other style
  param w2: f32[32, 4]  = normal(0, 0.1)
  param b2: f32[4]      = zeros

  h      = relu(x @ w1 + b1)
  logits = h @ w2 + b2
  minimize softmax_cross_entropy(logits, label)
}

train {
  data      = gaussian_classes(features = 20, classes = 4)
  batch     = 64
  optimizer = adam(lr = 0.01, beta2 = 0.99)
  steps     = 100
  seed      = 5
  eval_every = 50
}
";

fn compile(src: &str) -> Program {
    match compile_source("test.dsl", src, None) {
        Ok(p) => p,
        Err(e) => panic!("expected the program to compile:\n{}", e.render_plain()),
    }
}

fn op_of(g: &Graph, v: ValueId) -> &Op {
    g.op(v.node)
}

fn inputs_of(g: &Graph, v: ValueId) -> Vec<ValueId> {
    g.node(v.node).inputs.clone()
}

#[test]
fn bad_programs() {
    insta::glob!("bad_dsl/*.dsl", |path| {
        let bytes = std::fs::read(path).expect("readable test file");
        let src = String::from_utf8_lossy(&bytes);
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("bad.dsl");
        let err = match compile_source(name, &src, None) {
            Ok(_) => panic!("{name} should not compile"),
            Err(e) => e,
        };
        insta::assert_snapshot!(err.render_plain());
    });
}

#[test]
fn mlp_lowers_and_verifies() {
    let p = compile(MLP);
    let g = &p.graph;
    assert_eq!(g.name, "mlp");
    verify(g).expect("the lowered graph verifies");
    assert_eq!(p.batch_symbol_value, 64);

    let params: Vec<(&str, Vec<usize>)> = g
        .params()
        .iter()
        .map(|(_, n, t)| (*n, t.dims().to_vec()))
        .collect();
    assert_eq!(
        params,
        vec![
            ("w1", vec![20, 32]),
            ("b1", vec![32]),
            ("w2", vec![32, 4]),
            ("b2", vec![4])
        ]
    );
    let w2_init = g.params().iter().find_map(|(id, n, _)| {
        (*n == "w2").then(|| match g.op(*id) {
            Op::Param { init, .. } => init.clone(),
            _ => Init::Zeros,
        })
    });
    assert_eq!(
        w2_init,
        Some(Init::Normal {
            mean: 0.0,
            std: 0.1
        })
    );

    let inputs: Vec<(&str, DType, Vec<usize>)> = g
        .inputs()
        .iter()
        .map(|(_, n, t)| (*n, t.dtype, t.dims().to_vec()))
        .collect();
    assert_eq!(
        inputs,
        vec![
            ("x", DType::F32, vec![64, 20]),
            ("label", DType::I32, vec![64])
        ]
    );

    let loss = g.loss().expect("a loss");
    assert!(matches!(op_of(g, loss), Op::SoftmaxCrossEntropy));
    assert!(g.tensor_type(loss).dims().is_empty());
    let outputs = g.outputs();
    let names: Vec<&str> = outputs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, vec!["prediction", "target"]);
    let sce_inputs = inputs_of(g, loss);
    assert_eq!(outputs[0].1, sce_inputs[0], "prediction is the logits");
    assert_eq!(outputs[1].1, sce_inputs[1], "target is the labels");

    let c = &p.config;
    assert_eq!(
        c.data,
        DataSpec::GaussianClasses {
            features: 20,
            classes: 4
        }
    );
    assert_eq!(
        c.optimizer,
        OptimizerSpec::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    );
    assert_eq!(
        (c.batch, c.steps, c.seed, c.eval_every, c.eval_samples),
        (64, 100, 5, 50, None)
    );
}

/// Issue 67, item 4: `lazy = true` asks for TensorFlow's LazyAdam rule on row-sparse
/// gradients; without it the update is torch.optim's (every row). LARS and LAMB have
/// no lazy rule, and say so.
#[test]
fn the_optimizers_lazy_flag() {
    assert!(!compile(MLP).config.lazy_updates);
    for (optimizer, lazy) in [
        ("adam(lr = 0.01, beta2 = 0.99, lazy = true)", true),
        ("adamw(lr = 0.01, lazy = false)", false),
        ("sgd(lr = 0.1, momentum = 0.9, lazy = true)", true),
    ] {
        let src = MLP.replace("adam(lr = 0.01, beta2 = 0.99)", optimizer);
        assert_eq!(compile(&src).config.lazy_updates, lazy, "{optimizer}");
    }
    for (optimizer, says) in [
        (
            "adam(lr = 0.01, lazy = 1)",
            "`lazy` must be `true` or `false`",
        ),
        ("lamb(lr = 0.01, lazy = true)", "lazy"),
    ] {
        let src = MLP.replace("adam(lr = 0.01, beta2 = 0.99)", optimizer);
        let e = match compile_source("test.dsl", &src, None) {
            Ok(_) => panic!("{optimizer} compiled"),
            Err(e) => e.render_plain(),
        };
        assert!(
            e.contains(says) && e.contains("test.dsl:"),
            "{optimizer}: {e}"
        );
    }
}

#[test]
fn batch_override_binds_b_only() {
    let p = compile_source("test.dsl", MLP, Some(256)).expect("compiles");
    assert_eq!(p.batch_symbol_value, 256);
    assert_eq!(
        p.config.batch, 64,
        "the train block's per-worker batch is kept"
    );
    let dims: Vec<Vec<usize>> = p
        .graph
        .inputs()
        .iter()
        .map(|(_, _, t)| t.dims().to_vec())
        .collect();
    assert_eq!(dims, vec![vec![256, 20], vec![256]]);
    verify(&p.graph).expect("verifies");
}

#[test]
fn operator_precedence() {
    let src = "\
model prec {
  input x: f32[B, 4]
  param b: f32[1, 4] = glorot
  param c: f32[4, 4] = glorot
  param d: f32[4]    = ones
  y = x + b @ c * d
  z = y - 1 - x          # left-associative: (y - 1) - x
  minimize mean(-z * 2)
}
train { data = gaussian_classes(features = 4, classes = 2)  batch = 8  optimizer = sgd(lr = 0.1)  steps = 1 }
";
    let p = compile(src);
    let g = &p.graph;
    verify(g).expect("verifies");
    // Find y = x + ((b @ c) * d).
    let add = g
        .node_ids()
        .into_iter()
        .find(|&id| matches!(g.op(id), Op::Add))
        .expect("an add");
    let ins = &g.node(add).inputs;
    assert!(matches!(op_of(g, ins[0]), Op::Input { name, .. } if name == "x"));
    assert!(
        matches!(op_of(g, ins[1]), Op::Mul),
        "rhs of + is the product"
    );
    let mul = inputs_of(g, ins[1]);
    assert!(
        matches!(op_of(g, mul[0]), Op::MatMul { .. }),
        "lhs of * is b @ c"
    );
    assert!(matches!(op_of(g, mul[1]), Op::Param { name, .. } if name == "d"));
    let mm = inputs_of(g, mul[0]);
    assert!(matches!(op_of(g, mm[0]), Op::Param { name, .. } if name == "b"));
    assert!(matches!(op_of(g, mm[1]), Op::Param { name, .. } if name == "c"));
    // z = (y - 1) - x: the outer sub reads the inner sub and x.
    let subs: Vec<_> = g
        .node_ids()
        .into_iter()
        .filter(|&id| matches!(g.op(id), Op::Sub))
        .collect();
    assert_eq!(subs.len(), 2);
    let outer = g.node(subs[1]);
    assert_eq!(outer.inputs[0].node, subs[0]);
    assert!(matches!(op_of(g, outer.inputs[1]), Op::Input { .. }));
    let inner = g.node(subs[0]);
    assert!(
        matches!(op_of(g, inner.inputs[1]), Op::Constant { value, ty } if *value == 1.0 && ty.dims().is_empty() && ty.dtype == DType::F32)
    );
    // A mean of all axes: no prediction output for a loss that is not a known loss op.
    assert!(g.outputs().is_empty());
    assert!(
        matches!(op_of(g, g.loss().expect("loss")), Op::Mean { axes, keep_dims: false } if axes == &vec![0, 1])
    );
}

#[test]
fn every_op_lowers() {
    let src = "\
model all_ops {
  input image: f32[B, 1, 28, 28]
  input label: i32[B]
  param k:  f32[4, 1, 3, 3] = he
  param g:  f32[16]         = ones
  param bt: f32[16]         = zeros
  param w:  f32[784, 10]    = uniform(-0.1, 0.1)
  c  = max_pool2d(conv2d(image, k, stride = 1, padding = 1), kernel = 2)      # [B, 4, 14, 14]
  p  = max_pool2d(c, 2, 2)                                                    # [B, 4, 7, 7]
  f  = reshape(p, [B, -1])                                                    # [B, 196]
  f2 = concat([f, f], axis = 1)                                               # [B, 392]
  f4 = concat(f2, f2, axis = -1)                                              # [B, 784]
  s  = slice(f4, axis = 1, start = 0, end = 16)
  n  = layer_norm(s, g, bt, eps = 1e-3)
  t  = transpose(transpose(n), [1, 0])
  a  = sigmoid(t) + tanh(t) - exp(neg(t)) * log(softmax(t) + 1) / log_softmax(t, axis = 0)
  r  = dropout(relu(a), rate = 0.1) + dropout(a)
  m  = sum(r, axes = [1], keep_dims = true) + mean(r, [0, 1])
  logits = matmul(reshape(image, [B, 784]), w, transpose_b = false) + m
  minimize softmax_cross_entropy(logits, label)
}
train { data = mnist()  batch = 2  optimizer = sgd(lr = 0.1, momentum = 0.9)  steps = 1  seed = 3 }
";
    let p = compile(src);
    verify(&p.graph).expect("verifies");
    let seeds: Vec<u64> = p
        .graph
        .node_ids()
        .into_iter()
        .filter_map(|id| match p.graph.op(id) {
            Op::Dropout { seed, .. } => Some(*seed),
            _ => None,
        })
        .collect();
    assert_eq!(
        seeds,
        vec![3000, 3001],
        "dropout seeds are seed * 1000 + index"
    );
}

#[test]
fn mse_outputs_prediction_and_target() {
    let src = "\
model rec {
  input user: i32[B]
  input item: i32[B]
  input rating: f32[B]
  param u: f32[10, 4] = normal(0, 0.1)
  param i: f32[10, 4] = normal(0, 0.1)
  pred = sum(embedding(u, user) * embedding(i, item), axes = [-1]) + 2.5
  loss = mse(pred, rating)
  minimize loss
}
train { data = movielens()  batch = 8  optimizer = sgd(lr = 0.1)  steps = 1 }
";
    let p = compile(src);
    let g = &p.graph;
    verify(g).expect("verifies");
    let loss = g.loss().expect("loss");
    let ins = inputs_of(g, loss);
    let outs = g.outputs();
    assert_eq!(outs.len(), 2);
    assert_eq!((outs[0].0.as_str(), outs[0].1), ("prediction", ins[0]));
    assert_eq!((outs[1].0.as_str(), outs[1].1), ("target", ins[1]));
    assert_eq!(p.config.data, DataSpec::Movielens { test_fraction: 0.1 });
}

#[test]
fn examples_compile() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        eprintln!("skipping: no examples directory at {}", dir.display());
        return;
    };
    let mut n = 0;
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("dsl") {
            continue;
        }
        let src = std::fs::read_to_string(&path).expect("readable example");
        let name = path.display().to_string();
        match compile_source(&name, &src, None) {
            Ok(p) => verify(&p.graph).unwrap_or_else(|e| panic!("{name}: {e}")),
            Err(e) => panic!("{name} does not compile:\n{}", e.render_plain()),
        }
        n += 1;
    }
    assert!(n > 0, "no examples found in {}", dir.display());
}

#[test]
fn rendering_is_rustc_style() {
    let src = "model m {\n  input x: f32[B, 20]\n  param w: f32[21, 4] = glorot\n  minimize mean(x @ w)\n}\ntrain { data = gaussian_classes(features = 20, classes = 4)  batch = 8  optimizer = sgd(lr = 0.1)  steps = 1 }\n";
    let err = compile_source("m.dsl", src, None).expect_err("inner dims differ");
    assert_eq!(
        err.render_plain(),
        "\
error: shape mismatch in matmul: inner dimensions differ: f32[8,20] @ f32[21,4] (20 vs 21)
 --> m.dsl:4:19
  |
4 |   minimize mean(x @ w)
  |                   ^ f32[8,20] @ f32[21,4]
"
    );
    assert_eq!(err.line_col(), (4, 19));
    // The miette side: source, one labelled span.
    use miette::Diagnostic;
    assert!(err.source_code().is_some());
    assert_eq!(err.labels().map(|l| l.count()), Some(1));
}

/// Every prefix of a valid program (on char boundaries) compiles or fails cleanly.
#[test]
fn prefixes_never_panic() {
    let src = format!("{MLP}# ünïcödé ✨ tail\n");
    let mut errors = 0;
    for (i, _) in src.char_indices().chain(std::iter::once((src.len(), ' '))) {
        if compile_source("prefix.dsl", &src[..i], None).is_err() {
            errors += 1;
        }
    }
    assert!(errors > 0);
}

/// A small deterministic generator (no dependency needed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn random_input_never_panics() {
    let mut rng = Lcg(0x5eed);
    // Random bytes, read as a file would be (lossy UTF-8).
    for _ in 0..300 {
        let len = rng.below(200);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let src = String::from_utf8_lossy(&bytes);
        let _ = compile_source("junk.dsl", &src, None)
            .map(|_| ())
            .map_err(|e| e.render_plain());
    }
    // Token soup: likelier to get deep into the parser and the lowering.
    let tokens = [
        "model",
        "train",
        "input",
        "param",
        "minimize",
        "{",
        "}",
        "(",
        ")",
        "[",
        "]",
        ",",
        "=",
        ":",
        "+",
        "-",
        "*",
        "/",
        "@",
        "B",
        "x",
        "label",
        "w",
        "f32",
        "i32",
        "[B, 20]",
        "0",
        "-1",
        "1e999",
        "99999999999999999999999",
        "relu",
        "reshape",
        "concat",
        "sum",
        "softmax_cross_entropy",
        "mse",
        "glorot",
        "uniform(-1, 1)",
        "data",
        "batch",
        "steps",
        "optimizer",
        "sgd(lr = 0.1)",
        "mnist()",
        "gaussian_classes(features = 20, classes = 4)",
        "\n",
        "# c\n",
        "é",
        "✨",
        "\t",
    ];
    for _ in 0..2000 {
        let n = rng.below(40);
        let src: Vec<&str> = (0..n).map(|_| tokens[rng.below(tokens.len())]).collect();
        let src = src.join(" ");
        let _ = compile_source("soup.dsl", &src, None).map_err(|e| e.render_plain());
    }
    // Mutations of a valid program: one token-sized edit each.
    let chars: Vec<char> = MLP.chars().collect();
    for _ in 0..1500 {
        let mut c = chars.clone();
        let at = rng.below(c.len());
        match rng.below(3) {
            0 => {
                c.remove(at);
            }
            1 => c.insert(
                at,
                "(){}[]=,:@+-*/0Bé#\n"
                    .chars()
                    .nth(rng.below(20))
                    .unwrap_or('x'),
            ),
            _ => c[at] = "0123456789xyzB-".chars().nth(rng.below(15)).unwrap_or('1'),
        }
        let src: String = c.into_iter().collect();
        if let Err(e) = compile_source("mutant.dsl", &src, Some(rng.below(4))) {
            let _ = e.render_plain();
        }
    }
    // Deep nesting and long chains are refused, not overflowed.
    let deep = format!(
        "model m {{ y = {}x{} }}",
        "(".repeat(10_000),
        ")".repeat(10_000)
    );
    assert!(compile_source("deep.dsl", &deep, None).is_err());
    let long = format!("model m {{ y = x{} }}", " + x".repeat(10_000));
    assert!(compile_source("long.dsl", &long, None).is_err());
    let negs = format!("model m {{ y = {}x }}", "-".repeat(10_000));
    assert!(compile_source("negs.dsl", &negs, None).is_err());
}
