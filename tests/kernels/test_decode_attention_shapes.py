"""The compiled decode attention (kernels/csrc/paged_attention.h) over the shapes its vector
passes split differently: query heads per KV head G (scores in groups of up to 3 heads, the
weighted V sum in groups of up to 3 or 4), head_dim D (AVX-512's 16 lanes or AVX2's 8, in
slices of 1, 2 or 4 vectors; 24 has no 16-lane path), contexts shorter than eight keys, not a
multiple of eight, and past the prefetch distance; with a window and a soft-cap; float32 and
the 8-bit codes. Against float64 attention over the (dequantized) cache."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.kv_quant import KV_QUANT_FORMATS, dequantize_rows, quantize_rows
from tests.kernels.test_kv_quant import _float64_decode, needs_kernel, ops


@needs_kernel
@pytest.mark.parametrize("G", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("D", [16, 24, 32, 64, 80, 128])
@pytest.mark.parametrize("kv", ["float32", "int8", "fp8_e4m3", "fp8_e5m2"])
def test_decode_attention_group_and_head_dim(G: int, D: int, kv: str) -> None:
    g = torch.Generator().manual_seed(G * 1000 + D)
    B, Hkv, bs, max_blocks = 4, 2, 4, 12
    seq_lens = torch.tensor([1, 7, 29, 45])  # < 8 keys, a tail, past the 16-row prefetch
    num_blocks = B * max_blocks + 1
    cache = torch.randn(2, num_blocks, bs, Hkv, D, generator=g)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: B * max_blocks] + 1).view(B, max_blocks).long()
    if kv != "float32":
        cache = quantize_rows(cache, KV_QUANT_FORMATS[kv])
        read = dequantize_rows(cache, torch.float32)
    else:
        read = cache
    flat = read.view(2, -1, Hkv, D)
    q = torch.randn(B, G * Hkv, D, generator=g)

    def rows_of(b: int, t: int) -> int:
        return int(tables[b, t // bs]) * bs + t % bs

    for window, cap in ((0, 0.0), (11, 0.0), (0, 1.5)):  # cap 1.5 bites: |scores| reach ~3
        got = ops.paged_decode_attention(q, cache, tables, seq_lens, 0.2, window, cap)
        want = _float64_decode(q, flat[0], flat[1], seq_lens, rows_of, 0.2, window, cap)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
