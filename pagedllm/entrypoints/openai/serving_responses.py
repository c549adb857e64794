"""POST /v1/responses (OpenAI's Responses API) on the chat path, and its response store.

A request becomes a chat request (responses_protocol.py) served by OpenAIServingChat: the same
template, tool parsing, reasoning split and structured outputs. Its whole answer becomes the
output items (reasoning, message, function_call); its stream of chat chunks becomes the
``response.*`` events, each with a ``sequence_number``. Stored responses (``store``, the
default) live in a bounded in-memory LRU (``--max-stored-responses``), with the conversation
that led to them, for ``previous_response_id``, GET, DELETE and cancel.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionResponse, random_id
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, output_messages, to_chat_request
from pagedllm.entrypoints.openai.serving_base import OpenAIError, bad_request
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.lora.request import LoRARequest

DEFAULT_MAX_STORED_RESPONSES = 1000


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(f"no response with id {response_id!r} (never stored, deleted or evicted)", 404,
                       "NotFoundError", "response_id")


@dataclass
class StoredResponse:
    body: dict[str, Any]
    """The response object as GET returns it."""
    conversation: list[dict[str, Any]]
    """The chat messages that led to it (instructions aside) followed by its output's."""
    task: asyncio.Task | None = None
    """While in progress: the task serving it (cancel cancels it)."""
    cancelled: bool = field(default=False)


