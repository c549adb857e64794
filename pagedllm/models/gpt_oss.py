"""gpt-oss (`GptOssForCausalLM`): Llama's layer shape with
- attention sinks: a learned logit per head in every softmax's denominator (AttentionParams.
  sinks; the torch backend, the compiled decode kernel, the fused decode and the reference run it);
- biases on q/k/v/o, YaRN rope (layers/rotary.py), sliding-window (128) and full attention
  layers alternating by `layer_types`;
- a sparse MLP in every layer: the router's logits with a bias, top-k of them, softmax over the
  k selected logits (not over all experts); each expert a clamped SwiGLU with biases:
  gate = min(x W_g + b_g, limit), up = clamp(x W_u + b_u, -limit, limit),
  out = ((up + 1) * gate * sigmoid(alpha * gate)) W_d + b_d (alpha 1.702, limit 7); GGUF-block
  experts (MXFP4 kept) run all active experts in one grouped call (kernels/gguf_moe.py with the
  biases and this activation), as SparseMoE's GGUF experts do.

Checkpoints: transformers' layout, `mlp.router.{weight,bias}`, `mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up interleaved by column (gate at even, up at odd), its bias [E, 2I],
`mlp.experts.down_proj` [E, I, H] and bias [E, H], `self_attn.sinks` [H]; loaded per expert into
layers/moe.py's shapes ([out, in] linears). The released checkpoints' MXFP4 experts
(`*_blocks` [E, rows, K / 32, 16] uint8, `*_scales` [E, rows, K / 32] e8m0) are kept as stored,
repacked into ggml's MXFP4 blocks (`mxfp4_rows`: the same codes and exponents) and run by the
GGUF kernels.

llama.cpp's `gpt-oss` GGUF files (its converter's names: the router `ffn_gate_inp`, the experts
`ffn_{gate,up,down}_exps` split from gate_up_proj, their biases [E, rows] 2-D, `attn_sinks`,
`post_attention_norm`; Q/K not permuted) read by the GGUF loader: the config from the file's
`gpt-oss.*` keys (gpt_oss_gguf.py: transformers' GGUF reader misreads the rope scaling keys),
the tokenizer by transformers' GGUF tokenizer builder, MXFP4 experts kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedllm.kernels import GGUFBlocks, grouped_experts, layer_ops, stack_expert_blocks, use_layer_ops
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.layers.moe import MoEConfig, RouterLinear, Routing, SparseMoE
from pagedllm.models.family import ArchConfig, GGUFSpec, ModelFamily
from pagedllm.models.fused_decode import DecodeLayout
from pagedllm.models.gpt_oss_gguf import GGUF_BLOCK_NAMES, gpt_oss_metadata_from_gguf
from pagedllm.models.llama import (
    PACKED_MODULES,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    llama_arch_config,
)


class ClampedSwiGLU(nn.Module):
    """[n, 2I] = [gate | up] -> [n, I]: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class GptOssExpert(nn.Module):
    """One expert: down(ClampedSwiGLU(x W_gate_up^T + b)) + b_down."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: ClampedSwiGLU) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=True)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=True)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> [n, 2I] -> [n, I] -> [n, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def route_selected(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> Routing:
    """logits: [T, E] (bias included) -> gpt-oss's routing: top-k logits, softmax over those k.
    On the host the compiled `moe_route` (csrc/layer_ops.h route_row, softmax_selected), which
    the fused decode runs too."""
    logits = logits.float()
    if logits.shape[0] and use_layer_ops(logits):
        expert_ids, weights = layer_ops().moe_route(logits, top_k, True, True)
    else:
        top, expert_ids = torch.topk(logits, top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    counts = torch.bincount(expert_ids.flatten(), minlength=logits.shape[-1]).tolist()
    return Routing(expert_ids, weights.to(dtype), counts)


class GptOssMoE(SparseMoE):
    """SparseMoE's grouping, expert loop and grouped call with gpt-oss's router (`gate`, with a
    bias) and experts: where the experts are GGUF blocks (MXFP4 as released, or a GGUF file's
    kept types), their stacks carry the biases and the clamped SwiGLU, and the grouped call
    (csrc/gguf_moe.h's ExpertAct) runs them as SparseMoE's steps do."""

    def __init__(self, hidden_size: int, moe: MoEConfig, act: ClampedSwiGLU) -> None:
        super().__init__(hidden_size, replace(moe, num_experts=0))  # no SparseMoE experts built
        self.act = act
        self.gate = RouterLinear(hidden_size, moe.num_experts, bias=True)
        self.experts = nn.ModuleList(
            GptOssExpert(hidden_size, moe.intermediate_size, act) for _ in range(moe.num_experts)
        )

    def finish_loading(self) -> None:
        for expert in self.experts:
            expert.gate_up_proj.finish_loading()
            expert.down_proj.finish_loading()
        gate_up = [e.gate_up_proj for e in self.experts]
        down = [e.down_proj for e in self.experts]
        if self.tp.size > 1 or any(
            not isinstance(m.blocks, GGUFBlocks) or m.bias is None or m.lora_slots is not None for m in gate_up + down
        ):
            return
        try:
            stacks, gu_views, down_views = stack_expert_blocks(
                [m.blocks for m in gate_up], [m.blocks for m in down]  # type: ignore[misc]
            )
        except ValueError:  # mixed types over experts: the loop runs them
            return
        for m, view in zip(gate_up + down, gu_views + down_views):
            m.blocks = view
        biases = []
        for linears in (gate_up, down):
            stacked = torch.stack([m.bias.detach().float() for m in linears])  # type: ignore[union-attr]
            if all(m.bias.dtype == torch.float32 for m in linears):  # type: ignore[union-attr]
                for e, m in enumerate(linears):  # the experts' biases become views: one copy
                    m.bias.data = stacked[e]  # type: ignore[union-attr]
            biases.append(stacked)
        self.expert_stacks = dataclasses.replace(
            stacks, gate_up_bias=biases[0], down_bias=biases[1], clamped_swiglu=(self.act.alpha, self.act.limit)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        routing = route_selected(self.gate(x), self.top_k, x.dtype)
        self.last_routing = routing
        if self._grouped(x):
            assert self.expert_stacks is not None
            int8 = self.experts[0].gate_up_proj.decode_activations == "int8"  # set_prefill_activations
            return grouped_experts(x, routing.expert_ids, routing.weights, self.expert_stacks, int8)
        return self._expert_loop(x, routing)


class GptOssAttention(LlamaAttention):
    def __init__(self, arch: ArchConfig, layer_idx: int, rotary_emb: nn.Module) -> None:
        super().__init__(arch, layer_idx, rotary_emb)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            arch.head_dim,
            self.qkv_proj.num_kv_heads,
            scale=arch.head_dim**-0.5,
            sliding_window=arch.sliding_window(layer_idx),
            sinks=True,
        )


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_class = GptOssAttention

    def decode_layout(self) -> DecodeLayout | None:
        """Llama's layout with gpt-oss's sparse MLP (models/fused_decode.py runs its sinks through
        the decode kernel and, where the experts are GGUF stacks, the grouped call with their
        biases and clamped SwiGLU)."""
        if type(self.self_attn) is not GptOssAttention or type(self.mlp) is not GptOssMoE:
            return None
        return DecodeLayout(self.arch)

    def build_mlp(self, arch: ArchConfig, layer_idx: int) -> nn.Module:
        assert arch.moe is not None
        act = ClampedSwiGLU(float(arch.hf.swiglu_alpha), float(arch.hf.swiglu_limit))
        return GptOssMoE(arch.hidden_size, arch.moe, act)


class GptOssModel(LlamaModel):
    decoder_layer = GptOssDecoderLayer


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 rows -> ggml's MXFP4 blocks: blocks uint8 [..., G, 16] (byte j holds
    elements 2j, 2j + 1 of a 32-element block, low nibble first), scales uint8 [..., G] (e8m0)
    -> uint8 [..., G * 17], each block its exponent byte then 16 bytes holding elements j and
    j + 16 (low, high nibble). The same e2m1 codes and exponents: nothing is rounded."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32]
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [..., G, 16]
    return torch.cat([scales.unsqueeze(-1), packed], dim=-1).flatten(-2).contiguous()


def _expert_tensors(prefix: str, kind: str, tensor: Any) -> Iterator[tuple[str, Any]]:
    """One 3-D expert tensor of transformers' layout (module docstring) per expert; an MXFP4
    pair (`kind` "gate_up_proj_mxfp4": (blocks, scales)) as GGUF blocks, kept."""
    if kind.endswith("_mxfp4"):
        blocks, scales = tensor
        rows = mxfp4_rows(blocks, scales)  # [E, R, row bytes], rows as [out, in]: no transpose
        k, num_experts = blocks.shape[-2] * 32, blocks.shape[0]
    else:
        num_experts = tensor.shape[0]
    for e in range(num_experts):
        expert = f"{prefix}.mlp.experts.{e}"
        if kind == "gate_up_proj_mxfp4":  # rows interleaved: gate at even, up at odd
            yield f"{expert}.gate_proj.weight", GGUFBlocks(rows[e, 0::2].contiguous(), "MXFP4", k)
            yield f"{expert}.up_proj.weight", GGUFBlocks(rows[e, 1::2].contiguous(), "MXFP4", k)
        elif kind == "down_proj_mxfp4":
            yield f"{expert}.down_proj.weight", GGUFBlocks(rows[e], "MXFP4", k)
        elif kind == "gate_up_proj":  # [H, 2I], gate and up interleaved by column
            yield f"{expert}.gate_proj.weight", tensor[e, :, 0::2].t()
            yield f"{expert}.up_proj.weight", tensor[e, :, 1::2].t()
        elif kind == "gate_up_proj_bias":  # [2I]
            yield f"{expert}.gate_proj.bias", tensor[e, 0::2]
            yield f"{expert}.up_proj.bias", tensor[e, 1::2]
        elif kind == "down_proj":  # [I, H]
            yield f"{expert}.down_proj.weight", tensor[e].t()
        elif kind == "down_proj_bias":  # [H]
            yield f"{expert}.down_proj.bias", tensor[e]
        else:
            raise ValueError(f"unknown gpt-oss expert tensor {prefix}.mlp.experts.{kind}")


def gpt_oss_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """transformers' gpt-oss tensors under this package's names (module docstring); an MXFP4
    expert tensor once both its `_blocks` and `_scales` have come."""
    pending: dict[str, dict[str, Any]] = {}  # "<prefix>|<kind>" -> {"blocks": ..., "scales": ...}
    for name, tensor in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks.weight", ".self_attn.sinks")
        name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
        prefix, sep, kind = name.rpartition(".mlp.experts.")
        if not sep or kind[:1].isdigit():  # not an expert, or one expert's tensor already (GGUF)
            yield name, tensor
            continue
        if kind.endswith(("_blocks", "_scales")):
            stem, _, part = kind.rpartition("_")
            pair = pending.setdefault(f"{prefix}|{stem}", {})
            pair[part] = tensor
            if len(pair) < 2:
                continue
            del pending[f"{prefix}|{stem}"]
            kind, tensor = f"{stem}_mxfp4", (pair["blocks"], pair["scales"])
        yield from _expert_tensors(prefix, kind, tensor)
    if pending:
        raise ValueError(f"MXFP4 expert tensors without their pair: {', '.join(sorted(pending))}")


class GptOssForCausalLM(LlamaForCausalLM):
    inner_model = GptOssModel

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(gpt_oss_tensors(weights))


def gpt_oss_arch_config(hf: Any) -> ArchConfig:
    moe = MoEConfig(
        num_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.intermediate_size,
        norm_topk_prob=True,  # the softmax over the k selected logits sums to one
    )
    # hidden_act is unused: the experts' activation is the clamped SwiGLU above.
    return llama_arch_config(hf, moe=moe, activation="swiglu_clamped")


FAMILIES = (
    ModelFamily(
        name="gpt-oss",
        architectures=("GptOssForCausalLM",),
        model_class=GptOssForCausalLM,
        arch_config=gpt_oss_arch_config,
        # q/k/v as in the checkpoint; its gate_up_proj is already one tensor (split per expert
        # into gate_proj / up_proj by gpt_oss_tensors, then packed again by the loader).
        packed_modules=tuple(p for p in PACKED_MODULES if p[0] == "qkv_proj"),
        gguf=GGUFSpec("gpt-oss", GGUF_BLOCK_NAMES, metadata_from_gguf=gpt_oss_metadata_from_gguf),
    ),
)
