//! The graph: nodes on a petgraph `StableDiGraph`, handed out as typed ids.
//!
//! A node's ordered inputs live in the node itself; the graph's edges mirror them
//! (one edge per input slot) so that users and topological order come from petgraph.
//! Only this module touches the petgraph, which keeps the two in step.

use crate::op::Op;
use crate::shape::{infer, ShapeError};
use crate::types::{TensorType, ValueType};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;

thread_local! {
    /// See [`query_work`].
    static QUERY_WORK: Cell<u64> = const { Cell::new(0) };
}

/// The nodes and edges that this thread's graph queries have visited so far:
/// [`Graph::node_ids`], [`Graph::topo_order`], [`Graph::users`], [`Graph::user_nodes`]
/// and those built on them ([`Graph::params`], ...). Tests compare it at two model
/// sizes to hold an algorithm linear without a clock: a loop that rescans the graph
/// per statement or per variable grows fourfold when the model doubles.
pub fn query_work() -> u64 {
    QUERY_WORK.with(Cell::get)
}

fn count_work(visited: usize) {
    QUERY_WORK.with(|w| w.set(w.get().saturating_add(visited as u64)));
}

/// The input a backward pass starts from under fp16's dynamic loss scaling: the
/// runtime feeds the current scale (the gradients are unscaled before the update).
pub const LOSS_SCALE: &str = "loss_scale";

/// A node of the graph. `Display` is its text-IR spelling, `%7`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

impl NodeId {
    fn index(self) -> NodeIndex {
        NodeIndex::new(self.0 as usize)
    }
    /// The value on output port `port`.
    pub fn out(self, port: u16) -> ValueId {
        ValueId { node: self, port }
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One output of a node. `Display` is `%7` for port 0 and `%7#1` otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId {
    /// The producing node.
    pub node: NodeId,
    /// Which of its outputs.
    pub port: u16,
}

impl From<NodeId> for ValueId {
    fn from(node: NodeId) -> ValueId {
        ValueId { node, port: 0 }
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port == 0 {
            write!(f, "{}", self.node)
        } else {
            write!(f, "{}#{}", self.node, self.port)
        }
    }
}

/// An op with its inputs and result types.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// Inputs in slot order.
    pub inputs: Vec<ValueId>,
    /// Result types, one per output port.
    pub outputs: Vec<ValueType>,
}

/// A node in canonical form: op, inputs as (position, port), result types.
type CanonicalNode = (Op, Vec<(usize, u16)>, Vec<ValueType>);

#[derive(Clone, Copy, Debug)]
struct Edge {
    slot: u16,
}

/// A dataflow graph of one program (one device, one worker or one server).
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// The model's name.
    pub name: String,
    g: StableDiGraph<Node, Edge>,
}

