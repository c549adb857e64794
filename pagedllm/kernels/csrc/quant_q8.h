#pragma once
// Prefill on quantized weights with int8 activations: AVX2 integer dot products
// (maddubs / madd), or VNNI's dpbusd where the compiler targets it.
//
// y[M, N] = x[M, K] . W[N, K]^T where x is rounded per row and per group of 32 columns to
// int8 (xq in [-127, 127], scale dx = absmax / 127, and the group's exact float sum xs), and W
// stays in its stored form (quant_linear.h's layouts). Per group g of 32 columns:
//   4-bit (w = q s + z, q in [0, 15]):  sum_i w_i x_i ~ s dx sum_i q_i xq_i + z xs
//   8-bit (w = q s, q in [-127, 127]):  sum_i w_i x_i ~ s dx sum_i q_i xq_i
// The integer sums are exact: maddubs (u8 x s8 -> pairs summed to s16) then madd with ones
// (-> s32), or dpbusd (u8 x s8, four products summed into s32). maddubs needs one unsigned operand: the 4-bit q is; for 8-bit, |q| and xq with
// q's sign (sign_epi8). Pairs stay far from int16 saturation: 4-bit 2 * 15 * 127 = 3,810,
// 8-bit 2 * 128 * 127 = 32,512 < 32,767 (xq never -128, so its sign flip cannot overflow).
// Eight groups' int32 sums become float at once (the super-block layout below) and are
// multiplied by s dx into float32 accumulators; the 4-bit zero term (z times the exact sum)
// is one multiply-add per 8 groups.
// The only rounding beyond float summation is xq's: at most half a step, absmax / 254 per
// group.

#if !(defined(__AVX2__) && defined(__FMA__))
#error "quant_q8.h needs AVX2 and FMA (compile with -march=native on such a CPU)"
#endif
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm_tiles.h"
#include "quant_linear.h"

namespace pagedllm {

// The activations are grouped as the weights are (quant_linear.h): one scale pair per group.
constexpr int kQ8Group = kGroup;
// Groups per super-block. Both operands are repacked so that a 32-byte vector holds 4
// consecutive elements of each of 8 groups (dword j: group j): maddubs + madd then leave group
// j's partial sum in int32 lane j, 8 vectors complete all 8 groups, and one conversion and one
// multiply-add by a vector of 8 scales finishes 8 groups (instead of one of each per group,
// which cost more than the integer products themselves: measured 2.5x slower than the float
// GEMM on this machine when every group ended in its own conversion).
constexpr int kSuper = 8;
constexpr int kSuperBytes = kSuper * kQ8Group;  // 256: 8 vectors of 32 bytes
// Register tile: 4 activation rows x NT weight rows, 2 * 4 * NT vector registers of sums:
// NT = 3 where AVX-512VL gives 32 of them (measured 1.15-1.2x over NT = 2 on a 2-core
// Sapphire Rapids), else 2 (AVX2's 16).
constexpr int kQ8MT = 4;
#if defined(__AVX512VL__)
constexpr int kQ8NT = 3;
#else
constexpr int kQ8NT = 2;
#endif
// Weight rows repacked per task: about kQ8ChunkBytes of repacked weight (L1, beside an
// activation tile), a multiple of 12 rows (whole tiles of 2 or 3), 12 to 96 rows.
#ifndef Q8_CHUNK_BYTES
#define Q8_CHUNK_BYTES 24576
#endif
constexpr int64_t kQ8ChunkBytes = Q8_CHUNK_BYTES;
inline int64_t q8_chunk_rows(int64_t K) { return std::clamp<int64_t>(kQ8ChunkBytes / K / 12 * 12, 12, 96); }

// Group j (< 8) of a super-block: its 32 bytes v (element order) go to dword j of vectors
// t = 0..7, vector t taking elements [4 t, 4 t + 4).
inline void scatter_group(__m256i v, uint8_t* super, int j) {
  alignas(32) int32_t d[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(d), v);
  int32_t* out = reinterpret_cast<int32_t*>(super);
  for (int t = 0; t < 8; ++t) out[t * kSuper + j] = d[t];
}

// Per group: the group's 32 x as int8 in element order, dx = absmax / 127, xs = the float32
// sum. xq = round-half-even(x * 127 / absmax) in [-127, 127] (0 where the group is all zero).
inline __m256i quantize_group_q8(const float* xg, float* dx, float* xs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
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
  *dx = m / 127.f;
  *xs = hsum(sum);
  const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
  __m256i i32[4];
  for (int j = 0; j < 4; ++j) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
  // packs work within 128-bit lanes: dword d of the packed bytes holds elements
  // [4 (2 (d % 4) + d / 4), +4); the permute puts them back in order.
  const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]);
  const __m256i p16b = _mm256_packs_epi32(i32[2], i32[3]);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// x [M, K] float32 -> xq int8 [M, K] (element order), dx, xs [M, K / 32] (for tests).
