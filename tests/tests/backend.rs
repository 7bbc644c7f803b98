//! The backend-generic device loop (`distc_runtime::device::train_on`, what `--device
//! cuda` runs) computes on the CPU backend exactly what the in-process trainer
//! computes for one worker: same losses, bitwise the same weights, on every example.

use distc::{compile_file, CompileOptions};
use distc_runtime::backend::Cpu;
use distc_runtime::data::data_dir;
use distc_runtime::device::train_on;
use distc_runtime::train::{train, TrainOptions};
use distc_tests::{example, EXAMPLES};

#[test]
fn the_device_loop_on_the_cpu_backend_equals_the_trainer_bitwise() {
    for name in EXAMPLES {
        let c = compile_file(&example(name), &CompileOptions::default()).expect("compiles");
        if c.config.data.needs_files() && data_dir(None).is_none() {
            println!("skipping {name}: DISTC_DATA not set");
            continue;
        }
        let opts = TrainOptions {
            steps: Some(3),
            ..Default::default()
        };
        let mut trainer_losses = Vec::new();
        let expected = train(c.programs(1), &c.config, &opts, &mut |m| {
            trainer_losses.push(m.loss);
            Ok(())
        })
        .expect("trains");
        let mut device_losses = Vec::new();
        let got = train_on(Cpu, &c.programs.worker, &c.config, &opts, &mut |m| {
            device_losses.push(m.loss);
            Ok(())
        })
        .expect("trains on the backend");
        assert_eq!(trainer_losses, device_losses, "{name}: losses differ");
        assert_eq!(expected.params.len(), got.params.len(), "{name}");
        for (var, w) in &expected.params {
            assert!(got.params.get(var) == Some(w), "{name}: `{var}` differs");
        }
        assert_eq!(
            expected.eval.map(|e| e.eval_loss),
            got.eval.map(|e| e.eval_loss),
            "{name}: evaluation differs"
        );
    }
}

#[test]
fn the_device_loop_refuses_a_plan_that_communicates() {
    let c = compile_file(
        &example("dense_mlp.dsl"),
        &CompileOptions {
            strategy: distc_passes::placement::StrategyConfig {
                strategy: distc_passes::placement::Strategy::Allreduce,
                workers: 2,
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .expect("compiles");
    let err = train_on(
        Cpu,
        &c.programs.worker,
        &c.config,
        &TrainOptions {
            steps: Some(1),
            ..Default::default()
        },
        &mut |_| Ok(()),
    )
    .expect_err("a distributed plan is refused");
    let text = err.to_string();
    assert!(
        text.contains("communicates") && text.contains("--strategy single"),
        "{text}"
    );
}

#[test]
fn the_device_loop_profiles_each_op_and_reads_no_outputs_while_training() {
    let c = compile_file(&example("dense_mlp.dsl"), &CompileOptions::default()).expect("compiles");
    let report = train_on(
        Cpu,
        &c.programs.worker,
        &c.config,
        &TrainOptions {
            steps: Some(2),
            profile: true,
            ..Default::default()
        },
        &mut |_| Ok(()),
    )
    .expect("trains");
    let profile = report.profile.expect("a profile");
    assert_eq!(profile.steps, 2);
    assert!(
        profile
            .ops
            .iter()
            .any(|(op, d, calls)| *op == "matmul" && *calls > 0 && !d.is_zero()),
        "{:?}",
        profile.ops
    );
    // The evaluation after the last step still read its outputs.
    assert!(report.eval.is_some());
}
