//! Issue 35 item 13: lowering went quadratic (each statement rescanned every variable
//! for its first user, to find its pipeline stage) and compile time grew 18-40x before
//! anyone noticed. No clock here: the graph queries count the nodes and edges they
//! visit (`distc_ir::graph::query_work`), and lowering a model twice as deep must cost
//! about twice as much, not four times.

use distc::bench::deep_model;
use distc::dsl::compile_source;
use distc_ir::graph::query_work;

/// [`deep_model`] with `pipeline_stage` markers before the layers at a quarter, a half
/// and three quarters of the depth: four stages, so the markers' path is measured too.
fn staged_model(layers: usize) -> String {
    let cuts = [layers / 4, layers / 2, 3 * layers / 4].map(|i| format!("  h{i} = "));
    deep_model(layers)
        .lines()
        .map(|line| {
            if cuts.iter().any(|c| line.starts_with(c.as_str())) {
                format!("  pipeline_stage\n{line}\n")
            } else {
                format!("{line}\n")
            }
        })
        .collect()
}

/// The graph-query work of parsing and lowering a staged model of `layers` layers.
fn lowering_work(layers: usize) -> u64 {
    let src = staged_model(layers);
    let before = query_work();
    let program = compile_source("deep.dsl", &src, None).unwrap_or_else(|e| panic!("{e}"));
    let work = query_work() - before;
    let stages = program.stage_marks.expect("the model has markers");
    // Each layer's variables belong to the quarter of the depth that first uses them.
    let quarter = |i: usize| {
        [layers / 4, layers / 2, 3 * layers / 4]
            .iter()
            .filter(|&&c| i >= c)
            .count()
    };
    for i in 0..layers {
        assert_eq!(stages[&format!("w{i}")], quarter(i), "w{i}");
        assert_eq!(stages[&format!("b{i}")], quarter(i), "b{i}");
    }
    assert_eq!(stages["emb"], 0);
    assert_eq!(stages["wo"], 3);
    work
}

#[test]
fn lowering_work_grows_linearly_with_the_model() {
    let (small, large) = (lowering_work(200), lowering_work(400));
    assert!(small > 0, "the graph queries count no work");
    // Linear work doubles; a rescan per statement quadruples.
    assert!(
        (large as f64) < 2.5 * small as f64,
        "lowering 400 layers visits {large} nodes and edges, 200 layers {small}: {:.2}x for twice the model",
        large as f64 / small as f64
    );
}
