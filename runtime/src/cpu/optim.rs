//! Optimizers: apply one step's gradients to the variables, keeping per-variable
//! slots (SGD momentum buffer; Adam's first and second moments).
//!
//! * SGD: `v = momentum * v + g; w -= lr * v`; with momentum 0 there is no slot and the
//!   update is `w -= lr * g` (WORKLOADS.md's plain SGD).
//! * Adam (bias-corrected, as in the paper and PyTorch):
//!   `m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
//!   w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`, with one global step
//!   count `t` (1 on the first step), advanced by [`Optimizer::end_step`].
//! * AdamW (Adam with `weight_decay > 0`, as `torch.optim.AdamW`): the decay is
//!   decoupled from the gradient, `w -= lr * wd * w` before Adam's step, with the
//!   scheduled `lr`; variables exempt from decay ([`Optimizer::exempt_from_decay`])
//!   take Adam's step alone. LARS and LAMB's decay honours the same exemptions.
//!
//! Every gradient is first multiplied by `scale` (e.g. `1/N` to average over workers).
//!
//! **Sparse gradients** (`Value::Slices`, row-sparse): duplicate rows are summed first
//! (in order of appearance). By default the update is then the dense update of the
//! scattered gradient, as `torch.optim` applies the gradient of an `nn.Embedding`:
//! every row's slots decay and every row with a non-zero slot moves (and AdamW decays
//! every row). Plain SGD updates only the touched rows, in time proportional to them:
//! the same float operations as the dense update, so bit-identical results.
//! [`Optimizer::set_lazy`] (the DSL's `lazy = true`) keeps momentum and Adam to the
//! touched rows too: the "lazy" semantics of TensorFlow's sparse apply / LazyAdam, in
//! which the slots of untouched rows are neither decayed nor used and AdamW decays the
//! touched rows only. Adam's bias correction uses the global `t` on sparse rows too.
//! LARS and LAMB always take the dense update (their trust ratio is over the whole
//! variable).
//!
//! f32 and f64 variables are supported; slots have the variable's dtype.

use crate::core::config::{LrSchedule, OptimizerSpec};
use crate::core::error::{Result, RuntimeError};
use crate::core::value::{Tensor, Value};
use ndarray::{ArrayD, IxDyn, Zip};
use num_traits::Float;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};

/// Dense updates of at least this many elements run on the rayon pool.
const PAR_MIN: usize = 1 << 15;

pub use crate::core::checkpoint::STEP_KEY;

/// The float element types the optimizer updates.
trait Elem: Float + Send + Sync + std::fmt::Debug + 'static {
    fn of(x: f64) -> Self;
    fn arr_mut(t: &mut Tensor) -> Option<&mut ArrayD<Self>>;
    fn wrap(a: ArrayD<Self>) -> Tensor;
}

impl Elem for f32 {
    fn of(x: f64) -> f32 {
        x as f32
    }
    fn arr_mut(t: &mut Tensor) -> Option<&mut ArrayD<f32>> {
        match t {
            Tensor::F32(a) => Some(a),
            _ => None,
        }
    }
    fn wrap(a: ArrayD<f32>) -> Tensor {
        Tensor::F32(a)
    }
}

impl Elem for f64 {
    fn of(x: f64) -> f64 {
        x
    }
    fn arr_mut(t: &mut Tensor) -> Option<&mut ArrayD<f64>> {
        match t {
            Tensor::F64(a) => Some(a),
            _ => None,
        }
    }
    fn wrap(a: ArrayD<f64>) -> Tensor {
        Tensor::F64(a)
    }
}

/// The update rule with its hyper-parameters.
#[derive(Clone, Copy, Debug)]
enum Rule {
    Sgd {
        lr: f64,
    },
    Momentum {
        lr: f64,
        mu: f64,
    },
    Adam {
        lr: f64,
        b1: f64,
        b2: f64,
        eps: f64,
        /// Decoupled weight decay (0: plain Adam).
        wd: f64,
    },
    Lars {
        lr: f64,
        mu: f64,
        wd: f64,
        eta: f64,
    },
    Lamb {
        lr: f64,
        b1: f64,
        b2: f64,
        eps: f64,
        wd: f64,
    },
}

