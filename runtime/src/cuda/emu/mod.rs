//! The GPU emulator's kernels (issue 21): the CUDA C a plan generates, compiled by the
//! system C++ compiler with `cuda_emu.h`, which gives CUDA's built-ins their meaning on
//! a CPU, into a shared library loaded at run time.
//!
//! A launch runs every block of the grid in turn; each CUDA thread of a block is a
//! fiber with a stack of its own, so `__syncthreads` is a real barrier over the block
//! and `__shfl_xor_sync` / `__ballot_sync` exchange values between the 32 lanes of a
//! warp as on a GPU. Arguments are passed as `cuLaunchKernel` takes them: one pointer
//! per parameter, to a value of the parameter's own type, so a wrong argument gives a
//! wrong result here too. A barrier some threads of a block never reach is reported
//! by name instead of hanging.
//!
//! What this cannot show: speed, memory ordering between blocks running at once (they
//! run one after another), and anything the hardware or driver does on its own.

// Loading a compiled library and calling into it is FFI: each unsafe block says why it
// holds.
#![allow(unsafe_code)]

pub mod blas;
pub mod device;
pub mod driver;
pub mod nccl;

pub use driver::EmuDriver;

use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use thiserror::Error;

/// The header every emulated translation unit is compiled with.
pub const HEADER: &str = include_str!("cuda_emu.h");

/// What went wrong compiling or running an emulated kernel.
#[derive(Debug, Error)]
pub enum EmuError {
    /// The C++ compiler could not be run, or refused the source.
    #[error("compiling the kernels for the GPU emulator with `{compiler}`: {message}")]
    Compile {
        /// The compiler run.
        compiler: String,
        /// Its message (the first lines of its log).
        message: String,
    },
    /// The compiled library could not be loaded, or lacks a kernel.
    #[error("loading the emulated kernels: {0}")]
    Load(String),
    /// A launch failed (a bad geometry, a barrier not every thread reached).
    #[error("kernel `{kernel}` (grid {grid:?}, block {block:?}): {message}")]
    Launch {
        /// The kernel.
        kernel: String,
        /// Its grid.
        grid: [u32; 3],
        /// Its block.
        block: [u32; 3],
        /// What went wrong.
        message: String,
    },
}

type LaunchFn = unsafe extern "C" fn(*const u32, *const u32, *mut *mut c_void) -> *const c_char;

/// The functions of `source` that need their threads as fibers: those that use a
/// barrier, a warp exchange or shared memory, or call a function that does. The rest
/// run as a plain loop over their threads, which is far faster (no context switch per
/// thread). A function is a top-level `name(...) { ... }`; a call is its name followed
/// by `(` in a body. Should the analysis miss one, the plain loop reports the barrier
/// it reaches instead of running it.
pub fn needs_fibers(source: &str) -> std::collections::HashSet<String> {
    const MARKS: [&str; 5] = [
        "__syncthreads",
        "__shfl",
        "__ballot_sync",
        "__shared__",
        "__syncwarp",
    ];
    let bodies = functions(source);
    let mut marked: std::collections::HashSet<String> = bodies
        .iter()
        .filter(|(_, body)| MARKS.iter().any(|m| body.contains(m)))
        .map(|(name, _)| name.clone())
        .collect();
    loop {
        let before = marked.len();
        for (name, body) in &bodies {
            if !marked.contains(name) && marked.iter().any(|m| calls(body, m)) {
                marked.insert(name.clone());
            }
        }
        if marked.len() == before {
            return marked;
        }
    }
}

/// Whether `body` calls `name`: the name as a whole identifier followed by `(`.
fn calls(body: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    body.match_indices(name).any(|(at, _)| {
        let before = body[..at].chars().next_back().is_none_or(|c| !ident(c));
        let after = body[at + name.len()..].trim_start();
        before && (after.starts_with('(') || after.starts_with('<'))
    })
}

/// The top-level functions of C source: name and body.
fn functions(source: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let (mut depth, mut head_start, mut body_start) = (0usize, 0usize, 0usize);
    let mut name = None;
    for (i, c) in source.char_indices() {
        match c {
            '{' => {
                if depth == 0 {
                    let head = &source[head_start..i];
                    name = head.find('(').map(|p| {
                        let before = head[..p].trim_end();
                        let start = before
                            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                            .map_or(0, |k| k + 1);
                        before[start..].to_string()
                    });
                    body_start = i + 1;
                }
                depth += 1;
            }
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    if let Some(n) = name.take() {
                        out.push((n, source[body_start..i].to_string()));
                    }
                    head_start = i + 1;
                }
            }
            ';' if depth == 0 => head_start = i + 1,
            _ => {}
        }
    }
    out
}

