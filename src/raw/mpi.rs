//! MPI communicators and calls on the MPI library itself: a communicator moved to a
//! communication thread ([`SendComm`]) or shared by threads for point-to-point calls
//! ([`PeerComm`], [`PointToPoint`]), MPI_ANY_TAG, ending the job ([`abort_world`],
//! [`exit_now`]), the library's own CUDA queries, and the most elements one call takes.
//!
//! The invariants its unsafe code relies on: MPI is initialised before any of these calls; an
//! MPI communicator handle may be used from any thread when the library was initialised with
//! MPI_THREAD_MULTIPLE (checked when a [`SendComm`] or a [`PeerComm`] is made), and from
//! several threads at once only for point-to-point calls; a symbol looked up in the loaded
//! libraries has the signature its library documents.

use std::ffi::{c_int, CString};

use mpi::datatype::{Buffer, BufferMut};
use mpi::point_to_point::{Destination, Message, Source, Status};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator, Rank, SimpleCommunicator};
use mpi::Tag;

use crate::error::{Error, Result};

/// The most elements one MPI call takes: MPI counts are C ints. Longer buffers are split by the
/// callers that can (chunked collectives, ring segments) and refused by the others.
pub const MAX_MPI_COUNT: usize = i32::MAX as usize;

/// `len` as an MPI count, or an error naming `what` when it does not fit one.
pub(super) fn mpi_count(len: usize, what: &str) -> Result<mpi::Count> {
    mpi::Count::try_from(len).map_err(|_| {
        Error::exchange("memory", format!("{what}: {len} elements exceed the {MAX_MPI_COUNT} one MPI call can take; use smaller buckets"))
    })
}

/// What `MPIX_Query_cuda_support` says, where the MPI library has it (Open MPI, MPICH,
/// MVAPICH). `None` when the library does not export the function.
pub fn mpi_cuda_support() -> Option<bool> {
    let name = CString::new("MPIX_Query_cuda_support").expect("no NUL in the name");
    // SAFETY: dlsym with RTLD_DEFAULT searches the already-loaded libraries (libmpi is linked
    // into the binary); a null result means the symbol is absent and is checked before use.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: the symbol is the MPI extension `int MPIX_Query_cuda_support(void)`, documented
    // by Open MPI and MPICH with exactly this signature; it may be called after MPI_Init.
    let query: extern "C" fn() -> c_int = unsafe { std::mem::transmute(sym) };
    Some(query() == 1)
}

extern "C" {
    /// From src/shim/mpi_shim.c: an integer control variable of the MPI tool interface.
    fn hpc_train_int_cvar(name: *const std::ffi::c_char, value: *mut c_int) -> c_int;
}

/// The value of the integer (or boolean) control variable `name` of the MPI tool interface
/// (MPI_T), read after MPI_Init; None where the library has no such variable or the read fails.
pub fn int_control_variable(name: &str) -> Option<i64> {
    let name = CString::new(name).ok()?;
    let mut value: c_int = 0;
    // SAFETY: `name` is a NUL-terminated string alive for the call, `value` a live int the shim
    // writes only when it returns 0; the shim opens and closes the tool interface itself.
    let status = unsafe { hpc_train_int_cvar(name.as_ptr(), &mut value) };
    (status == 0).then_some(i64::from(value))
}

/// What MPICH's `MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)` says, where the MPI
/// library has it (MPICH 4.0 and later, and libraries built on them). `None` when the library
/// does not export the function or the call fails.
pub fn mpix_gpu_query_support_cuda() -> Option<bool> {
    // The first value of MPICH 4's `MPIX_GPU_SUPPORT_*` (mpi.h): part of its ABI, so that a
    // binary built against an older mpi.h asks a newer library the same question.
    const MPIX_GPU_SUPPORT_CUDA: c_int = 0;
    let name = CString::new("MPIX_GPU_query_support").expect("no NUL in the name");
    // SAFETY: as in `mpi_cuda_support`: a lookup in the loaded libraries, null when absent.
    let sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if sym.is_null() {
        return None;
    }
    // SAFETY: the symbol is MPICH's `int MPIX_GPU_query_support(int gpu_type, int *is_supported)`
    // (mpi.h of MPICH 4.0); it may be called after MPI_Init and writes the flag before returning.
    let query: extern "C" fn(c_int, *mut c_int) -> c_int = unsafe { std::mem::transmute(sym) };
    let mut supported: c_int = 0;
    (query(MPIX_GPU_SUPPORT_CUDA, &mut supported) == 0).then_some(supported != 0)
}

