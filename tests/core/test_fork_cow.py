"""Model-free tests of sequence groups: fork, copy-on-write with exact block ids, group
admission and preemption, and every block free at the end."""

from __future__ import annotations

from pagedllm.request import RequestStatus
from tests.core.utils import (
    FakeRunner,
    make_group,
    make_kv_cache_manager,
    make_request,
    make_scheduler,
    run_until_done,
)


def test_fork_shares_blocks_and_cow_copies_the_partial_block():
    kv = make_kv_cache_manager(num_blocks=16, block_size=4)
    parent = make_request("p", num_prompt_tokens=10)
    assert kv.allocate_slots(parent, 9).block_ids == [[1, 2, 3]]  # 9 tokens: blocks 1, 2 full, 3 partial
    parent.num_computed_tokens = 9
    child = make_request("c", num_prompt_tokens=10)
    child.num_computed_tokens = 9
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [[1, 2, 3]]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 2]
    assert kv.get_kv_figures("c") == (3, 3)
    assert kv.get_num_distinct_blocks(["p", "c"]) == 3

    # The parent writes position 9 into shared block 3: it gets a copy (block 4).
    assert kv.allocate_slots(parent, 1) == ([[]], [(3, 4)])
    assert kv.get_block_ids("p") == [[1, 2, 4]]
    assert kv.block_pool.blocks[3].ref_cnt == 1
    # The child is now block 3's only holder: it writes in place, no copy.
    assert kv.allocate_slots(child, 1) == ([[]], [])
    assert kv.get_block_ids("c") == [[1, 2, 3]]
    assert kv.get_kv_figures("c") == (3, 2)  # full blocks 1, 2 stay shared
    assert kv.get_num_distinct_blocks(["p", "c"]) == 4

    for r in (parent, child):
        r.status = RequestStatus.FINISHED_STOPPED
        kv.free(r)
    assert kv.num_free_blocks == 15


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = make_kv_cache_manager(num_blocks=16, block_size=4)
    parent, child = make_request("p", num_prompt_tokens=9), make_request("c", num_prompt_tokens=9)
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert kv.allocate_slots(parent, 1) == ([[3]], [])
    assert kv.allocate_slots(child, 1) == ([[4]], [])


def test_cow_fails_cleanly_without_a_free_block():
    kv = make_kv_cache_manager(num_blocks=4, block_size=4)  # blocks 1..3
    parent, child = make_request("p", num_prompt_tokens=12), make_request("c", num_prompt_tokens=12)
    assert kv.allocate_slots(parent, 11).block_ids == [[1, 2, 3]]
    parent.num_computed_tokens = child.num_computed_tokens = 11
    kv.fork(parent, child)
    assert kv.allocate_slots(parent, 1) is None  # the copy needs a block; nothing changed
    assert kv.get_block_ids("p") == [[1, 2, 3]] and kv.block_pool.blocks[3].ref_cnt == 2


def test_scheduler_forks_group_after_prompt_and_copies_on_write():
    sched = make_scheduler(block_size=4, num_blocks=64, max_num_batched_tokens=64)
    runner = FakeRunner(4, 64, sample_fn=lambda req_id, toks: 10 + int(req_id[0]))
    sched.add_request(make_group("g", 3, num_prompt_tokens=10, max_tokens=5, ignore_eos=True))

    so = sched.schedule()  # the leader computes the prompt but its last token
    assert so.num_scheduled_tokens == {"0_g": 9}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["0_g"]
    assert sched.update_from_output(so, runner.execute(so)) == []

    so = sched.schedule()  # fork: the others join, sharing blocks 1, 2 and partial block 3
    assert so.num_scheduled_tokens == {"0_g": 1, "1_g": 1, "2_g": 1}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["1_g", "2_g"]
    assert so.blocks_to_copy == [(3, 4), (3, 5)]  # the last writer keeps block 3
    assert so.scheduled_cached_reqs[0].copied_blocks == [(3, 4)]
    assert [r.block_ids for r in so.scheduled_new_reqs] == [[[1, 2, 5]], [[1, 2, 3]]]
    kv = sched.kv_cache_manager
    assert kv.get_num_distinct_blocks(["0_g", "1_g", "2_g"]) == 5
    assert kv.get_kv_figures("1_g") == (3, 2)
    outs = sched.update_from_output(so, runner.execute(so))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("0_g", [10]), ("1_g", [11]), ("2_g", [12])]

    outputs = run_until_done(sched, runner)
    assert {r: len(o) for r, o in outputs.items()} == {"0_g": 4, "1_g": 4, "2_g": 4}
    assert kv.num_free_blocks == 63


def test_group_is_preempted_and_resumed_together():
    # 12 usable blocks of 4: two groups of 2 with 6-token prompts and 12 outputs cannot both fit.
    sched = make_scheduler(block_size=4, num_blocks=13, max_num_batched_tokens=32)
    runner = FakeRunner(4, 13, sample_fn=lambda req_id, toks: 10 + len(toks) % 7)
    sched.add_request(make_group("a", 2, num_prompt_tokens=6, max_tokens=12, ignore_eos=True))
    sched.add_request(make_group("b", 2, prompt_token_ids=list(range(200, 206)), max_tokens=12, ignore_eos=True))
    group_of = {"0_a": "a", "1_a": "a", "0_b": "b", "1_b": "b"}

    def check(so, _outs):
        # Members of a group are always running together or waiting together.
        running = {r.request_id for r in sched.running}
        for g in "ab":
            members = {r for r, grp in group_of.items() if grp == g and r in sched.requests}
            if members and not any(sched.requests[m].pending_forks for m in members):
                assert members <= running or not members & running, (g, running)

    outputs = run_until_done(sched, runner, on_step=check)
    assert sched.num_preemptions > 0
    assert all(sum(len(o.new_token_ids) for o in outs) == 12 for outs in outputs.values())
    assert sched.kv_cache_manager.num_free_blocks == 12


def test_abort_group_frees_everything():
    sched = make_scheduler(block_size=4, num_blocks=32)
    runner = FakeRunner(4, 32)
    sched.add_request(make_group("g", 4, num_prompt_tokens=10, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    sched.finish_requests([f"{i}_g" for i in range(4)], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 31
