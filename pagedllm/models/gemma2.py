"""Gemma 2 over a flat batch of tokens.

What sets it apart from Llama: RMSNorm scaling by (1 + weight), embeddings multiplied by
sqrt(hidden_size), norms after attention and after the MLP as well as before them, a
GELU(tanh)-gated MLP, attention scaled by query_pre_attn_scalar**-0.5 (not head_dim**-0.5),
attention scores soft-capped to c * tanh(s / c) (`attn_logit_softcapping`, passed to every
Attention layer: each attention path applies it), the logits soft-capped the same way
(`final_logit_softcapping`), and sliding-window layers alternating with global ones
(`layer_types`; HF's default: even layers slide). One rotary base for every layer (Gemma 3
has two), no q/k norm (Gemma 3 has one). Tied embeddings.
Parameter names are HF's except the fused `qkv_proj` and `gate_up_proj`. Gemma 3
(models/gemma3.py) is built on these modules: its attention adds the q/k norms, its model
a rotary base per layer kind.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Iterable

import torch
from torch import nn

from pagedllm.layers.activation import GeluAndMul, gelu_approximation
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead, VocabEmbedding
from pagedllm.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.layers.utils import default_dtype
from pagedllm.models.config_utils import decoder_sizes, sliding_windows_of
from pagedllm.models.family import LLAMA_GGUF_BLOCK_NAMES, ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.fused_decode import DecodeLayout, FusedDecoderLayers
from pagedllm.models.utils import load_named_weights

PACKED_MODULES = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


# llama.cpp's block names of the sandwich layout (Gemma 2; Gemma 3 adds the q/k norms).
GEMMA_GGUF_BLOCK_NAMES = {
    **LLAMA_GGUF_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class Gemma2Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = arch.head_dim
        self.qkv_proj = QKVLinear(arch.hidden_size, head_dim, arch.num_heads, arch.num_kv_heads, arch.qkv_bias)
        self.o_proj = RowParallelLinear(arch.num_heads * head_dim, arch.hidden_size, bias=arch.o_bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            self.qkv_proj.num_kv_heads,
            scale=arch.hf.query_pre_attn_scalar**-0.5,
            sliding_window=arch.sliding_window(layer_idx),
            logit_soft_cap=arch.attn_logit_softcap,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> [T, hidden]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma2MLP(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = MergedLinear(arch.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, arch.hidden_size)
        self.act_fn = GeluAndMul(gelu_approximation(arch.activation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, 2 * intermediate] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2DecoderLayer(nn.Module):
    attention_class: type[Gemma2Attention] = Gemma2Attention

    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.norm_eps
        self.arch = arch
        self.self_attn = self.attention_class(arch, layer_idx, rotary_emb)
        self.mlp = Gemma2MLP(arch)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # Sandwich norms: each sublayer's input and output normed, the residual stream not.
        attn_out = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp_out)

    def decode_layout(self) -> DecodeLayout | None:
        """What this class's forward computes (models/fused_decode.py): sandwich norms by
        (1 + weight), gelu's tanh form, no q/k norm; None when its submodules are others."""
        if type(self.self_attn) is not Gemma2Attention or type(self.mlp) is not Gemma2MLP or self.arch.qk_norm:
            return None
        return DecodeLayout(self.arch)


