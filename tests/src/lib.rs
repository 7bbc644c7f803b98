//! End-to-end tests live in tests/; this is what they share.

use distc_runtime::run::metrics::StepMetrics;
use std::path::{Path, PathBuf};

/// Every example model, each of which the memory, ZeRO, accumulation and remat tests
/// verify.
pub const EXAMPLES: [&str; 6] = [
    "sparse_lm.dsl",
    "dense_mlp.dsl",
    "mlp.dsl",
    "cnn.dsl",
    "lm.dsl",
    "recsys.dsl",
];

/// The example model `name` (`mlp.dsl`) in examples/: of the repository at
/// `DISTC_REPO` when set (a test binary run on another machine, see
/// scripts/gpu-suite.sh), else of the one it was built from.
pub fn example(name: &str) -> PathBuf {
    let root = std::env::var_os("DISTC_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    root.join("examples").join(name)
}

/// A mesh of `data` replicas x `model` model ranks x `pipe` stages, `micro`
/// micro-batches a step: all-reduce over the replicas, one device's layout (`single`)
/// without them; one replica of a pipeline alone is one worker (its stages are its
/// ranks), as `--mesh` compiles it.
pub fn mesh(
    data: usize,
    model: usize,
    pipe: usize,
    micro: usize,
) -> distc_passes::placement::StrategyConfig {
    use distc_passes::placement::{Strategy, StrategyConfig};
    StrategyConfig {
        strategy: if data > 1 {
            Strategy::Allreduce
        } else {
            Strategy::Single
        },
        workers: if data * model == 1 {
            1
        } else {
            data * model * pipe
        },
        model,
        pipeline: pipe,
        micro_batches: micro,
        ..Default::default()
    }
}

/// Whether NVRTC is there to compile generated CUDA: in the folders of
/// `DISTC_CUDA_LIB_DIR`, then in the repository's `.nvrtc/` (what
/// `scripts/install-nvrtc.sh` fills). Without it `test` skips, saying why, except in
/// CI (`CI` set), where the install script ran: there it fails.
pub fn nvrtc_or_skip(test: &str) -> bool {
    use distc_runtime::cuda::{probe, CudaLib, LibDirs};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dirs = LibDirs::from_env().with(root.join(".nvrtc/nvidia/cu13/lib"));
    let in_ci = std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false");
    match probe(CudaLib::Nvrtc, &dirs) {
        Ok(found) => {
            eprintln!("{test}: NVRTC found {found}");
            true
        }
        Err(e) if in_ci => panic!("{test}: NVRTC is required in CI (CI is set): {e}"),
        Err(e) => {
            eprintln!("SKIP {test}: {e}");
            false
        }
    }
}

/// Whether a GPU test can run: the emulator was asked for (`DISTC_CUDA_EMULATOR=1`),
/// or a GPU and the CUDA libraries are found. Otherwise it says why `test` skips.
pub fn gpu_or_skip(test: &str) -> bool {
    if distc_runtime::cuda::backend::emulator_requested() {
        return true;
    }
    match distc_runtime::cuda::require_gpu(&distc_runtime::cuda::LibDirs::from_env()) {
        Ok(_) => true,
        Err(e) => {
            println!("skipping {test}: {e}");
            false
        }
    }
}

/// The optimizer's CUDA kernels for every variable `g` has a gradient of, as the CUDA
/// backend builds them (`lazy`: `RunConfig::lazy_updates`).
pub fn optimizer_plan(
    g: &distc_ir::Graph,
    (spec, lazy): (&distc_runtime::core::config::OptimizerSpec, bool),
) -> distc_runtime::cuda::codegen::OptimizerPlan {
    use distc_runtime::cuda::codegen::{optimizer_kernels, sparse_bound, weight_copies};
    let params: Vec<(String, distc_ir::TensorType, Option<usize>)> = g
        .param_grads()
        .into_iter()
        .filter_map(|(name, v)| {
            let ty = g
                .params()
                .into_iter()
                .find(|(_, n, _)| *n == name)
                .map(|(_, _, t)| t.clone())?;
            Some((name, ty, sparse_bound(g.value_type(v))))
        })
        .collect();
    let copies = weight_copies(g).into_values().collect();
    optimizer_kernels(spec, &[], lazy, &params, &copies, 1.0).expect("optimizer kernels")
}

/// A model whose input projection `e` is also its output layer (tied), `layers` tanh
/// layers between: `e` is read on the first stage and the last.
pub fn tied(layers: usize) -> String {
    let mut s = "model tied {\n  input x: f32[B, 16]\n  input label: i32[B]\n  \
                 param e: f32[16, 16] = glorot\n"
        .to_string();
    for k in 0..layers {
        s += &format!("  param w{k}: f32[16, 16] = glorot\n");
    }
    s += "  h0 = tanh(x @ e)\n";
    for k in 0..layers {
        s += &format!("  h{} = tanh(h{k} @ w{k})\n", k + 1);
    }
    s += &format!(
        "  minimize softmax_cross_entropy(h{layers} @ e, label)\n}}\n\
         train {{\n  data = gaussian_classes(features = 16, classes = 16)\n  batch = 8\n  \
         optimizer = sgd(lr = 0.1)\n  steps = 3\n  seed = 1\n}}\n"
    );
    s
}

/// A model whose loss is 1000 times a cross-entropy, trained by `optimizer` for 12
/// steps: its fp16 gradients overflow at the first loss scales, so the scale comes
/// down over about 8 skipped steps, then steps update.
pub fn fp16_overflowing_model(optimizer: &str) -> String {
    format!(
        "model big {{\n  input x: f32[B, 8]\n  input label: i32[B]\n  \
         param w1: f32[8, 16] = glorot\n  param w2: f32[16, 4] = glorot\n  \
         minimize 1000.0 * softmax_cross_entropy(relu(x @ w1) @ w2, label)\n}}\n\
         train {{\n  data = gaussian_classes(features = 8, classes = 4)\n  \
         batch = 16\n  optimizer = {optimizer}\n  steps = 12\n  seed = 7\n}}\n"
    )
}

/// fp16 steps replayed from a CUDA graph against the same steps run eagerly and on the
/// CPU, each as `(report, every step's metrics)`: steps 3 on are replays, the
/// replays both skip and update, every step's skipped count is eager's and the CPU's,
/// its loss scale and loss eager's, and the final weights eager's, bit for bit.
pub fn assert_fp16_replays_match(
    what: &str,
    graphs: &(distc_runtime::run::train::TrainReport, Vec<StepMetrics>),
    eager: &(distc_runtime::run::train::TrainReport, Vec<StepMetrics>),
    cpu: &[StepMetrics],
) {
    let ((got, gm), (want, wm)) = (graphs, eager);
    let steps = gm.len();
    let replayed: Vec<usize> = gm.iter().filter(|m| m.cuda_graph).map(|m| m.step).collect();
    assert_eq!(
        replayed,
        (3..=steps).collect::<Vec<_>>(),
        "{what}: replayed steps"
    );
    assert!(
        wm.iter().all(|m| !m.cuda_graph),
        "{what}: an eager step replayed"
    );
    let skipped = |m: &[StepMetrics]| m.iter().map(|m| m.skipped_steps).collect::<Vec<_>>();
    let (at_capture, at_end) = (gm[2].skipped_steps, gm[steps - 1].skipped_steps);
    assert!(
        at_capture.is_some_and(|a| a >= 3) && at_end > at_capture && at_end < Some(steps),
        "{what}: replays should both skip and update: skipped {:?}",
        skipped(gm)
    );
    assert_eq!(
        skipped(gm),
        skipped(wm),
        "{what}: skipped, graphs against eager"
    );
    assert_eq!(
        skipped(gm),
        skipped(cpu),
        "{what}: skipped, graphs against the CPU"
    );
    let scales = |m: &[StepMetrics]| m.iter().map(|m| m.loss_scale).collect::<Vec<_>>();
    assert_eq!(scales(gm), scales(wm), "{what}: loss scales");
    let losses = |m: &[StepMetrics]| m.iter().map(|m| m.loss).collect::<Vec<_>>();
    assert_eq!(
        losses(gm),
        losses(wm),
        "{what}: losses, graphs against eager"
    );
    for (var, w) in &want.params {
        assert!(
            got.params.get(var) == Some(w),
            "{what}: `{var}` differs between graphs and eager steps"
        );
    }
}
