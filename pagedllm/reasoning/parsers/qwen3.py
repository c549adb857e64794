"""Qwen3: ``<think>...</think>``, with a strict switch: ``chat_template_kwargs`` with
``enable_thinking: false`` turns thinking off (the Qwen3 template then writes an empty
``<think></think>`` into the prompt; with a template that writes nothing, the switch alone
says so). Thinking on (the default), the model writes ``<think>`` itself (Qwen3 up to 2507) or
its template opens it in the prompt (later ones): either way the text before ``</think>`` is
reasoning."""

from __future__ import annotations

from typing import Any

from pagedllm.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    start_marker = "<think>"
    end_marker = "</think>"

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


PARSER = Qwen3ReasoningParser
