"""Factories and a fake model runner for model-free tests of the control plane."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.kv_backends.paged.manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

EOS = 2
SAMPLED_TOKEN = 7  # what the fake runner samples unless told otherwise


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int] | None = None,
    *,
    num_prompt_tokens: int = 8,
    max_tokens: int | None = 4,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    eos_token_ids: tuple[int, ...] = (EOS,),
    cache_salt: str | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
) -> Request:
    """A request; without ``prompt_token_ids`` its prompt is 100, 101, ... (no EOS in it)."""
    if prompt_token_ids is None:
        prompt_token_ids = range(100, 100 + num_prompt_tokens)
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
    )
    return Request(
        request_id,
        list(prompt_token_ids),
        params,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
        priority=priority,
        arrival_time=arrival_time,
    )


def make_group(request_id: str, n: int, **kwargs) -> Request:
    """A parent request of n sequences as the engine builds it: the leader ("0_<id>") with
    the others pending a fork; every sequence in group ``request_id``."""
    children = [make_request(f"{i}_{request_id}", **kwargs) for i in range(n)]
    for child in children:
        child.group_id = request_id
    children[0].pending_forks = children[1:]
    return children[0]


def make_kv_cache_manager(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    enable_caching: bool = True,
    num_groups: int = 1,
) -> KVCacheManager:
    return KVCacheManager(
        num_blocks,
        block_size,
        max_model_len,
        enable_caching=enable_caching,
        hash_extra_keys=("test-model", "float32", block_size),
        num_groups=num_groups,
    )


def make_scheduler(
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    num_blocks: int = 128,
    block_size: int = 4,
    enable_caching: bool = True,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
    )
    kv = make_kv_cache_manager(num_blocks, block_size, max_model_len, enable_caching)
    return Scheduler(config, kv)


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    prefix_ids: list[int] = field(default_factory=list)  # prefix_ids[p] names tokens[: p + 1]


class FakeRunner:
    """Stands in for the model runner: mirrors its per-request state and samples a fixed token.

    It follows the SchedulerOutput protocol as a real runner must (drop finished ids, add new
    requests, extend block tables of cached ones) and asserts what the scheduler promises.
    It also simulates the KV cache: computing position ``p`` writes an id of the prefix
    ``tokens[: p + 1]`` into the slot of ``p``, and every position a step attends to must hold
    the id of the request's own prefix. So a wrong prefix hit, a block handed to two requests,
    or an evicted block still in use fails a test, with no model.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        sample_fn: Callable[[str, list[int]], int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.sample_fn = sample_fn or (lambda req_id, token_ids: SAMPLED_TOKEN)
        self.requests: dict[str, _RunnerState] = {}
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self._prefix_ids: dict[tuple[int, int], int] = {}  # (parent id, token) -> id

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} is new but known"
            # A prefix hit is whole blocks; a forked sequence has all but its last token.
            assert (
                new.num_computed_tokens % self.block_size == 0
                or new.num_computed_tokens == len(new.token_ids) - 1
            )
            self.requests[new.req_id] = _RunnerState(
                list(new.token_ids), list(new.block_ids[0]), new.num_computed_tokens
            )
        for src, dst in so.blocks_to_copy:  # copy-on-write, before any write of this step
            self.kv[dst] = list(self.kv[src])
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens, cached.req_id
            for src, dst in cached.copied_blocks:
                state.block_ids[state.block_ids.index(src)] = dst
            state.block_ids.extend(cached.new_block_ids[0])
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            assert 0 < num_tokens and end <= len(state.token_ids), (req_id, start, end)
            assert len(state.block_ids) * self.block_size >= end, "too few blocks"
            self._write_and_check_kv(state, start, end)
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                token = self.sample_fn(req_id, state.token_ids)
                state.token_ids.append(token)
                req_ids.append(req_id)
                sampled.append([token])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _prefix_id(self, state: _RunnerState, pos: int) -> int:
        while len(state.prefix_ids) <= pos:
            p = len(state.prefix_ids)
            key = (state.prefix_ids[-1] if p else -1, state.token_ids[p])
            state.prefix_ids.append(self._prefix_ids.setdefault(key, len(self._prefix_ids)))
        return state.prefix_ids[pos]

    def _write_and_check_kv(self, state: _RunnerState, start: int, end: int) -> None:
        bs = self.block_size
        for pos in range(start, end):
            self.kv[state.block_ids[pos // bs]][pos % bs] = self._prefix_id(state, pos)
        # Attention at positions start..end-1 reads every slot 0..end-1.
        for pos in range(end):
            block_id = state.block_ids[pos // bs]
            assert block_id != 0, "the null block is never written"
            got = self.kv[block_id][pos % bs]
            assert got == self._prefix_id(state, pos), f"wrong KV at position {pos}"


def run_until_done(
    scheduler: Scheduler,
    runner: FakeRunner,
    max_steps: int = 10_000,
    on_step: Callable[[SchedulerOutput, list[EngineCoreOutput]], None] | None = None,
) -> dict[str, list[EngineCoreOutput]]:
    """Step until no request is left; returns every EngineCoreOutput, per request id."""
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        step_outputs = scheduler.update_from_output(so, runner.execute(so))
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).append(out)
        if on_step is not None:
            on_step(so, step_outputs)
    else:
        raise AssertionError(f"requests still unfinished after {max_steps} steps")
    return outputs


def output_token_ids(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]
