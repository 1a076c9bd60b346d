//! libtorch's profiler (Kineto, what torch.profiler drives) through the shim
//! (src/shim/profiler.cpp): collecting starts and stops on the training thread, and each
//! profiled step is a user scope named as torch.profiler names its steps.
//!
//! The invariants its unsafe code relies on: a heap mark the shim returns is owned by exactly
//! one [`StepMark`] and closed once, by its drop, on the thread that opened it (a `StepMark` is
//! neither `Send` nor `Sync`: it holds a raw pointer); the strings handed to the shim are
//! NUL-terminated and live through the call; the error buffer is as in [`super::cuda`].

use std::ffi::{c_char, c_int, c_void, CString};
use std::path::Path;
use std::ptr::NonNull;

use crate::error::{Error, Result};

use super::cuda::shim_error;

extern "C" {
    fn hpc_profiler_start(cuda: bool, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_profiler_stop(path: *const c_char, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_mark_begin(name: *const c_char, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_mark_end(mark: *mut c_void);
    fn hpc_thread_state_capture(error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_thread_state_free(state: *mut c_void);
    fn hpc_thread_state_enter(state: *const c_void, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_thread_state_leave(guard: *mut c_void);
}

fn profiler_error(what: &str, err: &[c_char]) -> Error {
    Error::Torch(tch::TchError::Torch(format!("profiler: {what}: {}", shim_error(err))))
}

/// Starts collecting host ops on this thread (and on the autograd engine's threads, which
/// libtorch hands the profiler to), with CUDA kernels and copies where `cuda`.
pub fn profiler_start(cuda: bool) -> Result<()> {
    let mut err = [0 as c_char; 256];
    // SAFETY: a plain value and a writable buffer.
    if unsafe { hpc_profiler_start(cuda, err.as_mut_ptr(), err.len()) } != 0 {
        return Err(profiler_error("starting", &err));
    }
    Ok(())
}

/// Stops collecting and writes the Chrome trace (JSON) to `path`.
pub fn profiler_stop(path: &Path) -> Result<()> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| Error::usage(format!("{}: a path with a NUL byte", path.display())))?;
    let mut err = [0 as c_char; 256];
    // SAFETY: a NUL-terminated string alive through the call, and a writable buffer.
    if unsafe { hpc_profiler_stop(c_path.as_ptr(), err.as_mut_ptr(), err.len()) } != 0 {
        return Err(profiler_error(&format!("writing {}", path.display()), &err));
    }
    Ok(())
}

/// A user scope in the profile, open until dropped (on the thread that opened it).
pub struct StepMark(NonNull<c_void>);

impl StepMark {
    pub fn open(name: &str) -> Result<StepMark> {
        let c_name = CString::new(name).map_err(|_| Error::usage(format!("profiler mark {name:?}: a NUL byte")))?;
        let mut err = [0 as c_char; 256];
        // SAFETY: a NUL-terminated string alive through the call (the shim copies it), and a
        // writable buffer; the shim returns a new heap mark or null.
        let mark = unsafe { hpc_mark_begin(c_name.as_ptr(), err.as_mut_ptr(), err.len()) };
        NonNull::new(mark).map(StepMark).ok_or_else(|| profiler_error(&format!("marking {name}"), &err))
    }
}

impl Drop for StepMark {
    fn drop(&mut self) {
        // SAFETY: the mark came from hpc_mark_begin, is owned by this value alone and closed
        // here once, on the thread that opened it (StepMark is not Send).
        unsafe { hpc_mark_end(self.0.as_ptr()) }
    }
}

/// A thread's libtorch state (the profiler's among it), captured to be set on another thread
/// for one piece of work: overlap's backward thread runs each backward under the MPI thread's
/// state, so that `--profile-dir` sees its ops as it sees those of the autograd engine's threads.
pub struct ThreadState(NonNull<c_void>);

// SAFETY: an at::ThreadLocalState is a value (copies of thread-local settings and shared
// pointers to the profiler's state), made to be carried to another thread; this value owns it
// alone and frees it once, on whichever thread drops it.
unsafe impl Send for ThreadState {}

impl ThreadState {
    /// The calling thread's state.
    pub fn capture() -> Result<ThreadState> {
        let mut err = [0 as c_char; 256];
        // SAFETY: a writable buffer; the shim returns a new heap state or null.
        let state = unsafe { hpc_thread_state_capture(err.as_mut_ptr(), err.len()) };
        NonNull::new(state).map(ThreadState).ok_or_else(|| profiler_error("capturing the thread's state", &err))
    }

    /// Sets the state as the calling thread's until the guard is dropped (on this thread).
    pub fn enter(&self) -> Result<ThreadStateGuard<'_>> {
        let mut err = [0 as c_char; 256];
        // SAFETY: the state is alive while the guard borrows it; the shim returns a new heap
        // guard or null.
        let guard = unsafe { hpc_thread_state_enter(self.0.as_ptr(), err.as_mut_ptr(), err.len()) };
        NonNull::new(guard).map(|g| ThreadStateGuard(g, std::marker::PhantomData)).ok_or_else(|| profiler_error("setting the thread's state", &err))
    }
}

impl Drop for ThreadState {
    fn drop(&mut self) {
        // SAFETY: made by hpc_thread_state_capture, owned by this value alone, freed once; no
        // guard outlives it (a guard borrows it).
        unsafe { hpc_thread_state_free(self.0.as_ptr()) }
    }
}

/// The state of [`ThreadState::enter`] set on this thread, restored when dropped.
pub struct ThreadStateGuard<'a>(NonNull<c_void>, std::marker::PhantomData<&'a ThreadState>);

impl Drop for ThreadStateGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: made by hpc_thread_state_enter on this thread (a guard holds a raw pointer, so
        // it is not Send), deleted once, here, which restores the thread's previous state.
        unsafe { hpc_thread_state_leave(self.0.as_ptr()) }
    }
}
