"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn


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

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
