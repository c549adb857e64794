#pragma once
// The grouped-expert MLP of a sparse MoE layer over GGUF blocks, for a few tokens (decode):
//   out[t] = sum_slot w[t, slot] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, slot]
// or, with an ExpertAct of gpt-oss's form, each projection with its expert's bias and the
// clamped SwiGLU (clamp(u, -l, l) + 1) * g' * sigmoid(alpha g'), g' = min(g, l), between them:
//   out[t] = sum_slot w * (down_e(act(gate_e x + b_g, up_e x + b_u)) + b_d)
// in one call and one OpenMP region, for every active expert at once:
// 1. plan (one thread): the T * k (token, slot) pairs grouped by expert in ascending expert
//    order, within an expert by token (a counting sort: layers/moe.py's stable argsort order);
// 2. gate/up: work items (active expert, block of kItemRows intermediate rows), dynamic
//    schedule; each weight row read once for all of that expert's tokens (x's rows gathered),
//    h[pair, j] = silu(gate) * up, each element written by one thread;
// 3. h rounded to int16 once (where the down type takes the int16 path; or to int8 per 256
//    where int8 activations were asked for and the type has that dot);
// 4. down: work items = blocks of output rows (moe_down); an item runs every active expert over
//    its rows in expert order and adds w * dot into out[t, n]: each output element is one
//    thread's, summed in the loop path's order (expert by expert), so no races and the result
//    does not depend on the thread count.
// x is rounded to int16 once for all experts (gguf_dot_avx512.h), as the small-M kernel does
// per call; types without the int16 dot (or builds without VNNI) take the float path
// (a decoded span dotted with each gathered row, gguf_matmul.h's order).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "gguf_matmul.h"

namespace pagedllm::gguf {

// Weight rows per work item (of gate and of up each, or of down).
constexpr int64_t kItemRows = 16;

// The experts' activation between gate/up and down, and their biases.
struct ExpertAct {
  bool clamped = false;  // false: silu(g) * u; true: gpt-oss's clamped SwiGLU (above)
  float alpha = 1.702f, limit = 7.f;
  const float* gate_up_bias = nullptr;  // [E, 2 I] (gate's then up's), or none
  const float* down_bias = nullptr;     // [E, H], or none

  float operator()(float g, float u) const {
    if (!clamped) return g / (1.f + std::exp(-g)) * u;
    g = std::min(g, limit);
    u = std::clamp(u, -limit, limit);
    return (u + 1.f) * (g / (1.f + std::exp(-alpha * g)));
  }
};

// One projection of all experts: E consecutive [rows, row_bytes] matrices of type `type`.
struct ExpertStack {
  const uint8_t* data;
  Type type;
  int64_t rows;  // per expert: 2 I (gate rows then up rows) or H (down)
  int64_t row_bytes;
  int64_t k;  // elements per row
  const uint8_t* row(int64_t e, int64_t n) const { return data + (e * rows + n) * row_bytes; }
};

// The pairs grouped by expert: pairs [start[i], start[i + 1]) belong to active[i].
struct ExpertPlan {
  std::vector<int64_t> active;
  std::vector<int64_t> start;
  std::vector<int32_t> token;  // [P] the pair's token (its row of x and of out)
  std::vector<float> weight;   // [P] its routing weight
  std::vector<int32_t> pair;   // [P] 0 .. P - 1: the pairs' rows of h
  int64_t max_pairs = 0;       // the most pairs of one expert
};

// ids, w: [T, k] row-major; ids in [0, E) (the caller checks).
inline ExpertPlan plan_experts(const int64_t* ids, const float* w, int64_t T, int64_t k, int64_t E) {
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) ++count[ids[i] + 1];
  ExpertPlan p;
  for (int64_t e = 0; e < E; ++e) {
    if (count[e + 1] > 0) p.active.push_back(e), p.max_pairs = std::max(p.max_pairs, count[e + 1]);
    count[e + 1] += count[e];  // now count[e] = the first pair of expert e
  }
  for (int64_t e : p.active) p.start.push_back(count[e]);
  p.start.push_back(T * k);
  p.token.resize(T * k), p.weight.resize(T * k), p.pair.resize(T * k);
  for (int64_t i = 0; i < T * k; ++i) {  // pair i = token i / k, slot i % k: tokens ascending per expert
    const int64_t at = count[ids[i]]++;
    p.token[at] = int32_t(i / k), p.weight[at] = w[i];
  }
  for (int64_t i = 0; i < T * k; ++i) p.pair[i] = int32_t(i);
  return p;
}

// sums[i] (i < n) = activation row rows[i] of x [*, K] dotted with one weight row, by the float
// path (per row the same order of operations as matmul_f32).
template <Type T>
inline void gathered_dots_f32(const uint8_t* row, int64_t K, const float* x, const int32_t* rows, int64_t n,
                              float* sums) {
  alignas(64) float tile[kSpan];
  for (int64_t i0 = 0; i0 < n; i0 += kMaxTileRows) {
    const int64_t cnt = std::min(kMaxTileRows, n - i0);
    tile_dots_f32<T>(row, K, x, [&](int64_t m) { return rows[i0 + m]; }, cnt, tile, sums + i0);
  }
}

// Activation rows [M, K] as a type's dot reads them: float32, and their int16 rounding where
// the phase's type takes the int16 path, or their int8 rounding (per 256) where int8
// activations were asked for and the type has the int8 dot (gguf_dot_int8_avx512.h).
struct Activations {
  const float* x;
  int64_t K;
  std::unique_ptr<Int16Activations> q;
  std::unique_ptr<Int8Activations> q8;
};

