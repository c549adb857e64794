"""One chat request's tool calling, as the chat server sees it: which choice applies, what
the grammar constrains, and how each choice's text becomes content and calls.

The rules are vLLM's: ``tool_choice`` defaults to ``"auto"`` when tools are given; ``"auto"``
needs ``--enable-auto-tool-choice`` (and so a ``--tool-call-parser``); ``"none"``,
``"required"`` and a named function work without them, and the last two are read back as
calls whatever the parser flag says. The text it is given is the content (a reasoning
parser, when there is one, has already taken the reasoning out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)
from pagedllm.entrypoints.openai.tool_parsers.stream import ToolStreamState, tool_call_id
from pagedllm.sampling_params import StructuredOutputsParams


class ToolChoiceError(ValueError):
    """The request's tools or tool_choice are refused (the server's 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCallConfig:
    """The server's tool-calling flags."""

    enable_auto_tool_choice: bool = False
    """``tool_choice: "auto"`` is allowed (the parser reads calls from the model's text)."""
    tool_call_parser: str | None = None
    """The registered parser for the model's tool-call format (tool_parsers.tool_parser_names())."""

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's call format)")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the choices


@dataclass(frozen=True, slots=True)
class ToolCallResult:
    """A finished choice: ``content`` None when the calls are all there is."""

    content: str | None
    tool_calls: list[tuple[str, ParsedCall]]  # (id, call)


class ToolCallHandler:
    def __init__(self, parser: ToolParser, structured_outputs: StructuredOutputsParams | None) -> None:
        self.parser = parser
        self.structured_outputs = structured_outputs
        """The grammar for required/named choices (None for auto)."""

    @classmethod
    def for_request(
        cls, functions: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
        parallel_tool_calls: bool | None, config: ToolCallConfig,
    ) -> ToolCallHandler | None:
        """``functions``: the tools' ``function`` objects; ``tool_choice``: a mode or
        ``{"name": ...}``. None when the output is plain text (no tools, or ``"none"``)."""
        if not functions:
            if tool_choice not in (None, "none"):
                raise ToolChoiceError("tool_choice needs tools: give the functions in tools", "tool_choice")
            return None
        choice = tool_choice or "auto"
        if choice == "none":
            return None
        if choice == "auto":
            if not config.enable_auto_tool_choice or config.tool_call_parser is None:
                raise ToolChoiceError(
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                    '(or use tool_choice "none", "required" or a named function)', "tool_choice")
            return cls(get_tool_parser(config.tool_call_parser, functions), None)
        if choice == "required":
            schema = required_schema(functions, parallel_tool_calls is not False)
            return cls(RequiredToolParser(), StructuredOutputsParams(json=schema))
        assert isinstance(choice, dict)
        function = next((f for f in functions if f["name"] == choice["name"]), None)
        if function is None:
            raise ToolChoiceError(f"tool_choice names {choice['name']!r}, which is not among the tools", "tool_choice")
        return cls(NamedToolParser(function["name"]), StructuredOutputsParams(json=named_schema(function)))

    def stream(self) -> ToolStreamState:
        """A fresh state for one streamed choice."""
        return ToolStreamState(self.parser)

    def result(self, text: str) -> ToolCallResult:
        parsed = self.parser.parse(text, final=True)
        content: str | None = parsed.content
        if parsed.calls and not parsed.content.strip():
            content = None
        return ToolCallResult(content, [(tool_call_id(), c) for c in parsed.calls])


def finish_reason_with_calls(finish_reason: str | None, made_calls: bool) -> str | None:
    """``"tool_calls"`` for a choice that stopped after making calls; ``"length"`` stays (a
    call cut short is worth knowing about)."""
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason
