"""Admission control: a bounded waiting queue (503 with Retry-After beyond it, 400 for a request
that could never fit) and a per-request time limit that aborts the request and frees its blocks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.entrypoints.test_metrics_disconnect import metrics, wait_all_blocks_free
from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer, metric_value

pytestmark = pytest.mark.slow

MAX_NUM_SEQS, MAX_WAITING, TIMEOUT_S = 2, 2, 8.0
LONG = {"prompt": "Write a very long story about a dragon.", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def limited_server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-waiting-requests", str(MAX_WAITING), "--request-timeout", str(TIMEOUT_S)])
    yield srv
    srv.stop()


def assert_unavailable(r: httpx.Response, contains: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 503
    assert contains in err["message"], err


def sse_events(lines: list[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


async def stream_lines(client: httpx.AsyncClient, url: str, body: dict) -> list[str]:
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [line async for line in r.aiter_lines()]


def in_flight(server) -> float:
    text = metrics(server)
    return metric_value(text, "pagedllm:num_requests_running") + metric_value(text, "pagedllm:num_requests_waiting")


def test_full_queue_gets_503_and_time_limit_aborts(limited_server):
    url = limited_server.url + "/v1/completions"

    async def run() -> tuple[list[list[str]], float]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream_lines(client, url, LONG)) for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
            t0 = time.monotonic()
            while in_flight(limited_server) < MAX_NUM_SEQS + MAX_WAITING:
                assert time.monotonic() - t0 < TIMEOUT_S / 2, "the long requests never all arrived"
                await asyncio.sleep(0.1)
            # The batch and the queue are full: one more sequence is turned away...
            r = await client.post(url, json={"prompt": "Hi", "max_tokens": 2})
            assert_unavailable(r, "overloaded")
            r = await client.post(limited_server.url + "/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert_unavailable(r, "overloaded")
            # ...and a request that could never fit is a 400 naming n.
            r = await client.post(url, json={"prompt": "Hi", "max_tokens": 2, "n": MAX_NUM_SEQS + MAX_WAITING + 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            return await asyncio.gather(*tasks), time.monotonic() - t0

    results, elapsed = asyncio.run(run())
    # 1500 tokens take far longer than the limit: every stream ends with a 503 error event.
    assert elapsed < TIMEOUT_S + 10
    for lines in results:
        events = sse_events(lines)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == 503 and "time limit" in err["message"], events[-2]
    wait_all_blocks_free(limited_server)

    # Not streaming: a 503 with Retry-After once the limit passes.
    t0 = time.monotonic()
    r = httpx.post(url, json=LONG, timeout=120)
    assert_unavailable(r, "time limit")
    assert TIMEOUT_S - 1 < time.monotonic() - t0 < TIMEOUT_S + 10
    wait_all_blocks_free(limited_server)
    # The server still serves, with room again.
    r = httpx.post(url, json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
