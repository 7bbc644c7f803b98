//! Fuzzing (issue 20): a seeded mutation fuzzer over what distc reads from outside —
//! DSL text, plan JSON, checkpoint files, command lines, `simulate`'s calibrations
//! and traces, data files, `--init` weights and sharded states — for a bounded time. No input may panic or hang; refusing it with an error is what distc should do.
//!
//! Each target starts from a seed corpus of the repository's own files (`examples/`,
//! `tests/models/`, `compiler/tests/bad_dsl/`, `compiler/tests/fuzz/`) and of files made
//! at run time (plans by `distc compile`, checkpoints and metrics by `distc train`), and
//! feeds the code mutated copies of them: byte flips, inserts, deletes, splices between
//! corpus entries, and token-aware replacements (numbers swapped for extreme values,
//! names for other names, lines deleted, duplicated or swapped, JSON values replaced,
//! dropped or retyped). Plans mutated below the JSON get their content hash recomputed,
//! so the mutation reaches the IR parser and verifier instead of stopping at the hash.
//!
//! - `dsl`: `distc::compile` under several strategies and flags, then the error's
//!   rendering (plain and miette), or the plan written and read back, which must give
//!   the same plan: a plan `distc compile` writes is one `distc run` and `distc
//!   explain` read. In this process.
//! - `plan`: `Plan::load` on a mutated plan file, in this process.
//! - `checkpoint`: `checkpoint::load` and `checkpoint::load_state`, in this process.
//! - `cli`: the `distc` binary on mutated command lines (compile, train, run, verify,
//!   explain, ir, dot, plot, bench) in a fresh temporary folder, sometimes with one of
//!   its input files mutated; it must exit with 0, 1 or 2 within the time limit and
//!   never print a panic.
//! - `simulate`: a calibration (`distc calibrate -o`) and a trace (`distc train
//!   --trace`), mutated, read as `distc simulate` reads them, in this process; one it
//!   accepts is simulated, and must give finite times.
//! - `data_files`: the data a user brings (issue 60): a safetensors file, a folder of
//!   `.npy` arrays, a CSV table and a token file, each mutated byte by byte or in its
//!   structure (a CSV cell set to NaN, a label past the classes, a `.npy` header's
//!   order, type or shape, a token id past the table), opened in this process as
//!   `distc train` opens them and checked against their model. What it accepts must
//!   be trainable: a drawn batch with a non-finite value or an id outside the rows the
//!   model indexes is an input that trains silently wrong, a failure.
//! - `init_files`: `--init` weights (issue 60): a safetensors file of a model's
//!   variables (batch norm's running statistics and PyTorch's `num_batches_tracked`
//!   among them), mutated in its structure (a tensor as another dtype, an f64 beyond
//!   f32, NaN, a negative running variance, another shape, another name, one dropped or
//!   added) or byte by byte, read into the model as `distc train --init` reads it, with
//!   and without `--init-partial`. What it accepts must be what the model trains from:
//!   every variable of the model's type, finite, a running variance not below 0.
//! - `sharded_states`: `--resume DIR` of a sharded state (issue 60) that `distc train
//!   --sharded` wrote (ZeRO-3 on a model axis, and pipeline stages): its manifest's
//!   text or values (some rewritten with their digest, as a deliberate edit would be),
//!   a shard's header or values (their checksums fixed), a shard removed, cut, swapped,
//!   copied over another or taken from another run. Read and checked against the model
//!   as a resume is; what it accepts after damage must be the state written, after a
//!   rewrite of values the same names and types, and any accepted state must name in
//!   its index what it holds.
//!
//! Besides panics and hangs, an input fails when distc contradicts itself: an error
//! that calls itself an `internal error`, or a compiled plan that does not load. In-process
//! inputs run on a thread of their own, timed: one that takes longer than the hang
//! limit is a hang. The settings come from the environment:
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `DISTC_FUZZ_SECS` | seconds per target | 5 (unless `DISTC_FUZZ_RUNS` is set) |
//! | `DISTC_FUZZ_RUNS` | inputs per target (with `DISTC_FUZZ_SECS`, whichever ends first) | none |
//! | `DISTC_FUZZ_SEED` | the seed; every input is derived from it and its index | 7 |
//! | `DISTC_FUZZ_ONLY` | run only the input of this index (reproduces a failure) | none |
//! | `DISTC_FUZZ_HANG_SECS` | an input running longer than this is a hang | 30 |
//! | `DISTC_FUZZ_VERBOSE` | print every input's outcome (what was mutated; the error) | off |
//!
//! Each target prints `fuzz NAME: N inputs, P panics, H hangs (seed S, T s; ...)`
//! (with `, F other failures` after the hangs when there are any). A
//! failing input is printed and saved under `target/tmp/fuzz-failures/`, with the
//! command that runs it alone. While an in-process target runs, the input it is on is
//! in `target/tmp/fuzz-current-NAME` (removed at the end), so an input that aborts the
//! process (not a panic: an allocation failure, a stack overflow) can be found.

use distc::{compile, CompileOptions, Plan};
use distc_passes::placement::{Precision, RematPolicy, Strategy, StrategyConfig, SyncMode};
use distc_runtime::core::checkpoint;
use serde_json::Value;
use std::cell::RefCell;
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::process::CommandExt;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tempfile::TempDir;

// ---------------------------------------------------------------------------------
// Settings, the random numbers, the driver.
// ---------------------------------------------------------------------------------

struct Settings {
    seed: u64,
    secs: Option<f64>,
    runs: Option<u64>,
    only: Option<u64>,
    hang: Duration,
    verbose: bool,
}

fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    let text = std::env::var(name).ok()?;
    match text.trim().parse() {
        Ok(v) => Some(v),
        Err(_) => panic!("{name}={text:?} is not a number"),
    }
}

fn settings() -> Settings {
    let runs = env_num::<u64>("DISTC_FUZZ_RUNS");
    let secs = env_num::<f64>("DISTC_FUZZ_SECS").or(if runs.is_some() { None } else { Some(5.0) });
    Settings {
        seed: env_num("DISTC_FUZZ_SEED").unwrap_or(7),
        secs,
        runs,
        only: env_num("DISTC_FUZZ_ONLY"),
        hang: Duration::from_secs_f64(env_num("DISTC_FUZZ_HANG_SECS").unwrap_or(30.0)),
        verbose: std::env::var_os("DISTC_FUZZ_VERBOSE").is_some_and(|v| v != "0"),
    }
}

/// SplitMix64: small, fast, and the same everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The generator of input `index` of `target`: inputs do not depend on each other,
    /// so one can be run alone.
    fn for_input(seed: u64, target: &str, index: u64) -> Rng {
        let name = target.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let mut r = Rng(seed ^ name);
        let a = r.next();
        let mut r = Rng(a ^ index.wrapping_mul(0xd134_2543_de82_ef95));
        r.next();
        r
    }

    /// Uniform in `0..n` (`n` at least 1).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// True with probability `num / den`.
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next() % den < num
    }

    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }

    /// How many mutations to stack: mostly few, sometimes many.
    fn count(&mut self) -> usize {
        if self.chance(1, 5) {
            1 + self.below(12)
        } else {
            1 + self.below(3)
        }
    }
}

/// Why an input failed.
enum Fail {
    Panic(String),
    Hang(String),
    /// Neither: distc contradicts itself (a plan it wrote that it will not read) or
    /// reports an internal error.
    Wrong(String),
}

/// What the code made of an input that did not fail.
enum Outcome {
    Accepted,
    /// Refused, with the error's first line.
    Refused(String),
}

/// The lines after the first indented (verbose output: one input, one block).
fn indent(text: &str) -> String {
    text.lines().collect::<Vec<_>>().join("\n        ")
}

/// An error distc reports as its own bug (`internal error`) fails the input; any
/// other refuses it.
fn refused(error: String) -> Result<Outcome, Fail> {
    if error.contains("internal error") {
        Err(Fail::Wrong(error))
    } else {
        Ok(Outcome::Refused(first_line(error)))
    }
}

fn first_line(text: impl std::fmt::Display) -> String {
    text.to_string()
        .lines()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// One generated input: what it is, its files (saved when it fails), and the run.
struct Case {
    what: String,
    files: Vec<(String, Vec<u8>)>,
    run: Box<dyn FnOnce() -> Result<Outcome, Fail> + Send>,
}

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Panics on the fuzzers' threads are recorded for the report, with a backtrace, and
/// not printed; others (the test harness's own) go to the default hook.
fn install_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if std::thread::current()
                .name()
                .is_some_and(|n| n.starts_with("fuzz-"))
            {
                let bt = std::backtrace::Backtrace::force_capture().to_string();
                let bt: Vec<&str> = bt.lines().take(60).collect();
                let text = format!("{info}\n{}", bt.join("\n"));
                LAST_PANIC.with(|l| *l.borrow_mut() = Some(text));
            } else {
                default(info);
            }
        }));
    });
}

fn payload_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".into())
}

fn temp_dir() -> TempDir {
    TempDir::new().expect("a temporary folder")
}

fn target_tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// Shows bytes as text: as they are when UTF-8 and short enough, else escaped.
fn show(bytes: &[u8], limit: usize) -> String {
    let text = match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => format!("{:?}", String::from_utf8_lossy(bytes)),
    };
    if text.len() > limit {
        let mut cut = limit;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}... ({} bytes in all)", &text[..cut], bytes.len())
    } else {
        text
    }
}

/// What tells failures apart: the place a panic names (`panicked at FILE:LINE:COL:`
/// and the message after it), else the first line.
/// Elsewhere, the first line with its numbers and quoted names left out.
fn signature(failure: &str) -> String {
    if let Some(at) = failure.find("panicked at ") {
        return failure[at..].lines().take(2).collect::<Vec<_>>().join(" ");
    }
    let line: Vec<&str> = failure
        .lines()
        .next()
        .unwrap_or_default()
        .split(' ')
        .map(|w| if w.contains('/') { "FILE" } else { w })
        .collect();
    let mut out = String::new();
    let mut quoted = false;
    for c in line.join(" ").chars() {
        match c {
            '`' => {
                quoted = !quoted;
                out.push(c);
            }
            _ if quoted => {}
            '0'..='9' if out.ends_with('N') => {}
            '0'..='9' => out.push('N'),
            _ => out.push(c),
        }
    }
    out
}

/// Runs `target`'s inputs until the budget ends; prints the counts; fails with every
/// failing input printed and saved.
fn fuzz(target: &str, mut make: impl FnMut(&mut Rng, u64) -> Case, in_process: bool) {
    install_hook();
    let s = settings();
    let start = Instant::now();
    let current = target_tmp().join(format!("fuzz-current-{target}"));
    if in_process {
        eprintln!(
            "fuzz {target}: should this process die, the input it was on is in {}",
            current.display()
        );
    }
    let (mut inputs, mut panics, mut hangs, mut wrong) = (0u64, 0, 0, 0);
    let (mut accepted, mut refused) = (0, 0);
    let mut failures: Vec<String> = Vec::new();
    // Failures by where they panicked: each printed once, with a count.
    let mut seen: Vec<(String, Vec<u64>)> = Vec::new();
    let mut index = s.only.unwrap_or(0);
    loop {
        if let Some(only) = s.only {
            if index > only {
                break;
            }
        } else if s.runs.is_some_and(|r| index >= r)
            || s.secs.is_some_and(|t| start.elapsed().as_secs_f64() >= t)
        {
            break;
        }
        let mut rng = Rng::for_input(s.seed, target, index);
        let case = make(&mut rng, index);
        if in_process {
            if let Some((_, bytes)) = case.files.first() {
                // Best effort: only for the diagnosis of an abort.
                let _ = std::fs::write(&current, bytes);
            }
        }
        let (tx, rx) = mpsc::channel();
        let run = case.run;
        let worker = std::thread::Builder::new()
            .name(format!("fuzz-{target}"))
            // As much stack as the binary's main thread, where distc parses.
            .stack_size(8 << 20)
            .spawn(move || {
                let r = panic::catch_unwind(AssertUnwindSafe(run)).unwrap_or_else(|p| {
                    let text = LAST_PANIC
                        .with(|l| l.borrow_mut().take())
                        .unwrap_or_else(|| payload_text(&*p));
                    Err(Fail::Panic(text))
                });
                let _ = tx.send(r);
            })
            .expect("a thread");
        inputs += 1;
        // A command line is killed after the hang limit; its thread gets a margin.
        let wait = if in_process {
            s.hang
        } else {
            s.hang + Duration::from_secs(10)
        };
        let failure = match rx.recv_timeout(wait) {
            Ok(Ok(Outcome::Accepted)) => {
                accepted += 1;
                if s.verbose {
                    eprintln!("#{index} accepted  <=  {}", indent(&case.what));
                }
                None
            }
            Ok(Ok(Outcome::Refused(why))) => {
                refused += 1;
                if s.verbose {
                    eprintln!("#{index} refused: {why}  <=  {}", indent(&case.what));
                }
                None
            }
            Ok(Err(Fail::Panic(text))) => {
                panics += 1;
                Some(format!("PANIC: {text}"))
            }
            Ok(Err(Fail::Hang(text))) => {
                hangs += 1;
                Some(format!("HANG: {text}"))
            }
            Ok(Err(Fail::Wrong(text))) => {
                wrong += 1;
                Some(format!("WRONG: {text}"))
            }
            Err(_) => {
                hangs += 1;
                Some(format!(
                    "HANG: still running after {:.1} s (the thread is left behind; \
                     the target stops here)",
                    wait.as_secs_f64()
                ))
            }
        };
        let stuck = failure
            .as_deref()
            .is_some_and(|f| f.contains("left behind"));
        if !stuck {
            let _ = worker.join();
        }
        let repeated = failure.as_deref().and_then(|f| {
            let sig = signature(f);
            match seen.iter_mut().find(|(s, _)| *s == sig) {
                Some((_, at)) => {
                    at.push(index);
                    Some(())
                }
                None => {
                    seen.push((sig, vec![index]));
                    None
                }
            }
        });
        if let (Some(f), None) = (failure, repeated) {
            let dir = target_tmp()
                .join("fuzz-failures")
                .join(format!("{target}-seed{}-{index}", s.seed));
            let _ = std::fs::create_dir_all(&dir);
            let mut shown = String::new();
            for (name, bytes) in &case.files {
                let _ = std::fs::write(dir.join(name), bytes);
                if name.ends_with(".dsl") || name == "argv.txt" {
                    shown.push_str(&format!("--- {name} ---\n{}\n", show(bytes, 4000)));
                }
            }
            failures.push(format!(
                "input #{index} of `{target}` (alone: DISTC_FUZZ_SEED={} DISTC_FUZZ_ONLY={index} \
                 cargo test -p distc --test fuzz {target} -- --nocapture)\n{}\n{shown}{f}\n\
                 files saved in {}",
                s.seed,
                case.what,
                dir.display()
            ));
        }
        if stuck {
            break;
        }
        index += 1;
    }
    if in_process {
        let _ = std::fs::remove_file(&current);
    }
    let budget = match (s.secs, s.runs, s.only) {
        (_, _, Some(i)) => format!("input {i} only"),
        (Some(t), _, _) => format!("{t} s"),
        (None, Some(r), _) => format!("{r} runs"),
        (None, None, None) => unreachable!("a default budget"),
    };
    let wrong = if wrong > 0 {
        format!(", {wrong} other failures")
    } else {
        String::new()
    };
    let line = format!(
        "fuzz {target}: {inputs} inputs, {panics} panics, {hangs} hangs{wrong} (seed {}, \
         {budget}; {accepted} accepted, {refused} refused, {:.1} s)",
        s.seed,
        start.elapsed().as_secs_f64()
    );
    println!("{line}");
    eprintln!("{line}");
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("\n==== {f}");
        }
        for (sig, at) in &seen {
            eprintln!("\n==== {} inputs failed at {sig}: {at:?}", at.len());
        }
        panic!("{line}");
    }
}

