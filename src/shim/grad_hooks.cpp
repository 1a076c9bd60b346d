// The libtorch calls hpc-train needs and tch does not offer. Gradient-ready hooks: libtorch calls
// a post-accumulate-grad hook once a parameter's gradient is final for this backward pass; this
// shim registers such a hook on each parameter and forwards (parameter index, CUDA event or
// null) to a Rust callback. tch exposes no autograd hooks (tch-rs issue 769). Also: events on a
// stream, non-blocking copies, the current CUDA device, a few global settings, and the fused
// SGD kernel.
//
// Built by build.rs against the headers of the libtorch that tch links. The hook itself does no
// MPI and no allocation beyond the event: it only tells Rust that the gradient is ready.

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/core/Tensor.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_zero.h>
#include <ATen/ops/_fused_sgd.h>

#include "write_error.h"

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

extern "C" {
// index: the parameter's position; device_index: the CUDA device of its gradient, or -1 for a
// CPU tensor. Called on the thread that accumulated the gradient, whose current stream on that
// device is the one that did: the callback records its bucket's reused event there (DDP's one
// event per bucket, not one made and freed per parameter per step).
typedef void (*hpc_grad_ready_fn)(void *context, int64_t index, int64_t device_index);
}

namespace {

struct GradReadyHook : torch::autograd::PostAccumulateGradHook {
  hpc_grad_ready_fn callback;
  void *context;
  int64_t index;

  GradReadyHook(hpc_grad_ready_fn f, void *ctx, int64_t i) : callback(f), context(ctx), index(i) {}

  void operator()(const torch::autograd::Variable &tensor) override {
    callback(context, index, tensor.is_cuda() ? static_cast<int64_t>(tensor.device().index()) : -1);
  }
};

using hpc_shim::write_error;

}  // namespace

