"""Llama (and the Llama-shaped Mistral and Qwen2) over a flat batch of tokens.

Forward-only: `forward(input_ids, positions)` -> hidden states of every token,
`compute_logits(hidden_states)` at the positions that sample. Parameter names are HF's except
the fused projections (`qkv_proj` from q/k/v_proj, `gate_up_proj` from gate/up_proj), which
`load_weights` fills through the layers' weight loaders (models/utils.py). The modules read
only the normalized `ArchConfig`; each family's differences live in its declaration below.
Families built on these modules (models/qwen3.py) subclass the layer and declare its layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import rope_parameters, rotary_embedding_for
from pagedllm.layers.utils import default_dtype
from pagedllm.models.config_utils import decoder_sizes, sliding_windows_of
from pagedllm.models.family import LLAMA_GGUF_BLOCK_NAMES, ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.fused_decode import DecodeLayout, FusedDecoderLayers
from pagedllm.models.gguf_rope import llama3_rope_from_freq_factors
from pagedllm.models.utils import load_named_weights

# (fused parameter, checkpoint projection, shard id)
PACKED_MODULES = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
# Checkpoint entries that are not parameters here (rotary caches of old checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: nn.Module) -> None:
        super().__init__()
        if arch.qk_norm and type(self) is LlamaAttention:
            # The config asks for an op this module does not compute: never drop it silently.
            raise ValueError("LlamaAttention has no q/k norm; the family needs its own attention (qwen3.py)")
        head_dim = arch.head_dim
        self.qkv_proj = QKVLinear(arch.hidden_size, head_dim, arch.num_heads, arch.num_kv_heads, arch.qkv_bias)
        self.o_proj = RowParallelLinear(arch.num_heads * head_dim, arch.hidden_size, bias=arch.o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(  # this rank's heads (all of them without tensor parallelism)
            self.qkv_proj.num_heads,
            head_dim,
            self.qkv_proj.num_kv_heads,
            scale=head_dim**-0.5,
            sliding_window=arch.sliding_window(layer_idx),
            logit_soft_cap=arch.attn_logit_softcap,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> [T, hidden]
        qkv = self.qkv_proj(hidden_states)  # [T, (H + 2 * Hkv) * D]
        q, k, v = self.qkv_proj.split(qkv)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.activation != "silu":
            raise ValueError(f"hidden_act={arch.activation!r} is not supported (only 'silu')")
        inter = arch.intermediate_size
        self.gate_up_proj = MergedLinear(arch.hidden_size, [inter, inter], bias=arch.mlp_bias)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, bias=arch.mlp_bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> gate_up: [T, 2 * intermediate] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.arch = arch
        self.self_attn = self.attention_class(arch, layer_idx, rotary_emb)
        self.mlp = self.build_mlp(arch, layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.norm_eps)

    def build_mlp(self, arch: ArchConfig, layer_idx: int) -> nn.Module:
        """The layer's MLP: [T, hidden] -> [T, hidden] (a sparse one in models/moe_utils.py)."""
        return LlamaMLP(arch)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def decode_layout(self) -> DecodeLayout | None:
        """What this class's forward computes (models/fused_decode.py); None when its
        submodules are not the ones this declaration describes."""
        if type(self.self_attn) is not LlamaAttention or type(self.mlp) is not LlamaMLP or self.arch.qk_norm:
            return None
        return DecodeLayout(self.arch)