// ---------------------------------------------------------------------------------
// Mutations.
// ---------------------------------------------------------------------------------

/// Numbers worth trying wherever a number is read.
const EXTREMES: &str = "0 -1 1 -0 0.5 1.5 2 3 1e308 -1e308 1e999 1e-320 5e-324 NaN nan inf -inf
    255 256 65536 2147483647 2147483648 -2147483649 4294967295 4294967296 9007199254740993
    9223372036854775807 9223372036854775808 -9223372036854775809 18446744073709551615
    18446744073709551616 340282366920938463463374607431768211456 3.4028236e38 1e19
    00000000000000000001 1e 1. .5 0x10";

/// Numbers that cannot make a run long: invalid, or small. (Where a valid large value
/// would only make distc work longer, as `--steps` or a train block's `batch` do.)
const CHEAP_NUMBERS: &str = "0 -1 1 2 3 -0 0.5 1.5 1e308 -1e308 1e999 1e-320 nan inf
    18446744073709551616 99999999999999999999999 1e .5 0x10";

/// DSL words and punctuation.
const DSL_WORDS: &str = "model train input param minimize B f32 f64 i32 i64 bool true false
    matmul relu sigmoid tanh exp log neg softmax log_softmax sum mean reshape transpose concat
    slice embedding softmax_cross_entropy mse dropout layer_norm conv2d max_pool2d zeros ones
    glorot he normal uniform data batch optimizer steps seed eval_every eval_samples sgd adam lr
    momentum beta1 beta2 eps mnist ptb movielens zipf_tokens gaussian_classes vocab context
    classes features s test_fraction axis axes keep_dims rate stride padding kernel transpose_a
    transpose_b { } ( ) [ ] , = : @ + - * / # // -1 [B] f32[] i32[B] é \u{feff} \u{0} \" ' \\
    model~m~{ train~{";

/// Text IR words and punctuation.
const IR_WORDS: &str = "%0 %1 %2 %3 %99 %4294967296 %18446744073709551616 #1 #2 #99 f32 f64
    i32 [ ] { } ( ) , : = \" indexed_slices(f32[300,8],~nnz=32) nnz= shape=[ shards=[0,0,300]
    var=\"emb\" name=\"x\" param=\"w\" table=f32[300,8] init=zeros init=glorot transpose_a=true
    transpose_b=true reduce=\"mean\" reduce=\"sum\" graph~g~{ loss~%0 output{name=\"prediction\"}~%0
    param_grad{param=\"w\"}~%0 :~f32[] :~f32[8,6] :~(f32[6],~f32[32,6]) input param
    constant{value=1.0} matmul add sub mul div relu reshape transpose pack unpack all_reduce
    all_gather broadcast sparse_pull sparse_push pull push serve shard embedding embedding_grad
    unique_rows sum_to fused accumulate{micro=2} softmax_cross_entropy softmax_cross_entropy_grad
    conv2d max_pool2d layer_norm dropout slice concat";

/// JSON punctuation and words (plans, metrics files, checkpoint headers).
const JSON_WORDS: &str = "{ } [ ] , : \" null true false \\u0000 \\ud800 \\ {} [] \"\" 1e308 -1
    NaN Infinity \"loss\": \"step\": \"memory\": \"eval_loss\": \"samples_per_sec\":";

/// Strings that JSON values are replaced with.
const STRINGS: &str = "x single allreduce ps hybrid auto sync async stale sparse dense F32 F16
    BF16 F64 I32 I64 U8 BOOL adam sgd mnist zipf_tokens gaussian_classes distc-plan
    distc-training-state optimizer/step emb w emb/m \u{0} é ../x 1e308";

/// The word lists above, split at blanks, `~` standing for a blank inside a word.
struct Lists {
    extremes: Vec<String>,
    cheap: Vec<String>,
    dsl: Vec<String>,
    ir: Vec<String>,
    json: Vec<String>,
    strings: Vec<String>,
    budget_flags: Vec<String>,
    budget_values: Vec<String>,
    flags: Vec<String>,
    values: Vec<String>,
    subcommands: Vec<String>,
}

fn words(list: &str, extra: &[&str]) -> Vec<String> {
    list.split_whitespace()
        .map(|w| w.replace('~', " "))
        .chain(extra.iter().map(|w| w.to_string()))
        .collect()
}

fn lists() -> &'static Lists {
    static LISTS: std::sync::OnceLock<Lists> = std::sync::OnceLock::new();
    LISTS.get_or_init(|| Lists {
        extremes: words(EXTREMES, &[""]),
        cheap: words(CHEAP_NUMBERS, &[""]),
        dsl: words(DSL_WORDS, &["\n", " ", "\t"]),
        ir: words(IR_WORDS, &["\n", " "]),
        json: words(JSON_WORDS, &["\n", " "]),
        strings: words(STRINGS, &[""]),
        budget_flags: words(BUDGET_FLAGS, &[]),
        budget_values: words(BUDGET_VALUES, &[""]),
        flags: words(FLAGS, &[]),
        values: words(VALUES, &[""]),
        subcommands: words(SUBCOMMANDS, &[""]),
    })
}

/// Mutates text or bytes in place; logs what it did.
struct Mutator<'a> {
    numbers: &'a [String],
    words: &'a [String],
    corpus: &'a [Vec<u8>],
    /// Whether plain byte flips and random bytes are allowed.
    raw: bool,
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Spans of numbers (`-12`, `0.5`, `1e-8`) in `t`.
fn number_spans(t: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let prev_ident = i > 0 && is_ident(t[i - 1]);
        if t[i].is_ascii_digit() && !prev_ident {
            let start = if i > 0 && t[i - 1] == b'-' { i - 1 } else { i };
            let mut j = i;
            while j < t.len()
                && (t[j].is_ascii_digit()
                    || t[j] == b'.'
                    || t[j] == b'e'
                    || t[j] == b'E'
                    || ((t[j] == b'-' || t[j] == b'+') && matches!(t[j - 1], b'e' | b'E')))
            {
                j += 1;
            }
            out.push((start, j));
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Spans of names in `t`.
fn ident_spans(t: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        if is_ident_start(t[i]) && (i == 0 || !is_ident(t[i - 1])) {
            let mut j = i;
            while j < t.len() && is_ident(t[j]) {
                j += 1;
            }
            out.push((i, j));
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Line spans, each with its line break.
fn line_spans(t: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &b) in t.iter().enumerate() {
        if b == b'\n' {
            out.push((start, i + 1));
            start = i + 1;
        }
    }
    if start < t.len() {
        out.push((start, t.len()));
    }
    out
}

impl Mutator<'_> {
    fn mutate(&self, rng: &mut Rng, t: &mut Vec<u8>, log: &mut Vec<String>) {
        for _ in 0..rng.count() {
            self.once(rng, t, log);
        }
    }

    fn once(&self, rng: &mut Rng, t: &mut Vec<u8>, log: &mut Vec<String>) {
        let len = t.len();
        let pos = rng.below(len + 1);
        match rng.below(if self.raw { 16 } else { 13 }) {
            0..=3 => self.number(rng, t, log),
            4..=5 => self.name(rng, t, log),
            6..=7 => {
                let lines = line_spans(t);
                if lines.is_empty() {
                    return self.insert_word(rng, t, log);
                }
                let (a, b) = *rng.pick(&lines);
                match rng.below(4) {
                    0 => {
                        log.push(format!("delete line at {a}"));
                        t.drain(a..b);
                    }
                    1 => {
                        log.push(format!("duplicate line at {a}"));
                        let line = t[a..b].to_vec();
                        t.splice(b..b, line);
                    }
                    2 => {
                        let (c, d) = *rng.pick(&lines);
                        log.push(format!("copy line at {c} over line at {a}"));
                        let line = t[c..d].to_vec();
                        t.splice(a..b, line);
                    }
                    _ => {
                        let line: Vec<u8> = t.drain(a..b).collect();
                        let at = rng.below(t.len() + 1);
                        log.push(format!("move line at {a} to {at}"));
                        t.splice(at..at, line);
                    }
                }
            }
            8..=9 => self.insert_word(rng, t, log),
            10 => {
                let other = rng.pick(self.corpus);
                if other.is_empty() {
                    return;
                }
                let a = rng.below(other.len());
                let b = (a + 1 + rng.below(256)).min(other.len());
                let chunk = other[a..b].to_vec();
                if rng.chance(1, 2) {
                    let end = (pos + chunk.len()).min(len);
                    log.push(format!("splice {} bytes over {pos}", chunk.len()));
                    t.splice(pos..end, chunk);
                } else {
                    log.push(format!("splice {} bytes in at {pos}", chunk.len()));
                    t.splice(pos..pos, chunk);
                }
            }
            11 => {
                let end = (pos + 1 + rng.below(32)).min(len);
                log.push(format!("delete {pos}..{end}"));
                t.drain(pos..end);
            }
            12 => {
                let end = (pos + 1 + rng.below(64)).min(len);
                let chunk = t[pos..end].to_vec();
                let most = if rng.chance(1, 8) { 2000 } else { 4 };
                let times = 1 + rng.below(most);
                log.push(format!("repeat {pos}..{end} {times} times"));
                for _ in 0..times {
                    t.splice(end..end, chunk.iter().copied());
                }
            }
            13 => {
                if len == 0 {
                    return;
                }
                let at = rng.below(len);
                let bit = rng.below(8);
                log.push(format!("flip bit {bit} of byte {at}"));
                t[at] ^= 1 << bit;
            }
            14 => {
                if len == 0 {
                    return;
                }
                let at = rng.below(len);
                let v = *rng.pick(&[0u8, 0xff, 0x7f, 0x80, b'\n', b'"', b'{', b'0', 0xc3]);
                log.push(format!("byte {at} -> {v:#x}"));
                t[at] = v;
            }
            _ => {
                log.push(format!("truncate at {pos}"));
                t.truncate(pos);
            }
        }
    }

    /// Only numbers and names replaced: the text mostly still parses, so the
    /// mutation reaches the checks after the parser.
    fn mutate_tokens(&self, rng: &mut Rng, t: &mut Vec<u8>, log: &mut Vec<String>) {
        for _ in 0..rng.count() {
            if rng.chance(2, 3) {
                self.number(rng, t, log);
            } else {
                self.name(rng, t, log);
            }
        }
    }

    /// Text mutated one way or the other, half the time each.
    fn mutate_any(&self, rng: &mut Rng, t: &mut Vec<u8>, log: &mut Vec<String>) {
        if rng.chance(1, 2) {
            self.mutate_tokens(rng, t, log);
        } else {
            self.mutate(rng, t, log);
        }
    }

    fn number(&self, rng: &mut Rng, t: &mut Vec<u8>, log: &mut Vec<String>) {
        let spans = number_spans(t);
        if spans.is_empty() {
            return self.insert_word(rng, t, log);
        }
        let (a, b) = *rng.pick(&spans);
        let n = rng.pick(self.numbers);
        log.push(format!(
            "number {:?} at {a} -> {n:?}",
            String::from_utf8_lossy(&t[a..b])
        ));
        t.splice(a..b, n.bytes());
    }

    fn name(&self, rng: &mut Rng, t: &mut Vec<u8>, log: &mut Vec<String>) {
        let spans = ident_spans(t);
        if spans.is_empty() {
            return self.insert_word(rng, t, log);
        }
        let (a, b) = *rng.pick(&spans);
        let with: Vec<u8> = if rng.chance(1, 2) {
            rng.pick(self.words).as_bytes().to_vec()
        } else {
            let (c, d) = *rng.pick(&spans);
            t[c..d].to_vec()
        };
        log.push(format!(
            "name {:?} at {a} -> {:?}",
            String::from_utf8_lossy(&t[a..b]),
            String::from_utf8_lossy(&with)
        ));
        t.splice(a..b, with);
    }

    fn insert_word(&self, rng: &mut Rng, t: &mut Vec<u8>, log: &mut Vec<String>) {
        let pos = rng.below(t.len() + 1);
        let w = if rng.chance(1, 4) {
            rng.pick(self.numbers)
        } else {
            rng.pick(self.words)
        };
        log.push(format!("insert {w:?} at {pos}"));
        t.splice(pos..pos, w.bytes());
    }
}

// JSON values.

#[derive(Clone)]
enum Seg {
    Key(String),
    Index(usize),
}

fn paths(v: &Value, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    out.push(at.clone());
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                at.push(Seg::Key(k.clone()));
                paths(x, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                at.push(Seg::Index(i));
                paths(x, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

fn at_path<'a>(v: &'a mut Value, path: &[Seg]) -> &'a mut Value {
    path.iter().fold(v, |v, seg| match seg {
        Seg::Key(k) => v.get_mut(k.as_str()).expect("the key"),
        Seg::Index(i) => v.get_mut(*i).expect("the index"),
    })
}

fn path_text(path: &[Seg]) -> String {
    let mut s = String::from("$");
    for seg in path {
        match seg {
            Seg::Key(k) => s.push_str(&format!(".{k}")),
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

fn extreme_json(rng: &mut Rng) -> Value {
    match rng.below(17) {
        0 => Value::from(0),
        1 => Value::from(-1),
        2 => Value::from(1),
        3 => Value::from(2),
        4 => Value::from(i64::from(i32::MAX) + 1),
        5 => Value::from(u64::from(u32::MAX) + 1),
        6 => Value::from(i64::MAX),
        7 => Value::from(i64::MIN),
        8 => Value::from(u64::MAX),
        9 => Value::from(1e308),
        10 => Value::from(-1e308),
        11 => Value::from(5e-324),
        12 => Value::from(0.5),
        13 => Value::from(-0.0),
        14 => Value::from(1.8446744073709552e19),
        15 => Value::from(9_007_199_254_740_993u64),
        _ => Value::from(1e-9),
    }
}

fn random_value(rng: &mut Rng) -> Value {
    match rng.below(8) {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(1, 2)),
        2 | 3 => extreme_json(rng),
        4 => Value::from(rng.pick(&lists().strings).as_str()),
        5 => Value::Array(vec![]),
        6 => Value::Object(Default::default()),
        _ => Value::Array(vec![extreme_json(rng), extreme_json(rng)]),
    }
}

/// One mutation of a JSON value somewhere in `v`; long strings (IR, text) go to
/// `text`, strings holding JSON are mutated as JSON.
fn mutate_json(rng: &mut Rng, v: &mut Value, text: &Mutator<'_>, log: &mut Vec<String>) {
    let mut all = Vec::new();
    paths(v, &mut Vec::new(), &mut all);
    let path = rng.pick(&all).clone();
    let node = at_path(v, &path);
    let p = path_text(&path);
    if rng.chance(1, 10) {
        let new = random_value(rng);
        log.push(format!("{p} -> {new}"));
        *node = new;
        return;
    }
    match node {
        Value::Number(_) => {
            let new = extreme_json(rng);
            log.push(format!("{p}: {node} -> {new}"));
            *node = new;
        }
        Value::String(s) => {
            if let (true, Ok(mut inner)) = (rng.chance(2, 3), serde_json::from_str::<Value>(s)) {
                if inner.is_object() || inner.is_array() {
                    log.push(format!("{p}: JSON inside:"));
                    mutate_json(rng, &mut inner, text, log);
                    *s = inner.to_string();
                    return;
                }
            }
            if s.len() > 24 && rng.chance(3, 4) {
                let mut bytes = s.clone().into_bytes();
                log.push(format!("{p}: text:"));
                text.mutate_any(rng, &mut bytes, log);
                *s = String::from_utf8_lossy(&bytes).into_owned();
            } else {
                let new = rng.pick(&lists().strings);
                log.push(format!("{p}: {s:?} -> {new:?}"));
                *s = new.to_string();
            }
        }
        Value::Bool(b) => {
            log.push(format!("{p}: flip {b}"));
            *b = !*b;
        }
        Value::Null => {
            let new = random_value(rng);
            log.push(format!("{p}: null -> {new}"));
            *node = new;
        }
        Value::Array(a) => {
            if a.is_empty() {
                let new = random_value(rng);
                log.push(format!("{p}: push {new}"));
                a.push(new);
                return;
            }
            let i = rng.below(a.len());
            match rng.below(5) {
                0 => {
                    log.push(format!("{p}: remove [{i}]"));
                    a.remove(i);
                }
                1 => {
                    log.push(format!("{p}: duplicate [{i}]"));
                    let x = a[i].clone();
                    a.insert(i, x);
                }
                2 => {
                    log.push(format!("{p}: clear"));
                    a.clear();
                }
                3 => {
                    log.push(format!("{p}: reverse"));
                    a.reverse();
                }
                _ => {
                    let new = random_value(rng);
                    log.push(format!("{p}: push {new}"));
                    a.push(new);
                }
            }
        }
        Value::Object(m) => {
            let keys: Vec<String> = m.keys().cloned().collect();
            if keys.is_empty() || rng.chance(1, 4) {
                let new = random_value(rng);
                let key = if keys.is_empty() || rng.chance(1, 2) {
                    rng.pick(&lists().strings).clone()
                } else {
                    rng.pick(&keys).clone()
                };
                log.push(format!("{p}: set {key:?} = {new}"));
                m.insert(key, new);
                return;
            }
            let k = rng.pick(&keys).clone();
            if rng.chance(2, 3) {
                log.push(format!("{p}: remove {k:?}"));
                m.remove(&k);
            } else {
                let to = rng.pick(&lists().strings).clone();
                log.push(format!("{p}: rename {k:?} -> {to:?}"));
                if let Some(x) = m.remove(&k) {
                    m.insert(to, x);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// Plans.
// ---------------------------------------------------------------------------------

/// The content hash `Plan::load` checks, so that mutated plans still pass the hash
/// check and reach the parser and verifier.
fn content_hash(p: &Plan) -> String {
    let mut sealed = p.clone();
    sealed.seal();
    sealed.hash
}

/// Puts the right hash into plan text whose `"hash"` is a plain string, if it still
/// reads as a plan.
fn rehash_text(t: &mut Vec<u8>) {
    let Ok(p) = serde_json::from_slice::<Plan>(t) else {
        return;
    };
    let hash = content_hash(&p);
    let text = String::from_utf8_lossy(t).into_owned();
    let Some(at) = text.rfind("\"hash\"") else {
        return;
    };
    let rest = &text[at + 6..];
    let Some(open) = rest.find('"') else {
        return;
    };
    let start = at + 6 + open + 1;
    let Some(len) = text[start..].find('"') else {
        return;
    };
    t.splice(start..start + len, hash.bytes());
}

/// A mutated plan from `plans`.
fn mutate_plan(rng: &mut Rng, plans: &[Vec<u8>], log: &mut Vec<String>) -> Vec<u8> {
    let which = rng.below(plans.len());
    log.push(format!("plan #{which}"));
    let base = &plans[which];
    let ir = Mutator {
        numbers: &lists().extremes,
        words: &lists().ir,
        corpus: plans,
        raw: true,
    };
    let json = Mutator {
        numbers: &lists().extremes,
        words: &lists().json,
        corpus: plans,
        raw: true,
    };
    let rehash = rng.chance(9, 10);
    match rng.below(4) {
        0 => {
            let mut t = base.clone();
            json.mutate_any(rng, &mut t, log);
            if rehash {
                rehash_text(&mut t);
            }
            t
        }
        mode => {
            let mut v: Value = serde_json::from_slice(base).expect("a plan");
            if mode == 3 {
                // The programs' IR.
                let mut fields = vec![vec![Seg::Key("graph".into())]];
                if v.get("init").is_some_and(Value::is_string) {
                    fields.push(vec![Seg::Key("init".into())]);
                }
                if v.get("finalize").is_some_and(Value::is_string) {
                    fields.push(vec![Seg::Key("finalize".into())]);
                }
                let servers = v
                    .get("servers")
                    .and_then(Value::as_array)
                    .map_or(0, Vec::len);
                for i in 0..servers {
                    fields.push(vec![Seg::Key("servers".into()), Seg::Index(i)]);
                }
                let path = rng.pick(&fields).clone();
                if let Value::String(s) = at_path(&mut v, &path) {
                    let mut bytes = s.clone().into_bytes();
                    log.push(format!("{}: IR:", path_text(&path)));
                    ir.mutate_any(rng, &mut bytes, log);
                    *s = String::from_utf8_lossy(&bytes).into_owned();
                }
            } else {
                for _ in 0..rng.count() {
                    mutate_json(rng, &mut v, &ir, log);
                }
            }
            if rehash {
                if let Ok(p) = serde_json::from_value::<Plan>(v.clone()) {
                    if let Some(m) = v.as_object_mut() {
                        m.insert("hash".into(), Value::from(content_hash(&p)));
                    }
                }
            } else {
                log.push("hash left as it was".into());
            }
            let text = if rng.chance(1, 2) {
                serde_json::to_string_pretty(&v)
            } else {
                serde_json::to_string(&v)
            };
            text.expect("JSON").into_bytes()
        }
    }
}

// ---------------------------------------------------------------------------------
// Checkpoints (safetensors: an 8-byte little-endian header length, the JSON header,
// the tensors' bytes).
// ---------------------------------------------------------------------------------

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn split_st(bytes: &[u8]) -> Option<(Value, Vec<u8>)> {
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    Some((header, bytes[8 + n..].to_vec()))
}

fn join_st(header: &Value, data: &[u8], pad: bool) -> Vec<u8> {
    let mut h = header.to_string().into_bytes();
    while pad && !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

/// Rewrites the per-tensor checksums to match `data`.
fn fix_checksums(header: &mut Value, data: &[u8]) {
    let Some(m) = header.as_object() else {
        return;
    };
    let mut sums = Vec::new();
    for (name, t) in m {
        let offsets = t.get("data_offsets").and_then(Value::as_array);
        let (Some(a), Some(b)) = (
            offsets.and_then(|o| o.first()).and_then(Value::as_u64),
            offsets.and_then(|o| o.get(1)).and_then(Value::as_u64),
        ) else {
            continue;
        };
        if let Some(bytes) = data.get(a as usize..b as usize) {
            sums.push(format!("{name}={:08x}", crc32(bytes)));
        }
    }
    if let Some(meta) = header
        .get_mut("__metadata__")
        .and_then(Value::as_object_mut)
    {
        meta.insert(
            checkpoint::CHECKSUM_KEY.into(),
            Value::from(sums.join("\n")),
        );
    }
}

fn mutate_checkpoint(rng: &mut Rng, files: &[Vec<u8>], log: &mut Vec<String>) -> Vec<u8> {
    let which = rng.below(files.len());
    log.push(format!("checkpoint #{which}"));
    let base = files[which].clone();
    let text = Mutator {
        numbers: &lists().extremes,
        words: &lists().json,
        corpus: files,
        raw: true,
    };
    let Some((mut header, mut data)) = split_st(&base) else {
        let mut t = base;
        text.mutate(rng, &mut t, log);
        return t;
    };
    match rng.below(6) {
        0 => {
            log.push("bytes:".into());
            let mut t = base;
            text.mutate(rng, &mut t, log);
            t
        }
        1 => {
            // The header's text, its length prefix kept right (or not).
            let mut h = header.to_string().into_bytes();
            log.push("header text:".into());
            text.mutate(rng, &mut h, log);
            let n = if rng.chance(4, 5) {
                h.len() as u64
            } else {
                let n = *rng.pick(&[0, 1, 7, u64::MAX, u64::MAX / 2, h.len() as u64 + 1]);
                log.push(format!("header length {n}"));
                n
            };
            let mut out = n.to_le_bytes().to_vec();
            out.extend(h);
            out.extend(data);
            out
        }
        2 | 3 => {
            log.push("header values:".into());
            for _ in 0..rng.count() {
                mutate_json(rng, &mut header, &text, log);
            }
            join_st(&header, &data, rng.chance(1, 2))
        }
        4 => {
            // The tensors' bytes, with checksums that match them.
            if !data.is_empty() {
                for _ in 0..rng.count() {
                    let at = rng.below(data.len());
                    let with: Vec<u8> = match rng.below(7) {
                        0 => f32::NAN.to_le_bytes().to_vec(),
                        1 => f32::INFINITY.to_le_bytes().to_vec(),
                        2 => f32::MAX.to_le_bytes().to_vec(),
                        3 => f64::NAN.to_le_bytes().to_vec(),
                        4 => i32::MIN.to_le_bytes().to_vec(),
                        5 => i32::MAX.to_le_bytes().to_vec(),
                        _ => vec![0xff],
                    };
                    log.push(format!("data {at} <- {with:?}"));
                    let end = (at + with.len()).min(data.len());
                    data.splice(at..end, with.iter().copied());
                }
            }
            fix_checksums(&mut header, &data);
            join_st(&header, &data, true)
        }
        _ => {
            // Shape, dtype or offsets of one tensor, checksums fixed.
            let names: Vec<String> = header
                .as_object()
                .map(|m| m.keys().filter(|k| *k != "__metadata__").cloned().collect())
                .unwrap_or_default();
            if let Some(name) = (!names.is_empty()).then(|| rng.pick(&names).clone()) {
                let field = *rng.pick(&["shape", "dtype", "data_offsets"]);
                let new = match field {
                    "dtype" => Value::from(*rng.pick(&[
                        "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "F8_E4M3", "x",
                    ])),
                    _ => {
                        let mut a = header[&name][field].clone();
                        if let Some(xs) = a.as_array_mut() {
                            match rng.below(3) {
                                0 if !xs.is_empty() => {
                                    let i = rng.below(xs.len());
                                    xs[i] = extreme_json(rng);
                                }
                                1 => xs.push(extreme_json(rng)),
                                _ => {
                                    xs.pop();
                                }
                            }
                        }
                        a
                    }
                };
                log.push(format!("{name}.{field} -> {new}"));
                if let Some(t) = header.get_mut(&name).and_then(Value::as_object_mut) {
                    t.insert(field.into(), new);
                }
            }
            fix_checksums(&mut header, &data);
            join_st(&header, &data, true)
        }
    }
}

// ---------------------------------------------------------------------------------
// The seed corpus.
// ---------------------------------------------------------------------------------

/// Files by name.
type Files = Vec<(String, Vec<u8>)>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The files of `dir` (relative to the repository root) whose names end with `ext`.
fn files_in(dir: &str, ext: &str) -> Files {
    let Ok(entries) = std::fs::read_dir(root().join(dir)) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(ext))
        .map(|p| {
            let name = format!("{dir}/{}", p.file_name().expect("a name").to_string_lossy());
            (name, std::fs::read(&p).expect("readable"))
        })
        .collect();
    out.sort();
    out
}

/// The DSL seeds: the valid models, and the ones `dsl_errors.rs` checks are refused.
fn dsl_corpus() -> (Files, Files) {
    let mut good = files_in("examples", ".dsl");
    good.extend(files_in("tests/models", ".dsl"));
    good.extend(files_in("compiler/tests/fuzz", ".dsl"));
    let bad = files_in("compiler/tests/bad_dsl", "");
    assert!(
        good.len() > 5 && bad.len() > 5,
        "the seed corpus is missing: {} valid and {} invalid models",
        good.len(),
        bad.len()
    );
    (good, bad)
}

fn data_dir() -> Option<PathBuf> {
    std::env::var_os("DISTC_DATA")
        .map(PathBuf::from)
        .filter(|d| d.join("mnist").is_dir())
}

/// Runs the built `distc` in `cwd` (setting up the corpus: it must succeed).
fn distc_ok(cwd: &Path, args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_distc"))
        .args(args)
        .current_dir(cwd)
        .env("TMPDIR", cwd)
        .output()
        .expect("distc runs");
    assert!(
        o.status.success(),
        "distc {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The files the plan, checkpoint and command-line targets start from, made in `dir`:
/// models, plans by `distc compile`, and (with `runs`) checkpoints and metrics by
/// `distc train`. Returns them by name.
fn make_fixtures(dir: &Path, runs: bool) -> Files {
    // Copies of models with few steps and little evaluation: a command line that
    // loses its `--steps` still ends quickly.
    let copy = |from: &str, to: &str| {
        let text = std::fs::read_to_string(root().join(from)).expect("a model");
        let short: Vec<String> = text
            .lines()
            .filter(|l| !l.trim_start().starts_with("eval_samples"))
            .map(|l| match l.trim_start() {
                t if t.starts_with("steps") => "  steps = 2".to_string(),
                t if t.starts_with("eval_every") => "  eval_every = 1\n  eval_samples = 200".into(),
                _ => l.to_string(),
            })
            .collect();
        std::fs::write(dir.join(to), short.join("\n") + "\n").expect("a model");
    };
    copy("tests/models/issue9_sparse_adam.dsl", "m.dsl");
    copy("tests/models/issue9_dropout.dsl", "d.dsl");
    copy("compiler/tests/fuzz/ops.dsl", "o.dsl");
    copy("tests/models/issue9_sparse_momentum.dsl", "sm.dsl");
    copy("examples/cnn.dsl", "cnn.dsl");
    copy("examples/mlp.dsl", "mlp.dsl");
    for args in [
        &["compile", "m.dsl", "-o", "p.json"][..],
        &[
            "compile",
            "m.dsl",
            "--strategy",
            "hybrid",
            "--workers",
            "2",
            "--servers",
            "2",
            "-o",
            "h.json",
        ],
        &[
            "compile",
            "d.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--zero",
            "3",
            "--accumulate",
            "2",
            "-o",
            "z.json",
        ],
        &[
            "compile",
            "o.dsl",
            "--strategy",
            "auto",
            "--workers",
            "2",
            "--servers",
            "1",
            "--fuse",
            "--remat",
            "layers",
            "-o",
            "o.json",
        ],
        &[
            "compile",
            "sm.dsl",
            "--strategy",
            "ps",
            "--workers",
            "2",
            "--servers",
            "2",
            "--sync",
            "stale:1",
            "-o",
            "s.json",
        ],
        &[
            "compile",
            "cnn.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--zero",
            "1",
            "--fuse",
            "-o",
            "c.json",
        ],
        // The newer kinds: a pipeline with replicas, a mesh with a model axis, 16-bit
        // arithmetic and wire, hierarchical all-reduces.
        &[
            "compile",
            "mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "4",
            "--pipeline",
            "2",
            "--micro-batches",
            "2",
            "--schedule",
            "gpipe",
            "-o",
            "pp.json",
        ],
        &[
            "compile",
            "mlp.dsl",
            "--mesh",
            "data=2,model=2",
            "-o",
            "mesh.json",
        ],
        &["compile", "m.dsl", "--precision", "fp16", "-o", "fp16.json"],
        &[
            "compile",
            "mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "2",
            "--precision",
            "bf16",
            "--grad-wire",
            "bf16",
            "-o",
            "bf16.json",
        ],
        &[
            "compile",
            "mlp.dsl",
            "--strategy",
            "allreduce",
            "--workers",
            "4",
            "--ranks-per-node",
            "2",
            "--link",
            "intra=1e12,1e-7",
            "--bandwidth",
            "1e8",
            "-o",
            "hier.json",
        ],
    ] {
        distc_ok(dir, args);
    }
    if runs {
        distc_ok(
            dir,
            &[
                "train",
                "m.dsl",
                "--steps",
                "3",
                "-q",
                "--checkpoint",
                "ck.st",
                "--save",
                "w.st",
                "--metrics",
                "mt.jsonl",
            ],
        );
        distc_ok(
            dir,
            &[
                "train",
                "d.dsl",
                "--strategy",
                "allreduce",
                "--workers",
                "2",
                "--zero",
                "3",
                "--steps",
                "2",
                "-q",
                "--checkpoint",
                "ck2.st",
            ],
        );
        if data_dir().is_some() {
            distc_ok(dir, &["train", "mlp.dsl", "-q", "--metrics", "mt2.jsonl"]);
        } else {
            eprintln!("fuzz: no DISTC_DATA with mnist/: the MNIST fixtures are left out");
        }
    }
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .expect("the fixtures")
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).expect("a fixture"),
            )
        })
        .collect();
    out.sort();
    out
}

fn named(files: &[(String, Vec<u8>)], suffixes: &[&str]) -> Vec<Vec<u8>> {
    files
        .iter()
        .filter(|(n, _)| suffixes.iter().any(|s| n.ends_with(s)))
        .map(|(_, b)| b.clone())
        .collect()
}

// ---------------------------------------------------------------------------------
// Target 1: DSL text, compiled in this process.
// ---------------------------------------------------------------------------------

/// Compile options as the command line could give them (flags `check_strategy_flags`
/// accepts), chosen at random.
fn random_options(rng: &mut Rng, empty_data: &Path, log: &mut Vec<String>) -> CompileOptions {
    let base = StrategyConfig::default();
    let strategy = match rng.below(12) {
        0..=2 => base,
        8 => StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: *rng.pick(&[2, 4]),
            pipeline: 2,
            micro_batches: 1 + rng.below(3),
            ..base
        },
        9 => StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: 4,
            model: 2,
            ..base
        },
        10 => StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: *rng.pick(&[1, 2]),
            precision: *rng.pick(&[Precision::Bf16, Precision::Fp16]),
            ..base
        },
        11 => StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: 4,
            ranks_per_node: 2,
            grad_wire: *rng.pick(&[Precision::Fp32, Precision::Bf16]),
            ..base
        },
        3 => StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: 2,
            ..base
        },
        4 => StrategyConfig {
            strategy: Strategy::Hybrid,
            workers: 2,
            servers: 2,
            ..base
        },
        5 => StrategyConfig {
            strategy: Strategy::Ps,
            workers: 2,
            servers: 1,
            sync: SyncMode::Stale(1),
            ..base
        },
        6 => StrategyConfig {
            strategy: Strategy::Auto,
            workers: 3,
            servers: 2,
            sync: SyncMode::Async,
            sparse_as_dense: rng.chance(1, 2),
            ..base
        },
        _ => StrategyConfig {
            strategy: Strategy::Allreduce,
            workers: 2,
            zero: 1 + rng.below(3) as u8,
            accumulate: 2,
            remat: *rng.pick(&[RematPolicy::Layers, RematPolicy::Budget(0.001)]),
            fuse: true,
            ..base
        },
    };
    let mut opts = CompileOptions {
        strategy,
        // The data set is read (to measure ids per batch) now and then only: it is slow.
        data_dir: (!rng.chance(1, 8)).then(|| empty_data.to_path_buf()),
        ..Default::default()
    };
    let passes = distc_passes::known_pass_names();
    if rng.chance(1, 10) {
        opts.stop_after = Some(rng.pick(&passes).clone());
    }
    if rng.chance(1, 10) {
        opts.disabled.push(rng.pick(&passes).clone());
    }
    if rng.chance(1, 10) {
        opts.batch = Some(1 + rng.below(3));
    }
    log.push(format!(
        "options: {} workers={} servers={} sync={} zero={} accumulate={} remat={} fuse={} \
         stop_after={:?} disabled={:?} batch={:?} data={}",
        opts.strategy.strategy.name(),
        opts.strategy.workers,
        opts.strategy.servers,
        opts.strategy.sync,
        opts.strategy.zero,
        opts.strategy.accumulate,
        opts.strategy.remat,
        opts.strategy.fuse,
        opts.stop_after,
        opts.disabled,
        opts.batch,
        if opts.data_dir.is_some() {
            "none"
        } else {
            "DISTC_DATA"
        }
    ));
    opts
}

#[test]
fn dsl() {
    let (good, bad) = dsl_corpus();
    let texts: Vec<Vec<u8>> = good.iter().chain(&bad).map(|(_, b)| b.clone()).collect();
    let work = temp_dir();
    let empty = work.path().join("no-data");
    std::fs::create_dir_all(&empty).expect("a folder");
    let mutator = Mutator {
        numbers: &lists().extremes,
        words: &lists().dsl,
        corpus: &texts,
        raw: true,
    };
    fuzz(
        "dsl",
        |rng, _| {
            // Mostly from a valid model, so that mutants get past the parser.
            let from = if rng.chance(4, 5) { &good } else { &bad };
            let (name, seed) = rng.pick(from);
            let mut log = vec![format!("from {name}")];
            let mut t = seed.clone();
            // The seeds themselves, unmutated, now and then.
            if !rng.chance(1, 50) {
                mutator.mutate_any(rng, &mut t, &mut log);
            }
            let opts = random_options(rng, &empty, &mut log);
            let plan_file = work.path().join("compiled.plan.json");
            let src = String::from_utf8_lossy(&t).into_owned();
            Case {
                what: log.join("\n"),
                files: vec![("input.dsl".into(), t)],
                run: Box::new(move || match compile("fuzz.dsl", &src, &opts) {
                    Ok(c) => {
                        let _ = distc::driver::check_settings(&c.config);
                        // What distc writes, distc reads back.
                        let plan = Plan::new(&c, "fuzz.dsl", &opts.strategy);
                        if let Err(e) = plan.save(&plan_file, &[]) {
                            return Err(Fail::Wrong(format!("the plan is not written: {e}")));
                        }
                        match Plan::load(&plan_file) {
                            Ok((back, _)) if back == plan => Ok(Outcome::Accepted),
                            Ok(_) => Err(Fail::Wrong("the plan read back differs".into())),
                            Err(e) => Err(Fail::Wrong(format!(
                                "the plan distc wrote does not load: {e}"
                            ))),
                        }
                    }
                    Err(distc::CompileError::Dsl(e)) => {
                        let _ = e.render_plain();
                        let _ = e.line_col();
                        let why = first_line(&e);
                        let _ = format!("{:?}", miette::Report::new(*e));
                        refused(why)
                    }
                    Err(e) => refused(e.to_string()),
                }),
            }
        },
        true,
    );
}

// ---------------------------------------------------------------------------------
// Target 2: plan JSON, loaded in this process.
// ---------------------------------------------------------------------------------

#[test]
fn plan() {
    let work = temp_dir();
    let fixtures = make_fixtures(work.path(), false);
    let plans = named(&fixtures, &[".json"]);
    assert!(plans.len() >= 5, "the plans were not made");
    let file = work.path().join("fuzzed.plan.json");
    fuzz(
        "plan",
        |rng, _| {
            let mut log = Vec::new();
            let t = mutate_plan(rng, &plans, &mut log);
            let path = file.clone();
            Case {
                what: log.join("\n"),
                files: vec![("input.plan.json".into(), t.clone())],
                run: Box::new(move || {
                    std::fs::write(&path, &t).expect("the plan written");
                    match Plan::load(&path) {
                        Ok((p, programs)) => {
                            let _ = p.check_runnable();
                            for (_, g) in programs.iter() {
                                let _ = distc_ir::print(g);
                            }
                            Ok(Outcome::Accepted)
                        }
                        Err(e) => refused(e.to_string()),
                    }
                }),
            }
        },
        true,
    );
}

// ---------------------------------------------------------------------------------
// Target 3: checkpoint files, loaded in this process.
// ---------------------------------------------------------------------------------

#[test]
fn checkpoint_files() {
    let work = temp_dir();
    let fixtures = make_fixtures(work.path(), true);
    let files = named(&fixtures, &[".st"]);
    assert!(files.len() >= 3, "the checkpoints were not made");
    let file = work.path().join("fuzzed.st");
    fuzz(
        "checkpoint",
        |rng, _| {
            let mut log = Vec::new();
            let t = mutate_checkpoint(rng, &files, &mut log);
            let path = file.clone();
            Case {
                what: log.join("\n"),
                files: vec![("input.st".into(), t.clone())],
                run: Box::new(move || {
                    std::fs::write(&path, &t).expect("the checkpoint written");
                    // Accepted: it loads as weights (`load`), whether or not it
                    // is also a training state (`load_state`).
                    let plain = checkpoint::load(&path);
                    let state = checkpoint::load_state(&path);
                    match (plain, state) {
                        (Err(e), _) => refused(e.to_string()),
                        (Ok(_), _) => Ok(Outcome::Accepted),
                    }
                }),
            }
        },
        true,
    );
}

// ---------------------------------------------------------------------------------
// Target 4: command lines, run by the built binary.
// ---------------------------------------------------------------------------------

/// Valid command lines over the fixture files (each in the run's own folder). Every
/// flag that sets how much work a run does (`--steps`, `--warmup`, ...) is given, so
/// no mutation can fall back to a long default.
const COMMANDS: &[&str] = &[
    "compile m.dsl -o out.json",
    "compile m.dsl --strategy hybrid --workers 2 --servers 2 --dump-ir ir -o out.json",
    "compile d.dsl --strategy allreduce --workers 2 --zero 3 --accumulate 2 --remat layers -o out.json",
    "compile o.dsl --strategy auto --workers 2 --servers 1 --sync stale:2 --bucket-mb 0.001 --bandwidth 1e9 --latency 0 --fuse -o out.json",
    "compile m.dsl --strategy ps --workers 2 --servers 1 --sync async --stop-after place --disable-pass simplify --batch 4 -o out.json",
    "compile m.dsl --strategy allreduce --workers 2 --sparse-as-dense --remat 1 -o out.json",
    "train m.dsl --steps 2 -q --metrics out.jsonl --save out.st --trace t.json",
    "train m.dsl --strategy hybrid --workers 2 --servers 2 --steps 2 -q --checkpoint c2.st --checkpoint-every 1 --timeout 20",
    "train m.dsl --steps 4 -q --resume ck.st --save out.st",
    "train o.dsl --steps 1 --preload --profile --fuse",
    "train d.dsl --strategy allreduce --workers 2 --zero 2 --accumulate 2 --steps 1 -q --resume ck2.st",
    "train sm.dsl --strategy ps --workers 2 --servers 2 --sync stale:1 --steps 2 -q",
    "run p.json --steps 2 -q --metrics out.jsonl --save out.st",
    "run h.json --steps 1 -q --timeout 10 --trace t.json",
    "run z.json --steps 1 -q --checkpoint c.st",
    "run s.json --steps 2 -q",
    "run o.json --steps 1 -q --preload",
    "run p.json --steps 1 --device cuda -q",
    "run h.json --steps 1 --transport mpi",
    "verify m.dsl --strategy hybrid --workers 2 --servers 1 --steps 1",
    "verify d.dsl --strategy allreduce --workers 2 --steps 1 --tolerance 0.001",
    "verify o.dsl --strategy single --steps 1 --fuse --remat layers",
    "explain h.json",
    "explain z.json --format json",
    "explain c.json",
    "ir m.dsl --after autodiff",
    "dot o.dsl --batch 2",
    "plot mt.jsonl -o out.svg",
    "plot mt.jsonl mt.jsonl --label a --label b -o out.png",
    "bench --compile --nodes 200 --strategies single,hybrid --workers 2 --runs 1 --warmup 0 --steps 1 --workloads sparse_lm --json b.json",
    "bench --workloads dense_mlp --strategies single --workers 1 --runs 1 --warmup 0 --steps 1 --nodes 200",
    "--help",
    "--version",
    "train --help",
    "",
];

/// Command lines that need the MNIST data set.
const DATA_COMMANDS: &[&str] = &[
    "train mlp.dsl --steps 1 -q --metrics out.jsonl",
    "verify mlp.dsl --strategy allreduce --workers 2 --steps 1",
    "plot mt2.jsonl mt.jsonl -o out.png",
];

/// Flags whose value sets how much work a run does: never dropped, and their values
/// are replaced only by ones that are invalid or small.
const BUDGET_FLAGS: &str = "--steps --warmup --runs --nodes --workers --servers --batch
    --accumulate --workloads --strategies --compile";

const BUDGET_VALUES: &str = "0 1 2 -1 nan inf 1e308 1.5 18446744073709551616
    99999999999999999999999 0x2 +1 ~1 1,2 2,,1 1,0 abc single hybrid allreduce_zero3
    allreduce_dense ps,single sparse_lm dense_mlp nope";

const FLAGS: &str = "--strategy --dump-ir --stop-after --disable-pass --sync --bucket-mb
    --bandwidth --latency --zero --remat --metrics --data --save --checkpoint --checkpoint-every
    --resume --trace --timeout --transport --device --gpus --collectives --format --after -o
    --output --label --json --tolerance -q --quiet --preload --profile --fuse --sparse-as-dense
    --no-cuda-graph --tf32 --help -h --version -- - --nope";

const VALUES: &str = "single allreduce ps hybrid auto sync async stale:0 stale:1
    stale:4294967296 stale:-1 stale: layers off lower autodiff simplify dead_code accumulate remat
    sparsity_analysis place distribute zero fusion kernel_fusion schedule bogus inprocess mpi cpu
    cuda cuda:0 cuda:18446744073709551616 gpu 0 0,1 0,,1 nccl host table json yaml out.json
    out.st out.jsonl out.svg out.png out.pdf . .. ../up.json nodir/x.json m.dsl p.json h.json
    ck.st w.st mt.jsonl ir x é -q --steps";

const SUBCOMMANDS: &str = "compile train run verify explain ir dot plot bench eval predict help x";

/// Values worth giving each flag that takes one (`@budget` for the budget values,
/// `@path` for file names, `@number` for the extreme numbers).
const FLAG_VALUES: &[(&str, &str)] = &[
    ("--strategy", "single allreduce ps hybrid auto Single"),
    (
        "--sync",
        "sync async stale:0 stale:1 stale:2 stale:4294967296 stale:-1 stale: stale",
    ),
    ("--zero", "0 1 2 3 4 255 256 -1"),
    ("--remat", "layers off 0 0.001 1 1e308 -1 nan inf"),
    ("--stop-after", "@pass"),
    ("--disable-pass", "@pass"),
    ("--after", "@pass"),
    ("--transport", "inprocess mpi tcp"),
    (
        "--device",
        "cpu cuda cuda:0 cuda:1 cuda:18446744073709551616 cuda: gpu",
    ),
    ("--gpus", "0 0,1 1,0 0,0 0,,1 18446744073709551616 -1"),
    ("--collectives", "auto nccl host x"),
    ("--format", "table json yaml"),
    ("--checkpoint-every", "1 2 0 -1 18446744073709551616"),
    ("--label", "a b é ~ --x"),
    ("--bucket-mb", "@number"),
    ("--bandwidth", "@number"),
    ("--latency", "@number"),
    ("--tolerance", "@number"),
    ("--timeout", "@number"),
];

/// The flags each subcommand takes (a flag without a value has none listed in
/// `FLAG_VALUES`, and is in `SWITCHES`).
const SUBCOMMAND_FLAGS: &[(&str, &str)] = &[
    ("compile", "@compile -o --output --data"),
    ("train", "@compile @run"),
    ("run", "@run"),
    (
        "verify",
        "@compile --steps --tolerance --data --timeout --transport --device",
    ),
    ("explain", "--format"),
    ("ir", "@compile --after --data"),
    ("dot", "--after --batch"),
    ("plot", "-o --output --label --log-y"),
    (
        "eval",
        "--init --init-partial --resume --data --batch --eval-samples --metrics",
    ),
    (
        "predict",
        "--init --init-partial --resume --input -o --output --batch",
    ),
    (
        "bench",
        "--workloads --strategies --compile --nodes --workers --runs --servers --warmup \
         --steps --transport --json --device --no-cuda-graph",
    ),
];

const COMPILE_FLAGS: &str = "--strategy --dump-ir --stop-after --disable-pass --batch --workers
    --servers --sync --bucket-mb --sparse-as-dense --bandwidth --zero --accumulate --remat --fuse
    --latency";

const RUN_FLAGS: &str = "--steps --metrics --data --save --checkpoint --checkpoint-every --resume
    --init --init-partial -q --trace --preload --profile --timeout --transport --device --gpus --collectives
    --no-cuda-graph --tf32";

const SWITCHES: &str = "--sparse-as-dense --fuse -q --quiet --preload --profile --no-cuda-graph
    --tf32 --compile --log-y --init-partial --help -h --version -V";

const PASSES: &str = "lower autodiff simplify dead_code accumulate remat sparsity_analysis place
    distribute zero fusion kernel_fusion schedule bogus";

const PATHS: &str = "out.json out.st out.jsonl out.svg out.png out.pdf out . .. ../up.json
    nodir/x.json m.dsl d.dsl p.json h.json z.json ck.st ck2.st w.st mt.jsonl ir x é";

/// The flags `subcommand` takes.
fn flags_of(subcommand: &[u8]) -> Vec<String> {
    let Some((_, list)) = SUBCOMMAND_FLAGS
        .iter()
        .find(|(s, _)| s.as_bytes() == subcommand)
    else {
        return Vec::new();
    };
    list.split_whitespace()
        .flat_map(|f| match f {
            "@compile" => words(COMPILE_FLAGS, &[]),
            "@run" => words(RUN_FLAGS, &[]),
            _ => vec![f.to_string()],
        })
        .collect()
}

/// A value for `flag`: one it could take, or (now and then) any extreme.
fn value_for(rng: &mut Rng, flag: &[u8]) -> Vec<u8> {
    let l = lists();
    if is_budget(flag) {
        return rng.pick(&l.budget_values).as_bytes().to_vec();
    }
    let pool = FLAG_VALUES
        .iter()
        .find(|(f, _)| f.as_bytes() == flag)
        .map_or("@path", |(_, v)| *v);
    let pool = match pool {
        _ if rng.chance(1, 6) => l.extremes.clone(),
        "@pass" => words(PASSES, &[""]),
        "@number" => l.extremes.clone(),
        "@path" => words(PATHS, &[""]),
        list => words(list, &[""]),
    };
    rng.pick(&pool).as_bytes().to_vec()
}

fn takes_value(flag: &[u8]) -> bool {
    !words(SWITCHES, &[]).iter().any(|s| s.as_bytes() == flag)
}

/// One mutation that keeps the command line well formed: a flag's value replaced by
/// another it could take, a flag of the subcommand added, or one dropped.
fn mutate_args_gently(rng: &mut Rng, args: &mut Vec<Vec<u8>>, log: &mut Vec<String>) {
    let Some(sub) = args.first().cloned() else {
        return;
    };
    let show = |t: &[u8]| String::from_utf8_lossy(t).into_owned();
    match rng.below(4) {
        0 | 1 => {
            let at: Vec<usize> = (1..args.len())
                .filter(|&i| is_flag(&args[i - 1]) && !is_flag(&args[i]))
                .filter(|&i| takes_value(&args[i - 1]))
                .collect();
            if at.is_empty() {
                return;
            }
            let i = *rng.pick(&at);
            let new = value_for(rng, &args[i - 1]);
            log.push(format!(
                "{} {:?} -> {:?}",
                show(&args[i - 1]),
                show(&args[i]),
                show(&new)
            ));
            args[i] = new;
        }
        2 => {
            let flags = flags_of(&sub);
            if flags.is_empty() {
                return;
            }
            let f = rng.pick(&flags).as_bytes().to_vec();
            let mut new = vec![f.clone()];
            if takes_value(&f) {
                new.push(value_for(rng, &f));
            }
            let line: Vec<String> = new.iter().map(|t| show(t)).collect();
            log.push(format!("add {line:?}"));
            args.extend(new);
        }
        _ => {
            let at: Vec<usize> = (1..args.len())
                .filter(|&i| is_flag(&args[i]) && !is_budget(&args[i]))
                .collect();
            if at.is_empty() {
                return;
            }
            let i = *rng.pick(&at);
            let with_value = takes_value(&args[i]) && i + 1 < args.len();
            log.push(format!("drop {}", show(&args[i])));
            args.drain(i..if with_value { i + 2 } else { i + 1 });
        }
    }
}

fn is_budget(t: &[u8]) -> bool {
    lists().budget_flags.iter().any(|f| f.as_bytes() == t)
}

fn is_flag(t: &[u8]) -> bool {
    t.starts_with(b"-")
}

/// One mutation of a command line.
fn mutate_args(rng: &mut Rng, args: &mut Vec<Vec<u8>>, log: &mut Vec<String>) {
    // A token is protected when it is a budget flag or a budget flag's value.
    let protected = |a: &[Vec<u8>], i: usize| is_budget(&a[i]) || (i > 0 && is_budget(&a[i - 1]));
    let value = |rng: &mut Rng| -> Vec<u8> {
        if rng.chance(1, 3) {
            rng.pick(&lists().extremes).as_bytes().to_vec()
        } else {
            rng.pick(&lists().values).as_bytes().to_vec()
        }
    };
    let n = args.len();
    match rng.below(9) {
        0 | 1 if n > 0 => {
            let i = rng.below(n);
            let new = if i > 0 && is_budget(&args[i - 1]) {
                rng.pick(&lists().budget_values).as_bytes().to_vec()
            } else if is_budget(&args[i]) {
                return;
            } else if i == 0 && rng.chance(1, 2) {
                rng.pick(&lists().subcommands).as_bytes().to_vec()
            } else if is_flag(&args[i]) {
                rng.pick(&lists().flags).as_bytes().to_vec()
            } else {
                value(rng)
            };
            log.push(format!(
                "arg {i}: {:?} -> {:?}",
                String::from_utf8_lossy(&args[i]),
                String::from_utf8_lossy(&new)
            ));
            args[i] = new;
        }
        2 if n > 0 => {
            let i = rng.below(n);
            if protected(args, i) {
                return;
            }
            log.push(format!(
                "drop arg {i} {:?}",
                String::from_utf8_lossy(&args[i])
            ));
            args.remove(i);
        }
        3 | 4 => {
            let at = rng.below(n + 1);
            let f = rng.pick(&lists().flags);
            let mut new = vec![f.as_bytes().to_vec()];
            if rng.chance(2, 3) {
                new.push(value(rng));
            }
            if rng.chance(1, 8) {
                let b = rng.pick(&lists().budget_flags);
                new = vec![
                    b.as_bytes().to_vec(),
                    rng.pick(&lists().budget_values).as_bytes().to_vec(),
                ];
            }
            log.push(format!(
                "insert {:?} at {at}",
                new.iter()
                    .map(|t| String::from_utf8_lossy(t).into_owned())
                    .collect::<Vec<_>>()
            ));
            args.splice(at..at, new);
        }
        5 if n > 0 => {
            let i = rng.below(n);
            log.push(format!("repeat arg {i}"));
            let t = args[i].clone();
            args.insert(i, t);
            if i + 2 < args.len() && is_flag(&args[i + 1]) && !is_flag(&args[i + 2]) {
                let v = args[i + 2].clone();
                args.insert(i + 1, v);
            }
        }
        6 if n > 1 => {
            let i = rng.below(n - 1);
            if protected(args, i) || protected(args, i + 1) || (i + 2 < n && protected(args, i + 2))
            {
                return;
            }
            log.push(format!("swap args {i} and {}", i + 1));
            args.swap(i, i + 1);
        }
        7 if n > 1 => {
            // `--flag value` as `--flag=value`.
            let i = rng.below(n - 1);
            if is_flag(&args[i]) && !is_flag(&args[i + 1]) && !protected(args, i) {
                log.push(format!("join args {i} and {} with =", i + 1));
                let v = args.remove(i + 1);
                args[i].push(b'=');
                args[i].extend(v);
            }
        }
        8 if n > 0 => {
            let i = rng.below(n);
            if protected(args, i) {
                return;
            }
            let t = &mut args[i];
            let at = rng.below(t.len() + 1);
            const PIECES: [&[u8]; 10] = [
                b"\xff",
                b"\xc3",
                "é".as_bytes(),
                b" ",
                b"=",
                b",",
                b"-",
                b"0",
                b"\t",
                b"\\",
            ];
            let with = rng.pick(&PIECES);
            log.push(format!("insert {with:?} into arg {i} at {at}"));
            t.splice(at..at, with.iter().copied());
        }
        _ => {}
    }
}

/// A `bench` command line (made by mutation from another) gets every flag that bounds
/// its work it lacks, so that it cannot run the whole benchmark.
fn with_budget(args: &mut Vec<Vec<u8>>) {
    if !args.iter().any(|a| a == b"bench") {
        return;
    }
    for (flag, value) in [
        ("--workloads", "dense_mlp"),
        ("--strategies", "single"),
        ("--workers", "1"),
        ("--runs", "1"),
        ("--warmup", "0"),
        ("--steps", "1"),
        ("--nodes", "200"),
    ] {
        if !args.iter().any(|a| a.starts_with(flag.as_bytes())) {
            args.push(flag.as_bytes().to_vec());
            args.push(value.as_bytes().to_vec());
        }
    }
}

/// Keeps every path the command line names inside the run's temporary folder: no
/// absolute paths, at most one `..` (the run's folder is two levels down), no NUL.
fn sanitize(args: &mut [Vec<u8>]) {
    for a in args.iter_mut() {
        a.retain(|&b| b != 0);
        let dots = a.windows(2).filter(|w| w == b"..").count();
        let absolute = a.starts_with(b"/") || a.windows(2).any(|w| w == b"=/");
        if dots > 1 || absolute || a.starts_with(b"~") {
            *a = b"x".to_vec();
        }
    }
}

fn shell_line(args: &[Vec<u8>]) -> String {
    let mut line = String::from("distc");
    for a in args {
        let s = String::from_utf8_lossy(a);
        if !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.,:/=+".contains(&b))
            && std::str::from_utf8(a).is_ok()
        {
            line.push(' ');
            line.push_str(&s);
        } else {
            line.push_str(&format!(" '{}'", s.replace('\'', "'\\''")));
        }
    }
    line
}

/// Runs `distc ARGS` in `cwd`, killed (its whole process group) after `limit`.
fn run_cli(cwd: &Path, tmp: &Path, args: &[Vec<u8>], limit: Duration) -> Result<Outcome, Fail> {
    let out_path = tmp.join("stdout");
    let err_path = tmp.join("stderr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_distc"))
        .args(args.iter().map(|a| OsString::from_vec(a.clone())))
        .current_dir(cwd)
        .env("TMPDIR", tmp)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .process_group(0)
        .spawn()
        .expect("distc starts");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("waits") {
            break Some(s);
        }
        if start.elapsed() > limit {
            // The group: `distc bench` runs children of its own.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = std::fs::read(&out_path).unwrap_or_default();
    let stderr = std::fs::read(&err_path).unwrap_or_default();
    let text = format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        show(&stdout, 3000),
        show(&stderr, 6000)
    );
    let Some(status) = status else {
        return Err(Fail::Hang(format!(
            "killed after {:.1} s\n{text}",
            limit.as_secs_f64()
        )));
    };
    let said = |w: &str| {
        String::from_utf8_lossy(&stderr).contains(w) || String::from_utf8_lossy(&stdout).contains(w)
    };
    if said("panicked") || said("RUST_BACKTRACE") {
        return Err(Fail::Panic(format!("a panic message ({status})\n{text}")));
    }
    if said("internal error") {
        return Err(Fail::Wrong(format!("an internal error ({status})\n{text}")));
    }
    match status.code() {
        Some(0) => Ok(Outcome::Accepted),
        // 75: a rehearsed lost worker (`--fail-worker`), refused as a run that lost one.
        Some(c @ (1 | 2 | 75)) => {
            let err = String::from_utf8_lossy(&stderr);
            let last = err.lines().rev().find(|l| !l.trim().is_empty());
            Ok(Outcome::Refused(format!(
                "exit {c}: {}",
                last.unwrap_or("")
            )))
        }
        _ => Err(Fail::Panic(format!("exit status {status}\n{text}"))),
    }
}

#[test]
fn cli() {
    let work = temp_dir();
    let fixture_dir = work.path().join("fixtures");
    std::fs::create_dir_all(&fixture_dir).expect("a folder");
    let fixtures = make_fixtures(&fixture_dir, true);
    let mut commands: Vec<&str> = COMMANDS.to_vec();
    if data_dir().is_some() {
        commands.extend(DATA_COMMANDS);
    }
    let dsls: Vec<Vec<u8>> = named(&fixtures, &[".dsl"]);
    let metrics = named(&fixtures, &[".jsonl"]);
    let dsl_mutator = Mutator {
        numbers: &lists().cheap,
        words: &lists().dsl,
        corpus: &dsls,
        raw: false,
    };
    let metrics_mutator = Mutator {
        numbers: &lists().extremes,
        words: &lists().json,
        corpus: &metrics,
        raw: true,
    };
    let limit = settings().hang;
    fuzz(
        "cli",
        |rng, _| {
            let which = rng.below(commands.len());
            let mut args: Vec<Vec<u8>> = commands[which]
                .split_whitespace()
                .map(|a| a.as_bytes().to_vec())
                .collect();
            let mut log = Vec::new();
            // A third of the command lines stay as they are (and get a damaged input
            // file), a third get well-formed changes, a third any change.
            let mode = rng.below(3);
            for _ in 0..if mode == 0 { 0 } else { rng.count() } {
                if mode == 1 {
                    mutate_args_gently(rng, &mut args, &mut log);
                } else {
                    mutate_args(rng, &mut args, &mut log);
                }
            }
            with_budget(&mut args);
            sanitize(&mut args);
            let mut files = vec![("argv.txt".to_string(), shell_line(&args).into_bytes())];
            // Now and then one input file is damaged too.
            let mut damaged: Option<(String, Vec<u8>)> = None;
            if mode == 0 || rng.chance(1, 4) {
                // Mostly a file the command line names.
                let named: Vec<&(String, Vec<u8>)> = fixtures
                    .iter()
                    .filter(|(n, _)| args.iter().any(|a| a == n.as_bytes()))
                    .collect();
                let (name, bytes) = if !named.is_empty() && rng.chance(4, 5) {
                    (*rng.pick(&named)).clone()
                } else {
                    rng.pick(&fixtures).clone()
                };
                let mut t = bytes;
                log.push(format!("{name} mutated:"));
                if name.ends_with(".dsl") {
                    dsl_mutator.mutate_any(rng, &mut t, &mut log);
                } else if name.ends_with(".json") {
                    t = mutate_plan(rng, std::slice::from_ref(&t), &mut log);
                } else if name.ends_with(".st") {
                    t = mutate_checkpoint(rng, std::slice::from_ref(&t), &mut log);
                } else {
                    metrics_mutator.mutate_any(rng, &mut t, &mut log);
                }
                files.push((name.clone(), t.clone()));
                damaged = Some((name, t));
            }
            let what = format!("{}\n{}", shell_line(&args), log.join("\n"));
            let fixture_dir = fixture_dir.clone();
            let base = work.path().to_path_buf();
            Case {
                what,
                files,
                run: Box::new(move || {
                    let tmp = TempDir::new_in(&base).expect("a run folder");
                    let cwd = tmp.path().join("a").join("b");
                    std::fs::create_dir_all(&cwd).expect("a run folder");
                    for e in std::fs::read_dir(&fixture_dir).expect("fixtures").flatten() {
                        if e.path().is_file() {
                            std::fs::copy(e.path(), cwd.join(e.file_name())).expect("a copy");
                        }
                    }
                    if let Some((name, bytes)) = &damaged {
                        std::fs::write(cwd.join(name), bytes).expect("the damaged file");
                    }
                    run_cli(&cwd, tmp.path(), &args, limit)
                }),
            }
        },
        false,
    );
}

// ---------------------------------------------------------------------------------
// Target 5: `simulate`'s input files (calibrations and traces), read in this process.
// ---------------------------------------------------------------------------------

/// Whether a simulated step is made of finite, non-negative times: what a file
/// `simulate` accepts must give (not `inf` ms, a NaN% overlap or a negative efficiency).
fn finite_step(s: &distc::simulate::Simulation) -> Result<Outcome, Fail> {
    let times = [
        ("step", s.step),
        ("compute", s.compute),
        ("comm", s.comm),
        ("exposed_comm", s.exposed_comm),
        ("single_step", s.single_step),
        ("scaling_efficiency", s.scaling_efficiency),
    ];
    for (name, x) in times {
        if !(x.is_finite() && x >= 0.0) {
            return Err(Fail::Wrong(format!(
                "accepted, but the simulated {name} is {x}"
            )));
        }
    }
    if !s.overlap.is_finite() {
        return Err(Fail::Wrong(format!(
            "accepted, but the overlap is {}",
            s.overlap
        )));
    }
    Ok(Outcome::Accepted)
}

/// `simulate --calibration FILE` and `simulate --trace FILE`: a calibration written by
/// `distc calibrate` and a trace by `distc train --trace`, mutated, read as `simulate`
/// reads them (`Calibration::from_json`; `spans_of_chrome_trace`, `check_spans_of`
/// against the model on one device, `ComputeProfile::from_trace`), then simulated on 2
/// workers: an accepted file must give finite times.
#[test]
fn simulate_files() {
    use distc::simulate::{self as sim, Calibration, ComputeProfile, Links};
    use std::sync::Arc;
    let work = temp_dir();
    let dir = work.path();
    make_fixtures(dir, false);
    distc_ok(
        dir,
        &[
            "calibrate",
            "--workers",
            "2",
            "--sizes",
            "4096,65536,1048576",
            "--reps",
            "1",
            "-o",
            "cal.json",
        ],
    );
    distc_ok(
        dir,
        &[
            "train",
            "m.dsl",
            "--steps",
            "5",
            "-q",
            "--trace",
            "trace.json",
        ],
    );
    let read = |n: &str| std::fs::read(dir.join(n)).expect("a fixture");
    let seeds: Files = vec![
        ("cal.json".into(), read("cal.json")),
        ("trace.json".into(), read("trace.json")),
    ];
    let corpus: Vec<Vec<u8>> = seeds.iter().map(|(_, b)| b.clone()).collect();
    // The programs the files are read against: m.dsl on one device, and on 2 workers.
    let src = std::fs::read_to_string(dir.join("m.dsl")).expect("m.dsl");
    let compiled = |strategy: &StrategyConfig| {
        let opts = CompileOptions {
            strategy: strategy.clone(),
            ..Default::default()
        };
        compile("m.dsl", &src, &opts).expect("m.dsl compiles")
    };
    let cfg = StrategyConfig {
        strategy: Strategy::Allreduce,
        workers: 2,
        ..StrategyConfig::default()
    };
    let single = Arc::new(compiled(&StrategyConfig::default()).programs.worker);
    let worker = Arc::new(compiled(&cfg).programs.worker);
    let cfg = Arc::new(cfg);
    // The seeds are accepted: the target starts from files simulate reads.
    let own = spans_profile(&single, &seeds[1].1).expect("the trace's own profile");
    Calibration::from_json(&String::from_utf8_lossy(&seeds[0].1)).expect("the calibration");
    let own = Arc::new(own);
    let json = Mutator {
        numbers: &lists().extremes,
        words: &lists().json,
        corpus: &corpus,
        raw: true,
    };
    fuzz(
        "simulate",
        |rng, _| {
            let (name, seed) = rng.pick(&seeds).clone();
            let mut log = vec![format!("from {name}")];
            let t = if rng.chance(1, 3) {
                let mut t = seed;
                json.mutate_any(rng, &mut t, &mut log);
                t
            } else {
                let mut v: Value = serde_json::from_slice(&seed).expect("JSON");
                for _ in 0..rng.count() {
                    mutate_json(rng, &mut v, &json, &mut log);
                }
                v.to_string().into_bytes()
            };
            let (single, worker, cfg, own) =
                (single.clone(), worker.clone(), cfg.clone(), own.clone());
            Case {
                what: log.join("\n"),
                files: vec![(name.clone(), t.clone())],
                run: Box::new(move || {
                    let (links, profile) = if name == "cal.json" {
                        match Calibration::from_json(&String::from_utf8_lossy(&t)) {
                            Err(e) => return refused(e),
                            Ok(c) => {
                                let _ = c.render();
                                let mut links = Links::new(c.link, c.link);
                                links.inter_measured = c.ring_steps();
                                links.intra_measured = c.ring_steps();
                                (links, (*own).clone())
                            }
                        }
                    } else {
                        match spans_profile(&single, &t) {
                            Err(e) => return refused(e),
                            Ok(p) => {
                                let l = distc_passes::placement::Link::default_intra();
                                (Links::new(l, l), p)
                            }
                        }
                    };
                    let s = sim::simulate(
                        &worker,
                        &single,
                        &cfg,
                        links,
                        &profile,
                        &Default::default(),
                        0,
                    );
                    finite_step(&s)
                }),
            }
        },
        true,
    );

    /// A trace file's profile of `g`, as `simulate --trace` takes it.
    fn spans_profile(g: &distc_ir::Graph, bytes: &[u8]) -> Result<ComputeProfile, String> {
        let spans =
            distc_runtime::run::trace::spans_of_chrome_trace(&String::from_utf8_lossy(bytes))?;
        sim::check_spans_of(g, &spans)?;
        ComputeProfile::from_trace(g, &spans, 1e10, "fuzz".into())
    }
}

// ---------------------------------------------------------------------------------
// Target 6: data files a user brings (issue 60, item 11), opened in this process.
// ---------------------------------------------------------------------------------

/// A `.npy` file of little-endian values (`descr`), C order.
fn npy(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while !(10 + dict.len() + 1).is_multiple_of(64) {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((dict.len() as u16).to_le_bytes());
    out.extend(dict.into_bytes());
    out.extend(data);
    out
}

/// One data source the target fuzzes: its train block's `data = ...`, its model's
/// inputs, and its files by name.
struct DataFixture {
    source: &'static str,
    inputs: &'static str,
    logits: &'static str,
    /// The rows of what the model indexes with its integer inputs.
    rows: usize,
    files: Vec<(String, Vec<u8>)>,
}

fn data_fixtures() -> Vec<DataFixture> {
    let n = 24;
    let x: Vec<f32> = (0..n * 4)
        .map(|i| ((i * 7) % 11) as f32 * 0.25 - 1.0)
        .collect();
    let label: Vec<i64> = (0..n as i64).map(|i| i % 3).collect();
    let xb: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let lb: Vec<u8> = label.iter().flat_map(|v| v.to_le_bytes()).collect();
    let st = st_bytes(&vec![
        (
            "features".into(),
            safetensors::Dtype::F32,
            vec![n, 4],
            xb.clone(),
        ),
        ("label".into(), safetensors::Dtype::I64, vec![n], lb.clone()),
    ]);
    let mut csv = "a,label\n".to_string();
    for i in 0..n {
        csv += &format!("{},{}\n", x[i], label[i]);
    }
    let tokens: Vec<u8> = (0..400u16)
        .flat_map(|i| ((i * 7) % 50).to_le_bytes())
        .collect();
    let features = "input features: f32[B, 4]\n  input label: i32[B]";
    let points = "features @ w + b";
    vec![
        DataFixture {
            source: r#"tensors(path = "train.safetensors", eval_path = "train.safetensors")"#,
            inputs: features,
            logits: points,
            rows: 3,
            files: vec![("train.safetensors".into(), st)],
        },
        DataFixture {
            source: r#"tensors(path = "arrays", eval_path = "arrays")"#,
            inputs: features,
            logits: points,
            rows: 3,
            files: vec![
                ("arrays/features.npy".into(), npy("<f4", &[n, 4], &xb)),
                ("arrays/label.npy".into(), npy("<i8", &[n], &lb)),
            ],
        },
        DataFixture {
            source: r#"csv(path = "train.csv", eval_path = "train.csv")"#,
            inputs: "input a: f32[B]\n  input label: i32[B]",
            logits: "reshape(a, [-1, 1]) @ w1 + b",
            rows: 3,
            files: vec![("train.csv".into(), csv.into_bytes())],
        },
        DataFixture {
            source: r#"tokens(path = "train.bin", eval_path = "train.bin", dtype = "u16", context = 4)"#,
            inputs: "input tokens: i32[B, 4]\n  input targets: i32[B, 4]",
            logits: "",
            rows: 50,
            files: vec![("train.bin".into(), tokens)],
        },
    ]
}

/// The model a fixture trains: a linear classifier of 3 classes, or for tokens an
/// embedding of 50 rows predicting the next token.
fn data_model(f: &DataFixture) -> String {
    let body = if f.logits.is_empty() {
        "param emb: f32[50, 8] = uniform(-0.05, 0.05)\n  param w: f32[8, 50] = glorot\n  \
         x = reshape(embedding(emb, tokens), [-1, 8])\n  \
         minimize softmax_cross_entropy(x @ w, reshape(targets, [-1]))"
            .to_string()
    } else {
        format!(
            "param w: f32[4, 3] = glorot\n  param w1: f32[1, 3] = glorot\n  \
             param b: f32[3] = zeros\n  minimize softmax_cross_entropy({}, label)",
            f.logits
        )
    };
    format!(
        "model fuzzed {{\n  {}\n  {body}\n}}\ntrain {{\n  data = {}\n  batch = 4\n  \
         optimizer = sgd(lr = 0.1)\n  steps = 3\n  seed = 1\n}}\n",
        f.inputs, f.source
    )
}

/// A structured mutation of a data file: a CSV cell, a `.npy` header's order, type or
/// shape, a token id; values a careless user writes.
fn mutate_data_structure(rng: &mut Rng, name: &str, t: &mut Vec<u8>, log: &mut Vec<String>) {
    const CELLS: [&str; 12] = [
        "NaN",
        "inf",
        "-inf",
        "-1",
        "3",
        "7",
        "1e39",
        "",
        "x",
        "2147483648",
        "0.5",
        "-0",
    ];
    if name.ends_with(".csv") {
        let text = String::from_utf8_lossy(t).into_owned();
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        if lines.len() > 1 {
            let row = 1 + rng.below(lines.len() - 1);
            let mut cells: Vec<String> = lines[row].split(',').map(str::to_string).collect();
            let col = rng.below(cells.len());
            let cell = rng.pick(&CELLS);
            log.push(format!("line {row} column {col} -> {cell:?}"));
            cells[col] = cell.to_string();
            lines[row] = cells.join(",");
        }
        *t = (lines.join("\n") + "\n").into_bytes();
    } else if name.ends_with(".npy") {
        let text = String::from_utf8_lossy(t).into_owned();
        let swaps: [(&str, &str); 9] = [
            ("False", "True"),
            ("<f4", "<f8"),
            ("<f4", ">f4"),
            ("<f4", "<f2"),
            ("<i8", "<i4"),
            ("<i8", "|u1"),
            ("<i8", "<f4"),
            ("(24,", "(25,"),
            ("(24, 4)", "(6, 16)"),
        ];
        let (from, to) = rng.pick(&swaps);
        if text.contains(from) {
            log.push(format!("header {from:?} -> {to:?}"));
            let cut = t.len().min(128);
            let head = String::from_utf8_lossy(&t[..cut]).replacen(from, to, 1);
            let mut out = head.into_bytes();
            out.extend_from_slice(&t[cut..]);
            *t = out;
        }
    } else if name.ends_with(".bin") && t.len() >= 2 {
        let at = 2 * rng.below(t.len() / 2);
        let id = *rng.pick(&[49u16, 50, 0x7fff, 0xffff]);
        log.push(format!("token at byte {at} -> {id}"));
        t[at..at + 2].copy_from_slice(&id.to_le_bytes());
    }
}

/// Opens the fixture's source as `distc train` does (the model's inputs, then the
/// model against what the files hold), draws batches and the held-out set; what it
/// accepts must be what the model can train on: finite floats, ids within the rows
/// the model indexes. Otherwise it trained silently on what it should have refused.
fn open_fuzzed_data(dir: &Path, model: &str, rows: usize) -> Result<Outcome, Fail> {
    use distc_runtime::run::data::DataSource;
    let opts = CompileOptions {
        data_dir: Some(dir.to_path_buf()),
        ..CompileOptions::default()
    };
    let c = match compile("fuzzed.dsl", model, &opts) {
        Ok(c) => c,
        Err(e) => return refused(e.to_string()),
    };
    let graph = &c.programs.worker;
    let shapes = distc_runtime::run::programs::input_types(graph);
    let spec = &c.config.data;
    let mut source = match DataSource::open(
        spec,
        Some(dir),
        &shapes,
        c.config.batch,
        c.config.seed,
        0,
        1,
    ) {
        Ok(s) => s,
        Err(e) => return refused(e.to_string()),
    };
    if let Err(e) = source.check_model(graph, c.config.batch) {
        return refused(e.to_string());
    }
    let mut batches = Vec::new();
    for _ in 0..3 {
        match source.next_batch() {
            Ok(b) => batches.push(b),
            Err(e) => return refused(e.to_string()),
        }
    }
    match source.eval_batches(None) {
        Ok(b) => batches.extend(b),
        Err(e) => return refused(e.to_string()),
    }
    for batch in &batches {
        for (name, t) in batch {
            let ints = matches!(t, distc_runtime::Tensor::I32(_));
            for v in t.to_f64_vec() {
                if !v.is_finite() || (ints && (v < 0.0 || v >= rows as f64)) {
                    return Err(Fail::Wrong(format!(
                        "accepted, and a batch's `{name}` holds {v}: the model trains on it"
                    )));
                }
            }
        }
    }
    Ok(Outcome::Accepted)
}

#[test]
fn data_files() {
    let work = temp_dir();
    let fixtures = data_fixtures();
    let corpus: Vec<Vec<u8>> = fixtures
        .iter()
        .flat_map(|f| f.files.iter().map(|(_, b)| b.clone()))
        .collect();
    fuzz(
        "data_files",
        |rng, index| {
            // A folder an input: the decoded-source cache knows files by path, inode,
            // length and time, which a file rewritten in place may all keep.
            let dir = work.path().join(format!("data-{index}"));
            let f = rng.pick(&fixtures);
            let mut files = f.files.clone();
            let which = rng.below(files.len());
            let name = files[which].0.clone();
            let mut log = vec![format!("{} from {name}", f.source)];
            let text = Mutator {
                numbers: &lists().extremes,
                words: &lists().json,
                corpus: &corpus,
                raw: true,
            };
            match rng.below(4) {
                0 | 1 => mutate_data_structure(rng, &name, &mut files[which].1, &mut log),
                2 if name.ends_with(".safetensors") => {
                    files[which].1 = mutate_checkpoint(rng, &[files[which].1.clone()], &mut log)
                }
                _ => text.mutate(rng, &mut files[which].1, &mut log),
            }
            let (model, rows) = (data_model(f), f.rows);
            Case {
                what: log.join("\n"),
                files: vec![(name.replace('/', "-"), files[which].1.clone())],
                run: Box::new(move || {
                    for (name, bytes) in &files {
                        let path = dir.join(name);
                        if let Some(parent) = path.parent() {
                            std::fs::create_dir_all(parent).expect("a folder");
                        }
                        std::fs::write(&path, bytes).expect("a data file");
                    }
                    let outcome = open_fuzzed_data(&dir, &model, rows);
                    let _ = std::fs::remove_dir_all(&dir);
                    outcome
                }),
            }
        },
        true,
    );
}

// ---------------------------------------------------------------------------------
// Target 7: `--init` weights files (issue 60, item 11), read into a model as `distc
// train --init` reads them.
// ---------------------------------------------------------------------------------

/// The model `--init` files are fuzzed against: a linear layer, batch norm (with its
/// running statistics, frozen variables `g_running_mean` and `g_running_var`) and a
/// classifier.
const INIT_MODEL: &str = "model inited {\n  input x: f32[B, 4]\n  input label: i32[B]\n  \
    param w: f32[4, 6] = glorot\n  param g: f32[6] = ones\n  param bb: f32[6] = zeros\n  \
    param wo: f32[6, 3] = glorot\n  h = relu(batch_norm(x @ w, g, bb, sync = false))\n  \
    minimize softmax_cross_entropy(h @ wo, label)\n}\ntrain {\n  \
    data = gaussian_classes(features = 4, classes = 3)\n  batch = 8\n  \
    optimizer = adam(lr = 0.01)\n  steps = 1\n  seed = 3\n  eval_samples = 16\n}\n";

/// A weights file's tensors: name, safetensors dtype, shape and little-endian bytes.
type StTensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// The safetensors file of `tensors` (each one's bytes fit its dtype and shape).
fn st_bytes(tensors: &StTensors) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            let view = safetensors::tensor::TensorView::new(*d, s.clone(), b);
            (n.clone(), view.expect("bytes that fit the dtype and shape"))
        })
        .collect();
    safetensors::serialize(views, None).expect("safetensors")
}

/// The value `v` as `dtype`'s little-endian bytes (`None`: a dtype not written here).
fn encode_as(dtype: safetensors::Dtype, v: f64) -> Option<Vec<u8>> {
    use safetensors::Dtype as D;
    Some(match dtype {
        D::F32 => (v as f32).to_le_bytes().to_vec(),
        D::F64 => v.to_le_bytes().to_vec(),
        D::BF16 => ((v as f32).to_bits() >> 16).to_le_bytes()[..2].to_vec(),
        D::I64 => (v as i64).to_le_bytes().to_vec(),
        D::I32 => (v as i32).to_le_bytes().to_vec(),
        D::U8 => vec![v as u8],
        D::BOOL => vec![u8::from(v != 0.0)],
        _ => return None,
    })
}

/// A structured mutation of `--init` tensors: what a user's conversion from PyTorch
/// gets wrong (dtypes, shapes, names, `num_batches_tracked`), and values that must not
/// train (NaN, infinities, an f64 beyond f32, a negative running variance).
fn mutate_init_structure(rng: &mut Rng, tensors: &mut StTensors, log: &mut Vec<String>) {
    use safetensors::Dtype as D;
    let i = rng.below(tensors.len());
    let f32s = |b: &[u8]| -> Vec<f64> {
        b.chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect()
    };
    match rng.below(6) {
        0 if tensors[i].1 == D::F32 => {
            // The same values as another dtype, one perhaps replaced by an extreme.
            let dtype = *rng.pick(&[D::F64, D::BF16, D::I64, D::I32, D::U8, D::BOOL]);
            let mut values = f32s(&tensors[i].3);
            if dtype == D::F64 && !values.is_empty() && rng.chance(1, 2) {
                let at = rng.below(values.len());
                values[at] = *rng.pick(&[1e300, -1e300, 3.5e38, f64::NAN, f64::INFINITY]);
                log.push(format!("{} [{at}] = {}", tensors[i].0, values[at]));
            }
            log.push(format!("{} as {dtype:?}", tensors[i].0));
            tensors[i].3 = values
                .iter()
                .flat_map(|v| encode_as(dtype, *v).unwrap_or_default())
                .collect();
            tensors[i].1 = dtype;
        }
        1 if tensors[i].1 == D::F32 && !tensors[i].3.is_empty() => {
            let at = rng.below(tensors[i].3.len() / 4);
            let v = *rng.pick(&[
                f32::NAN,
                f32::INFINITY,
                -f32::INFINITY,
                -1.0,
                -1e-30,
                0.0,
                1e-45,
                f32::MAX,
            ]);
            log.push(format!("{} [{at}] = {v}", tensors[i].0));
            tensors[i].3[4 * at..4 * at + 4].copy_from_slice(&v.to_le_bytes());
        }
        2 => {
            let shape = &mut tensors[i].2;
            let before = shape.clone();
            match rng.below(4) {
                0 => shape.reverse(),
                1 => shape.insert(0, 1),
                2 => *shape = vec![shape.iter().product()],
                _ => {
                    shape.pop();
                }
            }
            // The bytes follow the shape (cut, or zeros added): the file stays valid
            // and says the new shape.
            let size = tensors[i].3.len() / before.iter().product::<usize>().max(1);
            let len = size * tensors[i].2.iter().product::<usize>();
            tensors[i].3.resize(len, 0);
            log.push(format!(
                "{} shape {before:?} -> {:?}",
                tensors[i].0, tensors[i].2
            ));
        }
        3 => {
            let name = tensors[i].0.clone();
            let renamed = match rng.below(3) {
                0 => format!("model.{name}"),
                1 => name.to_uppercase(),
                _ => format!("{name}.weight"),
            };
            log.push(format!("{name} renamed {renamed}"));
            tensors[i].0 = renamed;
        }
        4 => {
            let gone = tensors.remove(i);
            log.push(format!("{} dropped", gone.0));
        }
        _ => {
            let (name, dtype) = *rng.pick(&[
                ("g_num_batches_tracked", D::I64),
                ("extra", D::U8),
                ("w", D::F32),
                ("g_running_var", D::F16),
                ("x", D::BOOL),
            ]);
            log.push(format!("extra {name} ({dtype:?})"));
            let bytes = match dtype {
                D::F16 => [0, 0x3c].repeat(6),
                D::F32 => 0.5f32.to_le_bytes().repeat(24),
                _ => encode_as(dtype, 7.0).unwrap_or_default(),
            };
            let shape = match dtype {
                D::F16 => vec![6],
                D::F32 => vec![4, 6],
                _ => vec![],
            };
            tensors.retain(|t| t.0 != name);
            tensors.push((name.to_string(), dtype, shape, bytes));
        }
    }
}

/// Reads `path` as `distc train --init` does, into the model `c`; what it accepts
/// must be what the model can train from: every variable of the model's type, finite,
/// a running variance not below 0, and the model evaluates on it.
fn init_fuzzed(c: &distc::Compiled, path: &Path, partial: bool) -> Result<Outcome, Fail> {
    let (weights, foreign) = match checkpoint::load_weights(path) {
        Ok(w) => w,
        Err(e) => return refused(e.to_string()),
    };
    let programs = c.programs(1);
    let state = match distc_runtime::run::state::state_from_weights(
        &programs,
        &c.config,
        (&weights, &foreign),
        partial,
    ) {
        Ok((state, _)) => state,
        Err(e) => return refused(e.to_string()),
    };
    let model = distc_runtime::run::programs::init_params(programs.worker, c.config.seed);
    for (name, init) in &model {
        let Some(t) = state.params.get(name) else {
            return Err(Fail::Wrong(format!(
                "accepted, and the state lacks `{name}`"
            )));
        };
        if t.dtype() != init.dtype() || t.shape() != init.shape() {
            return Err(Fail::Wrong(format!(
                "accepted, and `{name}` is {:?} {:?}; the model's is {:?} {:?}",
                t.dtype(),
                t.shape(),
                init.dtype(),
                init.shape()
            )));
        }
        for v in t.to_f64_vec() {
            if !v.is_finite() || (name.ends_with("_running_var") && v < 0.0) {
                return Err(Fail::Wrong(format!(
                    "accepted, and `{name}` holds {v}: the model trains from it"
                )));
            }
        }
    }
    match distc_runtime::run::eval::evaluate_weights(
        programs.worker,
        &c.config,
        &state.params,
        None,
    ) {
        Ok(_) => Ok(Outcome::Accepted),
        Err(e) => refused(e.to_string()),
    }
}

#[test]
fn init_files() {
    let work = temp_dir();
    let c = std::sync::Arc::new(
        compile("inited.dsl", INIT_MODEL, &CompileOptions::default()).expect("the model compiles"),
    );
    let whole = distc_runtime::run::programs::init_params(&c.programs.worker, c.config.seed);
    let mut names: Vec<&String> = whole.keys().collect();
    names.sort();
    let mut base: StTensors = names
        .iter()
        .map(|n| {
            let t = &whole[*n];
            let bytes = t
                .to_f64_vec()
                .iter()
                .flat_map(|v| (*v as f32).to_le_bytes())
                .collect();
            (
                (*n).clone(),
                safetensors::Dtype::F32,
                t.shape().to_vec(),
                bytes,
            )
        })
        .collect();
    // As PyTorch's batch norm writes it beside the statistics.
    base.push((
        "g_num_batches_tracked".into(),
        safetensors::Dtype::I64,
        vec![],
        3i64.to_le_bytes().to_vec(),
    ));
    let corpus = vec![st_bytes(&base)];
    let path = work.path().join("fuzzed.safetensors");
    fuzz(
        "init_files",
        |rng, _| {
            let partial = rng.chance(1, 2);
            let mut log = vec![format!(
                "--init{}",
                if partial { " --init-partial" } else { "" }
            )];
            let bytes = if rng.chance(2, 3) {
                let mut tensors = base.clone();
                if rng.chance(1, 2) {
                    tensors.retain(|t| t.0 != "g_num_batches_tracked");
                }
                for _ in 0..1 + rng.below(2) {
                    if !tensors.is_empty() {
                        mutate_init_structure(rng, &mut tensors, &mut log);
                    }
                }
                st_bytes(&tensors)
            } else {
                mutate_checkpoint(rng, &corpus, &mut log)
            };
            let (path, c) = (path.clone(), c.clone());
            Case {
                what: log.join("\n"),
                files: vec![("init.safetensors".into(), bytes.clone())],
                run: Box::new(move || {
                    std::fs::write(&path, &bytes).expect("the weights written");
                    init_fuzzed(&c, &path, partial)
                }),
            }
        },
        true,
    );
}

// ---------------------------------------------------------------------------------
// Target 8: sharded training states (issue 60, item 11): a state's folder (its
// manifest and one shard a worker) mutated, read as `--resume DIR` reads it.
// ---------------------------------------------------------------------------------

/// A committed sharded state's files by name, and the state they hold.
struct ShardedFixture {
    layout: &'static str,
    files: Files,
    state: checkpoint::TrainingState,
}

/// Sharded states `distc train --sharded` writes: ZeRO-3 chunks on a model axis, and
/// pipeline stages of model ranks (each shard holding other variables).
fn sharded_fixtures(dir: &Path) -> Vec<ShardedFixture> {
    let model = root().join("tests/models/adam_mlp.dsl");
    let model = model.to_str().expect("a UTF-8 path");
    let layouts: [(&str, &[&str]); 2] = [
        ("mesh-zero3", &["--mesh", "data=2,model=2", "--zero", "3"]),
        (
            "pipe-mesh",
            &["--mesh", "data=2,model=2,pipe=2", "--micro-batches", "2"],
        ),
    ];
    layouts
        .into_iter()
        .map(|(layout, flags)| {
            let out = dir.join(layout);
            let mut args = vec![
                "train",
                model,
                "--steps",
                "2",
                "-q",
                "--checkpoint-every",
                "2",
            ];
            args.extend(flags);
            args.extend(["--checkpoint", out.to_str().expect("UTF-8"), "--sharded"]);
            distc_ok(dir, &args);
            let step = out.join("step-000000002");
            let mut files: Files = std::fs::read_dir(&step)
                .expect("the state's folder")
                .flatten()
                .map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    (name, std::fs::read(e.path()).expect("a state file"))
                })
                .collect();
            files.sort();
            let state = checkpoint::load_state(&out).expect("the written state loads");
            ShardedFixture {
                layout,
                files,
                state,
            }
        })
        .collect()
}

