//! Tensor parallelism (issue 23): variables split over a mesh's model axis train what
//! one device trains, alone and with a data axis; the sharding pass's rewrite is
//! snapshotted.

use distc::verify::{verify, VerifyOptions};
use distc::{compile, CompileOptions};
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
    // w1 by columns, w2 by rows. Forward: x enters the split computation (`f`), the
    // row-parallel partial sums are summed before b2 (`g`); backward: the gradient
    // enters back through `g`'s rule, x (an input) needs no gradient, and b1's cut
    // gathers its gradient.
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
    assert_eq!(count("model_gather"), 1, "{ir}");
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
