//! This process and its host, through libc: resident memory, glibc's allocator settings, free
//! space in a file system, the host name, the stop signals before main, the exit.
//!
//! The invariants its unsafe code relies on: an out-parameter is read only once the call that
//! fills it has succeeded (or it was zero-initialised), a string handed to libc is
//! NUL-terminated and outlives the call, and a signal handler touches nothing but an atomic.

use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::atomic::{AtomicI32, Ordering};

/// The last stop signal (SIGTERM, SIGUSR1) that arrived while [`hold_stop_signals`]' handler was
/// in place; 0 for none.
static STOP_SIGNAL_HELD: AtomicI32 = AtomicI32::new(0);

/// The stop signals that training turns into a stop request (train::run's `StopSignal`).
const STOP_SIGNALS: [c_int; 2] = [libc::SIGTERM, libc::SIGUSR1];

/// Called by glibc before the initialisers of every shared library, from the executable's
/// `.preinit_array` (the one place that runs earlier than they do): libtorch's static
/// initialisers take 0.4-1.0 s between exec and main on the development VM (the dynamic loader
/// itself 10 ms), and a SIGTERM then killed a training rank by its default action, which the job
/// reported as 143, the status that says a checkpoint holds the step (issue 64). Left out of the
/// unit tests' binary, whose harness should die of a signal as usual.
#[cfg(not(test))]
#[used]
#[link_section = ".preinit_array"]
static HOLD_STOP_SIGNALS_BEFORE_MAIN: extern "C" fn(c_int, *const *const c_char, *const *const c_char) = hold_stop_signals_before_main;

#[cfg(not(test))]
extern "C" fn hold_stop_signals_before_main(_argc: c_int, _argv: *const *const c_char, _envp: *const *const c_char) {
    hold_stop_signals();
}

#[cfg_attr(test, allow(dead_code))]
extern "C" fn note_stop_signal(signal: c_int) {
    STOP_SIGNAL_HELD.store(signal, Ordering::Relaxed);
}

/// Holds SIGTERM and SIGUSR1 (notes their arrival) until main knows what the command does with
/// them: [`stop_signal_held`] for training, which stops on them; [`release_stop_signals`] for
/// the others. Runs before main (see `HOLD_STOP_SIGNALS_BEFORE_MAIN`).
#[cfg_attr(test, allow(dead_code))]
fn hold_stop_signals() {
    for signal in STOP_SIGNALS {
        set_handler(signal, note_stop_signal as extern "C" fn(c_int) as libc::sighandler_t);
    }
}

/// Installs `handler` (a function's address, SIG_DFL or SIG_IGN) for `signal`; a signal the
/// kernel refuses keeps its action.
fn set_handler(signal: c_int, handler: libc::sighandler_t) {
    // SAFETY: `action` is zero-initialised (an empty mask, no flags) and then given a handler
    // that only stores into an atomic, which is async-signal-safe, or SIG_DFL; sigaction reads
    // it during the call only, and the old action is not asked for (null).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(signal, &action, std::ptr::null_mut());
    }
}

/// Whether a stop signal arrived before training's own handlers took over (they chain to the
/// holding one, so one that arrives later is seen by both).
pub fn stop_signal_held() -> bool {
    STOP_SIGNAL_HELD.load(Ordering::Relaxed) != 0
}

/// Gives SIGTERM and SIGUSR1 back their default action (ending the process), for the commands
/// that do not stop on them, and delivers now one that arrived while they were held: such a
/// command ends as if the signal had come with no handler.
pub fn release_stop_signals() {
    for signal in STOP_SIGNALS {
        set_handler(signal, libc::SIG_DFL);
    }
    let held = STOP_SIGNAL_HELD.load(Ordering::Relaxed);
    if held != 0 {
        // SAFETY: raise has no preconditions; the signal's action is its default now.
        unsafe { libc::raise(held) };
    }
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

/// Ends the process with `code`, its work done (files closed, MPI finalized): flushes Rust's
/// and C's standard streams, then `_exit`, skipping the C++ static destructors and atexit
/// handlers. libtorch's destructors unregister each of its thousands of operators one by one:
/// 0.15 s of CPU per process on the development VM (0.29 s registering them at start-up), paid
/// by every rank of every launch, and by CI's suite some thousand times. Where the process has
/// loaded the CUDA driver (libcuda), it exits through `exit` as before: CUDA's own teardown and
/// the profilers that hook it (Nsight Systems flushes its last buffers from an exit handler)
/// need it. The Rust side loses nothing: `std::process::exit` runs no Rust destructors either.
pub fn exit_process(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    if cuda_driver_loaded() {
        std::process::exit(code);
    }
    // SAFETY: fflush(NULL) flushes every C stdio stream of the process (the C++ shim's and the
    // MPI library's output); _exit has no preconditions and does not return.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(code)
    }
}

