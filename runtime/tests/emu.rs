//! The GPU emulator's kernels (issue 21, first part): CUDA C compiled by the system C++
//! compiler with `cuda_emu.h` and run block by block, each CUDA thread a fiber. The
//! block reductions, ballots and scans of the generated code's prelude run as written
//! (real barriers, warps of 32); a divergent warp exchange is named. (Every kernel the
//! backend generates for the examples compiling for the emulator: `tests/tests/cuda_emu.rs`.)

// Launching a kernel hands raw pointers to compiled code: each call says why it holds.
#![allow(unsafe_code)]

use distc_runtime::cuda::codegen::generate;
use distc_runtime::cuda::emu::EmuModule;
use std::ffi::c_void;

/// The prelude every generated translation unit opens with (block_sum, block_scan),
/// taken from a generated plan so the test runs the backend's own helpers.
fn prelude() -> String {
    let mut g = distc_ir::Graph::new("p");
    let x = g
        .add(
            distc_ir::Op::Input {
                name: "x".into(),
                ty: distc_ir::TensorType::f32(vec![4]),
            },
            vec![],
        )
        .expect("input");
    g.add(distc_ir::Op::Relu, vec![x.into()]).expect("relu");
    let src = generate(&g).expect("generates").source;
    let end = src.find("extern \"C\"").unwrap_or(src.len());
    src[..end].to_string()
}

fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// Each block sums its slice with warp shuffles and barriers (`block_sum`); the
/// partial sums match the slices' sums. A mutant prelude that skips the barrier
/// gives wrong sums here, as it would on a GPU.
#[test]
fn block_reductions_run_with_real_barriers_and_shuffles() {
    let src = format!(
        "{}\nextern \"C\" __global__ void partial(const float* x, float* out, u64 n) {{\n    __shared__ float sh[32];\n    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    float v = i < n ? x[i] : 0.0f;\n    float s = block_sum(v, sh);\n    if (threadIdx.x == 0) out[blockIdx.x] = s;\n}}\n",
        prelude()
    );
    let m = EmuModule::compile(&src, &["partial"]).expect("compiles");
    let n: u64 = 1000;
    let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 101) as f32 - 50.0).collect();
    let mut out = vec![f32::NAN; 4];
    let (mut xp, mut op, mut np) = (x.as_ptr(), out.as_mut_ptr(), n);
    let mut args = [arg(&mut xp), arg(&mut op), arg(&mut np)];
    // SAFETY: three arguments of the kernel's types; x holds n floats, out 4.
    unsafe { m.launch("partial", [4, 1, 1], [256, 1, 1], &mut args) }.expect("runs");
    for (b, got) in out.iter().enumerate() {
        let want: f32 = x.iter().skip(b * 256).take(256).sum();
        assert!((got - want).abs() < 1e-3, "block {b}: {got} vs {want}");
    }
}

/// `block_scan` (a ballot, popcounts and a barrier-separated prefix over warps)
/// compacts the flagged elements of each block in order.
#[test]
fn ballots_and_scans_compact_in_order() {
    let src = format!(
        "{}\nextern \"C\" __global__ void compact(const int* flags, int* pos, int* totals) {{\n    __shared__ int sh[33];\n    int total;\n    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n    int p = block_scan(flags[i], sh, &total);\n    pos[i] = flags[i] ? p : -1;\n    if (threadIdx.x == 0) totals[blockIdx.x] = total;\n}}\n",
        prelude()
    );
    let m = EmuModule::compile(&src, &["compact"]).expect("compiles");
    let flags: Vec<i32> = (0..512).map(|i| ((i * 37) % 5 == 0) as i32).collect();
    let mut pos = vec![0i32; 512];
    let mut totals = vec![0i32; 2];
    let (mut fp, mut pp, mut tp) = (flags.as_ptr(), pos.as_mut_ptr(), totals.as_mut_ptr());
    let mut args = [arg(&mut fp), arg(&mut pp), arg(&mut tp)];
    // SAFETY: three pointers to 512, 512 and 2 ints.
    unsafe { m.launch("compact", [2, 1, 1], [256, 1, 1], &mut args) }.expect("runs");
    for (b, &total) in totals.iter().enumerate() {
        let mut next = 0;
        for i in b * 256..(b + 1) * 256 {
            if flags[i] == 1 {
                assert_eq!(pos[i], next, "element {i}");
                next += 1;
            } else {
                assert_eq!(pos[i], -1);
            }
        }
        assert_eq!(total, next);
    }
}

