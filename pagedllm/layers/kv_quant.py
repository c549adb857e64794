"""The 8-bit KV cache formats (``--kv-cache-dtype int8 | fp8 | fp8_e4m3 | fp8_e5m2``).

A quantized cache keeps the layouts of attention/layouts.py with one change: each (token, KV
head) row of ``head_dim`` values becomes ``head_dim`` 8-bit codes followed by that row's
float32 scale in 4 more bytes, so the last dimension is ``head_dim + 4`` and the tensor's
dtype (int8, float8_e4m3fn, float8_e5m2) names the format. value = code * scale, with scale =
max |row| / qmax (1 for an all-zero row), so every row uses the code's full range and nothing
clips.

Why a scale per row and not per (head, block): a row's scale is settled by the row alone at
its write, so a write never revisits earlier rows of its block (no re-quantization when a
later token is larger, no clipping), and blocks move as bytes (copy-on-write, KV transfer,
prefix sharing) with their scales inside them. It costs 4 bytes per head_dim codes (6% at
head_dim 64) and factors out of both attention sums: q . k = scale_k * (q . codes), and
sum_i p_i v_i = sum_i (p_i scale_i) codes_i, so the kernels widen codes to float32 and apply
one multiply per row (kernels/csrc/paged_attention.h).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4
"""Bytes after each row's codes: its float32 scale."""


@dataclass(frozen=True)
class KVQuantFormat:
    name: str
    """A resolved storage name (config.resolve_kv_cache_dtype)."""
    torch_dtype: torch.dtype
    """The cache tensor's dtype (one byte per code)."""
    qmax: float
    """The largest code magnitude: a row's max |value| maps to it."""


KV_QUANT_FORMATS: dict[str, KVQuantFormat] = {
    "int8": KVQuantFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVQuantFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVQuantFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}
_BY_DTYPE = {f.torch_dtype: f for f in KV_QUANT_FORMATS.values()}


def quant_format(cache: torch.Tensor) -> KVQuantFormat | None:
    """The format of a cache tensor (or a slice of one); None for a float cache."""
    return _BY_DTYPE.get(cache.dtype)


def row_width(storage: str, head_dim: int) -> int:
    """Elements per (token, head) row of a cache stored as ``storage``."""
    return head_dim + SCALE_BYTES if storage in KV_QUANT_FORMATS else head_dim


def row_bytes(storage: str, head_dim: int) -> int:
    """Bytes per (token, head) row: codes and scale, or head_dim float elements."""
    if storage in KV_QUANT_FORMATS:
        return head_dim + SCALE_BYTES
    return head_dim * torch.empty((), dtype=getattr(torch, storage)).element_size()


def cache_torch_dtype(storage: str) -> torch.dtype:
    fmt = KV_QUANT_FORMATS.get(storage)
    return fmt.torch_dtype if fmt is not None else getattr(torch, storage)


def quantize_rows(x: torch.Tensor, fmt: KVQuantFormat) -> torch.Tensor:
    """x [..., D] float -> [..., D + 4] codes and scale in ``fmt.torch_dtype``. The same
    arithmetic as the compiled writer (kernels/csrc/paged_attention.h, quantize_row): float32
    max |x| / qmax, x / scale, round half to even (int8) or the dtype's conversion (fp8)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)  # [..., 1]
    scale = torch.where(amax > 0, amax / fmt.qmax, torch.ones_like(amax))
    y = (x / scale).clamp(-fmt.qmax, fmt.qmax)
    codes = y.round().to(torch.int8) if fmt.torch_dtype == torch.int8 else y.to(fmt.torch_dtype)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.uint8, device=x.device)
    out[..., : x.shape[-1]] = codes.view(torch.uint8)
    out[..., x.shape[-1] :] = scale.view(torch.uint8)
    return out.view(fmt.torch_dtype)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows [..., D + 4] of a quantized cache -> [..., D] in ``dtype``; a float cache's rows
    are returned as they are (cast to ``dtype``)."""
    if quant_format(rows) is None:
        return rows.to(dtype)
    raw = rows.contiguous().view(torch.uint8)
    d = raw.shape[-1] - SCALE_BYTES
    scale = raw[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (raw[..., :d].view(rows.dtype).float() * scale).to(dtype)
