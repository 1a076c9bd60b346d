//! The one module with `unsafe` code: tensor memory seen as slices, device pointers handed to
//! MPI, MPI handles moved to the communication thread, and calls into the C library.
//!
//! Everything else in the crate is safe Rust. Each `unsafe` block states why it is sound; the
//! invariants callers must keep are written on the functions that expose them.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use mpi::datatype::{Buffer, BufferMut, DatatypeRef, DynBufferMut};
use mpi::point_to_point::{Destination, Message, Source, Status};
use mpi::raw::{AsRaw, FromRaw};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator, Rank, SimpleCommunicator};
use mpi::traits::Equivalence;
use mpi::Tag;
use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::exchange::element::Element;

/// Checks that `t` is a contiguous CPU tensor of element type `E` and returns its length.
fn check_host<E: Element>(t: &Tensor) -> Result<usize> {
    if t.device() != Device::Cpu {
        return Err(Error::exchange("memory", format!("expected a CPU tensor, got one on {:?}", t.device())));
    }
    check_layout::<E>(t)
}

fn check_layout<E: Element>(t: &Tensor) -> Result<usize> {
    if t.kind() != E::KIND {
        return Err(Error::exchange("memory", format!("expected {:?} elements, got {:?}", E::KIND, t.kind())));
    }
    if !t.is_contiguous() {
        return Err(Error::exchange("memory", "expected a contiguous tensor"));
    }
    Ok(t.numel())
}

/// The most elements one MPI call takes: MPI counts are C ints. Longer buffers are split by the
/// callers that can (chunked collectives, ring segments) and refused by the others.
pub const MAX_MPI_COUNT: usize = i32::MAX as usize;

/// `len` as an MPI count, or an error naming `what` when it does not fit one.
fn mpi_count(len: usize, what: &str) -> Result<mpi::Count> {
    mpi::Count::try_from(len).map_err(|_| {
        Error::exchange("memory", format!("{what}: {len} elements exceed the {MAX_MPI_COUNT} one MPI call can take; use smaller buckets"))
    })
}

/// The elements of a contiguous CPU tensor, read-only and without a copy.
///
/// # Safety
/// tch tensors are reference-counted handles: other handles of the same storage (shallow
/// clones, `grad()`, views) are invisible to the borrow checker. While the slice lives, no other
/// handle may write the tensor's elements or replace its storage (`set_data`, `resize_`, an
/// in-place op that reallocates), and no device work may write it.
pub unsafe fn host_slice<E: Element>(t: &Tensor) -> Result<&[E]> {
    let len = check_host::<E>(t)?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: `t` is a defined, contiguous CPU tensor of `len` elements of type E (checked
    // above), so its data pointer is valid and aligned for `len` reads of E right now. That it
    // stays valid and unchanged while the slice lives (no writer, no new storage through another
    // handle) is the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(t.data_ptr() as *const E, len) })
}

/// The elements of a contiguous CPU tensor, writable in place and without a copy.
///
/// # Safety
/// As [`host_slice`], and besides no other handle may read the tensor while the slice lives.
pub unsafe fn host_slice_mut<E: Element>(t: &mut Tensor) -> Result<&mut [E]> {
    let len = check_host::<E>(t)?;
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: as in `host_slice`; the `&mut Tensor` borrow makes this the only slice made through
    // this handle, and the caller's contract excludes every other handle for its lifetime.
    Ok(unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut E, len) })
}

/// A device tensor's memory as an MPI buffer, for a CUDA-aware MPI library.
///
/// # Safety
/// The MPI library must be CUDA-aware (it dereferences the pointer on the device); all device
/// work writing the tensor must be complete (MPI does not order itself after CUDA streams); the
/// buffer must only be handed to MPI, never read or written from the host; and, as for
/// [`host_slice_mut`], no other handle may touch the tensor while the buffer lives.
pub unsafe fn device_buffer_mut<E: Element>(t: &mut Tensor) -> Result<DynBufferMut<'_>> {
    if !t.device().is_cuda() {
        return Err(Error::exchange("memory", "expected a CUDA tensor for the direct device path"));
    }
    let len = check_layout::<E>(t)?;
    let count = mpi_count(len, "a device buffer")?;
    let datatype = <E::Wire as Equivalence>::equivalent_datatype();
    // SAFETY: the pointer is the tensor's device allocation of `len` elements of E, each the size
    // of E::Wire (Element guarantees it), and `count` is `len` (checked to fit); the buffer
    // borrows the tensor, and the caller's contract keeps the allocation in place while it
    // lives; the datatype handle is a predefined MPI type, valid until MPI_Finalize.
    unsafe {
        let dt = DatatypeRef::from_raw(datatype.as_raw());
        Ok(DynBufferMut::from_raw(t.data_ptr() as *mut E::Wire, count, dt))
    }
}

/// Any contiguous tensor as an MPI buffer: host memory in place, or device memory for a
/// CUDA-aware MPI.
///
/// # Safety
/// As [`host_slice_mut`] for a host tensor, as [`device_buffer_mut`] for a device tensor.
pub unsafe fn mpi_buffer_mut<E: Element>(t: &mut Tensor) -> Result<DynBufferMut<'_>> {
    if t.device().is_cuda() {
        // SAFETY: forwarded from the caller's contract.
        unsafe { device_buffer_mut::<E>(t) }
    } else {
        // SAFETY: forwarded from the caller's contract.
        let slice = unsafe { host_slice_mut::<E>(t)? };
        mpi_count(slice.len(), "a host buffer")?;
        Ok(DynBufferMut::new(E::as_wire_mut(slice)))
    }
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

