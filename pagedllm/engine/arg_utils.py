"""EngineArgs: the user-facing engine arguments, named like vLLM's, turned into EngineConfig."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, fields

from pagedllm.config import (
    KV_CACHE_DTYPES,
    ATTENTION_BACKENDS,
    GiB,
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    PREFILL_ACTIVATIONS,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    parse_bytes,
)
from pagedllm.kv_backends import KV_BACKEND_NAMES, get_kv_backend
from pagedllm.lora.config import LoRAConfig
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
    hf_file: str | None = None
    """A GGUF file of the hub repo `model` (as llama-server's --hf-file): the same as
    model="org/name:NAME.gguf"; a quant tag works without it ("org/name:Q4_K_M")."""
    download_dir: str | None = None
    """The hub cache a hub id downloads into and resolves in (default: $HF_HUB_CACHE or
    huggingface_hub's ~/.cache/huggingface/hub); HF_HUB_OFFLINE=1 reads it alone."""
    dtype: str = "auto"
    """float32, bfloat16, or auto (bfloat16 on CUDA and where the CPU has native bf16 support);
    vLLM's half / float16 map to what auto picks (no float16 compute here), float to float32."""
    tokenizer: str | None = None
    """A tokenizer directory (or .gguf file) other than the model's own."""
    device: str = "auto"
    """cpu, cuda, or auto (cuda when torch sees a CUDA device); docs/gpu.md."""
    gpu_memory_utilization: float | None = None
    """CUDA: fraction of the device's memory the process may use (default 0.9); the KV cache
    gets what the weights and the profiled peak leave. An error on the CPU (config.DeviceConfig)."""
    cuda_graph_sizes: list[int] | None = None
    """CUDA: decode batch sizes to capture CUDA graphs for (default none: eager)."""
    max_model_len: int | None = None
    """Longest prompt + output; default: the checkpoint's context length."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory_bytes: int | str | None = None
    """KV cache pool size, an int or a string like '2GiB' (default: 4 GiB on the CPU; on
    CUDA from gpu_memory_utilization, which a given size overrides, as in vLLM)."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int | None = None
    """Most tokens in one engine step (default: max(4096, max_num_seqs))."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV blocks of shared prompt prefixes (default: on where the KV backend
    supports it)."""
    kv_cache_backend: str = "paged"
    """A name in pagedllm/kv_backends/: "paged" or "vattention" (docs/kv_backends.md)."""
    kv_cache_dtype: str = "auto"
    """What the KV cache stores: auto (the model's dtype), int8, fp8 (= fp8_e4m3) or fp8_e5m2:
    8-bit codes with a float32 scale per (token, KV head) row (layers/kv_quant.py)."""
    vattention_hugepages: bool = False
    """vattention: back the slots with transparent huge pages (2 MiB accounting pages)."""
    vattention_deferred_reclaim: bool = True
    """vattention: keep a finished request's pages for the next request in its slot and
    release them (madvise) only when the budget needs them."""
    attention_backend: str | None = None
    """The attention implementation: "torch" (the CPU's default), "triton" (CUDA's default;
    on the CPU only under Triton's interpreter) or "reference" (float64 loops, tests)."""
    seed: int = 0
    """Seed for requests without their own seed."""
    quantization: str | None = None
    """Weights: gguf (keep a GGUF file's Q4/Q8 types), int8 / int4 (quantize at load), none
    (dequantize to dtype); default: gguf for GGUF files whose types it supports, else none."""
    prefill_activations: str = "float"
    """Matmuls of many activation rows (prefill chunks, large decode batches): "float"
    (float32 products), "int8" (quantized weights: activations rounded to int8 per group of 32,
    integer dot products) or "bf16" (bf16 weight copies and torch's bf16 GEMM: AMX where the CPU
    has it); docs/quantization.md."""
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
    disable_log_stats: bool = False
    """No periodic stats log line (the metrics are still served)."""
    enable_lora: bool = False
    """Serve LoRA adapters over the base model (docs/lora.md)."""
    max_loras: int = 1
    """Distinct LoRA adapters in one step."""
    max_lora_rank: int = 16
    """Largest LoRA rank accepted; every adapter slot is padded to it."""
    max_cpu_loras: int | None = None
    """LoRA adapters kept loaded in host memory, least recently used evicted (default: max_loras)."""

    def __post_init__(self) -> None:
        if self.hf_file is not None:  # normalised at the edge: one form reaches the loader
            if not self.hf_file.endswith(".gguf") or ":" in self.model:
                raise ValueError(
                    f"hf_file={self.hf_file!r} must name a .gguf file of a hub repo given without a tag "
                    f"(model={self.model!r})"
                )
            self.model, self.hf_file = f"{self.model}:{self.hf_file}", None
        ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend)
        SchedulerConfig(scheduling_policy=self.scheduling_policy)  # type: ignore[arg-type]
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an integer >= 0")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ValueError(
                f"generation_config={self.generation_config!r} is not auto, vllm or a directory "
                "holding a generation_config.json"
            )
        if self.device != "auto" or self.gpu_memory_utilization is not None or self.cuda_graph_sizes:
            # One check, config.DeviceConfig's (auto resolves here only when a CUDA-only
            # setting asks; otherwise torch is not imported before the core starts).
            DeviceConfig(self.resolve_device(), self.gpu_memory_utilization,  # type: ignore[arg-type]
                         tuple(self.cuda_graph_sizes or ()))
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # ValueError naming the choices
        lora = self.lora_config()
        if lora is not None:
            check_lora_support(self)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--revision", default=None, help="a hub id's branch, tag or commit (default: main)")
        parser.add_argument(
            "--hf-file", default=None,
            help="a GGUF file of the hub repo given as the model (NAME.gguf; a split model's first file); "
            "the same as model org/name:NAME.gguf, and org/name:Q4_K_M picks a file by its quant type",
        )
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
        parser.add_argument("--kv-cache-memory-bytes", default=None,
                            help="KV cache budget (default 4GiB on the CPU; on CUDA from --gpu-memory-utilization)")
        parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        parser.add_argument(
            "--gpu-memory-utilization", type=float, default=None,
            help="CUDA: fraction of the device's memory to use (default 0.9); CPU: use --kv-cache-memory-bytes",
        )
        parser.add_argument(
            "--cuda-graph-sizes", type=int, nargs="+", default=None,
            help="CUDA: decode batch sizes to capture CUDA graphs for (default: none, eager)",
        )
        parser.add_argument("--max-num-seqs", type=int, default=256)
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None
        )
        parser.add_argument("--kv-cache-backend", default="paged", choices=list(KV_BACKEND_NAMES))
        parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                            help="what the KV cache stores: auto (the model's dtype), or 8-bit codes "
                            "with a float32 scale per (token, head) row: int8, fp8 (e4m3), fp8_e5m2")
        parser.add_argument(
            "--vattention-hugepages", action=argparse.BooleanOptionalAction, default=False
        )
        parser.add_argument(
            "--vattention-deferred-reclaim", action=argparse.BooleanOptionalAction, default=True
        )
        parser.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS))
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--quantization", "-q", default=None, choices=["gguf", "int8", "int4", "none"]
        )
        parser.add_argument("--prefill-activations", default="float", choices=list(PREFILL_ACTIVATIONS))
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
        parser.add_argument("--enable-lora", action="store_true", default=False,
                            help="serve LoRA adapters (--lora-modules, or loaded at run time)")
        parser.add_argument("--max-loras", type=int, default=1, help="distinct LoRA adapters in one step")
        parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted")
        parser.add_argument("--max-cpu-loras", type=int, default=None,
                            help="LoRA adapters kept in host memory, LRU evicted (default: --max-loras)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})

    def lora_config(self) -> LoRAConfig | None:
        """The LoRAConfig under --enable-lora, else None (ValueError for bad sizes)."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

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

    def resolve_device(self) -> str:
        """"cpu" or "cuda"; ValueError for a CUDA request torch cannot serve."""
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not one of 'auto', 'cpu', 'cuda'")
        if self.device == "cpu":
            return "cpu"
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if not torch.cuda.is_available():
            raise ValueError(
                f"device='cuda', but torch {torch.__version__} sees no CUDA device "
                f"(built with CUDA: {torch.version.cuda is not None}); use device='cpu'"
            )
        return "cuda"

    def resolve_attention_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.resolve_device() == "cuda" else "torch"

    def kv_cache_budget(self) -> int:
        """The KV pool's byte budget: the given size, else 4 GiB (as vLLM's CPU backend)."""
        if self.kv_cache_memory_bytes is None:
            return 4 * GiB
        return parse_bytes(self.kv_cache_memory_bytes)

    def check_device_support(self) -> None:
        """ValueError naming the first argument the resolved device cannot honour yet
        (docs/gpu.md lists them); called before the model loads."""
        device = self.resolve_device()
        backend = self.resolve_attention_backend()
        if backend == "triton" and self.kv_cache_backend != "paged":
            raise ValueError(
                f"attention_backend='triton' reads the paged block-table layout; "
                f"kv_cache_backend={self.kv_cache_backend!r} needs attention_backend 'torch' or 'reference'"
            )
        if self.kv_cache_dtype != "auto" and backend == "triton":
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} (8-bit KV codes with per-row scales) is read "
                "by the CPU kernels only; attention_backend='triton' (and device='cuda') reads a "
                "float cache: use --kv-cache-dtype auto there, or device='cpu' with the 'torch' "
                "attention backend"
            )
        if device == "cpu" and backend == "triton":
            from pagedllm.kernels.triton import triton_available, triton_interpreted

            if not triton_available() or not triton_interpreted():
                raise ValueError(
                    "attention_backend='triton' runs on the CPU only under Triton's interpreter "
                    "(TRITON_INTERPRET=1 before triton's first import; tests do); use 'torch' on the CPU"
                )
        if device != "cuda":
            return
        refusals = {
            f"kv_cache_dtype={self.kv_cache_dtype!r} (the 8-bit KV kernels are CPU code)":
                self.kv_cache_dtype != "auto",
            "tensor_parallel_size > 1 (--tensor-parallel-size)": self.tensor_parallel_size > 1,
            f"prefill_activations={self.prefill_activations!r} (a CPU setting: cuda runs in its --dtype)":
                self.prefill_activations != "float",
            "KV transfer (--kv-transfer-config; it reads the pool with .numpy())": self.kv_transfer_config is not None,
            "speculative decoding (--speculative-config; the rejection sampler is host-side)":
                self.speculative_config is not None,
            f"quantization={self.quantization!r} (the 4/8-bit kernels are CPU code; GGUF files are "
            "dequantized to the dtype at load on cuda, --quantization none)":
                self.quantization not in (None, "none"),
            f"attention_backend={backend!r} (its masks and kernels are host-side; cuda runs 'triton')":
                backend != "triton",
        }
        for what, refused in refusals.items():
            if refused:
                raise ValueError(f"device='cuda' does not support {what} yet; see docs/gpu.md, or use device='cpu'")

    def device_config(self) -> DeviceConfig:
        return DeviceConfig(
            self.resolve_device(), self.gpu_memory_utilization,  # type: ignore[arg-type]
            tuple(sorted(set(self.cuda_graph_sizes or ()))),
        )

    def resolve_dtype(self) -> str:
        if self.dtype in ("float32", "bfloat16"):
            return self.dtype
        if self.dtype == "float":
            return "float32"
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(map(repr, DTYPE_CHOICES))}")
        if self.resolve_device() == "cuda":
            logger.info("dtype=%s chose bfloat16 (device cuda)", self.dtype)
            return "bfloat16"
        import torch

        from pagedllm.models.loader import keeps_quantized_weights

        # bf16 pays off only where the CPU computes it natively (AVX512-BF16 / AMX): without it
        # bf16 weights are widened to float32 per matmul (docs/bfloat16.md). Quantized weights
        # (the default model's Q4_1 file) compute in float32 either way: their kernels and the
        # fused decode take float32 activations, while bf16 ones send every linear through a
        # per-layer dequantization and the per-module decode (docs/benchmarks.md, 2026-12-01).
        native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        quantized = keeps_quantized_weights(self.model, self.quantization)
        chosen = "bfloat16" if native and not quantized else "float32"
        if self.dtype in ("half", "float16"):
            logger.warning("dtype=%s: no float16 compute on CPUs; using %s (native bf16: %s, quantized weights: %s)",
                           self.dtype, chosen, native, quantized)
        else:
            logger.info("dtype=auto chose %s (native bf16: %s, quantized weights: %s)", chosen, native, quantized)
        return chosen

    def create_engine_config(self, model_config: ModelConfig, num_blocks: int) -> EngineConfig:
        max_num_batched_tokens = self.max_num_batched_tokens or max(4096, self.max_num_seqs)
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_budget(),
                enable_prefix_caching=self.resolve_prefix_caching(),
                kv_cache_backend=self.kv_cache_backend,
                kv_cache_dtype=self.kv_cache_dtype,  # type: ignore[arg-type]
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
            attention_config=AttentionConfig(backend=self.resolve_attention_backend()),  # type: ignore[arg-type]
            device_config=self.device_config(),
        )


def check_lora_support(args: EngineArgs) -> None:
    """ValueError naming the first setting LoRA adapters do not run with (docs/lora.md)."""
    refusals = {
        "tensor parallelism (--tensor-parallel-size > 1)": args.tensor_parallel_size > 1,
        "disaggregated prefill (--kv-transfer-config)": args.kv_transfer_config is not None,
    }
    for what, refused in refusals.items():
        if refused:
            raise ValueError(f"--enable-lora does not run with {what}; see docs/lora.md")


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
