#pragma once
// Decode attention straight from the paged KV cache: no gather into a dense copy.
//
// For each (request, kv head) pair, in parallel: the query heads of that group score every
// cached position, reached through the request's block table, then a softmax and a weighted
// sum of V. Scores and sums are float32 whatever the cache dtype. A soft-cap c > 0 bounds
// each score s (after scaling) to c * tanh(s / c) before the softmax (Gemma 2); c = 0 is none.
// An 8-bit cache (kv_codes.h: codes then a float32 scale per row) is widened as it is read;
// each row's scale multiplies its score (q . k = scale * q . codes) and its softmax weight
// (sum_i p_i v_i = sum_i (p_i * scale_i) codes_i), so the inner loops see codes only.
//
// Vector paths (float32 and coded caches, head_dim a multiple of 8): AVX-512F (16 lanes) where
// the build has it and head_dim % 16 == 0, else AVX2 (8 lanes), one template over both. Pass 1
// scores eight keys at a time, each key slice widened once for up to 3 (AVX-512) query heads;
// pass 2 walks the V rows once per slice of up to 4 vectors for up to 3 (AVX2) or 4 heads, so
// a V row is read about once, not G times; the softmax leaves exp(s - max) and its 1/sum
// scales the sums. Both passes prefetch the rows kPrefetchRows positions ahead (a head's rows
// are Hkv rows apart, in blocks scattered over the pool: the hardware prefetchers miss them).
// Each output is computed by one thread in a fixed order: results do not depend on the thread
// count.
#include <cstdint>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_codes.h"
#include "vec_avx2.h"

namespace pagedllm {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Where token t of request b sits, in token rows of the cache (paged: through the block
// table; contiguous: the request's slot times the slot capacity, plus t).
struct PagedRows {
  const int64_t* block_tables;  // [B, max_blocks]
  int64_t max_blocks, bs;
  inline int64_t operator()(int64_t b, int64_t t) const {
    return block_tables[b * max_blocks + t / bs] * bs + t % bs;
  }
  // f(t, row) for t in [t0, t1), a block at a time (one table read and no division per token).
  template <typename F>
  inline void each(int64_t b, int64_t t0, int64_t t1, F&& f) const {
    for (int64_t t = t0; t < t1;) {
      const int64_t first = t - t % bs;  // the block's first token
      const int64_t shift = block_tables[b * max_blocks + t / bs] * bs - first;  // row = t + shift
      const int64_t end = std::min(t1, first + bs);
      for (; t < end; ++t) f(t, t + shift);
    }
  }
};

struct SlotRows {
  const int64_t* slots;  // [B]
  int64_t capacity;
  inline int64_t operator()(int64_t b, int64_t t) const { return slots[b] * capacity + t; }
  template <typename F>
  inline void each(int64_t b, int64_t t0, int64_t t1, F&& f) const {
    for (int64_t t = t0; t < t1; ++t) f(t, slots[b] * capacity + t);
  }
};

#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_AVX2 1
#include <immintrin.h>

// The sums of eight vectors' lanes, as one vector: [sum(a0), ..., sum(a7)].
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                    __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lines of a row (bytes long, any alignment) into L1 ahead of use: the rows of one head are
// Hkv rows apart and the blocks scattered, beyond what the hardware prefetchers follow.
inline void prefetch_row(const void* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes) - 1;
  for (uintptr_t a = first; a <= last; a += 64) _mm_prefetch(reinterpret_cast<const char*>(a), _MM_HINT_T0);
}
constexpr int64_t kPrefetchRows = 16;  // how many positions ahead the passes prefetch

// The vector width the score and weighted-sum passes are written over: eight lanes (AVX2) or
// sixteen (AVX-512F). V: the register; load widens W elements of a row (float or codes).
struct Vec256 {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kScoreHeads = 1;  // 8 key accumulators per head + q + k: 16 ymm
  static constexpr int kSumHeads = 3;    // 3 heads x 4 accumulators + 3 weights + v: 16 ymm
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  template <typename KV>
  static V load(const KV* p) { return load8(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) { return hsum(v); }
  static __m256 sums8(const V* a) { return hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]); }
};

