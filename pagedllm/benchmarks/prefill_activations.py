"""Prompt processing (llama-bench's pp: one prompt, no decode) with float, int8 and bf16
prefill activations (`--matmul-activations`) on the same weights, alternated on one engine.

    pagedllm bench prefill-activations [--input-len 512] [--rounds 6] [--modes float,int8,bf16] [--model M]

Mode `bf16-panels` is bf16 without weight copies: kept weights (GGUF blocks, quantized) through
bf16 panels decoded per call (what `auto` runs where the copies would pass its limit), against
`bf16`'s copies.

Each run prefills one new random `--input-len`-token prompt (max_tokens=1, prefix caching
off) and reports prompt tokens / s; the modes alternate (forward, then reversed, per round)
after one warm-up each, and the per-round ratio to float is the figure to read on a shared
machine. The same shape as `llama-bench -p 512 -n 0`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--modes", default="float,int8,bf16",
                        help="comma-separated --matmul-activations modes (float: float32; bf16-panels: bf16 with "
                             "no weight copies, kept weights in panels); float first (the base)")


def run(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.workloads import random_prompts
    from pagedllm.layers.linear import set_prefill_activations

    llm = LLM(args.model, dtype="float32", matmul_activations="float32", max_model_len=max(2048, args.input_len + 1),
              kv_cache_memory_bytes="256MiB", enable_prefix_caching=False)  # fmt: skip
    model = llm.llm_engine.engine_core.runner.model
    vocab = llm.llm_engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    modes = tuple(args.modes.split(","))
    if modes[0] != "float":
        raise SystemExit("--modes must start with float (the base of the ratios)")
    prompts = iter(random_prompts(len(modes) * (args.rounds + 1), args.input_len, args.input_len, vocab, seed=0))

    def once(mode: str) -> float:
        # before the clock: bf16 makes its weight copies here
        set_prefill_activations(model, "bf16" if mode == "bf16-panels" else mode, copies=mode != "bf16-panels")
        prompt = next(prompts)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return len(prompt) / (time.perf_counter() - start)

    for mode in modes:
        once(mode)  # warm-up (and the kernel build)
    results: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            results[mode].append(once(mode))
    set_prefill_activations(model, "float")
    print(f"pp{args.input_len}, {args.model}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for mode, values in results.items():
        print(f"{mode:5s} prompt tok/s {' '.join(f'{v:.0f}' for v in values)}   median {statistics.median(values):.0f}"
              f"   best {max(values):.0f}")  # fmt: skip
    for mode in modes[1:]:
        ratios = [b / a for a, b in zip(results["float"], results[mode])]
        print(f"{mode} / float per round {' '.join(f'{r:.2f}' for r in ratios)}   "
              f"median {statistics.median(ratios):.2f}")  # fmt: skip
