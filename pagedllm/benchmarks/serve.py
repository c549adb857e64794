"""`pagedllm bench serve`: a serving benchmark against any OpenAI-compatible server, with the
options, datasets, arithmetic and result JSON of `vllm bench serve` (the same command line
runs against vLLM and pagedllm; docs/benchmarks.md lists the differences).

`--backend openai` streams /v1/completions, `openai-chat` /v1/chat/completions (the user
message is the prompt). Datasets: serve_datasets.py; metrics, goodput and arrivals:
serve_metrics.py. Prompt lengths are counted with the served model's tokenizer (the server's
/tokenize) unless `--tokenizer` names a local one. One test request (the first prompt) checks
the server and whether it takes ``ignore_eos``; `--num-warmups` more follow, untimed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedllm.benchmarks.serve_datasets import (
    DATASETS, DatasetContext, SampleRequest, add_dataset_arguments, apply_length_overrides,
)
from pagedllm.benchmarks.serve_metrics import (  # noqa: F401 -- RequestResult, summarize: this module's API too
    RequestResult, arrival_times, parse_goodput, parse_percentile_metrics, parse_percentiles, summarize,
)
from pagedllm.benchmarks.serve_tokenizer import BenchTokenizer, LocalTokenizer, ServerTokenizer

logger = logging.getLogger(__name__)

SAMPLING_ARGS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty")
DEFAULT_VOCAB_SIZE = 32000


def completion_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    return (choices[0].get("text") or "") if choices else ""


def chat_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


@dataclass(frozen=True)
class Backend:
    endpoint: str
    """Default path when --endpoint is not given."""
    text_only: bool
    body: Callable[[SampleRequest, str, int], dict]
    """(sample, model, max_tokens) -> the request body, without sampling fields or stream."""
    chunk_text: Callable[[dict], str]


BACKENDS: dict[str, Backend] = {
    "openai": Backend("/v1/completions", False,
                      lambda s, model, n: {"model": model, "prompt": s.prompt, "max_tokens": n}, completion_text),
    "openai-chat": Backend("/v1/chat/completions", True,
                           lambda s, model, n: {"model": model, "messages": [{"role": "user", "content": s.prompt}],
                                                "max_completion_tokens": n}, chat_text),
}


async def send_one(client, url: str, body: dict, prompt_len: int, headers: dict,
                   chunk_text: Callable[[dict], str] = completion_text) -> RequestResult:
    """Stream one request; times from send to each chunk with text, tokens from usage."""
    import httpx

    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    result.start_time = start
    usage_tokens = None
    pieces: list[str] = []
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
                text = chunk_text(chunk)
                if not text:
                    continue
                now = time.perf_counter()
                if not pieces:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                pieces.append(text)
        result.latency = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else len(pieces)
        result.generated_text = "".join(pieces)
        result.success = bool(pieces)
        if not result.success:
            result.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _first_model(client, base_url: str, headers: dict) -> str:
    r = await client.get(f"{base_url}/v1/models", headers=headers)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def load_samples(args: argparse.Namespace, base_url: str, model: str, headers: dict) -> tuple[list[SampleRequest], str]:
    """The dataset's requests, and the tokenizer's name ("server" for the served model's)."""
    import httpx

    backend = BACKENDS[args.backend]
    with httpx.Client(timeout=60) as http:
        made: list[BenchTokenizer] = []

        def tokenizer() -> BenchTokenizer:
            if not made:
                made.append(LocalTokenizer(args.tokenizer) if args.tokenizer else
                            ServerTokenizer(http, base_url, model, headers, args.vocab_size or DEFAULT_VOCAB_SIZE))
            return made[0]

        vocab_size = args.vocab_size or (tokenizer().vocab_size if args.tokenizer else DEFAULT_VOCAB_SIZE)
        ctx = DatasetContext(args, tokenizer, backend.text_only, vocab_size)
        samples = DATASETS[args.dataset_name](ctx)
    return samples, args.tokenizer or "server"


@dataclass
class _Sender:
    """How this run's requests go: one endpoint, one model, the same sampling fields."""

    client: object  # httpx.AsyncClient
    url: str
    headers: dict
    backend: Backend
    model: str
    sampling: dict
    ignore_eos: bool

    async def send(self, s: SampleRequest) -> RequestResult:
        body = self.backend.body(s, self.model, s.expected_output_len) | self.sampling | {
            "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True
        return await send_one(self.client, self.url, body, s.prompt_len, self.headers, self.backend.chunk_text)

    async def check(self, first: SampleRequest) -> None:
        """The test request; a server that rejects ignore_eos (llama.cpp's) gets none."""
        test = await self.send(first)
        if not test.success and self.ignore_eos:
            logger.warning("the server rejected ignore_eos (%s); sending without it", test.error)
            self.ignore_eos = False
            test = await self.send(first)
        if not test.success:
            raise RuntimeError(f"test request failed: {test.error}")


async def _drive(sender: _Sender, samples: list[SampleRequest], args: argparse.Namespace, limit: int
                 ) -> tuple[list[RequestResult], float, float]:
    """Warm-ups, then every sample at its arrival time under the concurrency limit:
    (results, duration, start)."""
    sem = asyncio.Semaphore(limit)

    async def limited(s: SampleRequest) -> RequestResult:
        async with sem:
            return await sender.send(s)

    if args.num_warmups:
        await asyncio.gather(*[limited(samples[0]) for _ in range(args.num_warmups)])
    delays = arrival_times(len(samples), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    start = time.perf_counter()
    tasks = []
    for s, delay in zip(samples, delays):
        wait = start + delay - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(limited(s)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start, start


def _metadata(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r}: give KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the benchmark; vLLM's result fields (and a few of pagedllm's: the run's options)."""
    import httpx

    apply_length_overrides(args)
    percentile_metrics = parse_percentile_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    goodput = parse_goodput(args.goodput)
    metadata = _metadata(args.metadata)
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be > 0")
    backend = BACKENDS[args.backend]
    base_url = _base_url(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        model_id = args.model or await _first_model(client, base_url, headers)
        model = args.served_model_name or model_id
        samples, tokenizer_id = await asyncio.to_thread(load_samples, args, base_url, model, headers)
        sender = _Sender(
            client, base_url + (args.endpoint or backend.endpoint), headers, backend, model,
            {k: getattr(args, k) for k in SAMPLING_ARGS if getattr(args, k) is not None},
            # vLLM's rule: the random dataset runs every request to its length.
            (args.ignore_eos or args.dataset_name == "random") and not args.no_ignore_eos,
        )
        await sender.check(samples[0])
        results, duration, start = await _drive(sender, samples, args, limit)
    summary = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "endpoint_type": args.backend,
        "label": args.label, "model_id": model_id, "tokenizer_id": tokenizer_id, "num_prompts": len(samples),
        "dataset_name": args.dataset_name, "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "ignore_eos": sender.ignore_eos,
        "num_warmups": args.num_warmups, "seed": args.seed, "goodput": goodput or None,
    } | metadata
    summary |= summarize(results, duration, percentile_metrics, percentiles, goodput)
    summary["percentile_metrics"], summary["metric_percentiles"] = percentile_metrics, percentiles
    summary["errors"] = [r.error for r in results]
    if args.save_detailed:
        summary |= {
            "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results], "start_times": [r.start_time - start for r in results],
            "generated_texts": [r.generated_text for r in results],
        }
    return summary


def format_summary(s: dict) -> str:
    """vLLM's printed layout."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"])]
    if s.get("max_concurrency") is not None:
        rows.append(("Maximum request concurrency:", s["max_concurrency"]))
    if s.get("request_rate", "inf") != "inf":
        rows.append(("Request rate configured (RPS):", f"{s['request_rate']:.2f}"))
    rows += [
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
    ]
    if s.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s):", f"{s['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests:", f"{s['max_concurrent_requests']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    lines += [f"{k:<40} {v:<10}" for k, v in rows]
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    for name in s.get("percentile_metrics", ()):
        title, short = titles[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for key in [k for k in s if k.endswith(f"_{name}_ms") and not k.startswith("std_")]:
            stat = key.split("_", 1)[0]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            lines.append(f"{f'{label} {short} (ms):':<40} {s[key]:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def result_filename(args: argparse.Namespace, s: dict) -> str:
    """vLLM's default name: {label}-{rate}qps[-concurrency{C}]-{model}-{date}.json."""
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{s['model_id'].split('/')[-1]}-{s['date']}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def run(args: argparse.Namespace) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
    summary = asyncio.run(run_benchmark(args))
    print(format_summary(summary), flush=True)
    if args.save_result:
        filename = result_filename(args, summary)
        with open(filename, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"saved {filename}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=list(BACKENDS), default="openai")
    p.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default: the backend's (/v1/completions, /v1/chat/completions)")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--served-model-name", default=None, help="the `model` sent, if not --model")
    p.add_argument("--tokenizer", default=None,
                   help="a local tokenizer (HF name or directory, .gguf, pagedllm model); default: the server's /tokenize")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"synthetic token ids from [100, vocab-size); default: the --tokenizer's, else {DEFAULT_VOCAB_SIZE}")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--num-prompts", type=int, default=1000)
    add_dataset_arguments(p)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 steadier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0, help="untimed requests (the first prompt) before the run")
    p.add_argument("--ignore-eos", action="store_true", help="run every request to its length (always for random)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS, random dataset included")
    for name in SAMPLING_ARGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int if name == "top_k" else float,
                       default=0.0 if name == "temperature" else None)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="of ttft, tpot, itl, e2el")
    p.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="service-level objectives in ms, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None, help="the result's label (default: the backend)")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra fields for the result JSON")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="per-request lists in the JSON")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true", help="accepted (there is no progress bar)")


def namespace(**overrides) -> argparse.Namespace:
    """The defaults of `pagedllm bench serve`, with overrides (for scripts and tests)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise AttributeError(f"bench serve has no option {key!r}")
        setattr(args, key, value)
    return args

