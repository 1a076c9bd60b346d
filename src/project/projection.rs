//! `hpc-train project`: scaling tables for clusters larger than the one measured, from a
//! cluster profile (link costs, or a model file from `model fit`), with every prediction
//! checked against the measurements it is given. Projected runs are written as run records
//! marked `projected` and handed to `hpc-train report`, so that they come out in the report's
//! own tables and plots.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Deserialize;

use crate::cost::{CostModel, Layout, LinkCost, MeasuredCurve};
use crate::error::{Error, Result, WithPath};
use crate::layouts::{self, Setting, Transformer};
use crate::model::ModelKind;
use crate::plan::pipeline::ScheduleKind;
use crate::project::predict::{median, residual, BenchRow, Predictor, Residual, HOROVOD_HIERARCHICAL};
use crate::report::ReportArgs;
use crate::results::{self, RunRecord};

/// Options of `hpc-train project`.
#[derive(Args, Debug, Clone)]
pub struct ProjectArgs {
    /// The cluster's description (TOML; see jobs/clusters/); formerly --profile (not the
    /// profiler: that is training's --profile-dir).
    #[arg(long = "cluster", aliases = ["profile"], value_name = "FILE.toml", help_heading = "Cluster and model")]
    pub profile: PathBuf,
    /// Model whose gradients are exchanged.
    #[arg(long, value_enum, default_value_t = ModelKind::Resnet50, help_heading = "Cluster and model")]
    pub model: ModelKind,
    /// One rank's forward, backward and optimizer per step, in ms.
    #[arg(long, help_heading = "Cluster and model")]
    pub compute_ms: Option<f64>,
    /// Take the compute time from the 1-rank run of the model at --batch in this runs.jsonl.
    #[arg(long, help_heading = "Cluster and model")]
    pub from_runs: Option<PathBuf>,
    /// Samples per rank per step (weak scaling).
    #[arg(long, default_value_t = 256, help_heading = "Cluster and model")]
    pub batch: usize,
    /// Rank counts.
    #[arg(long, default_value = "1,2,4,8,16,32,64,128,256,512,1024", help_heading = "Sweep")]
    pub ranks: String,
    /// Ranks per node [default: the profile's].
    #[arg(long, help_heading = "Sweep")]
    pub ranks_per_node: Option<usize>,
    /// Gradient buckets in MiB.
    #[arg(long = "bucket-mib", aliases = ["bucket-mb"], value_name = "MIB", default_value_t = 25.0, help_heading = "Sweep")]
    pub bucket_mb: f64,
    /// Share of compute that backward takes (what overlap can hide the exchange behind).
    #[arg(long, default_value_t = 0.67, help_heading = "Cluster and model")]
    pub backward_share: f64,
    /// Parameter servers of the measured ps rows (validation).
    #[arg(long, default_value_t = 1, help_heading = "Sweep")]
    pub servers: usize,
    /// Folder for the tables, the projected records and their report, and validation.csv.
    #[arg(long, default_value = "results/projection", help_heading = "Output")]
    pub out: PathBuf,
    /// Measured bench rows to compare the model with (validation.csv).
    #[arg(long, help_heading = "Output")]
    pub validate_bench: Option<PathBuf>,
    /// Measured training runs to compare the model with (validation.csv).
    #[arg(long, help_heading = "Output")]
    pub validate_runs: Option<PathBuf>,
    /// Pipeline stages to project besides data parallelism, e.g. `2,4`: each at every
    /// rank count it divides, a pipeline on consecutive ranks, the stages' replicas averaging
    /// with the ring.
    #[arg(long, default_value = "", help_heading = "Sweep")]
    pub pipeline_stages: String,
    /// Micro-batches per step of the projected pipelines (each pipeline takes --batch).
    #[arg(long, default_value_t = 16, help_heading = "Sweep")]
    pub micro_batches: usize,
    /// The pipelines' schedule, for --pipeline-stages and --plan: gpipe, 1f1b, zb-h1 or zb-v
    /// (interleaved needs --virtual-stages, which project does not take).
    #[arg(long, value_enum, default_value_t = crate::plan::pipeline::ScheduleKind::OneFOneB, help_heading = "Sweep")]
    pub schedule: crate::plan::pipeline::ScheduleKind,
    /// Instead of scaling tables: the 3D layouts (data x pipeline x tensor, micro-batch size) of
    /// --transformer on --gpus GPUs of the profile that fit --gpu-memory-gb, each with its
    /// projected step split into compute, bubble and the three kinds of communication.
    #[arg(long, help_heading = "Plan (--plan)")]
    pub plan: bool,
    /// With --plan: the transformer (its shape; --layers, --hidden, --heads, --tokens, --vocab
    /// change it).
    #[arg(long, value_enum, default_value_t = TransformerKind::Gpt3, help_heading = "Plan (--plan)")]
    pub transformer: TransformerKind,
    #[arg(long, help_heading = "Plan (--plan)")]
    pub layers: Option<usize>,
    #[arg(long, help_heading = "Plan (--plan)")]
    pub hidden: Option<usize>,
    #[arg(long, help_heading = "Plan (--plan)")]
    pub heads: Option<usize>,
    /// Sequence length, or a ViT's tokens.
    #[arg(long, help_heading = "Plan (--plan)")]
    pub tokens: Option<usize>,
    /// Vocabulary, or a ViT's classes.
    #[arg(long, help_heading = "Plan (--plan)")]
    pub vocab: Option<usize>,
    /// With --plan: GPUs (ranks) in all.
    #[arg(long, default_value_t = 1024, help_heading = "Plan (--plan)")]
    pub gpus: usize,
    /// With --plan: sequences (or images) per step over all replicas.
    #[arg(long, default_value_t = 1536, help_heading = "Plan (--plan)")]
    pub global_batch: usize,
    /// With --plan: memory per GPU, GB (10^9 bytes).
    #[arg(long, default_value_t = 80.0, help_heading = "Plan (--plan)")]
    pub gpu_memory_gb: f64,
    /// With --plan: what one GPU sustains on the model's layers, TFLOP/s [default: 156, half the
    /// A100's 312 dense fp16/bf16 peak].
    #[arg(long, default_value_t = 156.0, help_heading = "Plan (--plan)")]
    pub gpu_tflops: f64,
    /// With --plan: layouts shown in the table (all of them go to the JSON lines).
    #[arg(long, default_value_t = 12, help_heading = "Plan (--plan)")]
    pub show: usize,
}

