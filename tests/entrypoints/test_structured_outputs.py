"""Structured outputs through the server with the official openai client: response_format
json_schema / json_object, vLLM's structured_outputs and the older guided_* fields, streamed
and not; invalid specs are 400s naming the field; every KV block is free afterwards."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import MODEL
from tests.entrypoints.test_metrics_disconnect import wait_all_blocks_free
from tests.structured_output.schemas import SCHEMAS

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Describe a team as JSON."}]
SCHEMA = SCHEMAS[18][1]  # nested objects, $ref, enums, a bounded array


def _stream_chat_text(client, **kwargs) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_chat_response_format_json_schema(server, client):
    response_format = {"type": "json_schema", "json_schema": {"name": "team", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=300, temperature=1.0, seed=1, response_format=response_format,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text, finish = _stream_chat_text(client, max_tokens=300, temperature=1.0, seed=1, response_format=response_format)
    assert finish == "stop"
    assert text == choice.message.content  # same seed: the stream carries the same document
    wait_all_blocks_free(server)


def test_chat_response_format_json_object(server, client):
    messages = [{"role": "user", "content": 'Reply with this JSON object: {"status": "ok", "count": 3}'}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=100, temperature=0.0, response_format={"type": "json_object"},
    )
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict), text
    wait_all_blocks_free(server)


def test_extra_body_structured_outputs_streaming_and_not(server, client):
    regex = r"[A-Z][a-z]{2,9}, [A-Z]{2} \d{5}"
    cases = [
        ({"regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
        ({"json": SCHEMAS[4][1]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[4][1]) is None),
        ({"grammar": 'root ::= "x=" [0-9]{1,3} ";"'}, lambda t: re.fullmatch(r"x=[0-9]{1,3};", t)),
    ]
    for structured, ok in cases:
        body = {"structured_outputs": structured}
        out = client.completions.create(
            model=MODEL, prompt="An example:", max_tokens=120, temperature=1.0, seed=4, n=2, extra_body=body,
        )
        for c in out.choices:
            assert c.finish_reason == "stop" and ok(c.text), (structured, c.text)
        texts, finishes = {}, {}
        for chunk in client.completions.create(
            model=MODEL, prompt="An example:", max_tokens=120, temperature=1.0, seed=4, n=2, stream=True,
            extra_body=body,
        ):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                finishes[c.index] = c.finish_reason or finishes.get(c.index)
        assert texts == {c.index: c.text for c in out.choices}, structured
        assert set(finishes.values()) == {"stop"}
        text, finish = _stream_chat_text(client, max_tokens=120, temperature=1.0, extra_body=body)
        assert finish == "stop" and ok(text), (structured, text)
    wait_all_blocks_free(server)


def test_legacy_guided_fields_are_honoured(server, client):
    cases = [
        ({"guided_choice": ["north", "south"]}, lambda t: t in ("north", "south")),
        ({"guided_regex": r"\d{2}:\d{2}"}, lambda t: re.fullmatch(r"\d{2}:\d{2}", t)),
        ({"guided_json": json.dumps(SCHEMAS[2][1])}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[2][1]) is None),
        ({"guided_grammar": 'root ::= "ok" | "not ok"'}, lambda t: t in ("ok", "not ok")),
    ]
    for body, ok in cases:
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=1.0, extra_body=body)
        c = chat.choices[0]
        assert c.finish_reason == "stop" and ok(c.message.content), (body, c.message.content)
    wait_all_blocks_free(server)


BAD = [
    ("invalid schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format", "frobnicate"),
    ("schema missing", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ("unsupported response_format", {"response_format": {"type": "xml"}}, "response_format", "structural_tag"),
    ("structural_tag without a format", {"response_format": {"type": "structural_tag"}}, "response_format",
     "structural tag"),
    ("structural_tag not JSON", {"structured_outputs": {"structural_tag": "{oops"}}, "structured_outputs",
     "not valid JSON"),
    ("invalid regex", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
    ("invalid grammar", {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs", "nowhere"),
    ("unknown key", {"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
    ("two at once", {"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "only one"),
    ("guided_json not JSON", {"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ("with beam search", {"guided_regex": "a", "use_beam_search": True}, "use_beam_search", "beam search"),
]


@pytest.mark.parametrize("label,extra,param,contains", BAD, ids=[b[0] for b in BAD])
def test_invalid_structured_outputs_are_400(server, client, label, extra, param, contains):
    import openai

    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, stream=stream, extra_body=extra)
        assert e.value.status_code == 400
        error = e.value.body
        assert error["param"] == param and contains in error["message"], error
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # Nothing else is affected.
    ok = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0.0)
    assert ok.choices[0].message.content
    wait_all_blocks_free(server)


ANSWER_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                 "additionalProperties": False}
# xgrammar's structural tag: the output is <answer>, a JSON document, </answer>.
STRUCTURAL_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": ANSWER_SCHEMA},
    "end": "</answer>"}}


def test_structural_tag(server, client):
    """response_format structural_tag (xgrammar's format, as vLLM takes it), plain and
    streamed, and the same as structured_outputs.structural_tag (JSON text); the older
    structures/triggers form is accepted (free text until a trigger)."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Answer with a number."}], max_tokens=40,
                  temperature=0.0)
    text = client.chat.completions.create(response_format=STRUCTURAL_TAG, **kwargs).choices[0].message.content
    match = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)
    assert match, text
    jsonschema.validate(json.loads(match.group(1)), ANSWER_SCHEMA)
    streamed, finish = _stream_chat_text(client, response_format=STRUCTURAL_TAG, max_tokens=40, temperature=0.0)
    assert finish == "stop" and re.fullmatch(r"<answer>(.*)</answer>", streamed, re.S), streamed
    via_field = client.chat.completions.create(extra_body={"structured_outputs": {"structural_tag": json.dumps(
        STRUCTURAL_TAG)}}, **kwargs).choices[0].message.content
    assert via_field == text
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=add>", "schema": ANSWER_SCHEMA, "end": "</function>"}]}
    out = client.chat.completions.create(response_format=legacy, **kwargs).choices[0]
    assert out.message.content is not None
    wait_all_blocks_free(server)


@pytest.mark.parametrize("regex", ["\U00040000", "a\U00040000"], ids=["at-start", "after-a-token"])
def test_constraint_no_token_can_follow_is_400(server, client, regex):
    """A regex valid as text that this vocabulary cannot spell (found by the fuzz test): the
    request's own fault, a 400 (an error event then [DONE] in a stream), not a 500."""
    body = {"model": MODEL, "prompt": "0", "max_tokens": 6, "temperature": 0.0, "guided_regex": regex}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "admits no token" in r.json()["error"]["message"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    if r.status_code == 200:
        assert events[-1] == "[DONE]", events
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert len(errors) == 1 and errors[0]["code"] == 400 and "admits no token" in errors[0]["message"], events
    else:
        assert r.status_code == 400
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0.0)
    assert ok.choices[0].text
    wait_all_blocks_free(server)
