//! Every role's data: its replica's share of the plan's source, one source per
//! micro-batch, checked against the model where the source's id ranges are known
//! only once read (a token file's vocabulary).

use super::{data_dir, DataSource};
use crate::core::config::RunConfig;
use crate::core::error::Result;
use crate::run::mesh::Mesh;
use crate::run::options::TrainOptions;
use crate::run::programs::{input_types, Programs};
use distc_ir::Graph;

/// Opens worker `rank`'s data (its shard of the plan's source), preloaded if asked:
/// one source per micro-batch, micro-batch `m` of replica `r` being part `r*K + m` of
/// the `R*K` parts of the global batch. Every role opens its data here: a model axis's
/// workers and a pipeline's stages read their replica's batch, as data parallelism
/// with accumulation does.
pub fn open_data(
    programs: &Programs<'_>,
    mesh: &Mesh,
    config: &RunConfig,
    opts: &TrainOptions,
    rank: usize,
) -> Result<Vec<DataSource>> {
    let k = programs.micro_batches();
    let (replica, replicas) = (mesh.coord(rank).replica, mesh.data);
    (0..k)
        .map(|m| {
            let mut source =
                open_source(programs.worker, config, opts, replica * k + m, replicas * k)?;
            if m == 0 && config.data.needs_files() {
                // File sources know their id ranges (a vocabulary) only once read;
                // synthetic sources' were checked with the settings at launch.
                source.check_model(programs.worker, config.batch)?;
            }
            let mut steps = opts.last_step(config);
            if let Some(state) = &opts.resume {
                source.skip_samples(state.index.samples)?;
                steps = steps.saturating_sub(state.index.step as usize);
            }
            if opts.preload {
                source.preload(steps)?;
            }
            Ok(source)
        })
        .collect()
}

/// Part `part` of `parts` of the plan's source, shaped for `graph`'s inputs: sliced
/// from one global stream when the run asks for it (`--global-data`).
pub(crate) fn open_source(
    graph: &Graph,
    config: &RunConfig,
    opts: &TrainOptions,
    part: usize,
    parts: usize,
) -> Result<DataSource> {
    let open = if opts.global_data {
        DataSource::open_global
    } else {
        DataSource::open
    };
    open(
        &config.data,
        data_dir(opts.data_dir.as_deref()).as_deref(),
        &input_types(graph),
        config.batch,
        config.seed,
        part,
        parts,
    )
}