/// One translation unit's kernels, compiled for the CPU. Identical units share one
/// loaded library: its state is all thread-local (a block's shared memory, its
/// fibers), so two contexts launching from their own threads cannot see each other.
#[derive(Debug, Clone)]
pub struct EmuModule {
    lib: std::sync::Arc<libloading::Library>,
}

/// Where compiled units are kept across processes: `DISTC_EMU_CACHE`, when set (CI
/// points it into its scratch folder). Unset, nothing is written outside each compile's
/// own scratch folder.
pub const CACHE_ENV: &str = "DISTC_EMU_CACHE";

/// The flags every unit is compiled with (part of a unit's identity).
const FLAGS: [&str; 6] = ["-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-include"];

/// Units compiled (or found in the cache) by this process, by their text's hash: the
/// text itself is kept to tell a collision from a hit.
type Loaded = std::collections::HashMap<u64, Vec<(String, EmuModule)>>;

fn loaded() -> &'static std::sync::Mutex<Loaded> {
    static LOADED: std::sync::OnceLock<std::sync::Mutex<Loaded>> = std::sync::OnceLock::new();
    LOADED.get_or_init(Default::default)
}

/// A unit's identity: the compiler, its flags, the header and the unit's text.
fn unit_key(cxx: &str, text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same in every process of this build, so the key
    // names a cache file as well as a map entry.
    let mut h = std::hash::DefaultHasher::new();
    (cxx, FLAGS, HEADER, text).hash(&mut h);
    h.finish()
}

/// The C++ compiler: `CXX`, else `c++`.
fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".into())
}

/// A fresh scratch folder for one compile, removed once the library is loaded.
fn scratch() -> std::io::Result<PathBuf> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "distc-emu-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The translation unit of `source`: the source, then a launcher for each of
/// `kernels` (fibers where a kernel needs them).
fn unit_text(source: &str, kernels: &[&str]) -> String {
    let mut text = String::with_capacity(source.len() + 64 * kernels.len());
    text.push_str(source);
    text.push('\n');
    let fibers = needs_fibers(source);
    for k in kernels {
        if fibers.contains(*k) {
            text.push_str(&format!("DISTC_EMU_EXPORT({k})\n"));
        } else {
            text.push_str(&format!("DISTC_EMU_EXPORT_PLAIN({k})\n"));
        }
    }
    text
}

/// Loads a compiled unit.
fn load(lib: &Path) -> Result<EmuModule, EmuError> {
    // SAFETY: the library was compiled from our own source (just now, or into the
    // cache by an earlier run of this build); loading it runs no initialisers beyond
    // the C++ runtime's.
    let lib =
        unsafe { libloading::Library::new(lib) }.map_err(|e| EmuError::Load(e.to_string()))?;
    Ok(EmuModule {
        lib: std::sync::Arc::new(lib),
    })
}

/// The cache folder, when `DISTC_EMU_CACHE` names one.
fn cache_dir() -> Option<PathBuf> {
    std::env::var_os(CACHE_ENV).map(PathBuf::from)
}

/// The cache's files of unit `key`: the library and the text it was compiled from.
fn cache_files(dir: &Path, key: u64) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{key:016x}.so")),
        dir.join(format!("{key:016x}.cpp")),
    )
}

/// The cached library of unit `key`, if the cache holds one compiled from `text`.
fn cached(dir: &Path, key: u64, text: &str) -> Option<EmuModule> {
    let (lib, unit) = cache_files(dir, key);
    if std::fs::read_to_string(&unit).ok()? != text {
        return None;
    }
    load(&lib).ok()
}

/// The header in the cache folder beside its precompiled form (`cuda_emu.h.gch`, which
/// the compiler takes in place of the text it was built from), built by the first
/// process that needs it: parsing the header was most of a small unit's compile. A
/// folder per compiler, flags and header, renamed into place whole, so a reader never
/// sees half of one. None where it cannot be built: units then include the text.
fn precompiled_header(cache: &Path, cxx: &str) -> Option<PathBuf> {
    // The key of an empty unit: it changes with the compiler, its flags and the header.
    let key = unit_key(cxx, "");
    let folder = cache.join(format!("header-{key:016x}"));
    let header = folder.join("cuda_emu.h");
    if folder.join("cuda_emu.h.gch").is_file() {
        return Some(header);
    }
    // One builder a process: test threads compiling at once would share the side
    // folder, and two compilers writing one `.gch` leave one no compiler can read.
    static BUILDING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|p| p.into_inner());
    if folder.join("cuda_emu.h.gch").is_file() {
        return Some(header);
    }
    let side = cache.join(format!("header-{key:016x}.{}.part", std::process::id()));
    // A folder left by an earlier process of this id, stopped halfway.
    let _ = std::fs::remove_dir_all(&side);
    let built = std::fs::create_dir_all(&side).is_ok()
        && std::fs::write(side.join("cuda_emu.h"), HEADER).is_ok()
        && Command::new(cxx)
            .args(
                FLAGS
                    .iter()
                    .filter(|f| !matches!(**f, "-shared" | "-include")),
            )
            .args(["-x", "c++-header"])
            .arg(side.join("cuda_emu.h"))
            .arg("-o")
            .arg(side.join("cuda_emu.h.gch"))
            .output()
            .is_ok_and(|o| o.status.success());
    // Another process may have renamed its own folder into place first.
    let placed = built && std::fs::rename(&side, &folder).is_ok();
    if !placed {
        let _ = std::fs::remove_dir_all(&side);
    }
    folder.join("cuda_emu.h.gch").is_file().then_some(header)
}

