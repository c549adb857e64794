"""--scheduling-policy priority, model-free: lower priority values first, ties by arrival; a
preemption takes the lowest priority (largest value), latest arrival, first (vLLM's rule)."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import RequestStatus
from tests.core.utils import FakeRunner, make_group, make_request, make_scheduler, run_until_done


def runner_for(scheduler: Scheduler) -> FakeRunner:
    kv = scheduler.kv_cache_manager
    return FakeRunner(kv.block_size, kv.num_blocks)


def test_waiting_is_ordered_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    a = make_request("a", priority=5, arrival_time=1.0, max_tokens=2)
    b = make_request("b", priority=0, arrival_time=2.0, max_tokens=2)
    c = make_request("c", priority=5, arrival_time=4.0, max_tokens=2)
    d = make_request("d", priority=0, arrival_time=3.0, max_tokens=2)
    for r in (a, b, c, d):
        scheduler.add_request(r)
    assert list(scheduler.waiting) == [b, d, a, c]
    admitted: list[str] = []

    def on_step(so, _outputs) -> None:
        admitted.extend(new.req_id for new in so.scheduled_new_reqs)

    run_until_done(scheduler, runner_for(scheduler), on_step=on_step)
    assert admitted == ["b", "d", "a", "c"]


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a = make_request("a", priority=5, arrival_time=1.0)
    b = make_request("b", priority=0, arrival_time=2.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert list(scheduler.waiting) == [a, b]


def _three_running(policy: str, priorities: tuple[int, int, int]):
    """8 usable blocks of 4 tokens: a and b hold 3 blocks each, c one; one block is left."""
    scheduler = make_scheduler(max_num_seqs=3, num_blocks=9, scheduling_policy=policy)
    runner = runner_for(scheduler)
    a = make_request("a", [5] * 12, max_tokens=20, priority=priorities[0], arrival_time=1.0)
    b = make_request("b", [6] * 12, max_tokens=20, priority=priorities[1], arrival_time=2.0)
    c = make_request("c", [7] * 4, max_tokens=20, priority=priorities[2], arrival_time=3.0)
    for r in (a, b, c):
        scheduler.add_request(r)
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 12, "b": 12, "c": 4}
    scheduler.update_from_output(so, runner.execute(so))
    return scheduler, runner, (a, b, c)


def test_preemption_takes_the_lowest_priority_even_before_the_requester() -> None:
    # a takes the last free block; b needs one: a (priority 2, the lowest) is preempted
    # although it runs first and was already scheduled in this step; c goes on.
    scheduler, runner, (a, b, c) = _three_running("priority", (2, 0, 1))
    so = scheduler.schedule()
    assert so.finished_req_ids == {"a"} and a.status == RequestStatus.PREEMPTED
    assert so.num_scheduled_tokens == {"b": 1, "c": 1}
    assert list(scheduler.waiting) == [a] and scheduler.running == [b, c]
    scheduler.update_from_output(so, runner.execute(so))
    run_until_done(scheduler, runner)  # the fake runner checks every KV slot it reads
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in (a, b, c))


def test_fcfs_preempts_the_newest_instead() -> None:
    scheduler, _, (a, b, c) = _three_running("fcfs", (2, 0, 1))
    so = scheduler.schedule()
    assert so.finished_req_ids == {"c"} and so.num_scheduled_tokens == {"a": 1, "b": 1}


def test_a_request_that_is_the_lowest_preempts_itself_and_the_step_goes_on() -> None:
    # a takes the last free block; b (priority 2) needs one and is itself the lowest: it
    # leaves, and c, after it, is still scheduled (with a block b freed).
    scheduler, runner, (a, b, c) = _three_running("priority", (0, 2, 1))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "c": 1}
    assert so.finished_req_ids == {"b"} and list(scheduler.waiting) == [b]
    scheduler.update_from_output(so, runner.execute(so))
    run_until_done(scheduler, runner)


def test_ties_preempt_the_latest_arrival() -> None:
    scheduler, _, (a, b, c) = _three_running("priority", (1, 1, 1))
    so = scheduler.schedule()
    assert so.finished_req_ids == {"c"}


def test_a_group_is_preempted_whole_and_requeued_together() -> None:
    # 16 usable blocks: the group grows to 12 (a shared 2-block prompt), h to 7.
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=17, scheduling_policy="priority")
    runner = runner_for(scheduler)
    group = make_group("g", 2, prompt_token_ids=[5] * 8, max_tokens=20)
    for member in [group, *group.pending_forks]:
        member.priority, member.arrival_time = 3, 1.0
    high = make_request("h", [6] * 8, max_tokens=20, priority=0, arrival_time=2.0)
    scheduler.add_request(group)
    scheduler.add_request(high)
    member = group.pending_forks[0]
    run_until_done(scheduler, runner)
    # The group (priority 3) gave way to h (priority 0), both sequences together.
    assert group.num_preemptions >= 1 and member.num_preemptions == group.num_preemptions
    assert high.num_preemptions == 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in (group, member, high))


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy='lifo' is not one of 'fcfs', 'priority'"):
        SchedulerConfig(scheduling_policy="lifo")  # type: ignore[arg-type]
