"""Linear layers whose parameters load themselves from checkpoint tensors.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, so fused
projections (QKV, gate/up), tensor-parallel sharding and quantized weights change only the
loaders here, never the model files.

The matmul itself goes through `kernels.linear_op` (zentorch or plain torch, see there), or
`quantization.quantized_linear` once the layer holds a quantized weight: a checkpoint's own
(`QuantizedWeight` tensors from GGUF) or one quantized from float shards at load
(`quantize_bits`), or `gguf_blocks.gguf_linear` for a GGUF tensor kept as its file's blocks
(`GGUFBlocks`). Shards load separately and `finish_loading()` joins them: into one weight when
they share a form, else into `sections` (a GGUF file may store the parts of one fused
projection in different types, e.g. Q4_K q/k with a Q6_K v), each computed into its slice of
the output.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TPGroup, check_heads, current_tp, divide
from pagedllm.config import PREFILL_ACTIVATIONS
from pagedllm.kernels import (
    INT8_ACTIVATION_MIN_ROWS,
    QuantizedWeight,
    clear_weight_caches,
    linear_op,
    quantize,
    quantized_linear,
)
from pagedllm.kernels.bf16_activations import (
    BF16_ACTIVATION_MIN_ROWS,
    bf16_activation_linear,
    bf16_copy_for,
    warn_if_not_native,
)
from pagedllm.kernels.gguf_blocks import DECODE_ACTIVATIONS, GGUFBlocks, gguf_linear
from pagedllm.layers.attention import Attention
from pagedllm.layers.embedding import LMHead
from pagedllm.layers.utils import set_weight_loader
from pagedllm.lora.layers import LinearLoRASlots, add_lora_delta

__all__ = [
    "ColumnParallelLinear", "Linear", "MergedLinear", "QKVLinear", "RowParallelLinear", "linear_op",
]


def _rank_rows(tp: TPGroup, loaded_weight: torch.Tensor, per_rank: int) -> torch.Tensor:
    """This rank's output rows [rank * per_rank, (rank + 1) * per_rank) of a full tensor."""
    return loaded_weight if tp.size == 1 else loaded_weight.narrow(0, tp.rank * per_rank, per_rank)


KeptWeight = QuantizedWeight | GGUFBlocks
"""A weight held in a checkpoint's own (or a load-time) quantized form."""


def kept_linear(
    x: torch.Tensor, weight: KeptWeight, bias: torch.Tensor | None, int8_min_rows: int | None = None,
    bf16_panel_rows: int | None = None, decode_activations: str = "int16",
) -> torch.Tensor:
    # x: [..., K] -> [..., N]; bf16_panel_rows: from this many rows up bf16 panels (None: never)
    if isinstance(weight, GGUFBlocks):
        return gguf_linear(x, weight, bias, bf16_panel_rows, decode_activations)
    return quantized_linear(x, weight, bias, int8_min_rows, bf16_panel_rows)


def sectioned_linear(
    x: torch.Tensor, sections: tuple[tuple[int, KeptWeight], ...], bias: torch.Tensor | None, int8_min_rows: int | None,
    bf16_panel_rows: int | None = None, decode_activations: str = "int16",
) -> torch.Tensor:
    """x: [T, K] -> [T, N], output rows [offset, offset + rows) from each section's weight."""
    n = sum(w.shape[0] for _, w in sections)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    for offset, weight in sections:
        part_bias = None if bias is None else bias[offset : offset + weight.shape[0]]
        y[..., offset : offset + weight.shape[0]] = kept_linear(x, weight, part_bias, int8_min_rows, bf16_panel_rows,
                                                                  decode_activations)
    return y


