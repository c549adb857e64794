"""Calls written as JSON objects ``{"name": ..., "arguments"|"parameters": {...}}``, complete
or partial, read with ``partial_json_parser``.

Arguments are always re-serialised as ``json.dumps(value, ensure_ascii=False)`` (vLLM's form),
whatever spacing the model used. A partial object is parsed keeping only finished strings,
numbers and literals (``Allow.OBJ | Allow.ARR``): the containers it opens hold only values
that will not change. Its serialisation with every trailing ``}``/``]`` removed is then a
prefix of the final serialisation (the final text only appends items or closes containers).
"""

from __future__ import annotations

import json
from typing import Any

import partial_json_parser
from partial_json_parser import Allow

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall

_SETTLED = Allow.OBJ | Allow.ARR
_ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder()


def dump_arguments(value: Any) -> str:
    """The final arguments text. A model that writes its arguments as a JSON string gets the
    object inside it (as OpenAI's own arguments are an object's JSON)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def settled_prefix(value: Any) -> str:
    """A prefix of the final arguments text, from a partially parsed value."""
    if isinstance(value, str):  # a string of arguments is only read once complete
        return ""
    return json.dumps(value, ensure_ascii=False).rstrip("}]")


def parse_partial(text: str) -> Any | None:
    """The settled part of a JSON text that may be cut anywhere; None if it is not JSON."""
    if not text.strip():
        return None
    try:
        return partial_json_parser.loads(text, _SETTLED)
    except ValueError:  # MalformedJSON and json's JSONDecodeError are ValueErrors
        return None


def decode_first(text: str) -> tuple[Any, int] | None:
    """The complete JSON value at the start of ``text`` (after whitespace) and the index
    after it, or None if there is none yet (or it is malformed)."""
    start = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError:
        return None


def call_from_object(obj: Any, complete: bool) -> ParsedCall | None:
    """A call from a parsed object; None if it has no finished string ``name`` (yet)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in _ARGUMENT_KEYS if k in obj), None)
    if complete:
        return ParsedCall(obj["name"], dump_arguments(obj[key] if key else {}))
    return ParsedCall(obj["name"], settled_prefix(obj[key]) if key else "")


def parse_call_array(text: str) -> tuple[list[ParsedCall], int | None] | None:
    """A JSON array of call objects at the start of ``text``.

    Returns (calls, end): ``end`` is the index after the closing ``]`` once the array is
    complete, else None; an incomplete array lists the calls whose names are known, the last
    with settled arguments. None if the text is not (the start of) an array of calls.
    """
    decoded = decode_first(text)
    if decoded is not None:
        value, end = decoded
        if not isinstance(value, list):
            return None
        calls = [call_from_object(item, complete=True) for item in value]
        return (None if any(c is None for c in calls) else (calls, end))  # type: ignore[return-value]
    value = parse_partial(text)
    if not isinstance(value, list):
        return None
    calls = []
    for i, item in enumerate(value):
        # Every item but the last is complete: a later one has begun.
        call = call_from_object(item, complete=i < len(value) - 1)
        if call is None:
            break
        calls.append(call)
    return calls, None
