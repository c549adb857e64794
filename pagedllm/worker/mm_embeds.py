"""Image embeddings for a step: each image encoded once, its rows cached by image hash, and
the rows of the step's scheduled positions written over the placeholder tokens.

A prompt chunk may end inside an image (chunked prefill does not stop at image boundaries):
the image is encoded whole the first time any of its positions is scheduled, and each chunk
takes the rows of its own positions, so a split image is computed exactly as an unsplit one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.worker.sampling_inputs import CachedRequestState


class EncoderCache:
    """Encoder outputs by image hash, least recently used first out, within a budget of
    embedding rows (one image larger than the budget is kept alone until the next)."""

    def __init__(self, budget_rows: int) -> None:
        self.budget_rows = budget_rows
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_rows = 0
        self.hits = 0
        self.misses = 0

    def get(self, feature: MultiModalFeature, model: Any) -> torch.Tensor:
        """The image's rows [num_embeds, hidden], encoding it on a miss."""
        rows = self.entries.get(feature.identifier)
        if rows is not None:
            self.entries.move_to_end(feature.identifier)
            self.hits += 1
            return rows
        self.misses += 1
        device = next(model.parameters()).device
        rows = model.encode_images(torch.from_numpy(feature.pixel_values).to(device))
        assert rows.shape[0] == feature.num_embeds, (rows.shape, feature.num_embeds)
        while self.entries and self.num_rows + rows.shape[0] > self.budget_rows:
            _, old = self.entries.popitem(last=False)
            self.num_rows -= old.shape[0]
        self.entries[feature.identifier] = rows
        self.num_rows += rows.shape[0]
        return rows


def step_inputs_embeds(
    model: Any, cache: EncoderCache, states: list[CachedRequestState], query_start: list[int],
    num_scheduled: list[int], input_ids: torch.Tensor,
) -> torch.Tensor | None:
    """inputs_embeds [T, hidden] for the step: the token embeddings with every scheduled image
    position's row written in; None when no image position is scheduled (the model embeds)."""
    rows: list[np.ndarray] = []  # flat batch rows to overwrite
    parts: list[torch.Tensor] = []  # their image rows, in the same order
    for state, start, n in zip(states, query_start, num_scheduled):
        if not state.mm_features:
            continue
        lo = state.num_computed_tokens
        hi = lo + n
        for feature in state.mm_features:
            if feature.end <= lo or feature.offset >= hi:
                continue
            pos = feature.positions
            take = np.flatnonzero((pos >= lo) & (pos < hi))  # this chunk's rows of the image
            if len(take) == 0:
                continue
            embeds = cache.get(feature, model)
            parts.append(embeds[torch.from_numpy(take)])
            rows.append(start + pos[take] - lo)
    if not parts:
        return None
    inputs_embeds = model.embed_input_ids(input_ids)  # [T, hidden]
    index = torch.from_numpy(np.concatenate(rows)).to(inputs_embeds.device)
    inputs_embeds[index] = torch.cat(parts).to(inputs_embeds.dtype)
    return inputs_embeds
