"""Metrics under vLLM's names; clients that drop their streams free their KV blocks."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.entrypoints.conftest import MODEL
from tests.entrypoints.utils import metric_value

pytestmark = pytest.mark.slow

NAMES = [
    "pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
    "pagedllm:kv_cache_free_blocks", "pagedllm:kv_cache_total_blocks",
    "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total", "pagedllm:num_preemptions_total",
    "pagedllm:request_success_total", "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
    "pagedllm:time_to_first_token_seconds_bucket", "pagedllm:inter_token_latency_seconds_bucket",
    "pagedllm:e2e_request_latency_seconds_bucket", "pagedllm:request_queue_time_seconds_bucket",
]


def metrics(server) -> str:
    # /metrics needs the key where the server has one (docs/security.md).
    key = getattr(server, "api_key", None)
    r = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200
    return r.text


def wait_all_blocks_free(server, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics(server)
        free = metric_value(text, "pagedllm:kv_cache_free_blocks")
        total = metric_value(text, "pagedllm:kv_cache_total_blocks")
        running = metric_value(text, "pagedllm:num_requests_running")
        waiting = metric_value(text, "pagedllm:num_requests_waiting")
        if total and free == total and running == 0 and waiting == 0:
            return text
        assert time.monotonic() < deadline, f"blocks not freed: free={free} total={total} running={running}"
        time.sleep(0.2)


def test_metric_names_present(server, client):
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    text = wait_all_blocks_free(server)
    for name in NAMES:
        assert metric_value(text, name, {"model_name": MODEL}) is not None, name
    assert metric_value(text, "pagedllm:generation_tokens_total") >= 3
    assert metric_value(text, "pagedllm:request_success_total", {"finished_reason": "length"}) >= 1
    assert metric_value(text, "pagedllm:prefix_cache_queries_total") > 0
    assert metric_value(text, "pagedllm:kv_cache_usage_perc") == 0.0


def test_dropped_streams_free_their_blocks(server, async_client):
    before = metric_value(metrics(server), "pagedllm:request_success_total", {"finished_reason": "abort"}) or 0.0

    async def one(i: int, drop: bool) -> str:
        stream = await async_client.completions.create(
            model=MODEL, prompt=f"Story number {i}: once upon a time", max_tokens=48, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text
            if drop and len(text) >= 3:
                await stream.close()  # the client goes away mid-generation
                return "dropped"
        return text

    async def run() -> list[str]:
        return await asyncio.gather(*(one(i, drop=i % 2 == 0) for i in range(8)))

    results = asyncio.run(run())
    assert results.count("dropped") == 4
    assert all(r and r != "dropped" for r in results[1::2])
    text = wait_all_blocks_free(server)
    aborted = metric_value(text, "pagedllm:request_success_total", {"finished_reason": "abort"})
    assert aborted - before == 4
    # And the server still serves.
    httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).raise_for_status()


def test_health_answers_while_engine_busy(server, async_client):
    async def busy():
        stream = await async_client.completions.create(
            model=MODEL, prompt="Count: one, two,", max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        async for _ in stream:
            pass

    async def probe() -> list[float]:
        tasks = [asyncio.create_task(busy()) for _ in range(4)]
        latencies = []
        async with httpx.AsyncClient() as h:
            while not all(t.done() for t in tasks):
                t0 = time.perf_counter()
                assert (await h.get(server.url + "/health")).status_code == 200
                latencies.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        return latencies

    latencies = asyncio.run(probe())
    assert latencies
    # The engine runs in its own process: /health never waits for a model step.
    assert sorted(latencies)[len(latencies) // 2] < 0.1, latencies


def test_reset_prefix_cache(server):
    wait_all_blocks_free(server)
    r = httpx.post(server.url + "/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"reset": True}


def test_non_streaming_client_that_leaves_is_aborted(server):
    before = metric_value(metrics(server), "pagedllm:request_success_total", {"finished_reason": "abort"}) or 0.0
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"prompt": "Write a long story.", "max_tokens": 1000, "ignore_eos": True})
    text = wait_all_blocks_free(server, timeout_s=20)  # 1000 tokens would take far longer
    after = metric_value(text, "pagedllm:request_success_total", {"finished_reason": "abort"})
    assert after - before == 1
