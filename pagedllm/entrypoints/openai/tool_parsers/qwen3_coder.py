"""Qwen3-Coder format: XML-style calls, any number, with content around them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text (one newline either side of it is layout): it is converted by
the type its tool's ``parameters`` schema gives it (``type``, a list of types or ``anyOf``:
``integer``, ``number`` (integral values as integers), ``boolean``, ``object``/``array``
read as JSON or a Python literal, ``null``/``None`` as null where the type is not a string or
null is allowed); a string, an undeclared parameter or a value that does not convert stays
text. The arguments are the JSON object
of the parameters in order; while streaming, a call shows once its ``<function=...>`` tag
has closed (arguments ``{``) and grows by one parameter as each closes, ``}`` last.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import (
    ParsedCall,
    ParsedText,
    Resume,
    ToolParser,
    settled_content,
)

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _schema_types(functions: list[dict[str, Any]], name: str, key: str) -> tuple[list[str], bool] | None:
    """The parameter's JSON-schema types (``type``, a list of them, or ``anyOf``'s) and whether
    null is one; None for a parameter the tool does not declare."""
    for function in functions:
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            prop = properties.get(key)
            if not isinstance(prop, dict):
                return None
            raw = prop.get("type") if "type" in prop else [o.get("type") for o in prop.get("anyOf", ())
                                                           if isinstance(o, dict)]
            types = [str(t).strip().lower() for t in (raw if isinstance(raw, list) else [raw]) if t is not None]
            return [t for t in types if t != "null"] or ["string"], "null" in types
    return None


def convert(value: str, schema: tuple[list[str], bool] | None) -> Any:
    """A parameter's text as its schema type: the text itself for a string, an undeclared
    parameter or a value that does not convert; ``null``/``None`` is null where the schema
    allows it or the type is not a string."""
    if schema is None:
        return value
    types, nullable = schema
    stripped = value.strip()
    is_null = stripped.lower() in ("null", "none")
    if is_null and nullable:
        return None
    for t in types:
        if t in ("string", "str", "text", "char", "varchar", "enum"):
            return value
        if is_null:
            return None
        try:
            if t.startswith(("int", "uint", "long", "short")):
                return int(stripped)
            if t.startswith(("num", "float", "double")):
                number = float(stripped)
                if not math.isfinite(number):  # no JSON for it: stays text
                    continue
                return int(number) if number.is_integer() else number
            if t in ("boolean", "bool") and stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            if t in ("object", "array", "arr") or t.startswith(("dict", "list")):
                try:
                    return json.loads(stripped)
                except ValueError:
                    return ast.literal_eval(stripped)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError, OverflowError):
            continue
    return value


def _member(key: str, value: Any) -> str:
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class Qwen3CoderToolParser(ToolParser):
    def _call(self, body: str, closed: bool, final: bool) -> ParsedCall | None | bool:
        """One call's text after ``<tool_call>`` (up to ``</tool_call>`` when ``closed``):
        the call, None while its function tag is still coming, False if it is malformed."""
        head = body.lstrip()
        if not head.startswith(FUNCTION):
            return False if closed or final or (head and not FUNCTION.startswith(head)) else None
        tag_end = head.find(">")
        if tag_end < 0:
            return False if closed or final else None
        name = head[len(FUNCTION):tag_end].strip()
        if not name:
            return False
        rest = head[tag_end + 1:]
        members: list[str] = []
        done = closed or final
        pos = 0
        while True:
            start = rest.find(PARAMETER, pos)
            function_end = rest.find(FUNCTION_END, pos)
            if start < 0 or 0 <= function_end < start:
                done = done or function_end >= 0
                break
            key_end = rest.find(">", start)
            if key_end < 0:
                break
            key = rest[start + len(PARAMETER):key_end].strip()
            value_start = key_end + 1
            # A value ends at its closing tag, or (a model that leaves it out) at the next
            # parameter or the function's end; at the output's end if cut there.
            ends = [i for i in (rest.find(PARAMETER_END, value_start), rest.find(PARAMETER, value_start),
                                rest.find(FUNCTION_END, value_start)) if i >= 0]
            if ends:
                value_end = min(ends)
            elif closed or final:
                value_end = len(rest)
            else:
                break
            value = rest[value_start:value_end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            members.append(_member(key, convert(value, _schema_types(self.functions, name, key))))
            pos = value_end + len(PARAMETER_END) if rest.startswith(PARAMETER_END, value_end) else value_end
        arguments = "{" + ", ".join(members)
        return ParsedCall(name, arguments + "}" if done else arguments)

    def parse(self, text: str, final: bool) -> ParsedText:
        content: list[str] = []
        calls: list[ParsedCall] = []
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
            call = self._call(text[body_start:] if end < 0 else text[body_start:end], end >= 0, final)
            if end >= 0:
                if call:
                    calls.append(call)  # type: ignore[arg-type]
                else:  # a closed but malformed call is text
                    content.append(text[start:end + len(END)])
                pos = end + len(END)
                resume = Resume(pos, sum(map(len, content)), len(calls))
                continue
            if call:
                calls.append(call)  # type: ignore[arg-type]
            elif final:
                content.append(text[start:])
            break
        return ParsedText("".join(content), calls, resume)