/// Keeps a compiled unit in the cache, when there is one: written beside and renamed
/// into place, so a reader never sees half a file. A cache that cannot be written
/// only costs the next compile.
fn store(dir: &Path, key: u64, text: &str, lib: &Path) {
    let (to_lib, to_unit) = cache_files(dir, key);
    let side = |to: &Path| {
        let name = to.file_name().map(|n| n.to_string_lossy().into_owned());
        to.with_file_name(format!(
            "{}.{}.part",
            name.unwrap_or_default(),
            std::process::id()
        ))
    };
    let (lib_side, unit_side) = (side(&to_lib), side(&to_unit));
    let _ = to_lib
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::copy(lib, &lib_side))
        .and_then(|_| std::fs::rename(&lib_side, &to_lib))
        .and_then(|()| std::fs::write(&unit_side, text))
        .and_then(|()| std::fs::rename(&unit_side, &to_unit));
}

impl EmuModule {
    /// Whether `self` and `other` run from one loaded library (one compile).
    pub fn shares_library(&self, other: &EmuModule) -> bool {
        std::sync::Arc::ptr_eq(&self.lib, &other.lib)
    }

    /// Compiles `source` (CUDA C as NVRTC would get it) with a launcher for each of
    /// `kernels`, and loads it.
    pub fn compile(source: &str, kernels: &[&str]) -> Result<EmuModule, EmuError> {
        let cxx = compiler();
        let text = unit_text(source, kernels);
        let key = unit_key(&cxx, &text);
        let same = |entries: &Vec<(String, EmuModule)>| {
            entries
                .iter()
                .find(|(t, _)| *t == text)
                .map(|(_, m)| m.clone())
        };
        if let Some(m) = loaded()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
            .and_then(same)
        {
            return Ok(m);
        }
        let cache = cache_dir();
        let module = match cache.as_deref().and_then(|d| cached(d, key, &text)) {
            Some(m) => m,
            None => {
                let fail = |message: String| EmuError::Compile {
                    compiler: cxx.clone(),
                    message,
                };
                let dir = scratch().map_err(|e| fail(format!("a scratch folder: {e}")))?;
                let result =
                    Self::compile_in(&dir, &cxx, &text, cache.as_deref().map(|d| (d, key)));
                let _ = std::fs::remove_dir_all(&dir);
                result?
            }
        };
        loaded()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default()
            .push((text, module.clone()));
        Ok(module)
    }

    /// Compiles `text` in the scratch folder `dir` and loads it; kept in the cache
    /// folder under its key, when there is one.
    fn compile_in(
        dir: &Path,
        cxx: &str,
        text: &str,
        cache: Option<(&Path, u64)>,
    ) -> Result<EmuModule, EmuError> {
        let fail = |message: String| EmuError::Compile {
            compiler: cxx.to_string(),
            message,
        };
        let header = match cache.and_then(|(to, _)| precompiled_header(to, cxx)) {
            Some(shared) => shared,
            None => {
                let header = dir.join("cuda_emu.h");
                std::fs::write(&header, HEADER).map_err(|e| fail(e.to_string()))?;
                header
            }
        };
        let unit = dir.join("kernels.cpp");
        let lib = dir.join("kernels.so");
        std::fs::write(&unit, text).map_err(|e| fail(e.to_string()))?;
        let out = Command::new(cxx)
            .args(FLAGS)
            .arg(&header)
            .arg(&unit)
            .arg("-o")
            .arg(&lib)
            .output()
            .map_err(|e| fail(format!("cannot run it: {e}")))?;
        if !out.status.success() {
            let log = String::from_utf8_lossy(&out.stderr);
            let head: Vec<&str> = log.lines().take(20).collect();
            return Err(fail(head.join("\n")));
        }
        if let Some((to, key)) = cache {
            store(to, key, text, &lib);
        }
        load(&lib)
    }

