//! Kernel fusion (`--fuse`): collapses each maximal tree of element-wise ops into one
//! `fused` node, so the runtime passes over memory once per tree instead of once per
//! op (a CPU loop over cache-sized blocks; one generated kernel on a GPU).
//!
//! Fusible: `add sub mul div neg relu sigmoid tanh exp log`, the activation gradients
//! (`relu_grad` is `dy * step(x)`, `sigmoid_grad` `dy * y * (1 - y)`, `tanh_grad`
//! `dy * (1 - y * y)`), `broadcast_to` (a numpy broadcast, which the fused node does
//! as it reads), earlier `fused` nodes, and float `constant`s (absorbed as literals,
//! copied into every group that reads them). Only dense f32/f64 values take part.
//!
//! A group grows from a root (visited consumers first) by absorbing a producer when
//! every reader of its value is already in the group, so a group has one result and
//! nothing outside reads its interior; communication ops, sources, sinks and every
//! other op stay where they are, and a group of one op stays that op. A matmul stays a
//! matmul: its bias add and activation become one node reading the matmul and the
//! bias. The group's result must have the broadcast shape of its inputs (a
//! `broadcast_to` that is the only source of the result's shape is not absorbed).
//!
//! One rewrite makes room: `relu_grad(dy, x)` reads the pre-activation `x`, which
//! would then have two readers and keep the bias add out of the forward group; it reads
//! `relu(x)` instead when the graph has it (`relu(x) > 0` exactly when `x > 0`), which
//! also frees the pre-activation at the end of the forward pass.
//!
//! Runs on the worker program after every pass that makes element-wise ops (autodiff,
//! simplify, remat, the strategy rewrites) and before `schedule`; the fused node takes
//! its root's place in the node order, so the executor's order is unchanged. A no-op
//! without `--fuse`. Before/after:
//! ```text
//! %8 = matmul %0, %2 : f32[100,512]       %8 = matmul %0, %2 : f32[100,512]
//! %9 = add %8, %3 : f32[100,512]    =>    %9 = fused{expr="relu(add(in0, in1))"} %8, %3
//! %10 = relu %9 : f32[100,512]                 : f32[100,512]
//! %22 = relu_grad %20, %9                 %21 = relu_grad %19, %9
//! ```

use crate::cost::{elementwise_cost, ComputeCost};
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::shape::broadcast_shapes;
use distc_ir::{
    BinaryFn, FusedExpr, FusedStep, Graph, NodeId, Op, TensorType, UnaryFn, ValueId, ValueType,
};
use std::collections::{HashMap, HashSet};

/// The kernel-fusion pass.
pub struct KernelFusion;

impl Pass for KernelFusion {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        if !cx.strategy.fuse {
            return Ok(PassStats {
                counters: vec![],
                note: Some("off (--fuse not given)".into()),
            });
        }
        let rewired = read_relu_outputs(g);
        let groups = find_groups(g);
        let mut before = ComputeCost::default();
        let mut absorbed = 0;
        for grp in &groups {
            absorbed += grp.members.len();
            for &m in &grp.members {
                before = before + elementwise_cost(g, m).unwrap_or_default();
            }
        }
        let fused = rebuild(g, &groups)?;
        let after = fused
            .iter()
            .map(|&id| elementwise_cost(g, id).unwrap_or_default())
            .fold(ComputeCost::default(), |a, b| a + b);
        let stats = PassStats::default()
            .count("groups", groups.len())
            .count("ops_fused", absorbed)
            .count("relu_grads_rewired", rewired);
        if groups.is_empty() {
            return Ok(stats);
        }
        Ok(stats.with_note(format!(
            "memory traffic of the fused ops {} -> {} per step",
            human_bytes(before.bytes),
            human_bytes(after.bytes)
        )))
    }
}

fn human_bytes(b: f64) -> String {
    if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else {
        format!("{:.1} KB", b / 1e3)
    }
}

/// Points each `relu_grad(dy, x)` at `relu(x)` where the graph computes it; returns
/// how many it rewired.
fn read_relu_outputs(g: &mut Graph) -> usize {
    let mut n = 0;
    for id in g.topo_order() {
        if !matches!(g.op(id), Op::ReluGrad) {
            continue;
        }
        let x = g.node(id).inputs[1];
        let relu = g
            .users(x)
            .into_iter()
            .map(|(u, _)| u)
            .find(|&u| matches!(g.op(u), Op::Relu));
        if let Some(r) = relu {
            g.set_input(id, 1, r.into());
            n += 1;
        }
    }
    n
}

/// One group: the nodes it replaces, its root (whose value it computes), the
/// expression and the values it reads.
struct Group {
    root: NodeId,
    members: Vec<NodeId>,
    expr: FusedExpr,
    inputs: Vec<ValueId>,
}

/// The dense float type of a node's only result, if it has exactly one.
fn float_result(g: &Graph, id: NodeId) -> Option<&TensorType> {
    match g.node(id).outputs.as_slice() {
        [ValueType::Tensor(t)] if t.dtype.is_float() => Some(t),
        _ => None,
    }
}

