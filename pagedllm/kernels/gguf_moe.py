"""The grouped-expert MLP over GGUF blocks: every active expert of a sparse MoE layer in one
compiled call (csrc/gguf_moe.h, in the `gguf_linear` extension) for a few tokens.

An `ExpertStacks` holds all experts' fused gate/up weights as one uint8 [E, 2 I, row bytes]
tensor and their down weights as one [E, H, row bytes] tensor (llama.cpp's 3-D `ffn_*_exps`
layout); each expert's `Linear` holds a view of its slice (`stack_expert_blocks`), so the
stacks cost no memory beyond the experts' own weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels.build import gguf_linear_ops
from pagedllm.kernels.gguf_blocks import KEPT_GGUF_TYPES, SMALL_M_MAX_ROWS, GGUFBlocks, type_index

# Up to this many tokens the grouped call runs (the small-M kernel's range); above, the loop.
GROUPED_MAX_TOKENS = SMALL_M_MAX_ROWS


@dataclass(frozen=True)
class ExpertStacks:
    """All experts' weights of one sparse layer, as GGUF blocks stacked over experts."""

    gate_up: torch.Tensor
    """uint8 [E, 2 I, row bytes]: expert e's gate rows, then its up rows"""
    gate_up_type: str
    down: torch.Tensor
    """uint8 [E, H, row bytes]"""
    down_type: str


def stack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Equal-shape 2-D tensors -> one [len(parts), *shape] tensor: a view where they already lie
    back to back in one storage (slices of a 3-D tensor read from the file), else a copy."""
    first = parts[0]
    step = first.numel()
    in_place = all(p.is_contiguous() and p.shape == first.shape for p in parts) and all(
        p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.storage_offset() == first.storage_offset() + i * step
        for i, p in enumerate(parts)
    )
    if in_place:
        return first.as_strided((len(parts), *first.shape), (step, *first.stride()), first.storage_offset())
    return torch.stack(parts)


def stack_expert_blocks(gate_up: list[GGUFBlocks], down: list[GGUFBlocks]) -> tuple[ExpertStacks, list[GGUFBlocks], list[GGUFBlocks]]:
    """The stacks of the experts' gate/up and down blocks, with each expert's blocks as a view
    of its slice (to replace the experts' own, so one copy of the weights stays resident).
    ValueError unless each projection has one type and width over all experts."""
    for name, parts in (("gate_up", gate_up), ("down", down)):
        kinds = {(p.type_name, p.shape) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"experts' {name} weights differ in type or shape: {sorted(kinds)}")
    gu = stack_rows([p.data for p in gate_up])
    dn = stack_rows([p.data for p in down])
    stacks = ExpertStacks(gu, gate_up[0].type_name, dn, down[0].type_name)
    return (
        stacks,
        [GGUFBlocks(gu[e], p.type_name, p.k) for e, p in enumerate(gate_up)],
        [GGUFBlocks(dn[e], p.type_name, p.k) for e, p in enumerate(down)],
    )


def grouped_experts_available(stacks: ExpertStacks) -> bool:
    """Whether the compiled grouped call takes these stacks (the extension built, kept types)."""
    return (
        stacks.gate_up_type in KEPT_GGUF_TYPES
        and stacks.down_type in KEPT_GGUF_TYPES
        and gguf_linear_ops() is not None
    )


def grouped_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, stacks: ExpertStacks
) -> torch.Tensor:
    """x: [T, H], expert_ids / weights: [T, k] -> [T, H] = sum over the k slots of
    weight * down(silu(gate x) * up x) of the slot's expert, in float32 arithmetic (x's dtype
    out). Where the build has AVX-512 VNNI and the type an int16 dot (gguf_blocks.small_m_kernels),
    x and the silu products are rounded to int16 per group of 32, as gguf_linear rounds them."""
    ops = gguf_linear_ops()
    assert ops is not None, "grouped_experts needs the gguf_linear extension (grouped_experts_available)"
    out = ops.moe_experts(
        x.float().contiguous(),
        expert_ids.long().contiguous(),
        weights.float().contiguous(),
        stacks.gate_up,
        type_index(ops, stacks.gate_up_type),
        stacks.down,
        type_index(ops, stacks.down_type),
    )
    return out.to(x.dtype)