/// How far an accepted state may differ from the state as written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Edit {
    /// A change the state's checks must see: accepted only as the state written.
    Damage,
    /// Shard values rewritten with their checksums: the same names and types.
    Values,
    /// A manifest rewritten with its digest recomputed: a deliberate edit, which must
    /// still give a state that agrees with itself.
    Resealed,
}

/// A mutation of a sharded state's files (`files`, the folder's by name; `other`, a
/// state of another layout and run).
fn mutate_sharded(rng: &mut Rng, files: &mut Files, other: &Files, log: &mut Vec<String>) -> Edit {
    let shards: Vec<usize> = (0..files.len())
        .filter(|i| files[*i].0.ends_with(".safetensors"))
        .collect();
    let manifest = files.iter().position(|(n, _)| n == "manifest.json");
    let corpus: Vec<Vec<u8>> = other.iter().map(|(_, b)| b.clone()).collect();
    let text = Mutator {
        numbers: &lists().extremes,
        words: &lists().json,
        corpus: &corpus,
        raw: true,
    };
    match (rng.below(6), manifest) {
        (0, Some(m)) => {
            log.push("manifest bytes:".into());
            text.mutate(rng, &mut files[m].1, log);
            Edit::Damage
        }
        (1 | 2, Some(m)) => {
            let Ok(mut v) = serde_json::from_slice::<Value>(&files[m].1) else {
                return Edit::Damage;
            };
            log.push("manifest values:".into());
            for _ in 0..rng.count() {
                mutate_json(rng, &mut v, &text, log);
            }
            files[m].1 = v.to_string().into_bytes();
            // Resealed as distc writes it: its digest matches the edit.
            let resealed = rng
                .chance(1, 2)
                .then(|| serde_json::from_value::<distc_runtime::core::shards::Manifest>(v).ok());
            match resealed.flatten() {
                Some(mut m2) => {
                    m2.digest = None;
                    let root = temp_dir();
                    let written = m2.write(root.path()).ok().and_then(|()| {
                        let step =
                            distc_runtime::core::shards::step_dir(root.path(), m2.index.step);
                        std::fs::read(step.join("manifest.json")).ok()
                    });
                    match written {
                        Some(bytes) => {
                            log.push("resealed".into());
                            files[m].1 = bytes;
                            Edit::Resealed
                        }
                        None => Edit::Damage,
                    }
                }
                None => Edit::Damage,
            }
        }
        (3 | 4, _) if !shards.is_empty() => {
            let i = *rng.pick(&shards);
            log.push(format!("{}:", files[i].0));
            let before = log.len();
            files[i].1 = mutate_checkpoint(rng, &[files[i].1.clone()], log);
            // The tensors' bytes with their checksums fixed: values a user rewrote.
            if log[before..].iter().any(|l| l.starts_with("data ")) {
                Edit::Values
            } else {
                Edit::Damage
            }
        }
        _ if !shards.is_empty() => {
            let (a, b) = (*rng.pick(&shards), *rng.pick(&shards));
            match rng.below(5) {
                0 => {
                    log.push(format!("{} removed", files[a].0));
                    files.remove(a);
                }
                1 if a != b => {
                    log.push(format!("{} copied over {}", files[a].0, files[b].0));
                    files[b].1 = files[a].1.clone();
                }
                2 if a != b => {
                    log.push(format!("{} and {} swapped", files[a].0, files[b].0));
                    let t = files[a].1.clone();
                    files[a].1 = std::mem::replace(&mut files[b].1, t);
                }
                3 => {
                    let cut = rng.below(files[a].1.len().max(1));
                    log.push(format!("{} cut at {cut}", files[a].0));
                    files[a].1.truncate(cut);
                }
                _ => {
                    // The same rank's shard of another run and layout.
                    if let Some((n, bytes)) = other.iter().find(|(n, _)| *n == files[a].0) {
                        log.push(format!("{n} of the other state"));
                        files[a].1 = bytes.clone();
                    }
                }
            }
            Edit::Damage
        }
        _ => Edit::Damage,
    }
}

