"""The `pagedllm` command: serve, generate, chat-demo, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig
from pagedllm.engine.arg_utils import DEFAULT_MODEL, EngineArgs
from pagedllm.entrypoints.vllm_flags import (
    add_vllm_compat_args,
    api_keys_from,
    check_vllm_compat_args,
    kv_cache_bytes_from_env,
    runtime_lora_updating_from_env,
    server_dev_mode_from_env,
)

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.api_server import ServerConfig
    from pagedllm.entrypoints.openai.tool_parsers.handler import ToolCallConfig

logger = logging.getLogger(__name__)


class StartupError(SystemExit):
    """A user error found at start-up: main() prints its one line and exits with status 2
    (argparse's), never a traceback."""


DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences what a KV cache is in a language model.",
    "Write a haiku about the sea.",
]


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None,
        help="in this order: a local path (.gguf file or HF directory), a packaged model name "
        f"(default {DEFAULT_MODEL}), or a Hugging Face hub id such as Qwen/Qwen3-0.6B",
    )
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="the model, as vLLM's --model (instead of the positional argument)")
    EngineArgs.add_cli_args(parser)
    add_vllm_compat_args(parser)


def _engine_args(args: argparse.Namespace, command: str) -> EngineArgs:
    """EngineArgs from the command line and vLLM's environment; a flag this engine cannot
    honour, or a bad value, stops here (before anything loads) with the reason."""
    try:
        args.model = _model_from(args)
        for warning in check_vllm_compat_args(args):
            logger.warning(warning)
        args.kv_cache_memory_bytes = kv_cache_bytes_from_env(os.environ, args.kv_cache_memory_bytes)
        if getattr(args, "lora_modules", None) and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        engine_args = EngineArgs.from_cli_args(args)
        engine_args.usage_context = "serve" if command == "serve" else "offline"
        return engine_args
    except ValueError as e:
        raise StartupError(f"pagedllm {command}: {e}") from None


def _model_from(args: argparse.Namespace) -> str:
    """The positional model or --model (vLLM accepts both); the default model if neither."""
    option = getattr(args, "model_option", None)
    if option is not None and args.model is not None and option != args.model:
        raise ValueError(f"the model is given twice: {args.model!r} and --model {option!r}; give one")
    return option or args.model or DEFAULT_MODEL


def _check_model_source(engine_args: EngineArgs, command: str) -> None:
    """A model that cannot be found stops the start here, in one line (before the core spawns)."""
    from pagedllm.models.sources import check_source

    try:
        check_source(engine_args.model, engine_args.revision, engine_args.download_dir)
    except ValueError as e:
        raise StartupError(f"pagedllm {command}: {e}") from None


def _engine_config(args: argparse.Namespace, command: str) -> tuple[EngineArgs, EngineConfig]:
    """The arguments and their one validated configuration (created here, once); a bad
    value or combination stops the command before anything loads."""
    engine_args = _engine_args(args, command)
    try:
        return engine_args, engine_args.create_engine_config()
    except ValueError as e:
        raise StartupError(f"pagedllm {command}: {e}") from None


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    engine_args, engine_config = _engine_config(args, "generate")
    _check_model_source(engine_args, "generate")
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        llm = LLM.from_engine_config(engine_config)
    except ValueError as e:  # a model that cannot load (not found, invalid, too big): one line
        raise StartupError(f"pagedllm generate: {e}") from None
    params = _sampling_params(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "finish_reason": c.finish_reason}))
        else:
            print(f"### {prompt}\n{c.text}\n[finish_reason={c.finish_reason}]\n")


def cmd_chat_demo(args: argparse.Namespace) -> None:
    """What `make run` shows: the default model answering a few chat prompts."""
    args.prompt, args.chat, args.json = DEMO_QUESTIONS, True, False
    cmd_generate(args)


