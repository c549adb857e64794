"""Lossless verification of draft tokens (speculative decoding).

A request with k drafts d_1..d_k brings k + 1 rows of target logits: row j is the target's
distribution for the token after d_1..d_j (row 0: after the known tokens; row k: the bonus).
Each row is processed exactly as the plain Sampler would at that position (restrictions,
penalties, temperature, min_p, top-k/top-p), giving p_j. Walking the drafts in order:

    greedy:  accept d_{j+1} while it equals argmax p_j; the first mismatch emits argmax p_j.
    random:  accept d_{j+1} with probability min(1, p_j(d) / q_j(d));
             on rejection emit a sample of normalise(max(p_j - q_j, 0)) and stop.
    all accepted: emit a bonus token sampled from p_k (greedy: its argmax).

Each emitted token is then distributed exactly as p at its position (Leviathan et al.,
Chen et al. 2023). Proposers here draft deterministically, so q_j is one-hot at d_{j+1}: the
acceptance probability is p_j(d) and the residual is p_j with d removed. A general q (the
draft's sampling distribution, [num_draft_rows, V]) is accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sample.sampler import SamplingMetadata, process_logits, target_probs


@dataclass
class RejectionSamplerOutput:
    token_ids: list[list[int]]
    """Per request: the accepted drafts, then the corrected or bonus token."""
    logprobs: LogprobsTensors | None
    """Per row (k + 1 per request) for the token emitted at that row; None if none asked."""


class RejectionSampler:
    def __init__(self, generator: torch.Generator) -> None:
        # Unseeded rows draw from the engine-wide generator (the plain Sampler's).
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        draft_token_ids: list[list[int]],
        draft_probs: torch.Tensor | None = None,
    ) -> RejectionSamplerOutput:
        # logits: [N, V] raw target logits, N = sum(len(d) + 1 for d in draft_token_ids);
        # md: one row per logits row (row j of a request sees its drafts before j as output).
        # draft_probs: [sum(len(d)), V] or None for deterministic (one-hot) drafts.
        num_rows, vocab_size = logits.shape
        counts = [len(d) + 1 for d in draft_token_ids]
        assert sum(counts) == num_rows, (counts, num_rows)
        drafts = torch.tensor([t for d in draft_token_ids for t in [*d, 0]], dtype=torch.int64)  # [N]
        is_draft = torch.tensor([j < c - 1 for c in counts for j in range(c)])  # [N] bool
        processed = process_logits(logits, md)
        tokens = processed.argmax(dim=-1)  # greedy rows: the argmax decides everything
        accepted = tokens == drafts
        if not md.all_greedy:
            probs = target_probs(processed, md)  # [N, V]
            uniform, noise = self._randomness(num_rows, vocab_size, md)
            p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)  # [N]
            residual = probs.clone()
            q_draft = torch.ones(num_rows)
            if draft_probs is None:  # q one-hot at the draft: remove the draft from p
                residual[is_draft, drafts[is_draft]] = 0.0
            else:
                q = torch.zeros_like(probs)
                q[is_draft] = draft_probs.to(probs.dtype)
                q_draft = q.gather(1, drafts.unsqueeze(1)).squeeze(1)
                residual = (probs - q).clamp_min(0.0)
            # Rounding can leave no residual mass (p == q): then p itself is the residual.
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            residual = torch.where(empty, probs, residual)
            # Bonus rows sample from p; draft rows' rejection samples from the residual.
            pool = torch.where(is_draft.unsqueeze(1), residual, probs)
            sampled = (pool / noise).argmax(dim=-1)  # exponential race: a sample of normalise(pool)
            random_accept = uniform * q_draft < p_draft
            is_random = md.temperature > 0
            accepted = torch.where(is_random, random_accept, accepted)
            tokens = torch.where(is_random, torch.where(is_draft & accepted, drafts, sampled), tokens)
        out = _emitted(counts, accepted.tolist(), tokens.tolist())
        logprobs = None
        if md.max_num_logprobs is not None:
            logprobs = compute_logprobs(logits, tokens, md.max_num_logprobs)
        return RejectionSamplerOutput(out, logprobs)

    def _randomness(
        self, num_rows: int, vocab_size: int, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform [N] and exponential noise [N, V] per row; seeded rows from their own
        generator (uniform first, then noise), so they do not depend on the batch."""
        uniform = torch.rand(num_rows, generator=self.generator)
        noise = torch.empty(num_rows, vocab_size).exponential_(generator=self.generator)
        for row, gen in md.generators.items():
            uniform[row] = torch.rand(1, generator=gen)
            noise[row].exponential_(generator=gen)
        return uniform, noise


def _emitted(counts: list[int], accepted: list[bool], tokens: list[int]) -> list[list[int]]:
    """Per request: row tokens up to and including the first rejected draft (or the bonus)."""
    out: list[list[int]] = []
    row = 0
    for count in counts:
        emitted: list[int] = []
        for j in range(count):
            emitted.append(tokens[row + j])
            if j < count - 1 and not accepted[row + j]:
                break
        out.append(emitted)
        row += count
    return out
