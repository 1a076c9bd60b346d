//! `--zero 1|2`: ZeRO's sharded optimizer (Rajbhandari et al., "ZeRO: Memory Optimizations
//! Toward Training Trillion Parameter Models", SC 2020), stages 1 and 2, on a strategy that runs
//! the two halves of its all-reduce apart: the reduce-scatter, then the all-gather.
//!
//! Per bucket: the gradients are packed into one bucket-sized buffer and reduce-scattered, so
//! that this rank holds the averaged gradient of its shard of the bucket (the range the
//! strategy's reduce-scatter leaves summed here, balanced to within one element by
//! `ShardInfo`). The optimizer steps only that shard, with the momentum of that shard only,
//! on this rank's copy of the shard's weights. The updated shard goes back into the buffer, the
//! all-gather fills in every other rank's shard, and the buffer is unpacked into the parameters.
//!
//! - Stage 1 shards the optimizer state: momentum is 1/n per rank.
//! - Stage 2 also lets go of a bucket's full gradients once they are reduce-scattered: between
//!   steps a rank holds only its 1/n shard of them. With overlap, that happens bucket by bucket
//!   while backward still runs.
//!
//! The shards follow the bucket plan. When the plan changes (overlap rebuilds its buckets after
//! the first step) the momentum is made whole by an all-gather and cut again along the new one.
//! Checkpoints hold it whole, so a run resumes with any rank count and any stage.
//!
//! One buffer of the largest bucket serves every bucket in turn (on the host when MPI cannot
//! read device memory); the weights' shards and the gradients' shards live on the device.

use std::ops::Range;

use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::exchange::buckets::{unpack, Bucket, BucketPlan};
use crate::exchange::element::Dtype;
use crate::exchange::staging::wait_for_stream;
use crate::exchange::{common_dtype, DataPath, Exchange, ExchangeReport, ReduceOp, Role};
use crate::optim::{self, Sgd};
use crate::raw;

/// The halves of an all-reduce, for strategies that can run them apart. Buffers are flat and
/// where MPI can read them: host memory, or device memory with a CUDA-aware MPI.
pub trait ShardedCollectives: Exchange {
    /// The range of a `len`-element buffer that this rank holds reduced after
    /// [`ShardedCollectives::reduce_scatter`], and brings to [`ShardedCollectives::all_gather`].
    fn shard(&self, len: usize, dtype: Dtype) -> Range<usize>;

    /// Afterwards `buffer[shard(len)]` holds the reduction over the ranks; the rest is scratch.
    fn reduce_scatter(&mut self, buffer: &mut Tensor, dtype: Dtype, op: ReduceOp) -> Result<()>;

    /// Fills every rank's shard of `buffer` from its owner (this rank's shard is read).
    fn all_gather(&mut self, buffer: &mut Tensor, dtype: Dtype) -> Result<()>;
}

/// Which halves of an all-reduce to run.
#[derive(Clone, Copy, Debug)]
pub struct Phases {
    pub reduce_scatter: bool,
    pub all_gather: bool,
}

impl Phases {
    pub const BOTH: Phases = Phases { reduce_scatter: true, all_gather: true };
    pub const REDUCE_SCATTER: Phases = Phases { reduce_scatter: true, all_gather: false };
    pub const ALL_GATHER: Phases = Phases { reduce_scatter: false, all_gather: true };
}

/// The shards of one bucket plan.
struct Layout {
    plan: BucketPlan,
    /// This rank's range of each bucket.
    shards: Vec<Range<usize>>,
    /// This rank's copy of its shard of the weights, one flat tensor per bucket: what the
    /// optimizer steps (the parameters receive it through the all-gather).
    weights: Vec<Tensor>,
    /// The averaged gradient of this rank's shard, one flat tensor per bucket.
    grads: Vec<Tensor>,
}

pub struct ZeroExchange {
    inner: Box<dyn ShardedCollectives>,
    stage: u8,
    bucket_bytes: usize,
    path: DataPath,
    layout: Option<Layout>,
    /// The bucket buffer: packed gradients, then gathered weights (grown, never shrunk).
    buffer: Option<Tensor>,
    /// Whole momentum per parameter from a checkpoint, until the first plan cuts it.
    restored: Option<Vec<Tensor>>,
}

impl ZeroExchange {
    pub fn new(inner: Box<dyn ShardedCollectives>, stage: u8, bucket_bytes: usize, path: DataPath) -> ZeroExchange {
        debug_assert!(stage == 1 || stage == 2);
        ZeroExchange { inner, stage, bucket_bytes, path, layout: None, buffer: None, restored: None }
    }

