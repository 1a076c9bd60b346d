//! Overlapping the gradient exchange with the backward pass, as PyTorch DDP and Horovod do.
//!
//! Each parameter carries a post-accumulate-grad hook (src/shim/grad_hooks.cpp) that reports
//! when its gradient is final. Backward runs on a helper thread started once; this thread, which
//! makes the MPI calls, blocks on one channel that carries both the hooks' reports and the end of
//! backward, counts the reports into buckets (reverse parameter order, the first one small) and
//! exchanges each bucket the moment it is complete, then steps the optimizer for that bucket's
//! parameters only, while backward goes on with the earlier layers.
//!
//! A pipeline stage (train/pipeline.rs) runs only each chunk's last backward this way, the
//! one after which the chunk's gradients are final: its buckets are planned per chunk
//! (segments) and exchanged beside that backward; what is left when it ends waits until the
//! stage has sent the chunk's input gradient upstream ([`Overlap::backward_segment`],
//! [`Overlap::finish_segment`]). The earlier micro-batches' backwards fire the hooks too: their
//! reports are dropped before the last one starts.
//!
//! Buckets are exchanged in plan order on every rank (collectives must match), so a bucket that
//! completes early waits for the ones before it. A parameter that the step did not use never
//! reports; when backward ends, what is left counts as ready (its gradient stays zero).
//!
//! The first plan guesses that gradients arrive in reverse creation order. As DDP does, the
//! buckets are rebuilt once, after the first step, from the order in which rank 0 saw them
//! really arrive (branches such as ResNet's downsample convolutions break the guess), so that
//! no bucket waits for a gradient that comes late.
//!
//! A step returns only once backward has ended, on every path (an error included): the hooks'
//! channel lives in `Overlap`, and backward must not call into it after `Overlap` is gone.
//!
//! On a GPU, this thread queues its work (packing, copies, the optimizer, events) on a
//! communication stream of its own for the step, which waits on each bucket's last hook event
//! on the device: on the default stream, each bucket's exchange would wait for every backward
//! kernel launched so far. The gradients' finiteness is gathered on the device and read once,
//! at the step's end ([`FiniteCheck`]); the default stream waits for the communication stream
//! before the next step reads the weights.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::ops::Range;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::exchange::{ReduceOp, Training};
use crate::optim::{FiniteCheck, Optimizer};
use crate::plan::buckets::{Bucket, BucketPlan};
use crate::plan::pipeline::segmented_plan;
use crate::raw::{CudaStream, GradReady, GradReadyHooks, ThreadState};

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

/// What the MPI thread waits for during a step.
enum Report {
    /// A parameter's gradient is final.
    Grad(GradReady),
    /// Backward ended, after `took`.
    BackwardDone { result: Result<()>, took: Duration },
}

impl From<GradReady> for Report {
    fn from(g: GradReady) -> Report {
        Report::Grad(g)
    }
}

pub struct Overlap {
    /// The hooks, and on a GPU each bucket's reused event (its slot is the bucket).
    hooks: GradReadyHooks<Report>,
    reports: Receiver<Report>,
    /// Losses to run backward on, for the backward thread, each with the MPI thread's libtorch
    /// state to run it under.
    jobs: Option<Sender<(Tensor, ThreadState)>>,
    backward_thread: Option<JoinHandle<()>>,
    plan: BucketPlan,
    bucket_of: Vec<usize>,
    /// The flat buffer of each bucket of several tensors, whose parameters' gradients are views
    /// into it (`views`); None for a bucket of one tensor, reduced in place in its gradient.
    buffers: Vec<Option<Tensor>>,
    /// Whether the gradients of a bucket of several tensors are views into its buffer, so that
    /// backward adds where the exchange reads (DDP's `gradient_as_bucket_view`): not under
    /// ZeRO, which packs every bucket into one buffer of its own and (stage 2) lets go of the
    /// gradients.
    views: bool,
    /// The gradients' dtype and device, for the fusion buffers.
    layout: (tch::Kind, Device),
    /// What a plan is made with: element size, bucket caps.
    elem_bytes: usize,
    bucket_bytes: usize,
    /// Until the buckets are rebuilt: the order gradients arrived in, and the communicator
    /// that carries rank 0's order to every rank.
    arrivals: Option<(Vec<usize>, SimpleCommunicator)>,
    /// On a GPU: the stream this (the MPI) thread queues its work on during a step.
    comm_stream: Option<CudaStream>,
    /// Each parameter's segment (a pipeline stage's chunk, by the order in which the chunks'
    /// gradients become final; 0 for all outside pipelines), and each segment's buckets: a
    /// bucket never mixes segments ([`segmented_plan`]).
    segment_of: Vec<usize>,
    segment_buckets: Vec<Range<usize>>,
    /// Whether this step's plan was handed to the exchange (ZeRO's shards, Horovod's keys).
    prepared: bool,
    /// The buckets a pipeline's backward left for [`Overlap::finish_segment`].
    pending: Option<Pending>,
}

