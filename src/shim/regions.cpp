// Megatron-LM's two conjugate operators of tensor parallelism (Shoeybi et al. 2019, section 3),
// as libtorch autograd functions, since tch can define none:
//
//   copy to the region:    forward identity,            backward all-reduce (sum) of the gradient;
//   reduce from the region: forward all-reduce (sum),   backward identity.
//
// A column-parallel linear layer starts after the first, a row-parallel one ends with the
// second. The all-reduce itself is hpc-train's (ring, rhd or the cost model's choice): the shim
// calls back into Rust with a fresh contiguous tensor that it sums in place over the group the
// handle names. On the CPU libtorch runs both the forward and the backward on the thread that
// calls them (the run's thread); on a GPU the backward runs on the device's autograd thread.
//
// Built with grad_hooks.cpp (see build.rs).

#include <torch/csrc/autograd/custom_function.h>
#include <ATen/core/Tensor.h>

#include "write_error.h"

#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

extern "C" {
// Sums `tensor` (an at::Tensor* the shim made for this call: contiguous, held by nobody else)
// over the ranks of the tensor-parallel group `group`, in place. Returns 0, or non-zero with a
// message in `error`.
typedef int (*hpc_region_all_reduce_fn)(int64_t group, void *tensor, char *error, size_t error_length);
}

namespace {

// Set once at start-up, before any model is built (hpc_region_set_all_reduce).
hpc_region_all_reduce_fn all_reduce_callback = nullptr;

at::Tensor summed_over_group(const at::Tensor &x, int64_t group) {
  if (all_reduce_callback == nullptr) {
    throw std::runtime_error("hpc-train: no tensor-parallel all-reduce is registered");
  }
  // A copy of its own: the caller's tensor may be autograd's input buffer or a view.
  at::Tensor out = x.detach().clone(at::MemoryFormat::Contiguous);
  char error[512] = {0};
  if (all_reduce_callback(group, &out, error, sizeof error) != 0) {
    throw std::runtime_error(std::string("tensor-parallel all-reduce: ") + error);
  }
  return out;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CopyToRegion : public torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, int64_t group) {
    ctx->saved_data["group"] = group;
    // An input returned unchanged: libtorch makes it a view with this function's gradient edge.
    return x;
  }
  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    return {summed_over_group(grads[0], ctx->saved_data["group"].toInt()), at::Tensor()};
  }
};

struct ReduceFromRegion : public torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, int64_t group) {
    (void)ctx;
    return summed_over_group(x, group);
  }
  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

using hpc_shim::write_error;

}  // namespace

extern "C" {

void hpc_region_set_all_reduce(hpc_region_all_reduce_fn callback) { all_reduce_callback = callback; }

// CopyToRegion.apply(tensor, group): a new at::Tensor*, or null with a message in `error`.
void *hpc_region_copy_to(void *tensor, int64_t group, char *error, size_t error_length) {
  try {
    return new at::Tensor(CopyToRegion::apply(*static_cast<at::Tensor *>(tensor), group));
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

// ReduceFromRegion.apply(tensor, group): a new at::Tensor*, or null with a message in `error`.
void *hpc_region_reduce_from(void *tensor, int64_t group, char *error, size_t error_length) {
  try {
    return new at::Tensor(ReduceFromRegion::apply(*static_cast<at::Tensor *>(tensor), group));
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

}  // extern "C"
