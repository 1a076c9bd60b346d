//! The one training step of every layout ([`Run::step`]: the batch, the layout's forward and
//! backward, the loss checked, the gradients averaged, one decision whether they step the
//! optimizer, the optimizer, the times), what the loop keeps between steps, fp16's loss scaler,
//! and what follows a step at some steps: a progress line, an evaluation, a checkpoint, a stop
//! request. What differs between layouts is theirs: whole_step.rs (whole layers, with or
//! without overlap), pipeline_step.rs (a pipeline stage's schedule), fsdp_step.rs (`--zero 3`'s
//! units); layout.rs says which a run has.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::collective::SystemOperation;
use mpi::traits::*;
use tch::{Device, Kind, Tensor};

use crate::checkpoint::Retention;
use crate::data::loader::{Batch, Loader, Parts, Schedule};
use crate::error::{Error, Result};
use crate::exchange::staging::synchronize_device;
use crate::optim::{self, FiniteCheck};
use crate::topology::World;

use super::checkpoints::{checkpoint_meta, save_checkpoint, save_sharded_checkpoint, save_weights, save_weights_in_parts};
use super::collective::{average_over, sum_pair};
use super::layout::Part;
use super::net::Normalizer;
use super::options::Precision;
use super::profile::StepProfile;
use super::progress::{finite_loss, LossWindow, PendingLoss, Progress, SampleTrace, StepLoss, Timings};
use super::run::Run;
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
    pub(super) deferred: Option<DeferredChecks>,
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
    pub(super) not_finite: Tensor,
}

