"""The compiled fused layer ops (kernels/csrc/layer_ops.cpp) against the torch formulations
they replace: RMSNorm with and without the residual add, rotary embedding on strided q/k
views, silu-and-mul. float32 agrees to rounding. bfloat16 rounds at the same points: the
elementwise ops agree exactly; the norm within one bfloat16 step, since its mean of squares
sums in another order than torch's (whose order depends on its threads)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import build as cpu_kernels
from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.norm import GemmaRMSNorm, RMSNorm
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


def _gelu_tanh_f64(g: torch.Tensor) -> torch.Tensor:
    g = g.double()
    return 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_is_gelus_tanh_form(ops, torch_only, dtype):
    # Computed as x * sigmoid(2u) (the same function as 0.5 x (1 + tanh(u))): float32 within
    # 2e-6 relative of the float64 formula wherever |y| > 1e-3 (torch's own gelu is off by up to
    # 5e-5 there) and 1e-6 absolute below; bfloat16 within one bfloat16 step of torch's.
    gate = torch.linspace(-12, 12, 24001)
    x = torch.cat([gate, torch.ones_like(gate)])[None]  # up = 1: the activation itself
    got = ops.gelu_tanh_and_mul(x)[0].double()
    want = _gelu_tanh_f64(gate)
    big = want.abs() > 1e-3
    assert ((got - want).abs() / want.abs())[big].max() < 2e-6
    assert (got - want)[~big].abs().max() < 1e-6
    gen = torch.Generator().manual_seed(2)
    y = (4 * torch.randn(40, 2 * 96, generator=gen)).to(dtype)
    act = GeluAndMul("tanh")
    reference = torch_only(lambda: act(y))  # torch's F.gelu(gate, approximate="tanh") * up
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=2**-7)
    torch.testing.assert_close(act(y), reference, **tol)
    torch.testing.assert_close(act(y[:2]), reference[:2], **tol)  # a decode step's few rows (the scalar kernel in bf16)


def test_gemma_rms_norm_scales_by_one_plus_weight(ops, torch_only):
    # float32 through the compiled rms_norm by weight + 1 (its offset argument), after a
    # weight change as well, and on q/k heads (rows not evenly strided); against the torch
    # formulation.
    gen = torch.Generator().manual_seed(3)
    norm = GemmaRMSNorm(96, eps=1e-6)
    norm.weight.data.copy_(0.1 * torch.randn(96, generator=gen))
    x = torch.randn(7, 96, generator=gen)
    torch.testing.assert_close(norm(x), torch_only(lambda: norm(x)), **NORM_TOL[torch.float32])
    norm.weight.data.mul_(-1.0)  # written as the weight loaders write (no version bump)
    torch.testing.assert_close(norm(x), torch_only(lambda: norm(x)), **NORM_TOL[torch.float32])
    heads = torch.randn(5, 3 * 96, generator=gen)[:, :192].view(5, 2, 96)
    torch.testing.assert_close(norm(heads), torch_only(lambda: norm(heads)), **NORM_TOL[torch.float32])


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
