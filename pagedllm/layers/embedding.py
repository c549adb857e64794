"""Token embedding and the LM head, which may share (tie) the embedding's weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.kernels import linear_op
from pagedllm.layers.utils import default_weight_loader, set_weight_loader


class VocabEmbedding(nn.Module):
    """Lookup table [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden -> vocabulary logits; `tie(embedding)` makes it reuse the embedding matrix."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def tie(self, embedding: VocabEmbedding) -> None:
        # One tensor for both: the checkpoint stores it once (as the embedding).
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [N, hidden] -> logits: [N, vocab] in the model dtype
        return linear_op(hidden_states, self.weight, persistent_weight=True)


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
