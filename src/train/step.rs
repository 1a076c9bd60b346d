//! One training step (data, forward, backward with the exchange, optimizer, timings), and what
//! follows a step at some steps: a progress line, an evaluation, a checkpoint, a stop request.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use tch::nn::ModuleT;
use tch::{Kind, Reduction, Tensor};

use crate::checkpoint::Retention;
use crate::data::{DatasetInfo, Labels, Split};
use crate::data::loader::{Batch, Loader, Parts, Schedule};
use crate::data::reader::SplitReader;
use crate::error::{Error, Result};
use crate::exchange::{self, ReduceOp};
use crate::optim::{self};
use crate::plan::shard::ShardInfo;
use crate::topology::World;

use super::checkpoints::{checkpoint_meta, save_checkpoint, save_sharded_checkpoint, save_weights, save_weights_in_parts};
use super::collective::{average_over, sum_pair};
use super::net::{Net, Normalizer};
use super::options::Precision;
use super::profile::StepProfile;
use super::progress::{finite_loss, LossWindow, PendingLoss, Progress, SampleTrace, StepLoss, Timings};
use super::run::{part_replicas, Run};
use super::step_faults::StepFaults;

/// What the loop keeps from step to step.
pub(super) struct LoopState {
    pub(super) norm: Normalizer,
    pub(super) loader: Loader,
    pub(super) trace: SampleTrace,
    pub(super) progress: Progress,
    /// The first step whose time counts in throughput figures.
    pub(super) warmup: u64,
    pub(super) profile: StepProfile,
    /// fp16's dynamic loss scaler; None at other precisions.
    pub(super) scaler: Option<LossScaler>,
    /// The one-rank GPU step's checks, left on the device ([`DeferredChecks`]); None elsewhere.
    deferred: Option<DeferredChecks>,
}

/// On one GPU rank, what the step would read from the device every step, the loss and whether
/// the gradients are finite, stays there until the loop reads it, at its progress lines, its
/// evaluations, checkpoints, the end of the warm-up and of the run: one wait for the device
/// there instead of four in every step (as a PyTorch loop that calls `loss.item()` only when
/// it logs). The gradients' check is GradScaler's multi-tensor kernel into a flag that stays
/// set once any step's gradients were not finite; the fused SGD and AdamW kernels read the flag
/// on the device and change nothing under it, so that no weight takes a non-finite update while
/// the host does not yet know, and the read names the first such step (issue 52).
pub(super) struct DeferredChecks {
    /// 1 once a step's gradients held a value that is not finite.
    not_finite: Tensor,
}

impl DeferredChecks {
    /// Where they apply: a GPU, one rank (the exchange is the identity, with nothing to wait
    /// for), no fp16 loss scaler (which decides on the host whether to step).
    fn for_run(run: &Run, fp16: bool) -> Result<Option<DeferredChecks>> {
        let plain = run.pipeline.is_none() && run.fsdp.is_none() && run.tensor_parallel.is_none() && run.overlap.is_none();
        // Test hook: the same path on a CPU rank, where a read costs no idle device, so that the
        // CPU-only test suite checks it (tests/reliability.rs).
        let cuda_or_test = run.plan.device.is_cuda() || std::env::var_os("HPC_TRAIN_TEST_DEFER_CHECKS").is_some();
        // One rank in the world: one worker, whose all-reduce is the identity.
        if !cuda_or_test || !plain || fp16 || run.world.size != 1 {
            return Ok(None);
        }
        Ok(Some(DeferredChecks { not_finite: Tensor::f_zeros([1], (Kind::Float, run.plan.device))? }))
    }
}

