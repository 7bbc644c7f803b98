//! Removes nodes whose results nothing reads (sinks, inputs and variables stay).
//!
//! Requires nothing; preserves every sink's value. Before/after:
//! ```text
//! %2 = exp %0 : f32[4]      // read by nobody
//! %3 = relu %0 : f32[4]     =>   %2 = relu %0 : f32[4]
//! output{name="y"} %3             output{name="y"} %2
//! ```

use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::Graph;

/// Dead-code elimination.
pub struct DeadCode;

impl Pass for DeadCode {
    fn run(&self, g: &mut Graph, _cx: &mut PassCx) -> Result<PassStats, PassError> {
        Ok(PassStats::default().count("removed", g.remove_dead()))
    }
}