impl Rule {
    /// The same rule without weight decay (a variable exempt from it).
    fn without_decay(self) -> Rule {
        match self {
            Rule::Adam {
                lr, b1, b2, eps, ..
            } => Rule::Adam {
                lr,
                b1,
                b2,
                eps,
                wd: 0.0,
            },
            Rule::Lars { lr, mu, eta, .. } => Rule::Lars {
                lr,
                mu,
                wd: 0.0,
                eta,
            },
            Rule::Lamb {
                lr, b1, b2, eps, ..
            } => Rule::Lamb {
                lr,
                b1,
                b2,
                eps,
                wd: 0.0,
            },
            other => other,
        }
    }

    /// The same rule with its learning rate multiplied by `f`.
    fn scaled(self, f: f64) -> Rule {
        match self {
            Rule::Sgd { lr } => Rule::Sgd { lr: lr * f },
            Rule::Momentum { lr, mu } => Rule::Momentum { lr: lr * f, mu },
            Rule::Adam {
                lr,
                b1,
                b2,
                eps,
                wd,
            } => Rule::Adam {
                lr: lr * f,
                b1,
                b2,
                eps,
                wd,
            },
            Rule::Lars { lr, mu, wd, eta } => Rule::Lars {
                lr: lr * f,
                mu,
                wd,
                eta,
            },
            Rule::Lamb {
                lr,
                b1,
                b2,
                eps,
                wd,
            } => Rule::Lamb {
                lr: lr * f,
                b1,
                b2,
                eps,
                wd,
            },
        }
    }
}

/// An optimizer with its per-variable slots.
#[derive(Debug)]
pub struct Optimizer {
    spec: OptimizerSpec,
    /// The rule as the spec gives it.
    base: Rule,
    /// The rule of the next update: `base` with the schedule's learning rate.
    rule: Rule,
    /// The learning-rate schedule and the run's updates, when one is followed.
    schedule: Option<(LrSchedule, u64)>,
    /// Variable name -> its slots, in [`Optimizer::slot_names`] order.
    slots: BTreeMap<String, Vec<Tensor>>,
    /// Completed steps.
    steps: u64,
    /// `steps` as an f64 scalar, for [`Optimizer::state`].
    step_tensor: Tensor,
    /// Large dense updates split over rayon's threads.
    parallel: bool,
    /// Variables the weight decay skips (by their one-device names).
    no_decay: std::collections::BTreeSet<String>,
    /// Row-sparse gradients update only their rows (see the module doc).
    lazy: bool,
}

