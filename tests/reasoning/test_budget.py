"""forced_end_token: where the thinking budget forces the end marker (model-free)."""

from __future__ import annotations

from pagedllm.reasoning.budget import forced_end_token

END = ((7, 8, 9),)  # "</", "think", ">"


def forced_sequence(free_tokens: list[int], budget: int, markers=END) -> list[int]:
    """The output when the model would write ``free_tokens`` (then 0s) and forcing applies."""
    out: list[int] = []
    for i in range(12):
        token = forced_end_token(out, budget, markers[0], markers)
        out.append(token if token is not None else (free_tokens[i] if i < len(free_tokens) else 0))
    return out


def test_forced_at_the_budget_then_free():
    assert forced_sequence([1, 2, 3, 4], 2) == [1, 2, 7, 8, 9, 0, 0, 0, 0, 0, 0, 0]
    assert forced_sequence([], 0)[:4] == [7, 8, 9, 0]


def test_reasoning_closed_within_the_budget_is_left_alone():
    assert forced_sequence([1, 7, 8, 9, 5, 5, 5], 5)[:7] == [1, 7, 8, 9, 5, 5, 5]


def test_a_begun_marker_is_completed_not_repeated():
    assert forced_sequence([1, 7, 5, 5], 2)[:5] == [1, 7, 8, 9, 0]


def test_the_given_spelling_is_written_any_closes():
    markers = ((42,), (7, 8, 9))
    assert forced_sequence([1, 7, 8, 9, 3], 4, markers)[:6] == [1, 7, 8, 9, 3, 0]
    assert forced_sequence([1, 2, 3], 1, markers)[:3] == [1, 42, 3]
