#pragma once
// Small-M GGUF matmul with int16 activations and VNNI integer dot products, for CPUs with
// AVX512-BW/VL and AVX512-VNNI (compiled where the compiler targets them; elsewhere
// has_int16_dot is false and gguf_matmul.h's float path runs).
//
// Activations: each row is rounded to int16 per group of 32 (xq = round-half-even(x * 32767 /
// absmax), scale xd = absmax / 32767, error at most xd / 2 per element: quant_linear.h's
// int16 rounding), once per call, kept in element order with xd and xs = xd * sum(xq) per
// group.
// Weights: each 32-element group of a block is widened to 32 signed int16 codes c with a
// float scale ws and a per-element offset wo (Q4_1: m; Q4_K / Q5_K: -dmin m; else 0), so that
// each weight is w = ws * c + wo (Q6_K's codes carry their 16-element int8 scales: |c| <= 4096).
// One vpdpwssd sums the group's c * xq exactly in 16 int32 lanes (a lane at most
// 2 * 4096 * 32767 < 2^31), and
//   y += (ws * xd) * float(lanes) + wo * xs
// one conversion and one FMA per group; a block computes ws * xd for all its groups at once.
// A weight row is read once per call: each group decoded once for up to 4 activation rows.
// Each output's arithmetic is the same whatever M, so the result does not depend on M, the
// activation rows' tiling or the thread count.
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
  return T == Type::Q4_0 || T == Type::Q4_1 || T == Type::Q5_0 || T == Type::Q5_1 || T == Type::Q8_0 ||
         T == Type::Q4_K || T == Type::Q5_K || T == Type::Q6_K || T == Type::IQ4_NL || T == Type::IQ4_XS ||
         T == Type::MXFP4;
}

// x [M, K] (K a multiple of 32) rounded to int16 per group of 32: q [M, K] in element order;
// per group d = its scale, s = d * the sum of its codes ([M, K / 32] each).
struct Int16Activations {
  int64_t K, groups;
  std::vector<int16_t> q;
  std::vector<float> d, s;

  Int16Activations(const float* x, int64_t M, int64_t K_)
      : K(K_), groups(K_ / 32), q(M * K_), d(M * groups), s(M * groups) {
    for (int64_t i = 0; i < M * groups; ++i) {
      const __m512 v0 = _mm512_loadu_ps(x + 32 * i), v1 = _mm512_loadu_ps(x + 32 * i + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
      const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + 32 * i), _mm512_cvtsepi32_epi16(c0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + 32 * i + 16), _mm512_cvtsepi32_epi16(c1));
      d[i] = amax / 32767.f;  // |x| <= amax: the codes are within int16 without saturating
      s[i] = d[i] * float(_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
    }
  }
};