template <Type T>
inline void gathered_dots(const uint8_t* row, const Activations& a, const int32_t* rows, int64_t n, float* sums) {
  if constexpr (has_int8_dot<T>()) {
    if (a.q8) return gathered_dots_int8<T>(row, *a.q8, rows, n, sums);
  }
  if constexpr (use_int16_path<T>()) {
    gathered_dots_int16<T>(row, a.K, *a.q, rows, n, sums);
  } else {
    gathered_dots_f32<T>(row, a.K, a.x, rows, n, sums);
  }
}

inline bool int16_path(Type t) {
  bool out = false;
  with_type(t, [&](auto tag) { out = use_int16_path<decltype(tag)::value>(); });
  return out;
}
inline bool int8_path(Type t) {
  bool out = false;
  with_type(t, [&](auto tag) { out = has_int8_dot<decltype(tag)::value>(); });
  return out;
}

// A phase's activations rounded as its type's dot reads them (int8: asked for and the type has
// that dot; else int16 where the type takes it; else none).
inline void round_activations(Activations& a, const float* x, int64_t M, Type t, bool int8) {
  if (int8 && int8_path(t))
    a.q8 = std::make_unique<Int8Activations>(x, M, a.K, t == Type::Q4_K || t == Type::Q5_K);
  else if (int16_path(t))
    a.q = std::make_unique<Int16Activations>(x, M, a.K);
}

// Phase 2 (called by every thread of the region): h [P, I] from x's gathered rows.
template <Type T>
void moe_gate_up(const ExpertPlan& p, const Activations& x, const ExpertStack& gu, const ExpertAct& act, float* h) {
  const int64_t I = gu.rows / 2;
  const int64_t per_expert = (I + kItemRows - 1) / kItemRows;
  std::vector<float> g(p.max_pairs), u(p.max_pairs);
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < int64_t(p.active.size()) * per_expert; ++item) {
    const int64_t a = item / per_expert, e = p.active[a], j0 = item % per_expert * kItemRows;
    const int64_t first = p.start[a], n = p.start[a + 1] - first;
    for (int64_t j = j0; j < std::min(I, j0 + kItemRows); ++j) {
      gathered_dots<T>(gu.row(e, j), x, p.token.data() + first, n, g.data());
      gathered_dots<T>(gu.row(e, I + j), x, p.token.data() + first, n, u.data());
      if (act.gate_up_bias) {
        const float bg = act.gate_up_bias[e * 2 * I + j], bu = act.gate_up_bias[e * 2 * I + I + j];
        for (int64_t i = 0; i < n; ++i) g[i] += bg, u[i] += bu;
      }
      for (int64_t i = 0; i < n; ++i) h[(first + i) * I + j] = act(g[i], u[i]);
    }
  }
}

// Phase 4 (called by every thread of the region): out [T, H] += w * down(h), out zeroed.
// An item's rows run expert by expert, so each expert's rows of h are read once per item from
// L1: items of H / (8 threads) rows (16 .. 256), not 16, or a step with many active experts
// streams all of h from L2/L3 for every 16 rows (measured 3x slower at 64 tokens).
template <Type T>
void moe_down(const ExpertPlan& p, const Activations& h, const ExpertStack& down, const float* bias, float* out) {
  const int64_t H = down.rows;
  const int64_t rows = std::clamp(H / (8 * omp_get_num_threads()) / kItemRows * kItemRows, kItemRows, 16 * kItemRows);
  std::vector<float> s(p.max_pairs);
#pragma omp for schedule(dynamic, 1)
  for (int64_t n0 = 0; n0 < H; n0 += rows) {
    for (size_t a = 0; a < p.active.size(); ++a) {  // expert order: the loop path's summation order
      const int64_t first = p.start[a], n = p.start[a + 1] - first;
      for (int64_t j = n0; j < std::min(H, n0 + rows); ++j) {
        gathered_dots<T>(down.row(p.active[a], j), h, p.pair.data() + first, n, s.data());
        if (bias) {  // the loop path's (dot + b) * w
          const float b = bias[p.active[a] * H + j];
          for (int64_t i = 0; i < n; ++i) s[i] += b;
        }
        for (int64_t i = 0; i < n; ++i) out[int64_t(p.token[first + i]) * H + j] += p.weight[first + i] * s[i];
      }
    }
  }
}

// out [T, H] (zeroed by the caller) = the grouped-expert MLP of x [T, H]; ids, w: [T, k];
// int8: int8 activations per 256 for the K-quant projections (the layer's decode_activations);
// act: the activation and biases (default: silu, none).
inline void moe_grouped(const float* x, int64_t T, const int64_t* ids, const float* w, int64_t k, int64_t E,
                        const ExpertStack& gu, const ExpertStack& down, float* out, bool int8 = false,
                        const ExpertAct& act = {}) {
  const ExpertPlan p = plan_experts(ids, w, T, k, E);
  const int64_t I = gu.rows / 2, P = T * k;
  Activations xa{x, gu.k, nullptr, nullptr};
  round_activations(xa, x, T, gu.type, int8);
  std::vector<float> h(P * I);
  Activations ha{h.data(), I, nullptr, nullptr};
#pragma omp parallel
  {
    with_type(gu.type, [&](auto tag) { moe_gate_up<decltype(tag)::value>(p, xa, gu, act, h.data()); });
    // The implicit barrier of the omp for above: h is complete.
#pragma omp single
    round_activations(ha, h.data(), P, down.type, int8);
    // The single's barrier: ha is complete.
    with_type(down.type, [&](auto tag) { moe_down<decltype(tag)::value>(p, ha, down, act.down_bias, out); });
  }
}

}  // namespace pagedllm::gguf
