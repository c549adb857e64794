"""Gemma 3 (text only): the Gemma 2 layer (models/gemma2.py) with an RMSNorm over each query
and key head, and a rotary base per layer kind.

Gemma 3's differences from Gemma 2, all stated here: per-head q/k RMSNorm (scaling by
1 + weight) before the rotary embedding; the local (sliding-window) and global layers each
with their own rotary base (1e4 and 1e6 in the released checkpoints); a sliding-window
pattern of five local layers to one global (from `layer_types`); no soft-caps in its
checkpoints (the attention and final ones apply where a config sets them, as Gemma 2's);
the text weights of a multimodal checkpoint under "language_model.". Sandwich norms, the
(1 + weight) scale, sqrt(hidden) embeddings, GELU(tanh), query_pre_attn_scalar and tied
embeddings are Gemma 2's.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.models.family import ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.fused_decode import DecodeLayout
from pagedllm.models.gemma2 import (
    GEMMA_GGUF_BLOCK_NAMES,
    PACKED_MODULES,
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2MLP,
    Gemma2ForCausalLM,
    Gemma2Model,
    gemma_arch_config,
)


def layer_rope_parameters(config: Any, sliding: bool) -> dict[str, Any]:
    """Rope settings of the local (sliding) or global layers.

    transformers 5 keys `rope_parameters` by layer type; older configs give the global
    settings flat and the local base as `rope_local_base_freq`.
    """
    params = getattr(config, "rope_parameters", None) or {}
    layer_type = "sliding_attention" if sliding else "full_attention"
    if layer_type in params:
        flat = dict(params[layer_type])
        flat.setdefault("rope_type", "default")
        return flat
    if sliding:
        return {"rope_type": "default", "rope_theta": config.rope_local_base_freq}
    return rope_parameters(config)


class Gemma3Attention(Gemma2Attention):
    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(arch, layer_idx, rotary_emb)
        self.head_dim = arch.head_dim
        self.q_norm = GemmaRMSNorm(arch.head_dim, arch.norm_eps)
        self.k_norm = GemmaRMSNorm(arch.head_dim, arch.norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> [T, hidden]
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        # Norms per head: [T, H * D] -> [T, H, D] -> back.
        q = self.q_norm(q.view(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.view(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention

    def decode_layout(self) -> DecodeLayout | None:
        """Gemma 2's layout with the q/k norms (models/fused_decode.py); each layer's rotary
        table is its kind's."""
        if type(self.self_attn) is not Gemma3Attention or type(self.mlp) is not Gemma2MLP or not self.arch.qk_norm:
            return None
        return DecodeLayout(self.arch)


class Gemma3Model(Gemma2Model):
    decoder_layer = Gemma3DecoderLayer

    @staticmethod
    def rotary_embeddings(arch: ArchConfig) -> list[RotaryEmbedding]:
        """One cos/sin cache per layer kind, shared by the layers of that kind."""
        head_dim, max_pos = arch.head_dim, arch.max_position_embeddings
        local_rope = RotaryEmbedding(head_dim, max_pos, layer_rope_parameters(arch.hf, sliding=True))
        global_rope = RotaryEmbedding(head_dim, max_pos, layer_rope_parameters(arch.hf, sliding=False))
        return [local_rope if arch.sliding_window(i) is not None else global_rope for i in range(arch.num_layers)]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    inner_model = Gemma3Model
    checkpoint_prefix = "language_model."  # the text weights of a multimodal checkpoint


def _config_from_gguf(reader: Any, hf: Any) -> dict[str, Any]:
    """The rope scaling of the global (full-attention) layers, which transformers' GGUF reader
    leaves out: llama.cpp's converter writes Gemma 3 4B and up's `rope_scaling` (linear, factor
    8) as gemma3.rope.scaling.type / .factor; the local layers are never scaled."""
    fields = reader.fields
    kind, factor = fields.get("gemma3.rope.scaling.type"), fields.get("gemma3.rope.scaling.factor")
    if kind is None or factor is None or str(kind.contents()) == "none":
        return {}
    params = dict(getattr(hf, "rope_parameters", None) or {})
    full = dict(params.get("full_attention") or {"rope_theta": getattr(hf, "rope_theta", 1e6)})
    full.update(rope_type=str(kind.contents()), factor=float(factor.contents()))
    params["full_attention"] = full
    params.setdefault("sliding_attention", {"rope_type": "default", "rope_theta": 10000.0})
    return {"rope_parameters": params}


def _gemma3_arch_config(hf: Any) -> ArchConfig:
    # rope: the global layers'; the local ones' come from layer_rope_parameters.
    return gemma_arch_config(hf, qk_norm=True)


FAMILIES = (
    ModelFamily(
        name="Gemma 3",
        architectures=("Gemma3ForCausalLM",),
        model_class=Gemma3ForCausalLM,
        arch_config=_gemma3_arch_config,
        packed_modules=PACKED_MODULES,
        # Gemma 2's names and (1 + weight) norm scales, plus the q/k norms.
        gguf=GGUFSpec(
            "gemma3",
            {**GEMMA_GGUF_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
            norm_plus_one=True,
            config_from_gguf=_config_from_gguf,
        ),
    ),
)
