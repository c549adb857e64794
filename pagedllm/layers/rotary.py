"""Rotary position embedding in the HF "rotate_half" layout.

Each head vector is split in halves (x1, x2) and rotated pairwise, pair i = (x1[i], x2[i]) by
angle position * inv_freq[i]. cos/sin are precomputed for every position up to
`max_position` in float32 and gathered per token with `positions` ([num_tokens] int64).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.layers.longrope import LongRopeEmbedding
from pagedllm.layers.rotary_apply import apply_rotary, rotary_dim_of

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The checkpoint's rope settings as one flat dict with "rope_type" and "rope_theta"."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params


def _inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    # -> [rotary_dim // 2] float32, angular speed of each rotated pair
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, params)
    if rope_type == "yarn":
        return yarn_inv_freq(inv_freq, rotary_dim, params)
    if rope_type in _ROTARY_MODULES:
        raise ValueError(f"rope_type {rope_type!r} has its own module: build it with rotary_embedding_for")
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 context extension: wavelengths longer than original_len / low_freq_factor are
    # slowed down by `factor`, shorter than original_len / high_freq_factor kept, and the band
    # between blends the two linearly in original_len / wavelength.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    slowed = inv_freq / factor
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed + smooth * inv_freq
    out = torch.where(wavelen > original_len / low, slowed, blended)
    return torch.where(wavelen < original_len / high, inv_freq, out)


def yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    # YaRN (gpt-oss, DeepSeek): pairs that turn fewer than beta_slow times over the original
    # context are interpolated (slowed by `factor`), those that turn more than beta_fast times
    # kept, and a linear ramp over the pair index blends the two in between. HF's bounds:
    # floored/ceiled unless truncate=False, clipped to [0, rotary_dim - 1].
    base, factor = float(params["rope_theta"]), float(params["factor"])
    original_len = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32.0)
    beta_slow = float(params.get("beta_slow") or 1.0)

    def pair_of(num_rotations: float) -> float:
        # the (fractional) pair index whose wavelength fits num_rotations in original_len
        return rotary_dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_of(beta_fast), pair_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the pair's own speed), 0: interpolate (slowed)
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep


def rope_attention_factor(params: dict[str, Any]) -> float:
    """The scale YaRN puts on cos and sin (so on every q.k by its square): the config's
    `attention_factor`, else 0.1 ln(factor) + 1 (HF's default without mscale settings); 1.0
    for the other rope types."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
    return get_mscale(factor)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q and k of a flat batch (to the first `rotary_dim` dims of
    each head with a partial_rotary_factor)."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(head_dim, params)
        self.max_position = max_position
        inv_freq = _inv_freq(self.rotary_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # cos_sin_cache: [max_position, rotary_dim] = [cos | sin], each [max_position, rotary_dim // 2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(params)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64; q: [T, num_heads * head_dim]; k: [T, num_kv_heads * head_dim]
        return apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


# Rope types whose angles are not one inv_freq per pair for every position: their own module.
_ROTARY_MODULES: dict[str, type[nn.Module]] = {"longrope": LongRopeEmbedding, "su": LongRopeEmbedding}


def rotary_embedding_for(head_dim: int, max_position: int, params: dict[str, Any]) -> nn.Module:
    """The rotary module of a rope setting (RotaryEmbedding, or LongRopeEmbedding for
    "longrope" / its older name "su"); both take (positions, q, k)."""
    module = _ROTARY_MODULES.get(params["rope_type"], RotaryEmbedding)
    return module(head_dim, max_position, params)


def get_rope(head_dim: int, max_position: int, hf_config: Any) -> nn.Module:
    """Rotary embedding configured from the checkpoint's rope_theta / rope_scaling."""
    return rotary_embedding_for(head_dim, max_position, rope_parameters(hf_config))
