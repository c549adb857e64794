"""POST /v1/chat/completions: the chat template, then one request; streaming as OpenAI does
(a role chunk, content deltas, a finish chunk, optionally a usage chunk). With a reasoning
parser each choice's text is split into reasoning (also sent as reasoning_content) and content (chat_reasoning.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from pagedllm.engine.async_llm import AsyncLLM, EngineNotReadyError, RequestFaultError, RequestStream
from pagedllm.entrypoints.openai.chat_reasoning import RequestReasoning, ServerReasoning
from pagedllm.entrypoints.openai.chat_renderer import ChatRenderer, ChatTemplateError
from pagedllm.entrypoints.openai.limits import check_list_caps
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_base import (
    SSE_DONE,
    add_requests,
    response_model_name,
    bad_request,
    engine_error,
    final_usage,
    chat_logprobs,
    check_context_length,
    check_structured_outputs,
    choice_logprob_slice,
    continuous_usage,
    final_outputs,
    merge_streams,
    prompt_logprobs_of,
    sampling_params_from,
    tokenize_bad_words,
    sse,
    truncate_prompt,
    usage_info,
)
from pagedllm.entrypoints.openai.serving_tools import (
    choice_stream,
    constrain_tool_calls,
    request_tools,
    tool_call_handler,
    delta_message,
    tool_message,
)
from pagedllm.entrypoints.openai.tool_parsers.handler import (
    ToolCallConfig,
    ToolCallHandler,
    finish_reason_with_calls,
)
from pagedllm.entrypoints.openai.tool_parsers.stream import TextStreamState, ToolStreamState
from pagedllm.engine.input_processor import PromptInputs
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.chat import extract_images, has_image_parts


def messages_to_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """Plain dicts for the template; content parts must be text or image_url (a message with
    images keeps its parts, in order, for a vision-language model's template)."""
    result = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        content = d.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind == "image_url":
                    continue
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"only text and image_url content parts are supported, got {kind!r}", "messages")
                texts.append(part["text"])
            if len(texts) == len(content):
                d["content"] = "\n".join(texts)
        result.append(d)
    return result


class ChatRun(NamedTuple):
    """A queued chat request: its id, reported model, streams and per-request parsers."""

    request_id: str
    model: str
    streams: list[RequestStream]
    prompt_token_ids: list[int]
    tools: ToolCallHandler | None
    reasoning: RequestReasoning
    num_logprobs: int | None


