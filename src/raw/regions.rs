//! Tensor parallelism's two conjugate operators (src/shim/regions.cpp): "copy to the region"
//! (identity in forward, all-reduce of the gradient in backward) and "reduce from the region"
//! (all-reduce in forward, identity in backward), as autograd functions whose all-reduce calls
//! back into Rust, into the group's [`RegionAllReduce`] (hpc-train's own ring, rhd or auto).
//!
//! The invariants its unsafe code relies on: a registered group stays in the registry, and so
//! alive, until its [`RegisteredGroup`] is dropped, and a lookup clones the group's `Arc`, so a
//! call that runs meanwhile keeps it; the tensor the shim passes to the callback is an
//! at::Tensor it made for the call and holds until the callback returns; a group's reducer
//! (which makes MPI calls) runs on the thread that registered it unless MPI was initialised with
//! `MPI_THREAD_MULTIPLE` (checked on every call), and one call at a time (its mutex).

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex, Once};
use std::thread::ThreadId;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::raw::cuda::shim_error;

type RegionAllReduceCallback = extern "C" fn(group: i64, tensor: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;

extern "C" {
    fn hpc_region_set_all_reduce(callback: RegionAllReduceCallback);
    fn hpc_region_copy_to(tensor: *mut c_void, group: i64, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_region_reduce_from(tensor: *mut c_void, group: i64, error: *mut c_char, error_length: usize) -> *mut c_void;
}

/// Sums a tensor over a tensor-parallel group, in place.
pub trait RegionAllReduce {
    fn all_reduce(&mut self, tensor: &mut Tensor) -> Result<()>;

    /// Called by every rank of the group together once the run ends: frees what the reducer
    /// holds (a ring's node-shared window).
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

struct Registered {
    reducer: Mutex<Box<dyn RegionAllReduce>>,
    home: ThreadId,
    any_thread: bool,
}

// SAFETY: the reducer is reached only through its mutex (one call at a time), and only from the
// thread that registered it unless MPI provides MPI_THREAD_MULTIPLE (`any_thread`, checked in
// `reduce` before the lock is taken): the MPI handles inside are never used from two threads
// at once, nor from another thread than MPI allows.
unsafe impl Send for Registered {}
// SAFETY: as above; shared references only reach the mutex.
unsafe impl Sync for Registered {}

static GROUPS: Mutex<Vec<Option<Arc<Registered>>>> = Mutex::new(Vec::new());
static CALLBACK: Once = Once::new();

/// A tensor-parallel group, as the model's layers name it (a copyable handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionGroup(i64);

impl RegionGroup {
    /// The group's all-reduce (a sum, in place) called from Rust rather than from a layer's
    /// operator: the same reducer (watched, counted), the same thread rule.
    pub fn all_reduce(self, tensor: &mut Tensor) -> Result<()> {
        reduce(self.0, tensor)
    }
}

/// The registration of a group: removed from the registry (and its reducer dropped) on drop.
pub struct RegisteredGroup(RegionGroup);

impl RegisteredGroup {
    pub fn group(&self) -> RegionGroup {
        self.0
    }
}

impl RegisteredGroup {
    /// The group's reducer's `finish`, on every rank of the group together.
    pub fn finish(&self) -> Result<()> {
        let registered = GROUPS.lock().unwrap_or_else(|e| e.into_inner()).get(self.0 .0 as usize).cloned().flatten();
        match registered {
            Some(registered) => registered.reducer.lock().unwrap_or_else(|e| e.into_inner()).finish(),
            None => Ok(()),
        }
    }
}

impl Drop for RegisteredGroup {
    fn drop(&mut self) {
        let mut groups = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
        groups[self.0 .0 as usize] = None;
    }
}

/// Registers `reducer` for the layers of one tensor-parallel group. `threading` is the level MPI
/// was initialised with: below `MPI_THREAD_MULTIPLE`, the reducer refuses calls from other
/// threads (a GPU's backward runs on libtorch's device thread).
pub fn register_group(reducer: Box<dyn RegionAllReduce>, threading: mpi::Threading) -> RegisteredGroup {
    // SAFETY: the callback is a plain function that lives as long as the program.
    CALLBACK.call_once(|| unsafe { hpc_region_set_all_reduce(on_all_reduce) });
    let registered = Arc::new(Registered { reducer: Mutex::new(reducer), home: std::thread::current().id(), any_thread: threading >= mpi::Threading::Multiple });
    let mut groups = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
    groups.push(Some(registered));
    RegisteredGroup(RegionGroup(groups.len() as i64 - 1))
}

fn reduce(group: i64, tensor: &mut Tensor) -> Result<()> {
    let registered = GROUPS.lock().unwrap_or_else(|e| e.into_inner()).get(group as usize).cloned().flatten();
    let registered = registered.ok_or_else(|| Error::exchange("tensor parallel", format!("group {group} is not registered (the run has ended)")))?;
    if !registered.any_thread && std::thread::current().id() != registered.home {
        return Err(Error::exchange(
            "tensor parallel",
            "an all-reduce was called from another thread than the run's (a GPU's backward), which needs MPI_THREAD_MULTIPLE; this MPI library was not initialised with it",
        ));
    }
    let mut reducer = registered.reducer.lock().unwrap_or_else(|e| e.into_inner());
    reducer.all_reduce(tensor)
}

extern "C" fn on_all_reduce(group: i64, tensor: *mut c_void, error: *mut c_char, error_length: usize) -> c_int {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `tensor` is the at::Tensor the shim made for this call and holds until we
        // return; clone_from_ptr makes a second handle of it, dropped before we return.
        let mut handle = unsafe { Tensor::clone_from_ptr(tensor as *mut torch_sys::C_tensor) };
        reduce(group, &mut handle)
    }));
    let message = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e.to_string(),
        Err(_) => "the all-reduce panicked".to_string(),
    };
    if !error.is_null() && error_length > 0 {
        let bytes = message.as_bytes();
        let n = bytes.len().min(error_length - 1);
        // SAFETY: `error` is the shim's buffer of `error_length` bytes, writable during the call;
        // n + 1 <= error_length.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, error, n);
            *error.add(n) = 0;
        }
    }
    1
}

