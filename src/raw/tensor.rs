//! Tensor memory without libtorch in between: a tensor's elements as a slice or as an MPI
//! buffer, plain copies between host tensors, and what tch does not expose, through the shim
//! (src/shim/grad_hooks.cpp): non-blocking copies, pinned memory, channels-last layouts,
//! releasing a gradient, libtorch's fused SGD.
//!
//! The invariants its unsafe code relies on: a tensor viewed as a slice or handed to MPI is
//! contiguous, of the element type and on the device the view expects (checked here), and no
//! other handle of it, in libtorch or the program, touches it while the view lives (the
//! caller's contract, written as `# Safety` on each function that makes a view); a tensor handed
//! to the shim is tch's live at::Tensor for the whole call, and one the shim returns is new and
//! owned by nobody else.

use std::ffi::{c_char, c_int, c_void};

use mpi::datatype::{DatatypeRef, DynBufferMut};
use mpi::raw::{AsRaw, FromRaw};
use mpi::traits::Equivalence;
use tch::{Device, Tensor};

use crate::element::Element;
use crate::error::{Error, Result};
use crate::raw::cuda::shim_error;
use crate::raw::mpi::mpi_count;

extern "C" {
    fn hpc_copy(dst: *mut c_void, src: *mut c_void, non_blocking: bool, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_channels_last(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_pin_memory(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_zero_all(tensors: *const *mut c_void, count: i64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_unscale_and_check(tensors: *const *mut c_void, count: i64, found_inf: *mut c_void, inv_scale: f64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_empty_pinned_bytes(sizes: *const i64, dims: usize, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_param_to_channels_last(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_release_grad(tensor: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_set_grad(tensor: *mut c_void, grad: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
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
        found_inf: *mut c_void,
        error: *mut c_char,
        error_length: usize,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    fn hpc_fused_adamw(
        params: *const *mut c_void,
        grads: *const *mut c_void,
        exp_avgs: *const *mut c_void,
        exp_avg_sqs: *const *mut c_void,
        count: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        step: i64,
        found_inf: *mut c_void,
        error: *mut c_char,
        error_length: usize,
    ) -> c_int;
}

/// Checks that `t` is a contiguous CPU tensor of element type `E` and returns its length.
pub(super) fn check_host<E: Element>(t: &Tensor) -> Result<usize> {
    if t.device() != Device::Cpu {
        return Err(Error::exchange("memory", format!("expected a CPU tensor, got one on {:?}", t.device())));
    }
    check_layout::<E>(t)
}

pub(super) fn check_layout<E: Element>(t: &Tensor) -> Result<usize> {
    if t.kind() != E::KIND {
        return Err(Error::exchange("memory", format!("expected {:?} elements, got {:?}", E::KIND, t.kind())));
    }
    if !t.is_contiguous() {
        return Err(Error::exchange("memory", "expected a contiguous tensor"));
    }
    Ok(t.numel())
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

/// Raw pointer of a tensor's data, for identity comparisons only (never dereferenced).
pub fn data_address(t: &Tensor) -> usize {
    t.data_ptr() as *const c_void as usize
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
        return Err(shim_failure(&err));
    }
    Ok(())
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
        return Err(shim_failure(&err));
    }
    // SAFETY: a fresh at::Tensor* from the shim, owned by nobody else.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// A uint8 host tensor of `len` bytes written by `fill`, in pinned (page-locked) memory when
/// `pinned`: bytes read straight into pinned memory cross to a GPU without blocking and without
/// the extra copy that [`pin_memory`] makes.
pub fn host_bytes(len: usize, pinned: bool, fill: impl FnOnce(&mut [u8]) -> Result<()>) -> Result<Tensor> {
    let t = if pinned && len > 0 {
        let shape = [len as i64];
        let mut err = [0 as c_char; 256];
        // SAFETY: `shape` is read for its one value during the call; the shim returns a new heap
        // at::Tensor (or null), whose ownership passes to the tch Tensor made from it.
        let out = unsafe { hpc_empty_pinned_bytes(shape.as_ptr(), shape.len(), err.as_mut_ptr(), err.len()) };
        if out.is_null() {
            return Err(shim_failure(&err));
        }
        // SAFETY: a fresh at::Tensor* from the shim, owned by nobody else.
        unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) }
    } else {
        Tensor::f_empty([len as i64], (tch::Kind::Uint8, Device::Cpu))?
    };
    if len > 0 {
        // SAFETY: `t` was made above as `len` contiguous uint8 elements in host memory, and no
        // other handle to it exists; the slice is gone when `fill` returns.
        let bytes = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut u8, len) };
        fill(bytes)?;
    } else {
        fill(&mut [])?;
    }
    Ok(t)
}

/// A copy of a 4-d tensor in channels-last (NHWC) memory order.
pub fn channels_last(t: &Tensor) -> Result<Tensor> {
    let mut err = [0 as c_char; 256];
    let mut handle = t.shallow_clone();
    // SAFETY: the pointer is tch's at::Tensor, alive during the call; the shim returns a new
    // heap at::Tensor (or null), whose ownership passes to the tch Tensor made from it.
    let out = unsafe { hpc_channels_last(handle.as_mut_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
    if out.is_null() {
        return Err(shim_failure(&err));
    }
    // SAFETY: a fresh at::Tensor* from the shim, owned by nobody else.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

/// The strides of a 4-d tensor of `sizes` (N, C, H, W) laid out channels-last (NHWC): what
/// `contiguous(memory_format=channels_last)` gives.
pub fn channels_last_strides(sizes: &[i64]) -> Result<[i64; 4]> {
    match *sizes {
        [_, c, h, w] => Ok([h * w * c, 1, w * c, c]),
        _ => Err(Error::exchange("memory", format!("channels-last needs a 4-d tensor, not one of sizes {sizes:?}"))),
    }
}

/// Whether `t` is a 4-d tensor laid out channels-last without gaps (libtorch's
/// `is_contiguous(at::MemoryFormat::ChannelsLast)`: the stride of a dimension of size 1 does
/// not count).
pub fn is_channels_last(t: &Tensor) -> bool {
    let sizes = t.size();
    let Ok(expected) = channels_last_strides(&sizes) else { return false };
    sizes.iter().zip(t.stride()).zip(expected).all(|((&size, stride), want)| size == 1 || stride == want)
}

/// Moves a 4-d parameter to channels-last memory order in place (other tensors are left).
pub fn param_to_channels_last(p: &Tensor) -> Result<()> {
    let mut err = [0 as c_char; 256];
    let mut handle = p.shallow_clone();
    // SAFETY: tch's at::Tensor pointer, alive during the call; set_data keeps the tensor's
    // identity, so other handles of it see the new storage.
    let rc = unsafe { hpc_param_to_channels_last(handle.as_mut_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(shim_failure(&err));
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
        return Err(shim_failure(&err));
    }
    Ok(())
}

/// Makes `grad` the parameter's gradient (sizes, device and dtype checked): the next backward
/// adds into it in place, so that a view into a bucket's buffer is where backward writes.
pub fn set_grad(p: &Tensor, grad: &Tensor) -> Result<()> {
    let mut err = [0 as c_char; 256];
    let mut handle = p.shallow_clone();
    // SAFETY: two of tch's at::Tensor pointers, alive during the call; the handle shares the
    // parameter's autograd meta (the parameter itself gets the gradient), and the shim copies
    // `grad`'s handle (a reference count) rather than taking it.
    let rc = unsafe { hpc_set_grad(handle.as_mut_ptr() as *mut c_void, grad.as_ptr() as *mut c_void, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(shim_failure(&err));
    }
    Ok(())
}

/// The at::Tensor handles of `tensors`, as the shim's tensor-list calls take them (borrowed for
/// the call: the shim copies each handle, a reference count).
fn handles(tensors: &[&Tensor]) -> Vec<*mut c_void> {
    tensors.iter().map(|t| t.as_ptr() as *mut c_void).collect()
}

/// The error of a failed call into the shim, from the message it wrote into `err`.
fn shim_failure(err: &[c_char]) -> Error {
    Error::Torch(tch::TchError::Torch(shim_error(err)))
}

/// The SGD update of `params` in one pass per tensor (libtorch's fused SGD kernel): with
/// d = g + weight_decay w, the momentum buffer v becomes d on the first step and momentum v + d
/// after, and w -= lr v. `grads` are left as they are. The caller makes each parameter, its
/// gradient and its buffer alike in device, kind and strides; `momentum_buffers` is empty when
/// momentum is 0, else one per parameter (contents ignored on the first step).
pub fn fused_sgd(params: &[&Tensor], grads: &[&Tensor], momentum_buffers: &[&Tensor], weight_decay: f64, momentum: f64, lr: f64, is_first_step: bool, skip_if: Option<&Tensor>) -> Result<()> {
    let buffers_expected = if momentum != 0.0 { params.len() } else { 0 };
    if grads.len() != params.len() || momentum_buffers.len() != buffers_expected {
        return Err(Error::Torch(tch::TchError::Torch(format!(
            "fused SGD: {} parameters, {} gradients, {} momentum buffers",
            params.len(),
            grads.len(),
            momentum_buffers.len()
        ))));
    }
    let (p, g, v) = (handles(params), handles(grads), handles(momentum_buffers));
    let mut err = [0 as c_char; 256];
    // SAFETY: each pointer is a tch at::Tensor borrowed for the call; the arrays hold `count`
    // entries each (the buffers' array is read only when momentum is non-zero, and then holds
    // `count` too: checked above). The shim copies the handles (a reference count) and updates
    // the tensors' data in place, as any in-place libtorch op on a shared handle does.
    let mut skip = skip_if.map(Tensor::shallow_clone);
    let found_inf = skip.as_mut().map_or(std::ptr::null_mut(), |t| t.as_mut_ptr() as *mut c_void);
    // SAFETY: as above; `found_inf` is null or a live one-element at::Tensor held by `skip` for
    // the call, which the kernel only reads.
    let rc = unsafe { hpc_fused_sgd(p.as_ptr(), g.as_ptr(), v.as_ptr(), p.len() as i64, weight_decay, momentum, lr, is_first_step, found_inf, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(shim_failure(&err));
    }
    Ok(())
}

/// Zeroes every tensor in place (libtorch's `_foreach_zero_`): on CUDA a few multi-tensor
/// launches where a `zero_` per tensor is one launch each.
pub fn zero_all(tensors: &[&Tensor]) -> Result<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    let list = handles(tensors);
    let mut err = [0 as c_char; 256];
    // SAFETY: each pointer is a tch at::Tensor borrowed for the call and `list` holds `count`
    // of them; the shim copies the handles (a reference count) and writes the tensors'
    // data in place, as any in-place libtorch op on a shared handle does.
    let rc = unsafe { hpc_zero_all(list.as_ptr(), list.len() as i64, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(shim_failure(&err));
    }
    Ok(())
}

/// GradScaler's unscale (libtorch's `_amp_foreach_non_finite_check_and_unscale_`): multiplies
/// every tensor by `inv_scale` in place and returns a one-element float tensor on their device,
/// queued and not read, that holds 1 where any element was not finite (before the multiply)
/// and 0 otherwise. On CUDA one multi-tensor pass over all of them. The tensors share a device
/// and are of floating kinds.
pub fn unscale_and_check(tensors: &[&Tensor], inv_scale: f64) -> Result<Tensor> {
    let device = tensors.first().map_or(Device::Cpu, |t| t.device());
    let mut found = Tensor::f_zeros([1], (tch::Kind::Float, device))?;
    unscale_and_check_into(tensors, inv_scale, &mut found)?;
    Ok(found)
}

/// As [`unscale_and_check`], setting `found` (a one-element float tensor on the tensors'
/// device) to 1 where any element was not finite and leaving it as it was otherwise: a flag that
/// stays set over the steps it is handed to.
pub fn unscale_and_check_into(tensors: &[&Tensor], inv_scale: f64, found: &mut Tensor) -> Result<()> {
    if tensors.is_empty() {
        return Ok(());
    }
    let list = handles(tensors);
    let mut err = [0 as c_char; 256];
    // SAFETY: each pointer is a tch at::Tensor borrowed for the call, `list` holds `count` of
    // them, and `found` is a live at::Tensor; the shim copies the handles (a reference count) and
    // writes the tensors' data and `found` in place, as libtorch's in-place ops on shared
    // handles do.
    let rc = unsafe { hpc_unscale_and_check(list.as_ptr(), list.len() as i64, found.as_mut_ptr() as *mut c_void, inv_scale, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(shim_failure(&err));
    }
    Ok(())
}

/// The AdamW update of `params` in one pass per tensor (libtorch's fused AdamW kernel, that of
/// `torch.optim.AdamW(fused=True)`) for step `step` counted from 1: see optim/adamw.rs for the
/// rule. `grads` are left as they are. The caller makes each parameter, its gradient and its two
/// buffers alike in device, kind and strides.
#[allow(clippy::too_many_arguments)]
pub fn fused_adamw(params: &[&Tensor], grads: &[&Tensor], exp_avgs: &[&Tensor], exp_avg_sqs: &[&Tensor], lr: f64, beta1: f64, beta2: f64, weight_decay: f64, eps: f64, step: u64, skip_if: Option<&Tensor>) -> Result<()> {
    let n = params.len();
    if grads.len() != n || exp_avgs.len() != n || exp_avg_sqs.len() != n {
        return Err(Error::Torch(tch::TchError::Torch(format!(
            "fused AdamW: {n} parameters, {} gradients, {} and {} state buffers",
            grads.len(),
            exp_avgs.len(),
            exp_avg_sqs.len()
        ))));
    }
    let (p, g, m, v) = (handles(params), handles(grads), handles(exp_avgs), handles(exp_avg_sqs));
    let mut err = [0 as c_char; 256];
    // SAFETY: each pointer is a tch at::Tensor borrowed for the call; the four arrays hold `n`
    // entries each (checked above). The shim copies the handles (a reference count) and updates
    // the tensors' data in place, as any in-place libtorch op on a shared handle does.
    let mut skip = skip_if.map(Tensor::shallow_clone);
    let found_inf = skip.as_mut().map_or(std::ptr::null_mut(), |t| t.as_mut_ptr() as *mut c_void);
    // SAFETY: as above; `found_inf` is null or a live one-element at::Tensor held by `skip` for
    // the call, which the kernel only reads.
    let rc = unsafe { hpc_fused_adamw(p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr(), n as i64, lr, beta1, beta2, weight_decay, eps, step as i64, found_inf, err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(shim_failure(&err));
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