    /// Shards along `plan` (unless they already follow it). Collective when momentum must be
    /// re-cut: every rank changes plans at the same step.
    pub fn use_plan(&mut self, plan: &BucketPlan, params: &[Tensor], sgd: &mut Sgd) -> Result<()> {
        if self.layout.as_ref().is_some_and(|l| l.plan == *plan) {
            return Ok(());
        }
        let had_momentum = sgd.momentum_buffers().iter().any(Option::is_some);
        let whole = match self.layout.take() {
            Some(old) if had_momentum => Some(self.whole_momentum(&old, params, sgd)?),
            _ => self.restored.take(),
        };
        let dtype = common_dtype(params)?;
        let shards: Vec<Range<usize>> = plan.buckets.iter().map(|b| self.inner.shard(b.len, dtype)).collect();
        let cut = |tensors: &[Tensor]| -> Result<Vec<Tensor>> {
            plan.buckets.iter().zip(&shards).map(|(b, r)| gather_range(b, r, tensors)).collect()
        };
        let weights = cut(params)?;
        let grads = weights.iter().map(|w| w.f_zeros_like()).collect::<std::result::Result<_, _>>()?;
        let momentum = match whole {
            Some(whole) => cut(&whole)?.into_iter().map(Some).collect(),
            None => Vec::new(),
        };
        sgd.restore(momentum, sgd.steps());
        let largest = plan.buckets.iter().map(|b| b.len).max().unwrap_or(0);
        let device = self.buffer_device(params);
        if self.buffer.as_ref().is_none_or(|b| (b.numel() as usize) < largest || b.device() != device) {
            let kind = params.first().map_or(tch::Kind::Float, |p| p.kind());
            self.buffer = Some(Tensor::f_zeros([largest as i64], (kind, device))?);
        }
        self.layout = Some(Layout { plan: plan.clone(), shards, weights, grads });
        Ok(())
    }

    /// The bucket buffer lives where MPI reads: with the parameters, or on the host when they
    /// are on a GPU that MPI cannot read.
    fn buffer_device(&self, params: &[Tensor]) -> Device {
        match self.path {
            DataPath::Staged => Device::Cpu,
            _ => params.first().map_or(Device::Cpu, |p| p.device()),
        }
    }

    /// The first `len` elements of the bucket buffer.
    fn buffer(&self, len: usize) -> Tensor {
        self.buffer.as_ref().expect("a plan is in use").narrow(0, 0, len as i64)
    }

    /// Reduce-scatters bucket `b`'s gradients (averaged): this rank keeps its shard; stage 2
    /// lets go of the bucket's full gradients. `check_finite`: refuse non-finite gradients.
    pub fn reduce_bucket(&mut self, b: usize, params: &[Tensor], check_finite: bool) -> Result<()> {
        let layout = self.layout.as_mut().expect("use_plan comes first");
        let (bucket, shard) = (&layout.plan.buckets[b], &layout.shards[b]);
        let mut buffer = self.buffer.as_ref().expect("a plan is in use").narrow(0, 0, bucket.len as i64);
        pack_grads(bucket, params, &mut buffer)?;
        if check_finite && !optim::all_finite(std::slice::from_ref(&buffer))? {
            return Err(Error::NonFinite { what: "gradient", step: 0, epoch: 0 });
        }
        ready_for_mpi(&buffer)?;
        let dtype = common_dtype(std::slice::from_ref(&buffer))?;
        self.inner.reduce_scatter(&mut buffer, dtype, ReduceOp::Mean)?;
        tch::no_grad(|| layout.grads[b].f_copy_(&narrow(&buffer, shard)))?;
        if self.stage >= 2 {
            for slot in &bucket.slots {
                raw::release_grad(&params[slot.tensor])?;
            }
        }
        Ok(())
    }

    /// Steps the optimizer on this rank's shard of bucket `b`, then all-gathers the bucket's
    /// weights into the parameters.
    pub fn step_bucket(&mut self, b: usize, params: &mut [Tensor], sgd: &mut Sgd) -> Result<()> {
        let layout = self.layout.as_mut().expect("use_plan comes first");
        sgd.step_some(&mut layout.weights, &mut layout.grads, &[b])?;
        let (bucket, shard) = (&layout.plan.buckets[b], &layout.shards[b]);
        let mut buffer = self.buffer.as_ref().expect("a plan is in use").narrow(0, 0, bucket.len as i64);
        tch::no_grad(|| narrow(&buffer, shard).f_copy_(&layout.weights[b]))?;
        ready_for_mpi(&buffer)?;
        let dtype = common_dtype(std::slice::from_ref(&buffer))?;
        self.inner.all_gather(&mut buffer, dtype)?;
        tch::no_grad(|| unpack(bucket, &buffer, params));
        Ok(())
    }

