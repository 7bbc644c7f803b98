//! Hierarchical all-reduce (issue 25, item 1): the `hierarchy` pass marks each dense
//! all-reduce flat or hierarchical from the two links' costs (snapshot), the mark
//! prints and parses, and a plan with hierarchical all-reduces trains what one device
//! trains (`verify`) for several node shapes, ZeRO-free all-reduce with fused buckets.

use distc::verify::{verify, VerifyOptions};
use distc::{compile_file, CompileOptions};
use distc_ir::Op;
use distc_passes::placement::{Link, Strategy, StrategyConfig};
use distc_tests::example;
use std::time::Duration;

fn nodes(workers: usize, local: usize, intra: Link) -> StrategyConfig {
    StrategyConfig {
        strategy: Strategy::Allreduce,
        workers,
        ranks_per_node: local,
        intra_link: intra,
        ..Default::default()
    }
}

/// `(ranks_per_node of each dense all-reduce, the worker program's text)`.
fn marks(s: StrategyConfig) -> (Vec<usize>, String) {
    let c = compile_file(
        &example("dense_mlp.dsl"),
        &CompileOptions {
            strategy: s,
            batch: Some(16),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let g = &c.programs.worker;
    let marks = g
        .topo_order()
        .into_iter()
        .filter_map(|id| match g.op(id) {
            Op::AllReduce { ranks_per_node, .. } => Some(*ranks_per_node),
            _ => None,
        })
        .collect();
    (marks, distc_ir::print(g))
}

#[test]
fn the_cost_model_picks_hierarchical_on_a_fast_node_and_flat_on_a_slow_one() {
    // NVLink-class within a node, 10 Gbit/s between: both buckets go hierarchical.
    let (fast, ir) = marks(nodes(8, 4, Link::default_intra()));
    assert_eq!(fast, vec![4, 4], "{ir}");
    let all_reduces: String = ir
        .lines()
        .filter(|l| l.contains("all_reduce"))
        .map(|l| format!("{l}\n"))
        .collect();
    insta::assert_snapshot!(all_reduces);
    // The mark survives printing and parsing.
    let parsed = distc_ir::parse(&ir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(distc_ir::print(&parsed), ir);
    // A node link ten times slower than the network: the flat ring is cheaper.
    let slow = Link {
        bandwidth: 1.25e8,
        latency: 25e-6,
    };
    let (flat, ir) = marks(nodes(8, 4, slow));
    assert_eq!(flat, vec![0, 0], "{ir}");
    // One node: nothing to do.
    let (one, ir) = marks(nodes(4, 4, Link::default_intra()));
    assert_eq!(one, vec![0, 0], "{ir}");
}

#[test]
fn hierarchical_all_reduces_train_what_one_device_trains() {
    for (workers, local) in [(4, 2), (6, 3), (6, 2), (8, 4)] {
        let opts = VerifyOptions {
            compile: CompileOptions {
                strategy: nodes(workers, local, Link::default_intra()),
                batch: Some(8),
                ..Default::default()
            },
            steps: 3,
            tolerance: 1e-4,
            timeout: Duration::from_secs(60),
            device: None,
            init: None,
        };
        let r = verify(&example("dense_mlp.dsl"), &opts).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            r.passed(),
            "{workers} workers in nodes of {local}: {:?}",
            r.vars
        );
    }
}

#[test]
fn nodes_that_do_not_divide_the_workers_are_refused() {
    let Err(e) = compile_file(
        &example("dense_mlp.dsl"),
        &CompileOptions {
            strategy: nodes(6, 4, Link::default_intra()),
            ..Default::default()
        },
    ) else {
        panic!("6 workers in nodes of 4 compiled");
    };
    assert!(e.to_string().contains("cannot fill nodes of 4"), "{e}");
}