/// `--transformer`: shapes with published parameter counts (layouts.rs).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransformerKind {
    /// GPT-3 175B: 96 layers, width 12288, 96 heads, sequence 2048.
    #[value(name = "gpt3-175b")]
    Gpt3,
    /// Narayanan et al.'s 145.6B row of table 1: 80 layers, width 12288, 96 heads.
    #[value(name = "megatron-145b")]
    Megatron145b,
    /// ViT-H/14 at 224x224: 32 layers, width 1280, 16 heads, 257 tokens.
    #[value(name = "vit-h14")]
    VitH14,
    /// ViT-B/16 at 224x224 (hpc-train's vit-b16).
    #[value(name = "vit-b16")]
    VitB16,
}

/// A cluster profile (jobs/clusters/*.toml): link costs with their sources.
#[derive(Debug, Deserialize)]
struct Profile {
    name: String,
    ranks_per_node: usize,
    /// A fitted model file instead of the figures below (this machine's local cluster).
    fitted: Option<PathBuf>,
    intra: Option<ProfileLink>,
    inter: Option<ProfileLink>,
    add_gbs: Option<f64>,
    /// Network links per node, shared by the node's ranks that cross at once (absent: one per
    /// rank). A fitted model carries its own.
    nics_per_node: Option<usize>,
    /// What the whole network can carry at once, GB/s summed over every node (absent: a
    /// non-blocking fabric). A fitted model carries its own.
    fabric_gbs: Option<f64>,
    #[serde(default = "default_cycle_ms")]
    horovod_cycle_ms: f64,
}

fn default_cycle_ms() -> f64 {
    1.0
}

#[derive(Debug, Deserialize)]
struct ProfileLink {
    alpha_us: f64,
    /// Bandwidth one rank sees on this link.
    gbs: f64,
}

impl Profile {
    fn load(path: &Path) -> Result<Profile> {
        let text = std::fs::read_to_string(path).at(path)?;
        toml::from_str(&text).map_err(|e| Error::usage(format!("{}: not a cluster profile: {e}", path.display())))
    }

    /// The profile's cost model, and MPI_Allreduce's measured curve when the model was fitted
    /// from rows that had some.
    fn model(&self, base: &Path) -> Result<(CostModel, Option<MeasuredCurve>)> {
        if let Some(f) = &self.fitted {
            let path = if f.is_absolute() { f.clone() } else { base.join(f) };
            let (model, file) = CostModel::load_file(&path)?;
            // A bare model (no file around it) has no curve.
            let curve = file
                .get("mpi_allreduce")
                .cloned()
                .map(serde_json::from_value::<MeasuredCurve>)
                .transpose()
                .map_err(|e| Error::usage(format!("{}: mpi_allreduce is not a measured curve ({e})", path.display())))?;
            return Ok((model, curve));
        }
        // A rate of zero or less (or not a number) would cost every byte nothing or forever.
        let seconds_per_byte = |gbs: f64, what: &str| -> Result<f64> {
            if gbs.is_finite() && gbs > 0.0 {
                Ok(1.0 / (gbs * 1e9))
            } else {
                Err(Error::usage(format!("profile {}: {what} is {gbs}; a rate in GB/s must be a positive number", self.name)))
            }
        };
        let link = |l: &Option<ProfileLink>, what: &str| -> Result<LinkCost> {
            let l = l.as_ref().ok_or_else(|| Error::usage(format!("profile {}: no [{what}] link", self.name)))?;
            if !(l.alpha_us.is_finite() && l.alpha_us >= 0.0) {
                return Err(Error::usage(format!("profile {}: [{what}] alpha_us is {}; a latency must be a number of microseconds, 0 or more", self.name, l.alpha_us)));
            }
            Ok(LinkCost { alpha_s: l.alpha_us * 1e-6, beta_s_per_byte: seconds_per_byte(l.gbs, &format!("[{what}] gbs"))? })
        };
        let (intra, inter) = (link(&self.intra, "intra")?, link(&self.inter, "inter")?);
        let add = self.add_gbs.ok_or_else(|| Error::usage(format!("profile {}: no add_gbs", self.name)))?;
        let gamma_s_per_byte = seconds_per_byte(add, "add_gbs")?;
        let fabric_s_per_byte = self.fabric_gbs.map(|gbs| seconds_per_byte(gbs, "fabric_gbs")).transpose()?;
        Ok((CostModel { intra, inter, gamma_s_per_byte, nics_per_node: self.nics_per_node, shared: None, fabric_s_per_byte }, None))
    }
}

/// One projected point.
struct Point {
    strategy: String,
    ranks: usize,
    step_s: f64,
    exchange_s: f64,
    exposed_s: f64,
}

