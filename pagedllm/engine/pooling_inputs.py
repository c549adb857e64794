"""A pooling request's token ids: a text, a pair of texts (a cross-encoder's query and
document, joined by the tokenizer's pair template), or token ids; truncated on request.

`truncate_prompt_tokens` (vLLM's): keep the first k tokens (the tokenizer's truncation, so a
BERT prompt keeps its [CLS] and ends with [SEP]); -1: the model's limit (max_model_len - 1).
"""

from __future__ import annotations

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
