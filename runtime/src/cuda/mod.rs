//! CUDA at run time: finding the libraries, asking for a GPU, compiling kernels.
//!
//! Groundwork for the CUDA backend (issue 10). Every CUDA library is loaded at run
//! time by cudarc (`fallback-dynamic-loading`), so every build compiles this module
//! and no build needs a CUDA toolkit. cudarc *panics* when a library it calls into
//! cannot be loaded, so nothing here calls into a library before [`probe`] has
//! found it; a missing library is a [`CudaError::MissingLibrary`] value that names
//! the library, the file looked for and how to point distc at it.
//!
//! How a library is found, in this order:
//! 1. In the folders of [`LIB_DIR_ENV`] (`DISTC_CUDA_LIB_DIR`, a `:`-separated list
//!    like `PATH`), or of an explicit [`LibDirs`]: the file is loaded by its full
//!    path (with its companions: NVRTC's builtins library, cuBLAS's cublasLt) and
//!    kept loaded. cudarc then asks the dynamic loader for the same name, and the
//!    loader hands back the library already loaded under that soname. This works
//!    after the process has started, unlike `LD_LIBRARY_PATH`.
//! 2. Else by the dynamic loader's own search, as cudarc does it: `LD_LIBRARY_PATH`
//!    as it was when the process started, the `ld.so` cache, the system folders.
//!
//! [`backend`] runs a plan on one GPU ([`CudaBackend`], the executor's CUDA backend).

pub mod backend;
pub mod codegen;
pub mod driver;
pub mod emu;
pub mod nccl;
pub mod nvrtc;

pub use backend::{CudaBackend, CudaOptions};

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use thiserror::Error;

/// The environment variable that lists folders holding CUDA libraries
/// (`:`-separated, like `PATH`). Searched before the dynamic loader's own search.
pub const LIB_DIR_ENV: &str = "DISTC_CUDA_LIB_DIR";

/// A CUDA library distc loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaLib {
    /// The driver API (`libcuda.so.1`), installed with the NVIDIA driver.
    Driver,
    /// The runtime compiler (`libnvrtc.so.13`): needs no GPU and no driver.
    Nvrtc,
    /// cuBLAS (`libcublas.so.13`, which needs `libcublasLt.so.13`).
    Cublas,
    /// NCCL, which cudarc loads as `libnccl.so`.
    Nccl,
}

impl CudaLib {
    /// Every library, in the order a GPU run needs them.
    pub const ALL: [CudaLib; 4] = [
        CudaLib::Driver,
        CudaLib::Nvrtc,
        CudaLib::Cublas,
        CudaLib::Nccl,
    ];

