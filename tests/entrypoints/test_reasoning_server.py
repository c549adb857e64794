"""--reasoning-parser qwen3 through the server with the official openai client, on the tiny
model whose greedy output is "hello world</think>" over and over (tests/reasoning/think_model.py):
reasoning_content apart from content, plain and streamed (the streamed parts concatenate to the
plain ones, reasoning first, no marker text leaking); max_tokens inside the reasoning;
enable_thinking through chat_template_kwargs; a JSON schema whose grammar starts after
"</think>"."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.entrypoints.utils import RemoteServer
from tests.reasoning.think_model import REASONING

SCHEMA = {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"], "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
CHAT = [{"role": "user", "content": "Is it? Think first."}]
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def think_server(think_model_dir):
    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "32MiB",
                        "--reasoning-parser", "qwen3"], model=think_model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(think_server):
    import openai

    return openai.OpenAI(base_url=think_server.base_url, api_key="EMPTY", max_retries=0, timeout=120)


def ask(client, **kwargs):
    chat = client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT, temperature=0.0, **kwargs)
    (choice,) = chat.choices
    assert choice.message.reasoning == choice.message.reasoning_content  # vLLM's name and the older one
    return choice.message.reasoning, choice.message.content, choice.finish_reason


def ask_streamed(client, **kwargs):
    reasoning, content, finish, kinds = "", "", None, []
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHAT, temperature=0.0, stream=True, **kwargs)
    for chunk in stream:
        for choice in chunk.choices:
            r, c = getattr(choice.delta, "reasoning", None), choice.delta.content
            assert r == getattr(choice.delta, "reasoning_content", None)
            if r:
                reasoning += r
                kinds.append("reasoning")
            if c:
                content += c
                kinds.append("content")
            finish = choice.finish_reason or finish
    assert kinds == sorted(kinds, key=lambda k: k == "content"), kinds  # reasoning deltas first
    return reasoning or None, content or None, finish


def both(client, **kwargs):
    plain = ask(client, **kwargs)
    assert ask_streamed(client, **kwargs) == plain
    return plain


def test_reasoning_apart_from_content(client):
    assert both(client, max_tokens=8) == (REASONING, "hello world</", "length")
    assert both(client, max_tokens=5) == (REASONING, None, "length")


def test_max_tokens_inside_the_reasoning(client):
    assert both(client, max_tokens=3) == ("hello world</", None, "length")


def test_enable_thinking_false_has_no_reasoning(client):
    assert both(client, max_tokens=8, extra_body=THINKING_OFF) == (None, "hello world</think>hello world</", "length")


def test_include_reasoning_false(client):
    assert both(client, max_tokens=8, extra_body={"include_reasoning": False}) == (None, "hello world</", "length")


def test_each_streamed_choice_is_split_on_its_own(client):
    parts: dict[int, dict[str, str]] = {0: {"r": "", "c": ""}, 1: {"r": "", "c": ""}}
    for chunk in client.chat.completions.create(
            model=client.models.list().data[0].id, messages=CHAT, temperature=0.0, max_tokens=8, n=2, stream=True):
        for choice in chunk.choices:
            parts[choice.index]["r"] += getattr(choice.delta, "reasoning_content", None) or ""
            parts[choice.index]["c"] += choice.delta.content or ""
    assert parts[0] == parts[1] == {"r": REASONING, "c": "hello world</"}


def test_json_schema_applies_after_the_reasoning(client):
    reasoning, content, finish = both(client, max_tokens=40, response_format=RESPONSE_FORMAT)
    assert (reasoning, finish) == (REASONING, "stop")
    jsonschema.validate(json.loads(content), SCHEMA)
    # Thinking off: the grammar holds from the first token, and nothing is reasoning.
    reasoning, content, finish = both(client, max_tokens=40, response_format=RESPONSE_FORMAT, extra_body=THINKING_OFF)
    assert (reasoning, finish) == (None, "stop")
    jsonschema.validate(json.loads(content), SCHEMA)


TOOL = {"type": "function", "function": {"name": "answer_it", "description": "Give the answer.",
                                          "parameters": SCHEMA}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "answer_it"}}])
def test_forced_tool_call_after_the_reasoning(client, tool_choice):
    """A forced tool call's grammar starts after "</think>" too: the reasoning is free text, the
    call comes from the content after it, and its arguments validate; streamed equals plain."""
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=CHAT, temperature=0.0, max_tokens=64, tools=[TOOL], tool_choice=tool_choice)
    (choice,) = client.chat.completions.create(**kwargs).choices
    assert choice.message.reasoning_content == REASONING
    (call,) = choice.message.tool_calls
    assert call.function.name == "answer_it" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    reasoning, arguments, names, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            for d in c.delta.tool_calls or ():
                names += [d.function.name] if d.function.name else []
                arguments += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert (reasoning, names, arguments, finish) == (REASONING, ["answer_it"], call.function.arguments, "tool_calls")
