#pragma once
// Small-M GGUF matmul with int16 activations and VNNI integer dot products, for CPUs with
// AVX512-BW/VL and AVX512-VNNI (compiled where the compiler targets them; elsewhere
// has_int16_dot is false and gguf_matmul.h's float path runs).
//
// Activations: each row is rounded to int16 per group of 32 (xq = round-half-even(x * 32767 /
// absmax), scale xd = absmax / 32767, error at most xd / 2 per element: quant_linear.h's
// int16 rounding), once per call. The weight is read as 64-element units of unsigned 8-bit
// codes u (0..255) with a per-lane weight scale ws and offset ov (a lane = 4 consecutive
// elements), such that each weight is
//   w = ws * u - ov   (Q4_K: u = q, ws = d sc, ov = dmin m; Q6_K: ws = d sc, ov = 32 ws;
//                      Q8_0 / IQ4: u = value + 128, ov = 128 ws; Q4_0: ov = 8 ws; Q4_1: ov = -m)
// so a unit contributes sum_lanes ws * xd * dot4(u, xq) - ov * xd * sum4(xq): two vpdpwssd
// form dot4 exactly in int32 (at most 4 * 255 * 32767 < 2^31), the rest is float32 per lane.
#include <cstdint>

#include "gguf_types.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAGEDLLM_GGUF_INT16_DOT 1
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace pagedllm::gguf {

inline const char* int16_dot_variant() { return "avx512_vnni"; }

template <Type T>
constexpr bool has_int16_dot() {
  return T == Type::Q4_0 || T == Type::Q4_1 || T == Type::Q8_0 || T == Type::Q4_K || T == Type::Q5_K ||
         T == Type::Q6_K || T == Type::IQ4_NL || T == Type::IQ4_XS || T == Type::MXFP4;
}

// x [M, K] rounded to int16 per group of 32, padded with zeros to whole 64-element units and
// split for vpdpwssd: lane i of a unit's xe holds elements (4i, 4i + 2), of xo (4i + 1, 4i + 3)
// ([M, units * 32] each), so two vpdpwssd with the weight codes' even and odd bytes sum the
// 4 elements of lane i. Per lane: xde = the group's scale, xs4 = xd * the lane's code sum
// ([M, units * 16] each).
struct Int16Activations {
  int64_t units;
  std::vector<int16_t> xe, xo;
  std::vector<float> xde, xs4;

  Int16Activations(const float* x, int64_t M, int64_t K)
      : units((K + 63) / 64), xe(M * units * 32, 0), xo(M * units * 32, 0), xde(M * units * 16, 0.f),
        xs4(M * units * 16, 0.f) {
    std::vector<int16_t> q(units * 64, 0);  // one row's codes in element order
    for (int64_t m = 0; m < M; ++m) {
      float* de = xde.data() + m * units * 16;
      for (int64_t g = 0; g < K / 32; ++g) {
        const __m512 v0 = _mm512_loadu_ps(x + m * K + 32 * g), v1 = _mm512_loadu_ps(x + m * K + 32 * g + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + 32 * g),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + 32 * g + 16),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
        std::fill(de + 8 * g, de + 8 * g + 8, amax / 32767.f);
      }
      int16_t* e = xe.data() + m * units * 32;
      int16_t* o = xo.data() + m * units * 32;
      float* s4 = xs4.data() + m * units * 16;
      for (int64_t i = 0; i < units * 16; ++i) {
        const int16_t* l = q.data() + 4 * i;
        e[2 * i] = l[0], e[2 * i + 1] = l[2], o[2 * i] = l[1], o[2 * i + 1] = l[3];
        s4[i] = de[i] * float(int32_t(l[0]) + l[1] + l[2] + l[3]);
      }
    }
  }
};

// Two scales as the lanes of a unit's halves (lanes 0-7: a, 8-15: b).
inline __m512 halves(float a, float b) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b)); }

