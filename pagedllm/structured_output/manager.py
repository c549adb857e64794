"""StructuredOutputManager: grammars and matchers of the engine core's constrained requests.

Life of a constrained request:
1. ``compile(spec)`` returns a future: compiled grammars are cached by their spec (the same
   schema compiles once), and compilation runs on a thread pool, never in the step loop.
2. Once compiled, ``add_matchers`` gives each sequence (n > 1: every sequence of the group)
   its own matcher; until then the engine core keeps the request out of the scheduler.
3. Each step ``grammar_bitmask`` fills one bitmask row per constrained request that samples
   (a prefill chunk that does not reach the end samples nothing and gets no row).
4. After sampling, ``accept`` advances the matcher with the appended tokens; a terminated
   matcher (the grammar accepted a stop token) means the request is done.

With a reasoning parser (``reasoning``), a sequence whose output starts inside the reasoning
is unconstrained until its output holds the end marker's token ids (``</think>``): it gets no
bitmask row, and its matcher sees only the tokens after the marker. Whether it starts inside
is the request's ``structured_outputs.reasoning_ended`` (the chat server sets it), else the
parser's rule on the decoded prompt.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pagedllm import faults
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.bitmask import GrammarBitmask
from pagedllm.structured_output.grammar import compile_spec

if TYPE_CHECKING:
    from pagedllm.reasoning.base import ReasoningParser
    from pagedllm.request import Request

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], max_workers: int | None = None,
        reasoning: ReasoningParser | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reasoning = reasoning  # the engine's reasoning parser: grammars start after its end marker
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.max_workers = max_workers or min(2, os.cpu_count() or 1)
        self._compiler: Any = None  # built on first use: imports xgrammar, reads the vocabulary
        self._compiler_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._grammars: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._matchers: dict[str, Any] = {}  # request id -> xgrammar GrammarMatcher
        # Sequences still inside their reasoning: request id -> their last output token ids
        # (fewer than the longest end-marker sequence), to find a marker spread over steps.
        self._in_reasoning: dict[str, tuple[int, ...]] = {}

    # ---- compiling ---------------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``spec`` (a future; done at once on a cache hit)."""
        key = spec.key
        future = self._grammars.get(key)
        if future is not None:
            self._grammars.move_to_end(key)
            return future
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix="pagedllm-grammar")
        future = self._executor.submit(self._compile, spec)
        self._grammars[key] = future
        while len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return future

    def release(self, spec: StructuredOutputsParams, future: Future) -> None:
        """No request waits for ``future`` any more (aborted, or past its compile deadline):
        a compile not yet started is cancelled and forgotten, so it never takes a thread; one
        running finishes on its thread (xgrammar cannot be interrupted) and stays cached."""
        if future.cancel() and self._grammars.get(spec.key) is future:
            del self._grammars[spec.key]

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        t0 = time.perf_counter()
        compiled = compile_spec(self._get_compiler(), spec)
        logger.debug("compiled a %s grammar in %.3f s", spec.key[0], time.perf_counter() - t0)
        # A grammar valid as text may still admit no token of this vocabulary at its start
        # (e.g. a character no token spells): the request's own fault, refused before it runs.
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not matcher.is_terminated() and not bool(bitmask.any()):
            raise ValueError(
                f"the {spec.key[0]} constraint admits no token of this model's vocabulary at its start; "
                "change the constraint"
            )
        return compiled

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                from pagedllm.models.tokenizer_snapshot import transformers_tokenizer

                info = xgr.TokenizerInfo.from_huggingface(
                    transformers_tokenizer(self.tokenizer), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # Caching is ours (by spec, with futures shared by concurrent requests).
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_workers, cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- matchers ----------------------------------------------------------------------

    def add_matchers(self, request_ids: list[str], compiled: Any, reasoning_ended: bool = True) -> None:
        """One fresh matcher per sequence (the sequences of n > 1 fork before any output,
        so a fresh matcher is the forked one); ``reasoning_ended`` False: each waits for the
        end of its reasoning (``reasoning_ended_at_start``)."""
        import xgrammar as xgr

        for request_id in request_ids:
            self._matchers[request_id] = xgr.GrammarMatcher(compiled)
            if not reasoning_ended:
                self._in_reasoning[request_id] = ()

    def reasoning_ended_at_start(self, request: Request) -> bool:
        """Whether ``request``'s grammar applies from its first output token."""
        if self.reasoning is None:
            return True
        spec = request.sampling_params.structured_outputs
        if spec is not None and spec.reasoning_ended is not None:
            return spec.reasoning_ended
        prompt = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
        return not self.reasoning.starts_in_reasoning(prompt)

    def has_matcher(self, request_id: str) -> bool:
        return request_id in self._matchers

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._in_reasoning.pop(request_id, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    # ---- one step ----------------------------------------------------------------------

    def grammar_bitmask(
        self, sampling_req_ids: list[str], failed: dict[str, str], rejected: set[str] | None = None
    ) -> GrammarBitmask | None:
        """Masks for the constrained requests among ``sampling_req_ids`` (those that sample
        this step), in that order; None if none is constrained. A request whose matcher raises
        gets no row and lands in ``failed`` (id -> message); its matcher is dropped. One whose
        grammar admits no token here (a dead end in this vocabulary) lands in ``failed`` and
        in ``rejected`` too: the request's own fault, not the engine's."""
        req_ids = [r for r in sampling_req_ids if r in self._matchers and r not in self._in_reasoning]
        if not req_ids:
            return None
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(req_ids), self.vocab_size)  # [R, W] int32
        rows: list[int] = []
        for row, request_id in enumerate(req_ids):
            try:
                faults.maybe_raise("grammar", request_id)
                matcher = self._matchers[request_id]
                matcher.fill_next_token_bitmask(bitmask, row)
                if not matcher.is_terminated() and not bool(bitmask[row].any()):
                    del self._matchers[request_id]
                    failed[request_id] = (
                        "the structured-output constraint admits no token of this model's vocabulary "
                        "after the text generated so far; change the constraint"
                    )
                    if rejected is not None:
                        rejected.add(request_id)
                    continue
                rows.append(row)
            except Exception as e:  # noqa: BLE001 -- one grammar's fault fails its request alone
                logger.error("request %s: filling its grammar bitmask failed: %s", request_id, e)
                del self._matchers[request_id]
                failed[request_id] = f"{type(e).__name__}: {e}"
        if len(rows) < len(req_ids):
            if not rows:
                return None
            req_ids, bitmask = [req_ids[r] for r in rows], bitmask[rows]
        return GrammarBitmask(req_ids, bitmask)

    def accept(self, request_id: str, token_ids: list[int]) -> bool | None:
        """Advance the request's matcher. Returns None when it has no matcher, True when the
        grammar is finished (terminated), False while it continues. Raises ValueError if the
        grammar rejects a token (a sampled token outside the mask: a bug, or a mask that
        other restrictions emptied). Inside the reasoning, tokens go to the matcher only
        after the end marker."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        if request_id in self._in_reasoning:
            after = self._reasoning_end(request_id, token_ids)
            if after is None:
                return False
            token_ids = token_ids[after:]
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                raise ValueError(f"request {request_id}: the grammar rejects token {token_id}")
        return matcher.is_terminated()

    def _reasoning_end(self, request_id: str, token_ids: list[int]) -> int | None:
        """The index in ``token_ids`` just past the reasoning's end marker (the sequence then
        leaves the reasoning), or None while the marker has not been completed."""
        assert self.reasoning is not None
        markers = self.reasoning.end_token_ids
        tail = self._in_reasoning[request_id]
        seq = tail + tuple(token_ids)
        for end in range(len(tail) + 1, len(seq) + 1):
            if any(seq[max(0, end - len(m)):end] == m for m in markers):
                del self._in_reasoning[request_id]
                return end - len(tail)
        keep = max(len(m) for m in markers) - 1
        self._in_reasoning[request_id] = seq[-keep:] if keep else ()
        return None