impl RegionGroup {
    /// Identity in forward; the gradient summed over the group in backward. Where a
    /// column-parallel layer begins: each rank's part of the input's gradient is summed.
    pub fn copy_to(self, x: &Tensor) -> Result<Tensor> {
        apply(x, self.0, hpc_region_copy_to)
    }

    /// The partial results summed over the group in forward; identity in backward. Where a
    /// row-parallel layer ends.
    pub fn reduce_from(self, x: &Tensor) -> Result<Tensor> {
        apply(x, self.0, hpc_region_reduce_from)
    }
}

fn apply(x: &Tensor, group: i64, function: unsafe extern "C" fn(*mut c_void, i64, *mut c_char, usize) -> *mut c_void) -> Result<Tensor> {
    let mut err = [0 as c_char; 512];
    let mut handle = x.shallow_clone();
    // SAFETY: the pointer is tch's at::Tensor, alive during the call; the shim returns a new heap
    // at::Tensor (or null), whose ownership passes to the tch Tensor made from it.
    let out = unsafe { function(handle.as_mut_ptr() as *mut c_void, group, err.as_mut_ptr(), err.len()) };
    if out.is_null() {
        return Err(Error::Torch(tch::TchError::Torch(shim_error(&err))));
    }
    // SAFETY: a fresh at::Tensor* from the shim, owned by nobody else.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// A group of `copies` identical ranks: the sum is the tensor times `copies`.
    struct Copies(f64, std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl RegionAllReduce for Copies {
        fn all_reduce(&mut self, tensor: &mut Tensor) -> Result<()> {
            self.1.fetch_add(tensor.numel(), std::sync::atomic::Ordering::Relaxed);
            let _ = tch::no_grad(|| tensor.f_mul_scalar_(self.0))?;
            Ok(())
        }
    }

    #[test]
    fn the_operators_sum_in_one_direction_only() {
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let registered = register_group(Box::new(Copies(3.0, count.clone())), mpi::Threading::Single);
        let group = registered.group();
        let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);

        // copy_to: the value as it is; the gradient (ones) summed: 3.
        let y = group.copy_to(&w).unwrap();
        assert_eq!(Vec::<f32>::try_from(&y).unwrap(), vec![1.0, 2.0, 3.0]);
        y.sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&w.grad()).unwrap(), vec![3.0; 3]);
        assert_eq!(count.load(std::sync::atomic::Ordering::Relaxed), 3);

        // reduce_from: the value summed; the gradient as it is (1 more on top of the 3).
        let z = group.reduce_from(&(&w * 2.0)).unwrap();
        assert_eq!(Vec::<f32>::try_from(&z).unwrap(), vec![6.0, 12.0, 18.0]);
        z.sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&w.grad()).unwrap(), vec![5.0; 3]);
        assert_eq!(count.load(std::sync::atomic::Ordering::Relaxed), 6);

        // Another thread, without MPI_THREAD_MULTIPLE: refused by name, not run.
        let x = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let err = std::thread::spawn(move || group.reduce_from(&x).map(|_| ()).unwrap_err().to_string()).join().unwrap();
        assert!(err.contains("MPI_THREAD_MULTIPLE"), "{err}");
        drop(registered);
        let err = group.reduce_from(&Tensor::ones([2], (Kind::Float, Device::Cpu))).unwrap_err().to_string();
        assert!(err.contains("not registered"), "{err}");
    }

    /// A reducer whose `finish` frees what it holds: counted here.
    struct Finishing(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl RegionAllReduce for Finishing {
        fn all_reduce(&mut self, _tensor: &mut Tensor) -> Result<()> {
            Ok(())
        }

        fn finish(&mut self) -> Result<()> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        }
    }

    /// The group's exchange was never finished, its shared window never freed (issue 48): the
    /// registered group hands `finish` to its reducer.
    #[test]
    fn finishing_a_group_finishes_its_reducer() {
        let finished = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let registered = register_group(Box::new(Finishing(finished.clone())), mpi::Threading::Single);
        registered.finish().unwrap();
        assert_eq!(finished.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}