/// A communicator that moves to a communication thread, which then makes all the calls on it.
///
/// rsmpi's communicators hold a raw MPI handle and so are not `Send`. Handing one to another
/// thread is sound when the MPI library was initialised with `MPI_THREAD_MULTIPLE` (the thread
/// calls MPI while the main thread does too), which the constructor checks. It is not `Sync`:
/// one thread at a time uses it, so collectives on it can never overlap.
pub struct SendComm(SimpleCommunicator);

impl SendComm {
    /// `threading` is the level MPI was initialised with.
    pub fn new(comm: SimpleCommunicator, threading: mpi::Threading) -> Result<SendComm> {
        require_multiple(threading, "a communication thread")?;
        Ok(SendComm(comm))
    }

    pub fn comm(&self) -> &SimpleCommunicator {
        &self.0
    }
}

// SAFETY: see the type's documentation: MPI_THREAD_MULTIPLE is checked at construction, which
// allows MPI calls on a communicator from any thread; without `Sync` only one thread holds it.
unsafe impl Send for SendComm {}

fn require_multiple(threading: mpi::Threading, who: &str) -> Result<()> {
    if threading < mpi::Threading::Multiple {
        return Err(Error::usage(format!(
            "the MPI library provides thread level {threading:?}, but {who} needs MPI_THREAD_MULTIPLE"
        )));
    }
    Ok(())
}

/// Point-to-point calls on a communicator: what the parameter server's messages need. Served
/// by a plain communicator (one thread) and by [`PeerComm`] (shared by threads).
pub trait PointToPoint {
    fn send<B: Buffer + ?Sized>(&self, to: Rank, buf: &B, tag: Tag);
    fn receive_into<B: BufferMut + ?Sized>(&self, from: Rank, buf: &mut B, tag: Tag);
    fn immediate_send<'a, Sc: Scope<'a>, B: 'a + Buffer + ?Sized>(&self, scope: Sc, to: Rank, buf: &'a B, tag: Tag) -> Request<'a, B, Sc>;
    fn immediate_receive_into<'a, Sc: Scope<'a>, B: 'a + BufferMut + ?Sized>(&self, scope: Sc, from: Rank, buf: &'a mut B, tag: Tag) -> Request<'a, B, Sc>;
    /// A message waiting from `from` (any rank when None), any tag, without blocking.
    fn probe(&self, from: Option<Rank>) -> Option<(Message, Status)>;
}

impl PointToPoint for SimpleCommunicator {
    fn send<B: Buffer + ?Sized>(&self, to: Rank, buf: &B, tag: Tag) {
        self.process_at_rank(to).send_with_tag(buf, tag)
    }
    fn receive_into<B: BufferMut + ?Sized>(&self, from: Rank, buf: &mut B, tag: Tag) {
        self.process_at_rank(from).receive_into_with_tag(buf, tag);
    }
    fn immediate_send<'a, Sc: Scope<'a>, B: 'a + Buffer + ?Sized>(&self, scope: Sc, to: Rank, buf: &'a B, tag: Tag) -> Request<'a, B, Sc> {
        self.process_at_rank(to).immediate_send_with_tag(scope, buf, tag)
    }
    fn immediate_receive_into<'a, Sc: Scope<'a>, B: 'a + BufferMut + ?Sized>(&self, scope: Sc, from: Rank, buf: &'a mut B, tag: Tag) -> Request<'a, B, Sc> {
        self.process_at_rank(from).immediate_receive_into_with_tag(scope, buf, tag)
    }
    fn probe(&self, from: Option<Rank>) -> Option<(Message, Status)> {
        match from {
            Some(rank) => self.process_at_rank(rank).immediate_matched_probe(),
            None => self.any_process().immediate_matched_probe(),
        }
    }
}

/// MPI_ANY_TAG, for a receive that takes whichever message its source sends next.
pub fn any_tag() -> Tag {
    // SAFETY: reads a constant that rsmpi's C shim defines from mpi.h.
    unsafe { mpi::ffi::RSMPI_ANY_TAG }
}

/// A communicator that several threads of a rank use at once for point-to-point messages only.
///
/// Under `MPI_THREAD_MULTIPLE` (checked at construction) point-to-point calls on one
/// communicator may run concurrently from several threads (MPI 4.0, 11.6); concurrent
/// collectives on one communicator may not, so this type offers no access to the communicator
/// beyond [`PointToPoint`].
pub struct PeerComm(SimpleCommunicator);

