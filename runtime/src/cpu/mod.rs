//! The CPU backend: host ndarrays, the kernels of [`kernels`], the optimizers of
//! [`optim`], and the allocator tuning a CPU step wants ([`warm_allocator`]).
//!
//! Depends on the core only. It is the reference every other backend is checked
//! against: the kernel suite, the examples and `distc verify` compare with it.

pub mod kernels;
pub mod optim;
pub mod peak;

use crate::core::backend::{
    BackendArg, Capture, Device, DeviceCollectives, KernelCtx, KernelError, Kernels,
    OptimizerState, OverflowBounds, Transfer, ValueRef,
};
use crate::core::config::{LrSchedule, OptimizerSpec};
use crate::core::error::Result;
use crate::core::exec::Executor;
use crate::core::schedule::Schedule;
use crate::core::value::{Tensor, Value};
use distc_ir::{Graph, NodeId, Op, TensorType, ValueType};
use optim::Optimizer;
use std::borrow::Cow;
use std::collections::HashMap;

/// The CPU backend: host ndarrays and the kernels of [`kernels`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Executor<Cpu> {
    /// Compiles `graph` for the CPU.
    pub fn new(graph: &Graph) -> Result<Executor<Cpu>> {
        Executor::with_backend(graph, Cpu)
    }
}

/// The widest vector instructions this CPU offers the matrix products (which pick
/// their kernels at run time), with the f32 lanes of one register.
fn vector_width() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "x86-64 AVX-512, 16 f32 lanes";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "x86-64 AVX2 and FMA, 8 f32 lanes";
        }
        "x86-64 SSE2, 4 f32 lanes"
    }
    #[cfg(target_arch = "aarch64")]
    {
        "AArch64 NEON, 4 f32 lanes"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        std::env::consts::ARCH
    }
}

impl Device for Cpu {
    type Value = Value;
    type Tensor = Tensor;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn describe(&self) -> String {
        format!(
            "CPU ({}, {} threads)",
            vector_width(),
            rayon::current_num_threads()
        )
    }

    fn value_type(v: &Value) -> ValueType {
        v.value_type()
    }

    fn value_bytes(v: &Value) -> u64 {
        v.bytes() as u64
    }

    fn tensor_type(t: &Tensor) -> TensorType {
        t.tensor_type()
    }
}

impl Kernels for Cpu {
    fn prepare(&mut self, _schedule: &Schedule) -> Result<(), KernelError> {
        warm_allocator();
        Ok(())
    }

    fn eval(
        &mut self,
        _node: NodeId,
        op: &Op,
        args: Vec<BackendArg<'_, Value, Tensor>>,
        ctx: &KernelCtx,
    ) -> Result<Vec<Value>, KernelError> {
        let args = args
            .into_iter()
            .map(|a| match a {
                BackendArg::Owned(v) => kernels::Arg::Owned(v),
                BackendArg::Borrowed(v) => kernels::Arg::Borrowed(v),
                BackendArg::BorrowedTensor(t) => kernels::Arg::BorrowedTensor(t),
            })
            .collect();
        Ok(kernels::eval(op, args, ctx)?)
    }

    fn filled(&mut self, ty: &TensorType, value: f64) -> Result<Tensor, KernelError> {
        Ok(Tensor::filled(ty, value))
    }

    fn copy_tensor(&mut self, t: &Tensor) -> Result<Value, KernelError> {
        Ok(Value::Tensor(t.clone()))
    }

    fn copy_value(&mut self, v: &Value) -> Result<Value, KernelError> {
        Ok(v.clone())
    }

    fn accumulate(
        &mut self,
        _node: NodeId,
        sum: Option<Value>,
        value: Value,
        _micro: usize,
    ) -> Result<Value, KernelError> {
        Ok(match sum {
            None => value,
            Some(sum) => crate::core::value::add_values(sum, value)?,
        })
    }

    fn accumulated(
        &mut self,
        _node: NodeId,
        sum: Value,
        micro: usize,
    ) -> Result<Value, KernelError> {
        let parts = if crate::core::planted::Planted::MicroBatchScale.here() {
            micro.saturating_sub(1).max(1)
        } else {
            micro
        };
        Ok(crate::core::value::scale_value(sum, 1.0 / parts as f64)?)
    }
}

impl Transfer for Cpu {
    fn upload(&mut self, _name: &str, t: Tensor) -> Result<Tensor, KernelError> {
        Ok(t)
    }

    fn peak_flops(&self, products: distc_ir::DType) -> Option<crate::core::peak::DevicePeak> {
        Some(peak::peak(products))
    }

    fn download(&mut self, t: &Tensor) -> Result<Tensor, KernelError> {
        Ok(t.clone())
    }

    fn to_host(&mut self, v: Value) -> Result<Value, KernelError> {
        Ok(v)
    }

    fn from_host(&mut self, _at: Option<(NodeId, usize)>, v: Value) -> Result<Value, KernelError> {
        Ok(v)
    }

    fn host_tensor<'s>(
        &mut self,
        v: ValueRef<'s, Value, Tensor>,
    ) -> Result<Cow<'s, Tensor>, KernelError> {
        match v {
            ValueRef::Value(Value::Tensor(t)) | ValueRef::Tensor(t) => Ok(Cow::Borrowed(t)),
            ValueRef::Value(s) => Err(KernelError::Invalid(format!(
                "needs a tensor, got {}",
                s.value_type()
            ))),
        }
    }

    fn move_to_host(&mut self, t: Tensor) -> Result<Tensor, KernelError> {
        Ok(t)
    }
}

