//! NCCL without a GPU: the bootstrap over the workers' host communicator takes the
//! same decision on every rank (host collectives when NCCL is missing and `auto` was
//! asked for; an error naming the library when `nccl` was), a missing or broken
//! library is an error, never a panic, and the compaction kernel compiles with NVRTC.
//! The NCCL collectives themselves run in the GPU suite (`tests/tests/cuda_backend.rs`).

use distc_runtime::comm::{in_process, Communicator};
use distc_runtime::cuda::nccl::{bootstrap, unique_id, Collectives};
use distc_runtime::cuda::{probe, CudaError, CudaLib, LibDirs};
use distc_runtime::RuntimeError;

/// A folder of this test's own under the system's temporary folder, removed on drop.
struct TempDir(tempfile::TempDir);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = tempfile::Builder::new()
            .prefix(&format!("distc-nccl-{name}-"))
            .tempdir()
            .expect("temp dir");
        TempDir(p)
    }
    fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

/// Whether the NCCL library can be found here (then the no-NCCL tests say so and
/// skip).
fn nccl_here() -> bool {
    probe(CudaLib::Nccl, &LibDirs::from_env()).is_ok()
}

/// Runs `bootstrap` on `n` in-process ranks, rank r on GPU `gpus[r]`, with `dirs`.
fn boot_all(
    n: usize,
    gpus: &[&str],
    mode: Collectives,
    dirs: &LibDirs,
) -> Vec<Result<Option<[u8; 128]>, RuntimeError>> {
    let comms = in_process(n);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                let gpu = gpus[c.rank()].to_string();
                let dirs = dirs.clone();
                s.spawn(move || bootstrap(&mut c, mode, &gpu, &dirs))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    })
}

#[test]
fn without_nccl_auto_falls_back_to_the_host_on_every_rank() {
    if nccl_here() {
        eprintln!("skipping: the NCCL library is present here");
        return;
    }
    let empty = TempDir::new("auto");
    let dirs = LibDirs::default().with(empty.path());
    for r in boot_all(3, &["GPU-a", "GPU-b", "GPU-c"], Collectives::Auto, &dirs) {
        assert!(matches!(r, Ok(None)), "{r:?}");
    }
    // Host collectives never look for NCCL.
    for r in boot_all(2, &["GPU-a", "GPU-a"], Collectives::Host, &dirs) {
        assert!(matches!(r, Ok(None)), "{r:?}");
    }
}

#[test]
fn without_nccl_asking_for_it_is_an_error_naming_the_library_on_every_rank() {
    if nccl_here() {
        eprintln!("skipping: the NCCL library is present here");
        return;
    }
    let empty = TempDir::new("nccl");
    let dirs = LibDirs::default().with(empty.path());
    for r in boot_all(2, &["GPU-a", "GPU-b"], Collectives::Nccl, &dirs) {
        let e = r.expect_err("no NCCL").to_string();
        assert!(e.contains("the NCCL library is missing"), "{e}");
        assert!(e.contains("libnccl.so"), "{e}");
        assert!(e.contains(&empty.path().display().to_string()), "{e}");
        assert!(e.contains("DISTC_CUDA_LIB_DIR"), "{e}");
    }
    let e = unique_id(&dirs).expect_err("no NCCL");
    assert!(
        matches!(
            e,
            CudaError::MissingLibrary {
                lib: CudaLib::Nccl,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn a_broken_nccl_library_is_an_error_not_a_panic() {
    let dir = TempDir::new("broken");
    std::fs::write(dir.path().join("libnccl.so"), b"not an ELF file").expect("write");
    let dirs = LibDirs::default().with(dir.path());
    let e = probe(CudaLib::Nccl, &dirs).expect_err("garbage is not a library");
    assert!(
        matches!(
            e,
            CudaError::LoadFailed {
                lib: CudaLib::Nccl,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("libnccl.so"), "{e}");
    for r in boot_all(2, &["GPU-a", "GPU-b"], Collectives::Nccl, &dirs) {
        let e = r.expect_err("a broken NCCL").to_string();
        assert!(e.contains("libnccl.so"), "{e}");
    }
}

#[test]
fn workers_sharing_a_gpu_use_the_host_or_are_told_why_not() {
    // The decision needs no library when the GPUs already rule NCCL out: a shared GPU
    // with `nccl` names the ranks (the library check comes first where it is missing).
    let empty = TempDir::new("shared");
    let dirs = LibDirs::default().with(empty.path());
    for r in boot_all(2, &["GPU-a", "GPU-a"], Collectives::Auto, &dirs) {
        assert!(matches!(r, Ok(None)), "{r:?}");
    }
}

#[test]
fn a_rank_that_dies_before_the_bootstrap_fails_the_others_instead_of_hanging() {
    let comms = in_process(2);
    let results: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut c| {
                s.spawn(move || {
                    if c.rank() == 1 {
                        // This worker's GPU failed: its communicator goes away.
                        drop(c);
                        return "dropped".to_string();
                    }
                    c.set_timeout(Some(std::time::Duration::from_secs(20)));
                    match bootstrap(&mut c, Collectives::Auto, "GPU-a", &LibDirs::default()) {
                        Ok(_) => "ok".into(),
                        Err(e) => e.to_string(),
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no panic"))
            .collect()
    });
    assert_ne!(results[0], "ok", "{results:?}");
}

#[test]
fn the_compaction_and_interleaving_kernels_compile_for_hopper() {
    // DISTC_CUDA_LIB_DIR's folders, then the one scripts/install-nvrtc.sh fills.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dirs = LibDirs::from_env().with(root.join(".nvrtc/nvidia/cu13/lib"));
    if let Err(e) = probe(CudaLib::Nvrtc, &dirs) {
        if std::env::var_os("CI").is_some() {
            panic!("CI runs this with NVRTC: {e}");
        }
        eprintln!("skipping: {e}");
        return;
    }
    let cubin = distc_runtime::cuda::nvrtc::compile_cubin(
        distc_runtime::cuda::nccl::COMPACT_SOURCE,
        "nccl_compact.cu",
        "sm_90",
    )
    .expect("compiles");
    assert_eq!(&cubin[..4], b"\x7fELF");
    for kernel in [
        distc_runtime::cuda::nccl::COMPACT_KERNEL,
        distc_runtime::cuda::nccl::INTERLEAVE_KERNEL,
    ] {
        let name = kernel.as_bytes();
        assert!(
            cubin.windows(name.len()).any(|w| w == name),
            "the CUBIN holds {kernel}"
        );
    }
}
