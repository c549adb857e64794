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
#include <torch/extension.h>

#include <cmath>

namespace {

// Rows of work per parallel task: below this a row costs less than waking a thread.
constexpr int64_t kGrainRows = 16;

template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, hidden] with unit stride on hidden");
}

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

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), out.stride(0), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

// (normed, sum) with sum = T(residual + x): the residual add fused into the norm after it.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must match in shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto sum = torch::empty({rows, hidden}, x.options());
  auto out = torch::empty({rows, hidden}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* sp = sum.data_ptr<scalar_t>();
    add_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(), residual.stride(0), sp,
                       rows, hidden);
    rms_norm_rows<scalar_t>(sp, hidden, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), hidden, rows,
                            hidden, static_cast<float>(eps));
  });
  return {out, sum};
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

std::vector<torch::Tensor> rotary_embedding(const torch::Tensor& positions, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& cos_sin_cache) {
  check_rows(q, "q");
  check_rows(k, "k");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() && positions.numel() == q.size(0),
              "positions must be [tokens] int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == torch::kFloat32 && cos_sin_cache.is_contiguous() && cos_sin_cache.dim() == 2,
              "cos_sin_cache must be [max_position, head_dim] float32");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.size(0) == k.size(0), "q and k must match in tokens and dtype");
  const int64_t head_dim = cos_sin_cache.size(1), rows = q.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0,
              "q and k widths must be multiples of head_dim");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_position = cos_sin_cache.size(0);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " outside the rotary cache (",
                max_position, " positions)");
  }
  auto q_out = torch::empty({rows, q.size(1)}, q.options());
  auto k_out = torch::empty({rows, k.size(1)}, k.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rotary_embedding", [&] {
    const float* cs = cos_sin_cache.data_ptr<float>();
    rotate_rows<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q_out.data_ptr<scalar_t>(), q.size(1) / head_dim,
                          head_dim, pos, cs, rows);
    rotate_rows<scalar_t>(k.data_ptr<scalar_t>(), k.stride(0), k_out.data_ptr<scalar_t>(), k.size(1) / head_dim,
                          head_dim, pos, cs, rows);
  });
  return {q_out, k_out};
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

// out[t] = T(silu(gate[t])) * up[t] with gate, up the halves of x[t], silu rounded to T first
// as torch's F.silu(gate) * up does.
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over rows");
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm: returns (normed, sum)");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half rotary embedding of q and k: returns (q, k)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over [gate | up] rows");
}
