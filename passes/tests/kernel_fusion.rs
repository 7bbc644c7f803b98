//! The kernel-fusion pass on a small graph: a layer's bias add and activation, and a
//! backward chain with a constant and a bias broadcast, before and after (insta); the
//! rules it keeps; autodiff and simplify meeting a fused node.

use distc_ir::{parse, print, verify, Graph, Op};
use distc_passes::autodiff::Autodiff;
use distc_passes::kernel_fusion::KernelFusion;
use distc_passes::simplify::Simplify;
use distc_passes::{Pass, PassCx, PassStats};

const LAYER: &str = r#"graph layer {
  %0 = input{name="x"} : f32[4,8]
  %1 = param{name="w", init=glorot} : f32[8,16]
  %2 = param{name="b", init=zeros} : f32[16]
  %3 = input{name="dy"} : f32[4,16]
  %4 = matmul %0, %1 : f32[4,16]
  %5 = add %4, %2 : f32[4,16]
  %6 = relu %5 : f32[4,16]
  %7 = tanh %6 : f32[4,16]
  %8 = relu_grad %3, %5 : f32[4,16]
  %9 = constant{value=0.5} : f32[]
  %10 = mul %8, %9 : f32[4,16]
  %11 = tanh_grad %10, %7 : f32[4,16]
  %12 = broadcast_to{shape=[4,16]} %2 : f32[4,16]
  %13 = sub %11, %12 : f32[4,16]
  %14 = sum_to{shape=[16]} %13 : f32[16]
  output{name="h"} %6
  output{name="t"} %7
  output{name="dx"} %13
  output{name="db"} %14
}
"#;

fn fuse(text: &str) -> (Graph, PassStats) {
    let mut g = parse(text).unwrap_or_else(|e| panic!("{e}"));
    let mut cx = PassCx::default();
    cx.strategy.fuse = true;
    let stats = KernelFusion.run(&mut g, &mut cx).expect("fuses");
    verify(&g).unwrap_or_else(|e| panic!("{e}\n{g}"));
    let back = parse(&print(&g)).expect("parses");
    assert_eq!(back, g, "does not round-trip");
    (g, stats)
}

fn count(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.node_ids()
        .into_iter()
        .filter(|&id| pred(g.op(id)))
        .count()
}

#[test]
fn layer_and_backward_chain() {
    let (g, stats) = fuse(LAYER);
    insta::assert_snapshot!(
        "layer_and_backward_chain",
        format!("before:\n{LAYER}\nafter:\n{g}\nstats: {stats}")
    );
    assert_eq!(stats.get("groups"), 2, "{stats}");
    assert_eq!(count(&g, |op| matches!(op, Op::MatMul { .. })), 1);
    // tanh has two readers outside any group (an output and tanh_grad): it stays.
    assert_eq!(count(&g, |op| matches!(op, Op::Tanh)), 1);
    assert_eq!(count(&g, |op| matches!(op, Op::Constant { .. })), 0);
}

#[test]
fn off_by_default_and_idempotent() {
    let mut g = parse(LAYER).expect("parses");
    let stats = KernelFusion
        .run(&mut g, &mut PassCx::default())
        .expect("runs");
    assert_eq!(g, parse(LAYER).expect("parses"), "changed without --fuse");
    assert!(
        stats.note.as_deref().unwrap_or("").contains("--fuse"),
        "{stats}"
    );
    let (once, _) = fuse(LAYER);
    let (twice, stats) = fuse(&print(&once));
    assert_eq!(twice, once, "a second run changed the graph");
    assert_eq!(stats.get("groups"), 0, "{stats}");
}

#[test]
fn what_stays_unfused() {
    // A value read outside the chain is not absorbed; one op alone stays itself; a
    // broadcast that alone makes the result's shape stays; integer and sparse values
    // and communication do not take part.
    let text = r#"graph keep {
  %0 = input{name="x"} : f32[4,8]
  %1 = param{name="b", init=zeros} : f32[8]
  %2 = exp %0 : f32[4,8]
  %3 = neg %2 : f32[4,8]
  %4 = broadcast_to{shape=[4,8]} %1 : f32[4,8]
  %5 = relu %4 : f32[4,8]
  %6 = all_reduce{reduce="mean"} %3 : f32[4,8]
  %7 = sigmoid %6 : f32[4,8]
  output{name="e"} %2
  output{name="r"} %5
  output{name="s"} %7
}
"#;
    let (g, stats) = fuse(text);
    assert_eq!(stats.get("groups"), 0, "{stats}\n{g}");
    assert_eq!(g, parse(text).expect("parses"));
}

#[test]
fn fused_groups_merge_with_earlier_fused_nodes() {
    let text = r#"graph merge {
  %0 = input{name="x"} : f64[3,5]
  %1 = input{name="y"} : f64[5]
  %2 = fused{expr="relu(add(in0, in1))"} %0, %1 : f64[3,5]
  %3 = sigmoid %2 : f64[3,5]
  %4 = constant{value=2.0} : f64[]
  %5 = mul %3, %4 : f64[3,5]
  output{name="z"} %5
}
"#;
    let (g, stats) = fuse(text);
    assert_eq!(stats.get("groups"), 1, "{stats}");
    let line = print(&g)
        .lines()
        .find(|l| l.contains("fused"))
        .expect("a fused node")
        .trim()
        .to_string();
    assert_eq!(
        line,
        r#"%2 = fused{expr="mul(sigmoid(relu(add(in0, in1))), 2.0)"} %0, %1 : f64[3,5]"#
    );
}

/// Issue 37: a fused node is differentiable (the DSL's element-wise functions are fused
/// nodes from the start): each input's gradient is an expression of its own, summed
/// down to the input's shape. (Before, autodiff refused a fused node.)
#[test]
fn autodiff_differentiates_a_fused_node_into_fused_nodes() {
    let text = r#"graph d {
  %0 = input{name="x"} : f32[4,8]
  %1 = param{name="b", init=zeros} : f32[8]
  %2 = fused{expr="relu(add(in0, in1))"} %0, %1 : f32[4,8]
  %3 = mean{axes=[0,1]} %2 : f32[]
  loss %3
}
"#;
    let mut g = parse(text).expect("parses");
    Autodiff
        .run(&mut g, &mut PassCx::default())
        .expect("a fused node has a gradient");
    let ir = distc_ir::print(&g);
    // d/db: dy * step(x + b), then summed over the broadcast rows.
    assert!(
        ir.contains(r#"fused{expr="mul(in0, step(add(in1, in2)))"}"#),
        "{ir}"
    );
    assert!(ir.contains("sum_to{shape=[8]}"), "{ir}");
    assert_eq!(g.param_grads().len(), 1, "{ir}");
}

#[test]
fn simplify_keeps_fused_nodes_and_merges_equal_ones() {
    let text = r#"graph s {
  %0 = input{name="x"} : f32[4,8]
  %1 = param{name="b", init=zeros} : f32[8]
  %2 = fused{expr="relu(add(in0, in1))"} %0, %1 : f32[4,8]
  %3 = fused{expr="relu(add(in0, in1))"} %0, %1 : f32[4,8]
  %4 = add %2, %3 : f32[4,8]
  output{name="y"} %4
}
"#;
    let mut g = parse(text).expect("parses");
    Simplify::default()
        .run(&mut g, &mut PassCx::default())
        .expect("simplifies");
    verify(&g).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(count(&g, |op| matches!(op, Op::Fused { .. })), 1, "{g}");
}