    /// Every parameter's whole momentum (zeros where a shard has none yet), made from every
    /// rank's shards by an all-gather per bucket. Collective.
    fn whole_momentum(&mut self, layout: &Layout, params: &[Tensor], sgd: &Sgd) -> Result<Vec<Tensor>> {
        let mut whole: Vec<Tensor> = params.iter().map(|p| p.f_zeros_like()).collect::<std::result::Result<_, _>>()?;
        for (b, (bucket, shard)) in layout.plan.buckets.iter().zip(&layout.shards).enumerate() {
            let mut buffer = self.buffer(bucket.len);
            let mut mine = narrow(&buffer, shard);
            tch::no_grad(|| match sgd.momentum_buffers().get(b) {
                Some(Some(m)) => mine.f_copy_(m).map(|_| ()),
                _ => mine.f_zero_().map(|_| ()),
            })?;
            ready_for_mpi(&buffer)?;
            let dtype = common_dtype(std::slice::from_ref(&buffer))?;
            self.inner.all_gather(&mut buffer, dtype)?;
            tch::no_grad(|| unpack(bucket, &buffer, &mut whole));
        }
        Ok(whole)
    }

    /// Bytes of this rank's gradient shards.
    fn grad_shard_bytes(&self) -> usize {
        self.layout.as_ref().map_or(0, |l| l.grads.iter().map(|g| g.numel() * g.kind().elt_size_in_bytes()).sum())
    }
}

/// A device buffer's writes must be done before MPI reads it.
fn ready_for_mpi(buffer: &Tensor) -> Result<()> {
    if buffer.device().is_cuda() {
        wait_for_stream(buffer.device())?;
    }
    Ok(())
}

/// The view of `range` of a flat tensor.
fn narrow(flat: &Tensor, range: &Range<usize>) -> Tensor {
    flat.narrow(0, range.start as i64, range.len() as i64)
}

/// The elements of `range` of the bucket's flat layout, taken from `tensors` (a new flat tensor
/// on their device): a shard may start and end inside a tensor and span several.
fn gather_range(bucket: &Bucket, range: &Range<usize>, tensors: &[Tensor]) -> Result<Tensor> {
    let like = tensors.first().expect("a bucket holds tensors");
    let out = Tensor::f_zeros([range.len() as i64], (like.kind(), like.device()))?;
    for slot in &bucket.slots {
        let (start, end) = (range.start.max(slot.offset), range.end.min(slot.offset + slot.len));
        if start >= end {
            continue;
        }
        let src = raw::flat_dense_view(&tensors[slot.tensor])?.narrow(0, (start - slot.offset) as i64, (end - start) as i64);
        tch::no_grad(|| out.narrow(0, (start - range.start) as i64, (end - start) as i64).f_copy_(&src))?;
    }
    Ok(out)
}

/// Packs the bucket's gradients into `buffer`; a parameter without one (unused by this step,
/// or let go by stage 2 and not remade) counts as zero.
fn pack_grads(bucket: &Bucket, params: &[Tensor], buffer: &mut Tensor) -> Result<()> {
    for slot in &bucket.slots {
        let grad = params[slot.tensor].grad();
        if !grad.defined() {
            tch::no_grad(|| buffer.narrow(0, slot.offset as i64, slot.len as i64).f_zero_().map(|_| ()))?;
            continue;
        }
        let src = raw::flat_dense_view(&grad)?;
        if !raw::copy_host_elements(buffer, slot.offset, &src, 0, slot.len) {
            tch::no_grad(|| buffer.narrow(0, slot.offset as i64, slot.len as i64).f_copy_(&src))?;
        }
    }
    Ok(())
}

