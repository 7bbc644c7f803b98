//! End-to-end tests live in tests/; this is what they share.

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
/// backend builds them.
pub fn optimizer_plan(
    g: &distc_ir::Graph,
    spec: &distc_runtime::core::config::OptimizerSpec,
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
    optimizer_kernels(spec, &[], &params, &copies, 1.0).expect("optimizer kernels")
}
