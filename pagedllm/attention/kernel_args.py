"""A layer's ``AttentionParams`` as the compiled CPU kernels' scalar arguments
(kernels/csrc/paged_attention.h, decode_layers.cpp), built in this one place: the kernels
take plain numbers where 0 means "none", so a feature the kernels learn is one field here
and its C++ argument, not a value threaded through every call site."""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.attention.params import AttentionParams


class KernelAttentionArgs(NamedTuple):
    scale: float
    """Scores are q.k * scale."""
    sliding_window: int
    """The window in tokens; 0: none."""
    soft_cap: float
    """c in c * tanh(s / c); 0.0: uncapped."""


def kernel_args(params: AttentionParams) -> KernelAttentionArgs:
    """The kernels' arguments for ``params`` (features they do not run are refused at
    start-up by the backend's ``runs``, never here)."""
    return KernelAttentionArgs(float(params.scale), params.sliding_window or 0, params.logit_soft_cap or 0.0)
