#pragma once
// Small-M GGUF matmul with int8 activations per 256-element block, for the K-quants that
// dominate the files users download (Q4_K and Q6_K: Q4_K_M; Q5_K: Q5_K_M; Q3_K: Q3_K_*), on CPUs with
// AVX512-BW/VL and AVX512-VNNI. The idea is ggml's (K-quants dotted with "Q8_K"
// activations); the instruction sequence is this file's own.
//
// Activations: each row is rounded to int8 per block of 256 (q = round-half-even(x * 127 /
// absmax), scale xd = absmax / 127, error at most xd / 2 per element) once per call, with the
// exact integer sums of q per 16 and per 32 elements. The codes are stored in the order the
// weight type's unpacked codes come in (Q4_K / Q5_K: each 64-byte vector of nibbles gives
// groups (0, 2), (1, 3), (4, 6), (5, 7); Q6_K: element order).
//
// Weights are read as stored. Per 64 codes one vpdpbusd multiplies the unsigned codes by the
// int8 activations and sums each 4 products into an int32 lane (at most 4 * 63 * 127 = 32004:
// the lane fits in int16), and one vpdpwssd multiplies each lane by its sub-block's integer
// scale (the lane's low 16 bits times the scale, its high 16 bits times 0) and adds it to the
// block's int32 accumulator: the sub-block scales are applied in the integer pipeline, and a
// block costs one int -> float conversion and one FMA per activation row:
//   Q4_K / Q5_K: y += (d * xd) * sum(sc_j * dot_j) - (dmin * xd) * sum(m_j * qsum_j)
//   Q6_K:        y += (d * xd) * sum(sc_j * (dot_j - 32 * qsum_j))   (codes 0..63, minus 32)
//   Q3_K:        y += (d * xd) * sum(sc_j * (dot_j - 4 * qsum_j))    (codes 0..7, minus 4)
// where dot_j and qsum_j are exact integers. The result differs from float activations only by
// the int8 rounding of x (kernels/gguf_blocks.py states the drift the tests bound); each
// output's arithmetic is the same whatever M, the tiling of the rows, or the thread count.
#include <cstdint>

#include "gguf_types.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define PAGEDLLM_GGUF_INT8_DOT 1
#include <immintrin.h>

#include <vector>

namespace pagedllm::gguf {

template <Type T>
constexpr bool has_int8_dot() {
  return T == Type::Q3_K || T == Type::Q4_K || T == Type::Q5_K || T == Type::Q6_K;
}

// x [M, K] (K a multiple of 256) rounded to int8 per block of 256: q [M, K] in the type's
// order (k4_order: Q4_K / Q5_K's group order (0, 2, 1, 3, 4, 6, 5, 7); else element order),
// d [M, K / 256], and per block the negated sums of q per 16 elements (nsum16, 16 int16) and
// the sums per 32 elements in group order (sum32, 8 int16).
struct Int8Activations {
  int64_t K, blocks;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> nsum16, sum32;

  Int8Activations(const float* x, int64_t M, int64_t K_, bool k4_order)
      : K(K_), blocks(K_ / 256), q(M * K_), d(M * blocks), nsum16(M * blocks * 16), sum32(M * blocks * 8) {
    for (int64_t i = 0; i < M * blocks; ++i) {
      const float* xb = x + 256 * i;
      __m512 amax = _mm512_setzero_ps();
      for (int j = 0; j < 256; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + j)));
      const float m = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
      d[i] = m / 127.f;
      for (int g = 0; g < 8; ++g) {  // group g of 32 elements
        const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 32 * g), inv));
        const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 32 * g + 16), inv));
        const int s0 = _mm512_reduce_add_epi32(c0), s1 = _mm512_reduce_add_epi32(c1);
        nsum16[16 * i + 2 * g] = int16_t(-s0), nsum16[16 * i + 2 * g + 1] = int16_t(-s1);
        sum32[8 * i + g] = int16_t(s0 + s1);
        // Q4_K's nibble vectors: groups (0, 2) from the low nibbles of qs 0..63, (1, 3) from
        // the high ones; so group g goes to slot 2 (g / 4) * 2 + ... : 0->0, 2->1, 1->2, 3->3.
        const int slot = k4_order ? (g & ~3) | ((g & 1) << 1) | ((g >> 1) & 1) : g;
        int8_t* at = q.data() + 256 * i + 32 * slot;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm512_cvtsepi32_epi8(c0));  // |c| <= 127
        _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 16), _mm512_cvtsepi32_epi8(c1));
      }
    }
  }
};

// The types whose codes unpack in element order (16 sub-blocks of 16); the others (Q4_K,
// Q5_K) in K4 group order (Int8Activations).
template <Type T>
constexpr bool kElementOrder = T == Type::Q6_K || T == Type::Q3_K;

// Lanes i of an int32 vector (i < 16) take word-pair (scale, 0) with scale = s[idx[i]]:
// `s16` holds the scales as int32 lanes 0..15 (high words zero).
inline __m512i lane_scales(__m512i s16, __m512i idx) { return _mm512_permutexvar_epi32(idx, s16); }

template <Type T>
struct Int8Block;

// Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of 5th bits),
// 128 bytes of nibbles: qs bytes 32 j .. + 31 hold group 2 j (low nibbles) and 2 j + 1 (high).
template <Type T>
struct K4Int8Block {
  static constexpr int kQs = T == Type::Q5_K ? 48 : 16;
  float d, dmin;
  __m512i S[4];   // lane scales of vectors (0, 2), (1, 3), (4, 6), (5, 7)
  __m512i W[4];   // the codes of those vectors
  __m128i mins;   // the 8 mins as int16
  void load(const uint8_t* b) {
    d = fp16_at(b), dmin = fp16_at(b + 2);
    uint64_t sc8, m8;
    k4_scales_mins(b + 4, sc8, m8);
    const __m512i s16 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc8)));
    S[0] = lane_scales(s16, _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0));
    S[1] = lane_scales(s16, _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1));
    S[2] = lane_scales(s16, _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4));
    S[3] = lane_scales(s16, _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5));
    mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(m8)));
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < 2; ++h) {
      const __m512i w = _mm512_loadu_si512(b + kQs + 64 * h);
      W[2 * h] = _mm512_and_si512(w, nib);
      W[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
    }
    if constexpr (T == Type::Q5_K) {
      // Group g's 5th bits are bit g of qh bytes 0..31; vector (g, g + 2) takes them as
      // 32-byte halves: bit g of the low half, bit g + 2 of the high one, moved to bit 4.
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
      const __m512i bit4 = _mm512_set1_epi8(0x10);
      const int g0[4] = {0, 1, 4, 5};
      for (int v = 0; v < 4; ++v) {
        // Shift right by g - 4 (g >= 4) or left by 4 - g, per 256-bit half (g, g + 2).
        const int lo = g0[v], hi = g0[v] + 2;
        const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(short(lo < 4 ? 4 - lo : 0)),
                                               _mm256_set1_epi16(short(hi < 4 ? 4 - hi : 0)), 1);
        const __m512i shr = _mm512_inserti64x4(_mm512_set1_epi16(short(lo > 4 ? lo - 4 : 0)),
                                               _mm256_set1_epi16(short(hi > 4 ? hi - 4 : 0)), 1);
        const __m512i h5 = _mm512_and_si512(_mm512_srlv_epi16(_mm512_sllv_epi16(qh, shl), shr), bit4);
        W[v] = _mm512_or_si512(W[v], h5);
      }
    }
  }
  // One activation row's block: the int32 sums and the min term.
  void dot(const int8_t* xq, const int16_t* sum32, float xd, __m512& facc, __m128& macc) const {
    __m512i acc = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) {
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[v], _mm512_loadu_si512(xq + 64 * v));
      acc = _mm512_dpwssd_epi32(acc, p, S[v]);
    }
    facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d * xd), facc);
    const __m128i mm = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(sum32)));
    macc = _mm_fmadd_ps(_mm_cvtepi32_ps(mm), _mm_set1_ps(dmin * xd), macc);
  }
};
template <> struct Int8Block<Type::Q4_K> : K4Int8Block<Type::Q4_K> {};
template <> struct Int8Block<Type::Q5_K> : K4Int8Block<Type::Q5_K> {};

