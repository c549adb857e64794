"""`pagedllm bench throughput`: offline throughput on random-token prompts, optionally
side by side with HF transformers static batching on the same workload in the same run.

N prompts with seeded lengths uniform in [--input-len-min, --input-len-max], --output-len
tokens each, EOS ignored; prints output and total tokens/s. `--baseline hf` runs the same
workload through HF transformers `generate` (static batches of --hf-batch-size, left padding)
in the same run and dtype, on the weights the engine loaded.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass

from pagedllm.benchmarks.workloads import random_prompts
from pagedllm.entrypoints.engine_flags import DEFAULT_MODEL, add_engine_flags, engine_kwargs

logger = logging.getLogger(__name__)


@dataclass
class ThroughputResult:
    engine: str
    dtype: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def summary(self) -> str:
        return (
            f"{self.engine:>10} {self.dtype:>8}: {self.num_requests} requests in {self.elapsed_s:.1f} s, "
            f"{self.output_tok_s:.1f} output tok/s, {self.total_tok_s:.1f} total tok/s"
        )


def bench_pagedllm(args: argparse.Namespace, llm, prompts: list[list[int]]) -> ThroughputResult:
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    # Warm-up: one short request, so one-time costs are not timed.
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == len(prompts) * args.output_len, "EOS was ignored, every request must run to length"
    dtype = llm.llm_engine.model_config.dtype
    return ThroughputResult("pagedllm", dtype, len(prompts), sum(map(len, prompts)), num_out, elapsed)


def bench_hf(args: argparse.Namespace, model_dir: str, prompts: list[list[int]], dtype: str) -> ThroughputResult:
    """HF transformers `generate` with static batches (left padding), greedy, EOS ignored.

    It loads the same weights from the HF-format directory the engine loaded (for a GGUF
    model, the dequantized conversion in the cache).
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    pad = 0
    start = time.perf_counter()
    num_out = 0
    for i in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[i : i + args.hf_batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad,
            )
        num_out += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - start
    return ThroughputResult("hf", dtype, len(prompts), sum(map(len, prompts)), num_out, elapsed)


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    vocab_size = llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len_min, args.input_len_max, vocab_size, args.seed)
    results = [bench_pagedllm(args, llm, prompts)]
    print(results[0].summary(), flush=True)
    if args.baseline == "hf":
        model_dir = llm.llm_engine.model_dir
        del llm  # free the engine's memory before loading the baseline
        results.append(bench_hf(args, model_dir, prompts, results[0].dtype))
        print(results[1].summary(), flush=True)
        print(f"pagedllm / hf output throughput: {results[0].output_tok_s / results[1].output_tok_s:.2f}x")
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(
                {
                    "workload": {
                        "num_prompts": args.num_prompts, "input_len": [args.input_len_min, args.input_len_max],
                        "output_len": args.output_len, "seed": args.seed, "model": args.model,
                    },
                    "results": [asdict(r) | {"output_tok_s": r.output_tok_s, "total_tok_s": r.total_tok_s} for r in results],
                },
                f, indent=2,
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    add_engine_flags(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-min", type=int, default=32)
    parser.add_argument("--input-len-max", type=int, default=480)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--baseline", choices=["none", "hf"], default="none")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--save-json", default=None)
