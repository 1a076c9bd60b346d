//! A pipeline stage's part of the one step (step.rs) on the [`Run`]: its forward and backward
//! through the stage's schedule, and the evaluation through the stages. The stage itself (its
//! schedule's executor, messages, figures, checkpoints) is pipeline.rs, which the run's layout
//! holds.

use std::time::{Duration, Instant};

use tch::{Kind, Reduction, Tensor};

use crate::data::loader::Batch;
use crate::data::reader::SplitReader;
use crate::data::{DatasetInfo, Labels, Split};
use crate::error::Result;
use crate::exchange::strategy::UnitTimes;
use crate::optim::{self, FiniteCheck};
use crate::plan::shard::ShardInfo;

use super::collective::sum_pair;
use super::net::Normalizer;
use super::pipeline::StageOverlap;
use super::run::Run;
use super::step::{inject_inf, Backward, Gradients, LoopState, PassLoss};
use super::step_faults::StepFaults;

impl Run<'_> {
    /// A pipeline stage's forward and backward: its schedule over the micro-batches, which
    /// leaves the stage's gradients accumulated for the step to exchange among its replicas,
    /// or with overlap exchanges them beside each chunk's last backward (and without a loss
    /// scaler, which must see every averaged gradient before any step, applies them bucket by
    /// bucket, as an overlapped plain step does: whole_step.rs).
    /// Every stage takes the same samples; the loader read only the parts this stage uses.
    /// With fp16's loss scaler in `factor`, the last stage's loss is scaled, and so every
    /// gradient that flows back through the stages.
    pub(super) fn stage_pass(&mut self, batch: &Batch, factor: f64, faults: &StepFaults, state: &mut LoopState, step: u64) -> Result<Backward> {
        // `nangrad` spoils the gradients after the schedule, where only an exchange after it
        // would see them: that step runs without overlap.
        let overlapped = self.layout.overlap().is_some() && self.overlap_choice.overlaps_at(step) && !faults.nan_gradients();
        match (self.layout.overlap(), overlapped) {
            // Views into the buckets' buffers, zeroed; the other gradients let go.
            (Some(overlap), true) => overlap.prepare_grads(&self.net.params)?,
            _ => optim::zero_grads(&mut self.net.grads())?,
        }
        let n = batch.samples();
        let scaler = state.scaler.is_some();
        let pipeline = self.layout.pipeline_mut().expect("a pipelined run");
        let (image_bytes, labels_read) = batch.read();
        pipeline.data_read.train_image_bytes += image_bytes as u64;
        pipeline.data_read.train_labels += labels_read as u64;
        let images = if pipeline.first_stage() && n > 0 { Some(state.norm.images(batch.images(), n)?) } else { None };
        let labels = if pipeline.last_stage() && n > 0 { Some(state.norm.labels(batch.labels())?) } else { None };
        let measured = step >= state.warmup;
        let (chunks, params, smoothing, precision) = (&self.net.chunks, &mut self.net.params, self.args.recipe.label_smoothing, self.args.precision);
        if overlapped {
            let mut overlap = pipeline.overlap.take().expect("overlapped: the stage has an overlap");
            let mut grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            let mut finite = FiniteCheck::default();
            let mut stage = StageOverlap { overlap: &mut overlap, grads: &mut grads, exchange: self.exchange.as_mut(), optimizer: &mut self.optimizer, finite: (!scaler).then_some(&mut finite), times: Default::default() };
            let result = pipeline.run_schedule(chunks, params, n, images.as_ref(), labels.as_ref(), factor, smoothing, precision, step, measured, faults, Some(&mut stage));
            let result = result.and_then(|loss_sum| {
                stage.overlap.end_step(params, stage.optimizer, !scaler)?;
                Ok(loss_sum)
            });
            let times = stage.times;
            pipeline.overlap = Some(overlap);
            let loss_sum = result.map_err(|e| crate::overlap::at_step(e, step, batch.epoch))?;
            let samples = if pipeline.last_stage() { n } else { 0 };
            let gradients = if scaler { Gradients::Reduced(grads) } else { Gradients::Applied(finite) };
            return Ok(Backward { loss: PassLoss::Read(loss_sum), samples, gradients, exchange_total: times.exchange, exchange_exposed: times.exposed });
        }
        // The loss and its samples count once, on the stage that computes them.
        let samples = if pipeline.last_stage() { n } else { 0 };
        if pipeline.shards_parameters {
            // --zero 3: the stage gathered whole for its schedule, its gradients reduce-scattered
            // after it (the micro-batches reuse the one gather, as torchtitan's FSDP under
            // pipelining), and its parameters let go.
            let shards = self.exchange.fully_sharded().expect("--zero 3 builds a fully sharded exchange");
            let started = Instant::now();
            let gathered = shards.gather(0)?;
            shards.install(0, &gathered, params)?;
            let gather = started.elapsed();
            let loss_sum = pipeline.run_schedule(chunks, params, n, images.as_ref(), labels.as_ref(), factor, smoothing, precision, step, measured, faults, None)?;
            let started = Instant::now();
            let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
            spoil_gradients(&grads, faults, scaler)?;
            let mut finite = FiniteCheck::default();
            shards.pack_grads(0, params, &mut finite)?;
            shards.release(0, params)?;
            shards.reduce(0)?;
            shards.free_buffers();
            let reduce = started.elapsed();
            shards.note_step(UnitTimes { gather, exposed_gather: gather, reduce, exposed_reduce: reduce });
            let exchanged = gather + reduce;
            return Ok(Backward { loss: PassLoss::Read(loss_sum), samples, gradients: Gradients::Shards(finite), exchange_total: exchanged, exchange_exposed: exchanged });
        }
        let loss_sum = pipeline.run_schedule(chunks, params, n, images.as_ref(), labels.as_ref(), factor, smoothing, precision, step, measured, faults, None)?;
        // Zeros where a parameter got none (an overlapped step lets some go before backward).
        let grads = optim::defined_grads(&self.net.params)?;
        // (`infgrad` with the loss scaler: the step spoils whole gradients itself.)
        spoil_gradients(&grads, faults, false)?;
        Ok(Backward { loss: PassLoss::Read(loss_sum), samples, gradients: Gradients::Local(grads), exchange_total: Duration::ZERO, exchange_exposed: Duration::ZERO })
    }

    /// Test loss and accuracy through the pipelines (the batch-norm statistics averaged first,
    /// by evaluate_epoch): each replica evaluates its share of the
    /// test set in micro-batches of training's size, pipelined through the stages (forwards
    /// only: stage p on micro-batch m while stage p + 1 is on m - 1), the first stage reading
    /// the images and the last scoring against the labels. Batch norm uses its running
    /// statistics, so the values are one process's whatever the micro-batches (up to the
    /// order of f32 sums).
    pub(super) fn pipeline_evaluate(&mut self, norm: &Normalizer) -> Result<(f64, f64)> {
        let pipeline = self.layout.pipeline_mut().expect("a pipelined run");
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
        // --zero 3: the stage gathered whole for the evaluation's forwards, then let go.
        let mut shards = if pipeline.shards_parameters { self.exchange.fully_sharded() } else { None };
        if let Some(shards) = shards.as_deref_mut() {
            let gathered = shards.gather(0)?;
            shards.install(0, &gathered, &self.net.params)?;
        }
        tch::no_grad(|| pipeline.run_forwards(&self.net.chunks, &micro, input, score))?;
        if let Some(shards) = shards {
            shards.release(0, &self.net.params)?;
            shards.free_buffers();
        }
        pipeline.data_read.test_image_bytes += image_bytes as u64;
        pipeline.data_read.test_labels += labels_scored as u64;
        // A tensor-parallel group's ranks score the same samples; the first counts them.
        let counted = self.layout.tensor.as_ref().is_none_or(|tp| tp.rank == 0);
        let (loss_sum, correct) = if counted { (loss_sum, correct) } else { (0.0, 0.0) };
        let (loss_sum, correct) = sum_pair(&self.world.comm, loss_sum, correct);
        let n = info.test.len as f64;
        Ok((loss_sum / n, correct / n))
    }

    /// The ranks the pipelines run over: the world, or with tensor parallelism the ranks of
    /// this rank's place in the groups.
    pub(super) fn pipeline_world(&self) -> &crate::topology::World {
        self.layout.tensor.as_ref().map_or(self.world, |tp| &tp.plane)
    }
}

/// The test hooks that spoil a stage's own gradients after its schedule, whichever stage it is
/// (the loss factor reaches only the last stage's): `nangrad` makes them NaN; `infgrad` with
/// the loss scaler (`overflow`: where the step does not spoil them itself) makes one +inf, as
/// an fp16 overflow. A stage without parameters has none to spoil.
fn spoil_gradients(grads: &[Tensor], faults: &StepFaults, overflow: bool) -> Result<()> {
    if faults.nan_gradients() {
        tch::no_grad(|| grads.iter().filter(|g| g.defined()).try_for_each(|g| g.shallow_clone().f_fill_(f64::NAN).map(drop)))?;
    }
    if overflow && faults.inf_gradient() {
        inject_inf(grads)?;
    }
    Ok(())
}