impl OptimizerState for Cpu {
    type Optimizer = Optimizer;

    fn optimizer(
        &mut self,
        spec: &OptimizerSpec,
        no_decay: &[String],
        lazy: bool,
        _params: &HashMap<String, Tensor>,
    ) -> Result<Optimizer, KernelError> {
        let mut opt = Optimizer::new(spec);
        opt.exempt_from_decay(no_decay);
        opt.set_lazy(lazy);
        Ok(opt)
    }

    fn follow_schedule(
        &mut self,
        opt: &mut Optimizer,
        schedule: &LrSchedule,
        total: u64,
    ) -> Result<(), KernelError> {
        opt.follow(schedule, total);
        Ok(())
    }

    fn update(
        &mut self,
        opt: &mut Optimizer,
        params: &mut HashMap<String, Tensor>,
        grads: Vec<(String, Value)>,
    ) -> Result<(), KernelError> {
        opt.step(params, &grads)
            .map_err(|e| KernelError::Invalid(e.to_string()))
    }

    fn assign(
        &mut self,
        params: &mut HashMap<String, Tensor>,
        assigned: Vec<(String, Value)>,
    ) -> Result<(), KernelError> {
        for (name, v) in assigned {
            let slot = params.get_mut(&name).ok_or_else(|| {
                KernelError::Invalid(format!("assigns `{name}`, which it does not hold"))
            })?;
            match v {
                Value::Tensor(t) if t.tensor_type() == slot.tensor_type() => *slot = t,
                v => {
                    return Err(KernelError::Invalid(format!(
                        "assigns {} to `{name}`, which is {}",
                        v.value_type(),
                        slot.tensor_type()
                    )))
                }
            }
        }
        Ok(())
    }

    fn grad_squares(&mut self, grads: &[(String, Value)]) -> Result<Vec<f64>, KernelError> {
        grads
            .iter()
            .map(|(_, g)| g.square_sum().map_err(KernelError::Invalid))
            .collect()
    }

    fn unscale(
        &mut self,
        grads: &mut [(String, Value)],
        factor: f64,
        bounds: &OverflowBounds,
    ) -> Result<bool, KernelError> {
        let mut finite = true;
        // `x.abs() < bound` is false for an infinity and a NaN, whatever the bound.
        let mut scale = |t: &mut Tensor, bound: f64| match t {
            Tensor::F32(a) => {
                let bound = bound as f32;
                finite &= a.iter().all(|x| x.abs() < bound);
                a.mapv_inplace(|x| x * factor as f32);
                Ok(())
            }
            Tensor::F64(a) => {
                finite &= a.iter().all(|x| x.abs() < bound);
                a.mapv_inplace(|x| x * factor);
                Ok(())
            }
            t => Err(KernelError::Invalid(format!(
                "a {} gradient: gradients reach the optimizer in f32",
                t.dtype()
            ))),
        };
        for (name, g) in grads.iter_mut() {
            let bound = bounds.get(name.as_str()).copied().unwrap_or(f64::INFINITY);
            match g {
                Value::Tensor(t) => scale(t, bound)?,
                Value::Slices(s) => scale(&mut s.values, bound)?,
            }
        }
        Ok(finite)
    }

    fn optimizer_bytes(opt: &Optimizer) -> u64 {
        opt.state_bytes()
    }

    fn learning_rate(opt: &Optimizer, _ahead: u64) -> Option<f64> {
        Some(opt.lr())
    }

    fn parallel_updates(opt: &mut Optimizer, on: bool) {
        opt.set_parallel(on);
    }

    fn optimizer_state(&mut self, opt: &Optimizer) -> Result<Vec<(String, Tensor)>, KernelError> {
        Ok(opt
            .state()
            .into_iter()
            .map(|(k, t)| (k, t.clone()))
            .collect())
    }

    fn load_optimizer_state(
        &mut self,
        opt: &mut Optimizer,
        state: &HashMap<String, Tensor>,
    ) -> Result<(), KernelError> {
        opt.load_state(state)
            .map_err(|e| KernelError::Invalid(e.to_string()))
    }

    fn optimizer_slots(opt: &Optimizer) -> &'static [&'static str] {
        opt.slot_names()
    }
}

/// The CPU runs every step as it comes: no graphs.
impl Capture for Cpu {}

/// The CPU's collectives run on the worker's host communicator.
impl DeviceCollectives for Cpu {}

/// Makes the allocator keep freed intermediates for the next step.
///
/// A step frees most of its buffers at its end. glibc's malloc serves blocks above its
/// mmap threshold (128 KiB at first, at most 32 MiB) with fresh mappings and returns
/// free memory at the top of the heap to the OS; either way the next step page-faults
/// its buffers in again (measured: 1400 faults and a quarter of the time of a step of
/// the MNIST CNN; a 51 MB densified embedding gradient took 35 ms a step to fault in,
/// five times its memset). So, as a caching allocator would, every block comes from
/// the heap and freed memory stays with the process: `M_MMAP_MAX = 0` and no trimming.
/// Once per process; elsewhere than glibc, a no-op.
pub fn warm_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: mallopt only changes malloc's tuning parameters; both values are in
        // range (glibc refuses out-of-range ones by returning 0, which changes nothing).
        #[allow(unsafe_code)]
        ONCE.call_once(|| unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        });
    }
}
