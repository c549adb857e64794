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
from tests.reasoning.think_model import GRANITE_CHAIN, REASONING, save_think_model

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


# ---- the thinking budget (reasoning/budget.py) ------------------------------------------
# The model thinks "hello world" (2 tokens) before its "</think>" ("</", "think", ">"); a budget
# of one token cuts the reasoning after "hello", forces the marker, and the answer follows.


def test_thinking_token_budget_cuts_the_reasoning(client):
    assert both(client, max_tokens=6, extra_body={"thinking_token_budget": 1}) == ("hello", "hello world", "length")
    assert both(client, max_tokens=5, extra_body={"thinking_token_budget": 0}) == (None, "hello world", "length")
    # A budget the reasoning stays within changes nothing.
    assert both(client, max_tokens=8, extra_body={"thinking_token_budget": 5}) == (REASONING, "hello world</", "length")
    # Thinking off: nothing to cut.
    off = {"thinking_token_budget": 1, **THINKING_OFF}
    assert both(client, max_tokens=8, extra_body=off) == (None, "hello world</think>hello world</", "length")


def test_thinking_token_budget_refused_values(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        ask(client, max_tokens=4, extra_body={"thinking_token_budget": -2})
    assert e.value.body["param"] == "thinking_token_budget"


def test_reasoning_budget_server_default(think_model_dir):
    """--reasoning-budget (llama-server's) applies to requests that leave the field out."""
    import openai

    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "32MiB",
                        "--reasoning-parser", "qwen3", "--reasoning-budget", "1"], model=think_model_dir)
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0, timeout=120)
        assert both(c, max_tokens=6) == ("hello", "hello world", "length")
        assert both(c, max_tokens=7, extra_body={"thinking_token_budget": -1}) == (REASONING, "hello world", "length")
    finally:
        srv.stop()


def test_responses_reasoning_items_and_events(client, think_server):
    """/v1/responses on a reasoning model: a reasoning item then the message, plain and
    streamed (response.reasoning_text.* events, each valid as the SDK's own), with the budget."""
    from tests.entrypoints.test_responses import raw_events

    model = client.models.list().data[0].id
    kwargs = dict(model=model, input="Is it? Think first.", temperature=0.0, max_output_tokens=6,
                  extra_body={"thinking_token_budget": 1})
    r = client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "hello" and r.output_text == "hello world"
    assert r.status == "incomplete"
    events = raw_events(think_server, {"model": model, "input": "Is it? Think first.", "temperature": 0.0,
                                       "max_output_tokens": 6, "thinking_token_budget": 1})
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "hello"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "hello world"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "message"]


@pytest.mark.slow
def test_granite_phrases(tmp_path, default_tokenizer):
    """--reasoning-parser granite on a model that writes "Here is my thought process: hi Here's
    my response:** ok" (tests/reasoning/think_model.py's GRANITE_CHAIN): thinking on by
    Granite's template switch, off by default; a budget writes "Here is my response:"."""
    import openai

    save_think_model(tmp_path, default_tokenizer, GRANITE_CHAIN)
    srv = RemoteServer(["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "32MiB",
                        "--reasoning-parser", "granite"], model=str(tmp_path))
    try:
        c = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0, timeout=120)
        on = {"chat_template_kwargs": {"thinking": True}}
        assert both(c, max_tokens=14, extra_body=on) == (" hi ", "** ok", "length")
        assert both(c, max_tokens=10, extra_body=on) == (" hi Here's m", None, "length")
        text = "Here is my thought process: hi Here's my response:** ok"
        assert both(c, max_tokens=14) == (None, text, "length")
        # Budget 7: after " hi" the canonical phrase is forced (5 tokens), and ":" leads to " hi".
        budget = {"thinking_token_budget": 7, **on}
        assert both(c, max_tokens=13, extra_body=budget) == (" hi", " hi", "length")
    finally:
        srv.stop()
