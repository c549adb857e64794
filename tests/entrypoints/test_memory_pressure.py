"""Memory pressure at the server: a KV pool far too small for the concurrent load. Preemption
keeps every request progressing, and greedy outputs equal those of the same requests sent one
at a time (no pressure), by the tie-aware rule."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.entrypoints.test_metrics_disconnect import metrics, wait_all_blocks_free
from tests.entrypoints.utils import RemoteServer, metric_value
from tests.utils import TEXT_PROMPTS, assert_greedy_match

pytestmark = pytest.mark.slow

NUM_BLOCKS = 20  # 320 token slots; 8 requests of ~70 tokens need ~40 blocks at once
PRESSURE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
                 "--kv-cache-memory-bytes", str((NUM_BLOCKS + 1) * 8192)]  # tiny Llama: 8 KiB a block
BODY = {"max_tokens": 60, "temperature": 0, "ignore_eos": True, "logprobs": 2}


@pytest.fixture(scope="module")
def pressure_server(tiny_llama_dir):
    srv = RemoteServer(PRESSURE_ARGS, model=tiny_llama_dir, startup_timeout_s=600)
    yield srv
    srv.stop()


def tokens_and_gaps(choice: dict) -> tuple[list[str], list[float]]:
    lp = choice["logprobs"]
    gaps = []
    for top in lp["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return lp["tokens"], gaps


def test_preemption_keeps_greedy_outputs(pressure_server):
    url = pressure_server.url + "/v1/completions"
    alone = []
    for prompt in TEXT_PROMPTS:
        r = httpx.post(url, json={**BODY, "prompt": prompt}, timeout=120)
        assert r.status_code == 200, r.text
        alone.append(tokens_and_gaps(r.json()["choices"][0]))
    before = metric_value(metrics(pressure_server), "pagedllm:num_preemptions_total")

    async def together() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(url, json={**BODY, "prompt": p}) for p in TEXT_PROMPTS))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0] for r in rs]

    for i, choice in enumerate(asyncio.run(together())):
        assert choice["finish_reason"] == "length"
        tokens, _ = tokens_and_gaps(choice)
        ref_tokens, ref_gaps = alone[i]
        assert len(tokens) == len(ref_tokens) == BODY["max_tokens"]
        assert_greedy_match(tokens, ref_tokens, ref_gaps, TEXT_PROMPTS[i])
    text = wait_all_blocks_free(pressure_server)
    assert metric_value(text, "pagedllm:num_preemptions_total") > before, "the small pool was meant to preempt"