// 16 bytes of Q4_0-order nibbles (element j: low nibble of byte j, j + 16: high nibble) through
// a 16-entry int8 table (in both 128-bit lanes) -> 32 int16 codes in element order.
inline __m512i nibble_codes(const uint8_t* qs, __m256i table) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0x0F);
  const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
  return _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(table, idx));
}
inline __m256i code_table(const int8_t* values) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
}
// 32 bytes -> 32 words (zero-extended).
inline __m512i widen_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline constexpr int8_t kQ4_0Values[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
inline constexpr int8_t kQ4_1Values[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// A block of T as the kernel reads it: G groups of 32; load(blk) takes its scales (ws[g],
// and wo[g] where kOffset), codes(g) widens group g.
template <Type T>
struct Int16Block;

// The 32-element types whose codes are a 16-entry table of nibbles.
template <Type T>
struct NibbleBlock {
  static constexpr int G = 1;
  static constexpr bool kOffset = T == Type::Q4_1;
  static constexpr int kQs = T == Type::Q4_1 ? 4 : (T == Type::MXFP4 ? 1 : 2);
  const uint8_t* blk;
  float ws[1], wo[1];
  __m256i table = code_table(T == Type::Q4_0   ? kQ4_0Values
                             : T == Type::Q4_1 ? kQ4_1Values
                             : T == Type::MXFP4 ? kMXFP4Values
                                                : kIQ4Values);
  void load(const uint8_t* b) {
    blk = b;
    ws[0] = T == Type::MXFP4 ? e8m0_half(b[0]) : fp16_at(b);
    if constexpr (kOffset) wo[0] = fp16_at(b + 2);
  }
  __m512i codes(int) const { return nibble_codes(blk + kQs, table); }
};
template <> struct Int16Block<Type::Q4_0> : NibbleBlock<Type::Q4_0> {};
template <> struct Int16Block<Type::Q4_1> : NibbleBlock<Type::Q4_1> {};
template <> struct Int16Block<Type::IQ4_NL> : NibbleBlock<Type::IQ4_NL> {};
template <> struct Int16Block<Type::MXFP4> : NibbleBlock<Type::MXFP4> {};

// Q5_0 / Q5_1: Q4_0's nibble order (qs 16 bytes) plus a 5th bit per element: bit i of the
// 32-bit qh is element i's, so the 32 bits are the write mask adding 16 to the words.
// Q5_0: (nibble + 16 bit) - 16, times d; Q5_1: nibble + 16 bit, times d, plus m.
inline constexpr int8_t kQ5_0Low[16] = {-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1};
template <Type T>
struct Q5Block {
  static constexpr int G = 1;
  static constexpr bool kOffset = T == Type::Q5_1;
  static constexpr int kQh = kOffset ? 4 : 2, kQs = kQh + 4;
  const uint8_t* blk;
  float ws[1], wo[1];
  __m256i table = code_table(kOffset ? kQ4_1Values : kQ5_0Low);
  void load(const uint8_t* b) {
    blk = b;
    ws[0] = fp16_at(b);
    if constexpr (kOffset) wo[0] = fp16_at(b + 2);
  }
  __m512i codes(int) const {
    const __m512i c = nibble_codes(blk + kQs, table);
    return _mm512_mask_add_epi16(c, __mmask32(load_u32(blk + kQh)), c, _mm512_set1_epi16(16));
  }
};
template <> struct Int16Block<Type::Q5_0> : Q5Block<Type::Q5_0> {};
template <> struct Int16Block<Type::Q5_1> : Q5Block<Type::Q5_1> {};

template <>
struct Int16Block<Type::Q8_0> {
  static constexpr int G = 1;
  static constexpr bool kOffset = false;
  const uint8_t* blk;
  float ws[1], wo[1];
  void load(const uint8_t* b) { blk = b, ws[0] = fp16_at(b); }
  __m512i codes(int) const {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
  }
};

// Q4_K and Q5_K: 8 groups with 6-bit scales and mins; group g is the low (g even) or high
// nibbles of qs bytes 32 (g / 2) .. + 31, Q5_K's 5th bit is bit g of qh byte l.
template <Type T>
struct K4Block {
  static constexpr int G = 8;
  static constexpr bool kOffset = true;
  const uint8_t* blk;
  alignas(32) float ws[8], wo[8];
  void load(const uint8_t* b) {
    blk = b;
    uint64_t sc8, m8;
    k4_scales_mins(b + 4, sc8, m8);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc8))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(m8))));
    _mm256_store_ps(ws, _mm256_mul_ps(sc, _mm256_set1_ps(fp16_at(b))));
    _mm256_store_ps(wo, _mm256_mul_ps(mn, _mm256_set1_ps(-fp16_at(b + 2))));
  }
  __m512i codes(int g) const {
    const __m512i w = widen_u8(blk + (T == Type::Q5_K ? 48 : 16) + 32 * (g / 2));
    __m512i c = (g & 1) ? _mm512_srli_epi16(w, 4) : _mm512_and_si512(w, _mm512_set1_epi16(0x0F));
    if constexpr (T == Type::Q5_K) {
      const __m512i bit = _mm512_and_si512(_mm512_srli_epi16(widen_u8(blk + 16), g), _mm512_set1_epi16(1));
      c = _mm512_or_si512(c, _mm512_slli_epi16(bit, 4));
    }
    return c;
  }
};
template <> struct Int16Block<Type::Q4_K> : K4Block<Type::Q4_K> {};
template <> struct Int16Block<Type::Q5_K> : K4Block<Type::Q5_K> {};

