"""Tool calling end to end: the real server on the default model, the official openai client
and LangChain used unchanged. Forced calls (required, named) are grammar-constrained, so
their arguments must validate; the parsers' own cases are in test_tool_parsers.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import MODEL
from tests.entrypoints.test_errors import assert_error
from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris? Also add 2 and 3."}]
ADD_ONLY = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def tool_server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    import openai

    return openai.OpenAI(base_url=tool_server.base_url, api_key="EMPTY", max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **kwargs}
    return client.chat.completions.create(model=MODEL, **kwargs)


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def collect_stream(chunks) -> dict[int, dict]:
    """Per choice: content, calls (id, name, arguments) and finish_reason, checking OpenAI's
    delta shape (id, type and name only in a call's first delta)."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            out = choices.setdefault(c.index, {"content": "", "calls": [], "finish_reason": None})
            out["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index == len(out["calls"]):
                    assert d.id and d.type == "function" and d.function.name, d
                    out["calls"].append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.id is None and d.type is None and d.function.name is None, d
                out["calls"][d.index]["arguments"] += d.function.arguments or ""
            if c.finish_reason is not None:
                out["finish_reason"] = c.finish_reason
    return choices


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_validate(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    out = chat(client, tool_choice="required", **extra)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert_valid_calls(choice.message.tool_calls)
    if parallel is False:
        assert len(choice.message.tool_calls) == 1


def test_named_call_streams_as_it_answers(client):
    plain = chat(client, tool_choice=ADD_ONLY).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.content is None
    (call,) = plain.message.tool_calls
    assert call.function.name == "add"
    assert_valid_calls([call])
    streamed = collect_stream(chat(client, tool_choice=ADD_ONLY, stream=True))[0]
    (scall,) = streamed["calls"]
    # Greedy both times: the same call, its fragments joining to the same bytes.
    assert (scall["name"], scall["arguments"]) == ("add", call.function.arguments)
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == ""


def test_required_streamed_with_n(client):
    # One call per choice (parallel_tool_calls false) keeps sampled choices short.
    choices = collect_stream(chat(client, tool_choice="required", stream=True, n=2, temperature=1.0, seed=7,
                                  parallel_tool_calls=False))
    assert sorted(choices) == [0, 1]
    for out in choices.values():
        assert out["finish_reason"] == "tool_calls", out
        (c,) = out["calls"]
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    assert choices[0]["calls"][0]["id"] != choices[1]["calls"][0]["id"]


# The model's text under "auto", fixed by a regex (the 135M model will not write calls on
# its own), so the hermes parser runs on the real server, plain and streamed.
AUTO_TEXT = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 22}}\n</tool_call>'
AUTO_REGEX = "".join("\\" + ch if ch in '.{}[]()' else ch for ch in AUTO_TEXT)


def test_auto_parses_the_models_calls(client):
    body = {"structured_outputs": {"regex": AUTO_REGEX}}
    plain = chat(client, extra_body=body).choices[0]
    assert plain.finish_reason == "tool_calls" and plain.message.content == "Sure.\n"
    (call,) = plain.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 22})
    streamed = collect_stream(chat(client, extra_body=body, stream=True))[0]
    assert streamed["content"] == "Sure.\n" and streamed["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [("add", call.function.arguments)]
    none = chat(client, extra_body=body, tool_choice="none").choices[0]
    assert (none.message.content, none.message.tool_calls, none.finish_reason) == (AUTO_TEXT, None, "stop")


# The same with qwen3_coder's XML calls: the parser is given the request's tools, whose
# schemas type the parameter values (integers here, not strings).
QWEN3_CODER_TEXT = ("Sure.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                    "<parameter=b>\n22\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.slow
def test_qwen3_coder_parser_on_the_server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"])
    try:
        import openai

        qwen_client = openai.OpenAI(base_url=srv.base_url, api_key="EMPTY", max_retries=0, timeout=120)
        body = {"structured_outputs": {"regex": QWEN3_CODER_TEXT.replace(".", "\\.")}}
        plain = chat(qwen_client, extra_body=body, max_tokens=60).choices[0]
        assert plain.finish_reason == "tool_calls" and plain.message.content == "Sure.\n"
        (call,) = plain.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("add", '{"a": 1, "b": 22}')
        streamed = collect_stream(chat(qwen_client, extra_body=body, max_tokens=60, stream=True))[0]
        assert streamed["content"] == "Sure.\n" and streamed["finish_reason"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [("add", call.function.arguments)]
    finally:
        srv.stop()


def test_tool_choice_none_renders_tools_and_answers_text(client):
    with_tools = chat(client, tool_choice="none", max_tokens=8)
    without = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=8)
    assert with_tools.choices[0].message.tool_calls is None
    assert isinstance(with_tools.choices[0].message.content, str)
    # The tools are in the prompt (the shipped tool template's system block).
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + 50


def test_two_turn_tool_loop(client):
    first = chat(client, tool_choice=ADD_ONLY).choices[0].message
    (call,) = first.tool_calls
    args = json.loads(call.function.arguments)
    messages = [
        *ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
    ]
    answer = chat(client, messages=messages, max_tokens=24).choices[0]  # tool_choice auto (hermes parser)
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


def test_errors(tool_server):
    url = tool_server.url + "/v1/chat/completions"
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", ""),
        ({"tool_choice": "sometimes"}, "tool_choice", ""),
        # A function without its name (an unknown field there is ignored, as everywhere).
        ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]},
         "tools", "tools.0.function.name"),
    ]
    for extra, param, contains in cases:
        body = {"model": MODEL, "messages": ASK, "tools": TOOLS, **extra}
        assert_error(httpx.post(url, json=body, timeout=60), 400, param, contains)


def test_langchain_bind_tools(tool_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    llm = ChatOpenAI(base_url=tool_server.base_url, api_key="EMPTY", model=MODEL, temperature=0, max_tokens=60)
    forced = llm.bind_tools([add], tool_choice="add")
    question = HumanMessage("What is 2 plus 3?")
    ai = forced.invoke([question])
    (call,) = ai.tool_calls
    assert call["name"] == "add"
    jsonschema.validate(call["args"], add.args_schema.model_json_schema())

    streamed = None
    for chunk in llm.bind_tools([add], tool_choice="any").stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls and streamed.tool_calls[0]["name"] == "add"
    jsonschema.validate(streamed.tool_calls[0]["args"], add.args_schema.model_json_schema())

    result = ToolMessage(content=str(add.invoke(call["args"])), tool_call_id=call["id"])
    answer = llm.bind_tools([add]).invoke([question, ai, result])
    assert answer.content or answer.tool_calls
