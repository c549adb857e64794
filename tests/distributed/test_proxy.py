"""`pagedllm proxy`'s failure paths against scripted instances (httpx.MockTransport): a decode
instance that errs, times out or breaks before its first byte is replaced by the next one
(recomputing, the prefill hold released); a stream broken after its first byte ends with an
error event and [DONE]; bad bodies are 400s; /health is 503 while a role has no live instance.
Every error is in OpenAI's shape. Real processes and `kill -9`: test_disagg_failover.py."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedllm.distributed.kv_transfer.proxy import DisaggProxy, build_app

PARAMS = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
          "remote_transfer_id": "t-1", "remote_num_blocks": 2}
EVENT = b'data: {"choices": [{"text": "hi"}]}\n\n'
DONE = b"data: [DONE]\n\n"
Handler = Callable[[httpx.Request], httpx.Response]


def ok_stream() -> httpx.Response:
    async def body():
        yield EVENT[:10]  # events split across chunks are relayed whole
        yield EVENT[10:] + EVENT
        yield DONE
    return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})


def ok_json(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": "from " + request.url.host}]})


def prefill_ok(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})


class Instances:
    """Routes each request to the handler of its host; records the bodies decode hosts got."""

    def __init__(self, **handlers: Handler) -> None:
        self.handlers = handlers
        self.bodies: dict[str, list[dict]] = {host: [] for host in handlers}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path != "/health":
            self.bodies[host].append(json.loads(request.content))
        return self.handlers[host](request)


@pytest.fixture
def make_client():
    clients = []

    def make(instances: Instances, decode=("d1", "d2")) -> tuple[TestClient, list[dict]]:
        released: list[dict] = []
        proxy = DisaggProxy(["http://p"], [f"http://{d}" for d in decode],
                            transport=httpx.MockTransport(instances), release=released.append)
        client = TestClient(build_app(proxy))
        client.__enter__()
        clients.append(client)
        return client, released

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def assert_openai_error(body: dict, status: int, text: str) -> None:
    assert set(body) == {"error"} and body["error"]["code"] == status, body
    assert text in body["error"]["message"] and body["error"]["type"], body


def events(response) -> list[bytes]:
    return [e + b"\n\n" for e in response.read().split(b"\n\n") if e]


def raise_(exc: Exception) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc
    return handler


@pytest.mark.parametrize("failure", ["500", "timeout", "died"])
def test_failed_decode_is_retried_elsewhere_recomputing(make_client, failure):
    fail = {"500": lambda r: httpx.Response(500, json={"error": {"message": "boom"}}),
            "timeout": raise_(httpx.ReadTimeout("slow")),
            "died": raise_(httpx.RemoteProtocolError("Server disconnected without sending a response."))}[failure]
    instances = Instances(p=prefill_ok, d1=fail, d2=ok_json)
    client, released = make_client(instances)
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "from d2"
    assert instances.bodies["d1"][0]["kv_transfer_params"] == PARAMS
    assert "kv_transfer_params" not in instances.bodies["d2"][0]  # recomputed there
    assert released == [PARAMS]


@pytest.mark.parametrize("failure, status, text", [
    (raise_(httpx.ConnectError("refused")), 503, "unreachable"),
    (raise_(httpx.ReadTimeout("slow")), 504, "timed out"),
    (lambda r: httpx.Response(500, text="Internal Server Error"), 502, "answered 500"),
    (lambda r: httpx.Response(503, json={"error": {"message": "overloaded"}}), 503, "answered 503: overloaded"),
])
def test_no_decode_left_gives_an_openai_error(make_client, failure, status, text):
    client, released = make_client(Instances(p=prefill_ok, d1=failure, d2=failure))
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        assert r.status_code == status
        assert_openai_error(r.json(), status, text)
    assert released == [PARAMS, PARAMS]  # once per request


@pytest.mark.parametrize("prefill", ["down", "no_params"])
def test_client_sent_kv_transfer_params_never_reach_an_instance(make_client, prefill):
    """A client's kv_transfer_params could aim a decode instance at any host: when the
    prefill gives none (it is down, or held nothing), the decode instance gets none."""
    handler = {"down": raise_(httpx.ConnectError("refused")),
               "no_params": lambda r: httpx.Response(200, json={"choices": [{"text": "x"}]})}[prefill]
    instances = Instances(p=handler, d1=ok_json, d2=ok_json)
    client, _ = make_client(instances)
    evil = {**PARAMS, "remote_host": "169.254.169.254", "remote_port": 80}
    r = client.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": evil})
    assert r.status_code == 200
    (body,) = instances.bodies["d1"]
    assert "kv_transfer_params" not in body


def test_decode_4xx_is_passed_on_as_it_is(make_client):
    bad = {"error": {"message": "max_tokens too large", "type": "BadRequestError", "param": None, "code": 400}}
    client, released = make_client(Instances(p=prefill_ok, d1=lambda r: httpx.Response(400, json=bad), d2=ok_json))
    r = client.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.json() == bad and released == []


def test_stream_relays_whole_events(make_client):
    client, _ = make_client(Instances(p=prefill_ok, d1=lambda r: ok_stream(), d2=lambda r: ok_stream()))
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200 and events(r) == [EVENT, EVENT, DONE]


def test_stream_broken_after_first_event_ends_with_error_and_done(make_client):
    def broken(request: httpx.Request) -> httpx.Response:
        async def body():
            yield EVENT + b'data: {"choi'  # a partial event, then the instance dies
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    def truncated(request: httpx.Request) -> httpx.Response:  # a clean close without [DONE]
        return httpx.Response(200, content=EVENT, headers={"content-type": "text/event-stream"})

    client, released = make_client(Instances(p=prefill_ok, d1=broken, d2=truncated))
    for text in ("failed mid-request", "ended the stream early"):
        with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            got = events(r)
        assert r.status_code == 200 and got[0] == EVENT and got[-1] == DONE and len(got) == 3, got
        assert_openai_error(json.loads(got[1][6:]), 502, text)
    assert released == []  # bytes were relayed: no retry


def test_stream_failing_before_its_first_event_is_retried(make_client):
    def dies_at_once(request: httpx.Request) -> httpx.Response:
        async def body():
            raise httpx.RemoteProtocolError("peer closed connection")
            yield b""
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})

    instances = Instances(p=prefill_ok, d1=dies_at_once, d2=lambda r: ok_stream())
    client, released = make_client(instances)
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200 and events(r) == [EVENT, EVENT, DONE]
    assert released == [PARAMS] and "kv_transfer_params" not in instances.bodies["d2"][0]


@pytest.mark.parametrize("raw, text", [(b"not json", "malformed JSON"), (b"[1, 2]", "JSON object"),
                                       (b'"hi"', "JSON object"), (b"\xff\xfe", "malformed JSON")])
def test_bad_bodies_are_400(make_client, raw, text):
    client, _ = make_client(Instances(p=prefill_ok, d1=ok_json, d2=ok_json))
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert_openai_error(r.json(), 400, text)


def test_health_needs_a_live_instance_of_each_role(make_client):
    up = lambda r: httpx.Response(200)  # noqa: E731
    down = raise_(httpx.ConnectError("refused"))
    cases = [({"p": up, "d1": down, "d2": up}, 200), ({"p": up, "d1": down, "d2": down}, 503),
             ({"p": down, "d1": up, "d2": up}, 503),
             ({"p": up, "d1": lambda r: httpx.Response(503), "d2": down}, 503)]
    for handlers, status in cases:
        client, _ = make_client(Instances(**handlers))
        r = client.get("/health")
        assert r.status_code == status, (handlers, r.json())
        assert set(r.json()) == {"prefill", "decode"}
