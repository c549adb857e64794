"""A compact picture of the KV block pool for the dashboard, taken between engine steps.

The block pool mirrors each block's ref count and cached flag in numpy arrays, and the owner
of each held block as a small integer slot (``BlockOwners``), so a snapshot is a few array
copies and vectorized comparisons: no Python work per block. Per-request work (O(running
requests), for the fragmentation figure) is the only loop.

Block states in ``KVSnapshot.block_state`` (one uint8 per block, block 0 first):

- ``FREE`` (0): in the free queue, holding nothing reusable;
- ``FREE_CACHED`` (1): free, but still holding a cached prefix block (a prefix hit can revive
  it until it is evicted from the head of the free queue);
- ``IN_USE`` (2): held by at least one request;
- ``IN_USE_CACHED`` (3): held, and a full block entered into the prefix cache (sharable);
- ``NULL`` (4): block 0, the placeholder that never holds KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.core.block_pool import NO_OWNER, BlockPool

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler

FREE, FREE_CACHED, IN_USE, IN_USE_CACHED, NULL = range(5)
STATE_NAMES = ("free", "free_cached", "in_use", "in_use_cached", "null")

ORPHANED = -2
"""``BlockPool.owners`` value of a held block whose owner left while others still hold it;
the next snapshot names one of the remaining holders."""


class BlockOwners:
    """Gives each request holding blocks a small owner slot, recorded per block in
    ``pool.owners``: the request that took the block from the free queue (or, after that
    request left, another holder). Slots are reused, so the table stays short."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.request_ids: list[str | None] = []  # [slot]
        self._free_slots: list[int] = []

    def add(self, request_id: str) -> int:
        """A slot for a request that starts holding blocks."""
        if self._free_slots:
            slot = self._free_slots.pop()
            self.request_ids[slot] = request_id
        else:
            slot = len(self.request_ids)
            self.request_ids.append(request_id)
        return slot

    def claim(self, slot: int, block_ids: Sequence[int]) -> None:
        """Own the blocks among ``block_ids`` that have no owner (just taken from the free
        queue); blocks already owned (a prefix hit on a held block) keep their owner."""
        owners = self.pool.owners_mem
        for block_id in block_ids:
            if block_id and owners[block_id] == NO_OWNER:
                owners[block_id] = slot

    def disown(self, slot: int, block_ids: Sequence[int]) -> None:
        """The request left these blocks while it lives on (copy-on-write, sliding window)."""
        owners = self.pool.owners_mem
        for block_id in block_ids:
            if owners[block_id] == slot:
                owners[block_id] = ORPHANED

    def remove(self, slot: int) -> None:
        """The request released all its blocks; call after the pool's ``free_blocks``, so
        that the blocks still held are exactly those others hold."""
        owners = self.pool.owners
        owners[owners == slot] = ORPHANED
        self.request_ids[slot] = None
        self._free_slots.append(slot)


@dataclass
class KVSnapshot:
    """The KV pool and the scheduler's queues at one instant between steps (plain data)."""

    block_size: int
    num_groups: int
    block_state: np.ndarray
    """[num_blocks] uint8: FREE, FREE_CACHED, IN_USE, IN_USE_CACHED or NULL (see above)."""
    ref_cnt: np.ndarray
    """[num_blocks] int32: requests holding each block (> 1: shared)."""
    owner: np.ndarray
    """[num_blocks] int32: index into ``requests`` of a holder, -1 for unheld blocks."""
    requests: list[str | None]
    """Request ids by owner slot (None: a free slot)."""
    num_running: int
    num_waiting: int
    num_preempted: int
    """Waiting requests that were preempted (they resume by recomputing, with prefix hits)."""
    num_preemptions_total: int
    num_allocated_slots: int
    """Token slots in blocks held by requests (block_size per held block)."""
    num_empty_slots: int
    """Of those, slots holding no computed token yet: internal fragmentation."""
    take_seconds: float = 0.0
    """Time this snapshot took to build in the engine."""
    cost_seconds_mean: float = 0.0
    """Mean full cost of the engine's earlier snapshots (build, pickle, send)."""
    step_seconds_mean: float = 0.0
    """Mean duration of the engine's last 32 steps (the snapshot's cost is against this)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Backend-specific views, e.g. ``"vattention"``: resident pages per slot (see the
    dashboard's docs); empty for the paged backend."""


def resolve_orphans(kv: Any) -> None:
    """Name a current holder of every block whose owner has left. Runs only when such blocks
    exist and walks the held blocks once; the result is written back, so steady state is
    array copies only."""
    if not np.any(kv.block_pool.owners == ORPHANED):
        return
    owners = kv.block_pool.owners_mem
    for req in kv._requests.values():
        for blocks in req.blocks:
            for block in blocks:
                if owners[block.block_id] == ORPHANED:
                    owners[block.block_id] = req.owner_slot


def count_empty_slots(scheduler: Scheduler) -> int:
    """Slots of held blocks that hold no computed token: the unfilled tails of running
    requests' last blocks (and lookahead). A tail block shared by forked sequences counts
    once, with its fullest holder's fill."""
    kv = scheduler.kv_cache_manager
    block_size = kv.block_size
    fill: dict[int, int] = {}  # block id -> computed tokens in it
    for request in scheduler.running:
        req = kv._requests.get(request.request_id)
        if req is None:
            continue
        num_computed = request.num_computed_tokens
        first_partial = num_computed // block_size
        for blocks in req.blocks:
            for i in range(first_partial, len(blocks)):
                block_id = blocks[i].block_id
                if block_id == 0:
                    continue
                filled = min(block_size, max(0, num_computed - i * block_size))
                fill[block_id] = max(fill.get(block_id, 0), filled)
    return sum(block_size - f for f in fill.values())


def take_kv_snapshot(scheduler: Scheduler) -> KVSnapshot:
    """The pool's block states, ref counts and owners, and the queue figures."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    resolve_orphans(kv)
    ref_cnt = pool.ref_cnts.copy()
    held = ref_cnt > 0
    state = np.where(held, IN_USE, FREE).astype(np.uint8)
    state += pool.cached.view(np.uint8)  # FREE -> FREE_CACHED, IN_USE -> IN_USE_CACHED
    state[0] = NULL
    owner = np.where(held, pool.owners, NO_OWNER).astype(np.int32)
    owner[owner < 0] = NO_OWNER
    num_held = int(np.count_nonzero(held))
    return KVSnapshot(
        block_size=kv.block_size,
        num_groups=kv.num_groups,
        block_state=state,
        ref_cnt=ref_cnt,
        owner=owner,
        requests=list(kv.owners.request_ids),
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_preempted=sum(r.num_preemptions > 0 for r in scheduler.waiting),
        num_preemptions_total=scheduler.num_preemptions,
        num_allocated_slots=num_held * kv.block_size,
        num_empty_slots=count_empty_slots(scheduler),
    )
