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
