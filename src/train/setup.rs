//! Set-up, checked on every rank (a problem on any rank stops all of them here): the plan, the
//! device, the data, the network, the resume point, the exchange, overlap. Builds the [`Run`].

use std::collections::HashMap;
use std::path::Path;

use mpi::topology::{Color, Communicator};

use crate::data::{self};
use crate::error::{Error, Result};
use crate::exchange::{self, ExchangeConfig, Role};
use crate::faults::Faults;
use crate::optim::{self, LrSchedule, Optimizer, OptimizerConfig};
use crate::plan::fsdp as fsdp_plan;
use crate::raw;
use crate::results::{self};
use crate::topology::World;

use super::checkpoints::{check_parts_folder, checkpoint_meta, find_resume_point, lock_checkpoint_dir, restore_state, save_checkpoint_weights, state_reader, CheckpointLog};
use super::collective::broadcast_step;
use super::fsdp::{FullySharded, UnitWorker};
use super::net::{input_spec, variable_blocks, InitialValues, Net, NetLayout, TensorPart};
use super::pipeline::Pipeline;
use super::stages::choose_cut;
use super::stamp_clock::StampClock;
use super::tensor::TensorParallel;
use super::options::{OnOff, Precision, TrainArgs};
use super::overlap_choice::{make_overlap, OverlapChoice};
use super::plan::{check_model_fits, check_same_config, device_name, make_current, num_cpus_online, watchdog_timeout, Plan};
use super::layout::{part_replicas, Part, RunLayout};
use super::run::{Run, StopSignal};

