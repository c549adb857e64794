"""Token embedding and the LM head, which may share (tie) the embedding's weight.

Either may hold a quantized weight (`quant`): a GGUF file's own Q8_0 table, or one quantized
to int8 at load (`quantize_bits`); or a GGUF table of any other kept type as its file's blocks
(`blocks`: a lookup dequantizes only the rows it reads, the head multiplies by the blocks). A
tied head multiplies with the embedding's table, in whichever form.

Tensor parallel (vocabulary parallel): each rank holds ceil(vocab / size) rows of the table
(the last rank's tail is zero padding); a lookup sums the ranks' partial embeddings, the head
gathers the ranks' logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import current_tp, shard_range
from pagedllm.kernels import QuantizedWeight, embedding_lookup, linear_op, quantize, quantized_linear
from pagedllm.kernels.bf16_activations import bf16_activation_linear, bf16_copy_for
from pagedllm.kernels.gguf_blocks import GGUFBlocks, gguf_embedding_lookup, gguf_linear
from pagedllm.layers.utils import default_weight_loader, set_weight_loader


class _QuantizableTable(nn.Module):
    """A [rows, hidden] weight that loads as float or as (or into) a QuantizedWeight."""

    def __init__(self, rows: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = current_tp()
        self.num_rows = rows
        self.hidden_size = hidden_size
        if self.tp.size > 1:
            # This rank's vocabulary rows [vocab_start, vocab_start + rows).
            self.vocab_start, rows = shard_range(rows, self.tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.quant: QuantizedWeight | None = None
        self.blocks: GGUFBlocks | None = None
        """The table as a GGUF file's blocks (types other than QuantizedWeight's)."""
        self.quantize_bits: int | None = None
        """8: quantize the float table at load (int8 per group of 32, as GGUF Q8_0)."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantizedWeight | GGUFBlocks, shard_id: object = None
    ) -> None:
        kept = isinstance(loaded_weight, (QuantizedWeight, GGUFBlocks))
        if self.tp.size > 1:
            assert not kept and not self.quantize_bits
            self._load_rank_rows(param, loaded_weight)  # type: ignore[arg-type]
            return
        if not kept and not self.quantize_bits:
            default_weight_loader(param, loaded_weight, shard_id)
            return
        assert shard_id is None, f"{type(self).__name__} has no shards, got {shard_id!r}"
        if tuple(loaded_weight.shape) != tuple(param.shape):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
                f"parameter of shape {tuple(param.shape)}"
            )
        if isinstance(loaded_weight, GGUFBlocks):
            self.blocks = loaded_weight
        else:
            if not isinstance(loaded_weight, QuantizedWeight):
                loaded_weight = quantize(loaded_weight, self.quantize_bits)  # type: ignore[arg-type]
            self.quant = loaded_weight
        # The float table was never written (its pages never touched); drop it.
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def _load_rank_rows(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if tuple(loaded_weight.shape) != (self.num_rows, param.shape[1]):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit a "
                f"vocabulary table of shape {(self.num_rows, param.shape[1])}"
            )
        rows = min(param.shape[0], self.num_rows - self.vocab_start)
        param.data.zero_()
        param.data[:rows].copy_(loaded_weight[self.vocab_start : self.vocab_start + rows])


class VocabEmbedding(_QuantizableTable):
    """Lookup table [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.vocab_size = vocab_size
        self.dtype = self.weight.dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        if self.quant is not None:
            return embedding_lookup(input_ids, self.quant, self.dtype)
        if self.blocks is not None:
            return gguf_embedding_lookup(input_ids, self.blocks, self.dtype)
        if self.tp.size > 1:
            # Ids outside this rank's rows read row 0 and are zeroed; the sum over ranks
            # leaves each token the one rank's row that holds it.
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.weight.shape[0])
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))
        return F.embedding(input_ids, self.weight)


class LMHead(_QuantizableTable):
    """hidden -> vocabulary logits; `tie(embedding)` makes it reuse the embedding matrix."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.vocab_size = vocab_size
        self._tied: list[VocabEmbedding] = []  # a list: not registered as a submodule
        self.decode_activations = "int16"  # GGUF blocks' small-M kernel (linear.Linear's)
        self.bf16_weight: torch.Tensor | None = None
        self.bf16_min_rows = 0
        """--matmul-activations bf16: at least bf16_min_rows rows in bf16, through a bf16 copy
        of the (tied) float32 table (kernels/bf16_activations.py) or bf16 panels of a kept one"""
        self.bf16_panels = False

    def tie(self, embedding: VocabEmbedding) -> None:
        # One tensor for both: the checkpoint stores it once (as the embedding).
        self.weight = embedding.weight
        self._tied = [embedding]

    def finish_loading(self) -> None:
        # The embedding may have swapped its float table for a quantized one.
        if self._tied:
            self.weight = self._tied[0].weight

    def table_owner(self) -> _QuantizableTable:
        """The module holding the table this head multiplies by (`weight` or `quant`): the
        tied embedding, or the head itself."""
        return self._tied[0] if self._tied else self

    def use_bf16_activations(self, min_rows: int | None, copies: bool = True) -> bool:
        """Keep a bf16 copy of the table for at least `min_rows` rows (None: drop it); False
        where it is neither float32 nor quantized, or split over tensor-parallel ranks.
        `copies` False: no copy, a kept table (GGUF blocks, quantized) through bf16 panels."""
        owner = self.table_owner()
        min_rows = None if self.tp.size > 1 else min_rows
        self.bf16_min_rows = min_rows or 0
        kept = owner.blocks is not None or owner.quant is not None
        self.bf16_panels = not copies and min_rows is not None and kept
        if not copies:
            self.bf16_weight = None
            return self.bf16_panels
        source = owner.quant if owner.quant is not None else owner.weight
        if owner.blocks is not None:  # a bf16 copy of the dequantized table
            source = [owner.blocks]
        self.bf16_weight = bf16_copy_for(source, min_rows)
        return self.bf16_weight is not None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] -> logits: [N, vocab] in the model dtype
        owner = self.table_owner()
        if self.bf16_weight is not None and hidden_states.shape[0] >= self.bf16_min_rows:
            return bf16_activation_linear(hidden_states, self.bf16_weight).to(hidden_states.dtype)
        panel_rows = self.bf16_min_rows if self.bf16_panels else None
        if owner.quant is not None:
            return quantized_linear(hidden_states, owner.quant, None, None, panel_rows)
        if owner.blocks is not None:
            return gguf_linear(hidden_states, owner.blocks, None, panel_rows, self.decode_activations)
        logits = linear_op(hidden_states, owner.weight, persistent_weight=True)
        if self.tp.size > 1:
            # [N, vocab / size] per rank -> [N, vocab] (the padding rows cut off)
            return self.tp.all_gather(logits)[:, : self.vocab_size]
        return logits


class LearnedPositionEmbedding(nn.Module):
    """Absolute position table [num_positions + offset, hidden] (GPT-2; OPT with offset 2).

    OPT's checkpoints reserve `offset` leading rows, so position p reads row p + offset.
    """

    def __init__(self, num_positions: int, hidden_size: int, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # positions: [num_tokens] int64 -> [num_tokens, hidden]
        return F.embedding(positions + self.offset, self.weight)
