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

namespace pagedllm {

// Rows of work per parallel task: below this a row costs less than waking a thread.
constexpr int64_t kGrainRows = 16;

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// out[t] = weight * T(x[t] * rsqrt(mean(x[t]^2) + eps)), x[t] taken as sum[t] when fused.
template <typename T>
void rms_norm_rows(const T* in, int64_t in_stride, const T* weight, T* out, int64_t out_stride,
                   int64_t rows, int64_t hidden, float eps) {
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
        y[i] = static_cast<T>(static_cast<float>(weight[i]) * normed);
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

template <typename T>
void silu_mul_rows(const T* in, int64_t in_stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = in + t * in_stride;
      const T* up = gate + inter;
      T* y = out + t * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float silu = round_to<T>(g / (1.f + std::exp(-g)));
        y[i] = static_cast<T>(silu * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace pagedllm
