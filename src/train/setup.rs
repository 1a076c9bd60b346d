//! Set-up, checked on every rank (a problem on any rank stops all of them here): the plan, the
//! device, the data, the network, the resume point, the exchange, overlap; and the parts of a
//! run that deal with checkpoints and the configuration check.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::*;
use tch::nn::{self};
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{self, Checkpoint, CheckpointMeta};
use crate::data::{self, DatasetInfo};
use crate::error::{Error, Result};
use crate::exchange::{self, Exchange, ExchangeConfig, Role};
use crate::faults::Faults;
use crate::model::{self, InputSpec};
use crate::optim::{self, Sgd, SgdConfig};
use crate::overlap::Overlap;
use crate::raw;
use crate::results::{self};
use crate::topology::{assign_gpus, World};

use super::options::{DeviceChoice, OnOff, Precision, Scaling, TrainArgs};
use super::Run;

impl<'a> Run<'a> {
    /// Everything a run needs, or None when the checkpoint it resumes from already covers the
    /// steps asked for (said on rank 0; nothing is started and no record written).
    pub(super) fn set_up(world: &'a World, args: &'a TrainArgs) -> Result<Option<Run<'a>>> {
        let plan = world.agree(Plan::resolve(args, world))?;
        world.agree(check_same_config(world, args))?;
        tch::set_num_threads(plan.threads as i32);
        world.agree(make_current(plan.device))?;
        crate::watchdog::start(world.rank, world.agree(watchdog_timeout(args.exchange_timeout_s))?);
        if plan.device.is_cuda() {
            tch::Cuda::cudnn_set_benchmark(true);
            // PyTorch lets cuDNN use TF32 by default: fp32 means fp32.
            raw::set_allow_tf32(args.precision == Precision::Tf32);
            if matches!(args.precision, Precision::Bf16 | Precision::Fp16) {
                world.agree(raw::set_cuda_autocast_bf16(args.precision == Precision::Bf16))?;
            }
        }
        world.agree(if world.is_root() { results::check_writable(&args.results) } else { Ok(()) })?;
        let faults = world.agree(Faults::from_env())?;
        let stop = StopSignal::install()?;
        let (info, labels) = world.agree(data::open(&args.data))?;
        let global_batch = plan.batch * plan.workers;
        if info.train.len < global_batch {
            // Every rank computes the same verdict from the same file; agree keeps one message.
            let why = format!("{} training samples, fewer than ranks x batch = {} x {} = {global_batch}", info.train.len, plan.workers, plan.batch);
            world.agree::<()>(Err(Error::data(&args.data, why)))?;
        }
        let split_bytes = info.train.len * info.sample_bytes();
        let cache_data = world.agree(data::loader::cache_decision(args.cache_data, split_bytes, world.local_size as usize, data::loader::memory_available()))?;
        let steps_per_epoch = info.train.len.div_ceil(global_batch) as u64;
        let total_steps = args.steps.unwrap_or(args.epochs * steps_per_epoch);
        world.agree(check_model_fits(args, &info, &plan, world))?;
        let (mut net, spec) = world.agree(Net::new(args, &info, plan.device))?;
        // Same seed on every rank gives the same weights; rank 0's are sent anyway, so that a
        // mismatch (another libtorch, another seed) cannot start.
        broadcast_from_root(&world.comm, &net.named_variables().into_iter().map(|(_, t)| t).collect::<Vec<_>>())?;
        if args.channels_last {
            world.agree(net.params.iter().chain(net.buffers.iter().map(|(_, t)| t)).try_for_each(raw::param_to_channels_last))?;
        }
        // Every parameter gets a gradient, so that every rank exchanges the same set.
        optim::define_grads(&net.params)?;

        // The checkpoint folder, held for this run alone; the checkpoint to continue from, and
        // whether anything is left to do.
        let checkpoint_lock = world.agree(lock_checkpoint_dir(world, args))?;
        let dataset_fingerprint = world.agree(match (&args.checkpoint_dir, world.is_root()) {
            (Some(_), true) => data::fingerprint(&info, &labels),
            _ => Ok(String::new()),
        })?;
        let now = checkpoint_meta(args, world, &plan, &info, &dataset_fingerprint, steps_per_epoch, 0, 0);
        let resume_from = world.agree(find_resume_point(world, args, &now))?;
        let first_step = broadcast_step(&world.comm, resume_from.as_ref().map(|c| c.meta.step)).unwrap_or(0);
        if first_step > 0 && first_step >= total_steps {
            // Stop before any strategy starts (a parameter server would wait for workers that
            // never come), without a record (a run of no steps would replace the real one).
            if world.is_root() {
                let dir = args.checkpoint_dir.as_deref().unwrap_or(Path::new("?")).display();
                println!("hpc-train: the checkpoint at step {first_step} in {dir} already covers the {total_steps} steps asked for; nothing to train, no record appended");
            }
            if let Some(path) = &args.save_weights {
                world.agree(if world.is_root() { save_checkpoint_weights(resume_from.as_ref(), &net, path) } else { Ok(()) })?;
            }
            return Ok(None);
        }

