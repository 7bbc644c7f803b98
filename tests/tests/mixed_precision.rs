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
    for (precision, half) in [
        (Precision::Bf16, DType::BF16),
        (Precision::Fp16, DType::F16),
    ] {
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
        assert_eq!(
            ir.matches(&format!("cast{{to=\"{half}\"}} %2")).count(),
            1,
            "{ir}"
        );
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
            init: None,
        };
        let r = verify(&example("dense_mlp.dsl"), &opts).unwrap_or_else(|e| panic!("{e}"));
        assert!(r.passed(), "{workers} workers: {:?}", r.vars);
        // bf16 does change the weights, and by more than the f32 tolerance.
        let w1 = r.vars.iter().find(|v| v.name == "w1").expect("w1");
        let effect = w1
            .precision_effect
            .expect("a bf16 plan measures bf16's effect");
        assert!(
            effect > 1e-4 && effect < 5e-2,
            "w1: bf16 vs f32 {effect:.2e}"
        );
    }
    // A regression: sparse_lm's output bias, summed over 16 rows in bf16 on each worker
    // and over 32 on one device, differed by 1.4e-3 where bf16 changed it by 3.1e-4
    // alone; the type's own tolerance (1.6e-2) covers that rounding.
    let Some(dir) = distc_runtime::run::data::data_dir(None) else {
        eprintln!("SKIP: no data directory (DISTC_DATA) for Penn Treebank");
        return;
    };
    let opts = VerifyOptions {
        compile: CompileOptions {
            strategy: StrategyConfig {
                strategy: Strategy::Hybrid,
                workers: 2,
                servers: 1,
                precision: Precision::Bf16,
                ..Default::default()
            },
            batch: Some(16),
            data_dir: Some(dir),
            ..Default::default()
        },
        steps: 3,
        tolerance: 1e-4,
        timeout: Duration::from_secs(60),
        device: None,
        init: None,
    };
    let r = verify(&example("sparse_lm.dsl"), &opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(r.passed(), "sparse_lm hybrid bf16: {:?}", r.vars);
}

