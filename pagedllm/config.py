"""Engine configuration: one frozen dataclass per concern, composed into EngineConfig.

No torch here: the control plane (core/) reads these too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pagedllm.kv_backends import KV_BACKEND_NAMES

GiB = 1 << 30

DType = Literal["float32", "bfloat16"]
SchedulingPolicy = Literal["fcfs", "priority"]

KV_CACHE_BACKENDS = KV_BACKEND_NAMES

KVCacheDType = Literal["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
"""What the KV cache stores: "auto" (the model's dtype), or 8-bit codes with a float32 scale
per (token, KV head) row: "int8", "fp8_e4m3" ("fp8", as vLLM) or "fp8_e5m2"
(layers/kv_quant.py; docs/architecture.md's KV cache part)."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The storage name of the KV cache: the model's dtype for "auto", "fp8" spelled
    "fp8_e4m3", else the name itself; ValueError naming the choices otherwise."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        return model_dtype
    return "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype


def parse_bytes(value: int | str) -> int:
    """Parse a byte count: an int, or a string such as "4GiB", "512MiB", "2GB", "1e9"."""
    if isinstance(value, int):
        return value
    text = str(value).strip()
    m = re.fullmatch(r"(?i)\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", text)
    if not m:
        raise ValueError(
            f"kv_cache_memory_bytes={value!r} is not a byte count; "
            "use an integer or a string such as '4GiB', '512MiB' or '2GB'"
        )
    number, unit, binary = m.groups()
    base = 1024 if binary or not unit else 1000
    power = " kmgt".index(unit.lower()) if unit else 0
    return int(float(number) * base**power)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model; built by models.loader."""

    model: str
    """The name or path the user gave."""
    architecture: str
    """The checkpoint's architecture name, e.g. "LlamaForCausalLM"."""
    dtype: DType
    """Compute and KV dtype."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may reach."""
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    """End-of-sequence ids: the checkpoint's EOS plus end-of-turn ids."""
    bos_token_id: int | None = None
    sliding_window: int | None = None
    """Window of sliding-window layers, None when every layer attends fully."""


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache pool."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int = 4 * GiB
    """Byte budget of the KV pool (as vLLM's CPU backend's default of 4 GiB)."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    kv_cache_backend: str = "paged"
    """A name in the KV backend registry (pagedllm/kv_backends/); each backend checks the
    engine arguments it cannot honour (``KVBackend.check_args``)."""
    kv_cache_dtype: KVCacheDType = "auto"
    """What the KV cache stores (KV_CACHE_DTYPES): the model's dtype, or 8-bit codes with a
    scale per (token, KV head) row."""

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.kv_cache_dtype, "float32")
        if self.kv_cache_backend not in KV_CACHE_BACKENDS:
            raise ValueError(
                f"kv_cache_backend={self.kv_cache_backend!r} is not one of {', '.join(KV_CACHE_BACKENDS)}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")


PrefillActivations = Literal["float", "int8", "bf16"]
PREFILL_ACTIVATIONS = ("float", "int8", "bf16")
"""How weights meet the activations of many-row matmuls (prefill chunks, large decode
batches): "float" (dequantized weights, float32 products), "int8" (quantized weights only:
activations rounded to int8 per group of 32, integer dot products) or "bf16" (a bf16 copy of
each weight, torch's bf16 GEMM: AMX where the CPU has it); docs/quantization.md."""
MATMUL_ACTIVATIONS = ("auto", "float32", "int8", "bf16")
"""`--matmul-activations` (alias `--prefill-activations`): "auto" (the platform's fastest,
kernels/bf16_activations.auto_matmul_activations) or a PREFILL_ACTIVATIONS mode ("float32" is "float")."""


AttentionImpl = Literal["torch", "reference", "triton"]
ATTENTION_BACKENDS = ("torch", "reference", "triton")
ContiguousDecode = Literal["kernel", "torch"]


@dataclass(frozen=True)
class AttentionConfig:
    """How every Attention layer computes (each layer's own parameters, its scale, sliding
    window and logit soft-cap, come from the model's configuration)."""

    backend: AttentionImpl = "torch"
    """"torch": decodes in one call of the compiled kernel (or one padded SDPA call), prefill
    chunks one SDPA call each; "reference": a per-request, per-head float64 loop (tests);
    "triton": the Triton kernels (kernels/triton/: the KV write and one paged-attention
    launch per layer; compiled on CUDA, interpreted on CPU tensors, docs/gpu.md)."""
    compiled_kernels: bool = True
    """Decode through the compiled C++ kernels where they build (False: torch ops only)."""
    contiguous_decode: ContiguousDecode = "kernel"
    """Decodes over the contiguous-slot layout: the compiled contiguous kernel ("kernel") or
    one SDPA call per request over views of its slot ("torch")."""

    def __post_init__(self) -> None:
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend {self.backend!r} is not one of {', '.join(map(repr, ATTENTION_BACKENDS))}"
            )
        if self.contiguous_decode not in ("kernel", "torch"):
            raise ValueError(f"contiguous_decode={self.contiguous_decode!r} is not one of 'kernel', 'torch'")


Device = Literal["cpu", "cuda"]
DEVICES = ("cpu", "cuda")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class DeviceConfig:
    """Where the weights, the KV cache and the step's tensors live (docs/gpu.md)."""

    device: Device = "cpu"
    """"cpu", or "cuda" (the current CUDA device); EngineArgs resolves "auto"."""
    gpu_memory_utilization: float | None = None
    """CUDA only, vLLM's meaning: the fraction of the device's total memory this process may
    use; the KV cache gets what remains of it after the weights and the profiled peak of a
    forward pass (default 0.9). On CPU the KV budget is ``kv_cache_memory_bytes``."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """CUDA only: decode batch sizes to capture CUDA graphs for (worker/cuda_graphs.py); a
    decode step of n rows replays the smallest size >= n. Empty: every step runs eagerly
    (the default until the GPU check measures graphs faster, docs/gpu.md)."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not one of 'cpu', 'cuda' (or 'auto' in EngineArgs)")
        if self.cuda_graph_sizes and self.device != "cuda":
            raise ValueError(f"cuda_graph_sizes={list(self.cuda_graph_sizes)} needs device='cuda'")
        if any(not isinstance(s, int) or s < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes={list(self.cuda_graph_sizes)} must be integers >= 1")
        util = self.gpu_memory_utilization
        if util is None:
            return
        if self.device == "cpu":
            raise ValueError(
                f"gpu_memory_utilization={util} (--gpu-memory-utilization) sizes the KV cache on "
                "device='cuda'; on the CPU size it with kv_cache_memory_bytes (--kv-cache-memory-bytes)"
            )
        if not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization={util} must be in (0, 1]")

    @property
    def memory_utilization(self) -> float:
        """The fraction in use on CUDA (the configured one or the default)."""
        return self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION


@dataclass(frozen=True)
class SchedulerConfig:
    """Token and sequence budgets of one engine step."""

    max_num_batched_tokens: int = 2048
    """Most tokens (prefill chunks + decodes) in one step."""
    max_num_seqs: int = 128
    """Most requests running at once."""
    max_model_len: int = 2048
    """Longest sequence a request may reach (copied from ModelConfig)."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """fcfs: arrival order; priority: lower `Request.priority` first, ties by arrival, and
    preemption takes the lowest priority (largest value), latest arrival, first."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} is not one of 'fcfs', 'priority'")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be > 0")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be > 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least "
                f"max_num_seqs={self.max_num_seqs} so every running request can decode each step"
            )


