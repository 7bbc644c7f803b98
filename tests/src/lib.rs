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

/// The example model `name` (`mlp.dsl`) in examples/.
pub fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}
