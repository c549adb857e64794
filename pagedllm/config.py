"""Engine configuration: one frozen dataclass per concern, composed into EngineConfig.

No torch here: the control plane (core/) reads these too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.kv_backends import KV_BACKEND_NAMES
from pagedllm import faults
from pagedllm.distributed.kv_transfer.config import KVTransferConfig
from pagedllm.lora.config import LoRAConfig
from pagedllm.pooling_params import PoolerConfig
from pagedllm.sampling_params import MAX_LOGPROBS
from pagedllm.speculative_config import SpecMethod, SpeculativeConfig  # noqa: F401  (re-exported)

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
    runner: Runner = "generate"
    """generate: a causal LM (which also embeds, by its pooler); pooling: it only embeds or
    classifies (set at build: PoolingConfig, the family's declaration)."""
    pooler: PoolerConfig | None = None
    """The resolved pooling (every field set), None where the model does not pool."""
    num_labels: int | None = None
    """A classifier's outputs (a *ForSequenceClassification checkpoint), else None."""
    labels: tuple[str, ...] = ()
    """A classifier's label names by output index (the checkpoint's id2label)."""
    multimodal_dir: str | None = None
    """A vision-language checkpoint's HF-format directory, whose processor preprocesses images
    (multimodal/processor.py); None: the model takes text only."""


Runner = Literal["generate", "pooling"]
RUNNER_CHOICES = ("auto", "generate", "pooling")
CONVERT_CHOICES = ("auto", "none", "embed", "classify")
# vLLM's older --task values -> (runner, convert).
TASK_CHOICES: dict[str, tuple[str, str]] = {
    "auto": ("auto", "auto"), "generate": ("generate", "none"), "embed": ("pooling", "embed"),
    "embedding": ("pooling", "embed"), "classify": ("pooling", "classify"), "score": ("pooling", "classify"),
}


@dataclass(frozen=True)
class PoolingConfig:
    """Pooling models (vLLM's --runner, --convert, --task, --pooler-config)."""

    runner: str = "auto"
    """auto: the checkpoint's (an encoder pools, a causal LM generates); pooling: embed or
    classify only; generate: refuse a model that only pools."""
    convert: str = "auto"
    """embed: run a causal LM as an embedder (last-token pooling unless the checkpoint says
    otherwise); classify: needs a *ForSequenceClassification checkpoint."""
    pooler: PoolerConfig = PoolerConfig()
    """Overrides of the checkpoint's pooling."""

    def __post_init__(self) -> None:
        if self.runner not in RUNNER_CHOICES:
            raise ValueError(f"runner={self.runner!r} is not one of {', '.join(RUNNER_CHOICES)}")
        if self.convert not in CONVERT_CHOICES:
            raise ValueError(f"convert={self.convert!r} is not one of {', '.join(CONVERT_CHOICES)}")
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            raise ValueError(f"runner='generate' with convert={self.convert!r}: converting makes a pooling model")


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache pool."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_bytes: int | None = None
    """Byte budget of the KV pool; None until the platform's rule sets it at build
    (platforms/: 4 GiB on the CPU, as vLLM's CPU backend; on CUDA what gpu_memory_utilization
    leaves after the weights and a profiled peak)."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of shared prompt prefixes."""
    kv_cache_backend: str = "paged"
    """A name in the KV backend registry (pagedllm/kv_backends/); each backend checks the
    settings it cannot honour (``KVBackend.check_config``)."""
    kv_cache_dtype: KVCacheDType = "auto"
    """What the KV cache stores (KV_CACHE_DTYPES): the model's dtype, or 8-bit codes with a
    scale per (token, KV head) row."""
    vattention_hugepages: bool = False
    """vattention: back the slots with transparent huge pages (2 MiB accounting pages)."""
    vattention_deferred_reclaim: bool = True
    """vattention: keep a finished request's pages for the next request in its slot."""
    kv_offload_cpu_bytes: int = 0
    """KV offload: bytes of host memory holding cached blocks evicted from the pool (0: no
    CPU tier); docs/kv_offload.md."""
    kv_offload_dir: str | None = None
    """KV offload: a directory holding evicted blocks as files (None: no disk tier); it
    survives restarts and may be shared by engines of the same model."""
    kv_offload_disk_bytes: int | None = None
    """KV offload: most bytes of block files this engine keeps in ``kv_offload_dir`` (None:
    no bound)."""

    @property
    def kv_offload(self) -> bool:
        """Whether an offload tier is configured."""
        return self.kv_offload_cpu_bytes > 0 or self.kv_offload_dir is not None

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.kv_cache_dtype, "float32")
        if self.kv_cache_backend not in KV_CACHE_BACKENDS:
            raise ValueError(
                f"kv_cache_backend={self.kv_cache_backend!r} is not one of {', '.join(KV_CACHE_BACKENDS)}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")
        if self.kv_offload_cpu_bytes < 0:
            raise ValueError(f"kv_offload_cpu_bytes={self.kv_offload_cpu_bytes} must be >= 0")
        if self.kv_offload_disk_bytes is not None and self.kv_offload_dir is None:
            raise ValueError("kv_offload_disk_bytes (--kv-offload-disk-bytes) needs kv_offload_dir (--kv-offload-dir)")
        if self.kv_offload_disk_bytes is not None and self.kv_offload_disk_bytes <= 0:
            raise ValueError(f"kv_offload_disk_bytes={self.kv_offload_disk_bytes} must be > 0")