/// A warp exchange some lanes of a warp wait in while others wait at a block barrier
/// would hang or misbehave on a GPU; the emulator names it.
#[test]
fn a_divergent_warp_exchange_is_reported() {
    let src = "extern \"C\" __global__ void bad(float* y) {\n    float v = threadIdx.x;\n    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);\n    __syncthreads();\n    y[threadIdx.x] = v;\n}\n";
    let m = EmuModule::compile(&format!("typedef unsigned long long u64;\n{src}"), &["bad"])
        .expect("compiles");
    let mut y = vec![0f32; 32];
    let mut yp = y.as_mut_ptr();
    let mut args = [arg(&mut yp)];
    // SAFETY: one pointer to 32 floats.
    let e = unsafe { m.launch("bad", [1, 1, 1], [32, 1, 1], &mut args) }
        .expect_err("divergent")
        .to_string();
    assert!(e.contains("warp exchange"), "{e}");
    // A block of more than 1024 threads is refused as a GPU refuses it.
    // SAFETY: as above; the launch is refused before the kernel runs.
    let e = unsafe { m.launch("bad", [1, 1, 1], [2048, 1, 1], &mut args) }
        .expect_err("too big")
        .to_string();
    assert!(e.contains("1024"), "{e}");
}

mod device {
    use distc_runtime::cuda::emu::device::{Captured, EmuDevice, EmuFault, Touch};

    fn ok(_: &mut [*mut u8]) -> Result<(), String> {
        Ok(())
    }

    /// One stream writes, another reads with no event between: a race, named. The
    /// same read after an event recorded on the writer and waited on is fine.
    #[test]
    fn a_cross_stream_read_without_an_event_is_a_race() {
        let mut d = EmuDevice::new();
        let (s0, s1) = (d.stream(), d.stream());
        let p = d.alloc(16).expect("alloc");
        d.copy_htod(s0, p, 0, &[1; 16]).expect("copy");
        let e = d.launch(s1, "reader", &[p], &[], ok).expect_err("a race");
        assert!(matches!(e, EmuFault::Race { .. }), "{e}");
        let ev = d.event();
        d.record_event(s0, ev).expect("record");
        d.wait_event(s1, ev).expect("wait");
        d.launch(s1, "reader", &[p], &[], ok)
            .expect("ordered by the event");
        // An event recorded before the write does not order it.
        let early = d.event();
        d.record_event(s0, early).expect("record");
        d.memset(s0, p, 0, 0, 16).expect("memset");
        d.wait_event(s1, early).expect("wait");
        let e = d.launch(s1, "writer", &[], &[p], ok).expect_err("a race");
        assert!(e.to_string().contains("writes it after stream"), "{e}");
    }

    /// Allocating or freeing while a stream is captured is refused; a captured
    /// graph records without running, and its replay runs with every check.
    #[test]
    fn allocating_during_capture_is_refused_and_graphs_replay() {
        let mut d = EmuDevice::new();
        let s = d.stream();
        let p = d.alloc(8).expect("alloc");
        d.copy_htod(s, p, 0, &[0; 8]).expect("copy");
        d.begin_capture(s).expect("capture");
        assert!(matches!(d.alloc(4), Err(EmuFault::DuringCapture(..))));
        assert!(matches!(d.free(p), Err(EmuFault::DuringCapture(..))));
        d.memset(s, p, 0, 7, 8).expect("recorded");
        let mut ran = 0;
        d.launch(s, "k", &[p], &[p], |_| {
            ran += 1;
            Ok(())
        })
        .expect("recorded");
        let graph = d.end_capture(s).expect("graph");
        assert_eq!(ran, 0, "a captured launch ran");
        assert_eq!(graph.len(), 2);
        assert!(matches!(graph[0], Captured::Memset { value: 7, .. }));
        let mut byte = [0u8; 1];
        d.copy_dtoh(s, p, 0, &mut byte).expect("read");
        assert_eq!(byte[0], 0, "a captured memset ran at capture");
        let mut labels = Vec::new();
        d.replay(s, &graph, &mut |l, _| {
            labels.push(l.to_string());
            Ok(())
        })
        .expect("replays");
        d.copy_dtoh(s, p, 0, &mut byte).expect("read");
        assert_eq!((byte[0], labels), (7, vec!["k".to_string()]));
    }

