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
use crate::exchange::buckets::unpack;
use crate::exchange::staging::{wait_for_stream, HostPool};
use crate::exchange::strategy::{common_dtype, Checkpointed, DataPath, Described, ExchangeReport, FlatPiece, HeldBytes, HeldShards, Reduce, ReduceOp, Role, StateSource, Training, UnitShards, UnitTimes, WholeSource, WholeState};
use crate::exchange::zero::{cut_pieces, flat_pieces, pack_grads, pieces, ready_for_mpi, Piece, ShardAlgorithm, ShardedCollectives};
use crate::optim::{FiniteCheck, Optimizer, Pieces};
use crate::plan::buckets::Bucket;
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

    /// Bytes of the reused buffers (gathers, packed gradients).
    fn buffer_bytes(&self) -> usize {
        let pooled = self.free.iter().chain(self.in_use.iter().flatten()).chain(self.packed.iter().flatten());
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
}

impl UnitShards for FullyShardedExchange {
    fn shard(&mut self, units: &[Bucket], params: &[Tensor], shapes: &[Vec<i64>], range: &mut dyn FnMut(usize, i64, i64) -> Result<Tensor>, optimizer: &mut Optimizer) -> Result<()> {
        self.dtype = common_dtype(params)?;
        (self.kind, self.device) = params.first().map_or((Kind::Float, Device::Cpu), |p| (p.kind(), p.device()));
        self.shapes = shapes.to_vec();
        let elements: usize = shapes.iter().map(|s| s.iter().product::<i64>() as usize).sum();
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
                let view = gathered.f_narrow(0, slot.offset as i64, slot.len as i64)?.f_view(self.shapes[slot.tensor].as_slice())?;
                params[slot.tensor].shallow_clone().f_set_data(&view)?;
            }
            Ok(())
        })
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
        pack_grads(layout, params, &mut packed)?;
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