impl LoopState {
    pub(super) fn new(run: &Run) -> Result<LoopState> {
        let (args, first, total) = (run.args, run.first_step, run.total_steps);
        let schedule = Schedule { samples: run.info.train.len, workers: run.workers, worker: run.worker, batch: run.plan.batch, seed: args.seed };
        // Throughput counts the steps after `--overlap auto`'s trial too, which run in one mode,
        // from the second (the first may switch modes) where the run has one after it.
        let settled = run.overlap_choice.trial_end().map_or(0, |end| (end + 1).min(total.saturating_sub(1)).max(end));
        let warmup = (first + args.warmup_steps.min(total.saturating_sub(first + 1))).max(settled);
        // A pipeline's stages read only what they use (the first the images, the last the labels).
        let parts = run.pipeline.as_ref().map_or(Parts::ALL, |p| p.data_parts());
        let labels = Arc::new(if parts.labels { run.labels.train.clone() } else { Vec::new() });
        Ok(LoopState {
            norm: Normalizer::new(&run.info, run.plan.device, args.channels_last)?,
            loader: Loader::spawn(args.data.clone(), labels, parts, schedule, first, total, args.prefetch, run.cache_data, run.plan.device),
            trace: SampleTrace::open(args.trace_samples.as_deref(), run.world.rank)?,
            progress: Progress::new(run.world.is_root(), total, args.log_every),
            warmup,
            profile: StepProfile::new(args.profile_dir.as_deref(), run.world.rank, warmup, args.profile_steps, total, run.plan.device.is_cuda()),
            scaler: (args.precision == Precision::Fp16).then(|| LossScaler { scale: args.loss_scale, ..LossScaler::default() }),
            deferred: DeferredChecks::for_run(run, args.precision == Precision::Fp16)?,
        })
    }

    /// Whether the step's loss and checks stay on the device until the loop reads them.
    pub(super) fn defers_checks(&self) -> bool {
        self.deferred.is_some()
    }
}

/// A step's loss on the device: the rank's summed loss (read once the step's backward has run)
/// and the scaled one that backward starts from.
pub(super) struct Losses {
    loss: Tensor,
    scaled: Tensor,
    /// Test hook (`nan` fault): the loss reads as NaN.
    injected_nan: bool,
    step: u64,
    epoch: u64,
}

impl Losses {
    /// The summed loss, refused when it is not finite.
    fn read(&self) -> Result<f64> {
        finite_loss(self.loss.f_double_value(&[])?, self.injected_nan, self.step, self.epoch)
    }
}

/// What backward and the exchange took, and the loss read after them.
struct Exchanged {
    compute: Duration,
    /// The exchange not hidden behind backward.
    comm: Duration,
    exchange_total: Duration,
    exchange_exposed: Duration,
    loss: StepLoss,
}

/// One step's figures (its total time is the caller's to measure).
pub(super) struct StepDone {
    pub(super) timings: Timings,
    pub(super) loss: StepLoss,
    pub(super) samples: usize,
    pub(super) epoch: u64,
}

