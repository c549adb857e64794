"""Pooling requests in the scheduler, model-free (hand-built runner outputs): finished by the
runner's pooled vector with their blocks freed, no prefix hit when the pooling reads every
prompt token, and whole prompts per step for bidirectional models."""

from __future__ import annotations

import dataclasses

from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.utils import make_request, make_scheduler


def _pooling(request_id: str, num_tokens: int, reads_whole_prompt: bool = False) -> Request:
    return Request(request_id, list(range(100, 100 + num_tokens)), SamplingParams(max_tokens=1), max_tokens=1,
                   pooling_params=PoolingParams(), reads_whole_prompt=reads_whole_prompt)


def test_pooled_output_finishes_the_request_and_frees_its_blocks() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, num_blocks=32)
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.add_request(_pooling("p", 24))
    sched.add_request(make_request("g", num_prompt_tokens=4))
    first = sched.schedule()  # p's first 16 tokens; g waits for the budget
    assert first.num_scheduled_tokens == {"p": 16}
    assert first.scheduled_new_reqs[0].pooling_params == PoolingParams()
    assert sched.update_from_output(first, ModelRunnerOutput([], [])) == []
    second = sched.schedule()  # p's last 8 tokens beside g's prompt
    assert second.num_scheduled_tokens == {"p": 8, "g": 4}
    outputs = sched.update_from_output(second, ModelRunnerOutput(["g"], [[7]], pooler_output={"p": [0.5, 0.5]}))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["p"].pooled == [0.5, 0.5] and by_id["p"].finish_reason == "stop" and by_id["p"].new_token_ids == []
    assert by_id["g"].new_token_ids == [7] and not by_id["g"].finished
    assert "p" not in sched.requests and [r.request_id for r in sched.running] == ["g"]
    sched.finish_requests("g", sched.requests["g"].status.FINISHED_ABORTED)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_no_prefix_hit_when_the_pooling_reads_every_prompt_token() -> None:
    sched = make_scheduler()
    sched.add_request(_pooling("a", 16))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput([], [], pooler_output={"a": [1.0]}))
    sched.add_request(_pooling("last", 16))
    sched.add_request(_pooling("mean", 16, reads_whole_prompt=True))
    so = sched.schedule()
    assert sched.requests["last"].num_cached_tokens > 0  # its cached prefix: the last token left
    assert sched.requests["mean"].num_cached_tokens == 0 and so.num_scheduled_tokens["mean"] == 16


def test_whole_prompts_wait_rather_than_split() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.scheduler_config = dataclasses.replace(sched.scheduler_config, whole_prompts=True)
    for i, n in enumerate((20, 20, 8)):
        sched.add_request(_pooling(f"r{i}", n, reads_whole_prompt=True))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 20}  # r1 would not fit whole: it and r2 wait (FCFS)
    sched.update_from_output(so, ModelRunnerOutput([], [], pooler_output={"r0": [1.0]}))
    assert sched.schedule().num_scheduled_tokens == {"r1": 20, "r2": 8}