// Q6_K: group g = 4h + i of half h takes nibble i / 2 of ql bytes 64 h + 32 (i % 2) .. + 31
// and bits 2i, 2i + 1 of qh bytes 128 + 32 h + l; minus 32, times the int8 scales of its two
// 16-element halves (sc[2g], sc[2g + 1]).
template <>
struct Int16Block<Type::Q6_K> {
  static constexpr int G = 8;
  static constexpr bool kOffset = false;
  const uint8_t* blk;
  alignas(32) float ws[8], wo[8];
  __m512i sc;  // the 16 scales as words 0..15
  void load(const uint8_t* b) {
    blk = b;
    _mm256_store_ps(ws, _mm256_set1_ps(fp16_at(b + 208)));
    sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
  }
  __m512i codes(int g) const {
    const int h = g / 4, i = g % 4;
    const __m512i lw = widen_u8(blk + 64 * h + 32 * (i & 1)), hw = widen_u8(blk + 128 + 32 * h);
    const __m512i lo = i < 2 ? _mm512_and_si512(lw, _mm512_set1_epi16(0x0F)) : _mm512_srli_epi16(lw, 4);
    const __m512i hi = _mm512_and_si512(i < 2 ? _mm512_slli_epi16(hw, 4 - 2 * i) : _mm512_srli_epi16(hw, 2 * i - 4),
                                        _mm512_set1_epi16(0x30));
    const __m512i c = _mm512_sub_epi16(_mm512_or_si512(lo, hi), _mm512_set1_epi16(32));
    const __m512i idx = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(short(2 * g)),
                                                _mm512_set1_epi16(short(2 * g + 1)));
    return _mm512_mullo_epi16(c, _mm512_permutexvar_epi16(idx, sc));
  }
};

// IQ4_XS: 8 groups of IQ4_NL's nibbles (qs bytes 8 + 16 g ..) with 6-bit scales biased by 32.
template <>
struct Int16Block<Type::IQ4_XS> {
  static constexpr int G = 8;
  static constexpr bool kOffset = false;
  const uint8_t* blk;
  alignas(32) float ws[8], wo[8];
  __m256i table = code_table(kIQ4Values);
  void load(const uint8_t* b) {
    blk = b;
    const float d = fp16_at(b);
    const uint16_t scales_h = load_u16(b + 2);
    for (int g = 0; g < 8; ++g) ws[g] = d * float(iq4xs_scale(scales_h, b + 4, g));
  }
  __m512i codes(int g) const { return nibble_codes(blk + 8 + 16 * g, table); }
};

// fs[g] = ws[g] * xd[g] and, where the type has offsets, off += wo[g] * xs[g], for one block's
// G groups.
template <int G>
inline void block_scales(const float* ws, const float* wo, bool offset, const float* xd, const float* xs,
                         float* fs, __m256& off8, float& off1) {
  if constexpr (G == 8) {
    _mm256_store_ps(fs, _mm256_mul_ps(_mm256_load_ps(ws), _mm256_loadu_ps(xd)));
    if (offset) off8 = _mm256_fmadd_ps(_mm256_load_ps(wo), _mm256_loadu_ps(xs), off8);
  } else {
    fs[0] = ws[0] * xd[0];
    if (offset) off1 += wo[0] * xs[0];
  }
}

