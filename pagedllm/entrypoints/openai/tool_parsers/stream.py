"""From successive parses of a growing output to OpenAI's streamed deltas.

Each call's first delta carries its ``index``, ``id``, ``type`` and ``function.name``; later
deltas carry ``index`` and ``function.arguments`` fragments only. The fragments are the
growth of the parser's settled arguments (abstract.py's contract), so they concatenate to
the non-streamed ``arguments`` byte for byte.

The parser is fed the text from its last settled point on (``ParsedText.resume``), not the
whole output: content and calls settled before that point have been sent already.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedText, ToolParser

logger = logging.getLogger(__name__)


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None
    """Set (with ``name``) only in the call's first delta."""
    name: str | None = None


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class TextStreamState:
    """A choice streamed as plain text (no tool calling): the new text is the delta."""

    made_calls = False

    def __init__(self) -> None:
        self.num_sent = 0

    def update(self, text: str, final: bool) -> StreamDelta:
        delta = StreamDelta(content=text[self.num_sent:])
        self.num_sent = len(text)
        return delta


class ToolStreamState:
    """One choice's stream: what has been sent so far."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.num_content_sent = 0
        self.arguments_sent: list[str] = []  # per call index
        self.ids: list[str] = []
        # The settled point: text offset, content characters and calls before it.
        self.base_offset = 0
        self.base_content = 0
        self.base_calls = 0
        self.rest_is_content = False

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool) -> StreamDelta:
        """``text``: the choice's whole output so far; ``final``: the choice has finished."""
        rest = text[self.base_offset:]
        parsed = ParsedText(rest) if self.rest_is_content else self.parser.parse(rest, final)
        delta = StreamDelta(content=parsed.content[self.num_content_sent - self.base_content:])
        self.num_content_sent = max(self.num_content_sent, self.base_content + len(parsed.content))
        for index, call in enumerate(parsed.calls, start=self.base_calls):
            if index == len(self.ids):
                self.ids.append(tool_call_id())
                self.arguments_sent.append("")
                delta.tool_calls.append(ToolCallDelta(index, "", self.ids[index], call.name))
            sent = self.arguments_sent[index]
            if not call.arguments.startswith(sent):
                # Only a model that repeats a key gets here (the later value wins in JSON):
                # what was sent cannot be taken back.
                logger.warning("tool call %d: arguments changed after streaming began", index)
                continue
            if len(call.arguments) > len(sent):
                fragment = call.arguments[len(sent):]
                self.arguments_sent[index] = call.arguments
                if delta.tool_calls and delta.tool_calls[-1].index == index:
                    delta.tool_calls[-1].arguments += fragment
                else:
                    delta.tool_calls.append(ToolCallDelta(index, fragment))
        if parsed.resume is not None and not final:
            self.base_offset += parsed.resume.offset
            self.base_content += parsed.resume.content_len
            self.base_calls += parsed.resume.num_calls
            self.rest_is_content = parsed.resume.rest_is_content
        return delta
