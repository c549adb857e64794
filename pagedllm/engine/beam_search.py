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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine


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
    finished: list[BeamSearchSequence] = field(default_factory=list)
    reported: dict[str, EngineCoreOutput] = field(default_factory=dict)


class BeamSearchDriver:
    def __init__(self, engine: LLMEngine, params: BeamSearchParams) -> None:
        self.engine = engine
        self.params = params
        self.scheduler = engine.scheduler
        self.eos_token_ids = set(engine.model_config.eos_token_ids)
        self._ids = itertools.count()
        # The core never stops a beam: the driver decides (EOS and length).
        self._beam_params = SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens + 1, ignore_eos=True,
            logprobs=2 * params.beam_width, detokenize=False,
        )

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        k = self.params.beam_width
        max_groups = max(1, self.scheduler.max_num_seqs // k)
        results: list[BeamSearchOutput] = []
        for start in range(0, len(prompts), max_groups):
            groups = [self._start(p) for p in prompts[start : start + max_groups]]
            active = {g.group_id: g for g in groups}
            while active:
                for out in self.engine.engine_core.step():
                    group = active[self.scheduler_group(out.request_id)]
                    group.reported[out.request_id] = out
                for group in list(active.values()):
                    if not group.reported:
                        continue
                    if len(group.reported) != len(group.beams):
                        raise RuntimeError(
                            "beam search lost lockstep (a beam was preempted): raise "
                            "kv_cache_memory_bytes or lower the beam width"
                        )
                    if self._advance(group):
                        del active[group.group_id]
            results += [self._output(g) for g in groups]
        self.engine.engine_core.step()  # flush the freed beams' ids to the runner
        return results

    def scheduler_group(self, request_id: str) -> str:
        return request_id.rsplit("/", 1)[0]

    def _new_request(self, group_id: str, prompt: list[int], output: list[int]) -> Request:
        request = Request(
            f"{group_id}/{next(self._ids)}", prompt, self._beam_params,
            eos_token_ids=self.engine.model_config.eos_token_ids, group_id=group_id,
        )
        request.append_output_token_ids(output)
        return request

    def _start(self, prompt: list[int]) -> _Group:
        if len(prompt) + self.params.max_tokens >= self.scheduler.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens={self.params.max_tokens} does "
                f"not fit max_model_len={self.scheduler.max_model_len}"
            )
        group_id = f"beam-{next(self._ids)}"
        request = self._new_request(group_id, prompt, [])
        self.engine.engine_core.add_request(request)
        return _Group(group_id, list(prompt), [_Beam(request, 0.0)])

    def _advance(self, group: _Group) -> bool:
        """Score this step's candidates, fork the chosen ones, free the rest. True when done."""
        k, p = self.params.beam_width, self.params
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
                child = self._new_request(
                    group.group_id, group.prompt_token_ids, parent.output_token_ids[:-1] + [token]
                )
                self.scheduler.add_forked_request(parent, child)
                group.beams.append(_Beam(child, cum))
        # Dropped beams (and the parents of forks) release their blocks now.
        self.scheduler.finish_requests([b.request.request_id for b in old], RequestStatus.FINISHED_ABORTED)
        return done

    def _output(self, group: _Group) -> BeamSearchOutput:
        tokenizer = self.engine.tokenizer
        num_prompt = len(group.prompt_token_ids)
        for seq in group.finished:
            output = seq.tokens[num_prompt:]
            if output and output[-1] in self.eos_token_ids and not self.params.ignore_eos:
                output = output[:-1]
            seq.text = tokenizer.decode(output, skip_special_tokens=True)
        return BeamSearchOutput(group.finished)
