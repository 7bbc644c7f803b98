//! Every example trained on the CUDA backend agrees with the CPU backend: one step
//! (every forward and backward kernel and the optimizer: the updated weights within
//! 1e-4 relative of the largest weight change scale) and five steps with CUDA graphs
//! (losses within 1e-3 relative). Needs a GPU: without one (or without the CUDA
//! libraries) each test prints why it skips and passes.

use distc::{compile_file, CompileOptions};
use distc_runtime::backend::Cpu;
use distc_runtime::cuda::{CudaBackend, CudaOptions};
use distc_runtime::data::data_dir;
use distc_runtime::device::train_on;
use distc_runtime::train::{TrainOptions, TrainReport};
use distc_tests::{example, EXAMPLES};

fn run(name: &str, steps: usize, opts: Option<CudaOptions>) -> Option<(TrainReport, Vec<f64>)> {
    let c = compile_file(&example(name), &CompileOptions::default()).expect("compiles");
    if c.config.data.needs_files() && data_dir(None).is_none() {
        println!("skipping {name}: DISTC_DATA not set");
        return None;
    }
    let topts = TrainOptions {
        steps: Some(steps),
        ..Default::default()
    };
    let mut losses = Vec::new();
    let report = match opts {
        None => train_on(Cpu, &c.programs.worker, &c.config, &topts, &mut |m| {
            losses.push(m.loss);
            Ok(())
        }),
        Some(o) => {
            let b = match CudaBackend::new(0, &c.programs.worker, o) {
                Ok(b) => b,
                Err(e) => {
                    println!("SKIP {name} on CUDA: {e}");
                    return None;
                }
            };
            train_on(b, &c.programs.worker, &c.config, &topts, &mut |m| {
                losses.push(m.loss);
                Ok(())
            })
        }
    }
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    Some((report, losses))
}

fn close(a: f64, b: f64, rtol: f64) -> bool {
    (a - b).abs() <= rtol * b.abs().max(1e-6)
}

#[test]
fn one_step_on_cuda_matches_the_cpu() {
    for name in EXAMPLES {
        let Some((want, wl)) = run(name, 1, None) else {
            continue;
        };
        let no_graphs = CudaOptions {
            tf32: false,
            graphs: false,
        };
        let Some((got, gl)) = run(name, 1, Some(no_graphs)) else {
            continue;
        };
        assert!(
            close(gl[0], wl[0], 1e-4),
            "{name}: loss {} vs {}",
            gl[0],
            wl[0]
        );
        for (var, w) in &want.params {
            let g = got
                .params
                .get(var)
                .unwrap_or_else(|| panic!("{name}: no `{var}`"));
            let (g, w) = (g.to_f64_vec(), w.to_f64_vec());
            let scale = w.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-6);
            for (i, (a, b)) in g.iter().zip(&w).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * scale,
                    "{name}: `{var}`[{i}]: {a} on CUDA, {b} on the CPU"
                );
            }
        }
    }
}

#[test]
fn five_steps_with_cuda_graphs_match_the_cpu() {
    for name in EXAMPLES {
        let Some((_, wl)) = run(name, 5, None) else {
            continue;
        };
        let Some((_, gl)) = run(name, 5, Some(CudaOptions::default())) else {
            continue;
        };
        assert_eq!(gl.len(), wl.len(), "{name}");
        for (s, (a, b)) in gl.iter().zip(&wl).enumerate() {
            assert!(
                close(*a, *b, 1e-3),
                "{name}: step {}: loss {a} on CUDA, {b} on the CPU",
                s + 1
            );
        }
    }
}

/// `distc verify --device cuda`: allreduce, ps and hybrid with 2 workers sharing the
/// GPU (collectives through the host) against one device on the GPU, for both
/// standard workloads (issue 11).
#[test]
fn verify_on_the_gpu_passes_for_allreduce_ps_and_hybrid() {
    use distc::verify::{verify, VerifyOptions};
    use distc_passes::placement::{Strategy, StrategyConfig};
    let dirs = distc_runtime::cuda::LibDirs::from_env();
    if let Err(e) = distc_runtime::cuda::require_gpu(&dirs) {
        println!("skipping: {e}");
        return;
    }
    for name in ["sparse_lm.dsl", "dense_mlp.dsl"] {
        for (strategy, servers) in [
            (Strategy::Allreduce, 0),
            (Strategy::Ps, 2),
            (Strategy::Hybrid, 1),
        ] {
            let opts = VerifyOptions {
                compile: CompileOptions {
                    strategy: StrategyConfig {
                        strategy,
                        workers: 2,
                        servers,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                steps: 3,
                // The GPU sums in another order than one device's batch: f32 rounding.
                tolerance: 1e-3,
                timeout: std::time::Duration::from_secs(120),
                device: Some(0),
            };
            let report = verify(&example(name), &opts)
                .unwrap_or_else(|e| panic!("{name} {strategy:?}: {e}"));
            assert!(report.passed(), "{name} {strategy:?}: {report:?}");
        }
    }
}
