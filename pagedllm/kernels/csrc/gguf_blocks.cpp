// Bindings of the GGUF block kernels (gguf_matmul.h) for Python: a weight is `data`, uint8
// [N, row bytes] (contiguous rows of one kept type's blocks, as the file stores them), its
// type as an index into type_names(), and K.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "gguf_matmul.h"

using namespace pagedllm::gguf;

namespace {

std::vector<std::string> type_names() { return {std::begin(kTypeNames), std::end(kTypeNames)}; }

Type check_weight(const torch::Tensor& data, int64_t type, int64_t K) {
  TORCH_CHECK(type >= 0 && type < int64_t(Type::kCount), "unknown GGUF type index ", type);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == torch::kUInt8 && data.dim() == 2 && data.is_contiguous(),
              "data must be a contiguous CPU uint8 [N, row bytes] tensor");
  const Geometry g = kGeometry[type];
  TORCH_CHECK(K > 0 && K % g.elems == 0 && data.size(1) == K / g.elems * g.bytes, kTypeNames[type],
              " rows of K = ", K, " elements do not take ", data.size(1), " bytes");
  return Type(type);
}

// Rows [start, start + buf.size(0)) of the weight as float32 into buf [R, K].
void dequantize_rows(const torch::Tensor& data, int64_t type, int64_t start, torch::Tensor buf) {
  TORCH_CHECK(buf.scalar_type() == torch::kFloat32 && buf.dim() == 2 && buf.is_contiguous(),
              "buf must be a contiguous float32 [rows, K] tensor");
  const int64_t K = buf.size(1), R = buf.size(0);
  const Type t = check_weight(data, type, K);
  TORCH_CHECK(start >= 0 && start + R <= data.size(0), "rows [", start, ", ", start + R, ") out of [0, ",
              data.size(0), ")");
  const uint8_t* d = data.data_ptr<uint8_t>();
  with_type(t, [&](auto tag) {
    decode_rows<decltype(tag)::value>(d, data.size(1), K, R, [&](int64_t r) { return start + r; }, 1,
                                      buf.data_ptr<float>());
  });
}

// Rows [start, start + buf.size(0)) of the weight as bfloat16 into buf [R, K] (a prefill's
// bf16 panel: the weight is never copied whole).
void dequantize_rows_bf16(const torch::Tensor& data, int64_t type, int64_t start, torch::Tensor buf) {
  TORCH_CHECK(buf.scalar_type() == torch::kBFloat16 && buf.dim() == 2 && buf.is_contiguous(),
              "buf must be a contiguous bfloat16 [rows, K] tensor");
  const int64_t K = buf.size(1), R = buf.size(0);
  const Type t = check_weight(data, type, K);
  TORCH_CHECK(start >= 0 && start + R <= data.size(0), "rows [", start, ", ", start + R, ") out of [0, ",
              data.size(0), ")");
  with_type(t, [&](auto tag) {
    decode_rows_bf16<decltype(tag)::value>(data.data_ptr<uint8_t>(), data.size(1), K, start, R,
                                           reinterpret_cast<uint16_t*>(buf.data_ptr<at::BFloat16>()));
  });
}

// Rows `ids` of the weight as float32 [T, K] (the embedding lookup).
torch::Tensor gather_rows(const torch::Tensor& data, int64_t type, const torch::Tensor& ids) {
  TORCH_CHECK(type >= 0 && type < int64_t(Type::kCount) && data.dim() == 2, "unknown GGUF type index ", type);
  const int64_t K = data.size(1) / kGeometry[type].bytes * kGeometry[type].elems;
  const Type t = check_weight(data, type, K);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids must be int64 [T]");
  const auto idc = ids.contiguous();
  const int64_t* ip = idc.data_ptr<int64_t>();
  const int64_t T = ids.size(0), N = data.size(0);
  for (int64_t i = 0; i < T; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "id ", ip[i], " out of range [0, ", N, ")");
  auto out = torch::empty({T, K}, torch::dtype(torch::kFloat32));
  const uint8_t* d = data.data_ptr<uint8_t>();
  // A decode step looks up one row per request: threads only for a prefill's many.
  with_type(t, [&](auto tag) {
    decode_rows<decltype(tag)::value>(d, data.size(1), K, T, [&](int64_t i) { return ip[i]; }, 64,
                                      out.data_ptr<float>());
  });
  return out;
}

// x [M, K] float32 -> [M, N] by the small-M kernel; `path` "" (the build's choice for the
// type), "int16" or "float" (tests run both).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& data, int64_t type, const std::string& path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = data.size(0);
  const Type t = check_weight(data, type, K);
  auto y = torch::empty({M, N}, x.options());
  bool ok = true;
  with_type(t, [&](auto tag) {
    ok = matmul_small<decltype(tag)::value>(x.data_ptr<float>(), M, K, data.data_ptr<uint8_t>(), data.size(1), N,
                                            y.data_ptr<float>(), path.c_str());
  });
  TORCH_CHECK(ok, "no ", path, " kernel for ", kTypeNames[type], " in this build");
  return y;
}

// The small-M kernel linear("") runs for each type: "int16 <isa>" or "float <isa>".
std::vector<std::string> small_m_kernels() {
  std::vector<std::string> out;
  for (int i = 0; i < int(Type::kCount); ++i)
    with_type(Type(i), [&](auto tag) {
      constexpr Type T = decltype(tag)::value;
      out.emplace_back(use_int16_path<T>() ? std::string("int16 ") + int16_dot_variant()
                                          : std::string("float ") + float_dot_variant());
    });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("type_names", &type_names, "the kept GGUF types, in the order of the type index");
  m.def("dequantize_rows", &dequantize_rows, "(data, type, start, buf): rows [start, start + len(buf)) as float32");
  m.def("dequantize_rows_bf16", &dequantize_rows_bf16,
        "(data, type, start, buf): rows [start, start + len(buf)) as bfloat16 (a prefill's panel)");
  m.def("gather_rows", &gather_rows, "(data, type, ids) -> float32 [T, K]: rows ids (embedding lookup)");
  m.def("linear", &linear, "(x [M, K], data, type, path) -> x @ W.T [M, N]: the small-M kernel");
  m.def("small_m_kernels", &small_m_kernels, "per type (type_names order): the kernel linear runs");
}
