"""`pagedllm bench latency`: decode step time and tokens/s at fixed batch sizes.

For each batch size B, B random-token prompts are prefilled, then every request is decoding
and the engine's steps are timed (each step computes one token per request, EOS ignored).
Besides tokens/s it prints what a step reads and computes, so the figures can be read
against the machine's limits: the achieved GFLOP/s of the linear layers (2 x weights x B per
step) and the bytes a step must read (the weights once, plus the KV of every request).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

from pagedllm.entrypoints.engine_flags import DEFAULT_MODEL, add_engine_flags, engine_kwargs
from pagedllm.benchmarks.step_profile import StepProfile, profiling


@dataclass
class LatencyResult:
    batch_size: int
    context_len: int
    """Prompt length; the context grows by one per timed step from there."""
    step_ms: float
    """Median wall time of a decode step."""
    decode_tok_s: float
    linear_gflop_s: float
    """2 x linear weights x batch / step time: how hard the matmuls run."""
    read_gb_s: float
    """(weight bytes + the batch's KV bytes) / step time: against the memory bandwidth."""

    def summary(self) -> str:
        return (
            f"batch {self.batch_size:>4}: {self.step_ms:8.1f} ms/step, {self.decode_tok_s:8.1f} tok/s, "
            f"linears {self.linear_gflop_s:6.1f} GFLOP/s, reads {self.read_gb_s:5.1f} GB/s"
        )


def _linear_weights(model) -> tuple[int, int]:
    """(weights, bytes) of the matmuls a decode step runs: the projections and the head, not
    the embedding table; a quantized layer counts its logical [N, K] and its packed bytes; a
    tied head counts once."""
    import torch

    from pagedllm.layers.embedding import LMHead
    from pagedllm.layers.moe import SparseMoE

    # Routed experts are counted by the step's routing (_expert_weights), not all of them.
    routed = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE) for m in moe.experts.modules()}
    seen: dict[int, tuple[int, int]] = {}  # data pointer -> (numel, bytes)
    for module in model.modules():
        if isinstance(module, LMHead):
            module = module.table_owner()  # a tied head multiplies by the embedding's table
        elif isinstance(module, torch.nn.Embedding) or "Embedding" in type(module).__name__:
            continue
        if id(module) in routed:
            continue
        for key, numel, nbytes in _matmul_weights(module):
            seen[key] = (numel, nbytes)
    return sum(n for n, _ in seen.values()), sum(b for _, b in seen.values())


def _expert_weights(model) -> tuple[int, int]:
    """(weight x token products, bytes read) of the routed experts in the last step, from each
    sparse layer's routing: an expert chosen by n of the batch's tokens runs n rows over its
    weights, which are read once; experts no token chose are not read (layers/moe.py)."""
    from pagedllm.layers.moe import SparseMoE

    products = read = 0
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        if moe.last_routing is None:
            continue
        for e, n in enumerate(moe.last_routing.counts):
            if n:
                numel, nbytes = _linear_weights_of(moe.experts[e])
                products += n * numel
                read += nbytes
    return products, read


def _linear_weights_of(module) -> tuple[int, int]:
    numel = nbytes = 0
    for linear in module.modules():
        for _, n, b in _matmul_weights(linear):
            numel += n
            nbytes += b
    return numel, nbytes


def _matmul_weights(module) -> list[tuple[int, int, int]]:
    """(data pointer, logical weights, bytes) of each weight a module's own matmul reads: its
    quantized weight (`quant`), its GGUF blocks (`blocks`, or the parts in `sections`: a
    fused projection whose parts a file stores in different types), else a float `weight`."""
    import torch

    kept = []
    if getattr(module, "quant", None) is not None:
        kept = [module.quant]
    elif getattr(module, "blocks", None) is not None:
        kept = [module.blocks]
    elif getattr(module, "sections", None):
        kept = [w for _, w in module.sections]
    if kept:
        return [(_data_ptr(w), w.shape[0] * w.shape[1], w.nbytes) for w in kept]
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel():
        return [(weight.data_ptr(), weight.numel(), weight.numel() * weight.element_size())]
    return []


