"""Several models behind one server (``pagedllm serve --models-dir DIR`` or ``--models
NAME=PATH ...``), as llama-server's router mode: the router starts a ``pagedllm serve`` child
for a model on the first request naming it, proxies the request to it, and stops children
least recently used when ``--models-max`` are loaded, or idle past ``--idle-unload-seconds``.

- Each child runs on 127.0.0.1 on a port of its own, with the router's other flags (engine
  flags apply to every model) and ``--served-model-name NAME``.
- A request for a model still loading waits for it; at most ``--models-max-queued`` requests
  wait for loads at once (beyond: a 503). A model that fails to load answers a 503 naming why,
  and is tried again on the next request.
- When ``--models-max`` models are loaded and another is asked for, the least recently used
  loaded model with no request in flight is stopped first; if every loaded model is busy, the
  request waits (in the same bounded queue) until one is free.
- ``GET /v1/models`` lists every available model with its ``status`` (``unloaded``,
  ``loading``, ``loaded``, as llama-server) and its load time in seconds (so far, while loading).
- Errors have the server's OpenAI shape (an unknown model: 404); with ``--api-key`` the router
  asks for a key on every route but ``/health``, as the children do.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.api_server import error_response
from pagedllm.entrypoints.openai.serving_base import OpenAIError

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 600.0
HEALTH_POLL_S = 0.25
IDLE_CHECK_S = 1.0
STOP_TIMEOUT_S = 30.0
ROUTER_FLAGS = {"--models-dir": 1, "--models": "+", "--models-max": 1, "--idle-unload-seconds": 1,
                "--models-max-queued": 1, "--host": 1, "--port": 1}
"""The router's own flags and how many values each takes: not passed to the children."""


def discover_models(models_dir: str | None, entries: list[str] | None) -> dict[str, str]:
    """Model name -> path: each ``*.gguf`` file (its stem) and each directory holding a
    ``config.json`` (its name) in ``models_dir``, then each ``NAME=PATH``; ValueError naming a
    bad entry."""
    models: dict[str, str] = {}
    if models_dir is not None:
        if not os.path.isdir(models_dir):
            raise ValueError(f"--models-dir {models_dir}: no such directory")
        for name in sorted(os.listdir(models_dir)):
            path = os.path.join(models_dir, name)
            if name.endswith(".gguf") and os.path.isfile(path):
                models[name[: -len(".gguf")]] = path
            elif os.path.isfile(os.path.join(path, "config.json")):
                models[name] = path
    for entry in entries or ():
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--models {entry!r}: give NAME=PATH")
        models[name] = path
    if not models:
        raise ValueError("no model found: give --models-dir with *.gguf files or model directories, or --models NAME=PATH")
    return models