/// Whether `id` may be a member of a group (constants are absorbed separately).
fn fusible(g: &Graph, id: NodeId) -> bool {
    let node = g.node(id);
    node.op.is_elementwise_math()
        && float_result(g, id).is_some()
        && node
            .inputs
            .iter()
            .all(|v| matches!(g.value_type(*v), ValueType::Tensor(t) if t.dtype.is_float()))
}

/// The groups of two or more ops, consumers first.
fn find_groups(g: &Graph) -> Vec<Group> {
    let order = g.topo_order();
    let mut taken: HashSet<NodeId> = HashSet::new();
    let mut groups = Vec::new();
    for &root in order.iter().rev() {
        if taken.contains(&root) || !fusible(g, root) {
            continue;
        }
        let mut members: Vec<NodeId> = vec![root];
        let mut inside: HashSet<NodeId> = HashSet::from([root]);
        // Each member is expanded once. A producer refused now (a reader outside) is
        // looked at again when that reader joins, since the reader is expanded then.
        let mut next = 0;
        while next < members.len() {
            let m = members[next];
            next += 1;
            for v in &g.node(m).inputs {
                let p = v.node;
                if inside.contains(&p) || taken.contains(&p) || !fusible(g, p) {
                    continue;
                }
                if g.user_nodes(p).iter().all(|u| inside.contains(u)) {
                    inside.insert(p);
                    members.push(p);
                }
            }
        }
        if members.len() < 2 {
            continue;
        }
        let Some(grp) = build(g, root, members, &inside) else {
            continue;
        };
        taken.extend(grp.members.iter().copied());
        groups.push(grp);
    }
    groups
}

/// The expression of a group, or `None` when its result does not have the broadcast
/// shape and dtype of the values it reads.
fn build(g: &Graph, root: NodeId, members: Vec<NodeId>, inside: &HashSet<NodeId>) -> Option<Group> {
    let out_ty = float_result(g, root)?.clone();
    let mut b = ExprBuilder {
        g,
        inside,
        dtype: out_ty.dtype,
        steps: Vec::new(),
        memo: HashMap::new(),
        inputs: Vec::new(),
    };
    b.value(root.into())?;
    let mut shape: Vec<usize> = Vec::new();
    for v in &b.inputs {
        let t = g.tensor_type(*v);
        if t.dtype != out_ty.dtype {
            return None;
        }
        shape = broadcast_shapes(&shape, t.dims())?;
    }
    if b.inputs.is_empty() || shape != out_ty.dims() {
        return None;
    }
    // Canonical step order, then inputs numbered in the order the expression reads
    // them, so the text reads `relu(add(in0, in1))` and parses back to this expression.
    let canonical = FusedExpr { steps: b.steps }.canonical();
    let first_read = canonical.input_order();
    let renumber: HashMap<usize, usize> = first_read
        .iter()
        .enumerate()
        .map(|(new, &old)| (old, new))
        .collect();
    let steps = canonical
        .steps
        .into_iter()
        .map(|s| match s {
            FusedStep::Input(k) => FusedStep::Input(renumber[&k]),
            s => s,
        })
        .collect();
    let inputs = first_read.iter().map(|&k| b.inputs[k]).collect();
    Some(Group {
        root,
        members,
        expr: FusedExpr { steps },
        inputs,
    })
}

struct ExprBuilder<'a> {
    g: &'a Graph,
    inside: &'a HashSet<NodeId>,
    dtype: distc_ir::DType,
    steps: Vec<FusedStep>,
    memo: HashMap<ValueId, usize>,
    inputs: Vec<ValueId>,
}