/// Whether `a` and `b` hold the same names with the same types (values aside).
fn same_types(
    a: &std::collections::HashMap<String, distc_runtime::Tensor>,
    b: &std::collections::HashMap<String, distc_runtime::Tensor>,
) -> bool {
    a.len() == b.len()
        && a.iter().all(|(k, t)| {
            b.get(k)
                .is_some_and(|u| u.dtype() == t.dtype() && u.shape() == t.shape())
        })
}

/// Loads the state in `dir` as `--resume DIR` does: read, then checked against the
/// model `c` (its variables' types, the optimizer's state). Accepted after damage, it must be the
/// state written; after a rewrite of values, of its names and types; after a resealed
/// manifest, one that agrees with itself (its index names what it holds).
fn load_fuzzed_sharded(
    dir: &Path,
    (written, c): (&checkpoint::TrainingState, &distc::Compiled),
    edit: Edit,
) -> Result<Outcome, Fail> {
    let state = match checkpoint::load_state(dir) {
        Ok(s) => s,
        Err(e) => return refused(e.to_string()),
    };
    if let Err(e) = distc_runtime::run::launch::check_resume(&state, &c.programs(1), &c.config) {
        return refused(e.to_string());
    }
    let wrong = |what: &str| Err(Fail::Wrong(format!("accepted, and {what}")));
    let mut held: Vec<&String> = state.params.keys().collect();
    held.sort();
    let mut named: Vec<&String> = state.index.variables.iter().collect();
    named.sort();
    if held != named {
        return wrong(&format!(
            "it holds {held:?} while its index names {named:?}"
        ));
    }
    match edit {
        Edit::Damage if state.index != written.index => wrong("its index is not the one written"),
        Edit::Damage if state.params != written.params || state.optimizer != written.optimizer => {
            wrong("its tensors are not the ones written")
        }
        Edit::Values
            if !same_types(&state.params, &written.params)
                || !same_types(&state.optimizer, &written.optimizer) =>
        {
            wrong("its tensors' names or types are not the ones written")
        }
        _ => Ok(Outcome::Accepted),
    }
}

