// Bindings of the fused layer ops (layer_ops.h) for Python.
#include <torch/extension.h>

#include "layer_ops.h"

using namespace pagedllm;

namespace {

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, hidden] with unit stride on hidden");
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, double offset) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [hidden] in x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), out.stride(0), x.size(0), x.size(1),
                            static_cast<float>(eps), static_cast<float>(offset));
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

// out[t] = T(act(gate[t])) * up[t] with gate, up the halves of x[t] (layer_ops.h's
// gated_mul_rows): silu_and_mul, gelu_tanh_and_mul.
template <Gate A>
torch::Tensor gated_and_mul(const torch::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  auto out = torch::empty({rows, inter}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  if (x.scalar_type() == torch::kFloat32) {  // vectorised exp (float32 only: bf16 rounds like torch)
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
      gated_mul_rows_avx2<A>(xp + begin * stride, stride, op + begin * inter, end - begin, inter);
    });
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gated_and_mul", [&] {
    gated_mul_rows<scalar_t, A>(x.data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// router logits [rows, E] float32 -> (expert ids int64 [rows, top_k], weights float32 [rows,
// top_k]): route_row of each row.
std::vector<torch::Tensor> moe_route(const torch::Tensor& logits, int64_t top_k, bool renorm, bool softmax_selected) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32, "router logits must be float32");
  const int64_t rows = logits.size(0), E = logits.size(1), ld = logits.stride(0);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be in [1, ", E, "], got ", top_k);
  auto ids = torch::empty({rows, top_k}, logits.options().dtype(torch::kInt64));
  auto w = torch::empty({rows, top_k}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) route_row(lp + r * ld, E, top_k, renorm, ip + r * top_k, wp + r * top_k, softmax_selected);
  });
  return {ids, w};
}

// logits [rows, V] float32 -> int64 [rows]: argmax_row of each row.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.size(1) > 0, "x must be float32 with at least one column");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * ld, n);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over rows, scaled by weight + offset (Gemma: offset 1)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("offset") = 0.0);
  m.def("add_rms_norm", &add_rms_norm, "residual add then RMSNorm: returns (normed, sum)");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half rotary embedding of q and k: returns (q, k)");
  m.def("silu_and_mul", &gated_and_mul<Gate::kSilu>, "silu(gate) * up over [gate | up] rows");
  m.def("gelu_tanh_and_mul", &gated_and_mul<Gate::kGeluTanh>, "gelu_tanh(gate) * up over [gate | up] rows");
  m.def("moe_route", &moe_route, "(router logits float32 [rows, E], top_k, renorm, softmax_selected) -> (ids, weights): "
        "softmax, top-k, optional renormalisation; softmax_selected: top-k logits, softmax over them (gpt-oss)");
  m.def("argmax_rows", &argmax_rows, "each float32 row's argmax (torch.argmax's ties and NaN)");
}
