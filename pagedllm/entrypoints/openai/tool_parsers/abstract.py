"""What every tool parser returns, and the contract that makes streaming agree with the
non-streamed answer.

A parser reads the model's whole text so far (not a delta) and returns a ``ParsedText``:
the content outside calls and the calls found. Called on a growing prefix with
``final=False`` it returns only what is settled: each later answer extends the earlier one
(content and every call's ``arguments`` grow by appending, calls are only added). The
streaming layer (``stream.py``) sends exactly those extensions, so the streamed deltas
concatenate to the ``final=True`` answer, byte for byte.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str
    """JSON text of the arguments; in a non-final parse, a prefix of the final text."""


@dataclass(frozen=True, slots=True)
class ParsedText:
    content: str = ""
    """The text outside calls; in a non-final parse, only what can no longer turn into a call."""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(ABC):
    """Turns one model output format into content and calls (see the module docstring)."""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """``text``: the whole output so far; ``final``: it is complete (the request finished)."""


def partial_marker_len(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker`` (held back
    from content while the rest may still arrive)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def settled_content(text: str, marker: str, final: bool) -> str:
    """``text`` without a trailing partial ``marker``, unless the output is complete."""
    return text if final else text[: len(text) - partial_marker_len(text, marker)]
