"""The chat server's tool-calling hooks: the request's handler, the grammar for forced
choices, and OpenAI's message and delta shapes for calls (the logic is in tool_parsers/)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.serving_base import BeamSearchRequest, bad_request
from pagedllm.entrypoints.openai.tool_parsers.handler import ToolCallConfig, ToolCallHandler, ToolChoiceError
from pagedllm.entrypoints.openai.tool_parsers.stream import StreamDelta, TextStreamState, ToolStreamState
from pagedllm.sampling_params import SamplingParams


def request_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them (OpenAI's shape, as plain dicts)."""
    return None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]


def tool_call_handler(req: ChatCompletionRequest, config: ToolCallConfig) -> ToolCallHandler | None:
    """The request's tool calling (None: plain text); a 400 for a choice it cannot have."""
    functions = None if req.tools is None else [t.function.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice
    try:
        return ToolCallHandler.for_request(
            functions, choice if isinstance(choice, str) or choice is None else {"name": choice.function.name},
            req.parallel_tool_calls, config)
    except ToolChoiceError as e:
        raise bad_request(str(e), e.param) from None


async def constrain_tool_calls(
    tools: ToolCallHandler | None, params: SamplingParams | BeamSearchRequest,
) -> SamplingParams | BeamSearchRequest:
    """Required and named choices: the grammar over the tools' schemas (a 400 if it cannot be built)."""
    if tools is None or tools.structured_outputs is None:
        return params
    if isinstance(params, BeamSearchRequest):
        raise bad_request("a required or named tool_choice cannot be combined with beam search", "tool_choice")
    if params.structured_outputs is not None:
        raise bad_request("a required or named tool_choice already constrains the output: "
                          "leave out response_format and the structured-output fields", "tool_choice")
    from pagedllm.structured_output import validate

    try:
        params = dataclasses.replace(params, structured_outputs=tools.structured_outputs)
    except ValueError as e:  # a sampling field that structured outputs refuse (min_tokens)
        raise bad_request(str(e), "tool_choice") from None
    try:
        await asyncio.to_thread(validate, tools.structured_outputs)
    except ValueError as e:
        raise bad_request(f"the tools' parameter schemas: {e}", "tools") from None
    return params


def tool_message(tools: ToolCallHandler | None, text: str | None) -> tuple[ChatResponseMessage, bool]:
    """A finished choice's message, and whether it made calls. ``text`` is the content after
    any reasoning (None: the reasoning never ended, so there is no content to parse)."""
    if tools is None or text is None:
        return ChatResponseMessage(content=text), False
    result = tools.result(text)
    calls = [ToolCall(id=i, function=FunctionCall(name=c.name, arguments=c.arguments)) for i, c in result.tool_calls]
    return ChatResponseMessage(content=result.content, tool_calls=calls or None), bool(calls)


def choice_stream(tools: ToolCallHandler | None) -> TextStreamState | ToolStreamState:
    """A streamed choice's state: ``update(text so far, final)`` gives its next delta."""
    return TextStreamState() if tools is None else tools.stream()


def delta_message(delta: StreamDelta) -> DeltaMessage:
    calls = [
        DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                      function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
        for d in delta.tool_calls
    ]
    return DeltaMessage(content=delta.content or None, tool_calls=calls or None)
