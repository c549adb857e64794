"""The scheduler, model-free: budgets, chunked prefill, preemption, stops, aborts."""

from __future__ import annotations

import random

import pytest

from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import RequestStatus

from .utils import (
    EOS,
    SAMPLED_TOKEN,
    FakeRunner,
    make_request,
    make_scheduler,
    output_token_ids,
    run_until_done,
)


def runner_for(scheduler: Scheduler, sample_fn=None) -> FakeRunner:
    kv = scheduler.kv_cache_manager
    return FakeRunner(kv.block_size, kv.num_blocks, sample_fn)


def assert_all_released(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not scheduler.has_unfinished_requests() and scheduler.requests == {}
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert kv.usage == 0.0
    assert kv._requests == {} and kv._block_hashes == {}


@pytest.mark.parametrize("seed", range(5))
def test_randomized_run_respects_budgets_and_finishes_everything(seed: int) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(
        max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64, num_blocks=41
    )
    runner = runner_for(scheduler)
    kv = scheduler.kv_cache_manager
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    pending = []
    for i in range(150):  # shared prefixes exercise prefix hits and eviction
        suffix = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 20))]
        prompt = (rng.choice(prefixes) + suffix)[:40]
        max_tokens = rng.choice([None, rng.randrange(1, 30)])
        pending.append(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    expected = {
        r.request_id: min(r.max_tokens or 10**9, 64 - r.num_prompt_tokens) for r in pending
    }
    aborted: set[str] = set()
    outputs: dict[str, list[EngineCoreOutput]] = {}
    num_full_steps = num_full_batches = num_hit_tokens = 0
    for _ in range(5000):
        while pending and rng.random() < 0.6:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        if scheduler.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        num_preemptions = scheduler.num_preemptions
        so = scheduler.schedule()
        if scheduler.num_preemptions > num_preemptions:  # memory is short: admit no one
            assert so.scheduled_new_reqs == []
        assert so.total_num_scheduled_tokens <= 16
        num_full_steps += so.total_num_scheduled_tokens == 16
        num_hit_tokens += sum(new.num_computed_tokens for new in so.scheduled_new_reqs)
        assert len(so.num_scheduled_tokens) <= 6 and scheduler.num_running <= 6
        num_full_batches += scheduler.num_running == 6
        for request in scheduler.running:
            assert request.num_computed_tokens <= 63
            assert kv.get_num_blocks(request.request_id) * 4 >= request.num_computed_tokens
        for out in scheduler.update_from_output(so, runner.execute(so)):
            outputs.setdefault(out.request_id, []).append(out)
    else:
        raise AssertionError("did not finish")
    # The run must have stressed what it checks: full budgets, preemption, prefix hits, aborts.
    assert num_full_steps > 50 and num_full_batches > 50 and scheduler.num_preemptions > 5
    assert num_hit_tokens > 0 and len(aborted) >= 3
    for request_id, num_expected in expected.items():
        if request_id in aborted:
            continue
        tokens = output_token_ids(outputs[request_id])
        assert tokens == [SAMPLED_TOKEN] * num_expected, request_id
        assert outputs[request_id][-1].finish_reason == "length"
    scheduler.schedule()  # flush the last finished ids
    assert_all_released(scheduler)


def test_long_prompt_is_chunked_while_decodes_get_one_token_each_step() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=256, max_num_seqs=8, max_model_len=4096, num_blocks=1024,
        block_size=16,
    )
    runner = runner_for(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"d{i}", [10 + i] * 10, max_tokens=100))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"d0": 10, "d1": 10, "d2": 10}
    scheduler.update_from_output(so, runner.execute(so))

    scheduler.add_request(make_request("long", list(range(3, 2003)), max_tokens=5))
    chunks = []
    while True:
        so = scheduler.schedule()
        assert so.total_num_scheduled_tokens <= 256
        for i in range(3):
            assert so.num_scheduled_tokens[f"d{i}"] == 1
        chunks.append(so.num_scheduled_tokens["long"])
        assert [r.req_id for r in so.scheduled_new_reqs] == (["long"] if len(chunks) == 1 else [])
        outs = {o.request_id: o for o in scheduler.update_from_output(so, runner.execute(so))}
        assert all(len(outs[f"d{i}"].new_token_ids) == 1 for i in range(3))
        if "long" in outs:  # the first token comes only after the last chunk
            break
    assert chunks == [253] * 7 + [229] and sum(chunks) == 2000
    outputs = run_until_done(scheduler, runner)
    assert len(output_token_ids(outputs["long"])) == 4  # plus the one sampled above


