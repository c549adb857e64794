"""The control-plane KV protocol: what the scheduler and the engine ask of a KV backend.

``KVManager`` is the one type the scheduler holds. A backend (pagedllm/kv_backends/)
implements it: the paged backend with ``KVCacheManager`` (block pool, prefix cache,
copy-on-write forks), the slot backend with its own page accounting. Results are explicit
(``KVAllocation`` names the ids appended *and* the blocks copied this call); nothing is left
in attributes for the caller to read afterwards. No torch here.

Capabilities beyond the protocol's core are declared, not discovered by downcasting: each
manager class states its ``KVCapabilities``, and a caller that needs one asks for it
(``kv_transfer()``, ``allocate_slots(..., delay_cache_blocks=True)``); a manager without it
refuses by name with a ValueError.

Ids: ``block_ids[group][i]`` are whatever the backend's worker side needs to find a
request's KV (physical block ids for paged, a slot for a slot backend). The scheduler passes
them on to the runner unread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

from pagedllm.core.outputs import PrefixCacheStats
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division: units of ``b`` that hold ``a``."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCapabilities:
    """What a KV manager can do beyond the protocol's core (one declaration per backend)."""

    prefix_caching: bool
    """Full blocks are shared between requests under prefix-cache hashes."""
    forks: bool
    """A sequence group (n > 1, beams) shares its parent's KV (``fork``)."""
    delayed_caching: bool
    """``allocate_slots(..., delay_cache_blocks=True)``: the blocks' KV arrives later and
    enters the prefix cache through ``kv_transfer().cache_blocks``."""
    kv_transfer: bool
    """``kv_transfer()``: blocks held past their request and moved between instances under
    their prefix-cache hashes (disaggregated prefill)."""


class KVFigures(NamedTuple):
    num_blocks: int
    """Memory units (blocks or pages) the request holds, over all groups."""
    num_shared_blocks: int
    """Of those, units also held by another request (fork or prefix hit)."""


class KVAllocation(NamedTuple):
    """What one successful ``allocate_slots`` call changed."""

    block_ids: list[list[int]]
    """Ids appended to the request this call, per group (prefix-hit ids first; lists may be
    empty)."""
    copied_blocks: list[tuple[int, int]]
    """Copy-on-write: (src, dst) ids whose KV the runner copies before the forward; in the
    request's block table src becomes dst."""


class PrefixHit(NamedTuple):
    """A prefix-cache lookup: cached units per group (opaque to the caller) and hit tokens."""

    blocks: list[list[Any]]
    num_tokens: int


