"""The scheduler: each step, decide how many tokens each request computes.

There is no prefill phase and no decode phase. A request has ``num_tokens`` (prompt + output
so far) and ``num_computed_tokens`` (tokens whose KV is cached); each step the scheduler hands
out ``num_scheduled_tokens`` to close that gap, under two caps: ``max_num_batched_tokens``
tokens and ``max_num_seqs`` running requests. A prompt chunk, a decode, a prefix hit (jump
forward) and a preemption (back to 0) are all just numbers.

Invariants between steps:
- ``running`` holds requests in admission order; each holds KV blocks for its computed tokens.
- ``waiting`` holds requests without blocks, FCFS, preempted ones in front.
- Every unfinished request is in exactly one of them and in ``requests``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.stop import check_stop
from pagedllm.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.scheduler_config = scheduler_config
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = kv_cache_manager

        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished or preempted since the last schedule(): the runner must drop their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # since start

    # ---- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS). Raises ValueError for a duplicate id or a prompt that
        leaves no room for output under ``max_model_len``."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if not 0 < request.num_prompt_tokens < self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens; "
                f"it needs at least 1 and fewer than max_model_len={self.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the core (abort, a stop string matched in the front
        end): free their blocks and report them in the next ``SchedulerOutput``.

        Ids of requests that already finished are ignored (the finish raced with the step).
        """
        assert status.is_finished, status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        removed: set[str] = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            request.status = status
            self._free_finished(request)
            removed.add(request_id)
        if removed:
            self.running = [r for r in self.running if r.request_id not in removed]
            self.waiting = deque(r for r in self.waiting if r.request_id not in removed)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """Whether finished/preempted ids wait to reach the runner (one more step flushes them)."""
        return bool(self.finished_req_ids)

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work. Running requests first (in order), then waiting ones.

        Advances ``num_computed_tokens`` of every scheduled request optimistically, as if the
        step succeeds; ``update_from_output`` then appends the sampled tokens.
        """
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        # Pass 1: running requests, in admission order; the newest yield memory to older ones.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(
                request.num_tokens - request.num_computed_tokens,
                token_budget,
                # Position max_model_len - 1 is never computed: the request stops first.
                self.max_model_len - 1 - request.num_computed_tokens,
            )
            if num_new_tokens <= 0:
                req_index += 1
                continue
            while (new_block_ids := kv.allocate_slots(request, num_new_tokens)) is None:
                # The victim is at or after req_index, so it holds no work of this step.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break  # the request preempted itself: nothing runs after it
            cached_reqs.append(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # Pass 2: waiting requests, FCFS. Skipped after a preemption: memory is short.
        while (
            not preempted
            and self.waiting
            and token_budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            assert request.num_computed_tokens == 0
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            # Chunked prefill: whatever the budget allows; the rest comes in later steps.
            num_new_tokens = min(request.num_tokens - num_hit_tokens, token_budget)
            block_ids = kv.allocate_slots(request, num_new_tokens, computed_blocks)
            if block_ids is None:
                break  # FCFS: nothing overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(request)
            if request.status == RequestStatus.WAITING:  # first scheduling, not a resume
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=block_ids,  # the request held no blocks: these are all of them
                    num_computed_tokens=num_hit_tokens,
                )
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens

        # As if the step succeeds; the runner reads the pre-step values from the output.
        for request_id, num_tokens in num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, run the stop checks, free finished requests.

        Returns one EngineCoreOutput per request that sampled this step. Requests finished
        from outside since the step was scheduled (aborts) are skipped.
        """
        outputs: list[EngineCoreOutput] = []
        finished: set[str] = set()
        runner_logprobs = model_runner_output.logprobs or [None] * len(model_runner_output.req_ids)
        for request_id, token_ids, logprobs in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, runner_logprobs
        ):
            assert request_id in scheduler_output.num_scheduled_tokens, request_id
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING or not token_ids:
                continue
            # Speculative decoding will roll num_computed_tokens back here for rejected drafts.
            new_token_ids: list[int] = []
            for token_id in token_ids:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if check_stop(request, self.max_model_len):
                    break  # tokens after a stop are dropped
            if request.is_finished:
                self._free_finished(request)
                finished.add(request_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    new_logprobs=logprobs[: len(new_token_ids)] if logprobs is not None else None,
                    prompt_logprobs=model_runner_output.prompt_logprobs.get(request_id),
                )
            )
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return outputs

    # ---- stats -------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        """A snapshot; the prefix-cache figures cover the interval since the previous call."""
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
        )

    # ---- internals ---------------------------------------------------------------------

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the KV, requeue at the front of ``waiting``."""
        num_computed = request.num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        self.kv_cache_manager.free(request)  # keeps the block hashes: not finished
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self.finished_req_ids.add(request.request_id)
        logger.debug(
            "preempted request %s (%d tokens computed, preempted %d times); %d blocks free",
            request.request_id,
            num_computed,
            request.num_preemptions,
            self.kv_cache_manager.num_free_blocks,
        )

    def _free_finished(self, request: Request) -> None:
        """Release a request whose status is already a finished one (caller fixes the queues)."""
        assert request.is_finished
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
