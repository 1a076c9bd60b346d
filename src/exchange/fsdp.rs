//! `--zero 3`: fully sharded data parallelism (ZeRO stage 3, Rajbhandari et al. 2020; PyTorch
//! FSDP, Zhao et al. 2023) on the halves of the from-scratch all-reduces.
//!
//! The model is cut into units (`plan::fsdp`). Each unit's parameters are laid out flat, one
//! buffer per unit, and this rank keeps only its shard of that buffer: the range the strategy's
//! reduce-scatter leaves reduced here (`ShardedCollectives::shard`), as ZeRO stages 1 and 2 do
//! for a bucket. Between steps the parameters themselves hold no memory (their data is an empty
//! tensor); the optimizer state and the reduced gradients exist for the shard only.
//!
//! The training step (`train/fsdp_step.rs`) drives the units: [`UnitShards::gather`] all-gathers
//! a unit's buffer from every rank's shard, [`UnitShards::install`] points the unit's
//! parameters at its elements (`set_data`, PyTorch's `param.data = ...`: the parameter keeps
//! its identity, so the modules see the gathered values), and [`UnitShards::release`] points
//! them back at nothing, which frees the buffer. After a unit's backward, its gradients are
//! packed flat, reduce-scattered (averaged), and the shard is kept for the optimizer.
//!
//! Buffers are allocated once and reused, as PyTorch's caching allocator does for FSDP on a GPU:
//! gathers take a buffer of the largest unit's size from a pool; once a unit's backward is done,
//! its gradients are packed into the buffer its parameters were gathered into (they are not
//! needed again), which goes back to the pool after the reduce-scatter; the reduced shards land
//! in one flat buffer of this rank's shards. The step reduces before it gathers, so the pool
//! holds one buffer without prefetch and two with it. Allocating and freeing unit-sized
//! buffers at every unit instead made glibc keep the freed memory (its mmap threshold rises
//! after the first large free), and the resident memory of stage 3 exceeded stage 2's
//! (results/zero3/). Only the whole model made for a checkpoint is allocated apart, and freed.
//! A pipeline stage, one unit gathered once per step, frees its buffer after each step and
//! evaluation ([`UnitShards::free_buffers`]): kept, it would be the whole stage between steps.
//!
//! `--channels-last`: the 4-d parameters compute in channels-last (NHWC) memory order, as FSDP2
//! keeps each parameter's memory format. Everything that leaves a rank or outlives a step stays
//! in the standard contiguous order: the shards, the gathers' and reduce-scatters' wire, the
//! checkpoints' flat ranges (which any layout resumes from) and `range` in [`UnitShards::shard`].
//! Only a gathered buffer is reordered, in place, parameter by parameter, once its all-gather is
//! done: each parameter's elements are copied to a scratch tensor of the largest such
//! parameter's size (made once, the only memory this costs) and written back in channels-last
//! order, which `install` then points the parameter at with channels-last strides. The gradients
//! (channels-last too: autograd gives a parameter's gradient its layout) are packed back into
//! the standard order by a strided copy. Keeping the shards in memory order instead would make a
//! shard's piece of a parameter a scattered set of its standard elements: a checkpoint's flat
//! ranges, and a resume's reads of them, would need the whole parameter.
//!
//! `--fsdp-hybrid` (FSDP's HYBRID_SHARD, ZeRO++'s hpZ): the shards are cut over the ranks of a
//! node only, and the same shard lives on every node. The all-gathers stay inside the node; a
//! reduce-scatter inside the node is followed by an all-reduce of the shard among the ranks that
//! hold it on the other nodes, so only 1/(ranks per node) of each unit crosses the network.

use std::ops::Range;
use std::time::Duration;

use tch::{Device, Kind, Tensor};

use crate::element::Dtype;
use crate::error::{Error, Result};
use crate::exchange::buckets::{pack_slot, unpack};
use crate::exchange::staging::{wait_for_stream, HostPool};
use crate::exchange::strategy::{common_dtype, Checkpointed, DataPath, Described, ExchangeReport, FlatPiece, HeldBytes, HeldShards, Reduce, ReduceOp, Role, StateSource, Training, UnitShards, UnitTimes, WholeSource, WholeState};
use crate::exchange::zero::{cut_pieces, flat_pieces, pieces, ready_for_mpi, Piece, ShardAlgorithm, ShardedCollectives};
use crate::optim::{FiniteCheck, Optimizer, Pieces};
use crate::plan::buckets::{Bucket, Slot};
use crate::raw;

/// One unit's layout and this rank's part of it.
struct UnitShard {
    layout: Bucket,
    /// Chosen once, with the shard: the algorithm whose reduce-scatter leaves `shard` here.
    algorithm: ShardAlgorithm,
    shard: Range<usize>,
    /// This rank's elements of the unit's flat parameters: what it holds between steps.
    params: Tensor,
    /// Where this unit's shard starts in the buffer of reduced gradient shards.
    grads_at: usize,
    /// Whether the shard's gradient was reduced this step.
    reduced: bool,
    /// Indices of this unit's pieces in the exchange's piece lists.
    pieces: Vec<usize>,
    /// The unit's parameter tensors in layout order (the same on every rank): LARS's layers.
    layers: Vec<usize>,
}

