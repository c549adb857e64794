// Bindings of the weight-only quantized linear kernels (quant_linear.h) for Python.
#include <torch/extension.h>

#include "quant_linear.h"
#include "quant_q8.h"
#include "quant_scales.h"

using namespace pagedllm;

namespace {

template <bool INT4>
void check_quant_linear_args(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                             const torch::Tensor& zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(1) == (INT4 ? K / 2 : K), "qweight shape");
  check_scales(scales, zeros, INT4, N, K / kGroup);
}

// x [M, K] float32 -> [M, N] through quant_matmul's choice of kernel by M (thresholds from
// quantization.py, the same ones the fused decode passes).
template <bool INT4>
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                           const torch::Tensor& zeros, int64_t int16_max_rows, int64_t tile_max_rows) {
  check_quant_linear_args<INT4>(x, qweight, scales, zeros);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  auto y = torch::empty({M, N}, x.options());
  with_scale_type(scales, [&](auto tag) {
    using S = decltype(tag);
    quant_matmul<INT4, S>(x.data_ptr<float>(), M, K, N, reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                          scale_ptr<S>(scales), INT4 ? scale_ptr<S>(zeros) : nullptr, y.data_ptr<float>(),
                          int16_max_rows, tile_max_rows);
  });
  return y;
}

// The int16-activation kernels this build holds: "avx2" always, "avx512" where
// quant_q16_avx512.h is compiled (quant_matmul_q16 then runs it).
std::vector<std::string> q16_variants() {
  std::vector<std::string> names{"avx2"};
  if (PAGEDLLM_Q16_AVX512) names.emplace_back("avx512");
  return names;
}

// x [M, K] -> [M, N] through one int16-activation kernel by name (q16_variants), any M.
template <bool INT4>
torch::Tensor quant_linear_q16(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                               const torch::Tensor& zeros, const std::string& variant) {
  check_quant_linear_args<INT4>(x, qweight, scales, zeros);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  with_scale_type(scales, [&](auto tag) {
    using S = decltype(tag);
    const S* sp = scale_ptr<S>(scales);
    const S* zp = INT4 ? scale_ptr<S>(zeros) : nullptr;
    if (variant == "avx2") {
      quant_matmul_q16_avx2<INT4, S>(xp, M, K, N, qp, sp, zp, y.data_ptr<float>());
#if PAGEDLLM_Q16_AVX512
    } else if (variant == "avx512") {
      quant_matmul_q16_avx512<INT4, S>(xp, M, K, N, qp, sp, zp, y.data_ptr<float>());
#endif
    } else {
      TORCH_CHECK(false, "no int16-activation kernel ", variant, " in this build");
    }
  });
  return y;
}

// op [T, K] float32 <- weight row row_of(t) dequantized, for t < T; threads from
// min_parallel rows up.
template <bool INT4, typename RowOf>
void dequantize_row_list(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& zeros,
                         int64_t T, int64_t K, RowOf row_of, int64_t min_parallel, float* op) {
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  with_scale_type(scales, [&](auto tag) {
    using S = decltype(tag);
    const S* sp = scale_ptr<S>(scales);
    const S* zp = INT4 ? scale_ptr<S>(zeros) : nullptr;
#pragma omp parallel for schedule(static) if (T >= min_parallel)
    for (int64_t t = 0; t < T; ++t) dequant_rows<INT4, S>(qp, sp, zp, K, row_of(t), 1, op + t * K);
  });
}

// Rows [row0, row0 + out.size(0)) of the dequantized weight into `out` (float32 [R, K]).
template <bool INT4>
void dequantize_rows(const torch::Tensor& qweight, const torch::Tensor& scales,
                     const torch::Tensor& zeros, int64_t row0, torch::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous(), "out: contiguous float32");
  const int64_t R = out.size(0), K = out.size(1);
  TORCH_CHECK(row0 >= 0 && row0 + R <= qweight.size(0), "rows out of range");
  check_scales(scales, zeros, INT4, qweight.size(0), K / kGroup);
  dequantize_row_list<INT4>(qweight, scales, zeros, R, K, [&](int64_t r) { return row0 + r; }, 1,
                            out.data_ptr<float>());
}

// Rows `ids` of the dequantized weight, float32 [T, K]: the quantized embedding lookup.
template <bool INT4>
torch::Tensor gather_rows(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& zeros,
                          const torch::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids must be int64 [T]");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be contiguous [N, K / 2 or K]");
  const int64_t N = qweight.size(0), K = INT4 ? 2 * qweight.size(1) : qweight.size(1), T = ids.size(0);
  check_scales(scales, zeros, INT4, N, K / kGroup);
  const auto idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "token id ", ip[t], " out of range [0, ", N, ")");
  auto out = torch::empty({T, K}, scales.options().dtype(torch::kFloat32));
  // A decode step looks up one row per request: threads only for a prefill's many.
  dequantize_row_list<INT4>(qweight, scales, zeros, T, K, [&](int64_t t) { return ip[t]; }, 64,
                            out.data_ptr<float>());
  return out;
}

