"""Caps on what one request may ask for (issue 48 item 4): every list field over its cap is a
400 naming the field and the limit; stop strings, bad words and structured-output specs have
a size cap; a prompt longer than max_model_len tokens could spell is refused before the
tokenizer runs; /tokenize and /detokenize are bounded; bad_words are tokenized off the event
loop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pagedllm.entrypoints.openai.limits import (
    LIST_FIELD_CAPS,
    MAX_STOP_STRING_CHARS,
    MAX_STRUCTURED_SPEC_CHARS,
)
from tests.entrypoints.conftest import MODEL

MAX_MODEL_LEN = 2048  # SMALL_SERVER_ARGS


def _post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def _over(field: str) -> object:
    n = LIST_FIELD_CAPS[field] + 1
    return {
        "prompt": ["hi"] * n,
        "stop": ["x"] * n,
        "stop_token_ids": [1] * n,
        "bad_words": ["x"] * n,
        "allowed_token_ids": [1] * n,
        "logit_bias": {str(i): 1.0 for i in range(n)},
        "guided_choice": ["a"] * n,
    }[field]


@pytest.mark.parametrize("field", ["prompt", "stop", "stop_token_ids", "bad_words", "allowed_token_ids",
                                   "logit_bias", "guided_choice"])
def test_completions_list_field_over_cap_is_400(server, field):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, field: _over(field)}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field
    assert f"at most {LIST_FIELD_CAPS[field]}" in err["message"]
    # At the cap, the field is accepted (token ids 1 are in the vocabulary).
    if field in ("stop_token_ids", "stop", "bad_words"):
        body[field] = body[field][:LIST_FIELD_CAPS[field]]
        assert _post(server, "/v1/completions", body).status_code == 200


def test_chat_messages_and_tools_over_cap_are_400(server):
    n = LIST_FIELD_CAPS["messages"] + 1
    r = _post(server, "/v1/chat/completions",
              {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = _post(server, "/v1/chat/completions",
              {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
               "tools": [tool] * (LIST_FIELD_CAPS["tools"] + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    r = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}] * n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_long_stop_string_and_large_spec_are_400(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1,
                                          "stop": ["ab" * MAX_STOP_STRING_CHARS]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    regex = "(a|b)" * (MAX_STRUCTURED_SPEC_CHARS // 5 + 1)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "guided_regex": regex})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_regex"
    assert str(MAX_STRUCTURED_SPEC_CHARS) in r.json()["error"]["message"]
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20000)}}
    r = _post(server, "/v1/chat/completions",
              {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


# 8 million characters: tokenizing them takes seconds on the test machine; the length check
# answers at once, since no 2048 tokens can spell them.
HUGE = "lorem ipsum " * 700_000


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 1}),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi", HUGE], "max_tokens": 1}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": HUGE}]}),
    ("/tokenize", {"prompt": HUGE}),
    ("/tokenize", {"prompt": HUGE, "add_special_tokens": False}),
], ids=["completion", "completion-list", "chat", "tokenize", "tokenize-no-special"])
def test_prompt_longer_than_the_model_could_spell_is_refused_before_tokenizing(server, path, body):
    t0 = time.monotonic()
    r = _post(server, path, body)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == ("messages" if "messages" in body else "prompt")
    assert "characters" in err["message"] and f"max_model_len={MAX_MODEL_LEN}" in err["message"], err
    assert took < 3.0, f"{took:.1f} s: the tokenizer ran on the whole text"


def test_detokenize_is_bounded(server):
    r = _post(server, "/detokenize", {"tokens": [1] * (MAX_MODEL_LEN + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
    r = _post(server, "/detokenize", {"tokens": [1] * MAX_MODEL_LEN})
    assert r.status_code == 200


def test_bad_words_are_tokenized_off_the_event_loop(server):
    """/health answers while four requests' 256 long bad words are tokenized. Measured on the
    2-core test machine: /health waited at most 1.5-1.9 s with the words tokenized on the event
    loop, 0.3-0.4 s off it."""
    words = [f"w{i} " + "lorem ipsum dolor " * 56 for i in range(LIST_FIELD_CAPS["bad_words"])]
    assert all(len(w) <= MAX_STOP_STRING_CHARS for w in words)
    statuses: list[int] = []

    def send() -> None:
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "bad_words": words})
        statuses.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.005)
    assert statuses == [200] * 4
    assert worst < 1.0, f"/health waited {worst:.2f} s: the event loop was held"
