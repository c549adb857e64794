"""Engine faults: an exception inside one request's processing fails that request with an error
and the server goes on; an engine-core crash makes the server answer 503 and exit non-zero.

Faults are injected with PAGEDLLM_INJECT_FAULT (pagedllm/faults.py) for requests whose id
carries a marker; everything else is the real server. The same server is also a
disaggregated-prefill consumer with kv_load_failure_policy "fail" (one start-up for both)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import jsonschema
import pytest

from tests.entrypoints.test_metrics_disconnect import metrics, wait_all_blocks_free
from tests.entrypoints.utils import RemoteServer, engine_core_pid, free_port, metric_value
from tests.utils import assert_greedy_match

pytestmark = pytest.mark.slow

TINY_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--max-num-seqs", "8"]
# Per-request sites fail mid-way: from the 4th grammar bitmask fill, the 3rd sampling pass
# and the 2nd beam expansion of a marked request on (pagedllm/faults.py).
# Messages to the core fail alone: adding a marked request, and every reset_prefix_cache utility.
FAULTS = ("detokenize:poison-detok,core_step:poison-core,grammar:poison-grammar@4,sample:poison-sample@3,"
          "beam:poison-beam@2,add:poison-add,utility:reset_prefix_cache")
# Disaggregated decode side that fails (503) instead of recomputing when a KV pull fails.
KV_FAIL_ARGS = ["--kv-transfer-config", json.dumps(
    {"kv_role": "kv_consumer", "kv_load_failure_policy": "fail", "kv_transfer_timeout_s": 2})]


@pytest.fixture(scope="module")
def faulty_server(tiny_llama_dir):
    srv = RemoteServer(TINY_ARGS + KV_FAIL_ARGS, model=tiny_llama_dir,
                       env={"PAGEDLLM_INJECT_FAULT": FAULTS, "VLLM_SERVER_DEV_MODE": "1"}, startup_timeout_s=600)
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


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                         "size": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["color", "size"], "additionalProperties": False}
PROMPT = "The quick brown fox jumps over the lazy dog"


async def outcome(coro) -> tuple[str, object]:
    """("ok", the response or the list of stream chunks) or ("error", (status, message, the
    stream chunks received before the error))."""
    import openai

    chunks: list = []
    try:
        result = await coro
        if isinstance(result, openai.AsyncStream):
            async for chunk in result:
                chunks.append(chunk)
            result = chunks
        return "ok", result
    except openai.APIStatusError as e:
        return "error", (e.status_code, str(e.message), chunks)
    except openai.APIError as e:  # an error event inside a stream
        return "error", ((e.body or {}).get("code"), str(e.message), chunks)


def test_per_request_faults_fail_only_their_request(faulty_server, tiny_llama_dir):
    """A grammar, sampling or beam-expansion fault inside one request's processing in the engine
    core fails that request (500, or an error event) while the others in the same batches
    finish with the output they have alone; every KV block comes back."""
    import openai

    client = openai.AsyncOpenAI(base_url=faulty_server.base_url, api_key="EMPTY", max_retries=0, timeout=120)
    model = tiny_llama_dir

    def plain(rid: str | None, stream: bool = False, n: int = 1):
        extra = {"ignore_eos": True, **({"request_id": rid} if rid else {})}
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, n=n,
                                         logprobs=2, stream=stream, extra_body=extra)

    def structured(rid: str | None, stream: bool = False):
        extra = {"structured_outputs": {"json": SCHEMA}, **({"request_id": rid} if rid else {})}
        return client.completions.create(model=model, prompt="A small object as JSON:", max_tokens=40,
                                         temperature=0, stream=stream, extra_body=extra)

    def beam(rid: str | None):
        extra = {"use_beam_search": True, **({"request_id": rid} if rid else {})}
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, extra_body=extra)

    def tokens_and_gaps(result) -> tuple[list[str], list[float]]:
        if isinstance(result, list):  # stream chunks
            lps = [c.choices[0].logprobs for c in result if c.choices and c.choices[0].logprobs]
            toks, tops = [t for lp in lps for t in lp.tokens], [t for lp in lps for t in lp.top_logprobs]
        else:
            toks, tops = result.choices[0].logprobs.tokens, result.choices[0].logprobs.top_logprobs
        return toks, [abs(a - b) for a, b in (sorted(t.values(), reverse=True)[:2] for t in tops)]

    def text_of(result) -> list[str]:
        if isinstance(result, list):  # stream chunks
            return ["".join(c.choices[0].text for c in result if c.choices)]
        return [c.text for c in result.choices]

    healthy = {"plain": lambda: plain(None), "stream": lambda: plain(None, stream=True),
               "structured": lambda: structured(None), "structured_stream": lambda: structured(None, True),
               "beam": lambda: beam(None)}
    poisoned = {"grammar": lambda: structured("poison-grammar-1"),
                "grammar_stream": lambda: structured("poison-grammar-2", stream=True),
                "sample": lambda: plain("poison-sample-1", n=2),
                "sample_stream": lambda: plain("poison-sample-2", stream=True),
                "beam": lambda: beam("poison-beam-1")}

    async def run():
        alone = {k: await outcome(f()) for k, f in healthy.items()}  # references, one at a time
        together = await asyncio.gather(*(outcome(f()) for f in [*healthy.values(), *poisoned.values()]))
        return alone, dict(zip(healthy, together)), dict(zip(poisoned, together[len(healthy):]))

    alone, mixed, failed = asyncio.run(run())
    for site, (status, result) in failed.items():
        assert status == "error", (site, result)
        code, message, chunks = result
        assert code == 500 and f"InjectedFault: injected fault at {site.split('_')[0]} for" in message, (site, result)
        if site.endswith("_stream"):  # the fault came mid-way: some text was streamed first
            assert "".join(c.choices[0].text for c in chunks if c.choices), (site, chunks)
    for kind, (status, result) in mixed.items():
        assert status == "ok" and alone[kind][0] == "ok", (kind, result, alone[kind])
        if kind in ("plain", "stream"):
            ref_tokens, ref_gaps = tokens_and_gaps(alone[kind][1])
            tokens, _ = tokens_and_gaps(result)
            assert len(tokens) == 24
            assert_greedy_match(tokens, ref_tokens, ref_gaps, kind)
        else:
            assert text_of(result) == text_of(alone[kind][1]), kind
        if kind.startswith("structured"):
            jsonschema.validate(json.loads(text_of(result)[0]), SCHEMA)
    assert len(mixed["beam"][1].choices) == 2
    wait_all_blocks_free(faulty_server)


def test_kv_load_failure_policy_fail_gives_503(faulty_server, tiny_llama_dir):
    """Disaggregated decode with kv_load_failure_policy "fail": the prefill instance named in
    kv_transfer_params is gone (nothing listens at its KV port), so the pull fails and the
    request gets a 503 in OpenAI's shape with Retry-After (streamed: an error event), not a
    recompute; a request beside it and later ones are served; no block stays held."""
    gone = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
            "remote_host": "127.0.0.1", "remote_port": free_port(), "remote_transfer_id": "gone-1",
            "remote_num_blocks": 3}
    prompt = PROMPT + ", " + PROMPT + ", " + PROMPT + ", " + PROMPT  # > 3 blocks of 16 tokens
    url = faulty_server.url + "/v1/completions"
    failed_before = metric_value(metrics(faulty_server), "pagedllm:kv_transfer_failed_loads") or 0.0

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            doomed = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "kv_transfer_params": gone}
            return await asyncio.gather(
                client.post(url, json={**doomed, "stream": False}),
                post(client, url, {**doomed, "stream": True}),
                post(client, url, body(max_tokens=24)),
            )

    r, (stream_status, events), (ok_status, ok) = asyncio.run(run())
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == 503, error
    assert "prefill instance failed" in error["message"], error
    assert stream_status == 200 and events[-1]["error"]["code"] == 503, events
    assert ok_status == 200 and ok["usage"]["completion_tokens"] == 24, ok
    assert metric_value(metrics(faulty_server), "pagedllm:kv_transfer_failed_loads") >= failed_before + 2
    # Keeps serving: the same prompt without the dead instance, computed here.
    again = httpx.post(url, json={"prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=120)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1, again.text
    wait_all_blocks_free(faulty_server)


def test_add_and_utility_faults_fail_alone(faulty_server):
    """A core message that raises fails its caller alone: a request whose `add` raises gets a
    500 in OpenAI's shape (streamed: an error event, then [DONE]), so does a utility call
    (reset_prefix_cache); streams running beside them finish and the core serves on."""
    url = faulty_server.url + "/v1/completions"

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            healthy = [asyncio.create_task(post(client, url, body(stream=True, max_tokens=64))) for _ in range(4)]
            await asyncio.sleep(0.5)  # the streams are running when the faults come
            faulted = await asyncio.gather(
                post(client, url, body("poison-add-1")),
                post(client, url, body("poison-add-2", stream=True)),
                client.post(faulty_server.url + "/reset_prefix_cache"),
            )
            return faulted, await asyncio.gather(*healthy)

    ((s1, r1), (s2, r2), reset), healthy = asyncio.run(run())
    for error in (r1["error"], r2[-1]["error"], reset.json()["error"]):
        assert set(error) >= {"message", "type", "param", "code"}, error
    assert s1 == 500 and "InjectedFault: injected fault at add" in r1["error"]["message"], r1
    assert s2 == 200 and r2[-1]["error"]["code"] == 500 and "at add" in r2[-1]["error"]["message"], r2
    assert reset.status_code == 500 and "at utility" in reset.json()["error"]["message"], reset.text
    for status, chunks in healthy:
        assert status == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    after = httpx.post(url, json=body(max_tokens=8), timeout=120)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 8, after.text
    wait_all_blocks_free(faulty_server)


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