inline void quantize_activations_q8(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  const int64_t groups = K / kQ8Group;
#pragma omp parallel for schedule(static)
  for (int64_t mg = 0; mg < M * groups; ++mg) {
    const __m256i v = quantize_group_q8(x + mg * kQ8Group, dx + mg, xs + mg);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + mg * kQ8Group), v);
  }
}

// The 32 weights of group g of one row as bytes in element order: 4-bit q as u8 in [0, 15],
// 8-bit q as s8.
template <bool INT4>
__attribute__((always_inline)) inline __m256i load_weight_group(const uint8_t* qrow, int64_t g) {
  if constexpr (INT4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + g * (kQ8Group / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);                     // elements 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);  // elements 16..31
    return _mm256_set_m128i(hi, lo);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow + g * kQ8Group));
  }
}

// u8 x s8 dot products accumulated straight into int32 where the CPU has VNNI (AVX512-VNNI
// with VL, or AVX-VNNI): one instruction for maddubs + madd + add, no int16 stage. Chosen at
// compile time (the builds are -march=native, keyed by the ISA macros the compiler defines).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDLLM_Q8_VNNI 1
__attribute__((always_inline)) inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#elif defined(__AVXVNNI__)
#define PAGEDLLM_Q8_VNNI 1
__attribute__((always_inline)) inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_avx_epi32(acc, u, s);
}
#else
#define PAGEDLLM_Q8_VNNI 0
#endif

// Repacked operands: bytes [rows, K] and float32 [rows, K / 32] scales (and the 4-bit
// zeros, or the activations' exact group sums). Groups [0, 8 F) (F = K / 256 super-blocks)
// lie in the super-block layout (bytes [256 b, 256 b + 256) for groups 8 b .. 8 b + 7);
// the G % 8 groups after them lie in element order, 32 bytes each (no padding: K = 576 is 2
// super-blocks and 2 groups, and padding it to 3 super-blocks measured 1.3x the work).
struct Q8Operand {
  const uint8_t* q;
  const float* scale;
  const float* extra;  // weights: 4-bit zeros; activations: exact group sums
  int64_t stride;      // bytes per row (K); floats per row are stride / 32
};

// Where group g of a row goes in the repacked layout: (byte offset, super-block lane or -1).
inline void place_group(int64_t g, int64_t supers, int64_t* offset, int* lane) {
  if (g < supers * kSuper) {
    *offset = (g / kSuper) * kSuperBytes;
    *lane = static_cast<int>(g % kSuper);
  } else {
    *offset = g * kQ8Group;
    *lane = -1;
  }
}

inline void store_group(__m256i v, uint8_t* row, int64_t g, int64_t supers) {
  int64_t offset;
  int lane;
  place_group(g, supers, &offset, &lane);
  if (lane >= 0) {
    scatter_group(v, row + offset, lane);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + offset), v);
  }
}

