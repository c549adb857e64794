"""bf16 decode step time with the bf16 linears (bf16 weights, float32 arithmetic) against
torch's bf16 matmul, alternating step by step in one engine, and the float32 model.

    OMP_NUM_THREADS=1 pagedllm bench bf16-decode [--batch-sizes 1,8,32] [--steps 8]

For each batch size, B random prompts of --input-len tokens are prefilled (with the bf16
linears), then decode steps alternate between the two matmul paths (the context grows by one
token per step, the same for both); median ms per step of each. Alternating keeps the
comparison fair on a machine other work is loading. Then the same for a float32 engine.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import numpy as np

from pagedllm import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM


def _decode_steps(llm: LLM, batch: int, input_len: int, steps: int, modes: list[bool]) -> dict[bool, float]:
    """Median step ms per mode (True: the bf16 linears) over `steps` rounds of all modes."""
    from pagedllm.kernels import linear as kernels
    from pagedllm.kernels import use_bf16_kernels

    engine = llm.llm_engine
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=steps * len(modes) + 4, temperature=0.0, ignore_eos=True, detokenize=False)
    vocab = engine.model_config.vocab_size
    ids = [
        engine.add_request({"prompt_token_ids": rng.integers(100, vocab, input_len).tolist()}, params)
        for _ in range(batch)
    ]
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    times: dict[bool, list[float]] = {m: [] for m in modes}
    for _ in range(steps + 1):  # the first round warms up
        for mode in modes:
            kernels.use_bf16_kernels = use_bf16_kernels if mode else (lambda: False)
            start = time.perf_counter()
            engine.step()
            times[mode].append(time.perf_counter() - start)
    kernels.use_bf16_kernels = use_bf16_kernels
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {m: float(np.median(t[1:])) * 1e3 for m, t in times.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    for dtype in ("bfloat16", "float32"):
        llm = LLM(dtype=dtype, quantization="none", kv_cache_memory_bytes="2GiB", enable_prefix_caching=False)
        modes = [True, False] if dtype == "bfloat16" else [True]
        for batch in batches:
            for mode, ms in _decode_steps(llm, batch, args.input_len, args.steps, modes).items():
                name = dtype if dtype == "float32" else f"bf16 {'float32 arithmetic' if mode else 'torch bf16 matmul'}"
                print(f"{name:30s} batch {batch:3d}: {ms:7.1f} ms/step, {batch / ms * 1e3:6.1f} tok/s", flush=True)
        del llm
