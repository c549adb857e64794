"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis over hypothesis): bodies that fit
the schema and bodies that break it, then raw bytes (invalid UTF-8, broken JSON), unicode and
huge values. Never a 5xx, every error in OpenAI's shape, and the server still serves a normal
request after each batch.

PAGEDLLM_FUZZ_EXAMPLES sets the cases per operation and mode (default 12, about a minute in
CI); raise it for a longer run.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.entrypoints.utils import RemoteServer

pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation import GenerationMode  # noqa: E402

NUM_EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "12"))
# A short context bounds the work of any one case: at most 63 tokens per sequence, and the
# waiting queue bounds the sequences (prompts x n) of one request.
FUZZ_ARGS = ["--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory-bytes", "16MiB",
             "--max-num-seqs", "8", "--max-waiting-requests", "8"]
POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
STREAMING_PATHS = POST_PATHS[:2]
COUNTS = {"cases": 0, "streams": 0}  # cases sent; 200 event streams whose body was checked


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir):
    srv = RemoteServer(FUZZ_ARGS, model=tiny_llama_dir, startup_timeout_s=600)
    yield srv
    srv.stop()
    print(f"\nfuzz: {COUNTS['cases']} cases sent, {COUNTS['streams']} stream bodies checked")


def check_error_shape(err: object, status: int, text: str) -> None:
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, text
    assert err["code"] == status and err["message"], text


RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def check_stream_body(text: str, label: str, complete: bool = True) -> None:
    """A 200 event stream in its API's dialect, complete unless `complete` is False (a stream the
    client stopped reading). Chat and completions: JSON events, then `[DONE]` last; an error event
    fails the case unless it says the request was invalid (a 4xx found after the stream began).
    Responses: typed events ending in response.completed / incomplete, or response.failed for an
    invalid request only. Anthropic Messages: events ending in message_stop, or an error event of
    an invalid request."""
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events, f"{label}: an empty event stream: {text[-2000:]}"
    first = json.loads(events[0])
    kind = first.get("type", "") if isinstance(first, dict) else ""
    if kind.startswith("response."):
        objs = [json.loads(e) for e in events]
        assert all(isinstance(o, dict) and o.get("type", "").startswith("response.") for o in objs), label
        if complete:
            assert objs[-1]["type"] in RESPONSE_ENDS, f"{label}: the stream does not end: {text[-2000:]}"
        for o in objs:
            if o["type"] == "response.failed":
                assert o["response"]["error"]["code"] != "server_error", f"{label}: {json.dumps(o)[:2000]}"
        return
    if kind in ("message_start", "error") and "choices" not in first:
        objs = [json.loads(e) for e in events]
        if complete:
            assert objs[-1]["type"] in ("message_stop", "error"), f"{label}: the stream does not end: {text[-2000:]}"
        for o in objs:
            if o["type"] == "error":
                assert o["error"]["type"] in ("invalid_request_error", "not_found_error", "request_too_large"), \
                    f"{label}: error event in a 200 stream: {json.dumps(o)[:2000]}"
        return
    if complete:
        assert events[-1] == "[DONE]", f"{label}: the stream does not end with [DONE]: {text[-2000:]}"
    for event in events:
        if event == "[DONE]":
            continue
        obj = json.loads(event)
        if "error" in obj:
            err = obj["error"]
            check_error_shape(err, err.get("code") if isinstance(err, dict) else None, event)
            assert 400 <= err["code"] < 500, f"{label}: error event in a 200 stream: {event[:2000]}"
        else:
            assert obj.get("object") in ("text_completion", "chat.completion.chunk"), f"{label}: {event[:2000]}"


def _content_type(r: httpx.Response | object) -> str:
    value = r.headers.get("content-type", "")  # schemathesis' responses hold a list per header
    return (value[0] if value else "") if isinstance(value, list) else value


def check_response(r: httpx.Response | object, label: str, complete: bool = True) -> None:
    status = r.status_code
    assert status < 500, f"{label}: {status} {r.text[:2000]}"
    if status >= 400:
        body = r.json()
        if body.get("type") == "error":  # /v1/messages answers in Anthropic's shape
            assert {"type", "message"} <= set(body["error"]), f"{label}: {r.text[:2000]}"
            return
        check_error_shape(body["error"], status, r.text)
    elif _content_type(r).startswith("text/event-stream"):
        COUNTS["streams"] += 1
        check_stream_body(r.text, label, complete)


