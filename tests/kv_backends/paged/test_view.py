"""Model-free tests of the paged backend's dashboard view: exact block states, ref counts and owners
through fork, copy-on-write, prefix hits, preemption and frees, and the array mirrors agreeing
with the blocks at every step of randomized runs."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedllm.engine.kv_snapshot import take_kv_snapshot
from pagedllm.kv_backends.paged.view import FREE, FREE_CACHED, IN_USE, IN_USE_CACHED, NULL
from pagedllm.request import RequestStatus
from tests.core.utils import FakeRunner, make_group, make_request, make_scheduler, run_until_done


def check_snapshot(sched) -> None:
    """The snapshot agrees with the block objects, and each held block's owner holds it."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    snap = take_kv_snapshot(sched)
    holders: dict[int, set[str]] = {}
    for request_id, req in kv._requests.items():
        for blocks in req.blocks:
            for block in blocks:
                if block.block_id != 0:
                    holders.setdefault(block.block_id, set()).add(request_id)
    for block in pool.blocks[1:]:
        i = block.block_id
        assert snap.kv.ref_cnt[i] == block.ref_cnt == len(holders.get(i, ())), i
        cached = block.block_hash is not None
        expected = (IN_USE_CACHED if cached else IN_USE) if block.ref_cnt else (FREE_CACHED if cached else FREE)
        assert snap.kv.block_state[i] == expected, i
        if block.ref_cnt:
            assert snap.kv.requests[snap.kv.owner[i]] in holders[i], (i, snap.kv.owner[i], holders[i])
        else:
            assert snap.kv.owner[i] == -1
    assert snap.kv.block_state[0] == NULL
    assert snap.num_running == len(sched.running) and snap.num_waiting == len(sched.waiting)
    assert snap.kv.num_allocated_slots == len(holders) * kv.block_size
    assert 0 <= snap.kv.num_empty_slots <= snap.kv.num_allocated_slots


def test_fork_cow_and_orphaned_owner():
    sched = make_scheduler(block_size=4, num_blocks=16, max_num_batched_tokens=64)
    runner = FakeRunner(4, 16)
    sched.add_request(make_group("g", 3, num_prompt_tokens=10, max_tokens=5, ignore_eos=True))
    so = sched.schedule()  # the leader computes 9 prompt tokens: blocks 1, 2 full, 3 partial
    sched.update_from_output(so, runner.execute(so))
    snap = take_kv_snapshot(sched)
    assert list(snap.kv.block_state[:5]) == [NULL, IN_USE_CACHED, IN_USE_CACHED, IN_USE, FREE]
    assert list(snap.kv.ref_cnt[:4]) == [0, 1, 1, 1]
    assert [snap.kv.requests[o] for o in snap.kv.owner[1:4]] == ["0_g"] * 3
    assert (snap.kv.num_allocated_slots, snap.kv.num_empty_slots) == (12, 3)

    so = sched.schedule()  # fork: 1, 2 shared by three; 3 copied for two of them (4, 5)
    sched.update_from_output(so, runner.execute(so))
    snap = take_kv_snapshot(sched)
    assert list(snap.kv.ref_cnt[:6]) == [0, 3, 3, 1, 1, 1]
    assert [snap.kv.requests[o] for o in snap.kv.owner[3:6]] == ["2_g", "0_g", "1_g"]
    assert (snap.kv.num_allocated_slots, snap.kv.num_empty_slots) == (20, 3 * 2)  # 10 tokens each: 2 in 3, 4, 5
    check_snapshot(sched)

    # The leader, owner of the shared blocks 1 and 2, leaves: a remaining holder takes over.
    sched.finish_requests(["0_g"], RequestStatus.FINISHED_ABORTED)
    snap = take_kv_snapshot(sched)
    assert list(snap.kv.ref_cnt[:6]) == [0, 2, 2, 1, 0, 1]
    assert {snap.kv.requests[snap.kv.owner[1]], snap.kv.requests[snap.kv.owner[2]]} <= {"1_g", "2_g"}
    assert snap.kv.block_state[4] == FREE and snap.kv.owner[4] == -1
    check_snapshot(sched)

    run_until_done(sched, runner, on_step=lambda *_: check_snapshot(sched))
    snap = take_kv_snapshot(sched)
    assert set(snap.kv.block_state[1:]) <= {FREE, FREE_CACHED}
    assert np.all(snap.kv.owner == -1) and not np.any(snap.kv.ref_cnt)
    assert snap.kv.block_state[1] == snap.kv.block_state[2] == FREE_CACHED  # the prompt's full blocks
    assert snap.kv.requests == [None] * len(snap.kv.requests)


def test_prefix_hit_on_a_free_cached_block_is_owned_by_the_new_request():
    sched = make_scheduler(block_size=4, num_blocks=16)
    runner = FakeRunner(4, 16)
    sched.add_request(make_request("a", num_prompt_tokens=9, max_tokens=1))
    run_until_done(sched, runner)
    snap = take_kv_snapshot(sched)
    assert list(snap.kv.block_state[1:4]) == [FREE_CACHED, FREE_CACHED, FREE]
    sched.add_request(make_request("b", num_prompt_tokens=9, max_tokens=3))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    snap = take_kv_snapshot(sched)
    assert list(snap.kv.block_state[1:3]) == [IN_USE_CACHED, IN_USE_CACHED]
    assert [snap.kv.requests[o] for o in snap.kv.owner[1:3]] == ["b", "b"]
    check_snapshot(sched)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_runs_keep_the_mirrors_exact(seed: int):
    """Groups, shared prefixes and a pool small enough to preempt: checked after every step."""
    rng = random.Random(seed)
    sched = make_scheduler(block_size=4, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=8)
    runner = FakeRunner(4, 24, sample_fn=lambda req_id, toks: 10 + (len(toks) * 7 + len(req_id)) % 50)
    prefixes = [list(range(300, 312)), list(range(400, 408))]
    for i in range(10):
        prompt = rng.choice(prefixes) + [500 + i] * rng.randint(1, 6)
        kwargs = dict(prompt_token_ids=prompt, max_tokens=rng.randint(8, 24), ignore_eos=True)
        if i % 3 == 0:
            sched.add_request(make_group(f"g{i}", rng.randint(2, 3), **kwargs))
        else:
            sched.add_request(make_request(f"r{i}", **kwargs))
    run_until_done(sched, runner, on_step=lambda *_: check_snapshot(sched))
    assert sched.num_preemptions > 0
    check_snapshot(sched)
    assert sched.kv_cache_manager.num_free_blocks == 23