/// Figures for runs.jsonl.
#[derive(Default)]
struct Figures {
    gathered_bytes: usize,
    /// The most gathered at once by steps and evaluations (not by the whole model made for a
    /// checkpoint).
    peak_gathered_bytes: usize,
    /// Every gather (training, evaluation, checkpoints).
    gathers: u64,
    /// Training steps, and their gathers and reductions.
    steps: u64,
    step_times: UnitTimes,
}

pub struct FullyShardedExchange {
    /// The ranks the shards are cut over: all of them, or (hybrid) the node's.
    shards: Box<dyn ShardedCollectives>,
    /// Hybrid sharding: the ranks on other nodes that hold the same shard.
    replicas: Option<Box<dyn Reduce>>,
    role: Role,
    path: DataPath,
    units: Vec<UnitShard>,
    /// Every parameter's shape, kind and device: the parameters themselves are empty between
    /// steps.
    shapes: Vec<Vec<i64>>,
    kind: Kind,
    device: Device,
    dtype: Dtype,
    /// Per parameter: whether it computes in channels-last order (`--channels-last`'s 4-d
    /// parameters), from [`UnitShards::compute_channels_last`].
    channels_last: Vec<bool>,
    /// With channels-last parameters: one tensor of the largest one's size, through which a
    /// gathered parameter is reordered in place.
    reorder_scratch: Option<Tensor>,
    /// Per piece (a parameter's part in this rank's shard of a unit): where it is, its layer,
    /// and a view of its elements in the unit's shard, which the optimizer updates in place.
    pieces: Vec<Piece>,
    layer_of: Vec<usize>,
    weights: Vec<Tensor>,
    /// The optimizer state from a checkpoint (read by region), until `shard` cuts this rank's
    /// pieces from it.
    restored: Option<Box<dyn StateSource>>,
    /// Whether this rank writes its shards into a checkpoint: with `--fsdp-hybrid` every node
    /// holds the same shards, and the first node's ranks write them.
    writes_shards: bool,
    /// Buffers of the largest unit's size: free ones, and per unit the one its parameters were
    /// gathered into (None for a whole-model gather's own buffer, freed on release) and then
    /// its gradients packed into, until their reduce-scatter.
    free: Vec<Tensor>,
    in_use: Vec<Option<Tensor>>,
    /// On the staged path: the host buffer of the largest unit's size (pinned for a GPU) that
    /// every gather and reduce-scatter passes through, one at a time.
    staging: HostPool,
    /// Time spent in the staged path's copies between the device and `staging`, in all.
    copy_time: Duration,
    packed: Vec<Option<Tensor>>,
    /// This rank's averaged gradient shards of every unit, one after the other.
    shard_grads: Option<Tensor>,
    figures: Figures,
}

impl FullyShardedExchange {
    /// `role`: this rank among all the ranks that train (not only those it shares shards with).
    pub fn new(shards: Box<dyn ShardedCollectives>, replicas: Option<Box<dyn Reduce>>, role: Role, path: DataPath, writes_shards: bool) -> FullyShardedExchange {
        FullyShardedExchange {
            shards,
            replicas,
            role,
            path,
            units: Vec::new(),
            shapes: Vec::new(),
            kind: Kind::Float,
            device: Device::Cpu,
            dtype: Dtype::F32,
            channels_last: Vec::new(),
            reorder_scratch: None,
            pieces: Vec::new(),
            layer_of: Vec::new(),
            weights: Vec::new(),
            restored: None,
            writes_shards,
            free: Vec::new(),
            in_use: Vec::new(),
            staging: HostPool::default(),
            copy_time: Duration::ZERO,
            packed: Vec::new(),
            shard_grads: None,
            figures: Figures::default(),
        }
    }

    fn elem_bytes(&self) -> usize {
        self.kind.elt_size_in_bytes()
    }

    /// Bytes of parameters this rank holds between steps: its shards.
    pub fn held_parameter_bytes(&self) -> usize {
        self.units.iter().map(|u| u.shard.len()).sum::<usize>() * self.elem_bytes()
    }

    /// Bytes of the reused buffers (gathers, packed gradients, the channels-last reorder's
    /// scratch).
    fn buffer_bytes(&self) -> usize {
        let pooled = self.free.iter().chain(self.in_use.iter().flatten()).chain(self.packed.iter().flatten()).chain(&self.reorder_scratch);
        pooled.map(|t| t.numel()).sum::<usize>() * self.elem_bytes()
    }

    fn largest_unit(&self) -> usize {
        self.units.iter().map(|u| u.layout.len).max().unwrap_or(0)
    }

    /// A buffer of the largest unit's size from the pool.
    fn pooled_buffer(&mut self) -> Result<Tensor> {
        match self.free.pop() {
            Some(b) => Ok(b),
            None => Ok(Tensor::f_empty([self.largest_unit() as i64], (self.kind, self.device))?),
        }
    }

