//! The schedule: what the executor runs, independent of any tensor or device.
//!
//! [`Schedule::new`] compiles a graph once: a topological order, a dense slot per
//! value, and three plans (training: every node; evaluation: only what the `loss` and
//! `output` sinks need; micro-batch: only what the loss, the `accumulate` ops and the
//! `send`s need). For each node input a plan records whether it is the value's last
//! use, so that the executor ([`crate::core::exec`]) can hand it to the kernel owned
//! and free it as soon as nothing reads it. Building a schedule allocates nothing the
//! size of a tensor.
//!
//! The same plans predict a step's memory ([`Schedule::predicted_memory`]) by the rule
//! a run measures it with ([`MemoryUse`]), and give the value lifetimes
//! ([`Schedule::lifetimes`]) a device's static memory plan lays its buffers out by.

use crate::core::error::{Result, RuntimeError};
use distc_ir::{Graph, NodeId, Op, ValueId, ValueType};
use std::collections::HashMap;

/// Bytes a step holds at its peak, by category: values the kernels computed
/// (activations, and in a backward pass the intermediate gradients), bucket buffers
/// (packed gradients and collective results) and the gradients handed to the
/// optimizer. Variables, feeds and constants are borrowed, not counted here.
///
/// The rule, for prediction and measurement alike: at each node the outputs are added,
/// the peak is taken, then the inputs at their last use are freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryUse {
    /// Peak bytes of computed values other than buckets.
    pub activations: u64,
    /// Peak bytes of packed buckets and collective results.
    pub comm_buffers: u64,
    /// Bytes of the gradients the step hands to the optimizer.
    pub gradients: u64,
}

impl MemoryUse {
    /// The larger of each category.
    pub fn max(self, o: MemoryUse) -> MemoryUse {
        MemoryUse {
            activations: self.activations.max(o.activations),
            comm_buffers: self.comm_buffers.max(o.comm_buffers),
            gradients: self.gradients.max(o.gradients),
        }
    }
}

/// Whether a node's outputs are bucket buffers.
pub(super) fn is_comm_buffer(op: &Op) -> bool {
    matches!(
        op,
        Op::Pack
            | Op::PackChunks { .. }
            | Op::AllReduce { .. }
            | Op::AllGather { .. }
            | Op::Broadcast { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGatherDense { .. }
    )
}

/// Live bytes by category while a plan runs.
#[derive(Default)]
pub(super) struct Tally {
    live: [u64; 2],
    peak: [u64; 2],
    pub(super) gradients: u64,
}

impl Tally {
    pub(super) fn add(&mut self, comm: bool, bytes: u64) {
        let c = usize::from(comm);
        self.live[c] += bytes;
        self.peak[c] = self.peak[c].max(self.live[c]);
    }
    fn free(&mut self, comm: bool, bytes: u64) {
        let c = usize::from(comm);
        self.live[c] = self.live[c].saturating_sub(bytes);
    }
    /// Frees the values the node read for the last time (`held`: each slot's category
    /// and bytes).
    pub(super) fn free_released(&mut self, held: &mut [(bool, u64)], uses: &[Use]) {
        for u in uses.iter().filter(|u| u.release) {
            let (c, b) = std::mem::take(&mut held[u.slot]);
            self.free(c, b);
        }
    }
    pub(super) fn result(&self) -> MemoryUse {
        MemoryUse {
            activations: self.peak[0],
            comm_buffers: self.peak[1],
            gradients: self.gradients,
        }
    }
}

/// Bytes of a value of type `t`, as [`Value::bytes`] counts them (slices at their
/// row bound).
pub(super) fn type_bytes(t: &ValueType) -> u64 {
    match t {
        ValueType::Tensor(t) => t.bytes() as u64,
        ValueType::IndexedSlices { dense, nnz } => {
            let rows = dense.dims().first().copied().unwrap_or(1).max(1);
            let row = dense.bytes() / rows;
            (*nnz * (row + 4)) as u64
        }
    }
}

/// What a run computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every node, dropout active.
    Train,
    /// Only the nodes the `loss` and `output` sinks need, dropout off.
    Eval,
    /// A micro-batch before the last of a step (gradient accumulation): only what the
    /// loss and the `accumulate` ops need; they keep their input for the last one.
    Micro,
}

/// One node, with its inputs and outputs as slot numbers.
#[derive(Debug)]
pub(super) struct Node {
    pub(super) id: NodeId,
    pub(super) op: Op,
    pub(super) inputs: Vec<usize>,
    pub(super) outputs: Vec<(usize, ValueType)>,
}

/// One input of a node in a plan.
#[derive(Debug)]
pub(super) struct Use {
    pub(super) slot: usize,
    /// Last use, and the only input slot of the node reading it: the kernel gets it owned.
    pub(super) take: bool,
    /// Last use: the slot is emptied after the node ran.
    pub(super) release: bool,
}

