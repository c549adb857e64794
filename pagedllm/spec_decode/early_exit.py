"""Self-speculation: the target's first L decoder layers, its final norm and LM head draft.

No second checkpoint and no KV cache of its own: the draft's layers are the target's, so
the target's forward already wrote their KV for every computed token.
"""

from __future__ import annotations

import torch
from torch import nn


class EarlyExitModel(nn.Module):
    """The target's first ``num_layers`` decoder layers, then its final norm and LM head
    (Llama-shaped models: ``model.embed_tokens``, ``model.layers``, ``model.norm``)."""

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        inner = getattr(target, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
            raise ValueError(
                f"speculative_config draft_layers: self-speculation needs a Llama-shaped model, "
                f"not {type(target).__name__}"
            )
        if not 1 <= num_layers < len(inner.layers):
            raise ValueError(
                f"speculative_config draft_layers={num_layers} must be in [1, {len(inner.layers) - 1}] "
                f"(the target has {len(inner.layers)} layers)"
            )
        # Plain attributes, not submodules: the target owns these weights.
        object.__setattr__(self, "target", target)
        self.num_layers = num_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        inner = self.target.model
        hidden = inner.embed_tokens(input_ids)
        residual = None
        for layer in inner.layers[: self.num_layers]:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = inner.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)