/// The exchange of one step: `gradient_bytes` in buckets of `bucket_bytes`, each reduced by the
/// strategy; with overlap, all but what backward cannot hide (at least the last bucket).
fn project_step(predictor: Predictor, strategy: &'static str, layout: Layout, gradient_bytes: f64, args: &ProjectArgs, compute_s: f64) -> Option<Point> {
    let bucket = (args.bucket_mb * (1 << 20) as f64).max(1.0);
    let full = (gradient_bytes / bucket).floor();
    let rest = gradient_bytes - full * bucket;
    let predictor = Predictor { servers: layout.nodes().max(1), ..predictor };
    // The ring as it runs by default: through node-shared memory on one node (costed so when
    // the model has those costs; across nodes, or without them, it is the ring over MPI).
    let each = |b: f64| predictor.exchange(strategy, layout, b, true, false);
    let exchange = if strategy == "ps" {
        // The parameter server exchanges whole shares after backward: one round.
        each(gradient_bytes)?
    } else {
        full * each(bucket)? + if rest > 0.0 { each(rest)? } else { 0.0 }
    };
    let exposed = if strategy == "ps" {
        exchange
    } else {
        let last = each(bucket.min(gradient_bytes))?;
        (exchange - args.backward_share * compute_s).max(last.min(exchange))
    };
    Some(Point { strategy: strategy.into(), ranks: layout.ranks, step_s: compute_s + exposed, exchange_s: exchange, exposed_s: exposed })
}

/// A pipelined layout's step: D = ranks / P pipelines of P stages on consecutive ranks. The
/// balanced stages go through the 1F1B schedule's M + P - 1 slots, each a micro-batch's share
/// of a stage's compute plus its activation and gradient on the link to the neighbour (counted
/// in full, not hidden behind compute: a bound); then each stage's 1/P of the gradients is
/// all-reduced by its D replicas with the ring, after the last backward (pipelines do not
/// overlap it). `boundary_bytes`: one sample's largest activation between two stages.
#[allow(clippy::too_many_arguments)]
fn project_pipeline(predictor: Predictor, layout: Layout, schedule: ScheduleKind, stages: usize, micro: usize, boundary_bytes: f64, batch: usize, gradient_bytes: f64, compute_s: f64) -> Option<Point> {
    let replicas = layout.ranks / stages;
    let per_slot = compute_s / (stages * micro) as f64;
    // A pipeline sits on one node when the node's ranks hold whole pipelines.
    let link = if layout.per_node.is_multiple_of(stages) { predictor.model.intra } else { predictor.model.inter };
    let message = link.alpha_s + boundary_bytes * (batch as f64 / micro as f64) * link.beta_s_per_byte;
    // The stage's M slots of work and the schedule's idle time (1F1B: P - 1 slots), and the
    // messages of M + P - 1 slots (ZB-V's chunks cross the stages twice).
    let shape = crate::plan::pipeline::Shape::new(schedule, stages, micro, 1).ok()?;
    let crossings = if schedule == ScheduleKind::ZbV { 2.0 } else { 1.0 };
    let pipeline_s = micro as f64 * per_slot * (1.0 + crate::plan::pipeline::idle_per_busy(&shape)) + (micro + stages - 1) as f64 * 2.0 * message * crossings;
    let stage_layout = Layout { ranks: replicas, per_node: (layout.per_node / stages).max(1) };
    let exchange = if replicas > 1 { predictor.exchange("ring", stage_layout, gradient_bytes / stages as f64, true, false)? } else { 0.0 };
    let strategy = format!("ring (P={stages}, M={micro} {schedule})");
    Some(Point { strategy, ranks: layout.ranks, step_s: pipeline_s + exchange, exchange_s: exchange, exposed_s: exchange })
}

/// One sample's largest activation (bytes, f32) crossing a stage boundary when `kind` at
/// 3x224x224 is cut into `stages` by parameters (the projection's cut).
fn boundary_bytes(kind: ModelKind, stages: usize) -> Result<f64> {
    use crate::plan::pipeline::{balance, ranges};
    let spec = crate::model::InputSpec { channels: 3, height: 224, width: 224, classes: 1000 };
    let scratch = tch::nn::VarStore::new(tch::Device::Cpu);
    let blocks = crate::model::build_blocks(kind, spec, |_| scratch.root());
    let params: Vec<f64> = blocks.iter().map(|b| b.parameters() as f64).collect();
    let shapes = crate::model::block_output_shapes(&blocks, spec)?;
    let starts = balance(&params, stages).map_err(|e| Error::usage(format!("--pipeline-stages {stages}: {e}")))?;
    Ok(ranges(&starts, blocks.len())[..stages - 1].iter().map(|r| shapes[r.end - 1].iter().product::<i64>() as f64 * 4.0).fold(0.0, f64::max))
}

/// `--pipeline-stages` of `project`: stage counts of at least 2, each dividing at least one of
/// the rank counts (a pipeline is projected only at the counts it divides).
fn parse_pipeline_stages(list: &str, ranks: &[usize]) -> Result<Vec<usize>> {
    let stages = if list.trim().is_empty() { Vec::new() } else { crate::study::parse_counts(list, "--pipeline-stages", "number of pipeline stages")? };
    if let Some(p) = stages.iter().find(|&&p| p < 2) {
        return Err(Error::usage(format!("--pipeline-stages {p}: a projected pipeline has at least 2 stages (data parallelism is projected anyway)")));
    }
    crate::study::check_stages_divide("--pipeline-stages", &stages, ranks, "is projected")?;
    Ok(stages)
}

/// The most GPUs `--plan` lays out: 2^24, a hundred times the largest machines built; its
/// divisors are found in 2^12 steps (2^64 - 1 would take 2^32).
const MOST_GPUS: usize = 1 << 24;