    /// The MPI side of `buffer` (device memory with a CUDA-aware MPI, host memory otherwise),
    /// made ready for MPI, and on the staged path the host buffer it was copied into, to bring
    /// the result back from and give back with [`FullyShardedExchange::staged_done`]: the pool's
    /// one buffer of the largest unit's size, not fresh pageable memory at every gather and
    /// reduce-scatter.
    fn for_mpi(&mut self, buffer: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        match self.path {
            DataPath::Staged => {
                let host = self.staging.take(&[self.largest_unit() as i64], self.kind, self.device)?;
                let mut view = host.f_narrow(0, 0, buffer.numel() as i64)?;
                // Blocking: done, with the kernels that wrote `buffer`, when MPI reads it.
                self.timed_copy(&mut view, buffer)?;
                Ok((view, Some(host)))
            }
            DataPath::Host | DataPath::Direct => {
                ready_for_mpi(buffer)?;
                Ok((buffer.shallow_clone(), None))
            }
        }
    }

    /// Gives the staging buffer of [`FullyShardedExchange::for_mpi`] back, once the result is
    /// copied out of it (blocking copies: nothing reads it any more).
    /// A blocking copy, counted in `copy_time` (which the record gives on the staged path, where
    /// the copies cross between the device and the staging buffer).
    fn timed_copy(&mut self, dst: &mut Tensor, src: &Tensor) -> Result<()> {
        let started = std::time::Instant::now();
        tch::no_grad(|| dst.f_copy_(src))?;
        self.copy_time += started.elapsed();
        Ok(())
    }

    fn staged_done(&mut self, host: Option<Tensor>) {
        if let Some(host) = host {
            self.staging.give(host);
        }
    }

    /// Fills `full` (a unit's flat buffer with this rank's shard in place) from every rank.
    fn all_gather_unit(&mut self, u: usize, full: &mut Tensor) -> Result<()> {
        let (mut mpi_buffer, staged) = self.for_mpi(full)?;
        self.shards.all_gather(&mut mpi_buffer, self.dtype, self.units[u].algorithm)?;
        if staged.is_some() {
            self.timed_copy(full, &mpi_buffer)?;
        }
        self.staged_done(staged);
        Ok(())
    }

    /// Every parameter's whole state of one optimizer slot, gathered unit by unit. Collective.
    fn whole_slot(&mut self, buffers: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
        let mut whole: Vec<Tensor> =
            self.shapes.iter().map(|s| Tensor::f_zeros(s.as_slice(), (self.kind, self.device))).collect::<std::result::Result<_, _>>()?;
        for u in 0..self.units.len() {
            let unit = &self.units[u];
            if unit.layout.len == 0 {
                continue;
            }
            let mut full = Tensor::f_zeros([unit.layout.len as i64], (self.kind, self.device))?;
            tch::no_grad(|| -> Result<()> {
                for &i in &unit.pieces {
                    if let Some(Some(mine)) = buffers.get(i) {
                        let piece = &self.pieces[i];
                        full.f_narrow(0, (unit.shard.start + piece.shard_at) as i64, piece.len as i64)?.f_copy_(mine)?;
                    }
                }
                Ok(())
            })?;
            self.all_gather_unit(u, &mut full)?;
            let layout = self.units[u].layout.clone();
            tch::no_grad(|| unpack(&layout, &full, &mut whole));
        }
        Ok(whole)
    }

    /// Rewrites unit `u`'s channels-last parameters in `full` (as gathered: standard order)
    /// into channels-last order, one at a time through the scratch tensor.
    fn reorder_for_compute(&self, u: usize, full: &Tensor) -> Result<()> {
        let Some(scratch) = &self.reorder_scratch else { return Ok(()) };
        tch::no_grad(|| -> Result<()> {
            for slot in self.units[u].layout.slots.iter().filter(|s| self.channels_last[s.tensor]) {
                reorder_to_channels_last(&full.f_narrow(0, slot.offset as i64, slot.len as i64)?, &self.shapes[slot.tensor], scratch)?;
            }
            Ok(())
        })
    }
}

/// Whether channels-last order differs from the standard one for a 4-d tensor of `shape`: it
/// does not where C or H x W is 1 (only the strides of dimensions of size 1 differ), which
/// libtorch's `contiguous(channels_last)` then leaves as it is.
fn reorders(shape: &[i64]) -> bool {
    let Ok(channels_last) = raw::channels_last_strides(shape) else { return false };
    let standard = [shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1];
    shape.iter().zip(channels_last.iter().zip(standard)).any(|(&size, (&cl, st))| size != 1 && cl != st)
}

/// Rewrites a 4-d parameter's `elements` (a flat range, in the standard contiguous order of
/// `shape`) into channels-last order in the same memory, through `scratch` (at least as long).
fn reorder_to_channels_last(elements: &Tensor, shape: &[i64], scratch: &Tensor) -> Result<()> {
    let mut copy = scratch.f_narrow(0, 0, elements.numel() as i64)?;
    copy.f_copy_(elements)?;
    let mut in_place = elements.f_as_strided(shape, raw::channels_last_strides(shape)?, None::<i64>)?;
    in_place.f_copy_(&copy.f_view(shape)?)?;
    Ok(())
}

