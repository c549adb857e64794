#pragma once
// Weight-only quantized linear layers for x86 CPUs with AVX2 (no AVX-512 needed).
//
// Weights stay quantized in memory; each group of 32 consecutive input columns of a row is
// dequantized in registers to float32 and multiplied with float32 activations, so the result
// equals F.linear over the dequantized weight up to summation order (no activation rounding).
//
// Layouts (N output rows, K input columns, G = K / 32 groups per row):
//   int4: qweight uint8 [N, K / 2]; group g of row n is bytes [16 g, 16 g + 16): byte i holds
//         element i in its low nibble and element i + 16 in its high nibble (GGUF Q4_0/Q4_1's
//         own order). w = q * scale + zero, q in [0, 15]; scale, zero [N, G].
//   int8: qweight int8 [N, K]; w = q * scale; scale [N, G].
// Scales and zeros are float32 or fp16 (S = float or uint16_t, the fp16 bits; both of one
// weight the same): GGUF Q8_0, Q4_0 and Q4_1 store fp16, which keeps a 4-bit group at 20
// bytes (0.625 a weight, 0.75 with float32) and is what single-stream decode reads.
// Three kernels, by the number of activation rows M (quant_matmul picks, with the thresholds
// of quantization.py, for the module path and the fused decode alike):
//   quant_matmul_q16  (M <= 2): activations rounded to int16, integer dot products per group
//                     (AVX2 madd_epi16; where the compiler targets AVX512-BW/VL and VNNI,
//                     quant_q16_avx512.h's vpdpwssd kernel with the same integer arithmetic);
//   quant_matmul_f32  (M <= 16): a tile of up to 8 activation rows shares each dequantized
//                     group, so small batches read the weights once;
//   quant_matmul_panel (M <= 128): gemm_tiles.h's panel_matmul, a panel of 8 weight rows
//                     dequantized once into a float32 buffer, then register tiles of 6 x 2.

// AVX2 at least: no scalar path here; build.py builds its extensions only for the avx2 ISA
// (elsewhere the callers' torch paths run).
#if !(defined(__AVX2__) && defined(__FMA__))
#error "quant_linear.h needs AVX2 and FMA (compile with -march=native on such a CPU)"
#endif
#include <immintrin.h>
#include <omp.h>
#include <cstdint>

#include <type_traits>
#include <vector>

#include "gemm_tiles.h"
#include "quant_q16_avx512.h"

namespace pagedllm {

constexpr int kGroup = 32;
constexpr int kRowTile = 8;

// A group scale or zero as float32 (fp16 widens exactly: F16C's vcvtph2ps).
inline float scale_at(const float* s, int64_t i) { return s[i]; }
inline float scale_at(const uint16_t* s, int64_t i) { return _cvtsh_ss(s[i]); }
// Eight consecutive ones.
inline __m256 load8_scales(const float* s) { return _mm256_loadu_ps(s); }
inline __m256 load8_scales(const uint16_t* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}

// The 32 weights of one int4 group as float32, in element order.
inline void dequant_int4(const uint8_t* q, float scale, float zero, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask);                     // elements 0..15
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // elements 16..31
  const __m256 s = _mm256_set1_ps(scale), z = _mm256_set1_ps(zero);
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), s, z);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), s, z);
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), s, z);
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), s, z);
}

// The 32 weights of one int8 group as float32, in element order.
inline void dequant_int8(const int8_t* q, float scale, __m256 w[4]) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int j = 0; j < 4; ++j) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j));
    w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s);
  }
}

// y[m, n] for rows m0 .. m0 + MT of x and one weight row n.
template <int MT, bool INT4, typename S>
inline void row_dot(const float* x, int64_t ldx, const uint8_t* qrow, const S* srow,
                    const S* zrow, int64_t groups, float* y, int64_t ldy) {
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (INT4) {
      dequant_int4(qrow + g * (kGroup / 2), scale_at(srow, g), scale_at(zrow, g), w);
    } else {
      dequant_int8(reinterpret_cast<const int8_t*>(qrow) + g * kGroup, scale_at(srow, g), w);
    }
    for (int m = 0; m < MT; ++m) {
      const float* xg = x + m * ldx + g * kGroup;
      for (int j = 0; j < 4; ++j) acc[m] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xg + 8 * j), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) y[m * ldy] = hsum(acc[m]);
}

