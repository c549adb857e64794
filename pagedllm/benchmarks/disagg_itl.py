"""Inter-token latency of running streams while a burst of long prompts arrives.

Point it at one instance (`pagedllm serve`) or at `pagedllm proxy` over a prefill and a decode
instance, and compare: 8 streams decode while 16 prompts of 1,500 random tokens arrive at
once; the figure is the p99 gap between tokens of the 8 streams. With --decode-url (the decode
instance behind a proxy) it also reports the KV transfer throughput from its /metrics.

    pagedllm bench disagg-itl --base-url http://127.0.0.1:8000 [--decode-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import numpy as np

from pagedllm.benchmarks.serve import send_one
from pagedllm.benchmarks.workloads import random_token_prompts


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _run(args: argparse.Namespace) -> None:
    url = args.base_url.rstrip("/") + "/v1/completions"
    streams = random_token_prompts(args.num_streams, args.stream_input_len, 0.0, args.vocab_size, 1)
    burst = random_token_prompts(args.num_burst, args.burst_input_len, 0.0, args.vocab_size, 2)

    def body(prompt: list[int], max_tokens: int) -> dict:
        return {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        before = httpx.get(args.decode_url + "/metrics").text if args.decode_url else ""
        t0 = time.perf_counter()
        stream_tasks = [asyncio.create_task(send_one(client, url, body(p, args.stream_output_len), len(p), {}))
                        for p in streams]
        await asyncio.sleep(args.burst_delay_s)
        burst_results = await asyncio.gather(*[send_one(client, url, body(p, args.burst_output_len), len(p), {})
                                               for p in burst])
        burst_end = time.perf_counter() - t0
        stream_results = await asyncio.gather(*stream_tasks)
        after = httpx.get(args.decode_url + "/metrics").text if args.decode_url else ""
    itl = np.asarray([x for r in stream_results for x in r.itl]) * 1000
    ttft = np.asarray([r.ttft for r in burst_results if r.success]) * 1000
    failed = sum(not r.success for r in [*stream_results, *burst_results])
    print(f"streams: {args.num_streams} x {args.stream_output_len} tokens; burst: {args.num_burst} x "
          f"{args.burst_input_len}-token prompts at t={args.burst_delay_s} s, done at t={burst_end:.1f} s; "
          f"failed requests: {failed}")
    print(f"stream ITL ms: median {np.median(itl):.1f}  p99 {np.percentile(itl, 99):.1f}  max {itl.max():.1f}")
    print(f"burst TTFT ms: median {np.median(ttft):.0f}  p99 {np.percentile(ttft, 99):.0f}")
    if args.decode_url:
        name = "pagedllm:kv_transfer_"
        num_bytes = metric(after, name + "bytes_received") - metric(before, name + "bytes_received")
        seconds = metric(after, name + "seconds") - metric(before, name + "seconds")
        blocks = metric(after, name + "blocks_received") - metric(before, name + "blocks_received")
        if seconds:
            print(f"KV transfer: {blocks:.0f} blocks, {num_bytes / 1e6:.1f} MB in {seconds:.2f} s of pulls "
                  f"= {num_bytes / 1e6 / seconds:.0f} MB/s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True)
    p.add_argument("--decode-url", default=None, help="the decode instance behind the proxy (for MB/s)")
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--num-streams", type=int, default=8)
    p.add_argument("--stream-input-len", type=int, default=64)
    p.add_argument("--stream-output-len", type=int, default=128)
    p.add_argument("--num-burst", type=int, default=16)
    p.add_argument("--burst-input-len", type=int, default=1500)
    p.add_argument("--burst-output-len", type=int, default=4)
    p.add_argument("--burst-delay-s", type=float, default=2.0)


def run(args: argparse.Namespace) -> None:
    asyncio.run(_run(args))
