"""EngineArgs: the user-facing engine arguments, named like vLLM's, turned into EngineConfig."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, fields

from pagedllm.config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_bytes,
)
from pagedllm.kv_backends import KV_BACKEND_NAMES, get_kv_backend
from pagedllm.reasoning import REASONING_PARSER_NAMES, get_reasoning_parser
from pagedllm.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float", "half", "float16")
"""vLLM's --dtype values; half/float16 resolve as auto (docs/bfloat16.md), float is float32."""


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    """A local path (.gguf file or HF directory), else a packaged model name, else a Hugging
    Face hub id, in that order (models/loader.py)."""
    revision: str | None = None
    """A hub id's branch, tag or commit (default: main)."""
    download_dir: str | None = None
    """The hub cache a hub id downloads into and resolves in (default: $HF_HUB_CACHE or
    huggingface_hub's ~/.cache/huggingface/hub); HF_HUB_OFFLINE=1 reads it alone."""
    dtype: str = "auto"
    """float32, bfloat16, or auto (bfloat16 where the CPU has native bf16 support); vLLM's
    half / float16 map to what auto picks (no float16 compute here), float to float32."""
    tokenizer: str | None = None
    """A tokenizer directory (or .gguf file) other than the model's own."""
    max_model_len: int | None = None
    """Longest prompt + output; default: the checkpoint's context length."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory_bytes: int | str = "4GiB"
    """KV cache pool size, an int or a string like '2GiB'."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int | None = None
    """Most tokens in one engine step (default: max(4096, max_num_seqs))."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV blocks of shared prompt prefixes (default: on where the KV backend
    supports it)."""
    kv_cache_backend: str = "paged"
    """A name in pagedllm/kv_backends/: "paged" or "vattention" (docs/kv_backends.md)."""
    vattention_hugepages: bool = False
    """vattention: back the slots with transparent huge pages (2 MiB accounting pages)."""
    vattention_deferred_reclaim: bool = True
    """vattention: keep a finished request's pages for the next request in its slot and
    release them (madvise) only when the budget needs them."""
    attention_backend: str = "torch"
    """The attention implementation: "torch" (fast) or "reference" (float64 loops, tests)."""
    seed: int = 0
    """Seed for requests without their own seed."""
    quantization: str | None = None
    """Weights: gguf (keep a GGUF file's Q4/Q8 types), int8 / int4 (quantize at load), none
    (dequantize to dtype); default: gguf for GGUF files whose types it supports, else none."""
    kv_transfer_config: str | dict | None = None
    """Disaggregated prefill: the JSON of KVTransferConfig (distributed/kv_transfer/config.py)."""
    speculative_config: dict | None = None
    """Speculative decoding as vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4}."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks (docs/tensor_parallel.md)."""
    distributed_executor_backend: str | None = None
    """uni, mp or ray; default uni for one rank, mp for more."""
    reasoning_parser: str | None = None
    """A name in pagedllm/reasoning/parsers/ (deepseek_r1, qwen3): structured outputs start
    after the reasoning's end marker, and the chat server returns ``reasoning_content``
    (docs/reasoning.md)."""

    scheduling_policy: str = "fcfs"
    """fcfs (arrival order) or priority (lower `priority` value first, ties by arrival)."""
    max_logprobs: int = MAX_LOGPROBS
    """Most logprobs (and prompt_logprobs) a request may ask for per position."""
    generation_config: str = "auto"
    """Sampling defaults: auto (the checkpoint's generation_config.json or GGUF
    general.sampling.* keys), vllm (none: vLLM's neutral defaults), or a directory holding a
    generation_config.json."""
    override_generation_config: dict | None = None
    """Sampling defaults laid over those of generation_config, e.g. {"temperature": 0.5}."""
    gpu_memory_utilization: float | None = None
    """vLLM's GPU memory share; refused on CPUs (see check_device_memory_args)."""
    disable_log_stats: bool = False
    """No periodic stats log line (the metrics are still served)."""

    def __post_init__(self) -> None:
        ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend)
        SchedulerConfig(scheduling_policy=self.scheduling_policy)  # type: ignore[arg-type]
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an integer >= 0")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"generation_config={self.generation_config!r} is not auto, vllm or a directory "
                "holding a generation_config.json"
            )
        check_device_memory_args(self.gpu_memory_utilization)
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # ValueError naming the choices

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--revision", default=None, help="a hub id's branch, tag or commit (default: main)")
        parser.add_argument(
            "--download-dir", default=None,
            help="the hub cache to download a hub id into and read it from (default: $HF_HUB_CACHE or "
            "~/.cache/huggingface/hub); with HF_HUB_OFFLINE=1 the cache alone",
        )
        parser.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES))
        parser.add_argument("--tokenizer", default=None, help="a tokenizer directory other than the model's")
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--block-size", type=int, default=16)
        # None when not given, so VLLM_CPU_KVCACHE_SPACE can apply (entrypoints/vllm_flags.py).
        parser.add_argument("--kv-cache-memory-bytes", default=None, help="KV cache budget (default 4GiB)")
        parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                            help="GPU backends only; on CPUs size the KV cache with --kv-cache-memory-bytes")
        parser.add_argument("--max-num-seqs", type=int, default=256)
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None
        )
        parser.add_argument("--kv-cache-backend", default="paged", choices=list(KV_BACKEND_NAMES))
        parser.add_argument(
            "--vattention-hugepages", action=argparse.BooleanOptionalAction, default=False
        )
        parser.add_argument(
            "--vattention-deferred-reclaim", action=argparse.BooleanOptionalAction, default=True
        )
        parser.add_argument("--attention-backend", default="torch", choices=["torch", "reference"])
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--quantization", "-q", default=None, choices=["gguf", "int8", "int4", "none"]
        )
        parser.add_argument(
            "--kv-transfer-config", default=None,
            help='disaggregated prefill, e.g. \'{"kv_role": "kv_producer", "kv_port": 14579}\'',
        )
        parser.add_argument(
            "--speculative-config", type=_json_dict, default=None,
            help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
        )
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        parser.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"])
        parser.add_argument(
            "--reasoning-parser", default=None, choices=list(REASONING_PARSER_NAMES),
            help="split the reasoning (<think>...</think>) from the answer; grammars start after it",
        )
        parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                            help="priority: lower request `priority` first, ties by arrival")
        parser.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                            help="most logprobs a request may ask for per position")
        parser.add_argument("--generation-config", default="auto",
                            help="sampling defaults: auto (from the checkpoint), vllm (none), or a directory")
        parser.add_argument("--override-generation-config", type=_json_dict, default=None,
                            help='sampling defaults over generation-config\'s, e.g. \'{"temperature": 0.5}\'')
        parser.add_argument("--disable-log-stats", action="store_true", default=False,
                            help="no periodic stats log line")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})

    def resolve_prefix_caching(self) -> bool:
        if self.enable_prefix_caching is None:
            return self.kv_cache_backend in KV_BACKEND_NAMES and get_kv_backend(
                self.kv_cache_backend
            ).supports_prefix_caching
        return self.enable_prefix_caching

    def parse_kv_transfer_config(self):
        """The KVTransferConfig, or None; raises ValueError naming a bad key or value."""
        if self.kv_transfer_config is None:
            return None
        from pagedllm.distributed.kv_transfer.config import KVTransferConfig

        return KVTransferConfig.from_cli(self.kv_transfer_config)

    def resolve_dtype(self) -> str:
        if self.dtype in ("float32", "bfloat16"):
            return self.dtype
        if self.dtype == "float":
            return "float32"
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(map(repr, DTYPE_CHOICES))}")
        import torch

        # bf16 pays off only where the CPU computes it natively (AVX512-BF16 / AMX): without it
        # bf16 weights are widened to float32 per matmul (docs/bfloat16.md).
        native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        chosen = "bfloat16" if native else "float32"
        if self.dtype in ("half", "float16"):
            logger.warning("dtype=%s: no float16 compute on CPUs; using %s (native bf16: %s)",
                           self.dtype, chosen, native)
        else:
            logger.info("dtype=auto chose %s (native bf16: %s)", chosen, native)
        return chosen

    def create_engine_config(self, model_config: ModelConfig, num_blocks: int) -> EngineConfig:
        max_num_batched_tokens = self.max_num_batched_tokens or max(4096, self.max_num_seqs)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=parse_bytes(self.kv_cache_memory_bytes),
                enable_prefix_caching=self.resolve_prefix_caching(),
                kv_cache_backend=self.kv_cache_backend,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=model_config.max_model_len,
                scheduling_policy=self.scheduling_policy,  # type: ignore[arg-type]
            ),
            num_blocks=num_blocks,
            seed=self.seed,
            speculative_config=SpeculativeConfig.from_dict(self.speculative_config),
            attention_config=AttentionConfig(backend=self.attention_backend),  # type: ignore[arg-type]
        )


def check_device_memory_args(gpu_memory_utilization: float | None) -> None:
    """The one place that decides whether a GPU memory share is accepted: on CPUs the KV cache
    is sized in bytes. (A CUDA device path accepts it here once it exists.)"""
    if gpu_memory_utilization is not None:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} applies to GPU backends only; on CPUs "
            "size the KV cache with --kv-cache-memory-bytes (e.g. 4GiB) or VLLM_CPU_KVCACHE_SPACE (GiB)"
        )


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
