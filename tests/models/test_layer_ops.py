"""The compiled fused layer ops (kernels/csrc/layer_ops.cpp) against the torch formulations
they replace: RMSNorm with and without the residual add, rotary embedding on strided q/k
views, silu-and-mul. float32 agrees to rounding. bfloat16 rounds at the same points: the
elementwise ops agree exactly; the norm within one bfloat16 step, since its mean of squares
sums in another order than torch's (whose order depends on its threads)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import build as cpu_kernels
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

TOL = {torch.float32: dict(atol=2e-6, rtol=1e-6), torch.bfloat16: dict(atol=0, rtol=0)}
# One bfloat16 step (8 significant bits): a float32 difference in the RMS can flip a rounding.
NORM_TOL = {torch.float32: TOL[torch.float32], torch.bfloat16: dict(atol=1e-6, rtol=2**-7)}


@pytest.fixture
def torch_only(monkeypatch):
    """Run a block with the torch formulations (as if the extension had not built)."""

    def run(fn):
        with monkeypatch.context() as m:
            m.setitem(cpu_kernels._loaded, ("layer_ops", cpu_kernels.cpu_isa()), None)
            return fn()

    return run


@pytest.fixture(scope="module")
def ops():
    module = cpu_kernels.layer_ops()
    assert module is not None, "the layer ops extension did not build"
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rms_norm_matches_torch(ops, torch_only, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=gen).to(dtype)
    x, residual = (torch.randn(rows, 576, generator=gen).to(dtype) for _ in range(2))
    assert cpu_kernels.use_layer_ops(x)  # the module takes the kernel...
    assert not torch_only(lambda: cpu_kernels.use_layer_ops(x))  # ...and torch_only the torch ops
    fused, (fused_normed, fused_sum) = norm(x), norm(x, residual)
    want, (want_normed, want_sum) = torch_only(lambda: (norm(x), norm(x, residual)))
    torch.testing.assert_close(fused, want, **NORM_TOL[dtype])
    torch.testing.assert_close(fused_normed, want_normed, **NORM_TOL[dtype])
    assert torch.equal(fused_sum, want_sum)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_torch_on_strided_views(ops, torch_only, dtype):
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(64, 4096, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 1024})
    qkv = torch.randn(7, 15 * 64, generator=gen).to(dtype)
    q, k = qkv[:, : 9 * 64], qkv[:, 9 * 64 : 12 * 64]  # views with the fused row stride
    positions = torch.tensor([0, 1, 17, 511, 1024, 2047, 4095])
    got = rope(positions, q, k)
    want = torch_only(lambda: rope(positions, q, k))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype])
    with pytest.raises(RuntimeError, match="outside the rotary cache"):
        ops.rotary_embedding(torch.tensor([4096] * 7), q, k, rope.cos_sin_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(ops, torch_only, dtype):
    gen = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(40, 2 * 96, generator=gen)).to(dtype)
    act = SiluAndMul()
    want = torch_only(lambda: act(x))
    torch.testing.assert_close(ops.silu_and_mul(x), want, **TOL[dtype])  # the kernel at any size
    torch.testing.assert_close(act(x[:2]), want[:2], **TOL[dtype])  # the module's fused rows


def test_argmax_rows_is_torchs_argmax() -> None:
    # The compiled row argmax the sampler's greedy rows take: torch's answer on random rows
    # (the vector body and a scalar tail: 49,157 columns), ties (the first), NaN (the first
    # NaN), all -inf, a strided view, and bfloat16 (torch's own).
    from pagedllm.kernels import argmax_rows

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 49157, generator=gen)
    x[1, 49156] = 100.0  # the maximum in the tail
    x[2, 17] = x[2, 4000] = 50.0  # a tie
    x[3, 9] = x[3, 70] = float("nan")
    x[4] = -float("inf")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [int(x[0].argmax()), 49156, 17, 9, 0]
    view = x[:, :1000]
    assert argmax_rows(view).tolist() == view.argmax(dim=-1).tolist()
    assert torch.equal(argmax_rows(x.bfloat16()), x.bfloat16().argmax(dim=-1))
