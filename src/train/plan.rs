//! The run's plan: the options resolved against the world ([`Plan`]: device, threads, workers,
//! batch), and the checks made before anything starts: settings, outputs that would overwrite
//! inputs, the model against the data and the memory, the same configuration on every rank.
//! Also the choice of each rank's device.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mpi::traits::*;
use tch::Device;

use crate::checkpoint;
use crate::data::DatasetInfo;
use crate::data::loader::memory_available;
use crate::error::{Error, Result};
use crate::exchange;
use crate::model::InputSpec;
use crate::raw;
use crate::results;
use crate::topology::{assign_gpus, World};

use super::collective::gather_strings;
use super::options::{DeviceChoice, Precision, Scaling, TrainArgs};
use super::stages::PipelinePlan;
use crate::plan::compat::{self, Feature, Kind};

/// Options resolved against the world: what every rank agrees to run.
pub(super) struct Plan {
    pub(super) device: Device,
    pub(super) threads: usize,
    pub(super) cuda_aware: bool,
    pub(super) workers: usize,
    pub(super) batch: usize,
    /// The pipelines' grid and schedule shape, for a pipelined run.
    pub(super) pipeline: Option<PipelinePlan>,
}

/// The ranks that take a share of each step's batch when `args` train with `strategy` on `ranks`
/// ranks in `stages` pipeline stages: a pipelined run's pipelines (the replicas, as its grid
/// counts them), a tensor-parallel run's groups, else the strategy's workers (ps's dedicated
/// servers take none). `hpc-train study` asks it of every point before the first runs.
pub fn training_ranks(args: &TrainArgs, strategy: exchange::StrategyKind, ranks: usize, stages: usize) -> Result<usize> {
    let plane = ranks / (args.tensor_parallel as usize).max(1);
    if stages > 1 {
        return Ok(plane / stages);
    }
    if args.tensor_parallel > 1 {
        return Ok(plane);
    }
    exchange::worker_count(strategy, ranks, &args.ps.roles())
}

/// Whether `args` combine, as a run checks before it starts (the compatibility table, and the
/// options the strategy reads): `--print-config` prints no run file that a run would refuse.
pub fn check_combination(args: &TrainArgs) -> Result<()> {
    let (features, kinds) = features_and_kinds(args, crate::faults::injected());
    compat::check(&features, &kinds).map_err(Error::usage)?;
    check_triples(args)?;
    args.check_unused_options(&[args.strategy]).map(|_| ())
}

impl Plan {
    pub(super) fn resolve(args: &TrainArgs, world: &World) -> Result<Plan> {
        // First: choosing the device is collective over the node's ranks (before any early return).
        let device = choose_device(args.device, args.allow_gpu_sharing, world);
        // What combines, from the one table (plan/compat.rs), before any size is looked at.
        let (features, kinds) = features_and_kinds(args, crate::faults::injected());
        compat::check(&features, &kinds).map_err(Error::usage)?;
        check_tensor_parallel(args, world.size as usize)?;
        // With tensor parallelism a pipeline's stages are groups: the grid lays out the ranks of
        // one place in the groups (N / T of them).
        let pipeline = args.pipeline.plan(&args.given, world.size as usize / args.tensor_parallel as usize, args.model)?;
        let workers = match &pipeline {
            Some(p) => p.grid.replicas,
            None => training_ranks(args, args.strategy, world.size as usize, 1)?,
        };
        let batch = batch_per_worker(args, workers)?;
        if let Some(p) = &pipeline {
            check_pipeline(p, batch)?;
        }
        check_triples(args)?;
        if args.given.has("loss_scale") && args.precision != Precision::Fp16 {
            return Err(Error::usage("--loss-scale is an option of --precision fp16 (the loss scaler); drop it, or add --precision fp16"));
        }
        if !(args.loss_scale.is_finite() && args.loss_scale >= 1.0 && args.loss_scale <= f32::MAX as f64) {
            return Err(Error::usage(format!("--loss-scale {}: expected a scale from 1 to the largest f32", args.loss_scale)));
        }
        if args.steps == Some(0) || (args.steps.is_none() && args.epochs == 0) {
            return Err(Error::usage("nothing to train: --steps and --epochs must be at least 1"));
        }
        args.exchange.check()?;
        args.recipe.check(&args.given)?;
        if args.recipe.target_accuracy.is_some() && args.no_eval {
            return Err(Error::usage("--target-accuracy with --no-eval: the accuracy is measured by the evaluation at each epoch's end; drop --no-eval"));
        }
        check_outputs_are_not_inputs(args)?;
        let device = device?;
        // bf16 and fp16 autocast on the CPU as on CUDA; TF32 is a mode of NVIDIA's matrix units,
        // which a CPU rank would silently compute without (in fp32) while its record said tf32.
        if device == Device::Cpu && args.precision == Precision::Tf32 {
            return Err(Error::usage("--precision tf32: TF32 is a mode of NVIDIA GPUs' matrix units; this rank trains on the CPU, where it would compute in fp32 (use fp32, or bf16 / fp16 autocast)"));
        }
        // The ranks the data-parallel exchange runs on: with pipelines or tensor parallelism a
        // stage's (or place's) D replicas, not the world (12 ranks in 3 stages are D = 4, a power
        // of two for rhd; issue 48).
        exchange::check_zero(args.strategy, args.zero, workers)?;
        check_fully_sharded_options(args)?;
        let threads = if args.threads > 0 {
            check_threads(args.threads, num_cpus_online())?;
            let mine = std::thread::available_parallelism().map_or(1, |n| n.get());
            if args.threads > mine && world.is_root() {
                log::warn!("--threads {}: this rank may run on {mine} core(s); its threads will take turns on them", args.threads);
            }
            args.threads
        } else {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            // With ranks bound to cores, each rank sees its own; unbound, the node's ranks share.
            let bound = cores < num_cpus_online();
            if bound { cores } else { (cores / world.local_size as usize).max(1) }
        };
        warn_single_core_gpu_rank(device, world.rank);
        let cuda_aware = args.exchange.cuda_aware.resolve();
        if device.is_cuda() && world.is_root() {
            // Which path the GPU's bytes take to MPI, said once at start-up: the record says it
            // again at the end, but a run that hangs or fails in its first exchange never gets there.
            log::info!(
                "GPU buffers go to MPI {} (--cuda-aware {})",
                if cuda_aware { "directly (CUDA-aware MPI)" } else { "staged through pinned host memory (MPI not CUDA-aware)" },
                format!("{:?}", args.exchange.cuda_aware).to_lowercase()
            );
        }
        Ok(Plan { device, threads, cuda_aware, workers, batch, pipeline })
    }
}

