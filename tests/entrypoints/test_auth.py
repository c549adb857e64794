"""--api-key guards the API (not /health, /version; /metrics unless --metrics-public); an empty
key is refused at start-up; --served-model-name. (The
server is the shared keyed one of conftest.py; PAGEDLLM_API_KEY, the key from the environment,
is tested by test_vattention_server.py; SIGTERM by test_shutdown.py.)"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY as KEY
from tests.entrypoints.conftest import SERVED_NAME as NAME
from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow


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
    ("GET", "/metrics", None),  # its prefix-cache counters tell about other clients' prompts
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
    for path in ("/health", "/version", "/dashboard"):
        assert httpx.get(keyed_server.url + path).status_code == 200, path


def test_empty_api_key_refused_at_start_up():
    """`--api-key ""` would admit every client: one clear line and exit status 2, before the
    model loads."""
    r = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--api-key", ""],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-key" in lines[0] and "empty" in lines[0], lines


def test_metrics_public_opens_metrics_only_and_admin_key_guards_admin_paths():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--api-key", KEY, "--metrics-public", "--admin-api-key", "adm1n"])
    try:
        assert httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        reset = srv.url + "/reset_prefix_cache"
        assert httpx.post(reset, headers={"Authorization": f"Bearer {KEY}"}).status_code == 401  # an API key is not enough
        assert httpx.post(reset, headers={"Authorization": "Bearer adm1n"}).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer adm1n"}).status_code == 401
    finally:
        srv.stop()


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
