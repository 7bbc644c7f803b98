//! Gradient accumulation (`--accumulate K`): K micro-batches per step, one update and
//! one round of communication per step, as DDP's `no_sync` gives.
//!
//! Puts an `accumulate{micro=K}` between every gradient and its sink. The executor
//! runs the first K-1 micro-batches of a step only as far as the loss and the
//! accumulators (whatever follows an `accumulate`, collectives, pushes and the update
//! included, waits for the last one), so a step holds one micro-batch's activations.
//! The last micro-batch's `accumulate` outputs the mean of the K gradients, which the
//! strategy passes then communicate as usual. Runs before the strategy passes (they see
//! the accumulated gradient as the gradient); a no-op for K = 1. Before/after:
//! ```text
//! param_grad{param="w1"} %7          %8 = accumulate{micro=4} %7
//!                              =>    param_grad{param="w1"} %8
//! ```

use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{Graph, Op};

/// The accumulation rewrite.
pub struct Accumulate;

impl Pass for Accumulate {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let micro = cx.strategy.accumulate.max(1);
        let mut inserted = 0;
        if micro > 1 {
            for id in g.node_ids() {
                if !matches!(g.op(id), Op::ParamGrad { .. }) {
                    continue;
                }
                let grad = g.node(id).inputs[0];
                let acc = g.add(Op::Accumulate { micro }, vec![grad])?;
                g.set_input(id, 0, acc.into());
                inserted += 1;
            }
        }
        Ok(PassStats::default()
            .count("micro_batches", micro)
            .count("accumulators", inserted))
    }
}
