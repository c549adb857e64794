"""Structured outputs: throughput with and without constraints, and grammar compile time.

1. Compile time of a typical schema (nested object, enums, bounded array): the one-time
   vocabulary set-up (xgrammar TokenizerInfo), a cold compile, and a cached one (same spec).
2. N chat requests constrained by JSON schemas (temperature 1.0, seeded), then the same N
   prompts unconstrained, each capped at exactly the token count its constrained run produced
   (ignore_eos), so both runs generate the same number of tokens. Both run in one engine,
   after a warm-up; the constrained run's grammars are compiled (and cached) beforehand so
   it measures the per-step cost (bitmask fill + masking + matcher advance), not compiling.
   Prefix caching is off so that both runs compute the same prompts.

    pagedllm bench structured-outputs --num-requests 32
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from pagedllm import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.com$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address"],
}


def compile_times(llm: LLM) -> None:
    from pagedllm.structured_output.manager import StructuredOutputManager

    engine = llm.llm_engine
    mc = engine.model_config
    manager = StructuredOutputManager(engine.tokenizer, mc.vocab_size, mc.eos_token_ids)
    spec = StructuredOutputsParams(json=TYPICAL)
    t0 = time.perf_counter()
    manager._get_compiler()
    t1 = time.perf_counter()
    manager.compile(spec).result()
    t2 = time.perf_counter()
    manager.compile(StructuredOutputsParams(json=json.dumps(TYPICAL))).result()
    t3 = time.perf_counter()
    manager.shutdown()
    print(f"vocabulary set-up (once per engine): {t1 - t0:.3f} s")
    print(f"compile typical schema, cold: {(t2 - t1) * 1e3:.1f} ms; cached: {(t3 - t2) * 1e3:.3f} ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--dtype", default="float32")


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    # Prefix caching off: the second run must not find the first run's prompts cached.
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, kv_cache_memory_bytes="1GiB",
              enable_prefix_caching=False)
    compile_times(llm)

    schemas = [TYPICAL, {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                          "population": {"type": "integer", "minimum": 0}},
                         "required": ["city", "population"]}]
    convs = [[{"role": "user", "content": f"Describe example number {i} as JSON."}] for i in range(args.num_requests)]
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=256,
                       structured_outputs=StructuredOutputsParams(json=schemas[i % len(schemas)]))
        for i in range(args.num_requests)
    ]
    llm.chat(convs[:2], constrained[:2], use_tqdm=False)  # warm-up; compiles (and caches) both schemas
    t0 = time.perf_counter()
    outs = llm.chat(convs, constrained, use_tqdm=False)
    t_con = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    t0 = time.perf_counter()
    free_outs = llm.chat(convs, free, use_tqdm=False)
    t_free = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in free_outs] == lengths
    total = sum(lengths)
    finished = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    print(f"{args.num_requests} requests, {total} output tokens each run ({finished} constrained ended with stop)")
    print(f"constrained:   {t_con:.2f} s, {total / t_con:.1f} output tok/s")
    print(f"unconstrained: {t_free:.2f} s, {total / t_free:.1f} output tok/s")
    print(f"overhead: {(t_con / t_free - 1) * 100:.1f}% time")
