"""Front-end side of outputs: detokenize, match stop strings, build RequestOutputs.

Stop strings are matched here (not in the core) over the newly decoded text only; text that
could still be the start of a stop string is held back from streamed output. When one
matches, the caller aborts the request in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.outputs import EngineCoreOutput
from pagedllm import faults
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.core.sched_output import PositionLogprobsData
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestOutput,
)
from pagedllm.sampling_params import SamplingParams


class RequestState:
    __slots__ = (
        "request_id", "prompt", "prompt_token_ids", "params", "detokenizer", "output_token_ids",
        "text", "finish_reason", "stop_reason", "num_cached_tokens", "arrival_time",
        "first_token_time", "finished_time", "max_stop_len", "logprobs", "cumulative_logprob",
        "prompt_logprobs", "index", "kv_transfer_params", "pooling", "pooled",
    )

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
        params: SamplingParams, tokenizer: Any, arrival_time: float, index: int = 0,
        pooling: bool = False,
    ) -> None:
        self.request_id = request_id
        self.index = index  # position among the sequences of its parent request (n > 1)
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            if params.detokenize else None
        )
        self.output_token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.kv_transfer_params: dict | None = None
        self.pooling = pooling  # a pooling request: its output is `pooled`, no tokens
        self.pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self) -> str:
        """Text safe to show now: while running, hold back what may begin a stop string."""
        if self.finished or self.max_stop_len == 0:
            return self.text
        return self.text[: max(len(self.text) - (self.max_stop_len - 1), 0)]

    def to_output(self) -> RequestOutput | PoolingRequestOutput:
        if self.pooling:
            return PoolingRequestOutput(
                self.request_id, self.prompt, self.prompt_token_ids, PoolingOutput(self.pooled or []),
                finished=self.finished, num_cached_tokens=self.num_cached_tokens,
                metrics={"arrival_time": self.arrival_time, "finished_time": self.finished_time},
            )
        completion = CompletionOutput(
            index=self.index,
            text=self.visible_text(),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_params=self.kv_transfer_params,
            metrics={
                "arrival_time": self.arrival_time,
                "first_token_time": self.first_token_time,
                "finished_time": self.finished_time,
            },
        )


class ParentRequest:
    """n > 1: the sequences of one user request (core requests of their own), reported as
    one RequestOutput with a CompletionOutput each, finished when all are."""

    def __init__(self, request_id: str, children: list[RequestState]) -> None:
        self.request_id = request_id
        self.children = children

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def to_output(self) -> RequestOutput:
        outputs = [c.to_output() for c in self.children]
        first = outputs[0]
        first_token_times = [o.metrics["first_token_time"] for o in outputs if o.metrics["first_token_time"]]
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[o.outputs[0] for o in outputs],
            finished=self.finished,
            prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
            metrics={
                "arrival_time": first.metrics["arrival_time"],
                "first_token_time": min(first_token_times, default=None),
                "finished_time": max((o.metrics["finished_time"] or 0.0) for o in outputs) if self.finished else None,
            },
        )


def find_stop_string(text: str, new_len: int, params: SamplingParams) -> tuple[str, int] | None:
    """Find the earliest stop string that ends inside the last `new_len` chars of text.

    Returns (stop string, index where the output should be cut).
    """
    best: tuple[int, str] | None = None  # (index of the match, stop string)
    for stop in params.stop:
        # A match must overlap the new text; begin searching just before it.
        start = max(len(text) - new_len - len(stop) + 1, 0)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return stop, idx + len(stop) if params.include_stop_str_in_output else idx


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    """Requests finished by a stop string here: the core must stop them too."""
    failed: dict[str, Exception] = field(default_factory=dict)
    """User request id -> the exception its processing raised (detokenizing, stop strings,
    logprobs). The caller fails and aborts these; the other requests are unaffected."""


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by core request id
        self.parents: dict[str, ParentRequest] = {}  # n > 1, by user request id
        self._parent_of: dict[str, ParentRequest] = {}  # core request id -> its parent

    def add_request(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def add_parent_request(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.states[child.request_id] = child
            self._parent_of[child.request_id] = parent

    def core_request_ids(self, request_ids: list[str]) -> list[str]:
        """User request ids -> the core requests behind them (a parent's sequences)."""
        out: list[str] = []
        for r in request_ids:
            parent = self.parents.get(r)
            out += [c.request_id for c in parent.children] if parent is not None else [r]
        return out

    def user_request_id(self, core_request_id: str) -> str:
        """The user request a core request belongs to (itself unless it is a sequence of n > 1)."""
        parent = self._parent_of.get(core_request_id)
        return parent.request_id if parent is not None else core_request_id

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget the requests (user ids); returns the core ids that were still running."""
        core_ids = self.core_request_ids(request_ids)
        for r in request_ids:
            self.parents.pop(r, None)
        for r in core_ids:
            self._parent_of.pop(r, None)
        return [r for r in core_ids if self.states.pop(r, None) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        touched_parents: dict[str, ParentRequest] = {}
        failed: dict[str, Exception] = {}
        for eo in engine_outputs:
            state = self.states.get(eo.request_id)
            if state is None:  # aborted meanwhile
                continue
            if state.first_token_time is None and eo.new_token_ids:
                state.first_token_time = now
            state.num_cached_tokens = eo.num_cached_tokens
            if eo.kv_transfer_params is not None:
                state.kv_transfer_params = eo.kv_transfer_params
            state.output_token_ids.extend(eo.new_token_ids)
            if eo.pooled is not None:
                state.pooled = eo.pooled
            if eo.finish_reason is not None:
                state.finish_reason, state.stop_reason = eo.finish_reason, eo.stop_reason
            try:
                self._update_logprobs(state, eo)
                if state.detokenizer is not None:
                    self._update_text(state, eo)
            except Exception as e:  # noqa: BLE001 -- one request's fault fails only that request
                failed[self.user_request_id(eo.request_id)] = e
                continue
            if state.detokenizer is not None and state.finished and eo.finish_reason is None:
                to_abort.append(eo.request_id)  # a stop string matched
            if state.finished:
                state.finished_time = now
                del self.states[eo.request_id]
            parent = self._parent_of.get(eo.request_id)
            if parent is None:
                outputs.append(state.to_output())
            else:
                touched_parents[parent.request_id] = parent
                if state.finished:
                    del self._parent_of[eo.request_id]
        for parent in touched_parents.values():
            if parent.request_id in failed:
                continue
            outputs.append(parent.to_output())
            if parent.finished:
                del self.parents[parent.request_id]
        return ProcessedOutputs(outputs, to_abort, failed)

    def _update_logprobs(self, state: RequestState, eo: EngineCoreOutput) -> None:
        if eo.new_logprobs is not None and state.logprobs is not None:
            for entry in eo.new_logprobs:
                state.logprobs.append(self._to_position_logprobs(entry))
                state.cumulative_logprob += entry.logprobs[0]
        if eo.prompt_logprobs is not None:
            # The first prompt token has no logprob (nothing precedes it).
            state.prompt_logprobs = [None] + [self._to_position_logprobs(e) for e in eo.prompt_logprobs]

    def _to_position_logprobs(self, entry: PositionLogprobsData) -> PositionLogprobs:
        """Chosen token first (with its rank), then the top-k with ranks 1..k."""
        texts = self.tokenizer.batch_decode([[t] for t in entry.token_ids])
        out: PositionLogprobs = {}
        for i, (token_id, logprob, text) in enumerate(zip(entry.token_ids, entry.logprobs, texts)):
            if token_id not in out:
                out[token_id] = Logprob(logprob, entry.rank if i == 0 else i, text)
        return out

    def _update_text(self, state: RequestState, eo: EngineCoreOutput) -> None:
        assert state.detokenizer is not None
        faults.maybe_raise("detokenize", state.request_id)
        new_ids = eo.new_token_ids
        if eo.finish_reason == "stop" and new_ids and not state.params.include_stop_str_in_output:
            # The core stopped on a stop token (EOS or stop_token_ids), the last one here: as in
            # vLLM, its text is left out of the output (with skip_special_tokens=False it would
            # read "<|im_end|>"); the token id stays in token_ids.
            new_ids = new_ids[:-1]
        new_text = state.detokenizer.update(new_ids)
        if eo.finish_reason is not None:
            new_text += state.detokenizer.flush()
        state.text += new_text
        params = state.params
        if not params.stop or not new_text or len(state.output_token_ids) <= params.min_tokens:
            return
        match = find_stop_string(state.text, len(new_text), params)
        if match is not None:
            stop, cut = match
            state.text = state.text[:cut]
            state.finish_reason, state.stop_reason = "stop", stop