        let sgd_config = SgdConfig { lr: args.lr, momentum: args.momentum, weight_decay: args.weight_decay };
        let config = exchange_config(world, args, &plan, sgd_config, first_step)?;
        let mut exchange = world.agree(exchange::build(args.strategy, world, &config))?;
        world.agree(exchange.prepare(&net.params))?;
        exchange.name_tensors(&net.param_names);
        let mut sgd = Sgd::new(sgd_config);
        if resume_from.is_some() || first_step > 0 {
            restore(world, resume_from.as_ref(), &mut net, exchange.as_mut(), &mut sgd)?;
        }
        let overlap = make_overlap(world, args, &plan, &net, config.bucket_bytes)?;
        if let Some(overlap) = &overlap {
            exchange.describe_keys(overlap.plan());
        }
        world.agree(match faults.setup_fails(world.rank) {
            true => Err(Error::usage(format!("rank {}: set-up failed (injected by {})", world.rank, crate::faults::FAULT_ENV))),
            false => Ok(()),
        })?;

        // Workers-only communicator: dedicated parameter servers take no part in evaluation.
        let role = exchange.role();
        let workers_comm = world.comm.split_by_color(Color::with_value(if matches!(role, Role::Worker { .. }) { 0 } else { 1 })).expect("every rank has a colour");
        let (worker, workers) = match role {
            Role::Worker { index, count } => (index, count),
            Role::Server => (0, plan.workers),
        };
        let run = Run {
            world, args, plan, info, labels, cache_data, spec, net, exchange, sgd, overlap, faults, stop, workers_comm, worker, workers,
            global_batch, steps_per_epoch, first_step, total_steps, resumed_at: resume_from.as_ref().map(|c| c.meta.step),
            dataset_fingerprint, checkpoints: CheckpointLog { newest_good: resume_from.as_ref().map(|c| c.meta.step), failed: Vec::new() },
            _checkpoint_lock: checkpoint_lock,
        };
        run.log_start();
        Ok(Some(run))
    }

    fn log_start(&self) {
        if !self.world.is_root() {
            return;
        }
        let (args, info, plan) = (self.args, &self.info, &self.plan);
        log::info!(
            "{} on {} rank(s) ({} worker(s), {} node(s)), {} on {} {}x{}x{} ({} train / {} test), batch {}/rank = {} global, steps {}..{} ({:.2} epochs), device {}, {} thread(s)/rank",
            args.strategy, self.world.size, self.workers, self.world.nodes(), args.model.name(), info.meta.name, info.meta.channels, info.meta.height, info.meta.width,
            info.train.len, info.test.len, plan.batch, self.global_batch, self.first_step, self.total_steps, self.total_steps as f64 / self.steps_per_epoch as f64,
            super::record::device_name(plan.device), plan.threads
        );
        let split_mb = (info.train.len * info.sample_bytes()) as f64 / 1e6;
        if self.cache_data {
            log::info!("training split held in memory ({split_mb:.1} MB per rank; --cache-data)");
        } else if args.cache_data == data::loader::CacheData::Auto {
            match data::loader::memory_available() {
                Some(_) => log::info!("training split read from the file per batch ({split_mb:.1} MB per rank is more than this node's ranks may hold: --cache-data auto)"),
                None => log::info!("training split read from the file per batch (MemAvailable could not be read from /proc/meminfo; --cache-data on holds it anyway)"),
            }
        }
    }

    /// Whether a periodic checkpoint falls after `last_step`.
    pub(super) fn checkpoint_due(&self, last_step: u64) -> bool {
        self.args.checkpoint_dir.is_some() && last_step % self.args.checkpoint_every == 0
    }

    /// A checkpoint after `last_step` (every worker takes part; rank 0 writes it). A write that
    /// fails on rank 0 ends the run there when this run has no earlier checkpoint to continue
    /// from; otherwise it is logged and counted, and the run ends non-zero (see `record`).
    pub(super) fn save_checkpoint(&mut self, last_step: u64) -> Result<()> {
        let Some(dir) = &self.args.checkpoint_dir else { return Ok(()) };
        let meta = checkpoint_meta(self.args, self.world, &self.plan, &self.info, &self.dataset_fingerprint, self.steps_per_epoch, last_step, self.sgd.steps());
        match save_checkpoint(self.world, dir, self.args.keep_checkpoints, &self.net, self.exchange.as_mut(), &self.sgd, meta)? {
            Some(written) => self.checkpoints.note(dir, last_step, written),
            None => Ok(()),
        }
    }
}

/// Rank 0's account of the run's checkpoints.
#[derive(Debug, Default)]
pub(super) struct CheckpointLog {
    /// The newest checkpoint this run can continue from: written by it, or resumed from.
    pub(super) newest_good: Option<u64>,
    /// Steps whose checkpoint could not be written.
    pub(super) failed: Vec<u64>,
}

impl CheckpointLog {
    /// Takes note of rank 0's write of the checkpoint after `step`.
    fn note(&mut self, dir: &Path, step: u64, written: Result<std::path::PathBuf>) -> Result<()> {
        match (written, self.newest_good) {
            (Ok(path), _) => {
                log::info!("checkpoint at step {step}: {}", path.display());
                self.newest_good = Some(step);
                Ok(())
            }
            // Training on would only spend the allocation on steps that nothing keeps.
            (Err(e), None) => Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!("the checkpoint at step {step} could not be written ({e}), and this run has no earlier one to continue from: stopping"),
            }),
            (Err(e), Some(good)) => {
                log::error!("checkpoint at step {step} failed ({e}); the newest good one is at step {good}; training goes on, and the run will end non-zero");
                self.failed.push(step);
                Ok(())
            }
        }
    }

    /// The error a run with failed checkpoints ends with (rank 0), once its record is written.
    pub(super) fn verdict(&self, dir: &Path) -> Result<()> {
        match (self.failed.as_slice(), self.newest_good) {
            ([], _) => Ok(()),
            (failed, good) => Err(Error::Checkpoint {
                path: dir.to_path_buf(),
                reason: format!(
                    "{} checkpoint(s) could not be written (after step(s) {}); --resume continues from the newest good one, at step {}",
                    failed.len(),
                    failed.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", "),
                    good.map_or("?".into(), |g| g.to_string())
                ),
            }),
        }
    }
}

