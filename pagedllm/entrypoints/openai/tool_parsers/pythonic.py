"""Pythonic format (Llama 3.2 / Llama 4, ToolACE): the whole output is a Python list of
calls with keyword arguments, ``[get_weather(city="Paris"), add(a=1, b=2)]``. An output that
does not start with ``[`` is content.

The complete text is read with ``ast``. While it streams, a small scanner (quotes, escapes,
bracket depth) finds the finished keyword arguments of each call; each is read with
``ast.literal_eval``, so a call's arguments grow one finished argument at a time, and a call
is announced only once its first argument has been read (or it closes without any).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedText, Resume, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_calls import settled_prefix

_OPEN, _CLOSE = "([{", ")]}"


def _full_calls(text: str) -> list[ParsedCall] | None:
    """Every call of a complete list, or None if the text is not a list of such calls."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):
            return None  # **kwargs
        calls.append(ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def _keyword(segment: str) -> tuple[str, Any] | None:
    """``name=literal`` -> (name, value); None if it is not one."""
    name, eq, value = segment.partition("=")
    if not eq or not name.strip().isidentifier():
        return None
    try:
        return name.strip(), ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
        return None


def _open_calls(text: str) -> list[tuple[str, list[str], bool]]:
    """The calls of a list cut anywhere: (name, finished argument texts, call closed).

    Depth 1 is the list, 2 a call's arguments; a comma at depth 2 ends an argument.
    """
    calls: list[tuple[str, list[str], bool]] = []
    depth, quote, escaped = 0, "", False
    name_start = arg_start = 0
    for i, ch in enumerate(text):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
            continue
        if ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
            if depth == 1:
                name_start = i + 1
            elif depth == 2 and ch == "(":
                calls.append((text[name_start:i].strip(), [], False))
                arg_start = i + 1
        elif ch in _CLOSE:
            if depth == 2 and calls and ch == ")":
                name, args, _ = calls[-1]
                if text[arg_start:i].strip():
                    args.append(text[arg_start:i])
                calls[-1] = (name, args, True)
            depth -= 1
        elif ch == "," and depth == 2 and calls:
            calls[-1][1].append(text[arg_start:i])
            arg_start = i + 1
        elif ch == "," and depth == 1:
            name_start = i + 1
    return calls


class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        stripped = text.strip()
        if not stripped.startswith("["):
            if not stripped:
                return ParsedText(text if final else "")
            return ParsedText(text, [], Resume(len(text), len(text), 0, rest_is_content=True))
        full = _full_calls(stripped)
        if full is not None:
            return ParsedText("", full)
        calls = []
        for name, args, closed in _open_calls(stripped):
            kwargs = [_keyword(a) for a in args]
            # A call shows once an argument is read (or it closes): `f(x=oops` is no call.
            if not name.isidentifier() or any(k is None for k in kwargs) or not (kwargs or closed):
                break
            value = dict(kwargs)  # type: ignore[arg-type]
            arguments = json.dumps(value, ensure_ascii=False) if closed else settled_prefix(value)
            calls.append(ParsedCall(name, arguments))
        if final and not calls:
            return ParsedText(text)
        return ParsedText("", calls)