    /// Launches `kernel` over `grid` blocks of `block` threads; `args` holds one pointer
    /// per kernel parameter, to a value of that parameter's type (as `cuLaunchKernel`).
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in number and types, and every device
    /// pointer among them must point to memory the kernel may use as it does.
    pub unsafe fn launch(
        &self,
        kernel: &str,
        grid: [u32; 3],
        block: [u32; 3],
        args: &mut [*mut c_void],
    ) -> Result<(), EmuError> {
        let fail = |message: String| EmuError::Launch {
            kernel: kernel.to_string(),
            grid,
            block,
            message,
        };
        if grid.contains(&0) {
            return Err(fail("a grid with a zero dimension".into()));
        }
        let symbol = format!("distc_emu_launch_{kernel}");
        // SAFETY: every exported launcher has this signature (DISTC_EMU_EXPORT).
        let f: libloading::Symbol<LaunchFn> = unsafe { self.lib.get(symbol.as_bytes()) }
            .map_err(|_| EmuError::Load(format!("no kernel `{kernel}` in the module")))?;
        // SAFETY: the caller vouches for the arguments; the launcher reads three
        // dimensions from each array.
        let err = unsafe { f(grid.as_ptr(), block.as_ptr(), args.as_mut_ptr()) };
        if err.is_null() {
            Ok(())
        } else {
            // SAFETY: the launcher returns a static C string.
            let message = unsafe { CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned();
            Err(fail(message))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNIT: &str = "__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }";

    #[test]
    fn a_unit_compiled_twice_is_compiled_once() {
        let a = EmuModule::compile(UNIT, &["twice"]).expect("compiles");
        let b = EmuModule::compile(UNIT, &["twice"]).expect("compiles");
        assert!(a.shares_library(&b));
        let other =
            EmuModule::compile(&format!("{UNIT}\n// another unit"), &["twice"]).expect("compiles");
        assert!(!a.shares_library(&other));
    }

    #[test]
    fn the_cache_gives_back_only_the_unit_it_was_given() {
        let dir = scratch().expect("a scratch folder");
        let cache = dir.join("cache");
        let text = unit_text(UNIT, &["twice"]);
        let key = unit_key(&compiler(), &text);
        assert!(cached(&cache, key, &text).is_none(), "an empty cache hit");
        let work = dir.join("work");
        std::fs::create_dir_all(&work).expect("a folder");
        EmuModule::compile_in(&work, &compiler(), &text, Some((&cache, key))).expect("compiles");
        assert!(
            cached(&cache, key, &text).is_some(),
            "the stored unit is not found"
        );
        // Another text under the same key (a collision, or a changed header) misses.
        assert!(cached(&cache, key, &format!("{text} ")).is_none());
        // The header was precompiled once, into a folder of its own, and a unit compiled
        // against it runs.
        let headers: Vec<PathBuf> = std::fs::read_dir(&cache)
            .expect("the cache")
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("cuda_emu.h.gch").is_file())
            .collect();
        assert_eq!(headers.len(), 1, "{headers:?}");
        let text = unit_text(
            &format!("{UNIT}\n// against the precompiled header"),
            &["twice"],
        );
        let m = EmuModule::compile_in(&work, &compiler(), &text, Some((&cache, key + 1)))
            .expect("compiles");
        let mut x = vec![1.5f32, -2.0, 3.0];
        let mut xp = x.as_mut_ptr();
        let mut args = [(&mut xp as *mut *mut f32).cast::<c_void>()];
        // SAFETY: the one argument is a pointer to 3 floats, one a thread.
        unsafe { m.launch("twice", [1, 1, 1], [3, 1, 1], &mut args) }.expect("runs");
        assert_eq!(x, [3.0, -4.0, 6.0]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Threads compiling at once into a fresh cache (as a test binary's threads do)
    /// build the header once between them, and every unit compiles: two compilers
    /// writing one shared `.gch` had left one that no compile could read.
    #[test]
    fn threads_compiling_at_once_share_one_precompiled_header() {
        let dir = scratch().expect("a scratch folder");
        let cache = dir.join("cache");
        std::thread::scope(|scope| {
            for k in 0..3u64 {
                let (dir, cache) = (&dir, &cache);
                scope.spawn(move || {
                    let work = dir.join(format!("work{k}"));
                    std::fs::create_dir_all(&work).expect("a folder");
                    let text = unit_text(&format!("{UNIT}\n// unit {k}"), &["twice"]);
                    let key = unit_key(&compiler(), &text);
                    EmuModule::compile_in(&work, &compiler(), &text, Some((cache, key)))
                        .unwrap_or_else(|e| panic!("unit {k}: {e}"));
                });
            }
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
