//! MPI-3 shared-memory windows ([`SharedWindow`]): memory that every rank of a node loads from
//! and stores to directly.
//!
//! The invariants its unsafe code relies on: every rank's part is mapped, 8-byte aligned and at
//! least as large as asked (checked at allocation) until the window is freed, which consumes it;
//! the counters in a part's header are only ever accessed as atomics; and the data a rank reads
//! was published by its writer's progress counter and is not written again until every reader's
//! finished counter allows it (the contracts of [`SharedWindow::part`] and
//! [`SharedWindow::own_part_mut`]).

use std::ffi::{c_int, c_void};

use mpi::raw::AsRaw;
use mpi::topology::{Communicator, SimpleCommunicator};

use crate::element::Element;
use crate::error::{Error, Result};

/// Memory that every rank of a node communicator loads from and stores to directly: an MPI-3
/// shared window (`MPI_Win_allocate_shared`), one part per rank, each part mapped into every
/// rank's address space. A part holds two counters (atomics the owner publishes with release
/// stores and the others read with acquire loads: how far it has written, and how many calls it
/// has finished reading) and then `bytes` of data. The counters order the plain loads and
/// stores of the data (release/acquire on coherent memory: MPI's "unified" memory model, which
/// shared windows have). The window stays in a passive-target epoch (`MPI_Win_lock_all`) from
/// allocation to free, as that model asks of direct loads and stores (MPI 4.0 section 12.7).
///
/// Freeing is collective (`MPI_Win_free` waits for every rank), so it is explicit:
/// [`SharedWindow::free`], which every rank calls at the same point. A window dropped without it
/// (on an error path, where a peer may never reach another collective) stays mapped until the
/// process ends; MPI_Finalize and MPI_Abort both take it down.
pub struct SharedWindow {
    win: mpi::ffi::MPI_Win,
    /// Where each rank's part starts, in this process's address space.
    parts: Vec<*mut u8>,
    bytes: usize,
    me: usize,
}

/// Bytes before the data of each part: the two counters, 64 bytes apart (each alone on its
/// cache line as far as the part's alignment allows).
const PART_HEADER: usize = 128;

impl SharedWindow {
    /// Bytes of one rank's part for `bytes` of data (header and page rounding included): a
    /// window over `ranks` ranks takes `ranks` times this in the backing file system.
    pub fn part_bytes(bytes: usize) -> usize {
        (PART_HEADER + bytes).next_multiple_of(4096)
    }

    /// Allocates `bytes` of data per rank of `comm`, with every counter at zero.
    /// Collective over `comm`, whose ranks must share one node (a communicator from
    /// `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`).
    pub fn allocate(comm: &SimpleCommunicator, bytes: usize) -> Result<SharedWindow> {
        let part = SharedWindow::part_bytes(bytes);
        let aint = mpi::ffi::MPI_Aint::try_from(part).map_err(|_| Error::exchange("MPI_Win_allocate_shared", format!("{part} bytes do not fit an MPI_Aint")))?;
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut win = std::mem::MaybeUninit::<mpi::ffi::MPI_Win>::uninit();
        // SAFETY: `base` and `win` are out-parameters MPI writes before returning; the info
        // handle is MPI_INFO_NULL and the communicator a live one of this process.
        let rc = unsafe {
            mpi::ffi::MPI_Win_allocate_shared(aint, 1, mpi::ffi::RSMPI_INFO_NULL, comm.as_raw(), (&mut base as *mut *mut c_void).cast(), win.as_mut_ptr())
        };
        if rc != 0 {
            return Err(Error::exchange("MPI_Win_allocate_shared", format!("returned error code {rc} for {part} bytes per rank")));
        }
        // SAFETY: written by the successful call above.
        let win = unsafe { win.assume_init() };
        let mut parts = Vec::with_capacity(comm.size() as usize);
        for rank in 0..comm.size() {
            let (mut size, mut unit, mut ptr): (mpi::ffi::MPI_Aint, c_int, *mut c_void) = (0, 0, std::ptr::null_mut());
            // SAFETY: `win` is the window just made over `comm`, `rank` one of its ranks, and the
            // three out-parameters are written by MPI.
            let rc = unsafe { mpi::ffi::MPI_Win_shared_query(win, rank, &mut size, &mut unit, (&mut ptr as *mut *mut c_void).cast()) };
            // Open MPI places the parts one after another behind a header, MPICH one after
            // another from the start of one mapping (parts are whole pages, so page-aligned
            // there): 8-byte aligned either way, as the counter (AtomicU64) and every element
            // type (f32 at most) need. Checked, since the standard promises no alignment.
            if rc != 0 || (size as usize) < part || ptr.is_null() || !(ptr as usize).is_multiple_of(8) {
                return Err(Error::exchange("MPI_Win_shared_query", format!("rank {rank}'s part: code {rc}, {size} bytes at {ptr:?} (wanted {part}, 8-byte aligned)")));
            }
            parts.push(ptr.cast::<u8>());
        }
        // SAFETY: a window of this process, not yet in any epoch. MPI_MODE_NOCHECK: no rank
        // takes an exclusive lock on it, ever.
        let rc = unsafe { mpi::ffi::MPI_Win_lock_all(mpi::ffi::MPI_MODE_NOCHECK as c_int, win) };
        if rc != 0 {
            return Err(Error::exchange("MPI_Win_lock_all", format!("returned error code {rc}")));
        }
        let window = SharedWindow { win, parts, bytes, me: comm.rank() as usize };
        // MPI does not promise zeroed memory: each rank clears its own counters before anyone
        // reads one.
        window.progress(window.me).store(0, std::sync::atomic::Ordering::Release);
        window.finished(window.me).store(0, std::sync::atomic::Ordering::Release);
        window.fence(comm);
        Ok(window)
    }