def child_argv(argv: list[str]) -> list[str]:
    """The serve command line without the router's own flags (and their values)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag = arg.split("=", 1)[0]
        if flag in ROUTER_FLAGS:
            i += 1
            if "=" in arg:
                continue
            if ROUTER_FLAGS[flag] == "+":
                while i < len(argv) and not argv[i].startswith("-"):
                    i += 1
            else:
                i += 1
            continue
        out.append(arg)
        i += 1
    return out


def _error(message: str, status: int) -> JSONResponse:
    """An error in the server's OpenAI shape (a 503 with Retry-After)."""
    kind = {401: "AuthenticationError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
        status, "BadRequestError")
    return error_response(OpenAIError(message, status, kind, retry_after_s=1 if status == 503 else None))


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM when the router dies (PR_SET_PDEATHSIG, Linux)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(eq=False)
class ModelEntry:
    name: str
    path: str
    status: str = "unloaded"
    """unloaded, loading or loaded."""
    proc: subprocess.Popen | None = None
    port: int = 0
    in_flight: int = 0
    last_used: float = 0.0
    load_seconds: float | None = None
    load_started: float = 0.0
    loading: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ModelRouter:
    def __init__(self, models: dict[str, str], child_args: list[str], models_max: int = 4,
                 idle_unload_s: float | None = None, max_queued: int = 64) -> None:
        if models_max < 1:
            raise ValueError(f"--models-max {models_max} must be >= 1")
        if idle_unload_s is not None and not idle_unload_s > 0:
            raise ValueError(f"--idle-unload-seconds {idle_unload_s} must be > 0")
        self.models = {name: ModelEntry(name, path) for name, path in models.items()}
        self.child_args = child_args
        self.models_max = models_max
        self.idle_unload_s = idle_unload_s
        self.max_queued = max_queued
        self.num_queued = 0
        self._changed = asyncio.Condition()  # a model loaded, unloaded or a request finished
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self._idle_task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.idle_unload_s is not None:
            self._idle_task = asyncio.get_running_loop().create_task(self._unload_idle())

    async def close(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
        for entry in self.models.values():
            if entry.loading is not None:
                entry.loading.cancel()
            await self._stop(entry)
        await self._http.aclose()

    # ---- loading and unloading ---------------------------------------------------------

    async def acquire(self, entry: ModelEntry) -> None:
        """Wait until ``entry`` is loaded (loading it, and stopping another first if
        ``models_max`` are loaded), then count a request in flight on it."""
        if entry.status != "loaded":
            if self.num_queued >= self.max_queued:
                raise RouterBusyError(f"{self.num_queued} requests already wait for models to load "
                                      f"(--models-max-queued {self.max_queued}); retry later")
            self.num_queued += 1
            try:
                while entry.status != "loaded":
                    if entry.loading is None:
                        if not await self._make_room(entry):
                            async with self._changed:
                                await self._changed.wait()
                            continue
                        entry.loading = asyncio.get_running_loop().create_task(self._load(entry))
                    await asyncio.shield(entry.loading)
            finally:
                self.num_queued -= 1
        entry.in_flight += 1
        entry.last_used = time.monotonic()

    async def release(self, entry: ModelEntry) -> None:
        entry.in_flight -= 1
        entry.last_used = time.monotonic()
        async with self._changed:
            self._changed.notify_all()

    async def _make_room(self, entry: ModelEntry) -> bool:
        """Stop the least recently used idle loaded model if ``models_max`` are up; False when
        every one of them is busy."""
        up = [e for e in self.models.values() if e.status in ("loaded", "loading") and e is not entry]
        if len(up) < self.models_max:
            return True
        idle = [e for e in up if e.status == "loaded" and e.in_flight == 0]
        if not idle:
            return False
        victim = min(idle, key=lambda e: e.last_used)
        logger.info("unloading model %s (least recently used) to load %s", victim.name, entry.name)
        await self._stop(victim)
        return True

    async def _load(self, entry: ModelEntry) -> None:
        """Start the child and wait until it is healthy; LoadFailedError naming why not."""
        entry.status = "loading"
        entry.port = _free_port()
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", entry.path, "--host", "127.0.0.1",
               "--port", str(entry.port), "--served-model-name", entry.name, *self.child_args]
        logger.info("loading model %s: %s", entry.name, " ".join(cmd[3:]))
        t0 = entry.load_started = time.monotonic()
        # Its own session (a Ctrl-C here stops it through the router), ended with the router.
        entry.proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_term_with_parent)
        try:
            while True:
                if entry.proc.poll() is not None:
                    raise LoadFailedError(f"model {entry.name!r} failed to load (its server exited with code "
                                          f"{entry.proc.returncode}; see the log)")
                if time.monotonic() - t0 > LOAD_TIMEOUT_S:
                    raise LoadFailedError(f"model {entry.name!r} did not load within {LOAD_TIMEOUT_S:.0f} s")
                try:
                    if (await self._http.get(entry.url + "/health", timeout=2.0)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(HEALTH_POLL_S)
        except BaseException:
            await self._stop(entry)
            raise
        finally:
            entry.loading = None
        entry.load_seconds = time.monotonic() - t0
        entry.status = "loaded"
        entry.last_used = time.monotonic()
        logger.info("model %s loaded in %.1f s (port %d)", entry.name, entry.load_seconds, entry.port)
        async with self._changed:
            self._changed.notify_all()

    async def _stop(self, entry: ModelEntry) -> None:
        proc, entry.proc = entry.proc, None
        entry.status = "unloaded"
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.get_running_loop().run_in_executor(None, proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.get_running_loop().run_in_executor(None, proc.wait)
            logger.info("model %s unloaded", entry.name)
        async with self._changed:
            self._changed.notify_all()

    async def _unload_idle(self) -> None:
        assert self.idle_unload_s is not None
        while True:
            await asyncio.sleep(IDLE_CHECK_S)
            now = time.monotonic()
            for entry in list(self.models.values()):
                if entry.status == "loaded" and entry.in_flight == 0 and now - entry.last_used > self.idle_unload_s:
                    logger.info("model %s idle for %.0f s (--idle-unload-seconds)", entry.name, now - entry.last_used)
                    await self._stop(entry)

    # ---- requests ------------------------------------------------------------------------

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error("the request body is not JSON", 400)
        name = body.get("model") if isinstance(body, dict) else None
        if name is None:
            return _error(f"give `model`: one of {', '.join(self.models)}", 400)
        entry = self.models.get(name)
        if entry is None:
            return _error(f"The model `{name}` does not exist (available: {', '.join(self.models)})", 404)
        try:
            await self.acquire(entry)
        except (RouterBusyError, LoadFailedError) as e:
            return _error(str(e), 503)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            upstream = await self._http.send(
                self._http.build_request("POST", f"{entry.url}/v1/{path}", content=await request.body(),
                                         headers=headers), stream=True)
        except httpx.HTTPError as e:
            await self.release(entry)
            return _error(f"model {name!r}: its server did not answer ({type(e).__name__})", 503)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(entry, upstream), status_code=upstream.status_code,
                                     media_type="text/event-stream")
        try:
            content = await upstream.aread()
        finally:
            await upstream.aclose()
            await self.release(entry)
        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"))

    async def _relay(self, entry: ModelEntry, upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await self.release(entry)

    def list_models(self) -> dict[str, Any]:
        data = []
        for entry in self.models.values():
            item: dict[str, Any] = {"id": entry.name, "object": "model", "owned_by": "pagedllm", "created": 0,
                                    "path": entry.path, "status": {"value": entry.status}}
            if entry.status == "loaded":
                item["status"]["load_seconds"] = round(entry.load_seconds or 0.0, 2)
            elif entry.status == "loading":  # progress: how long it has been loading
                item["status"]["loading_seconds"] = round(time.monotonic() - entry.load_started, 2)
            data.append(item)
        return {"object": "list", "data": data}


class RouterBusyError(RuntimeError):
    """Too many requests already wait for models to load."""


class LoadFailedError(RuntimeError):
    """A model's server did not come up."""


def build_router_app(router: ModelRouter, api_keys: tuple[str, ...] = ()) -> FastAPI:
    """``api_keys``: the server's (--api-key): the router asks for one on every route but
    /health, as the children do on theirs."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(lifespan=lifespan)

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        if api_keys and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not any(hmac.compare_digest(given, f"Bearer {key}") for key in api_keys):
                return _error("invalid or missing API key", 401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(router.list_models())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/{path:path}")
    async def forward(path: str, request: Request) -> Response:
        return await router.handle(path, request)

    return app


class _RouterServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the SIGTERM it handled once its shutdown (the children stopped)
        # is over: exit 0 instead, as the single-model server does.
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def run_model_router(models: dict[str, str], child_args: list[str], host: str, port: int, models_max: int,
                     idle_unload_s: float | None, max_queued: int, log_level: str = "info",
                     api_keys: tuple[str, ...] = ()) -> None:
    async def main() -> None:
        router = ModelRouter(models, child_args, models_max, idle_unload_s, max_queued)
        logger.info("router mode: %d model(s) available (%s), at most %d loaded", len(models),
                    ", ".join(models), models_max)
        config = uvicorn.Config(build_router_app(router, api_keys), host=host, port=port, log_level=log_level)
        await _RouterServer(config).serve()

    asyncio.run(main())
