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
//! in O(1) (`Pcg64::advance`) however far into the stream it is, and each worker of a
//! global stream (the one device's batches, split by rows) skip the other workers'
//! rows instead of generating them. The exact bit streams
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
        let bad = |m: String| Err(super::setting(spec, m));
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
        self.generate_rows(rng, n, 0..n)
    }

    /// Samples `rows` of the next `n` from `rng`, as [`Generator::generate`] would give
    /// them, leaving `rng` where `generate` would (past all `n`). The other samples'
    /// outputs are skipped (`Pcg64::advance`), not generated: each worker of a global
    /// stream draws only its own rows of the step's batch.
    pub(crate) fn generate_rows(
        &self,
        rng: &mut Pcg64,
        n: usize,
        rows: std::ops::Range<usize>,
    ) -> Vec<ColData> {
        let (first, count) = (rows.start, rows.len());
        debug_assert!(rows.end <= n, "rows {rows:?} of {n} samples");
        let skip = |rng: &mut Pcg64, draws: usize| rng.advance(draws as u128);
        match self {
            Generator::Zipf {
                cdf,
                context,
                classes,
            } => {
                let last = cdf.len() - 1;
                skip(rng, first * context);
                let ids: Vec<i32> = (0..count * context)
                    .map(|_| {
                        let u: f64 = rng.random();
                        cdf.partition_point(|&c| c <= u).min(last) as i32
                    })
                    .collect();
                skip(rng, (n - rows.end) * context);
                let labels: Vec<i32> = ids
                    .chunks(*context)
                    .map(|row| row[context - 1] % *classes as i32)
                    .collect();
                vec![ColData::I32(ids), ColData::I32(labels)]
            }
            Generator::Gaussian { features, classes } => {
                // The normals come in pairs of two outputs each, pair k giving elements
                // 2k and 2k+1 of the row-major `[n, features]`, and n f features
                // rounded up to pairs.
                let (from, to) = (first * features, rows.end * features);
                let (pair0, pair1) = (from / 2, to.div_ceil(2));
                skip(rng, 2 * pair0);
                let mut x = Vec::with_capacity(2 * (pair1 - pair0));
                for _ in pair0..pair1 {
                    let (a, b) = box_muller(rng);
                    x.push(a);
                    x.push(b);
                }
                skip(rng, 2 * ((n * features).div_ceil(2) - pair1));
                let x = x[from - 2 * pair0..to - 2 * pair0].to_vec();
                // Then one output a label.
                skip(rng, first);
                let labels: Vec<i32> = (0..count)
                    .map(|_| ((u128::from(rng.next_u64()) * *classes as u128) >> 64) as i32)
                    .collect();
                skip(rng, n - rows.end);
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// Every range of rows skipped to is the rows the whole batch has, and the stream
    /// goes on where the whole batch leaves it: with an odd width (rows that split a
    /// pair of normals) and an even one, and for token ids.
    #[test]
    fn a_workers_rows_are_the_whole_batchs_and_the_stream_goes_on_alike() {
        let generators = [
            Generator::Gaussian {
                features: 7,
                classes: 3,
            },
            Generator::Gaussian {
                features: 4,
                classes: 10,
            },
            Generator::Zipf {
                cdf: Arc::new(zipf_cdf(50, 1.1)),
                context: 3,
                classes: 5,
            },
        ];
        let n = 5;
        for g in &generators {
            let mut whole_rng = Pcg64::seed_from_u64(11);
            let whole = g.generate(&mut whole_rng, n);
            let after = whole_rng.next_u64();
            for first in 0..=n {
                for end in first..=n {
                    let mut rng = Pcg64::seed_from_u64(11);
                    let part = g.generate_rows(&mut rng, n, first..end);
                    for (c, (p, w)) in part.iter().zip(&whole).enumerate() {
                        let want = w.rows(g.pers()[c], first, end - first);
                        let same = match (p, &want) {
                            (ColData::F32(a), ColData::F32(b)) => a
                                .iter()
                                .map(|x| x.to_bits())
                                .eq(b.iter().map(|x| x.to_bits())),
                            (ColData::I32(a), ColData::I32(b)) => a == b,
                            _ => false,
                        };
                        assert!(same, "{g:?}: column {c} of rows {first}..{end}");
                    }
                    assert_eq!(rng.next_u64(), after, "{g:?}: after rows {first}..{end}");
                }
            }
        }
    }
}
