"""Prompt-lookup (n-gram) proposer: no model, numpy over each request's tokens.

The longest suffix n-gram of prompt + output (from ``prompt_lookup_max`` down to
``prompt_lookup_min`` tokens) that occurred earlier proposes the tokens that followed its most
recent earlier occurrence, up to ``num_speculative_tokens`` of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedllm.spec_decode.proposer import PrefillChunk, Proposer

if TYPE_CHECKING:
    from pagedllm.config import SpeculativeConfig
    from pagedllm.worker.sampling_inputs import CachedRequestState


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[list[int]], max_drafts: list[int]) -> list[list[int]]:
        """Drafts per request (possibly empty), at most ``min(k, max_drafts[i])`` each."""
        return [
            self.propose_one(np.asarray(tokens, dtype=np.int64), min(self.k, cap)) if cap > 0 else []
            for tokens, cap in zip(token_ids, max_drafts)
        ]

    def propose_one(self, tokens: np.ndarray, k: int) -> list[int]:
        # tokens: [L] int64
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows that end before the last token, so each has a continuation.
            windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start : start + k].tolist()
        return []


class NgramRunnerProposer(Proposer):
    """The runner's n-gram proposer: prompt lookup over each state's tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(
        self, states: list[CachedRequestState], max_model_len: int, prefills: Sequence[PrefillChunk] = ()
    ) -> list[list[int]]:
        return self.ngram.propose([s.token_ids for s in states], self.max_drafts(states, max_model_len))
