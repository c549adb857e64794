"""Many-row matmuls in bf16 on CPUs that compute bf16 natively (`--matmul-activations bf16`,
the default "auto" there: the CPU platform, `CpuPlatform.auto_matmul_activations`).

On a CPU with AMX-BF16 (or AVX512-BF16) torch's bf16 GEMM (oneDNN) runs several times the
float32 rate: measured on a 2-core Sapphire Rapids VM, 2 threads, [M, 576] x [576, 1536]:
M=16 0.19 ms float32 / 0.10 bf16; M=64 0.52 / 0.16; M=512 2.9 / 0.63 (330 against 2,200
GFLOP/s). The compiled quantized kernels compute in float32 from 4/8-bit weights (8-row tiles
and dequantized panels, ~80-90 GFLOP/s at M=64 there), so for matmuls of at least
`BF16_ACTIVATION_MIN_ROWS` activation rows (prefill chunks, decode batches of that size) a
layer keeps a bf16 copy of its weight, made once at load (the dequantized 4/8-bit weight or
the float one, rounded to bf16: 2 bytes a weight beside the quantized ones), and multiplies
bf16 activations with it, accumulating in float32; the output is rounded to bf16 once (the
GEMM's own output type) and widened back to float32, where the residual stream stays.

The error is that of a bf16 model's matmuls (activations, weights and outputs each rounded to
8 significant bits); the drift against float32 on the default model is stated in
docs/bfloat16.md and bounded in tests/models/test_bf16_activations.py. Fewer rows keep the
float32 kernels: single-stream and small-batch decode read 0.6-1.1 bytes a weight there
against the copy's 2.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pagedllm.config import PrefillActivations
from pagedllm.kernels.bf16 import native_bf16
from pagedllm.kernels.gguf_blocks import GGUFBlocks
from pagedllm.kernels.gguf_blocks import dequantize_rows_bf16_into as gguf_rows_bf16_into
from pagedllm.kernels.quantization import QuantizedWeight, dequantize_rows_bf16_into

logger = logging.getLogger(__name__)

# From this many activation rows up, the bf16 GEMM (below: the float32 kernels).
BF16_ACTIVATION_MIN_ROWS = 16

def bf16_weight_copy(weight: torch.Tensor | QuantizedWeight | list[QuantizedWeight | GGUFBlocks]) -> torch.Tensor:
    """bf16 [N, K] copy of a float weight or of a quantized one's dequantized values (GGUF
    blocks: the rows of the parts, stacked). Kept weights go straight into the copy, GGUF
    blocks decoded to bf16, a QuantizedWeight through a float32 buffer of a few rows that stays
    in L2 (the compiled dequantizers where built), never through a float32 copy of the whole
    matrix: a start-up cost of the bf16 default."""
    if isinstance(weight, torch.Tensor):
        return weight.detach().to(torch.bfloat16).contiguous()
    parts: list[QuantizedWeight | GGUFBlocks] = list(weight) if isinstance(weight, list) else [weight]
    k = parts[0].shape[1]
    assert all(p.shape[1] == k for p in parts), [p.shape for p in parts]
    out = torch.empty(sum(p.shape[0] for p in parts), k, dtype=torch.bfloat16)
    row = 0
    for part in parts:
        n = part.shape[0]
        if isinstance(part, GGUFBlocks):
            gguf_rows_bf16_into(part, 0, out[row : row + n])
        else:
            dequantize_rows_bf16_into(part, 0, out[row : row + n])
        row += n
    return out


def bf16_copy_for(
    source: torch.Tensor | QuantizedWeight | list[QuantizedWeight | GGUFBlocks], min_rows: int | None
) -> torch.Tensor | None:
    """The bf16 copy a layer keeps for bf16 activations from `min_rows` rows up: None where
    min_rows is None (the mode is off) or the weight is neither quantized (GGUF blocks: the
    layer's parts) nor a non-empty float32 tensor (a bf16 model's weights are already bf16)."""
    if min_rows is None:
        return None
    if isinstance(source, torch.Tensor) and (source.dtype != torch.float32 or source.numel() == 0):
        return None
    return bf16_weight_copy(source)


def bf16_activation_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] (any float dtype), weight: bf16 [N, K] -> float32 [M, N]: x rounded to bf16,
    torch's bf16 GEMM, the output widened (plus the bias, in float32)."""
    y = F.linear(x.to(torch.bfloat16), weight).float()
    if bias is not None:
        y += bias.float()
    return y


def bf16_copy_bytes(net: torch.nn.Module) -> int:
    """Bytes of the bf16 weight copies the layers of `net` keep (0 without bf16 activations)."""
    copies = (getattr(m, "bf16_weight", None) for m in net.modules())
    return sum(c.nbytes for c in copies if isinstance(c, torch.Tensor))


def warn_if_not_native() -> None:
    """bf16 activations are correct everywhere, but only fast where the CPU computes bf16."""
    if not native_bf16():
        logger.warning(
            "--matmul-activations bf16: this CPU has no native bf16 (AMX-BF16 or AVX512-BF16), where "
            "torch's bf16 matmul is slower than float32; use --matmul-activations float32 or int8"
        )
