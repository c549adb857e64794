"""The CPU platform: float32 (bfloat16 where the CPU computes it natively), the compiled
kernels at the CPU's ISA level (isa.py), a KV budget of 4 GiB unless given."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.platforms.interface import MemoryProfile, Platform
from pagedllm.platforms.isa import Isa, detect_cpu_isa, read_cpu_flags, resolve_isa

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

AUTO_BF16_COPY_LIMIT_BYTES = 1 << 30
"""`--matmul-activations auto`'s bf16 keeps a bf16 copy of every weight (2 bytes a weight:
256 MiB for the default model, 14 GiB for an 8B one): past this many bytes of copies the
model runs float32 instead, so the default keeps a model near its file's size. `bf16` by name
has no limit."""

DEFAULT_KV_CACHE_BYTES = 4 << 30
"""As vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE unset)."""


class CpuPlatform(Platform):
    device_type = "cpu"
    default_attention_backend = "torch"
    supported_dtypes = ("float32", "bfloat16")
    supports_kv_quantization = True
    runs_compiled_kernels = True
    supports_weight_quantization = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def isa(self, requested: str | None = None) -> Isa:
        """The kernels' ISA level: ``requested`` where the CPU runs it, else the CPU's highest."""
        return resolve_isa(requested)

    def check_and_update_config(self, config: EngineConfig) -> EngineConfig:
        device = config.device_config
        if device.gpu_memory_utilization is not None:
            raise ValueError(
                f"gpu_memory_utilization={device.gpu_memory_utilization} (--gpu-memory-utilization) "
                "sizes the KV cache on device='cuda'; on the CPU size it with kv_cache_memory_bytes "
                "(--kv-cache-memory-bytes)"
            )
        if device.cuda_graph_sizes:
            raise ValueError(f"cuda_graph_sizes={list(device.cuda_graph_sizes)} needs device='cuda'")
        attention = config.attention_config
        if attention.backend == "triton":
            from pagedllm.kernels.triton import triton_available, triton_interpreted

            if not triton_available() or not triton_interpreted():
                raise ValueError(
                    "attention_backend='triton' runs on the CPU only under Triton's interpreter "
                    "(TRITON_INTERPRET=1 before triton's first import; tests do); use 'torch' on the CPU"
                )
        isa = self.isa(device.cpu_isa)
        quant = config.quantization_config
        if quant.matmul_activations == "auto":
            chosen = self.auto_matmul_activations(config)
            limit = AUTO_BF16_COPY_LIMIT_BYTES if chosen == "bf16" else None
            quant = dataclasses.replace(quant, matmul_activations=chosen, bf16_copy_limit_bytes=limit)
        return dataclasses.replace(
            config, device_config=dataclasses.replace(device, cpu_isa=isa), quantization_config=quant)

    def auto_matmul_activations(self, config: EngineConfig) -> str:
        """`--matmul-activations auto`: bf16 where the CPU computes bf16 natively (avx512_bf16 or
        amx_bf16 in /proc/cpuinfo: there torch's bf16 GEMM, oneDNN, runs 2-5x the float32 one
        from 16 rows up, docs/bfloat16.md); float32 elsewhere and under tensor parallelism (bf16
        copies are made in one process only). Read without torch."""
        if config.parallel_config.tensor_parallel_size > 1:
            return "float32"
        flags = read_cpu_flags()
        return "bf16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"

    def resolve_dtype(self, requested: str, quantized_weights: bool) -> str:
        if requested != "auto":
            return requested
        import torch

        # bf16 pays off only where the CPU computes it natively (AVX512-BF16 / AMX): without it
        # bf16 weights are widened to float32 per matmul (docs/bfloat16.md). Quantized weights
        # compute in float32 either way: their kernels and the fused decode take float32
        # activations (docs/benchmarks.md, 2026-12-01).
        native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        chosen = "bfloat16" if native and not quantized_weights else "float32"
        logger.info("dtype=auto chose %s (native bf16: %s, quantized weights: %s)", chosen, native, quantized_weights)
        return chosen

    def kv_cache_budget(self, config: EngineConfig, measure: Callable[[], MemoryProfile]) -> int:
        given = config.cache_config.kv_cache_memory_bytes
        return DEFAULT_KV_CACHE_BYTES if given is None else given

    def free_memory_bytes(self) -> int:
        # MemAvailable (within a cgroup's limit), as the load-time memory check reads it: free
        # pages alone leave out the page cache (a GGUF file just read), which the kernel gives back.
        from pagedllm.models.memory_check import available_memory

        available = available_memory().bytes
        return available if available is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def prepare_process(self) -> None:
        from pagedllm.malloc_policy import keep_freed_memory

        if keep_freed_memory():
            logger.debug("glibc keeps freed memory for reuse (malloc_policy.py)")

    def describe(self) -> str:
        return f"cpu (ISA levels up to {detect_cpu_isa()})"