/// Loads libtorch_cuda (found beside the libtorch already loaded) so that CUDA is registered
/// with libtorch. Returns the error text when the library or one of its dependencies is missing,
/// which is the normal case on a machine without the CUDA libraries.
///
/// rustc links with `--as-needed`, so libtorch_cuda, which no symbol of ours references, would
/// otherwise be dropped and CUDA would never be available. Loading it at run time instead of
/// linking it keeps the binary startable on machines without the CUDA libraries.
pub fn load_torch_cuda() -> std::result::Result<String, String> {
    let dir = loaded_library_dir("libtorch_cpu.so").ok_or("libtorch_cpu.so is not loaded")?;
    let path = format!("{dir}/libtorch_cuda.so");
    if !std::path::Path::new(&path).exists() {
        return Err(format!("{path} does not exist (a CPU-only libtorch)"));
    }
    let c_path = CString::new(path.clone()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen with a valid NUL-terminated path; the handle is intentionally never closed,
    // since libtorch keeps pointers into the library (its registered CUDA hooks) for the process.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
        let msg = unsafe {
            let e = libc::dlerror();
            if e.is_null() { "unknown dlopen error".to_string() } else { CStr::from_ptr(e).to_string_lossy().into_owned() }
        };
        return Err(msg);
    }
    Ok(path)
}

/// The identity of each GPU this process sees, in CUDA's index order (the order
/// `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER` give): its UUID from the CUDA driver, written
/// as nvidia-smi writes it. MIG instances have UUIDs of their own (`cuDeviceGetUuid_v2`), so two
/// ranks on two instances of one GPU do not count as sharing it. Call after libtorch has seen
/// CUDA (its device count initialises the driver, which loads libcuda.so.1).
pub fn cuda_device_uuids(count: usize) -> std::result::Result<Vec<String>, String> {
    type CuInit = unsafe extern "C" fn(flags: u32) -> c_int;
    type CuDeviceGet = unsafe extern "C" fn(device: *mut c_int, ordinal: c_int) -> c_int;
    type CuDeviceGetUuid = unsafe extern "C" fn(uuid: *mut [u8; 16], device: c_int) -> c_int;
    let library = CString::new("libcuda.so.1").expect("no NUL in the name");
    // SAFETY: dlopen with a valid NUL-terminated name; the driver library stays loaded for the
    // process (CUDA itself keeps it), and the handle is intentionally never closed.
    let handle = unsafe { libc::dlopen(library.as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        return Err("the CUDA driver (libcuda.so.1) cannot be loaded".into());
    }
    let symbol = |name: &str| -> Option<*mut c_void> {
        let c_name = CString::new(name).expect("no NUL in the name");
        // SAFETY: a live handle and a NUL-terminated name; a null result is checked by callers.
        let sym = unsafe { libc::dlsym(handle, c_name.as_ptr()) };
        (!sym.is_null()).then_some(sym)
    };
    let (Some(init), Some(get), Some(get_uuid)) =
        (symbol("cuInit"), symbol("cuDeviceGet"), symbol("cuDeviceGetUuid_v2").or_else(|| symbol("cuDeviceGetUuid")))
    else {
        return Err("the CUDA driver lacks cuInit, cuDeviceGet or cuDeviceGetUuid".into());
    };
    // SAFETY: these are the CUDA driver API's entry points, with the signatures its cuda.h
    // declares (CUresult is an int enum, CUdevice an int, CUuuid 16 bytes); each is called with
    // valid out-pointers, and cuInit(0) may be called any number of times.
    unsafe {
        let (init, get, get_uuid): (CuInit, CuDeviceGet, CuDeviceGetUuid) =
            (std::mem::transmute(init), std::mem::transmute(get), std::mem::transmute(get_uuid));
        let rc = init(0);
        if rc != 0 {
            return Err(format!("cuInit returned {rc}"));
        }
        (0..count)
            .map(|ordinal| {
                let mut device: c_int = 0;
                let rc = get(&mut device, ordinal as c_int);
                if rc != 0 {
                    return Err(format!("cuDeviceGet({ordinal}) returned {rc}"));
                }
                let mut uuid = [0u8; 16];
                let rc = get_uuid(&mut uuid, device);
                if rc != 0 {
                    return Err(format!("cuDeviceGetUuid({ordinal}) returned {rc}"));
                }
                Ok(format_gpu_uuid(&uuid))
            })
            .collect()
    }
}

/// A GPU UUID as nvidia-smi writes it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
fn format_gpu_uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

/// The folder of a shared library already mapped into this process, from /proc/self/maps.
fn loaded_library_dir(file_name: &str) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.rsplit('/').next() == Some(file_name))
        .and_then(|path| path.rsplit_once('/').map(|(dir, _)| dir.to_string()))
}

/// Peak resident memory of this process, in MiB: the kernel's high-water mark, or the resident
/// memory now where that is higher. Linux updates `ru_maxrss` from per-thread counters that it
/// folds in lazily, so right after a growth it can read below the current RSS that
/// /proc/self/statm gives (seen in results/zero: "peak" below "RSS at end").
pub fn peak_rss_mb() -> f64 {
    let now = current_rss_mb(); // also raises the highest seen
    max_rss_mb().max(now).max(f64::from_bits(HIGHEST_RSS_SEEN.load(std::sync::atomic::Ordering::Relaxed)))
}

/// The highest value [`current_rss_mb`] has returned, as f64 bits (non-negative floats order
/// like their bits), so that the peak is never below a figure recorded earlier in the run.
static HIGHEST_RSS_SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `ru_maxrss` of this process, in MiB (0 when getrusage fails).
fn max_rss_mb() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a complete rusage into the pointer it is given; the struct was
    // zero-initialised, so it is fully initialised even if the call failed (checked).
    let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0;
    if !ok {
        return 0.0;
    }
    // SAFETY: zero-initialised above and filled by a successful getrusage.
    let usage = unsafe { usage.assume_init() };
    usage.ru_maxrss as f64 / 1024.0 // Linux reports kibibytes
}