/// The buckets `next..end` of a segment, complete, not yet exchanged, and whether each one's
/// gradients recorded their events on the device.
struct Pending {
    next: usize,
    end: usize,
    recorded: Vec<bool>,
}

/// What a bucket's exchange works on: the parameters and their gradients, the run's exchange
/// and optimizer, and where the optimizer steps each bucket's parameters as it is averaged
/// (`finite` given), the local gradients' finiteness, gathered as the buckets go.
pub struct BucketWork<'a> {
    pub params: &'a mut [Tensor],
    pub grads: &'a mut [Tensor],
    pub exchange: &'a mut dyn Training,
    pub optimizer: &'a mut Optimizer,
    pub finite: Option<&'a mut FiniteCheck>,
}

/// An error of a step's exchange with the step and epoch it happened at.
pub fn at_step(e: Error, step: u64, epoch: u64) -> Error {
    match e {
        Error::NonFinite { what, .. } => Error::NonFinite { what, step, epoch },
        other => other,
    }
}

/// Whether every gradient falls into one bucket, in any order: its exchange can only start
/// after the last gradient, so overlap would have nothing to hide behind backward.
pub fn one_bucket(params: &[Tensor], bucket_bytes: usize) -> bool {
    let bytes: usize = params.iter().map(|p| p.numel() * p.kind().elt_size_in_bytes()).sum();
    bytes <= FIRST_BUCKET_BYTES.min(bucket_bytes.max(1))
}

impl Overlap {
    /// `comm`: the ranks that train (a collective runs on it after the first step); `views`:
    /// see [`Overlap::views`].
    pub fn new(params: &[Tensor], bucket_bytes: usize, comm: SimpleCommunicator, views: bool) -> Result<Overlap> {
        Overlap::with_segments(params, &vec![0; params.len()], 1, bucket_bytes, comm, views)
    }

    /// [`Overlap::new`] for a pipeline stage: `segment_of` gives each parameter's segment (of
    /// `segments`), its chunk's place in the order the chunks' gradients become final, whose
    /// buckets [`Overlap::backward_segment`] exchanges.
    pub fn with_segments(params: &[Tensor], segment_of: &[usize], segments: usize, bucket_bytes: usize, comm: SimpleCommunicator, views: bool) -> Result<Overlap> {
        let (sender, reports) = channel();
        let hooks = GradReadyHooks::register(params, sender.clone())?;
        let sizes: Vec<usize> = params.iter().map(|p| p.numel()).collect();
        let (kind, device) = params.first().map_or((tch::Kind::Float, Device::Cpu), |p| (p.kind(), p.device()));
        let (jobs, backward_thread) = start_backward_thread(device, sender)?;
        let mut overlap = Overlap {
            hooks,
            reports,
            jobs: Some(jobs),
            backward_thread: Some(backward_thread),
            plan: BucketPlan { buckets: Vec::new(), sizes: Vec::new() },
            bucket_of: Vec::new(),
            buffers: Vec::new(),
            views,
            layout: (kind, device),
            elem_bytes: kind.elt_size_in_bytes(),
            bucket_bytes,
            arrivals: Some((Vec::with_capacity(sizes.len()), comm)),
            comm_stream: CudaStream::from_pool(device)?,
            segment_of: segment_of.to_vec(),
            segment_buckets: vec![0..0; segments],
            prepared: false,
            pending: None,
        };
        let reverse: Vec<usize> = (0..sizes.len()).rev().collect();
        overlap.make_plan(params, &reverse)?;
        Ok(overlap)
    }

