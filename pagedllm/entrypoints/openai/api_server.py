"""The OpenAI-compatible server: FastAPI routes over AsyncLLM, served by uvicorn.

The engine core runs in its own process, so the HTTP side never waits on a model step.
``/health`` answers 503 until the model is loaded and again once shutdown begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_llm import (
    STALLED_STREAM_ABORT_TIMEOUT_S,
    STALLED_STREAM_TIMEOUT_S,
    AsyncLLM,
    EngineNotReadyError,
    RequestFaultError,
)
from pagedllm.engine.core_client import StartedCore
from pagedllm.entrypoints.anthropic import router as anthropic_router
from pagedllm.entrypoints.openai.chat_renderer import ChatRenderer
from pagedllm.entrypoints.openai import dashboard
from pagedllm.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, BodyCheckMiddleware
from pagedllm.entrypoints.openai.lora_adapters import build_lora_registry, check_in_engine
from pagedllm.entrypoints.openai.request_logger import RequestLogger
from pagedllm.entrypoints.openai.routers import admin, completions, health, kv, models, pooling, responses, tokenize
from pagedllm.entrypoints.openai.routers.state import ServerState
from pagedllm.entrypoints.openai.serving_base import OpenAIError, bad_request, engine_error
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_responses import DEFAULT_MAX_STORED_RESPONSES, OpenAIServingResponses
from pagedllm.entrypoints.openai.tool_parsers.handler import ToolCallConfig

logger = logging.getLogger(__name__)

# All else needs the API key. The /dashboard page is static HTML that asks the user for the
# key and sends it with its /dashboard/state requests. /metrics is open only with
# --metrics-public (its prefix-cache counters let one client probe another's prompts).
_OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/dashboard"})
# With --admin-api-key, these need an admin key (an API key is not enough).
ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# After the drain (--shutdown-timeout) every stream has ended: uvicorn waits this long at most
# for their connections to close before cancelling what is left.
UVICORN_CLOSE_TIMEOUT_S = 5


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8000
    """Port to bind."""
    served_model_names: tuple[str, ...] = ()
    """The names clients may use in `model` (the first is the one responses and metrics
    report); default: the model argument."""
    api_keys: tuple[str, ...] = ()
    """Keys (a bearer token, or Anthropic's x-api-key header), any one of which is required on
    every path but /health, /ping, /version and the /dashboard page (its data, /dashboard/state,
    needs one); /metrics too unless metrics_public."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    """--max-request-body-bytes: a longer body is refused with a 413 before it is parsed."""
    admin_api_keys: tuple[str, ...] = ()
    """--admin-api-key: bearer tokens required on ADMIN_PATHS (adapter loading, cache reset)."""
    metrics_public: bool = False
    """--metrics-public: /metrics answers without the API key."""
    chat_template: str | None = None
    """A Jinja chat template (text) replacing the model's."""
    trust_request_chat_template: bool = False
    """Allow a `chat_template` in chat requests (arbitrary Jinja; refused with a 400 otherwise)."""
    request_chat_template_timeout_s: float = 5.0
    """A request's template rendering longer than this is stopped (a 400)."""
    tool_calls: ToolCallConfig = field(default_factory=ToolCallConfig)
    """--enable-auto-tool-choice and --tool-call-parser (docs/tool_calling.md)."""
    uvicorn_log_level: str = "info"
    """uvicorn's own log level."""
    max_waiting_requests: int | None = None
    """Sequences allowed to wait beyond max_num_seqs; more get a 503 with Retry-After (None: no bound)."""
    request_timeout_s: float | None = None
    """A request unfinished this long after arrival is aborted with a 503 (None: no limit)."""
    stalled_stream_timeout_s: float | None = STALLED_STREAM_TIMEOUT_S
    """A stream's output unread this long pauses its request (None: never)."""
    stalled_stream_abort_timeout_s: float | None = STALLED_STREAM_ABORT_TIMEOUT_S
    """A request paused this long is aborted (None: never)."""
    metrics_names: str = "pagedllm"
    """Prometheus names on /metrics: "pagedllm" (``pagedllm:`` prefix, label model_name) or
    "vllm" (``vllm:`` names with vLLM's labels, for vLLM's dashboards and autoscalers)."""
    timeout_keep_alive_s: float = 30.0
    """Seconds an idle keep-alive connection stays open. Longer than the pool expiry of common
    clients (httpx and so the openai client: 5 s) so a client never reuses a connection at the
    moment the server closes it (that race shows up as "connection reset by peer")."""
    enable_log_requests: bool = False
    """Log one line per request as it is queued (id, prompt tokens, parameters)."""
    max_log_len: int | None = None
    """With enable_log_requests at DEBUG: the most prompt characters / ids logged."""
    allowed_origins: tuple[str, ...] = ("*",)
    """CORS: origins allowed (vLLM's default: any)."""
    allowed_methods: tuple[str, ...] = ("*",)
    """CORS: methods allowed."""
    allowed_headers: tuple[str, ...] = ("*",)
    """CORS: request headers allowed."""
    allow_credentials: bool = False
    """CORS: allow credentials (cookies, authorization headers) in cross-origin requests."""
    disable_uvicorn_access_log: bool = False
    """No uvicorn access log line per HTTP request."""
    lora_modules: tuple[dict, ...] = ()
    """--lora-modules: {"name", "path", "base_model_name"?} per adapter (needs --enable-lora)."""
    allow_runtime_lora_updating: bool = False
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    enable_prompt_tokens_details: bool = False
    """Usage carries the prefix cache's share of the prompt: prompt_tokens_details.cached_tokens
    (chat, completions), input_tokens_details.cached_tokens (responses)."""
    """/v1/responses kept in memory for GET and previous_response_id (least recently used evicted; 0: none)."""
    ssl_keyfile: str | None = None
    """With ssl_certfile: serve HTTPS (uvicorn's TLS)."""
    ssl_certfile: str | None = None
    """With ssl_keyfile: the certificate (chain) file."""
    root_path: str | None = None
    """The path prefix a proxy serves this server under (ASGI root_path, --root-path)."""
    shutdown_timeout_s: float = 10.0
    """--shutdown-timeout: on SIGTERM/SIGINT, new requests get a 503 and those in flight get
    this many seconds to finish; then the rest are aborted and the server exits (0: abort at
    once)."""
    dev_mode: bool = False
    """Serve the development routes (/reset_prefix_cache), as vLLM under VLLM_SERVER_DEV_MODE=1."""


def error_response(err: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.to_response().model_dump(), status_code=err.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: {e.get('msg')}" for e in errors[:3]]
    return "invalid request: " + "; ".join(parts), param


class APIKeyMiddleware:
    """The key check (a bearer token, or Anthropic's x-api-key header) on every path but
    _OPEN_PATHS (docs and schema included), as plain ASGI (so client disconnects still reach
    the handlers, which BaseHTTPMiddleware would hide)."""

    def __init__(self, app: Any, api_keys: tuple[bytes, ...], open_paths: frozenset[str] = _OPEN_PATHS,
                 admin_keys: tuple[bytes, ...] = ()) -> None:
        self.app = app
        self.api_keys = api_keys
        self.open_paths = open_paths
        self.admin_keys = admin_keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            keys = self.admin_keys if self.admin_keys and scope["path"] in ADMIN_PATHS else self.api_keys
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"")
            # Anthropic's clients send the key as x-api-key.
            given = header[7:] if header.lower().startswith(b"bearer ") else headers.get(b"x-api-key", b"")
            # Every key is compared (no early exit), each in constant time; no keys: open.
            if keys and not sum(hmac.compare_digest(given, key) for key in keys):
                err = OpenAIError("invalid or missing API key", 401, "AuthenticationError")
                in_anthropic_shape = scope["path"].startswith("/v1/messages")
                response = anthropic_router.error_response(err) if in_anthropic_shape else error_response(err)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = _validation_message(exc)
    return error_response(bad_request(message, param))


async def _engine_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(engine_error(exc))  # not ready: a 503 with Retry-After


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "NotFoundError" if exc.status_code == 404 else "HTTPError"
    return error_response(OpenAIError(str(exc.detail), exc.status_code, kind))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error")
    return error_response(OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500, "InternalServerError"))


