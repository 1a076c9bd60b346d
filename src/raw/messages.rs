//! Whole tensors in flight between two ranks: a non-blocking send or receive that owns its
//! tensor until MPI is done with it ([`TensorMessage`]), for pipeline parallelism's activations
//! and their gradients, which stay in flight across several compute steps (rsmpi's scoped
//! requests cannot outlive the scope that borrows their buffer).
//!
//! The invariants its unsafe code relies on: the tensor handed to MPI is contiguous, f32, on the
//! host or (CUDA-aware MPI) on a device, with its device work finished (the caller's contract
//! for a send; a receive waits for its stream itself, see [`TensorMessage::receive`]);
//! the message owns the handle for as long as the request is active, and the program gets the
//! tensor back only from [`TensorMessage::wait`], after completion; a message dropped while
//! still active (an error path) never frees the tensor: it cancels a receive, hands the request
//! back to MPI (MPI_Request_free) and leaks the tensor, so MPI never writes or reads freed
//! memory and the error path never waits for a peer that may never come. The
//! tensors are fresh ones that no other handle writes (a new empty tensor for a receive, a
//! detached contiguous copy for a send), so nothing else touches the memory meanwhile.

use std::ffi::{c_int, c_void};

use mpi::raw::AsRaw;
use mpi::topology::{Rank, SimpleCommunicator};
use mpi::traits::Equivalence;
use mpi::Tag;
use tch::{Kind, Tensor};

use crate::error::{Error, Result};
use crate::raw::cuda::CudaEvent;
use crate::raw::mpi::mpi_count;

/// A send or receive of one f32 tensor, in flight.
pub struct TensorMessage {
    tensor: Option<Tensor>,
    request: mpi::ffi::MPI_Request,
    active: bool,
    /// A receive (MPI writes the tensor), which can be cancelled; a send cannot (MPI-4
    /// deprecates cancelling sends).
    receiving: bool,
}

fn checked(t: &Tensor) -> Result<c_int> {
    if t.kind() != Kind::Float || !t.is_contiguous() {
        return Err(Error::exchange("pipeline message", format!("expected a contiguous f32 tensor, got {:?}", t.kind())));
    }
    mpi_count(t.numel(), "a pipeline message")
}

impl TensorMessage {
    /// Starts sending `tensor` to `dest`.
    ///
    /// # Safety
    /// `tensor` is contiguous f32 memory that no other handle writes until the message is
    /// waited for or dropped; on a device, the work that wrote it is finished and the MPI
    /// library is CUDA-aware.
    pub unsafe fn send(tensor: Tensor, comm: &SimpleCommunicator, dest: Rank, tag: Tag) -> Result<TensorMessage> {
        let count = checked(&tensor)?;
        let mut request = std::mem::MaybeUninit::<mpi::ffi::MPI_Request>::uninit();
        let datatype = f32::equivalent_datatype();
        // SAFETY: the pointer is the tensor's `count` f32 elements (checked), kept alive by the
        // handle this message owns until the request completes; the caller guarantees nothing
        // writes them meanwhile. MPI writes the request handle before returning.
        let rc = unsafe { mpi::ffi::MPI_Isend(tensor.data_ptr() as *const c_void, count, datatype.as_raw(), dest, tag, comm.as_raw(), request.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::exchange("MPI_Isend", format!("returned error code {rc}")));
        }
        // SAFETY: initialised by the successful MPI_Isend.
        Ok(TensorMessage { tensor: Some(tensor), request: unsafe { request.assume_init() }, active: true, receiving: false })
    }

