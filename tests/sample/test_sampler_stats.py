"""Sampling frequencies match the distributions computed directly from the logits (chi-square
at significance 1e-3), and a deliberately wrong sampler is rejected by the same test.

Each case draws NUM_SAMPLES = 20,000 samples from a 12-token vocabulary with a fixed seed.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample.sampler import Sampler, SamplingMetadata
from tests.sample.stats import SIGNIFICANCE, chi_square_p_value

NUM_SAMPLES = 20_000
VOCAB = 12
LOGITS = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -3.0])


def _metadata(**kw) -> SamplingMetadata:
    b = NUM_SAMPLES
    fields = dict(
        temperature=torch.full((b,), kw.pop("temperature", 1.0)),
        all_greedy=False,
        top_k=None,
        top_p=None,
        generators={},
        banned_rows=None,
        banned_token_ids=None,
    )
    if "top_k" in kw:
        fields["top_k"] = torch.full((b,), kw.pop("top_k"), dtype=torch.int64)
    if "top_p" in kw:
        fields["top_p"] = torch.full((b,), kw.pop("top_p"))
    if "min_p" in kw:
        fields["min_p"] = torch.full((b,), kw.pop("min_p"))
    assert not kw
    return SamplingMetadata(**fields)


def _counts(md: SamplingMetadata, seed: int) -> torch.Tensor:
    logits = LOGITS.expand(NUM_SAMPLES, VOCAB).clone()
    tokens = Sampler(seed)(logits, md).sampled_token_ids
    return torch.bincount(tokens, minlength=VOCAB)


def _expected_temperature(t: float) -> torch.Tensor:
    return (LOGITS / t).softmax(-1)


def _expected_top_k(k: int) -> torch.Tensor:
    p = LOGITS.softmax(-1)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[LOGITS.argsort(descending=True)[:k]] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def _expected_top_p(top_p: float, p: torch.Tensor | None = None) -> torch.Tensor:
    # Written out in Python over the (sorted) vocabulary: the smallest set reaching top_p of p
    # (default: the softmax of LOGITS).
    p = LOGITS.softmax(-1) if p is None else p
    order = p.argsort(descending=True).tolist()
    out = torch.zeros(VOCAB)
    mass = 0.0
    for token in order:
        out[token] = p[token]
        mass += float(p[token])
        if mass >= top_p:
            break
    return out / out.sum()


def _expected_min_p(min_p: float, t: float) -> torch.Tensor:
    p = (LOGITS / t).softmax(-1)
    p = torch.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


def _expected_top_k_top_p(k: int, top_p: float) -> torch.Tensor:
    # top-p over the top-k tokens' renormalised probabilities (as the full-vocabulary path does).
    return _expected_top_p(top_p, _expected_top_k(k))


# (name, right metadata, expected distribution, wrong metadata = the negative control)
CASES = [
    ("temperature", dict(temperature=0.7), _expected_temperature(0.7), dict(temperature=0.8)),
    ("top_k", dict(top_k=4), _expected_top_k(4), dict(top_k=5)),
    ("top_p", dict(top_p=0.6), _expected_top_p(0.6), dict(top_p=0.75)),
    ("top_k+temperature", dict(top_k=6, temperature=1.5), None, dict(top_k=6)),
    ("min_p", dict(min_p=0.2, temperature=0.8), _expected_min_p(0.2, 0.8), dict(min_p=0.3, temperature=0.8)),
    # top_k below the vocabulary: the draw runs over the k candidates (Sampler's top-k path)
    ("top_k+top_p", dict(top_k=6, top_p=0.6), _expected_top_k_top_p(6, 0.6), dict(top_k=6, top_p=0.75)),
]


@pytest.mark.parametrize("name,right,expected,wrong", CASES, ids=[c[0] for c in CASES])
def test_frequencies_match_and_negative_control_is_rejected(name, right, expected, wrong):
    if expected is None:  # top-k over tempered logits
        p = (LOGITS / 1.5).softmax(-1)
        p = torch.where(_expected_top_k(6) > 0, p, 0.0)
        expected = p / p.sum()
    p_right = chi_square_p_value(_counts(_metadata(**right), seed=1), expected)
    assert p_right > SIGNIFICANCE, f"{name}: correct sampler rejected, p={p_right:.2e}"
    p_wrong = chi_square_p_value(_counts(_metadata(**wrong), seed=2), expected)
    assert p_wrong < SIGNIFICANCE, f"{name}: wrong sampler not rejected, p={p_wrong:.2e}"


def test_greedy_rows_take_the_argmax():
    md = _metadata(temperature=1.0)
    md.temperature[::2] = 0.0
    tokens = Sampler(0)(LOGITS.expand(NUM_SAMPLES, VOCAB).clone(), md).sampled_token_ids
    assert (tokens[::2] == 0).all()


def test_rows_with_their_own_top_k_and_the_full_path():
    # One batch, rows alternating top_k 3 and 6 (the top-k path over 6 candidates, each row's k
    # applied): each half matches its distribution. With one row that sets no top_k (the
    # vocabulary) the whole batch takes the full path, with the same distributions.
    for no_top_k_row in (False, True):
        md = _metadata(top_k=6)
        md.top_k[::2] = 3
        if no_top_k_row:
            md.top_k[1] = VOCAB
        tokens = Sampler(3)(LOGITS.expand(NUM_SAMPLES, VOCAB).clone(), md).sampled_token_ids
        three, six = tokens[::2], tokens[1::2][int(no_top_k_row):]
        for drawn, k in ((three, 3), (six, 6)):
            p_value = chi_square_p_value(torch.bincount(drawn, minlength=VOCAB), _expected_top_k(k))
            assert p_value > SIGNIFICANCE, (no_top_k_row, k, p_value)
        swapped = chi_square_p_value(torch.bincount(three, minlength=VOCAB), _expected_top_k(6))
        assert swapped < SIGNIFICANCE  # the negative control: the rows' k matters
