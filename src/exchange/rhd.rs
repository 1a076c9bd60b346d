//! `rhd`: recursive halving and doubling (Rabenseifner's all-reduce, as MPICH runs it for long
//! messages) on MPI point-to-point calls.
//!
//! Among p = 2^k ranks, the reduce-scatter halves the vector log2(p) times: at each step a rank
//! swaps half of its current range with a partner (the rank whose number differs in one bit,
//! farthest first) and adds the half it keeps; afterwards each rank holds one p-th, summed. The
//! all-gather retraces the steps, doubling the range each time. Every rank sends 2(p-1)/p of the
//! buffer, as in a ring, but in 2 log2(p) steps instead of 2(n-1): the latency term that makes
//! a ring slow for small buffers on many ranks.
//!
//! Recursive doubling, MPICH's algorithm for short messages, lives here too: the same partners
//! and the same pre- and post-step, but every step swaps the whole buffer and adds it, so
//! log2(p) messages instead of 2 log2(p), each of the whole size. `auto` hands it the buckets
//! whose time the per-message latency dominates.
//!
//! Other rank counts take the usual pre- and post-step: of the first 2r ranks (r = n - p), each
//! even rank hands its whole buffer to the odd rank after it and waits; the odd ranks and the
//! ranks from 2r on (p of them) run the algorithm; the odd ranks then hand the result back.

use std::ops::Range;

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use tch::Tensor;

use crate::element::{accumulate, Dtype, Element};
use crate::error::{Error, Result};
use crate::exchange::buckets::Fusion;
use crate::exchange::config::ExchangeConfig;
use crate::exchange::staging::{wait_for_stream, Scratch, Staging};
use crate::exchange::strategy::{all_reduce_is_identity, allreduce_bus_factor, common_dtype, Checkpointed, DataPath, Described, ExchangeReport, Reduce, ReduceOp, Role, Training};
use crate::exchange::zero::{expect_algorithm, Phases, ShardAlgorithm, ShardedCollectives};
use crate::plan::rhd::{Extra, RhdSchedule};
use crate::raw;
use crate::topology::World;

/// The communication half of the strategy.
struct Halving {
    comm: SimpleCommunicator,
    n: usize,
    rank: usize,
    segment_bytes: usize,
    /// Receive space: the largest step's range (the whole buffer for recursive doubling and for
    /// a rank that absorbs another's).
    scratch: Scratch,
}

/// Sends `outgoing` to `partner` while receiving `incoming` from it, in segments.
fn swap_host<E: Element>(comm: &SimpleCommunicator, segment_bytes: usize, partner: usize, outgoing: &[E], incoming: &mut [E]) {
    let seg = (segment_bytes / std::mem::size_of::<E>()).max(1);
    let peer = comm.process_at_rank(partner as i32);
    mpi::request::scope(|scope| {
        let receives: Vec<_> = E::as_wire_mut(incoming).chunks_mut(seg).map(|part| peer.immediate_receive_into(scope, part)).collect();
        let sends: Vec<_> = bytemuck::cast_slice::<E, E::Wire>(outgoing).chunks(seg).map(|part| peer.immediate_send(scope, part)).collect();
        receives.into_iter().for_each(|r| r.wait_without_status());
        sends.into_iter().for_each(|r| r.wait_without_status());
    });
    crate::watchdog::progress();
}

impl Halving {
    /// The reduce-scatter (the pre-step, the halving, the mean on the owned range), the
    /// all-gather (the doubling, the post-step), or both, on a host buffer in place.
    fn run_host<E: Element>(&mut self, buf: &mut [E], op: ReduceOp, phases: Phases) -> Result<()> {
        if self.n == 1 || buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let schedule = RhdSchedule::new(len, self.n, self.rank);
        let scratch: &mut [E] = self.scratch.host(schedule.largest_receive(len));
        let scale = (op == ReduceOp::Mean).then_some(1.0 / self.n as f32);
        if let Extra::SitsOut { partner } = schedule.extra {
            let peer = self.comm.process_at_rank(partner as i32);
            if phases.reduce_scatter {
                peer.send(bytemuck::cast_slice::<E, E::Wire>(buf));
            }
            if phases.all_gather {
                peer.receive_into(E::as_wire_mut(buf));
            }
            crate::watchdog::progress();
            return Ok(());
        }
        if phases.reduce_scatter {
            if let Extra::Absorbs { partner } = schedule.extra {
                let incoming = &mut scratch[..len];
                self.comm.process_at_rank(partner as i32).receive_into(E::as_wire_mut(incoming));
                accumulate(buf, incoming);
                crate::watchdog::progress();
            }
            for step in &schedule.halving {
                let incoming = &mut scratch[..step.recv.len()];
                swap_host(&self.comm, self.segment_bytes, step.partner, &buf[step.send.clone()], incoming);
                accumulate(&mut buf[step.recv.clone()], incoming);
            }
            if let Some(f) = scale {
                // One pass over the owned p-th: the mean, before the all-gather spreads it.
                let owned = &mut buf[schedule.owned.clone()];
                for v in owned.iter_mut() {
                    *v = E::from_f32(v.to_f32() * f);
                }
            }
        }
        if phases.all_gather {
            for step in &schedule.doubling {
                let (send, recv) = split_disjoint(buf, step.send.clone(), step.recv.clone());
                swap_host(&self.comm, self.segment_bytes, step.partner, send, recv);
            }
            if let Extra::Absorbs { partner } = schedule.extra {
                self.comm.process_at_rank(partner as i32).send(bytemuck::cast_slice::<E, E::Wire>(buf));
                crate::watchdog::progress();
            }
        }
        Ok(())
    }

