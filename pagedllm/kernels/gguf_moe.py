"""The grouped-expert MLP over GGUF blocks: every active expert of a sparse MoE layer in one
compiled call (csrc/gguf_moe.h, in the `gguf_linear` extension), for decode steps and, where
the build has the int16 path, prefill chunks (grouped_experts_available).

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

# Steps the grouped call takes (grouped_experts_available): up to GROUPED_MAX_TOKENS tokens
# (the small-M kernel's range) on every build; where both projections take the int16 path
# (AVX-512 VNNI), larger steps too, up to GROUPED_MAX_PAIRS_PER_EXPERT (token, slot) pairs per
# expert on average and GROUPED_MAX_ELEMENTS elements of the silu products (float32 plus
# their int16 rounding: ~8 bytes each). Measured on Qwen3-30B-A3B's layer (Q8_0), the grouped
# call against the loop over Q8_0 QuantizedWeight experts: 4.0x at 64 tokens, 2.0x at 2048
# (docs/benchmarks.md, 2026-12-03); the float path (avx2, generic builds) is not measured
# past 16 tokens, where the loop's dequantize-and-GEMM stays.
GROUPED_MAX_TOKENS = SMALL_M_MAX_ROWS
GROUPED_MAX_PAIRS_PER_EXPERT = 128
GROUPED_MAX_ELEMENTS = 1 << 24
_EMPTY = torch.empty(0)


@dataclass(frozen=True)
class ExpertStacks:
    """All experts' weights of one sparse layer, as GGUF blocks stacked over experts."""

    gate_up: torch.Tensor
    """uint8 [E, 2 I, row bytes]: expert e's gate rows, then its up rows"""
    gate_up_type: str
    down: torch.Tensor
    """uint8 [E, H, row bytes]"""
    down_type: str
    gate_up_bias: torch.Tensor | None = None
    """float32 [E, 2 I] (gate's then up's), or None: no biases (gpt-oss's experts have them)"""
    down_bias: torch.Tensor | None = None
    """float32 [E, H], or None"""
    clamped_swiglu: tuple[float, float] | None = None
    """(alpha, limit): gpt-oss's clamped SwiGLU between gate/up and down
    ((clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit)); None: silu(g) * u"""


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


def grouped_experts_available(stacks: ExpertStacks, num_tokens: int, top_k: int) -> bool:
    """Whether the compiled grouped call takes a step of `num_tokens` tokens over these stacks
    (the extension built, kept types, the step's size within the bounds above)."""
    ops = gguf_linear_ops()
    if ops is None or stacks.gate_up_type not in KEPT_GGUF_TYPES or stacks.down_type not in KEPT_GGUF_TYPES:
        return False
    if num_tokens <= GROUPED_MAX_TOKENS:
        return True
    num_experts, intermediate = stacks.gate_up.shape[0], stacks.gate_up.shape[1] // 2
    pairs = num_tokens * top_k
    int16 = _int16_types(ops)
    return (
        stacks.gate_up_type in int16
        and stacks.down_type in int16
        and pairs <= GROUPED_MAX_PAIRS_PER_EXPERT * num_experts
        and pairs * intermediate <= GROUPED_MAX_ELEMENTS
    )


# id(extension module) -> the types its small-M kernel (and the grouped call) runs with int16 activations.
_int16_by_ops: dict[int, frozenset[str]] = {}


def _int16_types(ops) -> frozenset[str]:  # type: ignore[no-untyped-def]
    types = _int16_by_ops.get(id(ops))
    if types is None:
        kernels = ops.small_m_kernels()
        types = _int16_by_ops[id(ops)] = frozenset(
            name for i, name in enumerate(ops.type_names()) if kernels[i].startswith("int16")
        )
    return types


def grouped_experts(
    x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, stacks: ExpertStacks,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x: [T, H], expert_ids / weights: [T, k] -> [T, H] = sum over the k slots of
    weight * down(silu(gate x) * up x) of the slot's expert (with the stacks' biases and
    activation where they have them), in float32 arithmetic (x's dtype out). Where the build has AVX-512 VNNI and the type an int16 dot (gguf_blocks.small_m_kernels),
    x and the silu products are rounded to int16 per group of 32, as gguf_linear rounds them;
    with int8_activations (the experts' decode_activations "int8") to int8 per block of 256 for
    the projections of a type in gguf_blocks.INT8_DECODE_TYPES."""
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
        int8_activations,
        _EMPTY if stacks.gate_up_bias is None else stacks.gate_up_bias,
        _EMPTY if stacks.down_bias is None else stacks.down_bias,
        stacks.clamped_swiglu is not None,
        *(stacks.clamped_swiglu or (0.0, 0.0)),
    )
    return out.to(x.dtype)