impl<'a> Run<'a> {
    /// Everything a run needs, or None when the checkpoint it resumes from already covers the
    /// steps asked for (said on rank 0; nothing is started and no record written).
    pub(super) fn set_up(world: &'a World, args: &'a TrainArgs) -> Result<Option<Run<'a>>> {
        let plan = world.agree(Plan::resolve(args, world))?;
        world.agree(check_same_config(world, args))?;
        tch::set_num_threads(plan.threads as i32);
        world.agree(make_current(plan.device))?;
        crate::watchdog::start(world.rank, world.agree(watchdog_timeout(args.watchdog.exchange_timeout_s))?);
        if plan.device.is_cuda() {
            tch::Cuda::cudnn_set_benchmark(true);
            // PyTorch lets cuDNN use TF32 by default: fp32 means fp32.
            raw::set_allow_tf32(args.precision == Precision::Tf32);
        }
        world.agree(if world.is_root() { results::check_writable(&args.results) } else { Ok(()) })?;
        // Each node's ranks write their traces into their own node's folder.
        world.agree(args.profile_dir.as_deref().map_or(Ok(()), |dir| std::fs::create_dir_all(dir).map_err(|e| Error::usage(format!("--profile-dir {}: {e}", dir.display())))))?;
        let faults = world.agree(Faults::from_env(world.size))?;
        // The parameter server's checkpoints are whole, written by rank 0 from its servers'
        // state: `stall-write` and `damage-write` act inside a rank's part of a sharded one,
        // which it has none of. Refused rather than ignored.
        world.agree(match (faults.in_a_sharded_write(), args.strategy == crate::exchange::StrategyKind::Ps) {
            (Some(kind), true) => Err(Error::usage(format!("{}: {kind} acts in a rank's part of a sharded checkpoint; --strategy ps writes whole checkpoints, which it does not reach", crate::faults::FAULT_ENV))),
            _ => Ok(()),
        })?;
        if faults.terminates_in_setup(world.rank) {
            let _ = signal_hook::low_level::raise(signal_hook::consts::SIGTERM);
        }
        let stop = StopSignal::install()?;
        let (info, labels) = world.agree(data::open(&args.data))?;
        let global_batch = plan.batch * plan.workers;
        if info.train.len < global_batch {
            // Every rank computes the same verdict from the same file; agree keeps one message.
            let why = format!("{} training samples, fewer than ranks x batch = {} x {} = {global_batch}", info.train.len, plan.workers, plan.batch);
            world.agree::<()>(Err(Error::data(&args.data, why)))?;
        }
        let steps_per_epoch = info.train.len.div_ceil(global_batch) as u64;
        let total_steps = args.total_steps(steps_per_epoch);
        world.agree(check_model_fits(args, &info, &plan, world))?;
        // --tensor-parallel: the groups, and their all-reduce behind the model's layers.
        let tensor_parallel = match args.tensor_parallel {
            1 => None,
            _ => {
                let config = exchange_config(world, args, &plan, args.recipe.config(), args.recipe.schedule(global_batch, steps_per_epoch, total_steps), 0)?;
                Some(world.agree(TensorParallel::new(world, args, &config))?)
            }
        };
        // A pipeline: the cut of the model, then this rank's stage of it. With tensor
        // parallelism, the pipelines run over the ranks of one place in the groups.
        let pipeline_world = tensor_parallel.as_ref().map_or(world, |tp| &tp.plane);
        let (mut pipeline, stage_cut) = match plan.pipeline {
            Some(pp) => {
                let micro_batch = plan.batch.div_ceil(pp.shape.micro_batches);
                let cut = world.agree(choose_cut(world, args.model, input_spec(&info), &args.pipeline.partition, &pp.shape, micro_batch, plan.device))?;
                let stage_cut = cut.stage(&pp.shape, pp.grid.stage_of(pipeline_world.rank as usize));
                let pipeline = world.agree(Pipeline::new(pipeline_world, pp, cut, micro_batch, plan.device, plan.cuda_aware, args.pipeline.recompute, args.pipeline.pipeline_timeline.is_some()))?;
                (Some(pipeline), Some(stage_cut))
            }
            None => (None, None),
        };
        // --cache-data: only the ranks that read images hold them (a pipeline's first stages),
        // so the node's copies are theirs.
        let split_bytes = info.train.len * info.sample_bytes();
        let reads_images = pipeline.as_ref().is_none_or(|p| p.data_parts().images);
        let image_ranks_on_node = {
            use mpi::collective::CommunicatorCollectives;
            let mut sum = 0i32;
            world.local.all_reduce_into(&i32::from(reads_images), &mut sum, mpi::collective::SystemOperation::sum());
            sum as usize
        };
        // Generated samples (`--data synthetic:...`) are drawn as they are read: nothing to hold.
        let generated = data::source::SyntheticData::from_path(&args.data).is_some();
        let cache_data = world.agree(match (reads_images, generated) {
            (_, true) if args.cache_data == data::loader::CacheData::On => Err(Error::usage(format!(
                "--cache-data on with --data {}: its samples are generated as they are read, there is no file to hold in memory; drop --cache-data",
                args.data.display()
            ))),
            (true, false) => data::loader::cache_decision(args.cache_data, split_bytes, image_ranks_on_node, data::loader::memory_available()),
            _ => Ok(false),
        })?;
        // The ranks that hold the same variables: all of them, a stage's replicas, or the ranks
        // of the other groups that hold the same part.
        let replicas: &World = part_replicas(pipeline.as_ref(), tensor_parallel.as_ref()).unwrap_or(world);
        // --zero 3: which blocks make each unit (learnt before the seed draws the weights). In a
        // pipeline the stage is one unit instead (shard_stage, below).
        let fully_sharded = (args.zero == 3 && pipeline.is_none()).then(|| {
            let (block_names, block_of_variable) = variable_blocks(args.model, input_spec(&info));
            let groups = fsdp_plan::group_blocks(&block_names, args.fsdp_unit);
            (block_names, block_of_variable, groups)
        });
        let layout = match (&stage_cut, &fully_sharded) {
            (Some(cut), _) => NetLayout::Stage(cut),
            (None, Some((_, _, groups))) => NetLayout::Units(groups),
            (None, None) => NetLayout::Whole,
        };
        // --save-weights where the model is cut goes through a folder beside the file, which must
        // be free: checked before the first step rather than after the whole training.
        if let (Some(out), true) = (&args.save_weights, pipeline.is_some() || tensor_parallel.is_some() || fully_sharded.is_some()) {
            world.agree(if world.is_root() { check_parts_folder(out) } else { Ok(()) })?;
        }
        // The checkpoint folder, held for this run alone; the checkpoint to continue from, and
        // whether anything is left to do.
        let checkpoint_lock = world.agree(lock_checkpoint_dir(world, args))?;
        let dataset_fingerprint = world.agree(match (&args.checkpoint_dir, world.is_root()) {
            (Some(_), true) => data::fingerprint(&info, &labels),
            _ => Ok(String::new()),
        })?;
        let now = checkpoint_meta(args, world, &plan, &info, &dataset_fingerprint, steps_per_epoch, total_steps, 0, 0);
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
                world.agree(if world.is_root() { save_checkpoint_weights(resume_from.as_ref(), path) } else { Ok(()) })?;
            }
            return Ok(None);
        }
        // Every rank gives memory to what it holds only, each variable drawn from its name, read
        // from --init-weights, or read from the checkpoint it resumes from: no rank holds the
        // whole model, nothing is broadcast.
        let resumed_from = resume_from.as_ref().filter(|_| first_step > 0);
        let initial_values = world.agree(InitialValues::of(args, resumed_from))?;
        let part = tensor_parallel.as_ref().map(|tp| TensorPart { split: tp.split(), rank: tp.rank, size: tp.layout.tensor });
        let (mut net, spec) = world.agree(Net::new(args, &info, plan.device, layout, part, &initial_values))?;

        // (--zero 3's parameters are empty until shard_units, which has the exchange lay them
        // out channels-last.)
        if args.channels_last {
            world.agree(net.params.iter().chain(net.buffers.iter().map(|(_, t)| t)).try_for_each(raw::param_to_channels_last))?;
        }
        // Every parameter gets a gradient, so that every rank exchanges the same set (stage 3
        // packs a missing gradient as zeros, and holds no whole gradients between steps).
        if args.zero != 3 {
            optim::define_grads(&net.params)?;
        }

        let optimizer_config = args.recipe.config();
        let schedule = args.recipe.schedule(global_batch, steps_per_epoch, total_steps);
        let config = exchange_config(world, args, &plan, optimizer_config, schedule.clone(), first_step)?;
        let mut exchange = world.agree(exchange::build(args.strategy, replicas, &config))?;
        world.agree(exchange.prepare(&net.params))?;
        exchange.name_tensors(&net.param_names);
        let mut optimizer = Optimizer::new(optimizer_config, schedule, optim::exempt_by_dims(net.declared.iter().map(|v| v.shape.len())));
        if let Some(tp) = &tensor_parallel {
            // LARS's trust ratio over whole layers, not over this rank's parts of them.
            optimizer.set_layer_parts(tp.layer_parts(&net.param_names));
        }
        // Resuming: every rank reads the optimizer state it will hold (its exchange says which
        // ranges), from the reader its weights came through or one on a whole checkpoint.
        let mut resume_read = None;
        if let Some(found) = resumed_from {
            let reader = world.agree(state_reader(&initial_values, &found.dir))?;
            resume_read = Some(reader.shared_stats());
            world.agree(restore_state(reader, &net, tensor_parallel.as_ref(), exchange.as_mut(), &mut optimizer))?;
        }
        // --zero 3: the parameters cut to this rank's shards, the units' modules to their thread.
        let fsdp = match fully_sharded {
            Some((block_names, block_of_variable, groups)) => {
                // Agreed: with and without prefetch the collectives come in different orders.
                let prefetch = world.sum_f64(f64::from(u8::from(fsdp_prefetch(world, args, &plan)))) as i32 == world.size;
                Some(world.agree(shard_units(&mut net, &initial_values, exchange.as_mut(), &mut optimizer, &block_names, &block_of_variable, &groups, args, plan.device, prefetch))?)
            }
            None => None,
        };
        // --zero 3 in a pipeline: the stage's parameters cut to this rank's shard of them.
        if let Some(stage) = pipeline.as_mut().filter(|_| args.zero == 3) {
            world.agree(shard_stage(&net, exchange.as_mut(), &mut optimizer, args.channels_last))?;
            stage.shards_parameters = true;
        }
        // Stage 3 overlaps through its units' prefetch (in a pipeline it has none: the stage is
        // gathered once per step, and an explicit --overlap on is refused: plan.rs); tensor
        // parallelism exchanges after backward (an explicit --overlap on is refused there:
        // plan/compat.rs); a pipeline stage overlaps chunk by chunk, its parameters' chunks
        // found by name.
        let fixed = match (fsdp.is_some(), args.zero == 3, tensor_parallel.is_some()) {
            (true, _, _) => Some("--zero 3 overlaps through its units' prefetch"),
            (false, true, _) => Some("--zero 3 gathers a pipeline stage once per step, before its schedule"),
            (false, false, true) => Some("tensor parallelism exchanges after backward"),
            (false, false, false) => None,
        };
        let (overlap, overlap_choice) = if let Some(why) = fixed {
            (None, OverlapChoice::fixed(why))
        } else {
            let stage = pipeline.as_ref().map(|p| (p, spec));
            make_overlap(world, args, &plan, &net, exchange.as_mut(), config.bucket_bytes, (first_step, total_steps), stage)?
        };
        // (--zero 3 said its prefetch's choice above.)
        if world.is_root() && fsdp.is_none() {
            let state = match (&overlap, &overlap_choice.trial) {
                (Some(_), Some(_)) => "on trial",
                (Some(_), None) => "on",
                (None, _) => "off",
            };
            log::info!("--overlap {}: {state} ({})", format!("{:?}", args.overlap).to_lowercase(), overlap_choice.reason);
        }
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
        // --recompute: each chunk's batch-norm buffers, put back after its recomputed forward.
        if let Some(pipeline) = pipeline.as_mut().filter(|_| args.pipeline.recompute) {
            pipeline.hold_buffers(&net.buffers, &variable_blocks(args.model, spec).1);
        }
        let part = match (pipeline, fsdp) {
            (Some(mut stage), _) => {
                stage.overlap = overlap;
                Part::Stage(stage)
            }
            (None, Some(units)) => Part::Units(units),
            (None, None) => Part::Whole { overlap },
        };
        let layout = RunLayout { tensor: tensor_parallel, part };
        let run = Run {
            world, args, plan, info, labels, cache_data, spec, net, layout, exchange, optimizer, overlap_choice, faults, stop, workers_comm, worker, workers,
            global_batch, steps_per_epoch, first_step, total_steps, resumed_at: resume_from.as_ref().map(|c| c.meta.step),
            dataset_fingerprint, checkpoints: CheckpointLog { newest_good: resume_from.as_ref().map(|c| c.meta.step), resume_read, ..CheckpointLog::default() },
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
            "{} on {} rank(s) ({} {}, {} node(s)), {} on {} {}x{}x{} ({} train / {} test), batch {}/{} = {} global, steps {}..{} ({:.2} epochs), device {}, {} thread(s)/rank",
            args.strategy, self.world.size, self.workers, if self.layout.pipeline().is_some() { "pipeline(s)" } else { "worker(s)" }, self.world.nodes(), args.model.name(), info.meta.name, info.meta.channels, info.meta.height, info.meta.width,
            info.train.len, info.test.len, plan.batch, if self.layout.pipeline().is_some() { "pipeline" } else { "rank" }, self.global_batch, self.first_step, self.total_steps, self.total_steps as f64 / self.steps_per_epoch as f64,
            device_name(plan.device), plan.threads
        );
        if let Some(preset) = args.preset {
            let counts = args.step_counts(info.train.len, self.workers, plan.batch);
            log::info!("--preset {}: {} warm-up and {} measured step(s)", preset.name(), counts.warmup, counts.measured);
        }
        if let Some(tp) = &self.layout.tensor {
            log::info!(
                "tensor parallel: {}; each encoder layer's heads and MLP columns cut over {} ranks, their partial sums all-reduced by {}",
                tp.layout.describe(),
                tp.layout.tensor,
                tp.strategy
            );
        }
        if let Some(f) = self.layout.fsdp() {
            // The ranks that share the shards: all of them, or those that hold the same
            // tensor-parallel part (on the node, with --fsdp-hybrid).
            let sharers = self.layout.tensor.as_ref().map_or(self.world, |tp| &tp.replicas);
            let sharing = if self.args.fsdp_hybrid { sharers.local_size } else { sharers.size };
            log::info!("{}", f.describe(sharing as usize));
        }
        if let Some(p) = self.layout.pipeline() {
            let shape = &p.plan.shape;
            log::info!(
                "pipeline: {} replica(s) x {} stage(s), {} micro-batch(es) of about {} samples, schedule {}{}, --partition {}{}",
                p.plan.grid.replicas,
                shape.stages,
                shape.micro_batches,
                self.plan.batch.div_ceil(shape.micro_batches),
                shape.kind,
                if shape.virtual_stages > 1 { format!(" ({} chunks per stage)", shape.virtual_stages) } else { String::new() },
                self.args.pipeline.partition.name(),
                if self.args.pipeline.recompute { ", recomputing forwards in backward" } else { "" }
            );
            for line in p.cut.describe(shape) {
                log::info!("  {line}");
            }
            if p.shards_parameters {
                let held = self.net.held_elements();
                let sharing = if self.args.fsdp_hybrid { p.stage_world.local_size } else { p.stage_world.size };
                log::info!(
                    "  zero 3: each stage is one unit, sharded over its {sharing} replica(s){}: rank 0 holds about {} of its {held} parameters between steps, and gathers them once per step for every micro-batch",
                    if self.args.fsdp_hybrid { " of the node" } else { "" },
                    held.div_ceil(sharing as usize)
                );
            }
            if let Some(costs) = p.cut.chunk_costs() {
                // The schedule replayed with the survey's F, B and W of each chunk: what the
                // profiled cut should give.
                if let Ok(replay) = crate::plan::pipeline::replay(shape, &costs) {
                    let bubbles: Vec<String> = (0..shape.stages).map(|s| format!("{:.1}%", replay.bubble(s) * 100.0)).collect();
                    let held: Vec<String> = replay.peak_alive.iter().map(usize::to_string).collect();
                    log::info!(
                        "  expected bubble per stage with the profiled times: {} (balanced theory {:.1}%); micro-batches held per stage at most {}",
                        bubbles.join(", "),
                        shape.theoretical_bubble() * 100.0,
                        held.join(", ")
                    );
                }
            }
        }
        let schedule = self.optimizer.schedule();
        log::info!(
            "optimizer {}; learning rate {} ({}{}), label smoothing {}",
            self.optimizer.config.describe(),
            schedule.peak,
            schedule.describe(self.steps_per_epoch),
            match args.recipe.scale_lr {
                optim::ScaleLr::None => String::new(),
                scale => format!(", --lr {} scaled {:?} from a batch of {}", args.recipe.lr, scale, args.recipe.base_batch).to_lowercase(),
            },
            args.recipe.label_smoothing
        );
        let split_mb = (info.train.len * info.sample_bytes()) as f64 / 1e6;
        // Rank 0 says what it holds; in a pipeline it is a first stage, which reads the images
        // alone, and the other stages read less.
        let (what, pipelined) = match self.layout.pipeline() {
            Some(p) if p.plan.grid.stages > 1 => ("the training split's images", "; as on each pipeline's first stage (its last stage reads the labels alone, the stages between read nothing)"),
            _ => ("the training split", ""),
        };
        if data::source::SyntheticData::from_path(&args.data).is_some() {
            log::info!("the training samples are generated as they are read ({split_mb:.1} MB nominal, none of it held)");
        } else if self.cache_data {
            log::info!("rank 0 holds {what} in memory ({split_mb:.1} MB; --cache-data){pipelined}");
        } else if args.cache_data == data::loader::CacheData::Auto {
            match data::loader::memory_available() {
                Some(_) => log::info!("rank 0 reads {what} from the file per batch ({split_mb:.1} MB on each rank of the node that reads images is more than they may hold: --cache-data auto){pipelined}"),
                None => log::info!("rank 0 reads {what} from the file per batch (MemAvailable could not be read from /proc/meminfo; --cache-data on holds it anyway){pipelined}"),
            }
        } else if !pipelined.is_empty() {
            log::info!("rank 0 reads {what} from the file per batch{pipelined}");
        }
    }
}

