//! The peak arithmetic rate of the devices a run uses, for model FLOPs utilisation
//! (MFU: the model's FLOPs per second over the peak): a GPU's from a table of
//! datasheet figures, a CPU's measured by the CPU backend (`crate::cpu::peak`).
//!
//! Each worker's backend says which device it computes on and that device's peak
//! ([`crate::core::backend::Kernels::peak_flops`]); the coordinator adds the peaks of
//! distinct devices, so worker threads sharing one CPU count its peak once.

use distc_ir::{DType, Graph, Op};
use serde::{Deserialize, Serialize};

/// Model FLOPs a worker's run must have for it to ask its device's peak: the CPU's
/// takes 80 ms to measure (`crate::cpu::peak`), before the first step, which a run of
/// 1e10 FLOPs (a tenth of a second at 100 GFLOP/s; `distc bench`'s runs have more)
/// can spare and a test's few steps of a small model would pay many times over;
/// shorter runs report model FLOP/s without utilisation.
pub const MIN_WORK: f64 = 1e10;

/// Whether a worker that computes `samples` samples of `flops_per_sample` FLOPs in
/// all asks its device's peak.
pub fn worth_measuring(flops_per_sample: Option<f64>, samples: usize) -> bool {
    flops_per_sample.is_some_and(|f| f * samples as f64 >= MIN_WORK)
}

/// One device's peak rate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DevicePeak {
    /// Which device: equal keys are one device, however many workers share it.
    pub device: String,
    /// Floating-point operations per second at most.
    pub flops_per_sec: f64,
    /// Where the figure comes from, for the summary (`NVIDIA H100 80GB HBM3, bf16
    /// tensor cores, datasheet`).
    pub source: String,
}

/// The arithmetic of a plan's products (matrix products, convolutions, attention),
/// which sets the peak they can reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// 16-bit inputs (bf16 or fp16) on tensor cores, f32 accumulation.
    Half,
    /// f32 inputs rounded to TF32 on tensor cores.
    Tf32,
    /// f32 on the vector units.
    F32,
    /// f64.
    F64,
}

impl Products {
    /// The products' arithmetic from their inputs' element type; `tf32` when f32
    /// products may use TF32 tensor cores.
    pub fn of(dtype: DType, tf32: bool) -> Products {
        match dtype {
            DType::BF16 | DType::F16 => Products::Half,
            DType::F64 => Products::F64,
            _ if tf32 => Products::Tf32,
            _ => Products::F32,
        }
    }

    fn words(self) -> &'static str {
        match self {
            Products::Half => "16-bit tensor cores",
            Products::Tf32 => "TF32 tensor cores",
            Products::F32 => "f32",
            Products::F64 => "f64",
        }
    }
}

/// The element type a plan's products take their inputs in: 16-bit where any product
/// of `g` has 16-bit inputs (the products are the FLOPs a mixed-precision plan is
/// about), else f64 where one has f64 inputs, else f32.
pub fn products_dtype(g: &Graph) -> DType {
    let mut seen = DType::F32;
    for id in g.node_ids() {
        let node = g.node(id);
        if !matches!(
            node.op,
            Op::MatMul { .. } | Op::Conv2d { .. } | Op::Attention { .. }
        ) {
            continue;
        }
        let Some(input) = node.inputs.first() else {
            continue;
        };
        match g.value_type(*input).dense_type().dtype {
            d @ (DType::BF16 | DType::F16) => return d,
            DType::F64 => seen = DType::F64,
            _ => {}
        }
    }
    seen
}

/// Dense peaks, TFLOP/s, from NVIDIA's datasheets (the sparse figures halved where a
/// datasheet gives only those): (what the device name contains, f64, f32, TF32,
/// bf16/fp16). The first row whose every word the name contains applies, so the
/// specific rows come first.
const DATASHEET: &[(&[&str], [f64; 4])] = &[
    (&["H100", "PCIe"], [25.6, 51.2, 378.0, 756.0]),
    (&["H100", "NVL"], [30.0, 60.0, 417.5, 835.5]),
    // The SXM part: its name is "NVIDIA H100 80GB HBM3".
    (&["H100"], [33.5, 66.9, 494.7, 989.4]),
    (&["H200"], [33.5, 66.9, 494.7, 989.4]),
    (&["A100"], [9.7, 19.5, 156.0, 312.0]),
    (&["L40S"], [1.4, 91.6, 183.0, 362.1]),
];

/// The datasheet peak of GPU `name` for `products`, FLOP/s, and the row's words; `None`
/// for a GPU the table does not list.
pub fn datasheet_peak(name: &str, products: Products) -> Option<(f64, String)> {
    let (_, peaks) = DATASHEET
        .iter()
        .find(|(words, _)| words.iter().all(|w| name.contains(w)))?;
    let tflops = match products {
        Products::F64 => peaks[0],
        Products::F32 => peaks[1],
        Products::Tf32 => peaks[2],
        Products::Half => peaks[3],
    };
    Some((
        tflops * 1e12,
        format!("{name}, {}, datasheet", products.words()),
    ))
}

/// The peak of `products` on this machine's CPU, as `measured` FLOP/s.
pub fn cpu_peak(measured: f64, products: Products) -> DevicePeak {
    DevicePeak {
        device: format!("cpu@{}", machine_id()),
        flops_per_sec: measured,
        source: format!("this CPU, {} matrix product, measured", products.words()),
    }
}

/// This machine, the same for every process on it (network namespaces included): the
/// kernel's boot id, else the host name.
pub fn machine_id() -> String {
    ["/proc/sys/kernel/random/boot_id", "/etc/hostname"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "this machine".into())
}

/// The summed peak of the distinct devices among `peaks` (by [`DevicePeak::device`]),
/// and the sources' words (one device's, or `N devices: ...`).
pub fn total_peak<'a>(peaks: impl IntoIterator<Item = &'a DevicePeak>) -> Option<(f64, String)> {
    let mut seen: Vec<&DevicePeak> = Vec::new();
    for p in peaks {
        if !seen.iter().any(|s| s.device == p.device) {
            seen.push(p);
        }
    }
    let first = seen.first()?;
    let total = seen.iter().map(|p| p.flops_per_sec).sum();
    let source = match seen.len() {
        1 => first.source.clone(),
        n => format!("{n} devices, each {}", first.source),
    };
    Some((total, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datasheet_rows_match_the_names_the_driver_gives() {
        let h100 = datasheet_peak("NVIDIA H100 80GB HBM3", Products::Half).expect("listed");
        assert_eq!(h100.0, 989.4e12);
        let pcie = datasheet_peak("NVIDIA H100 PCIe", Products::Tf32).expect("listed");
        assert_eq!(pcie.0, 378.0e12);
        let a100 = datasheet_peak("NVIDIA A100-SXM4-80GB", Products::F32).expect("listed");
        assert_eq!(a100.0, 19.5e12);
        assert!(datasheet_peak("distc CUDA emulator", Products::Half).is_none());
    }

    #[test]
    fn a_device_shared_by_workers_counts_once() {
        let cpu = |d: &str| DevicePeak {
            device: d.into(),
            flops_per_sec: 1e11,
            source: "cpu".into(),
        };
        let (t, s) = total_peak(&[cpu("a"), cpu("a"), cpu("a")]).expect("one device");
        assert_eq!((t, s.as_str()), (1e11, "cpu"));
        let (t, s) = total_peak(&[cpu("a"), cpu("b")]).expect("two devices");
        assert_eq!(t, 2e11);
        assert!(s.starts_with("2 devices"), "{s}");
        assert!(total_peak(&[]).is_none());
    }
}