/// The last evaluation of example `model` trained `steps` steps in `precision` on the
/// data in `dir`.
fn last_evaluation(
    model: &str,
    precision: Precision,
    steps: usize,
    dir: &std::path::Path,
) -> distc_runtime::run::metrics::EvalMetrics {
    let c = distc::compile_file(
        &example(model),
        &CompileOptions {
            strategy: with(precision),
            data_dir: Some(dir.to_path_buf()),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{model}: {e}"));
    let opts = TrainOptions {
        steps: Some(steps),
        data_dir: Some(dir.to_path_buf()),
        evaluate: true,
        ..TrainOptions::default()
    };
    let mut last = None;
    train(c.programs(1), &c.config, &opts, &mut |m| {
        if let Some(e) = &m.eval {
            last = Some(e.clone());
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{model} {precision}: {e}"));
    last.expect("an evaluation")
}

#[test]
fn mnist_in_bf16_reaches_the_accuracy_of_f32() {
    let Some(dir) = distc_runtime::run::data::data_dir(None) else {
        eprintln!("SKIP: no data directory (DISTC_DATA) for MNIST");
        return;
    };
    // Measured: after 500 steps fp32 0.9679, bf16 0.9685; after 800 0.9708 and 0.9711;
    // after 1500 (the test's length before CI time was cut again) 0.9739 and 0.9746.
    const STEPS: usize = 500;
    let accuracy: Vec<f64> = [Precision::Fp32, Precision::Bf16]
        .into_iter()
        .map(|p| {
            let e = last_evaluation("mlp.dsl", p, STEPS, &dir);
            e.eval_accuracy.expect("an evaluation with an accuracy")
        })
        .collect();
    let (fp32, bf16) = (accuracy[0], accuracy[1]);
    eprintln!("mlp after {STEPS} steps: fp32 accuracy {fp32:.4}, bf16 {bf16:.4}");
    assert!(bf16 >= 0.96, "bf16 reached {bf16:.4}");
    assert!(
        (fp32 - bf16).abs() < 0.005,
        "fp32 {fp32:.4}, bf16 {bf16:.4}"
    );
}

/// A model whose loss is multiplied by `factor` (with the learning rate divided by it,
/// the same training as factor 1 in exact arithmetic).
fn scaled_loss_model(factor: &str, lr: &str) -> String {
    format!(
        "model tiny {{\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
         param w1: f32[8, 16] = glorot\n  param w2: f32[16, 4] = glorot\n  \
         minimize {factor} * softmax_cross_entropy(relu(x @ w1) @ w2, label)\n}}\n\
         train {{\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 16\n  \
         optimizer = sgd(lr = {lr})\n  steps = 60\n  seed = 7\n}}\n"
    )
}

#[test]
fn gradients_that_underflow_fp16_survive_with_the_loss_scale() {
    use distc_runtime::core::exec::Executor;
    use distc_runtime::core::schedule::Mode;
    // A loss of 1e-8 of the cross-entropy: its gradient at the logits (about 1e-8 / 16)
    // is below fp16's smallest subnormal (6e-8), so the 16-bit backward pass has only
    // zeros; scaled by 2^16 it is a normal fp16 number.
    let src = scaled_loss_model("0.00000001", "50000000.0");
    let c = compile(
        "tiny.dsl",
        &src,
        &CompileOptions {
            strategy: with(Precision::Fp16),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let g = &c.programs.worker;
    assert!(g.scales_loss());
    let params = distc_runtime::run::train::init_params(g, 7);
    let mut data = distc_runtime::run::data::DataSource::open(
        &c.config.data,
        None,
        &distc_runtime::run::train::input_types(g),
        16,
        7,
        0,
        1,
    )
    .expect("data");
    let feeds = data.next_batch().expect("a batch");
    let mut exec = Executor::new(g).expect("executor");
    let mut w1 = |scale: f64| {
        exec.set_loss_scale(scale).expect("scale");
        let out = exec.run(&feeds, &params, Mode::Train, 1).expect("a step");
        let (_, grad) = out
            .grads
            .into_iter()
            .find(|(n, _)| n == "w1")
            .expect("w1's gradient");
        grad.tensor().expect("dense").to_f64_vec()
    };
    let unscaled = w1(1.0);
    assert!(unscaled.iter().all(|x| *x == 0.0), "fp16 kept {unscaled:?}");
    let scaled = w1(65536.0);
    assert!(
        scaled.iter().any(|x| *x != 0.0),
        "the scaled gradient underflowed too"
    );
    // Training: fp16 with its loss scale follows fp32.
    let mut finals = Vec::new();
    for precision in [Precision::Fp32, Precision::Fp16] {
        let c = compile(
            "tiny.dsl",
            &src,
            &CompileOptions {
                strategy: with(precision),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut losses = Vec::new();
        let opts = TrainOptions {
            evaluate: false,
            ..TrainOptions::default()
        };
        train(c.programs(1), &c.config, &opts, &mut |m| {
            losses.push(m.loss);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{precision}: {e}"));
        let mean = |l: &[f64]| l.iter().sum::<f64>() / l.len() as f64;
        let (first, last) = (mean(&losses[..10]), mean(&losses[losses.len() - 10..]));
        assert!(
            last < 0.95 * first,
            "{precision}: loss {first:e} -> {last:e}"
        );
        finals.push(last);
    }
    let rel = (finals[0] - finals[1]).abs() / finals[0];
    assert!(rel < 0.05, "fp32 {:e}, fp16 {:e}", finals[0], finals[1]);
}

#[test]
fn overflowing_steps_are_skipped_on_every_worker_alike() {
    // A loss of 1000 cross-entropies: scaled by 2^16 its gradients overflow fp16
    // (65504), so the first steps are skipped and halve the scale until they fit.
    let src = scaled_loss_model("1000.0", "0.0005");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("big.dsl");
    std::fs::write(&path, &src).expect("writes the model");
    let s = |workers, zero| StrategyConfig {
        strategy: if workers > 1 {
            Strategy::Allreduce
        } else {
            Strategy::Single
        },
        workers,
        zero,
        precision: Precision::Fp16,
        ..Default::default()
    };
    let c = distc::compile_file(
        &path,
        &CompileOptions {
            strategy: s(2, 1),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let opts = TrainOptions {
        evaluate: false,
        global_data: true,
        ..TrainOptions::default()
    };
    let mut last = None;
    train(c.programs(2), &c.config, &opts, &mut |m| {
        last = Some((m.loss_scale, m.skipped_steps));
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let (scale, skipped) = last.expect("steps");
    let (scale, skipped) = (scale.expect("a scale"), skipped.expect("a count"));
    assert!(
        skipped > 0 && scale < 65536.0,
        "scale {scale}, {skipped} skipped"
    );
    assert_eq!(scale, 65536.0 / f64::powi(2.0, skipped as i32));
    // ZeRO 1: each worker checks its own chunk; had one skipped a step the other took,
    // the variables would part ways. They equal one device's fp16 run.
    for (workers, zero) in [(2, 0), (2, 1)] {
        let r = verify(
            &path,
            &VerifyOptions {
                compile: CompileOptions {
                    strategy: s(workers, zero),
                    ..Default::default()
                },
                steps: 12,
                tolerance: 1e-4,
                timeout: Duration::from_secs(60),
                device: None,
                init: None,
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(r.passed(), "{workers} workers, ZeRO {zero}: {:?}", r.vars);
    }
}

/// Issue 67, item 5: the skip decision is the whole step's. Each part of a step (a
/// worker's batch, a micro-batch) sums its own samples' weight gradient, 1/N of one
/// device's, so it overflowed fp16 less often: 2 workers and `--accumulate 2` skipped
/// fewer steps than one device with their global batch. Skipped where one device's
/// 16-bit gradient of the whole batch would not fit, every layout skips its steps.
#[test]
fn every_layout_skips_the_steps_one_device_skips() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("big.dsl");
    let skips = |factor: &str, strategy: StrategyConfig, batch: usize| -> Vec<usize> {
        std::fs::write(&path, scaled_loss_model(factor, "0.0001")).expect("writes the model");
        let c = distc::compile_file(
            &path,
            &CompileOptions {
                strategy: StrategyConfig {
                    precision: Precision::Fp16,
                    ..strategy.clone()
                },
                batch: Some(batch),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let opts = TrainOptions {
            steps: Some(12),
            evaluate: false,
            global_data: true,
            ..TrainOptions::default()
        };
        let mut skipped = Vec::new();
        train(c.programs(strategy.workers), &c.config, &opts, &mut |m| {
            skipped.push(m.skipped_steps.expect("a count"));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        skipped
    };
    let workers = |n, zero| StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: n,
        zero,
        ..Default::default()
    };
    for factor in ["3000.0", "20000.0"] {
        let one = skips(factor, StrategyConfig::default(), 16);
        assert!(
            one.last().is_some_and(|&k| k > 0),
            "x{factor}: no step skipped: {one:?}"
        );
        for (what, strategy, batch) in [
            ("2 workers", workers(2, 0), 8),
            ("2 workers, ZeRO 1", workers(2, 1), 8),
            (
                "--accumulate 2",
                StrategyConfig {
                    accumulate: 2,
                    ..Default::default()
                },
                8,
            ),
        ] {
            let got = skips(factor, strategy, batch);
            assert_eq!(got, one, "x{factor}, {what}: steps skipped (cumulative)");
        }
    }
}

/// Issue 67, items 5 and 7. A verify of fp16 steps that were all skipped compared the
/// starting weights with themselves, and passed: it is an error that says so. And an
/// fp16 layout is compared with one device that splits its batch as the layout does
/// (each worker's 16-bit values are its own samples'), which it equals bitwise on a
/// layout that is right.
#[test]
fn fp16_verify_splits_its_batch_as_the_layout_and_refuses_a_run_of_skipped_steps() {
    let dir = tempfile::tempdir().expect("temp dir");
    let opts = |workers, steps| VerifyOptions {
        compile: CompileOptions {
            strategy: StrategyConfig {
                strategy: Strategy::Allreduce,
                workers,
                precision: Precision::Fp16,
                ..Default::default()
            },
            ..Default::default()
        },
        steps,
        tolerance: 1e-4,
        timeout: Duration::from_secs(60),
        device: None,
        init: None,
    };
    // A loss beyond fp16 whatever the scale of the first steps: every step skipped.
    let huge = dir.path().join("huge.dsl");
    std::fs::write(&huge, scaled_loss_model("1e30", "0.1")).expect("writes the model");
    let e = verify(&huge, &opts(2, 3)).expect_err("a verify of skipped steps");
    assert!(
        e.to_string().contains("skipped all 3 steps")
            && e.to_string().contains("nothing was checked"),
        "{e}"
    );
    let fits = dir.path().join("fits.dsl");
    std::fs::write(&fits, scaled_loss_model("1.0", "0.1")).expect("writes the model");
    for workers in [2, 3] {
        let r = verify(&fits, &opts(workers, 4)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.micro_batches, workers, "the one device's micro-batches");
        let w = r.worst().expect("variables");
        // Two parts sum in the same order on both sides; three in another (f32).
        let exact = if workers == 2 { 0.0 } else { 1e-7 };
        assert!(
            w.relative <= exact,
            "{workers} workers: `{}` differs by {:e}",
            w.name,
            w.relative
        );
    }
}

#[test]
fn a_16_bit_gradient_wire_halves_the_bytes_and_matches_the_f32_wire() {
    let plan = |workers, wire| {
        distc::compile_file(
            &example("dense_mlp.dsl"),
            &CompileOptions {
                strategy: StrategyConfig {
                    strategy: Strategy::Allreduce,
                    workers,
                    grad_wire: wire,
                    ..Default::default()
                },
                batch: Some(16),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let sent = |c: &distc::Compiled, workers| {
        let opts = TrainOptions {
            steps: Some(3),
            evaluate: false,
            global_data: true,
            ..TrainOptions::default()
        };
        let mut sent = Vec::new();
        train(c.programs(workers), &c.config, &opts, &mut |m| {
            sent.push(m.bytes_sent as f64);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        sent
    };
    for workers in [2, 4] {
        let full = plan(workers, Precision::Fp32);
        let predicted_full = full
            .dist
            .as_ref()
            .expect("a plan")
            .predicted_bytes_per_step_per_worker();
        let measured_full = sent(&full, workers);
        // Measured: a ring of 16-bit chunks sends half the bytes of the f32 ring, step
        // for step (step 1 also carries the initial broadcast, in f32 on both).
        for (wire, tolerance) in [(Precision::Bf16, 1e-2), (Precision::Fp16, 2e-3)] {
            let c = plan(workers, wire);
            let predicted = c
                .dist
                .as_ref()
                .expect("a plan")
                .predicted_bytes_per_step_per_worker();
            assert_eq!(predicted, predicted_full / 2.0, "{workers} workers, {wire}");
            let measured = sent(&c, workers);
            for step in 1..3 {
                assert_eq!(
                    measured[step],
                    measured_full[step] / 2.0,
                    "{workers} {wire}"
                );
                let err = (measured[step] - predicted).abs() / predicted;
                assert!(
                    err < 1e-3,
                    "{workers} {wire}: {} vs {predicted}",
                    measured[step]
                );
            }
            // The 16-bit wire's sums against one device's f32 update: within a few of
            // the wire type's rounding steps (measured after 3 steps: bf16 3.2e-3 and
            // 4.8e-3, fp16 3.4e-4 and 7.5e-4, for 2 and 4 workers).
            let r = verify(
                &example("dense_mlp.dsl"),
                &VerifyOptions {
                    compile: CompileOptions {
                        strategy: StrategyConfig {
                            strategy: Strategy::Allreduce,
                            workers,
                            grad_wire: wire,
                            ..Default::default()
                        },
                        batch: Some(16),
                        ..Default::default()
                    },
                    steps: 3,
                    tolerance,
                    timeout: Duration::from_secs(60),
                    device: None,
                    init: None,
                },
            )
            .unwrap_or_else(|e| panic!("{e}"));
            assert!(r.passed(), "{workers} workers, {wire} wire: {:?}", r.vars);
            let worst = r.worst().expect("variables").relative;
            assert!(worst > 1e-6, "{wire}: the wire rounded nothing ({worst:e})");
        }
    }
}

/// ZeRO's gradient collectives on a 16-bit wire: stage 1's all-reduce, stages 2 and 3's
/// reduce-scatters send 16-bit values, the gathers of the variables' chunks stay f32;
/// the measured bytes are the predicted ones, and the weights one device's within the
/// wire's rounding.
#[test]
fn zero_sends_its_gradients_on_a_16_bit_wire() {
    let strategy = |zero, wire| StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 2,
        zero,
        grad_wire: wire,
        ..Default::default()
    };
    let sent = |zero, wire| {
        let c = distc::compile_file(
            &example("dense_mlp.dsl"),
            &CompileOptions {
                strategy: strategy(zero, wire),
                batch: Some(16),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let predicted = c
            .dist
            .as_ref()
            .expect("a plan")
            .predicted_bytes_per_step_per_worker();
        let opts = TrainOptions {
            steps: Some(2),
            evaluate: false,
            global_data: true,
            ..TrainOptions::default()
        };
        let mut sent = Vec::new();
        train(c.programs(2), &c.config, &opts, &mut |m| {
            sent.push(m.bytes_sent as f64);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        (predicted, sent[1])
    };
    for zero in [1, 2, 3] {
        let (_, full) = sent(zero, Precision::Fp32);
        for (wire, tolerance) in [(Precision::Bf16, 1e-2), (Precision::Fp16, 2e-3)] {
            let what = format!("ZeRO {zero}, {wire} wire");
            let (predicted, measured) = sent(zero, wire);
            assert_eq!(measured, predicted, "{what}");
            // Stage 1 all-reduces whole gradients (twice a chunk's bytes a worker);
            // stages 2 and 3 reduce-scatter them: either way the gradients' share
            // halves, the gathers of chunks do not.
            assert!(
                measured < full && measured > full / 2.0,
                "{what}: {measured} of f32's {full}"
            );
            let r = verify(
                &example("dense_mlp.dsl"),
                &VerifyOptions {
                    compile: CompileOptions {
                        strategy: strategy(zero, wire),
                        batch: Some(16),
                        ..Default::default()
                    },
                    steps: 3,
                    tolerance,
                    timeout: Duration::from_secs(60),
                    device: None,
                    init: None,
                },
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(r.passed(), "{what}: {:?}", r.vars);
            let worst = r.worst().expect("variables").relative;
            assert!(worst > 1e-6, "{what}: the wire rounded nothing ({worst:e})");
        }
    }
}

// Measured (eval loss): after 100 steps lm f32 6.9329, bf16 6.9331; sparse_lm f32
// 6.1121, bf16 6.1118. After 200 (the test's length before CI time was cut): lm f32
// 6.7852, bf16 6.7854, fp16 6.7853; sparse_lm f32 5.2670, bf16 5.2661, fp16 5.2669.
// Held to 1% of f32. One test a model, so the two train side by side.
#[test]
fn lm_in_bf16_ends_where_f32_does_after_100_steps() {
    ends_where_f32_does_after_100_steps("lm.dsl");
}

#[test]
fn sparse_lm_in_bf16_ends_where_f32_does_after_100_steps() {
    ends_where_f32_does_after_100_steps("sparse_lm.dsl");
}

fn ends_where_f32_does_after_100_steps(model: &str) {
    let Some(dir) = distc_runtime::run::data::data_dir(None) else {
        eprintln!("SKIP: no data directory (DISTC_DATA) for Penn Treebank");
        return;
    };
    let eval: Vec<f64> = [Precision::Fp32, Precision::Bf16]
        .into_iter()
        .map(|p| last_evaluation(model, p, 100, &dir).eval_loss)
        .collect();
    let rel = (eval[1] - eval[0]).abs() / eval[0];
    eprintln!("{model}: eval loss f32 {:.4}, bf16 {:.4}", eval[0], eval[1]);
    assert!(
        rel < 0.01,
        "{model}: f32 {:.4}, bf16 {:.4}",
        eval[0],
        eval[1]
    );
}

/// A model using every op of the DSL that the lists name, each fed by a 16-bit
/// product where it can be, so an op in f32 shows its casts up.
const EVERY_LISTED_OP: &str = "model listed {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
    param emb: f32[4, 4] = glorot\n  param w1: f32[8, 16] = glorot\n  \
    param gamma: f32[16] = ones\n  param beta: f32[16] = zeros\n  \
    param w2: f32[16, 4] = glorot\n  \
    q = reshape(x @ w1, [B, 2, 8])\n  \
    h = layer_norm(x @ w1 + reshape(attention(q, q, q, causal = true), [B, 16]), gamma, beta)\n  \
    y = tanh(h) @ w2 + embedding(emb, label)\n  \
    p = softmax(y) + log_softmax(y) + exp(y) + log(relu(y) + 1.0)\n  \
    minimize softmax_cross_entropy(y, label) + mse(p, y) + 0.001 * mean(sum(p, axes = [1]))\n}\n\
    train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 4\n  \
    optimizer = sgd(lr = 0.1)\n  steps = 1\n  seed = 3\n}\n";

/// The README's list of the ops that run in f32, as IR mnemonics: "softmax
/// cross-entropy" is `softmax_cross_entropy`, "layer norm" `layer_norm`.
fn documented_f32_ops() -> Vec<String> {
    let readme = std::fs::read_to_string(distc_tests::example("../README.md")).expect("README");
    let flat = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    let from = flat
        .find("table's sparse gradient stays f32); ")
        .expect("the lists")
        + 36;
    let to = from + flat[from..].find(" run in f32;").expect("the f32 list");
    flat[from..to]
        .split(", ")
        .flat_map(|s| s.split(" and "))
        .map(|s| s.trim().replace(['-', ' '], "_"))
        .collect()
}

/// Issue 35, item 14: layer norm computed in bf16 passed every test, though the README
/// and `--help` say it stays in f32. Every op of a model that uses each listed op is
/// checked against the README's lists, and the rewrite of a model with a layer norm
/// is snapshotted.
#[test]
fn every_op_runs_in_the_precision_the_readme_lists() {
    let documented = documented_f32_ops();
    for op in [
        "softmax_cross_entropy",
        "mse",
        "softmax",
        "log_softmax",
        "exp",
        "log",
        "layer_norm",
        "attention",
    ] {
        assert!(
            documented.iter().any(|d| d == op),
            "{op} not in {documented:?}"
        );
    }
    let c = compile(
        "listed.dsl",
        EVERY_LISTED_OP,
        &CompileOptions {
            strategy: with(Precision::Bf16),
            stop_after: Some("mixed_precision".into()),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let g = &c.programs.worker;
    let ir = distc_ir::print(g);
    let mut seen = std::collections::BTreeSet::new();
    for id in g.node_ids() {
        let node = g.node(id);
        let floats: Vec<DType> = node
            .inputs
            .iter()
            .map(|v| g.value_type(*v).dense_type().dtype)
            .filter(|d| *d != DType::I32)
            .collect();
        let m = node.op.mnemonic();
        seen.insert(m);
        let scalar = matches!(node.op, Op::Sum { .. } | Op::Mean { .. })
            && node.outputs[0].dense_type().shape.rank() == 0;
        let want = match m {
            "matmul" | "conv2d" => Some(DType::BF16),
            // Documented in words: reductions to a scalar, the model-axis collectives,
            // the sinks.
            _ if scalar
                || m.starts_with("model_")
                || ["loss", "output", "param_grad"].contains(&m) =>
            {
                Some(DType::F32)
            }
            _ if documented.iter().any(|d| d == m) => Some(DType::F32),
            // Everything else follows its inputs: not pinned here.
            _ => None,
        };
        if let Some(want) = want {
            assert!(
                floats.iter().all(|d| *d == want),
                "`{m}` reads {floats:?}, the README says {want}:\n{ir}"
            );
        }
    }
    for op in [
        "layer_norm",
        "attention",
        "softmax",
        "log_softmax",
        "exp",
        "log",
        "mse",
        "embedding",
    ] {
        assert!(seen.contains(op), "the model has no {op}");
    }
    insta::assert_snapshot!(ir);
}

/// Issue 35, item 2: the loss scale and the skipped-step count were not part of the
/// training state: a resumed fp16 run restarted at 2^16, skipped steps the
/// uninterrupted run did not, and ended elsewhere. They are kept, and the resumed run
/// ends bit for bit where the uninterrupted one does, scale and count included.
#[test]
fn an_fp16_run_resumes_its_loss_scale_and_skipped_steps_bitwise() {
    use distc_runtime::core::checkpoint::{load_state, LOSS_SCALE_KEY};
    use distc_runtime::run::train::CheckpointEvery;
    use std::sync::Arc;
    let src = scaled_loss_model("1000.0", "0.0005");
    let c = compile(
        "big.dsl",
        &src,
        &CompileOptions {
            strategy: with(Precision::Fp16),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("fp16.state");
    let run = |steps: usize,
               save: bool,
               resume: Option<Arc<distc_runtime::core::checkpoint::TrainingState>>| {
        let opts = TrainOptions {
            steps: Some(steps),
            evaluate: false,
            checkpoint: save.then(|| CheckpointEvery::new(file.clone(), steps, "test".into())),
            resume,
            ..TrainOptions::default()
        };
        let mut last = None;
        let report = train(c.programs(1), &c.config, &opts, &mut |m| {
            last = Some((m.loss_scale, m.skipped_steps));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        (report.params, last.expect("steps"))
    };
    let (whole, (scale, skipped)) = run(8, false, None);
    assert!(
        skipped.is_some_and(|s| s > 0),
        "no step overflowed: {skipped:?}"
    );
    // Stopped after step 2, when the scale has already come down.
    run(2, true, None);
    let state = load_state(&file).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        state.optimizer.contains_key(LOSS_SCALE_KEY),
        "no loss scale kept"
    );
    let (resumed, (scale_again, skipped_again)) = run(8, false, Some(Arc::new(state)));
    assert_eq!((scale, skipped), (scale_again, skipped_again));
    for (name, w) in &whole {
        assert!(
            resumed.get(name) == Some(w),
            "`{name}` differs after the resume"
        );
    }
}

/// Issue 35, item 2: each worker started its backward pass from the whole loss scale
/// over the mean of its own b samples, so its 16-bit values were N times one device's
/// with the global batch, and it overflowed (and skipped) where one device did not:
/// 6.3e-3 apart after 6 steps, passed only by the precision allowance. Each of the
/// step's N x K batches now starts from its share of the scale: the same as one
/// device to 1e-5, whatever the allowance, for workers and for accumulation.
#[test]
fn workers_and_micro_batches_in_fp16_overflow_where_one_device_does() {
    let src = scaled_loss_model("40.0", "0.0005");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("near.dsl");
    std::fs::write(&path, &src).expect("writes the model");
    for strategy in [
        StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: 2,
            ..with(Precision::Fp16)
        },
        StrategyConfig {
            accumulate: 2,
            ..with(Precision::Fp16)
        },
    ] {
        let r = verify(
            &path,
            &VerifyOptions {
                compile: CompileOptions {
                    strategy: strategy.clone(),
                    ..Default::default()
                },
                steps: 6,
                tolerance: 1e-5,
                timeout: Duration::from_secs(60),
                device: None,
                init: None,
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let worst = r.vars.iter().map(|v| v.relative).fold(0.0, f64::max);
        assert!(
            worst < 1e-5,
            "{} workers, accumulate {}: {worst:e} from one device",
            strategy.workers,
            strategy.accumulate
        );
    }
}
