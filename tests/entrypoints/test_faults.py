"""Engine faults: an exception inside one request's processing fails that request with an error
and the server goes on; an engine-core crash makes the server answer 503 and exit non-zero.

Faults are injected with PAGEDLLM_INJECT_FAULT (pagedllm/engine/faults.py) for requests whose
id carries a marker; everything else is the real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.entrypoints.test_metrics_disconnect import wait_all_blocks_free
from tests.entrypoints.utils import RemoteServer, engine_core_pid

pytestmark = pytest.mark.slow

TINY_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--max-num-seqs", "8"]
FAULTS = "detokenize:poison-detok,core_step:poison-core"


@pytest.fixture(scope="module")
def faulty_server(tiny_llama_dir):
    srv = RemoteServer(TINY_ARGS, model=tiny_llama_dir, env={"PAGEDLLM_INJECT_FAULT": FAULTS}, startup_timeout_s=600)
    yield srv
    srv.stop()


def body(request_id: str | None = None, stream: bool = False, max_tokens: int = 48) -> dict:
    b = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": max_tokens,
         "temperature": 0, "ignore_eos": True, "stream": stream}
    return {**b, "request_id": request_id} if request_id else b


async def post(client: httpx.AsyncClient, url: str, b: dict) -> tuple[int, object]:
    if not b["stream"]:
        r = await client.post(url, json=b)
        return r.status_code, r.json()
    async with client.stream("POST", url, json=b) as r:
        lines = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return r.status_code, [json.loads(x) for x in lines[:-1]]


def test_detokenizer_fault_fails_only_its_request(faulty_server):
    url = faulty_server.url + "/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                post(client, url, body("poison-detok-1")),
                post(client, url, body("poison-detok-2", stream=True)),
                *(post(client, url, body(stream=i % 2 == 1)) for i in range(4)),
            )

    (s1, r1), (s2, r2), *healthy = asyncio.run(run())
    assert s1 == 500 and "InjectedFault" in r1["error"]["message"], r1
    assert s2 == 200 and r2[-1]["error"]["code"] == 500 and "InjectedFault" in r2[-1]["error"]["message"], r2
    for status, result in healthy:
        assert status == 200
        if isinstance(result, dict):
            assert result["usage"]["completion_tokens"] == 48
        else:
            assert result[-1]["choices"][0]["finish_reason"] == "length"
    wait_all_blocks_free(faulty_server)


def test_core_step_fault_fails_the_batch_and_the_core_goes_on(faulty_server):
    url = faulty_server.url + "/v1/completions"
    before = httpx.post(url, json=body(), timeout=120).json()["choices"][0]["text"]
    r = httpx.post(url, json=body("poison-core-1"), timeout=120)
    assert r.status_code == 500 and "InjectedFault" in r.json()["error"]["message"], r.text
    wait_all_blocks_free(faulty_server)
    # Same prompt again: the prefix cache dropped by the failed step serves no stale KV.
    after = httpx.post(url, json=body(), timeout=120)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before


def test_engine_core_crash_gives_503_and_exit(faulty_server):
    """Last in this module: it kills the module's server."""
    core_pid = engine_core_pid(faulty_server.proc.pid)
    url = faulty_server.url + "/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            # Kill once a 200-token stream has produced its first token: both requests (sent
            # together, the same length) are then surely still running, on a fast machine too.
            first_token = asyncio.Event()

            async def stream_until_killed() -> tuple[int, object]:
                async with client.stream("POST", url, json=body(stream=True, max_tokens=200)) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            first_token.set()
                assert lines[-1] == "[DONE]"
                return r.status_code, [json.loads(x) for x in lines[:-1]]

            in_flight = [
                asyncio.create_task(post(client, url, body(max_tokens=200))),
                asyncio.create_task(stream_until_killed()),
            ]
            await asyncio.wait_for(first_token.wait(), 60)
            os.kill(core_pid, signal.SIGKILL)
            results = await asyncio.gather(*in_flight)
            try:  # until the server has closed its socket, new requests get a 503 too
                r = await client.post(url, json=body())
                assert r.status_code == 503 and r.headers["retry-after"], r.text
            except httpx.TransportError:
                pass
            return results

    (s1, r1), (s2, r2) = asyncio.run(run())
    assert s1 == 503 and "dead" in r1["error"]["message"], r1
    assert s2 == 200 and r2[-1]["error"]["code"] == 503, r2
    t0 = time.monotonic()
    code = faulty_server.proc.wait(60)
    assert code == 1, faulty_server.log()
    assert time.monotonic() - t0 < 30
