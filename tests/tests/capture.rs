//! The worker loop's capture mode, checked where there is no GPU: a CPU backend that
//! records a step as a tape while "capturing" (as a CUDA stream capture records
//! kernels without running them for real: nothing the tape records touches the
//! variables, the optimizer state or the loss) and runs the tape on `replay`. Trained
//! through the one worker loop, every example's replayed steps equal the CPU trainer's
//! eager steps bitwise: losses, weights and evaluation. So the loop captures after its
//! warm-up, sets the step before each replay (dropout masks read it), reads the loss
//! the replay left, applies the update exactly once per step, and stages the next
//! batch into the buffers the graph reads only when it may.

use distc::{compile_file, CompileOptions};
use distc_runtime::run::data::data_dir;
use distc_runtime::run::train::{train, train_with, TrainOptions};
use distc_tests::{example, EXAMPLES};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

mod taped {
    use distc_ir::{NodeId, Op, TensorType, ValueType};
    use distc_runtime::core::backend::{
        BackendArg, Capture, Device, DeviceCollectives, KernelCtx, KernelError, Kernels,
        OptimizerState, Transfer, ValueRef,
    };
    use distc_runtime::core::schedule::Schedule;
    use distc_runtime::cpu::kernels::{self, Arg};
    use distc_runtime::cpu::optim::Optimizer;
    use distc_runtime::{OptimizerSpec, Tensor, Value};
    use std::borrow::Cow;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    /// A computed value's buffer.
    pub type Cell = Arc<Mutex<Option<Value>>>;
    /// A held tensor's buffer (variables, feeds, constants).
    pub type TCell = Arc<Mutex<Tensor>>;

    fn cell(v: Value) -> Cell {
        Arc::new(Mutex::new(Some(v)))
    }

    fn read(c: &Cell) -> Result<Value, KernelError> {
        c.lock()
            .map_err(|_| KernelError::Invalid("a poisoned cell".into()))?
            .clone()
            .ok_or_else(|| KernelError::Invalid("a cell read before it was written".into()))
    }

    fn write(c: &Cell, v: Value) -> Result<(), KernelError> {
        *c.lock()
            .map_err(|_| KernelError::Invalid("a poisoned cell".into()))? = Some(v);
        Ok(())
    }

