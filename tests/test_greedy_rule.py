"""The shared greedy comparison (tests/utils.py) enforces DESIGN.md's rule, no laxer."""

from __future__ import annotations

import pytest

from tests.utils import assert_greedy_match, assert_same_greedy

REF = [5, 6, 7, 8]
CLEAR = [2.0, 2.0, 2.0, 2.0]  # top-2 gaps far from a tie
TIE_AT_2 = [2.0, 2.0, 5e-4, 2.0]


def test_identical_sequences_pass():
    assert_greedy_match(list(REF), REF, CLEAR)
    assert_greedy_match([], [], [])


def test_divergence_at_a_near_tie_passes_and_nothing_after_is_compared():
    assert_greedy_match([5, 6, 9, 1, 1, 1], REF, TIE_AT_2)  # longer after the tie: not compared
    assert_greedy_match([5, 6, 9], REF, TIE_AT_2)


def test_divergence_without_a_tie_fails():
    with pytest.raises(AssertionError, match="diverge at step 2"):
        assert_greedy_match([5, 6, 9, 8], REF, CLEAR)


@pytest.mark.parametrize("ours", [[5, 6, 7], [5], [5, 6, 7, 8, 9]], ids=["shorter", "much-shorter", "longer"])
def test_different_lengths_without_a_tie_fail(ours):
    with pytest.raises(AssertionError, match="no divergence, but"):
        assert_greedy_match(ours, REF, TIE_AT_2)  # the tie lies beyond where they differ
    with pytest.raises(AssertionError, match="no divergence, but"):
        assert_same_greedy(ours, REF, CLEAR)


def test_an_empty_output_against_a_nonempty_reference_fails():
    with pytest.raises(AssertionError):
        assert_greedy_match([], REF, CLEAR)


def test_same_greedy_without_gaps_means_identical():
    assert_same_greedy([1, 2], [1, 2], None)
    with pytest.raises(AssertionError):
        assert_same_greedy([1, 2], [1, 2, 3], None)