    /// The file looked for: the name cudarc loads for CUDA 13 on Linux.
    pub fn file_name(self) -> &'static str {
        match self {
            CudaLib::Driver => "libcuda.so.1",
            CudaLib::Nvrtc => "libnvrtc.so.13",
            CudaLib::Cublas => "libcublas.so.13",
            CudaLib::Nccl => "libnccl.so",
        }
    }

    /// Where the library usually comes from, and how to point distc at it.
    fn hint(self) -> &'static str {
        match self {
            CudaLib::Driver => {
                "it comes with the NVIDIA driver (CUDA 13.0 or later); on a machine with no \
                 NVIDIA GPU there is none. Put its folder in DISTC_CUDA_LIB_DIR or \
                 LD_LIBRARY_PATH if it is installed somewhere unusual"
            }
            CudaLib::Nvrtc => {
                "install it with `bash scripts/install-nvrtc.sh` (PyPI's nvidia-cuda-nvrtc \
                 13.0.88, into .nvrtc/nvidia/cu13/lib) or use a CUDA 13 toolkit's or PyTorch's \
                 (site-packages/nvidia/cu13/lib), and put that folder in DISTC_CUDA_LIB_DIR \
                 or LD_LIBRARY_PATH"
            }
            CudaLib::Cublas => {
                "it comes with a CUDA 13 toolkit or PyPI's nvidia-cublas wheel \
                 (site-packages/nvidia/cu13/lib, beside libcublasLt.so.13); put that folder \
                 in DISTC_CUDA_LIB_DIR or LD_LIBRARY_PATH"
            }
            CudaLib::Nccl => {
                "it comes with PyPI's nvidia-nccl-cu13 wheel as nvidia/nccl/lib/libnccl.so.2; \
                 cudarc loads `libnccl.so`, so make a libnccl.so symlink to libnccl.so.2 and \
                 put its folder in DISTC_CUDA_LIB_DIR or LD_LIBRARY_PATH"
            }
        }
    }

    /// Whether cudarc's own loader finds the library now.
    fn cudarc_finds(self) -> bool {
        // SAFETY: `is_culib_present` only tries `dlopen` on candidate names and
        // drops what it opened; it calls no function of the library. Loading a
        // library runs its initialisers, which is what loading it for use does too.
        #[allow(unsafe_code)]
        unsafe {
            match self {
                CudaLib::Driver => cudarc::driver::sys::is_culib_present(),
                CudaLib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                CudaLib::Cublas => cudarc::cublas::sys::is_culib_present(),
                CudaLib::Nccl => cudarc::nccl::sys::is_culib_present(),
            }
        }
    }

    /// Libraries in the same folder to load first, so that the library's own
    /// `dlopen` or `NEEDED` lookups of them find them already loaded.
    fn companions(self, dir: &Path) -> Vec<PathBuf> {
        match self {
            // libnvrtc dlopens `libnvrtc-builtins.so.<major>.<minor>` at compile time;
            // missing, compiles fail with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE.
            CudaLib::Nvrtc => {
                let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with("libnvrtc-builtins.so."))
                    })
                    .collect();
                found.sort();
                found
            }
            CudaLib::Cublas => {
                let lt = dir.join("libcublasLt.so.13");
                if lt.exists() {
                    vec![lt]
                } else {
                    Vec::new()
                }
            }
            CudaLib::Driver | CudaLib::Nccl => Vec::new(),
        }
    }
}

impl fmt::Display for CudaLib {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CudaLib::Driver => "CUDA driver",
            CudaLib::Nvrtc => "NVRTC",
            CudaLib::Cublas => "cuBLAS",
            CudaLib::Nccl => "NCCL",
        })
    }
}

/// What can go wrong with CUDA: a missing library or GPU, or a kernel NVRTC refused.
#[derive(Debug, Error)]
pub enum CudaError {
    /// A library is not where distc looked.
    #[error(
        "the {lib} library is missing: {file} was {searched}; {hint}",
        file = lib.file_name(),
        searched = searched_text(searched),
        hint = lib.hint()
    )]
    MissingLibrary {
        /// The library.
        lib: CudaLib,
        /// The folders searched before the dynamic loader's own search.
        searched: Vec<PathBuf>,
    },
    /// The library file is there but the loader refused it.
    #[error("the {lib} library {path} could not be loaded: {message}")]
    LoadFailed {
        /// The library.
        lib: CudaLib,
        /// The file.
        path: PathBuf,
        /// The loader's message.
        message: String,
    },
    /// The driver is there but there is no usable GPU.
    #[error("no usable CUDA GPU: {0}")]
    NoDevice(String),
    /// NVRTC refused the kernel source: the log says where and why.
    #[error("NVRTC could not compile `{name}` for {arch} ({code}):\n{log}")]
    Compile {
        /// The program's name (the file name in the log's locations).
        name: String,
        /// The target, as `sm_90`.
        arch: String,
        /// NVRTC's result code, as `NVRTC_ERROR_COMPILATION`.
        code: String,
        /// NVRTC's log, each error followed by the source line it points at.
        log: String,
    },
    /// An NVRTC call other than the compile itself failed.
    #[error("NVRTC {call} failed for `{name}`: {code}{hint}")]
    Nvrtc {
        /// The program's name.
        name: String,
        /// The NVRTC function.
        call: &'static str,
        /// NVRTC's result code.
        code: String,
        /// What to do about it, when known (starts with "; ").
        hint: String,
    },
    /// The caller asked for something NVRTC cannot do.
    #[error("{0}")]
    Invalid(String),
    /// A graph (or optimizer update) has no CUDA code.
    #[error(transparent)]
    Codegen(#[from] codegen::CodegenError),
    /// A CUDA driver call failed (out of memory, an illegal address in a kernel, ...).
    #[error("CUDA driver call {call} failed: {code}")]
    Driver {
        /// What was being done.
        call: &'static str,
        /// The driver's result code, as `CUDA_ERROR_OUT_OF_MEMORY`.
        code: String,
    },
    /// An NCCL call failed.
    #[error("NCCL call {call} failed: {code}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// NCCL's result, as `ncclInvalidUsage`.
        code: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS call {call} failed: {code}")]
    Cublas {
        /// The cuBLAS function.
        call: &'static str,
        /// cuBLAS's status, as `CUBLAS_STATUS_NOT_SUPPORTED`.
        code: String,
    },
}

