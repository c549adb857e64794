"""KVCacheManager and prefix caching, model-free: exact block ids for hits, misses, eviction."""

from __future__ import annotations

import pytest

from pagedllm.kv_backends.paged.manager import KVCacheManager
from pagedllm.request import Request, RequestStatus

from tests.core.utils import make_kv_cache_manager, make_request

PROMPT = list(range(100, 116))  # 16 tokens = 4 blocks of 4


def ids(blocks_per_group: list) -> list[list[int]]:
    return [[b.block_id for b in group] for group in blocks_per_group]


def run_prefill(kv: KVCacheManager, request: Request) -> list[list[int]]:
    """Look up, allocate and 'compute' the whole prompt, as the scheduler would."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    allocation = kv.allocate_slots(request, request.num_tokens - num_hit, hit_blocks)
    assert allocation is not None and allocation.copied_blocks == []
    request.num_computed_tokens = request.num_tokens
    return allocation.block_ids


def finish(kv: KVCacheManager, request: Request) -> None:
    request.status = RequestStatus.FINISHED_STOPPED
    kv.free(request)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def test_allocate_extends_and_returns_only_new_blocks() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    a = make_request("a", PROMPT[:10])
    assert kv.allocate_slots(a, 6).block_ids == [[1, 2]]  # a chunk of 6 tokens
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 2).block_ids == [[]]  # 8 tokens still fit in 2 blocks
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 2).block_ids == [[3]]
    assert kv.get_block_ids("a") == [[1, 2, 3]] and kv.get_num_blocks("a") == 3
    assert kv.usage == pytest.approx(3 / 10) and kv.num_free_blocks == 7
    finish(kv, a)
    assert kv.get_block_ids("a") == [[]] and kv.num_free_blocks == 10
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]  # deepest first to the tail


def test_full_hit_returns_exact_blocks_and_leaves_one_token_to_compute() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    a = make_request("a", PROMPT)
    assert run_prefill(kv, a) == [[1, 2, 3, 4]]
    finish(kv, a)
    b = make_request("b", PROMPT)
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    # All 4 blocks are cached, but the last token must be recomputed: 3 blocks, 12 tokens.
    assert ids(hit_blocks) == [[1, 2, 3]] and num_hit == 12
    assert kv.allocate_slots(b, 4, hit_blocks).block_ids == [[1, 2, 3, 5]]
    assert [blk.ref_cnt for blk in hit_blocks[0]] == [1, 1, 1]
    # A prompt of exactly two cached blocks hits only one of them.
    c = make_request("c", PROMPT[:8])
    assert ids(kv.get_computed_blocks(c)[0]) == [[1]]
    # One more token and both blocks hit.
    d = make_request("d", PROMPT[:9])
    hit_blocks, num_hit = kv.get_computed_blocks(d)
    assert ids(hit_blocks) == [[1, 2]] and num_hit == 8


def test_partial_hit_shares_blocks_by_reference() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    a = make_request("a", PROMPT)
    run_prefill(kv, a)  # a keeps running: its blocks are in use, and still hit
    b = make_request("b", PROMPT[:8] + [7] * 8)
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert ids(hit_blocks) == [[1, 2]] and num_hit == 8
    assert kv.allocate_slots(b, 8, hit_blocks).block_ids == [[1, 2, 5, 6]]
    blocks = kv.block_pool.blocks
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4, 5, 6)] == [2, 2, 1, 1, 1, 1]
    finish(kv, a)
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 0]
    assert free_ids(kv)[-2:] == [4, 3]


def test_hit_stops_at_the_first_block_whose_prefix_differs() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    run_prefill(kv, make_request("a", PROMPT))
    for pos, expected in [(0, []), (3, []), (4, [1]), (9, [1, 2]), (13, [1, 2, 3])]:
        tokens = list(PROMPT) + [1]
        tokens[pos] = 5  # change one token: no block from its block on may hit
        assert ids(kv.get_computed_blocks(make_request(f"b{pos}", tokens))[0]) == [expected], pos


def test_eviction_is_lru_deepest_block_first() -> None:
    kv = make_kv_cache_manager(num_blocks=11)  # 10 usable blocks
    a = make_request("a", PROMPT[:12])
    assert run_prefill(kv, a) == [[1, 2, 3]]
    finish(kv, a)
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    x = make_request("x", [9] * 28)
    assert run_prefill(kv, x) == [[4, 5, 6, 7, 8, 9, 10]]  # uncached free blocks go first
    y = make_request("y", [8] * 3)
    assert run_prefill(kv, y) == [[3]]  # then a's deepest block is evicted
    assert kv.block_pool.get_cached_block(kv._get_block_hashes(x)[0]) is not None
    a2 = make_request("a2", PROMPT[:12] + [1])
    hit_blocks, num_hit = kv.get_computed_blocks(a2)
    assert ids(hit_blocks) == [[1, 2]] and num_hit == 8


def test_no_hit_across_cache_salts() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    run_prefill(kv, make_request("a", PROMPT, cache_salt="tenant-1"))
    assert kv.get_computed_blocks(make_request("b", PROMPT, cache_salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(make_request("c", PROMPT))[1] == 0
    assert kv.get_computed_blocks(make_request("d", PROMPT, cache_salt="tenant-1"))[1] == 12


def test_engine_keys_separate_caches() -> None:
    a = make_request("a", PROMPT)
    h1 = KVCacheManager(11, 4, 64, hash_extra_keys=("model-a",))._get_block_hashes(a)
    h2 = KVCacheManager(11, 4, 64, hash_extra_keys=("model-b",))._get_block_hashes(a)
    assert h1[0] != h2[0]


def test_no_hit_after_reset_and_no_reset_while_in_use() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    a = make_request("a", PROMPT)
    run_prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(make_request("b", PROMPT))[1] == 12
    finish(kv, a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("c", PROMPT)) == ([[]], 0)


def test_only_computed_known_tokens_are_cached_not_lookahead() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    a = make_request("a", PROMPT[:10])
    assert kv.allocate_slots(a, 6).block_ids == [[1, 2]]
    a.num_computed_tokens = 6
    assert kv.block_pool.get_num_cached_blocks() == 1  # 6 computed tokens: one full block
    # The rest of the prompt plus 8 lookahead slots (speculative tokens): 18 tokens.
    assert kv.allocate_slots(a, 4, num_lookahead_tokens=8).block_ids == [[3, 4, 5]]
    a.num_computed_tokens = 10
    assert kv.block_pool.get_num_cached_blocks() == 2  # 10 known tokens: two full blocks
    # Lookahead never reaches past max_model_len.
    kv2 = make_kv_cache_manager(num_blocks=11, max_model_len=12)
    b = make_request("b", PROMPT[:10])
    assert kv2.allocate_slots(b, 10, num_lookahead_tokens=8).block_ids == [[1, 2, 3]]


def test_failed_allocation_changes_nothing_and_counts_free_hit_blocks() -> None:
    kv = make_kv_cache_manager(num_blocks=6)  # 5 usable blocks
    a = make_request("a", PROMPT)
    run_prefill(kv, a)
    finish(kv, a)  # 4 cached free blocks + 1 uncached
    b = make_request("b", PROMPT + [1] * 8)
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16
    # 6 blocks are needed, 4 of them hits: the 2 new ones must not evict the hits.
    before = free_ids(kv)
    assert kv.allocate_slots(b, 8, hit_blocks) is None
    assert free_ids(kv) == before and kv.get_block_ids("b") == [[]]
    assert all(blk.ref_cnt == 0 for blk in hit_blocks[0])
    c = make_request("c", PROMPT + [1] * 4)  # needs 1 new block: fits
    hit_blocks, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 4, hit_blocks).block_ids == [[1, 2, 3, 4, 5]]
    assert kv.num_free_blocks == 0


def test_multiple_groups_share_positions_not_blocks() -> None:
    kv = make_kv_cache_manager(num_blocks=11, num_groups=2)
    a = make_request("a", PROMPT[:8])
    assert run_prefill(kv, a) == [[1, 2], [3, 4]]
    assert kv.get_num_blocks("a") == 2 and kv.num_free_blocks == 6
    finish(kv, a)
    b = make_request("b", PROMPT[:9])
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert ids(hit_blocks) == [[1, 2], [3, 4]] and num_hit == 8
    assert kv.allocate_slots(b, 1, hit_blocks).block_ids == [[1, 2, 5], [3, 4, 6]]
    # A hit must exist in every group: evict group 1's second block and only one block hits.
    kv.block_pool._evict(kv.block_pool.blocks[4])
    c = make_request("c", PROMPT[:9])
    assert ids(kv.get_computed_blocks(c)[0]) == [[1], [3]]


def test_prefix_cache_stats_count_tokens_and_reset_on_read() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    run_prefill(kv, make_request("a", PROMPT))
    run_prefill(kv, make_request("b", PROMPT + [1]))
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 33, 16)
    assert stats.hit_rate == pytest.approx(16 / 33)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_caching_disabled() -> None:
    kv = make_kv_cache_manager(num_blocks=11, enable_caching=False)
    run_prefill(kv, make_request("a", PROMPT))
    assert kv.get_computed_blocks(make_request("b", PROMPT)) == ([[]], 0)
    assert kv.block_pool.get_num_cached_blocks() == 0
    assert kv.make_prefix_cache_stats().queries == 0


def test_free_forgets_hashes_only_when_finished() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    a = make_request("a", PROMPT)
    run_prefill(kv, a)
    a.status = RequestStatus.PREEMPTED
    kv.free(a)
    assert "a" in kv._block_hashes  # reused when it resumes
    finish(kv, a)
    assert kv._block_hashes == {}


def test_a_reused_request_id_gets_fresh_hashes() -> None:
    kv = make_kv_cache_manager(num_blocks=11)
    a = make_request("a", PROMPT)
    run_prefill(kv, a)
    a.status = RequestStatus.PREEMPTED
    kv.free(a)  # keeps a's hashes, keyed by "a"
    other = make_request("a", [7] * 16)  # a different request under the same id
    assert kv.get_computed_blocks(other) == ([[]], 0)