PrefillActivations = Literal["float", "int8", "bf16"]
PREFILL_ACTIVATIONS = ("float", "int8", "bf16")
"""How weights meet the activations of many-row matmuls (prefill chunks, large decode
batches): "float" (dequantized weights, float32 products), "int8" (quantized weights only:
activations rounded to int8 per group of 32, integer dot products) or "bf16" (a bf16 copy of
each weight, torch's bf16 GEMM: AMX where the CPU has it); docs/quantization.md."""
MATMUL_ACTIVATIONS = ("auto", "float32", "int8", "bf16")
"""`--matmul-activations` (alias `--prefill-activations`): "auto" (the platform fills in its
fastest: Platform.check_and_update_config) or a PREFILL_ACTIVATIONS mode ("float32" is "float")."""


def normalize_matmul_activations(value: str) -> str:
    """The flag's value with the old name "float" (--prefill-activations float) as "float32"."""
    return "float32" if value == "float" else value


def prefill_mode(matmul_activations: str) -> PrefillActivations:
    """A resolved MATMUL_ACTIVATIONS value as the mode layers/linear.set_prefill_activations takes."""
    if matmul_activations not in PREFILL_ACTIVATIONS and matmul_activations != "float32":
        raise ValueError(f"matmul_activations={matmul_activations!r} is not resolved to one of float32, int8, bf16")
    return "float" if matmul_activations == "float32" else matmul_activations  # type: ignore[return-value]


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
    fused_decode: bool = True
    """Decode steps through one compiled call over every decoder layer where it applies
    (models/fused_decode.py); False: module by module (e.g. to profile the modules)."""

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
    """"cpu", or "cuda" (the current CUDA device): the platform (platforms/); "auto" is
    resolved before this is built (platforms.resolve_device)."""
    gpu_memory_utilization: float | None = None
    """CUDA only, vLLM's meaning: the fraction of the device's total memory this process may
    use; the KV cache gets what remains of it after the weights and the profiled peak of a
    forward pass (default 0.9). On CPU the KV budget is ``kv_cache_memory_bytes``."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """CUDA only: decode batch sizes to capture CUDA graphs for (worker/cuda_graphs.py); a
    decode step of n rows replays the smallest size >= n. Empty: every step runs eagerly
    (the default until the GPU check measures graphs faster, docs/gpu.md)."""

    cpu_isa: str | None = None
    """CPU: the compiled kernels' instruction-set level (platforms/isa.py: generic, avx2,
    avx512, amx); None: the CPU's highest. A level above the CPU's falls to the CPU's (the
    CPU platform checks the name and sets the level in effect)."""

    def __post_init__(self) -> None:
        # What each device refuses is its platform's (platforms/*.py check_and_update_config).
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is not one of 'cpu', 'cuda' (or 'auto' in EngineArgs)")
        if any(not isinstance(s, int) or s < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes={list(self.cuda_graph_sizes)} must be integers >= 1")
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
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
    whole_prompts: bool = False
    """Each prompt runs whole in one step, never in chunks (set at build for a model with
    bidirectional attention; max_num_batched_tokens is then at least max_model_len)."""

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


EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (distributed/): how many ranks, and who hosts them."""

    tensor_parallel_size: int = 1
    """Ranks each layer is split across (attention heads, MLP columns, vocabulary)."""
    distributed_executor_backend: str | None = None
    """"uni" (in process), "mp" (worker processes here) or "ray" (Ray actors); default: uni
    for one rank, mp for more."""
    data_parallel_size: int = 1
    """Engine-core replicas behind one front end (engine/dp_client.py), each a whole model."""
    data_parallel_size_local: int | None = None
    """Replicas on this machine (None: all of them with ``mp``, wherever Ray places them with
    ``ray``); the ``mp`` backend runs every replica here."""
    data_parallel_address: str = "127.0.0.1"
    """The front end's address the replicas connect to (their input and output sockets)."""
    data_parallel_backend: str = "mp"
    """"mp" (local processes) or "ray" (Ray actors placed over the cluster's nodes)."""

    def __post_init__(self) -> None:
        self._check_data_parallel()
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


    def _check_data_parallel(self) -> None:
        dp = self.data_parallel_size
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size={dp!r} must be an integer >= 1")
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(f"data_parallel_backend={self.data_parallel_backend!r} is not one of "
                             f"{', '.join(DATA_PARALLEL_BACKENDS)}")
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= dp:
            raise ValueError(f"data_parallel_size_local={local} must be between 0 and data_parallel_size={dp}")
        if self.data_parallel_backend == "mp" and local is not None and local != dp:
            raise ValueError(f"data_parallel_backend='mp' runs every replica on this machine: "
                             f"data_parallel_size_local={local} must equal data_parallel_size={dp} "
                             f"(use 'ray' to place replicas on other nodes)")


