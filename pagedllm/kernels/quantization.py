"""Weight-only quantized weights (int8 and 4-bit, groups of 32 input columns) and their matmul.

A `QuantizedWeight` holds a [N, K] weight as integers plus scales (and zeros for 4-bit) per
group of 32 consecutive columns of a row: GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K map onto it
exactly, and `--quantization int8|int4` produce it from float weights at load. Scales and
zeros are float16 where GGUF stores them so (Q8_0, Q4_0, Q4_1) and for `quantize_int4` /
`quantize_int8` (rounded to fp16 first, as llama.cpp's quantizer): a 4-bit group is then 20
bytes, as Q4_1's, against 24 with float32, and single-stream decode reads every byte of it a
token. They are float32 where fp16 would round them (Q4_K's d * sc products) or cannot hold
them (`_scale_dtype`).

The matmul (`quantized_linear`) switches by the number of activation rows M:
- M <= INT16_MAX_ROWS (single-stream decode): the compiled AVX2 kernel rounds the activations
  to int16 per group of 32 (error at most 1/65534 of the group's largest |x|, far below the
  weights' own 4- or 8-bit rounding) and takes integer dot products (madd_epi16): 1.8-2.4x
  (int4) and 2.7-3x (int8) faster than dequantizing to float at M = 1. Built where the
  compiler targets AVX512-BW/VL and VNNI, the same arithmetic runs with vpdpwssd on the codes
  as stored (csrc/quant_q16_avx512.h), four weight rows at a time with software prefetch: on
  the 2-core Sapphire Rapids, min of 20-30 alternated passes under other sessions' load, a
  4-bit layer in L2 1.8-2x, 30 layers' four 4-bit projections cycled (80 MB) 1.06-1.49x (the
  less, the more memory traffic the others make), the 49152-row Q8_0 LM head 1.47-1.63x.
- M <= TILE_MAX_ROWS: the compiled AVX2 kernel (csrc/quant_linear.h) reads the weight once
  per 8 rows and dequantizes in registers to float32 (batch 3 to 16: decode).
- M <= PANEL_MAX_ROWS: a panel of 8 weight rows is dequantized once into a small float32
  buffer (L1) and multiplied with every activation row in register tiles of 6 x 2
  (csrc/gemm_tiles.h): larger decode batches and short prefill chunks.
- larger M (prefill): dequantize a chunk of weight rows at a time into one reused float32
  buffer and multiply with torch's GEMM (`gemm.chunked_gemm`), which catches up there.
- with `int8_min_rows` (`--prefill-activations int8`, off by default), from that many rows
  up: the activations rounded to int8 per row and group of 32 and integer dot products
  against the stored 4/8-bit weights (csrc/quant_q8.h; docs/quantization.md for the algebra,
  the drift and the measurements).
Measured (2-core AVX2 EPYC, 2 threads, ms per [3072, 576] 4-bit layer; float32 weight with
torch's GEMM / 8-row tiles / panels / dequantize + GEMM): M=16 0.68 / 0.50 / 0.56 / 1.02;
M=32 1.75 / 1.38 / 0.97 / 2.79; M=64 2.67 / 2.65 / 1.77 / 3.64; M=128 4.36 / 6.14 / 3.52 /
5.33; M=256 7.6 / 17.7 / 8.0-10.0 / 10.3; M=512 15.2 / 35.3 / 16.7 / 16.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from pagedllm.kernels.build import quant_linear_ops
from pagedllm.kernels.gemm import chunked_bf16_gemm, chunked_gemm
from pagedllm.platforms.host import is_host_tensor

GROUP_SIZE = 32
# Up to this many activation rows, the kernel with int16 activations (integer dot products).
INT16_MAX_ROWS = 2
# Up to this many activation rows, the kernel with 8-row tiles; above, dequantized panels.
TILE_MAX_ROWS = 16
# Above this many activation rows, dequantize-then-GEMM.
PANEL_MAX_ROWS = 128
# With int8 prefill activations (--prefill-activations int8), from this many rows up the
# int8-activation kernel (csrc/quant_q8.h) runs instead of the panels / dequantize + GEMM.
INT8_ACTIVATION_MIN_ROWS = 129

QUANTIZATION_METHODS: tuple[str, ...] = ("gguf", "int8", "int4", "none")
# The dtypes a QuantizedWeight's scales and zeros may have (the kernels take both).
SCALE_DTYPES = (torch.float32, torch.float16)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight: w[n, 32 g + i] = q * scales[n, g] (+ zeros[n, g] for 4-bit)."""

    bits: Literal[4, 8]
    qweight: torch.Tensor
    """4-bit: uint8 [N, K / 2], per group byte i = element i | element (i + 16) << 4, q in
    [0, 15]; 8-bit: int8 [N, K]."""
    scales: torch.Tensor
    """float32 or float16 [N, K / 32]"""
    zeros: torch.Tensor | None
    """4-bit only: [N, K / 32] in the scales' dtype"""

    shape: tuple[int, int] = field(init=False)
    """(N, K), from the scales"""

    def __post_init__(self) -> None:
        if self.scales.dtype not in SCALE_DTYPES:
            raise ValueError(f"quantized weight scales must be float32 or float16, got {self.scales.dtype}")
        if self.zeros is not None and self.zeros.dtype != self.scales.dtype:
            raise ValueError(f"4-bit zeros ({self.zeros.dtype}) must have the scales' dtype ({self.scales.dtype})")
        n, g = self.scales.shape
        object.__setattr__(self, "shape", (int(n), int(g) * GROUP_SIZE))

    @property
    def nbytes(self) -> int:
        zeros = 0 if self.zeros is None else self.zeros.nbytes
        return self.qweight.nbytes + self.scales.nbytes + zeros

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight of rows `index` (a permutation, or the rows an embedding looks up)."""
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantizedWeight(self.bits, self.qweight[index], self.scales[index], zeros)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] (torch formulation; the kernel's chunks agree with it exactly)."""
        n, k = self.shape
        scales = self.scales.float()[..., None]
        if self.bits == 8:
            q = self.qweight.float().view(n, -1, GROUP_SIZE)
            return (q * scales).view(n, k)
        assert self.zeros is not None
        packed = self.qweight.view(n, -1, GROUP_SIZE // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # [N, G, 32]
        return torch.addcmul(self.zeros.float()[..., None], q, scales).view(n, k)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of `parts` stacked in order (fused QKV or gate/up)."""
        bits = {p.bits for p in parts}
        if len(bits) != 1:
            raise ValueError(
                f"fused projection mixes {sorted(bits)}-bit quantized parts; a GGUF file must "
                "store the parts of one fused layer in the same bit width (use --quantization none)"
            )
        # Parts of mixed scale dtypes (say Q4_1 and Q4_K in one file) widen to float32 (exact).
        dtype = parts[0].scales.dtype if len({p.scales.dtype for p in parts}) == 1 else torch.float32
        zeros = None
        if parts[0].zeros is not None:
            zeros = torch.cat([p.zeros.to(dtype) for p in parts])  # type: ignore[union-attr]
        return QuantizedWeight(
            parts[0].bits,
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales.to(dtype) for p in parts]),
            zeros,
        )


def _groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % GROUP_SIZE:
        raise ValueError(f"cannot quantize a weight with {k} input columns: not a multiple of {GROUP_SIZE}")
    return w.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)


# fp16's largest finite value and smallest normal one (below it fp16 loses relative precision).
_FP16_MAX, _FP16_MIN_NORMAL = 65504.0, 2.0**-14


def _scale_dtype(scales: torch.Tensor, zeros: torch.Tensor | None = None) -> torch.dtype:
    """float16 where every scale is 0 or a normal fp16 number (relative rounding at most
    2^-11, a 4,000th of a 4-bit step) and every zero within fp16's range, as GGUF Q8_0 / Q4_1
    store them; else float32 (weights of extreme magnitude)."""
    a = scales.abs()
    ok = bool(((a == 0) | ((a >= _FP16_MIN_NORMAL) & (a <= _FP16_MAX))).all())
    if zeros is not None:
        ok = ok and bool((zeros.abs() <= _FP16_MAX).all())
    return torch.float16 if ok else torch.float32


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric int8 per group of 32 (as GGUF Q8_0): scale = absmax / 127, stored in fp16
    (`_scale_dtype`), the codes rounded against the stored scale."""
    g = _groups(w)
    scales = g.abs().amax(-1) / 127.0
    scales = scales.to(_scale_dtype(scales))
    s32 = scales.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    q = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q.view(w.shape[0], -1), scales.contiguous(), None)


