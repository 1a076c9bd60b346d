//! Overlapping the gradient exchange with the backward pass, as PyTorch DDP and Horovod do.
//!
//! Each parameter carries a post-accumulate-grad hook (src/shim/grad_hooks.cpp) that reports
//! when its gradient is final. Backward runs on a helper thread; this thread, which makes the
//! MPI calls, counts the reports into buckets (reverse parameter order, the first one small)
//! and exchanges each bucket the moment it is complete, then steps the optimizer for that
//! bucket's parameters only, while backward goes on with the earlier layers.
//!
//! Buckets are exchanged in plan order on every rank (collectives must match), so a bucket that
//! completes early waits for the ones before it. A parameter that the step did not use never
//! reports; when backward ends, what is left counts as ready (its gradient stays zero).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tch::Tensor;

use crate::error::{Error, Result};
use crate::exchange::buckets::{pack, unpack, BucketPlan};
use crate::exchange::{Exchange, ReduceOp};
use crate::optim::Sgd;
use crate::raw::{GradEvent, GradReady, GradReadyHooks};

/// DDP's first bucket: small, so that communication starts early in the backward pass.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Timings of one overlapped step.
#[derive(Clone, Copy, Debug, Default)]
pub struct OverlapTimes {
    /// Backward, from its start to its end.
    pub backward: Duration,
    /// Time spent exchanging buckets (the strategy's all-reduce).
    pub exchange: Duration,
    /// Part of the step after backward ended (exchange and optimizer not hidden).
    pub exposed: Duration,
}

pub struct Overlap {
    _hooks: GradReadyHooks,
    ready: Receiver<GradReady>,
    plan: BucketPlan,
    bucket_of: Vec<usize>,
    /// Fusion buffer of each bucket of several tensors (None: reduced in place).
    buffers: Vec<Option<Tensor>>,
}

impl Overlap {
    pub fn new(params: &[Tensor], bucket_bytes: usize) -> Result<Overlap> {
        let (sender, ready) = channel();
        let hooks = GradReadyHooks::register(params, sender)?;
        let sizes: Vec<usize> = params.iter().map(|p| p.numel()).collect();
        let kind = params.first().map_or(tch::Kind::Float, |p| p.kind());
        let plan = BucketPlan::new(&sizes, kind.elt_size_in_bytes(), bucket_bytes, Some(FIRST_BUCKET_BYTES.min(bucket_bytes.max(1))));
        let bucket_of = plan.bucket_of();
        let buffers = plan
            .buckets
            .iter()
            .map(|b| (b.slots.len() > 1).then(|| params[0].f_new_zeros([b.len as i64], (kind, params[0].device()))).transpose())
            .collect::<std::result::Result<_, _>>()?;
        Ok(Overlap { _hooks: hooks, ready, plan, bucket_of, buffers })
    }

    pub fn buckets(&self) -> usize {
        self.plan.buckets.len()
    }

    /// Backward of `loss` (already scaled) overlapped with the exchange of the gradients and,
    /// with `optimize`, the optimizer step: the parameters are updated when it returns.
    pub fn step(
        &mut self,
        loss: Tensor,
        params: &mut [Tensor],
        grads: &mut [Tensor],
        exchange: &mut dyn Exchange,
        sgd: &mut Sgd,
        step: u64,
        epoch: u64,
        optimize: bool,
    ) -> Result<OverlapTimes> {
        // Reports left over from an earlier, failed step must not count.
        while self.ready.try_recv().is_ok() {}
        let mut missing: Vec<usize> = self.plan.buckets.iter().map(|b| b.slots.len()).collect();
        let mut events: Vec<Option<GradEvent>> = (0..missing.len()).map(|_| None).collect();
        let mut next = 0;
        let mut times = OverlapTimes::default();

        let started = Instant::now();
        let backward = std::thread::Builder::new()
            .name("backward".into())
            .spawn(move || {
                let result = loss.f_backward();
                (result, started.elapsed())
            })
            .expect("spawning the backward thread");
        let mut backward_done: Option<Instant> = None;

        while next < missing.len() {
            match self.ready.recv_timeout(Duration::from_millis(1)) {
                Ok(GradReady { index, event }) => {
                    let b = self.bucket_of[index];
                    missing[b] = missing[b].saturating_sub(1);
                    if event.is_some() {
                        events[b] = event; // one stream: the latest event covers the earlier ones
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if backward_done.is_none() && backward.is_finished() {
                        backward_done = Some(Instant::now());
                        // Parameters the step did not use never report: they are ready now.
                        while let Ok(GradReady { index, event }) = self.ready.try_recv() {
                            let b = self.bucket_of[index];
                            missing[b] = missing[b].saturating_sub(1);
                            if event.is_some() {
                                events[b] = event;
                            }
                        }
                        missing.iter_mut().for_each(|m| *m = 0);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(Error::exchange("overlap", "the gradient hooks are gone")),
            }
            // Exchange, in plan order, every bucket that is complete.
            while next < missing.len() && missing[next] == 0 {
                if let Some(event) = events[next].take() {
                    event.synchronize()?;
                }
                let t = Instant::now();
                self.exchange_bucket(next, grads, exchange, optimize).map_err(|e| match e {
                    Error::NonFinite { what, .. } => Error::NonFinite { what, step, epoch },
                    other => other,
                })?;
                times.exchange += t.elapsed();
                if optimize {
                    let which: Vec<usize> = self.plan.buckets[next].slots.iter().map(|s| s.tensor).collect();
                    sgd.step_some(params, grads, &which)?;
                }
                next += 1;
            }
        }
        let (result, backward_time) = backward.join().map_err(|_| Error::exchange("overlap", "the backward thread panicked"))?;
        result?;
        if optimize {
            sgd.count_step();
        }
        times.backward = backward_time;
        let end = Instant::now();
        times.exposed = end.saturating_duration_since(backward_done.unwrap_or(started + backward_time).min(end));
        Ok(times)
    }

    /// Averages bucket `b`'s gradients over the workers, in place in the gradients
    /// (`check_finite`: refuse non-finite gradients first; off under a loss scaler, which
    /// expects them now and then).
    fn exchange_bucket(&mut self, b: usize, grads: &mut [Tensor], exchange: &mut dyn Exchange, check_finite: bool) -> Result<()> {
        let bucket = &self.plan.buckets[b];
        if check_finite && !crate::train::all_finite(&bucket.slots.iter().map(|s| grads[s.tensor].shallow_clone()).collect::<Vec<_>>())? {
            return Err(Error::NonFinite { what: "gradient", step: 0, epoch: 0 });
        }
        match &mut self.buffers[b] {
            None => {
                let mut flat = [crate::raw::flat_dense_view(&grads[bucket.slots[0].tensor])?];
                exchange.all_reduce(&mut flat, ReduceOp::Mean)
            }
            Some(buffer) => {
                pack(bucket, grads, buffer);
                let mut flat = [buffer.shallow_clone()];
                exchange.all_reduce(&mut flat, ReduceOp::Mean)?;
                unpack(bucket, buffer, grads);
                Ok(())
            }
        }
    }
}