class KVTransfer(ABC):
    """The KV-transfer capability of a manager (disaggregated prefill,
    distributed/kv_transfer/): a request's full blocks travel under their prefix-cache
    hashes, are held past the request for a remote pull, and pulled blocks enter the prefix
    cache once their KV has arrived."""

    block_size: int
    """Tokens per block: the unit blocks are pulled and held in."""

    @abstractmethod
    def get_block_hashes(self, request: Request) -> list[bytes]:
        """The prefix-cache hashes of the request's full blocks (stable across processes)."""

    @abstractmethod
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's full blocks up to ``num_tokens`` into the prefix cache (their
        KV arrived after ``allocate_slots(..., delay_cache_blocks=True)``)."""

    @abstractmethod
    def hold(self, hold_id: str, request: Request, num_blocks: int) -> list[int]:
        """Keep the request's first ``num_blocks`` blocks alive under ``hold_id`` past the
        request; returns their ids."""

    @abstractmethod
    def release_held(self, hold_id: str) -> None:
        """Drop a ``hold`` (unknown ids are ignored: a release can race an expiry)."""

    @property
    @abstractmethod
    def num_held(self) -> int:
        """Holds not yet released."""

    @abstractmethod
    def get_num_blocks(self, request_id: str) -> int:
        """Logical blocks the request holds (the same in every group)."""


class KVManager(ABC):
    """Allocate, free, fork and look up the KV memory of requests (the scheduler's view)."""

    backend: ClassVar[str]
    """Registry name of the backend this manager belongs to (pagedllm/kv_backends/)."""
    capabilities: ClassVar[KVCapabilities]
    """What this manager can do beyond the core protocol; callers ask, never downcast."""
    bytes_per_token: int = 0
    """Bytes of one token's K and V over every layer (for the fragmentation figure)."""

    @abstractmethod
    def check_request(self, request: Request) -> None:
        """Raise ValueError, at submission, for a request this backend cannot hold."""

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of the request (never its last token); not yet taken."""

    @abstractmethod
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[Any]] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVAllocation | None:
        """Room for ``num_computed_tokens`` + hits + ``num_new_tokens`` + lookahead tokens
        (capped at max_model_len); None, with nothing changed, when memory is short.
        ``delay_cache_blocks``: the new blocks' KV arrives later, so they do not enter the
        prefix cache now (ValueError unless ``capabilities.delayed_caching``)."""

    @abstractmethod
    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release the request's memory (finished, preempted, or rolled back at admission;
        with ``num_valid_tokens``, KV past that many tokens was never computed)."""

    @abstractmethod
    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares ``parent``'s KV (n > 1, beams); ValueError where unsupported."""

    def kv_transfer(self) -> KVTransfer:
        """This manager's KV-transfer side; ValueError naming the backend where it has none
        (``capabilities.kv_transfer`` is False)."""
        raise ValueError(
            f"kv_cache_backend={self.backend!r} cannot transfer KV between instances (blocks "
            "travel under prefix-cache hashes, which it does not keep); use kv_cache_backend='paged'"
        )

    def check_delayed_caching(self, delay_cache_blocks: bool) -> None:
        """ValueError naming the backend when delayed caching is asked of a manager without it."""
        if delay_cache_blocks and not self.capabilities.delayed_caching:
            raise ValueError(
                f"kv_cache_backend={self.backend!r} has no prefix cache to enter blocks into "
                "later (delay_cache_blocks=True)"
            )

    @abstractmethod
    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """All ids of the request per group (empty lists if it holds none)."""

    @abstractmethod
    def get_kv_figures(self, request_id: str) -> KVFigures:
        """Units the request holds and how many of them are shared."""

    @abstractmethod
    def max_blocks_per_request(self, num_tokens: int, max_new_tokens: int = 1) -> int:
        """Most units one request of ``num_tokens`` tokens holds at once."""

    def prefetch(self, request: Request) -> None:
        """A request was queued: a backend with offload tiers may start reading its prefix
        (nothing for others)."""

    def take_offload_ops(self) -> Any:
        """This step's copies between the pool and the KV offload tiers, for the worker side
        (None: none; a backend without tiers has none)."""
        return None

    def take_persist_ops(self) -> Any:
        """At shutdown: copies of the cached blocks not yet in a persistent offload tier
        (None: none, or no such tier)."""
        return None

    def save_prefix(self, name: str, token_ids: list[int], cache_salt: str | None, read_blocks: Any) -> int:
        """Save the KV of ``token_ids``'s cached prefix under ``name``; returns its tokens
        (/v1/kv/save). ValueError naming the backend where it has no offload tiers."""
        raise ValueError(f"kv_cache_backend={self.backend!r} cannot save KV by name (it keeps no prefix-cache "
                         "blocks); use kv_cache_backend='paged' with --kv-offload-dir")

    def restore_prefix(self, name: str) -> int:
        """Bring the KV saved under ``name`` back; returns its tokens (/v1/kv/restore)."""
        raise ValueError(f"kv_cache_backend={self.backend!r} cannot restore KV by name (it keeps no prefix-cache "
                         "blocks); use kv_cache_backend='paged' with --kv-offload-dir")

    def take_offload_stats(self) -> dict[str, dict[str, int]] | None:
        """Per offload tier: hits, misses, stores, rejected (blocks, since the previous call)
        and bytes held; None without tiers."""
        return None

    @abstractmethod
    def take_slots_to_release(self) -> list[int]:
        """Ids whose memory the worker releases before this step's writes (then forgotten)."""

    # ---- usage -------------------------------------------------------------------------

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of the KV budget held by requests, 0.0 .. 1.0."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Units that can be handed out now."""

    @property
    @abstractmethod
    def resident_bytes(self) -> int:
        """KV bytes in use by the backend's accounting."""

    # ---- prefix cache ------------------------------------------------------------------

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (and no change) while any is in use."""

    @abstractmethod
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The lookups since the previous call."""