impl PeerComm {
    pub fn new(comm: SimpleCommunicator, threading: mpi::Threading) -> Result<PeerComm> {
        require_multiple(threading, "a communicator shared by threads")?;
        Ok(PeerComm(comm))
    }
}

// SAFETY: MPI_THREAD_MULTIPLE is checked at construction, so MPI calls on the handle may come
// from any thread, and concurrently; only point-to-point calls are reachable (see the type).
unsafe impl Send for PeerComm {}
// SAFETY: as for Send: concurrent point-to-point calls on one communicator are allowed under
// MPI_THREAD_MULTIPLE, and nothing else can be called through a shared reference.
unsafe impl Sync for PeerComm {}

impl PointToPoint for PeerComm {
    fn send<B: Buffer + ?Sized>(&self, to: Rank, buf: &B, tag: Tag) {
        self.0.send(to, buf, tag)
    }
    fn receive_into<B: BufferMut + ?Sized>(&self, from: Rank, buf: &mut B, tag: Tag) {
        self.0.receive_into(from, buf, tag)
    }
    fn immediate_send<'a, Sc: Scope<'a>, B: 'a + Buffer + ?Sized>(&self, scope: Sc, to: Rank, buf: &'a B, tag: Tag) -> Request<'a, B, Sc> {
        self.0.immediate_send(scope, to, buf, tag)
    }
    fn immediate_receive_into<'a, Sc: Scope<'a>, B: 'a + BufferMut + ?Sized>(&self, scope: Sc, from: Rank, buf: &'a mut B, tag: Tag) -> Request<'a, B, Sc> {
        self.0.immediate_receive_into(scope, from, buf, tag)
    }
    fn probe(&self, from: Option<Rank>) -> Option<(Message, Status)> {
        self.0.probe(from)
    }
}

/// Ends every rank of the job: `MPI_Abort` on MPI_COMM_WORLD. For failures seen by one rank
/// while the others may be blocked in communication.
pub fn abort_world(code: i32) -> ! {
    // A rank's output reaches the user through a pipe to its launcher daemon. MPICH's Hydra
    // ends the job on MPI_Abort without draining what the aborting rank wrote just before, so
    // the one line saying why the job ends was lost in 3 of 4 runs of 2 ranks; a short pause
    // after the flush lets the daemon forward it (an abort is no place to save milliseconds).
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    std::thread::sleep(std::time::Duration::from_millis(ABORT_OUTPUT_GRACE_MS));
    // SAFETY: MPI_Abort may be called at any time after MPI_Init (callers check initialisation);
    // RSMPI_COMM_WORLD is the predefined world communicator.
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
    }
    std::process::exit(code) // MPI_Abort does not return; this satisfies the type checker
}

/// How long an aborting rank waits for its last output to be forwarded before MPI_Abort.
const ABORT_OUTPUT_GRACE_MS: u64 = 200;

/// Ends this process at once, without MPI_Finalize or destructors: for a rank whose job cannot
/// be ended through MPI (a watchdog abort that cannot reach the launcher).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit has no preconditions; it does not return.
    unsafe { libc::_exit(code) }
}

/// MPI_TAG_UB, the largest message tag the MPI library accepts (the standard guarantees at
/// least 32767, the value taken when the attribute cannot be read).
pub fn tag_upper_bound() -> i32 {
    let mut value: *mut c_int = std::ptr::null_mut();
    let mut found: c_int = 0;
    // SAFETY: for MPI_TAG_UB, MPI_Comm_get_attr stores a pointer to the library's own int in
    // `value` (the address of a pointer is what it takes) and sets `found`; both are valid
    // locals, and MPI_COMM_WORLD is valid between MPI_Init and MPI_Finalize.
    let rc = unsafe {
        mpi::ffi::MPI_Comm_get_attr(mpi::ffi::RSMPI_COMM_WORLD, mpi::ffi::MPI_TAG_UB as c_int, &mut value as *mut *mut c_int as *mut std::ffi::c_void, &mut found)
    };
    if rc != 0 || found == 0 || value.is_null() {
        return 32767;
    }
    // SAFETY: MPI set `value` to the attribute's int, which lives until MPI_Finalize.
    unsafe { *value }
}
