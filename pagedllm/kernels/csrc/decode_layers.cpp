// Every decoder layer of a Llama-shaped model in one compiled call, for decode steps: the
// layout models/fused_decode.py's DecodeLayout describes, with its kernel_refusal's values.
//
// At decode a layer's arithmetic on a few rows is small next to what surrounds it in Python:
// a dozen module calls, tensor views and allocations, the KV write's index_copy_, each a few
// to tens of microseconds, thirty layers over. Here a step's rows run through all layers in
// C++ over buffers reused from step to step, calling the same kernels as the per-module path
// (layer_ops.h, quant_linear.h, paged_attention.h); only silu's exp is vectorised here (a
// polynomial within ~2 ulp of std::exp). Float32 weights go through an AVX2 matrix-vector
// kernel (below) at one row and gemm_tiles.h's register tiles at more.
//
// Per layer, over M rows (each a decode: a request's next token, or one row of its verification run):
//   residual += h (the first layer: residual = h); x = rms_norm(residual)
//   (every norm scales by weight + norm_offset: Gemma's (1 + weight) with norm_offset 1)
//   qkv = x W_qkv^T (+ b); [q, k = rms_norm per head (q/k norm layouts only)]
//   q, k = rotary(q, k); K/V rows written to the cache at slot_mapping (an 8-bit cache:
//       quantized per row as layers/kv_quant.py does, kv_codes.h's quantize_row)
//   a = decode attention of each row over its request's context up to the row (block table or
//       contiguous slot; seq_lens: the row's position + 1),
//       its scores soft-capped to c * tanh(s / c) where the layer has a cap c, each head's sink
//       logit in its softmax where the layer has sinks (gpt-oss)
//   residual += a W_o^T (+ b); x = rms_norm(residual)
//   h = act(x W_gate^T) * (x W_up^T), then h W_down^T (+ b); act: silu, or gelu's tanh form;
//   or a sparse MLP (Qwen3-MoE, Mixtral): router logits x W_r^T, route_row (layer_ops.h: the
//   module path's routing), then gguf_moe.h's grouped call over the experts' GGUF stacks;
//   gpt-oss's (set_moe_gpt_oss): the router's bias, the softmax over the selected logits, the
//   experts' biases and clamped SwiGLU
// Sandwich norms (Gemma 2 and 3): the attention's and the MLP's outputs are each normed
// (attn_out_norm, mlp_out_norm) before they join the residual stream. The rotary cos/sin table
// is the decoder's or the layer's own (Gemma 3's local and global layers: two bases).
// The caller applies the final norm to (h, residual), as the per-module model does.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "decode_gguf_linear.h"
#include "gguf_moe.h"
#include "layer_ops.h"
#include "lora_delta.h"
#include "paged_attention.h"
#include "quant_linear.h"
#include "quant_scales.h"

namespace pagedllm {
namespace {

// y[r] = x . w_r for four consecutive float32 weight rows (one activation row): four weight
// streams in flight per thread, the activation block loaded once for all four.
inline void rows4_dot_f32(const float* x, int64_t K, const float* w, float* y) {
  __m256 a[4], b[4];
  for (int r = 0; r < 4; ++r) a[r] = b[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < 4; ++r) {
      a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k), x0, a[r]);
      b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k + 8), x1, b[r]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + k);
    for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k), x0, a[r]);
  }
  for (int r = 0; r < 4; ++r) {
    float sum = hsum(_mm256_add_ps(a[r], b[r]));
    for (int64_t kk = k; kk < K; ++kk) sum += w[r * K + kk] * x[kk];
    y[r] = sum;
  }
}

// A linear layer's weight as this forward reads it (tensors held so the pointers stay valid),
// in one of four forms: float32, quant_linear.h's int8/int4, a GGUF file's blocks
// (decode_gguf_linear.h), or sections: parts of one fused projection in different forms, part
// i writing output rows [offsets[i], offsets[i] + parts[i].N) (the bias and bf16 copy, if
// any, are the whole layer's; parts carry none).
struct DecodeLinear {
  int64_t bits = 32;  // 32: float32 weight [N, K]; 8 or 4: quant_linear.h's layouts; 0: gguf or sections
  torch::Tensor weight, scales, zeros, bias;
  torch::Tensor bf16;         // bf16 [N, K] copy of the weight for M >= bf16_min_rows, or empty
  int64_t bf16_min_rows = 0;  // (--prefill-activations bf16: kernels/bf16_activations.py)
  int64_t N = 0, K = 0;
  std::optional<GGUFDecodeWeight> gguf;  // the GGUF-blocks form
  std::vector<DecodeLinear> parts;       // the sections form (non-empty)
  std::vector<int64_t> offsets;          // [parts]: each part's first output row

