"""The proxy with one prefill and two decode instances (real processes on loopback, a tiny
random-weight Llama): a decode instance that answers a 500 or is killed with `kill -9`
mid-load costs the client nothing before the first relayed byte (the request is recomputed
on the other instance and the prefill hold released); a stream cut after it ends with an
error event and [DONE]; /health follows the instances; every error is in OpenAI's shape."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.distributed.test_disagg_e2e import ProxyProcess, wait_blocks_free
from tests.entrypoints.utils import RemoteServer, free_port, metric_value

pytestmark = pytest.mark.slow

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--max-num-seqs", "8"]
MARKER = "poison-decode"  # decode instance A fails the requests whose id has it (a 500)
NUM_REQUESTS, MAX_TOKENS = 16, 120
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # three full blocks to pull


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    producer = {"kv_role": "kv_producer", "kv_port": free_port(), "kv_hold_timeout_s": 60}
    consumer = {"kv_role": "kv_consumer", "kv_transfer_timeout_s": 3}
    specs = [(producer, None), (consumer, {"PAGEDLLM_INJECT_FAULT": f"core_step:{MARKER}"}), (consumer, None)]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(RemoteServer, ARGS + ["--kv-transfer-config", json.dumps(cfg)], model=tiny_llama_dir,
                               env=env, startup_timeout_s=900) for cfg, env in specs]
        servers = [f.result() for f in futures]
    prefill, decode_a, decode_b = servers
    proxy = ProxyProcess([prefill.url], [decode_a.url, decode_b.url])
    yield prefill, decode_a, decode_b, proxy
    proxy.stop()
    for srv in servers:
        srv.stop()


def body(i: int, stream: bool, **extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": stream, "cache_salt": f"salt-{i}-{stream}", **extra}


def send(url: str, b: dict) -> tuple[int, object]:
    """(status, JSON body) or, for a stream, (status, list of its data payloads)."""
    if not b["stream"]:
        r = httpx.post(url + "/v1/completions", json=b, timeout=300)
        return r.status_code, r.json()  # a plain-text error fails here
    with httpx.stream("POST", url + "/v1/completions", json=b, timeout=300) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return r.status_code, data


def is_openai_error(obj: object) -> bool:
    return isinstance(obj, dict) and set(obj) == {"error"} and {"message", "type", "code"} <= set(obj["error"])


def test_decode_answering_500_is_retried_on_the_other(cluster):
    prefill, _, _, proxy = cluster
    for i in range(4):  # round-robin: about half start on instance A, which fails them
        status, out = send(proxy.url, body(i, False, request_id=f"{MARKER}-{i}"))
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
    assert "answered 500" in proxy.log_path.read_text()
    wait_blocks_free(prefill, timeout_s=20)  # released, long before the 60 s hold timeout


def test_bad_bodies_are_openai_400s(cluster):
    proxy = cluster[3]
    for raw in (b"not json", b"[1, 2]"):
        r = httpx.post(proxy.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and is_openai_error(r.json()), r.text


def wait_running(server: RemoteServer, at_least: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        if (metric_value(text, "pagedllm:num_requests_running") or 0) >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"{server.url} never ran {at_least} requests")


def test_decode_killed_mid_load(cluster):
    """Runs last in this module: it kills both decode instances."""
    prefill, decode_a, decode_b, proxy = cluster
    retries_before = proxy.log_path.read_text().count("retrying on the next decode instance")
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(send, proxy.url, body(i, stream=(i // 2) % 2 == 1)) for i in range(NUM_REQUESTS)]
        wait_running(decode_a, 3)
        decode_a.proc.kill()  # kill -9: its engine core dies with it
        decode_a.proc.wait(30)
        results = [(f.result(), i) for i, f in enumerate(futures)]

    num_cut = 0
    for (status, out), i in results:
        assert status == 200, (i, out)
        if isinstance(out, dict):  # not streamed: retried whole
            assert out["usage"]["completion_tokens"] == MAX_TOKENS, (i, out)
            continue
        assert out[-1] == "[DONE]", (i, out[-3:])
        chunks = [json.loads(x) for x in out[:-1]]
        errors = [c for c in chunks if "error" in c]
        if errors:  # cut after bytes were relayed: one error event, last before [DONE]
            assert len(errors) == 1 and chunks[-1] is errors[0] and is_openai_error(errors[0]), (i, chunks[-2:])
            num_cut += 1
        else:
            assert sum(len(c["choices"]) for c in chunks if c.get("choices")) >= MAX_TOKENS, i
    num_retried = proxy.log_path.read_text().count("retrying on the next decode instance") - retries_before
    print(f"after kill -9: {NUM_REQUESTS} requests, {num_cut} streams cut with an error event, "
          f"{num_retried} retried on the other instance")
    assert num_cut + num_retried >= 1

    wait_blocks_free(prefill, timeout_s=20)
    wait_blocks_free(decode_b, timeout_s=20)
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200  # B is alive
    decode_b.proc.kill()
    decode_b.proc.wait(30)
    r = httpx.get(proxy.url + "/health", timeout=10)
    assert r.status_code == 503 and not any(r.json()["decode"].values()), r.text
    for stream in (False, True):
        r = httpx.post(proxy.url + "/v1/completions", json=body(99, stream), timeout=60)
        assert r.status_code == 503 and is_openai_error(r.json()), r.text
