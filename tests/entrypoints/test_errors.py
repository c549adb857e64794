"""Every bad request gets an OpenAI-shaped error with the right status, and the server still
answers a normal request afterwards."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import MODEL

pytestmark = pytest.mark.slow

OK_BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = [{"role": "user", "content": "Hi"}]


def assert_error(r: httpx.Response, status: int, param: str | None = "unset", contains: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and err["message"] and err["type"]
    if param != "unset":
        assert err["param"] == param, err
    assert contains in err["message"], err


def assert_still_serving(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json=OK_BODY, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


COMPLETION_CASES = [
    ("unknown model", {**OK_BODY, "model": "no-such-model"}, 404, "model", "does not exist"),
    ("negative max_tokens", {**OK_BODY, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("temperature out of range", {**OK_BODY, "temperature": 3.5}, 400, "temperature", "temperature"),
    ("top_p out of range", {**OK_BODY, "top_p": 0}, 400, "top_p", "top_p"),
    ("beyond max_model_len", {**OK_BODY, "max_tokens": 4000}, 400, "max_tokens", "maximum context length"),
    ("wrong type", {**OK_BODY, "max_tokens": "many"}, 400, "max_tokens", ""),
    ("prompt of wrong type", {**OK_BODY, "prompt": {"a": 1}}, 400, "prompt", ""),
    ("missing prompt", {"model": MODEL}, 400, "prompt", ""),
    ("empty prompt list", {**OK_BODY, "prompt": []}, 400, "prompt", ""),
    ("token id out of vocab", {**OK_BODY, "prompt": [1, 10**9]}, 400, "prompt", "vocabulary"),
    ("best_of", {**OK_BODY, "best_of": 3}, 400, "best_of", "not supported"),
    ("suffix", {**OK_BODY, "suffix": "x"}, 400, "suffix", "not supported"),
    ("beam search with logprobs", {**OK_BODY, "use_beam_search": True, "logprobs": 2}, 400, "logprobs",
     "not supported with use_beam_search"),
    ("beam width too large", {**OK_BODY, "use_beam_search": True, "n": 1000}, 400, "n", "beam width"),
    ("bad logit_bias key", {**OK_BODY, "logit_bias": {"abc": 1.0}}, 400, "logit_bias", ""),
    ("min_tokens above max_tokens", {**OK_BODY, "min_tokens": 5}, 400, "min_tokens", "min_tokens"),
    ("empty stop string", {**OK_BODY, "stop": [""]}, 400, "stop", "stop"),
]


@pytest.mark.parametrize("label,body,status,param,contains", COMPLETION_CASES, ids=[c[0] for c in COMPLETION_CASES])
def test_completion_errors(server, label, body, status, param, contains):
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert_error(r, status, param, contains)
    assert_still_serving(server)


CHAT_CASES = [
    ("unknown model", {"model": "nope", "messages": CHAT}, 404, "model"),
    ("negative max_completion_tokens", {"messages": CHAT, "max_completion_tokens": -3}, 400, "max_tokens"),
    ("temperature out of range", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("tools without --enable-auto-tool-choice", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("tool_choice without tools", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("malformed tool", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("functions", {"messages": CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("response_format structural_tag without a format", {"messages": CHAT, "response_format": {"type": "structural_tag"}}, 400,
     "response_format"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("messages of wrong type", {"messages": "hi"}, 400, "messages"),
    ("image content part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    # Without --trust-request-chat-template (test_event_loop.py has a template that rejects).
    ("per-request chat template", {"messages": CHAT, "chat_template": "{{ 'x' }}"}, 400, "chat_template"),
    ("top_logprobs without logprobs", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("beyond max_model_len", {"messages": CHAT, "max_tokens": 5000}, 400, "max_tokens"),
]


@pytest.mark.parametrize("label,body,status,param", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
def test_chat_errors(server, label, body, status, param):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert_error(r, status, param)
    assert_still_serving(server)


def test_malformed_json(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, content=b'{"prompt": "x",', headers={"content-type": "application/json"})
        assert_error(r, 400, contains="malformed JSON")
    assert_still_serving(server)


def test_unknown_fields_are_ignored_with_a_warning(server):
    """As vLLM: a field the server does not know (a newer client's, a typo) is dropped and named
    in a warning, at any depth; the request is served as if it were not there."""
    plain = httpx.post(server.url + "/v1/completions", json=OK_BODY, timeout=60)
    body = {**OK_BODY, "frobnicate": 1, "stream_options": None}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True, "zebra": 2}})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text
    log = server.log_path.read_text()
    assert "CompletionRequest: ignoring unknown field(s) frobnicate" in log
    assert "StreamOptions: ignoring unknown field(s) zebra" in log


def test_unknown_route_is_404_in_openai_shape(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)


def test_openai_client_raises_typed_errors(client):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=9)
    assert "temperature" in str(e.value)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
