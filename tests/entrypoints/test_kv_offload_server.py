"""The disk KV offload tier across a server restart (docs/kv_offload.md): a server started
on the directory of a stopped one serves a repeated prompt's blocks from disk, with the same
outputs, greedy and seeded, and counts the hits in its metrics."""

from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest

from tests.entrypoints.utils import RemoteServer, metric_value

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-model-len", "448", "--kv-cache-memory-bytes", "256KiB",
        "--enable-prompt-tokens-details"]  # tiny Llama: 8 KiB a block of 16 tokens
PROMPT = np.random.default_rng(5).integers(100, 40000, size=300).tolist()  # 18 full blocks
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "seed": 1234}}


def _complete(server: RemoteServer, sampling: dict) -> tuple[str, int]:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True},
                                    **sampling)
    details = out.usage.prompt_tokens_details
    return out.choices[0].text, details.cached_tokens if details is not None else 0


def _disk_hits(server: RemoteServer, at_least: float) -> float | None:
    """pagedllm:kv_offload_hits_total{tier="disk"}, once the periodic stats carried it."""
    deadline = time.monotonic() + 30
    value = None
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        value = metric_value(text, "pagedllm:kv_offload_hits_total", {"tier": "disk"})
        if value is not None and value >= at_least:
            return value
        time.sleep(0.5)
    return value


def test_restart_serves_prompt_from_disk(tiny_llama_dir, tmp_path):
    tier = ["--kv-offload-dir", str(tmp_path / "kv")]
    first = RemoteServer([*ARGS, *tier], model=tiny_llama_dir, startup_timeout_s=600)
    try:
        before = {name: _complete(first, s) for name, s in SAMPLINGS.items()}
    finally:
        assert first.stop() == 0  # the shutdown writes the pool's cached blocks to the tier
    assert len(list((tmp_path / "kv").glob("*.kvb"))) >= 18
    second = RemoteServer([*ARGS, *tier], model=tiny_llama_dir, startup_timeout_s=600)
    try:
        after = {name: _complete(second, s) for name, s in SAMPLINGS.items()}
        assert _disk_hits(second, 18) == 18  # the second request hits the pool, not the disk
        tiers = httpx.get(second.url + "/dashboard/state", timeout=60).json()["prefix_cache"]["offload_tiers"]
        assert tiers["disk"]["hits"] == 18 and tiers["disk"]["hit_rate"] == 1.0
    finally:
        second.stop()
    assert before["greedy"][1] == 0 and before["seeded"][1] == 288  # the second hit the first's blocks
    assert after["greedy"] == (before["greedy"][0], 288)  # from disk: no block was computed here
    assert after["seeded"] == before["seeded"]


def test_save_and_restore_by_name(tiny_llama_dir, tmp_path):
    import shutil

    saver = RemoteServer([*ARGS, "--kv-offload-dir", str(tmp_path / "a")], model=tiny_llama_dir,
                         startup_timeout_s=600)
    try:
        saved = httpx.post(saver.url + "/v1/kv/save", json={"name": "system-1", "prompt": PROMPT}, timeout=120)
        assert saved.status_code == 200, saved.text
        assert saved.json() == {"name": "system-1", "num_tokens": 288, "num_prompt_tokens": 300}
        bad = httpx.post(saver.url + "/v1/kv/save", json={"name": "../x", "prompt": PROMPT}, timeout=120)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "name"
        expected = _complete(saver, SAMPLINGS["greedy"])[0]
    finally:
        saver.stop()
    # A new server on a directory holding only the saved prefix (no block files).
    shutil.copytree(tmp_path / "a" / "saved", tmp_path / "b" / "saved")
    restorer = RemoteServer([*ARGS, "--kv-offload-dir", str(tmp_path / "b")], model=tiny_llama_dir,
                            startup_timeout_s=600)
    try:
        missing = httpx.post(restorer.url + "/v1/kv/restore", json={"name": "other"}, timeout=60)
        assert missing.status_code == 400 and "no KV saved under the name 'other'" in missing.json()["error"]["message"]
        restored = httpx.post(restorer.url + "/v1/kv/restore", json={"name": "system-1"}, timeout=60)
        assert restored.json() == {"name": "system-1", "num_tokens": 288}
        assert _complete(restorer, SAMPLINGS["greedy"]) == (expected, 288)
    finally:
        restorer.stop()
