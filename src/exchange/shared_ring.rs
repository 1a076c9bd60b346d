//! The ring's transport when every rank of the ring shares one node: node-shared memory (an
//! MPI-3 shared window) in place of MPI messages.
//!
//! Through MPI, a ring hop on one node costs a copy into the receiver's scratch (Open MPI's
//! single-copy path, `process_vm_readv` in the kernel, measured at about half a user-space
//! memcpy on the development VM), and the add then reads that scratch again. Here each rank
//! reads its left neighbour's partial sum straight from the neighbour's part of the window and
//! adds it to its own data in one pass, writing the result into its own part for its right
//! neighbour. The schedule, and so every sum's operands and their order, is the ring's
//! ([`RingSchedule`]): the results have the same bits as the ring over MPI.
//!
//! Stages run in pieces, as the ring's segments do: stage 0 publishes the chunk the right
//! neighbour adds first, stage t (1..n) is reduce-scatter step t-1. After each piece a rank
//! raises its progress counter, and a rank waits for its neighbour's counter before reading a
//! piece, so that the stages of neighbouring ranks overlap, as the ring's hops do over MPI.
//! Within one call every chunk of a rank's part is written once (stage t writes chunk pos-t),
//! so counters are the only ordering reads need. Between calls, whose chunks may lie elsewhere,
//! a rank writes its part again only once every rank has said (a second counter) that it has
//! finished reading the last call: a barrier, but one that is usually passed at once, long
//! after the others finished, instead of one more synchronisation at the end of every call.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use mpi::topology::SimpleCommunicator;
use mpi::traits::*;

use crate::element::{accumulate_and_copy, sum_into, Element};
use crate::error::{Error, Result};
use crate::exchange::strategy::ReduceOp;
use crate::exchange::zero::Phases;
use crate::plan::ring::RingSchedule;
use crate::raw::{Backoff, SharedWindow};

/// Bytes per piece. On the development VM pieces of 32 KiB to 64 MiB gave the same rate on a
/// 64 MiB buffer (memory-bound); small pieces let buffers of a few MiB overlap their stages.
const PIECE_BYTES: usize = 256 << 10;

pub struct SharedRing {
    /// Made at the first call, grown with the buckets, freed by [`SharedRing::release`].
    window: Option<SharedWindow>,
    /// The node's ranks, numbered by ring position.
    comm: SimpleCommunicator,
    n: usize,
    pos: usize,
    /// Pieces every rank published in the calls since the window was made: the counters'
    /// common starting point (every rank runs the same calls on the same lengths).
    published: u64,
    /// Calls run since the window was made.
    calls: u64,
}

impl SharedRing {
    /// The shared-memory ring of `world`'s ranks, `pos` being this rank's ring position, or None
    /// when they do not all share one node's memory. Collective over `world`.
    pub fn new(world: &SimpleCommunicator, n: usize, pos: usize) -> Option<SharedRing> {
        let comm = world.split_shared(pos as i32);
        // Every rank sees the same sizes, so every rank decides alike.
        (comm.size() as usize == n).then_some(SharedRing { window: None, comm, n, pos, published: 0, calls: 0 })
    }

    /// Makes sure the window holds `bytes` per rank: the current one, or (collectively: every
    /// rank passes the same size, as all exchange the same bucket) a larger one in its place.
    /// A window lives in a file of the node's shared-memory file system, and MPI aborts the job
    /// when that has no room (a container's /dev/shm is 64 MiB by default): where the free space
    /// is short on any rank, nothing is allocated and every rank gets the same `Room::Short`.
    pub fn reserve(&mut self, bytes: usize) -> Result<Room> {
        if self.window.as_ref().is_some_and(|w| w.bytes() >= bytes) {
            return Ok(Room::Ready);
        }
        let dir = crate::mpi_library::shared_window_directory();
        let need = (self.n * SharedWindow::part_bytes(bytes)) as u64;
        // The window being replaced gives its space back first.
        let held = self.window.as_ref().map_or(0, |w| (self.n * SharedWindow::part_bytes(w.bytes())) as u64);
        let free = crate::raw::free_bytes(&dir).map_or(u64::MAX, |f| f.saturating_add(held));
        let mut least = 0u64;
        self.comm.all_reduce_into(&free, &mut least, mpi::collective::SystemOperation::min());
        if least < need {
            return Ok(Room::Short { dir, free: least, need });
        }
        self.release();
        self.window = Some(SharedWindow::allocate(&self.comm, bytes)?);
        self.published = 0;
        self.calls = 0;
        Ok(Room::Ready)
    }

    /// Frees the window (a later call makes a new one). Collective: every rank calls it at the
    /// same point, which the exchange's `finish` is.
    pub fn release(&mut self) {
        if let Some(window) = self.window.take() {
            // Unmapping under a rank still reading this part would fault it: wait until every
            // rank has finished reading every call (MPI_Win_free knows nothing of plain loads).
            for q in 0..self.n {
                wait_until(window.finished(q), &self.comm, self.calls);
            }
            window.free();
        }
    }

