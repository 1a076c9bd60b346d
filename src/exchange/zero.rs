//! `--zero 1|2`: ZeRO's sharded optimizer (Rajbhandari et al., "ZeRO: Memory Optimizations
//! Toward Training Trillion Parameter Models", SC 2020), stages 1 and 2, on a strategy that runs
//! the two halves of its all-reduce apart: the reduce-scatter, then the all-gather.
//!
//! Per bucket: the gradients are packed into one bucket-sized buffer and reduce-scattered, so
//! that this rank holds the averaged gradient of its shard of the bucket (the range the
//! strategy's reduce-scatter leaves summed here, balanced to within one element by
//! `ShardInfo`). The optimizer steps only that shard, with the momentum of that shard only: a
//! shard is cut into pieces, one per tensor it touches, and the optimizer updates views of the
//! parameters' own elements from views of the buffer. The updated shard goes back into the
//! buffer, the all-gather fills in every other rank's shard, and the buffer is unpacked into the
//! parameters.
//!
//! - Stage 1 shards the optimizer state: momentum (SGD, LARS) or Adam's two moments are 1/n
//!   per rank. LARS's per-layer norms are summed from the shards: each rank adds its pieces'
//!   squared norms per layer of the bucket, and a small all-reduce of those sums (two figures
//!   per layer) runs before the shard steps, so that every piece moves with its whole layer's
//!   trust ratio.
//! - Stage 2 also lets go of a bucket's full gradients once they are reduce-scattered (the
//!   shard is consumed from the buffer at once): between steps a rank holds no gradients. With
//!   overlap, that happens bucket by bucket while backward still runs.
//!
//! The shards follow the bucket plan. When the plan changes (overlap rebuilds its buckets after
//! the first step) the optimizer state is made whole by an all-gather and cut again along the new one.
//! Checkpoints hold it as each rank's flat ranges of the parameters ([`Checkpointed::held_shards`]),
//! and a resumed run at any rank count and stage reads only its shards' ranges (the source is
//! kept until the first plan says which they are).
//!
//! One buffer of the largest bucket, on the parameters' device, serves every bucket in turn:
//! packing, the optimizer and unpacking run there. When MPI cannot read device memory (the
//! staged path) it has a pinned host mirror: the packed bucket crosses to the host in one
//! non-blocking copy before the reduce-scatter, the shard comes back in one, and so on for the
//! all-gather (see [`Mirror`]).

use std::ops::Range;

use tch::{Device, Tensor};

use crate::element::Dtype;
use crate::error::{Error, Result};
use crate::exchange::buckets::{pack_slot, unpack};
use crate::exchange::staging::{wait_for_stream, Mirror};
use crate::exchange::strategy::{common_dtype, Checkpointed, DataPath, Described, ExchangeReport, FlatPiece, HeldShards, Reduce, ReduceOp, Role, ShardedUpdate, StateSource, Training, WholeSource, WholeState};
use crate::optim::{self, Optimizer, Pieces};
use crate::plan::buckets::{Bucket, BucketPlan};
use crate::raw;

/// The algorithm whose reduce-scatter and all-gather run a bucket: each leaves the ranks
/// different shards of it, so a bucket keeps one for as long as its shards are in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardAlgorithm {
    Ring,
    Rhd,
}

/// The halves of an all-reduce, for strategies that can run them apart. Buffers are flat and
/// where MPI can read them: host memory, or device memory with a CUDA-aware MPI.
///
/// The algorithm of a bucket is chosen once, when ZeRO plans its shards ([`ShardedUpdate::use_plan`]),
/// and passed back on every call for that bucket: a strategy whose choice can change during a
/// run (`auto` follows the ring out of node-shared memory when /dev/shm is short) must not
/// reduce-scatter a bucket along one algorithm's shards while ZeRO steps another's.
pub trait ShardedCollectives: Training {
    /// The algorithm for a bucket of `len` elements of `dtype`, as things stand now.
    fn choose(&self, len: usize, dtype: Dtype) -> ShardAlgorithm;

    /// The range of a `len`-element buffer that this rank holds reduced after `algorithm`'s
    /// [`ShardedCollectives::reduce_scatter`], and brings to its [`ShardedCollectives::all_gather`].
    fn shard(&self, len: usize, algorithm: ShardAlgorithm) -> Range<usize>;