class OpenAIServingChat:
    def __init__(
        self, engine: AsyncLLM, model_name: str, renderer: ChatRenderer,
        tool_config: ToolCallConfig | None = None, reasoning_parser: str | None = None,
        request_logger: RequestLogger | None = None, prompt_tokens_details: bool = False,
    ) -> None:
        self.engine = engine
        self.prompt_tokens_details = prompt_tokens_details
        """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens."""
        self.model_name = model_name
        self.renderer = renderer
        self.tool_config = tool_config or ToolCallConfig()
        self.reasoning = ServerReasoning(engine, reasoning_parser)
        self.request_logger = request_logger

    async def render(
        self, req_messages: list[Any], chat_template: str | None, add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
        **options: Any,
    ):
        """(prompt text, token ids, image features or None), rendered off the event loop (see
        chat_renderer.py); image_url parts are loaded and preprocessed on worker threads.
        options: ChatRenderer.render's (continue_final_message, documents, add_special_tokens)."""
        if not req_messages:
            raise bad_request("messages must not be empty", "messages")
        messages = messages_to_dicts(req_messages)
        images = None
        if has_image_parts(messages):
            messages, images = await self._load_images(messages)
        try:
            text, ids = await self.renderer.render(
                messages, chat_template, add_generation_prompt, chat_template_kwargs, tools, **options)
        except ChatTemplateError as e:
            message = str(e)
            if message.startswith("chat_template_kwargs"):
                param = "chat_template_kwargs"
            elif message.startswith("continue_final_message"):
                param = "continue_final_message"
            else:
                param = "chat_template" if chat_template else "messages"
            raise bad_request(message, param) from None
        if images is None:
            return PromptInputs(text, ids)
        assert self.engine.input_processor is not None
        processor = self.engine.input_processor.require_images()
        try:
            ids, features = await asyncio.to_thread(
                processor.process, text, images, add_special_tokens=bool(options.get("add_special_tokens")))
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return PromptInputs(text, ids, features)

    async def _load_images(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
        """The messages with {"type": "image"} parts, and their images, loaded on a worker
        thread (decoding and any fetch stay off the event loop); a 400 naming the problem."""
        processor = self.engine.input_processor
        assert processor is not None
        try:
            images = processor.require_images()
            messages, loaded = await asyncio.to_thread(extract_images, messages, processor.media)
            images.check_count(len(loaded))
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return messages, loaded

    def _check(self, req: ChatCompletionRequest) -> int | None:
        """Reject what we do not support (the fields no endpoint honours: serving_base's
        UNHONOURED_FIELDS); return the logprobs count for SamplingParams."""
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None

    async def start(self, req: ChatCompletionRequest, lora_request: LoRARequest | None = None) -> ChatRun:
        """Check, render and queue one chat request: what /v1/chat/completions and the other
        chat-shaped APIs (anthropic/serving_messages.py) share; each shapes the outputs its way."""
        check_list_caps(req)
        num_logprobs = self._check(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params_from(req, max_tokens, num_logprobs, self.engine.generation_defaults)
        await check_structured_outputs(req, params)
        await tokenize_bad_words(self.engine, params)
        tools = tool_call_handler(req, self.tool_config)
        params = await constrain_tool_calls(tools, params)
        text, ids, mm_features = await self.render(
            req.messages, req.chat_template, req.add_generation_prompt, req.chat_template_kwargs, request_tools(req),
            continue_final_message=req.continue_final_message, documents=req.documents,
            add_special_tokens=req.add_special_tokens)
        assert self.engine.model_config is not None
        max_len = self.engine.model_config.max_model_len
        kept = truncate_prompt(ids, req.truncate_prompt_tokens, max_len)
        if mm_features and len(kept) != len(ids):
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens")
        text, ids = (text if len(kept) == len(ids) else None), kept
        check_context_length(len(ids), max_tokens, max_len)
        reasoning = self.reasoning.for_request(text, req.chat_template_kwargs, req.include_reasoning,
                                               req.thinking_token_budget)
        reasoning.apply_to(params)
        request_id = req.request_id or random_id("chatcmpl")
        model = response_model_name(self.model_name, lora_request)
        streams = add_requests(self.engine, request_id, [(text, ids)], params, req.cache_salt, req.kv_transfer_params,
                               priority=req.priority, request_logger=self.request_logger, lora_request=lora_request,
                               mm_features=mm_features)
        return ChatRun(request_id, model, streams, ids, tools, reasoning, num_logprobs)

    async def create(
        self, req: ChatCompletionRequest, lora_request: LoRARequest | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        request_id, model, streams, ids, tools, reasoning, num_logprobs = await self.start(req, lora_request)
        if req.stream:
            return self._stream(req, request_id, model, streams, ids, tools, reasoning)
        try:
            (out,) = await final_outputs(streams)
        except (EngineNotReadyError, RequestFaultError) as e:
            raise engine_error(e) from None
        choices = []
        for c in out.outputs:
            logprobs = None
            if num_logprobs is not None and c.logprobs is not None:
                logprobs = ChatChoiceLogprobs(content=chat_logprobs(c.token_ids, c.logprobs, num_logprobs, self._decode))
            split = reasoning.split(c.text)
            message, made_calls = tool_message(tools, split.content)
            message.reasoning = message.reasoning_content = split.reasoning
            choices.append(ChatChoice(
                index=c.index, message=message, logprobs=logprobs,
                finish_reason=finish_reason_with_calls(c.finish_reason, made_calls), stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None,
            ))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=final_usage([out], self.prompt_tokens_details), prompt_logprobs=prompt_logprobs_of(out),
                                      prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None,
                                      kv_transfer_params=out.kv_transfer_params)

    def _decode(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def _chunk(self, request_id: str, model: str, choice: ChatStreamChoice, usage: UsageInfo | None = None,
               prompt_token_ids: list[int] | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice], usage=usage,
                                       prompt_token_ids=prompt_token_ids))

    async def _stream(
        self, req: ChatCompletionRequest, request_id: str, model: str, streams, prompt_token_ids: list[int],
        tools: ToolCallHandler | None, reasoning: RequestReasoning,
    ) -> AsyncIterator[str]:
        # Per choice index: the reasoning split runs first on each text delta; tool parsing
        # (or plain text) runs on the content so far.
        splitters = {index: reasoning.stream() for index in range(req.n)}
        choice_states: dict[int, TextStreamState | ToolStreamState] = {}
        sent_text: dict[int, int] = {}
        content_so_far: dict[int, str] = {}
        sent_tokens: dict[int, int] = {}
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        out = None
        # Continuous usage, as vLLM: the prompt and the chunk's choice's tokens so far.
        num_prompt = len(prompt_token_ids) if continuous_usage(req) else None
        return_ids = req.return_token_ids
        try:
            for index in range(req.n):  # the role first, for every choice (with the prompt's ids)
                yield self._chunk(request_id, model, ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")),
                                  None if num_prompt is None else usage_info(num_prompt, 0),
                                  list(prompt_token_ids) if return_ids and index == 0 else None)
            async for _, out in merge_streams(streams):
                for c in out.outputs:
                    final = c.finish_reason is not None
                    part = splitters[c.index].feed(c.text[sent_text.get(c.index, 0):], final)
                    sent_text[c.index] = len(c.text)
                    content = content_so_far[c.index] = content_so_far.get(c.index, "") + part.content
                    state = choice_states.setdefault(c.index, choice_stream(tools))
                    message = delta_message(state.update(content, final=final))
                    message.reasoning = message.reasoning_content = part.reasoning or None
                    finish_reason = finish_reason_with_calls(c.finish_reason, state.made_calls)
                    start = sent_tokens.get(c.index, 0)
                    if (message.content is None and message.tool_calls is None and message.reasoning is None
                            and finish_reason is None and not (return_ids and len(c.token_ids) > start)):
                        continue  # nothing settled yet (a marker may be arriving)
                    logprobs = None
                    if num_logprobs is not None and c.logprobs is not None:
                        ids, lps = choice_logprob_slice(c, sent_tokens.get(c.index, 0))
                        logprobs = ChatChoiceLogprobs(content=chat_logprobs(ids, lps, num_logprobs, self._decode))
                    sent_tokens[c.index] = len(c.token_ids)
                    yield self._chunk(request_id, model, ChatStreamChoice(
                        index=c.index, delta=message,
                        logprobs=logprobs, finish_reason=finish_reason, stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids[start:]) if return_ids else None,
                    ), None if num_prompt is None else usage_info(num_prompt, len(c.token_ids)))
            if out is not None and req.stream_options is not None and req.stream_options.include_usage:
                usage = final_usage([out], self.prompt_tokens_details)
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[], usage=usage))
        except (EngineNotReadyError, RequestFaultError) as e:
            yield sse(engine_error(e).to_response())
        yield SSE_DONE
