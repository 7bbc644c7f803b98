//! The strategies' decisions on the standard workloads: predicted bytes per step equal
//! the hand computation of ../shared/WORKLOADS.md; hybrid partitions the embedding over
//! the servers and buckets the dense layers; auto places W1 like hybrid and W2 like
//! all-reduce.

use distc::{compile_file, CompileOptions, Compiled};
use distc_passes::placement::{Kind, Mechanism, Strategy, StrategyConfig};
use std::path::Path;

fn compile(
    stem: &str,
    strategy: Strategy,
    workers: usize,
    servers: usize,
    sparse_as_dense: bool,
) -> Compiled {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../examples/{stem}.dsl"));
    let strategy = StrategyConfig {
        strategy,
        workers,
        servers,
        sparse_as_dense,
        ..Default::default()
    };
    compile_file(
        &path,
        &CompileOptions {
            strategy,
            ..Default::default()
        },
    )
    .expect("compiles")
}

/// WORKLOADS.md, W1: dense gradients 4,151,200 B, all variables 55,351,200 B, a row
/// 512 B plus an 8-byte id on the wire.
const DENSE: f64 = 4_151_200.0;
const ALL: f64 = 55_351_200.0;
const ROW: f64 = 512.0 + 8.0;

#[test]
fn predicted_bytes_match_workloads_md() {
    for n in [2usize, 4] {
        let nf = n as f64;
        let ring = |b: f64| 2.0 * (nf - 1.0) / nf * b;
        let cases = [
            ("all-reduce everything", Strategy::Allreduce, 0, true),
            ("sparse all-gather", Strategy::Allreduce, 0, false),
            ("hybrid", Strategy::Hybrid, 2, false),
            ("all on PS", Strategy::Ps, 2, false),
        ];
        for (what, strategy, servers, dense) in cases {
            let c = compile("sparse_lm", strategy, n, servers, dense);
            let dist = c.dist.expect("placement");
            let d = dist.var("emb").expect("emb").rows_touched;
            // WORKLOADS.md: 862.5 distinct rows per worker batch on average.
            assert!(
                (d - 862.5).abs() / 862.5 < 0.03,
                "measured {d} distinct rows"
            );
            let hand = match what {
                // Densified, the table travels with a mask of the rows the batch touched
                // (one f32 per row), so the update stays lazy as on one device.
                "all-reduce everything" => ring(ALL + 100_000.0 * 4.0),
                "sparse all-gather" => ring(DENSE) + (nf - 1.0) * d * ROW,
                "hybrid" => ring(DENSE) + 2.0 * d * ROW,
                _ => 2.0 * DENSE + 2.0 * d * ROW,
            };
            let predicted = dist.predicted_bytes_per_step_per_worker();
            assert!(
                (predicted - hand).abs() <= 1e-9 * hand,
                "{what}, {n} workers: predicted {predicted}, by hand {hand}"
            );
        }
    }
}

#[test]
fn hybrid_partitions_the_embedding_and_buckets_the_dense_layers() {
    let hybrid = compile("sparse_lm", Strategy::Hybrid, 4, 2, false)
        .dist
        .expect("placement");
    let emb = hybrid.var("emb").expect("emb");
    assert_eq!(emb.placement, Mechanism::Ps);
    let servers: Vec<usize> = emb.shards.iter().map(|s| s.server).collect();
    assert_eq!(servers, [0, 1]);
    assert_eq!(
        (emb.shards[0].start, emb.shards[0].end, emb.shards[1].end),
        (0, 50_000, 100_000)
    );
    for v in hybrid.vars.iter().filter(|v| v.kind == Kind::Dense) {
        assert_eq!(v.placement, Mechanism::Allreduce, "{}", v.name);
        assert!(v.bucket.is_some(), "{} has no bucket", v.name);
    }
    let allreduce = compile("sparse_lm", Strategy::Allreduce, 4, 0, true)
        .dist
        .expect("placement");
    let (h, a) = (
        hybrid.predicted_bytes_per_step_per_worker(),
        allreduce.predicted_bytes_per_step_per_worker(),
    );
    assert!(
        h * 10.0 < a,
        "hybrid {h} B/step is not far below all-reduce {a} B/step"
    );
}

#[test]
fn auto_places_w1_like_hybrid_and_w2_like_allreduce() {
    let auto = compile("sparse_lm", Strategy::Auto, 4, 2, false)
        .dist
        .expect("placement");
    let hybrid = compile("sparse_lm", Strategy::Hybrid, 4, 2, false)
        .dist
        .expect("placement");
    for (a, h) in auto.vars.iter().zip(&hybrid.vars) {
        assert_eq!(
            (a.placement, &a.shards),
            (h.placement, &h.shards),
            "{}: {}",
            a.name,
            a.reason
        );
        assert!(a.runner_up.is_some(), "{} has no runner-up", a.name);
    }
    let w2 = compile("dense_mlp", Strategy::Auto, 4, 2, false)
        .dist
        .expect("placement");
    assert!(
        w2.vars.iter().all(|v| v.placement == Mechanism::Allreduce),
        "{:?}",
        w2.vars
    );
}

#[test]
fn fusion_caps_buckets_and_keeps_backward_order() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/dense_mlp.dsl");
    let strategy = StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 2,
        bucket_mb: 4.0,
        ..Default::default()
    };
    let c = compile_file(
        &path,
        &CompileOptions {
            strategy,
            ..Default::default()
        },
    )
    .expect("compiles");
    let dist = c.dist.expect("placement");
    let order: Vec<&str> = dist
        .buckets
        .iter()
        .flat_map(|b| b.vars.iter().map(String::as_str))
        .collect();
    // The backward pass produces the last layer's gradients first.
    assert_eq!(order, ["b3", "w3", "b2", "w2", "b1", "w1"]);
    assert!(
        dist.buckets[0].bytes <= 1 << 20,
        "first bucket {} B",
        dist.buckets[0].bytes
    );
    for b in &dist.buckets[1..] {
        assert!(
            b.bytes <= 4 << 20 || b.vars.len() == 1,
            "bucket {} holds {} B",
            b.id,
            b.bytes
        );
    }
    let text = distc_ir::print(&c.programs.worker);
    assert!(
        text.contains(" = pack ") && text.contains(" = unpack{"),
        "{text}"
    );
}
