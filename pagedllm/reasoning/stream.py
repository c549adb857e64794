"""ReasoningStream: one streamed output split into reasoning and content, delta by delta.

Text that could still be the start of a marker is held back until the next delta settles it
(a marker may arrive split across deltas, one token at a time), so the reasoning parts
concatenate to exactly the finished output's reasoning and the content parts to its content
(``ReasoningParser.split``).
"""

from __future__ import annotations

from typing import NamedTuple


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


class ReasoningStream:
    def __init__(self, start_marker: str, end_marker: str, in_reasoning: bool) -> None:
        self.start_marker = start_marker
        self.end_marker = end_marker
        self.in_reasoning = in_reasoning
        """Until the end marker has been seen; False from the start for an output outside reasoning."""
        self._at_start = in_reasoning  # nothing decided yet: a leading start marker may come
        self._held = ""  # a possible marker prefix, not yet sent

    def feed(self, delta: str) -> ReasoningDelta:
        """The parts of ``delta`` (with what was held back) that are settled now."""
        if not self.in_reasoning:
            return ReasoningDelta("", delta)
        text, self._held = self._held + delta, ""
        if self._at_start:
            if len(text) < len(self.start_marker) and self.start_marker.startswith(text):
                self._held = text
                return ReasoningDelta("", "")
            self._at_start = False
            text = text.removeprefix(self.start_marker)
        end = text.find(self.end_marker)
        if end >= 0:
            self.in_reasoning = False
            return ReasoningDelta(text[:end], text[end + len(self.end_marker):])
        keep = _marker_prefix_len(text, self.end_marker)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return ReasoningDelta(text, "")

    def finish(self) -> ReasoningDelta:
        """The output ended: what was held back is reasoning after all."""
        held, self._held = self._held, ""
        return ReasoningDelta(held, "")


def _marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