// The signed int32 pair sums (8 lanes) of w . x for 32 bytes each: 4-bit w unsigned; 8-bit
// w signed, through |w| and x with w's sign.
template <bool INT4>
__attribute__((always_inline)) inline __m256i dot_pairs16(__m256i w, __m256i wabs, __m256i x) {
  if constexpr (INT4) {
    return _mm256_maddubs_epi16(w, x);
  } else {
    return _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w));
  }
}

// y[m, n] for MT activation rows and NT weight rows (operands already at the tile's rows).
template <int MT, int NT, bool INT4>
inline void q8_tile(Q8Operand x, Q8Operand w, int64_t supers, int64_t groups, float* y, int64_t ldy) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t gs = x.stride / kQ8Group;  // floats per row of scales
  for (int64_t b = 0; b < supers; ++b) {
    // 4-bit: int16 sums over the 8 vectors (each pair <= 2 * 15 * 127, 8 of them 30,480 <
    // 32,767), widened once; 8-bit: widened per vector (a pair alone reaches 32,512).
    __m256i isum[MT][NT];
#if PAGEDLLM_Q8_VNNI
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n) isum[m][n] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      __m256i wv[NT], wabs[NT];
      for (int n = 0; n < NT; ++n) {
        wv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + n * w.stride + b * kSuperBytes + 32 * t));
        if constexpr (!INT4) wabs[n] = _mm256_sign_epi8(wv[n], wv[n]);  // |q| (as unsigned)
      }
      for (int m = 0; m < MT; ++m) {
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + m * x.stride + b * kSuperBytes + 32 * t));
        for (int n = 0; n < NT; ++n) {
#if PAGEDLLM_Q8_VNNI
          isum[m][n] = INT4 ? dpbusd(isum[m][n], wv[n], xv) : dpbusd(isum[m][n], wabs[n], _mm256_sign_epi8(xv, wv[n]));
#else
          const __m256i p = dot_pairs16<INT4>(wv[n], wabs[n], xv);
          if constexpr (INT4) {
            isum[m][n] = t == 0 ? p : _mm256_add_epi16(isum[m][n], p);
          } else {
            const __m256i p32 = _mm256_madd_epi16(p, ones);
            isum[m][n] = t == 0 ? p32 : _mm256_add_epi32(isum[m][n], p32);
          }
#endif
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 dx = _mm256_loadu_ps(x.scale + m * gs + b * kSuper);
      for (int n = 0; n < NT; ++n) {
        const __m256i p32 = INT4 && !PAGEDLLM_Q8_VNNI ? _mm256_madd_epi16(isum[m][n], ones) : isum[m][n];
        const __m256 s = _mm256_mul_ps(dx, _mm256_loadu_ps(w.scale + n * gs + b * kSuper));
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), s, acc[m][n]);
        if constexpr (INT4) {
          // The zero points times the groups' exact sums.
          acc[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(w.extra + n * gs + b * kSuper),
                                      _mm256_loadu_ps(x.extra + m * gs + b * kSuper), acc[m][n]);
        }
      }
    }
  }
  // The groups past the super-blocks, one at a time (their lanes all one group's: the
  // accumulators' lanes are only summed at the end, so they mix freely).
  float tail[MT][NT] = {};
  for (int64_t g = supers * kSuper; g < groups; ++g) {
    __m256i wv[NT], wabs[NT];
    __m256 sw[NT];
    for (int n = 0; n < NT; ++n) {
      wv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q + n * w.stride + g * kQ8Group));
      if constexpr (!INT4) wabs[n] = _mm256_sign_epi8(wv[n], wv[n]);
      sw[n] = _mm256_broadcast_ss(w.scale + n * gs + g);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + m * x.stride + g * kQ8Group));
      const __m256 dx = _mm256_broadcast_ss(x.scale + m * gs + g);
      for (int n = 0; n < NT; ++n) {
#if PAGEDLLM_Q8_VNNI
        const __m256i p32 = INT4 ? dpbusd(_mm256_setzero_si256(), wv[n], xv)
                                 : dpbusd(_mm256_setzero_si256(), wabs[n], _mm256_sign_epi8(xv, wv[n]));
#else
        const __m256i p32 = _mm256_madd_epi16(dot_pairs16<INT4>(wv[n], wabs[n], xv), ones);
#endif
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_mul_ps(dx, sw[n]), acc[m][n]);
        if constexpr (INT4) tail[m][n] += w.extra[n * gs + g] * x.extra[m * gs + g];
      }
    }
  }
  for (int n = 0; n < NT; ++n) {
    if constexpr (MT == 4) {
      // The four rows' sums of column n at once: two rounds of hadd, then the 128-bit halves
      // (5 instructions for 4 sums instead of 6 each; measurable at K = 576).
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][n], acc[1][n]), _mm256_hadd_ps(acc[2][n], acc[3][n]));
      alignas(16) float sums[4];
      _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      for (int m = 0; m < 4; ++m) y[m * ldy + n] = sums[m] + tail[m][n];
    } else {
      for (int m = 0; m < MT; ++m) y[m * ldy + n] = hsum(acc[m][n]) + tail[m][n];
    }
  }
}