  DecodeLinear(int64_t bits_, torch::Tensor weight_, torch::Tensor scales_, torch::Tensor zeros_,
               torch::Tensor bias_, torch::Tensor bf16_, int64_t bf16_min_rows_)
      : bits(bits_), weight(weight_), scales(scales_), zeros(zeros_), bias(bias_), bf16(bf16_),
        bf16_min_rows(bf16_min_rows_) {
    TORCH_CHECK(bits == 32 || bits == 8 || bits == 4, "bits must be 32, 8 or 4, got ", bits);
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous 2-D tensor");
    N = weight.size(0);
    if (bits == 32) {
      TORCH_CHECK(weight.scalar_type() == torch::kFloat32, "a float weight must be float32");
      K = weight.size(1);
    } else {
      TORCH_CHECK(scales.dim() == 2, "scales must be [N, K / 32]");
      K = scales.size(1) * kGroup;
      check_scales(scales, zeros, bits == 4, N, K / kGroup);
      TORCH_CHECK(weight.size(1) == (bits == 4 ? K / 2 : K), "quantized weight shape does not match its scales");
    }
    check_bias_bf16();
  }

  // The GGUF-blocks form (decode_gguf_linear.h).
  static DecodeLinear from_gguf(GGUFDecodeWeight g, torch::Tensor bias_, torch::Tensor bf16_, int64_t bf16_min_rows_) {
    DecodeLinear d;
    d.bits = 0;
    d.N = g.N;
    d.K = g.K;
    d.gguf = std::move(g);
    d.set_bias_bf16(bias_, bf16_, bf16_min_rows_);
    return d;
  }

  // The sections form: parts in order of their offsets, which tile [0, N) without gaps.
  static DecodeLinear from_sections(std::vector<DecodeLinear> parts_, std::vector<int64_t> offsets_,
                                    torch::Tensor bias_, torch::Tensor bf16_, int64_t bf16_min_rows_) {
    TORCH_CHECK(!parts_.empty() && parts_.size() == offsets_.size(), "sections need one offset per part");
    DecodeLinear d;
    d.bits = 0;
    d.K = parts_[0].K;
    for (size_t i = 0; i < parts_.size(); ++i) {
      TORCH_CHECK(offsets_[i] == d.N, "section ", i, " starts at row ", offsets_[i], ", expected ", d.N);
      TORCH_CHECK(parts_[i].K == d.K, "sections of different input widths");
      TORCH_CHECK(parts_[i].parts.empty() && parts_[i].bias.numel() == 0 && parts_[i].bf16.numel() == 0,
                  "a section part carries no sections, bias or bf16 copy of its own");
      d.N += parts_[i].N;
    }
    d.parts = std::move(parts_);
    d.offsets = std::move(offsets_);
    d.set_bias_bf16(bias_, bf16_, bf16_min_rows_);
    return d;
  }

