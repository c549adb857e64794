"""GGUF weights kept as the file stores them: raw ggml blocks, one row of blocks per output row.

A `GGUFBlocks` is a [N, K] matrix whose row n is the file's bytes for that row (K / block
elements blocks of the tensor's ggml type), so its resident bytes are the file's bytes. Row
permutations (llama.cpp's Q/K interleave undone) and row gathers (embedding lookups) select
whole rows of bytes; nothing is widened at load.

The matmul and the gather dequantize rows on the fly (`gguf_linear`, `gguf_embedding_lookup`)
with the compiled kernels of csrc/gguf_blocks.cpp (the `gguf_linear` extension, every ISA):
- M <= SMALL_M_MAX_ROWS (decode): the small-M kernel, threads over output rows, each weight
  row read once per call for all M activation rows (csrc/gguf_matmul.h);
- larger M (prefill): `chunked_gemm`, a chunk of rows decoded to float32 at a time
  (`dequantize_rows`) and torch's GEMM; with bf16 matmul activations (`bf16_min_rows`, what
  `--matmul-activations auto` picks where the CPU computes bf16 natively) from that many rows
  up bf16 panels: a chunk of rows decoded to bf16 (`dequantize_rows_bf16_into`) and
  torch's bf16 GEMM (oneDNN) on the activations rounded to bf16 (gemm.chunked_bf16_gemm). No
  copy of the weight is kept either way;
- the extension unavailable: gguf-py's numpy dequantizer (`reference_dequantize`) and the
  same GEMM; build.py says so once in the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.kernels.build import gguf_linear_ops
from pagedllm.kernels.gemm import chunked_bf16_gemm, chunked_gemm

# Up to this many activation rows the small-M kernel runs; above, decode + torch's GEMM.
SMALL_M_MAX_ROWS = 16
DECODE_ACTIVATIONS = ("int16", "int8")
"""How the small-M kernel (decode steps, M <= SMALL_M_MAX_ROWS) rounds its activations:
"int16" per group of 32 (the float32 mode's: drift below 1e-4 relative) or "int8" per block
of 256 against the K-quants (INT8_DECODE_TYPES; csrc/gguf_dot_int8_avx512.h: the integer
pipeline applies the sub-block scales, 1.4-2.5x the int16 kernel's speed per core; drift
about 0.7% relative per matmul on Gaussian activations, bounded in tests/kernels). Set per
layer by layers/linear.set_prefill_activations: "int8" in the bf16 and int8 modes."""
INT8_DECODE_TYPES = ("Q3_K", "Q4_K", "Q5_K", "Q6_K")
INT8_SMALL_M_MAX_ROWS = 64
"""With int8 decode activations the small-M kernel takes these types up to this many rows
(decode batches of up to 64 sequences, short prefill chunks): one thread, [2048, 2048], its
time against the bf16 panels' (decode to bf16 + torch's GEMM) at M = 32 / 64 / 128: Q4_K
0.67x / 0.95x / 1.25x, Q6_K 0.47x / 0.80x / 1.09x (2026-12-03, Zen 4)."""


def small_m_path(decode_activations: str) -> str:
    """The small-M kernel's path (csrc/gguf_matmul.h matmul_small) for a layer's
    decode_activations: "fast" (int8 where the type has that kernel) or "" (the build's choice)."""
    return "fast" if decode_activations == "int8" else ""


def small_m_max_rows(type_name: str, decode_activations: str) -> int:
    """The most activation rows the small-M kernel takes for a weight of this type."""
    if decode_activations == "int8" and type_name in INT8_DECODE_TYPES:
        return INT8_SMALL_M_MAX_ROWS
    return SMALL_M_MAX_ROWS

# ggml type name -> (elements per block, bytes per block), as the GGUF spec fixes them.
GGUF_BLOCK_GEOMETRY: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "MXFP4": (32, 17),
}
# The types kept as blocks and computed on directly.
KEPT_GGUF_TYPES: tuple[str, ...] = tuple(t for t in GGUF_BLOCK_GEOMETRY if t != "F32")


