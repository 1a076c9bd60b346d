//! Pipeline parallelism's options ([`PipelineArgs`]) and the choice of the cut: which blocks
//! each chunk holds, balanced by measured time (torchgpipe's balance by time: a few profiling
//! passes of every block on this rank's device, averaged over the ranks so that every rank
//! computes the same cut), by parameters, or as given. The schedules are plan/pipeline/; the
//! executor is pipeline.rs.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::exchange::options::Given;
use crate::model::{self, InputSpec, ModelKind};
use crate::plan::pipeline::{self, BlockCost, Grid, ScheduleKind, Shape};
use crate::topology::World;


/// Pipeline parallelism (docs/parallelism.md, "Pipeline parallelism").
#[derive(Args, Debug, Clone)]
pub struct PipelineArgs {
    /// Pipeline stages per model replica: N ranks form N/P pipelines of P consecutive ranks, and
    /// the N/P ranks that hold the same stage average its gradients with --strategy.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub pipeline_stages: u64,

    /// Micro-batches each pipeline's batch is cut into per step (with one stage: gradient
    /// accumulation over the micro-batches).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub micro_batches: u64,

    /// Order of the micro-batches' forwards and backwards on each stage.
    #[arg(long = "schedule", value_enum, default_value_t = ScheduleKind::OneFOneB)]
    pub schedule: ScheduleKind,

    /// Model chunks per stage for --schedule interleaved (the bubble divided by it).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub virtual_stages: u64,

    /// Where the model is cut: `time` (balance measured forward+backward time; under ZB-V, the
    /// cut whose replay of the schedule with the measured F, B and W is fastest), `params`
    /// (balance parameters), or the first block of every chunk but the first, e.g. `3,6,8`.
    #[arg(long, default_value = "time", value_parser = parse_partition)]
    pub partition: Partition,

    /// Keep only each stage's input per micro-batch and recompute its forward during backward
    /// (GPipe's re-materialisation): activation memory for compute.
    #[arg(long)]
    pub recompute: bool,

    /// Write every rank's forward, backward, send, receive and idle time per micro-batch as a
    /// Chrome trace (chrome://tracing, Perfetto) to this file (rank 0 writes it).
    #[arg(long)]
    pub pipeline_timeline: Option<PathBuf>,
}

/// `--partition`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Partition {
    Time,
    Params,
    Cuts(Vec<usize>),
}

impl Partition {
    pub fn name(&self) -> String {
        match self {
            Partition::Time => "time".into(),
            Partition::Params => "params".into(),
            Partition::Cuts(c) => c.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(","),
        }
    }
}

fn parse_partition(s: &str) -> std::result::Result<Partition, String> {
    match s {
        "time" => Ok(Partition::Time),
        "params" => Ok(Partition::Params),
        list => list
            .split(',')
            .map(|b| b.trim().parse::<usize>().map_err(|_| format!("expected time, params or a list of block indices such as 3,6,8; {b:?} is not a block index")))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(Partition::Cuts),
    }
}

/// Options that only a pipeline reads: (clap id, flag).
const PIPELINE_ONLY: &[(&str, &str)] =
    &[("schedule", "--schedule"), ("virtual_stages", "--virtual-stages"), ("partition", "--partition"), ("recompute", "--recompute"), ("pipeline_timeline", "--pipeline-timeline")];

/// What a pipelined run is: its rank grid and the shape of its schedule.
#[derive(Clone, Copy, Debug)]
pub struct PipelinePlan {
    pub grid: Grid,
    pub shape: Shape,
}

impl PipelineArgs {
    /// Whether the run goes through the pipeline's executor: more than one stage, or one stage
    /// that accumulates the gradients of several micro-batches.
    pub fn pipelined(&self) -> bool {
        self.pipeline_stages > 1 || self.micro_batches > 1
    }

    /// The grid and shape for `ranks`, or None for a plain run; refuses what cannot run, naming
    /// the flag.
    pub fn plan(&self, given: &Given, ranks: usize, model: ModelKind) -> Result<Option<PipelinePlan>> {
        if self.pipeline_stages == 1 {
            if let Some((_, flag)) = PIPELINE_ONLY.iter().find(|(id, _)| given.has(id)) {
                return Err(Error::usage(format!("{flag} is an option of pipelines; with --pipeline-stages 1 there is none: drop it, or add --pipeline-stages")));
            }
        }
        if !self.pipelined() {
            return Ok(None);
        }
        let grid = Grid::new(ranks, self.pipeline_stages as usize).map_err(Error::usage)?;
        let shape = Shape::new(self.schedule, grid.stages, self.micro_batches as usize, self.virtual_stages as usize).map_err(Error::usage)?;
        if model == ModelKind::TinyUnused {
            return Err(Error::usage("--model tiny-unused has a layer outside its blocks, which no pipeline stage would hold"));
        }
        Ok(Some(PipelinePlan { grid, shape }))
    }
}