def cmd_serve(args: argparse.Namespace) -> None:
    """`pagedllm serve`: the OpenAI-compatible server (engine core in its own process)."""
    if args.models_dir is not None or args.models is not None:
        _serve_models(args)
        return
    if (args.api_key is not None and not all(args.api_key)) or (
            args.admin_api_key is not None and not all(args.admin_api_key)):
        # An empty key would let every client in while the operator believes the API guarded.
        print("pagedllm serve: --api-key: an empty key is refused (it would admit every client); "
              "give a non-empty key or leave --api-key out (--admin-api-key likewise)", file=sys.stderr)
        raise SystemExit(2)
    engine_args, engine_config = _engine_config(args, "serve")
    tool_calls, allow_runtime_lora_updating = _check_serve_args(args, engine_args)
    _check_model_source(engine_args, "serve")
    # Start-up: the core loads the model on one CPU while this process imports the server
    # and the tokenizer classes (which unpickling the core's tokenizer needs) on the other:
    # a GGUF model's tokenizer is a snapshot over `tokenizers` (models/tokenizer_snapshot.py),
    # any other transformers' (seconds to import).
    from pagedllm import faults
    from pagedllm.engine.core_client import start_engine_core
    from pagedllm.models.sources import is_gguf_source

    # Data parallelism: the front end starts its replicas once it runs (engine/dp_client.py).
    dp = engine_config.parallel_config.data_parallel_size > 1
    started_core = None if dp else start_engine_core(engine_config)
    faults.configure(engine_config.observability_config.inject_fault)  # the front end's sites
    import tokenizers  # noqa: F401

    load = engine_config.load_config
    if load.tokenizer is not None or not is_gguf_source(load.model):
        from transformers import PreTrainedTokenizerFast  # noqa: F401

    from pagedllm.entrypoints.openai.api_server import run_server

    run_server(engine_args, _server_config(args, tool_calls, allow_runtime_lora_updating), started_core)


def _serve_models(args: argparse.Namespace) -> None:
    """Router mode: several models behind this server, each in a `pagedllm serve` child."""
    from pagedllm.entrypoints.model_router import child_argv, discover_models, run_model_router

    argv = list(args.argv)
    if args.model is not None or getattr(args, "model_option", None) is not None:
        raise StartupError("pagedllm serve: give the models with --models-dir or --models, not a model argument")
    try:
        models = discover_models(args.models_dir, args.models)
    except ValueError as e:
        raise StartupError(f"pagedllm serve: {e}") from None
    run_model_router(models, child_argv(argv[argv.index("serve") + 1:]), args.host, args.port, args.models_max,
                     args.idle_unload_seconds, args.models_max_queued, args.uvicorn_log_level,
                     api_keys_from(args.api_key, os.environ))


def _check_serve_args(args: argparse.Namespace, engine_args: EngineArgs) -> tuple[ToolCallConfig, bool]:
    """(tool-call configuration, runtime LoRA updating allowed), checked before the model
    loads, every --lora-modules adapter's files included; SystemExit naming what is wrong."""
    from pagedllm.entrypoints.openai.tool_parsers.handler import ToolCallConfig

    try:
        tool_calls = ToolCallConfig(args.enable_auto_tool_choice, args.tool_call_parser)
        if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
        for name, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path}: no such file")
        allow_runtime_lora_updating = runtime_lora_updating_from_env(os.environ)
        if allow_runtime_lora_updating and not engine_args.enable_lora:
            raise ValueError("VLLM_ALLOW_RUNTIME_LORA_UPDATING needs --enable-lora")
        from pagedllm.lora.registry import LoRARegistry

        check = LoRARegistry(engine_args.max_lora_rank)  # every adapter's files, before loading the model
        for module in args.lora_modules or ():
            check.add(module["name"], module["path"])
    except ValueError as e:
        raise StartupError(f"pagedllm serve: {e}") from None
    return tool_calls, allow_runtime_lora_updating


