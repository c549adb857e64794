"""Phi-4-mini format: content, then ``functools`` and a JSON array of
``{"name": ..., "arguments": {...}}`` (``functools[{"name": "add", "arguments": {"a": 1}}]``):
Mistral's shape under another marker."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser


class Phi4MiniJsonToolParser(MistralToolParser):
    marker = "functools"