// Activations as int16 per group of 32: x[m, 32 g + i] ~ xq[m, 32 g + i] * xs[m, g], with
// xsum[m, g] = sum_i x[m, 32 g + i] in float32 (the zero points multiply the exact sum).
// The rounding error is at most half a step, 1 / 65534 of the group's largest |x|.
inline void quantize_activations(const float* x, int64_t M, int64_t K, int16_t* xq, float* xs, float* xsum) {
  const int64_t groups = K / kGroup;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t mg = 0; mg < M * groups; ++mg) {
    const float* xg = x + mg * kGroup;
    __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xg + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      sum = _mm256_add_ps(sum, v[j]);
    }
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    const float m = _mm_cvtss_f32(a);
    xs[mg] = m / 32767.f;
    xsum[mg] = hsum(sum);
    const __m256 inv = _mm256_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    for (int j = 0; j < 4; j += 2) {
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inv));
      // packs interleaves 128-bit lanes: restore element order with a 64-bit permute.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + mg * kGroup + 8 * j), packed);
    }
  }
}

// y[m, n] for rows m0 .. m0 + MT of the int16 activations and one weight row n: per group,
// integer dot products (madd_epi16: int16 x int16 pairs summed into int32), then scaled.
template <int MT, bool INT4, typename S>
inline void row_dot_q16(const int16_t* xq, const float* xs, const float* xsum, int64_t K,
                        const uint8_t* qrow, const S* srow, const S* zrow, int64_t groups,
                        float* y, int64_t ldy) {
  // Two accumulators per row (even and odd groups): two multiply-add chains in flight
  // (measured 0.272 -> 0.259 ms per layer's four projections at M = 1, one thread: ~5%).
  __m256 acc[MT], acc_odd[MT];
  for (int m = 0; m < MT; ++m) acc[m] = acc_odd[m] = _mm256_setzero_ps();
  auto group = [&](int64_t g, __m256* into) {
    __m256i w0, w1;  // elements 0..15 and 16..31 of the group as int16
    if constexpr (INT4) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * (kGroup / 2)));
      const __m128i mask = _mm_set1_epi8(0x0F);
      w0 = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
      w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(qrow) + g * kGroup;
      w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    }
    const float sw = scale_at(srow, g);
    for (int m = 0; m < MT; ++m) {
      const int16_t* xg = xq + m * K + g * kGroup;
      const __m256i p = _mm256_add_epi32(
          _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg))),
          _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16))));
      into[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sw * xs[m * groups + g]), into[m]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    group(g, acc);
    group(g + 1, acc_odd);
  }
  if (g < groups) group(g, acc);
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_add_ps(acc[m], acc_odd[m]);
  if constexpr (INT4) {
    // The zero points times the groups' exact sums, eight groups per multiply-add.
    for (int m = 0; m < MT; ++m) {
      const float* xsm = xsum + m * groups;
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8)
        acc[m] = _mm256_fmadd_ps(load8_scales(zrow + g), _mm256_loadu_ps(xsm + g), acc[m]);
      float tail = 0.f;
      for (; g < groups; ++g) tail += scale_at(zrow, g) * xsm[g];
      y[m * ldy] = hsum(acc[m]) + tail;
    }
  } else {
    for (int m = 0; m < MT; ++m) y[m * ldy] = hsum(acc[m]);
  }
}

// y = x @ dequant(w).T for raw row-major buffers: the weight's rows are split across
// threads; each thread walks its rows once per tile of up to 8 activation rows (a weight row
// is read ceil(M / 8) times; 8 rather than 4 rows: 1.2-1.5x at M = 6-16 for 4-bit, one
// thread), `tile(std::integral_constant<int, MT>, m, qrow, srow, zrow, y + m * N + n)`
// computing rows m .. m + MT of column n.
// Guided rather than static: with a static split a thread whose core is briefly taken by
// another process holds up the step at the region's barrier while the other spins; guided
// hands out shrinking chunks (down to kMinChunkRows weight rows), so the thread that runs
// takes the rest, at a few chunk hand-outs per call on a quiet machine.
template <bool INT4, typename S, typename Tile>
void tiled_rows(int64_t M, int64_t N, int64_t K, const uint8_t* qp, const S* sp, const S* zp, float* yp,
                Tile tile) {
  const int64_t groups = K / kGroup, qstride = INT4 ? K / 2 : K;
#pragma omp parallel for schedule(guided, kMinChunkRows)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* qrow = qp + n * qstride;
    const S* srow = sp + n * groups;
    const S* zrow = INT4 ? zp + n * groups : nullptr;
    for_row_tiles<kRowTile>(M, [&](auto mt, int64_t m) { tile(mt, m, qrow, srow, zrow, yp + m * N + n); });
  }
}

