#pragma once
// AVX-512 version of quant_linear.h's int16-activation dot products (quant_matmul_q16,
// M <= 2: single-stream decode and the LM head), for CPUs with AVX512-BW and AVX512-VNNI:
// vpdpwssd multiplies 32 int16 pairs and adds them into sixteen int32 lanes in one
// instruction (AVX2's madd + add: 16 pairs in two). Chosen at compile time
// (PAGEDLLM_Q16_AVX512; the builds are -march=native and keyed by the ISA macros), the AVX2
// kernel stays compiled beside it (quant_linear.cpp's q16_variants lets tests run both).
//
// The integer arithmetic is the AVX2 kernel's: the same int16 activations
// (quantize_activations), exact int32 products of the stored 4/8-bit codes, then per group
// times (weight scale * activation scale) in float32 (+ zero * the group's exact sum for
// 4-bit). Only the float summation order differs (a group's integer sum is converted as 4
// (4-bit) or 8 (8-bit) int32 partials, each exact in float32: at most 8 * 15 * 32767 or
// 4 * 128 * 32767 < 2^24).
//
// The weights are read as stored, without byte shuffles: a 16-bit word j of an int4 group's
// 16 bytes holds elements 2j, 2j + 16, 2j + 1, 2j + 17 in its four nibbles (quant_linear.h's
// nibble order), so shifts and masks of 64 loaded bytes (4 groups, one per 128-bit lane)
// give four vectors of int16 weights; a word j of an int8 group holds elements 2j and
// 2j + 1 (two groups per 64 bytes, one per 256-bit half). The activations are permuted once
// per call to match (permute_activations_avx512), so every weight vector meets its
// activation vector lane for lane.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAGEDLLM_Q16_AVX512 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagedllm {

// Groups per 64 bytes of weight codes (one block), and the block's int16 activations:
// int4 4 groups (4 vectors of 32 words), int8 2 groups (2 vectors).
template <bool INT4>
constexpr int kQ16BlockGroups = INT4 ? 4 : 2;
template <bool INT4>
constexpr int kQ16BlockWords = INT4 ? 128 : 64;

// Int16 activations per row, in blocks (the weight's tail block padded with zero words).
template <bool INT4>
inline int64_t q16_permuted_width(int64_t groups) {
  constexpr int BG = kQ16BlockGroups<INT4>;
  return (groups + BG - 1) / BG * kQ16BlockWords<INT4>;
}

// xq [M, K] (element order, quantize_activations) -> xp [M, q16_permuted_width] in the
// weight words' order; xs [M, G] -> xse [M, blocks * 16]: each lane's group scale.
//   int4 block b, vector v, lane L (group 4 b + L), word j: element 2j + (16, 1, 17 for v = 1, 2, 3; 0 for v = 0)
//   int8 block b, vector v, half H (group 2 b + H), word j: element 2j + v
template <bool INT4>
inline void permute_activations_avx512(const int16_t* xq, const float* xs, int64_t M, int64_t K, int16_t* xp,
                                       float* xse) {
  constexpr int BG = kQ16BlockGroups<INT4>, BW = kQ16BlockWords<INT4>;
  constexpr int lane_words = 32 / BG;  // words of one group in one vector
  const int64_t groups = K / 32, width = q16_permuted_width<INT4>(groups), blocks = width / BW;
  // Even elements then odd ones: int8's two vectors as 256-bit halves, and int4's four
  // (2j, 2j + 16, 2j + 1, 2j + 17) as 128-bit quarters.
  const __m512i order = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                         30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int64_t m = 0; m < M; ++m) {
    int16_t* xpm = xp + m * width;
    float* xsem = xse + m * blocks * 16;
    std::memset(xpm + (blocks - 1) * BW, 0, sizeof(int16_t) * BW);  // the tail block's missing groups
    std::memset(xsem + (blocks - 1) * 16, 0, sizeof(float) * 16);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t b = g / BG, lane = g % BG;
      const __m512i v = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(xq + m * K + g * 32));
      int16_t* at = xpm + b * BW + lane * lane_words;
      if constexpr (INT4) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_extracti32x4_epi32(v, 0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 32), _mm512_extracti32x4_epi32(v, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 64), _mm512_extracti32x4_epi32(v, 2));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 96), _mm512_extracti32x4_epi32(v, 3));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_castsi512_si256(v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 32), _mm512_extracti64x4_epi64(v, 1));
      }
      const float s = xs[m * groups + g];
      for (int i = 0; i < 16 / BG; ++i) xsem[b * 16 + lane * (16 / BG) + i] = s;
    }
  }
}

