"""The runner's pooling of a step: each pooling request's prompt states pooled, chunk by chunk
(a causal model's prompt may run in chunks), into its output vector once its prompt ends.

The model's pooling (models/pooling.py: CLS, MEAN, LAST; normalization) is resolved at build
into the `PoolerConfig` given here; each request's `PoolingParams` chooses what it gets back
(an embedding, the classifier's probabilities, or the pooled vector as is).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.models.pooling import normalize
from pagedllm.pooling_params import PoolerConfig, PoolingParams


class StepPooler:
    def __init__(self, model: Any, config: PoolerConfig) -> None:
        assert config.pooling_type is not None and config.normalize is not None, config
        self.model = model
        self.config = config
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}
        """req id -> (pooled so far [H] float32, tokens pooled) over its earlier prompt chunks."""

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._partial.pop(req_id, None)

    def pool(self, hidden: torch.Tensor, states: list[Any], query_start: list[int],
             num_scheduled: list[int]) -> dict[str, list[float]]:
        """Outputs of the pooling requests whose prompt ends this step (hidden: [T, H]; row i's
        tokens start at query_start[i]; states' num_computed_tokens are pre-step)."""
        done: list[tuple[Any, torch.Tensor]] = []
        kind = self.config.pooling_type
        for i, state in enumerate(states):
            if state.pooling_params is None:
                continue
            start, count = query_start[i], num_scheduled[i]
            n = state.num_computed_tokens + count  # prompt tokens pooled after this chunk
            previous = self._partial.pop(state.req_id, None)
            if kind == "LAST":
                pooled = hidden[start + count - 1].float()
            elif kind == "CLS":  # the first chunk's first row (no prefix hit: reads_whole_prompt)
                pooled = hidden[start].float() if previous is None else previous[0]
            else:  # MEAN: a running sum over the chunks, divided at the end
                total = hidden[start : start + count].float().sum(0)  # [H]
                pooled = total if previous is None else previous[0] + total
            if n < state.num_prompt_tokens:
                self._partial[state.req_id] = (pooled, n)
                continue
            if kind == "MEAN":
                pooled = pooled / n
            done.append((state, pooled))
        if not done:
            return {}
        return self._outputs(done)

    def _outputs(self, done: list[tuple[Any, torch.Tensor]]) -> dict[str, list[float]]:
        pooled = torch.stack([p for _, p in done])  # [R, H]
        classify = getattr(self.model, "classify", None)
        logits = classify(pooled.to(next(self.model.parameters()).dtype)).float() if classify is not None else None
        out: dict[str, list[float]] = {}
        for r, (state, _) in enumerate(done):
            params: PoolingParams = state.pooling_params
            if params.task in ("classify", "score") or (params.task == "encode" and logits is not None):
                assert logits is not None, "checked at submission: the model has a classifier"
                row = logits[r]
                if params.activation:
                    row = torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, -1)
                out[state.req_id] = row.tolist()
                continue
            vector = pooled[r]
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            wants_norm = params.normalize if params.normalize is not None else self.config.normalize
            if params.task == "encode":
                wants_norm = self.config.normalize
            out[state.req_id] = (normalize(vector[None])[0] if wants_norm else vector).tolist()
        return out
