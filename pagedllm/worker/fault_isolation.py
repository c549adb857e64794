"""Per-request fault isolation in the runner: a request whose sampling parameters or draft
proposal make the batched call raise fails alone, not the whole batch.

The batched call runs first, so a step where nothing fails costs nothing extra. If it raises,
each request is tried alone to find those that fail by themselves; they are reported failed
(request id -> message) and the call is repeated over the others. A failure that no request
causes alone (a bug in the batched path itself) is raised again, and the engine core fails
the step as before. Sampling twice is harmless: every sampling op is out of place, and a
seeded request's generator is a function of (seed, position) only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from pagedllm import faults
from pagedllm.spec_decode.verify import verify_drafts
from pagedllm.worker.sampling_inputs import CachedRequestState, build_sampling_metadata

if TYPE_CHECKING:
    from pagedllm.core.sched_output import PositionLogprobsData
    from pagedllm.sample.rejection_sampler import RejectionSampler
    from pagedllm.sample.sampler import Sampler, SamplerOutput
    from pagedllm.spec_decode.proposer import PrefillChunk, Proposer

logger = logging.getLogger(__name__)

T = TypeVar("T")


def isolate(call: Callable[[list[int]], T], req_ids: list[str]) -> tuple[T | None, list[int], dict[str, str]]:
    """``call(indices)`` does the batched work for those requests (indices into ``req_ids``).
    Returns (its result over the kept requests or None if none is kept, the kept indices,
    {failed request id: message}).

    Each round that raises tries every remaining request alone and drops those that fail, so
    a request that fails only on a later call (a fault that depends on how often it ran)
    is caught in the next round instead of failing the step; every round drops at least one
    request, so this ends."""
    kept = list(range(len(req_ids)))
    failed: dict[str, str] = {}
    while kept:
        try:
            result = call(kept)
        except Exception:
            newly: dict[str, str] = {}
            for i in kept:
                try:
                    call([i])
                except Exception as e:  # noqa: BLE001 -- this request's fault: it fails alone
                    newly[req_ids[i]] = f"{type(e).__name__}: {e}"
            if not newly:
                raise  # no request fails alone: the batched path itself is broken
            for request_id, message in newly.items():
                logger.error("request %s failed in the model runner: %s", request_id, message)
            failed.update(newly)
            kept = [i for i in kept if req_ids[i] not in failed]
            continue
        return result, kept, failed
    return None, kept, failed


def sample_isolated(
    sampler: Sampler, logits: torch.Tensor, states: list[CachedRequestState], eos_token_ids: list[int]
) -> tuple[SamplerOutput | None, list[CachedRequestState], dict[str, str]]:
    """Sample one token per state (logits: [len(states), V]); returns the sampler's output over
    the kept states, the kept states and the failed ones."""

    def call(idx: list[int]) -> SamplerOutput:
        sub = [states[i] for i in idx]
        md = build_sampling_metadata(sub, logits.shape[1], eos_token_ids, device=logits.device)
        return sampler(logits if len(idx) == len(states) else logits[idx], md)

    out, kept, failed = isolate(call, [s.req_id for s in states])
    return out, [states[i] for i in kept], failed


def verify_isolated(
    sampler: RejectionSampler,
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts: list[list[int]],
    eos_token_ids: list[int],
) -> tuple[tuple[list[list[int]], list[list[PositionLogprobsData] | None] | None] | None, list[int], dict[str, str]]:
    """``verify_drafts`` with isolation; logits: [sum(1 + k_r), V], each request's rows
    consecutive. Returns (its result over the kept states, the kept indices, the failed)."""
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + 1 + len(d))

    def call(idx: list[int]):
        if len(idx) == len(states):
            return verify_drafts(sampler, logits, states, drafts, eos_token_ids)
        rows = [r for i in idx for r in range(starts[i], starts[i + 1])]
        return verify_drafts(sampler, logits[rows], [states[i] for i in idx], [drafts[i] for i in idx], eos_token_ids)

    return isolate(call, [s.req_id for s in states])


def propose_isolated(
    proposer: Proposer, states: list[CachedRequestState], max_model_len: int, prefills: Sequence[PrefillChunk] = ()
) -> tuple[list[list[int]], dict[str, str]]:
    """Drafts per state (a failed state gets none) and the failed states. Every call passes
    all of ``prefills`` (writing their draft KV again is harmless: same tokens, same slots)."""

    def call(idx: list[int]) -> list[list[int]]:
        sub = [states[i] for i in idx]
        faults.maybe_raise_any("propose", (s.req_id for s in sub))
        return proposer.propose(sub, max_model_len, prefills)

    proposals, kept, failed = isolate(call, [s.req_id for s in states])
    drafts: list[list[int]] = [[] for _ in states]
    for i, d in zip(kept, proposals or []):
        drafts[i] = d
    return drafts, failed
