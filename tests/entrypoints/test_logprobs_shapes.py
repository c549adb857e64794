"""OpenAI logprobs shapes built from CompletionOutput.logprobs (hand-made, no server)."""

from __future__ import annotations

import math

from pagedllm.entrypoints.openai.serving_base import chat_logprobs, completion_logprobs
from pagedllm.outputs import Logprob

TOKENS = {5: "He", 6: "llo", 7: " world", 8: "!"}


def decode(token_id: int) -> str:
    return TOKENS[token_id]


def positions():
    # Chosen tokens 5 (rank 1) then 7 (rank 2, sampled below the top); top-2 plus the chosen.
    return [
        {5: Logprob(-0.1, 1, "He"), 6: Logprob(-2.5, 2, "llo")},
        {6: Logprob(-0.5, 1, None), 7: Logprob(-1.2, 2, " world"), 8: Logprob(-float("inf"), 3, "!")},
    ]


def test_completion_logprobs_shape():
    lp = completion_logprobs([5, 7], positions(), num_top=2, decode=decode, text_offset=10)
    assert lp.tokens == ["He", " world"]
    assert lp.token_logprobs == [-0.1, -1.2]
    assert lp.top_logprobs == [{"He": -0.1, "llo": -2.5}, {"llo": -0.5, " world": -1.2}]
    assert lp.text_offset == [10, 12]
    none = completion_logprobs([5], positions()[:1], num_top=0, decode=decode)
    assert none.top_logprobs == [None] and none.token_logprobs == [-0.1]


def test_chat_logprobs_shape_and_finite_values():
    content = chat_logprobs([5, 8], positions(), num_top=1, decode=decode)
    assert [c.token for c in content] == ["He", "!"]
    assert content[0].logprob == -0.1 and content[0].bytes == list(b"He")
    assert [t.token for t in content[0].top_logprobs] == ["He"]
    assert [t.token for t in content[1].top_logprobs] == ["llo"]
    assert math.isfinite(content[1].logprob)  # -inf becomes a JSON-safe number
    dumped = content[1].model_dump()
    assert set(dumped) == {"token", "logprob", "bytes", "top_logprobs"}
