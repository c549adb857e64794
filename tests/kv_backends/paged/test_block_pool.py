"""BlockPool and its free queue: exact ids, LRU order, O(1) removal, eviction, ref counts."""

from __future__ import annotations

import time

import pytest

from pagedllm.kv_backends.paged.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedllm.kv_backends.paged.kv_cache_utils import hash_request_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_fresh_pool_hands_out_ids_in_order_and_never_block_zero() -> None:
    pool = BlockPool(num_blocks=6)
    assert pool.get_num_free_blocks() == 5
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 5]
    assert pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="cannot get 1 blocks, 0 free"):
        pool.get_new_blocks(1)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0


def test_blocks_have_slots() -> None:
    block = KVCacheBlock(3)
    with pytest.raises(AttributeError):
        block.other = 1  # type: ignore[attr-defined]


def test_free_appends_to_tail_in_the_given_order() -> None:
    pool = BlockPool(num_blocks=8)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    b = pool.get_new_blocks(2)  # 4, 5
    assert free_ids(pool) == [6, 7]
    pool.free_blocks(reversed(a))  # deepest first
    assert free_ids(pool) == [6, 7, 3, 2, 1]
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [6, 7, 3, 2, 1, 5, 4]
    # Handed out again from the head: LRU.
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [6, 7, 3, 2]
    assert pool.get_usage() == pytest.approx(4 / 7)


def test_queue_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVCacheBlock(i) for i in range(1, 6)]
    queue = FreeKVCacheBlockQueue(blocks)
    middle = blocks[2]
    queue.remove(middle)  # O(1): only the neighbours' links change
    assert middle.prev_free is None and middle.next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2, 4, 5]
    assert queue.num_free_blocks == 4
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[4])  # the tail
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 4]
    queue.append(middle)
    assert queue.popleft() is blocks[1]
    assert [b.block_id for b in queue.get_all_free_blocks()] == [4, 3]
    assert queue.num_free_blocks == 2


def test_touch_and_free_count_references() -> None:
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(2)  # 1, 2
    assert [b.ref_cnt for b in blocks] == [1, 1]
    pool.touch(blocks)  # a second request shares them
    assert [b.ref_cnt for b in blocks] == [2, 2]
    pool.free_blocks(reversed(blocks))
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert free_ids(pool) == [3, 4]  # still held by the other request
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1]
    # Touching a free block takes it out of the middle of the queue.
    pool.touch([blocks[1]])
    assert free_ids(pool) == [3, 4, 1] and blocks[1].ref_cnt == 1
    assert pool.get_num_free_blocks() == 3


def test_cached_block_is_reusable_while_free_and_evicted_from_the_head() -> None:
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    hashes = hash_request_tokens(range(12), 4)
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=3)
    assert [pool.get_cached_block(h) for h in hashes] == blocks
    assert blocks[0].block_hash == hashes[0]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 3, 2, 1]
    assert pool.get_cached_block(hashes[2]) is blocks[2]  # free but still cached
    assert pool.get_num_cached_blocks() == 3
    # Block 4 is uncached; block 3 (the deepest) is evicted next: its hash goes.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [4, 3]
    assert pool.get_cached_block(hashes[2]) is None
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_num_cached_blocks() == 2


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(num_blocks=5)
    hashes = hash_request_tokens(range(4), 4)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(first, hashes, 0, 1)
    pool.cache_full_blocks(second, hashes, 0, 1)
    assert pool.get_cached_block(hashes[0]) is first[0]
    assert second[0].block_hash is None
    # Freeing and reusing the duplicate must not drop the original's entry.
    pool.free_blocks(second)
    pool.get_new_blocks(3)
    assert pool.get_cached_block(hashes[0]) is first[0]


def test_groups_have_separate_cache_entries() -> None:
    pool = BlockPool(num_blocks=5)
    hashes = hash_request_tokens(range(4), 4)
    g0, g1 = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(g0, hashes, 0, 1, group_id=0)
    pool.cache_full_blocks(g1, hashes, 0, 1, group_id=1)
    assert pool.get_cached_block(hashes[0], group_id=0) is g0[0]
    assert pool.get_cached_block(hashes[0], group_id=1) is g1[0]


def test_reset_prefix_cache_only_when_no_block_is_in_use() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(2)
    hashes = hash_request_tokens(range(8), 4)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(hashes[0]) is None and blocks[0].block_hash is None
    assert pool.get_num_free_blocks() == 3


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    hashes = hash_request_tokens(range(4), 4)
    pool.cache_full_blocks(blocks, hashes, 0, 1)
    assert pool.get_cached_block(hashes[0]) is None


def test_queue_operations_are_constant_time() -> None:
    # 20,000 removals from the middle of a 40,000-block queue: instant when O(1), minutes if
    # each removal walked the list.
    blocks = [KVCacheBlock(i) for i in range(40_000)]
    queue = FreeKVCacheBlockQueue(blocks)
    start = time.perf_counter()
    for block in blocks[10_000:30_000]:
        queue.remove(block)
    for block in blocks[10_000:30_000]:
        queue.append(block)
    assert time.perf_counter() - start < 2.0
    assert queue.num_free_blocks == 40_000
    assert queue.popleft() is blocks[0]
