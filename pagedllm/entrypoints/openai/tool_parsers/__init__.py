"""Tool calling: parsers from model text to calls (a registry, one module each), the
constrained ``required``/named choices, and the per-request handler the chat server uses.

    get_tool_parser("hermes")      -> a ToolParser (modules import on first use)
    tool_parser_names()            -> the registered names (for --tool-call-parser)
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedText, ToolParser

# name -> "module:class"; a new format is one module and one line here.
_REGISTRY: dict[str, str] = {
    "deepseek_v3": "deepseek_v3:DeepSeekV3ToolParser",
    "granite": "granite:GraniteToolParser",
    "hermes": "hermes:HermesToolParser",
    "llama3_json": "llama3_json:Llama3JsonToolParser",
    "mistral": "mistral:MistralToolParser",
    "phi4_mini_json": "phi4_mini_json:Phi4MiniJsonToolParser",
    "openai": "openai:OpenAIToolParser",
    "pythonic": "pythonic:PythonicToolParser",
    "qwen3_coder": "qwen3_coder:Qwen3CoderToolParser",
}


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def get_tool_parser(name: str, functions: list[dict[str, Any]] | None = None) -> ToolParser:
    """A fresh parser for ``--tool-call-parser name`` and the request's tools' ``function``
    objects; ValueError naming the choices."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(tool_parser_names())}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(functions)


__all__ = ["ParsedCall", "ParsedText", "ToolParser", "get_tool_parser", "tool_parser_names"]
