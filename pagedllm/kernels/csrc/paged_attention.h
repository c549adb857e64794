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
};

struct SlotRows {
  const int64_t* slots;  // [B]
  int64_t capacity;
  inline int64_t operator()(int64_t b, int64_t t) const { return slots[b] * capacity + t; }
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

// scores[g * n + i] = qf_g . k(start + i) for every query head g of the group, eight keys at a
// time: eight independent FMA chains hide the FMA latency, one transpose-add per eight scores.
// KV: float, or a code type of kv_codes.h (load8 widens; the caller applies the row scales).
template <typename KV>
inline void scores_avx2(const float* qf, const KV* const* kps, int64_t n, int64_t G, int64_t D,
                        float* scores) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const KV* const* k = kps + i;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(qv, load8(k[0] + d), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k[1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k[2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k[3] + d), a3);
        a4 = _mm256_fmadd_ps(qv, load8(k[4] + d), a4);
        a5 = _mm256_fmadd_ps(qv, load8(k[5] + d), a5);
        a6 = _mm256_fmadd_ps(qv, load8(k[6] + d), a6);
        a7 = _mm256_fmadd_ps(qv, load8(k[7] + d), a7);
      }
      _mm256_storeu_ps(scores + g * n + i, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
    }
  }
  for (; i < n; ++i)
    for (int64_t g = 0; g < G; ++g) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), load8(kps[i] + d), a);
      scores[g * n + i] = hsum(a);
    }
}

// out_g = sum_i p[g, i] * v(start + i), D / 8 accumulators kept in registers (NC = D / 8).
template <int NC, typename KV>
inline void weighted_sum_avx2(const float* p, const KV* const* vps, int64_t n, float* out) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const __m256 pv = _mm256_set1_ps(p[i]);
    const KV* v = vps[i];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(pv, load8(v + 8 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// s[0, n) = softmax(s), exp eight lanes at a time (vec_avx2.h's exp_avx2, ~2 ulp).
inline void softmax_avx2(float* s, int64_t n) {
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; i < n; ++i) m = std::max(m, s[i]);
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
  const float inv = 1.f / sum;
  const __m256 invv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), invv));
  for (; i < n; ++i) s[i] *= inv;
}

template <typename KV>
inline bool weighted_sum_avx2_any(const float* p, const KV* const* vps, int64_t n, int64_t D, float* out) {
  switch (D) {
    case 32: weighted_sum_avx2<4>(p, vps, n, out); return true;
    case 64: weighted_sum_avx2<8>(p, vps, n, out); return true;
    case 128: weighted_sum_avx2<16>(p, vps, n, out); return true;
    case 256: weighted_sum_avx2<32>(p, vps, n, out); return true;
    default: return false;
  }
}
#endif

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
                   float scale, int64_t window, float softcap) {
  const int64_t G = Hq / Hkv;
  constexpr bool coded = kv_is_code<KV>;
  const int64_t row = kv_row_width<KV>(D);
  const int64_t token_stride = Hkv * row;  // between consecutive slots
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> qf(G * D);
    std::vector<float> acc(G * D);
    std::vector<const KV*> kps, vps;  // each position's K and V row of this kv head
    std::vector<float> k_scales, v_scales;  // coded rows: each position's K and V scale
#pragma omp for schedule(dynamic, 1)
    for (int64_t work = 0; work < B * Hkv; ++work) {
      const int64_t b = work / Hkv, h = work % Hkv;
      const int64_t len = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      scores.resize(G * n);
      kps.resize(n);
      vps.resize(n);
      for (int64_t t = start; t < len; ++t) {
        const int64_t slot = rows(b, t) * token_stride + h * row;
        kps[t - start] = k_cache + slot;
        vps[t - start] = v_cache + slot;
      }
      if constexpr (coded) {
        k_scales.resize(n);
        v_scales.resize(n);
        for (int64_t i = 0; i < n; ++i) {
          k_scales[i] = kv_row_scale(kps[i], D);
          v_scales[i] = kv_row_scale(vps[i], D);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(q[(b * Hq + h * G + g) * D + d]) * scale;
      // Pass 1: scores[g, i] = q_g . k_i
      bool done = false;
#ifdef PAGEDLLM_AVX2
      if constexpr (std::is_same_v<KV, float> || coded) {
        if (D % 8 == 0) {
          scores_avx2(qf.data(), kps.data(), n, G, D, scores.data());
          done = true;
        }
      }
#endif
      if (!done) {
        for (int64_t i = 0; i < n; ++i) {
          const KV* kp = kps[i];
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(kp[d]);
            scores[g * n + i] = s;
          }
        }
      }
      if constexpr (coded)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < n; ++i) scores[g * n + i] *= k_scales[i];
      if (softcap > 0.f)
        for (int64_t i = 0; i < G * n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
      // Softmax per query head.
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
#ifdef PAGEDLLM_AVX2
        softmax_avx2(sg, n);
#else
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
#endif
      }
      // Pass 2: out_g = sum_i p[g, i] * v_i (coded rows: p[g, i] * scale_i times the codes)
      if constexpr (coded)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < n; ++i) scores[g * n + i] *= v_scales[i];
      done = false;
#ifdef PAGEDLLM_AVX2
      if constexpr (std::is_same_v<KV, float> || coded) {
        done = true;
        for (int64_t g = 0; g < G && done; ++g)
          done = weighted_sum_avx2_any(scores.data() + g * n, vps.data(), n, D, acc.data() + g * D);
      }
#endif
      if (!done) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = 0; i < n; ++i) {
          const KV* vp = vps[i];
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * n + i];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vp[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  }
}

}  // namespace pagedllm
