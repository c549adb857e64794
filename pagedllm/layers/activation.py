"""Gated activations over fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up over the fused gate/up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