/// One node in a plan.
#[derive(Debug)]
pub(super) struct Step {
    pub(super) node: usize,
    pub(super) uses: Vec<Use>,
    /// Per output: whether a later node of the plan reads it (else it is dropped).
    pub(super) keep: Vec<bool>,
}

/// What the executor runs, independent of any tensor: the nodes in order with their
/// slots, and the training and evaluation plans with each input's last use. Building
/// it allocates nothing the size of a tensor, so memory can be predicted before a run
/// is allowed to start.
#[derive(Debug)]
pub struct Schedule {
    pub(super) nodes: Vec<Node>,
    pub(super) slots: usize,
    pub(super) train: Vec<Step>,
    pub(super) eval: Vec<Step>,
    pub(super) micro: Vec<Step>,
}

impl Schedule {
    /// The schedule of `graph`: order, slots, last uses.
    pub fn new(graph: &Graph) -> Result<Schedule> {
        let order = graph.topo_order();
        if order.len() != graph.node_count() {
            return Err(RuntimeError::Plan(format!(
                "graph `{}` has a cycle: it cannot be run",
                graph.name
            )));
        }
        let mut slot_of: HashMap<ValueId, usize> = HashMap::new();
        let mut nodes = Vec::with_capacity(order.len());
        for &id in &order {
            let n = graph.node(id);
            let inputs = n
                .inputs
                .iter()
                .map(|v| {
                    slot_of.get(v).copied().ok_or_else(|| RuntimeError::Kernel {
                        node: id.to_string(),
                        op: n.op.mnemonic(),
                        message: format!("reads {v}, which no earlier node produces"),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let outputs = n
                .outputs
                .iter()
                .enumerate()
                .map(|(port, ty)| {
                    let slot = slot_of.len();
                    slot_of.insert(id.out(port as u16), slot);
                    (slot, ty.clone())
                })
                .collect();
            nodes.push(Node {
                id,
                op: n.op.clone(),
                inputs,
                outputs,
            });
        }
        let all = vec![true; nodes.len()];
        let needed = needed_for(&nodes, slot_of.len(), Mode::Eval, |op| {
            matches!(op, Op::Loss | Op::Output { .. })
        });
        // A pipeline stage's sends carry every micro-batch to the next stage; running
        // statistics move after every micro-batch, as PyTorch's move on every forward.
        let micro = needed_for(&nodes, slot_of.len(), Mode::Micro, |op| {
            matches!(
                op,
                Op::Loss | Op::Accumulate { .. } | Op::Send { .. } | Op::Assign { .. }
            )
        });
        Ok(Schedule {
            train: plan(&nodes, &all, slot_of.len(), Mode::Train),
            eval: plan(&nodes, &needed, slot_of.len(), Mode::Eval),
            micro: plan(&nodes, &micro, slot_of.len(), Mode::Micro),
            slots: slot_of.len(),
            nodes,
        })
    }
}

/// How long a computed value lives in the training plan, for a static memory plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Lifetime {
    /// The node that computes it.
    pub node: NodeId,
    /// Its output port.
    pub port: usize,
    /// Its type.
    pub ty: ValueType,
    /// The plan position of `node`.
    pub first: usize,
    /// The plan position of the last node that reads it (`first` if none does).
    pub last: usize,
}

impl Schedule {
    /// The nodes in the order they run (the training plan runs every one).
    pub fn order(&self) -> impl Iterator<Item = (NodeId, &Op)> {
        self.nodes.iter().map(|n| (n.id, &n.op))
    }

    /// The lifetime of every value the training plan computes (sources are borrowed,
    /// not computed). The evaluation and micro-batch plans run subsets of its nodes in
    /// the same order, so a memory plan that keeps these lifetimes apart serves them
    /// too.
    pub fn lifetimes(&self) -> Vec<Lifetime> {
        let mut last = vec![None; self.slots];
        for (k, st) in self.train.iter().enumerate() {
            for u in &st.uses {
                last[u.slot] = Some(k);
            }
        }
        let mut out = Vec::new();
        for (k, st) in self.train.iter().enumerate() {
            let node = &self.nodes[st.node];
            if node.op.is_source() {
                continue;
            }
            for (port, (slot, ty)) in node.outputs.iter().enumerate() {
                out.push(Lifetime {
                    node: node.id,
                    port,
                    ty: ty.clone(),
                    first: k,
                    last: last[*slot].unwrap_or(k).max(k),
                });
            }
        }
        out
    }

    /// Micro-batches per step: the `micro` of the `accumulate` ops (1 without).
    pub fn micro_batches(&self) -> usize {
        self.nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::Accumulate { micro } => Some(micro),
                _ => None,
            })
            .max()
            .unwrap_or(1)
    }

    /// Whether the program pulls from or pushes to parameter servers.
    pub fn has_server_ops(&self) -> bool {
        self.nodes
            .iter()
            .any(|n| n.op.is_communication() && !n.op.is_collective())
    }

    /// Whether a run in `mode` makes a collective.
    pub fn has_collective(&self, mode: Mode) -> bool {
        let plan = match mode {
            Mode::Train => &self.train,
            Mode::Eval => &self.eval,
            Mode::Micro => &self.micro,
        };
        plan.iter().any(|st| self.nodes[st.node].op.is_collective())
    }

    /// What a run in `mode` will hold at its peak, from the plan and the IR's types by
    /// the rule the run measures with (slices at their row bound).
    pub fn predicted_memory(&self, mode: Mode) -> MemoryUse {
        self.predicted_memory_with(mode, &HashMap::new())
    }

    /// [`Schedule::predicted_memory`], counting the slices a node in `rows` produces at
    /// that many rows instead of their type's bound (the rows a batch is measured to
    /// touch, for `unique_rows` and `all_gather`).
    pub fn predicted_memory_with(&self, mode: Mode, rows: &HashMap<NodeId, usize>) -> MemoryUse {
        let plan = match mode {
            Mode::Train => &self.train,
            Mode::Eval => &self.eval,
            Mode::Micro => &self.micro,
        };
        let mut tally = Tally::default();
        let mut held: Vec<(bool, u64)> = vec![(false, 0); self.slots];
        for st in plan {
            let node = &self.nodes[st.node];
            match &node.op {
                Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } => continue,
                Op::ParamGrad { .. } => {
                    if let Some(u) = st.uses.first() {
                        tally.gradients += held[u.slot].1;
                    }
                }
                // As the executor runs it: the micro-batch's gradient is added into the
                // running sum and freed first; the sum is the gradient the step hands
                // over (counted there), and only the last micro-batch's mean is a value.
                Op::Accumulate { .. } => {
                    tally.free_released(&mut held, &st.uses);
                    if mode != Mode::Micro {
                        if let (Some(&(slot, ref ty)), Some(true)) =
                            (node.outputs.first(), st.keep.first())
                        {
                            let bytes = type_bytes(ty);
                            held[slot] = (false, bytes);
                            tally.add(false, bytes);
                        }
                    }
                    continue;
                }
                op => {
                    let comm = is_comm_buffer(op);
                    for (&(slot, ref ty), &keep) in node.outputs.iter().zip(&st.keep) {
                        if keep {
                            let bytes = match (ty, rows.get(&node.id)) {
                                (ValueType::IndexedSlices { dense, nnz }, Some(&r)) => {
                                    type_bytes(&ValueType::IndexedSlices {
                                        dense: dense.clone(),
                                        nnz: r.min(*nnz),
                                    })
                                }
                                _ => type_bytes(ty),
                            };
                            held[slot] = (comm, bytes);
                            tally.add(comm, bytes);
                        }
                    }
                }
            }
            tally.free_released(&mut held, &st.uses);
        }
        tally.result()
    }
}

