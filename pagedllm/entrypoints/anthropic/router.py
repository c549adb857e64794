"""``/v1/messages`` and ``/v1/messages/count_tokens``; every error in Anthropic's shape.

The body is validated here rather than by FastAPI, so that a malformed request is answered
in Anthropic's error shape too (the app's handlers answer in OpenAI's).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from pagedllm.engine.async_llm import EngineNotReadyError, RequestFaultError
from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, error_body, error_type
from pagedllm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagedllm.entrypoints.openai.routers.completions import respond, until_disconnected
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state
from pagedllm.entrypoints.openai.serving_base import OpenAIError, bad_request, engine_error

M = TypeVar("M", bound=BaseModel)
router = APIRouter()


def error_response(err: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(error_body(error_type(err.status), err.message), status_code=err.status, headers=headers)


async def _body(request: Request, model: type[M]) -> M:
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        parts = [f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:3]]
        raise bad_request("invalid request: " + "; ".join(parts)) from None


async def _answer(work: Callable[[], Awaitable[Any]]) -> Response:
    try:
        return await work()
    except OpenAIError as e:
        return error_response(e)
    except (EngineNotReadyError, RequestFaultError) as e:
        return error_response(engine_error(e))


@router.post("/v1/messages")
async def create_message(request: Request, state: ServerState = Depends(server_state)) -> Response:
    async def work() -> Response:
        body = await _body(request, MessagesRequest)
        lora = state.resolve_model(body.model)
        state.check_ready()
        return respond(await until_disconnected(request, AnthropicServingMessages(state.chat).create(body, lora)))

    return await _answer(work)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, state: ServerState = Depends(server_state)) -> Response:
    async def work() -> Response:
        body = await _body(request, CountTokensRequest)
        state.resolve_model(body.model)
        state.check_ready()
        return JSONResponse(await AnthropicServingMessages(state.chat).count_tokens(body))

    return await _answer(work)
