"""OpenAI's harmony format (gpt-oss) read from output text: messages on channels.

An assistant turn is a run of messages, each
    [<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>
ending with <|end|> (more follows), <|return|> (the final answer's end) or <|call|> (a tool
call's end); the prompt's generation prompt writes the first `<|start|>assistant`, so an output
starts at `<|channel|>`. Channels: `analysis` (the reasoning), `commentary` (tool calls, with a
recipient `functions.NAME`, and preambles without one), `final` (the answer).

`split_harmony(text, final)` splits an output into (reasoning, content): analysis bodies are
reasoning; final and commentary-preamble bodies are content; a message with a recipient stays
in the content as harmony text (header, <|message|>, body, and <|call|> once closed), for the
`openai` tool parser (entrypoints/openai/tool_parsers/openai.py). Text before any header is
content. For a growing output (`final=False`) only what is settled: a header once its
<|message|> has come, a body without a trailing partial marker, so every later split extends
the earlier one (what the streamed deltas rely on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TERMINATORS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True, slots=True)
class HarmonyMessage:
    header: str
    """The text before <|message|> as written (from <|start|> where the output has it); empty
    for text outside any message."""
    body: str
    closed: bool
    """Its terminator has come (<|end|>, <|return|> or <|call|>)."""

    @property
    def channel(self) -> str | None:
        found = _CHANNEL_RE.search(self.header)
        return found.group(1) if found else None

    @property
    def recipient(self) -> str | None:
        found = _RECIPIENT_RE.search(self.header)
        return found.group(1) if found else None


def partial_marker_len(text: str) -> int:
    """How many trailing characters of ``text`` could be the start of a marker."""
    for k in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) and m != tail for m in MARKERS):
            return k
    return 0


def _next(text: str, pos: int, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first of ``markers`` at or after pos: (index, marker), or (len(text), "")."""
    best, which = len(text), ""
    for m in markers:
        i = text.find(m, pos)
        if 0 <= i < best:
            best, which = i, m
    return best, which


def parse_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of an output, settled ones only unless ``final`` (module docstring)."""
    messages: list[HarmonyMessage] = []
    pos = 0
    lead, _ = _next(text, 0, (START, CHANNEL))
    if lead > 0:  # text before any header: content
        plain = text[:lead]
        if not final and lead == len(text):
            plain = plain[: len(plain) - partial_marker_len(plain)]
        messages.append(HarmonyMessage("", plain, closed=False))
        pos = lead
    while pos < len(text):
        body_start = text.find(MESSAGE, pos)
        if body_start < 0:
            break  # a header still being written (or cut off): nothing of it is content
        header = text[pos:body_start]
        body_start += len(MESSAGE)
        end, marker = _next(text, body_start, (*TERMINATORS, START))
        body = text[body_start:end]
        closed = marker in TERMINATORS
        if not final and not marker:
            body = body[: len(body) - partial_marker_len(body)]
        messages.append(HarmonyMessage(header, body, closed))
        pos = end + len(marker) if closed else end
    return messages


def call_text(message: HarmonyMessage) -> str:
    """A message with a recipient as harmony text (what the tool parser reads)."""
    return message.header + MESSAGE + message.body + (CALL if message.closed else "")


def split_harmony(text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of an output (module docstring)."""
    reasoning: list[str] = []
    content: list[str] = []
    for message in parse_messages(text, final):
        if message.recipient is not None:
            content.append(call_text(message))
        elif message.channel == "analysis":
            reasoning.append(message.body)
        else:  # final, a commentary preamble, or text outside messages
            content.append(message.body)
    return "".join(reasoning), "".join(content)