impl Optimizer {
    /// A fresh optimizer (no slots yet; they are created, zero, on first use).
    pub fn new(spec: &OptimizerSpec) -> Optimizer {
        let rule = match *spec {
            OptimizerSpec::Sgd { lr, momentum: 0.0 } => Rule::Sgd { lr },
            OptimizerSpec::Sgd { lr, momentum } => Rule::Momentum { lr, mu: momentum },
            OptimizerSpec::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => Rule::Adam {
                lr,
                b1: beta1,
                b2: beta2,
                eps,
                wd: weight_decay,
            },
            OptimizerSpec::Lars {
                lr,
                momentum,
                weight_decay,
                trust,
            } => Rule::Lars {
                lr,
                mu: momentum,
                wd: weight_decay,
                eta: trust,
            },
            OptimizerSpec::Lamb {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => Rule::Lamb {
                lr,
                b1: beta1,
                b2: beta2,
                eps,
                wd: weight_decay,
            },
        };
        Optimizer {
            spec: spec.clone(),
            base: rule,
            rule,
            schedule: None,
            slots: BTreeMap::new(),
            steps: 0,
            parallel: true,
            step_tensor: step_tensor(0),
            no_decay: Default::default(),
            lazy: false,
        }
    }

    /// Row-sparse gradients of momentum and Adam update only the rows they hold
    /// (TensorFlow's LazyAdam), not every row as the dense gradient they stand for.
    pub fn set_lazy(&mut self, lazy: bool) {
        self.lazy = lazy;
    }

    /// Whether rows a sparse gradient does not hold move all the same
    /// ([`OptimizerSpec::moves_untouched_rows`] under this optimizer's `lazy`).
    pub fn moves_untouched_rows(&self) -> bool {
        self.spec.moves_untouched_rows(self.lazy)
    }

    /// Exempts the variables `names` (one-device names) from weight decay: their
    /// tensor-parallel parts and ZeRO chunks (`w.tp`, `w.zero`) too.
    pub fn exempt_from_decay(&mut self, names: &[String]) {
        self.no_decay = names.iter().cloned().collect();
    }

    /// The rule for variable `name`: without decay where it is exempt.
    fn rule_for(&self, name: &str) -> Rule {
        if self.no_decay.contains(distc_ir::whole_variable(name)) {
            self.rule.without_decay()
        } else {
            self.rule
        }
    }

    /// Follows `schedule` over a run of `total` updates from the next update on (the
    /// update count, restored with the state, says where in the schedule it is).
    pub fn follow(&mut self, schedule: &LrSchedule, total: u64) {
        self.schedule = (!schedule.is_constant()).then(|| (schedule.clone(), total));
        self.refresh_rule();
    }

    /// The learning rate the next update uses.
    pub fn lr(&self) -> f64 {
        match self.rule {
            Rule::Sgd { lr }
            | Rule::Momentum { lr, .. }
            | Rule::Adam { lr, .. }
            | Rule::Lars { lr, .. }
            | Rule::Lamb { lr, .. } => lr,
        }
    }

    fn refresh_rule(&mut self) {
        self.rule = match &self.schedule {
            Some((s, total)) => self.base.scaled(s.factor(self.steps, *total)),
            None => self.base,
        };
    }

    /// Bytes of every slot the optimizer holds.
    pub fn state_bytes(&self) -> u64 {
        self.slots
            .values()
            .flatten()
            .map(|t| t.bytes() as u64)
            .sum()
    }

    /// The optimizer's spec.
    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    /// Steps completed (calls of [`Optimizer::end_step`]).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The names of each variable's slots: none for plain SGD, `["momentum"]` for SGD
    /// with momentum, `["m", "v"]` for Adam.
    pub fn slot_names(&self) -> &'static [&'static str] {
        match self.rule {
            Rule::Sgd { .. } => &[],
            Rule::Momentum { .. } | Rule::Lars { .. } => &["momentum"],
            Rule::Adam { .. } | Rule::Lamb { .. } => &["m", "v"],
        }
    }

    /// Applies one gradient to one variable (see the module doc for dense and sparse
    /// semantics). `scale` multiplies the gradient first.
    pub fn apply(
        &mut self,
        name: &str,
        param: &mut Tensor,
        grad: &Value,
        scale: f64,
    ) -> Result<()> {
        // The gradient a program computed against the variable it updates: programs that
        // disagree with each other.
        let err = |m: String| RuntimeError::Plan(format!("optimizer: variable `{name}`: {m}"));
        if crate::core::planted::Planted::ZeroSlot.here() && name.ends_with(".zero") {
            self.slots.remove(name);
        }
        match grad {
            Value::Tensor(g) => {
                if g.shape() != param.shape() {
                    return Err(err(format!(
                        "gradient shape {:?} differs from the variable's {:?}",
                        g.shape(),
                        param.shape()
                    )));
                }
                match (param, g) {
                    (Tensor::F32(w), Tensor::F32(g)) => self.dense(name, w, g, scale),
                    (Tensor::F64(w), Tensor::F64(g)) => self.dense(name, w, g, scale),
                    (p, g) => Err(err(format!(
                        "cannot apply a {} gradient to a {} variable",
                        g.dtype(),
                        p.dtype()
                    ))),
                }
            }
            Value::Slices(s) => {
                if s.dense_shape.as_slice() != param.shape() || param.shape().is_empty() {
                    return Err(err(format!(
                        "sparse gradient of shape {:?} does not fit the variable's {:?}",
                        s.dense_shape,
                        param.shape()
                    )));
                }
                match (param, &s.values) {
                    (Tensor::F32(w), Tensor::F32(v)) => self.sparse(name, w, &s.indices, v, scale),
                    (Tensor::F64(w), Tensor::F64(v)) => self.sparse(name, w, &s.indices, v, scale),
                    (p, v) => Err(err(format!(
                        "cannot apply a {} sparse gradient to a {} variable",
                        v.dtype(),
                        p.dtype()
                    ))),
                }
            }
        }
    }