def quantize_int4(w: torch.Tensor) -> QuantizedWeight:
    """Asymmetric 4-bit per group of 32 (as GGUF Q4_1): w ~ q * (max - min) / 15 + min, the
    scale and min stored in fp16 (`_scale_dtype`), the codes rounded against the stored ones."""
    g = _groups(w)
    lo, hi = g.amin(-1), g.amax(-1)
    dtype = _scale_dtype((hi - lo) / 15.0, lo)
    zeros = lo.to(dtype)
    scales = ((hi - zeros.float()) / 15.0).to(dtype)
    s32, z32 = scales.float(), zeros.float()
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    q = torch.round((g - z32[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(4, pack_int4(q), scales.contiguous(), zeros.contiguous())


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: uint8 [N, G, 32] in [0, 15] -> uint8 [N, G * 16] in the kernel's nibble order."""
    n = q.shape[0]
    return (q[..., : GROUP_SIZE // 2] | (q[..., GROUP_SIZE // 2 :] << 4)).reshape(n, -1).contiguous()


def quantize(w: torch.Tensor, bits: Literal[4, 8]) -> QuantizedWeight:
    return quantize_int8(w) if bits == 8 else quantize_int4(w)


def quantized_linear(
    x: torch.Tensor,
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,
    int8_min_rows: int | None = None,
    bf16_panel_rows: int | None = None,
) -> torch.Tensor:
    """x: [..., K] -> [..., N]; computed in float32, returned in x's dtype.

    int8_min_rows: from this many activation rows up (None: never), the activations are
    rounded to int8 per group of 32 and multiplied in integers (`int8_activation_linear`).
    bf16_panel_rows: from this many rows up, past PANEL_MAX_ROWS (where the compiled kernels
    and the fused decode take the weight as stored), bf16 panels and torch's bf16 GEMM
    (`bf16_panel_gemm`; None: never)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        x2 = x  # the decode case: skip three no-op dispatches
    else:
        x2 = x.reshape(-1, k).float().contiguous()  # [M, K]
    ops = quant_linear_ops()
    rows = x2.shape[0]
    if ops is not None and int8_min_rows is not None and rows >= max(int8_min_rows, 1):
        y = _int8_activation_matmul(ops, x2, weight)
    elif ops is not None and 0 < rows <= PANEL_MAX_ROWS:
        # The compiled side picks the kernel by rows, as the fused decode does.
        if weight.bits == 8:
            y = ops.int8_linear(x2, weight.qweight, weight.scales, INT16_MAX_ROWS, TILE_MAX_ROWS)
        else:
            y = ops.int4_linear(x2, weight.qweight, weight.scales, weight.zeros, INT16_MAX_ROWS, TILE_MAX_ROWS)
    elif bf16_panel_rows is not None and rows >= bf16_panel_rows:
        y = bf16_panel_gemm(x2, weight)
    else:
        y = _dequantize_gemm(x2, weight)
    if bias is not None:
        y += bias.float()
    if x2 is x:
        return y
    return y.to(x.dtype).view(*lead, n)


def int8_activation_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x: [M, K] float32 -> [M, N] with x rounded to int8 per row and group of 32 (the
    compiled kernel, csrc/quant_q8.h); RuntimeError where the extension is not built."""
    ops = quant_linear_ops()
    if ops is None:
        raise RuntimeError("the int8-activation kernel needs the compiled quant_linear extension (AVX2)")
    return _int8_activation_matmul(ops, x.float().contiguous(), weight)


def _int8_activation_matmul(ops, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:  # type: ignore[no-untyped-def]
    if weight.bits == 8:
        return ops.int8_linear_q8(x, weight.qweight, weight.scales)
    return ops.int4_linear_q8(x, weight.qweight, weight.scales, weight.zeros)


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [M, K] float32 -> (xq int8 [M, K], scales [M, K / 32], exact group sums [M, K / 32])
    as the int8-activation kernel rounds them: xq = round-half-even(x * 127 / absmax)."""
    ops = quant_linear_ops()
    if ops is None:
        raise RuntimeError("the int8-activation kernel needs the compiled quant_linear extension (AVX2)")
    xq, dx, xs = ops.quantize_activations_int8(x.float().contiguous())
    return xq, dx, xs


def _dequantize_gemm(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x: [M, K] float32 -> [M, N], dequantizing a chunk of weight rows at a time."""
    return chunked_gemm(x, weight.shape[0], lambda start, buf: dequantize_rows_into(weight, start, buf))


def bf16_panel_gemm(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x: float32 [M, K] -> float32 [M, N] by gemm.chunked_bf16_gemm, each panel's rows by
    `dequantize_rows_bf16_into` (no copy of the weight kept)."""
    return chunked_bf16_gemm(x, weight.shape[0], lambda start, buf: dequantize_rows_bf16_into(weight, start, buf))


# Rows widened to float32 at a time on their way to bf16: the float32 step stays in L2
# (256 x 576 x 4 bytes: 576 KiB) and bounds the peak.
_BF16_STEP_ROWS = 256


def dequantize_rows_bf16_into(weight: QuantizedWeight, start: int, buf: torch.Tensor) -> None:
    """Rows [start, start + buf.shape[0]) of `weight` rounded to bf16 into buf ([rows, K]
    bf16): dequantized to float32 _BF16_STEP_ROWS rows at a time (`dequantize_rows_into`),
    never the whole range at once (a bf16 copy of a whole weight, a prefill's panel)."""
    step = torch.empty(min(_BF16_STEP_ROWS, buf.shape[0]), weight.shape[1])
    for s in range(0, buf.shape[0], _BF16_STEP_ROWS):
        rows = step[: min(_BF16_STEP_ROWS, buf.shape[0] - s)]
        dequantize_rows_into(weight, start + s, rows)
        buf[s : s + rows.shape[0]].copy_(rows)


def dequantize_rows_into(weight: QuantizedWeight, start: int, buf: torch.Tensor) -> None:
    """Rows [start, start + buf.shape[0]) of `weight` as float32 into buf ([rows, K]): the
    compiled kernel, or the torch formulation where it is not built (the same values)."""
    ops = quant_linear_ops()
    if ops is None:
        buf.copy_(weight.rows(torch.arange(start, start + buf.shape[0])).dequantize())
    elif weight.bits == 8:
        ops.int8_dequantize_rows(weight.qweight, weight.scales, start, buf)
    else:
        ops.int4_dequantize_rows(weight.qweight, weight.scales, weight.zeros, start, buf)


def embedding_lookup(input_ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """input_ids: [T] -> [T, K]: only the looked-up rows are dequantized (compiled: one call
    instead of a dozen torch ops, 0.16 -> ~0.02 ms of a batch-1 decode step)."""
    ops = quant_linear_ops()
    if ops is not None and is_host_tensor(input_ids) and input_ids.dtype == torch.int64 and input_ids.dim() == 1:
        if weight.bits == 8:
            rows = ops.int8_gather_rows(weight.qweight, weight.scales, input_ids)
        else:
            rows = ops.int4_gather_rows(weight.qweight, weight.scales, weight.zeros, input_ids)
        return rows if dtype == torch.float32 else rows.to(dtype)
    return weight.rows(input_ids).dequantize().to(dtype)
