//! Issue 21, first part: every kernel the CUDA backend generates (each example's
//! worker program, single and hybrid, with and without kernel fusion, and the
//! optimizer's kernels) compiles for the GPU emulator with a launcher each: the
//! emulator's header gives every built-in the generated code uses a meaning.

use distc::{compile_file, CompileOptions};
use distc_passes::placement::{Strategy, StrategyConfig};
use distc_runtime::cuda::codegen::{generate, kernel_signatures};
use distc_runtime::cuda::emu::EmuModule;
use distc_tests::{example, EXAMPLES};

fn emulate(source: &str, what: &str) -> usize {
    let sigs = kernel_signatures(source).unwrap_or_else(|e| panic!("{what}: {e}"));
    let names: Vec<&str> = sigs.keys().map(String::as_str).collect();
    EmuModule::compile(source, &names).unwrap_or_else(|e| panic!("{what}: {e}"));
    names.len()
}

#[test]
fn every_generated_kernel_compiles_for_the_emulator() {
    for name in EXAMPLES {
        for (label, strategy, workers, servers, fuse) in [
            ("single", Strategy::Single, 1, 0, false),
            ("hybrid-fuse", Strategy::Hybrid, 2, 1, true),
        ] {
            let opts = CompileOptions {
                strategy: StrategyConfig {
                    strategy,
                    workers,
                    servers,
                    fuse,
                    ..Default::default()
                },
                ..Default::default()
            };
            let what = format!("{name} {label}");
            let c = compile_file(&example(name), &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
            let g = &c.programs.worker;
            let plan = generate(g).unwrap_or_else(|e| panic!("{what}: {e}"));
            let kernels = emulate(&plan.source, &what);
            let opt = distc_tests::optimizer_plan(g, (&c.config.optimizer, c.config.lazy_updates));
            let updates = emulate(&opt.source, &format!("{what} optimizer"));
            eprintln!("{what}: {kernels} kernels and {updates} optimizer kernels emulated");
        }
    }
}
