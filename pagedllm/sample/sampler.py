"""Token sampling over a batch of logits, vectorised across requests.

Order (as vLLM): raw logprobs are taken from the model's logits first -> restrictions
(allowed_token_ids, logit_bias, banned tokens: min_tokens and bad_words) -> penalties ->
greedy argmax, or temperature -> min_p -> top-k / top-p -> softmax -> sample with the
exponential race (argmax(p / E), E ~ Exp(1)), which equals sampling from p. Seeded requests
draw their E from their own generator, so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels.elementwise import argmax_rows
from pagedllm.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sample.penalties import PenaltyMetadata, apply_penalties


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where off; None if off for every row
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off; None if off for every row
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    banned_rows: torch.Tensor | None  # [N] int64 } (row, token) pairs that may not be sampled
    banned_token_ids: torch.Tensor | None  # [N] int64 } this step (min_tokens, bad_words)
    min_p: torch.Tensor | None = None  # [B] float32, 0 where off
    allowed_mask: torch.Tensor | None = None  # [B, V] bool, all True for unrestricted rows
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values [N]
    penalties: PenaltyMetadata | None = None
    max_num_logprobs: int | None = None  # largest k over rows asking for logprobs


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # rows of every request; None if none asked


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # Unseeded requests share one engine-wide generator: runs are reproducible per engine
        # seed (and device: a CUDA generator draws other numbers than the CPU's).
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V] float32
        raw_logits = logits
        logits = process_logits(logits, md)
        sampled = self.sample(logits, md)
        logprobs = None
        if md.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw_logits, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        # logits: [B, V] after restrictions and penalties -> token ids [B]
        greedy = argmax_rows(logits)
        if md.all_greedy:
            return greedy
        top = _top_candidate_rows(md, logits.shape[-1])
        if top is None or not bool(top.any()):
            sampled = exponential_race(target_probs(logits, md), self.generator, md.generators)
        elif bool(top.all()):
            sampled = sample_top_candidates(logits, md, self.generator)
        else:  # each row by its own settings: a seeded row's draws never depend on its batch
            sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            rows = top.nonzero().squeeze(1)
            sampled[rows] = sample_top_candidates(logits[rows], _rows_of(md, rows), self.generator)
            rows = (~top).nonzero().squeeze(1)
            sub = _rows_of(md, rows)
            sampled[rows] = exponential_race(target_probs(logits[rows], sub), self.generator, sub.generators)
        return torch.where(md.temperature > 0, sampled, greedy)


# A random row whose top_k is at most this (and below the vocabulary) draws over its top-k
# candidates only (torch.topk, then top-p, the softmax and the race over k values): a
# 262,144-token vocabulary's full sort and V exponentials cost ~28 ms a row (Gemma 3's default
# top_k 64, top_p 0.95), the top-k path ~1 ms. The same distribution: top-k leaves nothing else.
TOP_CANDIDATES_MAX = 4096


def _top_candidate_rows(md: SamplingMetadata, vocab_size: int) -> torch.Tensor | None:
    """[B] bool: the rows the top-k path draws (random rows with a top_k below the vocabulary
    and TOP_CANDIDATES_MAX, and greedy rows, whose draw is not used); None: no row sets top_k."""
    if md.top_k is None:
        return None
    return (md.temperature <= 0) | ((md.top_k < vocab_size) & (md.top_k <= TOP_CANDIDATES_MAX))


def _rows_of(md: SamplingMetadata, rows: torch.Tensor) -> SamplingMetadata:
    """The metadata of a subset of rows (what target_probs and the draws read), the seeded rows'
    generators re-keyed to their new positions."""
    position = {int(r): i for i, r in enumerate(rows.tolist())}
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return SamplingMetadata(
        temperature=md.temperature[rows], all_greedy=False, top_k=pick(md.top_k), top_p=pick(md.top_p),
        generators={position[r]: g for r, g in md.generators.items() if r in position},
        banned_rows=None, banned_token_ids=None, min_p=pick(md.min_p),
    )


def sample_top_candidates(logits: torch.Tensor, md: SamplingMetadata, generator: torch.Generator) -> torch.Tensor:
    """target_probs' draw over each row's top_k best tokens (every row sets one; greedy rows'
    draws are not used): temperature, min_p over the whole vocabulary, torch.topk's candidates
    (k: the largest random row's top_k), each row's own top_k and top_p over them, the softmax
    and the race, a seeded row drawing exactly its own top_k exponentials. [B, V] -> ids [B]."""
    assert md.top_k is not None
    top_k = torch.where(md.temperature > 0, md.top_k, 1).clamp(max=TOP_CANDIDATES_MAX)
    k = int(top_k.max())
    temperature = torch.where(md.temperature > 0, md.temperature, 1.0)
    logits = logits / temperature.unsqueeze(1)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    values, ids = logits.topk(k, dim=-1)  # [B, k], best first
    remove = torch.arange(k, device=logits.device).unsqueeze(0) >= top_k.unsqueeze(1)
    if md.top_p is not None:
        probs = values.masked_fill(remove, float("-inf")).softmax(dim=-1)
        remove |= (probs.cumsum(dim=-1) - probs) >= md.top_p.unsqueeze(1)
    probs = values.masked_fill(remove, float("-inf")).softmax(dim=-1)
    choice = exponential_race(probs, generator, md.generators, draws=top_k.tolist())  # [B] in 0 .. k - 1
    return ids.gather(1, choice.unsqueeze(1)).squeeze(1)


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Restrictions then penalties: the logits greedy rows take the argmax of. [B, V]."""
    logits = apply_restrictions(logits, md)
    if md.penalties is not None:
        logits = apply_penalties(logits, md.penalties)
    return logits


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: processed logits -> temperature -> min_p ->
    top-k / top-p -> softmax. [B, V] (greedy rows: temperature 1, unused)."""
    temperature = torch.where(md.temperature > 0, md.temperature, 1.0)
    logits = logits / temperature.unsqueeze(1)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
    return logits.softmax(dim=-1)


def apply_restrictions(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, then logit_bias, then banned (row, token) pairs; logits: [B, V]."""
    if md.allowed_mask is not None:
        logits = logits.masked_fill(~md.allowed_mask, float("-inf"))
    if md.logit_bias is not None:
        rows, ids, values = md.logit_bias
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if md.banned_rows is not None:
        minus_inf = torch.full((), float("-inf"), device=logits.device)  # a fill, not a copy
        logits = logits.index_put((md.banned_rows, md.banned_token_ids), minus_inf)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's. logits: [B, V]."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf. logits: [B, V]."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        remove |= ranks >= top_k.unsqueeze(1)
    if top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Keep a token while the mass before it is below top_p (the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p.unsqueeze(1)
    remove = remove.scatter(1, sorted_idx, remove)  # back to vocabulary order
    return logits.masked_fill(remove, float("-inf"))


def exponential_race(
    probs: torch.Tensor, generator: torch.Generator, generators: dict[int, torch.Generator],
    draws: list[int] | None = None,
) -> torch.Tensor:
    # probs: [B, V]; argmax(p / E) with E ~ Exp(1) is a sample from p. A seeded row's noise comes
    # from its own generator: all V columns, or its first draws[row] (the columns past them
    # hold probability 0).
    noise = _exponentials(probs.shape, generator, probs.device).to(probs.dtype)
    for row, gen in generators.items():
        n = probs.shape[-1] if draws is None else draws[row]
        noise[row, :n] = _exponentials((n,), gen, probs.device)
    return (probs / noise).argmax(dim=-1)


def _exponentials(shape: tuple[int, ...], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Exp(1) draws as -log(1 - U), U uniform in float64 [0, 1) (torch's exponential_ costs 6 ms
    for 262,144 float32 values here, this ~2 ms; float64 keeps the tail: U never rounds to 1;
    the race divides in the probabilities' dtype)."""
    u = torch.empty(shape, dtype=torch.float64, device=device).uniform_(generator=generator)
    return u.neg_().log1p_().neg_()
