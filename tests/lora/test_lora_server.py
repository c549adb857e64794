"""LoRA adapters through a real server and the openai client: --lora-modules at start, `model`
selecting an adapter, /v1/models with the base as parent, hot load and unload
(VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.entrypoints.utils import RemoteServer
from tests.lora.utils import save_random_adapter, save_tiny_llama
from tests.utils import hf_greedy

PROMPT = "Once upon a time"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora-server")
    base = save_tiny_llama(root / "base")
    refs = {"a": save_random_adapter(base, root / "a", seed=1, r=8),
            "b": save_random_adapter(base, root / "b", seed=2, r=4, targets=("q_proj", "v_proj"))}
    server = RemoteServer(
        ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB",
         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--served-model-name", "tiny",
         "--lora-modules", f"a={root / 'a'}"],
        model=str(root / "base"), env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    yield {"root": root, "base": base, "refs": refs, "server": server,
           "client": openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)}
    server.stop()


def complete(client: openai.OpenAI, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    return out.choices[0].token_ids


def expected(setup: dict[str, Any], model: Any) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(setup["root"] / "base").encode(PROMPT)
    return hf_greedy(model, ids, MAX_TOKENS)[0]


def test_adapters_through_the_server(setup: dict[str, Any]) -> None:
    client, url, root = setup["client"], setup["server"].url, setup["root"]
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a"}
    assert models["a"].model_extra["parent"] == "tiny" and models["tiny"].model_extra["parent"] is None
    base_tokens = complete(client, "tiny")
    a_tokens = complete(client, "a")
    assert base_tokens == expected(setup, setup["base"])
    assert a_tokens == expected(setup, setup["refs"]["a"])
    assert a_tokens != base_tokens
    with pytest.raises(openai.NotFoundError):
        complete(client, "b")
    # Hot load b, use it, unload it; a bad path is a 400, a second unload a 404.
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(root / "b")})
    assert loaded.status_code == 200, loaded.text
    assert {m.id for m in client.models.list().data} == {"tiny", "a", "b"}
    assert complete(client, "b") == expected(setup, setup["refs"]["b"])
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.choices[0].message.content is not None
    assert chat.model == "b"  # the adapter's name is reported, as vLLM
    stream = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            stream=True)
    assert {chunk.model for chunk in stream} == {"b"}
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).model == "tiny"
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(root / "none")})
    assert bad.status_code == 400 and "adapter_config.json" in bad.text
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        complete(client, "b")
    assert complete(client, "a") == a_tokens


def test_bad_adapters_are_400s_and_never_listed(setup: dict[str, Any]) -> None:
    """Each refusal is a 400 naming why, the adapter unlisted and unusable; a good one loaded
    and unloaded frees its slot in the engine core."""
    from tests.lora.test_lora_hardening import variant

    client, url, root = setup["client"], setup["server"].url, setup["root"]
    other = save_tiny_llama(root / "wide", hidden_size=96)
    save_random_adapter(other, root / "wide-lora", seed=3, r=4)
    cases = {
        "nan": (variant(root, "nan", poison="nan"), "NaN or infinite"),
        "r0": (variant(root, "r0", {"r": 0}), "r=0"),
        "no-r": (variant(root, "no-r", {"r": None}), "r=None"),
        "r-list": (variant(root, "r-list", {"r": [8]}), "r=[8]"),
        "alpha-nan": (variant(root, "alpha-nan", {"lora_alpha": float("nan")}), "lora_alpha=nan"),
        "wide": (root / "wide-lora", "an adapter of another base"),  # found in the engine core
    }
    for name, (path, text) in cases.items():
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, (name, r.status_code, r.text)
        error = r.json()["error"]
        assert text in error["message"] and error["type"] == "BadRequestError", (name, error)
    assert {m.id for m in client.models.list().data} == {"tiny", "a"}
    with pytest.raises(openai.NotFoundError):
        complete(client, "wide")
    base_tokens = complete(client, "tiny")
    assert base_tokens == expected(setup, setup["base"])  # the engine serves on, unharmed
    # Unloading reaches the engine core: the adapter's slot is freed there.
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b2", "lora_path": str(root / "b")})
    assert loaded.status_code == 200, loaded.text
    assert complete(client, "b2") == expected(setup, setup["refs"]["b"])
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b2"}).status_code == 200
    deadline = time.monotonic() + 10
    while "unloaded (slot" not in setup["server"].log_path.read_text():
        assert time.monotonic() < deadline, "the unload did not reach the engine core"
        time.sleep(0.1)