    /// Afterwards `buffer[shard(len, algorithm)]` holds the reduction over the ranks; the rest
    /// is scratch.
    fn reduce_scatter(&mut self, buffer: &mut Tensor, dtype: Dtype, op: ReduceOp, algorithm: ShardAlgorithm) -> Result<()>;

    /// Fills every rank's shard of `buffer` from its owner (this rank's shard is read).
    fn all_gather(&mut self, buffer: &mut Tensor, dtype: Dtype, algorithm: ShardAlgorithm) -> Result<()>;
}

/// For a strategy that runs one algorithm only: an error when asked for another (a plan made
/// by a different strategy).
pub fn expect_algorithm(strategy: &'static str, own: ShardAlgorithm, asked: ShardAlgorithm) -> Result<()> {
    if own != asked {
        return Err(Error::exchange(strategy, format!("asked to run a bucket planned for {asked:?} with {own:?}")));
    }
    Ok(())
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

/// The part of one tensor that falls in this rank's shard of a bucket.
#[derive(Clone, Debug)]
pub(super) struct Piece {
    pub(super) tensor: usize,
    /// Where it starts in the tensor's flat view, and in the shard.
    pub(super) at: usize,
    pub(super) shard_at: usize,
    pub(super) len: usize,
}

/// The pieces of `range` of a bucket's flat layout: a shard may start and end inside a tensor
/// and span several.
pub(super) fn pieces(bucket: &Bucket, range: &Range<usize>) -> Vec<Piece> {
    bucket
        .slots
        .iter()
        .filter_map(|slot| {
            let (start, end) = (range.start.max(slot.offset), range.end.min(slot.offset + slot.len));
            (start < end).then(|| Piece { tensor: slot.tensor, at: start - slot.offset, shard_at: start - range.start, len: end - start })
        })
        .collect()
}

/// The shards of one bucket plan, and the tensors the optimizer steps: one per piece.
struct Layout {
    plan: BucketPlan,
    /// The algorithm of each bucket, fixed with its shards.
    algorithms: Vec<ShardAlgorithm>,
    /// This rank's range of each bucket.
    shards: Vec<Range<usize>>,
    pieces: Vec<Piece>,
    /// Per bucket, the indices of its pieces.
    pieces_of: Vec<Vec<usize>>,
    /// Per piece, the parameter tensor it is part of (LARS's layer).
    layer_of: Vec<usize>,
    /// Per bucket, its parameter tensors in plan order (the same on every rank).
    layers_of: Vec<Vec<usize>>,
    /// Per piece, a view of the parameter's elements: the optimizer updates them in place.
    weights: Vec<Tensor>,
    /// Per piece, a view of where its averaged gradient lands in the bucket buffer.
    grads: Vec<Tensor>,
}

/// ZeRO's bucket buffer: on the parameters' device, where MPI reads it (host memory, or device
/// memory with a CUDA-aware MPI), or mirrored in host memory for MPI (the staged path).
enum BucketBuffer {
    InPlace(Tensor),
    Mirrored(Mirror),
}

impl BucketBuffer {
    fn new(len: usize, kind: tch::Kind, device: Device, path: DataPath) -> Result<BucketBuffer> {
        Ok(match path {
            DataPath::Staged => BucketBuffer::Mirrored(Mirror::new(len, kind, device)?),
            DataPath::Host | DataPath::Direct => BucketBuffer::InPlace(Tensor::f_zeros([len as i64], (kind, device))?),
        })
    }

    /// Whether it holds `len` elements of `kind` on `device`.
    fn fits(&self, len: usize, kind: tch::Kind, device: Device) -> bool {
        let (n, k, d) = match self {
            BucketBuffer::InPlace(t) => (t.numel(), t.kind(), t.device()),
            BucketBuffer::Mirrored(m) => (m.len(), m.device_kind().0, m.device_kind().1),
        };
        n >= len && k == kind && d == device
    }

    /// The first `len` elements on the parameters' device: where buckets are packed, stepped
    /// and unpacked.
    fn on_device(&self, len: usize) -> Tensor {
        match self {
            BucketBuffer::InPlace(t) => t.narrow(0, 0, len as i64),
            BucketBuffer::Mirrored(m) => m.on_device(len),
        }
    }

    /// The first `len` elements where MPI works on them, once elements `fresh` (written on the
    /// device) are there.
    fn for_mpi(&mut self, len: usize, fresh: Range<usize>) -> Result<Tensor> {
        match self {
            BucketBuffer::InPlace(t) => {
                let view = t.narrow(0, 0, len as i64);
                ready_for_mpi(&view)?;
                Ok(view)
            }
            BucketBuffer::Mirrored(m) => {
                m.to_host(fresh)?;
                Ok(m.on_host(len))
            }
        }
    }

    /// Elements `written` (by MPI) back where the device reads them: queued, not waited for.
    fn from_mpi(&mut self, written: Range<usize>) -> Result<()> {
        match self {
            BucketBuffer::InPlace(_) => Ok(()),
            BucketBuffer::Mirrored(m) => m.to_device(written),
        }
    }

    /// Time spent waiting for copies to the host (staged path).
    fn copy_time(&self) -> std::time::Duration {
        match self {
            BucketBuffer::InPlace(_) => std::time::Duration::ZERO,
            BucketBuffer::Mirrored(m) => m.copy_time(),
        }
    }
}

pub struct ZeroExchange {
    inner: Box<dyn ShardedCollectives>,
    stage: u8,
    bucket_bytes: usize,
    path: DataPath,
    layout: Option<Layout>,
    /// The bucket buffer: packed gradients, then gathered weights (grown, never shrunk).
    buffer: Option<BucketBuffer>,
    /// The optimizer state from a checkpoint (read by region) or made whole for a new plan,
    /// until the next plan cuts this rank's pieces from it.
    restored: Option<Box<dyn StateSource>>,
}

impl ZeroExchange {
    pub fn new(inner: Box<dyn ShardedCollectives>, stage: u8, bucket_bytes: usize, path: DataPath) -> ZeroExchange {
        debug_assert!(stage == 1 || stage == 2);
        ZeroExchange { inner, stage, bucket_bytes, path, layout: None, buffer: None, restored: None }
    }
}

impl ShardedUpdate for ZeroExchange {
    /// Shards along `plan` (unless they already follow it). Collective when the optimizer
    /// state must be re-cut: every rank changes plans at the same step.
    fn use_plan(&mut self, plan: &BucketPlan, params: &[Tensor], optimizer: &mut Optimizer) -> Result<()> {
        if self.layout.as_ref().is_some_and(|l| l.plan == *plan) {
            return Ok(());
        }
        let had_state = optimizer.state_bytes() > 0;
        let source: Option<Box<dyn StateSource>> = match self.layout.take() {
            Some(old) if had_state => Some(Box::new(WholeSource(self.whole_state(&old, params, optimizer)?))),
            _ => self.restored.take(),
        };
        let dtype = common_dtype(params)?;
        let (kind, device) = params.first().map_or((tch::Kind::Float, Device::Cpu), |p| (p.kind(), p.device()));
        let largest = plan.buckets.iter().map(|b| b.len).max().unwrap_or(0);
        if self.buffer.as_ref().is_none_or(|b| !b.fits(largest, kind, device)) {
            self.buffer = Some(BucketBuffer::new(largest, kind, device, self.path)?);
        }
        let buffer = self.buffer.as_ref().expect("made above").on_device(largest);
        let algorithms: Vec<ShardAlgorithm> = plan.buckets.iter().map(|b| self.inner.choose(b.len, dtype)).collect();
        let shards: Vec<Range<usize>> = plan.buckets.iter().zip(&algorithms).map(|(b, &a)| self.inner.shard(b.len, a)).collect();
        let (mut all, mut pieces_of) = (Vec::new(), Vec::new());
        for (bucket, shard) in plan.buckets.iter().zip(&shards) {
            let mine = pieces(bucket, shard);
            pieces_of.push((all.len()..all.len() + mine.len()).collect());
            all.extend(mine);
        }
        // Views made without autograd: the optimizer writes the parameters through them.
        let (weights, grads) = tch::no_grad(|| -> Result<(Vec<Tensor>, Vec<Tensor>)> {
            let mut weights = Vec::with_capacity(all.len());
            let mut grads = Vec::with_capacity(all.len());
            for (b, ids) in pieces_of.iter().enumerate() {
                for &i in ids {
                    let piece: &Piece = &all[i];
                    weights.push(raw::flat_dense_view(&params[piece.tensor])?.f_narrow(0, piece.at as i64, piece.len as i64)?);
                    grads.push(buffer.f_narrow(0, (shards[b].start + piece.shard_at) as i64, piece.len as i64)?);
                }
            }
            Ok((weights, grads))
        })?;
        // This rank's pieces of every state slot (an optimizer with no state yet starts afresh).
        let state = match source {
            Some(source) => cut_pieces(source.as_ref(), &all, params, optimizer.kind().slots().len())?,
            None => Vec::new(),
        };
        optimizer.restore(state, optimizer.steps());
        let layer_of = all.iter().map(|p| p.tensor).collect();
        let layers_of = plan.buckets.iter().map(|b| b.slots.iter().map(|s| s.tensor).collect()).collect();
        self.layout = Some(Layout { plan: plan.clone(), algorithms, shards, pieces: all, pieces_of, layer_of, layers_of, weights, grads });
        Ok(())
    }

    /// Reduce-scatters bucket `b`'s gradients (averaged): this rank's shard stays in the
    /// buffer for [`ShardedUpdate::step_bucket`]; stage 2 lets go of the bucket's full
    /// gradients. The packed local gradients are added to `finite` when given.
    fn reduce_bucket(&mut self, b: usize, params: &[Tensor], finite: Option<&mut optim::FiniteCheck>) -> Result<()> {
        let layout = self.layout.as_mut().expect("use_plan comes first");
        let (bucket, shard) = (&layout.plan.buckets[b], &layout.shards[b]);
        let buffer = self.buffer.as_mut().expect("a plan is in use");
        let mut packed = buffer.on_device(bucket.len);
        pack_grads(bucket, params, &mut packed)?;
        if let Some(finite) = finite {
            finite.add(&packed)?;
        }
        let mut mpi_buffer = buffer.for_mpi(bucket.len, 0..bucket.len)?;
        let dtype = common_dtype(std::slice::from_ref(&mpi_buffer))?;
        self.inner.reduce_scatter(&mut mpi_buffer, dtype, ReduceOp::Mean, layout.algorithms[b])?;
        buffer.from_mpi(shard.clone())?;
        if self.stage >= 2 {
            for slot in &bucket.slots {
                raw::release_grad(&params[slot.tensor])?;
            }
        }
        Ok(())
    }

    /// Steps the optimizer on this rank's shard of bucket `b` (the parameters' own elements),
    /// then all-gathers the bucket's weights into the parameters.
    fn step_bucket(&mut self, b: usize, params: &mut [Tensor], optimizer: &mut Optimizer) -> Result<()> {
        let layout = self.layout.as_mut().expect("use_plan comes first");
        let inner = &mut self.inner;
        let mut sum_over_ranks = |sums: &mut Tensor| inner.all_reduce(std::slice::from_mut(sums), ReduceOp::Sum);
        let pieces = Pieces::Parts { layer_of: &layout.layer_of, layers: &layout.layers_of[b], sum_over_ranks: &mut sum_over_ranks };
        optimizer.step_pieces(&mut layout.weights, &mut layout.grads, &layout.pieces_of[b], pieces)?;
        let (bucket, shard) = (&layout.plan.buckets[b], &layout.shards[b]);
        let buffer = self.buffer.as_mut().expect("a plan is in use");
        let on_device = buffer.on_device(bucket.len);
        tch::no_grad(|| -> Result<()> {
            for &i in &layout.pieces_of[b] {
                let piece = &layout.pieces[i];
                on_device.f_narrow(0, (shard.start + piece.shard_at) as i64, piece.len as i64)?.f_copy_(&layout.weights[i])?;
            }
            Ok(())
        })?;
        let mut mpi_buffer = buffer.for_mpi(bucket.len, shard.clone())?;
        let dtype = common_dtype(std::slice::from_ref(&mpi_buffer))?;
        self.inner.all_gather(&mut mpi_buffer, dtype, layout.algorithms[b])?;
        buffer.from_mpi(0..bucket.len)?;
        tch::no_grad(|| unpack(bucket, &on_device, params));
        Ok(())
    }

}

impl ZeroExchange {
    /// The bucket buffer (made by the plan).
    fn buffer(&mut self) -> &mut BucketBuffer {
        self.buffer.as_mut().expect("a plan is in use")
    }

    /// Every parameter's whole optimizer state (`[slot][parameter]`), made from every rank's
    /// shards by an all-gather per bucket and slot. Collective.
    fn whole_state(&mut self, layout: &Layout, params: &[Tensor], optimizer: &Optimizer) -> Result<WholeState> {
        (0..optimizer.kind().slots().len()).map(|slot| self.whole_slot(layout, params, optimizer.state(slot))).collect()
    }

    /// One state slot made whole (zeros where a shard has none yet).
    fn whole_slot(&mut self, layout: &Layout, params: &[Tensor], buffers: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        let mut whole: Vec<Tensor> = params.iter().map(|p| p.f_zeros_like()).collect::<std::result::Result<_, _>>()?;
        for (b, (bucket, shard)) in layout.plan.buckets.iter().zip(&layout.shards).enumerate() {
            let on_device = self.buffer().on_device(bucket.len);
            tch::no_grad(|| -> Result<()> {
                for &i in &layout.pieces_of[b] {
                    let piece = &layout.pieces[i];
                    let mut mine = on_device.f_narrow(0, (shard.start + piece.shard_at) as i64, piece.len as i64)?;
                    match buffers.get(i) {
                        Some(Some(m)) => mine.f_copy_(m)?,
                        _ => drop(mine.f_zero_()?),
                    }
                }
                Ok(())
            })?;
            let mut mpi_buffer = self.buffer().for_mpi(bucket.len, shard.clone())?;
            let dtype = common_dtype(std::slice::from_ref(&mpi_buffer))?;
            self.inner.all_gather(&mut mpi_buffer, dtype, layout.algorithms[b])?;
            self.buffer().from_mpi(0..bucket.len)?;
            tch::no_grad(|| unpack(bucket, &on_device, &mut whole));
        }
        Ok(whole)
    }
}

/// This rank's pieces (`[slot][piece]`) of the state that `source` holds, on their parameters'
/// devices and in their kind; None where the source has no buffer (a parameter never stepped).
/// Each piece reads only its range, except for a channels-last parameter, whose pieces are
/// ranges of its memory order: its buffer is read whole and laid out as the parameter is.
pub(super) fn cut_pieces(source: &dyn StateSource, all: &[Piece], params: &[Tensor], slots: usize) -> Result<Vec<Vec<Option<Tensor>>>> {
    tch::no_grad(|| {
        (0..slots)
            .map(|slot| {
                all.iter()
                    .map(|p| {
                        let param = &params[p.tensor];
                        let range = p.at..p.at + p.len;
                        let read = match param.is_contiguous() {
                            true => source.read(slot, p.tensor, Some(range))?,
                            false => match source.read(slot, p.tensor, None)? {
                                Some(whole) => {
                                    let laid_out = param.f_empty_like()?;
                                    laid_out.shallow_clone().f_copy_(&whole.f_reshape(param.size().as_slice())?)?;
                                    Some(raw::flat_dense_view(&laid_out)?.f_narrow(0, p.at as i64, p.len as i64)?)
                                }
                                None => None,
                            },
                        };
                        read.map(|t| Ok(t.f_to_kind(param.kind())?.f_to_device(param.device())?.f_reshape([-1])?.f_detach_copy()?)).transpose()
                    })
                    .collect()
            })
            .collect()
    })
}

/// Pieces and their state buffers (`[slot][piece]`, None or missing: zeros) as flat pieces
/// of the parameters, for a checkpoint.
pub(super) fn flat_pieces(all: &[Piece], state: &[Vec<Option<Tensor>>], slots: usize) -> Result<Vec<Vec<FlatPiece>>> {
    (0..slots)
        .map(|slot| {
            all.iter()
                .enumerate()
                .map(|(i, p)| {
                    let data = match state.get(slot).and_then(|s| s.get(i)) {
                        Some(Some(t)) => t.shallow_clone(),
                        _ => Tensor::f_zeros([p.len as i64], (tch::Kind::Float, Device::Cpu))?,
                    };
                    Ok(FlatPiece { param: p.tensor, at: p.at, data })
                })
                .collect()
        })
        .collect()
}

/// A device buffer's writes must be done before MPI reads it.
pub(super) fn ready_for_mpi(buffer: &Tensor) -> Result<()> {
    if buffer.device().is_cuda() {
        wait_for_stream(buffer.device())?;
    }
    Ok(())
}

/// Packs the bucket's gradients into `buffer`; a parameter without one (unused by this step,
/// or let go by stage 2 and not remade) counts as zero.
pub(super) fn pack_grads(bucket: &Bucket, params: &[Tensor], buffer: &mut Tensor) -> Result<()> {
    for slot in &bucket.slots {
        let grad = params[slot.tensor].grad();
        if !grad.defined() {
            tch::no_grad(|| buffer.narrow(0, slot.offset as i64, slot.len as i64).f_zero_().map(|_| ()))?;
            continue;
        }
        pack_slot(slot, &raw::flat_dense_view(&grad)?, buffer);
    }
    Ok(())
}

impl Described for ZeroExchange {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn bus_factor(&self) -> f64 {
        self.inner.bus_factor()
    }

    fn waits_for(&self) -> String {
        self.inner.waits_for()
    }

    fn report(&self) -> ExchangeReport {
        let mut report = self.inner.report();
        report.extra.insert("zero".into(), self.stage.into());
        if let Some(buffer) = &self.buffer {
            // ZeRO's own copies through the host mirror, beside whatever the inner strategy's
            // all-reduces staged.
            let inner = report.extra.get("staging_copy_ms").and_then(|v| v.as_f64()).unwrap_or(0.0);
            if self.path == DataPath::Staged {
                report.extra.insert("staging_copy_ms".into(), (inner + buffer.copy_time().as_secs_f64() * 1e3).into());
            }
        }
        report
    }
}

impl Reduce for ZeroExchange {
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        self.inner.all_reduce(tensors, op)
    }

    fn prepare(&mut self, params: &[Tensor]) -> Result<()> {
        self.inner.prepare(params)
    }

    fn finish(&mut self, params: &mut [Tensor]) -> Result<()> {
        self.inner.finish(params)
    }
}

