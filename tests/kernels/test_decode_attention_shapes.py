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


@needs_kernel
@pytest.mark.parametrize("G", [1, 3, 8])
@pytest.mark.parametrize("D", [16, 20, 64])  # 20: the scalar path (no 8-lane split)
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16 q and cache: the scalar path
def test_decode_attention_with_sinks(G: int, D: int, layout: str, dtype: torch.dtype) -> None:
    # Attention sinks (gpt-oss): each head's logit joins its softmax with no value row. Sinks
    # of +-3 against scores of ~1 take much of the weight (a kernel ignoring them is ~0.1 off),
    # with a window and a soft-cap too; a context of one key.
    g = torch.Generator().manual_seed(G * 100 + D)
    B, Hkv, bs, max_blocks = 3, 2, 4, 12
    Hq = G * Hkv
    seq_lens = torch.tensor([1, 13, 45])
    sinks = 3 * torch.randn(Hq, generator=g)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    if layout == "paged":
        num_blocks = B * max_blocks + 1
        cache = torch.randn(2, num_blocks, bs, Hkv, D, generator=g).to(dtype)
        tables = (torch.randperm(num_blocks - 1, generator=g)[: B * max_blocks] + 1).view(B, max_blocks).long()

        def rows_of(b: int, t: int) -> int:
            return int(tables[b, t // bs]) * bs + t % bs

        def run(window: int, cap: float, s: torch.Tensor | None) -> torch.Tensor:
            return ops.paged_decode_attention(q, cache, tables, seq_lens, 0.2, window, cap, s)
    else:
        capacity = 48
        cache = torch.randn(2, B + 1, capacity, Hkv, D, generator=g).to(dtype)
        slots = torch.tensor([2, 0, 3])

        def rows_of(b: int, t: int) -> int:
            return int(slots[b]) * capacity + t

        def run(window: int, cap: float, s: torch.Tensor | None) -> torch.Tensor:
            return ops.contiguous_decode_attention(q, cache, slots, seq_lens, 0.2, window, cap, s)

    flat = cache.view(2, -1, Hkv, D)
    atol = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the output rounded to 8 bits
    for window, cap in ((0, 0.0), (11, 0.0), (0, 1.5)):
        want = _float64_decode(q, flat[0], flat[1], seq_lens, rows_of, 0.2, window, cap, sinks)
        got = run(window, cap, sinks)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=atol)
        without = run(window, cap, None).double()
        assert float((without - want).abs().max()) > 0.05  # the sinks matter here
