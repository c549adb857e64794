"""Mistral format: content, then ``[TOOL_CALLS]`` and a JSON array of
``{"name": ..., "arguments": {...}}``."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedText, Resume, ToolParser, settled_content
from pagedllm.entrypoints.openai.tool_parsers.json_calls import parse_call_array

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    marker = TOOL_CALLS
    """What opens the array of calls."""

    def parse(self, text: str, final: bool) -> ParsedText:
        start = text.find(self.marker)
        if start < 0:
            content = settled_content(text, self.marker, final)
            return ParsedText(content, [], Resume(len(content), len(content), 0))
        body = text[start + len(self.marker):]
        parsed = parse_call_array(body)
        if parsed is None or (final and parsed[1] is None and not parsed[0]):
            return ParsedText(text[:start] + (text[start:] if final else ""))
        calls, end = parsed
        after = "" if end is None else body[end:]
        return ParsedText(text[:start] + after, calls)
