"""Which chat template renders a request that has tools or tool messages.

A model whose template never mentions ``tools`` cannot show them to the model, and may fail
on ``content: null`` beside ``tool_calls`` (the default model's concatenates ``content``).
Such a request is rendered with the Hermes-style ChatML template shipped here, unless the
server was given ``--chat-template`` (which always wins).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

TOOL_TEMPLATE_PATH = Path(__file__).with_name("hermes_tool_template.jinja")
_MENTIONS_TOOLS = re.compile(r"\btools\b")


@functools.cache
def hermes_tool_template() -> str:
    return TOOL_TEMPLATE_PATH.read_text()


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Tools offered, or a conversation that already holds calls or their results."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def handles_tools(template: Any) -> bool:
    return isinstance(template, str) and _MENTIONS_TOOLS.search(template) is not None


def choose_chat_template(
    server_template: str | None, model_template: Any, messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> str | None:
    """The template to render with; None: the model's own."""
    if server_template is not None:
        return server_template
    if uses_tools(messages, tools) and not handles_tools(model_template):
        return hermes_tool_template()
    return None
