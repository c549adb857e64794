"""Data parallelism on Ray (engine/dp_client.py): two replicas of the default model on a local
two-node cluster (one core each, 127.0.0.1) behind one server. Greedy outputs equal one
replica's; a repeated prefix goes to the replica that holds it; kill -9 of a replica under
load hangs no request, the replica comes back, and the per-replica metrics add up to the totals."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.distributed.ray_cluster import LocalRayCluster
from tests.entrypoints.utils import SMALL_SERVER_ARGS, RemoteServer, metric_value, pid_alive
from tests.utils import assert_same_greedy

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# Two running sequences per replica: of 8 concurrent requests, some wait without output, so a
# replica's death both fails requests (they had tokens) and retries others elsewhere.
SERVER_ARGS = [*SMALL_SERVER_ARGS, "--max-num-seqs", "2"]
# One replica asked on the server's node (all nodes are 127.0.0.1 here: the bundle's shape only).
DP_ARGS = ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--data-parallel-size-local", "1"]
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a quiet village,",
    "The three primary colors are",
]
LONG_PREFIX = ("You are a careful assistant. Answer briefly and precisely, citing the rule you used. "
               "The rules are: one, be short; two, be right; three, be kind. ") * 2


@pytest.fixture(scope="module")
def cluster():
    c = LocalRayCluster(num_nodes=2, cpus_per_node=1)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def dp_server(cluster):
    srv = RemoteServer([*SERVER_ARGS, *DP_ARGS], env=cluster.env)
    try:
        yield srv
    finally:
        srv.stop()


def greedy(client: openai.OpenAI, prompt: str, max_tokens: int = 12) -> tuple[list[int], list[float]]:
    """Token ids and per-position top-2 logprob gaps of a greedy completion."""
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0]
    tops = [sorted(t.values(), reverse=True) for t in choice.logprobs.top_logprobs]
    return choice.token_ids, [t[0] - t[1] for t in tops]


def replica_series(srv: RemoteServer, name: str) -> dict[int, float]:
    text = httpx.get(srv.url + "/metrics").text
    values = {}
    for replica in (0, 1):
        value = metric_value(text, f"pagedllm:{name}", {"replica": str(replica)})
        values[replica] = 0.0 if value is None else value
    return values


def total(srv: RemoteServer, name: str, labels: dict[str, str] | None = None) -> float:
    return metric_value(httpx.get(srv.url + "/metrics").text, f"pagedllm:{name}", labels) or 0.0


def test_dp2_greedy_matches_dp1(dp_server):
    reference = RemoteServer(SERVER_ARGS)
    try:
        ref_client = openai.OpenAI(base_url=reference.base_url, api_key="x")
        expected = [greedy(ref_client, p) for p in PROMPTS]
    finally:
        reference.stop()
    client = openai.OpenAI(base_url=dp_server.base_url, api_key="x")
    routed_before = replica_series(dp_server, "dp_replica_requests_routed_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: both replicas serve
        got = list(pool.map(lambda p: greedy(client, p), PROMPTS))
    for i, ((ours, _), (ref, gaps)) in enumerate(zip(got, expected)):
        assert len(ours) == 12
        assert_same_greedy(ours, ref, gaps, f"dp=2 prompt {i}")
    routed = replica_series(dp_server, "dp_replica_requests_routed_total")
    delta = {r: routed[r] - routed_before[r] for r in routed}
    assert sum(delta.values()) == len(PROMPTS)
    assert min(delta.values()) >= 1, f"one replica served everything: {delta}"
    replicas = httpx.get(dp_server.url + "/dashboard/state").json()["replicas"]  # the dashboard lists both
    assert [(r["replica"], r["up"], r["routed"]) for r in replicas] == [(i, True, routed[i]) for i in (0, 1)]


def test_repeated_prefix_goes_to_the_same_replica(dp_server):
    client = openai.OpenAI(base_url=dp_server.base_url, api_key="x")

    def routed_to(prompt: str) -> int:
        before = replica_series(dp_server, "dp_replica_requests_routed_total")
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        after = replica_series(dp_server, "dp_replica_requests_routed_total")
        [replica] = [r for r in after if after[r] > before[r]]
        return replica

    hits_before = total(dp_server, "prefix_cache_hits_total")
    home = routed_to(LONG_PREFIX + "Question 0: what is 2 + 2?")
    # A prompt with nothing in common goes elsewhere (the replicas are idle and equally loaded:
    # the one sent fewer requests): without affinity, the next ones would alternate likewise.
    assert routed_to("Tell me about volcanoes and the way they form over millions of years.") != home
    for i in range(1, 4):
        assert routed_to(LONG_PREFIX + f"Question {i}: what is {i} + {i}?") == home
    assert total(dp_server, "prefix_cache_hits_total") - hits_before >= 3 * 64  # the prefix's blocks hit


def replica_pids(srv: RemoteServer) -> dict[int, list[int]]:
    """Each replica's engine-core pids (processes or Ray actors) in start order, from the log."""
    pids: dict[int, list[int]] = {}
    for replica, pid in re.findall(r"data-parallel replica (\d+) up: pid (\d+)", srv.log_path.read_text()):
        pids.setdefault(int(replica), []).append(int(pid))
    return pids


