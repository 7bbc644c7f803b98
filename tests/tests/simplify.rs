//! The simplify pass removes what its rules say and the graph still computes the same
//! loss and gradients.

use distc::dsl::compile_source;
use distc_ir::print;
use distc_passes::{autodiff::Autodiff, simplify::Simplify, Pass, PassCx};
use distc_runtime::core::exec::Executor;
use distc_runtime::core::schedule::Mode;
use distc_runtime::run::data::DataSource;
use distc_runtime::run::train::{init_params, input_types};

const MODEL: &str = r#"
model redundant {
  input x:     f32[B, 12]
  input label: i32[B]
  param w: f32[12, 6] = glorot
  param v: f32[6, 4]  = glorot
  param b: f32[4]     = zeros

  a      = (x @ w) * 1 + 0                          # x*1, x+0
  t      = transpose(transpose(a))                  # double transpose
  r      = reshape(reshape(t, [B, 3, 2]), [B, 6])   # reshape chain back to the same shape
  h      = pow(tanh(r), 1) / 1 - 0                  # pow(x, 1) in a fused node
  same   = tanh(r)                                  # a common subexpression
  sq     = pow(same, 2)                             # pow(x, 2) is x * x
  logits = (h + same + sq) @ v + b - -b             # a - -b
  minimize softmax_cross_entropy(logits, label)
}
train {
  data = gaussian_classes(features = 12, classes = 4)
  batch = 8
  optimizer = sgd(lr = 0.1)
  steps = 1
}
"#;

#[test]
fn simplified_graph_computes_the_same_values() {
    let program = compile_source("redundant.dsl", MODEL, None).expect("compiles");
    let mut g = program.graph.clone();
    let mut cx = PassCx::default();
    Autodiff.run(&mut g, &mut cx).expect("autodiff");
    let before = g.clone();
    let stats = Simplify::default().run(&mut g, &mut cx).expect("simplify");
    distc_ir::verify(&g).expect("verifies");
    assert!(stats.get("removed") >= 10, "{stats}");
    insta::assert_snapshot!("simplify_before", print(&before));
    insta::assert_snapshot!("simplify_after", format!("{stats}\n{}", print(&g)));
    let text = print(&g);
    assert!(
        !text.contains("= transpose"),
        "double transpose left:\n{text}"
    );
    assert_eq!(
        text.matches("= tanh ").count(),
        1,
        "tanh not shared:\n{text}"
    );

    let config = &program.config;
    let mut data = DataSource::open(&config.data, None, &input_types(&g), config.batch, 1, 0, 1)
        .expect("data");
    let batch = data.next_batch().expect("batch");
    let params = init_params(&g, 5);
    let run = |graph| {
        let mut exec = Executor::new(graph).expect("executor");
        exec.run(&batch, &params, Mode::Train, 1).expect("runs")
    };
    let (a, b) = (run(&before), run(&g));
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * x.abs().max(1.0);
    assert!(close(a.loss.expect("loss"), b.loss.expect("loss")));
    assert_eq!(a.grads.len(), b.grads.len());
    for (name, ga) in &a.grads {
        let gb = &b
            .grads
            .iter()
            .find(|(n, _)| n == name)
            .expect("same gradients")
            .1;
        let (va, vb) = (
            ga.tensor().expect("dense").to_f64_vec(),
            gb.tensor().expect("dense").to_f64_vec(),
        );
        for (x, y) in va.iter().zip(&vb) {
            assert!(close(*x, *y), "d/d{name}: {x} vs {y}");
        }
    }
}
