"""ReasoningStream: one streamed output split into reasoning and content, delta by delta.

Text that could still be the start of a marker is held back until the next delta settles it
(a marker may arrive split across deltas, one token at a time), so the reasoning parts
concatenate to exactly the finished output's reasoning and the content parts to its content
(``ReasoningParser.split``). With several spellings of a marker, text is held while it could
still become any of them (or a longer one than the one already complete).
"""

from __future__ import annotations

from typing import NamedTuple


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


class ReasoningStream:
    def __init__(
        self, start_markers: str | tuple[str, ...], end_markers: str | tuple[str, ...], in_reasoning: bool,
        start_required: bool = False,
    ) -> None:
        self.start_markers = (start_markers,) if isinstance(start_markers, str) else tuple(start_markers)
        self.end_markers = (end_markers,) if isinstance(end_markers, str) else tuple(end_markers)
        self.start_required = start_required
        """An output that does not open with a start marker is all content."""
        self.in_reasoning = in_reasoning
        """Until the end marker has been seen; False from the start for an output outside reasoning."""
        self._at_start = in_reasoning  # nothing decided yet: a leading start marker may come
        self._held = ""  # a possible marker prefix, not yet sent

    def feed(self, delta: str) -> ReasoningDelta:
        """The parts of ``delta`` (with what was held back) that are settled now."""
        return self._advance(delta, final=False)

    def finish(self) -> ReasoningDelta:
        """The output ended: what was held back is settled as the whole-output split would."""
        return self._advance("", final=True)

    def _advance(self, delta: str, final: bool) -> ReasoningDelta:
        if not self.in_reasoning:
            return ReasoningDelta("", delta)
        text, self._held = self._held + delta, ""
        if self._at_start:
            if not final and _may_become(text, self.start_markers):
                self._held = text
                return ReasoningDelta("", "")
            self._at_start = False
            start = opening_marker(text, self.start_markers)
            if start is None and self.start_required:
                self.in_reasoning = False
                return ReasoningDelta("", text)
            text = text[len(start or ""):]
        found = find_marker(text, self.end_markers)
        if found is not None:
            end, marker = found
            if not final and _may_become(text[end:], self.end_markers):  # a longer spelling may follow
                self._held = text[end:]
                return ReasoningDelta(text[:end], "")
            self.in_reasoning = False
            return ReasoningDelta(text[:end], text[end + len(marker):])
        keep = 0 if final else _marker_prefix_len(text, self.end_markers)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return ReasoningDelta(text, "")


def opening_marker(text: str, markers: tuple[str, ...]) -> str | None:
    """The longest of ``markers`` that ``text`` starts with, or None."""
    found = [m for m in markers if text.startswith(m)]
    return max(found, key=len) if found else None


def find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the earliest of ``markers`` begins in ``text`` and which (the longest of those
    beginning there), or None."""
    best: tuple[int, str] | None = None
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (best is None or at < best[0] or (at == best[0] and len(marker) > len(best[1]))):
            best = (at, marker)
    return best


def _may_become(text: str, markers: tuple[str, ...]) -> bool:
    """Whether ``text`` is a proper prefix of one of ``markers`` (more text could complete it)."""
    return any(len(text) < len(m) and m.startswith(text) for m in markers)


def _marker_prefix_len(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of one of ``markers``."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if _may_become(text[-k:], markers):
            return k
    return 0
