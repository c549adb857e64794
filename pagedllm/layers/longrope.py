"""LongRoPE ("su" / "longrope", Phi-3's long-context variants): rotary embedding with two sets
of per-frequency factors, short and long, and a fixed attention factor.

HF transformers (modeling_rope_utils, 5.x) picks the set per forward call: long when that
call's sequence length, max(position) + 1, exceeds `original_max_position_embeddings`, short
otherwise; the keys already in its cache keep the set they were rotated with. So a prompt
longer than the original context rotates every position with the long set, while a short
prompt decoded past it keeps its short-rotated keys and rotates each new token (position p,
length p + 1) with the long set from p = original on.

Here the same rule holds per request: a token is rotated with the long set when its request's
sequence length at the end of the step that computes it (its `seq_lens` entry) exceeds the
original context. For a decode that is exactly "position >= original", which is what the
first `max_position` rows of `cos_sin_cache` hold, so the fused decode (models/fused_decode.py)
and any caller indexing by position decode as HF does. A step whose request is longer than the
original context reads its positions below it from the extra rows past `max_position`.

Unlike HF's batch-wide choice the set depends only on the token's own request, so a request's
output does not depend on its batch. It does depend on how its prompt was split: a chunk of a
long prompt that ends within the original context is rotated with the short set, as is a
prefix-cache hit computed by a short request; recompute after preemption re-prefills with the
long set. HF has none of those (its one unchunked prefill decides).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import get_attention_metadata
from pagedllm.layers.rotary_apply import apply_rotary, rotary_dim_of


def longrope_inv_freq(rotary_dim: int, params: dict[str, Any], long: bool) -> torch.Tensor:
    # -> [rotary_dim // 2] float32: 1 / (factor_i * base^(2i / rotary_dim)), as HF computes it
    base = float(params["rope_theta"])
    factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.shape != (rotary_dim // 2,):
        raise ValueError(f"longrope factors of length {factors.shape[0]}, expected rotary_dim / 2 = {rotary_dim // 2}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (factors * base**exponents)


def longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    """cos and sin are scaled by this: sqrt(1 + ln(s) / ln(original)), s = max / original
    (or `factor`), unless the checkpoint states `attention_factor`."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = int(params["original_max_position_embeddings"])
    scale = float(params.get("factor") or max_position / original)
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    # positions: [P] float32 -> [P, rotary_dim] = [cos | sin], each scaled by the attention factor
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


class LongRopeEmbedding(nn.Module):
    """Applies LongRoPE to q and k of a flat batch (see the module docstring for the rule)."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, params)
        self.max_position = max_position
        self.original_max_position = original = int(params["original_max_position_embeddings"])
        if not 0 < original <= max_position:
            raise ValueError(f"original_max_position_embeddings={original} must be in (0, {max_position}]")
        scaling = longrope_attention_factor(params, max_position)
        short = longrope_inv_freq(self.rotary_dim, params, long=False)
        long = longrope_inv_freq(self.rotary_dim, params, long=True)
        before = torch.arange(original, dtype=torch.float32)
        after = torch.arange(original, max_position, dtype=torch.float32)
        # cos_sin_cache: [max_position + original, rotary_dim]. Rows [0, max_position): the
        # decode rule (short below the original context, long from it on); rows
        # [max_position, max_position + original): the long set below the original context.
        cache = torch.cat(
            [_cos_sin(before, short, scaling), _cos_sin(after, long, scaling), _cos_sin(before, long, scaling)]
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._rows_for: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (metadata, positions, rows)

    def cache_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] int64: each token's row of cos_sin_cache in this step (the forward context's)."""
        md = get_attention_metadata(0)
        memo = self._rows_for
        if memo is not None and memo[0] is md and memo[1] is positions:
            return memo[2]  # every layer of one forward shares the rows
        query_lens = torch.diff(torch.tensor(md.query_start_loc))
        assert int(query_lens.sum()) == positions.shape[0], (md.query_start_loc, positions.shape)
        long_request = md.seq_lens[: md.num_reqs] > self.original_max_position  # [num_reqs]
        long_token = torch.repeat_interleave(long_request, query_lens)  # [T]
        shift = (long_token & (positions < self.original_max_position)).to(positions.dtype) * self.max_position
        rows = positions + shift
        self._rows_for = (md, positions, rows)
        return rows

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64; q: [T, num_heads * head_dim]; k: [T, num_kv_heads * head_dim]
        return apply_rotary(self.cache_rows(positions), q, k, self.cos_sin_cache, self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"original={self.original_max_position}"
        )
