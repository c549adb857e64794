"""`pagedllm serve --kv-cache-backend vattention`: serves completions, refuses n > 1 with a
400 in OpenAI's shape, and exports the KV memory gauges. Its API key comes from the
environment (PAGEDLLM_API_KEY; the --api-key flag is test_auth.py's)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.entrypoints.test_metrics_disconnect import wait_all_blocks_free
from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer, metric_value

MODEL = "SmolLM2-135M-Instruct"
ENV_KEY = "key-from-the-environment"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vattn_server():
    srv = RemoteServer(SMALL_SERVER_ARGS + ["--kv-cache-backend", "vattention"], env={"PAGEDLLM_API_KEY": ENV_KEY})
    yield srv
    srv.stop()


def test_vattention_server(vattn_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=vattn_server.base_url, api_key="EMPTY", max_retries=0).models.list()
    client = openai.OpenAI(base_url=vattn_server.base_url, api_key=ENV_KEY, max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="vattention KV backend.*n > 1"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2)
    text = wait_all_blocks_free(vattn_server)
    labels = {"model_name": MODEL}
    # Deferred reclamation: the finished request's pages stay resident, holding no token.
    assert metric_value(text, "pagedllm:kv_cache_resident_bytes", labels) > 0
    assert metric_value(text, "pagedllm:kv_cache_token_bytes", labels) == 0
    assert metric_value(text, "pagedllm:kv_cache_fragmentation_ratio", labels) == 1.0
    assert httpx.get(vattn_server.url + "/health").status_code == 200
