"""Applying a cos/sin table to q and k, over whole heads or their first `rotary_dim` dims
(partial rotary: HF's `partial_rotary_factor`, e.g. Phi-4-mini's 0.75), shared by the rotary
modules (rotary.py, longrope.py)."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.kernels import rotary_embedding


def rotary_dim_of(head_dim: int, params: dict[str, Any]) -> int:
    """The rotated dims of each head, int(head_dim * partial_rotary_factor) as HF has it."""
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} gives {rotary_dim} of {head_dim} dims")
    return rotary_dim


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [T] int64 (rows of cos_sin_cache: [rows, rotary_dim]); q: [T, Hq * head_dim],
    # k: [T, Hkv * head_dim]. The first rotary_dim dims of each head rotate, the rest pass.
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim == head_dim:
        return rotary_embedding(positions, q, k, cos_sin_cache)
    num_tokens = q.shape[0]
    q3, k3 = q.view(num_tokens, -1, head_dim), k.view(num_tokens, -1, head_dim)
    q_rot, k_rot = rotary_embedding(
        positions,
        q3[..., :rotary_dim].reshape(num_tokens, -1),
        k3[..., :rotary_dim].reshape(num_tokens, -1),
        cos_sin_cache,
    )
    q_out = torch.cat([q_rot.view(num_tokens, -1, rotary_dim), q3[..., rotary_dim:]], dim=-1)
    k_out = torch.cat([k_rot.view(num_tokens, -1, rotary_dim), k3[..., rotary_dim:]], dim=-1)
    return q_out.view(num_tokens, -1), k_out.view(num_tokens, -1)
