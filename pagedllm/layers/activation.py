"""Activations: plain ones by HF config name, and gated ones over fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(nn.Module):
    """silu(gate) * up over the fused gate/up projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        return silu_and_mul(x)


class GeluAndMul(nn.Module):
    """gelu(gate) * up over the fused gate/up projection output (Gemma: the tanh form)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        if self.approximate == "tanh":
            return gelu_tanh_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


class Gelu(nn.Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)


# HF `activation_function` / `hidden_act` name -> module factory.
# gelu_new (GPT-2) and gelu_pytorch_tanh are both the tanh approximation.
_ACTIVATIONS = {
    "relu": nn.ReLU,
    "gelu": lambda: Gelu("none"),
    "gelu_new": lambda: Gelu("tanh"),
    "gelu_pytorch_tanh": lambda: Gelu("tanh"),
    "silu": nn.SiLU,
}


def get_act_fn(name: str) -> nn.Module:
    """The activation for an HF config name; ValueError naming the supported ones."""
    factory = _ACTIVATIONS.get(name)
    if factory is None:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return factory()


def gelu_approximation(name: str) -> str:
    """The F.gelu `approximate` argument of a GELU-family HF activation name."""
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return "tanh"
    if name == "gelu":
        return "none"
    raise ValueError(f"activation {name!r} is not a GELU; supported: gelu, gelu_new, gelu_pytorch_tanh")