DATA_PARALLEL_BACKENDS = ("mp", "ray")
UsageContext = Literal["offline", "serve"]
SCHEDULER_DEFAULTS: dict[str, tuple[int, int]] = {"offline": (256, 4096), "serve": (128, 2048)}
"""(max_num_seqs, max_num_batched_tokens) where the user gives neither, per usage context, as
vLLM's on CPUs: throughput for ``LLM``, latency for the API server. The one place they live."""


def scheduler_defaults(usage_context: UsageContext, max_num_seqs: int | None,
                       max_num_batched_tokens: int | None) -> tuple[int, int]:
    """The step budgets: the given values, else the usage context's (the batched tokens at
    least max_num_seqs, so every running request can decode each step)."""
    default_seqs, default_tokens = SCHEDULER_DEFAULTS[usage_context]
    seqs = default_seqs if max_num_seqs is None else max_num_seqs
    return seqs, max_num_batched_tokens if max_num_batched_tokens is not None else max(default_tokens, seqs)


@dataclass(frozen=True)
class LoadConfig:
    """Which weights and tokenizer to load, and how (models/loader.py)."""

    model: str = "SmolLM2-135M-Instruct"
    """A local path (.gguf file or HF directory), else a packaged model name, else a hub id."""
    revision: str | None = None
    """A hub id's branch, tag or commit (default: main)."""
    download_dir: str | None = None
    """The hub cache a hub id downloads into and resolves in."""
    tokenizer: str | None = None
    """A tokenizer directory (or .gguf file) other than the model's own."""
    dtype: str = "auto"
    """float32, bfloat16, or auto (the platform's rule at load, platforms/)."""
    max_model_len: int | None = None
    """Longest prompt + output; None: the checkpoint's context length."""
    quantization: str | None = None
    """gguf, int8, int4, none; None: the loader's default for the file."""
    hf_overrides: dict | None = None
    """vLLM's --hf-overrides: only Qwen3-Reranker's recipe (models/hf_overrides.py)."""

    def __post_init__(self) -> None:
        from pagedllm.models.hf_overrides import check_hf_overrides

        check_hf_overrides(self.hf_overrides)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} is not one of 'auto', 'float32', 'bfloat16'")
        if self.quantization not in (None, "gguf", "int8", "int4", "none"):
            raise ValueError(f"quantization={self.quantization!r} is not one of gguf, int8, int4, none")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")


