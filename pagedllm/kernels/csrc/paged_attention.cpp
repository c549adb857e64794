// Bindings of the decode attention kernels (paged_attention.h) for Python.
#include <torch/extension.h>

#include "paged_attention.h"

using namespace pagedllm;

// q: [B, Hq, D]; kv_cache: [2, num_blocks, bs, Hkv, D]; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64; window <= 0 means full attention; softcap <= 0 means none (else each
// scaled score s becomes softcap * tanh(s / softcap)). Returns [B, Hq, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "q and kv_cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "head shapes do not match");
  auto out = torch::empty_like(q);
  const int64_t plane = num_blocks * bs * Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), base, base + plane,
                            PagedRows{bt.data_ptr<int64_t>(), bt.size(1), bs},
                            sl.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, D,
                            static_cast<float>(scale), window, static_cast<float>(std::max(softcap, 0.0)));
  });
  return out;
}

// The contiguous-slot layout (one slot per request): kv_cache [2, num_slots, capacity, Hkv, D], request b's tokens
// contiguous at slot slots[b]; no block table. Returns [B, Hq, D].
torch::Tensor contiguous_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor slots,
                                          torch::Tensor seq_lens, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous(), "q and kv_cache must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "slots and seq_lens must be int64");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  auto sl_ = slots.contiguous();
  auto sl = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_slots = kv_cache.size(1), capacity = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "head shapes do not match");
  auto out = torch::empty_like(q);
  const int64_t plane = num_slots * capacity * Hkv * D;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "contiguous_decode_attention", [&] {
    const scalar_t* base = kv_cache.data_ptr<scalar_t>();
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), base, base + plane,
                            SlotRows{sl_.data_ptr<int64_t>(), capacity},
                            sl.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, Hq, Hkv, D,
                            static_cast<float>(scale), window, static_cast<float>(std::max(softcap, 0.0)));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
  m.def("contiguous_decode_attention", &contiguous_decode_attention,
        "decode attention over per-request contiguous KV slots");
}