/// A GPU rank bound to one core (Open MPI binds 1 or 2 ranks to a core each by default) shares
/// it between the training thread, which launches the kernels, the loader thread and libtorch's
/// autograd thread: the GPU then waits for the host (on the H200, 2026-11-26, every hpc-train
/// run was so bound while PyTorch had 16 cores). Said by the rank itself, since ranks may be
/// bound differently.
fn warn_single_core_gpu_rank(device: Device, rank: i32) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if device.is_cuda() && cores == 1 && num_cpus_online() > 1 {
        log::warn!(
            "rank {rank} trains on a GPU but may run on 1 of this node's {} cores: its training, loader and autograd threads take turns on it and the GPU waits for them; launch with `mpirun --bind-to none` or give each rank several cores (`--map-by slot:PE=N`, Slurm's --cpus-per-task)",
            num_cpus_online()
        );
    }
}

/// What `--tensor-parallel` needs and cannot do yet, refused with the reason.
fn check_tensor_parallel(args: &TrainArgs, ranks: usize) -> Result<()> {
    let t = args.tensor_parallel as usize;
    if t == 1 {
        if args.given.has("tp_allreduce") {
            return Err(Error::usage("--tp-allreduce is an option of --tensor-parallel (2 or more); add it or drop --tp-allreduce"));
        }
        return Ok(());
    }
    let config = args.model.vit_config().ok_or_else(|| {
        Error::usage(format!(
            "--tensor-parallel {t} splits a transformer's attention heads and MLP over ranks; --model {} has none: use --model vit-b16 or vit-tiny (or data, pipeline or fully sharded parallelism for CNNs)",
            args.model.name()
        ))
    })?;
    crate::plan::tensor::check_divides(args.model.name(), config.heads as usize, config.mlp as usize, t).map_err(Error::usage)?;
    crate::plan::tensor::Layout::new(ranks, args.pipeline.pipeline_stages as usize, t).map_err(Error::usage)?;
    Ok(())
}

/// The options of `args` that change what a step computes or how it fails, and the layout
/// kinds the run is in: the rows and columns of plan/compat.rs's table that the run touches.
/// `faults`: whether `HPC_TRAIN_FAULT` injects any.
pub fn features_and_kinds(args: &TrainArgs, faults: bool) -> (Vec<Feature>, Vec<Kind>) {
    use crate::exchange::config::PsMode;
    use crate::optim::{DecayKind, OptimizerKind, ScaleLr};
    use crate::plan::pipeline::ScheduleKind;
    use exchange::StrategyKind as S;
    let mut kinds = vec![match args.strategy {
        S::Ring => Kind::Ring,
        S::Rhd => Kind::Rhd,
        S::Auto => Kind::Auto,
        S::Ps if args.ps.ps_mode == PsMode::Async => Kind::PsAsync,
        S::Ps => Kind::Ps,
        S::Allreduce => Kind::Allreduce,
        S::Horovod => Kind::Horovod,
    }];
    kinds.extend(match args.zero {
        1 => vec![Kind::Zero1],
        2 => vec![Kind::Zero2],
        3 if args.fsdp_hybrid => vec![Kind::Zero3, Kind::Zero3Hybrid],
        3 => vec![Kind::Zero3],
        _ => vec![],
    });
    if args.pipeline.pipelined() {
        kinds.push(match args.pipeline.schedule {
            ScheduleKind::Gpipe => Kind::Gpipe,
            ScheduleKind::OneFOneB => Kind::OneFOneB,
            ScheduleKind::Interleaved => Kind::Interleaved,
            ScheduleKind::ZbH1 => Kind::ZbH1,
            ScheduleKind::ZbV => Kind::ZbV,
        });
    }
    if args.tensor_parallel > 1 {
        kinds.push(Kind::TensorParallel);
        if args.pipeline.pipelined() {
            kinds.push(Kind::TensorPipeline);
        }
    }
    let recipe = &args.recipe;
    let uses = [
        (Feature::Tf32, args.precision == Precision::Tf32),
        (Feature::Bf16, args.precision == Precision::Bf16),
        (Feature::Fp16, args.precision == Precision::Fp16),
        (Feature::Lars, recipe.optimizer == OptimizerKind::Lars),
        (Feature::Adamw, recipe.optimizer == OptimizerKind::Adamw),
        (Feature::LrSchedule, recipe.lr_schedule != DecayKind::Constant || recipe.warmup_epochs > 0.0 || recipe.scale_lr != ScaleLr::None),
        (Feature::LabelSmoothing, recipe.label_smoothing > 0.0),
        (Feature::Overlap, args.overlap == super::options::OnOff::On),
        (Feature::ChannelsLast, args.channels_last),
        (Feature::Recompute, args.pipeline.recompute),
        (Feature::Checkpoint, args.checkpoint_dir.is_some()),
        (Feature::Resume, args.resume),
        (Feature::SaveWeights, args.save_weights.is_some()),
        (Feature::InitWeights, args.init_weights.is_some()),
        (Feature::Eval, !args.no_eval),
        (Feature::Faults, faults),
        (Feature::Profile, args.profile_dir.is_some()),
        (Feature::PipelineTimeline, args.pipeline.pipeline_timeline.is_some()),
        (Feature::HorovodTimeline, args.horovod.timeline.is_some()),
        (Feature::Compression, args.horovod.compression != crate::exchange::config::Compression::None),
        (Feature::Hierarchical, args.horovod.hierarchical == Some(true)),
        (Feature::CacheData, args.cache_data == crate::data::loader::CacheData::On),
        (Feature::StrongScaling, args.scaling == Scaling::Strong),
    ];
    (uses.into_iter().filter(|(_, used)| *used).map(|(f, _)| f).collect(), kinds)
}