def add_exception_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body with its status."""
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(EngineNotReadyError, _engine_error)
    app.add_exception_handler(RequestFaultError, _engine_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


def add_middleware(app: FastAPI, config: ServerConfig) -> None:
    # Innermost: the body is read (capped) and its text checked only once the key passed.
    app.add_middleware(BodyCheckMiddleware, max_body_bytes=config.max_request_body_bytes)
    if config.api_keys or config.admin_api_keys:
        open_paths = _OPEN_PATHS | {"/metrics"} if config.metrics_public else _OPEN_PATHS
        app.add_middleware(APIKeyMiddleware, api_keys=tuple(k.encode() for k in config.api_keys),
                           open_paths=open_paths, admin_keys=tuple(k.encode() for k in config.admin_api_keys))
    # Added last, so outermost: a browser's preflight (OPTIONS, no key) is answered before
    # the key check, as in vLLM.
    app.add_middleware(
        CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers), allow_credentials=config.allow_credentials,
    )


def build_state(engine: AsyncLLM, config: ServerConfig, model_names: tuple[str, ...]) -> ServerState:
    """The serving objects the routes share."""
    model_name = model_names[0]
    request_logger = RequestLogger(config.max_log_len) if config.enable_log_requests else None
    renderer = ChatRenderer(engine, config.chat_template, config.trust_request_chat_template,
                            config.request_chat_template_timeout_s)
    return ServerState(
        engine=engine,
        model_names=model_names,
        loras=build_lora_registry(engine.args, config.lora_modules, model_names),
        completion=OpenAIServingCompletion(engine, model_name, request_logger, config.enable_prompt_tokens_details),
        chat=OpenAIServingChat(engine, model_name, renderer, config.tool_calls, engine.args.reasoning_parser,
                               request_logger, config.enable_prompt_tokens_details),
    )


def build_app(engine: AsyncLLM, config: ServerConfig, model_names: tuple[str, ...]) -> FastAPI:
    """model_names: what clients may send as `model`; the first is the one reported."""
    state = build_state(engine, config, model_names)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        lora_check = asyncio.create_task(check_in_engine(engine, state.loras))
        yield
        lora_check.cancel()
        await engine.shutdown()
        state.chat.renderer.close()

    app = FastAPI(title="pagedllm", version=pagedllm.__version__, lifespan=lifespan)
    app.state.server = state
    app.state.responses = OpenAIServingResponses(state.chat, config.max_stored_responses)
    add_middleware(app, config)
    add_exception_handlers(app)
    for router in (completions.router, responses.router, anthropic_router.router, models.router, tokenize.router,
                   health.router, dashboard.router, pooling.router, kv.router):
        app.include_router(router)
    if config.dev_mode or config.admin_api_keys:  # the admin routes: dev mode, or an admin key given
        app.include_router(admin.router)
    if state.loras is not None and config.allow_runtime_lora_updating:
        app.include_router(admin.lora_router)
    return app


class _Server(uvicorn.Server):
    """uvicorn's server with a bounded drain: the first SIGTERM/SIGINT asks for a graceful stop
    (run by ``drain_then_exit``) instead of closing the listener at once; a second one cuts
    the drain short."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine
        self.stop_requested = False  # a signal came: drain, then exit
        self.stop_now = False  # a second signal came: abort what is left now

    def handle_exit(self, sig: int, frame: Any) -> None:
        # A signal handler: only flags here; drain_then_exit acts on them on the event loop.
        self.engine.shutting_down = True  # new requests get a 503, /health too, from now on
        if not self.stop_requested and self.engine.ready:
            self._captured_signals.append(sig)
            self.stop_requested = True
            return
        self.stop_now = True
        super().handle_exit(sig, frame)

    async def drain_then_exit(self, timeout_s: float) -> None:
        while not self.stop_requested and not self.should_exit:
            await asyncio.sleep(0.05)
        if self.should_exit:
            return
        logger.info("stopping: draining requests in flight for at most %g s (--shutdown-timeout)", timeout_s)
        await self.engine.drain(timeout_s, lambda: self.stop_now)
        self.should_exit = True  # uvicorn closes the listener and the connections, then the engine

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a captured SIGTERM/SIGINT once its graceful shutdown is over, so
        # the process would die by that signal (-15). The shutdown is complete and clean
        # by then: exit 0, as service managers expect of a handled stop.
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def load_chat_template(value: str | None) -> str | None:
    """A path to a template file, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


async def serve(
    engine_args: EngineArgs, config: ServerConfig, started_core: StartedCore | None = None
) -> None:
    model_names = config.served_model_names or (engine_args.model,)
    model_name = model_names[0]
    engine = AsyncLLM(
        engine_args, model_name, config.max_waiting_requests, config.request_timeout_s, started_core,
        metrics_names=config.metrics_names, stalled_stream_timeout_s=config.stalled_stream_timeout_s,
        stalled_stream_abort_timeout_s=config.stalled_stream_abort_timeout_s,
    )
    app = build_app(engine, config, model_names)
    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
        timeout_graceful_shutdown=UVICORN_CLOSE_TIMEOUT_S, timeout_keep_alive=config.timeout_keep_alive_s,
        access_log=not config.disable_uvicorn_access_log, ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile, root_path=config.root_path or "",
    )
    server = _Server(uv_config, engine)

    async def exit_if_engine_fails() -> None:
        while engine._client is None and not server.should_exit:
            await asyncio.sleep(0.05)
        try:
            await engine.wait_ready()
        except Exception as e:  # noqa: BLE001
            logger.error("the engine failed: %s; stopping the server", e)
            server.should_exit = True
            return
        scheme = "https" if config.ssl_certfile else "http"
        logger.info("pagedllm is serving %s on %s://%s:%d%s", model_name, scheme, config.host, config.port,
                    config.root_path or "")
        logger.error("the engine core died: %s; stopping the server", await engine.wait_dead())
        server.should_exit = True

    if not config.shutdown_timeout_s >= 0:
        raise ValueError(f"--shutdown-timeout {config.shutdown_timeout_s} must be >= 0")
    watchers = [asyncio.create_task(exit_if_engine_fails()),
                asyncio.create_task(server.drain_then_exit(config.shutdown_timeout_s))]
    try:
        await server.serve()
    finally:
        for watcher in watchers:
            watcher.cancel()
    if engine.dead_error is not None:
        raise SystemExit(1)


def run_server(engine_args: EngineArgs, config: ServerConfig, started_core: StartedCore | None = None) -> None:
    """started_core: an engine core spawned early (`pagedllm serve`); else one is spawned here."""
    asyncio.run(serve(engine_args, config, started_core))
