"""One server subprocess per configuration, shared by the tests that need it."""

from __future__ import annotations

import pytest

from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def server():
    srv = RemoteServer(SMALL_SERVER_ARGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture
def async_client(server):
    import openai

    return openai.AsyncOpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer alone (no weights): the reference for usage counts."""
    from pagedllm.models.gguf_loader import gguf_to_hf_dir
    from pagedllm.models.loader import _load_tokenizer, resolve_checkpoint

    gguf_path, model_dir = resolve_checkpoint(MODEL)
    return _load_tokenizer(gguf_to_hf_dir(gguf_path) if gguf_path else model_dir)
