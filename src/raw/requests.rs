//! MPI requests in flight: waiting for one without holding the core ([`Backoff`], which the
//! shared-memory ring waits with too), and [`Segments`], a host buffer cut into segments that
//! MPI sends from and receives into in the background while the program works on the others.
//!
//! The invariants its unsafe code relies on: a request is waited for only while it is active
//! (MPI sets a completed one to MPI_REQUEST_NULL, and [`Segments`] drops completed ones); the
//! program and MPI never use one segment at once, since every access, by the program or for a
//! new receive, first waits for the requests on the segment that conflict with it; and no
//! request outlives the buffer, since [`with_segments`] waits for all of them before it gives
//! the buffer back.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use mpi::raw::AsRaw;
use mpi::topology::{Rank, SimpleCommunicator};
use mpi::traits::Equivalence;
use mpi::Tag;

use crate::element::Element;
use crate::error::{Error, Result};
use crate::raw::mpi::MAX_MPI_COUNT;

/// How a rank waits for a peer without holding its core (MPI_Wait would spin, and with overlap
/// that core is the one backward runs on): a few hundred spins, then yielding the core, then
/// sleeps of 20 us between looks.
#[derive(Default)]
pub struct Backoff {
    idle: u32,
}

impl Backoff {
    /// One pause between two looks. Returns false while still spinning (the peer is probably
    /// about to arrive), true after, when a look may be worth more work.
    pub fn pause(&mut self) -> bool {
        self.idle = self.idle.saturating_add(1);
        if self.idle < 256 {
            std::hint::spin_loop();
            return false;
        }
        if self.idle < 1024 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        true
    }
}

/// Waits for `request` without holding the core: MPI_Wait spins while the peer is not there
/// yet, and with overlap that core is the one backward runs on. Tests, spins a little, yields,
/// then sleeps between tests.
///
/// # Safety
/// `request` is an active request (or MPI_REQUEST_NULL) of this process; MPI sets it to
/// MPI_REQUEST_NULL when it completes.
pub(super) unsafe fn wait_politely(request: &mut mpi::ffi::MPI_Request) -> Result<()> {
    let mut backoff = Backoff::default();
    loop {
        let mut done: c_int = 0;
        // SAFETY: the caller's contract; the flag is a valid int and the status is ignored.
        let rc = unsafe { mpi::ffi::MPI_Test(request, &mut done, mpi::ffi::RSMPI_STATUS_IGNORE) };
        if rc != 0 {
            return Err(Error::exchange("MPI_Test", format!("returned error code {rc}")));
        }
        if done != 0 {
            return Ok(());
        }
        backoff.pause();
    }
}

// ---- Segments of a host buffer with MPI requests in flight. ----

/// Requests that [`Segments`] has seen complete in this process so far: progress that the
/// exchange watchdog (src/watchdog.rs) counts besides what the exchanges report to it. The raw
/// layer keeps the count and the watchdog reads it ([`completed_requests`]), rather than raw
/// calling the watchdog, which ends the job through raw.
static COMPLETED_REQUESTS: AtomicU64 = AtomicU64::new(0);

/// How many requests [`Segments`] has seen complete so far: it only grows.
pub fn completed_requests() -> u64 {
    COMPLETED_REQUESTS.load(Ordering::Relaxed)
}

/// A host buffer cut into disjoint segments that MPI reads (sends) or writes (receives) in the
/// background, for algorithms that receive into a segment, reduce it, send it on and receive
/// into it again within one operation (a pipelined ring), which rsmpi's scoped borrows cannot
/// express. Every access to a segment, from the program or for a new receive, first waits for
/// the requests on it that conflict, so the program and MPI never use one segment at once.
///
/// Made only inside [`with_segments`], which waits for every request before it returns, so no
/// request outlives the buffer (a value the caller could forget would not guarantee that).
pub struct Segments<'a, E> {
    base: *mut E,
    bounds: Vec<std::ops::Range<usize>>,
    /// Per segment: requests in flight, and whether one of them writes it (a receive).
    pending: Vec<(Vec<mpi::ffi::MPI_Request>, bool)>,
    _buffer: std::marker::PhantomData<&'a mut [E]>,
}

