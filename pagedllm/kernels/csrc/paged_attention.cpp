// Bindings of the decode attention kernels (paged_attention.h) for Python.
#include <torch/extension.h>

#include "paged_attention.h"

using namespace pagedllm;

namespace {

// Whether a cache dtype is one of the 8-bit code formats (layers/kv_quant.py).
bool is_code_dtype(at::ScalarType t) {
  return t == at::ScalarType::Char || t == at::ScalarType::Float8_e4m3fn || t == at::ScalarType::Float8_e5m2;
}

// f(KV{}) with KV the code type of a coded cache dtype.
template <typename F>
void dispatch_codes(at::ScalarType t, F&& f) {
  switch (t) {
    case at::ScalarType::Char: f(Int8Code{}); break;
    case at::ScalarType::Float8_e4m3fn: f(E4M3Code{}); break;
    case at::ScalarType::Float8_e5m2: f(E5M2Code{}); break;
    default: TORCH_CHECK(false, "not an 8-bit KV cache dtype: ", t);
  }
}

// The checks both layouts share; returns whether the cache is coded.
bool check_cache(const torch::Tensor& q, const torch::Tensor& kv_cache) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "q and kv_cache must be contiguous");
  const bool coded = is_code_dtype(kv_cache.scalar_type());
  TORCH_CHECK(coded || q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  const int64_t D = q.size(2);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(4) == (coded ? D + kScaleBytes : D) &&
                  q.size(1) % kv_cache.size(3) == 0,
              "head shapes do not match (a coded cache's rows are head_dim + 4 wide)");
  return coded;
}

// Runs decode_kernel<scalar_t, Rows, KV> with KV the cache's element type.
template <typename Rows>
torch::Tensor decode(torch::Tensor q, torch::Tensor kv_cache, Rows rows, torch::Tensor seq_lens, double scale,
                     int64_t window, double softcap, const std::optional<torch::Tensor>& sinks) {
  const bool coded = check_cache(q, kv_cache);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kv_cache.size(3);
  torch::Tensor sinks_f;  // [Hq] float32, or undefined: no sinks
  if (sinks.has_value()) {
    sinks_f = sinks->to(torch::kFloat32).contiguous();
    TORCH_CHECK(sinks_f.dim() == 1 && sinks_f.size(0) == Hq, "sinks must be [num_heads]");
  }
  const float* sinks_ptr = sinks_f.defined() ? sinks_f.data_ptr<float>() : nullptr;
  const int64_t plane = kv_cache.numel() / 2;  // elements of K (then V)
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto kv_tag) {
      using KV = decltype(kv_tag);
      const KV* base = reinterpret_cast<const KV*>(kv_cache.data_ptr());
      decode_kernel<scalar_t, Rows, KV>(q.data_ptr<scalar_t>(), base, base + plane, rows,
                                        seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, D,
                                        static_cast<float>(scale), window,
                                        static_cast<float>(std::max(softcap, 0.0)), sinks_ptr);
    };
    if (coded) {
      dispatch_codes(kv_cache.scalar_type(), run);
    } else {
      run(scalar_t{});
    }
  });
  return out;
}

}  // namespace

// q: [B, Hq, D]; kv_cache: [2, num_blocks, bs, Hkv, D] (or an 8-bit cache's [.., D + 4]:
// codes then the row's scale); block_tables: [B, max_blocks] int64; seq_lens: [B] int64;
// window <= 0 means full attention; softcap <= 0 means none (else each scaled score s becomes
// softcap * tanh(s / softcap)); sinks: [Hq] logits joining each head's softmax denominator with no
// value row (gpt-oss), or None. Returns [B, Hq, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                                     std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  return decode(q, kv_cache, PagedRows{bt.data_ptr<int64_t>(), bt.size(1), kv_cache.size(2)}, sl, scale, window,
                softcap, sinks);
}

// The contiguous-slot layout (one slot per request): kv_cache [2, num_slots, capacity, Hkv, D (+ 4)], request b's
// tokens contiguous at slot slots[b]; no block table. Returns [B, Hq, D].
torch::Tensor contiguous_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor slots,
                                          torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                                          std::optional<torch::Tensor> sinks) {
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "slots and seq_lens must be int64");
  auto sl_ = slots.contiguous();
  auto sl = seq_lens.contiguous();
  return decode(q, kv_cache, SlotRows{sl_.data_ptr<int64_t>(), kv_cache.size(2)}, sl, scale, window, softcap, sinks);
}

// x: float32 [N, D] -> out [N, D + 4] of an 8-bit cache dtype (quantize_row per row: what the
// compiled decode writes; tests compare it with layers/kv_quant.py's quantize_rows).
void quantize_kv_rows(torch::Tensor x, torch::Tensor out) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be float32 [N, D]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.size(1) == x.size(1) + kScaleBytes, "out must be [N, D + 4]");
  const int64_t N = x.size(0), D = x.size(1);
  dispatch_codes(out.scalar_type(), [&](auto kv_tag) {
    using KV = decltype(kv_tag);
    KV* o = reinterpret_cast<KV*>(out.data_ptr());
    for (int64_t r = 0; r < N; ++r) quantize_row<KV>(x.data_ptr<float>() + r * D, D, o + r * (D + kScaleBytes));
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("window"),
        py::arg("softcap"), py::arg("sinks") = py::none());
  m.def("contiguous_decode_attention", &contiguous_decode_attention,
        "decode attention over per-request contiguous KV slots", py::arg("q"), py::arg("kv_cache"),
        py::arg("slots"), py::arg("seq_lens"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
        py::arg("sinks") = py::none());
  m.def("quantize_kv_rows", &quantize_kv_rows, "rows to 8-bit KV codes and their scales");
}