/// The blocks of one pipeline stage: per chunk it holds, the global chunk index and its blocks.
#[derive(Clone, Debug)]
pub(super) struct StageCut {
    pub(super) chunks: Vec<(usize, std::ops::Range<usize>)>,
}

impl StageCut {
    pub(super) fn holds(&self, block: usize) -> bool {
        self.chunks.iter().any(|(_, r)| r.contains(&block))
    }
}

/// What the cut was chosen from, per block: name, parameters, measured milliseconds.
#[derive(Clone, Debug)]
pub(super) struct BlockSurvey {
    pub(super) names: Vec<String>,
    pub(super) params: Vec<usize>,
    /// Forward, B and W per micro-batch (ms, mean over the ranks), when measured; an unsplit
    /// backward (every schedule but the zero-bubble ones) counts as B.
    pub(super) costs: Option<Vec<BlockCost>>,
    /// Per block, the shape of one sample of its output.
    pub(super) output_shapes: Vec<Vec<i64>>,
}

/// The cut of the model into P x V chunks, and what it was chosen from.
#[derive(Clone, Debug)]
pub(super) struct Cut {
    /// The blocks of every chunk, in model order.
    pub(super) chunks: Vec<std::ops::Range<usize>>,
    pub(super) survey: BlockSurvey,
}

impl Cut {
    /// The chunks `stage` holds.
    pub(super) fn stage(&self, shape: &Shape, stage: usize) -> StageCut {
        StageCut { chunks: shape.chunks_of(stage).into_iter().map(|c| (c, self.chunks[c].clone())).collect() }
    }

    /// The shape of one sample entering chunk `c` (c >= 1).
    pub(super) fn input_shape(&self, chunk: usize) -> &[i64] {
        &self.survey.output_shapes[self.chunks[chunk].start - 1]
    }

    /// The shape of one sample leaving chunk `c`.
    pub(super) fn output_shape(&self, chunk: usize) -> &[i64] {
        &self.survey.output_shapes[self.chunks[chunk].end - 1]
    }

    /// Per chunk: its blocks by name, parameters and measured time, for the log and the record.
    pub(super) fn describe(&self, shape: &Shape) -> Vec<String> {
        let s = &self.survey;
        let costs = self.chunk_costs();
        self.chunks
            .iter()
            .enumerate()
            .map(|(c, r)| {
                let params: usize = s.params[r.clone()].iter().sum();
                let ms = costs.as_ref().map_or(String::new(), |k| {
                    let (f, b, w) = (k.forward[c], k.input_grad[c], k.weight_grad[c]);
                    if shape.kind.splits_backward() {
                        format!(", {:.2} ms (F {f:.2}, B {b:.2}, W {w:.2})", f + b + w)
                    } else {
                        format!(", {:.2} ms (forward {f:.2})", f + b + w)
                    }
                });
                format!("chunk {c} on stage {}: blocks {}..{} ({}..{}), {params} parameters{ms}", shape.stage_of(c), r.start, r.end - 1, s.names[r.start], s.names[r.end - 1])
            })
            .collect()
    }

    pub(super) fn chunk_params(&self) -> Vec<usize> {
        self.chunks.iter().map(|r| self.survey.params[r.clone()].iter().sum()).collect()
    }

    pub(super) fn chunk_ms(&self) -> Option<Vec<f64>> {
        self.survey.costs.as_ref().map(|costs| self.chunks.iter().map(|r| costs[r.clone()].iter().map(BlockCost::total).sum()).collect())
    }

    /// Each chunk's measured forward, B and W, when measured: what the replay of the schedule
    /// takes.
    pub(super) fn chunk_costs(&self) -> Option<pipeline::Costs> {
        let starts: Vec<usize> = self.chunks.iter().map(|r| r.start).collect();
        self.survey.costs.as_ref().map(|costs| pipeline::chunk_costs(costs, &starts))
    }
}