// float32 activations x [M, K]: each weight group dequantized in registers; y [M, N].
template <bool INT4, typename S>
void quant_matmul_f32(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qp, const S* sp,
                      const S* zp, float* y) {
  const int64_t groups = K / kGroup;
  tiled_rows<INT4, S>(M, N, K, qp, sp, zp, y, [&](auto mt, int64_t m, const uint8_t* qrow, const S* srow,
                                                   const S* zrow, float* yp) {
    row_dot<decltype(mt)::value, INT4, S>(x + m * K, K, qrow, srow, zrow, groups, yp, N);
  });
}

// int16 activations (quantize_activations): integer dot products per group; y [M, N].
template <bool INT4, typename S>
void quant_matmul_q16_avx2(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qp, const S* sp,
                           const S* zp, float* y) {
  const int64_t groups = K / kGroup;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M * groups), xsum(M * groups);
  quantize_activations(x, M, K, xq.data(), xs.data(), xsum.data());
  tiled_rows<INT4, S>(M, N, K, qp, sp, zp, y, [&](auto mt, int64_t m, const uint8_t* qrow, const S* srow,
                                                   const S* zrow, float* yp) {
    row_dot_q16<decltype(mt)::value, INT4, S>(xq.data() + m * K, xs.data() + m * groups, xsum.data() + m * groups,
                                              K, qrow, srow, zrow, groups, yp, N);
  });
}

#if PAGEDLLM_Q16_AVX512
// Software prefetch of the four weight rows (codes, scales, zeros) this many quads ahead: the
// rows stream from L3 or memory once per call, and the hardware prefetchers lose each short
// stream's start (measured at one thread, 30 layers' four projections cycled: 1.0-1.2x ->
// 1.6-2.1x over the AVX2 kernel; 1 and 3-6 quads ahead slower than 2).
constexpr int64_t kQ16PrefetchQuads = 2;