impl Exchange for ZeroExchange {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn bus_factor(&self) -> f64 {
        self.inner.bus_factor()
    }

    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        self.inner.all_reduce(tensors, op)
    }

    fn role(&self) -> Role {
        self.inner.role()
    }

    fn waits_for(&self) -> String {
        self.inner.waits_for()
    }

    fn prepare(&mut self, params: &[Tensor]) -> Result<()> {
        self.inner.prepare(params)
    }

    /// Bucket by bucket: reduce-scatter, step the shard, all-gather the weights.
    fn update(&mut self, params: &mut [Tensor], _grads: &mut [Tensor], sgd: &mut Sgd) -> Result<()> {
        let sizes: Vec<usize> = params.iter().map(|p| p.numel()).collect();
        let elem_bytes = params.first().map_or(4, |p| p.kind().elt_size_in_bytes());
        let plan = BucketPlan::new(&sizes, elem_bytes, self.bucket_bytes, None);
        self.use_plan(&plan, params, sgd)?;
        for b in 0..plan.buckets.len() {
            crate::watchdog::set_bucket(b);
            self.reduce_bucket(b, params, false)?;
            self.step_bucket(b, params, sgd)?;
        }
        sgd.count_step();
        Ok(())
    }

    fn zero(&mut self) -> Option<&mut ZeroExchange> {
        Some(self)
    }

    /// The whole momentum, gathered from the shards (every worker takes part).
    fn optimizer_state(&mut self, params: &[Tensor], sgd: &Sgd) -> Result<Option<Vec<Tensor>>> {
        match self.layout.take() {
            Some(layout) => {
                let whole = self.whole_momentum(&layout, params, sgd);
                self.layout = Some(layout);
                Ok(Some(whole?))
            }
            None => match &self.restored {
                Some(whole) => Ok(Some(whole.iter().map(|t| t.shallow_clone()).collect())),
                None => Ok(Some(params.iter().map(|p| p.f_zeros_like()).collect::<std::result::Result<_, _>>()?)),
            },
        }
    }

    /// Keeps the whole momentum until the first plan cuts this rank's shards from it.
    fn restore_optimizer(&mut self, _params: &[Tensor], momentum: Vec<Tensor>, steps: u64, sgd: &mut Sgd) -> Result<()> {
        self.layout = None;
        self.restored = Some(momentum);
        sgd.restore(Vec::new(), steps);
        Ok(())
    }

    fn held_bytes(&self, params: &[Tensor], sgd: &Sgd) -> HeldBytes {
        let mut held = HeldBytes::of(params, sgd);
        held.gradients += self.grad_shard_bytes();
        held
    }

    fn report(&self) -> ExchangeReport {
        let mut report = self.inner.report();
        report.extra.insert("zero".into(), self.stage.into());
        report
    }
}

/// What a rank holds between steps, for runs.jsonl.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeldBytes {
    /// Momentum buffers.
    pub optimizer_state: usize,
    /// Gradients: the parameters' own, and ZeRO's shards.
    pub gradients: usize,
}

impl HeldBytes {
    /// The optimizer's momentum and the parameters' gradients that exist now.
    pub fn of(params: &[Tensor], sgd: &Sgd) -> HeldBytes {
        let bytes = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
        HeldBytes {
            optimizer_state: sgd.momentum_buffers().iter().flatten().map(bytes).sum(),
            gradients: params.iter().map(|p| p.grad()).filter(|g| g.defined()).map(|g| bytes(&g)).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::ShardInfo;
    use tch::Kind;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v)
    }

    #[test]
    fn shards_that_split_tensors_are_gathered_and_scattered_back_exactly() {
        let tensors = vec![t(&[0., 1., 2.]), t(&[3., 4., 5., 6., 7.]), t(&[8.])];
        let plan = BucketPlan::in_order(&[3, 5, 1], &[0, 1, 2], 4, 1 << 20, None);
        let bucket = &plan.buckets[0];
        for n in [1, 2, 3, 4, 9, 12] {
            let mut whole = Tensor::zeros([9], (Kind::Float, Device::Cpu));
            for shard in ShardInfo::all(9, n) {
                let range = shard.range();
                let part = gather_range(bucket, &range, &tensors).unwrap();
                assert_eq!(part.numel(), range.len(), "n {n}");
                narrow(&whole, &range).copy_(&part);
            }
            assert_eq!(Vec::<f32>::try_from(&whole).unwrap(), (0..9).map(|i| i as f32).collect::<Vec<_>>(), "n {n}");
            let mut back = vec![Tensor::zeros([3], (Kind::Float, Device::Cpu)), Tensor::zeros([5], (Kind::Float, Device::Cpu)), Tensor::zeros([1], (Kind::Float, Device::Cpu))];
            unpack(bucket, &whole, &mut back);
            for (a, b) in back.iter().zip(&tensors) {
                assert_eq!(Vec::<f32>::try_from(a).unwrap(), Vec::<f32>::try_from(b).unwrap());
            }
        }
    }

    #[test]
    fn a_missing_gradient_packs_as_zeros() {
        let used = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let unused = Tensor::from_slice(&[5.0f32]).set_requires_grad(true);
        (&used * 3.0).sum(Kind::Float).backward();
        let plan = BucketPlan::in_order(&[2, 1], &[0, 1], 4, 1 << 20, None);
        let mut buffer = Tensor::full([3], 9.0, (Kind::Float, Device::Cpu));
        pack_grads(&plan.buckets[0], &[used, unused], &mut buffer).unwrap();
        assert_eq!(Vec::<f32>::try_from(&buffer).unwrap(), vec![3.0, 3.0, 0.0]);
    }
}