    /// The ring's `phases` on `buf`, in place (same chunks and results as over MPI), in a
    /// window that [`SharedRing::reserve`] has made room for.
    pub fn run<E: Element>(&mut self, buf: &mut [E], op: ReduceOp, phases: Phases) -> Result<()> {
        let (n, pos) = (self.n, self.pos);
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        if self.reserve(std::mem::size_of_val(buf))? != Room::Ready {
            return Err(Error::exchange("ring", "the shared-memory ring ran without room for its window"));
        }
        let schedule = RingSchedule::new(buf.len(), n, pos);
        let pieces = schedule.pieces_per_chunk((PIECE_BYTES / std::mem::size_of::<E>()).max(1));
        let bounds = schedule.piece_bounds(pieces);
        let piece = |chunk: usize, k: usize| bounds[chunk * pieces + k].clone();
        let left = (pos + n - 1) % n;
        let scale = (op == ReduceOp::Mean).then_some(1.0 / n as f32);
        let window = self.window.as_ref().expect("reserved above");
        let base = self.published;
        // Counter value once `rank` has published piece k of stage t.
        let mark = |t: usize, k: usize| base + (t * pieces + k + 1) as u64;
        let publish = |t: usize, k: usize| window.progress(pos).store(mark(t, k), Ordering::Release);
        // Nobody may still be reading this rank's part from the last call.
        for q in 0..n {
            wait_until(window.finished(q), &self.comm, self.calls);
        }

        // Stage 0: this rank's first chunk (reduce-scatter) or its summed chunk (all-gather
        // alone), into its part.
        let first = if phases.reduce_scatter { schedule.hop_chunks(0).0 } else { schedule.reduced_chunk_of(pos) };
        for k in 0..pieces {
            let range = piece(first, k);
            // SAFETY: stage 0 writes chunk `first` of this rank's part, which no rank reads
            // before this piece's counter says so; every rank has finished reading the last
            // call (waited for above).
            unsafe { window.own_part_mut::<E>(range.clone())? }.copy_from_slice(&buf[range]);
            publish(0, k);
        }
        let mut stages = 1;
        if phases.reduce_scatter {
            for s in 0..n - 1 {
                let chunk = schedule.hop_chunks(s).1;
                for k in 0..pieces {
                    wait_until(window.progress(left), &self.comm, mark(s, k));
                    let range = piece(chunk, k);
                    // SAFETY: the left neighbour published this piece at stage s and writes
                    // this chunk of its part at no other stage of this call; this rank writes
                    // chunk pos-s-1 of its own part only here, and the right neighbour reads it
                    // only after the counter below covers it.
                    let (arrived, mine) = unsafe { (window.part::<E>(left, range.clone())?, window.own_part_mut::<E>(range.clone())?) };
                    if s + 1 == n - 1 {
                        // The last step: the summed chunk, for this rank and for the all-gather.
                        accumulate_and_copy(&mut buf[range], arrived, mine, scale);
                    } else {
                        sum_into(mine, &buf[range], arrived);
                    }
                    publish(s + 1, k);
                }
            }
            stages = n;
        }
        if phases.all_gather {
            // Each rank's summed chunk from its part, nearest left first as the ring passes them.
            for d in 1..n {
                let from = (pos + n - d) % n;
                let chunk = schedule.reduced_chunk_of(from);
                for k in 0..pieces {
                    wait_until(window.progress(from), &self.comm, mark(stages - 1, k));
                    let range = piece(chunk, k);
                    // SAFETY: published by its owner at its last stage, and written again only
                    // once this rank has said it finished reading this call.
                    buf[range.clone()].copy_from_slice(unsafe { window.part::<E>(from, range)? });
                }
            }
        }
        self.published = base + (stages * pieces) as u64;
        self.calls += 1;
        window.finished(pos).store(self.calls, Ordering::Release);
        Ok(())
    }
}

/// Whether a window of the asked size fits the node's shared-memory file system.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Room {
    Ready,
    /// `need` bytes in `dir`, where the fullest rank saw `free`.
    Short { dir: PathBuf, free: u64, need: u64 },
}

/// Waits until a rank's `counter` reaches `target`, pausing as waits for MPI requests do
/// ([`Backoff`]). Past the spinning it also lets MPI make progress: a job whose rank failed is
/// ended through MPI's runtime (the SIGTERM it sends first is taken as a stop request), which a
/// rank hears only inside MPI calls.
fn wait_until(counter: &AtomicU64, comm: &SimpleCommunicator, target: u64) {
    let mut backoff = Backoff::default();
    while counter.load(Ordering::Acquire) < target {
        if backoff.pause() {
            // Nothing is ever sent on this communicator: the probe only drives MPI's progress.
            let _ = comm.any_process().immediate_probe();
        }
    }
    // A neighbour that stops publishing (a dead rank) leaves this loop waiting: the watchdog
    // then ends the job, as for a receive that never completes.
    crate::watchdog::progress();
}
