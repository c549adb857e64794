"""A pooling request's token ids: a text, a pair of texts (a cross-encoder's query and
document, joined by the tokenizer's pair template), or token ids; truncated on request.

`truncate_prompt_tokens` (vLLM's): keep the first k tokens (the tokenizer's truncation, so a
BERT prompt keeps its [CLS] and ends with [SEP]); -1: the model's limit (max_model_len - 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def truncation_limit(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The token count to cut to, None for no cut; ValueError for an out-of-range value."""
    if truncate_prompt_tokens is None:
        return None
    limit = max_model_len - 1
    if truncate_prompt_tokens == -1:
        return limit
    if not 1 <= truncate_prompt_tokens <= limit:
        raise ValueError(
            f"truncate_prompt_tokens={truncate_prompt_tokens} must be -1 or between 1 and this model's maximum "
            f"input of {limit} tokens"
        )
    return truncate_prompt_tokens


def pooling_token_ids(
    tokenizer: Any, text: str | list[int], max_model_len: int, truncate_prompt_tokens: int | None = None,
    pair: str | None = None,
) -> list[int]:
    """The ids of ``text`` (or ``text`` itself when it is ids), joined with ``pair`` by the
    tokenizer's pair template when given."""
    limit = truncation_limit(truncate_prompt_tokens, max_model_len)
    if isinstance(text, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in text):
            raise ValueError("token id inputs must be lists of integers")
        return text[:limit] if limit is not None else list(text)
    kwargs: dict[str, Any] = {"truncation": True, "max_length": limit} if limit is not None else {}
    if pair is not None:
        return list(tokenizer(text, pair, **kwargs)["input_ids"])
    return list(tokenizer(text, **kwargs)["input_ids"])


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing for scores: one text against each of many, or the i-th with the i-th."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValueError("give at least one text on each side to score")
    if len(first) == 1:
        return [(first[0], b) for b in second]
    if len(first) != len(second):
        raise ValueError(f"got {len(first)} texts to score against {len(second)}; give one, or as many")
    return list(zip(first, second))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (an embedding model's score of a pair)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