    /// Buckets walking the tensors in `order`, and with `views` their buffers, the parameters'
    /// gradients made views into them (their values carried over).
    fn make_plan(&mut self, params: &[Tensor], order: &[usize]) -> Result<()> {
        let sizes: Vec<usize> = params.iter().map(|p| p.numel()).collect();
        let first = Some(FIRST_BUCKET_BYTES.min(self.bucket_bytes.max(1)));
        let segments = self.segment_buckets.len();
        (self.plan, self.segment_buckets) = segmented_plan(&sizes, &self.segment_of, segments, order, self.elem_bytes, self.bucket_bytes, first);
        self.bucket_of = self.plan.bucket_of();
        self.hooks.set_slots(&self.bucket_of);
        let fused = |b: &Bucket| self.views && b.slots.len() > 1;
        self.buffers = self.plan.buckets.iter().map(|b| fused(b).then(|| Tensor::f_zeros([b.len as i64], self.layout)).transpose()).collect::<std::result::Result<_, _>>()?;
        for b in 0..self.plan.buckets.len() {
            self.attach_views(b, params, true)?;
        }
        Ok(())
    }

    /// Makes bucket `b`'s gradients the views into its buffer where they are not already (the
    /// set-up's gradients, a new plan's, or those a step without overlap made), copying their
    /// values in when `keep`. A no-op for a bucket without a buffer.
    fn attach_views(&self, b: usize, params: &[Tensor], keep: bool) -> Result<()> {
        let Some(buffer) = &self.buffers[b] else { return Ok(()) };
        for slot in &self.plan.buckets[b].slots {
            let param = &params[slot.tensor];
            let grad = param.grad();
            let at = buffer.data_ptr() as usize + slot.offset * self.elem_bytes;
            if grad.defined() && grad.data_ptr() as usize == at && grad.stride() == param.stride() {
                continue;
            }
            // The parameter's own strides over its slot: a channels-last weight's gradient is
            // channels-last too, and its slot holds it in storage order, as `pack` would.
            let view = buffer.f_as_strided(param.size(), param.stride(), Some(slot.offset as i64))?;
            if keep && grad.defined() {
                tch::no_grad(|| view.shallow_clone().f_copy_(&grad).map(drop))?;
            }
            crate::raw::set_grad(param, &view)?;
        }
        Ok(())
    }

    /// Before a step's forward: the gradients of buckets with a buffer are their views, zeroed
    /// (one fill per bucket; backward adds into them in place, and nothing is packed or
    /// unpacked); every other gradient is let go, so that backward hands its result over rather
    /// than adding it into zeros (what PyTorch's `zero_grad(set_to_none=True)` lets it do).
    pub fn prepare_grads(&self, params: &[Tensor]) -> Result<()> {
        for (b, (bucket, buffer)) in self.plan.buckets.iter().zip(&self.buffers).enumerate() {
            match buffer {
                Some(buffer) => {
                    self.attach_views(b, params, false)?;
                    tch::no_grad(|| buffer.shallow_clone().f_zero_().map(drop))?;
                }
                None => {
                    for slot in &bucket.slots {
                        crate::raw::release_grad(&params[slot.tensor])?;
                    }
                }
            }
        }
        Ok(())
    }

    /// After the first step: buckets in the order rank 0 saw the gradients arrive (the same plan
    /// on every rank); parameters that never reported go last.
    fn rebuild_from_arrivals(&mut self, params: &[Tensor]) -> Result<()> {
        let Some((seen, comm)) = self.arrivals.take() else { return Ok(()) };
        let n = self.plan.sizes.len();
        let mut order: Vec<u64> = Vec::with_capacity(n);
        let mut placed = vec![false; n];
        for &i in seen.iter().chain((0..n).rev().collect::<Vec<_>>().iter()) {
            if !placed[i] {
                placed[i] = true;
                order.push(i as u64);
            }
        }
        comm.process_at_rank(0).broadcast_into(&mut order[..]);
        let order: Vec<usize> = order.into_iter().map(|i| i as usize).collect();
        let before = self.plan.buckets.len();
        self.make_plan(params, &order)?;
        log::debug!("overlap: {} bucket(s) rebuilt from the gradients' arrival order (were {before})", self.plan.buckets.len());
        Ok(())
    }

    pub fn buckets(&self) -> usize {
        self.plan.buckets.len()
    }