impl Training for ZeroExchange {
    fn role(&self) -> Role {
        self.inner.role()
    }

    /// Bucket by bucket: reduce-scatter, step the shard, all-gather the weights.
    fn update(&mut self, params: &mut [Tensor], _grads: &mut [Tensor], optimizer: &mut Optimizer) -> Result<()> {
        let sizes: Vec<usize> = params.iter().map(|p| p.numel()).collect();
        let elem_bytes = params.first().map_or(4, |p| p.kind().elt_size_in_bytes());
        // The plan in use where there is one (overlap's, after steps with it in `--overlap
        // auto`'s trial): a new plan re-cuts the optimizer state, gathering it whole first.
        let plan = match &self.layout {
            Some(layout) if layout.plan.sizes == sizes => layout.plan.clone(),
            _ => BucketPlan::new(&sizes, elem_bytes, self.bucket_bytes, None),
        };
        self.use_plan(&plan, params, optimizer)?;
        for b in 0..plan.buckets.len() {
            crate::watchdog::set_bucket(b);
            self.reduce_bucket(b, params, None)?;
            self.step_bucket(b, params, optimizer)?;
        }
        optimizer.count_step();
        Ok(())
    }

    fn zero(&mut self) -> Option<&mut dyn ShardedUpdate> {
        Some(self)
    }
}