/// A graph edit that names a node or value that is not there.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// The op rejected its input types.
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// A value that does not exist.
    #[error("{0} does not exist")]
    NoValue(ValueId),
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            g: StableDiGraph::default(),
        }
    }

    /// Adds a node, inferring its result types; fails when the inputs do not fit the op.
    pub fn add(&mut self, op: Op, inputs: Vec<ValueId>) -> Result<NodeId, GraphError> {
        let types = inputs
            .iter()
            .map(|&v| self.try_value_type(v).ok_or(GraphError::NoValue(v)))
            .collect::<Result<Vec<_>, _>>()?;
        let outputs = infer(&op, &types)?;
        Ok(self.add_typed(op, inputs, outputs))
    }

    /// Adds a node whose result types are given (the parser; checked by the verifier).
    /// Inputs must exist.
    pub fn add_typed(&mut self, op: Op, inputs: Vec<ValueId>, outputs: Vec<ValueType>) -> NodeId {
        let id = NodeId(
            self.g
                .add_node(Node {
                    op,
                    inputs: inputs.clone(),
                    outputs,
                })
                .index() as u32,
        );
        for (slot, v) in inputs.iter().enumerate() {
            self.g
                .add_edge(v.node.index(), id.index(), Edge { slot: slot as u16 });
        }
        id
    }

    /// The node `id`. Panics on a removed id: ids come from this graph.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id.index()]
    }

    /// The node `id`, if it exists.
    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.g.node_weight(id.index())
    }

    /// The op of node `id`.
    pub fn op(&self, id: NodeId) -> &Op {
        &self.node(id).op
    }

    /// Whether `id` is a node of this graph.
    pub fn contains(&self, id: NodeId) -> bool {
        self.g.contains_node(id.index())
    }

    /// The type of value `v`, if it exists.
    pub fn try_value_type(&self, v: ValueId) -> Option<&ValueType> {
        self.g
            .node_weight(v.node.index())?
            .outputs
            .get(v.port as usize)
    }

    /// The type of value `v`. Panics on a value not in the graph.
    pub fn value_type(&self, v: ValueId) -> &ValueType {
        &self.node(v.node).outputs[v.port as usize]
    }

    /// The dense type of value `v`; panics if it is `IndexedSlices`.
    pub fn tensor_type(&self, v: ValueId) -> &TensorType {
        self.value_type(v).dense_type()
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.g.node_count()
    }

    /// Node ids in index order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        count_work(self.g.node_count());
        self.g
            .node_indices()
            .map(|i| NodeId(i.index() as u32))
            .collect()
    }

    /// Nodes in a deterministic topological order: among ready nodes the lowest id first.
    pub fn topo_order(&self) -> Vec<NodeId> {
        count_work(self.g.node_count() + self.g.edge_count());
        // Indexed by node index (removed slots stay 0 and are never reached).
        let mut indegree = vec![0u32; petgraph::visit::NodeIndexable::node_bound(&self.g)];
        let mut ready = BinaryHeap::new();
        for i in self.g.node_indices() {
            let d = self.g.edges_directed(i, Direction::Incoming).count();
            if d == 0 {
                ready.push(Reverse(i.index() as u32));
            }
            indegree[i.index()] = d as u32;
        }
        let mut order = Vec::with_capacity(self.g.node_count());
        while let Some(Reverse(i)) = ready.pop() {
            order.push(NodeId(i));
            for e in self
                .g
                .edges_directed(NodeIndex::new(i as usize), Direction::Outgoing)
            {
                let t = e.target().index();
                indegree[t] -= 1;
                if indegree[t] == 0 {
                    ready.push(Reverse(t as u32));
                }
            }
        }
        order
    }

    /// Whether the graph has a cycle (the verifier reports it).
    pub fn has_cycle(&self) -> bool {
        self.topo_order().len() != self.g.node_count()
    }

    /// The nodes reading value `v`, with the input slot, in node order.
    pub fn users(&self, v: ValueId) -> Vec<(NodeId, usize)> {
        let mut out: Vec<(NodeId, usize)> = self
            .g
            .edges_directed(v.node.index(), Direction::Outgoing)
            .filter_map(|e| {
                let user = NodeId(e.target().index() as u32);
                let slot = e.weight().slot as usize;
                (self.node(user).inputs[slot] == v).then_some((user, slot))
            })
            .collect();
        count_work(out.len());
        out.sort();
        out.dedup();
        out
    }

    /// The nodes reading any output of `id`.
    pub fn user_nodes(&self, id: NodeId) -> Vec<NodeId> {
        let mut out: Vec<NodeId> = self
            .g
            .neighbors_directed(id.index(), Direction::Outgoing)
            .map(|i| NodeId(i.index() as u32))
            .collect();
        count_work(out.len());
        out.sort();
        out.dedup();
        out
    }

    /// Points input `slot` of `node` at `v`.
    pub fn set_input(&mut self, node: NodeId, slot: usize, v: ValueId) {
        let old = self.node(node).inputs[slot];
        let edge = self
            .g
            .edges_directed(node.index(), Direction::Incoming)
            .find(|e| e.weight().slot as usize == slot && e.source() == old.node.index())
            .map(|e| e.id());
        if let Some(e) = edge {
            self.g.remove_edge(e);
        }
        self.g
            .add_edge(v.node.index(), node.index(), Edge { slot: slot as u16 });
        self.g[node.index()].inputs[slot] = v;
    }

    /// Makes every reader of `old` read `new` instead.
    pub fn replace_all_uses(&mut self, old: ValueId, new: ValueId) {
        for (user, slot) in self.users(old) {
            self.set_input(user, slot, new);
        }
    }

    /// Removes node `id` with its edges. Readers of it are left dangling for the
    /// caller to repair; the verifier reports any that are not.
    pub fn remove(&mut self, id: NodeId) -> Option<Node> {
        self.g.remove_node(id.index())
    }

    /// Replaces the op of `id`, keeping its inputs; the result types are re-inferred.
    pub fn replace_op(&mut self, id: NodeId, op: Op) -> Result<(), GraphError> {
        let types: Vec<ValueType> = self
            .node(id)
            .inputs
            .iter()
            .map(|&v| self.value_type(v).clone())
            .collect();
        let refs: Vec<&ValueType> = types.iter().collect();
        let outputs = infer(&op, &refs)?;
        let n = &mut self.g[id.index()];
        n.op = op;
        n.outputs = outputs;
        Ok(())
    }

    /// Removes nodes whose results nothing reads and that are not sinks; returns how many.
    /// Removes in rounds, each in node order: the dead nodes, then those that only
    /// they read, and so on. A round looks only at the producers of what the round
    /// before removed, so a dead chain costs its length, not its length times the graph.
    pub fn remove_dead(&mut self) -> usize {
        let removable = |g: &Graph, id: NodeId| {
            let n = g.node(id);
            !n.op.is_sink()
                && !matches!(n.op, Op::Param { .. } | Op::Input { .. })
                && g.g
                    .neighbors_directed(id.index(), Direction::Outgoing)
                    .next()
                    .is_none()
        };
        let mut dead: Vec<NodeId> = self
            .node_ids()
            .into_iter()
            .filter(|&id| removable(self, id))
            .collect();
        let mut removed = 0;
        while !dead.is_empty() {
            let mut producers = Vec::new();
            for id in dead {
                if let Some(n) = self.remove(id) {
                    producers.extend(n.inputs.iter().map(|v| v.node));
                    removed += 1;
                }
            }
            producers.sort();
            producers.dedup();
            dead = producers
                .into_iter()
                .filter(|&id| self.contains(id) && removable(self, id))
                .collect();
        }
        removed
    }

    /// Trainable variables in node order: `(node, name, type)`.
    pub fn params(&self) -> Vec<(NodeId, &str, &TensorType)> {
        self.topo_order()
            .into_iter()
            .filter_map(|id| match self.op(id) {
                Op::Param { name, ty, .. } => Some((id, name.as_str(), ty)),
                _ => None,
            })
            .collect()
    }

    /// The names of the variables marked `frozen` (never trained), sorted.
    pub fn frozen_params(&self) -> std::collections::BTreeSet<String> {
        self.node_ids()
            .into_iter()
            .filter_map(|id| match self.op(id) {
                Op::Param {
                    name, frozen: true, ..
                } => Some(name.clone()),
                _ => None,
            })
            .collect()
    }

    /// Model inputs in node order: `(node, name, type)`; the data's, not the loss
    /// scale ([`LOSS_SCALE`]) the runtime feeds itself.
    pub fn inputs(&self) -> Vec<(NodeId, &str, &TensorType)> {
        self.topo_order()
            .into_iter()
            .filter_map(|id| match self.op(id) {
                Op::Input { name, ty } if name != LOSS_SCALE => Some((id, name.as_str(), ty)),
                _ => None,
            })
            .collect()
    }

    /// Whether the backward pass starts from the runtime's loss scale (fp16).
    pub fn scales_loss(&self) -> bool {
        self.node_ids()
            .into_iter()
            .any(|id| matches!(self.op(id), Op::Input { name, .. } if name == LOSS_SCALE))
    }

    /// The value marked by the `loss` sink, if any.
    pub fn loss(&self) -> Option<ValueId> {
        self.node_ids()
            .into_iter()
            .find(|&id| matches!(self.op(id), Op::Loss))
            .map(|id| self.node(id).inputs[0])
    }

    /// The gradient values marked by `param_grad` sinks: `(param name, value)`.
    pub fn param_grads(&self) -> Vec<(String, ValueId)> {
        self.topo_order()
            .into_iter()
            .filter_map(|id| match self.op(id) {
                Op::ParamGrad { param } => Some((param.clone(), self.node(id).inputs[0])),
                _ => None,
            })
            .collect()
    }

    /// The values marked by `output` sinks: `(name, value)`.
    pub fn outputs(&self) -> Vec<(String, ValueId)> {
        self.topo_order()
            .into_iter()
            .filter_map(|id| match self.op(id) {
                Op::Output { name } => Some((name.clone(), self.node(id).inputs[0])),
                _ => None,
            })
            .collect()
    }

    /// A canonical form for comparison: nodes in topological order, inputs renumbered.
    fn canonical(&self) -> Vec<CanonicalNode> {
        let order = self.topo_order();
        let pos: std::collections::HashMap<NodeId, usize> =
            order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        order
            .iter()
            .map(|&id| {
                let n = self.node(id);
                let ins = n
                    .inputs
                    .iter()
                    .map(|v| (pos.get(&v.node).copied().unwrap_or(usize::MAX), v.port))
                    .collect();
                (n.op.clone(), ins, n.outputs.clone())
            })
            .collect()
    }
}

/// Two graphs are equal when they have the same name and the same nodes in the same
/// topological order, whatever their node ids.
impl PartialEq for Graph {
    fn eq(&self, other: &Graph) -> bool {
        self.name == other.name && self.canonical() == other.canonical()
    }
}
