"""`pagedllm bench prefix-caching`: a shared-prefix workload with prefix caching on and off,
in one run: many requests over a few long system prompts with short distinct questions."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from pagedllm.entrypoints.engine_flags import DEFAULT_MODEL, add_engine_flags, engine_kwargs


def shared_prefix_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(100, vocab_size, size=args.prefix_len).tolist() for _ in range(args.num_prefixes)]
    return [
        systems[i % args.num_prefixes] + rng.integers(100, vocab_size, size=args.question_len).tolist()
        for i in range(args.num_prompts)
    ]


def _run(args: argparse.Namespace, enable: bool) -> dict:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    engine_args = engine_kwargs(args) | {"enable_prefix_caching": enable}
    llm = LLM(**engine_args)
    prompts = shared_prefix_prompts(args, llm.llm_engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][-16:]}], SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outputs]
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "prefix_caching": enable,
        "elapsed_s": elapsed,
        "output_tok_s": num_out / elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "median_ttft_s": statistics.median(ttfts),
        "p99_ttft_s": float(np.percentile(ttfts, 99)),
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs),
        "prompt_tokens": sum(map(len, prompts)),
    }


def run(args: argparse.Namespace) -> None:
    results = [_run(args, True), _run(args, False)]
    for r in results:
        print(
            f"prefix caching {'on ' if r['prefix_caching'] else 'off'}: {r['elapsed_s']:.1f} s, "
            f"{r['output_tok_s']:.1f} output tok/s, median TTFT {r['median_ttft_s'] * 1e3:.0f} ms, "
            f"p99 TTFT {r['p99_ttft_s'] * 1e3:.0f} ms, cached {r['cached_prompt_tokens']}/{r['prompt_tokens']} prompt tokens",
            flush=True,
        )
    on, off = results
    print(
        f"median TTFT off/on: {off['median_ttft_s'] / on['median_ttft_s']:.2f}x, "
        f"throughput on/off: {on['output_tok_s'] / off['output_tok_s']:.2f}x"
    )
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump({"workload": {k: getattr(args, k) for k in _WORKLOAD_KEYS}, "results": results}, f, indent=2)


_WORKLOAD_KEYS = ("num_prompts", "num_prefixes", "prefix_len", "question_len", "output_len", "seed", "model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    add_engine_flags(p)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--save-json", default=None)