def test_small_pool_forces_preemption_and_every_request_completes() -> None:
    # 16 usable blocks of 4 tokens; each request grows to 30 tokens (8 blocks): at most two fit.
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=8, num_blocks=17)
    runner = runner_for(scheduler)
    requests = [make_request(f"r{i}", [20 + i] * 10, max_tokens=20) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    resumed_token_lens = []

    def on_step(so: SchedulerOutput, _: list[EngineCoreOutput]) -> None:
        for new in so.scheduled_new_reqs:
            request = next(r for r in requests if r.request_id == new.req_id)
            if request.num_preemptions:  # a resume recomputes prompt and outputs so far
                assert new.token_ids[:10] == request.prompt_token_ids
                assert new.req_id in preempted_ids
                resumed_token_lens.append(len(new.token_ids))
        preempted_ids.update(so.finished_req_ids)

    preempted_ids: set[str] = set()
    outputs = run_until_done(scheduler, runner, on_step=on_step)
    assert scheduler.num_preemptions >= 2
    assert any(n > 10 for n in resumed_token_lens)
    assert requests[0].num_preemptions == 0  # the oldest is never the victim
    for request in requests:
        assert output_token_ids(outputs[request.request_id]) == [SAMPLED_TOKEN] * 20
        assert outputs[request.request_id][-1].finish_reason == "length"
    assert scheduler.get_stats().num_preemptions == scheduler.num_preemptions
    scheduler.schedule()
    assert_all_released(scheduler)


def test_preempted_request_is_reported_and_requeued_in_front() -> None:
    # 8 usable blocks, at most 3 running.
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=3, num_blocks=9)
    runner = runner_for(scheduler)
    a = make_request("a", [5] * 12, max_tokens=20)
    b = make_request("b", [6] * 12, max_tokens=20)
    c = make_request("c", [7] * 4, max_tokens=20)
    d = make_request("d", [8] * 4, max_tokens=20)
    for request in (a, b, c, d):
        scheduler.add_request(request)
    so = scheduler.schedule()  # a: 3 blocks + b: 3 blocks + c: 1 block; d waits
    assert so.num_scheduled_tokens == {"a": 12, "b": 12, "c": 4}
    scheduler.update_from_output(so, runner.execute(so))
    # a needs a 4th block (1 free), then b needs one too: c, the newest, is preempted.
    so = scheduler.schedule()
    assert so.finished_req_ids == {"c"}
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert list(scheduler.waiting) == [c, d] and c.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_num_blocks("c") == 0


def test_max_model_len_caps_output() -> None:
    scheduler = make_scheduler(max_model_len=32)
    runner = runner_for(scheduler)
    request = make_request("a", list(range(3, 23)), max_tokens=None)  # 20-token prompt
    scheduler.add_request(request)
    outputs = run_until_done(scheduler, runner)["a"]
    assert len(output_token_ids(outputs)) == 12 and request.num_tokens == 32
    assert outputs[-1].finish_reason == "length" and outputs[-1].stop_reason is None
    assert request.num_computed_tokens == 31
    with pytest.raises(ValueError, match="max_model_len=32"):
        scheduler.add_request(make_request("b", list(range(3, 35))))
    with pytest.raises(ValueError, match="at least 1"):
        scheduler.add_request(make_request("c", []))


def test_duplicate_request_id_is_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(make_request("a"))


def sample_script(script: list[int]):
    """A sample_fn emitting script[i] as output token i (then 7s), prompt length 8."""
    return lambda req_id, token_ids: (script + [SAMPLED_TOKEN] * 100)[len(token_ids) - 8]


@pytest.mark.parametrize(
    ("kwargs", "script", "tokens", "finish_reason", "stop_reason"),
    [
        ({"stop_token_ids": [9]}, [5, 6, 9, 4], [5, 6, 9], "stop", 9),
        ({}, [5, EOS, 4], [5, EOS], "stop", None),
        ({"ignore_eos": True, "max_tokens": 5}, [EOS] * 8, [EOS] * 5, "length", None),
        ({"min_tokens": 3, "max_tokens": 10}, [EOS] * 10, [EOS] * 4, "stop", None),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9, 9, 9], [9, 9, 9], "stop", 9),
        ({"ignore_eos": True, "stop_token_ids": [EOS]}, [5, EOS], [5, EOS], "stop", EOS),
        ({"max_tokens": 3}, [5, 6, 4, 4], [5, 6, 4], "length", None),
    ],
)
def test_stop_checks(kwargs, script, tokens, finish_reason, stop_reason) -> None:
    scheduler = make_scheduler()
    runner = runner_for(scheduler, sample_script(script))
    request = make_request("a", **kwargs)
    scheduler.add_request(request)
    outputs = run_until_done(scheduler, runner)["a"]
    assert output_token_ids(outputs) == tokens
    assert [o.finish_reason for o in outputs] == [None] * (len(tokens) - 1) + [finish_reason]
    assert outputs[-1].stop_reason == stop_reason == request.stop_reason
    scheduler.schedule()
    assert_all_released(scheduler)


