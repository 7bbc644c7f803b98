//! Tensor parallelism (issue 23): variables split over a mesh's model axis train what
//! one device trains, alone and with a data axis; the sharding pass's rewrite is
//! snapshotted.

use distc::verify::{verify, VerifyOptions};
use distc::{compile, CompileOptions};
use distc_ir::pipeline::schedule::ScheduleKind;
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_tests::example;
use std::time::Duration;

fn mesh(data: usize, model: usize) -> StrategyConfig {
    StrategyConfig {
        strategy: if data > 1 {
            Strategy::Allreduce
        } else {
            Strategy::Single
        },
        workers: data * model,
        model,
        ..Default::default()
    }
}

/// A mesh of `data` x `model` x `pipe` workers, `micro` micro-batches a step.
fn mesh3(data: usize, model: usize, pipe: usize, micro: usize) -> StrategyConfig {
    StrategyConfig {
        workers: data * model * pipe,
        pipeline: pipe,
        micro_batches: micro,
        ..mesh(data, model)
    }
}

/// examples/lm.dsl with SGD instead of Adam (whose first steps amplify rounding), written
/// into `dir`.
fn lm_with_sgd(dir: &std::path::Path) -> std::path::PathBuf {
    let src = std::fs::read_to_string(example("lm.dsl")).expect("example");
    let sgd = src.replace(
        "optimizer    = adam(lr = 0.002)",
        "optimizer    = sgd(lr = 0.5)",
    );
    assert_ne!(src, sgd, "lm.dsl's optimizer line changed");
    let path = dir.join("lm_sgd.dsl");
    std::fs::write(&path, sgd).expect("writes the model");
    path
}

fn verify_opts(strategy: StrategyConfig) -> VerifyOptions {
    VerifyOptions {
        compile: CompileOptions {
            strategy,
            batch: Some(16),
            ..Default::default()
        },
        steps: 3,
        tolerance: 1e-5,
        timeout: Duration::from_secs(60),
        device: None,
        init: None,
    }
}

fn assert_passes(what: &str, r: &distc::verify::VerifyReport) {
    let w = r.worst().expect("variables");
    assert!(
        r.passed(),
        "{what}: `{}` differs by {:.2e} (tolerance {:.0e})",
        w.name,
        w.relative,
        r.tolerance
    );
}

#[test]
fn megatron_pairs_on_a_model_axis_match_one_device() {
    for (data, model) in [(1, 2), (1, 4), (2, 2)] {
        let r = verify(&example("dense_mlp.dsl"), &verify_opts(mesh(data, model)))
            .unwrap_or_else(|e| panic!("data={data} model={model}: {e}"));
        assert_passes(&format!("dense_mlp data={data} model={model}"), &r);
        assert_eq!(r.global_batch, 16 * data);
    }
    // The pair one layer down (`--shard w2=1 --shard w3=0`): h1, whole and needing its
    // gradient for w1, enters the split computation, so its gradient is summed.
    let s = StrategyConfig {
        shard: [("w2".to_string(), 1), ("w3".to_string(), 0)]
            .into_iter()
            .collect(),
        ..mesh(1, 2)
    };
    let r = verify(&example("dense_mlp.dsl"), &verify_opts(s)).unwrap_or_else(|e| panic!("{e}"));
    assert_passes("dense_mlp w2 and w3 split", &r);
}