/// `--zero 3`'s own options without it (what stage 3 combines with is plan/compat.rs's).
fn check_fully_sharded_options(args: &TrainArgs) -> Result<()> {
    if args.zero != 3 {
        if let Some(flag) = [("fsdp_unit", "--fsdp-unit"), ("fsdp_hybrid", "--fsdp-hybrid")].iter().find(|(id, _)| args.given.has(id)).map(|(_, f)| f) {
            return Err(Error::usage(format!("{flag} is an option of --zero 3 (fully sharded data parallelism); add --zero 3 or drop it")));
        }
    }
    Ok(())
}

/// Combinations of three, which the table of pairs (plan/compat.rs) cannot state:
/// - fp16 with ZeRO 1/2 and `--overlap on`: ZeRO's overlap steps each bucket's shard as soon as
///   the bucket is reduced, while backward still runs; the loss scaler must see every gradient
///   before any step. (`--overlap auto` chooses off there: overlap_choice.rs.)
/// - `--zero 3` in a pipeline with `--overlap on`: stage 3's overlap is its units' prefetch,
///   and a pipeline stage is gathered once, before its schedule (pipeline_step.rs), with
///   nothing beside it to hide behind. (`--overlap auto` is off there: set-up.)
/// - `--fsdp-unit` in a pipeline: a stage is its own one unit.
fn check_triples(args: &TrainArgs) -> Result<()> {
    let on = args.overlap == super::options::OnOff::On;
    if args.precision == Precision::Fp16 && matches!(args.zero, 1 | 2) && on {
        return Err(Error::usage(format!(
            "--precision fp16 with --zero {} and --overlap on: ZeRO's overlap steps each bucket's shard as soon as it is reduced, before the loss scaler has seen every gradient; use --overlap off or auto, or --precision bf16",
            args.zero
        )));
    }
    if args.zero == 3 && args.pipeline.pipelined() {
        if on {
            return Err(Error::usage(
                "--zero 3 with --pipeline-stages and --overlap on: stage 3's overlap is the prefetch of its next unit, and a pipeline stage is one unit, gathered once before its schedule; use --overlap off or auto",
            ));
        }
        if args.given.has("fsdp_unit") {
            return Err(Error::usage(
                "--fsdp-unit with --pipeline-stages: under --zero 3 a pipeline stage is one unit, gathered once per step for all its micro-batches (as torchtitan's FSDP under pipelining, which does not reshard after forward); drop --fsdp-unit",
            ));
        }
    }
    Ok(())
}

/// What a pipeline's sizes cannot do, refused with the reason.
fn check_pipeline(plan: &PipelinePlan, batch: usize) -> Result<()> {
    let m = plan.shape.micro_batches;
    if batch < m {
        return Err(Error::usage(format!(
            "--micro-batches {m} with a batch of {batch} per pipeline: some micro-batches would be empty; use at most {batch} micro-batches or a larger batch"
        )));
    }
    Ok(())
}

/// Intra-op threads beyond this many per core online are refused.
const MAX_THREADS_PER_CORE: usize = 4;

/// `--threads` against the cores online: libtorch's intra-op threads meet at the end of every
/// parallel region, so threads beyond the cores only wait for each other (--threads 1000 on
/// 2 cores took 28 s for 2 steps; 100,000 never started). A few per core can make sense when
/// ranks share a node unevenly; more than `MAX_THREADS_PER_CORE` times the cores never does.
pub(super) fn check_threads(threads: usize, cores_online: usize) -> Result<()> {
    let limit = MAX_THREADS_PER_CORE * cores_online.max(1);
    if threads > limit {
        return Err(Error::usage(format!(
            "--threads {threads}: {} has {cores_online} core(s) online, and more than {MAX_THREADS_PER_CORE} intra-op threads per core only wait for each other; use at most {limit}, or 0 for the cores this rank may use",
            raw::hostname()
        )));
    }
    Ok(())
}

/// Refuses an output of the run that is one of its inputs (`--save-weights` on the `--data`
/// file overwrote the dataset): the files the run writes against the ones it reads, compared
/// as canonical paths and, when the output exists, as the same inode (a hard link). An output
/// in a checkpoint folder is refused too, and a `--checkpoint-dir` that is one.
pub(super) fn check_outputs_are_not_inputs(args: &TrainArgs) -> Result<()> {
    check_outputs_against_inputs(args, std::env::var_os("HOROVOD_TIMELINE").map(PathBuf::from))
}

/// [`check_outputs_are_not_inputs`] with the value of `HOROVOD_TIMELINE` given, which a
/// Horovod-style run without `--timeline` writes its timeline to, as Horovod does.
fn check_outputs_against_inputs(args: &TrainArgs, horovod_timeline_variable: Option<PathBuf>) -> Result<()> {
    let mut inputs: Vec<(&str, &Path)> = vec![("--data", args.data.as_path())];
    if let Some(model) = &args.exchange.cost_model {
        inputs.push(("--cost-model", model));
    }
    if let Some(weights) = &args.init_weights {
        inputs.push(("--init-weights", weights));
    }
    let runs = results::runs_path(&args.results);
    let mut outputs: Vec<(&str, &Path)> = vec![("--results", runs.as_path())];
    outputs.extend(args.save_weights.as_deref().map(|p| ("--save-weights", p)));
    outputs.extend(args.horovod.timeline.as_deref().map(|p| ("--timeline", p)));
    if args.strategy == exchange::StrategyKind::Horovod && args.horovod.timeline.is_none() {
        outputs.extend(horovod_timeline_variable.as_deref().map(|p| ("HOROVOD_TIMELINE", p)));
    }
    outputs.extend(args.checkpoint_dir.as_deref().map(|p| ("--checkpoint-dir", p)));
    outputs.extend(args.trace_samples.as_deref().map(|p| ("--trace-samples", p)));
    outputs.extend(args.profile_dir.as_deref().map(|p| ("--profile-dir", p)));
    for (input_flag, input) in inputs {
        // An input that does not exist or is no file is reported where it is read.
        let Ok(input_real) = input.canonicalize() else { continue };
        if !input_real.is_file() {
            continue;
        }
        for &(output_flag, output) in &outputs {
            let output_real = canonical_output(output);
            if output_real.starts_with(&input_real) || same_file(output, input) {
                return Err(Error::usage(format!(
                    "{output_flag} {}: it is {} {input_flag} file ({}), which the run reads; write it elsewhere",
                    output.display(),
                    if output_real == input_real || same_file(output, input) { "the" } else { "inside the" },
                    input.display()
                )));
            }
        }
    }
    // Checkpoint folders are inputs wherever they are (a part file overwritten by --save-weights
    // made --resume skip that checkpoint as damaged). --checkpoint-dir naming one is the
    // usual slip of giving a checkpoint where the folder of checkpoints is meant.
    if let Some(dir) = &args.checkpoint_dir {
        if let Some(folder) = checkpoint::files::checkpoint_folder_of(dir).filter(|f| *f == canonical_output(dir)) {
            let parent = folder.parent().unwrap_or(Path::new("/"));
            return Err(Error::usage(format!(
                "--checkpoint-dir {}: it is a checkpoint, not a folder of checkpoints (a run would write its own inside it); to continue from it, give the folder it is in: --checkpoint-dir {} --resume",
                dir.display(),
                parent.display()
            )));
        }
    }
    for &(output_flag, output) in &outputs {
        checkpoint::check_not_in_checkpoint(output_flag, output)?;
    }
    Ok(())
}

