"""--api-key guards the API (not /health, /version, /metrics); --served-model-name. (The
server is the shared keyed one of conftest.py; PAGEDLLM_API_KEY, the key from the environment,
is tested by test_vattention_server.py; SIGTERM by test_shutdown.py.)"""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY as KEY
from tests.entrypoints.conftest import SERVED_NAME as NAME

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
