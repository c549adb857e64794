"""Granite 3.x format: the output is ``<|tool_call|>`` (Granite 3.0) or ``<tool_call>``
(3.1 on), or neither, then a JSON array of ``{"name": ..., "arguments": {...}}``. An output
that does not start that way is content; text after the array is content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedText, Resume, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_calls import parse_call_array

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        stripped = text.lstrip()
        if not final and any(m.startswith(stripped) for m in MARKERS):
            return ParsedText()  # empty, or may still become a marker
        body = stripped
        for marker in MARKERS:
            if body.startswith(marker):
                body = body[len(marker):].lstrip()
                break
        if not body.startswith("["):
            if not body and not final:
                return ParsedText()
            return ParsedText(text, [], Resume(len(text), len(text), 0, rest_is_content=True))
        parsed = parse_call_array(body)
        if parsed is None or (final and parsed[1] is None and not parsed[0]):
            return ParsedText(text if final else "")
        calls, end = parsed
        return ParsedText("" if end is None else body[end:], calls)
