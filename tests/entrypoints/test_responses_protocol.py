"""Responses request -> chat request (model-free): input items as chat messages, flat tools,
text.format, reasoning.effort to the chat template, previous turns first."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest, to_chat_request
from pagedllm.entrypoints.openai.serving_base import OpenAIError


def chat(body: dict, history: list | None = None):
    return to_chat_request(ResponsesRequest(**body), history or [])


def messages(body: dict, history: list | None = None) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in chat(body, history).messages]


def test_items_become_chat_messages():
    got = messages({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]})
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning": "Ask.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]


def test_history_comes_before_the_new_input_and_instructions_first():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    got = messages({"input": "Again", "instructions": "Be brief."}, history)
    assert [m["content"] for m in got] == ["Be brief.", "Hi", "Hello", "Again"]


def test_tools_format_effort_and_sampling():
    req = chat({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"effort": "low"},
                "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
                "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9})
    assert req.tools[0].function.name == "f" and req.tool_choice.function.name == "f"
    assert req.chat_template_kwargs == {"reasoning_effort": "low"}
    assert req.response_format == {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    assert (req.max_completion_tokens, req.temperature, req.top_p) == (7, 0.5, 0.9)


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": "x", "background": True}, "background"),
])
def test_refused_with_the_field_named(body, param):
    with pytest.raises(OpenAIError) as e:
        chat(body)
    assert e.value.status == 400 and e.value.param == param