def _data_ptr(weight) -> int:
    # QuantizedWeight keeps its codes in `qweight`, GGUFBlocks its bytes in `data`.
    return (weight.qweight if hasattr(weight, "qweight") else weight.data).data_ptr()


def measure_decode(
    llm, batch_size: int, context_len: int, num_steps: int, seed: int, profile_steps: int = 0
) -> tuple[LatencyResult, StepProfile | None]:
    import numpy as np

    from pagedllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    model_config = engine.model_config
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=num_steps + profile_steps + 4, temperature=0.0, ignore_eos=True, detokenize=False)
    ids = [
        engine.add_request({"prompt_token_ids": rng.integers(100, model_config.vocab_size, context_len).tolist()}, params)
        for _ in range(batch_size)
    ]
    scheduler = engine.scheduler
    # Prefill (chunked as the engine likes), then two untimed decode steps.
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()
    assert len(scheduler.running) == batch_size, "the KV cache cannot hold this batch: raise --kv-cache-memory-bytes"
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    expert_products, expert_bytes = _expert_weights(engine.engine_core.runner.model)  # the last timed step
    profile = None
    if profile_steps:
        profile = StepProfile()
        with profiling(engine, profile) as profiled_step:
            for _ in range(profile_steps):
                profiled_step()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    step_s = float(np.median(times))
    linear_numel, linear_bytes = _linear_weights(engine.engine_core.runner.model)
    itemsize = 4 if model_config.dtype == "float32" else 2  # the KV cache's dtype
    kv_bytes_per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * itemsize
    read_bytes = linear_bytes + expert_bytes + batch_size * (context_len + num_steps // 2) * kv_bytes_per_token
    result = LatencyResult(
        batch_size=batch_size,
        context_len=context_len,
        step_ms=step_s * 1e3,
        decode_tok_s=batch_size / step_s,
        linear_gflop_s=2 * (linear_numel * batch_size + expert_products) / step_s / 1e9,
        read_gb_s=read_bytes / step_s / 1e9,
    )
    return result, profile


def run(args: argparse.Namespace) -> None:
    import os

    from pagedllm.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(args))
    # A short warm-up request pays one-time costs (kernel builds, weight packing).
    llm.generate([{"prompt_token_ids": [100] * 16}], use_tqdm=False)
    dtype = llm.llm_engine.model_config.dtype
    zentorch = os.environ.get("PAGEDLLM_ZENTORCH", "1") != "0"
    print(f"pagedllm decode, {dtype}, zentorch {'allowed' if zentorch else 'off'}, context {args.input_len}:")
    results = []
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        result, profile = measure_decode(
            llm, batch_size, args.input_len, args.num_steps, args.seed, args.num_steps if args.profile else 0
        )
        print(result.summary(), flush=True)
        if profile is not None:
            print(profile.table(), flush=True)
        results.append((result, profile))
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(
                {"model": args.model, "dtype": str(dtype), "zentorch_allowed": zentorch,
                 "results": [
                     {**asdict(r), **({"profile_ms_per_step": p.per_step_ms()} if p is not None else {})}
                     for r, p in results
                 ]},
                f, indent=2,
            )


def add_arguments(lat: argparse.ArgumentParser) -> None:
    lat.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    add_engine_flags(lat)
    lat.add_argument("--batch-sizes", default="1,8,32,128", help="comma-separated, e.g. 1,32")
    lat.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    lat.add_argument("--num-steps", type=int, default=16, help="timed decode steps per batch size")
    lat.add_argument("--profile", action="store_true",
                     help="after timing, profile as many steps again and print where a step's time goes "
                          "(schedule, input preparation, each layer type, attention, sampling, detokenization)")
    lat.add_argument("--save-json", default=None)
