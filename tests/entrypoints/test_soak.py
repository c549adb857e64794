"""Soak: the real server at about twice its saturation (open streams = 4 x --max-num-seqs),
a mix of completions and chat, streaming or not, n > 1, stop strings, structured outputs (a
JSON schema, a regex, a choice: the output must match), beam search (n beams back), 10% of
streams dropped by their clients, every request under a deadline. Two identical rounds; after each, every
request completed or got a clear error, the only 5xx are 503/429 with Retry-After, every KV
block is free, and the engine's resident memory after round two is within RSS_TOLERANCE of
round one.

PAGEDLLM_SOAK_SECONDS sets the length of a round (default 25 s, for CI); raise it for a longer
soak. The figures are printed (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import jsonschema
import pytest

from tests.entrypoints.test_metrics_disconnect import wait_all_blocks_free
from tests.entrypoints.utils import RemoteServer, engine_core_pid, metric_value

pytestmark = pytest.mark.slow

ROUND_S = float(os.environ.get("PAGEDLLM_SOAK_SECONDS", "25"))
MAX_NUM_SEQS = 4
CONCURRENCY = 4 * MAX_NUM_SEQS
DEADLINE_S = 90.0  # the client's own limit: a request still open after it is a hang
RSS_TOLERANCE = 0.10  # round-two RSS at most 10% above round one's (allocator noise)
SOAK_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", str(17 * 8192),  # 16 blocks: preemption
             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(2 * MAX_NUM_SEQS),
             "--request-timeout", "30"]
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "List three colors:",
           "In the beginning", "Q: What is 2+2?\nA:"]


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    completed_kinds: Counter = field(default_factory=Counter)
    """Completed requests by kind (plain, beam, json, regex, choice)."""
    latencies: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# Structured outputs whose every match is short: the grammar ends them well within max_tokens.
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "size": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["color", "size"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]


def check_structured(body: dict, text: str) -> str | None:
    """Whether ``text`` matches what the request constrained it to (None if it does)."""
    spec = body.get("structured_outputs") or {"json": body.get("response_format", {}).get("json_schema", {}).get("schema")}
    try:
        if spec.get("json") is not None:
            jsonschema.validate(json.loads(text), spec["json"])
        elif spec.get("regex") is not None:
            assert re.fullmatch(spec["regex"], text)
        else:
            assert text in spec["choice"]
    except (AssertionError, ValueError, jsonschema.ValidationError) as e:
        return f"structured output {text!r} does not match {spec}: {type(e).__name__}"
    return None


# The first request of the first clients, sent while the queue still has room: each kind
# surely gets through at least once per round, however slow the machine.
FIRST_KINDS = ["beam", "json", "regex", "choice", "beam", "json"]


def make_request(rng: random.Random, kind: str | None = None) -> tuple[str, dict, bool]:
    """(path, body, whether the client drops the stream midway); ``kind`` forces beam search
    or a structured output (and no drop)."""
    stream = rng.random() < 0.5
    body: dict = {"max_tokens": rng.randint(4, 120), "n": rng.choice([1, 1, 1, 2]),
                  "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1000), "stream": stream}
    draw = rng.random()
    spec = rng.choice([{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}])
    if kind is not None:
        draw = 0.0 if kind == "beam" else 0.2
        spec = {kind: {"json": SCHEMA, "regex": REGEX, "choice": CHOICES}.get(kind)}
    if draw < 0.1:  # beam search: n is the beam width; no stop strings, temperature 0
        body.update(use_beam_search=True, n=2, temperature=0.0, max_tokens=rng.randint(4, 24))
    elif draw < 0.25:
        body["max_tokens"] = 48
        body["structured_outputs"] = spec
    else:
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(["\n", ".", " the", "e"])]
        if rng.random() < 0.3:
            body["ignore_eos"] = True
    prompt = rng.choice(PROMPTS) + " " * rng.randint(0, 3)
    drop = stream and rng.random() < 0.1 and kind is None
    if "structured_outputs" in body and "json" in body["structured_outputs"] and rng.random() < 0.5:
        # Chat asks for the schema the OpenAI way.
        del body["structured_outputs"]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}, drop
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt}, drop
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}, drop


def kind_of(body: dict) -> str:
    if body.get("use_beam_search"):
        return "beam"
    if "response_format" in body:
        return "json"
    return next(iter(body.get("structured_outputs") or {"plain": None}))


def check_choices(body: dict, finishes: dict[int, str], texts: dict[int, str]) -> str | None:
    """n choices (n beams for beam search), each finished by stop or length; a constrained
    output ends by its grammar ("stop") and matches it."""
    if sorted(finishes) != list(range(body["n"])) or not set(finishes.values()) <= {"stop", "length"}:
        return f"finishes {finishes} for n={body['n']}"
    if "structured_outputs" in body or "response_format" in body:
        for index, text in texts.items():
            if finishes[index] != "stop":
                return f"structured output ended by {finishes[index]}: {text!r}"
            problem = check_structured(body, text)
            if problem:
                return problem
    return None


def check_body(path: str, body: dict, data: dict) -> str | None:
    choices = data.get("choices") or []
    finishes = {c["index"]: c.get("finish_reason") for c in choices}
    texts = {c["index"]: c["text"] if "text" in c else c["message"]["content"] for c in choices}
    if len(choices) != body["n"]:
        return f"{len(choices)} choices for n={body['n']}"
    return check_choices(body, finishes, texts)


async def one(client: httpx.AsyncClient, path: str, body: dict, drop: bool, tally: Tally) -> float:
    """Send one request; return how long to back off (Retry-After) before the next."""
    t0 = time.monotonic()
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code == 200:
            problem = check_body(path, body, r.json())
            tally.outcomes["completed" if problem is None else "bad_body"] += 1
            tally.completed_kinds[kind_of(body)] += problem is None
            if problem:
                tally.problems.append(f"{path}: {problem}")
            tally.latencies.append(time.monotonic() - t0)
            return 0.0
        return classify_error(r.status_code, r.headers, r.text, tally)
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return classify_error(r.status_code, r.headers, r.text, tally)
        finishes: dict[int, str] = {}
        texts: dict[int, str] = {}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                tally.outcomes[f"stream_error_{event['error']['code']}"] += 1
                if event["error"]["code"] != 503:
                    tally.problems.append(f"stream error {event['error']}")
                return 1.0
            if drop:
                tally.outcomes["dropped_by_client"] += 1
                return 0.0  # leaving the block closes the connection mid-stream
            for c in event["choices"]:
                piece = c["text"] if "text" in c else (c.get("delta") or {}).get("content")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                if c.get("finish_reason"):
                    finishes[c["index"]] = c["finish_reason"]
    problem = check_choices(body, finishes, texts)
    if problem is None:
        tally.outcomes["completed"] += 1
        tally.completed_kinds[kind_of(body)] += 1
        tally.latencies.append(time.monotonic() - t0)
    else:
        tally.outcomes["bad_stream"] += 1
        tally.problems.append(f"{path} stream: {problem}")
    return 0.0


def classify_error(status: int, headers: httpx.Headers, text: str, tally: Tally) -> float:
    tally.outcomes[f"http_{status}"] += 1
    if status in (503, 429):
        if "retry-after" not in headers:
            tally.problems.append(f"{status} without Retry-After: {text[:200]}")
            return 1.0
        return float(headers["retry-after"])
    tally.problems.append(f"unexpected {status}: {text[:300]}")
    return 1.0


async def soak_round(base_url: str, seed: int) -> Tally:
    tally = Tally()
    end = time.monotonic() + ROUND_S

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=base_url, timeout=DEADLINE_S) as client:
            kind = FIRST_KINDS[i] if i < len(FIRST_KINDS) else None
            while time.monotonic() < end:
                path, body, drop = make_request(rng, kind)
                kind = None
                try:
                    backoff = await one(client, path, body, drop, tally)
                except httpx.TimeoutException:
                    tally.outcomes["client_deadline_passed"] += 1
                    tally.problems.append(f"{path}: no answer within {DEADLINE_S} s")
                    backoff = 0.0
                await asyncio.sleep(min(backoff, 2.0))

    await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    return tally


@pytest.fixture(scope="module")
def soak_server(tiny_llama_dir):
    srv = RemoteServer(SOAK_ARGS, model=tiny_llama_dir, startup_timeout_s=600)
    yield srv
    srv.stop()


def test_soak_two_rounds(soak_server):
    core_pid = engine_core_pid(soak_server.proc.pid)
    rss = []
    completed_kinds: Counter = Counter()
    for round_index in range(2):
        tally = asyncio.run(soak_round(soak_server.url, seed=1))  # both rounds send the same mix
        text = wait_all_blocks_free(soak_server)
        free = metric_value(text, "pagedllm:kv_cache_free_blocks")
        total = metric_value(text, "pagedllm:kv_cache_total_blocks")
        preemptions = metric_value(text, "pagedllm:num_preemptions_total")
        rss.append((rss_bytes(core_pid), rss_bytes(soak_server.proc.pid)))
        latencies = sorted(tally.latencies)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else float("nan")
        sent = sum(tally.outcomes.values())
        print(f"\nsoak round {round_index + 1} ({ROUND_S:.0f} s, {CONCURRENCY} clients, max_num_seqs={MAX_NUM_SEQS}): "
              f"sent {sent}, outcomes {dict(tally.outcomes)}, completed by kind {dict(tally.completed_kinds)}, "
              f"p99 latency {p99:.2f} s, "
              f"blocks held at end {total - free:.0f}/{total:.0f}, preemptions so far {preemptions:.0f}, "
              f"RSS engine core {rss[-1][0] / 2**20:.1f} MiB, front end {rss[-1][1] / 2**20:.1f} MiB")
        assert not tally.problems, tally.problems[:10]
        assert tally.outcomes["completed"] > 0
        assert free == total
        completed_kinds += tally.completed_kinds
    # Every kind of request got through at least once (the outputs checked as it did).
    assert set(completed_kinds) == {"plain", "beam", "json", "regex", "choice"}, completed_kinds
    (core1, front1), (core2, front2) = rss
    assert core2 <= core1 * (1 + RSS_TOLERANCE), (core1, core2)
    assert front2 <= front1 * (1 + RSS_TOLERANCE), (front1, front2)
    r = httpx.post(soak_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