def _sse(*events: object) -> httpx.Response:
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream; charset=utf-8"})


CHUNK = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}


@pytest.mark.parametrize("events", [
    [CHUNK, {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}, "[DONE]"],
    [CHUNK, {"error": {"message": "busy", "type": "ServiceUnavailableError", "param": None, "code": 503}}, "[DONE]"],
    [CHUNK],  # cut short: no [DONE]
    [CHUNK, {"error": "not OpenAI's shape"}, "[DONE]"],
    ["not json", "[DONE]"],
    ['{"type": "response.created", "response": {}}', '{"type": "response.output_text.delta", "delta": "a"}'],
    ['{"type": "response.created", "response": {}}',
     '{"type": "response.failed", "response": {"error": {"code": "server_error", "message": "boom"}}}'],
    ['{"type": "message_start", "message": {}}', '{"type": "content_block_delta"}'],
    ['{"type": "message_start", "message": {}}', '{"type": "error", "error": {"type": "api_error", "message": "x"}}'],
], ids=["500-event", "503-event", "no-done", "bad-error-shape", "not-json", "responses-no-end", "responses-failed",
        "messages-no-stop", "messages-api-error"])
def test_stream_bodies_are_checked(events):
    """The check reads a 200 stream's body: a server error inside it fails the case."""
    with pytest.raises((AssertionError, ValueError)):
        check_response(_sse(*events), "case")


def test_valid_streams_pass_the_check():
    check_response(_sse(CHUNK, CHUNK, "[DONE]"), "case")
    invalid = {"error": {"message": "bad stop", "type": "BadRequestError", "param": "stop", "code": 400}}
    check_response(_sse(CHUNK, invalid, "[DONE]"), "case")  # an invalid request found mid-stream
    check_response(_sse('{"type": "response.created", "response": {}}', '{"type": "response.completed", "response": {}}'),
                   "case")
    check_response(_sse('{"type": "message_start", "message": {}}', '{"type": "message_stop"}'), "case")
    # A stream the client stopped reading is checked without its end.
    check_response(_sse(CHUNK, CHUNK), "case", complete=False)
    check_response(_sse('{"type": "response.created", "response": {}}'), "case", complete=False)