    /// Whether large dense updates may use rayon's threads (default yes). Off where
    /// several workers share the cores: each one's update then stays on its thread
    /// instead of queueing on the one global pool, whose spinning threads would also
    /// take cores from the other workers.
    pub fn set_parallel(&mut self, on: bool) {
        self.parallel = on;
    }

    /// Applies one step's gradients (unscaled) to their variables, then ends the step.
    pub fn step(
        &mut self,
        params: &mut HashMap<String, Tensor>,
        grads: &[(String, Value)],
    ) -> Result<()> {
        for (name, grad) in grads {
            let p = params
                .get_mut(name)
                .ok_or_else(|| RuntimeError::MissingParam(name.clone()))?;
            self.apply(name, p, grad, 1.0)?;
        }
        self.end_step();
        Ok(())
    }

    /// Ends a step (after all [`Optimizer::apply`] calls): advances Adam's `t`.
    pub fn end_step(&mut self) {
        self.steps += 1;
        self.step_tensor = step_tensor(self.steps);
        self.refresh_rule();
    }

    /// Serialisable state: each slot as `"<variable>/<slot>"` (sorted by variable),
    /// then the step count as an f64 scalar named [`STEP_KEY`].
    pub fn state(&self) -> Vec<(String, &Tensor)> {
        let names = self.slot_names();
        let mut out: Vec<(String, &Tensor)> = self
            .slots
            .iter()
            .flat_map(|(var, slots)| {
                slots
                    .iter()
                    .zip(names)
                    .map(move |(t, s)| (format!("{var}/{s}"), t))
            })
            .collect();
        out.push((STEP_KEY.to_string(), &self.step_tensor));
        out
    }