// y [M, N] = x [M, K] . dequant(W)^T with x rounded to int8 once per call; threads split the
// weight rows in chunks (q8_chunk_rows), each chunk repacked once into a thread-local buffer and
// then met by every activation row tile.
template <bool INT4, typename S>
void quant_matmul_q8(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* qp, const S* sp,
                     const S* zp, float* y) {
  const int64_t groups = K / kQ8Group, supers = groups / kSuper;
  const int64_t qstride = INT4 ? K / 2 : K;
  std::vector<uint8_t> xq(M * K);
  std::vector<float> dx(M * groups), xs(M * groups);
#pragma omp parallel for schedule(static)
  for (int64_t mg = 0; mg < M * groups; ++mg) {
    const int64_t m = mg / groups, g = mg % groups;
    store_group(quantize_group_q8(x + mg * kQ8Group, &dx[mg], &xs[mg]), &xq[m * K], g, supers);
  }
  const int64_t chunk = q8_chunk_rows(K), chunks = (N + chunk - 1) / chunk;
#pragma omp parallel
  {
    static thread_local std::vector<uint8_t> wbuf;
    static thread_local std::vector<float> sbuf, zbuf;
    if (wbuf.size() < static_cast<size_t>(chunk * K)) wbuf.resize(chunk * K);
    if (sbuf.size() < static_cast<size_t>(chunk * groups)) {
      sbuf.resize(chunk * groups);
      zbuf.resize(chunk * groups);
    }
    // Dynamic: on a shared machine a thread that loses its core for a while leaves its
    // chunks to the others instead of holding up the call.
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t n0 = c * chunk, R = std::min<int64_t>(chunk, N - n0);
      for (int64_t r = 0; r < R; ++r) {
        const uint8_t* qrow = qp + (n0 + r) * qstride;
        for (int64_t g = 0; g < groups; ++g) store_group(load_weight_group<INT4>(qrow, g), &wbuf[r * K], g, supers);
        for (int64_t g = 0; g < groups; ++g) {  // (widened from fp16 where stored so)
          sbuf[r * groups + g] = scale_at(sp, (n0 + r) * groups + g);
          if constexpr (INT4) zbuf[r * groups + g] = scale_at(zp, (n0 + r) * groups + g);
        }
      }
      for_row_tiles<kQ8MT>(M, [&](auto mt, int64_t m) {
        constexpr int MT = decltype(mt)::value;
        const Q8Operand xm{&xq[m * K], &dx[m * groups], &xs[m * groups], K};
        auto cols = [&](auto nt, int64_t j) {
          constexpr int NT = decltype(nt)::value;
          const Q8Operand wj{&wbuf[j * K], &sbuf[j * groups], &zbuf[j * groups], K};
          q8_tile<MT, NT, INT4>(xm, wj, supers, groups, y + m * N + n0 + j, N);
        };
        for_row_tiles<kQ8NT>(R, cols);
      });
    }
  }
}

}  // namespace pagedllm
