"""Llama 3.1/3.2 JSON format: the whole output is ``{"name": ..., "parameters": {...}}``,
optionally after ``<|python_tag|>``, several calls separated by ``;``. An output that does
not start that way is content."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedText, Resume, ToolParser, partial_marker_len
from pagedllm.entrypoints.openai.tool_parsers.json_calls import call_from_object, decode_first, parse_partial

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG):].lstrip()
        elif not final and stripped and partial_marker_len(stripped, PYTHON_TAG) == len(stripped):
            return ParsedText()  # may still become the tag
        if not stripped.startswith("{"):
            if not stripped:
                return ParsedText(text if final else "")
            return ParsedText(text, [], Resume(len(text), len(text), 0, rest_is_content=True))
        calls = []
        rest = stripped
        while rest:
            decoded = decode_first(rest)
            if decoded is None:  # the last call, still open (or malformed)
                call = call_from_object(parse_partial(rest), complete=False)
                if call is not None:
                    calls.append(call)
                    return ParsedText("", calls)
                return ParsedText(rest if final else "", calls)
            call = call_from_object(decoded[0], complete=True)
            if call is None:
                return ParsedText(rest if final else "", calls)
            calls.append(call)
            rest = rest[decoded[1]:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:  # text after the calls that is not another call
                return ParsedText(rest if final else "", calls)
        return ParsedText("", calls)