// 32 bytes of Q4_0-order nibbles (two 16-byte groups: element j low nibble, j + 16 high) ->
// 64 codes in element order.
inline __m512i nibbles_q4_0_order(__m256i q) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(q, mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
  const __m512i idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  return _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), idx, _mm512_castsi256_si512(hi));
}
// 32 bytes whose low nibbles are elements 0..31 and high nibbles 32..63 -> 64 codes.
inline __m512i nibbles_k_order(__m256i q) {
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
  return _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
}
// A 16-entry int8 code book plus 128, in each 128-bit lane (for vpshufb).
inline __m512i offset_table(const int8_t* values) {
  alignas(16) uint8_t t[16];
  for (int i = 0; i < 16; ++i) t[i] = uint8_t(values[i] + 128);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// The 64-element units of a row of 32-element blocks (Q4_0, Q4_1, Q8_0, IQ4_NL, MXFP4): two
// blocks per unit, f(unit, u, ws, ov) for each.
template <Type T, typename F>
inline void units_of_32_blocks(const uint8_t* row, int64_t K, F&& f) {
  constexpr Geometry g = kGeometry[int(T)];
  const int64_t blocks = K / 32;
  const __m512i table = offset_table(T == Type::MXFP4 ? kMXFP4Values : kIQ4Values);
  for (int64_t p = 0; p < blocks; p += 2) {
    const uint8_t* b0 = row + p * g.bytes;
    const bool two = p + 1 < blocks;
    const uint8_t* b1 = two ? b0 + g.bytes : b0;  // a lone tail block: its upper half zeroed
    constexpr int qoff = T == Type::Q4_1 ? 4 : (T == Type::MXFP4 ? 1 : 2);
    const float d0 = T == Type::MXFP4 ? e8m0_half(b0[0]) : fp16_at(b0);
    const float d1 = two ? (T == Type::MXFP4 ? e8m0_half(b1[0]) : fp16_at(b1)) : 0.f;
    __m512i u;
    if constexpr (T == Type::Q8_0) {
      const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
      const __m256i q1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)) : _mm256_setzero_si256();
      u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1), _mm512_set1_epi8(char(0x80)));
    } else {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + qoff));
      const __m128i q1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + qoff)) : _mm_setzero_si128();
      u = nibbles_q4_0_order(_mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1));
      if constexpr (T == Type::IQ4_NL || T == Type::MXFP4) u = _mm512_shuffle_epi8(table, u);
    }
    const __m512 ws = halves(d0, d1);
    __m512 ov;
    if constexpr (T == Type::Q4_1) {
      ov = _mm512_sub_ps(_mm512_setzero_ps(), halves(fp16_at(b0 + 2), two ? fp16_at(b1 + 2) : 0.f));
    } else {
      ov = _mm512_mul_ps(ws, _mm512_set1_ps(T == Type::Q4_0 ? 8.f : 128.f));
    }
    f(p / 2, u, ws, ov);
  }
}

// The 4 units of one Q4_K / Q5_K block (unit0 = its first unit's index).
template <Type T, typename F>
inline void units_of_k4_block(const uint8_t* blk, int64_t unit0, F&& f) {
  const float d = fp16_at(blk), dmin = fp16_at(blk + 2);
  const uint8_t* qs = blk + (T == Type::Q5_K ? 48 : 16);
  uint64_t sc8, m8;
  k4_scales_mins(blk + 4, sc8, m8);
  // d * scale and dmin * min of the 8 sub-blocks, in lanes 0..7.
  const __m512 scd = _mm512_castps256_ps512(_mm256_mul_ps(
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc8)))), _mm256_set1_ps(d)));
  const __m512 md = _mm512_castps256_ps512(_mm256_mul_ps(
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(m8)))), _mm256_set1_ps(dmin)));
  const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int j = 0; j < 4; ++j) {
    const __m512i sub = _mm512_add_epi32(pair, _mm512_set1_epi32(2 * j));  // sub-blocks 2j, 2j + 1
    __m512i u = nibbles_k_order(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j)));
    if constexpr (T == Type::Q5_K) {
      // The 5th bits: bit 2j (low nibbles) / 2j + 1 (high) of qh[l], moved to bit 4.
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
      const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(short(2 * j)), _mm256_set1_epi16(short(2 * j + 1)), 1);
      const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(1));
      u = _mm512_or_si512(u, _mm512_slli_epi16(bit, 4));
    }
    f(unit0 + j, u, _mm512_permutexvar_ps(sub, scd), _mm512_permutexvar_ps(sub, md));
  }
}

// The 4 units of one Q6_K block.
template <typename F>
inline void units_of_q6k_block(const uint8_t* blk, int64_t unit0, F&& f) {
  const float d = fp16_at(blk + 208);
  const __m512 sc = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))),
      _mm512_set1_ps(d));  // d * scale of each 16 elements
  const __m512i lane_scale = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m512i qhh = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
    const __m512i a = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qhh, shl), m30));
    const __m512i c = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                      _mm512_and_si512(_mm512_srlv_epi16(qhh, shr), m30));
    const __m512 wa = _mm512_permutexvar_ps(_mm512_add_epi32(lane_scale, _mm512_set1_epi32(8 * h)), sc);
    const __m512 wc = _mm512_permutexvar_ps(_mm512_add_epi32(lane_scale, _mm512_set1_epi32(8 * h + 4)), sc);
    f(unit0 + 2 * h, a, wa, _mm512_mul_ps(wa, _mm512_set1_ps(32.f)));
    f(unit0 + 2 * h + 1, c, wc, _mm512_mul_ps(wc, _mm512_set1_ps(32.f)));
  }
}

// The 4 units of one IQ4_XS block.
template <typename F>
inline void units_of_iq4xs_block(const uint8_t* blk, int64_t unit0, F&& f) {
  const float d = fp16_at(blk);
  const uint16_t scales_h = load_u16(blk + 2);
  const __m512i table = offset_table(kIQ4Values);
  for (int j = 0; j < 4; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 8 + 32 * j));
    const __m512i u = _mm512_shuffle_epi8(table, nibbles_q4_0_order(q));
    const __m512 ws = halves(d * float(iq4xs_scale(scales_h, blk + 4, 2 * j)),
                             d * float(iq4xs_scale(scales_h, blk + 4, 2 * j + 1)));
    f(unit0 + j, u, ws, _mm512_mul_ps(ws, _mm512_set1_ps(128.f)));
  }
}