impl Run<'_> {
    /// Data, forward, backward overlapped with (or followed by) the exchange, optimizer.
    pub(super) fn step(&mut self, step: u64, state: &mut LoopState) -> Result<StepDone> {
        if self.pipeline.is_some() {
            return self.pipeline_step(step, state);
        }
        if self.fsdp.is_some() {
            return self.fsdp_step(step, state);
        }
        let tensor_parallel_before = self.tensor_parallel.as_ref().map(|tp| tp.counts());
        let (batch, data_wait) = self.begin_step(step, state)?;
        let faults = StepFaults::begin(&self.faults, self.world.rank, step);

        // Forward on this rank's share of the global batch. The loss is the sum over the rank's
        // samples scaled by workers / global samples, so that the mean over workers of the
        // gradients is the gradient of the global batch's mean loss, however the last step of
        // an epoch is split.
        let compute_start = Instant::now();
        // Backward hands its gradients over (none are zeroed to be added into), but those that
        // are views into the overlap's bucket buffers, zeroed there. The handles live for this
        // step only: after ZeRO stage 2 lets go of a gradient, no handle may keep its memory.
        let overlapped = self.overlap.is_some() && self.overlap_choice.overlaps_at(step);
        match (&self.overlap, overlapped) {
            (Some(overlap), true) => overlap.prepare_grads(&self.net.params)?,
            _ => optim::release_grads(&self.net.params)?,
        }
        let mut grads = self.net.grads();
        let n = batch.samples();
        let loss_factor = self.loss_factor(batch.global_samples, state.scaler.as_ref());
        let losses = if n == 0 {
            None
        } else {
            faults.forward()?;
            let loss = self.forward(&state.norm, &batch)?;
            let factor = if faults.nan_gradients() { f64::NAN } else { loss_factor };
            let scaled = loss.f_mul_scalar(factor)?;
            Some(Losses { loss: loss.f_detach()?, scaled, injected_nan: faults.nan_loss(), step, epoch: batch.epoch })
        };
        faults.before_exchange();

        // Backward and the exchange. With the fp16 loss scaler the optimizer steps after the
        // exchange, once the averaged gradients (the same on every rank) are known to be finite.
        let optimize_in_exchange = state.scaler.is_none();
        let deferred = state.deferred.as_ref().map(|d| &d.not_finite);
        let Exchanged { compute, comm, exchange_total, exchange_exposed, loss } =
            self.backward_and_exchange(losses, &mut grads, compute_start, step, batch.epoch, optimize_in_exchange, deferred, overlapped)?;
        if let Some(scaler) = &mut state.scaler {
            if faults.inf_gradient() {
                inject_inf(&grads)?;
            }
            // A tensor-parallel group's ranks hold different slices of its parameters, each of
            // which may overflow alone: they skip or step together.
            let sharing = self.tensor_parallel.as_ref().map(|tp| &tp.group);
            if scaler.unscale_or_skip(&mut grads, sharing, step, self.world.is_root().then_some(&state.progress))? {
                self.optimizer.step(&mut self.net.params, &mut grads)?;
            }
        }
        faults.after_exchange();
        let optimizer = self.optimizer.take_busy();
        let comm = comm.saturating_sub(optimizer);
        if let (Some(tp), Some(before)) = (&mut self.tensor_parallel, tensor_parallel_before) {
            tp.note_step(&before, step >= state.warmup);
        }
        let timings = Timings { steps: 1, samples: batch.global_samples as u64, data_wait, compute, comm, optimizer, step: Duration::ZERO, exchange_total, exchange_exposed };
        Ok(StepDone { timings, loss, samples: n, epoch: batch.epoch })
    }

    /// What a rank's summed loss is multiplied by before backward: workers / global samples, so
    /// that the mean over workers of the gradients is the gradient of the global batch's mean
    /// loss however the last step of an epoch is split, times fp16's loss scale where it has one.
    pub(super) fn loss_factor(&self, global_samples: usize, scaler: Option<&LossScaler>) -> f64 {
        self.workers as f64 / global_samples.max(1) as f64 * scaler.map_or(1.0, |s| s.scale)
    }

    /// What every step starts with: the watchdog and the optimizer told the step, and the
    /// step's batch (with the time waited for it), traced.
    pub(super) fn begin_step(&mut self, step: u64, state: &mut LoopState) -> Result<(Batch, Duration)> {
        let started = Instant::now();
        crate::watchdog::set_step(step);
        self.optimizer.begin_step(step);
        let batch = state.loader.next()?;
        let data_wait = started.elapsed();
        state.trace.record(&batch)?;
        Ok((batch, data_wait))
    }

    /// The summed loss of the rank's samples (with --label-smoothing), in f32 (the forward under
    /// autocast for bf16 and fp16).
    fn forward(&self, norm: &Normalizer, batch: &Batch) -> Result<Tensor> {
        let x = norm.images(batch.images(), batch.samples())?;
        let y = norm.labels(batch.labels())?;
        self.args.precision.training_forward(self.plan.device, || {
            let logits = self.net.model().forward_t(&x, true);
            Ok(logits.f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, self.args.recipe.label_smoothing)?.f_to_kind(Kind::Float)?)
        })
    }

    /// Backward overlapped with the exchange and the optimizer bucket by bucket, or backward
    /// then the exchange (every strategy leaves the parameters updated for the next step).
    ///
    /// The loss is read (and checked) once backward has run, where the host waits for the
    /// device anyway: read after forward, it made the GPU idle between forward and backward.
    /// The gradients' finiteness is checked before the exchange without overlap, and gathered
    /// on the device during an overlapped step and read once at its end. Given `deferred` (the
    /// flag of [`DeferredChecks`]), neither is read: the check sets the flag, the optimizer
    /// skips under it, and the loop reads both later.
    #[allow(clippy::too_many_arguments)]
    fn backward_and_exchange(
        &mut self,
        losses: Option<Losses>,
        grads: &mut Vec<Tensor>,
        compute_start: Instant,
        step: u64,
        epoch: u64,
        optimize: bool,
        deferred: Option<&Tensor>,
        overlapped: bool,
    ) -> Result<Exchanged> {
        let device = self.plan.device;
        if let (Some(overlap), Some(losses), true) = (&mut self.overlap, losses.as_ref(), overlapped) {
            let forward = compute_start.elapsed();
            let (times, finite) = overlap.step(losses.scaled.shallow_clone(), &mut self.net.params, grads, self.exchange.as_mut(), &mut self.optimizer, step, epoch, optimize)?;
            exchange::staging::synchronize_device(device);
            let loss_sum = losses.read()?;
            if !finite.all_finite()? {
                return Err(Error::NonFinite { what: "gradient", step, epoch });
            }
            return Ok(Exchanged { compute: forward + times.backward, comm: times.exposed, exchange_total: times.exchange, exchange_exposed: times.exposed, loss: StepLoss::Read(loss_sum) });
        }
        if let Some(losses) = &losses {
            losses.scaled.f_backward()?;
        }
        if let (Some(flag), true) = (deferred, optimize) {
            return self.optimize_unread(losses, grads, flag, compute_start);
        }
        let loss_sum = losses.as_ref().map_or(Ok(0.0), Losses::read)?;
        // What backward handed over, zeros where it made none.
        *grads = optim::defined_grads(&self.net.params)?;
        if optimize && !optim::grads_finite(grads)? {
            return Err(Error::NonFinite { what: "gradient", step, epoch });
        }
        exchange::staging::synchronize_device(device);
        let compute = compute_start.elapsed();
        let comm_start = Instant::now();
        {
            let exchange = &mut self.exchange;
            let _watched = crate::watchdog::exchange(exchange.name(), || exchange.waits_for());
            if optimize {
                exchange.update(&mut self.net.params, grads, &mut self.optimizer)?;
            } else {
                exchange.all_reduce(grads, ReduceOp::Mean)?;
            }
        }
        exchange::staging::synchronize_device(device);
        let comm = comm_start.elapsed();
        Ok(Exchanged { compute, comm, exchange_total: comm, exchange_exposed: comm, loss: StepLoss::Read(loss_sum) })
    }

    /// After backward on one GPU rank ([`DeferredChecks`]): the gradients' check into `flag`,
    /// the update under it, nothing read and no wait for the device. The times are the host's:
    /// compute ends when backward's kernels are queued, and the device's time shows where the
    /// host next waits (the loop's reads).
    fn optimize_unread(&mut self, losses: Option<Losses>, grads: &mut Vec<Tensor>, flag: &Tensor, compute_start: Instant) -> Result<Exchanged> {
        *grads = optim::defined_grads(&self.net.params)?;
        optim::flag_not_finite(grads, flag)?;
        let compute = compute_start.elapsed();
        let comm_start = Instant::now();
        self.optimizer.skip_if(Some(flag.shallow_clone()));
        let updated = self.exchange.update(&mut self.net.params, grads, &mut self.optimizer);
        self.optimizer.skip_if(None);
        updated?;
        let comm = comm_start.elapsed();
        let loss = match losses {
            Some(l) => StepLoss::OnDevice(PendingLoss { loss: l.loss, not_finite: flag.f_detach_copy()?, injected_nan: l.injected_nan, step: l.step, epoch: l.epoch }),
            None => StepLoss::Read(0.0),
        };
        Ok(Exchanged { compute, comm, exchange_total: comm, exchange_exposed: comm, loss })
    }

    /// The mean training loss since the last report, over all workers; logged by rank 0.
    pub(super) fn report_progress(&self, step: u64, epoch: u64, window: &mut LossWindow, totals: &Timings, progress: &Progress) {
        let (loss, samples) = sum_pair(&self.workers_comm, window.sum, window.samples);
        window.restart();
        progress.report(step, epoch, loss / samples.max(1.0), totals);
    }

    /// Test loss and accuracy at an epoch's end, batch-norm statistics averaged first.
    pub(super) fn evaluate_epoch(&mut self, step: u64, epoch: u64, state: &LoopState) -> Result<(f64, f64)> {
        let _phase = super::memory::enter(super::memory::Phase::Evaluation);
        // Batch-norm statistics averaged among the ranks that hold the same buffers, chosen here
        // for every step kind: a stage's replicas in a pipeline (with tensor parallelism, those
        // of the same part), the D replicas of this rank's part with tensor parallelism alone
        // (a group's other ranks hold other parts, whose buffers need not even have this
        // part's sizes: issue 48, item 4), else every worker (not ps's dedicated servers).
        let buffers: Vec<Tensor> = self.net.buffers.iter().map(|(_, t)| t.shallow_clone()).collect();
        let (holders, count) = match part_replicas(self.pipeline.as_ref(), self.tensor_parallel.as_ref()) {
            Some(replicas) => (&replicas.comm, replicas.size as usize),
            None => (&self.workers_comm, self.workers),
        };
        average_over(holders, &buffers, true, count)?;
        let (test_loss, accuracy) = if self.pipeline.is_some() {
            self.pipeline_evaluate(&state.norm)?
        } else if self.fsdp.is_some() {
            self.fsdp_evaluate(&state.norm)?
        } else {
            // A tensor-parallel group's ranks evaluate the same samples; the first counts them.
            let counted = self.tensor_parallel.as_ref().is_none_or(|tp| tp.rank == 0);
            evaluate(&self.net, &state.norm, &self.args.data, &self.info, &self.labels, &self.workers_comm, self.worker, self.workers, self.plan.batch, counted)?
        };
        if self.world.is_root() {
            state.progress.suspend(|| log::info!("epoch {} done at step {}: test loss {test_loss:.4}, accuracy {:.2}%", epoch + 1, step + 1, accuracy * 100.0));
        }
        Ok((test_loss, accuracy))
    }

    /// A stop request (SIGTERM) every worker has agreed on: whether it cut training short.
    pub(super) fn stop_requested(&self, last_step: u64, progress: &Progress) -> bool {
        let stopped = last_step < self.total_steps;
        if self.world.is_root() && stopped {
            progress.suspend(|| log::warn!("stop requested (signal): ending after step {last_step} of {}", self.total_steps));
        }
        stopped
    }
}

