"""The scheduler: each step, decide how many tokens each request computes.

There is no prefill phase and no decode phase. A request has ``num_tokens`` (prompt + output
so far) and ``num_computed_tokens`` (tokens whose KV is cached); each step the scheduler hands
out ``num_scheduled_tokens`` to close that gap, under two caps: ``max_num_batched_tokens``
tokens and ``max_num_seqs`` running requests. A prompt chunk, a decode, a prefix hit (jump
forward) and a preemption (back to 0) are all just numbers.

Invariants between steps:
- ``running`` holds requests in admission order; each holds KV blocks for its computed tokens.
- ``waiting`` holds requests without blocks, in its policy's order (waiting_queue.py).
- The sequences of a group (n > 1, one arrival time and priority) are contiguous in both.
- Every unfinished request is in exactly one of them and in ``requests``, or (disaggregated
  prefill) in ``waiting_for_remote`` while its prompt's KV is pulled (remote_prefill.py).

Its parts: the waiting queue and its policy (waiting_queue.py), the allocation of a waiting
group, all or nothing (group_admission.py), and the remote prefill (remote_prefill.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.config import SchedulerConfig, SpeculativeConfig
from pagedllm.core.group_admission import AdmittedSeq, GroupAdmission, num_tokens_to_compute, waiting_group
from pagedllm.core.kv_manager import KVAllocation, KVManager
from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats, SpecDecodingStats
from pagedllm.core.remote_prefill import RemotePrefill
from pagedllm.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.core.stop import check_stop
from pagedllm.core.waiting_queue import make_waiting_queue
from pagedllm.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.distributed.kv_transfer.base import KVConnectorOutput, KVConnectorSchedulerBase

logger = logging.getLogger(__name__)


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVManager,
        *,
        kv_connector: KVConnectorSchedulerBase | None = None,
        kv_load_failure_policy: str = "recompute",
        speculative_config: SpeculativeConfig | None = None,
        max_loras: int | None = None,
    ) -> None:
        """``max_loras``: most distinct LoRA adapters among running requests (None: no cap)."""
        self.scheduler_config = scheduler_config
        self.max_loras = max_loras
        # Speculative decoding: a running request's drafts are scheduled after its own tokens;
        # a draft model also needs KV slots past them to write its proposals.
        self.speculative_config = speculative_config
        self.num_lookahead_tokens = speculative_config.num_lookahead_tokens if speculative_config else 0
        self._spec_stats = (
            SpecDecodingStats(speculative_config.num_speculative_tokens) if speculative_config else None
        )
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.admission = GroupAdmission(kv_cache_manager, self.num_lookahead_tokens)

        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting = make_waiting_queue(scheduler_config.scheduling_policy)
        self.running: list[Request] = []
        # Finished or preempted since the last schedule(): the runner must drop their state.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # since start
        # Paused by the front end (their clients stopped reading): out of the batch, their
        # blocks kept unless memory runs short (then dropped, recomputed on resume).
        self.paused: dict[str, Request] = {}
        self._pause_wanted: set[str] = set()  # paused as soon as they run (waiting or unforked now)
        # Forked sequences not yet sent to the runner (they go as NewRequestData).
        self._unsent: set[str] = set()
        # Disaggregated prefill: the connector's scheduler side over the manager's KV
        # transfer (a manager without that capability refuses by name here).
        self.kv_connector = kv_connector
        self.kv_load_failure_policy = kv_load_failure_policy
        self.remote = RemotePrefill(kv_connector, kv_cache_manager) if kv_connector is not None else None

    @property
    def waiting_for_remote(self) -> dict[str, Request]:
        """Requests whose prompt KV is being pulled (they hold blocks, outside waiting/running)."""
        return self.remote.waiting_for_remote if self.remote is not None else {}

    # ---- requests in and out -----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (by the scheduling policy). Raises ValueError for a duplicate id
        or a prompt that leaves no room for output under ``max_model_len``."""
        self.check_request(request)
        for r in [request, *request.pending_forks]:
            r.status = RequestStatus.WAITING
            self.requests[r.request_id] = r
        self.waiting.add(request, front=False)
        if not request.reads_whole_prompt:
            self.kv_cache_manager.prefetch(request)  # KV offload: read its prefix off the step

    def check_request(self, request: Request) -> None:
        """The checks of ``add_request``, without queueing (ValueError if it would refuse)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if not 0 < request.num_prompt_tokens < self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens; "
                f"it needs at least 1 and fewer than max_model_len={self.max_model_len}"
            )
        self.kv_cache_manager.check_request(request)
        num_seqs = 1 + len(request.pending_forks)
        if num_seqs > self.max_num_seqs:
            raise ValueError(
                f"request {request.request_id!r} asks for {num_seqs} sequences, more than "
                f"max_num_seqs={self.max_num_seqs}"
            )
        for r in request.pending_forks:
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in the engine")

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
            if self.remote is not None and self.remote.abort(request_id):
                # Its pull still writes into its blocks: they are freed when the pull ends.
                del self.requests[request_id]
                self.finished_req_ids.add(request_id)
                continue
            self._free_finished(request)
            removed.add(request_id)
            self._detach_from_group(request, removed)
        if removed:
            self.running = [r for r in self.running if r.request_id not in removed]
            self.waiting.remove_ids(removed)
            for request_id in removed:
                self.paused.pop(request_id, None)
                self._pause_wanted.discard(request_id)

    def pause_requests(self, request_ids: Iterable[str]) -> None:
        """Stop scheduling these requests (a client that stopped reading) until resumed:
        a running one leaves the batch now, keeping its blocks; one not running yet, when it
        first runs. Unknown or finished ids are ignored."""
        self._pause_wanted.update(r for r in request_ids if r in self.requests)
        self._apply_pauses()

    def resume_requests(self, request_ids: Iterable[str]) -> None:
        """Schedule paused requests again: back at the end of ``running`` with their blocks,
        or at the front of ``waiting`` if memory pressure took their blocks meanwhile."""
        for request_id in request_ids:
            self._pause_wanted.discard(request_id)
            request = self.paused.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.append(request)
            else:
                self.waiting.add(request, front=True)

    def _apply_pauses(self) -> None:
        if not self._pause_wanted:
            return
        kept = []
        for request in self.running:
            if request.request_id in self._pause_wanted and not request.pending_forks:
                self._pause_wanted.discard(request.request_id)
                self.paused[request.request_id] = request
            else:
                kept.append(request)
        self.running = kept

    def _preempt_paused(self) -> bool:
        """Memory is short: drop the blocks of a paused request (the newest first) rather than
        preempt one whose client reads. False if no paused request holds blocks."""
        for request in reversed(list(self.paused.values())):
            if request.status == RequestStatus.RUNNING:
                self._preempt(request, requeue=False)
                return True
        return False

    def add_forked_request(self, parent: Request, child: Request) -> None:
        """Run ``child`` (same tokens as ``parent`` but possibly its last, uncomputed one)
        sharing ``parent``'s blocks: a beam-search fork. The child joins ``running``."""
        assert parent.status == RequestStatus.RUNNING and child.num_tokens == parent.num_tokens
        assert parent.num_computed_tokens == parent.num_tokens - 1
        self.kv_cache_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)
        self._unsent.add(child.request_id)

    def _detach_from_group(self, request: Request, removed: set[str]) -> None:
        """A finished sequence leaves its group's fork bookkeeping: a leader hands its pending
        sequences to ``waiting`` (they then admit as a group); a pending one leaves its leader."""
        if request.pending_forks:
            pending, request.pending_forks = request.pending_forks, []
            for p in reversed([p for p in pending if p.request_id not in removed]):
                self.waiting.add(p, front=True)
        for leader in [*self.running, *self.waiting, *self.paused.values()]:
            if request in leader.pending_forks:
                leader.pending_forks.remove(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote) + len(self.paused)

    def has_unfinished_requests(self) -> bool:
        remote = self.remote is not None and bool(self.remote.waiting_for_remote or self.remote.aborted_loading)
        return bool(self.waiting or self.running or remote)  # paused requests wait for the front end

    def has_pending_kv_transfers(self) -> bool:
        """Blocks held for a remote pull: the engine keeps polling the connector."""
        return self.remote is not None and self.remote.has_pending

    def has_finished_requests(self) -> bool:
        """Whether finished/preempted ids wait to reach the runner (one more step flushes them)."""
        return bool(self.finished_req_ids)

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work. Running requests first (in order), then waiting ones.

        Advances ``num_computed_tokens`` of every scheduled request optimistically, as if the
        step succeeds; ``update_from_output`` then appends the sampled tokens.
        """
        step = _Step(self.max_num_batched_tokens)
        self._apply_pauses()
        self._schedule_running(step)
        # Waiting requests, FCFS. Skipped after a preemption: memory is short. One whose
        # adapter finds no slot (max_loras in use) is held aside, so it blocks no one behind.
        held: list[Request] = []
        while not step.preempted and self.waiting and step.token_budget > 0:
            if not self._lora_fits(self.waiting[0]):
                held.append(self.waiting.popleft())
                continue
            if not self._admit_waiting_group(step):
                break
        self.waiting.push_front(held)  # back at the front, in their order

        # As if the step succeeds; the runner reads the pre-step values from the output.
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens

        dropped = step.unscheduled
        output = SchedulerOutput(
            scheduled_new_reqs=[r for r in step.new_reqs if r.req_id not in dropped],
            scheduled_cached_reqs=[r for r in step.cached_reqs if r.req_id not in dropped],
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.token_budget,
            finished_req_ids=self.finished_req_ids,
            blocks_to_copy=step.blocks_to_copy,
            kv_slots_to_release=self.kv_cache_manager.take_slots_to_release(),
            scheduled_spec_decode_tokens={r: t for r, t in step.spec_tokens.items() if r not in dropped},
        )
        output.kv_offload = self.kv_cache_manager.take_offload_ops()
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta()
        self.finished_req_ids = set()
        return output

    def _schedule_running(self, step: _Step) -> None:
        """Running requests, in admission order; the newest yield memory to older ones."""
        req_index = 0
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            if request.pending_forks and request.num_computed_tokens == request.num_prompt_tokens - 1:
                self._fork_group(request, req_index)
            num_new_tokens = min(
                num_tokens_to_compute(request) + len(request.spec_token_ids),
                step.token_budget,
                # Position max_model_len - 1 is never computed: the request stops first.
                self.max_model_len - 1 - request.num_computed_tokens,
            )
            if num_new_tokens <= 0:
                req_index += 1
                continue
            # Drafts that did not fit the budget or max_model_len are dropped.
            num_drafts = max(0, num_new_tokens - num_tokens_to_compute(request))
            del request.spec_token_ids[num_drafts:]
            allocation, preempted_here = self._allocate_preempting(request, num_new_tokens, step)
            if allocation is None:
                if not self.waiting.victims_anywhere:
                    return  # FCFS: the request preempted itself, so nothing runs after it
                # Priority: victims may have stood anywhere; go on with the first request not
                # scheduled yet (one skipped earlier for having no tokens is skipped again).
                req_index = next((i for i, r in enumerate(self.running)
                                  if r.request_id not in step.num_scheduled_tokens), len(self.running))
                continue
            if preempted_here and self.waiting.victims_anywhere:
                req_index = self.running.index(request)  # victims before it shifted it
            self._schedule_allocated(request, num_new_tokens, allocation, step)
            req_index += 1

    def _allocate_preempting(
        self, request: Request, num_new_tokens: int, step: _Step
    ) -> tuple[KVAllocation | None, bool]:
        """Slots for a running request, preempting victim groups until they fit or the
        request itself was preempted (then None). Also whether anything was preempted."""
        preempted = False
        lookahead = self.num_lookahead_tokens
        while (allocation := self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens=lookahead
        )) is None:
            if self._preempt_paused():
                continue
            # Any members of the victim group scheduled earlier in this step are
            # unscheduled with it (the current request may be among them).
            victims = self._pop_victim_group()
            for victim in victims:
                step.unschedule(victim.request_id)
                self._preempt(victim)
            step.preempted = preempted = True
            if request in victims:
                break
        return allocation, preempted

    def _schedule_allocated(
        self, request: Request, num_new_tokens: int, allocation: KVAllocation, step: _Step
    ) -> None:
        """A running request that got its slots joins this step (new to the runner if it
        was forked since it last ran)."""
        step.blocks_to_copy.extend(allocation.copied_blocks)
        if request.request_id in self._unsent:  # forked this step or earlier: new to the runner
            self._unsent.discard(request.request_id)
            step.new_reqs.append(self._new_request_data(request))
        else:
            step.cached_reqs.append(
                CachedRequestData(
                    request.request_id, allocation.block_ids, request.num_computed_tokens,
                    allocation.copied_blocks,
                )
            )
        step.schedule(request.request_id, num_new_tokens)
        if request.spec_token_ids:
            step.spec_tokens[request.request_id] = list(request.spec_token_ids)

    def _admit_waiting_group(self, step: _Step) -> bool:
        """Admit the head of ``waiting`` with the rest of its group, all or nothing.

        A fresh group enters as its leader (the others fork from it later); a preempted
        group resumes every member at once, sharing the prompt through the prefix cache.
        """
        head = self.waiting[0]
        if self.remote is not None and self.remote.wants_pull(head):
            parked = self.remote.admit(head, len(self.running), self.max_num_seqs)
            if parked:
                self.waiting.popleft()
            if parked is not None:
                return parked
        members = waiting_group(self.waiting, head)
        if self.scheduler_config.whole_prompts and head.num_tokens > step.token_budget:
            return False  # bidirectional attention: the prompt runs in one step or waits
        num_from_waiting = len(members)
        num_seqs = num_from_waiting + len(head.pending_forks)
        if len(self.running) + num_seqs > self.max_num_seqs or step.token_budget < num_seqs:
            return False
        admitted = self.admission.allocate(members, step.token_budget)
        if admitted is None:
            return False
        for _ in range(num_from_waiting):
            self.waiting.popleft()
        for seq in admitted:
            self._start(seq, step)
        return True

    def _start(self, seq: AdmittedSeq, step: _Step) -> None:
        """An admitted sequence joins ``running`` and this step, its prefix hit computed."""
        request = seq.request
        self.running.append(request)
        if request.status == RequestStatus.WAITING:  # first scheduling, not a resume
            request.num_cached_tokens = seq.num_hit_tokens
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = seq.num_hit_tokens
        self._unsent.discard(request.request_id)
        # The request held no blocks: block_ids are all of them.
        step.new_reqs.append(self._new_request_data(request, seq.block_ids))
        step.schedule(request.request_id, seq.num_new_tokens)

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter is running already or a slot is free for it."""
        if request.lora_request is None or self.max_loras is None:
            return True
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return request.lora_request.lora_int_id in active or len(active) < self.max_loras

    def _update_from_kv_transfers(self, kv_output: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Requests whose pull ended go back to the front of ``waiting`` (their admission
        then finds the prompt as a prefix hit); a failed pull either recomputes the prompt
        or fails the request, by ``kv_load_failure_policy``."""
        assert self.remote is not None
        outputs: list[EngineCoreOutput] = []
        for request, error in self.remote.take_ended_pulls(kv_output):
            if error is not None and self.kv_load_failure_policy == "fail":
                request.status = RequestStatus.FINISHED_ABORTED
                self._free_finished(request)
                outputs.append(EngineCoreOutput(
                    request.request_id, [], "abort", None, 0,
                    error=f"loading the prompt's KV from the prefill instance failed: {error}",
                    retryable=True,
                ))
                continue
            if error is not None:
                logger.info("request %s recomputes its prompt: %s", request.request_id, error)
            request.status = RequestStatus.WAITING
            self.waiting.add(request, front=True)
        return outputs

    def _expire_remote_waits(self) -> list[EngineCoreOutput]:
        """Fail the requests whose prompt KV did not arrive in time (a 503 the client may
        retry); their blocks are freed when the connector reports the pull ended."""
        assert self.remote is not None
        outputs = []
        for request in self.remote.expire():
            request.status = RequestStatus.FINISHED_ABORTED
            self.requests.pop(request.request_id, None)
            self.finished_req_ids.add(request.request_id)
            timeout_s = self.kv_connector.remote_wait_timeout_s() if self.kv_connector is not None else None
            logger.warning("request %s: its prompt's KV did not arrive within %s s", request.request_id, timeout_s)
            outputs.append(EngineCoreOutput(
                request.request_id, [], "abort", None, 0,
                error=f"the prompt's KV did not arrive from the prefill instance within {timeout_s} s "
                      "(kv_remote_wait_timeout_s)",
                retryable=True,
            ))
        return outputs

    def _fork_group(self, leader: Request, index: int) -> None:
        """The leader computed all of the prompt but its last token: its pending sequences
        share its blocks and join ``running`` right after it."""
        for offset, child in enumerate(leader.pending_forks, start=1):
            self.kv_cache_manager.fork(leader, child)
            child.num_computed_tokens = leader.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.insert(index + offset, child)
            self._unsent.add(child.request_id)
        leader.pending_forks = []

    def _pop_victim_group(self) -> list[Request]:
        """Take the preemption victim out of ``running`` with every member of its group
        (contiguous), the last member first. FCFS: the newest request. Priority: the lowest
        priority (the largest value), the latest arrival among equals."""
        running = self.running
        index = self.waiting.victim_index(running)
        start = end = index
        group_id = running[index].group_id
        if group_id is not None:
            while start > 0 and running[start - 1].group_id == group_id:
                start -= 1
            while end + 1 < len(running) and running[end + 1].group_id == group_id:
                end += 1
        victims = running[start : end + 1]
        del running[start : end + 1]
        return victims[::-1]

    def _new_request_data(self, request: Request, block_ids: list[list[int]] | None = None) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=block_ids if block_ids is not None else self.kv_cache_manager.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
            mm_features=request.mm_features,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the sampled tokens, run the stop checks, free finished requests.

        Returns one EngineCoreOutput per request that sampled this step. Requests finished
        from outside since the step was scheduled (aborts) are skipped.
        """
        outputs: list[EngineCoreOutput] = []
        finished: set[str] = set()
        if model_runner_output.kv_connector_output:
            outputs.extend(self._update_from_kv_transfers(model_runner_output.kv_connector_output))
        if self.remote is not None and self.remote.waiting_for_remote:
            outputs.extend(self._expire_remote_waits())
        for request_id, pooled in model_runner_output.pooler_output.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.status = RequestStatus.FINISHED_STOPPED
            self._free_finished(request)
            finished.add(request_id)
            outputs.append(EngineCoreOutput(
                request_id, [], request.status.finish_reason, None, request.num_cached_tokens, pooled=pooled,
            ))
        runner_logprobs = model_runner_output.logprobs or [None] * len(model_runner_output.req_ids)
        proposals = model_runner_output.spec_token_ids or [None] * len(model_runner_output.req_ids)
        for request_id, token_ids, logprobs, spec_token_ids in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, runner_logprobs, proposals
        ):
            assert request_id in scheduler_output.num_scheduled_tokens, request_id
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING or not token_ids:
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                self._roll_back_rejected(request, drafts, token_ids)
            request.spec_token_ids = []
            new_token_ids = self._append_until_stop(request, token_ids)
            kv_transfer_params = None
            if request.is_finished:
                kv_transfer_params = self._free_finished(request)
                finished.add(request_id)
            elif spec_token_ids:
                request.spec_token_ids = list(spec_token_ids)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    new_logprobs=logprobs[: len(new_token_ids)] if logprobs is not None else None,
                    prompt_logprobs=model_runner_output.prompt_logprobs.get(request_id),
                    kv_transfer_params=kv_transfer_params,
                )
            )
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return outputs

    def _roll_back_rejected(self, request: Request, drafts: list[int], token_ids: list[int]) -> None:
        """Accepted drafts plus one token came back: the rejected drafts' KV slots are no
        longer computed (the next step overwrites them)."""
        num_accepted = len(token_ids) - 1
        assert 0 <= num_accepted <= len(drafts), (request.request_id, drafts, token_ids)
        request.num_computed_tokens -= len(drafts) - num_accepted
        assert self._spec_stats is not None
        self._spec_stats.observe(len(drafts), num_accepted)

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append the sampled tokens up to and including a stop; returns those appended."""
        new_token_ids: list[int] = []
        for token_id in token_ids:
            request.append_output_token_ids([token_id])
            new_token_ids.append(token_id)
            if check_stop(request, self.max_model_len):
                break  # tokens after a stop are dropped
        return new_token_ids

    # ---- stats -------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        """A snapshot; the prefix-cache figures cover the interval since the previous call."""
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            kv_resident_bytes=self.kv_cache_manager.resident_bytes,
            kv_token_bytes=sum(r.num_computed_tokens for r in self.running) * self.kv_cache_manager.bytes_per_token,
            spec_decoding_stats=self._take_spec_stats(),
            num_paused=len(self.paused),
            kv_offload=self.kv_cache_manager.take_offload_stats(),
        )

    def _take_spec_stats(self) -> SpecDecodingStats | None:
        stats = self._spec_stats
        if stats is not None:
            self._spec_stats = SpecDecodingStats(stats.num_spec_tokens)
        return stats

    # ---- internals ---------------------------------------------------------------------

    def _preempt(self, request: Request, requeue: bool = True) -> None:
        """Preempt by recompute: drop the KV, requeue at the front of ``waiting`` (a paused
        request stays paused: ``requeue=False``)."""
        num_computed = request.num_computed_tokens
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        # Keeps the block hashes (not finished); blocks allocated for this step's tokens,
        # if it was scheduled before being taken back, leave the prefix cache.
        self.kv_cache_manager.free(request, num_valid_tokens=num_computed)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._unsent.discard(request.request_id)
        if requeue:
            self.waiting.add(request, front=True)
        self.finished_req_ids.add(request.request_id)
        logger.debug(
            "preempted request %s (%d tokens computed, preempted %d times); %d blocks free",
            request.request_id,
            num_computed,
            request.num_preemptions,
            self.kv_cache_manager.num_free_blocks,
        )

    def _free_finished(self, request: Request) -> dict | None:
        """Release a request whose status is already a finished one (caller fixes the queues).

        With a KV connector, the prompt's full blocks may stay held for a remote pull; the
        returned kv_transfer_params (or None) tell the client where to pull them from.
        """
        assert request.is_finished
        params = self.remote.hold_for_pull(request) if self.remote is not None else None
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        return params


@dataclass
class _Step:
    """What one ``schedule()`` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    unscheduled: set[str] = field(default_factory=set)
    preempted: bool = False

    def schedule(self, request_id: str, num_tokens: int) -> None:
        self.num_scheduled_tokens[request_id] = num_tokens
        self.token_budget -= num_tokens
        self.unscheduled.discard(request_id)

    def unschedule(self, request_id: str) -> None:
        """Take back a request preempted after it was scheduled in this step."""
        num_tokens = self.num_scheduled_tokens.pop(request_id, None)
        if num_tokens is not None:
            self.token_budget += num_tokens
            self.unscheduled.add(request_id)
