"""The fused elementwise layer ops (csrc/layer_ops.cpp), each with its torch formulation:
the compiled op where it takes the input (`use_layer_ops`), else torch. Both round to the
tensor dtype at the same points, so they agree exactly in bfloat16 (up to the RMS mean's
summation order) and to rounding in float32.

CUDA tensors take the Triton kernels (kernels/triton/elementwise.py) when triton imports,
else the torch formulations.

Under the generic ISA the compiled ops are scalar loops; they still replace a chain of
small torch kernels (RMSNorm alone is nine) by one call, which is what they win at decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.kernels.build import layer_ops, use_layer_ops
from pagedllm.kernels.isa import cpu_isa, isa_at_least
from pagedllm.kernels.triton import triton_available, triton_ops
from pagedllm.platforms.host import is_host_tensor


def _device_ops(x: torch.Tensor):
    """The Triton launchers for a device tensor (not in host memory) of 2 dims with unit
    stride on the last, else None."""
    if not is_host_tensor(x) and x.dim() == 2 and x.stride(-1) == 1 and triton_available():
        return triton_ops(x.device)
    return None

# silu-and-mul: the AVX2 build's float32 path vectorises exp and beats torch's silu-then-
# multiply at every size (measured, 1536 wide, loaded machine: 1 row 0.002 vs 0.005 ms, 16 rows
# 0.013 vs 0.034, 256 rows 0.13 vs 3.8, 2048 rows 10.7 vs 24.1). Elsewhere (bfloat16, or the
# generic build) exp is computed one element at a time, which wins only up to a few rows
# (bfloat16, 16 rows: 0.16 vs 0.095 ms).
_SCALAR_SILU_MAX_ROWS = 4


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]; the statistic in float32, the scale after casting back
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim; x: [..., hidden]."""
    if (ops := _device_ops(x)) is not None:
        return ops.rms_norm(x, weight, eps)
    if use_layer_ops(x):
        return layer_ops().rms_norm(x, weight, eps)
    return _rms(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), the sum in the model dtype."""
    if (ops := _device_ops(x)) is not None and residual.stride(-1) == 1:
        return ops.add_rms_norm(x, residual, weight, eps)
    if use_layer_ops(x):
        normed, summed = layer_ops().add_rms_norm(x, residual, weight, eps)
        return normed, summed
    summed = residual + x
    return _rms(summed, weight, eps), summed


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding. positions: [T] int64; q: [T, Hq * D], k: [T, Hkv * D]
    (views with unit stride on the last dim are fine); cos_sin_cache: [max_position, D] float32,
    [cos | sin] each [max_position, D / 2]."""
    if (ops := _device_ops(q)) is not None and k.stride(-1) == 1:
        return ops.rotary_embedding(positions, q, k, cos_sin_cache)
    if use_layer_ops(q) and k.stride(-1) == 1 and positions.is_contiguous():
        q, k = layer_ops().rotary_embedding(positions, q, k, cos_sin_cache)
        return q, k
    head_dim = cos_sin_cache.shape[1]
    cos_sin = cos_sin_cache.index_select(0, positions).to(q.dtype)
    cos, sin = cos_sin[:, None, :].chunk(2, dim=-1)  # [T, 1, D / 2] each
    return _rotate(q, cos, sin, head_dim), _rotate(k, cos, sin, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_dim)  # [T, H, D]
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.view(num_tokens, -1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; x: [num_tokens, 2 * intermediate] = [gate | up] -> [num_tokens, intermediate]."""
    if (ops := _device_ops(x)) is not None:
        return ops.silu_and_mul(x)
    vector_exp = x.dtype == torch.float32 and isa_at_least(cpu_isa(), "avx2")
    if (vector_exp or x.shape[0] <= _SCALAR_SILU_MAX_ROWS) and use_layer_ops(x):
        return layer_ops().silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up; x: [num_tokens, 2 * intermediate] -> [num_tokens,
    intermediate]. On the host as silu_and_mul (the float32 AVX2 build's exp: within a few ulp
    of torch's gelu; the compiled decode forward runs the same function); torch elsewhere."""
    if is_host_tensor(x):
        vector_exp = x.dtype == torch.float32 and isa_at_least(cpu_isa(), "avx2")
        if (vector_exp or x.shape[0] <= _SCALAR_SILU_MAX_ROWS) and use_layer_ops(x):
            return layer_ops().gelu_tanh_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, V] -> int64 [rows], as x.argmax(dim=-1) (the first of equal maxima, NaN the
    largest): compiled for CPU float32 rows (a batch-1 decode step's 49,152 logits in ~10 us
    against torch's ~90), torch elsewhere."""
    if x.dtype == torch.float32 and x.numel() and use_layer_ops(x):
        return layer_ops().argmax_rows(x)
    return x.argmax(dim=-1)
