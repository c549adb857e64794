"""EngineArgs: the user-facing engine arguments (the CLI's flags and ``LLM(...)``'s keywords,
named like vLLM's), turned once into a validated, frozen ``EngineConfig``.

Each field declares its flag (``arg_flags.flag``: names, help, choices), so the parser is
generated from the fields and a flag's default is its field's. A default that a sub-config
already holds is read from that sub-config's class. Nothing here validates: every check runs
in ``create_engine_config`` (the sub-configs' own checks, then engine/config_checks.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass

from pagedllm.config import (
    ATTENTION_BACKENDS,
    CONVERT_CHOICES,
    KV_CACHE_DTYPES,
    MATMUL_ACTIVATIONS,
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoadConfig,
    ObservabilityConfig,
    ParallelConfig,
    PoolingConfig,
    QuantizationConfig,
    SamplingConfig,
    SchedulerConfig,
    RUNNER_CHOICES,
    SpeculativeConfig,
    StructuredOutputConfig,
    TASK_CHOICES,
    UsageContext,
    parse_bytes,
    normalize_matmul_activations,
    scheduler_defaults,
)
from pagedllm.engine.arg_flags import add_dataclass_flags, flag, given_flags, json_dict
from pagedllm.kv_backends import KV_BACKEND_NAMES, get_kv_backend
from pagedllm.lora.config import LoRAConfig
from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.pooling_params import PoolerConfig
from pagedllm.platforms.registry import DEVICE_CHOICES, get_platform, resolve_device
from pagedllm.platforms.isa import ISAS
from pagedllm.reasoning import REASONING_PARSER_NAMES

logger = logging.getLogger(__name__)

DEFAULT_MODEL = LoadConfig.model
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float", "half", "float16")
"""vLLM's --dtype values; half/float16 resolve as auto (docs/bfloat16.md), float is float32."""

ENV_FAULTS = "PAGEDLLM_INJECT_FAULT"
ENV_FUSED_DECODE = "PAGEDLLM_FUSED_DECODE"
ENV_CPU_KERNELS = "PAGEDLLM_CPU_KERNELS"
ENV_CPU_ISA = "PAGEDLLM_CPU_ISA"


