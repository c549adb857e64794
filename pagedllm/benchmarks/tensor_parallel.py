"""Decode throughput of tensor parallelism: TP 1 against TP 2 (mp executor, each rank pinned
to its share of the cores), at batch 1 and 32, and rank 0's time in collectives per step.

The default model (SmolLM2-135M, 9 query / 3 KV heads) cannot split its heads over 2 ranks,
so by default this measures a random-weight Llama of the default model's shape (hidden 576,
30 layers, MLP 1536, vocabulary 49152) with 8 query / 4 KV heads of 72: the same weights in
bytes and FLOPs; decode speed depends on shapes, not on the weights' values.

    pagedllm bench tensor-parallel --dtype float32 --batch-sizes 1 32 --max-tokens 32

Decode time is (time of prompt + N tokens) - (time of prompt + 1 token), over N - 1 steps.
TP 1 runs with one torch thread per available core (--tp1-threads), TP N with each rank
pinned to its share.
"Collective time" is rank 0's time inside all-reduce and all-gather, per decode step: it
includes waiting for the other rank, so it also measures how unevenly the ranks progress.
The bare gloo all-reduce latency of a [batch, 576] float32 tensor between two pinned
processes is measured alone too (a step has 2 per layer + 1, plus the logits' all-gather).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import TYPE_CHECKING

import numpy as np

from pagedllm import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM


def default_shaped_llama(path: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.models.loader import load_model

    tokenizer = load_model("SmolLM2-135M-Instruct", dtype="float32").tokenizer
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def run_decode(llm: LLM, batch: int, prompt_len: int, max_tokens: int) -> tuple[float, float]:
    """(decode tokens/s, rank 0's collective seconds per decode step)."""
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, prompt_len).tolist()} for _ in range(batch)]

    def timed(n: int) -> tuple[float, float]:
        group = getattr(llm.llm_engine.engine_core.runner, "group", None)
        c0 = group.all_reduce_seconds if group else 0.0
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, (group.all_reduce_seconds - c0) if group else 0.0

    timed(2)  # warm-up
    t1, c1 = timed(1)
    tn, cn = timed(max_tokens)
    steps = max_tokens - 1
    return batch * steps / (tn - t1), (cn - c1) / steps


def _allreduce_rank(rank: int, port: int, batch: int, iters: int, out) -> None:
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(batch, 576)
    for _ in range(20):
        dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    if rank == 0:
        out.put((time.perf_counter() - t0) / iters)
    dist.destroy_process_group()


def bare_allreduce_seconds(batch: int, iters: int = 500) -> float:
    import multiprocessing as mp

    from pagedllm.distributed.mp_executor import _free_port

    ctx = mp.get_context("spawn")
    port, out = _free_port(), ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, batch, iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a float checkpoint whose heads divide by 2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tp1-threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads of the TP 1 run (default: every available core)")


def run(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or default_shaped_llama(os.path.join(tmp, "llama-576"))
        for batch in args.batch_sizes:
            print(f"bare gloo all-reduce [{batch}, 576] fp32: {1e6 * bare_allreduce_seconds(batch):.1f} us", flush=True)
        for tp in args.tp_sizes:
            if tp == 1:
                import torch

                torch.set_num_threads(args.tp1_threads)
            llm = LLM(
                model, dtype=args.dtype, tensor_parallel_size=tp, max_model_len=512,
                kv_cache_memory_bytes="1GiB", max_num_seqs=max(args.batch_sizes), quantization="none",
            )
            for batch in args.batch_sizes:
                tok_s, coll = run_decode(llm, batch, args.prompt_len, args.max_tokens)
                print(
                    f"tp={tp} batch={batch:3d}: decode {tok_s:8.1f} tok/s, {1000 * batch / tok_s:7.2f} ms/step"
                    + (f", collectives {1000 * coll:6.2f} ms/step" if tp > 1 else ""),
                    flush=True,
                )
            llm.shutdown()
