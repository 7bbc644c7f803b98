//! From DSL source to a compiled graph: lower, then the strategy's passes, with the IR
//! written after each step when asked (`--dump-ir`), `--stop-after` and `--disable-pass`.

use crate::dsl::{compile_source, DslError};
use distc_ir::Graph;
use distc_passes::{known_pass_names, run_pipeline, single_pipeline, PassCx, PassRecord, PipelineError};
use distc_runtime::RunConfig;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// How to compile.
#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// Write the IR after each pass into this directory, numbered in pipeline order.
    pub dump_ir: Option<PathBuf>,
    /// Stop after this pass (`lower` stops before any pass).
    pub stop_after: Option<String>,
    /// Passes to skip.
    pub disabled: Vec<String>,
    /// Overrides the train block's per-worker batch.
    pub batch: Option<usize>,
}

/// A compiled model.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The final graph.
    pub graph: Graph,
    /// The run configuration from the train block.
    pub config: RunConfig,
    /// What each pass did.
    pub records: Vec<PassRecord>,
    /// Node count right after lowering.
    pub lowered_nodes: usize,
}

/// Why compilation failed.
#[derive(Debug, Error)]
pub enum CompileError {
    /// The source file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The DSL is wrong.
    #[error("{0}")]
    Dsl(Box<DslError>),
    /// A pass failed; the last good IR was written to `last_good`.
    #[error("{error}\nthe IR before that pass is in {}", .last_good.display())]
    Pipeline {
        /// The failure.
        error: PipelineError,
        /// Where the last good IR was written.
        last_good: PathBuf,
    },
    /// A flag names a pass that does not exist.
    #[error("unknown pass `{name}`; the passes are: {}", .known.join(", "))]
    UnknownPass {
        /// The name given.
        name: String,
        /// The valid names.
        known: Vec<String>,
    },
    /// Writing a dump failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

fn write(path: &Path, text: &str) -> Result<(), CompileError> {
    std::fs::write(path, text).map_err(|source| CompileError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Compiles DSL `src` (read from `file_name`).
pub fn compile(file_name: &str, src: &str, opts: &CompileOptions) -> Result<Compiled, CompileError> {
    let known = known_pass_names();
    for name in opts.stop_after.iter().chain(&opts.disabled) {
        if !known.contains(name) {
            return Err(CompileError::UnknownPass {
                name: name.clone(),
                known,
            });
        }
    }
    let program = compile_source(file_name, src, opts.batch).map_err(|e| CompileError::Dsl(Box::new(e)))?;
    let mut graph = program.graph;
    let mut config = program.config;
    // The data loader must produce the batch the graph was bound to.
    config.batch = program.batch_symbol_value;
    let lowered_nodes = graph.node_count();
    if let Some(dir) = &opts.dump_ir {
        std::fs::create_dir_all(dir).map_err(|source| CompileError::Write {
            path: dir.clone(),
            source,
        })?;
        write(&dir.join("00-lower.ir"), &distc_ir::print(&graph))?;
    }
    if opts.stop_after.as_deref() == Some("lower") {
        return Ok(Compiled {
            graph,
            config: config.clone(),
            records: vec![],
            lowered_nodes,
        });
    }
    let passes = single_pipeline();
    let mut cx = PassCx {
        disabled: opts.disabled.clone(),
    };
    let mut index = 0;
    let mut dump_err = None;
    let result = run_pipeline(&mut graph, &passes, &mut cx, opts.stop_after.as_deref(), |name, g| {
        index += 1;
        if let Some(dir) = &opts.dump_ir {
            if let Err(e) = write(&dir.join(format!("{index:02}-{name}.ir")), &distc_ir::print(g)) {
                dump_err.get_or_insert(e);
            }
        }
    });
    if let Some(e) = dump_err {
        return Err(e);
    }
    match result {
        Ok(records) => Ok(Compiled {
            graph,
            config: config.clone(),
            records,
            lowered_nodes,
        }),
        Err(error) => {
            let dir = opts.dump_ir.clone().unwrap_or_else(std::env::temp_dir);
            let last_good = dir.join(format!("distc-before-{}.ir", error.pass));
            write(&last_good, &distc_ir::print(&error.last_good))?;
            Err(CompileError::Pipeline { error, last_good })
        }
    }
}

/// Compiles the DSL file at `path`.
pub fn compile_file(path: &Path, opts: &CompileOptions) -> Result<Compiled, CompileError> {
    let src = std::fs::read_to_string(path).map_err(|source| CompileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    compile(&path.display().to_string(), &src, opts)
}