def assert_still_serving(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzz_from_openapi_schema(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(POST_PATHS)
    if mode == GenerationMode.NEGATIVE:  # the others take no input that could break the schema
        operations = [op for op in operations if op.path in POST_PATHS]
    for op in operations:

        @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            COUNTS["cases"] += 1
            response = case.call(base_url=fuzz_server.url, timeout=120)
            label = f"{op.method.upper()} {op.path} body={str(case.body)[:500]}"
            # schemathesis stops reading an event stream after 20 events: what it read is checked,
            # then the same request is sent again and its whole stream checked.
            cut_short = bool(getattr(response, "stream_cut_short", False))
            check_response(response, label, complete=not cut_short)
            if cut_short:
                COUNTS["cases"] += 1
                again = httpx.post(fuzz_server.url + op.path, content=json.dumps(case.body),
                                   headers={"content-type": "application/json"}, timeout=120)
                check_response(again, f"{label} (read to the end)")
            if response.status_code == 200 and op.path in STREAMING_PATHS and not case.body.get("stream"):
                # The same valid request streamed: its events are checked too.
                COUNTS["cases"] += 1
                streamed = httpx.post(fuzz_server.url + op.path, content=json.dumps({**case.body, "stream": True}),
                                      headers={"content-type": "application/json"}, timeout=120)
                check_response(streamed, f"{label} (streamed)")

        run()
        assert_still_serving(fuzz_server)


def json_mutants() -> st.SearchStrategy[bytes]:
    """Bodies that are not JSON, not UTF-8, or JSON of the wrong shape."""
    valid = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    return st.one_of(
        st.binary(max_size=256),
        st.builds(lambda cut: valid[:cut], st.integers(0, len(valid) - 1)),
        st.builds(lambda i, b: valid[:i] + bytes([b]) + valid[i + 1:], st.integers(0, len(valid) - 1), st.integers(0x80, 0xFF)),
        st.text(max_size=64).map(lambda t: json.dumps(t).encode()),
        st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8).map(lambda v: json.dumps(v).encode()),
    )


def test_fuzz_raw_bodies(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=120) as client:

        @settings(max_examples=NUM_EXAMPLES * 8, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(POST_PATHS), content=json_mutants(),
               content_type=st.sampled_from(["application/json", "text/plain", "application/json; charset=latin-1"]))
        def run(path, content, content_type):
            COUNTS["cases"] += 1
            r = client.post(path, content=content, headers={"content-type": content_type})
            check_response(r, f"POST {path} {content[:200]!r}")

        run()
    assert_still_serving(fuzz_server)


HUGE_AND_ODD = [
    {"prompt": "a" * 300_000, "max_tokens": 2},
    {"prompt": ["x"] * 5000, "max_tokens": 1},
    {"prompt": [[1, 2]] * 100, "max_tokens": 1},
    {"prompt": "Hi", "max_tokens": 10**30},
    {"prompt": "Hi", "max_tokens": 2, "n": 10**9},
    {"prompt": "Hi", "max_tokens": 2, "temperature": 1e308},
    {"prompt": "Hi", "max_tokens": 2, "top_k": -(10**20)},
    {"prompt": "Hi", "max_tokens": 2, "seed": 2**70},
    {"prompt": "Hi", "max_tokens": 2, "logprobs": 10**6},
    {"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 10**6},
    {"prompt": "Hi", "max_tokens": 2, "stop": ["x"] * 10000},
    {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"1": 1e308}},
    {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [-1, 2**40]},
    {"prompt": "Hi", "max_tokens": 2, "allowed_token_ids": []},
    {"prompt": "Hi", "max_tokens": 2, "bad_words": ["", "\udcff"]},
    {"prompt": "\u0000\ud7ff\ue000\U0010ffff \u202e ﷽ 🦙" * 3, "max_tokens": 2},
    {"prompt": "", "max_tokens": 2},
    {"prompt": [""], "max_tokens": 2},
    {"prompt": "Hi", "max_tokens": 0},
    {"prompt": "Hi", "max_tokens": 2, "request_id": ""},
]


# Fields the server does not know are ignored (with a warning), as vLLM: a 200, never a 400.
UNKNOWN_FIELDS = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "frobnicate": {"nested": [1, None]}, "": 1}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True, "stream_options": {"x" * 1000: 1}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              "\u202e\U0010ffff": [], "max_tokens_typo": 10**30}),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens_": False}),
    ("/detokenize", {"tokens": [1, 2], "skip_special_tokens": True}),
]


@pytest.mark.parametrize("path,body", UNKNOWN_FIELDS, ids=[str(i) for i in range(len(UNKNOWN_FIELDS))])
def test_unknown_fields_are_ignored(fuzz_server, path, body):
    COUNTS["cases"] += 1
    r = httpx.post(fuzz_server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 200, r.text[:2000]
    check_response(r, f"{path} {str(body)[:300]}")


@pytest.mark.parametrize("body", HUGE_AND_ODD, ids=[str(i) for i in range(len(HUGE_AND_ODD))])
def test_huge_and_odd_values(fuzz_server, body):
    for stream in (False, True):
        COUNTS["cases"] += 1
        # json.dumps escapes lone surrogates (valid JSON, invalid unicode), which httpx would refuse.
        r = httpx.post(fuzz_server.url + "/v1/completions", content=json.dumps({**body, "stream": stream}),
                       headers={"content-type": "application/json"}, timeout=120)
        check_response(r, str(body)[:300])
        if r.status_code == 200 and stream:
            assert '"error"' not in r.text, r.text[:2000]
    assert_still_serving(fuzz_server)


# Streams longer than the 20 events schemathesis reads, in each API's dialect, read to the end.
LONG_STREAMS = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 40, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}], "stream": True}),
    ("/v1/responses", {"input": "", "background": False, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 30, "stream": True}),
]


@pytest.mark.parametrize("path,body", LONG_STREAMS, ids=[p for p, _ in LONG_STREAMS])
def test_long_streams_end_in_their_dialect(fuzz_server, path, body):
    COUNTS["cases"] += 1
    if path == "/v1/messages":  # Anthropic's API names the model in every request
        body = {**body, "model": httpx.get(fuzz_server.url + "/v1/models").json()["data"][0]["id"]}
    r = httpx.post(fuzz_server.url + path, content=json.dumps(body), headers={"content-type": "application/json"},
                   timeout=120)
    assert r.status_code == 200, r.text[:2000]
    assert r.text.count("data: ") > 20, r.text[:2000]
    check_response(r, f"{path} {body}")