// sums[m] for m < MR: one weight row dotted with activation rows row_of(0) .. row_of(MR - 1).
// Two accumulators per output where a block has 8 groups (even and odd groups: two FMA chains).
// The next row's bytes are prefetched as this row's are read (rows are read in order; short
// rows end before the hardware prefetcher has caught up with a new one).
template <Type T, int MR, typename RowOf>
inline void rows_int16(const uint8_t* row, int64_t row_bytes, const Int16Activations& a, RowOf row_of, float* sums) {
  using B = Int16Block<T>;
  constexpr int G = B::G, A = G == 8 ? 2 : 1;
  constexpr Geometry geo = kGeometry[int(T)];
  __m512 acc[MR][A];
  __m256 off8[MR];
  float off1[MR];
  int64_t xrow[MR];  // each activation row's index
  for (int m = 0; m < MR; ++m) {
    xrow[m] = int64_t(row_of(m));
    for (int i = 0; i < A; ++i) acc[m][i] = _mm512_setzero_ps();
    off8[m] = _mm256_setzero_ps(), off1[m] = 0.f;
  }
  B blk;
  alignas(32) float fs[MR][G];
  for (int64_t b = 0; b < a.K / geo.elems; ++b) {
    const uint8_t* p = row + b * geo.bytes;
    for (int l = 0; l < geo.bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + row_bytes + l), _MM_HINT_T0);
    blk.load(p);
    const int64_t g0 = b * G;  // the block's first group
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const int64_t at = xrow[m] * a.groups + g0;
      block_scales<G>(blk.ws, blk.wo, B::kOffset, a.d.data() + at, a.s.data() + at, fs[m], off8[m], off1[m]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __m512i c = blk.codes(g);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512i xq = _mm512_loadu_si512(a.q.data() + xrow[m] * a.K + 32 * (g0 + g));
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), c, xq);
        acc[m][g % A] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(fs[m][g]), acc[m][g % A]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float off = off1[m];
    if constexpr (G == 8 && B::kOffset) off += _mm512_reduce_add_ps(_mm512_castps256_ps512(off8[m]));
    __m512 sum = acc[m][0];
    for (int i = 1; i < A; ++i) sum = _mm512_add_ps(sum, acc[m][i]);
    sums[m] = _mm512_reduce_add_ps(sum) + off;
  }
}

// y[(m0 + m) N] for m < MR: one weight row dotted with activation rows m0 .. m0 + MR - 1.
template <Type T, int MR>
inline void row_int16(const uint8_t* row, int64_t row_bytes, const Int16Activations& a, int64_t m0, float* y,
                      int64_t N) {
  float sums[MR];
  rows_int16<T, MR>(row, row_bytes, a, [m0](int m) { return m0 + m; }, sums);
  for (int m = 0; m < MR; ++m) y[(m0 + m) * N] = sums[m];
}

// sums[i] (i < n) = activation row rows[i] dotted with one weight row of K elements (the rows
// in passes of up to 4; the grouped-expert call, gguf_moe.h).
template <Type T>
inline void gathered_dots_int16(const uint8_t* row, int64_t K, const Int16Activations& a, const int32_t* rows,
                                int64_t n, float* sums) {
  constexpr Geometry geo = kGeometry[int(T)];
  const int64_t row_bytes = K / geo.elems * geo.bytes;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) rows_int16<T, 4>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i);
  switch (n - i) {
    case 3: rows_int16<T, 3>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    case 2: rows_int16<T, 2>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    case 1: rows_int16<T, 1>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    default: break;
  }
}

// y [M, N] = x [M, K] @ W.T with int16 activations; threads over output rows (guided), each
// weight row read once for all M activation rows, up to 4 of them per pass.
template <Type T>
void matmul_int16(const float* x, int64_t M, int64_t K, const uint8_t* data, int64_t row_bytes, int64_t N,
                  float* y) {
  const Int16Activations a(x, M, K);
#pragma omp parallel for schedule(guided, kMinChunkRows)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = data + n * row_bytes;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) row_int16<T, 4>(row, row_bytes, a, m0, y + n, N);
    switch (M - m0) {
      case 3: row_int16<T, 3>(row, row_bytes, a, m0, y + n, N); break;
      case 2: row_int16<T, 2>(row, row_bytes, a, m0, y + n, N); break;
      case 1: row_int16<T, 1>(row, row_bytes, a, m0, y + n, N); break;
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
