"""KVCacheManager: which physical blocks hold each request's KV, and the prefix cache.

The paged backend's ``KVManager`` (core/kv_manager.py, the protocol the scheduler types
against); ``BlockPool`` is its private store.

Storage: per request, one append-only block list per KV cache *group* (a set of layers with
the same attention type). Groups share token positions, so every group of a request has the
same number of logical blocks and block ``i`` of any group holds positions
``[i * block_size, (i + 1) * block_size)``.

Sliding-window groups (``KVCacheGroupSpec.sliding_window``): at the top of
``allocate_slots`` a windowed group replaces the blocks that lie wholly before the first
position this step's queries can see (``num_computed_tokens - sliding_window + 1``) with
``pool.null_block`` and frees them; the lists keep their length, so logical indices stay
valid. A long request thus holds about ``sliding_window / block_size + 1`` blocks in such a
group. The runner keeps its own copy of the ids (it is not told of the frees): the stale ids
lie outside every query's window, which attention masks (the compiled decode kernel does not
even read them), and the slot mapping never writes there. Prefix hits still require every
hit block in every group (conservative: a windowed block evicted after leaving the window
shortens the hit).

Where later features go (each is an addition, not a rewrite):
- Prefix hits for a windowed group that need only the blocks inside the window (search
  from the right).
- Speculative rollback: a ``truncate(request, num_tokens)`` that pops and frees blocks past
  ``cdiv(num_tokens, block_size)`` (lookahead slots are already allocated and capped by
  ``max_model_len`` here). Rejected tokens are never cached: caching stops at
  ``request.num_tokens``, which drafts are not part of.
- Fork with copy-on-write (n > 1, beams): ``fork(parent, child)`` copies the parent's lists
  and takes a reference on every block; ``allocate_slots`` copies a shared (ref_cnt > 1),
  partially filled block before the first write into it and returns the (src, dst) pair in
  its ``KVAllocation`` for the scheduler to pass to the runner. Full shared blocks are never
  written again and stay shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from pagedllm.multimodal.inputs import mm_block_keys
from pagedllm.core.kv_manager import (
    KVAllocation,
    KVCapabilities,
    KVFigures,
    KVManager,
    KVTransfer,
    PrefixHit,
    cdiv,
)
from pagedllm.core.outputs import PrefixCacheStats
from pagedllm.kv_backends.paged.block_pool import BlockOwners, BlockPool, KVCacheBlock
from pagedllm.kv_backends.paged.kv_cache_utils import BlockHash, extend_block_hashes, first_block_extra_keys
from pagedllm.kv_backends.paged.offload import OffloadOps, OffloadStore
from pagedllm.request import Request

__all__ = ["KVCacheBlock", "KVCacheGroupSpec", "KVCacheManager", "KVFigures", "cdiv"]


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """The attention type shared by the layers of one KV cache group."""

    sliding_window: int | None = None
    """Tokens each query sees (itself included) on these layers; None for full attention."""

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 or None")


class TierBlock(NamedTuple):
    """A prefix hit found in a KV offload tier, not in the pool: ``allocate_slots`` gives it
    a fresh block and the worker loads ``data`` into it before the forward."""

    block_hash: BlockHash
    data: Any


class _RequestBlocks:
    """One request's blocks."""

    __slots__ = ("blocks", "num_cached_blocks", "owner_slot")

    def __init__(self, num_groups: int) -> None:
        self.blocks: list[list[KVCacheBlock]] = [[] for _ in range(num_groups)]  # [group][i]
        # Leading blocks already offered to the prefix cache (cached, a hit, or a duplicate).
        self.num_cached_blocks = 0
        # The request's slot in the owner table (BlockOwners), for the dashboard.
        self.owner_slot = 0


class _AllocationPlan(NamedTuple):
    """One ``allocate_slots`` call's need, per group alike."""

    num_computed: int
    """Computed tokens once the hit blocks are taken."""
    num_hit_blocks: int
    num_new_blocks: int
    """Fresh blocks appended to every group."""
    cow_index: int | None
    """Logical index of a shared, partly filled block this step writes into (copied first)."""
    skips: list[int]
    """Per group: leading hit blocks already out of its window (nulls take their place)."""


