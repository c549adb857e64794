"""Token sampling over a batch of logits, vectorised across requests.

Order (as vLLM): mask tokens that may not be sampled yet (min_tokens) -> greedy argmax, or
temperature -> top-k / top-p -> softmax -> sample with the exponential race
(argmax(p / E), E ~ Exp(1)), which equals sampling from p. Seeded requests draw their E from
their own generator, so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where off; None if off for every row
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off; None if off for every row
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    banned_rows: torch.Tensor | None  # [N] int64 } (row, token) pairs that may not be sampled
    banned_token_ids: torch.Tensor | None  # [N] int64 } this step (min_tokens)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        # Unseeded requests share one engine-wide generator: runs are reproducible per engine seed.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        # logits: [B, V] float32 -> token ids [B] int64
        if md.banned_rows is not None:
            logits = logits.index_put((md.banned_rows, md.banned_token_ids), torch.tensor(float("-inf")))
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            return greedy
        temperature = torch.where(md.temperature > 0, md.temperature, 1.0)
        logits = logits / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        sampled = exponential_race(probs, self.generator, md.generators)
        return torch.where(md.temperature > 0, sampled, greedy)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf. logits: [B, V]."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1]).unsqueeze(0)
        remove |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)
    remove = remove.scatter(1, sorted_idx, remove)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def exponential_race(
    probs: torch.Tensor, generator: torch.Generator, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    # probs: [B, V]; argmax(p / E) with E ~ Exp(1) is a sample from p.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)
