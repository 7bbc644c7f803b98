//! Bugs planted on purpose, to show that `distc verify` catches them: each is one
//! plausible one-line mistake, off unless `DISTC_PLANTED_BUG` names it. Only tests set
//! it; a run with it set says so on its first line of stderr.

use std::sync::OnceLock;

/// The bugs that can be planted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Planted {
    /// A data-axis all-reduce of gradients sums where it should average
    /// (`allreduce-mean`).
    AllReduceMean,
    /// ZeRO's optimizer drops its shard's slots after each step: Adam starts its
    /// moments again every step (`zero-slot`).
    ZeroSlot,
    /// Gradient accumulation divides the last micro-batch's sum by K - 1 instead of K
    /// (`micro-batch-scale`).
    MicroBatchScale,
}

impl Planted {
    const ALL: [(Planted, &'static str); 3] = [
        (Planted::AllReduceMean, "allreduce-mean"),
        (Planted::ZeroSlot, "zero-slot"),
        (Planted::MicroBatchScale, "micro-batch-scale"),
    ];

    /// Whether this bug is planted in this process.
    pub fn here(self) -> bool {
        planted() == Some(self)
    }
}

fn planted() -> Option<Planted> {
    static PLANTED: OnceLock<Option<Planted>> = OnceLock::new();
    *PLANTED.get_or_init(|| {
        let name = std::env::var("DISTC_PLANTED_BUG")
            .ok()
            .filter(|n| !n.is_empty())?;
        let found = Planted::ALL.iter().find(|(_, n)| *n == name).map(|p| p.0);
        match found {
            Some(_) => eprintln!("distc: DISTC_PLANTED_BUG={name}: this run has a bug planted"),
            None => eprintln!(
                "distc: DISTC_PLANTED_BUG={name} names no planted bug (allreduce-mean, \
                 zero-slot, micro-batch-scale): none planted"
            ),
        }
        found
    })
}
