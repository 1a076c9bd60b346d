//! `ring`: a ring all-reduce on MPI point-to-point calls only: reduce-scatter, then all-gather.
//!
//! The buffer is cut into one chunk per rank. In each of the n-1 reduce-scatter steps every
//! rank sends one chunk to its right neighbour and adds the chunk arriving from its left into
//! its own copy; afterwards each rank holds one chunk summed over all ranks. The n-1 all-gather
//! steps then pass the summed chunks around the ring. Each rank sends 2(n-1)/n of the buffer,
//! the least any all-reduce can.
//!
//! Within a step the chunk travels in segments of `--segment-kb`: all receives are posted
//! first, and each segment is reduced as soon as it arrives while the later ones are still in
//! flight, so reduction overlaps communication. A mean is scaled in the last reduce-scatter
//! step, at no extra pass. Ranks sit on the ring in node order, so that only two ring links
//! per node cross the network.
//!
//! When every rank of the ring is on one node, host buffers go through node-shared memory
//! instead of MPI messages (`--ring-transport`, [`SharedRing`]): the same schedule and sums,
//! without the copy into a receive buffer that every MPI message costs.

use std::ops::Range;

use mpi::topology::{Process, SimpleCommunicator};
use mpi::traits::*;
use tch::Tensor;

use crate::element::{accumulate, accumulate_scaled, Dtype, Element};
use crate::error::{Error, Result};
use crate::exchange::buckets::Fusion;
use mpi::Tag;
use crate::exchange::config::{ExchangeConfig, RingTransport};
use crate::exchange::shared_ring::{Room, SharedRing};
use crate::exchange::staging::{wait_for_stream, Scratch, Staging};
use crate::exchange::strategy::{all_reduce_is_identity, allreduce_bus_factor, common_dtype, Checkpointed, DataPath, Described, ExchangeReport, Reduce, ReduceOp, Role, Training};
use crate::exchange::zero::{expect_algorithm, Phases, ShardAlgorithm, ShardedCollectives};
use crate::plan::ring::RingSchedule;
use crate::plan::shard::ShardInfo;
use crate::raw;
use crate::topology::World;

/// The communication half of the strategy: the ring and its scratch space.
struct Ring {
    comm: SimpleCommunicator,
    n: usize,
    pos: usize,
    left: i32,
    right: i32,
    segment_bytes: usize,
    /// Receive space: two chunks on the host, one on the device (direct path).
    scratch: Scratch,
    /// The transport for host buffers when every rank shares one node (`--ring-transport`).
    shared: Option<SharedRing>,
    /// `--ring-transport shm`: no falling back to MPI messages when the window has no room.
    shared_required: bool,
}

impl Ring {
    fn neighbours(&self) -> (Process<'_>, Process<'_>) {
        (self.comm.process_at_rank(self.left), self.comm.process_at_rank(self.right))
    }