    fn tensor(t: &TCell) -> Tensor {
        t.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// One kernel input as the tape holds it.
    #[derive(Clone)]
    enum In {
        Value(Cell),
        Tensor(TCell),
    }

    /// What the tape records.
    enum Entry {
        Kernel {
            op: Op,
            args: Vec<In>,
            ctx: KernelCtx,
            outs: Vec<Cell>,
        },
        Update {
            params: Vec<(String, TCell)>,
            grads: Vec<(String, Cell)>,
        },
    }

    /// The CPU kernels over buffers that stay put, with a tape.
    pub struct Taped {
        pub captures: Arc<AtomicUsize>,
        pub replays: Arc<AtomicUsize>,
        step: u64,
        recording: Option<Vec<Entry>>,
        graph: Vec<Entry>,
        feeds: HashMap<String, TCell>,
        optimizer: Option<Arc<Mutex<Optimizer>>>,
        loss_cell: Option<Cell>,
        graph_loss: Option<Cell>,
        // One loss per replay not read yet: the worker issues a step's successor
        // before it reads the step's loss.
        pending: std::collections::VecDeque<Option<f64>>,
    }

    impl Taped {
        pub fn new(captures: &Arc<AtomicUsize>, replays: &Arc<AtomicUsize>) -> Taped {
            Taped {
                captures: captures.clone(),
                replays: replays.clone(),
                step: 0,
                recording: None,
                graph: Vec::new(),
                feeds: HashMap::new(),
                optimizer: None,
                loss_cell: None,
                graph_loss: None,
                pending: std::collections::VecDeque::new(),
            }
        }

        fn run_kernel(op: &Op, args: &[In], ctx: &KernelCtx) -> Result<Vec<Value>, KernelError> {
            let held: Vec<Value> = args
                .iter()
                .map(|a| match a {
                    In::Value(c) => read(c),
                    In::Tensor(t) => Ok(Value::Tensor(tensor(t))),
                })
                .collect::<Result<_, _>>()?;
            let args = held.into_iter().map(Arg::Owned).collect();
            Ok(kernels::eval(op, args, ctx)?)
        }

        fn apply(
            opt: &Mutex<Optimizer>,
            params: &[(String, TCell)],
            grads: Vec<(String, Value)>,
        ) -> Result<(), KernelError> {
            let mut host: HashMap<String, Tensor> =
                params.iter().map(|(k, t)| (k.clone(), tensor(t))).collect();
            opt.lock()
                .map_err(|_| KernelError::Invalid("a poisoned optimizer".into()))?
                .step(&mut host, &grads)
                .map_err(|e| KernelError::Invalid(e.to_string()))?;
            for (k, t) in params {
                if let Some(v) = host.remove(k) {
                    *t.lock().unwrap_or_else(|p| p.into_inner()) = v;
                }
            }
            Ok(())
        }
    }

    impl Device for Taped {
        type Value = Cell;
        type Tensor = TCell;

        fn name(&self) -> String {
            "taped-cpu".into()
        }
        fn value_type(v: &Cell) -> ValueType {
            match &*v.lock().unwrap_or_else(|p| p.into_inner()) {
                Some(v) => v.value_type(),
                None => ValueType::Tensor(TensorType::new(distc_ir::DType::F32, vec![])),
            }
        }
        fn value_bytes(v: &Cell) -> u64 {
            v.lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .map_or(0, |v| v.bytes() as u64)
        }
        fn tensor_type(t: &TCell) -> TensorType {
            t.lock().unwrap_or_else(|p| p.into_inner()).tensor_type()
        }
    }

    impl Kernels for Taped {
        fn prepare(&mut self, _: &Schedule) -> Result<(), KernelError> {
            Ok(())
        }

        fn eval(
            &mut self,
            _node: NodeId,
            op: &Op,
            args: Vec<BackendArg<'_, Cell, TCell>>,
            ctx: &KernelCtx,
        ) -> Result<Vec<Cell>, KernelError> {
            let args: Vec<In> = args
                .into_iter()
                .map(|a| match a {
                    BackendArg::Owned(c) => In::Value(c),
                    BackendArg::Borrowed(c) => In::Value(c.clone()),
                    BackendArg::BorrowedTensor(t) => In::Tensor(t.clone()),
                })
                .collect();
            // While capturing, the kernel runs once so its outputs have their types (a
            // device knows them from the plan), on inputs nothing else changes.
            let outs: Vec<Cell> = Taped::run_kernel(op, &args, ctx)?
                .into_iter()
                .map(cell)
                .collect();
            if let Some(tape) = self.recording.as_mut() {
                tape.push(Entry::Kernel {
                    op: op.clone(),
                    args,
                    ctx: *ctx,
                    outs: outs.clone(),
                });
            }
            Ok(outs)
        }

        fn filled(&mut self, ty: &TensorType, value: f64) -> Result<TCell, KernelError> {
            Ok(Arc::new(Mutex::new(Tensor::filled(ty, value))))
        }
        fn copy_tensor(&mut self, t: &TCell) -> Result<Cell, KernelError> {
            if self.recording.is_some() {
                return Err(KernelError::Invalid("copy_tensor while capturing".into()));
            }
            Ok(cell(Value::Tensor(tensor(t))))
        }
        fn copy_value(&mut self, v: &Cell) -> Result<Cell, KernelError> {
            if self.recording.is_some() {
                return Err(KernelError::Invalid("copy_value while capturing".into()));
            }
            Ok(cell(read(v)?))
        }
        // No plan here accumulates micro-batches (a step with several is never
        // captured anyway).
        fn accumulate(
            &mut self,
            _: NodeId,
            _: Option<Cell>,
            _: Cell,
            _: usize,
        ) -> Result<Cell, KernelError> {
            Err(KernelError::Invalid(
                "no accumulation on this backend".into(),
            ))
        }
        fn accumulated(&mut self, _: NodeId, _: Cell, _: usize) -> Result<Cell, KernelError> {
            Err(KernelError::Invalid(
                "no accumulation on this backend".into(),
            ))
        }
        fn set_step(&mut self, step: u64) -> Result<(), KernelError> {
            if self.recording.is_some() {
                return Err(KernelError::Invalid("set_step while capturing".into()));
            }
            self.step = step;
            Ok(())
        }
    }

    impl Transfer for Taped {
        fn upload(&mut self, name: &str, t: Tensor) -> Result<TCell, KernelError> {
            if self.recording.is_some() {
                return Err(KernelError::Invalid(format!(
                    "upload of `{name}` while capturing"
                )));
            }
            // Each name has one buffer, rewritten every step, as on a device: a graph
            // reads the batch staged there.
            let c = self
                .feeds
                .entry(name.to_string())
                .or_insert_with(|| Arc::new(Mutex::new(t.clone())));
            *c.lock().unwrap_or_else(|p| p.into_inner()) = t;
            Ok(c.clone())
        }
        fn download(&mut self, t: &TCell) -> Result<Tensor, KernelError> {
            Ok(tensor(t))
        }
        fn to_host(&mut self, v: Cell) -> Result<Value, KernelError> {
            read(&v)
        }
        fn from_host(&mut self, _: Option<(NodeId, usize)>, v: Value) -> Result<Cell, KernelError> {
            Ok(cell(v))
        }
        fn host_tensor<'s>(
            &mut self,
            v: ValueRef<'s, Cell, TCell>,
        ) -> Result<Cow<'s, Tensor>, KernelError> {
            match v {
                ValueRef::Value(c) => match read(c)? {
                    Value::Tensor(t) => Ok(Cow::Owned(t)),
                    s => Err(KernelError::Invalid(format!(
                        "needs a tensor, got {}",
                        s.value_type()
                    ))),
                },
                ValueRef::Tensor(t) => Ok(Cow::Owned(tensor(t))),
            }
        }
        fn read_scalar(
            &mut self,
            v: ValueRef<'_, Cell, TCell>,
        ) -> Result<Option<f64>, KernelError> {
            if self.recording.is_some() {
                if let ValueRef::Value(c) = v {
                    self.loss_cell = Some(c.clone());
                }
                return Ok(None);
            }
            Ok(self.host_tensor(v)?.scalar_f64())
        }
        fn pending_scalar(&mut self) -> Result<Option<f64>, KernelError> {
            Ok(self.pending.pop_front().flatten())
        }
    }

    impl OptimizerState for Taped {
        type Optimizer = Arc<Mutex<Optimizer>>;

        fn optimizer(
            &mut self,
            spec: &OptimizerSpec,
            _: &[String],
            _: bool,
            _: &HashMap<String, TCell>,
        ) -> Result<Self::Optimizer, KernelError> {
            let o = Arc::new(Mutex::new(Optimizer::new(spec)));
            self.optimizer = Some(o.clone());
            Ok(o)
        }
        fn update(
            &mut self,
            opt: &mut Self::Optimizer,
            params: &mut HashMap<String, TCell>,
            grads: Vec<(String, Cell)>,
        ) -> Result<(), KernelError> {
            let params: Vec<(String, TCell)> =
                params.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
            if let Some(tape) = self.recording.as_mut() {
                // Recorded, not applied: a capture runs nothing.
                tape.push(Entry::Update { params, grads });
                return Ok(());
            }
            let grads = grads
                .into_iter()
                .map(|(k, c)| Ok((k, read(&c)?)))
                .collect::<Result<Vec<_>, KernelError>>()?;
            Taped::apply(opt, &params, grads)
        }
        fn assign(
            &mut self,
            _: &mut HashMap<String, TCell>,
            assigned: Vec<(String, Cell)>,
        ) -> Result<(), KernelError> {
            match assigned.first() {
                None => Ok(()),
                Some((name, _)) => Err(KernelError::Invalid(format!(
                    "the taped backend keeps no running statistics (`{name}`)"
                ))),
            }
        }
        fn optimizer_bytes(opt: &Self::Optimizer) -> u64 {
            opt.lock().unwrap_or_else(|p| p.into_inner()).state_bytes()
        }
        fn optimizer_slots(opt: &Self::Optimizer) -> &'static [&'static str] {
            opt.lock().unwrap_or_else(|p| p.into_inner()).slot_names()
        }
    }

    impl Capture for Taped {
        fn can_capture(&self, _: &Schedule) -> bool {
            true
        }
        fn begin_capture(&mut self, _: usize) -> Result<bool, KernelError> {
            self.recording = Some(Vec::new());
            self.loss_cell = None;
            Ok(true)
        }
        fn end_capture(&mut self) -> Result<(), KernelError> {
            self.graph = self
                .recording
                .take()
                .ok_or_else(|| KernelError::Invalid("end_capture without begin".into()))?;
            self.graph_loss = self.loss_cell.take();
            self.captures.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        fn replay(&mut self) -> Result<(), KernelError> {
            let opt = self
                .optimizer
                .clone()
                .ok_or_else(|| KernelError::Invalid("no optimizer".into()))?;
            for entry in &self.graph {
                match entry {
                    Entry::Kernel {
                        op,
                        args,
                        ctx,
                        outs,
                    } => {
                        // The step is read at replay, as a device reads it from memory.
                        let ctx = KernelCtx {
                            step: self.step,
                            ..*ctx
                        };
                        let values = Taped::run_kernel(op, args, &ctx)?;
                        for (c, v) in outs.iter().zip(values) {
                            write(c, v)?;
                        }
                    }
                    Entry::Update { params, grads } => {
                        let grads = grads
                            .iter()
                            .map(|(k, c)| Ok((k.clone(), read(c)?)))
                            .collect::<Result<Vec<_>, KernelError>>()?;
                        Taped::apply(&opt, params, grads)?;
                    }
                }
            }
            let loss = match &self.graph_loss {
                Some(c) => match read(c)? {
                    Value::Tensor(t) => t.scalar_f64(),
                    _ => None,
                },
                None => None,
            };
            self.pending.push_back(loss);
            self.replays.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }

    impl DeviceCollectives for Taped {}
}

#[test]
fn replayed_steps_equal_eager_ones_bitwise_on_every_example() {
    for name in EXAMPLES {
        let c = compile_file(&example(name), &CompileOptions::default()).expect("compiles");
        if c.config.data.needs_files() && data_dir(None).is_none() {
            println!("skipping {name}: DISTC_DATA not set");
            continue;
        }
        let opts = TrainOptions {
            steps: Some(6),
            ..Default::default()
        };
        let mut eager = Vec::new();
        let want = train(c.programs(1), &c.config, &opts, &mut |m| {
            eager.push((m.loss, m.memory));
            Ok(())
        })
        .expect("trains eagerly");
        let (captures, replays) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mut replayed = Vec::new();
        let got = train_with(
            c.programs(1),
            &c.config,
            &opts,
            &mut |m| {
                replayed.push((m.loss, m.memory));
                Ok(())
            },
            |_, _| Ok(taped::Taped::new(&captures, &replays)),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Two warm-up steps, one capture, steps 3 to 6 replayed.
        assert_eq!(captures.load(Ordering::Relaxed), 1, "{name}: captures");
        assert_eq!(replays.load(Ordering::Relaxed), 4, "{name}: replays");
        // Losses, and the memory metrics of replayed steps (measured at the capture).
        assert_eq!(eager, replayed, "{name}: losses or memory differ");
        for (var, w) in &want.params {
            assert!(got.params.get(var) == Some(w), "{name}: `{var}` differs");
        }
        assert_eq!(
            want.eval.map(|e| e.eval_loss),
            got.eval.map(|e| e.eval_loss),
            "{name}: evaluation differs"
        );
    }
}

/// A step with a host round trip is never captured: a pull from a parameter server,
/// and a profiled run (it times each kernel). Both still train what the CPU trains.
#[test]
fn steps_with_a_host_round_trip_or_a_profile_run_eagerly() {
    use distc_passes::placement::{Strategy, StrategyConfig};
    let hybrid = compile_file(
        &example("sparse_lm.dsl"),
        &CompileOptions {
            strategy: StrategyConfig {
                strategy: Strategy::Hybrid,
                workers: 1,
                servers: 1,
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .expect("compiles");
    let single =
        compile_file(&example("dense_mlp.dsl"), &CompileOptions::default()).expect("compiles");
    for (what, c, profile) in [("hybrid", &hybrid, false), ("profiled", &single, true)] {
        let opts = TrainOptions {
            steps: Some(4),
            profile,
            global_data: true,
            ..Default::default()
        };
        let want = train(c.programs(1), &c.config, &opts, &mut |_| Ok(())).expect("trains");
        let (captures, replays) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let got = train_with(c.programs(1), &c.config, &opts, &mut |_| Ok(()), |_, _| {
            Ok(taped::Taped::new(&captures, &replays))
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(captures.load(Ordering::Relaxed), 0, "{what}: captured");
        assert_eq!(replays.load(Ordering::Relaxed), 0, "{what}: replayed");
        for (var, w) in &want.params {
            assert!(got.params.get(var) == Some(w), "{what}: `{var}` differs");
        }
    }
}