    /// Recursive doubling on a host buffer, in place: the pre-step, log2(p) swaps of the whole
    /// buffer with the halving's partners, each followed by an add, the mean, the post-step.
    /// Partners add the same two partial sums in opposite order, and IEEE addition is
    /// commutative, so every rank ends with the same bits.
    fn doubling_host<E: Element>(&mut self, buf: &mut [E], op: ReduceOp) -> Result<()> {
        if self.n == 1 || buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let schedule = RhdSchedule::new(len, self.n, self.rank);
        let incoming: &mut [E] = self.scratch.host(len);
        match schedule.extra {
            Extra::SitsOut { partner } => {
                let peer = self.comm.process_at_rank(partner as i32);
                peer.send(bytemuck::cast_slice::<E, E::Wire>(buf));
                peer.receive_into(E::as_wire_mut(buf));
                crate::watchdog::progress();
                return Ok(());
            }
            Extra::Absorbs { partner } => {
                self.comm.process_at_rank(partner as i32).receive_into(E::as_wire_mut(incoming));
                accumulate(buf, incoming);
                crate::watchdog::progress();
            }
            Extra::None => {}
        }
        for step in &schedule.halving {
            swap_host(&self.comm, self.segment_bytes, step.partner, buf, incoming);
            accumulate(buf, incoming);
        }
        if op == ReduceOp::Mean {
            let f = 1.0 / self.n as f32;
            buf.iter_mut().for_each(|v| *v = E::from_f32(v.to_f32() * f));
        }
        if let Extra::Absorbs { partner } = schedule.extra {
            self.comm.process_at_rank(partner as i32).send(bytemuck::cast_slice::<E, E::Wire>(buf));
            crate::watchdog::progress();
        }
        Ok(())
    }

    /// Recursive doubling on a device buffer (CUDA-aware MPI, additions on the GPU).
    fn doubling_device<E: Element>(&mut self, bucket: &mut Tensor, op: ReduceOp) -> Result<()> {
        let len = bucket.numel();
        if self.n == 1 || len == 0 {
            return Ok(());
        }
        let schedule = RhdSchedule::new(len, self.n, self.rank);
        let device = bucket.device();
        let mut incoming = self.scratch.device_like(bucket, len)?;
        match schedule.extra {
            Extra::SitsOut { partner } => {
                self.swap_device::<E>(partner, Some(&mut bucket.shallow_clone()), None)?;
                self.swap_device::<E>(partner, None, Some(&mut bucket.shallow_clone()))?;
                return Ok(());
            }
            Extra::Absorbs { partner } => {
                self.swap_device::<E>(partner, None, Some(&mut incoming))?;
                let _ = bucket.f_add_(&incoming)?;
                wait_for_stream(device)?;
            }
            Extra::None => {}
        }
        for step in &schedule.halving {
            self.swap_device::<E>(step.partner, Some(&mut bucket.shallow_clone()), Some(&mut incoming))?;
            let _ = bucket.f_add_(&incoming)?;
            wait_for_stream(device)?;
        }
        if op == ReduceOp::Mean {
            let _ = bucket.f_mul_scalar_(1.0 / self.n as f64)?;
            wait_for_stream(device)?;
        }
        if let Extra::Absorbs { partner } = schedule.extra {
            self.swap_device::<E>(partner, Some(&mut bucket.shallow_clone()), None)?;
        }
        Ok(())
    }

