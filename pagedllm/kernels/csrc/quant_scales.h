#pragma once
// The torch side of quant_linear.h's scale types: a quantized weight's scales (and 4-bit
// zeros) are float32 or float16 tensors, passed to the kernels as `const float*` or as
// `const uint16_t*` (the fp16 bits, widened in the kernels).
#include <torch/extension.h>

#include <cstdint>

namespace pagedllm {

// Scales [N, groups] (and zeros of the same shape and dtype, for 4-bit) as the kernels take them.
inline void check_scales(const torch::Tensor& scales, const torch::Tensor& zeros, bool int4, int64_t N,
                         int64_t groups) {
  const auto dtype = scales.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kFloat16) && scales.dim() == 2 &&
                  scales.is_contiguous() && scales.size(0) == N && scales.size(1) == groups,
              "scales must be float32 or float16 [N, K / 32]");
  if (int4) {
    TORCH_CHECK(zeros.scalar_type() == dtype && zeros.is_contiguous() && zeros.sizes() == scales.sizes(),
                "4-bit zeros must be [N, K / 32] in the scales' dtype");
  }
}

// f(tag) with tag a float (float32 scales) or a uint16_t (float16).
template <typename F>
decltype(auto) with_scale_type(const torch::Tensor& scales, F&& f) {
  if (scales.scalar_type() == torch::kFloat16) return f(uint16_t{});
  return f(float{});
}

template <typename S>
const S* scale_ptr(const torch::Tensor& t) {
  return t.numel() ? reinterpret_cast<const S*>(t.data_ptr()) : nullptr;
}

}  // namespace pagedllm
