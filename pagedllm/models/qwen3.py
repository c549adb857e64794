"""Qwen3 (dense): the Llama layer with an RMSNorm over each query and key head.

Qwen3's differences from Llama, all stated here: per-head q/k RMSNorm before the rotary
embedding, no q/k/v bias (`attention_bias` covers q, k, v and o alike), a `head_dim` of its own
(128 in Qwen3-0.6B, whose hidden/heads is 64), and llama.cpp's "qwen3" GGUF names (rotary in
HF's layout: no Q/K permutation). The decode layout adds `qk_norm`, which the fused decode runs.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.family import LLAMA_GGUF_BLOCK_NAMES, ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.fused_decode import DecodeLayout
from pagedllm.models.llama import (
    PACKED_MODULES,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    llama_arch_config,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(arch, layer_idx, rotary_emb)
        self.head_dim = arch.head_dim
        self.q_norm = RMSNorm(arch.head_dim, arch.norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [T, hidden] -> [T, hidden]
        num_tokens, d = hidden_states.shape[0], self.head_dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        # Norms per head: [T, H * D] -> [T * H, D] -> back.
        q = self.q_norm(q.reshape(-1, d)).view(num_tokens, -1)
        k = self.k_norm(k.reshape(-1, d)).view(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_class = Qwen3Attention

    def decode_layout(self) -> DecodeLayout | None:
        if type(self.self_attn) is not Qwen3Attention or type(self.mlp) is not LlamaMLP:
            return None
        return DecodeLayout(self.arch)  # its arch declares the q/k norm


class Qwen3Model(LlamaModel):
    decoder_layer = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    inner_model = Qwen3Model


def _qwen3_arch_config(hf: Any) -> ArchConfig:
    return llama_arch_config(hf, qk_norm=True)


FAMILIES = (
    ModelFamily(
        name="Qwen3",
        architectures=("Qwen3ForCausalLM",),
        model_class=Qwen3ForCausalLM,
        arch_config=_qwen3_arch_config,
        packed_modules=PACKED_MODULES,
        gguf=GGUFSpec(
            "qwen3",
            {**LLAMA_GGUF_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
        ),
    ),
)
