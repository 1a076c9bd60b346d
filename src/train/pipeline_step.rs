//! The pipelined run's own steps on the [`Run`]: one step through the stage's schedule then the
//! exchange among the stage's replicas, the evaluation through the stages, and the whole model
//! gathered for --save-weights. The stage itself (its schedule's executor, messages, figures,
//! checkpoints) is pipeline.rs, which the run holds.

use std::time::{Duration, Instant};

use tch::{Kind, Reduction, Tensor};

use crate::data::reader::SplitReader;
use crate::data::{DatasetInfo, Labels, Split};
use crate::error::{Error, Result};
use crate::exchange::staging::synchronize_device;
use crate::exchange::ReduceOp;
use crate::optim;
use crate::plan::shard::ShardInfo;

use super::collective::sum_pair;
use super::net::Normalizer;
use super::progress::Timings;
use super::run::Run;
use super::progress::StepLoss;
use super::step::{inject_inf, LoopState, StepDone};
use super::step_faults::StepFaults;

impl Run<'_> {
    /// One pipelined step: the stage's schedule over the micro-batches, then the exchange of
    /// the accumulated gradients among the stage's replicas and the optimizer step.
    pub(super) fn pipeline_step(&mut self, step: u64, state: &mut LoopState) -> Result<StepDone> {
        let tensor_parallel_before = self.tensor_parallel.as_ref().map(|tp| tp.counts());
        let (batch, data_wait) = self.begin_step(step, state)?;
        // Test hooks (HPC_TRAIN_FAULT), as in the plain step: the schedule's messages are the
        // step's first communication, so a stall comes before it.
        let faults = StepFaults::begin(&self.faults, self.world.rank, step);
        faults.before_exchange();
        let compute_start = Instant::now();
        let mut grads = self.net.grads();
        optim::zero_grads(&mut grads)?;
        // Every stage takes the same samples; the loader read only the parts this stage uses.
        let n = batch.samples();
        // With fp16's loss scaler the last stage's loss is scaled, and so every gradient that
        // flows back through the stages.
        let factor = self.loss_factor(batch.global_samples, state.scaler.as_ref());
        let pipeline = self.pipeline.as_mut().expect("a pipelined run");
        let (image_bytes, labels_read) = batch.read();
        pipeline.data_read.train_image_bytes += image_bytes as u64;
        pipeline.data_read.train_labels += labels_read as u64;
        let images = if pipeline.first_stage() && n > 0 { Some(state.norm.images(batch.images(), n)?) } else { None };
        let labels = if pipeline.last_stage() && n > 0 { Some(state.norm.labels(batch.labels())?) } else { None };
        let measured = step >= state.warmup;
        let loss_sum = pipeline.run_schedule(&self.net.chunks, &self.net.params, n, images.as_ref(), labels.as_ref(), factor, self.args.recipe.label_smoothing, self.args.precision, step, measured, &faults)?;
        let last_stage = pipeline.last_stage();
        // `nan` on any stage: this rank reads its loss as NaN (only the last stage has one to read).
        if !loss_sum.is_finite() || faults.nan_loss() {
            return Err(Error::NonFinite { what: "loss", step, epoch: batch.epoch });
        }
        grads = self.net.grads();
        if faults.nan_gradients() {
            // `nangrad`: this stage's own gradients, whichever stage it is (the loss factor
            // reaches only the last stage's). A stage without parameters has none to spoil.
            tch::no_grad(|| grads.iter().filter(|g| g.defined()).try_for_each(|g| g.shallow_clone().f_fill_(f64::NAN).map(drop)))?;
        }
        if state.scaler.is_some() && faults.inf_gradient() {
            inject_inf(&grads)?;
        }
        // Without a loss scaler a gradient that is not finite ends the run; with one, the
        // scaler skips the step (below).
        if state.scaler.is_none() && !optim::grads_finite(&mut grads)? {
            return Err(Error::NonFinite { what: "gradient", step, epoch: batch.epoch });
        }
        let compute = compute_start.elapsed();
        let comm_start = Instant::now();
        // A stage without parameters (the tiny CNN's pooling) has nothing to exchange or step.
        let has_params = !self.net.params.is_empty();
        {
            let exchange = &mut self.exchange;
            let _watched = crate::watchdog::exchange(exchange.name(), || exchange.waits_for());
            match &mut state.scaler {
                None if has_params => exchange.update(&mut self.net.params, &mut grads, &mut self.optimizer)?,
                None => {}
                Some(scaler) => {
                    // The stage's replicas average first (the same gradients on each), then
                    // every rank of every stage (and tensor-parallel group) agrees whether to
                    // step: each stage holds other parameters, any of which may overflow, and
                    // one stage stepping while another skips would part the model's halves.
                    if has_params {
                        exchange.all_reduce(&mut grads, ReduceOp::Mean)?;
                    }
                    let stepped = scaler.unscale_or_skip(&mut grads, Some(self.world), step, self.world.is_root().then_some(&state.progress))?;
                    if stepped && has_params {
                        self.optimizer.step(&mut self.net.params, &mut grads)?;
                    }
                }
            }
        }
        faults.after_exchange();
        synchronize_device(self.plan.device);
        let comm = comm_start.elapsed();
        let optimizer = self.optimizer.take_busy();
        let comm = comm.saturating_sub(optimizer);
        if let (Some(tp), Some(before)) = (&mut self.tensor_parallel, tensor_parallel_before) {
            tp.note_step(&before, measured);
        }
        let timings = Timings { steps: 1, samples: batch.global_samples as u64, data_wait, compute, comm, optimizer, step: Duration::ZERO, exchange_total: comm, exchange_exposed: comm };
        // The loss and its samples count once, on the stage that computes them.
        Ok(StepDone { timings, loss: StepLoss::Read(loss_sum), samples: if last_stage { n } else { 0 }, epoch: batch.epoch })
    }

    /// Test loss and accuracy through the pipelines (the batch-norm statistics averaged first,
    /// by evaluate_epoch): each replica evaluates its share of the
    /// test set in micro-batches of training's size, pipelined through the stages (forwards
    /// only: stage p on micro-batch m while stage p + 1 is on m - 1), the first stage reading
    /// the images and the last scoring against the labels. Batch norm uses its running
    /// statistics, so the values are one process's whatever the micro-batches (up to the
    /// order of f32 sums).
    pub(super) fn pipeline_evaluate(&mut self, norm: &Normalizer) -> Result<(f64, f64)> {
        let pipeline = self.pipeline.as_mut().expect("a pipelined run");
        let (info, labels): (&DatasetInfo, &Labels) = (&self.info, &self.labels);
        let shard = ShardInfo::split(info.test.len, self.workers, pipeline.replica);
        let size = self.plan.batch.div_ceil(pipeline.shape().micro_batches).max(1);
        let micro: Vec<ShardInfo> = (shard.offset..shard.end()).step_by(size).map(|offset| ShardInfo { offset, len: size.min(shard.end() - offset) }).collect();
        let mut reader = if pipeline.first_stage() { Some(SplitReader::open(&self.args.data, Split::Test)?) } else { None };
        let (mut loss_sum, mut correct) = (0.0, 0.0);
        let (mut image_bytes, mut labels_scored) = (0usize, 0usize);
        let mut bytes = Vec::new();
        let input = |m: usize| -> Result<Tensor> {
            let indices: Vec<usize> = micro[m].range().collect();
            bytes.resize(indices.len() * info.sample_bytes(), 0);
            reader.as_mut().expect("the first stage reads the images").read(&indices, &mut bytes)?;
            image_bytes += bytes.len();
            norm.images_from_bytes(&bytes, indices.len())
        };
        let score = |m: usize, logits: &Tensor| -> Result<()> {
            let target = norm.labels(&labels.test[micro[m].range()])?;
            labels_scored += micro[m].len;
            loss_sum += logits.f_cross_entropy_loss::<Tensor>(&target, None, Reduction::Sum, -100, 0.0)?.f_double_value(&[])?;
            correct += logits.f_argmax(-1, false)?.f_eq_tensor(&target)?.f_sum(Kind::Float)?.f_double_value(&[])?;
            Ok(())
        };
        tch::no_grad(|| pipeline.run_forwards(&self.net.chunks, &micro, input, score))?;
        pipeline.data_read.test_image_bytes += image_bytes as u64;
        pipeline.data_read.test_labels += labels_scored as u64;
        // A tensor-parallel group's ranks score the same samples; the first counts them.
        let counted = self.tensor_parallel.as_ref().is_none_or(|tp| tp.rank == 0);
        let (loss_sum, correct) = if counted { (loss_sum, correct) } else { (0.0, 0.0) };
        let (loss_sum, correct) = sum_pair(&self.world.comm, loss_sum, correct);
        let n = info.test.len as f64;
        Ok((loss_sum / n, correct / n))
    }

    /// The ranks the pipelines run over: the world, or with tensor parallelism the ranks of
    /// this rank's place in the groups.
    pub(super) fn pipeline_world(&self) -> &crate::topology::World {
        self.tensor_parallel.as_ref().map_or(self.world, |tp| &tp.plane)
    }
}

