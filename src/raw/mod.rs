//! The raw layer: the crate's `unsafe` code, and only it. Tensor memory seen as slices, device
//! pointers handed to MPI, MPI handles moved to other threads, and calls into C: the MPI
//! library, libtorch through the C++ shim (src/shim/), the CUDA driver and libc.
//!
//! The rule: the crate's unsafe code (every `unsafe fn` and `unsafe impl`, every raw pointer
//! made into a reference or a slice, every call into C) is in a file of this folder. Outside
//! it, `unsafe` appears only as a block around a call to one of the `unsafe fn`s here, which
//! keeps that function's contract (`# Safety`: no other handle touches the tensor while its
//! view lives, ...) and says how in its own `// SAFETY:` comment. The files are cut by what
//! they wrap, and each opens by stating once the invariants its unsafe code relies on; every
//! `unsafe` block says why it is sound in a `// SAFETY:` comment.
//!
//! - [`mpi`](self::mpi): communicators moved to or shared by threads, point-to-point calls,
//!   ending the job, the MPI library's CUDA queries, the most elements one MPI call takes;
//! - [`collective`]: in-place all-reduce and reduce over host or device memory;
//! - [`requests`]: waiting for MPI requests without holding the core, and segments of a host
//!   buffer with requests in flight;
//! - [`window`]: MPI-3 shared-memory windows between the ranks of a node;
//! - [`tensor`]: tensor memory as slices and MPI buffers, plain copies, and what the shim does
//!   to tensors that tch does not (pinned memory, channels-last, fused SGD, ...);
//! - [`autocast`]: mixed-precision regions on the CPU or a CUDA device;
//! - [`cuda`]: events, streams, the current device, TF32, loading libtorch_cuda,
//!   the GPUs' UUIDs;
//! - [`hooks`]: gradient-ready hooks on parameters, for overlap;
//! - [`regions`]: tensor parallelism's two conjugate operators (an all-reduce in forward or in
//!   backward), as autograd functions calling back into the group's all-reduce;
//! - [`messages`]: whole tensors in flight between two ranks (a pipeline's activations);
//! - [`process`]: this process and its host: resident memory, the allocator, free disk space,
//!   the host name, the stop signals held from before main, the exit without libtorch's teardown;
//! - [`profiler`]: libtorch's profiler (Kineto) and its step marks, for `--profile-dir`;
//! - [`mapped`]: files mapped read-only (checkpoint part files read a slice at a time);
//! - [`split_backward`]: zero-bubble's backward in two passes over autograd's graph.
//!
//! The rest of the crate names all of it as `crate::raw::X`, through the re-exports below; the
//! files here import one another directly, never through this one.

pub mod autocast;
pub mod collective;
pub mod cuda;
pub mod hooks;
pub mod mapped;
pub mod messages;
pub mod mpi;
pub mod process;
pub mod profiler;
pub mod regions;
pub mod requests;
pub mod split_backward;
pub mod tensor;
pub mod window;

pub use autocast::{with_autocast, HalfType};
pub use collective::{all_reduce_in_place, all_reduce_in_place_device, reduce_in_place};
pub use cuda::{
    cuda_device_uuids, current_cuda_device, load_torch_cuda, set_allow_tf32, set_cuda_device, CudaEvent,
    CudaStream, CurrentStream,
};
pub use hooks::{GradReady, GradReadyHooks};
pub use mapped::{map_read_only, release_pages};
pub use messages::TensorMessage;
pub use self::mpi::{abort_world, any_tag, exit_now, int_control_variable, mpi_cuda_support, mpix_gpu_query_support_cuda, tag_upper_bound, PeerComm, PointToPoint, SendComm};
pub use regions::{register_group, RegionAllReduce, RegionGroup, RegisteredGroup};
pub use process::{current_rss_mb, exit_process, free_bytes, hostname, keep_freed_memory, peak_rss_mb, peak_rss_since_restart_mb, release_stop_signals, restart_peak_rss, stop_signal_held};
pub use profiler::{profiler_start, profiler_stop, StepMark, ThreadState};
pub use requests::{completed_requests, with_segments, Backoff, Segments};
pub use split_backward::{backward_input, backward_weight, KeptGraph};
pub use tensor::{
    channels_last, channels_last_strides, copy_host_elements, copy_into, data_address, device_buffer_mut, flat_dense_view, fused_adamw, fused_sgd, host_bytes, host_slice, host_slice_mut,
    is_channels_last, mpi_buffer_mut, param_to_channels_last, pin_memory, release_grad, set_grad, unscale_and_check, unscale_and_check_into, zero_all,
};
pub use window::SharedWindow;
