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

/// The graph-query work of compiling [`deep_model`] of `layers` layers with
/// `strategy`, whole: lowering, every pass, and the plan's checks.
fn compile_work(layers: usize, strategy: distc_passes::placement::StrategyConfig) -> u64 {
    let opts = distc::CompileOptions {
        strategy,
        ..Default::default()
    };
    let before = query_work();
    distc::compile("deep.dsl", &deep_model(layers), &opts).unwrap_or_else(|e| panic!("{e}"));
    query_work() - before
}

/// Issue 39's search on a 100k-node model found three more quadratic loops, each a
/// search of every variable (`Graph::params`, a topological sort) once per variable:
/// `tensor_parallel` checking the variables it splits (24.6 s at 100k nodes),
/// `pipeline_split` finding each gradient's variable (118 s), and the plan's consistency
/// check of `settings.shard` (170 s in `explain`). A model axis and pipeline stages
/// must compile in linear work.
#[test]
fn a_model_axis_and_pipeline_stages_compile_in_linear_work() {
    use distc_passes::placement::{Strategy, StrategyConfig};
    let mesh = |model: usize, pipeline: usize| StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: model * pipeline,
        model,
        pipeline,
        micro_batches: pipeline,
        ..StrategyConfig::default()
    };
    for (what, strategy) in [("model=2", mesh(2, 1)), ("pipe=2", mesh(1, 2))] {
        let (small, large) = (
            compile_work(200, strategy.clone()),
            compile_work(400, strategy),
        );
        assert!(
            (large as f64) < 2.5 * small as f64,
            "{what}: compiling 400 layers visits {large} nodes and edges, 200 layers \
             {small}: {:.2}x for twice the model",
            large as f64 / small as f64
        );
    }
}
