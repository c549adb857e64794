"""The rejection sampler on synthetic target and draft distributions: each emitted token is
distributed as the target p at its position (Pearson chi-square at significance 1e-3, fixed
seeds, stated sample counts), greedy acceptance is exact, sampling parameters shape p as in
the plain sampler, and an always-accepting sampler (negative control) is rejected."""

from __future__ import annotations

import torch

from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.sample.sampler import SamplingMetadata
from tests.sample.stats import SIGNIFICANCE, chi_square_p_value

V = 8
NUM_REQUESTS = 20_000  # samples per test; each request verifies K drafts
K = 2


def metadata(num_rows: int, temperature: float = 1.0, **kwargs) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((num_rows,), temperature),
        all_greedy=temperature == 0.0,
        top_k=kwargs.pop("top_k", None),
        top_p=kwargs.pop("top_p", None),
        generators=kwargs.pop("generators", {}),
        banned_rows=None,
        banned_token_ids=None,
        **kwargs,
    )


def distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p [K + 1, V] and a draft q [K, V] that puts its mass where p has little."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, V, generator=g) ** 2 + 0.01
    p = p / p.sum(-1, keepdim=True)
    q = 1.0 / p[:K]  # very different: q is large exactly where p is small
    q = q / q.sum(-1, keepdim=True)
    return p, q


def sample_drafts(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(K)], 1)


def run(sampler, p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, **md_kwargs):
    n = drafts.shape[0]
    logits = p.log().repeat(n, 1)  # [n * (K + 1), V]: rows of one request are consecutive
    draft_probs = q.repeat(n, 1) if q is not None else None
    md = metadata(n * (K + 1), **md_kwargs)
    return sampler(logits, md, drafts.tolist(), draft_probs)


def position_counts(token_lists: list[list[int]]) -> list[torch.Tensor]:
    """Counts of the token emitted at each position 0..K over the requests that reached it."""
    counts = [torch.zeros(V, dtype=torch.int64) for _ in range(K + 1)]
    for tokens in token_lists:
        for pos, token in enumerate(tokens):
            counts[pos][token] += 1
    return counts


def test_random_drafts_from_a_very_different_q_keep_the_target_distribution() -> None:
    p, q = distributions(seed=0)
    drafts = sample_drafts(q, NUM_REQUESTS, seed=1)
    out = run(RejectionSampler(torch.Generator().manual_seed(2)), p, q, drafts)
    counts = position_counts(out.token_ids)
    # Position 0 always; positions 1 and 2 only after acceptances, still distributed as p.
    assert counts[0].sum() == NUM_REQUESTS
    assert counts[2].sum() > 500
    for pos in range(K + 1):
        assert chi_square_p_value(counts[pos], p[pos]) > SIGNIFICANCE, pos
    # Accepted drafts are the drafts; a rejection emits a token, then nothing.
    for tokens, d in zip(out.token_ids[:200], drafts[:200].tolist()):
        assert 1 <= len(tokens) <= K + 1 and tokens[: len(tokens) - 1] == d[: len(tokens) - 1]


def test_deterministic_drafts_one_hot_q() -> None:
    p, _ = distributions(seed=3)
    # Each request drafts the same fixed tokens: the ngram / argmax-draft case (q one-hot).
    drafts = torch.tensor([[int(p[0].argmax()), int(p[1].argmin())]]).repeat(NUM_REQUESTS, 1)
    out = run(RejectionSampler(torch.Generator().manual_seed(4)), p, None, drafts)
    counts = position_counts(out.token_ids)
    for pos in range(K + 1):
        assert chi_square_p_value(counts[pos], p[pos]) > SIGNIFICANCE, pos
    # Acceptance of the first draft happens with probability p(d).
    rate = float((counts[1].sum()) / NUM_REQUESTS)
    assert abs(rate - float(p[0].max())) < 4 * (0.25 / NUM_REQUESTS) ** 0.5


def test_negative_control_always_accepting_sampler_is_rejected() -> None:
    p, q = distributions(seed=0)
    drafts = sample_drafts(q, NUM_REQUESTS, seed=1)

    def always_accept(logits, md, draft_token_ids, draft_probs):
        out = RejectionSampler(torch.Generator().manual_seed(2))(logits, md, draft_token_ids, draft_probs)
        out.token_ids = [d + [t[-1]] for d, t in zip(draft_token_ids, out.token_ids)]
        return out

    counts = position_counts(run(always_accept, p, q, drafts).token_ids)
    assert chi_square_p_value(counts[0], p[0]) < SIGNIFICANCE


def test_sampling_parameters_shape_the_target() -> None:
    p, _ = distributions(seed=5)
    q = 0.5 * p[:K] + 0.5 / V  # a draft close enough to be accepted past the top-k cut
    drafts = sample_drafts(q, NUM_REQUESTS, seed=6)
    num_rows = NUM_REQUESTS * (K + 1)
    out = run(
        RejectionSampler(torch.Generator().manual_seed(7)), p, q, drafts,
        temperature=0.7, top_k=torch.full((num_rows,), 4, dtype=torch.int64),
    )
    counts = position_counts(out.token_ids)
    assert counts[2].sum() > 500
    for pos in range(K + 1):
        logits = p[pos].log() / 0.7
        logits[logits.argsort(descending=True)[4:]] = float("-inf")
        expected = logits.softmax(-1)
        assert chi_square_p_value(counts[pos], expected) > SIGNIFICANCE, pos
        assert counts[pos][expected == 0].sum() == 0


def test_greedy_accepts_while_drafts_equal_the_argmax() -> None:
    p, _ = distributions(seed=8)
    best = p.argmax(-1).tolist()
    other = [(b + 1) % V for b in best]
    drafts = torch.tensor([[best[0], best[1]], [best[0], other[1]], [other[0], best[1]]])
    n = drafts.shape[0]
    out = RejectionSampler(torch.Generator())(
        p.log().repeat(n, 1), metadata(n * (K + 1), temperature=0.0), drafts.tolist()
    )
    assert out.token_ids == [[best[0], best[1], best[2]], [best[0], best[1]], [best[0]]]


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    p, q = distributions(seed=9)
    drafts = sample_drafts(q, 64, seed=10)

    def seeded(n_before: int, shared_seed: int) -> list[int]:
        # The seeded request sits after n_before unseeded ones.
        all_drafts = torch.cat([drafts[:n_before], drafts[:1]])
        rows = (n_before + 1) * (K + 1)
        gens = {n_before * (K + 1) + j: torch.Generator().manual_seed(1000 + j) for j in range(K + 1)}
        out = run(RejectionSampler(torch.Generator().manual_seed(shared_seed)), p, q, all_drafts,
                  generators=gens)
        assert rows == len(out.token_ids) * (K + 1)
        return out.token_ids[-1]

    assert seeded(0, 1) == seeded(5, 2) == seeded(40, 3)