    fn all_reduce_doubling(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp) -> Result<()> {
        crate::with_element!(dtype, E => {
            if bucket.device().is_cuda() {
                self.doubling_device::<E>(bucket, op)
            } else {
                // SAFETY: as in run_phases: a buffer of this exchange's, or the flat view of a
                // gradient whose backward is done; nothing else touches it meanwhile.
                self.doubling_host::<E>(unsafe { raw::host_slice_mut::<E>(bucket)? }, op)
            }
        })
    }

    /// With a CUDA-aware MPI: device pointers go to MPI, additions run on the GPU.
    fn run_device<E: Element>(&mut self, bucket: &mut Tensor, op: ReduceOp, phases: Phases) -> Result<()> {
        let len = bucket.numel();
        if self.n == 1 || len == 0 {
            return Ok(());
        }
        let schedule = RhdSchedule::new(len, self.n, self.rank);
        let device = bucket.device();
        let scratch = self.scratch.device_like(bucket, schedule.largest_receive(len))?;
        let view = |t: &Tensor, r: Range<usize>| t.narrow(0, r.start as i64, r.len() as i64);
        if let Extra::SitsOut { partner } = schedule.extra {
            if phases.reduce_scatter {
                self.swap_device::<E>(partner, Some(&mut bucket.shallow_clone()), None)?;
            }
            if phases.all_gather {
                self.swap_device::<E>(partner, None, Some(&mut bucket.shallow_clone()))?;
            }
            return Ok(());
        }
        if phases.reduce_scatter {
            if let Extra::Absorbs { partner } = schedule.extra {
                let mut incoming = view(&scratch, 0..len);
                self.swap_device::<E>(partner, None, Some(&mut incoming))?;
                let _ = bucket.f_add_(&incoming)?;
                wait_for_stream(device)?;
            }
            for step in &schedule.halving {
                let mut incoming = view(&scratch, 0..step.recv.len());
                self.swap_device::<E>(step.partner, Some(&mut view(bucket, step.send.clone())), Some(&mut incoming))?;
                let _ = view(bucket, step.recv.clone()).f_add_(&incoming)?;
                wait_for_stream(device)?;
            }
            if op == ReduceOp::Mean {
                let _ = view(bucket, schedule.owned.clone()).f_mul_scalar_(1.0 / self.n as f64)?;
                wait_for_stream(device)?;
            }
        }
        if phases.all_gather {
            for step in &schedule.doubling {
                self.swap_device::<E>(step.partner, Some(&mut view(bucket, step.send.clone())), Some(&mut view(bucket, step.recv.clone())))?;
            }
            if let Extra::Absorbs { partner } = schedule.extra {
                self.swap_device::<E>(partner, Some(&mut bucket.shallow_clone()), None)?;
            }
        }
        Ok(())
    }

    /// Device memory to and from `partner` (either side may be absent).
    fn swap_device<E: Element>(&self, partner: usize, outgoing: Option<&mut Tensor>, incoming: Option<&mut Tensor>) -> Result<()> {
        let peer = self.comm.process_at_rank(partner as i32);
        // SAFETY: views of this exchange's bucket or scratch, which nothing else touches while it
        // runs; the device path is only taken with a CUDA-aware MPI (DataPath::Direct), and the
        // stream was waited for after every kernel that wrote them.
        let send_buf = outgoing.map(|t| unsafe { raw::device_buffer_mut::<E>(t) }).transpose()?;
        let mut recv_buf = incoming.map(|t| unsafe { raw::device_buffer_mut::<E>(t) }).transpose()?;
        mpi::request::scope(|scope| {
            let receive = recv_buf.as_mut().map(|b| peer.immediate_receive_into(scope, b));
            let send = send_buf.as_ref().map(|b| peer.immediate_send(scope, b));
            if let Some(r) = receive {
                r.wait_without_status();
            }
            if let Some(s) = send {
                s.wait_without_status();
            }
        });
        crate::watchdog::progress();
        Ok(())
    }

    fn all_reduce(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp) -> Result<()> {
        self.run_phases(bucket, dtype, op, Phases::BOTH)
    }

    fn run_phases(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp, phases: Phases) -> Result<()> {
        crate::with_element!(dtype, E => {
            if bucket.device().is_cuda() {
                self.run_device::<E>(bucket, op, phases)
            } else {
                // SAFETY: the bucket is a fusion buffer, a staging buffer, ZeRO's bucket buffer
                // or the flat view of a gradient whose backward is done; nothing else reads or
                // writes it meanwhile.
                self.run_host::<E>(unsafe { raw::host_slice_mut::<E>(bucket)? }, op, phases)
            }
        })
    }
}

