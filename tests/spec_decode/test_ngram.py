"""The n-gram proposer: longest suffix match first, most recent occurrence, capped drafts."""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.ngram import NgramProposer


def test_longest_match_wins_and_proposes_what_followed() -> None:
    proposer = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=3)
    #           0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # Suffix (5, 6, 7) occurred at 0: propose 8, 9, 1. The shorter (6, 7) at 6 would give 2, 3.
    assert proposer.propose([tokens], [10]) == [[8, 9, 1]]


def test_most_recent_occurrence_and_caps() -> None:
    proposer = NgramProposer(num_speculative_tokens=4, min_n=2, max_n=2)
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 22, 23, 24, 1, 2]
    assert proposer.propose([tokens], [10]) == [[20, 21, 22, 23]]
    assert proposer.propose([tokens], [2]) == [[20, 21]]
    assert proposer.propose([tokens], [0]) == [[]]
    # Near the end the continuation is shorter than k.
    assert proposer.propose([[3, 4, 9, 3, 4]], [10]) == [[9, 3, 4]]


def test_no_match_below_min_n_proposes_nothing() -> None:
    proposer = NgramProposer(num_speculative_tokens=4, min_n=2, max_n=4)
    assert proposer.propose([[1, 2, 3, 4, 5, 1], [7], []], [4, 4, 4]) == [[], [], []]
    rng = np.random.default_rng(0)
    tokens = rng.permutation(1000).tolist()  # no repeated token: no bigram repeats
    assert proposer.propose([tokens], [4]) == [[]]