/// The exchange's options from the command line and the plan.
fn exchange_config(world: &World, args: &TrainArgs, plan: &Plan, optimizer: OptimizerConfig, schedule: LrSchedule, first_step: u64) -> Result<ExchangeConfig> {
    let mut ps = args.ps.config(optimizer, schedule);
    ps.checkpoint_every = args.checkpoint_dir.as_ref().map(|_| args.checkpoint_every);
    ps.first_step = first_step;
    Ok(ExchangeConfig {
        device: plan.device,
        cuda_aware: plan.cuda_aware,
        bucket_bytes: args.exchange.bucket_bytes(),
        segment_bytes: args.exchange.segment_bytes(),
        ring_transport: args.exchange.ring_transport,
        ps,
        horovod: world.agree(args.horovod.config())?,
        mpi_allreduce: args.exchange.mpi_allreduce,
        cost_model: world.agree(crate::cost::CostModel::from_option(args.exchange.cost_model.as_deref()))?,
        zero: args.zero,
        fsdp_hybrid: args.fsdp_hybrid,
    })
}

/// `--zero 3`: the units' layouts, this rank's shards cut from the whole parameters (and
/// optimizer state, on resume) which are then let go, and the thread that computes the units.
#[allow(clippy::too_many_arguments)]
fn shard_units(
    net: &mut Net,
    values: &InitialValues,
    exchange: &mut dyn exchange::Exchange,
    optimizer: &mut Optimizer,
    block_names: &[String],
    block_of_variable: &HashMap<String, usize>,
    groups: &[std::ops::Range<usize>],
    args: &TrainArgs,
    device: tch::Device,
    prefetch: bool,
) -> Result<FullySharded> {
    // A variable outside every block (tiny-unused's extra layer) goes with the last one.
    let last_block = block_names.len() - 1;
    let block_of = |name: &str| block_of_variable.get(name).copied().unwrap_or(last_block);
    let param_blocks: Vec<usize> = net.param_names.iter().map(|n| block_of(n)).collect();
    // Under tensor parallelism the units are of this rank's parts, sharded over its replicas.
    let shapes: Vec<Vec<i64>> = (0..net.declared.len()).map(|i| net.held_shape(i)).collect();
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product::<i64>() as usize).collect();
    let units = fsdp_plan::lay_out(block_names, groups, &param_blocks, &sizes);
    let layouts: Vec<_> = units.iter().map(|u| u.layout.clone()).collect();
    let shards = exchange.fully_sharded().ok_or_else(|| Error::usage("--zero 3 needs a fully sharded exchange"))?;
    // The parameters are empty here, so the channels-last block above left them: the exchange
    // lays out the 4-d ones (raw::param_to_channels_last's rule) channels-last at each gather.
    shards.compute_channels_last(shapes.iter().map(|s| args.channels_last && s.len() == 4).collect());
    // This rank's range of each parameter, one at a time: read from a checkpoint for that range
    // only, or drawn whole from the seed and cut.
    shards.shard(&layouts, &net.params, &shapes, &mut |index, at, len| net.initial_range(index, at, len, values), optimizer)?;
    let unit_of_block = |b: usize| groups.iter().position(|g| g.contains(&b)).expect("every block is in a unit");
    let mut buffers: Vec<Vec<tch::Tensor>> = (0..units.len()).map(|_| Vec::new()).collect();
    for (name, t) in &net.buffers {
        buffers[unit_of_block(block_of(name))].push(t.shallow_clone());
    }
    let modules = std::mem::take(&mut net.chunks).into_iter().map(|(_, m)| m).collect();
    let clock = StampClock::new(device);
    let worker = UnitWorker::spawn(modules, buffers, device, args.precision, clock.clone())?;
    Ok(FullySharded { units, size: args.fsdp_unit, prefetch, worker, comm_stream: crate::raw::CudaStream::from_pool(device)?, clock })
}