/// Runs `f` on `buf` cut into `bounds` (disjoint ranges inside it), then waits for every
/// request `f` left in flight, even when `f` fails.
pub fn with_segments<E: Element, T>(
    buf: &mut [E],
    bounds: Vec<std::ops::Range<usize>>,
    f: impl FnOnce(&mut Segments<'_, E>) -> Result<T>,
) -> Result<T> {
    let mut sorted: Vec<&std::ops::Range<usize>> = bounds.iter().collect();
    sorted.sort_by_key(|r| r.start);
    let disjoint = sorted.windows(2).all(|w| w[0].end <= w[1].start);
    if !disjoint || bounds.iter().any(|r| r.start > r.end || r.end > buf.len()) {
        return Err(Error::exchange("segments", "segments must be disjoint ranges inside the buffer"));
    }
    if let Some(r) = bounds.iter().find(|r| r.len() > MAX_MPI_COUNT) {
        return Err(Error::exchange("segments", format!("a segment of {} elements exceeds one MPI call's count", r.len())));
    }
    let pending = bounds.iter().map(|_| (Vec::new(), false)).collect();
    let mut segments = Segments { base: buf.as_mut_ptr(), bounds, pending, _buffer: std::marker::PhantomData };
    let result = f(&mut segments);
    let drained = (0..segments.bounds.len()).try_for_each(|s| segments.wait(s));
    let value = result?;
    drained?;
    Ok(value)
}

impl<E: Element> Segments<'_, E> {
    pub fn len_of(&self, segment: usize) -> usize {
        self.bounds[segment].len()
    }

    /// Waits for every request on `segment`.
    pub fn wait(&mut self, segment: usize) -> Result<()> {
        let (requests, writes) = &mut self.pending[segment];
        for request in requests.iter_mut() {
            // SAFETY: a request made by `send` or `receive` below and not yet completed
            // (completed ones are removed from the list).
            unsafe { wait_politely(request)? };
            COMPLETED_REQUESTS.fetch_add(1, Ordering::Relaxed);
        }
        requests.clear();
        *writes = false;
        Ok(())
    }

    /// Sends the first `len` elements of `segment` to `dest` (after any receive into it).
    pub fn send(&mut self, segment: usize, len: usize, comm: &SimpleCommunicator, dest: Rank, tag: Tag) -> Result<()> {
        if self.pending[segment].1 {
            self.wait(segment)?;
        }
        let (ptr, len) = self.span(segment, len)?;
        let mut request = std::mem::MaybeUninit::<mpi::ffi::MPI_Request>::uninit();
        let datatype = <E::Wire as Equivalence>::equivalent_datatype();
        // SAFETY: ptr..ptr+len lies inside the segment (span checks), inside the buffer that
        // `with_segments` borrows mutably until every request is waited for; no receive is in
        // flight on it (waited above) and the program can only write it through `get_mut`,
        // which waits for this send first. MPI writes the request handle before returning.
        let rc = unsafe {
            mpi::ffi::MPI_Isend(ptr as *const c_void, len as c_int, datatype.as_raw(), dest, tag, comm.as_raw(), request.as_mut_ptr())
        };
        if rc != 0 {
            return Err(Error::exchange("MPI_Isend", format!("returned error code {rc}")));
        }
        // SAFETY: initialised by the successful MPI_Isend.
        self.pending[segment].0.push(unsafe { request.assume_init() });
        Ok(())
    }

    /// Receives `len` elements from `source` into the start of `segment` (after every request
    /// on it is done).
    pub fn receive(&mut self, segment: usize, len: usize, comm: &SimpleCommunicator, source: Rank, tag: Tag) -> Result<()> {
        self.wait(segment)?;
        let (ptr, len) = self.span(segment, len)?;
        let mut request = std::mem::MaybeUninit::<mpi::ffi::MPI_Request>::uninit();
        let datatype = <E::Wire as Equivalence>::equivalent_datatype();
        // SAFETY: as in `send`; no request is in flight on the segment (waited above), and the
        // program can only read or write it again through `get`/`get_mut`, which wait first.
        let rc = unsafe {
            mpi::ffi::MPI_Irecv(ptr as *mut c_void, len as c_int, datatype.as_raw(), source, tag, comm.as_raw(), request.as_mut_ptr())
        };
        if rc != 0 {
            return Err(Error::exchange("MPI_Irecv", format!("returned error code {rc}")));
        }
        // SAFETY: initialised by the successful MPI_Irecv.
        self.pending[segment] = (vec![unsafe { request.assume_init() }], true);
        Ok(())
    }

    /// The first `len` elements of `segment`, once no receive writes them.
    pub fn get(&mut self, segment: usize, len: usize) -> Result<&[E]> {
        if self.pending[segment].1 {
            self.wait(segment)?;
        }
        let (ptr, len) = self.span(segment, len)?;
        // SAFETY: inside the borrowed buffer (span checks); no receive is in flight on the
        // segment, and MPI only reads it (sends) while the shared slice lives: the slice borrows
        // `self`, so no new receive can start meanwhile.
        Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
    }

    /// The first `len` elements of `segment`, writable, once no request uses them.
    pub fn get_mut(&mut self, segment: usize, len: usize) -> Result<&mut [E]> {
        self.wait(segment)?;
        let (ptr, len) = self.span(segment, len)?;
        // SAFETY: inside the borrowed buffer; no request is in flight on the segment (waited
        // above), and none can start while the slice borrows `self`; segments are disjoint.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
    }

    fn span(&self, segment: usize, len: usize) -> Result<(*mut E, usize)> {
        let range = &self.bounds[segment];
        if len > range.len() {
            return Err(Error::exchange("segments", format!("{len} elements do not fit segment {segment} of {}", range.len())));
        }
        // SAFETY: range.start <= buffer length (checked in with_segments), so the pointer stays
        // inside the allocation or one past its end.
        Ok((unsafe { self.base.add(range.start) }, len))
    }
}
