"""StructuredOutputManager: grammars and matchers of the engine core's constrained requests.

Life of a constrained request:
1. ``compile(spec)`` returns a future: compiled grammars are cached by their spec (the same
   schema compiles once), and compilation runs on a thread pool, never in the step loop.
2. Once compiled, ``add_matchers`` gives each sequence (n > 1: every sequence of the group)
   its own matcher; until then the engine core keeps the request out of the scheduler.
3. Each step ``grammar_bitmask`` fills one bitmask row per constrained request that samples
   (a prefill chunk that does not reach the end samples nothing and gets no row). Under
   speculative decoding a request with k draft tokens gets k + 1 rows: row i is the mask
   after its first i drafts, found by feeding the drafts to its matcher and rolling them
   back. A draft the grammar rejects ends that: the target's masked row at its position
   cannot pick it, so verification stops there, and later rows (never used) allow all.
   Verification thus samples every kept token from a masked distribution, as without
   speculation (greedy: the same output).
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
        self, sampling_req_ids: list[str], failed: dict[str, str], rejected: set[str] | None = None,
        drafts: dict[str, list[int]] | None = None,
    ) -> GrammarBitmask | None:
        """Masks for the constrained requests among ``sampling_req_ids`` (those that sample
        this step), in that order; None if none is constrained. ``drafts``: each request's
        draft tokens this step (speculative decoding): 1 + len(drafts) rows for it. A request
        whose matcher raises gets no row and lands in ``failed`` (id -> message); its matcher
        is dropped. One whose grammar admits no token here (a dead end in this vocabulary)
        lands in ``failed`` and in ``rejected`` too: the request's own fault, not the engine's."""
        drafts = drafts or {}
        # (request, tokens before its grammar applies): those inside their reasoning take part
        # only when their drafts end it (their rows until then allow all).
        req_ids: list[tuple[str, int]] = []
        for r in sampling_req_ids:
            if r not in self._matchers:
                continue
            if r not in self._in_reasoning:
                req_ids.append((r, 0))
            elif drafts.get(r) and (end := self._reasoning_end_in(r, drafts[r])) is not None:
                req_ids.append((r, end))
        if not req_ids:
            return None
        import xgrammar as xgr

        num_rows = [1 + len(drafts.get(r, ())) for r, _ in req_ids]
        bitmask = xgr.allocate_token_bitmask(sum(num_rows), self.vocab_size)  # [R, W] int32, all allowed
        kept: list[int] = []  # indices into req_ids
        first = 0
        for index, ((request_id, skip), n) in enumerate(zip(req_ids, num_rows)):
            row, first = first + skip, first + n
            try:
                faults.maybe_raise("grammar", request_id)
                matcher = self._matchers[request_id]
                matcher.fill_next_token_bitmask(bitmask, row)
                if skip == 0 and not matcher.is_terminated() and not bool(bitmask[row].any()):
                    del self._matchers[request_id]
                    failed[request_id] = (
                        "the structured-output constraint admits no token of this model's vocabulary "
                        "after the text generated so far; change the constraint"
                    )
                    if rejected is not None:
                        rejected.add(request_id)
                    continue
                if n > 1:
                    self._fill_draft_rows(matcher, bitmask, row, drafts[request_id][skip:])
                kept.append(index)
            except Exception as e:  # noqa: BLE001 -- one grammar's fault fails its request alone
                logger.error("request %s: filling its grammar bitmask failed: %s", request_id, e)
                del self._matchers[request_id]
                failed[request_id] = f"{type(e).__name__}: {e}"
        if not kept:
            return None
        if len(kept) < len(req_ids):
            starts = [sum(num_rows[:i]) for i in range(len(num_rows))]
            bitmask = bitmask[[starts[i] + j for i in kept for j in range(num_rows[i])]]
        ids, rows = [req_ids[i][0] for i in kept], [num_rows[i] for i in kept]
        return GrammarBitmask(ids, bitmask, rows if any(n > 1 for n in rows) else None)

    @staticmethod
    def _fill_draft_rows(matcher: Any, bitmask: Any, row: int, draft: list[int]) -> None:
        """Rows ``row + 1 ...``: the masks after each draft token the grammar accepts (row
        ``row`` is filled already); the matcher is rolled back after. Rows past a rejected
        draft, a finished grammar or a dead end allow every token (they are never used:
        verification stops at the rejected draft, the stop token, or the request fails)."""
        accepted = 0
        for token_id in draft:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            accepted += 1
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row + accepted)
                if not bool(bitmask[row + accepted].any()):
                    bitmask[row + accepted] = -1
        if accepted:
            matcher.rollback(accepted)

    def _reasoning_end_in(self, request_id: str, token_ids: list[int]) -> int | None:
        """Like ``_reasoning_end`` on tokens not output yet (drafts), changing nothing."""
        assert self.reasoning is not None
        tail = self._in_reasoning[request_id]
        seq = tail + tuple(token_ids)
        for end in range(len(tail) + 1, len(seq) + 1):
            if any(seq[max(0, end - len(m)):end] == m for m in self.reasoning.end_token_ids):
                return end - len(tail)
        return None

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