/// Keeps memory that libtorch frees inside the process for its next allocation, instead of
/// handing it back to the kernel. glibc's defaults serve large blocks from fresh mmaps and
/// trim the heap's top once a little of it is free, so every training step frees its
/// activations and then faults the same pages back in, each zeroed by the kernel: a quarter of
/// a short CPU step on the tiny CNN (perf, results/pytorch_comparison.md). A step's peak is
/// needed again by the next step, so holding it costs nothing that the step does not already
/// use (PyTorch's GPU caching allocator holds it the same way). A user's own `MALLOC_*_`
/// environment settings are left to win.
pub fn keep_freed_memory() {
    let user_tuned = std::env::vars_os().any(|(k, _)| k.to_str().is_some_and(|k| k.starts_with("MALLOC_") && k.ends_with('_')));
    if user_tuned {
        return;
    }
    // SAFETY: mallopt only sets glibc allocator parameters (it takes the allocator's own lock);
    // it is called first thing in main, and a value it rejects leaves the default in place.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// Current resident memory of this process, in MiB (from /proc/self/statm).
pub fn current_rss_mb() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as f64;
    let mb = pages * page / (1024.0 * 1024.0);
    HIGHEST_RSS_SEEN.fetch_max(mb.to_bits(), std::sync::atomic::Ordering::Relaxed);
    mb
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

/// Bytes an unprivileged process may still write in the file system holding `dir` (statvfs's
/// f_bavail blocks of f_frsize bytes); None where it cannot be asked (no such directory).
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a NUL-terminated string that outlives the call, and `stat` an
    // out-parameter statvfs fills when it returns 0.
    if unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: written by the successful call above.
    let stat = unsafe { stat.assume_init() };
    // Both fields are u64 here, narrower on 32-bit targets.
    #[allow(clippy::unnecessary_cast)]
    Some((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// The name of this host.
pub fn hostname() -> String {
    let mut buf = [0 as c_char; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into buf; the last byte is forced to
    // NUL below, so CStr::from_ptr finds a terminator inside the buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    buf[buf.len() - 1] = 0;
    // SAFETY: NUL-terminated within the buffer (see above).
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Raw pointer of a tensor's data, for identity comparisons only (never dereferenced).
pub fn data_address(t: &Tensor) -> usize {
    t.data_ptr() as *const c_void as usize
}

extern "C" {
    /// From src/shim/mpi_shim.c: the library's MPI_IN_PLACE.
    fn hpc_train_mpi_in_place() -> *mut c_void;
}

/// `MPI_Allreduce(MPI_IN_PLACE, ...)` over a host slice: the blocking call, as users of MPI
/// make it, or with `nonblocking` the old path of this program (`MPI_Iallreduce` and a wait
/// that leaves the core to backward, `--mpi-allreduce nonblocking`). Open MPI 4.1 runs the two
/// differently: the blocking call picks among its tuned algorithms by size, while libnbc's
/// in-place non-blocking all-reduce is a binomial tree (reduce to rank 0, then broadcast),
/// which at 16-64 MiB on 2 ranks reached half the blocking call's bus bandwidth (issue 32).
pub fn all_reduce_in_place<E: Element>(
    comm: &SimpleCommunicator,
    buf: &mut [E],
    op: &impl mpi::collective::Operation,
    nonblocking: bool,
) -> Result<()> {
    for chunk in buf.chunks_mut(MAX_MPI_COUNT) {
        let (ptr, len) = (chunk.as_mut_ptr() as *mut c_void, chunk.len());
        // SAFETY: `chunk` is a live, exclusively borrowed host buffer of chunk.len() elements of
        // E, whose wire type has the same size (Element guarantees it).
        unsafe {
            if nonblocking {
                iallreduce_in_place_raw::<E>(comm, ptr, len, op)?
            } else {
                all_reduce_in_place_raw::<E>(comm, ptr, len, op)?
            }
        };
    }
    Ok(())
}

/// `MPI_Allreduce(MPI_IN_PLACE, ...)` over a CUDA tensor's memory, for a CUDA-aware MPI. Always
/// the blocking call: Open MPI's CUDA support covers the blocking collectives (its `coll/cuda`
/// component stages their reductions) and lists the non-blocking reductions among the calls
/// that do not take GPU memory.
///
/// # Safety
/// As [`device_buffer_mut`]: a CUDA-aware MPI, device work writing the tensor complete, no other
/// handle touching it during the call; `op` must be one MPI applies on the device (a
/// predefined operation: a user operation's function would read device memory on the host).
pub unsafe fn all_reduce_in_place_device<E: Element>(
    comm: &SimpleCommunicator,
    t: &mut Tensor,
    op: &impl mpi::collective::Operation,
) -> Result<()> {
    if !t.device().is_cuda() {
        return Err(Error::exchange("memory", "expected a CUDA tensor for the direct device path"));
    }
    let len = check_layout::<E>(t)?;
    let base = t.data_ptr() as *mut E;
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_MPI_COUNT);
        // SAFETY: base..base+len is the tensor's device allocation (checked contiguous, of E);
        // the pointer is only handed to MPI, which the caller guarantees is CUDA-aware.
        unsafe { all_reduce_in_place_raw::<E>(comm, base.add(done) as *mut c_void, n, op)? };
        done += n;
    }
    Ok(())
}

/// Waits for `request` without holding the core: MPI_Wait spins while the peer is not there
/// yet, and with overlap that core is the one backward runs on. Tests, spins a little, yields,
/// then sleeps between tests.
///
/// # Safety
/// `request` is an active request (or MPI_REQUEST_NULL) of this process; MPI sets it to
/// MPI_REQUEST_NULL when it completes.
unsafe fn wait_politely(request: &mut mpi::ffi::MPI_Request) -> Result<()> {
    let mut backoff = crate::exchange::Backoff::default();
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

/// `MPI_Allreduce(MPI_IN_PLACE, ptr, len, ...)`: the blocking call. It holds the calling thread
/// until every rank has taken part; a rank that never comes is the watchdog's to catch (it
/// aborts the job from its own thread, see src/watchdog.rs).
///
/// # Safety
/// `ptr` must point to `len` writable elements of E (host memory, or device memory with a
/// CUDA-aware MPI), not aliased by anything else during the call.
unsafe fn all_reduce_in_place_raw<E: Element>(
    comm: &SimpleCommunicator,
    ptr: *mut c_void,
    len: usize,
    op: &impl mpi::collective::Operation,
) -> Result<()> {
    use mpi::traits::AsRaw as _;
    if len == 0 {
        return Ok(());
    }
    let datatype = <E::Wire as Equivalence>::equivalent_datatype();
    // SAFETY: forwarded from the caller's contract (the buffer stays valid and untouched for the
    // call); the handles are live (the communicator is borrowed, the datatype predefined, the
    // operation borrowed); MPI_IN_PLACE comes from mpi.h; `len` fits a C int (callers split at
    // MAX_MPI_COUNT).
    let rc = unsafe {
        mpi::ffi::MPI_Allreduce(hpc_train_mpi_in_place(), ptr, len as c_int, datatype.as_raw(), op.as_raw(), comm.as_raw())
    };
    if rc != 0 {
        return Err(Error::exchange("MPI_Allreduce", format!("returned error code {rc}")));
    }
    Ok(())
}

/// `MPI_Iallreduce(MPI_IN_PLACE, ...)` and a wait that leaves the core to backward while other
/// ranks catch up (`--mpi-allreduce nonblocking`, host memory only).
///
/// # Safety
/// `ptr` must point to `len` writable host elements of E, not aliased by anything else during
/// the call.
unsafe fn iallreduce_in_place_raw<E: Element>(
    comm: &SimpleCommunicator,
    ptr: *mut c_void,
    len: usize,
    op: &impl mpi::collective::Operation,
) -> Result<()> {
    use mpi::traits::AsRaw as _;
    if len == 0 {
        return Ok(());
    }
    let datatype = <E::Wire as Equivalence>::equivalent_datatype();
    let mut request = std::mem::MaybeUninit::<mpi::ffi::MPI_Request>::uninit();
    // SAFETY: forwarded from the caller's contract (the buffer stays valid and untouched until
    // the wait below returns); the handles are live (the communicator is borrowed, the datatype
    // predefined, the operation borrowed); MPI_IN_PLACE comes from mpi.h; MPI writes the request.
    let rc = unsafe {
        mpi::ffi::MPI_Iallreduce(
            hpc_train_mpi_in_place(),
            ptr,
            len as c_int,
            datatype.as_raw(),
            op.as_raw(),
            comm.as_raw(),
            request.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(Error::exchange("MPI_Iallreduce", format!("returned error code {rc}")));
    }
    // SAFETY: initialised by the successful MPI_Iallreduce; the buffer stays borrowed (the
    // caller's contract) until the wait returns.
    unsafe { wait_politely(request.assume_init_mut()) }
}

/// Ends every rank of the job: `MPI_Abort` on MPI_COMM_WORLD. For failures seen by one rank
/// while the others may be blocked in communication.
pub fn abort_world(code: i32) -> ! {
    // SAFETY: MPI_Abort may be called at any time after MPI_Init (callers check initialisation);
    // RSMPI_COMM_WORLD is the predefined world communicator.
    unsafe {
        mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, code);
    }
    std::process::exit(code) // MPI_Abort does not return; this satisfies the type checker
}

/// Ends this process at once, without MPI_Finalize or destructors: for a rank whose job cannot
/// be ended through MPI (a watchdog abort that cannot reach the launcher).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit has no preconditions; it does not return.
    unsafe { libc::_exit(code) }
}

/// `MPI_Reduce` to `root` of `comm`, in place on the root (MPI_IN_PLACE there); on the other
/// ranks `buf` is only read. Host memory, or device memory with a CUDA-aware MPI.
///
/// # Safety
/// As [`mpi_buffer_mut`] for the tensor; on the device, `op` must be a predefined operation.
pub unsafe fn reduce_in_place<E: Element>(
    comm: &SimpleCommunicator,
    t: &mut Tensor,
    op: &impl mpi::collective::Operation,
    root: c_int,
) -> Result<()> {
    use mpi::traits::{AsRaw as _, Communicator as _};
    let len = if t.device().is_cuda() { check_layout::<E>(t)? } else { check_host::<E>(t)? };
    if len == 0 {
        return Ok(());
    }
    if len > MAX_MPI_COUNT {
        return Err(Error::exchange("MPI_Reduce", format!("{len} elements exceed one call's count")));
    }
    let datatype = <E::Wire as Equivalence>::equivalent_datatype();
    let ptr = t.data_ptr();
    let is_root = comm.rank() == root;
    // SAFETY: `ptr` is the tensor's memory of `len` elements of E (checked above: contiguous,
    // of E, at most MAX_MPI_COUNT); the caller guarantees no other handle touches it and, on the
    // device, a CUDA-aware MPI and a predefined operation. On the root the buffer is both input and output (MPI_IN_PLACE); elsewhere
    // it is the send buffer and the receive buffer is ignored by MPI.
    let rc = unsafe {
        if is_root {
            mpi::ffi::MPI_Reduce(hpc_train_mpi_in_place(), ptr, len as c_int, datatype.as_raw(), op.as_raw(), root, comm.as_raw())
        } else {
            mpi::ffi::MPI_Reduce(ptr, std::ptr::null_mut(), len as c_int, datatype.as_raw(), op.as_raw(), root, comm.as_raw())
        }
    };
    if rc != 0 {
        return Err(Error::exchange("MPI_Reduce", format!("returned error code {rc}")));
    }
    Ok(())
}

/// Copies `len` elements from `src` at element `src_at` to `dst` at element `dst_at`, when
/// both are contiguous CPU tensors of one dtype and the ranges lie inside them, as a plain
/// memory copy: libtorch's copy costs microseconds of dispatch (and views more), which adds up
/// over the hundreds of small tensors of a fusion buffer. Returns false, copying nothing, when
/// the tensors do not qualify (the caller then uses libtorch).
pub fn copy_host_elements(dst: &mut Tensor, dst_at: usize, src: &Tensor, src_at: usize, len: usize) -> bool {
    let qualifies = dst.device() == Device::Cpu
        && src.device() == Device::Cpu
        && dst.kind() == src.kind()
        && dst.is_contiguous()
        && src.is_contiguous()
        && dst_at + len <= dst.numel()
        && src_at + len <= src.numel();
    if !qualifies {
        return false;
    }
    if len == 0 {
        return true;
    }
    let elem = dst.kind().elt_size_in_bytes();
    // SAFETY: both tensors are contiguous CPU tensors of the same element size, and the ranges
    // [at, at + len) lie inside each (checked above), so both pointers stay in their
    // allocations; `dst` is borrowed mutably; `ptr::copy` tolerates overlapping ranges.
    unsafe {
        let s = (src.data_ptr() as *const u8).add(src_at * elem);
        let d = (dst.data_ptr() as *mut u8).add(dst_at * elem);
        std::ptr::copy(s, d, len * elem);
    }
    true
}

// ---- Gradient-ready hooks (src/shim/grad_hooks.cpp). ----

type GradReadyCallback = extern "C" fn(context: *mut c_void, index: i64, event: *mut c_void);

extern "C" {
    fn hpc_register_grad_ready_hook(
        tensor: *mut c_void,
        index: i64,
        callback: GradReadyCallback,
        context: *mut c_void,
        error: *mut c_char,
        error_length: usize,
    ) -> c_int;
    fn hpc_clear_grad_ready_hook(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_event_synchronize(event: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_event_destroy(event: *mut c_void);
    fn hpc_event_record(device_index: i64, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_copy(dst: *mut c_void, src: *mut c_void, non_blocking: bool, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_set_cuda_device(device_index: i64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_stream_from_pool(device_index: i64, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_stream_destroy(stream: *mut c_void);
    fn hpc_stream_exchange(stream: *mut c_void, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_event_block_current(event: *mut c_void, device_index: i64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_current_cuda_device(error: *mut c_char, error_length: usize) -> i64;
}

/// `dst.copy_(src, non_blocking)`: libtorch's copy between any devices (tch has no
/// non-blocking form). Non-blocking only changes anything between pinned host memory and a GPU:
/// the copy is then queued on the current stream, and the caller waits on an event.
pub fn copy_into(dst: &mut Tensor, src: &Tensor, non_blocking: bool) -> Result<()> {
    let mut err = [0 as c_char; 256];
    let mut src_handle = src.shallow_clone();
    // SAFETY: both pointers are tch's at::Tensor objects, alive during the call (`dst` borrowed
    // mutably, `src_handle` owned here); the buffer is writable.
    let rc = unsafe { hpc_copy(dst.as_mut_ptr() as *mut c_void, src_handle.as_mut_ptr() as *mut c_void, non_blocking, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(Error::Torch(tch::TchError::Torch(shim_error(&err))));
    }
    Ok(())
}

/// Makes `device` the calling thread's current CUDA device (cudaSetDevice), so that everything
/// that uses the current device (a CUDA-aware MPI, streams, events, libraries) uses this rank's
/// GPU rather than GPU 0. The current device is per thread: every thread that touches CUDA or
/// hands device pointers to MPI calls this. A no-op for the CPU.
pub fn set_cuda_device(device: Device) -> Result<()> {
    let Device::Cuda(index) = device else { return Ok(()) };
    let mut err = [0 as c_char; 256];
    // SAFETY: a plain value and a writable buffer.
    let rc = unsafe { hpc_set_cuda_device(index as i64, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(Error::usage(format!("making cuda:{index} the current device: {}", shim_error(&err))));
    }
    Ok(())
}

/// The calling thread's current CUDA device, or an error where CUDA is not available.
pub fn current_cuda_device() -> Result<usize> {
    let mut err = [0 as c_char; 256];
    // SAFETY: a writable buffer; the shim returns -1 with a message on failure.
    let index = unsafe { hpc_current_cuda_device(err.as_mut_ptr(), err.len()) };
    usize::try_from(index).map_err(|_| Error::usage(format!("asking for the current CUDA device: {}", shim_error(&err))))
}

fn shim_error(buffer: &[c_char]) -> String {
    // SAFETY: the shim writes a NUL-terminated message into the buffer, or leaves it zeroed.
    unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned()
}

/// A CUDA event recorded on a stream: after a gradient's accumulation (by the gradient hook),
/// or after copies queued by the exchange. Waiting on it waits for that stream's work up to
/// that point, not for the whole device.
pub struct CudaEvent(std::ptr::NonNull<c_void>);

// SAFETY: a c10::Event may be waited on and destroyed from any thread; ownership is unique.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// An event recorded now on the current stream of `device`; None on the CPU, where work is
    /// done when the call that queued it returns.
    pub fn record(device: Device) -> Result<Option<CudaEvent>> {
        let Device::Cuda(index) = device else { return Ok(None) };
        let mut err = [0 as c_char; 256];
        // SAFETY: plain values and a writable buffer; the shim returns a new heap c10::Event
        // (owned by the CudaEvent from here on) or null with a message.
        let event = unsafe { hpc_event_record(index as i64, err.as_mut_ptr(), err.len()) };
        match std::ptr::NonNull::new(event) {
            Some(e) => Ok(Some(CudaEvent(e))),
            None => Err(Error::exchange("cuda", format!("recording an event on cuda:{index}: {}", shim_error(&err)))),
        }
    }

    /// Waits for the work recorded before the event.
    pub fn synchronize(&self) -> Result<()> {
        let mut err = [0 as c_char; 256];
        // SAFETY: the pointer is a live c10::Event owned by self; the buffer is writable.
        let rc = unsafe { hpc_event_synchronize(self.0.as_ptr(), err.as_mut_ptr(), err.len()) };
        if rc != 0 {
            return Err(Error::exchange("overlap", format!("waiting on a CUDA event: {}", shim_error(&err))));
        }
        Ok(())
    }
}

impl CudaEvent {
    /// Makes the calling thread's current stream on `device` wait for the work recorded before
    /// the event, on the device: the host does not wait.
    pub fn block_current(&self, device: Device) -> Result<()> {
        let Device::Cuda(index) = device else { return self.synchronize() };
        let mut err = [0 as c_char; 256];
        // SAFETY: the pointer is a live c10::Event owned by self; plain values and a writable
        // buffer.
        let rc = unsafe { hpc_event_block_current(self.0.as_ptr(), index as i64, err.as_mut_ptr(), err.len()) };
        if rc != 0 {
            return Err(Error::exchange("cuda", format!("making cuda:{index}'s stream wait on an event: {}", shim_error(&err))));
        }
        Ok(())
    }
}

/// A CUDA stream of libtorch's pool: work queued on it runs apart from the default stream's
/// (the communication stream of overlap, so that packing and copies for one bucket do not
/// queue behind every backward kernel launched so far).
pub struct CudaStream {
    stream: std::ptr::NonNull<c_void>,
    device: Device,
}

// SAFETY: a c10::Stream is a plain value (device, id); ownership of the heap copy is unique.
unsafe impl Send for CudaStream {}

impl CudaStream {
    /// A stream of `device` from the pool; None on the CPU.
    pub fn from_pool(device: Device) -> Result<Option<CudaStream>> {
        let Device::Cuda(index) = device else { return Ok(None) };
        let mut err = [0 as c_char; 256];
        // SAFETY: plain values and a writable buffer; the shim returns a new heap c10::Stream
        // (owned by the CudaStream from here on) or null with a message.
        let stream = unsafe { hpc_stream_from_pool(index as i64, err.as_mut_ptr(), err.len()) };
        match std::ptr::NonNull::new(stream) {
            Some(stream) => Ok(Some(CudaStream { stream, device })),
            None => Err(Error::exchange("cuda", format!("taking a stream of cuda:{index}: {}", shim_error(&err)))),
        }
    }

    /// Makes this the calling thread's current stream on its device until the guard is given
    /// back ([`CurrentStream::restore`]) or dropped; work the thread queues meanwhile (copies,
    /// packing, the optimizer, events) goes to this stream.
    pub fn make_current(&self) -> Result<CurrentStream> {
        let mut err = [0 as c_char; 256];
        // SAFETY: the pointer is a live c10::Stream owned by self; the shim returns the stream it
        // replaced as a new heap c10::Stream (owned by the guard) or null with a message.
        let previous = unsafe { hpc_stream_exchange(self.stream.as_ptr(), err.as_mut_ptr(), err.len()) };
        match std::ptr::NonNull::new(previous) {
            Some(previous) => Ok(CurrentStream { previous: Some(previous), device: self.device }),
            None => Err(Error::exchange("cuda", format!("making a stream current: {}", shim_error(&err)))),
        }
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // SAFETY: made by the shim with `new`, destroyed once, here.
        unsafe { hpc_stream_destroy(self.stream.as_ptr()) }
    }
}

/// A stream made current by [`CudaStream::make_current`]; the one it replaced comes back on
/// [`CurrentStream::restore`] (which also orders it after the work queued meanwhile) or drop.
pub struct CurrentStream {
    previous: Option<std::ptr::NonNull<c_void>>,
    device: Device,
}

impl CurrentStream {
    /// Gives the previous stream back and makes it wait, on the device, for everything queued
    /// on this one meanwhile: what the previous stream runs next sees that work done.
    pub fn restore(mut self) -> Result<()> {
        let done = CudaEvent::record(self.device)?;
        self.swap_back()?;
        match done {
            Some(event) => event.block_current(self.device),
            None => Ok(()),
        }
    }

    fn swap_back(&mut self) -> Result<()> {
        let Some(previous) = self.previous.take() else { return Ok(()) };
        let mut err = [0 as c_char; 256];
        // SAFETY: `previous` is the heap c10::Stream the shim returned; it is made current again,
        // and the stream the shim hands back (ours, a new heap copy) is destroyed at once; the
        // previous one is destroyed after, each once.
        unsafe {
            let ours = hpc_stream_exchange(previous.as_ptr(), err.as_mut_ptr(), err.len());
            hpc_stream_destroy(previous.as_ptr());
            if ours.is_null() {
                return Err(Error::exchange("cuda", format!("restoring the current stream: {}", shim_error(&err))));
            }
            hpc_stream_destroy(ours);
        }
        Ok(())
    }
}

impl Drop for CurrentStream {
    fn drop(&mut self) {
        // On an error path: the previous stream comes back, without ordering (the step failed).
        let _ = self.swap_back();
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: the event was made by the shim with `new` and is destroyed once, here.
        unsafe { hpc_event_destroy(self.0.as_ptr()) }
    }
}

/// A parameter whose gradient is final for this backward pass.
pub struct GradReady {
    pub index: usize,
    pub event: Option<CudaEvent>,
}

extern "C" fn on_grad_ready<T: From<GradReady> + Send>(context: *mut c_void, index: i64, event: *mut c_void) {
    // SAFETY: `context` is the Box<Sender<T>> that `GradReadyHooks<T>` owns and keeps alive until
    // it has removed every hook (in Drop), which its owner does only once no backward pass runs
    // (overlap.rs joins its backward thread first); Sender is Sync, so a shared borrow from the
    // autograd thread is fine. `event` is null or a fresh c10::Event handed over to us.
    let sender = unsafe { &*(context as *const std::sync::mpsc::Sender<T>) };
    let event = std::ptr::NonNull::new(event).map(CudaEvent);
    // The receiver may be gone on an error path; the event is then dropped and freed.
    let _ = sender.send(T::from(GradReady { index: index as usize, event }));
}

/// Post-accumulate-grad hooks on a set of parameters, each sending its index (and, on a GPU, an
/// event) into a channel when its gradient is final. The hooks are removed on drop, which must
/// not happen while a backward pass over the parameters runs.
pub struct GradReadyHooks<T> {
    params: Vec<Tensor>,
    context: Box<std::sync::mpsc::Sender<T>>,
}

impl<T: From<GradReady> + Send> GradReadyHooks<T> {
    pub fn register(params: &[Tensor], sender: std::sync::mpsc::Sender<T>) -> Result<GradReadyHooks<T>> {
        let mut hooks = GradReadyHooks { params: Vec::new(), context: Box::new(sender) };
        let context = &*hooks.context as *const std::sync::mpsc::Sender<T> as *mut c_void;
        for (index, p) in params.iter().enumerate() {
            let mut handle = p.shallow_clone();
            let mut err = [0 as c_char; 256];
            // SAFETY: as_mut_ptr is tch's pointer to the at::Tensor it owns, valid while `handle`
            // lives (kept in hooks.params until the hooks are removed); the callback and the
            // context outlive the hook (see Drop); the buffer is writable.
            let rc = unsafe {
                hpc_register_grad_ready_hook(handle.as_mut_ptr() as *mut c_void, index as i64, on_grad_ready::<T>, context, err.as_mut_ptr(), err.len())
            };
            hooks.params.push(handle);
            if rc != 0 {
                return Err(Error::exchange("overlap", format!("registering the hook of parameter {index}: {}", shim_error(&err))));
            }
        }
        Ok(hooks)
    }
}

impl<T> Drop for GradReadyHooks<T> {
    fn drop(&mut self) {
        for p in &mut self.params {
            let mut err = [0 as c_char; 256];
            // SAFETY: as in register; afterwards libtorch holds no pointer to the context.
            unsafe { hpc_clear_grad_ready_hook(p.as_mut_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
        }
    }
}

// ---- Settings tch does not expose (src/shim/grad_hooks.cpp). ----

extern "C" {
    fn hpc_set_allow_tf32(allow: bool);
    fn hpc_set_cuda_autocast_dtype(which: c_int, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_channels_last(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_cuda_autocast_enter() -> bool;
    fn hpc_cuda_autocast_exit(was_enabled: bool);
    fn hpc_pin_memory(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_param_to_channels_last(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_release_grad(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn hpc_fused_sgd(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        momentum_buffers: *const *mut c_void,
        count: i64,
        weight_decay: f64,
        momentum: f64,
        lr: f64,
        is_first_step: bool,
        error: *mut c_char,
        error_length: usize,
    ) -> c_int;
}

/// Allows or forbids TF32 in cuBLAS and cuDNN (libtorch's global setting).
pub fn set_allow_tf32(allow: bool) {
    // SAFETY: sets two flags of libtorch's global context; no pointers involved.
    unsafe { hpc_set_allow_tf32(allow) }
}

/// Makes CUDA autocast cast to bfloat16 (`true`) or float16.
pub fn set_cuda_autocast_bf16(bf16: bool) -> Result<()> {
    let mut err = [0 as c_char; 256];
    // SAFETY: plain values and a writable buffer.
    let rc = unsafe { hpc_set_cuda_autocast_dtype(c_int::from(bf16), err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(Error::usage(format!("setting the autocast type: {}", shim_error(&err))));
    }
    Ok(())
}

/// Runs `f` with CUDA autocast on (the type set by [`set_cuda_autocast_bf16`]), through
/// libtorch's device-type API: tch's `autocast` calls the deprecated one, which warns on every
/// call. Call it only where a precision asks for autocast.
pub fn with_cuda_autocast<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: flips libtorch's thread-local autocast state; no pointers involved.
    let was = unsafe { hpc_cuda_autocast_enter() };
    // Left on every path, a panic included, so that no later code runs under autocast.
    struct Exit(bool);
    impl Drop for Exit {
        fn drop(&mut self) {
            // SAFETY: as above; pairs with the enter call.
            unsafe { hpc_cuda_autocast_exit(self.0) }
        }
    }
    let _exit = Exit(was);
    f()
}

/// A pinned (page-locked) copy of a host tensor, from which copies to a GPU run without
/// blocking. `Tensor.pin_memory()` without a device: tch passes one, which libtorch 2.x
/// deprecates with a warning per call.
pub fn pin_memory(t: &Tensor) -> Result<Tensor> {
    let mut err = [0 as c_char; 256];
    let mut handle = t.shallow_clone();
    // SAFETY: the pointer is tch's at::Tensor, alive during the call; the shim returns a new
    // heap at::Tensor (or null), whose ownership passes to the tch Tensor made from it.
    let out = unsafe { hpc_pin_memory(handle.as_mut_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
    if out.is_null() {
        return Err(Error::Torch(tch::TchError::Torch(shim_error(&err))));
    }
    // SAFETY: a fresh at::Tensor* from the shim, owned by nobody else.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// A copy of a 4-d tensor in channels-last (NHWC) memory order.
pub fn channels_last(t: &Tensor) -> Result<Tensor> {
    let mut err = [0 as c_char; 256];
    let mut handle = t.shallow_clone();
    // SAFETY: the pointer is tch's at::Tensor, alive during the call; the shim returns a new
    // heap at::Tensor (or null), whose ownership passes to the tch Tensor made from it.
    let out = unsafe { hpc_channels_last(handle.as_mut_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
    if out.is_null() {
        return Err(Error::Torch(tch::TchError::Torch(shim_error(&err))));
    }
    // SAFETY: a fresh at::Tensor* from the shim, owned by nobody else.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// Moves a 4-d parameter to channels-last memory order in place (other tensors are left).
pub fn param_to_channels_last(p: &Tensor) -> Result<()> {
    let mut err = [0 as c_char; 256];
    let mut handle = p.shallow_clone();
    // SAFETY: tch's at::Tensor pointer, alive during the call; set_data keeps the tensor's
    // identity, so other handles of it see the new storage.
    let rc = unsafe { hpc_param_to_channels_last(handle.as_mut_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(Error::Torch(tch::TchError::Torch(shim_error(&err))));
    }
    Ok(())
}

/// Drops the parameter's gradient (set to none): its memory goes back once no other handle
/// holds it, and the next backward makes a new one.
pub fn release_grad(p: &Tensor) -> Result<()> {
    let mut err = [0 as c_char; 256];
    let mut handle = p.shallow_clone();
    // SAFETY: tch's at::Tensor pointer, alive during the call; the handle shares the
    // parameter's autograd meta, so the parameter itself loses its gradient.
    let rc = unsafe { hpc_release_grad(handle.as_mut_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(Error::Torch(tch::TchError::Torch(shim_error(&err))));
    }
    Ok(())
}

/// The SGD update of `params` in one pass per tensor (libtorch's fused SGD kernel): with
/// d = g + weight_decay w, the momentum buffer v becomes d on the first step and momentum v + d
/// after, and w -= lr v. `grads` are left as they are. The caller makes each parameter, its
/// gradient and its buffer alike in device, kind and strides; `momentum_buffers` is empty when
/// momentum is 0, else one per parameter (contents ignored on the first step).
pub fn fused_sgd(params: &[&Tensor], grads: &[&Tensor], momentum_buffers: &[&Tensor], weight_decay: f64, momentum: f64, lr: f64, is_first_step: bool) -> Result<()> {
    let buffers_expected = if momentum != 0.0 { params.len() } else { 0 };
    if grads.len() != params.len() || momentum_buffers.len() != buffers_expected {
        return Err(Error::Torch(tch::TchError::Torch(format!(
            "fused SGD: {} parameters, {} gradients, {} momentum buffers",
            params.len(),
            grads.len(),
            momentum_buffers.len()
        ))));
    }
    let pointers = |tensors: &[&Tensor]| -> Vec<*mut c_void> { tensors.iter().map(|t| t.as_ptr() as *mut c_void).collect() };
    let (p, g, v) = (pointers(params), pointers(grads), pointers(momentum_buffers));
    let mut err = [0 as c_char; 256];
    // SAFETY: each pointer is a tch at::Tensor borrowed for the call; the arrays hold `count`
    // entries each (the buffers' array is read only when momentum is non-zero, and then holds
    // `count` too: checked above). The shim copies the handles (a reference count) and updates
    // the tensors' data in place, as any in-place libtorch op on a shared handle does.
    let rc = unsafe { hpc_fused_sgd(p.as_ptr(), g.as_ptr(), v.as_ptr(), p.len() as i64, weight_decay, momentum, lr, is_first_step, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(Error::Torch(tch::TchError::Torch(shim_error(&err))));
    }
    Ok(())
}

/// A flat view of a tensor whose elements fill its storage without gaps (contiguous, or dense
/// in another order such as channels-last), so that ranks holding the same layout can reduce
/// it element by element. Errors for tensors with gaps or overlaps.
pub fn flat_dense_view(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        return Ok(t.f_view([-1])?);
    }
    let (sizes, strides) = (t.size(), t.stride());
    let mut dims: Vec<(i64, i64)> = sizes.iter().copied().zip(strides.iter().copied()).filter(|(s, _)| *s != 1).collect();
    dims.sort_by_key(|&(_, stride)| stride);
    let mut expected = 1;
    for (size, stride) in dims {
        if stride != expected {
            return Err(Error::exchange("memory", format!("a tensor of sizes {sizes:?} and strides {strides:?} is not dense")));
        }
        expected *= size;
    }
    Ok(t.f_as_strided([t.numel() as i64], [1], None::<i64>)?)
}

// ---- Segments of a host buffer with MPI requests in flight. ----

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
            crate::watchdog::progress();
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
            if rc != 0 || (size as usize) < part || ptr.is_null() || (ptr as usize) % 8 != 0 {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_uuids_are_written_as_nvidia_smi_writes_them() {
        let bytes: [u8; 16] = [0x3f, 0x1a, 0x00, 0x9b, 0x12, 0x34, 0xab, 0xcd, 0x00, 0x01, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54];
        assert_eq!(format_gpu_uuid(&bytes), "GPU-3f1a009b-1234-abcd-0001-fedcba987654");
    }

    /// The peak is never below a resident-memory figure read earlier, nor below the one now
    /// (issue 31: results/zero showed a "peak" below "RSS at end").
    #[test]
    fn the_peak_is_at_least_every_resident_figure() {
        let before = current_rss_mb();
        let mut block = vec![0u8; 96 << 20];
        // Touch every page so that it becomes resident.
        block.iter_mut().step_by(4096).for_each(|b| *b = 1);
        let during = current_rss_mb();
        assert!(during > before + 64.0, "96 MiB touched: {before:.1} -> {during:.1} MiB");
        drop(std::hint::black_box(block));
        let peak = peak_rss_mb();
        assert!(peak >= during && peak >= current_rss_mb(), "peak {peak:.1} < a figure read before ({during:.1})");
    }
}