// Group scales or zeros (float32, or fp16 bits: quant_linear.h's S), the first lanes of k.
inline __m128 load4_scales(const float* s, __mmask8 k) { return _mm_maskz_loadu_ps(k, s); }
inline __m128 load4_scales(const uint16_t* s, __mmask8 k) { return _mm_cvtph_ps(_mm_maskz_loadu_epi16(k, s)); }
inline __m512 load16_scales(const float* s, __mmask16 k) { return _mm512_maskz_loadu_ps(k, s); }
inline __m512 load16_scales(const uint16_t* s, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, s));
}

// The sums of four vectors' lanes, as one vector [sum a0, sum a1, sum a2, sum a3].
inline __m128 reduce4_avx512(const __m512 a[4]) {
  __m256 h[4];
  for (int i = 0; i < 4; ++i) h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]), _mm512_extractf32x8_ps(a[i], 1));
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// y[m, n0 + r] for rows m < MT of the permuted activations (xp, xse; row strides width and
// sstride; xsum [MT, groups] for 4-bit's zeros) and NT consecutive weight rows from n0 (qrow,
// srow, zrow: row n0's codes, scales and zeros; qstride bytes and `groups` scales per row).
// Four weight rows at a time share each activation load, and their sums reduce together
// (measured at one thread, 576 x 576 in L2: 25.8 -> 20 ns per row; 256 x 1536: 57 -> 43).
template <int MT, int NT, bool INT4, typename S>
inline void rows_dot_q16_avx512(const int16_t* xp, int64_t width, const float* xse, int64_t sstride,
                                const float* xsum, const uint8_t* qrow, int64_t qstride, const S* srow,
                                const S* zrow, int64_t groups, float* y, int64_t ldy) {
  static_assert(NT == 1 || NT == 4, "one weight row or four");
  constexpr int BG = kQ16BlockGroups<INT4>, BW = kQ16BlockWords<INT4>;
  // Lane -> its group within the block, to spread the block's BG weight scales.
  const __m512i lane_group = INT4 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < NT; ++r) acc[m][r] = _mm512_setzero_ps();
  auto block = [&](int64_t b, __mmask64 bytes, __mmask8 lanes) {
    __m512i xv[MT][BW / 32];
    __m512 xsv[MT];
    for (int m = 0; m < MT; ++m) {
      for (int i = 0; i < BW / 32; ++i) xv[m][i] = _mm512_loadu_si512(xp + m * width + b * BW + 32 * i);
      xsv[m] = _mm512_loadu_ps(xse + m * sstride + b * 16);
    }
    for (int r = 0; r < NT; ++r) {
      const __m512i v = _mm512_maskz_loadu_epi8(bytes, qrow + r * qstride + 64 * b);
      __m512i w[BW / 32];
      if constexpr (INT4) {
        const __m512i nib = _mm512_set1_epi16(0x000F);
        w[0] = _mm512_and_si512(v, nib);                        // elements 2j
        w[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);  // 2j + 16
        w[2] = _mm512_and_si512(_mm512_srli_epi16(v, 8), nib);  // 2j + 1
        w[3] = _mm512_srli_epi16(v, 12);                        // 2j + 17
      } else {
        w[0] = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);   // elements 2j, sign-extended
        w[1] = _mm512_srai_epi16(v, 8);                         // 2j + 1
      }
      const __m512 sw = _mm512_permutexvar_ps(
          lane_group, _mm512_castps128_ps512(load4_scales(srow + r * groups + BG * b, lanes)));
      for (int m = 0; m < MT; ++m) {
        __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w[0], xv[m][0]);
        for (int i = 1; i < BW / 32; ++i) p = _mm512_dpwssd_epi32(p, w[i], xv[m][i]);
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sw, xsv[m]), acc[m][r]);
      }
    }
  };
  const int64_t full = groups / BG, tail = groups % BG;
  for (int64_t b = 0; b < full; ++b) block(b, ~0ULL, (1 << BG) - 1);
  if (tail) block(full, (~0ULL) >> (64 - 64 / BG * tail), (1 << tail) - 1);
  if constexpr (INT4) {  // the zero points times the groups' exact sums, 16 groups at a time
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 k = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
      __m512 xs[MT];
      for (int m = 0; m < MT; ++m) xs[m] = _mm512_maskz_loadu_ps(k, xsum + m * groups + g);
      for (int r = 0; r < NT; ++r) {
        const __m512 z = load16_scales(zrow + r * groups + g, k);
        for (int m = 0; m < MT; ++m) acc[m][r] = _mm512_fmadd_ps(z, xs[m], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    if constexpr (NT == 4) {
      _mm_storeu_ps(y + m * ldy, reduce4_avx512(acc[m]));
    } else {
      y[m * ldy] = _mm512_reduce_add_ps(acc[m][0]);
    }
  }
}

}  // namespace pagedllm

#else
#define PAGEDLLM_Q16_AVX512 0
#endif
