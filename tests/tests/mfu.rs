//! Model FLOPs and their utilisation (MFU) in the metrics: the count is the model's
//! forward and backward products (checked against a hand count of dense_mlp's), every
//! line's model FLOP/s is that count times its samples per second, worker threads
//! that share the CPU are measured against its peak once, and a run too short to be
//! worth the peak's measurement reports FLOP/s alone.

use distc::{compile_file, CompileOptions, Compiled};
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::run::metrics::StepMetrics;
use distc_runtime::run::train::{train, TrainOptions, TrainReport};
use distc_tests::example;

fn compile(batch: usize, strategy: Strategy, workers: usize) -> Compiled {
    compile_file(
        &example("dense_mlp.dsl"),
        &CompileOptions {
            batch: Some(batch),
            strategy: StrategyConfig {
                strategy,
                workers,
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .expect("compiles")
}

fn run(c: &Compiled, workers: usize, steps: usize) -> (TrainReport, Vec<StepMetrics>) {
    let opts = TrainOptions {
        steps: Some(steps),
        global_data: true,
        evaluate: false,
        flops_per_sample: c.flops_per_sample,
        ..Default::default()
    };
    let mut lines = Vec::new();
    let r = train(c.programs(workers), &c.config, &opts, &mut |m| {
        lines.push(m.clone());
        Ok(())
    })
    .expect("trains");
    (r, lines)
}

#[test]
fn dense_mlp_flops_per_sample_are_its_products() {
    // 784 -> 1024 -> 1024 -> 10: the forward products, the weight gradients (as
    // many), and the input gradients of layers 2 and 3 (none reaches the data).
    let layers = [784.0 * 1024.0, 1024.0 * 1024.0, 1024.0 * 10.0];
    let forward: f64 = layers.iter().map(|mk| 2.0 * mk).sum();
    let products = 2.0 * forward + 2.0 * (layers[1] + layers[2]);
    for batch in [8, 32] {
        let f = compile(batch, Strategy::Single, 1)
            .flops_per_sample
            .expect("autodiff ran, so the model's FLOPs were counted");
        // Bias adds, ReLUs, their gradients and the loss add a fraction of a percent.
        assert!(
            f >= products && f <= 1.01 * products,
            "batch {batch}: {f} FLOPs per sample, the products alone are {products}"
        );
    }
}

#[test]
fn every_line_reports_model_flops_and_one_cpu_peak() {
    // Each worker computes 1.1e10 FLOPs or more (9.6e6 a sample), so it measures the
    // CPU's peak (core::peak::MIN_WORK).
    let (one, one_steps) = (compile(256, Strategy::Single, 1), 5);
    let (two, two_steps) = (compile(128, Strategy::Allreduce, 2), 9);
    let per_sample = one.flops_per_sample.expect("counted");
    let mut ratios = Vec::new();
    for (c, workers, steps) in [(&one, 1, one_steps), (&two, 2, two_steps)] {
        let (report, lines) = run(c, workers, steps);
        assert_eq!(lines.len(), steps);
        for m in &lines {
            let f = m.model_flops_per_sec.expect("the plan counted its FLOPs");
            let want = c.flops_per_sample.expect("counted") * m.samples_per_sec;
            assert!((f - want).abs() <= 1e-9 * want, "{f} against {want}");
            let mfu = m.mfu.expect("the CPU's peak is measured");
            assert!(mfu > 0.0 && mfu.is_finite(), "MFU {mfu}");
            // Every line divides by the same peak.
            ratios.push(f / mfu);
        }
        let (mfu, peak, source) = report.mfu.expect("the run's MFU");
        assert!(
            mfu > 0.0 && source.contains("measured"),
            "{mfu} of {peak}: {source}"
        );
    }
    // A sample of two workers of 8 costs what one of one worker of 16 does, and both
    // runs divide by one CPU's peak: two threads on it do not double it.
    let two_per_sample = two.flops_per_sample.expect("counted");
    assert!(
        (two_per_sample - per_sample).abs() <= 1e-4 * per_sample,
        "{two_per_sample} against {per_sample}"
    );
    let first = ratios[0];
    for r in &ratios {
        assert!((r - first).abs() <= 1e-9 * first, "peaks {r} and {first}");
    }
}

#[test]
fn a_short_run_reports_model_flops_without_measuring_a_peak() {
    let c = compile(16, Strategy::Single, 1);
    let (report, lines) = run(&c, 1, 3);
    assert!(lines
        .iter()
        .all(|m| m.model_flops_per_sec.is_some() && m.mfu.is_none()));
    assert!(report.model_flops_per_sec.is_some() && report.mfu.is_none());
}
