"""vLLM's command-line flags that mean nothing here, or name a feature this engine lacks, and
vLLM's environment variables: so a vLLM launch line runs with the command name changed.

A flag in NO_OP_FLAGS is accepted with a one-line warning saying why it changes nothing; a
flag in MISSING_FEATURE_FLAGS is accepted only at the value that asks for nothing (e.g.
``-pp 1``) and otherwise stops the start with an error naming what
is missing. Flags vLLM has that are neither here nor elsewhere in the parser are argparse's
"unrecognized arguments" error. docs/vllm_compatibility.md lists them all.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config import parse_bytes

logger = logging.getLogger(__name__)

_DEST_PREFIX = "vllm_compat_"


@dataclass(frozen=True)
class CompatFlag:
    flags: tuple[str, ...]
    """The option strings, as vLLM spells them."""
    reason: str
    """No-op: why it changes nothing here. Missing feature: what this engine lacks."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """argparse arguments (the default is always None: "not given")."""
    harmless: Callable[[Any], bool] = lambda value: True
    """Values that change nothing: a no-op flag at another value, or a missing-feature flag
    at one of these, is refused / accepted silently respectively."""

    @property
    def dest(self) -> str:
        return _DEST_PREFIX + self.flags[0].lstrip("-").replace("-", "_").replace(".", "_")


def _store_true(*flags: str, reason: str) -> CompatFlag:
    return CompatFlag(flags, reason, {"action": "store_true"})


def _missing_switch(*flags: str, reason: str) -> CompatFlag:
    return CompatFlag(flags, reason, {"action": "store_true"}, harmless=lambda value: False)


def _one_of(*values: str) -> Callable[[Any], bool]:
    return lambda value: value in values


_XGRAMMAR = "structured outputs always run on xgrammar"
_XGRAMMAR_NAMES = ("auto", "xgrammar")


def _backend_only(value: str) -> bool:
    """vLLM's --structured-outputs-config as JSON: harmless when it names xgrammar (or auto) only."""
    try:
        config = json.loads(value)
    except json.JSONDecodeError:
        return False
    return isinstance(config, dict) and set(config) <= {"backend"} and config.get("backend", "auto") in _XGRAMMAR_NAMES


NO_OP_FLAGS: tuple[CompatFlag, ...] = (
    CompatFlag(("--enable-chunked-prefill",), "chunked prefill is always on here",
               {"action": argparse.BooleanOptionalAction}, harmless=bool),
    _store_true("--trust-remote-code",
                reason="pagedllm runs its own model implementations; no code from the checkpoint is loaded"),
    CompatFlag(("--swap-space",), "preemption recomputes (as vLLM V1): there is no CPU swap space",
               {"type": float}),
    CompatFlag(("--load-format",), "the format is read from the files (safetensors or GGUF)",
               {}, harmless=_one_of("auto", "safetensors", "gguf")),
    _store_true("--enforce-eager", reason="CUDA graphs run only where --cuda-graph-sizes asks for them"),
    _store_true("--disable-custom-all-reduce", reason="tensor parallelism reduces over gloo"),
    CompatFlag(("--max-parallel-loading-workers",), "weights load in one pass per rank", {"type": int}),
    CompatFlag(("--tokenizer-mode",), "the Hugging Face fast tokenizer is always used",
               {}, harmless=_one_of("auto", "hf")),
    _store_true("--disable-log-requests",
                reason="requests are not logged unless --enable-log-requests (vLLM's default too)"),
    _store_true("--disable-frontend-multiprocessing",
                reason="the engine core always runs in its own process"),
    _store_true("--disable-cascade-attn", reason="there is no cascade attention"),
    CompatFlag(("--compilation-config", "-O"), "nothing is compiled with torch.compile or captured as graphs", {}),
    CompatFlag(("--prefix-caching-hash-algo",), "prefix blocks are hashed with sha256",
               {}, harmless=_one_of("sha256")),
    CompatFlag(("--model-impl",), "pagedllm's own model implementations are always used",
               {}, harmless=_one_of("auto", "vllm")),
    CompatFlag(("--logprobs-mode",), "logprobs are the log-softmax of the raw logits",
               {}, harmless=_one_of("raw_logprobs")),
    CompatFlag(("--hf-token",), "set HF_TOKEN instead (huggingface_hub reads it for hub downloads)", {}),
    CompatFlag(("--async-scheduling",), "the engine core schedules each step after the last one's output "
               "(the HTTP front end, tokenizing and detokenizing already run beside it)",
               {"action": argparse.BooleanOptionalAction}),
    CompatFlag(("--max-cudagraph-capture-size",), "CUDA graphs are captured for the sizes in --cuda-graph-sizes",
               {"type": int}),
    CompatFlag(("--structured-outputs-config.backend",), _XGRAMMAR, {}, harmless=_one_of(*_XGRAMMAR_NAMES)),
    CompatFlag(("--structured-outputs-config",), _XGRAMMAR, {}, harmless=_backend_only),
)

