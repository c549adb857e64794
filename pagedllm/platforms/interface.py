"""``Platform``: what one device declares (its defaults, capabilities and refusals), so the
engine's default configuration and the checks on it follow from one object per device. No
torch at import: the front end resolves the platform before the core process starts."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, NamedTuple

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


class MemoryProfile(NamedTuple):
    total_bytes: int
    """The device's memory."""
    peak_bytes: int
    """Weights + the profiled forward's peak + memory outside torch's allocator (the
    profile's own small KV pool not included)."""


class Platform(ABC):
    device_type: ClassVar[str]
    """The torch device type of its tensors ("cpu", "cuda")."""
    default_attention_backend: ClassVar[str]
    """The attention implementation where the user names none (config.ATTENTION_BACKENDS)."""
    supported_dtypes: ClassVar[tuple[str, ...]]
    """Compute dtypes it runs (config.DType)."""
    supports_kv_quantization: ClassVar[bool] = False
    """Reads 8-bit KV codes (--kv-cache-dtype int8/fp8)."""
    supports_graph_capture: ClassVar[bool] = False
    """Captures decode steps as graphs (--cuda-graph-sizes)."""
    uses_host_memory: ClassVar[bool] = True
    """Its tensors live in host memory: the step's inputs are built there with no copy, the KV
    pool takes lazily zeroed host pages, the weights load in place."""
    runs_compiled_kernels: ClassVar[bool] = False
    """Runs the compiled C++/OpenMP kernels (kernels/csrc: the compiled attention decode)."""
    supports_weight_quantization: ClassVar[bool] = False
    """Runs 4/8-bit quantized weights (--quantization; the quantized GEMM kernels)."""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this process can run on the device."""

    @abstractmethod
    def check_and_update_config(self, config: EngineConfig) -> EngineConfig:
        """The configuration with this platform's defaults filled in; ValueError naming the
        first setting it cannot honour (docs/gpu.md lists them)."""

    @abstractmethod
    def resolve_dtype(self, requested: str, quantized_weights: bool) -> str:
        """The compute dtype for ``requested`` ("auto", "float32", "bfloat16") and weights
        that are (or are not) kept quantized."""

    @abstractmethod
    def kv_cache_budget(self, config: EngineConfig, measure: Callable[[], MemoryProfile]) -> int:
        """The KV pool's byte budget with the model in memory: the given
        ``kv_cache_memory_bytes``, else this platform's rule. ``measure`` profiles one forward
        at the step's largest shape (worker/memory_profile.py), for a rule that needs it."""

    @abstractmethod
    def free_memory_bytes(self) -> int:
        """Memory still free on the device (for the start-up log)."""

    def prepare_process(self) -> None:
        """Process-wide settings before the model and the KV cache allocate."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.device_type