/// A parameter's tensor on its elements of a gathered unit: channels-last strides where
/// [`reorder_to_channels_last`] has laid them out so, the standard shape's view otherwise.
fn parameter_view(gathered: &Tensor, slot: &Slot, shape: &[i64], channels_last: bool) -> Result<Tensor> {
    let elements = gathered.f_narrow(0, slot.offset as i64, slot.len as i64)?;
    if !channels_last {
        return Ok(elements.f_view(shape)?);
    }
    let view = elements.f_as_strided(shape, raw::channels_last_strides(shape)?, None::<i64>)?;
    debug_assert!(raw::is_channels_last(&view), "a channels-last parameter of sizes {shape:?} installed with strides {:?}", view.stride());
    Ok(view)
}

/// Packs a unit's gradients into `buffer` in the parameters' standard contiguous order, which
/// the shards keep whatever order the parameters computed in: a channels-last gradient by a
/// strided copy, a contiguous one as it is. A missing gradient is packed as zeros.
fn pack_grads_in_order(layout: &Bucket, shapes: &[Vec<i64>], params: &[Tensor], buffer: &mut Tensor) -> Result<()> {
    for slot in &layout.slots {
        let grad = params[slot.tensor].grad();
        let mut dst = buffer.f_narrow(0, slot.offset as i64, slot.len as i64)?;
        if !grad.defined() {
            drop(dst.f_zero_()?);
        } else if grad.is_contiguous() {
            pack_slot(slot, &grad.f_view([-1])?, buffer);
        } else {
            dst.f_view(shapes[slot.tensor].as_slice())?.f_copy_(&grad)?;
        }
    }
    Ok(())
}

impl UnitShards for FullyShardedExchange {
    fn shard(&mut self, units: &[Bucket], params: &[Tensor], shapes: &[Vec<i64>], range: &mut dyn FnMut(usize, i64, i64) -> Result<Tensor>, optimizer: &mut Optimizer) -> Result<()> {
        self.dtype = common_dtype(params)?;
        (self.kind, self.device) = params.first().map_or((Kind::Float, Device::Cpu), |p| (p.kind(), p.device()));
        self.shapes = shapes.to_vec();
        let elements: usize = shapes.iter().map(|s| s.iter().product::<i64>() as usize).sum();
        if self.channels_last.is_empty() {
            self.channels_last = vec![false; shapes.len()];
        }
        if self.channels_last.len() != shapes.len() {
            return Err(Error::exchange("zero 3", format!("a memory order for {} parameters, {} to shard", self.channels_last.len(), shapes.len())));
        }
        // Where a 4-d parameter's channels-last order is its standard one (C or H x W of 1),
        // it keeps its standard strides, as libtorch's `contiguous(channels_last)` leaves such a
        // tensor in a plain run: a convolution picks its kernel's memory format from the
        // strides, and channels-last ones would take another kernel than the plain run's.
        for (channels_last, shape) in self.channels_last.iter_mut().zip(shapes) {
            *channels_last = *channels_last && reorders(shape);
        }
        let covered: usize = units.iter().flat_map(|u| &u.slots).map(|s| s.len).sum();
        if covered != elements {
            return Err(Error::exchange("zero 3", format!("the units cover {covered} elements, the parameters have {elements}")));
        }
        let (mut all, mut unit_shards) = (Vec::new(), Vec::new());
        let mut weights = Vec::new();
        tch::no_grad(|| -> Result<()> {
            for layout in units {
                let algorithm = self.shards.choose(layout.len, self.dtype);
                let shard = if layout.len == 0 { 0..0 } else { self.shards.shard(layout.len, algorithm) };
                let mine = pieces(layout, &shard);
                let flat = Tensor::f_zeros([shard.len() as i64], (self.kind, self.device))?;
                let ids: Vec<usize> = (all.len()..all.len() + mine.len()).collect();
                for piece in &mine {
                    // A shard meets a parameter in one piece at most: each is asked once.
                    let value = range(piece.tensor, piece.at as i64, piece.len as i64)?;
                    let mut dst = flat.f_narrow(0, piece.shard_at as i64, piece.len as i64)?;
                    dst.f_copy_(&value.f_reshape([-1])?)?;
                    weights.push(dst);
                }
                all.extend(mine);
                let layers = layout.slots.iter().map(|s| s.tensor).collect();
                let grads_at = unit_shards.last().map_or(0, |u: &UnitShard| u.grads_at + u.shard.len());
                unit_shards.push(UnitShard { layout: layout.clone(), algorithm, shard, params: flat, grads_at, reduced: false, pieces: ids, layers });
            }
            Ok(())
        })?;
        // This rank's pieces of the optimizer state, if a checkpoint gave one: only their
        // ranges are read.
        let state = match self.restored.take() {
            Some(source) => cut_pieces(source.as_ref(), &all, params, optimizer.kind().slots().len())?,
            None => Vec::new(),
        };
        optimizer.restore(state, optimizer.steps());
        self.layer_of = all.iter().map(|p| p.tensor).collect();
        self.pieces = all;
        self.weights = weights;
        let shard_total: usize = unit_shards.iter().map(|u| u.shard.len()).sum();
        self.shard_grads = Some(Tensor::f_zeros([shard_total as i64], (self.kind, self.device))?);
        let largest_channels_last = shapes.iter().zip(&self.channels_last).filter(|(_, &cl)| cl).map(|(s, _)| s.iter().product::<i64>()).max();
        self.reorder_scratch = largest_channels_last.map(|n| Tensor::f_empty([n], (self.kind, self.device))).transpose()?;
        self.in_use = (0..unit_shards.len()).map(|_| None).collect();
        self.packed = (0..unit_shards.len()).map(|_| None).collect();
        self.units = unit_shards;
        for u in 0..self.units.len() {
            self.release(u, params)?;
        }
        self.figures.gathered_bytes = 0;
        Ok(())
    }