  // y [M, N] = x [M, K] @ W^T (+ bias), by quantization.quantized_linear's choice of kernel
  // for quantized weights (int16 activations up to int16_max_rows, then 8-row tiles up to
  // tile_max_rows, then dequantized panels); GGUF blocks by gguf_blocks.gguf_linear's
  // (GGUFDecodeWeight); sections part by part, as layers/linear.sectioned_linear.
  // With a bf16 copy and at least bf16_min_rows rows: torch's bf16 GEMM (oneDNN; AMX where the
  // CPU has it) on x rounded to bf16, its bf16 output widened into y, as
  // bf16_activations.bf16_activation_linear computes.
  void operator()(const float* x, int64_t M, float* y, int64_t int16_max_rows, int64_t tile_max_rows) const {
    if (bf16.numel() && M >= bf16_min_rows) {
      const auto xb = torch::from_blob(const_cast<float*>(x), {M, K}, torch::kFloat32).to(torch::kBFloat16);
      torch::from_blob(y, {M, N}, torch::kFloat32).copy_(torch::mm(xb, bf16.t()));
    } else if (gguf) {
      (*gguf)(x, M, y);
    } else if (!parts.empty()) {
      run_sections(x, M, y, int16_max_rows, tile_max_rows);
    } else if (bits == 32 && M == 1) {  // single stream: four weight rows at a time
      const float* wp = weight.data_ptr<float>();
      const int64_t n_ = N, k_ = K, blocks = N / 4;
#pragma omp parallel for schedule(guided, kMinChunkRows / 4)
      for (int64_t i = 0; i < blocks; ++i) rows4_dot_f32(x, k_, wp + 4 * i * k_, y + 4 * i);
      for (int64_t n = 4 * blocks; n < n_; ++n) {
        float sum = 0.f;
        for (int64_t k = 0; k < k_; ++k) sum += wp[n * k_ + k] * x[k];
        y[n] = sum;
      }
    } else if (bits == 32) {  // register tiles straight from the weight (no copy)
      const float* wp = weight.data_ptr<float>();
      const int64_t n_ = N, k_ = K;
      panel_matmul(
          x, M, K, N, [&](int64_t n0, int64_t, float*) { return wp + n0 * k_; },
          [&](int64_t m, int64_t n, float v) { y[m * n_ + n] = v; });
    } else {
      const uint8_t* qp = reinterpret_cast<const uint8_t*>(weight.data_ptr());
      with_scale_type(scales, [&](auto tag) {
        using S = decltype(tag);
        if (bits == 4) {
          quant_matmul<true, S>(x, M, K, N, qp, scale_ptr<S>(scales), scale_ptr<S>(zeros), y, int16_max_rows,
                                tile_max_rows);
        } else {
          quant_matmul<false, S>(x, M, K, N, qp, scale_ptr<S>(scales), nullptr, y, int16_max_rows, tile_max_rows);
        }
      });
    }
    if (bias.numel()) {
      const float* b = bias.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) y[m * N + n] += b[n];
    }
  }

 private:
  DecodeLinear() = default;

  // The layer's bias and bf16 copy (either may be empty), checked against [N, K].
  void set_bias_bf16(torch::Tensor bias_, torch::Tensor bf16_, int64_t bf16_min_rows_) {
    bias = bias_;
    bf16 = bf16_;
    bf16_min_rows = bf16_min_rows_;
    check_bias_bf16();
  }

  void check_bias_bf16() const {
    TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == torch::kFloat32 &&
                                      bias.is_contiguous()), "bias must be float32 [N] or empty");
    TORCH_CHECK(bf16.numel() == 0 || (bf16.scalar_type() == torch::kBFloat16 && bf16.is_contiguous() &&
                                      bf16.dim() == 2 && bf16.size(0) == N && bf16.size(1) == K),
                "the bf16 weight copy must be bf16 [N, K] or empty");
  }

  // Each part into its own [M, part N] buffer (the module path's sectioned_linear computes
  // each part's output alone), then into its columns of y [M, N].
  void run_sections(const float* x, int64_t M, float* y, int64_t int16_max_rows, int64_t tile_max_rows) const {
    static thread_local std::vector<float> part_out;
    for (size_t i = 0; i < parts.size(); ++i) {
      const DecodeLinear& p = parts[i];
      part_out.resize(M * p.N);
      p(x, M, part_out.data(), int16_max_rows, tile_max_rows);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + m * N + offsets[i], part_out.data() + m * p.N, sizeof(float) * p.N);
    }
  }
};

// The cache's element: float32, or one of kv_codes.h's 8-bit codes (rows of D + 4).
enum class KVElem { kFloat32, kInt8, kE4M3, kE5M2 };

inline KVElem kv_elem(at::ScalarType t) {
  switch (t) {
    case at::ScalarType::Float: return KVElem::kFloat32;
    case at::ScalarType::Char: return KVElem::kInt8;
    case at::ScalarType::Float8_e4m3fn: return KVElem::kE4M3;
    case at::ScalarType::Float8_e5m2: return KVElem::kE5M2;
    default: TORCH_CHECK(false, "kv_cache must be float32, int8, float8_e4m3fn or float8_e5m2, got ", t);
  }
}

// f(KV{}) with KV the element type `e` names.
template <typename F>
void dispatch_kv(KVElem e, F&& f) {
  switch (e) {
    case KVElem::kFloat32: f(float{}); break;
    case KVElem::kInt8: f(Int8Code{}); break;
    case KVElem::kE4M3: f(E4M3Code{}); break;
    case KVElem::kE5M2: f(E5M2Code{}); break;
  }
}

// A sparse MLP: the router, and every expert's gate/up and down as GGUF stacks (the module
// path's SparseMoE.expert_stacks, run by the same grouped call).
struct DecodeMoE {
  DecodeLinear router;            // [E, hidden]
  torch::Tensor router_float;     // the router's float32 weight, multiplied by torch's linear as the
                                  // module path's F.linear (bit for bit: the top-k is discrete), or empty
  torch::Tensor gate_up, down;    // uint8 [E, 2 I, row bytes], [E, hidden, row bytes]
  gguf::ExpertStack gu, dn;
  int64_t E, top_k;
  bool renorm, int8;              // renormalise the top-k weights; int8 activations (K-quants)
  // gpt-oss's (set_moe_gpt_oss): the float router's bias, the experts' biases and clamped SwiGLU
  // (act's pointers into these tensors), the softmax over the selected logits.
  torch::Tensor router_bias, gate_up_bias, down_bias;
  gguf::ExpertAct act{};
  bool softmax_selected = false;
};

