// Bindings of the GGUF block kernels (gguf_matmul.h, gguf_moe.h) for Python: a weight is `data`, uint8
// [N, row bytes] (contiguous rows of one kept type's blocks, as the file stores them), its
// type as an index into type_names(), and K.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "gguf_matmul.h"
#include "gguf_moe.h"

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

// The weight's type, checked with buf [R, K] of `dtype` as the destination of rows
// [start, start + R).
Type check_rows(const torch::Tensor& data, int64_t type, int64_t start, const torch::Tensor& buf,
                torch::ScalarType dtype) {
  TORCH_CHECK(buf.scalar_type() == dtype && buf.dim() == 2 && buf.is_contiguous(), "buf must be a contiguous ",
              c10::toString(dtype), " [rows, K] tensor");
  const Type t = check_weight(data, type, buf.size(1));
  TORCH_CHECK(start >= 0 && start + buf.size(0) <= data.size(0), "rows [", start, ", ", start + buf.size(0),
              ") out of [0, ", data.size(0), ")");
  return t;
}

// Rows [start, start + buf.size(0)) of the weight as float32 into buf [R, K].
void dequantize_rows(const torch::Tensor& data, int64_t type, int64_t start, torch::Tensor buf) {
  const Type t = check_rows(data, type, start, buf, torch::kFloat32);
  const int64_t K = buf.size(1), R = buf.size(0);
  const uint8_t* d = data.data_ptr<uint8_t>();
  with_type(t, [&](auto tag) {
    decode_rows<decltype(tag)::value>(d, data.size(1), K, R, [&](int64_t r) { return start + r; }, 1,
                                      buf.data_ptr<float>());
  });
}

// Rows [start, start + buf.size(0)) of the weight as bfloat16 into buf [R, K] (a prefill's
// bf16 panel: the weight is never copied whole).
void dequantize_rows_bf16(const torch::Tensor& data, int64_t type, int64_t start, torch::Tensor buf) {
  const Type t = check_rows(data, type, start, buf, torch::kBFloat16);
  const int64_t K = buf.size(1), R = buf.size(0);
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

// One projection of all experts: uint8 [E, rows, row bytes] of type `type`, K elements per row.
ExpertStack expert_stack(const torch::Tensor& data, int64_t type, int64_t K, const char* what) {
  TORCH_CHECK(data.dim() == 3 && data.is_contiguous(), what, " must be a contiguous uint8 [E, rows, row bytes] tensor");
  check_weight(data.view({-1, data.size(2)}), type, K);
  return {data.data_ptr<uint8_t>(), Type(type), data.size(1), data.size(2), K};
}

// x [T, H] float32, expert_ids [T, k] int64, weights [T, k] float32, gate_up uint8 [E, 2 I, row
// bytes of H] (each expert's gate rows then its up rows), down uint8 [E, H, row bytes of I] ->
// out [T, H] = sum over slots of weights * down(silu(gate x) * up x) (gguf_moe.h); with biases
// and clamped_swiglu, gpt-oss's experts (gguf_moe.h's ExpertAct).
torch::Tensor moe_experts(const torch::Tensor& x, const torch::Tensor& expert_ids, const torch::Tensor& weights,
                          const torch::Tensor& gate_up, int64_t gate_up_type, const torch::Tensor& down,
                          int64_t down_type, bool int8_activations, const torch::Tensor& gate_up_bias,
                          const torch::Tensor& down_bias, bool clamped_swiglu, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [T, H] tensor");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == T && expert_ids.scalar_type() == torch::kInt64 &&
                  expert_ids.is_contiguous(),
              "expert_ids must be a contiguous int64 [T, k] tensor");
  const int64_t k = expert_ids.size(1);
  TORCH_CHECK(weights.sizes() == expert_ids.sizes() && weights.scalar_type() == torch::kFloat32 &&
                  weights.is_contiguous(),
              "weights must be a contiguous float32 [T, k] tensor");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0) && gate_up.size(1) % 2 == 0 &&
                  down.size(1) == H,
              "gate_up [E, 2 I, *] and down [E, H, *] must share E, with H = x's width");
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  const ExpertStack gu = expert_stack(gate_up, gate_up_type, H, "gate_up");
  const ExpertStack dn = expert_stack(down, down_type, I, "down");
  const int64_t* ids = expert_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * k; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "expert id ", ids[i], " out of range [0, ", E, ")");
  ExpertAct act{clamped_swiglu, static_cast<float>(alpha), static_cast<float>(limit)};
  if (gate_up_bias.numel()) {
    TORCH_CHECK(gate_up_bias.scalar_type() == torch::kFloat32 && gate_up_bias.is_contiguous() &&
                    gate_up_bias.numel() == E * 2 * I,
                "gate_up_bias must be a contiguous float32 [E, 2 I] tensor");
    act.gate_up_bias = gate_up_bias.data_ptr<float>();
  }
  if (down_bias.numel()) {
    TORCH_CHECK(down_bias.scalar_type() == torch::kFloat32 && down_bias.is_contiguous() && down_bias.numel() == E * H,
                "down_bias must be a contiguous float32 [E, H] tensor");
    act.down_bias = down_bias.data_ptr<float>();
  }
  auto out = torch::zeros({T, H}, x.options());
  if (T * k > 0)
    moe_grouped(x.data_ptr<float>(), T, ids, weights.data_ptr<float>(), k, E, gu, dn,
                out.data_ptr<float>(), int8_activations, act);
  return out;
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
  m.def("moe_experts", &moe_experts,
        "(x, expert_ids, weights, gate_up, gate_up_type, down, down_type, int8_activations, gate_up_bias, "
        "down_bias, clamped_swiglu, alpha, limit) -> [T, H]: the grouped-expert MLP (int8_activations: per 256 "
        "for the K-quant projections; biases [E, 2 I] / [E, H] or empty; clamped_swiglu: gpt-oss's activation)");
  m.def("small_m_kernels", &small_m_kernels, "per type (type_names order): the kernel linear runs");
}