def _server_config(
    args: argparse.Namespace, tool_calls: ToolCallConfig, allow_runtime_lora_updating: bool
) -> ServerConfig:
    """The HTTP front end's settings (api_server.ServerConfig) from the serve flags."""
    from pagedllm.config import parse_bytes
    from pagedllm.engine.async_llm import STALLED_STREAM_ABORT_TIMEOUT_S, STALLED_STREAM_TIMEOUT_S
    from pagedllm.entrypoints.openai.api_server import ServerConfig, load_chat_template

    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        api_keys=api_keys_from(args.api_key, os.environ),
        chat_template=load_chat_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        request_chat_template_timeout_s=args.request_chat_template_timeout,
        tool_calls=tool_calls,
        uvicorn_log_level=args.uvicorn_log_level,
        max_waiting_requests=args.max_waiting_requests,
        request_timeout_s=args.request_timeout,
        stalled_stream_timeout_s=_seconds_or_off(args.stalled_stream_timeout, STALLED_STREAM_TIMEOUT_S),
        stalled_stream_abort_timeout_s=_seconds_or_off(args.stalled_stream_abort_timeout,
                                                       STALLED_STREAM_ABORT_TIMEOUT_S),
        shutdown_timeout_s=args.shutdown_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        metrics_names=args.metrics_names,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        lora_modules=tuple(args.lora_modules or ()),
        allow_runtime_lora_updating=allow_runtime_lora_updating,
        metrics_public=args.metrics_public,
        admin_api_keys=tuple(args.admin_api_key or ()),
        max_request_body_bytes=parse_bytes(args.max_request_body_bytes),
        max_stored_responses=args.max_stored_responses,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        root_path=args.root_path,
        dev_mode=server_dev_mode_from_env(os.environ),
    )



def _seconds_or_off(value: float | None, default: float) -> float | None:
    """A seconds flag: unset is ``default``, 0 turns the behaviour off (None)."""
    if value is None:
        return default
    if value < 0:
        raise SystemExit(f"error: a timeout of {value:g} s: give seconds > 0, or 0 to turn it off")
    return value or None