/// A shared view of one range of `buf` and a mutable view of another, disjoint, range.
fn split_disjoint<T>(buf: &mut [T], send: Range<usize>, recv: Range<usize>) -> (&[T], &mut [T]) {
    assert!(send.end <= recv.start || recv.end <= send.start, "ranges are disjoint");
    if send.start < recv.start {
        let (a, b) = buf.split_at_mut(recv.start);
        (&a[send], &mut b[..recv.len()])
    } else {
        let (a, b) = buf.split_at_mut(send.start);
        (&b[..send.len()], &mut a[recv])
    }
}

pub struct RhdAllreduce {
    halving: Halving,
    path: DataPath,
    fusion: Fusion,
    staging: Staging,
}

impl RhdAllreduce {
    pub fn new(world: &World, config: &ExchangeConfig) -> Result<RhdAllreduce> {
        if config.segment_bytes == 0 {
            return Err(Error::usage("--segment-kib 0: messages need segments of at least 1 KiB"));
        }
        Ok(RhdAllreduce {
            halving: Halving {
                // A communicator of its own: its messages never match anyone else's.
                comm: world.comm.duplicate(),
                n: world.size as usize,
                rank: world.rank as usize,
                segment_bytes: config.segment_bytes,
                scratch: Scratch::default(),
            },
            path: DataPath::choose(config.device, config.cuda_aware),
            fusion: Fusion::new(config.bucket_bytes, None),
            staging: Staging::new(),
        })
    }

    /// One flat bucket, already where MPI can read it (host memory, or device memory with a
    /// CUDA-aware MPI): what `auto` hands over when it picks this algorithm.
    pub fn reduce_flat(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp) -> Result<()> {
        self.halving.all_reduce(bucket, dtype, op)
    }

    /// The same bucket by recursive doubling (short messages; see the module's notes).
    pub fn reduce_flat_doubling(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp) -> Result<()> {
        self.halving.all_reduce_doubling(bucket, dtype, op)
    }
}

impl Described for RhdAllreduce {
    fn name(&self) -> &'static str {
        "rhd"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.halving.n)
    }

    fn waits_for(&self) -> String {
        let s = RhdSchedule::new(self.halving.n, self.halving.n, self.halving.rank);
        let mut peers: Vec<usize> = s.halving.iter().map(|st| st.partner).collect();
        if let Extra::SitsOut { partner } | Extra::Absorbs { partner } = s.extra {
            peers.push(partner);
        }
        // Named by world rank (see the ring's).
        let world = crate::topology::world_ranks_of(&self.halving.comm);
        let peers: Vec<i32> = peers.iter().map(|&p| world.get(p).copied().unwrap_or(-1)).collect();
        format!("its partners, world ranks {peers:?}")
    }

    fn report(&self) -> ExchangeReport {
        self.staging.report(self.path, serde_json::Map::new())
    }
}

impl Reduce for RhdAllreduce {
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        if all_reduce_is_identity(self.halving.n) {
            return Ok(());
        }
        let dtype = common_dtype(tensors)?;
        let halving = &mut self.halving;
        self.staging.reduce_fused(&mut self.fusion, self.path, tensors, |_, bucket| halving.all_reduce(bucket, dtype, op))
    }
}

impl Training for RhdAllreduce {
    fn role(&self) -> Role {
        Role::Worker { index: self.halving.rank, count: self.halving.n }
    }
}

impl Checkpointed for RhdAllreduce {}

/// ZeRO's halves: shards are balanced only among a power of two of ranks (otherwise the ranks
/// that sit out would own nothing), which `zero_shards_balance` tells.
impl ShardedCollectives for RhdAllreduce {
    fn choose(&self, _len: usize, _dtype: Dtype) -> ShardAlgorithm {
        ShardAlgorithm::Rhd
    }

    fn shard(&self, len: usize, _algorithm: ShardAlgorithm) -> Range<usize> {
        RhdSchedule::new(len, self.halving.n, self.halving.rank).owned
    }

    fn reduce_scatter(&mut self, buffer: &mut Tensor, dtype: Dtype, op: ReduceOp, algorithm: ShardAlgorithm) -> Result<()> {
        expect_algorithm("rhd", ShardAlgorithm::Rhd, algorithm)?;
        self.halving.run_phases(buffer, dtype, op, Phases::REDUCE_SCATTER)
    }

    fn all_gather(&mut self, buffer: &mut Tensor, dtype: Dtype, algorithm: ShardAlgorithm) -> Result<()> {
        expect_algorithm("rhd", ShardAlgorithm::Rhd, algorithm)?;
        self.halving.run_phases(buffer, dtype, ReduceOp::Sum, Phases::ALL_GATHER)
    }
}