    fn gather(&mut self, u: usize) -> Result<Tensor> {
        let len = self.units[u].layout.len;
        let buffer = {
            let pooled = self.pooled_buffer()?;
            self.in_use[u] = Some(pooled.shallow_clone());
            pooled
        };
        let mut full = buffer.f_narrow(0, 0, len as i64)?;
        if len > 0 {
            // Watched as an exchange: a rank that never joins is named after the timeout.
            let _watched = crate::watchdog::exchange(self.shards.name(), || self.shards.waits_for());
            crate::watchdog::set_bucket(u);
            let unit = &self.units[u];
            tch::no_grad(|| full.f_narrow(0, unit.shard.start as i64, unit.shard.len() as i64)?.f_copy_(&unit.params).map(drop))?;
            self.all_gather_unit(u, &mut full)?;
            self.reorder_for_compute(u, &full)?;
            // The compute thread reads the unit on a stream of its own: whatever this stream
            // still has queued for it (the shard's copy, a direct path's kernels) is done first.
            wait_for_stream(self.device)?;
        }
        let f = &mut self.figures;
        f.gathered_bytes += len * self.kind.elt_size_in_bytes();
        f.peak_gathered_bytes = f.peak_gathered_bytes.max(f.gathered_bytes);
        f.gathers += 1;
        Ok(full)
    }

    fn install(&mut self, u: usize, gathered: &Tensor, params: &[Tensor]) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for slot in &self.units[u].layout.slots {
                let view = parameter_view(gathered, slot, &self.shapes[slot.tensor], self.channels_last[slot.tensor])?;
                params[slot.tensor].shallow_clone().f_set_data(&view)?;
            }
            Ok(())
        })
    }

    fn compute_channels_last(&mut self, channels_last: Vec<bool>) {
        self.channels_last = channels_last;
    }

    fn release(&mut self, u: usize, params: &[Tensor]) -> Result<()> {
        let empty = Tensor::f_empty([0], (self.kind, self.device))?;
        tch::no_grad(|| -> Result<()> {
            for slot in &self.units[u].layout.slots {
                params[slot.tensor].shallow_clone().f_set_data(&empty)?;
            }
            Ok(())
        })?;
        if let Some(buffer) = self.in_use.get_mut(u).and_then(Option::take) {
            self.free.push(buffer);
        }
        let bytes = self.units[u].layout.len * self.elem_bytes();
        self.figures.gathered_bytes = self.figures.gathered_bytes.saturating_sub(bytes);
        Ok(())
    }

    fn pack_grads(&mut self, u: usize, params: &[Tensor], finite: &mut FiniteCheck) -> Result<()> {
        // Into the buffer the unit's parameters were gathered into: backward is done with them.
        let buffer = match self.in_use[u].take() {
            Some(b) => b,
            None => self.pooled_buffer()?,
        };
        let layout = &self.units[u].layout;
        let mut packed = buffer.f_narrow(0, 0, layout.len as i64)?;
        tch::no_grad(|| pack_grads_in_order(layout, &self.shapes, params, &mut packed))?;
        finite.add(&packed)?;
        // The gradients were made on the compute thread's stream and are read here on the
        // communication stream (a GPU's): letting them go before that read is done would hand
        // their memory to the compute stream's next allocation while the packing still reads it
        // (what record_stream is for in PyTorch).
        wait_for_stream(self.device)?;
        for slot in &layout.slots {
            raw::release_grad(&params[slot.tensor])?;
        }
        self.packed[u] = Some(buffer);
        Ok(())
    }

    fn reduce(&mut self, u: usize) -> Result<()> {
        let buffer = self.packed[u].take().ok_or_else(|| Error::exchange("zero 3", "a unit's gradients were reduced before they were packed"))?;
        let (len, shard, algorithm) = (self.units[u].layout.len, self.units[u].shard.clone(), self.units[u].algorithm);
        if len > 0 {
            let _watched = crate::watchdog::exchange(self.shards.name(), || self.shards.waits_for());
            crate::watchdog::set_bucket(u);
            let packed = buffer.f_narrow(0, 0, len as i64)?;
            let (mut mpi_buffer, staged) = self.for_mpi(&packed)?;
            self.shards.reduce_scatter(&mut mpi_buffer, self.dtype, ReduceOp::Mean, algorithm)?;
            let mut mine = self.shard_grads.as_ref().expect("sharded").f_narrow(0, self.units[u].grads_at as i64, shard.len() as i64)?;
            self.timed_copy(&mut mine, &mpi_buffer.f_narrow(0, shard.start as i64, shard.len() as i64)?)?;
            drop(mpi_buffer);
            self.staged_done(staged);
            if let Some(replicas) = &mut self.replicas {
                replicas.all_reduce(std::slice::from_mut(&mut mine), ReduceOp::Mean)?;
            }
        }
        self.units[u].reduced = true;
        self.free.push(buffer);
        Ok(())
    }

    fn step(&mut self, optimizer: &mut Optimizer) -> Result<()> {
        let mut grads: Vec<Tensor> = Vec::with_capacity(self.pieces.len());
        let shard_grads = self.shard_grads.as_ref().expect("sharded");
        for unit in &self.units {
            if !unit.reduced && !unit.pieces.is_empty() {
                return Err(Error::exchange("zero 3", "a unit's gradients were not reduced before the step"));
            }
            for &i in &unit.pieces {
                let piece = &self.pieces[i];
                grads.push(shard_grads.f_narrow(0, (unit.grads_at + piece.shard_at) as i64, piece.len as i64)?);
            }
        }
        let shards = &mut self.shards;
        // LARS sums its per-layer norms over the ranks here, between the unit collectives: a
        // peer lost now would otherwise leave this all-reduce waiting unwatched for ever.
        let mut sum_over_ranks = |sums: &mut Tensor| {
            let _watched = crate::watchdog::exchange("the zero 3 optimizer's norm all-reduce", || shards.waits_for());
            shards.all_reduce(std::slice::from_mut(sums), ReduceOp::Sum)
        };
        for unit in &self.units {
            let pieces = Pieces::Parts { layer_of: &self.layer_of, layers: &unit.layers, sum_over_ranks: &mut sum_over_ranks };
            optimizer.step_pieces(&mut self.weights, &mut grads, &unit.pieces, pieces)?;
        }
        for unit in &mut self.units {
            unit.reduced = false;
        }
        optimizer.count_step();
        Ok(())
    }

    fn free_buffers(&mut self) {
        debug_assert!(self.in_use.iter().chain(&self.packed).all(Option::is_none), "a unit still gathered or waiting for its reduce-scatter");
        self.free.clear();
    }

    fn note_step(&mut self, times: UnitTimes) {
        let t = &mut self.figures.step_times;
        t.gather += times.gather;
        t.exposed_gather += times.exposed_gather;
        t.reduce += times.reduce;
        t.exposed_reduce += times.exposed_reduce;
        self.figures.steps += 1;
    }
}

