"""The Attention layer: grouped-query heads over the KV cache, one flat batch of tokens from
many requests (no padding), computed by the attention backend bound to it.

What a layer computes is one value, its `AttentionParams` (scale, sliding window, logit
soft-cap, sinks, causal or not: attention/params.py), from the model's configuration. How it
is computed is the backend's (attention/: torch with or without the compiled decode kernels,
the float64 reference, Triton), chosen once at start-up from the configuration, the device,
the KV worker's layout and the layers' features (attention/registry.py), which refuses by
name a feature its backend does not run. The per-step metadata reaches every layer through
the scoped forward context (attention/metadata.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import get_attention_metadata
from pagedllm.attention.params import AttentionParams


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads, reading K/V from the KV cache.

    The KV worker binds `kv_cache` (one of attention/layouts.py's layouts) and
    `kv_cache_group` (whose block tables this layer reads); the runner binds `backend`
    (attention/registry.bind_backend) once after allocating the pool.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logit_soft_cap: float | None = None,
        *,
        sinks: bool = False,
        causal: bool = True,
    ) -> None:
        """The keyword arguments are AttentionParams' fields (attention/params.py)."""
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.backend: AttentionBackend | None = None
        self._params = AttentionParams(scale, sliding_window, logit_soft_cap, sinks, causal)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None
        """[num_heads] learned logits (params.sinks), loaded with the weights."""
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_group = 0
        self.bf16_min_rows: int | None = None
        """--prefill-activations bf16: first prompt chunks of at least this many tokens run
        torch's SDPA in bf16 (None: float32 always; layers/linear.set_prefill_activations)."""

    @property
    def params(self) -> AttentionParams:
        return self._params

    @params.setter
    def params(self, params: AttentionParams) -> None:
        if self.backend is not None:
            self.backend.check(params)
        self._params = params

    @property
    def scale(self) -> float:
        return self._params.scale

    @property
    def sliding_window(self) -> int | None:
        return self._params.sliding_window

    @property
    def logit_soft_cap(self) -> float | None:
        return self._params.logit_soft_cap

    @logit_soft_cap.setter
    def logit_soft_cap(self, cap: float | None) -> None:
        self.params = replace(self._params, logit_soft_cap=cap)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, num_heads * head_dim], k/v: [T, num_kv_heads * head_dim] -> [T, num_heads * head_dim]
        md = get_attention_metadata(self.kv_cache_group)
        assert self.backend is not None, "no attention backend bound to this layer (attention/registry.py)"
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(self, q, k, v, md)
        return out.view(num_tokens, self.num_heads * self.head_dim)