/// The canonical form of a path that may not exist yet: its nearest existing ancestor
/// canonicalised, and the rest appended.
fn canonical_output(path: &Path) -> std::path::PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Samples per step of each of the `workers` training ranks: --batch-size (weak scaling), or
/// --global-batch split evenly over them (strong).
fn batch_per_worker(args: &TrainArgs, workers: usize) -> Result<usize> {
    match args.scaling {
        Scaling::Weak => {
            if args.global_batch.is_some() {
                return Err(Error::usage("--global-batch goes with --scaling strong; weak scaling uses --batch-size per rank"));
            }
            Ok(args.batch_size as usize)
        }
        Scaling::Strong => {
            let global = args.global_batch.ok_or_else(|| {
                Error::usage("--scaling strong needs --global-batch (the samples per step over all ranks)")
            })? as usize;
            if !global.is_multiple_of(workers) {
                return Err(Error::usage(format!(
                    "--global-batch {global} is not divisible by the {workers} training ranks (strong scaling splits it evenly)"
                )));
            }
            Ok(global / workers)
        }
    }
}

pub(super) fn num_cpus_online() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| {
            s.trim().split(',').map(|r| match r.split_once('-') {
                Some((a, b)) => b.parse::<usize>().ok().zip(a.parse::<usize>().ok()).map(|(b, a)| b - a + 1),
                None => r.parse::<usize>().ok().map(|_| 1),
            }).sum::<Option<usize>>()
        })
        .unwrap_or(1)
}

/// Whether the model can be built for the dataset and trained at this batch, said before it is
/// built (libtorch would panic, or try to allocate what no machine has).
pub(super) fn check_model_fits(args: &TrainArgs, info: &DatasetInfo, plan: &Plan, world: &World) -> Result<()> {
    let spec = InputSpec {
        channels: info.meta.channels as i64,
        height: info.meta.height as i64,
        width: info.meta.width as i64,
        classes: info.meta.classes as i64,
    };
    let what = || format!("--model {} on {} ({}x{}x{} images, {} classes)", args.model.name(), args.data.display(), spec.channels, spec.height, spec.width, spec.classes);
    args.model.check_input(spec, plan.batch).map_err(|why| Error::usage(format!("{}: {why}", what())))?;
    let parameters = args.model.parameters_for(spec);
    // --zero 3 cuts every rank's share to 1/n (n: the ranks sharing the shards).
    let sharing = match (args.zero, args.fsdp_hybrid) {
        (3, true) => world.local_size.max(1) as u128,
        (3, false) => world.size.max(1) as u128,
        _ => 1,
    };
    let need = bytes_per_rank(parameters, sharing) * world.local_size.max(1) as u128;
    if let Some(available) = memory_available() {
        if need > available as u128 {
            let share = if sharing > 1 { format!(", 1/{sharing} of them per rank at --zero 3,") } else { String::new() };
            return Err(Error::usage(format!(
                "{}: the model has {parameters} parameters ({}); at {BYTES_PER_PARAMETER} bytes each (weights, gradients, momentum, exchange buffer){share} for {} rank(s) that is {:.3e} bytes, more than the {:.1} GB this node has available",
                what(),
                args.model.largest_layer(spec),
                world.local_size,
                need as f64,
                available as f64 / 1e9
            )));
        }
    }
    Ok(())
}

/// Weights, gradients, momentum and an exchange buffer: 16 bytes per parameter per rank.
const BYTES_PER_PARAMETER: u128 = 16;

/// What a rank holds of a model of `parameters`, with its parameters, gradients and optimizer
/// state sharded over `sharing` ranks (1: not sharded), rounded up; the early check's estimate
/// (stage 3's unit buffers come on top, a few units at most).
fn bytes_per_rank(parameters: u128, sharing: u128) -> u128 {
    (parameters * BYTES_PER_PARAMETER).div_ceil(sharing.max(1))
}

