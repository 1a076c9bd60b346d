//! The forward and backward of a rank that computes whole layers ([`Part::Whole`]: a replica of
//! the model, or a tensor-parallel part of one): backward then the exchange, or the exchange
//! bucket by bucket beside backward (`--overlap`), or on one GPU rank everything left unread on
//! the device; and the evaluation of such a rank. The rest of the step is step.rs's.

use std::path::Path;
use std::time::Instant;

use mpi::topology::SimpleCommunicator;
use tch::nn::ModuleT;
use tch::{Kind, Reduction, Tensor};

use crate::data::loader::Batch;
use crate::data::reader::SplitReader;
use crate::data::{DatasetInfo, Labels, Split};
use crate::error::Result;
use crate::optim;
use crate::plan::shard::ShardInfo;

use super::collective::sum_pair;
use super::layout::Part;
use super::net::{Net, Normalizer};
use super::progress::PendingLoss;
use super::run::Run;
use super::step::{Backward, Gradients, LoopState, PassLoss};
use super::step_faults::StepFaults;

impl Run<'_> {
    /// Forward on this rank's samples, then backward: alone (the gradients stay this rank's
    /// for the step to exchange), with the exchange and the optimizer bucket by bucket beside
    /// it (an overlapped step without a loss scaler: the gradients come back applied), or with
    /// the exchange alone beside it (with the scaler, which must see every averaged gradient
    /// before any step). On one GPU rank ([`super::step::DeferredChecks`]) the gradients'
    /// check and the update run under the device's flag, and nothing is read.
    pub(super) fn whole_pass(&mut self, batch: &Batch, factor: f64, faults: &StepFaults, state: &mut LoopState, step: u64) -> Result<Backward> {
        let overlapped = self.layout.overlap().is_some() && self.overlap_choice.overlaps_at(step);
        // Backward hands its gradients over (none are zeroed to be added into), but those that
        // are views into the overlap's bucket buffers, zeroed there. The handles live for this
        // step only: after ZeRO stage 2 lets go of a gradient, no handle may keep its memory.
        match (self.layout.overlap(), overlapped) {
            (Some(overlap), true) => overlap.prepare_grads(&self.net.params)?,
            _ => optim::release_grads(&self.net.params)?,
        }
        let n = batch.samples();
        let scaler = state.scaler.is_some();
        let backward = |loss: Option<Tensor>, gradients: Gradients| Backward { loss: loss.map_or(PassLoss::Read(0.0), PassLoss::Tensor), samples: n, gradients, exchange_total: Default::default(), exchange_exposed: Default::default() };
        if n == 0 {
            return Ok(backward(None, Gradients::Local(optim::defined_grads(&self.net.params)?)));
        }
        faults.forward()?;
        let loss = self.forward(&state.norm, batch)?;
        let scaled = loss.f_mul_scalar(faults.loss_factor(factor))?;
        let loss = loss.f_detach()?;
        if overlapped {
            let Part::Whole { overlap: Some(overlap) } = &mut self.layout.part else { unreachable!("overlapped: the layout has an overlap") };
            // The bucket buffers' views that prepare_grads attached, reduced in place.
            let mut grads = self.net.grads();
            let (times, finite) = overlap.step(scaled, &mut self.net.params, &mut grads, self.exchange.as_mut(), &mut self.optimizer, step, batch.epoch, !scaler)?;
            let gradients = if scaler { Gradients::Reduced(grads) } else { Gradients::Applied(finite) };
            return Ok(Backward { exchange_total: times.exchange, exchange_exposed: times.exposed, ..backward(Some(loss), gradients) });
        }
        scaled.f_backward()?;
        // What backward handed over, zeros where it made none.
        let grads = optim::defined_grads(&self.net.params)?;
        match state.deferred.as_ref().filter(|_| !scaler) {
            Some(deferred) => {
                optim::flag_not_finite(&grads, &deferred.not_finite)?;
                // The host's time to queue the update: the exchange's, as the step counts it.
                let started = Instant::now();
                self.optimize_unread(grads, &deferred.not_finite)?;
                let update = started.elapsed();
                let pending = PendingLoss { loss, not_finite: deferred.not_finite.f_detach_copy()?, injected_nan: faults.nan_loss(), step, epoch: batch.epoch };
                Ok(Backward { loss: PassLoss::Deferred(pending), exchange_total: update, exchange_exposed: update, ..backward(None, Gradients::AppliedOnDevice) })
            }
            None => Ok(backward(Some(loss), Gradients::Local(grads))),
        }
    }

    /// On one GPU rank: the exchange's update (the identity's average, then the step) under
    /// the device's flag, which the fused optimizers read on the device and change nothing
    /// under: no weight takes a non-finite update while the host does not yet know.
    fn optimize_unread(&mut self, mut grads: Vec<Tensor>, flag: &Tensor) -> Result<()> {
        self.optimizer.skip_if(Some(flag.shallow_clone()));
        let updated = self.exchange.update(&mut self.net.params, &mut grads, &mut self.optimizer);
        self.optimizer.skip_if(None);
        updated
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

    /// Test loss and accuracy of whole layers over all workers' shards of the test set (a
    /// tensor-parallel group's ranks evaluate the same samples; the first counts them).
    pub(super) fn whole_evaluate(&self, norm: &Normalizer) -> Result<(f64, f64)> {
        let counted = self.layout.tensor.as_ref().is_none_or(|tp| tp.rank == 0);
        evaluate(&self.net, norm, &self.args.data, &self.info, &self.labels, &self.workers_comm, self.worker, self.workers, self.plan.batch, counted)
    }
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