/// Whether the CUDA driver library is mapped into this process (a GPU was initialised): read
/// from /proc/self/maps; true where that cannot be read, so that the full exit is kept.
fn cuda_driver_loaded() -> bool {
    std::fs::read_to_string("/proc/self/maps").map_or(true, |maps| maps.lines().any(|l| l.contains("/libcuda.so")))
}

/// The high-water mark of this process's resident memory since the last [`restart_peak_rss`]
/// (or since it started), in MiB: Linux's VmHWM. None where /proc/self/status has no such line.
pub fn peak_rss_since_restart_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib / 1024.0)
}

/// Starts a new high-water mark of resident memory, so that [`peak_rss_since_restart_mb`] then
/// gives the peak of what follows (a phase of the run): writes 5 to /proc/self/clear_refs
/// (Linux 4.0 and later). The old mark is folded into [`peak_rss_mb`] first, since getrusage's
/// ru_maxrss reads the same mark and would drop with it. False where the kernel refuses.
pub fn restart_peak_rss() -> bool {
    if let Some(mark) = peak_rss_since_restart_mb() {
        HIGHEST_RSS_SEEN.fetch_max(mark.to_bits(), std::sync::atomic::Ordering::Relaxed);
    }
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
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

/// Held by the unit tests that measure this process's resident memory, which would otherwise
/// see each other's blocks (the test harness runs tests on parallel threads of one process).
#[cfg(test)]
pub(crate) static MEMORY_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// The peak is never below a resident-memory figure read earlier, nor below the one now
    /// (issue 31: results/zero showed a "peak" below "RSS at end"). Unit tests share this
    /// process with other tests running on other threads, which allocate and free as they
    /// please, so nothing here asserts how much the resident memory moved (CI once saw 96 MiB
    /// touched here grow it by 52 MiB, another test having freed the rest meanwhile): only the
    /// ordering, which holds whatever the other threads do.
    #[test]
    fn the_peak_is_at_least_every_resident_figure() {
        let _alone = MEMORY_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut block = vec![0u8; 96 << 20];
        // Touch every page so that it becomes resident, a figure the peak must then cover.
        block.iter_mut().step_by(4096).for_each(|b| *b = 1);
        let during = current_rss_mb();
        drop(std::hint::black_box(block));
        let now = current_rss_mb();
        let peak = peak_rss_mb();
        assert!(peak >= during && peak >= now, "peak {peak:.1} MiB below a figure read before it ({during:.1}, {now:.1})");
    }

    /// A restarted high-water mark drops to about the memory now, and the whole run's peak
    /// keeps what came before the restart. Other tests' threads may allocate meanwhile, so the
    /// drop is checked against a block far larger than they hold at once.
    #[test]
    fn a_restarted_peak_forgets_what_came_before_and_the_run_peak_does_not() {
        let _alone = MEMORY_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let mut block = vec![0u8; 512 << 20];
        block.iter_mut().step_by(4096).for_each(|b| *b = 1);
        let with_block = peak_rss_since_restart_mb().expect("VmHWM in /proc/self/status");
        drop(std::hint::black_box(block));
        assert!(restart_peak_rss(), "/proc/self/clear_refs refused 5");
        let after = peak_rss_since_restart_mb().unwrap();
        assert!(after < with_block - 256.0, "a restarted mark of {after:.1} MiB kept the 512 MiB block ({with_block:.1} before)");
        // Within 1 MiB: the kernel folds per-thread RSS counters in lazily, so two readings of
        // one mark can differ by a few pages (918.1 against 918.2 MiB seen).
        assert!(peak_rss_mb() >= with_block - 1.0, "the run's peak {:.1} lost the mark before the restart ({with_block:.1})", peak_rss_mb());
    }
}