/// `project`'s own flags, named as project names them: values that would write tables of NaN
/// (a compute time of 0), wrap (sizes near 2^64) or project nothing are refused here.
/// Returns the rank counts of the scaling tables.
fn check_flags(args: &ProjectArgs) -> Result<Vec<usize>> {
    let at_least_one = |value: usize, flag: &str| if value >= 1 { Ok(()) } else { Err(Error::usage(format!("--{flag} 0: expected at least 1"))) };
    if args.schedule == crate::plan::pipeline::ScheduleKind::Interleaved {
        return Err(Error::usage("--schedule interleaved: project prices gpipe, 1f1b, zb-h1 and zb-v (interleaving needs --virtual-stages, which project does not take)"));
    }
    if let Some(per_node) = args.ranks_per_node {
        at_least_one(per_node, "ranks-per-node")?;
    }
    if args.plan {
        let preset = preset_of(args.transformer);
        for (value, flag) in [(args.layers, "layers"), (args.hidden, "hidden"), (args.heads, "heads"), (args.tokens, "tokens"), (args.vocab, "vocab")] {
            if let Some(v) = value {
                at_least_one(v, flag)?;
            }
        }
        at_least_one(args.gpus, "gpus")?;
        at_least_one(args.global_batch, "global-batch")?;
        if args.gpus > MOST_GPUS {
            return Err(Error::usage(format!("--gpus {}: at most {MOST_GPUS} (2^24) GPUs are laid out", args.gpus)));
        }
        if let Some(hidden) = args.hidden {
            if hidden.checked_mul(preset.mlp / preset.hidden).is_none() {
                return Err(Error::usage(format!("--hidden {hidden}: too wide (its MLP of {} x {hidden} does not fit in 64 bits)", preset.mlp / preset.hidden)));
            }
        }
        return Ok(Vec::new());
    }
    if let Some(ms) = args.compute_ms {
        if !(ms.is_finite() && ms > 0.0) {
            return Err(Error::usage(format!("--compute-ms {ms}: expected a positive number of milliseconds")));
        }
    }
    if !(0.0..=1.0).contains(&args.backward_share) {
        return Err(Error::usage(format!("--backward-share {}: expected a share of compute from 0 to 1", args.backward_share)));
    }
    if !(args.bucket_mb.is_finite() && args.bucket_mb > 0.0) {
        return Err(Error::usage(format!("--bucket-mib {}: expected a positive number of MiB", args.bucket_mb)));
    }
    at_least_one(args.batch, "batch")?;
    at_least_one(args.micro_batches, "micro-batches")?;
    at_least_one(args.servers, "servers")?;
    let ranks = crate::study::parse_counts(&args.ranks, "--ranks", "rank count")?;
    // The tables count the samples of every rank: N x --batch must be a count.
    if let Some(&n) = ranks.iter().find(|&&n| n.checked_mul(args.batch).is_none()) {
        return Err(Error::usage(format!("--ranks {n}: {n} ranks of --batch {} samples each do not fit in 64 bits", args.batch)));
    }
    parse_pipeline_stages(&args.pipeline_stages, &ranks)?;
    Ok(ranks)
}

fn preset_of(kind: TransformerKind) -> Transformer {
    match kind {
        TransformerKind::Gpt3 => Transformer::GPT3_175B,
        TransformerKind::Megatron145b => Transformer::MEGATRON_145B,
        TransformerKind::VitH14 => Transformer::VIT_H14,
        TransformerKind::VitB16 => Transformer::VIT_B16,
    }
}

