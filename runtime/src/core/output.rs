//! Writing a user's output files without harming anything else.
//!
//! Every file distc writes whole (plans, checkpoints, traces, benchmark tables) goes
//! through [`write_atomic`]: the content goes to a temporary file beside the target,
//! which is then renamed onto it, so a reader never sees half a file. A rename
//! replaces whatever is at the target, so first [`check_output`] refuses a target that
//! exists and is not a regular file (`/dev/null` renamed over by root becomes a
//! regular file) and a target that is one of the command's inputs (`-o model.dsl`).
//!
//! A process killed while writing leaves its temporary file behind. Temporary files
//! are named `.NAME.distc-tmp-PID`, so the next write of the same target removes those
//! whose process is gone; a process stopped by a signal it handles removes its own
//! first ([`stop_writes`]).

use crate::core::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};

fn refuse(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Data {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The same file, whether or not either path exists yet: by identity (device and
/// inode, links followed: a hard link or a symbolic one is the file) when both exist,
/// else the absolute paths compared as written.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => std::path::absolute(a).ok() == std::path::absolute(b).ok(),
    }
}

/// Refuses an output target that exists and is not a regular file (a device, a
/// directory, a pipe) or that names one of `inputs`, or whose folder cannot be written.
pub fn check_output(path: &Path, inputs: &[&Path]) -> Result<()> {
    check_target(path, inputs)?;
    probe_writable(path)
}

/// [`check_output`] short of the probe: [`write_atomic`] finds out whether the folder
/// takes a file by making its own temporary file there.
fn check_target(path: &Path, inputs: &[&Path]) -> Result<()> {
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            let what = if meta.is_dir() {
                "a directory"
            } else {
                "not a regular file (a device, a pipe or a socket)"
            };
            return Err(refuse(
                path,
                format!("refusing to write here: it is {what}; give the path of a file"),
            ));
        }
    }
    for input in inputs {
        if same_file(path, input) {
            return Err(refuse(
                path,
                "refusing to overwrite an input of this command; write the output elsewhere",
            ));
        }
    }
    Ok(())
}

/// Fails now, not after training, where `path` could not be written: its folder is
/// made (as the write would make it) and a probe file is created in it and removed.
fn probe_writable(path: &Path) -> Result<()> {
    let (tmp, _) = temp_path(path)?;
    let dir = tmp.parent().unwrap_or(Path::new("."));
    make_folder(path, dir)?;
    let probe = dir.join(format!(
        "{}.probe",
        tmp.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    // In flight like a write's temporary file, so a signal's handler removes it too.
    create_in_flight(path, dir, &probe, |p| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(p)
    })?;
    let _ = std::fs::remove_file(&probe);
    in_flight().retain(|p| p != &probe);
    Ok(())
}

/// Makes `dir`, the folder `path` is written into, refusing `path` where it cannot.
fn make_folder(path: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| {
        refuse(
            path,
            format!("cannot make its folder {}: {e}", dir.display()),
        )
    })
}

/// Creates `file` (with `open`) in `dir`, the folder of `path`, listed in flight under
/// one lock: a signal's handler that holds it (see [`stop_writes`]) sees every
/// temporary file that exists, and no other is made. The caller takes it off the list.
fn create_in_flight(
    path: &Path,
    dir: &Path,
    file: &Path,
    open: impl FnOnce(&Path) -> std::io::Result<std::fs::File>,
) -> Result<std::fs::File> {
    let mut files = in_flight();
    let made =
        open(file).map_err(|e| refuse(path, format!("cannot write in {}: {e}", dir.display())))?;
    files.push(file.to_path_buf());
    Ok(made)
}

/// Checks a set of outputs against the inputs and against each other.
pub fn check_outputs(outputs: &[&Path], inputs: &[&Path]) -> Result<()> {
    for (i, out) in outputs.iter().enumerate() {
        check_output(out, inputs)?;
        if let Some(other) = outputs[..i].iter().find(|o| same_file(o, out)) {
            return Err(refuse(
                out,
                format!("is also given as another output ({})", other.display()),
            ));
        }
    }
    Ok(())
}

