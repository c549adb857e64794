"""`pagedllm bench serve`: a serving benchmark against any OpenAI-compatible server.

Random-token prompts (sent as token ids to /v1/completions, as `vllm bench serve`'s random
dataset does), arriving at a Poisson `--request-rate` (inf: all at once) under an optional
`--max-concurrency`, streamed. Reports request and token throughput and mean/median/p99 of
TTFT, TPOT (excluding the first token), ITL and end-to-end latency, like `vllm bench serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedllm.benchmarks.workloads import random_token_prompts

logger = logging.getLogger(__name__)


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def send_one(client, url: str, body: dict, prompt_len: int, headers: dict) -> RequestResult:
    import httpx

    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    usage_tokens = None
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if num_chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                num_chunks += 1
        result.latency = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        result.success = num_chunks > 0
        if not result.success:
            result.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2el_ms": _stats([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def format_summary(s: dict) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    rows = [
        ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(f"{f'{label} {short} (ms):':<40}{s[key][stat]:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


async def _pick_model(client, base_url: str, headers: dict) -> str:
    r = await client.get(f"{base_url}/v1/models", headers=headers)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_benchmark(args: argparse.Namespace) -> dict:
    import httpx

    base_url = args.base_url.rstrip("/")
    url = base_url + args.endpoint
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model or await _pick_model(client, base_url, headers)
        prompts = random_token_prompts(args.num_prompts, args.random_input_len, args.random_range_ratio,
                                       args.vocab_size, args.seed)

        def body(p: list[int], ignore_eos: bool) -> dict:
            b = {"model": model, "prompt": p, "max_tokens": args.random_output_len, "temperature": 0.0,
                 "stream": True, "stream_options": {"include_usage": True}}
            return b | {"ignore_eos": True} if ignore_eos else b

        # A test request: checks the server, warms it up, and asks whether it takes ignore_eos.
        ignore_eos = not args.no_ignore_eos
        test = await send_one(client, url, body(prompts[0][:16], ignore_eos), 16, headers)
        if not test.success and ignore_eos:
            logger.warning("the server rejected ignore_eos (%s); sending without it", test.error)
            ignore_eos = False
            test = await send_one(client, url, body(prompts[0][:16], False), 16, headers)
        if not test.success:
            raise RuntimeError(f"test request failed: {test.error}")

        sem = asyncio.Semaphore(limit)
        rng = np.random.default_rng(args.seed)

        async def limited(p: list[int]) -> RequestResult:
            async with sem:
                return await send_one(client, url, body(p, ignore_eos), len(p), headers)

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration)
    summary.update({
        "model": model, "base_url": base_url, "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "ignore_eos": ignore_eos, "seed": args.seed,
        "date": time.strftime("%Y%m%d-%H%M%S"),
    })
    summary["per_request"] = [asdict(r) | {"itl": None} for r in results] if args.save_detailed else None
    return summary


def run(args: argparse.Namespace) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
    summary = asyncio.run(run_benchmark(args))
    print(format_summary(summary), flush=True)
    if args.save_result:
        filename = args.result_filename or (
            f"bench-serve-{summary['model'].replace('/', '_')}-c{args.max_concurrency or 'inf'}-{summary['date']}.json")
        with open(filename, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"saved {filename}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="input lengths uniform in len*(1 +- ratio)")
    p.add_argument("--vocab-size", type=int, default=32000, help="random token ids are drawn from [100, vocab-size)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="include per-request results in the JSON")
    p.add_argument("--result-filename", default=None)