    /// Bytes of data in each rank's part.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// `rank`'s progress counter: its owner stores (Release) how far it has written, the others
    /// load it (Acquire) before reading what it covers.
    pub fn progress(&self, rank: usize) -> &std::sync::atomic::AtomicU64 {
        self.counter(rank, 0)
    }

    /// `rank`'s count of calls it has finished reading the window for: what a rank waits for
    /// before it writes its part again.
    pub fn finished(&self, rank: usize) -> &std::sync::atomic::AtomicU64 {
        self.counter(rank, 64)
    }

    fn counter(&self, rank: usize, offset: usize) -> &std::sync::atomic::AtomicU64 {
        // SAFETY: 8 bytes of a live part's header (offset 0 or 64, below PART_HEADER), 8-byte
        // aligned (the part is, checked at allocation), mapped for as long as the window (and
        // so the returned reference) lives. Every access to them, from any process, goes
        // through this atomic.
        unsafe { &*self.parts[rank].add(offset).cast::<std::sync::atomic::AtomicU64>() }
    }

    /// Makes every store any rank made to the window before this call visible to every load
    /// any rank makes after it: a barrier over `comm` (the window's communicator) between two
    /// memory synchronisations. Used once, after the counters are cleared.
    fn fence(&self, comm: &SimpleCommunicator) {
        // SAFETY: MPI_Win_sync on a window of this process inside its lock_all epoch.
        unsafe { mpi::ffi::MPI_Win_sync(self.win) };
        mpi::collective::CommunicatorCollectives::barrier(comm);
        // SAFETY: as above.
        unsafe { mpi::ffi::MPI_Win_sync(self.win) };
    }

    /// Checks `range` of E elements against a part's data and returns where it starts.
    fn span<E: Element>(&self, rank: usize, range: &std::ops::Range<usize>) -> Result<*mut E> {
        let size = std::mem::size_of::<E>();
        if rank >= self.parts.len() || range.start > range.end || range.end * size > self.bytes {
            return Err(Error::exchange("shared window", format!("elements {range:?} of rank {rank}'s part do not fit its {} bytes", self.bytes)));
        }
        // SAFETY: PART_HEADER + range.start * size <= the part's size, inside the part; the part
        // is 8-byte aligned, PART_HEADER a multiple of 8 and E's alignment at most 4.
        Ok(unsafe { self.parts[rank].add(PART_HEADER + range.start * size) }.cast())
    }

    /// Elements `range` of `rank`'s data, to read.
    ///
    /// # Safety
    /// No rank may store to these elements while the slice lives: the caller has seen through
    /// their writer's progress counter that it is done with them, and the writer writes them
    /// again only after this rank's finished-reading counter says so.
    pub unsafe fn part<E: Element>(&self, rank: usize, range: std::ops::Range<usize>) -> Result<&[E]> {
        let ptr = self.span::<E>(rank, &range)?;
        // SAFETY: inside the mapped part (span checks), aligned, and by the caller's contract
        // not written by anyone while the slice lives. Any bit pattern is a valid E (Pod).
        Ok(unsafe { std::slice::from_raw_parts(ptr, range.len()) })
    }

    /// Elements `range` of this rank's own data, to write.
    ///
    /// # Safety
    /// No other rank may load or store these elements, and no other slice of them may exist in
    /// this process, while the slice lives: others read them only after this rank's progress
    /// counter covers them, and the caller has seen through every rank's finished-reading
    /// counter that no one still reads them from an earlier call.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn own_part_mut<E: Element>(&self, range: std::ops::Range<usize>) -> Result<&mut [E]> {
        let ptr = self.span::<E>(self.me, &range)?;
        // SAFETY: as in `part`, and exclusive by the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, range.len()) })
    }
}

impl SharedWindow {
    /// Frees the window. Collective over the window's communicator.
    pub fn free(mut self) {
        // SAFETY: the window is in the lock_all epoch opened at allocation; `self` is consumed,
        // so no slice or counter of it outlives the free.
        unsafe {
            mpi::ffi::MPI_Win_unlock_all(self.win);
            mpi::ffi::MPI_Win_free(&mut self.win);
        }
    }
}