impl DeferredChecks {
    /// Where they apply: a GPU, one rank (the exchange is the identity, with nothing to wait
    /// for), no fp16 loss scaler (which decides on the host whether to step).
    fn for_run(run: &Run, fp16: bool) -> Result<Option<DeferredChecks>> {
        let plain = run.layout.is_plain();
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
        let parts = run.layout.pipeline().map_or(Parts::ALL, |p| p.data_parts());
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

/// A step's loss as a layout's forward and backward leave it, before the step checks it.
pub(super) enum PassLoss {
    /// Read on the host (0 where this rank computed none).
    Read(f64),
    /// On the device, read once backward has run (where the host waits for the device anyway:
    /// read after forward, it made the GPU idle between forward and backward).
    Tensor(Tensor),
    /// Left on the device with the gradients' flag until the loop reads both ([`DeferredChecks`]).
    Deferred(PendingLoss),
}

/// Where a layout's forward and backward leave the gradients, and so what of the step is left.
pub(super) enum Gradients {
    /// This rank's own, not yet averaged over the ranks that hold its part alike.
    Local(Vec<Tensor>),
    /// Averaged beside backward (overlap's buckets with the loss scaler, which must see them
    /// all before any step), not yet applied.
    Reduced(Vec<Tensor>),
    /// `--zero 3`: reduce-scattered into this rank's shards (in the exchange), unit by unit
    /// beside backward or a pipeline stage's after its schedule, the local gradients'
    /// finiteness gathered as they were packed.
    Shards(FiniteCheck),
    /// Averaged and applied bucket by bucket beside backward (overlap without the scaler),
    /// their finiteness gathered as they went.
    Applied(FiniteCheck),
    /// Checked and applied on the device under [`DeferredChecks`]' flag: nothing to read now.
    AppliedOnDevice,
}

/// What a layout's forward and backward (whole layers, a pipeline stage's schedule, `--zero 3`'s
/// units) leave for the rest of the step.
pub(super) struct Backward {
    pub(super) loss: PassLoss,
    /// The samples whose loss this rank counts (in a pipeline, the last stage's).
    pub(super) samples: usize,
    pub(super) gradients: Gradients,
    /// The exchange beside backward (overlap's buckets, stage 3's gathers and reduce-scatters):
    /// its time in all, and the part compute did not hide, which the pass's time includes.
    pub(super) exchange_total: Duration,
    pub(super) exchange_exposed: Duration,
}

/// One step's figures (its total time is the caller's to measure).
pub(super) struct StepDone {
    pub(super) timings: Timings,
    pub(super) loss: StepLoss,
    pub(super) samples: usize,
    pub(super) epoch: u64,
}

/// The step's one clock: laps of the host's time, each ending once the device has done what
/// was queued (on a CPU, the host's time alone). Under [`DeferredChecks`] nothing waits for the
/// device: the laps are the host's, and the device's time shows where the loop next reads.
struct StepClock {
    device: Option<Device>,
    last: Instant,
}

impl StepClock {
    fn start(device: Device, waits: bool) -> StepClock {
        StepClock { device: waits.then_some(device), last: Instant::now() }
    }

    fn lap(&mut self) -> Duration {
        if let Some(device) = self.device {
            synchronize_device(device);
        }
        let now = Instant::now();
        now - std::mem::replace(&mut self.last, now)
    }
}

impl Run<'_> {
    /// One training step, whatever the layout (layout.rs): the batch; forward and backward as
    /// the layout computes them (whole layers, a pipeline stage's schedule, `--zero 3`'s units),
    /// with the exchange where the layout runs it beside backward; the loss checked; the
    /// gradients averaged where backward did not; one decision whether they step the optimizer
    /// (fp16's loss scaler: agreed by every rank that holds a part); the optimizer; the times.
    /// The test hooks of `HPC_TRAIN_FAULT` act at the same points in every layout.
    pub(super) fn step(&mut self, step: u64, state: &mut LoopState) -> Result<StepDone> {
        let tensor_counts = self.layout.tensor.as_ref().map(|tp| tp.counts());
        // The watchdog and the optimizer told the step; the batch; `exit` ends the process here,
        // `stall` and `pace` wait before the step's first communication.
        let (batch, data_wait) = self.begin_step(step, state)?;
        let faults = StepFaults::begin(&self.faults, self.world.rank, step);
        faults.before_exchange();
        let mut clock = StepClock::start(self.plan.device, !state.defers_checks());
        let factor = self.loss_factor(batch.global_samples, state.scaler.as_ref());

        let backward = match &self.layout.part {
            Part::Whole { .. } => self.whole_pass(&batch, factor, &faults, state, step)?,
            Part::Stage(_) => self.stage_pass(&batch, factor, &faults, state, step)?,
            Part::Units(_) => self.units_pass(&batch, factor, &faults, state)?,
        };
        let compute = clock.lap().saturating_sub(backward.exchange_exposed);
        let loss = match backward.loss {
            PassLoss::Read(sum) => StepLoss::Read(finite_loss(sum, faults.nan_loss(), step, batch.epoch)?),
            PassLoss::Tensor(sum) => StepLoss::Read(finite_loss(sum.f_double_value(&[])?, faults.nan_loss(), step, batch.epoch)?),
            PassLoss::Deferred(pending) => StepLoss::OnDevice(pending),
        };

        // The one decision whether the gradients step the optimizer, then the step: the exchange
        // averages them and the optimizer steps, where backward did not (`infgrad`: an fp16
        // overflow of this rank's gradients, which the scaler must see).
        let mut gradients = backward.gradients;
        if let (Gradients::Local(grads) | Gradients::Reduced(grads), true) = (&gradients, faults.inf_gradient() && state.scaler.is_some()) {
            inject_inf(grads)?;
        }
        let inv_scale = state.scaler.as_ref().map(|s| 1.0 / s.scale);
        if self.decide(&mut gradients, state.scaler.as_mut(), &state.progress, step, batch.epoch)? {
            self.optimizer.unscale_by(inv_scale);
            let applied = self.apply(gradients, &faults);
            self.optimizer.unscale_by(None);
            applied?;
        } else {
            faults.after_exchange();
        }

        // The exchange's time, beside backward and after it, less the optimizer's, which the
        // exchange's update and overlap's buckets run inside theirs.
        let after_backward = clock.lap();
        let optimizer = self.optimizer.take_busy();
        let comm = (backward.exchange_exposed + after_backward).saturating_sub(optimizer);
        let exchange_total = (backward.exchange_total + after_backward).saturating_sub(optimizer);
        if let (Some(tp), Some(before)) = (&mut self.layout.tensor, tensor_counts) {
            tp.note_step(&before, step >= state.warmup);
        }
        let timings = Timings { steps: 1, samples: batch.global_samples as u64, data_wait, compute, comm, optimizer, step: Duration::ZERO, exchange_total, exchange_exposed: comm };
        Ok(StepDone { timings, loss, samples: backward.samples, epoch: batch.epoch })
    }

    /// The one decision whether this step's gradients step the optimizer, from this rank's
    /// own gradients (before the exchange averages them, as backward packed them for stage 3's
    /// reduce-scatter, or as the exchange gathered them beside backward). Without fp16's loss
    /// scaler, gradients that are not finite end the run (no collective). With it, every rank
    /// steps or every rank skips: any rank's overflow reaches the average of its part's
    /// replicas, and one part stepping while another skips would part the model (stages,
    /// shards, tensor-parallel slices), so the verdicts are agreed over the world.
    fn decide(&mut self, gradients: &mut Gradients, scaler: Option<&mut LossScaler>, progress: &Progress, step: u64, epoch: u64) -> Result<bool> {
        let finite = match gradients {
            Gradients::Local(grads) | Gradients::Reduced(grads) => optim::grads_finite(grads)?,
            Gradients::Shards(check) | Gradients::Applied(check) => check.all_finite()?,
            // Checked on the device; the loop reads the flag with the loss.
            Gradients::AppliedOnDevice => true,
        };
        match scaler {
            Some(scaler) => Ok(scaler.agree(finite, self.world, step, self.world.is_root().then_some(progress))),
            None if finite => Ok(true),
            None => Err(Error::NonFinite { what: "gradient", step, epoch }),
        }
    }

    /// The optimizer's step on what the gradients came to: the exchange's update where they are
    /// this rank's own (the average and the step in one call: ZeRO 1/2 step each rank's shard
    /// then gather the weights, ps's servers step). `stall-after` acts once the gradients are
    /// averaged, before the collectives that follow (LARS's norms under ZeRO 3; the next
    /// step's): after the exchange's update where that averages and steps in one call.
    fn apply(&mut self, gradients: Gradients, faults: &StepFaults) -> Result<()> {
        match gradients {
            Gradients::Local(mut grads) => {
                if !grads.is_empty() {
                    let exchange = &mut self.exchange;
                    let _watched = crate::watchdog::exchange(exchange.name(), || exchange.waits_for());
                    exchange.update(&mut self.net.params, &mut grads, &mut self.optimizer)?;
                }
                faults.after_exchange();
            }
            Gradients::Reduced(mut grads) => {
                faults.after_exchange();
                if !grads.is_empty() {
                    self.optimizer.step(&mut self.net.params, &mut grads)?;
                }
            }
            Gradients::Shards(_) => {
                faults.after_exchange();
                // The optimizer on the units' collectives' stream, as the shards it reads (a
                // pipeline stage's shards are gathered and reduced on the run's stream).
                let on_comm_stream = self.layout.fsdp().map(|f| f.collectives_stream()).transpose()?.flatten();
                self.exchange.fully_sharded().expect("--zero 3 builds a fully sharded exchange").step(&mut self.optimizer)?;
                if let Some(stream) = on_comm_stream {
                    stream.restore()?;
                }
            }
            Gradients::Applied(_) | Gradients::AppliedOnDevice => faults.after_exchange(),
        }
        Ok(())
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
        let (holders, count) = match self.layout.part_replicas() {
            Some(replicas) => (&replicas.comm, replicas.size as usize),
            None => (&self.workers_comm, self.workers),
        };
        average_over(holders, &buffers, true, count)?;
        let (test_loss, accuracy) = match &self.layout.part {
            Part::Whole { .. } => self.whole_evaluate(&state.norm)?,
            Part::Stage(_) => self.pipeline_evaluate(&state.norm)?,
            Part::Units(_) => self.fsdp_evaluate(&state.norm)?,
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
        self.args.checkpoint_dir.is_some() && last_step.is_multiple_of(self.args.checkpoint_every)
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
        let replicas = self.layout.part_replicas().unwrap_or(self.world);
        let fault = self.faults.in_write(self.world.rank, last_step);
        let written = save_sharded_checkpoint(self.world, dir, retention, &self.net, self.exchange.as_mut(), &self.optimizer, meta, replicas, self.layout.tensor.as_ref(), fault)?;
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
        let Some(replicas) = self.layout.part_replicas().or(self.layout.fsdp().map(|_| self.world)) else {
            return self.world.agree(if self.world.is_root() { save_weights(&self.net, path) } else { Ok(()) });
        };
        let meta = checkpoint_meta(self.args, self.world, &self.plan, &self.info, &self.dataset_fingerprint, self.steps_per_epoch, self.total_steps, last_step, self.optimizer.steps());
        save_weights_in_parts(self.world, path, &self.net, self.exchange.as_mut(), &self.optimizer, meta, replicas, self.layout.tensor.as_ref())
    }
}

/// Dynamic loss scaling for fp16, as torch.cuda.amp.GradScaler: the loss is multiplied by
/// `scale` so that small gradients survive fp16's backward; the optimizer unscales the averaged
/// gradients as it steps (`Optimizer::unscale_by`). Where any rank's gradients are not finite,
/// every rank skips the step and the scale halves; after `growth_interval` good steps in a row
/// it doubles. Every rank decides alike (the step's `decide`).
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
    /// Whether this step steps: `finite_here` (this rank's gradients) on every rank of `world`
    /// (collective over it). A skip halves the scale and is logged to `progress` where given
    /// (rank 0's); a run of good steps doubles it.
    pub(super) fn agree(&mut self, finite_here: bool, world: &World, step: u64, progress: Option<&Progress>) -> bool {
        let here = i32::from(finite_here);
        let mut everywhere = 0;
        let comm = &world.comm;
        crate::watchdog::collective("the loss scaler's overflow agreement", comm, || comm.all_reduce_into(&here, &mut everywhere, SystemOperation::min()));
        if everywhere == 0 {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
            self.skipped += 1;
            if let Some(progress) = progress {
                progress.suspend(|| log::info!("fp16: gradients overflowed at step {step}; step skipped, loss scale now {}", self.scale));
            }
            return false;
        }
        self.good_steps += 1;
        if self.good_steps == self.growth_interval {
            self.scale *= 2.0;
            self.good_steps = 0;
        }
        true
    }
}

/// Test hook (`infgrad` fault): one element of the first gradient that has any becomes +inf.
pub(super) fn inject_inf(grads: &[Tensor]) -> Result<()> {
    if let Some(g) = grads.iter().find(|g| g.defined() && g.numel() > 0) {
        tch::no_grad(|| g.f_view([-1])?.f_get(0)?.f_fill_(f64::INFINITY).map(drop))?;
    }
    Ok(())
}