impl Checkpointed for ZeroExchange {
    /// The whole optimizer state, gathered from the shards (every worker takes part).
    fn optimizer_state(&mut self, params: &[Tensor], optimizer: &Optimizer) -> Result<Option<WholeState>> {
        match self.layout.take() {
            Some(layout) => {
                let whole = self.whole_state(&layout, params, optimizer);
                self.layout = Some(layout);
                Ok(Some(whole?))
            }
            None => match &self.restored {
                Some(source) => Ok(Some(crate::exchange::strategy::whole_from_source(source.as_ref(), params, optimizer.kind().slots().len())?)),
                None => Ok(Some(crate::exchange::strategy::state_or_zeros(params, optimizer)?)),
            },
        }
    }

    /// Keeps the whole state until the first plan cuts this rank's shards from it.
    fn restore_optimizer(&mut self, params: &[Tensor], state: WholeState, steps: u64, optimizer: &mut Optimizer) -> Result<()> {
        self.restore_state(params, Box::new(WholeSource(state)), steps, optimizer)
    }

    /// Keeps the source until the first plan says which ranges this rank holds: only those are
    /// read.
    fn restore_state(&mut self, _params: &[Tensor], source: Box<dyn StateSource>, steps: u64, optimizer: &mut Optimizer) -> Result<()> {
        self.layout = None;
        self.restored = Some(source);
        optimizer.restore(Vec::new(), steps);
        Ok(())
    }

