"""Multi-LoRA decode: tokens/s with 0, 1 and 4 distinct adapters in one batch against the
same model with an adapter merged into its weights, alternated in one run.

    pagedllm bench lora [--model M] [--batch 16] [--output-len 64] [--rank 16] [--rounds 3]

Adapters are random rank-`--rank` LoRAs on every projection of every decoder layer, written
as PEFT checkpoints into a temporary directory. "merged" is the base model without
--enable-lora: an adapter merged into the weights changes their values, not their shapes or
format (a quantized base stays in its format), so it decodes at the base's speed. Decode
tokens/s = batch * (output_len - 1) / (time of the batch - time of its first token), best of
`--rounds`; the configurations alternate A B C D A B C D so load drifts hit them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

from pagedllm import SamplingParams
from pagedllm.benchmarks.workloads import random_prompts

_CHECKPOINT_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def write_random_adapter(path: str, model: Any, rank: int, seed: int) -> None:
    """A PEFT LoRA checkpoint for `model` (our module tree, HF names) on every projection."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(model.model.layers):
        for parent, part in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                             ("mlp", "down_proj")):
            linear = getattr(getattr(layer, parent), part)
            names = _CHECKPOINT_NAMES.get(part, (part,))
            for name, (_, rows) in zip(names, linear.output_sections().values()):
                key = f"base_model.model.model.layers.{index}.{parent}.{name}"
                a = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(rows, rank, generator=generator)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def decode_tok_s(llm: Any, prompts: list[list[int]], output_len: int, loras: list | None) -> float:
    """Decode tokens/s of one batch: its time less the time to its first tokens."""
    batch = [{"prompt_token_ids": p} for p in prompts]
    kwargs = {} if loras is None else {"lora_request": loras}
    start = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False, **kwargs)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True), use_tqdm=False,
                 **kwargs)
    return len(prompts) * (output_len - 1) / (time.perf_counter() - start - first)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the default model (Q4_1 GGUF, kept quantized)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)


def run(args: argparse.Namespace) -> None:
    from pagedllm.config import LoadConfig
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.lora.request import LoRARequest

    model = args.model or LoadConfig.model
    common: dict[str, Any] = dict(dtype=args.dtype, kv_cache_memory_bytes="512MiB", enable_prefix_caching=False)
    merged = LLM(model, **common)
    served = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common)
    vocab = served.llm_engine.model_config.vocab_size
    prompts = random_prompts(args.batch, args.input_len, args.input_len, vocab, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(4):
            write_random_adapter(os.path.join(tmp, f"a{i}"), served.llm_engine.engine_core.runner.model, args.rank, i)
            adapters.append(LoRARequest(f"a{i}", i + 1, os.path.join(tmp, f"a{i}")))
        configs: dict[str, tuple[Any, list | None]] = {
            "merged": (merged, None),
            "0 adapters": (served, [None] * args.batch),
            "1 adapter": (served, [adapters[0]] * args.batch),
            "4 adapters": (served, [adapters[i % 4] for i in range(args.batch)]),
        }
        for llm, loras in configs.values():  # warm-up: kernels built, adapters loaded
            decode_tok_s(llm, prompts, 4, loras)
        best = {name: 0.0 for name in configs}
        for _ in range(args.rounds):
            for name, (llm, loras) in configs.items():
                best[name] = max(best[name], decode_tok_s(llm, prompts, args.output_len, loras))
    base = best["merged"]
    print(f"{model}, batch {args.batch}, rank {args.rank}, {args.output_len} output tokens, best of {args.rounds}")
    for name, tok_s in best.items():
        print(f"{name:12s} {tok_s:8.1f} decode tok/s   {tok_s / base:5.2f}x merged", flush=True)