    /// Hops `run` of the ring on a host buffer, in place: `0..n-1` is the reduce-scatter (this
    /// rank's chunk ends summed), `n-1..2(n-1)` the all-gather (its chunk goes around), the
    /// two together the all-reduce. Pipelined across hops: a segment received and reduced at
    /// one hop is sent on at once for the next, while the chunk's later segments are still
    /// arriving, so the ring never waits for a whole chunk between hops.
    fn run_hops_host<E: Element>(&mut self, buf: &mut [E], op: ReduceOp, run: Range<usize>) -> Result<()> {
        let n = self.n;
        if n == 1 || buf.is_empty() || run.is_empty() {
            return Ok(());
        }
        let schedule = RingSchedule::new(buf.len(), n, self.pos);
        let pieces = schedule.pieces_per_chunk((self.segment_bytes / std::mem::size_of::<E>()).max(1));
        let largest = schedule.largest_chunk();
        // Two receive areas for reduce-scatter hops, alternating: hop h+1's receives are posted
        // while hop h's arrivals are still being added.
        let scratch: &mut [E] = self.scratch.host(2 * largest);
        let scratch_bounds: Vec<Range<usize>> = (0..2)
            .flat_map(|area| ShardInfo::all(largest, pieces).into_iter().map(move |p| area * largest + p.offset..area * largest + p.end()))
            .collect();
        let (comm, left, right) = (&self.comm, self.left, self.right);
        let (first_hop, hops) = (run.start, run.end.min(schedule.hops()));
        let rs_hops = n - 1;
        let scale = (op == ReduceOp::Mean).then_some(1.0 / n as f32);
        raw::with_segments(buf, schedule.piece_bounds(pieces), |data| {
            raw::with_segments(scratch, scratch_bounds, |spare| {
                let piece = |chunk: usize, k: usize| chunk * pieces + k;
                let area = |hop: usize, k: usize| (hop % 2) * pieces + k;
                // Receives of hop h: into a scratch area (reduce-scatter) or in place (all-gather).
                let post_receives = |hop: usize, data: &mut raw::Segments<'_, E>, spare: &mut raw::Segments<'_, E>| -> Result<()> {
                    let chunk = schedule.hop_chunks(hop).1;
                    for k in 0..pieces {
                        let len = data.len_of(piece(chunk, k));
                        if hop < rs_hops {
                            spare.receive(area(hop, k), len, comm, left, hop as Tag)?;
                        } else {
                            data.receive(piece(chunk, k), len, comm, left, hop as Tag)?;
                        }
                    }
                    Ok(())
                };
                post_receives(first_hop, data, spare)?;
                let first = schedule.hop_chunks(first_hop).0;
                for k in 0..pieces {
                    data.send(piece(first, k), data.len_of(piece(first, k)), comm, right, first_hop as Tag)?;
                }
                for hop in first_hop..hops {
                    if hop + 1 < hops {
                        post_receives(hop + 1, data, spare)?;
                    }
                    let chunk = schedule.hop_chunks(hop).1;
                    for k in 0..pieces {
                        let len = data.len_of(piece(chunk, k));
                        if hop < rs_hops {
                            // Add the arrival into this rank's copy; the last reduce-scatter hop
                            // also scales a mean, at no extra pass.
                            let arrived = spare.get(area(hop, k), len)?;
                            let acc = data.get_mut(piece(chunk, k), len)?;
                            match scale.filter(|_| hop + 1 == rs_hops) {
                                Some(f) => accumulate_scaled(acc, arrived, f),
                                None => accumulate(acc, arrived),
                            }
                        } else {
                            data.wait(piece(chunk, k))?;
                        }
                        // What arrived at this hop is what the next one sends.
                        if hop + 1 < hops {
                            data.send(piece(chunk, k), len, comm, right, (hop + 1) as Tag)?;
                        }
                    }
                }
                Ok(())
            })
        })
    }

    /// All-reduce of a device buffer with a CUDA-aware MPI: device pointers go to MPI, and the
    /// reduction runs on the GPU. Each step waits for the GPU before sending what it computed.
    fn all_reduce_device<E: Element>(&mut self, bucket: &mut Tensor, op: ReduceOp, phases: Phases) -> Result<()> {
        let n = self.n;
        let len = bucket.numel();
        if n == 1 || len == 0 {
            return Ok(());
        }
        let schedule = RingSchedule::new(len, n, self.pos);
        let scratch = self.scratch.device_like(bucket, schedule.largest_chunk())?;
        let device = bucket.device();
        let view = |t: &Tensor, r: &Range<usize>| t.narrow(0, r.start as i64, r.len() as i64);
        for s in (0..n - 1).filter(|_| phases.reduce_scatter) {
            let (send, recv) = schedule.reduce_scatter(s);
            let mut outgoing = view(bucket, &send);
            let mut incoming = view(&scratch, &(0..recv.len()));
            self.exchange_device::<E>(&mut outgoing, &mut incoming)?;
            let mut target = view(bucket, &recv);
            let _ = target.f_add_(&incoming)?;
            if op == ReduceOp::Mean && s == n - 2 {
                let _ = target.f_mul_scalar_(1.0 / n as f64)?;
            }
            // The next step sends what this one added: MPI must not read it before the GPU wrote it.
            wait_for_stream(device)?;
        }
        for s in (0..n - 1).filter(|_| phases.all_gather) {
            let (send, recv) = schedule.all_gather(s);
            let mut outgoing = view(bucket, &send);
            let mut target = view(bucket, &recv);
            self.exchange_device::<E>(&mut outgoing, &mut target)?;
        }
        Ok(())
    }

    /// Sends `outgoing` right while receiving `incoming` from the left, device memory both.
    fn exchange_device<E: Element>(&self, outgoing: &mut Tensor, incoming: &mut Tensor) -> Result<()> {
        let (left, right) = self.neighbours();
        // SAFETY: both are views of the ring's bucket or its scratch, which nothing but this
        // exchange touches while it runs; the device path is only taken with a CUDA-aware MPI
        // (DataPath::Direct), and the stream was waited for after every kernel writing them.
        let send_buf = unsafe { raw::device_buffer_mut::<E>(outgoing)? };
        let mut recv_buf = unsafe { raw::device_buffer_mut::<E>(incoming)? };
        mpi::request::scope(|scope| {
            let receive = left.immediate_receive_into(scope, &mut recv_buf);
            let send = right.immediate_send(scope, &send_buf);
            receive.wait_without_status();
            send.wait_without_status();
        });
        Ok(())
    }

