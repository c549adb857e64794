"""The structured-output manager with a reasoning parser, token by token on the real default
vocabulary (where '</think>' is three tokens): no bitmask row and no grammar while a sequence
is inside its reasoning, the grammar from the token after the end marker, even within one
step's tokens."""

from __future__ import annotations

import pytest

from pagedllm.reasoning import get_reasoning_parser
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.manager import StructuredOutputManager

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    reasoning = get_reasoning_parser("qwen3")(default_tokenizer)
    m = StructuredOutputManager(default_tokenizer, len(default_tokenizer), [default_tokenizer.eos_token_id],
                                reasoning=reasoning)
    yield m
    m.shutdown()


@pytest.fixture(scope="module")
def compiled(manager):
    return manager.compile(StructuredOutputsParams(json=SCHEMA)).result(timeout=120)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def rows(manager, req_ids) -> list[str]:
    failed: dict[str, str] = {}
    bitmask = manager.grammar_bitmask(req_ids, failed)
    assert not failed
    return [] if bitmask is None else bitmask.req_ids


def test_grammar_waits_for_the_end_marker(manager, compiled, default_tokenizer):
    tok = default_tokenizer
    manager.add_matchers(["thinking"], compiled, reasoning_ended=False)
    manager.add_matchers(["plain"], compiled)
    try:
        assert rows(manager, ["thinking", "plain"]) == ["plain"]
        # Reasoning the schema forbids, one token at a time: the grammar sees none of it.
        for token_id in ids(tok, "Not JSON at all: </b> </thin"):
            assert manager.accept("thinking", [token_id]) is False
            assert rows(manager, ["thinking"]) == []
        end = ids(tok, "</think>")
        assert len(end) == 3
        for token_id in end:
            assert rows(manager, ["thinking"]) == []
            assert manager.accept("thinking", [token_id]) is False
        assert rows(manager, ["thinking", "plain"]) == ["thinking", "plain"]  # constrained from here
        with pytest.raises(ValueError, match="rejects"):
            manager.accept("thinking", ids(tok, "hello"))
    finally:
        manager.remove(["thinking", "plain"])
    assert manager.num_matchers == 0 and not manager._in_reasoning


@pytest.mark.parametrize("text", ["x</think>", "x </think>"])
def test_marker_and_content_in_one_step(manager, compiled, default_tokenizer, text):
    """Several tokens at once (as a speculative step would bring): those after the marker go
    to the grammar, those before it do not."""
    tok = default_tokenizer
    manager.add_matchers(["good", "bad"], compiled, reasoning_ended=False)
    try:
        assert manager.accept("good", ids(tok, text) + ids(tok, '{"ok":true}')) is False
        assert manager.accept("good", [tok.eos_token_id]) is True  # the document is complete
        with pytest.raises(ValueError, match="rejects"):
            manager.accept("bad", ids(tok, text + "hello"))
    finally:
        manager.remove(["good", "bad"])


def test_reasoning_ended_at_start(manager, default_tokenizer):
    """The request's own setting first (the chat server's), else the decoded prompt."""
    tok = default_tokenizer

    def request(prompt: str, reasoning_ended: bool | None = None) -> Request:
        spec = StructuredOutputsParams(json=SCHEMA, reasoning_ended=reasoning_ended)
        return Request("r", ids(tok, prompt), SamplingParams(structured_outputs=spec))

    assert manager.reasoning_ended_at_start(request("Question?")) is False  # qwen3 thinks by default
    assert manager.reasoning_ended_at_start(request("Question?<think>")) is False
    assert manager.reasoning_ended_at_start(request("Question?<think>\n\n</think>\n\n")) is True
    assert manager.reasoning_ended_at_start(request("Question?", reasoning_ended=True)) is True
    assert manager.reasoning_ended_at_start(request("Q?<think>\n\n</think>", reasoning_ended=False)) is False
    no_reasoning = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])
    assert no_reasoning.reasoning_ended_at_start(request("Question?<think>")) is True