    /// Starts receiving into `tensor` (its size is the message's) from `source`. A device
    /// tensor is handed to MPI only once the work queued so far on the calling thread's current
    /// stream is done (see below); a host tensor at once.
    ///
    /// # Safety
    /// As [`TensorMessage::send`], and no other handle reads `tensor` either until `wait`; a
    /// device tensor was allocated on the calling thread's current stream (as every tensor the
    /// thread makes is, unless it switched streams in between).
    pub unsafe fn receive(tensor: Tensor, comm: &SimpleCommunicator, source: Rank, tag: Tag) -> Result<TensorMessage> {
        let count = checked(&tensor)?;
        // A device buffer fresh from libtorch's caching allocator may be memory that kernels
        // queued on this stream still read or write: the allocator gives a block freed on a
        // stream to that stream's next allocation at once, relying on stream order (blocks
        // another stream used wait for that stream's recorded events in the allocator itself).
        // MPI writes outside every stream, so it may write only once that stream has caught up.
        // On the host the buffer's earlier work is done when its call returned: nothing to wait.
        if let Some(queued) = CudaEvent::record(tensor.device())? {
            queued.synchronize()?;
        }
        let mut request = std::mem::MaybeUninit::<mpi::ffi::MPI_Request>::uninit();
        let datatype = f32::equivalent_datatype();
        // SAFETY: as in `send`: the tensor's memory, owned by this message until completion and
        // touched by nobody else (the caller's contract), is MPI's to write.
        let rc = unsafe { mpi::ffi::MPI_Irecv(tensor.data_ptr(), count, datatype.as_raw(), source, tag, comm.as_raw(), request.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::exchange("MPI_Irecv", format!("returned error code {rc}")));
        }
        // SAFETY: initialised by the successful MPI_Irecv.
        Ok(TensorMessage { tensor: Some(tensor), request: unsafe { request.assume_init() }, active: true, receiving: true })
    }

    /// Whether the transfer is done (drives MPI's progress too); never blocks.
    pub fn test(&mut self) -> Result<bool> {
        if !self.active {
            return Ok(true);
        }
        let mut done: c_int = 0;
        // SAFETY: an active request of this process; MPI sets it to MPI_REQUEST_NULL on completion.
        let rc = unsafe { mpi::ffi::MPI_Test(&mut self.request, &mut done, mpi::ffi::RSMPI_STATUS_IGNORE) };
        if rc != 0 {
            return Err(Error::exchange("MPI_Test", format!("returned error code {rc}")));
        }
        self.active = done == 0;
        Ok(done != 0)
    }

    /// Waits for the transfer (politely: see `requests::wait_politely`) and gives the tensor back.
    pub fn wait(mut self) -> Result<Tensor> {
        self.finish()?;
        Ok(self.tensor.take().expect("the tensor is held until the message is waited for"))
    }

    fn finish(&mut self) -> Result<()> {
        if self.active {
            // SAFETY: an active request of this process (see `test`).
            unsafe { super::requests::wait_politely(&mut self.request)? };
            self.active = false;
        }
        Ok(())
    }
}

impl Drop for TensorMessage {
    /// A message still in flight when dropped is an error path: the schedule failed midway (an
    /// out-of-memory in a forward), and its neighbours may never send what this rank waits for,
    /// since they wait for what this rank never sent. Waiting here would hang the job before the
    /// error reaches the abort that ends it (issue 48), so the message is abandoned instead: a
    /// receive is cancelled, the request is handed back to MPI, and the tensor is leaked on
    /// purpose, since MPI may still read or write it until the request ends, which after an
    /// error is when the job ends. A few activations' memory, once, on the way out.
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        if self.receiving {
            // SAFETY: an active receive request of this process; cancelling is local and marks
            // it for cancellation (a receive already matched completes normally instead).
            let rc = unsafe { mpi::ffi::MPI_Cancel(&mut self.request) };
            if rc != 0 {
                log::error!("a pipeline receive could not be cancelled (MPI_Cancel returned {rc})");
            }
        }
        // SAFETY: an active request of this process: MPI_Request_free lets MPI complete it in the
        // background and sets the handle to MPI_REQUEST_NULL; the memory it uses is leaked below,
        // so it stays valid for as long as MPI may touch it.
        let rc = unsafe { mpi::ffi::MPI_Request_free(&mut self.request) };
        if rc != 0 {
            log::error!("a pipeline message could not be abandoned (MPI_Request_free returned {rc})");
        }
        self.active = false;
        std::mem::forget(self.tensor.take());
    }
}
