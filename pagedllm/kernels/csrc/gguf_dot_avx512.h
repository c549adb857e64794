#pragma once
// Placeholder until the int8-activation kernels land: no type has an int8 path.
#include <cstdint>

#include "gguf_types.h"

namespace pagedllm::gguf {

inline const char* int8_dot_variant() { return "none"; }
template <Type T>
constexpr bool has_int8_dot() {
  return false;
}
template <Type T>
void matmul_int8(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*) {}

}  // namespace pagedllm::gguf
