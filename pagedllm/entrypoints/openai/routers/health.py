"""``/health``, ``/ping``, ``/version`` (open without an API key) and ``/metrics`` (behind the key
unless --metrics-public)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagedllm
from pagedllm.entrypoints.openai.routers.state import ServerState, server_state

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(server_state)) -> Response:
    """200 once the model is loaded, 503 before that, once shutdown begins, and once a
    background thread the engine needs died (the KV-transfer threads)."""
    if state.engine.ready and not state.engine.shutting_down and getattr(state.engine, "unhealthy", None) is None:
        return Response(status_code=200)
    return Response(status_code=503)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(state: ServerState = Depends(server_state)) -> Response:
    """vLLM's /ping (SageMaker's health check): /health's answer."""
    return await health(state)


@router.get("/version")
async def version() -> dict:
    return {"version": pagedllm.__version__}


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    return Response(state.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)
