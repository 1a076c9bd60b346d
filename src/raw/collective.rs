//! MPI's in-place reductions on tensor memory: `MPI_Allreduce` over a host slice (blocking, or
//! `MPI_Iallreduce` and a wait that leaves the core free) or over a CUDA tensor, and
//! `MPI_Reduce` to a root.
//!
//! The invariants its unsafe code relies on: the memory handed to MPI is `len` elements of E,
//! each the size of E's wire type (Element guarantees it), that nothing else reads or writes
//! until the call, or the wait on its request, returns; device memory goes only to a
//! CUDA-aware MPI, once the device work writing it is done, and with a predefined operation; no
//! count exceeds [`MAX_MPI_COUNT`], so that it fits MPI's C int.

use std::ffi::{c_int, c_void};

use mpi::topology::SimpleCommunicator;
use mpi::traits::Equivalence;
use tch::Tensor;

use crate::element::Element;
use crate::error::{Error, Result};
use crate::raw::mpi::MAX_MPI_COUNT;
use crate::raw::requests::wait_politely;
use crate::raw::tensor::{check_host, check_layout};

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
/// As [`device_buffer_mut`](crate::raw::tensor::device_buffer_mut): a CUDA-aware MPI, device
/// work writing the tensor complete, no other handle touching it during the call; `op` must be
/// one MPI applies on the device (a predefined operation: a user operation's function would
/// read device memory on the host).
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

/// `MPI_Reduce` to `root` of `comm`, in place on the root (MPI_IN_PLACE there); on the other
/// ranks `buf` is only read. Host memory, or device memory with a CUDA-aware MPI.
///
/// # Safety
/// As [`mpi_buffer_mut`](crate::raw::tensor::mpi_buffer_mut) for the tensor; on the device,
/// `op` must be a predefined operation.
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
