"""Benchmarks, one module each, run as `pagedllm bench NAME` (or `python -m pagedllm.benchmarks NAME`).

A benchmark module has two functions: `add_arguments(parser)`, its flags, and `run(args)`,
which measures and prints. Their imports of torch and the engine sit inside the functions,
so building the `pagedllm` parser stays cheap. docs/benchmarks.md keeps the dated figures.
"""

from __future__ import annotations

# `pagedllm bench` subcommand -> (module under pagedllm.benchmarks, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("throughput", "offline throughput on random-token prompts"),
    "latency": ("latency", "decode step time and tokens/s at fixed batch sizes"),
    "embed": ("embed", "embedding texts/s and one short text's latency, optionally against sentence-transformers"),
    "prefix-caching": ("prefix_caching", "shared-prefix workload, prefix caching on vs off"),
    "serve": ("serve", "serving benchmark against an OpenAI-compatible server"),
    "startup": ("startup", "seconds from `pagedllm serve` to healthy and to the first token"),
    "kv-backends": ("kv_backends", "paged KV (two block sizes) against vattention, side by side"),
    "quant-decode": ("quant_decode", "single-stream and batched decode per weight format"),
    "prefill-activations": ("prefill_activations", "prompt processing (pp512): float against int8 prefill activations"),
    "bf16-decode": ("bf16_decode", "bf16 decode: float32-arithmetic linears against torch's bf16 matmul"),
    "beam-search": ("beam_search", "engine beam search against one request per beam per step"),
    "spec-decode": ("spec_decode", "speculative decoding: tokens/s and acceptance per proposer"),
    "structured-outputs": ("structured_outputs", "constrained against unconstrained throughput, compile times"),
    "tensor-parallel": ("tensor_parallel", "decode throughput of TP 1 against TP 2, time in collectives"),
    "kv-transfer": ("kv_transfer", "KV transfer throughput of the ZMQ connector over TCP loopback"),
    "attack": ("attack", "well-behaved streams' outputs, latency and the server's memory while it is attacked"),
    "disagg-itl": ("disagg_itl", "stream inter-token latency during a burst of long prompts (any server)"),
    "random-llama-1b": ("random_llama_1b", "a Llama-3.2-1B-shaped random model against llama.cpp on its own GGUF files"),
    "kv-cache-dtype": ("kv_cache_dtype", "decode step time at long contexts, KV capacity and drift per --kv-cache-dtype"),
    "dashboard-snapshot": ("dashboard_snapshot", "cost of the dashboard's KV snapshot against the step time"),
    "lora": ("lora", "multi-LoRA decode: 0, 1 and 4 adapters in a batch against the merged model"),
    "moe-grouped": ("moe_grouped", "a Qwen3-30B-A3B-shaped MoE layer: the grouped-expert call against the loop"),
    "gguf-matmul": ("gguf_matmul", "the small-M GGUF kernels' weight GB/s against a torch copy, per type and shape"),
}