/// Compares the run's configuration across ranks before any training: every rank must run the
/// same binary with the same options on the same data.
pub(super) fn check_same_config(world: &World, args: &TrainArgs) -> Result<()> {
    let mine = config_fingerprint(args);
    let text = mine.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("\n");
    let hash = crc32fast::hash(text.as_bytes());
    let mut hashes = vec![0u32; world.size as usize];
    world.comm.all_gather_into(&hash, &mut hashes[..]);
    if hashes.iter().all(|&h| h == hashes[0]) {
        return Ok(());
    }
    // Somebody differs: rank 0 gathers the texts to say what.
    let bytes = text.into_bytes();
    let count = bytes.len() as i32;
    let root = world.comm.process_at_rank(0);
    if !world.is_root() {
        root.gather_into(&count);
        root.gather_varcount_into(&bytes[..]);
        return Err(Error::usage("configuration differs between ranks"));
    }
    let mut counts = vec![0i32; world.size as usize];
    root.gather_into_root(&count, &mut counts[..]);
    let displs: Vec<i32> = counts.iter().scan(0, |acc, &c| { let d = *acc; *acc += c; Some(d) }).collect();
    let mut all = vec![0u8; counts.iter().sum::<i32>() as usize];
    {
        let mut partition = mpi::datatype::PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        root.gather_varcount_into_root(&bytes[..], &mut partition);
    }
    let mut differences = Vec::new();
    for r in 1..world.size as usize {
        let theirs = String::from_utf8_lossy(&all[displs[r] as usize..(displs[r] + counts[r]) as usize]).into_owned();
        for line in theirs.lines() {
            let (key, value) = line.split_once('=').unwrap_or((line, ""));
            let ours = mine.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str()).unwrap_or("(absent)");
            if ours != value {
                differences.push(format!("{key} is {ours} on rank 0 but {value} on rank {r}"));
            }
        }
    }
    differences.truncate(8);
    Err(Error::usage(format!("the ranks were started with different configurations: {}", differences.join("; "))))
}

/// The settings every rank must share, as (name, value) pairs.
pub(super) fn config_fingerprint(args: &TrainArgs) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vec![
        ("binary".into(), format!("{} {}", env!("CARGO_PKG_VERSION"), results::GIT_COMMIT)),
        ("strategy".into(), args.strategy.name().into()),
        ("model".into(), args.model.name().into()),
        ("data".into(), args.data.display().to_string()),
        ("batch-size".into(), args.batch_size.to_string()),
        ("scaling".into(), format!("{:?}", args.scaling)),
        ("global-batch".into(), format!("{:?}", args.global_batch)),
        ("epochs".into(), args.epochs.to_string()),
        ("steps".into(), format!("{:?}", args.steps)),
        ("init-weights".into(), format!("{:?}", args.init_weights)),
        ("seed".into(), args.seed.to_string()),
        ("bucket-mb".into(), args.exchange.bucket_mb.to_string()),
        ("segment-kb".into(), args.exchange.segment_kb.to_string()),
        ("device".into(), format!("{:?}", args.device)),
        ("checkpoint-dir".into(), format!("{:?}", args.checkpoint_dir)),
        ("checkpoint-every".into(), args.checkpoint_every.to_string()),
        ("resume".into(), args.resume.to_string()),
        ("ps".into(), format!("{:?}", args.ps)),
        ("horovod".into(), format!("{:?}", args.horovod)),
        ("zero".into(), args.zero.to_string()),
        ("fsdp-unit".into(), args.fsdp_unit.name().into()),
        ("fsdp-hybrid".into(), args.fsdp_hybrid.to_string()),
        ("mpi-allreduce".into(), args.exchange.mpi_allreduce.name().into()),
    ];
    out.extend(args.recipe.fingerprint());
    out.sort();
    out
}

/// Test hook: the identities of a node's GPUs, comma-separated, simulated on a machine without
/// one. Each rank then "sees" them filtered by its `CUDA_VISIBLE_DEVICES` (indices or
/// identities, as CUDA reads it), the node's ranks choose among them as on a GPU node (an error
/// where they would share one without --allow-gpu-sharing), and training runs on the CPU.
pub const SIMULATED_GPUS_ENV: &str = "HPC_TRAIN_SIMULATE_GPUS";

/// The rank's GPU, or the CPU. Collective over the node's ranks (`world.local`), which compare
/// the identities of the GPUs each one sees, so that ranks share a GPU only with
/// `--allow-gpu-sharing` however the launcher masks devices (see [`assign_gpus`]).
pub fn choose_device(choice: DeviceChoice, allow_sharing: bool, world: &World) -> Result<Device> {
    // Every rank reaches both exchanges below (the node's identities, then the world's choice
    // lines), whatever it finds: a rank returning early would leave the others waiting.
    let mask = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let (visible, simulated) = match std::env::var(SIMULATED_GPUS_ENV) {
        Ok(node) if choice != DeviceChoice::Cpu => (Ok(simulated_visible_gpus(&node, mask.as_deref())), true),
        _ => (visible_gpus(choice), false),
    };
    // One identity per line, each line ended (an all-gather of no bytes at all is refused by
    // Open MPI: a CPU rank still sends its newline).
    let mine: String = visible.as_ref().map(|ids| ids.iter().map(|id| format!("{id}\n")).collect()).unwrap_or_else(|_| "\n".into());
    let all = gather_strings(&world.local, if mine.is_empty() { "\n" } else { &mine });
    let (device, line) = match visible {
        Err(e) => (Err(e), None),
        Ok(visible) if visible.is_empty() => (Ok(Device::Cpu), None),
        Ok(visible) => {
            let lists: Vec<Vec<String>> = all.iter().map(|s| s.lines().filter(|l| !l.is_empty()).map(String::from).collect()).collect();
            let choices = assign_gpus(&lists);
            let me = choices[world.local_rank as usize].clone().expect("this rank sees a GPU");
            let line = device_line(world.rank, &raw::hostname(), &me.id, me.index, visible.len(), mask.as_deref(), simulated);
            if !me.shared_with.is_empty() && !allow_sharing {
                let ranks: Vec<String> = std::iter::once(world.local_rank as usize).chain(me.shared_with.iter().copied()).map(|r| r.to_string()).collect();
                let error = Error::usage(format!(
                    "node-local ranks {} on {} would share GPU {} ({} rank(s) on the node, {} GPU(s) visible to this one): launch one rank per GPU (srun --gpus-per-task=1, or a CUDA_VISIBLE_DEVICES per rank), or pass --allow-gpu-sharing",
                    ranks.join(", "),
                    raw::hostname(),
                    me.id,
                    world.local_size,
                    visible.len()
                ));
                (Err(error), Some(line))
            } else if simulated {
                (Ok(Device::Cpu), Some(line))
            } else {
                (Ok(Device::Cuda(me.index)), Some(line))
            }
        }
    };
    // Which GPU each rank took, and what the launcher let it see: rank 0 says it for every rank
    // (the others log warnings only), one line each, in rank order. Nothing on CPU-only runs.
    // Each line ended by a newline: Open MPI refuses an all-gather of no bytes at all, which a
    // run with no GPU anywhere would be.
    let lines = gather_strings(&world.comm, &format!("{}\n", line.as_deref().unwrap_or("")));
    if world.is_root() {
        for line in lines.iter().map(|l| l.trim_end()).filter(|l| !l.is_empty()) {
            log::info!("{line}");
        }
    }
    device
}

