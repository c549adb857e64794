#pragma once
// The 8-bit KV cache codes (layers/kv_quant.py): each (token, head) row is head_dim one-byte
// codes followed by the row's float32 scale; value = code * scale.
//
// Widening (one code to float32, or eight at a time under AVX2) and the writer's quantizer
// (quantize_row: the same arithmetic as kv_quant.quantize_rows, so the compiled and the torch
// writes store the same bytes). fp8 codes widen by moving their exponent and mantissa bits into
// a float's and re-biasing the exponent with an integer add; the subnormal codes (exponent 0)
// are code * 2^-(bias - 1 + mantissa bits), computed as an int-to-float conversion times a
// power of two, so no float denormal ever appears (denormals are slow on x86). With F16C
// (every AVX2 CPU has it) the eight-at-a-time widening goes through float16 instead; under
// AVX-512F load16 widens sixteen at a time the same ways.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedllm {

// One code of each format: distinct one-byte types, so the kernels overload on them.
struct Int8Code { int8_t bits; };
struct E4M3Code { uint8_t bits; };  // float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa
struct E5M2Code { uint8_t bits; };  // float8_e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa

template <typename KV>
inline constexpr bool kv_is_code = std::is_same_v<KV, Int8Code> || std::is_same_v<KV, E4M3Code> ||
                                   std::is_same_v<KV, E5M2Code>;

constexpr int64_t kScaleBytes = 4;  // the float32 scale after each row's codes

// Elements per (token, head) row: the codes and the 4 bytes of the scale, or head_dim floats.
template <typename KV>
inline int64_t kv_row_width(int64_t D) { return kv_is_code<KV> ? D + kScaleBytes : D; }

// The scale of the row that starts at `row` (1 for float rows).
template <typename KV>
inline float kv_row_scale(const KV* row, int64_t D) {
  if constexpr (kv_is_code<KV>) {
    float s;
    std::memcpy(&s, reinterpret_cast<const uint8_t*>(row) + D, sizeof(float));
    return s;
  } else {
    return 1.f;
  }
}

// Format constants: mantissa bits, exponent bias, the largest finite code's magnitude bits.
template <int M, int Bias>
inline float fp8_to_float(uint8_t c) {
  const uint32_t mag = c & 0x7Fu;
  float f;
  if ((mag >> M) == 0) {
    f = std::ldexp(static_cast<float>(mag), -(Bias - 1 + M));
  } else {
    const uint32_t bits = (mag << (23 - M)) + (static_cast<uint32_t>(127 - Bias) << 23);
    std::memcpy(&f, &bits, sizeof f);
  }
  return (c & 0x80u) ? -f : f;
}

inline float to_float(Int8Code x) { return static_cast<float>(x.bits); }
inline float to_float(E4M3Code x) { return fp8_to_float<3, 7>(x.bits); }
inline float to_float(E5M2Code x) { return fp8_to_float<2, 15>(x.bits); }

// v (already divided by the row's scale, |v| <= the format's max) to the nearest code, ties to
// even (as torch's float-to-float8 conversion); max_code bounds the magnitude bits.
template <int M, int Bias>
inline uint8_t float_to_fp8(float v, uint32_t max_code) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const float a = std::fabs(v);
  uint32_t code;
  if (a < std::ldexp(1.f, 1 - Bias)) {  // a subnormal code: steps of 2^(1 - Bias - M)
    code = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, Bias - 1 + M)));
  } else {
    constexpr int shift = 23 - M;
    const uint32_t rebased = (bits & 0x7FFFFFFFu) - (static_cast<uint32_t>(127 - Bias) << 23);
    code = (rebased + ((1u << (shift - 1)) - 1) + ((rebased >> shift) & 1u)) >> shift;
  }
  if (code > max_code) code = max_code;
  return static_cast<uint8_t>(sign | code);
}

template <typename KV> struct CodeLimits;
template <> struct CodeLimits<Int8Code> { static constexpr float qmax = 127.f; };
template <> struct CodeLimits<E4M3Code> { static constexpr float qmax = 448.f; };
template <> struct CodeLimits<E5M2Code> { static constexpr float qmax = 57344.f; };

inline Int8Code encode(float v, Int8Code) {
  return Int8Code{static_cast<int8_t>(std::nearbyint(std::fmin(std::fmax(v, -127.f), 127.f)))};
}
inline E4M3Code encode(float v, E4M3Code) { return E4M3Code{float_to_fp8<3, 7>(v, 0x7E)}; }
inline E5M2Code encode(float v, E5M2Code) { return E5M2Code{float_to_fp8<2, 15>(v, 0x7B)}; }

// out[0, D) = the codes of x[0, D), out[D, D + 4) = its scale (max |x| / qmax, 1 for zeros).
// For float rows, a plain copy.
template <typename KV>
inline void quantize_row(const float* x, int64_t D, KV* out) {
  if constexpr (kv_is_code<KV>) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(x[d]));
    const float scale = amax > 0.f ? amax / CodeLimits<KV>::qmax : 1.f;
    for (int64_t d = 0; d < D; ++d) out[d] = encode(x[d] / scale, KV{});
    std::memcpy(reinterpret_cast<uint8_t*>(out) + D, &scale, sizeof scale);
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<KV>(x[d]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight consecutive elements of a row as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Int8Code* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int M, int Bias>
inline __m256 fp8x8_to_float(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - M), _mm256_set1_epi32((127 - Bias) << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(std::ldexp(1.f, -(Bias - 1 + M))));
  const __m256i is_sub = _mm256_cmpeq_epi32(_mm256_srli_epi32(mag, M), _mm256_setzero_si256());
  const __m256 f = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}
#ifdef __F16C__
// Through float16 (one conversion instruction, subnormals included): an e5m2 code is a float16's
// high byte; an e4m3 code's 7 magnitude bits shifted by 7 are a float16 of 2^-8 its value.
inline __m256 load8(const E4M3Code* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  // c << 7 puts the sign at bit 14 (bit 15 is clear): adding bit 14 to itself moves it to 15.
  const __m128i x = _mm_slli_epi16(c, 7);
  const __m128i h = _mm_add_epi16(x, _mm_and_si128(x, _mm_set1_epi16(0x4000)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
inline __m256 load8(const E5M2Code* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(c, 8));
}
#else
inline __m256 load8(const E4M3Code* p) { return fp8x8_to_float<3, 7>(reinterpret_cast<const uint8_t*>(p)); }
inline __m256 load8(const E5M2Code* p) { return fp8x8_to_float<2, 15>(reinterpret_cast<const uint8_t*>(p)); }
#endif
#endif

#ifdef __AVX512F__
// Sixteen consecutive elements of a row as float32 (the AVX-512 kernels' widening; fp8 through
// float16 as load8 above: AVX-512F has the sixteen-lane float16 conversion).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const Int8Code* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const E4M3Code* p) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i x = _mm256_slli_epi16(c, 7);
  const __m256i h = _mm256_add_epi16(x, _mm256_and_si256(x, _mm256_set1_epi16(0x4000)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
inline __m512 load16(const E5M2Code* p) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(c, 8));
}
#endif

}  // namespace pagedllm
