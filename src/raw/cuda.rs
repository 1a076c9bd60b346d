//! CUDA through libtorch and the CUDA driver: events and streams ([`CudaEvent`],
//! [`CudaStream`], [`CurrentStream`]), the calling thread's current device, TF32,
//! loading libtorch_cuda at run time, and the GPUs' UUIDs from the driver. Also [`shim_error`],
//! the message of a failed call into the shim (src/shim/grad_hooks.cpp), for every file here.
//!
//! The invariants its unsafe code relies on: each heap c10::Event or c10::Stream the shim
//! returns is owned by exactly one value here and destroyed once, by it; the error buffer of a
//! call into the shim is writable and holds a NUL-terminated message (or zeros) afterwards; a
//! symbol looked up with dlsym has the signature of the header that declares it; a library
//! opened with dlopen is never closed.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use tch::Device;

use crate::error::{Error, Result};

extern "C" {
    fn hpc_event_synchronize(event: *mut c_void, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_event_destroy(event: *mut c_void);
    fn hpc_event_record(device_index: i64, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_event_new(timing: bool, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_event_record_current(event: *mut c_void, device_index: i64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_event_elapsed_ms(start: *mut c_void, end: *mut c_void, ms: *mut f64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_set_cuda_device(device_index: i64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_stream_from_pool(device_index: i64, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_stream_destroy(stream: *mut c_void);
    fn hpc_stream_exchange(stream: *mut c_void, error: *mut c_char, error_length: usize) -> *mut c_void;
    fn hpc_event_block_current(event: *mut c_void, device_index: i64, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_current_cuda_device(error: *mut c_char, error_length: usize) -> i64;
    fn hpc_set_allow_tf32(allow: bool);
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
            (
                std::mem::transmute::<*mut c_void, CuInit>(init),
                std::mem::transmute::<*mut c_void, CuDeviceGet>(get),
                std::mem::transmute::<*mut c_void, CuDeviceGetUuid>(get_uuid),
            );
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

pub(super) fn shim_error(buffer: &[c_char]) -> String {
    // SAFETY: the shim writes a NUL-terminated message into the buffer, or leaves it zeroed.
    unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned()
}

/// A CUDA event recorded on a stream: after a gradient's accumulation (by the gradient hook),
/// or after copies queued by the exchange. Waiting on it waits for that stream's work up to
/// that point, not for the whole device.
pub struct CudaEvent(pub(super) std::ptr::NonNull<c_void>);

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

    /// An event of `device` to record again and again ([`CudaEvent::record_current`]), as DDP
    /// keeps one per bucket; with `timing`, [`CudaEvent::elapsed_ms`] reads the time between
    /// two. None on the CPU.
    pub fn reusable(device: Device, timing: bool) -> Result<Option<CudaEvent>> {
        let Device::Cuda(_) = device else { return Ok(None) };
        let mut err = [0 as c_char; 256];
        // SAFETY: a plain value and a writable buffer; the shim returns a new heap c10::Event
        // (owned by the CudaEvent from here on) or null with a message.
        let event = unsafe { hpc_event_new(timing, err.as_mut_ptr(), err.len()) };
        match std::ptr::NonNull::new(event) {
            Some(e) => Ok(Some(CudaEvent(e))),
            None => Err(Error::exchange("cuda", format!("making an event: {}", shim_error(&err)))),
        }
    }

    /// Records the event again, now, on the calling thread's current stream of `device` (the
    /// device of its first record): waiting on it then waits for that stream's work up to here.
    pub fn record_current(&self, device: Device) -> Result<()> {
        let Device::Cuda(index) = device else { return Ok(()) };
        let mut err = [0 as c_char; 256];
        // SAFETY: the pointer is a live c10::Event owned by self; plain values and a writable
        // buffer.
        let rc = unsafe { hpc_event_record_current(self.0.as_ptr(), index as i64, err.as_mut_ptr(), err.len()) };
        if rc != 0 {
            return Err(Error::exchange("cuda", format!("recording an event on cuda:{index}: {}", shim_error(&err))));
        }
        Ok(())
    }

    /// Milliseconds on the device from this event to `end`, both made with timing and recorded;
    /// waits for `end`.
    pub fn elapsed_ms(&self, end: &CudaEvent) -> Result<f64> {
        end.synchronize()?;
        let (mut ms, mut err) = (0.0f64, [0 as c_char; 256]);
        // SAFETY: both pointers are live c10::Events owned by their CudaEvents; `ms` and the
        // buffer are writable.
        let rc = unsafe { hpc_event_elapsed_ms(self.0.as_ptr(), end.0.as_ptr(), &mut ms, err.as_mut_ptr(), err.len()) };
        if rc != 0 {
            return Err(Error::exchange("cuda", format!("reading the time between two events: {}", shim_error(&err))));
        }
        Ok(ms)
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

/// Allows or forbids TF32 in cuBLAS and cuDNN (libtorch's global setting).
pub fn set_allow_tf32(allow: bool) {
    // SAFETY: sets two flags of libtorch's global context; no pointers involved.
    unsafe { hpc_set_allow_tf32(allow) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_uuids_are_written_as_nvidia_smi_writes_them() {
        let bytes: [u8; 16] = [0x3f, 0x1a, 0x00, 0x9b, 0x12, 0x34, 0xab, 0xcd, 0x00, 0x01, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54];
        assert_eq!(format_gpu_uuid(&bytes), "GPU-3f1a009b-1234-abcd-0001-fedcba987654");
    }
}
