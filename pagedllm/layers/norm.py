"""Normalisation layers: RMSNorm (optionally fused with the residual add before it),
LayerNorm (GPT-2, OPT) and Gemma's RMSNorm with its (1 + weight) scale."""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import add_rms_norm, layer_ops, rms_norm, use_layer_ops


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the statistic computed in float32.

    `forward(x)` returns the normed tensor. `forward(x, residual)` first adds the residual
    (x + residual, in the model dtype, as the unfused model does) and returns
    `(normed, new_residual)` where new_residual is that sum.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [num_tokens, hidden]
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim (GPT-2, OPT).

    `elementwise_affine=False` (some OPT checkpoints) has neither weight nor bias.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
            self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: y = x / sqrt(mean(x^2) + eps) * (1 + weight), all in float32, then
    cast to the input dtype (Llama's casts before the scale; Gemma's after, as HF's does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        # Stored as in checkpoints: the offset from 1, so zeros is the identity scale.
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden] -> [..., hidden]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # float32: the compiled kernel's rms_norm by weight + 1, as the fused decode's.
            rows = x.reshape(-1, x.shape[-1])  # a copy where x's rows are not evenly strided (q/k heads)
            if rows.shape[0] and use_layer_ops(rows):
                return layer_ops().rms_norm(rows, self.weight, self.eps, 1.0).view(x.shape)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