/// The nodes `root` picks and everything they read.
/// The input slots a node reads in `mode`: all of them, but one of `train_or_eval`'s
/// two (the other side is not computed for it).
fn reads(node: &Node, mode: Mode) -> &[usize] {
    match (&node.op, mode) {
        (Op::TrainOrEval, Mode::Eval) => &node.inputs[1..2],
        (Op::TrainOrEval, _) => &node.inputs[..1],
        _ => &node.inputs,
    }
}

fn needed_for(nodes: &[Node], n_slots: usize, mode: Mode, root: impl Fn(&Op) -> bool) -> Vec<bool> {
    let mut producer = vec![0; n_slots];
    for (i, n) in nodes.iter().enumerate() {
        for &(s, _) in &n.outputs {
            producer[s] = i;
        }
    }
    let mut needed = vec![false; nodes.len()];
    let mut stack: Vec<usize> = nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| root(&n.op))
        .map(|(i, _)| i)
        .collect();
    while let Some(i) = stack.pop() {
        if needed[i] {
            continue;
        }
        needed[i] = true;
        stack.extend(reads(&nodes[i], mode).iter().map(|&s| producer[s]));
    }
    needed
}

/// The steps running the `included` nodes in order, with last uses.
fn plan(nodes: &[Node], included: &[bool], n_slots: usize, mode: Mode) -> Vec<Step> {
    let order: Vec<usize> = (0..nodes.len()).filter(|&i| included[i]).collect();
    let mut last = vec![None; n_slots];
    for (k, &i) in order.iter().enumerate() {
        for &s in reads(&nodes[i], mode) {
            last[s] = Some(k);
        }
    }
    order
        .iter()
        .enumerate()
        .map(|(k, &i)| {
            let ins = reads(&nodes[i], mode);
            let uses = ins
                .iter()
                .enumerate()
                .map(|(j, &s)| {
                    let release = last[s] == Some(k) && !ins[j + 1..].contains(&s);
                    let once = ins.iter().filter(|&&t| t == s).count() == 1;
                    Use {
                        slot: s,
                        take: release && once,
                        release,
                    }
                })
                .collect();
            let keep = nodes[i]
                .outputs
                .iter()
                .map(|&(s, _)| last[s].is_some())
                .collect();
            Step {
                node: i,
                uses,
                keep,
            }
        })
        .collect()
}
