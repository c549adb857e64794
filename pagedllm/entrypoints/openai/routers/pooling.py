"""The pooling routes: ``/v1/embeddings`` (OpenAI's), ``/pooling``, ``/classify``, ``/score``
and ``/rerank`` (also ``/v1/score``, ``/v1/rerank``, ``/v2/rerank``), in vLLM's shapes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from pagedllm.entrypoints.openai.routers.completions import until_disconnected
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling

router = APIRouter()


def _serving(state: ServerState, model: str | None) -> OpenAIServingPooling:
    if state.resolve_model(model) is not None:
        from pagedllm.entrypoints.openai.serving_base import bad_request

        raise bad_request("LoRA adapters are not applied to pooling requests; name the base model", "model")
    state.check_ready()
    return OpenAIServingPooling(state.engine, state.model_names[0])


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request,
                            state: ServerState = Depends(server_state)) -> JSONResponse:
    result = await until_disconnected(request, _serving(state, body.model).embeddings(body))
    return JSONResponse(result.model_dump())


@router.post("/pooling")
async def create_pooling(body: PoolingRequest, request: Request,
                         state: ServerState = Depends(server_state)) -> JSONResponse:
    result = await until_disconnected(request, _serving(state, body.model).pooling(body))
    return JSONResponse(result.model_dump())


@router.post("/classify")
async def create_classify(body: ClassificationRequest, request: Request,
                          state: ServerState = Depends(server_state)) -> JSONResponse:
    result = await until_disconnected(request, _serving(state, body.model).classify(body))
    return JSONResponse(result.model_dump())


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request,
                       state: ServerState = Depends(server_state)) -> JSONResponse:
    result = await until_disconnected(request, _serving(state, body.model).score(body))
    return JSONResponse(result.model_dump())


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, request: Request,
                        state: ServerState = Depends(server_state)) -> JSONResponse:
    result = await until_disconnected(request, _serving(state, body.model).rerank(body))
    return JSONResponse(result.model_dump(exclude_none=True))