MISSING_FEATURE_FLAGS: tuple[CompatFlag, ...] = (
    CompatFlag(("--pipeline-parallel-size", "-pp"), "no pipeline parallelism (tensor parallelism: -tp)",
               {"type": int}, harmless=lambda v: v == 1),
    CompatFlag(("--api-server-count", "-asc"), "one API server process per engine",
               {"type": int}, harmless=lambda v: v == 1),
    CompatFlag(("--cpu-offload-gb",), "the weights already live in CPU memory",
               {"type": float}, harmless=lambda v: v == 0),
    _missing_switch("--enable-sleep-mode", reason="no sleep mode"),
    _missing_switch("--disable-sliding-window", reason="sliding-window layers always attend over their window"),
    CompatFlag(("--long-prefill-token-threshold",), "no separate budget for long prefills",
               {"type": int}, harmless=lambda v: v == 0),
    CompatFlag(("--max-num-partial-prefills",), "no concurrent partial prefills limit",
               {"type": int}, harmless=lambda v: v == 1),
    _missing_switch("--enable-expert-parallel", reason="no expert parallelism (tensor parallelism shards each expert)"),
    CompatFlag(("--rope-scaling",), "no RoPE scaling override (the checkpoint's config applies)", {}),
)


def add_vllm_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility", "accepted so that vLLM launch lines run")
    for flag in (*NO_OP_FLAGS, *MISSING_FEATURE_FLAGS):
        kind = "changes nothing" if flag in NO_OP_FLAGS else "unsupported"
        kwargs = dict(flag.kwargs)
        if "action" not in kwargs:
            kwargs["metavar"] = "VALUE"
        group.add_argument(*flag.flags, dest=flag.dest, default=None,
                           help=f"vLLM's; {kind} here: {flag.reason}", **kwargs)


def check_vllm_compat_args(args: argparse.Namespace) -> list[str]:
    """The warning for each no-op flag given; ValueError naming the first flag whose value
    asks for what this engine lacks."""
    warnings = []
    for flag in NO_OP_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if not flag.harmless(value):
            raise ValueError(f"{_show(flag, value)} is not supported: {flag.reason}")
        warnings.append(f"{_show(flag, value)} changes nothing here: {flag.reason}")
    for flag in MISSING_FEATURE_FLAGS:
        value = getattr(args, flag.dest, None)
        if value is not None and not flag.harmless(value):
            raise ValueError(f"{_show(flag, value)} is not supported: {flag.reason}")
    return warnings


def _show(flag: CompatFlag, value: Any) -> str:
    """The flag as given: `--enable-lora`, `--no-enable-chunked-prefill`, `--swap-space 4`."""
    name = flag.flags[0]
    if value is True:
        return name
    if value is False:
        return "--no-" + name[2:]
    if isinstance(value, list):
        return f"{name} {' '.join(map(str, value))}"
    return f"{name} {value}"


def runtime_lora_updating_from_env(environ: Mapping[str, str]) -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads it: "1" or "true" (any case) allow
    loading and unloading LoRA adapters through the API; unset or anything else does not."""
    return environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def server_dev_mode_from_env(environ: Mapping[str, str]) -> bool:
    """VLLM_SERVER_DEV_MODE as vLLM reads it: "1" serves the development routes
    (/reset_prefix_cache); unset or anything else does not."""
    return environ.get("VLLM_SERVER_DEV_MODE", "0").strip() == "1"


def kv_cache_bytes_from_env(environ: Mapping[str, str], flag_value: str | None) -> str | int | None:
    """The KV cache budget as vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE: whole GiB, 0 or
    unset meaning the default (4 GiB). Here an explicit --kv-cache-memory-bytes wins over it
    (with a warning); None: neither is set (EngineArgs' default)."""
    raw = environ.get("VLLM_CPU_KVCACHE_SPACE")
    if raw is None or raw.strip() == "":
        return flag_value
    try:
        gib = int(raw)
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={raw!r} is not a whole number of GiB") from None
    if gib < 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE={raw!r} must be >= 0 (GiB; 0: the default 4 GiB)")
    if flag_value is not None:
        logger.warning("--kv-cache-memory-bytes %s wins over VLLM_CPU_KVCACHE_SPACE=%s", flag_value, raw)
        return flag_value
    if gib == 0:
        return None
    logger.info("KV cache budget from VLLM_CPU_KVCACHE_SPACE: %d GiB", gib)
    return parse_bytes(f"{gib}GiB")


def api_keys_from(flag_keys: list[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """--api-key (one or more), else VLLM_API_KEY (as vLLM reads it), else PAGEDLLM_API_KEY."""
    if flag_keys:
        return tuple(flag_keys)
    for name in ("VLLM_API_KEY", "PAGEDLLM_API_KEY"):
        if environ.get(name):
            return (environ[name],)
    return ()
