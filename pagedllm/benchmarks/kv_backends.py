"""Side by side in one run: the paged KV backend (two block sizes) against vattention.

    pagedllm bench kv-backends [--num-prompts 16 --output-len 64 ...]

Per configuration: offline throughput on seeded random prompts (as `pagedllm bench
throughput`, stepping the engine to sample its KV memory figures every step: peak resident
KV bytes and the internal fragmentation), then the engine's decode step time with a batch of
requests at 1k and 4k context. Last, decode attention alone (one layer) through each layout.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

CONFIGS = {
    "paged-16": {"kv_cache_backend": "paged", "block_size": 16},
    "paged-128": {"kv_cache_backend": "paged", "block_size": 128},
    "vattention": {"kv_cache_backend": "vattention"},
    "vattention-thp": {"kv_cache_backend": "vattention", "vattention_hugepages": True},
}


def _run(engine, prompts: list[list[int]], params) -> tuple[float, list[dict], dict[str, list[int]]]:
    """Submit every prompt, step to the end; per step: the KV figures. Returns (seconds,
    per-step figures, tokens per request)."""
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    figures = []
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        s = engine.scheduler.get_stats()
        figures.append({"resident": s.kv_resident_bytes, "tokens": s.kv_token_bytes})
    return time.perf_counter() - start, figures, [tokens[i] for i in ids]


def bench_config(name: str, args: argparse.Namespace) -> dict:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.workloads import random_prompts

    llm = LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=False,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, **CONFIGS[name],
    )
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    _run(engine, [list(range(100, 116))], warm)
    # 1. Throughput, with the KV figures of every step.
    prompts = random_prompts(args.num_prompts, 32, 480, vocab, seed=0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    elapsed, figs, outputs = _run(engine, prompts, params)
    num_out = sum(map(len, outputs))
    peak = max(figs, key=lambda f: f["resident"])
    busy = [f for f in figs if f["resident"]]
    frag = [1 - f["tokens"] / f["resident"] for f in busy if f["tokens"]]
    result = {
        "name": name,
        "output_tok_s": num_out / elapsed,
        "total_tok_s": (num_out + sum(map(len, prompts))) / elapsed,
        "peak_resident_mib": peak["resident"] / 2**20,
        "tokens_at_peak_mib": peak["tokens"] / 2**20,
        "frag_at_peak": 1 - peak["tokens"] / peak["resident"] if peak["resident"] else 0.0,
        "frag_mean": statistics.mean(frag) if frag else 0.0,
        "outputs": outputs,
    }
    # 2. Decode step time at 1k and 4k context (batch of args.decode_batch requests).
    for ctx in args.contexts:
        batch = random_prompts(args.decode_batch, ctx, ctx, vocab, seed=ctx)
        p = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
        for prompt in batch:
            engine.add_request({"prompt_token_ids": prompt}, p)
        times = []
        while engine.has_unfinished_requests():
            sched = engine.scheduler
            decoding = all(r.num_computed_tokens == r.num_tokens - 1 for r in sched.running) and not sched.waiting
            t0 = time.perf_counter()
            engine.step()
            if decoding and sched.running:
                times.append(time.perf_counter() - t0)
        result[f"decode_step_ms_{ctx}"] = 1000 * statistics.median(times) if times else float("nan")
    del llm, engine
    gc.collect()
    return result


def bench_attention(args: argparse.Namespace) -> list[str]:
    """Decode attention of one layer, SmolLM2-135M's shape (9 heads, 3 KV heads, 64 dims)."""
    import torch

    from pagedllm.attention.layouts import BLOCK_TABLES, CONTIGUOUS_SLOTS, KVLayout
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.attention.registry import bind_backend
    from pagedllm.config import AttentionConfig
    from pagedllm.layers.attention import Attention

    def decode(cache: torch.Tensor, layout: KVLayout, config: AttentionConfig):
        # One layer over `cache`, its backend's decode path alone (no KV write).
        layer = Attention(H, D, HKV, 0.125)
        layer.kv_cache = cache
        backend = bind_backend([layer], config, layout, "cpu")
        return lambda md: backend.decode(layer, q, md)  # type: ignore[attr-defined]

    torch.manual_seed(0)
    H, HKV, D, B = 9, 3, 64, args.decode_batch
    lines = []
    for ctx in args.contexts:
        q = torch.randn(B, H, D)
        seq = torch.full((B,), ctx, dtype=torch.int64)
        rows = []
        for bs in (16, 128):
            nb = ctx // bs
            cache = torch.randn(2, B * nb + 1, bs, HKV, D)
            perm = torch.randperm(B * nb) + 1
            md = AttentionMetadata(torch.zeros(0, dtype=torch.int64), perm.view(B, nb), seq, [], [ctx] * B, B, bs)
            fn = decode(cache, BLOCK_TABLES, AttentionConfig())
            rows.append((f"paged kernel bs={bs}", lambda md=md, fn=fn: fn(md)))
        cache = torch.randn(2, B, ctx, HKV, D)
        slots = torch.arange(B)
        md = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 0, dtype=torch.int64), seq, [],
                               [ctx] * B, B, 1, slots, slots.tolist())
        for mode in ("kernel", "torch"):
            fn = decode(cache, CONTIGUOUS_SLOTS, AttentionConfig(contiguous_decode=mode))
            rows.append((f"contiguous {mode}", lambda md=md, fn=fn: fn(md)))
        for label, fn in rows:
            fn()
            t = []
            for _ in range(args.attn_iters):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            lines.append(f"| {ctx} | {label} | {1000 * statistics.median(t):.2f} |")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4224)
    parser.add_argument("--kv-cache-memory-bytes", default="768MiB")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--attn-iters", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--contexts", default="1024,4096")


def run(args: argparse.Namespace) -> None:
    args.contexts = [int(c) for c in args.contexts.split(",")]
    results = []
    for name in args.configs.split(","):
        results.append(bench_config(name, args))
        r = results[-1]
        print(name, {k: v for k, v in r.items() if k != "outputs"}, flush=True)
    ref = results[0]["outputs"]
    steps = "".join(f" decode step {c} ctx (ms) |" for c in args.contexts)
    print(f"| config | output tok/s | total tok/s |{steps} "
          "peak resident KV (MiB) | of it tokens (MiB) | fragmentation at peak | mean fragmentation | "
          f"greedy outputs equal to {results[0]['name']} |")
    print("|---" * (8 + len(args.contexts)) + "|")
    for r in results:
        same = sum(a == b for a, b in zip(r["outputs"], ref))
        step_cells = "".join(f" {r[f'decode_step_ms_{c}']:.1f} |" for c in args.contexts)
        print(f"| {r['name']} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.1f} |{step_cells} "
              f"{r['peak_resident_mib']:.1f} | {r['tokens_at_peak_mib']:.1f} | "
              f"{r['frag_at_peak']:.3f} | {r['frag_mean']:.3f} | {same}/{len(ref)} |")
    print(f"\nDecode attention, one layer, batch {args.decode_batch} (ms, median of {args.attn_iters}):")
    print("| context | layout | ms |\n|---|---|---|")
    print("\n".join(bench_attention(args)))
