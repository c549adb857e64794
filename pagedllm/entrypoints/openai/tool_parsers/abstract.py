"""What every tool parser returns, and the contract that makes streaming agree with the
non-streamed answer.

A parser reads the model's whole text so far (not a delta) and returns a ``ParsedText``:
the content outside calls and the calls found. Called on a growing prefix with
``final=False`` it returns only what is settled: each later answer extends the earlier one
(content and every call's ``arguments`` grow by appending, calls are only added). The
streaming layer (``stream.py``) sends exactly those extensions, so the streamed deltas
concatenate to the ``final=True`` answer, byte for byte.

So that a long stream costs work in proportion to its length (not its length squared), a
parse may also say where the settled text ends (``ParsedText.resume``): the text before
that offset gave the answer's first ``content_len`` characters of content and its first
``num_calls`` calls, all final, and a fresh parse of the text after it (with the same
``final``) gives exactly the rest. The streaming layer then feeds the parser only the text
from the last such offset on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


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
    resume: Resume | None = None
    """Where a later parse may start over (None: from where this one started)."""


@dataclass(frozen=True, slots=True)
class Resume:
    """A settled point of the text (see the module docstring)."""

    offset: int
    """Characters of the parsed text before the point."""
    content_len: int
    """Characters of ``ParsedText.content`` from the text before the point."""
    num_calls: int
    """Calls (complete) from the text before the point."""
    rest_is_content: bool = False
    """All the text after the point is content, whatever follows (a format whose calls
    must open the output, once it has not)."""


class ToolParser(ABC):
    """Turns one model output format into content and calls (see the module docstring)."""

    def __init__(self, functions: list[dict[str, Any]] | None = None) -> None:
        self.functions = functions or []
        """The request's tools' ``function`` objects (a format whose argument values are
        text reads their types from the ``parameters`` schemas)."""

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
