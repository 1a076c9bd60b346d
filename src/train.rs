//! The training run: set-up checked on every rank, the step loop, evaluation and the record.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::traits::*;
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};

use crate::cli::{DeviceChoice, OnOff, Precision, Scaling, TrainArgs};
use crate::data::loader::{Batch, Loader, Schedule};
use crate::data::reader::SplitReader;
use crate::data::{self, DatasetInfo, Labels, Split};
use crate::error::{Error, Result, WithPath};
use crate::checkpoint::{self, Checkpoint, CheckpointMeta};
use crate::exchange::{self, Exchange, ExchangeConfig, ReduceOp, Role};
use crate::faults::{Fault, Faults};
use crate::model::{self, InputSpec};
use crate::optim::{self, Sgd, SgdConfig};
use crate::overlap::Overlap;
use crate::raw;
use crate::results::{self, RunRecord};
use crate::topology::{ShardInfo, World};

/// Options resolved against the world: what every rank agrees to run.
struct Plan {
    device: Device,
    threads: usize,
    cuda_aware: bool,
    workers: usize,
    batch: usize,
}

impl Plan {
    fn resolve(args: &TrainArgs, world: &World) -> Result<Plan> {
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
        let device = choose_device(args.device, args.allow_gpu_sharing, world)?;
        if device == Device::Cpu && args.precision != Precision::Fp32 {
            return Err(Error::usage(format!(
                "--precision {}: mixed precision and TF32 run on CUDA devices; this rank trains on the CPU (use fp32)",
                format!("{:?}", args.precision).to_lowercase()
            )));
        }
        if args.precision == Precision::Fp16 && args.strategy == exchange::StrategyKind::Ps {
            return Err(Error::usage("--precision fp16 with --strategy ps: the loss scaler unscales gradients before the optimizer step, which the servers own; use bf16"));
        }
        let threads = if args.threads > 0 {
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

fn num_cpus_online() -> usize {
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

/// The GPU of this rank (node-local rank modulo the GPUs), or the CPU.
fn choose_device(choice: DeviceChoice, allow_sharing: bool, world: &World) -> Result<Device> {
    let loaded = raw::load_torch_cuda();
    let cuda = tch::Cuda::is_available();
    if let Err(why) = &loaded {
        log::debug!("CUDA support not loaded: {why}");
    }
    match (choice, cuda) {
        (DeviceChoice::Cpu, _) | (DeviceChoice::Auto, false) => Ok(Device::Cpu),
        (DeviceChoice::Cuda, false) => Err(Error::usage(format!(
            "--device cuda: CUDA is not available on {} ({})",
            raw::hostname(),
            loaded.err().unwrap_or_else(|| "libtorch sees no GPU".into())
        ))),
        (DeviceChoice::Cuda | DeviceChoice::Auto, true) => {
            let gpus = tch::Cuda::device_count() as i32;
            if world.local_size > gpus && !allow_sharing {
                return Err(Error::usage(format!(
                    "{} ranks on {} for {gpus} GPU(s): launch one rank per GPU, or pass --allow-gpu-sharing",
                    world.local_size,
                    raw::hostname()
                )));
            }
            Ok(Device::Cuda((world.local_rank % gpus) as usize))
        }
    }
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
struct Net {
    vs: nn::VarStore,
    model: nn::FuncT<'static>,
    params: Vec<Tensor>,
    /// The name of every parameter, in `params` order.
    param_names: Vec<String>,
    /// Non-trainable state (batch-norm running statistics), by name.
    buffers: Vec<(String, Tensor)>,
}

impl Net {
    fn new(args: &TrainArgs, info: &DatasetInfo, device: Device) -> Result<(Net, InputSpec)> {
        let spec = InputSpec {
            channels: info.meta.channels as i64,
            height: info.meta.height as i64,
            width: info.meta.width as i64,
            classes: info.meta.classes as i64,
        };
        tch::manual_seed(args.seed as i64); // the same initial weights on every rank
        let vs = nn::VarStore::new(device);
        let model = model::build(args.model, &vs.root(), spec);
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
    fn named_variables(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = self.vs.variables().into_iter().collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    fn grads(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| p.grad()).collect()
    }
}

/// Sends rank 0's values of `tensors` to every rank of `comm` (one flat message).
fn broadcast_from_root(comm: &SimpleCommunicator, tensors: &[Tensor]) -> Result<()> {
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
fn average_over(comm: &SimpleCommunicator, tensors: &[Tensor], contribute: bool, contributors: usize) -> Result<()> {
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
    comm.all_reduce_into(&send[..], unsafe { raw::host_slice_mut::<f32>(&mut flat)? }, mpi::collective::SystemOperation::sum());
    let _ = flat.f_div_scalar_(contributors as f64)?;
    unflatten_into(&flat, tensors)
}

fn unflatten_into(flat: &Tensor, tensors: &[Tensor]) -> Result<()> {
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
struct Normalizer {
    shape: [i64; 3],
    channels_last: bool,
    /// Per-channel mean and 1/std, in units of raw byte values, shaped [1, C, 1, 1].
    mean: Tensor,
    inv_std: Tensor,
    device: Device,
}

impl Normalizer {
    fn new(info: &DatasetInfo, device: Device, channels_last: bool) -> Result<Normalizer> {
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

    fn images(&self, bytes: &[u8], n: usize) -> Result<Tensor> {
        let [c, h, w] = self.shape;
        let host = Tensor::f_from_slice(bytes)?.f_view([n as i64, c, h, w])?;
        // To a GPU through pinned memory, without waiting for the copy (the stream orders it
        // before the kernels that read it); the bytes travel as uint8, a quarter of the floats.
        let x = if self.device.is_cuda() {
            host.f_pin_memory(self.device)?.f_to_device_(self.device, Kind::Uint8, true, false)?
        } else {
            host
        };
        let x = x.f_to_kind(Kind::Float)?.f_sub(&self.mean)?.f_mul(&self.inv_std)?;
        if self.channels_last { raw::channels_last(&x) } else { Ok(x) }
    }

    fn labels(&self, labels: &[i64]) -> Result<Tensor> {
        Ok(Tensor::f_from_slice(labels)?.f_to_device(self.device)?)
    }
}

/// Running sums of one rank's step timings.
#[derive(Default, Clone, Copy)]
struct Timings {
    steps: u64,
    samples: u64,
    data_wait: Duration,
    compute: Duration,
    comm: Duration,
    optimizer: Duration,
    step: Duration,
    /// With overlap: all exchange time, and the part of the step after backward ended.
    exchange_total: Duration,
    exchange_exposed: Duration,
}

impl Timings {
    fn mean_ms(&self, d: Duration) -> f64 {
        if self.steps == 0 { 0.0 } else { d.as_secs_f64() * 1e3 / self.steps as f64 }
    }
}

/// Mean training loss over a window of steps.
#[derive(Default)]
struct LossWindow {
    sum: f64,
    samples: f64,
}

/// What a caller outside the command line adds to a run (a study tags its runs).
#[derive(Clone, Debug, Default)]
pub struct RunContext {
    pub study: Option<String>,
}

/// Trains as `args` says on the ranks of `world`; rank 0 returns the run's record (None on the
/// other ranks, and when the run was stopped by a signal before its end).
pub fn run(world: &World, args: &TrainArgs, context: &RunContext) -> Result<Option<RunRecord>> {
    // ---- Set-up, checked on every rank: a problem on any rank stops all of them here. ----
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
        world.agree::<()>(Err(Error::data(
            &args.data,
            format!(
                "{} training samples, fewer than ranks x batch = {} x {} = {global_batch}",
                info.train.len, plan.workers, plan.batch
            ),
        )))?;
    }
    let steps_per_epoch = info.train.len.div_ceil(global_batch) as u64;
    let total_steps = args.steps.unwrap_or(args.epochs * steps_per_epoch);
    let (mut net, spec) = world.agree(Net::new(args, &info, plan.device))?;
    // Same seed on every rank gives the same weights; rank 0's are sent anyway, so that a
    // mismatch (another libtorch, another seed) cannot start.
    broadcast_from_root(&world.comm, &net.named_variables().into_iter().map(|(_, t)| t).collect::<Vec<_>>())?;
    if args.channels_last {
        world.agree(net.params.iter().chain(net.buffers.iter().map(|(_, t)| t)).try_for_each(raw::param_to_channels_last))?;
    }
    let mut grads = optim::define_grads(&net.params)?;

    // ---- Checkpoints: where they go, and the one to continue from. ----
    let checkpoint_meta = |step: u64, optimizer_steps: u64| CheckpointMeta {
        format: 0,
        step,
        steps_per_epoch,
        model: args.model.name().into(),
        dataset: info.meta.name.clone(),
        train_samples: info.train.len,
        image_shape: vec![info.meta.channels, info.meta.height, info.meta.width],
        classes: info.meta.classes,
        strategy: args.strategy.name().into(),
        ranks: world.size as usize,
        workers: plan.workers,
        batch_per_rank: plan.batch,
        global_batch,
        seed: args.seed,
        sgd: SgdConfig { lr: args.lr, momentum: args.momentum, weight_decay: args.weight_decay },
        optimizer_steps,
        git_commit: results::GIT_COMMIT.into(),
        timestamp: results::timestamp(),
        files: Default::default(),
    };
    let resume_from = world.agree(find_resume_point(world, args, &checkpoint_meta(0, 0)))?;
    let mut first_step = 0;
    if let Some(step) = broadcast_step(&world.comm, resume_from.as_ref().map(|c| c.meta.step)) {
        first_step = step;
    }
    if first_step > 0 && first_step >= total_steps {
        // Nothing left to do: say so and stop here, before any strategy starts (a parameter
        // server would wait for workers that never come) and without a record (a run of no
        // steps would replace the real one in a study's table).
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
    let mut ps_config = args.ps.config(sgd_config);
    ps_config.checkpoint_every = args.checkpoint_dir.as_ref().map(|_| args.checkpoint_every);
    ps_config.first_step = first_step;
    let config = ExchangeConfig {
        device: plan.device,
        cuda_aware: plan.cuda_aware,
        bucket_bytes: (args.bucket_mb * (1 << 20) as f64) as usize,
        segment_bytes: (args.segment_kb as usize) << 10,
        ps: ps_config,
        horovod: world.agree(args.horovod.config())?,
        cost_model: world.agree(crate::cost::CostModel::from_option(args.cost_model.as_deref()))?,
    };
    let mut exchange = world.agree(exchange::build(args.strategy, world, &config))?;
    world.agree(exchange.prepare(&net.params))?;
    let role = exchange.role();
    let mut sgd = Sgd::new(sgd_config);
    if resume_from.is_some() || first_step > 0 {
        restore(world, resume_from.as_ref(), &mut net, exchange.as_mut(), &mut sgd)?;
    }

    // Gradient-ready hooks for overlapping the exchange with backward (not for the parameter
    // server, whose servers take whole shares after backward).
    let mut overlap = match (args.overlap, args.strategy) {
        (OnOff::On, exchange::StrategyKind::Ps) => {
            if world.is_root() {
                log::info!("--overlap on: the parameter server exchanges after backward (its servers take whole shares)");
            }
            None
        }
        (OnOff::On, _) => Some(world.agree(Overlap::new(&net.params, config.bucket_bytes, world.comm.duplicate()))?),
        (OnOff::Off, _) => None,
    };
    world.agree(match faults.setup_fails(world.rank) {
        true => Err(Error::usage(format!("rank {}: set-up failed (injected by {})", world.rank, crate::faults::FAULT_ENV))),
        false => Ok(()),
    })?;

    // Workers-only communicator: dedicated parameter servers take no part in evaluation.
    let is_worker = matches!(role, Role::Worker { .. });
    let workers_comm = world
        .comm
        .split_by_color(Color::with_value(if is_worker { 0 } else { 1 }))
        .expect("every rank has a colour");

    let (worker, workers) = match role {
        Role::Worker { index, count } => (index, count),
        Role::Server => (0, plan.workers),
    };
    let schedule = Schedule { samples: info.train.len, workers, worker, batch: plan.batch, seed: args.seed };

    if world.is_root() {
        log::info!(
            "{} on {} rank(s) ({} worker(s), {} node(s)), {} on {} {}x{}x{} ({} train / {} test), batch {}/rank = {} global, steps {}..{} ({:.2} epochs), device {}, {} thread(s)/rank",
            args.strategy, world.size, workers, world.nodes(), args.model.name(), info.meta.name, info.meta.channels, info.meta.height, info.meta.width,
            info.train.len, info.test.len, plan.batch, global_batch, first_step, total_steps, total_steps as f64 / steps_per_epoch as f64,
            device_name(plan.device), plan.threads
        );
    }

    // ---- Training. ----
    let mut totals = Timings::default();
    let mut measured = Timings::default();
    let mut last_eval: Option<(f64, f64)> = None;
    let mut window = LossWindow::default();
    let mut final_loss = f64::NAN;
    let mut rss_warmup = raw::current_rss_mb();
    let mut last_step = first_step;
    let mut saved_at: Option<u64> = resume_from.as_ref().map(|c| c.meta.step);
    let mut stopped = false;

    match role {
        Role::Server => exchange.serve(&mut net.params, &mut sgd)?,
        Role::Worker { .. } => {
            let norm = Normalizer::new(&info, plan.device, args.channels_last)?;
            let train_labels = Arc::new(labels.train.clone());
            let mut loader = Loader::spawn(args.data.clone(), train_labels, schedule, first_step, total_steps, args.prefetch);
            let mut trace = SampleTrace::open(args.trace_samples.as_deref(), world.rank)?;
            let progress = Progress::new(world.is_root(), total_steps, args.log_every);
            let warmup = first_step + args.warmup_steps.min(total_steps.saturating_sub(first_step + 1));
            let mut scaler = (args.precision == Precision::Fp16).then(LossScaler::default);

            for step in first_step..total_steps {
                if step == warmup {
                    rss_warmup = raw::current_rss_mb();
                }
                let step_start = Instant::now();
                crate::watchdog::set_step(step);
                let batch = loader.next()?;
                let data_wait = step_start.elapsed();
                trace.record(&batch)?;
                let fault = faults.at(world.rank, step);
                if fault == Some(&Fault::Exit) {
                    eprintln!("rank {}: exiting at step {step} (injected fault)", world.rank);
                    std::process::exit(3);
                }

                // Forward and backward on this rank's share of the global batch. The loss is the
                // sum over the rank's samples scaled by workers / global samples, so that the
                // mean over workers of the gradients is the gradient of the global batch's mean
                // loss, however the last step of an epoch is split.
                let compute_start = Instant::now();
                optim::zero_grads(&mut grads)?;
                let n = batch.labels.len();
                let loss_factor = workers as f64 / batch.global_samples.max(1) as f64 * scaler.as_ref().map_or(1.0, |s| s.scale);
                let (mut loss_sum, scaled_loss) = if n == 0 {
                    (0.0, None)
                } else {
                    let x = norm.images(&batch.images, n)?;
                    let y = norm.labels(&batch.labels)?;
                    let autocast = matches!(args.precision, Precision::Bf16 | Precision::Fp16);
                    let loss = tch::autocast(autocast, || -> Result<Tensor> {
                        let logits = net.model.forward_t(&x, true);
                        Ok(logits.f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0)?.f_to_kind(Kind::Float)?)
                    })?;
                    let value = loss.f_double_value(&[])?;
                    let factor = if fault == Some(&Fault::NanGrad) { f64::NAN } else { loss_factor };
                    (value, Some(loss.f_mul_scalar(factor)?))
                };
                if fault == Some(&Fault::Nan) {
                    loss_sum = f64::NAN;
                }
                if !loss_sum.is_finite() {
                    return Err(Error::NonFinite { what: "loss", step, epoch: batch.epoch });
                }
                if let Some(Fault::Stall(pause)) = fault {
                    eprintln!("rank {}: stalling {:.1} s at step {step} (injected fault)", world.rank, pause.as_secs_f64());
                    std::thread::sleep(*pause);
                }

                // With the fp16 loss scaler the optimizer steps after the exchange, once the
                // averaged gradients (the same on every rank) are known to be finite.
                let optimize_in_exchange = scaler.is_none();
                let (compute, comm, exchange_total, exchange_exposed);
                grads = net.grads();
                match (&mut overlap, scaled_loss) {
                    (Some(overlap), Some(scaled)) => {
                        // Backward overlapped with the exchange and the optimizer, bucket by bucket.
                        let forward = compute_start.elapsed();
                        let times = overlap.step(scaled, &mut net.params, &mut grads, exchange.as_mut(), &mut sgd, step, batch.epoch, optimize_in_exchange)?;
                        exchange::staging::synchronize_device(plan.device);
                        compute = forward + times.backward;
                        exchange_total = times.exchange;
                        exchange_exposed = times.exposed;
                        comm = times.exposed;
                    }
                    (_, scaled) => {
                        // Backward, then the exchange (every strategy leaves the parameters
                        // updated for the next step).
                        if let Some(scaled) = scaled {
                            scaled.f_backward()?;
                        }
                        if optimize_in_exchange && !optim::all_finite(&grads)? {
                            return Err(Error::NonFinite { what: "gradient", step, epoch: batch.epoch });
                        }
                        exchange::staging::synchronize_device(plan.device);
                        compute = compute_start.elapsed();
                        let comm_start = Instant::now();
                        let _watched = crate::watchdog::exchange(exchange.name(), || exchange.waits_for());
                        if optimize_in_exchange {
                            exchange.update(&mut net.params, &mut grads, &mut sgd)?;
                        } else {
                            exchange.all_reduce(&mut grads, ReduceOp::Mean)?;
                        }
                        exchange::staging::synchronize_device(plan.device);
                        comm = comm_start.elapsed();
                        exchange_total = comm;
                        exchange_exposed = comm;
                    }
                }
                if let Some(scaler) = &mut scaler {
                    if scaler.unscale_or_skip(&mut grads)? {
                        sgd.step(&mut net.params, &mut grads)?;
                    } else if world.is_root() {
                        progress.suspend(|| log::info!("fp16: gradients overflowed at step {step}; step skipped, loss scale now {}", scaler.scale));
                    }
                }
                let optimizer = sgd.take_busy();
                let comm = comm.saturating_sub(optimizer);

                let t = Timings {
                    steps: 1,
                    samples: batch.global_samples as u64,
                    data_wait,
                    compute,
                    comm,
                    optimizer,
                    step: step_start.elapsed(),
                    exchange_total,
                    exchange_exposed,
                };
                totals.add(&t);
                if step >= warmup {
                    measured.add(&t);
                }
                window.sum += loss_sum;
                window.samples += n as f64;
                last_step = step + 1;

                let epoch_end = (step + 1) % steps_per_epoch == 0 || step + 1 == total_steps;
                if progress.due(step) || epoch_end {
                    let (loss, samples) = sum_pair(&workers_comm, window.sum, window.samples);
                    final_loss = loss / samples.max(1.0);
                    window = LossWindow::default();
                    progress.report(step, batch.epoch, final_loss, &totals);
                }
                if epoch_end && !args.no_eval && info.test.len > 0 {
                    average_over(&workers_comm, &net.buffers.iter().map(|(_, t)| t.shallow_clone()).collect::<Vec<_>>(), true, workers)?;
                    let (test_loss, accuracy) = evaluate(&net, &norm, &args.data, &info, &labels, &workers_comm, worker, workers, plan.batch)?;
                    if world.is_root() {
                        progress.suspend(|| log::info!("epoch {} done at step {}: test loss {test_loss:.4}, accuracy {:.2}%", batch.epoch + 1, step + 1, accuracy * 100.0));
                    }
                    last_eval = Some((test_loss, accuracy));
                }

                // Periodic checkpoint, then a stop request (SIGTERM) seen by any worker: every
                // worker takes both decisions at the same step.
                if let Some(dir) = &args.checkpoint_dir {
                    if last_step % args.checkpoint_every == 0 {
                        save_checkpoint(world, dir, args.keep_checkpoints, &net, exchange.as_mut(), &sgd, checkpoint_meta(last_step, sgd.steps()))?;
                        saved_at = Some(last_step);
                    }
                }
                // Asynchronous workers agree only at logging steps, to stay untied.
                let agree_now = exchange.lockstep() || progress.due(step) || epoch_end;
                if agree_now && stop.agreed(&workers_comm) {
                    stopped = last_step < total_steps;
                    if world.is_root() && stopped {
                        progress.suspend(|| log::warn!("stop requested (signal): ending after step {last_step} of {total_steps}"));
                    }
                    break;
                }
            }
            progress.finish();
        }
    }
    exchange.finish(&mut net.params)?;
    let rss_end = raw::current_rss_mb();

    // A last checkpoint where training ended (at the end, or where a signal stopped it).
    if let (Some(dir), true) = (&args.checkpoint_dir, is_worker) {
        if saved_at != Some(last_step) {
            save_checkpoint(world, dir, args.keep_checkpoints, &net, exchange.as_mut(), &sgd, checkpoint_meta(last_step, sgd.steps()))?;
        }
    }
    if let (Some(path), true) = (&args.save_weights, world.is_root()) {
        save_weights(&net, path)?;
    }
    let last_step = broadcast_step(&world.comm, Some(last_step)).unwrap_or(last_step);
    if world.sum_f64(if stopped { 1.0 } else { 0.0 }) > 0.0 {
        if world.is_root() {
            println!("hpc-train: stopped by a signal after step {last_step} of {total_steps}; continue with --resume");
        }
        return Ok(None);
    }

    // ---- Results: figures over all ranks, written by rank 0. ----
    // Throughput counts the measured steps' own time (evaluation excluded), on the slowest worker.
    let wall = world.max_f64(measured.step.as_secs_f64());
    let mean_over_workers = |v: f64| world.sum_f64(if is_worker { v } else { 0.0 }) / workers as f64;
    let images_per_sec = if wall > 0.0 { measured.samples as f64 / wall } else { 0.0 };
    let step_ms = mean_over_workers(measured.mean_ms(measured.step));
    let compute_ms = mean_over_workers(measured.mean_ms(measured.compute));
    let comm_ms = mean_over_workers(measured.mean_ms(measured.comm));
    let data_wait_ms = mean_over_workers(measured.mean_ms(measured.data_wait));
    let optimizer_ms = mean_over_workers(measured.mean_ms(measured.optimizer));
    let peak_rss_mb = world.max_f64(raw::peak_rss_mb());
    let rss_warmup_mb = world.max_f64(rss_warmup);
    let rss_end_mb = world.max_f64(rss_end);
    // With overlap: exchange time per step, and the share of it that ran while backward was
    // still going (the rest is exposed after backward).
    let overlap_figures = overlap.as_ref().map(|o| {
        let total = mean_over_workers(measured.mean_ms(measured.exchange_total));
        let exposed = mean_over_workers(measured.mean_ms(measured.exchange_exposed));
        let hidden = if total > 0.0 { ((total - exposed.min(total)) / total).max(0.0) } else { 0.0 };
        (o.buckets(), total, hidden)
    });
    let report = exchange.report();
    if !world.is_root() {
        return Ok(None);
    }
    let mut extra = report.extra.clone();
    extra.insert("overlap".into(), (overlap.is_some()).into());
    extra.insert("precision".into(), serde_json::to_value(args.precision).unwrap_or_default());
    extra.insert("channels_last".into(), args.channels_last.into());
    // What every step's exchange carries (the cost model's projections and validation read it).
    extra.insert("parameters".into(), net.params.iter().map(|p| p.numel()).sum::<usize>().into());
    if let Some((buckets, total, hidden)) = overlap_figures {
        extra.insert("overlap_buckets".into(), buckets.into());
        extra.insert("exchange_total_ms".into(), total.into());
        extra.insert("exchange_hidden_share".into(), hidden.into());
    }
    if first_step > 0 {
        extra.insert("resumed_from_step".into(), first_step.into());
    }
    let steps_run = total_steps.saturating_sub(first_step);
    let record = RunRecord {
        strategy: exchange.name().into(),
        ranks: world.size as usize,
        workers,
        nodes: world.nodes() as usize,
        model: args.model.name().into(),
        dataset: info.meta.name.clone(),
        image_shape: vec![info.meta.channels, info.meta.height, info.meta.width],
        batch_per_rank: plan.batch,
        global_batch,
        scaling: match args.scaling { Scaling::Weak => "weak".into(), Scaling::Strong => "strong".into() },
        steps: steps_run,
        epochs: steps_run as f64 / steps_per_epoch as f64,
        images_per_sec,
        step_ms,
        compute_ms,
        comm_ms,
        data_wait_ms,
        optimizer_ms,
        final_loss,
        test_accuracy: last_eval.map(|e| e.1),
        test_loss: last_eval.map(|e| e.0),
        device: device_name(plan.device),
        mpi_library: mpi_library(),
        cuda_aware: plan.cuda_aware,
        data_path: report.data_path.map(|p| format!("{p:?}").to_lowercase()),
        threads: plan.threads,
        bucket_mb: args.bucket_mb,
        peak_rss_mb,
        rss_warmup_mb,
        rss_end_mb,
        host: raw::hostname(),
        git_commit: results::GIT_COMMIT.into(),
        timestamp: results::timestamp(),
        study: context.study.clone(),
        extra,
    };
    let runs = results::runs_path(&args.results);
    results::append_json_line(&runs, &record)?;
    print_summary(&record, spec, &runs);
    Ok(Some(record))
}

/// Dynamic loss scaling for fp16, as torch.cuda.amp.GradScaler: the loss is multiplied by
/// `scale` so that small gradients survive fp16; after the exchange the averaged gradients
/// (identical on every rank, so every rank decides alike) are checked: finite, they are
/// unscaled for the optimizer, and the scale doubles after `growth_interval` good steps;
/// not finite, the step is skipped and the scale halves.
struct LossScaler {
    scale: f64,
    good_steps: u32,
    growth_interval: u32,
    skipped: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler { scale: 65536.0, good_steps: 0, growth_interval: 2000, skipped: 0 }
    }
}

impl LossScaler {
    /// Unscales `grads` and returns true, or returns false (skip this step) on an overflow.
    fn unscale_or_skip(&mut self, grads: &mut [Tensor]) -> Result<bool> {
        if !optim::all_finite(grads)? {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
            self.skipped += 1;
            return Ok(false);
        }
        for g in grads.iter_mut() {
            let _ = g.f_mul_scalar_(1.0 / self.scale)?;
        }
        self.good_steps += 1;
        if self.good_steps == self.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
        Ok(true)
    }
}

/// SIGTERM (what Slurm sends before the time limit) and SIGUSR1 (what `--signal` jobs often
/// ask for) set a flag; the workers agree on it after every step, so that all stop together.
struct StopSignal(Arc<std::sync::atomic::AtomicBool>);

impl StopSignal {
    fn install() -> Result<StopSignal> {
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR1] {
            signal_hook::flag::register(signal, flag.clone())
                .map_err(|e| Error::usage(format!("cannot install the handler of signal {signal}: {e}")))?;
        }
        Ok(StopSignal(flag))
    }

    /// Whether any rank of `comm` has been asked to stop (collective over `comm`).
    fn agreed(&self, comm: &SimpleCommunicator) -> bool {
        let mine = i32::from(self.0.load(std::sync::atomic::Ordering::Relaxed));
        let mut any = 0;
        comm.all_reduce_into(&mine, &mut any, mpi::collective::SystemOperation::max());
        any != 0
    }
}

/// Rank 0's value of a step, on every rank (None travels as u64::MAX).
fn broadcast_step(comm: &SimpleCommunicator, step: Option<u64>) -> Option<u64> {
    let mut value = step.unwrap_or(u64::MAX);
    comm.process_at_rank(0).broadcast_into(&mut value);
    (value != u64::MAX).then_some(value)
}

/// Rank 0 finds the newest complete checkpoint when `--resume` is given and checks that this
/// run may continue from it.
fn find_resume_point(world: &World, args: &TrainArgs, now: &CheckpointMeta) -> Result<Option<Checkpoint>> {
    if let Some(dir) = &args.checkpoint_dir {
        if world.is_root() {
            checkpoint::check_writable(dir)?;
        }
        if args.ps.ps_mode == crate::exchange::ps::PsMode::Async && args.strategy == exchange::StrategyKind::Ps {
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
fn restore(world: &World, found: Option<&Checkpoint>, net: &mut Net, exchange: &mut dyn Exchange, sgd: &mut Sgd) -> Result<()> {
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

/// Collects the optimizer state (every worker takes part) and has rank 0 write the checkpoint.
/// A failed write is logged and training goes on: the previous checkpoint is intact.
fn save_checkpoint(
    world: &World,
    dir: &Path,
    keep: usize,
    net: &Net,
    exchange: &mut dyn Exchange,
    sgd: &Sgd,
    meta: CheckpointMeta,
) -> Result<()> {
    let momentum = exchange.optimizer_state(&net.params, sgd)?;
    if !world.is_root() {
        return Ok(());
    }
    let momentum = momentum.ok_or_else(|| Error::exchange("checkpoint", "rank 0 received no optimizer state"))?;
    let named_momentum: Vec<(String, Tensor)> = net.param_names.iter().cloned().zip(momentum).collect();
    let step = meta.step;
    match checkpoint::save(dir, meta, &net.named_variables(), &named_momentum, keep) {
        Ok(path) => log::info!("checkpoint at step {step}: {}", path.display()),
        Err(e) => log::error!("checkpoint at step {step} failed, training goes on (the previous one is intact): {e}"),
    }
    Ok(())
}

/// Compares the run's configuration across ranks before any training: every rank must run the
/// same binary with the same options on the same data.
fn check_same_config(world: &World, args: &TrainArgs) -> Result<()> {
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
fn config_fingerprint(args: &TrainArgs) -> Vec<(String, String)> {
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
    ];
    out.sort();
    out
}

impl Timings {
    fn add(&mut self, t: &Timings) {
        self.steps += t.steps;
        self.samples += t.samples;
        self.data_wait += t.data_wait;
        self.compute += t.compute;
        self.comm += t.comm;
        self.optimizer += t.optimizer;
        self.step += t.step;
        self.exchange_total += t.exchange_total;
        self.exchange_exposed += t.exchange_exposed;
    }
}

fn sum_pair(comm: &SimpleCommunicator, a: f64, b: f64) -> (f64, f64) {
    let send = [a, b];
    let mut out = [0.0; 2];
    comm.all_reduce_into(&send[..], &mut out[..], mpi::collective::SystemOperation::sum());
    (out[0], out[1])
}

/// Test loss and accuracy over all workers' shards of the test set.
#[allow(clippy::too_many_arguments)]
fn evaluate(
    net: &Net,
    norm: &Normalizer,
    path: &Path,
    info: &DatasetInfo,
    labels: &Labels,
    workers_comm: &SimpleCommunicator,
    worker: usize,
    workers: usize,
    batch: usize,
) -> Result<(f64, f64)> {
    let shard = ShardInfo::split(info.test.len, workers, worker);
    let mut reader = SplitReader::open(path, Split::Test)?;
    let (mut loss_sum, mut correct) = (0.0, 0.0);
    let mut images = Vec::new();
    let eval_batch = batch.max(1) * 2;
    tch::no_grad(|| -> Result<()> {
        for start in (shard.offset..shard.end()).step_by(eval_batch) {
            let end = (start + eval_batch).min(shard.end());
            let indices: Vec<usize> = (start..end).collect();
            images.resize(indices.len() * info.sample_bytes(), 0);
            reader.read(&indices, &mut images)?;
            let x = norm.images(&images, indices.len())?;
            let y = norm.labels(&labels.test[start..end])?;
            let logits = net.model.forward_t(&x, false);
            loss_sum += logits.f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0)?.f_double_value(&[])?;
            correct += logits.f_argmax(-1, false)?.f_eq_tensor(&y)?.f_sum(Kind::Float)?.f_double_value(&[])?;
        }
        Ok(())
    })?;
    let (loss_sum, correct) = sum_pair(workers_comm, loss_sum, correct);
    let n = info.test.len as f64;
    Ok((loss_sum / n, correct / n))
}

/// `--save-weights` for a run that had nothing left to train: the checkpoint's weights.
fn save_checkpoint_weights(found: Option<&Checkpoint>, net: &Net, path: &Path) -> Result<()> {
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
fn save_weights(net: &Net, path: &Path) -> Result<()> {
    let vars: Vec<(String, Tensor)> = net
        .named_variables()
        .into_iter()
        .map(|(n, t)| Ok((n, t.f_to_device(Device::Cpu)?.f_contiguous()?)))
        .collect::<Result<_>>()?;
    let tmp = path.with_extension("safetensors.tmp");
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).at(dir)?;
    }
    Tensor::write_safetensors(&vars, &tmp)?;
    std::fs::rename(&tmp, path).at(path)?;
    Ok(())
}

fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".into(),
        Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

pub fn mpi_library() -> String {
    mpi::environment::library_version()
        .ok()
        .and_then(|v| v.split([',', '\n']).next().map(|l| l.trim().to_string()))
        .unwrap_or_else(|| "unknown".into())
}

/// One file per rank listing the samples it trained on: `epoch step index,index,...`.
struct SampleTrace(Option<std::io::BufWriter<std::fs::File>>, PathBuf);

impl SampleTrace {
    fn open(dir: Option<&Path>, rank: i32) -> Result<SampleTrace> {
        let Some(dir) = dir else { return Ok(SampleTrace(None, PathBuf::new())) };
        std::fs::create_dir_all(dir).at(dir)?;
        let path = dir.join(format!("rank{rank}.txt"));
        Ok(SampleTrace(Some(std::io::BufWriter::new(std::fs::File::create(&path).at(&path)?)), path))
    }

    fn record(&mut self, batch: &Batch) -> Result<()> {
        use std::io::Write;
        if let Some(w) = &mut self.0 {
            let list: Vec<String> = batch.indices.iter().map(|i| i.to_string()).collect();
            writeln!(w, "{} {} {}", batch.epoch, batch.step, list.join(",")).at(&self.1)?;
            w.flush().at(&self.1)?;
        }
        Ok(())
    }
}

/// Progress on rank 0: a bar on a terminal, a log line every `every` steps otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    active: bool,
    every: u64,
}

impl Progress {
    fn new(root: bool, total: u64, every: u64) -> Progress {
        let bar = (root && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps {msg}")
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            bar
        });
        Progress { bar, active: root, every: every.max(1) }
    }

    fn due(&self, step: u64) -> bool {
        (step + 1) % self.every == 0
    }

    fn report(&self, step: u64, epoch: u64, loss: f64, t: &Timings) {
        if !self.active {
            return;
        }
        let rate = t.samples as f64 / t.step.as_secs_f64().max(1e-9);
        let msg = format!(
            "loss {loss:.4} | {rate:.1} img/s | step {:.1} ms (compute {:.1}, comm {:.1}, data {:.1})",
            t.mean_ms(t.step), t.mean_ms(t.compute), t.mean_ms(t.comm), t.mean_ms(t.data_wait)
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position(step + 1);
                bar.set_message(msg);
            }
            None => log::info!("epoch {} step {}: {msg}", epoch + 1, step + 1),
        }
    }

    fn suspend(&self, f: impl FnOnce()) {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn print_summary(r: &RunRecord, spec: InputSpec, runs: &Path) {
    println!(
        "hpc-train: {} on {} rank(s) ({} worker(s), {} node(s)), {} on {} [{}x{}x{}], batch {}/rank = {} global, {} scaling",
        r.strategy, r.ranks, r.workers, r.nodes, r.model, r.dataset, spec.channels, spec.height, spec.width,
        r.batch_per_rank, r.global_batch, r.scaling
    );
    println!(
        "  {} steps ({:.2} epochs): {:.1} images/s; per step {:.1} ms = compute {:.1} + exchange {:.1} + optimizer {:.1} + data wait {:.2}",
        r.steps, r.epochs, r.images_per_sec, r.step_ms, r.compute_ms, r.comm_ms, r.optimizer_ms, r.data_wait_ms
    );
    let accuracy = match (r.test_accuracy, r.test_loss) {
        (Some(a), Some(l)) => format!("test accuracy {:.2}% (loss {l:.4})", a * 100.0),
        _ => "no test evaluation".into(),
    };
    println!("  final training loss {:.4}, {accuracy}", r.final_loss);
    println!(
        "  device {} ({} thread(s)/rank), {}, data path {}, peak RSS {:.0} MiB",
        r.device, r.threads, r.mpi_library, r.data_path.as_deref().unwrap_or("-"), r.peak_rss_mb
    );
    println!("  appended to {}", runs.display());
}

#[cfg(test)]
mod tests {
    #[test]
    fn online_cpus_parse() {
        assert!(super::num_cpus_online() >= 1);
    }
}
