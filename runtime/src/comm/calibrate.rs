//! Timing the real transport for `distc calibrate`: all-reduces of growing buffers
//! over a communicator, the median of several repetitions each, every repetition
//! started together (a barrier first) so a rank's time is the collective's, not its
//! wait for a late peer; then messages of the same sizes from rank 0 to rank 1 and
//! back, as a pipeline's stages send them (one at a time, point to point: a ring's
//! steps send on every link at once). The alpha-beta fit of these samples is the
//! compiler's (`distc_passes::placement::Link`); this module only measures.

use super::{in_process, Communicator};
use crate::core::error::{PeerKind, Result, RuntimeError};
use std::time::Instant;

/// One buffer size's timing.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// Bytes of the buffer all-reduced (f32 elements times 4).
    pub bytes: usize,
    /// Median seconds of one all-reduce, as rank 0 timed it.
    pub seconds: f64,
}

/// What a sweep measured, by buffer size (rank 0's times).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sweep {
    /// One all-reduce over every rank.
    pub all_reduce: Vec<Sample>,
    /// One message from rank 0 to rank 1: half the round trip.
    pub messages: Vec<Sample>,
}

/// Rank `comm.rank()`'s part of the sweep: for each size in `sizes` (bytes, rounded
/// down to whole f32s, at least one), one untimed all-reduce, then `reps` timed ones;
/// then the same for messages between ranks 0 and 1 (the others wait at a barrier).
/// Every rank must call it with the same arguments.
pub fn sweep(comm: &mut dyn Communicator, sizes: &[usize], reps: usize) -> Result<Sweep> {
    let all_reduce = sweep_all_reduce(comm, sizes, reps)?;
    let messages = sweep_messages(comm, sizes, reps)?;
    Ok(Sweep {
        all_reduce,
        messages,
    })
}

fn sweep_messages(
    comm: &mut dyn Communicator,
    sizes: &[usize],
    reps: usize,
) -> Result<Vec<Sample>> {
    let rank = comm.rank();
    let mut out = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let bytes = (bytes / 4).max(1) * 4;
        comm.set_label(&format!("calibration message of {bytes} bytes"));
        let mut times = Vec::with_capacity(reps.max(1));
        // The first round trip is not timed (connections, first touches).
        for rep in 0..=reps.max(1) {
            comm.barrier()?;
            let t = Instant::now();
            match rank {
                0 => {
                    comm.send(1, vec![1u8; bytes])?;
                    let back = comm.recv(1)?;
                    if back.len() != bytes {
                        return Err(RuntimeError::Peer {
                            rank: 0,
                            peer: 1,
                            op: "recv".into(),
                            kind: PeerKind::Malformed,
                            message: format!(
                                "calibration: rank 1 answered a message of {bytes} bytes with {}",
                                back.len()
                            ),
                        });
                    }
                }
                1 => {
                    let got = comm.recv(0)?;
                    comm.send(0, got)?;
                }
                _ => {}
            }
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64() / 2.0);
            }
        }
        times.sort_by(f64::total_cmp);
        out.push(Sample {
            bytes,
            seconds: times[times.len() / 2],
        });
    }
    Ok(out)
}

fn sweep_all_reduce(
    comm: &mut dyn Communicator,
    sizes: &[usize],
    reps: usize,
) -> Result<Vec<Sample>> {
    if comm.size() < 2 {
        return Err(RuntimeError::Config(
            "calibration needs at least 2 ranks: one rank's all-reduce sends nothing".into(),
        ));
    }
    let mut out = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let mut buf = vec![1.0f32; (bytes / 4).max(1)];
        comm.set_label(&format!(
            "calibration all-reduce of {} bytes",
            buf.len() * 4
        ));
        comm.all_reduce(&mut buf, true)?;
        let mut times = Vec::with_capacity(reps.max(1));
        for _ in 0..reps.max(1) {
            comm.barrier()?;
            let t = Instant::now();
            comm.all_reduce(&mut buf, true)?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        out.push(Sample {
            bytes: buf.len() * 4,
            seconds: times[times.len() / 2],
        });
    }
    Ok(out)
}

/// [`sweep`] over `ranks` threads of this process (the in-process transport); rank
/// 0's samples.
pub fn sweep_in_process(
    ranks: usize,
    sizes: &[usize],
    reps: usize,
    timeout: std::time::Duration,
) -> Result<Sweep> {
    let comms = in_process(ranks);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                c.set_timeout(Some(timeout));
                s.spawn(move || sweep(&mut c, sizes, reps))
            })
            .collect();
        let results: Vec<Result<Sweep>> = handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(RuntimeError::Internal {
                        at: "calibrate".into(),
                        message: "a calibration rank panicked".into(),
                    })
                })
            })
            .collect();
        let (sweeps, failed): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
        let mut errors: Vec<RuntimeError> = failed.into_iter().filter_map(Result::err).collect();
        // The error that started it: a rank that timed out makes its peers see it hang
        // up, and which rank times out first is a race.
        if !errors.is_empty() {
            let cause = errors
                .iter()
                .position(|e| e.peer_kind() != Some(PeerKind::HungUp))
                .unwrap_or(0);
            return Err(errors.swap_remove(cause));
        }
        // No rank failed: rank 0's samples are the answer.
        sweeps
            .into_iter()
            .next()
            .unwrap_or_else(|| Ok(Sweep::default()))
    })
}

/// Bytes per second of a plain copy of a 64 MiB buffer on this machine (the best of
/// five), what packing gradients into buckets and unpacking them costs per byte.
pub fn copy_bandwidth() -> f64 {
    let src = vec![1.0f32; 16 << 20];
    let mut dst = vec![0.0f32; src.len()];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    // Read and written: each byte crosses memory twice.
    2.0 * (src.len() * 4) as f64 / best.max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sweep_times_every_size_on_every_rank() {
        let samples = sweep_in_process(
            3,
            &[4, 4096, 1 << 16],
            3,
            std::time::Duration::from_secs(60),
        )
        .expect("three ranks time");
        for samples in [&samples.all_reduce, &samples.messages] {
            assert_eq!(
                samples.iter().map(|s| s.bytes).collect::<Vec<_>>(),
                vec![4, 4096, 1 << 16]
            );
            assert!(samples
                .iter()
                .all(|s| s.seconds > 0.0 && s.seconds.is_finite()));
        }
    }

    #[test]
    fn one_rank_is_refused() {
        let e = sweep_in_process(1, &[4], 1, std::time::Duration::from_secs(60))
            .expect_err("one rank is refused")
            .to_string();
        assert!(e.contains("at least 2 ranks"), "{e}");
    }
}
