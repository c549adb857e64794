#pragma once
// Fused elementwise layer ops for the CPU: RMSNorm (optionally with the residual add before
// it), rotary embedding (rotate-half layout) and silu(gate) * up.
//
// At decode the torch formulations of these ops are a chain of small kernels (RMSNorm alone
// is add, cast, pow, mean, add, rsqrt, mul, cast, mul) whose dispatch costs far more than the
// arithmetic on one 576-wide row; here each is one call. The results round to the tensor
// dtype at the same points as the torch formulations (pagedllm/layers/norm.py, rotary.py,
// activation.py) so bfloat16 agrees with them; only the summation order of the RMS mean and
// fused multiply-adds differ (float32 rounding level).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "vec_avx2.h"

namespace pagedllm {

// Rows of work per parallel task: below this a row costs less than waking a thread.
constexpr int64_t kGrainRows = 16;

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// out[t] = (weight + offset) * T(x[t] * rsqrt(mean(x[t]^2) + eps)), x[t] taken as sum[t] when
// fused; offset 1 is Gemma's (1 + weight) scale (float32 models: the sum rounds as torch's).
template <typename T>
void rms_norm_rows(const T* in, int64_t in_stride, const T* weight, T* out, int64_t out_stride,
                   int64_t rows, int64_t hidden, float eps, float offset = 0.f) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = in + t * in_stride;
      T* y = out + t * out_stride;
      float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = static_cast<float>(x[i]);
        sum_sq += v * v;
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        const float normed = round_to<T>(static_cast<float>(x[i]) * inv_rms);
        y[i] = static_cast<T>((static_cast<float>(weight[i]) + offset) * normed);
      }
    }
  });
}

// sum[t] = T(b[t] + a[t]), sum contiguous.
template <typename T>
void add_rows(const T* a, int64_t a_stride, const T* b, int64_t b_stride, T* sum, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = a + t * a_stride;
      const T* r = b + t * b_stride;
      T* s = sum + t * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) s[i] = static_cast<T>(static_cast<float>(r[i]) + static_cast<float>(x[i]));
    }
  });
}

// Rotate every head of x[t] (rows of heads * head_dim, any row stride) by position[t]:
// halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin rounded to T as torch's
// `cos_sin_cache.to(dtype)` does, each product and difference rounded to T.
template <typename T>
void rotate_rows(const T* in, int64_t in_stride, T* out, int64_t heads, int64_t head_dim, const int64_t* positions,
                 const float* cos_sin, int64_t rows) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * head_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = in + t * in_stride + h * head_dim;
        T* y = out + (t * heads + h) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_to<T>(cos[i]), s = round_to<T>(sin[i]);
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          y[i] = static_cast<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
          y[i + half] = static_cast<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
        }
      }
    }
  });
}

// The gated activations, act(gate) * up, each act as g * sigmoid(z): silu z = g; gelu's tanh
// form z = 2u, u = sqrt(2/pi) (g + 0.044715 g^3) (the same function as 0.5 g (1 + tanh(u)), one
// exp and no cancellation near tanh = -1).
enum class Gate { kSilu, kGeluTanh };
constexpr float kGeluTanhScale2 = 2.f * 0.7978845608028654f;
constexpr float kGeluTanhCubic = 0.044715f;

template <Gate A>
inline float gate_z(float g) {
  if constexpr (A == Gate::kSilu) return g;
  return kGeluTanhScale2 * (g + kGeluTanhCubic * g * g * g);
}

// out[t] = T(act(gate[t])) * up[t] with gate, up the halves of x[t], act rounded to T first as
// torch's F.silu(gate) * up does.
template <typename T, Gate A = Gate::kSilu>
void gated_mul_rows(const T* in, int64_t in_stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = in + t * in_stride;
      const T* up = gate + inter;
      T* y = out + t * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float act = round_to<T>(g / (1.f + std::exp(-gate_z<A>(g))));
        y[i] = static_cast<T>(act * static_cast<float>(up[i]));
      }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