// The element-order types with 16 sub-blocks of 16, signed scales and unsigned codes u
// offset by `kOffset` (Q6_K: u in 0..63, minus 32; Q3_K: 0..7, minus 4). Lanes i of vector v
// (elements 64 v .. + 63) take sub-block 4 v + i / 4's scale; the offset is folded into the
// block's int32 accumulator as (sc * kOffset) times the negated per-16 sums.
template <int kOffset>
struct Signed16Int8Block {
  float d;
  __m512i S[4];     // lane scales of elements 64 v .. + 63
  __m512i W[4];     // the unsigned codes of those elements
  __m512i sc_off;   // the 16 scales times kOffset as int16 words 0..15 (the rest zero)
  void set_scales(__m128i sc) {  // 16 int8 scales
    const __m512i s16 = _mm512_and_si512(_mm512_cvtepi8_epi32(sc), _mm512_set1_epi32(0xFFFF));
    for (int v = 0; v < 4; ++v) {
      const int s = 4 * v;
      S[v] = lane_scales(s16, _mm512_set_epi32(s + 3, s + 3, s + 3, s + 3, s + 2, s + 2, s + 2, s + 2, s + 1, s + 1,
                                               s + 1, s + 1, s, s, s, s));
    }
    sc_off = _mm512_zextsi256_si512(_mm256_mullo_epi16(_mm256_cvtepi8_epi16(sc), _mm256_set1_epi16(kOffset)));
  }
  void dot(const int8_t* xq, const int16_t* nsum16, float xd, __m512& facc, __m128&) const {
    __m512i acc = _mm512_dpwssd_epi32(_mm512_setzero_si512(), sc_off,
                                      _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nsum16))));
    for (int v = 0; v < 4; ++v) {
      const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[v], _mm512_loadu_si512(xq + 64 * v));
      acc = _mm512_dpwssd_epi32(acc, p, S[v]);
    }
    facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d * xd), facc);
  }
};

// Q6_K: ql (128 bytes), qh (64), 16 int8 scales, d. Half h (128 elements): ql bytes 64 h ..
// + 63 give elements 0..63 (low nibbles) and 64..127 (high nibbles) in order; qh bytes
// 32 h + l hold the top 2 bits of elements l, l + 32, l + 64, l + 96 (bit pairs 0, 1, 2, 3).
template <>
struct Int8Block<Type::Q6_K> : Signed16Int8Block<32> {
  void load(const uint8_t* b) {
    d = fp16_at(b + 208);
    set_scales(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i nib = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    // Per 256-bit half: shift the qh bytes so that the wanted bit pair lands at bits 4-5.
    const __m512i shl_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr_hi = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      W[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, nib), _mm512_and_si512(_mm512_sllv_epi16(qh, shl_lo), top));
      W[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nib),
                                     _mm512_and_si512(_mm512_srlv_epi16(qh, shr_hi), top));
    }
  }
};

// Q3_K: hmask (32 bytes), qs (64), 12 bytes of 6-bit scales (biased by 32), d. Half h: qs
// bytes 32 h + l hold 2-bit codes of elements 128 h + 32 j + l at bits 2 j (j < 4), and
// hmask byte l's bit 4 h + j their third bit: u = low 2 | third << 2, value u - 4.
template <>
struct Int8Block<Type::Q3_K> : Signed16Int8Block<4> {
  void load(const uint8_t* b) {
    d = fp16_at(b + 108);
    // The 16 scales (q3k_scale) four bytes at a time: low 4 bits from bytes 0..7 (low nibbles
    // for scales 0..7, high ones for 8..15), top 2 bits from bytes 8..11 at bit pairs i / 4.
    const uint32_t a0 = load_u32(b + 96), a1 = load_u32(b + 100), t = load_u32(b + 104);
    const uint32_t lo4 = 0x0F0F0F0Fu, hi2 = 0x03030303u;
    alignas(16) uint32_t sc[4] = {(a0 & lo4) | ((t & hi2) << 4), (a1 & lo4) | (((t >> 2) & hi2) << 4),
                                  ((a0 >> 4) & lo4) | (((t >> 4) & hi2) << 4),
                                  ((a1 >> 4) & lo4) | (((t >> 6) & hi2) << 4)};
    set_scales(_mm_sub_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(sc)), _mm_set1_epi8(32)));
    const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * h)));
      for (int v = 0; v < 2; ++v) {  // j = 2 v (low 256 bits), 2 v + 1 (high)
        const int j0 = 2 * v, j1 = 2 * v + 1, b0 = 4 * h + j0, b1 = 4 * h + j1;
        const __m512i qs = _mm512_srlv_epi16(q, _mm512_inserti64x4(_mm512_set1_epi16(short(2 * j0)),
                                                                    _mm256_set1_epi16(short(2 * j1)), 1));
        // the third bit (bit b of hmask) to bit 2: right by b - 2, or left by 2 - b
        const __m512i r = _mm512_inserti64x4(_mm512_set1_epi16(short(b0 > 2 ? b0 - 2 : 0)),
                                             _mm256_set1_epi16(short(b1 > 2 ? b1 - 2 : 0)), 1);
        const __m512i l = _mm512_inserti64x4(_mm512_set1_epi16(short(b0 < 2 ? 2 - b0 : 0)),
                                             _mm256_set1_epi16(short(b1 < 2 ? 2 - b1 : 0)), 1);
        const __m512i third = _mm512_and_si512(_mm512_srlv_epi16(_mm512_sllv_epi16(hm, l), r), four);
        W[2 * h + v] = _mm512_or_si512(_mm512_and_si512(qs, three), third);
      }
    }
  }
};