def stream_one(base_url: str, prompt: str, max_tokens: int = 48) -> str:
    """'ok', or 'error: ...' for a request the server failed (mid-stream or before)."""
    client = openai.OpenAI(base_url=base_url, api_key="x", timeout=120, max_retries=0)
    try:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        n = sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)
    except openai.APIError as e:
        return f"error: {e}"
    return "ok" if n > 0 else "error: empty"


def test_replica_killed_under_load(dp_server):
    routed_before = replica_series(dp_server, "dp_replica_requests_routed_total")
    success_before = total(dp_server, "request_success_total", {"finished_reason": "length"})
    victim_pid = replica_pids(dp_server)[1][-1]
    prompts = [f"Story number {i}: " + PROMPTS[i % len(PROMPTS)] for i in range(8)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_one, dp_server.base_url, p, 96) for p in prompts]
        # Kill while replica 1 holds more requests than it runs (--max-num-seqs 2): two with tokens
        # out (they fail), at least one still waiting without output (retried elsewhere). Its two
        # running requests take 96 steps (over a second on any machine): the others wait that long.
        deadline = time.monotonic() + 60
        while replica_series(dp_server, "dp_replica_num_requests_in_flight")[1] < 3:
            assert time.monotonic() < deadline, "replica 1 got fewer than 3 requests"
            time.sleep(0.05)
        time.sleep(0.5)  # the running two have tokens out
        os.kill(victim_pid, signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]  # none hangs
    assert time.monotonic() - t0 < 180
    failures = [r for r in results if r != "ok"]
    assert all("data-parallel replica 1 died" in r for r in failures), failures
    # The replica comes back (Ray restarts the actor; the front end starts a core in it).
    deadline = time.monotonic() + 120
    while replica_series(dp_server, "dp_replica_up")[1] != 1.0:
        assert time.monotonic() < deadline, f"replica 1 did not come back:\n{dp_server.log()}"
        time.sleep(0.5)
    assert not pid_alive(victim_pid)
    assert replica_series(dp_server, "dp_replica_restarts_total") == {0: 0.0, 1: 1.0}
    new_pid = replica_pids(dp_server)[1][-1]
    assert new_pid != victim_pid and pid_alive(new_pid)
    # Totals add up: every request was routed once, plus once per retry; the failed ones are
    # counted on the replica that died; the others finished.
    routed = replica_series(dp_server, "dp_replica_requests_routed_total")
    retried = replica_series(dp_server, "dp_replica_requests_retried_total")
    failed = replica_series(dp_server, "dp_replica_requests_failed_total")
    assert sum(routed.values()) - sum(routed_before.values()) == len(prompts) + sum(retried.values())
    assert sum(failed.values()) == len(failures) >= 1
    assert sum(retried.values()) >= 1
    finished = total(dp_server, "request_success_total", {"finished_reason": "length"}) - success_before
    assert finished == len(prompts) - len(failures)
    # Both replicas serve again.
    routed_before = routed
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda p: stream_one(dp_server.base_url, p), PROMPTS[:4])) == ["ok"] * 4
    routed = replica_series(dp_server, "dp_replica_requests_routed_total")
    assert routed[1] > routed_before[1] and routed[0] > routed_before[0]