    /// The buckets as planned now (see [`Training::describe_keys`](crate::exchange::Training::describe_keys)).
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// Backward of `loss` (already scaled) overlapped with the exchange of the gradients and,
    /// with `optimize`, the optimizer step: the parameters are updated when it returns. With
    /// `optimize`, the local gradients' finiteness comes back unread (the caller reads it once,
    /// after the step: see [`FiniteCheck`]).
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        loss: Tensor,
        params: &mut [Tensor],
        grads: &mut [Tensor],
        exchange: &mut dyn Training,
        optimizer: &mut Optimizer,
        step: u64,
        epoch: u64,
        optimize: bool,
    ) -> Result<(OverlapTimes, FiniteCheck)> {
        let mut finite = FiniteCheck::default();
        let mut work = BucketWork { params, grads, exchange, optimizer, finite: optimize.then_some(&mut finite) };
        let times = self.run_segment(Some(loss), Some(0), &mut work, false).map_err(|e| at_step(e, step, epoch))?;
        self.end_step(work.params, work.optimizer, optimize)?;
        Ok((times, finite))
    }

    /// A pipeline stage's backward of `loss` (a chunk's output times its gradient, summed) on
    /// the helper thread, while this thread exchanges first the buckets an earlier backward
    /// left (complete), then, where this backward makes segment `segment`'s gradients final
    /// (its chunk's last micro-batch's), that segment's buckets as they complete (with
    /// `work.finite`, stepping the optimizer for each). Returns once backward has ended,
    /// leaving the segment's buckets not yet exchanged for the next backward or
    /// [`Overlap::finish_segment`], so that the caller can first send the chunk's input
    /// gradient upstream. `loss` None: the micro-batch is empty (no backward to run), and the
    /// segment's buckets are all left.
    pub fn backward_segment(&mut self, loss: Option<Tensor>, segment: Option<usize>, work: &mut BucketWork) -> Result<OverlapTimes> {
        self.run_segment(loss, segment, work, true)
    }

    /// Whether buckets are left for the next backward or [`Overlap::finish_segment`].
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The buckets [`Overlap::backward_segment`] left (all complete), exchanged now; the time
    /// it took. Nothing where none are left.
    pub fn finish_segment(&mut self, work: &mut BucketWork) -> Result<Duration> {
        let Some(pending) = self.pending.take() else { return Ok(Duration::ZERO) };
        let started = Instant::now();
        let on_comm_stream = self.comm_stream.as_ref().map(CudaStream::make_current).transpose()?;
        for b in pending.next..pending.end {
            self.exchange_now(b, pending.recorded[b - pending.next], work)?;
        }
        on_comm_stream.map(|s| s.restore()).transpose()?;
        Ok(started.elapsed())
    }

    /// After the step's last segment: the optimizer's step counted where it stepped per bucket,
    /// and after the first step the buckets rebuilt from the order gradients arrived in
    /// (collective over the communicator given to [`Overlap::new`]).
    pub fn end_step(&mut self, params: &[Tensor], optimizer: &mut Optimizer, optimize: bool) -> Result<()> {
        debug_assert!(self.pending.is_none(), "a segment's buckets were left unexchanged");
        if optimize {
            optimizer.count_step();
        }
        self.prepared = false;
        if self.arrivals.is_some() {
            self.rebuild_from_arrivals(params)?;
        }
        Ok(())
    }

    /// Backward of `loss` on the helper thread (none: nothing to run) beside the exchange of
    /// segment `segment`'s buckets; with `leave_rest`, returns as soon as backward has ended
    /// and leaves the buckets not yet exchanged pending. Returns only once backward has ended,
    /// also on an error.
    fn run_segment(&mut self, loss: Option<Tensor>, segment: Option<usize>, work: &mut BucketWork, leave_rest: bool) -> Result<OverlapTimes> {
        // A backward run without overlap since the last report was read (`--overlap auto`'s
        // trial; a pipeline's earlier micro-batches, whose gradients were not final) fired the
        // hooks too: its reports are stale, and counted they would complete buckets early.
        while self.reports.try_recv().is_ok() {}
        let started = Instant::now();
        let mut backward_ended = true;
        if let Some(loss) = loss {
            // Under this thread's state: the profiler's, so that `--profile-dir` sees backward's ops.
            let state = ThreadState::capture()?;
            self.jobs
                .as_ref()
                .expect("the backward thread runs while Overlap lives")
                .send((loss, state))
                .map_err(|_| Error::exchange("overlap", "the backward thread has stopped"))?;
            backward_ended = false;
        }
        let on_comm_stream = self.comm_stream.as_ref().map(CudaStream::make_current).transpose();
        let result = on_comm_stream.and_then(|on_comm_stream| {
            let times = self.exchange_during_backward(segment, work, started, &mut backward_ended, leave_rest)?;
            // The next kernels, on the default stream, read what this stream wrote.
            on_comm_stream.map(|s| s.restore()).transpose()?;
            Ok(times)
        });
        if !backward_ended {
            // An error left the loop while backward still runs: wait for its end, so that no
            // hook fires into a channel or a step that is gone (whatever it reports is moot).
            while let Ok(report) = self.reports.recv() {
                if matches!(report, Report::BackwardDone { .. }) {
                    break;
                }
            }
        }
        result
    }

    /// The body of [`Overlap::run_segment`] after backward has been started; sets
    /// `backward_ended` once backward's end has been received.
    fn exchange_during_backward(&mut self, segment: Option<usize>, work: &mut BucketWork, started: Instant, backward_ended: &mut bool, leave_rest: bool) -> Result<OverlapTimes> {
        if !self.prepared {
            if let Some(zero) = work.exchange.zero() {
                zero.use_plan(&self.plan, work.params, work.optimizer)?;
            }
            work.exchange.describe_keys(&self.plan);
            self.prepared = true;
        }
        let range = segment.map_or(0..0, |s| self.segment_buckets[s].clone());
        let ready = *backward_ended;
        let mut missing: Vec<usize> = self.plan.buckets[range.clone()].iter().map(|b| if ready { 0 } else { b.slots.len() }).collect();
        // Whether a gradient of the bucket recorded its event during this backward.
        let mut recorded = vec![false; range.len()];
        let mut next = range.start;
        let mut times = OverlapTimes::default();
        let mut backward_end = None;
        // What an earlier backward left (complete, in plan order before this segment's).
        if let Some(pending) = self.pending.take() {
            for b in pending.next..pending.end {
                times.exchange += self.exchange_now(b, pending.recorded[b - pending.next], work)?;
            }
        }

        while !*backward_ended {
            // Blocks until a gradient is final or backward ends: no polling.
            match self.reports.recv().map_err(|_| Error::exchange("overlap", "the gradient hooks are gone"))? {
                Report::Grad(GradReady { index, recorded: on_device }) => {
                    let b = self.bucket_of[index];
                    let on_device = on_device.map_err(|e| Error::exchange("overlap", format!("recording bucket {b}'s event: {e}")))?;
                    // A gradient of another segment is not final yet (a pipeline's backward of
                    // an earlier micro-batch of another chunk): neither counted nor an arrival.
                    if range.contains(&b) {
                        if let Some((seen, _)) = &mut self.arrivals {
                            seen.push(index);
                        }
                        missing[b - range.start] = missing[b - range.start].saturating_sub(1);
                        recorded[b - range.start] |= on_device;
                    }
                }
                Report::BackwardDone { result, took } => {
                    *backward_ended = true;
                    // When backward ended, not when this thread got to read it (it may have
                    // been exchanging a bucket): what follows is the exposed part.
                    backward_end = Some(started + took);
                    times.backward = took;
                    result?;
                    // Parameters the step did not use never report: they are ready now.
                    missing.iter_mut().for_each(|m| *m = 0);
                    if leave_rest {
                        break;
                    }
                }
            }
            // Exchange, in plan order, every bucket that is complete.
            while next < range.end && missing[next - range.start] == 0 {
                times.exchange += self.exchange_now(next, std::mem::take(&mut recorded[next - range.start]), work)?;
                next += 1;
            }
        }
        if next < range.end {
            self.pending = Some(Pending { next, end: range.end, recorded: recorded[next - range.start..].to_vec() });
        }
        let end = Instant::now();
        times.exposed = end.saturating_duration_since(backward_end.unwrap_or(started + times.backward).min(end));
        Ok(times)
    }

    /// Exchanges bucket `b`, complete (its gradients' events waited for on the device where
    /// `recorded`), and with `work.finite` steps the optimizer for its parameters; the time of
    /// the exchange (ZeRO's shard step included, the plain optimizer's not).
    fn exchange_now(&mut self, b: usize, recorded: bool, work: &mut BucketWork) -> Result<Duration> {
        if recorded {
            // The communication stream (current here) waits for the bucket's gradients, on
            // the device.
            self.hooks.block_current_on(b, self.layout.1)?;
        }
        let t = Instant::now();
        let exchange = &mut *work.exchange;
        let _watched = crate::watchdog::exchange(exchange.name(), || exchange.waits_for());
        crate::watchdog::set_bucket(b);
        if let Some(zero) = exchange.zero() {
            // ZeRO: reduce-scatter, step this rank's shard, all-gather the weights.
            zero.reduce_bucket(b, work.params, work.finite.as_deref_mut())?;
            zero.step_bucket(b, work.params, work.optimizer)?;
            return Ok(t.elapsed());
        }
        let optimize = work.finite.is_some();
        self.exchange_bucket(b, work.params, work.grads, exchange, work.finite.as_deref_mut())?;
        let took = t.elapsed();
        if optimize {
            let which: Vec<usize> = self.plan.buckets[b].slots.iter().map(|s| s.tensor).collect();
            work.optimizer.step_some(work.params, work.grads, &which)?;
        }
        Ok(took)
    }

    /// Averages bucket `b`'s gradients over the workers, in place in the gradients (`grads`
    /// takes the parameters' gradients of the bucket: views, or what backward handed over, or
    /// zeros for a parameter the step did not use), adding the local ones to `finite` first
    /// (None under a loss scaler, which expects non-finite ones now and then).
    fn exchange_bucket(&mut self, b: usize, params: &[Tensor], grads: &mut [Tensor], exchange: &mut dyn Training, finite: Option<&mut FiniteCheck>) -> Result<()> {
        // Views already (a no-op but for a gradient that a step without overlap made).
        self.attach_views(b, params, true)?;
        let bucket = &self.plan.buckets[b];
        for slot in &bucket.slots {
            grads[slot.tensor] = crate::optim::defined_grad(&params[slot.tensor])?;
        }
        let mut flat = match (&self.buffers[b], bucket.slots.as_slice()) {
            (Some(buffer), _) => buffer.shallow_clone(),
            (None, [one]) => crate::raw::flat_dense_view(&grads[one.tensor])?,
            // Without views the buckets are ZeRO's, which exchanges them itself.
            (None, _) => return Err(Error::exchange("overlap", "a bucket of several tensors has no buffer (made only with views)")),
        };
        if let Some(finite) = finite {
            finite.add(&flat)?;
        }
        exchange.all_reduce_keyed(b, std::slice::from_mut(&mut flat), ReduceOp::Mean)
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        // The hooks (dropped after this) must outlive every backward pass: end the thread first.
        drop(self.jobs.take());
        if let Some(thread) = self.backward_thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread that runs backward, once per step, for the life of `Overlap`: a thread made per
/// step would cost its creation and a new OpenMP team every step. It runs with the MPI thread's
/// intra-op thread count and CUDA device, and reports the end of each backward on `reports`.
fn start_backward_thread(device: Device, reports: Sender<Report>) -> Result<(Sender<(Tensor, ThreadState)>, JoinHandle<()>)> {
    let (jobs, losses) = channel::<(Tensor, ThreadState)>();
    let threads = tch::get_num_threads();
    let thread = std::thread::Builder::new()
        .name("backward".into())
        .spawn(move || {
            // at::set_num_threads also sets this thread's OpenMP team size (PyTorch's own threads
            // call at::init_num_threads for the same reason).
            tch::set_num_threads(threads);
            let ready = crate::raw::set_cuda_device(device);
            for (loss, state) in losses {
                let started = Instant::now();
                let result = match &ready {
                    Ok(()) => state.enter().and_then(|_state| loss.f_backward().map_err(Error::from)),
                    Err(e) => Err(Error::exchange("overlap", e.to_string())),
                };
                let _ = reports.send(Report::BackwardDone { result, took: started.elapsed() });
            }
        })
        .map_err(|e| Error::exchange("overlap", format!("cannot start the backward thread: {e}")))?;
    Ok((jobs, thread))
}