// Calls f(unit, u, ws, ov) for every 64-element unit of a row of K elements.
template <Type T, typename F>
inline void for_units(const uint8_t* row, int64_t K, F&& f) {
  constexpr Geometry g = kGeometry[int(T)];
  if constexpr (g.elems == 32) {
    units_of_32_blocks<T>(row, K, f);
  } else {
    for (int64_t b = 0; b < K / 256; ++b) {
      if constexpr (T == Type::Q4_K || T == Type::Q5_K) units_of_k4_block<T>(row + b * g.bytes, 4 * b, f);
      if constexpr (T == Type::Q6_K) units_of_q6k_block(row + b * g.bytes, 4 * b, f);
      if constexpr (T == Type::IQ4_XS) units_of_iq4xs_block(row + b * g.bytes, 4 * b, f);
    }
  }
}

// sums[r] (r < R) = activation row row_of(r) dotted with one weight row.
template <Type T, int R, typename RowOf>
inline void row_dots_int16(const uint8_t* row, int64_t K, const Int16Activations& a, RowOf row_of, float* sums) {
  __m512 acc[R];
  int64_t base[R];  // each activation row's first lane
  const int64_t lstride = a.units * 16;
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), base[r] = int64_t(row_of(r)) * lstride;
  for_units<T>(row, K, [&](int64_t unit, __m512i u, __m512 ws, __m512 ov) {
    // Word i of u_even / u_odd: byte 2i / 2i + 1 of u, i.e. codes (4j, 4j + 2) / (4j + 1, 4j + 3) of lane j.
    const __m512i u_even = _mm512_and_si512(u, _mm512_set1_epi16(0x00FF)), u_odd = _mm512_srli_epi16(u, 8);
    for (int r = 0; r < R; ++r) {
      const int64_t lane = base[r] + unit * 16;
      const __m512i dot = _mm512_dpwssd_epi32(
          _mm512_dpwssd_epi32(_mm512_setzero_si512(), u_even, _mm512_loadu_si512(a.xe.data() + 2 * lane)), u_odd,
          _mm512_loadu_si512(a.xo.data() + 2 * lane));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(a.xde.data() + lane));
      acc[r] = _mm512_fnmadd_ps(_mm512_loadu_ps(a.xs4.data() + lane), ov, _mm512_fmadd_ps(t, ws, acc[r]));
    }
  });
  for (int r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
}

// y[r] (r < R) = activation rows m0 .. m0 + R - 1 dotted with one weight row.
template <Type T, int R>
inline void row_dot_int16(const uint8_t* row, int64_t K, const Int16Activations& a, int64_t m0, float* y,
                          int64_t N) {
  float sums[R];
  row_dots_int16<T, R>(row, K, a, [m0](int r) { return m0 + r; }, sums);
  for (int r = 0; r < R; ++r) y[(m0 + r) * N] = sums[r];
}

// sums[i] (i < n) = activation row rows[i] dotted with one weight row (the rows in tiles of 4).
template <Type T>
inline void gathered_dots_int16(const uint8_t* row, int64_t K, const Int16Activations& a, const int32_t* rows,
                                int64_t n, float* sums) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) row_dots_int16<T, 4>(row, K, a, [&](int r) { return rows[i + r]; }, sums + i);
  switch (n - i) {
    case 3: row_dots_int16<T, 3>(row, K, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    case 2: row_dots_int16<T, 2>(row, K, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    case 1: row_dots_int16<T, 1>(row, K, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    default: break;
  }
}

// y [M, N] = x [M, K] @ W.T with int16 activations; threads over output rows, the activation
// rows in tiles of up to 4 per pass over a (cached) weight row.
template <Type T>
void matmul_int16(const float* x, int64_t M, int64_t K, const uint8_t* data, int64_t row_bytes, int64_t N,
                  float* y) {
  const Int16Activations a(x, M, K);
#pragma omp parallel for schedule(guided, kMinChunkRows)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = data + n * row_bytes;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) row_dot_int16<T, 4>(row, K, a, m0, y + n, N);
    switch (M - m0) {
      case 3: row_dot_int16<T, 3>(row, K, a, m0, y + n, N); break;
      case 2: row_dot_int16<T, 2>(row, K, a, m0, y + n, N); break;
      case 1: row_dot_int16<T, 1>(row, K, a, m0, y + n, N); break;
      default: break;
    }
  }
}

}  // namespace pagedllm::gguf

#else  // no AVX-512 VNNI: no int16 path

namespace pagedllm::gguf {

inline const char* int16_dot_variant() { return "none"; }
template <Type T>
constexpr bool has_int16_dot() {
  return false;
}
template <Type T>
void matmul_int16(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*) {}
struct Int16Activations {
  Int16Activations(const float*, int64_t, int64_t) {}
};
template <Type T>
inline void gathered_dots_int16(const uint8_t*, int64_t, const Int16Activations&, const int32_t*, int64_t, float*) {}

}  // namespace pagedllm::gguf
#endif