#ifdef __AVX512F__
#define PAGEDLLM_AVX512 1
struct Vec512 {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kScoreHeads = 3;  // 3 heads x 8 key accumulators + 3 q + k: 28 zmm
  static constexpr int kSumHeads = 4;    // 4 heads x 4 accumulators + 4 weights + v: 21 zmm
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  template <typename KV>
  static V load(const KV* p) { return load16(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static __m256 fold(V a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  static __m256 sums8(const V* a) {
    return hsum8(fold(a[0]), fold(a[1]), fold(a[2]), fold(a[3]), fold(a[4]), fold(a[5]), fold(a[6]), fold(a[7]));
  }
};
#endif

// s[g * n] for the NG heads at qf (qf_g = qf + g * D) against the eight keys k[0..8): each
// key's W-lane slice is widened once and feeds every head; eight independent FMA chains per
// head hide the FMA latency, one transpose-add per eight scores.
// Coded keys: times the rows' scales ks (for float keys ks is unused).
template <class VT, int NG, typename KV>
inline void scores8(const float* qf, const KV* const* k, int64_t D, int64_t n, __m256 ks, float* s) {
  using V = typename VT::V;
  V a[NG][8];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 8; ++j) a[g][j] = VT::zero();
  for (int64_t d = 0; d < D; d += VT::W) {
    V qv[NG];
    for (int g = 0; g < NG; ++g) qv[g] = VT::loadf(qf + g * D + d);
    for (int j = 0; j < 8; ++j) {
      const V x = VT::load(k[j] + d);
      for (int g = 0; g < NG; ++g) a[g][j] = VT::fma(qv[g], x, a[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    __m256 r = VT::sums8(a[g]);
    if constexpr (kv_is_code<KV>) r = _mm256_mul_ps(r, ks);
    _mm256_storeu_ps(s + g * n, r);
  }
}

// scores[g * n + i] = qf_g . k_i for every query head g of the group (D a multiple of W), the
// heads in groups of up to VT::kScoreHeads; row_bytes: one K row's bytes (prefetched ahead).
// KV: float, or a code type of kv_codes.h (each score times its row's scale).
template <class VT, typename KV>
inline void scores_simd(const float* qf, const KV* const* kps, int64_t n, int64_t G, int64_t D, int64_t row_bytes,
                        float* scores) {
  constexpr int NGM = VT::kScoreHeads;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int64_t j = i + kPrefetchRows; j < std::min(n, i + kPrefetchRows + 8); ++j) prefetch_row(kps[j], row_bytes);
    __m256 ks = _mm256_set1_ps(1.f);
    if constexpr (kv_is_code<KV>) {
      alignas(32) float sc[8];
      for (int j = 0; j < 8; ++j) sc[j] = kv_row_scale(kps[i + j], D);
      ks = _mm256_load_ps(sc);
    }
    for (int64_t g0 = 0; g0 < G; g0 += NGM) {
      const float* qg = qf + g0 * D;
      float* sg = scores + g0 * n + i;
      switch (std::min<int64_t>(NGM, G - g0)) {
        case 1: scores8<VT, 1>(qg, kps + i, D, n, ks, sg); break;
        case 2: if constexpr (NGM >= 2) scores8<VT, std::min(NGM, 2)>(qg, kps + i, D, n, ks, sg); break;
        default: if constexpr (NGM >= 3) scores8<VT, std::min(NGM, 3)>(qg, kps + i, D, n, ks, sg); break;
      }
    }
  }
  for (; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) {
      typename VT::V a = VT::zero();
      for (int64_t d = 0; d < D; d += VT::W) a = VT::fma(VT::loadf(qf + g * D + d), VT::load(kps[i] + d), a);
      scores[g * n + i] = VT::sum(a) * kv_row_scale(kps[i], D);
    }
}

// out_g[d0, d0 + NC * W) = inv_g * sum_i p[g * n + i] * v_i[d0, ..) for the NG heads at p /
// inv / out (out_g = out + g * D; coded rows: p times the row's scale, then the codes): one
// pass over the positions, each V slice widened once for all NG heads, NG * NC accumulators
// in registers. prefetch_bytes > 0: prefetch the rows ahead.
template <class VT, int NC, int NG, typename KV>
inline void weighted_sum_heads(const float* p, const KV* const* vps, int64_t n, int64_t d0, int64_t D,
                               int64_t prefetch_bytes, const float* inv, float* out) {
  using V = typename VT::V;
  V a[NG][NC];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = VT::zero();
  for (int64_t i = 0; i < n; ++i) {
    if (prefetch_bytes > 0 && i + kPrefetchRows < n) prefetch_row(vps[i + kPrefetchRows], prefetch_bytes);
    const float w = kv_row_scale(vps[i], D);  // 1 for float rows
    V pv[NG];
    for (int g = 0; g < NG; ++g) pv[g] = VT::set1(kv_is_code<KV> ? p[g * n + i] * w : p[g * n + i]);
    const KV* v = vps[i] + d0;
    for (int c = 0; c < NC; ++c) {
      const V x = VT::load(v + c * VT::W);
      for (int g = 0; g < NG; ++g) a[g][c] = VT::fma(pv[g], x, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < NC; ++c) VT::store(out + g * D + d0 + c * VT::W, VT::mul(a[g][c], VT::set1(inv[g])));
}

template <class VT, int NC, typename KV>
inline void weighted_sum_slice(const float* p, const KV* const* vps, int64_t n, int64_t G, int64_t d0, int64_t D,
                               int64_t row_bytes, const float* inv, float* out) {
  constexpr int NGM = VT::kSumHeads;
  for (int64_t g0 = 0; g0 < G; g0 += NGM) {
    const int64_t pf = d0 == 0 && g0 == 0 ? row_bytes : 0;  // the first pass over the rows prefetches
    const float* pg = p + g0 * n;
    const float* ig = inv + g0;
    float* og = out + g0 * D;
    switch (std::min<int64_t>(NGM, G - g0)) {
      case 1: weighted_sum_heads<VT, NC, 1>(pg, vps, n, d0, D, pf, ig, og); break;
      case 2: weighted_sum_heads<VT, NC, 2>(pg, vps, n, d0, D, pf, ig, og); break;
      case 3: weighted_sum_heads<VT, NC, 3>(pg, vps, n, d0, D, pf, ig, og); break;
      default: if constexpr (NGM >= 4) weighted_sum_heads<VT, NC, std::min(NGM, 4)>(pg, vps, n, d0, D, pf, ig, og); break;
    }
  }
}

// out[g * D + d] = inv[g] * sum_i p[g * n + i] * v_i[d] for every head of the group (D a multiple of W):
// D in slices of up to 4 vectors, each slice one pass over the positions per group of heads.
template <class VT, typename KV>
inline void weighted_sum_simd(const float* p, const KV* const* vps, int64_t n, int64_t G, int64_t D,
                              int64_t row_bytes, const float* inv, float* out) {
  const int64_t nv = D / VT::W;
  const int64_t nc = nv % 4 == 0 ? 4 : nv % 2 == 0 ? 2 : 1;
  for (int64_t d0 = 0; d0 < D; d0 += nc * VT::W) {
    switch (nc) {
      case 4: weighted_sum_slice<VT, 4>(p, vps, n, G, d0, D, row_bytes, inv, out); break;
      case 2: weighted_sum_slice<VT, 2>(p, vps, n, G, d0, D, row_bytes, inv, out); break;
      default: weighted_sum_slice<VT, 1>(p, vps, n, G, d0, D, row_bytes, inv, out); break;
    }
  }
}

// s[0, n) = exp(s - max s), eight lanes at a time (vec_avx2.h's exp_avx2, ~2 ulp); returns
// 1 / their sum (the weighted sums scale their result by it: no normalising pass). A finite
// `sink` is one more logit with no value row (attention sinks): in the max and the sum only.
inline float exp_shifted_avx2(float* s, int64_t n, float sink = -std::numeric_limits<float>::infinity()) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; i < n; ++i) m = std::max(m, s[i]);
  m = std::max(m, sink);
  const __m256 mb = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), mb));
    _mm256_storeu_ps(s + i, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  if (sink > -std::numeric_limits<float>::infinity()) sum += std::exp(sink - m);
  return sum > 0.f ? 1.f / sum : 0.f;  // n = 0: no positions, a zero output
}

// One (request, kv head) on the vector path: out[g * D + d] for the G query heads at qf,
// through scores (G * n floats of scratch) and inv (G). False (nothing done) where there is
// no vector path: a bf16 cache, or D not a multiple of 8. The widest path for D: sixteen
// lanes where AVX-512F is built in and D % 16 == 0, else eight.
template <typename KV>
inline bool attend_simd(const float* qf, const KV* const* kps, const KV* const* vps, int64_t n, int64_t G,
                        int64_t D, int64_t row_bytes, float softcap, float* scores, float* inv, float* out,
                        const float* sinks = nullptr) {
  if constexpr (!std::is_same_v<KV, float> && !kv_is_code<KV>) {
    return false;
  } else {
    if (D % 8 != 0) return false;
#ifdef PAGEDLLM_AVX512
    const bool wide = D % 16 == 0;
#else
    constexpr bool wide = false;
#endif
    // Pass 1: scores[g, i] = q_g . k_i (times the row's scale)
#ifdef PAGEDLLM_AVX512
    if (wide) scores_simd<Vec512>(qf, kps, n, G, D, row_bytes, scores);
#endif
    if (!wide) scores_simd<Vec256>(qf, kps, n, G, D, row_bytes, scores);
    if (softcap > 0.f)
      for (int64_t i = 0; i < G * n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
    for (int64_t g = 0; g < G; ++g)
      inv[g] = sinks ? exp_shifted_avx2(scores + g * n, n, sinks[g]) : exp_shifted_avx2(scores + g * n, n);
    // Pass 2: out_g = inv_g * sum_i e[g, i] * v_i
#ifdef PAGEDLLM_AVX512
    if (wide) weighted_sum_simd<Vec512>(scores, vps, n, G, D, row_bytes, inv, out);
#endif
    if (!wide) weighted_sum_simd<Vec256>(scores, vps, n, G, D, row_bytes, inv, out);
    return true;
  }
}
#endif

// The same without vectors (any D, any cache element): scores, soft-cap, softmax (with each
// query head's sink logit where `sinks` [G]), then the weighted sum, into out[g * D + d].
template <typename KV>
inline void attend_scalar(const float* qf, const KV* const* kps, const KV* const* vps, int64_t n, int64_t G,
                          int64_t D, float softcap, float* scores, float* out, const float* sinks = nullptr) {
  for (int64_t i = 0; i < n; ++i) {
    const KV* kp = kps[i];
    const float ks = kv_row_scale(kp, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(kp[d]);
      scores[g * n + i] = s * ks;
    }
  }
  if (softcap > 0.f)
    for (int64_t i = 0; i < G * n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
    if (sinks) m = std::max(m, sinks[g]);
    float sum = sinks ? std::exp(sinks[g] - m) : 0.f;
    for (int64_t i = 0; i < n; ++i) {
      sg[i] = std::exp(sg[i] - m);
      sum += sg[i];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
  }
  std::fill(out, out + G * D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const KV* vp = vps[i];
    const float vs = kv_row_scale(vp, D);  // coded rows: p * scale times the codes
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + i] * vs;
      float* ag = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vp[d]);
    }
  }
}