    fn all_reduce(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp) -> Result<()> {
        self.run_phases(bucket, dtype, op, Phases::BOTH)
    }

    /// Whether `bytes` go through node-shared memory. Where the node's shared-memory file
    /// system has no room for the window (every rank learns it at the same call), the ring
    /// goes over MPI messages from then on, and says so once; with `--ring-transport shm` that
    /// is an error instead.
    fn shared_memory_for(&mut self, bytes: usize) -> Result<bool> {
        let Some(shared) = &mut self.shared else { return Ok(false) };
        if bytes == 0 {
            return Ok(true); // nothing to place: the shared ring returns at once
        }
        let Room::Short { dir, free, need } = shared.reserve(bytes)? else { return Ok(true) };
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let what = format!(
            "the ring's node-shared window for {} ranks needs {:.1} MiB in {} and {:.1} MiB are free (a container's /dev/shm is 64 MiB unless raised, e.g. docker run --shm-size)",
            self.n, mib(need), dir.display(), mib(free)
        );
        if self.shared_required {
            // Every rank stops here alike (the answer came from an all-reduce): rank 0 says why.
            let error = Error::usage(format!("--ring-transport shm: {what}; use --ring-transport auto or mpi, or a smaller --bucket-mib"));
            return Err(if self.comm.rank() == 0 { Error::Agreed(Box::new(error)) } else { Error::Reported(0) });
        }
        if self.pos == 0 {
            log::warn!("{what}: the ring goes over MPI point-to-point instead (--ring-transport mpi says so from the start)");
        }
        // Collective, and every rank is here: the Short answer came from an all-reduce.
        if let Some(mut shared) = self.shared.take() {
            shared.release();
        }
        Ok(false)
    }

    /// The reduce-scatter, the all-gather or both, on a host or (CUDA-aware MPI) device buffer.
    fn run_phases(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp, phases: Phases) -> Result<()> {
        let rs_hops = self.n.max(1) - 1;
        let hops = if phases.reduce_scatter { 0 } else { rs_hops }..if phases.all_gather { 2 * rs_hops } else { rs_hops };
        crate::with_element!(dtype, E => {
            if bucket.device().is_cuda() {
                self.all_reduce_device::<E>(bucket, op, phases)
            } else {
                // SAFETY: the bucket is a fusion buffer, a staging buffer, ZeRO's bucket buffer
                // or the flat view of a gradient whose backward is done; nothing else reads or
                // writes it meanwhile.
                let buf = unsafe { raw::host_slice_mut::<E>(bucket)? };
                if self.shared_memory_for(std::mem::size_of_val(buf))? {
                    let shared = self.shared.as_mut().expect("checked just above");
                    return shared.run::<E>(buf, op, phases);
                }
                self.run_hops_host::<E>(buf, op, hops)
            }
        })
    }
}


pub struct RingAllreduce {
    ring: Ring,
    rank: usize,
    path: DataPath,
    fusion: Fusion,
    staging: Staging,
}

impl RingAllreduce {
    pub fn new(world: &World, config: &ExchangeConfig) -> Result<RingAllreduce> {
        let order = world.ring_order();
        let n = order.len();
        let pos = order.iter().position(|&r| r == world.rank).expect("every rank is on the ring");
        if config.segment_bytes == 0 {
            return Err(Error::usage("--segment-kib 0: the ring needs segments of at least 1 KiB"));
        }
        let right = order[(pos + 1) % n];
        // Where this rank sits, for checking a launch's layout (RUST_LOG=debug on every rank):
        // the node-aware order crosses the network once per node.
        let crosses = world.node_of[right as usize] != world.node_of[world.rank as usize];
        log::debug!(
            "ring: rank {} on node {} (node-local rank {} of {}), right neighbour rank {right}{}",
            world.rank, world.node_of[world.rank as usize], world.local_rank, world.local_size,
            if crosses { ", across the network" } else { "" }
        );
        // Node-shared memory only where the ranks are one node both to the launch's layout
        // (which tests may fake) and to MPI (which must map the window into every rank).
        let one_node = n > 1 && world.nodes() == 1;
        let shared = match config.ring_transport {
            RingTransport::Mpi => None,
            _ if n == 1 => None,
            transport => {
                let shared = one_node.then(|| SharedRing::new(&world.comm, n, pos)).flatten();
                if shared.is_none() && transport == RingTransport::Shm {
                    return Err(Error::usage(format!(
                        "--ring-transport shm: the {n} ranks are on {} node(s) that do not share memory, and the shared-memory ring needs one; use --ring-transport auto or mpi",
                        world.nodes()
                    )));
                }
                shared
            }
        };
        if world.is_root() {
            log::info!("ring: {n} ranks, {}", if shared.is_some() { "node-shared memory (one node)" } else { "MPI point-to-point" });
        }
        Ok(RingAllreduce {
            ring: Ring {
                // A communicator of its own: ring messages never match anyone else's.
                comm: world.comm.duplicate(),
                n,
                pos,
                left: order[(pos + n - 1) % n],
                right: order[(pos + 1) % n],
                segment_bytes: config.segment_bytes,
                scratch: Scratch::default(),
                shared,
                shared_required: config.ring_transport == RingTransport::Shm,
            },
            rank: world.rank as usize,
            path: DataPath::choose(config.device, config.cuda_aware),
            fusion: Fusion::new(config.bucket_bytes, None),
            staging: Staging::new(),
        })
    }
}