struct DecodeLayer {
  torch::Tensor input_norm, post_norm;  // float32 [hidden]: before the attention and before the MLP
  torch::Tensor q_norm, k_norm;         // float32 [head_dim], or both empty: no q/k norm
  torch::Tensor attn_out_norm, mlp_out_norm;  // float32 [hidden], or both empty: no sandwich norms
  torch::Tensor cos_sin;                      // the layer's rotary table, or empty: the decoder's
  DecodeLinear qkv, o;
  std::optional<DecodeLinear> gate_up, down;  // a dense MLP, or none: the layer's moe
  std::shared_ptr<DecodeMoE> moe;             // a sparse MLP (set_moe), or none
  torch::Tensor kv_cache;  // [2, blocks, block_size, Hkv, D] or the contiguous-slot layout [2, slots, capacity, Hkv, D]
                           // (8-bit codes: D + 4, the row's scale last)
  KVElem kv_elem;
  int64_t group;           // the KV cache group whose slot mapping and block tables address kv_cache
  int64_t window;          // sliding window, 0 = full attention
  float softcap;           // attention logit soft-cap, 0 = none
  torch::Tensor sinks;     // float32 [num_heads]: attention sinks' logits (gpt-oss), or empty
};

}  // namespace

class LlamaDecodeLayers {
 public:
  LlamaDecodeLayers(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t intermediate, double eps, double scale, torch::Tensor cos_sin_cache,
                    double qk_norm_eps, int64_t int16_max_rows, int64_t tile_max_rows, std::string activation,
                    double norm_offset)
      : hidden_(hidden), hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), inter_(intermediate),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)),
        qk_norm_eps_(static_cast<float>(qk_norm_eps)), norm_offset_(static_cast<float>(norm_offset)),
        cos_sin_(cos_sin_cache),
        int16_max_rows_(int16_max_rows), tile_max_rows_(tile_max_rows) {
    TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
    check_cos_sin(cos_sin_cache);
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation must be silu or gelu_tanh, got ",
                activation);
    gelu_tanh_ = activation == "gelu_tanh";
  }

  // linears: qkv, o, gate_up, down (DecodeLinear's forms, built in Python by the bound
  // DecodeLinear factories). q_norm, k_norm: the per-head RMSNorm weights [head_dim], or both
  // empty for none. window: the sliding window (0: full attention); softcap: the attention logit
  // soft-cap (0: none).
  // attn_out_norm, mlp_out_norm: the sandwich norms' weights [hidden], or both empty; cos_sin:
  // the layer's rotary table [max_position, head_dim], or empty for the decoder's.
  // group: the layer's KV cache group (forward's slot_mappings / block_tables index).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, torch::Tensor q_norm, torch::Tensor k_norm,
                 torch::Tensor attn_out_norm, torch::Tensor mlp_out_norm, torch::Tensor cos_sin,
                 torch::Tensor kv_cache, int64_t group, int64_t window, double softcap, torch::Tensor sinks,
                 std::vector<DecodeLinear> lin) {
    TORCH_CHECK(group >= 0, "the KV cache group must be >= 0, got ", group);
    TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == torch::kFloat32 && sinks.is_contiguous() &&
                                       sinks.numel() == hq_),
                "sinks must be float32 [num_heads] or empty");
    TORCH_CHECK(lin.size() == 4 || lin.size() == 2,
                "a layer has four linears (qkv, o, gate_up, down), or two and a sparse MLP (set_moe)");
    for (const auto& w : {input_norm, post_norm})
      TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == hidden_,
                  "norm weights must be float32 [hidden]");
    TORCH_CHECK(attn_out_norm.numel() == mlp_out_norm.numel(), "the sandwich norms come together");
    for (const auto& w : {attn_out_norm, mlp_out_norm})
      TORCH_CHECK(w.numel() == 0 || (w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == hidden_),
                  "sandwich norm weights must be float32 [hidden] or empty");
    if (cos_sin.numel()) check_cos_sin(cos_sin);
    TORCH_CHECK(q_norm.numel() == k_norm.numel(), "q_norm and k_norm come together");
    for (const auto& w : {q_norm, k_norm})
      TORCH_CHECK(w.numel() == 0 || (w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == d_),
                  "q/k norm weights must be float32 [head_dim] or empty");
    const KVElem elem = kv_elem(kv_cache.scalar_type());
    const int64_t row = elem == KVElem::kFloat32 ? d_ : d_ + kScaleBytes;
    TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                    kv_cache.size(3) == hkv_ && kv_cache.size(4) == row,
                "kv_cache must be [2, blocks, block_size, num_kv_heads, head_dim] (8-bit codes: head_dim + 4)");
    const int64_t qkv_width = (hq_ + 2 * hkv_) * d_;
    TORCH_CHECK(lin[0].N == qkv_width && lin[0].K == hidden_, "qkv_proj must be [", qkv_width, ", ", hidden_, "]");
    TORCH_CHECK(lin[1].N == hidden_ && lin[1].K == hq_ * d_, "o_proj shape");
    if (lin.size() == 4) {
      TORCH_CHECK(lin[2].N == 2 * inter_ && lin[2].K == hidden_, "gate_up_proj shape");
      TORCH_CHECK(lin[3].N == hidden_ && lin[3].K == inter_, "down_proj shape");
    }
    TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none), got ", softcap);
    std::optional<DecodeLinear> gate_up, down;
    if (lin.size() == 4) gate_up = lin[2], down = lin[3];
    layers_.push_back(DecodeLayer{input_norm, post_norm, q_norm, k_norm, attn_out_norm, mlp_out_norm, cos_sin,
                                 lin[0], lin[1], gate_up, down, nullptr, kv_cache, elem, group, window,
                                 static_cast<float>(softcap), sinks});
    num_groups_ = std::max(num_groups_, group + 1);
  }

  // Layer `index` (added with two linears) gets a sparse MLP: router [E, hidden] and the experts'
  // GGUF stacks gate_up [E, 2 I, row bytes of hidden] and down [E, hidden, row bytes of I] of the
  // given type indices; top_k experts a row, renormalised when renorm; int8 activations per 256
  // for the K-quant projections.
  void set_moe(int64_t index, DecodeLinear router, torch::Tensor router_float, torch::Tensor gate_up,
               int64_t gate_up_type, torch::Tensor down, int64_t down_type, int64_t top_k, bool renorm, bool int8) {
    TORCH_CHECK(index >= 0 && index < num_layers(), "no layer ", index);
    DecodeLayer& layer = layers_[index];
    TORCH_CHECK(!layer.gate_up, "layer ", index, " has a dense MLP");
    const int64_t E = router.N;
    TORCH_CHECK(router.K == hidden_, "the router must be [experts, hidden]");
    TORCH_CHECK(router_float.numel() == 0 || (router_float.scalar_type() == torch::kFloat32 &&
                                              router_float.sizes() == torch::IntArrayRef({E, hidden_})),
                "router_float must be float32 [experts, hidden] or empty");
    TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be in [1, ", E, "]");
    TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == E && down.size(0) == E &&
                    gate_up.size(1) % 2 == 0 && down.size(1) == hidden_ && gate_up.is_contiguous() &&
                    down.is_contiguous() && gate_up.scalar_type() == torch::kUInt8 &&
                    down.scalar_type() == torch::kUInt8,
                "expert stacks must be contiguous uint8 gate_up [E, 2 I, *] and down [E, hidden, *]");
    const int64_t I = gate_up.size(1) / 2;
    auto stack = [](const torch::Tensor& t, int64_t type, int64_t K) {
      TORCH_CHECK(type >= 0 && type < int64_t(gguf::Type::kCount), "unknown GGUF type index ", type);
      const gguf::Geometry g = gguf::kGeometry[type];
      TORCH_CHECK(K % g.elems == 0 && t.size(2) == K / g.elems * g.bytes, gguf::kTypeNames[type], " rows of ", K,
                  " elements do not take ", t.size(2), " bytes");
      return gguf::ExpertStack{t.data_ptr<uint8_t>(), gguf::Type(type), t.size(1), t.size(2), K};
    };
    layer.moe = std::make_shared<DecodeMoE>(DecodeMoE{router, router_float, gate_up, down,
                                                      stack(gate_up, gate_up_type, hidden_),
                                                      stack(down, down_type, I), E, top_k, renorm, int8});
  }

  // Layer `index`'s sparse MLP (set_moe) takes gpt-oss's form: the float router's bias [E] (or
  // empty: the router DecodeLinear carries its own), the experts' biases gate_up [E, 2 I] and down
  // [E, hidden], the clamped SwiGLU (alpha, limit), and the softmax over the selected logits.
  void set_moe_gpt_oss(int64_t index, torch::Tensor router_bias, torch::Tensor gate_up_bias,
                       torch::Tensor down_bias, double alpha, double limit) {
    TORCH_CHECK(index >= 0 && index < num_layers() && layers_[index].moe, "layer ", index, " has no sparse MLP");
    DecodeMoE& moe = *layers_[index].moe;
    const int64_t E = moe.E, I = moe.gu.rows / 2;
    TORCH_CHECK(router_bias.numel() == 0 || (moe.router_float.numel() && router_bias.scalar_type() == torch::kFloat32 &&
                                             router_bias.is_contiguous() && router_bias.numel() == E),
                "router_bias must be float32 [experts] beside a float router, or empty");
    TORCH_CHECK(gate_up_bias.scalar_type() == torch::kFloat32 && gate_up_bias.is_contiguous() &&
                    gate_up_bias.numel() == E * 2 * I,
                "gate_up_bias must be float32 [experts, 2 I]");
    TORCH_CHECK(down_bias.scalar_type() == torch::kFloat32 && down_bias.is_contiguous() &&
                    down_bias.numel() == E * hidden_,
                "down_bias must be float32 [experts, hidden]");
    moe.router_bias = router_bias, moe.gate_up_bias = gate_up_bias, moe.down_bias = down_bias;
    moe.act = gguf::ExpertAct{true, static_cast<float>(alpha), static_cast<float>(limit),
                              gate_up_bias.data_ptr<float>(), down_bias.data_ptr<float>()};
    moe.softmax_selected = true;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden: float32 [M, hidden] (the embeddings); residual: [M, hidden] or empty (the first
  // layer starts the residual stream); positions, seq_lens: int64 [M]; per KV cache group a
  // slot mapping (int64 [M]) and, for paged caches, block tables (int64 [M, max_blocks]);
  // contiguous-slot caches (one group) are read through slots (int64 [M], block tables then
  // ignored). Returns (h, residual) after the last layer.
  std::vector<torch::Tensor> forward(torch::Tensor hidden, torch::Tensor residual, torch::Tensor positions,
                                     std::vector<torch::Tensor> slot_mappings, std::vector<torch::Tensor> block_tables,
                                     torch::Tensor seq_lens, torch::Tensor slots) {
    TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.dim() == 2 && hidden.size(1) == hidden_,
                "hidden must be float32 [rows, hidden]");
    const int64_t M = hidden.size(0);
    const bool paged = slots.numel() == 0;
    TORCH_CHECK(static_cast<int64_t>(slot_mappings.size()) == num_groups_ &&
                    static_cast<int64_t>(block_tables.size()) == num_groups_,
                "one slot mapping and one block table per KV cache group (", num_groups_, ")");
    TORCH_CHECK(paged || num_groups_ == 1, "contiguous-slot caches hold one KV cache group");
    for (const auto* t : {&positions, &seq_lens})
      TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == M,
                  "positions and seq_lens must be int64 [rows]");
    for (int64_t g = 0; g < num_groups_; ++g) {
      const auto& sm = slot_mappings[g];
      const auto& bt = block_tables[g];
      TORCH_CHECK(sm.scalar_type() == torch::kInt64 && sm.is_contiguous() && sm.numel() == M,
                  "slot_mapping must be int64 [rows]");
      TORCH_CHECK(paged ? bt.scalar_type() == torch::kInt64 && bt.dim() == 2 && bt.size(0) >= M && bt.stride(1) == 1
                        : slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == M,
                  "block_tables must be int64 [rows, max_blocks] (or slots int64 [rows])");
    }
    for (const DecodeLayer& layer : layers_)
      TORCH_CHECK(layer.gate_up || layer.moe, "layer ", &layer - layers_.data(), " has no MLP (set_moe)");
    const int64_t* pos = positions.data_ptr<int64_t>();
    int64_t max_position = cos_sin_.size(0);
    for (const DecodeLayer& layer : layers_)
      if (layer.cos_sin.numel()) max_position = std::min(max_position, layer.cos_sin.size(0));
    for (int64_t t = 0; t < M; ++t)
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " outside the rotary cache (",
                  max_position, " positions)");

    auto h_out = hidden.contiguous().clone();
    auto res_out = residual.numel() ? residual.contiguous().clone() : torch::empty_like(h_out);
    float* h = h_out.data_ptr<float>();
    float* res = res_out.data_ptr<float>();
    const int64_t H = hidden_, QKV = (hq_ + 2 * hkv_) * d_, QD = hq_ * d_, KD = hkv_ * d_;
    xn_.resize(M * H);
    qkv_.resize(M * QKV);
    q_.resize(M * QD);
    k_.resize(M * KD);
    attn_.resize(M * QD);
    gu_.resize(M * 2 * inter_);
    act_.resize(M * inter_);
    bool first = residual.numel() == 0;
    for (const DecodeLayer& layer : layers_) {
      const size_t li = &layer - layers_.data();  // LoRA deltas (lora_delta.h) after each projection
      if (first) {
        std::memcpy(res, h, sizeof(float) * M * H);
        first = false;
      } else {
        add_rows<float>(h, H, res, H, res, M, H);
      }
      rms_norm_rows<float>(res, H, layer.input_norm.data_ptr<float>(), xn_.data(), H, M, H, eps_, norm_offset_);
      layer.qkv(xn_.data(), M, qkv_.data(), int16_max_rows_, tile_max_rows_);
      lora_.apply(li, 0, xn_.data(), M, H, qkv_.data(), QKV);
      if (layer.q_norm.numel()) {  // in place, each head's D values of q then of k
        const float* qw = layer.q_norm.data_ptr<float>();
        const float* kw = layer.k_norm.data_ptr<float>();
        for (int64_t t = 0; t < M; ++t) {
          float* row = qkv_.data() + t * QKV;
          rms_norm_rows<float>(row, d_, qw, row, d_, hq_, d_, qk_norm_eps_, norm_offset_);
          rms_norm_rows<float>(row + QD, d_, kw, row + QD, d_, hkv_, d_, qk_norm_eps_, norm_offset_);
        }
      }
      const float* cos_sin = (layer.cos_sin.numel() ? layer.cos_sin : cos_sin_).data_ptr<float>();
      rotate_rows<float>(qkv_.data(), QKV, q_.data(), hq_, d_, pos, cos_sin, M);
      rotate_rows<float>(qkv_.data() + QD, QKV, k_.data(), hkv_, d_, pos, cos_sin, M);
      const int64_t* slot_map = slot_mappings[layer.group].data_ptr<int64_t>();
      const torch::Tensor& tables = block_tables[layer.group];
      const float* sinks = layer.sinks.numel() ? layer.sinks.data_ptr<float>() : nullptr;
      dispatch_kv(layer.kv_elem, [&](auto kv_tag) {
        using KV = decltype(kv_tag);
        // K/V rows into the cache (the same rows the per-module path's write_kv writes).
        const int64_t row = kv_row_width<KV>(d_), token_row = hkv_ * row;
        KV* k_cache = reinterpret_cast<KV*>(layer.kv_cache.data_ptr());
        const int64_t plane_rows = layer.kv_cache.numel() / 2 / token_row;
        KV* v_cache = k_cache + plane_rows * token_row;
        for (int64_t t = 0; t < M; ++t) {
          TORCH_CHECK(slot_map[t] >= 0 && slot_map[t] < plane_rows, "slot ", slot_map[t], " outside the KV cache");
          for (int64_t hh = 0; hh < hkv_; ++hh) {
            const int64_t at = slot_map[t] * token_row + hh * row;
            quantize_row<KV>(k_.data() + t * KD + hh * d_, d_, k_cache + at);
            quantize_row<KV>(qkv_.data() + t * QKV + QD + KD + hh * d_, d_, v_cache + at);
          }
        }
        if (paged) {
          decode_kernel<float, PagedRows, KV>(q_.data(), k_cache, v_cache,
                                              PagedRows{tables.data_ptr<int64_t>(), tables.stride(0),
                                                        layer.kv_cache.size(2)},
                                              seq_lens.data_ptr<int64_t>(), attn_.data(), M, hq_, hkv_, d_, scale_,
                                              layer.window, layer.softcap, sinks);
        } else {
          decode_kernel<float, SlotRows, KV>(q_.data(), k_cache, v_cache,
                                             SlotRows{slots.data_ptr<int64_t>(), layer.kv_cache.size(2)},
                                             seq_lens.data_ptr<int64_t>(), attn_.data(), M, hq_, hkv_, d_, scale_,
                                             layer.window, layer.softcap, sinks);
        }
      });
      layer.o(attn_.data(), M, h, int16_max_rows_, tile_max_rows_);
      lora_.apply(li, 1, attn_.data(), M, QD, h, H);
      const bool sandwich = layer.attn_out_norm.numel() != 0;
      if (sandwich) rms_norm_rows<float>(h, H, layer.attn_out_norm.data_ptr<float>(), h, H, M, H, eps_, norm_offset_);
      add_rows<float>(h, H, res, H, res, M, H);
      rms_norm_rows<float>(res, H, layer.post_norm.data_ptr<float>(), xn_.data(), H, M, H, eps_, norm_offset_);
      if (layer.moe) {
        const DecodeMoE& moe = *layer.moe;
        logits_.resize(M * moe.E);
        ids_.resize(M * moe.top_k);
        weights_.resize(M * moe.top_k);
        if (moe.router_float.numel()) {
          const auto xt = torch::from_blob(xn_.data(), {M, H}, torch::kFloat32);
          torch::from_blob(logits_.data(), {M, moe.E}, torch::kFloat32).copy_(moe.router_bias.numel() ? at::linear(xt, moe.router_float, moe.router_bias)
                                       : at::linear(xt, moe.router_float));
        } else {
          moe.router(xn_.data(), M, logits_.data(), int16_max_rows_, tile_max_rows_);
        }
        for (int64_t t = 0; t < M; ++t)
          route_row(logits_.data() + t * moe.E, moe.E, moe.top_k, moe.renorm, ids_.data() + t * moe.top_k,
                    weights_.data() + t * moe.top_k, moe.softmax_selected);
        std::memset(h, 0, sizeof(float) * M * H);
        gguf::moe_grouped(xn_.data(), M, ids_.data(), weights_.data(), moe.top_k, moe.E, moe.gu, moe.dn, h, moe.int8, moe.act);
      } else {
        (*layer.gate_up)(xn_.data(), M, gu_.data(), int16_max_rows_, tile_max_rows_);
        lora_.apply(li, 2, xn_.data(), M, H, gu_.data(), 2 * inter_);
        if (gelu_tanh_) {
          gated_mul_rows_avx2<Gate::kGeluTanh>(gu_.data(), 2 * inter_, act_.data(), M, inter_);
        } else {
          gated_mul_rows_avx2<Gate::kSilu>(gu_.data(), 2 * inter_, act_.data(), M, inter_);
        }
        (*layer.down)(act_.data(), M, h, int16_max_rows_, tile_max_rows_);
        lora_.apply(li, 3, act_.data(), M, inter_, h, H);
      }
      if (sandwich) rms_norm_rows<float>(h, H, layer.mlp_out_norm.data_ptr<float>(), h, H, M, H, eps_, norm_offset_);
    }
    return {h_out, res_out};
  }

 private:
  void check_cos_sin(const torch::Tensor& t) const {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == 2 && t.size(1) == d_,
                "cos_sin_cache must be float32 [max_position, head_dim]");
  }

  int64_t hidden_, hq_, hkv_, d_, inter_;
  float eps_, scale_, qk_norm_eps_;
  float norm_offset_;       // every norm scales by weight + norm_offset_ (Gemma: 1)
  bool gelu_tanh_ = false;  // the MLP's activation: gelu's tanh form, else silu
  int64_t num_groups_ = 0;  // KV cache groups the layers read (1 + the largest group index)
  torch::Tensor cos_sin_;
  int64_t int16_max_rows_, tile_max_rows_;
  std::vector<DecodeLayer> layers_;

 public:
  LoRAHooks lora_;  // per-row adapter deltas; none until set_lora / set_lora_rows

 private:
  // Buffers reused from step to step (one forward at a time per object).
  std::vector<float> xn_, qkv_, q_, k_, attn_, gu_, act_, logits_, weights_;
  std::vector<int64_t> ids_;
};

}  // namespace pagedllm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pagedllm::DecodeLinear;
  using pagedllm::GGUFDecodeWeight;
  m.def("gguf_type_names", [] { return std::vector<std::string>(std::begin(pagedllm::gguf::kTypeNames),
                                                                 std::end(pagedllm::gguf::kTypeNames)); },
        "the GGUF types the GGUF-blocks form takes, in the order of its type index");
  // module_local: each ISA level's build registers its own classes (a process may load two).
  pybind11::class_<DecodeLinear>(m, "DecodeLinear", pybind11::module_local())
      .def(pybind11::init<int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          int64_t>(),
           "(bits 32/8/4, weight, scales, zeros, bias, bf16 copy, bf16_min_rows): float32 or int8/int4")
      .def_static("gguf",
                  [](torch::Tensor data, int64_t type, int64_t K, int64_t small_max_rows, int64_t chunk_rows,
                     int64_t panel_min_rows, torch::Tensor bias, torch::Tensor bf16, int64_t bf16_min_rows,
                     std::string small_path) {
                    return DecodeLinear::from_gguf(
                        GGUFDecodeWeight(data, type, K, small_max_rows, chunk_rows, panel_min_rows,
                                         std::move(small_path)),
                        bias, bf16, bf16_min_rows);
                  },
                  "(blocks uint8 [N, row bytes], type index, K, small_max_rows, chunk_rows, panel_min_rows "
                  "(bf16 panels from this many rows; 0: never), bias, bf16 copy, bf16_min_rows, small_path "
                  "(\"\" or \"fast\": int8 activations for the K-quants))")
      .def_static("sections", &DecodeLinear::from_sections,
                  "(parts, offsets, bias, bf16 copy, bf16_min_rows): part i's rows at offsets[i]")
      .def_readonly("N", &DecodeLinear::N)
      .def_readonly("K", &DecodeLinear::K);
  pybind11::class_<pagedllm::LlamaDecodeLayers>(m, "LlamaDecodeLayers", pybind11::module_local())
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, torch::Tensor, double, int64_t,
                          int64_t, std::string, double>())
      .def("add_layer", &pagedllm::LlamaDecodeLayers::add_layer)
      .def("set_moe", &pagedllm::LlamaDecodeLayers::set_moe,
           "(layer, router, its float32 weight or empty, gate_up stack, its type index, down stack, its type index, "
           "top_k, renorm, int8)")
      .def("set_moe_gpt_oss", &pagedllm::LlamaDecodeLayers::set_moe_gpt_oss,
           "(layer, float router's bias or empty, gate_up_bias [E, 2 I], down_bias [E, hidden], alpha, limit)")
      .def("num_layers", &pagedllm::LlamaDecodeLayers::num_layers)
      .def("set_lora", [](pagedllm::LlamaDecodeLayers& d, int64_t layer, std::vector<torch::Tensor> a,
                          std::vector<torch::Tensor> b, std::vector<std::vector<int64_t>> sections,
                          int64_t rank) { d.lora_.set_layer(layer, a, b, sections, rank); })
      .def("set_lora_rows", [](pagedllm::LlamaDecodeLayers& d, torch::Tensor rows) { d.lora_.set_rows(rows); })
      .def("forward", &pagedllm::LlamaDecodeLayers::forward, "every decoder layer over a decode step's rows");
}
