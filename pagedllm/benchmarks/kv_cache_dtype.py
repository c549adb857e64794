"""--kv-cache-dtype: decode step time where attention dominates, KV capacity, and quality.

    pagedllm bench kv-cache-dtype [--batch 64] [--context 2048] [--rounds 3] [--steps 3]

Decode: the default model (Q4_1 weights, float32 activations) decodes one token for each of
--batch requests whose contexts hold --context tokens, the caches filled with random K/V (no
prefill: the step's cost does not depend on the values) in scattered blocks. The KV dtypes alternate round by round
(auto, int8, fp8, ...) on the same model, each round a warm-up step then --steps timed steps;
medians of the whole forward (the compiled decode layers) and of one layer's decode attention
call alone. Capacity: the blocks --kv-cache-memory-bytes buys for each dtype.

Quality (--text-repeats > 0): a fixed text's prompt logprobs for each dtype, prefilled in
chunks of 32 tokens so that every chunk after the first attends over the cached (quantized)
K/V: perplexity, and the largest and mean |logprob - auto's| per token.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

TEXT = (
    "The sun was setting over the hills as the travellers reached the village. They had walked "
    "all day along the river, and their feet ached. An old woman stood at the gate of the first "
    "house and asked where they had come from. They told her about the long road from the city, "
    "the storm that had caught them on the second night, and the bridge that had washed away. "
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,fp8")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kv-cache-memory-bytes", default="4GiB", help="the budget the capacity figures use")
    parser.add_argument("--text-repeats", type=int, default=4, help="TEXT repeated this often (0: no quality run)")


def _fill(caches: list, storage: str, seed: int) -> None:
    """Random unit-normal K/V into every cache, quantized for an 8-bit storage."""
    import torch

    from pagedllm.layers.kv_quant import KV_QUANT_FORMATS, quantize_rows

    g = torch.Generator().manual_seed(seed)
    fmt = KV_QUANT_FORMATS.get(storage)
    for cache in caches:  # [2, num_blocks, bs, Hkv, row]
        if fmt is None:
            cache.normal_(generator=g)
            continue
        raw = cache.view(torch.uint8)
        for start in range(0, cache.shape[1], 512):
            chunk = torch.randn((*cache[:, start : start + 512].shape[:-1], cache.shape[-1] - 4), generator=g)
            raw[:, start : start + 512] = quantize_rows(chunk, fmt).view(torch.uint8)


def _decode(args: argparse.Namespace, dtypes: list[str]) -> None:
    import torch

    from pagedllm.config import parse_bytes, resolve_kv_cache_dtype
    from pagedllm.kernels import paged_attention_ops
    from pagedllm.attention.metadata import AttentionMetadata, forward_context
    from pagedllm.models.loader import load_model
    from pagedllm.kv_backends.paged.worker import allocate_kv_caches, attention_layers, kv_bytes_per_block

    B, L, bs = args.batch, args.context, args.block_size
    loaded = load_model(args.model, dtype="float32", max_model_len=L + 16)
    model, mc = loaded.model, loaded.model_config
    layers = attention_layers(model)
    per_req = -(-(L + 1) // bs)
    num_blocks = B * per_req + 1
    rng = np.random.default_rng(0)
    tables = (rng.permutation(num_blocks - 1)[: B * per_req] + 1).reshape(B, per_req)  # scattered blocks
    block_tables = torch.from_numpy(tables.astype(np.int64))
    slot_mapping = block_tables[:, L // bs] * bs + L % bs  # position L of each request
    md = AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=torch.full((B,), L + 1, dtype=torch.int64),
        query_start_loc=list(range(B + 1)), seq_lens_list=[L + 1] * B, num_decodes=B, block_size=bs,
    )
    input_ids = torch.from_numpy(rng.integers(100, mc.vocab_size, B))
    positions = torch.full((B,), L, dtype=torch.int64)
    q = torch.randn(B, layers[0].num_heads, layers[0].head_dim)
    caches = {}
    for i, d in enumerate(dtypes):
        storage = resolve_kv_cache_dtype(d, mc.dtype)
        caches[d] = allocate_kv_caches(layers, num_blocks, bs, storage)
        _fill(caches[d], storage, i)
    budget = parse_bytes(args.kv_cache_memory_bytes)
    print(f"decode: {args.model} (float32 activations), batch {B}, context {L} tokens, blocks of {bs}; "
          f"{args.rounds} rounds x {args.steps} steps, dtypes alternating", flush=True)
    step_ms: dict[str, list[float]] = {d: [] for d in dtypes}
    attn_ms: dict[str, list[float]] = {d: [] for d in dtypes}
    ops = paged_attention_ops()
    with torch.inference_mode(), forward_context(md):
        for _ in range(args.rounds):
            for d in dtypes:
                for layer, cache in zip(layers, caches[d]):
                    layer.kv_cache = cache
                model(input_ids, positions)  # warm-up (the fused decode rebinds its caches)
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    model(input_ids, positions)
                    step_ms[d].append((time.perf_counter() - t0) * 1e3)
                    if ops is not None:
                        t0 = time.perf_counter()
                        ops.paged_decode_attention(q, caches[d][0], block_tables, md.seq_lens, 0.125, 0, 0.0)
                        attn_ms[d].append((time.perf_counter() - t0) * 1e3)
    base = float(np.median(step_ms[dtypes[0]]))
    base_attn = float(np.median(attn_ms[dtypes[0]])) if ops is not None else float("nan")
    base_blocks = budget // kv_bytes_per_block(mc, bs, None, dtypes[0])
    for d in dtypes:
        ms = float(np.median(step_ms[d]))
        a = float(np.median(attn_ms[d])) if ops is not None else float("nan")
        blocks = budget // kv_bytes_per_block(mc, bs, None, d)
        print(f"  {d:9s} step {ms:8.1f} ms ({base / ms:4.2f}x), {B / ms * 1e3:6.1f} tok/s; one layer's attention "
              f"{a:6.2f} ms ({base_attn / a:4.2f}x); {kv_bytes_per_block(mc, 1, None, d) / 1024:5.1f} KiB/token, "
              f"{blocks} blocks in {args.kv_cache_memory_bytes} ({blocks / base_blocks:4.2f}x)", flush=True)


def _quality(args: argparse.Namespace, dtypes: list[str]) -> None:
    from pagedllm import LLM, SamplingParams

    text = TEXT * args.text_repeats
    results: dict[str, list[float]] = {}
    for d in dtypes:
        llm = LLM(args.model, dtype="float32", kv_cache_dtype=d, max_model_len=2048, kv_cache_memory_bytes="256MiB",
                  max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False)
        [out] = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        ids = out.prompt_token_ids
        results[d] = [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], ids[1:])]
        del llm
    ref = np.array(results[dtypes[0]])
    print(f"quality: prompt logprobs of a fixed text ({len(ref) + 1} tokens), chunks of 32 tokens", flush=True)
    for d in dtypes:
        lp = np.array(results[d])
        drift = np.abs(lp - ref)
        print(f"  {d:9s} perplexity {math.exp(-lp.mean()):7.4f}; |logprob - {dtypes[0]}| max {drift.max():.4f}, "
              f"mean {drift.mean():.5f}", flush=True)


def run(args: argparse.Namespace) -> None:
    dtypes = args.kv_cache_dtypes.split(",")
    _decode(args, dtypes)
    if args.text_repeats > 0:
        _quality(args, dtypes + (["fp8_e5m2"] if "fp8_e5m2" not in dtypes else []))