    /// Restores the state saved by [`Optimizer::state`] (e.g. from a checkpoint that
    /// also holds the variables: keys that are not this optimizer's are ignored).
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let names = self.slot_names();
        let mut found: BTreeMap<String, Vec<Option<Tensor>>> = BTreeMap::new();
        for (key, t) in state {
            if key == STEP_KEY {
                let steps = crate::core::checkpoint::step_count(t)
                    .map_err(|e| RuntimeError::state(format!("optimizer state: {e}")))?;
                self.steps = steps;
                self.step_tensor = step_tensor(self.steps);
                self.refresh_rule();
                continue;
            }
            let Some((var, slot)) = key.rsplit_once('/') else {
                continue;
            };
            if let Some(k) = names.iter().position(|n| *n == slot) {
                found
                    .entry(var.to_string())
                    .or_insert_with(|| vec![None; names.len()])[k] = Some(t.clone());
            }
        }
        for (var, slots) in found {
            let slots: Option<Vec<Tensor>> = slots.into_iter().collect();
            let slots = slots.ok_or_else(|| {
                RuntimeError::state(format!(
                    "optimizer state: variable `{var}` lacks some of its slots ({})",
                    names.join(", ")
                ))
            })?;
            self.slots.insert(var, slots);
        }
        Ok(())
    }

    /// The slots of `name` (created as zeros of `shape` on first use), checked.
    fn slots_for<T: Elem>(&mut self, name: &str, shape: &[usize]) -> Result<&mut Vec<Tensor>> {
        let n = self.slot_names().len();
        let slots = self.slots.entry(name.to_string()).or_insert_with(|| {
            (0..n)
                .map(|_| T::wrap(ArrayD::zeros(IxDyn(shape))))
                .collect()
        });
        for t in slots.iter_mut() {
            let ok = t.shape() == shape;
            match T::arr_mut(t) {
                Some(a) if ok => {
                    if !a.is_standard_layout() {
                        *a = a.as_standard_layout().into_owned();
                    }
                }
                _ => {
                    // Slots made here fit; a loaded one may not.
                    return Err(RuntimeError::state(format!(
                        "optimizer: variable `{name}`: its slot is {}{:?}, the variable {:?}",
                        t.dtype(),
                        t.shape(),
                        shape
                    )));
                }
            }
        }
        Ok(slots)
    }

    fn dense<T: Elem>(
        &mut self,
        name: &str,
        w: &mut ArrayD<T>,
        g: &ArrayD<T>,
        scale: f64,
    ) -> Result<()> {
        let sc = T::of(scale);
        let par = self.parallel && w.len() >= PAR_MIN;
        match self.rule_for(name) {
            Rule::Sgd { lr } => {
                let lr = T::of(lr);
                let z = Zip::from(w).and(g);
                let f = |w: &mut T, &g: &T| *w = *w - lr * (g * sc);
                if par {
                    z.par_for_each(f)
                } else {
                    z.for_each(f)
                }
            }
            Rule::Momentum { lr, mu } => {
                let (lr, mu) = (T::of(lr), T::of(mu));
                let slots = self.slots_for::<T>(name, w.shape())?;
                let v = slot_arr(name, &mut slots[0])?;
                let z = Zip::from(w).and(g).and(v);
                let f = |w: &mut T, &g: &T, v: &mut T| {
                    *v = mu * *v + g * sc;
                    *w = *w - lr * *v;
                };
                if par {
                    z.par_for_each(f)
                } else {
                    z.for_each(f)
                }
            }
            Rule::Adam {
                lr,
                b1,
                b2,
                eps,
                wd,
            } => {
                let t = (self.steps + 1) as f64;
                let (bc1, bc2) = (T::of(1.0 - b1.powf(t)), T::of(1.0 - b2.powf(t)));
                // 1-b computed in f64: f32(0.999) is off by 5e-8, which is 5e-5 of 1-b2.
                let (c1, c2) = (T::of(1.0 - b1), T::of(1.0 - b2));
                // AdamW's decoupled decay, as torch: w *= 1 - lr * wd, then Adam's step.
                let keep = T::of(1.0 - lr * wd);
                let decays = wd != 0.0;
                let (lr, b1, b2, eps) = (T::of(lr), T::of(b1), T::of(b2), T::of(eps));
                let slots = self.slots_for::<T>(name, w.shape())?;
                let [m, v] = slots.as_mut_slice() else {
                    return Err(slot_count(name));
                };
                let (m, v) = (slot_arr(name, m)?, slot_arr(name, v)?);
                let z = Zip::from(w).and(g).and(m).and(v);
                let f = |w: &mut T, &g: &T, m: &mut T, v: &mut T| {
                    let g = g * sc;
                    *m = b1 * *m + c1 * g;
                    *v = b2 * *v + c2 * g * g;
                    if decays {
                        *w = *w * keep;
                    }
                    *w = *w - lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
                };
                if par {
                    z.par_for_each(f)
                } else {
                    z.for_each(f)
                }
            }
            // The trust ratios need the whole variable's norms first: two passes, the
            // norms summed in f64 in element order (the same bits every run).
            Rule::Lars { lr, mu, wd, eta } => {
                let (w_norm, g_norm) = (norm(w.iter().copied()), scale * norm(g.iter().copied()));
                let trust = if w_norm > 0.0 && g_norm > 0.0 {
                    eta * w_norm / (g_norm + wd * w_norm)
                } else {
                    1.0
                };
                let (step, mu, wd) = (T::of(lr * trust), T::of(mu), T::of(wd));
                let slots = self.slots_for::<T>(name, w.shape())?;
                let v = slot_arr(name, &mut slots[0])?;
                Zip::from(w).and(g).and(v).for_each(|w, &g, v| {
                    *v = mu * *v + step * (g * sc + wd * *w);
                    *w = *w - *v;
                });
            }
            Rule::Lamb {
                lr,
                b1,
                b2,
                eps,
                wd,
            } => {
                let t = (self.steps + 1) as f64;
                let (bc1, bc2) = (T::of(1.0 - b1.powf(t)), T::of(1.0 - b2.powf(t)));
                let (c1, c2) = (T::of(1.0 - b1), T::of(1.0 - b2));
                let (b1, b2, eps, wd) = (T::of(b1), T::of(b2), T::of(eps), T::of(wd));
                let slots = self.slots_for::<T>(name, w.shape())?;
                let [m, v] = slots.as_mut_slice() else {
                    return Err(slot_count(name));
                };
                let (m, v) = (slot_arr(name, m)?, slot_arr(name, v)?);
                let ratio = |w: T, m: T, v: T| (m / bc1) / ((v / bc2).sqrt() + eps) + wd * w;
                Zip::from(&*w)
                    .and(g)
                    .and(&mut *m)
                    .and(&mut *v)
                    .for_each(|_, &g, m, v| {
                        let g = g * sc;
                        *m = b1 * *m + c1 * g;
                        *v = b2 * *v + c2 * g * g;
                    });
                let w_norm = norm(w.iter().copied());
                let r_norm = norm(
                    Zip::from(&*w)
                        .and(&*m)
                        .and(&*v)
                        .map_collect(|&w, &m, &v| ratio(w, m, v))
                        .into_iter(),
                );
                let trust = if w_norm > 0.0 && r_norm > 0.0 {
                    w_norm / r_norm
                } else {
                    1.0
                };
                let step = T::of(lr * trust);
                Zip::from(w).and(&*m).and(&*v).for_each(|w, &m, &v| {
                    *w = *w - step * ratio(*w, m, v);
                });
            }
        }
        Ok(())
    }

    fn sparse<T: Elem>(
        &mut self,
        name: &str,
        w: &mut ArrayD<T>,
        indices: &[i32],
        values: &ArrayD<T>,
        scale: f64,
    ) -> Result<()> {
        let err = |m: String| RuntimeError::Plan(format!("optimizer: variable `{name}`: {m}"));
        // What this function laid out itself.
        let internal =
            |m: String| RuntimeError::internal("the optimizer", format!("variable `{name}`: {m}"));
        let shape = w.shape().to_vec();
        let rows = shape[0];
        let row: usize = shape[1..].iter().product();
        if values.shape().first() != Some(&indices.len()) || values.len() != indices.len() * row {
            return Err(err(format!(
                "sparse gradient values {:?} do not hold {} rows of {row}",
                values.shape(),
                indices.len()
            )));
        }
        let vals = values.as_standard_layout();
        let vals = vals
            .as_slice()
            .ok_or_else(|| internal("non-contiguous values".into()))?;
        // Sum duplicate rows, in order of appearance.
        let mut pos: HashMap<i32, usize> = HashMap::with_capacity(indices.len());
        let mut uniq: Vec<usize> = Vec::with_capacity(indices.len());
        let mut sums: Vec<T> = Vec::with_capacity(vals.len());
        for (k, &i) in indices.iter().enumerate() {
            if i < 0 || i as usize >= rows {
                // The ids come from the data.
                return Err(RuntimeError::plan(format!(
                    "optimizer: variable `{name}`: row index {i} is not in 0..{rows}"
                )));
            }
            let src = &vals[k * row..(k + 1) * row];
            match pos.entry(i) {
                Entry::Occupied(e) => {
                    let at = *e.get() * row;
                    for (a, &b) in sums[at..at + row].iter_mut().zip(src) {
                        *a = *a + b;
                    }
                }
                Entry::Vacant(e) => {
                    e.insert(uniq.len());
                    uniq.push(i as usize);
                    sums.extend_from_slice(src);
                }
            }
        }
        let rule = self.rule_for(name);
        // The trust ratio of LARS and LAMB is over the whole variable, and without
        // `lazy` every row's slots move: the rows are applied as the dense gradient
        // they stand for.
        if self.moves_untouched_rows() {
            let mut dense = ArrayD::<T>::zeros(IxDyn(&shape));
            let ds = dense
                .as_slice_mut()
                .ok_or_else(|| internal("non-contiguous gradient".into()))?;
            for (k, &r) in uniq.iter().enumerate() {
                ds[r * row..(r + 1) * row].copy_from_slice(&sums[k * row..(k + 1) * row]);
            }
            return self.dense(name, w, &dense, scale);
        }
        if !w.is_standard_layout() {
            *w = w.as_standard_layout().into_owned();
        }
        let ws = w
            .as_slice_mut()
            .ok_or_else(|| internal("non-contiguous variable".into()))?;
        let sc = T::of(scale);
        let touched = uniq.iter().enumerate().map(|(k, &r)| (r * row, k * row));
        match rule {
            Rule::Sgd { lr } => {
                let lr = T::of(lr);
                for (at, from) in touched {
                    for (w, &g) in ws[at..at + row].iter_mut().zip(&sums[from..from + row]) {
                        *w = *w - lr * (g * sc);
                    }
                }
            }
            Rule::Momentum { lr, mu } => {
                let (lr, mu) = (T::of(lr), T::of(mu));
                let slots = self.slots_for::<T>(name, &shape)?;
                let vs = slot(name, &mut slots[0])?;
                for (at, from) in touched {
                    let rows = ws[at..at + row].iter_mut().zip(&mut vs[at..at + row]);
                    for ((w, v), &g) in rows.zip(&sums[from..from + row]) {
                        *v = mu * *v + g * sc;
                        *w = *w - lr * *v;
                    }
                }
            }
            Rule::Lars { .. } | Rule::Lamb { .. } => {
                return Err(internal("LARS and LAMB take the dense update".into()))
            }
            Rule::Adam {
                lr,
                b1,
                b2,
                eps,
                wd,
            } => {
                let t = (self.steps + 1) as f64;
                let (bc1, bc2) = (T::of(1.0 - b1.powf(t)), T::of(1.0 - b2.powf(t)));
                // 1-b computed in f64: f32(0.999) is off by 5e-8, which is 5e-5 of 1-b2.
                let (c1, c2) = (T::of(1.0 - b1), T::of(1.0 - b2));
                // Lazy AdamW decays the touched rows only, as the moments move.
                let keep = T::of(1.0 - lr * wd);
                let (lr, b1, b2, eps) = (T::of(lr), T::of(b1), T::of(b2), T::of(eps));
                let slots = self.slots_for::<T>(name, &shape)?;
                let [m, v] = slots.as_mut_slice() else {
                    return Err(slot_count(name));
                };
                let (ms, vs) = (slot(name, m)?, slot(name, v)?);
                for (at, from) in touched {
                    let rows = ws[at..at + row]
                        .iter_mut()
                        .zip(&mut ms[at..at + row])
                        .zip(&mut vs[at..at + row]);
                    for (((w, m), v), &g) in rows.zip(&sums[from..from + row]) {
                        let g = g * sc;
                        *m = b1 * *m + c1 * g;
                        *v = b2 * *v + c2 * g * g;
                        *w = *w * keep - lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
                    }
                }
            }
        }
        Ok(())
    }
}

