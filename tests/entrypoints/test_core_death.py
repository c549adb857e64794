"""A dead engine core never freezes the front end: with 16 streams open, `kill -9` of the core
ends every stream with an error event and `[DONE]` within 5 s, requests sent after the kill get
a 503 (a send to the dead core must not block the event loop), and the server exits with 1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer, engine_core_pid

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "32MiB", "--max-num-seqs", "16"]
NUM_STREAMS = 16
DEADLINE_S = 5.0


def test_kill_core_with_16_streams(tiny_llama_dir):
    srv = RemoteServer(ARGS, model=tiny_llama_dir)
    url = srv.url + "/v1/completions"
    body = {"prompt": "The quick brown fox", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        core_pid = engine_core_pid(srv.proc.pid)

        async def run() -> tuple[list, list, float]:
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            ended: list[float] = []
            killed_at: list[float] = []

            async def stream(client: httpx.AsyncClient, i: int) -> list[str]:
                lines = []
                async with client.stream("POST", url, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            started[i].set()
                ended.append(time.monotonic())
                return lines

            async def new_request(client: httpx.AsyncClient, delay_s: float) -> int | str:
                """One request sent `delay_s` after the kill, while the front end may not know
                yet (a blocking send to the dead core would freeze the event loop here)."""
                await asyncio.sleep(delay_s)
                try:
                    r = await client.post(url, json={**body, "stream": False, "max_tokens": 4})
                    return r.status_code
                except httpx.TransportError as e:  # the server has closed its socket
                    return type(e).__name__

            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=limits) as client:
                tasks = [asyncio.create_task(stream(client, i)) for i in range(NUM_STREAMS)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                os.kill(core_pid, signal.SIGKILL)
                killed_at.append(time.monotonic())
                statuses = await asyncio.gather(*(new_request(client, 0.1 * k) for k in range(10)))
                results = await asyncio.gather(*tasks)
            return results, list(statuses), max(ended) - killed_at[0]

        results, statuses, seconds = asyncio.run(asyncio.wait_for(run(), 60))
        print(f"streams ended {seconds:.2f} s after the kill; new requests: {statuses}")
        for lines in results:
            assert lines[-1] == "[DONE]", lines[-3:]
            error = json.loads(lines[-2])["error"]
            assert error["code"] == 503 and "dead" in error["message"], error
        assert seconds < DEADLINE_S
        assert statuses[0] == 503, statuses
        assert all(s == 503 or isinstance(s, str) for s in statuses), statuses
        t0 = time.monotonic()
        code = srv.proc.wait(30)
        print(f"server exited with {code}, {time.monotonic() - t0:.2f} s after the streams ended")
        assert code == 1, srv.log()
    finally:
        srv.stop()