template <bool INT4, typename S>
inline void prefetch_rows_q16(const uint8_t* qp, const S* sp, const S* zp, int64_t qstride, int64_t groups,
                              int64_t n, int64_t rows) {
  const char* q = reinterpret_cast<const char*>(qp + n * qstride);
  for (int64_t o = 0; o < rows * qstride; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
  const int64_t scale_bytes = rows * groups * static_cast<int64_t>(sizeof(S));
  const char* s = reinterpret_cast<const char*>(sp + n * groups);
  for (int64_t o = 0; o < scale_bytes; o += 64) _mm_prefetch(s + o, _MM_HINT_T0);
  if constexpr (INT4) {
    const char* z = reinterpret_cast<const char*>(zp + n * groups);
    for (int64_t o = 0; o < scale_bytes; o += 64) _mm_prefetch(z + o, _MM_HINT_T0);
  }
}

// The same with quant_q16_avx512.h's dot products (vpdpwssd on the weights as stored): four
// weight rows per task item, activation rows in tiles of up to 2 (its 2 x 4 accumulators).
template <bool INT4, typename S>
void quant_matmul_q16_avx512(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qp, const S* sp,
                             const S* zp, float* y) {
  const int64_t groups = K / kGroup, qstride = INT4 ? K / 2 : K, width = q16_permuted_width<INT4>(groups);
  const int64_t sstride = width / kQ16BlockWords<INT4> * 16;
  // The caller's buffers, kept from call to call (a decode step makes ~120 of these calls).
  thread_local std::vector<int16_t> xq, xp;
  thread_local std::vector<float> xs, xsum, xse;
  xq.resize(M * K);
  xp.resize(M * width);
  xs.resize(M * groups);
  xsum.resize(M * groups);
  xse.resize(M * sstride);
  quantize_activations(x, M, K, xq.data(), xs.data(), xsum.data());
  permute_activations_avx512<INT4>(xq.data(), xs.data(), M, K, xp.data(), xse.data());
  // Pointers, not the names: inside the parallel region a thread_local name is each thread's own.
  const int16_t* xpp = xp.data();
  const float *xsep = xse.data(), *xsump = xsum.data();
  const int64_t quads = (N + 3) / 4;
#pragma omp parallel for schedule(guided, kMinChunkRows / 4)
  for (int64_t i = 0; i < quads; ++i) {
    if (const int64_t ahead = 4 * (i + kQ16PrefetchQuads); ahead < N)
      prefetch_rows_q16<INT4, S>(qp, sp, zp, qstride, groups, ahead, std::min<int64_t>(4, N - ahead));
    for_row_tiles<2>(M, [&](auto mt, int64_t m) {
      constexpr int MT = decltype(mt)::value;
      auto rows = [&](auto nt, int64_t n) {
        rows_dot_q16_avx512<MT, decltype(nt)::value, INT4, S>(
            xpp + m * width, width, xsep + m * sstride, sstride, xsump + m * groups,
            qp + n * qstride, qstride, sp + n * groups, INT4 ? zp + n * groups : nullptr, groups, y + m * N + n, N);
      };
      if (4 * i + 4 <= N) {
        rows(std::integral_constant<int, 4>{}, 4 * i);
      } else {
        for (int64_t n = 4 * i; n < N; ++n) rows(std::integral_constant<int, 1>{}, n);
      }
    });
  }
}
#endif

// The int16-activation kernel this build runs: AVX-512 VNNI where the compiler targets it.
template <bool INT4, typename S>
void quant_matmul_q16(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qp, const S* sp,
                      const S* zp, float* y) {
#if PAGEDLLM_Q16_AVX512
  quant_matmul_q16_avx512<INT4, S>(x, M, K, N, qp, sp, zp, y);
#else
  quant_matmul_q16_avx2<INT4, S>(x, M, K, N, qp, sp, zp, y);
#endif
}

// Rows [n0, n0 + R) of the dequantized weight, float32, into out [R, K].
template <bool INT4, typename S>
inline void dequant_rows(const uint8_t* qp, const S* sp, const S* zp, int64_t K, int64_t n0, int64_t R,
                         float* out) {
  const int64_t groups = K / kGroup, qstride = INT4 ? K / 2 : K;
  __m256 w[4];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
    for (int64_t g = 0; g < groups; ++g) {
      if constexpr (INT4) {
        dequant_int4(qp + n * qstride + g * (kGroup / 2), scale_at(sp, n * groups + g),
                     scale_at(zp, n * groups + g), w);
      } else {
        dequant_int8(reinterpret_cast<const int8_t*>(qp) + n * qstride + g * kGroup, scale_at(sp, n * groups + g), w);
      }
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + r * K + g * kGroup + 8 * j, w[j]);
    }
  }
}

// float32 activations x [M, K], a panel of 8 weight rows dequantized at a time; y [M, N].
template <bool INT4, typename S>
void quant_matmul_panel(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qp, const S* sp,
                        const S* zp, float* y) {
  panel_matmul(
      x, M, K, N,
      [&](int64_t n0, int64_t R, float* buf) {
        dequant_rows<INT4, S>(qp, sp, zp, K, n0, R, buf);
        return static_cast<const float*>(buf);
      },
      [&](int64_t m, int64_t n, float v) { y[m * N + n] = v; });
}

// The kernel for M rows (M <= quantization.PANEL_MAX_ROWS; more rows dequantize and GEMM).
template <bool INT4, typename S>
void quant_matmul(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qp, const S* sp,
                  const S* zp, float* y, int64_t int16_max_rows, int64_t tile_max_rows) {
  if (M <= int16_max_rows) {
    quant_matmul_q16<INT4, S>(x, M, K, N, qp, sp, zp, y);
  } else if (M <= tile_max_rows) {
    quant_matmul_f32<INT4, S>(x, M, K, N, qp, sp, zp, y);
  } else {
    quant_matmul_panel<INT4, S>(x, M, K, N, qp, sp, zp, y);
  }
}

}  // namespace pagedllm
