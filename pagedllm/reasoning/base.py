"""ReasoningParser: a model's reasoning markers, and where its output's reasoning ends.

The rules every parser here shares (text-based, so a marker split across tokens, or spelled
by several tokens, is found all the same):
- The output starts inside the reasoning unless the prompt closed it (its last marker is the
  end marker: a template that turned thinking off) or the parser says thinking is off for the
  request (``thinking_enabled``); a prompt whose last marker opens the reasoning starts it.
- Inside the reasoning, an opening marker at the very start of the output is dropped (models
  that write it themselves); the text up to the end marker is reasoning, the end marker is
  dropped, and everything after it is content. No end marker: all of it is reasoning (the
  output was cut short, e.g. by max_tokens).
- An output that starts outside the reasoning is all content.

A parser may declare several spellings of each marker (``start_markers``, ``end_markers``;
Granite's "Here is my ..." and "Here's my ..."): any of them opens or closes the reasoning, the
earliest in the text wins (the longest where several begin at the same place), and the first
of each is the canonical one (``start_marker``/``end_marker``: what a thinking budget writes).
A parser with ``start_required`` reads an output as reasoning only if it opens with a start
marker; otherwise the whole output is content (Granite's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pagedllm.reasoning.stream import ReasoningStream, find_marker, opening_marker


@dataclass(frozen=True)
class ReasoningSplit:
    """A whole output split in two; None where a part is empty."""

    reasoning: str | None
    content: str | None


class ReasoningParser:
    """The markers of one model family. Subclasses set ``start_marker``/``end_marker`` (or
    several spellings, ``start_markers``/``end_markers``, the first canonical) and may override
    ``thinking_enabled``."""

    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    start_markers: ClassVar[tuple[str, ...]] = (start_marker,)
    end_markers: ClassVar[tuple[str, ...]] = (end_marker,)
    start_required: ClassVar[bool] = False
    """Inside the reasoning, an output that does not open with a start marker is all content."""
    needs_special_tokens: ClassVar[bool] = False
    """The markers are special tokens: requests keep them in the output text
    (``skip_special_tokens=False``) so the parser sees them (harmony's)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Keep the single and the several markers in step: a subclass that declares one form
        gets the other."""
        super().__init_subclass__(**kwargs)
        for one, several in (("start_marker", "start_markers"), ("end_marker", "end_markers")):
            if several in cls.__dict__:
                setattr(cls, one, cls.__dict__[several][0])
            elif one in cls.__dict__:
                setattr(cls, several, (cls.__dict__[one],))

    def __init__(self, tokenizer: Any) -> None:
        self.end_token_ids = _union(marker_token_ids(tokenizer, m) for m in self.end_markers)
        """The token-id sequences that spell an end marker in this vocabulary (one id where the
        marker is a token of its own, as in reasoning models' vocabularies)."""
        self.end_marker_ids = tuple(tokenizer.encode(self.end_marker, add_special_tokens=False))
        """The ids that spell the end marker alone: what a thinking budget writes (budget.py)."""

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the request lets the model think when the prompt says nothing either way."""
        return True

    def starts_in_reasoning(self, prompt_text: str | None, chat_template_kwargs: dict[str, Any] | None = None) -> bool:
        """Whether the output begins inside the reasoning (see the module's rules)."""
        if prompt_text:
            last_end = max(prompt_text.rfind(m) for m in self.end_markers)
            last_start = max(prompt_text.rfind(m) for m in self.start_markers)
            if last_end > last_start:
                return False
            if last_start > last_end:
                return True
        return self.thinking_enabled(chat_template_kwargs)

    def split(self, text: str, in_reasoning: bool) -> ReasoningSplit:
        """A finished output's (reasoning, content); ``in_reasoning`` from ``starts_in_reasoning``."""
        if not in_reasoning:
            return ReasoningSplit(None, text)
        start = opening_marker(text, self.start_markers)
        if start is None and self.start_required:
            return ReasoningSplit(None, text)
        body = text[len(start or ""):]
        found = find_marker(body, self.end_markers)
        if found is None:
            return ReasoningSplit(body or None, None)
        at, marker = found
        return ReasoningSplit(body[:at] or None, body[at + len(marker):] or None)

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        """A splitter for one streamed output (one per choice)."""
        return ReasoningStream(self.start_markers, self.end_markers, in_reasoning, self.start_required)


def _union(groups: Any) -> tuple[tuple[int, ...], ...]:
    """The sequences of several markers' ``marker_token_ids``, in order, each once."""
    return tuple(dict.fromkeys(ids for group in groups for ids in group))


def marker_token_ids(tokenizer: Any, marker: str) -> tuple[tuple[int, ...], ...]:
    """How ``marker`` tokenizes alone and after a space, keeping only the shortest of two
    sequences where one ends with the other (a marker that is one token: that one id)."""
    found: list[tuple[int, ...]] = []
    for text, prefix in ((marker, ""), (" " + marker, " ")):
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if prefix:  # drop the tokens that spell the space alone
            space = tuple(tokenizer.encode(prefix, add_special_tokens=False))
            if ids[: len(space)] == space:
                ids = ids[len(space):]
        if ids:
            found.append(ids)
    kept = sorted(set(found), key=len)
    result: list[tuple[int, ...]] = []
    for ids in kept:
        if not any(ids[len(ids) - len(short):] == short for short in result):
            result.append(ids)
    return tuple(result)