def row_bytes(type_name: str, k: int) -> int:
    """Bytes of one row of `k` elements of `type_name`; ValueError if k is not whole blocks."""
    elems, nbytes = GGUF_BLOCK_GEOMETRY[type_name]
    if k % elems:
        raise ValueError(f"a {type_name} row of {k} elements is not a whole number of {elems}-element blocks")
    return k // elems * nbytes


@dataclass(frozen=True)
class GGUFBlocks:
    """A [N, K] weight held as ggml blocks of one type, rows in HF order."""

    data: torch.Tensor
    """uint8 [N, row_bytes(type_name, K)]: row n's blocks, as in the file"""
    type_name: str
    """the ggml type (a key of GGUF_BLOCK_GEOMETRY)"""
    k: int
    """elements per row (input features)"""

    shape: tuple[int, int] = field(init=False)
    """(N, K)"""

    def __post_init__(self) -> None:
        if self.type_name not in GGUF_BLOCK_GEOMETRY:
            raise ValueError(f"GGUF type {self.type_name} is not kept as blocks; kept: {', '.join(KEPT_GGUF_TYPES)}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"GGUF blocks must be uint8 [N, row bytes], got {self.data.dtype} {tuple(self.data.shape)}")
        if self.data.shape[1] != row_bytes(self.type_name, self.k):
            raise ValueError(
                f"{self.type_name} rows of {self.k} elements take {row_bytes(self.type_name, self.k)} bytes, "
                f"got {self.data.shape[1]}"
            )
        object.__setattr__(self, "shape", (int(self.data.shape[0]), int(self.k)))

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def rows(self, index: torch.Tensor) -> GGUFBlocks:
        """The weight of rows `index` (a permutation, or the rows an embedding looks up)."""
        return GGUFBlocks(self.data[index], self.type_name, self.k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype` (the compiled decoder where built, else gguf-py's)."""
        return dequantize_blocks(self.data, self.type_name, self.k).to(dtype)

    @staticmethod
    def cat(parts: list[GGUFBlocks]) -> GGUFBlocks:
        """Rows of `parts` stacked in order; ValueError unless all share one type and K."""
        kinds = {(p.type_name, p.k) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack GGUF blocks of different types or widths: {sorted(kinds)}")
        return GGUFBlocks(torch.cat([p.data for p in parts]), parts[0].type_name, parts[0].k)


def dequantize_blocks(data: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    """uint8 [N, row bytes] of `type_name` -> float32 [N, k] (compiled; else the reference)."""
    ops = gguf_linear_ops()
    if ops is None or type_name not in KEPT_GGUF_TYPES:
        return reference_dequantize(data, type_name, k)
    out = torch.empty(data.shape[0], k)
    ops.dequantize_rows(data.contiguous(), type_index(ops, type_name), 0, out)
    return out


def dequantize_rows_into(weight: GGUFBlocks, start: int, buf: torch.Tensor) -> None:
    """Rows [start, start + buf.shape[0]) of `weight` as float32 into buf ([rows, K])."""
    ops = gguf_linear_ops()
    if ops is None or weight.type_name not in KEPT_GGUF_TYPES:
        buf.copy_(reference_dequantize(weight.data[start : start + buf.shape[0]], weight.type_name, weight.k))
    else:
        ops.dequantize_rows(weight.data.contiguous(), type_index(ops, weight.type_name), start, buf)


def dequantize_rows_bf16_into(weight: GGUFBlocks, start: int, buf: torch.Tensor) -> None:
    """Rows [start, start + buf.shape[0]) of `weight` rounded to bf16 into buf ([rows, K] bf16):
    decoded straight to bf16 where compiled (`dequantize_rows_bf16`, the same values as the
    float32 decode rounded by torch), else the reference decode rounded."""
    ops = gguf_linear_ops()
    if ops is None or weight.type_name not in KEPT_GGUF_TYPES:
        buf.copy_(reference_dequantize(weight.data[start : start + buf.shape[0]], weight.type_name, weight.k))
    else:
        ops.dequantize_rows_bf16(weight.data.contiguous(), type_index(ops, weight.type_name), start, buf)


def reference_dequantize(data: torch.Tensor, type_name: str, k: int) -> torch.Tensor:
    """uint8 [N, row bytes] of `type_name` -> float32 [N, k] (gguf-py's numpy dequantizer)."""
    n = data.shape[0]
    raw = data.contiguous().numpy()
    if type_name == "F16":
        out = raw.view(np.float16).astype(np.float32)
    elif type_name == "BF16":
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif type_name == "F32":
        out = raw.view(np.float32)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(raw, GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(n, k))


# id(extension module) -> {type name: its index in the module's type_names()}.
_type_indices: dict[int, dict[str, int]] = {}


def type_index(ops, type_name: str) -> int:  # type: ignore[no-untyped-def]
    """The extension's index of a kept type (its `type_names()` order)."""
    names = _type_indices.get(id(ops))
    if names is None:
        names = _type_indices[id(ops)] = {name: i for i, name in enumerate(ops.type_names())}
    return names[type_name]


def gguf_linear(
    x: torch.Tensor, weight: GGUFBlocks, bias: torch.Tensor | None = None, bf16_min_rows: int | None = None,
    decode_activations: str = "int16",
) -> torch.Tensor:
    """x: [..., K] -> [..., N] in float32 arithmetic, returned in x's dtype. Up to
    SMALL_M_MAX_ROWS rows, where the build has AVX-512 VNNI (`small_m_kernels()`), the activations
    are rounded to int16 per group of 32 (at most 1/65534 of the group's largest |x|), or with
    decode_activations "int8" (DECODE_ACTIVATIONS) for the K-quants the int8 kernel takes
    (INT8_DECODE_TYPES) to int8 per block of 256 (at most 1/254 of the block's largest |x|),
    those up to INT8_SMALL_M_MAX_ROWS rows. From
    `bf16_min_rows` rows up (above SMALL_M_MAX_ROWS; None: never) bf16 panels
    (gemm.chunked_bf16_gemm): the error of a bf16 model's matmul."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float().contiguous()  # [M, K]
    ops = gguf_linear_ops() if weight.type_name in KEPT_GGUF_TYPES else None
    m = x2.shape[0]
    if ops is not None and m <= small_m_max_rows(weight.type_name, decode_activations):
        index = type_index(ops, weight.type_name)
        y = ops.linear(x2, weight.data.contiguous(), index, small_m_path(decode_activations))
    elif ops is not None and bf16_min_rows is not None and m >= bf16_min_rows:
        # bf16 panels, decoded as csrc/decode_gguf_linear.h's bf16_panels decodes them (so the
        # fused decode gives the same floats)
        y = chunked_bf16_gemm(x2, n, lambda start, buf: dequantize_rows_bf16_into(weight, start, buf))
    else:
        y = chunked_gemm(x2, n, lambda start, buf: dequantize_rows_into(weight, start, buf))
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*lead, n)


def gguf_embedding_lookup(input_ids: torch.Tensor, weight: GGUFBlocks, dtype: torch.dtype) -> torch.Tensor:
    """input_ids: [T] -> [T, K]: only the looked-up rows are dequantized."""
    ops = gguf_linear_ops() if weight.type_name in KEPT_GGUF_TYPES else None
    if ops is None or input_ids.dim() != 1:
        return weight.rows(input_ids).dequantize(dtype)
    rows = ops.gather_rows(weight.data.contiguous(), type_index(ops, weight.type_name), input_ids.long())
    return rows if dtype == torch.float32 else rows.to(dtype)
