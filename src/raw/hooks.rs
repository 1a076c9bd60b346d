//! Gradient-ready hooks (src/shim/grad_hooks.cpp): a post-accumulate-grad hook on each
//! parameter that sends the parameter's index, and on a GPU an event, into a channel once its
//! gradient is final for the backward pass.
//!
//! The invariants its unsafe code relies on: the channel's sender the hooks point to, and the
//! parameters' handles they are registered on, outlive every hook: [`GradReadyHooks`] owns both
//! and removes the hooks before it drops them, which its owner lets happen only when no
//! backward pass runs.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::error::{Error, Result};
use crate::raw::cuda::{shim_error, CudaEvent};

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