    /// This rank's pieces of the state, as the plan in use cuts them (before the first step,
    /// the update's own plan, read from the restored source). Not collective, except with
    /// channels-last parameters (below).
    fn held_shards(&mut self, params: &[Tensor], optimizer: &Optimizer) -> Result<Option<HeldShards>> {
        let slots = optimizer.kind().slots().len();
        if params.iter().any(|p| !p.is_contiguous()) {
            // A channels-last parameter's shard is a range of its memory order, not of its
            // row-major elements, which is what a checkpoint's flat ranges are. Fall back to
            // today's whole state (an all-gather, collective), and write the row-major range
            // of each parameter that this rank's place among the replicas gives it.
            let whole = self.optimizer_state(params, optimizer)?.expect("ZeRO always has a state");
            let dtype = common_dtype(params)?;
            // The ranges a reduce-scatter of each parameter alone would leave here: they tile it.
            let state = whole
                .iter()
                .map(|slot| {
                    slot.iter()
                        .enumerate()
                        .map(|(i, t)| (i, self.inner.shard(t.numel(), self.inner.choose(t.numel(), dtype))))
                        .filter(|(_, r)| !r.is_empty())
                        .map(|(i, r)| Ok(FlatPiece { param: i, at: r.start, data: slot[i].f_contiguous()?.f_view([-1])?.f_narrow(0, r.start as i64, r.len() as i64)? }))
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(Some(HeldShards { state, params: Vec::new(), writes: true }));
        }
        if self.layout.is_none() {
            // No step since the start (or the resume): the pieces of the plan the first step
            // would use. Not kept: a step with overlap may choose another plan.
            let sizes: Vec<usize> = params.iter().map(|p| p.numel()).collect();
            let elem_bytes = params.first().map_or(4, |p| p.kind().elt_size_in_bytes());
            let plan = BucketPlan::new(&sizes, elem_bytes, self.bucket_bytes, None);
            let dtype = common_dtype(params)?;
            let all: Vec<Piece> = plan.buckets.iter().flat_map(|b| pieces(b, &self.inner.shard(b.len, self.inner.choose(b.len, dtype)))).collect();
            let state = match &self.restored {
                Some(source) => cut_pieces(source.as_ref(), &all, params, slots)?,
                None => Vec::new(),
            };
            return Ok(Some(HeldShards { state: flat_pieces(&all, &state, slots)?, params: Vec::new(), writes: true }));
        }
        let layout = self.layout.as_ref().expect("checked above");
        let state: Vec<Vec<Option<Tensor>>> = (0..slots).map(|s| optimizer.state(s).iter().map(|t| t.as_ref().map(Tensor::shallow_clone)).collect()).collect();
        Ok(Some(HeldShards { state: flat_pieces(&layout.pieces, &state, slots)?, params: Vec::new(), writes: true }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::shard::ShardInfo;
    use tch::Kind;

    #[test]
    fn the_pieces_of_every_shard_tile_the_bucket_exactly() {
        // Tensors of 3, 5 and 1 elements in one bucket of 9, cut into 1 to 12 shards.
        let plan = BucketPlan::in_order(&[3, 5, 1], &[0, 1, 2], 4, 1 << 20, None);
        let bucket = &plan.buckets[0];
        for n in [1, 2, 3, 4, 9, 12] {
            let mut covered = [vec![0u32; 3], vec![0u32; 5], vec![0u32; 1]];
            for shard in ShardInfo::all(9, n) {
                let range = shard.range();
                let mine = pieces(bucket, &range);
                assert_eq!(mine.iter().map(|p| p.len).sum::<usize>(), range.len(), "n {n}");
                let mut next = 0;
                for p in &mine {
                    assert_eq!(p.shard_at, next, "pieces follow each other in the shard");
                    next += p.len;
                    let slot = &bucket.slots.iter().find(|s| s.tensor == p.tensor).unwrap();
                    assert_eq!(slot.offset + p.at, range.start + p.shard_at, "the same element of the bucket");
                    covered[p.tensor][p.at..p.at + p.len].iter_mut().for_each(|c| *c += 1);
                }
            }
            assert!(covered.iter().flatten().all(|&c| c == 1), "n {n}: every element in exactly one shard");
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
