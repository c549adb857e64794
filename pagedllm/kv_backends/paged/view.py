"""The dashboard's picture of the paged block pool, taken between engine steps.

The block pool mirrors each block's ref count and cached flag in numpy arrays, and the owner
of each held block as a small integer slot (``BlockOwners``, block_pool.py), so a view
is a few array copies and vectorized comparisons: no Python work per block. Per-request work
(O(running requests), for the fragmentation figure) is the only loop.

Block states in ``PagedKVView.block_state`` (one uint8 per block, block 0 first):

- ``FREE`` (0): in the free queue, holding nothing reusable;
- ``FREE_CACHED`` (1): free, but still holding a cached prefix block (a prefix hit can revive
  it until it is evicted from the head of the free queue);
- ``IN_USE`` (2): held by at least one request;
- ``IN_USE_CACHED`` (3): held, and a full block entered into the prefix cache (sharable);
- ``NULL`` (4): block 0, the placeholder that never holds KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.kv_backends.paged.block_pool import NO_OWNER, ORPHANED
from pagedllm.kv_backends.paged.manager import KVCacheManager
from pagedllm.request import Request

FREE, FREE_CACHED, IN_USE, IN_USE_CACHED, NULL = range(5)
STATE_NAMES = ("free", "free_cached", "in_use", "in_use_cached", "null")


@dataclass
class PagedKVView:
    """The block pool at one instant (plain data)."""

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
    num_allocated_slots: int
    """Token slots in blocks held by requests (block_size per held block)."""
    num_empty_slots: int
    """Of those, slots holding no computed token yet: internal fragmentation."""

    def to_json(self) -> dict[str, Any]:
        """The block map and the KV figures, as plain JSON types."""
        state = self.block_state
        counts = np.bincount(state, minlength=len(STATE_NAMES))
        num_usable = len(state) - 1
        num_in_use = int(counts[IN_USE] + counts[IN_USE_CACHED])
        allocated = self.num_allocated_slots
        return {
            "kind": "blocks",
            "num_blocks": len(state),
            "block_size": self.block_size,
            "num_groups": self.num_groups,
            "state_names": list(STATE_NAMES),
            "block_state": state.tolist(),
            "ref_cnt": self.ref_cnt.tolist(),
            "owner": self.owner.tolist(),
            "requests": self.requests,
            "num_free": int(counts[FREE]),
            "num_free_cached": int(counts[FREE_CACHED]),
            "num_in_use": num_in_use,
            "num_in_use_cached": int(counts[IN_USE_CACHED]),
            "num_shared": int(np.count_nonzero(self.ref_cnt > 1)),
            "usage": num_in_use / num_usable if num_usable else 0.0,
            "num_allocated_slots": allocated,
            "num_empty_slots": self.num_empty_slots,
            "fragmentation": self.num_empty_slots / allocated if allocated else 0.0,
        }


def resolve_orphans(kv: KVCacheManager) -> None:
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


def count_empty_slots(kv: KVCacheManager, running: Sequence[Request]) -> int:
    """Slots of held blocks that hold no computed token: the unfilled tails of running
    requests' last blocks (and lookahead). A tail block shared by forked sequences counts
    once, with its fullest holder's fill."""
    block_size = kv.block_size
    fill: dict[int, int] = {}  # block id -> computed tokens in it
    for request in running:
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


def take_paged_view(kv: KVCacheManager, running: Sequence[Request]) -> PagedKVView:
    """The pool's block states, ref counts and owners, and the fill of running requests."""
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
    return PagedKVView(
        block_size=kv.block_size,
        num_groups=kv.num_groups,
        block_state=state,
        ref_cnt=ref_cnt,
        owner=owner,
        requests=list(kv.owners.request_ids),
        num_allocated_slots=num_held * kv.block_size,
        num_empty_slots=count_empty_slots(kv, running),
    )
