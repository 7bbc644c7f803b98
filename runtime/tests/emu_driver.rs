//! The GPU emulator behind the CUDA backend's driver seam (issue 21): what the backend
//! asks (allocations, copies, launches with packed arguments and the bytes each
//! pointer may touch, graphs) runs on the CPU, and what a GPU punishes only sometimes
//! fails by name: a kernel writing past its buffer, a kernel reading a value nobody
//! wrote, a launch touching memory outside any allocation. (The whole backend on the
//! emulator against the CPU: `DISTC_CUDA_EMULATOR=1` with `tests/tests/cuda_ops.rs`
//! and `cuda_backend.rs`.)

use distc_runtime::cuda::driver::{Access, ArgVal, Driver, KernelLaunch, Region};
use distc_runtime::cuda::emu::EmuDriver;

const SRC: &str = r#"
extern "C" __global__ void scale(const float* x, float* y, int n, float k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = k * x[i];
}
extern "C" __global__ void scale_one_too_many(const float* x, float* y, int n, float k) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) y[i] = k * x[i];
}
"#;

fn floats(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

struct Setup {
    dev: EmuDriver,
    kernels: Vec<distc_runtime::cuda::driver::KernelHandle>,
    x: u64,
    y: u64,
}

/// A device with both kernels loaded, `x` = 1..=8 uploaded and `y` allocated.
fn setup() -> Setup {
    let mut dev = EmuDriver::new(0).expect("emulator");
    let names = ["scale".to_string(), "scale_one_too_many".to_string()];
    let kernels = dev.load_module(SRC, "t.cu", &names).expect("compiles");
    let x = dev.alloc(32, false).expect("alloc");
    let y = dev.alloc(32, false).expect("alloc");
    let xs: Vec<f32> = (1..=8).map(|i| i as f32).collect();
    dev.htod(x, &floats(&xs)).expect("upload");
    Setup { dev, kernels, x, y }
}

fn launch(s: &mut Setup, k: usize, n: i32, x_bytes: usize) -> Result<(), String> {
    let args = [
        ArgVal::U64(s.x),
        ArgVal::U64(s.y),
        ArgVal::I32(n),
        ArgVal::F32(2.0),
    ];
    let regions = [
        Region {
            arg: 0,
            bytes: x_bytes,
            access: Access::Read,
        },
        Region {
            arg: 1,
            bytes: 4 * n as usize,
            access: Access::Write,
        },
    ];
    s.dev
        .launch(&KernelLaunch {
            kernel: s.kernels[k],
            name: ["scale", "scale_one_too_many"][k],
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
            args: &args,
            regions: &regions,
            what: &|| "test".to_string(),
        })
        .map_err(|e| e.to_string())
}

fn read_y(s: &mut Setup, n: usize) -> Result<Vec<f32>, String> {
    let mut b = vec![0u8; 4 * n];
    s.dev.read(s.y, &mut b).map_err(|e| e.to_string())?;
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

#[test]
fn a_launch_runs_with_its_arguments_packed() {
    let mut s = setup();
    launch(&mut s, 0, 8, 32).expect("runs");
    let y = read_y(&mut s, 8).expect("reads");
    assert_eq!(y, (1..=8).map(|i| 2.0 * i as f32).collect::<Vec<_>>());
}

/// An off-by-one write, one float past the 6 the launch may write: inside the
/// allocation (a GPU would not fault) but outside the value.
#[test]
fn a_kernel_writing_past_its_buffer_is_named() {
    let mut s = setup();
    let e = launch(&mut s, 1, 6, 32).expect_err("out of bounds");
    assert!(
        e.contains("scale_one_too_many") && e.contains("past its end"),
        "{e}"
    );
}

/// A value the kernel only partly wrote: the reader of the rest is refused.
#[test]
fn reading_what_no_kernel_wrote_is_named() {
    let mut s = setup();
    s.dev.fresh(s.y, 32).expect("fresh");
    launch(&mut s, 0, 6, 32).expect("runs");
    assert_eq!(read_y(&mut s, 6).expect("written part").len(), 6);
    let e = read_y(&mut s, 8).expect_err("uninitialised");
    assert!(
        e.contains("never written") && e.contains("bytes 24..32"),
        "{e}"
    );
    // A kernel reading it is refused the same way.
    let (x, y) = (s.x, s.y);
    s.x = y;
    s.y = x;
    let e = launch(&mut s, 0, 8, 32).expect_err("uninitialised");
    assert!(e.contains("never written"), "{e}");
}

/// A region reaching past its allocation (a wrong size or offset in the memory plan).
#[test]
fn a_region_outside_its_allocation_is_named() {
    let mut s = setup();
    // x's allocation holds 256 bytes (the minimum); 300 do not fit.
    let e = launch(&mut s, 0, 8, 300).expect_err("out of bounds");
    assert!(
        e.contains("touches bytes 0..300") && e.contains("holds 256"),
        "{e}"
    );
}

/// A captured launch runs at each replay, not at capture; memory cannot be
/// allocated while capturing.
#[test]
fn graphs_record_and_replay() {
    let mut s = setup();
    s.dev.begin_capture().expect("capture");
    launch(&mut s, 0, 8, 32).expect("recorded");
    let e = s
        .dev
        .alloc(64, false)
        .expect_err("no allocation in a capture");
    assert!(e.to_string().contains("being captured"), "{e}");
    assert!(s.dev.end_capture().expect("ends"));
    s.dev.fresh(s.y, 32).expect("fresh");
    assert!(read_y(&mut s, 8).is_err(), "nothing ran at capture");
    s.dev.replay().expect("replays");
    assert_eq!(read_y(&mut s, 8).expect("reads")[7], 16.0);
}
