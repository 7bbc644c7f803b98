//! The one worker loop over a backend other than the CPU's own: on a wrapped CPU
//! backend it computes exactly what the CPU trainer computes (same losses, bitwise the
//! same weights) on every example, for one worker as for distributed plans, and a
//! backend with its own communicator trains and counts what the host path does.

use distc::{compile_file, CompileOptions};
use distc_runtime::run::data::data_dir;
use distc_runtime::run::train::{train, train_with, TrainOptions};
use distc_tests::{example, EXAMPLES};

#[test]
fn one_worker_on_another_backend_equals_the_cpu_trainer_bitwise() {
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
        let kernels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut device_losses = Vec::new();
        let got = train_with(
            c.programs(1),
            &c.config,
            &opts,
            &mut |m| {
                device_losses.push(m.loss);
                Ok(())
            },
            |_, _| Ok(Wrapped::new(&kernels)),
        )
        .expect("trains on the backend");
        assert!(
            kernels.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{name}"
        );
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
fn the_loop_on_another_backend_profiles_each_op_and_still_evaluates() {
    let c = compile_file(&example("dense_mlp.dsl"), &CompileOptions::default()).expect("compiles");
    let kernels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let report = train_with(
        c.programs(1),
        &c.config,
        &TrainOptions {
            steps: Some(2),
            profile: true,
            ..Default::default()
        },
        &mut |_| Ok(()),
        |_, _| Ok(Wrapped::new(&kernels)),
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

/// The CPU backend behind another type: what runs through it cannot be the CPU
/// trainer's own fast path, and it counts the kernels it ran.
struct Wrapped {
    kernels: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// A communicator of the backend's own, as NCCL is a device backend's: when set,
    /// the backend runs the plan's collectives itself (`start_collective`).
    own: Option<Box<dyn distc_runtime::comm::Communicator>>,
    /// Collectives the backend ran itself.
    collectives: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Wrapped {
    fn new(kernels: &std::sync::Arc<std::sync::atomic::AtomicUsize>) -> Wrapped {
        Wrapped {
            kernels: kernels.clone(),
            own: None,
            collectives: Default::default(),
        }
    }
}

mod wrapped {
    use super::Wrapped;
    use distc_ir::{NodeId, Op, TensorType, ValueType};
    use distc_runtime::comm::ByteCount;
    use distc_runtime::core::backend::{
        BackendArg, Capture, Device, DeviceCollectives, KernelError, Kernels, OptimizerState,
        Started, Transfer, ValueRef,
    };
    use distc_runtime::core::schedule::Schedule;
    use distc_runtime::cpu::kernels::KernelCtx;
    use distc_runtime::cpu::optim::Optimizer;
    use distc_runtime::cpu::Cpu;
    use distc_runtime::{OptimizerSpec, Tensor, Value};
    use std::borrow::Cow;
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;

    impl Device for Wrapped {
        type Value = Value;

        type Tensor = Tensor;

        fn name(&self) -> String {
            "wrapped-cpu".into()
        }

        fn value_type(v: &Value) -> ValueType {
            Cpu::value_type(v)
        }

        fn value_bytes(v: &Value) -> u64 {
            Cpu::value_bytes(v)
        }

        fn tensor_type(t: &Tensor) -> TensorType {
            Cpu::tensor_type(t)
        }
    }

    impl Kernels for Wrapped {
        fn prepare(&mut self, s: &Schedule) -> Result<(), KernelError> {
            Cpu.prepare(s)
        }

        fn eval(
            &mut self,
            node: NodeId,
            op: &Op,
            args: Vec<BackendArg<'_, Value, Tensor>>,
            ctx: &KernelCtx,
        ) -> Result<Vec<Value>, KernelError> {
            self.kernels.fetch_add(1, Ordering::Relaxed);
            Cpu.eval(node, op, args, ctx)
        }

        fn filled(&mut self, ty: &TensorType, v: f64) -> Result<Tensor, KernelError> {
            Cpu.filled(ty, v)
        }

        fn copy_tensor(&mut self, t: &Tensor) -> Result<Value, KernelError> {
            Cpu.copy_tensor(t)
        }

        fn copy_value(&mut self, v: &Value) -> Result<Value, KernelError> {
            Cpu.copy_value(v)
        }

        fn accumulate(
            &mut self,
            node: NodeId,
            sum: Option<Value>,
            value: Value,
            micro: usize,
        ) -> Result<Value, KernelError> {
            Cpu.accumulate(node, sum, value, micro)
        }

        fn accumulated(
            &mut self,
            node: NodeId,
            sum: Value,
            micro: usize,
        ) -> Result<Value, KernelError> {
            Cpu.accumulated(node, sum, micro)
        }
    }

    impl Transfer for Wrapped {
        fn upload(&mut self, name: &str, t: Tensor) -> Result<Tensor, KernelError> {
            Cpu.upload(name, t)
        }

        fn download(&mut self, t: &Tensor) -> Result<Tensor, KernelError> {
            Cpu.download(t)
        }

        fn to_host(&mut self, v: Value) -> Result<Value, KernelError> {
            Cpu.to_host(v)
        }

        fn from_host(
            &mut self,
            at: Option<(NodeId, usize)>,
            v: Value,
        ) -> Result<Value, KernelError> {
            Cpu.from_host(at, v)
        }

        fn host_tensor<'s>(
            &mut self,
            v: ValueRef<'s, Value, Tensor>,
        ) -> Result<Cow<'s, Tensor>, KernelError> {
            Cpu.host_tensor(v)
        }
    }

    impl OptimizerState for Wrapped {
        type Optimizer = Optimizer;

        fn optimizer(
            &mut self,
            spec: &OptimizerSpec,
            no_decay: &[String],
            lazy: bool,
            params: &HashMap<String, Tensor>,
        ) -> Result<Optimizer, KernelError> {
            Cpu.optimizer(spec, no_decay, lazy, params)
        }

        fn update(
            &mut self,
            opt: &mut Optimizer,
            params: &mut HashMap<String, Tensor>,
            grads: Vec<(String, Value)>,
        ) -> Result<(), KernelError> {
            Cpu.update(opt, params, grads)
        }

        fn assign(
            &mut self,
            params: &mut HashMap<String, Tensor>,
            assigned: Vec<(String, Value)>,
        ) -> Result<(), KernelError> {
            Cpu.assign(params, assigned)
        }

        fn optimizer_bytes(opt: &Optimizer) -> u64 {
            Cpu::optimizer_bytes(opt)
        }

        fn optimizer_slots(opt: &Optimizer) -> &'static [&'static str] {
            Cpu::optimizer_slots(opt)
        }
    }

    impl Capture for Wrapped {}

    impl DeviceCollectives for Wrapped {
        // No optimizer_state / load_optimizer_state: the defaults refuse, as a
        // device backend's do today.
        fn start_collective(
            &mut self,
            _node: NodeId,
            op: &Op,
            v: Value,
        ) -> Result<Started<Value>, KernelError> {
            match self.own.as_mut() {
                None => Ok(Started::Host(v)),
                Some(c) => {
                    self.collectives.fetch_add(1, Ordering::Relaxed);
                    distc_runtime::comm::collective::collective(c.as_mut(), op, v)
                        .map(Started::Device)
                        .map_err(|e| KernelError::Invalid(e.to_string()))
                }
            }
        }

        fn collective_bytes(&self) -> ByteCount {
            self.own.as_ref().map(|c| c.bytes()).unwrap_or_default()
        }
    }
}

/// Example `model` compiled for `strategy` with `workers`, `servers` and ZeRO `zero`.
fn compile_strategy(
    model: &str,
    strategy: distc_passes::placement::Strategy,
    workers: usize,
    servers: usize,
    zero: u8,
) -> distc::Compiled {
    compile_file(
        &example(model),
        &CompileOptions {
            strategy: distc_passes::placement::StrategyConfig {
                strategy,
                workers,
                servers,
                zero,
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .expect("compiles")
}

#[test]
fn distributed_workers_on_another_backend_train_what_the_cpu_workers_train() {
    use distc_passes::placement::Strategy;
    for (strategy, workers, servers, zero) in [
        (Strategy::Allreduce, 2, 0, 0),
        (Strategy::Hybrid, 2, 1, 0),
        (Strategy::Ps, 3, 2, 0),
        (Strategy::Allreduce, 2, 0, 3),
    ] {
        let c = compile_strategy("sparse_lm.dsl", strategy, workers, servers, zero);
        let what = format!("{strategy:?} x{workers} zero {zero}");
        cpu_against_wrapped(&what, &c, workers);
    }
}

/// Trains `c` with `workers` for 3 steps (one global data stream) on the CPU and on the
/// wrapped backend; the losses and every variable must be bitwise the same, and the
/// wrapped backend must have run kernels.
fn cpu_against_wrapped(what: &str, c: &distc::Compiled, workers: usize) {
    let opts = TrainOptions {
        steps: Some(3),
        global_data: true,
        ..Default::default()
    };
    let mut cpu_losses = Vec::new();
    let expected = train(c.programs(workers), &c.config, &opts, &mut |m| {
        cpu_losses.push(m.loss);
        Ok(())
    })
    .unwrap_or_else(|e| panic!("{what} on the CPU: {e}"));
    let kernels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut losses = Vec::new();
    let got = train_with(
        c.programs(workers),
        &c.config,
        &opts,
        &mut |m| {
            losses.push(m.loss);
            Ok(())
        },
        |_, _| Ok(Wrapped::new(&kernels)),
    )
    .unwrap_or_else(|e| panic!("{what} on the wrapped backend: {e}"));
    assert!(
        kernels.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "{what}: no kernel ran on the backend"
    );
    assert_eq!(cpu_losses.len(), 3, "{what}");
    assert_eq!(cpu_losses, losses, "{what}: losses differ");
    assert_eq!(expected.params.len(), got.params.len(), "{what}");
    for (var, w) in &expected.params {
        assert!(got.params.get(var) == Some(w), "{what}: `{var}` differs");
    }
}

/// Pipelined and mesh plans (issue 34: the stage loop and the model axis are modes of
/// the one loop over any backend): on the wrapped backend every stage, replica and
/// model rank computes bitwise what the CPU computes, losses and weights.
#[test]
fn pipelines_and_meshes_on_another_backend_train_what_the_cpu_trains() {
    use distc_ir::pipeline::schedule::ScheduleKind;
    use distc_passes::placement::StrategyConfig;
    // (what, data, model, pipe, micro-batches, schedule)
    let layouts = [
        ("pipeline 2, GPipe", 1, 1, 2, 2, ScheduleKind::GPipe),
        (
            "2 replicas of pipeline 2, 1F1B",
            2,
            1,
            2,
            2,
            ScheduleKind::OneFOneB,
        ),
        ("mesh data=2 model=2", 2, 2, 1, 1, ScheduleKind::GPipe),
        ("mesh model=2 pipe=2", 1, 2, 2, 2, ScheduleKind::OneFOneB),
    ];
    for (what, data, model, pipe, micro, schedule) in layouts {
        let strategy = StrategyConfig {
            schedule,
            ..distc_tests::mesh(data, model, pipe, micro)
        };
        let workers = strategy.workers;
        let c = compile_file(
            &example("dense_mlp.dsl"),
            &CompileOptions {
                strategy,
                batch: Some(16),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        cpu_against_wrapped(what, &c, workers);
    }
}

#[test]
fn a_backend_without_optimizer_state_refuses_a_training_state_by_name() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path();
    let c = compile_file(&example("dense_mlp.dsl"), &CompileOptions::default()).expect("compiles");
    let opts = TrainOptions {
        steps: Some(1),
        checkpoint: Some(distc_runtime::run::train::CheckpointEvery::new(
            dir.join("state.safetensors"),
            1,
            "test".into(),
        )),
        ..Default::default()
    };
    let kernels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let err = distc_runtime::run::train::train_with(
        c.programs(1),
        &c.config,
        &opts,
        &mut |_| Ok(()),
        |_, _| Ok(Wrapped::new(&kernels)),
    )
    .expect_err("refused")
    .to_string();
    assert!(
        err.contains("wrapped-cpu") && err.contains("training state"),
        "{err}"
    );
    assert!(!dir.join("state.safetensors").exists());
}

/// A backend that runs the plan's collectives on a communicator of its own (as the
/// CUDA backend runs them on NCCL), joined through a bootstrap over the workers' host
/// communicator: the executor hands it every collective, the workers train bitwise
/// what the CPU workers train, and the metrics count the same bytes per step (the
/// bootstrap's own are not counted).
#[test]
fn a_backend_with_its_own_communicator_trains_and_counts_what_the_host_path_does() {
    use distc_passes::placement::Strategy;
    use distc_runtime::comm::in_process;
    use std::sync::{Arc, Mutex};
    for (model, strategy, workers, servers, zero) in [
        ("sparse_lm.dsl", Strategy::Allreduce, 2, 0, 0),
        ("sparse_lm.dsl", Strategy::Hybrid, 3, 1, 0),
        ("dense_mlp.dsl", Strategy::Allreduce, 3, 0, 3),
    ] {
        let c = compile_strategy(model, strategy, workers, servers, zero);
        let opts = TrainOptions {
            steps: Some(3),
            global_data: true,
            ..Default::default()
        };
        let mut cpu = Vec::new();
        let expected = train(c.programs(workers), &c.config, &opts, &mut |m| {
            cpu.push((m.loss, m.bytes_sent, m.bytes_received));
            Ok(())
        })
        .expect("trains on the CPU");
        let kernels = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let own: Mutex<Vec<Option<_>>> =
            Mutex::new(in_process(workers).into_iter().map(Some).collect());
        let ran = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut got_lines = Vec::new();
        let got = train_with(
            c.programs(workers),
            &c.config,
            &opts,
            &mut |m| {
                got_lines.push((m.loss, m.bytes_sent, m.bytes_received));
                Ok(())
            },
            |site: distc_runtime::run::train::Site<'_>,
             mut links: distc_runtime::run::train::Links<'_>| {
                let rank = site.worker;
                let host = links
                    .take(distc_runtime::core::axis::Axis::Data)
                    .expect("a data-parallel worker's link");
                // The bootstrap: rank 0's token to everyone over the host communicator.
                let mut token = if rank == 0 {
                    b"own-comm".to_vec()
                } else {
                    vec![0; 8]
                };
                host.broadcast(&mut token, 0)?;
                assert_eq!(token, b"own-comm");
                let mut w = Wrapped::new(&kernels);
                let comm = own.lock().expect("lock")[rank]
                    .take()
                    .expect("one per rank");
                w.own = Some(Box::new(comm));
                w.collectives = ran.clone();
                Ok(w)
            },
        )
        .expect("trains with the backend's own communicator");
        let what = format!("{model} {strategy:?} x{workers} zero {zero}");
        assert!(
            ran.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{what}: no collective ran on the backend"
        );
        assert_eq!(cpu, got_lines, "{what}: losses or bytes differ");
        for (var, w) in &expected.params {
            assert!(got.params.get(var) == Some(w), "{what}: `{var}` differs");
        }
    }
}