template <Gate A>
inline __m256 gate_z_avx2(__m256 g) {
  if constexpr (A == Gate::kSilu) return g;
  const __m256 cubic = _mm256_mul_ps(_mm256_set1_ps(kGeluTanhCubic), g);
  return _mm256_mul_ps(_mm256_set1_ps(kGeluTanhScale2), _mm256_fmadd_ps(cubic, _mm256_mul_ps(g, g), g));
}

// float32 act(gate) * up, eight lanes at a time, on the calling thread: for the few rows of a
// decode step, where the scalar exp of gated_mul_rows dominates (1,536 exps per row).
template <Gate A = Gate::kSilu>
inline void gated_mul_rows_avx2(const float* in, int64_t in_stride, float* out, int64_t rows, int64_t inter) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  for (int64_t t = 0; t < rows; ++t) {
    const float* gate = in + t * in_stride;
    const float* up = gate + inter;
    float* y = out + t * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp_avx2(_mm256_xor_ps(gate_z_avx2<A>(g), sign));  // exp(-z)
      const __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, e));
      _mm256_storeu_ps(y + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
    }
    for (; i < inter; ++i) y[i] = gate[i] / (1.f + std::exp(-gate_z<A>(gate[i]))) * up[i];
  }
}
#endif

// A sparse MoE's routing of one row of router logits [E] (layers/moe.py's `route`, the module
// path and the fused decode both): softmax in float32 (exp of logit - max, summed in index
// order), the top_k probabilities in descending order (of equal ones the lower expert first),
// renormalised to sum to one when `renorm` (their sum in slot order).
// softmax_selected (gpt-oss): the top_k logits (the same order), then the softmax over those k
// alone (exp of logit - the first, summed in slot order); renorm is then moot.
inline void route_row(const float* logits, int64_t E, int64_t top_k, bool renorm, int64_t* ids, float* w,
                      bool softmax_selected = false) {
  if (softmax_selected) {
    for (int64_t s = 0; s < top_k; ++s) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t j = 0; j < s; ++j) taken |= ids[j] == e;
        if (!taken && (best < 0 || logits[e] > logits[best] || std::isnan(logits[e]))) best = e;
      }
      ids[s] = best;
      w[s] = logits[best];
    }
    const float m = w[0];
    float sum = 0.f;
    for (int64_t s = 0; s < top_k; ++s) sum += (w[s] = std::exp(w[s] - m));
    for (int64_t s = 0; s < top_k; ++s) w[s] /= sum;
    return;
  }
  float m = -INFINITY;
  for (int64_t e = 0; e < E; ++e) m = logits[e] > m ? logits[e] : m;
  thread_local std::vector<float> p;
  p.resize(E);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logits[e] - m));
  for (int64_t e = 0; e < E; ++e) p[e] /= sum;
  for (int64_t s = 0; s < top_k; ++s) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t j = 0; j < s; ++j) taken |= ids[j] == e;
      if (!taken && (best < 0 || p[e] > p[best] || std::isnan(p[e]))) best = e;
    }
    ids[s] = best;
    w[s] = p[best];
  }
  if (renorm) {
    float total = 0.f;
    for (int64_t s = 0; s < top_k; ++s) total += w[s];
    for (int64_t s = 0; s < top_k; ++s) w[s] /= total;
  }
}

// The index of each row's largest value, as torch.argmax: the first of equal maxima, and the
// first NaN where a row holds one (NaN counts as the largest). One thread per row: a decode
// step's rows of 49,152 logits take ~10 us each, torch's argmax ~90.
inline int64_t argmax_row(const float* x, int64_t n) {
  float best = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vmax = _mm256_max_ps(vmax, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) best = v > best ? v : best;
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    best = x[i] > best ? x[i] : best;
    nan = nan || std::isnan(x[i]);
  }
  for (int64_t j = 0; j < n; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == best) return j;
  return 0;  // n == 0 is refused by the caller
}

}  // namespace pagedllm
