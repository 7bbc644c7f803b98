//! CUDA groundwork: probing the libraries with no GPU, and NVRTC compiling kernels to
//! CUBIN for sm_90 (no GPU or driver needed).
//!
//! NVRTC is looked for in `DISTC_CUDA_LIB_DIR`'s folders, then in the project-local
//! `.nvrtc/nvidia/cu13/lib` that `scripts/install-nvrtc.sh` fills, then by the
//! dynamic loader. Where it is not found the NVRTC tests skip with a printed
//! reason, except in CI (`CI` set), where a missing NVRTC fails them.

use distc_runtime::cuda::{self, nvrtc, CudaError, CudaLib, Found, LibDirs};
use std::path::Path;

/// `DISTC_CUDA_LIB_DIR`'s folders and then the project-local NVRTC folder.
fn lib_dirs() -> LibDirs {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest.parent().unwrap_or(manifest);
    LibDirs::from_env().with(root.join(".nvrtc/nvidia/cu13/lib"))
}

fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// Finds NVRTC, or says why the test skips (panics in CI: the install script runs there).
fn nvrtc_or_skip(test: &str) -> bool {
    match cuda::probe(CudaLib::Nvrtc, &lib_dirs()) {
        Ok(found) => {
            eprintln!("{test}: NVRTC found {found}");
            true
        }
        Err(e) if in_ci() => panic!("{test}: NVRTC is required in CI (CI is set): {e}"),
        Err(e) => {
            eprintln!("SKIP {test}: {e}");
            false
        }
    }
}

/// The fused kernel a backend would generate for `y = max(a*x + b, 0)`.
const AXPB_RELU: &str = r#"extern "C" __global__ void axpb_relu(const float* __restrict__ x,
                                 float* __restrict__ y, float a, float b, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = fmaxf(fmaf(a, x[i], b), 0.0f);
    }
}
"#;

#[test]
fn probing_without_a_gpu_gives_errors_not_panics() {
    let dirs = lib_dirs();
    for lib in CudaLib::ALL {
        match cuda::probe(lib, &dirs) {
            Ok(found) => eprintln!("{lib}: found {found}"),
            Err(e) => {
                let text = e.to_string();
                eprintln!("{lib}: {text}");
                assert!(
                    matches!(e, CudaError::MissingLibrary { lib: l, .. } if l == lib),
                    "{e:?}"
                );
                assert!(text.contains(lib.file_name()), "{text}");
                assert!(text.contains(&lib.to_string()), "{text}");
                assert!(text.contains("DISTC_CUDA_LIB_DIR"), "{text}");
            }
        }
    }
    match cuda::require_gpu(&dirs) {
        Ok(n) => eprintln!("a usable GPU: the driver sees {n} device(s)"),
        Err(e) => {
            eprintln!("no GPU: {e}");
            // With no driver library the error names it; with a driver but no
            // device, it says so.
            match &e {
                CudaError::MissingLibrary { lib, .. } => {
                    assert_eq!(*lib, CudaLib::Driver);
                    assert!(e.to_string().contains("libcuda.so.1"), "{e}");
                }
                CudaError::NoDevice(_) => {}
                other => panic!("unexpected error: {other:?}"),
            }
        }
    }
}

#[test]
fn a_missing_folder_is_named_in_the_error() {
    // A library no folder holds and the loader cannot find: only checkable where the
    // driver is absent (this project's CPU machines and CI).
    let dirs = LibDirs::default().with("/nonexistent/distc-cuda-libs");
    match cuda::probe(CudaLib::Driver, &dirs) {
        Ok(found) => eprintln!(
            "SKIP a_missing_folder_is_named_in_the_error: a CUDA driver is installed ({found})"
        ),
        Err(e) => {
            let text = e.to_string();
            assert!(text.contains("/nonexistent/distc-cuda-libs"), "{text}");
            assert!(text.contains("libcuda.so.1"), "{text}");
        }
    }
}

#[test]
fn nvrtc_compiles_a_fused_kernel_to_cubin_for_sm_90() {
    if !nvrtc_or_skip("nvrtc_compiles_a_fused_kernel_to_cubin_for_sm_90") {
        return;
    }
    let cubin = match nvrtc::compile_cubin(AXPB_RELU, "axpb_relu.cu", "sm_90") {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    assert!(cubin.len() > 64, "a CUBIN of {} bytes", cubin.len());
    assert_eq!(&cubin[..4], b"\x7fELF", "not an ELF image");
    // ELF64, little-endian, machine EM_CUDA (190).
    assert_eq!(cubin[4], 2, "not ELF64");
    assert_eq!(
        u16::from_le_bytes([cubin[18], cubin[19]]),
        190,
        "not a CUDA ELF"
    );
    // The kernel's symbol is in the image.
    assert!(
        cubin.windows(9).any(|w| w == b"axpb_relu"),
        "no axpb_relu symbol"
    );
    eprintln!("axpb_relu.cu: CUBIN for sm_90, {} bytes", cubin.len());
}

#[test]
fn nvrtc_errors_carry_the_log_and_the_line() {
    if !nvrtc_or_skip("nvrtc_errors_carry_the_log_and_the_line") {
        return;
    }
    let broken = AXPB_RELU.replace("fmaf(a, x[i], b)", "fmaf(a, x[i], bias)");
    let err = match nvrtc::compile_cubin(&broken, "broken_axpb_relu.cu", "sm_90") {
        Ok(_) => panic!("a kernel reading an undefined `bias` compiled"),
        Err(e) => e,
    };
    let text = err.to_string();
    eprintln!("{text}");
    match &err {
        CudaError::Compile {
            name,
            arch,
            code,
            log,
        } => {
            assert_eq!(name, "broken_axpb_relu.cu");
            assert_eq!(arch, "sm_90");
            assert_eq!(code, "NVRTC_ERROR_COMPILATION");
            // NVRTC's located message, then the source line it points at (line 5),
            // quoted by NVRTC or, where it does not, by compile_cubin.
            assert!(log.contains("broken_axpb_relu.cu(5): error"), "{log}");
            assert!(log.contains("\"bias\" is undefined"), "{log}");
            assert!(
                log.contains("y[i] = fmaxf(fmaf(a, x[i], bias), 0.0f);"),
                "{log}"
            );
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    assert!(
        text.contains("NVRTC could not compile `broken_axpb_relu.cu` for sm_90"),
        "{text}"
    );
}

#[test]
fn nvrtc_refuses_a_virtual_architecture_by_name() {
    // Checked before NVRTC is loaded: runs everywhere.
    match nvrtc::compile_cubin(AXPB_RELU, "axpb_relu.cu", "compute_90") {
        Err(CudaError::Invalid(m)) => assert!(m.contains("compute_90"), "{m}"),
        other => panic!("expected an invalid-architecture error, got {other:?}"),
    }
}

#[test]
fn found_says_where() {
    assert_eq!(Found::Loader.to_string(), "by the dynamic loader");
}
