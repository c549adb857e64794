"""Disaggregated prefill/decode end to end: three real processes on loopback (a prefill
server, a decode server, `pagedllm proxy`), driven by the official `openai` client.

Every request carries its own cache_salt, so no request finds another's blocks in a prefix
cache and the number of blocks pulled is known exactly. The reference is the single-instance
path: the same prompt sent straight to the decode server (no transfer), compared by the
tie-aware greedy rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.utils import REPO_ROOT, SMALL_SERVER_ARGS, RemoteServer, free_port, metric_value
from tests.utils import TEXT_PROMPTS, assert_greedy_match

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the server default
MAX_TOKENS = 10
PREAMBLE = "You are a careful assistant who answers briefly and precisely. "
PROMPTS = [f"{PREAMBLE * (3 + i % 5)}Item {i}. {TEXT_PROMPTS[i % len(TEXT_PROMPTS)]}" for i in range(16)]


class ProxyProcess:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedllm-proxy-{self.port}.log"
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "proxy", "--port", str(self.port),
               "--prefill", *prefill_urls, "--decode", *decode_urls]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"proxy did not start:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def disagg():
    kv_port = free_port()
    producer = ["--kv-transfer-config", json.dumps({"kv_role": "kv_producer", "kv_port": kv_port,
                                                     "kv_hold_timeout_s": 60})]
    consumer = ["--kv-transfer-config", json.dumps({"kv_role": "kv_consumer", "kv_transfer_timeout_s": 3})]
    with ThreadPoolExecutor(2) as pool:  # both load the model at once
        # A generous start-up limit: on a shared machine the kernel build lock can be busy.
        futures = [pool.submit(RemoteServer, SMALL_SERVER_ARGS + extra, startup_timeout_s=900)
                   for extra in (producer, consumer)]
        prefill, decode = [f.result() for f in futures]
    proxy = ProxyProcess([prefill.url], [decode.url])
    yield prefill, decode, proxy
    proxy.stop()
    for srv in (prefill, decode):
        srv.stop()


def client_for(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)


def metrics(server: RemoteServer) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


def wait_blocks_free(server: RemoteServer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics(server)
        free = metric_value(text, "pagedllm:kv_cache_free_blocks")
        total = metric_value(text, "pagedllm:kv_cache_total_blocks")
        if free == total and total:
            return
        assert time.monotonic() < deadline, f"{server.url}: {total - free} KV blocks still in use"
        time.sleep(0.25)


def completion(url: str, prompt: str, salt: str, stream: bool = False) -> tuple[list[str], list[float], int]:
    """(tokens, top-2 logprob gaps, prompt tokens) of a greedy completion."""
    client = client_for(url)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2,
                  extra_body={"cache_salt": salt})
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    if stream:
        num_prompt = -1
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens
                    tops += choice.logprobs.top_logprobs
    else:
        out = client.completions.create(**kwargs)
        tokens, tops = out.choices[0].logprobs.tokens, out.choices[0].logprobs.top_logprobs
        num_prompt = out.usage.prompt_tokens
    gaps = [abs(a - b) for a, b in (sorted(t.values(), reverse=True)[:2] for t in tops)]
    return tokens, gaps, num_prompt


def check_greedy(tokens: list[str], ref_tokens: list[str], ref_gaps: list[float], label: str) -> None:
    """The tie-aware rule; without a divergence, both stopped at the same step (EOS or length)."""
    assert 0 < len(tokens) <= MAX_TOKENS, label
    assert_greedy_match(tokens, ref_tokens, ref_gaps, label)
    if all(a == b for a, b in zip(tokens, ref_tokens)):
        assert len(tokens) == len(ref_tokens), f"{label}: {tokens} vs {ref_tokens}"


@pytest.fixture(scope="module")
def reference(disagg):
    """Single-instance outputs: straight to the decode server, no transfer."""
    _, decode, _ = disagg
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda ip: completion(decode.url, ip[1], f"ref-{ip[0]}"), enumerate(PROMPTS)))


def blocks_received(server: RemoteServer) -> float:
    return metric_value(metrics(server), "pagedllm:kv_transfer_blocks_received") or 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_split_matches_single_instance(disagg, reference, stream):
    prefill, decode, proxy = disagg
    before = blocks_received(decode)
    salt = f"split-{stream}"
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda ip: completion(proxy.url, ip[1], f"{salt}-{ip[0]}", stream), enumerate(PROMPTS)))
    for i, ((tokens, _, _), (ref_tokens, ref_gaps, _)) in enumerate(zip(results, reference)):
        check_greedy(tokens, ref_tokens, ref_gaps, f"prompt {i} stream={stream}")
    wait_blocks_free(prefill)
    wait_blocks_free(decode)
    # Every full prompt block but the one holding the last prompt token came over the wire.
    num_prompt = [n for _, _, n in reference]
    assert blocks_received(decode) - before == sum((n - 1) // BLOCK_SIZE for n in num_prompt)
    assert all(n > 2 * BLOCK_SIZE for n in num_prompt)


def test_same_prefix_again_hits_locally_and_releases_the_producer(disagg, reference):
    prefill, decode, proxy = disagg
    completion(proxy.url, PROMPTS[3], "again-3")  # pulled
    before = blocks_received(decode)
    t0 = time.monotonic()
    tokens, _, _ = completion(proxy.url, PROMPTS[3], "again-3")  # cached on both: nothing pulled
    assert blocks_received(decode) == before
    check_greedy(tokens, reference[3][0], reference[3][1], "again")
    # The decode instance told the producer it will not pull: freed long before the 60 s hold.
    wait_blocks_free(prefill, timeout_s=15)
    assert time.monotonic() - t0 < 30


def test_chat_through_proxy(disagg):
    _, decode, proxy = disagg
    messages = [{"role": "user", "content": PREAMBLE * 3 + "Name three primary colors."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0.0)
    ref = client_for(decode.url).chat.completions.create(extra_body={"cache_salt": "chat-ref"}, **kwargs)
    out = client_for(proxy.url).chat.completions.create(extra_body={"cache_salt": "chat-split"}, **kwargs)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client_for(proxy.url).chat.completions.create(
            stream=True, extra_body={"cache_salt": "chat-stream"}, **kwargs)
        if c.choices
    )
    assert out.choices[0].message.content == ref.choices[0].message.content == streamed
    wait_blocks_free(decode)


def test_bad_kv_transfer_params_are_a_400(disagg):
    import openai

    _, decode, _ = disagg
    with pytest.raises(openai.BadRequestError, match="remote_host"):
        client_for(decode.url).completions.create(
            model=MODEL, prompt="hi", max_tokens=2,
            extra_body={"kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}})


def test_killed_prefill_instance_requests_recompute(disagg, reference):
    """Runs last in this module: it kills the prefill server."""
    prefill, decode, proxy = disagg
    # Blocks the prefill instance holds for a pull that will find it gone.
    held = httpx.post(prefill.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPTS[5], "max_tokens": 1, "temperature": 0.0,
        "cache_salt": "dead-5", "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = held["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_num_blocks"] > 0
    failed_before = metric_value(metrics(decode), "pagedllm:kv_transfer_failed_loads")

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(completion, proxy.url, p, f"fault-{i}", i % 2 == 1) for i, p in enumerate(PROMPTS)]
        time.sleep(1.0)
        prefill.proc.kill()  # mid-run: its engine core dies with it
        prefill.proc.wait(30)
        results = [f.result() for f in futures]
    for i, ((tokens, _, _), (ref_tokens, ref_gaps, _)) in enumerate(zip(results, reference)):
        check_greedy(tokens, ref_tokens, ref_gaps, f"fault prompt {i}")

    # A pull from the dead instance fails; the decode instance recomputes the prompt.
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "logprobs": 2, "cache_salt": "dead-5", "kv_transfer_params": params}
    out = httpx.post(decode.url + "/v1/completions", json=body, timeout=120)
    assert out.status_code == 200, out.text
    check_greedy(out.json()["choices"][0]["logprobs"]["tokens"], *reference[5][:2], "dead pull")
    assert metric_value(metrics(decode), "pagedllm:kv_transfer_failed_loads") >= failed_before + 1

    # Later requests through the proxy are served by the decode instance alone.
    tokens, _, _ = completion(proxy.url, PROMPTS[0], "after-0")
    check_greedy(tokens, reference[0][0], reference[0][1], "after the kill")
    wait_blocks_free(decode)