/// `hpc-train project`.
pub fn project(args: &ProjectArgs) -> Result<()> {
    let ranks = check_flags(args)?;
    let profile = Profile::load(&args.profile)?;
    let base = args.profile.parent().unwrap_or(Path::new("."));
    let (model, mpi_allreduce) = profile.model(base).or_else(|_| profile.model(Path::new(".")))?;
    let per_node = args.ranks_per_node.unwrap_or(profile.ranks_per_node).max(1);
    if args.plan {
        return plan_layouts(args, &profile, &model, per_node);
    }
    let compute_s = match (args.compute_ms, &args.from_runs) {
        (Some(ms), _) => ms * 1e-3,
        (None, Some(runs)) => compute_from_runs(runs, args)?,
        (None, None) => return Err(Error::usage("project needs --compute-ms (one rank's forward and backward per step) or --from-runs FILE")),
    };
    let gradient_bytes = args.model.parameter_count() as f64 * 4.0;
    let predictor = Predictor { model: &model, mpi_allreduce: mpi_allreduce.as_ref(), servers: args.servers, cycle_s: profile.horovod_cycle_ms * 1e-3, cycle_share: 0.5 };
    let strategies: [&'static str; 7] = ["ring", "rhd", "auto", "allreduce", "horovod", HOROVOD_HIERARCHICAL, "ps"];
    std::fs::create_dir_all(&args.out).at(&args.out)?;
    let slug = format!("{}-{}", args.profile.file_stem().and_then(|s| s.to_str()).unwrap_or("profile"), args.model.name());

    // The table, and the same points as run records for the report's tables and plots.
    let mut text = format!(
        "# Projected weak scaling: {} on {} ({} ranks per node)\n\nProjected, not measured: {:.1} ms of compute per step per rank at batch {}, {:.1} MB of f32 gradients in {} MiB buckets, backward {:.0}% of compute (what overlap can hide); cost model {}.\n\n| strategy | ranks | nodes | step ms | exchange ms | exposed ms | img/s | speedup | efficiency |\n|---|---|---|---|---|---|---|---|---|\n",
        args.model.name(), profile.name, per_node, compute_s * 1e3, args.batch, gradient_bytes / 1e6, args.bucket_mb, args.backward_share * 100.0,
        serde_json::to_string(&model).unwrap_or_default()
    );
    let mut records = Vec::new();
    let one_rank = args.batch as f64 / compute_s;
    for strategy in strategies {
        for &n in &ranks {
            let layout = Layout { ranks: n, per_node: per_node.min(n) };
            let Some(p) = project_step(predictor, strategy, layout, gradient_bytes, args, compute_s) else { continue };
            if strategy == "ps" && n < 2 {
                continue;
            }
            let images = (n * args.batch) as f64 / p.step_s;
            let speedup = images / one_rank;
            text.push_str(&format!(
                "| {} (projected) | {} | {} | {:.1} | {:.1} | {:.1} | {:.0} | {:.2} | {:.1}% |\n",
                p.strategy, p.ranks, layout.nodes(), p.step_s * 1e3, p.exchange_s * 1e3, p.exposed_s * 1e3, images, speedup, speedup / n as f64 * 100.0
            ));
            records.push(projected_record(args, &profile, p, layout, images, compute_s, &slug));
        }
    }
    // Pipelined layouts (issue 36), beside the data-parallel ones.
    let micro = args.micro_batches;
    for stages in parse_pipeline_stages(&args.pipeline_stages, &ranks)? {
        let bytes = boundary_bytes(args.model, stages)?;
        for &n in ranks.iter().filter(|&&n| n % stages == 0) {
            let layout = Layout { ranks: n, per_node: per_node.min(n) };
            let Some(p) = project_pipeline(predictor, layout, args.schedule, stages, micro, bytes, args.batch, gradient_bytes, compute_s) else { continue };
            let images = (n / stages * args.batch) as f64 / p.step_s;
            let speedup = images / one_rank;
            text.push_str(&format!(
                "| {} (projected) | {} | {} | {:.1} | {:.1} | {:.1} | {:.0} | {:.2} | {:.1}% |\n",
                p.strategy, p.ranks, layout.nodes(), p.step_s * 1e3, p.exchange_s * 1e3, p.exposed_s * 1e3, images, speedup, speedup / n as f64 * 100.0
            ));
            let mut record = projected_record(args, &profile, p, layout, images, compute_s, &slug);
            record.strategy = "ring (projected)".into();
            record.workers = n / stages;
            record.global_batch = n / stages * args.batch;
            record.batch_per_rank = args.batch;
            let shape = crate::plan::pipeline::Shape::new(args.schedule, stages, micro, 1).map_err(Error::usage)?;
            record.pipeline = Some(crate::results::PipelineRecord {
                pipeline_stages: stages,
                micro_batches: micro,
                schedule: args.schedule.name().into(),
                virtual_stages: 1,
                partition: "params".into(),
                theoretical_bubble: shape.theoretical_bubble(),
                ..Default::default()
            });
            records.push(record);
        }
    }
    let md = args.out.join(format!("{slug}.md"));
    std::fs::write(&md, &text).at(&md)?;
    let runs = args.out.join(format!("{slug}-runs.jsonl"));
    let _ = std::fs::remove_file(&runs);
    for r in &records {
        results::append_json_line(&runs, r)?;
    }
    print!("{text}");
    println!("wrote {} and {}", md.display(), runs.display());
    crate::report::run(&ReportArgs { input: runs, study: None, bench: None, points: None, statistic: Default::default(), out: args.out.join(&slug) })?;

    if args.validate_bench.is_some() || args.validate_runs.is_some() {
        validate(predictor, args)?;
    }
    Ok(())
}

/// `project --plan`: the layouts that fit, fastest first, as a table (the first --show) and
/// JSON lines (all).
fn plan_layouts(args: &ProjectArgs, profile: &Profile, model: &CostModel, per_node: usize) -> Result<()> {
    let preset = preset_of(args.transformer);
    let hidden = args.hidden.unwrap_or(preset.hidden);
    // A changed width keeps the preset's MLP ratio.
    let shape = Transformer {
        layers: args.layers.unwrap_or(preset.layers),
        hidden,
        heads: args.heads.unwrap_or(preset.heads),
        mlp: preset.mlp / preset.hidden * hidden,
        tokens: args.tokens.unwrap_or(preset.tokens),
        vocab: args.vocab.unwrap_or(preset.vocab),
    };
    let positive = |v: f64, flag: &str| if v.is_finite() && v > 0.0 { Ok(v) } else { Err(Error::usage(format!("--{flag} {v}: expected a positive number"))) };
    if !shape.hidden.is_multiple_of(shape.heads) {
        return Err(Error::usage(format!("--hidden {}: not a multiple of the {} heads (--heads)", shape.hidden, shape.heads)));
    }
    let setting = Setting {
        model,
        gpus: args.gpus,
        per_node,
        global_batch: args.global_batch,
        memory_bytes: positive(args.gpu_memory_gb, "gpu-memory-gb")? * 1e9,
        flops_per_gpu: positive(args.gpu_tflops, "gpu-tflops")? * 1e12,
        schedule: args.schedule,
    };
    let all = layouts::plan(&shape, &setting);
    let name = match (args.transformer, args.layers.or(args.hidden).or(args.heads).or(args.tokens).or(args.vocab)) {
        (kind, None) => format!("{kind:?}").to_lowercase(),
        (kind, Some(_)) => format!("{}-l{}-h{}", format!("{kind:?}").to_lowercase(), shape.layers, shape.hidden),
    };
    let slug = format!("{}-{name}-{}gpus", args.profile.file_stem().and_then(|s| s.to_str()).unwrap_or("profile"), args.gpus);
    let mut text = format!(
        "# Layouts of {name} on {} GPUs of {} ({per_node} per node)

Projected, not measured: {:.1} billion parameters ({} layers, width {}, {} heads, MLP {}, {} tokens, vocabulary {}); global batch {}; {} GB per GPU; {} TFLOP/s sustained per GPU on the layers; cost model {}.

",
        args.gpus, profile.name, shape.parameters() / 1e9, shape.layers, shape.hidden, shape.heads, shape.mlp, shape.tokens, shape.vocab, args.global_batch,
        args.gpu_memory_gb, args.gpu_tflops, serde_json::to_string(model).unwrap_or_default()
    );
    if all.is_empty() {
        text.push_str("No layout fits: every (D, P, T, b) needs more memory per GPU than given.
");
    } else {
        text.push_str(&format!("{} layouts fit; the {} fastest:

", all.len(), args.show.min(all.len())));
        text.push_str("| D | P | T | micro-batch | micro-batches | recompute | memory GB | compute s | bubble s | TP comm s | PP comm s | DP comm s | step s | TFLOP/s per GPU |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
");
        for (i, p) in all.iter().take(args.show).enumerate() {
            text.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {:.1} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3}{} | {:.0} |
",
                p.data, p.pipeline, p.tensor, p.micro_batch, p.micro_batches, if p.recompute { "yes" } else { "no" }, p.memory_bytes() / 1e9,
                p.compute_s, p.bubble_s, p.tensor_s, p.pipeline_s, p.data_s, p.step_s, if i == 0 { " (fastest)" } else { "" }, p.achieved_flops_per_gpu / 1e12
            ));
        }
    }
    std::fs::create_dir_all(&args.out).at(&args.out)?;
    let md = args.out.join(format!("{slug}-plan.md"));
    std::fs::write(&md, &text).at(&md)?;
    let lines = args.out.join(format!("{slug}-plan.jsonl"));
    let _ = std::fs::remove_file(&lines);
    for (rank, p) in all.iter().enumerate() {
        results::append_json_line(&lines, &serde_json::json!({ "rank": rank + 1, "transformer": name, "gpus": args.gpus, "layout": p }))?;
    }
    print!("{text}");
    println!("wrote {} and {}", md.display(), lines.display());
    Ok(())
}

fn projected_record(args: &ProjectArgs, profile: &Profile, p: Point, layout: Layout, images: f64, compute_s: f64, slug: &str) -> RunRecord {
    let mut extra = serde_json::Map::new();
    extra.insert("projected".into(), true.into());
    extra.insert("profile".into(), profile.name.clone().into());
    extra.insert("exchange_total_ms".into(), (p.exchange_s * 1e3).into());
    RunRecord {
        strategy: format!("{} (projected)", p.strategy),
        ranks: p.ranks,
        workers: p.ranks,
        nodes: layout.nodes(),
        model: args.model.name().into(),
        dataset: format!("projected on {}", profile.name),
        image_shape: vec![3, 224, 224],
        batch_per_rank: args.batch,
        global_batch: args.batch * p.ranks,
        scaling: "weak".into(),
        steps: 1,
        epochs: 0.0,
        images_per_sec: images,
        step_ms: p.step_s * 1e3,
        compute_ms: compute_s * 1e3,
        comm_ms: p.exposed_s * 1e3,
        data_wait_ms: 0.0,
        optimizer_ms: 0.0,
        final_loss: 0.0,
        test_accuracy: None,
        test_loss: None,
        device: "gpu (projected)".into(),
        mpi_library: "-".into(),
        cuda_aware: true,
        data_path: None,
        threads: 0,
        bucket_mb: args.bucket_mb,
        peak_rss_mb: 0.0,
        rss_warmup_mb: 0.0,
        rss_end_mb: 0.0,
        host: "-".into(),
        git_commit: results::GIT_COMMIT.into(),
        timestamp: results::timestamp(),
        study: Some(format!("projected-{slug}")),
        optimizer: None,
        lr_schedule: None,
        final_lr: None,
        accuracy_by_epoch: Vec::new(),
        target_accuracy: None,
        time_to_target_s: None,
        epoch_to_target: None,
        pipeline: None,
        extra,
        rerun: Default::default(),
        hardware: Default::default(),
    }
}

/// One rank's compute per step from measured runs: the 1-rank run of the model at the batch.
fn compute_from_runs(path: &Path, args: &ProjectArgs) -> Result<f64> {
    let runs: Vec<RunRecord> = results::read_json_lines(path)?;
    runs.iter()
        .rev()
        .find(|r| r.model == args.model.name() && r.ranks == 1 && r.batch_per_rank == args.batch && r.steps > 0)
        .map(|r| (r.compute_ms + r.optimizer_ms) * 1e-3)
        .ok_or_else(|| Error::usage(format!("{}: no 1-rank run of {} at batch {} to take the compute time from", path.display(), args.model.name(), args.batch)))
}

/// Predictions against every measured row given: validation.csv.
fn validate(predictor: Predictor, args: &ProjectArgs) -> Result<()> {
    let mut rows: Vec<Residual> = Vec::new();
    if let Some(path) = &args.validate_bench {
        let bench: Vec<BenchRow> = results::read_json_lines(path)?;
        let lone = Predictor { cycle_share: 1.0, ..predictor };
        for r in bench.iter().filter(|r| r.usable()) {
            if let Some(p) = lone.exchange(r.strategy(), r.layout(), r.size as f64, r.shared_ring(), true) {
                rows.push(residual(r.strategy(), r.ranks, r.nodes.max(1), r.link_mbit, Some(r.size), r.time_us, p * 1e6));
            }
        }
    }
    if let Some(path) = &args.validate_runs {
        let runs: Vec<RunRecord> = results::read_json_lines(path)?;
        for r in runs.iter().filter(|r| r.steps > 0 && r.ranks > 1 && r.device == "cpu") {
            let Some(parameters) = r.extra.get("parameters").and_then(|v| v.as_u64()) else { continue };
            let layout = Layout { ranks: r.ranks, per_node: r.ranks.div_ceil(r.nodes.max(1)) };
            let sub = ProjectArgs { bucket_mb: if r.bucket_mb > 0.0 { r.bucket_mb } else { args.bucket_mb }, ..args.clone() };
            let compute = (r.compute_ms + r.optimizer_ms + r.data_wait_ms) * 1e-3;
            let overlap = r.extra.get("overlap").and_then(|v| v.as_bool()).unwrap_or(false);
            // Pipelined runs are not data-parallel steps: the formula above is not theirs.
            if r.pipeline.is_some() {
                continue;
            }
            let strategy: &'static str = match r.strategy.as_str() {
                "ring" => "ring",
                "rhd" => "rhd",
                "auto" => "auto",
                "allreduce" => "allreduce",
                "horovod" if r.extra.get("hierarchical").and_then(|v| v.as_bool()) == Some(true) => HOROVOD_HIERARCHICAL,
                "horovod" => "horovod",
                "ps" => "ps",
                _ => continue,
            };
            let Some(p) = project_step(predictor, strategy, layout, parameters as f64 * 4.0, &ProjectArgs { backward_share: if overlap { sub.backward_share } else { 0.0 }, ..sub }, compute) else { continue };
            rows.push(residual(strategy, r.ranks, r.nodes.max(1), r.extra.get("link_mbit").and_then(|v| v.as_f64()), None, r.step_ms * 1e3, p.step_s * 1e6));
        }
    }
    let path = args.out.join("validation.csv");
    let mut w = csv::Writer::from_path(&path).map_err(|e| Error::Results(format!("{}: {e}", path.display())))?;
    w.write_record(["strategy", "ranks", "nodes", "link_mbit", "size_bytes", "measured_us", "predicted_us", "error_pct"]).map_err(|e| Error::Results(e.to_string()))?;
    for r in &rows {
        w.write_record([
            r.strategy.clone(),
            r.ranks.to_string(),
            r.nodes.to_string(),
            r.link_mbit.map_or(String::new(), |m| m.to_string()),
            r.size_bytes.map_or(String::new(), |s| s.to_string()),
            format!("{:.1}", r.measured_us),
            format!("{:.1}", r.predicted_us),
            format!("{:.1}", r.error_pct),
        ])
        .map_err(|e| Error::Results(e.to_string()))?;
    }
    w.flush().at(&path)?;
    let errors: Vec<f64> = rows.iter().map(|r| r.error_pct.abs()).collect();
    println!(
        "validation: {} row(s), median |error| {:.1}%, within 15%: {}; wrote {}",
        rows.len(),
        if errors.is_empty() { 0.0 } else { median(errors.clone()) },
        errors.iter().filter(|&&e| e <= 15.0).count(),
        path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_with_rates_of_zero_or_less_are_refused_by_name() {
        let profile = |extra: &str| -> Profile {
            toml::from_str(&format!("name = \"p\"\nranks_per_node = 8\nadd_gbs = 100.0\n{extra}\n[intra]\ngbs = 100.0\nalpha_us = 2.0\n[inter]\ngbs = 10.0\nalpha_us = 5.0\n")).unwrap()
        };
        let (model, curve) = profile("fabric_gbs = 40.0").model(Path::new(".")).unwrap();
        assert_eq!((model.fabric_s_per_byte, curve), (Some(1.0 / 40e9), None));
        assert_eq!(profile("").model(Path::new(".")).unwrap().0.fabric_s_per_byte, None);
        for (extra, named) in [("fabric_gbs = 0.0", "fabric_gbs is 0"), ("fabric_gbs = -1.0", "fabric_gbs is -1")] {
            let message = profile(extra).model(Path::new(".")).unwrap_err().to_string();
            assert!(message.contains(named), "{message}");
        }
        let zero_link: Profile = toml::from_str("name = \"p\"\nranks_per_node = 8\nadd_gbs = 100.0\n[intra]\ngbs = 0.0\nalpha_us = 2.0\n[inter]\ngbs = 10.0\nalpha_us = -5.0\n").unwrap();
        let message = zero_link.model(Path::new(".")).unwrap_err().to_string();
        assert!(message.contains("[intra] gbs is 0"), "{message}");
    }

    /// A projected pipeline: the bubble's M + P - 1 slots with their messages, then the
    /// stage's share of the gradients among its replicas.
    #[test]
    fn pipelines_are_projected_through_the_bubble_and_the_stages_exchange() {
        let model = CostModel::default();
        let p = Predictor { model: &model, mpi_allreduce: None, servers: 1, cycle_s: 1e-3, cycle_share: 0.5 };
        let (compute, grads, boundary) = (0.1, 1e8, 1e5);
        // One node of 8: 4 pipelines of 2 stages, messages on the node's link.
        let layout = Layout { ranks: 8, per_node: 8 };
        let point = project_pipeline(p, layout, ScheduleKind::OneFOneB, 2, 16, boundary, 64, grads, compute).unwrap();
        let message = model.intra.alpha_s + boundary * 4.0 * model.intra.beta_s_per_byte;
        let ring = p.exchange("ring", Layout { ranks: 4, per_node: 4 }, grads / 2.0, true, false).unwrap();
        let expected = 17.0 * (compute / 32.0 + 2.0 * message) + ring;
        assert!((point.step_s - expected).abs() < 1e-12, "{} {expected}", point.step_s);
        assert_eq!(point.strategy, "ring (P=2, M=16 1f1b)");
        // Zero bubble: ZB-H1 idles a third of 1F1B's P - 1 slots, ZB-V a sixth with twice the
        // messages.
        let h1 = project_pipeline(p, layout, ScheduleKind::ZbH1, 2, 16, boundary, 64, grads, compute).unwrap();
        let expected = 16.0 * compute / 32.0 * (1.0 + 1.0 / 48.0) + 17.0 * 2.0 * message + ring;
        assert!((h1.step_s - expected).abs() < 1e-12 && h1.strategy == "ring (P=2, M=16 zb-h1)", "{} {expected}", h1.step_s);
        let v = project_pipeline(p, layout, ScheduleKind::ZbV, 2, 16, boundary, 64, grads, compute).unwrap();
        let expected = 16.0 * compute / 32.0 * (1.0 + 1.0 / 96.0) + 17.0 * 4.0 * message + ring;
        assert!((v.step_s - expected).abs() < 1e-12, "{} {expected}", v.step_s);
        // More micro-batches, a smaller bubble; one pipeline, no exchange.
        let more = project_pipeline(p, Layout { ranks: 2, per_node: 8 }, ScheduleKind::OneFOneB, 2, 64, 0.0, 64, grads, compute).unwrap();
        let fewer = project_pipeline(p, Layout { ranks: 2, per_node: 8 }, ScheduleKind::OneFOneB, 2, 4, 0.0, 64, grads, compute).unwrap();
        assert_eq!(more.exchange_s, 0.0);
        assert!(more.step_s < fewer.step_s);
        assert!(boundary_bytes(ModelKind::Resnet18, 2).unwrap() > 0.0);
        assert!(parse_pipeline_stages("1,2", &[2]).unwrap_err().to_string().contains("at least 2 stages"));
        assert!(parse_pipeline_stages("", &[2]).unwrap().is_empty());
    }

    fn project_args(extra: &[&str]) -> ProjectArgs {
        use clap::Parser;
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            project: ProjectArgs,
        }
        let mut argv = vec!["project", "--profile", "p.toml"];
        argv.extend(extra);
        Command::try_parse_from(argv).unwrap().project
    }

    /// Each of project's flags is checked under its own name (issue 48): no table of NaN from a
    /// compute time of 0, no wrapped widths, no stage count that projects nothing, and no word
    /// of study's --stages or of "this launch".
    #[test]
    fn project_refuses_its_own_flags_by_their_own_names() {
        let refused = |extra: &[&str]| check_flags(&project_args(extra)).unwrap_err().to_string();
        assert_eq!(check_flags(&project_args(&["--compute-ms", "5", "--ranks", "1,4", "--pipeline-stages", "2"])).unwrap(), vec![1, 4]);
        let err = check_flags(&project_args(&["--compute-ms", "5", "--pipeline-stages", "2", "--schedule", "interleaved"])).unwrap_err().to_string();
        assert!(err.contains("--schedule interleaved: project prices gpipe, 1f1b, zb-h1 and zb-v"), "{err}");
        for (extra, message) in [
            (&["--compute-ms", "0"][..], "--compute-ms 0: expected a positive number of milliseconds"),
            (&["--compute-ms", "NaN"], "--compute-ms NaN: expected a positive number of milliseconds"),
            (&["--compute-ms", "inf"], "--compute-ms inf: expected"),
            (&["--backward-share", "2"], "--backward-share 2: expected a share of compute from 0 to 1"),
            (&["--backward-share", "NaN"], "--backward-share NaN:"),
            (&["--bucket-mb", "0"], "--bucket-mib 0: expected a positive number of MiB"),
            (&["--micro-batches", "0"], "--micro-batches 0: expected at least 1"),
            (&["--batch", "0"], "--batch 0: expected at least 1"),
            (&["--servers", "0"], "--servers 0: expected at least 1"),
            (&["--ranks-per-node", "0"], "--ranks-per-node 0: expected at least 1"),
            (&["--ranks", "0"], "--ranks: \"0\" is not a rank count (1 or more)"),
            (&["--ranks", "18446744073709551615"], "--ranks 18446744073709551615: 18446744073709551615 ranks of --batch 256 samples each do not fit in 64 bits"),
            (&["--pipeline-stages", "x"], "--pipeline-stages: \"x\" is not a number of pipeline stages"),
            (&["--ranks", "1,2,4", "--pipeline-stages", "2,3"], "--pipeline-stages 3: divides none of the rank counts of --ranks 1,2,4"),
            (&["--plan", "--vocab", "0"], "--vocab 0: expected at least 1"),
            (&["--plan", "--layers", "0"], "--layers 0: expected at least 1"),
            (&["--plan", "--global-batch", "0"], "--global-batch 0: expected at least 1"),
            (&["--plan", "--gpus", "18446744073709551615"], "--gpus 18446744073709551615: at most 16777216 (2^24) GPUs are laid out"),
            (&["--plan", "--hidden", "18446744073709551615"], "--hidden 18446744073709551615: too wide"),
        ] {
            let message_got = refused(extra);
            assert!(message_got.starts_with(message), "{extra:?}: {message_got}");
            assert!(!message_got.contains("--stages") && !message_got.contains("launch"), "{message_got}");
        }
        // The largest plan allowed and a batch near 2^64 pass the check (and plan quickly: layouts.rs).
        assert!(check_flags(&project_args(&["--plan", "--gpus", "16777216", "--global-batch", "18446744073709551615"])).is_ok());
    }
}