impl ExprBuilder<'_> {
    fn push(&mut self, s: FusedStep) -> usize {
        self.steps.push(s);
        self.steps.len() - 1
    }

    /// The step computing value `v` (a member's result, a constant, or an input);
    /// `None` for a member `fusible` should not have admitted.
    fn value(&mut self, v: ValueId) -> Option<usize> {
        if let Some(&s) = self.memo.get(&v) {
            return Some(s);
        }
        let node = self.g.node(v.node);
        let s = if self.inside.contains(&v.node) {
            self.member(v.node)?
        } else {
            match &node.op {
                Op::Constant { value, ty } if ty.dtype == self.dtype => {
                    self.push(FusedStep::Const(*value))
                }
                _ => {
                    let k = match self.inputs.iter().position(|&x| x == v) {
                        Some(k) => k,
                        None => {
                            self.inputs.push(v);
                            self.inputs.len() - 1
                        }
                    };
                    self.push(FusedStep::Input(k))
                }
            }
        };
        self.memo.insert(v, s);
        Some(s)
    }

    fn member(&mut self, id: NodeId) -> Option<usize> {
        let node = self.g.node(id);
        let ins = node.inputs.clone();
        let un = |b: &mut Self, f: UnaryFn| {
            let a = b.value(ins[0])?;
            Some(b.push(FusedStep::Unary(f, a)))
        };
        let bin = |b: &mut Self, f: BinaryFn| {
            let x = b.value(ins[0])?;
            let y = b.value(ins[1])?;
            Some(b.push(FusedStep::Binary(f, x, y)))
        };
        match &node.op {
            Op::Add => bin(self, BinaryFn::Add),
            Op::Sub => bin(self, BinaryFn::Sub),
            Op::Mul => bin(self, BinaryFn::Mul),
            Op::Div => bin(self, BinaryFn::Div),
            Op::Neg => un(self, UnaryFn::Neg),
            Op::Relu => un(self, UnaryFn::Relu),
            Op::Sigmoid => un(self, UnaryFn::Sigmoid),
            Op::Tanh => un(self, UnaryFn::Tanh),
            Op::Exp => un(self, UnaryFn::Exp),
            Op::Log => un(self, UnaryFn::Log),
            Op::BroadcastTo { .. } => self.value(ins[0]),
            Op::ReluGrad => {
                let dy = self.value(ins[0])?;
                let x = self.value(ins[1])?;
                let step = self.push(FusedStep::Unary(UnaryFn::Step, x));
                Some(self.push(FusedStep::Binary(BinaryFn::Mul, dy, step)))
            }
            Op::SigmoidGrad => {
                // As the kernel does it: (dy * y) * (1 - y).
                let dy = self.value(ins[0])?;
                let y = self.value(ins[1])?;
                let dyy = self.push(FusedStep::Binary(BinaryFn::Mul, dy, y));
                let one = self.push(FusedStep::Const(1.0));
                let rest = self.push(FusedStep::Binary(BinaryFn::Sub, one, y));
                Some(self.push(FusedStep::Binary(BinaryFn::Mul, dyy, rest)))
            }
            Op::TanhGrad => {
                let dy = self.value(ins[0])?;
                let y = self.value(ins[1])?;
                let yy = self.push(FusedStep::Binary(BinaryFn::Mul, y, y));
                let one = self.push(FusedStep::Const(1.0));
                let rest = self.push(FusedStep::Binary(BinaryFn::Sub, one, yy));
                Some(self.push(FusedStep::Binary(BinaryFn::Mul, dy, rest)))
            }
            Op::Fused { expr } => {
                let mut map: Vec<usize> = Vec::with_capacity(expr.steps.len());
                for s in &expr.steps {
                    let n = match *s {
                        FusedStep::Input(k) => self.value(*ins.get(k)?)?,
                        FusedStep::Const(c) => self.push(FusedStep::Const(c)),
                        FusedStep::Unary(f, a) => self.push(FusedStep::Unary(f, *map.get(a)?)),
                        FusedStep::Binary(f, a, b) => {
                            self.push(FusedStep::Binary(f, *map.get(a)?, *map.get(b)?))
                        }
                    };
                    map.push(n);
                }
                map.last().copied()
            }
            // `fusible` admits nothing else.
            _ => None,
        }
    }
}

/// Rebuilds `g` in its topological order with each group's `fused` node in its root's
/// place; drops the members and the constants only groups read. Returns the new nodes.
fn rebuild(g: &mut Graph, groups: &[Group]) -> Result<Vec<NodeId>, PassError> {
    let by_root: HashMap<NodeId, &Group> = groups.iter().map(|grp| (grp.root, grp)).collect();
    let members: HashSet<NodeId> = groups
        .iter()
        .flat_map(|grp| grp.members.iter().copied())
        .collect();
    let read_whole: HashSet<NodeId> = groups
        .iter()
        .flat_map(|grp| grp.inputs.iter().map(|v| v.node))
        .collect();
    let dropped = |id: NodeId| {
        members.contains(&id)
            || (matches!(g.op(id), Op::Constant { .. })
                && !read_whole.contains(&id)
                && !g.user_nodes(id).is_empty()
                && g.user_nodes(id).iter().all(|u| members.contains(u)))
    };
    let mut out = Graph::new(g.name.clone());
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    let mut fused = Vec::new();
    for id in g.topo_order() {
        if let Some(grp) = by_root.get(&id) {
            let inputs = grp
                .inputs
                .iter()
                .map(|v| map[&v.node].out(v.port))
                .collect();
            let nid = out.add(
                Op::Fused {
                    expr: grp.expr.clone(),
                },
                inputs,
            )?;
            if out.node(nid).outputs != g.node(id).outputs {
                return Err(PassError::Precondition(format!(
                    "{id} ({}): the fused node computes {}, the op it replaces {}",
                    g.op(id),
                    out.value_type(nid.into()),
                    g.value_type(id.into())
                )));
            }
            map.insert(id, nid);
            fused.push(nid);
            continue;
        }
        if dropped(id) {
            continue;
        }
        let node = g.node(id);
        let inputs = node
            .inputs
            .iter()
            .map(|v| map[&v.node].out(v.port))
            .collect();
        map.insert(
            id,
            out.add_typed(node.op.clone(), inputs, node.outputs.clone()),
        );
    }
    *g = out;
    Ok(fused)
}
