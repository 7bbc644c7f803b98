//! Issue 12.8: compile time grows with the graph, not faster. A deep generated MLP
//! (the one `distc bench --compile` times) compiles under every kind of pipeline, and
//! each pass's record carries its time. No timing thresholds: the counting tests in
//! `passes/src/simplify.rs` hold the scaling.

use distc::bench::{deep_model, deep_model_nodes};
use distc::{compile, CompileOptions};
use distc_passes::placement::{Strategy, StrategyConfig};

const LAYERS: usize = 270;

fn compiled(strategy: StrategyConfig) -> distc::Compiled {
    let opts = CompileOptions {
        strategy,
        ..Default::default()
    };
    compile("deep.dsl", &deep_model(LAYERS), &opts).expect("compiles")
}

#[test]
fn deep_model_compiles_and_every_pass_has_a_time() {
    let configs = [
        StrategyConfig::default(),
        StrategyConfig {
            strategy: Strategy::Hybrid,
            workers: 2,
            servers: 2,
            ..Default::default()
        },
        StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: 2,
            zero: 3,
            accumulate: 2,
            ..Default::default()
        },
    ];
    for config in configs {
        let c = compiled(config.clone());
        let autodiff = &c.records[0];
        assert_eq!(autodiff.name, "autodiff");
        assert_eq!(autodiff.nodes.1, deep_model_nodes(LAYERS), "{config:?}");
        assert!(c.records.len() >= 4);
        for r in &c.records {
            // The verifier alone walks thousands of nodes: never zero time.
            assert!(!(r.time + r.verify).is_zero(), "{} has no time", r.name);
            let line = r.to_string();
            assert!(line.starts_with(&r.name) && line.contains(" ms"), "{line}");
        }
        distc_ir::verify(&c.programs.worker).expect("the final graph verifies");
    }
}