torch::Tensor int4_gather_rows(torch::Tensor q, torch::Tensor s, torch::Tensor z, torch::Tensor ids) {
  return gather_rows<true>(q, s, z, ids);
}
torch::Tensor int8_gather_rows(torch::Tensor q, torch::Tensor s, torch::Tensor ids) {
  return gather_rows<false>(q, s, s, ids);
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor z, int64_t int16_max_rows,
                          int64_t tile_max_rows) {
  return quant_linear<true>(x, q, s, z, int16_max_rows, tile_max_rows);
}
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, int64_t int16_max_rows,
                          int64_t tile_max_rows) {
  return quant_linear<false>(x, q, s, s, int16_max_rows, tile_max_rows);
}
void int4_dequantize_rows(torch::Tensor q, torch::Tensor s, torch::Tensor z, int64_t row0, torch::Tensor out) {
  dequantize_rows<true>(q, s, z, row0, out);
}
void int8_dequantize_rows(torch::Tensor q, torch::Tensor s, int64_t row0, torch::Tensor out) {
  dequantize_rows<false>(q, s, s, row0, out);
}

torch::Tensor int4_linear_q16(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor z,
                              std::string variant) {
  return quant_linear_q16<true>(x, q, s, z, variant);
}
torch::Tensor int8_linear_q16(torch::Tensor x, torch::Tensor q, torch::Tensor s, std::string variant) {
  return quant_linear_q16<false>(x, q, s, s, variant);
}

// x [M, K] float32 -> [M, N] with x rounded to int8 per group of 32 (quant_q8.h): prefill.
template <bool INT4>
torch::Tensor quant_linear_q8(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                              const torch::Tensor& zeros) {
  check_quant_linear_args<INT4>(x, qweight, scales, zeros);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  auto y = torch::empty({M, N}, x.options());
  with_scale_type(scales, [&](auto tag) {
    using S = decltype(tag);
    quant_matmul_q8<INT4, S>(x.data_ptr<float>(), M, K, N, reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                             scale_ptr<S>(scales), INT4 ? scale_ptr<S>(zeros) : nullptr, y.data_ptr<float>());
  });
  return y;
}

torch::Tensor int4_linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor z) {
  return quant_linear_q8<true>(x, q, s, z);
}
torch::Tensor int8_linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor s) {
  return quant_linear_q8<false>(x, q, s, s);
}

// x [M, K] float32 -> (xq int8 [M, K], dx float32 [M, K / 32], xs float32 [M, K / 32]): the
// int8 activations quant_linear_q8 multiplies with (exposed for tests).
std::vector<torch::Tensor> quantize_activations_int8(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) % kGroup == 0,
              "x must be a contiguous float32 [M, K] tensor with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, K / kGroup}, x.options());
  auto xs = torch::empty({M, K / kGroup}, x.options());
  quantize_activations_q8(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), dx.data_ptr<float>(),
                          xs.data_ptr<float>());
  return {xq, dx, xs};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear,
        "x [M, K] @ dequant(int4 weight [N, K]).T -> [M, N], the kernel picked by M (int16_max_rows, tile_max_rows)");
  m.def("int8_linear", &int8_linear,
        "x [M, K] @ dequant(int8 weight [N, K]).T -> [M, N], the kernel picked by M (int16_max_rows, tile_max_rows)");
  m.def("q16_variants", &q16_variants, "the int16-activation kernels compiled in (the last one is quant_matmul's)");
  m.def("int4_linear_q16", &int4_linear_q16, "x @ dequant(int4 weight).T with int16 activations, by kernel name");
  m.def("int8_linear_q16", &int8_linear_q16, "x @ dequant(int8 weight).T with int16 activations, by kernel name");
  m.def("int4_linear_q8", &int4_linear_q8, "x [M, K] @ dequant(int4 weight [N, K]).T with int8 activations");
  m.def("int8_linear_q8", &int8_linear_q8, "x [M, K] @ dequant(int8 weight [N, K]).T with int8 activations");
  m.def("quantize_activations_int8", &quantize_activations_int8, "x -> (int8 x, scales, exact sums) per group of 32");
  m.def("int4_dequantize_rows", &int4_dequantize_rows, "rows of the int4 weight as float32");
  m.def("int8_dequantize_rows", &int8_dequantize_rows, "rows of the int8 weight as float32");
  m.def("int4_gather_rows", &int4_gather_rows, "rows ids of the int4 weight as float32 [T, K] (embedding lookup)");
  m.def("int8_gather_rows", &int8_gather_rows, "rows ids of the int8 weight as float32 [T, K] (embedding lookup)");
}
