// libtorch's profiler (Kineto, as torch.profiler uses it) for `hpc-train --profile-dir`: host
// ops and, on a GPU, CUDA kernels and copies (through CUPTI), written as the Chrome trace that
// torch.profiler's export_chrome_trace writes, so that one summary (scripts/trace_summary.py),
// Perfetto or TensorBoard reads hpc-train's traces and PyTorch's alike. Steps are marked as
// torch.profiler marks them ("ProfilerStep#N" user scopes).
//
// Built by build.rs with grad_hooks.cpp.

#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "write_error.h"

#include <exception>
#include <set>
#include <string>

using hpc_shim::write_error;

namespace {

// A user scope that stays open across the FFI boundary: its name lives beside it.
struct Mark {
  std::string name;
  at::RecordFunction scope{at::RecordScope::USER_SCOPE};
};

std::set<torch::profiler::impl::ActivityType> activities(bool cuda) {
  std::set<torch::profiler::impl::ActivityType> kinds{torch::profiler::impl::ActivityType::CPU};
  if (cuda) {
    kinds.insert(torch::profiler::impl::ActivityType::CUDA);
  }
  return kinds;
}

}  // namespace

extern "C" {

// Starts collecting on the calling thread (and the threads libtorch hands its state to, such as
// the autograd engine's); `cuda`: CUDA activity too.
int hpc_profiler_start(bool cuda, char *error, size_t error_length) {
  try {
    torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    torch::autograd::profiler::prepareProfiler(config, activities(cuda));
    torch::autograd::profiler::enableProfiler(config, activities(cuda));
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Stops collecting and writes the trace to `path` (JSON).
int hpc_profiler_stop(const char *path, char *error, size_t error_length) {
  try {
    auto result = torch::autograd::profiler::disableProfiler();
    result->save(path);
    return 0;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return -1;
  }
}

// Opens a user scope named `name` (copied); null on error. Closed by hpc_mark_end on the same
// thread.
void *hpc_mark_begin(const char *name, char *error, size_t error_length) {
  try {
    auto *mark = new Mark{name};
    if (mark->scope.isActive()) {
      mark->scope.before(std::string_view(mark->name), c10::ArrayRef<const c10::IValue>{});
    }
    return mark;
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

void hpc_mark_end(void *mark) {
  delete static_cast<Mark *>(mark);
}

// The calling thread's libtorch state (the profiler's, grad mode, autocast, ...), to be set on
// another thread for one piece of work, as the autograd engine hands it to its own threads:
// overlap's backward thread, whose ops then appear in the trace. Null on error.
void *hpc_thread_state_capture(char *error, size_t error_length) {
  try {
    return new at::ThreadLocalState();
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

void hpc_thread_state_free(void *state) {
  delete static_cast<at::ThreadLocalState *>(state);
}

// Sets `state` as the calling thread's until hpc_thread_state_leave(guard) on the same thread,
// which restores what it was. Null on error.
void *hpc_thread_state_enter(const void *state, char *error, size_t error_length) {
  try {
    return new at::ThreadLocalStateGuard(*static_cast<const at::ThreadLocalState *>(state));
  } catch (const std::exception &e) {
    write_error(error, error_length, e.what());
    return nullptr;
  }
}

void hpc_thread_state_leave(void *guard) {
  delete static_cast<at::ThreadLocalStateGuard *>(guard);
}

}  // extern "C"
