"""`pagedllm proxy`: one OpenAI endpoint over prefill and decode instances.

Each completion or chat request goes first to a prefill instance as a one-token request with
``kv_transfer_params={"do_remote_decode": true}`` (the prefill instance then holds the
prompt's KV blocks), then, with the ``kv_transfer_params`` of that answer, to a decode
instance, which pulls the blocks, computes the rest and answers; its answer (streamed or not)
goes back to the client unchanged. Instances of each role are used round-robin.

If no prefill instance answers, the request goes to a decode instance without transfer
params and is computed there whole: clients see no error while a decode instance lives.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

_TIMEOUT = httpx.Timeout(600.0, connect=5.0)


def _error(message: str, status: int) -> JSONResponse:
    body = {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class DisaggProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str]) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._next_prefill = itertools.cycle(range(len(self.prefill_urls)))
        self._next_decode = itertools.cycle(range(len(self.decode_urls)))
        self.client: httpx.AsyncClient | None = None

    def _order(self, urls: list[str], counter: itertools.cycle) -> list[str]:
        """Every instance once, starting with the next in round-robin order."""
        start = next(counter)
        return urls[start:] + urls[:start]

    async def prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict | None, Response | None]:
        """Run the one-token prefill. Returns (kv_transfer_params or None, an error response
        to pass on as it is, for a request the instance rejected)."""
        assert self.client is not None
        prefill_body = {**body, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        for url in self._order(self.prefill_urls, self._next_prefill):
            try:
                r = await self.client.post(url + path, json=prefill_body, headers=headers)
            except httpx.HTTPError as e:
                logger.warning("prefill instance %s failed (%s); trying the next", url, e)
                continue
            if r.status_code == 200:
                return r.json().get("kv_transfer_params"), None
            if 400 <= r.status_code < 500:  # the request itself is bad: the client hears why
                return None, Response(r.content, r.status_code, media_type="application/json")
            logger.warning("prefill instance %s answered %d; trying the next", url, r.status_code)
        logger.warning("no prefill instance answered: the decode instance computes the prompt")
        return None, None

    async def handle(self, path: str, request: Request) -> Response:
        assert self.client is not None
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        params, error = await self.prefill(path, body, headers)
        if error is not None:
            return error
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
        for url in self._order(self.decode_urls, self._next_decode):
            try:
                if body.get("stream"):
                    upstream = await self.client.send(
                        self.client.build_request("POST", url + path, json=decode_body, headers=headers),
                        stream=True,
                    )
                    return StreamingResponse(
                        _relay(upstream), status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type", "text/event-stream"),
                    )
                r = await self.client.post(url + path, json=decode_body, headers=headers)
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.ConnectError as e:
                logger.warning("decode instance %s unreachable (%s); trying the next", url, e)
        return _error("no decode instance is reachable", 503)


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()


def build_app(proxy: DisaggProxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        proxy.client = httpx.AsyncClient(timeout=_TIMEOUT, limits=limits)
        yield
        await proxy.client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        assert proxy.client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for url in proxy._order(proxy.decode_urls, proxy._next_decode):
            try:
                r = await proxy.client.get(url + "/v1/models", headers=headers)
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return _error("no decode instance is reachable", 503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def run_proxy(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, log_level: str = "info") -> None:
    app = build_app(DisaggProxy(prefill_urls, decode_urls))
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", host, port, prefill_urls, decode_urls)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
