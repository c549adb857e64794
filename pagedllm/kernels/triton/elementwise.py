"""Rotary embedding, RMSNorm (optionally after the residual add) and silu-and-mul in Triton.

Each computes in float32 and rounds to the tensor dtype where the torch formulation in
kernels/elementwise.py rounds: RMSNorm's normalised row before the weight multiply, the sum
of the residual add, the rotated q/k, silu(gate) * up. One program per token row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.triton.attention import next_power_of_2

__all__ = ["rotary_embedding", "rms_norm", "add_rms_norm", "silu_and_mul"]


@triton.jit
def _rotary_kernel(
    out_ptr, x_ptr, positions_ptr, cos_sin_ptr,
    stride_x_tok, stride_o_tok, stride_cs_pos, num_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # x: [T, H * 2 * HALF] rotate-half layout; cos_sin: [max_position, 2 * HALF] = [cos | sin]
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)
    i_valid = i < HALF
    mask = (h[:, None] < num_heads) & i_valid[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs_pos + i, mask=i_valid, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs_pos + HALF + i, mask=i_valid, other=0.0)
    cos = cos.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]  # rounded as the torch path's
    sin = sin.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    cols = h[:, None] * (2 * HALF) + i[None, :]  # [BLOCK_H, BLOCK_HALF], first halves
    x1 = tl.load(x_ptr + t * stride_x_tok + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + t * stride_x_tok + cols + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * stride_o_tok + cols, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_ptr + t * stride_o_tok + cols + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def _rotate(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    num_tokens = x.shape[0]
    head_dim = cos_sin_cache.shape[1]
    num_heads = x.shape[1] // head_dim
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=x.dtype, device=x.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            out, x, positions, cos_sin_cache, x.stride(0), out.stride(0), cos_sin_cache.stride(0),
            num_heads, HALF=half, BLOCK_H=next_power_of_2(num_heads), BLOCK_HALF=next_power_of_2(half),
        )
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; q: [T, Hq * D], k: [T, Hkv * D] (unit stride on the last dim);
    cos_sin_cache: [max_position, D] float32 -> rotated (q, k), new tensors."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    return _rotate(positions, q, cos_sin_cache), _rotate(positions, k, cos_sin_cache)


@triton.jit
def _rms_norm_kernel(
    out_ptr, sum_ptr, x_ptr, residual_ptr, weight_ptr, eps,
    stride_x, stride_r, stride_o, stride_s, hidden,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # the sum in the model dtype
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * inv_rms).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(dtype), mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    rows, hidden = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else out
    if rows:
        r = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](
            out, summed, x, r, weight, float(eps),
            x.stride(0), r.stride(0), out.stride(0), summed.stride(0), hidden,
            HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(hidden),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim; x: [rows, hidden]."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); x, residual: [rows, hidden]."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * width] = [gate | up] -> silu(gate) * up: [rows, width]."""
    rows, double = x.shape
    width = double // 2
    assert x.stride(-1) == 1
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, next_power_of_2(width))
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](out, x, x.stride(0), out.stride(0), width, BLOCK=block)
    return out
