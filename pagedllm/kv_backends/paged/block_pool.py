"""The KV block pool: preallocated blocks, an O(1) free queue, and the prefix-cache map.

Invariants (checked by tests/kv_backends/paged/test_block_pool.py):
- A block is in the free queue iff its ``ref_cnt`` is 0. Block 0 (the null block) never is.
- A free block may still hold a cached hash: it is reusable by a prefix hit until it reaches
  the head of the free queue and is handed out again, which evicts it. So eviction is LRU:
  blocks are appended to the tail when freed and taken from the head.
- ``_cached`` maps a cache key to exactly the one block whose ``block_hash`` is that key.
- ``ref_cnts[i]`` and ``cached[i]`` mirror block i's ``ref_cnt`` and ``block_hash is not None``;
  ``owners[i]`` is NO_OWNER whenever ``ref_cnt`` is 0 (the KV manager fills it in). These
  arrays let the dashboard copy the pool's state between steps without touching a block.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from pagedllm.kv_backends.paged.kv_cache_utils import BlockHash


NO_OWNER = -1
"""``BlockPool.owners`` value of a block that no request holds."""

ORPHANED = -2
"""``BlockPool.owners`` value of a held block whose owner left while others still hold it;
the next view of the pool names one of the remaining holders."""


class KVCacheBlock:
    """One physical KV block. Its links are owned by ``FreeKVCacheBlockQueue``."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Cache key of the full block's contents, None while the block is not in the cache.
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeKVCacheBlockQueue:
    """An intrusive doubly-linked list of free blocks, LRU order: head = evicted first.

    The links live in the blocks themselves, so ``remove`` of a block in the middle (a prefix
    hit on a free cached block) is O(1), as are ``popleft`` and ``append``. Two sentinel
    blocks (id -1) bound the list so no operation has to special-case the ends.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the least recently freed)."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``, which must be in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail (evicted last)."""
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head to tail (for tests and debugging: O(n))."""
        out: list[KVCacheBlock] = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


def make_cache_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The pool's key for ``block_hash`` in KV cache group ``group_id``.

    Groups (sets of layers) share token positions, hence hashes, but each has its own
    physical blocks; group 0's key is the bare hash so single-group keys equal the hashes.
    """
    return block_hash if group_id == 0 else block_hash + group_id.to_bytes(2, "little")


class BlockPool:
    """All KV blocks of the engine, allocated once. Block 0 is the null block.

    The null block is never handed out or freed; it is the placeholder for block-table slots
    that hold no KV (e.g. positions that left a sliding window).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # Initially free in id order, so a fresh pool hands out 1, 2, 3, ...
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        # Mirrors of the blocks' state for cheap snapshots (see the module docstring). Written
        # one element at a time through array.array (a numpy scalar write costs ~10x more);
        # read as numpy views of the same memory.
        self.ref_cnts_mem = array("i", [0]) * num_blocks
        self.cached_mem = array("b", [0]) * num_blocks
        # Owner slot of each held block (an index into the KV manager's owner table).
        self.owners_mem = array("i", [NO_OWNER]) * num_blocks
        self.ref_cnts = np.frombuffer(self.ref_cnts_mem, dtype=np.intc)  # [num_blocks]
        self.cached = np.frombuffer(self.cached_mem, dtype=np.int8)  # [num_blocks] 0 or 1
        self.owners = np.frombuffer(self.owners_mem, dtype=np.intc)  # [num_blocks]
        # Called with each cached block that get_new_blocks evicts, before its hash is
        # dropped (the KV offload tiers copy it out: offload.py).
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    # ---- allocation --------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue, each with ref_cnt 1.

        A popped block that still holds a cached hash is evicted from the prefix cache.
        Raises ValueError if fewer blocks are free (callers check ``get_num_free_blocks``).
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks, {self.free_block_queue.num_free_blocks} free"
            )
        out = []
        ref_cnts = self.ref_cnts_mem
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if self.on_evict is not None and block.block_hash is not None:
                self.on_evict(block)
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            ref_cnts[block.block_id] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (prefix hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            self.ref_cnts_mem[block.block_id] = block.ref_cnt

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching 0 go to the tail in the given order.

        Callers pass a request's blocks deepest first, so that the blocks hashing the longest
        prefixes (the least likely to be shared) are evicted first.
        """
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            self.ref_cnts_mem[block.block_id] = block.ref_cnt
            if block.ref_cnt == 0:
                self.owners_mem[block.block_id] = NO_OWNER
                self.free_block_queue.append(block)

    # ---- prefix cache ------------------------------------------------------------------

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix cache.

        ``blocks`` is a request's block list for one group and ``block_hashes`` the hashes of
        its full blocks (at least ``num_full_blocks`` of them). A block already cached (a hit)
        is skipped. If another block already holds the same key (two requests computed the
        same prefix at once), this block stays uncached: block tables are append-only, so
        duplicates cannot be merged; the cached copy serves future hits.
        """
        if not self.enable_caching:
            return
        assert len(block_hashes) >= num_full_blocks <= len(blocks)
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                continue
            key = make_cache_key(block_hashes[i], group_id)
            if key not in self._cached:
                block.block_hash = key
                self._cached[key] = block
                self.cached_mem[block.block_id] = 1

    def cache_block(self, block: KVCacheBlock, key: BlockHash) -> None:
        """Enter one uncached block under ``key`` (its KV is loaded from an offload tier);
        a block already holding ``key`` keeps it and this one stays uncached."""
        if self.enable_caching and block.block_hash is None and key not in self._cached:
            block.block_hash = key
            self._cached[key] = block
            self.cached_mem[block.block_id] = 1

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """The block holding ``block_hash`` in group ``group_id``, or None (free or in use)."""
        return self._cached.get(make_cache_key(block_hash, group_id))

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop ``block`` from the prefix cache (its KV was never computed)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            removed = self._cached.pop(block.block_hash, None)
            assert removed is block
            block.block_hash = None
            self.cached_mem[block.block_id] = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, since a
        running request's blocks would otherwise be re-hashed inconsistently (as vLLM)."""
        num_used = self.num_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used > 0:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self.cached[:] = 0
        return True

    # ---- accounting --------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests, 0.0 .. 1.0."""
        num_usable = self.num_blocks - 1
        return 1.0 - self.free_block_queue.num_free_blocks / num_usable

    def get_num_cached_blocks(self) -> int:
        return len(self._cached)


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