/// The temporary file beside `path` that [`write_atomic`] uses in this process.
fn temp_path(path: &Path) -> Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .ok_or_else(|| refuse(path, "not a file name"))?
        .to_string_lossy()
        .into_owned();
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let prefix = format!(".{name}.distc-tmp-");
    Ok((
        parent.join(format!("{prefix}{}", std::process::id())),
        prefix,
    ))
}

/// Whether process `pid` is running: it exists and is not a zombie (a killed writer
/// whose parent has not reaped it yet still has a `/proc` entry, in state `Z`).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) state ...`: comm may hold spaces and parentheses, so the state is
        // the first field after the last `)`.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Removes temporary files of `prefix` in `dir` left by processes that are gone.
fn remove_stale(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(prefix)
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !process_alive(pid) && pid != std::process::id() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Writes `path` through a temporary file renamed into place; `write` fills the
/// temporary file, which is synced before the rename. Checks the target as
/// [`check_output`] (no inputs) does first.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<()> {
    check_target(path, &[])?;
    let (tmp, prefix) = temp_path(path)?;
    let dir = tmp.parent().map(Path::to_path_buf).unwrap_or_default();
    make_folder(path, &dir)?;
    remove_stale(&dir, &prefix);
    let file = create_in_flight(path, &dir, &tmp, |p| std::fs::File::create(p));
    let io = |source| RuntimeError::Io {
        path: tmp.clone(),
        source,
    };
    let result = file
        .and_then(|mut f| write(&mut f).and_then(|()| f.sync_all()).map_err(io))
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|source| RuntimeError::Io {
                path: path.to_path_buf(),
                source,
            })
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    in_flight().retain(|p| p != &tmp);
    result
}

/// The temporary files this process is writing now.
fn in_flight() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    static FILES: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    FILES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes stopped for good, for a process about to exit in the middle of them (a
/// signal's handler; the training threads go on meanwhile): the temporary files in
/// flight are removed, so what they were to replace stays as it was, and no write
/// starts until the process is gone, however long the handler takes before
/// [`StoppedWrites::exit`] (mpirun may kill the process while it waits: nothing is
/// left behind then either). A write in flight goes on into its removed file, and its
/// rename fails.
pub fn stop_writes() -> StoppedWrites {
    let files = in_flight();
    for tmp in files.iter() {
        let _ = std::fs::remove_file(tmp);
    }
    StoppedWrites(files)
}

/// See [`stop_writes`].
pub struct StoppedWrites(#[allow(dead_code)] std::sync::MutexGuard<'static, Vec<PathBuf>>);

impl StoppedWrites {
    /// Exits with `code`, writes still stopped.
    pub fn exit(self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// [`write_atomic`] of bytes.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic(path, |f| std::io::Write::write_all(f, bytes))
}

/// Reads a whole input file (a model, a plan, a metrics file, a checkpoint, a data
/// file), refusing what is not a regular file (`/dev/zero`, a FIFO: they never end or
/// never answer) and a file above `limit` bytes, and reading no more than the size
/// the file had when opened.
pub fn read_regular(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    // Looked at before opening: opening a FIFO blocks until a writer comes.
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            if meta.is_dir() {
                "it is a directory, not a file"
            } else {
                "not a regular file (a device, a pipe or a socket)"
            },
        ));
    }
    if meta.len() > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "{} bytes, more than the {limit} this input may have",
                meta.len()
            ),
        ));
    }
    let f = std::fs::File::open(path)?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    f.take(meta.len()).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_text(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_regular(path, limit)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.utf8_error()))
}

/// The most a model, plan or metrics file distc reads may hold.
pub const TEXT_INPUT_LIMIT: u64 = 1 << 30;
