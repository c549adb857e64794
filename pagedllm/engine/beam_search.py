"""Beam search inside the engine: beams are core requests of one group that fork by sharing
KV blocks (copy-on-write for a shared partial block) and are freed the step they drop out.

Each step every live beam computes one token and reports the top 2k logprobs of its next
position (k = beam width). The driver scores candidates as HF transformers does with
``early_stopping=True``: a candidate's score is its cumulative logprob; candidates ending in
EOS (or reaching max_tokens) among the top k become finished hypotheses, scored
``cum_logprob / generated_len ** length_penalty``; the best k others continue. The search
ends when k hypotheses are finished or max_tokens is reached.

The core appends its own (greedy) token to each beam; the driver ignores it: the chosen
continuation becomes a new request forked from the beam (sharing its blocks) whose last,
uncomputed token is the chosen one, and the old beam is freed.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm import faults
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    """Kept for vLLM compatibility; only 0 (deterministic beam search) is supported."""
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {MAX_LOGPROBS // 2}], got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]
    """Prompt and generated tokens (an ending EOS included)."""
    cum_logprob: float
    text: str | None = None
    """The generated text (without the prompt and an ending EOS)."""
    score: float = 0.0
    """cum_logprob / generated_len ** length_penalty: the ranking key."""
    finish_reason: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    """The generated tokens (without the prompt and an ending EOS)."""


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """Best first."""


@dataclass
class _Beam:
    request: Request
    cum_logprob: float


@dataclass
class _Group:
    group_id: str
    prompt_token_ids: list[int]
    beams: list[_Beam]
    params: BeamSearchParams
    beam_params: SamplingParams
    finished: list[BeamSearchSequence] = field(default_factory=list)
    reported: dict[str, EngineCoreOutput] = field(default_factory=dict)


class BeamSearchManager:
    """Runs beam-search groups inside an engine core, step by step, beside ordinary requests.

    ``add`` queues a search; groups start while their beams fit ``max_num_seqs`` (a group
    holds up to k running sequences). ``process`` takes one step's outputs, keeps those of
    beams, advances every group whose beams all reported, and returns the other outputs plus
    one final ``EngineCoreOutput`` (with ``beams`` set, best first) per finished search.
    """

    def __init__(self, scheduler: Scheduler, eos_token_ids: list[int] | tuple[int, ...]) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = set(eos_token_ids)
        self._eos_list = list(eos_token_ids)
        self._ids = itertools.count()
        self._pending: deque[tuple[str, list[int], BeamSearchParams]] = deque()
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}  # core request id -> group id

    def add(self, request_id: str, prompt: list[int], params: BeamSearchParams) -> None:
        if len(prompt) + params.max_tokens >= self.scheduler.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} does "
                f"not fit max_model_len={self.scheduler.max_model_len}"
            )
        if request_id in self._groups or any(p[0] == request_id for p in self._pending):
            raise ValueError(f"request id {request_id!r} is already running")
        self._pending.append((request_id, list(prompt), params))
        self._start_pending()

    def has_unfinished(self) -> bool:
        return bool(self._groups or self._pending)

    def owns(self, request_id: str) -> bool:
        return request_id in self._groups or any(p[0] == request_id for p in self._pending)

    def search_id_of(self, request_id: str) -> str | None:
        """The beam search a core request (a beam) belongs to, if any."""
        return self._group_of.get(request_id)

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort searches by their ids; returns the ids that were not searches."""
        others = []
        for request_id in request_ids:
            group = self._groups.pop(request_id, None)
            if group is not None:
                self._drop_beams(group.beams)
            elif any(p[0] == request_id for p in self._pending):
                self._pending = deque(p for p in self._pending if p[0] != request_id)
            else:
                others.append(request_id)
        self._start_pending()
        return others

    def process(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        if not self._groups:
            return outputs
        others: list[EngineCoreOutput] = []
        touched: dict[str, _Group] = {}
        for out in outputs:
            group_id = self._group_of.get(out.request_id)
            if group_id is None:
                others.append(out)
                continue
            group = self._groups[group_id]
            group.reported[out.request_id] = out
            touched[group_id] = group
        for group_id, group in touched.items():
            if len(group.reported) != len(group.beams):
                # A beam was preempted: its siblings ran a step it did not. Fail the search.
                del self._groups[group_id]
                self._drop_beams(group.beams)
                others.append(self._final(group, error=(
                    "beam search lost lockstep (a beam was preempted for lack of KV cache): "
                    "raise kv_cache_memory_bytes or lower the beam width"
                ), retryable=True))
                continue
            try:
                done = self._advance(group)
            except Exception as e:  # noqa: BLE001 -- one search's fault fails it alone
                logger.exception("beam search %s failed; the others go on", group_id)
                others.append(self.fail(group_id, f"{type(e).__name__}: {e}"))
                continue
            if done:
                del self._groups[group_id]
                others.append(self._final(group))
        if touched:
            self._start_pending()
        return others

    def fail(self, search_id: str, error: str) -> EngineCoreOutput:
        """End a running search with an error: every request of its group is freed (forks
        made before the error included). Returns its final output."""
        group = self._groups.pop(search_id)
        ids = [r for r, g in self._group_of.items() if g == search_id]
        for request_id in ids:
            del self._group_of[request_id]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        self._start_pending()
        return self._final(group, error=error)

    # ---- groups ------------------------------------------------------------------------

    def _start_pending(self) -> None:
        in_use = sum(g.params.beam_width for g in self._groups.values())
        while self._pending and (
            not self._groups or in_use + self._pending[0][2].beam_width <= self.scheduler.max_num_seqs
        ):
            group_id, prompt, params = self._pending.popleft()
            group = _Group(group_id, prompt, [], params, _beam_params(params))
            request = self._new_request(group, [])
            self.scheduler.add_request(request)
            group.beams.append(_Beam(request, 0.0))
            self._groups[group_id] = group
            in_use += params.beam_width

    def _new_request(self, group: _Group, output: list[int]) -> Request:
        request = Request(
            f"{group.group_id}/{next(self._ids)}", group.prompt_token_ids, group.beam_params,
            eos_token_ids=self._eos_list, group_id=group.group_id,
        )
        request.append_output_token_ids(output)
        self._group_of[request.request_id] = group.group_id
        return request

    def _drop_beams(self, beams: list[_Beam]) -> None:
        ids = [b.request.request_id for b in beams]
        for request_id in ids:
            self._group_of.pop(request_id, None)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def _advance(self, group: _Group) -> bool:
        """Score this step's candidates, fork the chosen ones, free the rest. True when done."""
        faults.maybe_raise("beam", group.group_id)
        p = group.params
        k = p.beam_width
        generated_len = group.beams[0].request.num_output_tokens  # including the core's token
        at_max = generated_len >= p.max_tokens
        candidates: list[tuple[float, int, int]] = []  # (cum logprob, beam index, token)
        for i, beam in enumerate(group.beams):
            (entry,) = group.reported[beam.request.request_id].new_logprobs
            for token, logprob in zip(entry.token_ids[1:], entry.logprobs[1:]):
                candidates.append((beam.cum_logprob + logprob, i, token))
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[: 2 * k]
        group.reported.clear()

        continuing: list[tuple[float, int, int]] = []
        for rank, (cum, i, token) in enumerate(candidates):
            stops = at_max or (token in self.eos_token_ids and not p.ignore_eos)
            if stops:
                if rank < k:
                    beam = group.beams[i].request
                    tokens = group.prompt_token_ids + beam.output_token_ids[:-1] + [token]
                    group.finished.append(BeamSearchSequence(
                        tokens, cum, score=cum / generated_len**p.length_penalty,
                        finish_reason="length" if at_max and token not in self.eos_token_ids else "stop",
                    ))
            elif len(continuing) < k:
                continuing.append((cum, i, token))
        group.finished.sort(key=lambda s: -s.score)
        del group.finished[k:]
        done = at_max or len(group.finished) >= k or not continuing

        old = group.beams
        group.beams = []
        if not done:
            for cum, i, token in continuing:
                parent = old[i].request
                child = self._new_request(group, parent.output_token_ids[:-1] + [token])
                self.scheduler.add_forked_request(parent, child)
                group.beams.append(_Beam(child, cum))
        # Dropped beams (and the parents of forks) release their blocks now.
        self._drop_beams(old)
        return done

    def _final(self, group: _Group, error: str | None = None, retryable: bool = False) -> EngineCoreOutput:
        num_prompt = len(group.prompt_token_ids)
        for seq in group.finished:
            output = seq.tokens[num_prompt:]
            if output and output[-1] in self.eos_token_ids and not group.params.ignore_eos:
                seq.output_token_ids = output[:-1]
            else:
                seq.output_token_ids = output
        return EngineCoreOutput(
            group.group_id, [], "abort" if error else "stop", None, 0,
            beams=None if error else group.finished, error=error, retryable=retryable,
        )


def _beam_params(params: BeamSearchParams) -> SamplingParams:
    # The core never stops a beam: the manager decides (EOS and length).
    return SamplingParams(
        temperature=0.0, max_tokens=params.max_tokens + 1, ignore_eos=True,
        logprobs=2 * params.beam_width, detokenize=False,
    )


class BeamSearchDriver:
    """Offline beam search: the LLM class's loop over an in-process engine core."""

    def __init__(self, engine: LLMEngine, params: BeamSearchParams) -> None:
        self.engine = engine
        self.params = params

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        core = self.engine.engine_core
        ids = [f"beam-search-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            core.add_beam_search(request_id, prompt, self.params)
        finals: dict[str, EngineCoreOutput] = {}
        try:
            while core.has_unfinished_requests():
                for out in core.step():
                    if out.request_id in ids:
                        if out.error:
                            raise RuntimeError(out.error)
                        finals[out.request_id] = out
        except BaseException:
            core.abort_requests(ids)
            core.step()
            raise
        core.step()  # flush the freed beams' ids to the runner
        return [self._output(finals[i].beams) for i in ids]

    def _output(self, sequences: list[BeamSearchSequence]) -> BeamSearchOutput:
        tokenizer = self.engine.tokenizer
        for seq in sequences:
            seq.text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return BeamSearchOutput(sequences)