impl Described for FullyShardedExchange {
    fn name(&self) -> &'static str {
        self.shards.name()
    }

    fn bus_factor(&self) -> f64 {
        self.shards.bus_factor()
    }

    fn waits_for(&self) -> String {
        self.shards.waits_for()
    }

    /// The gradient shards' buffer counts as gradients held (as PyTorch FSDP keeps the sharded
    /// `.grad`); the gather and packing buffers are reported apart.
    fn held_bytes(&self, _params: &[Tensor], optimizer: &Optimizer) -> HeldBytes {
        let grads = self.shard_grads.as_ref().map_or(0, |g| g.numel()) * self.elem_bytes();
        HeldBytes { optimizer_state: optimizer.state_bytes(), gradients: grads }
    }

    fn report(&self) -> ExchangeReport {
        let mut report = self.shards.report();
        let f = &self.figures;
        let per_step = |d: Duration| d.as_secs_f64() * 1e3 / f.steps.max(1) as f64;
        let hidden = |total: Duration, exposed: Duration| if total.is_zero() { 0.0 } else { 1.0 - exposed.as_secs_f64().min(total.as_secs_f64()) / total.as_secs_f64() };
        let t = &f.step_times;
        let extra = &mut report.extra;
        extra.insert("zero".into(), 3.into());
        extra.insert("fsdp_units".into(), self.units.len().into());
        extra.insert("fsdp_hybrid".into(), self.replicas.is_some().into());
        extra.insert("parameter_bytes_held".into(), self.held_parameter_bytes().into());
        extra.insert("peak_gathered_parameter_bytes".into(), f.peak_gathered_bytes.into());
        extra.insert("fsdp_buffer_bytes".into(), self.buffer_bytes().into());
        extra.insert("fsdp_gathers".into(), f.gathers.into());
        extra.insert("fsdp_gather_ms_per_step".into(), per_step(t.gather).into());
        extra.insert("fsdp_exposed_gather_ms_per_step".into(), per_step(t.exposed_gather).into());
        extra.insert("fsdp_reduce_scatter_ms_per_step".into(), per_step(t.reduce).into());
        extra.insert("fsdp_exposed_reduce_scatter_ms_per_step".into(), per_step(t.exposed_reduce).into());
        extra.insert("fsdp_gather_hidden".into(), hidden(t.gather, t.exposed_gather).into());
        extra.insert("fsdp_reduce_scatter_hidden".into(), hidden(t.reduce, t.exposed_reduce).into());
        if self.path == DataPath::Staged {
            extra.insert("staging_copy_ms".into(), (self.copy_time.as_secs_f64() * 1e3).into());
            // One reused buffer of the largest unit's size, however many units and steps.
            extra.insert("staging_host_buffers".into(), self.staging.made().into());
        }
        report
    }
}

