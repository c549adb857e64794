"""The one place where settings are checked against each other (each sub-config checks its own
fields in ``__post_init__``): the platform's refusals and defaults, the attention backend
against the KV layout, the KV backend's, LoRA's and tensor parallelism's refusals. Runs once,
from ``EngineArgs.create_engine_config``, before anything loads. No torch at import."""

from __future__ import annotations

import os

from pagedllm.config import EngineConfig
from pagedllm.kv_backends import get_kv_backend
from pagedllm.platforms.registry import get_platform
from pagedllm.reasoning import get_reasoning_parser


def check_engine_config(config: EngineConfig) -> EngineConfig:
    """``config`` with the platform's defaults filled in; ValueError naming the first setting
    that cannot run (or cannot run with another)."""
    _check_sampling(config)
    if config.structured_output_config.reasoning_parser is not None:
        get_reasoning_parser(config.structured_output_config.reasoning_parser)  # ValueError naming the choices
    _check_attention(config)
    platform = get_platform(config.device_config.device)
    config = platform.check_and_update_config(config)
    get_kv_backend(config.cache_config.kv_cache_backend).check_config(config, platform)
    check_parallel_support(config)
    check_data_parallel_support(config)
    check_lora_support(config)
    return config


def _check_sampling(config: EngineConfig) -> None:
    generation_config = config.sampling_config.generation_config
    if generation_config not in ("auto", "vllm") and not os.path.isdir(generation_config):
        raise ValueError(
            f"generation_config={generation_config!r} is not auto, vllm or a directory holding a "
            "generation_config.json"
        )


def _check_attention(config: EngineConfig) -> None:
    """The attention backend against the KV layout it reads."""
    backend = config.attention_config.backend
    cache = config.cache_config
    if backend == "triton" and cache.kv_cache_backend != "paged":
        raise ValueError(
            f"attention_backend='triton' reads the paged block-table layout; "
            f"kv_cache_backend={cache.kv_cache_backend!r} needs attention_backend 'torch' or 'reference'"
        )
    if cache.kv_cache_dtype != "auto" and backend == "triton":
        raise ValueError(
            f"kv_cache_dtype={cache.kv_cache_dtype!r} (8-bit KV codes with per-row scales) is read "
            "by the CPU kernels only; attention_backend='triton' (and device='cuda') reads a "
            "float cache: use --kv-cache-dtype auto there, or device='cpu' with the 'torch' "
            "attention backend"
        )


def check_parallel_support(config: EngineConfig) -> None:
    """Features that do not run across ranks yet (a KV backend refuses tensor parallelism
    itself, ``KVBackend.check_config``)."""
    size = config.parallel_config.tensor_parallel_size
    if size == 1:
        return
    refusals = {
        "speculative_config": config.speculative_config is not None,
        "kv_transfer_config": config.kv_transfer_config is not None,
        "hf_overrides": config.load_config.hf_overrides is not None,
    }
    for what, refused in refusals.items():
        if refused:
            raise ValueError(
                f"tensor_parallel_size={size} does not support {what} yet; use "
                "--tensor-parallel-size 1 for it"
            )
    activations = config.quantization_config.matmul_activations
    if activations not in ("auto", "float32"):
        raise ValueError(f"--matmul-activations {activations} runs in one process only (--tensor-parallel-size 1)")


def check_data_parallel_support(config: EngineConfig) -> None:
    """Settings data-parallel replicas do not run with (ValueError naming it)."""
    dp = config.parallel_config.data_parallel_size
    if dp > 1 and config.kv_transfer_config is not None:
        raise ValueError(f"data_parallel_size={dp} does not run with kv_transfer_config (disaggregated "
                         "prefill): run one prefill and one decode server per replica")


def check_lora_support(config: EngineConfig) -> None:
    """ValueError naming the first setting LoRA adapters do not run with (docs/lora.md)."""
    if config.lora_config is None:
        return
    refusals = {
        "tensor parallelism (--tensor-parallel-size > 1)": config.parallel_config.tensor_parallel_size > 1,
        "disaggregated prefill (--kv-transfer-config)": config.kv_transfer_config is not None,
    }
    for what, refused in refusals.items():
        if refused:
            raise ValueError(f"--enable-lora does not run with {what}; see docs/lora.md")
