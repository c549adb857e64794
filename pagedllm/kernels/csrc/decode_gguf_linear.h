#pragma once
// A weight kept as a GGUF file's blocks (kernels/gguf_blocks.py's GGUFBlocks) as the fused
// decode (decode_layers.cpp) multiplies it: the same kernels, in the same order, as the
// module path's gguf_linear, so both give the same floats.
//   M <= small_max_rows: gguf_matmul.h's small-M kernel (matmul_small with the build's choice,
//       or "fast" (int8 activations for the K-quants), as the gguf_linear extension's
//       `linear(x, data, type, small_path)`);
//   larger M: chunk_rows weight rows at a time decoded to float32 (decode_rows, as
//       `dequantize_rows`) and torch's GEMM into that column slice of y, as kernels/gemm.py's
//       chunked_gemm does; from panel_min_rows rows up (bf16 matmul activations; 0: never)
//       decoded to bf16 panels instead (decode_rows_bf16) and torch's bf16 GEMM on x rounded
//       to bf16, the bf16 output widened, as gguf_blocks.py's gguf_linear does.
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <utility>

#include "gguf_matmul.h"

namespace pagedllm {

struct GGUFDecodeWeight {
  torch::Tensor data;  // uint8 [N, row bytes]: row n's blocks, as in the file
  gguf::Type type = gguf::Type::kCount;
  int64_t N = 0, K = 0;
  int64_t small_max_rows = 0;  // kernels/gguf_blocks.py SMALL_M_MAX_ROWS
  int64_t chunk_rows = 0;      // kernels/gemm.py CHUNK_ROWS
  int64_t panel_min_rows = 0;  // from this many rows bf16 panels (kernels/gguf_blocks.py); 0: never
  std::string small_path;      // the small-M kernel's path: "" or "fast" (int8 activations, K-quants)

  GGUFDecodeWeight() = default;
  GGUFDecodeWeight(torch::Tensor data_, int64_t type_, int64_t K_, int64_t small_max_rows_, int64_t chunk_rows_,
                   int64_t panel_min_rows_ = 0, std::string small_path_ = "")
      : data(data_), K(K_), small_max_rows(small_max_rows_), chunk_rows(chunk_rows_),
        panel_min_rows(panel_min_rows_), small_path(std::move(small_path_)) {
    TORCH_CHECK(small_path.empty() || small_path == "fast", "small_path must be \"\" or \"fast\"");
    TORCH_CHECK(type_ >= 0 && type_ < int64_t(gguf::Type::kCount), "unknown GGUF type index ", type_);
    TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kUInt8 && data.dim() == 2 &&
                    data.is_contiguous(), "GGUF blocks must be a contiguous CPU uint8 [N, row bytes] tensor");
    const gguf::Geometry g = gguf::kGeometry[type_];
    TORCH_CHECK(K > 0 && K % g.elems == 0 && data.size(1) == K / g.elems * g.bytes, gguf::kTypeNames[type_],
                " rows of K = ", K, " elements do not take ", data.size(1), " bytes");
    TORCH_CHECK(small_max_rows >= 0 && chunk_rows > 0 && panel_min_rows >= 0,
                "small_max_rows and panel_min_rows must be >= 0 and chunk_rows > 0");
    type = gguf::Type(type_);
    N = data.size(0);
  }

  // y [M, N] = x [M, K] @ W^T (no bias).
  void operator()(const float* x, int64_t M, float* y) const {
    const uint8_t* d = data.data_ptr<uint8_t>();
    const int64_t row_bytes = data.size(1);
    if (M <= small_max_rows) {
      gguf::with_type(type, [&](auto tag) {
        gguf::matmul_small<decltype(tag)::value>(x, M, K, d, row_bytes, N, y, small_path.c_str());
      });
      return;
    }
    const int64_t rows = std::min(N, chunk_rows);
    if (panel_min_rows > 0 && M >= panel_min_rows) {
      bf16_panels(x, M, y, rows);
      return;
    }
    // The reused float32 buffer of up to chunk_rows decoded rows (one forward at a time).
    static thread_local torch::Tensor scratch;
    if (!scratch.defined() || scratch.numel() < rows * K) scratch = torch::empty({rows * K}, torch::kFloat32);
    const auto xt = torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat32);
    auto yt = torch::from_blob(y, {M, N}, torch::kFloat32);
    for (int64_t start = 0; start < N; start += rows) {
      const int64_t size = std::min(rows, N - start);
      auto buf = scratch.narrow(0, 0, size * K).view({size, K});
      gguf::with_type(type, [&](auto tag) {
        gguf::decode_rows<decltype(tag)::value>(d, row_bytes, K, size, [&](int64_t r) { return start + r; }, 1,
                                                buf.data_ptr<float>());
      });
      auto out = yt.narrow(1, start, size);
      at::mm_out(out, xt, buf.t());
    }
  }

 private:
  // y = widen(bf16(x) @ bf16 panels^T), `rows` weight rows decoded to bf16 at a time.
  void bf16_panels(const float* x, int64_t M, float* y, int64_t rows) const {
    static thread_local torch::Tensor panel;
    if (!panel.defined() || panel.numel() < rows * K) panel = torch::empty({rows * K}, torch::kBFloat16);
    const auto xb = torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat32).to(torch::kBFloat16);
    auto yb = torch::empty({M, N}, torch::kBFloat16);
    const uint8_t* d = data.data_ptr<uint8_t>();
    for (int64_t start = 0; start < N; start += rows) {
      const int64_t size = std::min(rows, N - start);
      auto buf = panel.narrow(0, 0, size * K).view({size, K});
      gguf::with_type(type, [&](auto tag) {
        gguf::decode_rows_bf16<decltype(tag)::value>(d, data.size(1), K, start, size,
                                                     reinterpret_cast<uint16_t*>(buf.data_ptr<at::BFloat16>()));
      });
      auto out = yb.narrow(1, start, size);
      at::mm_out(out, xb, buf.t());
    }
    torch::from_blob(y, {M, N}, torch::kFloat32).copy_(yb);
  }
};

}  // namespace pagedllm