impl Reduce for FullyShardedExchange {
    /// Over every rank: the shard group, then (hybrid) the same ranks of the other nodes.
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        self.shards.all_reduce(tensors, op)?;
        match &mut self.replicas {
            Some(replicas) => replicas.all_reduce(tensors, op),
            None => Ok(()),
        }
    }

    /// Every rank is here together: the shard group's exchange and (hybrid) the replicas' free
    /// what they hold, such as the ring's node-shared window, which the default (nothing)
    /// left to a drop (issue 48).
    fn finish(&mut self, params: &mut [Tensor]) -> Result<()> {
        self.shards.finish(params)?;
        match &mut self.replicas {
            Some(replicas) => replicas.finish(params),
            None => Ok(()),
        }
    }
}

impl Training for FullyShardedExchange {
    fn role(&self) -> Role {
        self.role
    }

    fn update(&mut self, _params: &mut [Tensor], _grads: &mut [Tensor], _optimizer: &mut Optimizer) -> Result<()> {
        Err(Error::exchange("zero 3", "stage 3 reduces and steps unit by unit (the fully sharded step), never whole gradients"))
    }

    fn fully_sharded(&mut self) -> Option<&mut dyn UnitShards> {
        Some(self)
    }
}

impl Checkpointed for FullyShardedExchange {
    /// The whole optimizer state, gathered unit by unit from the shards (every rank takes part).
    fn optimizer_state(&mut self, params: &[Tensor], optimizer: &Optimizer) -> Result<Option<WholeState>> {
        if self.units.is_empty() {
            return match &self.restored {
                Some(source) => Ok(Some(crate::exchange::strategy::whole_from_source(source.as_ref(), params, optimizer.kind().slots().len())?)),
                None => Ok(Some(crate::exchange::strategy::state_or_zeros(params, optimizer)?)),
            };
        }
        let slots = optimizer.kind().slots().len();
        let mut whole = Vec::with_capacity(slots);
        for slot in 0..slots {
            let buffers: Vec<Option<Tensor>> = optimizer.state(slot).iter().map(|b| b.as_ref().map(|t| t.shallow_clone())).collect();
            whole.push(self.whole_slot(&buffers)?);
        }
        Ok(Some(whole))
    }

    /// Keeps the whole state until `shard` cuts this rank's pieces from it.
    fn restore_optimizer(&mut self, params: &[Tensor], state: WholeState, steps: u64, optimizer: &mut Optimizer) -> Result<()> {
        self.restore_state(params, Box::new(WholeSource(state)), steps, optimizer)
    }

    /// Keeps the source until `shard` says which ranges this rank holds: only those are read.
    fn restore_state(&mut self, _params: &[Tensor], source: Box<dyn StateSource>, steps: u64, optimizer: &mut Optimizer) -> Result<()> {
        self.restored = Some(source);
        optimizer.restore(Vec::new(), steps);
        Ok(())
    }

