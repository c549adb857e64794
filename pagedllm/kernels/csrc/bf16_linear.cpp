// bfloat16 linear layers for x86 CPUs with AVX2 but no native bf16 (no AVX512-BF16 / AMX).
//
// The weight stays bf16 in memory (half the bytes of float32); it is widened to float32 in
// registers (a bf16 is the top 16 bits of a float32: zero-extend, shift left by 16) and
// multiplied with float32 activations, accumulating in float32, as a native bf16 unit does.
// The result (+ bias) is rounded to bf16 once (round to nearest even), so it equals torch's
// float32 matmul of the same bf16 operands up to summation order, rounded to bf16.
//
// Up to 32 rows, register tiles (gemm_tiles.h's dot_tile) of MT activation rows x NT weight
// rows widen the weight in registers; a weight row (2 K bytes) stays in L1 while all
// activation tiles pass over it: the weight is read from memory once whatever M. For more
// rows (up to bf16_linear.KERNEL_MAX_ROWS, 128) a panel of 8 weight rows is widened once into
// a float32 buffer and multiplied from there (gemm_tiles.h's panel_matmul).

#include <immintrin.h>
#include <omp.h>
#include <torch/extension.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "gemm_tiles.h"

using pagedllm::dot_tile;
using pagedllm::for_row_tiles;

namespace {

constexpr int kRowTile = 4;  // activation rows per tile
constexpr int kColTile = 4;  // weight rows per tile (a thread's block is a multiple of it)
// Up to this many rows the weight is widened in registers; above, a panel at a time.
// Measured (2 threads, ms per [3072, 576] layer): M=32 0.96 in registers vs 0.97 panel;
// M=64 panel 1.8 vs widen-then-GEMM 3.3.
constexpr int64_t kTileMaxRows = 32;

// 8 bf16 at p as 8 float32.
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// n bf16 at w as float32 into out.
inline void widen_bf16(const uint16_t* w, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load_bf16x8(w + i));
  for (; i < n; ++i) out[i] = bf16_to_float(w[i]);
}

// y[m, n] (m < MT, n < NT) = sum_k x[m, k] * w[n, k], written through `out(m, n, value)`.
template <int MT, int NT, typename Out>
inline void micro_tile(const float* x, int64_t K, const uint16_t* w, Out out) {
  const int64_t K8 = K / 8 * 8;
  dot_tile<MT, NT>(
      x, K, K8, [&](int n, int64_t k) { return load_bf16x8(w + n * K + k); },
      [&](int m, int n, float s) {
        for (int64_t t = K8; t < K; ++t) s += x[m * K + t] * bf16_to_float(w[n * K + t]);
        out(m, n, s);
      });
}

// All activation rows against weight rows [n0, n0 + NT) (NT = 1 or kColTile). Tiles of 3-4
// activation rows take the weight rows in pairs: 4 x 4 accumulators would not fit in the 16
// ymm registers.
template <int NT, typename Out>
inline void column_block(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, Out out) {
  const uint16_t* wn = w + n0 * K;
  auto at = [&](int64_t m0, int64_t c0) {
    return [&, m0, c0](int mi, int ni, float v) { out(m0 + mi, c0 + ni, v); };
  };
  auto tile = [&](auto mt, int64_t m) {
    constexpr int MT = decltype(mt)::value;
    if constexpr (NT == kColTile && MT >= 3) {
      micro_tile<MT, 2>(x + m * K, K, wn, at(m, n0));
      micro_tile<MT, 2>(x + m * K, K, wn + 2 * K, at(m, n0 + 2));
    } else {
      micro_tile<MT, NT>(x + m * K, K, wn, at(m, n0));
    }
  };
  for_row_tiles<kRowTile>(M, tile);
}

// y = round_bf16(x @ w.T + bias): x bf16 or float32 [M, K], w bf16 [N, K], bias bf16 [N] or
// None; y bf16 [M, N].
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x must be a contiguous bfloat16 or float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kBFloat16,
              "w must be a contiguous bfloat16 [N, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x has ", K, " columns but w has ", w.size(1));
  std::vector<float> bias_f(N, 0.f);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have N elements");
    auto b = bias->to(torch::kFloat32).contiguous();
    std::memcpy(bias_f.data(), b.data_ptr<float>(), N * sizeof(float));
  }
  auto xf = x.to(torch::kFloat32).contiguous();  // [M, K], a no-op for float32 x
  auto y = torch::empty({M, N}, x.options().dtype(torch::kBFloat16));
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const float* bp = bias_f.data();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // c10::BFloat16(float) rounds to nearest even (and keeps NaN a NaN).
  auto out = [&](int64_t m, int64_t n, float v) { yp[m * N + n] = c10::BFloat16(v + bp[n]); };
  if (M > kTileMaxRows) {  // widen a panel of weight rows once for all the rows
    pagedllm::panel_matmul(
        xp, M, K, N,
        [&](int64_t n0, int64_t R, float* buf) {
          widen_bf16(wp + n0 * K, R * K, buf);
          return static_cast<const float*>(buf);
        },
        out);
    return y;
  }
  const int64_t blocks = N / kColTile;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) column_block<kColTile>(xp, M, K, wp, b * kColTile, out);
  for (int64_t n = blocks * kColTile; n < N; ++n) column_block<1>(xp, M, K, wp, n, out);
  return y;
}

// Rows [row0, row0 + out.size(0)) of w (bf16 [N, K]) as float32 into `out` ([R, K]): the
// chunks of the GEMM path (larger M), where torch's float32 GEMM beats the kernel above.
void bf16_rows_to_float(torch::Tensor w, int64_t row0, torch::Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kBFloat16, "w: contiguous bf16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == torch::kFloat32 &&
                  out.size(1) == w.size(1), "out: contiguous float32 [R, K]");
  const int64_t R = out.size(0), K = w.size(1);
  TORCH_CHECK(row0 >= 0 && row0 + R <= w.size(0), "rows out of range");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr()) + row0 * K;
  float* op = out.data_ptr<float>();
  const int64_t total = R * K, chunk = 8 * 1024;  // both row-major and contiguous: one flat conversion
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < total; i += chunk) widen_bf16(wp + i, std::min(chunk, total - i), op + i);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_linear", &bf16_linear, "round_bf16(x [M, K] @ bf16 w [N, K].T + bias) -> bf16 [M, N]",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("bf16_rows_to_float", &bf16_rows_to_float, "rows of a bf16 weight as float32, into out");
}
