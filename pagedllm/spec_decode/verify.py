"""Verification of drafts: the rejection sampler over each request's k + 1 logits rows."""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.core.sched_output import PositionLogprobsData
from pagedllm.sample.rejection_sampler import RejectionSampler
from pagedllm.worker.sampling_inputs import CachedRequestState, build_sampling_metadata


def verify_drafts(
    sampler: RejectionSampler,
    logits: torch.Tensor,
    states: list[CachedRequestState],
    drafts: list[list[int]],
    eos_token_ids: list[int],
) -> tuple[list[list[int]], list[list[PositionLogprobsData] | None] | None]:
    """logits: [sum(1 + len(d)), V], each request's rows consecutive. Returns the emitted
    tokens per request and, for requests asking for them, logprobs per emitted token."""
    # Row j of a request is sampled as if its first j drafts were already output, so
    # penalties, bad words, min_tokens and seeded generators see exactly that history.
    row_states: list[CachedRequestState] = []
    for state, draft in zip(states, drafts):
        row_states.append(state)
        row_states.extend(
            dataclasses.replace(state, token_ids=state.token_ids + draft[:j]) for j in range(1, len(draft) + 1)
        )
    md = build_sampling_metadata(row_states, logits.shape[1], eos_token_ids)
    out = sampler(logits, md, drafts)
    if out.logprobs is None:
        return out.token_ids, None
    lists = out.logprobs.tolists([s.sampling_params.logprobs or 0 for s in row_states])
    logprobs: list[list[PositionLogprobsData] | None] = []
    row = 0
    for state, draft, emitted in zip(states, drafts, out.token_ids):
        wants = state.sampling_params.logprobs is not None
        logprobs.append(lists[row : row + len(emitted)] if wants else None)
        row += len(draft) + 1
    return out.token_ids, logprobs
