"""bfloat16 linears on CPUs without native bf16 (AVX2 without AVX512-BF16 / AMX).

There torch's bf16 matmul is 3-9x slower than float32 (measured at M = 8-128), so a bf16
model would be far slower than the float32 one. Here the weight stays bf16 (half the bytes)
and the arithmetic is float32 (bf16 inputs, float32 accumulation, one rounding of the output
to bf16, as a native bf16 unit computes), switching by the number of activation rows M:
- M <= KERNEL_MAX_ROWS (decode, short prefill chunks): the compiled AVX2 kernel
  (csrc/bf16_linear.cpp) widens the weight in registers up to 32 rows, reading it from
  memory once, and above that a panel of 8 weight rows at a time into a float32 buffer
  (csrc/gemm_tiles.h);
- larger M: `chunked_gemm` widens chunks of weight rows into a float32 buffer for torch's
  float32 GEMM.
Measured (2-core AVX2 EPYC, loaded by other agents, 1 thread, ms per [3072, 576] layer):
M=1 float32 0.54 / torch bf16 0.53 / kernel 0.19; M=8 0.94 / 4.1 / 0.64;
M=64 4.1 / 37.8 / chunked GEMM 4.1; M=128 7.3 / 66 / 8.2. With 2 threads: M=64 panels ~1.8,
chunked GEMM 3.3.
"""

from __future__ import annotations

import functools
import logging

import torch

from pagedllm.kernels.build import bf16_linear_ops
from pagedllm.kernels.gemm import chunked_gemm
from pagedllm.kernels.isa import Isa, cpu_isa

logger = logging.getLogger(__name__)

# Up to this many activation rows the kernel; above, the chunked float32 GEMM.
KERNEL_MAX_ROWS = 128


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The first CPU's flags from /proc/cpuinfo, or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return None
    return frozenset(line.partition(":")[2].split())


@functools.cache
def native_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX), so torch's bf16 matmul
    (oneDNN) is the fast one."""
    flags = cpu_flags()
    if flags is None:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "avx512_bf16" in flags or "amx_bf16" in flags


_use_kernels: dict[Isa, bool] = {}  # per ISA (cpu_isa() may be switched): the answer below


def use_bf16_kernels() -> bool:
    """bf16 x bf16 linears go through `bf16_linear`: the CPU lacks native bf16 and the kernel
    builds (not on other architectures, under the generic ISA, nor with compiled kernels off)."""
    isa = cpu_isa()
    use = _use_kernels.get(isa)
    if use is None:
        use = _use_kernels[isa] = not native_bf16() and bf16_linear_ops() is not None
        logger.info("bf16 linears: %s", "float32 arithmetic on bf16 weights" if use else "torch")
    return use


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] bf16, weight: [N, K] bf16 (contiguous), bias: [N] -> [..., N] bf16."""
    ops = bf16_linear_ops()
    assert ops is not None, "bf16_linear needs the compiled kernel (see use_bf16_kernels)"
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    if x2.shape[0] <= KERNEL_MAX_ROWS:
        y = ops.bf16_linear(x2, weight, bias)
    else:
        y32 = chunked_gemm(x2.float(), n, lambda start, buf: ops.bf16_rows_to_float(weight, start, buf))
        if bias is not None:
            y32 += bias.float()
        y = y32.to(torch.bfloat16)
    return y.view(*lead, n)
