//! Pipeline stages and a mesh's model axis on the CUDA backend (issue 38, item 1):
//! every mesh and pipeline `verify` passes on the CPU (tests/tests/tensor_parallel.rs,
//! tests/tests/pipeline.rs) trains the same weights with each worker on a GPU,
//! against one device on the GPU. 2, 4 and 8 ranks: the model-axis ops' kernels
//! (`model_split`, the vocabulary-parallel lookup and its gradient), a stage's forward
//! beside its backward on one device, the data axis, the model axis (a stage's
//! forward's through the host) and the messages between stages on emulated NCCL.
//! Needs a GPU, or the GPU emulator
//! (`DISTC_CUDA_EMULATOR=1`, as CI runs it); without either each test says why it
//! skips.

use distc::verify::{verify, VerifyOptions};
use distc::CompileOptions;
use distc_ir::pipeline::schedule::ScheduleKind;
use distc_passes::placement::StrategyConfig;
use distc_tests::{example, mesh};
use std::path::Path;
use std::time::Duration;

/// Verifies `file` under `strategy` on the GPU: both sides (the mesh's workers and the
/// one device) on GPU 0, within `tolerance` of the largest weight.
fn passes_on_the_gpu(file: &Path, strategy: StrategyConfig, data: bool, tolerance: f64) {
    let what = format!("{} {:?}", file.display(), strategy);
    let opts = VerifyOptions {
        compile: CompileOptions {
            strategy,
            // Every emulated GPU thread runs on this machine's cores.
            batch: Some(16),
            data_dir: if data {
                distc_runtime::run::data::data_dir(None)
            } else {
                None
            },
            ..Default::default()
        },
        steps: 3,
        tolerance,
        timeout: Duration::from_secs(120),
        device: Some(0),
        init: None,
    };
    let r = verify(file, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
    let w = r.worst().expect("variables");
    assert!(
        r.passed(),
        "{what}: `{}` differs by {:.2e} (tolerance {:.0e})",
        w.name,
        w.relative,
        r.tolerance
    );
    println!("{what}: worst {:.2e} (`{}`)", w.relative, w.name);
}

#[test]
fn model_axes_and_pipelines_match_one_device_on_the_gpu() {
    if !distc_tests::gpu_or_skip("meshes on the GPU") {
        return;
    }
    let mlp = example("dense_mlp.dsl");
    // The Megatron pair on 2 and 4 model ranks, with a data axis; stages alone, with
    // replicas (the data axis on NCCL), and T workers wide; both schedules.
    for (data, model, pipe, micro, schedule) in [
        (1, 2, 1, 1, ScheduleKind::OneFOneB),
        (1, 4, 1, 1, ScheduleKind::OneFOneB),
        (2, 2, 1, 1, ScheduleKind::OneFOneB),
        (1, 1, 2, 3, ScheduleKind::GPipe),
        (2, 1, 2, 2, ScheduleKind::OneFOneB),
        (1, 4, 2, 1, ScheduleKind::OneFOneB),
        (2, 2, 2, 2, ScheduleKind::GPipe),
    ] {
        let s = StrategyConfig {
            schedule,
            ..mesh(data, model, pipe, micro)
        };
        passes_on_the_gpu(&mlp, s, false, 1e-5);
    }
}

#[test]
fn a_partial_sum_is_reduce_scattered_on_the_gpu() {
    if !distc_tests::gpu_or_skip("reduce-scatter on a model axis on the GPU") {
        return;
    }
    // The row-parallel product's partial sum meets a split gate: a model-axis
    // reduce-scatter (its gradient a gather).
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
    let s = StrategyConfig {
        shard: [("w1", 1), ("w2", 0), ("w3", 1)]
            .iter()
            .map(|(v, d)| (v.to_string(), *d))
            .collect(),
        ..mesh(1, 2, 1, 1)
    };
    passes_on_the_gpu(&path, s, false, 1e-5);
}

#[test]
fn vocabulary_parallel_lm_and_split_cnn_on_the_gpu() {
    if !distc_tests::gpu_or_skip("vocabulary parallelism on the GPU") {
        return;
    }
    if distc_runtime::run::data::data_dir(None).is_none() {
        println!("skipping: no data directory (DISTC_DATA) for Penn Treebank and MNIST");
        return;
    }
    // lm with SGD (Adam's first steps amplify rounding: see tensor_parallel.rs): the
    // table split by rows (`model_embedding` and its gradient's compaction), the
    // output layer by columns; alone and as stages of two replicas.
    let src = std::fs::read_to_string(example("lm.dsl")).expect("example");
    let sgd = src.replace(
        "optimizer    = adam(lr = 0.002)",
        "optimizer    = sgd(lr = 0.5)",
    );
    assert_ne!(src, sgd, "lm.dsl's optimizer line changed");
    let dir = tempfile::tempdir().expect("temp dir");
    let lm = dir.path().join("lm_sgd.dsl");
    std::fs::write(&lm, sgd).expect("writes the model");
    let shard = |pairs: &[(&str, usize)], s: StrategyConfig| StrategyConfig {
        shard: pairs.iter().map(|(v, d)| (v.to_string(), *d)).collect(),
        ..s
    };
    for s in [mesh(1, 2, 1, 1), mesh(2, 2, 2, 2)] {
        passes_on_the_gpu(&lm, shard(&[("emb", 0), ("w2", 1)], s), true, 1e-5);
    }
    // cnn's channels split (the convolutions' partial sums), as stages of replicas.
    let s = shard(&[("k1", 0), ("k2", 1)], mesh(2, 2, 2, 2));
    passes_on_the_gpu(&example("cnn.dsl"), s, true, 1e-4);
}

/// Issue 59: a GPU pipeline evaluates on its GPU (worker 0's device), as a worker
/// evaluates on its own, not on the host: the evaluation says which device ran it,
/// and its loss is the host's evaluation of the same trained variables.
#[test]
fn a_pipeline_on_the_gpu_evaluates_on_the_gpu() {
    use distc_runtime::cuda::nccl::Collectives;
    use distc_runtime::cuda::{worker_backend, CudaOptions};
    use distc_runtime::run::eval::evaluate_weights;
    use distc_runtime::run::train::{train_with, TrainOptions};
    if !distc_tests::gpu_or_skip("a pipeline's evaluation on the GPU") {
        return;
    }
    let mut src = String::from("model deep4 {\n  input x: f32[B, 8]\n  input label: i32[B]\n");
    for k in 0..4 {
        src += &format!("  param w{k}: f32[8, 8] = glorot\n  param b{k}: f32[8] = zeros\n");
    }
    src += "  param wo: f32[8, 4] = glorot\n  h0 = x\n";
    for k in 0..4 {
        src += &format!("  h{} = tanh(h{k} @ w{k} + b{k})\n", k + 1);
    }
    src += "  minimize softmax_cross_entropy(h4 @ wo, label)\n}\n\
            train {\n  data = gaussian_classes(features = 8, classes = 4)\n  batch = 8\n  \
            optimizer = sgd(lr = 0.5)\n  steps = 3\n  seed = 4\n  eval_samples = 64\n}\n";
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("deep4.dsl");
    std::fs::write(&path, src).expect("writes the model");
    let c = distc::compile_file(
        &path,
        &distc::CompileOptions {
            strategy: mesh(1, 1, 2, 2),
            ..Default::default()
        },
    )
    .expect("compiles");
    let cuda = CudaOptions {
        graphs: false,
        ..Default::default()
    };
    let report = train_with(
        c.programs(2),
        &c.config,
        &TrainOptions::default(),
        &mut |_| Ok(()),
        |site, links| worker_backend(site, cuda, 0, Collectives::Host, links),
    )
    .expect("trains");
    let eval = report.eval.expect("the run evaluates after its last step");
    let device = eval.eval_device.clone().unwrap_or_default();
    assert!(device.starts_with("cuda:0"), "evaluated on {device}");
    let host = evaluate_weights(&c.programs.worker, &c.config, &report.params, None)
        .expect("the host evaluates the trained variables");
    assert_eq!(host.eval_device.as_deref(), Some("cpu"));
    assert_eq!(eval.eval_samples, host.eval_samples);
    let gap = (eval.eval_loss - host.eval_loss).abs() / host.eval_loss.abs().max(1e-12);
    assert!(
        gap < 1e-5,
        "eval_loss {} on {device}, {} on the host",
        eval.eval_loss,
        host.eval_loss
    );
}
