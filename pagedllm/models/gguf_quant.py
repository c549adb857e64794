"""GGUF quantized blocks -> QuantizedWeight, without going through float.

Every supported type is groups of 32 weights with a float scale (and an offset for the
asymmetric ones), which is exactly `QuantizedWeight`'s form:
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

import numpy as np
import torch

from pagedllm.kernels import GROUP_SIZE, QuantizedWeight, pack_int4
from pagedllm.models.gguf_index import GGUF_FLOAT_TYPES

GGUF_QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")


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