@dataclass(frozen=True)
class QuantizationConfig:
    """How quantized weights meet many activation rows (kernels/, layers/linear.py)."""

    matmul_activations: str = "auto"
    """MATMUL_ACTIVATIONS: auto (the platform resolves it when the configuration is checked),
    float32, int8 or bf16 (docs/bfloat16.md)."""
    bf16_copy_limit_bytes: int | None = None
    """bf16 chosen by "auto": the most bytes of bf16 weight copies the model may take (more, and
    it runs float32: a default never multiplies a large model's memory); None: no limit (bf16
    asked for by name)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "matmul_activations", normalize_matmul_activations(self.matmul_activations))
        if self.matmul_activations not in MATMUL_ACTIVATIONS:
            raise ValueError(
                f"matmul_activations={self.matmul_activations!r} is not one of {', '.join(MATMUL_ACTIVATIONS)}")


@dataclass(frozen=True)
class StructuredOutputConfig:
    """Structured outputs and the reasoning that precedes them (structured_output/)."""

    reasoning_parser: str | None = None
    """A name in pagedllm/reasoning/parsers/; grammars start after the reasoning's end marker."""


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling limits and defaults (engine/generation_config.py)."""

    max_logprobs: int = MAX_LOGPROBS
    """Most logprobs (and prompt_logprobs) a request may ask for per position."""
    generation_config: str = "auto"
    """auto (the checkpoint's), vllm (none) or a directory holding a generation_config.json."""
    override_generation_config: dict | None = None
    """Sampling defaults laid over those of generation_config."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an integer >= 0")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Logs, stats and test hooks."""

    disable_log_stats: bool = False
    """No periodic stats log line (the metrics are still served)."""
    inject_fault: str | None = None
    """Fault injection for tests, "<site>:<marker>[@<n>],..." (faults.py)."""

    def __post_init__(self) -> None:
        faults.check(self.inject_fault)


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of one engine, validated once (EngineArgs.create_engine_config); each
    component gets its part. ``model_config`` and ``num_blocks`` are filled in at build, when
    the model is loaded and the KV backend sized (engine/core_builder.py)."""

    load_config: LoadConfig = LoadConfig()
    """The weights and tokenizer to load."""
    cache_config: CacheConfig = CacheConfig()
    """The KV cache pool."""
    scheduler_config: SchedulerConfig = SchedulerConfig()
    """Step budgets (max_model_len filled from the model at build)."""
    parallel_config: ParallelConfig = ParallelConfig()
    """Tensor parallelism."""
    device_config: DeviceConfig = DeviceConfig()
    """Where the model, the KV cache and the step run: the platform."""
    attention_config: AttentionConfig = AttentionConfig()
    """The attention implementation of every layer, and the compiled kernels' use."""
    quantization_config: QuantizationConfig = QuantizationConfig()
    """Activation precision of many-row matmuls over quantized weights."""
    lora_config: LoRAConfig | None = None
    """LoRA adapters, None when off."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, None when off."""
    structured_output_config: StructuredOutputConfig = StructuredOutputConfig()
    """The reasoning parser before grammars."""
    kv_transfer_config: KVTransferConfig | None = None
    """Disaggregated prefill, None when off."""
    sampling_config: SamplingConfig = SamplingConfig()
    """Sampling limits and defaults."""
    pooling_config: PoolingConfig = PoolingConfig()
    """Pooling models: runner, conversion, pooler overrides."""
    observability_config: ObservabilityConfig = ObservabilityConfig()
    """Logs, stats and test hooks."""
    multimodal_config: MultiModalConfig = MultiModalConfig()
    """Image inputs: where they may come from, how many per prompt, their bounds."""
    seed: int = 0
    """Seed of the engine's global generator (requests without their own seed)."""
    model_config: ModelConfig | None = None
    """The loaded model's description; None until the build loads it."""
    num_blocks: int = 0
    """Blocks in the KV pool, including the reserved null block 0; 0 until the build sizes it."""
