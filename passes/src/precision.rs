//! Promotes every f32 tensor of a graph to f64.
//!
//! Gradient checks run the promoted graph so that central finite differences are
//! accurate to many digits; nothing in training uses it. Every source type and every
//! type-carrying attribute changes; the result types are re-inferred. Before/after:
//! ```text
//! %0 = param{name="w", init=glorot} : f32[3,2]   =>   ... : f64[3,2]
//! ```

use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{DType, Graph, Op, TensorType};

/// f32 to f64 promotion.
pub struct PromoteF64;

fn promote(t: &TensorType) -> TensorType {
    match t.dtype {
        DType::F32 => TensorType::new(DType::F64, t.shape.clone()),
        _ => t.clone(),
    }
}

impl Pass for PromoteF64 {
    fn run(&self, g: &mut Graph, _cx: &mut PassCx) -> Result<PassStats, PassError> {
        let mut changed = 0;
        for id in g.topo_order() {
            let op = match g.op(id).clone() {
                Op::Input { name, ty } => Op::Input {
                    ty: promote(&ty),
                    name,
                },
                Op::Param {
                    name,
                    ty,
                    init,
                    frozen,
                } => Op::Param {
                    ty: promote(&ty),
                    name,
                    init,
                    frozen,
                },
                Op::Constant { value, ty } => Op::Constant {
                    ty: promote(&ty),
                    value,
                },
                Op::EmbeddingGrad { table } => Op::EmbeddingGrad {
                    table: promote(&table),
                },
                other => other,
            };
            if &op != g.op(id) {
                changed += 1;
            }
            // Re-inferring in topological order carries the new dtype through every node.
            g.replace_op(id, op)?;
        }
        Ok(PassStats::default().count("promoted", changed))
    }
}
