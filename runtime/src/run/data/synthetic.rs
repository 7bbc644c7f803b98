//! The synthetic benchmark sources of WORKLOADS.md, generated from a seeded `Pcg64`.
//!
//! * `zipf_tokens` (W1): `P(id = k) ∝ (k+1)^-s` over `0..vocab`, with
//!   `cdf = cumsum(p) / sum(p)` in f64; every id draws one uniform f64 `u` in `[0,1)`
//!   (row-major, sample after sample) and is `searchsorted(cdf, u, side='right')`,
//!   clamped to `vocab-1`. `label = ids[:, context-1] mod classes`.
//! * `gaussian_classes` (W2): per batch, first `x ~ N(0,1)` f32 `[n, features]`
//!   row-major, then `n` labels uniform in `0..classes`. The normals come in pairs
//!   from two uniforms each (Box-Muller) and a label from one (multiply-shift), so a
//!   batch consumes a number of generator outputs fixed by its size, as a Zipf batch
//!   does (one per id).
//!
//! A fixed consumption per batch is what lets a resumed run skip to its data position
//! in O(1) (`Pcg64::advance`) however far into the stream it is. The exact bit streams
//! differ from numpy's; the distributions are the specified ones.

use super::ColData;
use crate::core::config::DataSpec;
use crate::core::error::{Result, RuntimeError};
use rand::{Rng, RngCore};
use rand_pcg::Pcg64;
use std::collections::HashMap;
use std::sync::Arc;

/// Generates samples of one synthetic source.
#[derive(Clone, Debug)]
pub(crate) enum Generator {
    Zipf {
        cdf: Arc<Vec<f64>>,
        context: usize,
        classes: usize,
    },
    Gaussian {
        features: usize,
        classes: usize,
    },
}

impl Generator {
    pub(crate) fn new(spec: &DataSpec) -> Result<Generator> {
        let bad = |m: String| {
            Err(RuntimeError::Config(format!(
                "data source `{}`: {m}",
                spec.name()
            )))
        };
        spec.check().map_err(RuntimeError::Config)?;
        match *spec {
            DataSpec::ZipfTokens {
                vocab,
                context,
                classes,
                s,
            } => Ok(Generator::Zipf {
                cdf: Arc::new(zipf_cdf(vocab, s)),
                context,
                classes,
            }),
            DataSpec::GaussianClasses { features, classes } => {
                Ok(Generator::Gaussian { features, classes })
            }
            _ => bad("not a synthetic source".into()),
        }
    }

    /// Values per sample of each field, in `DataSpec::fields` order.
    pub(crate) fn pers(&self) -> [usize; 2] {
        match self {
            Generator::Zipf { context, .. } => [*context, 1],
            Generator::Gaussian { features, .. } => [*features, 1],
        }
    }

    pub(crate) fn id_bounds(&self) -> HashMap<String, usize> {
        match self {
            Generator::Zipf { cdf, classes, .. } => HashMap::from([
                ("ids".to_string(), cdf.len()),
                ("label".to_string(), *classes),
            ]),
            Generator::Gaussian { classes, .. } => HashMap::from([("label".to_string(), *classes)]),
        }
    }

    /// The next `n` samples from `rng`: all fields, in `DataSpec::fields` order.
    pub(crate) fn generate(&self, rng: &mut Pcg64, n: usize) -> Vec<ColData> {
        match self {
            Generator::Zipf {
                cdf,
                context,
                classes,
            } => {
                let last = cdf.len() - 1;
                let ids: Vec<i32> = (0..n * context)
                    .map(|_| {
                        let u: f64 = rng.random();
                        cdf.partition_point(|&c| c <= u).min(last) as i32
                    })
                    .collect();
                let labels: Vec<i32> = ids
                    .chunks(*context)
                    .map(|row| row[context - 1] % *classes as i32)
                    .collect();
                vec![ColData::I32(ids), ColData::I32(labels)]
            }
            Generator::Gaussian { features, classes } => {
                let mut x = Vec::with_capacity(n * features + 1);
                while x.len() < n * features {
                    let (a, b) = box_muller(rng);
                    x.push(a);
                    x.push(b);
                }
                x.truncate(n * features);
                let labels: Vec<i32> = (0..n)
                    .map(|_| ((u128::from(rng.next_u64()) * *classes as u128) >> 64) as i32)
                    .collect();
                vec![ColData::F32(x), ColData::I32(labels)]
            }
        }
    }
}

impl Generator {
    /// Generator outputs (`u64`s) that [`Generator::generate`] of `n` samples consumes.
    pub(crate) fn draws(&self, n: usize) -> u128 {
        let n = n as u128;
        match self {
            Generator::Zipf { context, .. } => n * *context as u128,
            Generator::Gaussian { features, .. } => (n * *features as u128).div_ceil(2) * 2 + n,
        }
    }
}

/// Two independent standard normals from two uniforms (Box-Muller).
fn box_muller(rng: &mut Pcg64) -> (f32, f32) {
    // (0, 1]: the logarithm of 0 is not finite.
    let u1 = ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f64::consts::TAU * u2).sin_cos();
    ((r * c) as f32, (r * s) as f32)
}

/// The truncated Zipf cdf: `cumsum(p) / sum(p)` with `p_k = (k+1)^-s`, in f64.
pub fn zipf_cdf(vocab: usize, s: f64) -> Vec<f64> {
    let mut acc = 0.0f64;
    let mut cdf: Vec<f64> = (0..vocab)
        .map(|k| {
            acc += ((k + 1) as f64).powf(-s);
            acc
        })
        .collect();
    for c in &mut cdf {
        *c /= acc;
    }
    cdf
}
