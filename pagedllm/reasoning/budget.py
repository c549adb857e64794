"""The thinking budget (``thinking_token_budget``): once a sequence that started inside its
reasoning has written that many output tokens without closing it, the end marker's tokens are
forced, one per step, and the answer follows.

Stateless over the sequence's output ids: the marker is forced at output positions
``budget .. budget + len(marker) - 1``, unless the reasoning closed within its budget. A marker
the model had begun right at the budget is completed, not written again.
"""

from __future__ import annotations


def forced_end_token(
    output_token_ids: list[int], budget: int, marker: tuple[int, ...], end_token_ids: tuple[tuple[int, ...], ...]
) -> int | None:
    """The token the next step must sample, or None (free). ``marker``: the ids written
    (``ReasoningParser.end_marker_ids``); ``end_token_ids``: every way the end marker tokenizes
    (``ReasoningParser.end_token_ids``), any of which closes the reasoning."""
    num_output = len(output_token_ids)
    if num_output < budget or num_output >= budget + len(marker):
        return None
    within = output_token_ids[:budget]
    if any(_contains(within, m) for m in end_token_ids):
        return None  # the reasoning ended by itself
    begun = _begun_len(within, marker)
    position = begun + num_output - budget
    return marker[position] if position < len(marker) else None


def _contains(ids: list[int], marker: tuple[int, ...]) -> bool:
    k = len(marker)
    return any(tuple(ids[i:i + k]) == marker for i in range(len(ids) - k + 1))


def _begun_len(ids: list[int], marker: tuple[int, ...]) -> int:
    """The length of the longest end of ``ids`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(ids)), 0, -1):
        if tuple(ids[-k:]) == marker[:k]:
            return k
    return 0
