"""Request and response bodies of Anthropic's Messages API (``/v1/messages``), as far as a
text model serves them. Unknown request fields are dropped with a warning naming them, as
on the OpenAI routes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import RequestModel


class AnthropicTool(RequestModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """A JSON schema of the tool's input object."""
    type: str | None = None
    """Anthropic's server tools (web_search, ...) have a type: refused, none run here."""


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The tool, with type "tool"."""
    disable_parallel_tool_use: bool = False


class Thinking(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(RequestModel):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    """Required, as in Anthropic's API."""
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """user_id and the like: accepted, not used."""


class Usage(BaseModel):
    input_tokens: int
    """Prompt tokens not read from the prefix cache (Anthropic's meaning: the total input is
    input_tokens + cache_read_input_tokens + cache_creation_input_tokens)."""
    output_tokens: int
    cache_read_input_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    cache_creation_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    """text, thinking and tool_use blocks, in the order the model wrote them."""
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage


def error_body(error_type: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": error_type, "message": message}}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (api_error for the rest)."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
