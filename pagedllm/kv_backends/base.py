"""``KVBackend``: what the engine builder, the front end and the dashboard ask of a backend.

A backend declares what it supports (checked against the engine configuration before the
model loads), builds its control-plane manager and the factory of its worker side from the loaded
model, and turns its manager's state into the dashboard's view (plain data, picklable, with
``to_json``). No torch at import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pagedllm.core.kv_manager import KVCapabilities, KVManager

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.platforms.interface import Platform
    from pagedllm.request import Request
    from pagedllm.worker.kv_worker import KVCacheWorker


class KVView(Protocol):
    """A backend's picture of its KV memory at one instant, for ``/dashboard/state``."""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; ``"kind"`` names the picture (``"blocks"`` or ``"pages"``)."""
        ...


@dataclass
class KVBuild:
    """A backend sized for a loaded model."""

    manager: KVManager
    config: EngineConfig
    """The engine configuration with the backend's sizes (num_blocks) filled in."""
    make_worker: Callable[[list[Any]], KVCacheWorker]
    """Builds the worker side over the model's Attention layers (binding their caches)."""
    block_size: int
    """Tokens per unit of the worker's cache (what the tensor-parallel workers are told)."""
    num_blocks: int
    summary: str
    """One line for the start-up log: the sizes and the resulting concurrency."""


class KVBackend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[KVCapabilities]
    """Its manager's capabilities (the manager class declares them; the backend names that
    declaration, so the two cannot drift)."""
    supports_speculation: ClassVar[bool] = True
    supports_tensor_parallel: ClassVar[bool] = True
    needs_host_memory: ClassVar[bool] = False
    """Its worker side maps host memory itself (mmap), so it runs only on a platform whose
    tensors live there (``Platform.uses_host_memory``; docs/gpu.md)."""
    fork_refusal: ClassVar[str] = ""
    """Why forks are refused (the user-facing message), where ``supports_forks`` is False."""

    @property
    def supports_prefix_caching(self) -> bool:
        return self.capabilities.prefix_caching

    @property
    def supports_forks(self) -> bool:
        """Sequence groups sharing KV: n > 1 and beam search."""
        return self.capabilities.forks

    @property
    def supports_kv_transfer(self) -> bool:
        return self.capabilities.kv_transfer

    def check_config(self, config: EngineConfig, platform: Platform) -> None:
        """ValueError naming the first setting of ``config`` this backend cannot honour on
        ``platform`` (the device's)."""
        name = f"kv_cache_backend={self.name!r}"
        if config.cache_config.enable_prefix_caching and not self.supports_prefix_caching:
            raise ValueError(
                f"prefix caching shares KV blocks between requests, which {name} cannot (each "
                "request owns its memory); drop enable_prefix_caching=True "
                "(--no-enable-prefix-caching) or use kv_cache_backend='paged'"
            )
        size = config.parallel_config.tensor_parallel_size
        if size > 1 and not self.supports_tensor_parallel:
            raise ValueError(
                f"tensor_parallel_size={size} does not support {name} yet; use --tensor-parallel-size 1 for it"
            )
        flag = f"--kv-cache-backend {self.name}"
        device = config.device_config.device
        if self.needs_host_memory and not platform.uses_host_memory:
            raise ValueError(
                f"{flag} is not supported on device={device!r} yet (its KV regions are host memory "
                "mapped with mmap); use the paged backend there, or --device cpu (docs/gpu.md)"
            )
        if config.speculative_config is not None and not self.supports_speculation:
            raise ValueError(
                f"--speculative-config is not supported with {flag} yet (drafts need lookahead "
                "slots and rollback); use the paged backend"
            )
        if config.kv_transfer_config is not None and not self.supports_kv_transfer:
            raise ValueError(
                f"--kv-transfer-config is not supported with {flag} (blocks travel under "
                "prefix-cache hashes, which this backend does not keep); use the paged backend"
            )
        self._check_kv_offload(config, flag, platform)

    def _check_kv_offload(self, config: EngineConfig, flag: str, platform: Platform) -> None:
        """The KV offload tiers keep prefix-cache blocks (docs/kv_offload.md)."""
        cache = config.cache_config
        if not cache.kv_offload:
            return
        tiers = "the KV offload tiers (--kv-offload-cpu-bytes, --kv-offload-dir)"
        if not self.supports_prefix_caching:
            raise ValueError(
                f"{tiers} are not supported with {flag}: they keep blocks evicted from the prefix "
                "cache, which this backend does not have; use the paged backend"
            )
        if not cache.enable_prefix_caching:
            raise ValueError(f"{tiers} keep prefix-cache blocks: they need prefix caching "
                             "(drop --no-enable-prefix-caching)")
        size = config.parallel_config.tensor_parallel_size
        if size > 1:
            raise ValueError(f"{tiers} do not run with tensor_parallel_size={size} yet; use --tensor-parallel-size 1")
        if not platform.uses_host_memory:
            raise ValueError(f"{tiers} run on --device cpu only yet (device={config.device_config.device!r})")

    def check_num_sequences(self, n: int) -> None:
        """ValueError for a request of ``n`` parallel sequences this backend cannot hold."""
        if n > 1 and not self.supports_forks:
            raise ValueError(f"n={n}: {self.fork_refusal}")

    @abstractmethod
    def build(self, config: EngineConfig, loaded: Any) -> KVBuild:
        """Size the manager and the worker's cache for ``loaded`` (a LoadedModel) under
        ``config``'s byte budget (``cache_config.kv_cache_memory_bytes``, set by the
        platform); ValueError if one request of max_model_len cannot fit."""

    @abstractmethod
    def view(self, manager: KVManager, running: Sequence[Request]) -> KVView:
        """The dashboard's picture of ``manager`` (taken between steps)."""