class ResponseStore:
    """Responses by id, the least recently used evicted beyond ``max_size`` (0: none kept)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        self._items[response_id] = entry
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        entry = self._items.get(response_id)
        if entry is None:
            raise not_found(response_id)
        self._items.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        if self._items.pop(response_id, None) is None:
            raise not_found(response_id)


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """The chat usage in the Responses shape (cached tokens where the chat usage has them:
    --enable-prompt-tokens-details)."""
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _mark_abandoned(entry: StoredResponse) -> None:
    """A response left in progress because its client went away: stored as failed."""
    if entry.body["status"] == "in_progress":
        entry.body.update(status="failed", error={"code": "server_error",
                                                  "message": "the client disconnected before the response finished"})


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored_responses)

    def _skeleton(self, req: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
        """The response object before any output (status in_progress)."""
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": req.truncation or "disabled",
            "usage": None, "metadata": req.metadata or {}, "user": req.user, "background": False,
        }

    async def create(self, req: ResponsesRequest, lora_request: LoRARequest | None = None) -> dict | AsyncIterator[str]:
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous.body["status"] == "in_progress":
                raise bad_request(f"response {req.previous_response_id!r} is still in progress", "previous_response_id")
            history = previous.conversation
        chat_req = to_chat_request(req, history)
        response_id = req.request_id or random_id("resp")
        chat_req.request_id = response_id
        model = lora_request.lora_name if lora_request is not None else self.chat.model_name
        body = self._skeleton(req, response_id, model)
        conversation = chat_req.model_dump(exclude_none=True)["messages"]
        if req.instructions:
            conversation = conversation[1:]  # instructions are not carried to the next response
        entry = StoredResponse(body, conversation)
        if req.stream:
            chunks = await self.chat.create(chat_req, lora_request)
            if req.store:
                self.store.put(response_id, entry)
            return self._stream(entry, chunks)
        entry.task = asyncio.ensure_future(self.chat.create(chat_req, lora_request))
        if req.store:
            self.store.put(response_id, entry)
        try:
            result = await entry.task
        except asyncio.CancelledError:
            if not entry.cancelled:
                _mark_abandoned(entry)
                raise
            body["status"] = "cancelled"
            return body
        finally:
            entry.task = None
        assert isinstance(result, ChatCompletionResponse)
        (choice,) = result.choices
        message = choice.message
        output = []
        if message.reasoning:
            output.append(_reasoning_item(random_id("rs"), message.reasoning))
        if message.content:
            output.append(_message_item(random_id("msg"), message.content))
        for call in message.tool_calls or ():
            output.append(_call_item(random_id("fc"), call.id, call.function.name, call.function.arguments))
        self._finish(entry, output, choice.finish_reason, _usage(result.usage.model_dump()))
        return body

    def _finish(self, entry: StoredResponse, output: list[dict[str, Any]], finish_reason: str | None,
                usage: dict[str, Any] | None) -> None:
        body = entry.body
        body["output"], body["usage"] = output, usage
        if finish_reason == "length":
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        entry.conversation = [*entry.conversation, *output_messages(output)]

    async def _stream(self, entry: StoredResponse, chunks: Any) -> AsyncIterator[str]:
        try:
            async for event in self._events(entry, chunks):
                yield event
        finally:
            await chunks.aclose()  # aborts the engine request if the stream stopped early
            _mark_abandoned(entry)

    async def _events(self, entry: StoredResponse, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        events = ResponseEvents(entry.body)
        yield events.emit("response.created", response=dict(entry.body))
        yield events.emit("response.in_progress", response=dict(entry.body))
        entry.task = asyncio.current_task()
        finish_reason, usage, error = None, None, None
        try:
            async for line in chunks:
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                if chunk.get("usage") is not None and not chunk["choices"]:
                    usage = _usage(chunk["usage"])
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    for event in events.feed(delta.get("reasoning"), delta.get("content"), delta.get("tool_calls")):
                        yield event
                    finish_reason = choice.get("finish_reason") or finish_reason
        except asyncio.CancelledError:
            if not entry.cancelled:
                raise
        finally:
            entry.task = None
        for event in events.close_item():
            yield event
        if entry.cancelled:
            entry.body["status"], entry.body["output"] = "cancelled", events.output
            return
        if error is not None:
            # An invalid request found after the stream began (a 4xx) is the prompt's fault, not the server's.
            status = error.get("code")
            code = "invalid_prompt" if isinstance(status, int) and 400 <= status < 500 else "server_error"
            entry.body.update(status="failed", output=events.output,
                              error={"code": code, "message": error.get("message", "")})
            yield events.emit("response.failed", response=dict(entry.body))
            return
        self._finish(entry, events.output, finish_reason, usage)
        kind = "response.incomplete" if entry.body["status"] == "incomplete" else "response.completed"
        yield events.emit(kind, response=dict(entry.body))

    def get(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).body

    def delete(self, response_id: str) -> dict[str, Any]:
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def cancel(self, response_id: str) -> dict[str, Any]:
        """Stop a stored response still in progress (its engine request is aborted)."""
        entry = self.store.get(response_id)
        if entry.task is None:
            raise bad_request(f"response {response_id!r} is {entry.body['status']}: only one in progress can be "
                              "cancelled", "response_id")
        entry.cancelled = True
        entry.body["status"] = "cancelled"
        entry.task.cancel()
        return entry.body


class ResponseEvents:
    """Chat deltas -> ``response.*`` events: one output item open at a time (reasoning, then
    the message, then each function call), each opened and closed with its parts."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.response_id = body["id"]
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""  # its text or arguments so far
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item

    def emit(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

    def _index(self) -> int:
        return len(self.output)

    def _open_item(self, item: dict[str, Any]) -> list[str]:
        events = self.close_item()
        self._open, self._text = item, ""
        events.append(self.emit("response.output_item.added", output_index=self._index(), item=dict(item)))
        if item["type"] == "message":
            events.append(self.emit("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        elif item["type"] == "reasoning":
            events.append(self.emit("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                    content_index=0, part={"type": "reasoning_text", "text": ""}))
        return events

    def close_item(self) -> list[str]:
        item = self._open
        if item is None:
            return []
        index, text, events = self._index(), self._text, []
        if item["type"] == "message":
            done = _message_item(item["id"], text)
            events.append(self.emit("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=text, logprobs=[]))
            events.append(self.emit("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=done["content"][0]))
        elif item["type"] == "reasoning":
            done = _reasoning_item(item["id"], text)
            events.append(self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=text))
            events.append(self.emit("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=done["content"][0]))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text)
            events.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=index, name=item["name"], arguments=text))
        events.append(self.emit("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self._open = None
        return events

    def feed(self, reasoning: str | None, content: str | None, tool_calls: list[dict[str, Any]] | None) -> list[str]:
        events: list[str] = []
        if reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._open_item(_reasoning_item(random_id("rs"), "", "in_progress"))
            self._text += reasoning
            events.append(self.emit("response.reasoning_text.delta", item_id=self._open["id"],
                                    output_index=self._index(), content_index=0, delta=reasoning))
        if content:
            if self._open is None or self._open["type"] != "message":
                events += self._open_item(_message_item(random_id("msg"), "", "in_progress"))
            self._text += content
            events.append(self.emit("response.output_text.delta", item_id=self._open["id"],
                                    output_index=self._index(), content_index=0, delta=content, logprobs=[]))
        for call in tool_calls or ():
            function = call.get("function", {})
            if call["index"] not in self._calls:
                item = _call_item(random_id("fc"), call.get("id") or random_id("call"), function.get("name", ""),
                                  "", "in_progress")
                self._calls[call["index"]] = item
                events += self._open_item(item)
            arguments = function.get("arguments")
            if arguments:
                self._text += arguments
                events.append(self.emit("response.function_call_arguments.delta", item_id=self._open["id"],
                                        output_index=self._index(), delta=arguments))
        return events
