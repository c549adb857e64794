"""``/v1/completions`` and ``/v1/chat/completions``: streamed (SSE) or whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state
from pagedllm.entrypoints.openai.serving_base import OpenAIError

T = TypeVar("T")
router = APIRouter()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so aborting its requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise OpenAIError("client disconnected", 499, "ClientClosedRequest")


def respond(result: Any) -> Response:
    """An SSE stream for a streamed result, else the response model as JSON."""
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)
) -> Response:
    lora = state.resolve_model(body.model)
    state.check_ready()
    return respond(await until_disconnected(request, state.completion.create(body, lora)))


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)
) -> Response:
    lora = state.resolve_model(body.model)
    state.check_ready()
    return respond(await until_disconnected(request, state.chat.create(body, lora)))
