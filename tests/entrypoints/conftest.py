"""One server subprocess per configuration, shared by the tests that need it."""

from __future__ import annotations

import pytest

from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer

MODEL = "SmolLM2-135M-Instruct"
# vLLM's dev mode serves /reset_prefix_cache, which the shared servers' tests call.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer(SMALL_SERVER_ARGS, env=DEV_MODE)
    yield srv
    srv.stop()


# One server behind an API key (--api-key) under another model name, logging its requests,
# shared by the auth tests (test_auth.py), the dashboard's (test_dashboard.py), the request
# log's (test_vllm_launch.py) and the SIGTERM test (test_shutdown.py, which stops it: last in
# file order).
API_KEY = "s3cret-key"
SERVED_NAME = "my-model"
KEYED_SERVER_ARGS = [*SMALL_SERVER_ARGS, "--served-model-name", SERVED_NAME, "--api-key", API_KEY,
                     "--enable-log-requests"]


@pytest.fixture(scope="session")
def _keyed_server_slot():
    slot: dict = {}
    yield slot
    if "server" in slot:
        slot["server"].stop()


@pytest.fixture
def keyed_server(_keyed_server_slot):
    """The shared keyed server; started again if a test stopped it (tests run in another
    order than the files', say). A start that failed is not tried again (as a session
    fixture's error, it fails every later test at once)."""
    slot = _keyed_server_slot
    if "error" in slot:
        raise RuntimeError(f"the keyed server failed to start earlier: {slot['error']}")
    srv = slot.get("server")
    if srv is None or srv.proc.poll() is not None:
        if srv is not None:
            srv.stop()
            del slot["server"]
        try:
            slot["server"] = RemoteServer(KEYED_SERVER_ARGS, env=DEV_MODE)
        except Exception as e:
            slot["error"] = str(e).splitlines()[0]
            raise
    return slot["server"]


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer(default_tokenizer):
    """The default model's tokenizer alone (no weights): the reference for usage counts."""
    return default_tokenizer
