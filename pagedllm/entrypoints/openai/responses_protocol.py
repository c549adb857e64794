"""The request body of ``POST /v1/responses`` (OpenAI's Responses API) and its translation to
a chat request: the conversation as chat messages, flat function tools as chat tools,
``text.format`` as ``response_format``, ``reasoning.effort`` as a chat-template argument.

Responses are built as plain dicts in OpenAI's shape (serving_responses.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    RequestModel,
    StreamOptions,
)
from pagedllm.entrypoints.openai.serving_base import bad_request


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    """Keep the response for GET /v1/responses/{id} and previous_response_id (OpenAI's default)."""
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool = False
    """Not supported (a 400 when true)."""
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # vLLM's extras, as on chat
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    request_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text", "reasoning_text"):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise bad_request(f"{where}: only text content parts are supported, got {kind!r}", "input")
    return str(part.get("text", ""))


def _content_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be text or a list of text parts", "input")
    return "".join(_part_text(p, where) for p in content)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages. Consecutive function calls become one
    assistant message's tool_calls; a reasoning item rides on the next assistant message
    (as ``reasoning``, which the chat templates read)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}: role {role!r} is not one of user, assistant, system, developer", "input")
            message = {"role": "system" if role == "developer" else role,
                       "content": _content_text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise bad_request(f"{where}: a function_call item needs its name", "input")
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning"], reasoning = reasoning, None
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _content_text(output, where)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(_part_text(p, where) for p in parts) or None
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", "input")
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the chat messages that continue its conversation."""
    return input_messages([_as_input_item(item) for item in output])


def _as_input_item(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return item


def chat_tools(tools: list[dict[str, Any]] | None) -> list[ChatTool] | None:
    if not tools:
        return None
    result = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got {tool.get('type')!r}", "tools")
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}]: a function tool needs its name", "tools")
        result.append(ChatTool(function=FunctionDefinition(
            name=tool["name"], description=tool.get("description"), parameters=tool.get("parameters"),
            strict=tool.get("strict"))))
    return result


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise bad_request(f"tool_choice {choice!r} is not one of auto, none, required", "tool_choice")
        return choice
    if choice.get("type") != "function" or "name" not in choice:
        raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}',
                          "tool_choice")
    return NamedToolChoice(function=NamedFunction(name=choice["name"]))


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if "schema" not in fmt:
            raise bad_request('text.format json_schema needs {"type": "json_schema", "name": ..., "schema": {...}}',
                              "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise bad_request(f"text.format type {fmt.get('type')!r} is not one of text, json_object, json_schema", "text")


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that serves ``req``; ``history``: the previous response's conversation."""
    if req.background:
        raise bad_request("background responses are not supported", "background")
    messages = [*history, *input_messages(req.input)]
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    kwargs = dict(req.chat_template_kwargs or {})
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    try:
        return _chat_request(req, messages, kwargs)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise bad_request(f"invalid request: {where}: {first.get('msg')}", "input") from None


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        messages=messages, model=req.model, tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=response_format(req.text),
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
        chat_template_kwargs=kwargs or None, stream=req.stream, thinking_token_budget=req.thinking_token_budget,
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
        logprobs=req.top_logprobs is not None, top_logprobs=req.top_logprobs,
    )


def arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)