#[test]
fn the_rewrite_of_a_pair_of_matmuls_is_megatrons_f_and_g() {
    let src = "model two {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
               param w1: f32[8, 16] = glorot\n  param b1: f32[16] = zeros\n  \
               param w2: f32[16, 4] = glorot\n  param b2: f32[4] = zeros\n  \
               h = relu(x @ w1 + b1)\n  minimize softmax_cross_entropy(h @ w2 + b2, label)\n}\n\
               train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 4\n  \
               optimizer = sgd(lr = 0.1)\n  steps = 1\n  seed = 3\n}\n";
    let c = compile(
        "two.dsl",
        src,
        &CompileOptions {
            strategy: mesh(1, 2),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let ir = distc_ir::print::print(&c.programs.worker);
    let count = |op: &str| ir.matches(&format!(" {op}")).count();
    // w1 by columns (and b1 with them), w2 by rows. Forward: x enters the split
    // computation (`f`), the row-parallel partial sums are summed before b2 (`g`);
    // backward: the gradient enters back through `g`'s rule, x (an input) needs no
    // gradient, and b1's part has its part of the gradient: nothing is gathered.
    assert!(
        ir.contains("param{name=\"w1.tp\", init=glorot} : f32[8,8]"),
        "{ir}"
    );
    assert!(
        ir.contains("param{name=\"w2.tp\", init=glorot} : f32[8,4]"),
        "{ir}"
    );
    assert_eq!(count("model_all_reduce"), 1, "{ir}");
    assert_eq!(count("model_enter"), 2, "{ir}");
    assert_eq!(count("model_gather"), 0, "{ir}");
    assert!(
        ir.contains("param{name=\"b1.tp\", init=zeros} : f32[8]"),
        "{ir}"
    );
    insta::assert_snapshot!(ir);
}

#[test]
fn the_ir_after_the_sharding_pass_shows_every_values_sharding() {
    let c = compile(
        "mlp.dsl",
        &std::fs::read_to_string(example("dense_mlp.dsl")).expect("example"),
        &CompileOptions {
            strategy: mesh(1, 2),
            stop_after: Some("tensor_parallel".into()),
            batch: Some(4),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let ir = distc_ir::print::print_with_notes(&c.programs.worker, &c.programs.worker_notes);
    // Every line with a result says where it lives; sinks have none.
    for line in ir.lines().filter(|l| l.contains(" = ")) {
        assert!(
            ["// whole", "// split(", "// partial"]
                .iter()
                .any(|n| line.contains(n)),
            "no sharding on `{line}`"
        );
    }
    assert!(
        ir.contains("matmul %11, %4 : f32[4,1024]  // partial"),
        "{ir}"
    );
    // The notes are comments: the text parses back to the same graph.
    let back = distc_ir::parse(&ir).unwrap_or_else(|e| panic!("{e}\n{ir}"));
    assert_eq!(distc_ir::print(&back), distc_ir::print(&c.programs.worker));
    insta::assert_snapshot!(ir);
}

#[test]
fn a_variable_that_does_not_split_evenly_is_refused_by_name() {
    let err = match compile(
        "dense.dsl",
        &std::fs::read_to_string(example("dense_mlp.dsl")).expect("example"),
        &CompileOptions {
            strategy: StrategyConfig {
                shard: [("w1".to_string(), 1)].into_iter().collect(),
                ..mesh(1, 7)
            },
            ..Default::default()
        },
    ) {
        Ok(_) => panic!("a split into 7 parts compiled"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("`w1`") && err.contains("7 equal parts"),
        "{err}"
    );
}

#[test]
fn mlp_lm_and_cnn_on_real_data_match_one_device() {
    let Some(dir) = distc_runtime::run::data::data_dir(None) else {
        eprintln!("SKIP: no data directory (DISTC_DATA) for MNIST");
        return;
    };
    let on_data = |strategy: StrategyConfig| VerifyOptions {
        compile: CompileOptions {
            data_dir: Some(dir.clone()),
            ..verify_opts(strategy).compile
        },
        ..verify_opts(StrategyConfig::default())
    };
    // mlp trains with Adam, whose first steps are g / (|g| + eps): a gradient element
    // near 1e-9, where summation order shows, moves by a good part of the learning
    // rate, so the example as written is held to 2e-4 (4 ranks sum w2's rows in
    // another order than one device: 1.1e-4 after one step). With SGD the same model
    // is held to 1e-5 (measured: 0 for model 2, 2.8e-7 for model 4).
    let src = std::fs::read_to_string(example("mlp.dsl")).expect("example");
    let sgd = src.replace(
        "optimizer  = adam(lr = 0.001)",
        "optimizer  = sgd(lr = 0.1)",
    );
    assert_ne!(src, sgd, "mlp.dsl's optimizer line changed");
    let tmp = tempfile::tempdir().expect("temp dir");
    let sgd_path = tmp.path().join("mlp_sgd.dsl");
    std::fs::write(&sgd_path, sgd).expect("writes the model");
    for model in [2, 4] {
        let r = verify(&sgd_path, &on_data(mesh(1, model)))
            .unwrap_or_else(|e| panic!("mlp (sgd) model={model}: {e}"));
        assert_passes(&format!("mlp (sgd) model={model}"), &r);
        let adam = VerifyOptions {
            tolerance: 2e-4,
            ..on_data(mesh(1, model))
        };
        let r =
            verify(&example("mlp.dsl"), &adam).unwrap_or_else(|e| panic!("mlp model={model}: {e}"));
        assert_passes(&format!("mlp (adam) model={model}"), &r);
    }
    // lm, vocabulary-parallel: the embedding table split by rows (each worker looks
    // up its ids, the lookups summed) and the output layer by columns (the logits
    // gathered before the loss). Adam as written (2e-4, see mlp above: 8e-5 with the
    // output layer split alone), SGD within 1e-5 (measured 1.7e-7).
    let lm_sgd = lm_with_sgd(tmp.path());
    for model in [2, 4] {
        let s = StrategyConfig {
            shard: [("emb".to_string(), 0), ("w2".to_string(), 1)]
                .into_iter()
                .collect(),
            ..mesh(1, model)
        };
        let r = verify(&lm_sgd, &on_data(s.clone()))
            .unwrap_or_else(|e| panic!("lm (sgd) model={model}: {e}"));
        assert_passes(&format!("lm (sgd) model={model}"), &r);
        let adam = VerifyOptions {
            tolerance: 2e-4,
            ..on_data(s)
        };
        let r =
            verify(&example("lm.dsl"), &adam).unwrap_or_else(|e| panic!("lm model={model}: {e}"));
        assert_passes(&format!("lm (adam) model={model}"), &r);
    }
    // Output channels of k1 split, input channels of k2: its sums are partial. And k2's
    // output channels split: the reshape keeps them split (blocks of each row), so the
    // classifier's rows are cut to match and its sums are partial.
    for model in [2, 4] {
        for shard in [vec![("k1", 0), ("k2", 1)], vec![("k2", 0)]] {
            let s = StrategyConfig {
                shard: shard.iter().map(|(v, d)| (v.to_string(), *d)).collect(),
                ..mesh(1, model)
            };
            let r = verify(&example("cnn.dsl"), &on_data(s))
                .unwrap_or_else(|e| panic!("cnn model={model} {shard:?}: {e}"));
            assert_passes(&format!("cnn model={model} {shard:?}"), &r);
        }
    }
    let c = compile(
        "cnn.dsl",
        &std::fs::read_to_string(example("cnn.dsl")).expect("example"),
        &CompileOptions {
            strategy: StrategyConfig {
                shard: [("k2".to_string(), 0)].into_iter().collect(),
                ..mesh(1, 2)
            },
            stop_after: Some("tensor_parallel".into()),
            batch: Some(4),
            data_dir: Some(dir.clone()),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let ir = distc_ir::print::print_with_notes(&c.programs.worker, &c.programs.worker_notes);
    assert!(ir.contains("reshape{shape=[4,392]}"), "{ir}");
    assert!(ir.contains(": f32[4,10]  // partial"), "{ir}");
    assert!(!ir.contains("model_gather"), "{ir}");
}

#[test]
fn shard_marks_in_the_model_split_what_they_name() {
    // Only the output layer, by columns (its logits gathered before the loss), and the
    // table of an embedding by columns: what the marks say, not the Megatron rule.
    let src = "model marked {\n  input ids: i32[B, 2]\n  input label: i32[B]\n  \
               param emb: f32[12, 8] = uniform(-0.1, 0.1) shard(1)\n  \
               param w1: f32[16, 16] = glorot\n  \
               param w2: f32[16, 12] = glorot shard(1)\n  \
               param b2: f32[12] = zeros\n  \
               x = reshape(embedding(emb, ids), [B, 16])\n  h = tanh(x @ w1)\n  \
               minimize softmax_cross_entropy(h @ w2 + b2, label)\n}\n\
               train {\n  data = zipf_tokens(vocab = 12, context = 2, classes = 12, s = 1.1)\n  \
               batch = 8\n  optimizer = adam(lr = 0.01)\n  steps = 3\n  seed = 5\n}\n";
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("marked.dsl");
    std::fs::write(&path, src).expect("writes the model");
    for model in [2, 4] {
        let c = compile(
            "marked.dsl",
            src,
            &CompileOptions {
                strategy: mesh(1, model),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let params: Vec<String> = c
            .programs
            .worker
            .params()
            .into_iter()
            .map(|(_, n, _)| n.to_string())
            .collect();
        assert!(
            params.contains(&"emb.tp".to_string()) && params.contains(&"w2.tp".to_string()),
            "{params:?}"
        );
        assert!(params.contains(&"w1".to_string()), "{params:?}");
        let r = verify(&path, &verify_opts(mesh(1, model)))
            .unwrap_or_else(|e| panic!("model={model}: {e}"));
        assert_passes(&format!("marked model={model}"), &r);
    }
}

#[test]
fn measured_bytes_per_step_equal_predicted() {
    use distc_passes::tensor_parallel::predicted_bytes_per_step;
    use distc_runtime::run::train::{train, TrainOptions};
    for (data, model, zero) in [(1, 2, 0), (1, 4, 0), (2, 2, 0), (2, 2, 3)] {
        let what = format!("data={data} model={model} zero={zero}");
        let c = distc::compile_file(
            &example("dense_mlp.dsl"),
            &CompileOptions {
                strategy: StrategyConfig {
                    zero,
                    ..mesh(data, model)
                },
                batch: Some(16),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let on_model_axis = predicted_bytes_per_step(&c.programs.worker);
        // Forward: [16,1024] summed. b1 splits with w1's columns, so nothing is gathered
        // backward (before issue 37 its gradient was: [1024/T] parts).
        let t = model as f64;
        let want = 2.0 * (t - 1.0) / t * (16.0 * 1024.0 * 4.0);
        assert_eq!(on_model_axis, want, "{what}");
        // The data axis: the gradients' all-reduce among the D copies of each part.
        let on_data_axis = c
            .dist
            .as_ref()
            .map_or(0.0, |d| d.predicted_bytes_per_step_per_worker());
        assert_eq!(on_data_axis > 0.0, data > 1, "{what}");
        let opts = TrainOptions {
            steps: Some(3),
            global_data: true,
            evaluate: false,
            ..TrainOptions::default()
        };
        let mut sent = Vec::new();
        train(c.programs(data * model), &c.config, &opts, &mut |m| {
            sent.push(m.bytes_sent as f64);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        // Step 1 also carries the data axis's initial broadcast.
        let predicted = on_model_axis + on_data_axis;
        for (step, &measured) in sent.iter().enumerate().skip(1) {
            let err = (measured - predicted).abs() / predicted;
            // A ring's chunks of an odd-sized bucket differ by an element between ranks.
            assert!(
                err < 1e-3,
                "{what}, step {}: measured {measured} B, predicted {predicted}",
                step + 1
            );
        }
    }
}

#[test]
fn zero_shards_each_part_over_the_data_axis() {
    // Each model rank's part of a split variable (and every whole one) is cut into
    // chunks over the D data workers: init cuts the part, then its chunk; the final
    // program gathers the chunks, then the parts.
    for zero in [1, 2, 3] {
        let s = StrategyConfig { zero, ..mesh(2, 2) };
        let c = distc::compile_file(
            &example("dense_mlp.dsl"),
            &CompileOptions {
                strategy: s.clone(),
                batch: Some(16),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("zero={zero}: {e}"));
        let params: Vec<String> = c
            .programs
            .worker
            .params()
            .into_iter()
            .map(|(_, n, _)| n.to_string())
            .collect();
        assert!(params.contains(&"w1.tp.zero".to_string()), "{params:?}");
        assert!(params.contains(&"w3.zero".to_string()), "{params:?}");
        let r = verify(&example("dense_mlp.dsl"), &verify_opts(s))
            .unwrap_or_else(|e| panic!("zero={zero}: {e}"));
        assert_passes(&format!("data=2 x model=2, ZeRO {zero}"), &r);
    }
    // One data replica has nothing to shard over.
    let e = StrategyConfig {
        zero: 1,
        ..mesh(1, 2)
    }
    .check()
    .expect_err("ZeRO on one data replica");
    assert!(e.contains("one data replica"), "{e}");
}

#[test]
fn a_whole_value_broadcast_along_the_split_dimension_gets_its_gradient_summed() {
    // `relu(x @ w1) * g` with `g = sigmoid(x @ wg)` of shape [B, 1]: g broadcasts along
    // w1's split columns, so each worker's gradient for it covers its columns alone and
    // must be summed (it enters the split computation). The Megatron rule passes over
    // wg (one column does not split) and pairs w1 with w2.
    let src = "model gated {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
               param w1: f32[8, 16] = glorot\n  param wg: f32[8, 1] = glorot\n  \
               param w2: f32[16, 4] = glorot\n  \
               g = sigmoid(x @ wg)\n  h = relu(x @ w1) * g\n  \
               minimize softmax_cross_entropy(h @ w2, label)\n}\n\
               train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 8\n  \
               optimizer = sgd(lr = 0.5)\n  steps = 3\n  seed = 9\n}\n";
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gated.dsl");
    std::fs::write(&path, src).expect("writes the model");
    for model in [2, 4] {
        let r = verify(&path, &verify_opts(mesh(1, model)))
            .unwrap_or_else(|e| panic!("model={model}: {e}"));
        assert_passes(&format!("gated model={model}"), &r);
        assert!(r.vars.iter().any(|v| v.name == "wg"));
    }
}

#[test]
fn data_model_and_pipe_meshes_match_one_device() {
    // Stages T workers wide: the Megatron pair's all-reduce runs inside a stage, the
    // activations cross stages per model rank, replicas average per stage and rank.
    for (data, model, pipe, micro, schedule) in [
        (1, 2, 2, 2, ScheduleKind::OneFOneB),
        (2, 2, 2, 2, ScheduleKind::GPipe),
        (1, 4, 2, 1, ScheduleKind::OneFOneB),
    ] {
        let what = format!("data={data} x model={model} x pipe={pipe}, {micro} micro ({schedule})");
        let s = StrategyConfig {
            schedule,
            ..mesh3(data, model, pipe, micro)
        };
        let r = verify(&example("dense_mlp.dsl"), &verify_opts(s))
            .unwrap_or_else(|e| panic!("dense_mlp {what}: {e}"));
        assert_passes(&format!("dense_mlp {what}"), &r);
        assert_eq!(r.global_batch, 16 * data * micro, "{what}");
    }
    let Some(dir) = distc_runtime::run::data::data_dir(None) else {
        eprintln!("SKIP: no data directory (DISTC_DATA) for Penn Treebank and MNIST");
        return;
    };
    let on_data = |strategy: StrategyConfig| VerifyOptions {
        compile: CompileOptions {
            data_dir: Some(dir.clone()),
            ..verify_opts(strategy).compile
        },
        ..verify_opts(StrategyConfig::default())
    };
    // lm, vocabulary-parallel (SGD: see mlp_lm_and_cnn_on_real_data_match_one_device),
    // and cnn with its channels split, each stage of each replica two workers wide.
    let tmp = tempfile::tempdir().expect("temp dir");
    let lm_sgd = lm_with_sgd(tmp.path());
    for (model, shard) in [
        (&lm_sgd, [("emb", 0), ("w2", 1)]),
        (&example("cnn.dsl"), [("k1", 0), ("k2", 1)]),
    ] {
        for data in [1, 2] {
            let s = StrategyConfig {
                shard: shard.iter().map(|(v, d)| (v.to_string(), *d)).collect(),
                ..mesh3(data, 2, 2, 2)
            };
            let r = verify(model, &on_data(s))
                .unwrap_or_else(|e| panic!("{} data={data}: {e}", model.display()));
            assert_passes(&format!("{} data={data}", model.display()), &r);
        }
    }
}

#[test]
fn a_partial_sum_beside_a_split_value_is_reduce_scattered() {
    // `(relu(x @ w1) @ w2) * sigmoid(x @ w3)`: the row-parallel product is partial, the
    // gate split by columns; the product is reduce-scattered to the gate's columns
    // (its gradient gathered back), and the classifier's rows are cut to match.
    let src = "model scattered {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
               param w1: f32[8, 16] = glorot\n  param w2: f32[16, 8] = glorot\n  \
               param w3: f32[8, 8] = glorot\n  param w4: f32[8, 4] = glorot\n  \
               param b4: f32[4] = zeros\n  \
               y = (relu(x @ w1) @ w2) * sigmoid(x @ w3)\n  \
               minimize softmax_cross_entropy(y @ w4 + b4, label)\n}\n\
               train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 8\n  \
               optimizer = sgd(lr = 0.5)\n  steps = 3\n  seed = 4\n}\n";
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("scattered.dsl");
    std::fs::write(&path, src).expect("writes the model");
    let shard = |model| StrategyConfig {
        shard: [("w1", 1), ("w2", 0), ("w3", 1)]
            .iter()
            .map(|(v, d)| (v.to_string(), *d))
            .collect(),
        ..mesh(1, model)
    };
    for model in [2, 4] {
        let c = compile(
            "scattered.dsl",
            src,
            &CompileOptions {
                strategy: shard(model),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let ir = distc_ir::print::print(&c.programs.worker);
        let count = |op: &str| ir.matches(&format!(" {op}{{")).count();
        assert_eq!(count("model_reduce_scatter"), 1, "{ir}");
        // Forward: the logits' partial sums; backward: the scattered product's
        // gradient and w4's cut rows' gradient gathered.
        assert_eq!(count("model_all_reduce"), 1, "{ir}");
        assert_eq!(count("model_gather"), 2, "{ir}");
        let r = verify(&path, &verify_opts(shard(model)))
            .unwrap_or_else(|e| panic!("model={model}: {e}"));
        assert_passes(&format!("scattered model={model}"), &r);
        // What the workers send is what the plan predicts: a reduce-scatter sends
        // (T-1)/T of its input.
        use distc_passes::tensor_parallel::predicted_bytes_per_step;
        use distc_runtime::run::train::{train, TrainOptions};
        let predicted = predicted_bytes_per_step(&c.programs.worker);
        let (b, t) = (8.0, model as f64);
        let want = (t - 1.0) / t * (b * 8.0 * 4.0)
            + 2.0 * (t - 1.0) / t * (b * 4.0 * 4.0)
            + (t - 1.0) * (b * 8.0 / t * 4.0)
            + (t - 1.0) * (8.0 / t * 4.0 * 4.0);
        assert_eq!(predicted, want, "model={model}");
        let opts = TrainOptions {
            steps: Some(2),
            evaluate: false,
            ..TrainOptions::default()
        };
        let mut sent = Vec::new();
        train(c.programs(model), &c.config, &opts, &mut |m| {
            sent.push(m.bytes_sent as f64);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        for measured in sent {
            assert_eq!(measured, predicted, "model={model}");
        }
    }
}

/// Issue 40, item 2: a training state moves into and out of a model axis. A run on
/// data 2 x model 2 (also with ZeRO 3's chunks of the parts) writes its state whole (the final program gathers each part and
/// each part's Adam slots: no `.tp` key, the one-device shapes); resumed on the same
/// mesh (the init program splits the variables and their slots again) it ends bit for
/// bit where the uninterrupted run ends (a regression: the state counted the model
/// ranks as replicas in its data position, so the resumed run skipped batches); and a
/// one-device state resumed on a model axis of 2 ends where one device ends, within
/// the split's rounding.
#[test]
fn training_states_move_into_and_out_of_a_model_axis() {
    use distc_runtime::core::checkpoint::{load_state, TrainingState};
    use distc_runtime::run::train::{train, CheckpointEvery, TrainOptions};
    use std::collections::HashMap;
    use std::sync::Arc;
    let src = "model wide {\n  input x: f32[B, 16]\n  input label: i32[B]\n  \
               param w1: f32[16, 32] = glorot\n  param b1: f32[32] = zeros\n  \
               param w2: f32[32, 8] = glorot\n  \
               minimize softmax_cross_entropy(relu(x @ w1 + b1) @ w2, label)\n}\n\
               train {\n  data = gaussian_classes(features = 16, classes = 8)\n  \
               batch = 16\n  optimizer = adam(lr = 0.01)\n  steps = 4\n  seed = 5\n}\n";
    let plan = |strategy: StrategyConfig| {
        compile(
            "wide.dsl",
            src,
            &CompileOptions {
                strategy,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let run = |c: &distc::Compiled,
               n: usize,
               save: Option<&std::path::Path>,
               resume: Option<TrainingState>|
     -> HashMap<String, distc_runtime::core::value::Tensor> {
        let steps = if save.is_some() { 2 } else { 4 };
        let opts = TrainOptions {
            steps: Some(steps),
            evaluate: false,
            checkpoint: save.map(|p| CheckpointEvery::new(p.to_path_buf(), steps, "test".into())),
            resume: resume.map(Arc::new),
            ..TrainOptions::default()
        };
        train(c.programs(n), &c.config, &opts, &mut |_| Ok(()))
            .unwrap_or_else(|e| panic!("{e}"))
            .params
    };
    let one = plan(StrategyConfig::default());
    for (what, strategy) in [
        ("data 2 x model 2", mesh(2, 2)),
        (
            "ZeRO 3 on data 2 x model 2",
            StrategyConfig {
                zero: 3,
                ..mesh(2, 2)
            },
        ),
    ] {
        let tp = plan(strategy);
        let whole = run(&tp, 4, None, None);
        let tp_state = dir.path().join("tp.state");
        run(&tp, 4, Some(&tp_state), None);
        let state = load_state(&tp_state).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            !state
                .params
                .keys()
                .chain(state.optimizer.keys())
                .any(|k| k.contains(".tp")),
            "parts in the state: {:?}",
            state.params.keys().collect::<Vec<_>>()
        );
        assert_eq!(state.params["w1"].shape(), [16, 32]);
        assert_eq!(state.optimizer["w1/m"].shape(), [16, 32]);
        assert_eq!(state.optimizer["w2/v"].shape(), [32, 8]);
        let resumed = run(&tp, 4, None, Some(state));
        for (name, w) in &whole {
            assert!(
                resumed.get(name) == Some(w),
                "{what}: `{name}` differs after resuming on the model axis"
            );
        }
    }
    // One device's state, resumed on a model axis of 2 (the same batch a step).
    let one_whole = run(&one, 1, None, None);
    let one_state = dir.path().join("one.state");
    run(&one, 1, Some(&one_state), None);
    let state = load_state(&one_state).unwrap_or_else(|e| panic!("{e}"));
    let moved = run(&plan(mesh(1, 2)), 2, None, Some(state));
    for (name, w) in &one_whole {
        let (a, b) = (moved[name].to_f64_vec(), w.to_f64_vec());
        let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-6);
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(
            worst <= 1e-5 * scale,
            "`{name}`: {worst:e} from one device's (scale {scale:e})"
        );
    }
}

/// Issue 67, item 8: a nonlinearity right after a row-split product. In
/// `tanh(relu(x @ w1) @ w2) @ w3` the pair (w1 by columns, w2 by rows) leaves each model
/// rank a partial sum of `relu(x @ w1) @ w2`: it must be summed over the model axis
/// before the tanh, which is not linear (a sum after it would not be the same).
#[test]
fn a_row_split_products_partial_sum_is_summed_before_a_nonlinearity() {
    let src = "model deep {\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
               param w1: f32[8, 16] = glorot\n  param w2: f32[16, 12] = glorot\n  \
               param w3: f32[12, 4] = glorot\n  \
               h = tanh(relu(x @ w1) @ w2)\n  \
               minimize softmax_cross_entropy(h @ w3, label)\n}\n\
               train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 8\n  \
               optimizer = sgd(lr = 0.5)\n  steps = 3\n  seed = 9\n}\n";
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("deep.dsl");
    std::fs::write(&path, src).expect("writes the model");
    for (data, model) in [(1, 2), (2, 2), (1, 4)] {
        let r = verify(&path, &verify_opts(mesh(data, model)))
            .unwrap_or_else(|e| panic!("data={data} model={model}: {e}"));
        assert_passes(&format!("deep data={data} model={model}"), &r);
        assert!(r.vars.iter().any(|v| v.name == "w2"));
    }
}
