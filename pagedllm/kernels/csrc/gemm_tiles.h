#pragma once
// Register-tiled float32 matrix products for x86 CPUs with AVX2, shared by the quantized
// (quant_linear.h), bfloat16 (bf16_linear.cpp) and fused decode (decode_layers.cpp) linears.
//
// Every product here is y[m, n] = x[m, :] . w[n, :] with both operands row-major along K (a
// weight is [N, K] as torch stores it), computed as MT x NT dot products at once: MT * NT
// eight-lane float32 accumulators, so each weight load serves MT activation rows and each
// activation load NT weight rows, and the FMAs rather than the loads bound the loop.

// AVX2-only: no scalar path here; build.py builds its extensions only for the avx2 ISA
// (elsewhere the callers' torch paths run).
#if !(defined(__AVX2__) && defined(__FMA__))
#error "gemm_tiles.h needs AVX2 and FMA (compile with -march=native on such a CPU)"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec_avx2.h"

namespace pagedllm {

// out(m, n, sum over k < K8 of x[m * ldx + k] * w_n[k]) for m < MT, n < NT, where
// load_w(n, k) gives w_n[k .. k + 8) as float32 and K8 is a multiple of 8 (callers add any
// tail of K themselves).
template <int MT, int NT, typename LoadW, typename Out>
inline void dot_tile(const float* x, int64_t ldx, int64_t K8, LoadW load_w, Out out) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = load_w(n, k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out(m, n, hsum(acc[m][n]));
}

// tile(std::integral_constant<int, R>{}, m) for the tail of R = rest rows (0 < rest < MAX).
template <int MAX, typename Tile>
__attribute__((always_inline)) inline void tail_tile(int64_t rest, int64_t m, Tile& tile) {
  if constexpr (MAX > 1) {
    if (rest == MAX - 1) {
      tile(std::integral_constant<int, MAX - 1>{}, m);
    } else {
      tail_tile<MAX - 1>(rest, m, tile);
    }
  }
}

// tile(std::integral_constant<int, MT>{}, m) over rows [0, M) in tiles of MT rows, then one
// tile of the M % MT rows left (each tile size its own instantiation: fixed register counts).
template <int MT, typename Tile>
__attribute__((always_inline)) inline void for_row_tiles(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + MT <= M; m += MT) tile(std::integral_constant<int, MT>{}, m);
  if (m < M) tail_tile<MT>(M - m, m, tile);
}

// Weight rows per panel, and the register tile: 6 activation rows x 2 weight rows = 12
// accumulators, 2 weight vectors and 1 activation vector: 15 of the 16 ymm registers.
constexpr int kPanelRows = 8;
constexpr int kPanelMT = 6;
constexpr int kPanelNT = 2;
// The smallest share of weight rows a thread takes at a time where work is handed out
// guided (schedule(guided, kMinChunkRows): shrinking chunks, so a thread that lost its core
// for a moment does not hold up the others at the barrier; panels count as kPanelRows rows).
constexpr int kMinChunkRows = 16;

// y = x @ W^T for weights that are expanded to float32 a panel of kPanelRows rows at a time:
// `panel(n0, R, buf)` returns rows [n0, n0 + R) of W as float32 [R, K] (written into buf,
// kPanelRows * K floats, or a pointer to W itself when it is float32), `out(m, n, v)` stores
// y[m, n] = v. Threads split the panels; each panel (8 rows, at most 8 K floats: L1/L2) is
// expanded once and multiplied with every activation row tile while it is hot, so a compact
// weight is expanded once per call whatever M, and a tile's activation rows stay in L1
// across the panel's row pairs.
//
// Measured (2-core AVX2 EPYC, 2 threads, ms per [3072, 576] 4-bit layer, this panel vs
// torch's float32 GEMM on the float weight vs dequantize + GEMM): M=32 0.97 / 1.75 / 2.79;
// M=64 1.77 / 2.67 / 3.64; M=128 3.52 / 4.36 / 5.33; at M = 256-512 the GEMM catches up.
template <typename Panel, typename Out>
void panel_matmul(const float* x, int64_t M, int64_t K, int64_t N, Panel panel, Out out) {
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows, K8 = K / 8 * 8;
#pragma omp parallel
  {
    static thread_local std::vector<float> buf;  // reused from call to call
    if (buf.size() < static_cast<size_t>(kPanelRows * K)) buf.resize(kPanelRows * K);
#pragma omp for schedule(guided, kMinChunkRows / kPanelRows)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanelRows, R = std::min<int64_t>(kPanelRows, N - n0);
      const float* w = panel(n0, R, buf.data());
      for_row_tiles<kPanelMT>(M, [&](auto mt, int64_t m) {
        constexpr int MT = decltype(mt)::value;
        auto cols = [&](auto nt, int64_t j) {
          constexpr int NT = decltype(nt)::value;
          const float* wj = w + j * K;
          dot_tile<MT, NT>(
              x + m * K, K, K8, [&](int n, int64_t k) { return _mm256_loadu_ps(wj + n * K + k); },
              [&](int mi, int ni, float v) {
                for (int64_t t = K8; t < K; ++t) v += x[(m + mi) * K + t] * wj[ni * K + t];
                out(m + mi, n0 + j + ni, v);
              });
        };
        for_row_tiles<kPanelNT>(R, cols);
      });
    }
  }
}

}  // namespace pagedllm