#[test]
fn sharded_states() {
    let work = temp_dir();
    let fixtures = std::sync::Arc::new(sharded_fixtures(work.path()));
    assert_eq!(fixtures.len(), 2, "the states were not written");
    let source =
        std::fs::read_to_string(root().join("tests/models/adam_mlp.dsl")).expect("the model");
    let model = std::sync::Arc::new(
        compile("adam_mlp.dsl", &source, &CompileOptions::default()).expect("compiles"),
    );
    fuzz(
        "sharded_states",
        |rng, index| {
            let k = rng.below(fixtures.len());
            let f = &fixtures[k];
            let other = &fixtures[1 - k].files;
            let mut files = f.files.clone();
            let mut log = vec![f.layout.to_string()];
            let edit = mutate_sharded(rng, &mut files, other, &mut log);
            let dir = work.path().join(format!("state-{index}"));
            let (fixtures, saved, model) = (fixtures.clone(), files.clone(), model.clone());
            Case {
                what: log.join("\n"),
                files: saved,
                run: Box::new(move || {
                    let step = dir.join("step-000000002");
                    std::fs::create_dir_all(&step).expect("a state folder");
                    for (name, bytes) in &files {
                        std::fs::write(step.join(name), bytes).expect("a state file");
                    }
                    std::fs::write(dir.join("latest"), "step-000000002\n").expect("latest");
                    let outcome = load_fuzzed_sharded(&dir, (&fixtures[k].state, &model), edit);
                    let _ = std::fs::remove_dir_all(&dir);
                    outcome
                }),
            }
        },
        true,
    );
}