    /// This rank's shards of the parameters and of the optimizer state, as flat ranges of the
    /// parameters: nothing is gathered.
    fn held_shards(&mut self, _params: &[Tensor], optimizer: &Optimizer) -> Result<Option<HeldShards>> {
        if self.units.is_empty() {
            return Err(Error::exchange("zero 3", "a checkpoint before the parameters were sharded"));
        }
        let slots = optimizer.kind().slots().len();
        let state: Vec<Vec<Option<Tensor>>> = (0..slots).map(|s| optimizer.state(s).iter().map(|t| t.as_ref().map(Tensor::shallow_clone)).collect()).collect();
        let params = self.pieces.iter().zip(&self.weights).map(|(p, w)| FlatPiece { param: p.tensor, at: p.at, data: w.shallow_clone() }).collect();
        Ok(Some(HeldShards { state: flat_pieces(&self.pieces, &state, slots)?, params, writes: self.writes_shards }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit of a bias (3) and a conv weight of 2x3x2x2, flat as gathered: standard order.
    fn gathered_unit() -> (Bucket, Vec<Vec<i64>>, Tensor) {
        let layout = Bucket { slots: vec![Slot { tensor: 0, offset: 0, len: 3 }, Slot { tensor: 1, offset: 3, len: 24 }], len: 27 };
        (layout, vec![vec![3], vec![2, 3, 2, 2]], Tensor::arange(27, (Kind::Float, Device::Cpu)))
    }

    /// A channels-last parameter computes channels-last, in the gathered buffer's own memory
    /// (no copy made per step), with its standard values; the others are plain views.
    #[test]
    fn a_gathered_conv_weight_is_installed_channels_last_in_place() {
        let (layout, shapes, gathered) = gathered_unit();
        let scratch = Tensor::full([24], -1.0, (Kind::Float, Device::Cpu));
        let weight = &layout.slots[1];
        tch::no_grad(|| reorder_to_channels_last(&gathered.narrow(0, 3, 24), &shapes[1], &scratch)).unwrap();
        let view = parameter_view(&gathered, weight, &shapes[1], true).unwrap();
        assert!(raw::is_channels_last(&view), "strides {:?}", view.stride());
        assert!(!view.is_contiguous(), "a 2x3x2x2 weight channels-last is not contiguous");
        assert_eq!(view.data_ptr() as usize, gathered.data_ptr() as usize + 3 * 4, "the weight is not the buffer's elements");
        let standard = Tensor::arange_start(3, 27, (Kind::Float, Device::Cpu)).view([2, 3, 2, 2]);
        assert!(view.equal(&standard), "the channels-last weight's values are not the gathered ones");
        // In memory: NHWC, so the buffer's elements moved (channel fastest).
        assert_eq!(Vec::<f32>::try_from(gathered.narrow(0, 3, 6)).unwrap(), [3.0, 7.0, 11.0, 4.0, 8.0, 12.0]);
        let bias = parameter_view(&gathered, &layout.slots[0], &shapes[0], false).unwrap();
        assert_eq!(Vec::<f32>::try_from(&bias).unwrap(), [0.0, 1.0, 2.0]);
    }

    /// Channels-last moves elements only where C and H x W exceed 1: a plain run's
    /// `contiguous(channels_last)` leaves the others' standard strides, and so does stage 3.
    #[test]
    fn only_weights_whose_order_changes_are_reordered() {
        assert!(reorders(&[2, 3, 2, 2]));
        assert!(reorders(&[1, 3, 2, 2]), "one filter: its elements still move");
        assert!(!reorders(&[64, 1, 7, 7]), "one input channel (a grey image's first convolution)");
        assert!(!reorders(&[128, 64, 1, 1]), "a 1x1 convolution");
        assert!(!reorders(&[10, 3]));
        let plain = raw::channels_last(&Tensor::zeros([64, 1, 7, 7], (Kind::Float, Device::Cpu))).unwrap();
        assert_eq!(plain.stride(), [49, 49, 7, 1], "libtorch leaves a weight of one input channel as it is");
        let plain = raw::channels_last(&Tensor::zeros([2, 3, 2, 2], (Kind::Float, Device::Cpu))).unwrap();
        assert_eq!(plain.stride(), raw::channels_last_strides(&[2, 3, 2, 2]).unwrap());
    }

    /// Backward through a convolution gives a channels-last weight a channels-last gradient;
    /// it is packed in the standard order the shards keep (the order a plain run's gradient
    /// has), and a missing gradient as zeros.
    #[test]
    fn a_channels_last_gradient_is_packed_in_the_standard_order() {
        let (layout, shapes, gathered) = gathered_unit();
        let scratch = Tensor::zeros([24], (Kind::Float, Device::Cpu));
        tch::no_grad(|| reorder_to_channels_last(&gathered.narrow(0, 3, 24), &shapes[1], &scratch)).unwrap();
        let params = [Tensor::zeros([0], (Kind::Float, Device::Cpu)).set_requires_grad(true), Tensor::zeros([0], (Kind::Float, Device::Cpu)).set_requires_grad(true)];
        tch::no_grad(|| params[1].shallow_clone().set_data(&parameter_view(&gathered, &layout.slots[1], &shapes[1], true).unwrap()));
        let x = raw::channels_last(&Tensor::arange(2 * 3 * 4 * 4, (Kind::Float, Device::Cpu)).view([2, 3, 4, 4]).sin()).unwrap();
        x.conv2d(&params[1], None::<Tensor>, [1, 1], [0, 0], [1, 1], 1).square().sum(Kind::Float).backward();
        let grad = params[1].grad();
        assert!(raw::is_channels_last(&grad) && !grad.is_contiguous(), "the gradient's strides {:?}", grad.stride());
        let mut packed = Tensor::full([27], f64::NAN, (Kind::Float, Device::Cpu));
        tch::no_grad(|| pack_grads_in_order(&layout, &shapes, &params, &mut packed)).unwrap();
        assert!(packed.narrow(0, 3, 24).equal(&grad.contiguous().view([-1])), "packed in memory order, not the standard one");
        assert!(packed.narrow(0, 0, 3).equal(&Tensor::zeros([3], (Kind::Float, Device::Cpu))));
        // The same gradient as a plain (contiguous) weight's, to f32 rounding of another kernel.
        let plain = Tensor::arange_start(3, 27, (Kind::Float, Device::Cpu)).view([2, 3, 2, 2]).set_requires_grad(true);
        x.contiguous().conv2d(&plain, None::<Tensor>, [1, 1], [0, 0], [1, 1], 1).square().sum(Kind::Float).backward();
        let diff = (packed.narrow(0, 3, 24) - plain.grad().view([-1])).abs().max().double_value(&[]);
        let scale = plain.grad().abs().max().double_value(&[]);
        assert!(diff <= 1e-5 * scale, "{diff} of {scale}");
    }
}
