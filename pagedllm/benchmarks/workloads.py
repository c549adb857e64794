"""Seeded random-token prompts, the workloads the benchmarks share."""

from __future__ import annotations

import numpy as np


def random_prompts(num: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded random-token prompts with lengths uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=num)
    # Stay clear of the low ids, where tokenizers keep their special tokens.
    return [rng.integers(100, vocab_size, size=int(n)).tolist() for n in lengths]


def random_token_prompts(num: int, input_len: int, range_ratio: float, vocab_size: int, seed: int) -> list[list[int]]:
    """`vllm bench serve`'s random dataset: lengths uniform in input_len * (1 +- range_ratio)."""
    rng = np.random.default_rng(seed)
    low, high = int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio))
    lengths = rng.integers(max(low, 1), max(high, 1) + 1, size=num)
    # Stay clear of the low ids, where tokenizers keep their special tokens.
    return [rng.integers(100, vocab_size, size=int(n)).tolist() for n in lengths]
