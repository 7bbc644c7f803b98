//! The verifier: every invariant of a graph, all violations collected, each located.

use crate::graph::Graph;
use crate::op::Op;
use crate::print::{node_line, numbering};
use crate::shape::infer;
use crate::types::ValueType;
use std::collections::HashMap;
use thiserror::Error;

/// Everything wrong with a graph, one located message per violation.
#[derive(Clone, Debug, PartialEq, Error)]
#[error("{}", .errors.join("\n"))]
pub struct VerifyError {
    /// One message per violation, each naming the node as `%N (line)`.
    pub errors: Vec<String>,
}

/// Checks: inputs exist, result types agree with the shape rules, no cycle, one loss at
/// most, variable and input names unique, each gradient names one existing variable once.
pub fn verify(g: &Graph) -> Result<(), VerifyError> {
    let mut errors = Vec::new();
    let order = g.topo_order();
    if order.len() != g.node_count() {
        errors.push("the graph has a cycle".to_string());
        return Err(VerifyError { errors });
    }
    // The printing numbers only name nodes in messages: made at the first one.
    let num = std::cell::OnceCell::new();
    let mut params: HashMap<&str, usize> = HashMap::new();
    let mut inputs: HashMap<&str, usize> = HashMap::new();
    let mut grads: HashMap<&str, usize> = HashMap::new();
    let mut losses = 0;
    for id in order {
        let node = g.node(id);
        let here = || {
            format!(
                "{} ({})",
                id,
                node_line(g, num.get_or_init(|| numbering(g)), id)
            )
        };
        let mut types: Vec<&ValueType> = Vec::new();
        let mut dangling = false;
        for v in &node.inputs {
            match g.try_value_type(*v) {
                Some(t) => types.push(t),
                None => {
                    errors.push(format!("{}: input {v} does not exist", here()));
                    dangling = true;
                }
            }
        }
        if !dangling {
            match infer(&node.op, &types) {
                Ok(out) if out != node.outputs => errors.push(format!(
                    "{}: result types should be {}",
                    here(),
                    out.iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                Ok(_) => {}
                Err(e) => errors.push(format!("{}: {e}", here())),
            }
        }
        match &node.op {
            Op::Param { name, .. } => *params.entry(name).or_default() += 1,
            Op::Input { name, .. } => *inputs.entry(name).or_default() += 1,
            Op::ParamGrad { param } => *grads.entry(param).or_default() += 1,
            Op::Loss => losses += 1,
            _ => {}
        }
    }
    if losses > 1 {
        errors.push(format!("{losses} loss sinks; at most one is allowed"));
    }
    let mut dup = |what: &str, m: &HashMap<&str, usize>| {
        let mut names: Vec<_> = m.iter().filter(|(_, &c)| c > 1).map(|(n, _)| *n).collect();
        names.sort();
        for n in names {
            errors.push(format!("{what} `{n}` is defined more than once"));
        }
    };
    dup("variable", &params);
    dup("input", &inputs);
    dup("gradient of", &grads);
    let mut names: Vec<_> = grads.keys().filter(|n| !params.contains_key(*n)).collect();
    names.sort();
    for n in names {
        errors.push(format!("param_grad names `{n}`, which is not a variable"));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(VerifyError { errors })
    }
}
