"""What the mixture-of-experts families (mixtral.py, qwen2_moe.py, qwen3_moe.py) share: the
MLP of a layer (sparse or dense, by `ArchConfig.moe`), the sparse layers of an HF config, the
expert tensors of a checkpoint under this package's names, and llama.cpp's expert tensors.

Parameter names: `mlp.gate` (router), `mlp.experts.<e>.gate_up_proj` / `.down_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate` (layers/moe.py). Checkpoints name experts
per expert (`experts.<e>.gate_proj`, as transformers 5 saves them; Mixtral's
`block_sparse_moe.experts.<e>.w1/w3/w2`) or as 3-D tensors (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I], transformers' in-memory layout); all load.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedllm.layers.moe import MoEConfig, SparseMoE
from pagedllm.models.family import LLAMA_GGUF_BLOCK_NAMES, ArchConfig
from pagedllm.models.fused_decode import DecodeLayout
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

# llama.cpp's MoE block tensors -> ours; `{expert}` marks a 3-D tensor [E, rows, cols] that the
# GGUF reader splits into one 2-D tensor per expert (models/gguf_loader.py).
MOE_GGUF_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
# A MoE file's attention and norms (Llama's names); its dense MLP tensors (`ffn_gate`, ...)
# only in files with dense layers (`mlp_only_layers`): GGUFSpec.optional_block_names.
MOE_GGUF_COMMON_NAMES = {k: v for k, v in LLAMA_GGUF_BLOCK_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm"}
DENSE_MLP_GGUF_NAMES = {k: v for k, v in LLAMA_GGUF_BLOCK_NAMES.items() if k not in MOE_GGUF_COMMON_NAMES}
SHARED_EXPERT_GGUF_BLOCK_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def sparse_layers_of(hf: Any, num_experts: int) -> tuple[bool, ...]:
    """HF's rule (Qwen2-MoE, Qwen3-MoE): layer i is sparse unless it is in `mlp_only_layers`
    or (i + 1) is not a multiple of `decoder_sparse_step`."""
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return tuple(
        i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(hf.num_hidden_layers)
    )


def build_mlp(arch: ArchConfig, layer_idx: int) -> nn.Module:
    """The layer's MLP: SparseMoE where `arch.moe` makes it sparse, else the dense LlamaMLP
    (of `arch.intermediate_size`)."""
    if arch.moe is not None and arch.moe.is_sparse(layer_idx):
        if arch.activation != "silu":
            raise ValueError(f"hidden_act={arch.activation!r} is not supported in experts (only 'silu')")
        return SparseMoE(arch.hidden_size, arch.moe)
    return LlamaMLP(arch)


def moe_config(hf: Any, num_experts: int, intermediate_size: int, norm_topk_prob: bool, **kw: Any) -> MoEConfig:
    return MoEConfig(
        num_experts=num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=intermediate_size,
        norm_topk_prob=norm_topk_prob,
        sparse_layers=sparse_layers_of(hf, num_experts),
        **kw,
    )


# Mixtral's checkpoint names -> ours (HF's Mixtral: w1 gate, w3 up, w2 down).
_MIXTRAL_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def expert_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors with expert names as this package loads them: Mixtral's renamed,
    3-D expert stacks split per expert (gate_up into gate and up), a 1-D shared-expert gate
    (llama.cpp's) as the [1, hidden] matrix it is."""
    for name, tensor in weights:
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_RENAMES:
                name = name.replace(old, new)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 and ".experts." in name:
            stem = name.removesuffix(".weight")
            prefix, _, kind = stem.rpartition(".")  # "....mlp.experts", "gate_up_proj"
            for e in range(tensor.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = tensor[e].chunk(2, dim=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
                else:
                    yield f"{prefix}.{e}.{kind}.weight", tensor[e]
            continue
        if name.endswith("shared_expert_gate.weight") and isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
            tensor = tensor.unsqueeze(0)
        yield name, tensor


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (attention, pre-norms) with `build_mlp`'s MLP: Mixtral, Qwen2-MoE."""

    def build_mlp(self, arch: ArchConfig, layer_idx: int) -> nn.Module:
        return build_mlp(arch, layer_idx)

    def decode_layout(self) -> DecodeLayout | None:
        """Llama's layout with a sparse or dense MLP (models/fused_decode.py: a sparse one of GGUF
        expert stacks, without a shared expert)."""
        if type(self.self_attn) is not LlamaAttention or type(self.mlp) not in (LlamaMLP, SparseMoE):
            return None
        if self.arch.qk_norm:
            return None
        return DecodeLayout(self.arch)


class MoEModel(LlamaModel):
    decoder_layer = MoEDecoderLayer


class MoEForCausalLM(LlamaForCausalLM):
    """A LlamaForCausalLM of MoE layers whose checkpoint names its experts in any of the
    forms above (Qwen3-MoE sets its own `inner_model`)."""

    inner_model = MoEModel

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(expert_tensors(weights))


def moe_config_from_gguf(reader: Any, hf_config: Any) -> dict[str, Any]:
    """The MoE config fields transformers' GGUF reader leaves at their defaults (its qwen2moe /
    qwen3moe tables map `expert_count` and `expert_used_count` only): the experts' width
    (`<arch>.expert_feed_forward_length`), the shared expert's
    (`<arch>.expert_shared_feed_forward_length`), and the dense layers (those whose block has
    `ffn_gate`, not `ffn_gate_exps`) as `mlp_only_layers`."""
    arch = str(reader.fields["general.architecture"].contents())
    out: dict[str, Any] = {}
    for key, attr in (
        ("expert_feed_forward_length", "moe_intermediate_size"),
        ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
    ):
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            out[attr] = int(field.contents())
    names = {t.name for t in reader.tensors}
    dense = [
        i for i in range(hf_config.num_hidden_layers)
        if f"blk.{i}.ffn_gate_exps.weight" not in names and f"blk.{i}.ffn_gate.weight" in names
    ]
    if dense:
        out["mlp_only_layers"] = dense
    return out
