//! The text IR printer. Values are renumbered densely in topological order, so a dump
//! depends only on the graph's structure, never on the ids passes happened to leave.
//!
//! ```text
//! graph mlp {
//!   %0 = input{name="x"} : f32[64,784]
//!   %1 = param{name="w1", init=glorot} : f32[784,128]
//!   %2 = matmul %0, %1 : f32[64,128]
//!   loss %9
//!   param_grad{param="w1"} %14
//! }
//! ```

use crate::graph::{Graph, NodeId, ValueId};
use std::collections::HashMap;
use std::fmt::Write;

/// Dense printing numbers of the nodes that have results, in topological order.
pub fn numbering(g: &Graph) -> HashMap<NodeId, usize> {
    let mut map = HashMap::new();
    for id in g.topo_order() {
        if !g.op(id).is_sink() {
            let n = map.len();
            map.insert(id, n);
        }
    }
    map
}

/// Spells value `v` with the dense numbering.
pub fn value_name(num: &HashMap<NodeId, usize>, v: ValueId) -> String {
    let n = num
        .get(&v.node)
        .map_or_else(|| format!("?{}", v.node.0), |n| n.to_string());
    if v.port == 0 {
        format!("%{n}")
    } else {
        format!("%{n}#{}", v.port)
    }
}

/// One node as a line of text IR (without indentation).
pub fn node_line(g: &Graph, num: &HashMap<NodeId, usize>, id: NodeId) -> String {
    let node = g.node(id);
    let mut s = String::new();
    if !node.op.is_sink() {
        let _ = write!(s, "{} = ", value_name(num, id.into()));
    }
    let _ = write!(s, "{}", node.op);
    for (i, v) in node.inputs.iter().enumerate() {
        s.push_str(if i == 0 { " " } else { ", " });
        s.push_str(&value_name(num, *v));
    }
    match node.outputs.as_slice() {
        [] => {}
        [t] => {
            let _ = write!(s, " : {t}");
        }
        ts => {
            s.push_str(" : (");
            for (i, t) in ts.iter().enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                let _ = write!(s, "{t}");
            }
            s.push(')');
        }
    }
    s
}

/// The whole graph as text IR.
pub fn print(g: &Graph) -> String {
    print_with_notes(g, &HashMap::new())
}

/// The whole graph as text IR, each node's line ending with a comment of what `notes`
/// say of its results (`// split(1)`), which the parser skips.
pub fn print_with_notes(g: &Graph, notes: &HashMap<ValueId, String>) -> String {
    let num = numbering(g);
    let mut s = format!("graph {} {{\n", g.name);
    for id in g.topo_order() {
        let _ = write!(s, "  {}", node_line(g, &num, id));
        let said: Vec<&str> = (0..g.node(id).outputs.len())
            .filter_map(|port| notes.get(&id.out(port as u16)).map(String::as_str))
            .collect();
        if !said.is_empty() {
            let _ = write!(s, "  // {}", said.join(", "));
        }
        s.push('\n');
    }
    s.push_str("}\n");
    s
}

impl std::fmt::Display for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&print(self))
    }
}