impl RingAllreduce {
    /// One flat bucket, already where MPI can read it (host memory, or device memory with a
    /// CUDA-aware MPI): what `auto` hands over when it picks the ring.
    pub fn reduce_flat(&mut self, bucket: &mut Tensor, dtype: Dtype, op: ReduceOp) -> Result<()> {
        self.ring.all_reduce(bucket, dtype, op)
    }

    /// Whether host buffers go through node-shared memory (else MPI messages).
    pub fn in_shared_memory(&self) -> bool {
        self.ring.shared.is_some()
    }

    /// How the ring's chunks travel, as runs.jsonl and bench.jsonl say it: GPU buffers handed
    /// to a CUDA-aware MPI go as MPI messages whatever the node shares (the shared window holds
    /// host buffers: the staged path's and a CPU rank's).
    pub fn transport(&self) -> &'static str {
        if self.in_shared_memory() && self.path != DataPath::Direct { "shared-memory" } else { "mpi" }
    }
}

impl Described for RingAllreduce {
    fn name(&self) -> &'static str {
        "ring"
    }

    fn bus_factor(&self) -> f64 {
        allreduce_bus_factor(self.ring.n)
    }

    fn waits_for(&self) -> String {
        // Named by world rank: with pipelines or tensor parallelism the ring runs over a
        // sub-communicator whose numbers name no process in the job's log.
        let world = crate::topology::world_ranks_of(&self.ring.comm);
        let of = |r: i32| world.get(r as usize).copied().unwrap_or(-1);
        format!("world rank {} (its left neighbour, sending) and world rank {} (its right, receiving)", of(self.ring.left), of(self.ring.right))
    }

    fn report(&self) -> ExchangeReport {
        let mut extra = serde_json::Map::new();
        extra.insert("segment_kb".into(), (self.ring.segment_bytes / 1024).into());
        extra.insert("ring_transport".into(), self.transport().into());
        self.staging.report(self.path, extra)
    }
}

impl Reduce for RingAllreduce {
    fn all_reduce(&mut self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        if all_reduce_is_identity(self.ring.n) {
            return Ok(());
        }
        let dtype = common_dtype(tensors)?;
        let ring = &mut self.ring;
        // Buckets go back to back; on the staged path the next one is copied to the host while
        // the current one circles the ring.
        self.staging.reduce_fused(&mut self.fusion, self.path, tensors, |_, bucket| ring.all_reduce(bucket, dtype, op))
    }

    fn finish(&mut self, _params: &mut [Tensor]) -> Result<()> {
        // Every rank is here together: the one place the shared window can be freed (a drop may
        // come on an error path, where a peer would never join the free).
        if let Some(shared) = &mut self.ring.shared {
            shared.release();
        }
        Ok(())
    }
}

impl Training for RingAllreduce {
    fn role(&self) -> Role {
        Role::Worker { index: self.rank, count: self.ring.n }
    }
}

impl Checkpointed for RingAllreduce {}

impl ShardedCollectives for RingAllreduce {
    fn choose(&self, _len: usize, _dtype: Dtype) -> ShardAlgorithm {
        ShardAlgorithm::Ring
    }

    fn shard(&self, len: usize, _algorithm: ShardAlgorithm) -> Range<usize> {
        RingSchedule::new(len, self.ring.n, self.ring.pos).reduced_chunk()
    }

    fn reduce_scatter(&mut self, buffer: &mut Tensor, dtype: Dtype, op: ReduceOp, algorithm: ShardAlgorithm) -> Result<()> {
        expect_algorithm("ring", ShardAlgorithm::Ring, algorithm)?;
        self.ring.run_phases(buffer, dtype, op, Phases::REDUCE_SCATTER)
    }

    fn all_gather(&mut self, buffer: &mut Tensor, dtype: Dtype, algorithm: ShardAlgorithm) -> Result<()> {
        expect_algorithm("ring", ShardAlgorithm::Ring, algorithm)?;
        self.ring.run_phases(buffer, dtype, ReduceOp::Sum, Phases::ALL_GATHER)
    }
}
