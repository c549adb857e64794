"""The CUDA platform: bfloat16, the Triton attention kernels, a KV budget from
gpu_memory_utilization, and the settings it refuses (docs/gpu.md)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.platforms.interface import MemoryProfile, Platform

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


def _refusals(config: EngineConfig) -> dict[str, bool]:
    """What CUDA does not run yet -> whether ``config`` asks for it."""
    cache, quant = config.cache_config, config.quantization_config
    backend = config.attention_config.backend
    quantization = config.load_config.quantization
    return {
        f"kv_cache_dtype={cache.kv_cache_dtype!r} (the 8-bit KV kernels are CPU code)": cache.kv_cache_dtype != "auto",
        "tensor_parallel_size > 1 (--tensor-parallel-size)": config.parallel_config.tensor_parallel_size > 1,
        f"matmul_activations={quant.matmul_activations!r} (a CPU setting: cuda runs in its --dtype)":
            quant.matmul_activations not in ("auto", "float32"),
        "KV transfer (--kv-transfer-config; it reads the pool with .numpy())": config.kv_transfer_config is not None,
        "speculative decoding (--speculative-config; the rejection sampler is host-side)":
            config.speculative_config is not None,
        f"quantization={quantization!r} (the 4/8-bit kernels are CPU code; GGUF files are "
        "dequantized to the dtype at load on cuda, --quantization none)": quantization not in (None, "none"),
        f"attention_backend={backend!r} (its masks and kernels are host-side; cuda runs 'triton')":
            backend != "triton",
    }


def kv_budget_from_utilization(profile: MemoryProfile, utilization: float) -> int:
    """Bytes left for the KV pool: ``utilization * total - peak``; ValueError when none are."""
    allowed = int(profile.total_bytes * utilization)
    budget = allowed - profile.peak_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {allowed / 2**20:.0f} MiB of the device's "
            f"{profile.total_bytes / 2**20:.0f} MiB, but the weights and the profiled peak of a forward "
            f"pass take {profile.peak_bytes / 2**20:.0f} MiB, leaving nothing for the KV cache; raise "
            "--gpu-memory-utilization, or lower --max-num-batched-tokens / --max-num-seqs"
        )
    return budget


class CudaPlatform(Platform):
    device_type = "cuda"
    default_attention_backend = "triton"
    supported_dtypes = ("float32", "bfloat16")
    supports_graph_capture = True
    uses_host_memory = False

    @classmethod
    def is_available(cls) -> bool:
        # No NVIDIA driver, no CUDA device: answered without importing torch (the front end).
        if not any(os.path.exists(p) for p in _DRIVER_PATHS):
            return False
        import torch

        return torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why ``is_available`` is False, for the error naming device='cuda'."""
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        return f"torch {torch.__version__} sees no CUDA device (built with CUDA: {torch.version.cuda is not None})"

    def check_and_update_config(self, config: EngineConfig) -> EngineConfig:
        for what, refused in _refusals(config).items():
            if refused:
                raise ValueError(f"device='cuda' does not support {what} yet; see docs/gpu.md, or use device='cpu'")
        if config.device_config.cpu_isa is not None:
            config = dataclasses.replace(config, device_config=dataclasses.replace(config.device_config, cpu_isa=None))
        quant = dataclasses.replace(config.quantization_config, matmul_activations="float32")
        return dataclasses.replace(config, quantization_config=quant)

    def resolve_dtype(self, requested: str, quantized_weights: bool) -> str:
        if requested == "auto":
            logger.info("dtype=auto chose bfloat16 (device cuda)")
            return "bfloat16"
        return requested

    def kv_cache_budget(self, config: EngineConfig, measure: Callable[[], MemoryProfile]) -> int:
        """The given budget, else what gpu_memory_utilization leaves after the weights and a
        profiled forward at the step's largest shape (``measure``)."""
        given = config.cache_config.kv_cache_memory_bytes
        if given is not None:
            return given
        profile = measure()
        utilization = config.device_config.memory_utilization
        budget = kv_budget_from_utilization(profile, utilization)
        logger.info(
            "KV cache budget %.0f MiB: gpu_memory_utilization=%s of %.0f MiB, less a %.0f MiB peak",
            budget / 2**20, utilization, profile.total_bytes / 2**20, profile.peak_bytes / 2**20,
        )
        return budget

    def free_memory_bytes(self) -> int:
        import torch

        return torch.cuda.mem_get_info()[0]