class LlamaModel(nn.Module):
    decoder_layer: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        assert arch.rope is not None, arch
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        # One cos/sin cache shared by every layer (LongRoPE's module for "longrope").
        rope = dict(arch.rope, partial_rotary_factor=arch.partial_rotary_factor)
        rotary_emb = rotary_embedding_for(arch.head_dim, arch.max_position_embeddings, rope)
        self.layers = nn.ModuleList(
            self.decoder_layer(arch, i, rotary_emb) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.norm_eps)
        # Decode steps of a few rows: every layer in one compiled call (models/fused_decode.py).
        self.fused_layers = FusedDecoderLayers()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]; inputs_embeds: [T, hidden] given by a
        # vision-language model (image rows written over the placeholders) instead of the lookup
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.fused_layers.applies(self.layers, hidden_states):
            hidden_states, residual = self.fused_layers(positions, hidden_states)
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    inner_model: type[LlamaModel] = LlamaModel

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = arch.hf
        self.arch = arch
        with default_dtype(dtype):
            self.model = self.inner_model(arch)
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size)
        self.tie_word_embeddings = arch.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden_states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] (only the sampled positions) -> logits: [N, vocab] float32
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the parameter names that were filled.

        Raises ValueError if a parameter (or a shard of a fused one) got no tensor.
        """

        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name.endswith(_IGNORED_SUFFIXES):
                return None
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the tied head is the embedding, loaded under its own name
            return name, tensor

        return load_named_weights(self, weights, stacked=PACKED_MODULES, transform=transform)


def llama_arch_config(hf: Any, **overrides: Any) -> ArchConfig:
    """The ArchConfig of a Llama-shaped HF config; `overrides` state a family's differences."""
    bias = bool(getattr(hf, "attention_bias", False))
    rope = rope_parameters(hf)
    fields: dict[str, Any] = dict(
        **decoder_sizes(hf),
        norm_eps=hf.rms_norm_eps,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        activation=hf.hidden_act,
        rope=rope,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_windows=sliding_windows_of(hf),
        hf=hf,
    )
    return replace(ArchConfig(**fields), **overrides)


# llama.cpp's MoE tensors in a `llama` file (Mixtral) -> ours (models/moe_utils.py's names;
# `{expert}`: a 3-D tensor split per expert).
MIXTRAL_GGUF_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}


def _mixtral_config_from_gguf(reader: Any, hf_config: Any) -> dict[str, Any]:
    """A `llama` file with `llama.expert_count` is a Mixtral (transformers' GGUF reader has no
    Mixtral and builds a LlamaConfig): name the architecture and its experts."""
    count = reader.fields.get("llama.expert_count")
    if count is None or int(count.contents()) == 0:
        return {}
    used = reader.fields["llama.expert_used_count"]
    return {
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": int(count.contents()),
        "num_experts_per_tok": int(used.contents()),
    }


def _llama_config_from_gguf(reader: Any, hf_config: Any) -> dict[str, Any]:
    """Mixtral's experts (above) and Llama 3's rope scaling, which llama.cpp stores only as
    the rope_freqs tensor (models/gguf_rope.py)."""
    out = _mixtral_config_from_gguf(reader, hf_config)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        params = rope_parameters(hf_config)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        rope = llama3_rope_from_freq_factors(freqs.data, float(params["rope_theta"]), head_dim)
        if rope is not None:
            out["rope_parameters"] = rope
    return out


def _qwen2_arch_config(hf: Any) -> ArchConfig:
    # Qwen2 has biases on q/k/v but not on o_proj, whatever attention_bias says.
    return llama_arch_config(hf, qkv_bias=True, o_bias=False)


FAMILIES = (
    ModelFamily(
        name="Llama",
        architectures=("LlamaForCausalLM",),
        model_class=LlamaForCausalLM,
        arch_config=llama_arch_config,
        packed_modules=PACKED_MODULES,
        # llama.cpp permutes Q/K rows for its rope kernel and precomputes llama3 rope
        # factors (rope_freqs), which our rotary embedding derives from the config.
        # Mixtral files are `llama` too, with expert tensors (models/mixtral.py).
        gguf=GGUFSpec(
            "llama",
            LLAMA_GGUF_BLOCK_NAMES,
            optional_block_names=MIXTRAL_GGUF_BLOCK_NAMES,
            permuted_qk=True,
            skipped_tensors=("rope_freqs.weight",),
            config_from_gguf=_llama_config_from_gguf,
        ),
        supports_tensor_parallel=True,
    ),
    ModelFamily(
        name="Mistral",
        architectures=("MistralForCausalLM",),
        model_class=LlamaForCausalLM,
        arch_config=llama_arch_config,
        packed_modules=PACKED_MODULES,
        supports_tensor_parallel=True,
    ),
    ModelFamily(
        name="Qwen2",
        architectures=("Qwen2ForCausalLM",),
        model_class=LlamaForCausalLM,
        arch_config=_qwen2_arch_config,
        packed_modules=PACKED_MODULES,
        gguf=GGUFSpec("qwen2", LLAMA_GGUF_BLOCK_NAMES),
        supports_tensor_parallel=True,
    ),
)
