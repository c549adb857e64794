"""The runner's flat batch of one step: the model's inputs, the attention metadata and
where the sampled positions are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.worker.sampling_inputs import CachedRequestState


def build_batch(
    states: list[CachedRequestState],
    input_ids: np.ndarray,
    positions: np.ndarray,
    attn_metadata: AttentionMetadata | list[AttentionMetadata],
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    counts: np.ndarray,
    num_drafts: np.ndarray,
) -> Batch:
    """The step's Batch from its host arrays (R requests, T tokens; counts, num_drafts: [R])."""
    # A request samples when this step reaches the end of its known tokens (and drafts);
    # with k drafts it needs logits at its last k + 1 positions.
    # A pooling request never samples (worker/pooler.py pools its prompt).
    sample_rows = [
        i for i, s in enumerate(states)
        if seq_lens[i] == len(s.token_ids) + num_drafts[i] and s.pooling_params is None
    ]
    rows = np.asarray(sample_rows, dtype=np.int64)
    num_logits = num_drafts[rows] + 1
    ends = np.repeat(query_start[1:][rows], num_logits)
    offsets = np.arange(int(num_logits.sum())) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
    logits_indices = torch.from_numpy(ends - np.repeat(num_logits, num_logits) + offsets)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        attn_metadata=attn_metadata,
        logits_indices=logits_indices,
        sample_rows=sample_rows,
        query_start=query_start[:-1].tolist(),
        num_scheduled=counts.tolist(),
    )


def gather_input_ids(
    states: list[CachedRequestState], drafts: list[list[int]], computed: np.ndarray, counts: np.ndarray,
    query_start: np.ndarray, num_decodes: int,
) -> np.ndarray:
    """The step's token ids [T]: row i's ``counts[i]`` tokens from ``computed[i]`` on (its
    drafts after its known tokens). The leading decodes (one token, no drafts) are one list
    built in a comprehension and one copy, not a slice assignment per row."""
    input_ids = np.empty(int(query_start[-1]), dtype=np.int64)
    first = 0 if any(drafts[:num_decodes]) else num_decodes  # rows up to `first`: one known token
    at = computed[:first].tolist()
    input_ids[:first] = [s.token_ids[c] for s, c in zip(states, at)]
    for i in range(first, len(states)):
        s = states[i]
        tokens = s.token_ids + drafts[i] if drafts[i] else s.token_ids
        input_ids[query_start[i] : query_start[i + 1]] = tokens[computed[i] : computed[i] + counts[i]]
    return input_ids


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata | list[AttentionMetadata]  # one, or one per KV group
    logits_indices: torch.Tensor  # [num_sampling] index into the flat batch
    sample_rows: list[int]  # which requests (rows of this step) sample
    query_start: list[int]  # [R] offset of each request's first token in the flat batch
    num_scheduled: list[int]  # [R] tokens of each request this step

    def to(self, device: torch.device) -> Batch:
        """The batch with its index tensors on ``device`` (the metadata is there already)."""
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            attn_metadata=self.attn_metadata,
            logits_indices=self.logits_indices.to(device, non_blocking=True),
            sample_rows=self.sample_rows,
            query_start=self.query_start,
            num_scheduled=self.num_scheduled,
        )
