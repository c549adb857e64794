// Decode attention straight from the paged KV cache: no gather into a dense copy.
//
// For each (request, kv head) pair, in parallel: the query heads of that group score every
// cached position, reached through the request's block table, then a softmax and a weighted
// sum of V. Scores and sums are float32 whatever the cache dtype.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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

template <typename T, typename Rows>
void decode_kernel(const T* q,            // [B, Hq, D]
                   const T* k_cache,      // [num_rows, Hkv, D]
                   const T* v_cache,      // [num_rows, Hkv, D]
                   Rows rows,
                   const int64_t* seq_lens,      // [B]
                   T* out,                // [B, Hq, D]
                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                   float scale, int64_t window) {
  const int64_t G = Hq / Hkv;
  const int64_t token_stride = Hkv * D;  // between consecutive slots
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> qf(G * D);
    std::vector<float> acc(G * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t work = 0; work < B * Hkv; ++work) {
      const int64_t b = work / Hkv, h = work % Hkv;
      const int64_t len = seq_lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - start;
      scores.assign(G * n, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_float(q[(b * Hq + h * G + g) * D + d]) * scale;
      // Pass 1: scores[g, t] = q_g . k_t
      for (int64_t t = start; t < len; ++t) {
        const T* kp = k_cache + rows(b, t) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(kp[d]);
          scores[g * n + (t - start)] = s;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) m = std::max(m, sg[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - m); sum += sg[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      // Pass 2: out_g = sum_t p[g, t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < len; ++t) {
        const T* vp = v_cache + rows(b, t) * token_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + (t - start)];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(vp[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + h * G + g) * D + d] = static_cast<T>(acc[g * D + d]);
    }
  }
}

}  // namespace

// q: [B, Hq, D]; kv_cache: [2, num_blocks, bs, Hkv, D]; block_tables: [B, max_blocks] int64;
// seq_lens: [B] int64; window <= 0 means full attention. Returns [B, Hq, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window) {
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
                            static_cast<float>(scale), window);
  });
  return out;
}

// The vattention layout: kv_cache [2, num_slots, capacity, Hkv, D], request b's tokens
// contiguous at slot slots[b]; no block table. Returns [B, Hq, D].
torch::Tensor contiguous_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor slots,
                                          torch::Tensor seq_lens, double scale, int64_t window) {
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
                            static_cast<float>(scale), window);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache");
  m.def("contiguous_decode_attention", &contiguous_decode_attention,
        "decode attention over per-request contiguous KV slots (vattention)");
}