impl Run<'_> {
    /// Whether a periodic checkpoint falls after `last_step`.
    pub(super) fn checkpoint_due(&self, last_step: u64) -> bool {
        self.args.checkpoint_dir.is_some() && last_step % self.args.checkpoint_every == 0
    }

    /// A checkpoint after `last_step` (every worker takes part): sharded, every rank writing
    /// what it holds (the parameter server: whole, rank 0 writing). A write that fails ends the
    /// run when this run has no earlier checkpoint to continue from; otherwise it is logged and
    /// counted, and the run ends non-zero (see `record`).
    pub(super) fn save_checkpoint(&mut self, last_step: u64) -> Result<()> {
        let Some(dir) = &self.args.checkpoint_dir else { return Ok(()) };
        let _phase = super::memory::enter(super::memory::Phase::Checkpoint);
        let meta = checkpoint_meta(self.args, self.world, &self.plan, &self.info, &self.dataset_fingerprint, self.steps_per_epoch, self.total_steps, last_step, self.optimizer.steps());
        // The checkpoint resumed from stays for the whole run, whatever --keep-checkpoints says.
        let retention = Retention { keep: self.args.keep_checkpoints, resumed_from: self.resumed_at };
        if self.args.strategy == crate::exchange::StrategyKind::Ps {
            return match save_checkpoint(self.world, dir, retention, &self.net, self.exchange.as_mut(), &self.optimizer, meta)? {
                Some(written) => self.checkpoints.note(dir, last_step, written),
                None => Ok(()),
            };
        }
        // The ranks that hold this rank's part alike: the exchange's.
        let replicas = part_replicas(self.pipeline.as_ref(), self.tensor_parallel.as_ref()).unwrap_or(self.world);
        let fault = self.faults.in_write(self.world.rank, last_step);
        let written = save_sharded_checkpoint(self.world, dir, retention, &self.net, self.exchange.as_mut(), &self.optimizer, meta, replicas, self.tensor_parallel.as_ref(), fault)?;
        if let Ok(w) = &written {
            self.checkpoints.count(w);
        }
        match self.world.is_root() {
            true => self.checkpoints.note(dir, last_step, written.map(|w| w.dir)),
            false => Ok(()),
        }
    }

    /// `--save-weights` (every rank takes part): where every worker holds the whole model, rank
    /// 0 writes it; where the model is cut, every rank writes what it holds and rank 0 streams
    /// the parts into the file, so that no rank holds the whole model (issue 49).
    pub(super) fn save_weights(&mut self, path: &std::path::Path, last_step: u64) -> Result<()> {
        let Some(replicas) = part_replicas(self.pipeline.as_ref(), self.tensor_parallel.as_ref()).or(self.fsdp.as_ref().map(|_| self.world)) else {
            return self.world.agree(if self.world.is_root() { save_weights(&self.net, path) } else { Ok(()) });
        };
        let meta = checkpoint_meta(self.args, self.world, &self.plan, &self.info, &self.dataset_fingerprint, self.steps_per_epoch, self.total_steps, last_step, self.optimizer.steps());
        save_weights_in_parts(self.world, path, &self.net, self.exchange.as_mut(), &self.optimizer, meta, replicas, self.tensor_parallel.as_ref())
    }
}