/// Chooses the cut (collective over `world` for `--partition time`: every rank profiles, the
/// times are averaged, and every rank cuts the same way). Under `--partition time`, ZB-V's cut
/// is the one whose replay of the schedule has the shortest step ([`pipeline::cut_by_replay`]),
/// every other schedule's the one that balances the chunks' times.
pub(super) fn choose_cut(world: &World, kind: ModelKind, spec: InputSpec, partition: &Partition, shape: &Shape, micro_batch: usize, device: Device) -> Result<Cut> {
    let chunks = shape.chunks();
    // Declared only: the survey gives one block at a time memory, and lets it go.
    let scratch = nn::VarStore::new(Device::Cpu);
    let blocks = model::build_blocks(kind, spec, |_| scratch.root());
    if chunks > blocks.len() {
        return Err(Error::usage(shape.too_many_chunks(kind.name(), blocks.len())));
    }
    let names = blocks.iter().map(|b| b.name.clone()).collect();
    let params = blocks.iter().map(model::Block::parameters).collect();
    let output_shapes = model::block_output_shapes(&blocks, spec)?;
    let mut survey = BlockSurvey { names, params, costs: None, output_shapes };
    let starts = match partition {
        Partition::Cuts(list) => pipeline::cuts_from_list(list, blocks.len(), chunks).map_err(Error::usage)?,
        Partition::Params => {
            let costs: Vec<f64> = survey.params.iter().map(|&p| p as f64).collect();
            pipeline::balance(&costs, chunks).map_err(|e| Error::usage(format!("--partition params: {e}")))?
        }
        Partition::Time => {
            // The backward is surveyed as the schedule runs it, whole or as B then W.
            let mine = world.agree(profile_blocks(&blocks, spec, micro_batch, device, shape.kind.splits_backward()))?;
            let mean = |t: f64| world.sum_f64(t) / world.size as f64;
            let costs: Vec<BlockCost> =
                mine.iter().map(|c| BlockCost { forward: mean(c.forward), input_grad: mean(c.input_grad), weight_grad: mean(c.weight_grad) }).collect();
            let refused = |e: String| Error::usage(format!("--partition time: {e}"));
            let starts = if shape.kind == ScheduleKind::ZbV {
                let cut = pipeline::cut_by_replay(shape, &costs, pipeline::REPLAYED_CUTS).map_err(refused)?;
                if world.is_root() {
                    log::info!(
                        "{} cut by the replay of the surveyed F, B and W: first blocks {:?}, a step of {:.1} ms replayed (the chunk-balanced cut {:?}: {:.1} ms)",
                        shape.kind.name(),
                        cut.starts,
                        cut.step,
                        cut.balanced,
                        cut.balanced_step
                    );
                }
                cut.starts
            } else {
                let ms: Vec<f64> = costs.iter().map(BlockCost::total).collect();
                pipeline::balance(&ms, chunks).map_err(refused)?
            };
            survey.costs = Some(costs);
            starts
        }
    };
    Ok(Cut { chunks: pipeline::ranges(&starts, blocks.len()), survey })
}

/// Milliseconds of every block's forward, B and W on a micro-batch of random images: each the
/// median of 3 passes after one warm-up pass. With `split`, the backward runs as the zero-bubble
/// schedules run it, B then W (the first block's input needs no gradient: all its backward is
/// W); without, it runs whole and counts as B. One block at a time holds its variables (drawn
/// on the device) and their gradients, and lets them go before the next: the survey never
/// holds more of the model than its largest block.
fn profile_blocks(blocks: &[model::Block], spec: InputSpec, micro_batch: usize, device: Device, split: bool) -> Result<Vec<BlockCost>> {
    let mut x = Tensor::f_randn([micro_batch.max(1) as i64, spec.channels, spec.height, spec.width], (Kind::Float, device))?;
    let mut medians = Vec::with_capacity(blocks.len());
    let elapsed_ms = |since: Instant| {
        crate::exchange::staging::synchronize_device(device);
        since.elapsed().as_secs_f64() * 1e3
    };
    for (b, block) in blocks.iter().enumerate() {
        block.draw(PROFILE_SEED, device)?;
        let parameters: Vec<Tensor> = block.variables.iter().filter(|v| v.trainable).map(|v| v.tensor.shallow_clone()).collect();
        let mut samples: [Vec<f64>; 3] = Default::default();
        let mut output = None;
        for pass in 0..4 {
            let inp = x.f_detach()?.f_requires_grad_(b > 0)?;
            let started = Instant::now();
            let y = block.module.forward_t(&inp, true);
            let forward = elapsed_ms(started);
            let gradient = y.f_ones_like()?;
            let started = Instant::now();
            let (input_grad, weight_grad) = if split && b > 0 {
                let (_, kept) = crate::raw::backward_input(&y, Some(&gradient), &inp, &parameters)?;
                let input_grad = elapsed_ms(started);
                let started = Instant::now();
                crate::raw::backward_weight(kept)?;
                (input_grad, elapsed_ms(started))
            } else {
                y.f_mul(&gradient)?.f_sum(Kind::Float)?.f_backward()?;
                let whole = elapsed_ms(started);
                if split { (0.0, whole) } else { (whole, 0.0) }
            };
            if pass > 0 {
                for (kind, t) in samples.iter_mut().zip([forward, input_grad, weight_grad]) {
                    kind.push(t);
                }
            }
            output = Some(y.f_detach()?);
        }
        for v in &block.variables {
            crate::raw::release_grad(&v.tensor)?;
        }
        block.release()?;
        x = output.expect("four passes");
        let [forward, input_grad, weight_grad] = samples.map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        });
        medians.push(BlockCost { forward, input_grad, weight_grad });
    }
    Ok(medians)
}

/// The seed of the survey's values (its times do not depend on them).
const PROFILE_SEED: u64 = 0;