/// The line that says which GPU a rank took: "rank 3 on node2: GPU <id> (cuda:1 of 2 visible,
/// CUDA_VISIBLE_DEVICES=0,1)", or with simulated GPUs "would take GPU ... (simulated; training on
/// the CPU)".
fn device_line(rank: i32, host: &str, id: &str, index: usize, visible: usize, mask: Option<&str>, simulated: bool) -> String {
    let mask = mask.map_or("CUDA_VISIBLE_DEVICES unset".to_string(), |m| format!("CUDA_VISIBLE_DEVICES={m}"));
    if simulated {
        format!("rank {rank} on {host}: would take GPU {id} (cuda:{index} of {visible} visible, {mask}; simulated, training on the CPU)")
    } else {
        format!("rank {rank} on {host}: GPU {id} (cuda:{index} of {visible} visible, {mask})")
    }
}

/// The identities of the GPUs this rank may train on: none for `--device cpu` or where CUDA is
/// absent (`--device auto`), an error for `--device cuda` without CUDA.
fn visible_gpus(choice: DeviceChoice) -> Result<Vec<String>> {
    if choice == DeviceChoice::Cpu {
        return Ok(Vec::new());
    }
    let loaded = raw::load_torch_cuda();
    if let Err(why) = &loaded {
        log::debug!("CUDA support not loaded: {why}");
    }
    if !tch::Cuda::is_available() {
        return match choice {
            DeviceChoice::Cuda => Err(Error::usage(format!(
                "--device cuda: CUDA is not available on {} ({})",
                raw::hostname(),
                loaded.err().unwrap_or_else(|| "libtorch sees no GPU".into())
            ))),
            _ => Ok(Vec::new()),
        };
    }
    let count = tch::Cuda::device_count().max(0) as usize;
    Ok(raw::cuda_device_uuids(count).unwrap_or_else(|why| {
        // Without identities, assume that the node's ranks see the same GPUs in the same order
        // (the count then decides, as before identities were compared).
        log::warn!("the GPUs' identities cannot be read ({why}); assuming that every rank of {} sees the same {count} GPU(s)", raw::hostname());
        (0..count).map(|i| format!("cuda:{i}")).collect()
    }))
}

/// What a rank sees of a simulated node's GPUs (`node`, comma-separated identities) through
/// `CUDA_VISIBLE_DEVICES` as CUDA reads it: indices or identities, comma-separated, up to the
/// first that names no device; unset means all.
fn simulated_visible_gpus(node: &str, mask: Option<&str>) -> Vec<String> {
    let gpus: Vec<&str> = node.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    let Some(mask) = mask else { return gpus.iter().map(|s| s.to_string()).collect() };
    let mut seen = Vec::new();
    for entry in mask.split(',').map(str::trim) {
        let found = match entry.parse::<usize>() {
            Ok(i) => gpus.get(i).copied(),
            Err(_) => gpus.iter().copied().find(|g| *g == entry),
        };
        match found {
            Some(g) if !seen.iter().any(|s: &String| s == g) => seen.push(g.to_string()),
            _ => break,
        }
    }
    seen
}

/// Makes the rank's GPU this (the MPI) thread's current device, and checks that it is: a
/// CUDA-aware MPI and everything else that uses the current device would otherwise work on
/// GPU 0, and every rank of a node would open a context there. Threads that the exchange starts
/// do the same for themselves (comm_thread, overlap).
pub fn make_current(device: Device) -> Result<()> {
    let Device::Cuda(index) = device else { return Ok(()) };
    raw::set_cuda_device(device)?;
    let current = raw::current_cuda_device()?;
    if current != index {
        return Err(Error::usage(format!("cuda:{index} was made the current device, but the current device is cuda:{current}")));
    }
    log::debug!("cuda:{index} is the current device of the MPI thread");
    Ok(())
}

/// `--exchange-timeout-s` as a duration (zero: no watchdog).
pub fn watchdog_timeout(seconds: f64) -> Result<Duration> {
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(Error::usage(format!("--exchange-timeout-s {seconds}: expected 0 (off) or a number of seconds")));
    }
    Ok(Duration::from_secs_f64(seconds))
}

