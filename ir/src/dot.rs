//! Graphviz export: one box per node labelled with its op and result type.

use crate::graph::Graph;
use crate::op::Op;
use crate::print::{numbering, value_name};
use std::fmt::Write;

/// The graph in Graphviz DOT. Gradient (backward) nodes are shaded; sparse values are
/// drawn as dashed edges.
pub fn to_dot(g: &Graph) -> String {
    let num = numbering(g);
    let mut s = format!(
        "digraph \"{}\" {{\n  node [shape=box, fontname=monospace];\n",
        g.name
    );
    let order = g.topo_order();
    let key = |id: crate::NodeId| format!("n{}", id.0);
    for &id in &order {
        let node = g.node(id);
        let name = if node.op.is_sink() {
            String::new()
        } else {
            format!("{} = ", value_name(&num, id.into()))
        };
        let ty: Vec<String> = node.outputs.iter().map(|t| t.to_string()).collect();
        let label = format!("{name}{}\\n{}", node.op, ty.join(", ")).replace('"', "\\\"");
        let style = match &node.op {
            Op::Param { .. } => ", style=filled, fillcolor=lightyellow",
            Op::Input { .. } => ", style=filled, fillcolor=lightblue",
            op if op.is_sink() => ", shape=ellipse",
            op if op.mnemonic().ends_with("_grad") => ", style=filled, fillcolor=mistyrose",
            _ => "",
        };
        let _ = writeln!(s, "  {} [label=\"{label}\"{style}];", key(id));
    }
    for &id in &order {
        for v in &g.node(id).inputs {
            let dashed = if g.try_value_type(*v).is_some_and(|t| t.is_sparse()) {
                " [style=dashed]"
            } else {
                ""
            };
            let _ = writeln!(s, "  {} -> {}{dashed};", key(v.node), key(id));
        }
    }
    s.push_str("}\n");
    s
}