/// Rank 0 takes the checkpoint folder's lock for the run (None without --checkpoint-dir and on
/// the other ranks), after checking that it can write there.
fn lock_checkpoint_dir(world: &World, args: &TrainArgs) -> Result<Option<checkpoint::FolderLock>> {
    match (&args.checkpoint_dir, world.is_root()) {
        (Some(dir), true) => {
            checkpoint::check_writable(dir)?;
            checkpoint::FolderLock::take(dir).map(Some)
        }
        _ => Ok(None),
    }
}

/// Whether the model can be built for the dataset and trained at this batch, said before it is
/// built (libtorch would panic, or try to allocate what no machine has).
fn check_model_fits(args: &TrainArgs, info: &DatasetInfo, plan: &Plan, world: &World) -> Result<()> {
    let spec = InputSpec {
        channels: info.meta.channels as i64,
        height: info.meta.height as i64,
        width: info.meta.width as i64,
        classes: info.meta.classes as i64,
    };
    let what = || format!("--model {} on {} ({}x{}x{} images, {} classes)", args.model.name(), args.data.display(), spec.channels, spec.height, spec.width, spec.classes);
    args.model.check_input(spec, plan.batch).map_err(|why| Error::usage(format!("{}: {why}", what())))?;
    // Weights, gradients, momentum and a bucket buffer: 16 bytes per parameter per rank.
    const BYTES_PER_PARAMETER: u128 = 16;
    let parameters = args.model.parameters_for(spec);
    let need = parameters * BYTES_PER_PARAMETER * world.local_size.max(1) as u128;
    if let Some(available) = data::loader::memory_available() {
        if need > available as u128 {
            return Err(Error::usage(format!(
                "{}: the model has {parameters} parameters ({}); at {BYTES_PER_PARAMETER} bytes each (weights, gradients, momentum, exchange buffer) for {} rank(s) that is {:.3e} bytes, more than the {:.1} GB this node has available",
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

/// What a checkpoint says about the run it belongs to.
#[allow(clippy::too_many_arguments)]
fn checkpoint_meta(args: &TrainArgs, world: &World, plan: &Plan, info: &DatasetInfo, fingerprint: &str, steps_per_epoch: u64, step: u64, optimizer_steps: u64) -> CheckpointMeta {
    CheckpointMeta {
        format: 0,
        step,
        steps_per_epoch,
        model: args.model.name().into(),
        dataset: info.meta.name.clone(),
        dataset_fingerprint: fingerprint.into(),
        train_samples: info.train.len,
        image_shape: vec![info.meta.channels, info.meta.height, info.meta.width],
        classes: info.meta.classes,
        strategy: args.strategy.name().into(),
        ranks: world.size as usize,
        workers: plan.workers,
        batch_per_rank: plan.batch,
        global_batch: plan.batch * plan.workers,
        seed: args.seed,
        sgd: SgdConfig { lr: args.lr, momentum: args.momentum, weight_decay: args.weight_decay },
        optimizer_steps,
        git_commit: results::GIT_COMMIT.into(),
        timestamp: results::timestamp(),
        files: Default::default(),
    }
}

/// The exchange's options from the command line and the plan.
fn exchange_config(world: &World, args: &TrainArgs, plan: &Plan, sgd: SgdConfig, first_step: u64) -> Result<ExchangeConfig> {
    let mut ps = args.ps.config(sgd);
    ps.checkpoint_every = args.checkpoint_dir.as_ref().map(|_| args.checkpoint_every);
    ps.first_step = first_step;
    Ok(ExchangeConfig {
        device: plan.device,
        cuda_aware: plan.cuda_aware,
        bucket_bytes: (args.bucket_mb * (1 << 20) as f64) as usize,
        segment_bytes: (args.segment_kb as usize) << 10,
        ring_transport: args.ring_transport,
        ps,
        horovod: world.agree(args.horovod.config())?,
        mpi_allreduce: args.mpi_allreduce,
        cost_model: world.agree(crate::cost::CostModel::from_option(args.cost_model.as_deref()))?,
        zero: args.zero,
    })
}

/// Gradient-ready hooks for overlapping the exchange with backward (not for the parameter
/// server, whose servers take whole shares after backward).
fn make_overlap(world: &World, args: &TrainArgs, plan: &Plan, net: &Net, bucket_bytes: usize) -> Result<Option<Overlap>> {
    let choice = match args.overlap {
        OnOff::Auto => {
            // Cores this rank's backward leaves free: those it may use beyond its threads (each
            // rank of the node counted).
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let bound = cores < num_cpus_online();
            let mine = if bound { cores } else { cores / world.local_size.max(1) as usize };
            let spare = mine > plan.threads;
            let on = plan.device.is_cuda() || spare;
            if world.is_root() {
                log::info!("--overlap auto: {}", if on { "on" } else { "off (backward uses every core of the rank: the exchange would take them from it)" });
            }
            if on { OnOff::On } else { OnOff::Off }
        }
        other => other,
    };
    Ok(match (choice, args.strategy) {
        (OnOff::On, exchange::StrategyKind::Ps) => {
            if world.is_root() {
                log::info!("--overlap on: the parameter server exchanges after backward (its servers take whole shares)");
            }
            None
        }
        // One rank exchanges nothing: backward on a thread of its own would only cost a hand-over.
        (OnOff::On, _) if world.size == 1 => {
            log::info!("--overlap on: one rank has nothing to exchange; backward runs on the MPI thread");
            None
        }
        // One bucket is exchanged after the last gradient however backward runs; on a thread
        // of its own, backward would only add hand-overs (measured on the tiny CNN, results/).
        (OnOff::On, _) if crate::overlap::one_bucket(&net.params, bucket_bytes) => {
            if world.is_root() {
                log::info!("--overlap on: every gradient fits one bucket (--bucket-mb), which is exchanged after backward; backward runs on the MPI thread");
            }
            None
        }
        (OnOff::On, _) => Some(world.agree(Overlap::new(&net.params, bucket_bytes, world.comm.duplicate()))?),
        (OnOff::Off | OnOff::Auto, _) => None,
    })
}

/// Options resolved against the world: what every rank agrees to run.
pub(super) struct Plan {
    pub(super) device: Device,
    pub(super) threads: usize,
    pub(super) cuda_aware: bool,
    pub(super) workers: usize,
    pub(super) batch: usize,
}

impl Plan {
    pub(super) fn resolve(args: &TrainArgs, world: &World) -> Result<Plan> {
        // First: choosing the device is collective over the node's ranks (before any early return).
        let device = choose_device(args.device, args.allow_gpu_sharing, world);
        let workers = exchange::worker_count(args.strategy, world.size as usize, &args.ps.roles())?;
        let batch = match args.scaling {
            Scaling::Weak => {
                if args.global_batch.is_some() {
                    return Err(Error::usage("--global-batch goes with --scaling strong; weak scaling uses --batch-size per rank"));
                }
                args.batch_size as usize
            }
            Scaling::Strong => {
                let global = args.global_batch.ok_or_else(|| {
                    Error::usage("--scaling strong needs --global-batch (the samples per step over all ranks)")
                })? as usize;
                if global % workers != 0 {
                    return Err(Error::usage(format!(
                        "--global-batch {global} is not divisible by the {workers} training ranks (strong scaling splits it evenly)"
                    )));
                }
                global / workers
            }
        };
        if args.steps == Some(0) || (args.steps.is_none() && args.epochs == 0) {
            return Err(Error::usage("nothing to train: --steps and --epochs must be at least 1"));
        }
        if args.bucket_mb < 0.0 || !args.bucket_mb.is_finite() {
            return Err(Error::usage(format!("--bucket-mb {}: expected 0 or more", args.bucket_mb)));
        }
        if args.lr <= 0.0 || !args.lr.is_finite() {
            return Err(Error::usage(format!("--lr {}: expected a positive learning rate", args.lr)));
        }
        check_sgd_settings(args.momentum, args.weight_decay)?;
        check_outputs_are_not_inputs(args)?;
        let device = device?;
        if device == Device::Cpu && args.precision != Precision::Fp32 {
            return Err(Error::usage(format!(
                "--precision {}: mixed precision and TF32 run on CUDA devices; this rank trains on the CPU (use fp32)",
                format!("{:?}", args.precision).to_lowercase()
            )));
        }
        exchange::check_zero(args.strategy, args.zero, world.size as usize)?;
        if args.precision == Precision::Fp16 && args.zero > 0 {
            return Err(Error::usage(format!("--precision fp16 with --zero {}: the loss scaler checks and unscales whole gradients before the optimizer step, which ZeRO shards; use bf16", args.zero)));
        }
        if args.precision == Precision::Fp16 && args.strategy == exchange::StrategyKind::Ps {
            return Err(Error::usage("--precision fp16 with --strategy ps: the loss scaler unscales gradients before the optimizer step, which the servers own; use bf16"));
        }
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
        let cuda_aware = args.cuda_aware.resolve();
        Ok(Plan { device, threads, cuda_aware, workers, batch })
    }
}

/// `--momentum` and `--weight-decay` as torch.optim.SGD takes them: it refuses a negative
/// momentum or weight decay. A momentum of 1 or more is refused as well: the momentum buffer
/// then never forgets a gradient, and grows without bound (1.5 ended at a loss of 1e10).
pub(super) fn check_sgd_settings(momentum: f64, weight_decay: f64) -> Result<()> {
    if !(0.0..1.0).contains(&momentum) {
        return Err(Error::usage(format!(
            "--momentum {momentum}: expected 0 <= momentum < 1 (torch.optim.SGD refuses a negative one; at 1 or more the momentum buffer never decays and training diverges)"
        )));
    }
    if !weight_decay.is_finite() || weight_decay < 0.0 {
        return Err(Error::usage(format!(
            "--weight-decay {weight_decay}: expected a finite weight decay of 0 or more (torch.optim.SGD refuses a negative one)"
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
/// as canonical paths and, when the output exists, as the same inode (a hard link).
pub(super) fn check_outputs_are_not_inputs(args: &TrainArgs) -> Result<()> {
    let mut inputs: Vec<(&str, &Path)> = vec![("--data", args.data.as_path())];
    if let Some(model) = &args.cost_model {
        inputs.push(("--cost-model", model));
    }
    let runs = results::runs_path(&args.results);
    let mut outputs: Vec<(&str, &Path)> = vec![("--results", runs.as_path())];
    outputs.extend(args.save_weights.as_deref().map(|p| ("--save-weights", p)));
    outputs.extend(args.horovod.timeline.as_deref().map(|p| ("--timeline", p)));
    outputs.extend(args.checkpoint_dir.as_deref().map(|p| ("--checkpoint-dir", p)));
    outputs.extend(args.trace_samples.as_deref().map(|p| ("--trace-samples", p)));
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

/// Test hook: the identities of a node's GPUs, comma-separated, simulated on a machine without
/// one. Each rank then "sees" them filtered by its `CUDA_VISIBLE_DEVICES` (indices or
/// identities, as CUDA reads it), the node's ranks choose among them as on a GPU node (an error
/// where they would share one without --allow-gpu-sharing), and training runs on the CPU.
pub const SIMULATED_GPUS_ENV: &str = "HPC_TRAIN_SIMULATE_GPUS";

/// The rank's GPU, or the CPU. Collective over the node's ranks (`world.local`), which compare
/// the identities of the GPUs each one sees, so that ranks share a GPU only with
/// `--allow-gpu-sharing` however the launcher masks devices (see [`assign_gpus`]).
pub fn choose_device(choice: DeviceChoice, allow_sharing: bool, world: &World) -> Result<Device> {
    // Every rank reaches the exchange of identities below, whatever it finds here.
    let (visible, simulated) = match std::env::var(SIMULATED_GPUS_ENV) {
        Ok(node) if choice != DeviceChoice::Cpu => (Ok(simulated_visible_gpus(&node, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())), true),
        _ => (visible_gpus(choice), false),
    };
    // One identity per line, each line ended (an all-gather of no bytes at all is refused by
    // Open MPI: a CPU rank still sends its newline).
    let mine: String = visible.as_ref().map(|ids| ids.iter().map(|id| format!("{id}\n")).collect()).unwrap_or_else(|_| "\n".into());
    let all = gather_strings(&world.local, if mine.is_empty() { "\n" } else { &mine });
    let visible = visible?;
    if visible.is_empty() {
        return Ok(Device::Cpu);
    }
    let lists: Vec<Vec<String>> = all.iter().map(|s| s.lines().filter(|l| !l.is_empty()).map(String::from).collect()).collect();
    let choices = assign_gpus(&lists);
    let me = choices[world.local_rank as usize].clone().expect("this rank sees a GPU");
    if !me.shared_with.is_empty() && !allow_sharing {
        let ranks: Vec<String> = std::iter::once(world.local_rank as usize).chain(me.shared_with.iter().copied()).map(|r| r.to_string()).collect();
        return Err(Error::usage(format!(
            "node-local ranks {} on {} would share GPU {} ({} rank(s) on the node, {} GPU(s) visible to this one): launch one rank per GPU (srun --gpus-per-task=1, or a CUDA_VISIBLE_DEVICES per rank), or pass --allow-gpu-sharing",
            ranks.join(", "),
            raw::hostname(),
            me.id,
            world.local_size,
            visible.len()
        )));
    }
    log::debug!("rank {}: GPU {} (cuda:{} of {} visible){}", world.rank, me.id, me.index, visible.len(), if simulated { ", simulated: training on the CPU" } else { "" });
    if simulated {
        return Ok(Device::Cpu);
    }
    Ok(Device::Cuda(me.index))
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

/// Every rank's `text` on every rank of `comm`, in rank order. Collective.
fn gather_strings(comm: &SimpleCommunicator, text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let count = bytes.len() as i32;
    let mut counts = vec![0i32; comm.size() as usize];
    comm.all_gather_into(&count, &mut counts[..]);
    let displs: Vec<i32> = counts.iter().scan(0, |acc, &c| { let d = *acc; *acc += c; Some(d) }).collect();
    let mut all = vec![0u8; counts.iter().sum::<i32>() as usize];
    {
        let mut partition = mpi::datatype::PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
        comm.all_gather_varcount_into(bytes, &mut partition);
    }
    counts
        .iter()
        .zip(&displs)
        .map(|(&c, &d)| String::from_utf8_lossy(&all[d as usize..(d + c) as usize]).into_owned())
        .collect()
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

/// The network and its parameters.
pub(super) struct Net {
    pub(super) vs: nn::VarStore,
    pub(super) model: nn::FuncT<'static>,
    pub(super) params: Vec<Tensor>,
    /// The name of every parameter, in `params` order.
    pub(super) param_names: Vec<String>,
    /// Non-trainable state (batch-norm running statistics), by name.
    pub(super) buffers: Vec<(String, Tensor)>,
}

impl Net {
    pub(super) fn new(args: &TrainArgs, info: &DatasetInfo, device: Device) -> Result<(Net, InputSpec)> {
        let spec = InputSpec {
            channels: info.meta.channels as i64,
            height: info.meta.height as i64,
            width: info.meta.width as i64,
            classes: info.meta.classes as i64,
        };
        // The same initial weights on every rank and every device: initialised on the CPU from
        // the seed, then moved. CUDA's random stream differs from the CPU's, so weights drawn on
        // the GPU would differ from a CPU run's with the same seed. Moving keeps each variable's
        // identity (set_data), so the model's layers see the moved tensors.
        tch::manual_seed(args.seed as i64);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let model = model::build(args.model, &vs.root(), spec);
        vs.set_device(device);
        model::check_forward(&model, spec, device)?;
        let params = vs.trainable_variables();
        let param_addrs: Vec<usize> = params.iter().map(raw::data_address).collect();
        let variables = vs.variables();
        let param_names: Vec<String> = param_addrs
            .iter()
            .map(|a| variables.iter().find(|(_, t)| raw::data_address(t) == *a).map(|(n, _)| n.clone()).expect("every parameter is a variable"))
            .collect();
        let mut buffers: Vec<(String, Tensor)> =
            variables.into_iter().filter(|(_, t)| !param_addrs.contains(&raw::data_address(t))).collect();
        buffers.sort_by(|a, b| a.0.cmp(&b.0));
        Ok((Net { vs, model, params, param_names, buffers }, spec))
    }

    /// Every variable, sorted by name (the same order on every rank).
    pub(super) fn named_variables(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    pub(super) fn grads(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| p.grad()).collect()
    }
}

/// Sends rank 0's values of `tensors` to every rank of `comm` (one flat message).
pub(super) fn broadcast_from_root(comm: &SimpleCommunicator, tensors: &[Tensor]) -> Result<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    let flat: Vec<Tensor> = tensors.iter().map(|t| t.f_to_kind(Kind::Float)?.f_reshape([-1])?.f_to_device(Device::Cpu)).collect::<std::result::Result<_, _>>()?;
    let mut flat = Tensor::f_cat(&flat, 0)?;
    // SAFETY: `flat` was just made by f_cat and has no other handle.
    comm.process_at_rank(0).broadcast_into(unsafe { raw::host_slice_mut::<f32>(&mut flat)? });
    unflatten_into(&flat, tensors)
}

/// Averages `tensors` over the ranks of `comm` that pass `contribute` (others send zeros).
pub(super) fn average_over(comm: &SimpleCommunicator, tensors: &[Tensor], contribute: bool, contributors: usize) -> Result<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    let flat: Vec<Tensor> = tensors.iter().map(|t| t.f_to_kind(Kind::Float)?.f_reshape([-1])?.f_to_device(Device::Cpu)).collect::<std::result::Result<_, _>>()?;
    let mut flat = Tensor::f_cat(&flat, 0)?;
    if !contribute {
        let _ = flat.f_zero_()?;
    }
    // SAFETY: `flat` was just made by f_cat and has no other handle.
    let send = unsafe { raw::host_slice::<f32>(&flat)? }.to_vec();
    // SAFETY: as above.
    let sums = unsafe { raw::host_slice_mut::<f32>(&mut flat)? };
    crate::watchdog::collective("averaging buffers", comm, || comm.all_reduce_into(&send[..], sums, mpi::collective::SystemOperation::sum()));
    let _ = flat.f_div_scalar_(contributors as f64)?;
    unflatten_into(&flat, tensors)
}

pub(super) fn unflatten_into(flat: &Tensor, tensors: &[Tensor]) -> Result<()> {
    let mut offset = 0;
    tch::no_grad(|| -> Result<()> {
        for t in tensors {
            let n = t.numel() as i64;
            let mut dst = t.shallow_clone();
            dst.f_copy_(&flat.f_narrow(0, offset, n)?.f_view(t.size().as_slice())?)?;
            offset += n;
        }
        Ok(())
    })
}

/// Scales raw bytes to the normalised input the model trains on, on the device.
pub(super) struct Normalizer {
    pub(super) shape: [i64; 3],
    pub(super) channels_last: bool,
    /// Per-channel mean and 1/std, in units of raw byte values, shaped [1, C, 1, 1].
    pub(super) mean: Tensor,
    pub(super) inv_std: Tensor,
    pub(super) device: Device,
}

impl Normalizer {
    pub(super) fn new(info: &DatasetInfo, device: Device, channels_last: bool) -> Result<Normalizer> {
        let c = info.meta.channels as i64;
        let mean: Vec<f32> = info.mean.iter().map(|m| m * 255.0).collect();
        let inv_std: Vec<f32> = info.std.iter().map(|s| 1.0 / (s * 255.0)).collect();
        Ok(Normalizer {
            shape: [c, info.meta.height as i64, info.meta.width as i64],
            channels_last,
            mean: Tensor::f_from_slice(&mean)?.f_view([1, c, 1, 1])?.f_to_device(device)?,
            inv_std: Tensor::f_from_slice(&inv_std)?.f_view([1, c, 1, 1])?.f_to_device(device)?,
            device,
        })
    }

    pub(super) fn images(&self, bytes: &[u8], n: usize) -> Result<Tensor> {
        let [c, h, w] = self.shape;
        let host = Tensor::f_from_slice(bytes)?.f_view([n as i64, c, h, w])?;
        // To a GPU through pinned memory, without waiting for the copy (the stream orders it
        // before the kernels that read it); the bytes travel as uint8, a quarter of the floats.
        let x = if self.device.is_cuda() {
            raw::pin_memory(&host)?.f_to_device_(self.device, Kind::Uint8, true, false)?
        } else {
            host
        };
        let x = x.f_to_kind(Kind::Float)?.f_sub(&self.mean)?.f_mul(&self.inv_std)?;
        if self.channels_last { raw::channels_last(&x) } else { Ok(x) }
    }

    pub(super) fn labels(&self, labels: &[i64]) -> Result<Tensor> {
        Ok(Tensor::f_from_slice(labels)?.f_to_device(self.device)?)
    }
}

/// SIGTERM (what Slurm sends before the time limit) and SIGUSR1 (what `--signal` jobs often
/// ask for) set a flag; the workers agree on it after every step, so that all stop together.
pub(super) struct StopSignal(Arc<std::sync::atomic::AtomicBool>);

impl StopSignal {
    pub(super) fn install() -> Result<StopSignal> {
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR1] {
            signal_hook::flag::register(signal, flag.clone())
                .map_err(|e| Error::usage(format!("cannot install the handler of signal {signal}: {e}")))?;
        }
        Ok(StopSignal(flag))
    }

    /// Whether any rank of `comm` has been asked to stop (collective over `comm`).
    pub(super) fn agreed(&self, comm: &SimpleCommunicator) -> bool {
        let mine = i32::from(self.0.load(std::sync::atomic::Ordering::Relaxed));
        let mut any = 0;
        // After a checkpoint step the other ranks wait here for rank 0's write.
        crate::watchdog::collective("the stop agreement", comm, || comm.all_reduce_into(&mine, &mut any, mpi::collective::SystemOperation::max()));
        any != 0
    }
}

/// Rank 0's value of a step, on every rank (None travels as u64::MAX).
pub(super) fn broadcast_step(comm: &SimpleCommunicator, step: Option<u64>) -> Option<u64> {
    let mut value = step.unwrap_or(u64::MAX);
    comm.process_at_rank(0).broadcast_into(&mut value);
    (value != u64::MAX).then_some(value)
}

/// Rank 0 finds the newest complete checkpoint when `--resume` is given and checks that this
/// run may continue from it.
pub(super) fn find_resume_point(world: &World, args: &TrainArgs, now: &CheckpointMeta) -> Result<Option<Checkpoint>> {
    if args.checkpoint_dir.is_some() {
        if args.ps.ps_mode == crate::exchange::PsMode::Async && args.strategy == exchange::StrategyKind::Ps {
            return Err(Error::usage(
                "--checkpoint-dir with --ps-mode async: asynchronous servers hold no state consistent across ranks at any step; checkpoint a synchronous run",
            ));
        }
        if args.checkpoint_every == 0 {
            return Err(Error::usage("--checkpoint-every 0: expected a number of steps, at least 1"));
        }
    }
    if !args.resume {
        return Ok(None);
    }
    let Some(dir) = &args.checkpoint_dir else {
        return Err(Error::usage("--resume needs --checkpoint-dir (where the checkpoints are)"));
    };
    if !world.is_root() {
        return Ok(None);
    }
    match checkpoint::find_latest(dir)? {
        None => {
            log::warn!("--resume: no complete checkpoint in {}; starting from the beginning", dir.display());
            Ok(None)
        }
        Some(found) => {
            let accepted = checkpoint::check_compatible(&found.meta, now)
                .map_err(|reason| Error::Checkpoint { path: found.dir.clone(), reason: format!("refused: {reason}") })?;
            for change in accepted {
                log::warn!("resuming from {} with a change: {change}", found.dir.display());
            }
            log::info!("resuming from {} (step {}, epoch {})", found.dir.display(), found.meta.step, found.meta.epoch() + 1);
            Ok(Some(found))
        }
    }
}

/// Loads the checkpoint on rank 0 and sends weights and momentum to every rank.
pub(super) fn restore(world: &World, found: Option<&Checkpoint>, net: &mut Net, exchange: &mut dyn Exchange, sgd: &mut Sgd) -> Result<()> {
    let loaded = world.agree(match found {
        Some(c) if world.is_root() => checkpoint::load(c).map(Some),
        _ => Ok(None),
    })?;
    let variables = net.named_variables();
    let momentum: Vec<Tensor> = net.params.iter().map(|p| p.f_zeros_like()).collect::<std::result::Result<_, _>>()?;
    let mut optimizer_steps = 0.0;
    world.agree((|| -> Result<()> {
        if let Some((weights, saved_momentum)) = &loaded {
            tch::no_grad(|| -> Result<()> {
                for (name, t) in &variables {
                    let w = weights.get(name).ok_or_else(|| Error::Checkpoint { path: found.unwrap().dir.clone(), reason: format!("no tensor {name}") })?;
                    t.shallow_clone().f_copy_(w)?;
                }
                for (name, m) in net.param_names.iter().zip(&momentum) {
                    if let Some(saved) = saved_momentum.get(name) {
                        m.shallow_clone().f_copy_(saved)?;
                    }
                }
                Ok(())
            })?;
            optimizer_steps = found.unwrap().meta.optimizer_steps as f64;
        }
        Ok(())
    })())?;
    broadcast_from_root(&world.comm, &variables.into_iter().map(|(_, t)| t).collect::<Vec<_>>())?;
    broadcast_from_root(&world.comm, &momentum)?;
    let mut steps = optimizer_steps;
    world.comm.process_at_rank(0).broadcast_into(&mut steps);
    exchange.restore_optimizer(&net.params, momentum, steps as u64, sgd)
}

/// Collects the optimizer state (every worker takes part) and has rank 0 write the checkpoint:
/// rank 0 returns how its write went (the folder written, or why not), the others None.
pub(super) fn save_checkpoint(
    world: &World,
    dir: &Path,
    keep: usize,
    net: &Net,
    exchange: &mut dyn Exchange,
    sgd: &Sgd,
    meta: CheckpointMeta,
) -> Result<Option<Result<std::path::PathBuf>>> {
    // Collective where the state is sharded (ZeRO) or held by servers.
    let momentum = crate::watchdog::collective("gathering the optimizer state", &world.comm, || exchange.optimizer_state(&net.params, sgd))?;
    if !world.is_root() {
        return Ok(None);
    }
    let momentum = momentum.ok_or_else(|| Error::exchange("checkpoint", "rank 0 received no optimizer state"))?;
    // Never replace good checkpoints with a diverged state: with overlap a non-finite gradient
    // is found at the end of the step on the rank that made it, after the exchange has spread
    // it to every rank, which may reach this checkpoint before that rank ends the job.
    if !optim::all_finite(&net.params)? || !optim::all_finite(&momentum)? {
        return Err(Error::NonFinite { what: "weights (no checkpoint written)", step: meta.step, epoch: meta.epoch() });
    }
    let named_momentum: Vec<(String, Tensor)> = net.param_names.iter().cloned().zip(momentum).collect();
    Ok(Some(checkpoint::save(dir, meta, &net.named_variables(), &named_momentum, keep)))
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
        ("lr".into(), args.lr.to_string()),
        ("momentum".into(), args.momentum.to_string()),
        ("weight-decay".into(), args.weight_decay.to_string()),
        ("seed".into(), args.seed.to_string()),
        ("bucket-mb".into(), args.bucket_mb.to_string()),
        ("segment-kb".into(), args.segment_kb.to_string()),
        ("device".into(), format!("{:?}", args.device)),
        ("checkpoint-dir".into(), format!("{:?}", args.checkpoint_dir)),
        ("checkpoint-every".into(), args.checkpoint_every.to_string()),
        ("resume".into(), args.resume.to_string()),
        ("ps".into(), format!("{:?}", args.ps)),
        ("horovod".into(), format!("{:?}", args.horovod)),
        ("zero".into(), args.zero.to_string()),
        ("mpi-allreduce".into(), args.mpi_allreduce.name().into()),
    ];
    out.sort();
    out
}

/// `--save-weights` for a run that had nothing left to train: the checkpoint's weights.
pub(super) fn save_checkpoint_weights(found: Option<&Checkpoint>, net: &Net, path: &Path) -> Result<()> {
    let found = found.ok_or_else(|| Error::exchange("checkpoint", "rank 0 has no checkpoint to take the weights from"))?;
    let (weights, _) = checkpoint::load(found)?;
    tch::no_grad(|| -> Result<()> {
        for (name, t) in net.named_variables() {
            let w = weights.get(&name).ok_or_else(|| Error::Checkpoint { path: found.dir.clone(), reason: format!("no tensor {name}") })?;
            t.shallow_clone().f_copy_(w)?;
        }
        Ok(())
    })?;
    save_weights(net, path)
}

/// Writes the weights (parameters and batch-norm statistics) as safetensors, under a temporary
/// name first so that an interrupted write leaves no damaged file.
pub(super) fn save_weights(net: &Net, path: &Path) -> Result<()> {
    let vars: Vec<(String, Tensor)> = net
        .named_variables()
        .into_iter()
        .map(|(n, t)| Ok((n, t.f_to_device(Device::Cpu)?.f_contiguous()?)))
        .collect::<Result<_>>()?;
    let tmp = path.with_extension("safetensors.tmp");
    results::replace_via_temp(path, &tmp, |tmp| Ok(Tensor::write_safetensors(&vars, tmp)?))
}
#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// The training options of a command line, parsed as `hpc-train` parses them.
    fn train_args(extra: &[&str]) -> TrainArgs {
        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            train: TrainArgs,
        }
        let mut argv = vec!["hpc-train"];
        argv.extend(extra);
        Command::try_parse_from(argv).unwrap().train
    }

    #[test]
    fn sgd_settings_torch_refuses_are_refused() {
        assert!(check_sgd_settings(0.9, 1e-4).is_ok());
        assert!(check_sgd_settings(0.0, 0.0).is_ok());
        for (momentum, flag) in [(-5.0, "--momentum -5"), (1.0, "--momentum 1"), (1.5, "--momentum 1.5"), (f64::NAN, "--momentum NaN")] {
            let err = check_sgd_settings(momentum, 0.0).unwrap_err().to_string();
            assert!(err.starts_with(&format!("{flag}: expected 0 <= momentum < 1")), "{err}");
        }
        for (decay, flag) in [(-100.0, "--weight-decay -100"), (f64::NAN, "--weight-decay NaN"), (f64::INFINITY, "--weight-decay inf")] {
            assert!(check_sgd_settings(0.9, decay).unwrap_err().to_string().starts_with(flag));
        }
    }

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
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn failed_checkpoints_end_the_run_without_an_earlier_one_and_are_counted_with_one() {
        let dir = Path::new("/ckpt");
        let full = || Err(Error::io("/ckpt/x", std::io::Error::from(std::io::ErrorKind::StorageFull)));
        let mut fresh = CheckpointLog::default();
        let err = fresh.note(dir, 5, full()).unwrap_err().to_string();
        assert!(err.contains("could not be written") && err.contains("no earlier one to continue from"), "{err}");

        let mut log = CheckpointLog::default();
        log.note(dir, 5, Ok("/ckpt/ckpt-5".into())).unwrap();
        log.note(dir, 10, full()).unwrap();
        log.note(dir, 15, full()).unwrap();
        assert_eq!((log.newest_good, log.failed.clone()), (Some(5), vec![10, 15]));
        let err = log.verdict(dir).unwrap_err().to_string();
        assert!(err.contains("2 checkpoint(s) could not be written (after step(s) 10, 15)") && err.contains("at step 5"), "{err}");
        assert!(CheckpointLog { newest_good: Some(3), failed: vec![] }.verdict(dir).is_ok());
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
}
