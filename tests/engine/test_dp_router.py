"""The data-parallel router (engine/dp_router.py), model-free: prefix affinity, load, and
the fallback to the least loaded replica; the data-parallel settings' checks."""

from __future__ import annotations

import pytest

from pagedllm.config import ParallelConfig
from pagedllm.engine.dp_router import PrefixAffinityRouter, ReplicaLoad

BLOCK = 4


def make_router(num_replicas: int = 2, num_blocks: int = 100, **kwargs) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(BLOCK, **kwargs)
    for replica in range(num_replicas):
        router.add_replica(replica, num_blocks)
    return router


def idle(num_replicas: int = 2) -> dict[int, ReplicaLoad]:
    return {r: ReplicaLoad() for r in range(num_replicas)}


def test_block_hashes_chain_full_blocks_only():
    router = make_router()
    a = router.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # the partial third block has no hash
    b = router.block_hashes([1, 2, 3, 4, 5, 6, 7, 0])
    assert a[0] == b[0] and a[1] != b[1]
    c = router.block_hashes([0, 2, 3, 4, 5, 6, 7, 8])
    assert c[1] != a[1]  # a block's hash covers every token before it


def test_repeated_prefix_goes_to_the_replica_that_has_it():
    router = make_router()
    prefix = list(range(100, 116))
    loads = idle()
    first = router.choose(router.block_hashes(prefix + [1, 2]), loads)
    router.record(first, router.block_hashes(prefix + [1, 2]))
    loads[first].num_routed += 1
    # A distinct prompt goes to the other replica (it was sent fewer requests).
    other = router.choose(router.block_hashes(list(range(500, 520))), loads)
    assert other != first
    router.record(other, router.block_hashes(list(range(500, 520))))
    loads[other].num_routed += 1
    for suffix in ([3, 4, 5, 6], [7, 8, 9, 10], [11]):
        hashes = router.block_hashes(prefix + suffix)
        assert router.choose(hashes, loads) == first
        router.record(first, hashes)
        loads[first].num_routed += 1


def test_longest_prefix_wins():
    router = make_router(3)
    tokens = list(range(32))
    router.record(0, router.block_hashes(tokens[:8]))
    router.record(1, router.block_hashes(tokens[:24]))
    router.record(2, router.block_hashes(tokens[:16]))
    assert router.choose(router.block_hashes(tokens), idle(3)) == 1


def test_overloaded_replica_loses_its_prefix_to_the_least_loaded():
    router = make_router(balance_abs_threshold=2, balance_rel_threshold=1.5)
    hashes = router.block_hashes(list(range(16)))
    router.record(0, hashes)
    assert router.choose(hashes, {0: ReplicaLoad(2), 1: ReplicaLoad(0)}) == 0  # within the slack
    assert router.choose(hashes, {0: ReplicaLoad(6), 1: ReplicaLoad(1)}) == 1
    assert router.choose(hashes, {0: ReplicaLoad(0, kv_cache_usage=0.99), 1: ReplicaLoad(0)}) == 1


def test_no_match_goes_to_least_loaded_then_lowest_kv_usage():
    router = make_router(3)
    hashes = router.block_hashes(list(range(8)))
    loads = {0: ReplicaLoad(3), 1: ReplicaLoad(1, 0.5), 2: ReplicaLoad(1, 0.2)}
    assert router.choose(hashes, loads) == 2


def test_dead_replica_is_forgotten_and_only_live_ones_are_chosen():
    router = make_router()
    hashes = router.block_hashes(list(range(16)))
    router.record(1, hashes)
    router.remove_replica(1)
    assert router.choose(hashes, {0: ReplicaLoad()}) == 0
    router.add_replica(1, 100)  # back, with an empty cache
    assert router.matched_blocks(1, hashes) == 0


def test_map_is_bounded_by_the_replica_pool_and_forgets_deepest_first():
    router = make_router(num_blocks=3)
    hashes = router.block_hashes(list(range(20)))  # 5 blocks
    router.record(0, hashes)
    assert router.matched_blocks(0, hashes) == 3  # the first 3 kept: a prefix still matches


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel_size=0), "data_parallel_size=0 must be an integer >= 1"),
    (dict(data_parallel_size=2, data_parallel_backend="tcp"), "data_parallel_backend='tcp' is not one of mp, ray"),
    (dict(data_parallel_size=2, data_parallel_size_local=1), "runs every replica on this machine"),
    (dict(data_parallel_size=2, data_parallel_size_local=3, data_parallel_backend="ray"), "must be between 0 and"),
])
def test_parallel_config_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_llm_class_refuses_data_parallelism(tiny_llama_dir):
    from pagedllm import LLM

    with pytest.raises(ValueError, match="data parallelism runs behind `pagedllm serve`"):
        LLM(tiny_llama_dir, data_parallel_size=2)
