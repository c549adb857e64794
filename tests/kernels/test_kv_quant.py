"""8-bit KV caches (layers/kv_quant.py, kernels/csrc/kv_codes.h): the codes round-trip within
the format's step, the compiled writer stores the bytes the torch writer stores, and the
decode kernels on codes match float64 attention over the dequantized cache (the widening is
exact) and float attention over the unquantized cache within a stated tolerance."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import paged_attention_ops
from pagedllm.layers.kv_quant import KV_QUANT_FORMATS, dequantize_rows, quantize_rows

FORMATS = list(KV_QUANT_FORMATS)
# Largest |dequantized - x| / max|row|: half a step of the code nearest the row's max.
ROUND_TRIP = {"int8": 0.5 / 127, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
# Decode output against float attention on the unquantized cache, max abs error, for unit
# normal K/V (outputs of magnitude ~0.3-1): measured 0.012 / 0.087 / 0.14 at this seed.
ATTENTION_TOL = {"int8": 0.03, "fp8_e4m3": 0.2, "fp8_e5m2": 0.3}

ops = paged_attention_ops()
needs_kernel = pytest.mark.skipif(ops is None, reason="the compiled paged_attention extension did not build")


@pytest.mark.parametrize("name", FORMATS)
def test_rows_round_trip_within_half_a_step(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    x[0, 0] = 0.0  # an all-zero row: scale 1, codes 0
    packed = quantize_rows(x, KV_QUANT_FORMATS[name])
    assert packed.shape == (64, 4, 36) and packed.dtype == KV_QUANT_FORMATS[name].torch_dtype
    y = dequantize_rows(packed, torch.float32)
    err = (y - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    assert float(err.max()) <= ROUND_TRIP[name] * 1.0001
    assert not y[0, 0].any()
    # A row's largest value is exact (it maps to qmax).
    idx = x.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(y.gather(-1, idx), x.gather(-1, idx), rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
def test_compiled_writer_stores_the_torch_writers_bytes(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 64, generator=g) * 3
    x[0] = 0.0
    x[1, :8] = 1e-7  # codes in the subnormal range of the fp8 formats
    x[2] = -x[2].abs()
    fmt = KV_QUANT_FORMATS[name]
    out = torch.empty(200, 68, dtype=fmt.torch_dtype)
    ops.quantize_kv_rows(x, out)
    assert torch.equal(out.view(torch.uint8), quantize_rows(x, fmt).view(torch.uint8))


def _float64_decode(q, k, v, seq_lens, rows_of, scale, window, cap, sinks=None):
    """Per request and head: softmax(q.k scale) v in float64; k/v [num_rows, Hkv, D]; with
    ``sinks`` [Hq], head h's sink logit joins its softmax with no value row."""
    B, Hq, _ = q.shape
    group = Hq // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(B):
        n = int(seq_lens[b])
        pos = range(max(0, n - window) if window else 0, n)
        rows = torch.tensor([rows_of(b, t) for t in pos])
        for h in range(Hq):
            s = (k[rows, h // group].double() @ q[b, h].double()) * scale
            if cap:
                s = cap * torch.tanh(s / cap)
            if sinks is not None:
                s = torch.cat([s, sinks[h : h + 1].double()])
            p = s.softmax(0)[: len(rows)]
            out[b, h] = p @ v[rows, h // group].double()
    return out


@needs_kernel
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,cap", [(0, 0.0), (7, 5.0)])
def test_decode_kernels_read_codes(name, layout, q_dtype, window, cap):
    g = torch.Generator().manual_seed(2)
    B, Hq, Hkv, D, bs = 3, 6, 2, 64, 4
    fmt = KV_QUANT_FORMATS[name]
    q = torch.randn(B, Hq, D, generator=g).to(q_dtype)
    seq_lens = torch.tensor([17, 20, 5])
    if layout == "paged":
        num_blocks = 20
        kv = torch.randn(2, num_blocks, bs, Hkv, D, generator=g)
        tables = (torch.randperm(num_blocks - 1, generator=g)[:15] + 1).view(B, 5).long()

        def rows_of(b, t):
            return int(tables[b, t // bs]) * bs + t % bs

        def run(cache):
            return ops.paged_decode_attention(q, cache, tables, seq_lens, 0.125, window, cap)
    else:
        capacity = 24
        kv = torch.randn(2, 4, capacity, Hkv, D, generator=g)
        slots = torch.tensor([2, 0, 3])

        def rows_of(b, t):
            return int(slots[b]) * capacity + t

        def run(cache):
            return ops.contiguous_decode_attention(q, cache, slots, seq_lens, 0.125, window, cap)
    packed = quantize_rows(kv, fmt)
    out = run(packed)
    assert out.dtype == q_dtype and out.shape == q.shape
    deq = dequantize_rows(packed, torch.float32)
    flat = deq.view(2, -1, Hkv, D)
    exact = _float64_decode(q, flat[0], flat[1], seq_lens, rows_of, 0.125, window, cap)
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=tol)
    flat = kv.view(2, -1, Hkv, D)
    unquantized = _float64_decode(q, flat[0], flat[1], seq_lens, rows_of, 0.125, window, cap)
    assert float((out.double() - unquantized).abs().max()) < ATTENTION_TOL[name]