// sums[m] for m < MR: one weight row dotted with activation rows row_of(0) .. row_of(MR - 1).
template <Type T, int MR, typename RowOf>
inline void rows_int8(const uint8_t* row, int64_t row_bytes, const Int8Activations& a, RowOf row_of, float* sums) {
  constexpr Geometry geo = kGeometry[int(T)];
  __m512 facc[MR];
  __m128 macc[MR];
  int64_t xrow[MR];
  for (int m = 0; m < MR; ++m) {
    xrow[m] = int64_t(row_of(m));
    facc[m] = _mm512_setzero_ps(), macc[m] = _mm_setzero_ps();
  }
  Int8Block<T> blk;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* p = row + b * geo.bytes;
    for (int l = 0; l < geo.bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + row_bytes + l), _MM_HINT_T0);
    blk.load(p);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const int64_t ab = xrow[m] * a.blocks + b;
      const int16_t* sums16 = kElementOrder<T> ? a.nsum16.data() + 16 * ab : a.sum32.data() + 8 * ab;
      blk.dot(a.q.data() + 256 * ab, sums16, a.d[ab], facc[m], macc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    const __m128 mv = macc[m];
    const __m128 h = _mm_add_ps(mv, _mm_movehl_ps(mv, mv));
    sums[m] = _mm512_reduce_add_ps(facc[m]) - _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
}

// sums[i] (i < n) = activation row rows[i] dotted with one weight row (the rows in passes of
// up to 4; the grouped-expert call, gguf_moe.h).
template <Type T>
inline void gathered_dots_int8(const uint8_t* row, const Int8Activations& a, const int32_t* rows, int64_t n,
                               float* sums) {
  const int64_t row_bytes = a.blocks * kGeometry[int(T)].bytes;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) rows_int8<T, 4>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i);
  switch (n - i) {
    case 3: rows_int8<T, 3>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    case 2: rows_int8<T, 2>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    case 1: rows_int8<T, 1>(row, row_bytes, a, [&](int r) { return rows[i + r]; }, sums + i); break;
    default: break;
  }
}

// y [M, N] = x [M, K] @ W.T with int8 activations; threads over output rows (guided), each
// weight row read once for all M activation rows, up to 4 of them per pass.
template <Type T>
void matmul_int8(const float* x, int64_t M, int64_t K, const uint8_t* data, int64_t row_bytes, int64_t N, float* y) {
  const Int8Activations a(x, M, K, !kElementOrder<T>);
#pragma omp parallel for schedule(guided, kMinChunkRows)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = data + n * row_bytes;
    int64_t m0 = 0;
    float sums[4];
    auto put = [&](int rows) {
      for (int m = 0; m < rows; ++m) y[(m0 + m) * N + n] = sums[m];
    };
    for (; m0 + 4 <= M; m0 += 4) rows_int8<T, 4>(row, row_bytes, a, [m0](int m) { return m0 + m; }, sums), put(4);
    switch (M - m0) {
      case 3: rows_int8<T, 3>(row, row_bytes, a, [m0](int m) { return m0 + m; }, sums), put(3); break;
      case 2: rows_int8<T, 2>(row, row_bytes, a, [m0](int m) { return m0 + m; }, sums), put(2); break;
      case 1: rows_int8<T, 1>(row, row_bytes, a, [m0](int m) { return m0 + m; }, sums), put(1); break;
      default: break;
    }
  }
}

}  // namespace pagedllm::gguf

#else  // no AVX-512 VNNI: no int8 path

namespace pagedllm::gguf {
template <Type T>
constexpr bool has_int8_dot() {
  return false;
}
template <Type T>
void matmul_int8(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*) {}
struct Int8Activations {
  Int8Activations(const float*, int64_t, int64_t, bool) {}
};
template <Type T>
inline void gathered_dots_int8(const uint8_t*, const Int8Activations&, const int32_t*, int64_t, float*) {}
}  // namespace pagedllm::gguf
#endif