pub(super) fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fully_sharded_rank_is_counted_for_its_share_only() {
        assert_eq!(bytes_per_rank(1000, 1), 16_000);
        assert_eq!(bytes_per_rank(1000, 4), 4_000);
        assert_eq!(bytes_per_rank(1001, 4), 4_004);
        assert_eq!(bytes_per_rank(1000, 0), 16_000);
    }
    use crate::train::options::parse_train_args as train_args;

    #[test]
    fn threads_far_beyond_the_cores_are_refused() {
        assert!(check_threads(8, 2).is_ok());
        let err = check_threads(9, 2).unwrap_err().to_string();
        assert!(err.contains("--threads 9:") && err.contains("has 2 core(s) online") && err.contains("use at most 8"), "{err}");
    }

    #[test]
    fn an_output_that_is_an_input_is_refused() {
        let dir = std::env::temp_dir().join(format!("hpc-train-outputs-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let data = dir.join("data.h5");
        std::fs::write(&data, b"x").unwrap();
        let d = data.to_str().unwrap();
        let fine = dir.join("w.safetensors");
        assert!(check_outputs_are_not_inputs(&train_args(&["--data", d, "--save-weights", fine.to_str().unwrap()])).is_ok());
        // The same file by another spelling, through a link, or a path inside it.
        let other_spelling = dir.join("sub/../data.h5");
        let err = check_outputs_are_not_inputs(&train_args(&["--data", d, "--save-weights", other_spelling.to_str().unwrap()])).unwrap_err().to_string();
        assert!(err.contains("--save-weights") && err.contains("it is the --data file"), "{err}");
        let link = dir.join("link.h5");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&data, &link).unwrap();
        assert!(check_outputs_are_not_inputs(&train_args(&["--data", link.to_str().unwrap(), "--timeline", d, "--strategy", "horovod"])).is_err());
        let hard = dir.join("hard.h5");
        let _ = std::fs::remove_file(&hard);
        std::fs::hard_link(&data, &hard).unwrap();
        assert!(check_outputs_are_not_inputs(&train_args(&["--data", d, "--save-weights", hard.to_str().unwrap()])).is_err());
        let inside = data.join("ckpt");
        let err = check_outputs_are_not_inputs(&train_args(&["--data", d, "--checkpoint-dir", inside.to_str().unwrap()])).unwrap_err().to_string();
        assert!(err.contains("--checkpoint-dir") && err.contains("inside the --data file"), "{err}");
        let model = dir.join("model.json");
        std::fs::write(&model, b"{}").unwrap();
        let err = check_outputs_are_not_inputs(&train_args(&["--data", d, "--cost-model", model.to_str().unwrap(), "--save-weights", model.to_str().unwrap()])).unwrap_err().to_string();
        assert!(err.contains("the --cost-model file"), "{err}");
        // Horovod's variable names an output of a Horovod-style run only.
        let horovod = train_args(&["--data", d, "--strategy", "horovod"]);
        let err = check_outputs_against_inputs(&horovod, Some(data.clone())).unwrap_err().to_string();
        assert!(err.contains("HOROVOD_TIMELINE") && err.contains("it is the --data file"), "{err}");
        assert!(check_outputs_against_inputs(&train_args(&["--data", d, "--strategy", "ring"]), Some(data.clone())).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fp16_with_zero_and_overlap_on_is_refused_and_the_rest_of_that_corner_is_not() {
        for zero in ["1", "2"] {
            let err = check_combination(&train_args(&["--precision", "fp16", "--zero", zero, "--overlap", "on"])).unwrap_err().to_string();
            assert!(err.contains(&format!("--precision fp16 with --zero {zero} and --overlap on:")) && err.contains("use --overlap off or auto"), "{err}");
        }
        for ok in [&["--precision", "fp16", "--zero", "2"][..], &["--precision", "fp16", "--zero", "3", "--overlap", "on"], &["--precision", "bf16", "--zero", "1", "--overlap", "on"], &["--precision", "fp16", "--overlap", "on"]] {
            assert!(check_combination(&train_args(ok)).is_ok(), "{ok:?}");
        }
    }

    #[test]
    fn simulated_masks_read_as_cuda_reads_them() {
        let node = "GPU-a,GPU-b,GPU-c";
        assert_eq!(simulated_visible_gpus(node, None), vec!["GPU-a", "GPU-b", "GPU-c"]);
        assert_eq!(simulated_visible_gpus(node, Some("2")), vec!["GPU-c"]);
        assert_eq!(simulated_visible_gpus(node, Some("1,0")), vec!["GPU-b", "GPU-a"]);
        assert_eq!(simulated_visible_gpus(node, Some("GPU-b")), vec!["GPU-b"]);
        // CUDA stops at the first entry that names no device.
        assert_eq!(simulated_visible_gpus(node, Some("0,7,1")), vec!["GPU-a"]);
        assert!(simulated_visible_gpus(node, Some("")).is_empty());
    }

    #[test]
    fn the_device_line_names_rank_node_gpu_and_mask() {
        assert_eq!(
            device_line(3, "node2", "GPU-b", 1, 2, Some("0,1"), false),
            "rank 3 on node2: GPU GPU-b (cuda:1 of 2 visible, CUDA_VISIBLE_DEVICES=0,1)"
        );
        assert_eq!(
            device_line(0, "node1", "GPU-a", 0, 1, None, true),
            "rank 0 on node1: would take GPU GPU-a (cuda:0 of 1 visible, CUDA_VISIBLE_DEVICES unset; simulated, training on the CPU)"
        );
    }

    #[test]
    fn a_batch_that_does_not_split_over_the_training_ranks_is_refused() {
        assert_eq!(batch_per_worker(&train_args(&["--batch-size", "4"]), 2).unwrap(), 4);
        assert_eq!(batch_per_worker(&train_args(&["--scaling", "strong", "--global-batch", "8"]), 2).unwrap(), 4);
        let err = batch_per_worker(&train_args(&["--scaling", "strong", "--global-batch", "3"]), 2).unwrap_err().to_string();
        assert!(err.contains("--global-batch 3 is not divisible by the 2 training ranks"), "{err}");
        let err = batch_per_worker(&train_args(&["--scaling", "strong"]), 2).unwrap_err().to_string();
        assert!(err.contains("--scaling strong needs --global-batch"), "{err}");
        let err = batch_per_worker(&train_args(&["--global-batch", "8"]), 2).unwrap_err().to_string();
        assert!(err.contains("--global-batch goes with --scaling strong"), "{err}");
    }

    /// `--device cuda` where CUDA is absent is refused, naming the node (on a GPU machine it
    /// finds the GPUs).
    #[test]
    fn cuda_asked_for_where_there_is_none_is_refused() {
        match visible_gpus(DeviceChoice::Cuda) {
            Err(e) => assert!(!tch::Cuda::is_available() && e.to_string().contains("--device cuda: CUDA is not available on"), "{e}"),
            Ok(gpus) => assert!(tch::Cuda::is_available() && !gpus.is_empty()),
        }
        assert!(visible_gpus(DeviceChoice::Cpu).unwrap().is_empty());
    }

    /// The training options of `extra` with the options given noted, as `hpc-train` parses them.
    fn given_args(extra: &[&str]) -> TrainArgs {
        use clap::{CommandFactory, FromArgMatches, Parser};
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            train: TrainArgs,
        }
        let matches = Command::command().try_get_matches_from([&["hpc-train"], extra].concat()).unwrap();
        let mut train = Command::from_arg_matches(&matches).unwrap().train;
        train.given = crate::exchange::options::Given::from_matches(&matches);
        train
    }

    /// Layouts whose sizes cannot run, refused before any rank starts on them (which layout
    /// kinds combine is plan/compat.rs's table, which tests/conformance.rs walks): the checks
    /// of `Plan::resolve` that need the world's size alone. tests/tensor.rs, tests/zero.rs,
    /// tests/fsdp.rs and tests/pipeline.rs launch one each.
    #[test]
    fn layouts_whose_sizes_cannot_run_are_refused() {
        let tp = |ranks: usize, extra: &[&str]| {
            let model: &[&str] = if extra.contains(&"--model") { &[] } else { &["--model", "vit-tiny"] };
            check_tensor_parallel(&given_args(&[model, extra].concat()), ranks).err().map(|e| e.to_string())
        };
        assert_eq!(tp(2, &["--tensor-parallel", "2"]), None);
        assert_eq!(tp(4, &["--tensor-parallel", "2", "--pipeline-stages", "2"]), None);
        for (ranks, extra, reason) in [
            (3, &["--tensor-parallel", "3"][..], "--tensor-parallel 3 does not divide the 4 attention heads of --model vit-tiny"),
            (3, &["--tensor-parallel", "2"], "--tensor-parallel 2 x --pipeline-stages 1 = 2 does not divide the 3 ranks"),
            (2, &["--tensor-parallel", "2", "--model", "tiny"], "--tensor-parallel 2 splits a transformer's attention heads and MLP over ranks; --model tiny has none"),
            (4, &["--tensor-parallel", "2", "--pipeline-stages", "3"], "--tensor-parallel 2 x --pipeline-stages 3 = 6 does not divide the 4 ranks"),
            (2, &["--tp-allreduce", "ring"], "--tp-allreduce is an option of --tensor-parallel"),
        ] {
            let said = tp(ranks, extra).unwrap_or_else(|| panic!("{extra:?} accepted"));
            assert!(said.contains(reason), "{extra:?}: {said}");
        }
        let vit_b16 = check_tensor_parallel(&given_args(&["--model", "vit-b16", "--tensor-parallel", "8"]), 8).unwrap_err().to_string();
        assert!(vit_b16.contains("does not divide the 12 attention heads"), "{vit_b16}");

        use exchange::StrategyKind::{Auto, Rhd, Ring};
        assert!(exchange::check_zero(Rhd, 1, 4).is_ok() && exchange::check_zero(Ring, 3, 3).is_ok() && exchange::check_zero(Auto, 2, 3).is_ok());
        for stage in [1, 3] {
            let err = exchange::check_zero(Rhd, stage, 3).unwrap_err().to_string();
            assert!(err.contains(&format!("--zero {stage} with --strategy rhd on 3 ranks")), "{err}");
        }
        assert!(check_fully_sharded_options(&given_args(&["--zero", "3", "--fsdp-unit", "stage"])).is_ok());
        for flag in ["--fsdp-unit", "--fsdp-hybrid"] {
            let extra: &[&str] = if flag == "--fsdp-unit" { &["--fsdp-unit", "stage"] } else { &["--fsdp-hybrid"] };
            let err = check_fully_sharded_options(&given_args(extra)).unwrap_err().to_string();
            assert!(err.contains(&format!("{flag} is an option of --zero 3")), "{err}");
        }
        // Stage 3 in a pipeline: one unit per stage, gathered once per step.
        let pipelined = ["--zero", "3", "--pipeline-stages", "2"];
        assert!(check_triples(&given_args(&pipelined)).is_ok());
        assert!(check_triples(&given_args(&[&pipelined[..], &["--overlap", "auto"]].concat())).is_ok());
        assert!(check_triples(&given_args(&["--zero", "3", "--overlap", "on", "--fsdp-unit", "stage"])).is_ok());
        let err = check_triples(&given_args(&[&pipelined[..], &["--overlap", "on"]].concat())).unwrap_err().to_string();
        assert!(err.starts_with("--zero 3 with --pipeline-stages and --overlap on:"), "{err}");
        let err = check_triples(&given_args(&[&pipelined[..], &["--fsdp-unit", "model"]].concat())).unwrap_err().to_string();
        assert!(err.starts_with("--fsdp-unit with --pipeline-stages:"), "{err}");

        // A pipeline's grid and schedule against the ranks, and its micro-batches against the
        // batch. (A partition or a chunk count the model's blocks cannot take is refused when the
        // stages are cut: src/plan/pipeline/cuts.rs's an_explicit_partition_is_checked and
        // too_many_chunks_names_the_options_that_made_them.)
        let pipeline = |ranks: usize, extra: &[&str]| {
            let args = given_args(&[&["--model", "tiny"][..], extra].concat());
            args.pipeline.plan(&args.given, ranks, args.model).map(|_| ()).err().map(|e| e.to_string())
        };
        assert_eq!(pipeline(2, &["--pipeline-stages", "2", "--micro-batches", "2"]), None);
        for (ranks, extra, reason) in [
            (3, &["--pipeline-stages", "2"][..], "--pipeline-stages 2 does not divide the 3 ranks"),
            (4, &["--pipeline-stages", "4", "--micro-batches", "2", "--schedule", "interleaved", "--virtual-stages", "2"], "--micro-batches 2 is not a multiple of --pipeline-stages 4"),
            (2, &["--pipeline-stages", "2", "--schedule", "interleaved"], "--schedule interleaved needs --virtual-stages of at least 2"),
            (1, &["--schedule", "gpipe"], "--schedule is an option of pipelines"),
        ] {
            let said = pipeline(ranks, extra).unwrap_or_else(|| panic!("{extra:?} accepted"));
            assert!(said.contains(reason), "{extra:?}: {said}");
        }
        let args = given_args(&["--model", "tiny", "--pipeline-stages", "2", "--micro-batches", "64"]);
        let plan = args.pipeline.plan(&args.given, 2, args.model).unwrap().unwrap();
        assert!(check_pipeline(&plan, 64).is_ok());
        let err = check_pipeline(&plan, 32).unwrap_err().to_string();
        assert!(err.contains("--micro-batches 64 with a batch of 32 per pipeline"), "{err}");
    }

    #[test]
    fn online_cpus_parse() {
        assert!(num_cpus_online() >= 1);
    }
}
