//! CUDA C to CUBIN with NVRTC: needs `libnvrtc.so.13` and its builtins library,
//! no GPU and no driver, so CI compiles every generated kernel.
//!
//! CUBIN, not PTX: PTX from a newer NVRTC can be refused by an older driver, while a
//! CUBIN for the device's architecture (`sm_90` on the H100/H200 machines) loads.

use super::{probe, CudaError, CudaLib, LibDirs};
use cudarc::nvrtc::{result, sys};
use std::ffi::CString;
use std::sync::OnceLock;

/// Whether NVRTC was found once in this process (it then stays loaded).
static READY: OnceLock<()> = OnceLock::new();

/// Makes sure cudarc can load NVRTC, so that no call below panics.
fn ensure_loaded() -> Result<(), CudaError> {
    if READY.get().is_none() {
        probe(CudaLib::Nvrtc, &LibDirs::from_env())?;
        let _ = READY.set(());
    }
    Ok(())
}

/// Checks `arch` names a real architecture (`sm_90`, `sm_90a`): CUBIN needs one.
fn check_arch(arch: &str) -> Result<(), CudaError> {
    let ok = arch.strip_prefix("sm_").is_some_and(|rest| {
        let digits = rest.trim_end_matches(|c: char| c.is_ascii_lowercase());
        !digits.is_empty()
            && digits.chars().all(|c| c.is_ascii_digit())
            && rest.len() - digits.len() <= 1
    });
    if ok {
        Ok(())
    } else {
        Err(CudaError::Invalid(format!(
            "`{arch}` is not a GPU architecture NVRTC can make a CUBIN for: use a real one such as sm_90"
        )))
    }
}

/// Destroys the program however the compile ends.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: self.0 came from nvrtcCreateProgram and is destroyed only here.
        // A failure to free it leaks a little memory; there is nothing else to do.
        #[allow(unsafe_code)]
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn code(e: result::NvrtcError) -> String {
    format!("{:?}", e.0)
}

/// Compiles the CUDA C `source` to a CUBIN for `arch` (as `sm_90`). `name` is the
/// program's name, which NVRTC's messages use as the file name.
///
/// NVRTC is found as [`probe`] finds it, with the folders of `DISTC_CUDA_LIB_DIR`;
/// a missing NVRTC is a [`CudaError::MissingLibrary`], never a panic. A source NVRTC
/// refuses gives [`CudaError::Compile`] carrying NVRTC's log, each located message
/// followed by the source line it points at.
pub fn compile_cubin(source: &str, name: &str, arch: &str) -> Result<Vec<u8>, CudaError> {
    check_arch(arch)?;
    let src = CString::new(source)
        .map_err(|_| CudaError::Invalid(format!("the CUDA source of `{name}` holds a NUL byte")))?;
    let prog_name = CString::new(name)
        .map_err(|_| CudaError::Invalid(format!("the program name {name:?} holds a NUL byte")))?;
    ensure_loaded()?;
    let nvrtc_err = |call: &'static str, e: result::NvrtcError| CudaError::Nvrtc {
        name: name.to_string(),
        call,
        code: code(e),
        hint: String::new(),
    };

    // `src` and `prog_name` outlive `prog` (dropped first, in reverse order).
    let prog = Program(
        result::create_program(&src, Some(&prog_name))
            .map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?,
    );
    let options = [format!("--gpu-architecture={arch}")];
    // SAFETY: prog.0 is a live program from nvrtcCreateProgram (destroyed on drop).
    #[allow(unsafe_code)]
    let compiled = unsafe { result::compile_program(prog.0, &options) };
    if let Err(e) = compiled {
        if e.0 == sys::nvrtcResult::NVRTC_ERROR_BUILTIN_OPERATION_FAILURE {
            return Err(CudaError::Nvrtc {
                name: name.to_string(),
                call: "nvrtcCompileProgram",
                code: code(e),
                hint: "; NVRTC could not load its builtins library (libnvrtc-builtins.so.13.*), \
                       which must sit beside libnvrtc.so.13: put that folder in \
                       DISTC_CUDA_LIB_DIR, or in LD_LIBRARY_PATH before distc starts"
                    .into(),
            });
        }
        // SAFETY: prog.0 is live; the log is read before the program is destroyed.
        #[allow(unsafe_code)]
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|raw| c_chars_to_string(&raw))
            .unwrap_or_else(|le| format!("(NVRTC gave no log: {})", code(le)));
        return Err(CudaError::Compile {
            name: name.to_string(),
            arch: arch.to_string(),
            code: code(e),
            log: annotate_log(&log, name, source),
        });
    }

    let mut size = 0usize;
    // SAFETY: prog.0 was compiled successfully; `size` is a valid out pointer.
    #[allow(unsafe_code)]
    unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
    if size == 0 {
        return Err(CudaError::Invalid(format!(
            "NVRTC made no CUBIN for `{name}` ({arch}): is it a real architecture?"
        )));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` holds the `size` bytes nvrtcGetCUBINSize asked for.
    #[allow(unsafe_code)]
    unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
    Ok(cubin)
}

/// NVRTC's log bytes (NUL-terminated) as text.
fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).trim_end().to_string()
}

/// After each log line located as `name(LINE): ...`, the source line it points at,
/// unless NVRTC quotes that line itself on the next line (NVRTC 13 does, with a caret
/// under the column).
fn annotate_log(log: &str, name: &str, source: &str) -> String {
    let src: Vec<&str> = source.lines().collect();
    let log_lines: Vec<&str> = log.lines().collect();
    let mut out = String::new();
    for (i, line) in log_lines.iter().enumerate() {
        out.push_str(line);
        out.push('\n');
        let located = line
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix('('))
            .and_then(|rest| rest.split_once(')'))
            .and_then(|(n, _)| n.parse::<usize>().ok());
        let Some(n) = located else { continue };
        let Some(text) = n.checked_sub(1).and_then(|k| src.get(k)) else {
            continue;
        };
        let quoted = log_lines
            .get(i + 1)
            .is_some_and(|next| next.trim() == text.trim());
        if !quoted {
            out.push_str(&format!("  {n:>4} | {}\n", text.trim_end()));
        }
    }
    out.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert!(check_arch("sm_90").is_ok());
        assert!(check_arch("sm_90a").is_ok());
        assert!(check_arch("sm_100").is_ok());
        for bad in ["compute_90", "sm_", "90", "sm_9x0", "sm_90ab", ""] {
            assert!(check_arch(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn log_lines_get_their_source_line() {
        let src = "int a;\nint b = c;\n";
        let log = "k.cu(2): error: identifier \"c\" is undefined\n\n1 error detected";
        let out = annotate_log(log, "k.cu", src);
        assert_eq!(
            out,
            "k.cu(2): error: identifier \"c\" is undefined\n     2 | int b = c;\n\n1 error detected"
        );
        // Quoted by NVRTC already: not repeated.
        let quoted = "k.cu(2): error: identifier \"c\" is undefined\n  int b = c;\n          ^";
        assert_eq!(annotate_log(quoted, "k.cu", src), quoted);
    }
}