class Gemma2Model(nn.Module):
    decoder_layer: type[Gemma2DecoderLayer] = Gemma2DecoderLayer

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        # sqrt(hidden) rounded to the model dtype first, as HF does.
        normalizer = torch.tensor(math.sqrt(arch.hidden_size), dtype=torch.get_default_dtype())
        self.register_buffer("normalizer", normalizer, persistent=False)
        rotary = self.rotary_embeddings(arch)
        self.layers = nn.ModuleList(self.decoder_layer(arch, i, rotary[i]) for i in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.norm_eps)
        # Decode steps of a few rows: every layer in one compiled call (models/fused_decode.py).
        self.fused_layers = FusedDecoderLayers()

    @staticmethod
    def rotary_embeddings(arch: ArchConfig) -> list[RotaryEmbedding]:
        """Each layer's rotary embedding: one cos/sin cache shared by every layer."""
        assert arch.rope is not None, arch
        rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, dict(arch.rope))
        return [rotary_emb] * arch.num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> [T, hidden]
        hidden_states = self.embed_tokens(input_ids) * self.normalizer
        if self.fused_layers.applies(self.layers, hidden_states):
            # (the last layer's normed MLP output, the residual stream before it)
            hidden_states, residual = self.fused_layers(positions, hidden_states)
            return self.norm(residual + hidden_states)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class Gemma2ForCausalLM(nn.Module):
    inner_model: type[Gemma2Model] = Gemma2Model
    checkpoint_prefix: str | None = None
    """Stripped from checkpoint names (Gemma 3: a multimodal checkpoint's "language_model.")."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if getattr(arch.hf, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__} with use_bidirectional_attention=True is not supported")
        self.config = arch.hf
        self.arch = arch
        with default_dtype(dtype):
            self.model = self.inner_model(arch)
            self.lm_head = LMHead(arch.vocab_size, arch.hidden_size)
        self.tie_word_embeddings = arch.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)
        self.final_logit_softcap = arch.final_logit_softcap

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] int64 -> hidden_states: [num_tokens, hidden]
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] -> logits: [N, vocab] float32
        logits = self.lm_head(hidden_states).float()
        cap = self.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap  # smoothly bounded to (-cap, cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def transform(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
            if name == "lm_head.weight" and self.tie_word_embeddings:
                return None  # the tied head is the embedding, loaded under its own name
            if self.checkpoint_prefix is not None:
                name = name.removeprefix(self.checkpoint_prefix)
            return name, tensor

        return load_named_weights(self, weights, stacked=PACKED_MODULES, transform=transform)


def gemma_arch_config(hf: Any, **overrides: Any) -> ArchConfig:
    """The ArchConfig of a Gemma 2 or 3 config; `overrides` state a family's differences."""
    bias = bool(getattr(hf, "attention_bias", False))
    fields: dict[str, Any] = dict(
        **decoder_sizes(hf),
        norm_eps=hf.rms_norm_eps,
        norm_offset=1.0,
        norm_placement="sandwich",
        qkv_bias=bias,
        o_bias=bias,
        activation=hf.hidden_activation,
        rope=rope_parameters(hf),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        sliding_windows=sliding_windows_of(hf),
        attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
        hf=hf,
    )
    return replace(ArchConfig(**fields), **overrides)


def _config_from_gguf(reader: Any, hf: Any) -> dict[str, Any]:
    """What transformers' GGUF reader leaves at Gemma2Config's defaults, as llama.cpp reads
    the file: the soft-caps from their keys (absent: llama.cpp's defaults, 50 and 30, which
    are HF's too), and the attention scale, which the file does not store: llama.cpp takes
    head_dim**-0.5, and (hidden / heads)**-0.5 for the 46-layer 27B (query_pre_attn_scalar
    144 there)."""
    fields = reader.fields
    out: dict[str, Any] = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = fields.get(f"gemma2.{key}")
        if value is not None:
            out[key] = float(value.contents())
    if hf.num_hidden_layers == 46:
        out["query_pre_attn_scalar"] = hf.hidden_size // hf.num_attention_heads
    else:
        out["query_pre_attn_scalar"] = hf.head_dim
    return out


FAMILIES = (
    ModelFamily(
        name="Gemma 2",
        architectures=("Gemma2ForCausalLM",),
        model_class=Gemma2ForCausalLM,
        arch_config=gemma_arch_config,
        packed_modules=PACKED_MODULES,
        # llama.cpp's "gemma2": RMSNorm scales stored as (1 + weight); the soft-caps are metadata keys (`gemma2.attn_logit_softcapping`,
        # `gemma2.final_logit_softcapping`), read at conversion (gguf_loader.py).
        gguf=GGUFSpec(
            "gemma2",
            GEMMA_GGUF_BLOCK_NAMES,
            norm_plus_one=True,
            config_from_gguf=_config_from_gguf,
        ),
    ),
)
