"""Sampling defaults from the checkpoint, as vLLM's --generation-config.

``auto`` (the default) reads the checkpoint's ``generation_config.json`` (a GGUF file: its
``general.sampling.*`` keys); ``vllm`` uses none (the neutral defaults: temperature 1, top_p 1,
...); a directory reads the ``generation_config.json`` in it. ``--override-generation-config``
is laid over the result. A request's own values always win over these defaults; they fill
only the fields a request leaves out (the server's sampling_params_from, LLM's
get_default_sampling_params).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
"""The SamplingParams fields a generation config may set (vLLM's list)."""

_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""generation_config.json key -> SamplingParams field."""

_GGUF_PREFIX = "general.sampling."
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
"""GGUF keys (gguf 0.19's Keys.General.SAMPLING_*) with a SamplingParams counterpart; the
others (penalty_last_n, mirostat, xtc, sequence) have none and are logged as unused."""


def _from_hf_dir(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        raw = json.load(f)
    return {field: raw[key] for key, field in _HF_KEYS.items() if raw.get(key) is not None}


_GGUF_CACHE_FILE = "gguf_sampling_keys.json"


def _from_gguf(gguf_path: str, cache_dir: str) -> dict[str, Any]:
    """The GGUF's sampling keys; kept in `cache_dir` (the file's converted directory, which
    is per file version), since scanning the header past the vocabulary takes ~0.2 s."""
    from pagedllm.models.gguf_metadata import read_scalar_keys

    cache = os.path.join(cache_dir, _GGUF_CACHE_FILE)
    try:
        with open(cache) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        raw = read_scalar_keys(gguf_path, _GGUF_PREFIX)
        tmp = f"{cache}.tmp.{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(raw, f)
            os.replace(tmp, cache)
        except OSError:  # a read-only cache: scan again next time
            pass
    unused = sorted(set(raw) - set(_GGUF_KEYS))
    if unused:
        logger.info("GGUF sampling keys without a pagedllm counterpart, unused: %s", ", ".join(unused))
    return {field: raw[key] for key, field in _GGUF_KEYS.items() if key in raw}


def _normalise(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Keep the known fields; check they make valid SamplingParams (ValueError naming source)."""
    unknown = sorted(set(values) - set(GENERATION_DEFAULT_FIELDS) - {"max_new_tokens"})
    if unknown:
        raise ValueError(
            f"{source}: unknown generation default(s) {', '.join(unknown)}; known: "
            f"{', '.join(GENERATION_DEFAULT_FIELDS)}"
        )
    out = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in values.items()}
    if out.get("top_k") is not None and out["top_k"] <= 0:
        del out["top_k"]  # 0 / -1: no top-k (as SamplingParams reads them)
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: the generation defaults {out} are not valid sampling parameters: {e}") from None
    return out


def resolve_generation_defaults(
    generation_config: str, override: dict[str, Any] | None, model_dir: str, gguf_path: str | None
) -> dict[str, Any]:
    """The sampling defaults (SamplingParams field -> value), logged once at start-up."""
    if generation_config == "vllm":
        values: dict[str, Any] = {}
        source = "vllm (none from the checkpoint)"
    elif generation_config == "auto":
        values = _from_gguf(gguf_path, model_dir) if gguf_path is not None else _from_hf_dir(model_dir)
        source = f"the checkpoint ({gguf_path or os.path.join(model_dir, 'generation_config.json')})"
    else:
        values = _from_hf_dir(generation_config)
        source = os.path.join(generation_config, "generation_config.json")
    defaults = _normalise(values, f"--generation-config {generation_config}")
    if override:
        defaults.update(_normalise(dict(override), "--override-generation-config"))
    if defaults:
        logger.info("sampling defaults from %s%s: %s (a request's own values override them)", source,
                    " and --override-generation-config" if override else "",
                    ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    else:
        logger.info("no sampling defaults from %s", source)
    return defaults