/// Dynamic loss scaling for fp16, as torch.cuda.amp.GradScaler: the loss is multiplied by
/// `scale` so that small gradients survive fp16; after the exchange the averaged gradients are
/// checked: finite, they are unscaled for the optimizer, and the scale doubles after
/// `growth_interval` good steps; not finite, the step is skipped and the scale halves. Every
/// rank must decide alike: the exchange gives the replicas of a part the same gradients, and
/// the ranks that hold other parts of the same parameters (a tensor-parallel group) agree on
/// one verdict, as Megatron's found-inf all-reduce over its model-parallel group does.
pub(super) struct LossScaler {
    pub(super) scale: f64,
    pub(super) good_steps: u32,
    pub(super) growth_interval: u32,
    pub(super) skipped: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler { scale: 65536.0, good_steps: 0, growth_interval: 2000, skipped: 0 }
    }
}

impl LossScaler {
    /// Unscales `grads` and returns true, or returns false (skip this step) on an overflow here
    /// or, given `sharing`, on any of its ranks (collective over it); a skip is logged to
    /// `progress` where given (rank 0's).
    pub(super) fn unscale_or_skip(&mut self, grads: &mut [Tensor], sharing: Option<&World>, step: u64, progress: Option<&Progress>) -> Result<bool> {
        let finite = match sharing {
            None => optim::unscale_if_finite(grads, 1.0 / self.scale)?,
            Some(group) => {
                let here = i32::from(optim::grads_finite(grads)?);
                let mut everywhere = 0;
                let comm = &group.comm;
                crate::watchdog::collective("the loss scaler's overflow agreement", comm, || comm.all_reduce_into(&here, &mut everywhere, SystemOperation::min()));
                // Finite everywhere, so finite here: the unscaling always applies.
                everywhere == 1 && optim::unscale_if_finite(grads, 1.0 / self.scale)?
            }
        };
        if !finite {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
            self.skipped += 1;
            if let Some(progress) = progress {
                progress.suspend(|| log::info!("fp16: gradients overflowed at step {step}; step skipped, loss scale now {}", self.scale));
            }
            return Ok(false);
        }
        self.good_steps += 1;
        if self.good_steps == self.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
        Ok(true)
    }
}

