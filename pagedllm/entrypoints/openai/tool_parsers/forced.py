"""``tool_choice: "required"`` and a named function: the grammar the output must follow, and
the parsers that read that output back as calls.

The output is constrained with a JSON schema built from the tools' parameter schemas,
through the engine's structured-output path (xgrammar), so the arguments always parse and
validate:

- named: the output is the function's arguments object itself;
- required: the output is ``[{"name": <one of the tools>, "parameters": {...}}, ...]``, one
  or more calls, exactly one when ``parallel_tool_calls`` is false.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedText, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    decode_first,
    dump_arguments,
    parse_call_array,
    parse_partial,
    settled_prefix,
)

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (a function without one takes no arguments)."""
    return function.get("parameters") or _NO_PARAMETERS


def named_schema(function: dict[str, Any]) -> dict[str, Any]:
    return parameters_schema(function)


def required_schema(functions: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """An array of calls, each naming one of the functions with its parameters."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": parameters_schema(f)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one known function."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        decoded = decode_first(text)
        if decoded is not None:
            return ParsedText("", [ParsedCall(self.name, dump_arguments(decoded[0]))])
        value = parse_partial(text)
        return ParsedText("", [ParsedCall(self.name, "" if value is None else settled_prefix(value))])


class RequiredToolParser(ToolParser):
    """The whole output is a JSON array of calls (see ``required_schema``)."""

    def parse(self, text: str, final: bool) -> ParsedText:
        parsed = parse_call_array(text)
        return ParsedText("", [] if parsed is None else parsed[0])
