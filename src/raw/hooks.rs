//! Gradient-ready hooks (src/shim/grad_hooks.cpp): a post-accumulate-grad hook on each
//! parameter that sends the parameter's index into a channel once its gradient is final for the
//! backward pass, having recorded (on a GPU) the reused event of the parameter's slot (its
//! bucket) on the stream that accumulated it, as DDP keeps one event per bucket.
//!
//! The invariants its unsafe code relies on: the context the hooks point to (the channel's
//! sender and the slots' events), and the parameters' handles they are registered on, outlive
//! every hook: [`GradReadyHooks`] owns them and removes the hooks before it drops them, which its
//! owner lets happen only when no backward pass runs.

use std::ffi::{c_char, c_int, c_void};
use std::sync::mpsc::Sender;
use std::sync::Mutex;

use tch::{Device, Tensor};

use crate::error::{Error, Result};
use crate::raw::cuda::{shim_error, CudaEvent};

type GradReadyCallback = extern "C" fn(context: *mut c_void, index: i64, device_index: i64);

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
    /// On a GPU: whether its slot's event was recorded after the gradient's accumulation (Err
    /// with the reason where recording failed); Ok(false) on the CPU.
    pub recorded: std::result::Result<bool, String>,
}

/// Each parameter's slot (its bucket), and each slot's event, recorded again by every gradient
/// of the slot: once the slot's last gradient has reported, its event covers them all (one
/// stream accumulates them, and a record replaces the one before).
struct SlotEvents {
    slot_of: Vec<usize>,
    events: Vec<Option<CudaEvent>>,
}

/// What the hooks point to.
struct HookContext<T> {
    sender: Sender<T>,
    slots: Mutex<SlotEvents>,
}

impl SlotEvents {
    fn record(&mut self, index: usize, device: Device) -> Result<()> {
        let slot = self.slot_of.get(index).copied().unwrap_or(0);
        if self.events.len() <= slot {
            self.events.resize_with(slot + 1, || None);
        }
        if self.events[slot].is_none() {
            self.events[slot] = CudaEvent::reusable(device, false)?;
        }
        match &self.events[slot] {
            Some(event) => event.record_current(device),
            None => Ok(()),
        }
    }
}

extern "C" fn on_grad_ready<T: From<GradReady> + Send>(context: *mut c_void, index: i64, device_index: i64) {
    // SAFETY: `context` is the Box<HookContext<T>> that `GradReadyHooks<T>` owns and keeps alive
    // until it has removed every hook (in Drop), which its owner does only once no backward pass
    // runs (overlap.rs joins its backward thread first); Sender and Mutex are Sync, so a shared
    // borrow from the autograd thread is fine.
    let context = unsafe { &*(context as *const HookContext<T>) };
    let index = index as usize;
    let recorded = match usize::try_from(device_index) {
        Err(_) => Ok(false),
        Ok(d) => match context.slots.lock() {
            Ok(mut slots) => slots.record(index, Device::Cuda(d)).map(|()| true).map_err(|e| e.to_string()),
            Err(_) => Err("the gradient hooks' events were poisoned by a panic".to_string()),
        },
    };
    // The receiver may be gone on an error path.
    let _ = context.sender.send(T::from(GradReady { index, recorded }));
}

/// Post-accumulate-grad hooks on a set of parameters, each sending its index into a channel when
/// its gradient is final (on a GPU, after recording its slot's event). The hooks are removed on
/// drop, which must not happen while a backward pass over the parameters runs.
pub struct GradReadyHooks<T> {
    params: Vec<Tensor>,
    context: Box<HookContext<T>>,
}

impl<T: From<GradReady> + Send> GradReadyHooks<T> {
    /// Every parameter starts in slot 0 ([`GradReadyHooks::set_slots`] assigns them).
    pub fn register(params: &[Tensor], sender: Sender<T>) -> Result<GradReadyHooks<T>> {
        let slots = Mutex::new(SlotEvents { slot_of: vec![0; params.len()], events: Vec::new() });
        let mut hooks = GradReadyHooks { params: Vec::new(), context: Box::new(HookContext { sender, slots }) };
        let context = &*hooks.context as *const HookContext<T> as *mut c_void;
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

impl<T> GradReadyHooks<T> {
    /// Puts parameter `i` in slot `slot_of[i]` (its bucket) from the next report on. Call only
    /// while no backward pass runs: a slot's event then stands for this assignment's gradients.
    pub fn set_slots(&self, slot_of: &[usize]) {
        let mut slots = self.context.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        slots.slot_of = slot_of.to_vec();
        let count = slot_of.iter().max().map_or(0, |&m| m + 1);
        slots.events.resize_with(count, || None);
    }

    /// Makes the calling thread's current stream on `device` wait, on the device, for slot
    /// `slot`'s event as last recorded.
    pub fn block_current_on(&self, slot: usize, device: Device) -> Result<()> {
        let slots = self.context.slots.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match slots.events.get(slot) {
            Some(Some(event)) => event.block_current(device),
            _ => Ok(()),
        }
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
