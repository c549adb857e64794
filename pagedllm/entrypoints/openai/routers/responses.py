"""``/v1/responses`` (OpenAI's Responses API): create, and the stored responses' GET, DELETE
and cancel (serving_responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.routers.completions import respond, until_disconnected
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses

router = APIRouter()


def serving_responses(request: Request) -> OpenAIServingResponses:
    return request.app.state.responses


@router.post("/v1/responses")
async def create_response(
    body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state),
    responses: OpenAIServingResponses = Depends(serving_responses),
) -> Response:
    lora = state.resolve_model(body.model)
    state.check_ready()
    result = await until_disconnected(request, responses.create(body, lora))
    return JSONResponse(result) if isinstance(result, dict) else respond(result)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, responses: OpenAIServingResponses = Depends(serving_responses)) -> Response:
    return JSONResponse(responses.get(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, responses: OpenAIServingResponses = Depends(serving_responses)) -> Response:
    return JSONResponse(responses.delete(response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, responses: OpenAIServingResponses = Depends(serving_responses)) -> Response:
    return JSONResponse(responses.cancel(response_id))
