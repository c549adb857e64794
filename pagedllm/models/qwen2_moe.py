"""Qwen2-MoE: Qwen2's attention (q/k/v biases, `qkv_bias`), sparse MLPs (layers/moe.py) with
top-`num_experts_per_tok` of `num_experts` weights kept as softmax probabilities unless
`norm_topk_prob`, plus a shared expert every token runs (`shared_expert_intermediate_size`),
scaled by sigmoid(x W_shared_expert_gate^T). `decoder_sparse_step` / `mlp_only_layers` make
some layers the dense MLP of `intermediate_size` (models/moe_utils.py). GGUF: llama.cpp's
`qwen2moe` with `ffn_*_exps`, `ffn_gate_inp` and the `*_shexp` tensors.
"""

from __future__ import annotations

from typing import Any

from pagedllm.models.family import ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.llama import PACKED_MODULES, llama_arch_config
from pagedllm.models.moe_utils import (
    DENSE_MLP_GGUF_NAMES,
    MOE_GGUF_BLOCK_NAMES,
    MOE_GGUF_COMMON_NAMES,
    SHARED_EXPERT_GGUF_BLOCK_NAMES,
    MoEForCausalLM,
    moe_config,
    moe_config_from_gguf,
)


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Llama's layers with sparse MLPs (models/moe_utils.py's MoEModel)."""


def qwen2_moe_arch_config(hf: Any) -> ArchConfig:
    moe = moe_config(
        hf,
        hf.num_experts,
        hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
    )
    # Biases on q/k/v (`qkv_bias`), never on o_proj, as in Qwen2.
    return llama_arch_config(hf, qkv_bias=bool(getattr(hf, "qkv_bias", True)), o_bias=False, moe=moe)


FAMILIES = (
    ModelFamily(
        name="Qwen2-MoE",
        architectures=("Qwen2MoeForCausalLM",),
        model_class=Qwen2MoeForCausalLM,
        arch_config=qwen2_moe_arch_config,
        supports_tensor_parallel=True,  # over each expert's columns (layers/moe.py)
        packed_modules=PACKED_MODULES,
        gguf=GGUFSpec(
            "qwen2moe",
            {**MOE_GGUF_COMMON_NAMES, **MOE_GGUF_BLOCK_NAMES, **SHARED_EXPERT_GGUF_BLOCK_NAMES},
            optional_block_names=DENSE_MLP_GGUF_NAMES,
            config_from_gguf=moe_config_from_gguf,
        ),
    ),
)