/// `--zero 3` in a pipeline: the stage's parameters (with tensor parallelism, this rank's parts
/// of them) laid out flat as one unit, this rank's shard of it cut from their values (drawn,
/// read from --init-weights or from the checkpoint resumed from, whole for this stage only),
/// which are then let go. The stage gathers the unit whole before each step's schedule and
/// each evaluation, and lets it go after (pipeline_step.rs), as torchtitan's FSDP under
/// pipelining, which does not reshard after forward so that the micro-batches reuse one
/// gather: between steps a rank holds 1/D of its stage.
fn shard_stage(net: &Net, exchange: &mut dyn exchange::Exchange, optimizer: &mut Optimizer, channels_last: bool) -> Result<()> {
    let shapes: Vec<Vec<i64>> = (0..net.declared.len()).map(|i| net.held_shape(i)).collect();
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product::<i64>() as usize).collect();
    let unit = fsdp_plan::whole_stage(&sizes);
    let shards = exchange.fully_sharded().ok_or_else(|| Error::usage("--zero 3 needs a fully sharded exchange"))?;
    shards.compute_channels_last(shapes.iter().map(|s| channels_last && s.len() == 4).collect());
    // The values this rank's shard starts from are the parameters' own, in the standard
    // row-major order the shards keep (a channels-last parameter's made contiguous).
    let params = &net.params;
    let mut range = |t: usize, at: i64, len: i64| -> Result<tch::Tensor> { Ok(params[t].f_contiguous()?.f_view([-1])?.f_narrow(0, at, len)?) };
    shards.shard(std::slice::from_ref(&unit), params, &shapes, &mut range, optimizer)
}

/// Whether `--zero 3` prefetches the next unit while this one computes (its overlap): as asked,
/// and under auto where backward leaves cores free (or on a GPU). Decided at set-up, since the
/// units' collectives come in another order with prefetch: auto's trial of the first steps
/// (overlap_choice.rs) is data parallelism's.
fn fsdp_prefetch(world: &World, args: &TrainArgs, plan: &Plan) -> bool {
    match args.overlap {
        OnOff::Auto => {
            // Cores this rank's backward leaves free: those it may use beyond its threads (each
            // rank of the node counted).
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let bound = cores < num_cpus_online();
            let mine = if bound { cores } else { cores / world.local_size.max(1) as usize };
            let on = plan.device.is_cuda() || mine > plan.threads;
            if world.is_root() {
                log::info!("--overlap auto (--zero 3 prefetch): {}", if on { "on" } else { "off (backward uses every core of the rank: the prefetch would take them from it)" });
            }
            on
        }
        other => other == OnOff::On,
    }
}
