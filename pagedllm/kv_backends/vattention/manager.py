"""VAttentionKVManager: the scheduler-side manager of the vattention KV backend.

vAttention (arXiv 2405.04437) keeps each request's KV virtually contiguous and backs it with
physical memory only as it grows. Here the worker reserves, per layer, K and V regions of
``num_slots`` slots of ``slot_capacity`` tokens with ``mmap(MAP_NORESERVE)``
(worker.py); the operating system supplies a page on its first write. This manager, a
``KVManager`` (core/kv_manager.py) as the paged ``KVCacheManager`` is, does
what the OS would only tell through the OOM killer: it charges those pages against the
``kv_cache_memory`` budget, so a request that cannot get pages makes the scheduler preempt,
exactly as with blocks.

Accounting, in pages of ``page_bytes`` (4 KiB, or 2 MiB with transparent huge pages): every
(K or V, layer) region of a slot holding ``n`` tokens has ``ceil(n * token_bytes /
page_bytes)`` resident pages, since each region starts page-aligned and pages appear on the
first write. A slot's resident count is a high-water mark: tokens are written at their
positions and nothing is unmapped while the slot is in use.

Reclamation (as the paper): a finished or preempted request's slot becomes idle and, with
``deferred_reclaim`` (the default), keeps its pages; a new request takes the idle slot whose
resident pages fit it best, and idle slots are released (``madvise(MADV_DONTNEED)``, done by
the runner from ``SchedulerOutput.kv_slots_to_release``) only when an allocation needs their
pages. Without it, a slot is released as soon as its request leaves.

The ids this manager hands to the runner are not blocks: a request's ``block_ids`` are
``[[slot]]`` (one group, one id), which is all the runner needs to find its KV.

Not supported (no physical page can be shared between slots): prefix caching, and any fork
(n > 1, beam search). ``check_request`` refuses those with a ValueError at submission; its
``KVCapabilities`` declare them (and KV transfer, delayed caching) absent, and the protocol's
``kv_transfer()`` and ``allocate_slots(..., delay_cache_blocks=True)`` refuse by name.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.kv_manager import KVAllocation, KVCapabilities, KVFigures, KVManager, PrefixHit, cdiv
from pagedllm.core.outputs import PrefixCacheStats
from pagedllm.request import Request

FORK_UNSUPPORTED = (
    "the vattention KV backend gives each sequence its own contiguous slot and cannot share "
    "KV pages between sequences, so it does not support n > 1 or beam search; use "
    "kv_cache_backend='paged' (--kv-cache-backend paged) for them"
)


class VAttentionKVManager(KVManager):
    """Slots and page accounting of the vattention backend."""

    backend = "vattention"
    capabilities = KVCapabilities(prefix_caching=False, forks=False, delayed_caching=False, kv_transfer=False)

    def __init__(
        self,
        num_pages: int,
        page_bytes: int,
        token_bytes: int,
        num_regions: int,
        num_slots: int,
        slot_capacity: int,
        max_model_len: int,
        deferred_reclaim: bool = True,
    ) -> None:
        """``num_pages`` pages of ``page_bytes`` make the budget; ``token_bytes`` is one
        token's K (or V) in one layer; ``num_regions`` is 2 x the number of layers."""
        if slot_capacity < max_model_len:
            raise ValueError(f"slot_capacity={slot_capacity} < max_model_len={max_model_len}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.token_bytes = token_bytes
        self.num_regions = num_regions
        self.num_slots = num_slots
        self.slot_capacity = slot_capacity
        self.max_model_len = max_model_len
        self.deferred_reclaim = deferred_reclaim
        self.bytes_per_token = token_bytes * num_regions  # K and V over every layer
        self._slot_of: dict[str, int] = {}  # request id -> slot
        self._resident = [0] * num_slots  # resident pages per region, per slot
        self._idle = set(range(num_slots))
        self._used_pages = 0  # num_regions * sum(_resident)
        self._to_release: list[int] = []
        self._stats = PrefixCacheStats()

    def pages_for(self, num_tokens: int) -> int:
        """Resident pages of one region holding ``num_tokens`` tokens."""
        return cdiv(num_tokens * self.token_bytes, self.page_bytes)

    # ---- the scheduler's interface -----------------------------------------------------

    def check_request(self, request: Request) -> None:
        """Refuse, at submission, a request that would need shared KV (a sequence group)."""
        if request.group_id is not None or request.pending_forks:
            raise ValueError(f"request {request.request_id!r}: {FORK_UNSUPPORTED}")

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """No prefix cache: nothing is ever computed in advance."""
        return PrefixHit([[]], 0)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[Any]] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVAllocation | None:
        """Charge the pages the request's slot needs for ``num_computed_tokens +
        num_new_tokens + num_lookahead_tokens`` tokens (capped at max_model_len), giving it
        a slot first if it has none. Returns ``[[slot]]`` for a request that just got its
        slot, ``[[]]`` otherwise, or None (nothing changed) if the budget cannot supply the
        pages even after releasing every idle slot."""
        self.check_delayed_caching(delay_cache_blocks)
        assert not new_computed_blocks or not any(new_computed_blocks), "no prefix cache here"
        rid = request.request_id
        slot = self._slot_of.get(rid)
        num_tokens = min(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        need = self.pages_for(num_tokens)
        new = slot is None
        if new:
            if not self._idle:
                return None
            slot = self._best_fit(need)
        extra = self.num_regions * max(0, need - self._resident[slot])
        unmapped = self.num_pages - self._used_pages
        if extra > unmapped:
            reclaimable = sorted((s for s in self._idle if s != slot), key=lambda s: -self._resident[s])
            short = extra - unmapped
            if short > self.num_regions * sum(self._resident[s] for s in reclaimable):
                return None
            for s in reclaimable:
                if short <= 0:
                    break
                short -= self.num_regions * self._resident[s]
                self._release(s)
        if new:
            self._idle.discard(slot)
            self._slot_of[rid] = slot
        self._used_pages += self.num_regions * max(0, need - self._resident[slot])
        self._resident[slot] = max(need, self._resident[slot])
        return KVAllocation([[slot]] if new else [[]], [])

    def fork(self, parent: Request, child: Request) -> None:
        raise ValueError(FORK_UNSUPPORTED)

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """The request leaves its slot (finished, preempted, or rolled back at admission);
        the slot's pages stay for reuse (deferred) or are released now."""
        slot = self._slot_of.pop(request.request_id, None)
        if slot is None:
            return
        self._idle.add(slot)
        if not self.deferred_reclaim:
            self._release(slot)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        slot = self._slot_of.get(request_id)
        return [[slot]] if slot is not None else [[]]

    def get_slot(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    def reserved_pages(self) -> int:
        """Pages of one region of a slot filled to its capacity (the reservation)."""
        return self.pages_for(self.slot_capacity)

    def slot_pages(self) -> tuple[dict[str, int], list[int]]:
        """Request id -> its slot, and each slot's resident pages per region."""
        return dict(self._slot_of), list(self._resident)

    def is_idle(self, slot: int) -> bool:
        return slot in self._idle

    def get_kv_figures(self, request_id: str) -> KVFigures:
        """Pages of the request's slot (over all regions); none shared."""
        slot = self._slot_of.get(request_id)
        return KVFigures(0 if slot is None else self.num_regions * self._resident[slot], 0)

    def get_num_distinct_blocks(self, request_ids: list[str]) -> int:
        return sum(self.get_kv_figures(r).num_blocks for r in set(request_ids))

    def get_num_held_blocks(self, request_id: str) -> list[int]:
        return [self.get_kv_figures(request_id).num_blocks]

    def get_num_blocks(self, request_id: str) -> int:
        return self.get_kv_figures(request_id).num_blocks

    def max_blocks_per_request(self, num_tokens: int, max_new_tokens: int = 1) -> int:
        """Pages one request of ``num_tokens`` tokens holds (over all regions)."""
        return self.num_regions * self.pages_for(min(num_tokens, self.slot_capacity))

    def take_slots_to_release(self) -> list[int]:
        """Slots whose pages the runner must release (madvise) before this step's writes."""
        slots, self._to_release = self._to_release, []
        return slots

    # ---- pool state and stats ----------------------------------------------------------

    @property
    def _idle_pages(self) -> int:
        return self.num_regions * sum(self._resident[s] for s in self._idle)

    @property
    def usage(self) -> float:
        """Fraction of the page budget charged to slots in use (idle slots' pages count as
        free: they are released on demand)."""
        return (self._used_pages - self._idle_pages) / self.num_pages if self.num_pages else 0.0

    @property
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now: never resident, or resident in an idle slot
        (released on demand), as the paged pool counts its cached free blocks."""
        return self.num_pages - self._used_pages + self._idle_pages

    @property
    def resident_bytes(self) -> int:
        """Bytes of KV pages resident by the engine's accounting (idle slots included)."""
        return self._used_pages * self.page_bytes

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is cached

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    # ---- internals ---------------------------------------------------------------------

    def _best_fit(self, need: int) -> int:
        """The idle slot whose resident pages cover ``need`` with the least to spare; else
        the idle slot with the most resident pages (fewest new page faults)."""
        fits = [s for s in self._idle if self._resident[s] >= need]
        if fits:
            return min(fits, key=lambda s: (self._resident[s], s))
        return max(self._idle, key=lambda s: (self._resident[s], -s))

    def _release(self, slot: int) -> None:
        if self._resident[slot]:
            self._used_pages -= self.num_regions * self._resident[slot]
            self._resident[slot] = 0
            self._to_release.append(slot)


def vattention_layout(
    token_bytes: int, max_model_len: int, align_bytes: int
) -> int:
    """Tokens per slot: max_model_len rounded up so that each (region, slot) span is a
    multiple of ``align_bytes`` (so slots start page- or huge-page-aligned)."""
    import math

    step = align_bytes // math.gcd(align_bytes, token_bytes)
    return cdiv(max_model_len, step) * step
