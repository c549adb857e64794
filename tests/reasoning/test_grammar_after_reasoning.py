"""The engine core starts a grammar after the reasoning: on a tiny model whose greedy output
is "hello world</think>" over and over (think_model.py), run through the real engine. With the
qwen3 parser the reasoning ("hello world", which the schema forbids) is free and the text
after "</think>" follows the JSON schema; where the reasoning is over before the output starts
(enable_thinking false, a prompt that closed it) or without a parser, the grammar holds from
the first token."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from tests.reasoning.think_model import REASONING

SCHEMA = {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"], "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Is it? Think first."}]
ENGINE_ARGS = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": "32MiB"}


def constrained(max_tokens: int = 40, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))


def assert_schema_document(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def llm(think_model_dir):
    return LLM(think_model_dir, reasoning_parser="qwen3", **ENGINE_ARGS)


def test_unconstrained_output_is_the_chain(llm):
    (out,) = llm.chat(CHAT, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    assert out.outputs[0].text == "hello world</think>hello world</think>"


def test_grammar_starts_after_the_end_marker(llm):
    outs = llm.chat(CHAT, constrained(n=2), use_tqdm=False)[0].outputs
    for c in outs:  # both sequences of n=2, each with its own reasoning state
        reasoning, marker, content = c.text.partition("</think>")
        assert (reasoning, marker) == (REASONING, "</think>"), c.text
        with pytest.raises(json.JSONDecodeError):  # the grammar did not hold before the marker
            json.loads(reasoning)
        assert_schema_document(content)
        assert c.finish_reason == "stop"
    engine_core = llm.llm_engine.engine_core
    assert engine_core.structured_output.num_matchers == 0 and not engine_core.structured_output._in_reasoning


def test_prompt_side_markers(llm):
    """A prompt whose last marker opens the reasoning waits for the output's end marker; one
    that closed it constrains from the first token."""
    (opened,) = llm.generate("Question: is it?<think>", constrained(), use_tqdm=False)
    assert opened.outputs[0].text.startswith(REASONING + "</think>")
    assert_schema_document(opened.outputs[0].text.removeprefix(REASONING + "</think>"))
    (closed,) = llm.generate("Question: is it?<think>\n\n</think>\n\n", constrained(), use_tqdm=False)
    assert_schema_document(closed.outputs[0].text)


def test_enable_thinking_false_constrains_from_the_start(llm):
    (out,) = llm.chat(CHAT, constrained(), chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    assert_schema_document(out.outputs[0].text)


def test_max_tokens_inside_the_reasoning(llm):
    (out,) = llm.chat(CHAT, constrained(max_tokens=3), use_tqdm=False)
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("hello world</", "length")


def test_without_a_parser_the_grammar_holds_from_the_start(think_model_dir):
    plain = LLM(think_model_dir, **ENGINE_ARGS)
    (out,) = plain.chat(CHAT, constrained(), use_tqdm=False)
    assert_schema_document(out.outputs[0].text)
