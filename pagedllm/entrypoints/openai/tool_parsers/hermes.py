"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
number of times, with content around the calls."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedText, Resume, ToolParser, settled_content
from pagedllm.entrypoints.openai.tool_parsers.json_calls import call_from_object, decode_first, parse_partial

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        content: list[str] = []
        calls = []
        pos = 0
        resume = None
        while True:
            start = text.find(START, pos)
            if start < 0:
                content.append(settled_content(text[pos:], START, final))
                resume = Resume(pos + len(content[-1]), sum(map(len, content)), len(calls))
                break
            content.append(text[pos:start])
            body_start = start + len(START)
            end = text.find(END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            decoded = decode_first(body)
            call = None
            if decoded is not None and not body[decoded[1]:].strip():
                call = call_from_object(decoded[0], complete=True)
            if end >= 0:
                if call is not None:
                    calls.append(call)
                else:  # a closed but malformed call is text
                    content.append(text[start:end + len(END)])
                pos = end + len(END)
                resume = Resume(pos, sum(map(len, content)), len(calls))
                continue
            # An open call (cut by max_tokens or still streaming): its settled part.
            if call is None:
                call = call_from_object(parse_partial(body), complete=False)
            if call is not None:
                calls.append(call)
            elif final:
                content.append(text[start:])
            break
        return ParsedText("".join(content), calls, resume)
