//! A 16-bit gradient wire (`--grad-wire bf16|fp16`): every dense gradient all-reduce
//! (each fused bucket), and ZeRO's reduce-scatters of gradients, send 16-bit values
//! instead of f32, halving the bytes on the wire.
//! The bucket is cast down before the all-reduce and its result cast back to f32, so the
//! optimizer still gets f32 gradients; the runtime divides each worker's contribution by
//! N before the sum (an fp16 sum of many workers' gradients would overflow otherwise)
//! and accumulates what it receives in f32. Runs after gradient fusion, on the buckets.
//! Before/after:
//! ```text
//! %9 = all_reduce{reduce="mean"} %8 : f32[1000]    =>   %9 = cast{to="bf16"} %8 : bf16[1000]
//!                                                       %10 = all_reduce{reduce="mean"} %9 : bf16[1000]
//!                                                       %11 = cast{to="f32"} %10 : f32[1000]
//! ```

use crate::mixed_precision::half_type;
use crate::placement::{Kind, Mechanism};
use crate::{Pass, PassCx, PassError, PassStats};
use distc_ir::{DType, Graph, Op, ValueType};

/// The pass: runs after fusion when `--grad-wire` is bf16 or fp16.
pub struct GradWire;

impl Pass for GradWire {
    fn run(&self, g: &mut Graph, cx: &mut PassCx) -> Result<PassStats, PassError> {
        let Some(half) = half_type(cx.strategy.grad_wire) else {
            return Ok(PassStats::default().with_note("fp32 wire"));
        };
        let mut wired = 0;
        for id in g.topo_order() {
            if !matches!(g.op(id), Op::AllReduce { .. } | Op::ReduceScatter { .. }) {
                continue;
            }
            // Gradients on their way to the optimizer travel in 16 bits; the batch
            // statistics a synchronised batch norm all-reduces (and their gradients,
            // read again by the backward pass) keep f32.
            let to_update = g.user_nodes(id).iter().all(|&u| {
                matches!(
                    g.op(u),
                    Op::ParamGrad { .. } | Op::Unpack { .. } | Op::Sparsify | Op::TakeChunk { .. }
                )
            });
            if !to_update {
                continue;
            }
            let x = g.node(id).inputs[0];
            match g.value_type(x) {
                ValueType::Tensor(t) if t.dtype == DType::F32 => {}
                _ => continue,
            }
            let users = g.users(id.into());
            let down = g.add(Op::Cast { to: half }, vec![x])?;
            g.set_input(id, 0, down.into());
            let op = g.op(id).clone();
            g.replace_op(id, op)?;
            let up = g.add(Op::Cast { to: DType::F32 }, vec![id.into()])?;
            for (u, slot) in users {
                g.set_input(u, slot, up.into());
            }
            wired += 1;
        }
        // What each all-reduced dense gradient sends per step halves with its bytes.
        if let Some(d) = cx.dist.as_mut() {
            let dense_too = cx.strategy.sparse_as_dense;
            for v in &mut d.vars {
                if v.placement == Mechanism::Allreduce && (v.kind == Kind::Dense || dense_too) {
                    // ZeRO's gathers of the variable's chunks stay f32.
                    let gradient = v.predicted_bytes_per_step - v.gather_bytes_per_step;
                    v.predicted_bytes_per_step = gradient * half.size() as f64
                        / DType::F32.size() as f64
                        + v.gather_bytes_per_step;
                }
            }
            for b in &mut d.buckets {
                b.bytes = b.bytes * half.size() / DType::F32.size();
            }
        }
        Ok(PassStats::default()
            .count("all_reduces", wired)
            .with_note(format!("{half} on the wire")))
    }
}
