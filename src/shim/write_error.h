// What the C++ shims (grad_hooks.cpp, regions.cpp) share: an error message copied into the
// caller's buffer, which Rust reads as a C string (raw::cuda::shim_error).
#pragma once

#include <cstddef>
#include <cstring>

namespace hpc_shim {

// Copies `message` into `buffer` of `length` bytes, cut and always NUL-terminated.
inline void write_error(char *buffer, size_t length, const char *message) {
  if (buffer != nullptr && length > 0) {
    std::strncpy(buffer, message, length - 1);
    buffer[length - 1] = '\0';
  }
}

}  // namespace hpc_shim
