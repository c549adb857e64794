"""Beam search throughput: the engine's beam search (beams share KV blocks, fork with
copy-on-write) against the same search run naively, one request per beam per step with no
KV sharing (prefix caching off: every step recomputes each beam's whole sequence), and the
same naive loop with prefix caching on (vLLM's current approach).

Throughput counts beam tokens: each step, every live beam extends by one token; the three
runs do the same search (the same beams), so the counts are equal.

    pagedllm bench beam-search --model SmolLM2-135M-Instruct --beam-width 4 \
        --num-prompts 4 --prompt-len 128 --max-tokens 32
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from pagedllm import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM


def naive_beam_search(llm: LLM, prompt: list[int], k: int, max_tokens: int, length_penalty: float):
    """The search of engine/beam_search.py, driven from outside with independent requests."""
    eos = set(llm.llm_engine.model_config.eos_token_ids)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * k, ignore_eos=True, detokenize=False)
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[float, list[int]]] = []
    num_beam_tokens = 0
    for generated_len in range(1, max_tokens + 1):
        outs = llm.generate([{"prompt_token_ids": prompt + b[0]} for b in beams], params, use_tqdm=False)
        num_beam_tokens += len(beams)
        candidates = []
        for (tokens, cum), out in zip(beams, outs):
            (pos,) = out.outputs[0].logprobs
            ranked = sorted(pos.items(), key=lambda kv: kv[1].rank)[: 2 * k]
            candidates += [(cum + lp.logprob, tokens + [t]) for t, lp in ranked]
        candidates.sort(key=lambda c: -c[0])
        at_max = generated_len >= max_tokens
        nxt = []
        for rank, (cum, tokens) in enumerate(candidates[: 2 * k]):
            if at_max or tokens[-1] in eos:
                if rank < k:
                    finished.append((cum / generated_len**length_penalty, tokens))
            elif len(nxt) < k:
                nxt.append((tokens, cum))
        finished = sorted(finished, key=lambda f: -f[0])[:k]
        beams = nxt
        if at_max or len(finished) >= k or not beams:
            break
    return finished, num_beam_tokens


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)


def run(args: argparse.Namespace) -> None:
    import numpy as np

    from pagedllm.entrypoints.llm import LLM

    k = args.beam_width
    rng = np.random.default_rng(0)
    common = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes="512MiB")

    llm = LLM(args.model, **common)
    prompts = [rng.integers(100, 40000, size=args.prompt_len).tolist() for _ in range(args.num_prompts)]
    params = BeamSearchParams(beam_width=k, max_tokens=args.max_tokens)
    llm.beam_search([{"prompt_token_ids": prompts[0][:16]}], BeamSearchParams(beam_width=k, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    engine_time = time.perf_counter() - t0

    results = {}
    for caching in (False, True):
        naive_llm = llm if caching else LLM(args.model, enable_prefix_caching=False, **common)
        t0 = time.perf_counter()
        total = 0
        naive_outs = []
        for p in prompts:
            finished, n = naive_beam_search(naive_llm, p, k, args.max_tokens, 1.0)
            naive_outs.append(finished)
            total += n
        results[caching] = (time.perf_counter() - t0, total, naive_outs)

    same = all(
        [s.tokens[len(p):] for s in o.sequences] == [t for _, t in f]
        for p, o, f in zip(prompts, outs, results[False][2])
    )
    total = results[False][1]
    print(f"model={args.model} dtype={args.dtype} beam_width={k} prompts={args.num_prompts}x{args.prompt_len} "
          f"max_tokens={args.max_tokens}; beam tokens per run={total}; same beams: {same}")
    print(f"engine beam search (shared blocks, CoW): {engine_time:7.2f} s  {total / engine_time:8.1f} beam tok/s")
    for caching, label in ((False, "naive, no sharing (no prefix cache)"), (True, "naive + prefix caching (vLLM-style)")):
        t, n, _ = results[caching]
        print(f"{label:40s}: {t:7.2f} s  {n / t:8.1f} beam tok/s")
