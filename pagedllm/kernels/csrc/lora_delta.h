#pragma once
// LoRA deltas inside the fused decode (decode_layers.cpp): after a projection y = x W^T, each
// row adds its own adapter's B A x, the BGMV/SGMV idea of Punica on the CPU.
//
// The weights are lora/layers.py's stacked slots, held by reference (their slots are refilled
// in place when the step's adapters change):
//   a: float32 [S * R, K]  rows slot * R + section * r + j   (R = sections * r, r = max rank)
//   b: float32 [S * R, N]  B transposed, rows likewise; section i's rank rows are nonzero only
//                          in its own output columns [off_i, off_i+1), the only ones read
// Rows are grouped by slot, so each adapter's A and B are read once per step, whatever the
// number of its rows; a row without an adapter (slot -1) adds nothing.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace pagedllm {

struct LoRAProjection {
  torch::Tensor a, b;                 // see above; both empty: no adapter on this projection
  std::vector<int64_t> section_rows;  // output row offsets, sections + 1 entries
  int64_t rank = 0;                   // r, per section

  bool empty() const { return a.numel() == 0; }

  // y [M, N] += per row m of slot row_slot[m]: B_s (A_s x_m); u: scratch. Two parallel
  // regions per projection, whatever the number of adapters.
  void add(const float* x, int64_t M, int64_t K, float* y, int64_t N, const int64_t* row_slot,
           std::vector<float>& u) const {
    const int64_t sections = static_cast<int64_t>(section_rows.size()) - 1;
    const int64_t width = rank * sections;  // R
    std::vector<std::vector<int64_t>> rows(b.size(0) / width);  // the rows of each slot
    for (int64_t m = 0; m < M; ++m)
      if (row_slot[m] >= 0) rows.at(row_slot[m]).push_back(m);
    std::vector<int64_t> active;
    for (int64_t s = 0; s < static_cast<int64_t>(rows.size()); ++s)
      if (!rows[s].empty()) active.push_back(s);
    if (active.empty()) return;
    const float* ap = a.data_ptr<float>();
    const float* bp = b.data_ptr<float>();
    u.assign(M * width, 0.f);
    // u[m, j] = A_s[j] . x_m: each adapter's A row read once for all of its rows.
    const int64_t num_a = static_cast<int64_t>(active.size()) * width;
    at::parallel_for(0, num_a, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t s = active[t / width], j = t % width;
        const float* ar = ap + (s * width + j) * K;
        for (const int64_t m : rows[s]) {
          const float* xr = x + m * K;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t k = 0; k < K; ++k) sum += ar[k] * xr[k];
          u[m * width + j] = sum;
        }
      }
    });
    // y[m, n] += sum_j u[m, i r + j] B_s[i r + j, n] over section i's columns: each rank row
    // of B scales into a contiguous run of outputs (no per-output horizontal sums); a padded
    // rank row (u = 0: its A row is zero) is skipped.
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = 0; i < sections; ++i) {
        const int64_t n0 = std::max(begin, section_rows[i]), n1 = std::min(end, section_rows[i + 1]);
        if (n0 >= n1) continue;
        for (const int64_t s : active) {
          for (const int64_t m : rows[s]) {
            float* yr = y + m * N;
            const float* ur = u.data() + m * width + i * rank;
            for (int64_t j = 0; j < rank; ++j) {
              const float c = ur[j];
              if (c == 0.f) continue;
              const float* br = bp + (s * width + i * rank + j) * N;
#pragma omp simd
              for (int64_t n = n0; n < n1; ++n) yr[n] += c * br[n];
            }
          }
        }
      }
    });
  }
};

// Every layer's four projections (qkv, o, gate_up, down) and the step's row -> slot map.
class LoRAHooks {
 public:
  void set_layer(int64_t layer, std::vector<torch::Tensor> a, std::vector<torch::Tensor> b,
                 std::vector<std::vector<int64_t>> section_rows, int64_t rank) {
    TORCH_CHECK(a.size() == 4 && b.size() == 4 && section_rows.size() == 4, "four projections per layer");
    if (static_cast<int64_t>(layers_.size()) <= layer) layers_.resize(layer + 1);
    for (int p = 0; p < 4; ++p) {
      TORCH_CHECK(a[p].scalar_type() == torch::kFloat32 && a[p].is_contiguous() && a[p].dim() == 2 &&
                      b[p].scalar_type() == torch::kFloat32 && b[p].is_contiguous() && b[p].dim() == 2 &&
                      section_rows[p].size() >= 2 && section_rows[p].front() == 0 &&
                      b[p].size(1) == section_rows[p].back() &&
                      a[p].size(0) == b[p].size(0) &&
                      b[p].size(0) % (rank * static_cast<int64_t>(section_rows[p].size() - 1)) == 0,
                  "LoRA slots must be float32 a [S * R, K] and b [S * R, N]");
      layers_[layer][p] = LoRAProjection{a[p], b[p], section_rows[p], rank};
    }
  }

  // The next forward's row -> slot (int64 [rows], -1: no adapter); empty: no adapters.
  void set_rows(torch::Tensor row_slots) {
    TORCH_CHECK(row_slots.numel() == 0 || (row_slots.scalar_type() == torch::kInt64 && row_slots.is_contiguous()),
                "row slots must be int64 [rows]");
    rows_ = row_slots;
  }

  // After projection p of layer l: y [M, N] += the rows' deltas (nothing without adapters).
  void apply(size_t layer, int p, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
    if (rows_.numel() == 0 || layer >= layers_.size() || layers_[layer][p].empty()) return;
    TORCH_CHECK(rows_.numel() == M, "row slots for ", rows_.numel(), " rows, the step has ", M);
    layers_[layer][p].add(x, M, K, y, N, rows_.data_ptr<int64_t>(), u_);
  }

 private:
  std::vector<std::array<LoRAProjection, 4>> layers_;
  torch::Tensor rows_;
  std::vector<float> u_;
};

}  // namespace pagedllm