// KV: the cache's element, T itself (float or bf16) or a code type of kv_codes.h (rows of
// D codes and a scale: [num_rows, Hkv, D + 4]).
template <typename T, typename Rows, typename KV = T>
void decode_kernel(const T* q,            // [B, Hq, D]
                   const KV* k_cache,     // [num_rows, Hkv, D]
                   const KV* v_cache,     // [num_rows, Hkv, D]
                   Rows rows,
                   const int64_t* seq_lens,      // [B]
                   T* out,                // [B, Hq, D]
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                   float scale, int64_t window, float softcap,
                   const float* sinks = nullptr) {  // [Hq] float32 logits (attention sinks), or none
  const int64_t G = Hq / Hkv;
  const int64_t row = kv_row_width<KV>(D);
  const int64_t token_stride = Hkv * row;  // between consecutive slots
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(KV));  // one (token, head) row, scale included
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> qf(G * D);
    std::vector<float> acc(G * D);
    std::vector<float> inv(G);
    std::vector<const KV*> kps, vps;  // each position's K and V row of this kv head
#pragma omp for schedule(dynamic, 1)
    for (int64_t work = 0; work < B * Hkv; ++work) {
      const int64_t b = work / Hkv, h = work % Hkv;
      const int64_t len = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      scores.resize(G * n);
      kps.resize(n);
      vps.resize(n);
      rows.each(b, start, len, [&](int64_t t, int64_t r) {
        const int64_t slot = r * token_stride + h * row;
        kps[t - start] = k_cache + slot;
        vps[t - start] = v_cache + slot;
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(q[(b * Hq + h * G + g) * D + d]) * scale;
      bool done = false;
      const float* head_sinks = sinks ? sinks + h * G : nullptr;  // this kv head's G query heads
#ifdef PAGEDLLM_AVX2
      done = attend_simd(qf.data(), kps.data(), vps.data(), n, G, D, row_bytes, softcap, scores.data(), inv.data(),
                         acc.data(), head_sinks);
#endif
      if (!done)
        attend_scalar(qf.data(), kps.data(), vps.data(), n, G, D, softcap, scores.data(), acc.data(), head_sinks);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  }
}

}  // namespace pagedllm
