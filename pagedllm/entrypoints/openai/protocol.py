"""Request and response bodies of the OpenAI API (plus vLLM's extra sampling fields).

A field we do not know is ignored with a warning in the server's log that names it, as vLLM
does (clients send fields of newer API versions). Fields we know but cannot honour are
declared, so that setting one is a 400 that names it, never silently dropped.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

logger = logging.getLogger(__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


MAX_LOGGED_NAMES = 16
MAX_LOGGED_CHARS = 64


def log_safe(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """A client-sent string fit for one log line: control characters and non-ASCII escaped
    (a newline cannot forge another line), cut to `limit` characters with a marker."""
    cut = text[:limit]
    out = cut.encode("ascii", "backslashreplace").decode("ascii")
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in out)
    return out + f"...(+{len(text) - limit} chars)" if len(text) > limit else out


class RequestModel(BaseModel):
    """A request body: unknown fields are dropped, each named in one warning."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(str(k) for k in data if k not in cls.model_fields)
            if unknown:
                names = [log_safe(k) for k in unknown[:MAX_LOGGED_NAMES]]
                if len(unknown) > MAX_LOGGED_NAMES:
                    names.append(f"(+{len(unknown) - MAX_LOGGED_NAMES} more)")
                logger.warning("%s: ignoring unknown field(s) %s", cls.__name__, ", ".join(names))
        return data


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    request_id: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's
    # older guided_* fields (accepted and honoured, never silently ignored).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregated prefill (set by `pagedllm proxy`): {"do_remote_decode": true} to a prefill
    instance; the prefill response's kv_transfer_params to a decode instance."""
    priority: int = 0
    """With --scheduling-policy priority: lower values are scheduled first (a 400 otherwise
    unless 0, as vLLM)."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """Keep only the last k prompt tokens (-1: max_model_len), as vLLM."""
    return_token_ids: bool = False
    """Add prompt_token_ids and each choice's token_ids to the response, as vLLM."""
    # vLLM fields this engine cannot honour (a 400 when set): serving_base.UNHONOURED_FIELDS.
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    vllm_xargs: dict[str, Any] | None = None


# Token ids must be ints: a list of strings is a list of prompts, not ids.
PromptField = Union[list[int], list[list[int]], str, list[str]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS) to a text prompt."""
    max_tokens: int | None = 16
    """Left out: the generation default (--generation-config), else 16; null: the generation
    default, else all the room left."""
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None
    """vLLM's prompt embeddings: not supported (a 400)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: handed to the template

    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object (absent: the function takes none)."""
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Leave the last (assistant) message open for the model to continue."""
    add_special_tokens: bool = False
    """Add special tokens over the rendered template's (which writes its own BOS)."""
    documents: list[dict[str, str]] | None = None
    """Documents for retrieval-augmented chat templates, handed to the template."""
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    """Handed to the chat template as ``reasoning_effort`` (gpt-oss's writes "Reasoning: high"
    into its system message), under a ``chat_template_kwargs`` entry of the same name."""
    include_reasoning: bool = True
    """With a reasoning parser: return ``reasoning`` (False: drop it, as vLLM)."""
    thinking_token_budget: int | None = None
    """With a reasoning parser: the most output tokens the reasoning may take before its end
    marker is forced (vLLM's; None: the server's --reasoning-budget; -1: no limit)."""
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: "auto" with tools (needs --enable-auto-tool-choice), else "none"."""
    parallel_tool_calls: bool | None = None
    """False: at most one call (exactly one under "required" or a named function)."""
    echo: bool = False
    """vLLM's: echo the last message in the reply; not supported (a 400 when true)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """vLLM's multimodal processor arguments: no multimodal models here (a 400)."""
    # OpenAI's legacy function calling, not supported (400 when set)
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def _effort_to_template(self) -> ChatCompletionRequest:
        if self.reasoning_effort is not None:
            self.chat_template_kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
        return self


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    """Under --enable-prompt-tokens-details (as vLLM); None otherwise."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- completions -----------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one candidate at a prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[Union[dict[int, PromptLogprob], None]]
"""Per prompt token, candidate token id -> PromptLogprob (the prompt's own token and the top
k); the first entry is None (nothing precedes the first token). As vLLM returns it."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """return_token_ids: the prompt's ids (in a stream, on the choice's first chunk)."""
    token_ids: list[int] | None = None
    """return_token_ids: the choice's output ids (in a stream, the chunk's new ones)."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


# ---- chat ------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments object as JSON text."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    """With a reasoning parser: the model's thinking, apart from ``content`` (vLLM's name)."""
    reasoning_content: str | None = None
    """The same text under its older name (llama-server's; vLLM's before ``reasoning``)."""
    tool_calls: list[ToolCall] | None = None


class _OmitNone(BaseModel):
    """Serialised without its unset (None) fields, as OpenAI streams tool-call deltas."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    """A call's first delta has id, type and function.name; later ones only arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """return_token_ids: the choice's output ids."""


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    """return_token_ids: the rendered prompt's ids."""
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    """``reasoning`` again, under its older name."""
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """return_token_ids: the chunk's new output ids."""


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """return_token_ids: the prompt's ids, on the first chunk."""


# ---- models, tokenize ------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (None for the base itself)."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