SpecMethod = Literal["ngram", "draft_model"]
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "model", "draft_layers", "disable_by_batch_size", "min_acceptance_rate")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, the target verifies them in one pass."""

    method: SpecMethod
    """"ngram" (prompt lookup) or "draft_model" (a smaller model, or the target's first layers)."""
    num_speculative_tokens: int
    """Drafts proposed per request and step (k): a step verifies up to k + 1 tokens."""
    prompt_lookup_min: int = 2
    """ngram: shortest suffix n-gram that may match."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix n-gram tried first."""
    model: str | None = None
    """draft_model: the draft checkpoint (same tokenizer as the target)."""
    draft_layers: int | None = None
    """draft_model without ``model``: self-speculation with the target's first L layers, its
    final norm and LM head (no second checkpoint)."""
    disable_by_batch_size: int | None = None
    """A step that runs at least this many requests proposes no drafts for the next (vLLM's
    key); None: never (spec_decode/policy.py)."""
    min_acceptance_rate: float | None = None
    """A request whose recent drafts were accepted at a lower rate gets none for a while (a
    doubling backoff); None: every request is drafted for (spec_decode/policy.py)."""

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config method={self.method!r} is not one of 'ngram', 'draft_model'"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config num_speculative_tokens={self.num_speculative_tokens!r} "
                "must be an integer >= 1"
            )
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1
        ):
            raise ValueError(
                f"speculative_config disable_by_batch_size={self.disable_by_batch_size!r} must be an integer >= 1"
            )
        if self.min_acceptance_rate is not None and not 0 <= self.min_acceptance_rate <= 1:
            raise ValueError(
                f"speculative_config min_acceptance_rate={self.min_acceptance_rate!r} must be in [0, 1]"
            )
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )
            if self.model is not None or self.draft_layers is not None:
                raise ValueError("speculative_config: 'model' and 'draft_layers' need method='draft_model'")
        else:
            if (self.model is None) == (self.draft_layers is None):
                raise ValueError(
                    "speculative_config method='draft_model' needs exactly one of 'model' (a draft "
                    "checkpoint) or 'draft_layers' (self-speculation with the target's first layers)"
                )
            if self.draft_layers is not None and self.draft_layers < 1:
                raise ValueError(f"speculative_config draft_layers={self.draft_layers} must be >= 1")

    @classmethod
    def from_dict(cls, config: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The vLLM-style dict (``--speculative-config`` JSON, ``LLM(speculative_config=...)``)."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {list(_SPEC_KEYS)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in config:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**config)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the verified tokens a draft model writes while proposing."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (distributed/): how many ranks, and who hosts them."""

    tensor_parallel_size: int = 1
    """Ranks each layer is split across (attention heads, MLP columns, vocabulary)."""
    distributed_executor_backend: str | None = None
    """"uni" (in process), "mp" (worker processes here) or "ray" (Ray actors); default: uni
    for one rank, mp for more."""

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be an integer >= 1")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend={backend!r} is not one of {', '.join(EXECUTOR_BACKENDS)}"
            )
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank in process, not "
                f"tensor_parallel_size={self.tensor_parallel_size}; use 'mp' or 'ray'"
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    num_blocks: int
    """Blocks in the KV pool, including the reserved null block 0."""
    seed: int = 0
    """Seed of the engine's global generator (requests without their own seed)."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, None when off."""
    attention_config: AttentionConfig = AttentionConfig()
    """The attention implementation of every layer."""
    device_config: DeviceConfig = DeviceConfig()
    """Where the model, the KV cache and the step run."""
