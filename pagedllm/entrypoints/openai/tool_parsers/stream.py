"""From successive parses of a growing output to OpenAI's streamed deltas.

Each call's first delta carries its ``index``, ``id``, ``type`` and ``function.name``; later
deltas carry ``index`` and ``function.arguments`` fragments only. The fragments are the
growth of the parser's settled arguments (abstract.py's contract), so they concatenate to
the non-streamed ``arguments`` byte for byte.
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

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def update(self, text: str, final: bool) -> StreamDelta:
        """``text``: the choice's whole output so far; ``final``: the choice has finished."""
        parsed: ParsedText = self.parser.parse(text, final)
        delta = StreamDelta(content=parsed.content[self.num_content_sent:])
        self.num_content_sent = max(self.num_content_sent, len(parsed.content))
        for index, call in enumerate(parsed.calls):
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
        return delta