// The core knows no device's error type: a CUDA error travels boxed.
impl From<CudaError> for crate::core::backend::KernelError {
    fn from(e: CudaError) -> Self {
        crate::core::backend::KernelError::Device(Box::new(e))
    }
}

impl From<CudaError> for crate::core::error::RuntimeError {
    fn from(e: CudaError) -> Self {
        crate::core::error::RuntimeError::Backend(Box::new(e))
    }
}

/// Turns a failed driver call into a [`CudaError::Driver`] naming the call, for
/// `map_err` in the driver and NCCL files.
fn drv_err(call: &'static str) -> impl Fn(cudarc::driver::result::DriverError) -> CudaError {
    move |e| CudaError::Driver {
        call,
        code: format!("{:?}", e.0),
    }
}

/// Where a missing library was looked for, to follow "`file` was".
fn searched_text(searched: &[PathBuf]) -> String {
    let loader = "by the dynamic loader (LD_LIBRARY_PATH as set when distc started, \
                  the ld.so cache, system folders)";
    if searched.is_empty() {
        format!("not found {loader}, and {LIB_DIR_ENV} is not set")
    } else {
        let dirs: Vec<String> = searched.iter().map(|d| d.display().to_string()).collect();
        format!("found neither in {} nor {loader}", dirs.join(", "))
    }
}

/// Folders searched for CUDA libraries before the dynamic loader's own search.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LibDirs(Vec<PathBuf>);

impl LibDirs {
    /// The folders of `DISTC_CUDA_LIB_DIR` (none when unset or empty).
    pub fn from_env() -> Self {
        match std::env::var_os(LIB_DIR_ENV) {
            Some(v) => LibDirs(
                std::env::split_paths(&v)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect(),
            ),
            None => LibDirs(Vec::new()),
        }
    }

    /// These folders and then `dir`.
    pub fn with(mut self, dir: impl Into<PathBuf>) -> Self {
        self.0.push(dir.into());
        self
    }

    /// The folders, in search order.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.0
    }
}

/// Where a library was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Loaded by full path from this file.
    Path(PathBuf),
    /// Found by the dynamic loader's own search (or loaded earlier in the process).
    Loader,
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Found::Path(p) => write!(f, "{}", p.display()),
            Found::Loader => f.write_str("by the dynamic loader"),
        }
    }
}

/// Libraries loaded by full path, kept loaded for the life of the process so that
/// cudarc's lookups by name find them.
static PINNED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());