    /// A 16-bit tensor's buffer need not be a whole number of 4-byte words: writing
    /// all of it is no fault, and one byte more is. (The guard after a buffer was
    /// checked as if the buffer ended on a word, so a 370-byte bf16 tensor's kernel
    /// was said to write past its end.)
    #[test]
    fn buffers_of_any_length_are_guarded_byte_by_byte() {
        let mut d = EmuDevice::new();
        let s = d.stream();
        let p = d.alloc(8).expect("alloc");
        let t = Touch {
            addr: p.0,
            len: 6,
            must_be_written: 0,
            write: true,
        };
        let fill = |n: usize| {
            move |ptrs: &mut [*mut u8]| {
                // SAFETY: the emulator hands the kernel its buffer with a 64-byte guard
                // on each side; writing one byte past the 6 lands in the guard.
                unsafe { std::ptr::write_bytes(ptrs[0], 1, n) };
                Ok(())
            }
        };
        d.run(s, "k", &[t], fill(6)).expect("writes its 6 bytes");
        let e = d.run(s, "k", &[t], fill(7)).expect_err("one byte past");
        assert!(matches!(e, EmuFault::OutOfBounds { end: 7, .. }), "{e}");
    }

    /// Reading bytes never written (a copy out, or a launch's input) is named; so is
    /// a copy past an allocation's end.
    #[test]
    fn uninitialised_reads_and_out_of_bounds_copies_are_named() {
        let mut d = EmuDevice::new();
        let s = d.stream();
        let p = d.alloc(8).expect("alloc");
        d.copy_htod(s, p, 0, &[1; 4]).expect("half");
        let mut out = [0u8; 8];
        let e = d.copy_dtoh(s, p, 0, &mut out).expect_err("uninitialised");
        assert!(matches!(e, EmuFault::Uninitialised { start: 4, .. }), "{e}");
        let e = d.launch(s, "k", &[p], &[], ok).expect_err("uninitialised");
        assert!(e.to_string().contains("kernel `k` reads bytes 4..8"), "{e}");
        let e = d.copy_htod(s, p, 4, &[0; 8]).expect_err("past the end");
        assert!(
            matches!(
                e,
                EmuFault::OutOfBounds {
                    size: 8,
                    end: 12,
                    ..
                }
            ),
            "{e}"
        );
    }
}

/// Kernels with no barrier, exchange or shared memory (directly or through a helper)
/// run as plain loops; the others as fibers. A barrier the analysis missed is
/// reported by the plain loop, not run wrongly.
#[test]
fn barrier_free_kernels_run_as_plain_loops() {
    let src = format!(
        "{}\nextern \"C\" __global__ void partial(const float* x, float* out) {{\n    __shared__ float sh[32];\n    out[blockIdx.x] = block_sum(x[threadIdx.x], sh);\n}}\nextern \"C\" __global__ void twice(const float* x, float* y) {{ y[threadIdx.x] = 2.0f * x[threadIdx.x]; }}\nextern \"C\" __global__ void helper_user(const float* x, float* y) {{ wrap(x, y); }}\n",
        prelude()
    );
    let src = src.replace(
        "extern \"C\" __global__ void helper_user",
        "__device__ void wrap(const float* x, float* y) { __syncthreads(); y[0] = x[0]; }\nextern \"C\" __global__ void helper_user",
    );
    let fibers = distc_runtime::cuda::emu::needs_fibers(&src);
    assert!(
        fibers.contains("partial") && fibers.contains("block_sum"),
        "{fibers:?}"
    );
    assert!(
        fibers.contains("helper_user") && fibers.contains("wrap"),
        "{fibers:?}"
    );
    assert!(!fibers.contains("twice"), "{fibers:?}");
    let m = EmuModule::compile(&src, &["twice"]).expect("compiles");
    let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let mut y = vec![0f32; 64];
    let (mut xp, mut yp) = (x.as_ptr(), y.as_mut_ptr());
    let mut args = [arg(&mut xp), arg(&mut yp)];
    // SAFETY: two arguments of the kernel's types; x and y hold 64 floats.
    unsafe { m.launch("twice", [1, 1, 1], [64, 1, 1], &mut args) }.expect("runs");
    assert_eq!(y[63], 126.0);
}