/// The Euclidean norm, summed in f64 in the order given.
fn norm<T: Elem>(xs: impl Iterator<Item = T>) -> f64 {
    xs.map(|x| {
        let x = x.to_f64().unwrap_or(f64::NAN);
        x * x
    })
    .sum::<f64>()
    .sqrt()
}

fn step_tensor(steps: u64) -> Tensor {
    Tensor::F64(ndarray::arr0(steps as f64).into_dyn())
}

/// A slot's elements (slots are kept contiguous by `slots_for`).
fn slot<'a, T: Elem>(name: &str, t: &'a mut Tensor) -> Result<&'a mut [T]> {
    T::arr_mut(t)
        .and_then(|a| a.as_slice_mut())
        .ok_or_else(|| wrong_slot(name))
}

/// A slot as an array.
fn slot_arr<'a, T: Elem>(name: &str, t: &'a mut Tensor) -> Result<&'a mut ArrayD<T>> {
    T::arr_mut(t).ok_or_else(|| wrong_slot(name))
}

/// `slots_for` checked every slot's dtype and layout: one that is not is the
/// optimizer's own bug.
fn wrong_slot(name: &str) -> RuntimeError {
    RuntimeError::internal(
        "the optimizer",
        format!("variable `{name}`: a slot has the wrong dtype"),
    )
}

/// Every variable's slots are the rule's (`slots_for`, `load_state`).
fn slot_count(name: &str) -> RuntimeError {
    RuntimeError::internal(
        "the optimizer",
        format!("variable `{name}` has the wrong number of slots"),
    )
}
