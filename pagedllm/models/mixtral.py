"""Mixtral: Llama's attention, every MLP a sparse mixture of experts (layers/moe.py):
softmax over `num_local_experts`, top-`num_experts_per_tok` (2 of 8 in Mixtral 8x7B), always
renormalised; each expert a SiLU-gated MLP of `intermediate_size`.

Checkpoint names `block_sparse_moe.gate`, `block_sparse_moe.experts.<e>.w1 / w3 / w2`
(gate, up, down) map onto ours (models/moe_utils.py). GGUF: llama.cpp writes Mixtral as the
`llama` architecture with expert tensors and `llama.expert_count`; the Llama family's spec
reads them (llama.py's `optional_block_names`, `config_from_gguf`).
"""

from __future__ import annotations

from typing import Any

from pagedllm.models.family import ArchConfig, ModelFamily
from pagedllm.models.llama import PACKED_MODULES, llama_arch_config
from pagedllm.models.moe_utils import MoEForCausalLM, moe_config


class MixtralForCausalLM(MoEForCausalLM):
    """Llama's layers with sparse MLPs (models/moe_utils.py's MoEModel)."""


def mixtral_arch_config(hf: Any) -> ArchConfig:
    moe = moe_config(hf, hf.num_local_experts, hf.intermediate_size, norm_topk_prob=True)
    return llama_arch_config(hf, moe=moe)


FAMILIES = (
    ModelFamily(
        name="Mixtral",
        architectures=("MixtralForCausalLM",),
        model_class=MixtralForCausalLM,
        arch_config=mixtral_arch_config,
        supports_tensor_parallel=True,  # over each expert's columns (layers/moe.py)
        # w1 / w3 (renamed to gate_proj / up_proj first, models/moe_utils.py) into gate_up_proj.
        packed_modules=(*PACKED_MODULES[:3], ("gate_up_proj", "w1", 0), ("gate_up_proj", "w3", 1)),
    ),
)