fn load_pinned(lib: CudaLib, path: &Path) -> Result<(), CudaError> {
    // SAFETY: loading a CUDA library runs only its initialisers, as loading it for
    // use does; no symbol is looked up or called here. The handle is kept in
    // PINNED, so the library is never unloaded while cudarc holds its functions.
    #[allow(unsafe_code)]
    let loaded = unsafe { libloading::Library::new(path) };
    let loaded = loaded.map_err(|e| CudaError::LoadFailed {
        lib,
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    PINNED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(loaded);
    Ok(())
}

/// Finds `lib` (see the module doc for the order) and makes sure cudarc will load
/// the same file, without calling into the library. A library found in `dirs` is
/// loaded and stays loaded.
pub fn probe(lib: CudaLib, dirs: &LibDirs) -> Result<Found, CudaError> {
    for dir in dirs.dirs() {
        let path = dir.join(lib.file_name());
        if !path.exists() {
            continue;
        }
        for companion in lib.companions(dir) {
            load_pinned(lib, &companion)?;
        }
        load_pinned(lib, &path)?;
        if lib.cudarc_finds() {
            return Ok(Found::Path(path));
        }
        return Err(CudaError::LoadFailed {
            lib,
            path,
            message: "it loads by full path, but cudarc's lookup by name does not find it \
                      (is its soname different from its file name?)"
                .into(),
        });
    }
    if lib.cudarc_finds() {
        Ok(Found::Loader)
    } else {
        Err(CudaError::MissingLibrary {
            lib,
            searched: dirs.dirs().to_vec(),
        })
    }
}

/// Probes every library with the folders of `DISTC_CUDA_LIB_DIR`.
pub fn probe_all() -> Vec<(CudaLib, Result<Found, CudaError>)> {
    let dirs = LibDirs::from_env();
    CudaLib::ALL
        .iter()
        .map(|&lib| (lib, probe(lib, &dirs)))
        .collect()
}

/// The number of CUDA GPUs the driver sees, or why it cannot say: the driver library
/// is probed first (never a panic when it is missing), then `cuInit` and
/// `cuDeviceGetCount` run.
pub fn device_count(dirs: &LibDirs) -> Result<usize, CudaError> {
    probe(CudaLib::Driver, dirs)?;
    match cudarc::driver::CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        // CUDA_ERROR_NO_DEVICE from cuInit: a driver with no GPU behind it.
        Err(e) => Err(CudaError::NoDevice(format!(
            "the CUDA driver says {:?}",
            e.0
        ))),
    }
}

/// A usable GPU: the driver is there and sees at least one device. Returns the
/// device count, or an error naming what is missing.
pub fn require_gpu(dirs: &LibDirs) -> Result<usize, CudaError> {
    match device_count(dirs)? {
        0 => Err(CudaError::NoDevice("the CUDA driver sees no device".into())),
        n => Ok(n),
    }
}

/// The backend of a worker of a distributed plan on GPU `ordinal`: a [`CudaBackend`]
/// joined to an NCCL communicator per mesh axis whose collectives its program (or the
/// one beside it) has
/// (and, for a pipeline stage, one among the stages, for its messages),
/// when `collectives` allows it ([`nccl::bootstrap`] over that axis's host link in
/// `links`), else one whose collectives go through the host. Every worker calls it on
/// its own thread.
pub fn worker_backend(
    site: crate::core::backend::Site<'_>,
    opts: CudaOptions,
    ordinal: usize,
    collectives: nccl::Collectives,
    links: crate::comm::Links<'_>,
) -> Result<CudaBackend, crate::core::error::RuntimeError> {
    let mut backend = CudaBackend::new(ordinal, site.program, opts)?;
    if collectives == nccl::Collectives::Host {
        return Ok(backend);
    }
    // Every rank of an axis holds the same programs, so all of them bootstrap alike.
    // The program beside this one shares its communicators (split from them).
    let has = |model: bool| site.programs().any(|g| backend::has_collectives(g, model));
    use crate::core::axis::Axis;
    let mut links = links;
    // Data, model, then the stages: every rank of the mesh joins them in this order.
    for axis in [Axis::Data, Axis::Model, Axis::Pipe] {
        let Some(comm) = links.take(axis) else {
            continue;
        };
        // Every stage joins, whether or not this program of it sends: the bootstrap is
        // a collective of the stages' link.
        let joins = match axis {
            Axis::Pipe => comm.size() > 1,
            Axis::Data | Axis::Model => has(axis == Axis::Model),
        };
        if joins {
            if let Some(id) = nccl_id(&backend, comm, opts, collectives)? {
                backend.attach_nccl(axis, comm.rank(), comm.size(), id)?;
            }
        }
    }
    Ok(backend)
}

/// The id of the NCCL communicator the ranks of `comm` join, where they can: on the
/// emulator every rank can (its ranks are threads of this process, each with a device
/// of its own), rank 0's id sent to the others; on GPUs as [`nccl::bootstrap`] decides.
fn nccl_id(
    backend: &CudaBackend,
    comm: &mut dyn crate::comm::Communicator,
    opts: CudaOptions,
    collectives: nccl::Collectives,
) -> Result<Option<[u8; 128]>, crate::core::error::RuntimeError> {
    if opts.emulator {
        let mut id = [0u8; 128];
        if comm.rank() == 0 {
            id = emu::nccl::unique_id();
        }
        let mut buf = id.to_vec();
        comm.broadcast(&mut buf, 0)?;
        id.copy_from_slice(&buf);
        return Ok(Some(id));
    }
    let gpu = backend.gpu_uuid()?;
    let id = nccl::bootstrap(comm, collectives, &gpu, &LibDirs::from_env())?;
    Ok(id)
}
