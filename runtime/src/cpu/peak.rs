//! This CPU's peak, measured: the best rate of the matrix product the CPU kernels use
//! (ndarray's `general_mat_mul`, matrixmultiply threaded as in a step), on square
//! products large enough to reach it. A datasheet figure would say nothing about a
//! virtual machine's share of a host, so this is what model FLOPs utilisation on the
//! CPU is measured against. Once per process and element type, on first use (about
//! 80 ms).

use crate::core::peak::{cpu_peak, DevicePeak, Products};
use distc_ir::DType;
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, LinalgScalar};
use std::sync::OnceLock;
use std::time::Instant;

/// Side of the measured square products: large enough for matrixmultiply's blocking
/// to reach its rate, small enough to measure in milliseconds.
const SIDE: usize = 512;
/// Products are timed until this long has passed (and at least [`MIN_TRIES`]); the
/// fastest counts, since others on the machine can only slow one down. A handful of
/// tries gave peaks from 100 to 169 GFLOP/s on this 2-core virtual machine: its first
/// products are slow, and a share of the host's time is another tenant's.
const BUDGET: std::time::Duration = std::time::Duration::from_millis(80);
const MIN_TRIES: usize = 4;

fn best_rate<A: LinalgScalar + From<u8>>() -> f64 {
    let a = Array2::<A>::from_shape_fn((SIDE, SIDE), |(i, j)| A::from(((i * 7 + j) % 13) as u8));
    let b = a.t().to_owned();
    let mut c = Array2::<A>::zeros((SIDE, SIDE));
    // The first product pages the buffers in and starts matrixmultiply's threads.
    general_mat_mul(A::one(), &a, &b, A::zero(), &mut c);
    let flops = 2.0 * (SIDE * SIDE * SIDE) as f64;
    let (start, mut best, mut tries) = (Instant::now(), 0.0f64, 0);
    while tries < MIN_TRIES || start.elapsed() < BUDGET {
        let t = Instant::now();
        general_mat_mul(A::one(), &a, &b, A::zero(), &mut c);
        best = best.max(flops / t.elapsed().as_secs_f64().max(1e-9));
        tries += 1;
    }
    best
}

/// How much of the machine a product measured here had: matrixmultiply's threads
/// (`MATMUL_NUM_THREADS`, which `distc bench` sets to a worker's share of the cores)
/// against the cores. 1 when unset: matrixmultiply then takes every physical core.
fn share_of_cores() -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    std::env::var("MATMUL_NUM_THREADS")
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
        .filter(|&t| t > 0 && t < cores)
        .map_or(1.0, |t| t as f64 / cores as f64)
}

/// This CPU's measured peak for products of `dtype` (16-bit products compute in f32
/// on the CPU), the whole machine's: a rate measured on fewer threads than cores is
/// scaled up to all of them.
pub fn peak(dtype: DType) -> DevicePeak {
    static F32: OnceLock<f64> = OnceLock::new();
    static F64: OnceLock<f64> = OnceLock::new();
    let (rate, products) = match dtype {
        DType::F64 => (*F64.get_or_init(best_rate::<f64>), Products::F64),
        _ => (*F32.get_or_init(best_rate::<f32>), Products::F32),
    };
    cpu_peak(rate / share_of_cores(), products)
}
