//! Initial values of trainable variables, from the plan's [`Init`] of each `Param`.
//!
//! Deterministic per `(seed, variable name)`: the name is hashed (FNV-1a) into the
//! seed of a private `Pcg64`, so adding or renaming one variable leaves the others'
//! initial values unchanged, and every worker computes the same values without
//! communicating. Values are drawn in f64 and rounded to the variable's dtype, so an
//! f32 and an f64 variable of the same name and seed start (almost) equal.
//!
//! Fans (see [`fans`]): rank 2 `[in, out]` (layout of `y = x @ W`): `dims[0]`,
//! `dims[1]`; rank 4 conv filters `[O, C, KH, KW]`: `C*KH*KW`, `O*KH*KW` (generally,
//! rank >= 3: `dims[1]*r`, `dims[0]*r` with `r` the product of `dims[2..]`); rank 1:
//! `dims[0]` both; scalars: 1.

use crate::core::value::Tensor;
use distc_ir::{DType, Init, TensorType};
use ndarray::{ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use rand_pcg::Pcg64;

/// `(fan_in, fan_out)` of a variable of dimensions `dims` (see the module doc).
pub fn fans(dims: &[usize]) -> (usize, usize) {
    match dims.len() {
        0 => (1, 1),
        1 => (dims[0], dims[0]),
        2 => (dims[0], dims[1]),
        _ => {
            let r: usize = dims[2..].iter().product();
            (dims[1] * r, dims[0] * r)
        }
    }
}

/// The seed of variable `name`'s generator under run seed `seed`.
pub fn param_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let mut z = seed ^ h.rotate_left(17) ^ 0x1d15_7c00_0000_0000;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The initial value of variable `name` of type `ty` (f32, f64; i32 values are
/// rounded), deterministic per `(seed, name)`.
///
/// Glorot: `U(-sqrt(6/(fan_in+fan_out)), +)`; He: `N(0, sqrt(2/fan_in))`; uniform on
/// `[lo, hi)`; normal `N(mean, std)`.
pub fn init_param(name: &str, ty: &TensorType, init: &Init, seed: u64) -> Tensor {
    let rows = ty.dims().first().copied().unwrap_or(1);
    init_rows(name, ty, init, seed, 0, rows)
}

/// Rows `start..end` of [`init_param`]'s value (the whole value for a scalar), equal to
/// slicing it, without ever holding the other rows: a parameter server initialises
/// its shard alone.
pub fn init_rows(
    name: &str,
    ty: &TensorType,
    init: &Init,
    seed: u64,
    start: usize,
    end: usize,
) -> Tensor {
    let dims = ty.dims();
    let mut rng = Pcg64::seed_from_u64(param_seed(seed, name));
    let (fan_in, fan_out) = fans(dims);
    let (fan_in, fan_out) = (fan_in.max(1) as f64, fan_out.max(1) as f64);
    let mut draw: Box<dyn FnMut() -> f64> = match *init {
        Init::Zeros => Box::new(|| 0.0),
        Init::Ones => Box::new(|| 1.0),
        Init::Normal { mean, std } => Box::new(move || {
            let z: f64 = StandardNormal.sample(&mut rng);
            mean + std * z
        }),
        Init::Uniform { lo, hi } => Box::new(move || lo + (hi - lo) * rng.random::<f64>()),
        Init::Glorot => {
            let a = (6.0 / (fan_in + fan_out)).sqrt();
            Box::new(move || -a + 2.0 * a * rng.random::<f64>())
        }
        Init::He => {
            let std = (2.0 / fan_in).sqrt();
            Box::new(move || {
                let z: f64 = StandardNormal.sample(&mut rng);
                std * z
            })
        }
    };
    let (shape, skip) = match dims.split_first() {
        None => (IxDyn(dims), 0),
        Some((_, rest)) => {
            let row: usize = rest.iter().product();
            let mut d = dims.to_vec();
            d[0] = end.saturating_sub(start);
            (IxDyn(&d), start * row)
        }
    };
    // Row-major order: the rows before `start` are drawn and dropped.
    for _ in 0..skip {
        draw();
    }
    match ty.dtype {
        DType::F32 => Tensor::F32(ArrayD::from_shape_simple_fn(shape, || draw() as f32)),
        DType::F64 => Tensor::F64(ArrayD::from_shape_simple_fn(shape, draw)),
        DType::I32 => Tensor::I32(ArrayD::from_shape_simple_fn(shape, || {
            draw().round() as i32
        })),
        DType::BF16 => Tensor::BF16(ArrayD::from_shape_simple_fn(shape, || {
            half::bf16::from_f64(draw())
        })),
        DType::F16 => Tensor::F16(ArrayD::from_shape_simple_fn(shape, || {
            half::f16::from_f64(draw())
        })),
    }
}
