//! The CLI's output. `println!` and `eprintln!` panic when their stream is closed
//! (`distc bench | head -c 10`, `distc compile ... 2>&1 | head`); everything distc
//! prints goes through here instead. A closed standard output ends distc quietly with
//! status 0, as it ends a Unix tool, once nothing more can be shown; a closed standard
//! error drops the message (what it said is a report, not a result).

use std::io::Write;

/// Writes `text` to standard output.
pub fn out(text: &str) {
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        err(&format!("error: cannot write to standard output: {e}\n"));
        std::process::exit(1);
    }
}

/// Writes `text` to standard error; a closed or failing stream drops it.
pub fn err(text: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr
        .write_all(text.as_bytes())
        .and_then(|()| stderr.flush());
}
