//! Mixed precision (issue 24): 16-bit types and the cast op in the IR, the
//! mixed_precision pass's rewrite (snapshotted), f32 master variables and gradients,
//! and bf16 training against one device and against f32.

use distc::verify::{verify, VerifyOptions};
use distc::{compile, CompileOptions};
use distc_ir::{DType, Op};
use distc_passes::placement::{Precision, Strategy, StrategyConfig};
use distc_runtime::run::train::{train, TrainOptions};
use distc_tests::example;
use std::time::Duration;

const TWO_LAYERS: &str = "model two {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
    param w1: f32[8, 16] = glorot\n  param b1: f32[16] = zeros\n  \
    param w2: f32[16, 4] = glorot\n  param b2: f32[4] = zeros\n  \
    h = relu(x @ w1 + b1)\n  \
    minimize softmax_cross_entropy(h @ w2 + b2, label) + 0.01 * sum(w1 * w1)\n}\n\
    train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 4\n  \
    optimizer = sgd(lr = 0.1)\n  steps = 1\n  seed = 3\n}\n";

fn with(precision: Precision) -> StrategyConfig {
    StrategyConfig {
        precision,
        ..Default::default()
    }
}

#[test]
fn sixteen_bit_types_and_casts_print_and_parse() {
    let text = "graph g {\n  %0 = param{name=\"w\", init=zeros} : f32[2,3]\n  \
                %1 = cast{to=\"bf16\"} %0 : bf16[2,3]\n  %2 = cast{to=\"f16\"} %1 : f16[2,3]\n  \
                %3 = cast{to=\"f32\"} %2 : f32[2,3]\n  output{name=\"y\"} %3\n}\n";
    let g = distc_ir::parse(text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(distc_ir::print(&g), text);
    assert_eq!(DType::BF16.size(), 2);
    assert_eq!(DType::F16.size(), 2);
    // A cast to an integer type, or of one, is refused by the parser and the shape rule.
    let bad = text.replace("to=\"f16\"", "to=\"i32\"");
    let e = distc_ir::parse(&bad).expect_err("a cast to i32");
    assert!(e.to_string().contains("a float type is needed"), "{e}");
    let ids = distc_ir::TensorType::new(DType::I32, vec![4]);
    let e = distc_ir::infer(
        &Op::Cast { to: DType::BF16 },
        &[&distc_ir::ValueType::Tensor(ids)],
    )
    .expect_err("a cast of ids");
    assert!(e.to_string().contains("a float tensor is needed"), "{e}");
}

#[test]
fn the_pass_puts_products_in_16_bits_losses_in_f32_and_keeps_f32_masters() {
    for (precision, half) in [(Precision::Bf16, DType::BF16), (Precision::Fp16, DType::F16)] {
        let c = compile(
            "two.dsl",
            TWO_LAYERS,
            &CompileOptions {
                strategy: with(precision),
                stop_after: Some("mixed_precision".into()),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let g = &c.programs.worker;
        let ir = distc_ir::print(g);
        for id in g.node_ids() {
            let node = g.node(id);
            let ins: Vec<DType> = node
                .inputs
                .iter()
                .map(|v| g.value_type(*v).dense_type().dtype)
                .collect();
            match &node.op {
                Op::MatMul { .. } => assert!(ins.iter().all(|d| *d == half), "{ir}"),
                Op::SoftmaxCrossEntropy => assert_eq!(ins[0], DType::F32, "{ir}"),
                Op::Sum { .. } => assert_eq!(ins[0], DType::F32, "{ir}"),
                Op::Param { ty, .. } => assert_eq!(ty.dtype, DType::F32, "{ir}"),
                _ => {}
            }
        }
        // w1 is read by a matmul (16 bits) and by the f32 penalty: cast once, for the
        // matmul; b1's add follows the 16-bit product.
        assert_eq!(ir.matches(&format!("cast{{to=\"{half}\"}} %2")).count(), 1, "{ir}");
        if precision == Precision::Bf16 {
            insta::assert_snapshot!(ir);
        }
        // After autodiff every gradient reaching the optimizer is f32.
        let full = compile(
            "two.dsl",
            TWO_LAYERS,
            &CompileOptions {
                strategy: with(precision),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let g = &full.programs.worker;
        let mut sinks = 0;
        for id in g.node_ids() {
            if let Op::ParamGrad { param } = g.op(id) {
                let d = g.value_type(g.node(id).inputs[0]).dense_type().dtype;
                assert_eq!(d, DType::F32, "the gradient of {param}");
                sinks += 1;
            }
        }
        assert_eq!(sinks, 4);
    }
}

#[test]
fn a_bf16_plan_verifies_against_one_device_in_bf16() {
    // Against one device in bf16, each variable within the tolerance plus twice what
    // bf16 itself changes on one device (one device bf16 against f32), which verify
    // measures too: two runs rounding differently each stray from f32 about that much.
    for workers in [2, 4] {
        let opts = VerifyOptions {
            compile: CompileOptions {
                strategy: StrategyConfig {
                    strategy: Strategy::Allreduce,
                    workers,
                    precision: Precision::Bf16,
                    ..Default::default()
                },
                batch: Some(16),
                ..Default::default()
            },
            steps: 3,
            tolerance: 1e-4,
            timeout: Duration::from_secs(60),
            device: None,
        };
        let r = verify(&example("dense_mlp.dsl"), &opts).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.passed(), "{workers} workers: {:?}", r.vars);
        // bf16 does change the weights, and by more than the f32 tolerance.
        let w1 = r.vars.iter().find(|v| v.name == "w1").expect("w1");
        let effect = w1.precision_effect.expect("a bf16 plan measures bf16's effect");
        assert!(effect > 1e-4 && effect < 5e-2, "w1: bf16 vs f32 {effect:.2e}");
    }
}

#[test]
fn mnist_in_bf16_reaches_the_accuracy_of_f32() {
    let Some(dir) = distc_runtime::run::data::data_dir(None) else {
        eprintln!("SKIP: no data directory (DISTC_DATA) for MNIST");
        return;
    };
    let mut accuracy = Vec::new();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let c = distc::compile_file(
            &example("mlp.dsl"),
            &CompileOptions {
                strategy: with(precision),
                data_dir: Some(dir.clone()),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let opts = TrainOptions {
            steps: Some(1500),
            data_dir: Some(dir.clone()),
            evaluate: true,
            ..TrainOptions::default()
        };
        let mut last = None;
        train(c.programs(1), &c.config, &opts, &mut |m| {
            if let Some(e) = &m.eval {
                last = e.eval_accuracy;
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{precision}: {e}"));
        accuracy.push(last.expect("an evaluation with an accuracy"));
    }
    let (fp32, bf16) = (accuracy[0], accuracy[1]);
    eprintln!("mlp after 1500 steps: fp32 accuracy {fp32:.4}, bf16 {bf16:.4}");
    assert!(bf16 >= 0.97, "bf16 reached {bf16:.4}");
    assert!((fp32 - bf16).abs() < 0.005, "fp32 {fp32:.4}, bf16 {bf16:.4}");
}
