"""Single-stream decode ms/token and batched throughput per weight format, side by side.

    pagedllm bench quant-decode [--configs float32:none bfloat16:none float32:int8 \
        float32:gguf float32:int4] [--batch 32] [--output-len 64]

Each config is dtype:quantization on the default model. Single stream: one 32-token prompt,
decode time = (end-to-end - time to first token) / (tokens - 1), best of 2 runs. Batch:
`--batch` random prompts of 32 to --input-len-max tokens (W1's shape: 480) with --output-len
tokens each.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from pagedllm import SamplingParams
from pagedllm.benchmarks.workloads import random_prompts

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM


def single_stream_ms(llm: LLM, prompt: list[int], num_tokens: int) -> float:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0)
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        runs.append((time.perf_counter() - start - ttft) / (num_tokens - 1) * 1e3)
    return min(runs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="+",
                        default=["float32:none", "bfloat16:none", "float32:int8", "float32:gguf"])  # fmt: skip
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=480)
    parser.add_argument("--single-stream-tokens", type=int, default=64)


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    rows = []
    for config in args.configs:
        dtype, quantization = config.split(":")
        llm = LLM(dtype=dtype, quantization=quantization, kv_cache_memory_bytes="1GiB",
                  enable_prefix_caching=False)  # fmt: skip
        vocab = llm.llm_engine.model_config.vocab_size
        prompt = random_prompts(1, 32, 32, vocab, seed=1)[0]
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4), use_tqdm=False)
        ms = single_stream_ms(llm, prompt, args.single_stream_tokens)
        prompts = random_prompts(args.batch, 32, args.input_len_max, vocab, seed=0)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tok_s = args.batch * args.output_len / elapsed
        rows.append((config, ms, tok_s))
        print(f"{config:16s} single stream {ms:6.1f} ms/token   batch {args.batch}: {tok_s:6.1f} output tok/s",
              flush=True)  # fmt: skip
        del llm
