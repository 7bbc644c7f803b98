//! The limits the command line and the simulator share: what a flag accepts is what a
//! calibration file may hold. Below both, so neither imports the other for them.

/// The longest `--timeout`: a year. Above about 1.8e19 s a duration overflows; no wait
/// needs more than this.
pub const MAX_TIMEOUT_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// The slowest link or copy a simulation takes, in bytes/s. A bandwidth of 5e-324 is
/// finite and above 0, yet a bucket's time over it is infinite; no network is slower
/// than a byte a second.
pub const MIN_BANDWIDTH: f64 = 1.0;

/// The smallest and largest buffer a calibration times, in bytes (`calibrate --sizes`):
/// one f32 to 1 GiB.
pub const SAMPLE_BYTES: std::ops::RangeInclusive<usize> = 4..=1 << 30;
