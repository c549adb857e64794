"""The int16-activation kernels (csrc/quant_linear.h's AVX2 one, quant_q16_avx512.h's
AVX-512 VNNI one where built) on 4-bit and 8-bit weights: against a float64 evaluation of the
same integer arithmetic (activations rounded as the kernel documents), and the dispatch of
quantized_linear at M <= INT16_MAX_ROWS to the build's last variant."""

from __future__ import annotations

import subprocess

import pytest
import torch

from pagedllm import kernels
from pagedllm.kernels import INT16_MAX_ROWS, QuantizedWeight, build, isa, quant_linear_ops, quantize, quantized_linear
from tests.utils import with_float32_scales

pytestmark = pytest.mark.skipif(
    not kernels.isa_at_least(kernels.cpu_isa(), "avx2") or quant_linear_ops() is None, reason="the int16-activation kernels are AVX2 code"
)

# (M, N, K): groups per row 1, 2, 3, 5, 18 (= 4 * 4 + 2: the AVX-512 int4 blocks' tails, and
# int8's odd tail), 48; N past several guided chunks (both threads take rows; 203: a last
# quad of 3 rows); M = 9: a row tile of 8 and one more (the AVX-512 kernel: tiles of 2).
SHAPES = [(1, 37, 32), (2, 19, 64), (1, 5, 96), (2, 40, 160), (1, 33, 576), (2, 17, 1536), (2, 203, 96), (9, 6, 96)]


def _variants() -> list[str]:
    ops = quant_linear_ops()
    return list(ops.q16_variants()) if ops is not None else []


def _weight(bits: int, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    w = quantize(torch.randn(n, k, generator=gen) * 0.05, bits)  # type: ignore[arg-type]
    if bits == 8:  # GGUF's Q8_0 may hold -128, which quantize_int8 never writes
        w.qweight.view(-1)[::29] = -128
    return w


def _reference(x: torch.Tensor, w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bound): y in float64 from the kernel's int16 activations (round-half-even of
    x * (32767 / group absmax), all in float32 as the kernel computes them) and exact integer
    group sums; bound: a float32-rounding allowance per output (1e-5 of the sum of every
    product's magnitude)."""
    m, k = x.shape
    n = w.shape[0]
    xg = x.view(m, -1, 32)  # [M, G, 32]
    amax = xg.abs().amax(-1)  # [M, G]
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv[..., None]).to(torch.int64)  # [M, G, 32]
    xs = amax / 32767.0  # float32, as the kernel
    if w.bits == 8:
        q = w.qweight.view(n, -1, 32).to(torch.int64)
    else:
        packed = w.qweight.view(n, -1, 16)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int64)  # [N, G, 32]
    dots = torch.einsum("mgi,ngi->mng", xq, q).double()  # exact integer group sums [M, N, G]
    scale = (w.scales[None, :, :] * xs[:, None, :]).double()  # float32 products, as the kernel
    terms = dots * scale
    size = terms.abs()  # each product's own magnitude (a group's two terms may cancel)
    if w.zeros is not None:
        zero_terms = w.zeros.double()[None] * xg.double().sum(-1)[:, None, :]
        terms = terms + zero_terms
        size = size + zero_terms.abs()
    return terms.sum(-1), 1e-5 * size.sum(-1) + 1e-7


@pytest.mark.parametrize("scales", ["float16", "float32"])
@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_q16_kernel_matches_integer_reference(
    variant: str, bits: int, shape: tuple[int, int, int], scales: str
) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + k + bits)
    w = _weight(bits, n, k, gen)
    if scales == "float32":
        w = with_float32_scales(w)
    assert w.scales.dtype == getattr(torch, scales)
    x = torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0  # an all-zero group: scale 0, no division by zero
    ops = quant_linear_ops()
    assert ops is not None
    if bits == 8:
        got = ops.int8_linear_q16(x, w.qweight, w.scales, variant)
    else:
        got = ops.int4_linear_q16(x, w.qweight, w.scales, w.zeros, variant)
    want, bound = _reference(x, w)
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_runs_the_builds_q16_kernel(bits: int) -> None:
    # At M <= INT16_MAX_ROWS quantized_linear (and the fused decode, through quant_matmul)
    # run the last variant q16_variants lists: AVX-512 where it is compiled.
    ops = quant_linear_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(7)
    w = _weight(bits, 50, 576, gen)
    x = torch.randn(INT16_MAX_ROWS, 576, generator=gen)
    variant = _variants()[-1]
    if bits == 8:
        want = ops.int8_linear_q16(x, w.qweight, w.scales, variant)
    else:
        want = ops.int4_linear_q16(x, w.qweight, w.scales, w.zeros, variant)
    assert torch.equal(quantized_linear(x, w), want)


def test_an_unknown_variant_is_refused() -> None:
    ops = quant_linear_ops()
    assert ops is not None
    w = _weight(8, 4, 32, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="no int16-activation kernel"):
        ops.int8_linear_q16(torch.zeros(1, 32), w.qweight, w.scales, "avx1024")


@pytest.mark.parametrize(
    ("flags", "avx512"),
    [(["-mavx2", "-mfma"], 0), (["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"], 1)],
)
def test_the_avx512_kernel_is_chosen_by_the_compilers_target(flags: list[str], avx512: int) -> None:
    # Both kernels compile on any x86 build host (an AVX2-only CI machine checks the AVX-512
    # code too); the AVX-512 one only where the target has AVX512-BW/VL and VNNI.
    cxx = isa.compiler_info("avx2").path
    assert cxx is not None
    src = f'#include "quant_linear.h"\nstatic_assert(PAGEDLLM_Q16_AVX512 == {avx512});\n'
    proc = subprocess.run(
        [cxx, *flags, "-fopenmp", "-fsyntax-only", "-I", str(build.CSRC), "-x", "c++", "-"],
        input=src, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
