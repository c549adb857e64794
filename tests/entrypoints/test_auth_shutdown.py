"""--api-key guards the API (not /health, /version, /metrics); --served-model-name; SIGTERM
stops the server and its engine-core process cleanly."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer, child_pids, pid_alive

pytestmark = pytest.mark.slow

KEY = "s3cret-key"
NAME = "my-model"


@pytest.fixture(scope="module")
def keyed_server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--served-model-name", NAME], env={"PAGEDLLM_API_KEY": KEY})
    yield srv
    srv.stop()


PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/openapi.json", None),
    ("GET", "/docs", None),
    ("GET", "/dashboard/state", None),
]


@pytest.mark.parametrize("method,path,body", PROTECTED, ids=[p[1] for p in PROTECTED])
def test_api_key_required(keyed_server, method, path, body):
    url = keyed_server.url + path
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == 401
    r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text


def test_open_endpoints(keyed_server):
    for path in ("/health", "/version", "/metrics", "/dashboard"):
        assert httpx.get(keyed_server.url + path).status_code == 200, path


def test_served_model_name_with_openai_client(keyed_server):
    import openai

    client = openai.OpenAI(base_url=keyed_server.base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=2)
    assert out.model == NAME and out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.base_url, api_key="bad", max_retries=0).models.list()


def test_sigterm_shuts_down_cleanly(keyed_server):
    """Last in this module: it stops the module's server."""
    pid = keyed_server.proc.pid
    children = child_pids(pid)
    assert children, "the engine core should run in a child process"
    result: dict = {}

    def in_flight():
        try:
            r = httpx.post(keyed_server.url + "/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": NAME, "prompt": "Once upon a time", "max_tokens": 8,
                                 "ignore_eos": True})
            result["status"] = r.status_code
            result["body"] = r.json()
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.3)
    keyed_server.proc.send_signal(signal.SIGTERM)
    code = keyed_server.proc.wait(60)
    t.join(60)
    # A handled SIGTERM is a clean stop: exit 0 (not death by the re-raised signal).
    assert code == 0, keyed_server.log()
    assert "engine core process stopped (exit code 0)" in keyed_server.log()
    # The in-flight request either finished or failed with an error, never hung.
    assert result, "the in-flight request neither finished nor failed"
    if result.get("status") == 200:
        assert result["body"]["usage"]["completion_tokens"] == 8
    deadline = time.monotonic() + 10
    while any(pid_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(c) for c in children), "orphaned child processes"
