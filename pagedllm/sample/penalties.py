"""Repetition, frequency and presence penalties over a batch of logits (as vLLM defines them).

- repetition_penalty r (prompt and output tokens): a seen token's logit l becomes l / r if
  l > 0, else l * r (r > 1 discourages repetition).
- frequency_penalty f (output tokens): l -= f * count.
- presence_penalty p (output tokens): l -= p if the token occurred at all.
Applied in that order, before temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyMetadata:
    presence: torch.Tensor  # [B] float32, 0 where off
    frequency: torch.Tensor  # [B] float32, 0 where off
    repetition: torch.Tensor  # [B] float32, 1 where off
    output_token_ids: torch.Tensor  # [B, L] int64, padded with vocab_size
    prompt_token_ids: torch.Tensor  # [B, P] int64, padded with vocab_size


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids: [B, L] padded with vocab_size -> counts [B, vocab_size] int64."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: PenaltyMetadata) -> torch.Tensor:
    """logits: [B, V] float32 -> penalised logits [B, V] (a new tensor)."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(md.output_token_ids, vocab_size)  # [B, V]
    output_seen = output_counts > 0
    prompt_seen = token_counts(md.prompt_token_ids, vocab_size) > 0
    seen = output_seen | prompt_seen
    rep = md.repetition.unsqueeze(1)  # [B, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - md.frequency.unsqueeze(1) * output_counts
    return logits - md.presence.unsqueeze(1) * output_seen
