"""EngineCore: the step loop of scheduler and model runner (in process for the LLM class).

Constrained requests (structured outputs) wait here, outside the scheduler, while their
grammar compiles on the StructuredOutputManager's thread pool; the others run meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from pagedllm.core.outputs import EngineCoreOutput, SchedulerStats
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.beam_search import BeamSearchManager, BeamSearchParams
from pagedllm.reasoning.budget import forced_end_token
from pagedllm.request import Request, RequestStatus
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05
"""With nothing else to run, how long a step waits for a grammar to finish compiling."""
GRAMMAR_COMPILE_TIMEOUT_S = float(os.environ.get("PAGEDLLM_GRAMMAR_COMPILE_TIMEOUT_S", "20"))
"""A request whose grammar has not compiled this long after it arrived fails (a 400): a spec
within the size cap (entrypoints/openai/limits.py) can still be slow to compile."""


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        structured_output: StructuredOutputManager | None = None,
        kv_connector: Any = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.beam_search = BeamSearchManager(scheduler, runner.eos_token_ids)
        self.structured_output = structured_output
        # Constrained requests whose grammar is compiling, by id, in arrival order.
        self._awaiting_grammar: dict[str, tuple[Request, Future]] = {}
        self._grammar_deadlines: dict[str, float] = {}  # by id: time.monotonic() to give up
        # Disaggregated prefill: the KV connector's worker side (KVConnectorWorkerBase) or None.
        self.kv_connector = kv_connector
        self.last_num_scheduled_tokens = 0
        """Tokens the last ``step()`` scheduled (for the tokens-per-step histogram)."""
        self._budgeted: set[str] = set()
        """Sequences with a thinking_token_budget (reasoning/budget.py), until they finish."""

    def add_request(self, request: Request) -> None:
        if request.lora_request is not None:
            # ValueError if refused or LoRA is off; pinned until the request ends.
            self.runner.add_lora(request.lora_request, request.request_id)
        try:
            self._add_request(request)
        except Exception:
            if request.lora_request is not None and self.runner.lora_manager is not None:
                self.runner.lora_manager.unpin([request.request_id])
            raise

    def _add_request(self, request: Request) -> None:
        if request.sampling_params.thinking_token_budget is not None:
            if self.structured_output is None or self.structured_output.reasoning is None:
                raise ValueError("thinking_token_budget needs a reasoning parser (--reasoning-parser)")
            self._budgeted.update(s.request_id for s in (request, *request.pending_forks))
        spec = request.sampling_params.structured_outputs
        if spec is None:
            self.scheduler.add_request(request)
            return
        if self.structured_output is None:
            raise ValueError("this engine was built without structured outputs support")
        if request.request_id in self._awaiting_grammar:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.scheduler.check_request(request)  # refuse now what the scheduler would refuse later
        self._awaiting_grammar[request.request_id] = (request, self.structured_output.compile(spec))
        self._grammar_deadlines[request.request_id] = time.monotonic() + GRAMMAR_COMPILE_TIMEOUT_S

    def add_beam_search(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams) -> None:
        """A beam search over shared KV blocks; its one output (``beams`` set) ends it."""
        self.beam_search.add(request_id, prompt_token_ids, params)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string): beam searches end with all
        their beams; those still waiting for their grammar just leave; the scheduler frees
        the others."""
        request_ids = self.beam_search.abort(request_ids)
        for request_id in request_ids:
            entry = self._awaiting_grammar.pop(request_id, None)
            if entry is not None:
                entry[0].status = status
                self._drop_grammar_wait(request_id, entry)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self._awaiting_grammar)
            or self.scheduler.has_unfinished_requests()
            or self.beam_search.has_unfinished()
        )

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, and fold the sampled tokens back into the requests."""
        outputs = self._admit_compiled() if self._awaiting_grammar else []
        scheduler_output = self.scheduler.schedule()
        self.last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        failed: dict[str, str] = {}  # requests whose own processing raised: they fail alone
        rejected: set[str] = set()  # of those, the ones at fault themselves (a 400)
        so_manager = self.structured_output
        if so_manager is not None and so_manager.num_matchers:
            # Finished (not preempted) requests drop their matchers.
            so_manager.remove(r for r in scheduler_output.finished_req_ids if r not in self.scheduler.requests)
            scheduler_output.grammar_bitmask = so_manager.grammar_bitmask(
                self._sampling_req_ids(scheduler_output), failed, rejected,
                scheduler_output.scheduled_spec_decode_tokens,
            )
        if self._budgeted:
            self._force_reasoning_ends(scheduler_output)
        if self.kv_connector is not None:
            self.kv_connector.start_load_kv(scheduler_output.kv_connector_metadata)
        runner_output = self.runner.execute(scheduler_output)
        if self.kv_connector is not None:
            if scheduler_output.is_empty and self.scheduler.waiting_for_remote:
                self.kv_connector.wait_for_transfers(0.005)  # only pulls in flight: do not spin
            runner_output.kv_connector_output = self.kv_connector.get_finished()
        failed.update(runner_output.failed)
        step_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        # Sequences inside their reasoning have matchers but no bitmask rows: advance them too.
        if so_manager is not None and so_manager.num_matchers:
            self._advance_matchers(step_outputs, failed)
        if failed:
            step_outputs = self._fail_requests(failed, step_outputs, rejected)
        return outputs + self.beam_search.process(step_outputs)

    def _fail_requests(
        self, failed: dict[str, str], step_outputs: list[EngineCoreOutput], rejected: set[str] = frozenset()
    ) -> list[EngineCoreOutput]:
        """Finish the requests whose own processing raised this step, each with an error
        output (a beam fails its whole search); what they sampled this step is dropped. The
        rest of the batch goes on."""
        searches: dict[str, str] = {}
        for request_id, message in failed.items():
            search_id = self.beam_search.search_id_of(request_id)
            if search_id is not None:
                searches.setdefault(search_id, message)
        dropped = set(failed)
        outputs = [
            o for o in step_outputs
            if o.request_id not in dropped and self.beam_search.search_id_of(o.request_id) not in searches
        ]
        for request_id, message in failed.items():
            if self.beam_search.search_id_of(request_id) is not None:
                continue
            logger.error("request %s failed: %s; the others go on", request_id, message)
            self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
            if self.structured_output is not None:
                self.structured_output.remove([request_id])
            outputs.append(
                EngineCoreOutput(request_id, [], "abort", None, 0, error=message, invalid=request_id in rejected)
            )
        for search_id, message in searches.items():
            logger.error("beam search %s failed: %s; the others go on", search_id, message)
            outputs.append(self.beam_search.fail(search_id, message))
        return outputs

    def save_kv(self, name: str, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Save the cached KV of ``token_ids``'s prefix under ``name`` (between steps);
        returns its tokens. ValueError naming why not."""
        return self.scheduler.kv_cache_manager.save_prefix(name, token_ids, cache_salt, self.runner.kv_worker.read_blocks)

    def restore_kv(self, name: str) -> int:
        """Bring the KV saved under ``name`` back into the prefix cache; returns its tokens."""
        return self.scheduler.kv_cache_manager.restore_prefix(name)

    def shutdown(self) -> None:
        # The disk offload tier keeps the pool's cached blocks for the next start (bounded).
        ops = self.scheduler.kv_cache_manager.take_persist_ops()
        if ops is not None:
            self.runner.kv_worker.persist_offload(ops, timeout_s=3.0)
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        runner_shutdown = getattr(self.runner, "shutdown", None)  # tensor-parallel executors
        if runner_shutdown is not None:
            runner_shutdown()

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        if self._awaiting_grammar:
            stats = dataclasses.replace(stats, num_waiting=stats.num_waiting + len(self._awaiting_grammar))
        return stats

    # ---- structured outputs ------------------------------------------------------------

    def _force_reasoning_ends(self, scheduler_output) -> None:
        """Sequences whose thinking budget is spent sample the end marker's next token (a
        one-token bitmask row beside the grammars')."""
        requests = self.scheduler.requests
        self._budgeted.difference_update(r for r in scheduler_output.finished_req_ids if r not in requests)
        assert self.structured_output is not None and self.structured_output.reasoning is not None
        reasoning = self.structured_output.reasoning
        grammar = scheduler_output.grammar_bitmask
        constrained = set(grammar.req_ids) if grammar is not None else set()
        forced: dict[str, int] = {}
        for request_id in self._sampling_req_ids(scheduler_output):
            if request_id not in self._budgeted or request_id in constrained:
                continue
            request = requests[request_id]
            token = forced_end_token(request.output_token_ids, request.sampling_params.thinking_token_budget,
                                     reasoning.end_marker_ids, reasoning.end_token_ids)
            if token is not None:
                forced[request_id] = token
        if forced:
            from pagedllm.structured_output.bitmask import with_forced_tokens

            scheduler_output.grammar_bitmask = with_forced_tokens(grammar, forced, self.structured_output.vocab_size)

    def _sampling_req_ids(self, scheduler_output) -> list[str]:
        """Scheduled requests that sample this step: their computed tokens (advanced by
        ``schedule``, past their draft tokens too) reach the end of their known tokens."""
        requests = self.scheduler.requests
        drafts = scheduler_output.scheduled_spec_decode_tokens
        return [
            r for r in scheduler_output.num_scheduled_tokens
            if requests[r].num_computed_tokens - len(drafts.get(r, ())) == requests[r].num_tokens
        ]

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar is ready to the scheduler (arrival order among the
        ready ones); a failed compile finishes its request. When nothing else can run, wait
        briefly for a compile instead of spinning."""
        if not self.scheduler.has_unfinished_requests():
            wait([f for _, f in self._awaiting_grammar.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        for request_id, (request, future) in list(self._awaiting_grammar.items()):
            if not future.done() and now < self._grammar_deadlines[request_id]:
                continue
            del self._awaiting_grammar[request_id]
            sequences = [request, *request.pending_forks]
            try:
                if not future.done():
                    self._drop_grammar_wait(request_id, (request, future))
                    raise ValueError(
                        f"structured_outputs.{request.sampling_params.structured_outputs.key[0]}: the grammar "
                        f"did not compile within {GRAMMAR_COMPILE_TIMEOUT_S:g} s; simplify the constraint")
                self._grammar_deadlines.pop(request_id, None)
                compiled = future.result()
                self.scheduler.check_request(request)
            except ValueError as e:  # the request's own: its grammar, or too long for the pool
                logger.error("request %s: %s", request_id, e)
                for seq in sequences:
                    seq.status = RequestStatus.FINISHED_ABORTED
                    outputs.append(EngineCoreOutput(seq.request_id, [], "abort", None, 0, error=str(e), invalid=True))
                continue
            assert self.structured_output is not None
            self.structured_output.add_matchers(
                [s.request_id for s in sequences], compiled, self.structured_output.reasoning_ended_at_start(request)
            )
            self.scheduler.add_request(request)
        return outputs

    def _drop_grammar_wait(self, request_id: str, entry: tuple[Request, Future]) -> None:
        """The request no longer waits for its grammar: if no other request does, the
        compile is cancelled if not yet started (the manager's release)."""
        self._grammar_deadlines.pop(request_id, None)
        request, future = entry
        if self.structured_output is not None and not any(f is future for _, f in self._awaiting_grammar.values()):
            self.structured_output.release(request.sampling_params.structured_outputs, future)

    def _advance_matchers(self, outputs: list[EngineCoreOutput], failed: dict[str, str]) -> None:
        """Feed the appended tokens to the matchers. A terminated grammar finishes its
        request with "stop" (normally it ends on EOS, which the scheduler already stopped;
        with ignore_eos the grammar decides). A matcher that raises (a rejected token, a
        grammar failing mid-way) puts its request in ``failed``."""
        assert self.structured_output is not None
        done: list[str] = []
        for out in outputs:
            if out.request_id in failed:
                continue
            try:
                terminated = self.structured_output.accept(out.request_id, out.new_token_ids)
            except Exception as e:  # noqa: BLE001 -- one grammar's fault fails its request alone
                failed[out.request_id] = f"{type(e).__name__}: {e}"
                done.append(out.request_id)
                continue
            if terminated is None:
                continue
            if out.finished:
                done.append(out.request_id)
            elif terminated:
                self.scheduler.finish_requests(out.request_id, RequestStatus.FINISHED_STOPPED)
                out.finish_reason, out.stop_reason = "stop", None
                done.append(out.request_id)
        self.structured_output.remove(done)