def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.entrypoints.openai.tool_parsers import tool_parser_names

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API", allow_abbrev=False)
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key file (with --ssl-certfile)")
    serve.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate file (with --ssl-keyfile)")
    serve.add_argument("--root-path", default=None,
                       help="the path prefix a proxy serves this server under (ASGI root_path), as vLLM")
    router = serve.add_argument_group("several models (router mode, as llama-server's; docs/data_parallel.md)")
    router.add_argument("--models-dir", default=None,
                        help="serve every *.gguf file and model directory in DIR, each loaded on its first request")
    router.add_argument("--models", nargs="+", default=None, metavar="NAME=PATH",
                        help="serve these models by name, each loaded on its first request")
    router.add_argument("--models-max", type=int, default=4,
                        help="models loaded at once; the least recently used idle one is stopped for another")
    router.add_argument("--idle-unload-seconds", type=float, default=None,
                        help="stop a model idle this long (default: never)")
    router.add_argument("--models-max-queued", type=int, default=64,
                        help="requests that may wait for models to load at once (beyond: 503)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the names clients may send as `model` (the first is reported)")
    serve.add_argument("--api-key", nargs="+", default=None,
                       help="require one of these bearer tokens (or set VLLM_API_KEY / PAGEDLLM_API_KEY)")
    serve.add_argument("--max-request-body-bytes", default="32MiB",
                       help="the largest request body accepted (bytes, or with a unit: 32MiB); a longer one is a 413")
    serve.add_argument("--admin-api-key", nargs="+", default=None,
                       help="require one of these bearer tokens (not an --api-key) for adapter loading and "
                            "unloading and /reset_prefix_cache")
    serve.add_argument("--metrics-public", action="store_true",
                       help="serve /metrics without the API key (by default it needs one when --api-key is set: "
                            "its prefix-cache counters tell one client about another's prompts)")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template: a file path or the text")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="allow a chat_template in chat requests (arbitrary Jinja, rendered in a "
                            "separate process under --request-chat-template-timeout); refused otherwise")
    serve.add_argument("--request-chat-template-timeout", type=float, default=5.0,
                       help="seconds a request's chat template may take to render")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto": calls are parsed from the model\'s text (needs --tool-call-parser)')
    serve.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                       help="the model's tool-call format (docs/tool_calling.md)")
    serve.add_argument("--max-stored-responses", type=int, default=1000,
                       help="/v1/responses kept in memory for GET and previous_response_id "
                            "(least recently used evicted; 0: none)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served")
    serve.add_argument("--uvicorn-log-level", default="info")
    serve.add_argument("--max-waiting-requests", type=int, default=None,
                       help="sequences allowed to wait beyond --max-num-seqs; more get a 503 with Retry-After")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds after which an unfinished request is aborted (503 with Retry-After)")
    serve.add_argument("--stalled-stream-timeout", type=float, default=None,
                       help="seconds a stream's output may wait unread (its client stopped reading) "
                            "before the request is paused: out of the batch, KV kept, resumed when "
                            "read (default 1; 0: never paused)")
    serve.add_argument("--stalled-stream-abort-timeout", type=float, default=None,
                       help="seconds a request stays paused before it is aborted and its KV freed "
                            "(default 60; 0: never)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="on SIGTERM/SIGINT: seconds requests in flight get to finish (new ones get a "
                            "503), then the rest are aborted and the server exits; 0: abort at once")
    serve.add_argument("--timeout-keep-alive", type=float, default=30.0,
                       help="seconds an idle HTTP keep-alive connection stays open (keep it above "
                            "your clients' pool expiry, 5 s for httpx/openai)")
    serve.add_argument("--metrics-names", choices=("pagedllm", "vllm"), default="pagedllm",
                       help="names on /metrics: pagedllm:* (label model_name), or vLLM's vllm:* with "
                            "its labels (model_name, engine), for vLLM's dashboards and autoscalers")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it is queued: id, prompt tokens, parameters")
    serve.add_argument("--max-log-len", type=int, default=None,
                       help="prompt characters / ids logged per request (at DEBUG)")
    serve.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins, JSON: \'["*"]\'')
    serve.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, JSON")
    serve.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, JSON")
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log line per HTTP request")
    serve.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None,
                       help='LoRA adapters as name=path or \'{"name": ..., "path": ..., "base_model_name": ...}\' '
                            "(needs --enable-lora; `model` selects one)")
    serve.set_defaults(func=cmd_serve)


def _lora_module(text: str) -> dict:
    from pagedllm.lora.registry import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM's CORS flags take them."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as \'["*"]\', got {text!r}')
    return value


def cmd_proxy(args: argparse.Namespace) -> None:
    """`pagedllm proxy`: disaggregated prefill/decode over running `pagedllm serve` instances."""
    from pagedllm.distributed.kv_transfer.proxy import run_proxy

    run_proxy(args.prefill, args.decode, args.host, args.port, args.uvicorn_log_level, args.timeout)


def _add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    proxy = sub.add_parser("proxy", help="route requests over prefill and decode instances",
                           allow_abbrev=False)
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                       help="prefill instances (serve --kv-transfer-config with kv_producer)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL",
                       help="decode instances (serve --kv-transfer-config with kv_consumer)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--uvicorn-log-level", default="info")
    proxy.add_argument("--timeout", type=float, default=600.0, metavar="S",
                       help="seconds to wait for an instance's next bytes; a decode instance past it "
                            "is replaced by the next (before any byte is relayed) or ends the stream with an error")
    proxy.set_defaults(func=cmd_proxy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference on CPUs",
                                     allow_abbrev=False)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for prompts (args or stdin)", allow_abbrev=False)
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", "-p", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("chat-demo", help="answer a few chat prompts with the default model", allow_abbrev=False)
    _add_engine_args(demo)
    _add_sampling_args(demo)
    demo.set_defaults(func=cmd_chat_demo)

    _add_serve_parser(sub)
    _add_proxy_parser(sub)

    from pagedllm.benchmarks.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        args.func(args)
    except StartupError as e:
        print(e, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
