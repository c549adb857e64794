"""`pagedllm proxy`: one OpenAI endpoint over prefill and decode instances.

Each completion or chat request goes first to a prefill instance as a one-token request with
``kv_transfer_params={"do_remote_decode": true}`` (the prefill instance then holds the
prompt's KV blocks), then, with the ``kv_transfer_params`` of that answer, to a decode
instance, which pulls the blocks, computes the rest and answers; its answer (streamed or not)
goes back to the client. Instances of each role are used round-robin.

If no prefill instance answers, the request goes to a decode instance without transfer
params and is computed there whole: clients see no error while a decode instance lives.
A client's own ``kv_transfer_params`` are dropped: only a prefill instance's reach a decode
instance.

A decode instance that fails before the first byte of its answer is relayed (unreachable,
dead mid-request, timed out, a 5xx) is replaced by the next one, which recomputes the prompt
(no transfer params: the first may have half-pulled them); the proxy releases the prefill
instance's hold itself. Once bytes are relayed a failure cannot be retried: a stream then
ends with an error event and ``[DONE]``. Every error the proxy makes has OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.distributed.kv_transfer.wire import send_release

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 5.0
_HEALTH_TIMEOUT_S = 2.0
_DONE = b"data: [DONE]\n\n"
_ERROR_TYPES = {400: "BadRequestError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
                504: "GatewayTimeoutError"}


def _error_body(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "InternalServerError"),
                      "param": None, "code": status}}


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(_error_body(message, status), status_code=status)


def _error_event(message: str, status: int) -> bytes:
    return b"data: " + json.dumps(_error_body(message, status)).encode() + b"\n\n"


class DecodeFailed(Exception):
    """A decode instance failed before any byte of its answer reached the client."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _failure(url: str, e: httpx.HTTPError) -> DecodeFailed:
    if isinstance(e, httpx.TimeoutException):
        return DecodeFailed(f"decode instance {url} timed out ({type(e).__name__})", 504)
    if isinstance(e, httpx.ConnectError):
        return DecodeFailed(f"decode instance {url} is unreachable ({e})", 503)
    return DecodeFailed(f"decode instance {url} failed mid-request ({type(e).__name__}: {e})", 502)


def _upstream_error(url: str, status: int, content: bytes) -> DecodeFailed:
    try:
        message = json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = content[:200].decode(errors="replace")
    # An overloaded instance's 503 stays a 503 (the client may retry); any other 5xx is a 502.
    return DecodeFailed(f"decode instance {url} answered {status}: {message}", 503 if status == 503 else 502)


def release_hold(ctx: zmq.Context, params: dict[str, Any]) -> None:
    """Tell the prefill instance that named ``params`` its blocks will not be pulled."""
    try:
        send_release(ctx, str(params["remote_host"]), int(params["remote_port"]), str(params["remote_transfer_id"]))
    except (KeyError, TypeError, ValueError, zmq.ZMQError) as e:  # it frees them on its hold timeout
        logger.warning("could not release prefill hold %s: %s", params.get("remote_transfer_id"), e)


class DisaggProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 release: Callable[[dict[str, Any]], None] | None = None) -> None:
        """``timeout_s``: the longest wait for an instance's next bytes; ``transport`` and
        ``release`` (send a release for a prefill's kv_transfer_params) replace the network."""
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self._next_prefill = itertools.cycle(range(len(self.prefill_urls)))
        self._next_decode = itertools.cycle(range(len(self.decode_urls)))
        self.timeout = httpx.Timeout(timeout_s, connect=min(_CONNECT_TIMEOUT_S, timeout_s))
        self.transport = transport
        self._zmq: zmq.Context | None = None
        self.release = release or self._release
        self.client: httpx.AsyncClient | None = None

    def _release(self, params: dict[str, Any]) -> None:
        if self._zmq is None:
            self._zmq = zmq.Context()
        release_hold(self._zmq, params)

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=limits, transport=self.transport)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self._zmq is not None:
            self._zmq.destroy(linger=1000)

    def _order(self, urls: list[str], counter: itertools.cycle) -> list[str]:
        """Every instance once, starting with the next in round-robin order."""
        start = next(counter)
        return urls[start:] + urls[:start]

    async def prefill(self, path: str, body: dict, headers: dict[str, str]) -> tuple[dict | None, Response | None]:
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
                if r.status_code == 200:
                    params = r.json().get("kv_transfer_params")
                    return (params if isinstance(params, dict) else None), None
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                logger.warning("prefill instance %s failed (%s); trying the next", url, e)
                continue
            if 400 <= r.status_code < 500:  # the request itself is bad: the client hears why
                return None, Response(r.content, r.status_code, media_type="application/json")
            logger.warning("prefill instance %s answered %d; trying the next", url, r.status_code)
        logger.warning("no prefill instance answered: the decode instance computes the prompt")
        return None, None

    async def handle(self, path: str, request: Request) -> Response:
        assert self.client is not None
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return _error(f"malformed JSON body: {e}", 400)
        if not isinstance(body, dict):
            return _error(f"the request body must be a JSON object, not {type(body).__name__}", 400)
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        # kv_transfer_params are the proxy's to set: a client's own never reach an instance
        # (they could point a decode instance at any host).
        body.pop("kv_transfer_params", None)
        params, error = await self.prefill(path, body, headers)
        if error is not None:
            return error
        failure = DecodeFailed("no decode instance is configured", 503)
        for url in self._order(self.decode_urls, self._next_decode):
            decode_body = {**body, "kv_transfer_params": params} if params is not None else body
            try:
                if body.get("stream"):
                    return await self._stream(url + path, decode_body, headers)
                return await self._complete(url + path, decode_body, headers)
            except DecodeFailed as e:
                failure = e
            if params is not None:  # the next instance recomputes: the prefill may let go
                self.release(params)
                params = None
            logger.warning("%s; retrying on the next decode instance", failure.message)
        return _error(f"no decode instance could serve the request: {failure.message}", failure.status)

    async def _complete(self, url: str, body: dict, headers: dict[str, str]) -> Response:
        assert self.client is not None
        try:
            r = await self.client.post(url, json=body, headers=headers)
        except httpx.HTTPError as e:
            raise _failure(url, e) from None
        if r.status_code >= 500:
            raise _upstream_error(url, r.status_code, r.content)
        return Response(r.content, r.status_code, media_type="application/json")

    async def _stream(self, url: str, body: dict, headers: dict[str, str]) -> Response:
        """Open the upstream stream and read its first event before answering, so a failure
        up to then can still go to another instance."""
        assert self.client is not None
        try:
            upstream = await self.client.send(self.client.build_request("POST", url, json=body, headers=headers),
                                              stream=True)
        except httpx.HTTPError as e:
            raise _failure(url, e) from None
        try:
            if upstream.status_code != 200:
                content = await upstream.aread()
                if upstream.status_code >= 500:
                    raise _upstream_error(url, upstream.status_code, content)
                return Response(content, upstream.status_code, media_type="application/json")
            events = sse_events(upstream.aiter_bytes())
            first = await anext(events)
        except httpx.HTTPError as e:
            await upstream.aclose()
            raise _failure(url, e) from None
        except StopAsyncIteration:
            await upstream.aclose()
            raise DecodeFailed(f"decode instance {url} ended its stream before the first event", 502) from None
        except DecodeFailed:
            await upstream.aclose()
            raise
        return StreamingResponse(relay(first, events, upstream, url), status_code=200,
                                 media_type=upstream.headers.get("content-type", "text/event-stream"))

    async def health(self) -> Response:
        """200 if each role has an instance whose /health answers 200, else 503; the body
        names each instance's state."""
        urls = self.prefill_urls + self.decode_urls
        ok = await asyncio.gather(*(self._healthy(u) for u in urls))
        state = {"prefill": dict(zip(self.prefill_urls, ok[: len(self.prefill_urls)])),
                 "decode": dict(zip(self.decode_urls, ok[len(self.prefill_urls):]))}
        healthy = all(any(role.values()) for role in state.values())
        return JSONResponse(state, status_code=200 if healthy else 503)

    async def _healthy(self, url: str) -> bool:
        assert self.client is not None
        try:
            r = await self.client.get(url + "/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return r.status_code == 200


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole server-sent events (each ending in a blank line) from arbitrary chunks; a
    trailing partial event is dropped."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            yield event + b"\n\n"


async def relay(first: bytes, events: AsyncIterator[bytes], upstream: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The upstream's events, whole; if it breaks or ends without ``[DONE]``, an error event
    and ``[DONE]`` follow (a client disconnect just closes the upstream)."""
    seen_done = first == _DONE
    problem = f"decode instance {url} ended the stream early"
    try:
        yield first
        async for event in events:
            seen_done = seen_done or event == _DONE
            yield event
    except httpx.HTTPError as e:
        problem = str(_failure(url, e))
    finally:
        await upstream.aclose()
    if not seen_done:
        logger.warning("%s; the client gets an error event", problem)
        yield _error_event(problem, 504 if "timed out" in problem else 502)
        yield _DONE


def build_app(proxy: DisaggProxy) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        yield
        await proxy.close()

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
        return await proxy.health()

    return app


def run_proxy(prefill_urls: list[str], decode_urls: list[str], host: str, port: int, log_level: str = "info",
              timeout_s: float = 600.0) -> None:
    app = build_app(DisaggProxy(prefill_urls, decode_urls, timeout_s=timeout_s))
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", host, port, prefill_urls, decode_urls)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30)