class KVCacheManager(KVManager, KVTransfer):
    """Allocates, shares (prefix cache) and frees the KV blocks of requests."""

    backend = "paged"
    capabilities = KVCapabilities(prefix_caching=True, forks=True, delayed_caching=True, kv_transfer=True)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        hash_extra_keys: tuple = (),
        num_groups: int = 1,
        group_specs: Sequence[KVCacheGroupSpec] | None = None,
    ) -> None:
        """``num_blocks`` includes the null block 0. ``hash_extra_keys`` are engine-wide keys
        (e.g. model name, dtype, block size) folded into every request's first block hash.
        ``group_specs`` gives each group's attention type (default: ``num_groups`` full
        attention groups); with it, ``num_groups`` is its length."""
        if group_specs is None:
            if num_groups < 1:
                raise ValueError(f"num_groups={num_groups} must be >= 1")
            group_specs = [KVCacheGroupSpec()] * num_groups
        if not group_specs:
            raise ValueError("group_specs must name at least one group")
        self.group_specs = tuple(group_specs)
        num_groups = len(self.group_specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_extra_keys = tuple(hash_extra_keys)
        self.num_groups = num_groups
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.owners = BlockOwners(self.block_pool)  # which request holds each block
        self._requests: dict[str, _RequestBlocks] = {}
        # Hashes of each request's full blocks, extended as its tokens grow. Kept across a
        # preemption (the tokens do not change); dropped when the request finishes.
        # The request object is kept to tell a reused request id from the same request.
        self._block_hashes: dict[str, tuple[Request, list[BlockHash]]] = {}
        self._stats = PrefixCacheStats()
        # Blocks kept alive past their request for a remote pull, by hold id.
        self._held: dict[str, list[KVCacheBlock]] = {}
        # KV offload tiers (offload.py; None: off): this step's evicted blocks to copy out
        # and tier blocks to load, for the worker side.
        self.offload: OffloadStore | None = None
        self._offload_stores: list[tuple[int, BlockHash]] = []
        self._offload_loads: dict[int, Any] = {}  # block id -> image

    def set_offload(self, store: OffloadStore) -> None:
        """Put the offload tiers behind the prefix cache (one KV cache group only)."""
        assert self.num_groups == 1, "KV offload needs one KV cache group"
        self.offload = store
        self.block_pool.on_evict = self._on_evict

    def _on_evict(self, block: KVCacheBlock) -> None:
        """A cached block leaves the pool: the worker copies it into the tiers before this
        step's forward, unless the tiers hold it already (a block loaded from them), or its
        KV was to be loaded from them this very step (the load is dropped: the block now
        serves someone else)."""
        assert block.block_hash is not None and self.offload is not None
        if self._offload_loads.pop(block.block_id, None) is None and not self.offload.holds(block.block_hash):
            self._offload_stores.append((block.block_id, block.block_hash))

    def prefetch(self, request: Request) -> None:
        """A request arrived: read the blocks of its prompt's chain that the pool lacks from
        the disk tier in the background, while it waits and other requests' steps run (its
        lookup then finds them in memory)."""
        if self.offload is None or self.offload.disk_dir is None or not self.enable_caching:
            return
        if request.sampling_params.prompt_logprobs is not None:
            return
        hashes = self._get_block_hashes(request)[: (request.num_tokens - 1) // self.block_size]
        first_missing = 0
        while first_missing < len(hashes) and self.block_pool.get_cached_block(hashes[first_missing]) is not None:
            first_missing += 1
        self.offload.prefetch(hashes[first_missing:])

    def take_offload_ops(self) -> OffloadOps | None:
        """This step's copies between the pool and the tiers (None: none, or tiers off)."""
        if not (self._offload_stores or self._offload_loads):
            return None
        ops = OffloadOps(self._offload_stores, list(self._offload_loads.items()))
        self._offload_stores, self._offload_loads = [], {}
        return ops

    def take_persist_ops(self) -> OffloadOps | None:
        """At shutdown: the cached blocks the disk tier lacks, most recently cached first
        (their disk writes are bounded in time by the caller)."""
        if self.offload is None or self.offload.disk_dir is None:
            return None
        cached = list(self.block_pool._cached.items())
        # A block whose load is still pending (restored since the last step) is in the tiers.
        stores = [(b.block_id, key) for key, b in reversed(cached)
                  if b.block_id not in self._offload_loads and not self.offload.on_disk(key)]
        return OffloadOps(stores) if stores else None

    def save_prefix(
        self, name: str, token_ids: list[int], cache_salt: str | None, read_blocks: Any
    ) -> int:
        """Save the cached blocks of ``token_ids``'s longest cached prefix (pool or tiers)
        under ``name`` in the disk tier; returns the tokens saved. ``read_blocks(ids)`` copies
        pool blocks out (the worker side's ``copy_out``)."""
        from pagedllm.kv_backends.paged.kv_cache_utils import hash_request_tokens
        from pagedllm.kv_backends.paged.saved_kv import saved_path, write_saved

        offload = self._require_offload()
        path = saved_path(offload, name)
        hashes = hash_request_tokens(token_ids, self.block_size,
                                     first_block_extra_keys(self.hash_extra_keys, cache_salt))
        found: list[Any] = []  # a pool block id, or an image
        for block_hash in hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is not None:
                pending = self._offload_loads.get(block.block_id)
                found.append(pending if pending is not None else block.block_id)
                continue
            data = offload.lookup(block_hash)
            if data is None:
                break
            found.append(data)
        pool_ids = [f for f in found if isinstance(f, int)]
        copied = iter(read_blocks(pool_ids) if pool_ids else [])
        images = [next(copied) if isinstance(f, int) else f for f in found]
        write_saved(offload, path, hashes[: len(images)], images, token_ids[: len(images) * self.block_size])
        return len(images) * self.block_size

    def restore_prefix(self, name: str) -> int:
        """Bring the blocks saved under ``name`` into the pool as cached blocks (free, most
        recently used) and into the CPU tier; returns the tokens restored. Their images are
        loaded before the next step's forward."""
        from pagedllm.kv_backends.paged.saved_kv import read_saved, saved_path

        offload = self._require_offload()
        hashes, images = read_saved(offload, saved_path(offload, name))
        room = self.block_pool.get_num_free_blocks()  # past it, restored blocks would evict each other
        for block_hash, image in zip(hashes, images):
            offload.store(block_hash, image)
            if self.block_pool.get_cached_block(block_hash) is not None:
                continue
            if room == 0:
                continue  # the pool is full: the tiers keep the rest
            room -= 1
            (block,) = self.block_pool.get_new_blocks(1)
            self.block_pool.cache_block(block, block_hash)
            self._offload_loads[block.block_id] = image
            self.block_pool.free_blocks([block])
        return len(images) * self.block_size

    def _require_offload(self) -> OffloadStore:
        if self.offload is None:
            raise ValueError("saving and restoring KV by name needs the KV offload tiers (--kv-offload-dir)")
        return self.offload

    def take_offload_stats(self) -> dict[str, dict[str, int]] | None:
        """Per tier counters since the previous call (None: tiers off)."""
        return self.offload.take_stats() if self.offload is not None else None

    # ---- the scheduler's interface -----------------------------------------------------

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest prefix of ``request``'s tokens whose KV is cached, per group.

        Returns (blocks per group, number of hit tokens). The hit is a whole number of blocks
        and at most ``num_tokens - 1`` tokens: the last token must be computed to get logits.
        Blocks are not referenced until ``allocate_slots`` is called with them.
        """
        empty: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        # A request asking for prompt logprobs must compute every prompt position itself.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return PrefixHit(empty, 0)
        hashes = self._get_block_hashes(request)
        num_hit = (request.num_tokens - 1) // self.block_size
        hit_blocks = empty
        offload = self.offload
        for group_id in range(self.num_groups):
            chain = hit_blocks[group_id]
            for block_hash in hashes[:num_hit]:
                block = self.block_pool.get_cached_block(block_hash, group_id)
                if block is None and offload is not None:  # the pool's miss, a tier's hit?
                    data = offload.lookup(block_hash)
                    block = TierBlock(block_hash, data) if data is not None else None
                if block is None:
                    break
                chain.append(block)
            # A hit must be present in every group; later groups search no further.
            num_hit = len(chain)
        hit_blocks = [chain[:num_hit] for chain in hit_blocks]
        num_hit_tokens = num_hit * self.block_size
        self._stats.requests += 1
        self._stats.queries += request.num_tokens
        self._stats.hits += num_hit_tokens
        return PrefixHit(hit_blocks, num_hit_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> KVAllocation | None:
        """Make room for ``request`` to hold the KV of this step's tokens.

        Slots are needed for ``request.num_computed_tokens + hit tokens + num_new_tokens +
        num_lookahead_tokens`` tokens (capped at ``max_model_len``), where the hit tokens are
        ``new_computed_blocks`` from ``get_computed_blocks`` (only for a request holding no
        blocks yet). Returns the ids of the blocks this call appended, per group (lists may
        be empty; prefix-hit blocks come first) with the blocks copied on write, or None if
        the pool cannot supply them; then nothing has changed.

        Blocks that become full with computed tokens (``num_computed + hits + num_new``, but
        never past ``request.num_tokens``) are entered into the prefix cache, unless
        ``delay_cache_blocks`` (their KV arrives later, from a remote instance: see
        ``cache_blocks``).
        """
        req = self._requests.get(request.request_id)
        if req is not None:
            # Blocks that left every window of this step are freed before counting the need.
            self._remove_skipped_blocks(req, request.num_computed_tokens)
        hits = new_computed_blocks or [[] for _ in range(self.num_groups)]
        plan = self._plan(request, req, hits, num_new_tokens, num_lookahead_tokens)
        if not self._can_supply(plan, hits):
            return None
        copied: list[tuple[int, int]] = []
        if plan.cow_index is not None:
            assert req is not None
            copied = self._copy_on_write(req, plan.cow_index)
        if req is None:
            req = self._requests[request.request_id] = _RequestBlocks(self.num_groups)
            req.owner_slot = self.owners.add(request.request_id)
        new_block_ids = self._append_blocks(req, hits, plan)
        if self.enable_caching and not delay_cache_blocks:
            num_full = min(plan.num_computed + num_new_tokens, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, req, num_full)
        return KVAllocation(new_block_ids, copied)

    def _plan(
        self,
        request: Request,
        req: _RequestBlocks | None,
        hits: list[list[KVCacheBlock]],
        num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> _AllocationPlan:
        """What ``allocate_slots`` needs from the pool, decided before anything changes."""
        num_existing = len(req.blocks[0]) if req is not None else 0
        num_hit_blocks = len(hits[0])
        assert len(hits) == self.num_groups
        assert not (num_hit_blocks and num_existing), "hits only for a request without blocks"
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_required_blocks = cdiv(
            min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len),
            self.block_size,
        )
        return _AllocationPlan(
            num_computed=num_computed,
            num_hit_blocks=num_hit_blocks,
            num_new_blocks=max(0, num_required_blocks - num_existing - num_hit_blocks),
            cow_index=self._cow_index(req, request.num_computed_tokens, num_new_tokens),
            # Per group, hit blocks already out of the window are not taken (null instead).
            skips=[
                min(self._num_skipped_blocks(group_id, num_computed), num_hit_blocks)
                for group_id in range(self.num_groups)
            ],
        )

    def _can_supply(self, plan: _AllocationPlan, hits: list[list[KVCacheBlock]]) -> bool:
        """Whether the free queue holds the plan's new blocks (and a copy-on-write copy)."""
        # Hit blocks that are free right now leave the free queue when touched; hits from
        # the offload tiers take fresh blocks.
        num_free_hits = num_tier_hits = 0
        for group, skip in zip(hits, plan.skips):
            for b in group[skip:]:
                if isinstance(b, TierBlock):
                    num_tier_hits += 1
                else:
                    num_free_hits += b.ref_cnt == 0
        num_needed = (plan.num_new_blocks + (plan.cow_index is not None)) * self.num_groups + num_tier_hits
        return num_needed <= self.block_pool.get_num_free_blocks() - num_free_hits

    def _append_blocks(
        self, req: _RequestBlocks, hits: list[list[KVCacheBlock]], plan: _AllocationPlan
    ) -> list[list[int]]:
        """Append the hit blocks (nulls for those out of a window) and the plan's new blocks
        to every group; returns the appended ids per group."""
        new_block_ids: list[list[int]] = []
        for blocks, group_hits, skip in zip(req.blocks, hits, plan.skips):
            start = len(blocks)
            taken = group_hits[skip:]
            # Touch before popping new blocks, so a free hit block cannot be evicted here.
            self.block_pool.touch([b for b in taken if not isinstance(b, TierBlock)])
            if any(isinstance(b, TierBlock) for b in taken):
                taken = self._load_tier_blocks(taken)
            blocks.extend([self.block_pool.null_block] * skip)
            blocks.extend(taken)
            blocks.extend(self.block_pool.get_new_blocks(plan.num_new_blocks))
            new_block_ids.append([b.block_id for b in blocks[start:]])
            self.owners.claim(req.owner_slot, new_block_ids[-1])
        # Hit blocks are cached already.
        req.num_cached_blocks = max(req.num_cached_blocks, plan.num_hit_blocks)
        return new_block_ids

    def _load_tier_blocks(self, taken: list[Any]) -> list[KVCacheBlock]:
        """Fresh blocks in place of the tier hits among ``taken``, entered into the prefix
        cache under their hashes; their images are loaded by the worker before the forward."""
        tier_hits = [b for b in taken if isinstance(b, TierBlock)]
        fresh = iter(self.block_pool.get_new_blocks(len(tier_hits)))
        out: list[KVCacheBlock] = []
        for b in taken:
            if isinstance(b, TierBlock):
                block = next(fresh)
                self.block_pool.cache_block(block, b.block_hash)
                self._offload_loads[block.block_id] = b.data
                out.append(block)
            else:
                out.append(b)
        return out

    # ---- disaggregated prefill (distributed/kv_transfer/): the KVTransfer capability ----

    def kv_transfer(self) -> KVTransfer:
        """This manager itself: its blocks travel under their prefix-cache hashes."""
        return self

    def get_block_hashes(self, request: Request) -> list[BlockHash]:
        """The prefix-cache hashes of the request's full blocks (stable across processes)."""
        return self._get_block_hashes(request)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's full blocks up to ``num_tokens`` into the prefix cache (their
        KV arrived after ``allocate_slots(..., delay_cache_blocks=True)``)."""
        req = self._requests[request.request_id]
        if self.enable_caching:
            self._cache_full_blocks(request, req, min(num_tokens, request.num_tokens) // self.block_size)

    def hold(self, hold_id: str, request: Request, num_blocks: int) -> list[int]:
        """Take a reference on the request's first ``num_blocks`` blocks (group 0) under
        ``hold_id``, so they outlive the request (a remote instance will pull them). Returns
        their ids."""
        assert self.num_groups == 1, "holding blocks for transfer needs one KV cache group"
        assert hold_id not in self._held, hold_id
        blocks = self._requests[request.request_id].blocks[0][:num_blocks]
        self.block_pool.touch(blocks)
        self._held[hold_id] = blocks
        return [b.block_id for b in blocks]

    def release_held(self, hold_id: str) -> None:
        """Drop a ``hold`` (unknown ids are ignored: a release can race an expiry)."""
        blocks = self._held.pop(hold_id, None)
        if blocks is not None:
            self.block_pool.free_blocks(reversed(blocks))

    @property
    def num_held(self) -> int:
        """Holds not yet released."""
        return len(self._held)

    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares every block of ``parent`` by reference (ref counts), including a
        partially filled last block, which the first write of either copies."""
        assert child.request_id not in self._requests, f"{child.request_id} holds blocks"
        src = self._requests[parent.request_id]
        dst = self._requests[child.request_id] = _RequestBlocks(self.num_groups)
        dst.owner_slot = self.owners.add(child.request_id)
        null = self.block_pool.null_block
        for blocks, parent_blocks in zip(dst.blocks, src.blocks):
            # Blocks that left a sliding window are the null block: shared, never counted.
            self.block_pool.touch([b for b in parent_blocks if b is not null])
            blocks.extend(parent_blocks)
        dst.num_cached_blocks = src.num_cached_blocks

    def get_kv_figures(self, request_id: str) -> KVFigures:
        """Blocks the request holds (over all groups) and how many of them are shared."""
        req = self._requests.get(request_id)
        if req is None:
            return KVFigures(0, 0)
        null = self.block_pool.null_block
        blocks = [b for group in req.blocks for b in group if b is not null]
        return KVFigures(len(blocks), sum(b.ref_cnt > 1 for b in blocks))

    def get_num_distinct_blocks(self, request_ids: list[str]) -> int:
        """Physical blocks held by any of the requests, each counted once (a group's memory)."""
        ids = {
            b.block_id
            for r in request_ids
            if (req := self._requests.get(r)) is not None
            for group in req.blocks
            for b in group
        }
        return len(ids)

    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Release every block of ``request``, deepest first so those are evicted first.

        A finished request (``request.is_finished``) also loses its block hashes; a preempted
        one keeps them for its prefix lookup when it resumes. With ``num_valid_tokens`` (a
        request taken back in the step that allocated for it), blocks past those tokens were
        entered into the prefix cache but never computed: they leave the cache.
        """
        req = self._requests.pop(request.request_id, None)
        if req is not None:
            if num_valid_tokens is not None:
                first_invalid = num_valid_tokens // self.block_size
                for blocks in req.blocks:
                    for block in blocks[first_invalid:]:
                        if block.ref_cnt == 1:
                            self.block_pool.uncache(block)
            for blocks in req.blocks:
                self.block_pool.free_blocks(reversed(blocks))
            self.owners.remove(req.owner_slot)
        if request.is_finished:
            self._block_hashes.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Physical block ids of the request per group (empty lists if it holds none)."""
        req = self._requests.get(request_id)
        if req is None:
            return [[] for _ in range(self.num_groups)]
        return [[b.block_id for b in blocks] for blocks in req.blocks]

    def get_num_held_blocks(self, request_id: str) -> list[int]:
        """Real (non-null) blocks the request holds, per group."""
        req = self._requests.get(request_id)
        if req is None:
            return [0] * self.num_groups
        null = self.block_pool.null_block
        return [sum(b is not null for b in blocks) for blocks in req.blocks]

    def max_blocks_per_request(self, num_tokens: int, max_new_tokens: int = 1) -> int:
        """Most blocks (summed over groups) one request of ``num_tokens`` tokens holds at once
        when a step computes at most ``max_new_tokens`` of its tokens."""
        num_blocks = cdiv(num_tokens, self.block_size)
        total = 0
        for spec in self.group_specs:
            if spec.sliding_window is None:
                total += num_blocks
            else:  # this step's tokens and the window before them, from any block offset
                span = spec.sliding_window - 1 + max_new_tokens
                total += min(num_blocks, cdiv(span, self.block_size) + 1)
        return total

    def get_num_blocks(self, request_id: str) -> int:
        """Logical blocks the request holds (the same in every group)."""
        req = self._requests.get(request_id)
        return len(req.blocks[0]) if req is not None else 0

    # ---- hooks of the KVManager protocol that blocks need nothing for -----------------

    def check_request(self, request: Request) -> None:
        """Every request is supported (blocks can be shared by sequence groups)."""

    def take_slots_to_release(self) -> list[int]:
        """Paged blocks are reused in place: nothing for the runner to release."""
        return []

    # ---- pool state and stats ----------------------------------------------------------

    bytes_per_block = 0
    """Bytes of one block over its group's layers, K and V (set by the engine builder)."""
    bytes_per_token = 0
    """Bytes of one token's K and V over every layer (set by the engine builder)."""

    @property
    def resident_bytes(self) -> int:
        """Bytes of the blocks held by requests (the pool's memory in use)."""
        return (self.num_blocks - 1 - self.block_pool.get_num_free_blocks()) * self.bytes_per_block

    @property
    def usage(self) -> float:
        """Fraction of the usable KV blocks held by requests, 0.0 .. 1.0."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached or not (the null block never counts)."""
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and no change) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The lookups since the previous call."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    # ---- internals ---------------------------------------------------------------------

    def _get_block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's full-block hashes, extended over any tokens appended since."""
        entry = self._block_hashes.get(request.request_id)
        if entry is None or entry[0] is not request:  # a new request (or a reused id)
            entry = self._block_hashes[request.request_id] = (request, [])
        hashes = entry[1]
        if len(hashes) < request.num_tokens // self.block_size:
            lora_key = request.lora_request.cache_key() if request.lora_request is not None else None
            extra = first_block_extra_keys(self.hash_extra_keys, request.cache_salt, lora_key)
            images = mm_block_keys(request.mm_features, self.block_size)
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, extra, images)
        return hashes

    def _cow_index(
        self, req: _RequestBlocks | None, num_computed: int, num_new_tokens: int
    ) -> int | None:
        """Logical index of a shared, partly filled block this step writes into, if any."""
        if req is None or num_new_tokens <= 0 or num_computed % self.block_size == 0:
            return None
        index = num_computed // self.block_size
        if index >= len(req.blocks[0]) or req.blocks[0][index].ref_cnt <= 1:
            return None
        return index

    def _copy_on_write(self, req: _RequestBlocks, index: int) -> list[tuple[int, int]]:
        """Give the request its own copy of the shared block at ``index``, in every group;
        returns the (src, dst) pairs whose KV the runner copies."""
        copied = []
        for blocks in req.blocks:
            src = blocks[index]
            (dst,) = self.block_pool.get_new_blocks(1)
            blocks[index] = dst
            self.block_pool.free_blocks([src])  # still referenced by its other holders
            self.owners.disown(req.owner_slot, [src.block_id])
            self.owners.claim(req.owner_slot, [dst.block_id])
            copied.append((src.block_id, dst.block_id))
        return copied

    def _num_skipped_blocks(self, group_id: int, num_computed_tokens: int) -> int:
        """Leading blocks of ``group_id`` that no query at or after ``num_computed_tokens``
        can see: with window w, the query at position p sees positions > p - w."""
        window = self.group_specs[group_id].sliding_window
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    def _remove_skipped_blocks(self, req: _RequestBlocks, num_computed_tokens: int) -> None:
        """Free the blocks of windowed groups that left the window; null blocks take their place."""
        null = self.block_pool.null_block
        for group_id, blocks in enumerate(req.blocks):
            num_skipped = min(self._num_skipped_blocks(group_id, num_computed_tokens), len(blocks))
            freed = []
            # Walk back from the window's edge; earlier blocks were nulled by earlier steps.
            for i in range(num_skipped - 1, -1, -1):
                if blocks[i] is null:
                    break
                freed.append(blocks[i])
                blocks[i] = null
            # Every freed block is full and computed, so it was cached already (if caching).
            assert num_skipped <= req.num_cached_blocks or not self.enable_caching or not freed
            self.block_pool.free_blocks(freed)
            self.owners.disown(req.owner_slot, [b.block_id for b in freed])

    def _cache_full_blocks(self, request: Request, req: _RequestBlocks, num_full: int) -> None:
        if num_full <= req.num_cached_blocks:
            return
        hashes = self._get_block_hashes(request)
        for group_id, blocks in enumerate(req.blocks):
            self.block_pool.cache_full_blocks(
                blocks, hashes, req.num_cached_blocks, num_full, group_id
            )
        req.num_cached_blocks = num_full
