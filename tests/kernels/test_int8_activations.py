"""The int8-activation kernel (csrc/quant_q8.h) on 4-bit and 8-bit weights: against a float64
evaluation of the same quantized math, against the float-activation path within the bound
the activation rounding allows, and its dispatch in quantized_linear / set_prefill_activations."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedllm import kernels
from pagedllm.kernels import (
    GROUP_SIZE,
    QuantizedWeight,
    int8_activation_linear,
    quant_linear_ops,
    quantize,
    quantize_activations_int8,
    quantized_linear,
)
from pagedllm.kernels.quantization import _dequantize_gemm
from tests.utils import with_float32_scales

pytestmark = pytest.mark.skipif(
    not kernels.isa_at_least(kernels.cpu_isa(), "avx2") or quant_linear_ops() is None, reason="the int8-activation kernel is AVX2 code"
)

# (M, N, K): row tails of the 4 x NT tiles, weight-row tails of the chunks, and K with
# whole super-blocks of 8 groups (256, 1536), groups after them (288 = 8 + 1, 576 = 16 + 2)
# or none at all (32).
SHAPES = [(1, 1, 256), (5, 7, 32), (130, 37, 576), (9, 50, 1536), (4, 3, 288)]


def _weight(bits: int, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    w = quantize(torch.randn(n, k, generator=gen) * 0.05, bits)  # type: ignore[arg-type]
    if bits == 8:  # GGUF's Q8_0 may hold -128, which quantize_int8 never writes
        w.qweight.view(-1)[:: 97] = -128
    return w


def _activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen)
    x[0, :GROUP_SIZE] = 0.0  # an all-zero group: scale 0
    x[-1, -GROUP_SIZE:] *= 50.0  # an outlier group
    return x


def _weight_levels(w: QuantizedWeight) -> torch.Tensor:
    """q as float64 [N, G, 32]."""
    n, k = w.shape
    if w.bits == 8:
        return w.qweight.double().view(n, -1, GROUP_SIZE)
    packed = w.qweight.view(n, -1, GROUP_SIZE // 2)
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).double()


def test_quantize_activations_int8_rounds_as_stated() -> None:
    gen = torch.Generator().manual_seed(0)
    x = _activations(6, 576, gen)
    xq, dx, xs = quantize_activations_int8(x)
    g = x.view(6, -1, GROUP_SIZE)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    want = torch.round(g * inv[..., None]).to(torch.int8).view(6, -1)  # half to even, as cvtps
    assert torch.equal(xq, want)
    assert int(xq.min()) >= -127
    assert torch.equal(dx, amax / 127.0)
    torch.testing.assert_close(xs, g.sum(-1), atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_float64_of_the_same_quantized_math(
    bits: int, shape: tuple[int, int, int], scales: str
) -> None:
    # y = sum_g s dx <q, xq> (+ z * sum(x) for 4-bit): the integer sums are exact, so the
    # kernel differs from float64 only by float32 rounding of the scaled sums.
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + bits)
    w, x = _weight(bits, n, k, gen), _activations(m, k, gen)
    if scales == "float32":
        w = with_float32_scales(w)
    assert w.scales.dtype == getattr(torch, scales)
    xq, dx, xs = quantize_activations_int8(x)
    dots = torch.einsum("mgi,ngi->mng", xq.double().view(m, -1, GROUP_SIZE), _weight_levels(w))
    terms = dots * dx.double()[:, None, :] * w.scales.double()[None]  # [M, N, G]
    want = terms.sum(-1)
    scale = terms.abs().sum(-1)
    if w.zeros is not None:
        zero_terms = xs.double()[:, None, :] * w.zeros.double()[None]
        want += zero_terms.sum(-1)
        scale += zero_terms.abs().sum(-1)
    got = int8_activation_linear(x, w).double()
    assert got.shape == (m, n)
    # float32 products and sums of at most K / 32 + K / 256 terms: a few ulps of their size.
    assert ((got - want).abs() <= 1e-6 * scale + 1e-30).all(), float(((got - want).abs() / scale).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_within_the_activation_rounding_bound_of_the_float_path(bits: int) -> None:
    # Each x moves by at most half a step, dx / 2, so |y_int8 - y_float| <= sum_g dx_g / 2 *
    # sum_i |w_i| over the dequantized weights (plus float32 rounding of either path).
    m, n, k = 40, 96, 576
    gen = torch.Generator().manual_seed(bits)
    w, x = _weight(bits, n, k, gen), _activations(m, k, gen)
    _, dx, _ = quantize_activations_int8(x)
    wabs = w.dequantize().abs().view(n, -1, GROUP_SIZE).sum(-1)  # [N, G]
    bound = 0.5 * dx @ wabs.T
    got, ref = int8_activation_linear(x, w), _dequantize_gemm(x, w)
    slack = 1e-5 * (x.abs() @ w.dequantize().abs().T)
    diff = (got - ref).abs()
    assert (diff <= bound + slack).all()
    # and it is a real rounding, not a float path: it moves the result by a visible part of it
    assert float(diff.max()) > 1e-3 * float(bound.max())


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_takes_int8_from_min_rows(bits: int) -> None:
    gen = torch.Generator().manual_seed(3)
    w = _weight(bits, 24, 64, gen)
    bias = torch.randn(24, generator=gen)
    x = torch.randn(6, 64, generator=gen)
    int8 = int8_activation_linear(x, w) + bias
    assert torch.equal(quantized_linear(x, w, bias, int8_min_rows=6), int8)
    assert torch.equal(quantized_linear(x, w, bias, int8_min_rows=7), quantized_linear(x, w, bias))
    assert not torch.equal(quantized_linear(x, w, bias), int8)
    # leading dims and bfloat16 inputs go through the same rows
    x3 = x.view(2, 3, 64).bfloat16()
    got = quantized_linear(x3, w, bias, int8_min_rows=1)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 24)
    assert torch.equal(got, (int8_activation_linear(x3.reshape(6, 64).float(), w) + bias).bfloat16().view(2, 3, 24))


def test_generic_isa_keeps_the_float_path() -> None:
    gen = torch.Generator().manual_seed(4)
    w = _weight(4, 16, 64, gen)
    x = torch.randn(300, 64, generator=gen)
    try:
        kernels.set_cpu_isa("generic")
        got = quantized_linear(x, w, int8_min_rows=1)
    finally:
        kernels.set_cpu_isa(None)
    torch.testing.assert_close(got, x @ w.dequantize().T, atol=1e-4, rtol=1e-4)


def test_set_prefill_activations() -> None:
    from pagedllm.layers.linear import Linear, set_prefill_activations

    gen = torch.Generator().manual_seed(5)
    net = nn.Sequential(Linear(64, 32), Linear(32, 8))
    net[0].quant = _weight(4, 32, 64, gen)
    assert set_prefill_activations(net, "int8", min_rows=3) == 1
    assert [layer.int8_min_rows for layer in net] == [3, 3]
    x = torch.randn(4, 64, generator=gen)
    assert torch.equal(net[0](x), int8_activation_linear(x, net[0].quant))
    assert set_prefill_activations(net, "float") == 1
    assert net[0].int8_min_rows is None
    with pytest.raises(ValueError, match="prefill_activations='fp8'"):
        set_prefill_activations(net, "fp8")
