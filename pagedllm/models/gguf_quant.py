"""A GGUF tensor's kept form: QuantizedWeight for Q4_0/Q4_1, GGUFBlocks for every other kept
type, BF16 blocks for the types that are dequantized (IQ1-IQ3, TQ1/TQ2).

| file type | kept as | resident bytes per 32 weights (file) |
| --- | --- | --- |
| Q4_1 | QuantizedWeight int4 + fp16 scale, zero | 20 (20) |
| Q4_0 | QuantizedWeight int4 + fp16 scale, zero = -8 d | 20 (18): +11%, for the fast kernels |
| Q4_0, Q4_1 of a 3-D expert stack | GGUFBlocks, the file's bytes | as in the file |
| Q8_0, Q4_K, Q5_*, Q2_K-Q6_K, IQ4_*, MXFP4 | GGUFBlocks, the file's bytes | as in the file |
| F16, BF16 | GGUFBlocks F16 / BF16 | 64 (64) |
| IQ1_*, IQ2_*, IQ3_*, TQ1_0, TQ2_0 | GGUFBlocks BF16 (dequantized) | 64 (7-14) |

(Q4_K's QuantizedWeight form, below, costs +33% over the file: it stays for callers that ask
for it, the loader keeps Q4_K as blocks.)

Into QuantizedWeight without going through float: each of its types is groups of 32 weights
with a float scale (and an offset for the asymmetric ones), which is exactly its form:
- Q8_0: 32 x int8 + fp16 d:                w = d q                 -> int8, scale d
- Q4_0: 32 x 4 bit + fp16 d:               w = d (q - 8)           -> int4, scale d, zero -8 d
- Q4_1: 32 x 4 bit + fp16 d, m:            w = d q + m             -> int4, scale d, zero m
- Q4_K: super-blocks of 256 = 8 groups of 32 with 6-bit sc, m per group and fp16 d, dmin:
                                           w = d sc q - dmin m     -> int4, scale d sc, zero -dmin m
(d sc and dmin m are exact in float32: an 11-bit mantissa times a 6-bit integer.)
Q8_0's and Q4_1's fp16 d and m stay fp16, and so does Q4_0's -8 d wherever it is exact in fp16
(it is unless d is past 8,188): the kernels widen them in registers, and a 4-bit group stays
20 bytes as in the file. Q4_K's products need float32.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pagedllm.kernels import GROUP_SIZE, QuantizedWeight, pack_int4
from pagedllm.kernels.gguf_blocks import KEPT_GGUF_TYPES, GGUFBlocks, row_bytes
from pagedllm.models.gguf_index import GGUF_FLOAT_TYPES

GGUF_QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
# The types kept as QuantizedWeight (its fast kernels, the compiled decode); others as blocks.
# Q8_0 was one until 2026-12-03: as blocks its decode runs the GGUF int16 kernel (1.40x
# quantized_linear's at one thread, docs/quantization.md) and a 1B file measured 1.47x tg and
# 1.29x pp256 (alternated, loaded machine; docs/benchmarks.md). gguf_quantized_weight still
# converts Q8_0 for callers that ask for it.
QUANTIZED_WEIGHT_TYPES = ("Q4_0", "Q4_1")
# Types dequantized to BF16 per tensor (no kernel of their own): gguf-py dequantizes them.
DEQUANTIZED_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "TQ1_0", "TQ2_0")


class TransposedKept(NamedTuple):
    """A kept matrix handed over in the layout of a checkpoint that stores it transposed,
    [in, out] (GPT-2's Conv1D; GGUFSpec.hf_transposed): `.t()` gives back the kept [out, in]
    rows as the file holds them, so no quantized block is ever reordered."""

    kept: QuantizedWeight | GGUFBlocks

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.kept.shape
        return k, n

    def t(self) -> QuantizedWeight | GGUFBlocks:
        return self.kept


KeptMatrix = QuantizedWeight | GGUFBlocks | torch.Tensor
KeptTensor = KeptMatrix | TransposedKept


def kept_gguf_tensor(
    data: np.ndarray, type_name: str, shape: tuple[int, int], rows: np.ndarray | None = None, expert: bool = False
) -> KeptMatrix:
    """A matrix of the file in its kept form (the table in the module docstring); F32 stays a
    float32 tensor. data: the raw [N, bytes per row] (or [N, K] for F32/F16) from the map;
    shape: (N, K) in HF order; rows: a row order to apply (llama.cpp's Q/K interleave undone),
    selected whole rows of bytes; expert: a slice of a 3-D expert stack, kept as GGUFBlocks in
    every kept type (Q4_0, Q4_1, Q8_0 too: the grouped-expert kernel, kernels/gguf_moe.py, runs
    on blocks; a view of `data`, no copy). ValueError for a type that is neither kept nor
    dequantized."""
    n, k = shape
    raw = data.reshape(n, -1)
    if rows is not None:
        raw = raw[rows]  # a copy in the new order
    if type_name == "F32":
        return torch.from_numpy(np.array(raw, dtype=np.float32, copy=True))
    if type_name in QUANTIZED_WEIGHT_TYPES and not expert:
        return gguf_quantized_weight(raw.view(np.uint8), type_name, shape)
    if type_name in KEPT_GGUF_TYPES:
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n, row_bytes(type_name, k))
        return GGUFBlocks(torch.from_numpy(blocks), type_name, k)
    if type_name in DEQUANTIZED_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = torch.from_numpy(dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[type_name]).reshape(n, k))
        return GGUFBlocks(w.to(torch.bfloat16).view(torch.uint8).reshape(n, 2 * k), "BF16", k)
    raise ValueError(
        f"GGUF tensor type {type_name} is not supported; kept: {', '.join(KEPT_GGUF_TYPES)}, "
        f"dequantized to BF16: {', '.join(DEQUANTIZED_TYPES)}"
    )


def kept_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Resident bytes of a matrix of `shape` (HF order), or of a 3-D expert stack, in its kept
    form (module docstring; an expert stack's Q4_0 stays blocks)."""
    elements = int(np.prod(shape))
    if type_name == "F32":
        return 4 * elements
    if type_name == "Q4_0" and len(shape) == 2:
        return elements // 32 * 20
    if type_name in KEPT_GGUF_TYPES:
        return elements // shape[-1] * row_bytes(type_name, shape[-1])
    return 2 * elements  # dequantized to BF16


def gguf_quantized_weight(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """data: a GGUF tensor's raw uint8 blocks, [N, bytes per row]; shape: (N, K) in HF order."""
    n, k = shape
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
    if type_name == "Q8_0":
        blocks = raw.reshape(n, k // 32, 34)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantizedWeight(8, torch.from_numpy(q), torch.from_numpy(d), None)
    if type_name in ("Q4_0", "Q4_1"):
        width = 18 if type_name == "Q4_0" else 20
        blocks = raw.reshape(n, k // 32, width)
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        if type_name == "Q4_1":
            zero = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        else:
            zero32 = -8.0 * d.astype(np.float32)
            with np.errstate(over="ignore"):
                zero = zero32.astype(np.float16)
            if not np.array_equal(zero.astype(np.float32), zero32):
                d, zero = d.astype(np.float32), zero32
        qs = blocks[..., width - 16 :].reshape(n, -1)  # already in the kernel's nibble order
        return QuantizedWeight(
            4, torch.from_numpy(qs.copy()), torch.from_numpy(d), torch.from_numpy(zero)
        )
    if type_name == "Q4_K":
        return _q4_k(raw, n, k)
    raise ValueError(
        f"GGUF tensor type {type_name} cannot stay quantized; --quantization gguf supports "
        f"{', '.join(GGUF_QUANT_TYPES)} (and float {', '.join(GGUF_FLOAT_TYPES)}); "
        "use --quantization none to dequantize it"
    )


def _q4_k(raw: np.ndarray, n: int, k: int) -> QuantizedWeight:
    from gguf.quants import Q4_K

    blocks = raw.reshape(n * (k // 256), 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each, 6-bit
    scales = (d * sc.astype(np.float32)).reshape(n, -1)
    zeros = (-(dmin * m.astype(np.float32))).reshape(n, -1)
    # qs: 4 chunks of 32 bytes; chunk j holds group 2j in its low nibbles, 2j+1 in its high.
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    return QuantizedWeight(
        4, pack_int4(torch.from_numpy(q)), torch.from_numpy(scales), torch.from_numpy(zeros)
    )
