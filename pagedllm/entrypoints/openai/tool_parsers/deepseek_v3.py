"""DeepSeek-V3 / R1 format: content, then the calls between DeepSeek's special tokens,
each with its arguments in a fenced JSON block::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

A call shows once its name's line has ended; its arguments stream as settled JSON (as
``hermes``). Text after the calls' end is content.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ParsedCall,
    ParsedText,
    Resume,
    ToolParser,
    partial_marker_len,
    settled_content,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import call_from_object, decode_first, parse_partial

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


def _call(body: str, closed: bool) -> ParsedCall | None | bool:
    """One call's text after ``CALL_BEGIN`` (up to ``CALL_END`` when ``closed``): the call,
    None while its name's line is still coming, False if it is malformed."""
    sep = body.find(SEP)
    line_end = body.find("\n", sep) if sep >= 0 else -1
    if line_end < 0:
        return False if closed else None
    name = body[sep + len(SEP):line_end].strip()
    args = body[line_end + 1:].lstrip()
    if args.startswith(FENCE):
        args = args[len(FENCE):]
    elif FENCE.startswith(args):
        args = ""  # the fence may still be coming
    if not name:
        return False
    decoded = decode_first(args)
    if decoded is not None:
        after = args[decoded[1]:].strip()
        if after and not (after.startswith("```") and not after[3:].strip()):
            return False  # text after the arguments
        return call_from_object({"name": name, "arguments": decoded[0]}, complete=True) or False
    if closed:
        return False
    return call_from_object({"name": name, "arguments": parse_partial(args)}, complete=False) if args.strip() \
        else ParsedCall(name, "")


class DeepSeekV3ToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            content = settled_content(text, CALLS_BEGIN, final)
            return ParsedText(content, [], Resume(len(content), len(content), 0))
        content = text[:start]
        calls: list[ParsedCall] = []
        pos = start + len(CALLS_BEGIN)
        while True:
            section = text[pos:].lstrip()
            pos = len(text) - len(section)
            if section.startswith(CALLS_END):
                after = text[pos + len(CALLS_END):]
                return ParsedText(content + after, calls, Resume(len(text), len(content) + len(after), len(calls),
                                                                 rest_is_content=True))
            if not section.startswith(CALL_BEGIN):
                if not final and (not section or partial_marker_len(section, CALL_BEGIN) == len(section)
                                  or partial_marker_len(section, CALLS_END) == len(section)):
                    return ParsedText(content, calls)  # the next marker may be coming
                return self._malformed(text, start, pos, content, calls, final)
            body_start = pos + len(CALL_BEGIN)
            end = text.find(CALL_END, body_start)
            call = _call(text[body_start:] if end < 0 else text[body_start:end], end >= 0)
            if call is False or (call is None and final):
                return self._malformed(text, start, pos, content, calls, final)
            if call is not None:
                calls.append(call)  # type: ignore[arg-type]
            if end < 0:
                return ParsedText(content, calls)
            pos = end + len(CALL_END)

    @staticmethod
    def _malformed(text: str, start: int, pos: int, content: str, calls: list[ParsedCall], final: bool) -> ParsedText:
        """Text at ``pos`` that is not DeepSeek's call syntax: content once the output is
        complete (all of the calls' section if no call was read, as the non-streamed answer)."""
        if not final:
            return ParsedText(content, calls)
        return ParsedText(content + text[start:], []) if not calls else ParsedText(content + text[pos:], calls)