/// Test hook (`infgrad` fault): one element of the first gradient that has any becomes +inf.
pub(super) fn inject_inf(grads: &[Tensor]) -> Result<()> {
    if let Some(g) = grads.iter().find(|g| g.defined() && g.numel() > 0) {
        tch::no_grad(|| g.f_view([-1])?.f_get(0)?.f_fill_(f64::INFINITY).map(drop))?;
    }
    Ok(())
}

/// Test loss and accuracy over all workers' shards of the test set.
#[allow(clippy::too_many_arguments)]
pub(super) fn evaluate(
    net: &Net,
    norm: &Normalizer,
    path: &Path,
    info: &DatasetInfo,
    labels: &Labels,
    workers_comm: &SimpleCommunicator,
    worker: usize,
    workers: usize,
    batch: usize,
    counted: bool,
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
            let x = norm.images_from_bytes(&images, indices.len())?;
            let y = norm.labels(&labels.test[start..end])?;
            let logits = net.model().forward_t(&x, false);
            loss_sum += logits.f_cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0)?.f_double_value(&[])?;
            correct += logits.f_argmax(-1, false)?.f_eq_tensor(&y)?.f_sum(Kind::Float)?.f_double_value(&[])?;
        }
        Ok(())
    })?;
    let (loss_sum, correct) = if counted { (loss_sum, correct) } else { (0.0, 0.0) };
    let (loss_sum, correct) = sum_pair(workers_comm, loss_sum, correct);
    let n = info.test.len as f64;
    Ok((loss_sum / n, correct / n))
}