extern "C" {

// Registers the hook on `tensor` (a tch C tensor: an at::Tensor*). Returns 0, or -1 with a
// message in `error`.
int hpc_register_grad_ready_hook(void *tensor, int64_t index, hpc_grad_ready_fn callback, void *context,
                                 char *error, size_t error_length) {
  try {
    auto *t = static_cast<at::Tensor *>(tensor);
    if (!t->requires_grad()) {
      write_error(error, error_length, "the tensor does not require a gradient");
      return -1;
    }
    torch::autograd::impl::set_post_acc_grad_hooks(*t, std::make_unique<GradReadyHook>(callback, context, index));
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Removes the hook from `tensor` (so that the Rust callback's context can go).
int hpc_clear_grad_ready_hook(void *tensor, char *error, size_t error_length) {
  try {
    auto *t = static_cast<at::Tensor *>(tensor);
    torch::autograd::impl::set_post_acc_grad_hooks(*t, nullptr);
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Blocks until the work recorded before `event` is done.
int hpc_event_synchronize(void *event, char *error, size_t error_length) {
  try {
    static_cast<c10::Event *>(event)->synchronize();
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

void hpc_event_destroy(void *event) { delete static_cast<c10::Event *>(event); }

// A new event recorded on the current stream of CUDA device `device_index`; null on error.
void *hpc_event_record(int64_t device_index, char *error, size_t error_length) {
  try {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
    auto event = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    event->record(guard.getStream(device));
    return event.release();
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

// A new CUDA event, not recorded yet (c10 makes its CUDA event at the first record), to be
// recorded again and again (hpc_event_record_current); with `timing`, the time between two
// such events can be read (hpc_event_elapsed_ms). Freed with hpc_event_destroy.
void *hpc_event_new(bool timing, char *error, size_t error_length) {
  try {
    return new c10::Event(c10::DeviceType::CUDA, timing ? c10::EventFlag::BACKEND_DEFAULT : c10::EventFlag::PYTORCH_DEFAULT);
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

// Records `event` (again: a record replaces the last one) on the current stream of CUDA device
// `device_index`. An event keeps the device of its first record.
int hpc_event_record_current(void *event, int64_t device_index, char *error, size_t error_length) {
  try {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
    static_cast<c10::Event *>(event)->record(guard.getStream(device));
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// The milliseconds on the device between two recorded timing events, `end` being done.
int hpc_event_elapsed_ms(void *start, void *end, double *ms, char *error, size_t error_length) {
  try {
    *ms = static_cast<c10::Event *>(start)->elapsedTime(*static_cast<c10::Event *>(end));
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// A stream of CUDA device `device_index` from libtorch's pool (a heap c10::Stream, freed with
// hpc_stream_destroy); null on error.
void *hpc_stream_from_pool(int64_t device_index, char *error, size_t error_length) {
  try {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
    return new c10::Stream(guard.getStreamFromGlobalPool(device, /*isHighPriority=*/false));
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

void hpc_stream_destroy(void *stream) { delete static_cast<c10::Stream *>(stream); }

// Makes `stream` the calling thread's current stream on its device; returns the one it replaces
// (a heap c10::Stream), or null on error.
void *hpc_stream_exchange(void *stream, char *error, size_t error_length) {
  try {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    return new c10::Stream(guard.exchangeStream(*static_cast<c10::Stream *>(stream)));
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

// Makes the current stream of CUDA device `device_index` wait (on the device, the host goes
// on) for the work recorded before `event`.
int hpc_event_block_current(void *event, int64_t device_index, char *error, size_t error_length) {
  try {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
    static_cast<c10::Event *>(event)->block(guard.getStream(device));
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// dst.copy_(src, non_blocking): tch only has the blocking form.
int hpc_copy(void *dst, void *src, bool non_blocking, char *error, size_t error_length) {
  try {
    static_cast<at::Tensor *>(dst)->copy_(*static_cast<at::Tensor *>(src), non_blocking);
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// cudaSetDevice for the calling thread, through libtorch's device guard (no CUDA headers here).
int hpc_set_cuda_device(int64_t device_index, char *error, size_t error_length) {
  try {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    guard.setDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)));
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// The calling thread's current CUDA device; -1 on error.
int64_t hpc_current_cuda_device(char *error, size_t error_length) {
  try {
    c10::impl::VirtualGuardImpl guard(c10::DeviceType::CUDA);
    return guard.getDevice().index();
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// ---- Settings tch does not expose (used by --precision and --channels-last). ----

// TF32 in cuBLAS matrix products and cuDNN convolutions.
void hpc_set_allow_tf32(bool allow) {
  at::globalContext().setAllowTF32CuBLAS(allow);
  at::globalContext().setAllowTF32CuDNN(allow);
}

// Autocast on a device type (0 the CPU, 1 CUDA), casting to `which` (0 float16, 1 bfloat16),
// through the device-type API: at::autocast::set_enabled, which tch calls, is deprecated and
// warns on every call. Both the switch and the type are the calling thread's (libtorch keeps
// them thread-local), so the region sets both and a thread of our own (--zero 3's compute
// thread) gets the run's type, not libtorch's default (float16 on CUDA). Writes the previous
// switch and type to `was` for the matching exit. Returns 0, or -1 with the reason in `error`.
int hpc_autocast_enter(int device_type, int which, int *was, char *error, size_t error_length) {
  try {
    const at::DeviceType device = device_type == 1 ? at::kCUDA : at::kCPU;
    was[0] = at::autocast::is_autocast_enabled(device) ? 1 : 0;
    was[1] = static_cast<int>(at::autocast::get_autocast_dtype(device));
    at::autocast::set_autocast_dtype(device, which == 1 ? at::kBFloat16 : at::kHalf);
    at::autocast::set_autocast_enabled(device, true);
    at::autocast::increment_nesting();
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Leaving an autocast region: the cast cache is cleared when the outermost region ends, as
// torch.autocast's __exit__ does, and the previous switch and type come back.
void hpc_autocast_exit(int device_type, const int *was) {
  const at::DeviceType device = device_type == 1 ? at::kCUDA : at::kCPU;
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  at::autocast::set_autocast_enabled(device, was[0] != 0);
  at::autocast::set_autocast_dtype(device, static_cast<at::ScalarType>(was[1]));
}

// A pinned copy of a host tensor: Tensor.pin_memory() without the device argument, which is
// deprecated (tch always passes one, and libtorch warns each time). Null on error.
void *hpc_pin_memory(void *tensor, char *error, size_t error_length) {
  try {
    return new at::Tensor(static_cast<at::Tensor *>(tensor)->pin_memory());
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

// An uninitialised uint8 host tensor of `dims` sizes in pinned (page-locked) memory, from
// libtorch's caching host allocator (as DataLoader's pin_memory): memory already pinned is
// reused once the copies that read it have run. Null on error.
void *hpc_empty_pinned_bytes(const int64_t *sizes, size_t dims, char *error, size_t error_length) {
  try {
    auto options = at::TensorOptions().dtype(at::kByte).pinned_memory(true);
    return new at::Tensor(at::empty(at::IntArrayRef(sizes, dims), options));
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

// A new tensor with `tensor`'s values in channels-last (NHWC) memory order; null on error.
void *hpc_channels_last(void *tensor, char *error, size_t error_length) {
  try {
    auto *t = static_cast<at::Tensor *>(tensor);
    return new at::Tensor(t->contiguous(at::MemoryFormat::ChannelsLast));
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

// Moves a 4-d parameter's storage to channels-last order in place (its identity, and so its
// autograd hooks and optimizer state, stay).
int hpc_param_to_channels_last(void *tensor, char *error, size_t error_length) {
  try {
    auto *t = static_cast<at::Tensor *>(tensor);
    if (t->dim() == 4) {
      t->set_data(t->contiguous(at::MemoryFormat::ChannelsLast));
    }
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Drops a parameter's gradient (ZeRO stage 2 keeps only the rank's shard of it between steps);
// the next backward makes a new one, as after PyTorch's zero_grad(set_to_none=True).
int hpc_release_grad(void *tensor, char *error, size_t error_length) {
  try {
    static_cast<at::Tensor *>(tensor)->mutable_grad().reset();
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Makes `grad` (an at::Tensor*) the gradient of `tensor`: backward then accumulates into it in
// place (a view into a bucket's flat buffer: DDP's gradient_as_bucket_view). Returns 0, or -1
// with a message in `error` (libtorch's own checks: same device, dtype and sizes).
int hpc_set_grad(void *tensor, void *grad, char *error, size_t error_length) {
  try {
    auto *t = static_cast<at::Tensor *>(tensor);
    const auto &g = *static_cast<at::Tensor *>(grad);
    TORCH_CHECK(g.sizes() == t->sizes(), "a gradient of sizes ", g.sizes(), " for a tensor of sizes ", t->sizes());
    TORCH_CHECK(g.device() == t->device() && g.scalar_type() == t->scalar_type(), "a gradient of another device or dtype");
    t->mutable_grad() = g;
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// ---- The optimizer's update in one pass (at::_fused_sgd_, which tch does not expose). ----

// torch.optim.SGD(fused=True)'s kernel over `count` tensors: per element, d = g + weight_decay w,
// v = d (first step) or momentum v + d, w -= lr v; one read of w, g, v and one write of w, v,
// where separate kernels make four passes. `momentum_buffers` is ignored when momentum is 0.
// Every pointer is a tch at::Tensor*; the caller makes w, g and v alike in device, kind and
// strides (the CPU kernel walks the three as flat arrays). `found_inf`, null or a one-element
// float at::Tensor* on the parameters' device: where it holds a non-zero value the kernel changes
// nothing (GradScaler's skipped step), read by the kernel on the device, never by the host.
int hpc_fused_sgd(void **params, void **grads, void **momentum_buffers, int64_t count, double weight_decay,
                  double momentum, double lr, bool is_first_step, void *found_inf, char *error,
                  size_t error_length) {
  try {
    std::vector<at::Tensor> p, g, v;
    p.reserve(count);
    g.reserve(count);
    for (int64_t i = 0; i < count; ++i) {
      p.push_back(*static_cast<at::Tensor *>(params[i]));
      g.push_back(*static_cast<at::Tensor *>(grads[i]));
      if (momentum != 0.0) {
        v.push_back(*static_cast<at::Tensor *>(momentum_buffers[i]));
      }
    }
    std::optional<at::Tensor> skip;
    if (found_inf != nullptr) {
      skip = *static_cast<at::Tensor *>(found_inf);
    }
    at::_fused_sgd_(p, g, v, weight_decay, momentum, lr, /*dampening=*/0.0, /*nesterov=*/false,
                    /*maximize=*/false, is_first_step, /*grad_scale=*/std::nullopt, skip);
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Zeroes `count` tensors in place (at::_foreach_zero_, what optimizer.zero_grad(set_to_none=
// False) calls): on CUDA a few multi-tensor launches instead of one per tensor. Every pointer is
// a tch at::Tensor*.
int hpc_zero_all(void **tensors, int64_t count, char *error, size_t error_length) {
  try {
    std::vector<at::Tensor> t;
    t.reserve(count);
    for (int64_t i = 0; i < count; ++i) {
      t.push_back(*static_cast<at::Tensor *>(tensors[i]));
    }
    at::_foreach_zero_(t);
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// GradScaler's unscale_ (at::_amp_foreach_non_finite_check_and_unscale_): every tensor
// multiplied by `inv_scale` in place, and `found_inf` (one float element on the tensors' device)
// set to 1 where any element was not finite; on CUDA one multi-tensor pass over all of them.
// Every pointer is a tch at::Tensor*.
int hpc_unscale_and_check(void **tensors, int64_t count, void *found_inf, double inv_scale, char *error,
                          size_t error_length) {
  try {
    std::vector<at::Tensor> t;
    t.reserve(count);
    for (int64_t i = 0; i < count; ++i) {
      t.push_back(*static_cast<at::Tensor *>(tensors[i]));
    }
    auto *found = static_cast<at::Tensor *>(found_inf);
    at::_amp_foreach_non_finite_check_and_unscale_(t, *found, at::full({}, inv_scale, found->options()));
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// `found_inf` as in hpc_fused_sgd.
int hpc_fused_adamw(void **params, void **grads, void **exp_avgs, void **exp_avg_sqs, int64_t count, double lr,
                    double beta1, double beta2, double weight_decay, double eps, int64_t step, void *found_inf,
                    char *error, size_t error_length) {
  try {
    std::vector<at::Tensor> p, g, m, v;
    for (int64_t i = 0; i < count; ++i) {
      p.push_back(*static_cast<at::Tensor *>(params[i]));
      g.push_back(*static_cast<at::Tensor *>(grads[i]));
      m.push_back(*static_cast<at::Tensor *>(exp_avgs[i]));
      v.push_back(*static_cast<at::Tensor *>(exp_avg_sqs[i]));
    }
    if (count == 0) {
      return 0;
    }
    // torch.optim.AdamW counts its steps in a float tensor per parameter, incremented before
    // the kernel runs: the kernel reads the count of the step it makes. The counts live where
    // the parameters do (the CUDA kernel reads them on the device), made in one fill and
    // handed over as views of it.
    std::vector<at::Tensor> steps =
        at::full({count}, static_cast<double>(step), at::TensorOptions().dtype(at::kFloat).device(p[0].device()))
            .unbind(0);
    std::optional<at::Tensor> skip;
    if (found_inf != nullptr) {
      skip = *static_cast<at::Tensor *>(found_inf);
    }
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, skip);
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

}  // extern "C"

