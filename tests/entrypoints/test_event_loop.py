"""Work that would stall the event loop runs off it: a 200,000-character prompt arriving
mid-stream keeps the other streams' inter-token latency p99 under a bound; a per-request chat
template is refused unless the server allows it, and when allowed its rendering is stopped
after --request-chat-template-timeout."""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx
import pytest

from tests.entrypoints.utils import RemoteServer

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "32MiB", "--max-num-seqs", "8"]
HUGE = ("The quick brown fox jumps over the lazy dog. " * 4500)[:200_000]  # ~44,000 tokens: a 400
# Inter-token latency p99 of 4 streams while huge prompts arrive, as measured on the 2-core
# test machine under load: 0.02-0.05 s with tokenization off the loop, 0.3-0.5 s on it (each
# 200,000-character prompt held the loop ~0.35 s: every stream stalled that long).
ITL_P99_BOUND_S = 0.15
RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TEMPLATE_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    srv = RemoteServer(ARGS, model=tiny_llama_dir)
    yield srv
    srv.stop()


async def _stream_gaps(client: httpx.AsyncClient, url: str, first: asyncio.Event) -> list[float]:
    """Seconds between the stream's chunks, from its second chunk on."""
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                if len(times) == 20:
                    first.set()
    assert len(times) >= 300, len(times)
    return [b - a for a, b in zip(times[1:], times[2:])]


def test_huge_prompt_does_not_stall_other_streams(tiny_server):
    url = tiny_server.url

    async def run() -> tuple[list[float], list[int], float]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=32)) as client:
            running = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.create_task(_stream_gaps(client, url, e)) for e in running]
            await asyncio.gather(*(e.wait() for e in running))
            statuses = []
            t0 = time.monotonic()
            for i in range(6):  # completions and chat, one after another while the streams run
                if i % 2:
                    r = await client.post(url + "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": HUGE}], "max_tokens": 4})
                else:
                    r = await client.post(url + "/v1/completions", json={"prompt": HUGE, "max_tokens": 4})
                statuses.append(r.status_code)
            huge_seconds = time.monotonic() - t0
            gaps = [g for s in await asyncio.gather(*streams) for g in s]
        return gaps, statuses, huge_seconds

    gaps, statuses, huge_seconds = asyncio.run(run())
    p99 = statistics.quantiles(gaps, n=100)[98]
    print(f"6 huge prompts answered in {huge_seconds:.2f} s ({statuses}); {len(gaps)} gaps: "
          f"p50 {statistics.median(gaps):.4f} s, p99 {p99:.4f} s, max {max(gaps):.4f} s")
    assert statuses == [400] * 6  # longer than max_model_len, found only by tokenizing it
    assert p99 < ITL_P99_BOUND_S


def test_request_chat_template_refused_by_default(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "chat_template": "{{ 'x' }}"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"], error


def test_request_chat_template_bounded_when_trusted(tiny_llama_dir):
    srv = RemoteServer([*ARGS, "--trust-request-chat-template", "--request-chat-template-timeout",
                        str(TEMPLATE_TIMEOUT_S)], model=tiny_llama_dir)
    url = srv.url + "/v1/chat/completions"
    simple = "{% for m in messages %}{{ m['content'] }}{% endfor %} ANSWER:"

    def chat(template: str) -> httpx.Response:
        return httpx.post(url, timeout=120, json={
            "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2, "chat_template": template})

    try:
        ok = chat(simple)  # the first also spawns the render process
        assert ok.status_code == 200, ok.text
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello there ANSWER:", "add_special_tokens": False})
        assert ok.json()["usage"]["prompt_tokens"] == ids.json()["count"]
        t0 = time.monotonic()
        runaway = chat(RUNAWAY)
        seconds = time.monotonic() - t0
        print(f"the runaway template was stopped after {seconds:.2f} s: {runaway.text}")
        assert runaway.status_code == 400, runaway.text
        assert "did not render within" in runaway.json()["error"]["message"]
        assert TEMPLATE_TIMEOUT_S <= seconds < TEMPLATE_TIMEOUT_S + 10  # 10: spawning is not needed here
        again = chat(simple)  # a new render process
        assert again.status_code == 200, again.text
        # 2 GB: more than the render process's address-space limit lets it grow by (1 GiB)
        hog = chat("{{ 'a' * 2000000000 }}")
        assert hog.status_code == 400 and hog.json()["error"]["param"] == "chat_template", hog.text[:300]
        assert chat(simple).status_code == 200
        bad = chat("{{ raise_exception('no system prompt') }}")
        assert bad.status_code == 400 and "no system prompt" in bad.json()["error"]["message"], bad.text
    finally:
        srv.stop()
