"""Sliding-window KV groups, model-free: exact block ids as blocks leave the window."""

from __future__ import annotations

import pytest

from pagedllm.kv_backends.paged.manager import KVCacheGroupSpec, KVCacheManager
from pagedllm.request import RequestStatus

from tests.core.utils import make_request

WINDOW = 8  # tokens; block_size 4
PROMPT = list(range(100, 140))  # 40 tokens = 10 blocks


def make_manager(enable_caching: bool = True, num_blocks: int = 32) -> KVCacheManager:
    specs = [KVCacheGroupSpec(None), KVCacheGroupSpec(WINDOW)]
    return KVCacheManager(num_blocks, 4, 256, enable_caching=enable_caching, group_specs=specs)


def test_windowed_group_frees_blocks_that_left_the_window() -> None:
    kv = make_manager()
    a = make_request("a", PROMPT)
    assert kv.allocate_slots(a, 16).block_ids == [[1, 2, 3, 4], [5, 6, 7, 8]]
    a.num_computed_tokens = 16
    # Queries from position 16 see positions > 16 - 8, i.e. from 9 (block 2): blocks 0, 1 go.
    assert kv.allocate_slots(a, 16).block_ids == [[9, 10, 11, 12], [13, 14, 15, 16]]
    assert kv.get_block_ids("a")[1] == [0, 0, 7, 8, 13, 14, 15, 16]
    a.num_computed_tokens = 32
    # From position 32 the window starts at 25 (block 6): blocks 2..5 go too.
    assert kv.allocate_slots(a, 8).block_ids == [[17, 18], [19, 20]]
    assert kv.get_block_ids("a") == [
        [1, 2, 3, 4, 9, 10, 11, 12, 17, 18],
        [0, 0, 0, 0, 0, 0, 15, 16, 19, 20],
    ]
    assert kv.get_num_held_blocks("a") == [10, 4] and kv.get_num_blocks("a") == 10
    assert kv.num_free_blocks == 31 - 14
    a.num_computed_tokens = 40
    # A decode step at position 40 (window from 33, block 8) frees block 6 (15) and then 16.
    a.append_output_token_ids([7])
    assert kv.allocate_slots(a, 1).block_ids == [[21], [22]]
    assert kv.get_block_ids("a")[1] == [0, 0, 0, 0, 0, 0, 0, 0, 19, 20, 22]
    assert kv.get_num_held_blocks("a") == [11, 3]
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert kv.num_free_blocks == 31 and kv.get_num_held_blocks("a") == [0, 0]


def test_prefix_hit_takes_only_window_blocks_of_the_windowed_group() -> None:
    kv = make_manager()
    a = make_request("a", PROMPT)
    for start in (0, 16, 32):
        a.num_computed_tokens = start
        assert kv.allocate_slots(a, min(16, 40 - start)) is not None
    a.num_computed_tokens = 40
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)  # freed (out-of-window) blocks stay cached until evicted
    b = make_request("b", PROMPT)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 36  # 9 blocks, found in both groups
    allocation = kv.allocate_slots(b, 4, hits)
    assert allocation is not None
    new = allocation.block_ids
    # Computing from position 36 needs positions >= 29 (block 7): group 1 takes hits 7, 8 only.
    assert new[0] == [1, 2, 3, 4, 9, 10, 11, 12, 17, 21]
    assert new[1][:7] == [0] * 7 and new[1][7:9] == [16, 19] and len(new[1]) == 10
    assert kv.get_num_held_blocks("b") == [10, 3]


def test_long_request_holds_window_sized_kv_without_caching() -> None:
    kv = make_manager(enable_caching=False, num_blocks=64)
    a = make_request("a", [1] * 4, max_tokens=None)
    a.num_computed_tokens = 0
    assert kv.allocate_slots(a, 4).block_ids == [[1], [2]]
    a.num_computed_tokens = 4
    for _ in range(200):
        a.append_output_token_ids([5])
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        held = kv.get_num_held_blocks("a")
        # The window (8 positions, from any offset in a block) spans at most 3 blocks.
        assert held[0] == -(-a.num_computed_tokens // 4) and held[1] <= 3
    assert kv.max_blocks_per_request(204) == 51 + 3
    assert kv.max_blocks_per_request(204, max_new_tokens=16) == 51 + 7  # cdiv(7 + 16, 4) + 1


def test_group_spec_validation() -> None:
    with pytest.raises(ValueError, match="sliding_window=0 must be >= 1"):
        KVCacheGroupSpec(0)
    assert KVCacheManager(8, 4, 64, num_groups=2).group_specs == (KVCacheGroupSpec(),) * 2