class Linear(nn.Module):
    """y = x @ W^T (+ b), W: [out_features, in_features] as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        self.quant: QuantizedWeight | None = None
        self.blocks: GGUFBlocks | None = None
        """The weight as a GGUF file's blocks (all its shards of one type)."""
        self.sections: tuple[tuple[int, KeptWeight], ...] | None = None
        """(first output row, weight) per shard, where the shards came in different forms."""
        self.quantize_bits: int | None = None
        """4 or 8: quantize float weight shards as they load (--quantization int4|int8)."""
        self.int8_min_rows: int | None = None
        """quantized weight: from this many activation rows up, int8 activations (None: never;
        set_prefill_activations)"""
        self.decode_activations = "int16"
        """GGUF blocks: the small-M kernel's activation rounding (kernels/gguf_blocks.py
        DECODE_ACTIVATIONS; set_prefill_activations)"""
        self.bf16_weight: torch.Tensor | None = None
        self.bf16_min_rows = 0
        """--matmul-activations bf16: matmuls of at least bf16_min_rows rows in bf16, with a
        bf16 copy of the weight (kernels/bf16_activations.py; set_prefill_activations) or, for
        a kept (quantized or GGUF-block) weight, bf16 panels decoded per call (`bf16_panels`:
        no copy; kernels/gemm.py's chunked_bf16_gemm)"""
        self.bf16_panels = False
        self._quant_parts: dict[int, KeptWeight] = {}  # row offset -> rows loaded so far
        self.lora_slots: LinearLoRASlots | None = None
        """--enable-lora: the adapters' stacked weights, added to the output (lora/layers.py)."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        assert shard_id is None, f"{type(self).__name__} has no shards, got {shard_id!r}"
        self._load_rows(param, loaded_weight, 0, self.out_features)

    def _load_rows(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | KeptWeight, offset: int, size: int
    ) -> None:
        is_quant = isinstance(loaded_weight, (QuantizedWeight, GGUFBlocks))
        if param is not self.weight or not (is_quant or self.quantize_bits):
            assert not is_quant, "a quantized tensor can only load into a weight"
            self._copy_rows(param, loaded_weight, offset, size)  # type: ignore[arg-type]
            return
        if tuple(loaded_weight.shape) != (size, self.in_features):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit rows "
                f"[{offset}, {offset + size}) of a weight of shape {(self.out_features, self.in_features)}"
            )
        if not is_quant:
            assert self.quantize_bits in (4, 8)
            loaded_weight = quantize(loaded_weight, self.quantize_bits)  # type: ignore[arg-type]
        self._quant_parts[offset] = loaded_weight  # type: ignore[assignment]

    def finish_loading(self) -> None:
        """Join the quantized shards into one weight (or sections, where their forms differ)
        and drop the (never written) float one."""
        if not self._quant_parts:
            return
        offsets = sorted(self._quant_parts)
        parts = [self._quant_parts[o] for o in offsets]
        starts = [0, *(sum(p.shape[0] for p in parts[: i + 1]) for i in range(len(parts)))]
        if offsets != starts[:-1] or starts[-1] != self.out_features:
            raise ValueError(
                f"a fused layer got quantized rows at offsets {offsets} but float rows elsewhere; "
                "load it all quantized or all float (--quantization none)"
            )
        if all(isinstance(p, QuantizedWeight) for p in parts):
            self.quant = QuantizedWeight.cat(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]
        elif len({(p.type_name, p.k) if isinstance(p, GGUFBlocks) else None for p in parts}) == 1:
            self.blocks = GGUFBlocks.cat(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]
        else:
            self.sections = tuple(zip(offsets, parts))
        self._quant_parts = {}
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    @staticmethod
    def _copy_rows(
        param: nn.Parameter, loaded_weight: torch.Tensor, offset: int, size: int
    ) -> None:
        # Output rows [offset, offset + size) of the weight (or bias) come from this tensor.
        expected = (size, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit rows "
                f"[{offset}, {offset + size}) of a parameter of shape {tuple(param.shape)}"
            )
        param.data.narrow(0, offset, size).copy_(loaded_weight)
        clear_weight_caches()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.bf16_weight is not None and x.dim() == 2 and x.shape[0] >= self.bf16_min_rows:
            y = bf16_activation_linear(x, self.bf16_weight, self.bias).to(x.dtype)
        elif self.quant is not None:
            y = quantized_linear(x, self.quant, self.bias, self.int8_min_rows, self.bf16_panel_rows())
        elif self.blocks is not None:
            y = gguf_linear(x, self.blocks, self.bias, self.bf16_panel_rows(), self.decode_activations)
        elif self.sections is not None:
            y = sectioned_linear(x, self.sections, self.bias, self.int8_min_rows, self.bf16_panel_rows(),
                                 self.decode_activations)
        else:
            y = linear_op(x, self.weight, self.bias, persistent_weight=True)
        return y if self.lora_slots is None else add_lora_delta(self.lora_slots, x, y)

    def use_bf16_activations(self, min_rows: int | None, copies: bool = True) -> bool:
        """Multiply in bf16 from `min_rows` rows up (None: never) with a bf16 copy of the weight
        kept beside it; False where the layer has no float32 or kept weight (a bf16 model).
        `copies` False makes no copy: a kept weight (quantized, GGUF blocks, sections of those)
        multiplies through bf16 panels decoded per call, a float32 one stays float32 (False)."""
        self.bf16_min_rows = min_rows or 0
        self.bf16_panels = not copies and min_rows is not None and bool(self.kept_weights())
        if not copies:
            self.bf16_weight = None
            return self.bf16_panels
        source: torch.Tensor | QuantizedWeight | list[QuantizedWeight | GGUFBlocks] = (
            self.quant if self.quant is not None else self.weight)
        if self.blocks is not None or self.sections is not None:  # a bf16 copy of the dequantized rows
            source = self.kept_weights()
        self.bf16_weight = bf16_copy_for(source, min_rows)
        return self.bf16_weight is not None

    def bf16_panel_rows(self) -> int | None:
        """A kept weight: from this many rows the bf16 panels (None: never)."""
        return self.bf16_min_rows if self.bf16_panels else None

    def kept_weights(self) -> list[KeptWeight]:
        """The quantized / GGUF-block weights this layer holds (for counting resident bytes)."""
        if self.quant is not None:
            return [self.quant]
        if self.blocks is not None:
            return [self.blocks]
        return [w for _, w in self.sections or ()]

    def output_sections(self) -> dict[object, tuple[int, int]]:
        """Shard id -> (first output row, rows) of each checkpoint projection in this layer."""
        return {None: (0, self.out_features)}

    def extra_repr(self) -> str:
        quant = "" if self.quant is None else f", int{self.quant.bits}"
        if self.blocks is not None or self.sections:
            kinds = (w.type_name if isinstance(w, GGUFBlocks) else f"int{w.bits}" for w in self.kept_weights())
            quant = ", gguf " + "+".join(kinds)
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{quant}"


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (e.g. gate and up).

    Output i occupies rows [sum(output_sizes[:i]), sum(output_sizes[:i+1])); its checkpoint
    tensor loads with shard_id=i, or all outputs fused in one tensor (shard_id None, Phi-3's
    gate_up_proj), which tensor parallelism splits per output before taking this rank's rows.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        # Tensor parallel: each output is split by rows (column parallel), this rank's part.
        self.tp = current_tp()
        self._full_sizes = list(output_sizes)
        sizes = [divide(size, self.tp.size, "output size") for size in output_sizes]
        super().__init__(in_features, sum(sizes), bias)
        self.output_sizes = sizes

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:  # the fused tensor: rows [output 0 | output 1 | ...]
            if self.tp.size == 1:
                self._load_rows(param, loaded_weight, 0, self.out_features)
                return
            assert not isinstance(loaded_weight, (QuantizedWeight, GGUFBlocks)), "quantized weights are not sharded"
            for i, tensor in enumerate(loaded_weight.split(self._full_sizes)):
                self.weight_loader(param, tensor, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}")
        offset, size = sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]
        self._load_rows(param, _rank_rows(self.tp, loaded_weight, size), offset, size)

    def output_sections(self) -> dict[object, tuple[int, int]]:
        return {i: (sum(self.output_sizes[:i]), size) for i, size in enumerate(self.output_sizes)}


class QKVLinear(Linear):
    """Fused q/k/v projection: rows are [q (num_heads * head_dim), k, v (num_kv_heads * head_dim)].

    Checkpoint tensors load with shard_id "q", "k" or "v", or all three fused (shard_id None,
    GPT-2's c_attn). Tensor parallel: this rank holds ``num_heads`` of the query heads and
    ``num_kv_heads`` of the KV heads (the totals divided by the size).
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.tp = current_tp()
        if self.tp.size > 1:
            check_heads(num_heads, num_kv_heads, self.tp.size)
        self.num_heads = num_heads // self.tp.size
        self.num_kv_heads = num_kv_heads // self.tp.size
        self._full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        self._shards = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is None:  # the fused tensor: rows [q | k | v]
            if self.tp.size == 1:
                self._load_rows(param, loaded_weight, 0, self.out_features)
                return
            assert not isinstance(loaded_weight, (QuantizedWeight, GGUFBlocks)), "quantized weights are not sharded"
            for part, tensor in zip("qkv", loaded_weight.split(self._full_sizes)):
                self.weight_loader(param, tensor, part)
            return
        if shard_id not in self._shards:
            raise ValueError(f"shard_id must be one of 'q', 'k', 'v', got {shard_id!r}")
        offset, size = self._shards[shard_id]  # type: ignore[index]
        self._load_rows(param, _rank_rows(self.tp, loaded_weight, size), offset, size)

    def output_sections(self) -> dict[object, tuple[int, int]]:
        return dict(self._shards)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # qkv: [T, q_size + 2 * kv_size] -> q: [T, q_size], k, v: [T, kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class ColumnParallelLinear(Linear):
    """Tensor parallel: output features split across ranks; this rank computes
    [rank * out / size, (rank + 1) * out / size) of them (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = current_tp()
        super().__init__(in_features, divide(out_features, self.tp.size, "output features"), bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        assert shard_id is None, f"{type(self).__name__} has no shards, got {shard_id!r}"
        self._load_rows(param, _rank_rows(self.tp, loaded_weight, self.out_features), 0, self.out_features)


class RowParallelLinear(Linear):
    """Tensor parallel: input features split across ranks (the output of a column-parallel
    layer, or of this rank's heads); partial products summed by an all-reduce, then the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = current_tp()
        super().__init__(divide(in_features, self.tp.size, "input features"), out_features, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        assert shard_id is None, f"{type(self).__name__} has no shards, got {shard_id!r}"
        if self.tp.size > 1 and param is self.weight:
            loaded_weight = loaded_weight.narrow(1, self.tp.rank * self.in_features, self.in_features)
        self._load_rows(param, loaded_weight, 0, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features / size] -> [num_tokens, out_features]
        if self.tp.size == 1:
            return super().forward(x)
        assert self.quant is None, "quantized weights are not sharded (refused at load)"
        y = linear_op(x, self.weight, None, persistent_weight=True)
        self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def bf16_copy_bytes_needed(net: nn.Module) -> int:
    """Bytes the bf16 weight copies of `set_prefill_activations(net, "bf16")` would take: 2 a
    weight of every Linear and LM head (known before any copy is made)."""
    total = 0
    for module in net.modules():
        if isinstance(module, Linear):
            total += 2 * module.in_features * module.out_features
        elif isinstance(module, LMHead):
            total += 2 * module.vocab_size * module.hidden_size
    return total


def set_decode_activations(net: nn.Module, mode: str) -> int:
    """How the GGUF small-M kernel of every Linear and LM head of `net` rounds its activations
    (kernels/gguf_blocks.py DECODE_ACTIVATIONS: "int16" or "int8"); returns the layers set.
    set_prefill_activations calls it ("int8" in the bf16 and int8 modes); the fused decode
    rebuilds on the change."""
    if mode not in DECODE_ACTIVATIONS:
        raise ValueError(f"decode_activations={mode!r} is not one of {', '.join(DECODE_ACTIVATIONS)}")
    count = 0
    for module in net.modules():
        if isinstance(module, (Linear, LMHead)):
            module.decode_activations = mode
            count += 1
    return count


def set_prefill_activations(net: nn.Module, mode: str, min_rows: int | None = None, copies: bool = True) -> int:
    """Set how the matmuls of `net` with at least `min_rows` activation rows (prefill chunks,
    large decode batches) meet their weights; returns how many layers it concerns (float,
    int8: the quantized Linears; bf16: the layers that took a bf16 copy):
    - "float": float32 activations always (the default), and the GGUF small-M kernel's
      activations rounded to int16 per 32 (near exact); in the other modes that kernel rounds
      them to int8 per 256 for the K-quants (kernels/gguf_blocks.py DECODE_ACTIVATIONS);
    - "int8": every quantized Linear rounds activations to int8 per group of 32 from
      `min_rows` (default INT8_ACTIVATION_MIN_ROWS) rows up;
    - "bf16": every Linear and LM head with a float32 or quantized weight keeps a bf16 copy
      of it and multiplies in bf16 from `min_rows` (default BF16_ACTIVATION_MIN_ROWS) up, and
      first prompt chunks of that many tokens run their attention (SDPA) in bf16; with
      `copies=False` (auto's choice where the copies would pass its limit) no copy is made:
      kept weights (quantized, GGUF blocks) multiply through bf16 panels decoded per call
      (kernels/gemm.py's chunked_bf16_gemm), float32 ones stay float32."""
    if mode not in PREFILL_ACTIVATIONS:
        raise ValueError(f"prefill_activations={mode!r} is not one of {', '.join(PREFILL_ACTIVATIONS)}")
    if mode == "bf16":
        warn_if_not_native()
    int8_rows = (min_rows or INT8_ACTIVATION_MIN_ROWS) if mode == "int8" else None
    bf16_rows = (min_rows or BF16_ACTIVATION_MIN_ROWS) if mode == "bf16" else None
    set_decode_activations(net, "int16" if mode == "float" else "int8")
    count = 0
    for module in net.modules():
        if isinstance(module, Linear):
            module.int8_min_rows = int8_rows
            # float, int8: the layers with a QuantizedWeight (whole, or a section of it)
            count += mode != "bf16" and any(isinstance(w, QuantizedWeight) for w in module.kept_weights())
        if isinstance(module, (Linear, LMHead)):
            count += module.use_bf16_activations(bf16_rows, copies)
        if isinstance(module, Attention):
            module.bf16_min_rows = bf16_rows
    return count
