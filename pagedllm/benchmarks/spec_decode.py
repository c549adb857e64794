"""Speculative decoding benchmark: output tokens/s with and without each proposer, side by
side in one run, on a repetitive workload (repeat or lightly edit a given paragraph) and on
random-token prompts, at concurrency 1 and 8, with acceptance rates.

    pagedllm bench spec-decode [--dtype float32] [--max-tokens 128] [--draft-layers 8] [--rounds 3]
        [--disable-by-batch-size 4] [--min-acceptance-rate 0.3]  (a '+policy' variant beside each)
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

import numpy as np

from pagedllm import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

PARAGRAPH = (
    "Paged attention stores the key and value cache of every request in fixed-size blocks, "
    "much like an operating system stores the memory of a process in pages. A block table maps "
    "each request's logical blocks to physical ones, so memory is allocated on demand, shared "
    "between requests with a common prefix, and freed as soon as a request finishes. This lets "
    "a server batch many more requests at once than a contiguous cache would allow."
)
EDITS = [
    "Repeat the following paragraph exactly, word for word:\n\n{p}",
    "Rewrite the following paragraph, replacing the word 'request' with 'query':\n\n{p}",
    "Copy this paragraph and then copy it once more:\n\n{p}",
    "Repeat the following paragraph exactly, but in the past tense:\n\n{p}",
]


def workloads(tokenizer, n: int, seed: int = 0) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    repetitive = [
        {"prompt_token_ids": tokenizer(tokenizer.apply_chat_template(
            [{"role": "user", "content": EDITS[i % len(EDITS)].format(p=PARAGRAPH)}],
            add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids}
        for i in range(n)
    ]
    random_prompts = [
        {"prompt_token_ids": rng.integers(100, len(tokenizer), size=int(rng.integers(64, 256))).tolist()}
        for _ in range(n)
    ]
    return {"repetitive": repetitive, "random": random_prompts}


def run_workload(llm: LLM, prompts: list, concurrency: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    scheduler = llm.llm_engine.scheduler
    scheduler.get_stats()  # reset the interval counters
    t0 = time.perf_counter()
    num_tokens = 0
    for start in range(0, len(prompts), concurrency):
        outs = llm.generate(prompts[start : start + concurrency], params, use_tqdm=False)
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - t0
    spec = scheduler.get_stats().spec_decoding_stats
    return {
        "tok_s": num_tokens / elapsed,
        "acceptance": spec.acceptance_rate if spec else None,
        "accepted_per_pos": spec.num_accepted_tokens_per_pos if spec else None,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts-c1", type=int, default=2)
    ap.add_argument("--num-prompts-c8", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--configs", default="none,ngram,self_draft", help="comma-separated subset")
    ap.add_argument("--rounds", type=int, default=1,
                    help="each workload run this many times per config, the configs alternated (loaded machines)")
    ap.add_argument("--disable-by-batch-size", type=int, default=None,
                    help="disable_by_batch_size of a '+policy' variant run beside each speculative config")
    ap.add_argument("--min-acceptance-rate", type=float, default=None,
                    help="min_acceptance_rate of a '+policy' variant run beside each speculative config")


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    policy = {"disable_by_batch_size": args.disable_by_batch_size, "min_acceptance_rate": args.min_acceptance_rate}
    policy = {key: value for key, value in policy.items() if value is not None}
    configs = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
        "self_draft": {"method": "draft_model", "num_speculative_tokens": 2, "draft_layers": args.draft_layers},
    }
    configs = {name: configs[name] for name in args.configs.split(",")}
    if policy:  # each speculative config also with the draft policy's keys
        configs |= {f"{name}+policy": spec | policy for name, spec in configs.items() if spec is not None}
    # Every config's engine at once, so each workload's runs alternate between them.
    llms = {}
    for name, spec in configs.items():
        llms[name] = LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes="256MiB",
                         max_num_seqs=8, speculative_config=spec)
        llms[name].generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    tok = next(iter(llms.values())).get_tokenizer()
    results: dict[str, dict[str, list[dict]]] = {}
    for concurrency, n in ((1, args.num_prompts_c1), (8, args.num_prompts_c8)):
        for wname, prompts in workloads(tok, n).items():
            key = f"{wname} c={concurrency}"
            for _ in range(args.rounds):
                for name, llm in llms.items():
                    r = run_workload(llm, prompts, concurrency, args.max_tokens)
                    results.setdefault(key, {}).setdefault(name, []).append(r)
                    print(name, wname, concurrency, json.dumps(r), flush=True)
    print(f"\n(median over {args.rounds} alternated rounds; the ratio: median of the rounds' ratios)")
    print("| workload | " + " | ".join(configs) + " |")
    print("| --- |" + " --- |" * len(configs))
    for key, row in results.items():
        base = [r["tok_s"] for r in row["none"]] if "none" in row else None
        cells = []
        for name in configs:
            runs = row[name]
            cell = f"{float(np.median([r['tok_s'] for r in runs])):.1f} tok/s"
            if name != "none" and base is not None:
                ratio = float(np.median([r["tok_s"] / b for r, b in zip(runs, base)]))
                accepted = [r["acceptance"] for r in runs if r["acceptance"] is not None]
                acceptance = f", accept {100 * float(np.mean(accepted)):.0f}%" if accepted else ", no drafts"
                cell += f" ({ratio:.2f}x{acceptance})"
            cells.append(cell)
        print(f"| {key} | " + " | ".join(cells) + " |")
