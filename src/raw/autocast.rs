//! Autocast (mixed precision) regions on the CPU or a CUDA device, through libtorch's
//! device-type API in the shim (src/shim/grad_hooks.cpp): tch's `autocast` calls the deprecated
//! CUDA-only one, which warns on every call and cannot reach the CPU.
//!
//! The invariants its unsafe code relies on: the shim's enter call writes the two-int previous
//! state into the array it is given and its error buffer is writable; each successful enter is
//! paired with exactly one exit, on the same thread, with that state (a drop guard does it).

use std::ffi::{c_char, c_int};

use tch::Device;

use super::cuda::shim_error;
use crate::error::{Error, Result};

extern "C" {
    fn hpc_autocast_enter(device_type: c_int, which: c_int, was: *mut c_int, error: *mut c_char, error_length: usize) -> c_int;
    fn hpc_autocast_exit(device_type: c_int, was: *const c_int);
}

/// The 16-bit type an autocast region casts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfType {
    Bf16,
    Fp16,
}

/// Runs `f` under autocast to `half` for `device`'s type (CUDA for a GPU, the CPU otherwise),
/// on the calling thread: the switch and the type are libtorch's per-thread settings, both set
/// here and put back as they were when `f` returns or panics.
pub fn with_autocast<T>(device: Device, half: HalfType, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let device_type = c_int::from(device.is_cuda());
    let which = c_int::from(half == HalfType::Bf16);
    let mut was = [0 as c_int; 2];
    let mut err = [0 as c_char; 256];
    // SAFETY: plain values, a two-int array for the previous state and a writable error buffer.
    let rc = unsafe { hpc_autocast_enter(device_type, which, was.as_mut_ptr(), err.as_mut_ptr(), err.len()) };
    if rc != 0 {
        return Err(Error::usage(format!("entering autocast to {half:?} on {device:?}: {}", shim_error(&err))));
    }
    // Left on every path, a panic included, so that no later code runs under autocast.
    struct Exit(c_int, [c_int; 2]);
    impl Drop for Exit {
        fn drop(&mut self) {
            // SAFETY: pairs with the successful enter above, on the same thread, with its state.
            unsafe { hpc_autocast_exit(self.0, self.1.as_ptr()) }
        }
    }
    let _exit = Exit(device_type, was);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    #[test]
    fn the_cpu_autocasts_a_matrix_product_to_either_half_type_and_only_inside_the_region() {
        let (a, b) = (Tensor::ones([2, 3], (Kind::Float, Device::Cpu)), Tensor::ones([3, 2], (Kind::Float, Device::Cpu)));
        for (half, kind) in [(HalfType::Bf16, Kind::BFloat16), (HalfType::Fp16, Kind::Half)] {
            let inside = with_autocast(Device::Cpu, half, || Ok(a.matmul(&b))).unwrap();
            assert_eq!(inside.kind(), kind, "{half:?}");
            // Nested regions of the other type restore the outer one's type on leaving.
            let outer_after_inner = with_autocast(Device::Cpu, half, || {
                let other = if half == HalfType::Bf16 { HalfType::Fp16 } else { HalfType::Bf16 };
                with_autocast(Device::Cpu, other, || Ok(()))?;
                Ok(a.matmul(&b))
            })
            .unwrap();
            assert_eq!(outer_after_inner.kind(), kind, "{half:?} after an inner region");
            assert_eq!(a.matmul(&b).kind(), Kind::Float, "after the region");
        }
        // The switch is per thread: another thread computes in f32 meanwhile.
        with_autocast(Device::Cpu, HalfType::Bf16, || {
            let (a, b) = (a.copy(), b.copy());
            let kind = std::thread::spawn(move || a.matmul(&b).kind()).join().unwrap();
            assert_eq!(kind, Kind::Float);
            Ok(())
        })
        .unwrap();
    }
}