@dataclass
class EngineArgs:
    model: str = flag(DEFAULT_MODEL, "a local path (.gguf file or HF directory), a packaged model name, or a "
                      "Hugging Face hub id, in that order", cli=False)
    revision: str | None = flag(None, "a hub id's branch, tag or commit (default: main)")
    hf_file: str | None = flag(
        None, "a GGUF file of the hub repo given as the model (NAME.gguf; a split model's first file), as "
        "llama-server's --hf-file: the same as model org/name:NAME.gguf (org/name:Q4_K_M picks a file by its "
        "quant type)")
    download_dir: str | None = flag(
        None, "the hub cache to download a hub id into and read it from (default: $HF_HUB_CACHE or "
        "~/.cache/huggingface/hub); with HF_HUB_OFFLINE=1 the cache alone")
    dtype: str = flag(LoadConfig.dtype, "float32, bfloat16, or auto (the platform's choice: bfloat16 on CUDA "
                      "and where the CPU computes bf16 natively); half/float16 as auto, float as float32",
                      choices=DTYPE_CHOICES)
    tokenizer: str | None = flag(None, "a tokenizer directory (or .gguf file) other than the model's")
    device: str = flag("auto", "cpu, cuda, or auto (cuda when a CUDA device is visible); docs/gpu.md",
                       choices=DEVICE_CHOICES)
    gpu_memory_utilization: float | None = flag(
        None, "CUDA: fraction of the device's memory to use (default 0.9); CPU: use --kv-cache-memory-bytes",
        type=float)
    cuda_graph_sizes: list[int] | None = flag(
        None, "CUDA: decode batch sizes to capture CUDA graphs for (default: none, eager)", type=int, nargs="+")
    cpu_isa: str | None = flag(None, "CPU: the compiled kernels' instruction-set level (default: the CPU's "
                               "highest; PAGEDLLM_CPU_ISA); one the CPU lacks falls to its highest", choices=ISAS)
    max_model_len: int | None = flag(None, "longest prompt + output (default: the checkpoint's context length)",
                                     type=int)
    block_size: int = flag(CacheConfig.block_size, "tokens per KV cache block", type=int)
    kv_cache_memory_bytes: int | str | None = flag(
        None, "KV cache budget, e.g. 2GiB (default: the platform's: 4GiB on the CPU; on CUDA from "
        "--gpu-memory-utilization)")
    max_num_seqs: int | None = flag(
        None, "most requests running at once (default: 256 offline, 128 for serve; config.SCHEDULER_DEFAULTS)",
        type=int)
    max_num_batched_tokens: int | None = flag(
        None, "most tokens in one engine step (default: 4096 offline, 2048 for serve, at least max_num_seqs)",
        type=int)
    enable_prefix_caching: bool | None = flag(
        None, "reuse the KV blocks of shared prompt prefixes (default: where the KV backend supports it)",
        type=bool)
    kv_cache_backend: str = flag(CacheConfig.kv_cache_backend, "the KV cache layout (docs/kv_backends.md)",
                                 choices=KV_BACKEND_NAMES)
    kv_cache_dtype: str = flag(CacheConfig.kv_cache_dtype, "what the KV cache stores: auto (the model's dtype), "
                               "or 8-bit codes with a float32 scale per (token, head) row: int8, fp8 (e4m3), "
                               "fp8_e5m2", choices=KV_CACHE_DTYPES)
    vattention_hugepages: bool = flag(CacheConfig.vattention_hugepages,
                                      "vattention: back the slots with transparent huge pages")
    vattention_deferred_reclaim: bool = flag(
        CacheConfig.vattention_deferred_reclaim,
        "vattention: keep a finished request's pages for the next request in its slot")
    kv_offload_cpu_bytes: int | str | None = flag(
        None, "host memory for KV blocks evicted from the pool, e.g. 8GiB (default: none); docs/kv_offload.md")
    kv_offloading_size: float | None = flag(
        None, "vLLM's name: the CPU offload tier in GiB (as --kv-offload-cpu-bytes)", type=float)
    kv_offloading_backend: str | None = flag(
        None, "vLLM's name: 'native' (pagedllm's own tiers); 'lmcache' is not supported", choices=("native", "lmcache"))
    kv_offload_dir: str | None = flag(
        None, "a directory for KV blocks evicted from the pool, kept across restarts and shareable "
        "between engines of the same model (default: none)")
    kv_offload_disk_bytes: int | str | None = flag(
        None, "most bytes of block files kept in --kv-offload-dir, e.g. 50GiB (default: no bound)")
    attention_backend: str | None = flag(
        None, "the attention implementation (default: the platform's: torch on the CPU, triton on CUDA)",
        choices=ATTENTION_BACKENDS)
    compiled_kernels: bool = flag(AttentionConfig.compiled_kernels,
                                  "run the compiled C++ kernels where they build (off: torch ops only)")
    fused_decode: bool = flag(AttentionConfig.fused_decode,
                              "decode steps in one compiled call over every layer where it applies")
    seed: int = flag(0, "seed for requests without their own seed", type=int)
    quantization: str | None = flag(
        None, "weights: gguf (keep a GGUF file's types), int8 / int4 (quantize at load), none (dequantize); "
        "default: gguf for GGUF files whose types it supports, else none",
        names=("-q",), choices=("gguf", "int8", "int4", "none"))
    matmul_activations: str = flag(
        QuantizationConfig.matmul_activations,
        "activation precision of matmuls of 16+ rows (prefill chunks, large decode batches): auto (the "
        "platform's fastest: bf16 where the CPU computes bf16 natively, else float32), float32, int8 "
        "(quantized weights) or bf16 (a bf16 copy of each weight, 2 bytes a weight); docs/bfloat16.md",
        names=("--prefill-activations",), choices=MATMUL_ACTIVATIONS, type=normalize_matmul_activations)
    kv_transfer_config: str | dict | None = flag(
        None, 'disaggregated prefill, e.g. \'{"kv_role": "kv_producer", "kv_port": 14579}\'')
    speculative_config: dict | None = flag(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
        type=json_dict)
    tensor_parallel_size: int = flag(ParallelConfig.tensor_parallel_size, "tensor-parallel ranks",
                                     names=("-tp",), type=int)
    distributed_executor_backend: str | None = flag(None, "uni, mp or ray (default: uni for one rank, mp for "
                                                    "more)", choices=("uni", "mp", "ray"))
    data_parallel_size: int = flag(ParallelConfig.data_parallel_size,
                                   "engine-core replicas behind one server, routed by prefix-cache affinity "
                                   "and load (docs/data_parallel.md)", names=("-dp",), type=int)
    data_parallel_size_local: int | None = flag(
        None, "replicas on this node (default: mp all, ray wherever it places them)", names=("-dpl",), type=int)
    data_parallel_address: str = flag(ParallelConfig.data_parallel_address,
                                      "the server's address the replicas connect to", names=("-dpa",))
    data_parallel_backend: str = flag(ParallelConfig.data_parallel_backend,
                                      "mp (local processes) or ray (actors over the Ray cluster's nodes)",
                                      names=("-dpb",), choices=("mp", "ray"))
    reasoning_parser: str | None = flag(
        None, "split the reasoning (<think>...</think>) from the answer; grammars start after it",
        choices=REASONING_PARSER_NAMES)
    reasoning_budget: int = flag(
        -1, "the server's thinking_token_budget: reasoning tokens before the end marker is forced "
        "(-1: no limit; 0: none), as llama-server; needs --reasoning-parser", type=int)
    scheduling_policy: str = flag(SchedulerConfig.scheduling_policy,
                                  "priority: lower request `priority` first, ties by arrival",
                                  choices=("fcfs", "priority"))
    max_logprobs: int = flag(SamplingConfig.max_logprobs, "most logprobs a request may ask for per position",
                             type=int)
    generation_config: str = flag(SamplingConfig.generation_config,
                                  "sampling defaults: auto (from the checkpoint), vllm (none), or a directory")
    override_generation_config: dict | None = flag(
        None, 'sampling defaults over generation-config\'s, e.g. \'{"temperature": 0.5}\'', type=json_dict)
    runner: str = flag("auto", "pooling: serve the model for embeddings/classification/scores only; "
                       "auto: the checkpoint decides (encoders pool)", choices=RUNNER_CHOICES)
    convert: str = flag("auto", "embed: a causal LM as an embedder (last-token pooling); classify: a "
                        "*ForSequenceClassification checkpoint", choices=CONVERT_CHOICES)
    task: str | None = flag(None, "vLLM's older spelling of --runner/--convert: generate, embed, classify, "
                            "score", choices=tuple(TASK_CHOICES))
    pooler_config: dict | None = flag(
        None, 'pooling over the checkpoint\'s, e.g. \'{"pooling_type": "MEAN", "normalize": true}\'',
        type=json_dict)
    hf_overrides: dict | None = flag(
        None, 'vLLM\'s config overrides; only Qwen3-Reranker\'s recipe: \'{"architectures": '
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}\' (a causal LM scored by its yes/no logits)', type=json_dict)
    disable_log_stats: bool = flag(ObservabilityConfig.disable_log_stats, "no periodic stats log line")
    enable_lora: bool = flag(False, "serve LoRA adapters (--lora-modules, or loaded at run time)")
    max_loras: int = flag(LoRAConfig.max_loras, "distinct LoRA adapters in one step", type=int)
    max_lora_rank: int = flag(LoRAConfig.max_lora_rank, "largest LoRA rank accepted", type=int)
    max_cpu_loras: int | None = flag(None, "LoRA adapters kept in host memory, LRU evicted (default: "
                                     "--max-loras)", type=int)
    limit_mm_per_prompt: dict | None = flag(
        None, 'most images per prompt, vLLM\'s JSON form, e.g. \'{"image": 2}\' (default: no cap)', type=json_dict)
    allowed_local_media_path: str | None = flag(
        None, "file:// image URLs are read only under this directory (default: refused)")
    allowed_media_domains: list[str] | None = flag(
        None, "http(s) image URLs are fetched only from these hosts (default: none)", nargs="+")
    inject_fault: str | None = flag(None, "fault injection for tests, '<site>:<marker>[@<n>],...' (faults.py; "
                                    "default: $PAGEDLLM_INJECT_FAULT)")
    usage_context: UsageContext = flag("offline", "offline (LLM) or serve: picks the step budgets' defaults",
                                       cli=False)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_flags(parser, cls)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**given_flags(args, cls))

    def _model_with_hf_file(self) -> str:
        """`model` with --hf-file folded in (one form reaches the loader: org/name:NAME.gguf)."""
        if self.hf_file is None:
            return self.model
        if not self.hf_file.endswith(".gguf") or ":" in self.model:
            raise ValueError(
                f"hf_file={self.hf_file!r} must name a .gguf file of a hub repo given without a tag "
                f"(model={self.model!r})"
            )
        return f"{self.model}:{self.hf_file}"

    def create_engine_config(self, environ: Mapping[str, str] = os.environ) -> EngineConfig:
        """The one validated configuration of these arguments (ValueError naming the first
        bad value or combination). ``environ``: the environment variables that default a
        field (PAGEDLLM_INJECT_FAULT, PAGEDLLM_FUSED_DECODE=0, PAGEDLLM_CPU_KERNELS=0,
        PAGEDLLM_CPU_ISA)."""
        from pagedllm.engine.config_checks import check_engine_config

        device = resolve_device(self.device)
        platform = get_platform(device)
        seqs, tokens = scheduler_defaults(self.usage_context, self.max_num_seqs, self.max_num_batched_tokens)
        config = EngineConfig(
            load_config=LoadConfig(self._model_with_hf_file(), self.revision, self.download_dir, self.tokenizer,
                                   _load_dtype(self.dtype), self.max_model_len, self.quantization,
                                   self.hf_overrides),
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=None if self.kv_cache_memory_bytes is None else parse_bytes(
                    self.kv_cache_memory_bytes),
                enable_prefix_caching=self._prefix_caching(),
                kv_cache_backend=self.kv_cache_backend,
                kv_cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
                vattention_hugepages=self.vattention_hugepages,
                vattention_deferred_reclaim=self.vattention_deferred_reclaim,
                **self._kv_offload(),
            ),
            scheduler_config=SchedulerConfig(
                tokens, seqs, scheduling_policy=self.scheduling_policy),  # type: ignore[arg-type]
            parallel_config=ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend,
                                           self.data_parallel_size, self.data_parallel_size_local,
                                           self.data_parallel_address, self.data_parallel_backend),
            device_config=DeviceConfig(device, self.gpu_memory_utilization,  # type: ignore[arg-type]
                                       tuple(sorted(set(self.cuda_graph_sizes or ()))),
                                       self.cpu_isa or environ.get(ENV_CPU_ISA) or None),
            attention_config=AttentionConfig(
                backend=self.attention_backend or platform.default_attention_backend,  # type: ignore[arg-type]
                compiled_kernels=self.compiled_kernels and environ.get(ENV_CPU_KERNELS, "1") != "0",
                fused_decode=self.fused_decode and environ.get(ENV_FUSED_DECODE, "1") != "0",
            ),
            quantization_config=QuantizationConfig(self.matmul_activations),  # type: ignore[arg-type]
            lora_config=self._lora_config(),
            speculative_config=SpeculativeConfig.from_dict(self.speculative_config),
            structured_output_config=StructuredOutputConfig(self.reasoning_parser),
            kv_transfer_config=self._kv_transfer_config(),
            sampling_config=SamplingConfig(self.max_logprobs, self.generation_config, self.override_generation_config),
            pooling_config=self._pooling_config(),
            multimodal_config=MultiModalConfig(
                dict(self.limit_mm_per_prompt or {}), self.allowed_local_media_path,
                tuple(h.lower() for h in self.allowed_media_domains or ())),
            observability_config=ObservabilityConfig(self.disable_log_stats,
                                                     self.inject_fault or environ.get(ENV_FAULTS) or None),
            seed=self.seed,
        )
        return check_engine_config(config)

    def _pooling_config(self) -> PoolingConfig:
        runner, convert = self.runner, self.convert
        if self.task is not None:
            task_runner, task_convert = TASK_CHOICES[self.task]
            runner = task_runner if runner == "auto" else runner
            convert = task_convert if convert == "auto" else convert
        return PoolingConfig(runner, convert, PoolerConfig.from_json(self.pooler_config))

    def _kv_offload(self) -> dict[str, Any]:
        """The offload tiers' CacheConfig fields (vLLM's --kv-offloading-size in GiB, or ours in bytes)."""
        if self.kv_offloading_backend == "lmcache":
            raise ValueError("--kv-offloading-backend lmcache is not supported; use native (pagedllm's "
                             "CPU and disk tiers: docs/kv_offload.md)")
        cpu = self.kv_offload_cpu_bytes
        if self.kv_offloading_size is not None:
            if cpu is not None:
                raise ValueError("give --kv-offload-cpu-bytes or --kv-offloading-size, not both")
            cpu = int(self.kv_offloading_size * 2**30)
        return {
            "kv_offload_cpu_bytes": parse_bytes(cpu) if cpu is not None else 0,
            "kv_offload_dir": self.kv_offload_dir,
            "kv_offload_disk_bytes": (
                parse_bytes(self.kv_offload_disk_bytes) if self.kv_offload_disk_bytes is not None else None),
        }

    def _prefix_caching(self) -> bool:
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        backend = self.kv_cache_backend
        return backend in KV_BACKEND_NAMES and get_kv_backend(backend).supports_prefix_caching

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _kv_transfer_config(self):
        if self.kv_transfer_config is None:
            return None
        from pagedllm.distributed.kv_transfer.config import KVTransferConfig

        return KVTransferConfig.from_cli(self.kv_transfer_config)


def _load_dtype(dtype: str) -> str:
    """vLLM's --dtype spellings as LoadConfig's: float is float32, half/float16 are auto."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(map(repr, DTYPE_CHOICES))}")
    if dtype == "float":
        return "float32"
    if dtype in ("half", "float16"):
        logger.warning("dtype=%s: no float16 compute here; using what auto picks", dtype)
        return "auto"
    return dtype
