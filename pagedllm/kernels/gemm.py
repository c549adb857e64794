"""Matmuls whose weight is stored compactly (quantized, or bf16 on a CPU without native bf16)
on torch's float32 GEMM: up to `CHUNK_ROWS` weight rows at a time are expanded into one
reused float32 buffer and multiplied. For larger M (prefill, big batches) this beats
computing from the compact weight in registers, the expansion being paid once per M rows.

`chunked_bf16_gemm` is the same with bf16 panels and torch's bf16 GEMM (bf16 matmul
activations on a CPU that computes bf16 natively): the activations rounded to bf16 once, each
chunk of rows expanded to bf16, the output in bf16 (as a bf16 model's matmul), widened at the
end. Neither keeps a copy of the weight: the buffers are CHUNK_ROWS x K."""

from __future__ import annotations

from typing import Callable

import torch

# Weight rows expanded at a time (a float32 buffer of at most 2048 x K).
CHUNK_ROWS = 2048

# The reused buffer per dtype: float32 rows for torch's GEMM, bf16 panels for its bf16 GEMM.
_buffers: dict[torch.dtype, torch.Tensor] = {}


def chunked_gemm(
    x: torch.Tensor, num_rows: int, fill_rows: Callable[[int, torch.Tensor], None]
) -> torch.Tensor:
    """x: [M, K] float32 -> x @ W.T: [M, num_rows] float32, where `fill_rows(start, buf)`
    writes W's rows [start, start + buf.shape[0]) as float32 into buf ([rows, K])."""
    return _chunked(x, num_rows, fill_rows, torch.float32)


def chunked_bf16_gemm(
    x: torch.Tensor, num_rows: int, fill_rows: Callable[[int, torch.Tensor], None]
) -> torch.Tensor:
    """x: [M, K] float32 -> float32 [M, num_rows]: widen(bf16(x) @ W.T in bf16), where
    `fill_rows(start, buf)` writes W's rows [start, start + buf.shape[0]) as bf16 into buf."""
    return _chunked(x, num_rows, fill_rows, torch.bfloat16).float()


def _chunked(
    x: torch.Tensor, num_rows: int, fill_rows: Callable[[int, torch.Tensor], None], dtype: torch.dtype
) -> torch.Tensor:
    """x (in `dtype`) @ W.T in `dtype`, CHUNK_ROWS rows of W at a time in the reused buffer."""
    k = x.shape[1]
    rows = min(num_rows, CHUNK_ROWS)
    buffer = _buffers.get(dtype)
    if buffer is None or buffer.numel() < rows * k:
        # A normal tensor even when first needed under inference mode: the buffer outlives the
        # call, and an inference tensor could not be written by a later call outside it.
        with torch.inference_mode(False):
            buffer = _buffers[dtype] = torch.empty(rows * k, dtype=dtype)
    xd = x.to(dtype)
    y = torch.empty(x.shape[0], num_rows, dtype=dtype)
    for start in range(0, num_rows, rows):
        size = min(rows, num_rows - start)
        buf = buffer[: size * k].view(size, k)
        fill_rows(start, buf)
        torch.mm(xd, buf.t(), out=y[:, start : start + size])
    return y
