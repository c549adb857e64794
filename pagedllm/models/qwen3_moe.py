"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, models/qwen3.py), sparse MLPs
(layers/moe.py): top-`num_experts_per_tok` of `num_experts` (8 of 128 in Qwen3-30B-A3B),
renormalised when `norm_topk_prob` (True in the released checkpoints; HF's config default is
False, its GGUF reader's True, as llama.cpp computes), no shared expert; `decoder_sparse_step`
/ `mlp_only_layers` make some layers dense (models/moe_utils.py). GGUF: llama.cpp's
`qwen3moe`. Decode steps run the fused decode where the experts are a GGUF file's kept
blocks (the grouped call's stacks), else module by module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedllm.models.family import ArchConfig, GGUFSpec, ModelFamily
from pagedllm.layers.moe import SparseMoE
from pagedllm.models.fused_decode import DecodeLayout
from pagedllm.models.llama import PACKED_MODULES, LlamaMLP, LlamaModel, llama_arch_config
from pagedllm.models.moe_utils import (
    DENSE_MLP_GGUF_NAMES,
    MOE_GGUF_BLOCK_NAMES,
    MOE_GGUF_COMMON_NAMES,
    MoEForCausalLM,
    build_mlp,
    moe_config,
    moe_config_from_gguf,
)
from pagedllm.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, arch: ArchConfig, layer_idx: int) -> nn.Module:
        return build_mlp(arch, layer_idx)

    def decode_layout(self) -> DecodeLayout | None:
        """Qwen3's layout with a sparse or dense MLP (models/fused_decode.py runs a sparse one
        whose experts are GGUF stacks through the grouped call)."""
        if type(self.self_attn) is not Qwen3Attention or type(self.mlp) not in (LlamaMLP, SparseMoE):
            return None
        return DecodeLayout(self.arch)


class Qwen3MoeModel(LlamaModel):
    decoder_layer = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MoEForCausalLM):
    inner_model = Qwen3MoeModel


def qwen3_moe_arch_config(hf: Any) -> ArchConfig:
    moe = moe_config(hf, hf.num_experts, hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob))
    return llama_arch_config(hf, qk_norm=True, moe=moe)


FAMILIES = (
    ModelFamily(
        name="Qwen3-MoE",
        architectures=("Qwen3MoeForCausalLM",),
        model_class=Qwen3MoeForCausalLM,
        arch_config=qwen3_moe_arch_config,
        supports_tensor_parallel=True,  # over each expert's columns (layers/moe.py)
        packed_modules=PACKED_MODULES,
        gguf=GGUFSpec(
            "qwen3moe",
            {
                **MOE_GGUF_COMMON_NAMES,
                **MOE_GGUF_BLOCK_NAMES,
                "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm",
            },
            optional_block_names=DENSE_MLP_GGUF_NAMES,
            config_from_gguf=moe_config_from_gguf,
        ),
    ),
)
