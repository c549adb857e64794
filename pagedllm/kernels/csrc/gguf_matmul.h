#pragma once
// x [M, K] float32 times the transpose of a [N, K] weight held as ggml blocks: the small-M
// (decode) kernels, and the row decoders the prefill's dequantize-then-GEMM and the embedding
// lookup use. Threads split the output rows (guided, kMinChunkRows at least; each row's sum
// is one thread's, in one order, so the result does not depend on the thread count); every
// weight row is read once per call and multiplied with all M activation rows.
//
// The float path (every type, every ISA): a span of up to kSpan elements of one weight row
// is decoded into an L1-resident float32 tile (gguf_decode.h) and dotted with the M
// activation rows (dot_f32: AVX-512 or AVX2 FMA where compiled, else 8 scalar partial sums
// the compiler may vectorise). Where gguf_dot_avx512.h is compiled (AVX512-BW/VL + VNNI),
// the types it covers take the int16-activation path instead (matmul_small picks).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "gguf_decode.h"
#include "gguf_dot_avx512.h"
#include "gguf_dot_int8_avx512.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace pagedllm::gguf {

// Elements of a weight row decoded at a time (whole blocks of every type: 256 = 8 x 32).
constexpr int64_t kSpan = 256;
// Activation rows sharing one decoded span (larger M: the rows in groups of this many).
constexpr int64_t kMaxTileRows = 16;

// Which float dot product this build holds.
inline const char* float_dot_variant() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "generic";
#endif
}

// sum_i a[i] b[i] over n floats.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  __m256 t = _mm256_add_ps(s0, s1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#else
  float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) p[j] += a[i + j] * b[i + j];
  s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Rows row_of(r) for r < R of the weight (`row_bytes` bytes each) -> out [R, K]; threads from
// min_parallel rows up.
template <Type T, typename RowOf>
void decode_rows(const uint8_t* data, int64_t row_bytes, int64_t K, int64_t R, RowOf row_of, int64_t min_parallel,
                 float* out) {
#pragma omp parallel for schedule(static) if (R >= min_parallel)
  for (int64_t r = 0; r < R; ++r) decode_elements<T>(data + row_of(r) * row_bytes, 0, K, out + r * K);
}

// Rows [start, start + R) of the weight -> out [R, K] as bfloat16 (round to nearest even, as
// torch's float -> bf16 conversion): the panels a prefill's bf16 GEMM multiplies, decoded a
// 256-element span at a time through a float32 tile in L1; threads over rows.
template <Type T>
void decode_rows_bf16(const uint8_t* data, int64_t row_bytes, int64_t K, int64_t start, int64_t R, uint16_t* out) {
#pragma omp parallel for schedule(static) if (R >= 16)
  for (int64_t r = 0; r < R; ++r) {
    alignas(64) float tile[kSpan];
    const uint8_t* row = data + (start + r) * row_bytes;
    uint16_t* dst = out + r * K;
    for (int64_t k0 = 0; k0 < K; k0 += kSpan) {
      const int64_t len = std::min(kSpan, K - k0);
      decode_elements<T>(row, k0, len, tile);
      for (int64_t i = 0; i < len; ++i) {
        uint32_t u;
        std::memcpy(&u, &tile[i], 4);
        u += 0x7fffu + ((u >> 16) & 1u);  // weights are finite: no NaN case
        dst[k0 + i] = uint16_t(u >> 16);
      }
    }
  }
}

// acc[m] (m < rows <= kMaxTileRows) = one weight row dotted with activation row row_of(m) of
// x [*, K], by the float path: kSpan elements at a time decoded into `tile` and dotted with
// each row (one order of operations for matmul_f32 and the grouped-expert call's gathers).
template <Type T, typename RowOf>
inline void tile_dots_f32(const uint8_t* row, int64_t K, const float* x, RowOf row_of, int64_t rows, float* tile,
                          float* acc) {
  for (int64_t m = 0; m < rows; ++m) acc[m] = 0.f;
  for (int64_t k0 = 0; k0 < K; k0 += kSpan) {
    const int64_t len = std::min(kSpan, K - k0);
    decode_elements<T>(row, k0, len, tile);
    for (int64_t m = 0; m < rows; ++m) acc[m] += dot_f32(tile, x + int64_t(row_of(m)) * K + k0, len);
  }
}

// y [M, N] = x [M, K] @ W.T through the float path.
template <Type T>
void matmul_f32(const float* x, int64_t M, int64_t K, const uint8_t* data, int64_t row_bytes, int64_t N, float* y) {
#pragma omp parallel for schedule(guided, kMinChunkRows)
  for (int64_t n = 0; n < N; ++n) {
    alignas(64) float tile[kSpan];
    const uint8_t* row = data + n * row_bytes;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
      const int64_t rows = std::min(kMaxTileRows, M - m0);
      float acc[kMaxTileRows];
      tile_dots_f32<T>(row, K, x, [m0](int64_t m) { return m0 + m; }, rows, tile, acc);
      for (int64_t m = 0; m < rows; ++m) y[(m0 + m) * N + n] = acc[m];
    }
  }
}

// The small-M kernel this build runs for `T`: "int16" (gguf_dot_avx512.h) or "float".
template <Type T>
constexpr bool use_int16_path() {
  return has_int16_dot<T>();
}

// y [M, N] = x [M, K] @ W.T, the kernel picked per type (use_int16_path), or the one named by
// `path` ("int8", "int16", "float"; "" for the build's choice; "fast": int8 where compiled for
// T, else the build's choice). False if `path` is not compiled for T.
template <Type T>
bool matmul_small(const float* x, int64_t M, int64_t K, const uint8_t* data, int64_t row_bytes, int64_t N, float* y,
                  const char* path) {
  std::string want = path;
  if (want == "fast" && has_int8_dot<T>()) want = "int8";
  if (want.empty() || want == "fast") want = use_int16_path<T>() ? "int16" : "float";
  if (want == "int8") {
    if constexpr (has_int8_dot<T>()) {
      matmul_int8<T>(x, M, K, data, row_bytes, N, y);
      return true;
    }
    return false;
  }
  if (want == "int16") {
    if constexpr (has_int16_dot<T>()) {
      matmul_int16<T>(x, M, K, data, row_bytes, N, y);
      return true;
    }
    return false;
  }
  if (want != "float") return false;
  matmul_f32<T>(x, M, K, data, row_bytes, N, y);
  return true;
}

}  // namespace pagedllm::gguf
