//! `--device`: a GPU run where there is none (or no CUDA library) is refused with a
//! message naming what is missing and how to point distc at it, exit 1, never a
//! panic; and device flags that do not fit the run are refused before anything runs.

mod common;

use common::{distc, refused, text};

/// Whether this machine has a CUDA driver that sees a GPU (then the no-GPU message
/// cannot be tested here).
fn have_gpu() -> bool {
    distc_runtime::cuda::require_gpu(&distc_runtime::cuda::LibDirs::from_env()).is_ok()
}

#[test]
fn cuda_without_a_gpu_names_what_is_missing() {
    if have_gpu() {
        println!("skipping: this machine has a GPU");
        return;
    }
    // One device, another GPU number, and a distributed plan (workers on the GPU).
    let distributed = ["--strategy", "hybrid", "--workers", "2", "--servers", "1"];
    for (device, extra) in [
        ("cuda", &[][..]),
        ("cuda:1", &[][..]),
        ("cuda", &distributed[..]),
    ] {
        let mut args = vec!["train", "examples/sparse_lm.dsl", "--device", device];
        args.extend_from_slice(&["--steps", "1"]);
        args.extend_from_slice(extra);
        let o = distc(&args);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let t = text(&o);
        assert!(!t.contains("panicked"), "{t}");
        // The driver library (or, with one, the missing GPU) is named with the fix.
        assert!(
            (t.contains("libcuda.so.1") && t.contains("DISTC_CUDA_LIB_DIR"))
                || t.contains("no usable CUDA GPU"),
            "{t}"
        );
    } // verify on the GPU: both sides' workers there.
    let o = distc(&[
        "verify",
        "examples/sparse_lm.dsl",
        "--strategy",
        "allreduce",
        "--workers",
        "2",
        "--steps",
        "1",
        "--device",
        "cuda",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t = text(&o);
    assert!(!t.contains("panicked"), "{t}");
    assert!(
        t.contains("libcuda.so.1") || t.contains("no usable CUDA GPU"),
        "{t}"
    );
}

#[test]
fn device_flags_that_do_not_fit_are_refused() {
    refused(
        &["train", "examples/mlp.dsl", "--device", "gpu"],
        "give cpu, cuda or cuda:N",
    );
    refused(
        &["train", "examples/mlp.dsl", "--device", "cuda:x"],
        "give cpu, cuda or cuda:N",
    );
    refused(
        &["train", "examples/mlp.dsl", "--tf32", "--steps", "1"],
        "give --device cuda with them",
    );
    refused(
        &["train", "examples/mlp.dsl", "--gpus", "0,1", "--steps", "1"],
        "give --device cuda with them",
    );
    refused(
        &[
            "train",
            "examples/mlp.dsl",
            "--collectives",
            "nccl",
            "--steps",
            "1",
        ],
        "give --device cuda with them",
    );
    refused(
        &[
            "train",
            "examples/mlp.dsl",
            "--device",
            "cuda",
            "--collectives",
            "mpi",
        ],
        "expected auto, nccl or host",
    );
    refused(
        &[
            "bench",
            "--device",
            "cuda",
            "--strategies",
            "allreduce",
            "--workers",
            "2",
        ],
        "--strategies single",
    );
}

/// Whether the NCCL library can be found here.
fn have_nccl() -> bool {
    distc_runtime::cuda::probe(
        distc_runtime::cuda::CudaLib::Nccl,
        &distc_runtime::cuda::LibDirs::from_env(),
    )
    .is_ok()
}

#[test]
fn nccl_asked_for_without_the_library_names_it_and_how_to_point_distc_at_it() {
    if have_nccl() {
        println!("skipping: this machine has the NCCL library");
        return;
    }
    // Two workers, and one worker (the world-size-1 NCCL run), each in-process; the
    // library is checked before the GPU, so this says NCCL even with no GPU.
    for workers in ["2", "1"] {
        let o = distc(&[
            "train",
            "examples/sparse_lm.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            workers,
            "--device",
            "cuda",
            "--collectives",
            "nccl",
            "--steps",
            "1",
        ]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let t = text(&o);
        assert!(!t.contains("panicked"), "{t}");
        assert!(t.contains("the NCCL library is missing"), "{t}");
        assert!(t.contains("libnccl.so"), "{t}");
        assert!(t.contains("DISTC_CUDA_LIB_DIR"), "{t}");
    }
}

/// Issue 35, item 11: the emulator accepted `--device cuda:7` and `--gpus 0,2^64-1`;
/// a GPU that does not exist is refused by number, on the emulator (one GPU) as on a
/// machine's driver.
#[test]
fn a_gpu_that_does_not_exist_is_refused_by_number() {
    for (args, want) in [
        (
            vec!["--device", "cuda:7"],
            "--device cuda: GPU 7 does not exist",
        ),
        (
            vec!["--device", "cuda", "--gpus", "0,18446744073709551615"],
            "--gpus: GPU 18446744073709551615 does not exist",
        ),
    ] {
        let mut all = vec!["train", "examples/mlp.dsl", "--steps", "1", "-q"];
        all.extend(args);
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_distc"))
            .args(&all)
            .current_dir(common::root())
            .env("DISTC_CUDA_EMULATOR", "1")
            .output()
            .expect("distc");
        assert_eq!(o.status.code(), Some(1), "{all:?}: {}", text(&o));
        assert!(text(&o).contains(want), "{all:?}: {}", text(&o));
        assert!(!text(&o).contains("panicked"), "{}", text(&o));
    }
}
