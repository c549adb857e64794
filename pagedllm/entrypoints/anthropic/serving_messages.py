"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request becomes a chat request (system and content blocks to chat messages, ``tool_use``
blocks to assistant tool calls, ``tool_result`` blocks to tool messages, tools'
``input_schema`` to function parameters, ``tool_choice`` any/tool to required/named), which
OpenAIServingChat checks, renders and queues; the reasoning and tool-call parsers of the chat
path split each output, and this module writes it as content blocks (thinking, text,
tool_use) or as Anthropic's stream of events.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.async_llm import EngineNotReadyError, RequestFaultError
from pagedllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    MessagesResponse,
    Usage,
    error_body,
    error_type,
)
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, random_id
from pagedllm.entrypoints.openai.serving_base import bad_request, engine_error, final_outputs, merge_streams
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_tools import choice_stream, request_tools, tool_message
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A string, or text blocks joined; any other block is a 400."""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _unsupported_block(block, where)
        texts.append(block["text"])
    return "\n".join(texts)


def _unsupported_block(block: dict[str, Any], where: str) -> Exception:
    kind = block.get("type")
    if kind in ("image", "document"):
        return bad_request(f"{where}: {kind} blocks need a vision model; the served model reads text only", "messages")
    return bad_request(f"{where}: content block type {kind!r} is not supported here", "messages")


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "thinking":
            thinking.append(block.get("thinking", ""))
        elif kind != "redacted_thinking":  # encrypted: nothing here can read it
            raise _unsupported_block(block, where)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Tool results first (as tool messages, answering the previous turn's calls), then the text."""
    results, texts = [], []
    for block in blocks:
        kind = block.get("type")
        if kind == "tool_result":
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(content, f"{where}.tool_result")})
        elif kind == "text":
            texts.append(block.get("text", ""))
        else:
            raise _unsupported_block(block, where)
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (OpenAI's shape, which the chat templates read)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            messages.append(_assistant_message(m.content, where))
        else:
            messages.extend(_user_messages(m.content, where))
    return messages


def _tool_choice(req: CountTokensRequest) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls)."""
    choice = req.tool_choice
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice {"type": "tool"} needs the tool\'s name', "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def to_chat_request(req: CountTokensRequest, request_id: str | None = None,
                    has_reasoning_parser: bool = False) -> ChatCompletionRequest:
    """The chat request the engine runs for a Messages (or count_tokens) request;
    ``has_reasoning_parser``: the server splits reasoning out (so a thinking budget applies)."""
    for tool in req.tools or ():
        if tool.type not in (None, "custom"):
            raise bad_request(f"tool {tool.name!r}: Anthropic's server tools ({tool.type}) do not run here", "tools")
    tool_choice, parallel = _tool_choice(req)
    fields: dict[str, Any] = {
        "messages": chat_messages(req), "request_id": request_id,
        "tools": None if req.tools is None else [
            {"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}} for t in req.tools],
        "tool_choice": tool_choice, "parallel_tool_calls": parallel,
    }
    if req.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
        if req.thinking.type == "enabled" and req.thinking.budget_tokens is not None and has_reasoning_parser:
            # vLLM's per-request thinking budget (the chat path's field; see docs/anthropic.md).
            # Without a reasoning parser there is no thinking to count: the budget is moot.
            fields["thinking_token_budget"] = req.thinking.budget_tokens
    if req.messages and req.messages[-1].role == "assistant":
        # Anthropic's prefill: the reply continues the last assistant turn (and holds only
        # what follows it).
        fields.update(continue_final_message=True, add_generation_prompt=False)
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stream=req.stream)
    return ChatCompletionRequest.model_validate(fields)


def stop_reason(c: CompletionOutput, made_calls: bool) -> tuple[str | None, str | None]:
    """(Anthropic's stop_reason, the stop sequence that matched)."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return ("end_turn" if c.finish_reason is not None else None), None


def usage(out: RequestOutput, num_output: int) -> Usage:
    cached = min(out.num_cached_tokens, len(out.prompt_token_ids))
    return Usage(input_tokens=len(out.prompt_token_ids) - cached, output_tokens=num_output,
                 cache_read_input_tokens=cached)


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        logger.warning("a tool call's arguments are not JSON; sent as {}: %r", arguments[:200])
        return {}
    return value if isinstance(value, dict) else {"value": value}


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic writes them: the type on the event: line too."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


class AnthropicServingMessages:
    """The Messages API over the server's chat serving object (its template, parsers, engine)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        chat_req = to_chat_request(req)
        _, ids, _ = await self.chat.render(chat_req.messages, None, chat_req.add_generation_prompt,
                                        chat_req.chat_template_kwargs, request_tools(chat_req),
                                        continue_final_message=chat_req.continue_final_message)
        return {"input_tokens": len(ids)}

    async def create(self, req: MessagesRequest, lora_request: LoRARequest | None = None
                     ) -> MessagesResponse | AsyncIterator[str]:
        # Anthropic's ids read msg_<hex>.
        chat_req = to_chat_request(req, random_id("msg").replace("-", "_", 1), self.chat.reasoning.name is not None)
        run = await self.chat.start(chat_req, lora_request)
        if req.stream:
            return self._stream(run)
        try:
            (out,) = await final_outputs(run.streams)
        except (EngineNotReadyError, RequestFaultError) as e:
            raise engine_error(e) from None
        c = out.outputs[0]
        split = run.reasoning.split(c.text)
        message, made_calls = tool_message(run.tools, split.content)
        blocks: list[dict[str, Any]] = []
        if split.reasoning:
            blocks.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
        if message.content:
            blocks.append({"type": "text", "text": message.content})
        for call in message.tool_calls or ():
            blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                           "input": _tool_input(call.function.arguments)})
        reason, sequence = stop_reason(c, made_calls)
        return MessagesResponse(id=run.request_id, model=run.model, content=blocks, stop_reason=reason,
                                stop_sequence=sequence, usage=usage(out, len(c.token_ids)))

    async def _stream(self, run: ChatRun) -> AsyncIterator[str]:
        blocks = _BlockStream()
        splitter = run.reasoning.stream()
        state = choice_stream(run.tools)
        content, sent_text, out, started = "", 0, None, False
        try:
            async for _, out in merge_streams(run.streams):
                c = out.outputs[0]
                if not started:  # after the first output: the prefix cache's hits are known
                    started = True
                    yield event("message_start", {"message": {
                        "id": run.request_id, "type": "message", "role": "assistant", "model": run.model,
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": usage(out, 0).model_dump()}})
                    yield event("ping", {})
                final = c.finish_reason is not None
                part = splitter.feed(c.text[sent_text:], final)
                sent_text = len(c.text)
                content += part.content
                delta = state.update(content, final=final)
                for e in blocks.thinking(part.reasoning) + blocks.text(delta.content):
                    yield e
                for call in delta.tool_calls:
                    for e in blocks.tool_use(call.index, call.id, call.name, call.arguments):
                        yield e
            assert out is not None
            c = out.outputs[0]
            for e in blocks.close():
                yield e
            reason, sequence = stop_reason(c, state.made_calls)
            yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                          "usage": usage(out, len(c.token_ids)).model_dump()})
            yield event("message_stop", {})
        except (EngineNotReadyError, RequestFaultError) as e:
            err = engine_error(e)
            yield event("error", {"error": error_body(error_type(err.status), err.message)["error"]})


class _BlockStream:
    """Content blocks as events: one block open at a time; a change of kind (or a new tool
    call) closes it and starts the next, numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.call_blocks: dict[int, int] = {}  # tool call index -> block index

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return events + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": index, "delta": delta})

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.kind == "thinking" else self._start(
            "thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return events + [self._delta(self.index, {"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.kind == "text" else self._start("text", {"type": "text", "text": ""})
        return events + [self._delta(self.index, {"type": "text_delta", "text": text})]

    def tool_use(self, call_index: int, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        events = []
        if call_id is not None:  # a call's first delta
            events = self._start("tool_use", {"type": "tool_use", "id": call_id, "name": name, "input": {}})
            self.call_blocks[call_index] = self.index
        if arguments:
            events.append(self._delta(self.call_blocks[call_index], {"type": "input_json_delta",
                                                                      "partial_json": arguments}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]