def test_abort_frees_blocks_and_is_reported() -> None:
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=33)
    runner = runner_for(scheduler)
    kv = scheduler.kv_cache_manager
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [30 + i] * 8, max_tokens=10))
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute(so))
    assert kv.get_num_blocks("r0") == 2 and kv.num_free_blocks == 32 - 4
    assert scheduler.num_running == 2 and scheduler.num_waiting == 1

    scheduler.finish_requests(["r0", "r2"], RequestStatus.FINISHED_ABORTED)  # running, waiting
    assert kv.get_num_blocks("r0") == 0 and kv.num_free_blocks == 32 - 2
    assert scheduler.get_num_unfinished_requests() == 1
    so = scheduler.schedule()
    assert so.finished_req_ids == {"r0", "r2"}
    assert set(so.num_scheduled_tokens) == {"r1"}
    # Aborted between schedule and update: its sampled token is dropped, no output.
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(so, runner.execute(so)) == []
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)  # a second abort: no-op
    assert scheduler.has_finished_requests()
    so = scheduler.schedule()
    assert so.finished_req_ids == {"r1"} and so.is_empty
    assert_all_released(scheduler)


def test_prefix_hit_through_the_scheduler() -> None:
    scheduler = make_scheduler()
    runner = runner_for(scheduler)
    prompt = list(range(3, 21))  # 18 tokens: 4 full blocks
    scheduler.add_request(make_request("a", prompt, max_tokens=2))
    run_until_done(scheduler, runner)
    scheduler.add_request(make_request("b", prompt, max_tokens=2))
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"b": 2}
    outs = scheduler.update_from_output(so, runner.execute(so))
    assert outs[0].num_cached_tokens == 16
    run_until_done(scheduler, runner)
    stats = scheduler.get_stats()
    assert (stats.prefix_cache_stats.queries, stats.prefix_cache_stats.hits) == (36, 16)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert scheduler.get_stats().prefix_cache_stats.queries == 0  # an interval


def test_running_requests_get_only_their_new_blocks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("a", list(range(3, 23)), max_tokens=3))  # 20 tokens
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].block_ids == [[1, 2]]
    assert so.scheduled_new_reqs[0].token_ids == list(range(3, 23))
    scheduler.update_from_output(so, runner.execute(so))
    so = scheduler.schedule()
    assert so.scheduled_new_reqs == []
    cached = so.scheduled_cached_reqs[0]
    assert (cached.req_id, cached.new_block_ids, cached.num_computed_tokens) == ("a", [[3, 4]], 8)


def test_paused_request_leaves_the_batch_keeps_its_blocks_and_resumes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=3)
    runner = runner_for(scheduler)
    a = make_request("a", [5] * 8, max_tokens=6)
    b = make_request("b", [6] * 8, max_tokens=6)
    for request in (a, b):
        scheduler.add_request(request)
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute(so))
    scheduler.pause_requests(["a", "unknown"])
    blocks = scheduler.kv_cache_manager.get_num_blocks("a")
    for _ in range(3):  # b goes on alone; a holds its blocks, computes nothing
        so = scheduler.schedule()
        assert set(so.num_scheduled_tokens) == {"b"} and so.finished_req_ids == set()
        scheduler.update_from_output(so, runner.execute(so))
    assert scheduler.running == [b] and list(scheduler.paused) == ["a"]
    assert scheduler.get_stats().num_running == 1 and scheduler.get_stats().num_paused == 1
    assert scheduler.kv_cache_manager.get_num_blocks("a") == blocks and a.num_output_tokens == 1
    scheduler.resume_requests(["a"])
    outputs = run_until_done(scheduler, runner)
    assert len(output_token_ids(outputs["a"])) == 5 and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_released(scheduler)


def test_memory_pressure_takes_a_paused_requests_blocks_first() -> None:
    # 8 usable blocks, at most 3 running (as the preemption test above).
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=3, num_blocks=9)
    runner = runner_for(scheduler)
    a = make_request("a", [5] * 12, max_tokens=20)
    b = make_request("b", [6] * 12, max_tokens=20)
    c = make_request("c", [7] * 4, max_tokens=20)
    for request in (a, b, c):
        scheduler.add_request(request)
    so = scheduler.schedule()  # a: 3 blocks, b: 3, c: 1; 1 free
    scheduler.update_from_output(so, runner.execute(so))
    scheduler.pause_requests(["a"])
    # b and c each need a block, 1 is free: the paused a loses its blocks, not c its place.
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"b": 1, "c": 1} and so.finished_req_ids == {"a"}
    assert a.status == RequestStatus.PREEMPTED and "a" in scheduler.paused and a not in scheduler.waiting
    assert scheduler.kv_cache_manager.get_num_blocks("a") == 0 and c.num_preemptions == 0
    scheduler.update_from_output(so, runner.execute(so))
    scheduler.resume_requests(["a"])  # recomputed from the front of waiting
    assert list(scheduler.waiting)[0] is a
    scheduler.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    outputs = run_until_done(scheduler, runner)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(output_token_ids(outputs["a"])) == 19
    assert_all_released(scheduler)


def test_aborting_a_paused_request_frees_its_blocks() -> None:
    scheduler = make_scheduler()
    runner = runner_for(scheduler)
    a = make_request("a", [5] * 8, max_tokens=6)
    scheduler.add_request(a)
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute(so))
    scheduler.pause_requests(["a"])
    assert not scheduler.has_unfinished_requests()  # nothing to step: the core idles
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.paused == {}
    so = scheduler.schedule()
    scheduler.update_from_output(so, runner.execute(so))
    assert_all_released(scheduler)
